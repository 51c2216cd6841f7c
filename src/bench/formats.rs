//! `inlet bench-decode`: every format's decoder alone on the same order updates, no broker needed.

use std::time::Instant;

use serde_json::json;

use inlet_common::error::{Error, ErrorKind, Result};
use inlet_decode::{Column, Decoded, Shape};

/// Measures decoding alone for every format: the same order updates (with before images) in
/// each format's own layout, decoded and typed for the same columns. No broker is needed.
pub fn decode_formats(records: usize) -> Result<()> {
    let schemas = std::env::temp_dir().join(format!("inlet-bench-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&schemas)
        .and_then(|()| std::fs::write(schemas.join("1.avsc"), AVRO_ENVELOPE.trim()))
        .map_err(|e| {
            Error::new(
                ErrorKind::Storage,
                "cannot write the benchmark's Avro schema",
            )
            .with_source(e)
        })?;
    let result = decode_each_format(records, &schemas);
    let _ = std::fs::remove_dir_all(&schemas);
    result
}

pub(super) fn decode_each_format(records: usize, schemas: &std::path::Path) -> Result<()> {
    use crate::config::{FormatConfig, FormatKind, TimeUnit};
    use inlet_decode::decoder_for;
    use inlet_iceberg::types::Type;

    let columns = [
        ("id", Type::Long, true),
        ("customer", Type::String, false),
        (
            "amount",
            Type::Decimal {
                precision: 10,
                scale: 2,
            },
            false,
        ),
        ("status", Type::String, false),
        ("created_at", Type::Timestamp, false),
    ]
    .into_iter()
    .map(|(name, ty, required)| Column {
        name: name.into(),
        ty,
        required,
        time_unit: TimeUnit::Millis,
    })
    .collect();
    let shape = Shape::new(columns);
    let avro_schema = apache_avro::Schema::parse_str(AVRO_ENVELOPE)
        .map_err(|e| Error::new(ErrorKind::Internal, format!("benchmark Avro schema: {e}")))?;
    println!("decode and type {records} order updates per format (with before images):");
    println!("| format | records/s | MB/s | bytes/record |");
    println!("|---|---|---|---|");
    let kinds = [
        ("debezium-json", FormatKind::DebeziumJson),
        ("debezium-json + schema", FormatKind::DebeziumJson),
        ("debezium-avro", FormatKind::DebeziumAvro),
        ("canal-json", FormatKind::CanalJson),
        ("maxwell-json", FormatKind::MaxwellJson),
        ("ogg-json", FormatKind::OggJson),
        ("changelog-json", FormatKind::ChangelogJson),
        ("upsert-json", FormatKind::UpsertJson),
    ];
    for (label, kind) in kinds {
        let format = FormatConfig {
            kind,
            schema_registry: None,
            schemas_dir: Some(schemas.display().to_string()),
            ..FormatConfig::default()
        };
        let decoder = decoder_for(&format, &["id".to_string()])?;
        let messages: Vec<(Vec<u8>, Vec<u8>)> = (0..records)
            .map(|i| sample_message(label, i as i64, &avro_schema))
            .collect::<Result<_>>()?;
        let bytes: usize = messages.iter().map(|(k, v)| k.len() + v.len()).sum();
        let started = Instant::now();
        let mut typed = 0usize;
        for (key, value) in &messages {
            for decoded in decoder.decode(Some(key), Some(value))? {
                if let Decoded::Change(raw) = decoded {
                    shape.record(&raw)?;
                    typed += 1;
                }
            }
        }
        let secs = started.elapsed().as_secs_f64();
        if typed != records {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("{label}: {typed} of {records} messages decoded to a change"),
            ));
        }
        println!(
            "| {label} | {:.0} | {:.1} | {} |",
            records as f64 / secs,
            bytes as f64 / 1e6 / secs,
            bytes / records
        );
    }
    Ok(())
}

/// The Debezium envelope of the decode benchmark's Avro messages (schema id 1).
pub(super) const AVRO_ENVELOPE: &str = r#"
{"type": "record", "name": "Envelope", "namespace": "shop.orders", "fields": [
  {"name": "before", "type": ["null", {"type": "record", "name": "Value", "fields": [
    {"name": "id", "type": "long"},
    {"name": "customer", "type": ["null", "string"], "default": null},
    {"name": "amount", "type": ["null", "string"], "default": null},
    {"name": "status", "type": ["null", "string"], "default": null},
    {"name": "created_at", "type": ["null", {"type": "long", "connect.name": "io.debezium.time.Timestamp"}], "default": null}
  ]}], "default": null},
  {"name": "after", "type": ["null", "Value"], "default": null},
  {"name": "source", "type": {"type": "record", "name": "Source", "fields": [
    {"name": "db", "type": "string"}, {"name": "table", "type": "string"},
    {"name": "file", "type": "string"}, {"name": "pos", "type": "long"},
    {"name": "row", "type": "int"}, {"name": "ts_ms", "type": "long"}
  ]}},
  {"name": "op", "type": "string"},
  {"name": "ts_ms", "type": ["null", "long"], "default": null}
]}"#;

/// One order update of the decode benchmark in `label`'s layout: (key, value).
pub(super) fn sample_message(
    label: &str,
    i: i64,
    avro: &apache_avro::Schema,
) -> Result<(Vec<u8>, Vec<u8>)> {
    let id = i % 100_000;
    let (customer, amount) = (
        format!("customer-{}", i % 977),
        format!("{}.{:02}", i % 10_000, i % 100),
    );
    let ms = 1_767_225_600_000 + i * 1000;
    let datetime = chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.naive_utc().format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_default();
    let row = |status: &str| json!({"id": id, "customer": customer, "amount": amount, "status": status, "created_at": ms});
    let text_row = |status: &str| json!({"id": id.to_string(), "customer": customer, "amount": amount, "status": status, "created_at": datetime});
    let key = json!({"id": id}).to_string().into_bytes();
    let source = json!({"connector": "mysql", "db": "shop", "table": "orders", "file": "mysql-bin.000003", "pos": 4 + i * 300, "row": 0, "ts_ms": ms});
    let value = match label {
        "debezium-json" => {
            json!({"before": row("new"), "after": row("paid"), "op": "u", "ts_ms": ms, "source": source})
        }
        "debezium-json + schema" => {
            let fields = json!([
                {"type": "int64", "optional": false, "field": "id"},
                {"type": "string", "optional": true, "field": "customer"},
                {"type": "string", "optional": true, "field": "amount"},
                {"type": "string", "optional": true, "field": "status"},
                {"type": "int64", "optional": true, "name": "io.debezium.time.Timestamp", "field": "created_at"}
            ]);
            json!({"schema": {"type": "struct", "optional": false, "fields": [
                    {"type": "struct", "optional": true, "field": "before", "fields": fields},
                    {"type": "struct", "optional": true, "field": "after", "fields": fields},
                    {"type": "string", "optional": false, "field": "op"}]},
                "payload": {"before": row("new"), "after": row("paid"), "op": "u", "ts_ms": ms, "source": source}})
        }
        "debezium-avro" => {
            use apache_avro::types::Value as Avro;
            let image = |status: &str| {
                Avro::Union(
                    1,
                    Box::new(Avro::Record(vec![
                        ("id".into(), Avro::Long(id)),
                        (
                            "customer".into(),
                            Avro::Union(1, Box::new(Avro::String(customer.clone()))),
                        ),
                        (
                            "amount".into(),
                            Avro::Union(1, Box::new(Avro::String(amount.clone()))),
                        ),
                        (
                            "status".into(),
                            Avro::Union(1, Box::new(Avro::String(status.into()))),
                        ),
                        (
                            "created_at".into(),
                            Avro::Union(1, Box::new(Avro::Long(ms))),
                        ),
                    ])),
                )
            };
            let envelope = Avro::Record(vec![
                ("before".into(), image("new")),
                ("after".into(), image("paid")),
                (
                    "source".into(),
                    Avro::Record(vec![
                        ("db".into(), Avro::String("shop".into())),
                        ("table".into(), Avro::String("orders".into())),
                        ("file".into(), Avro::String("mysql-bin.000003".into())),
                        ("pos".into(), Avro::Long(4 + i * 300)),
                        ("row".into(), Avro::Int(0)),
                        ("ts_ms".into(), Avro::Long(ms)),
                    ]),
                ),
                ("op".into(), Avro::String("u".into())),
                ("ts_ms".into(), Avro::Union(1, Box::new(Avro::Long(ms)))),
            ]);
            let datum = apache_avro::to_avro_datum(avro, envelope).map_err(|e| {
                Error::new(
                    ErrorKind::Internal,
                    format!("cannot encode a benchmark Avro datum: {e}"),
                )
            })?;
            let mut bytes = vec![0, 0, 0, 0, 1];
            bytes.extend(datum);
            return Ok((key, bytes));
        }
        "canal-json" => json!({
            "data": [text_row("paid")], "old": [{"status": "new"}], "database": "shop", "table": "orders",
            "type": "UPDATE", "es": ms, "ts": ms + 5, "id": i, "isDdl": false, "pkNames": ["id"],
            "mysqlType": {"id": "bigint(20)", "customer": "varchar(64)", "amount": "decimal(10,2)", "status": "varchar(16)", "created_at": "datetime"},
            "sqlType": {"id": -5, "customer": 12, "amount": 3, "status": 12, "created_at": 93},
        }),
        "maxwell-json" => json!({
            "database": "shop", "table": "orders", "type": "update", "ts": ms / 1000, "xid": i, "xoffset": 0,
            "position": format!("mysql-bin.000003:{}", 4 + i * 300), "primary_key_columns": ["id"],
            "data": {"id": id, "customer": customer, "amount": amount, "status": "paid", "created_at": datetime},
            "old": {"status": "new"},
        }),
        "ogg-json" => json!({
            "table": "SHOP.ORDERS", "op_type": "U", "op_ts": format!("{datetime}.000000"),
            "current_ts": format!("{}T00:00:00.000000", &datetime[..10]), "pos": format!("{:020}", 4 + i * 300),
            "primary_keys": ["id"],
            "before": {"id": id, "customer": customer, "amount": amount, "status": "new", "created_at": datetime},
            "after": {"id": id, "customer": customer, "amount": amount, "status": "paid", "created_at": datetime},
        }),
        "changelog-json" => json!({"data": text_row("paid"), "op": "+U"}),
        _ => text_row("paid"),
    };
    Ok((key, value.to_string().into_bytes()))
}
