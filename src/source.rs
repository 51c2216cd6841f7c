//! The Kafka source: a consumer-group member whose assigned partitions start at the offsets the
//! table's latest snapshot records (the table is the source of truth; group commits are only
//! for lag dashboards).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{
    BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol, StreamConsumer,
};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::statistics::Statistics;
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc;

use crate::commit::{table_epochs, table_offsets, Committer, Epochs, Offsets};
use crate::config::{KafkaConfig, StartWithoutOffsets};
use crate::health::health;
use crate::metrics::metrics;
use crate::metrics::Component;
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_common::secret::{is_secret_key, resolve_secret};
use inlet_iceberg::catalog::Catalog;
use inlet_iceberg::io::FileIO;
use inlet_iceberg::Table;

/// A change of partition ownership, seen by the pipeline before the next message.
#[derive(Debug)]
pub enum SourceEvent {
    /// Partitions newly assigned by the group, given to the consumer only once claimed in the
    /// table, and the number of that assignment in [`Claims`].
    Assigned(Vec<(String, i32)>, u64),
    /// These partitions were taken away; their buffered records must be dropped.
    Revoked(Vec<(String, i32)>),
    /// The consumer could not take or give up partitions.
    Failed(Error),
    /// The broker refused the client for good (credentials, permissions): stop, do not retry.
    Fatal(Error),
}

/// Where the consumer finds the tables to read its offsets from on assignment.
pub struct TableRef {
    pub catalog: Catalog,
    pub io: FileIO,
    /// The pipeline's one table; `None` when it routes to many, which are found in the catalog.
    pub table: Option<(String, String)>,
    pub pipeline_id: String,
    /// Where to start when the one table has snapshots but none of this pipeline.
    pub start_without_offsets: StartWithoutOffsets,
    /// Commits the claims of assigned partitions, as this member.
    pub committer: Committer,
    /// With routing: tables of the catalog found not to be the pipeline's, by the metadata
    /// file they were read at (metadata files never change, a table's pointer does).
    pub foreign: Mutex<HashMap<(String, String), String>>,
}

impl TableRef {
    fn foreign(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), String>> {
        self.foreign.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The pipeline's tables: the one configured, or with routing the tables of the catalog that
/// hold a snapshot of this pipeline (the only ones with its offsets and epochs). A table found
/// not to be the pipeline's is read again only once its metadata changes, where listing shows
/// that (a SQL catalog; a REST catalog shows a table's metadata only when it is loaded). A
/// transient fault reading any table fails the lookup, since that table may be one of the
/// pipeline's; a table that cannot be read for good (a v1 table, a view, a broken or missing
/// metadata file) cannot be one it writes: it is left out with a warning.
async fn pipeline_tables(t: &TableRef) -> Result<Vec<Table>> {
    if let Some((namespace, name)) = &t.table {
        let table = Table::load(&t.catalog, &t.io, namespace, name).await?;
        return Ok(table.into_iter().collect());
    }
    let mut tables = Vec::new();
    for ((namespace, name), at) in t.catalog.list_locations().await? {
        let key = (namespace, name);
        if at.is_some() && t.foreign().get(&key) == at.as_ref() {
            continue;
        }
        let (namespace, name) = (&key.0, &key.1);
        match Table::load(&t.catalog, &t.io, namespace, name).await {
            Ok(Some(table)) if table.metadata.last_snapshot_of(&t.pipeline_id).is_some() => {
                tables.push(table)
            }
            Ok(Some(table)) => {
                t.foreign().insert(key, table.metadata_location);
            }
            Ok(None) => {}
            Err(e) if e.retryable() => {
                return Err(e.with("table", format!("{namespace}.{name}")));
            }
            Err(e) => {
                tracing::warn!(table = %format!("{namespace}.{name}"), error = %e, "Cannot read a table of the catalog; it is not this pipeline's, leaving it out of the resume offsets");
                if let Some(at) = at {
                    t.foreign().insert(key, at);
                }
            }
        }
    }
    Ok(tables)
}

/// Where partitions without table offsets start: the beginning, unless the one table has
/// snapshots but none of this pipeline, where `kafka.start_without_offsets` decides.
fn start_position(t: &TableRef, tables: &[Table]) -> Result<Offset> {
    let mut start = Offset::Beginning;
    for table in tables {
        let meta = &table.metadata;
        if t.table.is_some()
            && meta.current_snapshot().is_some()
            && meta.last_snapshot_of(&t.pipeline_id).is_none()
        {
            let (namespace, name) = (&table.namespace, &table.name);
            start = match t.start_without_offsets {
                StartWithoutOffsets::Earliest => Offset::Beginning,
                StartWithoutOffsets::Latest => Offset::End,
                StartWithoutOffsets::Fail => {
                    return Err(Error::config(format!(
                        "table {namespace}.{name} has snapshots but none records the offsets of pipeline {} \
                         (expired by another engine, or written before this pipeline); set \
                         kafka.start_without_offsets to earliest (read the topics again from the \
                         beginning) or latest (only new changes)",
                        t.pipeline_id
                    )));
                }
            };
            tracing::warn!(table = %format!("{namespace}.{name}"), start = ?t.start_without_offsets, "The table holds no offsets of this pipeline; starting as kafka.start_without_offsets says");
        }
    }
    Ok(start)
}

/// Per partition, the highest offset any of `tables` records for the pipeline.
fn merged_offsets(t: &TableRef, tables: &[Table]) -> Result<Offsets> {
    let mut out = Offsets::new();
    for table in tables {
        for (topic, parts) in table_offsets(&table.metadata, &t.pipeline_id)? {
            let merged = out.entry(topic).or_default();
            for (p, offset) in parts {
                let at = merged.entry(p).or_insert(offset);
                *at = (*at).max(offset);
            }
        }
    }
    Ok(out)
}

/// What claiming partitions found: where each resumes, where those without table offsets
/// start, and the owner epochs claimed.
pub type Claimed = (Offsets, Offset, Epochs);

/// Takes `partitions` over: raises their owner epochs in every table of the pipeline (one
/// transaction), then reads where they resume from the tables as that claim left them. No
/// earlier owner can commit them from then on, so these offsets stay the table's until this
/// member commits. A claim that loses a race to another member's claim tries again only
/// while `current()` says the partitions are still this member's to claim.
pub async fn claim_partitions(
    t: &TableRef,
    partitions: &[(String, i32)],
    current: impl Fn() -> bool,
) -> Result<Claimed> {
    inlet_common::failpoint::delay_point("claim").await;
    let mut tables = pipeline_tables(t).await?;
    let start = start_position(t, &tables)?;
    // A routed table the pipeline creates later takes its epochs with its first commit. A
    // routed table records only the topics it takes changes from (Debezium's topic per table:
    // its own), so only the tables that record a claimed topic are fenced by this claim.
    let topics: HashSet<&str> = partitions.iter().map(|(t, _)| t.as_str()).collect();
    let mut ours: Vec<&mut Table> = Vec::with_capacity(tables.len());
    for table in tables.iter_mut() {
        let recorded = t.table.is_some()
            || table_offsets(&table.metadata, &t.pipeline_id)?
                .keys()
                .chain(table_epochs(&table.metadata, &t.pipeline_id)?.keys())
                .any(|topic| topics.contains(topic.as_str()));
        if recorded {
            ours.push(table);
        }
    }
    let epochs = if ours.is_empty() || partitions.is_empty() {
        Epochs::new()
    } else {
        t.committer.claim(ours, partitions, current).await?
    };
    Ok((merged_offsets(t, &tables)?, start, epochs))
}

/// Partitions assigned by the group but not yet claimed in the table, each with the number of
/// the assignment that brought it. The consumer gets them only once claimed; a claim that ends
/// after its partitions were revoked, or assigned again, is of no use.
#[derive(Default)]
pub struct Claims {
    assignments: std::sync::atomic::AtomicU64,
    waiting: Mutex<HashMap<(String, i32), u64>>,
}

impl Claims {
    fn waiting_mut(&self) -> std::sync::MutexGuard<'_, HashMap<(String, i32), u64>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `parts` were assigned: they wait for the claim of this assignment, whose number returns.
    fn assigned(&self, parts: &[(String, i32)]) -> u64 {
        use std::sync::atomic::Ordering;
        let n = self.assignments.fetch_add(1, Ordering::SeqCst) + 1;
        let mut waiting = self.waiting_mut();
        for part in parts {
            waiting.insert(part.clone(), n);
        }
        n
    }

    /// `parts` were revoked: no claim of them is waited for any more.
    fn revoked(&self, parts: &[(String, i32)]) {
        let mut waiting = self.waiting_mut();
        for part in parts {
            waiting.remove(part);
        }
    }

    /// The group's assignment failed: no claim is waited for any more.
    fn clear(&self) {
        self.waiting_mut().clear();
    }

    /// Of `parts`, those still waiting for the claim of assignment `n`.
    pub fn current(&self, parts: &[(String, i32)], n: u64) -> Vec<(String, i32)> {
        let waiting = self.waiting_mut();
        parts
            .iter()
            .filter(|part| waiting.get(*part) == Some(&n))
            .cloned()
            .collect()
    }

    /// Whether any partition is waiting for a claim.
    pub fn any(&self) -> bool {
        !self.waiting_mut().is_empty()
    }

    /// The claim of assignment `n` took `parts` over: of them, those that were still waiting
    /// for it, which may now be read.
    pub fn done(&self, parts: &[(String, i32)], n: u64) -> Vec<(String, i32)> {
        let mut waiting = self.waiting_mut();
        parts
            .iter()
            .filter(|part| {
                let ours = waiting.get(*part) == Some(&n);
                if ours {
                    waiting.remove(*part);
                }
                ours
            })
            .cloned()
            .collect()
    }
}

/// Gives claimed partitions to the consumer, each at the offset where the table says it
/// resumes (`start` for those without offsets). Only now does librdkafka fetch them: an
/// assignment at a logical offset (the end, say) and a seek once claimed would let the lookup
/// of that offset, answered after the seek, move the partition away from the table's offset.
pub fn assign_claimed(
    consumer: &StreamConsumer<SourceContext>,
    parts: &[(String, i32, Option<i64>)],
    start: Offset,
) -> Result<()> {
    let mut tpl = TopicPartitionList::new();
    for (topic, p, at) in parts {
        tpl.add_partition_offset(topic, *p, at.map_or(start, Offset::Offset))
            .map_err(kafka_error)?;
    }
    let result = match consumer.rebalance_protocol() {
        RebalanceProtocol::Cooperative => consumer.incremental_assign(&tpl),
        // An eager rebalance revokes everything before it assigns: the claim holds the whole
        // assignment.
        _ => consumer.assign(&tpl),
    };
    result.map_err(kafka_error)
}

/// Whether a checkpoint is being committed. Partitions are given up only between commits, as
/// a Kafka consumer commits in its revocation callback: a checkpoint already on its way lands
/// before the next owner claims its partitions, instead of being refused by their new epoch.
#[derive(Default)]
pub struct CommitGate {
    busy: Mutex<bool>,
    idle: std::sync::Condvar,
}

impl CommitGate {
    /// A commit starts.
    pub fn begin(&self) {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) = true;
    }

    /// The commit ended, landed or not.
    pub fn end(&self) {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.idle.notify_all();
    }

    /// Waits up to `limit` for no commit to be running; whether none is.
    pub fn wait_idle(&self, limit: Duration) -> bool {
        let busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let (busy, _) = self
            .idle
            .wait_timeout_while(busy, limit, |busy| *busy)
            .unwrap_or_else(|e| e.into_inner());
        !*busy
    }
}

/// The consumer's callbacks: positions partitions on assignment and reports lag.
pub struct SourceContext {
    /// Revocations wait for the checkpoint being committed, up to `commit_wait`.
    gate: std::sync::Arc<CommitGate>,
    commit_wait: Duration,
    /// Assigned partitions waiting for their claim.
    pub claims: std::sync::Arc<Claims>,
    events: mpsc::UnboundedSender<SourceEvent>,
    bootstrap: String,
}

impl ClientContext for SourceContext {
    fn stats(&self, statistics: Statistics) {
        for (topic, t) in &statistics.topics {
            for (p, part) in &t.partitions {
                if *p >= 0 && part.hi_offset >= 0 {
                    track_watermarks(topic, *p, part.lo_offset, part.hi_offset);
                }
            }
        }
    }

    // librdkafka's own lines repeat what reaches `error` and the consumer's results, which the
    // health state logs once per change; they are detail unless about the configuration.
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        if fac == "CONFWARN" && (level as i32) <= (RDKafkaLogLevel::Warning as i32) {
            tracing::warn!(target: "librdkafka", facility = fac, "{log_message}");
        } else {
            tracing::debug!(target: "librdkafka", facility = fac, "{log_message}");
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let cause = if reason.is_empty() {
            error.to_string()
        } else {
            reason.to_string()
        };
        match error.rdkafka_error_code() {
            Some(
                RDKafkaErrorCode::Authentication
                | RDKafkaErrorCode::SaslAuthenticationFailed
                | RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::GroupAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed,
            ) => {
                let _ = self.events.send(SourceEvent::Fatal(Error::config(format!(
                    "kafka.properties: the broker {} refused this client: {cause}; fix security.protocol, sasl.mechanism, sasl.username and sasl.password in kafka.properties, or grant the user access to the topics and to group kafka.group_id",
                    self.bootstrap
                ))));
            }
            _ if certificate_refused(&cause) => {
                let _ = self.events.send(SourceEvent::Fatal(Error::config(format!(
                    "kafka.properties: TLS with the broker {} failed: {cause}; check ssl.ca.location (the CA that signed the broker's certificate), the certificates' validity dates, and ssl.certificate.location / ssl.key.location if the broker asks for a client certificate",
                    self.bootstrap
                ))));
            }
            _ => consumer_error(&error, &cause),
        }
    }
}

/// Whether a TLS failure is a certificate the other side refused (expired, not yet valid,
/// signed by an unknown CA, a name that does not match, none where one is required): a
/// configuration to fix, not a fault that passes. A connection cut during a handshake is not.
fn certificate_refused(cause: &str) -> bool {
    let cause = cause.to_ascii_lowercase();
    cause.contains("ssl")
        && [
            "certificate verify failed",
            "certificate has expired",
            "certificate expired",
            "unknown ca",
            "bad certificate",
            "certificate required",
            "certificate is not yet valid",
            "unsupported certificate",
            "hostname mismatch",
        ]
        .iter()
        .any(|m| cause.contains(m))
}

/// Records an error of the consumer in the health state, which logs it once per change. A
/// missing topic is reported by the topic probe instead.
pub fn consumer_error(error: &KafkaError, cause: &str) {
    match error.rdkafka_error_code() {
        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {
            tracing::debug!(error = %cause, "Topic not available")
        }
        _ => health().failed(Component::Broker, &cause),
    }
}

/// Per assigned partition, the table's offset and the broker's watermarks: their difference
/// is the lag gauge, exported from assignment on.
#[derive(Default)]
struct Positions {
    assigned: HashSet<(String, i32)>,
    committed: HashMap<(String, i32), i64>,
    watermarks: HashMap<(String, i32), (i64, i64)>,
    /// Partitions without table offsets start at their end, not their earliest offset.
    from_end: bool,
}

impl Positions {
    fn update_lag(&mut self, key: &(String, i32)) {
        let Some(&(low, high)) = self.watermarks.get(key) else {
            return;
        };
        // Without table offsets reading starts at the earliest offset still kept, or at the
        // end as it was when the partition was assigned.
        let start = if self.from_end { high } else { low };
        let from = *self.committed.entry(key.clone()).or_insert(start);
        let from = from.max(low);
        metrics()
            .lag
            .with_label_values(&[key.0.as_str(), &key.1.to_string()])
            .set((high - from).max(0));
    }
}

fn positions() -> std::sync::MutexGuard<'static, Positions> {
    static POSITIONS: OnceLock<Mutex<Positions>> = OnceLock::new();
    POSITIONS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Starts tracking newly assigned partitions with their table offsets (`None`: none yet,
/// reading starts at the earliest offset kept or, with `from_end`, at the end).
pub fn track_assignment(parts: &[(String, i32, Option<i64>)], from_end: bool) {
    let mut pos = positions();
    pos.from_end = from_end;
    for (t, p, at) in parts {
        let key = (t.clone(), *p);
        pos.committed.remove(&key);
        if let Some(at) = at {
            pos.committed.insert(key.clone(), *at);
        }
        pos.assigned.insert(key);
        metrics()
            .records_consumed
            .with_label_values(&[t.as_str(), &p.to_string()]);
    }
    metrics().assigned_partitions.set(pos.assigned.len() as i64);
    for (t, p, _) in parts {
        pos.update_lag(&(t.clone(), *p));
    }
}

/// Stops tracking partitions no longer owned: their lag series go away.
pub fn track_revocation(parts: &[(String, i32)]) {
    let mut pos = positions();
    for key in parts {
        for gauge in [&metrics().lag, &metrics().owner_epoch] {
            let _ = gauge.remove_label_values(&[key.0.as_str(), &key.1.to_string()]);
        }
        pos.assigned.remove(key);
        pos.watermarks.remove(key);
        pos.committed.remove(key);
    }
    metrics().assigned_partitions.set(pos.assigned.len() as i64);
}

/// The table now holds `offsets`.
pub fn track_committed(offsets: &Offsets) {
    let mut pos = positions();
    for (topic, parts) in offsets {
        for (p, at) in parts {
            let key = (topic.clone(), *p);
            if pos.assigned.contains(&key) {
                pos.committed.insert(key.clone(), *at);
                pos.update_lag(&key);
            }
        }
    }
}

/// The broker reported a partition's watermarks.
pub fn track_watermarks(topic: &str, partition: i32, low: i64, high: i64) {
    let mut pos = positions();
    let key = (topic.to_string(), partition);
    if pos.assigned.contains(&key) {
        pos.watermarks.insert(key.clone(), (low.max(0), high));
        pos.update_lag(&key);
    }
}

/// Whether the broker's end of an assigned partition, as last reported, is at or below `next`:
/// nothing waits there to be read.
pub fn caught_up(topic: &str, partition: i32, next: i64) -> bool {
    positions()
        .watermarks
        .get(&(topic.to_string(), partition))
        .is_some_and(|(_, high)| *high <= next)
}

/// Assigned partitions whose watermarks are not known yet.
pub fn untracked_watermarks() -> Vec<(String, i32)> {
    let pos = positions();
    pos.assigned
        .iter()
        .filter(|k| !pos.watermarks.contains_key(*k))
        .cloned()
        .collect()
}

impl ConsumerContext for SourceContext {
    // Under the cooperative protocol only partitions that move are revoked and assigned; under
    // the eager one every rebalance revokes all. Either way the callback finishes at once: the
    // group never waits on this member's buffered work, which is dropped for revoked
    // partitions and read again by their next owner, nor on the catalog, where the pipeline
    // claims assigned partitions while the consumer keeps polling.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let incremental = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let parts: Vec<(String, i32)> = tpl
            .elements()
            .iter()
            .map(|e| (e.topic().to_string(), e.partition()))
            .collect();
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                // The group's assignment is taken, but the partitions are not assigned to the
                // consumer yet: the pipeline claims them in the table in its own time (a
                // catalog may be slow) and then assigns them at the table's offsets, so no
                // offset is ever looked up or fetched for them before.
                let result = if incremental {
                    consumer.incremental_assign(&TopicPartitionList::new())
                } else {
                    consumer.assign(&TopicPartitionList::new())
                };
                if let Err(e) = result {
                    let _ = self.events.send(SourceEvent::Failed(kafka_error(e)));
                    return;
                }
                if parts.is_empty() {
                    // A rebalance that moved nothing here.
                    return;
                }
                let n = self.claims.assigned(&parts);
                tracing::info!(
                    partitions = parts.len(),
                    assignment = n,
                    incremental,
                    "Claiming newly assigned partitions in the table"
                );
                let _ = self.events.send(SourceEvent::Assigned(parts, n));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                let lost = consumer.assignment_lost();
                // A member that lost its partitions cannot commit them any more anyway.
                if !lost && !tokio::task::block_in_place(|| self.gate.wait_idle(self.commit_wait)) {
                    tracing::warn!(
                        waited_ms = self.commit_wait.as_millis() as u64,
                        "Giving up partitions while a checkpoint is still committing; the next owner's claim may refuse it"
                    );
                }
                tracing::info!(
                    partitions = tpl.count(),
                    lost,
                    incremental,
                    "Partitions revoked"
                );
                self.claims.revoked(&parts);
                let _ = self.events.send(SourceEvent::Revoked(parts.clone()));
                track_revocation(&parts);
                let result = if incremental {
                    // Partitions still being claimed were never given to the consumer.
                    let held = assignment(consumer);
                    let mut given = TopicPartitionList::new();
                    for (topic, p) in parts.iter().filter(|part| held.contains(*part)) {
                        given.add_partition(topic, *p);
                    }
                    consumer.incremental_unassign(&given)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = result {
                    let _ = self.events.send(SourceEvent::Failed(kafka_error(e)));
                }
            }
            other => {
                tracing::error!(error = ?other, "Rebalance failed");
                let owned: Vec<(String, i32)> = assignment(consumer).into_iter().collect();
                self.claims.clear();
                let _ = self.events.send(SourceEvent::Revoked(owned.clone()));
                track_revocation(&owned);
                let _ = match consumer.assignment() {
                    Ok(current) if incremental => consumer.incremental_unassign(&current),
                    _ => consumer.unassign(),
                };
            }
        }
    }
}

/// The partitions assigned to `consumer` now (none if it cannot say).
fn assignment<C: Consumer<X>, X: ConsumerContext>(consumer: &C) -> HashSet<(String, i32)> {
    consumer
        .assignment()
        .map(|tpl| {
            tpl.elements()
                .iter()
                .map(|e| (e.topic().to_string(), e.partition()))
                .collect()
        })
        .unwrap_or_default()
}

/// `topic/partition=epoch` of each claimed partition.
pub(crate) fn describe_epochs(epochs: &Epochs) -> String {
    let shown: Vec<String> = epochs
        .iter()
        .flat_map(|(t, ps)| ps.iter().map(move |(p, e)| format!("{t}/{p}={e}")))
        .collect();
    shown.join(" ")
}

/// `topic/partition@offset` of each assigned partition (`start` without table offsets: the
/// beginning or the end, as configured).
pub(crate) fn describe_positions(parts: &[(String, i32, Option<i64>)]) -> String {
    let shown: Vec<String> = parts
        .iter()
        .map(|(t, p, at)| match at {
            Some(at) => format!("{t}/{p}@{at}"),
            None => format!("{t}/{p}@start"),
        })
        .collect();
    shown.join(" ")
}

fn kafka_error(e: rdkafka::error::KafkaError) -> Error {
    Error::new(ErrorKind::Kafka, "cannot assign partitions").with_source(e)
}

/// How long a partition whose fetch queue is full waits before it is fetched again.
const FETCH_QUEUE_BACKOFF_MS: &str = "10";
/// The most bytes one fetch returns per partition.
const MAX_PARTITION_FETCH_BYTES: &str = "8388608";

/// The consumer's librdkafka properties: inlet's own, then `kafka.properties` over them.
fn client_config(cfg: &KafkaConfig) -> Result<ClientConfig> {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &cfg.bootstrap_servers)
        .set("group.id", &cfg.group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set(
            "partition.assignment.strategy",
            assignment_strategy(cfg.properties.get("partition.assignment.strategy"))?,
        )
        .set("statistics.interval.ms", "10000")
        // A topic created after start is picked up within this (librdkafka's default: 5 min).
        .set("topic.metadata.refresh.interval.ms", "10000")
        .set("client.id", "inlet")
        // librdkafka pauses a partition's fetching for this long once its queue passes
        // `queued.min.messages` (default 1 s): long enough for a fast pipeline to drain the
        // queue and wait, idle, for the next fetch.
        .set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS)
        // Fewer, larger fetches (librdkafka's default is 1 MiB): the broker and the client
        // spend less per message; the queue stays bounded by `queued.max.messages.kbytes`.
        .set("max.partition.fetch.bytes", MAX_PARTITION_FETCH_BYTES);
    for (k, v) in &cfg.properties {
        if k == "partition.assignment.strategy" {
            continue;
        }
        if matches!(k.as_str(), "enable.auto.commit" | "group.protocol") {
            return Err(Error::config(format!(
                "kafka.properties.{k}: inlet manages this setting itself; remove it"
            )));
        }
        client.set(k, resolve_secret(&format!("kafka.properties.{k}"), v)?);
    }
    let shown: Vec<String> = cfg
        .properties
        .iter()
        .map(|(k, v)| {
            if is_secret_key(k) {
                format!("{k}=***")
            } else {
                format!("{k}={v}")
            }
        })
        .collect();
    tracing::debug!(properties = ?shown, "Kafka consumer properties");
    Ok(client)
}

/// Creates the group consumer and subscribes it to the configured topics.
pub fn consumer(
    cfg: &KafkaConfig,
    gate: std::sync::Arc<CommitGate>,
    commit_wait: Duration,
) -> Result<(
    StreamConsumer<SourceContext>,
    mpsc::UnboundedReceiver<SourceEvent>,
)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let client = client_config(cfg)?;
    let context = SourceContext {
        gate,
        commit_wait,
        claims: Default::default(),
        events: tx,
        bootstrap: cfg.bootstrap_servers.clone(),
    };
    // librdkafka refuses to create a client only for its configuration: an unknown property,
    // a certificate or key it cannot read, a key its passphrase does not open. Retrying
    // cannot help.
    let consumer: StreamConsumer<SourceContext> =
        client.create_with_context(context).map_err(|e| {
            Error::config(format!(
                "kafka.properties: cannot create the Kafka client: {e}; fix the setting it names"
            ))
        })?;
    let subscription = cfg.subscription();
    let topics: Vec<&str> = subscription.iter().map(String::as_str).collect();
    consumer.subscribe(&topics).or_kind(ErrorKind::Kafka, || {
        format!("cannot subscribe to {topics:?}")
    })?;
    Ok((consumer, rx))
}

/// The assignors: cooperative-sticky unless `kafka.properties.partition.assignment.strategy`
/// names others, which must be librdkafka's and not mix the cooperative one with eager ones.
pub fn assignment_strategy(configured: Option<&String>) -> Result<String> {
    const KEY: &str = "kafka.properties.partition.assignment.strategy";
    let Some(configured) = configured else {
        return Ok("cooperative-sticky".into());
    };
    let names: Vec<&str> = configured.split(',').map(str::trim).collect();
    for name in &names {
        if !matches!(*name, "range" | "roundrobin" | "cooperative-sticky") {
            return Err(Error::config(format!(
                "{KEY}: unknown assignor {name:?}; use cooperative-sticky (the default: only partitions that move stop), or range and/or roundrobin (every rebalance stops all partitions)"
            )));
        }
    }
    if names.len() > 1 && names.contains(&"cooperative-sticky") {
        return Err(Error::config(format!(
            "{KEY}: cooperative-sticky cannot be combined with the eager assignors ({configured}); choose cooperative-sticky alone or range/roundrobin"
        )));
    }
    Ok(names.join(","))
}

/// How many partitions `topic` has: the shard count of upsert tables. A topic that does not
/// exist yet (Debezium creates its topics as it first writes to them) is waited for, with
/// readiness naming it; a broker that does not answer is an error.
pub async fn partition_count(consumer: &StreamConsumer<SourceContext>, topic: &str) -> Result<u32> {
    let mut waiting = false;
    loop {
        let metadata =
            tokio::task::block_in_place(|| consumer.fetch_metadata(Some(topic), METADATA_TIMEOUT))
                .or_kind(ErrorKind::Kafka, || {
                    format!("cannot read the metadata of topic {topic}")
                })?;
        let count = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .map_or(0, |t| t.partitions().len());
        if count > 0 {
            return Ok(count as u32);
        }
        if !waiting {
            // Logged there, once.
            health().set_missing_topics(vec![topic.to_string()]);
            waiting = true;
        }
        tokio::time::sleep(TOPIC_WAIT_INTERVAL).await;
    }
}

/// How often a pipeline waiting for its topic asks the broker again.
const TOPIC_WAIT_INTERVAL: Duration = Duration::from_secs(2);

/// Runs `work` to its end while keeping this member of the group alive: every assigned
/// partition is paused and the consumer polled (rebalance callbacks run as usual). Messages
/// that were already fetched arrive anyway; they are dropped, and their partitions are sought
/// back to the first of them before everything resumes, so nothing is skipped.
pub async fn poll_while<F: std::future::Future>(
    consumer: &StreamConsumer<SourceContext>,
    work: F,
) -> Result<F::Output> {
    use rdkafka::Message;
    let paused = consumer
        .assignment()
        .or_kind(ErrorKind::Kafka, || "cannot read the assignment".into())?;
    consumer
        .pause(&paused)
        .or_kind(ErrorKind::Kafka, || "cannot pause partitions".into())?;
    tokio::pin!(work);
    let mut dropped: std::collections::BTreeMap<(String, i32), i64> = Default::default();
    let out = loop {
        tokio::select! {
            out = &mut work => break out,
            msg = consumer.recv() => {
                if let Ok(m) = msg {
                    dropped.entry((m.topic().to_string(), m.partition())).or_insert(m.offset());
                }
            }
        }
    };
    // A rebalance meanwhile may have taken partitions away; their next owner reads them.
    let now = assignment(consumer);
    for ((topic, partition), offset) in dropped {
        if now.contains(&(topic.clone(), partition)) {
            consumer
                .seek(
                    &topic,
                    partition,
                    Offset::Offset(offset),
                    Duration::from_secs(10),
                )
                .or_kind(ErrorKind::Kafka, || {
                    format!("cannot seek {topic}/{partition} back to {offset}")
                })?;
        }
    }
    let mut resume = TopicPartitionList::new();
    for e in paused.elements() {
        if now.contains(&(e.topic().to_string(), e.partition())) {
            resume.add_partition(e.topic(), e.partition());
        }
    }
    consumer
        .resume(&resume)
        .or_kind(ErrorKind::Kafka, || "cannot resume partitions".into())?;
    Ok(out)
}

/// Records committed offsets in the consumer group, for lag tools. Failures are only logged:
/// the table, not the group, decides where reading resumes.
pub fn commit_group_offsets(consumer: &StreamConsumer<SourceContext>, offsets: &Offsets) {
    let mut tpl = TopicPartitionList::new();
    for (topic, parts) in offsets {
        for (p, next) in parts {
            let _ = tpl.add_partition_offset(topic, *p, Offset::Offset(*next));
        }
    }
    if tpl.count() > 0 {
        if let Err(e) = consumer.commit(&tpl, rdkafka::consumer::CommitMode::Async) {
            tracing::warn!(error = %e, "Cannot commit group offsets (advisory only)");
        }
    }
}

/// How long a metadata or watermark request may take.
pub const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks the broker for the metadata of `topics`: `Err` if it does not answer, else the topics
/// it does not know.
pub fn probe_topics(
    consumer: &StreamConsumer<SourceContext>,
    topics: &[String],
) -> KafkaResult<Vec<String>> {
    let mut missing = Vec::new();
    for topic in topics {
        let metadata = consumer.fetch_metadata(Some(topic), METADATA_TIMEOUT)?;
        let known = metadata
            .topics()
            .iter()
            .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty());
        if !known {
            missing.push(topic.clone());
        }
    }
    Ok(missing)
}

/// How long the pipeline waits for a message before checking timers.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetching_keeps_the_queue_full_and_properties_override_it() {
        let mut cfg: KafkaConfig =
            serde_yaml::from_str("{bootstrap_servers: 'localhost:9092', group_id: g, topics: [t]}")
                .unwrap();
        let client = client_config(&cfg).unwrap();
        assert_eq!(client.get("fetch.queue.backoff.ms"), Some("10"));
        assert_eq!(client.get("max.partition.fetch.bytes"), Some("8388608"));
        assert_eq!(client.get("enable.auto.commit"), Some("false"));
        cfg.properties
            .insert("fetch.queue.backoff.ms".into(), "500".into());
        let client = client_config(&cfg).unwrap();
        assert_eq!(client.get("fetch.queue.backoff.ms"), Some("500"));
        cfg.properties
            .insert("enable.auto.commit".into(), "true".into());
        assert!(client_config(&cfg).is_err());
    }

    #[test]
    fn assignors_default_to_cooperative_and_overrides_are_checked() {
        assert_eq!(assignment_strategy(None).unwrap(), "cooperative-sticky");
        let set = |v: &str| assignment_strategy(Some(&v.to_string()));
        assert_eq!(set("range, roundrobin").unwrap(), "range,roundrobin");
        assert_eq!(set("cooperative-sticky").unwrap(), "cooperative-sticky");
        let mixed = set("cooperative-sticky,range").unwrap_err().to_string();
        assert!(mixed.contains("partition.assignment.strategy"), "{mixed}");
        let unknown = set("sticky").unwrap_err().to_string();
        assert!(unknown.contains("unknown assignor \"sticky\""), "{unknown}");
    }
}
