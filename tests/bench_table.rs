//! `inlet bench-table` on a small table: what it writes is a table the pipeline reads as its
//! own (an independent reader sees every key once, the rebuild finds every key live), and the
//! pipeline restarted on the index it left commits new changes without rebuilding; on a host
//! with no index it rebuilds every shard, or restores every shard from its copy.

mod common;

use std::collections::BTreeSet;

use common::*;
use inlet::bench_table::{changed_key, BenchTableOptions, CHANGED_STATUS, ROUNDS};
use inlet::index::KeyIndex;
use inlet::table::types::{encode_values, Value};

const KEYS: u64 = 20_000;
const PARTITIONS: i32 = 2;
const CHANGES: u64 = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_table_writes_a_table_the_pipeline_restarts_on() {
    let broker = Broker::shared();
    let lake = Lake::new();
    let opts = BenchTableOptions {
        keys: KEYS,
        partitions: PARTITIONS,
        dir: lake.path().to_path_buf(),
        bootstrap: Some(broker.bootstrap.clone()),
        changes: CHANGES,
        binary: Some(env!("CARGO_BIN_EXE_inlet").into()),
        failover: true,
    };
    let report = inlet::bench_table::run(opts).await.unwrap();
    assert!(report.checkpoints > 1, "{report:?}");
    assert_eq!(report.rebuilt_keys, KEYS, "no tombstones, no key missing");
    assert_eq!(report.live_keys, KEYS);
    assert!(report.index_bytes > 0 && report.index_bytes_compacted > 0);
    let restart = report.restart.as_ref().unwrap();
    assert_eq!(
        (restart.local_shards, restart.rebuilt_shards),
        (PARTITIONS as u64, 0),
        "the restart uses the rebuilt indexes in place"
    );
    assert!(restart.first_commit_secs <= restart.all_secs);
    let (rebuilt, copied) = report.failover.as_ref().unwrap();
    assert_eq!(
        (
            rebuilt.rebuilt_shards,
            rebuilt.copy_shards,
            rebuilt.local_shards
        ),
        (PARTITIONS as u64, 0, 0),
        "with no index and no copy every shard is rebuilt"
    );
    assert_eq!(
        (
            copied.rebuilt_shards,
            copied.copy_shards,
            copied.local_shards
        ),
        (0, PARTITIONS as u64, 0),
        "with no index every shard is restored from its copy"
    );

    // The table committed the changes at their offsets.
    let table = lake.table("bench", "orders_0").await.unwrap();
    let offsets = inlet::commit::table_offsets(&table.metadata, "bench-0").unwrap();
    let committed: i64 = offsets[&report.topic].values().sum();
    assert!(report.produced >= ROUNDS * CHANGES, "{report:?}");
    assert_eq!(committed, report.produced as i64);

    // pyiceberg reads every key once, the changed ones with their new status.
    let read = lake.pyiceberg(&report.table);
    let rows = read_rows(&read);
    assert_eq!(rows.len() as u64, KEYS);
    let ids: BTreeSet<u64> = rows.iter().map(|r| r["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, (0..KEYS).collect());
    let changed: BTreeSet<u64> = (0..ROUNDS * CHANGES)
        .map(|i| changed_key(i, KEYS))
        .collect();
    assert_eq!(changed.len() as u64, ROUNDS * CHANGES);
    // Every shard takes changes.
    for p in 0..PARTITIONS as u64 {
        assert!(changed.iter().any(|id| id % PARTITIONS as u64 == p));
    }
    let restarted: BTreeSet<u64> = rows
        .iter()
        .filter(|r| r["status"] == CHANGED_STATUS)
        .map(|r| r["id"].as_u64().unwrap())
        .collect();
    assert_eq!(restarted, changed);
    // Data files are the shards' own, in bucket directories of their day partitions.
    for f in read["files"].as_array().unwrap() {
        if f["content"] != "data" {
            continue;
        }
        let path = f["file_path"].as_str().unwrap();
        let shard = inlet::write::file_shard(path).unwrap_or_else(|| panic!("{path}"));
        assert!(shard < PARTITIONS as u32, "{path}");
        assert!(path.contains("/created_at_day=2026-01-"), "{path}");
    }

    // Each shard's index, as the restart left it, holds exactly its keys, all live.
    let root = lake.path().join("index-0").join("bench-0");
    let mut live = 0;
    for p in 0..PARTITIONS {
        let db = root.join(format!("{}-{p}", report.topic)).join("db");
        let index = inlet::index::RocksIndex::open(&db, None).unwrap();
        let keys: Vec<Vec<u8>> = (0..KEYS + 100)
            .map(|id| encode_values(&[Value::Long(id as i64)]))
            .collect();
        let asked: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        for (id, entry) in index.multi_get(&asked).unwrap().into_iter().enumerate() {
            let id = id as u64;
            let mine = id < KEYS && id % PARTITIONS as u64 == p as u64;
            assert_eq!(
                entry.as_ref().is_some_and(|e| e.location.is_some()),
                mine,
                "key {id} in shard {p}: {entry:?}"
            );
        }
        live += index
            .bucket_counts()
            .unwrap()
            .iter()
            .map(|(_, n)| n)
            .sum::<u64>();
    }
    assert_eq!(live, KEYS);
}
