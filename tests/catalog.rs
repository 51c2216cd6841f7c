//! The catalog seam: one conformance suite that the SQL catalog and a real Iceberg REST catalog
//! server (rustberg) both pass, then what only the REST catalog needs proven: two writers
//! racing through it, and a commit whose answer is lost after the server committed it.

mod common;

use std::collections::BTreeMap;

use common::*;
use inlet::commit::{Checkpoint, CommitOutcome, Committer, Offsets};
use inlet::error::ErrorKind;
use inlet::table::catalog::Catalog;
use inlet::table::io::FileIO;
use inlet::table::metadata::{Snapshot, SnapshotRef};
use inlet::table::types::Type;
use inlet::table::{commit_tables, Table, TableDefinition};

fn definition() -> TableDefinition {
    TableDefinition {
        columns: vec![
            ("id".into(), Type::Long, true, None),
            ("name".into(), Type::String, false, None),
        ],
        identifier: vec!["id".into()],
        partition: vec![],
        properties: BTreeMap::new(),
    }
}

fn offsets(partition: i32, next: i64) -> Offsets {
    Offsets::from([("topic".to_string(), BTreeMap::from([(partition, next)]))])
}

/// A checkpoint moving `partition` from `from` to `to`, with no files.
fn checkpoint(id: u64, partition: i32, from: Option<i64>, to: i64) -> Checkpoint {
    let start = from.map_or_else(Offsets::new, |f| offsets(partition, f));
    plain_checkpoint(id, vec![], vec![], start, offsets(partition, to))
}

fn committer(writer: &str) -> Committer {
    Committer {
        pipeline_id: "conformance".into(),
        writer_id: writer.into(),
        retries: 20,
        retry_for: std::time::Duration::from_secs(60),
    }
}

/// Next metadata with one more (empty) snapshot on `main`, as a writer that read `table`
/// would propose.
fn with_snapshot(table: &Table) -> inlet::table::metadata::TableMetadata {
    let mut next = table.metadata.clone();
    let id = next.new_snapshot_id();
    let seq = next.last_sequence_number + 1;
    next.snapshots.push(Snapshot {
        snapshot_id: id,
        parent_snapshot_id: next.current_snapshot_id,
        sequence_number: seq,
        timestamp_ms: inlet::table::now_ms(),
        manifest_list: format!("{}/metadata/snap-{id}.avro", next.location),
        summary: BTreeMap::from([("operation".into(), "append".into())]),
        schema_id: Some(next.current_schema_id),
        extra: Default::default(),
    });
    next.last_sequence_number = seq;
    next.current_snapshot_id = Some(id);
    next.refs.insert(
        "main".into(),
        SnapshotRef {
            snapshot_id: id,
            kind: "branch".into(),
            extra: Default::default(),
        },
    );
    next
}

/// What every catalog must do: create once, load what was committed, swap only from the
/// current state, move several tables together or not at all, list its tables.
async fn conformance(catalog: Catalog, io: FileIO, warehouse: &str) {
    let ns = unique("ns");
    assert!(Table::load(&catalog, &io, &ns, "a")
        .await
        .unwrap()
        .is_none());
    let mut a = Table::load_or_create(&catalog, &io, &ns, "a", warehouse, &definition())
        .await
        .unwrap();
    let again = Table::load_or_create(&catalog, &io, &ns, "a", warehouse, &definition())
        .await
        .unwrap();
    assert_eq!(
        a.metadata.table_uuid, again.metadata.table_uuid,
        "created twice"
    );
    let mut b = Table::load_or_create(&catalog, &io, &ns, "b", warehouse, &definition())
        .await
        .unwrap();

    // A checkpoint lands, and a reload sees it with its summary.
    let stale = a.clone();
    let outcome = committer("w1")
        .commit(&mut a, &checkpoint(1, 0, None, 10))
        .await
        .unwrap();
    let CommitOutcome::Committed { snapshot_id, .. } = outcome else {
        panic!("{outcome:?}");
    };
    let loaded = Table::load(&catalog, &io, &ns, "a").await.unwrap().unwrap();
    assert_eq!(loaded.metadata.current_snapshot_id, Some(snapshot_id));
    assert_eq!(loaded.metadata_location, a.metadata_location);
    let snap = loaded.metadata.current_snapshot().unwrap();
    assert_eq!(snap.checkpoint_id(), Some(1));
    assert_eq!(snap.offsets().unwrap(), offsets(0, 10));

    // A writer that read the table before that commit cannot swap.
    let mut stale = stale;
    let next = with_snapshot(&stale);
    assert!(
        !stale.try_commit(next).await.unwrap(),
        "a stale swap landed"
    );
    let now = Table::load(&catalog, &io, &ns, "a").await.unwrap().unwrap();
    assert_eq!(now.metadata.current_snapshot_id, Some(snapshot_id));

    // The same checkpoint again is recognised, not committed twice.
    let again = committer("w1")
        .commit(&mut a, &checkpoint(1, 0, None, 10))
        .await
        .unwrap();
    assert_eq!(again, CommitOutcome::AlreadyCommitted { snapshot_id });

    // Two tables move together; with one of them stale, neither moves.
    if catalog.multi_table() {
        let (a_before, b_before) = (
            a.metadata.current_snapshot_id,
            b.metadata.current_snapshot_id,
        );
        let mut stale_b = b.clone();
        let next_b = with_snapshot(&b);
        assert!(b.try_commit(next_b).await.unwrap());
        let (na, nb) = (with_snapshot(&a), with_snapshot(&stale_b));
        assert!(!commit_tables(&mut [&mut a, &mut stale_b], vec![na, nb])
            .await
            .unwrap());
        let a_now = Table::load(&catalog, &io, &ns, "a").await.unwrap().unwrap();
        assert_eq!(
            a_now.metadata.current_snapshot_id, a_before,
            "a moved alone"
        );
        b.refresh().await.unwrap();
        assert_ne!(b.metadata.current_snapshot_id, b_before);
        let (na, nb) = (with_snapshot(&a), with_snapshot(&b));
        let (ida, idb) = (na.current_snapshot_id, nb.current_snapshot_id);
        assert!(commit_tables(&mut [&mut a, &mut b], vec![na, nb])
            .await
            .unwrap());
        for (name, id) in [("a", ida), ("b", idb)] {
            let t = Table::load(&catalog, &io, &ns, name)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(t.metadata.current_snapshot_id, id, "table {name}");
        }
    }

    let tables = catalog.list_tables().await.unwrap();
    for name in ["a", "b"] {
        assert!(
            tables.contains(&(ns.clone(), name.to_string())),
            "{name} not listed in {tables:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_catalog_conforms() {
    let lake = Lake::new();
    let (catalog, io) = lake.open().await;
    conformance(catalog, io, &format!("file://{}", lake.warehouse)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_catalog_conforms() {
    let lake = Lake::rest(Store::S3s);
    let (catalog, io) = lake.open().await;
    assert!(
        catalog.multi_table(),
        "rustberg offers /transactions/commit"
    );
    conformance(catalog, io, "").await;
}

/// Two writers owning different partitions commit to one table through the REST catalog, each
/// from its own (so always stale) view of the table: every commit but the first meets the
/// other writer's snapshot, is refused by the server, rebases and lands; every checkpoint lands
/// exactly once and the offsets of both writers survive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_through_the_rest_catalog_each_land_every_checkpoint_once() {
    let lake = Lake::rest(Store::Local);
    let (catalog, io) = lake.open().await;
    let ns = unique("race");
    let table = Table::load_or_create(&catalog, &io, &ns, "t", "", &definition())
        .await
        .unwrap();
    const ROUNDS: u64 = 6;
    let mut views = [table.clone(), table];
    let committers = [committer("writer-0"), committer("writer-1")];
    let mut attempts = Vec::new();
    for round in 1..=ROUNDS {
        for p in 0..2 {
            let from = (round > 1).then(|| (round as i64 - 1) * 10);
            let cp = checkpoint(round, p as i32, from, round as i64 * 10);
            match committers[p].commit(&mut views[p], &cp).await.unwrap() {
                CommitOutcome::Committed { attempts: n, .. } => attempts.push(n),
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(attempts[0], 1, "{attempts:?}");
    assert!(
        attempts[1..].iter().all(|n| *n == 2),
        "every later commit conflicts once, then lands: {attempts:?}"
    );
    let t = Table::load(&catalog, &io, &ns, "t").await.unwrap().unwrap();
    let mut seen = BTreeMap::new();
    for s in t.metadata.lineage() {
        let writer = s.summary["inlet.writer-id"].clone();
        *seen
            .entry((writer, s.checkpoint_id().unwrap()))
            .or_insert(0) += 1;
    }
    assert_eq!(seen.len() as u64, 2 * ROUNDS, "{seen:?}");
    assert!(
        seen.values().all(|n| *n == 1),
        "a checkpoint landed twice: {seen:?}"
    );
    let table_offsets = inlet::commit::table_offsets(&t.metadata, "conformance").unwrap();
    assert_eq!(
        table_offsets["topic"],
        BTreeMap::from([(0, ROUNDS as i64 * 10), (1, ROUNDS as i64 * 10)])
    );
    // pyiceberg reads the same history through the REST catalog.
    let read = lake.pyiceberg(&format!("{ns}.t"));
    assert_eq!(read["snapshot_count"].as_u64(), Some(2 * ROUNDS));
}

/// A catalog whose commit answer is lost after the server committed (a proxy turns the
/// response into a 502): the writer finds its snapshot by reloading and does not commit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_after_the_server_committed_does_not_commit_twice() {
    lost_commit_answers(FaultProxy::BAD_GATEWAY).await;
}

/// A gateway answering 503 after the server committed, in front of a server that does not
/// keep idempotency keys (they are optional in the spec; the proxy drops them): the commit is
/// not sent again as if nothing had happened, since the server would refuse the repeat and the
/// writer would then delete the manifest list of the snapshot that landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_after_the_server_committed_keeps_the_landed_snapshot() {
    lost_commit_answers(FaultProxy::UNAVAILABLE).await;
}

async fn lost_commit_answers(reply: &'static [u8]) {
    let lake = Lake::rest(Store::Local);
    let server = lake.rest.as_ref().unwrap();
    let proxy = FaultProxy::start(server.port);
    let settings = match server.settings() {
        inlet::table::catalog::CatalogSettings::Rest(mut s) => {
            s.uri = format!("http://127.0.0.1:{}", proxy.port);
            inlet::table::catalog::CatalogSettings::Rest(s)
        }
        other => other,
    };
    let catalog = Catalog::connect(&settings).await.unwrap();
    let io = FileIO::default();
    let ns = unique("lost");
    let mut table = Table::load_or_create(&catalog, &io, &ns, "t", "", &definition())
        .await
        .unwrap();

    // Every commit's answer is lost once; each checkpoint still lands exactly once.
    let mut stale = None;
    for round in 1..=3u64 {
        if round == 3 {
            stale = Some(table.clone());
        }
        proxy.fail_next_commit(reply);
        let from = (round > 1).then(|| (round as i64 - 1) * 5);
        let outcome = committer("w")
            .commit(&mut table, &checkpoint(round, 0, from, round as i64 * 5))
            .await
            .unwrap();
        assert!(
            matches!(outcome, CommitOutcome::Committed { attempts: 1, .. }),
            "round {round}: {outcome:?}"
        );
        assert_eq!(proxy.failed(), round, "the proxy did not drop an answer");
        // Every landed snapshot still has its manifest list.
        for s in &table.metadata.snapshots {
            assert!(
                io.get(&s.manifest_list).await.is_ok(),
                "round {round}: the manifest list of snapshot {} was deleted",
                s.snapshot_id
            );
        }
    }
    let t = Table::load(&catalog, &io, &ns, "t").await.unwrap().unwrap();
    let checkpoints: Vec<u64> = t
        .metadata
        .lineage()
        .map(|s| s.checkpoint_id().unwrap())
        .collect();
    assert_eq!(checkpoints, vec![3, 2, 1]);
    assert_eq!(
        t.metadata.snapshots.len(),
        3,
        "a checkpoint was committed twice"
    );

    // Another writer that staged on the older state: the server refuses it, the answer is
    // lost, and the reload must not mistake it for landed.
    proxy.fail_next_commit(reply);
    let err = committer("other")
        .commit(&mut stale.unwrap(), &checkpoint(3, 0, Some(10), 15))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::CommitConflict, "{err}");
    assert_eq!(proxy.failed(), 4);
    let t = Table::load(&catalog, &io, &ns, "t").await.unwrap().unwrap();
    assert_eq!(t.metadata.snapshots.len(), 3);
}

/// An HTTP/1.1 proxy on loopback in front of a real server that can drop the answer of the
/// next table commit after forwarding it, replying with a 5xx of the test's choice instead. It
/// drops `Idempotency-Key` headers, as in front of a server that does not keep them.
struct FaultProxy {
    port: u16,
    state: std::sync::Arc<ProxyState>,
}

/// The reply to give the next commit instead of the server's, and how many were replaced.
type ProxyState = std::sync::Mutex<(Option<&'static [u8]>, u64)>;

impl FaultProxy {
    const BAD_GATEWAY: &'static [u8] =
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    const UNAVAILABLE: &'static [u8] =
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

    fn start(upstream: u16) -> FaultProxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = std::sync::Arc::new(std::sync::Mutex::new((None, 0u64)));
        let shared = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let shared = shared.clone();
                std::thread::spawn(move || proxy_one(conn, upstream, &shared));
            }
        });
        FaultProxy { port, state }
    }

    /// Answers the next table commit with `reply` after forwarding it.
    fn fail_next_commit(&self, reply: &'static [u8]) {
        self.state.lock().unwrap().0 = Some(reply);
    }

    fn failed(&self) -> u64 {
        self.state.lock().unwrap().1
    }
}

fn proxy_one(mut client: std::net::TcpStream, upstream: u16, state: &ProxyState) {
    use std::io::Write;
    // One request per client connection: the answer closes it and the client reconnects.
    if let Some((head, body)) = read_http(&mut client) {
        let request_line = head.lines().next().unwrap_or("").to_string();
        // One request per upstream connection, closed after the answer.
        let forwarded_head: String = head
            .split("\r\n")
            .filter(|l| {
                let l = l.to_ascii_lowercase();
                !l.starts_with("connection:") && !l.starts_with("idempotency-key:")
            })
            .collect::<Vec<_>>()
            .join("\r\n");
        let forwarded_head =
            forwarded_head.trim_end().to_string() + "\r\nConnection: close\r\n\r\n";
        let Ok(mut up) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else {
            return;
        };
        up.write_all(forwarded_head.as_bytes()).unwrap();
        up.write_all(&body).unwrap();
        let mut answer = Vec::new();
        use std::io::Read;
        let _ = up.read_to_end(&mut answer);
        let is_commit = request_line.starts_with("POST ")
            && request_line.contains("/tables/")
            && !request_line.contains("/tables/rename");
        let replaced = {
            let mut s = state.lock().unwrap();
            match s.0 {
                Some(reply) if is_commit => {
                    s.0 = None;
                    s.1 += 1;
                    Some(reply)
                }
                _ => None,
            }
        };
        let reply = replaced.map_or(answer, <[u8]>::to_vec);
        let _ = client.write_all(&reply);
    }
}

/// OAuth2 client credentials against the real catalog: the token endpoint first hands out a
/// token the catalog refuses (as after a revocation), then the catalog's key. The client asks
/// for a new token on the 401 and goes on; tables are created and committed through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oauth2_client_credentials_renew_a_refused_token() {
    let lake = Lake::rest(Store::Local);
    let server = lake.rest.as_ref().unwrap();
    let tokens = TokenServer::start(vec!["revoked".to_string(), server.token.clone()]);
    let settings = match server.settings() {
        inlet::table::catalog::CatalogSettings::Rest(mut s) => {
            s.token = None;
            s.credential = Some(("inlet-client".into(), "s3cr&t".into()));
            s.oauth2_server_uri = Some(format!("http://127.0.0.1:{}/token", tokens.port));
            inlet::table::catalog::CatalogSettings::Rest(s)
        }
        other => other,
    };
    let catalog = Catalog::connect(&settings).await.unwrap();
    let io = FileIO::default();
    let ns = unique("oauth");
    let mut table = Table::load_or_create(&catalog, &io, &ns, "t", "", &definition())
        .await
        .unwrap();
    let outcome = committer("w")
        .commit(&mut table, &checkpoint(1, 0, None, 5))
        .await
        .unwrap();
    assert!(matches!(outcome, CommitOutcome::Committed { .. }));
    let grants = tokens.grants();
    assert_eq!(grants.len(), 2, "one grant, one renewal: {grants:?}");
    for g in &grants {
        for part in [
            "grant_type=client_credentials",
            "client_id=inlet-client",
            "client_secret=s3cr%26t",
            "scope=catalog",
        ] {
            assert!(g.split('&').any(|p| p == part), "{part} missing in {g}");
        }
    }
}

/// An OAuth2 token endpoint on loopback handing out `tokens` in turn (the last one again and
/// again), keeping each grant request's body.
struct TokenServer {
    port: u16,
    grants: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl TokenServer {
    fn start(tokens: Vec<String>) -> TokenServer {
        let grants = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let shared = grants.clone();
        let port = serve_http(move |_, body| {
            let n = {
                let mut g = shared.lock().unwrap();
                g.push(String::from_utf8_lossy(body).into_owned());
                g.len()
            };
            let token = &tokens[(n - 1).min(tokens.len() - 1)];
            format!(r#"{{"access_token":"{token}","token_type":"bearer","expires_in":3600}}"#)
        });
        TokenServer { port, grants }
    }

    fn grants(&self) -> Vec<String> {
        self.grants.lock().unwrap().clone()
    }
}

/// A server whose `/v1/config` names a prefix (as Polaris, Lakekeeper and Glue do): every later
/// request goes below `/v1/{prefix}/`. A proxy in front of the real catalog adds the prefix to
/// the config answer and takes it off requests, refusing any table request without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_from_the_config_goes_into_every_request() {
    let lake = Lake::rest(Store::Local);
    let server = lake.rest.as_ref().unwrap();
    let proxy = RestProxy::start(server.port, Some("warehouse-1"), vec![]);
    let settings = match server.settings() {
        inlet::table::catalog::CatalogSettings::Rest(mut s) => {
            s.uri = format!("http://127.0.0.1:{}", proxy.port);
            inlet::table::catalog::CatalogSettings::Rest(s)
        }
        other => other,
    };
    let catalog = Catalog::connect(&settings).await.unwrap();
    let io = FileIO::default();
    let ns = unique("prefixed");
    let mut table = Table::load_or_create(&catalog, &io, &ns, "t", "", &definition())
        .await
        .unwrap();
    committer("w")
        .commit(&mut table, &checkpoint(1, 0, None, 5))
        .await
        .unwrap();
    let (prefixed, bare) = proxy.counts();
    assert!(prefixed >= 3, "{prefixed} requests carried the prefix");
    assert_eq!(bare, 0, "requests without the prefix");
    // The commit went to the real catalog.
    let (direct, _) = lake.open().await;
    let t = Table::load(&direct, &io, &ns, "t").await.unwrap().unwrap();
    assert_eq!(
        t.metadata.current_snapshot_id,
        table.metadata.current_snapshot_id
    );
    assert!(t.metadata.current_snapshot_id.is_some());
}

/// With routing, the resume offsets come from the catalog's tables that hold a snapshot of the
/// pipeline. A table found to be another's is not read again while the catalog points at the
/// same metadata file; once the pointer moves it is, and a storage fault reading it then fails
/// the lookup (it could have become one of the pipeline's) instead of leaving it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_lookup_reads_another_engines_table_again_only_once_its_metadata_moves() {
    use inlet::source::{claim_partitions, TableRef};
    let lake = Lake::new();
    let (catalog, io) = lake.open().await;
    let warehouse = format!("file://{}", lake.warehouse);
    let ns = unique("ns");
    let mut ours = Table::load_or_create(&catalog, &io, &ns, "ours", &warehouse, &definition())
        .await
        .unwrap();
    committer("w1")
        .commit(&mut ours, &checkpoint(1, 0, None, 10))
        .await
        .unwrap();
    let other = Table::load_or_create(&catalog, &io, &ns, "other", &warehouse, &definition())
        .await
        .unwrap();
    let routed = || TableRef {
        catalog: catalog.clone(),
        io: io.clone(),
        table: None,
        pipeline_id: "conformance".into(),
        start_without_offsets: Default::default(),
        committer: committer("claimer"),
        foreign: Default::default(),
    };
    let lookup = routed();
    let (found, _, _) = claim_partitions(&lookup, &[], || true).await.unwrap();
    assert_eq!(found, offsets(0, 10));

    // The other table's metadata file goes away under an unchanged pointer: not read again.
    let path = other.metadata_location.strip_prefix("file://").unwrap();
    std::fs::remove_file(path).unwrap();
    let (found, _, _) = claim_partitions(&lookup, &[], || true).await.unwrap();
    assert_eq!(found, offsets(0, 10));
    // A lookup without that memory reads it: a metadata file missing for good is a broken
    // table, left out.
    let fresh = routed();
    let (found, _, _) = claim_partitions(&fresh, &[], || true).await.unwrap();
    assert_eq!(found, offsets(0, 10));

    // The pointer moves to a file below a file, which storage cannot read for now.
    let blocker = lake.path().join("blocker");
    std::fs::write(&blocker, "a file where a directory should be").unwrap();
    let blocked = format!("file://{}/next.metadata.json", blocker.display());
    let Catalog::Sql(sql) = &catalog else {
        panic!("a SQL catalog")
    };
    assert!(sql
        .swap(&ns, "other", &other.metadata_location, &blocked)
        .await
        .unwrap());
    for lookup in [&lookup, &fresh] {
        let e = claim_partitions(lookup, &[], || true).await.unwrap_err();
        assert!(e.retryable(), "{e}");
        assert!(e.to_string().contains(&format!("table={ns}.other")), "{e}");
    }
}

/// A claim races another member's claim of the same partition. While the partition is still
/// the claimer's (`current`), it claims again above the winner; once it was revoked meanwhile,
/// the winner is its next owner and the claim gives up, leaving the winner's epoch in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_partitions_revoked_meanwhile_never_claims_above_their_next_owner() {
    use inlet::commit::table_epochs;
    let lake = Lake::new();
    let (catalog, io) = lake.open().await;
    let warehouse = format!("file://{}", lake.warehouse);
    let ns = unique("ns");
    let mut table = Table::load_or_create(&catalog, &io, &ns, "t", &warehouse, &definition())
        .await
        .unwrap();
    committer("w1")
        .commit(&mut table, &checkpoint(1, 0, None, 10))
        .await
        .unwrap();
    let part = [("topic".to_string(), 0)];
    let epoch = |t: &Table| table_epochs(&t.metadata, "conformance").unwrap()["topic"][&0];

    // The revoked member read the table before the next owner claimed it.
    let mut revoked = Table::load(&catalog, &io, &ns, "t").await.unwrap().unwrap();
    let mut owner = Table::load(&catalog, &io, &ns, "t").await.unwrap().unwrap();
    let won = committer("owner")
        .claim(vec![&mut owner], &part, || true)
        .await
        .unwrap();
    assert_eq!(won["topic"][&0], epoch(&owner));
    let e = committer("revoked")
        .claim(vec![&mut revoked], &part, || false)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::CommitConflict, "{e}");
    let now = Table::load(&catalog, &io, &ns, "t").await.unwrap().unwrap();
    assert_eq!(
        epoch(&now),
        won["topic"][&0],
        "the next owner keeps its epoch"
    );

    // A member still assigned the partition claims above a claim that beat it.
    let mut late = Table::load(&catalog, &io, &ns, "t").await.unwrap().unwrap();
    let mut quick = Table::load(&catalog, &io, &ns, "t").await.unwrap().unwrap();
    let first = committer("quick")
        .claim(vec![&mut quick], &part, || true)
        .await
        .unwrap();
    let second = committer("late")
        .claim(vec![&mut late], &part, || true)
        .await
        .unwrap();
    assert!(second["topic"][&0] > first["topic"][&0]);
    let now = Table::load(&catalog, &io, &ns, "t").await.unwrap().unwrap();
    assert_eq!(epoch(&now), second["topic"][&0]);
}
