//! Orphan-file cleanup: files under the table's `data/` and `metadata/` that neither the
//! current metadata, its metadata log nor any of its snapshots reach, left by commits that
//! never landed (a crash between upload and commit, a lost compare-and-swap) or by an expiry
//! cut short. Only files older than a safety age are touched, so a commit still on its way is
//! never robbed of its files. Other directories under the table (index copies, markers) are
//! not looked at, nor are mark-done's `_SUCCESS` files (retention removes those of the
//! partitions it empties).

use std::collections::HashSet;

use inlet_common::error::Result;
use inlet_iceberg::metadata::Snapshot;
use inlet_iceberg::Table;

use super::reach::{key, reach};

/// A file no metadata reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Orphan {
    pub uri: String,
    pub size: u64,
    pub modified_ms: i64,
}

/// The directories of a table that hold only files its metadata names.
fn owned_dirs(table: &Table) -> [String; 2] {
    let location = table.metadata.location.trim_end_matches('/');
    [format!("{location}/data"), format!("{location}/metadata")]
}

/// The orphans of `table` at least `min_age_ms` old at `now_ms`, sorted by URI. A file whose
/// store reports no modification time is never an orphan.
pub async fn find_orphans(table: &mut Table, min_age_ms: i64, now_ms: i64) -> Result<Vec<Orphan>> {
    // Listed before the metadata is read: a file a commit landing meanwhile adds is then in
    // the metadata, and a file written after the listing is not judged at all.
    let mut listed = Vec::new();
    for dir in owned_dirs(table) {
        listed.extend(table.io.list(&dir).await?);
    }
    table.refresh().await?;
    let meta = &table.metadata;
    let snapshots: Vec<&Snapshot> = meta.snapshots.iter().collect();
    let reached = reach(table, &snapshots, &HashSet::new(), true).await?;
    let mut live: HashSet<&str> = meta
        .metadata_log
        .iter()
        .map(|e| key(&e.metadata_file))
        .collect();
    live.insert(key(&table.metadata_location));
    let cutoff = now_ms.saturating_sub(min_age_ms);
    // Mark-done's markers are named by no metadata, and are no orphans.
    let marker = format!("/{}", super::done::SUCCESS_FILE);
    Ok(listed
        .into_iter()
        .filter(|l| !live.contains(key(&l.uri)) && !reached.contains(&l.uri))
        .filter(|l| !l.uri.ends_with(&marker))
        .filter_map(|l| {
            let modified_ms = l.modified_ms.filter(|m| *m <= cutoff)?;
            Some(Orphan {
                uri: l.uri,
                size: l.size,
                modified_ms,
            })
        })
        .collect())
}

/// Finds `table`'s orphans and deletes them unless `dry_run`.
pub async fn remove_orphans(
    table: &mut Table,
    min_age_ms: i64,
    now_ms: i64,
    dry_run: bool,
) -> Result<Vec<Orphan>> {
    let orphans = find_orphans(table, min_age_ms, now_ms).await?;
    if !dry_run {
        for o in &orphans {
            table.io.delete(&o.uri).await?;
        }
    }
    Ok(orphans)
}
