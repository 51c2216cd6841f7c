//! Table services that keep a table fast as it ages. Old metadata files and manifest merging
//! happen on every commit (in [`crate::table`]); snapshot expiry ([`expire`]) and orphan-file
//! cleanup ([`orphans`]) run here, in the background of a running pipeline every
//! `services.interval_ms`, or once through `inlet maintain`. Inline compaction ([`compact`]),
//! partition retention ([`retention`]) and mark-done ([`done`]) run right after a checkpoint,
//! as the shards' own writers.

pub mod compact;
pub mod done;
pub mod expire;
pub mod orphans;
pub mod pack;
pub mod partitions;
mod reach;
pub mod retention;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::config::{Config, ServicesConfig};
use crate::metrics::{metrics, service};
use inlet_common::error::Result;
use inlet_iceberg::Table;

pub use expire::{expire_snapshots, Expired, ExpiryPolicy};
pub use orphans::{find_orphans, remove_orphans, Orphan};

/// The table properties tables inlet creates get, so every engine's commits keep the
/// metadata files bounded too.
pub fn table_properties(services: &ServicesConfig) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            inlet_iceberg::DELETE_AFTER_COMMIT.to_string(),
            "true".into(),
        ),
        (
            inlet_iceberg::PREVIOUS_VERSIONS_MAX.to_string(),
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
            .set(inlet_iceberg::now_ms() as f64 / 1000.0);
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
        service::EXPIRE_SNAPSHOTS,
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
        service::REMOVE_ORPHANS,
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
    use inlet_iceberg::catalog::Catalog;
    use inlet_iceberg::io::FileIO;
    let catalog = Catalog::connect(&cfg.catalog.settings()?).await?;
    let io = FileIO::new(cfg.storage.settings()?);
    let names = match cfg.routing {
        None => vec![(cfg.table.namespace.clone(), cfg.table.name.clone())],
        Some(_) => catalog.list_tables().await?,
    };
    let settings = Settings::from_config(cfg, dry_run);
    let partition_settings = PartitionSettings::from_config(cfg);
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
        if let Some(partition_settings) = &partition_settings {
            run_partitions(
                &mut table,
                cfg,
                partition_settings,
                dry_run,
                inlet_iceberg::now_ms(),
                &mut print,
            )
            .await?;
        }
        if cfg.services.compact && cfg.table.mode == crate::config::TableMode::Changelog {
            pack(&mut table, cfg, dry_run, &mut print).await?;
        }
        run(&mut table, &settings, inlet_iceberg::now_ms(), &mut print).await?;
        print(format!(
            "{namespace}.{name}: done in {:.1}s",
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}

/// `inlet maintain`'s packing of a changelog table's small files.
async fn pack(
    table: &mut Table,
    cfg: &Config,
    dry_run: bool,
    progress: &mut (dyn FnMut(String) + Send),
) -> Result<()> {
    let name = format!("{}.{}", table.namespace, table.name);
    let verb = if dry_run { "would " } else { "" };
    let target = cfg.table.target_file_bytes as i64;
    let policy = pack::PackPolicy {
        small_file_bytes: target / 4,
        target_file_bytes: target,
        budget_bytes: cfg.services.compact_budget_bytes as i64,
    };
    let committer = crate::commit::Committer {
        pipeline_id: cfg.pipeline_id.clone(),
        writer_id: format!("maintain-{}", uuid::Uuid::new_v4()),
        retries: 10,
        retry_for: Duration::from_millis(cfg.checkpoint.commit_timeout_ms),
    };
    let done = timed(
        service::PACK_FILES,
        pack::pack_files(table, &committer, &policy, dry_run),
    )
    .await?;
    progress(format!(
        "{name}: {verb}pack {} small files into {} ({} bytes), {} left for the next run",
        done.files_in, done.files_out, done.bytes, done.backlog
    ));
    Ok(())
}

/// `inlet maintain`'s partition retention and mark-done on one table. Retention drops every
/// file of an expired partition, an upsert table's too: its shards' indexes replay the drop
/// when the pipeline next opens them.
async fn run_partitions(
    table: &mut Table,
    cfg: &Config,
    settings: &PartitionSettings,
    dry_run: bool,
    now_ms: i64,
    progress: &mut (dyn FnMut(String) + Send),
) -> Result<()> {
    let name = format!("{}.{}", table.namespace, table.name);
    let verb = if dry_run { "would " } else { "" };
    let Some(field) = settings.time_field(table, cfg.routing.is_some())? else {
        progress(format!(
            "{name}: no time partition field; partition services skip it"
        ));
        return Ok(());
    };
    let committer = crate::commit::Committer {
        pipeline_id: cfg.pipeline_id.clone(),
        writer_id: format!("maintain-{}", uuid::Uuid::new_v4()),
        retries: 10,
        retry_for: Duration::from_millis(cfg.checkpoint.commit_timeout_ms),
    };
    if let Some(policy) = &settings.retention {
        let done = timed(
            service::EXPIRE_PARTITIONS,
            retention::retain_whole(table, &committer, 1, &field, policy, now_ms, dry_run),
        )
        .await?;
        progress(format!(
            "{name}: {verb}drop {} expired partitions ({} data files, {} delete files, {} rows, {} late)",
            done.partitions.len(),
            done.data_files,
            done.delete_files,
            done.rows,
            done.late_rows
        ));
        for p in &done.partitions {
            progress(format!("{name}: expired partition {p}"));
        }
    }
    if let Some(policy) = &settings.done {
        let done = timed(
            service::MARK_DONE,
            done::mark_done(
                table,
                &cfg.pipeline_id,
                &field,
                policy,
                &report_client(),
                dry_run,
            ),
        )
        .await?;
        let watermark = done
            .watermark_ms
            .map_or("unknown".to_string(), |ms| ms.to_string());
        progress(format!(
            "{name}: {verb}mark {} partitions done (watermark {watermark}, {} late rows)",
            done.partitions.len(),
            done.late_rows
        ));
        for p in &done.partitions {
            progress(format!("{name}: done partition {p}"));
        }
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
                if let Err(e) = run(&mut table, &settings, inlet_iceberg::now_ms(), &mut log).await
                {
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

/// How partition retention and mark-done behave, from the `services` section.
#[derive(Debug, Clone)]
pub struct PartitionSettings {
    pub retention: Option<retention::RetentionPolicy>,
    pub done: Option<done::DonePolicy>,
    /// `services.partition_time_field`.
    pub time_field: Option<String>,
}

impl PartitionSettings {
    /// The settings `cfg` asks for; `None` when neither service is on.
    pub fn from_config(cfg: &Config) -> Option<PartitionSettings> {
        let s = &cfg.services;
        let settings = PartitionSettings {
            retention: (s.partition_expiration_ms > 0).then_some(retention::RetentionPolicy {
                expiration_ms: s.partition_expiration_ms as i64,
                strategy: s.partition_expiration_strategy,
            }),
            done: s.mark_done_idle_ms.map(|idle| done::DonePolicy {
                idle_ms: idle as i64,
                url: s.mark_done_url.clone(),
            }),
            time_field: s.partition_time_field.clone(),
        };
        (settings.retention.is_some() || settings.done.is_some()).then_some(settings)
    }

    /// The time field of `table`; `None` (logged) for a table without one when `lenient`
    /// (a routed table), else a configuration error.
    fn time_field(&self, table: &Table, lenient: bool) -> Result<Option<partitions::TimeField>> {
        let found = partitions::TimeField::of(&table.metadata, self.time_field.as_deref());
        let name = format!("{}.{}", table.namespace, table.name);
        match found {
            Ok(Some(f)) => Ok(Some(f)),
            Ok(None) if lenient => {
                tracing::debug!(table = %name, "No time partition field; partition retention and mark-done skip the table");
                Ok(None)
            }
            Ok(None) => Err(inlet_common::error::Error::config(format!(
                "services: partition retention and mark-done need a time partition field, and table {name} has none; partition it by a year, month, day or hour transform (table.partition_by) or unset services.partition_expiration_ms and services.mark_done_idle_ms"
            ))),
            Err(e) if lenient => {
                tracing::warn!(table = %name, error = %e, "Partition retention and mark-done skip the table");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// Runs `service`'s metrics around a run whose errors are only logged: a failure before
/// anything was committed, tried again next time.
fn counted(service: &str, started: Instant, ok: bool) {
    let m = metrics();
    m.maintain_duration
        .with_label_values(&[service])
        .set(started.elapsed().as_secs_f64());
    m.maintain_runs
        .with_label_values(&[service, if ok { "ok" } else { "failed" }])
        .inc();
    if ok {
        m.maintain_last_success
            .with_label_values(&[service])
            .set(inlet_iceberg::now_ms() as f64 / 1000.0);
    }
}

/// Partition retention and mark-done inside a running pipeline, after a checkpoint, at most
/// once every `services.partition_interval_ms`.
pub struct PartitionServices {
    settings: PartitionSettings,
    interval: Duration,
    last: Option<Instant>,
    http: reqwest::Client,
    routed: bool,
}

impl PartitionServices {
    /// The services `cfg` configures; `None` when neither is on.
    pub fn new(cfg: &Config) -> Option<PartitionServices> {
        Some(PartitionServices {
            settings: PartitionSettings::from_config(cfg)?,
            interval: Duration::from_millis(cfg.services.partition_interval_ms),
            last: None,
            http: report_client(),
            routed: cfg.routing.is_some(),
        })
    }

    /// Whether a run is due after this checkpoint (the first checkpoint runs one).
    pub fn due(&mut self) -> bool {
        if self.last.is_some_and(|l| l.elapsed() < self.interval) {
            return false;
        }
        self.last = Some(Instant::now());
        true
    }

    /// Runs retention, then mark-done, on one of the pipeline's tables as of `now_ms`. An
    /// upsert table's shards (`upsert`) each drop their own files as checkpoint `checkpoint`,
    /// fenced by `fence` (the offsets the pipeline's last checkpoint left) and `epochs`. A
    /// changelog table's files, and mark-done, are left to the member owning the table's first
    /// source partition among `owned`, so members do not race each other. Errors are those
    /// whose commit outcome is unknown; others are logged and counted, and the next run tries
    /// again.
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &self,
        table: &mut Table,
        upsert: Option<&mut crate::upsert::UpsertSink>,
        committer: &crate::commit::Committer,
        checkpoint: u64,
        fence: &crate::commit::Offsets,
        epochs: &crate::commit::Epochs,
        owned: &std::collections::HashSet<(String, i32)>,
        now_ms: i64,
    ) -> Result<()> {
        let name = format!("{}.{}", table.namespace, table.name);
        let field = match self.settings.time_field(table, self.routed) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(()),
            Err(e) => return Err(e),
        };
        let offsets = crate::commit::table_offsets(&table.metadata, &committer.pipeline_id)?;
        let leads = offsets
            .iter()
            .flat_map(|(t, ps)| ps.keys().map(move |p| (t.clone(), *p)))
            .next()
            .is_some_and(|first| owned.contains(&first));
        if let Some(policy) = &self.settings.retention {
            let started = Instant::now();
            let done = match upsert {
                Some(upsert) => {
                    match retention::stage_shards(table, upsert, &field, policy, now_ms).await {
                        Ok(None) => Some(retention::Retained::default()),
                        Ok(Some(staged)) => {
                            let r = retention::commit_shards(
                                staged, table, upsert, committer, checkpoint, fence, epochs,
                            )
                            .await;
                            if r.is_err() {
                                counted(service::EXPIRE_PARTITIONS, started, false);
                            }
                            Some(r?)
                        }
                        Err(e) => {
                            tracing::warn!(table = %name, service = service::EXPIRE_PARTITIONS, error = %e, "Table services failed; they run again next interval");
                            None
                        }
                    }
                }
                None if leads => {
                    let r = retention::retain_whole(
                        table, committer, checkpoint, &field, policy, now_ms, false,
                    )
                    .await;
                    match r {
                        Ok(done) => Some(done),
                        // A whole-table drop saves nothing beside an index: a failed commit
                        // is tried again by the next run.
                        Err(e) => {
                            tracing::warn!(table = %name, service = service::EXPIRE_PARTITIONS, error = %e, "Table services failed; they run again next interval");
                            None
                        }
                    }
                }
                None => Some(retention::Retained::default()),
            };
            counted(service::EXPIRE_PARTITIONS, started, done.is_some());
            if let Some(done) = done.filter(|d| d.snapshot_id.is_some()) {
                tracing::info!(
                    table = %name,
                    snapshot_id = done.snapshot_id,
                    partitions = done.partitions.len(),
                    data_files = done.data_files,
                    delete_files = done.delete_files,
                    rows = done.rows,
                    late_rows = done.late_rows,
                    backlog = done.backlog,
                    "Expired partitions dropped"
                );
            }
        }
        if let (Some(policy), true) = (&self.settings.done, leads) {
            let started = Instant::now();
            let r = done::mark_done(
                table,
                &committer.pipeline_id,
                &field,
                policy,
                &self.http,
                false,
            )
            .await;
            counted(service::MARK_DONE, started, r.is_ok());
            match r {
                Ok(d) if !d.partitions.is_empty() || d.late_rows > 0 => tracing::info!(
                    table = %name,
                    partitions = d.partitions.len(),
                    watermark_ms = d.watermark_ms,
                    through_ms = d.through_ms,
                    late_rows = d.late_rows,
                    "Partitions marked done"
                ),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(table = %name, service = service::MARK_DONE, error = %e, "Table services failed; they run again next interval")
                }
            }
        }
        Ok(())
    }
}

/// The HTTP client of mark-done reports.
fn report_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap_or_default()
}
