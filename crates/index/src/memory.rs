//! The in-memory [`KeyIndex`]: the reference the RocksDB index is tested against, and enough for
//! tests and tiny tables. Nothing survives the process.

use std::collections::BTreeMap;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{check_ascending, expired, now_secs, IndexBatch, IndexEntry, KeyIndex, Marker};
use inlet_common::error::Result;

/// A [`KeyIndex`] held in ordered maps.
#[derive(Debug, Default)]
pub struct MemoryIndex {
    state: RwLock<State>,
    ttl_secs: Option<u64>,
}

#[derive(Debug, Default)]
struct State {
    keys: BTreeMap<Vec<u8>, IndexEntry>,
    partitions: BTreeMap<u32, Vec<u8>>,
    files: BTreeMap<u64, String>,
    max_file_id: Option<u64>,
    buckets: BTreeMap<(u32, u32), u64>,
    marker: Option<Marker>,
}

impl State {
    fn apply(&mut self, batch: IndexBatch) {
        self.keys.extend(batch.entries);
        for key in &batch.removed {
            self.keys.remove(key);
        }
        self.partitions.extend(batch.partitions);
        for (id, path) in batch.files {
            self.max_file_id = self.max_file_id.max(Some(id));
            self.files.insert(id, path);
        }
        for id in &batch.removed_files {
            self.files.remove(id);
        }
        self.buckets.extend(batch.bucket_counts);
        if batch.marker.is_some() {
            self.marker = batch.marker;
        }
    }
}

impl MemoryIndex {
    /// An empty index without TTL.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty index whose entries read as absent `ttl_secs` after they were written.
    pub fn with_ttl(ttl_secs: Option<u64>) -> Self {
        MemoryIndex {
            ttl_secs,
            ..Self::default()
        }
    }

    fn live(&self, entry: &IndexEntry, now: u64) -> Option<IndexEntry> {
        (!expired(entry.written_at_secs, self.ttl_secs, now)).then(|| entry.clone())
    }

    // A panic while the lock was held leaves whole maps behind: every write is one call.
    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }
}

impl KeyIndex for MemoryIndex {
    fn get(&self, key: &[u8]) -> Result<Option<IndexEntry>> {
        let now = now_secs();
        Ok(self.read().keys.get(key).and_then(|e| self.live(e, now)))
    }

    fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<IndexEntry>>> {
        let now = now_secs();
        let state = self.read();
        Ok(keys
            .iter()
            .map(|k| state.keys.get(*k).and_then(|e| self.live(e, now)))
            .collect())
    }

    fn apply(&self, batch: IndexBatch) -> Result<()> {
        self.write().apply(batch);
        Ok(())
    }

    fn marker(&self) -> Result<Option<Marker>> {
        Ok(self.read().marker)
    }

    fn partitions(&self) -> Result<Vec<(u32, Vec<u8>)>> {
        Ok(self
            .read()
            .partitions
            .iter()
            .map(|(id, v)| (*id, v.clone()))
            .collect())
    }

    fn file_path(&self, file_id: u64) -> Result<Option<String>> {
        Ok(self.read().files.get(&file_id).cloned())
    }

    fn files(&self) -> Result<Vec<(u64, String)>> {
        Ok(self
            .read()
            .files
            .iter()
            .map(|(id, path)| (*id, path.clone()))
            .collect())
    }

    fn max_file_id(&self) -> Result<Option<u64>> {
        Ok(self.read().max_file_id)
    }

    fn bucket_counts(&self) -> Result<Vec<((u32, u32), u64)>> {
        Ok(self.read().buckets.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn len_estimate(&self) -> Result<u64> {
        Ok(self.read().keys.len() as u64)
    }

    fn bulk_load(
        &mut self,
        sorted: &mut dyn Iterator<Item = Result<(Vec<u8>, IndexEntry)>>,
        batch: IndexBatch,
    ) -> Result<u64> {
        // A load that fails part way must leave an index that asks to be loaded again.
        *self.write() = State::default();
        let mut state = State::default();
        let mut prev = None;
        let mut loaded = 0;
        for item in sorted {
            let (key, entry) = item?;
            check_ascending(&mut prev, &key)?;
            state.keys.insert(key, entry);
            loaded += 1;
        }
        state.apply(batch);
        *self.write() = state;
        Ok(loaded)
    }
}
