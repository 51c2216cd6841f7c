//! Committing a checkpoint: one manifest for the checkpoint's files, one snapshot carrying the
//! pipeline's full offset map and owner epochs, swapped in through the catalog. Two fences
//! guard it. The offsets: a checkpoint commits only if the table holds, for every partition it
//! read, exactly the offset it started from (all of them at their end means it already landed;
//! a mix is another writer's work and a conflict). The epochs: a member that takes partitions
//! over first commits a claim raising their epochs, so a member that lost them (paused past its
//! session timeout, cut off from the group) can never commit them again, whatever its offsets.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use inlet_common::error::{Error, ErrorKind, Result};
use inlet_iceberg::keys::{
    SUMMARY_CHECKPOINT, SUMMARY_EPOCHS, SUMMARY_INDEX_COPIES, SUMMARY_OFFSETS, SUMMARY_PIPELINE,
    SUMMARY_SHARD_TOPIC, SUMMARY_SOURCE_TS, SUMMARY_WATERMARKS, SUMMARY_WRITER,
};
use inlet_iceberg::manifest::{
    self, DataFile, EntryStatus, FileContent, ManifestEntry, ManifestFile,
};
use inlet_iceberg::metadata::{
    pipeline_tag, Schema, Snapshot, SnapshotLogEntry, SnapshotRef, TableMetadata,
};
use inlet_iceberg::{now_ms, Table};

/// URIs of index-copy manifests: topic → partition → URI.
pub type CopyPointers = BTreeMap<String, BTreeMap<i32, String>>;

/// The copies the pipeline's newest snapshot points at.
pub fn copy_pointers(meta: &TableMetadata, pipeline: &str) -> Result<CopyPointers> {
    let Some(text) = meta
        .last_snapshot_of(pipeline)
        .and_then(|s| s.summary.get(SUMMARY_INDEX_COPIES))
    else {
        return Ok(CopyPointers::new());
    };
    serde_json::from_str(text).map_err(|e| {
        Error::metadata(format!("unreadable {SUMMARY_INDEX_COPIES}: {text}")).with_source(e)
    })
}

/// Source offsets: topic → partition → next offset to read.
pub type Offsets = BTreeMap<String, BTreeMap<i32, i64>>;

/// Owner epochs: topic → partition → epoch of the member that owns it.
pub type Epochs = BTreeMap<String, BTreeMap<i32, i64>>;

/// What one checkpoint commits.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Increasing per writer.
    pub id: u64,
    /// Data files already uploaded.
    pub files: Vec<DataFile>,
    /// Position-delete files already uploaded.
    pub deletes: Vec<DataFile>,
    /// For each partition the checkpoint read: the offset the table held when reading began.
    pub start: Offsets,
    /// For each partition the checkpoint read: the next offset after its last record.
    pub end: Offsets,
    /// A schema the checkpoint's files use that the table does not have yet; it becomes the
    /// current schema in the same commit.
    pub schema: Option<SchemaChange>,
    /// The owner epoch of each partition the checkpoint read (a partition without one has never
    /// been claimed). The table must not hold a newer one.
    pub epochs: Epochs,
    /// A claim: no files, it raises `epochs` above what the table holds.
    pub claim: bool,
    /// Index copies uploaded since the last commit, recorded in the snapshot for the
    /// partitions' next owners.
    pub copies: CopyPointers,
    /// The newest source timestamp (ms) of the changes committed, so freshness is known again
    /// after a restart; the snapshot keeps the newest of this and its parent's.
    pub source_ms: Option<i64>,
    /// Upsert tables: each shard whose rows the checkpoint writes or deletes, with the snapshot
    /// its index was level with when the checkpoint was prepared (`None`: an empty table).
    pub index_markers: Vec<(u32, Option<i64>)>,
    /// Upsert tables: the topic whose partitions are the table's shards.
    pub shard_topic: Option<String>,
    /// Watermarks (ms) of source partitions this checkpoint speaks for: the newest source time
    /// of the changes it read from one, or its own time for an owned idle one. They replace
    /// what the table held: a partition taken for idle that turns out to have records goes
    /// back to their time.
    pub watermarks: Watermarks,
}

/// Watermarks: topic → partition → ms since the epoch.
pub type Watermarks = BTreeMap<String, BTreeMap<i32, i64>>;

/// The watermarks the table records for `pipeline`.
pub fn table_watermarks(meta: &TableMetadata, pipeline: &str) -> Result<Watermarks> {
    let Some(s) = meta.last_snapshot_of(pipeline) else {
        return Ok(Watermarks::new());
    };
    match s.summary.get(SUMMARY_WATERMARKS) {
        None => Ok(Watermarks::new()),
        Some(v) => serde_json::from_str(v).map_err(|e| {
            Error::metadata(format!(
                "snapshot {} has unreadable {SUMMARY_WATERMARKS}: {e}",
                s.snapshot_id
            ))
        }),
    }
}

/// A schema change made by the pipeline: the new schema and what it was made from, so a commit
/// rebased on another writer's schema change applies only this change's own part.
#[derive(Debug, Clone)]
pub struct SchemaChange {
    pub schema: Schema,
    /// The current schema id when the change was made.
    pub base_schema_id: i32,
    /// The table's `last-column-id` then: ids above it are this change's new columns.
    pub base_last_column_id: i32,
}

/// A manifest written for a checkpoint, with what its manifest-list entry needs.
struct WrittenManifest {
    path: String,
    length: i64,
    deletes: bool,
    files: i32,
    rows: i64,
    partitions: Vec<manifest::FieldSummary>,
}

/// One table's part of a commit attempt.
enum Staged {
    /// The checkpoint's snapshot is already in the table.
    Landed(i64),
    /// Metadata to swap in, and the manifest list it references.
    Next {
        next: Box<TableMetadata>,
        snapshot_id: i64,
        list_path: String,
        /// Manifests merged for this attempt (garbage if it does not land).
        merged: Vec<String>,
    },
}

/// How a commit ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitOutcome {
    /// A new snapshot was committed.
    Committed { snapshot_id: i64, attempts: u32 },
    /// An earlier attempt of the same checkpoint had landed.
    AlreadyCommitted { snapshot_id: i64 },
}

/// Commits checkpoints of one pipeline.
#[derive(Debug, Clone)]
pub struct Committer {
    pub pipeline_id: String,
    pub writer_id: String,
    /// Attempts after losing the compare-and-swap to other writers.
    pub retries: u32,
    /// How long catalog and storage failures are retried.
    pub retry_for: Duration,
}

/// The offsets the table records for `pipeline`.
pub fn table_offsets(meta: &TableMetadata, pipeline: &str) -> Result<Offsets> {
    meta.last_snapshot_of(pipeline)
        .map_or_else(|| Ok(Offsets::new()), |s| s.offsets())
}

/// The topic whose partitions are the upsert table's shards, as `pipeline` last committed it
/// (`None` before its first commit, and for tables written before this was recorded).
pub fn table_shard_topic(meta: &TableMetadata, pipeline: &str) -> Option<String> {
    meta.last_snapshot_of(pipeline)?
        .summary
        .get(SUMMARY_SHARD_TOPIC)
        .cloned()
}

/// The owner epochs the table records for `pipeline`.
pub fn table_epochs(meta: &TableMetadata, pipeline: &str) -> Result<Epochs> {
    meta.last_snapshot_of(pipeline)
        .map_or_else(|| Ok(Epochs::new()), |s| s.epochs())
}

fn offset_of(o: &Offsets, topic: &str, partition: i32) -> Option<i64> {
    o.get(topic)?.get(&partition).copied()
}

/// Compares the table's offsets and epochs with the checkpoint's: `Ok(true)` if the checkpoint
/// can commit, `Ok(false)` if it already committed, and a conflict naming the partition if
/// another member owns it now or has moved any of its partitions: a checkpoint commits only
/// where the table holds, for every partition it read, exactly the offset it started from.
fn check_fence(table: &Offsets, epochs: &Epochs, cp: &Checkpoint) -> Result<bool> {
    let conflict = |message: String| Error::new(ErrorKind::CommitConflict, message);
    for (topic, parts) in &cp.epochs {
        for (p, mine) in parts {
            let now = offset_of(epochs, topic, *p).unwrap_or(0);
            let lost = if cp.claim { now >= *mine } else { now > *mine };
            if lost {
                return Err(conflict(format!(
                    "partition {topic}/{p} belongs to a newer owner (epoch {now} in the table, this member holds {mine}); this member gives it up and its records are read by the owner"
                )));
            }
        }
    }
    let (mut at_start, mut at_end) = (Vec::new(), Vec::new());
    for (topic, parts) in &cp.end {
        for (p, end) in parts {
            let now = offset_of(table, topic, *p);
            let start = offset_of(&cp.start, topic, *p);
            if start == Some(*end) {
                // Nothing read: both ends hold.
                continue;
            }
            if now == start {
                at_start.push(format!("{topic}/{p}"));
            } else if now == Some(*end) {
                at_end.push(format!("{topic}/{p}"));
            } else {
                return Err(conflict(format!(
                    "partition {topic}/{p} was committed by another writer (table offset {now:?}, this checkpoint read from {start:?}); its records will be read again"
                )));
            }
        }
    }
    if !at_start.is_empty() && !at_end.is_empty() {
        return Err(conflict(format!(
            "another writer advanced part of this checkpoint's partitions ({} at their end, {} where this checkpoint started); its records will be read again",
            at_end.join(" "),
            at_start.join(" ")
        )));
    }
    Ok(at_end.is_empty())
}

/// Makes the change's schema current in `meta`: reused if the table already has it (a retried
/// commit), added if the table's schema is still the one the change was made from, and merged
/// otherwise: another writer's renames, drops, widenings and new columns stay, and only this
/// change's own new columns and widenings are added. A change that cannot merge (one field id
/// for two columns, or a type no promotion joins) is a conflict: the checkpoint is dropped and
/// its records are read again with the table's schema.
fn adopt_schema(meta: &mut TableMetadata, change: &SchemaChange) -> Result<()> {
    if let Some(same) = meta
        .schemas
        .iter()
        .find(|s| s.fields == change.schema.fields)
    {
        meta.current_schema_id = same.schema_id;
        return Ok(());
    }
    let current = meta.current_schema()?;
    let mut schema = if current.schema_id == change.base_schema_id
        && meta.last_column_id == change.base_last_column_id
    {
        change.schema.clone()
    } else {
        merge_schema(meta, current, change)?
    };
    schema.schema_id = meta.schemas.iter().map(|s| s.schema_id).max().unwrap_or(0) + 1;
    meta.last_column_id = meta
        .last_column_id
        .max(schema.fields.iter().map(|f| f.id).max().unwrap_or(0));
    meta.current_schema_id = schema.schema_id;
    meta.schemas.push(schema);
    Ok(())
}

/// The table's current schema with the change's own additions and widenings applied.
fn merge_schema(meta: &TableMetadata, current: &Schema, change: &SchemaChange) -> Result<Schema> {
    let conflict = |why: String| {
        Error::new(
            ErrorKind::CommitConflict,
            format!("another writer changed the table's schema: {why}; the checkpoint's records will be read again"),
        )
    };
    let mut merged = current.clone();
    for f in &change.schema.fields {
        if f.id > change.base_last_column_id {
            // A column this change adds, with an id the change allocated.
            if f.id <= meta.last_column_id {
                return Err(conflict(format!(
                    "field id {} of new column \"{}\" was taken meanwhile",
                    f.id, f.name
                )));
            }
            if merged.fields.iter().any(|c| c.name == f.name) {
                return Err(conflict(format!(
                    "column \"{}\" was added meanwhile with another field id",
                    f.name
                )));
            }
            let at = inlet_iceberg::metadata::new_column_position(&merged.fields);
            merged.fields.insert(at, f.clone());
        } else if let Some(c) = merged.fields.iter_mut().find(|c| c.id == f.id) {
            // The same column, perhaps renamed: the table's name stays, the wider type wins.
            if c.ty != f.ty {
                let (theirs, ours) = (c.primitive()?, f.primitive()?);
                if inlet_iceberg::widened(theirs, ours) {
                    c.ty = f.ty.clone();
                } else if !inlet_iceberg::widened(ours, theirs) {
                    return Err(conflict(format!(
                        "column {} is {theirs} in the table and {ours} in this checkpoint",
                        c.name
                    )));
                }
            }
        }
        // Otherwise another writer dropped the column; it stays dropped.
    }
    Ok(merged)
}

/// Whether a snapshot is one of `pipeline`'s own checkpoints, which change only the shards
/// whose index batches they carry.
fn own_checkpoint(s: &Snapshot, pipeline: &str) -> bool {
    s.summary.get(SUMMARY_PIPELINE).map(String::as_str) == Some(pipeline)
        && s.summary.get("operation").map(String::as_str) != Some("replace")
        && !s
            .summary
            .contains_key(inlet_iceberg::keys::SUMMARY_MAINTENANCE)
}

/// Fails if a shard's index may miss what another engine did after the snapshot the index was
/// level with: a snapshot after its marker (another engine's, or a compaction of a shard that
/// changed owner) that removed a data file the checkpoint's position deletes name (a rewrite or
/// a copy-on-write delete: the delete would miss the row, which lives on in the rewritten
/// file), or that added or removed files whose rows the shard's index takes (the checkpoint
/// may write again a key such a file holds). The pipeline then starts over, its index learns
/// the table anew, and the records are applied again (as Iceberg's own
/// `validateDataFilesExist` refuses such a commit). Checked on every attempt, against the
/// metadata the attempt commits on.
async fn check_indexes_level(table: &Table, pipeline: &str, cp: &Checkpoint) -> Result<()> {
    if cp.index_markers.is_empty() {
        return Ok(());
    }
    let conflict = |message: String| Error::new(ErrorKind::CommitConflict, message);
    let lineage: Vec<&Snapshot> = table.metadata.lineage().collect();
    let mut unseen: Vec<(u32, &[&Snapshot])> = Vec::with_capacity(cp.index_markers.len());
    for (shard, marker) in &cp.index_markers {
        let end = match marker {
            None => lineage.len(),
            Some(id) => lineage.iter().position(|s| s.snapshot_id == *id).ok_or_else(|| {
                conflict(format!(
                    "the index of shard {shard} was level with snapshot {id}, which is no longer in the table's history; the index is brought level with the table and the records read again"
                ))
            })?,
        };
        unseen.push((*shard, &lineage[..end]));
    }
    let mut changes: std::collections::HashMap<i64, (Vec<DataFile>, Vec<DataFile>)> =
        Default::default();
    for (_, snapshots) in &unseen {
        for s in snapshots.iter().filter(|s| !own_checkpoint(s, pipeline)) {
            if let std::collections::hash_map::Entry::Vacant(e) = changes.entry(s.snapshot_id) {
                e.insert(table.changes_of(s).await?);
            }
        }
    }
    // The files this checkpoint's deletes name: one each, or (a shard's grouped deletes) any
    // of the shard's.
    let mut targets: std::collections::HashSet<&str> = Default::default();
    let mut target_shards: std::collections::HashSet<u32> = Default::default();
    for f in &cp.deletes {
        match crate::write::deletes::names(f) {
            crate::write::deletes::Names::File(target) => {
                targets.insert(target);
            }
            crate::write::deletes::Names::ShardFiles(shard) => {
                target_shards.insert(shard);
            }
            crate::write::deletes::Names::Any => {}
        }
    }
    let named = |path: &str| {
        targets.contains(path)
            || crate::write::file_shard(path).is_some_and(|s| target_shards.contains(&s))
    };
    for (_, snapshots) in &unseen {
        for s in snapshots.iter() {
            let Some((_, removed)) = changes.get(&s.snapshot_id) else {
                continue;
            };
            if let Some(f) = removed
                .iter()
                .find(|f| f.content == FileContent::Data && named(&f.file_path))
            {
                return Err(conflict(format!(
                    "snapshot {} of another engine removed {}, whose rows this checkpoint deletes; the index is brought level with the table and the records read again",
                    s.snapshot_id, f.file_path
                )));
            }
        }
    }
    for (shard, snapshots) in &unseen {
        for s in snapshots.iter() {
            let Some((added, removed)) = changes.get(&s.snapshot_id) else {
                continue;
            };
            if let Some(f) = added
                .iter()
                .chain(removed)
                .find(|f| crate::write::touches_shard(*shard, f))
            {
                return Err(conflict(format!(
                    "snapshot {} of another engine changed {}, whose rows the index of shard {shard} takes, after the index last saw the table; the index is brought level with the table and the records read again",
                    s.snapshot_id, f.file_path
                )));
            }
        }
    }
    Ok(())
}

impl Committer {
    /// Commits `cp` to `table`, retrying conflicts and transient failures.
    pub async fn commit(&self, table: &mut Table, cp: &Checkpoint) -> Result<CommitOutcome> {
        let mut outcomes = self.commit_all(vec![(table, cp)]).await?;
        Ok(outcomes.remove(0))
    }

    /// Commits one checkpoint to several tables atomically (each table with its own files,
    /// the same offsets): the catalog swaps every table's metadata in one transaction, so
    /// after a crash either every table holds the checkpoint or none does. Retries conflicts
    /// and transient failures.
    pub async fn commit_all(
        &self,
        mut parts: Vec<(&mut Table, &Checkpoint)>,
    ) -> Result<Vec<CommitOutcome>> {
        let mut manifests = Vec::with_capacity(parts.len());
        for (table, cp) in &parts {
            let mut written = Vec::new();
            for files in [&cp.files, &cp.deletes] {
                if !files.is_empty() {
                    written.push(self.write_manifest(table, cp, files).await?);
                }
            }
            manifests.push(written);
        }
        let id = parts.first().map_or(0, |(_, cp)| cp.id);
        let started = std::time::Instant::now();
        let (mut attempt, mut conflicts, mut failures) = (0u32, 0u32, 0u32);
        loop {
            attempt += 1;
            // After a failed attempt the tables are read again; that read may fail too.
            let mut result = Ok(());
            if attempt > 1 {
                for (table, _) in parts.iter_mut() {
                    result = table.refresh().await;
                    if result.is_err() {
                        break;
                    }
                }
            }
            let result = match result {
                Ok(()) => self.try_once(&mut parts, &manifests, attempt).await,
                Err(e) => Err(e),
            };
            let delay = match result {
                Ok(Some(outcomes)) => return Ok(outcomes),
                // Lost the race: rebase on the fresh tables.
                Ok(None) => {
                    conflicts += 1;
                    crate::metrics::metrics()
                        .commit_retries
                        .with_label_values(&["conflict"])
                        .inc();
                    if conflicts >= self.retries {
                        return Err(Error::new(
                            ErrorKind::Catalog,
                            format!("checkpoint {id} did not commit after {attempt} attempts"),
                        ));
                    }
                    Duration::from_millis(50 * u64::from(conflicts.min(20)))
                }
                // A failing catalog or storage: capped exponential backoff, for as long as the
                // retry budget lasts, so a catalog restart is ridden out.
                Err(e) if e.retryable() && e.kind() != ErrorKind::CommitConflict => {
                    if started.elapsed() >= self.retry_for {
                        return Err(e.with("attempts", attempt));
                    }
                    failures += 1;
                    crate::metrics::metrics()
                        .commit_retries
                        .with_label_values(&["error"])
                        .inc();
                    crate::health::health().failed_with(&e);
                    if failures == 1 {
                        tracing::warn!(error = %e, checkpoint = id, retry_for_s = self.retry_for.as_secs(), "Commit attempt failed; retrying");
                    } else {
                        tracing::debug!(error = %e, attempt, "Commit attempt failed again");
                    }
                    Duration::from_millis(100 << (failures - 1).min(7)).min(Duration::from_secs(10))
                }
                Err(e) => return Err(e),
            };
            tokio::time::sleep(delay).await;
        }
    }

    /// One attempt: stages every table's next metadata, then swaps them all at once.
    async fn try_once(
        &self,
        parts: &mut [(&mut Table, &Checkpoint)],
        written: &[Vec<WrittenManifest>],
        attempt: u32,
    ) -> Result<Option<Vec<CommitOutcome>>> {
        let mut staged = Vec::with_capacity(parts.len());
        for ((table, cp), w) in parts.iter().zip(written) {
            staged.push(self.stage(table, cp, w, attempt).await?);
        }
        let landed: Vec<i64> = staged
            .iter()
            .filter_map(|s| match s {
                Staged::Landed(id) => Some(*id),
                Staged::Next { .. } => None,
            })
            .collect();
        if landed.len() == staged.len() {
            return Ok(Some(
                landed
                    .into_iter()
                    .map(|snapshot_id| CommitOutcome::AlreadyCommitted { snapshot_id })
                    .collect(),
            ));
        }
        if !landed.is_empty() {
            return Err(Error::new(
                ErrorKind::Internal,
                "a checkpoint is in some of its tables but not in others",
            ));
        }
        let (mut nexts, mut ids, mut lists) = (Vec::new(), Vec::new(), Vec::new());
        for s in staged {
            if let Staged::Next {
                next,
                snapshot_id,
                list_path,
                merged,
            } = s
            {
                nexts.push(*next);
                ids.push(snapshot_id);
                lists.push((list_path, merged));
            }
        }
        let mut tables: Vec<&mut Table> = parts.iter_mut().map(|(t, _)| &mut **t).collect();
        if inlet_iceberg::commit_tables(&mut tables, nexts).await? {
            Ok(Some(
                ids.into_iter()
                    .map(|snapshot_id| CommitOutcome::Committed {
                        snapshot_id,
                        attempts: attempt,
                    })
                    .collect(),
            ))
        } else {
            for (table, (list, merged)) in tables.iter().zip(&lists) {
                for file in std::iter::once(list).chain(merged) {
                    let _ = table.io.delete(file).await;
                }
            }
            Ok(None)
        }
    }

    /// Takes `partitions` over for this member: raises their owner epochs above what any of
    /// `tables` holds, in one snapshot per table committed in one transaction, so commits of
    /// their previous owner are refused from then on. Returns the epochs now held; the tables
    /// are left as the claim committed them. A race lost to another claim is run again only
    /// while `current()` says the partitions are still this member's.
    pub async fn claim(
        &self,
        mut tables: Vec<&mut Table>,
        partitions: &[(String, i32)],
        current: impl Fn() -> bool,
    ) -> Result<Epochs> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut epochs = Epochs::new();
            for (topic, p) in partitions {
                let mut held = 0;
                for t in &tables {
                    let e = table_epochs(&t.metadata, &self.pipeline_id)?;
                    held = held.max(offset_of(&e, topic, *p).unwrap_or(0));
                }
                epochs
                    .entry(topic.clone())
                    .or_default()
                    .insert(*p, held + 1);
            }
            let cp = Checkpoint {
                id: 0,
                files: vec![],
                deletes: vec![],
                start: Offsets::new(),
                end: Offsets::new(),
                schema: None,
                epochs: epochs.clone(),
                claim: true,
                copies: CopyPointers::new(),
                source_ms: None,
                index_markers: Vec::new(),
                shard_topic: None,
                watermarks: Default::default(),
            };
            let parts: Vec<(&mut Table, &Checkpoint)> =
                tables.iter_mut().map(|t| (&mut **t, &cp)).collect();
            match self.commit_all(parts).await {
                Ok(_) => return Ok(epochs),
                // Another member claimed meanwhile (a quick second rebalance): claim above it,
                // unless the partitions were revoked meanwhile and that member is their owner.
                Err(e)
                    if e.kind() == ErrorKind::CommitConflict
                        && attempt < self.retries
                        && current() =>
                {
                    tracing::debug!(error = %e, attempt, "Claim lost a race; claiming again");
                    for t in tables.iter_mut() {
                        t.refresh().await?;
                    }
                }
                Err(e) => return Err(e.with("while", "claiming partitions")),
            }
        }
    }

    /// Writes one manifest of `files` (all data or all deletes); sequence numbers and snapshot
    /// id are inherited, so retries reuse it.
    async fn write_manifest(
        &self,
        table: &Table,
        cp: &Checkpoint,
        files: &[DataFile],
    ) -> Result<WrittenManifest> {
        let meta = &table.metadata;
        let schema = match &cp.schema {
            Some(s) => &s.schema,
            None => meta.current_schema()?,
        };
        let entries: Vec<ManifestEntry> = files
            .iter()
            .map(|f| ManifestEntry {
                status: EntryStatus::Added,
                snapshot_id: None,
                sequence_number: None,
                file_sequence_number: None,
                data_file: f.clone(),
            })
            .collect();
        let bytes = manifest::write_manifest(
            &entries,
            schema,
            meta.default_spec()?,
            &table.partition_type()?,
        )?;
        let path = format!(
            "{}/metadata/{}-m0.avro",
            meta.location,
            uuid::Uuid::new_v4()
        );
        let length = bytes.len() as i64;
        table.io.put(&path, Bytes::from(bytes)).await?;
        let ptype = table.partition_type()?;
        let refs: Vec<&DataFile> = files.iter().collect();
        Ok(WrittenManifest {
            path,
            length,
            deletes: files.iter().any(|f| f.content != FileContent::Data),
            files: files.len() as i32,
            rows: files.iter().map(|f| f.record_count).sum(),
            partitions: manifest::summarize_partitions(&refs, &ptype),
        })
    }

    /// Checks the fence and prepares `table`'s next metadata for `cp` (not yet swapped in).
    async fn stage(
        &self,
        table: &Table,
        cp: &Checkpoint,
        written: &[WrittenManifest],
        attempt: u32,
    ) -> Result<Staged> {
        let base = table.metadata.clone();
        let current = table_offsets(&base, &self.pipeline_id)?;
        let mut epochs = table_epochs(&base, &self.pipeline_id)?;
        let commits = check_fence(&current, &epochs, cp)?;
        if commits {
            check_indexes_level(table, &self.pipeline_id, cp).await?;
        }
        if !commits {
            let landed = base.lineage().find(|s| {
                s.summary.get(SUMMARY_WRITER) == Some(&self.writer_id)
                    && s.checkpoint_id() == Some(cp.id)
            });
            return match landed {
                Some(s) => Ok(Staged::Landed(s.snapshot_id)),
                None => Err(Error::new(
                    ErrorKind::CommitConflict,
                    format!("the table already holds the end offsets of checkpoint {} but not its snapshot", cp.id),
                )),
            };
        }
        let snapshot_id = base.new_snapshot_id();
        let sequence_number = base.last_sequence_number + 1;
        let parent = base.current_snapshot();
        let parent_manifests = match parent {
            Some(p) => manifest::read_manifest_list(&table.io.get(&p.manifest_list).await?)?,
            None => Vec::new(),
        };
        // The list stays bounded: small manifests of earlier commits merge now and then.
        let merged = inlet_iceberg::merge::merge_manifests(
            table,
            parent_manifests,
            snapshot_id,
            sequence_number,
        )
        .await?;
        let mut manifests = merged.manifests;
        let spec_id = base.default_spec()?.spec_id;
        for (i, m) in written.iter().enumerate() {
            manifests.insert(
                i,
                ManifestFile {
                    manifest_path: m.path.clone(),
                    manifest_length: m.length,
                    partition_spec_id: spec_id,
                    content: i32::from(m.deletes),
                    sequence_number,
                    min_sequence_number: sequence_number,
                    added_snapshot_id: snapshot_id,
                    added_files_count: m.files,
                    existing_files_count: 0,
                    deleted_files_count: 0,
                    added_rows_count: m.rows,
                    existing_rows_count: 0,
                    deleted_rows_count: 0,
                    partitions: Some(m.partitions.clone()),
                },
            );
        }
        let list = manifest::write_manifest_list(
            &manifests,
            snapshot_id,
            parent.map(|p| p.snapshot_id),
            sequence_number,
        );
        let list_path = format!(
            "{}/metadata/snap-{snapshot_id}-{attempt}-{}.avro",
            base.location,
            uuid::Uuid::new_v4()
        );
        table.io.put(&list_path, Bytes::from(list)).await?;

        let mut offsets = current;
        for (topic, parts) in &cp.end {
            offsets.entry(topic.clone()).or_default().extend(parts);
        }
        for (topic, parts) in &cp.epochs {
            epochs.entry(topic.clone()).or_default().extend(parts);
        }
        let mut summary = self.summary(parent, cp, &offsets, &epochs)?;
        let shard_topic = cp
            .shard_topic
            .clone()
            .or_else(|| table_shard_topic(&base, &self.pipeline_id));
        if let Some(topic) = shard_topic {
            summary.insert(SUMMARY_SHARD_TOPIC.into(), topic);
        }
        let mut watermarks = table_watermarks(&base, &self.pipeline_id)?;
        for (topic, parts) in &cp.watermarks {
            watermarks.entry(topic.clone()).or_default().extend(parts);
        }
        if !watermarks.is_empty() {
            summary.insert(
                SUMMARY_WATERMARKS.into(),
                serde_json::to_string(&watermarks).map_err(|e| {
                    Error::new(ErrorKind::Internal, "cannot encode watermarks").with_source(e)
                })?,
            );
        }
        let mut pointers = copy_pointers(&base, &self.pipeline_id)?;
        for (topic, parts) in &cp.copies {
            pointers
                .entry(topic.clone())
                .or_default()
                .extend(parts.iter().map(|(p, uri)| (*p, uri.clone())));
        }
        if !pointers.is_empty() {
            summary.insert(
                SUMMARY_INDEX_COPIES.into(),
                serde_json::to_string(&pointers).map_err(|e| {
                    Error::new(ErrorKind::Internal, "cannot encode index copies").with_source(e)
                })?,
            );
        }
        // Never before the parent or the last update, whatever this host's clock says.
        let now = now_ms()
            .max(base.last_updated_ms + 1)
            .max(parent.map_or(0, |p| p.timestamp_ms + 1));
        let mut next = base.clone();
        if let Some(change) = &cp.schema {
            adopt_schema(&mut next, change)?;
        }
        next.snapshots.push(Snapshot {
            snapshot_id,
            parent_snapshot_id: parent.map(|p| p.snapshot_id),
            sequence_number,
            timestamp_ms: now,
            manifest_list: list_path.clone(),
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
        // The branch keeps its retention settings; the tag marks the pipeline's newest commit,
        // so expiring snapshots (by any engine) keeps the offsets it carries.
        next.refs
            .entry("main".into())
            .or_insert_with(|| SnapshotRef {
                snapshot_id,
                kind: "branch".into(),
                extra: Default::default(),
            })
            .snapshot_id = snapshot_id;
        next.refs.insert(
            pipeline_tag(&self.pipeline_id),
            SnapshotRef {
                snapshot_id,
                kind: "tag".into(),
                extra: Default::default(),
            },
        );
        Ok(Staged::Next {
            next: Box::new(next),
            snapshot_id,
            list_path,
            merged: merged.written,
        })
    }

    fn summary(
        &self,
        parent: Option<&Snapshot>,
        cp: &Checkpoint,
        offsets: &Offsets,
        epochs: &Epochs,
    ) -> Result<BTreeMap<String, String>> {
        let prev = |k: &str| -> i64 {
            parent
                .and_then(|p| p.summary.get(k))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let added_records: i64 = cp.files.iter().map(|f| f.record_count).sum();
        let added_size: i64 = cp.files.iter().map(|f| f.file_size_in_bytes).sum();
        let added_deletes: i64 = cp.deletes.iter().map(|f| f.record_count).sum();
        let mut s = BTreeMap::new();
        let operation = match (cp.files.is_empty(), cp.deletes.is_empty()) {
            (_, true) => "append",
            (true, false) => "delete",
            (false, false) => "overwrite",
        };
        s.insert("operation".into(), operation.into());
        s.insert("added-data-files".into(), cp.files.len().to_string());
        s.insert("added-records".into(), added_records.to_string());
        s.insert("added-files-size".into(), added_size.to_string());
        s.insert(
            "total-data-files".into(),
            (prev("total-data-files") + cp.files.len() as i64).to_string(),
        );
        s.insert(
            "total-records".into(),
            (prev("total-records") + added_records).to_string(),
        );
        s.insert(
            "total-files-size".into(),
            (prev("total-files-size") + added_size).to_string(),
        );
        if !cp.deletes.is_empty() {
            s.insert("added-delete-files".into(), cp.deletes.len().to_string());
            s.insert(
                "added-position-delete-files".into(),
                cp.deletes.len().to_string(),
            );
            s.insert("added-position-deletes".into(), added_deletes.to_string());
        }
        let total_deletes = prev("total-delete-files") + cp.deletes.len() as i64;
        s.insert("total-delete-files".into(), total_deletes.to_string());
        let total_pos = prev("total-position-deletes") + added_deletes;
        s.insert("total-position-deletes".into(), total_pos.to_string());
        s.insert(
            "total-equality-deletes".into(),
            prev("total-equality-deletes").to_string(),
        );
        s.insert(SUMMARY_PIPELINE.into(), self.pipeline_id.clone());
        s.insert(SUMMARY_WRITER.into(), self.writer_id.clone());
        s.insert(SUMMARY_CHECKPOINT.into(), cp.id.to_string());
        let parent_source_ms = parent
            .and_then(|p| p.summary.get(SUMMARY_SOURCE_TS))
            .and_then(|v| v.parse::<i64>().ok());
        if let Some(ms) = cp.source_ms.max(parent_source_ms) {
            s.insert(SUMMARY_SOURCE_TS.into(), ms.to_string());
        }
        s.insert(
            SUMMARY_OFFSETS.into(),
            serde_json::to_string(offsets).map_err(|e| {
                Error::new(ErrorKind::Internal, "cannot encode offsets").with_source(e)
            })?,
        );
        if !epochs.is_empty() {
            s.insert(
                SUMMARY_EPOCHS.into(),
                serde_json::to_string(epochs).map_err(|e| {
                    Error::new(ErrorKind::Internal, "cannot encode epochs").with_source(e)
                })?,
            );
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offsets(v: &[(&str, i32, i64)]) -> Offsets {
        let mut o = Offsets::new();
        for (t, p, n) in v {
            o.entry(t.to_string()).or_default().insert(*p, *n);
        }
        o
    }

    fn cp(start: &[(&str, i32, i64)], end: &[(&str, i32, i64)]) -> Checkpoint {
        Checkpoint {
            schema: None,
            id: 1,
            files: vec![],
            deletes: vec![],
            start: offsets(start),
            end: offsets(end),
            epochs: Epochs::new(),
            claim: false,
            copies: CopyPointers::new(),
            source_ms: None,
            index_markers: Vec::new(),
            shard_topic: None,
            watermarks: Default::default(),
        }
    }

    fn field(id: i32, name: &str, ty: &str) -> inlet_iceberg::metadata::SchemaField {
        inlet_iceberg::metadata::SchemaField {
            id,
            name: name.into(),
            required: false,
            ty: serde_json::Value::String(ty.into()),
            doc: None,
            extra: Default::default(),
        }
    }

    fn schema(id: i32, fields: Vec<inlet_iceberg::metadata::SchemaField>) -> Schema {
        Schema {
            kind: "struct".into(),
            schema_id: id,
            identifier_field_ids: vec![],
            fields,
        }
    }

    /// Metadata whose schemas are `schemas`, the last one current.
    fn metadata(schemas: Vec<Schema>) -> TableMetadata {
        let def = inlet_iceberg::TableDefinition {
            columns: vec![],
            identifier: vec![],
            partition: vec![],
            properties: Default::default(),
        };
        let mut meta = def.new_metadata("file:///t").unwrap();
        meta.last_column_id = schemas
            .iter()
            .flat_map(|s| &s.fields)
            .map(|f| f.id)
            .max()
            .unwrap_or(0);
        meta.current_schema_id = schemas.last().unwrap().schema_id;
        meta.schemas = schemas;
        meta
    }

    #[test]
    fn a_schema_change_merges_with_another_writers_renames_drops_and_adds() {
        let base = schema(
            0,
            vec![
                field(1, "id", "long"),
                field(2, "amount", "int"),
                field(3, "gone", "string"),
            ],
        );
        // Ours: amount widened, note added as field 4.
        let ours = SchemaChange {
            schema: schema(
                1,
                vec![
                    field(1, "id", "long"),
                    field(2, "amount", "long"),
                    field(3, "gone", "string"),
                    field(4, "note", "string"),
                ],
            ),
            base_schema_id: 0,
            base_last_column_id: 3,
        };
        // Theirs: amount renamed, gone dropped, nothing added.
        let theirs = schema(
            1,
            vec![field(1, "id", "long"), field(2, "amount_eur", "int")],
        );
        let mut meta = metadata(vec![base.clone(), theirs]);
        meta.last_column_id = 3;
        adopt_schema(&mut meta, &ours).unwrap();
        let now = meta.current_schema().unwrap();
        let got: Vec<(i32, &str, String)> = now
            .fields
            .iter()
            .map(|f| (f.id, f.name.as_str(), f.ty.to_string()))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, "id", "\"long\"".to_string()),
                (2, "amount_eur", "\"long\"".to_string()),
                (4, "note", "\"string\"".to_string())
            ]
        );
        assert_eq!(meta.last_column_id, 4);

        // Theirs added a column that took field id 4: ours cannot keep it.
        let taken = schema(
            1,
            vec![
                field(1, "id", "long"),
                field(2, "amount", "int"),
                field(3, "gone", "string"),
                field(4, "extra", "string"),
            ],
        );
        let mut meta = metadata(vec![base, taken]);
        let err = adopt_schema(&mut meta, &ours).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::CommitConflict, "{err}");
    }

    #[test]
    fn fence_accepts_fresh_recognises_landed_and_rejects_stale() {
        let none = Epochs::new();
        let c = cp(&[("t", 0, 10)], &[("t", 0, 20)]);
        assert!(check_fence(&offsets(&[("t", 0, 10), ("t", 1, 5)]), &none, &c).unwrap());
        assert!(!check_fence(&offsets(&[("t", 0, 20)]), &none, &c).unwrap());
        let err = check_fence(&offsets(&[("t", 0, 15)]), &none, &c).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::CommitConflict);
        // A partition the table never saw starts from no offset.
        let first = Checkpoint {
            schema: None,
            id: 1,
            files: vec![],
            deletes: vec![],
            start: Offsets::new(),
            end: offsets(&[("t", 3, 7)]),
            epochs: Epochs::new(),
            claim: false,
            copies: CopyPointers::new(),
            source_ms: None,
            index_markers: Vec::new(),
            shard_topic: None,
            watermarks: Default::default(),
        };
        assert!(check_fence(&Offsets::new(), &none, &first).unwrap());
    }

    #[test]
    fn fence_rejects_a_partly_advanced_partition_set() {
        let none = Epochs::new();
        let c = cp(&[("t", 0, 10), ("t", 1, 30)], &[("t", 0, 20), ("t", 1, 40)]);
        // Another writer committed partition 1's records, not partition 0's.
        let err = check_fence(&offsets(&[("t", 0, 10), ("t", 1, 40)]), &none, &c).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::CommitConflict);
        assert!(err.to_string().contains("t/1"), "{err}");
        // A partition read from where it ends is at its start and at its end at once.
        let idle = cp(&[("t", 0, 10), ("t", 1, 30)], &[("t", 0, 20), ("t", 1, 30)]);
        assert!(check_fence(&offsets(&[("t", 0, 10), ("t", 1, 30)]), &none, &idle).unwrap());
        assert!(!check_fence(&offsets(&[("t", 0, 20), ("t", 1, 30)]), &none, &idle).unwrap());
    }

    #[test]
    fn fence_refuses_an_older_owner_and_a_claim_not_above_the_table() {
        let mut c = cp(&[("t", 0, 10)], &[("t", 0, 20)]);
        c.epochs = offsets(&[("t", 0, 3)]);
        let at = offsets(&[("t", 0, 10)]);
        assert!(check_fence(&at, &offsets(&[("t", 0, 3)]), &c).unwrap());
        // A table never claimed, or claimed earlier, takes this owner's epoch.
        assert!(check_fence(&at, &Epochs::new(), &c).unwrap());
        assert!(check_fence(&at, &offsets(&[("t", 0, 2)]), &c).unwrap());
        let err = check_fence(&at, &offsets(&[("t", 0, 4)]), &c).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::CommitConflict);
        assert!(err.to_string().contains("newer owner"), "{err}");
        let mut claim = cp(&[], &[]);
        claim.claim = true;
        claim.epochs = offsets(&[("t", 0, 4)]);
        assert!(check_fence(&at, &offsets(&[("t", 0, 3)]), &claim).unwrap());
        assert!(check_fence(&at, &offsets(&[("t", 0, 4)]), &claim).is_err());
    }
}
