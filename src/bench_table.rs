//! `inlet bench-table`: what a big upsert table costs, without a topic of its size. The table
//! of `inlet bench` is written directly, N keys spread over the shards as the pipeline places
//! them, and committed in a few large checkpoints; then every shard's index is rebuilt from it
//! and measured, and (with a broker) `inlet run` restarts on the persisted index and commits a
//! few changes; with `--failover` it also starts where no index is, rebuilding every shard from
//! the table and then restoring every shard from its copy.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use serde_json::json;

use crate::bench::{bench_yaml, delivered, merge_yaml, metric_value, reset_peak_rss, Rng};
use crate::commit::{table_offsets, Checkpoint, Committer, Offsets};
use crate::config::Config;
use crate::demo::{peak_rss_bytes, rss_bytes};
use crate::pipeline::{open_table, upsert_sink_for};
use crate::upsert::WriterTemplate;
use crate::write::shard_file_prefix;
use crate::write::DataWriter;
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_decode::{Version, VersionPart};
use inlet_iceberg::manifest::DataFile;
use inlet_iceberg::types::{encode_values, Value};
use inlet_iceberg::Table;

/// Rows a checkpoint writes at most: what the writers hold in memory is bounded by it.
const CHECKPOINT_ROWS: u64 = 2_000_000;

/// The first change's source position (Debezium `lsn`), as `inlet bench` numbers its stream:
/// key `id` was inserted at `FIRST_LSN + id`.
const FIRST_LSN: u64 = 1000;

/// Stages that produce changes (the restart, and the failover's three runs), each its own
/// keys: round `r`'s change `i` updates key [`changed_key`]`(r * changes + i)`.
pub const ROUNDS: u64 = 4;

/// What to write and measure.
pub struct BenchTableOptions {
    /// Keys in the table (ids `0..keys`).
    pub keys: u64,
    /// Kafka partitions of the source topic, one index shard each.
    pub partitions: i32,
    /// Where the catalog, warehouse and index go; the table must not exist there yet.
    pub dir: PathBuf,
    /// A Kafka-protocol broker: the restart stage runs when given.
    pub bootstrap: Option<String>,
    /// Updates of existing keys the restart stage produces.
    pub changes: u64,
    /// The `inlet` binary the restart stage runs (this one when `None`).
    pub binary: Option<PathBuf>,
    /// After the restart, also time a failover: the pipeline started with no local index,
    /// once rebuilding it from the table and once restoring it from its copy.
    pub failover: bool,
}

impl BenchTableOptions {
    /// Changes each restart stage produces: distinct keys over all stages.
    pub fn changes(&self) -> u64 {
        self.changes.min(self.keys / ROUNDS)
    }
}

/// The numbers of one run.
#[derive(Debug, Clone)]
pub struct BenchTableReport {
    /// The source topic the table's offsets name.
    pub topic: String,
    /// `namespace.name` of the table written.
    pub table: String,
    pub rows: u64,
    pub checkpoints: u64,
    pub data_files: usize,
    pub table_bytes: u64,
    pub write_secs: f64,
    /// The process's peak RSS by the end of the write.
    pub write_peak_rss: u64,
    /// Keys the rebuild loaded into all shards, tombstones included.
    pub rebuilt_keys: u64,
    /// Live keys of all shards after the rebuild (their bucket counts).
    pub live_keys: u64,
    pub rebuild_secs: f64,
    /// The process's peak RSS while the rebuild ran (from its start where the kernel resets it).
    pub rebuild_peak_rss: u64,
    /// Bytes of all shards' index directories after the rebuild, and after a full compaction.
    pub index_bytes: u64,
    pub index_bytes_compacted: u64,
    pub restart: Option<Restart>,
    /// Changes the restart stages produced (the offsets the table holds at the end).
    pub produced: u64,
    /// Failover with no local index: rebuilt from the table, and restored from its copy.
    pub failover: Option<(Restart, Restart)>,
}

/// What `inlet run` did on the persisted index.
#[derive(Debug, Clone)]
pub struct Restart {
    /// From process start to its first snapshot (the claim of its partitions).
    pub first_snapshot_secs: f64,
    /// From process start to the first snapshot that advanced the offsets: the first new commit.
    pub first_commit_secs: f64,
    /// From process start to the table holding every change produced.
    pub all_secs: f64,
    /// Shards the process rebuilt from the table instead of using the index in place.
    pub rebuilt_shards: u64,
    /// Shards it restored from their own index directory.
    pub local_shards: u64,
    /// Shards it restored from their copy beside the table.
    pub copy_shards: u64,
}

/// Writes the table, rebuilds and measures the index, and restarts the pipeline on it.
pub async fn run(opts: BenchTableOptions) -> Result<BenchTableReport> {
    if opts.keys == 0 || opts.partitions < 1 {
        return Err(Error::config(
            "bench-table: --keys and --partitions must be positive",
        ));
    }
    std::fs::create_dir_all(&opts.dir).or_kind(ErrorKind::Storage, || {
        format!("cannot create {}", opts.dir.display())
    })?;
    let topic = format!(
        "bigtable-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let warehouse = opts.dir.join("warehouse").display().to_string();
    // The write and rebuild stages reach no broker; the configuration needs one all the same.
    let bootstrap = opts.bootstrap.as_deref().unwrap_or("127.0.0.1:9092");
    let yaml = bench_yaml(bootstrap, &opts.dir, &topic, 0, &warehouse);
    let cfg = Config::from_yaml_with_env(&yaml)?;
    let mut table = open_table(&cfg).await?;
    if table.metadata.current_snapshot().is_some() {
        return Err(Error::config(format!(
            "bench-table: table {}.{} in {} holds snapshots already; use a fresh --dir",
            table.namespace,
            table.name,
            opts.dir.display()
        )));
    }
    let written = write_table(&cfg, &mut table, &topic, &opts).await?;
    let write_peak_rss = peak_rss_bytes().unwrap_or(0);
    let mib = |b: u64| b as f64 / 1_048_576.0;
    println!(
        "write: {} rows in {} checkpoints over {} shards, {} data files, {:.0} MiB, in {:.1}s: {:.0} rows/s, {:.1} MiB/s; peak RSS {:.0} MiB",
        opts.keys,
        written.checkpoints,
        opts.partitions,
        written.files,
        mib(written.bytes),
        written.secs,
        opts.keys as f64 / written.secs,
        mib(written.bytes) / written.secs,
        mib(write_peak_rss)
    );

    let rebuilt = rebuild_shards(&cfg, &table, &topic, opts.partitions).await?;
    println!(
        "index rebuild: {} keys ({} live) in {:.1}s, {:.0} keys/s, peak RSS during the rebuild {:.0} MiB ({:.0} MiB resident before it)",
        rebuilt.keys,
        rebuilt.live,
        rebuilt.secs,
        rebuilt.keys as f64 / rebuilt.secs,
        mib(rebuilt.peak_rss),
        mib(rebuilt.resident_before)
    );
    let root = index_root(&cfg);
    let index_bytes = dir_bytes(&root)?;
    for p in 0..opts.partitions {
        let db = root.join(format!("{topic}-{p}")).join("db");
        inlet_index::RocksIndex::open(&db, None)?.compact()?;
    }
    let index_bytes_compacted = dir_bytes(&root)?;
    let per_key = |b: u64| b as f64 / opts.keys as f64;
    println!(
        "index on disk: {:.0} MiB, {:.1} bytes/key after the rebuild; {:.0} MiB, {:.1} bytes/key after a full compaction",
        mib(index_bytes),
        per_key(index_bytes),
        mib(index_bytes_compacted),
        per_key(index_bytes_compacted)
    );

    let mut produced = 0;
    let (restart, failover) = match &opts.bootstrap {
        Some(bootstrap) => {
            create_topic(bootstrap, &topic, opts.partitions).await?;
            let mut stages = Stages::new(&cfg, &yaml, bootstrap, &topic, &opts)?;
            // The failover's rebuild must find no copy: the runs before it make none.
            let no_copies = if opts.failover {
                "{index: {copy_interval_ms: 0}}"
            } else {
                "{}"
            };
            let r = stages.run(0, no_copies, false).await?;
            println!(
                "restart on the persisted index: first snapshot (claim) {:.1}s, first new commit {:.1}s, all {} changes committed {:.1}s after process start; shards restored in place {}, rebuilt {}",
                r.first_snapshot_secs,
                r.first_commit_secs,
                opts.changes(),
                r.all_secs,
                r.local_shards,
                r.rebuilt_shards
            );
            let failover = if opts.failover {
                stages.forget_indexes()?;
                let rebuilt = stages.run(1, no_copies, false).await?;
                print_failover("no index and no copy", &rebuilt, &opts);
                // A run that leaves a copy of every shard beside the table.
                stages.run(2, "{}", true).await?;
                stages.forget_indexes()?;
                let copied = stages.run(3, "{}", false).await?;
                print_failover("no index, a copy beside the table", &copied, &opts);
                Some((rebuilt, copied))
            } else {
                None
            };
            produced = stages.produced;
            (Some(r), failover)
        }
        None => (None, None),
    };
    Ok(BenchTableReport {
        topic,
        table: format!("{}.{}", table.namespace, table.name),
        rows: opts.keys,
        checkpoints: written.checkpoints,
        data_files: written.files,
        table_bytes: written.bytes,
        write_secs: written.secs,
        write_peak_rss,
        rebuilt_keys: rebuilt.keys,
        live_keys: rebuilt.live,
        rebuild_secs: rebuilt.secs,
        rebuild_peak_rss: rebuilt.peak_rss,
        index_bytes,
        index_bytes_compacted,
        restart,
        produced,
        failover,
    })
}

/// What the write stage did.
struct Written {
    checkpoints: u64,
    files: usize,
    bytes: u64,
    secs: f64,
}

/// Where the pipeline keeps its shards' indexes.
fn index_root(cfg: &Config) -> PathBuf {
    Path::new(&cfg.index.dir).join(&cfg.pipeline_id)
}

/// Offset 0 for every partition of `topic`: the table holds none of its records, so a fresh
/// topic of that name continues it.
fn zero_offsets(topic: &str, partitions: i32) -> Offsets {
    Offsets::from([(topic.to_string(), (0..partitions).map(|p| (p, 0)).collect())])
}

/// Writes rows for keys `0..keys` in checkpoints of at most [`CHECKPOINT_ROWS`], each
/// committed through the pipeline's committer with the offsets of `topic`.
async fn write_table(
    cfg: &Config,
    table: &mut Table,
    topic: &str,
    opts: &BenchTableOptions,
) -> Result<Written> {
    let sink = upsert_sink_for(cfg, table)?;
    let template = sink.writer_template().clone();
    let target_rows = sink.spec.target_rows_per_bucket;
    drop(sink);
    let shards = opts.partitions as u32;
    let committer = Committer {
        pipeline_id: cfg.pipeline_id.clone(),
        writer_id: uuid::Uuid::new_v4().to_string(),
        retries: 3,
        retry_for: Duration::from_millis(cfg.checkpoint.commit_timeout_ms),
    };
    let per_checkpoint = opts.keys.div_ceil(4).clamp(1, CHECKPOINT_ROWS);
    let parallel = std::thread::available_parallelism().map_or(1, |n| n.get());
    let gate = Arc::new(tokio::sync::Semaphore::new(parallel));
    let template = Arc::new(template);
    // Live rows per (partition, bucket) of each shard, as its index would count them.
    let mut counts: Vec<BucketCounts> = (0..shards).map(|_| BucketCounts::new()).collect();
    let (mut files, mut bytes, mut checkpoint) = (0, 0u64, 0u64);
    let started = Instant::now();
    let mut from = 0;
    while from < opts.keys {
        let to = (from + per_checkpoint).min(opts.keys);
        checkpoint += 1;
        let mut jobs = Vec::with_capacity(shards as usize);
        for (shard, counts) in counts.drain(..).enumerate() {
            let permit = gate
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| Error::new(ErrorKind::Internal, "the write pool closed early"))?;
            let (template, io) = (template.clone(), table.io.clone());
            let handle = tokio::runtime::Handle::current();
            jobs.push(tokio::task::spawn_blocking(move || {
                let _permit = permit;
                let mut job = ShardWrite {
                    shard: shard as u32,
                    shards,
                    target_rows,
                    counts,
                    files: Vec::new(),
                };
                let result = job.write(&template, from..to, &mut |bytes, path| {
                    handle.block_on(io.put(path, bytes::Bytes::from(bytes)))
                });
                result.map(|()| job)
            }));
        }
        let mut data = Vec::new();
        let mut written = Vec::new();
        for job in jobs {
            let job = job.await.map_err(|e| {
                Error::new(ErrorKind::Internal, "a shard writer failed").with_source(e)
            })??;
            if !job.files.is_empty() {
                written.push(job.shard);
            }
            data.extend(job.files);
            counts.push(job.counts);
        }
        files += data.len();
        bytes += data
            .iter()
            .map(|f| f.file_size_in_bytes as u64)
            .sum::<u64>();
        let level = table.metadata.current_snapshot().map(|s| s.snapshot_id);
        let cp = Checkpoint {
            id: checkpoint,
            files: data,
            deletes: vec![],
            start: if from == 0 {
                Offsets::new()
            } else {
                zero_offsets(topic, opts.partitions)
            },
            end: zero_offsets(topic, opts.partitions),
            schema: None,
            epochs: Default::default(),
            claim: false,
            copies: Default::default(),
            source_ms: None,
            index_markers: written.into_iter().map(|s| (s, level)).collect(),
            shard_topic: Some(topic.to_string()),
            watermarks: Default::default(),
        };
        committer.commit(table, &cp).await?;
        tracing::info!(checkpoint, keys = to, "Bench table checkpoint committed");
        from = to;
    }
    Ok(Written {
        checkpoints: checkpoint,
        files,
        bytes,
        secs: started.elapsed().as_secs_f64().max(1e-9),
    })
}

/// Live rows per (encoded partition values, bucket).
type BucketCounts = HashMap<(Vec<u8>, u32), u64>;

/// One shard's part of a checkpoint.
struct ShardWrite {
    shard: u32,
    shards: u32,
    target_rows: u64,
    counts: BucketCounts,
    files: Vec<DataFile>,
}

impl ShardWrite {
    /// Writes the rows of the shard's keys in `ids` (a key's partition is `id % shards`, as
    /// `inlet bench` produces them) in key order, as a checkpoint of the shard writes new keys:
    /// named with the shard's prefix, in the first bucket of the shard below the target row
    /// count, rolled at the target file size. Each finished file goes to `upload` at once.
    fn write(
        &mut self,
        template: &WriterTemplate,
        ids: std::ops::Range<u64>,
        upload: &mut dyn FnMut(Vec<u8>, &str) -> Result<()>,
    ) -> Result<()> {
        let mut writer = DataWriter::new(
            template.columns.clone(),
            template.partition.clone(),
            &template.location,
            template.target_file_bytes,
            &format!("{}-", shard_file_prefix(self.shard)),
        );
        let columns: Vec<&str> = template.columns.iter().map(|c| c.name.as_str()).collect();
        let shards = u64::from(self.shards);
        let first = ids.start + (u64::from(self.shard) + shards - ids.start % shards) % shards;
        for (n, id) in (first..ids.end).step_by(shards as usize).enumerate() {
            let mut row = order_row(&columns, id)?;
            let partition = encode_values(&writer.partition_values(&row));
            let bucket = self.bucket(&partition);
            *self.counts.entry((partition, bucket)).or_default() += 1;
            writer.write_to(&mut row, Some(bucket))?;
            if n % 65_536 == 65_535 {
                for f in writer.take_finished() {
                    upload(f.bytes, &f.data_file.file_path)?;
                    self.files.push(f.data_file);
                }
            }
        }
        for f in writer.close()? {
            upload(f.bytes, &f.data_file.file_path)?;
            self.files.push(f.data_file);
        }
        Ok(())
    }

    /// The bucket a new key of `partition` goes to, as the shard assigns dynamic buckets: its
    /// own buckets (`shard`, `shard + shards`, …) in order, the first below the target.
    fn bucket(&self, partition: &[u8]) -> u32 {
        let mut bucket = self.shard;
        while self
            .counts
            .get(&(partition.to_vec(), bucket))
            .is_some_and(|n| *n >= self.target_rows)
        {
            bucket += self.shards;
        }
        bucket
    }
}

/// The row of key `id`, shaped as `inlet bench`'s inserts (customer and day of `created_at`
/// from the key; status and amount drawn from it, so shards can be written in any order), with
/// the version its Debezium insert has: the `lsn` `FIRST_LSN + id`.
fn order_row(columns: &[&str], id: u64) -> Result<Vec<Value>> {
    let mut rng = Rng(id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let created_ms = created_at_ms(id);
    columns
        .iter()
        .map(|c| {
            Ok(match *c {
                "id" => Value::Long(id as i64),
                "customer" => Value::String(format!("customer-{}", id % 9973)),
                "status" => Value::String(["new", "paid", "shipped"][rng.below(3) as usize].into()),
                "amount" => Value::Decimal(i128::from(rng.below(100_000) * 100 + rng.below(100))),
                "created_at" => Value::TimestampTz(created_ms as i64 * 1000),
                inlet_iceberg::keys::UPSERT_VERSION_COLUMN => {
                    Value::Binary(version(FIRST_LSN + id))
                }
                other => {
                    return Err(Error::new(
                        ErrorKind::Internal,
                        format!("the bench table has an unknown column {other}"),
                    ))
                }
            })
        })
        .collect()
}

/// The `created_at` of key `id` in `inlet bench`'s stream (one of 30 days), in ms.
fn created_at_ms(id: u64) -> u64 {
    1_767_225_600_000 + (id % 30) * 86_400_000 + id % 86_400_000
}

/// The version the pipeline gives a Debezium change at `lsn`.
fn version(lsn: u64) -> Vec<u8> {
    inlet_common::version::encode_version(&Version(vec![VersionPart::Int(i128::from(lsn))]))
}

/// What rebuilding every shard took.
struct Rebuilt {
    keys: u64,
    live: u64,
    secs: f64,
    peak_rss: u64,
    resident_before: u64,
}

/// Rebuilds every shard's index from the table where the pipeline keeps it.
async fn rebuild_shards(
    cfg: &Config,
    table: &Table,
    topic: &str,
    partitions: i32,
) -> Result<Rebuilt> {
    let root = index_root(cfg);
    match std::fs::remove_dir_all(&root) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(Error::new(
                ErrorKind::Storage,
                format!("cannot remove {}", root.display()),
            )
            .with_source(e))
        }
        _ => {}
    }
    let mut sink = upsert_sink_for(cfg, table)?;
    sink.spec.shards = partitions as u32;
    // The rebuild's own peak, apart from what writing the table left resident.
    let resident_before = if reset_peak_rss() {
        rss_bytes().unwrap_or(0)
    } else {
        0
    };
    let started = Instant::now();
    let keys = crate::rebuild::rebuild_shards(
        &mut sink,
        topic,
        0..partitions,
        table,
        cfg.pipeline.worker_count(),
    )
    .await?;
    let mut live = 0;
    for (_, shard) in sink.open_shards() {
        live += shard
            .index()
            .bucket_counts()?
            .iter()
            .map(|(_, n)| n)
            .sum::<u64>();
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    Ok(Rebuilt {
        keys,
        live,
        secs,
        peak_rss: peak_rss_bytes().unwrap_or(0),
        resident_before,
    })
}

/// Bytes of the files below `dir`.
fn dir_bytes(dir: &Path) -> Result<u64> {
    let io = |e: std::io::Error| {
        Error::new(ErrorKind::Storage, format!("cannot list {}", dir.display())).with_source(e)
    };
    let mut total = 0;
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let meta = entry.metadata().map_err(io)?;
        total += if meta.is_dir() {
            dir_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

fn print_failover(what: &str, r: &Restart, opts: &BenchTableOptions) {
    println!(
        "failover to a host with {what}: first new commit {:.1}s, all {} changes committed {:.1}s after process start; shards rebuilt {}, restored from a copy {}, in place {}",
        r.first_commit_secs,
        opts.changes(),
        r.all_secs,
        r.rebuilt_shards,
        r.copy_shards,
        r.local_shards
    );
}

/// The runs of `inlet run` on the written table, each producing a round of changes first.
struct Stages<'a> {
    cfg: &'a Config,
    yaml: serde_yaml::Value,
    topic: &'a str,
    opts: &'a BenchTableOptions,
    producer: FutureProducer,
    /// Records produced to `topic` so far: the offsets the table holds once all are committed.
    produced: u64,
    /// Extra changes produced to make a run commit again (see [`Stages::run`]).
    nudges: u64,
}

impl<'a> Stages<'a> {
    fn new(
        cfg: &'a Config,
        yaml: &str,
        bootstrap: &str,
        topic: &'a str,
        opts: &'a BenchTableOptions,
    ) -> Result<Stages<'a>> {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("linger.ms", "20")
            .create()
            .or_kind(ErrorKind::Kafka, || "cannot create producer".into())?;
        Ok(Stages {
            cfg,
            yaml: parse_yaml(yaml)?,
            topic,
            opts,
            producer,
            produced: 0,
            nudges: 0,
        })
    }

    /// Removes every shard's local index, as a new host finds none.
    fn forget_indexes(&self) -> Result<()> {
        let root = index_root(self.cfg);
        std::fs::remove_dir_all(&root).or_kind(ErrorKind::Storage, || {
            format!("cannot remove {}", root.display())
        })
    }

    /// Produces round `round`'s changes, runs `inlet run` with `overrides` merged into the
    /// configuration, and times it until the table holds every change. With `leave_copies`,
    /// it runs on until the table points at a copy of every shard's index (copies start after
    /// a commit and are recorded by the next one: a change per partition every second makes
    /// one).
    async fn run(&mut self, round: u64, overrides: &str, leave_copies: bool) -> Result<Restart> {
        let before = self.produced as i64;
        self.produce_round(round).await?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .or_kind(ErrorKind::Internal, || "cannot find a free port".into())?
            .port();
        let mut own = self.yaml.clone();
        // A checkpoint as soon as every change is read: the time measured is the restart's,
        // not the checkpoint interval's.
        merge_yaml(
            &mut own,
            parse_yaml(&format!(
                "{{metrics: {{listen: \"127.0.0.1:{port}\"}}, checkpoint: {{max_records: {}, interval_ms: 1000}}}}",
                self.opts.changes().max(1)
            ))?,
        );
        merge_yaml(&mut own, parse_yaml(overrides)?);
        let own = serde_yaml::to_string(&own)
            .or_kind(ErrorKind::Internal, || "cannot print YAML".into())?;
        let dir = &self.opts.dir;
        let path = dir.join(format!("restart-{round}.yaml"));
        let log = dir.join(format!("restart-{round}.log"));
        let io = |what: &str, p: &Path| format!("cannot {what} {}", p.display());
        std::fs::write(&path, own).or_kind(ErrorKind::Storage, || io("write", &path))?;
        let binary = match &self.opts.binary {
            Some(b) => b.clone(),
            None => std::env::current_exe()
                .or_kind(ErrorKind::Internal, || "cannot find this executable".into())?,
        };
        let mut table = open_table(self.cfg).await?;
        let snapshots = table.metadata.snapshots.len();
        let started = Instant::now();
        // At info: the log tells where the restart's time went.
        let mut child = crate::bench::spawn_run(&binary, &path, &log, "info")?;
        let (mut first_snapshot, mut first_commit, mut all) = (None, None, None);
        let mut nudged = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
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
            if started.elapsed() > Duration::from_secs(900) {
                return Err(Error::new(
                    ErrorKind::Internal,
                    format!(
                        "the restarted pipeline did not commit every change in 15 minutes; see {}",
                        log.display()
                    ),
                ));
            }
            table.refresh().await?;
            let secs = started.elapsed().as_secs_f64();
            if table.metadata.snapshots.len() > snapshots {
                first_snapshot.get_or_insert(secs);
            }
            let done: i64 = table_offsets(&table.metadata, &self.cfg.pipeline_id)?
                .get(self.topic)
                .map_or(0, |m| m.values().sum());
            if done > before {
                first_commit.get_or_insert(secs);
            }
            if done < self.produced as i64 {
                continue;
            }
            all.get_or_insert(secs);
            if !leave_copies {
                break;
            }
            let copied = crate::commit::copy_pointers(&table.metadata, &self.cfg.pipeline_id)?
                .get(self.topic)
                .map_or(0, |m| m.len());
            if copied >= self.opts.partitions as usize {
                break;
            }
            if nudged.elapsed() >= Duration::from_secs(1) {
                self.nudge().await?;
                nudged = Instant::now();
            }
        }
        let all = all.unwrap_or_default();
        let metrics = match reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let restores = |source: &str| {
            metric_value(
                &metrics,
                &format!("inlet_index_restores_total{{source=\"{source}\"}}"),
            )
            .unwrap_or(0.0) as u64
        };
        let restart = Restart {
            first_snapshot_secs: first_snapshot.unwrap_or(all),
            first_commit_secs: first_commit.unwrap_or(all),
            all_secs: all,
            rebuilt_shards: restores("rebuild"),
            local_shards: restores("local"),
            copy_shards: restores("copy"),
        };
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        if tokio::time::timeout(Duration::from_secs(60), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
        Ok(restart)
    }

    /// Produces round `round`'s updates: distinct existing keys, in their own partitions,
    /// newer than their inserts and than every earlier round.
    async fn produce_round(&mut self, round: u64) -> Result<()> {
        let n = self.opts.changes();
        let ids: Vec<(u64, u64)> = (0..n)
            .map(|i| {
                let at = round * n + i;
                (changed_key(at, self.opts.keys), at)
            })
            .collect();
        self.produce(&ids).await
    }

    /// One more change in every partition, of keys round 2 changed (no other round's keys),
    /// newer than all of them.
    async fn nudge(&mut self) -> Result<()> {
        let n = self.opts.changes();
        let parts = self.opts.partitions as u64;
        let mut ids = Vec::new();
        for p in 0..parts {
            if let Some(id) = (0..n)
                .map(|i| changed_key(2 * n + i, self.opts.keys))
                .find(|id| id % parts == p)
            {
                ids.push((id, ROUNDS * n + self.nudges));
                self.nudges += 1;
            }
        }
        self.produce(&ids).await
    }

    /// Produces an update of each `(key, sequence)`, at source position `keys + sequence`.
    async fn produce(&mut self, changes: &[(u64, u64)]) -> Result<()> {
        let mut acks = Vec::with_capacity(changes.len());
        for &(id, seq) in changes {
            let lsn = FIRST_LSN + self.opts.keys + seq;
            let after = json!({
                "id": id,
                "customer": format!("customer-{}", id % 9973),
                "status": CHANGED_STATUS,
                "amount": "1.00",
                "created_at": created_at_ms(id),
            });
            let value = json!({"before": null, "after": after, "op": "u", "ts_ms": lsn,
                               "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": lsn}})
            .to_string();
            let key = json!({ "id": id }).to_string();
            let record = FutureRecord::to(self.topic)
                .partition((id % self.opts.partitions as u64) as i32)
                .key(&key)
                .payload(&value);
            acks.push(
                self.producer.send_result(record).map_err(|(e, _)| {
                    Error::new(ErrorKind::Kafka, "cannot produce").with_source(e)
                })?,
            );
        }
        for ack in acks {
            delivered(ack.await)?;
        }
        self.produced += changes.len() as u64;
        Ok(())
    }
}

fn parse_yaml(text: &str) -> Result<serde_yaml::Value> {
    serde_yaml::from_str(text).or_kind(ErrorKind::Internal, || "bench-table YAML".into())
}

/// The key of the `i`-th change: distinct keys for `i < keys`, scattered over `0..keys` and so
/// over every partition (multiplying by a prime that divides no key count below it permutes
/// `0..keys`).
pub fn changed_key(i: u64, keys: u64) -> u64 {
    const PRIME: u128 = 2_654_435_761;
    (u128::from(i) * PRIME % u128::from(keys.max(1))) as u64
}

/// The status the restart's changes give their keys.
pub const CHANGED_STATUS: &str = "restarted";

/// Creates `topic` with the table's partitions.
async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .or_kind(ErrorKind::Kafka, || "cannot create admin client".into())?;
    let created = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .or_kind(ErrorKind::Kafka, || format!("cannot create topic {topic}"))?;
    for r in created {
        r.map_err(|(t, e)| Error::new(ErrorKind::Kafka, format!("cannot create topic {t}: {e}")))?;
    }
    Ok(())
}
