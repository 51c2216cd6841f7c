//! Work on the tables after checkpoints: inline compaction of upsert shards beside
//! consumption, partition retention and mark-done.

use std::time::Instant;

use crate::metrics::metrics;
use inlet_common::error::{Error, ErrorKind, Result};
use inlet_iceberg::Table;

use super::{checkpoint, Pipeline, TableName};

/// The work on the tables beside ingestion: index copies, inline compaction, and the
/// services that run after checkpoints.
pub(super) struct TableServices {
    /// Copies of the index shards beside the tables.
    pub(super) copier: crate::rebuild::copies::Copier,
    /// Snapshot expiry and orphan cleanup in the background.
    pub(super) scheduler: crate::maintain::Scheduler,
    /// Upsert tables: inline compaction after checkpoints.
    pub(super) compactor: Option<crate::maintain::compact::Compactor>,
    /// The compaction running while records are read, if any.
    pub(super) compacting: Option<Compacting>,
    /// Partition retention and mark-done after checkpoints.
    pub(super) partition_services: Option<crate::maintain::PartitionServices>,
    /// When each owned partition last delivered a record, for the watermarks of idle ones.
    pub(super) last_seen: crate::maintain::done::LastSeen,
}

/// A compaction running beside consumption: it holds the upsert tables' shard layouts until it
/// ends, and the next checkpoint waits for it.
pub(super) struct Compacting {
    pub(super) handle: tokio::task::JoinHandle<Result<Vec<CompactedTable>>>,
    pub(super) started: Instant,
}

/// One table compacted: the table as the compaction left it, and the layouts to give back.
pub(super) struct CompactedTable {
    pub(super) name: TableName,
    /// Whether the compaction committed a snapshot.
    pub(super) committed: bool,
    /// Files it left due.
    pub(super) backlog: usize,
    pub(super) table: Table,
    pub(super) layouts: Vec<((String, i32), crate::upsert::ShardLayout)>,
}

impl Pipeline {
    /// Upsert tables: each shard compacts its own files, as a checkpoint of its own that moves
    /// no offsets (see `maintain::compact`). The compaction runs in a task of its own while
    /// records are read and applied; the shards lend it their layouts, and the next checkpoint
    /// (or anything else that changes shards or tables) waits for it ([`Pipeline::settle`]).
    pub(super) fn start_compaction(&mut self) -> Result<()> {
        let Some(compactor) = self.services.compactor.as_mut() else {
            return Ok(());
        };
        let run = compactor.start();
        let mut tables = Vec::new();
        for (name, sink) in &mut self.tables.sinks {
            let Some(upsert) = sink.upsert.as_mut() else {
                continue;
            };
            let checkpoint = self.checkpoints.next_checkpoint_id;
            self.checkpoints.next_checkpoint_id += 1;
            tables.push((
                name.clone(),
                sink.table.clone(),
                upsert.lend()?,
                checkpoint,
                sink.committed.clone(),
            ));
        }
        if tables.is_empty() {
            return Ok(());
        }
        let (committer, epochs) = (
            self.checkpoints.committer.clone(),
            self.ownership.epochs.clone(),
        );
        let handle = checkpoint::gated(self.checkpoints.gate.clone(), async move {
            let mut done = Vec::with_capacity(tables.len());
            for (name, mut table, mut lent, checkpoint, fence) in tables {
                let compacted = run
                    .run(
                        &mut table, &mut lent, &committer, checkpoint, &fence, &epochs,
                    )
                    .await?;
                // Tests hold a compaction here to see records read meanwhile.
                inlet_common::failpoint::delay_point("after_compaction").await;
                done.push(CompactedTable {
                    name,
                    committed: compacted.snapshot_id.is_some(),
                    backlog: compacted.backlog,
                    table,
                    layouts: lent.into_layouts(),
                });
            }
            Ok(done)
        });
        self.services.compacting = Some(Compacting {
            handle,
            started: Instant::now(),
        });
        Ok(())
    }

    /// The source is idle: when nothing is buffered or in flight and the last compaction left
    /// files due, another run starts (`services.compact_when_idle`).
    pub(super) fn compact_when_idle(&mut self) -> Result<()> {
        let due = self
            .services
            .compactor
            .as_ref()
            .is_some_and(|c| c.due_when_idle());
        if !due || self.checkpoints.stopping || self.checkpoints.pending.records > 0 || self.busy()
        {
            return Ok(());
        }
        self.start_compaction()
    }

    /// Waits for the compaction in flight, if any: the tables move on to its snapshots and the
    /// shards take their layouts back. An error means a commit's outcome is unknown, and the
    /// pipeline restarts (recovery applies the saved batches iff the snapshot landed).
    pub(super) async fn settle_compaction(&mut self) -> Result<()> {
        let Some(compacting) = self.services.compacting.take() else {
            return Ok(());
        };
        let waited = Instant::now();
        let done = compacting.handle.await.unwrap_or_else(|e| {
            Err(Error::new(ErrorKind::Internal, "a compaction task failed").with_source(e))
        });
        metrics()
            .checkpoint_blocking
            .inc_by(waited.elapsed().as_secs_f64());
        let (mut committed, mut backlog) = (0, 0);
        for t in done? {
            committed += usize::from(t.committed);
            backlog += t.backlog;
            let Some(sink) = self.tables.sinks.get_mut(&t.name) else {
                continue;
            };
            sink.table = t.table;
            if let Some(upsert) = sink.upsert.as_mut() {
                upsert.attach(t.layouts);
            }
        }
        if let Some(c) = self.services.compactor.as_mut() {
            c.ran(backlog, committed > 0);
        }
        if committed > 0 {
            tracing::info!(
                tables = committed,
                backlog,
                elapsed_ms = compacting.started.elapsed().as_millis() as u64,
                // Read while it ran.
                records_meanwhile = self.checkpoints.pending.records,
                "Compaction landed"
            );
        }
        Ok(())
    }
}

impl Pipeline {
    /// Partition retention and mark-done, when due (see `maintain::PartitionServices`); an
    /// upsert table's shards drop their files as a checkpoint of their own, like compaction.
    pub(super) async fn partition_tables(&mut self) -> Result<()> {
        let Some(services) = self.services.partition_services.as_mut() else {
            return Ok(());
        };
        if !services.due() {
            return Ok(());
        }
        for sink in self.tables.sinks.values_mut() {
            let checkpoint = self.checkpoints.next_checkpoint_id;
            self.checkpoints.next_checkpoint_id += 1;
            services
                .run(
                    &mut sink.table,
                    sink.upsert.as_mut(),
                    &self.checkpoints.committer,
                    checkpoint,
                    &sink.committed,
                    &self.ownership.epochs,
                    &self.ownership.assigned,
                    inlet_iceberg::now_ms(),
                )
                .await?;
        }
        Ok(())
    }
}
