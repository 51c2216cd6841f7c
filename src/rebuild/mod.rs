//! Bringing a shard's index level with the table when a partition is assigned: a batch saved
//! before a commit whose outcome was never learned is applied if the commit landed; an index
//! that is missing, behind or from elsewhere is rebuilt from the shard's files (live rows, and
//! the versions of deleted rows as tombstones), sorted and bulk-loaded as SST files.
//!
//! A tombstone rebuilt this way carries the version of the key's last row, not of the delete
//! itself; a re-sent change whose version falls strictly between the two would be applied. Re-sends
//! of changes the stream already carried never do.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use crate::commit::SUMMARY_WRITER;
use crate::error::{Error, ErrorKind, Result};
use crate::index::{IndexBatch, IndexEntry, Marker, RowLocation};
use crate::table::manifest::FileContent;
use crate::table::metadata::{Snapshot, TableMetadata};
use crate::table::scan::{read_columns, read_position_deletes};
use crate::table::types::{encode_values, Type, Value};
use crate::table::Table;
use crate::upsert::{shard_file_prefix, Shard, UpsertSpec};
use crate::write::deletes::FILE_PATH_ID;

/// The offset the snapshot records for a partition.
fn offset_in(snapshot: &Snapshot, topic: &str, partition: i32) -> Result<Option<i64>> {
    Ok(snapshot
        .offsets()?
        .get(topic)
        .and_then(|m| m.get(&partition))
        .copied())
}

/// Whether an index at `marker` holds every change the table holds for the partition.
fn is_current(
    meta: &TableMetadata,
    pipeline: &str,
    marker: Option<Marker>,
    topic: &str,
    partition: i32,
) -> Result<bool> {
    let latest = match meta.last_snapshot_of(pipeline) {
        Some(s) => offset_in(s, topic, partition)?,
        None => None,
    };
    match marker {
        None => Ok(latest.is_none()),
        Some(m) => match meta
            .snapshots
            .iter()
            .find(|s| s.snapshot_id == m.snapshot_id)
        {
            Some(s) => Ok(offset_in(s, topic, partition)? == latest),
            None => Ok(false),
        },
    }
}

/// Makes the shard's index equal to the table. Returns how many keys a rebuild loaded, if one ran.
pub async fn recover(
    shard: &mut Shard,
    spec: &UpsertSpec,
    table: &Table,
    pipeline: &str,
    topic: &str,
    partition: i32,
) -> Result<Option<u64>> {
    let meta = &table.metadata;
    if let Some((writer, checkpoint, batch)) = shard.take_saved()? {
        let landed = meta.lineage().find(|s| {
            s.summary.get(SUMMARY_WRITER) == Some(&writer) && s.checkpoint_id() == Some(checkpoint)
        });
        match landed {
            Some(s) => {
                tracing::info!(
                    topic,
                    partition,
                    snapshot_id = s.snapshot_id,
                    "Applying the index batch of a commit that landed before a crash"
                );
                let marker = Marker {
                    snapshot_id: s.snapshot_id,
                    sequence_number: s.sequence_number,
                };
                shard.apply_committed(batch, marker)?;
                // The batch allocated file and partition ids this shard's memory has not seen.
                shard.discard()?;
            }
            None => shard.drop_saved()?,
        }
    }
    if is_current(meta, pipeline, shard.marker()?, topic, partition)? {
        return Ok(None);
    }
    tracing::warn!(
        topic,
        partition,
        "Index is missing or behind the table; rebuilding it from the table"
    );
    let loaded = rebuild(shard, spec, table, pipeline).await?;
    Ok(Some(loaded))
}

/// Rebuilds the shard's index from its live rows in the table.
pub async fn rebuild(
    shard: &mut Shard,
    spec: &UpsertSpec,
    table: &Table,
    pipeline: &str,
) -> Result<u64> {
    let started = Instant::now();
    let meta = &table.metadata;
    let schema = meta.current_schema()?;
    let prefix = format!("{}-", shard_file_prefix(shard.id));
    let entries = table.live_entries().await?;
    let is_shard_file = |path: &str| {
        path.rsplit('/')
            .next()
            .is_some_and(|name| name.starts_with(&prefix))
    };
    let data: Vec<_> = entries
        .iter()
        .filter(|e| {
            e.data_file.content == FileContent::Data && is_shard_file(&e.data_file.file_path)
        })
        .collect();
    let mut deleted: HashSet<(String, i64)> = HashSet::new();
    for e in entries
        .iter()
        .filter(|e| e.data_file.content == FileContent::PositionDeletes)
    {
        let target = e
            .data_file
            .lower_bounds
            .get(&FILE_PATH_ID)
            .and_then(|b| String::from_utf8(b.clone()).ok());
        // A delete file naming one data file of another shard is skipped unread.
        if target.as_deref().is_some_and(|t| !is_shard_file(t)) {
            continue;
        }
        let bytes = table.io.get(&e.data_file.file_path).await?;
        deleted.extend(read_position_deletes(bytes)?);
    }

    let user_columns: Vec<(String, Type)> = schema
        .fields
        .iter()
        .filter(|f| f.name != "_version")
        .map(|f| Ok((f.name.clone(), f.primitive()?)))
        .collect::<Result<_>>()?;
    let mut wanted: Vec<(&str, Type)> = if spec.stores_rows() {
        user_columns.iter().map(|(n, t)| (n.as_str(), *t)).collect()
    } else {
        spec.key_columns
            .iter()
            .map(|i| (user_columns[*i].0.as_str(), user_columns[*i].1))
            .collect()
    };
    wanted.push(("_version", Type::Binary));
    let key_at: Vec<usize> = if spec.stores_rows() {
        spec.key_columns.clone()
    } else {
        (0..spec.key_columns.len()).collect()
    };

    let mut partitions: HashMap<Vec<u8>, u32> = HashMap::new();
    let mut files = Vec::new();
    let mut buckets: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    let mut keys: BTreeMap<Vec<u8>, IndexEntry> = BTreeMap::new();
    // Deleted rows stay in their files: the newest version of a key with no live row becomes
    // its tombstone, so re-sent older changes of deleted keys stay dropped after a rebuild.
    let mut dead: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for (n, e) in data.iter().enumerate() {
        let file_id = n as u64 + 1;
        let path = &e.data_file.file_path;
        files.push((file_id, path.clone()));
        let pbytes = encode_values(&e.data_file.partition);
        let next_id = partitions.len() as u32;
        let pid = *partitions.entry(pbytes).or_insert(next_id);
        let bucket = path
            .rsplit('/')
            .nth(1)
            .and_then(|dir| dir.strip_prefix("bucket-"))
            .and_then(|b| b.parse::<u32>().ok())
            .ok_or_else(|| {
                Error::metadata(format!("data file {path} is not in a bucket-N directory"))
            })?;
        let rows = read_columns(table.io.get(path).await?, &wanted)?;
        for (pos, mut row) in rows.into_iter().enumerate() {
            let Some(Value::Binary(version)) = row.pop() else {
                return Err(Error::metadata(format!(
                    "row {pos} of {path} has no _version"
                )));
            };
            let key = encode_values(key_at.iter().map(|i| &row[*i]));
            if deleted.contains(&(path.clone(), pos as i64)) {
                let newest = dead.entry(key).or_default();
                if version > *newest {
                    *newest = version;
                }
                continue;
            }
            let entry = IndexEntry {
                version,
                location: Some(RowLocation {
                    partition_id: pid,
                    bucket,
                    file_id,
                    position: pos as u64,
                }),
                row: spec.stores_rows().then(|| encode_values(&row)),
                written_at_secs: now,
            };
            if let Some(old) = keys.get(&key) {
                tracing::error!(file = %path, position = pos, "Key is live twice in the table; keeping the newer version");
                if old.version >= entry.version {
                    continue;
                }
            }
            *buckets.entry((pid, bucket)).or_default() += 1;
            keys.insert(key, entry);
        }
        if (n + 1) % 16 == 0 {
            let secs = started.elapsed().as_secs_f64().max(0.001);
            tracing::info!(
                shard = shard.id,
                files_done = n + 1,
                files = data.len(),
                keys = keys.len(),
                keys_per_s = (keys.len() as f64 / secs) as u64,
                "Rebuilding index"
            );
        }
    }
    for (key, version) in dead {
        keys.entry(key).or_insert(IndexEntry {
            version,
            location: None,
            row: None,
            written_at_secs: now,
        });
    }
    let marker = meta.last_snapshot_of(pipeline).map(|s| Marker {
        snapshot_id: s.snapshot_id,
        sequence_number: s.sequence_number,
    });
    let batch = IndexBatch {
        partitions: partitions
            .into_iter()
            .map(|(bytes, id)| (id, bytes))
            .collect(),
        files,
        bucket_counts: buckets.into_iter().collect(),
        marker,
        ..IndexBatch::default()
    };
    let total = keys.len();
    let loaded = shard.bulk_load(keys.into_iter().collect(), batch)?;
    let secs = started.elapsed().as_secs_f64().max(0.001);
    tracing::info!(
        shard = shard.id,
        keys = total,
        seconds = secs,
        keys_per_s = (total as f64 / secs) as u64,
        "Index rebuilt from the table"
    );
    if loaded != total as u64 {
        return Err(Error::new(
            ErrorKind::Storage,
            format!("index rebuild loaded {loaded} of {total} keys"),
        ));
    }
    Ok(loaded)
}
