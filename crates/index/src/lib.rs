//! The key index: for every primary key, its newest version and where its live row is.
//!
//! The upsert engine asks the index two things per record: is this version newer than the
//! key's stored one (else the record is a late duplicate and is dropped), and where is the
//! key's old row (so an update becomes a position delete of the old row plus an insert, even
//! when the partition changed). After each committed snapshot the engine applies one
//! [`IndexBatch`] atomically; the batch carries the snapshot's [`Marker`], so the index always
//! knows which snapshot it equals and can catch up by replaying the snapshots after it.
//!
//! Two implementations pass one conformance test: [`RocksIndex`] (on local disk, memory
//! bounded by its block cache, not by the number of keys) and [`MemoryIndex`] (a model for
//! tests and tiny tables).
//!
//! # Layout on disk
//!
//! One RocksDB database per shard, one column family per kind of fact. Integers are fixed-width
//! big-endian, so RocksDB's bytewise key order is numeric order.
//!
//! | column family | key | value |
//! |---|---|---|
//! | `keys` | the primary key, as the caller encoded it | [`encode_entry`] |
//! | `partitions` | partition id `u32` | the caller's encoding of the partition values |
//! | `files` | data file id `u64` | the file path, UTF-8 |
//! | `buckets` | partition id `u32`, bucket `u32` | live row count `u64` |
//! | `meta` | `format` | format of this layout, one byte ([`FORMAT`]) |
//! | `meta` | `marker` | snapshot id `i64`, sequence number `i64` |
//! | `meta` | `max_file_id` | highest data file id ever recorded, `u64` |
//!
//! `max_file_id` is a high-water mark rather than the last key of `files`, so an id whose file
//! was forgotten after compaction is never handed out again.
//!
//! # Entry encoding (format 1)
//!
//! | bytes | field |
//! |---|---|
//! | 1 | format, `1` |
//! | 1 | flags: `0x01` location present, `0x02` row present; other bits zero |
//! | 8 | `written_at_secs` (fixed offset: the TTL compaction filter reads only this) |
//! | 4 + n | version length, version bytes ([`encode_version`]) |
//! | 24 | if located: partition id `u32`, bucket `u32`, file id `u64`, position `u64` |
//! | 4 + n | if row: row length, row bytes |
//!
//! Every field is length-checked on decode and trailing bytes are rejected, so a truncated or
//! foreign value is an error rather than a plausible entry.
//!
//! # TTL
//!
//! With a TTL, an entry written more than `ttl_secs` ago reads as absent, and RocksDB drops it
//! at compaction. The row itself stays in the table: a later insert of that key is taken as
//! new and adds a second row (a duplicate), and a late record older than an expired tombstone
//! is applied again. Only use a TTL where keys are known not to recur after it.

mod inline_bytes;
mod memory;
mod rocks;

#[cfg(test)]
mod conformance;

use std::time::{SystemTime, UNIX_EPOCH};

use inlet_common::error::{Error, ErrorKind, Result};

pub use inline_bytes::InlineBytes;
pub use memory::MemoryIndex;
pub use rocks::{
    damage_marker, RocksConfig, RocksIndex, DEFAULT_BLOCK_CACHE_BYTES, DEFAULT_BULK_LOAD_FILE_BYTES,
};

/// Format of the on-disk layout and of entry values; bump on any incompatible change.
pub const FORMAT: u8 = 1;

/// Where a key's live row is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLocation {
    /// Compact id of the row's partition (see [`KeyIndex::partitions`]).
    pub partition_id: u32,
    /// Bucket within the partition.
    pub bucket: u32,
    /// Id of the data file holding the row (see [`KeyIndex::file_path`]).
    pub file_id: u64,
    /// Row position within that file, as position deletes name it.
    pub position: u64,
}

/// What the index knows of a key: its newest version, and where its row lives unless deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    /// Memcomparable-encoded version ([`encode_version`]), compared bytewise.
    pub version: Vec<u8>,
    /// `None` is a tombstone: the key is deleted, its version kept so late older records stay
    /// dropped.
    pub location: Option<RowLocation>,
    /// The stored row, for merge engines that need old values.
    pub row: Option<Vec<u8>>,
    /// When the entry was written, in seconds since the epoch; only the TTL reads it.
    pub written_at_secs: u64,
}

/// The last table snapshot whose changes the index holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marker {
    /// Iceberg snapshot id.
    pub snapshot_id: i64,
    /// Iceberg sequence number of that snapshot.
    pub sequence_number: i64,
}

/// One checkpoint's changes, applied atomically.
///
/// Within a batch, later items win over earlier ones, and removals win over upserts.
#[derive(Debug, Clone, Default)]
pub struct IndexBatch {
    /// Upserts of keys (live or tombstone).
    pub entries: Vec<(Vec<u8>, IndexEntry)>,
    /// Keys to forget entirely.
    pub removed: Vec<Vec<u8>>,
    /// Partition id to encoded partition values.
    pub partitions: Vec<(u32, Vec<u8>)>,
    /// Data file id to file path.
    pub files: Vec<(u64, String)>,
    /// Data file ids no longer referenced (rewritten by compaction); their ids stay used.
    pub removed_files: Vec<u64>,
    /// (partition id, bucket) to live row count.
    pub bucket_counts: Vec<((u32, u32), u64)>,
    /// The snapshot these changes bring the index to; `None` keeps the current marker.
    pub marker: Option<Marker>,
}

/// A persistent map from primary key to [`IndexEntry`], plus the small tables the upsert
/// engine keeps beside it.
pub trait KeyIndex: Send + Sync {
    /// The key's entry, tombstones included; `None` if unknown or expired.
    fn get(&self, key: &[u8]) -> Result<Option<IndexEntry>>;

    /// [`KeyIndex::get`] for many keys, answers in the order of `keys`; duplicates allowed.
    fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<IndexEntry>>>;

    /// Applies `batch` atomically: after a crash either all of it or none of it is there.
    /// Readers meanwhile see the index before or after it, key by key.
    fn apply(&self, batch: IndexBatch) -> Result<()>;

    /// The last snapshot applied; `None` for a new index or one whose bulk load did not finish.
    fn marker(&self) -> Result<Option<Marker>>;

    /// All partition ids with their encoded values, ascending by id.
    fn partitions(&self) -> Result<Vec<(u32, Vec<u8>)>>;

    /// The path of data file `file_id`, unless unknown or removed.
    fn file_path(&self, file_id: u64) -> Result<Option<String>>;

    /// All data files not removed, ascending by id.
    fn files(&self) -> Result<Vec<(u64, String)>>;

    /// The highest file id ever recorded, removed files included, so new ids can follow it.
    fn max_file_id(&self) -> Result<Option<u64>>;

    /// Live row counts per (partition id, bucket), ascending.
    fn bucket_counts(&self) -> Result<Vec<((u32, u32), u64)>>;

    /// Roughly how many keys are stored, tombstones and expired keys included.
    fn len_estimate(&self) -> Result<u64>;

    /// Writes a consistent copy of the whole index (marker included) into the new directory
    /// `dir`, which an index opened there reads as this one. Indexes kept only in memory have
    /// none.
    fn copy_to(&self, dir: &std::path::Path) -> Result<()> {
        Err(Error::new(
            ErrorKind::Internal,
            format!("this index cannot be copied to {}", dir.display()),
        ))
    }

    /// Replaces the whole index (keys, partitions, files, bucket counts, marker) with `sorted`
    /// (ascending, unique keys) and then `batch`, for rebuilding from the table. Returns the
    /// number of keys loaded. The first error `sorted` yields ends the load with that error.
    ///
    /// The marker is cleared first, so an index whose load failed or was interrupted reads as
    /// having no marker and must be loaded again.
    fn bulk_load(
        &mut self,
        sorted: &mut dyn Iterator<Item = Result<(Vec<u8>, IndexEntry)>>,
        batch: IndexBatch,
    ) -> Result<u64>;
}

const FLAG_LOCATION: u8 = 0x01;
const FLAG_ROW: u8 = 0x02;
/// Offset of `written_at_secs` in an encoded entry.
const WRITTEN_AT_OFFSET: usize = 2;

/// Encodes an entry as the `keys` column family stores it (layout in the module docs).
pub fn encode_entry(entry: &IndexEntry) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_entry_len(entry));
    encode_entry_into(entry, &mut out);
    out
}

/// The length of `entry` encoded.
pub fn encoded_entry_len(entry: &IndexEntry) -> usize {
    let location = if entry.location.is_some() { 24 } else { 0 };
    let row = entry.row.as_ref().map_or(0, |r| 4 + r.len());
    2 + 8 + 4 + entry.version.len() + location + row
}

/// Appends `entry`, encoded as [`encode_entry`] does, to `out`.
pub fn encode_entry_into(entry: &IndexEntry, out: &mut Vec<u8>) {
    let mut flags = 0;
    if entry.location.is_some() {
        flags |= FLAG_LOCATION;
    }
    if entry.row.is_some() {
        flags |= FLAG_ROW;
    }
    out.push(FORMAT);
    out.push(flags);
    out.extend_from_slice(&entry.written_at_secs.to_be_bytes());
    put_bytes(out, &entry.version);
    if let Some(loc) = &entry.location {
        out.extend_from_slice(&loc.partition_id.to_be_bytes());
        out.extend_from_slice(&loc.bucket.to_be_bytes());
        out.extend_from_slice(&loc.file_id.to_be_bytes());
        out.extend_from_slice(&loc.position.to_be_bytes());
    }
    if let Some(row) = &entry.row {
        put_bytes(out, row);
    }
}

/// Appends a `u32` length and the bytes.
fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // RocksDB cannot store a value of 4 GiB or more, so u32 loses nothing; saturating makes an
    // impossible oversize field fail to decode instead of decoding as something else.
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(bytes);
}

/// Decodes a value written by [`encode_entry`].
pub fn decode_entry(bytes: &[u8]) -> Result<IndexEntry> {
    let mut r = Reader { bytes, pos: 0 };
    let format = r.u8()?;
    if format != FORMAT {
        return Err(corrupt("unknown index entry format").with("format", format));
    }
    let flags = r.u8()?;
    if flags & !(FLAG_LOCATION | FLAG_ROW) != 0 {
        return Err(corrupt("unknown index entry flags").with("flags", flags));
    }
    let written_at_secs = r.u64()?;
    let version = r.bytes()?.to_vec();
    let location = if flags & FLAG_LOCATION != 0 {
        Some(RowLocation {
            partition_id: r.u32()?,
            bucket: r.u32()?,
            file_id: r.u64()?,
            position: r.u64()?,
        })
    } else {
        None
    };
    let row = if flags & FLAG_ROW != 0 {
        Some(r.bytes()?.to_vec())
    } else {
        None
    };
    r.end()?;
    Ok(IndexEntry {
        version,
        location,
        row,
        written_at_secs,
    })
}

/// `written_at_secs` of an encoded entry, without decoding the rest.
fn written_at_secs(encoded: &[u8]) -> Option<u64> {
    if encoded.first() != Some(&FORMAT) {
        return None;
    }
    let field = encoded.get(WRITTEN_AT_OFFSET..WRITTEN_AT_OFFSET + 8)?;
    Some(u64::from_be_bytes(field.try_into().ok()?))
}

/// Cursor over an encoded value; every read is bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(corrupt("truncated index value").with("len", self.bytes.len()));
        };
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_be_bytes(self.array()?))
    }

    fn bytes(&mut self) -> Result<&'a [u8]> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    fn end(&self) -> Result<()> {
        if self.pos == self.bytes.len() {
            Ok(())
        } else {
            Err(corrupt("trailing bytes in index value").with("len", self.bytes.len()))
        }
    }
}

/// Stored bytes that do not decode: retrying will not help, rebuilding the index will.
fn corrupt(message: &str) -> Error {
    Error::new(ErrorKind::IndexDamaged, message)
}

fn encode_marker(marker: &Marker) -> [u8; 16] {
    let mut out = [0; 16];
    out[..8].copy_from_slice(&marker.snapshot_id.to_be_bytes());
    out[8..].copy_from_slice(&marker.sequence_number.to_be_bytes());
    out
}

fn decode_marker(bytes: &[u8]) -> Result<Marker> {
    let mut r = Reader { bytes, pos: 0 };
    let marker = Marker {
        snapshot_id: r.i64()?,
        sequence_number: r.i64()?,
    };
    r.end()?;
    Ok(marker)
}

fn decode_u32(bytes: &[u8]) -> Result<u32> {
    let mut r = Reader { bytes, pos: 0 };
    let v = r.u32()?;
    r.end()?;
    Ok(v)
}

fn decode_u64(bytes: &[u8]) -> Result<u64> {
    let mut r = Reader { bytes, pos: 0 };
    let v = r.u64()?;
    r.end()?;
    Ok(v)
}

fn encode_bucket_key(partition_id: u32, bucket: u32) -> [u8; 8] {
    let mut out = [0; 8];
    out[..4].copy_from_slice(&partition_id.to_be_bytes());
    out[4..].copy_from_slice(&bucket.to_be_bytes());
    out
}

fn decode_bucket_key(bytes: &[u8]) -> Result<(u32, u32)> {
    let mut r = Reader { bytes, pos: 0 };
    let key = (r.u32()?, r.u32()?);
    r.end()?;
    Ok(key)
}

/// Whether an entry written at `written_at_secs` has outlived `ttl_secs` at `now_secs`.
fn expired(written_at_secs: u64, ttl_secs: Option<u64>, now_secs: u64) -> bool {
    ttl_secs.is_some_and(|ttl| written_at_secs.saturating_add(ttl) < now_secs)
}

fn now_secs() -> u64 {
    // A clock before 1970 is broken; reading it as 0 only delays expiry.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Checks that bulk-loaded keys ascend strictly, remembering the last one in `prev`.
fn check_ascending(prev: &mut Option<Vec<u8>>, key: &[u8]) -> Result<()> {
    if let Some(p) = prev.as_mut() {
        if p.as_slice() >= key {
            return Err(Error::new(
                ErrorKind::Internal,
                "bulk load keys are not ascending and unique",
            ));
        }
        p.clear();
        p.extend_from_slice(key);
    } else {
        *prev = Some(key.to_vec());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry() -> impl Strategy<Value = IndexEntry> {
        (
            prop::collection::vec(any::<u8>(), 0..20),
            prop::option::of((any::<u32>(), any::<u32>(), any::<u64>(), any::<u64>())),
            prop::option::of(prop::collection::vec(any::<u8>(), 0..20)),
            any::<u64>(),
        )
            .prop_map(|(version, loc, row, written_at_secs)| IndexEntry {
                version,
                location: loc.map(|(partition_id, bucket, file_id, position)| RowLocation {
                    partition_id,
                    bucket,
                    file_id,
                    position,
                }),
                row,
                written_at_secs,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn entry_round_trips(e in entry()) {
            let bytes = encode_entry(&e);
            prop_assert_eq!(decode_entry(&bytes)?, e.clone());
            prop_assert_eq!(written_at_secs(&bytes), Some(e.written_at_secs));
            for cut in 0..bytes.len() {
                prop_assert!(decode_entry(&bytes[..cut]).is_err(), "prefix of {} decoded", cut);
            }
            let mut longer = bytes;
            longer.push(0);
            prop_assert!(decode_entry(&longer).is_err());
        }
    }

    #[test]
    fn entry_layout_is_stable() {
        let e = IndexEntry {
            version: vec![7],
            location: Some(RowLocation {
                partition_id: 1,
                bucket: 2,
                file_id: 3,
                position: 4,
            }),
            row: None,
            written_at_secs: 5,
        };
        let mut expected = vec![FORMAT, FLAG_LOCATION, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 1, 7];
        expected.extend([0, 0, 0, 1, 0, 0, 0, 2]);
        expected.extend([0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 4]);
        assert_eq!(encode_entry(&e), expected);
    }

    #[test]
    fn unknown_format_and_flags_are_rejected() {
        let mut bytes = encode_entry(&IndexEntry {
            version: vec![],
            location: None,
            row: None,
            written_at_secs: 0,
        });
        bytes[1] = 0x04;
        assert_eq!(
            decode_entry(&bytes).unwrap_err().kind(),
            ErrorKind::IndexDamaged
        );
        bytes[1] = 0;
        bytes[0] = FORMAT + 1;
        assert!(decode_entry(&bytes).is_err());
        assert_eq!(written_at_secs(&bytes), None);
    }

    #[test]
    fn expiry() {
        assert!(!expired(0, None, u64::MAX));
        assert!(!expired(100, Some(10), 110));
        assert!(expired(100, Some(10), 111));
        assert!(!expired(u64::MAX, Some(10), u64::MAX));
    }
}
