//! Debezium change events as JSON, with the Kafka Connect `schema`/`payload` envelope or
//! without it. The envelope's schema, when present, names logical types (dates, timestamps,
//! decimals) so values convert exactly; without it the table's column types and `time_unit`
//! decide.

pub(crate) mod text;

use std::sync::Arc;

use serde_json::{Map, Value as Json};

use super::{binlog_file, reason, Version, VersionPart};
use super::{
    json_kind, ChangeRecord, Decoded, Decoder, FieldMap, FieldType, FieldTypes, Op, RawChange,
};
use super::{Shape, SourceTable};
use inlet_common::error::{Error, Result};
use inlet_iceberg::types::Type;

/// Decodes Debezium JSON.
#[derive(Debug, Default)]
pub struct DebeziumJson;

/// Field types from the `before`/`after` struct of a Connect envelope schema.
pub fn field_types(schema: &Json) -> FieldMap {
    let mut out = FieldMap::default();
    let Some(fields) = schema.get("fields").and_then(Json::as_array) else {
        return out;
    };
    let image = fields
        .iter()
        .filter(|f| {
            matches!(
                f.get("field").and_then(Json::as_str),
                Some("after" | "before")
            )
        })
        .find_map(|f| f.get("fields").and_then(Json::as_array));
    for (position, f) in image.into_iter().flatten().enumerate() {
        let Some(name) = f.get("field").and_then(Json::as_str) else {
            continue;
        };
        let parameter = |key: &str| {
            f.get("parameters").and_then(|p| p.get(key)).and_then(|s| {
                s.as_str()
                    .and_then(|s| s.parse().ok())
                    .or_else(|| s.as_u64().map(|v| v as u32))
            })
        };
        let logical = f.get("name").and_then(Json::as_str);
        let connect_type = f.get("type").and_then(Json::as_str);
        let scale = parameter("scale");
        out.insert(
            name.to_string(),
            FieldType {
                declared: connect_iceberg_type(
                    connect_type,
                    logical,
                    scale,
                    parameter("connect.decimal.precision"),
                ),
                logical: logical.map(str::to_string),
                connect_type: connect_type.map(str::to_string),
                scale,
                position: Some(position as u32),
            },
        );
    }
    out
}

/// The Iceberg type of a Kafka Connect / Debezium field type.
pub fn connect_iceberg_type(
    connect_type: Option<&str>,
    logical: Option<&str>,
    scale: Option<u32>,
    precision: Option<u32>,
) -> Option<Type> {
    let by_logical = match logical {
        // Iceberg's decimal holds 38 digits: a wider column (MySQL's decimal(65,30),
        // PostgreSQL's numeric(50,10)) keeps each value's exact text instead.
        Some("org.apache.kafka.connect.data.Decimal")
            if precision.is_some_and(|p| p > 38) || scale.is_some_and(|s| s > 38) =>
        {
            Some(Type::String)
        }
        Some("org.apache.kafka.connect.data.Decimal") => {
            let scale = scale.unwrap_or(0) as u8;
            let precision = precision.unwrap_or(38).clamp(scale.max(1) as u32, 38) as u8;
            Some(Type::Decimal { precision, scale })
        }
        Some("io.debezium.time.Date" | "org.apache.kafka.connect.data.Date") => Some(Type::Date),
        Some(
            "io.debezium.time.Timestamp"
            | "io.debezium.time.MicroTimestamp"
            | "io.debezium.time.NanoTimestamp"
            | "org.apache.kafka.connect.data.Timestamp",
        ) => Some(Type::Timestamp),
        Some("io.debezium.time.ZonedTimestamp") => Some(Type::TimestampTz),
        Some(
            "io.debezium.time.Time"
            | "io.debezium.time.MicroTime"
            | "io.debezium.time.NanoTime"
            | "org.apache.kafka.connect.data.Time",
        ) => Some(Type::Time),
        // A numeric without scale: each value has its own scale and up to 131,072 digits, so
        // no Iceberg number holds them all; its exact text does, as the database prints it.
        Some("io.debezium.data.VariableScaleDecimal") => Some(Type::String),
        _ => None,
    };
    by_logical.or(match connect_type? {
        "int8" | "int16" | "int32" => Some(Type::Int),
        "int64" => Some(Type::Long),
        "float" | "float32" => Some(Type::Float),
        "double" | "float64" => Some(Type::Double),
        "boolean" => Some(Type::Boolean),
        "string" => Some(Type::String),
        "bytes" => Some(Type::Binary),
        _ => None,
    })
}

/// The source position Debezium records: MySQL binlog (file index, position, row), Postgres
/// LSN, SQL Server change LSN; other connectors carry none.
pub fn source_version(source: &Map<String, Json>) -> Option<Version> {
    version_of(|k| source.get(k))
}

/// [`source_version`] over the `source` block's fields as `field` finds them.
pub(super) fn version_of<'a>(field: impl Fn(&str) -> Option<&'a Json>) -> Option<Version> {
    let int = |k: &str| {
        field(k)
            .and_then(Json::as_i64)
            .map(|v| VersionPart::Int(v as i128))
    };
    if let Some(file) = field("file").and_then(Json::as_str) {
        let index = binlog_file(file);
        let pos = int("pos")?;
        return Some(Version(vec![
            index,
            pos,
            int("row").unwrap_or(VersionPart::Int(0)),
        ]));
    }
    if let Some(lsn) = int("lsn") {
        return Some(Version(vec![lsn]));
    }
    if let Some(lsn) = field("change_lsn").and_then(Json::as_str) {
        return Some(Version(vec![VersionPart::Text(lsn.to_string())]));
    }
    None
}

/// The upstream table named by a Debezium `source` block.
pub fn source_table(source: &Map<String, Json>) -> Option<SourceTable> {
    table_of(|k| source.get(k))
}

/// [`source_table`] over the `source` block's fields as `field` finds them.
pub(super) fn table_of<'a>(field: impl Fn(&str) -> Option<&'a Json>) -> Option<SourceTable> {
    let text = |k: &str| field(k).and_then(Json::as_str).map(str::to_string);
    Some(SourceTable {
        database: text("db"),
        schema: text("schema"),
        table: text("table")?,
    })
}

/// Key column names from the Kafka key: the fields of its payload (or of the bare object).
fn key_columns(key: Option<&[u8]>) -> Vec<String> {
    let Some(doc) = key.and_then(|k| serde_json::from_slice::<Json>(k).ok()) else {
        return Vec::new();
    };
    let object = match doc.get("payload") {
        Some(Json::Object(p)) if doc.get("schema").is_some() => p,
        _ => match &doc {
            Json::Object(o) => o,
            _ => return Vec::new(),
        },
    };
    object.keys().cloned().collect()
}

/// Debezium's messages that change no row, by the reason they are skipped: heartbeats
/// (`{"ts_ms"}` on `__debezium-heartbeat.<prefix>`), transaction metadata (`status` BEGIN or
/// END on `<prefix>.transaction`), schema changes (`ddl`/`tableChanges` on `<prefix>`),
/// PostgreSQL's logical decoding messages (`op: m`) and truncates (`op: t`, which a table
/// sync skips and counts rather than empty the table). A topic pattern that matches these
/// topics costs nothing but their reading.
pub fn control_message(payload: &Map<String, Json>) -> Option<&'static str> {
    match payload.get("op").and_then(Json::as_str) {
        Some("t") => return Some("truncate"),
        Some("m") => return Some("message"),
        Some(_) => return None,
        None => {}
    }
    if payload.contains_key("ddl") || payload.contains_key("tableChanges") {
        return Some("ddl");
    }
    let status = payload.get("status").and_then(Json::as_str);
    if matches!(status, Some("BEGIN" | "END")) && payload.contains_key("id") {
        return Some("transaction");
    }
    if payload.contains_key("ts_ms") && payload.len() == 1 {
        return Some("heartbeat");
    }
    None
}

/// The change a Debezium envelope payload (`op`, `before`, `after`, `source`, `ts_ms`) states,
/// whatever the encoding it arrived in.
pub fn envelope_change(
    mut payload: Map<String, Json>,
    fields: FieldTypes,
    key: Vec<String>,
) -> Result<RawChange> {
    let op = match payload.get("op").and_then(Json::as_str) {
        Some("c") => Op::Create,
        Some("r") => Op::Read,
        Some("u") => Op::Update,
        Some("d") => Op::Delete,
        Some(other) => {
            return Err(Error::decode(format!(
                "op: unknown operation \"{other}\"; expected c, r, u or d"
            ))
            .because(reason::UNKNOWN_OP))
        }
        None => {
            return Err(Error::decode(
                "op: missing; this is not a Debezium change event (events flattened by ExtractNewRecordState are not supported)",
            ))
        }
    };
    let mut image = |name: &str| -> Result<Option<Map<String, Json>>> {
        match payload.remove(name) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Object(o)) => Ok(Some(o)),
            Some(other) => Err(Error::decode(format!(
                "{name}: expected an object, found {}",
                json_kind(&other)
            ))),
        }
    };
    let before = image("before")?;
    let after = image("after")?;
    match op {
        Op::Delete if before.is_none() => {
            return Err(Error::decode("before: a delete event needs the before image (set REPLICA IDENTITY or include the key columns)"))
        }
        Op::Create | Op::Read | Op::Update if after.is_none() => {
            return Err(Error::decode(format!("after: missing for op \"{}\"", op.code())))
        }
        _ => {}
    }
    let source = payload.get("source").and_then(Json::as_object);
    let source_ts_ms = source
        .and_then(|s| s.get("ts_ms"))
        .or_else(|| payload.get("ts_ms"))
        .and_then(Json::as_i64);
    Ok(RawChange {
        op,
        source: source.and_then(source_table),
        before,
        after,
        fields,
        version: source.and_then(source_version),
        source_ts_ms,
        key,
    })
}

impl Decoder for DebeziumJson {
    fn decode(&self, key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Vec<Decoded>> {
        let Some(bytes) = value else {
            return Ok(vec![Decoded::Tombstone]);
        };
        match text::decode(key, bytes) {
            Some(decoded) => Ok(decoded),
            None => decode_tree(key, bytes),
        }
    }

    fn decode_typed(
        &self,
        key: Option<&[u8]>,
        value: &[u8],
        shape: &Shape,
    ) -> Option<(RawChange, ChangeRecord)> {
        text::decode_typed(key, value, shape)
    }
}

/// Decodes a message through a JSON tree of the whole of it: every message the text reader
/// leaves, errors included.
pub(super) fn decode_tree(key: Option<&[u8]>, bytes: &[u8]) -> Result<Vec<Decoded>> {
    let doc: Json =
        serde_json::from_slice(bytes).map_err(|e| Error::decode(format!("not JSON: {e}")))?;
    let (payload, schema) = match doc {
        Json::Object(mut o) if o.contains_key("payload") && o.contains_key("schema") => {
            (o.remove("payload").unwrap_or_default(), o.remove("schema"))
        }
        other => (other, None),
    };
    let payload = match payload {
        Json::Null => return Ok(vec![Decoded::Tombstone]),
        Json::Object(o) => o,
        other => {
            return Err(Error::decode(format!(
                "expected a JSON object, found {}",
                json_kind(&other)
            )))
        }
    };
    if let Some(why) = control_message(&payload) {
        return Ok(vec![Decoded::Skipped(why)]);
    }
    let fields: FieldTypes = Arc::new(schema.as_ref().map(field_types).unwrap_or_default());
    envelope_change(payload, fields, key_columns(key)).map(|c| vec![Decoded::Change(c)])
}

#[cfg(test)]
mod tests {
    #[test]
    fn golden_cases() {
        crate::golden::run("debezium", &super::DebeziumJson);
    }
}
