//! What the upsert bench measures after ingesting: rebuilding every index from the table, a fail-over from index copies, and commit latency over the table's history.

use std::time::{Duration, Instant};

use super::{reset_peak_rss, BenchOptions};
use crate::config::Config;
use crate::demo::peak_rss_bytes;
use crate::pipeline::open_table;
use inlet_common::error::{ErrorKind, Result, ResultExt};

/// Rebuilds every shard's index from the table and prints the rate and memory.
pub(super) async fn rebuild_all(
    cfg: &Config,
    table: &inlet_iceberg::Table,
    topic: &str,
    opts: &BenchOptions,
) -> Result<()> {
    let index_dir = std::path::PathBuf::from(&cfg.index.dir);
    let _ = std::fs::remove_dir_all(&index_dir);
    let mut sink = crate::pipeline::upsert_sink_for(cfg, table)?;
    let process_peak = peak_rss_bytes().unwrap_or(0);
    // The rebuild's own peak, apart from what the process held before it.
    let resident_before = reset_peak_rss().then(crate::demo::rss_bytes).flatten();
    let started = Instant::now();
    let keys = crate::rebuild::rebuild_shards(
        &mut sink,
        topic,
        0..opts.partitions,
        table,
        cfg.pipeline.worker_count(),
    )
    .await?;
    let secs = started.elapsed().as_secs_f64();
    let mib = |b: u64| b as f64 / 1_048_576.0;
    let peak = peak_rss_bytes().unwrap_or(0);
    match resident_before {
        Some(before) => println!(
            "index rebuild: {keys} keys in {secs:.1}s, {:.0} keys/s, peak RSS during the rebuild {:.0} MiB ({:.0} MiB resident before it; whole process {:.0} MiB)",
            keys as f64 / secs,
            mib(peak),
            mib(before),
            mib(peak.max(process_peak))
        ),
        None => println!(
            "index rebuild: {keys} keys in {secs:.1}s, {:.0} keys/s, peak RSS {:.0} MiB",
            keys as f64 / secs,
            mib(peak)
        ),
    }
    Ok(())
}

/// What a new owner on another host pays for the pipeline's shards when their indexes were
/// copied beside the table: the upload of every shard's copy, then download, open and
/// catch-up into a fresh directory. The rebuild measured after it is the price without copies.
pub(super) async fn failover_from_copies(
    cfg: &Config,
    table: &inlet_iceberg::Table,
    topic: &str,
    opts: &BenchOptions,
) -> Result<()> {
    use crate::rebuild::copies::{self, CopyManifest, LocalCopy};
    let mut sink = crate::pipeline::upsert_sink_for(cfg, table)?;
    let spec = sink.spec.clone();
    let started = Instant::now();
    let (mut bytes, mut uris) = (0, Vec::new());
    for p in 0..opts.partitions {
        let local = sink.shard_dir(topic, p).join("copy");
        let shard = sink.open_shard(topic, p)?;
        let Some(marker) = shard.marker()? else {
            continue;
        };
        let _ = std::fs::remove_dir_all(&local);
        shard.index().copy_to(&local)?;
        let copy = LocalCopy {
            dir: local,
            manifest: CopyManifest {
                pipeline: cfg.pipeline_id.clone(),
                topic: topic.to_string(),
                partition: p,
                epoch: 0,
                snapshot_id: marker.snapshot_id,
                sequence_number: marker.sequence_number,
                files: vec![],
            },
        };
        let remote = copies::shard_dir(&table.metadata.location, &cfg.pipeline_id, topic, p);
        let (uri, b) = copies::upload(&table.io, &remote, copy).await?;
        bytes += b;
        uris.push((p, uri));
    }
    let upload_secs = started.elapsed().as_secs_f64();
    drop(sink);
    let root = opts.dir.join("index-restored");
    let _ = std::fs::remove_dir_all(&root);
    let started = Instant::now();
    let mut keys = 0;
    for (p, uri) in &uris {
        let dir = root.join(format!("{topic}-{p}"));
        std::fs::create_dir_all(&dir).or_kind(ErrorKind::Storage, || {
            format!("cannot create {}", dir.display())
        })?;
        copies::download(&table.io, uri, &dir.join("db")).await?;
        let index = inlet_index::RocksIndex::open(&dir.join("db"), None)?;
        let mut shard = crate::upsert::Shard::open(*p as u32, &dir, Box::new(index))?;
        crate::rebuild::recover(&mut shard, &spec, table, &cfg.pipeline_id, topic, *p).await?;
        keys += inlet_index::KeyIndex::len_estimate(shard.index())?;
    }
    println!(
        "failover from index copies: {} shards, ~{keys} keys, {:.0} MiB; upload {upload_secs:.1}s, download + open + catch-up {:.1}s",
        uris.len(),
        bytes as f64 / 1_048_576.0,
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

/// Times `n` commits of a checkpoint holding one small data file into a table of `cfg`'s
/// catalog and warehouse: manifest, manifest list, metadata file and catalog swap, in ms.
pub(super) async fn commit_latencies(cfg: &Config, n: usize) -> Result<Vec<f64>> {
    Ok(commit_series(cfg, "commits", n, async |_, _| ()).await?.0)
}

/// What a table's history costs as it ages: the commit time and metadata size early (commit
/// 100) and late (commit `n`), with snapshot expiry run every 100 commits as the daemon's
/// services would (keeping the newest `snapshots_min`) and the table's own metadata upkeep
/// (old metadata files deleted, manifests merged) on every commit.
pub(super) async fn commit_history(cfg: &Config, n: usize) -> Result<()> {
    use crate::maintain::expire::{expire_snapshots, ExpiryPolicy};
    let n = n.max(200);
    let policy = ExpiryPolicy {
        window_ms: 0,
        min_snapshots: cfg.services.snapshots_min as usize,
        batch: cfg.services.expire_batch as usize,
    };
    let (ms, samples) = commit_series(cfg, "history", n, async |i, table| {
        let mut sample = None;
        if i % 100 == 0 {
            expire_snapshots(table, &policy, inlet_iceberg::now_ms(), false).await?;
            let meta = table.io.get(&table.metadata_location).await?.len();
            let snap = table
                .metadata
                .current_snapshot()
                .map(|s| s.manifest_list.clone());
            let manifests = match snap {
                Some(list) => {
                    inlet_iceberg::manifest::read_manifest_list(&table.io.get(&list).await?)?.len()
                }
                None => 0,
            };
            sample = Some((i, meta, manifests));
        }
        Result::Ok(sample)
    })
    .await?;
    let samples = samples.into_iter().collect::<Result<Vec<_>>>()?;
    let median = |from: usize, to: usize| {
        let mut v = ms[from.min(ms.len())..to.min(ms.len())].to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let at = |i: usize| samples.iter().flatten().find(|s| s.0 == i).copied();
    let (early, late) = (at(100), at(n - n % 100));
    println!(
        "table history ({n} commits, expiry every 100): commit median {:.1} ms at commits 81-120, {:.1} ms at the last 40 ({:.2}x); metadata.json {} bytes at commit 100, {} at {}; manifests in the list {} and {}",
        median(80, 120),
        median(n - 40, n),
        median(n - 40, n) / median(80, 120),
        early.map_or(0, |s| s.1),
        late.map_or(0, |s| s.1),
        late.map_or(0, |s| s.0),
        early.map_or(0, |s| s.2),
        late.map_or(0, |s| s.2),
    );
    Ok(())
}

/// `n` commits of one small data file each into a table of its own (`suffix`), timed; `after`
/// runs after each commit, outside the timing, and its results are returned in order.
pub(super) async fn commit_series<T>(
    cfg: &Config,
    suffix: &str,
    n: usize,
    mut after: impl AsyncFnMut(usize, &mut inlet_iceberg::Table) -> T,
) -> Result<(Vec<f64>, Vec<T>)> {
    use crate::commit::{Checkpoint, Committer, Offsets};
    let mut cfg = cfg.clone();
    cfg.table.name = format!("{}_{suffix}", cfg.table.name);
    cfg.table.partition_by.clear();
    let mut table = open_table(&cfg).await?;
    let mut results = Vec::with_capacity(n);
    let committer = Committer {
        pipeline_id: format!("{}-commits", cfg.pipeline_id),
        writer_id: uuid::Uuid::new_v4().to_string(),
        retries: 3,
        retry_for: Duration::from_millis(cfg.checkpoint.commit_timeout_ms),
    };
    let mut out = Vec::with_capacity(n);
    for i in 0..n as i64 {
        let path = format!("{}/data/commit-{i}.parquet", table.metadata.location);
        table
            .io
            .put(&path, bytes::Bytes::from(vec![0u8; 1024]))
            .await?;
        let file = inlet_iceberg::manifest::DataFile {
            content: inlet_iceberg::manifest::FileContent::Data,
            file_path: path,
            file_format: "PARQUET".into(),
            partition: vec![],
            record_count: 1,
            file_size_in_bytes: 1024,
            column_sizes: Default::default(),
            value_counts: Default::default(),
            null_value_counts: Default::default(),
            nan_value_counts: Default::default(),
            lower_bounds: Default::default(),
            upper_bounds: Default::default(),
            split_offsets: None,
            sort_order_id: None,
        };
        let at = |o: i64| Offsets::from([("bench".to_string(), [(0, o)].into())]);
        let cp = Checkpoint {
            id: i as u64 + 1,
            files: vec![file],
            deletes: vec![],
            start: if i == 0 { Offsets::new() } else { at(i) },
            end: at(i + 1),
            schema: None,
            epochs: Default::default(),
            claim: false,
            copies: Default::default(),
            source_ms: None,
            index_markers: Vec::new(),
            shard_topic: None,
            watermarks: Default::default(),
        };
        let started = Instant::now();
        committer.commit(&mut table, &cp).await?;
        out.push(started.elapsed().as_secs_f64() * 1000.0);
        results.push(after(i as usize + 1, &mut table).await);
    }
    Ok((out, results))
}
