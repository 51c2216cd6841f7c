//! A whole database through one pipeline: Debezium's topic per table, matched by a pattern,
//! into routed upsert tables whose index shards follow each table's own topic. Two instances
//! share the topics, one is killed and restarted midway, and a table whose capture starts while
//! the pipeline runs is picked up without a restart; every table ends equal to its model.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::*;

/// Upstream tables and the partition count of each one's topic.
const TABLES: [(&str, i32); 3] = [("orders", 3), ("customers", 2), ("items", 1)];
/// Captured only once the pipeline runs.
const LATE: (&str, i32) = ("late", 2);

/// The model stream of one upstream table, as Debezium writes it to the table's own topic:
/// every change in the Connect envelope, naming its database, schema and table.
fn table_stream(seed: u64, table: &str, partitions: i32) -> ModelStream {
    let mut model = upsert_stream(seed, 900, 150, partitions);
    for (_, _, value) in &mut model.messages {
        let Some(text) = value else { continue };
        let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
        if v.get("schema").is_none() {
            let payload = v.take();
            v = serde_json::json!({"schema": postgres_schema(), "payload": payload});
        }
        let source = &mut v["payload"]["source"];
        source["db"] = "shop".into();
        source["schema"] = "public".into();
        source["table"] = table.into();
        *text = v.to_string();
    }
    model
}

/// One member's configuration: the same pipeline and group (the test's own, `group`), its own
/// index directory and metrics port.
fn member_config(
    lake: &Lake,
    bootstrap: &str,
    group: &str,
    pattern: &str,
    member: &str,
    port: u16,
) -> std::path::PathBuf {
    let yaml = format!(
        r#"{kafka}table:
  mode: upsert
  target_rows_per_bucket: 40
  column_types: {{created_at: timestamptz}}
  partition_by:
    - {{column: created_at, transform: day}}
    - {{column: region}}
routing:
  by: source
  namespace: test
  name: "{{table}}"
{lake_sections}index:
  dir: "{index}"
checkpoint:
  interval_ms: 1000
  max_records: 150
metrics:
  listen: "127.0.0.1:{port}"
"#,
        kafka = kafka_sections(
            "dbsync",
            group,
            bootstrap,
            &format!("topic_pattern: '{pattern}'")
        ),
        lake_sections = lake.config_sections(),
        index = lake.path().join(format!("index-{member}")).display(),
    );
    lake.write_config(member, &yaml)
}

/// Next offset per partition of `topic` the table records for the pipeline.
async fn recorded(lake: &Lake, table: &str, topic: &str) -> BTreeMap<i32, i64> {
    match lake.table("test", table).await {
        Some(t) => inlet::commit::table_offsets(&t.metadata, "dbsync")
            .unwrap()
            .remove(topic)
            .unwrap_or_default(),
        None => BTreeMap::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pattern_syncs_a_topic_per_table_through_one_pipeline_of_two_members() {
    let broker = Broker::shared();
    let lake = Lake::new();
    let prefix = unique("dbz");
    let topic = |table: &str| format!("{prefix}.shop.{table}");
    // Debezium's own topics the pattern also matches: transaction metadata, schema changes.
    let (transactions, schema_changes) = (format!("{prefix}.transaction"), prefix.clone());
    for (table, partitions) in TABLES {
        create_topic(&broker.bootstrap, &topic(table), partitions).await;
    }
    create_topic(&broker.bootstrap, &transactions, 1).await;
    create_topic(&broker.bootstrap, &schema_changes, 1).await;
    let pattern = format!("{prefix}([.].*)?");
    let mut models = BTreeMap::new();
    for (i, (table, partitions)) in TABLES.into_iter().chain([LATE]).enumerate() {
        models.insert(table, table_stream(40 + i as u64, table, partitions));
    }
    let mut produced: BTreeMap<&str, Vec<Produced>> = BTreeMap::new();
    let half = |m: &ModelStream| m.messages.len() / 2;
    for (table, _) in TABLES {
        let m = &models[table];
        let sent = produce(&broker.bootstrap, &topic(table), &m.messages[..half(m)]).await;
        produced.entry(table).or_default().extend(sent);
    }
    let control = [
        (0, r#"{"id":"571:1"}"#.to_string(), Some(r#"{"status":"BEGIN","id":"571:1","event_count":null,"data_collections":null,"ts_ms":1}"#.to_string())),
        (0, r#"{"id":"571:1"}"#.to_string(), Some(r#"{"status":"END","id":"571:1","event_count":2,"data_collections":[{"data_collection":"shop.orders","event_count":2}],"ts_ms":2}"#.to_string())),
    ];
    produce(&broker.bootstrap, &transactions, &control).await;
    let ddl = serde_json::json!({"source": {"db": "shop", "table": "orders", "file": "mysql-bin.000003", "pos": 4, "row": 0},
        "ts_ms": 3, "databaseName": "shop", "ddl": "ALTER TABLE orders ADD COLUMN note text", "tableChanges": []});
    produce(
        &broker.bootstrap,
        &schema_changes,
        &[(
            0,
            r#"{"databaseName":"shop"}"#.into(),
            Some(ddl.to_string()),
        )],
    )
    .await;

    let ports = [free_port(), free_port()];
    let configs: Vec<_> = ["a", "b"]
        .iter()
        .zip(ports)
        .map(|(m, port)| member_config(&lake, &broker.bootstrap, &prefix, &pattern, m, port))
        .collect();
    let mut a = lake.spawn(&configs[0], &[]);
    let b = lake.spawn(&configs[1], &[]);

    // The first commits land, then member a dies mid-stream.
    let first = Instant::now();
    eventually(
        first + Duration::from_secs(120),
        "nothing committed",
        async || !recorded(&lake, "orders", &topic("orders")).await.is_empty(),
    )
    .await;
    // A table whose capture starts now: its topic appears while the pipeline runs.
    create_topic(&broker.bootstrap, &topic(LATE.0), LATE.1).await;
    let late = &models[LATE.0];
    let sent = produce(
        &broker.bootstrap,
        &topic(LATE.0),
        &late.messages[..half(late)],
    )
    .await;
    produced.entry(LATE.0).or_default().extend(sent);
    // Picked up by the running members, within their metadata refresh (10 s).
    eventually(
        first + Duration::from_secs(180),
        "the late table was never written",
        async || !recorded(&lake, LATE.0, &topic(LATE.0)).await.is_empty(),
    )
    .await;
    a.sigkill();
    a.wait_exit(Duration::from_secs(10));
    for (table, _) in TABLES.into_iter().chain([LATE]) {
        let m = &models[table];
        let sent = produce(&broker.bootstrap, &topic(table), &m.messages[half(m)..]).await;
        produced.entry(table).or_default().extend(sent);
    }
    let a = lake.spawn(&configs[0], &[]);

    let deadline = Instant::now() + Duration::from_secs(300);
    for (table, _) in TABLES.into_iter().chain([LATE]) {
        let want = end_offsets(&produced[table]);
        loop {
            let got = recorded(&lake, table, &topic(table)).await;
            if got == want {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{table}: the table records {got:?}, its topic ends at {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    for mut member in [a, b] {
        member.stop_cleanly(Duration::from_secs(60));
    }

    for (table, _) in TABLES.into_iter().chain([LATE]) {
        assert_matches(&lake, table, &models[table].expected, None).await;
        // The table records its own topic, names it as its shards' topic, and holds the
        // offsets of no other table's topic.
        let t = lake.table("test", table).await.unwrap();
        let offsets = inlet::commit::table_offsets(&t.metadata, "dbsync").unwrap();
        let others: Vec<&String> = offsets
            .keys()
            .filter(|k| k.contains(".shop.") && **k != topic(table))
            .collect();
        assert!(
            others.is_empty(),
            "{table} records other tables' topics {others:?}"
        );
        assert_eq!(
            inlet::commit::table_shard_topic(&t.metadata, "dbsync").as_deref(),
            Some(topic(table).as_str())
        );
    }
    // Debezium's own topics made no table; their messages were skipped by reason.
    let tables = lake.table_names().await;
    let want: BTreeSet<String> = TABLES
        .iter()
        .chain([&LATE])
        .map(|(t, _)| t.to_string())
        .collect();
    assert_eq!(tables, want);
    // They were read to their end all the same: some table records their offsets.
    for (control, end) in [(&transactions, 2), (&schema_changes, 1)] {
        let mut at = 0;
        for table in &want {
            let t = lake.table("test", table).await.unwrap();
            let offsets = inlet::commit::table_offsets(&t.metadata, "dbsync").unwrap();
            at = at.max(
                offsets
                    .get(control)
                    .and_then(|o| o.get(&0))
                    .copied()
                    .unwrap_or(0),
            );
        }
        assert_eq!(at, end, "{control} was not read to its end");
    }
    // Each member keeps index shards only of each table's own topic's partitions.
    for member in ["a", "b"] {
        let root = lake.path().join(format!("index-{member}")).join("dbsync");
        let Ok(dirs) = std::fs::read_dir(&root) else {
            continue;
        };
        for dir in dirs {
            let dir = dir.unwrap().path();
            let table = dir
                .file_name()
                .unwrap()
                .to_string_lossy()
                .trim_start_matches("test.")
                .to_string();
            for shard in std::fs::read_dir(&dir).unwrap() {
                let name = shard.unwrap().file_name().to_string_lossy().to_string();
                assert!(
                    name.starts_with(&format!("{}-", topic(&table))),
                    "{member}: table {table} has index shard {name}"
                );
            }
        }
    }
}

/// An upsert table's keys live in the partitions of one topic: changes of the same table from
/// a second topic are refused (`other_topic`, here under `errors.policy: skip`), in the run that
/// first wrote the table and after a restart, and the table stays equal to the first topic's
/// changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upsert_table_takes_its_changes_from_one_topic_only() {
    let broker = Broker::shared();
    let lake = Lake::new();
    let prefix = unique("two");
    let (first, second) = (format!("{prefix}.a.orders"), format!("{prefix}.b.orders"));
    create_topic(&broker.bootstrap, &first, 2).await;
    create_topic(&broker.bootstrap, &second, 2).await;
    let model = table_stream(7, "orders", 2);
    let other = table_stream(8, "orders", 2);
    let port = free_port();
    let config = member_config(
        &lake,
        &broker.bootstrap,
        &prefix,
        &format!("{prefix}[.].*"),
        "one",
        port,
    );
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("routing:", "errors:\n  policy: skip\nrouting:");
    std::fs::write(&config, text).unwrap();
    let sent = produce(&broker.bootstrap, &first, &model.messages).await;
    let want = end_offsets(&sent);
    let refused_after = |expected: usize| {
        let addr = format!("127.0.0.1:{port}");
        move || {
            let scraped = std::panic::catch_unwind(|| scrape(&addr)).ok()?;
            let n = try_metric(
                &scraped,
                "inlet_bad_records_total{action=\"skipped\",reason=\"other_topic\"}",
            )?;
            (n as usize >= expected).then_some(n as usize)
        }
    };
    let changes = |m: &ModelStream| m.messages.iter().filter(|(_, _, v)| v.is_some()).count();
    for run in 0..2 {
        let inlet = lake.spawn(&config, &[]);
        let started = Instant::now();
        eventually(
            started + Duration::from_secs(120),
            &format!("run {run}: not caught up"),
            async || recorded(&lake, "orders", &first).await == want,
        )
        .await;
        // Changes of the same table from the second topic, produced once the table is the
        // first topic's.
        let half = other.messages.len() / 2;
        let batch = if run == 0 {
            &other.messages[..half]
        } else {
            &other.messages[half..]
        };
        produce(&broker.bootstrap, &second, batch).await;
        let expected = batch.iter().filter(|(_, _, v)| v.is_some()).count();
        let refused = wait_for(Duration::from_secs(60), refused_after(expected));
        assert_eq!(
            refused,
            Some(expected),
            "run {run}: changes of the second topic not refused"
        );
        let mut inlet = inlet;
        inlet.stop_cleanly(Duration::from_secs(60));
    }
    assert!(changes(&other) > 0);
    assert_matches(&lake, "orders", &model.expected, None).await;
    let t = lake.table("test", "orders").await.unwrap();
    assert_eq!(
        inlet::commit::table_shard_topic(&t.metadata, "dbsync").as_deref(),
        Some(first.as_str())
    );
}
