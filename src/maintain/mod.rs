//! Table services that keep a table fast as it ages. Old metadata files and manifest merging
//! happen on every commit (in [`crate::table`]); snapshot expiry ([`expire`]) and orphan-file
//! cleanup ([`orphans`]) run here, in the background of a running pipeline every
//! `services.interval_ms`, or once through `inlet maintain`.

pub mod compact;
pub mod expire;
pub mod orphans;
mod reach;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::config::{Config, ServicesConfig};
use crate::error::Result;
use crate::metrics::metrics;
use crate::table::Table;

pub use expire::{expire_snapshots, Expired, ExpiryPolicy};
pub use orphans::{find_orphans, remove_orphans, Orphan};

/// The services' names, as metrics label them.
pub const SERVICES: [&str; 3] = [EXPIRE, ORPHANS, "compact"];
const EXPIRE: &str = "expire_snapshots";
const ORPHANS: &str = "remove_orphans";

/// The table properties tables inlet creates get, so every engine's commits keep the
/// metadata files bounded too.
pub fn table_properties(services: &ServicesConfig) -> BTreeMap<String, String> {
    BTreeMap::from([
        (crate::table::DELETE_AFTER_COMMIT.to_string(), "true".into()),
        (
            crate::table::PREVIOUS_VERSIONS_MAX.to_string(),
            services.metadata_versions_max.to_string(),
        ),
    ])
}

/// How one run of the services behaves.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub expiry: ExpiryPolicy,
    /// The youngest an orphan file may be (ms).
    pub orphan_min_age_ms: i64,
    /// Report what would be done; commit and delete nothing.
    pub dry_run: bool,
}

impl Settings {
    /// The settings `cfg` asks for.
    pub fn from_config(cfg: &Config, dry_run: bool) -> Settings {
        let s = &cfg.services;
        Settings {
            expiry: ExpiryPolicy {
                window_ms: cfg.snapshot_window_ms() as i64,
                min_snapshots: s.snapshots_min as usize,
                batch: s.expire_batch as usize,
            },
            orphan_min_age_ms: s.orphan_min_age_ms as i64,
            dry_run,
        }
    }
}

/// What one run did to one table.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub expired: Expired,
    pub orphans: Vec<Orphan>,
}

/// Runs `service`, timing and counting it.
async fn timed<T>(service: &str, run: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    let m = metrics();
    let started = Instant::now();
    let result = run.await;
    m.maintain_duration
        .with_label_values(&[service])
        .set(started.elapsed().as_secs_f64());
    let outcome = if result.is_ok() { "ok" } else { "failed" };
    m.maintain_runs.with_label_values(&[service, outcome]).inc();
    if result.is_ok() {
        m.maintain_last_success
            .with_label_values(&[service])
            .set(crate::table::now_ms() as f64 / 1000.0);
    }
    result
}

/// Runs snapshot expiry, then orphan cleanup, on `table` at `now_ms`. `progress` hears one
/// line per step.
pub async fn run(
    table: &mut Table,
    settings: &Settings,
    now_ms: i64,
    progress: &mut (dyn FnMut(String) + Send),
) -> Result<Report> {
    let name = format!("{}.{}", table.namespace, table.name);
    let verb = if settings.dry_run { "would " } else { "" };
    let m = metrics();
    let expired = timed(
        EXPIRE,
        expire_snapshots(table, &settings.expiry, now_ms, settings.dry_run),
    )
    .await?;
    if !settings.dry_run {
        m.maintain_snapshots_expired
            .inc_by(expired.snapshots.len() as u64);
        m.maintain_files_removed
            .with_label_values(&["expired"])
            .inc_by(expired.files.len() as u64);
        m.maintain_bytes_removed
            .with_label_values(&["expired"])
            .inc_by(expired.bytes);
    }
    progress(format!(
        "{name}: {verb}expire {} snapshots, {verb}delete {} files ({} bytes)",
        expired.snapshots.len(),
        expired.files.len(),
        expired.bytes
    ));
    let orphans = timed(
        ORPHANS,
        remove_orphans(table, settings.orphan_min_age_ms, now_ms, settings.dry_run),
    )
    .await?;
    let bytes: u64 = orphans.iter().map(|o| o.size).sum();
    if !settings.dry_run {
        m.maintain_files_removed
            .with_label_values(&["orphan"])
            .inc_by(orphans.len() as u64);
        m.maintain_bytes_removed
            .with_label_values(&["orphan"])
            .inc_by(bytes);
    }
    progress(format!(
        "{name}: {verb}delete {} orphan files ({bytes} bytes)",
        orphans.len()
    ));
    if settings.dry_run {
        for o in &orphans {
            progress(format!("{name}: orphan {}", o.uri));
        }
    }
    Ok(Report { expired, orphans })
}

/// `inlet maintain`: runs the services once over the pipeline's tables (the configured table,
/// or with routing every table of the catalog the pipeline has committed to), printing
/// progress to stdout. Stops at the first table that fails, or that cannot be read for a
/// reason that may pass (storage or catalog unreachable); with routing, a table of the catalog
/// that cannot be read for good (another engine's v1 table, a view, a missing or broken
/// metadata file) is not the pipeline's: it is reported and skipped.
pub async fn run_standalone(cfg: &Config, dry_run: bool) -> Result<()> {
    use crate::table::catalog::Catalog;
    use crate::table::io::FileIO;
    let catalog = Catalog::connect(&cfg.catalog.settings()?).await?;
    let io = FileIO::new(cfg.storage.settings()?);
    let names = match cfg.routing {
        None => vec![(cfg.table.namespace.clone(), cfg.table.name.clone())],
        Some(_) => catalog.list_tables().await?,
    };
    let settings = Settings::from_config(cfg, dry_run);
    let mut print = |line: String| println!("{line}");
    for (namespace, name) in names {
        let loaded = match Table::load(&catalog, &io, &namespace, &name).await {
            Err(e) if cfg.routing.is_some() && !e.retryable() => {
                print(format!(
                    "{namespace}.{name}: skipped, not a table this pipeline can read: {e}"
                ));
                continue;
            }
            other => other?,
        };
        let Some(mut table) = loaded else {
            print(format!("{namespace}.{name}: no such table"));
            continue;
        };
        if cfg.routing.is_some() && table.metadata.last_snapshot_of(&cfg.pipeline_id).is_none() {
            continue;
        }
        let started = Instant::now();
        run(&mut table, &settings, crate::table::now_ms(), &mut print).await?;
        print(format!(
            "{namespace}.{name}: done in {:.1}s",
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}

/// Starts the services in the background of a running pipeline, at most one run at a time
/// and one every interval, so ingestion never waits for them. Their commits race the
/// pipeline's through the catalog's compare-and-swap like any other writer's.
pub struct Scheduler {
    settings: Settings,
    interval: Duration,
    enabled: bool,
    /// When the last run started.
    last: Option<Instant>,
    running: Option<tokio::task::JoinHandle<()>>,
}

impl Scheduler {
    /// A scheduler for the services `cfg` configures.
    pub fn new(cfg: &Config) -> Scheduler {
        Scheduler {
            settings: Settings::from_config(cfg, false),
            interval: Duration::from_millis(cfg.services.interval_ms),
            enabled: cfg.services.enabled,
            last: None,
            running: None,
        }
    }

    /// Called after a checkpoint: starts a run over `tables` (copies of the pipeline's) if one
    /// is due and none is running. The first run waits one interval, so a pipeline that
    /// restarts often does not scan its tables each time.
    pub fn after_checkpoint(&mut self, tables: impl FnOnce() -> Vec<Table>) {
        if !self.enabled {
            return;
        }
        let last = *self.last.get_or_insert_with(Instant::now);
        if last.elapsed() < self.interval || self.running.as_ref().is_some_and(|h| !h.is_finished())
        {
            return;
        }
        self.last = Some(Instant::now());
        let tables = tables();
        let settings = self.settings;
        self.running = Some(tokio::spawn(async move {
            for mut table in tables {
                let mut log = |line: String| tracing::info!(line = %line, "Table services");
                if let Err(e) = run(&mut table, &settings, crate::table::now_ms(), &mut log).await {
                    tracing::warn!(table = %format!("{}.{}", table.namespace, table.name), error = %e, "Table services failed; they run again next interval");
                }
            }
        }));
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        if let Some(h) = self.running.take() {
            h.abort();
        }
    }
}
