//! The upsert engine of one shard (one Kafka partition of a key-partitioned topic): version
//! dedup, merge engines, and the delete-old / insert-new pairs that keep one live row per key in
//! the partition its latest value names.
//!
//! Changes of a checkpoint collect in `pending` (latest image per key, so a key updated many
//! times before a commit is written once). At the checkpoint the shard writes each surviving
//! row, names a position delete for every committed row it replaces, and prepares the index
//! batch. The batch is saved beside the index before the commit and applied after it, so a crash
//! between the two is repaired exactly on restart.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::{Aggregate, MergeEngine};
use crate::decode::Op;
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::index::{
    decode_entry, encode_entry, IndexBatch, IndexEntry, KeyIndex, Marker, RowLocation,
};
use crate::table::transform::Transform;
use crate::table::types::{decode_values, encode_values, ByteReader, Value};
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
}

struct Pending {
    version: Vec<u8>,
    /// The key's row in a committed file when the checkpoint began; it gets a position delete.
    committed: Option<RowLocation>,
    /// The latest image; `None` once deleted.
    row: Option<Vec<Value>>,
}

/// A position delete the checkpoint must write.
pub struct DeleteTarget {
    pub data_path: String,
    pub partition: Vec<Value>,
    pub positions: Vec<u64>,
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
    bucket_deltas: BTreeMap<(u32, u32), i64>,
}

/// One shard's index and pending changes.
pub struct Shard {
    pub id: u32,
    dir: PathBuf,
    index: Box<dyn KeyIndex>,
    pending: HashMap<Vec<u8>, Pending>,
    partition_ids: HashMap<Vec<u8>, u32>,
    partition_values: HashMap<u32, Vec<Value>>,
    new_partitions: Vec<(u32, Vec<u8>)>,
    bucket_counts: HashMap<(u32, u32), u64>,
    next_file_id: u64,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Shard {
    /// Wraps an opened index; `dir` is where the pending batch file lives.
    pub fn open(id: u32, dir: &Path, index: Box<dyn KeyIndex>) -> Result<Shard> {
        let mut shard = Shard {
            id,
            dir: dir.to_path_buf(),
            index,
            pending: HashMap::new(),
            partition_ids: HashMap::new(),
            partition_values: HashMap::new(),
            new_partitions: Vec::new(),
            bucket_counts: HashMap::new(),
            next_file_id: 0,
        };
        shard.reload()?;
        Ok(shard)
    }

    fn reload(&mut self) -> Result<()> {
        self.partition_ids.clear();
        self.partition_values.clear();
        for (id, bytes) in self.index.partitions()? {
            let values = decode_values(&bytes).ok_or_else(|| {
                Error::new(
                    ErrorKind::Storage,
                    format!("index of shard {} has a corrupt partition {id}", self.id),
                )
            })?;
            self.partition_ids.insert(bytes, id);
            self.partition_values.insert(id, values);
        }
        self.bucket_counts = self.index.bucket_counts()?.into_iter().collect();
        self.next_file_id = self.index.max_file_id()?.map_or(1, |m| m + 1);
        self.new_partitions.clear();
        self.pending.clear();
        Ok(())
    }

    /// The index's marker.
    pub fn marker(&self) -> Result<Option<Marker>> {
        self.index.marker()
    }

    /// Changes waiting for the next checkpoint.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Forgets pending changes (their records will be read again).
    pub fn discard(&mut self) -> Result<()> {
        self.reload()
    }

    /// Applies one change. `row` is the after image for upserts, the before image (or just
    /// the key) for deletes; `key` and `version` are already encoded.
    pub fn apply(
        &mut self,
        spec: &UpsertSpec,
        key: Vec<u8>,
        version: Vec<u8>,
        op: Op,
        row: Option<Vec<Value>>,
    ) -> Result<Outcome> {
        let (base_version, committed, base_row) = match self.pending.get(&key) {
            Some(p) => (Some(p.version.clone()), p.committed, p.row.clone()),
            None => match self.index.get(&key)? {
                Some(e) => {
                    let old_row = match (&e.row, e.location) {
                        (Some(bytes), Some(_)) => Some(decode_values(bytes).ok_or_else(|| {
                            Error::new(
                                ErrorKind::Storage,
                                format!("index of shard {} holds a corrupt row", self.id),
                            )
                        })?),
                        _ => None,
                    };
                    (Some(e.version), e.location, old_row)
                }
                None => (None, None, None),
            },
        };
        let live = match self.pending.get(&key) {
            Some(p) => p.row.is_some(),
            None => committed.is_some(),
        };
        let new_row = match spec.merge {
            MergeEngine::FirstRow => {
                if live || op == Op::Delete {
                    return Ok(Outcome::Ignored);
                }
                row
            }
            MergeEngine::Deduplicate | MergeEngine::PartialUpdate | MergeEngine::Aggregation => {
                if base_version.as_ref().is_some_and(|b| *b >= version) {
                    return Ok(Outcome::Stale);
                }
                match (op, row) {
                    (Op::Delete, _) | (_, None) => None,
                    (_, Some(new)) if spec.merge == MergeEngine::PartialUpdate && live => {
                        let old = base_row.unwrap_or_default();
                        Some(
                            new.into_iter()
                                .enumerate()
                                .map(|(i, v)| {
                                    if v.is_null() {
                                        old.get(i).cloned().unwrap_or(Value::Null)
                                    } else {
                                        v
                                    }
                                })
                                .collect(),
                        )
                    }
                    (_, Some(new)) if spec.merge == MergeEngine::Aggregation => {
                        let first = !live;
                        let old = if first {
                            vec![Value::Null; new.len()]
                        } else {
                            base_row.unwrap_or_default()
                        };
                        Some(
                            new.into_iter()
                                .enumerate()
                                .map(|(i, v)| {
                                    let how = spec.aggregates.get(i).copied().flatten();
                                    if spec.key_columns.contains(&i) {
                                        v
                                    } else {
                                        aggregate(
                                            how,
                                            old.get(i).cloned().unwrap_or(Value::Null),
                                            v,
                                        )
                                    }
                                })
                                .collect(),
                        )
                    }
                    (_, Some(new)) => Some(new),
                }
            }
        };
        self.pending.insert(
            key,
            Pending {
                version,
                committed,
                row: new_row,
            },
        );
        Ok(Outcome::Applied)
    }

    fn partition_id(&mut self, values: Vec<Value>) -> u32 {
        let bytes = encode_values(&values);
        if let Some(id) = self.partition_ids.get(&bytes) {
            return *id;
        }
        let id = self.partition_values.keys().max().map_or(0, |m| m + 1);
        self.partition_ids.insert(bytes.clone(), id);
        self.partition_values.insert(id, values);
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

    /// Writes the checkpoint's surviving rows through `writer` (with `_version` appended) and
    /// lists the position deletes of the rows they replace.
    pub fn prepare(&mut self, spec: &UpsertSpec, writer: &mut DataWriter) -> Result<Prepared> {
        let mut pending: Vec<(Vec<u8>, Pending)> = self.pending.drain().collect();
        // Sorted keys give files with ordered keys and a deterministic layout.
        pending.sort_by(|a, b| a.0.cmp(&b.0));
        let mut deletes: BTreeMap<u64, (u32, Vec<u64>)> = BTreeMap::new();
        let mut deltas: BTreeMap<(u32, u32), i64> = BTreeMap::new();
        let mut entries = Vec::with_capacity(pending.len());
        for (key, p) in pending {
            if let Some(old) = p.committed {
                let target = deletes
                    .entry(old.file_id)
                    .or_insert_with(|| (old.partition_id, Vec::new()));
                target.1.push(old.position);
                *deltas.entry((old.partition_id, old.bucket)).or_default() -= 1;
            }
            let Some(row) = p.row else {
                entries.push(PreparedEntry {
                    key,
                    version: p.version,
                    located: None,
                    row: None,
                });
                continue;
            };
            let stored = spec.stores_rows().then(|| encode_values(&row));
            let mut full = row;
            // Rows changed before the table gained columns lack them.
            full.resize(writer.column_count() - 1, Value::Null);
            full.push(Value::Binary(p.version.clone()));
            let (values, _) = writer.partition_of(&full);
            let pid = self.partition_id(values);
            let bucket = match (spec.fixed_buckets, p.committed) {
                (Some(n), _) => match Transform::Bucket(n).apply(&full[spec.key_columns[0]]) {
                    Value::Int(b) => b as u32,
                    _ => 0,
                },
                (None, Some(old)) if old.partition_id == pid => old.bucket,
                (None, _) => self.assign_bucket(spec, pid, &deltas),
            };
            *deltas.entry((pid, bucket)).or_default() += 1;
            let (slot, pos) = writer.write_to(full, Some(bucket))?;
            entries.push(PreparedEntry {
                key,
                version: p.version,
                located: Some((pid, bucket, slot, pos)),
                row: stored,
            });
        }
        let mut targets = Vec::with_capacity(deletes.len());
        for (file_id, (pid, positions)) in deletes {
            let data_path = self.index.file_path(file_id)?.ok_or_else(|| {
                Error::new(
                    ErrorKind::Storage,
                    format!("index of shard {} names unknown file {file_id}", self.id),
                )
            })?;
            // A delete file belongs to the partition of the data file it names.
            let partition = self.partition_values.get(&pid).cloned().ok_or_else(|| {
                Error::new(
                    ErrorKind::Storage,
                    format!("index of shard {} names unknown partition {pid}", self.id),
                )
            })?;
            targets.push(DeleteTarget {
                data_path,
                partition,
                positions,
            });
        }
        Ok(Prepared {
            entries,
            deletes: targets,
            bucket_deltas: deltas,
        })
    }

    /// Turns prepared rows into the index batch, once the writer's files have paths:
    /// `files` maps each file slot to its path.
    pub fn batch(
        &mut self,
        prepared: Prepared,
        files: &HashMap<u64, String>,
    ) -> Result<IndexBatch> {
        let now = now_secs();
        let mut batch = IndexBatch::default();
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

    fn pending_file(&self) -> PathBuf {
        self.dir.join("pending.batch")
    }

    /// Saves the batch before its commit is attempted.
    pub fn save_pending(&self, writer_id: &str, checkpoint: u64, batch: &IndexBatch) -> Result<()> {
        let bytes = encode_batch(writer_id, checkpoint, batch);
        let tmp = self.dir.join("pending.batch.tmp");
        std::fs::write(&tmp, bytes).or_kind(ErrorKind::Storage, || {
            format!("cannot write {}", tmp.display())
        })?;
        std::fs::rename(&tmp, self.pending_file()).or_kind(ErrorKind::Storage, || {
            "cannot save pending index batch".into()
        })
    }

    /// Applies a batch whose snapshot committed, and forgets the saved copy.
    pub fn apply_committed(&mut self, mut batch: IndexBatch, marker: Marker) -> Result<()> {
        batch.marker = Some(marker);
        self.index.apply(batch)?;
        match std::fs::remove_file(self.pending_file()) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(
                Error::new(ErrorKind::Storage, "cannot remove pending index batch").with_source(e),
            ),
        }
    }

    /// The batch saved before a commit whose outcome this process never learned.
    pub fn take_saved(&self) -> Result<Option<(String, u64, IndexBatch)>> {
        match std::fs::read(self.pending_file()) {
            Ok(bytes) => decode_batch(&bytes)
                .map(Some)
                .ok_or_else(|| Error::new(ErrorKind::Storage, "corrupt pending index batch")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(
                Error::new(ErrorKind::Storage, "cannot read pending index batch").with_source(e),
            ),
        }
    }

    /// Drops a saved batch whose commit never landed.
    pub fn drop_saved(&self) -> Result<()> {
        match std::fs::remove_file(self.pending_file()) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(
                Error::new(ErrorKind::Storage, "cannot remove pending index batch").with_source(e),
            ),
        }
    }

    /// Replaces the index with `sorted` (rebuilt from the table: ascending, unique keys) and the
    /// given layout facts.
    pub fn bulk_load(
        &mut self,
        sorted: &mut dyn Iterator<Item = Result<(Vec<u8>, IndexEntry)>>,
        batch: IndexBatch,
    ) -> Result<u64> {
        let n = self.index.bulk_load(sorted, batch)?;
        self.reload()?;
        Ok(n)
    }

    /// Applies a batch rebuilt or replayed from the table (its marker included) and rereads
    /// what the shard keeps of the index in memory.
    pub fn apply_batch(&mut self, batch: IndexBatch) -> Result<()> {
        self.index.apply(batch)?;
        self.reload()
    }

    /// The shard's index, for reading.
    pub fn index(&self) -> &dyn KeyIndex {
        self.index.as_ref()
    }

    /// The directory of the shard's index; scratch files of a rebuild go below it.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

fn encode_batch(writer_id: &str, checkpoint: u64, batch: &IndexBatch) -> Vec<u8> {
    let mut out = vec![1u8];
    put_bytes(&mut out, writer_id.as_bytes());
    out.extend_from_slice(&checkpoint.to_be_bytes());
    out.extend_from_slice(&(batch.entries.len() as u32).to_be_bytes());
    for (k, e) in &batch.entries {
        put_bytes(&mut out, k);
        put_bytes(&mut out, &encode_entry(e));
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

fn decode_batch(bytes: &[u8]) -> Option<(String, u64, IndexBatch)> {
    let mut b = ByteReader(bytes);
    if b.take(1)? != [1] {
        return None;
    }
    let writer = String::from_utf8(b.bytes()?.to_vec()).ok()?;
    let checkpoint = b.u64()?;
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
    b.is_empty().then_some((writer, checkpoint, batch))
}

/// The upsert side of a pipeline: one shard per owned Kafka partition, each with its index.
pub struct UpsertSink {
    pub spec: UpsertSpec,
    /// Positions of `table.version_columns` in a row.
    version_columns: Vec<usize>,
    shards: HashMap<(String, i32), Shard>,
    index_root: PathBuf,
    index_config: crate::config::IndexConfig,
    writer: WriterTemplate,
    pending_bytes: usize,
}

/// What every shard's checkpoint writer is made of.
#[derive(Clone)]
pub struct WriterTemplate {
    pub columns: Vec<crate::write::parquet::WriteColumn>,
    pub partition: Vec<crate::write::PartitionColumn>,
    pub location: String,
    pub target_file_bytes: u64,
}

/// One shard's part of a checkpoint, until its commit lands.
pub struct ShardCheckpoint {
    pub shard: (String, i32),
    pub batch: IndexBatch,
}

/// The files of a prepared checkpoint and the index batches to apply after it commits.
pub struct PreparedCheckpoint {
    pub data: Vec<crate::write::WrittenFile>,
    pub deletes: Vec<crate::write::WrittenFile>,
    pub shards: Vec<ShardCheckpoint>,
}

/// The version of a change: configured columns, else the format's position, else the offset.
pub fn version_of(
    version_columns: &[usize],
    row: &[Value],
    record: Option<&crate::decode::Version>,
    offset: i64,
) -> Vec<u8> {
    use crate::decode::{Version, VersionPart};
    if !version_columns.is_empty() {
        let parts = version_columns
            .iter()
            .map(|i| match &row[*i] {
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
        return crate::index::encode_version(&Version(parts));
    }
    match record {
        Some(v) => crate::index::encode_version(v),
        None => crate::index::encode_version(&Version(vec![VersionPart::Int(offset as i128)])),
    }
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
            shards: HashMap::new(),
            index_root,
            index_config,
            writer,
            pending_bytes: 0,
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
        let index = crate::index::RocksIndex::open_with(&dir.join("db"), config)?;
        let shard = Shard::open(partition as u32, &dir, Box::new(index))?;
        let key = (topic.to_string(), partition);
        self.shards.insert(key.clone(), shard);
        self.shards
            .get_mut(&key)
            .ok_or_else(|| Error::new(ErrorKind::Internal, "shard vanished"))
    }

    /// Writes later checkpoints with `columns` (the table's schema changed).
    pub fn change_columns(&mut self, columns: Vec<crate::write::parquet::WriteColumn>) {
        self.writer.columns = columns;
    }

    /// Closes every shard (on revocation); pending changes are dropped.
    pub fn close_all(&mut self) {
        self.shards.clear();
        self.pending_bytes = 0;
    }

    /// Applies one decoded change of `topic`/`partition` at `offset`.
    pub fn accept(
        &mut self,
        topic: &str,
        partition: i32,
        offset: i64,
        record: crate::decode::ChangeRecord,
    ) -> Result<Outcome> {
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
        let key_values: Vec<&Value> = self.spec.key_columns.iter().map(|i| &image[*i]).collect();
        if key_values.iter().any(|v| v.is_null()) {
            return Err(Error::decode("primary key column is null"));
        }
        let key = encode_values(key_values);
        let version = version_of(
            &self.version_columns,
            image,
            record.version.as_ref(),
            offset,
        );
        let bytes: usize =
            image.iter().map(Value::approx_bytes).sum::<usize>() + key.len() + version.len();
        let row = match record.op {
            Op::Delete => None,
            _ => record.after,
        };
        let spec = self.spec.clone();
        let shard = self
            .shards
            .get_mut(&(topic.to_string(), partition))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Internal,
                    format!("record of unowned partition {topic}/{partition}"),
                )
            })?;
        let outcome = shard.apply(&spec, key, version, record.op, row)?;
        if outcome == Outcome::Applied {
            self.pending_bytes += bytes;
        }
        Ok(outcome)
    }

    /// Approximate bytes of pending changes.
    pub fn buffered_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Writes data and delete files of every shard with pending changes and saves each shard's
    /// index batch beside its index, keyed by writer and checkpoint.
    pub fn prepare(
        &mut self,
        touched: &[(String, i32)],
        writer_id: &str,
        checkpoint: u64,
    ) -> Result<PreparedCheckpoint> {
        let mut out = PreparedCheckpoint {
            data: Vec::new(),
            deletes: Vec::new(),
            shards: Vec::new(),
        };
        let tag = uuid::Uuid::new_v4().simple().to_string();
        for key in touched {
            let Some(shard) = self.shards.get_mut(key) else {
                continue;
            };
            let w = &self.writer;
            let mut writer = DataWriter::new(
                w.columns.clone(),
                w.partition.clone(),
                &w.location,
                w.target_file_bytes,
                &format!("{}-", shard_file_prefix(shard.id)),
            );
            let prepared = shard.prepare(&self.spec, &mut writer)?;
            let files = writer.close()?;
            let slots: HashMap<u64, String> = files
                .iter()
                .map(|f| (f.slot, f.data_file.file_path.clone()))
                .collect();
            for target in &prepared.deletes {
                let mut positions = target.positions.clone();
                out.deletes
                    .push(crate::write::deletes::write_position_deletes(
                        &target.data_path,
                        target.partition.clone(),
                        &mut positions,
                        &tag,
                    )?);
            }
            let batch = shard.batch(prepared, &slots)?;
            shard.save_pending(writer_id, checkpoint, &batch)?;
            out.data.extend(files);
            out.shards.push(ShardCheckpoint {
                shard: key.clone(),
                batch,
            });
        }
        self.pending_bytes = 0;
        Ok(out)
    }

    /// Applies the batches of a committed checkpoint.
    pub fn finish(&mut self, shards: Vec<ShardCheckpoint>, marker: Marker) -> Result<()> {
        for sc in shards {
            if let Some(shard) = self.shards.get_mut(&sc.shard) {
                shard.apply_committed(sc.batch, marker)?;
            }
        }
        Ok(())
    }
}

/// Data files of shard `s` are named `s<s>-...`, so the shard's files can be found again.
pub fn shard_file_prefix(shard: u32) -> String {
    format!("s{shard:05}")
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let bytes = encode_batch("w", 42, &batch);
        let (writer, checkpoint, back) = decode_batch(&bytes).unwrap();
        assert_eq!((writer.as_str(), checkpoint), ("w", 42));
        assert_eq!(encode_batch("w", 42, &back), bytes);
        assert!(decode_batch(&bytes[..bytes.len() - 1]).is_none());
    }
}
