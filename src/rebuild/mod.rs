//! Bringing a shard's index level with the table when a partition is assigned: a batch saved
//! before a commit whose outcome was never learned is applied if the commit landed; an index
//! that is merely behind (its marker names a snapshot still in the table's history) replays the
//! snapshots after its marker ([`catch_up`]); an index that is missing, from elsewhere, or
//! cannot replay is rebuilt from the shard's files (live rows, and the versions of deleted rows
//! as tombstones), sorted externally in bounded memory ([`runs`]) and bulk-loaded as SST files.
//!
//! A tombstone rebuilt this way carries the version of the delete itself: inlet's delete files
//! record it beside each deleted position, and a key deleted without a committed row has one
//! written and deleted in the same snapshot for this purpose.

mod catch_up;
pub mod copies;
mod forget;
mod runs;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::upsert::{encode_row, Shard, UpsertSpec, FOREIGN_BUCKET};
use crate::write::deletes::{names, partition_dir, target_of, Names};
use crate::write::{file_shard, shard_file_prefix};
use inlet_common::error::{Error, ErrorKind, Result};
use inlet_iceberg::keys::{SUMMARY_PIPELINE, SUMMARY_WRITER};
use inlet_iceberg::manifest::{DataFile, FileContent};
use inlet_iceberg::metadata::{Snapshot, TableMetadata};
use inlet_iceberg::scan::{read_fields, read_position_deletes};
use inlet_iceberg::types::{encode_values, Type, Value};
use inlet_iceberg::Table;
use inlet_index::{IndexBatch, IndexEntry, Marker, RowLocation};

pub use forget::{forget_files, Forgotten};
pub use runs::DEFAULT_RUN_BYTES;

/// A deleted row's position, with the version of its delete where the delete file says.
type DeletedAt = (i64, Option<Vec<u8>>);

/// Where a rebuild spills its sorted runs, below the shard's index directory.
const SPILL_DIR: &str = "rebuild-runs";

/// Least time between two progress lines of a long rebuild.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// The offset the snapshot records for a partition.
fn offset_in(snapshot: &Snapshot, topic: &str, partition: i32) -> Result<Option<i64>> {
    Ok(snapshot
        .offsets()?
        .get(topic)
        .and_then(|m| m.get(&partition))
        .copied())
}

/// Whether an index at `marker` holds every change the table holds for the partition: every
/// snapshot after the marker is one of this pipeline's checkpoints, and none of them advanced
/// the partition. Another engine's snapshot, or a table service's of the pipeline (a
/// compaction, a partition retention: they move the offsets of no partition), may have
/// rewritten or dropped files the index points at, which only a replay tells.
fn is_current(
    meta: &TableMetadata,
    pipeline: &str,
    marker: Option<Marker>,
    topic: &str,
    partition: i32,
) -> Result<bool> {
    let Some(m) = marker else {
        return Ok(meta.current_snapshot().is_none());
    };
    let ours = |s: &Snapshot| s.summary.get(SUMMARY_PIPELINE).map(String::as_str) == Some(pipeline);
    let latest = match meta.last_snapshot_of(pipeline) {
        Some(s) => offset_in(s, topic, partition)?,
        None => None,
    };
    let mut lineage = meta.lineage();
    for s in lineage.by_ref() {
        if s.snapshot_id == m.snapshot_id {
            // The pipeline's offsets as of the marker: its newest snapshot at or before it.
            let at = match std::iter::once(s).chain(lineage).find(|s| ours(s)) {
                Some(s) => offset_in(s, topic, partition)?,
                None => None,
            };
            return Ok(at == latest);
        }
        if !ours(s) || is_service(s) {
            return Ok(false);
        }
    }
    Ok(false)
}

/// Whether a snapshot is a table service's (no checkpoint of the pipeline's).
fn is_service(s: &Snapshot) -> bool {
    s.summary.get("operation").map(String::as_str) == Some("replace")
        || s.summary
            .contains_key(inlet_iceberg::keys::SUMMARY_MAINTENANCE)
}

/// How [`recover`] brought a shard's index level with the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// The index already held every change of the table.
    Current,
    /// The snapshots after the index's marker were replayed into it.
    CaughtUp {
        /// Snapshots of the pipeline replayed.
        snapshots: usize,
        /// Key entries written (live rows and tombstones).
        keys: u64,
    },
    /// The index was rebuilt from the shard's files.
    Rebuilt {
        /// Keys loaded, tombstones included.
        keys: u64,
    },
}

/// Makes the shard's index equal to the table.
pub async fn recover(
    shard: &mut Shard,
    spec: &UpsertSpec,
    table: &Table,
    pipeline: &str,
    topic: &str,
    partition: i32,
) -> Result<Recovery> {
    let meta = &table.metadata;
    match shard.take_saved()? {
        None => {}
        Some(None) => {
            // Empty or torn by a power loss: whether its commit landed is read from the table
            // below, by catching up from the index's marker.
            tracing::warn!(
                topic,
                partition,
                "The saved index batch is unreadable; catching up from the table instead"
            );
            shard.drop_saved()?;
        }
        Some(Some(saved)) => {
            let landed = meta.lineage().find(|s| {
                s.summary.get(SUMMARY_WRITER) == Some(&saved.writer)
                    && s.checkpoint_id() == Some(saved.checkpoint)
            });
            match landed {
                Some(s) if shard.marker()? == saved.base => {
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
                    shard.apply_committed(saved.batch, marker)?;
                    // The batch allocated file and partition ids this shard's memory has not
                    // seen.
                    shard.discard()?;
                }
                // Landed on an index that has moved since (restored, rebuilt): the replay
                // below takes the snapshot from the table.
                Some(s) => {
                    tracing::warn!(
                        topic,
                        partition,
                        snapshot_id = s.snapshot_id,
                        "The saved index batch was built on another state of the index; catching up from the table instead"
                    );
                    shard.drop_saved()?;
                }
                // Never landed: its records are read again.
                None => shard.drop_saved()?,
            }
        }
    }
    let marker = shard.marker()?;
    if is_current(meta, pipeline, marker, topic, partition)? {
        return Ok(Recovery::Current);
    }
    if let Some(marker) = marker {
        let started = Instant::now();
        match catch_up::catch_up(shard, spec, table, pipeline, marker).await {
            Ok(done) if is_current(meta, pipeline, shard.marker()?, topic, partition)? => {
                tracing::info!(
                    topic,
                    partition,
                    snapshots = done.snapshots,
                    keys = done.keys,
                    seconds = started.elapsed().as_secs_f64(),
                    "Index caught up by replaying snapshots"
                );
                return Ok(Recovery::CaughtUp {
                    snapshots: done.snapshots,
                    keys: done.keys,
                });
            }
            Ok(_) => tracing::warn!(
                topic,
                partition,
                "Replaying snapshots left the index behind the table; rebuilding it"
            ),
            Err(e) => tracing::warn!(
                topic,
                partition,
                error = %e,
                "Cannot replay the snapshots after the index's marker; rebuilding it"
            ),
        }
    }
    // A shard this pipeline never committed (a new table, a partition added to the topic) has
    // no index yet as a matter of course; it is built from whatever the table holds.
    let committed = match meta.last_snapshot_of(pipeline) {
        Some(s) => offset_in(s, topic, partition)?.is_some(),
        None => false,
    };
    if marker.is_none() && !committed {
        tracing::info!(
            topic,
            partition,
            "Building the index of a partition new to the table from the table"
        );
    } else {
        tracing::warn!(
            topic,
            partition,
            "Index is missing or cannot catch up; rebuilding it from the table"
        );
    }
    let keys = rebuild(shard, spec, table).await?;
    Ok(Recovery::Rebuilt { keys })
}

/// Runs `work` on each job on threads of the blocking pool, at most `workers` at once, and
/// returns what each returned, in the order they finished: a shard's recovery keeps a core
/// busy, and shards are independent. Each job's future runs on its own thread (through the
/// runtime's handle, so its I/O is the runtime's), never on the runtime's workers.
pub async fn on_workers<J, T, F, Fut>(
    jobs: Vec<J>,
    workers: usize,
    work: F,
) -> Vec<std::result::Result<T, tokio::task::JoinError>>
where
    J: Send + 'static,
    T: Send + 'static,
    F: Fn(J) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    use futures::StreamExt;
    let handle = tokio::runtime::Handle::current();
    futures::stream::iter(jobs)
        .map(|job| {
            let (handle, work) = (handle.clone(), work.clone());
            tokio::task::spawn_blocking(move || handle.block_on(work(job)))
        })
        .buffer_unordered(workers.max(1))
        .collect()
        .await
}

/// Rebuilds the index shards of `partitions` of `topic` from the table, up to `workers` at
/// once (see [`on_workers`]), the way a new owner's recovery does; returns the keys loaded.
pub async fn rebuild_shards(
    sink: &mut crate::upsert::UpsertSink,
    topic: &str,
    partitions: impl IntoIterator<Item = i32>,
    table: &Table,
    workers: usize,
) -> Result<u64> {
    let mut shards = Vec::new();
    for p in partitions {
        sink.open_shard(topic, p)?;
        let shard = sink
            .take_shard(topic, p)
            .ok_or_else(|| Error::new(ErrorKind::Internal, "opened shard vanished"))?;
        shards.push((p, shard));
    }
    let (spec, table) = (sink.spec.clone(), table.clone());
    let done = on_workers(shards, workers, move |(p, mut shard)| {
        let (spec, table) = (spec.clone(), table.clone());
        async move {
            let keys = rebuild(&mut shard, &spec, &table).await;
            (p, shard, keys)
        }
    })
    .await;
    let mut keys = 0;
    let mut failed = None;
    for joined in done {
        let (p, shard, loaded) = joined.map_err(|e| {
            Error::new(ErrorKind::Internal, "index rebuild task failed").with_source(e)
        })?;
        sink.put_shard(topic, p, shard);
        match loaded {
            Ok(n) => keys += n,
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    failed.map_or(Ok(keys), Err)
}

/// Rebuilds the shard's index from its rows in the table, sorting in runs of
/// [`DEFAULT_RUN_BYTES`].
pub async fn rebuild(shard: &mut Shard, spec: &UpsertSpec, table: &Table) -> Result<u64> {
    rebuild_with(shard, spec, table, DEFAULT_RUN_BYTES).await
}

/// Rebuilds the shard's index from its rows in the table, holding about `run_bytes` of entries
/// in memory at a time. Returns the number of keys loaded, tombstones included.
pub async fn rebuild_with(
    shard: &mut Shard,
    spec: &UpsertSpec,
    table: &Table,
    run_bytes: usize,
) -> Result<u64> {
    let mut progress = Progress::new();
    let reader = ShardReader::new(shard.id, spec, table)?;
    let entries = table.live_entries().await?;
    if let Some(e) = entries
        .iter()
        .find(|e| e.data_file.content == FileContent::EqualityDeletes)
    {
        return Err(Error::metadata(format!(
            "table {}.{} has equality deletes ({}), written by another engine; the key index \
             cannot be rebuilt from them: rewrite them into the data files (e.g. Spark's \
             rewrite_data_files with delete-file-threshold=1) and start again",
            table.namespace, table.name, e.data_file.file_path
        )));
    }
    // In path order, so the files of a partition directory come one after another.
    let mut data: Vec<&DataFile> = entries
        .iter()
        .map(|e| &e.data_file)
        .filter(|f| f.content == FileContent::Data && reader.reads(&f.file_path))
        .collect();
    data.sort_by(|a, b| a.file_path.cmp(&b.file_path));
    // A delete file naming one data file is read with that file, and the shard's grouped
    // delete files of a partition directory with that directory's first file, so deleted
    // positions are in memory a directory at a time; another engine's naming several is read
    // now and only this shard's positions are kept.
    let mut deletes_of: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut grouped_in: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut loose: HashMap<String, Vec<DeletedAt>> = HashMap::new();
    for f in entries
        .iter()
        .map(|e| &e.data_file)
        .filter(|f| f.content == FileContent::PositionDeletes)
    {
        match target_of(f) {
            Some(target) if reader.reads(target) => {
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
                    if reader.reads(&d.path) {
                        loose
                            .entry(d.path.clone())
                            .or_default()
                            .extend(d.owned_rows());
                    }
                }
            }
        }
    }

    let total_bytes: u64 = data
        .iter()
        .map(|f| f.file_size_in_bytes.max(0) as u64)
        .sum();
    let mut sorter = runs::Sorter::new(shard.dir().join(SPILL_DIR), run_bytes)?;
    let mut partitions: HashMap<Vec<u8>, u32> = HashMap::new();
    let mut files = Vec::with_capacity(data.len());
    let (mut rows_read, mut bytes_read) = (0u64, 0u64);
    let mut grouped: HashMap<String, Vec<DeletedAt>> = HashMap::new();
    let mut grouped_dir = None;
    for (n, f) in data.iter().enumerate() {
        let file_id = n as u64 + 1;
        let path = &f.file_path;
        files.push((file_id, path.clone()));
        let next_id = partitions.len() as u32;
        let pid = *partitions
            .entry(encode_values(&f.partition))
            .or_insert(next_id);
        let bucket = bucket_of(path)?;
        let rows = reader.rows(path).await?;
        // Per row: `Some(version of its delete)` once deleted (empty if the delete file does
        // not say).
        let mut deleted: Vec<Option<Vec<u8>>> = vec![None; rows.len()];
        let dir = partition_dir(path);
        if grouped_dir != Some(dir) {
            grouped.clear();
            for delete_file in grouped_in.get(dir).into_iter().flatten() {
                for d in read_position_deletes(table.io.get(delete_file).await?)? {
                    grouped
                        .entry(d.path.clone())
                        .or_default()
                        .extend(d.owned_rows());
                }
            }
            grouped_dir = Some(dir);
        }
        let mut positions = loose.remove(path.as_str()).unwrap_or_default();
        positions.extend(grouped.remove(path.as_str()).unwrap_or_default());
        for delete_file in deletes_of.get(path.as_str()).into_iter().flatten() {
            for d in read_position_deletes(table.io.get(delete_file).await?)? {
                if d.path == *path {
                    positions.extend(d.owned_rows());
                }
            }
        }
        for (pos, version) in positions {
            if let Some(d) = usize::try_from(pos).ok().and_then(|p| deleted.get_mut(p)) {
                let version = version.unwrap_or_default();
                if d.as_ref().is_none_or(|v| *v < version) {
                    *d = Some(version);
                }
            }
        }
        rows_read += rows.len() as u64;
        for (pos, (row, deleted)) in rows.into_iter().zip(deleted).enumerate() {
            // Deleted rows stay in their files: the newest version of a key with no live row
            // (a deleted row's own, or its delete's, whichever is newer) becomes its tombstone,
            // so re-sent older changes of deleted keys stay dropped.
            let entry = match deleted {
                None => IndexEntry {
                    version: row.version,
                    location: Some(RowLocation {
                        partition_id: pid,
                        bucket,
                        file_id,
                        position: pos as u64,
                    }),
                    row: row.row,
                    written_at_secs: reader.now_secs,
                },
                Some(by) => IndexEntry {
                    version: row.version.max(by),
                    location: None,
                    row: None,
                    written_at_secs: reader.now_secs,
                },
            };
            sorter.push(row.key, entry)?;
        }
        bytes_read += f.file_size_in_bytes.max(0) as u64;
        if progress.due() {
            tracing::info!(
                shard = shard.id,
                files_done = n + 1,
                files = data.len(),
                rows = rows_read,
                rows_per_s = progress.per_sec(rows_read),
                eta_secs = progress.eta_secs(bytes_read, total_bytes),
                "Rebuilding index: reading the shard's files"
            );
        }
    }

    let spilled = sorter.spilled_runs();
    let mut merge = sorter.finish()?;
    let read_secs = progress.started.elapsed();
    let mut buckets: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    let mut merged = 0u64;
    let shard_id = shard.id;
    let mut counted = (&mut merge).inspect(|item| {
        let Ok((_, entry)) = item else { return };
        merged += 1;
        if let Some(at) = entry.location {
            *buckets.entry((at.partition_id, at.bucket)).or_default() += 1;
        }
        // Rows read bound the keys from above, so the estimate errs long.
        if merged % 65_536 == 0 && progress.due() {
            tracing::info!(
                shard = shard_id,
                keys = merged,
                keys_per_s = progress.per_sec_since(merged, read_secs),
                eta_secs = progress.eta_secs_since(merged, rows_read, read_secs),
                "Rebuilding index: loading sorted keys"
            );
        }
    });
    // Keys, partitions and files first, without a marker: an index whose load stops here is
    // rebuilt again. Bucket counts are known once every key has been merged.
    let layout = IndexBatch {
        partitions: partitions
            .into_iter()
            .map(|(bytes, id)| (id, bytes))
            .collect(),
        files,
        ..IndexBatch::default()
    };
    let loaded = shard.bulk_load(&mut counted, layout)?;
    let duplicates = std::mem::take(&mut merge.duplicates);
    drop(merge);
    if !duplicates.is_empty() {
        tracing::error!(
            shard = shard.id,
            keys = duplicates.len(),
            "Keys are live twice in the table; the index keeps the newer row of each and the next checkpoint deletes the older"
        );
        crate::metrics::metrics()
            .duplicate_keys_repaired
            .inc_by(duplicates.len() as u64);
    }
    // Before the marker: an index with a marker has its repairs saved.
    shard.save_repairs(duplicates)?;
    // The index now holds every file of the table as of its head.
    let marker = table.metadata.current_snapshot().map(|s| Marker {
        snapshot_id: s.snapshot_id,
        sequence_number: s.sequence_number,
    });
    shard.apply_batch(IndexBatch {
        bucket_counts: buckets.into_iter().collect(),
        marker,
        ..IndexBatch::default()
    })?;
    let secs = progress.started.elapsed().as_secs_f64().max(0.001);
    tracing::info!(
        shard = shard.id,
        keys = loaded,
        rows = rows_read,
        spilled_runs = spilled,
        seconds = secs,
        keys_per_s = (loaded as f64 / secs) as u64,
        "Index rebuilt from the table"
    );
    Ok(loaded)
}

/// The bucket of a data file, from its `bucket-N` directory; [`FOREIGN_BUCKET`] for a file
/// another engine wrote.
fn bucket_of(path: &str) -> Result<u32> {
    if is_foreign(path) {
        return Ok(FOREIGN_BUCKET);
    }
    path.rsplit('/')
        .nth(1)
        .and_then(|dir| dir.strip_prefix("bucket-"))
        .and_then(|b| b.parse::<u32>().ok())
        .ok_or_else(|| Error::metadata(format!("data file {path} is not in a bucket-N directory")))
}

/// Whether a data file was written by another engine: its name has no shard prefix.
fn is_foreign(path: &str) -> bool {
    file_shard(path).is_none()
}

/// One row of a shard's data file as the index sees it.
struct ShardRow {
    key: Vec<u8>,
    version: Vec<u8>,
    /// The encoded row, for merge engines that keep rows.
    row: Option<Vec<u8>>,
}

/// Reads the shard's data files for the index: which files are the shard's, and the key,
/// version and (where kept) row of each of their rows.
struct ShardReader<'a> {
    table: &'a Table,
    shard: u32,
    /// File names of the shard start with this.
    prefix: String,
    /// Columns read (field id, name, type): the key columns or the whole row, then `_version`.
    columns: Vec<(i32, String, Type)>,
    /// Positions of the key columns among `columns`.
    key_at: Vec<usize>,
    /// Merge engines that keep rows in the index: the field ids of a row's values.
    fields: Option<Vec<i32>>,
    /// `written_at_secs` of every entry written.
    now_secs: u64,
}

impl<'a> ShardReader<'a> {
    fn new(shard: u32, spec: &UpsertSpec, table: &'a Table) -> Result<ShardReader<'a>> {
        let schema = table.metadata.current_schema()?;
        let user_columns: Vec<(i32, String, Type)> = schema
            .fields
            .iter()
            .filter(|f| f.name != "_version")
            .map(|f| Ok((f.id, f.name.clone(), f.primitive()?)))
            .collect::<Result<_>>()?;
        let version = schema
            .fields
            .iter()
            .find(|f| f.name == "_version")
            .ok_or_else(|| Error::metadata("the upsert table has no _version column"))?;
        let (mut columns, key_at) = if spec.stores_rows() {
            (user_columns, spec.key_columns.clone())
        } else {
            let keys = spec
                .key_columns
                .iter()
                .map(|i| {
                    user_columns.get(*i).cloned().ok_or_else(|| {
                        Error::metadata(format!("key column {i} is not in the table schema"))
                    })
                })
                .collect::<Result<_>>()?;
            (keys, (0..spec.key_columns.len()).collect())
        };
        let fields = spec
            .stores_rows()
            .then(|| columns.iter().map(|c| c.0).collect());
        columns.push((version.id, version.name.clone(), Type::Binary));
        Ok(ShardReader {
            table,
            shard,
            prefix: format!("{}-", shard_file_prefix(shard)),
            columns,
            key_at,
            fields,
            now_secs: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        })
    }

    /// Whether the file at `path` is one of the shard's.
    fn owns(&self, path: &str) -> bool {
        path.rsplit('/')
            .next()
            .is_some_and(|name| name.starts_with(&self.prefix))
    }

    /// Whether the shard's index takes the rows of data file `path`: its own files, and files
    /// another engine wrote (a rewrite or an insert), whose keys cannot be told apart by shard
    /// and so are known to every shard; a key's changes reach only its own.
    fn reads(&self, path: &str) -> bool {
        self.owns(path) || is_foreign(path)
    }

    /// Whether the position-delete file `f` may delete rows the shard's index takes.
    fn reads_deletes_of(&self, f: &DataFile) -> bool {
        crate::write::deletes::may_name(f, self.shard, |path| self.reads(path))
    }

    /// Whether the position-delete file `f` is known to delete rows of the shard's own files.
    fn owns_deletes_of(&self, f: &DataFile) -> bool {
        match crate::write::deletes::names(f) {
            Names::File(target) => self.owns(target),
            Names::ShardFiles(shard) => shard == self.shard,
            Names::Any => false,
        }
    }

    /// The rows of data file `path`, in file order (the index of a row is its position).
    async fn rows(&self, path: &str) -> Result<Vec<ShardRow>> {
        let columns: Vec<(i32, &str, Type)> = self
            .columns
            .iter()
            .map(|(id, n, t)| (*id, n.as_str(), *t))
            .collect();
        let rows = read_fields(self.table.io.get(path).await?, &columns)?;
        rows.into_iter()
            .enumerate()
            .map(|(pos, mut row)| {
                let version = match row.pop() {
                    Some(Value::Binary(version)) => version,
                    // Written by another engine without a version: older than any change.
                    Some(Value::Null) if is_foreign(path) => Vec::new(),
                    _ => {
                        return Err(Error::metadata(format!(
                            "row {pos} of {path} has no _version"
                        )))
                    }
                };
                Ok(ShardRow {
                    key: encode_values(self.key_at.iter().map(|i| &row[*i])),
                    version,
                    row: self.fields.as_ref().map(|f| encode_row(f, &row)),
                })
            })
            .collect()
    }
}

/// Pace of a long rebuild, for progress lines at most every [`PROGRESS_INTERVAL`].
struct Progress {
    started: Instant,
    last: Instant,
}

impl Progress {
    fn new() -> Progress {
        let now = Instant::now();
        Progress {
            started: now,
            last: now,
        }
    }

    /// Whether a progress line is due; if so, the next one is due an interval from now.
    fn due(&mut self) -> bool {
        if self.last.elapsed() < PROGRESS_INTERVAL {
            return false;
        }
        self.last = Instant::now();
        true
    }

    fn per_sec(&self, done: u64) -> u64 {
        self.per_sec_since(done, Duration::ZERO)
    }

    /// Rate of a phase that began `offset` after the start.
    fn per_sec_since(&self, done: u64, offset: Duration) -> u64 {
        let secs = self.started.elapsed().saturating_sub(offset).as_secs_f64();
        if secs > 0.0 {
            (done as f64 / secs) as u64
        } else {
            0
        }
    }

    fn eta_secs(&self, done: u64, total: u64) -> u64 {
        self.eta_secs_since(done, total, Duration::ZERO)
    }

    /// Seconds left of a phase that began `offset` after the start, at its pace so far.
    fn eta_secs_since(&self, done: u64, total: u64, offset: Duration) -> u64 {
        if done == 0 {
            return 0;
        }
        let secs = self.started.elapsed().saturating_sub(offset).as_secs_f64();
        (secs * total.saturating_sub(done) as f64 / done as f64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// Jobs run side by side, never more than `workers` at once, and every job's result comes
    /// back. Each job waits until another has started, which a pool running them one after
    /// another never allows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn shards_recover_side_by_side_on_at_most_the_workers() {
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let started = Arc::new((Mutex::new(0usize), std::sync::Condvar::new()));
        let (r, m, s) = (running.clone(), most.clone(), started.clone());
        let done = on_workers((0..6).collect(), 2, move |job: usize| {
            let (running, most, started) = (r.clone(), m.clone(), s.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                let (count, cv) = &*started;
                let mut n = count.lock().unwrap();
                *n += 1;
                cv.notify_all();
                let mine = *n;
                // Until a job started after this one (the last job waits for none).
                let (n, timeout) = cv
                    .wait_timeout_while(n, Duration::from_secs(20), |n| *n == mine && mine < 6)
                    .unwrap();
                drop(n);
                running.fetch_sub(1, Ordering::SeqCst);
                (job, !timeout.timed_out())
            }
        })
        .await;
        let mut results: Vec<(usize, bool)> = done.into_iter().map(|r| r.unwrap()).collect();
        results.sort();
        assert_eq!(
            results,
            (0..6).map(|j| (j, true)).collect::<Vec<_>>(),
            "a job waited alone"
        );
        assert_eq!(most.load(Ordering::SeqCst), 2);
    }
}
