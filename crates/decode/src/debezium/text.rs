//! Debezium JSON read straight from the message text, for the messages a pipeline sees all
//! day: the envelope, its `source` block and the Kafka key become the change without a JSON
//! tree of their own; only the row images are built as JSON objects, which is what the change
//! holds. Whatever this path does not take as given (an error, an unusual shape) it leaves to
//! the tree-based decoder in [`super`], whose results and error messages stay the
//! reference; a test holds the two equal.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use serde::de::{Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value as Json};

use super::{field_types, table_of, version_of};
use crate::values::Scalar;
use crate::{ChangeRecord, Decoded, FieldTypes, Op, RawChange, Shape};

/// What the message decodes to, or `None` where the tree-based decoder must decide.
pub(super) fn decode(key: Option<&[u8]>, value: &[u8]) -> Option<Vec<Decoded>> {
    let doc: Document = read_object(value)?;
    let Some((payload, fields)) = doc.payload() else {
        return Some(vec![Decoded::Tombstone]);
    };
    let change = RawChange {
        before: image(payload.before)?,
        after: image(payload.after)?,
        ..change(payload, fields, key)?
    };
    complete(&change).then(|| vec![Decoded::Change(change)])
}

/// The message's change typed for `shape` straight from the text, without its images: the
/// change's `before` and `after` are `None`, and the record holds them. `None` where the
/// message is anything else than a change [`Shape::record`] types without question and that
/// needs no schema change ([`Shape::needs_change`]).
pub(super) fn decode_typed(
    key: Option<&[u8]>,
    value: &[u8],
    shape: &Shape,
) -> Option<(RawChange, ChangeRecord)> {
    let doc: Document = read_object(value)?;
    let (payload, fields) = doc.payload()?;
    if shape.widens(&fields) {
        return None;
    }
    let (before, after) = (object_text(payload.before)?, object_text(payload.after)?);
    let row = |text: Option<&str>, before: bool, watch_new: bool| match text {
        None => Some(None),
        Some(text) => shape
            .row_from_text(text, &fields, before, watch_new)
            .map(Some),
    };
    let record_before = row(before, true, after.is_none())?;
    let record_after = row(after, false, true)?;
    let change = change(payload, fields.clone(), key)?;
    let complete = match change.op {
        Op::Delete => record_before.is_some(),
        Op::Create | Op::Read | Op::Update => record_after.is_some(),
    };
    if !complete {
        return None;
    }
    let record = ChangeRecord {
        op: change.op,
        before: record_before,
        after: record_after,
        version: change.version.clone(),
        source_ts_ms: change.source_ts_ms,
    };
    Some((change, record))
}

/// An image's text where it is an object; `Some(None)` for none; `None` for anything else.
fn object_text(image: Option<&RawValue>) -> Option<Option<&str>> {
    match image.map(RawValue::get) {
        None | Some("null") => Some(None),
        Some(text) if text.starts_with('{') => Some(Some(text)),
        Some(_) => None,
    }
}

/// The change of a payload, its images aside; `None` without a known operation.
fn change(payload: &Payload<'_>, fields: FieldTypes, key: Option<&[u8]>) -> Option<RawChange> {
    let source = payload.source.as_ref();
    let source_ts_ms = source
        .and_then(|s| s.ts_ms.as_ref())
        .or(payload.ts_ms.as_ref())
        .and_then(Json::as_i64);
    Some(RawChange {
        op: payload.op?,
        source: source.and_then(|s| table_of(|k| s.get(k))),
        before: None,
        after: None,
        fields,
        version: source.and_then(|s| version_of(|k| s.get(k))),
        source_ts_ms,
        key: key_columns(key)?,
    })
}

/// Whether the change has the image its operation needs (else the tree-based decoder names
/// what is missing).
fn complete(change: &RawChange) -> bool {
    match change.op {
        Op::Delete => change.before.is_some(),
        Op::Create | Op::Read | Op::Update => change.after.is_some(),
    }
}

/// An image as the change holds it: absent or null is none; anything but an object is for
/// the tree-based decoder to reject.
fn image(text: Option<&RawValue>) -> Option<Option<Map<String, Json>>> {
    let Some(text) = text else {
        return Some(None);
    };
    match serde_json::from_str(text.get()).ok()? {
        Json::Null => Some(None),
        Json::Object(o) => Some(Some(o)),
        _ => None,
    }
}

/// Key column names from the Kafka key: the fields of its `payload` where a `schema` comes
/// with it, else of the key object itself; sorted, as the tree-based decoder gives them.
/// `None` for a key that is not a JSON object.
fn key_columns(key: Option<&[u8]>) -> Option<Vec<String>> {
    let Some(key) = key else {
        return Some(Vec::new());
    };
    let doc: KeyDocument = read_object(key)?;
    let names = match doc.payload {
        Some(Json::Object(payload)) if doc.schema => payload.into_iter().map(|(k, _)| k).collect(),
        _ => doc.names.into_iter().collect(),
    };
    Some(names)
}

/// The fields of a payload the change is made of; the images as their JSON text.
#[derive(Default)]
struct Payload<'a> {
    op: Option<Op>,
    before: Option<&'a RawValue>,
    after: Option<&'a RawValue>,
    source: Option<Source>,
    ts_ms: Option<Json>,
}

/// The top-level object: a Connect envelope (`schema` and `payload`) or the payload itself.
#[derive(Default)]
struct Document<'a> {
    fields: Payload<'a>,
    /// The schema's text: a topic's messages repeat it, so its field types are read once
    /// ([`schema_fields`]).
    schema: Option<&'a RawValue>,
    /// `Some(None)`: a `payload` of JSON null.
    payload: Option<Option<Payload<'a>>>,
}

impl<'a> Document<'a> {
    /// The payload and the field types its schema declares; `None` for a null payload (a
    /// tombstone).
    fn payload(&self) -> Option<(&Payload<'a>, FieldTypes)> {
        let (payload, schema) = match (&self.payload, self.schema) {
            (Some(None), Some(_)) => return None,
            (Some(Some(payload)), Some(schema)) => (payload, Some(schema)),
            _ => (&self.fields, None),
        };
        Some((payload, schema_fields(schema)))
    }
}

/// Schemas a decoding thread has read, by their text: most topics send one or a few.
const SCHEMAS_KEPT: usize = 64;

type SchemaCache = HashMap<Box<str>, FieldTypes, foldhash::fast::RandomState>;

thread_local! {
    static SCHEMAS: std::cell::RefCell<SchemaCache> = Default::default();
    static NO_SCHEMA: FieldTypes = Default::default();
}

/// The field types a schema declares (none without one), read once per schema text on this
/// thread; parsing the schema of every message cost more than the rest of decoding it.
fn schema_fields(schema: Option<&RawValue>) -> FieldTypes {
    let Some(schema) = schema else {
        return NO_SCHEMA.with(Arc::clone);
    };
    SCHEMAS.with(|cache| {
        let mut cache = cache.borrow_mut();
        if let Some(fields) = cache.get(schema.get()) {
            return fields.clone();
        }
        let tree: Json = serde_json::from_str(schema.get()).unwrap_or(Json::Null);
        let fields = Arc::new(field_types(&tree));
        if cache.len() >= SCHEMAS_KEPT {
            // A topic whose schema changes often: start over rather than grow.
            cache.clear();
        }
        cache.insert(schema.get().into(), fields.clone());
        fields
    })
}

/// The fields of a `source` block that versions and routing read.
#[derive(Default)]
struct Source {
    file: Option<Json>,
    pos: Option<Json>,
    row: Option<Json>,
    lsn: Option<Json>,
    change_lsn: Option<Json>,
    ts_ms: Option<Json>,
    db: Option<Json>,
    schema: Option<Json>,
    table: Option<Json>,
}

impl Source {
    fn get(&self, name: &str) -> Option<&Json> {
        match name {
            "file" => self.file.as_ref(),
            "pos" => self.pos.as_ref(),
            "row" => self.row.as_ref(),
            "lsn" => self.lsn.as_ref(),
            "change_lsn" => self.change_lsn.as_ref(),
            "ts_ms" => self.ts_ms.as_ref(),
            "db" => self.db.as_ref(),
            "schema" => self.schema.as_ref(),
            "table" => self.table.as_ref(),
            _ => None,
        }
    }

    fn slot(&mut self, name: &str) -> Option<&mut Option<Json>> {
        Some(match name {
            "file" => &mut self.file,
            "pos" => &mut self.pos,
            "row" => &mut self.row,
            "lsn" => &mut self.lsn,
            "change_lsn" => &mut self.change_lsn,
            "ts_ms" => &mut self.ts_ms,
            "db" => &mut self.db,
            "schema" => &mut self.schema,
            "table" => &mut self.table,
            _ => return None,
        })
    }
}

/// The Kafka key's field names, and its `payload` and whether a `schema` came with it.
#[derive(Default)]
struct KeyDocument {
    names: BTreeSet<String>,
    schema: bool,
    payload: Option<Json>,
}

/// A field name read without allocating where the text holds it unescaped.
struct Name<'a>(std::borrow::Cow<'a, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Name<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Name<'de>, E> {
                Ok(Name(v.into()))
            }
            fn visit_str<E>(self, v: &str) -> Result<Name<'de>, E> {
                Ok(Name(v.to_string().into()))
            }
        }
        d.deserialize_str(V)
    }
}

/// An operation code; anything but `c`, `r`, `u` or `d` is for the tree-based decoder.
struct OpCode(Op);

impl<'de> Deserialize<'de> for OpCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = OpCode;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("c, r, u or d")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OpCode, E> {
                Ok(OpCode(match v {
                    "c" => Op::Create,
                    "r" => Op::Read,
                    "u" => Op::Update,
                    "d" => Op::Delete,
                    _ => return Err(E::custom("unknown operation")),
                }))
            }
        }
        d.deserialize_str(V)
    }
}

/// Reads an image's fields into one slot per column (a later field of the same name wins, as
/// in a JSON object), for [`crate::Shape::row_from_text`]. Fails on a field the table lacks
/// that `new_fields` would list, when `watch_new`.
pub(crate) struct ImageReader<'s> {
    pub names: &'s HashMap<String, usize, foldhash::fast::RandomState>,
    pub fields: &'s FieldTypes,
    pub watch_new: bool,
    pub columns: usize,
}

impl<'de> DeserializeSeed<'de> for ImageReader<'_> {
    type Value = Vec<Option<Scalar<'de>>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ImageReader<'_> {
    type Value = Vec<Option<Scalar<'de>>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a row image")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut slots = vec![None; self.columns];
        while let Some(Name(name)) = map.next_key()? {
            let value: Scalar<'de> = map.next_value()?;
            match self.names.get(&*name) {
                Some(&i) => slots[i] = Some(value),
                None if self.watch_new
                    && (!value.is_null()
                        || self.fields.get(&*name).and_then(|f| f.declared).is_some()) =>
                {
                    return Err(serde::de::Error::custom("a field the table lacks"));
                }
                None => {}
            }
        }
        Ok(slots)
    }
}

/// A field's value, its string borrowed from the text where it is unescaped; arrays and
/// objects as `serde_json` reads them.
impl<'de> Deserialize<'de> for Scalar<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Scalar<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> Result<Scalar<'de>, E> {
                Ok(Scalar::Null)
            }
            fn visit_none<E>(self) -> Result<Scalar<'de>, E> {
                Ok(Scalar::Null)
            }
            fn visit_bool<E>(self, v: bool) -> Result<Scalar<'de>, E> {
                Ok(Scalar::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar<'de>, E> {
                Ok(Scalar::I64(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar<'de>, E> {
                Ok(Scalar::U64(v))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Scalar<'de>, E> {
                Ok(Scalar::F64(v))
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Scalar<'de>, E> {
                Ok(Scalar::Str(v.into()))
            }
            fn visit_str<E>(self, v: &str) -> Result<Scalar<'de>, E> {
                Ok(Scalar::Str(v.to_string().into()))
            }
            fn visit_string<E>(self, v: String) -> Result<Scalar<'de>, E> {
                Ok(Scalar::Str(v.into()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<Scalar<'de>, A::Error> {
                Json::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
                    .map(Scalar::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Scalar<'de>, A::Error> {
                Json::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(Scalar::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// A type filled in place from a JSON object's entries ([`Fill`]).
trait Fields<'de> {
    /// What the object is, for errors.
    const WHAT: &'static str;

    /// Reads the value of the entry `name`; `false` for an entry it does not keep.
    fn entry<A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error>;
}

/// `text` read as a JSON object into a `T`; `None` for anything else.
fn read_object<'de, T: Fields<'de> + Default>(text: &'de [u8]) -> Option<T> {
    let mut value = T::default();
    let mut json = serde_json::Deserializer::from_slice(text);
    Fill(&mut value).deserialize(&mut json).ok()?;
    json.end().ok()?;
    Some(value)
}

/// Fills a value in place from a JSON object. A change event's parts are a few hundred bytes
/// each: built on their own, returned and moved into the part that holds them, their copies
/// were a tenth of decoding.
struct Fill<'t, T>(&'t mut T);

impl<'de, T: Fields<'de>> DeserializeSeed<'de> for Fill<'_, T> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        struct V<'t, T>(&'t mut T);
        impl<'de, T: Fields<'de>> Visitor<'de> for V<'_, T> {
            type Value = ();
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(T::WHAT)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
                while let Some(Name(name)) = map.next_key()? {
                    if !self.0.entry(&name, &mut map)? {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(())
            }
        }
        d.deserialize_map(V(self.0))
    }
}

/// An envelope's `payload`, filled in place: `Some(None)` for JSON null.
struct NullablePayload<'t, 'a>(&'t mut Option<Option<Payload<'a>>>);

impl<'de> DeserializeSeed<'de> for NullablePayload<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        struct V<'t, 'a>(&'t mut Option<Option<Payload<'a>>>);
        impl<'de> Visitor<'de> for V<'_, 'de> {
            type Value = ();
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a Debezium payload or null")
            }
            fn visit_none<E>(self) -> Result<(), E> {
                *self.0 = Some(None);
                Ok(())
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                // A repeated entry replaces the one before it, as in a JSON tree.
                let payload = self.0.insert(Some(Payload::default()));
                Fill(payload.get_or_insert_default()).deserialize(d)
            }
        }
        d.deserialize_option(V(self.0))
    }
}

impl<'de> Fields<'de> for Payload<'de> {
    const WHAT: &'static str = "a Debezium payload";

    fn entry<A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
        match name {
            "op" => self.op = Some(map.next_value::<OpCode>()?.0),
            "before" => self.before = Some(map.next_value()?),
            "after" => self.after = Some(map.next_value()?),
            "source" => map.next_value_seed(Fill(self.source.insert(Source::default())))?,
            "ts_ms" => self.ts_ms = Some(map.next_value()?),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

impl<'de> Fields<'de> for Document<'de> {
    const WHAT: &'static str = "a Debezium change event";

    fn entry<A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
        match name {
            "schema" => self.schema = Some(map.next_value()?),
            "payload" => map.next_value_seed(NullablePayload(&mut self.payload))?,
            other => return self.fields.entry(other, map),
        }
        Ok(true)
    }
}

impl<'de> Fields<'de> for Source {
    const WHAT: &'static str = "a source block";

    fn entry<A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
        let Some(slot) = self.slot(name) else {
            return Ok(false);
        };
        *slot = Some(map.next_value()?);
        Ok(true)
    }
}

impl<'de> Fields<'de> for KeyDocument {
    const WHAT: &'static str = "a key object";

    fn entry<A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
        match name {
            "payload" => self.payload = Some(map.next_value()?),
            "schema" => {
                self.schema = true;
                map.next_value::<IgnoredAny>()?;
            }
            _ => {
                map.next_value::<IgnoredAny>()?;
            }
        }
        self.names.insert(name.to_string());
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use serde_json::{Map, Value as Json};

    use super::super::decode_tree;
    use super::{decode, decode_typed};
    use crate::config::TimeUnit;
    use crate::{fuzzing, Column, Decoded, RawChange, Shape};
    use inlet_iceberg::types::{Type, Value};

    /// Messages of every shape the tests know: the golden cases, the fuzz seeds and edge
    /// cases of the text itself.
    fn corpus() -> Vec<(Option<Vec<u8>>, Vec<u8>)> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut out = Vec::new();
        let seeds = root.join("../../fuzz/seeds/decode_debezium");
        for entry in std::fs::read_dir(&seeds).expect("fuzz seeds") {
            let data = std::fs::read(entry.expect("seed").path()).expect("seed");
            let (key, value, _) = fuzzing::split(&data);
            if let Some(value) = value {
                out.push((key.map(<[u8]>::to_vec), value.to_vec()));
            }
        }
        let source = json!({"connector": "mysql", "db": "shop", "table": "orders",
                            "file": "mysql-bin.000003", "pos": 1234, "row": 2, "ts_ms": 17});
        let row =
            json!({"id": 7, "name": "a\"b\\u00e9", "n": 1.5e3, "nested": {"x": [1, {"y": null}]}});
        let texts = [
            json!({"op": "c", "after": row, "source": source, "ts_ms": 5}).to_string(),
            json!({"op": "u", "before": row, "after": row, "source": {"lsn": 99, "ts_ms": "x"}, "ts_ms": 5}).to_string(),
            json!({"op": "d", "before": {"id": 1}, "after": null, "source": {"change_lsn": "00:01"}}).to_string(),
            json!({"schema": {"type": "struct", "fields": [{"field": "after", "fields": [{"field": "id", "type": "int64"}]}]},
                   "payload": {"op": "r", "after": {"id": 1}, "source": {"table": "t", "schema": "s"}}}).to_string(),
            json!({"schema": null, "payload": {"op": "c", "after": {"id": 1}}}).to_string(),
            json!({"schema": {}, "payload": null}).to_string(),
            json!({"payload": {"op": "c", "after": {"id": 1}}, "op": "c", "after": {"id": 2}}).to_string(),
            json!({"op": "c", "after": {"id": 1}, "source": null}).to_string(),
            json!({"op": "c", "after": {"id": 1}, "source": "mysql"}).to_string(),
            json!({"op": "c", "after": [1]}).to_string(),
            json!({"op": "x", "after": {"id": 1}}).to_string(),
            json!({"op": 1, "after": {"id": 1}}).to_string(),
            json!({"op": "d", "after": {"id": 1}}).to_string(),
            json!({"op": "u", "before": {"id": 1}}).to_string(),
            json!({"after": {"id": 1}}).to_string(),
            json!({"op": "c", "after": {"id": 1}, "ts_ms": 1.5}).to_string(),
            json!({"op": "c", "after": {"id": 1}, "source": {"file": "binlog", "row": 1}}).to_string(),
            r#"{"op":"c","after":{"id":1},"after":{"id":2},"op":"u","before":null}"#.to_string(),
            r#"{"\u006fp":"c","aft\u0065r":{"i\u0064":1},"source":{"l\u0073n":5}}"#.to_string(),
            r#" { "op" : "r" , "after" : { "id" : 1 } } "#.to_string(),
            // A repeated entry replaces the one before it, whole.
            r#"{"op":"c","after":{"id":1},"source":{"lsn":5},"source":{"table":"t"}}"#.to_string(),
            r#"{"schema":{},"payload":{"op":"c","after":{"id":1}},"payload":null}"#.to_string(),
            r#"{"schema":{},"payload":null,"payload":{"op":"c","after":{"id":1},"source":{"lsn":3}}}"#.to_string(),
            r#"{"schema":{},"payload":{"op":"c","after":{"id":1},"ts_ms":4},"payload":{"op":"u","after":{"id":2}}}"#.to_string(),
            r#"{"op":"c","after":{"id":1}} x"#.to_string(),
            "[1,2]".to_string(),
            "null".to_string(),
            "\"text\"".to_string(),
            String::new(),
        ];
        let keys: [Option<&str>; 8] = [
            None,
            Some(r#"{"id": 7}"#),
            Some(r#"{"b": 1, "a": 2, "b": 3}"#),
            Some(r#"{"schema": {"type": "struct"}, "payload": {"id": 7, "tenant": "x"}}"#),
            Some(r#"{"schema": null, "payload": 7}"#),
            Some(r#"{"payload": {"id": 7}}"#),
            Some(r#"{"schema": {}, "payload": {"id": 7}, "payload": {"tenant": "x"}}"#),
            Some("not json"),
        ];
        for text in texts {
            for key in keys {
                out.push((
                    key.map(|k| k.as_bytes().to_vec()),
                    text.clone().into_bytes(),
                ));
            }
        }
        out
    }

    /// Where the text reader decodes a message, it decodes it exactly as the tree-based
    /// decoder does; it leaves every message that decoder rejects (to name the error); and it
    /// takes the everyday shapes itself. Every prefix of every message and a sweep of single
    /// byte changes are checked too.
    #[test]
    fn the_text_reader_agrees_with_the_tree() {
        let mut taken = 0;
        let mut checked = 0;
        let mut check = |key: Option<&[u8]>, value: &[u8]| {
            checked += 1;
            if let Some(fast) = decode(key, value) {
                taken += 1;
                let tree = decode_tree(key, value).ok();
                assert_eq!(
                    tree.as_ref(),
                    Some(&fast),
                    "key {:?}, value {:?}",
                    key.map(String::from_utf8_lossy),
                    String::from_utf8_lossy(value)
                );
            }
        };
        let corpus = corpus();
        for (key, value) in &corpus {
            check(key.as_deref(), value);
            for cut in (0..value.len()).step_by(7) {
                check(key.as_deref(), &value[..cut]);
            }
            for at in (0..value.len()).step_by(11) {
                for byte in [b'"', b'{', b'}', b'0', b'n', b',', b':', b'\\'] {
                    let mut changed = value.clone();
                    changed[at] = byte;
                    check(key.as_deref(), &changed);
                }
            }
        }
        assert!(checked > 10_000, "only {checked} messages checked");
        assert!(
            taken > corpus.len() / 2,
            "the text reader took {taken} of {checked}"
        );
    }

    /// Where a message is typed straight from its text, the record is what decoding in full
    /// then typing gives, the change is the full change without its images, and the change
    /// needs no schema change; over the same corpus and changes as above, each typed for
    /// shapes of every column type, and for a shape that lacks some of the message's fields.
    #[test]
    fn typing_from_the_text_agrees_with_the_tree() {
        let mut taken = 0;
        let mut checked = 0;
        let mut check = |key: Option<&[u8]>, value: &[u8], shape: &Shape| {
            checked += 1;
            let Some((raw, record)) = decode_typed(key, value, shape) else {
                return;
            };
            taken += 1;
            let context = || {
                format!(
                    "key {:?}, value {:?}, columns {:?}",
                    key.map(String::from_utf8_lossy),
                    String::from_utf8_lossy(value),
                    shape.columns()
                )
            };
            let Ok(mut tree) = decode_tree(key, value) else {
                panic!("typed, but the tree rejects it: {}", context());
            };
            let Some(Decoded::Change(full)) = tree.pop() else {
                panic!("typed, but the tree finds no change: {}", context());
            };
            assert!(!shape.needs_change(&full), "{}", context());
            assert_eq!(shape.record(&full).ok(), Some(record), "{}", context());
            let without_images = RawChange {
                before: None,
                after: None,
                ..full
            };
            assert_eq!(without_images, raw, "{}", context());
        };
        let corpus = corpus();
        for (key, value) in &corpus {
            let Ok(decoded) = decode_tree(key.as_deref(), value) else {
                continue;
            };
            let Some(Decoded::Change(full)) = decoded.first() else {
                continue;
            };
            let images: Vec<&Map<String, Json>> =
                full.before.iter().chain(full.after.iter()).collect();
            let mut shapes: Vec<Shape> = [0, 5, 11, 13, 30, 40]
                .into_iter()
                .map(|selector| Shape::new(fuzzing::columns(&images, selector)))
                .collect();
            let narrow = fuzzing::columns(&images, 2).into_iter().take(1).collect();
            shapes.push(Shape::new(narrow));
            for shape in &shapes {
                check(key.as_deref(), value, shape);
                for at in (0..value.len()).step_by(13) {
                    for byte in [b'"', b'}', b'1', b'n', b','] {
                        let mut changed = value.clone();
                        changed[at] = byte;
                        check(key.as_deref(), &changed, shape);
                    }
                }
            }
        }
        assert!(checked > 10_000, "only {checked} messages checked");
        assert!(taken > 100, "typed from the text {taken} of {checked}");
    }

    /// A field the table lacks is left to the usual way (which changes the table's schema)
    /// when it has a value or its schema declares a type; a null of no declared type is not.
    #[test]
    fn new_fields_are_not_typed_from_the_text() {
        let column = Column {
            name: "id".into(),
            ty: Type::Long,
            required: false,
            time_unit: TimeUnit::Millis,
        };
        let shape = Shape::new(vec![column]);
        let declared = json!({"type": "struct", "fields": [{"field": "after", "fields": [
            {"field": "id", "type": "int64"}, {"field": "note", "type": "string", "optional": true}]}]});
        for (value, typed) in [
            (json!({"op": "c", "after": {"id": 1, "note": null}}), true),
            (json!({"op": "c", "after": {"id": 1, "note": "x"}}), false),
            (
                json!({"schema": declared, "payload": {"op": "c", "after": {"id": 1, "note": null}}}),
                false,
            ),
            (json!({"op": "d", "before": {"id": 1, "note": "x"}}), false),
            (
                json!({"op": "u", "before": {"id": 1, "note": "x"}, "after": {"id": 1}}),
                true,
            ),
        ] {
            let got = decode_typed(None, value.to_string().as_bytes(), &shape);
            assert_eq!(got.is_some(), typed, "{value}");
        }
    }

    /// The shapes a pipeline sees all day go the fast way: a flat envelope, a Connect envelope
    /// with its schema, and the keys of both kinds.
    #[test]
    fn everyday_messages_take_the_text_path() {
        let flat = json!({"before": null, "after": {"id": 1, "status": "paid"}, "op": "u", "ts_ms": 5,
                          "source": {"connector": "postgresql", "lsn": 5, "ts_ms": 5}});
        let wrapped = json!({"schema": {"type": "struct", "fields": []}, "payload": flat});
        let column = |name: &str, ty: Type| Column {
            name: name.into(),
            ty,
            required: false,
            time_unit: TimeUnit::Millis,
        };
        let shape = Shape::new(vec![
            column("id", Type::Long),
            column("status", Type::String),
        ]);
        for value in [flat, wrapped] {
            for key in [r#"{"id": 1}"#, r#"{"schema": {}, "payload": {"id": 1}}"#] {
                let decoded = decode(Some(key.as_bytes()), value.to_string().as_bytes());
                assert!(decoded.is_some(), "{value} with key {key} left to the tree");
                let typed =
                    decode_typed(Some(key.as_bytes()), value.to_string().as_bytes(), &shape);
                assert!(
                    typed.is_some(),
                    "{value} with key {key} not typed from the text"
                );
            }
        }
    }

    /// Schemas are read once per text and kept by it: messages of two schemas that differ
    /// only in a field's unit, taking turns, and more schemas than are kept, each type their
    /// field by their own schema.
    #[test]
    fn each_schema_types_its_own_messages() {
        let shape = Shape::new(vec![Column {
            name: "at".into(),
            ty: Type::TimestampTz,
            required: false,
            time_unit: TimeUnit::Millis,
        }]);
        let message = |logical: &str, tag: usize| {
            json!({"schema": {"type": "struct", "name": format!("v{tag}"), "fields": [
                    {"field": "after", "fields": [{"field": "at", "type": "int64", "name": logical}]}]},
                   "payload": {"op": "c", "after": {"at": 5}}})
            .to_string()
        };
        let units = [
            ("io.debezium.time.Timestamp", 5_000),
            ("io.debezium.time.MicroTimestamp", 5),
        ];
        for tag in 0..3 * super::SCHEMAS_KEPT {
            let (logical, micros) = units[tag % 2];
            for tag in [tag % 2, tag] {
                let (_, record) = decode_typed(None, message(logical, tag).as_bytes(), &shape)
                    .expect("typed from the text");
                let after = record.after.expect("an after image");
                assert_eq!(
                    after,
                    vec![Value::TimestampTz(micros)],
                    "{logical}, schema {tag}"
                );
            }
        }
    }
}
