//! Partition retention (Paimon's `partition.expiration-time`): the files of a partition whose
//! time is older than `services.partition_expiration_ms` leave the table in a `delete`
//! snapshot that carries the pipeline's offsets unchanged. A partition's time is the end of the
//! time range its values name (`values-time`), or when a snapshot last added a file to it
//! (`update-time`).
//!
//! In an upsert table each shard drops only its own files, fenced like a compaction (the
//! snapshot lands only while the table holds the offsets and owner epoch the shard's last
//! checkpoint left), and its index forgets them in one atomic batch saved beside the index
//! before the commit and applied after it. A changelog table has no index: its partitions'
//! files are dropped whole. Another engine's files in an upsert table are every shard's and
//! no shard's to drop; they stay.
//!
//! A change that arrives later for a dropped partition is applied like any other: it recreates
//! the partition (the key is new to the index), the next run drops it again, and its rows count
//! as late (`inlet_maintain_late_rows_total{state="expired"}`).

use std::collections::{HashMap, HashSet};

use crate::commit::{Committer, Epochs, Offsets};
use crate::config::PartitionExpirationStrategy;
use crate::upsert::UpsertSink;
use crate::write::deletes::{names, Names};
use inlet_common::error::Result;
use inlet_iceberg::manifest::{DataFile, FileContent, ManifestEntry};
use inlet_iceberg::metadata::TableMetadata;
use inlet_iceberg::Table;
use inlet_index::IndexBatch;

use super::compact::{commit_rewrite, Fence, Operation};
use super::partitions::{partitions, Partition, TimeField};
use crate::write::file_shard;

/// Crash points of a retention commit, for the fault tests.
pub const STEPS: [&str; 2] = ["retain_after_save", "retain_after_commit"];

/// Rows (of the dropped data files) past which one run stops taking more partitions; the rest
/// wait for the next run. The keys of dropped rows are held in memory while the index batch is
/// built. One partition is always taken.
const MAX_ROWS_PER_RUN: i64 = 2_000_000;

/// When partitions expire.
#[derive(Debug, Clone, Copy)]
pub struct RetentionPolicy {
    pub expiration_ms: i64,
    pub strategy: PartitionExpirationStrategy,
}

/// What one retention run did to one table.
#[derive(Debug, Default, Clone)]
pub struct Retained {
    /// The `delete` snapshot, if one was committed.
    pub snapshot_id: Option<i64>,
    /// Directories (below `data/`) of the partitions whose files were dropped.
    pub partitions: Vec<String>,
    pub data_files: usize,
    pub delete_files: usize,
    /// Rows of the dropped data files, deleted ones included.
    pub rows: i64,
    /// Rows written to a partition after it had expired by its values' time.
    pub late_rows: i64,
    /// Expired partitions left for the next run.
    pub backlog: usize,
}

/// A partition's time for `strategy`: the end of its values' range, or the newest time a
/// snapshot added one of its files (a file whose snapshot has been expired is older than the
/// oldest kept snapshot, whose time stands in for it).
fn partition_time(
    p: &Partition,
    strategy: PartitionExpirationStrategy,
    snapshot_ms: &HashMap<i64, i64>,
    oldest_ms: i64,
) -> i64 {
    match strategy {
        PartitionExpirationStrategy::ValuesTime => p.range_ms.1,
        PartitionExpirationStrategy::UpdateTime => p
            .files
            .iter()
            .map(|e| {
                e.snapshot_id
                    .and_then(|id| snapshot_ms.get(&id).copied())
                    .unwrap_or(oldest_ms)
            })
            .max()
            .unwrap_or(oldest_ms),
    }
}

fn snapshot_times(meta: &TableMetadata) -> (HashMap<i64, i64>, i64) {
    let times: HashMap<i64, i64> = meta
        .snapshots
        .iter()
        .map(|s| (s.snapshot_id, s.timestamp_ms))
        .collect();
    let oldest = times.values().copied().min().unwrap_or(0);
    (times, oldest)
}

/// Whether a manifest may hold a partition expired at `now_ms`, as far as its bounds tell.
fn may_expire(
    meta: &TableMetadata,
    field: &TimeField,
    policy: &RetentionPolicy,
    m: &inlet_iceberg::manifest::ManifestFile,
    now_ms: i64,
) -> bool {
    policy.strategy != PartitionExpirationStrategy::ValuesTime
        || field
            .manifest_ends(meta, m)
            .is_none_or(|(first, _)| first.saturating_add(policy.expiration_ms) <= now_ms)
}

/// The live entries of `table` when some partition has expired at `now_ms` (all of them, as
/// an upsert shard's index needs the deletes elsewhere), else none; only manifest bounds are
/// read to tell.
async fn entries_if_expired(
    table: &Table,
    field: &TimeField,
    policy: &RetentionPolicy,
    now_ms: i64,
) -> Result<Vec<ManifestEntry>> {
    let meta = &table.metadata;
    let candidates = table
        .live_entries_in(|m| may_expire(meta, field, policy, m, now_ms))
        .await?;
    if expired(meta, field, &candidates, policy, now_ms)?.is_empty() {
        return Ok(Vec::new());
    }
    table.live_entries().await
}

/// The partitions of `entries` expired at `now_ms`, oldest first.
pub fn expired(
    meta: &TableMetadata,
    field: &TimeField,
    entries: &[ManifestEntry],
    policy: &RetentionPolicy,
    now_ms: i64,
) -> Result<Vec<Partition>> {
    let (times, oldest) = snapshot_times(meta);
    let mut out: Vec<(i64, Partition)> = partitions(meta, field, entries)?
        .into_values()
        .map(|p| (partition_time(&p, policy.strategy, &times, oldest), p))
        .filter(|(t, _)| t.saturating_add(policy.expiration_ms) <= now_ms)
        .collect();
    out.sort_by_key(|(t, p)| (*t, p.path.clone()));
    Ok(out.into_iter().map(|(_, p)| p).collect())
}

/// Rows of `files` written after their partition had expired by its values' time.
fn late_rows(
    meta: &TableMetadata,
    p: &Partition,
    files: &[&DataFile],
    policy: &RetentionPolicy,
) -> i64 {
    if policy.strategy != PartitionExpirationStrategy::ValuesTime {
        return 0;
    }
    let (times, _) = snapshot_times(meta);
    let expired_at = p.range_ms.1.saturating_add(policy.expiration_ms);
    p.files
        .iter()
        .filter(|e| files.iter().any(|f| f.file_path == e.data_file.file_path))
        .filter(|e| {
            e.snapshot_id
                .and_then(|id| times.get(&id))
                .is_some_and(|t| *t > expired_at)
        })
        .map(|e| e.data_file.record_count)
        .sum()
}

/// Counts a run that committed.
fn record(done: &Retained) {
    let m = crate::metrics::metrics();
    m.partitions_expired.inc_by(done.partitions.len() as u64);
    m.partition_rows_dropped.inc_by(done.rows.max(0) as u64);
    m.late_rows
        .with_label_values(&["expired"])
        .inc_by(done.late_rows.max(0) as u64);
}

/// Removes the `_SUCCESS` markers of partitions that no longer hold any file.
async fn clear_markers(table: &Table, emptied: &[String]) -> Result<()> {
    for path in emptied {
        table
            .io
            .delete(&super::done::success_uri(table, path))
            .await?;
    }
    Ok(())
}

/// One shard's part of a retention: the files it drops and its index batch.
struct ShardDrop {
    shard: u32,
    source: (String, i32),
    batch: IndexBatch,
}

/// A retention of an upsert table's shards, planned and waiting for its commit.
pub struct Staged {
    drops: Vec<ShardDrop>,
    removed: Vec<DataFile>,
    /// The partitions taken, as their directories and whether every file of theirs goes.
    taken: Vec<(String, bool)>,
    done: Retained,
}

/// Upsert tables: plans, for each shard of `upsert`, the drop of its own files of the
/// partitions expired at `now_ms` and the index batch that forgets them. `None`: nothing to
/// drop. Nothing is saved or committed yet, so an error here only skips this run.
pub async fn stage_shards(
    table: &Table,
    upsert: &mut UpsertSink,
    field: &TimeField,
    policy: &RetentionPolicy,
    now_ms: i64,
) -> Result<Option<Staged>> {
    let entries = entries_if_expired(table, field, policy, now_ms).await?;
    let expired = expired(&table.metadata, field, &entries, policy, now_ms)?;
    if expired.is_empty() {
        return Ok(None);
    }
    let spec = upsert.spec.clone();
    let mut done = Retained::default();
    let mut drops: Vec<ShardDrop> = Vec::new();
    let mut removed: Vec<DataFile> = Vec::new();
    let mut taken: Vec<&Partition> = Vec::new();
    let mut rows = 0;
    for p in &expired {
        if !taken.is_empty() && rows >= MAX_ROWS_PER_RUN {
            done.backlog += 1;
            continue;
        }
        taken.push(p);
        rows += p.rows();
    }
    for (source, shard) in upsert.shards_mut() {
        let mut data: HashSet<String> = HashSet::new();
        let mut files: Vec<DataFile> = Vec::new();
        for p in &taken {
            let own: Vec<&DataFile> = p
                .files
                .iter()
                .map(|e| &e.data_file)
                .filter(|f| {
                    f.content == FileContent::Data && file_shard(&f.file_path) == Some(shard.id)
                })
                .collect();
            done.late_rows += late_rows(&table.metadata, p, &own, policy);
            for f in own {
                data.insert(f.file_path.clone());
                files.push(f.clone());
            }
        }
        if data.is_empty() {
            continue;
        }
        for p in &taken {
            files.extend(
                p.files
                    .iter()
                    .map(|e| &e.data_file)
                    .filter(|f| {
                        f.content != FileContent::Data
                            && match names(f) {
                                // Its partition is dropped with all the shard's files in it.
                                Names::ShardFiles(s) => s == shard.id,
                                Names::File(t) => data.contains(t),
                                Names::Any => false,
                            }
                    })
                    .cloned(),
            );
        }
        let forgotten = crate::rebuild::forget_files(shard, &spec, table, &entries, &data).await?;
        tracing::debug!(
            shard = shard.id,
            files = files.len(),
            tombstones = forgotten.tombstones,
            keys = forgotten.removed,
            "Partition retention: the shard's index forgets its dropped files"
        );
        drops.push(ShardDrop {
            shard: shard.id,
            source: source.clone(),
            batch: forgotten.batch,
        });
        removed.extend(files);
    }
    let foreign = taken
        .iter()
        .flat_map(|p| &p.files)
        .filter(|e| {
            e.data_file.content == FileContent::Data && file_shard(&e.data_file.file_path).is_none()
        })
        .count();
    if foreign > 0 {
        tracing::warn!(
            table = %format!("{}.{}", table.namespace, table.name),
            files = foreign,
            "Expired partitions hold data files another engine wrote; partition retention leaves them"
        );
    }
    if drops.is_empty() {
        return Ok(None);
    }
    let gone: HashSet<&str> = removed.iter().map(|f| f.file_path.as_str()).collect();
    let taken = taken
        .iter()
        .filter(|p| {
            p.files
                .iter()
                .any(|e| gone.contains(e.data_file.file_path.as_str()))
        })
        .map(|p| {
            let all = p
                .files
                .iter()
                .all(|e| gone.contains(e.data_file.file_path.as_str()));
            (p.path.clone(), all)
        })
        .collect();
    Ok(Some(Staged {
        drops,
        removed,
        taken,
        done,
    }))
}

/// Commits a staged retention as checkpoint `checkpoint` of `committer`'s writer, fenced by
/// `fence` and `epochs` like a compaction: each shard's batch is saved beside its index first
/// and applied once the `delete` snapshot landed. An error means the commit's outcome is
/// unknown: the pipeline must restart so that recovery applies the saved batches iff the
/// snapshot landed.
pub async fn commit_shards(
    staged: Staged,
    table: &mut Table,
    upsert: &mut UpsertSink,
    committer: &Committer,
    checkpoint: u64,
    fence: &Offsets,
    epochs: &Epochs,
) -> Result<Retained> {
    let Staged {
        mut drops,
        removed,
        taken,
        mut done,
    } = staged;
    for (_, shard) in upsert.shards_mut() {
        if let Some(d) = drops.iter().find(|d| d.shard == shard.id) {
            shard.save_pending(&committer.writer_id, checkpoint, &d.batch)?;
        }
    }
    inlet_common::failpoint::crash_point("retain_after_save");
    let expected: Vec<Fence> = drops
        .iter()
        .map(|d| {
            let (topic, p) = &d.source;
            let at = fence.get(topic).and_then(|o| o.get(p)).copied();
            let epoch = epochs.get(topic).and_then(|o| o.get(p)).copied();
            (d.source.clone(), at, epoch.unwrap_or(0))
        })
        .collect();
    let landed = commit_rewrite(
        table,
        committer,
        &Operation {
            name: "delete",
            service: crate::metrics::service::EXPIRE_PARTITIONS,
        },
        checkpoint,
        &expected,
        &[],
        &[],
        &removed,
    )
    .await?;
    inlet_common::failpoint::crash_point("retain_after_commit");
    let Some(snapshot) = landed else {
        // Definitely not committed: forget the batches; the next run tries again.
        for (_, shard) in upsert.shards_mut() {
            if drops.iter().any(|d| d.shard == shard.id) {
                shard.drop_saved()?;
            }
        }
        return Ok(Retained {
            backlog: done.backlog + taken.len(),
            ..Retained::default()
        });
    };
    for (_, shard) in upsert.shards_mut() {
        if let Some(i) = drops.iter().position(|d| d.shard == shard.id) {
            let d = drops.swap_remove(i);
            shard.apply_committed(d.batch, snapshot)?;
        }
    }
    // The shards it left alone are level with it too.
    upsert.advance_idle(&table.metadata, &committer.pipeline_id, snapshot)?;
    let emptied: Vec<String> = taken
        .iter()
        .filter(|(_, all)| *all)
        .map(|(path, _)| path.clone())
        .collect();
    done.partitions = taken.into_iter().map(|(path, _)| path).collect();
    done.snapshot_id = Some(snapshot.snapshot_id);
    done.data_files = removed
        .iter()
        .filter(|f| f.content == FileContent::Data)
        .count();
    done.delete_files = removed.len() - done.data_files;
    done.rows = removed
        .iter()
        .filter(|f| f.content == FileContent::Data)
        .map(|f| f.record_count)
        .sum();
    record(&done);
    clear_markers(table, &emptied).await?;
    Ok(done)
}

/// Changelog tables, and `inlet maintain` on any table: drops every file of the partitions
/// expired at `now_ms` in one `delete` snapshot carrying the pipeline's offsets. On an upsert
/// table the shards' indexes do not hear of it now: each replays the drop when next opened (a
/// running pipeline's next checkpoint touching such a shard fails and brings it level first).
/// With `dry_run`, reports what it would drop.
pub async fn retain_whole(
    table: &mut Table,
    committer: &Committer,
    checkpoint: u64,
    field: &TimeField,
    policy: &RetentionPolicy,
    now_ms: i64,
    dry_run: bool,
) -> Result<Retained> {
    let entries = entries_if_expired(table, field, policy, now_ms).await?;
    let expired = expired(&table.metadata, field, &entries, policy, now_ms)?;
    let mut done = Retained::default();
    let mut removed: Vec<DataFile> = Vec::new();
    for p in &expired {
        if !done.partitions.is_empty() && done.rows >= MAX_ROWS_PER_RUN {
            done.backlog += 1;
            continue;
        }
        let files: Vec<&DataFile> = p.files.iter().map(|e| &e.data_file).collect();
        done.late_rows += late_rows(&table.metadata, p, &files, policy);
        done.rows += p.rows();
        done.partitions.push(p.path.clone());
        removed.extend(files.into_iter().cloned());
    }
    done.data_files = removed
        .iter()
        .filter(|f| f.content == FileContent::Data)
        .count();
    done.delete_files = removed.len() - done.data_files;
    if removed.is_empty() || dry_run {
        return Ok(done);
    }
    let landed = commit_rewrite(
        table,
        committer,
        &Operation {
            name: "delete",
            service: crate::metrics::service::EXPIRE_PARTITIONS,
        },
        checkpoint,
        &[],
        &[],
        &[],
        &removed,
    )
    .await?;
    inlet_common::failpoint::crash_point("retain_after_commit");
    let Some(snapshot) = landed else {
        return Ok(Retained {
            backlog: done.backlog + done.partitions.len(),
            ..Retained::default()
        });
    };
    done.snapshot_id = Some(snapshot.snapshot_id);
    record(&done);
    clear_markers(table, &done.partitions).await?;
    Ok(done)
}
