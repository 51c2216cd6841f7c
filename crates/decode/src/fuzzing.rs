//! The input layout and table shape shared by the `cargo fuzz` targets in `fuzz/` and the
//! regression test that replays their findings, so an input the fuzzer saved reproduces under
//! `cargo test`.
//!
//! An input is a two-byte header, then the key and the value:
//!
//! - byte 0: the key's length, `0..=253`, cut to what follows; 254: no key, the rest is the value;
//!   255: no value, the rest is the key;
//! - byte 1: how the columns are typed (see [`columns`]);
//! - the rest: key bytes then value bytes.

use std::collections::HashSet;

use super::{decoder_for, Decoded, Decoder, Shape};
use super::{Column, Image};
use crate::config::{FormatConfig, FormatKind, TimeUnit};
use inlet_iceberg::types::Type;

/// Every Iceberg type, with a second decimal at the precision limit.
pub const TYPES: [Type; 13] = [
    Type::Boolean,
    Type::Int,
    Type::Long,
    Type::Float,
    Type::Double,
    Type::Decimal {
        precision: 10,
        scale: 2,
    },
    Type::Decimal {
        precision: 38,
        scale: 0,
    },
    Type::Date,
    Type::Time,
    Type::Timestamp,
    Type::TimestampTz,
    Type::String,
    Type::Binary,
];

/// A key and a value from a fuzz input, and the input's column selector (byte 1).
pub fn split(data: &[u8]) -> (Option<&[u8]>, Option<&[u8]>, u8) {
    let [len, selector, rest @ ..] = data else {
        return (None, None, 0);
    };
    match *len {
        254 => (None, Some(rest), *selector),
        255 => (Some(rest), None, *selector),
        n => {
            let (key, value) = rest.split_at(usize::from(n).min(rest.len()));
            (Some(key), Some(value), *selector)
        }
    }
}

/// The fuzz input for a key and a value (the inverse of [`split`], selector 0); a key longer
/// than 253 bytes is left out.
pub fn seed(key: Option<&[u8]>, value: Option<&[u8]>) -> Vec<u8> {
    let key = key.filter(|k| k.len() <= 253);
    match (key, value) {
        (key, None) => [&[255, 0][..], key.unwrap_or_default()].concat(),
        (None, Some(value)) => [&[254, 0][..], value].concat(),
        (Some(key), Some(value)) => [&[key.len() as u8, 0][..], key, value].concat(),
    }
}

/// The Debezium Avro decoder over the writer schemas in `schemas_dir` (offline, no registry).
pub fn avro_decoder(schemas_dir: &str) -> Box<dyn Decoder> {
    let format = FormatConfig {
        kind: FormatKind::DebeziumAvro,
        schema_registry: None,
        schemas_dir: Some(schemas_dir.to_string()),
        ..FormatConfig::default()
    };
    match decoder_for(&format, &["id".to_string()]) {
        Ok(decoder) => decoder,
        Err(e) => panic!("no Avro decoder over {schemas_dir}: {e}"),
    }
}

/// Columns named after the image's fields in message order, then `c<i>` up to two per type, so
/// every type meets the message's values. Column `i` has type `TYPES[(i + selector) % 13]` and
/// is required when `i + selector / 13` is odd; `selector / 26` picks the time unit.
pub fn columns(images: &[&Image], selector: u8) -> Vec<Column> {
    let mut seen = HashSet::new();
    let names: Vec<&String> = images
        .iter()
        .flat_map(|image| image.keys())
        .filter(|name| seen.insert(*name))
        .collect();
    let wanted = names.len().max(2 * TYPES.len());
    let s = usize::from(selector);
    let time_unit = [TimeUnit::Millis, TimeUnit::Micros, TimeUnit::Nanos][s / 26 % 3];
    (0..wanted)
        .map(|i| Column {
            name: names
                .get(i)
                .map_or_else(|| format!("c{i}"), |n| n.to_string()),
            ty: TYPES[(i + s) % TYPES.len()],
            required: (i + s / TYPES.len()) % 2 == 1,
            time_unit,
        })
        .collect()
}

/// The decoder a JSON format's fuzz target drives, keyed by an `id` primary key.
pub fn json_decoder(kind: FormatKind) -> Box<dyn Decoder> {
    let format = FormatConfig {
        kind,
        ..FormatConfig::default()
    };
    match decoder_for(&format, &["id".to_string()]) {
        Ok(decoder) => decoder,
        Err(e) => panic!("{kind:?} is not a JSON format with a decoder: {e}"),
    }
}

/// Decodes one fuzz input and types every change it yields, the way the pipeline does. The
/// outcome is not checked: only a panic, an overflow or a runaway allocation is a finding.
pub fn exercise(decoder: &dyn Decoder, data: &[u8]) {
    let (key, value, selector) = split(data);
    let Ok(decoded) = decoder.decode(key, value) else {
        return;
    };
    for item in decoded {
        let Decoded::Change(raw) = item else {
            continue;
        };
        let images: Vec<&Image> = raw.before.iter().chain(raw.after.iter()).collect();
        let shape = Shape::new(columns(&images, selector));
        let _ = shape.record(&raw);
        if let Some(value) = value {
            let _ = decoder.decode_typed(key, value, &shape);
        }
        let _ = raw.new_fields(&[]);
        if let Some(version) = &raw.version {
            let _ = version.to_string();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::tests::JSON_FORMATS;

    #[test]
    fn header_splits_key_and_value() {
        assert_eq!(split(b""), (None, None, 0));
        assert_eq!(
            split(b"\x02\x07abcd"),
            (Some(&b"ab"[..]), Some(&b"cd"[..]), 7)
        );
        assert_eq!(split(b"\x09\x00ab"), (Some(&b"ab"[..]), Some(&b""[..]), 0));
        assert_eq!(split(b"\xfe\x01ab"), (None, Some(&b"ab"[..]), 1));
        assert_eq!(split(b"\xff\x01ab"), (Some(&b"ab"[..]), None, 1));
    }

    #[test]
    fn columns_cover_every_type_required_and_optional() {
        for selector in [0, 1, 13, 255] {
            let columns = columns(&[], selector);
            for ty in TYPES {
                for required in [false, true] {
                    assert!(
                        columns.iter().any(|c| c.ty == ty && c.required == required),
                        "selector {selector}: no {} {ty} column",
                        if required { "required" } else { "optional" }
                    );
                }
            }
        }
    }

    /// Every input a fuzz target found a crash with, replayed through every JSON decoder.
    #[test]
    fn fuzz_regressions_do_not_panic() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/fuzz-regressions");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(
            !files.is_empty(),
            "no regression inputs in {}",
            dir.display()
        );
        for path in files {
            let data = std::fs::read(&path).unwrap();
            for kind in JSON_FORMATS {
                let outcome =
                    std::panic::catch_unwind(|| exercise(json_decoder(kind).as_ref(), &data));
                assert!(outcome.is_ok(), "{}: {kind:?} panicked", path.display());
            }
        }
    }
}
