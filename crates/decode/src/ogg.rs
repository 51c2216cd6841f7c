//! Oracle GoldenGate's JSON messages: `table` as `SCHEMA.TABLE`, `op_type` I/U/D/T, `before`
//! and `after` images, `op_ts` (commit time, UTC), `pos` (trail file sequence and offset) and
//! `primary_keys`. With `includeIsMissingFields` every column comes with a `<column>_isMissing`
//! flag; a missing column (not captured, as in a compressed update) is left out of the image.
//!
//! Version: `pos`, a zero-padded decimal string, compared as a number.

use std::collections::HashSet;
use std::sync::Arc;

use chrono::NaiveDateTime;
use serde_json::{Map, Value as Json};

use super::{json_object, names, reason, take_object, Decoded, Decoder, Image, Op, RawChange};
use super::{SourceTable, Version, VersionPart};
use inlet_common::error::{Error, Result};

/// Decodes GoldenGate JSON.
#[derive(Debug, Default)]
pub struct OggJson;

const MISSING_SUFFIX: &str = "_isMissing";

/// Drops the `_isMissing` flags and the columns they mark as missing.
fn strip_missing(image: Image) -> Image {
    // A set: a message may flag tens of thousands of columns, and a list made this quadratic.
    let missing: HashSet<String> = image
        .iter()
        .filter(|(_, flag)| flag.as_bool() == Some(true))
        .filter_map(|(name, _)| name.strip_suffix(MISSING_SUFFIX))
        .map(str::to_string)
        .collect();
    image
        .into_iter()
        .filter(|(name, flag)| {
            let is_flag = name.ends_with(MISSING_SUFFIX) && flag.is_boolean();
            !is_flag && !missing.contains(name)
        })
        .collect()
}

/// `SCHEMA.TABLE`, or `CATALOG.SCHEMA.TABLE` for multitenant sources.
fn source_table(name: &str) -> SourceTable {
    let parts: Vec<&str> = name.split('.').collect();
    let owned = |s: &str| Some(s.to_string());
    match parts.as_slice() {
        [catalog, schema, table] => SourceTable {
            database: owned(catalog),
            schema: owned(schema),
            table: table.to_string(),
        },
        [schema, table] => SourceTable {
            database: owned(schema),
            schema: None,
            table: table.to_string(),
        },
        _ => SourceTable {
            database: None,
            schema: None,
            table: name.to_string(),
        },
    }
}

/// `op_ts` (`2015-11-05 18:45:36.000000`, UTC) in milliseconds.
fn op_ts_ms(doc: &Map<String, Json>) -> Option<i64> {
    let text = doc.get("op_ts")?.as_str()?;
    ["%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H:%M:%S%.f"]
        .iter()
        .find_map(|f| NaiveDateTime::parse_from_str(text, f).ok())
        .map(|t| t.and_utc().timestamp_millis())
}

fn version(doc: &Map<String, Json>) -> Option<Version> {
    let part = match doc.get("pos")? {
        Json::String(s) => s
            .parse::<i128>()
            .map_or(VersionPart::Text(s.clone()), VersionPart::Int),
        Json::Number(n) => VersionPart::Int(n.as_i64()? as i128),
        _ => return None,
    };
    Some(Version(vec![part]))
}

impl Decoder for OggJson {
    fn decode(&self, _key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Vec<Decoded>> {
        let Some(bytes) = value else {
            return Ok(vec![Decoded::Tombstone]);
        };
        let Some(mut doc) = json_object(bytes)? else {
            return Ok(vec![Decoded::Tombstone]);
        };
        let op = match doc.get("op_type").and_then(Json::as_str) {
            Some("I") => Op::Create,
            Some("U") => Op::Update,
            Some("D") => Op::Delete,
            Some("T") => return Ok(vec![Decoded::Skipped("truncate")]),
            Some(other) => {
                return Err(Error::decode(format!(
                    "op_type: unknown operation \"{other}\"; expected I, U, D or T"
                ))
                .because(reason::UNKNOWN_OP))
            }
            None => {
                return Err(Error::decode(
                    "op_type: missing; this is not a GoldenGate JSON message",
                ))
            }
        };
        let table = doc
            .get("table")
            .and_then(Json::as_str)
            .map(source_table)
            .ok_or_else(|| Error::decode("table: missing; expected \"SCHEMA.TABLE\""))?;
        let before = take_object(&mut doc, "before")?.map(strip_missing);
        let after = take_object(&mut doc, "after")?.map(strip_missing);
        match op {
            Op::Delete if before.is_none() => {
                return Err(Error::decode(
                    "before: a delete needs the before image (capture the key columns)",
                ))
            }
            Op::Create | Op::Update if after.is_none() => {
                return Err(Error::decode(format!(
                    "after: missing for op_type \"{}\"",
                    if op == Op::Create { "I" } else { "U" }
                )))
            }
            _ => {}
        }
        Ok(vec![Decoded::Change(RawChange {
            op,
            source: Some(table),
            before,
            after,
            // GoldenGate's JSON messages carry no column types.
            fields: Arc::default(),
            version: version(&doc),
            source_ts_ms: op_ts_ms(&doc),
            key: names(doc.get("primary_keys")),
        })])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn golden_cases() {
        crate::golden::run("ogg", &OggJson);
    }

    #[test]
    fn positions_compare_as_numbers() {
        let v = |pos: Json| version(json!({ "pos": pos }).as_object().unwrap());
        assert!(v(json!("00000000000000004338")) > v(json!("00000000000000000999")));
        assert!(v(json!("00000000010000000000")) > v(json!("00000000009999999999")));
        assert_eq!(v(json!("-")).unwrap().to_string(), "-");
        assert_eq!(v(json!(true)), None);
    }

    #[test]
    fn missing_columns_leave_the_image() {
        let image = json!({"A": 1, "A_isMissing": false, "B": null, "B_isMissing": true,
                           "C_isMissing": "text, a column of its own"});
        let got = strip_missing(image.as_object().unwrap().clone());
        assert_eq!(
            Json::Object(got),
            json!({"A": 1, "C_isMissing": "text, a column of its own"})
        );
    }

    #[test]
    fn table_names() {
        assert_eq!(
            source_table("QASOURCE.TCUSTORD").to_string(),
            "QASOURCE.TCUSTORD"
        );
        assert_eq!(source_table("QASOURCE.TCUSTORD").schema, None);
        assert_eq!(source_table("CDB.HR.EMP").schema.as_deref(), Some("HR"));
        assert_eq!(source_table("EMP").database, None);
    }
}
