//! Secured Kafka: the pipeline reaching its broker over TLS, verifying the broker's certificate
//! and showing a client certificate, with every setting in `kafka.properties`.
//!
//! The test broker (tansu 0.6.0) cannot serve TLS itself: `--cert` and `--key` exclude each
//! other and its listener stays plaintext. Nor can it take SASL: PLAIN is not offered, and its
//! in-memory storage keeps no SCRAM users. So a TLS-terminating proxy stands in front of it,
//! and tansu advertises the proxy's address. (Refused SCRAM credentials are in `ops.rs`.)
//! Certificates that cannot work (a key its passphrase does not open, an expired broker or
//! client certificate) stop the process at once, naming the setting to fix.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// Forwards TLS connections to a plaintext upstream; with a CA file, demands a client
/// certificate signed by it.
const TLS_PROXY: &str = r#"
import asyncio, ssl, sys
listen, upstream, cert, key = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
if len(sys.argv) > 5:
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(sys.argv[5])
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except Exception:
        pass
    finally:
        w.close()
async def handle(cr, cw):
    try:
        ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
    except Exception:
        cw.close()
        return
    await asyncio.gather(pipe(cr, uw), pipe(ur, cw))
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", listen, ssl=ctx)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"#;

/// A private CA and the certificates it signs, made with the `openssl` command.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let pki = Pki {
            dir: tempfile::tempdir().unwrap(),
        };
        pki.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=inlet test CA",
        ]);
        std::fs::write(pki.path("index.txt"), "").unwrap();
        std::fs::write(pki.path("serial"), "01\n").unwrap();
        std::fs::write(
            pki.path("ca.cnf"),
            "[ca]\ndefault_ca = test\n[test]\ndatabase = index.txt\nnew_certs_dir = .\n\
             serial = serial\ndefault_md = sha256\npolicy = any\ncopy_extensions = copy\n\
             unique_subject = no\n[any]\ncommonName = supplied\n",
        )
        .unwrap();
        pki
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The pipeline's `kafka.properties` for TLS with the client certificate, its key opened
    /// with `key_password` if given.
    fn client_properties(&self, key_password: Option<&str>) -> Vec<(&'static str, String)> {
        let at = |name: &str| self.path(name).display().to_string();
        let mut properties = vec![
            ("security.protocol", "SSL".into()),
            ("ssl.ca.location", at("ca.crt")),
            ("ssl.certificate.location", at("client.crt")),
            ("ssl.key.location", at("client.key")),
        ];
        properties.extend(key_password.map(|p| ("ssl.key.password", p.to_string())));
        properties
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .expect(
                "run openssl (ca-certificates, which scripts/test-env.sh installs, depends on it)",
            );
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Signs a certificate for `name` valid from `start` to `end` (`YYYYMMDDHHMMSSZ`), for the
    /// server (names 127.0.0.1) or a client; the key is encrypted when `passphrase` is given.
    fn issue(&self, name: &str, start: &str, end: &str, passphrase: Option<&str>) {
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let mut args = vec!["req", "-newkey", "rsa:2048", "-keyout", &key, "-out", &csr];
        args.extend(["-subj", "/CN=localhost"]);
        args.extend(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]);
        let pass = passphrase.map(|p| format!("pass:{p}"));
        match &pass {
            Some(pass) => args.extend(["-passout", pass]),
            None => args.push("-nodes"),
        }
        self.openssl(&args);
        self.openssl(&[
            "ca",
            "-batch",
            "-config",
            "ca.cnf",
            "-cert",
            "ca.crt",
            "-keyfile",
            "ca.key",
            "-in",
            &csr,
            "-out",
            &format!("{name}.crt"),
            "-startdate",
            start,
            "-enddate",
            end,
            "-notext",
        ]);
    }
}

const VALID_FROM: &str = "20200101000000Z";
const VALID_TO: &str = "20991231000000Z";

/// The TLS proxy process, killed on drop.
struct TlsProxy {
    child: Child,
}

impl TlsProxy {
    /// Listens on `port` with `cert`, forwarding to `upstream`; demands client certificates
    /// signed by `client_ca` when given.
    fn start(pki: &Pki, port: u16, upstream: &str, cert: &str, client_ca: Option<&Path>) -> Self {
        let script = pki.path("tls_proxy.py");
        std::fs::write(&script, TLS_PROXY).unwrap();
        let upstream_port = upstream.rsplit(':').next().unwrap();
        let mut cmd = Command::new(python());
        cmd.arg(&script)
            .arg(port.to_string())
            .arg(upstream_port)
            .arg(pki.path(&format!("{cert}.crt")))
            .arg(pki.path(&format!("{cert}.key")));
        if let Some(ca) = client_ca {
            cmd.arg(ca);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the TLS proxy");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "the TLS proxy did not start");
        TlsProxy { child }
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tansu broker behind a TLS proxy: `bootstrap` is the proxy's address.
struct SecuredBroker {
    _proxy: TlsProxy,
    _broker: Broker,
    bootstrap: String,
}

impl SecuredBroker {
    fn start(pki: &Pki, cert: &str, client_ca: Option<&Path>) -> SecuredBroker {
        let port = free_port();
        let bootstrap = format!("127.0.0.1:{port}");
        let broker = Broker::start_behind(&bootstrap);
        let proxy = TlsProxy::start(pki, port, &broker.bootstrap, cert, client_ca);
        SecuredBroker {
            _proxy: proxy,
            _broker: broker,
            bootstrap,
        }
    }
}

/// Adds `properties` (YAML lines under `kafka.properties`) to a test config.
fn with_properties(config: &Path, properties: &[(&str, String)]) {
    let lines: String = properties
        .iter()
        .map(|(k, v)| format!("    {k}: \"{v}\"\n"))
        .collect();
    let anchor = "    session.timeout.ms: \"6000\"\n";
    let text = std::fs::read_to_string(config)
        .unwrap()
        .replace(anchor, &format!("{anchor}{lines}"));
    std::fs::write(config, text).unwrap();
}

/// Produces a changelog through `broker`, runs the pipeline with `properties` and `env` until
/// the table holds every change, and returns what it logged.
async fn consume_through(
    broker: &SecuredBroker,
    client: &[(&str, &str)],
    properties: &[(&str, String)],
    env: &[(&str, &str)],
) -> String {
    let lake = Lake::new();
    let (topic, table) = (unique("tls"), unique("tls"));
    create_topic_with(&broker.bootstrap, client, &topic, 2).await;
    let produced = produce_with(
        &broker.bootstrap,
        client,
        &topic,
        &debezium_stream(7, 200, 40, 2),
    )
    .await;
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 50, "");
    with_properties(&config, properties);
    let log = lake.log_path();
    let mut lake_env = lake.env();
    lake_env.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let env: Vec<(&str, &str)> = lake_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut inlet = Inlet::spawn_logged(&config, &env, &log);
    let total = end_offset_sum(&produced);
    let caught_up = wait_table_committed(&lake, &table, total, Duration::from_secs(120)).await;
    inlet.sigterm();
    let status = inlet.wait_exit(Duration::from_secs(60));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(caught_up, "inlet did not catch up: {text}");
    assert!(status.is_some_and(|s| s.success()), "{status:?}: {text}");
    assert_eq!(lake.row_count(&table), produced_changes(&produced).len());
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_verifying_the_broker_fills_the_table() {
    let pki = Pki::new();
    pki.issue("server", VALID_FROM, VALID_TO, None);
    let broker = SecuredBroker::start(&pki, "server", None);
    let ca = pki.path("ca.crt").display().to_string();
    let client = [
        ("security.protocol", "ssl"),
        ("ssl.ca.location", ca.as_str()),
    ];
    consume_through(
        &broker,
        &client,
        &[
            ("security.protocol", "SSL".into()),
            ("ssl.ca.location", ca.clone()),
        ],
        &[],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_with_an_encrypted_key_fills_the_table_and_hides_the_passphrase() {
    let pki = Pki::new();
    pki.issue("server", VALID_FROM, VALID_TO, None);
    let passphrase = "key-passphrase-7f3a";
    pki.issue("client", VALID_FROM, VALID_TO, Some(passphrase));
    let ca = pki.path("ca.crt");
    let broker = SecuredBroker::start(&pki, "server", Some(&ca));
    let ca = ca.display().to_string();
    let cert = pki.path("client.crt").display().to_string();
    let key = pki.path("client.key").display().to_string();
    let client = [
        ("security.protocol", "ssl"),
        ("ssl.ca.location", ca.as_str()),
        ("ssl.certificate.location", cert.as_str()),
        ("ssl.key.location", key.as_str()),
        ("ssl.key.password", passphrase),
    ];
    let log = consume_through(
        &broker,
        &client,
        &pki.client_properties(Some("${env:INLET_TEST_KEY_PASSPHRASE}")),
        &[("INLET_TEST_KEY_PASSPHRASE", passphrase)],
    )
    .await;
    assert!(!log.contains(passphrase), "the passphrase is logged: {log}");
}

/// Runs a changelog pipeline with `properties` against `broker` and expects it to stop for
/// good (exit 2: a configuration to fix) with an error naming `setting`; returns its log.
async fn refused(
    broker: &SecuredBroker,
    properties: &[(&str, String)],
    env: &[(&str, &str)],
    setting: &str,
) -> String {
    let lake = Lake::new();
    let (topic, table) = (unique("tls"), unique("tls"));
    let config = changelog_config(&lake, &broker.bootstrap, &topic, &table, 50, "");
    with_properties(&config, properties);
    let log = lake.log_path();
    let mut all = lake.env();
    all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let all: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut inlet = Inlet::spawn_logged(&config, &all, &log);
    let status = inlet.wait_exit(Duration::from_secs(60));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "not stopped as misconfigured: {text}"
    );
    let stopped = log_events(&log)
        .into_iter()
        .find(|e| e["fields"]["message"] == "Stopped")
        .unwrap_or_else(|| panic!("no Stopped event: {text}"));
    let error = stopped["fields"]["error"].as_str().unwrap_or_default();
    assert!(error.contains(setting), "{error}");
    text
}

/// A key the passphrase does not open stops the process naming the setting, never the
/// passphrase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_passphrase_stops_naming_the_setting_without_showing_it() {
    let pki = Pki::new();
    pki.issue("server", VALID_FROM, VALID_TO, None);
    pki.issue("client", VALID_FROM, VALID_TO, Some("the-right-one"));
    let ca = pki.path("ca.crt");
    let broker = SecuredBroker::start(&pki, "server", Some(&ca));
    let wrong = "not-the-passphrase-51c2";
    let log = refused(
        &broker,
        &pki.client_properties(Some("${env:INLET_TEST_KEY_PASSPHRASE}")),
        &[("INLET_TEST_KEY_PASSPHRASE", wrong)],
        "ssl.key.location",
    )
    .await;
    assert!(!log.contains(wrong), "the passphrase is logged: {log}");
}

/// A broker whose certificate has expired is refused for good, naming where its CA is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_broker_certificate_stops_naming_the_setting() {
    let pki = Pki::new();
    pki.issue("server", "20200101000000Z", "20210101000000Z", None);
    let broker = SecuredBroker::start(&pki, "server", None);
    refused(
        &broker,
        &[
            ("security.protocol", "SSL".into()),
            ("ssl.ca.location", pki.path("ca.crt").display().to_string()),
        ],
        &[],
        "ssl.ca.location",
    )
    .await;
}

/// A client certificate the broker refuses (expired) stops the process, naming the client
/// certificate settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_client_certificate_stops_naming_the_setting() {
    let pki = Pki::new();
    pki.issue("server", VALID_FROM, VALID_TO, None);
    pki.issue("client", "20200101000000Z", "20210101000000Z", None);
    let ca = pki.path("ca.crt");
    let broker = SecuredBroker::start(&pki, "server", Some(&ca));
    refused(
        &broker,
        &pki.client_properties(None),
        &[],
        "ssl.certificate.location",
    )
    .await;
}
