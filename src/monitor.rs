//! Probes that run beside a pipeline, so readiness tells the truth between checkpoints: the
//! broker (and whether the configured topics exist), the catalog and the storage are checked
//! every `health.probe_interval_ms`; high watermarks of newly assigned partitions are fetched
//! at once, so lag is exported from assignment on; progress is logged until the first commit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::consumer::{Consumer, StreamConsumer};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::health::health;
use crate::metrics::metrics;
use crate::metrics::Component;
use crate::source::{self, SourceContext};
use inlet_common::error::{Error, Result};
use inlet_iceberg::catalog::Catalog;
use inlet_iceberg::io::FileIO;

/// How long one probe may take before it counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(15);

/// How often progress is logged while nothing has been committed yet.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(15);

/// What the probes talk to.
pub struct Probes {
    pub consumer: Arc<StreamConsumer<SourceContext>>,
    pub topics: Vec<String>,
    pub catalog: Catalog,
    /// The pipeline's one table; `None` with routing (the catalog's table list is read).
    pub table: Option<(String, String)>,
    /// Where the storage probe writes, and with which credentials: below the warehouse, or
    /// where the catalog places the tables (REST), below the first table's location once it is
    /// known (`Monitor::watch_storage`).
    pub storage: Option<StorageProbe>,
    pub interval: Duration,
}

/// The file the storage probe writes and deletes, and the storage it goes through.
#[derive(Clone)]
pub struct StorageProbe {
    pub io: FileIO,
    pub file: String,
}

/// The running probes; they stop when this is dropped.
pub struct Monitor {
    task: JoinHandle<()>,
    wake: Arc<Notify>,
    storage: Arc<std::sync::Mutex<Option<StorageProbe>>>,
}

impl Monitor {
    /// Runs the probes now (after an assignment) instead of at the next interval.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Stops the probes and waits until they have let go of what they hold.
    pub async fn stop(&mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }

    /// Whether the storage is probed.
    pub fn watches_storage(&self) -> bool {
        self.slot().is_some()
    }

    /// Probes the storage through `probe` from now on.
    pub fn watch_storage(&self, probe: StorageProbe) {
        *self.slot() = Some(probe);
        self.wake();
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<StorageProbe>> {
        self.storage.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts the probes.
pub fn spawn(mut probes: Probes) -> Monitor {
    let wake = Arc::new(Notify::new());
    let storage = Arc::new(std::sync::Mutex::new(probes.storage.take()));
    let task = tokio::spawn(run(probes, wake.clone(), storage.clone()));
    Monitor {
        task,
        wake,
        storage,
    }
}

/// The file the storage probe writes and deletes, unique to this process.
pub fn probe_file(warehouse: &str, pipeline_id: &str) -> String {
    let id = &uuid::Uuid::new_v4().simple().to_string()[..8];
    format!("{warehouse}/.inlet/probe-{pipeline_id}-{id}")
}

async fn run(p: Probes, wake: Arc<Notify>, storage: Arc<std::sync::Mutex<Option<StorageProbe>>>) {
    let mut last_progress = Instant::now();
    loop {
        probe_broker(&p).await;
        probe_catalog(&p).await;
        let target = storage.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(target) = target {
            match within(write_probe(&target.io, &target.file)).await {
                Ok(()) => health().succeeded(Component::Storage),
                Err(e) => health().failed(Component::Storage, &e),
            }
        }
        fetch_watermarks(&p).await;
        if health().commits_this_run() == 0 && last_progress.elapsed() >= PROGRESS_INTERVAL {
            log_progress(&p.consumer);
            last_progress = Instant::now();
        }
        tokio::select! {
            _ = tokio::time::sleep(p.interval) => {}
            _ = wake.notified() => {}
        }
    }
}

/// Runs `f` with the probe timeout.
async fn within<T>(f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout(PROBE_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            crate::ErrorKind::Internal,
            format!("no answer within {}s", PROBE_TIMEOUT.as_secs()),
        )),
    }
}

async fn probe_broker(p: &Probes) {
    let consumer = p.consumer.clone();
    let topics = p.topics.clone();
    let answer =
        tokio::task::spawn_blocking(move || source::probe_topics(&consumer, &topics)).await;
    match answer {
        Ok(Ok(missing)) => {
            health().succeeded(Component::Broker);
            health().set_missing_topics(missing);
        }
        Ok(Err(e)) => health().failed(Component::Broker, &e),
        Err(e) => health().failed(Component::Broker, &e),
    }
}

async fn probe_catalog(p: &Probes) {
    let answer = within(p.catalog.probe(p.table.as_ref())).await;
    match answer {
        Ok(()) => health().succeeded(Component::Catalog),
        Err(e) => health().failed(Component::Catalog, &e),
    }
}

/// Writes and deletes a small file: the storage takes writes.
pub async fn write_probe(io: &FileIO, file: &str) -> Result<()> {
    io.put(file, Bytes::from_static(b"inlet storage probe\n"))
        .await?;
    io.delete(file).await
}

/// Checks at start that the warehouse (or, where the catalog places tables, a table's location)
/// takes writes. A refusal no retry can cure (permissions, a read-only file system) is a
/// configuration error naming `setting`.
pub async fn check_warehouse(
    io: &FileIO,
    file: &str,
    warehouse: &str,
    setting: &str,
) -> Result<()> {
    let result = write_probe(io, file).await;
    let Err(e) = result else {
        health().succeeded(Component::Storage);
        return Ok(());
    };
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind as K;
            if matches!(
                io.kind(),
                K::PermissionDenied | K::ReadOnlyFilesystem | K::NotADirectory
            ) {
                return Err(Error::config(format!(
                    "{setting}: cannot write below \"{warehouse}\" ({io}); make the directory writable by this process or point {setting} at a writable location"
                )));
            }
        }
        source = s.source();
    }
    health().failed(Component::Storage, &e);
    Err(e)
}

async fn fetch_watermarks(p: &Probes) {
    let untracked = source::untracked_watermarks();
    if untracked.is_empty() {
        return;
    }
    let consumer = p.consumer.clone();
    let _ = tokio::task::spawn_blocking(move || {
        for (topic, partition) in untracked {
            match consumer.fetch_watermarks(&topic, partition, source::METADATA_TIMEOUT) {
                Ok((low, high)) => source::track_watermarks(&topic, partition, low, high),
                Err(e) => {
                    tracing::debug!(topic, partition, error = %e, "Cannot fetch watermarks");
                    break;
                }
            }
        }
    })
    .await;
}

/// Logs what the pipeline is doing while it has not committed: waiting for partitions, or
/// reading them (positions, records buffered). Quiet when there is nothing to read.
fn log_progress(consumer: &StreamConsumer<SourceContext>) {
    let Some(assigned) = health().assignment() else {
        if consumer.context().claims.any() {
            tracing::info!("Claiming the assigned partitions in the table");
        } else {
            tracing::info!("Waiting for the consumer group to assign partitions");
        }
        return;
    };
    let buffered = metrics().buffered_records.get();
    if assigned.is_empty() || buffered == 0 {
        return;
    }
    let positions = consumer
        .position()
        .map(|tpl| {
            tpl.elements()
                .iter()
                .map(|e| match e.offset().to_raw() {
                    Some(o) if o >= 0 => format!("{}/{}@{o}", e.topic(), e.partition()),
                    _ => format!("{}/{}@start", e.topic(), e.partition()),
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    tracing::info!(
        partitions = assigned.len(),
        records_buffered = buffered,
        positions = %positions,
        "Consuming; nothing committed yet in this run"
    );
}
