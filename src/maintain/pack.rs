//! Bin-packing the small data files of changelog tables (`inlet maintain`, with
//! `services.compact`): a changelog table has no index to keep level, so its small files of one
//! partition directory are rewritten into files of up to `table.target_file_bytes` in one
//! `replace` snapshot that carries the pipeline's offsets, within a byte budget per run
//! (`services.compact_budget_bytes`; the rest waits for the next run). Files with deletes
//! (another engine's) and files of an older schema are left as they are. Its commit races the
//! pipeline's through the catalog's compare-and-swap; the pipeline only adds files, so the
//! rewrite rebases on them.

use std::collections::{BTreeMap, HashSet};

use bytes::Bytes;

use crate::commit::Committer;
use crate::write::parquet::{ParquetFile, WriteColumn};
use inlet_common::error::Result;
use inlet_iceberg::manifest::{DataFile, FileContent};
use inlet_iceberg::Table;

use super::compact::{commit_rewrite, Operation};

/// Crash points of a packing run, for the fault tests.
pub const STEPS: [&str; 2] = ["pack_after_upload", "pack_after_commit"];

/// What packing may do.
#[derive(Debug, Clone, Copy)]
pub struct PackPolicy {
    /// Data files below this size are small.
    pub small_file_bytes: i64,
    /// Size packed files aim at.
    pub target_file_bytes: i64,
    /// Most bytes one run reads.
    pub budget_bytes: i64,
}

/// What one packing run did.
#[derive(Debug, Default, Clone)]
pub struct Packed {
    pub snapshot_id: Option<i64>,
    /// Small files rewritten, and the files they became.
    pub files_in: usize,
    pub files_out: usize,
    pub bytes: i64,
    /// Small files left for the next run by the budget.
    pub backlog: usize,
}

fn dir_of(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(d, _)| d)
}

/// Groups of small files of one directory and partition, each to become one file.
fn plan(
    data: &[&DataFile],
    with_deletes: &HashSet<&str>,
    policy: &PackPolicy,
) -> Vec<Vec<DataFile>> {
    let mut small: BTreeMap<(&str, String), Vec<&DataFile>> = BTreeMap::new();
    for f in data {
        if f.file_size_in_bytes < policy.small_file_bytes
            && !with_deletes.contains(f.file_path.as_str())
        {
            small
                .entry((dir_of(&f.file_path), format!("{:?}", f.partition)))
                .or_default()
                .push(f);
        }
    }
    let mut groups = Vec::new();
    for files in small.into_values() {
        let mut group: Vec<DataFile> = Vec::new();
        let mut size = 0;
        for f in files {
            if size + f.file_size_in_bytes > policy.target_file_bytes && group.len() > 1 {
                groups.push(std::mem::take(&mut group));
                size = 0;
            }
            size += f.file_size_in_bytes;
            group.push(f.clone());
        }
        if group.len() > 1 {
            groups.push(group);
        }
    }
    groups
}

/// Packs the small files of `table` (a changelog table) within the policy's budget, committed
/// as a `replace` snapshot of `committer`'s writer. With `dry_run`, only reports what it would
/// pack.
pub async fn pack_files(
    table: &mut Table,
    committer: &Committer,
    policy: &PackPolicy,
    dry_run: bool,
) -> Result<Packed> {
    let entries = table.live_entries().await?;
    let mut with_deletes: HashSet<&str> = HashSet::new();
    let mut foreign_deletes = false;
    for e in entries
        .iter()
        .filter(|e| e.data_file.content != FileContent::Data)
    {
        match crate::write::deletes::target_of(&e.data_file) {
            Some(target) => {
                with_deletes.insert(target);
            }
            None => foreign_deletes = true,
        }
    }
    let mut done = Packed::default();
    // A delete file that may name any file: which files it touches is not known.
    if foreign_deletes {
        return Ok(done);
    }
    let data: Vec<&DataFile> = entries
        .iter()
        .map(|e| &e.data_file)
        .filter(|f| f.content == FileContent::Data)
        .collect();
    let schema = table.metadata.current_schema()?;
    let columns = WriteColumn::of_schema(schema)?;
    let wanted: Vec<(&str, inlet_iceberg::types::Type)> =
        columns.iter().map(|c| (c.name.as_str(), c.ty)).collect();
    let mut budget = policy.budget_bytes;
    let mut written: Vec<(DataFile, Vec<u8>)> = Vec::new();
    let mut removed: Vec<DataFile> = Vec::new();
    'groups: for group in plan(&data, &with_deletes, policy) {
        let bytes: i64 = group.iter().map(|f| f.file_size_in_bytes).sum();
        if budget <= 0 {
            done.backlog += group.len();
            continue;
        }
        budget -= bytes;
        if dry_run {
            done.files_in += group.len();
            done.files_out += 1;
            done.bytes += bytes;
            continue;
        }
        let mut out = ParquetFile::new(columns.clone().into())?;
        for f in &group {
            let content = table.io.get(&f.file_path).await?;
            // A file of an older schema is left as it is.
            let Ok(rows) =
                tokio::task::block_in_place(|| inlet_iceberg::scan::read_columns(content, &wanted))
            else {
                continue 'groups;
            };
            for mut row in rows {
                out.push(&mut row)?;
            }
        }
        let (content, metrics) = tokio::task::block_in_place(|| out.finish())?;
        let path = format!(
            "{}/{}-p.parquet",
            dir_of(&group[0].file_path),
            uuid::Uuid::new_v4().simple()
        );
        let len = content.len();
        let file = metrics.into_data_file(FileContent::Data, path, group[0].partition.clone(), len);
        done.files_in += group.len();
        done.files_out += 1;
        done.bytes += bytes;
        written.push((file, content));
        removed.extend(group);
    }
    if dry_run || written.is_empty() {
        return Ok(done);
    }
    table
        .io
        .put_many(
            written
                .iter()
                .map(|(f, b)| (f.file_path.clone(), Bytes::from(b.clone())))
                .collect(),
        )
        .await?;
    inlet_common::failpoint::crash_point("pack_after_upload");
    let added: Vec<DataFile> = written.into_iter().map(|(f, _)| f).collect();
    let landed = commit_rewrite(
        table,
        committer,
        &Operation {
            name: "replace",
            service: crate::metrics::service::PACK_FILES,
        },
        1,
        &[],
        &added,
        &[],
        &removed,
    )
    .await?;
    inlet_common::failpoint::crash_point("pack_after_commit");
    match landed {
        Some(snapshot) => done.snapshot_id = Some(snapshot.snapshot_id),
        // Not committed: its files are orphans for the cleanup.
        None => {
            return Ok(Packed {
                backlog: done.backlog + done.files_in,
                ..Packed::default()
            })
        }
    }
    let m = crate::metrics::metrics();
    m.maintain_files_packed.inc_by(done.files_in as u64);
    Ok(done)
}
