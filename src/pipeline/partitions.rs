//! The partitions a pipeline owns: assignments and revocations from the consumer group, the
//! claims that fence earlier owners, and bringing each upsert shard level with its table.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;

use crate::commit::Epochs;
use crate::health::health;
use crate::metrics::metrics;
use crate::rebuild::copies::{self, CopyManifest};
use crate::source::{self, SourceEvent, TableRef};
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_iceberg::Table;

use super::coordinator::Pending;
use super::{table_label, Pipeline, TableName};

/// The partitions this member owns, and the claims that make them its own.
pub(super) struct Ownership {
    /// Assignments and revocations from the consumer's rebalance callbacks.
    pub(super) events: tokio::sync::mpsc::UnboundedReceiver<SourceEvent>,
    /// Partitions this member owns.
    pub(super) assigned: HashSet<(String, i32)>,
    /// The owner epoch this member claimed for each partition it owns.
    pub(super) epochs: Epochs,
    /// Claims of newly assigned partitions, running beside the pipeline.
    pub(super) claiming: Vec<Claiming>,
    /// Where claims of assigned partitions find the tables, and commit as this member.
    pub(super) table_ref: std::sync::Arc<TableRef>,
}

/// An index shard taken out of its table while it is brought level with the table.
pub(super) struct Recovering {
    pub(super) name: TableName,
    pub(super) topic: String,
    pub(super) partition: i32,
    pub(super) shard: crate::upsert::Shard,
    pub(super) spec: crate::upsert::UpsertSpec,
    pub(super) table: Table,
    pub(super) started: Instant,
    /// Where its index came from: `local`, or `copy` when restored from its copy.
    pub(super) source: &'static str,
}

/// A claim of the partitions one assignment brought, running in its own task.
pub(super) struct Claiming {
    /// The assignment's number (see [`source::Claims`]).
    pub(super) n: u64,
    pub(super) parts: Vec<(String, i32)>,
    pub(super) task: tokio::task::JoinHandle<Result<source::Claimed>>,
}

impl Ownership {
    /// Whether this member owns `partition` of `topic`.
    pub(super) fn owns(&self, topic: &str, partition: i32) -> bool {
        self.assigned.contains(&(topic.to_string(), partition))
    }
}

impl Pipeline {
    /// Applies what the consumer reported (assignments, revocations, failures) and takes over
    /// the partitions whose claims finished meanwhile.
    pub(super) async fn handle_events(&mut self) -> Result<()> {
        loop {
            while let Ok(event) = self.ownership.events.try_recv() {
                match event {
                    SourceEvent::Assigned(parts, n) => self.claim(parts, n),
                    SourceEvent::Revoked(parts) => {
                        // Revocations change the shards a checkpoint in flight writes: it
                        // lands first.
                        self.settle().await?;
                        self.revoke(parts)?;
                    }
                    SourceEvent::Fatal(e) => return Err(e),
                    SourceEvent::Failed(e) => {
                        return Err(e.with("while", "partition assignment"));
                    }
                }
            }
            if !self.finish_claims().await? {
                return Ok(());
            }
        }
    }

    /// Starts claiming partitions the group just assigned, in a task of its own: the consumer
    /// keeps polling (and the member stays in its group) however long the catalog takes.
    pub(super) fn claim(&mut self, parts: Vec<(String, i32)>, n: u64) {
        self.monitor.wake();
        let (table, claims) = (
            self.ownership.table_ref.clone(),
            self.consumer.context().claims.clone(),
        );
        let claimed = parts.clone();
        let task = tokio::spawn(async move {
            let current = || !claims.current(&claimed, n).is_empty();
            claim_partitions_while(&table, &claimed, current).await
        });
        self.ownership.claiming.push(Claiming { n, parts, task });
    }

    /// Takes over the partitions of every finished claim that are still waiting for it:
    /// brings their index shards level with the table, then gives them to the consumer at the
    /// table's offsets. Whether any claim finished.
    async fn finish_claims(&mut self) -> Result<bool> {
        let mut finished = false;
        while let Some(at) = self
            .ownership
            .claiming
            .iter()
            .position(|c| c.task.is_finished())
        {
            finished = true;
            let Claiming { n, parts, task } = self.ownership.claiming.swap_remove(at);
            let claims = self.consumer.context().claims.clone();
            let result = task.await.map_err(|e| {
                Error::new(ErrorKind::Internal, "partition claim task failed").with_source(e)
            })?;
            let live = claims.current(&parts, n);
            let (offsets, start, mut epochs) = match result {
                Ok(claimed) => claimed,
                Err(e) if live.is_empty() => {
                    tracing::info!(error = %e, "A claim of partitions revoked meanwhile failed; nothing to take over");
                    continue;
                }
                Err(e) => {
                    health().failed_with(&e);
                    tracing::error!(error = %e, "Cannot claim the assigned partitions in the table");
                    return Err(e.with("while", "claiming assigned partitions"));
                }
            };
            if live.is_empty() {
                continue;
            }
            for (topic, ps) in epochs.iter_mut() {
                ps.retain(|p, _| live.contains(&(topic.clone(), *p)));
            }
            let positions: Vec<(String, i32, Option<i64>)> = live
                .iter()
                .map(|(t, p)| {
                    let at = offsets.get(t).and_then(|m| m.get(p)).copied();
                    (t.clone(), *p, at)
                })
                .collect();
            tracing::info!(
                partitions = positions.len(),
                positions = %source::describe_positions(&positions),
                epochs = %source::describe_epochs(&epochs),
                assignment = n,
                "Partitions assigned at table offsets"
            );
            source::track_assignment(&positions, start == rdkafka::Offset::End);
            for (topic, ps) in &epochs {
                for (p, e) in ps {
                    metrics()
                        .owner_epoch
                        .with_label_values(&[topic.as_str(), &p.to_string()])
                        .set(*e);
                }
            }
            self.take_over(positions.clone(), epochs).await?;
            // Revoked (or assigned again) while their shards recovered: not this claim's.
            let readable = claims.done(&live, n);
            let given: Vec<_> = positions
                .into_iter()
                .filter(|(t, p, _)| readable.contains(&(t.clone(), *p)))
                .collect();
            source::assign_claimed(&self.consumer, &given, start)?;
        }
        Ok(finished)
    }

    /// Makes claimed partitions this member's: the tables move on to what the claim (and other
    /// members' commits) left, and each index shard is brought level with its table.
    async fn take_over(
        &mut self,
        parts: Vec<(String, i32, Option<i64>)>,
        epochs: Epochs,
    ) -> Result<()> {
        // Shards and tables change under a checkpoint in flight: it lands first.
        self.settle().await?;
        for (topic, ps) in epochs {
            self.ownership.epochs.entry(topic).or_default().extend(ps);
        }
        // The claim moved the tables that record the claimed topics on; other members may
        // have committed too. Routed tables of other topics are left as they are.
        let topics: HashSet<&String> = parts.iter().map(|(t, _, _)| t).collect();
        let routed = self.cfg.routing.is_some();
        let names: Vec<TableName> = self
            .tables
            .sinks
            .iter()
            .filter(|(_, s)| {
                !routed
                    || s.committed.keys().any(|t| topics.contains(t))
                    || s.shard_topic.as_ref().is_some_and(|t| topics.contains(t))
            })
            .map(|(n, _)| n.clone())
            .collect();
        for name in &names {
            if let Some(sink) = self.tables.sinks.get_mut(name) {
                sink.refresh(&self.cfg).await?;
            }
        }
        let added: Vec<(String, i32)> = parts.iter().map(|(t, p, _)| (t.clone(), *p)).collect();
        for name in &names {
            self.start_without_offsets(name, &added)?;
        }
        let mut recovering = Vec::new();
        for (topic, p, _) in &parts {
            for name in &names {
                if self
                    .tables
                    .sinks
                    .get(name)
                    .is_some_and(|s| s.reads_shards_of(topic))
                {
                    recovering.extend(self.open_shard(name, topic, *p).await?);
                }
            }
        }
        self.recover_shards(recovering).await?;
        for (topic, p, at) in parts {
            if let Some(at) = at {
                self.checkpoints
                    .committed
                    .entry(topic.clone())
                    .or_default()
                    .insert(p, at);
            }
            self.services.last_seen.saw(&topic, p);
            self.ownership.assigned.insert((topic, p));
        }
        // Ready once the shards' indexes are level with the table.
        health().assigned(self.ownership.assigned.iter().cloned().collect());
        Ok(())
    }

    /// Reads owned partitions again from the given offsets (others are skipped: their next
    /// owner positions them).
    fn rewind(&mut self, rewind: BTreeMap<(String, i32), i64>) -> Result<()> {
        for ((topic, p), at) in rewind {
            if !self.ownership.assigned.contains(&(topic.clone(), p)) {
                continue;
            }
            self.consumer
                .seek(
                    &topic,
                    p,
                    rdkafka::Offset::Offset(at),
                    Duration::from_secs(10),
                )
                .or_kind(ErrorKind::Kafka, || {
                    format!("cannot read {topic}/{p} again from {at}")
                })?;
        }
        Ok(())
    }

    /// Gives up revoked partitions. Buffered records of a revoked partition cannot commit any
    /// more, and they share files and checkpoints with the partitions kept: every buffered
    /// record is dropped, and the kept partitions read again from their first dropped record.
    pub(super) fn revoke(&mut self, parts: Vec<(String, i32)>) -> Result<()> {
        let buffered = parts.iter().any(|(t, p)| {
            self.checkpoints
                .pending
                .end
                .get(t)
                .is_some_and(|m| m.contains_key(p))
        });
        for (topic, p) in &parts {
            self.ownership.assigned.remove(&(topic.clone(), *p));
            for map in [&mut self.ownership.epochs, &mut self.checkpoints.committed] {
                if let Some(m) = map.get_mut(topic) {
                    m.remove(p);
                }
            }
        }
        // Batches read ahead are dropped too: a partition revoked now may come back before
        // they would be applied, positioned where the table says.
        let mut rewind: BTreeMap<(String, i32), i64> = self
            .decode
            .drop_ahead()
            .into_iter()
            .map(|(t, p, at)| ((t.to_string(), p), at))
            .collect();
        if buffered {
            tracing::warn!(
                records = self.checkpoints.pending.records,
                revoked = parts.len(),
                kept = self.ownership.assigned.len(),
                "Dropping buffered records: their partitions were revoked, and the next owner reads them again"
            );
            for (t, ps) in &self.checkpoints.pending.first {
                for (p, at) in ps {
                    let to = rewind.entry((t.clone(), *p)).or_insert(*at);
                    *to = (*to).min(*at);
                }
            }
            for sink in self.tables.sinks.values_mut() {
                sink.abort()?;
            }
            for name in self.tables.touched.drain(..) {
                if let Some(sink) = self.tables.sinks.get_mut(&name) {
                    sink.touched = false;
                }
            }
            self.bad.abandon();
            self.checkpoints.pending = Pending::default();
            self.checkpoints.show_buffered();
        }
        self.rewind(rewind)?;
        for sink in self.tables.sinks.values_mut() {
            if let Some(upsert) = sink.upsert.as_mut() {
                upsert.close(&parts);
            }
        }
        self.services.copier.forget(&parts);
        if self.ownership.assigned.is_empty() {
            health().revoked();
        } else {
            health().assigned(self.ownership.assigned.iter().cloned().collect());
        }
        Ok(())
    }

    /// Records finished index copies and starts the ones due, after a commit.
    pub(super) async fn copy_indexes(&mut self) -> Result<()> {
        self.services.copier.collect().await;
        for sink in self.tables.sinks.values() {
            let Some(upsert) = sink.upsert.as_ref() else {
                continue;
            };
            let label = table_label(&sink.table);
            for ((topic, p), shard) in upsert.open_shards() {
                let key = (label.clone(), topic.clone(), *p);
                if !self.services.copier.due(&key) {
                    continue;
                }
                let (Some(marker), Some(epoch)) = (
                    shard.marker()?,
                    self.ownership
                        .epochs
                        .get(topic)
                        .and_then(|m| m.get(p))
                        .copied(),
                ) else {
                    continue;
                };
                let manifest = CopyManifest {
                    pipeline: self.cfg.pipeline_id.clone(),
                    topic: topic.clone(),
                    partition: *p,
                    epoch,
                    snapshot_id: marker.snapshot_id,
                    sequence_number: marker.sequence_number,
                    files: vec![],
                };
                let remote = copies::shard_dir(
                    &sink.table.metadata.location,
                    &self.cfg.pipeline_id,
                    topic,
                    *p,
                );
                let local = upsert.shard_dir(topic, *p).join("copy");
                let started = tokio::task::block_in_place(|| {
                    self.services.copier.start(
                        key,
                        shard.index(),
                        local,
                        sink.table.io.clone(),
                        remote,
                        manifest,
                    )
                });
                if let Err(e) = started {
                    metrics().index_copies.with_label_values(&["failed"]).inc();
                    tracing::warn!(topic, partition = p, error = %e, "Cannot copy an index shard");
                }
            }
        }
        Ok(())
    }

    /// Upsert tables: opens the index shard of an owned partition (restoring it from its copy
    /// beside the table when there is none here) and takes it out of its table, for
    /// [`Pipeline::recover_shards`] to bring level with the table.
    pub(super) async fn open_shard(
        &mut self,
        name: &TableName,
        topic: &str,
        partition: i32,
    ) -> Result<Option<Recovering>> {
        let started = Instant::now();
        let Some(sink) = self.tables.sinks.get_mut(name) else {
            return Ok(None);
        };
        let Some(upsert) = sink.upsert.as_mut() else {
            return Ok(None);
        };
        let spec = upsert.spec.clone();
        let dir = upsert.shard_dir(topic, partition);
        let table = sink.table.clone();
        // No index here (a new host, a lost volume): the newest copy beside the table, if any.
        let mut source = "local";
        if !dir.join("db").join("CURRENT").exists() {
            let pointer = crate::commit::copy_pointers(&table.metadata, &self.cfg.pipeline_id)?
                .get(topic)
                .and_then(|m| m.get(&partition))
                .cloned();
            if let Some(uri) = pointer {
                let (io, db) = (table.io.clone(), dir.join("db"));
                std::fs::create_dir_all(&dir).or_kind(ErrorKind::Storage, || {
                    format!("cannot create index directory {}", dir.display())
                })?;
                let _ = std::fs::remove_dir_all(&db);
                let task = tokio::spawn(async move { copies::download(&io, &uri, &db).await });
                match source::poll_while(&self.consumer, task).await? {
                    Ok(Ok((copy, _))) => {
                        source = "copy";
                        tracing::info!(
                            topic,
                            partition,
                            epoch = copy.epoch,
                            snapshot_id = copy.snapshot_id,
                            seconds = started.elapsed().as_secs_f64(),
                            "Index restored from its copy beside the table"
                        );
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(topic, partition, error = %e, "Cannot restore the index from its copy; rebuilding it from the table");
                        let _ = std::fs::remove_dir_all(dir.join("db"));
                    }
                    Err(e) => {
                        return Err(
                            Error::new(ErrorKind::Internal, "index download task failed")
                                .with_source(e),
                        )
                    }
                }
            }
        }
        let Some(upsert) = self
            .tables
            .sinks
            .get_mut(name)
            .and_then(|s| s.upsert.as_mut())
        else {
            return Ok(None);
        };
        tokio::task::block_in_place(|| upsert.open_shard(topic, partition))?;
        let shard = upsert
            .take_shard(topic, partition)
            .ok_or_else(|| Error::new(ErrorKind::Internal, "opened shard vanished"))?;
        Ok(Some(Recovering {
            name: name.clone(),
            topic: topic.to_string(),
            partition,
            shard,
            spec,
            table,
            started,
            source,
        }))
    }

    /// Brings the shards level with their tables (a catch-up or a whole rebuild each), up to
    /// `pipeline.workers` at once on threads of their own: shards are independent, and a
    /// rebuild keeps a core busy. Meanwhile this task keeps polling the consumer with every
    /// partition paused, so a long rebuild never outlasts `max.poll.interval.ms` and costs the
    /// group a rebalance. Every shard goes back to its table; the first failure is returned.
    pub(super) async fn recover_shards(&mut self, recovering: Vec<Recovering>) -> Result<()> {
        if recovering.is_empty() {
            return Ok(());
        }
        let pipeline = self.cfg.pipeline_id.clone();
        let workers = self.cfg.pipeline.worker_count();
        let task = tokio::spawn(crate::rebuild::on_workers(
            recovering,
            workers,
            move |mut r: Recovering| {
                let pipeline = pipeline.clone();
                async move {
                    inlet_common::failpoint::delay_point("recovery").await;
                    let result = crate::rebuild::recover(
                        &mut r.shard,
                        &r.spec,
                        &r.table,
                        &pipeline,
                        &r.topic,
                        r.partition,
                    )
                    .await;
                    (r, result)
                }
            },
        ));
        let done = source::poll_while(&self.consumer, task)
            .await?
            .map_err(|e| {
                Error::new(ErrorKind::Internal, "index recovery task failed").with_source(e)
            })?;
        let mut failed = None;
        for joined in done {
            let (r, result) = joined.map_err(|e| {
                Error::new(ErrorKind::Internal, "index recovery task failed").with_source(e)
            })?;
            if let Some(upsert) = self
                .tables
                .sinks
                .get_mut(&r.name)
                .and_then(|s| s.upsert.as_mut())
            {
                upsert.put_shard(&r.topic, r.partition, r.shard);
            }
            let source = match result {
                Ok(crate::rebuild::Recovery::Rebuilt { .. }) => "rebuild",
                Ok(_) => r.source,
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            };
            let m = metrics();
            m.index_restores.with_label_values(&[source]).inc();
            m.index_restore_seconds
                .with_label_values(&[source])
                .observe(r.started.elapsed().as_secs_f64());
        }
        failed.map_or(Ok(()), Err)
    }
}

/// Claims `parts`, trying again after a transient fault (a catalog restarting) for as long as
/// they are still this member's to claim.
async fn claim_partitions_while(
    table: &TableRef,
    parts: &[(String, i32)],
    current: impl Fn() -> bool + Copy,
) -> Result<source::Claimed> {
    let mut delay = Duration::from_millis(200);
    loop {
        match source::claim_partitions(table, parts, current).await {
            Err(e) if e.retryable() && current() => {
                health().failed_with(&e);
                tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "Cannot claim assigned partitions yet; trying again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            other => return other,
        }
    }
}
