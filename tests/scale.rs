//! Many instances in one consumer group writing one table: members join, leave, crash and
//! pause past their session timeout while the stream flows, and the table still ends exactly
//! as the model says; no commit of a member that lost its partitions ever lands.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

const PARTITIONS: i32 = 4;

/// One member: its own index directory and metrics port, as each pod has its own volume.
struct Member {
    config: PathBuf,
    log: PathBuf,
    metrics: String,
}

fn member(lake: &Lake, base: &Path, name: &str) -> Member {
    let (config, metrics) = member_config(lake, base, name);
    Member {
        config,
        log: lake.path().join(format!("{name}.log")),
        metrics,
    }
}

fn start(lake: &Lake, m: &Member) -> Inlet {
    let env = lake.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    // Appends: a member restarted in the same test keeps its earlier lines.
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&m.log)
        .unwrap();
    drop(log);
    Inlet::spawn_logged(&m.config, &env, &m.log)
}

fn signal(inlet: &Inlet, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &inlet.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} failed");
}

/// Every commit that advanced a partition carried the newest epoch claimed for it so far: no
/// member committed a partition after another had taken it over.
async fn assert_no_commit_of_a_lost_owner(lake: &Lake, table: &str) {
    let t = lake.table("test", table).await.expect("table exists");
    let mut lineage: Vec<_> = t.metadata.lineage().collect();
    lineage.reverse();
    // What each snapshot recorded, beside the members' logs, for a failure to be traced.
    let history: Vec<String> = lineage
        .iter()
        .map(|s| {
            format!(
                "{} {:?} {:?} {:?}",
                s.snapshot_id,
                s.summary,
                s.offsets().unwrap(),
                s.epochs().unwrap()
            )
        })
        .collect();
    std::fs::write(lake.path().join("lineage.txt"), history.join("\n")).unwrap();
    let mut newest: BTreeMap<(String, i32), i64> = BTreeMap::new();
    let mut offsets: BTreeMap<(String, i32), i64> = BTreeMap::new();
    let mut claims = 0;
    for s in lineage {
        let epochs = s.epochs().unwrap();
        let is_claim = s.checkpoint_id() == Some(0);
        claims += usize::from(is_claim);
        for (topic, parts) in s.offsets().unwrap() {
            for (p, at) in parts {
                let key = (topic.clone(), p);
                let before = offsets.insert(key.clone(), at);
                let epoch = epochs
                    .get(&topic)
                    .and_then(|m| m.get(&p))
                    .copied()
                    .unwrap_or(0);
                if before != Some(at) {
                    assert!(!is_claim, "claim snapshot {} moved offsets", s.snapshot_id);
                    let claimed = newest.get(&key).copied().unwrap_or(0);
                    assert_eq!(
                        epoch, claimed,
                        "snapshot {} advanced {topic}/{p} under epoch {epoch} after epoch {claimed} was claimed",
                        s.snapshot_id
                    );
                }
            }
        }
        for (topic, parts) in epochs {
            for (p, e) in parts {
                let at = newest.entry((topic.clone(), p)).or_insert(0);
                assert!(
                    e >= *at,
                    "snapshot {} lowered the epoch of {topic}/{p}",
                    s.snapshot_id
                );
                *at = e;
            }
        }
    }
    assert!(claims >= 4, "expected a claim per assignment, saw {claims}");
}

/// Produces `messages` in small bursts, so members always have records buffered.
async fn trickle(bootstrap: &str, topic: &str, messages: &[Record]) -> Vec<Produced> {
    let mut out = Vec::new();
    for burst in messages.chunks(60) {
        out.extend(produce(bootstrap, topic, burst).await);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    out
}

/// Scale 1 → 3 → 2 → 1 while the stream flows: a member paused past its session timeout and
/// then resumed, one killed with SIGKILL, one stopped with SIGTERM. PostgreSQL catalog when
/// CI provides one (SQLite otherwise), tables on an S3 server. The upsert table ends as the
/// model says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_join_leave_crash_and_pause_and_the_table_stays_exact() {
    scale_and_pause(false).await;
}

/// The same for a changelog table: every (partition, offset) exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_join_leave_crash_and_pause_and_each_change_lands_once() {
    scale_and_pause(true).await;
}

async fn scale_and_pause(changelog: bool) {
    let broker = Broker::shared();
    let mut lake = Lake::on(Store::Moto);
    match std::env::var("INLET_TEST_POSTGRES") {
        Ok(uri) => {
            lake.catalog_uri = uri;
            lake.catalog_name = unique("scale");
        }
        Err(_) => eprintln!("INLET_TEST_POSTGRES unset: the catalog is SQLite"),
    }
    let topic = unique("scale");
    let table = unique("scale");
    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    let model = upsert_stream(23, 9_000, 400, PARTITIONS);
    let base = if changelog {
        changelog_config(&lake, &broker.bootstrap, &topic, &table, 400, "")
    } else {
        upsert_config(&lake, &topic, &table, "deduplicate", 400)
    };
    let [a, b, c] = ["a", "b", "c"].map(|n| member(&lake, &base, n));
    let third = model.messages.len() / 3;
    let (first, rest) = model.messages.split_at(third);
    let (second, last) = rest.split_at(third);

    let mut produced = produce(&broker.bootstrap, &topic, first).await;
    let mut one = start(&lake, &a);
    assert_all_committed(
        &lake,
        &table,
        &produced,
        "the first member did not commit the first third",
    )
    .await;

    // 1 → 3 while records flow.
    let mut two = start(&lake, &b);
    let mut three = start(&lake, &c);
    let flow = {
        let (bootstrap, topic, msgs) = (broker.bootstrap.clone(), topic.clone(), second.to_vec());
        tokio::spawn(async move { trickle(&bootstrap, &topic, &msgs).await })
    };
    // Member b pauses while it owns partitions and holds records, past its session timeout.
    let holding = wait_for(Duration::from_secs(60), || {
        let s = http("GET", &b.metrics, "/metrics").1;
        (try_metric(&s, "inlet_source_assigned_partitions").unwrap_or(0.0) > 0.0
            && try_metric(&s, "inlet_write_buffered_records").unwrap_or(0.0) > 0.0)
            .then_some(())
    });
    assert!(
        holding.is_some(),
        "member b never owned partitions with records buffered"
    );
    signal(&two, "STOP");
    tokio::time::sleep(Duration::from_secs(14)).await;
    signal(&two, "CONT");
    // 3 → 2: member c dies at once.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    three.sigkill();
    produced.extend(flow.await.unwrap());
    produced.extend(trickle(&broker.bootstrap, &topic, last).await);
    // 2 → 1.
    tokio::time::sleep(Duration::from_secs(3)).await;
    signal(&two, "TERM");
    assert!(
        two.wait_exit(Duration::from_secs(60)).is_some(),
        "member b did not stop on SIGTERM"
    );

    assert_all_committed(
        &lake,
        &table,
        &produced,
        "the remaining member did not commit everything",
    )
    .await;
    one.stop_cleanly(Duration::from_secs(60));

    assert_no_commit_of_a_lost_owner(&lake, &table).await;
    // The paused member either had its commit refused or learnt it lost its partitions first.
    let gave_up = log_events(&b.log)
        .iter()
        .filter(|e| e.to_string().contains("newer owner") || e["fields"]["lost"] == true)
        .count();
    assert!(gave_up > 0, "member b never gave its partitions up");
    if changelog {
        assert_exactly_once(&lake, &table, &produced).await;
    } else {
        assert_matches(&lake, &table, &model.expected, None).await;
    }
}

/// A static member (`group.instance.id`) restarted within its session timeout keeps its
/// partitions: the other member sees no rebalance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_member_restarted_quickly_moves_no_partition() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("static", PARTITIONS).await;
    let model = upsert_stream(5, 1_200, 100, PARTITIONS);
    let base = upsert_config(&lake, &topic, &table, "deduplicate", 200);
    let members = ["a", "b"].map(|n| {
        let m = member(&lake, &base, n);
        let text = std::fs::read_to_string(&m.config).unwrap().replace(
            "    session.timeout.ms: \"6000\"\n",
            &format!("    session.timeout.ms: \"20000\"\n    group.instance.id: \"{table}-{n}\"\n"),
        );
        std::fs::write(&m.config, text).unwrap();
        m
    });
    let half = model.messages.len() / 2;
    let mut produced = produce(&broker.bootstrap, &topic, &model.messages[..half]).await;
    let mut a = start(&lake, &members[0]);
    let b = start(&lake, &members[1]);
    assert_all_committed(
        &lake,
        &table,
        &produced,
        "the members did not commit the first half",
    )
    .await;
    let settled = wait_for(Duration::from_secs(60), || {
        let (sa, sb) = (
            http("GET", &members[0].metrics, "/metrics").1,
            http("GET", &members[1].metrics, "/metrics").1,
        );
        (metric(&sa, "inlet_source_assigned_partitions")
            + metric(&sb, "inlet_source_assigned_partitions")
            == f64::from(PARTITIONS))
        .then_some(())
    });
    assert!(settled.is_some(), "the group never split the partitions");
    let assigned_before = events_with(&members[1].log, "Partitions assigned").len();

    a.sigkill();
    let restarted = Instant::now();
    let mut a = start(&lake, &members[0]);
    produced.extend(produce(&broker.bootstrap, &topic, &model.messages[half..]).await);
    assert_all_committed(
        &lake,
        &table,
        &produced,
        "the members did not commit the second half",
    )
    .await;
    assert!(restarted.elapsed() < Duration::from_secs(120));
    assert_eq!(
        events_with(&members[1].log, "Partitions revoked").len(),
        0,
        "the other member lost partitions"
    );
    assert_eq!(
        events_with(&members[1].log, "Partitions assigned").len(),
        assigned_before,
        "the other member was assigned partitions again"
    );
    a.sigterm();
    drop(b);
    assert_matches(&lake, &table, &model.expected, None).await;
}

/// A member that takes partitions over on a host without their index downloads the copies the
/// previous owner left beside the table (on S3) and catches up, rebuilding nothing; the result
/// equals a rebuild from the table entry by entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_owner_restores_the_index_from_its_copy_not_a_rebuild() {
    let lake = Lake::on(Store::Moto);
    let (broker, topic, table) = topic_and_table("copy", PARTITIONS).await;
    let model = upsert_stream(31, 4_000, 300, PARTITIONS);
    let base = upsert_config(&lake, &topic, &table, "deduplicate", 500);
    let [a, b] = ["a", "b"].map(|n| member(&lake, &base, n));
    let half = model.messages.len() / 2;
    let mut produced = produce(&broker.bootstrap, &topic, &model.messages[..half]).await;

    let mut first = start(&lake, &a);
    assert_all_committed(
        &lake,
        &table,
        &produced,
        "the first owner did not commit the first half",
    )
    .await;
    let copied = wait_for(Duration::from_secs(60), || {
        let s = http("GET", &a.metrics, "/metrics").1;
        (metric(&s, "inlet_index_copies_total{result=\"uploaded\"}") >= f64::from(PARTITIONS))
            .then_some(())
    });
    assert!(
        copied.is_some(),
        "the first owner uploaded no copy of every shard"
    );
    first.stop_cleanly(Duration::from_secs(60));

    let mut second = start(&lake, &b);
    produced.extend(produce(&broker.bootstrap, &topic, &model.messages[half..]).await);
    assert_all_committed(
        &lake,
        &table,
        &produced,
        "the new owner did not commit the second half",
    )
    .await;
    let s = http("GET", &b.metrics, "/metrics").1;
    assert_eq!(
        metric(&s, "inlet_index_restores_total{source=\"copy\"}"),
        f64::from(PARTITIONS),
        "{s}"
    );
    assert_eq!(
        metric(&s, "inlet_index_restores_total{source=\"rebuild\"}"),
        0.0
    );
    second.stop_cleanly(Duration::from_secs(60));
    assert_eq!(
        events_with(&b.log, "rebuilding").len(),
        0,
        "the new owner rebuilt an index"
    );
    assert_eq!(
        events_with(&b.log, "Index restored from its copy beside the table").len(),
        PARTITIONS as usize
    );
    let root = lake.path().join("index-b").join(&table);
    assert_index_equals_a_rebuild(&lake, &table, &root, &topic, PARTITIONS, 300).await;
    assert_matches(&lake, &table, &model.expected, None).await;
}

/// Claiming assigned partitions in the table can take long (a slow catalog; here a claim
/// delayed past `max.poll.interval.ms`). The member keeps polling meanwhile, so the group
/// never evicts it, and a member stopped while it claims leaves at once, without waiting for
/// the claim; its partitions go back to the other member and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_claim_keeps_the_member_in_its_group_and_sigterm_does_not_wait_for_it() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("slowclaim", PARTITIONS).await;
    let model = upsert_stream(41, 1_600, 150, PARTITIONS);
    let base = upsert_config(&lake, &topic, &table, "deduplicate", 200);
    let [a, b] = ["a", "b"].map(|n| {
        let m = member(&lake, &base, n);
        let text = std::fs::read_to_string(&m.config).unwrap().replace(
            "    session.timeout.ms: \"6000\"\n",
            "    session.timeout.ms: \"6000\"\n    max.poll.interval.ms: \"8000\"\n",
        );
        std::fs::write(&m.config, text).unwrap();
        m
    });
    let slow = |m: &Member| {
        let mut env = lake.env();
        env.push(("INLET_DELAY_AT".into(), "claim:15000".into()));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Inlet::spawn_logged(&m.config, &env, &m.log)
    };
    let half = model.messages.len() / 2;
    let mut produced = produce(&broker.bootstrap, &topic, &model.messages[..half]).await;
    let mut first = slow(&a);
    assert_all_committed(
        &lake,
        &table,
        &produced,
        "the member with a slow claim did not commit the first half",
    )
    .await;

    // A second member joins; it is stopped while its claim is still running.
    let mut second = slow(&b);
    let claiming = wait_for(Duration::from_secs(60), || {
        (!events_with(&b.log, "Claiming newly assigned partitions").is_empty()).then_some(())
    });
    assert!(claiming.is_some(), "the second member was assigned nothing");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stopped = Instant::now();
    second.stop_cleanly(Duration::from_secs(60));
    let took = stopped.elapsed();
    assert!(
        took < Duration::from_secs(12),
        "SIGTERM waited {took:?} for a claim delayed by 15 s"
    );
    assert!(
        events_with(&b.log, "Partitions assigned at table offsets").is_empty(),
        "the second member's claim finished before it was stopped"
    );

    produced.extend(produce(&broker.bootstrap, &topic, &model.messages[half..]).await);
    assert_all_committed(
        &lake,
        &table,
        &produced,
        "the first member did not commit the second half",
    )
    .await;
    first.stop_cleanly(Duration::from_secs(60));
    let evicted: Vec<_> = log_events(&a.log)
        .into_iter()
        .filter(|e| e["fields"]["lost"] == true)
        .collect();
    assert!(
        evicted.is_empty(),
        "the member with a slow claim lost its partitions: {evicted:?}"
    );
    assert_matches(&lake, &table, &model.expected, None).await;
}

/// Under an eager assignor (`range`) every rebalance revokes and assigns all partitions; the
/// claims still run beside the consumer, and members joining and leaving while the stream
/// flows leave the table exactly as the model says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_assignor_hands_partitions_over_exactly() {
    let lake = Lake::new();
    let (broker, topic, table) = topic_and_table("eager", PARTITIONS).await;
    let model = upsert_stream(53, 3_000, 200, PARTITIONS);
    let base = upsert_config(&lake, &topic, &table, "deduplicate", 200);
    let [a, b] = ["a", "b"].map(|n| {
        let m = member(&lake, &base, n);
        let text = std::fs::read_to_string(&m.config).unwrap().replace(
            "    session.timeout.ms: \"6000\"\n",
            "    session.timeout.ms: \"6000\"\n    partition.assignment.strategy: range\n",
        );
        std::fs::write(&m.config, text).unwrap();
        m
    });
    let third = model.messages.len() / 3;
    let mut produced = produce(&broker.bootstrap, &topic, &model.messages[..third]).await;
    let mut first = start(&lake, &a);
    assert_all_committed(&lake, &table, &produced, "the first member did not commit").await;
    let mut second = start(&lake, &b);
    produced.extend(trickle(&broker.bootstrap, &topic, &model.messages[third..2 * third]).await);
    assert_all_committed(&lake, &table, &produced, "the two members did not commit").await;
    second.stop_cleanly(Duration::from_secs(60));
    produced.extend(produce(&broker.bootstrap, &topic, &model.messages[2 * third..]).await);
    assert_all_committed(&lake, &table, &produced, "the last member did not commit").await;
    first.stop_cleanly(Duration::from_secs(60));
    assert!(
        !events_with(&b.log, "Partitions assigned at table offsets").is_empty(),
        "the second member never took partitions over"
    );
    assert_no_commit_of_a_lost_owner(&lake, &table).await;
    assert_matches(&lake, &table, &model.expected, None).await;
}
