//! End to end against a real Kafka-protocol broker process, the SQLite catalog and pyiceberg:
//! exactly-once delivery, and recovery from a crash at every checkpoint step.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use serde_json::Value as Json;

const PARTITIONS: i32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_changes_land_exactly_once() {
    changes_land_exactly_once(Lake::new()).await;
}

/// The same on S3 (moto), reached through the standard AWS environment variables alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_changes_land_exactly_once_on_s3() {
    changes_land_exactly_once(Lake::on(Store::Moto)).await;
}

/// The same through a REST catalog server whose warehouse is on S3 (s3s-fs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_changes_land_exactly_once_through_the_rest_catalog() {
    changes_land_exactly_once(Lake::rest(Store::S3s)).await;
}

async fn changes_land_exactly_once(lake: Lake) {
    let (broker, topic, table) = topic_and_table("orders", PARTITIONS).await;
    let produced = produce(
        &broker.bootstrap,
        &topic,
        &debezium_stream(7, 3000, 800, PARTITIONS),
    )
    .await;
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 700, &metrics_addr);

    let mut inlet = spawn_until_committed(
        &lake,
        &config,
        &table,
        end_offsets(&produced).values().sum(),
        "inlet did not catch up",
    )
    .await;
    let scraped = scrape(&metrics_addr);
    let changes = produced_changes(&produced).len() as f64;
    for (p, end) in end_offsets(&produced) {
        let series = format!("{{partition=\"{p}\",topic=\"{topic}\"}}");
        assert_eq!(
            metric(
                &scraped,
                &format!("inlet_source_records_consumed_total{series}")
            ),
            produced.iter().filter(|m| m.partition == p).count() as f64,
            "{scraped}"
        );
        // Everything up to the high watermark is committed (the series appears once the
        // client has learnt the watermark).
        let lag = format!("inlet_source_lag_records{series}");
        let seen = wait_for(Duration::from_secs(30), || {
            try_metric(&scrape(&metrics_addr), &lag).filter(|v| *v == 0.0)
        });
        assert_eq!(
            seen,
            Some(0.0),
            "partition {p} ends at {end}: {}",
            scrape(&metrics_addr)
        );
    }
    let label = format!("{{table=\"test.{table}\"}}");
    assert_eq!(
        metric(&scraped, &format!("inlet_write_rows_total{label}")),
        changes
    );
    // The stream's newest source timestamp (ts_ms) is what the table now holds.
    let newest_ms = newest_source_ms(&produced);
    // The table shows a commit a moment before the process has recorded it in its metrics.
    let newest = newest_ms as f64 / 1000.0;
    let committed_ts = format!("inlet_commit_source_timestamp_seconds{label}");
    let seen = wait_for(Duration::from_secs(30), || {
        try_metric(&scrape(&metrics_addr), &committed_ts).filter(|v| *v == newest)
    });
    let scraped = scrape(&metrics_addr);
    assert_eq!(seen, Some(newest), "{scraped}");
    assert!(
        metric(&scraped, &format!("inlet_commit_freshness_seconds{label}")) > 0.0,
        "{scraped}"
    );
    assert!(
        metric(
            &scraped,
            &format!("inlet_commit_last_success_timestamp_seconds{label}")
        ) > 0.0,
        "{scraped}"
    );
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
    inlet.stop_cleanly(Duration::from_secs(30));

    assert_exactly_once(&lake, &table, &produced).await;
    let read = lake.read(&table);
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
    // Many rows per key: no identifier fields; the upstream key is a table property.
    assert_eq!(read["identifier_field_ids"], serde_json::json!([]));
    assert_eq!(read["properties"]["inlet.primary-key"], "id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_every_checkpoint_step_loses_and_duplicates_nothing() {
    crash_at_every_checkpoint_step(Lake::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_every_checkpoint_step_on_s3_loses_and_duplicates_nothing() {
    crash_at_every_checkpoint_step(Lake::on(Store::S3s)).await;
}

async fn crash_at_every_checkpoint_step(lake: Lake) {
    let (broker, topic, table) = topic_and_table("crash", PARTITIONS).await;
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
        let mut inlet = lake.spawn(&config, &[("INLET_CRASH_AT", &format!("{step}:2"))]);
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
    let mut inlet = lake.spawn(&config, &[]);
    assert_committed(
        &lake,
        &table,
        before + 1,
        Duration::from_secs(60),
        "nothing committed before the kill",
    )
    .await;
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
    let lake = Lake::postgres(&uri);
    let (broker, topic, table) = topic_and_table("pg", 2).await;
    let produced = produce(&broker.bootstrap, &topic, &debezium_stream(3, 600, 100, 2)).await;
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 250, "");
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_exactly_once(&lake, &table, &produced).await;
}

/// Starts inlet and waits until the table's committed offsets sum to `target`.
async fn spawn_until_committed(
    lake: &Lake,
    config: &std::path::Path,
    table: &str,
    target: i64,
    why: &str,
) -> Inlet {
    let inlet = lake.spawn(config, &[]);
    assert_committed(lake, table, target, Duration::from_secs(90), why).await;
    inlet
}

/// Checks that the metrics count each reason's bad records as dead-lettered.
fn assert_dead_lettered(scraped: &str, bad: &[(&str, impl Sized)], reasons: &[&str]) {
    for reason in reasons {
        let want = bad.iter().filter(|(r, _)| r == reason).count() as f64;
        let series =
            format!("inlet_bad_records_total{{action=\"dead_lettered\",reason=\"{reason}\"}}");
        assert_eq!(metric(scraped, &series), want, "{reason}: {scraped}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_records_go_to_the_dead_letter_topic_and_the_rest_lands_once() {
    use rdkafka::message::Message;
    let broker = Broker::shared();
    let lake = Lake::new();
    let topic = unique("bad");
    let dlq = unique("dlq");
    let table = unique("bad");
    create_topic(&broker.bootstrap, &topic, 2).await;
    create_topic(&broker.bootstrap, &dlq, 1).await;
    let bad = [
        ("malformed", r#"{"op": "c", "after": {"id": 1"#),
        (
            "type_mismatch",
            r#"{"op":"c","after":{"id":"seven","region":"eu"},"source":{"lsn":5,"ts_ms":5}}"#,
        ),
        (
            "unknown_op",
            r#"{"op":"x","after":{"id":3},"source":{"lsn":6,"ts_ms":6}}"#,
        ),
        ("malformed", "[1, 2, 3]"),
        (
            "type_mismatch",
            r#"{"op":"c","after":{"id":4,"amount":"12.345"},"source":{"lsn":7,"ts_ms":7}}"#,
        ),
    ];
    let mut msgs = debezium_stream(11, 800, 150, 2);
    for (i, (_, value)) in bad.iter().enumerate() {
        let at = 50 + i * 120;
        msgs.insert(
            at,
            ((i % 2) as i32, format!("bad-{i}"), Some(value.to_string())),
        );
    }
    let produced = produce(&broker.bootstrap, &topic, &msgs).await;
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 300, &metrics_addr);
    extend_config(
        &config,
        &format!("errors:\n  policy: dead-letter\n  dead_letter_topic: {dlq}\n"),
    );

    let mut inlet = spawn_until_committed(
        &lake,
        &config,
        &table,
        end_offsets(&produced).values().sum(),
        "inlet did not pass the bad records",
    )
    .await;
    let scraped = scrape(&metrics_addr);
    assert_dead_lettered(
        &scraped,
        &bad,
        &["malformed", "type_mismatch", "unknown_op"],
    );
    inlet.stop_cleanly(Duration::from_secs(30));

    let letters = consume_all(&broker.bootstrap, &dlq, bad.len()).await;
    let sources: Vec<&Produced> = produced
        .iter()
        .filter(|p| p.key.starts_with("bad-"))
        .collect();
    for letter in &letters {
        let header = |name: &str| letter_header(letter, name);
        let key = String::from_utf8(letter.key().unwrap().to_vec()).unwrap();
        let i: usize = key.strip_prefix("bad-").unwrap().parse().unwrap();
        let source = sources.iter().find(|p| p.key == key).unwrap();
        assert_eq!(
            letter
                .payload()
                .map(|p| String::from_utf8(p.to_vec()).unwrap()),
            source.value,
            "the original value travels unchanged"
        );
        assert_eq!(header("inlet.error.reason"), bad[i].0, "{key}");
        assert_eq!(header("inlet.source.topic"), topic);
        assert_eq!(
            header("inlet.source.partition"),
            source.partition.to_string()
        );
        assert_eq!(header("inlet.source.offset"), source.offset.to_string());
        assert!(!header("inlet.error").is_empty());
        // A value that does not fit names its table (under routing one topic feeds many).
        if bad[i].0 == "type_mismatch" {
            assert!(
                header("inlet.error").contains(&format!("table=test.{table}")),
                "{}",
                header("inlet.error")
            );
        }
        assert!(header("inlet.failed.at").parse::<i64>().unwrap() > 0);
    }

    let good: Vec<Produced> = produced
        .into_iter()
        .filter(|p| !p.key.starts_with("bad-"))
        .collect();
    assert_exactly_once(&lake, &table, &good).await;
}

/// Schema ids of the Avro stream's writer schemas in its `schemas_dir`.
const AVRO_KEY_ID: u32 = 41;
const AVRO_VALUE_ID: u32 = 42;

/// The key schema of the Avro stream's upstream table.
const AVRO_KEY_SCHEMA: &str = r#"{"type": "record", "name": "Key", "namespace": "pg.public.orders",
  "fields": [{"name": "id", "type": "long"}], "connect.name": "pg.public.orders.Key"}"#;

/// The change envelope of the same table as Debezium's PostgreSQL connector writes it: `amount`
/// a Connect decimal, `created_at` a millisecond `io.debezium.time.Timestamp`.
const AVRO_VALUE_SCHEMA: &str = r#"{"type": "record", "name": "Envelope", "namespace": "pg.public.orders",
  "fields": [
    {"name": "before", "default": null, "type": ["null", {"type": "record", "name": "Value",
      "connect.name": "pg.public.orders.Value", "fields": [
        {"name": "id", "type": "long"},
        {"name": "region", "type": ["null", "string"], "default": null},
        {"name": "amount", "default": null, "type": ["null", {"type": "bytes", "scale": 2,
          "precision": 10, "connect.version": 1, "logicalType": "decimal",
          "connect.parameters": {"scale": "2", "connect.decimal.precision": "10"},
          "connect.name": "org.apache.kafka.connect.data.Decimal"}]},
        {"name": "created_at", "default": null, "type": ["null", {"type": "long",
          "connect.version": 1, "connect.name": "io.debezium.time.Timestamp"}]}]}]},
    {"name": "after", "type": ["null", "Value"], "default": null},
    {"name": "source", "type": {"type": "record", "name": "Source",
      "namespace": "io.debezium.connector.postgresql", "fields": [
        {"name": "connector", "type": "string"},
        {"name": "ts_ms", "type": "long"},
        {"name": "lsn", "type": ["null", "long"], "default": null}]}},
    {"name": "op", "type": "string"},
    {"name": "ts_ms", "type": ["null", "long"], "default": null}],
  "connect.name": "pg.public.orders.Envelope"}"#;

/// `value` as one message in the Confluent wire format under schema id `id`.
fn confluent(id: u32, schema: &apache_avro::Schema, value: apache_avro::types::Value) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&id.to_be_bytes());
    out.extend(apache_avro::to_avro_datum(schema, value).unwrap());
    out
}

/// A row image of [`debezium_stream`] as the Avro value of the nullable `Value` record.
fn avro_image(image: &Json) -> apache_avro::types::Value {
    use apache_avro::types::Value as Avro;
    if image.is_null() {
        return Avro::Union(0, Box::new(Avro::Null));
    }
    let nullable = |v: Option<Avro>| match v {
        None => Avro::Union(0, Box::new(Avro::Null)),
        Some(v) => Avro::Union(1, Box::new(v)),
    };
    // "12345.67" as the unscaled value's big-endian two's complement, as Connect writes decimals.
    let (units, cents) = image["amount"].as_str().unwrap().split_once('.').unwrap();
    let unscaled = units.parse::<i64>().unwrap() * 100 + cents.parse::<i64>().unwrap();
    let amount = apache_avro::Decimal::from(unscaled.to_be_bytes().to_vec());
    let row = Avro::Record(vec![
        ("id".into(), Avro::Long(image["id"].as_i64().unwrap())),
        (
            "region".into(),
            nullable(image["region"].as_str().map(|r| Avro::String(r.into()))),
        ),
        ("amount".into(), nullable(Some(Avro::Decimal(amount)))),
        (
            "created_at".into(),
            nullable(Some(Avro::Long(image["created_at"].as_i64().unwrap()))),
        ),
    ]);
    Avro::Union(1, Box::new(row))
}

/// A change of [`debezium_stream`] (with or without its schema envelope) as the Avro envelope.
fn avro_change(value: &str) -> apache_avro::types::Value {
    use apache_avro::types::Value as Avro;
    let doc: Json = serde_json::from_str(value).unwrap();
    let payload = doc.get("payload").unwrap_or(&doc);
    let source = &payload["source"];
    Avro::Record(vec![
        ("before".into(), avro_image(&payload["before"])),
        ("after".into(), avro_image(&payload["after"])),
        (
            "source".into(),
            Avro::Record(vec![
                ("connector".into(), Avro::String("postgresql".into())),
                (
                    "ts_ms".into(),
                    Avro::Long(source["ts_ms"].as_i64().unwrap()),
                ),
                (
                    "lsn".into(),
                    Avro::Union(1, Box::new(Avro::Long(source["lsn"].as_i64().unwrap()))),
                ),
            ]),
        ),
        (
            "op".into(),
            Avro::String(payload["op"].as_str().unwrap().into()),
        ),
        (
            "ts_ms".into(),
            Avro::Union(1, Box::new(Avro::Long(payload["ts_ms"].as_i64().unwrap()))),
        ),
    ])
}

/// The Debezium stream of the JSON tests, sent as Avro with offline writer schemas; bad records
/// of each Avro failure go to the dead-letter topic and every good change lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_changes_land_once_and_bad_avro_goes_to_the_dead_letter_topic() {
    use apache_avro::Schema;
    use rdkafka::message::Message;
    let broker = Broker::shared();
    let lake = Lake::new();
    let topic = unique("avro");
    let dlq = unique("avro_dlq");
    let table = unique("avro");
    let partitions = 3;
    create_topic(&broker.bootstrap, &topic, partitions).await;
    create_topic(&broker.bootstrap, &dlq, 1).await;
    let schemas = lake.path().join("schemas");
    std::fs::create_dir(&schemas).unwrap();
    std::fs::write(schemas.join(format!("{AVRO_KEY_ID}.avsc")), AVRO_KEY_SCHEMA).unwrap();
    std::fs::write(
        schemas.join(format!("{AVRO_VALUE_ID}.avsc")),
        AVRO_VALUE_SCHEMA,
    )
    .unwrap();
    let key_schema = Schema::parse_str(AVRO_KEY_SCHEMA).unwrap();
    let value_schema = Schema::parse_str(AVRO_VALUE_SCHEMA).unwrap();
    let avro_key = |key: &str| {
        let id = serde_json::from_str::<Json>(key).unwrap()["id"]
            .as_i64()
            .unwrap();
        confluent(
            AVRO_KEY_ID,
            &key_schema,
            apache_avro::types::Value::Record(vec![(
                "id".into(),
                apache_avro::types::Value::Long(id),
            )]),
        )
    };

    let stream = debezium_stream(31, 900, 150, partitions);
    // (partition, key, value) as sent, and the JSON twin of each good change for the checks.
    let mut sent: Vec<RawMessage> = Vec::new();
    let mut twins: Vec<Option<(String, Option<String>)>> = Vec::new();
    for (p, k, v) in &stream {
        let value = v
            .as_deref()
            .map(|v| confluent(AVRO_VALUE_ID, &value_schema, avro_change(v)));
        sent.push((*p, avro_key(k), value));
        twins.push(Some((k.clone(), v.clone())));
    }
    let template = stream
        .iter()
        .find_map(|(_, _, v)| v.as_deref())
        .expect("the stream has changes");
    let good_bytes = confluent(AVRO_VALUE_ID, &value_schema, avro_change(template));
    let mut truncated = good_bytes.clone();
    truncated.truncate(good_bytes.len() / 2);
    let mut wrong_magic = good_bytes.clone();
    wrong_magic[0] = 1;
    let mut unknown_id = good_bytes.clone();
    unknown_id[1..5].copy_from_slice(&99u32.to_be_bytes());
    let mut unknown_op: Json = serde_json::from_str(template).unwrap();
    let payload = match unknown_op.get_mut("payload") {
        Some(p) => p,
        None => &mut unknown_op,
    };
    payload["op"] = Json::String("x".into());
    let unknown_op = confluent(
        AVRO_VALUE_ID,
        &value_schema,
        avro_change(&unknown_op.to_string()),
    );
    let bad = [
        ("malformed", truncated),
        ("malformed", wrong_magic),
        ("unknown_schema", unknown_id),
        ("unknown_op", unknown_op),
    ];
    for (i, (_, value)) in bad.iter().enumerate() {
        // Spread over the partitions, each followed by good changes in its partition.
        let at = 60 + i * 200;
        let key = avro_key(&format!(r#"{{"id": {}}}"#, 1000 + i));
        sent.insert(at, (i as i32 % partitions, key, Some(value.clone())));
        twins.insert(at, None);
    }
    let positions = produce_bytes(&broker.bootstrap, &topic, &sent).await;
    let good: Vec<Produced> = positions
        .iter()
        .zip(&twins)
        .filter_map(|(&(partition, offset), twin)| {
            let (key, value) = twin.clone()?;
            Some(Produced {
                partition,
                offset,
                key,
                value,
            })
        })
        .collect();
    let bad_at: Vec<(i32, i64)> = positions
        .iter()
        .zip(&twins)
        .filter(|(_, twin)| twin.is_none())
        .map(|(at, _)| *at)
        .collect();
    assert_eq!(bad_at.len(), bad.len());

    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 250, &metrics_addr);
    extend_config(
        &config,
        &format!(
            "format:\n  type: debezium-avro\n  schemas_dir: \"{}\"\nerrors:\n  policy: dead-letter\n  dead_letter_topic: {dlq}\n",
            schemas.display()
        ),
    );
    let mut inlet = spawn_until_committed(
        &lake,
        &config,
        &table,
        sent.len() as i64,
        "inlet did not reach the end of the topic",
    )
    .await;
    let scraped = scrape(&metrics_addr);
    assert_dead_lettered(
        &scraped,
        &bad,
        &["malformed", "unknown_schema", "unknown_op"],
    );
    assert_eq!(
        metric_sum(&scraped, "inlet_source_records_consumed_total"),
        sent.len() as f64,
        "{scraped}"
    );
    assert_eq!(
        metric_sum(&scraped, "inlet_write_rows_total"),
        produced_changes(&good).len() as f64
    );
    assert_eq!(
        metric(&scraped, "inlet_decode_tombstones_total"),
        good.iter().filter(|p| p.value.is_none()).count() as f64
    );
    inlet.stop_cleanly(Duration::from_secs(30));

    let letters = consume_all(&broker.bootstrap, &dlq, bad.len()).await;
    let mut lettered = Vec::new();
    for letter in &letters {
        let header = |name: &str| letter_header(letter, name);
        assert_eq!(header("inlet.source.topic"), topic);
        let at: (i32, i64) = (
            header("inlet.source.partition").parse().unwrap(),
            header("inlet.source.offset").parse().unwrap(),
        );
        let i = bad_at
            .iter()
            .position(|b| *b == at)
            .unwrap_or_else(|| panic!("{at:?} is not a bad record"));
        let (_, key, value) = &sent[positions.iter().position(|p| *p == at).unwrap()];
        assert_eq!(letter.key(), Some(key.as_slice()), "{at:?}: original key");
        assert_eq!(letter.payload(), value.as_deref(), "{at:?}: original value");
        assert_eq!(header("inlet.error.reason"), bad[i].0, "{at:?}");
        assert!(!header("inlet.error").is_empty());
        lettered.push(at);
    }
    lettered.sort();
    let mut want = bad_at.clone();
    want.sort();
    assert_eq!(lettered, want, "each bad record is dead-lettered once");

    assert_exactly_once(&lake, &table, &good).await;
    // The millisecond `io.debezium.time.Timestamp` lands as the same instant.
    let created: BTreeMap<(i64, i64), i64> = good
        .iter()
        .filter_map(|p| {
            let doc: Json = serde_json::from_str(p.value.as_deref()?).unwrap();
            let payload = doc.get("payload").unwrap_or(&doc);
            let image = if payload["op"] == "d" {
                &payload["before"]
            } else {
                &payload["after"]
            };
            let at = (p.partition as i64, p.offset);
            Some((at, image["created_at"].as_i64().unwrap()))
        })
        .collect();
    let read = lake.read(&table);
    for r in read_rows(&read) {
        let at = position(r);
        let read_ms = chrono::DateTime::parse_from_rfc3339(r["created_at"].as_str().unwrap())
            .unwrap()
            .timestamp_millis();
        assert_eq!(read_ms, created[&at], "created_at of {at:?}: {r}");
    }
}

/// Adds a `note` field to every row image of a Debezium message (and to its schema).
fn with_note(value: &str) -> String {
    let mut doc: Json = serde_json::from_str(value).unwrap();
    let enveloped = doc.get("schema").is_some();
    let payload = if enveloped {
        &mut doc["payload"]
    } else {
        &mut doc
    };
    for image in ["before", "after"] {
        if let Some(row) = payload.get_mut(image).and_then(Json::as_object_mut) {
            let id = row["id"].as_i64().unwrap();
            row.insert("note".into(), Json::String(format!("note {id}")));
        }
    }
    if enveloped {
        for f in doc["schema"]["fields"].as_array_mut().unwrap() {
            if matches!(f["field"].as_str(), Some("before" | "after")) {
                f["fields"]
                    .as_array_mut()
                    .unwrap()
                    .push(serde_json::json!({"type": "string", "optional": true, "field": "note"}));
            }
        }
    }
    doc.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_added_upstream_appears_with_nulls_for_older_rows() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("evolve", 2).await;
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 200, "");

    let first = produce(&broker.bootstrap, &topic, &debezium_stream(21, 400, 100, 2)).await;
    run_to_end(&lake, &config, &table, &first, &[]).await;

    // The source gains a column mid-stream; the running pipeline adds it.
    let noted: Vec<_> = debezium_stream(22, 400, 100, 2)
        .into_iter()
        .map(|(p, k, v)| (p, k, v.map(|v| with_note(&v))))
        .collect();
    let mut produced = first;
    produced.extend(produce(&broker.bootstrap, &topic, &noted).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // A restart on the evolved table, with rows lacking the field again.
    produced.extend(produce(&broker.bootstrap, &topic, &debezium_stream(23, 200, 100, 2)).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;

    let read = lake.read(&table);
    let noted_offsets: BTreeSet<(i64, i64)> = produced
        .iter()
        .filter(|p| p.value.as_deref().is_some_and(|v| v.contains("\"note\"")))
        .map(|p| (p.partition as i64, p.offset))
        .collect();
    assert!(!noted_offsets.is_empty());
    let rows = read_rows(&read);
    let mut with_value = 0;
    for r in rows {
        let pos = position(r);
        if noted_offsets.contains(&pos) {
            assert_eq!(
                r["note"].as_str(),
                Some(format!("note {}", r["id"]).as_str()),
                "{pos:?}"
            );
            with_value += 1;
        } else {
            assert!(r["note"].is_null(), "row {pos:?} predates the column: {r}");
        }
    }
    assert_eq!(with_value, noted_offsets.len());
    let schema = read["schema"].to_string();
    assert!(schema.contains("note"), "{schema}");
    assert_exactly_once(&lake, &table, &produced).await;
}

/// A database-sync stream: MySQL Debezium changes of two tables with different schemas, all
/// in one topic, keyed by id. From message `tier_from` on, customers gain a `tier` column and
/// orders' `qty` widens from int to long.
fn database_stream(seed: u64, messages: usize, partitions: i32, tier_from: usize) -> Vec<Record> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut live: BTreeMap<(&str, i64), Json> = BTreeMap::new();
    let mut out = Vec::new();
    let mut pos = seed as i64 * 1_000_000;
    while out.len() < messages {
        let table = if rng.gen_bool(0.5) {
            "customers"
        } else {
            "orders"
        };
        let id = rng.gen_range(0..60i64);
        let tier = out.len() >= tier_from;
        let (row, fields) = if table == "customers" {
            let mut row = serde_json::json!({"id": id, "name": format!("c{}", rng.gen_range(0..1000)), "email": null});
            let mut fields = vec![
                serde_json::json!({"type": "int64", "optional": false, "field": "id"}),
                serde_json::json!({"type": "string", "optional": true, "field": "name"}),
                serde_json::json!({"type": "string", "optional": true, "field": "email"}),
            ];
            if tier {
                row["tier"] = Json::String(["gold", "silver"][rng.gen_range(0..2)].into());
                fields
                    .push(serde_json::json!({"type": "string", "optional": true, "field": "tier"}));
            }
            (row, fields)
        } else {
            let row = serde_json::json!({
                "id": id,
                "customer_id": rng.gen_range(0..60i64),
                "qty": rng.gen_range(1..20),
                "placed_at": 1_767_225_600_000_000i64 + rng.gen_range(0..86_400_000_000i64),
            });
            let fields = vec![
                serde_json::json!({"type": "int64", "optional": false, "field": "id"}),
                serde_json::json!({"type": "int64", "optional": true, "field": "customer_id"}),
                // Widened upstream (INT → BIGINT) when customers gain `tier`.
                serde_json::json!({"type": if tier { "int64" } else { "int32" }, "optional": true, "field": "qty"}),
                serde_json::json!({"type": "int64", "optional": true, "name": "io.debezium.time.MicroTimestamp", "field": "placed_at"}),
            ];
            (row, fields)
        };
        pos += rng.gen_range(1..500);
        let before = live.get(&(table, id)).cloned();
        let (op, before, after) = match (&before, rng.gen_range(0..10)) {
            (None, _) => ("c", None, Some(row)),
            (Some(b), 0..=1) => ("d", Some(b.clone()), None),
            (Some(b), _) => ("u", Some(b.clone()), Some(row)),
        };
        match &after {
            Some(a) => live.insert((table, id), a.clone()),
            None => live.remove(&(table, id)),
        };
        let schema = serde_json::json!({"type": "struct", "optional": false, "fields": [
            {"type": "struct", "optional": true, "field": "before", "fields": fields},
            {"type": "struct", "optional": true, "field": "after", "fields": fields},
            {"type": "string", "optional": false, "field": "op"},
        ]});
        let payload = serde_json::json!({
            "before": before, "after": after, "op": op, "ts_ms": pos,
            "source": {"connector": "mysql", "db": "inventory", "table": table,
                       "file": "mysql-bin.000004", "pos": pos, "row": 0, "ts_ms": pos},
        });
        let value = serde_json::json!({"schema": schema, "payload": payload}).to_string();
        let key = serde_json::json!({"id": id}).to_string();
        out.push(((id % partitions as i64) as i32, key, Some(value)));
    }
    out
}

/// The highest offset any of `tables` records for the pipeline, summed over partitions.
async fn routed_committed(lake: &Lake, tables: &[&str], pipeline: &str) -> i64 {
    let mut max: BTreeMap<i32, i64> = BTreeMap::new();
    for t in tables {
        if let Some(table) = lake.table("inventory", t).await {
            for parts in inlet::commit::table_offsets(&table.metadata, pipeline)
                .unwrap()
                .values()
            {
                for (p, o) in parts {
                    let at = max.entry(*p).or_insert(*o);
                    *at = (*at).max(*o);
                }
            }
        }
    }
    max.values().sum()
}

/// (partition, offset) of every change of upstream table `table` among `produced`.
fn routed_changes(produced: &[Produced], table: &str) -> BTreeSet<(i64, i64)> {
    produced
        .iter()
        .filter(|p| {
            p.value.as_deref().is_some_and(|v| {
                serde_json::from_str::<Json>(v).unwrap()["payload"]["source"]["table"] == table
            })
        })
        .map(|p| (p.partition as i64, p.offset))
        .collect()
}

/// (partition, offset) of every row pyiceberg reads in `inventory.table`, each at most once.
fn routed_rows(lake: &Lake, table: &str) -> BTreeSet<(i64, i64)> {
    changelog_positions(&lake.pyiceberg(&format!("inventory.{table}")))
}

/// Runs a routed pipeline until its tables hold every produced offset.
async fn run_routed_to_end(
    lake: &Lake,
    config: &std::path::Path,
    pipeline: &str,
    produced: &[Produced],
) {
    let target = end_offset_sum(produced);
    let mut inlet = Inlet::spawn(config, &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    eventually(deadline, "inlet did not catch up", async || {
        routed_committed(lake, &["customers", "orders"], pipeline).await >= target
    })
    .await;
    inlet.stop_cleanly(Duration::from_secs(30));
}

/// The `table:` body of the routed pipelines here: changelog tables.
const ROUTED_CHANGELOG: &str = "  mode: changelog\n";
/// Their checkpoints: every second or 120 records.
const ROUTED_CHECKPOINTS: &str = "checkpoint:\n  interval_ms: 1000\n  max_records: 120\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_table_without_the_pipelines_offsets_follows_start_without_offsets() {
    let lake = Lake::new();
    let (broker, topic, pipeline) = topic_and_table("rso", 2).await;
    let configure = |start: &str| {
        let source = format!("topics: [{topic}]\n  {start}");
        let kafka = kafka_sections(&pipeline, &pipeline, &broker.bootstrap, &source);
        routed_config(&lake, "rso", &kafka, ROUTED_CHANGELOG, ROUTED_CHECKPOINTS)
    };
    let config = configure("");
    let stream = database_stream(9, 900, 2, usize::MAX);
    let mut produced = produce(&broker.bootstrap, &topic, &stream[..300]).await;
    run_routed_to_end(&lake, &config, &pipeline, &produced).await;
    let first = produced.clone();

    // Another engine deletes from customers and expires its snapshots, the pipeline's tag
    // removed: no snapshot of customers records the pipeline's offsets any more, while orders
    // keeps them.
    let customers = "inventory.customers";
    foreign_writer_at(&lake, customers, &["delete", "_kafka_partition = 0"]);
    foreign_writer_at(
        &lake,
        customers,
        &["remove-tag", &format!("inlet-{pipeline}")],
    );
    foreign_writer_at(&lake, customers, &["expire"]);
    let second = produce(&broker.bootstrap, &topic, &stream[300..600]).await;
    produced.extend(second.clone());
    let log = lake.path().join("refused.log");
    let mut refused = Inlet::spawn_logged(&config, &[], &log);
    let status = refused.wait_exit(Duration::from_secs(60));
    if status.is_none() {
        refused.sigkill();
    }
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "a configuration error stops the pipeline"
    );
    let out = std::fs::read_to_string(&log).unwrap();
    assert!(
        out.contains("kafka.start_without_offsets") && out.contains(customers),
        "{out}"
    );

    // Told to take only new changes, customers skips what was produced before and orders
    // misses nothing. tansu answers "latest" with the last record batch's base offset + 1: one
    // single-record batch per partition makes that the true end.
    configure("start_without_offsets: latest");
    let ends: Vec<_> = (0..2)
        .map(|p| (p, format!("{{\"id\":{p}}}"), None))
        .collect();
    produced.extend(produce(&broker.bootstrap, &topic, &ends).await);
    let target = end_offset_sum(&produced);
    let mut inlet = Inlet::spawn(&config, &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    eventually(deadline, "inlet did not catch up", async || {
        routed_committed(&lake, &["customers", "orders"], &pipeline).await >= target
    })
    .await;
    let third = produce(&broker.bootstrap, &topic, &stream[600..]).await;
    produced.extend(third.clone());
    let target = end_offset_sum(&produced);
    eventually(deadline, "inlet did not catch up", async || {
        routed_committed(&lake, &["customers", "orders"], &pipeline).await >= target
    })
    .await;
    inlet.stop_cleanly(Duration::from_secs(30));

    assert_eq!(
        routed_rows(&lake, "orders"),
        routed_changes(&produced, "orders")
    );
    let want: BTreeSet<(i64, i64)> = routed_changes(&first, "customers")
        .into_iter()
        .filter(|(p, _)| *p != 0)
        .chain(routed_changes(&third, "customers"))
        .collect();
    assert_eq!(
        routed_rows(&lake, "customers"),
        want,
        "only new changes of customers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pipeline_routes_two_upstream_tables_into_two_tables_exactly_once() {
    let lake = Lake::new();
    let (broker, topic, pipeline) = topic_and_table("dbsync", 2).await;
    let source = format!("topics: [{topic}]");
    let kafka = kafka_sections(&pipeline, &pipeline, &broker.bootstrap, &source);
    let config = routed_config(
        &lake,
        "dbsync",
        &kafka,
        ROUTED_CHANGELOG,
        ROUTED_CHECKPOINTS,
    );
    let stream = database_stream(5, 1200, 2, 700);
    let mut produced = Vec::new();
    // Crash at each step of the multi-table commit, then finish; nothing may be lost or doubled.
    for (i, step) in ["after_upload", "after_metadata_write", "after_commit"]
        .iter()
        .enumerate()
    {
        let chunk = &stream[i * 300..(i + 1) * 300];
        produced.extend(produce(&broker.bootstrap, &topic, chunk).await);
        let before = routed_committed(&lake, &["customers", "orders"], &pipeline).await;
        let mut inlet = lake.spawn(&config, &[("INLET_CRASH_AT", &format!("{step}:2"))]);
        let status = inlet
            .wait_exit(Duration::from_secs(90))
            .unwrap_or_else(|| panic!("no crash at {step}"));
        assert!(!status.success(), "inlet should have crashed at {step}");
        let after = routed_committed(&lake, &["customers", "orders"], &pipeline).await;
        assert!(
            after > before,
            "the first checkpoint before the crash at {step} should have committed"
        );
    }
    // Other tables of the catalog cannot be read for good (a metadata file that is not JSON,
    // one that is missing, another engine's format-version 1 table): the pipeline leaves them
    // out of its resume offsets instead of refusing every assignment. One more cannot be read
    // for now: its metadata file lies below a file where a directory should be, a storage
    // fault that may pass, so no assignment may go ahead without it (it could be one of the
    // pipeline's tables, whose offsets and owner epochs the assignment must see).
    let broken = lake.path().join("broken.metadata.json");
    std::fs::write(&broken, "not json").unwrap();
    let v1_metadata = serde_json::json!({
        "format-version": 1, "table-uuid": "9c12d441-03fe-4693-9a96-a0705ddf69c1",
        "location": format!("file://{}", lake.path().join("v1").display()),
        "last-updated-ms": 1_600_000_000_000i64, "last-column-id": 1,
        "schema": {"type": "struct", "fields": [
            {"id": 1, "name": "id", "required": true, "type": "long"}]},
        "partition-spec": [], "properties": {}, "snapshots": [],
    })
    .to_string();
    let v1 = lake.path().join("v1.metadata.json");
    std::fs::write(&v1, &v1_metadata).unwrap();
    let missing = lake.path().join("missing.metadata.json");
    let blocker = lake.path().join("blocker");
    std::fs::write(&blocker, "a file where a directory should be").unwrap();
    let blocked = blocker.join("blocked.metadata.json");
    let unreadable = [
        ("broken", &broken),
        ("v1", &v1),
        ("missing", &missing),
        ("blocked", &blocked),
    ];
    for (name, file) in unreadable {
        let sql = format!(
            "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, metadata_location) VALUES ('{}', 'elsewhere', '{name}', 'file://{}')",
            lake.catalog_name,
            file.display()
        );
        let out = std::process::Command::new(python())
            .args(["-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute(sys.argv[2]); c.commit()"])
            .arg(lake.path().join("catalog.db"))
            .arg(sql)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    produced.extend(produce(&broker.bootstrap, &topic, &stream[900..]).await);
    let target = end_offset_sum(&produced);
    let before = routed_committed(&lake, &["customers", "orders"], &pipeline).await;
    let log = lake.path().join("dbsync.log");
    let env = lake.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut inlet = Inlet::spawn_logged(&config, &env, &log);
    let refused = wait_for(Duration::from_secs(60), || {
        events_with(&log, "Cannot claim assigned partitions yet")
            .into_iter()
            .find(|e| {
                e["fields"]["error"]
                    .as_str()
                    .is_some_and(|m| m.contains("table=elsewhere.blocked"))
            })
    });
    assert!(
        refused.is_some(),
        "a storage fault on one table of the catalog did not hold the claim: {:?}",
        events_with(&log, "table")
    );
    assert!(
        events_with(&log, "Partitions assigned at table offsets").is_empty(),
        "a claim went ahead without one of the catalog's tables"
    );
    assert_eq!(
        routed_committed(&lake, &["customers", "orders"], &pipeline).await,
        before,
        "nothing commits while the claim waits"
    );
    // The fault passes, and the table turns out to be another engine's v1 table.
    std::fs::remove_file(&blocker).unwrap();
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(&blocked, &v1_metadata).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    eventually(deadline, "inlet did not catch up", async || {
        routed_committed(&lake, &["customers", "orders"], &pipeline).await >= target
    })
    .await;
    inlet.stop_cleanly(Duration::from_secs(30));
    let warned: BTreeSet<String> = events_with(&log, "Cannot read a table of the catalog")
        .iter()
        .filter_map(|e| e["fields"]["table"].as_str().map(str::to_string))
        .collect();
    let want: BTreeSet<String> = unreadable
        .iter()
        .map(|(name, _)| format!("elsewhere.{name}"))
        .collect();
    assert_eq!(warned, want, "tables warned about");
    // `inlet maintain` over the routed tables skips the unreadable ones too.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_inlet"));
    cmd.args(["maintain", "--dry-run", "--config"]).arg(&config);
    for (k, v) in lake.env() {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (name, _) in unreadable {
        assert!(
            stdout.contains(&format!("elsewhere.{name}: skipped")),
            "{name}: {stdout}"
        );
    }
    for name in ["customers", "orders"] {
        assert!(
            stdout.contains(&format!("inventory.{name}: done")),
            "{name}: {stdout}"
        );
    }

    for table in ["customers", "orders"] {
        let expected: BTreeMap<(i64, i64), Json> = produced
            .iter()
            .filter_map(|p| {
                let doc: Json = serde_json::from_str(p.value.as_deref()?).unwrap();
                let payload = &doc["payload"];
                (payload["source"]["table"] == table).then(|| {
                    let image = if payload["op"] == "d" {
                        payload["before"].clone()
                    } else {
                        payload["after"].clone()
                    };
                    ((p.partition as i64, p.offset), image)
                })
            })
            .collect();
        let read = lake.pyiceberg(&format!("inventory.{table}"));
        let rows = read_rows(&read);
        let mut seen = BTreeSet::new();
        for r in rows {
            let pos = position(r);
            assert!(
                seen.insert(pos),
                "{table}: change {pos:?} is in the table twice"
            );
            let image = expected
                .get(&pos)
                .unwrap_or_else(|| panic!("{table}: row {pos:?} is not a change of {table}"));
            assert_eq!(r["id"], image["id"], "{table} {pos:?}");
            if table == "customers" {
                assert_eq!(r["name"], image["name"], "{pos:?}");
                assert_eq!(
                    r["tier"],
                    image.get("tier").cloned().unwrap_or(Json::Null),
                    "{pos:?}"
                );
            } else {
                assert_eq!(r["qty"], image["qty"], "{pos:?}");
                assert!(
                    r["placed_at"].as_str().unwrap().starts_with("2026-01-01"),
                    "{r}"
                );
            }
        }
        assert_eq!(
            seen.len(),
            expected.len(),
            "{table}: every change exactly once"
        );
        let schema: Vec<(String, String)> = read["schema"]
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
        let has = |name: &str, ty: &str| schema.iter().any(|(n, t)| n == name && t == ty);
        if table == "customers" {
            assert!(
                has("id", "long") && has("name", "string") && has("tier", "string"),
                "{schema:?}"
            );
        } else {
            assert!(
                has("qty", "long") && has("placed_at", "timestamp"),
                "{schema:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upsert_table_gains_a_column_mid_stream() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("upevolve", 2).await;
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 150);
    let mut produced = produce(&broker.bootstrap, &topic, &debezium_stream(41, 400, 60, 2)).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    // Later changes (later LSNs) carry a new `note` field.
    let noted: Vec<_> = debezium_stream(42, 400, 60, 2)
        .into_iter()
        .map(|(p, k, v)| {
            let v = v.map(|v| {
                let mut doc: Json = serde_json::from_str(&with_note(&v)).unwrap();
                let payload = if doc.get("schema").is_some() {
                    &mut doc["payload"]
                } else {
                    &mut doc
                };
                let lsn = payload["source"]["lsn"].as_i64().unwrap() + 1_000_000;
                payload["source"]["lsn"] = lsn.into();
                doc.to_string()
            });
            (p, k, v)
        })
        .collect();
    produced.extend(produce(&broker.bootstrap, &topic, &noted).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;

    let read = lake.read(&table);
    assert_live_rows_with_notes(&read, &produced);
    let names: Vec<&str> = read["schema"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.last(), Some(&"_version"), "{names:?}");
    assert!(names.contains(&"note"), "{names:?}");
}

/// Changes are typed on the decoding threads, ahead of the table, and come without their
/// images. When a change of a batch adds a column, the changes after it in that batch were
/// typed for the shape before: they are decoded again in full, so every change lands and the
/// pipeline never stops over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_typed_ahead_for_the_old_shape_land_after_a_column_is_added() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("typedahead", 1).await;
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 100_000);
    // One partition, and a note on every 50th change only: most changes after the first note
    // share its batch and were typed before the column existed.
    let stream: Vec<_> = debezium_stream(43, 600, 80, 1)
        .into_iter()
        .enumerate()
        .map(|(i, (p, k, v))| {
            (
                p,
                k,
                v.map(|v| if i % 50 == 25 { with_note(&v) } else { v }),
            )
        })
        .collect();
    let produced = produce(&broker.bootstrap, &topic, &stream).await;
    let events = run_to_end_logged(&lake, &config, &table, &produced).await;

    let stops: Vec<&Json> = events
        .iter()
        .filter(|e| {
            e["level"] == "ERROR"
                || e["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("restarting"))
        })
        .collect();
    assert!(stops.is_empty(), "the pipeline stopped: {stops:?}");
    let read = lake.read(&table);
    assert_live_rows_with_notes(&read, &produced);
}

/// The model of a Debezium stream whose later changes may carry a `note`: pyiceberg's `read`
/// holds each live key's last image once, its amount and its note (null where it had none), and
/// some key has a note.
fn assert_live_rows_with_notes(read: &Json, produced: &[Produced]) {
    let mut live: BTreeMap<i64, Json> = BTreeMap::new();
    replay(&mut live, produced, Json::clone);
    let mut seen = BTreeSet::new();
    for r in read_rows(read) {
        let id = r["id"].as_i64().unwrap();
        assert!(seen.insert(id), "key {id} twice");
        let want = live
            .get(&id)
            .unwrap_or_else(|| panic!("key {id} is not live"));
        assert_eq!(r["amount"], want["amount"], "{id}");
        assert_eq!(
            r["note"],
            want.get("note").cloned().unwrap_or(Json::Null),
            "{id}"
        );
    }
    assert_eq!(seen.len(), live.len(), "every live key once");
    assert!(live.values().any(|v| v.get("note").is_some()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_engines_snapshot_expiry_never_makes_inlet_replay() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("exp", PARTITIONS).await;
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 500, "");
    let stream = debezium_stream(71, 3_000, 300, PARTITIONS);
    let thirds = in_parts(&stream, 3);
    let mut produced = produce(&broker.bootstrap, &topic, &thirds[0]).await;
    run_to_end(&lake, &config, &table, &produced, &[]).await;

    // Another engine commits (deleting partition 0's rows) and expires every snapshot it can:
    // the tag on inlet's newest commit keeps its offsets.
    foreign_writer(&lake, &table, &["delete", "_kafka_partition = 0"]);
    foreign_writer(&lake, &table, &["expire"]);
    let kept = foreign_writer(&lake, &table, &["snapshot-ids"]);
    assert_eq!(
        kept.lines().count(),
        2,
        "the head and inlet's tagged snapshot: {kept}"
    );
    produced.extend(produce(&broker.bootstrap, &topic, &thirds[1]).await);
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    let want: BTreeSet<(i64, i64)> = produced_changes(&produced)
        .into_iter()
        .filter(|(p, o)| *p != 0 || *o >= end_offsets(&produced[..thirds[0].len()])[&0])
        .collect();
    assert_eq!(
        changelog_positions(&lake.read(&table)),
        want,
        "nothing replayed"
    );

    // With the tag removed too, no snapshot holds the pipeline's offsets: inlet refuses to
    // guess and names the setting that decides.
    foreign_writer(&lake, &table, &["delete", "_kafka_partition = 1"]);
    foreign_writer(&lake, &table, &["remove-tag", &format!("inlet-{table}")]);
    foreign_writer(&lake, &table, &["expire"]);
    let log = lake.path().join("refused.log");
    let mut refused = Inlet::spawn_logged(&config, &[], &log);
    let status = refused
        .wait_exit(Duration::from_secs(60))
        .expect("inlet exits");
    assert_eq!(status.code(), Some(2), "a configuration error");
    let out = std::fs::read_to_string(&log).unwrap();
    assert!(out.contains("kafka.start_without_offsets"), "{out}");
    // Told to start at the end, it reads only what is produced from then on.
    let text = std::fs::read_to_string(&config).unwrap().replace(
        &format!("group_id: {table}\n"),
        &format!("group_id: {table}\n  start_without_offsets: latest\n"),
    );
    std::fs::write(&config, text).unwrap();
    // tansu answers "latest" with the last record batch's base offset + 1: one single-record
    // batch per partition makes that the true end.
    let ends: Vec<_> = (0..PARTITIONS)
        .map(|p| (p, format!("{{\"id\":{p}}}"), None))
        .collect();
    produced.extend(produce(&broker.bootstrap, &topic, &ends).await);
    let before = changelog_positions(&lake.read(&table));
    let mut inlet = Inlet::spawn(&config, &[]);
    tokio::time::sleep(Duration::from_secs(8)).await;
    let third = produce(&broker.bootstrap, &topic, &thirds[2]).await;
    produced.extend(third.clone());
    assert!(
        caught_up(&lake, &table, &produced, 120).await,
        "inlet did not catch up"
    );
    inlet.stop_cleanly(Duration::from_secs(60));
    let after = changelog_positions(&lake.read(&table));
    let new: BTreeSet<_> = after.difference(&before).copied().collect();
    assert_eq!(
        new,
        produced_changes(&third),
        "only the new changes were read"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_changes_by_another_engine_survive_inlets_commits() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("fs", 2).await;
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 100_000, "");
    let mut inlet = Inlet::spawn(&config, &[]);
    let mut produced = produce(&broker.bootstrap, &topic, &debezium_stream(81, 300, 50, 2)).await;
    assert!(
        caught_up(&lake, &table, &produced, 120).await,
        "inlet did not catch up"
    );
    // While inlet runs, another engine adds, renames and drops columns.
    foreign_writer(&lake, &table, &["add-column", "extra", "string"]);
    foreign_writer(&lake, &table, &["rename-column", "amount", "amount_eur"]);
    foreign_writer(&lake, &table, &["drop-column", "_source_ts"]);
    // Later changes carry a new field: inlet's schema change meets the other engine's.
    let noted: Vec<_> = debezium_stream(82, 300, 50, 2)
        .into_iter()
        .map(|(p, k, v)| (p, k, v.map(|v| with_note(&v))))
        .collect();
    produced.extend(produce(&broker.bootstrap, &topic, &noted).await);
    assert!(
        caught_up(&lake, &table, &produced, 120).await,
        "inlet did not catch up"
    );
    inlet.stop_cleanly(Duration::from_secs(60));

    let t = lake.table("test", &table).await.unwrap();
    let current = t.metadata.current_schema().unwrap();
    let names: Vec<&str> = current.fields.iter().map(|f| f.name.as_str()).collect();
    for kept in ["extra", "amount_eur", "note"] {
        assert!(names.contains(&kept), "{kept} missing from {names:?}");
    }
    assert!(
        !names.contains(&"_source_ts"),
        "the dropped column came back: {names:?}"
    );
    // No field id ever names two columns or two types, in any schema.
    let mut by_id: BTreeMap<i32, (String, String)> = BTreeMap::new();
    for schema in &t.metadata.schemas {
        for f in &schema.fields {
            let ty = f.ty.to_string();
            let seen = by_id.entry(f.id).or_insert((f.name.clone(), ty.clone()));
            assert_eq!(seen.1, ty, "field id {} has two types", f.id);
        }
    }
    let ids: BTreeSet<i32> = current.fields.iter().map(|f| f.id).collect();
    assert_eq!(
        ids.len(),
        current.fields.len(),
        "duplicate field ids: {names:?}"
    );
    // Every change is there once, and pyiceberg reads the table.
    let positions = changelog_positions(&lake.read(&table));
    assert_eq!(positions, produced_changes(&produced));
}

/// The S3 server goes away while inlet checkpoints and comes back: uploads and commits fail,
/// the pipeline restarts from the table's offsets, and nothing is lost or duplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_outage_mid_checkpoint_loses_and_duplicates_nothing() {
    let mut lake = Lake::on(Store::S3s);
    let (broker, topic, table) = topic_and_table("outage", PARTITIONS).await;
    let stream = debezium_stream(77, 6000, 500, PARTITIONS);
    let (before, during) = stream.split_at(stream.len() / 2);
    let mut produced = produce(&broker.bootstrap, &topic, before).await;
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 100, "");
    let log = lake.path().join("outage.log");
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    assert_committed(
        &lake,
        &table,
        1,
        Duration::from_secs(90),
        "nothing committed before the outage",
    )
    .await;
    lake.s3.as_mut().unwrap().stop();
    // Records arriving during the outage make checkpoints that must fail, however fast the
    // first half went.
    produced.extend(produce(&broker.bootstrap, &topic, during).await);
    // Long enough for the retries of a request to run out and the pipeline to fail.
    tokio::time::sleep(Duration::from_secs(15)).await;
    lake.s3.as_mut().unwrap().restart();
    assert!(
        caught_up(&lake, &table, &produced, 240).await,
        "inlet did not catch up after the outage"
    );
    inlet.stop_cleanly(Duration::from_secs(60));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        // Met by a checkpoint: its commit retried through the outage, or it failed and the
        // pipeline restarted from the table's offsets.
        text.contains("Pipeline failed; restarting from the table's offsets")
            || text.contains("Commit attempt failed; retrying"),
        "the outage did not fail a checkpoint: {text}"
    );
    assert_exactly_once(&lake, &table, &produced).await;
}
