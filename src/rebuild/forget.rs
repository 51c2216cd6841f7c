//! What a shard's index must forget when the shard's files of whole partitions leave the table
//! (partition retention): the index afterwards equals one rebuilt from the table without them.
//!
//! A key whose live row was in a dropped file, or whose entry is a tombstone, keeps only what
//! the remaining files say of it: the newest version among its deleted rows there becomes its
//! tombstone, and without any it is forgotten. A key live elsewhere is untouched (a key is live
//! in one row). Only data files with deletes can hold deleted rows, so only those are read
//! besides the dropped files themselves.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::{DeletedAt, ShardReader};
use crate::upsert::{Shard, UpsertSpec, FOREIGN_BUCKET};
use crate::write::deletes::{names, partition_dir, target_of, Names};
use inlet_common::error::Result;
use inlet_iceberg::manifest::{FileContent, ManifestEntry};
use inlet_iceberg::scan::read_position_deletes;
use inlet_iceberg::types::encode_values;
use inlet_iceberg::Table;
use inlet_index::{IndexBatch, IndexEntry};

/// What forgetting some files does to a shard's index.
pub struct Forgotten {
    /// The batch to apply once the files' removal committed (no marker).
    pub batch: IndexBatch,
    /// Keys that keep a tombstone from rows deleted elsewhere.
    pub tombstones: usize,
    /// Keys forgotten entirely.
    pub removed: usize,
}

/// The batch that makes `shard`'s index forget its data files `dropped` (paths of the shard's
/// own data files, of whole partitions of the table's live `entries`).
pub async fn forget_files(
    shard: &mut Shard,
    spec: &UpsertSpec,
    table: &Table,
    entries: &[ManifestEntry],
    dropped: &HashSet<String>,
) -> Result<Forgotten> {
    let reader = ShardReader::new(shard.id, spec, table)?;
    let ids: HashMap<String, u64> = shard
        .index()
        .files()?
        .into_iter()
        .map(|(id, path)| (path, id))
        .collect();
    let dropped_ids: HashSet<u64> = dropped.iter().filter_map(|p| ids.get(p).copied()).collect();
    let mut partitions: HashSet<Vec<u8>> = HashSet::new();
    let mut affected: BTreeSet<Vec<u8>> = BTreeSet::new();
    for e in entries.iter().filter(|e| {
        e.data_file.content == FileContent::Data && dropped.contains(&e.data_file.file_path)
    }) {
        partitions.insert(encode_values(&e.data_file.partition));
        for row in reader.rows(&e.data_file.file_path).await? {
            if affected.contains(&row.key) {
                continue;
            }
            let Some(entry) = shard.index().get(&row.key)? else {
                continue;
            };
            // Live in a file that stays: untouched.
            if entry
                .location
                .is_some_and(|at| !dropped_ids.contains(&at.file_id))
            {
                continue;
            }
            affected.insert(row.key);
        }
    }

    // The deleted rows of affected keys in the files that stay. A delete file naming one data
    // file is read with that file, and the shard's grouped delete files of a partition
    // directory with that directory, so deleted positions are in memory a directory at a time;
    // another engine's naming several is read now and only this shard's positions are kept.
    let mut deletes_of: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut grouped_in: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut loose: HashMap<String, Vec<DeletedAt>> = HashMap::new();
    if !affected.is_empty() {
        for f in entries
            .iter()
            .map(|e| &e.data_file)
            .filter(|f| f.content == FileContent::PositionDeletes)
        {
            match target_of(f) {
                Some(target) if reader.reads(target) && !dropped.contains(target) => {
                    deletes_of.entry(target).or_default().push(&f.file_path)
                }
                Some(_) => {}
                None if !reader.reads_deletes_of(f) => {}
                None if matches!(names(f), Names::ShardFiles(_)) => grouped_in
                    .entry(f.file_path.rsplit_once('/').map_or("", |(dir, _)| dir))
                    .or_default()
                    .push(&f.file_path),
                None => {
                    for d in read_position_deletes(table.io.get(&f.file_path).await?)? {
                        if reader.reads(&d.path) && !dropped.contains(&d.path) {
                            loose
                                .entry(d.path.clone())
                                .or_default()
                                .extend(d.owned_rows());
                        }
                    }
                }
            }
        }
    }
    let mut with_deletes: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in deletes_of
        .keys()
        .copied()
        .chain(loose.keys().map(String::as_str))
    {
        with_deletes
            .entry(partition_dir(path).to_string())
            .or_default()
            .insert(path.to_string());
    }
    for dir in grouped_in.keys() {
        with_deletes.entry(dir.to_string()).or_default();
    }
    let mut tombstones: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for (dir, mut paths) in with_deletes {
        let mut grouped: HashMap<String, Vec<DeletedAt>> = HashMap::new();
        for delete_file in grouped_in.get(dir.as_str()).into_iter().flatten() {
            for d in read_position_deletes(table.io.get(delete_file).await?)? {
                if reader.reads(&d.path) && !dropped.contains(&d.path) {
                    grouped
                        .entry(d.path.clone())
                        .or_default()
                        .extend(d.owned_rows());
                }
            }
        }
        paths.extend(grouped.keys().cloned());
        for path in &paths {
            let path = path.as_str();
            let mut positions: HashMap<i64, Vec<u8>> = HashMap::new();
            let mut note = |pos: i64, version: Option<Vec<u8>>| {
                let v = version.unwrap_or_default();
                let at = positions.entry(pos).or_default();
                if *at < v {
                    *at = v;
                }
            };
            for (pos, version) in loose.remove(path).into_iter().flatten() {
                note(pos, version);
            }
            for (pos, version) in grouped.remove(path).into_iter().flatten() {
                note(pos, version);
            }
            for delete_file in deletes_of.get(path).into_iter().flatten() {
                for d in read_position_deletes(table.io.get(delete_file).await?)? {
                    if d.path == path {
                        for (pos, version) in d.owned_rows() {
                            note(pos, version);
                        }
                    }
                }
            }
            for (pos, row) in reader.rows(path).await?.into_iter().enumerate() {
                let Some(by) = positions.get(&(pos as i64)) else {
                    continue;
                };
                if !affected.contains(&row.key) {
                    continue;
                }
                let version = row.version.max(by.clone());
                let at = tombstones.entry(row.key).or_default();
                if *at < version {
                    *at = version;
                }
            }
        }
    }

    let mut batch = IndexBatch {
        removed_files: dropped_ids.into_iter().collect(),
        ..IndexBatch::default()
    };
    let (mut kept, mut removed) = (0, 0);
    for key in affected {
        match tombstones.remove(&key) {
            Some(version) => {
                kept += 1;
                batch.entries.push((
                    key,
                    IndexEntry {
                        version,
                        location: None,
                        row: None,
                        written_at_secs: reader.now_secs,
                    },
                ));
            }
            None => {
                removed += 1;
                batch.removed.push(key);
            }
        }
    }
    // The shard has no rows left in the dropped partitions (another engine's files, counted
    // apart, stay).
    let dropped_partitions: HashSet<u32> = shard
        .index()
        .partitions()?
        .into_iter()
        .filter(|(_, values)| partitions.contains(values))
        .map(|(id, _)| id)
        .collect();
    batch.bucket_counts = shard
        .index()
        .bucket_counts()?
        .into_iter()
        .filter(|((p, b), n)| dropped_partitions.contains(p) && *b != FOREIGN_BUCKET && *n > 0)
        .map(|(at, _)| (at, 0))
        .collect();
    Ok(Forgotten {
        batch,
        tombstones: kept,
        removed,
    })
}
