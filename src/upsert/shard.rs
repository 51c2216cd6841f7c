//! One shard: its index, the changes of the checkpoint being gathered, and the layout of its files (partition ids, buckets, file ids); a checkpoint's rows, deletes and index batch are prepared here.

use std::borrow::Cow;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::row::{aggregate, decode_row, encode_row};
use super::saved::{
    decode_batch, pending_file, remove_if_present, repairs_file, save_batch, SavedBatch,
};
use super::sink::{advance_idle, WriterTemplate};
use super::{Outcome, UpsertSpec, FOREIGN_BUCKET};
use crate::config::MergeEngine;
use crate::write::{file_shard, shard_file_prefix, DataWriter};
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_decode::Op;
use inlet_iceberg::transform::Transform;
use inlet_iceberg::types::{decode_values, decode_values_into, encode_values, ByteReader, Value};
use inlet_index::{IndexBatch, IndexEntry, InlineBytes, KeyIndex, Marker, RowLocation};

pub(super) struct Pending {
    pub(super) version: InlineBytes,
    /// The key had a row in the table when its change arrived: the row is looked up again when
    /// the checkpoint is written (a compaction or retention meanwhile may have moved or dropped
    /// it) and gets a position delete.
    pub(super) located: bool,
    /// The latest image; `None` once deleted.
    pub(super) row: Option<PackedRow>,
    /// A deleted key's last image, written and deleted in the same snapshot when the key has no
    /// committed row to carry its delete's version (see [`Prepared::ghosts`]).
    pub(super) ghost: Option<PackedRow>,
    /// Columns of `row` the change left unchanged (Debezium's unavailable-value placeholder)
    /// whose value only the key's committed row holds: read from it when the checkpoint is
    /// written.
    pub(super) unresolved: Option<Box<[u16]>>,
}

impl Pending {
    /// About what this change of `key` holds in memory: its map slot (at the map's usual
    /// load), and its allocations with their headers.
    pub(super) fn bytes(&self, key: &InlineBytes) -> usize {
        const SLOT: usize = std::mem::size_of::<(InlineBytes, Pending)>() * 8 / 7;
        const ALLOCATION: usize = 16;
        let heap = |len: usize| if len == 0 { 0 } else { len + ALLOCATION };
        let rows = [&self.row, &self.ghost]
            .into_iter()
            .flatten()
            .map(|r| heap(r.0.len()))
            .sum::<usize>();
        let unresolved = self.unresolved.as_ref().map_or(0, |u| heap(2 * u.len()));
        SLOT + heap(key.heap_len()) + heap(self.version.heap_len()) + rows + unresolved
    }
}

/// The error for a change that keeps columns of a key the table holds no row of; the sink
/// names the columns.
pub(super) fn nothing_to_keep() -> Error {
    Error::decode(
        "the change leaves columns unchanged (the connector's unavailable-value placeholder, \
         such as a TOASTed PostgreSQL value an update did not touch) but the table holds no row \
         of the key to keep their values from; with REPLICA IDENTITY FULL PostgreSQL sends \
         every value",
    )
    .because(inlet_decode::reason::UNAVAILABLE_VALUE)
}

/// The version column's value of the last row written from `full` (a data file's row of
/// `columns` values), taken out so its buffer serves the next.
pub(super) fn take_version(full: &mut Vec<Value>, columns: usize) -> Option<Value> {
    (full.len() == columns).then(|| full.pop()).flatten()
}

/// The version column's value for `version`, in the buffer of `last` if it has one.
pub(super) fn version_value(last: Option<Value>, version: &[u8]) -> Value {
    match last {
        Some(Value::Binary(mut b)) => {
            b.clear();
            b.extend_from_slice(version);
            Value::Binary(b)
        }
        _ => Value::Binary(version.to_vec()),
    }
}

/// A pending row, encoded ([`encode_values`]) in one allocation. As a `Vec<Value>` it took 32
/// bytes a value plus an allocation per text value, and a checkpoint holds a row for every key
/// it changed, two checkpoints at a time.
#[derive(Debug, Clone)]
pub(super) struct PackedRow(pub(super) Box<[u8]>);

impl PackedRow {
    pub(super) fn pack(row: &[Value]) -> PackedRow {
        PackedRow(encode_values(row).into_boxed_slice())
    }

    pub(super) fn unpack(&self) -> Result<Vec<Value>> {
        decode_values(&self.0).ok_or_else(Self::undecodable)
    }

    /// [`PackedRow::unpack`] into `out`, reusing its text and binary buffers.
    pub(super) fn unpack_into(&self, out: &mut Vec<Value>) -> Result<()> {
        decode_values_into(&self.0, out).ok_or_else(Self::undecodable)
    }

    pub(super) fn undecodable() -> Error {
        Error::new(
            ErrorKind::Internal,
            "a pending row does not decode as the values it was encoded from",
        )
    }
}

/// The version a change brings to its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangeVersion {
    /// Complete and encoded ([`inlet_common::version::encode_version`]).
    Known(Vec<u8>),
    /// A delete whose image lacks the configured version columns: the key's stored values of
    /// those `parts` columns, then the delete's own position `suffix`, so the delete orders
    /// after the row it deletes exactly when it comes later in the source.
    Inherit { parts: usize, suffix: Vec<u8> },
    /// Just after the key's stored version: a delete carried over from another partition,
    /// whose own position does not compare with this one's.
    Successor,
}

impl ChangeVersion {
    /// The encoded version given the key's stored one.
    pub(super) fn resolve(self, stored: Option<&[u8]>) -> Vec<u8> {
        match self {
            ChangeVersion::Known(v) => v,
            ChangeVersion::Inherit { parts, suffix } => {
                let mut v = stored
                    .and_then(|s| inlet_common::version::version_prefix(s, parts))
                    .map(<[u8]>::to_vec)
                    .unwrap_or_else(|| {
                        inlet_common::version::encode_version(&inlet_decode::Version(vec![
                            inlet_decode::VersionPart::Int(i128::MIN);
                            parts
                        ]))
                    });
                v.extend(suffix);
                v
            }
            // No encoding extends a version with a zero byte, and any greater version is
            // greater than this too.
            ChangeVersion::Successor => {
                let mut v = stored.unwrap_or_default().to_vec();
                v.push(0);
                v
            }
        }
    }
}

/// A row a change leaves: borrowed from the change, or built by a merge engine.
pub(super) type Image<'a> = Option<Cow<'a, [Value]>>;

/// Rows of one data file to delete, each with the version of the change that deleted it.
pub(super) type Deletions = Vec<(u64, Vec<u8>)>;

/// A position delete the checkpoint must write: rows of one committed data file, each with the
/// version of the change that deleted it.
pub struct DeleteTarget {
    pub data_path: String,
    pub partition: Vec<Value>,
    pub positions: Deletions,
}

/// A key's new state: where its row went (partition id, bucket, file slot, position) or
/// `None` for a tombstone.
pub(super) struct PreparedEntry {
    pub(super) key: Vec<u8>,
    pub(super) version: Vec<u8>,
    pub(super) located: Option<(u32, u32, u64, u64)>,
    pub(super) row: Option<Vec<u8>>,
}

/// Rows written for a checkpoint, waiting for their files to get ids and names.
pub struct Prepared {
    pub(super) entries: Vec<PreparedEntry>,
    pub deletes: Vec<DeleteTarget>,
    /// Rows written only to be deleted in the same snapshot, as (file slot, position, version):
    /// the record of a delete whose key has no committed row (inserted and deleted within the
    /// checkpoint, or never seen), so the tombstone's version is in the table and a rebuilt
    /// index keeps it. No reader sees them.
    pub ghosts: Vec<(u64, u64, Vec<u8>)>,
    pub(super) bucket_deltas: BTreeMap<(u32, u32), i64>,
}

/// The changes a shard holds by key.
/// Pending changes by key. Every change hashes its key here once or twice, so the hasher is
/// foldhash (seeded per process) rather than the standard library's SipHash.
pub(super) type Changes = HashMap<InlineBytes, Pending, foldhash::fast::RandomState>;

/// A shard's index, shared by the shard and the checkpoint being written.
pub type SharedIndex = Arc<dyn KeyIndex>;

/// What a shard knows of its table files besides its keys: partition ids, live rows per bucket,
/// file ids, and rows to repair. A checkpoint being written borrows it and gives it back.
pub struct ShardLayout {
    pub(super) id: u32,
    pub(super) dir: PathBuf,
    pub(super) partition_ids: HashMap<Vec<u8>, u32>,
    pub(super) partition_values: HashMap<u32, Vec<Value>>,
    pub(super) new_partitions: Vec<(u32, Vec<u8>)>,
    pub(super) bucket_counts: HashMap<(u32, u32), u64>,
    pub(super) next_file_id: u64,
    /// Older rows of keys a rebuild found live twice, deleted by the next checkpoint. Saved
    /// beside the index (`repairs`) until that checkpoint's batch is applied.
    pub(super) repairs: Vec<RowLocation>,
}

/// One shard's index and pending changes.
pub struct Shard {
    pub id: u32,
    pub(super) dir: PathBuf,
    pub(super) index: Arc<dyn KeyIndex>,
    pub(super) pending: Changes,
    /// What `pending` holds in memory, about.
    pub(super) pending_bytes: usize,
    /// The changes of the checkpoint being written and committed, until its index batch is
    /// applied: later changes find their keys' state here before the index.
    pub(super) inflight: Option<Arc<Changes>>,
    /// `None` while the checkpoint being written holds it.
    pub(super) layout: Option<ShardLayout>,
}

/// The fixed bucket of a key value: Iceberg's `bucket[n]`.
pub(super) fn fixed_bucket(n: u32, key: &Value) -> u32 {
    match Transform::Bucket(n).apply(key) {
        Value::Int(b) => b as u32,
        _ => 0,
    }
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl ShardLayout {
    /// What the index at `dir` records, and the rows to repair saved beside it.
    pub(super) fn read(id: u32, dir: &Path, index: &dyn KeyIndex) -> Result<ShardLayout> {
        let mut layout = ShardLayout {
            id,
            dir: dir.to_path_buf(),
            partition_ids: HashMap::new(),
            partition_values: HashMap::new(),
            new_partitions: Vec::new(),
            bucket_counts: index.bucket_counts()?.into_iter().collect(),
            next_file_id: index.max_file_id()?.map_or(1, |m| m + 1),
            repairs: Vec::new(),
        };
        for (pid, bytes) in index.partitions()? {
            let values = decode_values(&bytes).ok_or_else(|| {
                Error::new(
                    ErrorKind::IndexDamaged,
                    format!("index of shard {id} has a corrupt partition {pid}"),
                )
            })?;
            layout.partition_ids.insert(bytes, pid);
            layout.partition_values.insert(pid, values);
        }
        layout.repairs = layout.read_repairs()?;
        Ok(layout)
    }

    pub(super) fn save_repairs(&mut self, rows: Vec<RowLocation>) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let mut out = Vec::with_capacity(rows.len() * 24);
        for r in &rows {
            out.extend_from_slice(&r.partition_id.to_be_bytes());
            out.extend_from_slice(&r.bucket.to_be_bytes());
            out.extend_from_slice(&r.file_id.to_be_bytes());
            out.extend_from_slice(&r.position.to_be_bytes());
        }
        std::fs::write(repairs_file(&self.dir), out).or_kind(ErrorKind::Storage, || {
            "cannot save the rows to repair".into()
        })?;
        self.repairs = rows;
        Ok(())
    }

    pub(super) fn read_repairs(&self) -> Result<Vec<RowLocation>> {
        let bytes = match std::fs::read(repairs_file(&self.dir)) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(
                    Error::new(ErrorKind::Storage, "cannot read the rows to repair").with_source(e),
                )
            }
        };
        let mut b = ByteReader(&bytes);
        let mut rows = Vec::new();
        while !b.is_empty() {
            let (Some(partition_id), Some(bucket), Some(file_id), Some(position)) =
                (b.u32(), b.u32(), b.u64(), b.u64())
            else {
                return Err(Error::new(
                    ErrorKind::IndexDamaged,
                    "the rows to repair beside the index are unreadable",
                ));
            };
            rows.push(RowLocation {
                partition_id,
                bucket,
                file_id,
                position,
            });
        }
        Ok(rows)
    }

    /// The id of the partition of `values`, added if new. `scratch` is where they are
    /// encoded, so a known partition costs no allocation.
    pub(super) fn partition_id(&mut self, values: &[Value], scratch: &mut Vec<u8>) -> u32 {
        scratch.clear();
        inlet_iceberg::types::encode_values_into(values, scratch);
        if let Some(id) = self.partition_ids.get(scratch.as_slice()) {
            return *id;
        }
        let bytes = scratch.clone();
        let id = self.partition_values.keys().max().map_or(0, |m| m + 1);
        self.partition_ids.insert(bytes.clone(), id);
        self.partition_values.insert(id, values.to_vec());
        self.new_partitions.push((id, bytes));
        id
    }

    pub(super) fn assign_bucket(
        &self,
        spec: &UpsertSpec,
        partition_id: u32,
        deltas: &BTreeMap<(u32, u32), i64>,
    ) -> u32 {
        let mut bucket = self.id;
        loop {
            let count = self
                .bucket_counts
                .get(&(partition_id, bucket))
                .copied()
                .unwrap_or(0) as i64
                + deltas.get(&(partition_id, bucket)).copied().unwrap_or(0);
            if count < spec.target_rows_per_bucket as i64 {
                return bucket;
            }
            bucket += spec.shards.max(1);
        }
    }

    /// Writes a checkpoint's surviving rows through `writer` (with `_version` appended) and
    /// lists the position deletes of the rows they replace. `changes` are in key order, each
    /// with the key's row in the table now, if it has one.
    pub(super) fn prepare(
        &mut self,
        index: &dyn KeyIndex,
        spec: &UpsertSpec,
        changes: Vec<(&InlineBytes, &Pending, Option<RowLocation>)>,
        mut kept: HashMap<usize, Vec<(u16, Value)>>,
        writer: &mut DataWriter,
    ) -> Result<Prepared> {
        // Per data file id: its partition id, and the deleted positions with their versions.
        let mut deletes: BTreeMap<u64, (u32, Deletions)> = BTreeMap::new();
        let mut deltas: BTreeMap<(u32, u32), i64> = BTreeMap::new();
        let mut entries = Vec::with_capacity(changes.len());
        let mut ghosts = Vec::new();
        for old in &self.repairs {
            deletes
                .entry(old.file_id)
                .or_insert_with(|| (old.partition_id, Vec::new()))
                .1
                .push((old.position, Vec::new()));
        }
        let field_ids: Vec<i32> = spec.fields.iter().map(|f| f.0).collect();
        let mut scratch = Vec::new();
        // Every row is decoded into this one, whose text and binary buffers (the version's
        // too) serve row after row.
        let columns = writer.column_count();
        let mut full = Vec::with_capacity(columns);
        let mut values = Vec::new();
        for (i, (key, p, committed)) in changes.into_iter().enumerate() {
            if let Some(old) = committed {
                let target = deletes
                    .entry(old.file_id)
                    .or_insert_with(|| (old.partition_id, Vec::new()));
                target.1.push((old.position, p.version.to_vec()));
                *deltas.entry((old.partition_id, old.bucket)).or_default() -= 1;
            }
            let Some(row) = &p.row else {
                if let (None, Some(image)) = (committed, &p.ghost) {
                    let version = take_version(&mut full, columns);
                    image.unpack_into(&mut full)?;
                    full.resize(columns - 1, Value::Null);
                    writer.fill_required(&mut full);
                    full.push(version_value(version, &p.version));
                    writer.partition_values_into(&full, &mut values);
                    self.partition_id(&values, &mut scratch);
                    let bucket = match spec.fixed_buckets {
                        Some(n) => fixed_bucket(n, &full[spec.key_columns[0]]),
                        None => self.id,
                    };
                    let (slot, pos) = writer.write_to(&mut full, Some(bucket))?;
                    ghosts.push((slot, pos, p.version.to_vec()));
                }
                entries.push(PreparedEntry {
                    key: key.to_vec(),
                    version: p.version.to_vec(),
                    located: None,
                    row: None,
                });
                continue;
            };
            let version = take_version(&mut full, columns);
            row.unpack_into(&mut full)?;
            for (c, v) in kept.remove(&i).into_iter().flatten() {
                if let Some(slot) = full.get_mut(usize::from(c)) {
                    *slot = v;
                }
            }
            let stored = spec.stores_rows().then(|| encode_row(&field_ids, &full));
            // Rows changed before the table gained columns lack them.
            full.resize(columns - 1, Value::Null);
            full.push(version_value(version, &p.version));
            writer.partition_values_into(&full, &mut values);
            let pid = self.partition_id(&values, &mut scratch);
            let bucket = match (spec.fixed_buckets, committed) {
                (Some(n), _) => fixed_bucket(n, &full[spec.key_columns[0]]),
                (None, Some(old)) if old.partition_id == pid && old.bucket != FOREIGN_BUCKET => {
                    old.bucket
                }
                (None, _) => self.assign_bucket(spec, pid, &deltas),
            };
            *deltas.entry((pid, bucket)).or_default() += 1;
            let (slot, pos) = writer.write_to(&mut full, Some(bucket))?;
            entries.push(PreparedEntry {
                key: key.to_vec(),
                version: p.version.to_vec(),
                located: Some((pid, bucket, slot, pos)),
                row: stored,
            });
        }
        let mut targets = Vec::with_capacity(deletes.len());
        for (file_id, (pid, positions)) in deletes {
            let data_path = index.file_path(file_id)?.ok_or_else(|| {
                Error::new(
                    ErrorKind::Storage,
                    format!("index of shard {} names unknown file {file_id}", self.id),
                )
            })?;
            // A delete file belongs to the partition of the data file it names.
            let mut partition = self.partition_values.get(&pid).cloned().ok_or_else(|| {
                Error::new(
                    ErrorKind::Storage,
                    format!("index of shard {} names unknown partition {pid}", self.id),
                )
            })?;
            writer.promote_partition(&mut partition);
            targets.push(DeleteTarget {
                data_path,
                partition,
                positions,
            });
        }
        Ok(Prepared {
            entries,
            deletes: targets,
            ghosts,
            bucket_deltas: deltas,
        })
    }

    /// Turns prepared rows into the index batch, once the writer's files have paths:
    /// `files` maps each file slot to its path.
    pub(super) fn batch(
        &mut self,
        prepared: Prepared,
        files: &HashMap<u64, String>,
    ) -> Result<IndexBatch> {
        let now = now_secs();
        let mut batch = IndexBatch {
            entries: Vec::with_capacity(prepared.entries.len()),
            ..IndexBatch::default()
        };
        let mut file_ids: HashMap<u64, u64> = HashMap::new();
        for (slot, path) in files {
            let id = self.next_file_id;
            self.next_file_id += 1;
            file_ids.insert(*slot, id);
            batch.files.push((id, path.clone()));
        }
        for PreparedEntry {
            key,
            version,
            located,
            row,
        } in prepared.entries
        {
            let location = match located {
                None => None,
                Some((pid, bucket, slot, position)) => Some(RowLocation {
                    partition_id: pid,
                    bucket,
                    file_id: *file_ids.get(&slot).ok_or_else(|| {
                        Error::new(
                            ErrorKind::Internal,
                            format!("row written to unknown file slot {slot}"),
                        )
                    })?,
                    position,
                }),
            };
            batch.entries.push((
                key,
                IndexEntry {
                    version,
                    location,
                    row,
                    written_at_secs: now,
                },
            ));
        }
        for ((pid, bucket), delta) in prepared.bucket_deltas {
            let count = (self.bucket_counts.get(&(pid, bucket)).copied().unwrap_or(0) as i64
                + delta)
                .max(0) as u64;
            self.bucket_counts.insert((pid, bucket), count);
            batch.bucket_counts.push(((pid, bucket), count));
        }
        batch.partitions = std::mem::take(&mut self.new_partitions);
        Ok(batch)
    }

    /// Applies a batch whose snapshot committed to `index`, and forgets the saved copy and the
    /// repaired rows.
    pub(super) fn apply_committed(
        &mut self,
        index: &dyn KeyIndex,
        mut batch: IndexBatch,
        marker: Marker,
    ) -> Result<()> {
        batch.marker = Some(marker);
        // A checkpoint's batch repeats counts this shard set already; a retention's zeroes them.
        self.bucket_counts
            .extend(batch.bucket_counts.iter().copied());
        index.apply(batch)?;
        if !self.repairs.is_empty() {
            self.repairs.clear();
            remove_if_present(&repairs_file(&self.dir), "the repaired rows")?;
        }
        remove_if_present(&pending_file(&self.dir), "pending index batch")
    }
}

/// The stored values of the columns changes left unchanged ([`Pending::unresolved`]), read
/// from the committed rows they replace: by position in `changes`, each column's value. A row
/// that has gone meanwhile (its partition dropped by retention) has none: its columns are
/// written null, with a warning.
pub(super) fn kept_values(
    index: &dyn KeyIndex,
    spec: &UpsertSpec,
    columns: &[crate::write::parquet::WriteColumn],
    changes: &[(&InlineBytes, &Pending, Option<RowLocation>)],
    read: &dyn Fn(&str) -> Result<bytes::Bytes>,
) -> Result<HashMap<usize, Vec<(u16, Value)>>> {
    // Per data file: the changes (by position in `changes`), each with its row's position in
    // the file and the columns it keeps.
    type Wanted<'a> = BTreeMap<u64, Vec<(usize, u64, &'a [u16])>>;
    let mut wanted: Wanted = BTreeMap::new();
    let mut kept = HashMap::new();
    for (i, (_, p, committed)) in changes.iter().enumerate() {
        let (Some(unresolved), Some(_)) = (&p.unresolved, &p.row) else {
            continue;
        };
        match committed {
            Some(at) => wanted
                .entry(at.file_id)
                .or_default()
                .push((i, at.position, unresolved)),
            None => {
                tracing::warn!(
                    columns = unresolved.len(),
                    "A change kept values of a row that is gone from the table; writing them null"
                );
                kept.insert(i, unresolved.iter().map(|c| (*c, Value::Null)).collect());
            }
        }
    }
    for (file_id, rows) in wanted {
        let path = index.file_path(file_id)?.ok_or_else(|| {
            Error::new(
                ErrorKind::Storage,
                format!("index names unknown file {file_id}"),
            )
        })?;
        let mut wanted_columns: Vec<u16> = rows.iter().flat_map(|r| r.2.iter().copied()).collect();
        wanted_columns.sort_unstable();
        wanted_columns.dedup();
        let fields = wanted_columns
            .iter()
            .map(|c| {
                let (id, ty) = spec.fields[usize::from(*c)];
                let name = columns
                    .iter()
                    .find(|w| w.field_id == id)
                    .map_or("", |w| w.name.as_str());
                (id, name, ty)
            })
            .collect::<Vec<_>>();
        let values = inlet_iceberg::scan::read_fields(read(&path)?, &fields)?;
        for (i, position, unresolved) in rows {
            let row = values.get(position as usize).ok_or_else(|| {
                Error::new(
                    ErrorKind::IndexDamaged,
                    format!(
                        "index names row {position} of {path}, which has {} rows",
                        values.len()
                    ),
                )
            })?;
            let at = |c: &u16| {
                wanted_columns
                    .binary_search(c)
                    .map_or(Value::Null, |j| row[j].clone())
            };
            kept.insert(i, unresolved.iter().map(|c| (*c, at(c))).collect());
        }
    }
    Ok(kept)
}

/// A shard's part of a checkpoint, taken out of the shard so that it is written on another
/// thread while the shard takes the next checkpoint's changes.
pub struct ShardJob {
    pub key: (String, i32),
    pub(super) index: Arc<dyn KeyIndex>,
    pub(super) changes: Arc<Changes>,
    pub(super) layout: ShardLayout,
    pub(super) spec: UpsertSpec,
    pub(super) writer: WriterTemplate,
}

/// A shard's checkpoint written: its files, and the index batch saved beside the index, to
/// apply once the snapshot commits.
pub struct ShardWritten {
    pub key: (String, i32),
    pub data: Vec<crate::write::WrittenFile>,
    pub deletes: Vec<crate::write::WrittenFile>,
    /// The shard's id and the snapshot its index was level with when it was written.
    pub marker: (u32, Option<i64>),
    pub(super) batch: Option<IndexBatch>,
    pub(super) index: Arc<dyn KeyIndex>,
    pub(super) layout: ShardLayout,
}

/// The changes in their keys' bytewise order. Sorted first by each key's leading 16 bytes
/// as one integer, where most keys differ, and bytewise only where those tie: comparing the
/// keys themselves was most of the sort's time.
pub(super) fn sorted_changes(changes: &Changes) -> Vec<(&InlineBytes, &Pending)> {
    let mut sorted: Vec<(u128, &InlineBytes, &Pending)> = changes
        .iter()
        .map(|(k, p)| (leading_bytes(k), k, p))
        .collect();
    sorted.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(b.1)));
    sorted.into_iter().map(|(_, k, p)| (k, p)).collect()
}

/// A key's first 16 bytes, zero-padded, as a big-endian integer: keys that order differently
/// by it order the same way bytewise.
pub(super) fn leading_bytes(key: &[u8]) -> u128 {
    let mut bytes = [0; 16];
    let n = key.len().min(16);
    bytes[..n].copy_from_slice(&key[..n]);
    u128::from_be_bytes(bytes)
}

impl ShardJob {
    /// Writes the shard's rows and position deletes, and saves the index batch beside the index.
    /// `tag` names this checkpoint's delete files; `read` fetches a committed data file, for
    /// the values changes left unchanged.
    pub fn write(
        self,
        writer_id: &str,
        checkpoint: u64,
        tag: &str,
        read: &dyn Fn(&str) -> Result<bytes::Bytes>,
    ) -> Result<ShardWritten> {
        let ShardJob {
            key,
            index,
            changes,
            mut layout,
            spec,
            writer: w,
        } = self;
        let marker = (layout.id, index.marker()?.map(|m| m.snapshot_id));
        let mut writer = DataWriter::new(
            w.columns.clone(),
            w.partition.clone(),
            &w.location,
            w.target_file_bytes,
            &format!("{}-", shard_file_prefix(layout.id)),
        );
        // Sorted keys give files with ordered keys and a deterministic layout.
        let sorted = sorted_changes(&changes);
        // Where the keys that had rows have them now, asked in one batch.
        let asked: Vec<&[u8]> = sorted
            .iter()
            .filter(|(_, p)| p.located)
            .map(|(k, _)| &k[..])
            .collect();
        let mut found = index.multi_get(&asked)?.into_iter();
        let mut with_rows = Vec::with_capacity(sorted.len());
        for (k, p) in sorted {
            let committed = if p.located {
                found.next().flatten().and_then(|e| e.location)
            } else {
                None
            };
            with_rows.push((k, p, committed));
        }
        let kept = kept_values(index.as_ref(), &spec, &w.columns, &with_rows, read)?;
        let mut prepared = layout.prepare(index.as_ref(), &spec, with_rows, kept, &mut writer)?;
        let files = writer.close()?;
        let slots: HashMap<u64, String> = files
            .iter()
            .map(|f| (f.slot, f.data_file.file_path.clone()))
            .collect();
        let mut ghosts: BTreeMap<u64, Vec<(u64, Vec<u8>)>> = BTreeMap::new();
        for (slot, pos, version) in std::mem::take(&mut prepared.ghosts) {
            ghosts.entry(slot).or_default().push((pos, version));
        }
        for (slot, positions) in ghosts {
            let file = files.iter().find(|f| f.slot == slot).ok_or_else(|| {
                Error::new(
                    ErrorKind::Internal,
                    format!("ghost row written to unknown file slot {slot}"),
                )
            })?;
            prepared.deletes.push(DeleteTarget {
                data_path: file.data_file.file_path.clone(),
                partition: file.data_file.partition.clone(),
                positions,
            });
        }
        // Named by shard too: rows of another engine's file may be deleted by several shards
        // in one checkpoint.
        let shard_tag = format!("{tag}-{}", shard_file_prefix(layout.id));
        let mut deletes = Vec::new();
        // The shard's own files: one delete file per partition (and directory), which names
        // only files in the buckets of its directory.
        // Per directory and encoded partition: the partition, and rows borrowed from the targets.
        type Grouped<'a> = (Vec<Value>, Vec<(&'a str, u64, &'a [u8])>);
        let mut grouped: BTreeMap<(&str, Vec<u8>), Grouped> = BTreeMap::new();
        for target in &mut prepared.deletes {
            if file_shard(&target.data_path) == Some(layout.id) {
                let target: &DeleteTarget = target;
                let dir = crate::write::deletes::partition_dir(&target.data_path);
                let (_, rows) = grouped
                    .entry((dir, encode_values(&target.partition)))
                    .or_insert_with(|| (target.partition.clone(), Vec::new()));
                let path = target.data_path.as_str();
                rows.extend(
                    target
                        .positions
                        .iter()
                        .map(|(pos, version)| (path, *pos, version.as_slice())),
                );
            } else {
                deletes.push(crate::write::deletes::write_position_deletes(
                    &target.data_path,
                    target.partition.clone(),
                    &mut target.positions,
                    &shard_tag,
                )?);
            }
        }
        for ((dir, _), (partition, mut rows)) in grouped {
            rows.sort_unstable();
            deletes.push(crate::write::deletes::write_grouped_deletes(
                dir, layout.id, partition, rows, tag,
            )?);
        }
        let batch = layout.batch(prepared, &slots)?;
        save_batch(&layout.dir, index.as_ref(), writer_id, checkpoint, &batch)?;
        drop(changes);
        Ok(ShardWritten {
            key,
            data: files,
            deletes,
            marker,
            batch: Some(batch),
            index,
            layout,
        })
    }
}

impl ShardWritten {
    /// Applies the index batch: the checkpoint's snapshot `marker` committed.
    pub fn apply(&mut self, marker: Marker) -> Result<()> {
        match self.batch.take() {
            Some(batch) => self
                .layout
                .apply_committed(self.index.as_ref(), batch, marker),
            None => Ok(()),
        }
    }

    /// The shard's layout, to give back to the shard.
    pub fn into_layout(self) -> ((String, i32), ShardLayout) {
        (self.key, self.layout)
    }
}

/// A shard's index and layout, lent to a compaction that rewrites the shard's files while the
/// shard keeps taking changes. Those changes only read the index, and a compaction moves rows
/// without changing a key's version or liveness. The shard takes the layout back before its
/// next checkpoint, which then finds the moved rows where the compaction put them.
pub struct LentShard {
    pub key: (String, i32),
    pub id: u32,
    pub(super) dir: PathBuf,
    pub(super) index: Arc<dyn KeyIndex>,
    pub(super) layout: ShardLayout,
}

impl LentShard {
    /// The shard's index, for reading.
    pub fn index(&self) -> &dyn KeyIndex {
        self.index.as_ref()
    }

    /// A new data file id, for a compaction's output.
    pub fn allocate_file_id(&mut self) -> u64 {
        let id = self.layout.next_file_id;
        self.layout.next_file_id += 1;
        id
    }

    /// Saves a compaction's batch before its commit (see [`Shard::save_pending`]).
    pub fn save_pending(&self, writer_id: &str, checkpoint: u64, batch: &IndexBatch) -> Result<()> {
        save_batch(&self.dir, self.index.as_ref(), writer_id, checkpoint, batch)
    }

    /// Forgets a saved batch whose commit never landed, and the file ids it took.
    pub fn drop_saved(&mut self) -> Result<()> {
        remove_if_present(&pending_file(&self.dir), "pending index batch")?;
        self.layout = ShardLayout::read(self.id, &self.dir, self.index.as_ref())?;
        Ok(())
    }

    /// Applies a batch whose snapshot committed, and forgets the saved copy.
    pub fn apply_committed(&mut self, batch: IndexBatch, marker: Marker) -> Result<()> {
        self.layout
            .apply_committed(self.index.as_ref(), batch, marker)
    }

    /// The shard's layout, to give back to the shard.
    pub fn into_layout(self) -> ((String, i32), ShardLayout) {
        (self.key, self.layout)
    }
}

/// Every owned shard of an upsert table lent to a compaction, with what its rewrites need.
pub struct Lent {
    pub shards: Vec<LentShard>,
    pub columns: Vec<crate::write::parquet::WriteColumn>,
    pub key_columns: Vec<usize>,
}

impl Lent {
    /// Moves the marker of every lent shard the compaction left alone to its snapshot (see
    /// [`advance_idle`]).
    pub fn advance_idle(
        &self,
        meta: &inlet_iceberg::metadata::TableMetadata,
        pipeline: &str,
        marker: Marker,
    ) -> Result<()> {
        let indexes: Vec<Arc<dyn KeyIndex>> = self.shards.iter().map(|s| s.index.clone()).collect();
        advance_idle(&indexes, meta, pipeline, marker)
    }

    /// The layouts, to give back ([`UpsertSink::attach`]).
    pub fn into_layouts(self) -> Vec<((String, i32), ShardLayout)> {
        self.shards
            .into_iter()
            .map(LentShard::into_layout)
            .collect()
    }
}

impl Shard {
    /// Wraps an opened index; `dir` is where the pending batch file lives.
    pub fn open(id: u32, dir: &Path, index: Box<dyn KeyIndex>) -> Result<Shard> {
        let index: Arc<dyn KeyIndex> = Arc::from(index);
        let layout = ShardLayout::read(id, dir, index.as_ref())?;
        Ok(Shard {
            id,
            dir: dir.to_path_buf(),
            index,
            pending: Changes::default(),
            pending_bytes: 0,
            inflight: None,
            layout: Some(layout),
        })
    }

    pub(super) fn lent() -> Error {
        Error::new(
            ErrorKind::Internal,
            "the shard's layout is with the checkpoint being written",
        )
    }

    pub(super) fn layout_mut(&mut self) -> Result<&mut ShardLayout> {
        self.layout.as_mut().ok_or_else(Self::lent)
    }

    /// Rereads what the shard keeps of the index in memory, and drops its pending changes.
    pub(super) fn reload(&mut self) -> Result<()> {
        if self.inflight.is_some() {
            return Err(Self::lent());
        }
        self.layout = Some(ShardLayout::read(self.id, &self.dir, self.index.as_ref())?);
        self.pending.clear();
        self.pending_bytes = 0;
        Ok(())
    }

    /// Saves the older rows of duplicated keys for the next checkpoint to delete.
    pub fn save_repairs(&mut self, rows: Vec<RowLocation>) -> Result<()> {
        self.layout_mut()?.save_repairs(rows)
    }

    /// Whether the next checkpoint has rows of this shard to write or delete.
    pub fn has_work(&self) -> bool {
        !self.pending.is_empty() || self.layout.as_ref().is_some_and(|l| !l.repairs.is_empty())
    }

    /// The index's marker.
    pub fn marker(&self) -> Result<Option<Marker>> {
        self.index.marker()
    }

    /// The change a checkpoint in flight holds for `key`.
    pub(super) fn inflight(&self, key: &[u8]) -> Option<&Pending> {
        self.inflight.as_ref().and_then(|m| m.get(key))
    }

    /// Whether the key has a live row here, pending or committed.
    pub fn holds_live(&self, key: &[u8]) -> Result<bool> {
        Ok(match self.pending.get(key).or_else(|| self.inflight(key)) {
            Some(p) => p.row.is_some(),
            None => self.index.get(key)?.is_some_and(|e| e.location.is_some()),
        })
    }

    /// Whether `key` was last deleted by a key change carried over from another partition
    /// whose order against this partition's changes is unknown (no source positions).
    pub fn moved_away_unordered(&self, key: &[u8]) -> Result<bool> {
        Ok(match self.pending.get(key).or_else(|| self.inflight(key)) {
            Some(p) => p.row.is_none() && inlet_common::version::is_successor(&p.version),
            None => self.index.get(key)?.is_some_and(|e| {
                e.location.is_none() && inlet_common::version::is_successor(&e.version)
            }),
        })
    }

    /// Changes waiting for the next checkpoint.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// What the changes waiting for the next checkpoint hold in memory, about.
    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Forgets pending changes (their records will be read again).
    pub fn discard(&mut self) -> Result<()> {
        self.reload()
    }

    /// Applies one change. `row` is the after image for upserts, the before image (or just
    /// the key) for deletes; `key` is already encoded.
    ///
    /// `unavailable` lists the columns of `row` the change leaves unchanged (Debezium's
    /// unavailable-value placeholder): they keep the key's stored values, taken from its
    /// pending row where there is one, else from its committed row when the checkpoint is
    /// written. A key with no live row has none to keep: an error for the errors policy.
    pub fn apply(
        &mut self,
        spec: &UpsertSpec,
        key: InlineBytes,
        version: ChangeVersion,
        op: Op,
        row: Option<&[Value]>,
        unavailable: &[u16],
    ) -> Result<Outcome> {
        let unavailable = if op == Op::Delete { &[] } else { unavailable };
        // The old row matters only to a delete (its last image), to merge engines that
        // combine old and new, and to a change that keeps some of its values; cloning it for
        // every other change cost a copy of each row.
        let wants_row =
            op == Op::Delete || spec.merge != MergeEngine::Deduplicate || !unavailable.is_empty();
        // One probe of the pending map finds the key's change and the place for the new one.
        let slot = self.pending.entry(key);
        let earlier = match &slot {
            Entry::Occupied(o) => Some((o.get(), o.get().located)),
            // The checkpoint in flight wrote the key's row if it left one.
            Entry::Vacant(v) => self
                .inflight
                .as_ref()
                .and_then(|m| m.get(&**v.key()))
                .map(|p| (p, p.row.is_some())),
        };
        let mut base_unresolved = None;
        let (base_version, located, base_row, live) = match earlier {
            Some((p, located)) => (
                Some(p.version.clone()),
                located,
                p.row
                    .as_ref()
                    .filter(|_| wants_row)
                    .map(|r| {
                        base_unresolved = p.unresolved.clone();
                        r.unpack()
                    })
                    .transpose()?,
                p.row.is_some(),
            ),
            None => match self.index.get(slot.key())? {
                Some(e) => {
                    let old_row = match (&e.row, e.location) {
                        (Some(bytes), Some(_)) => {
                            Some(decode_row(bytes, &spec.fields).ok_or_else(|| {
                                Error::new(
                                    ErrorKind::IndexDamaged,
                                    format!("index of shard {} holds a corrupt row", self.id),
                                )
                            })?)
                        }
                        _ => None,
                    };
                    let live = e.location.is_some();
                    (Some(InlineBytes::from(e.version)), live, old_row, live)
                }
                None => (None, false, None, false),
            },
        };
        let version = InlineBytes::from(version.resolve(base_version.as_deref()));
        let mut unresolved = Vec::new();
        // The change's row with the values it keeps filled in, where it keeps some.
        let kept: Vec<Value>;
        // Borrowed from the change where it is kept as it came: the change's values are
        // freed where it was decoded, not here.
        let (new_row, ghost): (Image, Image) = match spec.merge {
            MergeEngine::FirstRow => {
                if live || op == Op::Delete {
                    return Ok(Outcome::Ignored);
                }
                if !unavailable.is_empty() {
                    return Err(nothing_to_keep());
                }
                (row.map(Cow::Borrowed), None)
            }
            MergeEngine::Deduplicate | MergeEngine::PartialUpdate | MergeEngine::Aggregation => {
                if base_version.as_ref().is_some_and(|b| *b >= version) {
                    return Ok(Outcome::Stale);
                }
                let row = match row {
                    Some(new) if !unavailable.is_empty() => {
                        if !live {
                            return Err(nothing_to_keep());
                        }
                        let mut filled = new.to_vec();
                        for &c in unavailable {
                            let c = usize::from(c);
                            let pending = base_unresolved
                                .as_deref()
                                .is_some_and(|u| u.contains(&(c as u16)));
                            match base_row.as_ref().filter(|_| !pending) {
                                Some(old) => filled[c] = old.get(c).cloned().unwrap_or(Value::Null),
                                None => unresolved.push(c as u16),
                            }
                        }
                        kept = filled;
                        Some(kept.as_slice())
                    }
                    other => other,
                };
                match (op, row) {
                    // The deleted key's last image: the pending row, else the delete's own
                    // before image (often just the key).
                    (Op::Delete, before) => (
                        None,
                        base_row
                            .filter(|_| live)
                            .map(Cow::Owned)
                            .or(before.map(Cow::Borrowed)),
                    ),
                    (_, None) => (None, None),
                    (_, Some(new)) if spec.merge == MergeEngine::PartialUpdate && live => {
                        let old = base_row.unwrap_or_default();
                        let merged = new
                            .iter()
                            .enumerate()
                            .map(|(i, v)| {
                                if v.is_null() {
                                    old.get(i).cloned().unwrap_or(Value::Null)
                                } else {
                                    v.clone()
                                }
                            })
                            .collect();
                        (Some(Cow::Owned(merged)), None)
                    }
                    (_, Some(new)) if spec.merge == MergeEngine::Aggregation => {
                        let first = !live;
                        let old = if first {
                            vec![Value::Null; new.len()]
                        } else {
                            base_row.unwrap_or_default()
                        };
                        let merged = new
                            .iter()
                            .enumerate()
                            .map(|(i, v)| {
                                let how = spec.aggregates.get(i).copied().flatten();
                                let old = old.get(i).cloned().unwrap_or(Value::Null);
                                if spec.key_columns.contains(&i) {
                                    v.clone()
                                } else {
                                    aggregate(how, old, v.clone())
                                }
                            })
                            .collect();
                        (Some(Cow::Owned(merged)), None)
                    }
                    (_, Some(new)) => (Some(Cow::Borrowed(new)), None),
                }
            }
        };
        let pending = Pending {
            version,
            located,
            row: new_row.as_deref().map(PackedRow::pack),
            ghost: ghost.as_deref().map(PackedRow::pack),
            unresolved: (!unresolved.is_empty()).then(|| unresolved.into_boxed_slice()),
        };
        self.pending_bytes += pending.bytes(slot.key());
        match slot {
            Entry::Occupied(mut o) => {
                let old = o.insert(pending);
                self.pending_bytes -= old.bytes(o.key());
            }
            Entry::Vacant(v) => {
                v.insert(pending);
            }
        }
        Ok(Outcome::Applied)
    }

    /// Takes the pending changes out as a checkpoint to write on another thread; until its
    /// batch is applied ([`Shard::attach`]) they stay readable for later changes.
    pub fn detach(
        &mut self,
        key: (String, i32),
        spec: &UpsertSpec,
        writer: &WriterTemplate,
    ) -> Result<ShardJob> {
        if self.inflight.is_some() {
            return Err(Error::new(
                ErrorKind::Internal,
                "a shard was asked for a checkpoint while one is in flight",
            ));
        }
        let layout = self.layout.take().ok_or_else(Self::lent)?;
        let changes = Arc::new(std::mem::take(&mut self.pending));
        self.pending_bytes = 0;
        self.inflight = Some(changes.clone());
        Ok(ShardJob {
            key,
            index: self.index.clone(),
            changes,
            layout,
            spec: spec.clone(),
            writer: writer.clone(),
        })
    }

    /// Lends the index and layout to a compaction (see [`LentShard`]).
    pub(super) fn lend(&mut self, key: (String, i32)) -> Result<LentShard> {
        if self.inflight.is_some() {
            return Err(Self::lent());
        }
        Ok(LentShard {
            key,
            id: self.id,
            dir: self.dir.clone(),
            index: self.index.clone(),
            layout: self.layout.take().ok_or_else(Self::lent)?,
        })
    }

    /// Takes back the layout a written checkpoint borrowed; its changes are in the index now
    /// (or, if it failed, the shard is reopened).
    pub fn attach(&mut self, layout: ShardLayout) {
        self.layout = Some(layout);
        self.inflight = None;
    }

    /// Saves a batch (of a compaction or a retention) before its commit, with the index marker
    /// it applies on top of.
    pub fn save_pending(&self, writer_id: &str, checkpoint: u64, batch: &IndexBatch) -> Result<()> {
        save_batch(&self.dir, self.index.as_ref(), writer_id, checkpoint, batch)
    }

    /// Applies a batch whose snapshot committed, and forgets the saved copy.
    pub fn apply_committed(&mut self, batch: IndexBatch, marker: Marker) -> Result<()> {
        let index = self.index.clone();
        self.layout_mut()?
            .apply_committed(index.as_ref(), batch, marker)
    }

    /// The batch saved before a commit whose outcome this process never learned:
    /// `Some(None)` if a file is there but does not decode (empty or torn by a power loss).
    pub fn take_saved(&self) -> Result<Option<Option<SavedBatch>>> {
        match std::fs::read(pending_file(&self.dir)) {
            Ok(bytes) => Ok(Some(decode_batch(&bytes))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(
                Error::new(ErrorKind::Storage, "cannot read pending index batch").with_source(e),
            ),
        }
    }

    /// Drops a saved batch whose commit never landed.
    pub fn drop_saved(&self) -> Result<()> {
        remove_if_present(&pending_file(&self.dir), "pending index batch")
    }

    /// Replaces the index with `sorted` (rebuilt from the table: ascending, unique keys) and the
    /// given layout facts.
    pub fn bulk_load(
        &mut self,
        sorted: &mut dyn Iterator<Item = Result<(Vec<u8>, IndexEntry)>>,
        batch: IndexBatch,
    ) -> Result<u64> {
        let index = Arc::get_mut(&mut self.index).ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                "an index cannot be rebuilt while a checkpoint writes to it",
            )
        })?;
        let n = index.bulk_load(sorted, batch)?;
        self.reload()?;
        Ok(n)
    }

    /// Applies a batch rebuilt or replayed from the table (its marker included) and rereads
    /// what the shard keeps of the index in memory.
    pub fn apply_batch(&mut self, batch: IndexBatch) -> Result<()> {
        self.index.apply(batch)?;
        self.reload()
    }

    /// Moves the index's marker to `marker` without changing any entry: the shard is level with
    /// that snapshot too.
    pub fn set_marker(&mut self, marker: Marker) -> Result<()> {
        set_marker(self.index.as_ref(), marker)
    }

    /// The shard's index, for reading.
    pub fn index(&self) -> &dyn KeyIndex {
        self.index.as_ref()
    }

    /// The shard's index, shared with the checkpoint being written.
    pub fn shared_index(&self) -> Arc<dyn KeyIndex> {
        self.index.clone()
    }

    /// The directory of the shard's index; scratch files of a rebuild go below it.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Moves `index`'s marker to `marker` without changing any entry.
pub(super) fn set_marker(index: &dyn KeyIndex, marker: Marker) -> Result<()> {
    index.apply(IndexBatch {
        marker: Some(marker),
        ..IndexBatch::default()
    })
}
