//! The upsert side of a pipeline: one shard per owned Kafka partition, versions of changes, and opening, setting aside and advancing the shards' indexes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::row::remap;
use super::shard::{
    now_secs, set_marker, ChangeVersion, Lent, PackedRow, Shard, ShardJob, ShardLayout, SharedIndex,
};
use super::{Outcome, UpsertSpec};
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_decode::Op;
use inlet_iceberg::types::{encode_values_into, Value};
use inlet_index::{InlineBytes, KeyIndex, Marker};

/// The upsert side of a pipeline: one shard per owned Kafka partition, each with its index.
pub struct UpsertSink {
    pub spec: UpsertSpec,
    /// Positions of `table.version_columns` in a row.
    pub(super) version_columns: Vec<usize>,
    /// Order changes by the Kafka offset even where the format carries a position.
    pub(super) offset_versions: bool,
    pub(super) shards: HashMap<(String, i32), Shard>,
    /// Per partition, a retraction (Flink's `-U`) waiting for the change after it.
    pub(super) held: HashMap<(String, i32), Held>,
    /// Where a change's key is encoded, before it is kept (inline when short).
    pub(super) key_buf: Vec<u8>,
    pub(super) index_root: PathBuf,
    pub(super) index_config: crate::config::IndexConfig,
    pub(super) writer: WriterTemplate,
}

/// A retraction of a key's row (Flink's `-U`), held until the next change of its partition
/// shows whether the key stays (`+U` of the same key: one update) or goes (anything else: the
/// key changed, and the old key is deleted).
pub(super) struct Held {
    pub(super) key: InlineBytes,
    pub(super) version: ChangeVersion,
    pub(super) offset: i64,
    pub(super) before: Vec<Value>,
}

/// What every shard's checkpoint writer is made of.
#[derive(Clone)]
pub struct WriterTemplate {
    pub columns: Vec<crate::write::parquet::WriteColumn>,
    pub partition: Vec<crate::write::PartitionColumn>,
    pub location: String,
    pub target_file_bytes: u64,
}

/// The version of a change: the configured columns, then the format's position (else the
/// Kafka offset), so ties of the columns go to the later change and an exact re-send ties with
/// itself. A delete whose image lacks the configured columns takes them from the key's stored
/// version ([`ChangeVersion::Inherit`]).
pub fn version_of(
    version_columns: &[usize],
    image: &[Value],
    op: Op,
    position: Option<&inlet_decode::Version>,
    offset: i64,
) -> ChangeVersion {
    use inlet_decode::{Version, VersionPart};
    let position = match position {
        Some(v) => inlet_common::version::encode_version(v),
        None => {
            inlet_common::version::encode_version(&Version(vec![VersionPart::Int(offset as i128)]))
        }
    };
    if version_columns.is_empty() {
        return ChangeVersion::Known(position);
    }
    let values: Vec<&Value> = version_columns.iter().map(|i| &image[*i]).collect();
    if op == Op::Delete && values.iter().any(|v| v.is_null()) {
        return ChangeVersion::Inherit {
            parts: values.len(),
            suffix: position,
        };
    }
    let parts = values
        .into_iter()
        .map(|v| match v {
            Value::Int(v) | Value::Date(v) => VersionPart::Int(*v as i128),
            Value::Long(v) | Value::Time(v) | Value::Timestamp(v) | Value::TimestampTz(v) => {
                VersionPart::Int(*v as i128)
            }
            Value::Decimal(v) => VersionPart::Int(*v),
            Value::Boolean(b) => VersionPart::Int(i128::from(*b)),
            Value::String(s) => VersionPart::Text(s.clone()),
            // NULL sorts first: a record without a version never beats one with it.
            _ => VersionPart::Int(i128::MIN),
        })
        .collect();
    let mut version = inlet_common::version::encode_version(&Version(parts));
    version.extend(position);
    ChangeVersion::Known(version)
}

impl UpsertSink {
    /// A sink whose shards keep their indexes below `index_root`.
    pub fn new(
        spec: UpsertSpec,
        version_columns: Vec<usize>,
        index_root: PathBuf,
        index_config: crate::config::IndexConfig,
        writer: WriterTemplate,
    ) -> Self {
        UpsertSink {
            spec,
            version_columns,
            offset_versions: false,
            shards: HashMap::new(),
            held: HashMap::new(),
            key_buf: Vec::new(),
            index_root,
            index_config,
            writer,
        }
    }

    /// The shard of a partition, if owned.
    pub fn shard_mut(&mut self, topic: &str, partition: i32) -> Option<&mut Shard> {
        self.shards.get_mut(&(topic.to_string(), partition))
    }

    /// Where a shard's index lives.
    pub fn shard_dir(&self, topic: &str, partition: i32) -> PathBuf {
        self.index_root.join(format!("{topic}-{partition}"))
    }

    /// Opens (creating if needed) the index of a newly owned partition.
    pub fn open_shard(&mut self, topic: &str, partition: i32) -> Result<&mut Shard> {
        let dir = self.shard_dir(topic, partition);
        std::fs::create_dir_all(&dir).or_kind(ErrorKind::Storage, || {
            format!("cannot create index directory {}", dir.display())
        })?;
        let config = inlet_index::RocksConfig {
            block_cache_bytes: self.index_config.block_cache_bytes as usize,
            ttl_secs: self.index_config.ttl_secs,
            ..inlet_index::RocksConfig::default()
        };
        let shard = match open_index(&dir, partition as u32, config.clone()) {
            Err(e) if e.kind() == ErrorKind::IndexDamaged => {
                tracing::error!(
                    topic,
                    partition,
                    error = %e,
                    "The key index is damaged; moving it aside and rebuilding it from the table"
                );
                crate::metrics::metrics().index_damaged.inc();
                set_aside(&dir)?;
                open_index(&dir, partition as u32, config)?
            }
            other => other?,
        };
        let key = (topic.to_string(), partition);
        self.shards.insert(key.clone(), shard);
        self.shards
            .get_mut(&key)
            .ok_or_else(|| Error::new(ErrorKind::Internal, "shard vanished"))
    }

    /// The open shards, by partition.
    pub fn open_shards(&self) -> impl Iterator<Item = (&(String, i32), &Shard)> {
        self.shards.iter()
    }

    /// Takes an opened shard out, to recover it in a task of its own.
    pub fn take_shard(&mut self, topic: &str, partition: i32) -> Option<Shard> {
        self.shards.remove(&(topic.to_string(), partition))
    }

    /// Puts back a shard [`UpsertSink::take_shard`] took.
    pub fn put_shard(&mut self, topic: &str, partition: i32, shard: Shard) {
        self.shards.insert((topic.to_string(), partition), shard);
    }

    /// Follows a change of the table's schema: later checkpoints write `columns` (partitioned by
    /// `partition`, whose sources may have moved), rows are
    /// laid out as `spec` says (its key, version and aggregate positions), and the changes
    /// pending now are laid out anew by field id (another engine may have dropped or moved
    /// columns).
    pub fn change_layout(
        &mut self,
        spec: UpsertSpec,
        version_columns: Vec<usize>,
        columns: Vec<crate::write::parquet::WriteColumn>,
        partition: Vec<crate::write::PartitionColumn>,
    ) -> Result<()> {
        let from: Vec<i32> = self.spec.fields.iter().map(|f| f.0).collect();
        if from.iter().ne(spec.fields.iter().map(|f| &f.0))
            || self
                .spec
                .fields
                .iter()
                .zip(&spec.fields)
                .any(|(a, b)| a.1 != b.1)
        {
            for shard in self.shards.values_mut() {
                for p in shard.pending.values_mut() {
                    for row in [&mut p.row, &mut p.ghost].into_iter().flatten() {
                        *row = PackedRow::pack(&remap(row.unpack()?, &from, &spec.fields));
                    }
                    if let Some(columns) = &mut p.unresolved {
                        // Positions follow their field ids; a dropped column has none to keep.
                        *columns = columns
                            .iter()
                            .filter_map(|c| from.get(usize::from(*c)))
                            .filter_map(|id| spec.fields.iter().position(|f| f.0 == *id))
                            .map(|c| c as u16)
                            .collect();
                    }
                }
                // Remapped rows have other sizes: a later change of a key subtracts its own.
                shard.pending_bytes = shard.pending.iter().map(|(k, p)| p.bytes(k)).sum();
            }
            for h in self.held.values_mut() {
                h.before = remap(std::mem::take(&mut h.before), &from, &spec.fields);
            }
        }
        self.spec = UpsertSpec {
            shards: self.spec.shards,
            ..spec
        };
        self.version_columns = version_columns;
        self.writer.columns = columns;
        self.writer.partition = partition;
        Ok(())
    }

    /// Drops every pending change (its records will be read again); shards stay open.
    pub fn discard_all(&mut self) -> Result<()> {
        for shard in self.shards.values_mut() {
            shard.discard()?;
        }
        self.held.clear();
        Ok(())
    }

    /// Closes the shards of partitions no longer owned.
    pub fn close(&mut self, partitions: &[(String, i32)]) {
        for key in partitions {
            self.shards.remove(key);
            self.held.remove(key);
        }
    }

    /// Orders every change by its Kafka offset, ignoring the format's position.
    pub fn order_by_offset(&mut self, yes: bool) {
        self.offset_versions = yes;
    }

    /// Partitions whose last change is a held retraction, with its offset: a checkpoint commits
    /// those partitions only up to it, so that a restart reads it again.
    pub fn held_offsets(&self) -> impl Iterator<Item = (&(String, i32), i64)> {
        self.held.iter().map(|(k, h)| (k, h.offset))
    }

    /// Applies one decoded change of `topic`/`partition` at `offset`.
    ///
    /// An update whose before image names another key (Canal, Maxwell and GoldenGate carry the
    /// old key; Flink's `-U` names it) deletes the old key wherever an owned shard holds it,
    /// then writes the new one, in the same checkpoint.
    /// Applies a change of `topic`/`partition` at `offset`; `unavailable` lists the columns of its
    /// row it leaves unchanged ([`Shard::apply`]).
    pub fn accept(
        &mut self,
        topic: &str,
        partition: i32,
        offset: i64,
        record: &inlet_decode::ChangeRecord,
        unavailable: &[u16],
    ) -> Result<Outcome> {
        let shard_key = (topic.to_string(), partition);
        let position = if self.offset_versions {
            None
        } else {
            record.version.as_ref()
        };
        // Retractions are rare: most changes find none held.
        let held = if self.held.is_empty() {
            None
        } else {
            self.held.remove(&shard_key)
        };
        if record.op == Op::Update && record.after.is_none() {
            // A retraction: held until the next change shows what it means.
            if let Some(h) = held {
                self.delete_key(topic, partition, h.key, h.version, false, &h.before)?;
            }
            let before = record
                .before
                .clone()
                .ok_or_else(|| Error::decode("u: change has no image to take the key from"))?;
            let key = self.key_of(&before)?;
            let version = version_of(&self.version_columns, &before, Op::Delete, position, offset);
            self.held.insert(
                shard_key,
                Held {
                    key,
                    version,
                    offset,
                    before,
                },
            );
            return Ok(Outcome::Deferred);
        }
        let image = match record.op {
            Op::Delete => record.before.as_ref(),
            _ => record.after.as_ref(),
        }
        .ok_or_else(|| {
            Error::decode(format!(
                "{}: change has no image to take the key from",
                record.op.code()
            ))
        })?;
        let key = self.key_of(image)?;
        let version = version_of(&self.version_columns, image, record.op, position, offset);
        // Versions of other partitions compare only if they are source positions or columns.
        let comparable = position.is_some() || !self.version_columns.is_empty();
        let old_key = match (record.op, &record.before) {
            (Op::Update, Some(before)) => Some(self.key_of(before)).and_then(Result::ok),
            _ => None,
        }
        .filter(|old| *old != key);
        let rekeyed = old_key.is_some();
        if let Some(old) = old_key {
            let before = record.before.as_deref().unwrap_or_default();
            let old_version =
                version_of(&self.version_columns, before, Op::Delete, position, offset);
            self.delete_key(topic, partition, old, old_version, comparable, before)?;
        }
        match held {
            // `-U` then `+U` of the same key: one update.
            Some(h) if h.key == key => {}
            // `-U` then the change of another key: the retracted key changed or moved away.
            Some(h) => self.delete_key(topic, partition, h.key, h.version, false, &h.before)?,
            None => {}
        }
        let row = match record.op {
            Op::Delete => record.before.as_deref(),
            _ => record.after.as_deref(),
        };
        let spec = &self.spec;
        let shard = self.shards.get_mut(&shard_key).ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("record of unowned partition {topic}/{partition}"),
            )
        })?;
        // The key was moved to another key by a change of another partition, and nothing
        // orders this partition's changes against that one. Upstream the old key is gone
        // from the move until inserted again, so an update of it is older than the move; a
        // delete is too, and means the key's history before the move goes on (its insert
        // again will look like a new row), which must not pass silently. An insert is a new
        // row under the old key.
        if !comparable && !rekeyed && shard.moved_away_unordered(&key)? {
            match record.op {
                Op::Update => return Ok(Outcome::Stale),
                Op::Delete => {
                    return Err(Error::decode(
                        "the change deletes a key that a change of another partition moved to a new \
                         primary key, and without source positions or table.version_columns the two \
                         cannot be ordered: the key's changes from before the move may still be \
                         arriving, and its insert again would not be told from a new row",
                    )
                    .because(inlet_decode::reason::KEY_CHANGE_UNORDERED))
                }
                Op::Create | Op::Read => {}
            }
        }
        shard
            .apply(spec, key, version, record.op, row, unavailable)
            .map_err(|e| {
                if e.reason() != inlet_decode::reason::UNAVAILABLE_VALUE {
                    return e;
                }
                let names: Vec<&str> = unavailable
                    .iter()
                    .filter_map(|c| spec.fields.get(usize::from(*c)))
                    .filter_map(|(id, _)| self.writer.columns.iter().find(|w| w.field_id == *id))
                    .map(|w| w.name.as_str())
                    .collect();
                e.with("columns", names.join(","))
            })
    }

    /// The encoded primary key of a row; an error if a key column is null.
    pub(super) fn key_of(&mut self, row: &[Value]) -> Result<InlineBytes> {
        let values = || self.spec.key_columns.iter().map(|i| &row[*i]);
        if values().any(Value::is_null) {
            return Err(Error::decode("primary key column is null"));
        }
        self.key_buf.clear();
        encode_values_into(values(), &mut self.key_buf);
        Ok(InlineBytes::from(self.key_buf.as_slice()))
    }

    /// Deletes `key`, which a change of `topic`/`partition` moved away from, in the owned shard
    /// that holds it live. Its version orders it there if `comparable` (a source position or
    /// configured columns); otherwise it deletes the row there whatever its version. A key no
    /// owned shard holds may live in a shard another instance owns, or (every shard owned) have
    /// its insert still on its way in a lagging partition: in the second case a comparable
    /// version is recorded as the key's delete in every shard, so that insert arrives stale;
    /// otherwise that is an error, so the record goes to the errors policy rather than leave a
    /// ghost row.
    pub(super) fn delete_key(
        &mut self,
        topic: &str,
        partition: i32,
        key: InlineBytes,
        version: ChangeVersion,
        comparable: bool,
        before: &[Value],
    ) -> Result<()> {
        let here = (topic.to_string(), partition);
        let mut holder = None;
        if self
            .shards
            .get(&here)
            .is_some_and(|s| s.holds_live(&key).unwrap_or(false))
        {
            holder = Some(here.clone());
        } else {
            for (id, shard) in &self.shards {
                if id.0 == topic && *id != here && shard.holds_live(&key)? {
                    holder = Some(id.clone());
                    break;
                }
            }
        }
        let Some(holder) = holder else {
            let owned: Vec<(String, i32)> = self
                .shards
                .keys()
                .filter(|(t, _)| t == topic)
                .cloned()
                .collect();
            if owned.len() as u32 >= self.spec.shards {
                if !comparable {
                    return Err(Error::decode(
                        "the change moves a row to a new primary key, and no partition holds the old key yet: \
                         its insert may still be on its way in another partition, and without source \
                         positions or table.version_columns it could not be ordered before this change; \
                         its row could not be deleted",
                    )
                    .because(inlet_decode::reason::KEY_CHANGE_UNORDERED));
                }
                // The old key's insert may still be on its way in another partition (a lagging
                // one): every shard records the delete, so that insert arrives stale wherever
                // the key lives. A key gone already just gains a tombstone.
                let spec = self.spec.clone();
                for id in owned {
                    if let Some(shard) = self.shards.get_mut(&id) {
                        shard.apply(
                            &spec,
                            key.clone(),
                            version.clone(),
                            Op::Delete,
                            Some(before),
                            &[],
                        )?;
                    }
                }
                return Ok(());
            }
            return Err(Error::decode(
                "the change moves a row to a new primary key, and the old key may be in a partition \
                 this instance does not own; its row could not be deleted",
            )
            .because(inlet_decode::reason::KEY_CHANGE_UNOWNED));
        };
        let version = if holder == here || comparable {
            version
        } else {
            ChangeVersion::Successor
        };
        let spec = self.spec.clone();
        let shard = self
            .shards
            .get_mut(&holder)
            .ok_or_else(|| Error::new(ErrorKind::Internal, "shard vanished"))?;
        shard.apply(&spec, key, version, Op::Delete, Some(before), &[])?;
        Ok(())
    }

    /// What the pending changes hold in memory, about.
    pub fn buffered_bytes(&self) -> usize {
        self.shards.values().map(Shard::pending_bytes).sum()
    }

    /// Takes the pending changes of every shard that has some (or rows to repair) out as a
    /// checkpoint to write on other threads, and the indexes of the shards left alone, whose
    /// markers follow the checkpoint's snapshot ([`advance_idle`]).
    pub fn detach(&mut self) -> Result<(Vec<ShardJob>, Vec<SharedIndex>)> {
        let (mut jobs, mut idle) = (Vec::new(), Vec::new());
        let mut keys: Vec<&(String, i32)> = self.shards.keys().collect();
        keys.sort();
        for key in keys.into_iter().cloned().collect::<Vec<_>>() {
            let Some(shard) = self.shards.get_mut(&key) else {
                continue;
            };
            // A shard with nothing to write keeps its marker until the pipeline's own commits
            // are all that follow it.
            if shard.has_work() {
                jobs.push(shard.detach(key, &self.spec, &self.writer)?);
            } else {
                idle.push(shard.shared_index());
            }
        }
        Ok((jobs, idle))
    }

    /// Lends every owned shard to a compaction, in the order of their partitions; the shards
    /// keep taking changes, and take their layouts back ([`UpsertSink::attach`]) before the next
    /// checkpoint.
    pub fn lend(&mut self) -> Result<Lent> {
        let mut keys: Vec<(String, i32)> = self.shards.keys().cloned().collect();
        keys.sort();
        let mut shards = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(shard) = self.shards.get_mut(&key) {
                shards.push(shard.lend(key)?);
            }
        }
        Ok(Lent {
            shards,
            columns: self.writer.columns.clone(),
            key_columns: self.spec.key_columns.clone(),
        })
    }

    /// Gives the shards back the layouts their written checkpoint borrowed; a shard closed
    /// meanwhile is left closed.
    pub fn attach(&mut self, layouts: Vec<((String, i32), ShardLayout)>) {
        for (key, layout) in layouts {
            if let Some(shard) = self.shards.get_mut(&key) {
                shard.attach(layout);
            }
        }
    }

    /// Moves the marker of every shard a checkpoint left alone to its snapshot `marker`, where
    /// each snapshot after the shard's marker is `pipeline`'s own (and so changed nothing of an
    /// idle shard). An idle shard then never points at a snapshot that expiry may remove, and
    /// a restart finds it current instead of rebuilding it.
    pub fn advance_idle(
        &mut self,
        meta: &inlet_iceberg::metadata::TableMetadata,
        pipeline: &str,
        marker: Marker,
    ) -> Result<()> {
        let indexes: Vec<Arc<dyn KeyIndex>> =
            self.shards.values().map(Shard::shared_index).collect();
        advance_idle(&indexes, meta, pipeline, marker)
    }

    /// What the shards' writers are made of.
    pub fn writer_template(&self) -> &WriterTemplate {
        &self.writer
    }

    /// The owned shards, by source partition.
    pub fn shards_mut(&mut self) -> impl Iterator<Item = (&(String, i32), &mut Shard)> {
        self.shards.iter_mut()
    }
}

/// Moves the marker of each of `indexes` that a checkpoint left alone to its snapshot `marker`,
/// where each snapshot after the index's marker is `pipeline`'s own (and so changed nothing of
/// an idle shard). An idle shard then never points at a snapshot that expiry may remove, and a
/// restart finds it current instead of rebuilding it.
pub fn advance_idle(
    indexes: &[Arc<dyn KeyIndex>],
    meta: &inlet_iceberg::metadata::TableMetadata,
    pipeline: &str,
    marker: Marker,
) -> Result<()> {
    let ours = |s: &inlet_iceberg::metadata::Snapshot| {
        s.summary
            .get(inlet_iceberg::keys::SUMMARY_PIPELINE)
            .map(String::as_str)
            == Some(pipeline)
    };
    for index in indexes {
        let Some(at) = index.marker()? else {
            continue;
        };
        if at == marker {
            continue;
        }
        let mut reached = false;
        for s in meta.lineage() {
            if s.snapshot_id == at.snapshot_id {
                reached = true;
                break;
            }
            if !ours(s) {
                break;
            }
        }
        if reached {
            set_marker(index.as_ref(), marker)?;
        }
    }
    Ok(())
}

/// Opens the shard whose index lives in `dir/db`; an index marked damaged by an earlier error
/// is refused as [`ErrorKind::IndexDamaged`].
pub(super) fn open_index(dir: &Path, id: u32, config: inlet_index::RocksConfig) -> Result<Shard> {
    let db = dir.join("db");
    let marker = inlet_index::damage_marker(&db);
    if marker.exists() {
        let why = std::fs::read_to_string(&marker).unwrap_or_default();
        return Err(Error::new(
            ErrorKind::IndexDamaged,
            format!("the key index at {} was found damaged: {why}", db.display()),
        ));
    }
    let index = inlet_index::RocksIndex::open_with(&db, config)?;
    Shard::open(id, dir, Box::new(index))
}

/// Moves a damaged index to `db.damaged-<secs>` (the one kept for inspection; older ones are
/// removed) and forgets its saved batch, so a new index is rebuilt from the table.
pub(super) fn set_aside(dir: &Path) -> Result<()> {
    let io =
        |what: String| move |e: std::io::Error| Error::new(ErrorKind::Storage, what).with_source(e);
    for entry in std::fs::read_dir(dir).map_err(io(format!("cannot list {}", dir.display())))? {
        let entry = entry.map_err(io(format!("cannot list {}", dir.display())))?;
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with("db.damaged-")
        {
            std::fs::remove_dir_all(entry.path())
                .map_err(io(format!("cannot remove {}", entry.path().display())))?;
        }
    }
    let db = dir.join("db");
    if db.exists() {
        let aside = dir.join(format!("db.damaged-{}", now_secs()));
        std::fs::rename(&db, &aside).map_err(io(format!("cannot move {} aside", db.display())))?;
    }
    for file in [inlet_index::damage_marker(&db), dir.join("pending.batch")] {
        match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io(format!("cannot remove {}", file.display()))(e))
            }
            _ => {}
        }
    }
    Ok(())
}
