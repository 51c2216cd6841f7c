//! Prometheus metrics. Every name is defined here; label values come from fixed sets (stage
//! outcomes, error kinds) or from the bounded set of assigned topic partitions.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use prometheus::core::{Collector, Desc};
use prometheus::{
    Counter, CounterVec, Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use inlet_common::error::ErrorKind;

/// The process's metrics.
pub struct Metrics {
    pub registry: Registry,
    pub records_consumed: IntCounterVec,
    pub records_decoded: IntCounter,
    pub records_failed: IntCounterVec,
    pub skipped: IntCounterVec,
    pub schema_changes: IntCounterVec,
    pub tombstones: IntCounter,
    pub rows_written: IntCounterVec,
    pub partitions_created: IntCounterVec,
    pub files_written: IntCounter,
    pub bytes_written: IntCounter,
    pub checkpoints: IntCounterVec,
    pub commit_duration: Histogram,
    pub checkpoint_blocking: Counter,
    pub idle: CounterVec,
    pub commit_retries: IntCounterVec,
    pub last_commit: GaugeVec,
    pub committed_source_ts: GaugeVec,
    pub freshness: GaugeVec,
    pub buffered_bytes: IntGauge,
    pub buffered_records: IntGauge,
    pub lag: IntGaugeVec,
    pub assigned_partitions: IntGauge,
    pub stale: IntCounterVec,
    pub index_damaged: IntCounter,
    pub owner_epoch: IntGaugeVec,
    pub index_restores: IntCounterVec,
    pub index_restore_seconds: HistogramVec,
    pub index_copies: IntCounterVec,
    pub index_copy_bytes: IntCounter,
    pub duplicate_keys_repaired: IntCounter,
    pub ignored: IntCounter,
    pub unavailable_values: IntCounterVec,
    pub position_deletes: IntCounter,
    pub restarts: IntCounterVec,
    pub pipeline_stopped: IntGaugeVec,
    pub ready: IntGauge,
    pub check_ok: IntGaugeVec,
    pub component_up: IntGaugeVec,
    pub component_failures: IntCounterVec,
    pub maintain_runs: IntCounterVec,
    pub maintain_last_success: GaugeVec,
    pub maintain_duration: GaugeVec,
    pub maintain_snapshots_expired: IntCounter,
    pub maintain_files_removed: IntCounterVec,
    pub maintain_bytes_removed: IntCounterVec,
    pub maintain_manifests_merged: IntCounter,
    pub compact_files_rewritten: IntCounter,
    pub compact_bytes_rewritten: IntCounter,
    pub compact_deletes_removed: IntCounter,
    pub compact_backlog: IntGauge,
    pub partitions_expired: IntCounter,
    pub maintain_files_packed: IntCounter,
    pub partition_rows_dropped: IntCounter,
    pub partitions_done: IntCounter,
    pub late_rows: IntCounterVec,
    pub done_through: GaugeVec,
    /// Newest committed source timestamp per table (seconds), for freshness at scrape time.
    source_ts: Mutex<BTreeMap<String, f64>>,
    descs: Vec<(Desc, &'static str)>,
}

/// Registers collectors and remembers their descriptions for the reference table.
struct Registrar {
    registry: Registry,
    descs: Vec<(Desc, &'static str)>,
}

/// The Prometheus type of a collector, for the reference table.
trait Kind {
    const KIND: &'static str;
}

impl Kind for IntCounter {
    const KIND: &'static str = "counter";
}
impl Kind for IntCounterVec {
    const KIND: &'static str = "counter";
}
impl Kind for IntGauge {
    const KIND: &'static str = "gauge";
}
impl Kind for IntGaugeVec {
    const KIND: &'static str = "gauge";
}
impl Kind for GaugeVec {
    const KIND: &'static str = "gauge";
}
impl Kind for CounterVec {
    const KIND: &'static str = "counter";
}
impl Kind for Counter {
    const KIND: &'static str = "counter";
}
impl Kind for Histogram {
    const KIND: &'static str = "histogram";
}
impl Kind for HistogramVec {
    const KIND: &'static str = "histogram";
}

impl Registrar {
    fn add<C: Collector + Clone + Kind + 'static>(&mut self, c: C) -> C {
        self.descs
            .extend(c.desc().into_iter().map(|d| (d.clone(), C::KIND)));
        self.registry
            .register(Box::new(c.clone()))
            .expect("each metric is registered once");
        c
    }

    fn counter(&mut self, name: &str, help: &str) -> IntCounter {
        self.add(IntCounter::new(name, help).expect("metric names are static and valid"))
    }

    fn counters(&mut self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(Opts::new(name, help), labels).expect("static metric"))
    }

    fn gauge(&mut self, name: &str, help: &str) -> IntGauge {
        self.add(IntGauge::new(name, help).expect("static metric"))
    }

    fn gauges(&mut self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric"))
    }

    fn float_gauges(&mut self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.add(GaugeVec::new(Opts::new(name, help), labels).expect("static metric"))
    }

    /// The process collector (CPU, memory, open files, threads) where the platform has one.
    fn process(&mut self) {
        #[cfg(target_os = "linux")]
        {
            let c = prometheus::process_collector::ProcessCollector::for_self();
            for d in c.desc() {
                let kind = if d.fq_name.ends_with("_total") {
                    "counter"
                } else {
                    "gauge"
                };
                self.descs.push((d.clone(), kind));
            }
            self.registry
                .register(Box::new(c))
                .expect("the process collector is registered once");
        }
    }
}

/// Every error kind, as the `reason` label of restarts.
const ERROR_KINDS: [ErrorKind; 10] = [
    ErrorKind::Config,
    ErrorKind::Decode,
    ErrorKind::Kafka,
    ErrorKind::Storage,
    ErrorKind::Catalog,
    ErrorKind::Registry,
    ErrorKind::CommitConflict,
    ErrorKind::Metadata,
    ErrorKind::Schema,
    ErrorKind::Internal,
];

impl Metrics {
    fn new() -> Self {
        let mut r = Registrar {
            registry: Registry::new(),
            descs: Vec::new(),
        };
        let build_info = r.gauges(
            "inlet_build_info",
            "Always 1; the labels name the running version",
            &["version"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        r.process();
        let restarts = r.counters(
            "inlet_pipeline_restarts_total",
            "Pipeline restarts after a failure, by the failure's kind",
            &["reason"],
        );
        let pipeline_stopped = r.gauges(
            "inlet_pipeline_stopped_offset",
            "Offset of the bad record the pipeline is stopped at under errors.policy fail (absent while it runs)",
            &["topic", "partition", "reason"],
        );
        let ready = r.gauge(
            "inlet_health_ready",
            "1 when every readiness check passes (/health/ready answers 200), else 0",
        );
        let check_ok = r.gauges(
            "inlet_health_check_ok",
            "1 when the readiness check passes, by check (pipeline, assignment, topics, broker, catalog, storage, checkpoint)",
            &["check"],
        );
        let component_up = r.gauges(
            "inlet_health_up",
            "1 when the component (broker, catalog, storage) answered the last request or probe, else 0",
            &["component"],
        );
        let component_failures = r.counters(
            "inlet_health_failures_total",
            "Failed requests and probes to the broker, catalog and storage, by component",
            &["component"],
        );
        let records_consumed = r.counters(
            "inlet_source_records_consumed_total",
            "Kafka messages received, by topic and partition",
            &["topic", "partition"],
        );
        let lag = r.gauges(
            "inlet_source_lag_records",
            "Records between the table's committed offset and the partition's high watermark, from assignment on",
            &["topic", "partition"],
        );
        let assigned_partitions = r.gauge(
            "inlet_source_assigned_partitions",
            "Partitions assigned to this member of the consumer group",
        );
        let records_decoded = r.counter(
            "inlet_decode_records_decoded_total",
            "Messages decoded into change records",
        );
        let records_failed = r.counters(
            "inlet_bad_records_total",
            "Records that could not be decoded or applied, by reason and by what the errors policy did (failed, skipped, dead_lettered)",
            &["reason", "action"],
        );
        let skipped = r.counters(
            "inlet_decode_skipped_total",
            "Messages carrying no row change (DDL, heartbeats), by reason",
            &["reason"],
        );
        let schema_changes = r.counters(
            "inlet_schema_changes_total",
            "Table schema changes made from upstream changes, by kind (add_column, promote)",
            &["kind"],
        );
        let tombstones = r.counter(
            "inlet_decode_tombstones_total",
            "Tombstone messages (null value) seen and skipped",
        );
        let stale = r.add(
            IntCounterVec::new(
                Opts::new(
                    "inlet_index_stale_records_total",
                    "Changes dropped because the key already holds a newer or equal version, by source partition",
                ),
                &["topic", "partition"],
            )
            .expect("static metric"),
        );
        let index_damaged = r.counter(
            "inlet_index_damaged_total",
            "Key index shards found damaged (corrupt files or entries), moved aside and rebuilt from the table",
        );
        let owner_epoch = r.gauges(
            "inlet_source_owner_epoch",
            "Owner epoch this member claimed in the table for each partition it owns; commits of an older epoch are refused",
            &["topic", "partition"],
        );
        let index_restores = r.counters(
            "inlet_index_restores_total",
            "Index shards made level with the table on assignment, by source: local (the shard's own index, caught up), copy (downloaded from the copy beside the table, then caught up), rebuild (read from every data file)",
            &["source"],
        );
        let index_restore_seconds = r.add(
            HistogramVec::new(
                HistogramOpts::new(
                    "inlet_index_restore_seconds",
                    "Time from assignment until a shard's index is level with the table, by source",
                )
                .buckets(vec![
                    0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0,
                ]),
                &["source"],
            )
            .expect("static metric"),
        );
        let index_copies = r.counters(
            "inlet_index_copies_total",
            "Copies of index shards uploaded beside the table, by result (uploaded, failed)",
            &["result"],
        );
        let index_copy_bytes = r.counter(
            "inlet_index_copy_bytes_total",
            "Bytes of index copies uploaded",
        );
        let duplicate_keys_repaired = r.counter(
            "inlet_index_duplicate_keys_repaired_total",
            "Keys a rebuild found live in two rows of the table; the older rows are deleted by the next checkpoint",
        );
        let ignored = r.counter(
            "inlet_index_ignored_records_total",
            "Changes the merge engine ignored (first-row keeps the first row)",
        );
        let unavailable_values = r.counters(
            "inlet_decode_unavailable_values_total",
            "Values a change left unchanged (Debezium's unavailable-value placeholder, such as a TOASTed PostgreSQL value), by what was written: kept (the table's value, upsert tables) or null (changelog tables)",
            &["written"],
        );
        for written in ["kept", "null"] {
            unavailable_values.with_label_values(&[written]);
        }
        let rows_written = r.counters(
            "inlet_write_rows_total",
            "Rows in data files uploaded, by table (changelog and upsert tables)",
            &["table"],
        );
        let partitions_created = r.counters(
            "inlet_write_partitions_created_total",
            "Partitions checkpoints added to the table, by table (table.max_new_partitions_per_checkpoint caps them per checkpoint)",
            &["table"],
        );
        let position_deletes = r.counter(
            "inlet_write_position_deletes_total",
            "Rows deleted through position-delete files (old rows of updated or deleted keys)",
        );
        let files_written = r.counter("inlet_write_files_total", "Data files uploaded");
        let bytes_written = r.counter("inlet_write_bytes_total", "Bytes of data files uploaded");
        let buffered_bytes = r.gauge(
            "inlet_write_buffered_bytes",
            "Bytes of rows and files held in memory awaiting commit",
        );
        let buffered_records = r.gauge(
            "inlet_write_buffered_records",
            "Kafka messages read and not yet committed: buffered, or in the checkpoint being committed",
        );
        let checkpoints = r.counters(
            "inlet_commit_checkpoints_total",
            "Checkpoints by result (committed, already_committed, failed: a file upload or the commit failed)",
            &["result"],
        );
        let commit_retries = r.counters(
            "inlet_commit_retries_total",
            "Commit attempts repeated, by reason (conflict: another writer committed first; error: the catalog or storage failed)",
            &["reason"],
        );
        let checkpoint_blocking = r.add(
            Counter::new(
                "inlet_checkpoint_blocking_seconds_total",
                "Seconds the pipeline stopped consuming for checkpoints: starting one, waiting for the one in flight when the next is due, and the work after a commit (index copies, compaction, retention)",
            )
            .expect("static metric"),
        );
        let idle = r.add(
            CounterVec::new(
                Opts::new(
                    "inlet_pipeline_idle_seconds_total",
                    "Seconds the pipeline had no change to apply, by what it waited for (source: no message fetched yet; decode: the oldest batch still decoding). Little idle time means applying changes is the bound",
                ),
                &["waiting_for"],
            )
            .expect("static metric"),
        );
        for what in ["source", "decode"] {
            idle.with_label_values(&[what]);
        }
        let commit_duration = r.add(
            Histogram::with_opts(
                HistogramOpts::new(
                    "inlet_commit_duration_seconds",
                    "Time to close files and commit a checkpoint",
                )
                .buckets(vec![
                    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                ]),
            )
            .expect("static metric"),
        );
        let last_commit = r.float_gauges(
            "inlet_commit_last_success_timestamp_seconds",
            "When this pipeline last committed to the table (Unix time; from the table's own snapshots at start)",
            &["table"],
        );
        let committed_source_ts = r.float_gauges(
            "inlet_commit_source_timestamp_seconds",
            "Newest source timestamp (database commit time, else Kafka message time) of the changes committed to the table, Unix time",
            &["table"],
        );
        let freshness = r.float_gauges(
            "inlet_commit_freshness_seconds",
            "Now minus the newest source timestamp committed to the table: how far the table trails its source",
            &["table"],
        );
        let maintain_runs = r.counters(
            "inlet_maintain_runs_total",
            "Table service runs by service (expire_snapshots, remove_orphans, compact, expire_partitions, mark_done, pack_files) and result (ok, failed)",
            &["service", "result"],
        );
        let maintain_last_success = r.float_gauges(
            "inlet_maintain_last_success_timestamp_seconds",
            "When the table service last ran to the end without error (Unix time), by service",
            &["service"],
        );
        let maintain_duration = r.float_gauges(
            "inlet_maintain_duration_seconds",
            "How long the table service's last run took, by service",
            &["service"],
        );
        let maintain_snapshots_expired = r.counter(
            "inlet_maintain_snapshots_expired_total",
            "Snapshots removed from table metadata by snapshot expiry",
        );
        let maintain_files_removed = r.counters(
            "inlet_maintain_files_removed_total",
            "Files deleted by the table services, by kind (expired: reachable only from expired snapshots; orphan: reachable from no metadata; metadata: old metadata files past write.metadata.previous-versions-max)",
            &["kind"],
        );
        let maintain_bytes_removed = r.counters(
            "inlet_maintain_bytes_removed_total",
            "Bytes of the files deleted by snapshot expiry and orphan cleanup, by kind (expired, orphan)",
            &["kind"],
        );
        let maintain_manifests_merged = r.counter(
            "inlet_maintain_manifests_merged_total",
            "Small manifests merged into larger ones by commits (commit.manifest.min-count-to-merge)",
        );
        let compact_files_rewritten = r.counter(
            "inlet_compact_files_rewritten_total",
            "Data files of upsert tables rewritten by inline compaction (many deleted rows or delete files, or small files packed)",
        );
        let compact_bytes_rewritten = r.counter(
            "inlet_compact_bytes_rewritten_bytes_total",
            "Bytes of data and delete files inline compaction read and replaced",
        );
        let compact_deletes_removed = r.counter(
            "inlet_compact_delete_files_removed_total",
            "Position-delete files removed by inline compaction (their deletes applied to the rewritten file)",
        );
        let compact_backlog = r.gauge(
            "inlet_compact_backlog_files",
            "Data files due for compaction that the last run's budget (services.compact_budget_bytes, services.compact_budget_ms) left for later",
        );
        let maintain_files_packed = r.counter(
            "inlet_maintain_files_packed_total",
            "Small data files of changelog tables that inlet maintain packed into larger ones",
        );
        let partitions_expired = r.counter(
            "inlet_maintain_partitions_expired_total",
            "Partitions whose files partition retention dropped (services.partition_expiration_ms), counted once per drop",
        );
        let partition_rows_dropped = r.counter(
            "inlet_maintain_partition_rows_dropped_total",
            "Rows of the data files partition retention dropped, deleted ones included",
        );
        let partitions_done = r.counter(
            "inlet_maintain_partitions_done_total",
            "Partitions marked done (services.mark_done_idle_ms): _SUCCESS written and, with services.mark_done_url, reported",
        );
        let late_rows = r.counters(
            "inlet_maintain_late_rows_total",
            "Rows written to or deleted from a partition after it was done (state done) or expired by its values' time (state expired); they are applied, and an expired partition is dropped again",
            &["state"],
        );
        let done_through = r.float_gauges(
            "inlet_maintain_done_through_timestamp_seconds",
            "Partitions whose time range ends at or before this are done, per table (Unix time)",
            &["table"],
        );
        for state in ["done", "expired"] {
            late_rows.with_label_values(&[state]);
        }
        for service in service::ALL {
            for result in ["ok", "failed"] {
                maintain_runs.with_label_values(&[service, result]);
            }
        }
        for kind in ["expired", "orphan", "metadata"] {
            maintain_files_removed.with_label_values(&[kind]);
        }
        for kind in ["expired", "orphan"] {
            maintain_bytes_removed.with_label_values(&[kind]);
        }
        for result in ["committed", "already_committed", "failed"] {
            checkpoints.with_label_values(&[result]);
        }
        for reason in ["conflict", "error"] {
            commit_retries.with_label_values(&[reason]);
        }
        for reason in inlet_decode::reason::ALL {
            for action in ["failed", "skipped", "dead_lettered"] {
                records_failed.with_label_values(&[reason, action]);
            }
        }
        for kind in ERROR_KINDS {
            restarts.with_label_values(&[kind.as_str()]);
        }
        for component in Component::ALL {
            component_failures.with_label_values(&[component.as_str()]);
        }
        for kind in ["add_column", "promote"] {
            schema_changes.with_label_values(&[kind]);
        }
        for source in ["local", "copy", "rebuild"] {
            index_restores.with_label_values(&[source]);
        }
        Metrics {
            records_consumed,
            records_decoded,
            records_failed,
            skipped,
            schema_changes,
            tombstones,
            rows_written,
            partitions_created,
            files_written,
            bytes_written,
            checkpoints,
            commit_duration,
            checkpoint_blocking,
            idle,
            commit_retries,
            last_commit,
            committed_source_ts,
            freshness,
            buffered_bytes,
            buffered_records,
            lag,
            assigned_partitions,
            stale,
            index_damaged,
            owner_epoch,
            index_restores,
            index_restore_seconds,
            index_copies,
            index_copy_bytes,
            duplicate_keys_repaired,
            ignored,
            unavailable_values,
            position_deletes,
            restarts,
            pipeline_stopped,
            ready,
            check_ok,
            component_up,
            component_failures,
            maintain_runs,
            maintain_last_success,
            maintain_duration,
            maintain_snapshots_expired,
            maintain_files_removed,
            maintain_bytes_removed,
            maintain_manifests_merged,
            compact_files_rewritten,
            compact_bytes_rewritten,
            compact_deletes_removed,
            compact_backlog,
            partitions_expired,
            maintain_files_packed,
            partition_rows_dropped,
            partitions_done,
            late_rows,
            done_through,
            source_ts: Mutex::new(BTreeMap::new()),
            registry: r.registry,
            descs: r.descs,
        }
    }

    /// Records that `table` now holds changes up to source time `ms` (milliseconds).
    pub fn committed_source_time(&self, table: &str, ms: i64) {
        let secs = ms as f64 / 1000.0;
        let mut map = self.source_ts.lock().unwrap_or_else(|e| e.into_inner());
        let newest = map.entry(table.to_string()).or_insert(secs);
        *newest = newest.max(secs);
        self.committed_source_ts
            .with_label_values(&[table])
            .set(*newest);
    }

    /// Brings the values computed at scrape time up to date: freshness, and the table layer's
    /// own counts.
    fn refresh(&self) {
        let now = inlet_iceberg::now_ms() as f64 / 1000.0;
        let map = self.source_ts.lock().unwrap_or_else(|e| e.into_inner());
        for (table, ts) in map.iter() {
            self.freshness
                .with_label_values(&[table])
                .set((now - ts).max(0.0));
        }
        drop(map);
        // Only the table layer removes old metadata files; it counts them itself.
        let removed = self.maintain_files_removed.with_label_values(&["metadata"]);
        removed.inc_by(inlet_iceberg::metadata_files_removed().saturating_sub(removed.get()));
    }

    /// The text exposition of all metrics.
    pub fn render(&self) -> String {
        self.refresh();
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// An external system the pipeline depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    Broker,
    Catalog,
    Storage,
}

impl Component {
    /// Every component, in report order.
    pub const ALL: [Component; 3] = [Component::Broker, Component::Catalog, Component::Storage];

    /// Stable lower-case name, used as a metric label and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Broker => "broker",
            Component::Catalog => "catalog",
            Component::Storage => "storage",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// The table services' names, as metrics label them and as a maintenance snapshot's summary
/// names the service that made it.
pub mod service {
    /// Snapshot expiry.
    pub const EXPIRE_SNAPSHOTS: &str = "expire_snapshots";
    /// Orphan file cleanup.
    pub const REMOVE_ORPHANS: &str = "remove_orphans";
    /// Compaction of a shard's files.
    pub const COMPACT: &str = "compact";
    /// Partition retention.
    pub const EXPIRE_PARTITIONS: &str = "expire_partitions";
    /// Mark-done of complete partitions.
    pub const MARK_DONE: &str = "mark_done";
    /// Bin-packing of small files.
    pub const PACK_FILES: &str = "pack_files";
    /// Every service, in report order.
    pub const ALL: [&str; 6] = [
        EXPIRE_SNAPSHOTS,
        REMOVE_ORPHANS,
        COMPACT,
        EXPIRE_PARTITIONS,
        MARK_DONE,
        PACK_FILES,
    ];
}

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

impl Metrics {
    /// A Markdown table of every metric with its type and help; docs/metrics.md embeds it.
    pub fn reference_markdown(&self) -> String {
        let mut out = String::from("| metric | type | labels | meaning |\n|---|---|---|---|\n");
        for (desc, kind) in &self.descs {
            out.push_str(&format!(
                "| `{}` | {kind} | {} | {} |\n",
                desc.fq_name,
                desc.variable_labels.join(", "),
                desc.help
            ));
        }
        out
    }
}
