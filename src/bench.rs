//! `inlet bench`: throughput and memory of the real upsert pipeline on a generated Debezium
//! stream, the decode-only rate of the same stream, and the index rebuild rate. It needs a real
//! Kafka-protocol broker (`--bootstrap`): the embedded one keeps too little for a benchmark.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use serde_json::json;
use tokio::sync::watch;

use crate::commit::table_offsets;
use crate::config::Config;
use crate::decode::debezium::DebeziumJson;
use crate::decode::{Column, Decoded, Decoder, Shape};
use crate::demo::peak_rss_bytes;
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::pipeline::{open_table, Pipeline};

/// What to generate.
pub struct BenchOptions {
    pub bootstrap: String,
    pub keys: u64,
    pub ops: u64,
    pub partitions: i32,
    pub dir: PathBuf,
}

/// A small deterministic generator (xorshift), so the decode pass sees the same stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The i-th change of the stream: (partition, key, value). Keys are inserted first, then 80%
/// updates (a quarter of them move the row to another day's partition) and 20% deletes with
/// re-inserts.
fn change(rng: &mut Rng, i: u64, opts: &BenchOptions, lsn: u64) -> (i32, String, String) {
    let (id, op) = if i < opts.keys {
        (i, "c")
    } else {
        (
            rng.below(opts.keys),
            if rng.below(10) < 8 { "u" } else { "d" },
        )
    };
    let day = if op == "u" && rng.below(4) == 0 {
        rng.below(30)
    } else {
        id % 30
    };
    let status = ["new", "paid", "shipped"][rng.below(3) as usize];
    let row = json!({
        "id": id,
        "customer": format!("customer-{}", id % 9973),
        "status": status,
        "amount": format!("{}.{:02}", rng.below(100_000), rng.below(100)),
        "created_at": 1_767_225_600_000u64 + day * 86_400_000 + id % 86_400_000,
    });
    let (before, after) = match op {
        "d" => (Some(row.clone()), None),
        _ => (None, Some(row)),
    };
    let value = json!({"before": before, "after": after, "op": op, "ts_ms": lsn,
                       "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": lsn}});
    (
        (id % opts.partitions as u64) as i32,
        json!({"id": id}).to_string(),
        value.to_string(),
    )
}

fn config_yaml(opts: &BenchOptions, topic: &str) -> String {
    format!(
        r#"pipeline_id: bench
kafka:
  bootstrap_servers: "{bootstrap}"
  group_id: inlet-bench-{topic}
  topics: [{topic}]
  properties: {{session.timeout.ms: "6000"}}
index:
  dir: "{dir}/index"
table:
  namespace: bench
  name: orders
  mode: upsert
  columns:
    - {{name: id, type: long, required: true}}
    - {{name: customer, type: string}}
    - {{name: status, type: string}}
    - {{name: amount, type: "decimal(10,2)"}}
    - {{name: created_at, type: timestamptz}}
  primary_key: [id]
  partition_by:
    - {{column: created_at, transform: day}}
catalog:
  uri: "sqlite://{dir}/catalog.db"
  warehouse: "{dir}/warehouse"
checkpoint:
  interval_ms: 10000
  max_records: 500000
metrics:
  listen: ""
"#,
        bootstrap = opts.bootstrap,
        dir = opts.dir.display()
    )
}

/// Runs the benchmark and prints its numbers.
pub async fn run(opts: BenchOptions) -> Result<()> {
    std::fs::create_dir_all(&opts.dir).or_kind(ErrorKind::Storage, || {
        format!("cannot create {}", opts.dir.display())
    })?;
    let topic = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &opts.bootstrap)
        .create()
        .or_kind(ErrorKind::Kafka, || "cannot create admin client".into())?;
    let created = admin
        .create_topics(
            &[NewTopic::new(
                &topic,
                opts.partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await
        .or_kind(ErrorKind::Kafka, || format!("cannot create topic {topic}"))?;
    for r in created {
        r.map_err(|(t, e)| Error::new(ErrorKind::Kafka, format!("cannot create topic {t}: {e}")))?;
    }

    // Produce, and decode the same stream, one pass each.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &opts.bootstrap)
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .or_kind(ErrorKind::Kafka, || "cannot create producer".into())?;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut bytes = 0u64;
    let started = Instant::now();
    let mut acks = Vec::new();
    for i in 0..opts.ops {
        let (p, key, value) = change(&mut rng, i, &opts, 1000 + i);
        bytes += value.len() as u64;
        let mut record = FutureRecord::to(&topic)
            .partition(p)
            .key(&key)
            .payload(&value);
        loop {
            match producer.send_result(record) {
                Ok(ack) => {
                    acks.push(ack);
                    break;
                }
                Err((_, r)) => {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
        if acks.len() >= 100_000 {
            for ack in acks.drain(..) {
                ack.await
                    .map_err(|_| Error::new(ErrorKind::Kafka, "producer went away"))?
                    .map_err(|(e, _)| {
                        Error::new(ErrorKind::Kafka, "not delivered").with_source(e)
                    })?;
            }
        }
    }
    for ack in acks {
        ack.await
            .map_err(|_| Error::new(ErrorKind::Kafka, "producer went away"))?
            .map_err(|(e, _)| Error::new(ErrorKind::Kafka, "not delivered").with_source(e))?;
    }
    println!(
        "produced {} changes ({:.1} MB) over {} keys in {:.1}s",
        opts.ops,
        bytes as f64 / 1e6,
        opts.keys,
        started.elapsed().as_secs_f64()
    );

    let yaml = config_yaml(&opts, &topic);
    let cfg = Config::from_yaml_with_env(&yaml)?;
    let columns: Vec<Column> = cfg
        .table
        .columns
        .iter()
        .map(|c| {
            Ok(Column {
                name: c.name.clone(),
                ty: crate::table::types::Type::parse(&c.ty)?,
                required: c.required,
                time_unit: c.time_unit,
            })
        })
        .collect::<Result<_>>()?;
    let shape = Shape::new(columns);
    let decoder = DebeziumJson;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let started = Instant::now();
    for i in 0..opts.ops {
        let (_, key, value) = change(&mut rng, i, &opts, 1000 + i);
        for decoded in decoder.decode(Some(key.as_bytes()), Some(value.as_bytes()))? {
            if let Decoded::Change(raw) = decoded {
                shape.record(&raw)?;
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "decode only: {:.0} records/s, {:.1} MB/s (includes generating the JSON)",
        opts.ops as f64 / secs,
        bytes as f64 / 1e6 / secs
    );

    let table = open_table(&cfg).await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let started = Instant::now();
    let handle = tokio::spawn(Pipeline::start(cfg.clone()).await?.run(stop_rx));
    let mut table = table;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        table.refresh().await?;
        let done: i64 = table_offsets(&table.metadata, &cfg.pipeline_id)?
            .values()
            .flat_map(|m| m.values())
            .sum();
        if done >= opts.ops as i64 || handle.is_finished() {
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let _ = stop_tx.send(true);
    handle
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, "pipeline task failed").with_source(e))??;
    println!(
        "pipeline (upsert, Kafka to committed Iceberg): {:.0} records/s, {:.1} MB/s, {:.1}s including a group join, peak RSS {:.0} MiB",
        opts.ops as f64 / secs,
        bytes as f64 / 1e6 / secs,
        secs,
        peak_rss_bytes().unwrap_or(0) as f64 / 1_048_576.0
    );

    // Rebuild every shard's index from the table.
    table.refresh().await?;
    let index_dir = opts.dir.join("index");
    std::fs::remove_dir_all(&index_dir)
        .or_kind(ErrorKind::Storage, || "cannot remove the index".into())?;
    let mut sink = crate::pipeline::upsert_sink_for(&cfg, &table)?;
    let spec = sink.spec.clone();
    let process_peak = peak_rss_bytes().unwrap_or(0);
    // The rebuild's own peak, apart from what the pipeline left resident.
    let resident_before = reset_peak_rss().then(crate::demo::rss_bytes).flatten();
    let started = Instant::now();
    let mut keys = 0;
    for p in 0..opts.partitions {
        let shard = sink.open_shard(&topic, p)?;
        keys += crate::rebuild::rebuild(shard, &spec, &table, &cfg.pipeline_id).await?;
    }
    let secs = started.elapsed().as_secs_f64();
    let mib = |b: u64| b as f64 / 1_048_576.0;
    let peak = peak_rss_bytes().unwrap_or(0);
    match resident_before {
        Some(before) => println!(
            "index rebuild: {keys} keys in {secs:.1}s, {:.0} keys/s, peak RSS during the rebuild {:.0} MiB ({:.0} MiB resident before it; whole process {:.0} MiB)",
            keys as f64 / secs,
            mib(peak),
            mib(before),
            mib(peak.max(process_peak))
        ),
        None => println!(
            "index rebuild: {keys} keys in {secs:.1}s, {:.0} keys/s, peak RSS {:.0} MiB",
            keys as f64 / secs,
            mib(peak)
        ),
    }
    Ok(())
}

/// Resets the process's peak RSS to its current RSS (Linux); false where that is unsupported.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}
