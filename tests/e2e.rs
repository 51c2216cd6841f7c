//! End to end against a real Kafka-protocol broker process, the SQLite catalog and pyiceberg:
//! exactly-once delivery, and recovery from a crash at every checkpoint step.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use serde_json::Value as Json;

const PARTITIONS: i32 = 4;

/// Expected changelog rows by (partition, offset): (op, id, region, amount).
fn expected_rows(produced: &[Produced]) -> BTreeMap<(i64, i64), (String, i64, Json, Json)> {
    let mut out = BTreeMap::new();
    for p in produced {
        let Some(v) = &p.value else { continue };
        let doc: Json = serde_json::from_str(v).unwrap();
        let payload = doc.get("payload").cloned().unwrap_or(doc);
        let op = payload["op"].as_str().unwrap().to_string();
        let image = if op == "d" {
            &payload["before"]
        } else {
            &payload["after"]
        };
        out.insert(
            (p.partition as i64, p.offset),
            (
                op,
                image["id"].as_i64().unwrap(),
                image["region"].clone(),
                image["amount"].clone(),
            ),
        );
    }
    out
}

/// Reads the table with pyiceberg and with inlet's own reader and checks that it holds every
/// produced change exactly once, with the right values, and records the right offsets.
async fn assert_exactly_once(lake: &Lake, table: &str, produced: &[Produced]) {
    let read = lake.pyiceberg(&format!("test.{table}"));
    let rows = read["rows"].as_array().unwrap();
    let expected = expected_rows(produced);
    let mut seen = BTreeSet::new();
    for r in rows {
        let pos = (
            r["_kafka_partition"].as_i64().unwrap(),
            r["_kafka_offset"].as_i64().unwrap(),
        );
        assert!(
            seen.insert(pos),
            "change at partition/offset {pos:?} is in the table twice"
        );
        let (op, id, region, amount) = expected
            .get(&pos)
            .unwrap_or_else(|| panic!("row {pos:?} was never produced"));
        assert_eq!(r["_op"].as_str().unwrap(), op, "{pos:?}");
        assert_eq!(r["id"].as_i64().unwrap(), *id, "{pos:?}");
        assert_eq!(&r["region"], region, "{pos:?}");
        assert_eq!(&r["amount"], amount, "{pos:?}");
    }
    assert_eq!(
        seen.len(),
        expected.len(),
        "pyiceberg sees {} of {} changes",
        seen.len(),
        expected.len()
    );

    let summary = &read["snapshot"]["summary"];
    let offsets: BTreeMap<String, BTreeMap<String, i64>> =
        serde_json::from_str(summary["inlet.offsets"].as_str().unwrap()).unwrap();
    let topic_offsets = offsets.values().next().unwrap();
    for (p, end) in end_offsets(produced) {
        assert_eq!(
            topic_offsets.get(&p.to_string()),
            Some(&end),
            "snapshot offset of partition {p}"
        );
    }

    let t = lake.table("test", table).await.unwrap();
    let mut own = own_reader_positions(&t).await;
    own.sort();
    let own_set: BTreeSet<_> = own.iter().copied().collect();
    assert_eq!(
        own.len(),
        own_set.len(),
        "inlet's reader finds duplicate changes"
    );
    assert_eq!(
        own_set,
        produced_changes(produced),
        "inlet's reader disagrees with what was produced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_changes_land_exactly_once() {
    let broker = Broker::start();
    let lake = Lake::new();
    let topic = unique("orders");
    let table = unique("orders");
    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    let produced = produce(
        &broker.bootstrap,
        &topic,
        &debezium_stream(7, 3000, 800, PARTITIONS),
    )
    .await;
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 700, &metrics_addr);

    let mut inlet = Inlet::spawn(&config, &[]);
    let target: i64 = end_offsets(&produced).values().sum();
    assert!(
        wait_committed(
            &lake,
            "test",
            &table,
            &table,
            target,
            Duration::from_secs(90)
        )
        .await,
        "inlet did not catch up"
    );
    let scraped = scrape(&metrics_addr);
    let changes = produced_changes(&produced).len() as f64;
    assert_eq!(
        metric(&scraped, "inlet_source_records_consumed_total"),
        produced.len() as f64,
        "{scraped}"
    );
    assert_eq!(metric(&scraped, "inlet_write_rows_total"), changes);
    assert_eq!(
        metric(&scraped, "inlet_decode_tombstones_total"),
        produced.len() as f64 - changes
    );
    assert!(
        metric(
            &scraped,
            "inlet_commit_checkpoints_total{result=\"committed\"}"
        ) >= 4.0,
        "{scraped}"
    );
    assert!(metric(&scraped, "inlet_write_files_total") > 0.0);
    inlet.sigterm();
    let status = inlet
        .wait_exit(Duration::from_secs(30))
        .expect("inlet exits on SIGTERM");
    assert!(status.success(), "inlet exited with {status}");

    assert_exactly_once(&lake, &table, &produced).await;
    let read = lake.pyiceberg(&format!("test.{table}"));
    assert!(
        read["snapshot_count"].as_i64().unwrap() >= 4,
        "checkpoints by record count: {}",
        read["snapshot_count"]
    );
    // Every file sits in one partition of the spec, and NULL/odd region values round-trip.
    let regions: BTreeSet<String> = read["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["partition"]["region"].to_string())
        .collect();
    assert!(
        regions.contains("null") && regions.contains("\"us/west\"") && regions.contains("\"..\""),
        "{regions:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_every_checkpoint_step_loses_and_duplicates_nothing() {
    let broker = Broker::start();
    let lake = Lake::new();
    let topic = unique("crash");
    let table = unique("crash");
    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 150, "");
    let mut produced = Vec::new();
    let mut seed = 100;

    for step in inlet::failpoint::STEPS {
        seed += 1;
        produced.extend(
            produce(
                &broker.bootstrap,
                &topic,
                &debezium_stream(seed, 500, 300, PARTITIONS),
            )
            .await,
        );
        let before = lake.committed_total("test", &table, &table).await;
        let mut inlet = Inlet::spawn(&config, &[("INLET_CRASH_AT", &format!("{step}:2"))]);
        let status = inlet
            .wait_exit(Duration::from_secs(90))
            .unwrap_or_else(|| panic!("no crash at {step}"));
        assert!(!status.success(), "inlet should have crashed at {step}");
        let after = lake.committed_total("test", &table, &table).await;
        assert!(
            after > before,
            "the first checkpoint before the crash at {step} should have committed"
        );
    }

    // A kill from outside while consuming, at no particular step.
    produced.extend(
        produce(
            &broker.bootstrap,
            &topic,
            &debezium_stream(999, 1500, 300, PARTITIONS),
        )
        .await,
    );
    let before = lake.committed_total("test", &table, &table).await;
    let mut inlet = Inlet::spawn(&config, &[]);
    assert!(
        wait_committed(
            &lake,
            "test",
            &table,
            &table,
            before + 1,
            Duration::from_secs(60)
        )
        .await
    );
    inlet.sigkill();

    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_exactly_once(&lake, &table, &produced).await;
}

/// The production catalog: the same pipeline on PostgreSQL, read back by pyiceberg through it.
/// CI sets INLET_TEST_POSTGRES; elsewhere the test says it did not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_catalog_commits_and_pyiceberg_reads_it() {
    let Ok(uri) = std::env::var("INLET_TEST_POSTGRES") else {
        eprintln!("not run: set INLET_TEST_POSTGRES=postgresql://user@host:5432/db to test the PostgreSQL catalog");
        return;
    };
    let broker = Broker::start();
    let lake = Lake::postgres(&uri);
    let topic = unique("pg");
    let table = unique("pg");
    create_topic(&broker.bootstrap, &topic, 2).await;
    let produced = produce(&broker.bootstrap, &topic, &debezium_stream(3, 600, 100, 2)).await;
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 250, "");
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_exactly_once(&lake, &table, &produced).await;
}
