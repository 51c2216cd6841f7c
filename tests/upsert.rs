//! Upsert tables against a model: random keyed CDC streams through a real broker, compared row
//! by row with the final table the stream implies, read by pyiceberg and by inlet's own reader;
//! also after crashes at every checkpoint step and after losing the index.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, Instant};

use common::*;
use inlet::table::manifest::FileContent;
use inlet::table::types::Value;

const PARTITIONS: i32 = 4;

/// Compares the table with the model through pyiceberg, then checks with inlet's reader that
/// every live row sits in a data file of the partition its values name.
async fn assert_matches_model(lake: &Lake, table: &str, model: &ModelStream) {
    assert_matches(lake, table, &model.expected, None).await;
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
    let (broker, topic, table) = topic_and_table("up", PARTITIONS).await;
    let model = upsert_stream(11, 100_000, 5_000, PARTITIONS);
    let produced = produce(&broker.bootstrap, &topic, &model.messages).await;
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 20_000);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_matches_model(&lake, &table, &model).await;
    let read = lake.read(&table);
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
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("fb", PARTITIONS).await;
    let model = upsert_stream(41, 20_000, 1_500, PARTITIONS);
    let produced = produce(&broker.bootstrap, &topic, &model.messages).await;
    let config = upsert_config(&lake, &topic, &table, "deduplicate\n  buckets: 8", 4_000);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_matches(&lake, &table, &model.expected, Some(8)).await;
    let read = lake.read(&table);
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
    let broker = Broker::shared();
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
        let config = upsert_config(&lake, &topic, &table, engine, 5_000);
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
    let (broker, topic, table) = topic_and_table("upc", PARTITIONS).await;
    let model = upsert_stream(23, 12_000, 800, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 400);
    let chunks = in_parts(&model.messages, 8);
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
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 800).await;

    // The index lost entirely comes back from its copy beside the table, caught up.
    std::fs::remove_dir_all(&index_dir).unwrap();
    let half = chunks[7].len() / 2;
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[7][..half]).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    assert_eq!(
        count_messages(&events, "Index restored from its copy beside the table"),
        PARTITIONS as usize,
        "{:?}",
        index_events(&events)
    );
    assert_eq!(count_messages(&events, "Index rebuilt from the table"), 0);
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 800).await;

    // Lost with its copies, it is rebuilt.
    std::fs::remove_dir_all(&index_dir).unwrap();
    assert!(remove_index_copies(&lake, &table).await > 0);
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[7][half..]).await);
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

/// A checkpoint is written and committed while the next one's records are read: a crash right
/// after a commit, with the next checkpoint's records applied to the shards, keeps the table
/// and the index exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_while_one_checkpoint_commits_and_the_next_buffers_keeps_the_table_exact() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("ovl", PARTITIONS).await;
    let model = upsert_stream(29, 6_000, 500, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 400);
    let produced = produce(&broker.bootstrap, &topic, &model.messages).await;
    let log = lake.path().join("overlap.log");
    let mut env = lake.env();
    env.push(("INLET_DELAY_AT".into(), "before_commit:1500".into()));
    env.push(("INLET_CRASH_AT".into(), "after_commit:3".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut inlet = Inlet::spawn_logged(&config, &env, &log);
    let status = inlet
        .wait_exit(Duration::from_secs(120))
        .expect("no crash after the third commit");
    assert!(!status.success(), "inlet should have crashed");
    let committed = events_with(&log, "Checkpoint committed");
    assert_eq!(committed.len(), 2, "{committed:?}");
    assert!(
        committed
            .iter()
            .all(|e| e["fields"]["records_meanwhile"].as_u64() > Some(0)),
        "no records were read while a checkpoint committed: {committed:?}"
    );
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 500).await;
}

/// [`assert_index_equals_a_rebuild`] for the test's one member, whose index is `index/`.
async fn assert_shards_equal_a_rebuild(lake: &Lake, table: &str, topic: &str, keys: i64) {
    let root = lake.path().join("index").join(table);
    assert_index_equals_a_rebuild(lake, table, &root, topic, PARTITIONS, keys).await;
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

/// A row of the versioned stream's table: `v`, `amount`, `updated_at`.
type VersionedRow = (Option<String>, Option<i64>, i64);

/// A Debezium stream of `id`, `v`, `amount`, `updated_at` in which `updated_at` (the configured
/// version column) has whole-second resolution, so consecutive changes of a key often tie;
/// half the deletes carry only the key (PostgreSQL's default replica identity); re-sends of
/// earlier messages are mixed in. Returns the messages and the final table of every merge
/// engine (`aggregation` sums `amount`).
struct VersionedStream {
    messages: Vec<Record>,
    expected: BTreeMap<&'static str, BTreeMap<i64, VersionedRow>>,
    ties: usize,
    key_only_deletes: usize,
}

fn versioned_stream(seed: u64, ops: usize, keys: i64, partitions: i32) -> VersionedStream {
    use rand::{Rng, SeedableRng};
    use serde_json::{json, Value as Json};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut models: BTreeMap<&'static str, BTreeMap<i64, VersionedRow>> = BTreeMap::new();
    for engine in ["deduplicate", "first-row", "partial-update", "aggregation"] {
        models.insert(engine, BTreeMap::new());
    }
    let mut live: BTreeMap<i64, (Json, i64)> = BTreeMap::new();
    let (mut lsn, mut second) = (1_000i64, 100i64);
    let (mut ties, mut key_only_deletes) = (0, 0);
    let mut sent: Vec<Record> = Vec::new();
    let mut messages = Vec::new();
    while messages.len() < ops {
        if !sent.is_empty() && rng.gen_bool(0.1) {
            messages.push(sent[rng.gen_range(0..sent.len())].clone());
            continue;
        }
        lsn += rng.gen_range(1..20);
        second += i64::from(rng.gen_bool(0.2));
        let id = rng.gen_range(0..keys);
        let v = rng
            .gen_bool(0.8)
            .then(|| format!("v{}", rng.gen_range(0..1000)));
        let amount = rng.gen_bool(0.9).then(|| rng.gen_range(1..100i64));
        let row = json!({"id": id, "v": v, "amount": amount, "updated_at": second});
        let before = live.get(&id).cloned();
        let (op, before_image, after) = match (&before, rng.gen_range(0..10)) {
            (None, _) => ("c", Json::Null, Some(row)),
            (Some((b, _)), 0..=2) => {
                let image = if rng.gen_bool(0.5) {
                    key_only_deletes += 1;
                    json!({"id": id, "v": null, "amount": null, "updated_at": null})
                } else {
                    b.clone()
                };
                ("d", image, None)
            }
            (Some((b, at)), _) => {
                ties += usize::from(*at == second);
                ("u", b.clone(), Some(row))
            }
        };
        match &after {
            Some(a) => {
                let (av, aa) = (a["v"].as_str().map(str::to_string), a["amount"].as_i64());
                let fresh = (av.clone(), aa, second);
                let m = models.get_mut("deduplicate").unwrap();
                m.insert(id, fresh.clone());
                models
                    .get_mut("first-row")
                    .unwrap()
                    .entry(id)
                    .or_insert(fresh.clone());
                let m = models.get_mut("partial-update").unwrap();
                let merged = match (before.is_some(), m.get(&id)) {
                    (true, Some(old)) => (av.clone().or(old.0.clone()), aa.or(old.1), second),
                    _ => fresh.clone(),
                };
                m.insert(id, merged);
                let m = models.get_mut("aggregation").unwrap();
                let summed = match (before.is_some(), m.get(&id)) {
                    (true, Some(old)) => (
                        av.or(old.0.clone()),
                        match (old.1, aa) {
                            (Some(x), Some(y)) => Some(x + y),
                            (x, y) => x.or(y),
                        },
                        second,
                    ),
                    _ => fresh,
                };
                m.insert(id, summed);
                live.insert(id, (a.clone(), second));
            }
            None => {
                live.remove(&id);
                for engine in ["deduplicate", "partial-update", "aggregation"] {
                    models.get_mut(engine).unwrap().remove(&id);
                }
            }
        }
        let payload = json!({
            "before": before_image, "after": after, "op": op, "ts_ms": second * 1000,
            "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": second * 1000},
        });
        let partition = (id % partitions as i64) as i32;
        let key = json!({"id": id}).to_string();
        let msg = (partition, key.clone(), Some(payload.to_string()));
        sent.push(msg.clone());
        messages.push(msg);
        if op == "d" {
            messages.push((partition, key, None));
        }
    }
    VersionedStream {
        messages,
        expected: models,
        ties,
        key_only_deletes,
    }
}

fn versioned_table(engine: &str) -> String {
    let mut yaml = format!(
        "  mode: upsert\n  merge_engine: {engine}\n  version_columns: [updated_at]\n  primary_key: [id]\n  columns:\n    - {{name: id, type: long, required: true}}\n    - {{name: v, type: string}}\n    - {{name: amount, type: long}}\n    - {{name: updated_at, type: long}}\n"
    );
    if engine == "aggregation" {
        yaml.push_str("  aggregations: {amount: sum}\n");
    }
    yaml
}

/// Reads `test.<table>` through pyiceberg as id → (v, amount, updated_at), each key once.
fn versioned_rows(lake: &Lake, table: &str) -> BTreeMap<i64, VersionedRow> {
    lake.rows_by_id(table, |r| {
        (
            r["v"].as_str().map(str::to_string),
            r["amount"].as_i64(),
            r["updated_at"].as_i64().unwrap(),
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_columns_order_ties_and_key_only_deletes_for_every_merge_engine() {
    let broker = Broker::shared();
    let lake = Lake::new();
    let topic = unique("vc");
    create_topic(&broker.bootstrap, &topic, 2).await;
    let stream = versioned_stream(5, 3_000, 60, 2);
    assert!(
        stream.ties > 50 && stream.key_only_deletes > 50,
        "ties {}, key-only deletes {}",
        stream.ties,
        stream.key_only_deletes
    );
    let produced = produce(&broker.bootstrap, &topic, &stream.messages).await;
    for (engine, expected) in &stream.expected {
        let table = unique(&engine.replace('-', "_"));
        let config = custom_config(&lake, &topic, &table, &versioned_table(engine), 700, "");
        run_to_end(&lake, &config, &table, &produced, &[]).await;
        let got = versioned_rows(&lake, &table);
        let wrong: Vec<_> = expected
            .iter()
            .filter(|(id, want)| got.get(id) != Some(want))
            .map(|(id, want)| (id, want, got.get(id)))
            .take(5)
            .collect();
        assert!(
            wrong.is_empty(),
            "{engine}: rows differ (id, want, got): {wrong:?}"
        );
        let extra: Vec<_> = got.keys().filter(|k| !expected.contains_key(k)).collect();
        assert!(
            extra.is_empty(),
            "{engine}: keys that should be gone: {extra:?}"
        );
    }
}

/// `version_columns` on a format that carries no position (plain upsert JSON): the columns order
/// changes, ties go by Kafka offset, a delete (a null value, no version at all) applies in Kafka
/// order — within a checkpoint and against rows an earlier run wrote, after the index was lost
/// and rebuilt from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_columns_without_positions_order_ties_by_offset_across_a_rebuild() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("vcoff", 1).await;
    let config = custom_config(
        &lake,
        &topic,
        &table,
        &versioned_table("deduplicate"),
        1_000,
        "format:\n  type: upsert-json\n",
    );
    without_index_copies(&config);
    let row = |id: i64, v: &str, at: i64| {
        let value = serde_json::json!({"id": id, "v": v, "amount": null, "updated_at": at});
        (0, format!("{{\"id\":{id}}}"), Some(value.to_string()))
    };
    let first = [
        row(1, "a", 10),
        row(2, "a", 20),
        row(3, "a", 10),
        row(4, "a", 10),
        // A tie within the checkpoint: the later offset wins.
        row(1, "b", 10),
    ];
    let mut produced = produce(&broker.bootstrap, &topic, &first).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    std::fs::remove_dir_all(lake.path().join("index")).unwrap();
    let second = [
        // Older than the table's row: dropped.
        row(2, "b", 15),
        // A tie with the table's row, whose offset the rebuilt index must know.
        row(3, "b", 10),
        // A delete without any version.
        (0, "{\"id\":4}".to_string(), None),
        row(5, "a", 1),
        row(5, "b", 3),
        row(5, "c", 2),
    ];
    produced.extend(produce(&broker.bootstrap, &topic, &second).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    let want: BTreeMap<i64, VersionedRow> = [
        (1, ("b", 10)),
        (2, ("a", 20)),
        (3, ("b", 10)),
        (5, ("b", 3)),
    ]
    .into_iter()
    .map(|(id, (v, at))| (id, (Some(v.to_string()), None, at)))
    .collect();
    assert_eq!(versioned_rows(&lake, &table), want);
}

/// A Debezium JSON change of key `id` at LSN `lsn`: op `c`, `u` or `d`, with `region` (the
/// partition column) in the row.
fn change(id: i64, op: &str, lsn: i64, region: &str) -> Record {
    let row = serde_json::json!({"id": id, "region": region, "v": format!("at {lsn}")});
    let (before, after) = match op {
        "d" => (row, serde_json::Value::Null),
        _ => (serde_json::Value::Null, row),
    };
    let payload = serde_json::json!({
        "before": before, "after": after, "op": op, "ts_ms": lsn,
        "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": lsn},
    });
    (0, format!("{{\"id\":{id}}}"), Some(payload.to_string()))
}

/// A checkpoint adds at most `table.max_new_partitions_per_checkpoint` partitions: changes for
/// further new partitions go to the dead-letter topic (reason `too_many_partitions`), changes
/// for partitions the table holds (written by an earlier process, so read from the table) pass,
/// and the next checkpoint may add as many again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_adds_at_most_the_partition_cap_and_dead_letters_the_rest() {
    let broker = Broker::shared();
    let lake = Lake::new();
    let topic = unique("pcap");
    let dlq = unique("pcapdlq");
    let table = unique("pcap");
    create_topic(&broker.bootstrap, &topic, 1).await;
    create_topic(&broker.bootstrap, &dlq, 1).await;
    let yaml = "  mode: upsert\n  primary_key: [id]\n  max_new_partitions_per_checkpoint: 3\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: region, type: string}\n    - {name: v, type: string}\n  partition_by:\n    - {column: region}\n";
    let config = custom_config(
        &lake,
        &topic,
        &table,
        yaml,
        1_000,
        &format!("errors:\n  policy: dead-letter\n  dead_letter_topic: {dlq}\n"),
    );
    let mut lsn = 0;
    let mut next = |id: i64, region: &str| {
        lsn += 10;
        change(id, "c", lsn, region)
    };
    let first: Vec<_> = (0..3).map(|i| next(i, &format!("r{i}"))).collect();
    let mut produced = produce(&broker.bootstrap, &topic, &first).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // One checkpoint: two partitions the table holds, three new ones, then two more new ones.
    let second = vec![
        next(10, "r0"),
        next(11, "r1"),
        next(12, "r3"),
        next(13, "r4"),
        next(14, "r5"),
        next(15, "r6"),
        next(16, "r0"),
        next(17, "r7"),
        next(18, "r6"),
    ];
    let at = produced.len();
    produced.extend(produce(&broker.bootstrap, &topic, &second).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    let letters = consume_all(&broker.bootstrap, &dlq, 3).await;
    let lettered: Vec<i64> = letters
        .iter()
        .map(|l| {
            assert_eq!(
                letter_header(l, "inlet.error.reason"),
                "too_many_partitions"
            );
            letter_header(l, "inlet.source.offset").parse().unwrap()
        })
        .collect();
    let want: Vec<i64> = [5, 7, 8].iter().map(|i| produced[at + i].offset).collect();
    assert_eq!(
        lettered, want,
        "the changes for r6 and r7 are dead-lettered"
    );
    // The next checkpoint may add them.
    let third = vec![next(15, "r6"), next(17, "r7")];
    produced.extend(produce(&broker.bootstrap, &topic, &third).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    let got = lake.rows_by_id(&table, |r| r["region"].as_str().unwrap().to_string());
    let want: BTreeMap<i64, String> = [
        (0, "r0"),
        (1, "r1"),
        (2, "r2"),
        (10, "r0"),
        (11, "r1"),
        (12, "r3"),
        (13, "r4"),
        (14, "r5"),
        (15, "r6"),
        (16, "r0"),
        (17, "r7"),
    ]
    .into_iter()
    .map(|(id, r)| (id, r.to_string()))
    .collect();
    assert_eq!(got, want);
}

/// The tombstone that follows a delete of `id`.
fn tombstone(id: i64) -> Record {
    (0, format!("{{\"id\":{id}}}"), None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_key_stays_deleted_when_a_change_is_resent_after_index_loss() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("resend", 1).await;
    let yaml = "  mode: upsert\n  primary_key: [id]\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: region, type: string}\n    - {name: v, type: string}\n  partition_by:\n    - {column: region}\n";
    let config = custom_config(&lake, &topic, &table, yaml, 1_000, "");
    // No copies beside the table: a lost index can only be rebuilt from the table's files.
    without_index_copies(&config);
    let index = lake.path().join("index");
    let shards = index.join(&table);
    // Key 1: created and updated, committed; key 9 stays live throughout.
    let mut produced = produce(
        &broker.bootstrap,
        &topic,
        &[
            change(1, "c", 100, "eu"),
            change(1, "u", 200, "eu"),
            change(9, "c", 150, "eu"),
        ],
    )
    .await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    let older_copy = lake.path().join("index-after-first-run");
    copy_dir(&index, &older_copy);
    // Key 1 moves to another partition and is deleted; key 2 is created and deleted; all in one
    // checkpoint, so neither the move nor key 2 ever reaches a data file as a live row.
    produced.extend(
        produce(
            &broker.bootstrap,
            &topic,
            &[
                change(1, "u", 300, "us"),
                change(1, "d", 400, "us"),
                tombstone(1),
                change(2, "c", 500, "eu"),
                change(2, "d", 600, "eu"),
                tombstone(2),
            ],
        )
        .await,
    );
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // The model: only key 9, as created.
    let matches_the_model = |lake: &Lake| {
        let read = lake.read(&table);
        let rows: Vec<(i64, String, String)> = read_rows(&read)
            .iter()
            .map(|r| {
                (
                    r["id"].as_i64().unwrap(),
                    r["region"].as_str().unwrap().to_string(),
                    r["v"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(rows, vec![(9, "eu".to_string(), "at 150".to_string())]);
    };
    matches_the_model(&lake);
    let tombstones_kept = || {
        let dir = shards.join(format!("{topic}-0"));
        let kept = inlet::index::RocksIndex::open(&dir.join("db"), None).unwrap();
        for (id, lsn) in [(1, 400), (2, 600)] {
            let key = inlet::table::types::encode_values([&Value::Long(id)]);
            let entry = inlet::index::KeyIndex::get(&kept, &key).unwrap().unwrap();
            let version = inlet::version::encode_version(&inlet::decode::Version(vec![
                inlet::decode::VersionPart::Int(lsn),
            ]));
            assert!(entry.location.is_none(), "key {id} is live in the index");
            assert_eq!(entry.version, version, "tombstone version of key {id}");
        }
    };
    tombstones_kept();
    let recoveries = |events: &[serde_json::Value]| {
        [
            "Index restored from its copy beside the table",
            "Index caught up by replaying snapshots",
            "Index rebuilt from the table",
        ]
        .map(|m| count_messages(events, m))
    };

    // Debezium re-sends the move of key 1 and the creation of key 2 after a connector restart.
    let resend = [change(1, "u", 300, "us"), change(2, "c", 500, "eu")];
    // The index is lost: rebuilt from the table, its tombstones carry the deletes' versions.
    std::fs::remove_dir_all(&index).unwrap();
    assert_eq!(remove_index_copies(&lake, &table).await, 0, "index copies");
    produced.extend(produce(&broker.bootstrap, &topic, &resend).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    assert_eq!(
        recoveries(&events),
        [0, 0, 1],
        "{:?}",
        index_events(&events)
    );
    matches_the_model(&lake);
    tombstones_kept();
    assert_index_equals_a_rebuild(&lake, &table, &shards, &topic, 1, 10).await;
    // An older copy of the index is restored: it catches up by replaying the snapshots after
    // its marker (the move, the deletes and the run above).
    std::fs::remove_dir_all(&index).unwrap();
    copy_dir(&older_copy, &index);
    produced.extend(produce(&broker.bootstrap, &topic, &resend).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    assert_eq!(
        recoveries(&events),
        [0, 1, 0],
        "{:?}",
        index_events(&events)
    );
    let replayed = events
        .iter()
        .find(|e| e["fields"]["message"] == "Index caught up by replaying snapshots")
        .and_then(|e| e["fields"]["snapshots"].as_u64());
    assert!(
        replayed.is_some_and(|n| n >= 2),
        "snapshots replayed: {replayed:?}"
    );
    matches_the_model(&lake);
    tombstones_kept();
    assert_index_equals_a_rebuild(&lake, &table, &shards, &topic, 1, 10).await;
}

/// The messages of a model stream without its re-sends (each message once), for tests in which
/// another engine's rewrite drops deleted rows, and with them what made re-sends stale.
fn without_resends(messages: &[Record]) -> Vec<Record> {
    let mut seen = HashSet::new();
    messages
        .iter()
        .filter(|m| m.2.is_none() || seen.insert((*m).clone()))
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_engines_rewrite_and_delete_between_runs_keep_keys_once() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("fw", PARTITIONS).await;
    let stream = without_resends(&upsert_stream(61, 6_000, 600, PARTITIONS).messages);
    let thirds = in_parts(&stream, 3);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 700);
    let mut live = BTreeMap::new();

    let mut produced = produce(&broker.bootstrap, &topic, &thirds[0]).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    replay(&mut live, &produced, expected_row);
    // A compaction by another engine replaces every data file (deletes applied).
    foreign_writer(&lake, &table, &["rewrite"]);
    assert_matches(&lake, &table, &live, None).await;

    let second = produce(&broker.bootstrap, &topic, &thirds[1]).await;
    produced.extend(second.clone());
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    assert!(
        count_messages(&events, "Index rebuilt from the table") > 0,
        "{:?}",
        index_events(&events)
    );
    replay(&mut live, &second, expected_row);
    assert_matches(&lake, &table, &live, None).await;

    // A copy-on-write delete by another engine rewrites the files holding the keys it deletes.
    foreign_writer(&lake, &table, &["delete", "id < 100"]);
    live.retain(|id, _| *id >= 100);
    assert_matches(&lake, &table, &live, None).await;
    let third = produce(&broker.bootstrap, &topic, &thirds[2]).await;
    produced.extend(third.clone());
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    replay(&mut live, &third, expected_row);
    assert!(
        live.keys().any(|id| *id < 100),
        "later changes bring deleted keys back"
    );
    assert_matches(&lake, &table, &live, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewrite_while_inlet_runs_never_commits_a_delete_against_a_removed_file() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("fwl", PARTITIONS).await;
    let stream = without_resends(&upsert_stream(67, 4_000, 300, PARTITIONS).messages);
    let (first, second) = stream.split_at(stream.len() / 2);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 100_000);
    let log = lake.path().join("live.log");
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    assert!(
        caught_up(&lake, &table, &produced, 120).await,
        "inlet did not catch up"
    );
    foreign_writer(&lake, &table, &["rewrite"]);
    // Every key of the second half updates or deletes rows that now live in the rewritten files.
    produced.extend(produce(&broker.bootstrap, &topic, second).await);
    assert!(
        caught_up(&lake, &table, &produced, 180).await,
        "inlet did not catch up after the rewrite"
    );
    inlet.stop_cleanly(Duration::from_secs(60));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("removed") && text.contains("whose rows this checkpoint deletes"),
        "the rebased commit was not refused"
    );
    let mut live = BTreeMap::new();
    replay(&mut live, &produced, expected_row);
    assert_matches(&lake, &table, &live, None).await;
}

/// Debezium inserts of keys no model stream uses (from 100 000), all in partition 0, at LSNs
/// after any of the streams'.
fn fresh_inserts(keys: std::ops::Range<i64>) -> Vec<Record> {
    keys.map(|n| {
        let id = 100_000 + n * PARTITIONS as i64;
        let lsn = 100_000_000 + n;
        let after = serde_json::json!({
            "id": id, "region": "eu", "amount": format!("{n}.00"), "created_at": 1_767_225_600_000i64,
        });
        let payload = serde_json::json!({
            "before": null, "after": after, "op": "c", "ts_ms": lsn,
            "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": lsn},
        });
        (0, serde_json::json!({"id": id}).to_string(), Some(payload.to_string()))
    })
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewrite_between_two_checkpoints_is_never_absorbed_by_the_index() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("fwa", PARTITIONS).await;
    let stream = without_resends(&upsert_stream(73, 4_000, 300, PARTITIONS).messages);
    let (first, second) = stream.split_at(stream.len() / 2);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 100_000);
    let mut inlet = Inlet::spawn(&config, &[]);
    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    assert_all_committed(
        &lake,
        &table,
        &produced,
        "inlet did not commit the first half",
    )
    .await;
    foreign_writer(&lake, &table, &["rewrite"]);
    // The next checkpoint only inserts new keys: it deletes nothing of the removed files, and
    // commits on top of the rewrite.
    produced.extend(produce(&broker.bootstrap, &topic, &fresh_inserts(0..20)).await);
    assert_all_committed(&lake, &table, &produced, "inlet did not commit the inserts").await;
    // The second half updates and deletes keys whose rows now live in the rewritten files.
    produced.extend(produce(&broker.bootstrap, &topic, second).await);
    assert_all_committed(
        &lake,
        &table,
        &produced,
        "inlet did not commit the second half",
    )
    .await;
    inlet.stop_cleanly(Duration::from_secs(60));
    let mut live = BTreeMap::new();
    replay(&mut live, &produced, expected_row);
    assert_matches(&lake, &table, &live, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_on_top_of_another_engines_delete_and_a_crash_keep_keys_once() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("fwk", PARTITIONS).await;
    let stream = without_resends(&upsert_stream(79, 4_000, 300, PARTITIONS).messages);
    let (first, second) = stream.split_at(stream.len() / 2);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 100_000);
    let mut live = BTreeMap::new();
    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    replay(&mut live, &produced, expected_row);

    // The next run commits once, then another engine deletes keys copy-on-write; the run's
    // next checkpoint commits on top of that delete and the run is killed before its index
    // batch is applied.
    let mut inlet = lake.spawn(&config, &[("INLET_CRASH_AT", "after_commit:2")]);
    let one = produce(&broker.bootstrap, &topic, &fresh_inserts(0..1)).await;
    produced.extend(one.clone());
    assert_all_committed(&lake, &table, &produced, "inlet did not commit the insert").await;
    replay(&mut live, &one, expected_row);
    foreign_writer(&lake, &table, &["delete", "id < 100"]);
    live.retain(|id, _| *id >= 100);
    let more = produce(&broker.bootstrap, &topic, &fresh_inserts(1..20)).await;
    produced.extend(more.clone());
    replay(&mut live, &more, expected_row);
    let status = inlet.wait_exit(Duration::from_secs(120)).expect("a crash");
    assert!(!status.success());

    // The run after it updates and deletes keys whose rows the delete rewrote.
    let last = produce(&broker.bootstrap, &topic, second).await;
    produced.extend(last.clone());
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    replay(&mut live, &last, expected_row);
    assert_matches(&lake, &table, &live, None).await;
}

/// A Debezium change of `row` (an object with `id`) at PostgreSQL LSN `lsn`, on partition
/// `id % 2`.
fn row_change(op: &str, lsn: i64, row: &serde_json::Value) -> Record {
    let id = row["id"].as_i64().unwrap();
    let (before, after) = match op {
        "d" => (row.clone(), serde_json::Value::Null),
        _ => (serde_json::Value::Null, row.clone()),
    };
    let payload = serde_json::json!({
        "before": before, "after": after, "op": op, "ts_ms": lsn,
        "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": lsn},
    });
    (
        (id % 2) as i32,
        format!("{{\"id\":{id}}}"),
        Some(payload.to_string()),
    )
}

/// Another engine adds, renames and drops columns of an upsert table and widens one while inlet
/// writes it: inlet's commits keep every change (`_version` stays inlet's, wherever the other
/// engine's columns land), no field id ever has two types, and the rows match the model, read
/// by pyiceberg under the new names, also where the index keeps rows to merge changes into.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_changes_by_another_engine_survive_upserts() {
    foreign_schema_changes("deduplicate").await;
    foreign_schema_changes("partial-update").await;
}

async fn foreign_schema_changes(merge: &str) {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("fsu", 2).await;
    let yaml = format!("  mode: upsert\n  merge_engine: {merge}\n  primary_key: [id]\n  columns:\n    - {{name: id, type: long, required: true}}\n    - {{name: region, type: string}}\n    - {{name: qty, type: int}}\n    - {{name: v, type: string}}\n    - {{name: note, type: string}}\n  partition_by:\n    - {{column: region}}\n");
    let config = custom_config(&lake, &topic, &table, &yaml, 100_000, "");
    without_index_copies(&config);
    let mut model: BTreeMap<i64, serde_json::Value> = BTreeMap::new();
    let mut lsn = 1_000;
    let mut batch = |model: &mut BTreeMap<i64, serde_json::Value>,
                     rows: Vec<serde_json::Value>,
                     deleted: &[i64]| {
        let mut out = Vec::new();
        for row in rows {
            lsn += 10;
            let id = row["id"].as_i64().unwrap();
            out.push(row_change("u", lsn, &row));
            // Under partial-update a null field keeps the key's value.
            match model.get_mut(&id) {
                Some(old) if merge == "partial-update" => {
                    for (k, v) in row.as_object().unwrap() {
                        if !v.is_null() {
                            old[k] = v.clone();
                        }
                    }
                }
                _ => {
                    model.insert(id, row);
                }
            }
        }
        for id in deleted {
            lsn += 10;
            let row = model.remove(id).unwrap();
            out.push(row_change("d", lsn, &row));
            out.push(((id % 2) as i32, format!("{{\"id\":{id}}}"), None));
        }
        out
    };
    let region = |id: i64| if id % 3 == 0 { "eu" } else { "us" };
    let first = batch(
        &mut model,
        (0..40)
            .map(|id| {
                serde_json::json!({"id": id, "region": region(id), "qty": id, "v": format!("v{id}"), "note": format!("n{id}")})
            })
            .collect(),
        &[],
    );
    let log = lake.path().join("fsu.log");
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    let landed = |produced: &[Produced], what: &str| {
        let target = end_offset_sum(produced);
        let (lake, table, log) = (&lake, &table, &log);
        let what = what.to_string();
        async move {
            if !wait_table_committed(lake, table, target, Duration::from_secs(120)).await {
                let problems: Vec<_> = log_events(log)
                    .into_iter()
                    .filter(|e| e["level"] != "INFO")
                    .collect();
                panic!("{what} did not land: {problems:?}");
            }
        }
    };
    let mut produced = produce(&broker.bootstrap, &topic, &first).await;
    landed(&produced, "the first batch").await;

    // While inlet runs, another engine adds, renames, drops and widens columns, and upstream
    // follows: later changes name the columns as the table now does.
    foreign_writer(&lake, &table, &["add-column", "extra", "string"]);
    foreign_writer(&lake, &table, &["rename-column", "v", "v_text"]);
    foreign_writer(&lake, &table, &["drop-column", "note"]);
    foreign_writer(&lake, &table, &["widen-column", "qty", "long"]);
    for row in model.values_mut() {
        let obj = row.as_object_mut().unwrap();
        let v = obj.remove("v").unwrap();
        obj.insert("v_text".into(), v);
        obj.remove("note");
    }
    let second = batch(
        &mut model,
        (0..40)
            .step_by(2)
            .map(|id| {
                serde_json::json!({"id": id, "region": region(id + 1), "qty": id * 10, "v_text": format!("w{id}"), "extra": format!("e{id}")})
            })
            .collect(),
        &[5, 7],
    );
    produced.extend(produce(&broker.bootstrap, &topic, &second).await);
    landed(&produced, "the second batch").await;
    // Then values only the widened column holds, and a field inlet adds itself.
    let third = batch(
        &mut model,
        (0..40)
            .step_by(3)
            .filter(|id| ![5, 7].contains(id))
            .map(|id| {
                serde_json::json!({"id": id, "region": region(id), "qty": 5_000_000_000i64 + id, "v_text": format!("x{id}"), "extra": null, "tag": format!("t{id}")})
            })
            .collect(),
        &[],
    );
    produced.extend(produce(&broker.bootstrap, &topic, &third).await);
    landed(&produced, "the third batch").await;
    inlet.stop_cleanly(Duration::from_secs(60));
    // The index is lost: rebuilt from files of every schema, columns found by field id (the
    // oldest files name `v`, hold `note` and an int `qty`, and lack `extra` and `tag`). Changes
    // with null fields then merge into the rebuilt rows under partial-update.
    std::fs::remove_dir_all(lake.path().join("index")).unwrap();
    let fourth = batch(
        &mut model,
        (0..40)
            .filter(|id| ![5, 7].contains(id) && id % 5 != 4)
            .map(|id| {
                serde_json::json!({"id": id, "region": region(id), "qty": null, "v_text": format!("y{id}"), "extra": null, "tag": null})
            })
            .collect(),
        &[],
    );
    produced.extend(produce(&broker.bootstrap, &topic, &fourth).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    assert_eq!(
        count_messages(&events, "Index rebuilt from the table"),
        2,
        "{:?}",
        index_events(&events)
    );

    let t = lake.table("test", &table).await.unwrap();
    let current = t.metadata.current_schema().unwrap();
    let names: Vec<&str> = current.fields.iter().map(|f| f.name.as_str()).collect();
    for kept in ["extra", "v_text", "tag", "_version"] {
        assert!(names.contains(&kept), "{kept} missing from {names:?}");
    }
    for gone in ["v", "note"] {
        assert!(!names.contains(&gone), "{gone} came back: {names:?}");
    }
    let qty = current.fields.iter().find(|f| f.name == "qty").unwrap();
    assert_eq!(qty.ty.to_string(), "\"long\"", "qty was narrowed again");
    let mut by_id: BTreeMap<i32, String> = BTreeMap::new();
    for schema in &t.metadata.schemas {
        for f in &schema.fields {
            let ty = f.ty.to_string();
            let seen = by_id.entry(f.id).or_insert(ty.clone());
            // The only change of type a field may see is a promotion.
            let promoted = seen == "\"int\"" && ty == "\"long\"";
            assert!(
                *seen == ty || promoted,
                "field id {} is {seen} and {ty}",
                f.id
            );
            if promoted {
                *seen = ty;
            }
        }
    }
    let ids: BTreeSet<i32> = current.fields.iter().map(|f| f.id).collect();
    assert_eq!(
        ids.len(),
        current.fields.len(),
        "duplicate field ids: {names:?}"
    );

    let got = lake.rows_by_id(&table, |r| {
        serde_json::json!({
            "region": r["region"], "qty": r["qty"], "v_text": r["v_text"],
            "extra": r["extra"], "tag": r["tag"],
        })
    });
    let want: BTreeMap<i64, serde_json::Value> = model
        .iter()
        .map(|(id, r)| {
            let field = |name: &str| r.get(name).cloned().unwrap_or(serde_json::Value::Null);
            (
                *id,
                serde_json::json!({
                    "region": field("region"), "qty": field("qty"), "v_text": field("v_text"),
                    "extra": field("extra"), "tag": field("tag"),
                }),
            )
        })
        .collect();
    assert_eq!(got, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_live_twice_is_repaired_by_the_next_checkpoint_after_a_rebuild() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("dup", 1).await;
    let yaml = "  mode: upsert\n  primary_key: [id]\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: region, type: string}\n    - {name: v, type: string}\n";
    let config = custom_config(&lake, &topic, &table, yaml, 1_000, "");
    let mut produced = produce(
        &broker.bootstrap,
        &topic,
        &[change(1, "c", 100, "eu"), change(2, "c", 110, "eu")],
    )
    .await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // Another engine inserts an older row of key 1: the key is live twice.
    let old = inlet::version::encode_version(&inlet::decode::Version(vec![
        inlet::decode::VersionPart::Int(50),
    ]));
    let hex: String = old.iter().map(|b| format!("{b:02x}")).collect();
    foreign_writer(
        &lake,
        &table,
        &[
            "append-json",
            &format!(r#"[{{"id": 1, "region": "eu", "v": "stale", "_version": "{hex}"}}]"#),
        ],
    );
    let count = |lake: &Lake| {
        let read = lake.read(&table);
        let mut ids: Vec<(i64, String)> = read_rows(&read)
            .iter()
            .map(|r| {
                (
                    r["id"].as_i64().unwrap(),
                    r["v"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(count(&lake).len(), 3);
    std::fs::remove_dir_all(lake.path().join("index")).unwrap();
    produced.extend(produce(&broker.bootstrap, &topic, &[change(3, "c", 120, "eu")]).await);
    let (events, scraped) = run_to_end_scraped(&lake, &config, &table, &produced).await;
    assert!(
        events.iter().any(|e| e["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("Keys are live twice"))),
        "{:?}",
        index_events(&events)
    );
    assert_eq!(
        metric(&scraped, "inlet_index_duplicate_keys_repaired_total"),
        1.0,
        "{scraped}"
    );
    assert_eq!(
        count(&lake),
        vec![
            (1, "at 100".to_string()),
            (2, "at 110".to_string()),
            (3, "at 120".to_string())
        ]
    );
}

/// A Debezium MySQL change of key `id` at binlog `file` index and position `pos`.
fn mysql_change(id: i64, file: u32, pos: i64, v: &str) -> Record {
    let payload = serde_json::json!({
        "before": null, "after": {"id": id, "region": "eu", "v": v}, "op": "c", "ts_ms": 1,
        "source": {"connector": "mysql", "file": format!("mysql-bin.{file:06}"), "pos": pos, "row": 0, "ts_ms": 1},
    });
    (0, format!("{{\"id\":{id}}}"), Some(payload.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positions_that_go_backwards_are_counted_and_logged_and_offsets_order_instead() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("reset", 1).await;
    let yaml = "  mode: upsert\n  primary_key: [id]\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: region, type: string}\n    - {name: v, type: string}\n";
    let port = free_port();
    let config = custom_config(&lake, &topic, &table, yaml, 100_000, "");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("listen: \"\"", &format!("listen: \"127.0.0.1:{port}\""));
    std::fs::write(&config, text).unwrap();
    // Before the failover: binlog file 7, positions rising.
    let before: Vec<_> = (0..1500)
        .map(|n| mysql_change(n % 100, 7, 1_000 + n * 10, &format!("old {n}")))
        .collect();
    let mut produced = produce(&broker.bootstrap, &topic, &before).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // After a failover without preserved positions the binlog restarts at file 1: every change
    // looks older than what the table holds.
    let after: Vec<_> = (0..1500)
        .map(|n| mysql_change(n % 100, 1, 100 + n * 10, &format!("new {n}")))
        .collect();
    produced.extend(produce(&broker.bootstrap, &topic, &after).await);
    let log = lake.path().join("reset.log");
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    assert!(
        caught_up(&lake, &table, &produced, 120).await,
        "inlet did not catch up"
    );
    let scraped = scrape(&format!("127.0.0.1:{port}"));
    let series = format!("inlet_index_stale_records_total{{partition=\"0\",topic=\"{topic}\"}}");
    assert!(
        metric(&scraped, &series) >= 1500.0,
        "{series} in:\n{scraped}"
    );
    inlet.stop_cleanly(Duration::from_secs(60));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("Most changes of this partition are older than what the table holds"),
        "no error logged"
    );
    let values = |lake: &Lake| {
        let read = lake.read(&table);
        read_rows(&read)
            .iter()
            .map(|r| r["v"].as_str().unwrap().to_string())
            .collect::<BTreeSet<String>>()
    };
    assert!(values(&lake).iter().all(|v| v.starts_with("old")));
    // Ordered by Kafka offset, later changes apply whatever their binlog position says.
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "  mode: upsert\n",
        "  mode: upsert\n  version_position: kafka-offset\n",
    );
    std::fs::write(&config, text).unwrap();
    let later: Vec<_> = (0..200)
        .map(|n| mysql_change(n % 100, 1, 20_000 + n * 10, &format!("later {n}")))
        .collect();
    produced.extend(produce(&broker.bootstrap, &topic, &later).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    let want: BTreeSet<String> = (100..200).map(|n| format!("later {n}")).collect();
    assert_eq!(values(&lake), want);
}

/// The shard directories of a test table's index.
fn shard_dirs(lake: &Lake, table: &str) -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<_> = std::fs::read_dir(lake.path().join("index").join(table))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    dirs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_or_torn_saved_batch_is_resolved_from_the_table() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("torn", PARTITIONS).await;
    let model = upsert_stream(83, 6_000, 500, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 400);
    let chunks = in_parts(&model.messages, 5);
    let mut produced = Vec::new();
    // Killed after a commit landed, before its saved batch was applied; or after the
    // checkpoint's files were uploaded, before its commit.
    let cases = [
        ("after_commit:3", "empty"),
        ("after_commit:3", "torn"),
        ("after_upload:3", "empty"),
        ("after_upload:3", "torn"),
    ];
    for (n, (crash, damage)) in cases.into_iter().enumerate() {
        produced.extend(produce(&broker.bootstrap, &topic, &chunks[n]).await);
        let mut inlet = Inlet::spawn(&config, &[("INLET_CRASH_AT", crash)]);
        let status = inlet.wait_exit(Duration::from_secs(120)).expect("a crash");
        assert!(!status.success());
        let mut saved = 0;
        for dir in shard_dirs(&lake, &table) {
            let batch = dir.join("pending.batch");
            let Ok(bytes) = std::fs::read(&batch) else {
                continue;
            };
            saved += 1;
            // A power loss left the file empty, or cut in the middle.
            let keep = if damage == "empty" {
                0
            } else {
                bytes.len() / 2
            };
            std::fs::write(&batch, &bytes[..keep]).unwrap();
        }
        assert!(saved > 0, "no saved batch to damage");
        let events = run_to_end_logged(&lake, &config, &table, &produced).await;
        assert!(
            count_messages(
                &events,
                "The saved index batch is unreadable; catching up from the table instead"
            ) > 0,
            "{:?}",
            index_events(&events)
        );
    }
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[4]).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 500).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_batch_built_on_another_index_is_resolved_from_the_table() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("base", PARTITIONS).await;
    let model = upsert_stream(89, 6_000, 500, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 400);
    let chunks = in_parts(&model.messages, 4);
    let index = lake.path().join("index");
    let older = lake.path().join("index-older");
    let mut produced = produce(&broker.bootstrap, &topic, &chunks[0]).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    copy_dir(&index, &older);
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[1]).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // Killed after a commit landed, before its saved batch was applied.
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[2]).await);
    let mut inlet = Inlet::spawn(&config, &[("INLET_CRASH_AT", "after_commit:3")]);
    let status = inlet.wait_exit(Duration::from_secs(120)).expect("a crash");
    assert!(!status.success());
    // The indexes of the shards with a saved batch go back to the older copy: each batch was
    // built on a later state of its index, and applying it would skip the snapshots between.
    let mut replaced = 0;
    for dir in shard_dirs(&lake, &table) {
        if !dir.join("pending.batch").exists() {
            continue;
        }
        replaced += 1;
        let db = dir.join("db");
        std::fs::remove_dir_all(&db).unwrap();
        let name = dir.file_name().unwrap();
        copy_dir(&older.join(&table).join(name).join("db"), &db);
    }
    assert!(replaced > 0, "no saved batch");
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[3]).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 500).await;
    assert_eq!(
        count_messages(
            &events,
            "The saved index batch was built on another state of the index; catching up from the table instead"
        ),
        replaced,
        "{:?}",
        index_events(&events)
    );
}

/// Damage done to a shard's RocksDB directory.
type Damage = fn(&std::path::Path);

/// A model row: region, amount, created_at in seconds.
type ModelRow = (Option<String>, String, i64);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_index_is_moved_aside_and_rebuilt() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("dmg", PARTITIONS).await;
    let model = upsert_stream(89, 8_000, 500, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 500);
    let chunks = in_parts(&model.messages, 5);
    // Two runs: the second opens the index and flushes its log into table files.
    let mut produced = produce(&broker.bootstrap, &topic, &chunks[0]).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    produced.extend(produce(&broker.bootstrap, &topic, &chunks[1]).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;

    let damages: [(&str, Damage); 3] = [
        ("a CURRENT file naming no manifest", |db| {
            std::fs::write(db.join("CURRENT"), "MANIFEST-999999\n").unwrap()
        }),
        ("a MANIFEST cut in half", |db| {
            for e in std::fs::read_dir(db).unwrap() {
                let path = e.unwrap().path();
                if path
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("MANIFEST-")
                {
                    let bytes = std::fs::read(&path).unwrap();
                    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
                }
            }
        }),
        ("table files with flipped bytes", |db| {
            for e in std::fs::read_dir(db).unwrap() {
                let path = e.unwrap().path();
                if path.extension().is_some_and(|x| x == "sst") {
                    let mut bytes = std::fs::read(&path).unwrap();
                    for b in bytes.iter_mut().skip(64).step_by(97).take(64) {
                        *b ^= 0x5A;
                    }
                    std::fs::write(&path, bytes).unwrap();
                }
            }
        }),
    ];
    for (n, (what, damage)) in damages.iter().enumerate() {
        for dir in shard_dirs(&lake, &table) {
            damage(&dir.join("db"));
        }
        produced.extend(produce(&broker.bootstrap, &topic, &chunks[n + 2]).await);
        let (events, scraped) = run_to_end_scraped(&lake, &config, &table, &produced).await;
        let aside = shard_dirs(&lake, &table)
            .iter()
            .filter(|d| {
                std::fs::read_dir(d).unwrap().any(|e| {
                    e.unwrap()
                        .file_name()
                        .to_string_lossy()
                        .starts_with("db.damaged-")
                })
            })
            .count();
        let damaged = count_messages(
            &events,
            "The key index is damaged; moving it aside and rebuilding it from the table",
        );
        let rebuilt = count_messages(&events, "Index rebuilt from the table");
        assert!(
            damaged > 0 && aside >= damaged && rebuilt >= damaged,
            "{what}: damaged {damaged}, moved aside {aside}, rebuilt {rebuilt}: {:?}",
            index_events(&events)
        );
        assert_eq!(
            metric(&scraped, "inlet_index_damaged_total"),
            damaged as f64,
            "{what}: damaged shards counted"
        );
        assert_matches_model_so_far(&lake, &table, &produced).await;
    }
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 500).await;
}

/// Compares the table with the state the produced messages imply so far (the model stream's
/// re-sends are never newer than what the key holds, so replaying in LSN order is the model).
async fn assert_matches_model_so_far(lake: &Lake, table: &str, produced: &[Produced]) {
    // Per key: the newest LSN, and its row unless that change deleted it.
    let mut newest: BTreeMap<i64, (i64, Option<ModelRow>)> = BTreeMap::new();
    for p in produced {
        let Some(payload) = payload(p) else { continue };
        let lsn = payload["source"]["lsn"].as_i64().unwrap();
        let (id, row) = if payload["op"] == "d" {
            (payload["before"]["id"].as_i64().unwrap(), None)
        } else {
            let after = &payload["after"];
            (after["id"].as_i64().unwrap(), Some(expected_row(after)))
        };
        if newest.get(&id).is_none_or(|(at, _)| *at < lsn) {
            newest.insert(id, (lsn, row));
        }
    }
    let live = newest
        .into_iter()
        .filter_map(|(id, (_, row))| row.map(|r| (id, r)))
        .collect();
    assert_matches(lake, table, &live, None).await;
}

/// A Debezium change of key `id` whose `shelf` (the partition column) the message's schema
/// declares as `shelf_type` (`int32` or `int64`).
fn shelf_change(id: i64, op: &str, lsn: i64, shelf: i64, shelf_type: &str) -> Record {
    let fields = serde_json::json!([
        {"type": "int64", "optional": false, "field": "id"},
        {"type": shelf_type, "optional": true, "field": "shelf"},
        {"type": "string", "optional": true, "field": "v"},
    ]);
    let schema = serde_json::json!({"type": "struct", "optional": false, "fields": [
        {"type": "struct", "optional": true, "field": "before", "fields": fields},
        {"type": "struct", "optional": true, "field": "after", "fields": fields},
        {"type": "struct", "optional": false, "field": "source", "fields": [
            {"type": "int64", "optional": true, "field": "lsn"}]},
        {"type": "string", "optional": false, "field": "op"},
    ]});
    let row = serde_json::json!({"id": id, "shelf": shelf, "v": format!("at {lsn}")});
    let (before, after) = match op {
        "d" => (row, serde_json::Value::Null),
        _ => (serde_json::Value::Null, row),
    };
    let payload = serde_json::json!({
        "before": before, "after": after, "op": op, "source": {"lsn": lsn},
    });
    let doc = serde_json::json!({"schema": schema, "payload": payload});
    (0, format!("{{\"id\":{id}}}"), Some(doc.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_column_widened_from_int_to_long_keeps_working() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("widen", 1).await;
    let yaml = "  mode: upsert\n  primary_key: [id]\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: shelf, type: int}\n    - {name: v, type: string}\n  partition_by:\n    - {column: shelf}\n    - {column: shelf, transform: \"truncate[10]\"}\n";
    let config = custom_config(&lake, &topic, &table, yaml, 1_000, "");
    let first: Vec<_> = (0..20)
        .map(|id| shelf_change(id, "c", 100 + id, id % 3, "int32"))
        .collect();
    let mut produced = produce(&broker.bootstrap, &topic, &first).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // The source widens the column; later changes update rows in their old partitions, move
    // some to new ones, and delete others.
    let mut second = Vec::new();
    for id in 0..20 {
        let lsn = 1_000 + id;
        second.push(match id % 4 {
            0 => shelf_change(id, "u", lsn, id % 3, "int64"),
            1 => shelf_change(id, "u", lsn, 5_000_000_000 + id, "int64"),
            2 => shelf_change(id, "d", lsn, id % 3, "int64"),
            _ => continue,
        });
    }
    second.push(shelf_change(99, "c", 2_000, 7_000_000_000, "int64"));
    produced.extend(produce(&broker.bootstrap, &topic, &second).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;

    let read = lake.read(&table);
    let got = keyed_rows(&read, |r| {
        (
            r["shelf"].as_i64().unwrap(),
            r["v"].as_str().unwrap().to_string(),
        )
    });
    let mut want = BTreeMap::new();
    for id in 0..20 {
        match id % 4 {
            0 => want.insert(id, (id % 3, format!("at {}", 1_000 + id))),
            1 => want.insert(id, (5_000_000_000 + id, format!("at {}", 1_000 + id))),
            2 => None,
            _ => want.insert(id, (id % 3, format!("at {}", 100 + id))),
        };
    }
    want.insert(99, (7_000_000_000, "at 2000".into()));
    assert_eq!(got, want);
    let types: BTreeMap<String, String> = read["schema"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["name"].as_str().unwrap().to_string(),
                f["type"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(types["shelf"], "long");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_rebuild_keeps_the_consumer_in_its_group() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("slow", 2).await;
    let model = upsert_stream(97, 3_000, 300, 2);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 500);
    without_index_copies(&config);
    // A member that does not poll for max.poll.interval.ms is evicted from its group.
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "    heartbeat.interval.ms: \"500\"\n",
        "    heartbeat.interval.ms: \"500\"\n    max.poll.interval.ms: \"7000\"\n",
    );
    std::fs::write(&config, text).unwrap();
    let (first, second) = model.messages.split_at(model.messages.len() / 2);
    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    std::fs::remove_dir_all(lake.path().join("index")).unwrap();
    produced.extend(produce(&broker.bootstrap, &topic, second).await);
    // Each shard's rebuild takes longer than max.poll.interval.ms.
    let log = lake.path().join("slow.log");
    let inlet = Inlet::spawn_logged(&config, &[("INLET_DELAY_AT", "recovery:9000")], &log);
    assert!(
        caught_up(&lake, &table, &produced, 180).await,
        "inlet did not catch up"
    );
    let mut inlet = inlet;
    inlet.stop_cleanly(Duration::from_secs(60));
    let events: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(
        count_messages(&events, "Index rebuilt from the table"),
        2,
        "{:?}",
        index_events(&events)
    );
    let assignments = events
        .iter()
        .filter(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("Partitions assigned"))
        })
        .count();
    assert_eq!(assignments, 1, "the group rebalanced during the rebuild");
    assert_matches_model(&lake, &table, &model).await;
}

/// SIGTERM while a shard's index is being rebuilt: the process exits 0 at once (within the 5 s
/// a pod's shutdown allows for it), and the next run rebuilds and ends in the exact table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_an_index_rebuild_exits_0_at_once() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("termrb", 2).await;
    let model = upsert_stream(98, 2_000, 300, 2);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 500);
    without_index_copies(&config);
    let (first, second) = model.messages.split_at(model.messages.len() / 2);
    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    std::fs::remove_dir_all(lake.path().join("index")).unwrap();
    produced.extend(produce(&broker.bootstrap, &topic, second).await);

    let log = lake.path().join("term.log");
    let mut inlet = Inlet::spawn_logged(&config, &[("INLET_DELAY_AT", "recovery:60000")], &log);
    wait_for(Duration::from_secs(60), || {
        events_with(&log, "Partitions assigned").pop()
    })
    .expect("the partitions are assigned and their recovery starts");
    std::thread::sleep(Duration::from_secs(1));
    let asked = Instant::now();
    inlet.stop_cleanly(Duration::from_secs(30));
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "the exit took {:?}",
        asked.elapsed()
    );
    assert_eq!(
        count_messages(&log_events(&log), "Index rebuilt from the table"),
        0,
        "the rebuild was not interrupted"
    );

    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_matches_model(&lake, &table, &model).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_keep_ref_settings_and_move_forward_and_name_delete_only_commits() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("spec", 1).await;
    let yaml = "  mode: upsert\n  primary_key: [id]\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: region, type: string}\n    - {name: v, type: string}\n";
    let config = custom_config(&lake, &topic, &table, yaml, 1_000, "");
    let mut produced = produce(
        &broker.bootstrap,
        &topic,
        &[change(1, "c", 100, "eu"), change(2, "c", 110, "eu")],
    )
    .await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // Another engine set a retention on `main`, and its clock runs an hour ahead.
    let ahead = chrono::Utc::now().timestamp_millis() + 3_600_000;
    let mut t = lake.table("test", &table).await.unwrap();
    let mut next = t.metadata.clone();
    next.refs
        .get_mut("main")
        .unwrap()
        .extra
        .insert("max-snapshot-age-ms".into(), serde_json::json!(86_400_000));
    next.last_updated_ms = ahead;
    assert!(t.try_commit(next).await.unwrap());
    // Deletes only.
    produced.extend(
        produce(
            &broker.bootstrap,
            &topic,
            &[change(1, "d", 200, "eu"), tombstone(1)],
        )
        .await,
    );
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    let t = lake.table("test", &table).await.unwrap();
    let main = &t.metadata.refs["main"];
    assert_eq!(main.extra["max-snapshot-age-ms"], 86_400_000, "{main:?}");
    let head = t.metadata.current_snapshot().unwrap();
    assert_eq!(main.snapshot_id, head.snapshot_id);
    // The checkpoint's own snapshot: a compaction's `replace` may follow it.
    let checkpoint = t
        .metadata
        .snapshots
        .iter()
        .filter(|s| s.summary["operation"] != "replace")
        .max_by_key(|s| s.sequence_number)
        .unwrap();
    assert_eq!(checkpoint.summary["operation"], "delete");
    assert!(
        head.timestamp_ms > ahead,
        "the snapshot is older than the table's last update"
    );
    assert!(t.metadata.last_updated_ms >= head.timestamp_ms);
    let log: Vec<i64> = t
        .metadata
        .snapshot_log
        .iter()
        .map(|e| e.timestamp_ms)
        .collect();
    assert!(
        log.windows(2).all(|w| w[0] < w[1]),
        "snapshot log goes backwards: {log:?}"
    );
    let read = lake.read(&table);
    assert_eq!(read["identifier_field_ids"], serde_json::json!([1]));
}

/// Inline compaction forced after every checkpoint (any deleted row or a second delete file
/// rewrites a file; small files pack): crashes at every compaction step, then the table equals
/// the model, the index equals a rebuild, no delete names a removed file, and no data file
/// keeps many delete files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_forced_often_keeps_the_table_and_index_exact_through_crashes() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("cmp", PARTITIONS).await;
    let model = upsert_stream(37, 12_000, 600, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 300);
    let mut yaml = std::fs::read_to_string(&config).unwrap();
    // A budget that never runs out, so the bound below measures what compaction keeps, not how
    // fast this machine rewrites (a fifth of the 300 ms interval fits a rewrite or two here;
    // the budget has a test of its own below).
    yaml.push_str(
        "services:\n  compact: true\n  compact_every_checkpoints: 1\n  compact_delete_ratio: 0.01\n  compact_max_delete_files: 2\n  compact_budget_ms: 600000\n",
    );
    std::fs::write(&config, yaml).unwrap();
    let steps = inlet::maintain::compact::STEPS;
    let chunks = in_parts(&model.messages, steps.len() + 2);
    let mut produced = Vec::new();
    let (mut most, mut seen) = ((0, 0), HashSet::new());
    for (i, step) in steps.iter().enumerate() {
        produced.extend(produce(&broker.bootstrap, &topic, &chunks[i]).await);
        let mut inlet = lake.spawn(&config, &[("INLET_CRASH_AT", &format!("{step}:2"))]);
        let status = inlet
            .wait_exit(Duration::from_secs(120))
            .unwrap_or_else(|| panic!("no crash at {step}"));
        assert!(!status.success(), "inlet should have crashed at {step}");
        // The restart recovers and commits the rest of the chunk, compacting as it goes.
        run_to_end(&lake, &config, &table, &produced, &[]).await;
        assert_matches_model_so_far(&lake, &table, &produced).await;
        most = most_files_after_compactions(&lake, &table, most, &mut seen).await;
    }
    for chunk in &chunks[steps.len()..] {
        produced.extend(produce(&broker.bootstrap, &topic, chunk).await);
        run_to_end(&lake, &config, &table, &produced, &[]).await;
        assert_matches_model_so_far(&lake, &table, &produced).await;
        most = most_files_after_compactions(&lake, &table, most, &mut seen).await;
    }
    // Without compaction a busy bucket gathers a data file and a delete file per checkpoint
    // (this stream commits some forty).
    assert!(seen.len() >= 5, "compactions measured: {}", seen.len());
    assert!(
        most.0 <= 4 && most.1 <= 4,
        "live data and delete files of one partition and bucket: {most:?}"
    );
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 600).await;

    let t = lake.table("test", &table).await.unwrap();
    let replaces = t
        .metadata
        .snapshots
        .iter()
        .filter(|s| s.summary.get("operation").map(String::as_str) == Some("replace"))
        .count();
    assert!(replaces > 0, "nothing was compacted");
    let per_file = delete_files_per_data_file(&t).await;
    assert!(
        per_file.values().all(|n| *n <= 2),
        "delete files per data file: {per_file:?}"
    );
}

/// How many live delete files name each data file; panics if one names a removed file.
async fn delete_files_per_data_file(t: &inlet::table::Table) -> BTreeMap<String, usize> {
    let entries = t.live_entries().await.unwrap();
    let data: HashSet<&str> = entries
        .iter()
        .filter(|e| e.data_file.content == FileContent::Data)
        .map(|e| e.data_file.file_path.as_str())
        .collect();
    let mut per_file: BTreeMap<String, usize> = BTreeMap::new();
    for e in entries
        .iter()
        .filter(|e| e.data_file.content == FileContent::PositionDeletes)
    {
        let named: HashSet<String> = deleted_rows(t, &e.data_file)
            .await
            .into_iter()
            .map(|(path, _)| path)
            .collect();
        for target in named {
            assert!(
                data.contains(target.as_str()),
                "a delete names removed {target}"
            );
            *per_file.entry(target).or_default() += 1;
        }
    }
    per_file
}

/// The (data file, position) rows of position-delete file `f`.
async fn deleted_rows(
    t: &inlet::table::Table,
    f: &inlet::table::manifest::DataFile,
) -> Vec<(String, i64)> {
    inlet::table::scan::read_position_deletes(t.io.get(&f.file_path).await.unwrap())
        .unwrap()
        .iter()
        .flat_map(|d| d.rows().map(|(pos, _)| (d.path.clone(), pos)))
        .collect()
}

/// The most live data files and delete files any one partition and bucket directory held
/// right after a compaction, over the table's compaction snapshots not in `seen` yet, and
/// `so_far`. (A run's last checkpoint may stay uncompacted: a shutdown leaves compaction to
/// the next start.)
async fn most_files_after_compactions(
    lake: &Lake,
    table: &str,
    so_far: (usize, usize),
    seen: &mut HashSet<i64>,
) -> (usize, usize) {
    let t = lake.table("test", table).await.unwrap();
    let mut most = so_far;
    for snapshot in &t.metadata.snapshots {
        if snapshot.summary.get("operation").map(String::as_str) != Some("replace")
            || !seen.insert(snapshot.snapshot_id)
        {
            continue;
        }
        let mut per_dir: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        let dir_of = |path: &str| path.rsplit_once('/').unwrap().0.to_string();
        for e in t.entries_of(snapshot, |_| true).await.unwrap() {
            let f = &e.data_file;
            match f.content {
                FileContent::Data => per_dir.entry(dir_of(&f.file_path)).or_default().0 += 1,
                // A delete file counts in every directory whose files it names.
                _ => {
                    for dir in deleted_rows(&t, f)
                        .await
                        .into_iter()
                        .map(|(path, _)| dir_of(&path))
                        .collect::<HashSet<_>>()
                    {
                        per_dir.entry(dir).or_default().1 += 1;
                    }
                }
            }
        }
        let data = per_dir.values().map(|n| n.0).max().unwrap_or(0);
        let deletes = per_dir.values().map(|n| n.1).max().unwrap_or(0);
        most = (most.0.max(data), most.1.max(deletes));
    }
    most
}

/// A shutdown commits what is buffered and leaves: the compaction due after that commit waits
/// for the next start, so SIGTERM never waits for a rewrite (nor fails in one the process
/// leaves behind). The next run compacts, and the table equals the model throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_commits_what_is_buffered_and_leaves_compaction_to_the_next_start() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("cstop", PARTITIONS).await;
    let model = upsert_stream(47, 4_000, 200, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 300);
    let mut yaml = std::fs::read_to_string(&config).unwrap();
    // Checkpoints by count only, so the last 100 records stay buffered until the shutdown.
    yaml = yaml.replace("interval_ms: 1000", "interval_ms: 600000");
    yaml.push_str(
        "services:\n  compact: true\n  compact_every_checkpoints: 1\n  compact_delete_ratio: 0.01\n  compact_max_delete_files: 1\n  compact_budget_ms: 600000\n",
    );
    std::fs::write(&config, yaml).unwrap();
    let (first, rest) = model.messages.split_at(3_100);
    let produced = produce(&broker.bootstrap, &topic, first).await;
    let log = lake.path().join("stop.log");
    let env = lake.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut inlet = Inlet::spawn_logged(&config, &env, &log);
    assert_committed(
        &lake,
        &table,
        3_000,
        Duration::from_secs(240),
        "inlet did not commit its checkpoints",
    )
    .await;
    assert!(
        wait_for(Duration::from_secs(60), || {
            (!events_with(&log, "Compacted").is_empty()).then_some(())
        })
        .is_some(),
        "nothing was compacted while running"
    );
    // The last 100 records are read (and buffered) well within a second.
    tokio::time::sleep(Duration::from_secs(2)).await;
    inlet.stop_cleanly(Duration::from_secs(60));
    let events = log_events(&log);
    let stop = events
        .iter()
        .position(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("Shutting down"))
        })
        .expect("no shutdown logged");
    let after: Vec<&serde_json::Value> = events[stop..]
        .iter()
        .filter(|e| e["fields"]["message"] == "Compacted")
        .collect();
    assert!(after.is_empty(), "compacted while shutting down: {after:?}");
    assert_eq!(
        lake.committed_total("test", &table, &table).await,
        3_100,
        "the shutdown commits what was buffered"
    );
    assert_matches_model_so_far(&lake, &table, &produced).await;

    let mut produced = produced;
    produced.extend(produce(&broker.bootstrap, &topic, rest).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    assert!(
        events.iter().any(|e| e["fields"]["message"] == "Compacted"),
        "the next start compacts"
    );
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 200).await;
}

/// Compaction runs beside consumption: records are read and applied while it rewrites files
/// and commits (held here for a second and a half after each commit), and a crash right after
/// a compaction's commit, with the next checkpoint's records applied to the shards, keeps the
/// table and the index exact. The rows of keys changed meanwhile are deleted where the
/// compaction moved them: no checkpoint names a file it removed, so the pipeline never fails
/// and restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_flow_while_a_compaction_runs_and_a_crash_after_its_commit_keeps_the_table_exact() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("cbg", PARTITIONS).await;
    let model = upsert_stream(53, 6_000, 500, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 400);
    let mut yaml = std::fs::read_to_string(&config).unwrap();
    yaml.push_str(
        "services:\n  compact: true\n  compact_every_checkpoints: 1\n  compact_delete_ratio: 0.01\n  compact_max_delete_files: 1\n  compact_budget_ms: 600000\n",
    );
    std::fs::write(&config, yaml).unwrap();
    let produced = produce(&broker.bootstrap, &topic, &model.messages).await;
    let log = lake.path().join("beside.log");
    let mut env = lake.env();
    env.push(("INLET_DELAY_AT".into(), "after_compaction:1500".into()));
    env.push(("INLET_CRASH_AT".into(), "compact_after_commit:3".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut inlet = Inlet::spawn_logged(&config, &env, &log);
    let status = inlet
        .wait_exit(Duration::from_secs(120))
        .expect("no crash after the third compaction");
    assert!(!status.success(), "inlet should have crashed");
    let landed = events_with(&log, "Compaction landed");
    assert_eq!(landed.len(), 2, "{landed:?}");
    assert!(
        landed
            .iter()
            .all(|e| e["fields"]["records_meanwhile"].as_u64() > Some(0)),
        "no records were read while a compaction ran: {landed:?}"
    );
    let failed = events_with(&log, "Pipeline failed");
    assert!(failed.is_empty(), "{failed:?}");
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    let failed: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("Pipeline failed"))
        })
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 500).await;
}

/// A compaction's time budget: with many files due and a budget of a millisecond, each run
/// rewrites its first due file and leaves the rest for later (counted as backlog), and the
/// table still equals the model. With only the byte budget (64 MiB) nothing would wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_stops_at_its_time_budget_and_leaves_the_rest_for_later() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("cbud", PARTITIONS).await;
    let model = upsert_stream(43, 6_000, 2_000, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 300);
    // Several buckets per partition, so a rewrite of one leaves files that a checkpoint's
    // delete file also names.
    let mut yaml = std::fs::read_to_string(&config)
        .unwrap()
        .replace("target_rows_per_bucket: 500", "target_rows_per_bucket: 10");
    yaml.push_str(
        "services:\n  compact: true\n  compact_every_checkpoints: 1\n  compact_delete_ratio: 0.01\n  compact_max_delete_files: 2\n  compact_budget_ms: 1\n",
    );
    std::fs::write(&config, yaml).unwrap();
    let produced = produce(&broker.bootstrap, &topic, &model.messages).await;
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    let compactions: Vec<(u64, u64)> = events
        .iter()
        .filter(|e| e["fields"]["message"] == "Compacted")
        .map(|e| {
            (
                e["fields"]["files"].as_u64().unwrap(),
                e["fields"]["backlog"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(!compactions.is_empty(), "nothing was compacted");
    assert!(
        compactions.iter().any(|(_, backlog)| *backlog > 0),
        "no run left files for later: {compactions:?}"
    );
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 2_000).await;
    // A shard's deletes of a checkpoint share one file per partition; a rewrite that leaves
    // some of the files such a file names writes their rows into a new one, so nothing names
    // a removed file.
    let t = lake.table("test", &table).await.unwrap();
    delete_files_per_data_file(&t).await;
    let mut kept = 0;
    for snapshot in t
        .metadata
        .snapshots
        .iter()
        .filter(|s| s.summary.get("operation").map(String::as_str) == Some("replace"))
    {
        let (added, _) = t.changes_of(snapshot).await.unwrap();
        kept += added
            .iter()
            .filter(|f| {
                // `sNNNNN-deletes-c…`: named by its shard, not after one data file.
                let name = f.file_path.rsplit('/').next().unwrap();
                name.get(6..16) == Some("-deletes-c")
            })
            .count();
    }
    assert!(kept > 0, "no rewrite kept another file's deletes");
}

/// While the source is idle, compaction works off what its time budget left: runs follow one
/// another after the last checkpoint until none leaves a file due, the table still equals the
/// model, and no data file is left with as many delete files as the policy allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_source_lets_compaction_work_off_its_backlog() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("cidle", PARTITIONS).await;
    let model = upsert_stream(47, 6_000, 2_000, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 300);
    let mut yaml = std::fs::read_to_string(&config)
        .unwrap()
        .replace("target_rows_per_bucket: 500", "target_rows_per_bucket: 10");
    yaml.push_str(
        "services:\n  compact: true\n  compact_every_checkpoints: 1\n  compact_delete_ratio: 0.01\n  compact_max_delete_files: 2\n  compact_budget_ms: 1\n",
    );
    std::fs::write(&config, yaml).unwrap();
    let produced = produce(&broker.bootstrap, &topic, &model.messages).await;
    let log = lake.path().join(format!("{}.log", unique("inlet")));
    let env = lake.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut inlet = Inlet::spawn_logged(&config, &env, &log);
    assert!(
        caught_up(&lake, &table, &produced, 240).await,
        "inlet did not catch up"
    );
    // After the last checkpoint: the compactions that ran, as (files, backlog).
    let after_last_checkpoint = || {
        let events: Vec<serde_json::Value> = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let last = events
            .iter()
            .rposition(|e| e["fields"]["message"] == "Checkpoint committed")
            .unwrap_or(0);
        events[last..]
            .iter()
            .filter(|e| e["fields"]["message"] == "Compacted")
            .map(|e| {
                (
                    e["fields"]["files"].as_u64().unwrap(),
                    e["fields"]["backlog"].as_u64().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(180);
    while !after_last_checkpoint()
        .iter()
        .any(|(_, backlog)| *backlog == 0)
    {
        assert!(
            Instant::now() < deadline,
            "the backlog was not worked off: {:?}",
            after_last_checkpoint()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let runs = after_last_checkpoint();
    assert!(
        runs.len() >= 2 && runs[0].1 > 0,
        "no run followed another while idle: {runs:?}"
    );
    inlet.stop_cleanly(Duration::from_secs(60));
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 2_000).await;
    let t = lake.table("test", &table).await.unwrap();
    let per_file = delete_files_per_data_file(&t).await;
    assert!(
        per_file.values().all(|n| *n < 2),
        "files still due: {per_file:?}"
    );
}

/// Shards whose partitions go quiet keep up with the pipeline's commits: their index markers
/// follow the newest snapshot, so after snapshot expiry removes the snapshots they last changed
/// in, a restart finds them current instead of rebuilding them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_shards_survive_snapshot_expiry_without_a_rebuild() {
    use inlet::index::{KeyIndex, RocksIndex};
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("idle", PARTITIONS).await;
    let model = upsert_stream(41, 6_000, 400, PARTITIONS);
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 200);
    let mut yaml = std::fs::read_to_string(&config).unwrap();
    yaml.push_str("services:\n  enabled: false\n  snapshot_min_age_ms: 0\n  snapshots_min: 1\n");
    std::fs::write(&config, yaml).unwrap();
    let (first, rest) = model.messages.split_at(model.messages.len() / 2);
    let (busy, quiet): (Vec<_>, Vec<_>) = rest.iter().cloned().partition(|m| m.0 == 0);
    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // Only partition 0 has changes for a while: the other shards idle.
    produced.extend(produce(&broker.bootstrap, &topic, &busy).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    let t = lake.table("test", &table).await.unwrap();
    let head = t.metadata.last_snapshot_of(&table).unwrap().snapshot_id;
    for p in 0..PARTITIONS {
        let dir = lake
            .path()
            .join("index")
            .join(&table)
            .join(format!("{topic}-{p}"));
        let index = RocksIndex::open(&dir.join("db"), None).unwrap();
        assert_eq!(
            index.marker().unwrap().map(|m| m.snapshot_id),
            Some(head),
            "shard {p} is behind"
        );
    }
    // Expire everything expiry may take, then the quiet partitions speak again.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inlet"))
        .args(["maintain", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    produced.extend(produce(&broker.bootstrap, &topic, &quiet).await);
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;
    assert_eq!(
        count_messages(&events, "Index rebuilt from the table"),
        0,
        "{:?}",
        index_events(&events)
    );
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 400).await;
}

/// An index copy older than compactions: taken after a run without compaction, restored after
/// one whose compactions rewrote files of every shard (partition 3's while it had no records,
/// so its offsets did not move; with a budget for one rewrite a run, each run starts with
/// another shard), it catches up by replaying the pipeline's `replace` snapshots,
/// not by a rebuild, and ends equal to a rebuild entry by entry, the table equal to the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_copy_older_than_compactions_catches_up_by_replaying_them() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("ccopy", PARTITIONS).await;
    let model = upsert_stream(59, 9_000, 600, PARTITIONS);
    let base = upsert_config(&lake, &topic, &table, "deduplicate", 300);
    let off = lake.path().join(format!("{table}-off.yaml"));
    let mut yaml = std::fs::read_to_string(&base).unwrap();
    std::fs::write(&off, format!("{yaml}services:\n  compact: false\n")).unwrap();
    // A millisecond's budget: each run rewrites only its first due file, the first of another
    // shard each time.
    yaml.push_str(
        "services:\n  compact: true\n  compact_every_checkpoints: 1\n  compact_delete_ratio: 0.01\n  compact_max_delete_files: 2\n  compact_budget_ms: 1\n",
    );
    std::fs::write(&base, yaml).unwrap();
    let third = model.messages.len() / 3;
    let first = &model.messages[..third];
    // The second part has nothing for partition 3: its shard is only compacted.
    let (second, held): (Vec<_>, Vec<_>) = model.messages[third..2 * third]
        .iter()
        .cloned()
        .partition(|m| m.0 != 3);
    let mut rest = held;
    rest.extend_from_slice(&model.messages[2 * third..]);

    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    run_to_end(&lake, &off, &table, &produced, &[]).await;
    let index_dir = lake.path().join("index");
    let stale_copy = lake.path().join("index-copy");
    copy_dir(&index_dir, &stale_copy);
    let before = lake
        .table("test", &table)
        .await
        .unwrap()
        .metadata
        .snapshots
        .len();
    produced.extend(produce(&broker.bootstrap, &topic, &second).await);
    run_to_end(&lake, &base, &table, &produced, &[]).await;
    let t = lake.table("test", &table).await.unwrap();
    let mut compacted = BTreeSet::new();
    for s in &t.metadata.snapshots[before..] {
        if s.summary.get("operation").map(String::as_str) != Some("replace") {
            continue;
        }
        let (_, removed) = t.changes_of(s).await.unwrap();
        compacted.extend(
            removed
                .iter()
                .filter_map(|f| inlet::write::file_shard(&f.file_path)),
        );
    }
    assert_eq!(
        compacted,
        (0..PARTITIONS as u32).collect(),
        "every shard has files rewritten after the copy"
    );

    std::fs::remove_dir_all(&index_dir).unwrap();
    copy_dir(&stale_copy, &index_dir);
    produced.extend(produce(&broker.bootstrap, &topic, &rest).await);
    let events = run_to_end_logged(&lake, &base, &table, &produced).await;
    for p in 0..PARTITIONS {
        let caught_up = recovery_events(&events, "Index caught up by replaying snapshots", p);
        assert!(
            caught_up.iter().any(|f| f["snapshots"].as_u64() > Some(0)),
            "partition {p} did not replay snapshots: {:?}",
            index_events(&events)
        );
    }
    assert_eq!(count_messages(&events, "Index rebuilt from the table"), 0);
    assert_matches_model(&lake, &table, &model).await;
    assert_shards_equal_a_rebuild(&lake, &table, &topic, 600).await;
}

/// An upsert pipeline started before its topic exists (Debezium creates its topics as it first
/// writes to them) waits for it: unready, naming the topic, logged once and never as an error
/// or a restart; once the topic is created its changes land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upsert_pipeline_waits_for_its_topic_to_be_created() {
    let broker = Broker::shared();
    let lake = Lake::new();
    let (topic, table) = (unique("late_up"), unique("late_up"));
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 10_000);
    let addr = format!("127.0.0.1:{}", free_port());
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("listen: \"\"", &format!("listen: \"{addr}\"")),
    )
    .unwrap();
    let log = lake.path().join("late.log");
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    wait_topic_missing(&addr, &topic);
    // Long enough for several rounds of asking the broker.
    tokio::time::sleep(Duration::from_secs(5)).await;

    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    let produced = produce(
        &broker.bootstrap,
        &topic,
        &debezium_stream(41, 300, 60, PARTITIONS),
    )
    .await;
    assert!(
        caught_up(&lake, &table, &produced, 60).await,
        "the topic was not consumed within 60 s of its creation"
    );
    wait_health(&addr, 200, &["topics: ok"], Duration::from_secs(30));
    inlet.stop_cleanly(Duration::from_secs(60));
    let events = log_events(&log);
    let loud: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["level"] == "ERROR" || e["level"] == "WARN")
        .collect();
    assert!(loud.is_empty(), "a wait for a topic is no fault: {loud:?}");
    assert_eq!(
        events_with(&log, "Configured topics do not exist").len(),
        1,
        "the missing topic is logged once"
    );
}
