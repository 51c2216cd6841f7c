//! Table services: metadata upkeep and manifest merging over thousands of commits, snapshot
//! expiry, orphan-file cleanup. Checkpoints are committed through the library's committer
//! directly (real SQLite catalog, real files), and the results are read back with pyiceberg.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use inlet::commit::{table_offsets, CommitOutcome, Committer, Offsets};
use inlet::maintain::{expire_snapshots, find_orphans, remove_orphans, ExpiryPolicy};
use inlet::table::manifest::read_manifest_list;
use inlet::table::types::{Type, Value};
use inlet::table::{Table, TableDefinition};
use inlet::write::parquet::WriteColumn;
use inlet::write::DataWriter;
use serde_json::Value as Json;

const PIPELINE: &str = "svc";

/// Writes one-row files and commits them, one checkpoint each, as a pipeline would; keeps the
/// model of the rows the table should hold.
struct Feed {
    table: Table,
    committer: Committer,
    /// Next offset of the one source partition.
    offset: i64,
    checkpoint: u64,
    /// id → (name, data file holding the row).
    rows: BTreeMap<i64, (String, String)>,
}

impl Feed {
    async fn new(lake: &Lake, name: &str, properties: &[(&str, &str)]) -> Feed {
        let (catalog, io) = lake.open().await;
        let def = TableDefinition {
            columns: vec![
                ("id".into(), Type::Long, true, None),
                ("name".into(), Type::String, false, None),
            ],
            identifier: vec!["id".into()],
            partition: vec![],
            properties: properties
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let warehouse = if lake.warehouse.contains("://") {
            lake.warehouse.clone()
        } else {
            format!("file://{}", lake.warehouse)
        };
        let table = Table::load_or_create(&catalog, &io, "test", name, &warehouse, &def)
            .await
            .unwrap();
        Feed {
            table,
            committer: Committer {
                pipeline_id: PIPELINE.into(),
                writer_id: "w".into(),
                retries: 10,
                retry_for: std::time::Duration::from_secs(30),
            },
            offset: 0,
            checkpoint: 0,
            rows: BTreeMap::new(),
        }
    }

    fn offsets(next: i64) -> Offsets {
        Offsets::from([("t".to_string(), BTreeMap::from([(0, next)]))])
    }

    /// Commits row `id` in a file of its own and, if given, deletes the row `delete` (by
    /// position, with a delete file). Returns the snapshot id.
    async fn commit(&mut self, id: i64, delete: Option<i64>) -> i64 {
        let columns = vec![
            WriteColumn {
                field_id: 1,
                name: "id".into(),
                ty: Type::Long,
                required: true,
            },
            WriteColumn {
                field_id: 2,
                name: "name".into(),
                ty: Type::String,
                required: false,
            },
        ];
        let mut writer =
            DataWriter::new(columns, vec![], &self.table.metadata.location, 1 << 20, "");
        let name = format!("row-{id}");
        writer
            .write(vec![Value::Long(id), Value::String(name.clone())])
            .unwrap();
        let mut written = writer.close().unwrap();
        let mut deletes = Vec::new();
        if let Some(gone) = delete {
            let (_, path) = self.rows.remove(&gone).expect("deleting a live row");
            let mut positions = [(0u64, vec![1u8])];
            deletes.push(
                inlet::write::deletes::write_position_deletes(&path, vec![], &mut positions, "d")
                    .unwrap(),
            );
        }
        for f in written.iter().chain(&deletes) {
            self.table
                .io
                .put(&f.data_file.file_path, f.bytes.clone().into())
                .await
                .unwrap();
        }
        let file = written.remove(0).data_file;
        self.rows.insert(id, (name, file.file_path.clone()));
        self.checkpoint += 1;
        let start = if self.offset == 0 {
            Offsets::new()
        } else {
            Self::offsets(self.offset)
        };
        self.offset += 1;
        let deletes = deletes.into_iter().map(|d| d.data_file).collect();
        let end = Self::offsets(self.offset);
        let cp = plain_checkpoint(self.checkpoint, vec![file], deletes, start, end);
        match self.committer.commit(&mut self.table, &cp).await.unwrap() {
            CommitOutcome::Committed { snapshot_id, .. } => snapshot_id,
            other => panic!("{other:?}"),
        }
    }

    /// The rows pyiceberg should read: (id, name).
    fn expected(&self) -> BTreeSet<(i64, String)> {
        self.rows
            .iter()
            .map(|(id, (name, _))| (*id, name.clone()))
            .collect()
    }
}

/// (id, name) of rows pyiceberg read.
fn rows_of(read: &Json) -> BTreeSet<(i64, String)> {
    read_rows(read)
        .iter()
        .map(|r| {
            (
                r["id"].as_i64().unwrap(),
                r["name"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn metadata_dir(table: &Table) -> std::path::PathBuf {
    let location = table.metadata.location.strip_prefix("file://").unwrap();
    std::path::Path::new(location).join("metadata")
}

fn files_in(dir: &std::path::Path, suffix: &str) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect()
}

async fn current_manifests(table: &Table) -> Vec<inlet::table::manifest::ManifestFile> {
    let snap = table.metadata.current_snapshot().unwrap();
    read_manifest_list(&table.io.get(&snap.manifest_list).await.unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_commits_keep_metadata_and_manifests_bounded() {
    const COMMITS: i64 = 2_000;
    const VERSIONS: usize = 10;
    const MIN_MERGE: usize = 20;
    let lake = Lake::new();
    let name = unique("long");
    let mut feed = Feed::new(
        &lake,
        &name,
        &[
            ("write.metadata.delete-after-commit.enabled", "true"),
            ("write.metadata.previous-versions-max", "10"),
            ("commit.manifest.min-count-to-merge", "20"),
        ],
    )
    .await;
    let dir = metadata_dir(&feed.table);
    // What the daemon's services do every interval: keep ten snapshots besides the tag.
    let policy = ExpiryPolicy {
        window_ms: 0,
        min_snapshots: 10,
        batch: 1_000,
    };
    let mut sizes = Vec::new();
    for id in 1..=COMMITS {
        // Every third commit deletes an earlier row: delete manifests grow too.
        let delete = (id % 3 == 0).then(|| *feed.rows.keys().next().unwrap());
        feed.commit(id, delete).await;
        if id % 100 == 0 {
            let now = inlet::table::now_ms();
            expire_snapshots(&mut feed.table, &policy, now, false)
                .await
                .unwrap();
            let len = std::fs::metadata(
                feed.table
                    .metadata_location
                    .strip_prefix("file://")
                    .unwrap(),
            )
            .unwrap()
            .len();
            sizes.push(len);
        }
        if id % 50 == 0 {
            let on_disk = files_in(&dir, ".metadata.json").len();
            assert!(
                on_disk <= VERSIONS + 1,
                "{on_disk} metadata files after {id} commits"
            );
            let manifests = current_manifests(&feed.table).await;
            let (deletes, data): (Vec<_>, Vec<_>) = manifests.iter().partition(|m| m.content == 1);
            assert!(
                data.len() <= MIN_MERGE + 1 && deletes.len() <= MIN_MERGE + 1,
                "{} data and {} delete manifests after {id} commits",
                data.len(),
                deletes.len()
            );
        }
    }
    // Compact JSON, snapshots and logs bounded: the file is as large at the end as early on.
    let first = sizes[1];
    assert!(
        sizes.iter().skip(1).all(|s| *s <= first + first / 5),
        "metadata.json sizes after expiry: {sizes:?}"
    );
    assert!(feed.table.metadata.snapshots.len() <= 11);
    // Expired snapshots' manifest lists are gone; the merged manifests keep the files apart.
    let lists = files_in(&dir, ".avro")
        .into_iter()
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("snap-")
        })
        .count();
    assert!(lists <= 12, "{lists} manifest lists on disk");
    let read = lake.read(&name);
    assert_eq!(rows_of(&read), feed.expected());
    assert_eq!(
        table_offsets(&feed.table.metadata, PIPELINE).unwrap(),
        Feed::offsets(COMMITS)
    );
}

fn exists(uri: &str) -> bool {
    std::path::Path::new(uri.strip_prefix("file://").unwrap_or(uri)).exists()
}

/// The files pyiceberg lists for what it read, each checked to exist.
fn assert_files_exist(read: &Json) {
    for f in read["files"].as_array().unwrap() {
        let path = f["file_path"].as_str().unwrap();
        assert!(exists(path), "{path} is gone");
        let manifest = f["manifest_path"].as_str().unwrap();
        assert!(exists(manifest), "{manifest} is gone");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_keeps_head_tag_window_and_what_pinned_readers_read() {
    let lake = Lake::new();
    let name = unique("exp");
    let table = format!("test.{name}");
    let mut feed = Feed::new(&lake, &name, &[]).await;
    // (snapshot, rows as of it) of each of 30 checkpoints.
    let mut ours = Vec::new();
    for id in 1..=30 {
        let delete = (id % 4 == 0).then(|| *feed.rows.keys().next().unwrap());
        let snapshot = feed.commit(id, delete).await;
        ours.push((snapshot, feed.expected()));
    }
    // Another engine commits on top of inlet's last checkpoint.
    foreign_writer(
        &lake,
        &name,
        &["append-json", r#"[{"id": 1000, "name": "foreign"}]"#],
    );
    feed.table.refresh().await.unwrap();
    let head = feed.table.metadata.current_snapshot_id.unwrap();
    assert!(!ours.iter().any(|(s, _)| *s == head));
    let ts = |t: &Table, id: i64| {
        t.metadata
            .snapshots
            .iter()
            .find(|s| s.snapshot_id == id)
            .unwrap()
            .timestamp_ms
    };
    // The window reaches back to checkpoint 21; batches of 5 take four runs for 1..=20.
    let now = inlet::table::now_ms();
    let policy = ExpiryPolicy {
        window_ms: now - ts(&feed.table, ours[20].0),
        min_snapshots: 1,
        batch: 5,
    };
    let lists: Vec<String> = feed
        .table
        .metadata
        .snapshots
        .iter()
        .map(|s| s.manifest_list.clone())
        .collect();
    let mut runs = Vec::new();
    loop {
        let expired = expire_snapshots(&mut feed.table, &policy, now, false)
            .await
            .unwrap();
        if expired.snapshots.is_empty() {
            break;
        }
        runs.push(expired.snapshots.len());
    }
    assert_eq!(runs, vec![5, 5, 5, 5]);
    let kept: BTreeSet<i64> = feed
        .table
        .metadata
        .snapshots
        .iter()
        .map(|s| s.snapshot_id)
        .collect();
    let mut want: BTreeSet<i64> = ours[20..].iter().map(|(s, _)| *s).collect();
    want.insert(head);
    assert_eq!(
        kept, want,
        "the head, the tag (checkpoint 30) and the window"
    );
    // Expired snapshots' manifest lists are deleted, kept ones are not.
    for list in &lists {
        let expired = !feed
            .table
            .metadata
            .snapshots
            .iter()
            .any(|s| &s.manifest_list == list);
        assert_eq!(exists(list), !expired, "{list}");
    }
    // Readers of the head and readers pinned to a kept snapshot read exactly what they did.
    let mut now_rows = feed.expected();
    now_rows.insert((1000, "foreign".into()));
    let read = lake.pyiceberg(&table);
    assert_eq!(rows_of(&read), now_rows);
    assert_files_exist(&read);
    for (snapshot, rows) in [&ours[20], &ours[25]] {
        let read = lake.pyiceberg_at(&table, *snapshot);
        assert_eq!(&rows_of(&read), rows, "snapshot {snapshot}");
        assert_files_exist(&read);
    }

    // Two more foreign commits, then expiry of everything it may take: the lineage from the
    // head is cut, and the tag alone keeps inlet's offsets.
    for (id, n) in [(1001, "f1"), (1002, "f2")] {
        foreign_writer(
            &lake,
            &name,
            &[
                "append-json",
                &format!(r#"[{{"id": {id}, "name": "{n}"}}]"#),
            ],
        );
        now_rows.insert((id, n.into()));
    }
    feed.table.refresh().await.unwrap();
    let head = feed.table.metadata.current_snapshot_id.unwrap();
    let all = ExpiryPolicy {
        window_ms: 0,
        min_snapshots: 1,
        batch: 1_000,
    };
    expire_snapshots(&mut feed.table, &all, inlet::table::now_ms() + 1, false)
        .await
        .unwrap();
    let kept: BTreeSet<i64> = feed
        .table
        .metadata
        .snapshots
        .iter()
        .map(|s| s.snapshot_id)
        .collect();
    assert_eq!(kept, BTreeSet::from([head, ours[29].0]));
    assert_eq!(
        table_offsets(&feed.table.metadata, PIPELINE).unwrap(),
        Feed::offsets(30),
        "inlet resumes at its own offsets"
    );
    // And its next checkpoint, fenced by those offsets, lands on top.
    let oldest = *feed.rows.keys().next().unwrap();
    feed.commit(31, Some(oldest)).await;
    now_rows = feed.expected();
    for (id, n) in [(1000, "foreign"), (1001, "f1"), (1002, "f2")] {
        now_rows.insert((id, n.into()));
    }
    let read = lake.pyiceberg(&table);
    assert_eq!(rows_of(&read), now_rows);
    assert_files_exist(&read);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphan_cleanup_spares_young_and_live_files_and_removes_old_leftovers() {
    const DAY_MS: i64 = 24 * 3_600_000;
    let lake = Lake::new();
    let name = unique("orph");
    let table = format!("test.{name}");
    // Old metadata files fall out of the log but stay on disk: orphans too.
    let mut feed = Feed::new(
        &lake,
        &name,
        &[("write.metadata.previous-versions-max", "2")],
    )
    .await;
    for id in 1..=6 {
        let delete = (id % 3 == 0).then(|| *feed.rows.keys().next().unwrap());
        feed.commit(id, delete).await;
    }
    // What a commit that never landed leaves: a data file, its manifest, its metadata file.
    let location = feed.table.metadata.location.clone();
    let leftovers = vec![
        format!("{location}/data/killed-00001.parquet"),
        format!("{location}/metadata/killed-m0.avro"),
        format!("{location}/metadata/00099-killed.metadata.json"),
    ];
    for f in &leftovers {
        feed.table
            .io
            .put(f, bytes::Bytes::from_static(b"partial"))
            .await
            .unwrap();
    }
    // A file outside data/ and metadata/ is never looked at.
    let elsewhere = format!("{location}/index/shard-0.sst");
    feed.table
        .io
        .put(&elsewhere, bytes::Bytes::from_static(b"x"))
        .await
        .unwrap();
    let dir = metadata_dir(&feed.table);
    let mut live_metadata: BTreeSet<String> = feed
        .table
        .metadata
        .metadata_log
        .iter()
        .map(|e| e.metadata_file.clone())
        .collect();
    live_metadata.insert(feed.table.metadata_location.clone());
    let old_metadata: Vec<String> = files_in(&dir, ".metadata.json")
        .into_iter()
        .map(|p| format!("file://{}", p.display()))
        .filter(|u| !live_metadata.contains(u) && !leftovers.contains(u))
        .collect();
    assert_eq!(old_metadata.len(), 4, "7 metadata files, 3 in use");

    // Young: nothing is an orphan yet, whatever it is.
    let now = inlet::table::now_ms();
    assert_eq!(
        find_orphans(&mut feed.table, 3 * DAY_MS, now)
            .await
            .unwrap(),
        vec![]
    );
    // Three days on: exactly the leftovers and the dropped metadata files.
    let later = now + 3 * DAY_MS + 60_000;
    let mut want: Vec<String> = leftovers.iter().cloned().chain(old_metadata).collect();
    want.sort();
    let dry = remove_orphans(&mut feed.table, 3 * DAY_MS, later, true)
        .await
        .unwrap();
    let found: Vec<String> = dry.iter().map(|o| o.uri.clone()).collect();
    assert_eq!(found, want);
    assert!(want.iter().all(|u| exists(u)), "a dry run deletes nothing");
    remove_orphans(&mut feed.table, 3 * DAY_MS, later, false)
        .await
        .unwrap();
    assert!(want.iter().all(|u| !exists(u)));
    assert!(exists(&elsewhere));
    // Live files all stay: the table reads exactly, and commits on.
    let read = lake.pyiceberg(&table);
    assert_eq!(rows_of(&read), feed.expected());
    assert_files_exist(&read);
    let oldest = *feed.rows.keys().next().unwrap();
    feed.commit(7, Some(oldest)).await;
    assert_eq!(rows_of(&lake.pyiceberg(&table)), feed.expected());
    assert_eq!(
        find_orphans(&mut feed.table, 3 * DAY_MS, later)
            .await
            .unwrap()
            .len(),
        1,
        "the metadata file that just fell out of the log"
    );
}

/// Runs `inlet maintain` on `config` with `env`: (success, stdout).
fn maintain_with(
    lake: &Lake,
    config: &std::path::Path,
    dry_run: bool,
    env: &[(&str, &str)],
) -> (bool, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_inlet"));
    cmd.args(["maintain", "--config"]).arg(config);
    if dry_run {
        cmd.arg("--dry-run");
    }
    for (k, v) in lake.env() {
        cmd.env(k, v);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run inlet maintain");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn maintain(lake: &Lake, config: &std::path::Path, dry_run: bool) -> (bool, String) {
    maintain_with(lake, config, dry_run, &[])
}

/// Makes every file below `dir` look `age_ms` old, as if the table had sat that long.
fn age_files(dir: &std::path::Path, age_ms: u64) {
    let then = std::time::SystemTime::now() - std::time::Duration::from_millis(age_ms);
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                let f = std::fs::File::options().write(true).open(&path).unwrap();
                f.set_modified(then).unwrap();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintain_command_cleans_up_after_a_killed_commit_and_inlet_resumes_exactly() {
    const PARTITIONS: i32 = 3;
    let lake = Lake::new();
    let (broker, topic, name) = topic_and_table("mnt", PARTITIONS).await;
    // The running pipeline expires snapshots in the background every second, racing its own
    // commits through the catalog.
    let config = custom_config(
        &lake,
        &topic,
        &name,
        "  mode: changelog
  columns:
    - {name: id, type: long, required: true}
    - {name: region, type: string}
    - {name: amount, type: \"decimal(10,2)\"}
    - {name: created_at, type: timestamptz}
  primary_key: [id]",
        150,
        "services:
  interval_ms: 1000
  snapshot_min_age_ms: 0
  snapshots_min: 2",
    );
    let stream = debezium_stream(5, 1_800, 200, PARTITIONS);
    let halves = in_parts(&stream, 2);
    let mut produced = produce(&broker.bootstrap, &topic, &halves[0]).await;
    // Killed after uploading its second checkpoint's files: they belong to no snapshot.
    let mut killed = Inlet::spawn(&config, &[("INLET_CRASH_AT", "after_upload:2")]);
    let status = killed
        .wait_exit(std::time::Duration::from_secs(90))
        .expect("inlet crashes");
    assert!(!status.success());
    run_to_end(&lake, &config, &name, &produced, &[]).await;

    let t = lake.table("test", &name).await.unwrap();
    let location = t
        .metadata
        .location
        .strip_prefix("file://")
        .unwrap()
        .to_string();
    // Young files are never orphans.
    let (ok, out) = maintain(&lake, &config, true);
    assert!(ok, "{out}");
    assert!(out.contains("would delete 0 orphan files"), "{out}");
    // Three days later the killed commit's files are.
    age_files(std::path::Path::new(&location), 3 * 24 * 3_600_000 + 60_000);
    let (ok, out) = maintain(&lake, &config, true);
    assert!(ok, "{out}");
    let orphans: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_once(": orphan ").map(|(_, u)| u))
        .collect();
    assert!(
        orphans.iter().any(|u| u.contains("/data/")),
        "the killed checkpoint's data files: {out}"
    );
    let read = lake.read(&name);
    let live: BTreeSet<&str> = read["files"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|f| {
            [
                f["file_path"].as_str().unwrap(),
                f["manifest_path"].as_str().unwrap(),
            ]
        })
        .collect();
    assert!(orphans.iter().all(|u| !live.contains(u)), "{out}");
    assert!(
        orphans.iter().all(|u| exists(u)),
        "a dry run deletes nothing"
    );
    // Killed before or after committing the shorter metadata (before deleting what it no
    // longer reaches): the table stays whole, and the next run finishes the job.
    for step in ["expire_before_commit", "expire_after_commit"] {
        let (ok, _) = maintain_with(&lake, &config, false, &[("INLET_CRASH_AT", step)]);
        assert!(!ok, "no crash at {step}");
        let read = lake.read(&name);
        assert_eq!(changelog_positions(&read), produced_changes(&produced));
        assert_files_exist(&read);
    }
    let (ok, out) = maintain(&lake, &config, false);
    assert!(ok, "{out}");
    assert!(orphans.iter().all(|u| !exists(u)), "{out}");
    let read = lake.read(&name);
    assert_eq!(changelog_positions(&read), produced_changes(&produced));
    assert_files_exist(&read);

    // The head and the tag survive; inlet resumes at its own offsets and stays exact.
    let t = lake.table("test", &name).await.unwrap();
    let tag = t.metadata.refs[&format!("inlet-{name}")].snapshot_id;
    assert!(t.metadata.snapshots.iter().any(|s| s.snapshot_id == tag));
    assert!(t.metadata.current_snapshot().is_some());
    produced.extend(produce(&broker.bootstrap, &topic, &halves[1]).await);
    run_to_end(&lake, &config, &name, &produced, &[]).await;
    let read = lake.read(&name);
    assert_eq!(changelog_positions(&read), produced_changes(&produced));
    assert_files_exist(&read);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_and_orphan_cleanup_work_through_a_rest_catalog_on_s3() {
    const DAY_MS: i64 = 24 * 3_600_000;
    let lake = Lake::rest(Store::S3s);
    let name = unique("rest");
    let table = format!("test.{name}");
    let mut feed = Feed::new(&lake, &name, &[]).await;
    let mut ours = Vec::new();
    for id in 1..=12 {
        let delete = (id % 3 == 0).then(|| *feed.rows.keys().next().unwrap());
        ours.push((feed.commit(id, delete).await, feed.expected()));
    }
    let lists: BTreeMap<i64, String> = feed
        .table
        .metadata
        .snapshots
        .iter()
        .map(|s| (s.snapshot_id, s.manifest_list.clone()))
        .collect();
    let policy = ExpiryPolicy {
        window_ms: 0,
        min_snapshots: 3,
        batch: 100,
    };
    let expired = expire_snapshots(&mut feed.table, &policy, inlet::table::now_ms() + 1, false)
        .await
        .unwrap();
    assert_eq!(expired.snapshots.len(), 9);
    // The server took the removal: a fresh load has the three newest.
    let read = lake.pyiceberg(&table);
    assert_eq!(read["snapshot_count"], 3);
    assert_eq!(rows_of(&read), feed.expected());
    let pinned = lake.pyiceberg_at(&table, ours[9].0);
    assert_eq!(rows_of(&pinned), ours[9].1);
    let newest: BTreeSet<i64> = ours[9..].iter().map(|(s, _)| *s).collect();
    assert!(expired.snapshots.iter().all(|s| !newest.contains(s)));
    for (id, list) in &lists {
        let there = feed.table.io.head(list).await.unwrap().is_some();
        assert_eq!(there, newest.contains(id), "{list}");
    }

    // Orphans on S3 are aged by the store's modification times.
    let location = feed.table.metadata.location.clone();
    let leftovers = vec![
        format!("{location}/data/killed-00001.parquet"),
        format!("{location}/metadata/killed-m0.avro"),
    ];
    for f in &leftovers {
        feed.table
            .io
            .put(f, bytes::Bytes::from_static(b"partial"))
            .await
            .unwrap();
    }
    let now = inlet::table::now_ms();
    assert_eq!(
        find_orphans(&mut feed.table, 3 * DAY_MS, now)
            .await
            .unwrap(),
        vec![]
    );
    let later = now + 3 * DAY_MS + 60_000;
    let removed = remove_orphans(&mut feed.table, 3 * DAY_MS, later, false)
        .await
        .unwrap();
    let removed: Vec<&str> = removed.iter().map(|o| o.uri.as_str()).collect();
    for f in &leftovers {
        assert!(removed.contains(&f.as_str()), "{f} in {removed:?}");
        assert!(feed.table.io.head(f).await.unwrap().is_none());
    }
    // Anything else removed is a metadata file the server no longer lists.
    let current = feed.table.metadata_location.clone();
    assert!(
        removed.iter().all(|u| leftovers.iter().any(|l| l == u)
            || (u.ends_with(".metadata.json") && *u != current)),
        "{removed:?}"
    );
    let read = lake.pyiceberg(&table);
    assert_eq!(rows_of(&read), feed.expected());
    for f in read["files"].as_array().unwrap() {
        for key in ["file_path", "manifest_path"] {
            let uri = f[key].as_str().unwrap();
            assert!(feed.table.io.head(uri).await.unwrap().is_some(), "{uri}");
        }
    }
}

const DAY_MS: i64 = 86_400_000;
const HOUR_MS: i64 = 3_600_000;
/// 2026-01-01T00:00Z, the first day of the test streams.
const JAN_1_MS: i64 = 1_767_225_600_000;

/// Appends `services` settings to a pipeline config.
fn with_services(config: &std::path::Path, settings: &str) -> std::path::PathBuf {
    let mut yaml = std::fs::read_to_string(config).unwrap();
    yaml.push_str("services:\n");
    for line in settings.lines() {
        yaml.push_str(&format!("  {}\n", line.trim()));
    }
    std::fs::write(config, yaml).unwrap();
    config.to_path_buf()
}

/// The day (days since the epoch) of every live data file of the table.
async fn live_days(lake: &Lake, table: &str) -> BTreeSet<i32> {
    let t = lake.table("test", table).await.unwrap();
    t.live_entries()
        .await
        .unwrap()
        .iter()
        .filter(|e| e.data_file.content == inlet::table::manifest::FileContent::Data)
        .map(|e| match e.data_file.partition[0] {
            Value::Date(d) => d,
            ref other => panic!("day partition {other:?}"),
        })
        .collect()
}

/// Sums a numeric field over the log events with `message`.
fn event_sum(events: &[Json], message: &str, field: &str) -> i64 {
    events
        .iter()
        .map(|e| &e["fields"])
        .filter(|f| f["message"] == message)
        .filter_map(|f| f[field].as_i64())
        .sum()
}

/// Partition retention on an upsert table with crashes at each of its commit steps: the days
/// whose end is older than the expiration are dropped, every later change for them (the random
/// stream keeps sending some) is applied and dropped again, and the table ends as the model's
/// rows of the days kept, with each shard's index equal to a rebuild.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_retention_drops_exactly_the_expired_days_of_an_upsert_table_through_crashes() {
    const PARTITIONS: i32 = 3;
    const KEYS: i64 = 400;
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("ret", PARTITIONS).await;
    let model = upsert_stream(51, 7_000, KEYS, PARTITIONS);
    // 2026-01-01 and -02 have expired, -03 and -04 have not, with twelve hours either side.
    let jan_3 = JAN_1_MS + 2 * DAY_MS;
    let expiration = inlet::table::now_ms() - jan_3 - 12 * HOUR_MS;
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 300);
    with_services(
        &config,
        &format!("partition_expiration_ms: {expiration}\npartition_interval_ms: 1"),
    );
    let steps = inlet::maintain::retention::STEPS;
    let chunks = in_parts(&model.messages, steps.len() + 2);
    let mut produced = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        produced.extend(produce(&broker.bootstrap, &topic, &chunks[i]).await);
        let mut inlet = lake.spawn(&config, &[("INLET_CRASH_AT", &format!("{step}:2"))]);
        let status = inlet
            .wait_exit(std::time::Duration::from_secs(120))
            .unwrap_or_else(|| panic!("no crash at {step}"));
        assert!(!status.success(), "inlet should have crashed at {step}");
    }
    for chunk in &chunks[steps.len()..] {
        produced.extend(produce(&broker.bootstrap, &topic, chunk).await);
    }
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;

    let jan_3_s = jan_3 / 1000;
    let expected: BTreeMap<i64, (Option<String>, String, i64)> = model
        .expected
        .iter()
        .filter(|(_, (_, _, created_s))| *created_s >= jan_3_s)
        .map(|(id, row)| (*id, row.clone()))
        .collect();
    assert!(expected.len() < model.expected.len() && !expected.is_empty());
    assert_matches(&lake, &table, &expected, None).await;
    let root = lake.path().join("index").join(&table);
    assert_index_equals_a_rebuild(&lake, &table, &root, &topic, PARTITIONS, KEYS).await;
    let jan_3_day = (jan_3 / DAY_MS) as i32;
    assert_eq!(
        live_days(&lake, &table).await,
        BTreeSet::from([jan_3_day, jan_3_day + 1])
    );
    // Only retention's own snapshots removed files, and only of the expired days.
    let t = lake.table("test", &table).await.unwrap();
    let mut drops = 0;
    for s in &t.metadata.snapshots {
        let (added, removed) = t.changes_of(s).await.unwrap();
        let service = s.summary.get("inlet.maintenance").map(String::as_str);
        if service != Some("expire_partitions") {
            continue;
        }
        drops += 1;
        assert_eq!(s.summary["operation"], "delete");
        assert!(added.is_empty());
        assert!(!removed.is_empty());
        for f in &removed {
            assert!(
                matches!(f.partition[0], Value::Date(d) if d < jan_3_day),
                "retention removed {} of a day it keeps",
                f.file_path
            );
        }
    }
    assert!(drops > 0, "nothing was dropped");
    // The stream kept sending changes for the expired days: applied, counted, dropped again.
    assert!(event_sum(&events, "Expired partitions dropped", "late_rows") > 0);

    // An index copy taken now and restored after new keys of an expired day came and were
    // dropped again replays the checkpoints and the drops, and rebuilds nothing.
    let index_dir = lake.path().join("index");
    let stale = lake.path().join("index-copy");
    copy_dir(&index_dir, &stale);
    let mut expected = expected;
    let mut fresh = |ids: std::ops::Range<i64>, day: i64, lsn: i64| {
        let mut out = Vec::new();
        for id in ids {
            let row = serde_json::json!({
                "id": id, "region": "eu", "amount": "1.00",
                "created_at": JAN_1_MS + day * DAY_MS + id,
            });
            if day >= 2 {
                expected.insert(id, expected_row(&row));
            }
            let payload = serde_json::json!({
                "before": null, "after": row, "op": "c", "ts_ms": lsn + id,
                "source": {"connector": "postgresql", "lsn": lsn + id, "ts_ms": lsn + id},
            });
            out.push((
                (id % PARTITIONS as i64) as i32,
                serde_json::json!({"id": id}).to_string(),
                Some(payload.to_string()),
            ));
        }
        out
    };
    let late = fresh(KEYS..KEYS + 60, 0, 10_000_000);
    produced.extend(produce(&broker.bootstrap, &topic, &late).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    std::fs::remove_dir_all(&index_dir).unwrap();
    copy_dir(&stale, &index_dir);
    let kept = fresh(KEYS + 60..KEYS + 90, 3, 20_000_000);
    produced.extend(produce(&broker.bootstrap, &topic, &kept).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    for p in 0..PARTITIONS {
        let replayed = events.iter().map(|e| &e["fields"]).any(|f| {
            f["message"] == "Index caught up by replaying snapshots"
                && f["partition"].as_i64() == Some(p.into())
                && f["snapshots"].as_u64() > Some(0)
        });
        assert!(replayed, "partition {p} did not replay the snapshots");
    }
    assert!(
        !events
            .iter()
            .any(|e| e["fields"]["message"] == "Index rebuilt from the table"),
        "an index was rebuilt"
    );
    assert_matches(&lake, &table, &expected, None).await;
    assert_index_equals_a_rebuild(&lake, &table, &root, &topic, PARTITIONS, KEYS + 90).await;
    assert_eq!(
        live_days(&lake, &table).await,
        BTreeSet::from([jan_3_day, jan_3_day + 1])
    );
}

/// The (partition, offset) of every change whose row (the after image, a delete's before image)
/// was created at or after `from_ms`.
fn changes_created_from(produced: &[Produced], from_ms: i64) -> BTreeSet<(i64, i64)> {
    produced
        .iter()
        .filter_map(|p| {
            let payload = payload(p)?;
            (image(&payload)["created_at"].as_i64().unwrap() >= from_ms)
                .then_some((p.partition as i64, p.offset))
        })
        .collect()
}

/// `inlet maintain` drops the expired day of a changelog table exactly: a dry run lists it and
/// drops nothing; a run killed right after its commit leaves the table whole and dropped; the
/// next finds nothing more; the pipeline then resumes at its own offsets, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintain_drops_the_expired_day_of_a_changelog_table_and_inlet_resumes_exactly() {
    const PARTITIONS: i32 = 2;
    let lake = Lake::new();
    let (broker, topic, name) = topic_and_table("cret", PARTITIONS).await;
    let table_yaml = "  mode: changelog
  columns:
    - {name: id, type: long, required: true}
    - {name: region, type: string}
    - {name: amount, type: \"decimal(10,2)\"}
    - {name: created_at, type: timestamptz}
  primary_key: [id]
  partition_by:
    - {column: created_at, transform: day}";
    let config = custom_config(&lake, &topic, &name, table_yaml, 150, "");
    // `inlet maintain` runs with retention: 2026-01-01 has expired, -02 and -03 have not.
    let jan_2 = JAN_1_MS + DAY_MS;
    let expiration = inlet::table::now_ms() - jan_2 - 12 * HOUR_MS;
    let retaining = lake.path().join(format!("{name}-retention.yaml"));
    std::fs::copy(&config, &retaining).unwrap();
    with_services(
        &retaining,
        &format!("partition_expiration_ms: {expiration}"),
    );
    let stream = debezium_stream(9, 1_200, 150, PARTITIONS);
    let (first, second) = stream.split_at(stream.len() / 2);
    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    run_to_end(&lake, &config, &name, &produced, &[]).await;
    let all = produced_changes(&produced);
    let kept = changes_created_from(&produced, jan_2);
    assert!(kept.len() < all.len() && !kept.is_empty());
    let table = format!("test.{name}");

    let (ok, out) = maintain(&lake, &retaining, true);
    assert!(ok, "{out}");
    assert!(out.contains("would drop 1 expired partitions"), "{out}");
    assert!(
        out.contains(&format!(
            "{table}: expired partition created_at_day=2026-01-01"
        )),
        "{out}"
    );
    assert_eq!(changelog_positions(&lake.pyiceberg(&table)), all);

    let (ok, _) = maintain_with(
        &lake,
        &retaining,
        false,
        &[("INLET_CRASH_AT", "retain_after_commit")],
    );
    assert!(!ok, "no crash after the retention's commit");
    let read = lake.pyiceberg(&table);
    assert_eq!(changelog_positions(&read), kept);
    assert_files_exist(&read);
    let (ok, out) = maintain(&lake, &retaining, false);
    assert!(ok, "{out}");
    assert!(out.contains("drop 0 expired partitions"), "{out}");
    let jan_2_day = (jan_2 / DAY_MS) as i32;
    assert_eq!(
        live_days(&lake, &name).await,
        BTreeSet::from([jan_2_day, jan_2_day + 1])
    );

    // The pipeline (without retention) resumes where its offsets say, exactly once.
    produced.extend(produce(&broker.bootstrap, &topic, second).await);
    run_to_end(&lake, &config, &name, &produced, &[]).await;
    let mut want = kept;
    want.extend(produced_changes(&produced[produced.len() - second.len()..]));
    let read = lake.pyiceberg(&table);
    assert_eq!(changelog_positions(&read), want);
    assert_files_exist(&read);
}

/// A loopback HTTP server that answers 200 to everything and keeps the JSON bodies POSTed to it.
struct ReportSink {
    port: u16,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<Json>>>,
}

impl ReportSink {
    fn start() -> ReportSink {
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = bodies.clone();
        let port = serve_http(move |head, body| {
            if let (true, Ok(report)) = (head.starts_with("POST "), serde_json::from_slice(body)) {
                kept.lock().unwrap().push(report);
            }
            String::new()
        });
        ReportSink { port, bodies }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/done", self.port)
    }

    fn reports(&self) -> Vec<Json> {
        self.bodies.lock().unwrap().clone()
    }
}

/// A Debezium change of key `id` on partition `id % 2` with source time `ts_ms`.
fn timed_change(
    id: i64,
    before: Option<Json>,
    after: Option<Json>,
    lsn: i64,
    ts_ms: i64,
) -> Record {
    let op = match (&before, &after) {
        (None, _) => "c",
        (Some(_), Some(_)) => "u",
        (Some(_), None) => "d",
    };
    let payload = serde_json::json!({
        "before": before, "after": after, "op": op, "ts_ms": ts_ms,
        "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": ts_ms},
    });
    (
        (id % 2) as i32,
        serde_json::json!({"id": id}).to_string(),
        Some(payload.to_string()),
    )
}

/// A row of the mark-done test stream, created at `created_ms`.
fn timed_row(id: i64, region: Option<&str>, cents: i64, created_ms: i64) -> Json {
    serde_json::json!({
        "id": id,
        "region": region,
        "amount": format!("{}.{:02}", cents / 100, cents % 100),
        "created_at": created_ms,
    })
}

/// Inserts, on both source partitions, one row an hour created in `hours` (since 2026-01-01),
/// committed ten minutes later; every other hour in `eu`, the others in `us/west`.
fn hourly_rows(
    hours: std::ops::Range<i64>,
    model: &mut BTreeMap<i64, (Option<String>, String, i64)>,
) -> Vec<Record> {
    let mut out = Vec::new();
    for h in hours {
        for p in 0..2 {
            let id = 2 * h + p;
            let region = if h % 2 == 0 { "eu" } else { "us/west" };
            let created = JAN_1_MS + h * HOUR_MS;
            let row = timed_row(id, Some(region), 100 + id, created);
            model.insert(id, expected_row(&row));
            out.push(timed_change(
                id,
                None,
                Some(row),
                1_000 + id,
                created + 600_000,
            ));
        }
    }
    out
}

/// The `(day, region)` partition a report or `_SUCCESS` file names.
fn reported(report: &Json) -> (String, String) {
    (
        report["partition"]["created_at_day"]
            .as_str()
            .unwrap()
            .to_string(),
        report["partition"]["region"].as_str().unwrap().to_string(),
    )
}

/// The `_SUCCESS` file of a `(day, region)` partition, parsed, if there is one.
fn success_file(location: &str, (day, region): &(String, String)) -> Option<Json> {
    use inlet::table::transform::escape_path_value;
    let path = format!(
        "{}/data/created_at_day={}/region={}/_SUCCESS",
        location.strip_prefix("file://").unwrap(),
        escape_path_value(day),
        escape_path_value(region)
    );
    let text = std::fs::read(path).ok()?;
    Some(serde_json::from_slice(&text).expect("_SUCCESS holds JSON"))
}

fn partition_set(reports: &[Json]) -> BTreeSet<(String, String)> {
    reports.iter().map(reported).collect()
}

fn day_region(day: &str, region: &str) -> (String, String) {
    (day.to_string(), region.to_string())
}

/// Mark-done on an upsert table fed through two source partitions whose source times the test
/// sets: exactly the partitions the least watermark has passed (end + an hour) get a `_SUCCESS`
/// file and one report each at a loopback server; a restart marks only what became done since
/// (a late row's new partition included) and counts the late rows; a crash between the actions
/// and their commit repeats the same reports once, and then nothing fires again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mark_done_marks_exactly_the_passed_partitions_once_and_counts_late_rows() {
    let lake = Lake::new();
    let sink = ReportSink::start();
    let (broker, topic, name) = topic_and_table("done", 2).await;
    let config = upsert_config(&lake, &topic, &name, "deduplicate", 25);
    let quiet = lake.path().join(format!("{name}-quiet.yaml"));
    std::fs::copy(&config, &quiet).unwrap();
    with_services(
        &config,
        &format!(
            "mark_done_idle_ms: {HOUR_MS}\nmark_done_url: \"{}\"\npartition_interval_ms: 1",
            sink.url()
        ),
    );
    let mut model = BTreeMap::new();

    // Both source partitions reach 2026-01-03T11:10Z: days 1 and 2 are done, day 3 is not.
    let first = hourly_rows(0..60, &mut model);
    let mut produced = produce(&broker.bootstrap, &topic, &first).await;
    run_to_end(&lake, &config, &name, &produced, &[]).await;
    let t = lake.table("test", &name).await.unwrap();
    let location = t.metadata.location.clone();
    let watermark = JAN_1_MS + 59 * HOUR_MS + 600_000;
    // Recorded when day 2 was marked: at or after its end, never past the watermark less the
    // idle time.
    let through = |t: &Table| -> i64 {
        t.metadata.properties["inlet.done-through-ms"]
            .parse()
            .unwrap()
    };
    assert!((JAN_1_MS + 2 * DAY_MS..=watermark - HOUR_MS).contains(&through(&t)));
    let reports = sink.reports();
    let done = BTreeSet::from([
        day_region("2026-01-01", "eu"),
        day_region("2026-01-01", "us/west"),
        day_region("2026-01-02", "eu"),
        day_region("2026-01-02", "us/west"),
    ]);
    assert_eq!(partition_set(&reports), done);
    assert_eq!(reports.len(), done.len(), "a partition reported twice");
    for report in &reports {
        let p = reported(report);
        assert_eq!(report["table"], format!("test.{name}"));
        assert_eq!(
            report["path"].as_str().unwrap(),
            format!(
                "{location}/data/created_at_day={}/region={}",
                p.0,
                inlet::table::transform::escape_path_value(&p.1)
            )
        );
        assert_eq!(success_file(&location, &p).as_ref(), Some(report));
    }
    assert!(success_file(&location, &day_region("2026-01-03", "eu")).is_none());
    assert_matches(&lake, &name, &model, None).await;

    // A restart: an update of a day-1 row and a day-2 row in a new region arrive late, and
    // both partitions reach 2026-01-04T05:10Z, which makes day 3 done.
    let old = timed_row(0, Some("eu"), 100, JAN_1_MS);
    let updated = timed_row(0, Some("eu"), 99_999, JAN_1_MS);
    model.insert(0, expected_row(&updated));
    let new_region = timed_row(1_000, None, 4_200, JAN_1_MS + DAY_MS + 12 * HOUR_MS);
    model.insert(1_000, expected_row(&new_region));
    let mut second = vec![
        timed_change(0, Some(old), Some(updated), 50_000, watermark + HOUR_MS),
        timed_change(
            1_000,
            None,
            Some(new_region),
            50_001,
            watermark + HOUR_MS + 60_000,
        ),
    ];
    second.extend(hourly_rows(60..78, &mut model));
    produced.extend(produce(&broker.bootstrap, &topic, &second).await);
    let events = run_to_end_logged(&lake, &config, &name, &produced).await;
    let reports = sink.reports();
    let mut done_now = done.clone();
    done_now.extend([
        day_region("2026-01-02", "__HIVE_DEFAULT_PARTITION__"),
        day_region("2026-01-03", "eu"),
        day_region("2026-01-03", "us/west"),
    ]);
    assert_eq!(partition_set(&reports), done_now);
    assert_eq!(reports.len(), done_now.len(), "a partition reported twice");
    for p in &done_now {
        assert!(success_file(&location, p).is_some(), "no _SUCCESS in {p:?}");
    }
    // The updated row (a new row and the delete of the old one) and the new region's row.
    assert_eq!(event_sum(&events, "Partitions marked done", "late_rows"), 3);
    assert_matches(&lake, &name, &model, None).await;

    // The pipeline without mark-done takes both partitions to 2026-01-05T03:10Z; `inlet
    // maintain` killed after its actions, before their commit, reports day 4 again next time,
    // alike, and then never again.
    let third = hourly_rows(78..100, &mut model);
    produced.extend(produce(&broker.bootstrap, &topic, &third).await);
    run_to_end(&lake, &quiet, &name, &produced, &[]).await;
    assert_eq!(sink.reports().len(), done_now.len());
    let (ok, _) = maintain_with(
        &lake,
        &config,
        false,
        &[("INLET_CRASH_AT", "done_after_actions")],
    );
    assert!(!ok, "no crash after the actions");
    let crashed = sink.reports()[done_now.len()..].to_vec();
    let day_4 = BTreeSet::from([
        day_region("2026-01-04", "eu"),
        day_region("2026-01-04", "us/west"),
    ]);
    assert_eq!(partition_set(&crashed), day_4);
    let (ok, out) = maintain(&lake, &config, false);
    assert!(ok, "{out}");
    assert!(out.contains("mark 2 partitions done"), "{out}");
    let again = sink.reports()[done_now.len() + crashed.len()..].to_vec();
    assert_eq!(again.len(), 2);
    for r in &again {
        assert!(crashed.contains(r), "a repeated report differs: {r}");
    }
    let (ok, out) = maintain(&lake, &config, false);
    assert!(ok, "{out}");
    assert!(out.contains("mark 0 partitions done"), "{out}");
    assert_eq!(sink.reports().len(), done_now.len() + 4);
    let mut t = lake.table("test", &name).await.unwrap();
    let watermark = JAN_1_MS + 99 * HOUR_MS + 600_000;
    assert_eq!(through(&t), watermark - HOUR_MS);
    assert_matches(&lake, &name, &model, None).await;
    // No metadata names the markers, yet they are no orphans, however old.
    let years_later = inlet::table::now_ms() + 3 * 365 * DAY_MS;
    let orphans = find_orphans(&mut t, 3 * DAY_MS, years_later).await.unwrap();
    assert!(
        orphans.iter().all(|o| !o.uri.ends_with("/_SUCCESS")),
        "{orphans:?}"
    );
    assert!(success_file(&location, &day_region("2026-01-04", "eu")).is_some());
}

/// Commits one row with `day` (days since the epoch) into an identity-partitioned table as the
/// next checkpoint of `committer`; returns the snapshot's time.
async fn commit_day(table: &mut Table, committer: &Committer, checkpoint: u64, day: i32) -> i64 {
    let columns = vec![
        WriteColumn {
            field_id: 1,
            name: "id".into(),
            ty: Type::Long,
            required: true,
        },
        WriteColumn {
            field_id: 2,
            name: "day".into(),
            ty: Type::Date,
            required: false,
        },
    ];
    let partition = vec![inlet::write::PartitionColumn {
        source: 1,
        transform: inlet::table::transform::Transform::Identity,
        name: "day".into(),
    }];
    let mut writer = DataWriter::new(columns, partition, &table.metadata.location, 1 << 20, "");
    writer
        .write(vec![Value::Long(checkpoint as i64), Value::Date(day)])
        .unwrap();
    let file = writer.close().unwrap().remove(0);
    table
        .io
        .put(&file.data_file.file_path, file.bytes.into())
        .await
        .unwrap();
    let at = |n: u64| Offsets::from([("t".to_string(), BTreeMap::from([(0, n as i64)]))]);
    let start = if checkpoint == 1 {
        Offsets::new()
    } else {
        at(checkpoint - 1)
    };
    let cp = plain_checkpoint(
        checkpoint,
        vec![file.data_file],
        vec![],
        start,
        at(checkpoint),
    );
    match committer.commit(table, &cp).await.unwrap() {
        CommitOutcome::Committed { snapshot_id, .. } => {
            table
                .metadata
                .snapshots
                .iter()
                .find(|s| s.snapshot_id == snapshot_id)
                .unwrap()
                .timestamp_ms
        }
        other => panic!("{other:?}"),
    }
}

/// Retention against an injected clock, on a table partitioned by an identity date column:
/// by `update-time` a partition expires an expiration after a snapshot last added to it, so
/// the day written again later outlives the other; by `values-time` both days go once the end
/// of each is an expiration old. Each drop keeps the offsets and pyiceberg reads the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_follows_the_injected_clock_by_update_and_by_values_time() {
    use inlet::config::PartitionExpirationStrategy::{UpdateTime, ValuesTime};
    use inlet::maintain::partitions::TimeField;
    use inlet::maintain::retention::{retain_whole, RetentionPolicy};
    let lake = Lake::new();
    let (catalog, io) = lake.open().await;
    let name = unique("clock");
    let def = TableDefinition {
        columns: vec![
            ("id".into(), Type::Long, true, None),
            ("day".into(), Type::Date, false, None),
        ],
        identifier: vec![],
        partition: vec![(
            "day".into(),
            inlet::table::transform::Transform::Identity,
            "day".into(),
        )],
        properties: Default::default(),
    };
    let warehouse = format!("file://{}", lake.warehouse);
    let mut table = Table::load_or_create(&catalog, &io, "test", &name, &warehouse, &def)
        .await
        .unwrap();
    let committer = Committer {
        pipeline_id: PIPELINE.into(),
        writer_id: "w".into(),
        retries: 10,
        retry_for: std::time::Duration::from_secs(30),
    };
    let (d1, d2) = (20_454, 20_455); // 2026-01-01, 2026-01-02
    commit_day(&mut table, &committer, 1, d1).await;
    let t2 = commit_day(&mut table, &committer, 2, d2).await;
    let t3 = commit_day(&mut table, &committer, 3, d1).await;
    assert!(t3 > t2);
    let field = TimeField::of(&table.metadata, None).unwrap().unwrap();
    let ids = |read: &Json| -> BTreeSet<i64> {
        read_rows(read)
            .iter()
            .map(|r| r["id"].as_i64().unwrap())
            .collect()
    };

    let by_update = RetentionPolicy {
        expiration_ms: HOUR_MS,
        strategy: UpdateTime,
    };
    let early = retain_whole(
        &mut table,
        &committer,
        10,
        &field,
        &by_update,
        t2 + HOUR_MS - 1,
        false,
    )
    .await
    .unwrap();
    assert!(early.partitions.is_empty() && early.snapshot_id.is_none());
    let done = retain_whole(
        &mut table,
        &committer,
        11,
        &field,
        &by_update,
        t2 + HOUR_MS,
        false,
    )
    .await
    .unwrap();
    assert_eq!(done.partitions, vec!["day=2026-01-02".to_string()]);
    assert_eq!((done.data_files, done.rows), (1, 1));
    assert_eq!(ids(&lake.read(&name)), BTreeSet::from([1, 3]));
    assert_eq!(
        table_offsets(&table.metadata, PIPELINE).unwrap(),
        Offsets::from([("t".to_string(), BTreeMap::from([(0, 3)]))])
    );

    // By values-time, 2026-01-01 (ending 2026-01-02T00:00Z) is due a day after its end.
    let by_values = RetentionPolicy {
        expiration_ms: DAY_MS,
        strategy: ValuesTime,
    };
    let end = (d1 as i64 + 1) * DAY_MS;
    let early = retain_whole(
        &mut table,
        &committer,
        12,
        &field,
        &by_values,
        end + DAY_MS - 1,
        false,
    )
    .await
    .unwrap();
    assert!(early.partitions.is_empty());
    let done = retain_whole(
        &mut table,
        &committer,
        13,
        &field,
        &by_values,
        end + DAY_MS,
        false,
    )
    .await
    .unwrap();
    assert_eq!(done.partitions, vec!["day=2026-01-01".to_string()]);
    assert_eq!((done.data_files, done.rows), (2, 2));
    // Both rows were written (now) long after their day had expired.
    assert_eq!(done.late_rows, 2);
    let read = lake.read(&name);
    assert!(ids(&read).is_empty());
    assert_files_exist(&read);
}

/// Live data files per partition directory.
async fn files_per_dir(lake: &Lake, table: &str) -> BTreeMap<String, usize> {
    let t = lake.table("test", table).await.unwrap();
    let mut out = BTreeMap::new();
    for e in t.live_entries().await.unwrap() {
        let path = &e.data_file.file_path;
        *out.entry(path.rsplit_once('/').unwrap().0.to_string())
            .or_default() += 1;
    }
    out
}

/// `inlet maintain` packs the small files of each partition of a changelog table into one: a
/// dry run changes nothing, a run killed after its upload leaves the table as it was, one killed
/// after its commit leaves it packed; every change stays in the table exactly once, and the
/// pipeline resumes at its offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintain_packs_the_small_files_of_a_changelog_table_exactly_through_crashes() {
    const PARTITIONS: i32 = 2;
    let lake = Lake::new();
    let (broker, topic, name) = topic_and_table("pack", PARTITIONS).await;
    let table_yaml = "  mode: changelog
  columns:
    - {name: id, type: long, required: true}
    - {name: region, type: string}
    - {name: amount, type: \"decimal(10,2)\"}
    - {name: created_at, type: timestamptz}
  primary_key: [id]
  partition_by:
    - {column: created_at, transform: day}";
    let config = custom_config(&lake, &topic, &name, table_yaml, 60, "");
    let stream = debezium_stream(13, 1_200, 150, PARTITIONS);
    let (first, second) = stream.split_at(stream.len() / 2);
    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    run_to_end(&lake, &config, &name, &produced, &[]).await;
    let table = format!("test.{name}");
    let before = files_per_dir(&lake, &name).await;
    assert!(before.values().all(|n| *n > 1), "{before:?}");
    let small: usize = before.values().sum();

    let (ok, out) = maintain(&lake, &config, true);
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!(
            "would pack {small} small files into {}",
            before.len()
        )),
        "{out}"
    );
    assert_eq!(files_per_dir(&lake, &name).await, before);
    let (ok, _) = maintain_with(
        &lake,
        &config,
        false,
        &[("INLET_CRASH_AT", "pack_after_upload")],
    );
    assert!(!ok, "no crash after the upload");
    assert_eq!(files_per_dir(&lake, &name).await, before);
    assert_eq!(
        changelog_positions(&lake.pyiceberg(&table)),
        produced_changes(&produced)
    );
    let (ok, _) = maintain_with(
        &lake,
        &config,
        false,
        &[("INLET_CRASH_AT", "pack_after_commit")],
    );
    assert!(!ok, "no crash after the commit");
    let packed = files_per_dir(&lake, &name).await;
    assert_eq!(
        packed.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>()
    );
    assert!(packed.values().all(|n| *n == 1), "{packed:?}");
    let read = lake.pyiceberg(&table);
    assert_eq!(changelog_positions(&read), produced_changes(&produced));
    assert_files_exist(&read);
    let t = lake.table("test", &name).await.unwrap();
    let head = t.metadata.current_snapshot().unwrap();
    assert_eq!(head.summary["operation"], "replace");
    let parent = t
        .metadata
        .snapshots
        .iter()
        .find(|s| Some(s.snapshot_id) == head.parent_snapshot_id)
        .unwrap();
    assert_eq!(head.offsets().unwrap(), parent.offsets().unwrap());

    // The pipeline resumes at its offsets; the next run packs what it added.
    produced.extend(produce(&broker.bootstrap, &topic, second).await);
    run_to_end(&lake, &config, &name, &produced, &[]).await;
    let (ok, out) = maintain(&lake, &config, false);
    assert!(ok, "{out}");
    assert!(files_per_dir(&lake, &name).await.values().all(|n| *n == 1));
    let read = lake.pyiceberg(&table);
    assert_eq!(changelog_positions(&read), produced_changes(&produced));
    assert_files_exist(&read);
}
