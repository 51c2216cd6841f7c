//! The index batch saved beside the index before its commit (and the rows to repair), so a crash between commit and apply is repaired exactly.

use std::path::{Path, PathBuf};

use inlet_common::error::{Error, ErrorKind, Result};
use inlet_iceberg::types::ByteReader;
use inlet_index::{decode_entry, IndexBatch, KeyIndex, Marker};

pub(super) fn pending_file(dir: &Path) -> PathBuf {
    dir.join("pending.batch")
}

pub(super) fn repairs_file(dir: &Path) -> PathBuf {
    dir.join("repairs")
}

pub(super) fn remove_if_present(path: &Path, what: &str) -> Result<()> {
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
pub(super) fn save_batch(
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

pub(super) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
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
pub(super) const SAVED_BATCH_FORMAT: u8 = 2;

/// Encodes a saved batch ([`SavedBatch`]'s fields) for its file, in one allocation.
pub(super) fn encode_batch(
    writer: &str,
    checkpoint: u64,
    base: Option<Marker>,
    batch: &IndexBatch,
) -> Vec<u8> {
    let entries: usize = batch
        .entries
        .iter()
        .map(|(k, e)| 8 + k.len() + inlet_index::encoded_entry_len(e))
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
        let len = inlet_index::encoded_entry_len(e);
        out.extend_from_slice(&(len as u32).to_be_bytes());
        inlet_index::encode_entry_into(e, &mut out);
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

pub(super) fn decode_batch(bytes: &[u8]) -> Option<SavedBatch> {
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
