//! `inlet bench-sync`: a whole database through one pipeline. Produces a Debezium stream to a
//! topic per table (as Debezium's default layout does), runs one routed upsert pipeline over
//! them all by `kafka.topic_pattern` as a process of its own, and prints the time to its first
//! commit, the time until every table holds its topic's end offsets, records/s, peak RSS, the
//! most file descriptors it held open, its threads and its RocksDB instances.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rdkafka::producer::FutureRecord;
use serde_json::json;

use crate::bench::{create_topics, delivered, producer, send, Rng};
use crate::commit::table_offsets;
use crate::config::Config;
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_iceberg::Table;

/// What to generate and run.
pub struct SyncOptions {
    pub bootstrap: String,
    /// Upstream tables, each with a topic of its own.
    pub tables: usize,
    /// Keys per table.
    pub keys: u64,
    /// Changes in all, spread over the tables.
    pub ops: u64,
    /// Partitions of each table's topic.
    pub partitions: i32,
    pub dir: PathBuf,
    /// The `inlet` binary to run the pipeline with (this one when `None`).
    pub binary: Option<PathBuf>,
    /// `checkpoint.interval_ms` of the pipeline.
    pub checkpoint_ms: u64,
}

/// Runs the benchmark and prints its numbers.
pub async fn run(opts: SyncOptions) -> Result<()> {
    std::fs::create_dir_all(&opts.dir).or_kind(ErrorKind::Storage, || {
        format!("cannot create {}", opts.dir.display())
    })?;
    let prefix = format!("sync{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let topics: Vec<String> = (0..opts.tables)
        .map(|i| format!("{prefix}.db.t{i:04}"))
        .collect();
    let ends = produce(&opts, &topics).await?;

    let yaml = format!(
        r#"pipeline_id: sync
kafka:
  bootstrap_servers: "{bootstrap}"
  group_id: inlet-bench-sync-{prefix}
  topic_pattern: '{prefix}[.]db[.].*'
  properties: {{session.timeout.ms: "6000"}}
table:
  mode: upsert
routing:
  by: topic
  namespace: bench
  name: "{{topic}}"
index:
  dir: "{dir}/index-{prefix}"
catalog:
  uri: "sqlite://{dir}/catalog-{prefix}.db"
  warehouse: "{dir}/warehouse-{prefix}"
checkpoint:
  interval_ms: {checkpoint_ms}
  max_records: 500000
metrics:
  listen: ""
"#,
        bootstrap = opts.bootstrap,
        dir = opts.dir.display(),
        checkpoint_ms = opts.checkpoint_ms,
    );
    let cfg = Config::from_yaml_with_env(&yaml)?;
    let path = opts.dir.join(format!("{prefix}.yaml"));
    let log = opts.dir.join(format!("{prefix}.log"));
    std::fs::write(&path, &yaml).or_kind(ErrorKind::Storage, || {
        format!("cannot write {}", path.display())
    })?;
    let binary = match &opts.binary {
        Some(b) => b.clone(),
        None => std::env::current_exe()
            .or_kind(ErrorKind::Internal, || "cannot find this executable".into())?,
    };
    let started = Instant::now();
    let mut child = crate::bench::spawn_run(&binary, &path, &log, "warn")?;
    let pid = child.id().unwrap_or_default().to_string();

    let catalog = inlet_iceberg::catalog::Catalog::connect(&cfg.catalog.settings()?).await?;
    let io_ = inlet_iceberg::io::FileIO::new(cfg.storage.settings()?);
    // Each table's metadata location as last read, and its topic's offsets there.
    let mut seen: BTreeMap<String, (String, BTreeMap<i32, i64>)> = BTreeMap::new();
    let (mut first_commit, mut most_files, mut most_threads) = (None, 0usize, 0usize);
    let total: i64 = ends.values().flat_map(|m| m.values()).sum();
    let mut committed_at_first = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Ok(Some(status)) = child.try_wait() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("the pipeline exited with {status}; see {}", log.display()),
            ));
        }
        most_files = most_files.max(count_entries(&format!("/proc/{pid}/fd")));
        most_threads = most_threads.max(count_entries(&format!("/proc/{pid}/task")));
        for ((namespace, name), at) in catalog.list_locations().await? {
            let Some(at) = at else { continue };
            if seen.get(&name).is_some_and(|(l, _)| *l == at) {
                continue;
            }
            let Some(table) = Table::load(&catalog, &io_, &namespace, &name).await? else {
                continue;
            };
            let topic = topics
                .iter()
                .find(|t| t.replace('.', "_") == name)
                .cloned()
                .unwrap_or_default();
            let offsets = table_offsets(&table.metadata, "sync")?
                .remove(&topic)
                .unwrap_or_default();
            seen.insert(name, (at, offsets));
        }
        let done: i64 = seen.values().flat_map(|(_, o)| o.values()).sum();
        if done > 0 && first_commit.is_none() {
            first_commit = Some(started.elapsed());
            committed_at_first = done;
        }
        if done >= total {
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let peak_rss = crate::demo::process_status_bytes(&pid, "VmHWM:").unwrap_or(0);
    let cpu = crate::bench::process_cpu_secs(&pid).unwrap_or(0.0);
    crate::bench::stop(&mut child, &pid).await;
    let indexes = count_indexes(&opts.dir.join(format!("index-{prefix}")).join("sync"));
    let first = first_commit.map_or(0.0, |d| d.as_secs_f64());
    println!(
        "database sync of {} tables ({} partition(s) each, {} changes over {} keys a table, checkpoints every {} ms): first commit after {first:.1}s, every table at its topic's end after {secs:.1}s; {:.0} records/s ({:.0}/s after the first commit); CPU {:.2} µs a record; peak RSS {:.0} MiB; at most {most_files} open files and {most_threads} threads; {indexes} RocksDB instances",
        opts.tables,
        opts.partitions,
        opts.ops,
        opts.keys,
        opts.checkpoint_ms,
        opts.ops as f64 / secs,
        (total - committed_at_first) as f64 / (secs - first).max(1e-9),
        cpu * 1e6 / opts.ops.max(1) as f64,
        peak_rss as f64 / 1_048_576.0,
    );
    Ok(())
}

/// Entries of a directory (a process's open files or threads), 0 if it cannot be read.
fn count_entries(dir: &str) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

/// Index shards below the pipeline's index directory (`<table>/<topic>-<partition>/db`).
fn count_indexes(root: &Path) -> usize {
    let Ok(tables) = std::fs::read_dir(root) else {
        return 0;
    };
    tables
        .flatten()
        .filter_map(|t| std::fs::read_dir(t.path()).ok())
        .flat_map(|shards| shards.flatten())
        .filter(|s| s.path().join("db").join("CURRENT").exists())
        .count()
}

/// Creates the topics and produces `opts.ops` changes over them (table `i % tables` for the
/// i-th); returns each topic's end offsets.
async fn produce(
    opts: &SyncOptions,
    topics: &[String],
) -> Result<BTreeMap<String, BTreeMap<i32, i64>>> {
    create_topics(&opts.bootstrap, topics, opts.partitions).await?;
    let producer = producer(&opts.bootstrap)?;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut ends: BTreeMap<String, BTreeMap<i32, i64>> = BTreeMap::new();
    let mut acks = Vec::new();
    let started = Instant::now();
    let tables = topics.len().max(1) as u64;
    for i in 0..opts.ops {
        let topic = &topics[(i % tables) as usize];
        // The table's own sequence: its first `keys` changes insert, the rest update or
        // delete (a third of those deletes).
        let n = i / tables;
        let (id, op) = if n < opts.keys {
            (n, "c")
        } else {
            (
                rng.below(opts.keys),
                if rng.below(10) < 8 { "u" } else { "d" },
            )
        };
        let status = ["new", "paid", "shipped"][rng.below(3) as usize];
        let row = json!({
            "id": id,
            "status": status,
            "amount": format!("{}.{:02}", rng.below(100_000), rng.below(100)),
            "updated_at": 1_767_225_600_000u64 + i,
        });
        let (before, after) = match op {
            "d" => (Some(row), None),
            _ => (None, Some(row)),
        };
        let lsn = 1000 + i;
        let value = json!({"before": before, "after": after, "op": op, "ts_ms": lsn,
                           "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": lsn}})
        .to_string();
        let key = json!({"id": id}).to_string();
        let partition = (id % opts.partitions as u64) as i32;
        let record = FutureRecord::to(topic)
            .partition(partition)
            .key(&key)
            .payload(&value);
        acks.push((topic.clone(), partition, send(&producer, record).await));
        if acks.len() >= 100_000 {
            settle(&mut acks, &mut ends).await?;
        }
    }
    settle(&mut acks, &mut ends).await?;
    println!(
        "produced {} changes to {} topics in {:.1}s",
        opts.ops,
        topics.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(ends)
}

type Ack = (String, i32, rdkafka::producer::DeliveryFuture);

/// Waits for the acknowledgements and notes each partition's end.
async fn settle(
    acks: &mut Vec<Ack>,
    ends: &mut BTreeMap<String, BTreeMap<i32, i64>>,
) -> Result<()> {
    for (topic, partition, ack) in acks.drain(..) {
        let result = ack.await;
        if let Ok(Ok(delivery)) = &result {
            let end = ends.entry(topic).or_default().entry(partition).or_insert(0);
            *end = (*end).max(delivery.offset + 1);
        }
        delivered(result)?;
    }
    Ok(())
}
