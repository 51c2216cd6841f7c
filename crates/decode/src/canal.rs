//! Canal's flat JSON messages: one binlog rows event of one table per message, its rows in
//! `data` (the row after an insert or update, the deleted row for a delete), the old values of
//! each updated row's changed fields in `old`, column types in `mysqlType`, key columns in
//! `pkNames`. Every value arrives as text (null as JSON null); `mysqlType` says what the text
//! means.
//!
//! No version: `es`, the only position-like field, is the binlog event time, which MySQL keeps
//! in whole seconds, and `id` is a batch number shared by many messages. A version built from
//! them ties for two changes of one row within a second, and the upsert engine drops a change
//! whose version does not exceed the row's. Without a version the Kafka offset orders changes,
//! which is the binlog order for a key-partitioned topic; rows of one message never share a
//! key, since one statement changes a row once.

use std::sync::Arc;

use serde_json::{Map, Value as Json};

use super::{json_kind, json_object, names, overlay, reason, Decoded, Decoder, FieldType};
use super::{FieldMap, FieldTypes, Image, Op, RawChange, SourceTable, LATIN1_BINARY};
use inlet_common::error::{Error, Result};
use inlet_iceberg::types::Type;

/// Decodes Canal flat JSON.
#[derive(Debug, Default)]
pub struct CanalJson;

/// The Iceberg type of a MySQL column type as Canal writes it (`int(11)`, `bigint(20) unsigned`,
/// `decimal(10,2)`, `VARCHAR(255)`); `None` for types without a fitting Iceberg type.
pub fn mysql_iceberg_type(mysql_type: &str) -> Option<Type> {
    let t = mysql_type.trim().to_ascii_lowercase();
    let base = t.split(['(', ' ']).next().unwrap_or_default();
    let unsigned = t.contains("unsigned");
    let params: Vec<u32> = t
        .split_once('(')
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(inside, _)| {
            inside
                .split(',')
                .filter_map(|p| p.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default();
    Some(match base {
        "tinyint" if params.first() == Some(&1) && !unsigned => Type::Boolean,
        "bool" | "boolean" => Type::Boolean,
        "tinyint" | "smallint" | "mediumint" | "year" => Type::Int,
        "int" | "integer" if unsigned => Type::Long,
        "int" | "integer" => Type::Int,
        // The unsigned range exceeds a long.
        "bigint" if unsigned => Type::Decimal {
            precision: 20,
            scale: 0,
        },
        "bigint" => Type::Long,
        "float" => Type::Float,
        "double" | "real" => Type::Double,
        "decimal" | "numeric" | "dec" | "fixed" => {
            let precision = params.first().copied().unwrap_or(10);
            let scale = params.get(1).copied().unwrap_or(0);
            // MySQL allows 65 digits, Iceberg 38: text keeps every digit.
            if precision > 38 || scale > precision {
                return Some(Type::String);
            }
            Type::Decimal {
                precision: precision as u8,
                scale: scale as u8,
            }
        }
        "date" => Type::Date,
        // Canal writes both as local text without an offset.
        "datetime" | "timestamp" => Type::Timestamp,
        "time" => Type::Time,
        "char" | "varchar" | "tinytext" | "text" | "mediumtext" | "longtext" | "enum" | "set"
        | "json" => Type::String,
        "binary" | "varbinary" | "tinyblob" | "blob" | "mediumblob" | "longblob" => Type::Binary,
        _ => return None,
    })
}

fn field_types(mysql_types: Option<&Json>) -> FieldTypes {
    let Some(types) = mysql_types.and_then(Json::as_object) else {
        return FieldTypes::default();
    };
    let fields: FieldMap = types
        .iter()
        .filter_map(|(name, t)| {
            let declared = mysql_iceberg_type(t.as_str()?)?;
            Some((
                name.clone(),
                FieldType {
                    // Canal turns binary values into text one character per byte.
                    logical: (declared == Type::Binary).then(|| LATIN1_BINARY.to_string()),
                    declared: Some(declared),
                    ..FieldType::default()
                },
            ))
        })
        .collect();
    Arc::new(fields)
}

/// The rows of an array field, each an object.
fn rows(doc: &mut Map<String, Json>, name: &str) -> Result<Option<Vec<Image>>> {
    let rows = match doc.remove(name) {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Array(rows)) => rows,
        Some(other) => {
            return Err(Error::decode(format!(
                "{name}: expected an array of rows, found {}",
                json_kind(&other)
            )))
        }
    };
    rows.into_iter()
        .enumerate()
        .map(|(i, row)| match row {
            Json::Object(o) => Ok(o),
            other => Err(Error::decode(format!(
                "{name}[{i}]: expected an object, found {}",
                json_kind(&other)
            ))),
        })
        .collect::<Result<_>>()
        .map(Some)
}

impl Decoder for CanalJson {
    fn decode(&self, _key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Vec<Decoded>> {
        let Some(bytes) = value else {
            return Ok(vec![Decoded::Tombstone]);
        };
        let Some(mut doc) = json_object(bytes)? else {
            return Ok(vec![Decoded::Tombstone]);
        };
        if doc.get("isDdl").and_then(Json::as_bool) == Some(true) {
            return Ok(vec![Decoded::Skipped("ddl")]);
        }
        let op = match doc.get("type").and_then(Json::as_str) {
            Some("INSERT") => Op::Create,
            Some("UPDATE") => Op::Update,
            Some("DELETE") => Op::Delete,
            // Canal's other event types carry no rows.
            Some(
                "CREATE" | "ALTER" | "ERASE" | "QUERY" | "TRUNCATE" | "RENAME" | "CINDEX"
                | "DINDEX",
            ) => return Ok(vec![Decoded::Skipped("ddl")]),
            Some("GTID" | "XACOMMIT" | "XAROLLBACK") => {
                return Ok(vec![Decoded::Skipped("transaction")])
            }
            Some("MHEARTBEAT") => return Ok(vec![Decoded::Skipped("heartbeat")]),
            Some(other) => {
                return Err(Error::decode(format!(
                    "type: unknown event type \"{other}\"; expected INSERT, UPDATE or DELETE"
                ))
                .because(reason::UNKNOWN_OP))
            }
            None => return Err(Error::decode("type: missing; this is not a Canal message")),
        };
        let data = rows(&mut doc, "data")?
            .ok_or_else(|| Error::decode("data: missing; a row event needs its rows"))?;
        let old = rows(&mut doc, "old")?.unwrap_or_default();
        let text = |k: &str| doc.get(k).and_then(Json::as_str).map(str::to_string);
        let source = text("table")
            .filter(|t| !t.is_empty())
            .map(|table| SourceTable {
                database: text("database"),
                schema: None,
                table,
            });
        let fields = field_types(doc.get("mysqlType"));
        let key = names(doc.get("pkNames"));
        let source_ts_ms = doc.get("es").and_then(Json::as_i64);
        Ok(data
            .into_iter()
            .enumerate()
            .map(|(i, row)| {
                let (before, after) = match op {
                    Op::Delete => (Some(row), None),
                    Op::Update => (old.get(i).map(|old| overlay(&row, old)), Some(row)),
                    _ => (None, Some(row)),
                };
                Decoded::Change(RawChange {
                    op,
                    source: source.clone(),
                    before,
                    after,
                    fields: fields.clone(),
                    version: None,
                    source_ts_ms,
                    key: key.clone(),
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_cases() {
        crate::golden::run("canal", &CanalJson);
    }

    #[test]
    fn mysql_types() {
        let dec = |p, s| {
            Some(Type::Decimal {
                precision: p,
                scale: s,
            })
        };
        for (mysql, want) in [
            ("int(11)", Some(Type::Int)),
            ("INTEGER", Some(Type::Int)),
            ("int(10) unsigned", Some(Type::Long)),
            ("bigint(20)", Some(Type::Long)),
            ("bigint(20) unsigned", dec(20, 0)),
            ("tinyint(1)", Some(Type::Boolean)),
            ("tinyint(4)", Some(Type::Int)),
            ("decimal(10,2)", dec(10, 2)),
            ("decimal", dec(10, 0)),
            ("decimal(65,30)", Some(Type::String)),
            ("datetime(3)", Some(Type::Timestamp)),
            ("timestamp", Some(Type::Timestamp)),
            ("date", Some(Type::Date)),
            ("time", Some(Type::Time)),
            ("double", Some(Type::Double)),
            ("float", Some(Type::Float)),
            ("varchar(255)", Some(Type::String)),
            ("text", Some(Type::String)),
            ("json", Some(Type::String)),
            ("enum('a','b')", Some(Type::String)),
            ("blob", Some(Type::Binary)),
            ("geometry", None),
        ] {
            assert_eq!(mysql_iceberg_type(mysql), want, "{mysql}");
        }
    }

    #[test]
    fn never_panics_on_odd_shapes() {
        for value in [
            "[]",
            "1",
            "\"x\"",
            "{}",
            r#"{"type": 5}"#,
            r#"{"type": "INSERT", "data": {}}"#,
            r#"{"type": "INSERT", "data": [1]}"#,
            r#"{"type": "UPDATE", "data": [{}], "old": "x"}"#,
            r#"{"type": "UPDATE", "data": [{}, {}], "old": [{}], "mysqlType": 3, "pkNames": "id"}"#,
        ] {
            let _ = CanalJson.decode(None, Some(value.as_bytes()));
        }
    }
}
