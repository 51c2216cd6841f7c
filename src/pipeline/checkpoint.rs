//! A checkpoint on its way to the table, while the next one's records keep flowing: its files
//! are written on blocking threads (every shard at once), uploaded, committed in one catalog
//! transaction, and its index batches applied. The pipeline starts it ([`Job`]) and takes its
//! result ([`Done`]) before it starts the next, so at most one is in flight.

use std::sync::Arc;

use bytes::Bytes;

use super::TableName;
use crate::commit::{Checkpoint, CommitOutcome, Committer};
use crate::metrics::metrics;
use crate::source::CommitGate;
use crate::upsert::{ShardJob, ShardLayout, ShardWritten};
use crate::write::{DataWriter, WrittenFile};
use inlet_common::error::{Error, ErrorKind, Result};
use inlet_iceberg::io::FileIO;
use inlet_iceberg::manifest::{DataFile, FileContent};
use inlet_iceberg::Table;
use inlet_index::{KeyIndex, Marker};

/// One table's part of a checkpoint.
pub(super) struct TableJob {
    pub name: TableName,
    /// The table as the pipeline last saw it; the commit rebases it as needed.
    pub table: Table,
    /// Files finished before the checkpoint and not uploaded yet.
    pub rolled: Vec<WrittenFile>,
    /// The rows written since the last checkpoint, in files still open.
    pub writer: Option<DataWriter>,
    /// Files uploaded already.
    pub uploaded: Vec<DataFile>,
    /// Upsert tables: the shards with rows to write, and the indexes of those left alone.
    pub shards: Vec<ShardJob>,
    pub idle: Vec<Arc<dyn KeyIndex>>,
    /// What the snapshot records; its files are filled in as they are uploaded.
    pub checkpoint: Checkpoint,
}

/// A checkpoint to write and commit.
pub(super) struct Job {
    pub id: u64,
    pub committer: Committer,
    pub tables: Vec<TableJob>,
}

/// One table's checkpoint, committed.
pub(super) struct TableDone {
    pub name: TableName,
    /// The table with the checkpoint's snapshot.
    pub table: Table,
    pub snapshot_id: i64,
    pub files: usize,
    /// The layouts the shards lent, to give back.
    pub layouts: Vec<((String, i32), ShardLayout)>,
    pub checkpoint: Checkpoint,
}

/// A committed checkpoint.
pub(super) struct Done {
    pub tables: Vec<TableDone>,
    /// `committed`, or `already_committed` when an earlier attempt had landed.
    pub result: &'static str,
}

/// Tells the gate the checkpoint ended, however it ends.
struct Ended(Arc<CommitGate>);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// Starts `job` as a task of its own; `gate` is open again once it ends.
pub(super) fn start(job: Job, gate: Arc<CommitGate>) -> tokio::task::JoinHandle<Result<Done>> {
    let id = job.id;
    gated(gate, async move {
        run(job).await.map_err(|e| e.with("checkpoint", id))
    })
}

/// Runs `work`, which commits, as a task of its own with `gate` closed until it ends:
/// partitions are given up only between commits.
pub(super) fn gated<T: Send + 'static>(
    gate: Arc<CommitGate>,
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    gate.begin();
    tokio::spawn(async move {
        let _ended = Ended(gate);
        work.await
    })
}

fn task_failed(e: tokio::task::JoinError) -> Error {
    Error::new(ErrorKind::Internal, "a checkpoint task failed").with_source(e)
}

async fn run(mut job: Job) -> Result<Done> {
    let (id, writer_id) = (job.id, job.committer.writer_id.clone());
    let tag = uuid::Uuid::new_v4().simple().to_string();
    // Every table's files and every shard's rows are written at once, on blocking threads.
    let mut writing = Vec::with_capacity(job.tables.len());
    for t in &mut job.tables {
        let writer = t.writer.take();
        let close = tokio::task::spawn_blocking(move || match writer {
            Some(mut w) => w.close(),
            None => Ok(Vec::new()),
        });
        let shards: Vec<_> = std::mem::take(&mut t.shards)
            .into_iter()
            .map(|shard| {
                let (writer_id, tag) = (writer_id.clone(), tag.clone());
                let (io, handle) = (t.table.io.clone(), tokio::runtime::Handle::current());
                tokio::task::spawn_blocking(move || {
                    // Committed rows are read only for values a change left unchanged.
                    let read = |path: &str| handle.block_on(io.get(path));
                    shard.write(&writer_id, id, &tag, &read)
                })
            })
            .collect();
        writing.push((close, shards));
    }
    let mut written: Vec<Vec<ShardWritten>> = Vec::with_capacity(job.tables.len());
    for (t, (close, shards)) in job.tables.iter_mut().zip(writing) {
        t.rolled.extend(close.await.map_err(task_failed)??);
        let mut done = Vec::with_capacity(shards.len());
        for s in shards {
            done.push(s.await.map_err(task_failed)??);
        }
        written.push(done);
    }
    inlet_common::failpoint::crash_point("before_upload");
    let m = metrics();
    for (t, shards) in job.tables.iter_mut().zip(&mut written) {
        let label = format!("{}.{}", t.name.0, t.name.1);
        let io = t.table.io.clone();
        let mut files = std::mem::take(&mut t.uploaded);
        files.extend(put_files(&io, std::mem::take(&mut t.rolled), &label).await?);
        let mut deletes = Vec::new();
        for s in shards.iter_mut() {
            m.position_deletes.inc_by(
                s.deletes
                    .iter()
                    .map(|f| f.data_file.record_count as u64)
                    .sum(),
            );
            files.extend(put_files(&io, std::mem::take(&mut s.data), &label).await?);
            deletes.extend(put_files(&io, std::mem::take(&mut s.deletes), &label).await?);
            t.checkpoint.index_markers.push(s.marker);
        }
        t.checkpoint.files = files;
        t.checkpoint.deletes = deletes;
    }
    inlet_common::failpoint::crash_point("after_upload");
    // Tests hold a commit here to see the next checkpoint's records arrive meanwhile.
    inlet_common::failpoint::delay_point("before_commit").await;
    let outcomes = {
        let commits: Vec<(&mut Table, &Checkpoint)> = job
            .tables
            .iter_mut()
            .map(|t| (&mut t.table, &t.checkpoint))
            .collect();
        job.committer.commit_all(commits).await?
    };
    inlet_common::failpoint::crash_point("after_commit");
    let mut result = "committed";
    let mut done = Vec::with_capacity(job.tables.len());
    for ((t, shards), outcome) in job.tables.into_iter().zip(written).zip(outcomes) {
        let snapshot_id = match outcome {
            CommitOutcome::Committed { snapshot_id, .. } => snapshot_id,
            CommitOutcome::AlreadyCommitted { snapshot_id } => {
                result = "already_committed";
                snapshot_id
            }
        };
        let snapshot = t
            .table
            .metadata
            .snapshots
            .iter()
            .find(|s| s.snapshot_id == snapshot_id)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Internal,
                    format!("committed snapshot {snapshot_id} is not in the table"),
                )
            })?;
        let marker = Marker {
            snapshot_id,
            sequence_number: snapshot.sequence_number,
        };
        let (meta, pipeline, idle) = (
            t.table.metadata.clone(),
            job.committer.pipeline_id.clone(),
            t.idle,
        );
        let layouts = tokio::task::spawn_blocking(move || -> Result<_> {
            let mut layouts = Vec::with_capacity(shards.len());
            for mut s in shards {
                s.apply(marker)?;
                layouts.push(s.into_layout());
            }
            crate::upsert::advance_idle(&idle, &meta, &pipeline, marker)?;
            Ok(layouts)
        })
        .await
        .map_err(task_failed)??;
        done.push(TableDone {
            name: t.name,
            files: t.checkpoint.files.len(),
            table: t.table,
            snapshot_id,
            layouts,
            checkpoint: t.checkpoint,
        });
    }
    Ok(Done {
        tables: done,
        result,
    })
}

/// Uploads `files` at once and returns their manifest descriptions.
pub(super) async fn put_files(
    io: &FileIO,
    files: Vec<WrittenFile>,
    table: &str,
) -> Result<Vec<DataFile>> {
    let m = metrics();
    let mut out = Vec::with_capacity(files.len());
    let mut uploads = Vec::with_capacity(files.len());
    let (mut bytes, mut rows) = (0, 0);
    for f in files {
        bytes += f.bytes.len() as u64;
        if f.data_file.content == FileContent::Data {
            rows += f.data_file.record_count.max(0) as u64;
        }
        uploads.push((f.data_file.file_path.clone(), Bytes::from(f.bytes)));
        out.push(f.data_file);
    }
    io.put_many(uploads).await?;
    m.files_written.inc_by(out.len() as u64);
    m.bytes_written.inc_by(bytes);
    m.rows_written.with_label_values(&[table]).inc_by(rows);
    Ok(out)
}
