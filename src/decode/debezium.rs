//! Debezium change events as JSON, with the Kafka Connect `schema`/`payload` envelope or
//! without it. The envelope's schema, when present, names logical types (dates, timestamps,
//! decimals) so values convert exactly; without it the table's column types and `time_unit`
//! decide.

use std::collections::HashMap;

use serde_json::{Map, Value as Json};

use super::values::{convert, FieldHint};
use super::{ChangeRecord, Column, Decoded, Decoder, Op, Row, Version, VersionPart};
use crate::error::{Error, Result};

/// Decodes Debezium JSON.
pub struct DebeziumJson {
    columns: Vec<Column>,
    /// The same columns, all nullable: before images of PostgreSQL deletes under the default
    /// replica identity carry only the key.
    before_columns: Vec<Column>,
}

impl DebeziumJson {
    /// A decoder producing rows for `columns`.
    pub fn new(columns: Vec<Column>) -> Self {
        let before_columns = columns
            .iter()
            .map(|c| Column {
                required: false,
                ..c.clone()
            })
            .collect();
        DebeziumJson {
            columns,
            before_columns,
        }
    }

    fn row(
        &self,
        image: &Map<String, Json>,
        hints: &HashMap<&str, FieldHint<'_>>,
        which: &str,
    ) -> Result<Row> {
        let columns = if which == "before" {
            &self.before_columns
        } else {
            &self.columns
        };
        columns
            .iter()
            .map(|c| {
                let v = image.get(&c.name).unwrap_or(&Json::Null);
                let hint = hints.get(c.name.as_str()).copied().unwrap_or_default();
                convert(v, c, hint)
                    .map_err(|why| Error::decode(format!("{which}.{}: {why}", c.name)))
            })
            .collect()
    }
}

/// Field hints from the `before`/`after` struct of a Connect envelope schema.
fn field_hints(schema: &Json) -> HashMap<&str, FieldHint<'_>> {
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
        let scale = f
            .get("parameters")
            .and_then(|p| p.get("scale"))
            .and_then(|s| {
                s.as_str()
                    .and_then(|s| s.parse().ok())
                    .or_else(|| s.as_u64().map(|v| v as u32))
            });
        out.insert(
            name,
            FieldHint {
                logical: f.get("name").and_then(Json::as_str),
                connect_type: f.get("type").and_then(Json::as_str),
                scale,
            },
        );
    }
    out
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

impl Decoder for DebeziumJson {
    fn decode(&self, _key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Decoded> {
        let Some(bytes) = value else {
            return Ok(Decoded::Tombstone);
        };
        let doc: Json =
            serde_json::from_slice(bytes).map_err(|e| Error::decode(format!("not JSON: {e}")))?;
        let (payload, schema) = match &doc {
            Json::Object(o) if o.contains_key("payload") && o.contains_key("schema") => {
                (&o["payload"], Some(&o["schema"]))
            }
            _ => (&doc, None),
        };
        let payload = match payload {
            Json::Null => return Ok(Decoded::Tombstone),
            Json::Object(o) => o,
            other => {
                return Err(Error::decode(format!(
                    "expected a JSON object, found {}",
                    type_name(other)
                )))
            }
        };
        let op = match payload.get("op").and_then(Json::as_str) {
            Some("c") => Op::Create,
            Some("r") => Op::Read,
            Some("u") => Op::Update,
            Some("d") => Op::Delete,
            Some(other) => return Err(Error::decode(format!("op: unknown operation \"{other}\"; expected c, r, u or d"))),
            None => {
                return Err(Error::decode(
                    "op: missing; this is not a Debezium change event (events flattened by ExtractNewRecordState are not supported)",
                ))
            }
        };
        let hints = schema.map(field_hints).unwrap_or_default();
        let image = |name: &str| -> Result<Option<Row>> {
            match payload.get(name) {
                None | Some(Json::Null) => Ok(None),
                Some(Json::Object(o)) => self.row(o, &hints, name).map(Some),
                Some(other) => Err(Error::decode(format!(
                    "{name}: expected an object, found {}",
                    type_name(other)
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
        Ok(Decoded::Change(ChangeRecord {
            op,
            before,
            after,
            version: source.and_then(source_version),
            source_ts_ms,
        }))
    }
}

fn type_name(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

#[cfg(test)]
mod golden {
    //! Golden cases in `tests/golden/debezium/`: each file holds a message, the table's columns
    //! and the expected change record (or error).

    use super::*;
    use crate::config::TimeUnit;
    use crate::table::transform::human_value;
    use crate::table::types::{Type, Value};
    use serde_json::json;

    fn canonical(v: &Value) -> Json {
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

    fn row_json(columns: &[Column], row: &Option<Row>) -> Json {
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
            let columns: Vec<Column> = case["columns"]
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
                .collect();
            let value = match &case["value"] {
                Json::Null => None,
                v => Some(v.to_string().into_bytes()),
            };
            let key = match &case["key"] {
                Json::Null => None,
                v => Some(v.to_string().into_bytes()),
            };
            let got = DebeziumJson::new(columns.clone()).decode(key.as_deref(), value.as_deref());
            let expect = &case["expect"];
            if let Some(want) = expect.get("error_contains").and_then(Json::as_str) {
                let err = got.expect_err(&name).to_string();
                assert!(err.contains(want), "{name}: error {err:?} lacks {want:?}");
                continue;
            }
            if expect.get("tombstone").is_some() {
                assert_eq!(got.unwrap(), Decoded::Tombstone, "{name}");
                continue;
            }
            let Decoded::Change(rec) = got.unwrap_or_else(|e| panic!("{name}: {e}")) else {
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
