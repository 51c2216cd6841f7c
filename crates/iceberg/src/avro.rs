//! A minimal Avro binary encoder and object-container writer. Manifests are written by hand so
//! the header carries the Iceberg schema exactly as the spec prints it, with every `field-id`,
//! `element-id` and `logicalType: map` annotation readers rely on. Reading goes through
//! `apache-avro`, which resolves whatever schema the writer (any engine) used.

/// Appends Avro binary encodings to a buffer.
#[derive(Default)]
pub struct Encoder {
    pub buf: Vec<u8>,
}

impl Encoder {
    /// Zig-zag varint `long` (also used for `int`).
    pub fn long(&mut self, v: i64) {
        let mut n = ((v << 1) ^ (v >> 63)) as u64;
        while n >= 0x80 {
            self.buf.push((n as u8) | 0x80);
            n >>= 7;
        }
        self.buf.push(n as u8);
    }

    /// Length-prefixed bytes.
    pub fn bytes(&mut self, b: &[u8]) {
        self.long(b.len() as i64);
        self.buf.extend_from_slice(b);
    }

    /// Length-prefixed UTF-8.
    pub fn string(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }

    /// A boolean.
    pub fn boolean(&mut self, b: bool) {
        self.buf.push(u8::from(b));
    }

    /// A `["null", T]` union: the branch index, then `T` if present.
    pub fn optional<T>(&mut self, v: Option<T>, f: impl FnOnce(&mut Self, T)) {
        match v {
            None => self.long(0),
            Some(v) => {
                self.long(1);
                f(self, v);
            }
        }
    }

    /// An array written as one block followed by the end marker.
    pub fn array<T>(
        &mut self,
        items: impl ExactSizeIterator<Item = T>,
        mut f: impl FnMut(&mut Self, T),
    ) {
        if items.len() > 0 {
            self.long(items.len() as i64);
            for item in items {
                f(self, item);
            }
        }
        self.long(0);
    }
}

/// An Avro object container file (null codec) holding `records`, each already encoded.
pub fn container(schema_json: &str, metadata: &[(&str, String)], records: &[Vec<u8>]) -> Vec<u8> {
    let mut e = Encoder::default();
    e.buf.extend_from_slice(b"Obj\x01");
    let mut meta: Vec<(&str, &[u8])> = vec![
        ("avro.schema", schema_json.as_bytes()),
        ("avro.codec", b"null"),
    ];
    meta.extend(metadata.iter().map(|(k, v)| (*k, v.as_bytes())));
    e.long(meta.len() as i64);
    for (k, v) in meta {
        e.string(k);
        e.bytes(v);
    }
    e.long(0);
    let sync = *uuid::Uuid::new_v4().as_bytes();
    e.buf.extend_from_slice(&sync);
    if !records.is_empty() {
        e.long(records.len() as i64);
        e.long(records.iter().map(Vec::len).sum::<usize>() as i64);
        for r in records {
            e.buf.extend_from_slice(r);
        }
        e.buf.extend_from_slice(&sync);
    }
    e.buf
}

/// The metadata map of an object container file's header (`avro.schema`, `avro.codec` and
/// user keys), exactly as written.
pub fn header_metadata(file: &[u8]) -> Option<std::collections::BTreeMap<String, Vec<u8>>> {
    fn read_long(b: &[u8], pos: &mut usize) -> Option<i64> {
        let (mut n, mut shift) = (0u64, 0);
        loop {
            let byte = *b.get(*pos)?;
            *pos += 1;
            n |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Some((n >> 1) as i64 ^ -((n & 1) as i64));
            }
            shift += 7;
            if shift > 63 {
                return None;
            }
        }
    }
    fn read_bytes(b: &[u8], pos: &mut usize) -> Option<Vec<u8>> {
        let len = usize::try_from(read_long(b, pos)?).ok()?;
        let out = b.get(*pos..*pos + len)?.to_vec();
        *pos += len;
        Some(out)
    }
    if file.get(..4)? != b"Obj\x01" {
        return None;
    }
    let mut pos = 4;
    let mut out = std::collections::BTreeMap::new();
    loop {
        let mut count = read_long(file, &mut pos)?;
        if count == 0 {
            return Some(out);
        }
        if count < 0 {
            count = -count;
            read_long(file, &mut pos)?; // the block's size in bytes
        }
        for _ in 0..count {
            let key = String::from_utf8(read_bytes(file, &mut pos)?).ok()?;
            out.insert(key, read_bytes(file, &mut pos)?);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_varints_match_the_avro_spec() {
        let enc = |v| {
            let mut e = Encoder::default();
            e.long(v);
            e.buf
        };
        assert_eq!(enc(0), vec![0x00]);
        assert_eq!(enc(-1), vec![0x01]);
        assert_eq!(enc(1), vec![0x02]);
        assert_eq!(enc(-64), vec![0x7f]);
        assert_eq!(enc(64), vec![0x80, 0x01]);
    }

    #[test]
    fn apache_avro_reads_what_we_write() {
        let schema = r#"{"type":"record","name":"r","fields":[
            {"name":"a","type":"long","field-id":1},
            {"name":"b","type":["null","string"],"field-id":2},
            {"name":"c","type":{"type":"array","items":"int","element-id":4},"field-id":3}]}"#;
        let mut records = Vec::new();
        for i in 0..3i64 {
            let mut e = Encoder::default();
            e.long(i * 1000 - 1);
            e.optional((i % 2 == 0).then_some("x"), |e, s| e.string(s));
            e.array([1i64, 2].into_iter(), |e, v| e.long(v));
            records.push(e.buf);
        }
        let bytes = container(schema, &[("k", "v".into())], &records);
        let reader = apache_avro::Reader::new(&bytes[..]).unwrap();
        assert_eq!(reader.user_metadata().get("k").unwrap(), b"v");
        let values: Vec<_> = reader.map(|r| r.unwrap()).collect();
        assert_eq!(values.len(), 3);
        let apache_avro::types::Value::Record(fields) = &values[2] else {
            panic!()
        };
        assert_eq!(fields[0].1, apache_avro::types::Value::Long(1999));
    }
}
