//! Operating inlet: faults injected one at a time into real components (a tansu broker, a
//! PostgreSQL server of the test's own, the SQLite catalog, the local warehouse), checked
//! through what an operator sees: `/health/ready`, metrics, exit codes and log lines.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value as Json;

/// Quick probes and a short fault grace, so tests see faults in seconds.
const FAST_HEALTH: &str = "health:\n  probe_interval_ms: 1000\n  fault_grace_ms: 3000\n";

/// A topic that does not exist yet makes the process unready, naming the topic; once created
/// it is consumed within about 30 s (librdkafka's default metadata refresh takes 5 minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_is_unready_and_consumed_soon_after_it_is_created() {
    let broker = Broker::shared();
    let lake = Lake::new();
    let (topic, table) = (unique("late"), unique("late"));
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 100, &addr);
    extend_config(&config, FAST_HEALTH);
    let log = lake.log_path();
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    wait_topic_missing(&addr, &topic);

    create_topic(&broker.bootstrap, &topic, 2).await;
    let produced = produce(&broker.bootstrap, &topic, &debezium_stream(5, 200, 50, 2)).await;
    assert!(
        caught_up(&lake, &table, &produced, 45).await,
        "the new topic was not consumed within 45 s of its creation"
    );
    wait_health(&addr, 200, &["topics: ok"], Duration::from_secs(30));
    assert_eq!(
        events_with(&log, "Configured topics do not exist").len(),
        1,
        "the missing topic is logged once"
    );
    // Progress before the first commit: where each partition starts.
    let assigned = events_with(&log, "Partitions assigned at table offsets");
    let positions = assigned[0]["fields"]["positions"]
        .as_str()
        .unwrap_or_default();
    assert!(
        positions.contains(&format!("{topic}/0@start"))
            && positions.contains(&format!("{topic}/1@start")),
        "{assigned:?}"
    );
    inlet.stop_cleanly(Duration::from_secs(60));
    assert_eq!(lake.row_count(&table), produced_changes(&produced).len());
}

/// With the broker gone the process turns unready after the grace, logs the fault once (not
/// once per librdkafka retry) and still exits 0 on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_broker_is_unready_logged_once_and_sigterm_still_exits() {
    let broker = Broker::start();
    let lake = Lake::new();
    let (topic, table) = (unique("gone"), unique("gone"));
    create_topic(&broker.bootstrap, &topic, 2).await;
    let produced = produce(&broker.bootstrap, &topic, &debezium_stream(6, 100, 30, 2)).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 100, &addr);
    extend_config(&config, FAST_HEALTH);
    let log = lake.log_path();
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    assert!(
        caught_up(&lake, &table, &produced, 90).await,
        "inlet did not catch up"
    );
    wait_health(&addr, 200, &["broker: ok"], Duration::from_secs(30));

    drop(broker);
    wait_health(&addr, 503, &["broker: FAIL"], Duration::from_secs(60));
    let scraped = scrape(&addr);
    assert_eq!(
        metric(&scraped, "inlet_health_up{component=\"broker\"}"),
        0.0,
        "{scraped}"
    );
    // librdkafka keeps reconnecting meanwhile; none of that is repeated in the log.
    std::thread::sleep(Duration::from_secs(5));
    let failures = metric(
        &scrape(&addr),
        "inlet_health_failures_total{component=\"broker\"}",
    );
    assert!(
        failures >= 2.0,
        "failures are counted each time: {failures}"
    );
    assert_eq!(
        events_with(&log, "Kafka is failing").len(),
        1,
        "logged once"
    );
    let noisy: Vec<Json> = log_events(&log)
        .into_iter()
        .filter(|e| {
            matches!(e["level"].as_str(), Some("WARN" | "ERROR"))
                && e["target"].as_str().is_some_and(|t| t.contains("rdkafka"))
        })
        .collect();
    assert!(
        noisy.is_empty(),
        "librdkafka lines at warn or error: {noisy:?}"
    );
    inlet.stop_cleanly(Duration::from_secs(60));
}

/// An unreachable catalog: not ready (naming the catalog and the real cause), each failed
/// start counted but logged once, and SIGTERM during the restart backoff exits 0 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_catalog_backs_off_quietly_and_sigterm_ends_the_backoff_at_once() {
    let mut lake = Lake::new();
    // Nothing listens there: every connection is refused.
    lake.catalog_uri = format!("postgresql://inlet@127.0.0.1:{}/inlet", free_port());
    let (topic, table) = (unique("nocat"), unique("nocat"));
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, "127.0.0.1:9", &topic, &table, 100, &addr);
    let log = lake.log_path();
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    // Backoff 1 s, 2 s, 4 s: the fourth delay is 8 s.
    let body = wait_health(
        &addr,
        503,
        &["(attempt 4)", "catalog: FAIL", "Connection refused"],
        Duration::from_secs(60),
    );
    assert!(body.contains("assignment: FAIL"), "{body}");
    let scraped = scrape(&addr);
    assert!(
        metric(
            &scraped,
            "inlet_pipeline_restarts_total{reason=\"catalog\"}"
        ) >= 4.0,
        "{scraped}"
    );
    assert_eq!(
        events_with(&log, "could not start").len(),
        1,
        "the same failure is logged once"
    );
    assert!(events_with(&log, "restarting from the table's offsets").is_empty());

    let asked = Instant::now();
    inlet.sigterm();
    let status = inlet.wait_exit(Duration::from_secs(5));
    assert!(
        status.is_some_and(|s| s.success()),
        "SIGTERM during an 8 s backoff: {status:?} after {:?}",
        asked.elapsed()
    );
}

/// A minimal config that never reaches Kafka: the catalog or the warehouse fails first.
fn offline_config(dir: &Path, catalog_uri: &str, warehouse: &str) -> PathBuf {
    let path = dir.join(format!("{}.yaml", unique("offline")));
    std::fs::write(
        &path,
        format!(
            r#"pipeline_id: offline
kafka: {{bootstrap_servers: "127.0.0.1:9", group_id: g, topics: [t]}}
table:
  namespace: test
  name: t
  columns: [{{name: id, type: long, required: true}}]
catalog: {{uri: "{catalog_uri}", warehouse: "{warehouse}"}}
metrics: {{listen: ""}}
"#
        ),
    )
    .unwrap();
    path
}

/// Runs `inlet run` to its end: exit code and the JSON log events.
fn run_to_exit(config: &Path, log: &Path) -> (i32, Vec<Json>) {
    let mut inlet = Inlet::spawn_logged(config, &[], log);
    let status = inlet
        .wait_exit(Duration::from_secs(60))
        .expect("a permanent misconfiguration ends the process instead of retrying");
    (status.code().unwrap_or(-1), log_events(log))
}

/// Misconfigurations no retry can cure end the process at once with exit code 2 and one log
/// line (JSON, as configured) naming the setting, its value and the fix.
#[test]
fn permanent_misconfigurations_exit_at_once_naming_the_setting_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    std::fs::write(dir.path().join("a-file"), "not a directory").unwrap();
    std::fs::write(dir.path().join("garbage.db"), vec![7u8; 4096]).unwrap();
    std::fs::create_dir(dir.path().join("a-directory.db")).unwrap();
    let pg = Postgres::start();
    let good_warehouse = format!("{d}/warehouse");
    let cases: Vec<(&str, String, String, Vec<String>)> = vec![
        (
            "catalog directory cannot be created",
            format!("sqlite:///{d}/a-file/catalog.db"),
            good_warehouse.clone(),
            vec![
                "catalog.uri".into(),
                format!("{d}/a-file"),
                "writable".into(),
            ],
        ),
        (
            "SQLite file is not a database",
            format!("sqlite:///{d}/garbage.db"),
            good_warehouse.clone(),
            vec![
                "catalog.uri".into(),
                "garbage.db".into(),
                "not a database".into(),
                "writable location".into(),
            ],
        ),
        (
            "SQLite file cannot be opened",
            format!("sqlite:///{d}/a-directory.db"),
            good_warehouse.clone(),
            vec![
                "catalog.uri".into(),
                "a-directory.db".into(),
                "writable location".into(),
            ],
        ),
        (
            "warehouse cannot be written",
            format!("sqlite:///{d}/catalog.db"),
            format!("{d}/a-file/warehouse"),
            vec![
                "catalog.warehouse".into(),
                format!("{d}/a-file/warehouse"),
                "Not a directory".into(),
                "writable".into(),
            ],
        ),
        (
            "PostgreSQL rejects the password",
            pg.uri("wrong-password"),
            good_warehouse.clone(),
            vec![
                "catalog.uri".into(),
                "password authentication failed".into(),
                "inlet:***@".into(),
                "fix the user and password".into(),
            ],
        ),
        (
            "PostgreSQL database does not exist",
            pg.uri(PG_PASSWORD).replace("/postgres", "/no_such_db"),
            good_warehouse.clone(),
            vec![
                "catalog.uri".into(),
                "no_such_db".into(),
                "does not exist".into(),
            ],
        ),
    ];
    for (case, uri, warehouse, wanted) in cases {
        let config = offline_config(dir.path(), &uri, &warehouse);
        let log = dir.path().join(format!("{}.log", unique("log")));
        let (code, events) = run_to_exit(&config, &log);
        let errors: Vec<&Json> = events.iter().filter(|e| e["level"] == "ERROR").collect();
        assert_eq!(code, 2, "{case}: exit code; log: {events:?}");
        assert_eq!(errors.len(), 1, "{case}: one error line: {events:?}");
        let text = errors[0]["fields"]["error"].as_str().unwrap_or_default();
        for w in &wanted {
            assert!(
                text.contains(w.as_str()),
                "{case}: {w:?} missing from: {text}"
            );
        }
        assert!(
            !text.contains("wrong-password"),
            "{case}: the password is shown: {text}"
        );
        assert!(
            events.iter().all(|e| !e["fields"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("retrying")),
            "{case}: retried: {events:?}"
        );
    }
}

/// Commit retries ride out a catalog restart of a minute: the checkpoint waiting on it commits
/// once the catalog is back, nothing fails or restarts, and readiness reported the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_ride_out_a_catalog_restart_of_a_minute() {
    let pg = Postgres::start();
    let lake = Lake::postgres(&pg.uri(PG_PASSWORD));
    let (broker, topic, table) = topic_and_table("pgre", 2).await;
    let mut produced = produce(&broker.bootstrap, &topic, &debezium_stream(8, 200, 50, 2)).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 100, &addr);
    extend_config(
        &config,
        "health:\n  probe_interval_ms: 1000\n  fault_grace_ms: 10000\n",
    );
    let mut inlet = Inlet::spawn(&config, &[]);
    assert!(
        caught_up(&lake, &table, &produced, 90).await,
        "inlet did not catch up"
    );
    wait_health(&addr, 200, &["catalog: ok"], Duration::from_secs(30));

    pg.stop();
    let stopped = Instant::now();
    produced.extend(produce(&broker.bootstrap, &topic, &debezium_stream(9, 200, 50, 2)).await);
    wait_health(&addr, 503, &["catalog: FAIL"], Duration::from_secs(60));
    std::thread::sleep(Duration::from_secs(60).saturating_sub(stopped.elapsed()));
    pg.resume();

    assert!(
        caught_up(&lake, &table, &produced, 120).await,
        "the checkpoint did not commit after the catalog came back"
    );
    wait_health(
        &addr,
        200,
        &["catalog: ok", "checkpoint: ok"],
        Duration::from_secs(60),
    );
    let scraped = scrape(&addr);
    assert_eq!(
        metric(
            &scraped,
            "inlet_commit_checkpoints_total{result=\"failed\"}"
        ),
        0.0,
        "{scraped}"
    );
    assert_eq!(
        metric_sum(&scraped, "inlet_pipeline_restarts_total"),
        0.0,
        "{scraped}"
    );
    assert!(metric(&scraped, "inlet_commit_retries_total{reason=\"error\"}") > 0.0);
    inlet.stop_cleanly(Duration::from_secs(60));
    assert_eq!(lake.row_count(&table), produced_changes(&produced).len());
}

/// A pipeline that ran well and then failed restarts after the first backoff step, not where
/// the failures before its good run had left the backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restart_backoff_starts_over_after_a_good_run() {
    let pg = Postgres::start();
    pg.stop();
    let lake = Lake::postgres(&pg.uri(PG_PASSWORD));
    let (broker, topic, table) = topic_and_table("reset", 1).await;
    let mut produced = produce(&broker.bootstrap, &topic, &debezium_stream(10, 100, 30, 1)).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 50, &addr);
    let text = std::fs::read_to_string(&config).unwrap();
    let text = text.replace("checkpoint:\n", "checkpoint:\n  commit_timeout_ms: 3000\n");
    std::fs::write(&config, text).unwrap();
    let log = lake.log_path();
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    // Failed starts: 1 s, 2 s, 4 s; the next failure would wait 8 s, then 16 s.
    wait_health(&addr, 503, &["(attempt 3)"], Duration::from_secs(60));
    pg.resume();
    assert!(
        caught_up(&lake, &table, &produced, 90).await,
        "inlet did not catch up"
    );

    pg.stop();
    produced.extend(produce(&broker.bootstrap, &topic, &debezium_stream(11, 100, 30, 1)).await);
    let failed = wait_for(Duration::from_secs(120), || {
        events_with(&log, "Pipeline failed; restarting from the table's offsets")
            .into_iter()
            .next()
    })
    .expect("the commit failure restarts the pipeline");
    assert_eq!(failed["fields"]["retry_in_ms"], 1000, "{failed}");
    pg.resume();
    assert!(
        caught_up(&lake, &table, &produced, 120).await,
        "inlet did not catch up"
    );
    inlet.stop_cleanly(Duration::from_secs(60));
    assert_eq!(lake.row_count(&table), produced_changes(&produced).len());
}

/// A warehouse that stops taking writes fails checkpoints, counted and shown in readiness;
/// once writes work again everything lands exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warehouse_that_refuses_writes_fails_checkpoints_visibly_and_recovers() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("wh", 2).await;
    let mut produced = produce(&broker.bootstrap, &topic, &debezium_stream(12, 200, 50, 2)).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 100, &addr);
    extend_config(&config, FAST_HEALTH);
    let mut inlet = Inlet::spawn(&config, &[]);
    assert!(
        caught_up(&lake, &table, &produced, 90).await,
        "inlet did not catch up"
    );

    // A file where the data directory was: no new data file can be written below it (this
    // holds for root too, unlike permissions).
    let data = Path::new(&lake.warehouse).join(format!("test.db/{table}/data"));
    let aside = data.with_extension("aside");
    std::fs::rename(&data, &aside).unwrap();
    std::fs::write(&data, "not a directory").unwrap();
    produced.extend(produce(&broker.bootstrap, &topic, &debezium_stream(13, 200, 50, 2)).await);
    let body = wait_health(
        &addr,
        503,
        &[
            "checkpoint: FAIL: the last checkpoint failed",
            "Not a directory",
        ],
        Duration::from_secs(60),
    );
    let scraped = scrape(&addr);
    assert!(
        metric(
            &scraped,
            "inlet_commit_checkpoints_total{result=\"failed\"}"
        ) >= 1.0,
        "{body}{scraped}"
    );
    // The restart is counted once the failed run has closed its consumer.
    assert!(wait_for(Duration::from_secs(15), || (metric(
        &scrape(&addr),
        "inlet_pipeline_restarts_total{reason=\"storage\"}"
    ) >= 1.0)
        .then_some(()))
    .is_some());

    std::fs::remove_file(&data).unwrap();
    std::fs::rename(&aside, &data).unwrap();
    assert!(
        caught_up(&lake, &table, &produced, 120).await,
        "inlet did not catch up"
    );
    wait_health(&addr, 200, &["checkpoint: ok"], Duration::from_secs(60));
    inlet.stop_cleanly(Duration::from_secs(60));
    assert_eq!(lake.row_count(&table), produced_changes(&produced).len());
}

/// Under the default `errors.policy: fail` a bad record stops the pipeline and the process
/// stays up, unready, naming the record in health, a gauge and one log line: no crash loop.
/// A skip request for exactly that record, bearing `metrics.admin_token`, or a changed config
/// file, lets it go on; without a configured token, or without the right one, a skip is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_record_stops_the_pipeline_visibly_until_skipped_or_reconfigured() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("bad", 1).await;
    let mut good = produce(&broker.bootstrap, &topic, &debezium_stream(14, 60, 20, 1)).await;
    let first_bad = produce(
        &broker.bootstrap,
        &topic,
        &[(0, "k".into(), Some("{not json".into()))],
    )
    .await;
    let bad_offset = first_bad[0].offset;
    good.extend(produce(&broker.bootstrap, &topic, &debezium_stream(15, 60, 20, 1)).await);
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 25, &addr);
    extend_config(&config, FAST_HEALTH);
    let log = lake.log_path();
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);

    let stopped_at =
        format!("stopped at the bad record topic={topic} partition=0 offset={bad_offset}");
    wait_health(
        &addr,
        503,
        &[&stopped_at, "(reason malformed)"],
        Duration::from_secs(90),
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        inlet.child.try_wait().unwrap().is_none(),
        "the process stays up"
    );
    let scraped = scrape(&addr);
    let gauge = format!(
        "inlet_pipeline_stopped_offset{{partition=\"0\",reason=\"malformed\",topic=\"{topic}\"}}"
    );
    assert_eq!(metric(&scraped, &gauge), bad_offset as f64, "{scraped}");
    assert_eq!(
        metric(
            &scraped,
            "inlet_bad_records_total{action=\"failed\",reason=\"malformed\"}"
        ),
        1.0,
        "counted once, and still there to alert on: {scraped}"
    );
    assert_eq!(
        metric_sum(&scraped, "inlet_pipeline_restarts_total"),
        1.0,
        "no crash loop"
    );

    // Admin actions are off without metrics.admin_token, token or not.
    let right = format!("/errors/skip?topic={topic}&partition=0&offset={bad_offset}");
    for headers in [&[][..], &["Authorization: Bearer anything"][..]] {
        let (status, body) = http_with("POST", &addr, &right, headers);
        assert_eq!(status, 403, "{headers:?}: {body}");
        assert!(body.contains("set metrics.admin_token"), "{body}");
    }
    wait_health(&addr, 503, &[&stopped_at], Duration::from_secs(5));

    // SIGTERM while stopped ends the process at once, with 0, keeping what was committed
    // before the bad record; a new process, now with a token, stops at the same record.
    inlet.sigterm();
    let asked = Instant::now();
    let status = inlet.wait_exit(Duration::from_secs(5));
    assert!(
        status.is_some_and(|s| s.success()),
        "SIGTERM while stopped: {status:?} after {:?}",
        asked.elapsed()
    );
    assert_eq!(
        lake.committed_total("test", &table, &table).await,
        bad_offset,
        "the records before the bad one are committed"
    );
    let token = format!("t0ken-{}", unique("admin"));
    let with_token = [("INLET__METRICS__ADMIN_TOKEN", token.as_str())];
    let log = lake.log_path();
    let mut inlet = Inlet::spawn_logged(&config, &with_token, &log);
    wait_health(
        &addr,
        503,
        &[&stopped_at, "(reason malformed)"],
        Duration::from_secs(90),
    );

    let bearer = format!("Authorization: Bearer {token}");
    let almost = format!("Authorization: Bearer {token}x");
    for headers in [
        &[][..],
        &["Authorization: Bearer wrong"],
        &[almost.as_str()],
    ] {
        let (status, body) = http_with("POST", &addr, &right, headers);
        assert_eq!(status, 401, "{headers:?}: {body}");
        assert!(!body.contains(&token), "{body}");
    }
    wait_health(&addr, 503, &[&stopped_at], Duration::from_secs(5));
    let wrong = format!(
        "/errors/skip?topic={topic}&partition=0&offset={}",
        bad_offset + 1
    );
    assert_eq!(
        http_with("POST", &addr, &wrong, &[bearer.as_str()]).0,
        409,
        "only the record it stopped at"
    );
    let (status, body) = http_with("POST", &addr, &right, &[bearer.as_str()]);
    assert_eq!(status, 200, "{body}");
    let target = good.iter().map(|p| p.offset + 1).max().unwrap();
    assert!(
        wait_table_committed(&lake, &table, target, Duration::from_secs(90)).await,
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    wait_health(&addr, 200, &["pipeline: ok"], Duration::from_secs(30));
    assert_eq!(
        metric(
            &scrape(&addr),
            "inlet_bad_records_total{action=\"skipped\",reason=\"malformed\"}"
        ),
        1.0
    );

    // Another bad record; this time the operator changes the policy in the config file.
    let second_bad = produce(
        &broker.bootstrap,
        &topic,
        &[(0, "k".into(), Some("[1,".into()))],
    )
    .await;
    good.extend(produce(&broker.bootstrap, &topic, &debezium_stream(16, 40, 20, 1)).await);
    let stopped_at = format!("offset={} (reason malformed)", second_bad[0].offset);
    wait_health(&addr, 503, &[&stopped_at], Duration::from_secs(90));
    extend_config(&config, "errors:\n  policy: skip\n");
    let target = good.iter().map(|p| p.offset + 1).max().unwrap();
    assert!(
        wait_table_committed(&lake, &table, target, Duration::from_secs(90)).await,
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    wait_health(&addr, 200, &["pipeline: ok"], Duration::from_secs(30));
    assert_eq!(events_with(&log, "Stopped at a bad record").len(), 2);
    inlet.stop_cleanly(Duration::from_secs(60));
    assert_eq!(lake.row_count(&table), produced_changes(&good).len());
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(!logged.contains(&token), "the token is logged: {logged}");
    let shown = Command::new(env!("CARGO_BIN_EXE_inlet"))
        .args(["validate", "--config"])
        .arg(&config)
        .envs(with_token)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.status.success(), "{shown:?}");
    assert!(stdout.contains("admin_token: '***'"), "{stdout}");
    assert!(!stdout.contains(&token), "{stdout}");
}

/// Records that change no table (only tombstones here) still commit their offsets on the
/// checkpoint interval, so an idle topic's position and lag move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_that_change_no_table_still_commit_their_offsets() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("idle", 1).await;
    let tombstones: Vec<_> = (0..5)
        .map(|i| (0, format!("{{\"id\":{i}}}"), None))
        .collect();
    let produced = produce(&broker.bootstrap, &topic, &tombstones).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 1000, &addr);
    let mut inlet = Inlet::spawn(&config, &[]);
    assert!(
        wait_table_committed(
            &lake,
            &table,
            produced.len() as i64,
            Duration::from_secs(60)
        )
        .await,
        "the tombstones' offsets were not committed"
    );
    let series = format!("inlet_source_lag_records{{partition=\"0\",topic=\"{topic}\"}}");
    assert!(wait_for(Duration::from_secs(30), || {
        (try_metric(&scrape(&addr), &series) == Some(0.0)).then_some(())
    })
    .is_some());
    inlet.stop_cleanly(Duration::from_secs(60));
}

/// Upsert tables count the rows they write (the data files' rows), like changelog tables.
/// Compaction is off: once the pipeline is idle it rewrites files without their deleted rows,
/// and could land between the scrape and the read of the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upsert_tables_count_the_rows_they_write() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("uprows", 2).await;
    let stream = upsert_stream(17, 400, 60, 2);
    let produced = produce(&broker.bootstrap, &topic, &stream.messages).await;
    let config = upsert_config(&lake, &topic, &table, "deduplicate", 100);
    let addr = format!("127.0.0.1:{}", free_port());
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("listen: \"\"", &format!("listen: \"{addr}\""));
    std::fs::write(&config, format!("{text}services:\n  compact: false\n")).unwrap();
    let mut inlet = Inlet::spawn(&config, &[]);
    assert!(
        caught_up(&lake, &table, &produced, 120).await,
        "inlet did not catch up"
    );
    let scraped = scrape(&addr);
    let written = metric(
        &scraped,
        &format!("inlet_write_rows_total{{table=\"test.{table}\"}}"),
    );
    let t = lake.table("test", &table).await.unwrap();
    let in_files: i64 = t
        .live_entries()
        .await
        .unwrap()
        .iter()
        .filter(|e| e.data_file.content == inlet::table::manifest::FileContent::Data)
        .map(|e| e.data_file.record_count)
        .sum();
    assert!(in_files > 0);
    assert_eq!(written, in_files as f64, "{scraped}");
    inlet.stop_cleanly(Duration::from_secs(60));
}

/// Text logs written to a file or a pipe carry no colour codes.
#[test]
fn text_logs_to_a_file_have_no_colour_codes() {
    let mut lake = Lake::new();
    lake.catalog_uri = format!("postgresql://inlet@127.0.0.1:{}/inlet", free_port());
    let config = changelog_config(&lake, "127.0.0.1:9", "t", "t", 100, "");
    let log = lake.log_path();
    let file = std::fs::File::create(&log).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_inlet"));
    cmd.args(["run", "--config"]).arg(&config);
    cmd.env_remove("NO_COLOR").env_remove("INLET_LOG_FORMAT");
    let mut inlet = Inlet {
        child: cmd.stderr(file).spawn().unwrap(),
    };
    let text = wait_for(Duration::from_secs(60), || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("could not start").then_some(text)
    })
    .expect("a log line about the unreachable catalog");
    assert!(!text.contains('\u{1b}'), "colour codes in a file: {text:?}");
    inlet.stop_cleanly(Duration::from_secs(60));
}

/// SIGTERM while a checkpoint's commit retries a catalog that is down: the process gives the
/// commit `checkpoint.shutdown_timeout_ms`, then exits 0; the records are read again later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_commit_retries_exits_0_after_the_shutdown_timeout() {
    let pg = Postgres::start();
    let lake = Lake::postgres(&pg.uri(PG_PASSWORD));
    let (broker, topic, table) = topic_and_table("term", 1).await;
    let mut produced = produce(&broker.bootstrap, &topic, &debezium_stream(18, 50, 20, 1)).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 1000, &addr);
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace(
            "checkpoint:\n",
            "checkpoint:\n  shutdown_timeout_ms: 3000\n",
        ),
    )
    .unwrap();
    let log = lake.log_path();
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    assert!(
        caught_up(&lake, &table, &produced, 90).await,
        "inlet did not catch up"
    );

    pg.stop();
    produced.extend(produce(&broker.bootstrap, &topic, &debezium_stream(19, 50, 20, 1)).await);
    let retry = wait_for(Duration::from_secs(60), || {
        events_with(&log, "Commit attempt failed; retrying").pop()
    })
    .expect("the checkpoint retries its commit");
    // The line names why there is no connection, not only that the pool had none.
    let error = retry["fields"]["error"].as_str().unwrap_or_default();
    assert!(error.contains("refused"), "{retry}");
    assert!(!error.contains("pool timed out"), "{retry}");
    inlet.stop_cleanly(Duration::from_secs(30));
    assert_eq!(
        events_with(&log, "did not finish in time").len(),
        1,
        "the exit says the last checkpoint was left behind"
    );

    // The records the abandoned checkpoint held land with the next run.
    pg.resume();
    run_to_end(&lake, &config, &table, &produced, &[]).await;
    assert_eq!(lake.row_count(&table), produced_changes(&produced).len());
}

/// A broker that refuses the client's credentials is a permanent misconfiguration too: exit 2,
/// one line naming `kafka.properties` and the fix, no retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_refusing_the_credentials_ends_the_process_naming_the_setting() {
    let broker = Broker::start_with(&["--authentication"]);
    let lake = Lake::new();
    let (topic, table) = (unique("auth"), unique("auth"));
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 100, "");
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "    session.timeout.ms: \"6000\"\n",
        "    session.timeout.ms: \"6000\"\n    security.protocol: SASL_PLAINTEXT\n    sasl.mechanism: SCRAM-SHA-256\n    sasl.username: inlet\n    sasl.password: \"${env:INLET_TEST_KAFKA_PASSWORD}\"\n",
    );
    std::fs::write(&config, text).unwrap();
    let log = lake.log_path();
    let mut inlet = Inlet::spawn_logged(&config, &[("INLET_TEST_KAFKA_PASSWORD", "not-it")], &log);
    let status = inlet
        .wait_exit(Duration::from_secs(60))
        .expect("refused credentials end the process");
    assert_eq!(status.code(), Some(2), "{:?}", log_events(&log));
    let errors: Vec<Json> = log_events(&log)
        .into_iter()
        .filter(|e| e["level"] == "ERROR")
        .collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    let text = errors[0]["fields"]["error"].as_str().unwrap_or_default();
    for wanted in [
        "kafka.properties",
        &broker.bootstrap,
        "SASL",
        "sasl.password",
    ] {
        assert!(text.contains(wanted), "{wanted:?} missing from: {text}");
    }
    assert!(!text.contains("not-it"), "the password is shown: {text}");
}

/// Freshness after a restart: the table records the newest source timestamp it holds, so a
/// restarted process exports the source timestamp and freshness before it commits anything
/// (here it never does: nothing new arrives), instead of no series until the first commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freshness_is_exported_from_the_start_after_a_restart() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("fresh", 2).await;
    let produced = produce(&broker.bootstrap, &topic, &debezium_stream(5, 300, 50, 2)).await;
    let newest_ms = newest_source_ms(&produced);
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 100, "");
    let mut inlet = Inlet::spawn(&config, &[]);
    assert!(
        caught_up(&lake, &table, &produced, 90).await,
        "inlet did not catch up"
    );
    inlet.stop_cleanly(Duration::from_secs(60));

    let addr = format!("127.0.0.1:{}", free_port());
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("listen: \"\"", &format!("listen: \"{addr}\""));
    std::fs::write(&config, text).unwrap();
    let mut inlet = Inlet::spawn(&config, &[]);
    let label = format!("{{table=\"test.{table}\"}}");
    let source = format!("inlet_commit_source_timestamp_seconds{label}");
    let scraped = wait_for(Duration::from_secs(60), || {
        std::net::TcpStream::connect(&addr).ok()?;
        let s = scrape(&addr);
        s.contains(&format!("{source} ")).then_some(s)
    })
    .expect("no source timestamp after the restart");
    assert_eq!(
        metric(&scraped, &source),
        newest_ms as f64 / 1000.0,
        "{scraped}"
    );
    let freshness = metric(&scraped, &format!("inlet_commit_freshness_seconds{label}"));
    let expected = inlet::table::now_ms() as f64 / 1000.0 - newest_ms as f64 / 1000.0;
    assert!(
        (freshness - expected).abs() < 30.0,
        "freshness {freshness}, expected about {expected}"
    );
    inlet.stop_cleanly(Duration::from_secs(60));
}

/// What an operator sees before the first commit and when only the storage fails: lag from
/// assignment on (the table holds no offsets yet, so all of each partition), liveness, build
/// info and process metrics; then a warehouse whose probe directory cannot be written fails
/// the `storage` check, naming the cause, and passes again once it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_any_commit_lag_liveness_and_process_metrics_show_and_storage_faults_fail_ready() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("first", 2).await;
    let produced = produce(&broker.bootstrap, &topic, &debezium_stream(21, 300, 50, 2)).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 1_000_000, &addr);
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("interval_ms: 1000", "interval_ms: 600000");
    std::fs::write(&config, text).unwrap();
    extend_config(&config, FAST_HEALTH);
    let mut inlet = Inlet::spawn(&config, &[]);

    // tansu answers ListOffsets "latest" with the last batch's base offset + 1, so the first
    // value may be low; the fetch statistics (every 10 s) carry the true high watermark.
    for (p, end) in end_offsets(&produced) {
        let series = format!("inlet_source_lag_records{{partition=\"{p}\",topic=\"{topic}\"}}");
        let mut last = None;
        wait_for(Duration::from_secs(60), || {
            std::net::TcpStream::connect(&addr).ok()?;
            let s = scrape(&addr);
            last = s
                .contains(&format!("{series} "))
                .then(|| metric(&s, &series));
            (last == Some(end as f64)).then_some(())
        })
        .unwrap_or_else(|| {
            panic!("partition {p}: lag {last:?} before the first commit, want {end}")
        });
    }
    assert_eq!(http("GET", &addr, "/health/live").0, 200);
    let scraped = scrape(&addr);
    let build = format!(
        "inlet_build_info{{version=\"{}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(metric(&scraped, &build), 1.0, "{scraped}");
    for series in ["process_resident_memory_bytes", "process_open_fds"] {
        assert!(metric(&scraped, series) > 0.0, "{series}: {scraped}");
    }
    assert_eq!(lake.committed_total("test", &table, &table).await, 0);

    // The probe writes below `<warehouse>/.inlet/`: a file there instead of a directory.
    let probes = Path::new(&lake.warehouse).join(".inlet");
    let _ = std::fs::remove_dir_all(&probes);
    std::fs::write(&probes, "not a directory").unwrap();
    let body = wait_health(
        &addr,
        503,
        &["storage: FAIL", ".inlet"],
        Duration::from_secs(30),
    );
    assert!(body.contains("catalog: ok"), "{body}");
    std::fs::remove_file(&probes).unwrap();
    wait_health(&addr, 200, &["storage: ok"], Duration::from_secs(30));
    inlet.stop_cleanly(Duration::from_secs(60));
    // The buffered records were committed on SIGTERM.
    assert_eq!(
        lake.committed_total("test", &table, &table).await,
        end_offsets(&produced).values().sum::<i64>()
    );
}
