//! Debezium change events as JSON, with the Kafka Connect `schema`/`payload` envelope or
//! without it. The envelope's schema, when present, names logical types (dates, timestamps,
//! decimals) so values convert exactly; without it the table's column types and `time_unit`
//! decide.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{Map, Value as Json};

use super::{json_kind, Decoded, Decoder, FieldType, FieldTypes, Op, RawChange, SourceTable};
use super::{reason, Version, VersionPart};
use crate::error::{Error, Result};
use crate::table::types::Type;

/// Decodes Debezium JSON.
#[derive(Debug, Default)]
pub struct DebeziumJson;

/// Field types from the `before`/`after` struct of a Connect envelope schema.
pub fn field_types(schema: &Json) -> HashMap<String, FieldType> {
    let mut out = HashMap::new();
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
    for f in image.into_iter().flatten() {
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
        Some("org.apache.kafka.connect.data.Decimal") => {
            let scale = scale.unwrap_or(0).min(38) as u8;
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
        // Scale varies per value: a double keeps every value readable.
        Some("io.debezium.data.VariableScaleDecimal") => Some(Type::Double),
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
    let int = |k: &str| {
        source
            .get(k)
            .and_then(Json::as_i64)
            .map(|v| VersionPart::Int(v as i128))
    };
    if let Some(file) = source.get("file").and_then(Json::as_str) {
        let index = file
            .rsplit('.')
            .next()
            .and_then(|i| i.parse::<i128>().ok())
            .map_or(VersionPart::Text(file.to_string()), VersionPart::Int);
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
    if let Some(lsn) = source.get("change_lsn").and_then(Json::as_str) {
        return Some(Version(vec![VersionPart::Text(lsn.to_string())]));
    }
    None
}

/// The upstream table named by a Debezium `source` block.
pub fn source_table(source: &Map<String, Json>) -> Option<SourceTable> {
    let text = |k: &str| source.get(k).and_then(Json::as_str).map(str::to_string);
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
        let fields: FieldTypes = Arc::new(schema.as_ref().map(field_types).unwrap_or_default());
        envelope_change(payload, fields, key_columns(key)).map(|c| vec![Decoded::Change(c)])
    }
}

#[cfg(test)]
pub(crate) mod golden {
    //! Golden cases in `tests/golden/debezium/`: each file holds a message, the table's columns
    //! and the expected change record (or error).

    use super::*;
    use crate::config::TimeUnit;
    use crate::decode::{Column, Row, Shape};
    use crate::table::transform::human_value;
    use crate::table::types::{Type, Value};
    use serde_json::json;

    /// A typed value as the golden files spell it.
    pub(crate) fn canonical(v: &Value) -> Json {
        let micros = |us: i64| {
            let t = chrono::DateTime::from_timestamp_micros(us).unwrap();
            t.naive_utc().format("%Y-%m-%dT%H:%M:%S%.6f").to_string()
        };
        match v {
            Value::Null => Json::Null,
            Value::Boolean(b) => json!(b),
            Value::Int(x) => json!(x),
            Value::Long(x) => json!(x),
            Value::Float(x) => json!(x),
            Value::Double(x) => json!(x),
            Value::Decimal(x) => json!(x.to_string()),
            Value::Timestamp(us) => json!(micros(*us)),
            Value::TimestampTz(us) => json!(format!("{}Z", micros(*us))),
            _ => json!(human_value(v)),
        }
    }

    /// A typed row as the golden files spell it.
    pub(crate) fn row_json(columns: &[Column], row: &Option<Row>) -> Json {
        match row {
            None => Json::Null,
            Some(r) => Json::Object(
                columns
                    .iter()
                    .zip(r)
                    .map(|(c, v)| (c.name.clone(), canonical(v)))
                    .collect(),
            ),
        }
    }

    /// The table columns of a golden case.
    pub(crate) fn columns(case: &Json) -> Vec<Column> {
        case["columns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| Column {
                name: c["name"].as_str().unwrap().into(),
                ty: Type::parse(c["type"].as_str().unwrap()).unwrap(),
                required: c["required"].as_bool().unwrap_or(false),
                time_unit: serde_json::from_value(
                    c.get("time_unit").cloned().unwrap_or(json!("millis")),
                )
                .unwrap_or(TimeUnit::Millis),
            })
            .collect()
    }

    #[test]
    fn golden_cases() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/debezium");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(
            files.len() >= 10,
            "golden cases missing in {}",
            dir.display()
        );
        for path in files {
            let case: Json =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let columns = columns(&case);
            let value = match &case["value"] {
                Json::Null => None,
                v => Some(v.to_string().into_bytes()),
            };
            let key = match &case["key"] {
                Json::Null => None,
                v => Some(v.to_string().into_bytes()),
            };
            let shape = Shape::new(columns.clone());
            let got = DebeziumJson
                .decode(key.as_deref(), value.as_deref())
                .and_then(|mut all| {
                    assert_eq!(all.len(), 1, "{name}: one change per message");
                    match all.remove(0) {
                        Decoded::Change(raw) => shape.record(&raw).map(Some),
                        Decoded::Tombstone => Ok(None),
                        Decoded::Skipped(why) => panic!("{name}: skipped ({why})"),
                    }
                });
            let expect = &case["expect"];
            if let Some(want) = expect.get("error_contains").and_then(Json::as_str) {
                let err = got.expect_err(&name).to_string();
                assert!(err.contains(want), "{name}: error {err:?} lacks {want:?}");
                continue;
            }
            if expect.get("tombstone").is_some() {
                assert_eq!(got.unwrap(), None, "{name}: tombstone");
                continue;
            }
            let Some(rec) = got.unwrap_or_else(|e| panic!("{name}: {e}")) else {
                panic!("{name}: expected a change, got a tombstone")
            };
            assert_eq!(json!(rec.op.code()), expect["op"], "{name}: op");
            assert_eq!(
                row_json(&columns, &rec.before),
                expect["before"],
                "{name}: before"
            );
            assert_eq!(
                row_json(&columns, &rec.after),
                expect["after"],
                "{name}: after"
            );
            assert_eq!(
                rec.version.map_or(Json::Null, |v| json!(v.to_string())),
                expect["version"],
                "{name}: version"
            );
            assert_eq!(
                rec.source_ts_ms.map_or(Json::Null, |v| json!(v)),
                expect["source_ts_ms"],
                "{name}: ts"
            );
        }
    }
}
