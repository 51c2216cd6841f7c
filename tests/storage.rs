//! The storage seam: one conformance suite that local files and two independent S3-protocol
//! servers (s3s-fs and moto) pass through `FileIO`, and the error a user sees when the
//! credentials are wrong.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use inlet::table::io::{FileIO, StorageSettings};

/// What every store must do: whole-file put and get, literal `%` in keys, sizes, listings,
/// idempotent deletes, multipart uploads of large files, many uploads at once.
async fn conformance(io: FileIO, root: &str) {
    let key = format!("{root}/t/data/region=us%2Fwest/f.parquet");
    assert_eq!(io.head(&key).await.unwrap(), None);
    assert!(io.get(&key).await.is_err(), "a missing file reads");
    io.put(&key, Bytes::from_static(b"hello")).await.unwrap();
    assert_eq!(io.get(&key).await.unwrap(), Bytes::from_static(b"hello"));
    assert_eq!(io.head(&key).await.unwrap(), Some(5));
    // Overwrite replaces the whole content.
    io.put(&key, Bytes::from_static(b"hi")).await.unwrap();
    assert_eq!(io.get(&key).await.unwrap(), Bytes::from_static(b"hi"));

    // Larger than one part: a multipart upload, read back byte for byte.
    let big: Vec<u8> = (0..11 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let big_key = format!("{root}/t/data/big.parquet");
    io.put(&big_key, Bytes::from(big.clone())).await.unwrap();
    assert_eq!(io.get(&big_key).await.unwrap().as_ref(), big.as_slice());

    let many: Vec<(String, Bytes)> = (0..20)
        .map(|i| {
            (
                format!("{root}/t/metadata/m{i:02}.avro"),
                Bytes::from(vec![i as u8; i + 1]),
            )
        })
        .collect();
    io.put_many(many.clone()).await.unwrap();
    let listed = io.list(&format!("{root}/t")).await.unwrap();
    // Orphan cleanup ages files by these times: every store must give them, near this clock.
    let now = inlet::table::now_ms();
    for l in &listed {
        let at = l
            .modified_ms
            .unwrap_or_else(|| panic!("{} has no time", l.uri));
        assert!(
            (at - now).abs() < 10 * 60 * 1000,
            "{} written at {at}",
            l.uri
        );
    }
    let mut want: Vec<(String, u64)> = many
        .iter()
        .map(|(k, v)| (k.clone(), v.len() as u64))
        .collect();
    want.push((key.clone(), 2));
    want.push((big_key.clone(), big.len() as u64));
    want.sort();
    let got: Vec<(String, u64)> = listed.into_iter().map(|l| (l.uri, l.size)).collect();
    assert_eq!(got, want);

    io.delete(&key).await.unwrap();
    io.delete(&key).await.unwrap();
    assert_eq!(io.head(&key).await.unwrap(), None);
    assert!(io
        .list(&format!("{root}/nothing-here"))
        .await
        .unwrap()
        .is_empty());
    io.check(root).await.unwrap();
}

fn small_parts(mut s: StorageSettings) -> StorageSettings {
    s.multipart_part_bytes = 5 * 1024 * 1024;
    s.upload_concurrency = 4;
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_files_conform() {
    let dir = tempfile::tempdir().unwrap();
    let io = FileIO::new(small_parts(StorageSettings::default()));
    conformance(io, &format!("file://{}", dir.path().display())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3s_fs_conforms() {
    s3_conforms(Store::S3s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moto_conforms() {
    s3_conforms(Store::Moto).await;
}

async fn s3_conforms(kind: Store) {
    let server = S3Server::start(kind);
    server.create_bucket("conformance");
    let io = FileIO::new(small_parts(server.settings()));
    conformance(io, "s3://conformance/wh").await;
}

/// Runs `config` with `env` (whose AWS secret is wrong) and expects inlet to stop at once as
/// misconfigured (exit 2), naming `bucket` and the AWS environment the credentials came from.
fn assert_stops_naming_the_environment(
    lake: &Lake,
    config: &std::path::Path,
    env: &[(&str, &str)],
    bucket: &str,
) {
    let log = lake.log_path();
    let status = Inlet::spawn_logged(config, env, &log)
        .wait_exit(Duration::from_secs(60))
        .expect("inlet exits on wrong credentials instead of retrying");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(
        text.contains(&format!("s3://{bucket}"))
            && text.contains("environment (AWS_ACCESS_KEY_ID)"),
        "{text}"
    );
}

/// The bucket the lake's warehouse is in.
fn bucket_of(lake: &Lake) -> String {
    let path = lake.warehouse.trim_start_matches("s3://");
    path.split('/').next().unwrap().to_string()
}

/// Wrong credentials stop `inlet run` at once with an error that names the bucket and where
/// the credentials came from: the config's storage section, then the AWS environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_name_the_bucket_and_their_source() {
    let mut lake = Lake::on(Store::S3s);
    let (broker, topic, table) = topic_and_table("creds", 1).await;
    let bucket = bucket_of(&lake);
    let real = lake.s3.as_ref().unwrap().secret_key.clone();
    lake.s3.as_mut().unwrap().secret_key = "not-the-secret".into();
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 10, "");
    let run = |env: &[(&str, &str)]| {
        let mut inlet = Inlet::spawn_logged(&config, env, &lake.path().join(unique("log")));
        inlet
            .wait_exit(Duration::from_secs(60))
            .expect("inlet exits on wrong credentials instead of retrying")
    };
    let status = run(&[]);
    assert_eq!(status.code(), Some(2), "a configuration error exits with 2");
    let logs = std::fs::read_dir(lake.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("log_"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect::<String>();
    assert!(
        logs.contains(&format!("s3://{bucket}"))
            && logs.contains("storage.access_key_id and storage.secret_access_key"),
        "{logs}"
    );

    // The same through the standard AWS environment only.
    lake.s3.as_mut().unwrap().secret_key = real;
    let server = lake.s3.take().unwrap();
    let env = server.aws_env();
    let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    env.retain(|(k, _)| *k != "AWS_SECRET_ACCESS_KEY");
    env.push(("AWS_SECRET_ACCESS_KEY", "wrong"));
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 10, "");
    assert_stops_naming_the_environment(&lake, &config, &env, &bucket);
    drop(server);
}

/// With a REST catalog the server places the table, so there is no warehouse to check before
/// it exists: the storage is checked below the table's location as soon as the table is
/// loaded, and wrong credentials still stop `inlet run` at once, naming the bucket and where
/// the credentials came from, instead of failing every checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_with_a_rest_catalog_stop_at_start() {
    let lake = Lake::rest(Store::S3s);
    let (broker, topic, table) = topic_and_table("restcreds", 1).await;
    let bucket = bucket_of(&lake);
    let mut env: Vec<(String, String)> = lake.env();
    env.retain(|(k, _)| k != "AWS_SECRET_ACCESS_KEY");
    env.push(("AWS_SECRET_ACCESS_KEY".into(), "wrong".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 10, "");
    assert_stops_naming_the_environment(&lake, &config, &env, &bucket);
}

/// A REST catalog that vends storage credentials: inlet writes with them, not with its own.
/// The process's own AWS keys are wrong here, so the table only fills if every upload (data,
/// deletes, manifests) went through the vended ones. The vending deployment is the real
/// catalog behind a proxy that adds the properties to each table answer's `config`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vended_credentials_are_what_inlet_writes_with() {
    let broker = Broker::shared();
    let lake = Lake::rest(Store::S3s);
    let server = lake.rest.as_ref().unwrap();
    let s3 = lake.s3.as_ref().unwrap();
    let vend = vec![
        ("s3.access-key-id".to_string(), s3.access_key.clone()),
        ("s3.secret-access-key".to_string(), s3.secret_key.clone()),
        ("s3.endpoint".to_string(), s3.endpoint.clone()),
        ("s3.path-style-access".to_string(), "true".to_string()),
        ("client.region".to_string(), "us-east-1".to_string()),
    ];
    let proxy = RestProxy::start(server.port, None, vend);
    let topic = unique("vended");
    let table = unique("vended");
    create_topic(&broker.bootstrap, &topic, 2).await;
    let produced = produce(&broker.bootstrap, &topic, &debezium_stream(3, 400, 100, 2)).await;
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 150, "");
    let yaml = std::fs::read_to_string(&config)
        .unwrap()
        .replace(&server.uri(), &proxy.uri());
    std::fs::write(&config, yaml).unwrap();
    let total = end_offset_sum(&produced);
    let mut inlet = Inlet::spawn(
        &config,
        &[
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:1"),
            ("AWS_ACCESS_KEY_ID", "wrong"),
            ("AWS_SECRET_ACCESS_KEY", "wrong"),
            ("AWS_REGION", "eu-west-3"),
            ("AWS_ALLOW_HTTP", "true"),
        ],
    );
    let start = std::time::Instant::now();
    while lake.committed_total("test", &table, &table).await < total {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "inlet did not commit through the vended credentials"
        );
        if let Some(status) = inlet.child.try_wait().unwrap() {
            panic!("inlet exited with {status}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    inlet.stop_cleanly(Duration::from_secs(30));
    assert_exactly_once(&lake, &table, &produced).await;
}
