//! Catch-up replay: an index whose marker names a snapshot still in the table's history takes
//! the changes of the later snapshots instead of a full rebuild. Each later snapshot of the
//! pipeline is applied as one batch carrying that snapshot's marker, so a replay cut short
//! resumes where it stopped.
//!
//! Within a snapshot, position deletes go first: the deleted row's key becomes a tombstone with
//! the deleted row's version unless a newer live entry holds it. Then the rows of the data files
//! the shard added become the key's live entry unless one at least as new exists, as the
//! rebuild decides between two live rows. The pipeline's own compactions and partition
//! retentions replay as what they did to the index. Another snapshot that removed one of the
//! shard's files (a rewrite), or that another writer made with the shard's files, cannot be
//! replayed; nor can deletes of a file the index does not know. The caller then rebuilds.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{bucket_of, DeletedAt, ShardReader};
use crate::upsert::{Shard, UpsertSpec};
use inlet_common::error::{Error, Result};
use inlet_iceberg::keys::SUMMARY_PIPELINE;
use inlet_iceberg::manifest::{DataFile, FileContent};
use inlet_iceberg::metadata::Snapshot;
use inlet_iceberg::scan::read_position_deletes;
use inlet_iceberg::types::encode_values;
use inlet_iceberg::Table;
use inlet_index::{IndexBatch, IndexEntry, KeyIndex, Marker, RowLocation};

/// What a replay did.
pub(super) struct Replayed {
    /// Snapshots of the pipeline applied.
    pub snapshots: usize,
    /// Key entries written.
    pub keys: u64,
}

/// Replays into the shard's index every snapshot after `marker`, oldest first. An error means
/// the index cannot catch up this way; what was applied before it is consistent.
pub(super) async fn catch_up(
    shard: &mut Shard,
    spec: &UpsertSpec,
    table: &Table,
    pipeline: &str,
    marker: Marker,
) -> Result<Replayed> {
    let lineage: Vec<&Snapshot> = table.metadata.lineage().collect();
    let at = lineage
        .iter()
        .position(|s| {
            s.snapshot_id == marker.snapshot_id && s.sequence_number == marker.sequence_number
        })
        .ok_or_else(|| {
            Error::metadata(format!(
                "snapshot {} of the index marker is not in the table's history",
                marker.snapshot_id
            ))
        })?;
    let later: Vec<&Snapshot> = lineage[..at].iter().rev().copied().collect();
    tracing::info!(
        shard = shard.id,
        marker = marker.snapshot_id,
        snapshots = later.len(),
        "Index is behind the table; replaying the snapshots after its marker"
    );
    let reader = ShardReader::new(shard.id, spec, table)?;
    let mut layout = Layout::read(shard.index())?;
    let mut done = Replayed {
        snapshots: 0,
        keys: 0,
    };
    for snapshot in later {
        let (added, removed) = table.changes_of(snapshot).await?;
        let ours = snapshot.summary.get(SUMMARY_PIPELINE).map(String::as_str) == Some(pipeline);
        if ours && snapshot.summary.get("operation").map(String::as_str) == Some("replace") {
            // The pipeline's own compaction: rows moved, nothing changed.
            let batch =
                replay_replace(shard, &reader, &mut layout, snapshot, &added, &removed).await?;
            done.snapshots += 1;
            done.keys += batch.entries.len() as u64;
            shard.apply_batch(batch)?;
            continue;
        }
        if ours
            && snapshot
                .summary
                .get(inlet_iceberg::keys::SUMMARY_MAINTENANCE)
                .map(String::as_str)
                == Some(crate::metrics::service::EXPIRE_PARTITIONS)
        {
            // The pipeline's partition retention: the shard forgets its dropped files as the
            // retention itself did, against the table as it was before.
            let batch = replay_drop(shard, spec, table, &reader, snapshot, &removed).await?;
            done.snapshots += 1;
            done.keys += (batch.entries.len() + batch.removed.len()) as u64;
            shard.apply_batch(batch)?;
            // Its files and bucket counts changed under the replay's copy.
            layout = Layout::read(shard.index())?;
            continue;
        }
        if let Some(f) = removed.iter().find(|f| touches(&reader, f)) {
            return Err(Error::metadata(format!(
                "snapshot {} removed {}, a file of this shard",
                snapshot.snapshot_id, f.file_path
            )));
        }
        if snapshot.summary.get(SUMMARY_PIPELINE).map(String::as_str) != Some(pipeline) {
            if let Some(f) = added.iter().find(|f| touches(&reader, f)) {
                return Err(Error::metadata(format!(
                    "snapshot {} of another writer added {}, a file of this shard",
                    snapshot.snapshot_id, f.file_path
                )));
            }
            // Nothing of this shard's: the index is level with this snapshot too.
            shard.apply_batch(IndexBatch {
                marker: Some(Marker {
                    snapshot_id: snapshot.snapshot_id,
                    sequence_number: snapshot.sequence_number,
                }),
                ..IndexBatch::default()
            })?;
            continue;
        }
        let batch = replay(shard, &reader, &mut layout, snapshot, &added).await?;
        done.snapshots += 1;
        done.keys += batch.entries.len() as u64;
        shard.apply_batch(batch)?;
    }
    Ok(done)
}

/// Whether a file is a data file the shard's index takes rows of (its own or another
/// engine's), or deletes rows of one. A delete file whose target is not known from its bounds
/// counts as touching.
fn touches(reader: &ShardReader, f: &DataFile) -> bool {
    crate::write::touches_shard(reader.shard, f)
}

/// What the replay keeps of the index's small tables while it adds to them.
struct Layout {
    partitions: HashMap<Vec<u8>, u32>,
    next_partition: u32,
    files: HashMap<String, u64>,
    next_file_id: u64,
    buckets: HashMap<(u32, u32), u64>,
}

impl Layout {
    fn read(index: &dyn KeyIndex) -> Result<Layout> {
        let partitions: HashMap<Vec<u8>, u32> = index
            .partitions()?
            .into_iter()
            .map(|(id, bytes)| (bytes, id))
            .collect();
        Ok(Layout {
            next_partition: partitions.values().max().map_or(0, |m| m + 1),
            partitions,
            files: index
                .files()?
                .into_iter()
                .map(|(id, path)| (path, id))
                .collect(),
            next_file_id: index.max_file_id()?.map_or(1, |m| m + 1),
            buckets: index.bucket_counts()?.into_iter().collect(),
        })
    }

    /// Moves one live row out of (`-1`) or into (`+1`) its bucket.
    fn count(&mut self, at: RowLocation, delta: i64, touched: &mut BTreeSet<(u32, u32)>) {
        let key = (at.partition_id, at.bucket);
        let n = self.buckets.entry(key).or_default();
        *n = n.saturating_add_signed(delta);
        touched.insert(key);
    }
}

/// The entry of `key`: as this snapshot changed it so far, else as the index has it.
fn current(
    index: &dyn KeyIndex,
    changed: &BTreeMap<Vec<u8>, IndexEntry>,
    key: &[u8],
) -> Result<Option<IndexEntry>> {
    match changed.get(key) {
        Some(e) => Ok(Some(e.clone())),
        None => index.get(key),
    }
}

/// The index batch of one of the pipeline's partition retentions (`maintain::retention`): the
/// shard's dropped data files are forgotten as [`super::forget_files`] decides against the
/// table of the snapshot before it. A retention that dropped nothing of the shard's only moves
/// the marker.
async fn replay_drop(
    shard: &mut Shard,
    spec: &UpsertSpec,
    table: &Table,
    reader: &ShardReader<'_>,
    snapshot: &Snapshot,
    removed: &[DataFile],
) -> Result<IndexBatch> {
    let marker = Some(Marker {
        snapshot_id: snapshot.snapshot_id,
        sequence_number: snapshot.sequence_number,
    });
    let dropped: std::collections::HashSet<String> = removed
        .iter()
        .filter(|f| f.content == FileContent::Data && reader.owns(&f.file_path))
        .map(|f| f.file_path.clone())
        .collect();
    if dropped.is_empty() {
        return Ok(IndexBatch {
            marker,
            ..IndexBatch::default()
        });
    }
    let parent = snapshot
        .parent_snapshot_id
        .and_then(|id| {
            table
                .metadata
                .snapshots
                .iter()
                .find(|s| s.snapshot_id == id)
        })
        .ok_or_else(|| {
            Error::metadata(format!(
                "the snapshot before retention snapshot {} is gone",
                snapshot.snapshot_id
            ))
        })?;
    let entries = table.entries_of(parent, |_| true).await?;
    let mut batch = super::forget_files(shard, spec, table, &entries, &dropped)
        .await?
        .batch;
    batch.marker = marker;
    Ok(batch)
}

/// The index batch of one of the pipeline's compactions (`maintain::compact`): the shard's
/// removed files are forgotten, and each live row of its rewritten files is where the index
/// placed it in a removed file; rows deleted again in the new files are tombstones the index
/// holds already. Anything else is an error, and the index is rebuilt.
async fn replay_replace(
    shard: &mut Shard,
    reader: &ShardReader<'_>,
    layout: &mut Layout,
    snapshot: &Snapshot,
    added: &[DataFile],
    removed: &[DataFile],
) -> Result<IndexBatch> {
    let mut batch = IndexBatch {
        marker: Some(Marker {
            snapshot_id: snapshot.snapshot_id,
            sequence_number: snapshot.sequence_number,
        }),
        ..IndexBatch::default()
    };
    let unknown = |path: &str| {
        Error::metadata(format!(
            "compaction snapshot {} removed {path}, a file the index does not know",
            snapshot.snapshot_id
        ))
    };
    let mut gone = std::collections::HashSet::new();
    for f in removed
        .iter()
        .filter(|f| f.content == FileContent::Data && reader.owns(&f.file_path))
    {
        let id = *layout
            .files
            .get(&f.file_path)
            .ok_or_else(|| unknown(&f.file_path))?;
        gone.insert(id);
        batch.removed_files.push(id);
    }
    let mut ghosts: BTreeSet<(String, i64)> = BTreeSet::new();
    for f in added
        .iter()
        .filter(|f| f.content == FileContent::PositionDeletes && reader.owns_deletes_of(f))
    {
        for d in read_position_deletes(reader.table.io.get(&f.file_path).await?)? {
            ghosts.extend(d.rows().map(|(pos, _)| (d.path.clone(), pos)));
        }
    }
    let mut changed: BTreeMap<Vec<u8>, IndexEntry> = BTreeMap::new();
    for f in added
        .iter()
        .filter(|f| f.content == FileContent::Data && reader.owns(&f.file_path))
    {
        let file_id = layout.next_file_id;
        layout.next_file_id += 1;
        layout.files.insert(f.file_path.clone(), file_id);
        batch.files.push((file_id, f.file_path.clone()));
        for (pos, row) in reader.rows(&f.file_path).await?.into_iter().enumerate() {
            if ghosts.contains(&(f.file_path.clone(), pos as i64)) {
                continue;
            }
            let mut entry = current(shard.index(), &changed, &row.key)?.ok_or_else(|| {
                Error::metadata(format!(
                    "compaction snapshot {} moved a key the index does not know",
                    snapshot.snapshot_id
                ))
            })?;
            let at = entry
                .location
                .filter(|at| gone.contains(&at.file_id))
                .ok_or_else(|| {
                    Error::metadata(format!(
                        "compaction snapshot {} moved a row the index does not place in a file it removed",
                        snapshot.snapshot_id
                    ))
                })?;
            entry.location = Some(RowLocation {
                file_id,
                position: pos as u64,
                ..at
            });
            changed.insert(row.key, entry);
        }
    }
    batch.entries = changed.into_iter().collect();
    Ok(batch)
}

/// The index batch that brings the shard's index from the snapshot before `snapshot` to it.
// `shard` is taken mutably only so that the future stays `Send`: the index is not `Sync`.
async fn replay(
    shard: &mut Shard,
    reader: &ShardReader<'_>,
    layout: &mut Layout,
    snapshot: &Snapshot,
    added: &[DataFile],
) -> Result<IndexBatch> {
    let mut batch = IndexBatch {
        marker: Some(Marker {
            snapshot_id: snapshot.snapshot_id,
            sequence_number: snapshot.sequence_number,
        }),
        ..IndexBatch::default()
    };
    let mut changed: BTreeMap<Vec<u8>, IndexEntry> = BTreeMap::new();
    let mut touched = BTreeSet::new();

    let mut deleted: BTreeMap<String, Vec<DeletedAt>> = BTreeMap::new();
    for f in added
        .iter()
        .filter(|f| f.content == FileContent::PositionDeletes)
    {
        if !reader.reads_deletes_of(f) {
            continue;
        }
        for d in read_position_deletes(reader.table.io.get(&f.file_path).await?)? {
            if reader.reads(&d.path) {
                deleted
                    .entry(d.path.clone())
                    .or_default()
                    .extend(d.owned_rows());
            }
        }
    }
    // Rows of data files this snapshot adds and deletes at once (a delete's record when its key
    // had no committed row) are taken with their files below.
    let mut added_deleted: HashMap<String, HashMap<i64, Vec<u8>>> = HashMap::new();
    for (path, positions) in deleted {
        if !layout.files.contains_key(&path) {
            if added
                .iter()
                .any(|f| f.content == FileContent::Data && f.file_path == path)
            {
                let rows = added_deleted.entry(path).or_default();
                for (pos, version) in positions {
                    rows.insert(pos, version.unwrap_or_default());
                }
                continue;
            }
            return Err(Error::metadata(format!(
                "snapshot {} deletes rows of {path}, a file the index does not know",
                snapshot.snapshot_id
            )));
        }
        let rows = reader.rows(&path).await?;
        for (pos, by) in positions {
            let row = usize::try_from(pos)
                .ok()
                .and_then(|p| rows.get(p))
                .ok_or_else(|| {
                    Error::metadata(format!(
                        "snapshot {} deletes row {pos} of {path}, which has {} rows",
                        snapshot.snapshot_id,
                        rows.len()
                    ))
                })?;
            let old = current(shard.index(), &changed, &row.key)?;
            if old
                .as_ref()
                .is_some_and(|e| e.location.is_some() && e.version > row.version)
            {
                continue;
            }
            // The newer of the deleted row's version and its delete's.
            let mut version = row.version.clone().max(by.unwrap_or_default());
            if let Some(old) = old {
                if let Some(at) = old.location {
                    layout.count(at, -1, &mut touched);
                }
                version = version.max(old.version);
            }
            changed.insert(
                row.key.clone(),
                IndexEntry {
                    version,
                    location: None,
                    row: None,
                    written_at_secs: reader.now_secs,
                },
            );
        }
    }

    for f in added
        .iter()
        .filter(|f| f.content == FileContent::Data && reader.owns(&f.file_path))
    {
        let file_id = layout.next_file_id;
        layout.next_file_id += 1;
        layout.files.insert(f.file_path.clone(), file_id);
        batch.files.push((file_id, f.file_path.clone()));
        let values = encode_values(&f.partition);
        let partition_id = match layout.partitions.get(&values) {
            Some(id) => *id,
            None => {
                let id = layout.next_partition;
                layout.next_partition += 1;
                layout.partitions.insert(values.clone(), id);
                batch.partitions.push((id, values));
                id
            }
        };
        let bucket = bucket_of(&f.file_path)?;
        let gone = added_deleted.remove(&f.file_path).unwrap_or_default();
        for (pos, row) in reader.rows(&f.file_path).await?.into_iter().enumerate() {
            let old = current(shard.index(), &changed, &row.key)?;
            if let Some(by) = gone.get(&(pos as i64)) {
                // Written and deleted at once: a tombstone unless the key is live.
                if old.as_ref().is_some_and(|e| e.location.is_some()) {
                    continue;
                }
                let mut version = row.version.max(by.clone());
                if let Some(old) = old {
                    version = version.max(old.version);
                }
                changed.insert(
                    row.key,
                    IndexEntry {
                        version,
                        location: None,
                        row: None,
                        written_at_secs: reader.now_secs,
                    },
                );
                continue;
            }
            if let Some(old) = old {
                if let Some(at) = old.location {
                    if old.version >= row.version {
                        tracing::error!(
                            file = %f.file_path,
                            position = pos,
                            "Key is live twice in the table; keeping the row with the newer version"
                        );
                        continue;
                    }
                    layout.count(at, -1, &mut touched);
                }
            }
            let at = RowLocation {
                partition_id,
                bucket,
                file_id,
                position: pos as u64,
            };
            layout.count(at, 1, &mut touched);
            changed.insert(
                row.key,
                IndexEntry {
                    version: row.version,
                    location: Some(at),
                    row: row.row,
                    written_at_secs: reader.now_secs,
                },
            );
        }
    }

    batch.entries = changed.into_iter().collect();
    batch.bucket_counts = touched
        .into_iter()
        .map(|key| (key, layout.buckets.get(&key).copied().unwrap_or(0)))
        .collect();
    Ok(batch)
}
