//! The upsert engine of one shard (one Kafka partition of a key-partitioned topic): version
//! dedup, merge engines, and the delete-old / insert-new pairs that keep one live row per key in
//! the partition its latest value names.
//!
//! Changes of a checkpoint collect in `pending` (latest image per key, so a key updated many
//! times before a commit is written once). At the checkpoint the shard writes each surviving
//! row, names a position delete for every committed row it replaces, and prepares the index
//! batch. The batch is saved beside the index before the commit and applied after it, so a crash
//! between the two is repaired exactly on restart.

use std::borrow::Cow;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::{Aggregate, MergeEngine};
use crate::decode::Op;
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::index::{
    decode_entry, IndexBatch, IndexEntry, InlineBytes, KeyIndex, Marker, RowLocation,
};
use crate::table::transform::Transform;
use crate::table::types::{
    decode_values, decode_values_into, encode_values, encode_values_into, ByteReader, Type, Value,
};
use crate::write::DataWriter;

/// How a shard applies changes.
#[derive(Debug, Clone)]
pub struct UpsertSpec {
    /// Positions of the primary key columns in a row.
    pub key_columns: Vec<usize>,
    pub merge: MergeEngine,
    /// Aggregation engine: the aggregate of each column position (`None`: last non-null).
    pub aggregates: Vec<Option<Aggregate>>,
    /// Fixed buckets: `bucket[N]` of the single key column; `None` for dynamic buckets.
    pub fixed_buckets: Option<u32>,
    /// A partition's bucket takes keys until it holds this many live rows.
    pub target_rows_per_bucket: u64,
    /// Number of shards (Kafka partitions); shard `s` owns buckets `b` with `b % shards == s`.
    pub shards: u32,
    /// Field id and type of each value of a row (the table's data columns, in row order).
    pub fields: Vec<(i32, Type)>,
}

impl UpsertSpec {
    /// Whether old rows must be kept in the index (merge engines that combine old and new).
    pub fn stores_rows(&self) -> bool {
        matches!(
            self.merge,
            MergeEngine::PartialUpdate | MergeEngine::Aggregation
        )
    }
}

/// Stored rows start with this byte (never the tag of a value), the count of their values
/// and each value's field id, then the values: see [`encode_row`].
const ROW_WITH_FIELDS: u8 = 0xF1;

/// A row as the index keeps it for merge engines: its values with the field id of each, so a
/// row stored before another engine dropped, moved or widened columns reads right after.
pub fn encode_row(field_ids: &[i32], row: &[Value]) -> Vec<u8> {
    let mut out = Vec::with_capacity(3 + 4 * field_ids.len() + 16 * row.len());
    out.push(ROW_WITH_FIELDS);
    out.extend_from_slice(&(field_ids.len() as u16).to_be_bytes());
    for id in field_ids {
        out.extend_from_slice(&id.to_be_bytes());
    }
    out.extend(encode_values(row));
    out
}

/// A stored row as a row of `fields` (field id and type of each value): values found by field
/// id and widened to the column's type; columns the row lacks are null. Rows stored before
/// field ids were (plain values) are positional: data columns then only grew at their end.
pub fn decode_row(bytes: &[u8], fields: &[(i32, Type)]) -> Option<Vec<Value>> {
    let Some((&ROW_WITH_FIELDS, rest)) = bytes.split_first() else {
        let mut values = decode_values(bytes)?;
        values.resize(fields.len(), Value::Null);
        return Some(
            values
                .into_iter()
                .zip(fields)
                .map(|(v, (_, ty))| widen(v, *ty))
                .collect(),
        );
    };
    let mut b = ByteReader(rest);
    let count = u16::from_be_bytes(b.take(2)?.try_into().ok()?) as usize;
    let ids = (0..count)
        .map(|_| Some(i32::from_be_bytes(b.take(4)?.try_into().ok()?)))
        .collect::<Option<Vec<i32>>>()?;
    let values = decode_values(b.0)?;
    if values.len() != ids.len() {
        return None;
    }
    Some(remap(values, &ids, fields))
}

/// `row`, whose values have field ids `from`, as a row of `to`.
fn remap(row: Vec<Value>, from: &[i32], to: &[(i32, Type)]) -> Vec<Value> {
    let mut by_id: HashMap<i32, Value> = from.iter().copied().zip(row).collect();
    to.iter()
        .map(|(id, ty)| widen(by_id.remove(id).unwrap_or(Value::Null), *ty))
        .collect()
}

/// A value written before its column was promoted (int to long, float to double), widened.
fn widen(v: Value, ty: Type) -> Value {
    match (v, ty) {
        (Value::Int(x), Type::Long) => Value::Long(x.into()),
        (Value::Float(x), Type::Double) => Value::Double(x.into()),
        (v, _) => v,
    }
}

/// Combines a stored and a new value of one column.
fn aggregate(how: Option<Aggregate>, old: Value, new: Value) -> Value {
    use Value::*;
    match (how, old, new) {
        (Some(Aggregate::Count), Null, _) => Long(1),
        (Some(Aggregate::Count), Int(n), _) => Int(n + 1),
        (Some(Aggregate::Count), Long(n), _) => Long(n + 1),
        (Some(Aggregate::FirstNonNull), old, new) => {
            if old.is_null() {
                new
            } else {
                old
            }
        }
        (_, old, Null) => old,
        (_, Null, new) => new,
        (Some(Aggregate::Sum), Int(a), Int(b)) => Int(a.wrapping_add(b)),
        (Some(Aggregate::Sum), Long(a), Long(b)) => Long(a.wrapping_add(b)),
        (Some(Aggregate::Sum), Float(a), Float(b)) => Float(a + b),
        (Some(Aggregate::Sum), Double(a), Double(b)) => Double(a + b),
        (Some(Aggregate::Sum), Decimal(a), Decimal(b)) => Decimal(a.wrapping_add(b)),
        (Some(Aggregate::Min), old, new) => {
            if new.partial_cmp_same(&old) == Some(std::cmp::Ordering::Less) {
                new
            } else {
                old
            }
        }
        (Some(Aggregate::Max), old, new) => {
            if new.partial_cmp_same(&old) == Some(std::cmp::Ordering::Greater) {
                new
            } else {
                old
            }
        }
        (_, _, new) => new,
    }
}

/// What happened to one change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It changed the key's row.
    Applied,
    /// Its version is not newer than the key's; dropped.
    Stale,
    /// The merge engine keeps the existing row (first-row).
    Ignored,
    /// A retraction waits for the change after it.
    Deferred,
}

struct Pending {
    version: InlineBytes,
    /// The key had a row in the table when its change arrived: the row is looked up again when
    /// the checkpoint is written (a compaction or retention meanwhile may have moved or dropped
    /// it) and gets a position delete.
    located: bool,
    /// The latest image; `None` once deleted.
    row: Option<PackedRow>,
    /// A deleted key's last image, written and deleted in the same snapshot when the key has no
    /// committed row to carry its delete's version (see [`Prepared::ghosts`]).
    ghost: Option<PackedRow>,
    /// Columns of `row` the change left unchanged (Debezium's unavailable-value placeholder)
    /// whose value only the key's committed row holds: read from it when the checkpoint is
    /// written.
    unresolved: Option<Box<[u16]>>,
}

impl Pending {
    /// About what this change of `key` holds in memory: its map slot (at the map's usual
    /// load), and its allocations with their headers.
    fn bytes(&self, key: &InlineBytes) -> usize {
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
fn nothing_to_keep() -> Error {
    Error::decode(
        "the change leaves columns unchanged (the connector's unavailable-value placeholder, \
         such as a TOASTed PostgreSQL value an update did not touch) but the table holds no row \
         of the key to keep their values from; with REPLICA IDENTITY FULL PostgreSQL sends \
         every value",
    )
    .because(crate::decode::reason::UNAVAILABLE_VALUE)
}

/// The version column's value of the last row written from `full` (a data file's row of
/// `columns` values), taken out so its buffer serves the next.
fn take_version(full: &mut Vec<Value>, columns: usize) -> Option<Value> {
    (full.len() == columns).then(|| full.pop()).flatten()
}

/// The version column's value for `version`, in the buffer of `last` if it has one.
fn version_value(last: Option<Value>, version: &[u8]) -> Value {
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
struct PackedRow(Box<[u8]>);

impl PackedRow {
    fn pack(row: &[Value]) -> PackedRow {
        PackedRow(encode_values(row).into_boxed_slice())
    }

    fn unpack(&self) -> Result<Vec<Value>> {
        decode_values(&self.0).ok_or_else(Self::undecodable)
    }

    /// [`PackedRow::unpack`] into `out`, reusing its text and binary buffers.
    fn unpack_into(&self, out: &mut Vec<Value>) -> Result<()> {
        decode_values_into(&self.0, out).ok_or_else(Self::undecodable)
    }

    fn undecodable() -> Error {
        Error::new(
            ErrorKind::Internal,
            "a pending row does not decode as the values it was encoded from",
        )
    }
}

/// The version a change brings to its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangeVersion {
    /// Complete and encoded ([`crate::index::encode_version`]).
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
    fn resolve(self, stored: Option<&[u8]>) -> Vec<u8> {
        match self {
            ChangeVersion::Known(v) => v,
            ChangeVersion::Inherit { parts, suffix } => {
                let mut v = stored
                    .and_then(|s| crate::index::version_prefix(s, parts))
                    .map(<[u8]>::to_vec)
                    .unwrap_or_else(|| {
                        crate::index::encode_version(&crate::decode::Version(vec![
                            crate::decode::VersionPart::Int(i128::MIN);
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
type Image<'a> = Option<Cow<'a, [Value]>>;

/// Rows of one data file to delete, each with the version of the change that deleted it.
type Deletions = Vec<(u64, Vec<u8>)>;

/// A position delete the checkpoint must write: rows of one committed data file, each with the
/// version of the change that deleted it.
pub struct DeleteTarget {
    pub data_path: String,
    pub partition: Vec<Value>,
    pub positions: Deletions,
}

/// A key's new state: where its row went (partition id, bucket, file slot, position) or
/// `None` for a tombstone.
struct PreparedEntry {
    key: Vec<u8>,
    version: Vec<u8>,
    located: Option<(u32, u32, u64, u64)>,
    row: Option<Vec<u8>>,
}

/// Rows written for a checkpoint, waiting for their files to get ids and names.
pub struct Prepared {
    entries: Vec<PreparedEntry>,
    pub deletes: Vec<DeleteTarget>,
    /// Rows written only to be deleted in the same snapshot, as (file slot, position, version):
    /// the record of a delete whose key has no committed row (inserted and deleted within the
    /// checkpoint, or never seen), so the tombstone's version is in the table and a rebuilt
    /// index keeps it. No reader sees them.
    pub ghosts: Vec<(u64, u64, Vec<u8>)>,
    bucket_deltas: BTreeMap<(u32, u32), i64>,
}

/// The changes a shard holds by key.
/// Pending changes by key. Every change hashes its key here once or twice, so the hasher is
/// foldhash (seeded per process) rather than the standard library's SipHash.
type Changes = HashMap<InlineBytes, Pending, foldhash::fast::RandomState>;

/// A shard's index, shared by the shard and the checkpoint being written.
pub type SharedIndex = Arc<dyn KeyIndex>;

/// What a shard knows of its table files besides its keys: partition ids, live rows per bucket,
/// file ids, and rows to repair. A checkpoint being written borrows it and gives it back.
pub struct ShardLayout {
    id: u32,
    dir: PathBuf,
    partition_ids: HashMap<Vec<u8>, u32>,
    partition_values: HashMap<u32, Vec<Value>>,
    new_partitions: Vec<(u32, Vec<u8>)>,
    bucket_counts: HashMap<(u32, u32), u64>,
    next_file_id: u64,
    /// Older rows of keys a rebuild found live twice, deleted by the next checkpoint. Saved
    /// beside the index (`repairs`) until that checkpoint's batch is applied.
    repairs: Vec<RowLocation>,
}

/// One shard's index and pending changes.
pub struct Shard {
    pub id: u32,
    dir: PathBuf,
    index: Arc<dyn KeyIndex>,
    pending: Changes,
    /// What `pending` holds in memory, about.
    pending_bytes: usize,
    /// The changes of the checkpoint being written and committed, until its index batch is
    /// applied: later changes find their keys' state here before the index.
    inflight: Option<Arc<Changes>>,
    /// `None` while the checkpoint being written holds it.
    layout: Option<ShardLayout>,
}

/// The fixed bucket of a key value: Iceberg's `bucket[n]`.
fn fixed_bucket(n: u32, key: &Value) -> u32 {
    match Transform::Bucket(n).apply(key) {
        Value::Int(b) => b as u32,
        _ => 0,
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn pending_file(dir: &Path) -> PathBuf {
    dir.join("pending.batch")
}

fn repairs_file(dir: &Path) -> PathBuf {
    dir.join("repairs")
}

fn remove_if_present(path: &Path, what: &str) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => {
            Err(Error::new(ErrorKind::Storage, format!("cannot remove {what}")).with_source(e))
        }
    }
}

/// Saves a batch before its commit is attempted, durably (file and directory synced), with the
/// index marker it applies on top of.
fn save_batch(
    dir: &Path,
    index: &dyn KeyIndex,
    writer_id: &str,
    checkpoint: u64,
    batch: &IndexBatch,
) -> Result<()> {
    let bytes = encode_batch(writer_id, checkpoint, index.marker()?, batch);
    let tmp = dir.join("pending.batch.tmp");
    let io = |what: &'static str| {
        move |e: std::io::Error| {
            Error::new(
                ErrorKind::Storage,
                format!("cannot {what} the pending index batch"),
            )
            .with_source(e)
        }
    };
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(io("write"))?;
        f.write_all(&bytes).map_err(io("write"))?;
        f.sync_all().map_err(io("sync"))?;
    }
    std::fs::rename(&tmp, pending_file(dir)).map_err(io("save"))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("sync the directory of"))
}

impl ShardLayout {
    /// What the index at `dir` records, and the rows to repair saved beside it.
    fn read(id: u32, dir: &Path, index: &dyn KeyIndex) -> Result<ShardLayout> {
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

    fn save_repairs(&mut self, rows: Vec<RowLocation>) -> Result<()> {
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

    fn read_repairs(&self) -> Result<Vec<RowLocation>> {
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
    fn partition_id(&mut self, values: &[Value], scratch: &mut Vec<u8>) -> u32 {
        scratch.clear();
        crate::table::types::encode_values_into(values, scratch);
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

    fn assign_bucket(
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
    fn prepare(
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
    fn batch(&mut self, prepared: Prepared, files: &HashMap<u64, String>) -> Result<IndexBatch> {
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
    fn apply_committed(
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
fn kept_values(
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
        let values = crate::table::scan::read_fields(read(&path)?, &fields)?;
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
    index: Arc<dyn KeyIndex>,
    changes: Arc<Changes>,
    layout: ShardLayout,
    spec: UpsertSpec,
    writer: WriterTemplate,
}

/// A shard's checkpoint written: its files, and the index batch saved beside the index, to
/// apply once the snapshot commits.
pub struct ShardWritten {
    pub key: (String, i32),
    pub data: Vec<crate::write::WrittenFile>,
    pub deletes: Vec<crate::write::WrittenFile>,
    /// The shard's id and the snapshot its index was level with when it was written.
    pub marker: (u32, Option<i64>),
    batch: Option<IndexBatch>,
    index: Arc<dyn KeyIndex>,
    layout: ShardLayout,
}

/// The changes in their keys' bytewise order. Sorted first by each key's leading 16 bytes
/// as one integer, where most keys differ, and bytewise only where those tie: comparing the
/// keys themselves was most of the sort's time.
fn sorted_changes(changes: &Changes) -> Vec<(&InlineBytes, &Pending)> {
    let mut sorted: Vec<(u128, &InlineBytes, &Pending)> = changes
        .iter()
        .map(|(k, p)| (leading_bytes(k), k, p))
        .collect();
    sorted.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(b.1)));
    sorted.into_iter().map(|(_, k, p)| (k, p)).collect()
}

/// A key's first 16 bytes, zero-padded, as a big-endian integer: keys that order differently
/// by it order the same way bytewise.
fn leading_bytes(key: &[u8]) -> u128 {
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
    dir: PathBuf,
    index: Arc<dyn KeyIndex>,
    layout: ShardLayout,
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
        meta: &crate::table::metadata::TableMetadata,
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

    fn lent() -> Error {
        Error::new(
            ErrorKind::Internal,
            "the shard's layout is with the checkpoint being written",
        )
    }

    fn layout_mut(&mut self) -> Result<&mut ShardLayout> {
        self.layout.as_mut().ok_or_else(Self::lent)
    }

    /// Rereads what the shard keeps of the index in memory, and drops its pending changes.
    fn reload(&mut self) -> Result<()> {
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
    fn inflight(&self, key: &[u8]) -> Option<&Pending> {
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
            Some(p) => p.row.is_none() && crate::index::is_successor(&p.version),
            None => self
                .index
                .get(key)?
                .is_some_and(|e| e.location.is_none() && crate::index::is_successor(&e.version)),
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
    fn lend(&mut self, key: (String, i32)) -> Result<LentShard> {
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
fn set_marker(index: &dyn KeyIndex, marker: Marker) -> Result<()> {
    index.apply(IndexBatch {
        marker: Some(marker),
        ..IndexBatch::default()
    })
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

/// A checkpoint's index batch as saved before its commit.
#[derive(Debug, Clone)]
pub struct SavedBatch {
    /// The writer and checkpoint whose snapshot the batch belongs to.
    pub writer: String,
    pub checkpoint: u64,
    /// The index marker the batch was built on: it applies only to an index still there.
    pub base: Option<Marker>,
    pub batch: IndexBatch,
}

/// Format of a saved batch file: 2 adds the base marker.
const SAVED_BATCH_FORMAT: u8 = 2;

/// Encodes a saved batch ([`SavedBatch`]'s fields) for its file, in one allocation.
fn encode_batch(
    writer: &str,
    checkpoint: u64,
    base: Option<Marker>,
    batch: &IndexBatch,
) -> Vec<u8> {
    let entries: usize = batch
        .entries
        .iter()
        .map(|(k, e)| 8 + k.len() + crate::index::encoded_entry_len(e))
        .sum();
    let removed: usize = batch.removed.iter().map(|k| 4 + k.len()).sum();
    let partitions: usize = batch.partitions.iter().map(|(_, v)| 8 + v.len()).sum();
    let files: usize = batch.files.iter().map(|(_, p)| 12 + p.len()).sum();
    let header = 1 + 4 + writer.len() + 8 + if base.is_some() { 17 } else { 1 };
    // Sized exactly: a checkpoint's batch is megabytes, and growing it copied them.
    let mut out = Vec::with_capacity(
        header
            + 6 * 4
            + entries
            + removed
            + partitions
            + files
            + 8 * batch.removed_files.len()
            + 16 * batch.bucket_counts.len(),
    );
    out.push(SAVED_BATCH_FORMAT);
    put_bytes(&mut out, writer.as_bytes());
    out.extend_from_slice(&checkpoint.to_be_bytes());
    match base {
        None => out.push(0),
        Some(m) => {
            out.push(1);
            out.extend_from_slice(&m.snapshot_id.to_be_bytes());
            out.extend_from_slice(&m.sequence_number.to_be_bytes());
        }
    }
    out.extend_from_slice(&(batch.entries.len() as u32).to_be_bytes());
    for (k, e) in &batch.entries {
        put_bytes(&mut out, k);
        let len = crate::index::encoded_entry_len(e);
        out.extend_from_slice(&(len as u32).to_be_bytes());
        crate::index::encode_entry_into(e, &mut out);
    }
    out.extend_from_slice(&(batch.removed.len() as u32).to_be_bytes());
    for k in &batch.removed {
        put_bytes(&mut out, k);
    }
    out.extend_from_slice(&(batch.partitions.len() as u32).to_be_bytes());
    for (id, v) in &batch.partitions {
        out.extend_from_slice(&id.to_be_bytes());
        put_bytes(&mut out, v);
    }
    out.extend_from_slice(&(batch.files.len() as u32).to_be_bytes());
    for (id, path) in &batch.files {
        out.extend_from_slice(&id.to_be_bytes());
        put_bytes(&mut out, path.as_bytes());
    }
    out.extend_from_slice(&(batch.removed_files.len() as u32).to_be_bytes());
    for id in &batch.removed_files {
        out.extend_from_slice(&id.to_be_bytes());
    }
    out.extend_from_slice(&(batch.bucket_counts.len() as u32).to_be_bytes());
    for ((p, b), n) in &batch.bucket_counts {
        out.extend_from_slice(&p.to_be_bytes());
        out.extend_from_slice(&b.to_be_bytes());
        out.extend_from_slice(&n.to_be_bytes());
    }
    out
}

fn decode_batch(bytes: &[u8]) -> Option<SavedBatch> {
    let mut b = ByteReader(bytes);
    if b.take(1)? != [SAVED_BATCH_FORMAT] {
        return None;
    }
    let writer = String::from_utf8(b.bytes()?.to_vec()).ok()?;
    let checkpoint = b.u64()?;
    let base = match b.take(1)? {
        [0] => None,
        [1] => Some(Marker {
            snapshot_id: b.u64()? as i64,
            sequence_number: b.u64()? as i64,
        }),
        _ => return None,
    };
    let mut batch = IndexBatch::default();
    for _ in 0..b.u32()? {
        let k = b.bytes()?.to_vec();
        let e = decode_entry(b.bytes()?).ok()?;
        batch.entries.push((k, e));
    }
    for _ in 0..b.u32()? {
        batch.removed.push(b.bytes()?.to_vec());
    }
    for _ in 0..b.u32()? {
        let id = b.u32()?;
        batch.partitions.push((id, b.bytes()?.to_vec()));
    }
    for _ in 0..b.u32()? {
        let id = b.u64()?;
        batch
            .files
            .push((id, String::from_utf8(b.bytes()?.to_vec()).ok()?));
    }
    for _ in 0..b.u32()? {
        batch.removed_files.push(b.u64()?);
    }
    for _ in 0..b.u32()? {
        let p = b.u32()?;
        let bucket = b.u32()?;
        batch.bucket_counts.push(((p, bucket), b.u64()?));
    }
    b.is_empty().then_some(SavedBatch {
        writer,
        checkpoint,
        base,
        batch,
    })
}

/// The upsert side of a pipeline: one shard per owned Kafka partition, each with its index.
pub struct UpsertSink {
    pub spec: UpsertSpec,
    /// Positions of `table.version_columns` in a row.
    version_columns: Vec<usize>,
    /// Order changes by the Kafka offset even where the format carries a position.
    offset_versions: bool,
    shards: HashMap<(String, i32), Shard>,
    /// Per partition, a retraction (Flink's `-U`) waiting for the change after it.
    held: HashMap<(String, i32), Held>,
    /// Where a change's key is encoded, before it is kept (inline when short).
    key_buf: Vec<u8>,
    index_root: PathBuf,
    index_config: crate::config::IndexConfig,
    writer: WriterTemplate,
}

/// A retraction of a key's row (Flink's `-U`), held until the next change of its partition
/// shows whether the key stays (`+U` of the same key: one update) or goes (anything else: the
/// key changed, and the old key is deleted).
struct Held {
    key: InlineBytes,
    version: ChangeVersion,
    offset: i64,
    before: Vec<Value>,
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
    position: Option<&crate::decode::Version>,
    offset: i64,
) -> ChangeVersion {
    use crate::decode::{Version, VersionPart};
    let position = match position {
        Some(v) => crate::index::encode_version(v),
        None => crate::index::encode_version(&Version(vec![VersionPart::Int(offset as i128)])),
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
    let mut version = crate::index::encode_version(&Version(parts));
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
        let config = crate::index::RocksConfig {
            block_cache_bytes: self.index_config.block_cache_bytes as usize,
            ttl_secs: self.index_config.ttl_secs,
            ..crate::index::RocksConfig::default()
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
        record: &crate::decode::ChangeRecord,
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
                    .because(crate::decode::reason::KEY_CHANGE_UNORDERED))
                }
                Op::Create | Op::Read => {}
            }
        }
        shard
            .apply(spec, key, version, record.op, row, unavailable)
            .map_err(|e| {
                if e.reason() != crate::decode::reason::UNAVAILABLE_VALUE {
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
    fn key_of(&mut self, row: &[Value]) -> Result<InlineBytes> {
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
    fn delete_key(
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
                    .because(crate::decode::reason::KEY_CHANGE_UNORDERED));
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
            .because(crate::decode::reason::KEY_CHANGE_UNOWNED));
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
        meta: &crate::table::metadata::TableMetadata,
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
    meta: &crate::table::metadata::TableMetadata,
    pipeline: &str,
    marker: Marker,
) -> Result<()> {
    let ours = |s: &crate::table::metadata::Snapshot| {
        s.summary
            .get(crate::table::metadata::SUMMARY_PIPELINE)
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
fn open_index(dir: &Path, id: u32, config: crate::index::RocksConfig) -> Result<Shard> {
    let db = dir.join("db");
    let marker = crate::index::damage_marker(&db);
    if marker.exists() {
        let why = std::fs::read_to_string(&marker).unwrap_or_default();
        return Err(Error::new(
            ErrorKind::IndexDamaged,
            format!("the key index at {} was found damaged: {why}", db.display()),
        ));
    }
    let index = crate::index::RocksIndex::open_with(&db, config)?;
    Shard::open(id, dir, Box::new(index))
}

/// Moves a damaged index to `db.damaged-<secs>` (the one kept for inspection; older ones are
/// removed) and forgets its saved batch, so a new index is rebuilt from the table.
fn set_aside(dir: &Path) -> Result<()> {
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
    for file in [crate::index::damage_marker(&db), dir.join("pending.batch")] {
        match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io(format!("cannot remove {}", file.display()))(e))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Data files of shard `s` are named `s<s>-...`, so the shard's files can be found again.
pub fn shard_file_prefix(shard: u32) -> String {
    format!("s{shard:05}")
}

/// The shard whose prefix a data file's name carries; `None` for files another engine wrote.
pub fn file_shard(path: &str) -> Option<u32> {
    let name = path.rsplit('/').next()?;
    let digits = name.strip_prefix('s')?.get(..5)?;
    if name.as_bytes().get(6) != Some(&b'-') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The bucket of rows in files another engine wrote: counted apart from inlet's buckets, and
/// never written to (an update of such a row goes to a bucket of the shard).
pub const FOREIGN_BUCKET: u32 = u32::MAX;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::ChangeRecord;

    /// A sink over rows `(id long, v string)` keyed by `id`, for a topic of `shards` partitions.
    fn sink(dir: &Path, shards: u32) -> UpsertSink {
        let column = |id, name: &str, ty| crate::write::parquet::WriteColumn {
            field_id: id,
            name: name.into(),
            ty,
            required: false,
        };
        UpsertSink::new(
            UpsertSpec {
                key_columns: vec![0],
                merge: MergeEngine::Deduplicate,
                aggregates: vec![None, None],
                fixed_buckets: None,
                target_rows_per_bucket: 100,
                shards,
                fields: vec![(1, Type::Long), (2, Type::String)],
            },
            vec![],
            dir.to_path_buf(),
            crate::config::IndexConfig {
                dir: dir.display().to_string(),
                ttl_secs: None,
                block_cache_bytes: 1 << 20,
                copy_interval_ms: 0,
            },
            WriterTemplate {
                columns: vec![
                    column(1, "id", crate::table::types::Type::Long),
                    column(2, "v", crate::table::types::Type::String),
                    column(3, "_version", crate::table::types::Type::Binary),
                ],
                partition: vec![],
                location: format!("file://{}", dir.display()),
                target_file_bytes: 1 << 20,
            },
        )
    }

    fn update(before: i64, after: i64) -> ChangeRecord {
        let row = |id| vec![Value::Long(id), Value::String(format!("v{id}"))];
        ChangeRecord {
            op: Op::Update,
            before: Some(row(before)),
            after: Some(row(after)),
            version: None,
            source_ts_ms: None,
        }
    }

    #[test]
    fn stored_rows_read_by_field_id_across_schema_changes() {
        let stored = encode_row(
            &[1, 2, 3],
            &[Value::Long(1), Value::Int(5), Value::String("a".into())],
        );
        // Another engine dropped nothing, moved field 3 before 2, widened 2 and added 4.
        let now = [
            (1, Type::Long),
            (3, Type::String),
            (2, Type::Long),
            (4, Type::String),
        ];
        assert_eq!(
            decode_row(&stored, &now).unwrap(),
            vec![
                Value::Long(1),
                Value::String("a".into()),
                Value::Long(5),
                Value::Null
            ]
        );
        // Field 2 dropped.
        assert_eq!(
            decode_row(&stored, &[(1, Type::Long), (3, Type::String)]).unwrap(),
            vec![Value::Long(1), Value::String("a".into())]
        );
        // A row stored before rows carried field ids is positional.
        let old = encode_values(&[Value::Long(1), Value::Int(5)]);
        assert_eq!(
            decode_row(&old, &[(1, Type::Long), (2, Type::Long), (3, Type::String)]).unwrap(),
            vec![Value::Long(1), Value::Long(5), Value::Null]
        );
        assert!(decode_row(&stored[..stored.len() - 1], &now).is_none());
    }

    proptest::proptest! {
        /// Keys short and long, sharing prefixes and zero bytes, where the integer order and
        /// the bytewise order could part.
        #[test]
        fn changes_sort_in_their_keys_bytewise_order(
            keys in proptest::collection::hash_set(
                proptest::collection::vec(proptest::sample::select(vec![0u8, 1, 0x7f, 0xff]), 0..40),
                0..200,
            )
        ) {
            let pending = || Pending {
                version: InlineBytes::default(),
                located: false,
                row: None,
                ghost: None,
                unresolved: None,
            };
            let changes: Changes = keys
                .iter()
                .map(|k| (InlineBytes::from(k.as_slice()), pending()))
                .collect();
            let got: Vec<&[u8]> = sorted_changes(&changes).into_iter().map(|(k, _)| &k[..]).collect();
            let mut want: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            want.sort();
            proptest::prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn a_key_change_whose_old_key_may_be_elsewhere_goes_to_the_errors_policy() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = sink(dir.path(), 2);
        sink.open_shard("t", 0).unwrap();
        let err = sink.accept("t", 0, 5, &update(7, 8), &[]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Decode);
        assert_eq!(err.reason(), crate::decode::reason::KEY_CHANGE_UNOWNED);
        assert!(err.to_string().contains("does not own"), "{err}");
        // With every partition owned, an old key no shard holds may still be on its way in
        // another partition: without a comparable version that cannot be told apart from a key
        // gone already.
        sink.open_shard("t", 1).unwrap();
        let err = sink.accept("t", 0, 6, &update(7, 8), &[]).unwrap_err();
        assert_eq!(err.reason(), crate::decode::reason::KEY_CHANGE_UNORDERED);
        // With source positions every shard records the old key's delete, and its insert
        // arriving later is stale.
        let mut change = update(7, 8);
        change.version = Some(crate::decode::Version(vec![
            crate::decode::VersionPart::Int(20),
        ]));
        assert_eq!(
            sink.accept("t", 0, 6, &change, &[]).unwrap(),
            Outcome::Applied
        );
        let mut insert = update(7, 7);
        (insert.op, insert.before) = (Op::Create, None);
        insert.version = Some(crate::decode::Version(vec![
            crate::decode::VersionPart::Int(10),
        ]));
        for p in [0, 1] {
            assert_eq!(
                sink.accept("t", p, 1, &insert, &[]).unwrap(),
                Outcome::Stale
            );
        }
    }

    /// Writes a checkpoint of every shard of `sink` as the pipeline does (files kept in
    /// `files` by path, read back from there), applies its index batch as committed, and
    /// returns the rows it wrote as `(id, v)`.
    fn checkpoint(
        sink: &mut UpsertSink,
        files: &mut HashMap<String, Vec<u8>>,
        id: u64,
    ) -> BTreeMap<i64, Value> {
        let (jobs, _) = sink.detach().unwrap();
        write_checkpoint(sink, files, jobs, id)
    }

    /// [`checkpoint`] of jobs detached already.
    fn write_checkpoint(
        sink: &mut UpsertSink,
        files: &mut HashMap<String, Vec<u8>>,
        jobs: Vec<ShardJob>,
        id: u64,
    ) -> BTreeMap<i64, Value> {
        let mut layouts = Vec::new();
        let mut rows = BTreeMap::new();
        for job in jobs {
            let read = |path: &str| {
                files
                    .get(path)
                    .map(|b| bytes::Bytes::from(b.clone()))
                    .ok_or_else(|| Error::new(ErrorKind::Storage, format!("no file {path}")))
            };
            let mut written = job.write("writer", id, &format!("t{id}"), &read).unwrap();
            for f in &written.data {
                files.insert(f.data_file.file_path.clone(), f.bytes.clone());
                let read = crate::table::scan::read_columns(
                    bytes::Bytes::from(f.bytes.clone()),
                    &[("id", Type::Long), ("v", Type::String)],
                )
                .unwrap();
                for row in read {
                    let Value::Long(k) = row[0] else {
                        panic!("{row:?}")
                    };
                    rows.insert(k, row[1].clone());
                }
            }
            let marker = Marker {
                snapshot_id: id as i64,
                sequence_number: id as i64,
            };
            written.apply(marker).unwrap();
            layouts.push(written.into_layout());
        }
        sink.attach(layouts);
        rows
    }

    /// A column a change leaves unchanged (Debezium's TOAST placeholder) keeps the key's value:
    /// from the change pending before it, from the committed row when the checkpoint is
    /// written, through a checkpoint in flight; a key without a row has none to keep.
    #[test]
    fn unavailable_values_keep_the_stored_value() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = sink(dir.path(), 1);
        sink.open_shard("t", 0).unwrap();
        let mut files = HashMap::new();
        let mut offset = 0;
        let mut change = |sink: &mut UpsertSink, id: i64, v: Option<&str>| {
            offset += 1;
            let unavailable: &[u16] = if v.is_none() { &[1] } else { &[] };
            let value = Value::String(v.unwrap_or("__debezium_unavailable_value").into());
            let record = ChangeRecord {
                op: Op::Update,
                before: None,
                after: Some(vec![Value::Long(id), value]),
                version: None,
                source_ts_ms: None,
            };
            sink.accept("t", 0, offset, &record, unavailable)
        };
        let text = |s: &str| Value::String(s.into());
        change(&mut sink, 1, Some("stored-1")).unwrap();
        change(&mut sink, 2, Some("stored-2")).unwrap();
        let first = checkpoint(&mut sink, &mut files, 1);
        assert_eq!(first[&1], text("stored-1"));

        // Committed row only: read back from its file when the checkpoint is written.
        change(&mut sink, 1, None).unwrap();
        // A pending row: taken from it at once.
        change(&mut sink, 2, Some("new-2")).unwrap();
        change(&mut sink, 2, None).unwrap();
        // No row to keep a value from.
        let err = change(&mut sink, 3, None).unwrap_err();
        assert_eq!(err.reason(), crate::decode::reason::UNAVAILABLE_VALUE);
        assert!(err.to_string().ends_with("columns=v"), "{err}");
        let second = checkpoint(&mut sink, &mut files, 2);
        assert_eq!(second[&1], text("stored-1"));
        assert_eq!(second[&2], text("new-2"));
        assert!(!second.contains_key(&3));

        // A change arriving while its key's unresolved change is in flight stays unresolved,
        // and reads the row that checkpoint writes.
        change(&mut sink, 1, None).unwrap();
        let (jobs, _) = sink.detach().unwrap();
        change(&mut sink, 1, None).unwrap();
        write_checkpoint(&mut sink, &mut files, jobs, 3);
        let fourth = checkpoint(&mut sink, &mut files, 4);
        assert_eq!(fourth[&1], text("stored-1"));
        // The placeholder itself is never written.
        for f in files.values() {
            let rows = crate::table::scan::read_columns(
                bytes::Bytes::from(f.clone()),
                &[("v", Type::String)],
            )
            .unwrap();
            assert!(!rows
                .iter()
                .any(|r| r[0] == text("__debezium_unavailable_value")));
        }
    }

    /// The buffered bytes that bound a checkpoint count each pending key once, at its latest
    /// change, and nothing once the changes are taken out as a checkpoint.
    #[test]
    fn buffered_bytes_count_each_pending_key_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = sink(dir.path(), 1);
        sink.open_shard("t", 0).unwrap();
        let insert = |id: i64, offset: i64| {
            let mut change = update(id, id);
            (change.op, change.before) = (Op::Create, None);
            change.version = Some(crate::decode::Version(vec![
                crate::decode::VersionPart::Int(offset.into()),
            ]));
            change
        };
        assert_eq!(sink.buffered_bytes(), 0);
        sink.accept("t", 0, 1, &insert(1, 1), &[]).unwrap();
        let one = sink.buffered_bytes();
        assert!(one > std::mem::size_of::<Pending>(), "{one}");
        for offset in 2..10 {
            sink.accept("t", 0, offset, &insert(1, offset), &[])
                .unwrap();
        }
        assert_eq!(sink.buffered_bytes(), one);
        sink.accept("t", 0, 10, &insert(2, 10), &[]).unwrap();
        assert_eq!(sink.buffered_bytes(), 2 * one);
        let (jobs, _) = sink.detach().unwrap();
        assert_eq!(jobs.len(), 1);
        assert_eq!(sink.buffered_bytes(), 0);
    }

    /// A schema change remaps pending rows, which changes their sizes; the count follows, so a
    /// later change of the key subtracts what its row holds now.
    #[test]
    fn buffered_bytes_follow_pending_rows_remapped_by_a_schema_change() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = sink(dir.path(), 1);
        sink.open_shard("t", 0).unwrap();
        let mut insert = update(1, 1);
        (insert.op, insert.before) = (Op::Create, None);
        sink.accept("t", 0, 1, &insert, &[]).unwrap();
        let mut spec = sink.spec.clone();
        spec.fields.push((4, Type::String));
        spec.aggregates.push(None);
        let (columns, partition) = (sink.writer.columns.clone(), sink.writer.partition.clone());
        sink.change_layout(spec, vec![], columns, partition)
            .unwrap();
        let remapped = sink.buffered_bytes();
        let shard = sink.shard_mut("t", 0).unwrap();
        let exact: usize = shard.pending.iter().map(|(k, p)| p.bytes(k)).sum();
        assert_eq!(remapped, exact);
        insert
            .after
            .as_mut()
            .unwrap()
            .push(Value::String("x".repeat(100)));
        sink.accept("t", 0, 2, &insert, &[]).unwrap();
        let shard = sink.shard_mut("t", 0).unwrap();
        let exact: usize = shard.pending.iter().map(|(k, p)| p.bytes(k)).sum();
        assert_eq!(sink.buffered_bytes(), exact);
    }

    #[test]
    fn aggregates_combine_old_and_new_values() {
        use Value::*;
        assert_eq!(
            aggregate(Some(Aggregate::Sum), Decimal(150), Decimal(25)),
            Decimal(175)
        );
        assert_eq!(aggregate(Some(Aggregate::Sum), Null, Long(2)), Long(2));
        assert_eq!(aggregate(Some(Aggregate::Sum), Long(2), Null), Long(2));
        assert_eq!(aggregate(Some(Aggregate::Min), Long(2), Long(1)), Long(1));
        assert_eq!(aggregate(Some(Aggregate::Max), Long(2), Long(1)), Long(2));
        assert_eq!(aggregate(Some(Aggregate::Count), Null, Long(9)), Long(1));
        assert_eq!(aggregate(Some(Aggregate::Count), Long(3), Null), Long(4));
        assert_eq!(
            aggregate(Some(Aggregate::FirstNonNull), Long(3), Long(4)),
            Long(3)
        );
        assert_eq!(
            aggregate(Some(Aggregate::LastNonNull), Long(3), Null),
            Long(3)
        );
        assert_eq!(aggregate(None, Long(3), Long(4)), Long(4));
    }

    #[test]
    fn saved_batches_round_trip_and_reject_truncation() {
        let entry = IndexEntry {
            version: vec![1, 2],
            location: Some(RowLocation {
                partition_id: 3,
                bucket: 4,
                file_id: 5,
                position: 6,
            }),
            row: Some(vec![7]),
            written_at_secs: 8,
        };
        let batch = IndexBatch {
            entries: vec![(b"k".to_vec(), entry)],
            removed: vec![b"gone".to_vec()],
            partitions: vec![(1, b"p".to_vec())],
            files: vec![(9, "file:///x.parquet".into())],
            removed_files: vec![2],
            bucket_counts: vec![((1, 0), 10)],
            marker: None,
        };
        for base in [
            None,
            Some(Marker {
                snapshot_id: 7,
                sequence_number: 3,
            }),
        ] {
            let bytes = encode_batch("w", 42, base, &batch);
            assert_eq!(bytes.capacity(), bytes.len(), "sized exactly up front");
            let back = decode_batch(&bytes).unwrap();
            assert_eq!((back.writer.as_str(), back.checkpoint), ("w", 42));
            assert_eq!(back.base, base);
            assert_eq!(
                encode_batch(&back.writer, back.checkpoint, back.base, &back.batch),
                bytes
            );
            for cut in 0..bytes.len() {
                assert!(
                    decode_batch(&bytes[..cut]).is_none(),
                    "prefix of {cut} decoded"
                );
            }
        }
    }
}
