//! `inlet demo`: an embedded Kafka (librdkafka's mock cluster), a realistic Debezium stream for
//! an `orders` table, and the real pipeline into a local SQLite catalog and warehouse.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;
use serde_json::{json, Value as Json};
use tokio::sync::watch;

use crate::commit::table_offsets;
use crate::config::Config;
use crate::pipeline::{open_table, Pipeline};
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_iceberg::types::decimal_min_bytes;

/// The demo's topic.
pub const TOPIC: &str = "demo.shop.orders";
const PARTITIONS: i32 = 6;

/// The demo's two pipelines, over the same topic: every change as a row, and the live orders.
pub const DEMO_TABLES: [(&str, &str); 2] =
    [("orders_changelog", "changelog"), ("orders", "upsert")];

/// A demo pipeline's configuration, written next to its output for the user to read.
pub fn demo_config_yaml(bootstrap: &str, dir: &Path, name: &str, mode: &str) -> String {
    format!(
        r#"pipeline_id: demo-{name}
kafka:
  bootstrap_servers: "{bootstrap}"
  group_id: inlet-demo-{name}
  topics: [{TOPIC}]
index:
  dir: "{dir}/index"
table:
  namespace: shop
  name: {name}
  mode: {mode}
  columns:
    - {{name: id, type: long, required: true}}
    - {{name: customer, type: string}}
    - {{name: status, type: string}}
    - {{name: amount, type: "decimal(10,2)"}}
    - {{name: created_at, type: timestamptz}}
    - {{name: updated_at, type: timestamptz}}
  primary_key: [id]
  partition_by:
    - {{column: created_at, transform: day}}
catalog:
  uri: "sqlite://{dir}/catalog.db"
  name: inlet
  warehouse: "{dir}/warehouse"
checkpoint:
  interval_ms: 1000
  max_records: 5000
metrics:
  listen: ""
"#,
        dir = dir.display()
    )
}

fn field(name: &str, ty: &str, logical: Option<&str>, optional: bool) -> Json {
    let mut f = json!({"type": ty, "optional": optional, "field": name});
    if let Some(l) = logical {
        f["name"] = json!(l);
        if l == "org.apache.kafka.connect.data.Decimal" {
            f["parameters"] = json!({"scale": "2", "connect.decimal.precision": "10"});
        }
    }
    f
}

fn envelope_schema() -> Json {
    let row = vec![
        field("id", "int64", None, false),
        field("customer", "string", None, true),
        field("status", "string", None, true),
        field(
            "amount",
            "bytes",
            Some("org.apache.kafka.connect.data.Decimal"),
            true,
        ),
        field(
            "created_at",
            "int64",
            Some("io.debezium.time.Timestamp"),
            true,
        ),
        field(
            "updated_at",
            "string",
            Some("io.debezium.time.ZonedTimestamp"),
            true,
        ),
    ];
    json!({
        "type": "struct", "optional": false, "name": "demo.shop.orders.Envelope",
        "fields": [
            {"type": "struct", "optional": true, "field": "before", "name": "demo.shop.orders.Value", "fields": row},
            {"type": "struct", "optional": true, "field": "after", "name": "demo.shop.orders.Value", "fields": row},
            {"type": "struct", "optional": false, "field": "source", "name": "io.debezium.connector.mysql.Source", "fields": [
                field("file", "string", None, false), field("pos", "int64", None, false),
                field("row", "int32", None, false), field("ts_ms", "int64", None, false)]},
            field("op", "string", None, false),
            field("ts_ms", "int64", None, true),
        ]
    })
}

#[derive(Clone)]
struct Order {
    id: i64,
    customer: String,
    status: &'static str,
    cents: i64,
    created_ms: i64,
    updated_ms: i64,
}

fn image(o: &Order) -> Json {
    let amount =
        base64::engine::general_purpose::STANDARD.encode(decimal_min_bytes(o.cents as i128));
    let updated = chrono::DateTime::from_timestamp_millis(o.updated_ms)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
    json!({"id": o.id, "customer": o.customer, "status": o.status, "amount": amount,
           "created_at": o.created_ms, "updated_at": updated})
}

/// Generates a Debezium stream: inserts, status updates and deletes of orders over three days,
/// in binlog order, with the Connect schema envelope or without it (`schemas.enable=false`).
/// Returns (key, value) pairs.
pub fn order_events(orders: usize, with_schema: bool) -> Vec<(String, String)> {
    let schema = envelope_schema();
    let base_ms = 1_767_225_600_000i64; // 2026-01-01T00:00:00Z
    let mut pos = 4i64;
    let mut out = Vec::new();
    let mut emit = |op: &str, before: Option<&Order>, after: Option<&Order>, ts: i64| {
        pos += 317;
        let id = after.or(before).map_or(0, |o| o.id);
        let payload = json!({
            "before": before.map(image), "after": after.map(image),
            "source": {"file": "mysql-bin.000003", "pos": pos, "row": 0, "ts_ms": ts},
            "op": op, "ts_ms": ts + 5,
        });
        let key = json!({"schema": {"type": "struct", "optional": false, "name": "demo.shop.orders.Key",
                        "fields": [field("id", "int64", None, false)]}, "payload": {"id": id}});
        let value = if with_schema {
            json!({"schema": schema, "payload": payload})
        } else {
            payload
        };
        out.push((key.to_string(), value.to_string()));
    };
    let mut live: Vec<Order> = Vec::with_capacity(orders);
    let span_ms = 3 * 86_400_000i64;
    for i in 0..orders as i64 {
        let created = base_ms + span_ms * i / orders.max(1) as i64;
        let o = Order {
            id: 1000 + i,
            customer: format!("customer-{}", i * 7919 % 997),
            status: "new",
            cents: 500 + (i * 104_729) % 50_000,
            created_ms: created,
            updated_ms: created,
        };
        emit("c", None, Some(&o), created);
        live.push(o);
        // Every third order is paid shortly after; every tenth paid order ships; every
        // twenty-fifth order is cancelled and deleted.
        if i % 3 == 2 {
            let idx = (i as usize) - 1;
            let before = live[idx].clone();
            let mut after = before.clone();
            after.status = "paid";
            after.updated_ms = created + 60_000;
            emit("u", Some(&before), Some(&after), after.updated_ms);
            live[idx] = after.clone();
            if i % 10 == 2 {
                let mut shipped = after.clone();
                shipped.status = "shipped";
                shipped.updated_ms = created + 120_000;
                emit("u", Some(&after), Some(&shipped), shipped.updated_ms);
                live[idx] = shipped;
            }
        }
        // Every fortieth order's date is corrected to the next day: in a table partitioned by
        // day the row moves to another partition.
        if i % 40 == 13 {
            let idx = i as usize;
            let before = live[idx].clone();
            let mut after = before.clone();
            after.created_ms += 86_400_000;
            after.updated_ms = created + 30_000;
            emit("u", Some(&before), Some(&after), after.updated_ms);
            live[idx] = after;
        }
        if i % 25 == 24 {
            let victim = live[(i as usize) - 20].clone();
            emit("d", Some(&victim), None, created + 1);
        }
    }
    out
}

/// Produces `events` keyed by order id; each delete is followed by a tombstone (null value), as
/// Debezium does for log compaction.
async fn produce(bootstrap: &str, events: &[(String, String)]) -> Result<usize> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .or_kind(ErrorKind::Kafka, || "cannot create demo producer".into())?;
    let mut sent = 0;
    let mut acks = Vec::with_capacity(events.len() * 2);
    for (key, value) in events {
        let is_delete = value.contains("\"op\":\"d\"");
        acks.push(
            producer
                .send_result(FutureRecord::to(TOPIC).key(key).payload(value))
                .map_err(|(e, _)| e),
        );
        if is_delete {
            acks.push(
                producer
                    .send_result(FutureRecord::<String, [u8]>::to(TOPIC).key(key))
                    .map_err(|(e, _)| e),
            );
        }
    }
    for ack in acks {
        let delivered = ack
            .or_kind(ErrorKind::Kafka, || "cannot enqueue demo message".into())?
            .await
            .map_err(|_| Error::new(ErrorKind::Kafka, "demo producer went away"))?;
        delivered.map_err(|(e, _)| {
            Error::new(ErrorKind::Kafka, "demo message not delivered").with_source(e)
        })?;
        sent += 1;
    }
    // The embedded Kafka keeps at most 5 MB per partition and silently drops older messages;
    // a demo that lost some would prove nothing.
    let client = producer.client();
    for p in 0..PARTITIONS {
        let (low, _) = tokio::task::block_in_place(|| {
            client.fetch_watermarks(TOPIC, p, Duration::from_secs(10))
        })
        .or_kind(ErrorKind::Kafka, || "cannot read demo watermarks".into())?;
        if low > 0 {
            return Err(Error::config(format!(
                "the embedded Kafka dropped the oldest {low} messages of partition {p} (it keeps 5 MB per partition); use fewer --orders"
            )));
        }
    }
    Ok(sent)
}

/// Peak resident memory of this process, from `/proc/self/status`.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM:")
}

/// Resident memory of this process now, from `/proc/self/status`.
pub fn rss_bytes() -> Option<u64> {
    proc_status_bytes("VmRSS:")
}

fn proc_status_bytes(field: &str) -> Option<u64> {
    process_status_bytes("self", field)
}

/// A `/proc/<pid>/status` memory field (`VmHWM:`, `VmRSS:`) of process `pid` in bytes.
pub fn process_status_bytes(pid: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Runs the demo into `dir`.
pub async fn run(dir: PathBuf, orders: usize, with_schema: bool) -> Result<()> {
    let dir = if dir.is_absolute() {
        dir
    } else {
        std::env::current_dir()
            .or_kind(ErrorKind::Storage, || {
                "cannot read working directory".into()
            })?
            .join(dir)
    };
    std::fs::create_dir_all(&dir).or_kind(ErrorKind::Storage, || {
        format!("cannot create {}", dir.display())
    })?;
    let cluster = MockCluster::new(1).or_kind(ErrorKind::Kafka, || {
        "cannot start the embedded Kafka".into()
    })?;
    cluster
        .create_topic(TOPIC, PARTITIONS, 1)
        .or_kind(ErrorKind::Kafka, || format!("cannot create topic {TOPIC}"))?;
    let bootstrap = cluster.bootstrap_servers();
    let events = order_events(orders, with_schema);
    println!("Producing {} Debezium change events for {orders} orders to {TOPIC} ({PARTITIONS} partitions)...", events.len());
    let produced = produce(&bootstrap, &events).await?;

    let mut cfgs = Vec::new();
    for (name, mode) in DEMO_TABLES {
        let yaml = demo_config_yaml(&bootstrap, &dir, name, mode);
        let file = dir.join(format!("inlet-demo-{name}.yaml"));
        std::fs::write(&file, &yaml).or_kind(ErrorKind::Storage, || {
            format!("cannot write {}", file.display())
        })?;
        cfgs.push(Config::from_yaml_with_env(&yaml)?);
    }
    let started = Instant::now();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut runs = Vec::new();
    for cfg in &cfgs {
        let table = open_table(cfg).await?;
        let already: i64 = table_offsets(&table.metadata, &cfg.pipeline_id)?
            .values()
            .flat_map(|m| m.values())
            .sum();
        let pipeline = Pipeline::start(cfg.clone()).await?;
        runs.push((
            cfg,
            table,
            already + produced as i64,
            tokio::spawn(pipeline.run(stop_rx.clone())),
        ));
    }
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let mut all_done = true;
        for (cfg, table, target, handle) in runs.iter_mut() {
            table.refresh().await?;
            let done: i64 = table_offsets(&table.metadata, &cfg.pipeline_id)?
                .values()
                .flat_map(|m| m.values())
                .sum();
            all_done &= done >= *target || handle.is_finished();
        }
        if all_done {
            break;
        }
        if started.elapsed() > Duration::from_secs(300) {
            let _ = stop_tx.send(true);
            return Err(Error::new(
                ErrorKind::Internal,
                "demo did not catch up within 5 minutes",
            ));
        }
    }
    let _ = stop_tx.send(true);
    let elapsed = started.elapsed().as_secs_f64();
    println!();
    println!(
        "Committed {produced} messages into {} tables in {elapsed:.2}s ({:.0} records/s per pipeline), peak RSS {:.1} MiB.",
        runs.len(),
        produced as f64 / elapsed,
        peak_rss_bytes().unwrap_or(0) as f64 / 1_048_576.0
    );
    let mut metadata_files = Vec::new();
    for (cfg, mut table, _, handle) in runs {
        handle.await.map_err(|e| {
            Error::new(ErrorKind::Internal, "pipeline task failed").with_source(e)
        })??;
        table.refresh().await?;
        let summary = |k: &str| -> i64 {
            table
                .metadata
                .current_snapshot()
                .and_then(|s| s.summary.get(k))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let rows = summary("total-records") - summary("total-position-deletes");
        println!(
            "Table shop.{} ({:?}): {rows} rows in {} data files and {} position-delete files, {} snapshots.",
            cfg.table.name,
            cfg.table.mode,
            summary("total-data-files"),
            summary("total-delete-files"),
            table.metadata.snapshots.len()
        );
        metadata_files.push(table.metadata_location.clone());
    }
    println!("Configs used: {}/inlet-demo-*.yaml", dir.display());
    println!();
    println!("Read it with pyiceberg:");
    println!("  python3 -c \"from pyiceberg.catalog.sql import SqlCatalog; \\");
    println!("    c = SqlCatalog('inlet', uri='sqlite:///{}/catalog.db', warehouse='file://{}/warehouse'); \\", dir.display(), dir.display());
    println!("    print(c.load_table('shop.orders').scan().to_arrow().to_pandas())\"");
    println!("or with DuckDB:");
    println!("  duckdb -c \"INSTALL iceberg; LOAD iceberg; SELECT _op, count(*) FROM iceberg_scan('{}') GROUP BY 1\"", metadata_files[0]);
    drop(cluster);
    Ok(())
}
