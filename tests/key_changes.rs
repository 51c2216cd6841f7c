//! Updates that change a row's primary key, in every format that can carry one (Canal's and
//! Maxwell's `old`, GoldenGate's `before`, Flink's `-U`/`+U` pair), within one shard and across
//! two: the old key's row is deleted wherever it lives, the new key's written, and the table
//! read back by pyiceberg equals the model.

mod common;

use std::collections::BTreeMap;

use common::*;
use serde_json::{json, Value as Json};

/// A logical change of the upstream table `db.t` (`id` primary key, `v` text).
#[derive(Debug, Clone)]
enum Change {
    Insert(i64, String),
    Update(i64, String),
    /// The row of the first key now has the second key (and value).
    Rekey(i64, i64, String),
    Delete(i64),
}

/// A row: key and value.
type Row = (i64, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Canal,
    Maxwell,
    Ogg,
    Changelog,
}

impl Format {
    fn name(self) -> &'static str {
        match self {
            Format::Canal => "canal-json",
            Format::Maxwell => "maxwell-json",
            Format::Ogg => "ogg-json",
            Format::Changelog => "changelog-json",
        }
    }
}

/// Encodes changes as messages of `format`, each on the partition of the key it is about
/// (a rekey: the new key's, and Flink's `-U` the old key's). `pos` numbers source positions
/// across calls. `rows` holds each live key's value, for before images.
fn encode(
    format: Format,
    changes: &[Change],
    partitions: i64,
    pos: &mut i64,
    rows: &mut BTreeMap<i64, String>,
) -> Vec<Record> {
    let mut out = Vec::new();
    let part = |id: i64| (id % partitions) as i32;
    for c in changes {
        *pos += 10;
        let (kind, before, after): (&str, Option<Row>, Option<Row>) = match c {
            Change::Insert(id, v) => ("insert", None, Some((*id, v.clone()))),
            Change::Update(id, v) => (
                "update",
                Some((*id, rows[id].clone())),
                Some((*id, v.clone())),
            ),
            Change::Rekey(old, new, v) => (
                "update",
                Some((*old, rows[old].clone())),
                Some((*new, v.clone())),
            ),
            Change::Delete(id) => ("delete", Some((*id, rows[id].clone())), None),
        };
        if let Some((id, _)) = &before {
            rows.remove(id);
        }
        if let Some((id, v)) = &after {
            rows.insert(*id, v.clone());
        }
        let row = |(id, v): &(i64, String)| json!({"id": id, "v": v});
        let target = after.as_ref().or(before.as_ref()).map(|r| r.0).unwrap();
        let key = json!({"id": target}).to_string();
        match format {
            Format::Canal => {
                let (kind, data, old) = match kind {
                    "insert" => ("INSERT", after.as_ref().unwrap(), None),
                    "delete" => ("DELETE", before.as_ref().unwrap(), None),
                    _ => {
                        let (b, a) = (before.as_ref().unwrap(), after.as_ref().unwrap());
                        let mut old = serde_json::Map::new();
                        if b.0 != a.0 {
                            old.insert("id".into(), json!(b.0.to_string()));
                        }
                        if b.1 != a.1 {
                            old.insert("v".into(), json!(b.1));
                        }
                        ("UPDATE", a, Some(Json::Object(old)))
                    }
                };
                let mut doc = json!({
                    "data": [{"id": data.0.to_string(), "v": data.1}],
                    "database": "db", "table": "t", "pkNames": ["id"], "isDdl": false,
                    "mysqlType": {"id": "bigint(20)", "v": "varchar(255)"},
                    "type": kind, "es": 1_700_000_000_000i64, "ts": 1_700_000_000_000i64, "id": *pos,
                });
                if let Some(old) = old {
                    doc["old"] = json!([old]);
                }
                out.push((part(target), key, Some(doc.to_string())));
            }
            Format::Maxwell => {
                let data = after.as_ref().or(before.as_ref()).unwrap();
                let mut doc = json!({
                    "database": "db", "table": "t", "type": kind, "ts": 1_700_000_000i64,
                    "xid": *pos, "xoffset": 0, "position": format!("mysql-bin.000001:{pos}"),
                    "primary_key_columns": ["id"], "data": row(data),
                });
                if let (Some(b), Some(a)) = (&before, &after) {
                    let mut old = serde_json::Map::new();
                    if b.0 != a.0 {
                        old.insert("id".into(), json!(b.0));
                    }
                    if b.1 != a.1 {
                        old.insert("v".into(), json!(b.1));
                    }
                    doc["old"] = Json::Object(old);
                }
                out.push((part(target), key, Some(doc.to_string())));
            }
            Format::Ogg => {
                let op = match kind {
                    "insert" => "I",
                    "delete" => "D",
                    _ => "U",
                };
                let doc = json!({
                    "table": "DB.T", "op_type": op, "op_ts": "2024-01-01 00:00:00.000000",
                    "current_ts": "2024-01-01T00:00:01.000000", "pos": format!("{:020}", *pos),
                    "primary_keys": ["id"],
                    "before": before.as_ref().map(row), "after": after.as_ref().map(row),
                });
                out.push((part(target), key, Some(doc.to_string())));
            }
            Format::Changelog => match kind {
                "insert" => out.push((
                    part(target),
                    key,
                    Some(json!({"op": "+I", "data": row(after.as_ref().unwrap())}).to_string()),
                )),
                "delete" => out.push((
                    part(target),
                    key,
                    Some(json!({"op": "-D", "data": row(before.as_ref().unwrap())}).to_string()),
                )),
                _ => {
                    let (b, a) = (before.unwrap(), after.unwrap());
                    out.push((
                        part(b.0),
                        json!({"id": b.0}).to_string(),
                        Some(json!({"op": "-U", "data": row(&b)}).to_string()),
                    ));
                    out.push((
                        part(a.0),
                        key,
                        Some(json!({"op": "+U", "data": row(&a)}).to_string()),
                    ));
                }
            },
        }
    }
    out
}

/// Three phases of changes over keys `0..n`: inserts; then updates, and rekeys of some keys to
/// fresh ones (many to the other partition); then updates and deletes of the new keys, and
/// inserts. Within a phase no change depends on another partition's change of the same phase,
/// so the result does not depend on how partitions interleave.
fn phases(n: i64) -> Vec<Vec<Change>> {
    let first: Vec<Change> = (0..n)
        .map(|id| Change::Insert(id, format!("a{id}")))
        .collect();
    let mut second = Vec::new();
    let mut third = Vec::new();
    for id in 0..n {
        match id % 4 {
            0 => second.push(Change::Update(id, format!("b{id}"))),
            1 => {
                // To the same partition (with two) when id + 1000 has id's parity, else across.
                let new = 1000 + id + (id / 4) % 2;
                second.push(Change::Rekey(id, new, format!("r{id}")));
                third.push(if id % 8 == 1 {
                    Change::Update(new, format!("c{new}"))
                } else {
                    Change::Delete(new)
                });
            }
            2 => second.push(Change::Rekey(id, 2000 + id, format!("s{id}"))),
            _ => {}
        }
    }
    third.extend((n..n + 10).map(|id| Change::Insert(id, format!("n{id}"))));
    // Every partition ends with a plain change, so a trailing `-U` is always followed.
    for id in [3, 4] {
        second.push(Change::Update(id, format!("z{id}")));
        third.push(Change::Update(id, format!("y{id}")));
    }
    vec![first, second, third]
}

async fn key_changes_land(format: Format, partitions: i32) {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("rekey", partitions).await;
    let yaml = "  mode: upsert\n  primary_key: [id]\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: v, type: string}\n";
    let extra = format!("format:\n  type: {}\n", format.name());
    let config = custom_config(&lake, &topic, &table, yaml, 10_000, &extra);
    let (mut pos, mut rows) = (0, BTreeMap::new());
    let mut produced = Vec::new();
    let mut rekeys_across = 0;
    for phase in phases(40) {
        rekeys_across += phase
            .iter()
            .filter(|c| matches!(c, Change::Rekey(a, b, _) if a % partitions as i64 != b % partitions as i64))
            .count();
        let messages = encode(format, &phase, partitions as i64, &mut pos, &mut rows);
        produced.extend(produce(&broker.bootstrap, &topic, &messages).await);
        run_to_end(&lake, &config, &table, &produced, &[]).await;
    }
    if partitions > 1 {
        assert!(
            rekeys_across >= 5,
            "the stream must move keys across partitions"
        );
    }
    let got = table_rows(&lake, &table);
    let ghosts: Vec<_> = got.keys().filter(|k| !rows.contains_key(k)).collect();
    assert!(
        ghosts.is_empty(),
        "{format:?}: old keys left behind: {ghosts:?}"
    );
    assert_eq!(got, rows, "{format:?} with {partitions} partitions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canal_key_changes_within_one_shard_and_across_two() {
    key_changes_land(Format::Canal, 1).await;
    key_changes_land(Format::Canal, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maxwell_key_changes_within_one_shard_and_across_two() {
    key_changes_land(Format::Maxwell, 1).await;
    key_changes_land(Format::Maxwell, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goldengate_key_changes_within_one_shard_and_across_two() {
    key_changes_land(Format::Ogg, 1).await;
    key_changes_land(Format::Ogg, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changelog_json_key_changes_within_one_shard_and_across_two() {
    key_changes_land(Format::Changelog, 1).await;
    key_changes_land(Format::Changelog, 2).await;
}

/// An update moves key 1 to key 1002 (another partition) while the partition of key 1 lags:
/// the old key's insert reaches inlet only after the update.
async fn old_key_arrives_late(format: Format) -> (Lake, String, BTreeMap<i64, String>) {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("late", 2).await;
    let yaml = "  mode: upsert\n  primary_key: [id]\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: v, type: string}\n";
    let extra = format!("format:\n  type: {}\n", format.name());
    let config = custom_config(&lake, &topic, &table, yaml, 10_000, &extra);
    let (mut pos, mut rows) = (0, BTreeMap::new());
    let insert = encode(
        format,
        &[Change::Insert(1, "a1".into())],
        2,
        &mut pos,
        &mut rows,
    );
    let rekey = encode(
        format,
        &[Change::Rekey(1, 1002, "r1".into())],
        2,
        &mut pos,
        &mut rows,
    );
    let mut produced = produce(&broker.bootstrap, &topic, &rekey).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    produced.extend(produce(&broker.bootstrap, &topic, &insert).await);
    let mut inlet = Inlet::spawn(&config, &[]);
    let target = end_offset_sum(&produced);
    let committed =
        wait_table_committed(&lake, &table, target, std::time::Duration::from_secs(60)).await;
    inlet.sigterm();
    inlet.wait_exit(std::time::Duration::from_secs(30));
    assert!(committed, "inlet did not catch up");
    (lake, table, rows)
}

fn table_rows(lake: &Lake, table: &str) -> BTreeMap<i64, String> {
    lake.rows_by_id(table, |r| r["v"].as_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_change_before_the_old_keys_late_insert_leaves_no_ghost() {
    for format in [Format::Maxwell, Format::Ogg] {
        let (lake, table, rows) = old_key_arrives_late(format).await;
        assert_eq!(table_rows(&lake, &table), rows, "{format:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_change_whose_old_key_cannot_be_ordered_follows_the_errors_policy() {
    use rdkafka::message::Message;
    // Canal carries no source position: an old key no partition holds yet may still have its
    // insert on the way, and nothing would order that insert before the update. Under
    // `dead-letter` the update goes to the dead-letter topic with its reason, counted, and
    // neither key is live.
    let broker = Broker::shared();
    let lake = Lake::new();
    let (topic, dlq, table, config) = canal_to_dead_letters(broker, &lake, "unord").await;
    let (mut pos, mut rows) = (0, BTreeMap::new());
    // Key 1's insert is encoded (for the update's before image) but never sent.
    encode(
        Format::Canal,
        &[Change::Insert(1, "a1".into())],
        2,
        &mut pos,
        &mut rows,
    );
    let mut messages = encode(
        Format::Canal,
        &[Change::Rekey(1, 1002, "r1".into())],
        2,
        &mut pos,
        &mut rows,
    );
    // A change of another key after it, so the checkpoint has a table to commit to.
    messages.extend(encode(
        Format::Canal,
        &[Change::Insert(7, "a7".into())],
        2,
        &mut pos,
        &mut rows,
    ));
    let produced = produce(&broker.bootstrap, &topic, &messages).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let config_text = std::fs::read_to_string(&config).unwrap().replace(
        "metrics:\n  listen: \"\"\n",
        &format!("metrics:\n  listen: \"{addr}\"\n"),
    );
    std::fs::write(&config, config_text).unwrap();
    let mut inlet = Inlet::spawn(&config, &[]);
    assert!(
        caught_up(&lake, &table, &produced, 90).await,
        "the pipeline did not pass the key change"
    );
    let scraped = scrape(&addr);
    assert_eq!(
        metric(
            &scraped,
            "inlet_bad_records_total{action=\"dead_lettered\",reason=\"key_change_unordered\"}"
        ),
        1.0,
        "{scraped}"
    );
    inlet.stop_cleanly(std::time::Duration::from_secs(30));

    let letters = consume_all(&broker.bootstrap, &dlq, 1).await;
    let header = |name: &str| letter_header(&letters[0], name);
    assert_eq!(header("inlet.error.reason"), "key_change_unordered");
    assert!(
        header("inlet.error").contains("no partition holds the old key yet"),
        "{}",
        header("inlet.error")
    );
    let rekey = &produced[0];
    assert_eq!(header("inlet.source.offset"), rekey.offset.to_string());
    assert_eq!(
        letters[0]
            .payload()
            .map(|p| String::from_utf8(p.to_vec()).unwrap()),
        rekey.value
    );
    assert_eq!(
        table_rows(&lake, &table),
        BTreeMap::from([(7, "a7".to_string())])
    );
}

/// Two instances, one partition each: a key change whose old key lives in the other
/// instance's partition cannot delete that row here. Under `dead-letter` it goes to the
/// dead-letter topic with reason `key_change_unowned`, counted, instead of leaving a ghost
/// silently; the rest of the stream lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_change_whose_old_key_another_instance_owns_follows_the_errors_policy() {
    use rdkafka::message::Message;
    let broker = Broker::shared();
    let lake = Lake::new();
    let (topic, dlq, table, base) = canal_to_dead_letters(broker, &lake, "unown").await;
    let members: Vec<(std::path::PathBuf, String)> = ["a", "b"]
        .iter()
        .map(|name| member_config(&lake, &base, name))
        .collect();
    let mut inlets: Vec<Inlet> = members
        .iter()
        .map(|(config, _)| Inlet::spawn(config, &[]))
        .collect();
    let split = wait_for(std::time::Duration::from_secs(90), || {
        members
            .iter()
            .all(|(_, addr)| {
                std::net::TcpStream::connect(addr).is_ok()
                    && try_metric(&scrape(addr), "inlet_source_assigned_partitions") == Some(1.0)
            })
            .then_some(())
    });
    assert!(split.is_some(), "the members did not own a partition each");

    let (mut pos, mut rows) = (0, BTreeMap::new());
    // Key 1 lives in partition 1; its change to key 1002 arrives in partition 0.
    let messages = encode(
        Format::Canal,
        &[
            Change::Insert(1, "a1".into()),
            Change::Insert(4, "a4".into()),
        ],
        2,
        &mut pos,
        &mut rows,
    );
    let rekey = encode(
        Format::Canal,
        &[Change::Rekey(1, 1002, "r1".into())],
        2,
        &mut pos,
        &mut rows,
    );
    assert_eq!(rekey[0].0, 0);
    let first = produce(&broker.bootstrap, &topic, &messages).await;
    assert!(
        caught_up(&lake, &table, &first, 90).await,
        "the inserts did not land"
    );
    let mut produced = first;
    produced.extend(produce(&broker.bootstrap, &topic, &rekey).await);
    assert!(
        caught_up(&lake, &table, &produced, 90).await,
        "the pipeline did not pass the key change"
    );
    let counted: f64 = members
        .iter()
        .map(|(_, addr)| {
            metric(
                &scrape(addr),
                "inlet_bad_records_total{action=\"dead_lettered\",reason=\"key_change_unowned\"}",
            )
        })
        .sum();
    assert_eq!(counted, 1.0);
    for inlet in &mut inlets {
        inlet.sigterm();
    }
    for inlet in &mut inlets {
        assert!(inlet
            .wait_exit(std::time::Duration::from_secs(30))
            .is_some_and(|s| s.success()));
    }

    let letters = consume_all(&broker.bootstrap, &dlq, 1).await;
    let header = |name: &str| letter_header(&letters[0], name);
    assert_eq!(header("inlet.error.reason"), "key_change_unowned");
    assert!(
        header("inlet.error").contains("does not own"),
        "{}",
        header("inlet.error")
    );
    assert_eq!(header("inlet.source.partition"), "0");
    assert_eq!(
        letters[0]
            .payload()
            .map(|p| String::from_utf8(p.to_vec()).unwrap()),
        rekey[0].2
    );
    // The key change did not apply: the old row stays, reported, and the new key is absent.
    assert_eq!(
        table_rows(&lake, &table),
        BTreeMap::from([(1, "a1".to_string()), (4, "a4".to_string())])
    );
}

/// The values of keys `old` and `new` in every snapshot of the table, oldest first, as
/// pyiceberg reads each one.
async fn both_keys_per_snapshot(
    lake: &Lake,
    table: &str,
    old: i64,
    new: i64,
) -> Vec<[Option<String>; 2]> {
    let mut snapshots = lake.table("test", table).await.unwrap().metadata.snapshots;
    snapshots.sort_by_key(|s| s.sequence_number);
    snapshots
        .iter()
        .map(|s| {
            let read = lake.pyiceberg_at(&format!("test.{table}"), s.snapshot_id);
            let value = |id: i64| {
                read_rows(&read)
                    .iter()
                    .find(|r| r["id"] == id)
                    .map(|r| r["v"].as_str().unwrap().to_string())
            };
            [value(old), value(new)]
        })
        .collect()
}

/// A key change lands in one snapshot with the delete of its old key: read at any snapshot,
/// the row lives under exactly one of its keys from its insert on. When the old key's insert
/// and the change share a checkpoint, the old key is never live in any snapshot. Canal within
/// one shard (its changes ordered by offset), Maxwell across two (ordered by position).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_change_deletes_its_old_key_in_the_snapshot_that_adds_the_new_one() {
    for (format, partitions, shift) in [(Format::Canal, 1, 1000), (Format::Maxwell, 2, 1001)] {
        let lake = Lake::new();
        let (broker, topic, table) = topic_and_table("onesnap", partitions).await;
        let yaml = "  mode: upsert\n  primary_key: [id]\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: v, type: string}\n";
        let extra = format!("format:\n  type: {}\n", format.name());
        // The first checkpoint closes at two records, not by time.
        let config = custom_config(&lake, &topic, &table, yaml, 2, &extra);
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(
            &config,
            text.replace("interval_ms: 1000", "interval_ms: 600000"),
        )
        .unwrap();
        let (mut pos, mut rows) = (0, BTreeMap::new());
        let n = partitions as i64;
        // Key 1: its insert and its change to a new key in one checkpoint.
        let same = encode(
            format,
            &[
                Change::Insert(1, "a1".into()),
                Change::Rekey(1, 1 + shift, "r1".into()),
            ],
            n,
            &mut pos,
            &mut rows,
        );
        let mut produced = produce(&broker.bootstrap, &topic, &same).await;
        run_to_end(&lake, &config, &table, &produced, &[]).await;
        let seen = both_keys_per_snapshot(&lake, &table, 1, 1 + shift).await;
        assert!(
            seen.iter().all(|[old, _]| old.is_none()),
            "{format:?}: key 1 was live in a snapshot: {seen:?}"
        );
        assert_eq!(seen.last().unwrap()[1].as_deref(), Some("r1"), "{format:?}");
        // Key 3: inserted and committed, then changed to a new key.
        std::fs::write(&config, &text).unwrap();
        let insert = encode(
            format,
            &[Change::Insert(3, "a3".into())],
            n,
            &mut pos,
            &mut rows,
        );
        produced.extend(produce(&broker.bootstrap, &topic, &insert).await);
        run_to_end(&lake, &config, &table, &produced, &[]).await;
        let rekey = encode(
            format,
            &[Change::Rekey(3, 3 + shift, "r3".into())],
            n,
            &mut pos,
            &mut rows,
        );
        produced.extend(produce(&broker.bootstrap, &topic, &rekey).await);
        run_to_end(&lake, &config, &table, &produced, &[]).await;
        let seen = both_keys_per_snapshot(&lake, &table, 3, 3 + shift).await;
        let from = seen.iter().position(|s| s[0].is_some()).unwrap();
        for (i, s) in seen[from..].iter().enumerate() {
            assert!(
                s[0].is_some() != s[1].is_some(),
                "{format:?}: snapshot {} of {seen:?} holds the row under {} keys",
                from + i,
                if s[0].is_some() { 2 } else { 0 }
            );
        }
        assert_eq!(seen.last().unwrap()[1].as_deref(), Some("r3"), "{format:?}");
        assert_eq!(table_rows(&lake, &table), rows, "{format:?}");
    }
}

/// Canal carries no positions: a change of key 1's partition that reaches inlet after key 1
/// was moved to a key of another partition cannot be ordered by version. An update of the old
/// key cannot follow the move upstream (the key is gone until inserted again), so it is older
/// and dropped; a delete means the old key's history before the move goes on (a re-insert
/// follows, indistinguishable from a new row), so it follows the errors policy with reason
/// `key_change_unordered`; an insert is a new row under the old key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_of_a_moved_key_that_lag_behind_its_move_never_bring_it_back_silently() {
    use rdkafka::message::Message;
    let broker = Broker::shared();
    let lake = Lake::new();
    let (topic, dlq, table, config) = canal_to_dead_letters(broker, &lake, "lag").await;
    let (mut pos, mut rows) = (0, BTreeMap::new());
    // Upstream order: key 1 inserted, updated, moved to 1002; key 3 inserted, deleted,
    // inserted again, moved to 1004. Keys 1 and 3 live in partition 1, 1002 and 1004 in 0.
    let mut encoded = |c: Change| encode(Format::Canal, &[c], 2, &mut pos, &mut rows);
    let insert1 = encoded(Change::Insert(1, "a1".into()));
    let update1 = encoded(Change::Update(1, "b1".into()));
    let move1 = encoded(Change::Rekey(1, 1002, "r1".into()));
    let insert3 = encoded(Change::Insert(3, "a3".into()));
    let delete3 = encoded(Change::Delete(3));
    let reinsert3 = encoded(Change::Insert(3, "c3".into()));
    let move3 = encoded(Change::Rekey(3, 1004, "r3".into()));
    let new1 = encoded(Change::Insert(1, "n1".into()));
    drop(reinsert3);
    assert_eq!((move1[0].0, update1[0].0, delete3[0].0), (0, 1, 1));
    // Partition 1 lags: the moves arrive (and commit) before the changes that preceded them.
    let mut produced = Vec::new();
    for batch in [
        [insert1, insert3].concat(),
        [move1, move3].concat(),
        [update1, delete3].concat(),
    ] {
        produced.extend(produce(&broker.bootstrap, &topic, &batch).await);
        run_to_end(&lake, &config, &table, &produced, &[]).await;
    }
    assert_eq!(
        table_rows(&lake, &table),
        BTreeMap::from([(1002, "r1".to_string()), (1004, "r3".to_string())]),
        "a lagging change brought a moved key back"
    );
    let letters = consume_all(&broker.bootstrap, &dlq, 1).await;
    assert_eq!(
        letter_header(&letters[0], "inlet.error.reason"),
        "key_change_unordered"
    );
    assert_eq!(
        letters[0]
            .payload()
            .map(|p| String::from_utf8(p.to_vec()).unwrap()),
        produced.last().unwrap().value,
        "the lagging delete is the dead letter"
    );
    // After the move, a new row under the old key is inserted upstream.
    produced.extend(produce(&broker.bootstrap, &topic, &new1).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_eq!(
        table_rows(&lake, &table),
        BTreeMap::from([
            (1, "n1".to_string()),
            (1002, "r1".to_string()),
            (1004, "r3".to_string())
        ])
    );
}

/// A Canal topic of two partitions feeding an upsert table `id`, `v`, its bad records going to
/// a dead-letter topic of their own: (topic, dead-letter topic, table, config).
async fn canal_to_dead_letters(
    broker: &Broker,
    lake: &Lake,
    name: &str,
) -> (String, String, String, std::path::PathBuf) {
    let (topic, dlq, table) = (unique(name), unique(&format!("{name}dlq")), unique(name));
    create_topic(&broker.bootstrap, &topic, 2).await;
    create_topic(&broker.bootstrap, &dlq, 1).await;
    let yaml = "  mode: upsert\n  primary_key: [id]\n  columns:\n    - {name: id, type: long, required: true}\n    - {name: v, type: string}\n";
    let extra = format!(
        "format:\n  type: {}\nerrors:\n  policy: dead-letter\n  dead_letter_topic: {dlq}\n",
        Format::Canal.name()
    );
    let config = custom_config(lake, &topic, &table, yaml, 10_000, &extra);
    (topic, dlq, table, config)
}
