//! The `inlet` command line.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tokio::sync::watch;

use inlet::config::Config;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Streams database change data from Kafka into Apache Iceberg tables, exactly once.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at startup: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Runs a pipeline until SIGINT/SIGTERM, then commits what is buffered and exits.
    Run {
        /// Pipeline configuration (YAML).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Checks a configuration and prints it with defaults filled in and secrets redacted.
    Validate {
        /// Pipeline configuration (YAML).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Runs the real pipeline against an embedded Kafka with a sample Debezium stream.
    Demo {
        /// Where the catalog and warehouse go.
        #[arg(long, default_value = "inlet-demo")]
        dir: PathBuf,
        /// Number of orders in the sample stream.
        #[arg(long, default_value_t = 20_000)]
        orders: usize,
        /// Send events with the Connect schema envelope (`schemas.enable=true`), about five times
        /// larger; the embedded Kafka then holds about 8,000 orders.
        #[arg(long)]
        schemas: bool,
    },
    /// Measures the upsert pipeline, decoding and index rebuild on a generated stream, through
    /// a real Kafka-protocol broker.
    Bench {
        /// Broker to produce the stream to and consume it from.
        #[arg(long)]
        bootstrap: String,
        /// Distinct primary keys.
        #[arg(long, default_value_t = 1_000_000)]
        keys: u64,
        /// Changes in the stream (the first `keys` are inserts).
        #[arg(long, default_value_t = 5_000_000)]
        ops: u64,
        /// Partitions of the generated topic (index shards).
        #[arg(long, default_value_t = 4)]
        partitions: i32,
        /// Where the catalog, warehouse and index go.
        #[arg(long, default_value = "inlet-bench")]
        dir: PathBuf,
        /// A warehouse to run the pipeline into (repeat to compare, e.g. a local path and
        /// `s3://bucket/bench`; S3 is reached through the standard AWS environment). Default:
        /// `DIR/warehouse`.
        #[arg(long)]
        warehouse: Vec<String>,
        /// Commits timed per warehouse for commit latency percentiles.
        #[arg(long, default_value_t = 200)]
        commits: usize,
        /// Reuse this topic if it already holds the stream (else it is created and produced).
        #[arg(long)]
        topic: Option<String>,
        /// An `inlet` binary to run the pipeline with, as a process of its own (repeat to
        /// compare builds side by side on the same stream). Default: this binary.
        #[arg(long)]
        pipeline: Vec<PathBuf>,
        /// Runs of each pipeline binary, taking turns.
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// Stages to leave out, comma-separated: decode, commits, history, failover, rebuild.
        #[arg(long, value_delimiter = ',')]
        skip: Vec<String>,
        /// A configuration to compare, `LABEL=YAML` (a mapping merged into the pipeline's
        /// configuration, e.g. `off=services: {compact: false}`); repeat to compare several,
        /// each run with every pipeline binary.
        #[arg(long, value_parser = parse_variant)]
        variant: Vec<(String, String)>,
        /// A Python with pyiceberg to time a full scan of each run's table with. Default: the
        /// test environment's (`$INLET_CACHE/venv`) when it exists.
        #[arg(long)]
        python: Option<PathBuf>,
        /// Commits of the table-history stage (commit time and metadata size, early and late).
        #[arg(long, default_value_t = 5_000)]
        history: usize,
        /// Instances of the pipeline run at once in one consumer group, comma-separated counts
        /// (each a run of its own, e.g. `1,2,3`; they share this machine's cores).
        #[arg(long, value_delimiter = ',')]
        instances: Vec<usize>,
        /// Seconds each pipeline may keep running after its last commit while its compaction
        /// works off what is due (idle compaction); the table is then scanned as it was at the
        /// last commit and as the compaction left it. 0: stopped at the last commit.
        #[arg(long, default_value_t = 0)]
        drain: u64,
    },
    /// Measures what a big upsert table costs: writes `inlet bench`'s table with N keys
    /// directly (no topic), rebuilds every shard's index from it (rate, memory, bytes on disk),
    /// and with `--bootstrap` restarts `inlet run` on the persisted index.
    BenchTable {
        /// Keys in the table.
        #[arg(long, default_value_t = 1_000_000)]
        keys: u64,
        /// Partitions of the source topic (index shards).
        #[arg(long, default_value_t = 4)]
        partitions: i32,
        /// Where the catalog, warehouse and index go (the table must not exist there yet).
        #[arg(long, default_value = "inlet-bench-table")]
        dir: PathBuf,
        /// Broker for the restart stage (left out without one).
        #[arg(long)]
        bootstrap: Option<String>,
        /// Updates of existing keys the restart stage produces and commits.
        #[arg(long, default_value_t = 1_000)]
        changes: u64,
        /// Also time a failover (needs `--bootstrap`): `inlet run` on a host with no local
        /// index, once rebuilding it from the table and once restoring it from its copy.
        #[arg(long)]
        failover: bool,
    },
    /// Measures a whole database through one pipeline: a topic per table (Debezium's layout),
    /// one routed upsert pipeline over them all by pattern; prints the time to the first
    /// commit and to every table caught up, records/s, peak RSS, open files and RocksDB
    /// instances.
    BenchSync {
        /// Broker to produce the topics to and consume them from.
        #[arg(long)]
        bootstrap: String,
        /// Upstream tables, a topic each.
        #[arg(long, default_value_t = 200)]
        tables: usize,
        /// Keys per table.
        #[arg(long, default_value_t = 5_000)]
        keys: u64,
        /// Changes in all, spread evenly over the tables.
        #[arg(long, default_value_t = 2_000_000)]
        ops: u64,
        /// Partitions of each table's topic.
        #[arg(long, default_value_t = 1)]
        partitions: i32,
        /// Where the catalog, warehouse and index go.
        #[arg(long, default_value = "inlet-bench-sync")]
        dir: PathBuf,
        /// An `inlet` binary to run the pipeline with. Default: this binary.
        #[arg(long)]
        pipeline: Option<PathBuf>,
        /// The pipeline's `checkpoint.interval_ms`.
        #[arg(long, default_value_t = 10_000)]
        checkpoint_ms: u64,
    },
    /// Measures decoding alone, for every format, on generated order updates (no broker).
    BenchDecode {
        /// Messages per format.
        #[arg(long, default_value_t = 200_000)]
        records: usize,
    },
    /// Runs the table services once (snapshot expiry, orphan-file cleanup) on the pipeline's
    /// tables, standalone, with progress on stdout.
    Maintain {
        /// Pipeline configuration (YAML); its `services` section applies.
        #[arg(long, short)]
        config: PathBuf,
        /// List what would be expired and deleted; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Prints the configuration's JSON Schema.
    ConfigSchema,
}

/// Whether logs are JSON lines (`INLET_LOG_FORMAT=json`) rather than text.
fn json_logs() -> bool {
    std::env::var("INLET_LOG_FORMAT").as_deref() == Ok("json")
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("INLET_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,librdkafka=warn,rdkafka=warn,sqlx=warn")
    });
    // Colour only for a person at a terminal who has not asked for none (no-color.org).
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    if json_logs() {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Turns the first SIGINT or SIGTERM into a shutdown request. The handlers are installed
/// before this returns, so a signal arriving during startup is not lost.
fn shutdown_on_signal(tx: watch::Sender<bool>) -> inlet::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let io = |e: std::io::Error| {
        inlet::Error::new(inlet::ErrorKind::Internal, "cannot install signal handlers")
            .with_source(e)
    };
    let mut term = signal(SignalKind::terminate()).map_err(io)?;
    let mut int = signal(SignalKind::interrupt()).map_err(io)?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("Shutting down: committing buffered records");
        let _ = tx.send(true);
    });
    Ok(())
}

async fn run(path: PathBuf) -> inlet::Result<()> {
    // First: a SIGTERM while the configuration loads is a shutdown, not the default action.
    let (tx, rx) = watch::channel(false);
    shutdown_on_signal(tx)?;
    let config = Config::load(&path)?;
    raise_open_file_limit();
    if !config.metrics.listen.is_empty() {
        // Bound before the pipeline starts, so a taken port is a startup error.
        let listen = config.metrics.listen.clone();
        let admin_token = config.metrics.resolved_admin_token()?;
        let server = inlet::http::bind(&listen, admin_token).await?;
        tokio::spawn(async move {
            if let Err(e) = server.await {
                tracing::error!(error = %e, "Metrics endpoint failed");
            }
        });
    }
    inlet::supervisor::supervise(path, config, rx).await
}

/// Raises the soft limit of open files to the hard one. Each index shard keeps about 20 files
/// open (RocksDB's tables, log, manifest and directories), so a database sync of hundreds of
/// tables needs thousands, past the soft limit of 1024 many systems and containers start with.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` and `setrlimit` only read and write the struct passed to them.
    let raised = unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0
            && limit.rlim_cur < limit.rlim_max
            && {
                let soft = limit.rlim_cur;
                limit.rlim_cur = limit.rlim_max;
                let ok = libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0;
                limit.rlim_cur = if ok { limit.rlim_max } else { soft };
                ok
            }
    };
    tracing::debug!(
        soft = limit.rlim_cur,
        hard = limit.rlim_max,
        raised,
        "Open file limit"
    );
}

fn main() -> ExitCode {
    inlet::alloc::configure();
    let cli = Cli::parse();
    init_logging();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run { config } => run(config).await,
            Command::Validate { config } => {
                let c = Config::load(&config)?;
                print!("{}", c.redacted_yaml());
                eprintln!("{}: valid", config.display());
                Ok(())
            }
            Command::Demo {
                dir,
                orders,
                schemas,
            } => inlet::demo::run(dir, orders, schemas).await,
            Command::Bench {
                bootstrap,
                keys,
                ops,
                partitions,
                dir,
                warehouse,
                commits,
                topic,
                pipeline,
                rounds,
                skip,
                variant,
                python,
                history,
                instances,
                drain,
            } => {
                let dir = std::env::current_dir().map(|d| d.join(&dir)).unwrap_or(dir);
                let python = python.or_else(|| {
                    let cache =
                        std::env::var_os("INLET_CACHE")
                            .map(PathBuf::from)
                            .or_else(|| {
                                std::env::var_os("HOME")
                                    .map(|h| PathBuf::from(h).join(".cache").join("inlet"))
                            })?;
                    let venv = cache.join("venv").join("bin").join("python");
                    venv.exists().then_some(venv)
                });
                inlet::bench::run(inlet::bench::BenchOptions {
                    bootstrap,
                    keys,
                    ops,
                    partitions,
                    dir,
                    warehouses: warehouse,
                    commits,
                    topic,
                    pipelines: pipeline,
                    rounds,
                    skip,
                    variants: variant,
                    python,
                    history,
                    instances,
                    drain_secs: drain,
                })
                .await
            }
            Command::BenchTable {
                keys,
                partitions,
                dir,
                bootstrap,
                changes,
                failover,
            } => {
                let dir = std::env::current_dir().map(|d| d.join(&dir)).unwrap_or(dir);
                inlet::bench_table::run(inlet::bench_table::BenchTableOptions {
                    keys,
                    partitions,
                    dir,
                    bootstrap,
                    changes,
                    binary: None,
                    failover,
                })
                .await
                .map(|_| ())
            }
            Command::BenchDecode { records } => inlet::bench::decode_formats(records),
            Command::BenchSync {
                bootstrap,
                tables,
                keys,
                ops,
                partitions,
                dir,
                pipeline,
                checkpoint_ms,
            } => {
                let dir = std::env::current_dir().map(|d| d.join(&dir)).unwrap_or(dir);
                inlet::bench_sync::run(inlet::bench_sync::SyncOptions {
                    checkpoint_ms,
                    bootstrap,
                    tables,
                    keys,
                    ops,
                    partitions,
                    dir,
                    binary: pipeline,
                })
                .await
            }
            Command::Maintain { config, dry_run } => {
                let c = Config::load(&config)?;
                inlet::maintain::run_standalone(&c, dry_run).await
            }
            Command::ConfigSchema => {
                print!("{}", Config::json_schema());
                Ok(())
            }
        }
    });
    // Tasks still blocked in a wait (a dead broker, a hung catalog) must not hold up the exit.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, in the configured log format, naming the setting and the fix.
            if json_logs() {
                tracing::error!(kind = e.kind().as_str(), error = %e, "Stopped");
            } else {
                eprintln!("error: {e}");
            }
            ExitCode::from(if e.kind() == inlet::ErrorKind::Config {
                2
            } else {
                1
            })
        }
    }
}

/// `LABEL=YAML` of `inlet bench --variant`.
fn parse_variant(text: &str) -> std::result::Result<(String, String), String> {
    let (label, yaml) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not LABEL=YAML"))?;
    Ok((label.trim().to_string(), yaml.to_string()))
}
