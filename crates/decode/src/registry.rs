//! A client of Confluent-compatible schema registries: the writer schema of a schema id.
//!
//! `GET {url}/schemas/ids/{id}` answers `{"schema": "<schema JSON as a string>", "schemaType"?:
//! "AVRO"}`; errors carry `{"error_code": 40403, "message": "..."}`, where 40403 means the id is
//! unknown. The client is blocking: decoders are synchronous and ask for each id once (see
//! [`super::avro`] for the cache and for how calls leave the async runtime's reactor alone).

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use serde::Deserialize;

use crate::config::SchemaRegistryConfig;
use inlet_common::error::{Error, ErrorKind, Result};
use inlet_common::secret::resolve_secret;

/// Attempts per lookup when the registry fails with 5xx, 429 or a connection error.
const ATTEMPTS: u32 = 3;

/// Pause before the second attempt; doubled before each later one.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);

/// A schema registry, ready to answer lookups.
pub struct Registry {
    /// Base URL without a trailing slash.
    base: String,
    agent: ureq::Agent,
    /// `Basic ...` header value, when credentials are configured.
    authorization: Option<String>,
    backoff: Duration,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Credentials stay out of debug output.
        f.debug_struct("Registry")
            .field("base", &self.base)
            .finish()
    }
}

/// The registry's answer for one id.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchemaResponse {
    schema: String,
    /// Absent for Avro, which was the only type before the registry supported others.
    schema_type: Option<String>,
}

/// The registry's error body.
#[derive(Debug, Default, Deserialize)]
struct ErrorResponse {
    error_code: Option<i64>,
    message: Option<String>,
}

/// The error code of "schema not found".
const SCHEMA_NOT_FOUND: i64 = 40403;

impl Registry {
    /// A client for `cfg`; reads secrets and the CA file now, so bad settings fail at startup.
    pub fn new(cfg: &SchemaRegistryConfig) -> Result<Registry> {
        let url = url::Url::parse(&cfg.url).map_err(|e| {
            Error::config(format!(
                "format.schema_registry.url: {:?} is not a URL ({e}); expected e.g. https://registry:8081",
                cfg.url
            ))
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Error::config(format!(
                "format.schema_registry.url: scheme {:?} is not supported; use http or https",
                url.scheme()
            )));
        }
        let username = cfg
            .username
            .as_deref()
            .map(|u| resolve_secret("format.schema_registry.username", u))
            .transpose()?;
        let password = cfg
            .password
            .as_deref()
            .map(|p| resolve_secret("format.schema_registry.password", p))
            .transpose()?;
        let authorization = match (username, password) {
            (Some(user), password) => {
                let pair = format!("{user}:{}", password.unwrap_or_default());
                Some(format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(pair)
                ))
            }
            (None, Some(_)) => {
                return Err(Error::config(
                    "format.schema_registry.password: set without username; set format.schema_registry.username too",
                ))
            }
            (None, None) => None,
        };
        let mut tls = native_tls::TlsConnector::builder();
        if let Some(path) = &cfg.ca_location {
            let pem = std::fs::read(path).map_err(|e| {
                Error::config(format!(
                    "format.schema_registry.ca_location: cannot read {path}"
                ))
                .with_source(e)
            })?;
            let ca = native_tls::Certificate::from_pem(&pem).map_err(|e| {
                Error::config(format!(
                    "format.schema_registry.ca_location: {path} is not a PEM certificate"
                ))
                .with_source(e)
            })?;
            tls.add_root_certificate(ca);
        }
        let tls = tls.build().map_err(|e| {
            Error::config("format.schema_registry: cannot set up TLS").with_source(e)
        })?;
        let agent = ureq::AgentBuilder::new()
            .tls_connector(Arc::new(tls))
            .timeout(Duration::from_millis(cfg.timeout_ms))
            .build();
        Ok(Registry {
            base: cfg.url.trim_end_matches('/').to_string(),
            agent,
            authorization,
            backoff: FIRST_BACKOFF,
        })
    }

    /// The schema text of `id`; `None` when the registry says the id does not exist.
    ///
    /// Blocks. Errors: `Registry` (retryable) when the registry stays unreachable or failing,
    /// `Config` when it refuses the request (credentials, URL), `Decode` with reason
    /// `unknown_schema` for a schema that is not Avro.
    pub fn schema(&self, id: u32) -> Result<Option<String>> {
        let url = format!("{}/schemas/ids/{id}", self.base);
        let mut backoff = self.backoff;
        let mut attempt = 1;
        loop {
            let mut request = self.agent.get(&url).set(
                "Accept",
                "application/vnd.schemaregistry.v1+json, application/json",
            );
            if let Some(auth) = &self.authorization {
                request = request.set("Authorization", auth);
            }
            let failure = match request.call() {
                Ok(response) => return self.parse(id, response).map(Some),
                Err(ureq::Error::Status(status, response)) => {
                    let body: ErrorResponse = response
                        .into_string()
                        .ok()
                        .and_then(|text| serde_json::from_str(&text).ok())
                        .unwrap_or_default();
                    if status == 404 && body.error_code == Some(SCHEMA_NOT_FOUND) {
                        return Ok(None);
                    }
                    let what = format!(
                        "HTTP {status}, error_code {}: {}",
                        body.error_code
                            .map_or_else(|| "none".to_string(), |c| c.to_string()),
                        body.message.as_deref().unwrap_or("no message")
                    );
                    if status < 500 && status != 429 {
                        return Err(Error::config(format!(
                            "format.schema_registry: the registry refused GET {url} ({what}); check url, username and password"
                        )));
                    }
                    Error::new(ErrorKind::Registry, what)
                }
                Err(ureq::Error::Transport(t)) => {
                    Error::new(ErrorKind::Registry, "cannot reach the registry").with_source(t)
                }
            };
            if attempt >= ATTEMPTS {
                return Err(Error::new(
                    ErrorKind::Registry,
                    format!("schema registry: GET {url} failed {ATTEMPTS} times"),
                )
                .with_source(failure));
            }
            tracing::warn!(schema_id = id, attempt, error = %failure, "Schema registry lookup failed; retrying");
            std::thread::sleep(backoff);
            backoff *= 2;
            attempt += 1;
        }
    }

    fn parse(&self, id: u32, response: ureq::Response) -> Result<String> {
        let text = response.into_string().map_err(|e| {
            Error::new(
                ErrorKind::Registry,
                format!("schema registry: cannot read the answer for schema id {id}"),
            )
            .with_source(e)
        })?;
        let answer: SchemaResponse = serde_json::from_str(&text).map_err(|e| {
            Error::new(
                ErrorKind::Registry,
                format!("schema registry: the answer for schema id {id} lacks a schema"),
            )
            .with_source(e)
        })?;
        match answer.schema_type.as_deref() {
            None | Some("AVRO") => Ok(answer.schema),
            Some(other) => Err(Error::decode(format!(
                "schema id {id} is a {other} schema; debezium-avro reads Avro only"
            ))
            .because(super::reason::UNKNOWN_SCHEMA)),
        }
    }
}

/// A minimal HTTP/1.1 server for tests, over plain TCP or TLS, that counts requests.
#[cfg(test)]
pub(crate) mod test_server {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    /// What a test server saw of one request.
    #[derive(Debug, Clone)]
    pub struct Request {
        pub path: String,
        pub headers: Vec<(String, String)>,
    }

    impl Request {
        pub fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
    }

    /// A running server; its thread ends with the test process.
    pub struct Server {
        pub url: String,
        pub requests: Arc<Mutex<Vec<Request>>>,
        count: Arc<AtomicUsize>,
    }

    impl Server {
        pub fn count(&self) -> usize {
            self.count.load(Ordering::SeqCst)
        }
    }

    type Handler = dyn Fn(usize, &Request) -> (u16, String) + Send + Sync;

    /// Serves `handler(request number from 0, request)` → (status, JSON body).
    pub fn start(
        tls: Option<openssl::ssl::SslAcceptor>,
        handler: impl Fn(usize, &Request) -> (u16, String) + Send + Sync + 'static,
    ) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let requests = Arc::new(Mutex::new(Vec::new()));
        let count = Arc::new(AtomicUsize::new(0));
        let handler: Arc<Handler> = Arc::new(handler);
        let (seen, counter) = (requests.clone(), count.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                match &tls {
                    Some(acceptor) => {
                        // Handshakes a client rejects (unknown CA) end here without a request.
                        if let Ok(s) = acceptor.accept(stream) {
                            serve(s, &*handler, &seen, &counter);
                        }
                    }
                    None => serve(stream, &*handler, &seen, &counter),
                }
            }
        });
        Server {
            url: format!("{scheme}://127.0.0.1:{port}"),
            requests,
            count,
        }
    }

    fn serve<S: Read + Write>(
        stream: S,
        handler: &Handler,
        seen: &Mutex<Vec<Request>>,
        count: &AtomicUsize,
    ) {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let mut headers = Vec::new();
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                headers.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        let request = Request { path, headers };
        let n = count.fetch_add(1, Ordering::SeqCst);
        seen.lock().unwrap().push(request.clone());
        let (status, body) = handler(n, &request);
        let response = format!(
            "HTTP/1.1 {status} X\r\nContent-Type: application/vnd.schemaregistry.v1+json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let mut stream = reader.into_inner();
        let _ = stream.write_all(response.as_bytes());
        let _ = stream.flush();
    }

    /// A self-signed certificate for 127.0.0.1: (acceptor for the server, CA PEM for clients).
    pub fn self_signed() -> (openssl::ssl::SslAcceptor, Vec<u8>) {
        use openssl::asn1::Asn1Time;
        use openssl::bn::BigNum;
        use openssl::hash::MessageDigest;
        use openssl::pkey::PKey;
        use openssl::rsa::Rsa;
        use openssl::ssl::{SslAcceptor, SslMethod};
        use openssl::x509::extension::{BasicConstraints, SubjectAlternativeName};
        use openssl::x509::{X509NameBuilder, X509};

        let key = PKey::from_rsa(Rsa::generate(2048).unwrap()).unwrap();
        let mut name = X509NameBuilder::new().unwrap();
        name.append_entry_by_text("CN", "127.0.0.1").unwrap();
        let name = name.build();
        let mut cert = X509::builder().unwrap();
        cert.set_version(2).unwrap();
        cert.set_serial_number(&BigNum::from_u32(1).unwrap().to_asn1_integer().unwrap())
            .unwrap();
        cert.set_subject_name(&name).unwrap();
        cert.set_issuer_name(&name).unwrap();
        cert.set_pubkey(&key).unwrap();
        cert.set_not_before(&Asn1Time::days_from_now(0).unwrap())
            .unwrap();
        cert.set_not_after(&Asn1Time::days_from_now(1).unwrap())
            .unwrap();
        cert.append_extension(BasicConstraints::new().critical().ca().build().unwrap())
            .unwrap();
        let san = SubjectAlternativeName::new()
            .ip("127.0.0.1")
            .build(&cert.x509v3_context(None, None))
            .unwrap();
        cert.append_extension(san).unwrap();
        cert.sign(&key, MessageDigest::sha256()).unwrap();
        let cert = cert.build();
        let mut acceptor = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
        acceptor.set_private_key(&key).unwrap();
        acceptor.set_certificate(&cert).unwrap();
        (acceptor.build(), cert.to_pem().unwrap())
    }
}

#[cfg(test)]
mod tests {
    use super::test_server::{self_signed, start};
    use super::*;
    use serde_json::json;

    const SCHEMA: &str = r#"{"type":"record","name":"K","fields":[{"name":"id","type":"long"}]}"#;

    fn config(url: &str) -> SchemaRegistryConfig {
        SchemaRegistryConfig {
            url: url.to_string(),
            username: None,
            password: None,
            ca_location: None,
            timeout_ms: 5_000,
        }
    }

    fn quick(cfg: &SchemaRegistryConfig) -> Registry {
        let mut registry = Registry::new(cfg).unwrap();
        registry.backoff = Duration::from_millis(5);
        registry
    }

    fn found() -> (u16, String) {
        (200, json!({ "schema": SCHEMA }).to_string())
    }

    #[test]
    fn fetches_the_schema_of_an_id() {
        let server = start(None, |_, _| found());
        let registry = quick(&config(&format!("{}/", server.url)));
        assert_eq!(registry.schema(7).unwrap().as_deref(), Some(SCHEMA));
        let requests = server.requests.lock().unwrap();
        assert_eq!(requests[0].path, "/schemas/ids/7");
        assert!(requests[0]
            .header("accept")
            .unwrap()
            .contains("application/vnd.schemaregistry.v1+json"));
        assert_eq!(requests[0].header("authorization"), None);
    }

    #[test]
    fn not_found_is_none_and_other_refusals_are_config_errors() {
        let server = start(None, |_, r| {
            if r.path.ends_with("/404") {
                (
                    404,
                    json!({"error_code": 40403, "message": "Schema 404 not found"}).to_string(),
                )
            } else {
                (
                    404,
                    json!({"error_code": 404, "message": "HTTP 404 Not Found"}).to_string(),
                )
            }
        });
        let registry = quick(&config(&server.url));
        assert_eq!(registry.schema(404).unwrap(), None);
        // A 404 without 40403 is a wrong URL, not a missing schema.
        let wrong = quick(&config(&format!("{}/nope", server.url)));
        let err = wrong.schema(1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("HTTP 404"), "{err}");
        assert_eq!(server.count(), 2, "refusals are not retried");
    }

    #[test]
    fn retries_server_errors_then_gives_up_retryably() {
        let server = start(None, |n, r| {
            if r.path.ends_with("/1") && n == 0 {
                (
                    500,
                    json!({"error_code": 50001, "message": "Error in the backend data store"})
                        .to_string(),
                )
            } else if r.path.ends_with("/2") {
                (503, String::new())
            } else {
                found()
            }
        });
        let registry = quick(&config(&server.url));
        assert_eq!(registry.schema(1).unwrap().as_deref(), Some(SCHEMA));
        assert_eq!(server.count(), 2);
        let err = registry.schema(2).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Registry);
        assert!(err.retryable());
        assert_eq!(server.count(), 2 + ATTEMPTS as usize);
    }

    #[test]
    fn unreachable_registry_is_retryable() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let registry = quick(&config(&format!("http://127.0.0.1:{port}")));
        let err = registry.schema(1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Registry);
        assert!(err.retryable());
    }

    #[test]
    fn basic_auth_from_secret_references() {
        let server = start(None, |_, r| {
            // "user:s3cret" in base64.
            if r.header("authorization") == Some("Basic dXNlcjpzM2NyZXQ=") {
                found()
            } else {
                (
                    401,
                    json!({"error_code": 401, "message": "Unauthorized"}).to_string(),
                )
            }
        });
        let anonymous = quick(&config(&server.url));
        let err = anonymous.schema(1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("HTTP 401"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("password");
        std::fs::write(&secret, "s3cret\n").unwrap();
        let mut cfg = config(&server.url);
        cfg.username = Some("user".into());
        cfg.password = Some(format!("${{file:{}}}", secret.display()));
        assert_eq!(
            quick(&cfg).schema(1).unwrap().as_deref(),
            Some(SCHEMA),
            "credentials are sent"
        );
        assert!(!format!("{:?}", quick(&cfg)).contains("s3cret"));
    }

    #[test]
    fn schemas_of_other_types_are_refused() {
        let server = start(None, |_, _| {
            (
                200,
                json!({"schema": "syntax = \"proto3\";", "schemaType": "PROTOBUF"}).to_string(),
            )
        });
        let err = quick(&config(&server.url)).schema(3).unwrap_err();
        assert_eq!(err.reason(), super::super::reason::UNKNOWN_SCHEMA);
        assert!(err.to_string().contains("PROTOBUF"), "{err}");
    }

    #[test]
    fn tls_with_the_configured_ca() {
        let (acceptor, ca_pem) = self_signed();
        let server = start(Some(acceptor), |_, _| found());
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &ca_pem).unwrap();
        let mut cfg = config(&server.url);
        cfg.ca_location = Some(ca.display().to_string());
        assert_eq!(quick(&cfg).schema(9).unwrap().as_deref(), Some(SCHEMA));
        assert_eq!(server.count(), 1);

        // Without the CA the certificate is not trusted and no request is made.
        let err = quick(&config(&server.url)).schema(9).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Registry);
        assert_eq!(server.count(), 1);
    }

    #[test]
    fn bad_settings_fail_at_startup() {
        let err = Registry::new(&config("registry:8081")).unwrap_err();
        assert!(
            err.to_string().contains("format.schema_registry.url"),
            "{err}"
        );
        let mut cfg = config("http://registry:8081");
        cfg.ca_location = Some("/nonexistent/ca.pem".into());
        let err = Registry::new(&cfg).unwrap_err();
        assert!(err.to_string().contains("ca_location"), "{err}");
        let mut cfg = config("http://registry:8081");
        cfg.password = Some("p".into());
        assert!(Registry::new(&cfg).is_err());
    }
}
