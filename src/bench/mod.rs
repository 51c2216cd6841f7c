//! `inlet bench`: throughput and memory of the real upsert pipeline on a generated Debezium
//! stream, the decode-only rate of the same stream, and the index rebuild rate. It needs a real
//! Kafka-protocol broker (`--bootstrap`): the embedded one keeps too little for a benchmark.

mod formats;
mod recovery;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use serde_json::json;

use crate::commit::table_offsets;
use crate::config::Config;
use crate::pipeline::open_table;
pub use formats::decode_formats;
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_decode::debezium::DebeziumJson;
use inlet_decode::{Column, Decoded, Decoder, Shape};
use recovery::{commit_history, commit_latencies, failover_from_copies, rebuild_all};

/// What to generate.
pub struct BenchOptions {
    pub bootstrap: String,
    pub keys: u64,
    pub ops: u64,
    pub partitions: i32,
    pub dir: PathBuf,
    /// Warehouses the pipeline runs into, one after the other on the same stream (a local
    /// directory below `dir` when empty); `s3://…` ones are reached through the standard AWS
    /// environment.
    pub warehouses: Vec<String>,
    /// Commits timed per warehouse for the commit latency percentiles.
    pub commits: usize,
    /// A topic to reuse when it holds the stream already (produced to when empty or missing).
    pub topic: Option<String>,
    /// `inlet` binaries to run the pipeline with, each as a process of its own on the same
    /// stream (this one when empty): old and new builds side by side.
    pub pipelines: Vec<PathBuf>,
    /// Runs of each binary, taking turns.
    pub rounds: usize,
    /// Stages left out: `decode`, `commits`, `history`, `failover`, `rebuild`.
    pub skip: Vec<String>,
    /// Configurations to compare, as (label, YAML merged into the run's configuration), e.g.
    /// `("off", "services: {compact: false}")`; each binary runs once per variant. None: one
    /// run on the defaults.
    pub variants: Vec<(String, String)>,
    /// A Python with pyiceberg: each run's table is then scanned whole with it and timed.
    pub python: Option<PathBuf>,
    /// Commits of the table-history stage.
    pub history: usize,
    /// Instances of each pipeline run at once, in one consumer group (each count a run).
    pub instances: Vec<usize>,
    /// Seconds a pipeline may keep running after its last commit while its compaction works
    /// off what is due; 0 stops it at the last commit.
    pub drain_secs: u64,
}

/// A small deterministic generator (xorshift), so the decode pass sees the same stream.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
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

/// The run's configuration: the benchmark's own, with `variant` (a YAML mapping) merged in.
fn config_yaml(
    opts: &BenchOptions,
    topic: &str,
    run: usize,
    warehouse: &str,
    variant: &str,
) -> Result<String> {
    let base = base_yaml(opts, topic, run, warehouse);
    if variant.trim().is_empty() {
        return Ok(base);
    }
    let parse = |text: &str| {
        serde_yaml::from_str::<serde_yaml::Value>(text).or_kind(ErrorKind::Config, || {
            format!("bench variant {text:?} is no YAML")
        })
    };
    let mut merged = parse(&base)?;
    merge_yaml(&mut merged, parse(variant)?);
    serde_yaml::to_string(&merged).or_kind(ErrorKind::Internal, || "cannot print YAML".into())
}

/// Merges `extra` into `base`: mappings key by key, anything else replaced.
pub(crate) fn merge_yaml(base: &mut serde_yaml::Value, extra: serde_yaml::Value) {
    match (base, extra) {
        (serde_yaml::Value::Mapping(b), serde_yaml::Value::Mapping(e)) => {
            for (k, v) in e {
                match b.get_mut(&k) {
                    Some(old) => merge_yaml(old, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, e) => *b = e,
    }
}

fn base_yaml(opts: &BenchOptions, topic: &str, run: usize, warehouse: &str) -> String {
    bench_yaml(&opts.bootstrap, &opts.dir, topic, run, warehouse)
}

/// The benchmark's pipeline configuration for run `run`: catalog and index below `dir`.
pub(crate) fn bench_yaml(
    bootstrap: &str,
    dir: &std::path::Path,
    topic: &str,
    run: usize,
    warehouse: &str,
) -> String {
    format!(
        r#"pipeline_id: bench-{run}
kafka:
  bootstrap_servers: "{bootstrap}"
  group_id: inlet-bench-{topic}-{run}-{bench}
  topics: [{topic}]
  properties: {{session.timeout.ms: "6000"}}
index:
  dir: "{dir}/index-{run}"
table:
  namespace: bench
  name: orders_{run}
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
  warehouse: "{warehouse}"
checkpoint:
  interval_ms: 10000
  max_records: 500000
metrics:
  listen: ""
"#,
        dir = dir.display(),
        // A group of this bench's own: another bench's pipelines on the same topic never
        // share it.
        bench = std::process::id(),
    )
}

/// Runs the benchmark and prints its numbers.
pub async fn run(opts: BenchOptions) -> Result<()> {
    std::fs::create_dir_all(&opts.dir).or_kind(ErrorKind::Storage, || {
        format!("cannot create {}", opts.dir.display())
    })?;
    let topic = match &opts.topic {
        Some(t) => t.clone(),
        None => format!("bench-{}", uuid::Uuid::new_v4().simple()),
    };
    let bytes = produce(&opts, &topic).await?;
    let skip = |stage: &str| opts.skip.iter().any(|s| s == stage);

    let warehouses = if opts.warehouses.is_empty() {
        vec![opts.dir.join("warehouse").display().to_string()]
    } else {
        opts.warehouses.clone()
    };
    let base = Config::from_yaml_with_env(&config_yaml(&opts, &topic, 0, &warehouses[0], "")?)?;
    let variants = if opts.variants.is_empty() {
        vec![(String::new(), String::new())]
    } else {
        opts.variants.clone()
    };
    let instance_counts = if opts.instances.is_empty() {
        vec![1]
    } else {
        opts.instances.clone()
    };
    if !skip("decode") {
        decode_only(&opts, &base, bytes)?;
    }

    // Every binary runs the pipeline as a process of its own, in turns, on the same stream.
    let current = std::env::current_exe()
        .or_kind(ErrorKind::Internal, || "cannot find this executable".into())?;
    let binaries = if opts.pipelines.is_empty() {
        vec![current]
    } else {
        opts.pipelines.clone()
    };
    let mut runs: Vec<(String, PipelineRun)> = Vec::new();
    let mut first: Option<Config> = None;
    let mut run_id = 0;
    for _ in 0..opts.rounds.max(1) {
        for binary in &binaries {
            for (name, variant) in &variants {
                for &instances in &instance_counts {
                    for warehouse in &warehouses {
                        let yaml = config_yaml(&opts, &topic, run_id, warehouse, variant)?;
                        let cfg = Config::from_yaml_with_env(&yaml)?;
                        let mut label = format!("{} into {warehouse}", binary.display());
                        if !name.is_empty() {
                            label = format!("{label} ({name})");
                        }
                        if instances > 1 {
                            label = format!("{label}, {instances} instances");
                        }
                        let r = run_child(binary, &cfg, &yaml, &opts, run_id, instances).await?;
                        let shape = table_shape(&cfg, opts.python.as_deref()).await?;
                        println!(
                    "pipeline {label}: {:.0} records/s ({:.0}/s after the first commit), {:.1} MB/s, {:.1}s incl. group join; CPU {:.0}%, {:.2} µs a record ({:.2} µs decoding, {:.2} µs the rest); peak RSS {:.0} MiB; commits {:.1}s, consumption stopped {}; {shape}",
                    opts.ops as f64 / r.secs,
                    r.steady_per_sec,
                    bytes as f64 / 1e6 / r.secs,
                    r.secs,
                    r.cpu_percent,
                    us_per_record(opts.ops, r.cpu_secs),
                    us_per_record(opts.ops, r.decode_cpu_secs),
                    us_per_record(opts.ops, r.cpu_secs - r.decode_cpu_secs),
                    r.peak_rss as f64 / 1_048_576.0,
                    r.commit_secs,
                    r.stopped_secs
                        .map_or("n/a".into(), |s| format!("{s:.1}s ({:.1}% of the run)", 100.0 * s / r.secs)),
                );
                        if let Some((location, secs)) = &r.drained {
                            println!(
                                "  at the last commit: {}; compaction ran on {secs:.1}s",
                                scan_at(location, opts.python.as_deref()).await?
                            );
                        }
                        if let Some((source, decode)) = r.idle_secs {
                            println!(
                                "  idle, nothing to apply: waiting for the source {source:.1}s, for decoding {decode:.1}s"
                            );
                        }
                        runs.push((label, r));
                        first.get_or_insert(cfg);
                        run_id += 1;
                    }
                }
            }
        }
    }
    if runs.len() > binaries.len() * variants.len() * instance_counts.len() * warehouses.len() {
        println!(
            "| pipeline | runs | records/s (median) | CPU % | CPU µs a record, outside decoding | peak RSS MiB | consumption stopped |"
        );
        println!("|---|---|---|---|---|---|---|");
        let mut labels: Vec<&String> = runs.iter().map(|(l, _)| l).collect();
        labels.dedup();
        labels.sort();
        labels.dedup();
        for label in labels {
            let of: Vec<&PipelineRun> = runs
                .iter()
                .filter(|(l, _)| l == label)
                .map(|(_, r)| r)
                .collect();
            let median = |f: &dyn Fn(&PipelineRun) -> f64| {
                let mut v: Vec<f64> = of.iter().map(|r| f(r)).collect();
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            println!(
                "| {label} | {} | {:.0} | {:.0} | {:.2} | {:.0} | {} |",
                of.len(),
                median(&|r| opts.ops as f64 / r.secs),
                median(&|r| r.cpu_percent),
                median(&|r| us_per_record(opts.ops, r.cpu_secs - r.decode_cpu_secs)),
                median(&|r| r.peak_rss as f64 / 1_048_576.0),
                if of.iter().all(|r| r.stopped_secs.is_some()) {
                    format!(
                        "{:.1}%",
                        median(&|r| 100.0 * r.stopped_secs.unwrap_or(0.0) / r.secs)
                    )
                } else {
                    "n/a".into()
                }
            );
        }
    }
    let cfg = first.unwrap_or(base);

    if !skip("commits") {
        for warehouse in &warehouses {
            let mut c = cfg.clone();
            c.catalog.warehouse = warehouse.clone();
            let mut ms = commit_latencies(&c, opts.commits.max(2)).await?;
            ms.sort_by(f64::total_cmp);
            let pct = |p: f64| ms[((ms.len() - 1) as f64 * p).round() as usize];
            println!(
                "commit latency into {warehouse} ({} commits of one data file): p50 {:.1} ms, p99 {:.1} ms",
                ms.len(),
                pct(0.5),
                pct(0.99)
            );
        }
    }
    if !skip("history") {
        commit_history(&cfg, opts.history).await?;
    }
    if skip("failover") && skip("rebuild") {
        return Ok(());
    }
    let mut table = open_table(&cfg).await?;
    table.refresh().await?;
    if !skip("failover") {
        failover_from_copies(&cfg, &table, &topic, &opts).await?;
    }
    if !skip("rebuild") {
        rebuild_all(&cfg, &table, &topic, &opts).await?;
    }
    Ok(())
}

/// Produces the stream to `topic`, unless the topic holds it already; returns its JSON bytes.
async fn produce(opts: &BenchOptions, topic: &str) -> Result<u64> {
    let bytes = || {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        (0..opts.ops)
            .map(|i| change(&mut rng, i, opts, 1000 + i).2.len() as u64)
            .sum::<u64>()
    };
    let consumer: rdkafka::consumer::BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &opts.bootstrap)
        .create()
        .or_kind(ErrorKind::Kafka, || "cannot create a client".into())?;
    let held = tokio::task::block_in_place(|| -> Result<Option<i64>> {
        use rdkafka::consumer::Consumer;
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .or_kind(ErrorKind::Kafka, || "cannot read topic metadata".into())?;
        let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
            return Ok(None);
        };
        if t.partitions().is_empty() {
            return Ok(None);
        }
        let mut sum = 0;
        for p in t.partitions() {
            let (_, high) = consumer
                .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
                .or_kind(ErrorKind::Kafka, || "cannot read watermarks".into())?;
            sum += high;
        }
        Ok(Some(sum))
    })?;
    // Some brokers report a high watermark short of the last batch; a named topic that holds
    // messages is taken to hold this stream.
    if let Some(n) = held.filter(|n| *n > 0) {
        println!("reusing topic {topic} ({n} messages by its high watermarks)");
        return Ok(bytes());
    }
    if held.is_none() {
        create_topics(&opts.bootstrap, &[topic.to_string()], opts.partitions).await?;
    }
    let producer = producer(&opts.bootstrap)?;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut bytes = 0u64;
    let started = Instant::now();
    let mut acks = Vec::new();
    for i in 0..opts.ops {
        let (p, key, value) = change(&mut rng, i, opts, 1000 + i);
        bytes += value.len() as u64;
        let record = FutureRecord::to(topic)
            .partition(p)
            .key(&key)
            .payload(&value);
        acks.push(send(&producer, record).await);
        if acks.len() >= 100_000 {
            for ack in acks.drain(..) {
                delivered(ack.await)?;
            }
        }
    }
    for ack in acks {
        delivered(ack.await)?;
    }
    println!(
        "produced {} changes ({:.1} MB) over {} keys to {topic} in {:.1}s",
        opts.ops,
        bytes as f64 / 1e6,
        opts.keys,
        started.elapsed().as_secs_f64()
    );
    Ok(bytes)
}

/// Creates `topics` with `partitions` each, 50 to a request.
pub(crate) async fn create_topics(
    bootstrap: &str,
    topics: &[String],
    partitions: i32,
) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .or_kind(ErrorKind::Kafka, || "cannot create admin client".into())?;
    for chunk in topics.chunks(50) {
        let new: Vec<NewTopic> = chunk
            .iter()
            .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(1)))
            .collect();
        for r in admin
            .create_topics(&new, &AdminOptions::new())
            .await
            .or_kind(ErrorKind::Kafka, || "cannot create topics".into())?
        {
            r.map_err(|(t, e)| {
                Error::new(ErrorKind::Kafka, format!("cannot create topic {t}: {e}"))
            })?;
        }
    }
    Ok(())
}

/// The producer of generated streams: batches of up to 20 ms, a deep queue.
pub(crate) fn producer(bootstrap: &str) -> Result<FutureProducer> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .or_kind(ErrorKind::Kafka, || "cannot create producer".into())
}

/// Sends `record`, waiting while the producer's queue is full.
pub(crate) async fn send(
    producer: &FutureProducer,
    mut record: FutureRecord<'_, String, String>,
) -> rdkafka::producer::DeliveryFuture {
    loop {
        match producer.send_result(record) {
            Ok(ack) => return ack,
            Err((_, r)) => {
                record = r;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

pub(crate) fn delivered(
    ack: std::result::Result<
        rdkafka::producer::future_producer::OwnedDeliveryResult,
        futures::channel::oneshot::Canceled,
    >,
) -> Result<()> {
    ack.map_err(|_| Error::new(ErrorKind::Kafka, "producer went away"))?
        .map_err(|(e, _)| Error::new(ErrorKind::Kafka, "not delivered").with_source(e))?;
    Ok(())
}

/// Decodes and types the stream on one thread, without Kafka: the per-core bound of the
/// pipeline. Messages are generated in chunks outside the timing.
fn decode_only(opts: &BenchOptions, cfg: &Config, bytes: u64) -> Result<()> {
    let columns: Vec<Column> = cfg
        .table
        .columns
        .iter()
        .map(|c| {
            Ok(Column {
                name: c.name.clone(),
                ty: inlet_iceberg::types::Type::parse(&c.ty)?,
                required: c.required,
                time_unit: c.time_unit,
            })
        })
        .collect::<Result<_>>()?;
    let shape = Shape::new(columns);
    let decoder = DebeziumJson;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    // The pipeline's way (typed straight from the text, as decoding threads do while a
    // table's shape is published) and the general way (decode, then type), taking turns.
    let (mut at_once, mut general) = (Duration::ZERO, Duration::ZERO);
    let mut i = 0;
    while i < opts.ops {
        let chunk: Vec<(String, String)> = (i..(i + 100_000).min(opts.ops))
            .map(|i| {
                let (_, k, v) = change(&mut rng, i, opts, 1000 + i);
                (k, v)
            })
            .collect();
        i += chunk.len() as u64;
        let started = Instant::now();
        for (key, value) in &chunk {
            let (key, value) = (key.as_bytes(), value.as_bytes());
            if decoder.decode_typed(Some(key), value, &shape).is_none() {
                decode_then_type(&decoder, &shape, key, value)?;
            }
        }
        at_once += started.elapsed();
        let started = Instant::now();
        for (key, value) in &chunk {
            decode_then_type(&decoder, &shape, key.as_bytes(), value.as_bytes())?;
        }
        general += started.elapsed();
    }
    let rate = |busy: Duration| opts.ops as f64 / busy.as_secs_f64();
    println!(
        "decode only, one core: {:.0} records/s, {:.1} MB/s (decoded, then typed: {:.0} records/s)",
        rate(at_once),
        bytes as f64 / 1e6 / at_once.as_secs_f64(),
        rate(general)
    );
    Ok(())
}

/// Decodes a message and types its changes, the way every format goes.
fn decode_then_type(decoder: &dyn Decoder, shape: &Shape, key: &[u8], value: &[u8]) -> Result<()> {
    for decoded in decoder.decode(Some(key), Some(value))? {
        if let Decoded::Change(raw) = decoded {
            shape.record(&raw)?;
        }
    }
    Ok(())
}

/// What one pipeline process did.
struct PipelineRun {
    /// From start to the table holding every offset, group join included.
    secs: f64,
    /// Records per second from the first commit on.
    steady_per_sec: f64,
    /// User and system CPU of the process over `secs`, in percent of one core.
    cpu_percent: f64,
    /// CPU seconds of the processes, and of their decoding threads (summed over instances).
    cpu_secs: f64,
    decode_cpu_secs: f64,
    peak_rss: u64,
    /// Seconds spent in checkpoint commits (the commit duration histogram's sum).
    commit_secs: f64,
    /// Seconds consumption stood still waiting for checkpoints, where the binary reports it.
    stopped_secs: Option<f64>,
    /// Seconds the pipeline waited for the source and for decoding, where the binary reports
    /// it (summed over instances).
    idle_secs: Option<(f64, f64)>,
    /// With `drain_secs`: the table's metadata at the last commit, and the seconds the
    /// compaction ran on after it.
    drained: Option<(String, f64)>,
}

/// CPU microseconds a record, of `cpu_secs` spent on `ops` records.
fn us_per_record(ops: u64, cpu_secs: f64) -> f64 {
    cpu_secs * 1e6 / ops.max(1) as f64
}

/// `command`, set to be killed when the process that starts it ends, however it ends: a bench
/// killed from outside would otherwise leave its pipelines running, taking CPU from the next
/// bench's and holding its consumer group. `kill_on_drop` covers only an orderly end.
fn dies_with_parent(mut command: tokio::process::Command) -> tokio::process::Command {
    #[cfg(target_os = "linux")]
    {
        use std::ffi::{c_int, c_ulong};
        const PR_SET_PDEATHSIG: c_int = 1;
        const SIGKILL: c_ulong = 9;
        unsafe extern "C" {
            fn prctl(option: c_int, ...) -> c_int;
        }
        // SAFETY: runs in the child between fork and exec, and calls only `prctl`, which is
        // async-signal-safe. The signal follows the thread that forks: the bench's
        // `block_on`, on the main thread, which lives as long as the bench.
        unsafe {
            command.pre_exec(|| match prctl(PR_SET_PDEATHSIG, SIGKILL) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            });
        }
    }
    command
}

/// Starts `binary run --config config` with its output in `log`, logging at `INLET_LOG` or
/// else `level`, killed when this process ends however it ends.
pub(crate) fn spawn_run(
    binary: &std::path::Path,
    config: &std::path::Path,
    log: &std::path::Path,
    level: &str,
) -> Result<tokio::process::Child> {
    let io = |what: &str| format!("cannot {what} {}", log.display());
    let out = std::fs::File::create(log).or_kind(ErrorKind::Storage, || io("create"))?;
    let err = out.try_clone().or_kind(ErrorKind::Storage, || io("open"))?;
    dies_with_parent(tokio::process::Command::new(binary))
        .args(["run", "--config"])
        .arg(config)
        .env(
            "INLET_LOG",
            std::env::var("INLET_LOG").unwrap_or_else(|_| level.into()),
        )
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .or_kind(ErrorKind::Internal, || {
            format!("cannot start {}", binary.display())
        })
}

/// Stops a pipeline started by [`spawn_run`] as an operator would (SIGTERM: it commits what it
/// buffered), killing it after a minute.
pub(crate) async fn stop(child: &mut tokio::process::Child, pid: &str) {
    let _ = std::process::Command::new("kill")
        .args(["-TERM", pid])
        .status();
    if tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

/// Runs `instances` processes of `binary run` on `cfg` (one consumer group, an index directory
/// each) until their table holds every offset of the stream.
async fn run_child(
    binary: &std::path::Path,
    cfg: &Config,
    yaml: &str,
    opts: &BenchOptions,
    run: usize,
    instances: usize,
) -> Result<PipelineRun> {
    let io = |what: &str, p: &std::path::Path| format!("cannot {what} {}", p.display());
    let mut table = open_table(cfg).await?;
    let started = Instant::now();
    let mut children = Vec::new();
    for i in 0..instances.max(1) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .or_kind(ErrorKind::Internal, || "cannot find a free port".into())?
            .port();
        let mut own: serde_yaml::Value = serde_yaml::from_str(yaml)
            .or_kind(ErrorKind::Internal, || {
                "the run's configuration is no YAML".into()
            })?;
        // Every instance has an index directory of its own.
        let index = match instances {
            0 | 1 => cfg.index.dir.clone(),
            _ => format!("{}-{i}", cfg.index.dir),
        };
        merge_yaml(
            &mut own,
            serde_yaml::from_str(&format!(
                "{{metrics: {{listen: \"127.0.0.1:{port}\"}}, index: {{dir: \"{index}\"}}}}"
            ))
            .or_kind(ErrorKind::Internal, || "bad instance YAML".into())?,
        );
        let own = serde_yaml::to_string(&own)
            .or_kind(ErrorKind::Internal, || "cannot print YAML".into())?;
        let path = opts.dir.join(format!("run-{run}-{i}.yaml"));
        let log = opts.dir.join(format!("run-{run}-{i}.log"));
        std::fs::write(&path, own).or_kind(ErrorKind::Storage, || io("write", &path))?;
        let child = spawn_run(binary, &path, &log, "warn")?;
        let pid = child.id().unwrap_or_default().to_string();
        children.push((child, pid, port, log));
    }
    let mut first: Option<(Instant, i64)> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        for (child, _, _, log) in &mut children {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(Error::new(
                    ErrorKind::Internal,
                    format!(
                        "{} exited with {status}; see {}",
                        binary.display(),
                        log.display()
                    ),
                ));
            }
        }
        table.refresh().await?;
        let done: i64 = table_offsets(&table.metadata, &cfg.pipeline_id)?
            .values()
            .flat_map(|m| m.values())
            .sum();
        if done > 0 && first.is_none() {
            first = Some((Instant::now(), done));
        }
        if done >= opts.ops as i64 {
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let (mut cpu, mut peak_rss, mut commit_secs, mut stopped) = (0.0, 0, 0.0, None);
    let mut decode_cpu = 0.0;
    let mut idle: Option<(f64, f64)> = None;
    for (_, pid, port, _) in &children {
        cpu += process_cpu_secs(pid).unwrap_or(0.0);
        decode_cpu += threads_cpu_secs(pid, DECODE_THREAD_PREFIX);
        peak_rss += crate::demo::process_status_bytes(pid, "VmHWM:").unwrap_or(0);
        let metrics = match reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        commit_secs += metric_value(&metrics, "inlet_commit_duration_seconds_sum").unwrap_or(0.0);
        if let Some(s) = metric_value(&metrics, "inlet_checkpoint_blocking_seconds_total") {
            // The instance that stood still longest.
            stopped = Some(stopped.map_or(s, |m: f64| m.max(s)));
        }
        let waited = |what: &str| {
            metric_value(
                &metrics,
                &format!("inlet_pipeline_idle_seconds_total{{waiting_for=\"{what}\"}}"),
            )
        };
        if let (Some(source), Some(decode)) = (waited("source"), waited("decode")) {
            let (s, d) = idle.unwrap_or((0.0, 0.0));
            idle = Some((s + source, d + decode));
        }
    }
    let steady_per_sec = first.map_or(0.0, |(at, n)| {
        (opts.ops as i64 - n) as f64 / at.elapsed().as_secs_f64().max(1e-9)
    });
    let mut drained = None;
    if opts.drain_secs > 0 {
        // Kept aside: the drain's commits may delete old metadata files.
        let kept = opts
            .dir
            .join(format!("run-{run}-last-commit.metadata.json"));
        let metadata = table.io.get(&table.metadata_location).await?;
        std::fs::write(&kept, &metadata).or_kind(ErrorKind::Storage, || io("write", &kept))?;
        let ports: Vec<u16> = children.iter().map(|c| c.2).collect();
        let secs = drain(&ports, opts.drain_secs).await;
        drained = Some((kept.display().to_string(), secs));
    }
    for (child, pid, _, _) in &mut children {
        stop(child, pid).await;
    }
    Ok(PipelineRun {
        secs,
        steady_per_sec,
        cpu_percent: 100.0 * cpu / secs,
        cpu_secs: cpu,
        decode_cpu_secs: decode_cpu,
        peak_rss,
        commit_secs,
        stopped_secs: stopped,
        idle_secs: idle,
        drained,
    })
}

/// Waits until no instance's compaction has files due (`inlet_compact_backlog_files` 0, a run
/// ended after the last commit or none for 10 s, and no run for 3 s), at most `secs`; returns
/// the seconds waited.
async fn drain(ports: &[u16], secs: u64) -> f64 {
    let started = Instant::now();
    let read = |text: &str| {
        let backlog = metric_value(text, "inlet_compact_backlog_files").unwrap_or(0.0);
        let runs: f64 = text
            .lines()
            .filter(|l| {
                l.starts_with("inlet_maintain_runs_total{") && l.contains("service=\"compact\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        (backlog, runs)
    };
    let mut first: Option<f64> = None;
    let (mut last_runs, mut still) = (f64::NAN, Instant::now());
    while started.elapsed() < Duration::from_secs(secs) {
        let (mut backlog, mut runs) = (0.0, 0.0);
        for port in ports {
            let text = match reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            let (b, r) = read(&text);
            backlog += b;
            runs += r;
        }
        let at_end = *first.get_or_insert(runs);
        if runs != last_runs {
            (last_runs, still) = (runs, Instant::now());
        }
        let ran_since = runs > at_end || started.elapsed() >= Duration::from_secs(10);
        if backlog == 0.0 && ran_since && still.elapsed() >= Duration::from_secs(3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    started.elapsed().as_secs_f64()
}

/// What a run left in its table: live data and delete files, and how long a full pyiceberg
/// scan takes when `python` is given.
async fn table_shape(cfg: &Config, python: Option<&std::path::Path>) -> Result<String> {
    use inlet_iceberg::manifest::FileContent;
    let table = open_table(cfg).await?;
    let entries = table.live_entries().await?;
    let data = entries
        .iter()
        .filter(|e| e.data_file.content == FileContent::Data)
        .count();
    let bytes: i64 = entries.iter().map(|e| e.data_file.file_size_in_bytes).sum();
    let mut shape = format!(
        "table {data} data files, {} delete files, {:.0} MiB, {} snapshots",
        entries.len() - data,
        bytes as f64 / 1_048_576.0,
        table.metadata.snapshots.len()
    );
    let Some(python) = python else {
        return Ok(shape);
    };
    let scan = scan_json(python, &table.metadata_location).await?;
    shape.push_str(&format!(
        "; pyiceberg full scan {:.2}s ({} rows)",
        scan["secs"].as_f64().unwrap_or(f64::NAN),
        scan["rows"]
    ));
    Ok(shape)
}

/// The live files of the table at metadata `location`, and a full pyiceberg scan's time, as
/// the scan script reports them.
async fn scan_at(location: &str, python: Option<&std::path::Path>) -> Result<String> {
    let Some(python) = python else {
        return Ok("no Python to scan with".into());
    };
    let scan = scan_json(python, location).await?;
    Ok(format!(
        "{} data files, {} delete files; pyiceberg full scan {:.2}s ({} rows)",
        scan["data_files"],
        scan["delete_files"],
        scan["secs"].as_f64().unwrap_or(f64::NAN),
        scan["rows"]
    ))
}

async fn scan_json(python: &std::path::Path, location: &str) -> Result<serde_json::Value> {
    let out = tokio::process::Command::new(python)
        .args(["-c", SCAN_TIME, location, "3"])
        .output()
        .await
        .or_kind(ErrorKind::Internal, || {
            format!("cannot run {}", python.display())
        })?;
    serde_json::from_slice(&out.stdout).or_kind(ErrorKind::Internal, || {
        format!(
            "the scan printed no JSON: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Times a full scan with pyiceberg (`scripts/scan_time.py`).
const SCAN_TIME: &str = include_str!("../../scripts/scan_time.py");

/// User plus system CPU seconds of process `pid` (all its threads), from `/proc/<pid>/stat`.
pub(crate) fn process_cpu_secs(pid: &str) -> Option<f64> {
    stat_cpu_secs(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// User and system CPU seconds in a `/proc` `stat` line (of a process or a thread).
fn stat_cpu_secs(stat: &str) -> Option<f64> {
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / clock_ticks_per_sec())
}

/// How the pipeline's decoding threads are named ([`inlet_decode::pool::DecodePool`]).
const DECODE_THREAD_PREFIX: &str = "inlet-decode-";

/// CPU seconds of the live threads of process `pid` whose names start with `prefix`.
fn threads_cpu_secs(pid: &str, prefix: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let name = std::fs::read_to_string(t.path().join("comm")).ok()?;
            if !name.trim_end().starts_with(prefix) {
                return None;
            }
            stat_cpu_secs(&std::fs::read_to_string(t.path().join("stat")).ok()?)
        })
        .sum()
}

fn clock_ticks_per_sec() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The value of an unlabelled series in Prometheus text.
pub(crate) fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Resets the process's peak RSS to its current RSS (Linux); false where that is unsupported.
pub(crate) fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Set in the process the test starts: it starts a pipeline stand-in and prints its pid.
    const MIDDLE: &str = "INLET_BENCH_TEST_MIDDLE";

    #[test]
    fn cpu_of_named_threads_counts_only_those_threads() {
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let (busy, spun) = std::sync::mpsc::channel::<()>();
        let spinner = std::thread::Builder::new()
            .name("bench-spin-0".into())
            .spawn(move || {
                let started = Instant::now();
                let mut x = 0_u64;
                while started.elapsed() < Duration::from_millis(400) {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
                busy.send(()).unwrap();
                // Alive while it is measured: only live threads are counted.
                let _ = wait.recv();
            })
            .unwrap();
        spun.recv().unwrap();
        let pid = std::process::id().to_string();
        let spinning = threads_cpu_secs(&pid, "bench-spin-");
        let process = process_cpu_secs(&pid).unwrap();
        done.send(()).unwrap();
        spinner.join().unwrap();
        // 400 ms of wall time, some of it maybe waiting for a core; ticks are 10 ms.
        assert!(spinning >= 0.1, "{spinning}");
        assert!(spinning <= process + 0.011, "{spinning} > {process}");
        assert_eq!(threads_cpu_secs(&pid, "no-such-thread-"), 0.0);
        assert_eq!(threads_cpu_secs("0", "bench-spin-"), 0.0);
        assert!((us_per_record(4, 2e-6) - 0.5).abs() < 1e-12);
    }

    #[tokio::test]
    async fn a_pipeline_started_by_a_killed_bench_ends_with_it() {
        const NAME: &str = "bench::tests::a_pipeline_started_by_a_killed_bench_ends_with_it";
        if std::env::var_os(MIDDLE).is_some() {
            let child = dies_with_parent(tokio::process::Command::new("sleep"))
                .arg("300")
                .spawn()
                .unwrap();
            println!("pipeline pid {}", child.id().unwrap());
            std::mem::forget(child);
            tokio::time::sleep(Duration::from_secs(300)).await;
            return;
        }
        let mut bench = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--test-threads", "1", "--nocapture"])
            .env(MIDDLE, "1")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut said = String::new();
        let stdout = bench.stdout.take().unwrap();
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let pid = loop {
            let line = lines.next().expect("the stand-in's pid").unwrap();
            said.push_str(&line);
            // The harness prints the test's name on the same line first.
            if let Some((_, pid)) = line.split_once("pipeline pid ") {
                break pid.trim().to_string();
            }
        };
        let alive = |pid: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|stat| !stat.contains(") Z "))
        };
        assert!(alive(&pid), "{said}");
        bench.kill().unwrap();
        bench.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive(&pid) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let orphaned = alive(&pid);
        if orphaned {
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid])
                .status();
        }
        assert!(!orphaned, "pid {pid} outlived the bench that started it");
    }
}
