//! Index copies beside the table. A shard's index is copied (a RocksDB checkpoint: immutable
//! files plus the marker of the snapshot it holds) to the table's storage under
//! `<location>/inlet-index/<pipeline>/<topic>-<partition>/<epoch>-<sequence>/`, and a small
//! manifest naming every file with its size is written last, so a copy without its manifest is
//! never used. The pipeline's next snapshot records the manifest's URI per partition
//! ([`SUMMARY_INDEX_COPIES`]). A member that takes a partition over without a local index
//! downloads the newest copy and catches up from the snapshots after its marker, instead of
//! reading every data file of the shard. Each shard keeps its two newest copies.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::commit::CopyPointers;
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_iceberg::io::FileIO;
use inlet_index::Marker;

/// Copies kept per shard.
const KEPT: usize = 2;

const MANIFEST: &str = "copy.json";

/// What a copy holds; written last.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CopyManifest {
    pub pipeline: String,
    pub topic: String,
    pub partition: i32,
    /// Owner epoch of the member that made it.
    pub epoch: i64,
    /// The snapshot the copied index is level with.
    pub snapshot_id: i64,
    pub sequence_number: i64,
    pub files: Vec<CopyFile>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CopyFile {
    pub name: String,
    pub size: u64,
}

/// Where the copies of one shard live.
pub fn shard_dir(location: &str, pipeline: &str, topic: &str, partition: i32) -> String {
    format!(
        "{}/inlet-index/{pipeline}/{topic}-{partition}",
        location.trim_end_matches('/')
    )
}

/// A local copy of a shard's index, taken at `marker`, waiting for upload.
pub struct LocalCopy {
    pub dir: PathBuf,
    pub manifest: CopyManifest,
}

/// Uploads `copy` below `shard_dir` (files first, manifest last), removes the local files and
/// the shard's copies older than the newest [`KEPT`], and returns the manifest's URI.
pub async fn upload(io: &FileIO, shard_dir: &str, mut copy: LocalCopy) -> Result<(String, u64)> {
    let m = &copy.manifest;
    // Zero-padded, so names sort by age.
    let dir = format!("{shard_dir}/{:012}-{:012}", m.epoch, m.sequence_number);
    let local = copy.dir.clone();
    let mut bytes = 0;
    let mut names: Vec<PathBuf> = std::fs::read_dir(&local)
        .or_kind(ErrorKind::Storage, || {
            format!("cannot list the index copy {}", local.display())
        })?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .or_kind(ErrorKind::Storage, || {
            format!("cannot list the index copy {}", local.display())
        })?;
    names.sort();
    for path in names {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let data = tokio::fs::read(&path)
            .await
            .or_kind(ErrorKind::Storage, || {
                format!("cannot read {}", path.display())
            })?;
        let size = data.len() as u64;
        io.put(&format!("{dir}/{name}"), Bytes::from(data)).await?;
        bytes += size;
        copy.manifest.files.push(CopyFile { name, size });
    }
    let manifest = serde_json::to_vec_pretty(&copy.manifest).map_err(|e| {
        Error::new(ErrorKind::Internal, "cannot encode an index copy manifest").with_source(e)
    })?;
    let uri = format!("{dir}/{MANIFEST}");
    io.put(&uri, Bytes::from(manifest)).await?;
    let _ = std::fs::remove_dir_all(&local);
    remove_old(io, shard_dir).await?;
    Ok((uri, bytes))
}

/// Removes all but the newest [`KEPT`] complete copies of a shard, and incomplete ones older
/// than them.
async fn remove_old(io: &FileIO, shard_dir: &str) -> Result<()> {
    let listed = io.list(shard_dir).await?;
    let mut copies: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for f in listed {
        if let Some(rest) = f.uri.strip_prefix(&format!("{shard_dir}/")) {
            if let Some((copy, _)) = rest.split_once('/') {
                copies.entry(copy.to_string()).or_default().push(f.uri);
            }
        }
    }
    let complete: Vec<&String> = copies
        .iter()
        .filter(|(_, files)| files.iter().any(|f| f.ends_with(MANIFEST)))
        .map(|(name, _)| name)
        .collect();
    let Some(oldest_kept) = complete.iter().rev().nth(KEPT - 1).map(|n| (*n).clone()) else {
        return Ok(());
    };
    for (name, files) in &copies {
        if *name < oldest_kept {
            // The manifest first: a copy is never seen half removed.
            let mut files = files.clone();
            files.sort_by_key(|f| !f.ends_with(MANIFEST));
            for f in files {
                io.delete(&f).await?;
            }
        }
    }
    Ok(())
}

/// Downloads the copy whose manifest is `uri` into `db`, a directory that must not exist yet
/// (files land in a sibling directory first and are renamed into place whole). Returns the
/// marker the copy holds.
pub async fn download(io: &FileIO, uri: &str, db: &Path) -> Result<(CopyManifest, Marker)> {
    let manifest: CopyManifest = serde_json::from_slice(&io.get(uri).await?).map_err(|e| {
        Error::metadata(format!("unreadable index copy manifest {uri}")).with_source(e)
    })?;
    let dir = uri.rsplit_once('/').map_or(uri, |(d, _)| d);
    let staging = db.with_extension("download");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).or_kind(ErrorKind::Storage, || {
        format!("cannot create {}", staging.display())
    })?;
    for f in &manifest.files {
        let data = io.get(&format!("{dir}/{}", f.name)).await?;
        if data.len() as u64 != f.size {
            return Err(Error::metadata(format!(
                "index copy file {dir}/{} has {} bytes, its manifest says {}",
                f.name,
                data.len(),
                f.size
            )));
        }
        let path = staging.join(&f.name);
        tokio::fs::write(&path, &data)
            .await
            .or_kind(ErrorKind::Storage, || {
                format!("cannot write {}", path.display())
            })?;
    }
    std::fs::rename(&staging, db).or_kind(ErrorKind::Storage, || {
        format!("cannot move {} to {}", staging.display(), db.display())
    })?;
    let marker = Marker {
        snapshot_id: manifest.snapshot_id,
        sequence_number: manifest.sequence_number,
    };
    Ok((manifest, marker))
}

/// A shard whose index is copied: (table, topic, partition).
pub type ShardKey = (String, String, i32);

/// Schedules a pipeline's index copies: each owned shard every `interval`, one upload per
/// shard at a time, in tasks of their own so consumption goes on meanwhile.
pub struct Copier {
    interval: Option<std::time::Duration>,
    last: BTreeMap<ShardKey, std::time::Instant>,
    running: BTreeMap<ShardKey, tokio::task::JoinHandle<Result<(String, u64)>>>,
    /// Uploaded copies not yet recorded in a snapshot, by table.
    ready: BTreeMap<String, CopyPointers>,
}

impl Copier {
    /// Copies every `interval_ms`; 0 never copies.
    pub fn new(interval_ms: u64) -> Copier {
        Copier {
            interval: (interval_ms > 0).then(|| std::time::Duration::from_millis(interval_ms)),
            last: BTreeMap::new(),
            running: BTreeMap::new(),
            ready: BTreeMap::new(),
        }
    }

    /// Whether `key` is due for a copy: never copied by this member, or not for `interval`,
    /// and no upload of it running.
    pub fn due(&self, key: &ShardKey) -> bool {
        self.interval.is_some_and(|every| {
            !self.running.contains_key(key)
                && self.last.get(key).is_none_or(|at| at.elapsed() >= every)
        })
    }

    /// Copies `index` (blocking, cheap: hard links) and uploads the copy in a task.
    pub fn start(
        &mut self,
        key: ShardKey,
        index: &dyn inlet_index::KeyIndex,
        local: PathBuf,
        io: FileIO,
        remote: String,
        manifest: CopyManifest,
    ) -> Result<()> {
        let _ = std::fs::remove_dir_all(&local);
        index.copy_to(&local)?;
        self.last.insert(key.clone(), std::time::Instant::now());
        let copy = LocalCopy {
            dir: local,
            manifest,
        };
        let task = tokio::spawn(async move { upload(&io, &remote, copy).await });
        self.running.insert(key, task);
        Ok(())
    }

    /// Moves finished uploads to the copies the next commit records; failures are logged and
    /// counted, and the shard is copied again at its next interval.
    pub async fn collect(&mut self) {
        let done: Vec<ShardKey> = self
            .running
            .iter()
            .filter(|(_, t)| t.is_finished())
            .map(|(k, _)| k.clone())
            .collect();
        let m = crate::metrics::metrics();
        for key in done {
            let Some(task) = self.running.remove(&key) else {
                continue;
            };
            let (table, topic, partition) = key;
            match task.await {
                Ok(Ok((uri, bytes))) => {
                    m.index_copies.with_label_values(&["uploaded"]).inc();
                    m.index_copy_bytes.inc_by(bytes);
                    tracing::info!(table, topic, partition, bytes, copy = %uri, "Index copy uploaded");
                    self.ready
                        .entry(table)
                        .or_default()
                        .entry(topic)
                        .or_default()
                        .insert(partition, uri);
                }
                Ok(Err(e)) => {
                    m.index_copies.with_label_values(&["failed"]).inc();
                    tracing::warn!(table, topic, partition, error = %e, "Cannot upload an index copy; trying again later");
                }
                Err(e) => {
                    m.index_copies.with_label_values(&["failed"]).inc();
                    tracing::warn!(table, topic, partition, error = %e, "Index copy task failed");
                }
            }
        }
    }

    /// The copies `table`'s next commit records; forgotten once taken.
    pub fn take_ready(&mut self, table: &str) -> CopyPointers {
        self.ready.remove(table).unwrap_or_default()
    }

    /// Forgets partitions no longer owned: a copy of one must not overwrite what its new
    /// owner records.
    pub fn forget(&mut self, partitions: &[(String, i32)]) {
        for (topic, p) in partitions {
            self.last.retain(|(_, t, q), _| !(t == topic && q == p));
            for (key, task) in &self.running {
                if &key.1 == topic && key.2 == *p {
                    task.abort();
                }
            }
            self.running.retain(|(_, t, q), _| !(t == topic && q == p));
            for pointers in self.ready.values_mut() {
                if let Some(m) = pointers.get_mut(topic) {
                    m.remove(p);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inlet_index::{IndexBatch, IndexEntry, KeyIndex, RocksIndex};

    #[tokio::test]
    async fn a_copy_round_trips_and_only_the_newest_two_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let index = RocksIndex::open(&dir.path().join("db"), None).unwrap();
        let mut batch = IndexBatch::default();
        batch.entries.push((
            b"k1".to_vec(),
            IndexEntry {
                version: vec![1],
                location: None,
                row: None,
                written_at_secs: 0,
            },
        ));
        batch.marker = Some(Marker {
            snapshot_id: 7,
            sequence_number: 3,
        });
        index.apply(batch).unwrap();
        let io = FileIO::default();
        let remote = format!(
            "file://{}/lake/t/inlet-index/p/topic-0",
            dir.path().display()
        );
        let mut uris = Vec::new();
        for epoch in 1..=3 {
            let local = dir.path().join(format!("copy-{epoch}"));
            index.copy_to(&local).unwrap();
            let copy = LocalCopy {
                dir: local.clone(),
                manifest: CopyManifest {
                    pipeline: "p".into(),
                    topic: "topic".into(),
                    partition: 0,
                    epoch,
                    snapshot_id: 7,
                    sequence_number: 3,
                    files: vec![],
                },
            };
            let (uri, bytes) = upload(&io, &remote, copy).await.unwrap();
            assert!(bytes > 0);
            assert!(!local.exists(), "the local copy is removed after upload");
            uris.push(uri);
        }
        let listed = io.list(&remote).await.unwrap();
        assert!(!listed.iter().any(|f| f.uri.contains("/000000000001-")));
        assert!(listed.iter().any(|f| f.uri == uris[1]));
        let db = dir.path().join("restored").join("db");
        std::fs::create_dir_all(db.parent().unwrap()).unwrap();
        let (manifest, marker) = download(&io, &uris[2], &db).await.unwrap();
        assert_eq!(manifest.epoch, 3);
        let restored = RocksIndex::open(&db, None).unwrap();
        assert_eq!(restored.marker().unwrap(), Some(marker));
        assert!(restored.get(b"k1").unwrap().is_some());
    }
}
