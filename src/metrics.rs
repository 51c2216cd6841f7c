//! Prometheus metrics. Every name is defined here; label values come from fixed sets (stage
//! outcomes, error kinds) or from the bounded set of assigned topic partitions.

use std::sync::OnceLock;

use prometheus::core::{Collector, Desc};
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// The process's metrics.
pub struct Metrics {
    pub registry: Registry,
    pub records_consumed: IntCounter,
    pub records_decoded: IntCounter,
    pub records_failed: IntCounterVec,
    pub skipped: IntCounterVec,
    pub schema_changes: IntCounterVec,
    pub tombstones: IntCounter,
    pub rows_written: IntCounter,
    pub files_written: IntCounter,
    pub bytes_written: IntCounter,
    pub checkpoints: IntCounterVec,
    pub commit_duration: Histogram,
    pub buffered_bytes: IntGauge,
    pub lag: IntGaugeVec,
    pub stale: IntCounterVec,
    pub index_damaged: IntCounter,
    pub duplicate_keys_repaired: IntCounter,
    pub ignored: IntCounter,
    pub position_deletes: IntCounter,
    descs: Vec<Desc>,
}

/// Registers collectors and remembers their descriptions for the reference table.
struct Registrar {
    registry: Registry,
    descs: Vec<Desc>,
}

impl Registrar {
    fn add<C: Collector + Clone + 'static>(&mut self, c: C) -> C {
        self.descs.extend(c.desc().into_iter().cloned());
        self.registry
            .register(Box::new(c.clone()))
            .expect("each metric is registered once");
        c
    }

    fn counter(&mut self, name: &str, help: &str) -> IntCounter {
        self.add(IntCounter::new(name, help).expect("metric names are static and valid"))
    }
}

impl Metrics {
    fn new() -> Self {
        let mut r = Registrar {
            registry: Registry::new(),
            descs: Vec::new(),
        };
        let records_consumed = r.counter(
            "inlet_source_records_consumed_total",
            "Kafka messages received",
        );
        let lag = r.add(
            IntGaugeVec::new(
                Opts::new("inlet_source_lag_records", "Records between the table's committed offset and the partition's high watermark"),
                &["topic", "partition"],
            )
            .expect("static metric"),
        );
        let records_decoded = r.counter(
            "inlet_decode_records_decoded_total",
            "Messages decoded into change records",
        );
        let records_failed = r.add(
            IntCounterVec::new(
                Opts::new(
                    "inlet_bad_records_total",
                    "Records that could not be decoded or applied, by reason and by what the errors policy did (failed, skipped, dead_lettered)",
                ),
                &["reason", "action"],
            )
            .expect("static metric"),
        );
        let skipped = r.add(
            IntCounterVec::new(
                Opts::new(
                    "inlet_decode_skipped_total",
                    "Messages carrying no row change (DDL, heartbeats), by reason",
                ),
                &["reason"],
            )
            .expect("static metric"),
        );
        let schema_changes = r.add(
            IntCounterVec::new(
                Opts::new(
                    "inlet_schema_changes_total",
                    "Table schema changes made from upstream changes, by kind (add_column, promote)",
                ),
                &["kind"],
            )
            .expect("static metric"),
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
        let duplicate_keys_repaired = r.counter(
            "inlet_index_duplicate_keys_repaired_total",
            "Keys a rebuild found live in two rows of the table; the older rows are deleted by the next checkpoint",
        );
        let ignored = r.counter(
            "inlet_index_ignored_records_total",
            "Changes the merge engine ignored (first-row keeps the first row)",
        );
        let rows_written = r.counter("inlet_write_rows_total", "Rows appended to data files");
        let position_deletes = r.counter(
            "inlet_write_position_deletes_total",
            "Rows deleted through position-delete files (old rows of updated or deleted keys)",
        );
        let files_written = r.counter("inlet_write_files_total", "Data files uploaded");
        let bytes_written = r.counter("inlet_write_bytes_total", "Bytes of data files uploaded");
        let buffered_bytes = r.add(
            IntGauge::new(
                "inlet_write_buffered_bytes",
                "Bytes of rows and files held in memory awaiting commit",
            )
            .expect("static metric"),
        );
        let checkpoints = r.add(
            IntCounterVec::new(
                Opts::new(
                    "inlet_commit_checkpoints_total",
                    "Checkpoints by result (committed, already_committed, failed)",
                ),
                &["result"],
            )
            .expect("static metric"),
        );
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
        Metrics {
            records_consumed,
            records_decoded,
            records_failed,
            skipped,
            schema_changes,
            tombstones,
            rows_written,
            files_written,
            bytes_written,
            checkpoints,
            commit_duration,
            buffered_bytes,
            lag,
            stale,
            index_damaged,
            duplicate_keys_repaired,
            ignored,
            position_deletes,
            registry: r.registry,
            descs: r.descs,
        }
    }

    /// The text exposition of all metrics.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// Serves `/metrics` and `/health` until the process ends.
pub async fn serve(listen: &str) -> crate::error::Result<()> {
    use crate::error::{ErrorKind, ResultExt};
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(|| async { metrics().render() }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .or_kind(ErrorKind::Config, || {
            format!("metrics.listen: cannot bind {listen}")
        })?;
    tracing::info!(listen, "Serving metrics");
    axum::serve(listener, app)
        .await
        .or_kind(ErrorKind::Internal, || "metrics server stopped".into())
}

impl Metrics {
    /// A Markdown table of every metric with its type and help; the README embeds it.
    pub fn reference_markdown(&self) -> String {
        let mut out = String::from("| metric | type | labels | meaning |\n|---|---|---|---|\n");
        for desc in &self.descs {
            let kind = if desc.fq_name.ends_with("_total") {
                "counter"
            } else if desc.fq_name.ends_with("_seconds") {
                "histogram"
            } else {
                "gauge"
            };
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
