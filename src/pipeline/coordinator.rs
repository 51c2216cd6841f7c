//! The checkpoint coordinator: when a checkpoint is due, starting it on its own task while
//! records keep flowing ([`checkpoint`](super::checkpoint)), and taking its result.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::commit::{Checkpoint, Committer, Epochs, Offsets};
use crate::health::health;
use crate::metrics::metrics;
use crate::metrics::Component;
use crate::source;
use crate::source::CommitGate;
use inlet_common::error::{Error, ErrorKind, Result};

use super::{checkpoint, table_label, Pipeline, TableName};

/// The checkpoint coordinator's state: what the checkpoint being gathered holds, the one being
/// written and committed beside it, and what every commit is fenced by.
pub(super) struct Checkpoints {
    pub(super) committer: Committer,
    /// Where the owned partitions resume: the offsets of the newest checkpoint.
    pub(super) committed: Offsets,
    pub(super) pending: Pending,
    pub(super) next_checkpoint_id: u64,
    /// The checkpoint being written and committed while the next one's records are read.
    pub(super) inflight: Option<InFlight>,
    /// Closed while a checkpoint commits; partitions are given up only when it is open.
    pub(super) gate: Arc<CommitGate>,
    /// Since the last checkpoint began: when, and how long the loop waited for the source.
    pub(super) cycle: (Instant, Duration),
    /// Shutting down: checkpoints still commit, index copies and compaction wait for the next
    /// start (see [`Pipeline::after_commit`]).
    pub(super) stopping: bool,
}

/// What a checkpoint has gathered so far, across tables.
#[derive(Default)]
pub(super) struct Pending {
    pub(super) records: u64,
    pub(super) since: Option<Instant>,
    /// Next offset to read per partition that has advanced since the last commit.
    pub(super) end: Offsets,
    /// The first buffered offset per partition: where reading starts again if the buffered
    /// records are dropped.
    pub(super) first: Offsets,
    /// The newest source time (ms) of the changes read per partition.
    pub(super) newest: crate::commit::Watermarks,
}

impl Checkpoints {
    /// `inlet_write_buffered_records`: records read and not yet committed, buffered or in the
    /// checkpoint in flight (a shutdown then knows it leaves records behind).
    pub(super) fn show_buffered(&self) {
        let inflight = self.inflight.as_ref().map_or(0, |f| f.records);
        metrics()
            .buffered_records
            .set((self.pending.records + inflight) as i64);
    }
}

/// A checkpoint on its way (see [`checkpoint`]).
pub(super) struct InFlight {
    pub(super) handle: tokio::task::JoinHandle<Result<checkpoint::Done>>,
    pub(super) id: u64,
    pub(super) started: Instant,
    /// Where its partitions resume once it landed.
    pub(super) end: Offsets,
    pub(super) records: u64,
    /// The partitions it adds to each table.
    pub(super) added: Vec<(TableName, usize)>,
    /// Whether the loop waited for the source at least half the time while its records were
    /// read: the pipeline has time to spare.
    pub(super) spare: bool,
}

impl Pipeline {
    /// Whether the buffered records make a checkpoint: `checkpoint.max_records`, the interval
    /// since the first of them, or `checkpoint.max_buffered_bytes` (summed every 256 records).
    pub(super) fn checkpoint_due(&self, interval: Duration) -> bool {
        let c = &self.cfg.checkpoint;
        let p = &self.checkpoints.pending;
        if p.records == 0 {
            return false;
        }
        if p.records >= c.max_records || p.since.is_some_and(|s| s.elapsed() >= interval) {
            return true;
        }
        // Summing open files costs a walk over them; every 256 records is often enough.
        if p.records % 256 == 0 {
            let buffered: usize = self
                .tables
                .sinks
                .values()
                .map(|s| {
                    s.writer.buffered_bytes() + s.upsert.as_ref().map_or(0, |u| u.buffered_bytes())
                })
                .sum();
            metrics().buffered_bytes.set(buffered as i64);
            return buffered as u64 >= c.max_buffered_bytes;
        }
        false
    }

    /// Uploads files the writers rolled over, so memory holds only open files. A failed upload
    /// fails the checkpoint those files belong to.
    pub(super) async fn upload_finished(&mut self) -> Result<()> {
        let result = self.upload_rolled().await;
        if let Err(e) = &result {
            checkpoint_failed(e);
        }
        result
    }

    async fn upload_rolled(&mut self) -> Result<()> {
        for name in std::mem::take(&mut self.tables.touched) {
            let Some(sink) = self.tables.sinks.get_mut(&name) else {
                continue;
            };
            sink.touched = false;
            let mut files = std::mem::take(&mut sink.rolled);
            files.extend(sink.writer.take_finished());
            if !files.is_empty() {
                let uploaded =
                    checkpoint::put_files(&sink.table.io, files, &table_label(&sink.table)).await?;
                sink.uploaded.extend(uploaded);
            }
        }
        Ok(())
    }

    /// Commits what is buffered and waits for it (and for any checkpoint in flight).
    pub(super) async fn checkpoint(&mut self) -> Result<()> {
        self.settle().await?;
        self.begin_checkpoint().await?;
        self.settle().await
    }

    /// Whether a checkpoint or a compaction is in flight.
    pub(super) fn busy(&self) -> bool {
        self.checkpoints.inflight.is_some() || self.services.compacting.is_some()
    }

    /// Waits for the checkpoint in flight and for the compaction it may start, if any, and
    /// takes their results.
    pub(super) async fn settle(&mut self) -> Result<()> {
        self.settle_checkpoint().await?;
        self.settle_compaction().await
    }

    /// Waits for the checkpoint in flight, if any, and takes its result.
    async fn settle_checkpoint(&mut self) -> Result<()> {
        let Some(inflight) = self.checkpoints.inflight.as_mut() else {
            return Ok(());
        };
        let waited = Instant::now();
        let done = (&mut inflight.handle).await.unwrap_or_else(|e| {
            Err(Error::new(ErrorKind::Internal, "a checkpoint task failed").with_source(e))
        });
        let result = self.complete_checkpoint(done).await;
        metrics()
            .checkpoint_blocking
            .inc_by(waited.elapsed().as_secs_f64());
        result
    }

    /// Takes the result of the checkpoint or compaction in flight if it has ended, without
    /// waiting.
    pub(super) async fn settle_if_done(&mut self) -> Result<()> {
        if self
            .checkpoints
            .inflight
            .as_ref()
            .is_some_and(|f| f.handle.is_finished())
        {
            self.settle_checkpoint().await?;
        }
        if self
            .services
            .compacting
            .as_ref()
            .is_some_and(|c| c.handle.is_finished())
        {
            self.settle_compaction().await?;
        }
        Ok(())
    }

    /// Starts a checkpoint of what is buffered: its changes leave the tables' writers and shards
    /// for a task that writes, uploads and commits them while the next records are read (see
    /// [`checkpoint`]). No checkpoint may be in flight.
    pub(super) async fn begin_checkpoint(&mut self) -> Result<()> {
        let started = Instant::now();
        let result = self.start_job().await;
        metrics()
            .checkpoint_blocking
            .inc_by(started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            checkpoint_failed(e);
        }
        result
    }

    async fn start_job(&mut self) -> Result<()> {
        if self.busy() {
            return Err(Error::new(
                ErrorKind::Internal,
                "a checkpoint started while another or a compaction was in flight",
            ));
        }
        // A held retraction is not in this checkpoint: its partition commits up to it, so that
        // a restart reads it again.
        for sink in self.tables.sinks.values() {
            for ((topic, p), offset) in sink.upsert.iter().flat_map(|u| u.held_offsets()) {
                if let Some(end) = self
                    .checkpoints
                    .pending
                    .end
                    .get_mut(topic)
                    .and_then(|m| m.get_mut(p))
                {
                    *end = (*end).min(offset);
                }
            }
        }
        let checkpoint_id = self.checkpoints.next_checkpoint_id;
        self.checkpoints.next_checkpoint_id += 1;
        let scopes = self.offset_scopes();
        let watermarks = crate::maintain::done::checkpoint_watermarks(
            &self.checkpoints.pending.newest,
            self.ownership.assigned.iter(),
            &self.checkpoints.committed,
            &self.services.last_seen,
            Duration::from_millis(self.cfg.checkpoint.interval_ms),
            inlet_iceberg::now_ms(),
        );
        // Dead letters must be on the broker before the offsets that pass them commit.
        self.bad.flush().await?;
        if scopes.is_empty() {
            // No table exists yet (every record was bad or skipped): nothing can hold the
            // offsets, so these records are read again after a restart.
            self.checkpoints.pending = Pending::default();
            return Ok(());
        }
        let mut tables = Vec::with_capacity(scopes.len());
        let mut added = Vec::with_capacity(scopes.len());
        for (name, end) in scopes {
            let Some(sink) = self.tables.sinks.get_mut(&name) else {
                continue;
            };
            let label = table_label(&sink.table);
            let (shards, idle) = match sink.upsert.as_mut() {
                Some(u) => u.detach()?,
                None => (Vec::new(), Vec::new()),
            };
            // Every partition read is committed under the epoch this member claimed for it.
            let (mut start, mut epochs) = (Offsets::new(), Epochs::new());
            for (topic, ps) in &end {
                for p in ps.keys() {
                    if let Some(at) = sink.committed.get(topic).and_then(|c| c.get(p)) {
                        start.entry(topic.clone()).or_default().insert(*p, *at);
                    }
                    if let Some(e) = self.ownership.epochs.get(topic).and_then(|m| m.get(p)) {
                        epochs.entry(topic.clone()).or_default().insert(*p, *e);
                    }
                }
            }
            // A table speaks for the partitions whose offsets it records (routed, its topics'
            // watermarks alone decide when its partitions are done).
            let mut marks = watermarks.clone();
            if self.cfg.routing.is_some() {
                marks.retain(|t, _| end.contains_key(t) || sink.committed.contains_key(t));
            }
            sink.changes = 0;
            sink.fed.clear();
            added.push((name.clone(), sink.partitions.committed()));
            tables.push(checkpoint::TableJob {
                name,
                table: sink.table.clone(),
                rolled: std::mem::take(&mut sink.rolled),
                writer: Some(sink.writer.detach()),
                uploaded: std::mem::take(&mut sink.uploaded),
                shards,
                idle,
                checkpoint: Checkpoint {
                    id: checkpoint_id,
                    files: Vec::new(),
                    deletes: Vec::new(),
                    start,
                    end,
                    schema: sink.schema_change.take(),
                    epochs,
                    claim: false,
                    copies: self.services.copier.take_ready(&label),
                    source_ms: sink.newest_source_ms.take(),
                    index_markers: Vec::new(),
                    shard_topic: sink.shard_topic.clone(),
                    watermarks: marks,
                },
            });
        }
        let job = checkpoint::Job {
            id: checkpoint_id,
            committer: self.checkpoints.committer.clone(),
            tables,
        };
        let (began, waited) = std::mem::replace(
            &mut self.checkpoints.cycle,
            (Instant::now(), Duration::ZERO),
        );
        let spare = waited >= began.elapsed() / 2;
        let pending = std::mem::take(&mut self.checkpoints.pending);
        self.checkpoints.inflight = Some(InFlight {
            handle: checkpoint::start(job, self.checkpoints.gate.clone()),
            id: checkpoint_id,
            started: Instant::now(),
            end: pending.end,
            records: pending.records,
            added,
            spare,
        });
        self.checkpoints.show_buffered();
        Ok(())
    }

    /// The tables this checkpoint commits, each with the offsets it records (see
    /// [`offset_scopes`]).
    fn offset_scopes(&self) -> Vec<(TableName, Offsets)> {
        let tables = self.tables.sinks.iter().map(|(name, s)| {
            let mut topics: BTreeSet<&str> = s.fed.iter().map(String::as_str).collect();
            topics.extend(s.committed.keys().map(String::as_str));
            topics.extend(s.shard_topic.as_deref());
            (name, s.has_changes(), topics)
        });
        offset_scopes(
            &self.checkpoints.pending.end,
            self.cfg.routing.is_some(),
            tables.collect(),
        )
    }

    /// Takes a checkpoint's result: on success the tables, offsets and shard layouts move on,
    /// and the work that follows a commit runs (index copies, compaction, retention).
    async fn complete_checkpoint(&mut self, done: Result<checkpoint::Done>) -> Result<()> {
        let Some(inflight) = self.checkpoints.inflight.take() else {
            return Ok(());
        };
        self.checkpoints.show_buffered();
        let done = match done {
            Ok(d) => d,
            Err(e) => {
                checkpoint_failed(&e);
                return Err(e);
            }
        };
        health().succeeded(Component::Catalog);
        health().succeeded(Component::Storage);
        let m = metrics();
        let mut files = 0;
        let mut snapshots = Vec::new();
        for t in done.tables {
            snapshots.push(t.snapshot_id);
            files += t.files;
            let Some(sink) = self.tables.sinks.get_mut(&t.name) else {
                continue;
            };
            sink.table = t.table;
            if let Some(upsert) = sink.upsert.as_mut() {
                upsert.attach(t.layouts);
            }
            for (topic, ps) in &t.checkpoint.end {
                sink.committed.entry(topic.clone()).or_default().extend(ps);
            }
            let label = table_label(&sink.table);
            if let Some((_, n)) = inflight.added.iter().find(|(n, _)| *n == t.name) {
                m.partitions_created
                    .with_label_values(&[&label])
                    .inc_by(*n as u64);
            }
            m.last_commit
                .with_label_values(&[&label])
                .set(inlet_iceberg::now_ms() as f64 / 1000.0);
            if let Some(ms) = t.checkpoint.source_ms {
                m.committed_source_time(&label, ms);
            }
        }
        m.checkpoints.with_label_values(&[done.result]).inc();
        m.commit_duration
            .observe(inflight.started.elapsed().as_secs_f64());
        for (topic, ps) in &inflight.end {
            self.checkpoints
                .committed
                .entry(topic.clone())
                .or_default()
                .extend(ps);
        }
        source::commit_group_offsets(&self.consumer, &inflight.end);
        source::track_committed(&inflight.end);
        health().checkpoint_done(Ok(()));
        m.buffered_bytes.set(
            self.tables
                .sinks
                .values()
                .map(|s| s.writer.buffered_bytes())
                .sum::<usize>() as i64,
        );
        tracing::info!(
            checkpoint = inflight.id,
            snapshot_id = snapshots.first().copied().unwrap_or_default(),
            tables = snapshots.len(),
            records = inflight.records,
            files,
            result = done.result,
            // Read while it was written and committed.
            records_meanwhile = self.checkpoints.pending.records,
            elapsed_ms = inflight.started.elapsed().as_millis() as u64,
            "Checkpoint committed"
        );
        self.after_commit(inflight.spare).await
    }

    /// Index copies, compaction, the partition services and the table services, each when
    /// due. While shutting down, no copies and no compaction: the process leaves once what it
    /// read is committed (and its partitions retained and marked as they are due), and the
    /// next start, here or on another host, copies and rewrites.
    pub(super) async fn after_commit(&mut self, spare: bool) -> Result<()> {
        self.partition_tables().await?;
        if !self.checkpoints.stopping {
            self.copy_indexes().await?;
            if self
                .services
                .compactor
                .as_mut()
                .is_some_and(|c| c.due(spare))
            {
                self.start_compaction()?;
            }
        }
        let tables = &self.tables.sinks;
        self.services
            .scheduler
            .after_checkpoint(|| tables.values().map(|s| s.table.clone()).collect());
        Ok(())
    }
}

/// The tables a checkpoint commits, each with the offsets it records, from each table's name,
/// whether it changed, and the topics it records (those whose changes it took now or
/// before). Without routing, the one table records every partition read. Routed, a changed
/// table records the topics it records, so a table of Debezium's topic-per-table layout
/// carries only its own topic's offsets and epochs, however many topics the pipeline reads;
/// a topic no changed table records (tombstones, skipped or bad records only) goes to a table
/// that recorded it before, else to the first changed table, else to the first table, which
/// then commits with no changes. The pipeline resumes each partition at the highest offset any
/// of its tables records.
fn offset_scopes(
    end: &Offsets,
    routed: bool,
    tables: Vec<(&TableName, bool, BTreeSet<&str>)>,
) -> Vec<(TableName, Offsets)> {
    let mut scopes: Vec<(TableName, Offsets)> = tables
        .iter()
        .filter(|(_, changed, _)| *changed)
        .map(|(n, _, _)| ((*n).clone(), Offsets::new()))
        .collect();
    if !routed {
        if scopes.is_empty() {
            scopes.extend(
                tables
                    .first()
                    .map(|(n, _, _)| ((*n).clone(), Offsets::new())),
            );
        }
        for (_, offsets) in &mut scopes {
            offsets.clone_from(end);
        }
        return scopes;
    }
    let records = |name: &TableName, topic: &str| {
        tables
            .iter()
            .any(|(n, _, topics)| *n == name && topics.contains(topic))
    };
    for (topic, parts) in end {
        let mut recorded = false;
        for (name, offsets) in &mut scopes {
            if records(name, topic) {
                offsets.insert(topic.clone(), parts.clone());
                recorded = true;
            }
        }
        if recorded {
            continue;
        }
        let holder = tables
            .iter()
            .map(|(n, _, _)| *n)
            .find(|n| records(n, topic))
            .or_else(|| scopes.first().map(|(n, _)| n))
            .or_else(|| tables.first().map(|(n, _, _)| *n))
            .cloned();
        let Some(holder) = holder else {
            continue;
        };
        match scopes.iter_mut().find(|(n, _)| *n == holder) {
            Some((_, offsets)) => {
                offsets.insert(topic.clone(), parts.clone());
            }
            None => scopes.push((holder, Offsets::from([(topic.clone(), parts.clone())]))),
        }
    }
    scopes.retain(|(_, offsets)| !offsets.is_empty());
    scopes
}

/// Counts a failed checkpoint and shows it in health.
fn checkpoint_failed(e: &Error) {
    metrics().checkpoints.with_label_values(&["failed"]).inc();
    health().failed_with(e);
    health().checkpoint_done(Err(e));
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn name(t: &str) -> TableName {
        ("db".into(), t.into())
    }

    fn read(topics: &[&str]) -> Offsets {
        topics
            .iter()
            .map(|t| (t.to_string(), BTreeMap::from([(0, 10)])))
            .collect()
    }

    fn scoped(scopes: &[(TableName, Offsets)]) -> Vec<(String, Vec<String>)> {
        scopes
            .iter()
            .map(|(n, o)| (n.1.clone(), o.keys().cloned().collect()))
            .collect()
    }

    #[test]
    fn a_table_of_its_own_topic_records_only_that_topic() {
        let (a, b, c) = (name("a"), name("b"), name("c"));
        let tables = vec![
            (&a, true, BTreeSet::from(["db.a"])),
            (&b, true, BTreeSet::from(["db.b"])),
            (&c, false, BTreeSet::from(["db.c"])),
        ];
        let got = offset_scopes(&read(&["db.a", "db.b", "db.c"]), true, tables);
        // c took no change but is the topic's table: it records its offsets with no changes.
        assert_eq!(
            scoped(&got),
            vec![
                ("a".into(), vec!["db.a".into()]),
                ("b".into(), vec!["db.b".into()]),
                ("c".into(), vec!["db.c".into()]),
            ]
        );
    }

    #[test]
    fn a_topic_no_table_records_goes_to_the_first_changed_table() {
        let (a, b) = (name("a"), name("b"));
        let tables = vec![
            (&a, false, BTreeSet::from(["db.a"])),
            (&b, true, BTreeSet::from(["db.b"])),
        ];
        let got = offset_scopes(&read(&["db.b", "heartbeats"]), true, tables);
        assert_eq!(
            scoped(&got),
            vec![("b".into(), vec!["db.b".into(), "heartbeats".into()])]
        );
        // Nothing changed at all: the first table holds the offsets.
        let tables = vec![
            (&a, false, BTreeSet::from(["db.a"])),
            (&b, false, BTreeSet::from(["db.b"])),
        ];
        let got = offset_scopes(&read(&["heartbeats"]), true, tables);
        assert_eq!(scoped(&got), vec![("a".into(), vec!["heartbeats".into()])]);
    }

    #[test]
    fn a_combined_topic_is_recorded_by_every_changed_table_and_no_other() {
        let (a, b, c) = (name("a"), name("b"), name("c"));
        let all = || BTreeSet::from(["cdc"]);
        let tables = vec![(&a, true, all()), (&b, false, all()), (&c, true, all())];
        let got = offset_scopes(&read(&["cdc"]), true, tables);
        assert_eq!(
            scoped(&got),
            vec![
                ("a".into(), vec!["cdc".into()]),
                ("c".into(), vec!["cdc".into()])
            ]
        );
    }

    #[test]
    fn without_routing_the_table_records_every_partition_read() {
        let a = name("a");
        let got = offset_scopes(
            &read(&["x", "y"]),
            false,
            vec![(&a, false, BTreeSet::new())],
        );
        assert_eq!(
            scoped(&got),
            vec![("a".into(), vec!["x".into(), "y".into()])]
        );
    }
}
