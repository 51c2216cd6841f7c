//! The RocksDB [`KeyIndex`]. Column families and encodings are described in the
//! [parent module](super).
//!
//! Tuned for point lookups on local SSD: a 10-bit bloom filter per key, partitioned filter and
//! index blocks in one bounded block cache, LZ4 blocks.

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rocksdb::compaction_filter::{CompactionFilter, Decision};
use rocksdb::compaction_filter_factory::{CompactionFilterContext, CompactionFilterFactory};
use rocksdb::{
    properties, BlockBasedIndexType, BlockBasedOptions, Cache, ColumnFamily,
    ColumnFamilyDescriptor, DBCompressionType, DataBlockIndexType, IngestExternalFileOptions,
    IteratorMode, Options, SstFileWriter, WriteBatch, DB,
};

use super::{
    check_ascending, corrupt, decode_bucket_key, decode_entry, decode_marker, decode_u32,
    decode_u64, encode_bucket_key, encode_entry, encode_entry_into, encode_marker, expired,
    now_secs, written_at_secs, IndexBatch, IndexEntry, KeyIndex, Marker, FORMAT,
};
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};

/// The file beside the database at `db` that says it is damaged.
pub fn damage_marker(db: &Path) -> PathBuf {
    db.with_extension("damaged")
}

/// Our error for a RocksDB failure while `what` at `path`. Corruption is
/// [`ErrorKind::IndexDamaged`] and leaves [`damage_marker`] behind.
fn db_error(path: &Path, what: &str, e: rocksdb::Error) -> Error {
    let message = format!("{what} in the key index at {}", path.display());
    if e.kind() == rocksdb::ErrorKind::Corruption {
        let _ = std::fs::write(damage_marker(path), e.to_string());
        return Error::new(ErrorKind::IndexDamaged, message).with_source(e);
    }
    Error::new(ErrorKind::Storage, message).with_source(e)
}

/// Default size of the block cache shared by the indexes of a process.
pub const DEFAULT_BLOCK_CACHE_BYTES: usize = 256 << 20;

/// Default size at which bulk load starts a new SST file.
pub const DEFAULT_BULK_LOAD_FILE_BYTES: u64 = 256 << 20;

const META: &str = "meta";
const KEYS: &str = "keys";
const PARTITIONS: &str = "partitions";
const FILES: &str = "files";
const BUCKETS: &str = "buckets";
/// `meta` first: bulk load drops in this order, so an interrupted load has lost its marker
/// before it touches anything else.
const COLUMN_FAMILIES: [&str; 5] = [META, KEYS, PARTITIONS, FILES, BUCKETS];

const META_FORMAT: &[u8] = b"format";
const META_MARKER: &[u8] = b"marker";
const META_MAX_FILE_ID: &[u8] = b"max_file_id";

/// Where bulk load writes SST files: inside the database directory, so ingestion can move them
/// by hard link instead of copying.
const BULK_LOAD_DIR: &str = "bulk-load";
const BULK_LOAD_PROGRESS_KEYS: u64 = 4_000_000;
/// Keys asked of RocksDB in one `multi_get` call.
const MULTI_GET_KEYS: usize = 4096;

/// Tuning of a [`RocksIndex`].
#[derive(Debug, Clone)]
pub struct RocksConfig {
    /// Entries written longer ago than this read as absent and are dropped at compaction;
    /// `None` keeps them forever. See the duplicate risk in the [module docs](super).
    pub ttl_secs: Option<u64>,
    /// Block cache shared by all column families and by every index of the process opened
    /// with the same size; holds data, index and filter blocks, so it bounds the indexes'
    /// memory.
    pub block_cache_bytes: usize,
    /// Size at which bulk load starts a new SST file.
    pub bulk_load_file_bytes: u64,
}

impl Default for RocksConfig {
    fn default() -> Self {
        RocksConfig {
            ttl_secs: None,
            block_cache_bytes: DEFAULT_BLOCK_CACHE_BYTES,
            bulk_load_file_bytes: DEFAULT_BULK_LOAD_FILE_BYTES,
        }
    }
}

/// A [`KeyIndex`] in a RocksDB database on local disk.
pub struct RocksIndex {
    db: DB,
    path: PathBuf,
    config: RocksConfig,
    cache: Cache,
    /// How the key column family's new table files filter and index their keys.
    layout: KeyLayout,
    /// The highest file id recorded; behind a lock so batches apply through `&self`.
    max_file_id: std::sync::Mutex<Option<u64>>,
}

impl RocksIndex {
    /// Opens or creates the index at `path` with the default block cache.
    pub fn open(path: &Path, ttl_secs: Option<u64>) -> Result<RocksIndex> {
        Self::open_with(
            path,
            RocksConfig {
                ttl_secs,
                ..RocksConfig::default()
            },
        )
    }

    /// Opens or creates the index at `path`, tuned by `config`.
    pub fn open_with(path: &Path, config: RocksConfig) -> Result<RocksIndex> {
        let cache = shared_cache(config.block_cache_bytes)?;
        let layout = KeyLayout::for_index(path, config.block_cache_bytes)?;
        let mut db_opts = Options::default();
        db_opts.create_if_missing(true);
        db_opts.create_missing_column_families(true);
        // Damage shows at open rather than as wrong answers later.
        db_opts.set_paranoid_checks(true);
        // Column families flush together, so a MANIFEST that lost its tail recovers to one
        // consistent past state of every family (keys and marker alike), which catch-up repairs.
        db_opts.set_atomic_flush(true);
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        db_opts.increase_parallelism(i32::try_from(cpus).unwrap_or(i32::MAX));
        // Smooths SSD writes instead of flushing whole files at once.
        db_opts.set_bytes_per_sync(1 << 20);
        // RocksDB keeps 1000 info logs by default, which a long-running daemon never needs.
        db_opts.set_keep_log_file_num(4);
        let descriptors = COLUMN_FAMILIES.iter().map(|name| {
            ColumnFamilyDescriptor::new(*name, cf_options(name, &cache, &config, layout))
        });
        let db = DB::open_cf_descriptors(&db_opts, path, descriptors).map_err(|e| {
            // A file the database's own records name is gone (CURRENT naming a MANIFEST that
            // is not there, a lost table file): damage, as much as a checksum mismatch.
            let missing = matches!(
                e.kind(),
                rocksdb::ErrorKind::IOError | rocksdb::ErrorKind::NotFound
            ) && e.to_string().contains("No such file");
            if missing {
                let _ = std::fs::write(damage_marker(path), e.to_string());
                return Error::new(
                    ErrorKind::IndexDamaged,
                    format!("opening the key index at {}", path.display()),
                )
                .with_source(e);
            }
            db_error(path, "opening", e)
        })?;
        let mut index = RocksIndex {
            db,
            path: path.to_path_buf(),
            config,
            cache,
            layout,
            max_file_id: std::sync::Mutex::new(None),
        };
        remove_dir_if_exists(&index.path.join(BULK_LOAD_DIR))?;
        index.check_format()?;
        *index
            .max_file_id
            .get_mut()
            .unwrap_or_else(|e| e.into_inner()) = index
            .meta(META_MAX_FILE_ID)?
            .map(|v| decode_u64(&v))
            .transpose()?;
        Ok(index)
    }

    /// Writes the format of a new index, or refuses one written in another format.
    fn check_format(&self) -> Result<()> {
        match self.meta(META_FORMAT)?.as_deref() {
            None => self.put_meta(META_FORMAT, &[FORMAT]),
            Some([FORMAT]) => Ok(()),
            Some(other) => Err(Error::new(
                ErrorKind::IndexDamaged,
                "key index has an unknown format; it is rebuilt from the table",
            )
            .with("path", self.path.display())
            .with("format", format!("{other:?}"))),
        }
    }

    fn cf(&self, name: &str) -> Result<&ColumnFamily> {
        self.db.cf_handle(name).ok_or_else(|| {
            Error::new(ErrorKind::Internal, "key index column family is not open")
                .with("column_family", name)
        })
    }

    /// Message for a RocksDB failure while doing `what`.
    /// Maps a RocksDB error of `what`: corruption marks the index damaged (see
    /// [`damage_marker`]), so the next open moves it aside and it is rebuilt from the table.
    fn failed<'a>(&'a self, what: &'a str) -> impl FnOnce(rocksdb::Error) -> Error + 'a {
        move |e| db_error(&self.path, what, e)
    }

    fn meta(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.db
            .get_cf(self.cf(META)?, key)
            .map_err(self.failed("reading metadata"))
    }

    fn put_meta(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.db
            .put_cf(self.cf(META)?, key, value)
            .map_err(self.failed("writing metadata"))
    }

    /// Decodes a stored entry, hiding it if it outlived the TTL (compaction drops it later).
    fn live(&self, value: &[u8], now: u64) -> Result<Option<IndexEntry>> {
        let entry = decode_entry(value)?;
        Ok((!expired(entry.written_at_secs, self.config.ttl_secs, now)).then_some(entry))
    }

    /// All pairs of a small column family in key order, each through `decode`.
    fn scan<T>(&self, name: &str, decode: impl Fn(&[u8], &[u8]) -> Result<T>) -> Result<Vec<T>> {
        self.db
            .iterator_cf(self.cf(name)?, IteratorMode::Start)
            .map(|pair| {
                let (k, v) = pair.map_err(self.failed("scanning a column family"))?;
                decode(&k, &v)
            })
            .collect()
    }

    /// Writes `sorted` into SST files under `dir` and ingests them into `keys`.
    fn load_keys(
        &self,
        sorted: &mut dyn Iterator<Item = Result<(Vec<u8>, IndexEntry)>>,
        dir: &Path,
    ) -> Result<u64> {
        // However small the index was, a bulk load can be of any size: its files are rolled
        // big, and only partitioned filters keep their lookups small.
        let opts = cf_options(KEYS, &self.cache, &self.config, KeyLayout::Partitioned);
        let start = Instant::now();
        let mut files = Vec::new();
        let mut writer: Option<SstFileWriter> = None;
        let mut prev = None;
        let mut loaded = 0u64;
        for item in sorted {
            let (key, entry) = item?;
            check_ascending(&mut prev, &key)?;
            let w = match &mut writer {
                Some(w) => w,
                None => {
                    let path = dir.join(format!("{:06}.sst", files.len()));
                    let w = SstFileWriter::create(&opts);
                    w.open(&path).map_err(self.failed("creating an SST file"))?;
                    files.push(path);
                    writer.insert(w)
                }
            };
            w.put(&key, encode_entry(&entry))
                .map_err(self.failed("writing an SST file"))?;
            loaded += 1;
            if w.file_size() >= self.config.bulk_load_file_bytes {
                w.finish().map_err(self.failed("finishing an SST file"))?;
                writer = None;
            }
            if loaded % BULK_LOAD_PROGRESS_KEYS == 0 {
                tracing::info!(
                    keys = loaded,
                    keys_per_sec = per_sec(loaded, start),
                    "Bulk load progress"
                );
            }
        }
        if let Some(mut w) = writer {
            w.finish().map_err(self.failed("finishing an SST file"))?;
        }
        let file_count = files.len();
        if !files.is_empty() {
            let mut ingest = IngestExternalFileOptions::default();
            ingest.set_move_files(true);
            self.db
                .ingest_external_file_cf_opts(self.cf(KEYS)?, &ingest, files)
                .map_err(self.failed("ingesting SST files"))?;
        }
        tracing::info!(
            keys = loaded,
            files = file_count,
            keys_per_sec = per_sec(loaded, start),
            elapsed_secs = start.elapsed().as_secs_f64(),
            "Bulk load ingested"
        );
        Ok(loaded)
    }

    /// Compacts `keys` fully, which runs the TTL filter over every entry.
    pub fn compact(&self) -> Result<()> {
        self.db
            .compact_range_cf(self.cf(KEYS)?, None::<&[u8]>, None::<&[u8]>);
        Ok(())
    }
}

impl KeyIndex for RocksIndex {
    fn get(&self, key: &[u8]) -> Result<Option<IndexEntry>> {
        let value = self
            .db
            .get_pinned_cf(self.cf(KEYS)?, key)
            .map_err(self.failed("reading a key"))?;
        match value {
            Some(v) => self.live(&v, now_secs()),
            None => Ok(None),
        }
    }

    fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<IndexEntry>>> {
        let now = now_secs();
        let cf = self.cf(KEYS)?;
        let mut out = Vec::with_capacity(keys.len());
        // RocksDB holds a context of about 150 bytes per key asked for the length of a call: a
        // checkpoint asks for every key it changed, 90 MB at once over four shards of 1M keys.
        for chunk in keys.chunks(MULTI_GET_KEYS) {
            for value in self.db.batched_multi_get_cf(cf, chunk, false) {
                out.push(match value.map_err(self.failed("reading keys"))? {
                    Some(v) => self.live(&v, now)?,
                    None => None,
                });
            }
        }
        Ok(out)
    }

    fn apply(&self, batch: IndexBatch) -> Result<()> {
        // One batch at a time: the file-id high-water mark is read, raised and written as one.
        let mut known = self.max_file_id.lock().unwrap_or_else(|e| e.into_inner());
        let (keys, partitions, files, buckets, meta) = (
            self.cf(KEYS)?,
            self.cf(PARTITIONS)?,
            self.cf(FILES)?,
            self.cf(BUCKETS)?,
            self.cf(META)?,
        );
        let mut wb = WriteBatch::default();
        // The batch copies each value: one buffer serves them all.
        let mut value = Vec::new();
        for (key, entry) in &batch.entries {
            value.clear();
            encode_entry_into(entry, &mut value);
            wb.put_cf(keys, key, &value);
        }
        for key in &batch.removed {
            wb.delete_cf(keys, key);
        }
        for (id, values) in &batch.partitions {
            wb.put_cf(partitions, id.to_be_bytes(), values);
        }
        let mut max_file_id = *known;
        for (id, path) in &batch.files {
            wb.put_cf(files, id.to_be_bytes(), path.as_bytes());
            max_file_id = max_file_id.max(Some(*id));
        }
        for id in &batch.removed_files {
            wb.delete_cf(files, id.to_be_bytes());
        }
        if let Some(id) = max_file_id.filter(|_| max_file_id != *known) {
            wb.put_cf(meta, META_MAX_FILE_ID, id.to_be_bytes());
        }
        for ((partition_id, bucket), count) in &batch.bucket_counts {
            wb.put_cf(
                buckets,
                encode_bucket_key(*partition_id, *bucket),
                count.to_be_bytes(),
            );
        }
        if let Some(marker) = &batch.marker {
            wb.put_cf(meta, META_MARKER, encode_marker(marker));
        }
        // Straight into table files, without the write-ahead log: the memtables are flushed now,
        // the marker's family last, so the MANIFEST records the batch before its marker and a
        // MANIFEST that lost its tail recovers to an older state of keys and marker alike. (A
        // log replayed on top of such a MANIFEST could bring back a marker whose keys were
        // lost.) A batch lost to a crash before the flush leaves the index consistently behind,
        // which the saved batch or a replay of the snapshots after its marker repairs.
        let mut no_wal = rocksdb::WriteOptions::default();
        no_wal.disable_wal(true);
        self.db
            .write_opt(wb, &no_wal)
            .map_err(self.failed("applying a batch"))?;
        let mut wait = rocksdb::FlushOptions::default();
        wait.set_wait(true);
        for cf in [keys, partitions, files, buckets, meta] {
            self.db
                .flush_cf_opt(cf, &wait)
                .map_err(self.failed("flushing a batch"))?;
        }
        *known = max_file_id;
        Ok(())
    }

    fn marker(&self) -> Result<Option<Marker>> {
        self.meta(META_MARKER)?
            .map(|v| decode_marker(&v))
            .transpose()
    }

    fn partitions(&self) -> Result<Vec<(u32, Vec<u8>)>> {
        self.scan(PARTITIONS, |k, v| Ok((decode_u32(k)?, v.to_vec())))
    }

    fn file_path(&self, file_id: u64) -> Result<Option<String>> {
        let value = self
            .db
            .get_cf(self.cf(FILES)?, file_id.to_be_bytes())
            .map_err(self.failed("reading a file path"))?;
        value
            .map(|v| {
                String::from_utf8(v)
                    .map_err(|_| corrupt("file path is not UTF-8").with("file_id", file_id))
            })
            .transpose()
    }

    fn files(&self) -> Result<Vec<(u64, String)>> {
        self.scan(FILES, |k, v| {
            let id = decode_u64(k)?;
            let path = String::from_utf8(v.to_vec())
                .map_err(|_| corrupt("file path is not UTF-8").with("file_id", id))?;
            Ok((id, path))
        })
    }

    fn max_file_id(&self) -> Result<Option<u64>> {
        Ok(*self.max_file_id.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn bucket_counts(&self) -> Result<Vec<((u32, u32), u64)>> {
        self.scan(BUCKETS, |k, v| Ok((decode_bucket_key(k)?, decode_u64(v)?)))
    }

    fn len_estimate(&self) -> Result<u64> {
        let estimate = self
            .db
            .property_int_value_cf(self.cf(KEYS)?, properties::ESTIMATE_NUM_KEYS)
            .map_err(self.failed("estimating the key count"))?;
        Ok(estimate.unwrap_or(0))
    }

    fn copy_to(&self, dir: &Path) -> Result<()> {
        // Files are hard-linked where the file system allows it: cheap, and immutable.
        rocksdb::checkpoint::Checkpoint::new(&self.db)
            .and_then(|c| c.create_checkpoint(dir))
            .map_err(self.failed("copying the index"))
    }

    fn bulk_load(
        &mut self,
        sorted: &mut dyn Iterator<Item = Result<(Vec<u8>, IndexEntry)>>,
        batch: IndexBatch,
    ) -> Result<u64> {
        // Dropping a column family discards its files at once, where deleting every key would
        // leave tombstones for compaction to chew through.
        for name in COLUMN_FAMILIES {
            self.db.drop_cf(name).or_kind(ErrorKind::Storage, || {
                format!("dropping column family {name} for bulk load")
            })?;
            let opts = cf_options(name, &self.cache, &self.config, self.layout);
            self.db
                .create_cf(name, &opts)
                .or_kind(ErrorKind::Storage, || {
                    format!("creating column family {name} for bulk load")
                })?;
        }
        *self
            .max_file_id
            .get_mut()
            .unwrap_or_else(|e| e.into_inner()) = None;
        self.check_format()?;
        let dir = self.path.join(BULK_LOAD_DIR);
        remove_dir_if_exists(&dir)?;
        std::fs::create_dir_all(&dir)
            .or_kind(ErrorKind::Storage, || format!("creating {}", dir.display()))?;
        let loaded = self.load_keys(sorted, &dir);
        let cleaned = remove_dir_if_exists(&dir);
        let loaded = loaded?;
        cleaned?;
        self.apply(batch)?;
        Ok(loaded)
    }
}

/// The block cache of `bytes` that every index opened with that size shares: the indexes of
/// all the shards and tables a process holds stay within one budget, however many partitions
/// it is assigned.
fn shared_cache(bytes: usize) -> Result<Cache> {
    static CACHES: std::sync::Mutex<BTreeMap<usize, Cache>> =
        std::sync::Mutex::new(BTreeMap::new());
    let mut caches = CACHES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cache) = caches.get(&bytes) {
        return Ok(cache.clone());
    }
    let cache = Cache::new_lru_cache(bytes).or_kind(ErrorKind::Storage, || {
        format!("creating a {bytes} byte block cache")
    })?;
    caches.insert(bytes, cache.clone());
    Ok(cache)
}

/// How the key column family's table files filter and index their keys, chosen at open by the
/// size of the index then. Files of either layout read alike, so an index changes layout on
/// disk as compaction rewrites it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyLayout {
    /// One Bloom filter and one index block per file, in files of at most
    /// [`WHOLE_FILTER_FILE_BYTES`]: a lookup finds each in the block cache at once. For an
    /// index whose filters all fit in the block cache many times over.
    Whole,
    /// Filters and index cut into blocks of 4 KiB under a pinned top level: a lookup reads
    /// one small block of each. For an index whose filters would crowd the block cache, and
    /// for bulk-loaded files of any size.
    Partitioned,
}

/// The most table-file bytes an index holds at open for new files to take whole filters:
/// half the block cache, about 1/30 of which is filter.
const fn whole_layout_max_bytes(block_cache_bytes: usize) -> u64 {
    block_cache_bytes as u64 / 2
}

/// Size of the key column family's files with whole filters: at about 30 bytes a key, a
/// filter of about 700 KB, well within a shard of the block cache.
const WHOLE_FILTER_FILE_BYTES: u64 = 16 << 20;

impl KeyLayout {
    /// The layout for the index at `path`, by the size of its table files.
    fn for_index(path: &Path, block_cache_bytes: usize) -> Result<KeyLayout> {
        let bytes = table_file_bytes(path)?;
        Ok(if bytes <= whole_layout_max_bytes(block_cache_bytes) {
            KeyLayout::Whole
        } else {
            KeyLayout::Partitioned
        })
    }
}

/// Bytes of the table files in the database directory `path` (none if it does not exist).
fn table_file_bytes(path: &Path) -> Result<u64> {
    let entries = match std::fs::read_dir(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        other => other.or_kind(ErrorKind::Storage, || format!("listing {}", path.display()))?,
    };
    let mut bytes = 0;
    for entry in entries {
        let entry = entry.or_kind(ErrorKind::Storage, || format!("listing {}", path.display()))?;
        if entry.file_name().to_string_lossy().ends_with(".sst") {
            // A file gone between listing and reading its size counts for nothing.
            bytes += entry.metadata().map_or(0, |m| m.len());
        }
    }
    Ok(bytes)
}

/// Options of one column family; every family shares the one block cache.
fn cf_options(name: &str, cache: &Cache, config: &RocksConfig, layout: KeyLayout) -> Options {
    let mut table = BlockBasedOptions::default();
    table.set_block_cache(cache);
    // Index and filter blocks are charged to the cache so memory stays bounded as keys grow;
    // level-0 ones stay pinned because every lookup consults them.
    table.set_cache_index_and_filter_blocks(true);
    table.set_pin_l0_filter_and_index_blocks_in_cache(true);
    table.set_format_version(5);
    let mut opts = Options::default();
    opts.set_compression_type(DBCompressionType::Lz4);
    if name == KEYS {
        table.set_bloom_filter(10.0, false);
        table.set_data_block_index_type(DataBlockIndexType::BinaryAndHash);
        match layout {
            // Small files keep each whole filter small: one of a 256 MB file (17 MB at 14M
            // keys) outgrew its shard of the block cache, was evicted at once and read again
            // on every lookup (4 ms a get at 25M keys per shard).
            KeyLayout::Whole => opts.set_target_file_size_base(WHOLE_FILTER_FILE_BYTES),
            KeyLayout::Partitioned => {
                table.set_index_type(BlockBasedIndexType::TwoLevelIndexSearch);
                table.set_partition_filters(true);
                table.set_metadata_block_size(4096);
                table.set_pin_top_level_index_and_filter(true);
            }
        }
        // Filters stay on the last level too: CDC streams are insert-heavy, and every insert
        // of a new key would otherwise read a data block there (a rebuilt index is all last
        // level). Filter blocks are charged to the block cache, so memory stays bounded.
        opts.set_level_compaction_dynamic_level_bytes(true);
        if let Some(ttl_secs) = config.ttl_secs {
            opts.set_compaction_filter_factory(TtlFilterFactory { ttl_secs });
        }
    }
    opts.set_block_based_table_factory(&table);
    opts
}

fn remove_dir_if_exists(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other.or_kind(ErrorKind::Storage, || format!("removing {}", dir.display())),
    }
}

fn per_sec(count: u64, start: Instant) -> u64 {
    let secs = start.elapsed().as_secs_f64();
    if secs > 0.0 {
        (count as f64 / secs) as u64
    } else {
        0
    }
}

const TTL_FILTER_NAME: &CStr = c"key-ttl";

/// Makes one [`TtlFilter`] per compaction, with the clock read once for the whole run.
struct TtlFilterFactory {
    ttl_secs: u64,
}

impl CompactionFilterFactory for TtlFilterFactory {
    type Filter = TtlFilter;

    fn create(&mut self, _context: CompactionFilterContext) -> TtlFilter {
        TtlFilter {
            ttl_secs: self.ttl_secs,
            now_secs: now_secs(),
        }
    }

    fn name(&self) -> &CStr {
        TTL_FILTER_NAME
    }
}

/// Drops `keys` entries that outlived the TTL.
struct TtlFilter {
    ttl_secs: u64,
    now_secs: u64,
}

impl CompactionFilter for TtlFilter {
    fn filter(&mut self, _level: u32, _key: &[u8], value: &[u8]) -> Decision {
        // A value that does not decode is kept, so reads still report it as corrupt.
        match written_at_secs(value) {
            Some(at) if expired(at, Some(self.ttl_secs), self.now_secs) => Decision::Remove,
            _ => Decision::Keep,
        }
    }

    fn name(&self) -> &CStr {
        TTL_FILTER_NAME
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RowLocation;

    fn entry(written_at_secs: u64) -> IndexEntry {
        IndexEntry {
            version: vec![1],
            location: Some(RowLocation {
                partition_id: 0,
                bucket: 0,
                file_id: 0,
                position: 0,
            }),
            row: None,
            written_at_secs,
        }
    }

    #[test]
    fn ttl_hides_expired_entries_and_compaction_drops_them() {
        let dir = tempfile::tempdir().unwrap();
        let index = RocksIndex::open(dir.path(), Some(3600)).unwrap();
        let fresh = entry(now_secs());
        index
            .apply(IndexBatch {
                entries: vec![
                    (b"old".to_vec(), entry(0)),
                    (b"new".to_vec(), fresh.clone()),
                ],
                ..IndexBatch::default()
            })
            .unwrap();
        assert_eq!(index.get(b"old").unwrap(), None);
        assert_eq!(index.get(b"new").unwrap(), Some(fresh.clone()));
        index.compact().unwrap();
        let stored = index.scan(KEYS, |k, _| Ok(k.to_vec())).unwrap();
        assert_eq!(stored, vec![b"new".to_vec()]);
        assert_eq!(index.get(b"new").unwrap(), Some(fresh));
    }

    #[test]
    fn multi_get_answers_more_keys_than_one_call_asks_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let index = RocksIndex::open(dir.path(), None).unwrap();
        let written = now_secs();
        let stored = |i: usize| {
            let mut e = entry(written);
            e.version = (i as u64).to_be_bytes().to_vec();
            e
        };
        let keys: Vec<Vec<u8>> = (0..3 * MULTI_GET_KEYS + 7)
            .map(|i| format!("k{i}").into_bytes())
            .collect();
        index
            .apply(IndexBatch {
                entries: (0..keys.len())
                    .filter(|i| i % 3 != 0)
                    .map(|i| (keys[i].clone(), stored(i)))
                    .collect(),
                ..IndexBatch::default()
            })
            .unwrap();
        let asked: Vec<&[u8]> = keys.iter().rev().map(Vec::as_slice).collect();
        let found = index.multi_get(&asked).unwrap();
        assert_eq!(found.len(), keys.len());
        for (i, got) in (0..keys.len()).rev().zip(found) {
            assert_eq!(got, (i % 3 != 0).then(|| stored(i)), "key {i}");
        }
    }

    #[test]
    fn files_damaged_on_disk_are_reported_as_damage() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("db");
        let index = RocksIndex::open(&db, None).unwrap();
        let entry = IndexEntry {
            version: vec![1],
            location: None,
            row: None,
            written_at_secs: 0,
        };
        index
            .apply(IndexBatch {
                entries: vec![(b"k".to_vec(), entry)],
                ..IndexBatch::default()
            })
            .unwrap();
        drop(index);
        std::fs::write(db.join("CURRENT"), "MANIFEST-999999\n").unwrap();
        let err = RocksIndex::open(&db, None).err().unwrap();
        assert_eq!(err.kind(), ErrorKind::IndexDamaged, "{err}");
        assert!(damage_marker(&db).exists());
    }

    #[test]
    fn unknown_format_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let index = RocksIndex::open(dir.path(), None).unwrap();
        index.put_meta(META_FORMAT, &[FORMAT + 1]).unwrap();
        drop(index);
        let err = RocksIndex::open(dir.path(), None).err().unwrap();
        assert_eq!(err.kind(), ErrorKind::IndexDamaged);
    }

    #[test]
    fn bulk_load_rolls_files_and_leaves_no_temp_dir() {
        let dir = tempfile::tempdir().unwrap();
        let config = RocksConfig {
            bulk_load_file_bytes: 4096,
            ..RocksConfig::default()
        };
        let mut index = RocksIndex::open_with(dir.path(), config).unwrap();
        let mut sorted = (0u32..20_000).map(|i| Ok((i.to_be_bytes().to_vec(), entry(i.into()))));
        let loaded = index.bulk_load(&mut sorted, IndexBatch::default()).unwrap();
        assert_eq!(loaded, 20_000);
        let live = index.db.live_files().unwrap();
        assert!(live.iter().filter(|f| f.column_family_name == KEYS).count() > 1);
        assert!(!dir.path().join(BULK_LOAD_DIR).exists());
        assert_eq!(index.get(&7u32.to_be_bytes()).unwrap(), Some(entry(7)));
        assert_eq!(index.len_estimate().unwrap(), 20_000);
    }

    /// Index partitions in the key column family's table files, all together (files with one
    /// index block do not list the count).
    fn index_partitions(index: &RocksIndex) -> u64 {
        let props = index
            .db
            .property_value_cf(
                index.cf(KEYS).unwrap(),
                "rocksdb.aggregated-table-properties",
            )
            .unwrap()
            .unwrap();
        props
            .split(';')
            .find_map(|p| p.trim().strip_prefix("# index partitions="))
            .map_or(0, |n| n.parse().unwrap())
    }

    #[test]
    fn an_index_too_big_at_open_for_whole_filters_partitions_them_and_reads_both() {
        let dir = tempfile::tempdir().unwrap();
        // A 1 MiB cache: whole filters up to 512 KiB of table files at open.
        let config = RocksConfig {
            block_cache_bytes: 1 << 20,
            ..RocksConfig::default()
        };
        let written = now_secs();
        let stored = |i: u32, round: u32| {
            let mut e = entry(written);
            e.version = [round.to_be_bytes(), i.to_be_bytes()].concat();
            e
        };
        let write = |index: &RocksIndex, keys: std::ops::Range<u32>, round: u32| {
            for chunk in keys.collect::<Vec<_>>().chunks(10_000) {
                let entries = chunk
                    .iter()
                    .map(|i| (format!("key-{i:08}").into_bytes(), stored(*i, round)))
                    .collect();
                index
                    .apply(IndexBatch {
                        entries,
                        ..IndexBatch::default()
                    })
                    .unwrap();
            }
        };
        let index = RocksIndex::open_with(dir.path(), config.clone()).unwrap();
        assert_eq!(index.layout, KeyLayout::Whole);
        write(&index, 0..60_000, 1);
        assert_eq!(index_partitions(&index), 0);
        drop(index);
        assert!(table_file_bytes(dir.path()).unwrap() > whole_layout_max_bytes(1 << 20));

        let index = RocksIndex::open_with(dir.path(), config).unwrap();
        assert_eq!(index.layout, KeyLayout::Partitioned);
        // Half the keys again, and new ones, in files of the other layout.
        write(&index, 30_000..90_000, 2);
        assert!(index_partitions(&index) > 0);
        let check = |index: &RocksIndex| {
            for i in (0..90_000)
                .step_by(7)
                .chain([0, 29_999, 30_000, 59_999, 89_999])
            {
                let round = if i < 30_000 { 1 } else { 2 };
                let key = format!("key-{i:08}").into_bytes();
                assert_eq!(index.get(&key).unwrap(), Some(stored(i, round)), "key {i}");
            }
            for absent in ["key-", "key-00090000", "kez"] {
                assert_eq!(index.get(absent.as_bytes()).unwrap(), None);
            }
        };
        check(&index);
        // Compaction rewrites files of both layouts into one.
        index.compact().unwrap();
        check(&index);
    }
}
