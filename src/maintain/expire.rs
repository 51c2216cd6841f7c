//! Snapshot expiry. What recovery and readers need is never dropped: the head, every branch
//! and tag (inlet's `inlet-<pipeline>` tag carries the pipeline's offsets even when another
//! engine's commits follow), every snapshot younger than the window, and the newest few of the
//! head's history. The shorter metadata is committed first; only then are the files that no
//! kept snapshot reaches deleted, so a crash in between leaves orphans, never a broken table.

use std::collections::HashSet;

use inlet_common::error::{Error, ErrorKind, Result};
use inlet_iceberg::metadata::{Snapshot, TableMetadata};
use inlet_iceberg::Table;

use super::reach::{key, reach};

/// What expiry keeps.
#[derive(Debug, Clone, Copy)]
pub struct ExpiryPolicy {
    /// Snapshots at least this young (ms) are kept.
    pub window_ms: i64,
    /// The newest this many snapshots of the head's history are kept, however old.
    pub min_snapshots: usize,
    /// Most snapshots removed by one run.
    pub batch: usize,
}

/// What a run expired.
#[derive(Debug, Default, Clone)]
pub struct Expired {
    /// Snapshots removed from the metadata (or that would be, in a dry run).
    pub snapshots: Vec<i64>,
    /// Files deleted (or that would be).
    pub files: Vec<String>,
    /// Their bytes, where the metadata records sizes.
    pub bytes: u64,
}

/// The snapshots `meta` may drop at `now_ms`, oldest first, at most one batch.
pub fn expirable(meta: &TableMetadata, policy: &ExpiryPolicy, now_ms: i64) -> Vec<i64> {
    let mut keep: HashSet<i64> = meta.refs.values().map(|r| r.snapshot_id).collect();
    keep.extend(meta.current_snapshot_id);
    keep.extend(
        meta.lineage()
            .take(policy.min_snapshots)
            .map(|s| s.snapshot_id),
    );
    let oldest_kept = now_ms.saturating_sub(policy.window_ms);
    let mut old: Vec<&Snapshot> = meta
        .snapshots
        .iter()
        .filter(|s| s.timestamp_ms < oldest_kept && !keep.contains(&s.snapshot_id))
        .collect();
    old.sort_by_key(|s| (s.timestamp_ms, s.sequence_number));
    old.into_iter()
        .take(policy.batch)
        .map(|s| s.snapshot_id)
        .collect()
}

/// `meta` without the snapshots `ids` (and their snapshot-log entries).
fn without(meta: &TableMetadata, ids: &HashSet<i64>, now_ms: i64) -> TableMetadata {
    let mut next = meta.clone();
    next.snapshots.retain(|s| !ids.contains(&s.snapshot_id));
    next.snapshot_log.retain(|e| !ids.contains(&e.snapshot_id));
    next.last_updated_ms = now_ms.max(meta.last_updated_ms + 1);
    next
}

/// Expires one batch of `table`'s snapshots at `now_ms`: commits the shorter metadata (rebasing
/// on concurrent commits), then deletes the files only expired snapshots reached. A dry run
/// commits and deletes nothing and reports what a run would do.
pub async fn expire_snapshots(
    table: &mut Table,
    policy: &ExpiryPolicy,
    now_ms: i64,
    dry_run: bool,
) -> Result<Expired> {
    const ATTEMPTS: u32 = 10;
    let mut attempt = 0;
    let (expired, kept) = loop {
        attempt += 1;
        let ids = expirable(&table.metadata, policy, now_ms);
        if ids.is_empty() {
            return Ok(Expired::default());
        }
        let ids: HashSet<i64> = ids.into_iter().collect();
        let expired: Vec<Snapshot> = table
            .metadata
            .snapshots
            .iter()
            .filter(|s| ids.contains(&s.snapshot_id))
            .cloned()
            .collect();
        let next = without(&table.metadata, &ids, now_ms);
        if dry_run {
            break (expired, next);
        }
        inlet_common::failpoint::crash_point("expire_before_commit");
        if table.try_commit(next.clone()).await? {
            break (expired, next);
        }
        if attempt >= ATTEMPTS {
            return Err(Error::new(
                ErrorKind::CommitConflict,
                format!("snapshot expiry lost the catalog's compare-and-swap {ATTEMPTS} times"),
            ));
        }
        table.refresh().await?;
    };
    inlet_common::failpoint::crash_point("expire_after_commit");
    // Files are judged against the metadata just committed: later commits add new files and
    // keep what the head reaches, so nothing only expired snapshots reach can come back.
    let kept_refs: Vec<&Snapshot> = kept.snapshots.iter().collect();
    let keep = reach(table, &kept_refs, &HashSet::new(), true).await?;
    let expired_refs: Vec<&Snapshot> = expired.iter().collect();
    let gone = reach(table, &expired_refs, &keep.manifests, false).await?;
    let mut out = Expired {
        snapshots: expired.iter().map(|s| s.snapshot_id).collect(),
        ..Expired::default()
    };
    for (uri, size) in gone.uris {
        if keep.contains(&uri) {
            continue;
        }
        out.bytes += size.unwrap_or(0).max(0) as u64;
        out.files.push(uri);
    }
    // Data and delete files first, then manifests, then lists: a run cut short leaves the
    // outer files, so a later orphan cleanup still finds what they name.
    let rank = |u: &String| {
        let k = key(u);
        if gone.lists.contains(k) {
            2
        } else if gone.manifests.contains(k) {
            1
        } else {
            0
        }
    };
    out.files.sort_by_key(rank);
    if !dry_run {
        for f in &out.files {
            table.io.delete(f).await?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use inlet_iceberg::metadata::SnapshotRef;

    fn meta(times: &[i64]) -> TableMetadata {
        let def = inlet_iceberg::TableDefinition {
            columns: vec![("id".into(), inlet_iceberg::types::Type::Long, true, None)],
            identifier: vec![],
            partition: vec![],
            properties: Default::default(),
        };
        let mut m = def.new_metadata("file:///t").unwrap();
        let mut parent = None;
        for (i, t) in times.iter().enumerate() {
            let id = i as i64 + 1;
            m.snapshots.push(Snapshot {
                snapshot_id: id,
                parent_snapshot_id: parent,
                sequence_number: id,
                timestamp_ms: *t,
                manifest_list: format!("file:///t/metadata/snap-{id}.avro"),
                summary: Default::default(),
                schema_id: Some(0),
                extra: Default::default(),
            });
            parent = Some(id);
        }
        m.current_snapshot_id = parent;
        m
    }

    #[test]
    fn keeps_head_refs_window_and_minimum() {
        // Snapshots 1..=20 at t = 1000 × id.
        let times: Vec<i64> = (1..=20).map(|i| i * 1000).collect();
        let mut m = meta(&times);
        m.refs.insert(
            "inlet-p".into(),
            SnapshotRef {
                snapshot_id: 3,
                kind: "tag".into(),
                extra: Default::default(),
            },
        );
        let policy = ExpiryPolicy {
            window_ms: 5_500,
            min_snapshots: 2,
            batch: 100,
        };
        // At t = 20,000 the window keeps 15..=20; the tag keeps 3.
        let ids = expirable(&m, &policy, 20_000);
        let want: Vec<i64> = (1..=14).filter(|i| *i != 3).collect();
        assert_eq!(ids, want);
        // The minimum count reaches past the window.
        let policy = ExpiryPolicy {
            min_snapshots: 10,
            ..policy
        };
        assert_eq!(expirable(&m, &policy, 20_000).len(), 9);
        // Batches take the oldest first.
        let policy = ExpiryPolicy { batch: 4, ..policy };
        assert_eq!(expirable(&m, &policy, 20_000), vec![1, 2, 4, 5]);
        // However old, the head stays.
        let policy = ExpiryPolicy {
            window_ms: 0,
            min_snapshots: 1,
            batch: 100,
        };
        let ids = expirable(&m, &policy, i64::MAX);
        assert!(!ids.contains(&20) && !ids.contains(&3));
        assert_eq!(ids.len(), 18);
    }
}
