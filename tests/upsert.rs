//! Upsert tables against a model: random keyed CDC streams through a real broker, compared row
//! by row with the final table the stream implies, read by pyiceberg and by inlet's own reader;
//! also after crashes at every checkpoint step and after losing the index.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use common::*;
use inlet::table::manifest::FileContent;
use inlet::table::scan::{read_columns, read_position_deletes};
use inlet::table::types::{Type, Value};

const PARTITIONS: i32 = 4;

/// Compares the table with the model through pyiceberg, then checks with inlet's reader that
/// every live row sits in a data file of the partition its values name.
async fn assert_matches_model(lake: &Lake, table: &str, model: &ModelStream) {
    assert_matches(lake, table, &model.expected, None).await;
}

async fn assert_matches(
    lake: &Lake,
    table: &str,
    expected: &BTreeMap<i64, (Option<String>, String, i64)>,
    buckets: Option<u32>,
) {
    let read = lake.pyiceberg(&format!("test.{table}"));
    let mut got: BTreeMap<i64, (Option<String>, String, i64)> = BTreeMap::new();
    for r in read["rows"].as_array().unwrap() {
        let id = r["id"].as_i64().unwrap();
        let ts = chrono::DateTime::parse_from_rfc3339(r["created_at"].as_str().unwrap())
            .unwrap()
            .timestamp();
        let row = (
            r["region"].as_str().map(str::to_string),
            r["amount"].as_str().unwrap().to_string(),
            ts,
        );
        assert!(
            got.insert(id, row).is_none(),
            "key {id} is in the table twice"
        );
    }
    let missing: Vec<_> = expected
        .keys()
        .filter(|k| !got.contains_key(k))
        .take(5)
        .collect();
    let extra: Vec<_> = got
        .keys()
        .filter(|k| !expected.contains_key(k))
        .take(5)
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing keys {missing:?}, unexpected keys {extra:?}"
    );
    for (id, want) in expected {
        assert_eq!(&got[id], want, "row of key {id}");
    }
    // iceberg-rust applies the position deletes itself and finds the same live keys.
    let mut ids: Vec<i64> = lake
        .iceberg_rust("test", table, &["id"])
        .await
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        expected.keys().copied().collect::<Vec<_>>(),
        "iceberg-rust reads other live keys"
    );

    let t = lake.table("test", table).await.unwrap();
    let entries = t.live_entries().await.unwrap();
    let mut deleted = HashSet::new();
    for e in entries
        .iter()
        .filter(|e| e.data_file.content == FileContent::PositionDeletes)
    {
        deleted.extend(
            read_position_deletes(t.io.get(&e.data_file.file_path).await.unwrap())
                .unwrap()
                .into_iter()
                .map(|(path, pos, _)| (path, pos)),
        );
    }
    let day = inlet::table::transform::Transform::Day;
    let mut live = 0;
    for e in entries
        .iter()
        .filter(|e| e.data_file.content == FileContent::Data)
    {
        let path = &e.data_file.file_path;
        let rows = read_columns(
            t.io.get(path).await.unwrap(),
            &[
                ("region", Type::String),
                ("created_at", Type::TimestampTz),
                ("id", Type::Long),
            ],
        )
        .unwrap();
        for (pos, row) in rows.iter().enumerate() {
            if deleted.contains(&(path.clone(), pos as i64)) {
                continue;
            }
            live += 1;
            let mut want = vec![day.apply(&row[1]), row[0].clone()];
            // A fixed-bucket table adds bucket[N](id) as a third partition field.
            if let Some(n) = buckets {
                want.push(inlet::table::transform::Transform::Bucket(n).apply(&row[2]));
            }
            assert_eq!(
                e.data_file.partition, want,
                "row {pos} of {path} is in the wrong partition"
            );
        }
    }
    assert_eq!(
        live,
        expected.len(),
        "inlet's reader counts a different number of live rows"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upserts_match_the_model_with_moves_duplicates_and_deletes() {
    upserts_match_the_model(Lake::new()).await;
}

/// On moto: s3s-fs keeps each object's metadata in one file named by the encoded key, which
/// outgrows the file system's name limit for the keys of position-delete files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upserts_on_s3_match_the_model_with_moves_duplicates_and_deletes() {
    upserts_match_the_model(Lake::on(Store::Moto)).await;
}

async fn upserts_match_the_model(lake: Lake) {
    let broker = Broker::start();
    let topic = unique("up");
    let table = unique("up");
    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    let model = upsert_stream(11, 100_000, 5_000, PARTITIONS);
    let produced = produce(&broker.bootstrap, &topic, &model.messages).await;
    let config = upsert_config(
        &lake,
        &broker.bootstrap,
        &topic,
        &table,
        "deduplicate",
        20_000,
    );
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_matches_model(&lake, &table, &model).await;
    let read = lake.pyiceberg(&format!("test.{table}"));
    let summary = &read["snapshot"]["summary"];
    assert!(
        summary["total-position-deletes"]
            .as_str()
            .unwrap()
            .parse::<i64>()
            .unwrap()
            > 0,
        "{summary}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_buckets_partition_by_the_key_and_match_the_model() {
    let broker = Broker::start();
    let lake = Lake::new();
    let topic = unique("fb");
    let table = unique("fb");
    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    let model = upsert_stream(41, 20_000, 1_500, PARTITIONS);
    let produced = produce(&broker.bootstrap, &topic, &model.messages).await;
    let config = upsert_config(
        &lake,
        &broker.bootstrap,
        &topic,
        &table,
        "deduplicate\n  buckets: 8",
        4_000,
    );
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_matches(&lake, &table, &model.expected, Some(8)).await;
    let read = lake.pyiceberg(&format!("test.{table}"));
    let spec: Vec<String> = read["partition_spec"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.to_string())
        .collect();
    assert!(spec.iter().any(|f| f.contains("bucket[8]")), "{spec:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_engines_match_their_models() {
    let broker = Broker::start();
    let lake = Lake::new();
    let topic = unique("me");
    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    let model = upsert_stream(31, 30_000, 2_000, PARTITIONS);
    let produced = produce(&broker.bootstrap, &topic, &model.messages).await;
    let engines = [
        ("first-row", &model.first_row),
        ("partial-update", &model.partial_update),
        ("aggregation", &model.aggregation),
    ];
    let mut runs = Vec::new();
    for (engine, _) in &engines {
        let table = unique(&engine.replace('-', "_"));
        let config = upsert_config(&lake, &broker.bootstrap, &topic, &table, engine, 5_000);
        runs.push((table, config));
    }
    for (table, config) in &runs {
        run_to_end(&lake, config, table, &produced, &[]).await;
    }
    for ((table, _), (engine, expected)) in runs.iter().zip(engines) {
        assert_ne!(
            expected, &model.expected,
            "the {engine} model must differ from deduplicate to prove anything"
        );
        assert_matches(&lake, table, expected, None).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_and_index_loss_keep_the_table_equal_to_the_model() {
    crashes_and_index_loss(Lake::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_and_index_loss_on_s3_keep_the_table_equal_to_the_model() {
    crashes_and_index_loss(Lake::on(Store::Moto)).await;
}

async fn crashes_and_index_loss(lake: Lake) {
    let broker = Broker::start();
    let topic = unique("upc");
    let table = unique("upc");
    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    let model = upsert_stream(23, 12_000, 800, PARTITIONS);
    let config = upsert_config(&lake, &broker.bootstrap, &topic, &table, "deduplicate", 400);
    let chunks: Vec<_> = model
        .messages
        .chunks(model.messages.len() / 8 + 1)
        .map(|c| c.to_vec())
        .collect();
    let mut produced = Vec::new();
    let index_dir = lake.path().join("index");

    for (i, step) in inlet::failpoint::STEPS.iter().enumerate() {
        produced.extend(produce(&broker.bootstrap, &topic, &chunks[i]).await);
        let before = lake.committed_total("test", &table, &table).await;
        let mut inlet = lake.spawn(&config, &[("INLET_CRASH_AT", &format!("{step}:2"))]);
        let status = inlet
            .wait_exit(Duration::from_secs(120))
            .unwrap_or_else(|| panic!("no crash at {step}"));
        assert!(!status.success(), "inlet should have crashed at {step}");
        assert!(
            lake.committed_total("test", &table, &table).await > before,
            "nothing committed before the crash at {step}"
        );
    }

    // A stale copy of the index (taken once every shard has committed, restored after more
    // commits) catches up by replaying the snapshots after its marker, and the changes after it
    // still find their keys' old rows.
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[4]).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    let stale_copy = lake.path().join("index-copy");
    copy_dir(&index_dir, &stale_copy);
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[5]).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    std::fs::remove_dir_all(&index_dir).unwrap();
    copy_dir(&stale_copy, &index_dir);
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[6]).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    for p in 0..PARTITIONS {
        let caught_up = recovery_events(&events, "Index caught up by replaying snapshots", p);
        assert!(
            caught_up.iter().any(|f| f["snapshots"].as_u64() > Some(0)),
            "partition {p} did not replay snapshots: {:?}",
            index_events(&events)
        );
    }
    assert_eq!(count_messages(&events, "Index rebuilt from the table"), 0);
    assert_index_equals_a_rebuild(&lake, &table, &topic, 800).await;

    // The index lost entirely is rebuilt.
    std::fs::remove_dir_all(&index_dir).unwrap();
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[7]).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    for p in 0..PARTITIONS {
        let rebuilt = events.iter().map(|e| &e["fields"]).find(|f| {
            f["message"] == "Index rebuilt from the table" && f["shard"].as_i64() == Some(p.into())
        });
        assert!(
            rebuilt.is_some_and(|f| f["keys"].as_u64() > Some(0)),
            "partition {p} was not rebuilt: {rebuilt:?}"
        );
    }
    assert_eq!(
        count_messages(&events, "Index caught up by replaying snapshots"),
        0
    );

    let all: BTreeSet<_> = produced.iter().map(|p| (p.partition, p.offset)).collect();
    assert_eq!(all.len(), model.messages.len());
    assert_matches_model(&lake, &table, &model).await;
}

/// Compares every shard's index (ids `0..keys`) with one rebuilt from the table now. File and
/// partition ids may differ, so locations compare by path and bucket counts by partition values.
/// A tombstone the engine wrote carries the delete's version, which the table does not hold: a
/// rebuilt one carries the deleted row's, no newer; and a key inserted and deleted before a
/// commit has a tombstone but no row.
async fn assert_index_equals_a_rebuild(lake: &Lake, table: &str, topic: &str, keys: i64) {
    use inlet::config::MergeEngine;
    use inlet::index::{IndexEntry, KeyIndex, RocksIndex};
    use inlet::table::types::encode_values;
    use inlet::upsert::{Shard, UpsertSpec};

    let t = lake.table("test", table).await.unwrap();
    let spec = UpsertSpec {
        key_columns: vec![0],
        merge: MergeEngine::Deduplicate,
        aggregates: vec![],
        fixed_buckets: None,
        target_rows_per_bucket: 500,
        shards: PARTITIONS as u32,
    };
    let located = |index: &dyn KeyIndex, e: &IndexEntry| {
        e.location.map(|at| {
            let path = index.file_path(at.file_id).unwrap().unwrap();
            (path, at.position, at.bucket)
        })
    };
    let buckets = |index: &dyn KeyIndex| {
        let partitions: BTreeMap<u32, Vec<u8>> = index.partitions().unwrap().into_iter().collect();
        index
            .bucket_counts()
            .unwrap()
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|((p, b), n)| ((partitions[&p].clone(), b), n))
            .collect::<BTreeMap<_, _>>()
    };
    for p in 0..PARTITIONS {
        let dir = lake
            .path()
            .join("index")
            .join(table)
            .join(format!("{topic}-{p}"));
        let kept = RocksIndex::open(&dir.join("db"), None).unwrap();
        let scratch = tempfile::tempdir().unwrap();
        let fresh = RocksIndex::open(&scratch.path().join("db"), None).unwrap();
        let mut shard = Shard::open(p as u32, scratch.path(), Box::new(fresh)).unwrap();
        inlet::rebuild::rebuild(&mut shard, &spec, &t, table)
            .await
            .unwrap();
        let rebuilt = shard.index();
        // Markers may name different snapshots: commits that leave a shard alone do not move
        // its marker.
        assert!(kept.marker().unwrap().is_some(), "shard {p} has no marker");
        assert_eq!(
            buckets(&kept),
            buckets(rebuilt),
            "bucket counts of shard {p}"
        );
        let mut live = 0;
        for id in 0..keys {
            let key = encode_values([&Value::Long(id)]);
            let (k, r) = (kept.get(&key).unwrap(), rebuilt.get(&key).unwrap());
            match (&k, &r) {
                (Some(k), Some(r)) if r.location.is_some() => {
                    live += 1;
                    assert_eq!(
                        (&k.version, located(&kept, k), &k.row),
                        (&r.version, located(rebuilt, r), &r.row),
                        "key {id}"
                    );
                }
                (Some(k), Some(r)) => assert!(
                    k.location.is_none() && k.version >= r.version,
                    "key {id}: {k:?} where a rebuild has the tombstone {r:?}"
                ),
                (k, None) => assert!(
                    k.as_ref().is_none_or(|k| k.location.is_none()),
                    "key {id}: {k:?} where a rebuild has nothing"
                ),
                (None, Some(r)) => panic!("key {id}: nothing where a rebuild has {r:?}"),
            }
        }
        assert!(live > 0, "shard {p} has no live keys to compare");
    }
}

/// Fields of the log events with `message` about `partition`.
fn recovery_events(
    events: &[serde_json::Value],
    message: &str,
    partition: i32,
) -> Vec<serde_json::Value> {
    events
        .iter()
        .map(|e| &e["fields"])
        .filter(|f| f["message"] == message && f["partition"].as_i64() == Some(partition.into()))
        .cloned()
        .collect()
}

/// What inlet said about its indexes, for failure messages.
fn index_events(events: &[serde_json::Value]) -> Vec<&serde_json::Value> {
    events
        .iter()
        .map(|e| &e["fields"])
        .filter(|f| f["message"].as_str().is_some_and(|m| m.contains("ndex")))
        .collect()
}

fn count_messages(events: &[serde_json::Value], message: &str) -> usize {
    events
        .iter()
        .filter(|e| e["fields"]["message"] == message)
        .count()
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
