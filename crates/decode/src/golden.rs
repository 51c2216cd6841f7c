//! Golden decode cases, one directory per format under `tests/golden/<format>/`. Each case file
//! holds a Kafka message, the table's columns and what the message must decode to:
//!
//! - `key`, `value`: the message; JSON `null` is an absent key or value, a JSON string is the
//!   raw bytes (for payloads that are not JSON), anything else is sent as JSON text.
//! - `columns`: `[{name, type, required, time_unit}]` to type the changes against.
//! - `expect`, one of:
//!   - `{"changes": [{op, source, before, after, version, key, source_ts_ms}, ...]}`: every
//!     change in message order; `source` is `{database, schema, table}` or null, rows hold
//!     canonical values (decimals and timestamps as text);
//!   - `{op, before, after, version, source_ts_ms}`: the one change of the message, without
//!     checking its source and key (the shorter form of the first Debezium cases);
//!   - `{"skipped": reason}`, `{"tombstone": true}`;
//!   - `{"error_contains": text, "reason": reason}`: decoding or typing fails; `reason` is
//!     optional and compared with [`Error::reason`].

use std::path::Path;

use serde_json::{json, Value as Json};

use super::{ChangeRecord, Column, Decoded, Decoder, RawChange, Row, Shape, SourceTable};
use crate::config::TimeUnit;
use inlet_common::error::{Error, Result};
use inlet_iceberg::transform::human_value;
use inlet_iceberg::types::{Type, Value};

/// What a message decoded to, typed.
enum Outcome {
    Change(Box<RawChange>, ChangeRecord),
    Tombstone,
    Skipped(&'static str),
}

/// Checks every case of `format` against `decoder`.
pub fn run(format: &str, decoder: &dyn Decoder) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 6,
        "golden cases missing in {}",
        dir.display()
    );
    for path in files {
        let name = format!("{format}/{}", path.file_name().unwrap().to_string_lossy());
        let case: Json = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        check(&name, &case, decoder);
    }
}

fn check(name: &str, case: &Json, decoder: &dyn Decoder) {
    let columns = columns(case);
    let key = payload(&case["key"]);
    let value = payload(&case["value"]);
    let shape = Shape::new(columns.clone());
    let got = decode(decoder, &shape, key.as_deref(), value.as_deref());
    let expect = &case["expect"];

    if let Some(want) = expect.get("error_contains").and_then(Json::as_str) {
        let err = match got {
            Ok(_) => panic!("{name}: decoded, expected an error containing {want:?}"),
            Err(e) => e,
        };
        let text = err.to_string();
        assert!(text.contains(want), "{name}: error {text:?} lacks {want:?}");
        if let Some(reason) = expect.get("reason") {
            assert_eq!(json!(err.reason()), *reason, "{name}: reason of {text:?}");
        }
        return;
    }
    let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
    if expect.get("tombstone").is_some() {
        assert!(
            matches!(got.as_slice(), [Outcome::Tombstone]),
            "{name}: expected a tombstone"
        );
        return;
    }
    if let Some(reason) = expect.get("skipped") {
        match got.as_slice() {
            [Outcome::Skipped(why)] => assert_eq!(json!(why), *reason, "{name}: skip reason"),
            _ => panic!("{name}: expected one skipped message"),
        }
        return;
    }
    let (wanted, full) = match expect.get("changes").and_then(Json::as_array) {
        Some(all) => (all.iter().collect::<Vec<_>>(), true),
        None => (vec![expect], false),
    };
    assert_eq!(got.len(), wanted.len(), "{name}: number of changes");
    for (i, (got, want)) in got.iter().zip(wanted).enumerate() {
        let Outcome::Change(raw, rec) = got else {
            panic!("{name}: item {i} is not a change");
        };
        let at = |what: &str| format!("{name}: change {i}: {what}");
        assert_eq!(json!(rec.op.code()), want["op"], "{}", at("op"));
        assert_eq!(
            row_json(&columns, &rec.before),
            want["before"],
            "{}",
            at("before")
        );
        assert_eq!(
            row_json(&columns, &rec.after),
            want["after"],
            "{}",
            at("after")
        );
        assert_eq!(
            rec.version
                .as_ref()
                .map_or(Json::Null, |v| json!(v.to_string())),
            want["version"],
            "{}",
            at("version")
        );
        assert_eq!(
            rec.source_ts_ms.map_or(Json::Null, |v| json!(v)),
            want["source_ts_ms"],
            "{}",
            at("source_ts_ms")
        );
        if full {
            for field in ["source", "key"] {
                assert!(
                    want.get(field).is_some(),
                    "{}",
                    at(&format!("{field} unstated"))
                );
            }
            assert_eq!(
                raw.source.as_ref().map_or(Json::Null, source_json),
                want["source"],
                "{}",
                at("source")
            );
            assert_eq!(json!(raw.key), want["key"], "{}", at("key"));
        }
    }
}

/// The table columns a case types its changes against.
pub fn columns(case: &Json) -> Vec<Column> {
    case["columns"]
        .as_array()
        .expect("a golden case lists its columns")
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

fn payload(v: &Json) -> Option<Vec<u8>> {
    match v {
        Json::Null => None,
        Json::String(raw) => Some(raw.clone().into_bytes()),
        other => Some(other.to_string().into_bytes()),
    }
}

fn decode(
    decoder: &dyn Decoder,
    shape: &Shape,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
) -> Result<Vec<Outcome>> {
    decoder
        .decode(key, value)?
        .into_iter()
        .map(|d| {
            Ok::<_, Error>(match d {
                Decoded::Change(raw) => {
                    let rec = shape.record(&raw)?;
                    Outcome::Change(Box::new(raw), rec)
                }
                Decoded::Tombstone => Outcome::Tombstone,
                Decoded::Skipped(why) => Outcome::Skipped(why),
            })
        })
        .collect()
}

fn source_json(s: &SourceTable) -> Json {
    json!({"database": s.database, "schema": s.schema, "table": s.table})
}

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

pub fn row_json(columns: &[Column], row: &Option<Row>) -> Json {
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
