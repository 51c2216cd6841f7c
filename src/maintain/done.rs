//! Partition mark-done (Flink's partition commit). Every snapshot of the pipeline carries a
//! watermark per source partition (`inlet.watermarks`): the newest source time of the last
//! checkpoint that read from it, or, for an owned partition that is idle (it delivered nothing
//! for a checkpoint interval and has nothing left on the broker), the time of the last
//! checkpoint it was idle in. The table's watermark is the least of them over every source
//! partition the pipeline has offsets or an owner epoch for (a claimed one that has committed
//! nothing yet holds it at none), so a lagging or stalled one holds it back whichever
//! instance owns it. A partition is done once the table's watermark has passed the end of its
//! time range by `services.mark_done_idle_ms`.
//!
//! A done partition gets a `_SUCCESS` JSON file in its directory and, with
//! `services.mark_done_url`, an HTTP POST of the same JSON. How far partitions are done is then
//! committed to the table's properties (`inlet.done-through-ms`, and the sequence number the
//! run saw, `inlet.done-sequence-number`), so a restart, another instance or `inlet maintain`
//! continues from there and nothing is marked twice. A run that marks nothing and finds
//! nothing late commits nothing. A crash between the actions and that commit
//! repeats the actions of that run: `_SUCCESS` is rewritten alike, the report is sent again with
//! the same partition and path.
//!
//! A change arriving for a done partition is applied; its rows count as late
//! (`inlet_maintain_late_rows_total{state="done"}`). A partition that first appears after its
//! time was done (late rows under a new partition value) is marked at the next run.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;

use crate::commit::{table_offsets, table_watermarks, Offsets, Watermarks};
use inlet_common::error::{Error, ErrorKind, Result};
use inlet_iceberg::manifest::ManifestEntry;
use inlet_iceberg::metadata::TableMetadata;
use inlet_iceberg::Table;

use super::partitions::{partitions, Partition, TimeField};
use inlet_iceberg::keys::{DONE_SEQUENCE, DONE_THROUGH, SUMMARY_MAINTENANCE};

/// The marker file of a done partition.
pub const SUCCESS_FILE: &str = "_SUCCESS";

/// Crash points of a mark-done run, for the fault tests.
pub const STEPS: [&str; 1] = ["done_after_actions"];

/// How mark-done behaves.
#[derive(Debug, Clone)]
pub struct DonePolicy {
    /// How far past a partition's end the watermark must be.
    pub idle_ms: i64,
    /// Where to POST reports.
    pub url: Option<String>,
}

/// What one mark-done run did to one table.
#[derive(Debug, Default, Clone)]
pub struct MarkedDone {
    /// The table's watermark (ms), if every source partition has one.
    pub watermark_ms: Option<i64>,
    /// Partitions ending at or before this are done.
    pub through_ms: Option<i64>,
    /// Directories of the partitions marked by this run.
    pub partitions: Vec<String>,
    /// Rows added to done partitions since the last run.
    pub late_rows: i64,
}

/// The URI of a partition's `_SUCCESS` file; `path` is the partition's directory below
/// `data/`.
pub fn success_uri(table: &Table, path: &str) -> String {
    format!(
        "{}/data/{path}/{SUCCESS_FILE}",
        table.metadata.location.trim_end_matches('/')
    )
}

/// Notes a change of source partition `topic`/`partition` with source time `ms` among a
/// checkpoint's newest.
pub fn observe(newest: &mut Watermarks, topic: &str, partition: i32, ms: i64) {
    // Runs for every change: a topic already present costs no allocation.
    let parts = match newest.get_mut(topic) {
        Some(parts) => parts,
        None => newest.entry(topic.to_string()).or_default(),
    };
    let at = parts.entry(partition).or_insert(ms);
    *at = (*at).max(ms);
}

/// When each owned source partition last delivered a record (or was assigned).
#[derive(Debug, Default)]
pub struct LastSeen(HashMap<String, HashMap<i32, Instant>>);

impl LastSeen {
    /// A record of `topic`/`partition` arrived (or it was just assigned).
    pub fn saw(&mut self, topic: &str, partition: i32) {
        self.saw_at(topic, partition, Instant::now());
    }

    /// A record of `topic`/`partition` arrived at `now` (read once for a batch of records).
    pub fn saw_at(&mut self, topic: &str, partition: i32, now: Instant) {
        match self.0.get_mut(topic) {
            Some(parts) => {
                parts.insert(partition, now);
            }
            None => {
                self.0
                    .insert(topic.to_string(), HashMap::from([(partition, now)]));
            }
        }
    }

    /// Whether nothing arrived from `topic`/`partition` for `quiet`.
    fn quiet(&self, topic: &str, partition: i32, quiet: Duration) -> bool {
        self.0
            .get(topic)
            .and_then(|m| m.get(&partition))
            .is_none_or(|at| at.elapsed() >= quiet)
    }
}

/// The watermarks a checkpoint commits: the newest source time of each source partition that
/// had changes, and `now_ms` for each of `owned` that is idle: it had none, delivered nothing
/// for `quiet` (a checkpoint interval), and has nothing left to read (its committed offset is at
/// the broker's end, as the broker last said).
pub fn checkpoint_watermarks<'a>(
    newest: &Watermarks,
    owned: impl Iterator<Item = &'a (String, i32)>,
    committed: &Offsets,
    last_seen: &LastSeen,
    quiet: Duration,
    now_ms: i64,
) -> Watermarks {
    let mut out = newest.clone();
    for (topic, p) in owned {
        if newest.get(topic).is_some_and(|m| m.contains_key(p)) {
            continue;
        }
        let Some(at) = committed.get(topic).and_then(|m| m.get(p)) else {
            continue;
        };
        if last_seen.quiet(topic, *p, quiet) && crate::source::caught_up(topic, *p, *at) {
            out.entry(topic.clone()).or_default().insert(*p, now_ms);
        }
    }
    out
}

/// The table's watermark for `pipeline`: the least over its source partitions, those it has
/// offsets for and those a member has claimed (before committing anything from them); `None`
/// while one of them has no watermark yet.
pub fn table_watermark(meta: &TableMetadata, pipeline: &str) -> Result<Option<i64>> {
    let mut sources = table_offsets(meta, pipeline)?;
    for (topic, parts) in crate::commit::table_epochs(meta, pipeline)? {
        sources.entry(topic).or_default().extend(parts);
    }
    let marks = table_watermarks(meta, pipeline)?;
    let mut least: Option<i64> = None;
    for (topic, parts) in &sources {
        for p in parts.keys() {
            let Some(ms) = marks.get(topic).and_then(|m| m.get(p)) else {
                return Ok(None);
            };
            least = Some(least.map_or(*ms, |l| l.min(*ms)));
        }
    }
    Ok(least)
}

fn property(meta: &TableMetadata, key: &str) -> Option<i64> {
    meta.properties.get(key).and_then(|v| v.parse().ok())
}

/// How far partitions of the table are done (ms), as its properties record.
pub fn done_through(meta: &TableMetadata) -> Option<i64> {
    property(meta, DONE_THROUGH)
}

/// The report of a done partition: `_SUCCESS`'s content and the HTTP body.
fn report(
    table: &Table,
    field_names: &[String],
    p: &Partition,
    watermark_ms: i64,
) -> Result<Vec<u8>> {
    let spec = table.metadata.default_spec()?;
    let mut values = serde_json::Map::new();
    for ((f, name), v) in spec.fields.iter().zip(field_names).zip(&p.values) {
        values.insert(name.clone(), json!(f.transform()?.to_human_string(v)));
    }
    let body = json!({
        "table": format!("{}.{}", table.namespace, table.name),
        "partition": values,
        "path": format!("{}/data/{}", table.metadata.location.trim_end_matches('/'), p.path),
        "start_ms": p.range_ms.0,
        "end_ms": p.range_ms.1,
        "watermark_ms": watermark_ms,
    });
    serde_json::to_vec(&body)
        .map_err(|e| Error::new(ErrorKind::Internal, "cannot encode a done report").with_source(e))
}

/// Whether an entry was added by a table service (a compaction's rewrite moves rows, it adds
/// none).
fn by_service(meta: &TableMetadata, e: &ManifestEntry) -> bool {
    e.snapshot_id
        .and_then(|id| meta.snapshots.iter().find(|s| s.snapshot_id == id))
        .is_some_and(|s| s.summary.contains_key(SUMMARY_MAINTENANCE))
}

/// Marks the partitions of `table` done that the table's watermark has passed, then commits how
/// far. With `dry_run`, only reports what it would mark.
pub async fn mark_done(
    table: &mut Table,
    pipeline: &str,
    field: &TimeField,
    policy: &DonePolicy,
    http: &reqwest::Client,
    dry_run: bool,
) -> Result<MarkedDone> {
    let mut done = MarkedDone::default();
    let Some(watermark) = table_watermark(&table.metadata, pipeline)? else {
        return Ok(done);
    };
    done.watermark_ms = Some(watermark);
    let cut = watermark.saturating_sub(policy.idle_ms);
    let before = done_through(&table.metadata);
    let seen = property(&table.metadata, DONE_SEQUENCE).unwrap_or(0);
    let through = before.map_or(cut, |b| b.max(cut));
    done.through_ms = Some(through);
    let sequence = table.metadata.last_sequence_number;
    if before == Some(through) && seen == sequence {
        return Ok(done);
    }
    // Only manifests that may hold a partition done now, or files added since the last run.
    let meta = &table.metadata;
    let entries = table
        .live_entries_in(|m| {
            m.sequence_number > seen
                || field
                    .manifest_ends(meta, m)
                    .is_none_or(|(first, last)| first <= through && before.is_none_or(|b| last > b))
        })
        .await?;
    let parts = partitions(&table.metadata, field, &entries)?;
    let mut due: Vec<&Partition> = Vec::new();
    for p in parts.values() {
        let end = p.range_ms.1;
        if end > through {
            continue;
        }
        if before.is_none_or(|b| end > b) {
            due.push(p);
            continue;
        }
        // Done before: rows added since are late; a partition they created is marked now.
        let late: Vec<&ManifestEntry> = p
            .files
            .iter()
            .filter(|e| e.sequence_number.unwrap_or(0) > seen && !by_service(&table.metadata, e))
            .collect();
        if late.is_empty() {
            continue;
        }
        done.late_rows += late.iter().map(|e| e.data_file.record_count).sum::<i64>();
        if table.io.head(&success_uri(table, &p.path)).await?.is_none() {
            due.push(p);
        }
    }
    let spec = table.metadata.default_spec()?;
    let names: Vec<String> = spec.fields.iter().map(|f| f.name.clone()).collect();
    for p in &due {
        done.partitions.push(p.path.clone());
        if dry_run {
            continue;
        }
        let body = report(table, &names, p, watermark)?;
        table
            .io
            .put(&success_uri(table, &p.path), Bytes::from(body.clone()))
            .await?;
        if let Some(url) = &policy.url {
            send(http, url, body).await?;
        }
    }
    if dry_run {
        return Ok(done);
    }
    let m = crate::metrics::metrics();
    m.done_through
        .with_label_values(&[&format!("{}.{}", table.namespace, table.name)])
        .set(through as f64 / 1000.0);
    // Nothing marked, nothing late: the table's record stays true as it is, and is not
    // rewritten each run.
    if due.is_empty() && done.late_rows == 0 {
        return Ok(done);
    }
    inlet_common::failpoint::crash_point("done_after_actions");
    commit_progress(table, through, sequence).await?;
    m.partitions_done.inc_by(done.partitions.len() as u64);
    m.late_rows
        .with_label_values(&["done"])
        .inc_by(done.late_rows.max(0) as u64);
    Ok(done)
}

/// POSTs a report; anything but a 2xx answer fails the run, which is tried again.
async fn send(http: &reqwest::Client, url: &str, body: Vec<u8>) -> Result<()> {
    let failed = |why: String| {
        Error::new(
            ErrorKind::Storage,
            format!("services.mark_done_url: the report to {url} failed: {why}"),
        )
    };
    let resp = http
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| failed(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(failed(format!("status {}", resp.status())));
    }
    Ok(())
}

/// Records in the table's properties that partitions ending at or before `through` are done
/// and that files up to `sequence` have been seen; never moves either back.
async fn commit_progress(table: &mut Table, through: i64, sequence: i64) -> Result<()> {
    const ATTEMPTS: u32 = 10;
    for attempt in 1..=ATTEMPTS {
        if attempt > 1 {
            table.refresh().await?;
        }
        let meta = &table.metadata;
        let through = done_through(meta).map_or(through, |t| t.max(through));
        let sequence = property(meta, DONE_SEQUENCE).map_or(sequence, |s| s.max(sequence));
        let mut next = meta.clone();
        let props: BTreeMap<&str, String> = BTreeMap::from([
            (DONE_THROUGH, through.to_string()),
            (DONE_SEQUENCE, sequence.to_string()),
        ]);
        if props
            .iter()
            .all(|(k, v)| meta.properties.get(*k) == Some(v))
        {
            return Ok(());
        }
        for (k, v) in props {
            next.properties.insert(k.to_string(), v);
        }
        next.last_updated_ms = inlet_iceberg::now_ms().max(meta.last_updated_ms + 1);
        if inlet_iceberg::commit_tables(&mut [&mut *table], vec![next]).await? {
            return Ok(());
        }
    }
    Err(Error::new(
        ErrorKind::CommitConflict,
        format!("mark-done progress did not commit after {ATTEMPTS} attempts"),
    ))
}
