//! External sort of the entries a rebuild gathers: entries collect in a run of bounded size; a
//! full run is sorted, reduced to one entry per key and spilled to a file; at the end the runs
//! are merged with a heap into one ascending stream for the bulk load. A rebuild whose entries
//! fit in one run never touches the disk.
//!
//! Each key's entries reduce by [`resolve`], which is commutative and associative, so neither
//! the order within a run nor the order of runs changes the result.
//!
//! A run file is a sequence of records: key length `u32`, key, entry length `u32`, entry as
//! [`encode_entry`] writes it. Integers are big-endian.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, ErrorKind as IoErrorKind, Read, Write};
use std::path::{Path, PathBuf};

use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_index::{decode_entry, encode_entry, IndexEntry, RowLocation};

/// Default memory budget of the run being gathered.
pub const DEFAULT_RUN_BYTES: usize = 64 << 20;

/// Most runs merged at once; more are first merged in groups of this many, so open files and
/// read buffers stay bounded however large the shard.
const MAX_FAN_IN: usize = 64;

/// Read and write buffer per run file.
const RUN_BUFFER_BYTES: usize = 64 << 10;

/// Memory an entry takes beyond its byte fields: the tuple itself and allocator headers.
const ENTRY_OVERHEAD_BYTES: usize = std::mem::size_of::<(Vec<u8>, IndexEntry)>() + 48;

/// The one entry a key keeps of two.
///
/// A live row beats a tombstone whatever their versions (the row is in the table); of two live
/// rows the newer version wins, and of equal versions the earlier row (lower file id, then
/// position), as the rebuild reads files in id order. Of two tombstones the newer version wins.
pub fn resolve(a: IndexEntry, b: IndexEntry) -> IndexEntry {
    match (&a.location, &b.location) {
        (Some(la), Some(lb)) => {
            let a_wins = match a.version.cmp(&b.version) {
                Ordering::Greater => true,
                Ordering::Less => false,
                Ordering::Equal => (la.file_id, la.position) <= (lb.file_id, lb.position),
            };
            if a_wins {
                a
            } else {
                b
            }
        }
        (Some(_), None) => a,
        (None, Some(_)) => b,
        (None, None) => {
            if a.version >= b.version {
                a
            } else {
                b
            }
        }
    }
}

/// [`resolve`], noting the losing row when both entries are live.
fn resolve_noting(a: IndexEntry, b: IndexEntry, losers: &mut Vec<RowLocation>) -> IndexEntry {
    let both = match (a.location, b.location) {
        (Some(la), Some(lb)) => Some((la, lb)),
        _ => None,
    };
    let kept = resolve(a, b);
    if let (Some((la, lb)), Some(k)) = (both, kept.location) {
        losers.push(if k == la { lb } else { la });
    }
    kept
}

/// Gathers entries in bounded runs; see the [module docs](self).
pub struct Sorter {
    spill: SpillDir,
    run_bytes: usize,
    run: Vec<(Vec<u8>, IndexEntry)>,
    gathered_bytes: usize,
    runs: Vec<PathBuf>,
    /// The losing rows of keys found live in two rows.
    pub duplicates: Vec<RowLocation>,
}

impl Sorter {
    /// A sorter whose runs hold about `run_bytes` and spill below `dir`, which it owns: any old
    /// content is removed now, and the directory is removed when the sorter or its merge is
    /// dropped, on success and on error alike.
    pub fn new(dir: PathBuf, run_bytes: usize) -> Result<Sorter> {
        let spill = SpillDir { dir };
        spill.remove()?;
        Ok(Sorter {
            spill,
            run_bytes,
            run: Vec::new(),
            gathered_bytes: 0,
            runs: Vec::new(),
            duplicates: Vec::new(),
        })
    }

    /// Adds an entry of `key`; the sorter spills a run when the budget is full.
    pub fn push(&mut self, key: Vec<u8>, entry: IndexEntry) -> Result<()> {
        self.gathered_bytes += ENTRY_OVERHEAD_BYTES
            + key.len()
            + entry.version.len()
            + entry.row.as_ref().map_or(0, Vec::len);
        self.run.push((key, entry));
        if self.gathered_bytes >= self.run_bytes {
            self.spill()?;
        }
        Ok(())
    }

    /// How many runs went to disk so far.
    pub fn spilled_runs(&self) -> usize {
        self.runs.len()
    }

    /// Sorts and reduces the gathered run in place.
    fn reduce_run(&mut self) {
        self.run.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let duplicates = &mut self.duplicates;
        self.run.dedup_by(|(key, entry), (kept_key, kept)| {
            if key != kept_key {
                return false;
            }
            let old = std::mem::replace(kept, placeholder());
            *kept = resolve_noting(old, std::mem::replace(entry, placeholder()), duplicates);
            true
        });
    }

    fn spill(&mut self) -> Result<()> {
        self.reduce_run();
        let path = self
            .spill
            .create()?
            .join(format!("{:06}.run", self.runs.len()));
        let mut w = RunWriter::create(&path)?;
        for (key, entry) in self.run.drain(..) {
            w.write(&key, &entry)?;
        }
        w.finish()?;
        self.runs.push(path);
        self.gathered_bytes = 0;
        Ok(())
    }

    /// Merges everything gathered into one ascending stream with one entry per key.
    pub fn finish(mut self) -> Result<Merge> {
        if self.runs.is_empty() {
            self.reduce_run();
            let run = std::mem::take(&mut self.run);
            return Merge::new(vec![Source::Memory(run.into_iter())], self);
        }
        if !self.run.is_empty() {
            self.spill()?;
        }
        self.run = Vec::new();
        let mut pass = 0;
        while self.runs.len() > MAX_FAN_IN {
            pass += 1;
            let runs = std::mem::take(&mut self.runs);
            for (n, group) in runs.chunks(MAX_FAN_IN).enumerate() {
                let path = self.spill.dir.join(format!("p{pass}-{n:06}.run"));
                let sources = group.iter().map(|p| RunReader::open(p).map(Source::File));
                let mut merge = Merge::from_sources(sources.collect::<Result<_>>()?)?;
                let mut w = RunWriter::create(&path)?;
                for item in &mut merge {
                    let (key, entry) = item?;
                    w.write(&key, &entry)?;
                }
                w.finish()?;
                self.duplicates.append(&mut merge.duplicates);
                for p in group {
                    std::fs::remove_file(p)
                        .or_kind(ErrorKind::Storage, || format!("removing {}", p.display()))?;
                }
                self.runs.push(path);
            }
        }
        let sources = self
            .runs
            .iter()
            .map(|p| RunReader::open(p).map(Source::File))
            .collect::<Result<_>>()?;
        Merge::new(sources, self)
    }
}

/// A tombstone with nothing in it, to move an entry out of a slot briefly.
fn placeholder() -> IndexEntry {
    IndexEntry {
        version: Vec::new(),
        location: None,
        row: None,
        written_at_secs: 0,
    }
}

/// The spill directory; removed with everything in it when dropped.
struct SpillDir {
    dir: PathBuf,
}

impl SpillDir {
    fn create(&self) -> Result<&Path> {
        std::fs::create_dir_all(&self.dir).or_kind(ErrorKind::Storage, || {
            format!("creating {}", self.dir.display())
        })?;
        Ok(&self.dir)
    }

    fn remove(&self) -> Result<()> {
        match std::fs::remove_dir_all(&self.dir) {
            Err(e) if e.kind() == IoErrorKind::NotFound => Ok(()),
            other => other.or_kind(ErrorKind::Storage, || {
                format!("removing {}", self.dir.display())
            }),
        }
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            tracing::warn!(error = %e, "Cannot remove the spill files of an index rebuild");
        }
    }
}

struct RunWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl RunWriter {
    fn create(path: &Path) -> Result<RunWriter> {
        let file = File::create(path).or_kind(ErrorKind::Storage, || {
            format!("creating {}", path.display())
        })?;
        Ok(RunWriter {
            out: BufWriter::with_capacity(RUN_BUFFER_BYTES, file),
            path: path.to_path_buf(),
        })
    }

    fn write(&mut self, key: &[u8], entry: &IndexEntry) -> Result<()> {
        let value = encode_entry(entry);
        let mut put = |bytes: &[u8]| -> std::io::Result<()> {
            let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
            self.out.write_all(&len.to_be_bytes())?;
            self.out.write_all(bytes)
        };
        put(key)
            .and_then(|()| put(&value))
            .or_kind(ErrorKind::Storage, || {
                format!("writing {}", self.path.display())
            })
    }

    /// Flushes the run. Not synced: a run outlives no crash, the rebuild starts over.
    fn finish(self) -> Result<()> {
        let path = self.path;
        self.out
            .into_inner()
            .map(drop)
            .map_err(|e| e.into_error())
            .or_kind(ErrorKind::Storage, || format!("writing {}", path.display()))
    }
}

struct RunReader {
    input: BufReader<File>,
    path: PathBuf,
}

impl RunReader {
    fn open(path: &Path) -> Result<RunReader> {
        let file = File::open(path)
            .or_kind(ErrorKind::Storage, || format!("opening {}", path.display()))?;
        Ok(RunReader {
            input: BufReader::with_capacity(RUN_BUFFER_BYTES, file),
            path: path.to_path_buf(),
        })
    }

    /// The next record, or `None` at a clean end of file.
    fn next_record(&mut self) -> Result<Option<(Vec<u8>, IndexEntry)>> {
        let failed = |e| {
            Error::new(
                ErrorKind::Storage,
                format!("reading {}", self.path.display()),
            )
            .with_source(e)
        };
        // Only an end between records is clean; a record cut anywhere is an error.
        if self.input.fill_buf().map_err(failed)?.is_empty() {
            return Ok(None);
        }
        let mut len = [0u8; 4];
        self.input.read_exact(&mut len).map_err(failed)?;
        let mut key = vec![0; u32::from_be_bytes(len) as usize];
        self.input.read_exact(&mut key).map_err(failed)?;
        self.input.read_exact(&mut len).map_err(failed)?;
        let mut value = vec![0; u32::from_be_bytes(len) as usize];
        self.input.read_exact(&mut value).map_err(failed)?;
        Ok(Some((key, decode_entry(&value)?)))
    }
}

enum Source {
    Memory(std::vec::IntoIter<(Vec<u8>, IndexEntry)>),
    File(RunReader),
}

impl Source {
    fn next_record(&mut self) -> Result<Option<(Vec<u8>, IndexEntry)>> {
        match self {
            Source::Memory(it) => Ok(it.next()),
            Source::File(r) => r.next_record(),
        }
    }
}

/// The head of one source in the heap, ordered by key, then source.
struct Head {
    key: Vec<u8>,
    source: usize,
    entry: IndexEntry,
}

impl PartialEq for Head {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Head {}

impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Head {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key
            .cmp(&other.key)
            .then(self.source.cmp(&other.source))
    }
}

/// The k-way merge of sorted, reduced runs: ascending keys, one resolved entry each.
///
/// Yields an error at most once and nothing after it.
pub struct Merge {
    sources: Vec<Source>,
    heap: BinaryHeap<Reverse<Head>>,
    failed: bool,
    /// The losing rows of keys found live in two rows, in the runs and while merging.
    pub duplicates: Vec<RowLocation>,
    /// Keeps the spill files until the merge is dropped.
    _spill: Option<SpillDir>,
}

impl Merge {
    fn new(sources: Vec<Source>, mut sorter: Sorter) -> Result<Merge> {
        let mut merge = Merge::from_sources(sources)?;
        merge.duplicates = std::mem::take(&mut sorter.duplicates);
        merge._spill = Some(sorter.spill);
        Ok(merge)
    }

    fn from_sources(mut sources: Vec<Source>) -> Result<Merge> {
        let mut heap = BinaryHeap::with_capacity(sources.len());
        for (source, s) in sources.iter_mut().enumerate() {
            if let Some((key, entry)) = s.next_record()? {
                heap.push(Reverse(Head { key, source, entry }));
            }
        }
        Ok(Merge {
            sources,
            heap,
            failed: false,
            duplicates: Vec::new(),
            _spill: None,
        })
    }

    /// Replaces the popped head of `source` with its next record.
    fn refill(&mut self, source: usize) -> Result<()> {
        if let Some((key, entry)) = self.sources[source].next_record()? {
            self.heap.push(Reverse(Head { key, source, entry }));
        }
        Ok(())
    }

    fn next_key(&mut self) -> Result<Option<(Vec<u8>, IndexEntry)>> {
        let Some(Reverse(first)) = self.heap.pop() else {
            return Ok(None);
        };
        self.refill(first.source)?;
        let (key, mut entry) = (first.key, first.entry);
        while self.heap.peek().is_some_and(|Reverse(h)| h.key == key) {
            let Some(Reverse(next)) = self.heap.pop() else {
                break;
            };
            self.refill(next.source)?;
            entry = resolve_noting(entry, next.entry, &mut self.duplicates);
        }
        Ok(Some((key, entry)))
    }
}

impl Iterator for Merge {
    type Item = Result<(Vec<u8>, IndexEntry)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.next_key() {
            Ok(next) => next.map(Ok),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use inlet_index::RowLocation;

    fn live(version: u8, file_id: u64, position: u64) -> IndexEntry {
        IndexEntry {
            version: vec![version],
            location: Some(RowLocation {
                partition_id: (file_id % 3) as u32,
                bucket: 0,
                file_id,
                position,
            }),
            row: Some(vec![version; 3]),
            written_at_secs: 7,
        }
    }

    fn dead(version: u8) -> IndexEntry {
        IndexEntry {
            version: vec![version],
            location: None,
            row: None,
            written_at_secs: 7,
        }
    }

    /// What the rebuild did before runs existed: everything in maps, live rows first.
    fn in_memory(entries: &[(Vec<u8>, IndexEntry)]) -> BTreeMap<Vec<u8>, IndexEntry> {
        let mut keys: BTreeMap<Vec<u8>, IndexEntry> = BTreeMap::new();
        let mut dead: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for (key, e) in entries {
            if e.location.is_none() {
                let newest = dead.entry(key.clone()).or_default();
                if e.version > *newest {
                    *newest = e.version.clone();
                }
                continue;
            }
            if keys.get(key).is_some_and(|old| old.version >= e.version) {
                continue;
            }
            keys.insert(key.clone(), e.clone());
        }
        for (key, version) in dead {
            keys.entry(key).or_insert(IndexEntry {
                version,
                location: None,
                row: None,
                written_at_secs: 7,
            });
        }
        keys
    }

    fn sort_externally(
        entries: &[(Vec<u8>, IndexEntry)],
        dir: &Path,
        run_bytes: usize,
    ) -> (Vec<(Vec<u8>, IndexEntry)>, usize) {
        let mut sorter = Sorter::new(dir.join("runs"), run_bytes).unwrap();
        for (k, e) in entries {
            sorter.push(k.clone(), e.clone()).unwrap();
        }
        let spilled = sorter.spilled_runs();
        let merged: Vec<_> = sorter.finish().unwrap().collect::<Result<_>>().unwrap();
        assert!(!dir.join("runs").exists(), "spill files left behind");
        (merged, spilled)
    }

    /// Entries in file order (file ids and positions ascend), keys drawn from a small set so
    /// they repeat across runs, a third of them tombstones.
    fn stream() -> impl Strategy<Value = Vec<(Vec<u8>, IndexEntry)>> {
        prop::collection::vec((0u8..40, any::<u8>(), 0u8..3), 0..600).prop_map(|rows| {
            rows.into_iter()
                .enumerate()
                .map(|(n, (key, version, kind))| {
                    let entry = if kind == 0 {
                        dead(version)
                    } else {
                        live(version, n as u64 / 16 + 1, n as u64 % 16)
                    };
                    (vec![b'k', key], entry)
                })
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn tiny_runs_merge_to_the_in_memory_result(entries in stream()) {
            let dir = tempfile::tempdir().unwrap();
            let expected: Vec<_> = in_memory(&entries).into_iter().collect();
            // About four entries per run: many runs, more than one merge pass for long streams.
            let (merged, spilled) = sort_externally(&entries, dir.path(), 4 * ENTRY_OVERHEAD_BYTES);
            prop_assert_eq!(&merged, &expected);
            prop_assert!(entries.len() < 4 || spilled > 0);
            let (merged, spilled) = sort_externally(&entries, dir.path(), DEFAULT_RUN_BYTES);
            prop_assert_eq!(spilled, 0);
            prop_assert_eq!(merged, expected);
        }
    }

    #[test]
    fn duplicates_across_runs_resolve_like_the_in_memory_rebuild() {
        let dir = tempfile::tempdir().unwrap();
        let entries = vec![
            (b"a".to_vec(), live(5, 1, 0)),
            (b"b".to_vec(), dead(9)),
            (b"c".to_vec(), dead(2)),
            // The same key live twice: the newer version wins, not the later file.
            (b"a".to_vec(), live(3, 2, 0)),
            // A live row beats a newer tombstone.
            (b"b".to_vec(), live(4, 2, 1)),
            (b"c".to_vec(), dead(6)),
            // Equal versions: the earlier row stays.
            (b"d".to_vec(), live(1, 2, 2)),
            (b"d".to_vec(), live(1, 3, 0)),
        ];
        let mut sorter = Sorter::new(dir.path().join("runs"), 1).unwrap();
        for (k, e) in &entries {
            sorter.push(k.clone(), e.clone()).unwrap();
        }
        assert_eq!(sorter.spilled_runs(), entries.len());
        assert!(dir.path().join("runs").exists());
        let mut merge = sorter.finish().unwrap();
        let merged: Vec<_> = (&mut merge).collect::<Result<_>>().unwrap();
        assert_eq!(merge.duplicates.len(), 2);
        drop(merge);
        assert!(!dir.path().join("runs").exists());
        assert_eq!(
            merged,
            vec![
                (b"a".to_vec(), live(5, 1, 0)),
                (b"b".to_vec(), live(4, 2, 1)),
                (b"c".to_vec(), dead(6)),
                (b"d".to_vec(), live(1, 2, 2)),
            ]
        );
        assert_eq!(merged, in_memory(&entries).into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn more_runs_than_the_fan_in_merge_in_passes() {
        let dir = tempfile::tempdir().unwrap();
        let n = MAX_FAN_IN as u64 * 3 + 5;
        let entries: Vec<_> = (0..n)
            .map(|i| {
                let key = (i % 50).to_be_bytes().to_vec();
                (key, live((i % 251) as u8, i + 1, 0))
            })
            .collect();
        let (merged, spilled) = sort_externally(&entries, dir.path(), 1);
        assert_eq!(spilled as u64, n);
        assert_eq!(merged, in_memory(&entries).into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn damaged_runs_fail_once_and_leave_no_spill_files() {
        let dir = tempfile::tempdir().unwrap();
        let runs = dir.path().join("runs");
        // Two entries per run.
        let run_bytes = 2 * (ENTRY_OVERHEAD_BYTES + 5);
        let gather = || {
            let mut sorter = Sorter::new(runs.clone(), run_bytes).unwrap();
            for i in 0u8..4 {
                sorter.push(vec![i], live(1, 1, i.into())).unwrap();
            }
            assert_eq!(sorter.spilled_runs(), 2);
            sorter
        };
        let cut = |path: PathBuf, keep: usize| {
            let bytes = std::fs::read(&path).unwrap();
            std::fs::write(&path, &bytes[..keep.min(bytes.len() - 3)]).unwrap();
        };

        // Cut inside the second record: the merge fails when it reaches it, once.
        let sorter = gather();
        cut(runs.join("000000.run"), usize::MAX);
        let mut merge = sorter.finish().unwrap();
        let oks: Vec<bool> = (&mut merge).map(|item| item.is_ok()).collect();
        assert_eq!(oks.iter().filter(|ok| !**ok).count(), 1, "{oks:?}");
        assert_eq!(oks.last(), Some(&false));
        drop(merge);
        assert!(!runs.exists());

        // Cut inside the first length: opening the merge fails.
        let sorter = gather();
        cut(runs.join("000001.run"), 2);
        let err = sorter.finish().err().unwrap();
        assert_eq!(err.kind(), ErrorKind::Storage);
        assert!(!runs.exists());
    }
}
