//! Test harness: a real Kafka-protocol broker process (tansu), the real SQL catalog, the
//! `inlet` binary as a child process, and pyiceberg as the independent reader.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use serde_json::Value as Json;

use inlet::commit::table_offsets;
use inlet::table::catalog::SqlCatalog;
use inlet::table::io::FileIO;
use inlet::table::Table;

fn cache_dir() -> PathBuf {
    std::env::var_os("INLET_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/inlet")
        })
}

fn tool(env: &str, default: PathBuf) -> PathBuf {
    let path = std::env::var_os(env).map(PathBuf::from).unwrap_or(default);
    assert!(
        path.exists(),
        "{} not found; run `scripts/test-env.sh` first (or set {env})",
        path.display()
    );
    path
}

/// The Python with pyiceberg.
pub fn python() -> PathBuf {
    tool("INLET_TEST_PYTHON", cache_dir().join("venv/bin/python"))
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A tansu broker process with in-memory storage, killed on drop.
pub struct Broker {
    child: Child,
    pub bootstrap: String,
}

impl Broker {
    pub fn start() -> Broker {
        Self::start_with(&[])
    }

    /// A broker started with extra `tansu broker` arguments (e.g. `--authentication`).
    pub fn start_with(args: &[&str]) -> Broker {
        let tansu = tool("INLET_TEST_TANSU", cache_dir().join("bin/tansu"));
        for _ in 0..5 {
            let port = free_port();
            let url = format!("tcp://127.0.0.1:{port}");
            let mut child = Command::new(&tansu)
                .args([
                    "broker",
                    "--listener-url",
                    &url,
                    "--advertised-listener-url",
                    &url,
                ])
                .args(["--storage-engine", "memory://tansu/"])
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("start tansu");
            let stdout = child.stdout.take().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if line.contains("ready in") {
                        let _ = tx.send(());
                    }
                }
            });
            // tansu exits 0 without "ready" when the port is taken; try another port.
            if rx.recv_timeout(Duration::from_secs(10)).is_ok() {
                return Broker {
                    child,
                    bootstrap: format!("127.0.0.1:{port}"),
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("tansu did not become ready");
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A unique name for a test's topic, table and group.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let res = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    for r in res {
        r.unwrap();
    }
}

/// A produced message: where it landed and what it carried.
#[derive(Debug, Clone)]
pub struct Produced {
    pub partition: i32,
    pub offset: i64,
    pub key: String,
    pub value: Option<String>,
}

/// Produces messages to explicit partitions; returns them with their offsets.
pub async fn produce(
    bootstrap: &str,
    topic: &str,
    msgs: &[(i32, String, Option<String>)],
) -> Vec<Produced> {
    let raw: Vec<_> = msgs
        .iter()
        .map(|(p, k, v)| {
            (
                *p,
                k.clone().into_bytes(),
                v.clone().map(String::into_bytes),
            )
        })
        .collect();
    produce_bytes(bootstrap, topic, &raw)
        .await
        .into_iter()
        .zip(msgs)
        .map(|((partition, offset), (_, k, v))| Produced {
            partition,
            offset,
            key: k.clone(),
            value: v.clone(),
        })
        .collect()
}

/// A binary message to produce: partition, key, value (`None` is a tombstone).
pub type RawMessage = (i32, Vec<u8>, Option<Vec<u8>>);

/// Produces binary messages to explicit partitions; returns (partition, offset) of each.
pub async fn produce_bytes(bootstrap: &str, topic: &str, msgs: &[RawMessage]) -> Vec<(i32, i64)> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "20")
        .set("enable.idempotence", "true")
        .create()
        .unwrap();
    // Enqueue everything first (send_result does not wait), then collect delivery reports;
    // awaiting each send in turn would put one message in flight at a time.
    let mut futures = Vec::with_capacity(msgs.len());
    for (p, k, v) in msgs {
        let mut rec = FutureRecord::<[u8], [u8]>::to(topic)
            .partition(*p)
            .key(k.as_slice());
        if let Some(v) = v {
            rec = rec.payload(v.as_slice());
        }
        loop {
            match producer.send_result(rec) {
                Ok(f) => {
                    futures.push(f);
                    break;
                }
                Err((
                    rdkafka::error::KafkaError::MessageProduction(
                        rdkafka::types::RDKafkaErrorCode::QueueFull,
                    ),
                    r,
                )) => {
                    rec = r;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err((e, _)) => panic!("cannot enqueue: {e}"),
            }
        }
    }
    let mut out = Vec::with_capacity(msgs.len());
    for f in futures {
        let delivery = f
            .await
            .expect("producer alive")
            .map_err(|(e, _)| e)
            .expect("delivered");
        out.push((delivery.partition, delivery.offset));
    }
    out
}

/// A test's catalog and warehouse in a temporary directory.
pub struct Lake {
    pub dir: tempfile::TempDir,
    pub catalog_uri: String,
    pub catalog_name: String,
    pub warehouse: String,
}

impl Lake {
    /// A SQLite catalog in a fresh directory.
    pub fn new() -> Lake {
        let mut dir = tempfile::tempdir().unwrap();
        if std::env::var_os("INLET_KEEP_TEST_DIRS").is_some() {
            dir.disable_cleanup(true);
            eprintln!("keeping test directory {}", dir.path().display());
        }
        let catalog_uri = format!("sqlite://{}/catalog.db", dir.path().display());
        let warehouse = format!("{}/warehouse", dir.path().display());
        Lake {
            dir,
            catalog_uri,
            catalog_name: "inlet".into(),
            warehouse,
        }
    }

    /// A catalog in the PostgreSQL database at `uri`, under a catalog name of its own.
    pub fn postgres(uri: &str) -> Lake {
        let mut lake = Lake::new();
        lake.catalog_uri = uri.to_string();
        lake.catalog_name = unique("inlet");
        lake
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Reads the table through pyiceberg: rows, snapshot, files.
    pub fn pyiceberg(&self, table: &str) -> Json {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/read_table.py");
        let uri = match self.catalog_uri.strip_prefix("postgresql://") {
            Some(rest) => format!("postgresql+psycopg2://{rest}"),
            None => format!("sqlite:///{}/catalog.db", self.path().display()),
        };
        let out = Command::new(python())
            .arg(script)
            .args(["--uri", &uri])
            .args([
                "--catalog",
                &self.catalog_name,
                "--warehouse",
                &format!("file://{}", self.warehouse),
            ])
            .args(["--table", table])
            .output()
            .expect("run read_table.py");
        assert!(
            out.status.success(),
            "read_table.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("read_table.py prints JSON")
    }

    pub async fn table(&self, namespace: &str, name: &str) -> Option<Table> {
        let catalog = SqlCatalog::connect(&self.catalog_uri, &self.catalog_name)
            .await
            .unwrap();
        Table::load(&catalog, &FileIO::default(), namespace, name)
            .await
            .unwrap()
    }

    /// The offsets the table records for `pipeline`, summed over partitions.
    pub async fn committed_total(&self, namespace: &str, name: &str, pipeline: &str) -> i64 {
        match self.table(namespace, name).await {
            None => 0,
            Some(t) => table_offsets(&t.metadata, pipeline)
                .unwrap()
                .values()
                .flat_map(|m| m.values())
                .sum(),
        }
    }
}

/// A running `inlet run` child process.
pub struct Inlet {
    pub child: Child,
}

impl Inlet {
    pub fn spawn(config: &Path, env: &[(&str, &str)]) -> Inlet {
        Self::spawn_to(config, env, Stdio::inherit())
    }

    /// Spawns with JSON logs written to `log`, for tests that check what inlet reported.
    pub fn spawn_logged(config: &Path, env: &[(&str, &str)], log: &Path) -> Inlet {
        let file = std::fs::File::create(log).expect("create log file");
        let mut env = env.to_vec();
        env.push(("INLET_LOG_FORMAT", "json"));
        Self::spawn_to(config, &env, Stdio::from(file))
    }

    fn spawn_to(config: &Path, env: &[(&str, &str)], stderr: Stdio) -> Inlet {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_inlet"));
        cmd.args(["run", "--config"]).arg(config);
        cmd.env("INLET_LOG", "info,rdkafka=warn");
        for (k, v) in env {
            cmd.env(k, v);
        }
        Inlet {
            child: cmd.stderr(stderr).spawn().expect("spawn inlet"),
        }
    }

    pub fn sigterm(&mut self) {
        unsafe_kill(self.child.id(), "TERM");
    }

    pub fn sigkill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for exit; returns whether it exited successfully.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Inlet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unsafe_kill(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status();
}

/// Polls until the table's committed offsets sum to `target` (or the timeout passes).
pub async fn wait_committed(
    lake: &Lake,
    ns: &str,
    table: &str,
    pipeline: &str,
    target: i64,
    timeout: Duration,
) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if lake.committed_total(ns, table, pipeline).await >= target {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

/// Next offset per partition after the produced messages.
pub fn end_offsets(produced: &[Produced]) -> BTreeMap<i32, i64> {
    let mut out = BTreeMap::new();
    for p in produced {
        let e = out.entry(p.partition).or_insert(0);
        *e = (*e).max(p.offset + 1);
    }
    out
}

/// (partition, offset) pairs of produced messages with a value (tombstones excluded).
pub fn produced_changes(produced: &[Produced]) -> BTreeSet<(i64, i64)> {
    produced
        .iter()
        .filter(|p| p.value.is_some())
        .map(|p| (p.partition as i64, p.offset))
        .collect()
}

/// Reads `(_kafka_partition, _kafka_offset)` of every live row with inlet's own reader:
/// manifests through `Table::live_entries`, Parquet through the arrow reader.
pub async fn own_reader_positions(table: &Table) -> Vec<(i64, i64)> {
    use arrow_array::{Int32Array, Int64Array};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let mut out = Vec::new();
    for entry in table.live_entries().await.unwrap() {
        let bytes = table.io.get(&entry.data_file.file_path).await.unwrap();
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .unwrap()
            .build()
            .unwrap();
        let mut rows = 0;
        for batch in reader {
            let batch = batch.unwrap();
            let p = batch
                .column_by_name("_kafka_partition")
                .unwrap()
                .as_any()
                .downcast_ref::<Int32Array>()
                .unwrap();
            let o = batch
                .column_by_name("_kafka_offset")
                .unwrap()
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            for i in 0..batch.num_rows() {
                out.push((p.value(i) as i64, o.value(i)));
            }
            rows += batch.num_rows() as i64;
        }
        assert_eq!(
            rows, entry.data_file.record_count,
            "record_count of {}",
            entry.data_file.file_path
        );
    }
    out
}

/// A pipeline config for a test table partitioned by day and by an identity column.
pub fn changelog_config(
    lake: &Lake,
    bootstrap: &str,
    topic: &str,
    table: &str,
    max_records: u64,
    metrics_listen: &str,
) -> PathBuf {
    pipeline_config(
        lake,
        bootstrap,
        topic,
        table,
        "mode: changelog",
        max_records,
        metrics_listen,
    )
}

/// A pipeline config for a test table of `id`, `region`, `amount`, `created_at`, partitioned
/// by day and region; `mode` holds the table's mode settings.
fn pipeline_config(
    lake: &Lake,
    bootstrap: &str,
    topic: &str,
    table: &str,
    mode: &str,
    max_records: u64,
    metrics_listen: &str,
) -> PathBuf {
    let yaml = format!(
        r#"pipeline_id: {table}
kafka:
  bootstrap_servers: "{bootstrap}"
  group_id: {table}
  topics: [{topic}]
  properties:
    session.timeout.ms: "6000"
    heartbeat.interval.ms: "500"
table:
  namespace: test
  name: {table}
  {mode}
  columns:
    - {{name: id, type: long, required: true}}
    - {{name: region, type: string}}
    - {{name: amount, type: "decimal(10,2)"}}
    - {{name: created_at, type: timestamptz}}
  primary_key: [id]
  partition_by:
    - {{column: created_at, transform: day}}
    - {{column: region}}
catalog:
  uri: "{uri}"
  name: {catalog_name}
  warehouse: "{warehouse}"
index:
  dir: "{index}"
checkpoint:
  interval_ms: 1000
  max_records: {max_records}
metrics:
  listen: "{metrics_listen}"
"#,
        uri = lake.catalog_uri,
        catalog_name = lake.catalog_name,
        warehouse = lake.warehouse,
        index = lake.path().join("index").display(),
    );
    let path = lake.path().join(format!("{table}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    path
}

/// A pipeline config of a test `table` in namespace `test` reading `topic`: `table_yaml` is the
/// body of the `table:` section (each line indented by two spaces), `extra` more top-level YAML.
pub fn custom_config(
    lake: &Lake,
    bootstrap: &str,
    topic: &str,
    table: &str,
    table_yaml: &str,
    max_records: u64,
    extra: &str,
) -> PathBuf {
    let yaml = format!(
        r#"pipeline_id: {table}
kafka:
  bootstrap_servers: "{bootstrap}"
  group_id: {table}
  topics: [{topic}]
  properties:
    session.timeout.ms: "6000"
    heartbeat.interval.ms: "500"
table:
  namespace: test
  name: {table}
{table_yaml}
catalog:
  uri: "{uri}"
  name: {catalog_name}
  warehouse: "{warehouse}"
index:
  dir: "{index}"
checkpoint:
  interval_ms: 1000
  max_records: {max_records}
metrics:
  listen: ""
{extra}
"#,
        uri = lake.catalog_uri,
        catalog_name = lake.catalog_name,
        warehouse = lake.warehouse,
        index = lake.path().join("index").display(),
    );
    let path = lake.path().join(format!("{table}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Runs `tests/py/foreign_writer.py` against the test catalog: another engine (pyiceberg)
/// changing `test.<table>`. Returns its stdout.
pub fn foreign_writer(lake: &Lake, table: &str, args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/foreign_writer.py");
    let uri = match lake.catalog_uri.strip_prefix("postgresql://") {
        Some(rest) => format!("postgresql+psycopg2://{rest}"),
        None => format!("sqlite:///{}/catalog.db", lake.path().display()),
    };
    let out = Command::new(python())
        .arg(script)
        .args(["--uri", &uri])
        .args(["--catalog", &lake.catalog_name])
        .args(["--warehouse", &format!("file://{}", lake.warehouse)])
        .args(["--table", &format!("test.{table}")])
        .args(args)
        .output()
        .expect("run foreign_writer.py");
    assert!(
        out.status.success(),
        "foreign_writer.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Region values that stress partition paths: NULL, empty, separators, dots.
pub const REGIONS: [Option<&str>; 7] = [
    Some("eu"),
    Some("us/west"),
    Some("a=b"),
    Some(".."),
    Some(""),
    None,
    Some("ü %"),
];

/// A Debezium stream over `keys` ids in `partitions` partitions (id % partitions): creates,
/// updates, deletes followed by tombstones, re-inserts; half the messages carry the schema
/// envelope. Returns (partition, key, value) in production order.
pub fn debezium_stream(
    seed: u64,
    messages: usize,
    keys: i64,
    partitions: i32,
) -> Vec<(i32, String, Option<String>)> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut live: BTreeMap<i64, serde_json::Value> = BTreeMap::new();
    let mut out = Vec::new();
    let mut lsn = 1000i64;
    while out.len() < messages {
        let id = rng.gen_range(0..keys);
        let region = REGIONS[rng.gen_range(0..REGIONS.len())];
        let row = serde_json::json!({
            "id": id,
            "region": region,
            "amount": format!("{}.{:02}", rng.gen_range(0..100_000), rng.gen_range(0..100)),
            "created_at": 1_767_225_600_000i64 + rng.gen_range(0..3 * 86_400_000i64),
        });
        lsn += rng.gen_range(1..100);
        let before = live.get(&id).cloned();
        let (op, before, after) = match (&before, rng.gen_range(0..10)) {
            (None, _) => ("c", None, Some(row)),
            (Some(b), 0..=1) => ("d", Some(b.clone()), None),
            (Some(b), _) => ("u", Some(b.clone()), Some(row)),
        };
        match &after {
            Some(a) => live.insert(id, a.clone()),
            None => live.remove(&id),
        };
        let payload = serde_json::json!({
            "before": before, "after": after, "op": op, "ts_ms": lsn,
            "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": lsn},
        });
        let value = if rng.gen_bool(0.5) {
            serde_json::json!({"schema": postgres_schema(), "payload": payload})
        } else {
            payload
        };
        let partition = (id % partitions as i64) as i32;
        let key = serde_json::json!({"id": id}).to_string();
        out.push((partition, key.clone(), Some(value.to_string())));
        if op == "d" {
            out.push((partition, key, None));
        }
    }
    out
}

fn postgres_schema() -> serde_json::Value {
    let row = serde_json::json!([
        {"type": "int64", "optional": false, "field": "id"},
        {"type": "string", "optional": true, "field": "region"},
        {"type": "string", "optional": true, "field": "amount"},
        {"type": "int64", "optional": true, "name": "io.debezium.time.Timestamp", "field": "created_at"},
    ]);
    serde_json::json!({"type": "struct", "name": "test.Envelope", "optional": false, "fields": [
        {"type": "struct", "optional": true, "field": "before", "fields": row},
        {"type": "struct", "optional": true, "field": "after", "fields": row},
        {"type": "struct", "optional": false, "field": "source", "fields": [
            {"type": "int64", "optional": true, "field": "lsn"}, {"type": "int64", "optional": false, "field": "ts_ms"}]},
        {"type": "string", "optional": false, "field": "op"},
        {"type": "int64", "optional": true, "field": "ts_ms"},
    ]})
}

/// Fetches `/metrics` from a running inlet.
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("metrics endpoint reachable");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).unwrap();
    body
}

/// The value of a metric line (`name{labels} value`) in a scrape, or 0.
pub fn metric(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// The sum of every series of metric `name` in a scrape (all label values).
pub fn metric_sum(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A CDC stream and the table it must produce.
pub struct ModelStream {
    /// (partition, key, value) in production order; `None` values are tombstones.
    pub messages: Vec<(i32, String, Option<String>)>,
    /// Expected live rows by id under `deduplicate`: (region, amount, created_at in seconds).
    pub expected: BTreeMap<i64, (Option<String>, String, i64)>,
    /// The same under `first-row`: each key's first row, deletes ignored.
    pub first_row: BTreeMap<i64, (Option<String>, String, i64)>,
    /// The same under `partial-update`: non-null fields of newer changes overwrite.
    pub partial_update: BTreeMap<i64, (Option<String>, String, i64)>,
    /// The same under `aggregation` with `amount: sum`, `created_at: max` (region keeps the last
    /// non-null value).
    pub aggregation: BTreeMap<i64, (Option<String>, String, i64)>,
}

fn cents(amount: &serde_json::Value) -> i64 {
    let (units, frac) = amount.as_str().unwrap().split_once('.').unwrap();
    units.parse::<i64>().unwrap() * 100 + frac.parse::<i64>().unwrap()
}

pub fn expected_row(r: &serde_json::Value) -> (Option<String>, String, i64) {
    (
        r["region"].as_str().map(str::to_string),
        r["amount"].as_str().unwrap().to_string(),
        r["created_at"].as_i64().unwrap() / 1000,
    )
}

/// A keyed Debezium stream with duplicates, stale re-sends, deletes with tombstones,
/// re-inserts and cross-partition moves (region and day change), and the final table it implies.
/// Keys go to partition `id % partitions`, as Debezium's key partitioning keeps a key in one
/// partition. Versions are the PostgreSQL LSN of each change.
pub fn upsert_stream(seed: u64, ops: usize, keys: i64, partitions: i32) -> ModelStream {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut live: BTreeMap<i64, serde_json::Value> = BTreeMap::new();
    let mut first_row: BTreeMap<i64, serde_json::Value> = BTreeMap::new();
    let mut partial: BTreeMap<i64, serde_json::Value> = BTreeMap::new();
    let mut aggregated: BTreeMap<i64, serde_json::Value> = BTreeMap::new();
    let mut sent: Vec<(i32, String, Option<String>)> = Vec::new();
    let mut lsn = 10_000i64;
    let mut messages = Vec::new();
    while messages.len() < ops {
        if !sent.is_empty() && rng.gen_bool(0.08) {
            // A duplicate or late re-send of an earlier change: never newer than what the key has.
            let old = sent[rng.gen_range(0..sent.len())].clone();
            messages.push(old);
            continue;
        }
        let id = rng.gen_range(0..keys);
        let row = serde_json::json!({
            "id": id,
            "region": REGIONS[rng.gen_range(0..REGIONS.len())],
            "amount": format!("{}.{:02}", rng.gen_range(0..100_000), rng.gen_range(0..100)),
            "created_at": (1_767_225_600i64 + rng.gen_range(0..4 * 86_400i64)) * 1000,
        });
        lsn += rng.gen_range(1..50);
        let before = live.get(&id).cloned();
        let (op, after) = match (&before, rng.gen_range(0..100)) {
            (None, _) => ("c", Some(row)),
            (Some(_), 0..=14) => ("d", None),
            (Some(_), _) => ("u", Some(row)),
        };
        match &after {
            Some(a) => {
                live.insert(id, a.clone());
                first_row.entry(id).or_insert_with(|| a.clone());
                let merged = match partial.get(&id) {
                    Some(old) => {
                        let mut m = old.clone();
                        for (k, v) in a.as_object().unwrap() {
                            if !v.is_null() {
                                m[k] = v.clone();
                            }
                        }
                        m
                    }
                    None => a.clone(),
                };
                partial.insert(id, merged);
                let combined = match aggregated.get(&id) {
                    Some(old) => {
                        let mut m = old.clone();
                        let sum = cents(&old["amount"]) + cents(&a["amount"]);
                        m["amount"] = serde_json::json!(format!("{}.{:02}", sum / 100, sum % 100));
                        let newest = old["created_at"].as_i64().max(a["created_at"].as_i64());
                        m["created_at"] = serde_json::json!(newest);
                        if !a["region"].is_null() {
                            m["region"] = a["region"].clone();
                        }
                        m
                    }
                    None => a.clone(),
                };
                aggregated.insert(id, combined);
            }
            None => {
                live.remove(&id);
                partial.remove(&id);
                aggregated.remove(&id);
            }
        };
        let payload = serde_json::json!({
            "before": before, "after": after, "op": op, "ts_ms": lsn,
            "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": lsn},
        });
        let value = if rng.gen_bool(0.3) {
            serde_json::json!({"schema": postgres_schema(), "payload": payload})
        } else {
            payload
        };
        let partition = (id % partitions as i64) as i32;
        let key = serde_json::json!({"id": id}).to_string();
        let msg = (partition, key.clone(), Some(value.to_string()));
        sent.push(msg.clone());
        messages.push(msg);
        if op == "d" {
            messages.push((partition, key, None));
        }
    }
    let rows = |m: BTreeMap<i64, serde_json::Value>| {
        m.into_iter()
            .map(|(id, r)| (id, expected_row(&r)))
            .collect()
    };
    ModelStream {
        messages,
        expected: rows(live),
        first_row: rows(first_row),
        partial_update: rows(partial),
        aggregation: rows(aggregated),
    }
}

/// A pipeline config for an upsert table keyed by `id`, partitioned by day and region.
pub fn upsert_config(
    lake: &Lake,
    bootstrap: &str,
    topic: &str,
    table: &str,
    merge: &str,
    max_records: u64,
) -> PathBuf {
    let mut mode = format!("mode: upsert\n  merge_engine: {merge}\n  target_rows_per_bucket: 500");
    if merge == "aggregation" {
        mode.push_str("\n  aggregations: {amount: sum, created_at: max}");
    }
    pipeline_config(lake, bootstrap, topic, table, &mode, max_records, "")
}

/// Runs `inlet` until the table holds every produced offset, then stops it with SIGTERM and
/// checks that it exits cleanly.
pub async fn run_to_end(
    lake: &Lake,
    config: &std::path::Path,
    table: &str,
    produced: &[Produced],
    env: &[(&str, &str)],
) {
    finish_run(lake, Inlet::spawn(config, env), table, produced).await;
}

/// [`run_to_end`], returning the log events inlet wrote (JSON objects, one per event).
pub async fn run_to_end_logged(
    lake: &Lake,
    config: &std::path::Path,
    table: &str,
    produced: &[Produced],
) -> Vec<Json> {
    let log = lake.path().join(format!("{}.log", unique("inlet")));
    finish_run(
        lake,
        Inlet::spawn_logged(config, &[], &log),
        table,
        produced,
    )
    .await;
    std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect()
}

async fn finish_run(lake: &Lake, mut inlet: Inlet, table: &str, produced: &[Produced]) {
    let target: i64 = end_offsets(produced).values().sum();
    assert!(
        wait_committed(lake, "test", table, table, target, Duration::from_secs(240)).await,
        "inlet did not catch up"
    );
    inlet.sigterm();
    let status = inlet.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "inlet did not exit cleanly: {status:?}"
    );
}

/// A GET or POST to inlet's HTTP endpoint: (status code, body).
pub fn http(method: &str, addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// `/health/ready`: (status code, body).
pub fn ready(addr: &str) -> (u16, String) {
    http("GET", addr, "/health/ready")
}

/// Polls `check` every 200 ms until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = check() {
            return Some(v);
        }
        if start.elapsed() > timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until `/health/ready` answers `status` with a body containing every one of `parts`;
/// panics with the last answer otherwise.
pub fn wait_health(addr: &str, status: u16, parts: &[&str], timeout: Duration) -> String {
    let mut last = (0, String::new());
    wait_for(timeout, || {
        last = ready(addr);
        (last.0 == status && parts.iter().all(|p| last.1.contains(p))).then(|| last.1.clone())
    })
    .unwrap_or_else(|| {
        panic!(
            "/health/ready never answered {status} with {parts:?}; last: {} {}",
            last.0, last.1
        )
    })
}

/// The JSON log events in a file written by [`Inlet::spawn_logged`].
pub fn log_events(log: &Path) -> Vec<Json> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// Log events whose message contains `text`.
pub fn events_with(log: &Path, text: &str) -> Vec<Json> {
    log_events(log)
        .into_iter()
        .filter(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(text))
        })
        .collect()
}

/// A PostgreSQL server of the test's own (initdb in a temporary directory, password
/// authentication, a free port), so faults can be injected by stopping and starting it without
/// touching any other server. Stopped on drop.
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
}

/// The password of the `inlet` user of a test [`Postgres`].
pub const PG_PASSWORD: &str = "inlet-test-secret";

impl Postgres {
    pub fn start() -> Postgres {
        let bin = std::env::var_os("INLET_TEST_PG_BIN")
            .map(PathBuf::from)
            .or_else(|| {
                let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
                    .ok()?
                    .filter_map(|e| Some(e.ok()?.path().join("bin")))
                    .filter(|p| p.join("initdb").exists())
                    .collect();
                found.sort();
                found.pop()
            })
            .expect("PostgreSQL server binaries not found; run `scripts/test-env.sh` (or set INLET_TEST_PG_BIN)");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pw"), PG_PASSWORD).unwrap();
        let pg = Postgres {
            dir,
            bin,
            port: free_port(),
        };
        // PostgreSQL refuses to run as root; its own user owns the directory then.
        if is_root() {
            assert!(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(pg.dir.path())
                .status()
                .unwrap()
                .success());
        }
        let data = pg.data();
        let out = pg
            .command("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "inlet", "--auth=scram-sha-256", "--no-sync"])
            .arg(format!("--pwfile={}", pg.dir.path().join("pw").display()))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        pg.resume();
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn command(&self, tool: &str) -> Command {
        let path = self.bin.join(tool);
        if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    /// `postgresql://` URI of database `postgres` as user `inlet` with `password`.
    pub fn uri(&self, password: &str) -> String {
        format!(
            "postgresql://inlet:{password}@127.0.0.1:{}/postgres",
            self.port
        )
    }

    /// Stops the server (fast shutdown: open connections are cut).
    pub fn stop(&self) {
        let out = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "fast", "-w", "stop"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl stop failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the server again on its port.
    pub fn resume(&self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.path().display()
        );
        let out = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-o", &opts, "-w", "-t", "60", "-l"])
            .arg(self.dir.path().join("log"))
            .arg("start")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
        );
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"])
            .output();
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
