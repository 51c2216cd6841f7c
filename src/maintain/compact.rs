//! Inline compaction of upsert tables by the shards' own writers. A shard owns the files it
//! wrote (their names carry its prefix) and is the only writer of position deletes against
//! them, so rewriting them can only race itself. Right after a checkpoint commits, within a
//! byte budget, it rewrites:
//!
//! - a data file whose deleted fraction passes `delete_ratio`, or that has gathered
//!   `max_delete_files` delete files: into one file of its live rows;
//! - small files of one partition and bucket: bin-packed into one.
//!
//! A shard's grouped delete file (one per partition per checkpoint, see `write::deletes`) names
//! many of its files. Rewriting some of them consumes every delete file naming them: the rows
//! such a file holds for files that stay (and are still live) go into one new delete file per
//! partition, so no delete ever names a removed file and a partition's delete files merge as
//! its data files are rewritten.
//!
//! The rewrite is its own `replace` snapshot, committed right after the checkpoint's data
//! snapshot and carrying the same offset map (fenced: it lands only on a table whose offsets for
//! the pipeline are the ones the checkpoint left). It removes the old data files and their
//! delete files; the moved rows' index entries point to their new positions in one atomic index
//! batch, saved beside the index before the commit and applied after it, exactly like a
//! checkpoint's. A deleted row whose delete is still the key's newest change (the index holds a
//! tombstone with that delete's version) is carried over as a row deleted again in the new
//! file, so an index rebuilt from the table keeps the tombstone.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;

use crate::commit::{table_offsets, Committer, Offsets};
use crate::upsert::{Lent, LentShard};
use crate::write::deletes::Names;
use crate::write::parquet::{ParquetFile, WriteColumn};
use crate::write::WrittenFile;
use crate::write::{file_shard, shard_file_prefix};
use inlet_common::error::{Error, ErrorKind, Result};
use inlet_iceberg::keys::{
    SUMMARY_CHECKPOINT, SUMMARY_MAINTENANCE, SUMMARY_OFFSETS, SUMMARY_PIPELINE, SUMMARY_WRITER,
};
use inlet_iceberg::manifest::{
    self, DataFile, EntryStatus, FileContent, ManifestEntry, ManifestFile,
};
use inlet_iceberg::metadata::{pipeline_tag, Snapshot, SnapshotLogEntry, SnapshotRef};
use inlet_iceberg::types::encode_values;
use inlet_iceberg::{now_ms, Table};
use inlet_index::{IndexBatch, IndexEntry, Marker, RowLocation};

/// Crash points of a compacting checkpoint, for the fault tests.
pub const STEPS: [&str; 3] = [
    "compact_after_upload",
    "compact_after_save",
    "compact_after_commit",
];

/// What compaction rewrites, and how much per checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct CompactPolicy {
    /// A data file with at least this share of its rows deleted is rewritten.
    pub delete_ratio: f64,
    /// A data file with at least this many delete files is rewritten.
    pub max_delete_files: usize,
    /// Data files below this size are small: those of one partition and bucket are packed.
    pub small_file_bytes: i64,
    /// Size packed files aim at.
    pub target_file_bytes: i64,
    /// Most bytes (data and delete files) read by one compaction.
    pub budget_bytes: i64,
    /// Longest time one compaction spends rewriting; the first rewrite always runs.
    pub budget_time: std::time::Duration,
}

/// What one compaction did.
#[derive(Debug, Default, Clone)]
pub struct Compacted {
    /// The replace snapshot, if one was committed.
    pub snapshot_id: Option<i64>,
    pub files_rewritten: usize,
    pub bytes_rewritten: u64,
    pub delete_files_removed: usize,
    /// Files left to rewrite once the budget ran out.
    pub backlog: usize,
}

/// One rewrite: data files of one shard, partition and bucket directory, into one.
struct Job {
    inputs: Vec<DataFile>,
    deletes: Vec<DataFile>,
}

impl Job {
    fn bytes(&self) -> i64 {
        self.inputs
            .iter()
            .chain(&self.deletes)
            .map(|f| f.file_size_in_bytes)
            .sum()
    }
}

/// A shard's part of the replace snapshot.
struct ShardRewrite {
    shard: u32,
    /// The shard's source partition.
    source: (String, i32),
    batch: IndexBatch,
}

fn dir_of(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(d, _)| d)
}

/// The jobs over `shard`'s files, most useful first: large files with many deletes, each
/// rewritten alone; then the small files of each directory (partition and bucket) packed
/// together, those with many deletes among them, groups holding such a file first. A small
/// file due for its deletes is rewritten even alone; one that is not waits for company.
fn plan(
    shard: u32,
    data: &[&DataFile],
    deletes_of: &DeletesOf,
    policy: &CompactPolicy,
) -> Vec<Job> {
    let mut jobs = Vec::new();
    let mut small: BTreeMap<(&str, String), Vec<(&DataFile, bool)>> = BTreeMap::new();
    for f in data
        .iter()
        .filter(|f| file_shard(&f.file_path) == Some(shard))
    {
        let deletes = deletes_of
            .get(f.file_path.as_str())
            .map(Vec::as_slice)
            .unwrap_or_default();
        // Only deletes that came after the file make it due.
        let later: Vec<&Naming> = deletes.iter().filter(|d| !d.born).collect();
        let deleted: i64 = later.iter().map(|d| d.rows).sum();
        let ratio = deleted as f64 / f.record_count.max(1) as f64;
        let due = !later.is_empty()
            && (ratio >= policy.delete_ratio || deletes.len() >= policy.max_delete_files);
        if f.file_size_in_bytes < policy.small_file_bytes {
            let partition = format!("{:?}", f.partition);
            small
                .entry((dir_of(&f.file_path), partition))
                .or_default()
                .push((f, due));
        } else if due {
            jobs.push(pack(&[*f], deletes_of));
        }
    }
    let (mut urgent, mut packs) = (Vec::new(), Vec::new());
    for files in small.into_values() {
        let mut group: Vec<&DataFile> = Vec::new();
        let (mut size, mut due) = (0, false);
        for (f, f_due) in files {
            if size + f.file_size_in_bytes > policy.target_file_bytes && !group.is_empty() {
                if group.len() > 1 || due {
                    let job = pack(&group, deletes_of);
                    if due {
                        urgent.push(job)
                    } else {
                        packs.push(job)
                    }
                }
                group.clear();
                (size, due) = (0, false);
            }
            size += f.file_size_in_bytes;
            due |= f_due;
            group.push(f);
        }
        if group.len() > 1 || due {
            let job = pack(&group, deletes_of);
            if due {
                urgent.push(job)
            } else {
                packs.push(job)
            }
        }
    }
    jobs.extend(urgent);
    jobs.extend(packs);
    jobs
}

fn pack(group: &[&DataFile], deletes_of: &DeletesOf) -> Job {
    let mut deletes: BTreeMap<&str, &DataFile> = BTreeMap::new();
    for d in group
        .iter()
        .flat_map(|f| deletes_of.get(f.file_path.as_str()).into_iter().flatten())
    {
        deletes.insert(&d.file.file_path, d.file);
    }
    Job {
        inputs: group.iter().map(|f| (*f).clone()).collect(),
        deletes: deletes.into_values().cloned().collect(),
    }
}

/// Per data file, the live delete files naming it and how many of its rows each deletes.
type DeletesOf<'a> = HashMap<String, Vec<Naming<'a>>>;

/// A delete file naming a data file.
#[derive(Debug, Clone, Copy)]
struct Naming<'a> {
    file: &'a DataFile,
    /// Rows of the data file it deletes.
    rows: i64,
    /// Whether it came in the data file's own snapshot: a rewrite keeps a deleted row whose
    /// delete is its key's newest change, deleted again by a delete file committed with the
    /// new file. Such deletes never make the file due, since a rewrite would keep them again.
    born: bool,
}

impl<'a> Naming<'a> {
    /// Delete file `e` naming `target`; `added_in` has the snapshot of every live data file.
    fn of(
        e: &'a ManifestEntry,
        target: &str,
        rows: i64,
        added_in: &HashMap<&str, Option<i64>>,
    ) -> Naming<'a> {
        Naming {
            file: &e.data_file,
            rows,
            born: e.snapshot_id.is_some() && added_in.get(target) == Some(&e.snapshot_id),
        }
    }
}

/// The files a delete file names, each with the rows it deletes there.
type Targets = Arc<Vec<(String, i64)>>;

/// The files a shard's grouped delete file names, with their deleted rows, as read once:
/// delete files never change, and every compaction plans from all of them.
#[derive(Default)]
pub struct DeleteCounts(std::sync::Mutex<HashMap<String, Targets>>);

impl DeleteCounts {
    async fn of(&self, table: &Table, f: &DataFile) -> Result<Targets> {
        if let Some(counts) = self.lock().get(&f.file_path) {
            return Ok(counts.clone());
        }
        let bytes = table.io.get(&f.file_path).await?;
        let counts = Arc::new(tokio::task::block_in_place(|| {
            crate::write::deletes::count_targets(bytes)
        })?);
        self.lock().insert(f.file_path.clone(), counts.clone());
        Ok(counts)
    }

    /// Forgets the files of `table` that are not in `live`.
    fn keep(&self, table: &Table, live: &HashSet<&str>) {
        let location = &table.metadata.location;
        self.lock()
            .retain(|path, _| !path.starts_with(location.as_str()) || live.contains(path.as_str()));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Targets>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A delete file's rows.
type DeleteRows = Arc<Vec<inlet_iceberg::scan::DeletesIn>>;

/// Delete files read during one compaction, each read once however many jobs it serves.
#[derive(Default)]
struct ReadDeletes(HashMap<String, DeleteRows>);

impl ReadDeletes {
    async fn of(&mut self, table: &Table, f: &DataFile) -> Result<DeleteRows> {
        if let Some(rows) = self.0.get(&f.file_path) {
            return Ok(rows.clone());
        }
        let bytes = table.io.get(&f.file_path).await?;
        let rows = Arc::new(tokio::task::block_in_place(|| {
            inlet_iceberg::scan::read_position_deletes(bytes)
        })?);
        self.0.insert(f.file_path.clone(), rows.clone());
        Ok(rows)
    }
}

/// The delete files `shard` writes in place of the grouped ones it `consumed`: their rows for
/// live data files that were not rewritten, one file per partition.
async fn remainders(
    table: &Table,
    shard: u32,
    consumed: &BTreeMap<String, DataFile>,
    rewritten: &HashSet<String>,
    live: &HashSet<&str>,
    read: &mut ReadDeletes,
) -> Result<Vec<WrittenFile>> {
    // Per partition directory and encoded partition: its values and its delete files' rows.
    type Partition = (Vec<inlet_iceberg::types::Value>, Vec<DeleteRows>);
    let mut by_partition: BTreeMap<(&str, Vec<u8>), Partition> = BTreeMap::new();
    for f in consumed.values() {
        if !matches!(
            crate::write::deletes::names(f),
            crate::write::deletes::Names::ShardFiles(_)
        ) {
            continue;
        }
        let (_, files) = by_partition
            .entry((dir_of(&f.file_path), encode_values(&f.partition)))
            .or_insert_with(|| (f.partition.clone(), Vec::new()));
        files.push(read.of(table, f).await?);
    }
    let mut written = Vec::new();
    for ((dir, _), (partition, files)) in by_partition {
        // A partition's deletes can be millions of rows: they are sorted one data file at a
        // time, not all at once.
        let mut by_path: BTreeMap<&str, Vec<&inlet_iceberg::scan::DeletesIn>> = BTreeMap::new();
        for d in files.iter().flat_map(|f| f.iter()) {
            if !rewritten.contains(&d.path) && live.contains(d.path.as_str()) {
                by_path.entry(&d.path).or_default().push(d);
            }
        }
        if by_path.is_empty() {
            continue;
        }
        let rows = by_path.into_iter().flat_map(|(path, groups)| {
            let mut rows: Vec<(i64, &[u8])> = groups
                .iter()
                .flat_map(|d| d.rows())
                .map(|(pos, version)| (pos, version.unwrap_or_default()))
                .collect();
            rows.sort_unstable();
            rows.into_iter()
                .map(move |(pos, version)| (path, pos as u64, version))
        });
        let tag = format!("c{}", uuid::Uuid::new_v4().simple());
        written.push(tokio::task::block_in_place(|| {
            crate::write::deletes::write_grouped_deletes(dir, shard, partition, rows, &tag)
        })?);
    }
    Ok(written)
}

/// The output of one job.
struct Rewritten {
    data: Option<WrittenFile>,
    ghosts: Option<WrittenFile>,
    moved: Vec<(Vec<u8>, IndexEntry)>,
    new_file: Option<(u64, String)>,
    removed_ids: Vec<u64>,
}

/// Rewrites one job's files of `shard`; `None` if the files and the index disagree (the job is
/// left alone).
async fn rewrite(
    table: &Table,
    shard: &mut LentShard,
    columns: &[WriteColumn],
    key_columns: &[usize],
    file_ids: &HashMap<String, u64>,
    job: &Job,
    read: &mut ReadDeletes,
) -> Result<Option<Rewritten>> {
    let inputs: HashSet<&str> = job.inputs.iter().map(|f| f.file_path.as_str()).collect();
    let mut files = Vec::with_capacity(job.deletes.len());
    for d in &job.deletes {
        files.push(read.of(table, d).await?);
    }
    let mut deleted: HashMap<(&str, i64), &[u8]> = HashMap::new();
    for d in files.iter().flat_map(|f| f.iter()) {
        if !inputs.contains(d.path.as_str()) {
            continue;
        }
        for (pos, version) in d.rows() {
            // Only inlet's delete files carry versions; without one a tombstone cannot be kept.
            let Some(version) = version else {
                return Ok(None);
            };
            let at = deleted.entry((&d.path, pos)).or_default();
            if *at < version {
                *at = version;
            }
        }
    }
    let wanted: Vec<inlet_iceberg::scan::FieldToRead<'_>> = columns
        .iter()
        .map(|c| (c.field_id, c.name.as_str(), c.ty))
        .collect();
    let first = &job.inputs[0];
    let new_id = shard.allocate_file_id();
    let new_path = format!(
        "{}/{}-{}-c.parquet",
        dir_of(&first.file_path),
        shard_file_prefix(shard.id),
        uuid::Uuid::new_v4().simple()
    );
    let mut out = ParquetFile::new(columns.to_vec().into())?;
    let (mut moved, mut ghosts, mut removed_ids) = (Vec::new(), Vec::new(), Vec::new());
    for input in &job.inputs {
        let Some(&file_id) = file_ids.get(&input.file_path) else {
            return Ok(None);
        };
        removed_ids.push(file_id);
        let bytes = table.io.get(&input.file_path).await?;
        // A file that cannot be read as the table's schema now says is left as it is.
        let Ok(rows) =
            tokio::task::block_in_place(|| inlet_iceberg::scan::read_fields(bytes, &wanted))
        else {
            return Ok(None);
        };
        // One batched lookup of the index per file rather than one per row.
        let keys: Vec<Vec<u8>> = rows
            .iter()
            .map(|row| encode_values(key_columns.iter().map(|i| &row[*i])))
            .collect();
        let entries = {
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            shard.index().multi_get(&keys)?
        };
        for (pos, ((mut row, key), entry)) in rows.into_iter().zip(keys).zip(entries).enumerate() {
            match deleted.get(&(input.file_path.as_str(), pos as i64)) {
                Some(&version) => match &entry {
                    Some(e) if e.location.is_none() && e.version == version => {
                        ghosts.push((out.rows() as u64, version.to_vec()));
                        out.push(&mut row)?;
                    }
                    // Superseded by a newer change of the key: gone for good.
                    _ => {}
                },
                None => match entry {
                    Some(mut e)
                        if e.location
                            .is_some_and(|l| l.file_id == file_id && l.position == pos as u64) =>
                    {
                        let at = e.location.ok_or_else(|| {
                            Error::new(ErrorKind::Internal, "checked location vanished")
                        })?;
                        e.location = Some(RowLocation {
                            file_id: new_id,
                            position: out.rows() as u64,
                            ..at
                        });
                        moved.push((key, e));
                        out.push(&mut row)?;
                    }
                    // A live row the index does not place here: leave the file to the
                    // index's own repair.
                    _ => return Ok(None),
                },
            }
        }
    }
    if out.rows() == 0 {
        return Ok(Some(Rewritten {
            data: None,
            ghosts: None,
            moved,
            new_file: None,
            removed_ids,
        }));
    }
    let (bytes, metrics) = tokio::task::block_in_place(|| out.finish())?;
    let len = bytes.len();
    let data = WrittenFile {
        data_file: metrics.into_data_file(
            FileContent::Data,
            new_path.clone(),
            first.partition.clone(),
            len,
        ),
        bytes,
        slot: 0,
    };
    let ghosts = if ghosts.is_empty() {
        None
    } else {
        Some(crate::write::deletes::write_position_deletes(
            &new_path,
            first.partition.clone(),
            &mut ghosts,
            "c",
        )?)
    };
    Ok(Some(Rewritten {
        data: Some(data),
        ghosts,
        moved,
        new_file: Some((new_id, new_path)),
        removed_ids,
    }))
}

/// Files rewritten and uploaded, waiting for their commit.
struct Staged {
    written: Vec<WrittenFile>,
    removed: Vec<DataFile>,
    rewrites: Vec<ShardRewrite>,
    done: Compacted,
}

/// Compacts the owned shards' files of `table` within the policy's budget, starting with the
/// `rotation`-th shard (each run another, so a shard late in line is not starved by earlier
/// ones that always have work), and commits the rewrite as checkpoint `checkpoint` of
/// `committer`'s writer, fenced by `fence` (the offsets
/// the pipeline's last checkpoint left in the table): it lands only while the table holds them
/// for every rewritten shard's partition, so a shard another member took over meanwhile is
/// left alone. A failure before anything is
/// saved or committed only skips this compaction (logged); an error means the outcome of the
/// commit is unknown, and the pipeline must restart so that recovery applies the saved batches
/// iff the snapshot landed.
#[allow(clippy::too_many_arguments)]
pub async fn compact(
    table: &mut Table,
    lent: &mut Lent,
    committer: &Committer,
    checkpoint: u64,
    policy: &CompactPolicy,
    fence: &Offsets,
    epochs: &crate::commit::Epochs,
    rotation: usize,
    counts: &DeleteCounts,
) -> Result<Compacted> {
    let staged = match stage(table, lent, policy, rotation, counts).await {
        Ok(Some(s)) => s,
        Ok(None) => return Ok(Compacted::default()),
        Err(e) => {
            tracing::warn!(error = %e, "Compaction skipped; it is tried again later");
            return Ok(Compacted::default());
        }
    };
    let Staged {
        written,
        removed,
        mut rewrites,
        mut done,
    } = staged;
    for shard in &lent.shards {
        if let Some(r) = rewrites.iter().find(|r| r.shard == shard.id) {
            shard.save_pending(&committer.writer_id, checkpoint, &r.batch)?;
        }
    }
    inlet_common::failpoint::crash_point("compact_after_save");
    let (added_data, added_deletes): (Vec<DataFile>, Vec<DataFile>) = written
        .into_iter()
        .map(|f| f.data_file)
        .partition(|f| f.content == FileContent::Data);
    let expected: Vec<Fence> = rewrites
        .iter()
        .map(|r| {
            let (topic, p) = &r.source;
            let at = fence.get(topic).and_then(|o| o.get(p)).copied();
            let epoch = epochs.get(topic).and_then(|o| o.get(p)).copied();
            (r.source.clone(), at, epoch.unwrap_or(0))
        })
        .collect();
    let landed = commit_rewrite(
        table,
        committer,
        &Operation {
            name: "replace",
            service: crate::metrics::service::COMPACT,
        },
        checkpoint,
        &expected,
        &added_data,
        &added_deletes,
        &removed,
    )
    .await?;
    inlet_common::failpoint::crash_point("compact_after_commit");
    let Some(snapshot) = landed else {
        // Definitely not committed: forget the batches and the ids they took.
        for shard in &mut lent.shards {
            if rewrites.iter().any(|r| r.shard == shard.id) {
                shard.drop_saved()?;
            }
        }
        return Ok(Compacted {
            backlog: done.backlog + done.files_rewritten,
            ..Compacted::default()
        });
    };
    for shard in &mut lent.shards {
        if let Some(i) = rewrites.iter().position(|r| r.shard == shard.id) {
            let r = rewrites.swap_remove(i);
            shard.apply_committed(r.batch, snapshot)?;
        }
    }
    // The shards it left alone are level with it too.
    lent.advance_idle(&table.metadata, &committer.pipeline_id, snapshot)?;
    done.snapshot_id = Some(snapshot.snapshot_id);
    Ok(done)
}

/// Plans and runs the rewrites and uploads their files; `None` if there is nothing to do.
async fn stage(
    table: &Table,
    lent: &mut Lent,
    policy: &CompactPolicy,
    rotation: usize,
    counts: &DeleteCounts,
) -> Result<Option<Staged>> {
    let mut done = Compacted::default();
    let entries = table.live_entries().await?;
    let owned: HashSet<u32> = lent.shards.iter().map(|shard| shard.id).collect();
    let data: Vec<&DataFile> = entries
        .iter()
        .map(|e| &e.data_file)
        .filter(|f| f.content == FileContent::Data)
        .collect();
    let added_in: HashMap<&str, Option<i64>> = entries
        .iter()
        .filter(|e| e.data_file.content == FileContent::Data)
        .map(|e| (e.data_file.file_path.as_str(), e.snapshot_id))
        .collect();
    let mut deletes_of: DeletesOf = HashMap::new();
    for e in &entries {
        let f = &e.data_file;
        match f.content {
            FileContent::Data => {}
            FileContent::PositionDeletes => match crate::write::deletes::names(f) {
                Names::File(target) => deletes_of
                    .entry(target.to_string())
                    .or_default()
                    .push(Naming::of(e, target, f.record_count, &added_in)),
                Names::ShardFiles(shard) if owned.contains(&shard) => {
                    for (target, rows) in counts.of(table, f).await?.iter() {
                        deletes_of
                            .entry(target.clone())
                            .or_default()
                            .push(Naming::of(e, target, *rows, &added_in));
                    }
                }
                // Another member's shard: it names none of these shards' files.
                Names::ShardFiles(_) => {}
                // Another engine's delete file may name any file: leave the table alone.
                Names::Any => return Ok(None),
            },
            FileContent::EqualityDeletes => return Ok(None),
        }
    }
    let live: HashSet<&str> = entries
        .iter()
        .map(|e| e.data_file.file_path.as_str())
        .collect();
    counts.keep(table, &live);
    let mut read = ReadDeletes::default();
    let columns = lent.columns.clone();
    let key_columns = lent.key_columns.clone();
    let mut budget = policy.budget_bytes;
    let started = std::time::Instant::now();
    let (mut written, mut removed, mut rewrites) = (Vec::new(), Vec::new(), Vec::new());
    // Lent in the order of their partitions.
    let mut shards: Vec<&mut LentShard> = lent.shards.iter_mut().collect();
    let len = shards.len().max(1);
    shards.rotate_left(rotation % len);
    for shard in shards {
        let jobs = plan(shard.id, &data, &deletes_of, policy);
        if jobs.is_empty() {
            continue;
        }
        let file_ids: HashMap<String, u64> = shard
            .index()
            .files()?
            .into_iter()
            .map(|(id, p)| (p, id))
            .collect();
        let mut batch = IndexBatch::default();
        let mut rewritten: HashSet<String> = HashSet::new();
        let mut consumed: BTreeMap<String, DataFile> = BTreeMap::new();
        for job in jobs {
            let first = budget == policy.budget_bytes;
            if budget <= 0 || (!first && started.elapsed() >= policy.budget_time) {
                done.backlog += job.inputs.len();
                continue;
            }
            budget -= job.bytes();
            let Some(r) = rewrite(
                table,
                shard,
                &columns,
                &key_columns,
                &file_ids,
                &job,
                &mut read,
            )
            .await?
            else {
                continue;
            };
            done.files_rewritten += job.inputs.len();
            done.bytes_rewritten += job.bytes().max(0) as u64;
            batch.entries.extend(r.moved);
            batch.files.extend(r.new_file);
            batch.removed_files.extend(r.removed_ids);
            written.extend(r.data.into_iter().chain(r.ghosts));
            rewritten.extend(job.inputs.iter().map(|f| f.file_path.clone()));
            consumed.extend(job.deletes.into_iter().map(|d| (d.file_path.clone(), d)));
            removed.extend(job.inputs);
        }
        // Every delete file naming a rewritten file goes; a grouped one leaves its other rows.
        for (_, files) in deletes_of
            .iter()
            .filter(|(target, _)| rewritten.contains(*target))
        {
            for d in files {
                consumed
                    .entry(d.file.file_path.clone())
                    .or_insert_with(|| d.file.clone());
            }
        }
        written.extend(remainders(table, shard.id, &consumed, &rewritten, &live, &mut read).await?);
        done.delete_files_removed += consumed.len();
        removed.extend(consumed.into_values());
        if !batch.removed_files.is_empty() {
            rewrites.push(ShardRewrite {
                shard: shard.id,
                source: shard.key.clone(),
                batch,
            });
        }
    }
    if rewrites.is_empty() {
        return Ok(None);
    }
    let uploads: Vec<(String, Bytes)> = written
        .iter()
        .map(|f| (f.data_file.file_path.clone(), Bytes::from(f.bytes.clone())))
        .collect();
    table.io.put_many(uploads).await?;
    inlet_common::failpoint::crash_point("compact_after_upload");
    Ok(Some(Staged {
        written,
        removed,
        rewrites,
        done,
    }))
}

/// Writes `files` as one manifest of entries with `status`.
async fn write_entries(
    table: &Table,
    entries: &[ManifestEntry],
    spec_id: i32,
) -> Result<(String, i64)> {
    let meta = &table.metadata;
    let spec = meta
        .partition_specs
        .iter()
        .find(|s| s.spec_id == spec_id)
        .ok_or_else(|| Error::metadata(format!("unknown partition spec {spec_id}")))?;
    let schema = meta.current_schema()?;
    let ptype = manifest::PartitionType::new(spec, schema)?;
    let bytes = manifest::write_manifest(entries, schema, spec, &ptype)?;
    let path = format!(
        "{}/metadata/{}-m-replace.avro",
        meta.location,
        uuid::Uuid::new_v4()
    );
    let len = bytes.len() as i64;
    table.io.put(&path, Bytes::from(bytes)).await?;
    Ok((path, len))
}

/// A manifest-list entry for a manifest written by snapshot `snapshot_id`.
#[allow(clippy::too_many_arguments)]
fn list_entry(
    table: &Table,
    path: String,
    length: i64,
    spec_id: i32,
    content: i32,
    snapshot_id: i64,
    sequence_number: i64,
    entries: &[ManifestEntry],
) -> Result<ManifestFile> {
    let count = |s: EntryStatus| entries.iter().filter(|e| e.status == s).count() as i32;
    let rows = |s: EntryStatus| {
        entries
            .iter()
            .filter(|e| e.status == s)
            .map(|e| e.data_file.record_count)
            .sum::<i64>()
    };
    let spec = table
        .metadata
        .partition_specs
        .iter()
        .find(|s| s.spec_id == spec_id)
        .ok_or_else(|| Error::metadata(format!("unknown partition spec {spec_id}")))?;
    let ptype = manifest::PartitionType::new(spec, table.metadata.current_schema()?)?;
    let files: Vec<&DataFile> = entries.iter().map(|e| &e.data_file).collect();
    Ok(ManifestFile {
        manifest_path: path,
        manifest_length: length,
        partition_spec_id: spec_id,
        content,
        sequence_number,
        min_sequence_number: entries
            .iter()
            .filter_map(|e| e.sequence_number)
            .min()
            .unwrap_or(sequence_number),
        added_snapshot_id: snapshot_id,
        added_files_count: count(EntryStatus::Added),
        existing_files_count: count(EntryStatus::Existing),
        deleted_files_count: count(EntryStatus::Deleted),
        added_rows_count: rows(EntryStatus::Added),
        existing_rows_count: rows(EntryStatus::Existing),
        deleted_rows_count: rows(EntryStatus::Deleted),
        partitions: Some(manifest::summarize_partitions(&files, &ptype)),
    })
}

/// The offsets and owner epoch a shard's source partition must still have in the table for a
/// table service's commit to land: `((topic, partition), offset, epoch)`.
pub(super) type Fence = ((String, i32), Option<i64>, i64);

/// What a table service's snapshot is, besides the files it adds and removes.
pub(super) struct Operation {
    /// Iceberg's `operation`: `replace` (no logical change) or `delete`.
    pub name: &'static str,
    /// Which service made it, recorded as [`SUMMARY_MAINTENANCE`].
    pub service: &'static str,
}

/// Commits a snapshot of `operation` adding `added_*` and removing `removed`, carrying the
/// pipeline's offsets unchanged. `Ok(None)`: definitely not committed (a removed file is gone
/// already, a fenced partition moved, or the race was lost too often).
#[allow(clippy::too_many_arguments)]
pub(super) async fn commit_rewrite(
    table: &mut Table,
    committer: &Committer,
    operation: &Operation,
    checkpoint: u64,
    fence: &[Fence],
    added_data: &[DataFile],
    added_deletes: &[DataFile],
    removed: &[DataFile],
) -> Result<Option<Marker>> {
    const ATTEMPTS: u32 = 10;
    let gone: HashSet<&str> = removed.iter().map(|f| f.file_path.as_str()).collect();
    for attempt in 1..=ATTEMPTS {
        if attempt > 1 {
            table.refresh().await?;
        }
        let base = table.metadata.clone();
        if let Some(s) = base.lineage().find(|s| {
            s.summary.get(SUMMARY_WRITER) == Some(&committer.writer_id)
                && s.checkpoint_id() == Some(checkpoint)
                && s.summary.get(SUMMARY_MAINTENANCE).map(String::as_str) == Some(operation.service)
        }) {
            return Ok(Some(Marker {
                snapshot_id: s.snapshot_id,
                sequence_number: s.sequence_number,
            }));
        }
        let offsets = table_offsets(&base, &committer.pipeline_id)?;
        // Another member owns a rewritten shard's partition now: its epoch in the table is
        // newer than this member's.
        let held = crate::commit::table_epochs(&base, &committer.pipeline_id)?;
        let moved = fence.iter().any(|((topic, p), at, mine)| {
            offsets.get(topic).and_then(|o| o.get(p)).copied() != *at
                || held
                    .get(topic)
                    .and_then(|o| o.get(p))
                    .is_some_and(|e| e > mine)
        });
        let Some(parent) = base.current_snapshot().filter(|_| !moved) else {
            return Ok(None);
        };
        let snapshot_id = base.new_snapshot_id();
        let sequence_number = base.last_sequence_number + 1;
        let spec_id = base.default_spec()?.spec_id;
        let schema = base.current_schema()?;
        let mut list = Vec::new();
        let mut scratch = Vec::new();
        for (files, content) in [(added_data, 0), (added_deletes, 1)] {
            if files.is_empty() {
                continue;
            }
            let entries: Vec<ManifestEntry> = files
                .iter()
                .map(|f| ManifestEntry {
                    status: EntryStatus::Added,
                    snapshot_id: Some(snapshot_id),
                    sequence_number: Some(sequence_number),
                    file_sequence_number: Some(sequence_number),
                    data_file: f.clone(),
                })
                .collect();
            let (path, len) = write_entries(table, &entries, spec_id).await?;
            scratch.push(path.clone());
            list.push(list_entry(
                table,
                path,
                len,
                spec_id,
                content,
                snapshot_id,
                sequence_number,
                &entries,
            )?);
        }
        let mut found = 0;
        for m in manifest::read_manifest_list(&table.io.get(&parent.manifest_list).await?)? {
            let ptype = table.manifest_partition_type(&m, schema)?;
            let entries = manifest::read_manifest(&table.io.get(&m.manifest_path).await?, &ptype)?;
            let hits = entries
                .iter()
                .filter(|e| {
                    e.status != EntryStatus::Deleted
                        && gone.contains(e.data_file.file_path.as_str())
                })
                .count();
            if hits == 0 {
                list.push(m);
                continue;
            }
            found += hits;
            let rewritten: Vec<ManifestEntry> = entries
                .into_iter()
                .filter(|e| e.status != EntryStatus::Deleted)
                .map(|e| {
                    let removed = gone.contains(e.data_file.file_path.as_str());
                    ManifestEntry {
                        status: if removed {
                            EntryStatus::Deleted
                        } else {
                            EntryStatus::Existing
                        },
                        snapshot_id: Some(if removed {
                            snapshot_id
                        } else {
                            e.snapshot_id.unwrap_or(m.added_snapshot_id)
                        }),
                        sequence_number: Some(e.sequence_number.unwrap_or(m.sequence_number)),
                        file_sequence_number: Some(
                            e.file_sequence_number.unwrap_or(m.sequence_number),
                        ),
                        data_file: e.data_file,
                    }
                })
                .collect();
            let (path, len) = write_entries(table, &rewritten, m.partition_spec_id).await?;
            scratch.push(path.clone());
            list.push(list_entry(
                table,
                path,
                len,
                m.partition_spec_id,
                m.content,
                snapshot_id,
                sequence_number,
                &rewritten,
            )?);
        }
        let cleanup = |table: &Table, scratch: Vec<String>| {
            let io = table.io.clone();
            async move {
                for f in scratch {
                    let _ = io.delete(&f).await;
                }
            }
        };
        if found != gone.len() {
            cleanup(table, scratch).await;
            return Ok(None);
        }
        let bytes = manifest::write_manifest_list(
            &list,
            snapshot_id,
            Some(parent.snapshot_id),
            sequence_number,
        );
        let list_path = format!(
            "{}/metadata/snap-{snapshot_id}-{attempt}-{}.avro",
            base.location,
            uuid::Uuid::new_v4()
        );
        table.io.put(&list_path, Bytes::from(bytes)).await?;
        scratch.push(list_path.clone());
        let mut summary = summary(
            parent,
            committer,
            checkpoint,
            &offsets,
            added_data,
            added_deletes,
            removed,
        )?;
        summary.insert("operation".into(), operation.name.into());
        summary.insert(SUMMARY_MAINTENANCE.into(), operation.service.into());
        // The pipeline's owner epochs, index copies and watermarks stay what its last snapshot
        // says.
        if let Some(last) = base.last_snapshot_of(&committer.pipeline_id) {
            for key in [
                inlet_iceberg::keys::SUMMARY_EPOCHS,
                inlet_iceberg::keys::SUMMARY_SHARD_TOPIC,
                inlet_iceberg::keys::SUMMARY_INDEX_COPIES,
                inlet_iceberg::keys::SUMMARY_WATERMARKS,
            ] {
                if let Some(v) = last.summary.get(key) {
                    summary.insert(key.into(), v.clone());
                }
            }
        }
        let now = now_ms()
            .max(base.last_updated_ms + 1)
            .max(parent.timestamp_ms + 1);
        let mut next = base.clone();
        next.snapshots.push(Snapshot {
            snapshot_id,
            parent_snapshot_id: Some(parent.snapshot_id),
            sequence_number,
            timestamp_ms: now,
            manifest_list: list_path,
            summary,
            schema_id: Some(next.current_schema_id),
            extra: Default::default(),
        });
        next.last_sequence_number = sequence_number;
        next.last_updated_ms = now;
        next.current_snapshot_id = Some(snapshot_id);
        next.snapshot_log.push(SnapshotLogEntry {
            timestamp_ms: now,
            snapshot_id,
        });
        for (name, kind) in [
            ("main".to_string(), "branch"),
            (pipeline_tag(&committer.pipeline_id), "tag"),
        ] {
            next.refs
                .entry(name)
                .or_insert_with(|| SnapshotRef {
                    snapshot_id,
                    kind: kind.into(),
                    extra: Default::default(),
                })
                .snapshot_id = snapshot_id;
        }
        if inlet_iceberg::commit_tables(&mut [&mut *table], vec![next]).await? {
            return Ok(Some(Marker {
                snapshot_id,
                sequence_number,
            }));
        }
        cleanup(table, scratch).await;
    }
    Ok(None)
}

/// A table service's snapshot summary: Iceberg's counts, and inlet's offsets and ids.
fn summary(
    parent: &Snapshot,
    committer: &Committer,
    checkpoint: u64,
    offsets: &crate::commit::Offsets,
    added_data: &[DataFile],
    added_deletes: &[DataFile],
    removed: &[DataFile],
) -> Result<BTreeMap<String, String>> {
    let prev = |k: &str| -> i64 {
        parent
            .summary
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let sum = |files: &mut dyn Iterator<Item = &DataFile>, f: fn(&DataFile) -> i64| -> i64 {
        files.map(f).sum()
    };
    let (removed_data, removed_deletes): (Vec<&DataFile>, Vec<&DataFile>) =
        removed.iter().partition(|f| f.content == FileContent::Data);
    let records = |f: &DataFile| f.record_count;
    let size = |f: &DataFile| f.file_size_in_bytes;
    let added_records = sum(&mut added_data.iter(), records);
    let removed_records = sum(&mut removed_data.iter().copied(), records);
    let added_pos = sum(&mut added_deletes.iter(), records);
    let removed_pos = sum(&mut removed_deletes.iter().copied(), records);
    let mut s = BTreeMap::new();
    let mut put = |k: &str, v: i64| {
        s.insert(k.to_string(), v.to_string());
    };
    put("added-data-files", added_data.len() as i64);
    put("deleted-data-files", removed_data.len() as i64);
    put("added-records", added_records);
    put("deleted-records", removed_records);
    put("added-delete-files", added_deletes.len() as i64);
    put("removed-delete-files", removed_deletes.len() as i64);
    put("added-position-deletes", added_pos);
    put("removed-position-deletes", removed_pos);
    put(
        "total-data-files",
        prev("total-data-files") + added_data.len() as i64 - removed_data.len() as i64,
    );
    put(
        "total-records",
        prev("total-records") + added_records - removed_records,
    );
    put(
        "total-files-size",
        prev("total-files-size") + sum(&mut added_data.iter(), size)
            - sum(&mut removed_data.iter().copied(), size),
    );
    put(
        "total-delete-files",
        prev("total-delete-files") + added_deletes.len() as i64 - removed_deletes.len() as i64,
    );
    put(
        "total-position-deletes",
        prev("total-position-deletes") + added_pos - removed_pos,
    );
    put("total-equality-deletes", prev("total-equality-deletes"));
    s.insert("operation".into(), "replace".into());
    s.insert(SUMMARY_PIPELINE.into(), committer.pipeline_id.clone());
    s.insert(SUMMARY_WRITER.into(), committer.writer_id.clone());
    s.insert(SUMMARY_CHECKPOINT.into(), checkpoint.to_string());
    s.insert(
        SUMMARY_OFFSETS.into(),
        serde_json::to_string(offsets)
            .map_err(|e| Error::new(ErrorKind::Internal, "cannot encode offsets").with_source(e))?,
    );
    Ok(s)
}

/// Decides when compaction runs: after every checkpoint while the pipeline has time to spare,
/// after every few otherwise, and again while the source is idle and a run left files due.
pub struct Compactor {
    policy: CompactPolicy,
    every: u32,
    count: u32,
    /// Runs started, so each starts with another shard.
    runs: usize,
    when_idle: bool,
    /// Files the last run left due, and whether it committed anything.
    backlog: usize,
    progressed: bool,
    /// A checkpoint committed since the last run started (or none ran yet): files may be due
    /// that no run has counted.
    unseen: bool,
    counts: Arc<DeleteCounts>,
}

/// One compaction run, due after a checkpoint; it runs in a task of its own (see
/// [`Compactor::start`]).
pub struct CompactRun {
    policy: CompactPolicy,
    rotation: usize,
    counts: Arc<DeleteCounts>,
}

impl Compactor {
    /// The compactor `cfg` asks for; `None` when compaction is off.
    pub fn new(cfg: &crate::config::Config) -> Option<Compactor> {
        let s = &cfg.services;
        (s.compact && cfg.table.mode == crate::config::TableMode::Upsert).then(|| Compactor {
            policy: CompactPolicy {
                delete_ratio: s.compact_delete_ratio,
                max_delete_files: s.compact_max_delete_files as usize,
                small_file_bytes: (cfg.table.target_file_bytes / 4) as i64,
                target_file_bytes: cfg.table.target_file_bytes as i64,
                budget_bytes: s.compact_budget_bytes as i64,
                budget_time: std::time::Duration::from_millis(match s.compact_budget_ms {
                    0 => cfg.checkpoint.interval_ms / 5,
                    ms => ms,
                }),
            },
            every: s.compact_every_checkpoints.max(1),
            count: 0,
            runs: 0,
            when_idle: s.compact_when_idle,
            backlog: 0,
            progressed: false,
            unseen: true,
            counts: Arc::default(),
        })
    }

    /// Counts a checkpoint; true when compaction is due after it: always when the pipeline
    /// waited for the source at least half the time while the checkpoint's records were read
    /// (`spare`), so a run takes no CPU that ingestion needs, and otherwise after every
    /// `compact_every_checkpoints`.
    pub fn due(&mut self, spare: bool) -> bool {
        self.count += 1;
        self.unseen = true;
        spare || self.count % self.every == 0
    }

    /// True, while the source is idle, when a checkpoint committed since the last run, or the
    /// last run left files due and made progress: runs follow one another until none is due
    /// (or a run can do nothing more).
    pub fn due_when_idle(&self) -> bool {
        self.when_idle && (self.unseen || (self.backlog > 0 && self.progressed))
    }

    /// Records how a run ended: the files it left due, and whether it committed.
    pub fn ran(&mut self, backlog: usize, committed: bool) {
        self.backlog = backlog;
        self.progressed = committed;
    }

    /// The run due now; each starts with another shard.
    pub fn start(&mut self) -> CompactRun {
        self.runs += 1;
        self.unseen = false;
        CompactRun {
            policy: self.policy,
            rotation: self.runs,
            counts: self.counts.clone(),
        }
    }
}

impl CompactRun {
    /// Compacts `table` as checkpoint `checkpoint`, recording metrics. Errors are those of
    /// [`compact`]: the commit's outcome is unknown.
    pub async fn run(
        &self,
        table: &mut Table,
        lent: &mut Lent,
        committer: &Committer,
        checkpoint: u64,
        fence: &Offsets,
        epochs: &crate::commit::Epochs,
    ) -> Result<Compacted> {
        let started = std::time::Instant::now();
        let m = crate::metrics::metrics();
        let result = compact(
            table,
            lent,
            committer,
            checkpoint,
            &self.policy,
            fence,
            epochs,
            self.rotation,
            &self.counts,
        )
        .await;
        m.maintain_duration
            .with_label_values(&[crate::metrics::service::COMPACT])
            .set(started.elapsed().as_secs_f64());
        match &result {
            Ok(done) => {
                m.maintain_runs
                    .with_label_values(&[crate::metrics::service::COMPACT, "ok"])
                    .inc();
                m.maintain_last_success
                    .with_label_values(&[crate::metrics::service::COMPACT])
                    .set(now_ms() as f64 / 1000.0);
                m.compact_files_rewritten
                    .inc_by(done.files_rewritten as u64);
                m.compact_bytes_rewritten.inc_by(done.bytes_rewritten);
                m.compact_deletes_removed
                    .inc_by(done.delete_files_removed as u64);
                m.compact_backlog.set(done.backlog as i64);
                if let Some(snapshot_id) = done.snapshot_id {
                    tracing::info!(
                        table = %format!("{}.{}", table.namespace, table.name),
                        snapshot_id,
                        files = done.files_rewritten,
                        bytes = done.bytes_rewritten,
                        delete_files = done.delete_files_removed,
                        backlog = done.backlog,
                        "Compacted"
                    );
                }
            }
            Err(_) => {
                m.maintain_runs
                    .with_label_values(&[crate::metrics::service::COMPACT, "failed"])
                    .inc();
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inlet_iceberg::types::Value;

    fn file(content: FileContent, path: &str, rows: i64, bytes: i64) -> DataFile {
        DataFile {
            content,
            file_path: path.to_string(),
            file_format: "PARQUET".into(),
            partition: vec![Value::Int(1)],
            record_count: rows,
            file_size_in_bytes: bytes,
            column_sizes: BTreeMap::new(),
            value_counts: BTreeMap::new(),
            null_value_counts: BTreeMap::new(),
            nan_value_counts: BTreeMap::new(),
            lower_bounds: BTreeMap::new(),
            upper_bounds: BTreeMap::new(),
            split_offsets: None,
            sort_order_id: None,
        }
    }

    fn names(job: &Job) -> Vec<&str> {
        job.inputs
            .iter()
            .map(|f| f.file_path.rsplit('/').next().unwrap())
            .collect()
    }

    /// Small files due for their deletes pack with the small files beside them instead of
    /// each becoming a file of its own; a large one is rewritten alone, first; a lone small
    /// file is left alone unless its deletes make it due.
    #[test]
    fn small_files_with_deletes_pack_with_their_neighbours() {
        let policy = CompactPolicy {
            delete_ratio: 0.1,
            max_delete_files: 2,
            small_file_bytes: 1_000,
            target_file_bytes: 4_000,
            budget_bytes: i64::MAX,
            budget_time: std::time::Duration::from_secs(60),
        };
        let data = [
            file(FileContent::Data, "t/d=1/b0/s00000-a.parquet", 100, 500),
            file(FileContent::Data, "t/d=1/b0/s00000-b.parquet", 100, 500),
            file(FileContent::Data, "t/d=1/b0/s00000-c.parquet", 100, 500),
            file(
                FileContent::Data,
                "t/d=1/b0/s00000-big.parquet",
                1000,
                50_000,
            ),
            file(FileContent::Data, "t/d=1/b1/s00000-lone.parquet", 100, 500),
            file(FileContent::Data, "t/d=1/b2/s00000-due.parquet", 100, 500),
            file(FileContent::Data, "t/d=1/b3/s00001-other.parquet", 100, 500),
        ];
        let deletes = [
            file(FileContent::PositionDeletes, "t/d=1/b0/del-a", 50, 100),
            file(FileContent::PositionDeletes, "t/d=1/b0/del-big", 500, 100),
            file(FileContent::PositionDeletes, "t/d=1/b2/del-due", 20, 100),
        ];
        let mut deletes_of: DeletesOf = HashMap::new();
        for (target, d) in [(0, 0), (3, 1), (5, 2)] {
            deletes_of
                .entry(data[target].file_path.clone())
                .or_default()
                .push(Naming {
                    file: &deletes[d],
                    rows: deletes[d].record_count,
                    born: false,
                });
        }
        let refs: Vec<&DataFile> = data.iter().collect();
        let jobs = plan(0, &refs, &deletes_of, &policy);
        let planned: Vec<(Vec<&str>, usize)> =
            jobs.iter().map(|j| (names(j), j.deletes.len())).collect();
        assert_eq!(
            planned,
            vec![
                (vec!["s00000-big.parquet"], 1),
                (
                    vec!["s00000-a.parquet", "s00000-b.parquet", "s00000-c.parquet"],
                    1
                ),
                (vec!["s00000-due.parquet"], 1),
            ]
        );
    }
    /// A grouped delete file counts for each file it names by the rows it deletes there, and
    /// is in every job rewriting one of them, once.
    #[test]
    fn a_grouped_delete_file_makes_due_only_the_files_it_deletes_much_of() {
        let policy = CompactPolicy {
            delete_ratio: 0.3,
            max_delete_files: 3,
            small_file_bytes: 1_000,
            target_file_bytes: 4_000,
            budget_bytes: i64::MAX,
            budget_time: std::time::Duration::from_secs(60),
        };
        let data = [
            file(FileContent::Data, "t/d=1/b0/s00000-a.parquet", 100, 50_000),
            file(FileContent::Data, "t/d=1/b0/s00000-b.parquet", 100, 50_000),
            file(FileContent::Data, "t/d=1/b1/s00000-c.parquet", 100, 50_000),
        ];
        let grouped = file(
            FileContent::PositionDeletes,
            "t/d=1/s00000-deletes-x.parquet",
            90,
            100,
        );
        let mut deletes_of: DeletesOf = HashMap::new();
        for (target, rows) in [(0, 40), (1, 10), (2, 40)] {
            deletes_of
                .entry(data[target].file_path.clone())
                .or_default()
                .push(Naming {
                    file: &grouped,
                    rows,
                    born: false,
                });
        }
        let refs: Vec<&DataFile> = data.iter().collect();
        let jobs = plan(0, &refs, &deletes_of, &policy);
        let planned: Vec<(Vec<&str>, usize)> =
            jobs.iter().map(|j| (names(j), j.deletes.len())).collect();
        assert_eq!(
            planned,
            vec![(vec!["s00000-a.parquet"], 1), (vec!["s00000-c.parquet"], 1)]
        );
    }

    /// A rewrite keeps tombstone rows deleted by a delete file of its own snapshot: those do
    /// not make the new file due however many they are, or the next run would rewrite it
    /// again, forever. A later delete does, by its own rows.
    #[test]
    fn deletes_a_rewrite_kept_do_not_make_its_file_due_again() {
        let policy = CompactPolicy {
            delete_ratio: 0.3,
            max_delete_files: 3,
            small_file_bytes: 1_000,
            target_file_bytes: 4_000,
            budget_bytes: i64::MAX,
            budget_time: std::time::Duration::from_secs(60),
        };
        let data = [
            file(
                FileContent::Data,
                "t/d=1/b0/s00000-kept.parquet",
                100,
                50_000,
            ),
            file(
                FileContent::Data,
                "t/d=1/b1/s00000-later.parquet",
                100,
                50_000,
            ),
        ];
        let own = file(FileContent::PositionDeletes, "t/d=1/b0/del-own", 80, 100);
        let later = file(FileContent::PositionDeletes, "t/d=1/b1/del-later", 30, 100);
        let mut deletes_of: DeletesOf = HashMap::new();
        for target in &data {
            deletes_of
                .entry(target.file_path.clone())
                .or_default()
                .push(Naming {
                    file: &own,
                    rows: 80,
                    born: true,
                });
        }
        deletes_of
            .get_mut(&data[1].file_path)
            .unwrap()
            .push(Naming {
                file: &later,
                rows: 30,
                born: false,
            });
        let refs: Vec<&DataFile> = data.iter().collect();
        let jobs = plan(0, &refs, &deletes_of, &policy);
        let planned: Vec<(Vec<&str>, usize)> =
            jobs.iter().map(|j| (names(j), j.deletes.len())).collect();
        assert_eq!(planned, vec![(vec!["s00000-later.parquet"], 2)]);
    }
}
