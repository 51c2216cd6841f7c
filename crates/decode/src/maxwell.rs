//! Maxwell's JSON messages: one row per message, the row after an insert or update (the deleted
//! row for a delete) in `data`, the old values of an update's changed fields in `old`. Values
//! keep their JSON types; datetimes are text, binary columns base64, JSON columns nested
//! objects and SET columns arrays.
//!
//! Version: the binlog position (`position`, present with `output_binlog_position`) as file
//! index and offset, then the row's offset in its transaction (`xoffset`, present with
//! `output_xoffset`). Maxwell leaves `xoffset` off the row that commits the transaction, the
//! last one, so that row sorts after every offset. Without `position` there is no version and
//! the Kafka offset orders changes.

use std::sync::Arc;

use serde_json::{Map, Value as Json};

use super::{binlog_file, json_object, names, overlay, reason, take_object, Decoded, Decoder};
use super::{Op, RawChange, SourceTable, Version, VersionPart};
use inlet_common::error::{Error, Result};

/// Decodes Maxwell JSON.
#[derive(Debug, Default)]
pub struct MaxwellJson;

/// `mysql-bin.000003:1234` plus the row's transaction offset as a version.
fn version(doc: &Map<String, Json>) -> Option<Version> {
    let (file, offset) = doc.get("position")?.as_str()?.rsplit_once(':')?;
    let offset = offset.parse::<i128>().ok()?;
    let in_transaction = match doc.get("xoffset").and_then(Json::as_i64) {
        Some(x) => x as i128,
        None if doc.get("commit").and_then(Json::as_bool) == Some(true) => i64::MAX as i128,
        None => 0,
    };
    Some(Version(vec![
        binlog_file(file),
        VersionPart::Int(offset),
        VersionPart::Int(in_transaction),
    ]))
}

/// Key column names: `primary_key_columns` in the value, else the `pk.<column>` fields of
/// Maxwell's default Kafka key.
fn key_columns(doc: &Map<String, Json>, key: Option<&[u8]>) -> Vec<String> {
    let stated = names(doc.get("primary_key_columns"));
    if !stated.is_empty() {
        return stated;
    }
    let Some(Json::Object(key)) = key.and_then(|k| serde_json::from_slice(k).ok()) else {
        return Vec::new();
    };
    key.keys()
        .filter_map(|k| k.strip_prefix("pk."))
        .map(str::to_string)
        .collect()
}

impl Decoder for MaxwellJson {
    fn decode(&self, key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Vec<Decoded>> {
        let Some(bytes) = value else {
            return Ok(vec![Decoded::Tombstone]);
        };
        let Some(mut doc) = json_object(bytes)? else {
            return Ok(vec![Decoded::Tombstone]);
        };
        let op = match doc.get("type").and_then(Json::as_str) {
            Some("insert") => Op::Create,
            Some("update") => Op::Update,
            Some("delete") => Op::Delete,
            Some("bootstrap-insert") => Op::Read,
            Some("bootstrap-start" | "bootstrap-complete") => {
                return Ok(vec![Decoded::Skipped("bootstrap")])
            }
            Some(
                "database-create" | "database-alter" | "database-drop" | "table-create"
                | "table-alter" | "table-drop",
            ) => return Ok(vec![Decoded::Skipped("ddl")]),
            Some(other) => {
                return Err(Error::decode(format!(
                    "type: unknown type \"{other}\"; expected insert, update, delete or bootstrap-insert"
                ))
                .because(reason::UNKNOWN_OP))
            }
            None => return Err(Error::decode("type: missing; this is not a Maxwell message")),
        };
        let data = take_object(&mut doc, "data")?
            .ok_or_else(|| Error::decode("data: missing; a row change needs its row"))?;
        let old = take_object(&mut doc, "old")?;
        let (before, after) = match op {
            Op::Delete => (Some(data), None),
            Op::Update => (old.map(|old| overlay(&data, &old)), Some(data)),
            _ => (None, Some(data)),
        };
        let text = |k: &str| doc.get(k).and_then(Json::as_str).map(str::to_string);
        Ok(vec![Decoded::Change(RawChange {
            op,
            source: text("table").map(|table| SourceTable {
                database: text("database"),
                schema: None,
                table,
            }),
            before,
            after,
            // Maxwell's messages carry no column types.
            fields: Arc::default(),
            version: version(&doc),
            source_ts_ms: doc
                .get("ts")
                .and_then(Json::as_i64)
                .map(|s| s.saturating_mul(1000)),
            key: key_columns(&doc, key),
        })])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_cases() {
        crate::golden::run("maxwell", &MaxwellJson);
    }

    #[test]
    fn versions_order_rows_of_one_transaction() {
        let v = |s: &str| {
            version(
                serde_json::from_str::<Json>(s)
                    .unwrap()
                    .as_object()
                    .unwrap(),
            )
        };
        let first = v(r#"{"position": "master.000006:800911", "xoffset": 0}"#).unwrap();
        let second = v(r#"{"position": "master.000006:800911", "xoffset": 1}"#).unwrap();
        let last = v(r#"{"position": "master.000006:800911", "commit": true}"#).unwrap();
        let next_file = v(r#"{"position": "master.000007:4", "xoffset": 0}"#).unwrap();
        assert!(first < second && second < last && last < next_file);
        assert_eq!(first.to_string(), "6:800911:0");
        assert_eq!(v(r#"{"position": "no-offset"}"#), None);
        assert_eq!(v(r#"{"xoffset": 3}"#), None);
    }

    #[test]
    fn key_names_from_the_default_kafka_key() {
        let doc = Map::new();
        let key = br#"{"database": "test", "table": "e", "pk.id": 1, "pk.c": "x"}"#;
        let mut got = key_columns(&doc, Some(key));
        got.sort();
        assert_eq!(got, ["c", "id"]);
        assert!(key_columns(&doc, Some(b"not json")).is_empty());
    }
}
