//! The Iceberg REST catalog client: tables and namespaces through `/v1/{prefix}/…`, commits as
//! requirements plus updates so the server is the compare-and-swap, and multi-table commits
//! through `/v1/{prefix}/transactions/commit` where the server offers it.
//!
//! A commit whose outcome is unknown (a 5xx that may come after the server committed, a
//! timeout, a dropped connection) is never sent again blindly: the tables are reloaded, and the
//! commit counts as landed iff the snapshot it added is there. If it is not, the caller gets a
//! retryable error and rebases; the requirement on the branch's snapshot id makes a late landing
//! of the first attempt reject the second, so nothing commits twice.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value as Json};

use super::metadata::TableMetadata;
use inlet_common::error::{Error, ErrorKind, Result};

/// How to reach a REST catalog.
#[derive(Debug, Clone)]
pub struct RestSettings {
    /// Base URL, without `/v1`.
    pub uri: String,
    /// Warehouse name or location sent to `/v1/config`.
    pub warehouse: Option<String>,
    /// A bearer token.
    pub token: Option<String>,
    /// OAuth2 client credentials (`client_id`, `client_secret`).
    pub credential: Option<(String, String)>,
    /// OAuth2 token endpoint.
    pub oauth2_server_uri: Option<String>,
    pub scope: String,
    /// Headers sent with every request.
    pub headers: BTreeMap<String, String>,
    /// Ask for vended storage credentials.
    pub vended_credentials: bool,
    pub request_timeout: Duration,
}

/// A table as the server returns it.
pub struct Loaded {
    pub metadata_location: String,
    pub metadata: TableMetadata,
    /// Storage properties for the table's files (vended credentials, endpoint).
    pub storage: BTreeMap<String, String>,
}

/// One table's part of a commit: its name, the metadata it was staged on, the metadata wanted.
pub struct Change<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub base: &'a TableMetadata,
    pub next: &'a TableMetadata,
}

/// How a commit request ended.
pub enum Committed {
    /// Landed; the tables' new state in `Change` order.
    Landed(Vec<Loaded>),
    /// A requirement failed: another writer changed a table first; nothing changed.
    Conflict,
}

struct Token {
    value: String,
    /// When to fetch a new one (OAuth2 only).
    renew_at: Option<Instant>,
}

struct Inner {
    http: reqwest::Client,
    settings: RestSettings,
    /// `{uri}/v1/` or `{uri}/v1/{prefix}/`.
    base: String,
    token: std::sync::Mutex<Option<Token>>,
    /// `POST /v1/{prefix}/transactions/commit` is offered.
    transactions: bool,
}

/// A connected REST catalog.
#[derive(Clone)]
pub struct RestCatalog {
    inner: Arc<Inner>,
}

/// Characters escaped in a path segment (namespace and table names).
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.');

fn segment(s: &str) -> String {
    utf8_percent_encode(s, SEGMENT).to_string()
}

/// What a response said, for errors.
fn server_message(body: &[u8]) -> String {
    serde_json::from_slice::<Json>(body)
        .ok()
        .and_then(|j| {
            let e = j.get("error")?;
            Some(format!(
                "{} {}",
                e.get("type").and_then(Json::as_str).unwrap_or(""),
                e.get("message").and_then(Json::as_str).unwrap_or("")
            ))
        })
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned())
}

/// How one request is sent.
#[derive(Clone, Copy)]
struct Call<'a> {
    /// The `Idempotency-Key` every attempt of this request carries.
    key: &'a str,
    /// Asks for vended storage credentials.
    delegate: bool,
    /// A table commit: only answers proving nothing was done are retried.
    commit: bool,
}

/// A request that failed without a response, or with a 5xx.
struct Unanswered {
    status: Option<StatusCode>,
    detail: String,
}

impl RestCatalog {
    /// Reads `/v1/config` (prefix, offered endpoints) and authenticates.
    pub async fn connect(settings: RestSettings) -> Result<RestCatalog> {
        let http = reqwest::Client::builder()
            .timeout(settings.request_timeout)
            .connect_timeout(settings.request_timeout.min(Duration::from_secs(10)))
            .build()
            .map_err(|e| {
                Error::new(ErrorKind::Catalog, "cannot create the REST catalog client")
                    .with_source(e)
            })?;
        let root = format!("{}/v1/", settings.uri.trim_end_matches('/'));
        let mut catalog = RestCatalog {
            inner: Arc::new(Inner {
                http,
                base: root.clone(),
                token: std::sync::Mutex::new(settings.token.clone().map(|value| Token {
                    value,
                    renew_at: None,
                })),
                settings,
                transactions: false,
            }),
        };
        let query = match &catalog.inner.settings.warehouse {
            Some(w) if !w.is_empty() => format!("config?warehouse={}", segment(w)),
            _ => "config".to_string(),
        };
        let config = catalog.read(&query).await?.ok_or_else(|| {
            Error::config(format!(
                "catalog.uri: {} does not serve an Iceberg REST catalog (no /v1/config)",
                catalog.inner.settings.uri
            ))
        })?;
        let pick = |key: &str| {
            config["overrides"]
                .get(key)
                .or_else(|| config["defaults"].get(key))
                .and_then(Json::as_str)
                .map(str::to_string)
        };
        let prefix = pick("prefix");
        // A server that lists no endpoints offers the spec's default set, which does not
        // include multi-table transactions.
        let transactions = config
            .get("endpoints")
            .and_then(Json::as_array)
            .is_some_and(|list| {
                list.iter()
                    .any(|e| e.as_str() == Some("POST /v1/{prefix}/transactions/commit"))
            });
        let inner = Arc::get_mut(&mut catalog.inner).ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                "REST catalog shared before it was set up",
            )
        })?;
        if let Some(p) = prefix.filter(|p| !p.is_empty()) {
            inner.base = format!("{root}{}/", p.trim_matches('/'));
        }
        inner.transactions = transactions;
        Ok(catalog)
    }

    /// Whether several tables commit atomically (`/transactions/commit`).
    pub fn multi_table(&self) -> bool {
        self.inner.transactions
    }

    /// The catalog's address, for messages.
    pub fn uri(&self) -> &str {
        &self.inner.settings.uri
    }

    async fn bearer(&self) -> Result<Option<String>> {
        let s = &self.inner.settings;
        {
            let token = self.inner.token.lock().unwrap_or_else(|p| p.into_inner());
            let fresh = token
                .as_ref()
                .is_some_and(|t| t.renew_at.is_none_or(|at| Instant::now() < at));
            if fresh || s.credential.is_none() {
                return Ok(token.as_ref().map(|t| t.value.clone()));
            }
        }
        // Fetched without the lock held; two requests renewing at once both get a valid token.
        let Some((id, secret)) = &s.credential else {
            return Ok(None);
        };
        let fresh = self.oauth2(id, secret).await?;
        let value = fresh.value.clone();
        *self.inner.token.lock().unwrap_or_else(|p| p.into_inner()) = Some(fresh);
        Ok(Some(value))
    }

    /// The client-credentials grant.
    async fn oauth2(&self, id: &str, secret: &str) -> Result<Token> {
        let s = &self.inner.settings;
        let url = s
            .oauth2_server_uri
            .clone()
            .unwrap_or_else(|| format!("{}/v1/oauth/tokens", s.uri.trim_end_matches('/')));
        let form = [
            ("grant_type", "client_credentials"),
            ("client_id", id),
            ("client_secret", secret),
            ("scope", s.scope.as_str()),
        ];
        let body = form
            .iter()
            .map(|(k, v)| format!("{k}={}", segment(v)))
            .collect::<Vec<_>>()
            .join("&");
        let response = self
            .inner
            .http
            .post(&url)
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::Catalog,
                    format!("cannot reach the OAuth2 server {url}"),
                )
                .with_source(e)
            })?;
        let status = response.status();
        let bytes = response.bytes().await.unwrap_or_default();
        if !status.is_success() {
            let message = format!(
                "catalog.credential: the OAuth2 server {url} refused the client credentials (HTTP {status}: {})",
                server_message(&bytes)
            );
            return Err(if status.is_client_error() {
                Error::config(message)
            } else {
                Error::new(ErrorKind::Catalog, message)
            });
        }
        let j: Json = serde_json::from_slice(&bytes).unwrap_or_default();
        let value = j["access_token"].as_str().ok_or_else(|| {
            Error::new(
                ErrorKind::Catalog,
                format!("the OAuth2 server {url} answered without an access_token"),
            )
        })?;
        let renew_at = j["expires_in"]
            .as_u64()
            .map(|secs| Instant::now() + Duration::from_secs(secs.saturating_sub(secs / 10 + 5)));
        Ok(Token {
            value: value.to_string(),
            renew_at,
        })
    }

    /// One request, retried with the same `Idempotency-Key` on answers that prove nothing was
    /// done: a refused connection, 429, and 503 except for commits (a 503 to a commit may come
    /// from a gateway after the server committed, so the spec counts its outcome as unknown).
    /// Returns the status and body, or what is known of a request that may or may not have been
    /// carried out.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Json>,
        call: Call<'_>,
    ) -> Result<std::result::Result<(StatusCode, bytes::Bytes), Unanswered>> {
        let url = format!("{}{path}", self.inner.base);
        let mut attempt = 0u32;
        let mut renewed = false;
        loop {
            attempt += 1;
            let mut req = self.inner.http.request(method.clone(), &url);
            if let Some(token) = self.bearer().await? {
                req = req.bearer_auth(token);
            }
            for (k, v) in &self.inner.settings.headers {
                req = req.header(k, v);
            }
            if call.delegate && self.inner.settings.vended_credentials {
                req = req.header("X-Iceberg-Access-Delegation", "vended-credentials");
            }
            if let Some(b) = body {
                req = req
                    .header("Content-Type", "application/json")
                    .header("Idempotency-Key", call.key)
                    .body(b.to_string());
            }
            let retry_later = |attempt: u32| attempt < 6;
            match req.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    let refused = status == StatusCode::TOO_MANY_REQUESTS
                        || (status == StatusCode::SERVICE_UNAVAILABLE && !call.commit);
                    if refused && retry_later(attempt) {
                        tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                        continue;
                    }
                    let bytes = match resp.bytes().await {
                        Ok(b) => b,
                        Err(e) => {
                            return Ok(Err(Unanswered {
                                status: Some(status),
                                detail: e.to_string(),
                            }))
                        }
                    };
                    if status.is_server_error() {
                        return Ok(Err(Unanswered {
                            status: Some(status),
                            detail: server_message(&bytes),
                        }));
                    }
                    // An OAuth2 token the server no longer takes (revoked, or expired before
                    // its renewal time): fetch a new one once. A 401 proves nothing was done.
                    if status == StatusCode::UNAUTHORIZED
                        && self.inner.settings.credential.is_some()
                        && !renewed
                    {
                        renewed = true;
                        *self.inner.token.lock().unwrap_or_else(|p| p.into_inner()) = None;
                        continue;
                    }
                    if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
                        return Err(Error::config(format!(
                            "catalog: the REST catalog {} refused {method} {path} (HTTP {status}: {}); check catalog.token, catalog.credential or catalog.headers",
                            self.inner.settings.uri,
                            server_message(&bytes)
                        )));
                    }
                    return Ok(Ok((status, bytes)));
                }
                Err(e) if e.is_connect() && retry_later(attempt) => {
                    tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                }
                Err(e) => {
                    return Ok(Err(Unanswered {
                        status: None,
                        detail: e.to_string(),
                    }))
                }
            }
        }
    }

    /// A request whose failure is an error (reads, creations): a 5xx or lost answer is retried
    /// here since doing it twice is harmless. `Ok(None)` on 404.
    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&Json>,
        delegate: bool,
    ) -> Result<Option<(StatusCode, Json)>> {
        // Every attempt is the same request: the server may recognise a repeat by its key.
        let key = uuid::Uuid::new_v4().to_string();
        let call = Call {
            key: &key,
            delegate,
            commit: false,
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.call(method.clone(), path, body, call).await? {
                Ok((StatusCode::NOT_FOUND, _)) => return Ok(None),
                Ok((status, bytes)) if status.is_success() || status == StatusCode::CONFLICT => {
                    let json = if bytes.is_empty() {
                        Json::Null
                    } else {
                        serde_json::from_slice(&bytes).map_err(|e| {
                            Error::new(
                                ErrorKind::Catalog,
                                format!(
                                    "the REST catalog answered {method} {path} with invalid JSON"
                                ),
                            )
                            .with_source(e)
                        })?
                    };
                    return Ok(Some((status, json)));
                }
                Ok((status, bytes)) => {
                    return Err(Error::new(
                        ErrorKind::Catalog,
                        format!(
                            "the REST catalog {} rejected {method} {path} (HTTP {status}: {})",
                            self.inner.settings.uri,
                            server_message(&bytes)
                        ),
                    ))
                }
                Err(u) if attempt < 4 => {
                    tracing::warn!(path, status = ?u.status, detail = %u.detail, "REST catalog request failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
                }
                Err(u) => {
                    return Err(Error::new(
                        ErrorKind::Catalog,
                        format!(
                            "the REST catalog {} did not answer {method} {path}: {}",
                            self.inner.settings.uri,
                            u.status
                                .map_or(u.detail.clone(), |s| format!("HTTP {s} {}", u.detail))
                        ),
                    ))
                }
            }
        }
    }

    async fn read(&self, path: &str) -> Result<Option<Json>> {
        Ok(self
            .request(Method::GET, path, None, false)
            .await?
            .map(|(_, j)| j))
    }

    fn table_path(namespace: &str, name: &str) -> String {
        format!("namespaces/{}/tables/{}", segment(namespace), segment(name))
    }

    /// Creates the namespace unless it exists.
    pub async fn ensure_namespace(&self, namespace: &str) -> Result<()> {
        let body = json!({"namespace": [namespace], "properties": {}});
        self.request(Method::POST, "namespaces", Some(&body), false)
            .await?;
        Ok(())
    }

    /// Loads a table, or `None` if the catalog does not know it.
    pub async fn load(&self, namespace: &str, name: &str) -> Result<Option<Loaded>> {
        let path = Self::table_path(namespace, name);
        match self.request(Method::GET, &path, None, true).await? {
            None => Ok(None),
            Some((_, j)) => parse_loaded(&j, &format!("{namespace}.{name}")).map(Some),
        }
    }

    /// Creates a table with the schema, partition spec and properties of `metadata`; the
    /// server assigns ids and the location. Returns false if it already exists.
    pub async fn create(
        &self,
        namespace: &str,
        name: &str,
        metadata: &TableMetadata,
    ) -> Result<bool> {
        let body = json!({
            "name": name,
            "schema": metadata.current_schema()?,
            "partition-spec": metadata.default_spec()?,
            "write-order": {"order-id": 0, "fields": []},
            "properties": metadata.properties,
            "stage-create": false,
        });
        let path = format!("namespaces/{}/tables", segment(namespace));
        match self.request(Method::POST, &path, Some(&body), true).await? {
            Some((StatusCode::CONFLICT, _)) => Ok(false),
            Some(_) => Ok(true),
            None => Err(Error::new(
                ErrorKind::Catalog,
                format!("namespace {namespace} vanished while creating table {name}"),
            )),
        }
    }

    /// Every table, as (namespace, name): top-level namespaces and their tables.
    pub async fn list_tables(&self) -> Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        for ns in self.paged("namespaces", "namespaces").await? {
            let Some(parts) = ns.as_array() else { continue };
            let namespace = parts
                .iter()
                .filter_map(Json::as_str)
                .collect::<Vec<_>>()
                .join("\u{1f}");
            let path = format!("namespaces/{}/tables", segment(&namespace));
            for ident in self.paged(&path, "identifiers").await? {
                if let Some(name) = ident["name"].as_str() {
                    out.push((namespace.clone(), name.to_string()));
                }
            }
        }
        out.sort();
        Ok(out)
    }

    async fn paged(&self, path: &str, field: &str) -> Result<Vec<Json>> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let url = match &token {
                Some(t) => format!("{path}?pageToken={}", segment(t)),
                None => path.to_string(),
            };
            let Some(page) = self.read(&url).await? else {
                return Ok(out);
            };
            out.extend(page[field].as_array().cloned().unwrap_or_default());
            match page["next-page-token"].as_str() {
                Some(t) if !t.is_empty() => token = Some(t.to_string()),
                _ => return Ok(out),
            }
        }
    }

    /// Commits changes to one or more tables as the server's compare-and-swap.
    pub async fn commit(&self, changes: &[Change<'_>]) -> Result<Committed> {
        let bodies: Vec<Json> = changes.iter().map(table_change).collect::<Result<_>>()?;
        let (method, path, body) = match bodies.as_slice() {
            [one] => (
                Method::POST,
                Self::table_path(changes[0].namespace, changes[0].name),
                one.clone(),
            ),
            _ if !self.multi_table() => {
                return Err(Error::config(format!(
                    "the REST catalog {} offers no multi-table transactions (POST /v1/{{prefix}}/transactions/commit), so the tables of one checkpoint cannot commit atomically; write one table per pipeline",
                    self.uri()
                )))
            }
            _ => (
                Method::POST,
                "transactions/commit".to_string(),
                json!({"table-changes": bodies}),
            ),
        };
        let key = uuid::Uuid::new_v4().to_string();
        let call = Call {
            key: &key,
            delegate: false,
            commit: true,
        };
        match self.call(method, &path, Some(&body), call).await? {
            Ok((StatusCode::CONFLICT, _)) => Ok(Committed::Conflict),
            Ok((status, bytes)) if status.is_success() => {
                let single = changes.len() == 1 && !bytes.is_empty();
                if single {
                    let j: Json = serde_json::from_slice(&bytes).map_err(|e| {
                        Error::new(
                            ErrorKind::Catalog,
                            "the REST catalog answered a commit with invalid JSON",
                        )
                        .with_source(e)
                    })?;
                    let name = format!("{}.{}", changes[0].namespace, changes[0].name);
                    let mut loaded = parse_loaded(&j, &name)?;
                    // Commit responses carry no storage config; keep the caller's.
                    loaded.storage = BTreeMap::new();
                    return Ok(Committed::Landed(vec![loaded]));
                }
                self.reload_all(changes).await.map(Committed::Landed)
            }
            Ok((status, bytes)) => Err(Error::new(
                if status == StatusCode::NOT_FOUND {
                    ErrorKind::Catalog
                } else {
                    ErrorKind::Metadata
                },
                format!(
                    "the REST catalog {} rejected the commit (HTTP {status}: {})",
                    self.uri(),
                    server_message(&bytes)
                ),
            )),
            Err(unanswered) => self.resolve_unknown(changes, unanswered).await,
        }
    }

    /// After a commit whose outcome is unknown: reloads the tables and looks for the snapshots
    /// the commit added.
    async fn resolve_unknown(&self, changes: &[Change<'_>], u: Unanswered) -> Result<Committed> {
        tracing::warn!(status = ?u.status, detail = %u.detail, "Commit outcome unknown; reloading the tables to find out");
        let reloaded = self.reload_all(changes).await?;
        let landed: Vec<bool> = changes
            .iter()
            .zip(&reloaded)
            .map(|(c, now)| {
                let added = c.next.current_snapshot_id;
                added.is_some()
                    && added != c.base.current_snapshot_id
                    && now
                        .metadata
                        .snapshots
                        .iter()
                        .any(|s| Some(s.snapshot_id) == added)
            })
            .collect();
        if landed.iter().all(|l| *l) {
            tracing::info!("The commit had landed");
            return Ok(Committed::Landed(reloaded));
        }
        if landed.iter().any(|l| *l) {
            return Err(Error::new(
                ErrorKind::Internal,
                "a multi-table commit landed in some tables but not in others",
            ));
        }
        Err(Error::new(
            ErrorKind::Catalog,
            format!(
                "commit outcome unknown ({}) and its snapshot is not in the table; rebasing",
                u.status.map_or(u.detail.clone(), |s| format!("HTTP {s}"))
            ),
        ))
    }

    async fn reload_all(&self, changes: &[Change<'_>]) -> Result<Vec<Loaded>> {
        let mut out = Vec::with_capacity(changes.len());
        for c in changes {
            let loaded = self.load(c.namespace, c.name).await?.ok_or_else(|| {
                Error::new(
                    ErrorKind::Catalog,
                    format!("table {}.{} was dropped", c.namespace, c.name),
                )
            })?;
            out.push(loaded);
        }
        Ok(out)
    }
}

fn parse_loaded(j: &Json, name: &str) -> Result<Loaded> {
    let metadata_location = j["metadata-location"]
        .as_str()
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Catalog,
                format!("the REST catalog returned table {name} without a metadata-location"),
            )
        })?
        .to_string();
    let metadata: TableMetadata = serde_json::from_value(j["metadata"].clone()).map_err(|e| {
        Error::metadata(format!(
            "cannot parse the metadata of table {name} from the REST catalog"
        ))
        .with_source(e)
    })?;
    let mut storage: BTreeMap<String, String> = string_map(&j["config"]);
    // The most specific credentials whose prefix holds the table win.
    let mut best: Option<(usize, BTreeMap<String, String>)> = None;
    for c in j["storage-credentials"].as_array().into_iter().flatten() {
        let prefix = c["prefix"].as_str().unwrap_or("");
        if metadata.location.starts_with(prefix)
            && best.as_ref().is_none_or(|(n, _)| prefix.len() > *n)
        {
            best = Some((prefix.len(), string_map(&c["config"])));
        }
    }
    if let Some((_, creds)) = best {
        storage.extend(creds);
    }
    Ok(Loaded {
        metadata_location,
        metadata,
        storage,
    })
}

fn string_map(j: &Json) -> BTreeMap<String, String> {
    j.as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
        .collect()
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<Json> {
    serde_json::to_value(v).map_err(|e| {
        Error::new(ErrorKind::Internal, "cannot serialise a catalog update").with_source(e)
    })
}

/// The requirements and updates that turn `base` into `next`, as one `table-changes` entry.
fn table_change(c: &Change<'_>) -> Result<Json> {
    let (base, next) = (c.base, c.next);
    let main = |m: &TableMetadata| {
        m.refs
            .get("main")
            .map(|r| r.snapshot_id)
            .or(m.current_snapshot_id)
    };
    let mut requirements = vec![
        json!({"type": "assert-table-uuid", "uuid": base.table_uuid}),
        json!({"type": "assert-ref-snapshot-id", "ref": "main", "snapshot-id": main(base)}),
    ];
    let mut updates = Vec::new();
    let new_schemas: Vec<_> = next
        .schemas
        .iter()
        .filter(|s| !base.schemas.iter().any(|b| b.schema_id == s.schema_id))
        .collect();
    if !new_schemas.is_empty() || next.current_schema_id != base.current_schema_id {
        requirements.push(
            json!({"type": "assert-current-schema-id", "current-schema-id": base.current_schema_id}),
        );
        requirements.push(json!({"type": "assert-last-assigned-field-id", "last-assigned-field-id": base.last_column_id}));
    }
    for s in &new_schemas {
        updates.push(json!({"action": "add-schema", "schema": to_json(s)?, "last-column-id": next.last_column_id}));
    }
    if next.current_schema_id != base.current_schema_id {
        let id = if new_schemas
            .iter()
            .any(|s| s.schema_id == next.current_schema_id)
        {
            -1
        } else {
            next.current_schema_id
        };
        updates.push(json!({"action": "set-current-schema", "schema-id": id}));
    }
    for s in next.snapshots.iter().filter(|s| {
        !base
            .snapshots
            .iter()
            .any(|b| b.snapshot_id == s.snapshot_id)
    }) {
        updates.push(json!({"action": "add-snapshot", "snapshot": to_json(s)?}));
    }
    let kept: std::collections::HashSet<i64> =
        next.snapshots.iter().map(|s| s.snapshot_id).collect();
    let removed_snapshots: Vec<i64> = base
        .snapshots
        .iter()
        .map(|s| s.snapshot_id)
        .filter(|id| !kept.contains(id))
        .collect();
    if !removed_snapshots.is_empty() {
        updates.push(json!({"action": "remove-snapshots", "snapshot-ids": removed_snapshots}));
    }
    for (name, r) in &next.refs {
        if base.refs.get(name) != Some(r) {
            let mut update = json!({"action": "set-snapshot-ref", "ref-name": name, "type": r.kind, "snapshot-id": r.snapshot_id});
            for (k, v) in &r.extra {
                update[k] = v.clone();
            }
            updates.push(update);
        }
    }
    let changed: BTreeMap<&String, &String> = next
        .properties
        .iter()
        .filter(|(k, v)| base.properties.get(*k) != Some(*v))
        .collect();
    if !changed.is_empty() {
        updates.push(json!({"action": "set-properties", "updates": changed}));
    }
    let removed: Vec<&String> = base
        .properties
        .keys()
        .filter(|k| !next.properties.contains_key(*k))
        .collect();
    if !removed.is_empty() {
        updates.push(json!({"action": "remove-properties", "removals": removed}));
    }
    Ok(json!({
        "identifier": {"namespace": [c.namespace], "name": c.name},
        "requirements": requirements,
        "updates": updates,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::{Snapshot, SnapshotRef};

    fn meta() -> TableMetadata {
        let def = crate::TableDefinition {
            columns: vec![("id".into(), crate::types::Type::Long, true, None)],
            identifier: vec!["id".into()],
            partition: vec![],
            properties: BTreeMap::new(),
        };
        def.new_metadata("s3://b/t").unwrap()
    }

    #[test]
    fn a_commit_asserts_the_branch_it_was_staged_on() {
        let base = meta();
        let mut next = base.clone();
        next.snapshots.push(Snapshot {
            snapshot_id: 7,
            parent_snapshot_id: None,
            sequence_number: 1,
            timestamp_ms: 1,
            manifest_list: "s3://b/t/metadata/snap-7.avro".into(),
            summary: BTreeMap::from([("operation".into(), "append".into())]),
            schema_id: Some(0),
            extra: Default::default(),
        });
        next.current_snapshot_id = Some(7);
        next.refs.insert(
            "main".into(),
            SnapshotRef {
                snapshot_id: 7,
                kind: "branch".into(),
                extra: Default::default(),
            },
        );
        let change = table_change(&Change {
            namespace: "ns",
            name: "t",
            base: &base,
            next: &next,
        })
        .unwrap();
        let req = &change["requirements"];
        assert_eq!(req[0]["type"], "assert-table-uuid");
        assert_eq!(req[0]["uuid"], base.table_uuid.as_str());
        assert_eq!(req[1]["type"], "assert-ref-snapshot-id");
        assert!(req[1]["snapshot-id"].is_null(), "{req}");
        let actions: Vec<&str> = change["updates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u["action"].as_str().unwrap())
            .collect();
        assert_eq!(actions, ["add-snapshot", "set-snapshot-ref"]);
        assert_eq!(change["updates"][0]["snapshot"]["snapshot-id"], 7);
    }

    #[test]
    fn vended_credentials_of_the_longest_matching_prefix_win() {
        let j = json!({
            "metadata-location": "s3://b/t/metadata/00001.metadata.json",
            "metadata": serde_json::to_value(meta()).unwrap(),
            "config": {"s3.endpoint": "http://s3", "s3.access-key-id": "general"},
            "storage-credentials": [
                {"prefix": "s3://b", "config": {"s3.access-key-id": "bucket"}},
                {"prefix": "s3://b/t", "config": {"s3.access-key-id": "table"}},
                {"prefix": "s3://other", "config": {"s3.access-key-id": "other"}},
            ],
        });
        let loaded = parse_loaded(&j, "ns.t").unwrap();
        assert_eq!(loaded.storage["s3.access-key-id"], "table");
        assert_eq!(loaded.storage["s3.endpoint"], "http://s3");
    }
}
