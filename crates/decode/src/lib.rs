//! Decoding: Kafka message bytes → typed change records aligned with the table's columns.

pub mod avro;
pub mod canal;
pub mod changelog;
pub mod config;
pub mod debezium;
pub mod fuzzing;
#[cfg(test)]
mod golden;
pub mod maxwell;
pub mod ogg;
pub mod pool;
pub mod registry;
pub mod upsert_json;
mod values;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use serde_json::{Map, Value as Json};

use crate::config::{FormatConfig, FormatKind, TimeUnit};
use inlet_common::error::{Error, Result};
use inlet_iceberg::types::{Type, Value};

pub use values::{convert, FieldHint, LATIN1_BINARY};

/// The kind of change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Insert.
    Create,
    /// Snapshot read of an existing row.
    Read,
    /// Update.
    Update,
    /// Delete.
    Delete,
}

impl Op {
    /// Debezium's one-letter code, stored in changelog tables.
    pub fn code(self) -> &'static str {
        match self {
            Op::Create => "c",
            Op::Read => "r",
            Op::Update => "u",
            Op::Delete => "d",
        }
    }
}

/// A row in table column order.
pub type Row = Vec<Value>;

pub use inlet_common::version::{Version, VersionPart};

/// A decoded change, typed for one table's columns.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangeRecord {
    pub op: Op,
    /// Row before the change, where the format carries it.
    pub before: Option<Row>,
    /// Row after the change; `None` for deletes.
    pub after: Option<Row>,
    /// Upstream order, where the format carries it.
    pub version: Option<Version>,
    /// When the change happened in the source database, in milliseconds since the epoch.
    pub source_ts_ms: Option<i64>,
}

/// The upstream table a change belongs to, as the message names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceTable {
    /// Database (MySQL database, PostgreSQL database, Oracle schema owner).
    pub database: Option<String>,
    /// Schema inside the database (PostgreSQL, SQL Server), where there is one.
    pub schema: Option<String>,
    pub table: String,
}

impl SourceTable {
    /// Whether `pattern` (`database.table`, `schema.table` or `table`; `*` matches any run of
    /// characters) names this table.
    pub fn matches(&self, pattern: &str) -> bool {
        let t = self.table.as_str();
        let mut names = vec![t.to_string()];
        for prefix in [&self.schema, &self.database].into_iter().flatten() {
            names.push(format!("{prefix}.{t}"));
        }
        if let (Some(d), Some(s)) = (&self.database, &self.schema) {
            names.push(format!("{d}.{s}.{t}"));
        }
        names.iter().any(|n| glob(pattern, n))
    }
}

/// `*`-wildcard matching, case-sensitive.
pub fn glob(pattern: &str, text: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == text,
        Some((head, rest)) => {
            let Some(tail) = text.strip_prefix(head) else {
                return false;
            };
            (0..=tail.len())
                .filter(|i| tail.is_char_boundary(*i))
                .any(|i| glob(rest, &tail[i..]))
        }
    }
}

impl fmt::Display for SourceTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for part in [&self.database, &self.schema].into_iter().flatten() {
            write!(f, "{part}.")?;
        }
        f.write_str(&self.table)
    }
}

/// What a message's own schema says about one field.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FieldType {
    /// Logical type name (`io.debezium.time.MicroTimestamp`, `org.apache.kafka.connect.data.Decimal`, ...),
    /// or a format's own encoding marker ([`LATIN1_BINARY`]).
    pub logical: Option<String>,
    /// Physical type name in the message's schema (`int64`, `bytes`, `string`, ...).
    pub connect_type: Option<String>,
    /// Decimal scale.
    pub scale: Option<u32>,
    /// The Iceberg type this field maps to, used for new tables and new columns.
    pub declared: Option<Type>,
    /// The field's place in the schema's field order (the source table's column order).
    pub position: Option<u32>,
}

impl FieldType {
    fn hint(&self) -> FieldHint<'_> {
        FieldHint {
            logical: self.logical.as_deref(),
            connect_type: self.connect_type.as_deref(),
            scale: self.scale,
        }
    }
}

/// Field name → what the message's schema says about it; empty for schemaless messages.
pub type FieldTypes = Arc<FieldMap>;

/// Field name → what the schema says about it. Looked up per column of every change, so the
/// hasher is foldhash rather than SipHash.
pub type FieldMap = HashMap<String, FieldType, foldhash::fast::RandomState>;

/// One image of a row: field name → JSON value, in the message's field order.
pub type Image = Map<String, Json>;

/// A change as the message states it, before it meets a table's columns.
#[derive(Debug, Clone, PartialEq)]
pub struct RawChange {
    pub op: Op,
    /// Upstream table, where the format names it.
    pub source: Option<SourceTable>,
    pub before: Option<Image>,
    pub after: Option<Image>,
    pub fields: FieldTypes,
    pub version: Option<Version>,
    pub source_ts_ms: Option<i64>,
    /// Primary key column names the message states (Debezium key schema, Canal `pkNames`).
    pub key: Vec<String>,
}

impl RawChange {
    /// The image whose fields describe the row's current shape.
    pub fn image(&self) -> Option<&Image> {
        self.after.as_ref().or(self.before.as_ref())
    }

    /// The image's fields in the source's column order: the schema's field order where the
    /// message has a schema, else the image's.
    pub fn fields_in_order(&self) -> Vec<(&String, &Json)> {
        let Some(image) = self.image() else {
            return Vec::new();
        };
        let mut fields: Vec<(&String, &Json)> = image.iter().collect();
        // Stable: fields the schema does not place keep their order, after the placed ones.
        fields.sort_by_key(|(name, _)| {
            self.fields
                .get(*name)
                .and_then(|f| f.position)
                .unwrap_or(u32::MAX)
        });
        fields
    }

    /// Fields of the row that `columns` lack, in the source's order, with the Iceberg type each
    /// maps to. Null-valued fields without a declared type are left out until a value shows
    /// their type.
    pub fn new_fields(&self, columns: &[Column]) -> Vec<(String, Type)> {
        self.fields_in_order()
            .into_iter()
            .filter(|(name, _)| !columns.iter().any(|c| &c.name == *name))
            .filter_map(|(name, value)| {
                let declared = self.fields.get(name).and_then(|f| f.declared);
                declared
                    .or_else(|| infer_type(value))
                    .map(|ty| (name.clone(), ty))
            })
            .collect()
    }
}

/// The Iceberg type a schemaless JSON value suggests; `None` for null.
pub fn infer_type(v: &Json) -> Option<Type> {
    Some(match v {
        Json::Null => return None,
        Json::Bool(_) => Type::Boolean,
        Json::Number(n) if n.is_i64() || n.is_u64() => Type::Long,
        Json::Number(_) => Type::Double,
        Json::String(_) | Json::Array(_) | Json::Object(_) => Type::String,
    })
}

/// What a message decodes to; a message may carry several changes (Canal batches rows).
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded {
    Change(RawChange),
    /// A null-valued message that only lets Kafka compaction drop a deleted key.
    Tombstone,
    /// A message that carries no row change (DDL, heartbeat, transaction marker), by reason.
    Skipped(&'static str),
}

/// A table column as decoders see it.
#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    pub ty: Type,
    pub required: bool,
    /// Unit of integer time values when the message has no schema.
    pub time_unit: TimeUnit,
}

/// Why a record is bad, as the `reason` label of `inlet_bad_records_total`.
pub mod reason {
    /// Not parseable in the configured format (bad JSON, truncated Avro, missing envelope).
    pub const MALFORMED: &str = "malformed";
    /// An operation code the format does not define.
    pub const UNKNOWN_OP: &str = "unknown_op";
    /// A field value that does not convert to its column's type.
    pub const TYPE_MISMATCH: &str = "type_mismatch";
    /// A change the table's schema cannot take and may not evolve to take.
    pub const INCOMPATIBLE_SCHEMA: &str = "incompatible_schema";
    /// An Avro schema id neither the registry nor the schema directory knows.
    pub const UNKNOWN_SCHEMA: &str = "unknown_schema";
    /// An update moves a row to a new primary key whose old key may live in a partition this
    /// instance does not own, so the old row cannot be deleted here.
    pub const KEY_CHANGE_UNOWNED: &str = "key_change_unowned";
    /// A change of a primary key, or a delete of a key another partition's change moved
    /// away, that the format gives no version to order against the old key's other changes
    /// (still to come from its own partition).
    pub const KEY_CHANGE_UNORDERED: &str = "key_change_unordered";
    /// A change would add a partition past `table.max_new_partitions_per_checkpoint`.
    pub const TOO_MANY_PARTITIONS: &str = "too_many_partitions";

    /// A change leaves a column unchanged (Debezium's unavailable-value placeholder, a
    /// TOASTed value PostgreSQL did not send) for a key the table holds no row of to keep it
    /// from.
    pub const UNAVAILABLE_VALUE: &str = "unavailable_value";

    /// A change of an upsert table from a topic other than the one its shards follow.
    pub const OTHER_TOPIC: &str = "other_topic";

    /// Every reason, for series that exist at 0 from the start.
    pub const ALL: [&str; 10] = [
        OTHER_TOPIC,
        TOO_MANY_PARTITIONS,
        UNAVAILABLE_VALUE,
        MALFORMED,
        UNKNOWN_OP,
        TYPE_MISMATCH,
        INCOMPATIBLE_SCHEMA,
        UNKNOWN_SCHEMA,
        KEY_CHANGE_UNOWNED,
        KEY_CHANGE_UNORDERED,
    ];
}

/// The decoder for the configured format.
pub fn decoder_for(format: &FormatConfig, primary_key: &[String]) -> Result<Box<dyn Decoder>> {
    match format.kind {
        FormatKind::DebeziumJson => Ok(Box::new(debezium::DebeziumJson)),
        FormatKind::CanalJson => Ok(Box::new(canal::CanalJson)),
        FormatKind::MaxwellJson => Ok(Box::new(maxwell::MaxwellJson)),
        FormatKind::OggJson => Ok(Box::new(ogg::OggJson)),
        FormatKind::ChangelogJson => Ok(Box::new(changelog::ChangelogJson)),
        FormatKind::UpsertJson => Ok(Box::new(upsert_json::UpsertJson::new(primary_key))),
        FormatKind::DebeziumAvro => Ok(Box::new(avro::DebeziumAvro::new(format)?)),
    }
}

/// Turns a Kafka message into changes. Decoders know the format, not the table.
pub trait Decoder: Send + Sync {
    /// Decodes one message. Errors name the offending field; the caller adds topic, partition
    /// and offset.
    fn decode(&self, key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Vec<Decoded>>;

    /// Decodes a message of one change and types it for `shape` in one go, where the format
    /// reads faster that way than [`Decoder::decode`] then [`Shape::record`]: the change comes
    /// without its images (`before` and `after` are `None`; the record holds the rows). Only
    /// for a change that needs no schema change ([`Shape::needs_change`]); `None` for any
    /// other message, to decode and type the usual way.
    fn decode_typed(
        &self,
        _key: Option<&[u8]>,
        _value: &[u8],
        _shape: &Shape,
    ) -> Option<(RawChange, ChangeRecord)> {
        None
    }
}

/// A table's columns, for typing raw changes.
#[derive(Debug, Clone)]
pub struct Shape {
    columns: Vec<Column>,
    /// The same columns, all nullable: before images often carry only the key (PostgreSQL's
    /// default replica identity) or only the changed fields.
    before_columns: Vec<Column>,
    /// Each column's position by name, for telling a message's new fields at a glance and
    /// for typing images read straight from JSON text.
    names: HashMap<String, usize, foldhash::fast::RandomState>,
}

impl Shape {
    pub fn new(columns: Vec<Column>) -> Shape {
        let before_columns = columns
            .iter()
            .map(|c| Column {
                required: false,
                ..c.clone()
            })
            .collect();
        let names = columns
            .iter()
            .enumerate()
            .map(|(i, c)| (c.name.clone(), i))
            .collect();
        Shape {
            columns,
            before_columns,
            names,
        }
    }

    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    /// Whether the change names a field these columns lack, or declares a type some column
    /// must be widened to: the table's schema changes first, where it follows the source.
    pub fn needs_change(&self, raw: &RawChange) -> bool {
        // What `new_fields` finds, without comparing each field with every column.
        let new_field = |(name, value): (&String, &Json)| {
            !self.names.contains_key(name)
                && (raw.fields.get(name).and_then(|f| f.declared).is_some()
                    || infer_type(value).is_some())
        };
        raw.image().is_some_and(|image| image.iter().any(new_field)) || self.widens(&raw.fields)
    }

    /// Types a raw change for these columns; a field the image lacks is null.
    pub fn record(&self, raw: &RawChange) -> Result<ChangeRecord> {
        Ok(ChangeRecord {
            op: raw.op,
            before: self.row(raw.before.as_ref(), &raw.fields, "before")?,
            after: self.row(raw.after.as_ref(), &raw.fields, "after")?,
            version: raw.version.clone(),
            source_ts_ms: raw.source_ts_ms,
        })
    }

    /// Whether `fields` declare a type some column must be widened to (the second half of
    /// [`Shape::needs_change`]).
    pub fn widens(&self, fields: &FieldTypes) -> bool {
        !fields.is_empty()
            && self.columns.iter().any(|c| {
                fields
                    .get(&c.name)
                    .and_then(|f| f.declared)
                    .is_some_and(|d| inlet_iceberg::widened(c.ty, d))
            })
    }

    /// Types an image given as the JSON text of an object, without building the image: the
    /// row [`Shape::record`] would give for it (`before` for a before image). `None` where it
    /// would not give one, or where the image names a field the table lacks and `new_fields`
    /// would list it (`watch_new`, for the image [`RawChange::image`] returns): the caller then
    /// builds the image and types it the usual way, which names the error.
    pub fn row_from_text(
        &self,
        text: &str,
        fields: &FieldTypes,
        before: bool,
        watch_new: bool,
    ) -> Option<Row> {
        use serde::de::DeserializeSeed;
        let reader = debezium::text::ImageReader {
            names: &self.names,
            fields,
            watch_new,
            columns: self.columns.len(),
        };
        let mut de = serde_json::Deserializer::from_str(text);
        let slots = reader.deserialize(&mut de).ok()?;
        de.end().ok()?;
        let columns = if before {
            &self.before_columns
        } else {
            &self.columns
        };
        // Collected by hand: an `Option` collect cannot size the row up front.
        let mut row = Vec::with_capacity(columns.len());
        for (c, v) in columns.iter().zip(slots) {
            let v = v.unwrap_or(values::Scalar::Null);
            let hint = fields.get(&c.name).map(FieldType::hint).unwrap_or_default();
            row.push(values::convert_scalar(v, c, hint).ok()?);
        }
        Some(row)
    }

    fn row(&self, image: Option<&Image>, fields: &FieldTypes, which: &str) -> Result<Option<Row>> {
        let Some(image) = image else {
            return Ok(None);
        };
        let columns = if which == "before" {
            &self.before_columns
        } else {
            &self.columns
        };
        columns
            .iter()
            .map(|c| {
                let v = image.get(&c.name).unwrap_or(&Json::Null);
                let hint = fields.get(&c.name).map(FieldType::hint).unwrap_or_default();
                convert(v, c, hint).map_err(|why| {
                    let error = Error::decode(format!("{which}.{}: {why}", c.name));
                    if v.is_null() {
                        // A required column the source no longer sends.
                        error.because(reason::INCOMPATIBLE_SCHEMA)
                    } else {
                        error.because(reason::TYPE_MISMATCH)
                    }
                })
            })
            .collect::<Result<Row>>()
            .map(Some)
    }
}

/// Positions of the columns of `row` that hold `placeholder` in any form Debezium sends it:
/// the text itself (text, json, xml, ...), its bytes (bytea), a one-element array of it
/// (arrays, as JSON text) or an object mapping it to itself (hstore as JSON).
pub fn unavailable_columns(row: &[Value], placeholder: &str, out: &mut Vec<u16>) {
    out.clear();
    let p = placeholder.as_bytes();
    for (i, v) in row.iter().enumerate() {
        let hit = match v {
            Value::String(s) => {
                s.as_bytes() == p
                    || (s.len() == p.len() + 4
                        && s.starts_with("[\"")
                        && s.ends_with("\"]")
                        && &s[2..s.len() - 2] == placeholder)
                    || (s.len() == 2 * p.len() + 7
                        && *s == format!("{{\"{placeholder}\":\"{placeholder}\"}}"))
            }
            Value::Binary(b) => b.as_slice() == p,
            _ => false,
        };
        if hit {
            out.push(i as u16);
        }
    }
}

/// "a string", "an object", ... for error messages.
pub fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// Parses a message value that must be one JSON object; `None` for a JSON `null`.
fn json_object(bytes: &[u8]) -> Result<Option<Image>> {
    let doc: Json =
        serde_json::from_slice(bytes).map_err(|e| Error::decode(format!("not JSON: {e}")))?;
    match doc {
        Json::Null => Ok(None),
        Json::Object(o) => Ok(Some(o)),
        other => Err(Error::decode(format!(
            "expected a JSON object, found {}",
            json_kind(&other)
        ))),
    }
}

/// Removes the object-valued field `name`; absent or null is `None`.
fn take_object(doc: &mut Map<String, Json>, name: &str) -> Result<Option<Image>> {
    match doc.remove(name) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Object(o)) => Ok(Some(o)),
        Some(other) => Err(Error::decode(format!(
            "{name}: expected an object, found {}",
            json_kind(&other)
        ))),
    }
}

/// The row before an update from the row after it and the old values of the changed fields
/// (Canal's and Maxwell's `old`).
fn overlay(after: &Image, old: &Image) -> Image {
    let mut before = after.clone();
    for (name, value) in old {
        before.insert(name.clone(), value.clone());
    }
    before
}

/// A string array field (`pkNames`, `primary_keys`) as column names; anything else is none.
fn names(v: Option<&Json>) -> Vec<String> {
    v.and_then(Json::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Json::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// The version component of a MySQL binlog file name: its numeric suffix (`mysql-bin.000012`
/// → 12), else the whole name.
fn binlog_file(file: &str) -> VersionPart {
    file.rsplit('.')
        .next()
        .and_then(|i| i.parse::<i128>().ok())
        .map_or(VersionPart::Text(file.to_string()), VersionPart::Int)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(super) const JSON_FORMATS: [FormatKind; 6] = [
        FormatKind::DebeziumJson,
        FormatKind::CanalJson,
        FormatKind::MaxwellJson,
        FormatKind::OggJson,
        FormatKind::ChangelogJson,
        FormatKind::UpsertJson,
    ];

    fn decoders() -> Vec<Box<dyn Decoder>> {
        JSON_FORMATS
            .into_iter()
            .map(fuzzing::json_decoder)
            .collect()
    }

    /// JSON documents built from the field names the formats look at, with values of any kind.
    fn message() -> impl Strategy<Value = Vec<u8>> {
        let leaf = prop_oneof![
            Just(Json::Null),
            any::<bool>().prop_map(Json::Bool),
            any::<i64>().prop_map(Json::from),
            "[a-zA-Z0-9:.+-]{0,12}".prop_map(Json::String),
            prop::sample::select(vec![
                "INSERT", "UPDATE", "DELETE", "insert", "+I", "-D", "U"
            ])
            .prop_map(Json::from),
        ];
        let value = leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Json::Array),
                prop::collection::btree_map("[a-z]{1,3}|id|old", inner, 0..4)
                    .prop_map(|m| Json::Object(m.into_iter().collect())),
            ]
        });
        let field = prop::sample::select(vec![
            "data",
            "old",
            "type",
            "op",
            "op_type",
            "before",
            "after",
            "isDdl",
            "mysqlType",
            "pkNames",
            "position",
            "xoffset",
            "commit",
            "pos",
            "table",
            "es",
            "ts",
            "payload",
            "schema",
            "source",
        ]);
        prop::collection::btree_map(field, value, 0..8).prop_map(|m| {
            Json::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
                .to_string()
                .into_bytes()
        })
    }

    #[test]
    fn every_json_format_has_a_decoder() {
        assert_eq!(decoders().len(), JSON_FORMATS.len());
    }

    proptest! {
        #[test]
        fn decoders_never_panic(
            value in prop_oneof![message(), prop::collection::vec(any::<u8>(), 0..64)],
            key in prop::option::of(prop_oneof![message(), prop::collection::vec(any::<u8>(), 0..16)]),
        ) {
            for decoder in decoders() {
                let _ = decoder.decode(key.as_deref(), Some(&value));
            }
        }
    }

    /// `needs_change` finds a new field exactly when `new_fields` lists one: a field no column
    /// holds, with a value or a declared type; a null without a type waits for a value.
    #[test]
    fn a_new_field_needs_a_change_once_its_type_shows() {
        let column = |name: &str| Column {
            name: name.into(),
            ty: Type::Long,
            required: false,
            time_unit: TimeUnit::Millis,
        };
        let shape = Shape::new(vec![column("id"), column("n")]);
        let declared: FieldTypes = Arc::new(FieldMap::from_iter([(
            "note".to_string(),
            FieldType {
                declared: Some(Type::String),
                logical: None,
                connect_type: Some("string".into()),
                scale: None,
                position: None,
            },
        )]));
        for (after, fields, expect) in [
            (
                serde_json::json!({"id": 1, "n": 2}),
                FieldTypes::default(),
                false,
            ),
            (serde_json::json!({"id": 1}), FieldTypes::default(), false),
            (
                serde_json::json!({"id": 1, "note": null}),
                FieldTypes::default(),
                false,
            ),
            (
                serde_json::json!({"id": 1, "note": "x"}),
                FieldTypes::default(),
                true,
            ),
            (
                serde_json::json!({"id": 1, "note": null}),
                declared.clone(),
                true,
            ),
            (
                serde_json::json!({"note": null, "id": 1, "n": null}),
                declared,
                true,
            ),
        ] {
            let raw = RawChange {
                op: Op::Create,
                source: None,
                before: None,
                after: after.as_object().cloned(),
                fields,
                version: None,
                source_ts_ms: None,
                key: Vec::new(),
            };
            assert_eq!(shape.needs_change(&raw), expect, "{after}");
            assert_eq!(
                !raw.new_fields(shape.columns()).is_empty(),
                expect,
                "{after}"
            );
        }
    }

    #[test]
    fn source_table_patterns() {
        let pg = SourceTable {
            database: Some("shop".into()),
            schema: Some("public".into()),
            table: "order_items".into(),
        };
        for yes in [
            "order_items",
            "public.order_items",
            "shop.order_items",
            "shop.public.order_items",
            "shop.order_*",
            "*.order_items",
            "*",
            "shop.*_items",
        ] {
            assert!(pg.matches(yes), "{yes}");
        }
        for no in [
            "orders",
            "shop.orders",
            "other.order_items",
            "shop.order",
            "shop.items*",
        ] {
            assert!(!pg.matches(no), "{no}");
        }
    }
}
