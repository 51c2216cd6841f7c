//! The conformance test both [`KeyIndex`] implementations must pass: random operation sequences,
//! each step checked against a plain model built from ordered maps.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

/// The smallest thing that behaves like an index; written apart from [`MemoryIndex`] on purpose.
#[derive(Debug, Default)]
struct Model {
    keys: BTreeMap<Vec<u8>, IndexEntry>,
    partitions: BTreeMap<u32, Vec<u8>>,
    files: BTreeMap<u64, String>,
    max_file_id: Option<u64>,
    buckets: BTreeMap<(u32, u32), u64>,
    marker: Option<Marker>,
}

impl Model {
    fn apply(&mut self, batch: &IndexBatch) {
        for (key, entry) in &batch.entries {
            self.keys.insert(key.clone(), entry.clone());
        }
        for key in &batch.removed {
            self.keys.remove(key);
        }
        for (id, values) in &batch.partitions {
            self.partitions.insert(*id, values.clone());
        }
        for (id, path) in &batch.files {
            self.files.insert(*id, path.clone());
            if self.max_file_id.is_none_or(|max| *id > max) {
                self.max_file_id = Some(*id);
            }
        }
        for id in &batch.removed_files {
            self.files.remove(id);
        }
        for (bucket, count) in &batch.bucket_counts {
            self.buckets.insert(*bucket, *count);
        }
        if let Some(marker) = batch.marker {
            self.marker = Some(marker);
        }
    }

    fn get(&self, key: &[u8], ttl_secs: Option<u64>) -> Option<IndexEntry> {
        let now = now_secs();
        let entry = self.keys.get(key)?;
        let alive = match ttl_secs {
            None => true,
            Some(ttl) => entry.written_at_secs.saturating_add(ttl) >= now,
        };
        alive.then(|| entry.clone())
    }
}

#[derive(Debug, Clone)]
enum Op {
    Apply(IndexBatch),
    BulkLoad(BTreeMap<Vec<u8>, IndexEntry>, IndexBatch),
    MultiGet(Vec<Vec<u8>>),
    /// Closes the RocksDB index and opens the same path again.
    Reopen,
    /// Compacts the RocksDB keys, running the TTL filter.
    Compact,
}

const KEY_BYTES: [u8; 3] = [0x00, 0x01, 0xFF];
const PARTITION_IDS: [u32; 4] = [0, 1, 2, u32::MAX];
const FILE_IDS: [u64; 5] = [0, 1, 2, 3, u64::MAX];

/// Every key the strategies can produce: collisions are the point, and the empty key and
/// 0x00/0xFF bytes probe the edges of RocksDB's bytewise order.
fn universe() -> Vec<Vec<u8>> {
    let mut keys = vec![vec![]];
    for a in KEY_BYTES {
        keys.push(vec![a]);
        for b in KEY_BYTES {
            keys.push(vec![a, b]);
        }
    }
    keys
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(KEY_BYTES.to_vec()), 0..3)
}

fn entry() -> impl Strategy<Value = IndexEntry> {
    (
        prop::collection::vec(any::<u8>(), 0..4),
        prop::option::of((
            prop::sample::select(PARTITION_IDS.to_vec()),
            0u32..3,
            prop::sample::select(FILE_IDS.to_vec()),
            any::<u64>(),
        )),
        prop::option::of(prop::collection::vec(any::<u8>(), 0..8)),
        // Long expired under the test's TTL, or never expiring.
        prop::sample::select(vec![0, 1, u64::MAX]),
    )
        .prop_map(|(version, location, row, written_at_secs)| IndexEntry {
            version,
            location: location.map(|(partition_id, bucket, file_id, position)| RowLocation {
                partition_id,
                bucket,
                file_id,
                position,
            }),
            row,
            written_at_secs,
        })
}

fn batch() -> impl Strategy<Value = IndexBatch> {
    let file_id = || prop::sample::select(FILE_IDS.to_vec());
    (
        prop::collection::vec((key(), entry()), 0..6),
        prop::collection::vec(key(), 0..3),
        prop::collection::vec(
            (
                prop::sample::select(PARTITION_IDS.to_vec()),
                prop::collection::vec(any::<u8>(), 0..4),
            ),
            0..3,
        ),
        prop::collection::vec((file_id(), "[a-z/=]{0,8}"), 0..3),
        prop::collection::vec(file_id(), 0..2),
        prop::collection::vec(((0u32..3, 0u32..3), any::<u64>()), 0..3),
        prop::option::of((any::<i64>(), any::<i64>())),
    )
        .prop_map(
            |(entries, removed, partitions, files, removed_files, bucket_counts, marker)| {
                IndexBatch {
                    entries,
                    removed,
                    partitions,
                    files,
                    removed_files,
                    bucket_counts,
                    marker: marker.map(|(snapshot_id, sequence_number)| Marker {
                        snapshot_id,
                        sequence_number,
                    }),
                }
            },
        )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => batch().prop_map(Op::Apply),
        2 => (prop::collection::btree_map(key(), entry(), 0..10), batch())
            .prop_map(|(sorted, batch)| Op::BulkLoad(sorted, batch)),
        2 => prop::collection::vec(key(), 0..8).prop_map(Op::MultiGet),
        1 => Just(Op::Reopen),
        1 => Just(Op::Compact),
    ]
}

/// Compares everything an index can be asked with the model.
fn check(
    name: &str,
    index: &dyn KeyIndex,
    model: &Model,
    ttl_secs: Option<u64>,
) -> std::result::Result<(), TestCaseError> {
    let keys = universe();
    for key in &keys {
        prop_assert_eq!(
            index.get(key)?,
            model.get(key, ttl_secs),
            "{} get {:?}",
            name,
            key
        );
    }
    // Reversed and with a repeat, so answers must follow the request, not key order.
    let mut request: Vec<&[u8]> = keys.iter().rev().map(Vec::as_slice).collect();
    request.push(&keys[1]);
    let expected: Vec<_> = request.iter().map(|k| model.get(k, ttl_secs)).collect();
    prop_assert_eq!(index.multi_get(&request)?, expected, "{} multi_get", name);
    prop_assert_eq!(index.marker()?, model.marker, "{} marker", name);
    let partitions: Vec<_> = model
        .partitions
        .iter()
        .map(|(k, v)| (*k, v.clone()))
        .collect();
    prop_assert_eq!(index.partitions()?, partitions, "{} partitions", name);
    for id in FILE_IDS {
        prop_assert_eq!(
            index.file_path(id)?,
            model.files.get(&id).cloned(),
            "{} file {}",
            name,
            id
        );
    }
    let files: Vec<_> = model
        .files
        .iter()
        .map(|(id, path)| (*id, path.clone()))
        .collect();
    prop_assert_eq!(index.files()?, files, "{} files", name);
    prop_assert_eq!(
        index.max_file_id()?,
        model.max_file_id,
        "{} max_file_id",
        name
    );
    let buckets: Vec<_> = model.buckets.iter().map(|(k, v)| (*k, *v)).collect();
    prop_assert_eq!(index.bucket_counts()?, buckets, "{} bucket_counts", name);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn rocks_and_memory_match_the_model(
        ttl_secs in prop::option::of(Just(3600u64)),
        ops in prop::collection::vec(op(), 1..50),
    ) {
        let dir = tempfile::tempdir()?;
        let config = RocksConfig {
            ttl_secs,
            block_cache_bytes: 1 << 20,
            ..RocksConfig::default()
        };
        let mut rocks = RocksIndex::open_with(dir.path(), config.clone())?;
        let mut memory = MemoryIndex::with_ttl(ttl_secs);
        let mut model = Model::default();
        check("rocks", &rocks, &model, ttl_secs)?;
        for op in ops {
            match op {
                Op::Apply(batch) => {
                    model.apply(&batch);
                    memory.apply(batch.clone())?;
                    rocks.apply(batch)?;
                }
                Op::BulkLoad(sorted, batch) => {
                    model = Model { keys: sorted.clone(), ..Model::default() };
                    model.apply(&batch);
                    let n = sorted.len() as u64;
                    let loaded = memory.bulk_load(&mut sorted.clone().into_iter().map(Ok), batch.clone())?;
                    prop_assert_eq!(loaded, n);
                    let loaded = rocks.bulk_load(&mut sorted.into_iter().map(Ok), batch)?;
                    prop_assert_eq!(loaded, n);
                }
                Op::MultiGet(keys) => {
                    let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                    let expected: Vec<_> = keys.iter().map(|k| model.get(k, ttl_secs)).collect();
                    prop_assert_eq!(memory.multi_get(&keys)?, expected.clone());
                    prop_assert_eq!(rocks.multi_get(&keys)?, expected);
                }
                Op::Reopen => {
                    drop(rocks);
                    rocks = RocksIndex::open_with(dir.path(), config.clone())?;
                }
                Op::Compact => rocks.compact()?,
            }
            check("memory", &memory, &model, ttl_secs)?;
            check("rocks", &rocks, &model, ttl_secs)?;
            prop_assert_eq!(memory.len_estimate()?, model.keys.len() as u64);
        }
    }
}

fn entry_at(written_at_secs: u64) -> IndexEntry {
    IndexEntry {
        version: vec![],
        location: None,
        row: None,
        written_at_secs,
    }
}

/// An unsorted load fails, and leaves an index that says it must be loaded again.
fn unsorted_bulk_load_fails(index: &mut dyn KeyIndex) {
    let marker = Marker {
        snapshot_id: 1,
        sequence_number: 1,
    };
    index
        .apply(IndexBatch {
            marker: Some(marker),
            ..IndexBatch::default()
        })
        .unwrap();
    let mut unsorted = [b"b", b"a"]
        .into_iter()
        .map(|k| Ok((k.to_vec(), entry_at(0))));
    let err = index
        .bulk_load(&mut unsorted, IndexBatch::default())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Internal);
    assert_eq!(index.marker().unwrap(), None);
    let mut repeated = [b"a", b"a"]
        .into_iter()
        .map(|k| Ok((k.to_vec(), entry_at(0))));
    assert!(index
        .bulk_load(&mut repeated, IndexBatch::default())
        .is_err());
    // A source that fails part way must not leave a marked index with half its keys.
    let mut failing = [
        Ok((b"a".to_vec(), entry_at(0))),
        Err(Error::new(ErrorKind::Storage, "run file lost")),
    ]
    .into_iter();
    let batch = IndexBatch {
        marker: Some(marker),
        ..IndexBatch::default()
    };
    let err = index.bulk_load(&mut failing, batch).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Storage);
    assert_eq!(index.marker().unwrap(), None);
}

#[test]
fn unsorted_bulk_load_fails_in_memory() {
    unsorted_bulk_load_fails(&mut MemoryIndex::new());
}

#[test]
fn unsorted_bulk_load_fails_in_rocks() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = RocksIndex::open(dir.path(), None).unwrap();
    unsorted_bulk_load_fails(&mut index);
    drop(index);
    let index = RocksIndex::open(dir.path(), None).unwrap();
    assert_eq!(index.marker().unwrap(), None);
}
