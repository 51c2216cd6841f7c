//! File access for table metadata and data, addressed by the URIs that appear in Iceberg
//! metadata: local files, or objects on S3 (and S3-compatible stores), Google Cloud Storage and
//! Azure through `object_store`.
//!
//! A `file://` URI names a local path literally: `%` in a partition directory such as
//! `region=us%2Fwest` is part of the name, as Iceberg's other readers take it, never an escape.
//! Object keys are literal in the same way (`s3://b/t/region=us%2Fwest/f.parquet` is the key
//! `t/region=us%2Fwest/f.parquet`), which is how pyiceberg, DuckDB and Spark address them.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
    WriteMultipart,
};

use inlet_common::error::{Error, ErrorKind, Result, ResultExt};

/// Default timeout of one storage request.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 30_000;
/// Default timeout of connecting to the store.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 5_000;
/// Default retries of one failed storage request.
pub const DEFAULT_MAX_RETRIES: usize = 10;
/// Default first backoff between retries; it doubles up to the maximum.
pub const DEFAULT_RETRY_BACKOFF_MS: u64 = 100;
/// Default longest backoff between retries.
pub const DEFAULT_RETRY_BACKOFF_MAX_MS: u64 = 15_000;
/// Default limit on the time spent retrying one request.
pub const DEFAULT_RETRY_TIMEOUT_MS: u64 = 180_000;
/// Default number of uploads of one checkpoint in flight at once.
pub const DEFAULT_UPLOAD_CONCURRENCY: usize = 8;
/// Default part size of multipart uploads; smaller files are one request.
pub const DEFAULT_MULTIPART_PART_BYTES: usize = 16 * 1024 * 1024;

/// How object stores are reached. Unset fields fall back to the provider's standard
/// environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`) and credential chain.
#[derive(Debug, Clone)]
pub struct StorageSettings {
    /// S3 region.
    pub region: Option<String>,
    /// S3-compatible endpoint URL.
    pub endpoint: Option<String>,
    /// Address buckets as `bucket.host` instead of `host/bucket`.
    pub virtual_hosted_style: bool,
    /// Allow plain-HTTP endpoints.
    pub allow_http: Option<bool>,
    /// Static S3 credentials (already resolved from `${env:…}`/`${file:…}`).
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    /// The shared-credentials profile to read.
    pub profile: Option<String>,
    /// Further `object_store` options by key (`google_service_account`,
    /// `azure_storage_account_name`, ...).
    pub options: BTreeMap<String, String>,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub max_retries: usize,
    pub retry_backoff: Duration,
    pub retry_backoff_max: Duration,
    pub retry_timeout: Duration,
    pub upload_concurrency: usize,
    pub multipart_part_bytes: usize,
}

impl Default for StorageSettings {
    fn default() -> Self {
        StorageSettings {
            region: None,
            endpoint: None,
            virtual_hosted_style: false,
            allow_http: None,
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            profile: None,
            options: BTreeMap::new(),
            request_timeout: Duration::from_millis(DEFAULT_REQUEST_TIMEOUT_MS),
            connect_timeout: Duration::from_millis(DEFAULT_CONNECT_TIMEOUT_MS),
            max_retries: DEFAULT_MAX_RETRIES,
            retry_backoff: Duration::from_millis(DEFAULT_RETRY_BACKOFF_MS),
            retry_backoff_max: Duration::from_millis(DEFAULT_RETRY_BACKOFF_MAX_MS),
            retry_timeout: Duration::from_millis(DEFAULT_RETRY_TIMEOUT_MS),
            upload_concurrency: DEFAULT_UPLOAD_CONCURRENCY,
            multipart_part_bytes: DEFAULT_MULTIPART_PART_BYTES,
        }
    }
}

/// One object store (a bucket or container) and where its credentials came from.
#[derive(Clone)]
struct Remote {
    store: Arc<dyn ObjectStore>,
    credentials: String,
}

#[derive(Default)]
struct Stores {
    settings: StorageSettings,
    /// Storage properties a REST catalog handed out for one table (Iceberg names:
    /// `s3.access-key-id`, `s3.endpoint`, ...); they take precedence over the settings.
    vended: BTreeMap<String, String>,
    /// Stores by `scheme://bucket`, built on first use.
    built: Mutex<HashMap<String, Remote>>,
}

/// Reads and writes files by URI.
#[derive(Clone, Default)]
pub struct FileIO {
    inner: Arc<Stores>,
}

/// Where a URI points.
enum Location {
    Local(PathBuf),
    Remote {
        /// `scheme://bucket`, the store's identity.
        root: String,
        path: ObjectPath,
    },
}

/// An object a listing found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub uri: String,
    pub size: u64,
    /// When the object was last written (ms since the epoch), where the store says.
    pub modified_ms: Option<i64>,
}

const REMOTE_SCHEMES: [&str; 8] = ["s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl"];

fn locate(uri: &str) -> Result<Location> {
    if let Some(rest) = uri
        .strip_prefix("file://")
        .or_else(|| uri.strip_prefix("file:"))
    {
        if !rest.starts_with('/') {
            return Err(Error::new(
                ErrorKind::Storage,
                format!("file URI {uri} is not absolute"),
            ));
        }
        return Ok(Location::Local(PathBuf::from(rest)));
    }
    let unsupported = || {
        Error::config(format!(
            "storage location {uri} is not supported; use a local path, file://, s3://, gs://, az:// or abfss://"
        ))
    };
    let (scheme, rest) = uri.split_once("://").ok_or_else(unsupported)?;
    if !REMOTE_SCHEMES.contains(&scheme) {
        return Err(unsupported());
    }
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(Error::config(format!(
            "storage location {uri} names no bucket"
        )));
    }
    let path = ObjectPath::parse(key).or_kind(ErrorKind::Storage, || {
        format!("{uri} is not a valid object key")
    })?;
    Ok(Location::Remote {
        root: format!("{scheme}://{bucket}"),
        path,
    })
}

impl FileIO {
    /// Storage reached with `settings` (local files need none).
    pub fn new(settings: StorageSettings) -> FileIO {
        FileIO {
            inner: Arc::new(Stores {
                settings,
                ..Stores::default()
            }),
        }
    }

    /// The same storage, with properties a catalog handed out for one table (vended
    /// credentials); without any, `self`.
    pub fn with_vended(&self, properties: BTreeMap<String, String>) -> FileIO {
        let relevant: BTreeMap<String, String> = properties
            .into_iter()
            .filter(|(k, _)| {
                k.starts_with("s3.")
                    || k.starts_with("gcs.")
                    || k.starts_with("adls.")
                    || k == "client.region"
            })
            .collect();
        if relevant.is_empty() || relevant == self.inner.vended {
            return self.clone();
        }
        FileIO {
            inner: Arc::new(Stores {
                settings: self.inner.settings.clone(),
                vended: relevant,
                built: Mutex::default(),
            }),
        }
    }

    /// How many uploads run at once.
    pub fn upload_concurrency(&self) -> usize {
        self.inner.settings.upload_concurrency.max(1)
    }

    fn remote(&self, root: &str) -> Result<Remote> {
        let mut built = self
            .inner
            .built
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(r) = built.get(root) {
            return Ok(r.clone());
        }
        let remote = build_store(root, &self.inner.settings, &self.inner.vended)?;
        built.insert(root.to_string(), remote.clone());
        Ok(remote)
    }

    /// A storage error saying what failed; a refusal also names the bucket and where the
    /// credentials came from.
    fn failed(&self, root: &str, what: String, e: object_store::Error) -> Error {
        let denied = matches!(
            e,
            object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. }
        );
        if denied {
            let source = self.remote(root).map(|r| r.credentials).unwrap_or_default();
            // Retryable while running: vended credentials expire and a reload renews them.
            // At startup `check` turns this into a configuration error.
            return Error::new(
                ErrorKind::Storage,
                format!(
                    "storage: {what}: access to {root} was denied with credentials from {source}; check the credentials and the bucket policy"
                ),
            )
            .with_source(e);
        }
        Error::new(ErrorKind::Storage, what).with_source(e)
    }

    /// Writes a whole file, creating parent directories. The content appears atomically
    /// (written aside then renamed locally; one request or a completed multipart upload on
    /// object stores), so no reader sees a partial file.
    pub async fn put(&self, uri: &str, data: Bytes) -> Result<()> {
        match locate(uri)? {
            Location::Local(path) => put_local(uri, path, data).await,
            Location::Remote { root, path } => {
                let remote = self.remote(&root)?;
                let part = self
                    .inner
                    .settings
                    .multipart_part_bytes
                    .max(5 * 1024 * 1024);
                let result = if data.len() <= part {
                    remote
                        .store
                        .put(&path, PutPayload::from_bytes(data))
                        .await
                        .map(|_| ())
                } else {
                    let upload = match remote.store.put_multipart(&path).await {
                        Ok(u) => u,
                        Err(e) => return Err(self.failed(&root, format!("cannot write {uri}"), e)),
                    };
                    let mut writer = WriteMultipart::new_with_chunk_size(upload, part);
                    writer.put(data);
                    match writer.finish().await {
                        Ok(_) => Ok(()),
                        Err(e) => Err(e),
                    }
                };
                result.map_err(|e| self.failed(&root, format!("cannot write {uri}"), e))
            }
        }
    }

    /// Writes many files, a bounded number at a time. Returns once every one is written, or
    /// with the first failure (files already written stay, unreferenced, for orphan cleanup).
    pub async fn put_many(&self, files: Vec<(String, Bytes)>) -> Result<()> {
        futures::stream::iter(files)
            .map(|(uri, data)| async move { self.put(&uri, data).await })
            .buffer_unordered(self.upload_concurrency())
            .try_collect::<Vec<()>>()
            .await
            .map(|_| ())
    }

    /// Reads a whole file.
    pub async fn get(&self, uri: &str) -> Result<Bytes> {
        match locate(uri)? {
            Location::Local(path) => tokio::fs::read(&path)
                .await
                .map(Bytes::from)
                .or_kind(ErrorKind::Storage, || format!("cannot read {uri}")),
            Location::Remote { root, path } => {
                let remote = self.remote(&root)?;
                let read = async { remote.store.get(&path).await?.bytes().await };
                read.await
                    .map_err(|e| self.failed(&root, format!("cannot read {uri}"), e))
            }
        }
    }

    /// The size of a file, or `None` if it does not exist.
    pub async fn head(&self, uri: &str) -> Result<Option<u64>> {
        match locate(uri)? {
            Location::Local(path) => match tokio::fs::metadata(&path).await {
                Ok(m) => Ok(Some(m.len())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => {
                    Err(Error::new(ErrorKind::Storage, format!("cannot stat {uri}")).with_source(e))
                }
            },
            Location::Remote { root, path } => {
                let remote = self.remote(&root)?;
                match remote.store.head(&path).await {
                    Ok(meta) => Ok(Some(meta.size)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(self.failed(&root, format!("cannot stat {uri}"), e)),
                }
            }
        }
    }

    /// Deletes a file; a missing file is not an error.
    pub async fn delete(&self, uri: &str) -> Result<()> {
        match locate(uri)? {
            Location::Local(path) => match tokio::fs::remove_file(&path).await {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(
                    Error::new(ErrorKind::Storage, format!("cannot delete {uri}")).with_source(e),
                ),
            },
            Location::Remote { root, path } => {
                let remote = self.remote(&root)?;
                match remote.store.delete(&path).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(self.failed(&root, format!("cannot delete {uri}"), e)),
                }
            }
        }
    }

    /// Every file below `prefix` (a directory URI), sorted by URI.
    pub async fn list(&self, prefix: &str) -> Result<Vec<Listed>> {
        let prefix = prefix.trim_end_matches('/');
        let mut out = match locate(prefix)? {
            Location::Local(dir) => list_local(prefix, dir).await?,
            Location::Remote { root, path } => {
                let remote = self.remote(&root)?;
                let listed: Vec<object_store::ObjectMeta> = remote
                    .store
                    .list(Some(&path))
                    .try_collect()
                    .await
                    .map_err(|e| self.failed(&root, format!("cannot list {prefix}"), e))?;
                listed
                    .into_iter()
                    .map(|m| Listed {
                        uri: format!("{root}/{}", m.location.as_ref()),
                        size: m.size,
                        modified_ms: Some(m.last_modified.timestamp_millis()),
                    })
                    .collect()
            }
        };
        out.sort_by(|a, b| a.uri.cmp(&b.uri));
        Ok(out)
    }

    /// Checks that the warehouse can be reached with the configured credentials: a read of a
    /// probe key and a listing of the warehouse. Wrong credentials or a missing bucket are
    /// configuration errors naming the bucket and where the credentials came from.
    pub async fn check(&self, warehouse: &str) -> Result<()> {
        let Location::Remote { root, path } = locate(warehouse)? else {
            return Ok(());
        };
        let remote = self.remote(&root)?;
        let probe = path.clone().join(".inlet-access-check");
        match remote.store.head(&probe).await {
            Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
            Err(
                e @ (object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. }),
            ) => {
                // Wrong credentials do not heal by retrying: stop at once.
                let err = self.failed(&root, format!("cannot read warehouse {warehouse}"), e);
                return Err(Error::config(err.to_string()));
            }
            Err(e) => {
                return Err(self.failed(&root, format!("cannot read warehouse {warehouse}"), e))
            }
        }
        match remote.store.list_with_delimiter(Some(&path)).await {
            Ok(_) => Ok(()),
            // Listing errors arrive untyped; the server's error code tells a missing bucket.
            Err(e) if format!("{e:?}").contains("NoSuchBucket") => Err(Error::config(format!(
                "storage: bucket {root} of warehouse {warehouse} does not exist; create it or fix catalog.warehouse"
            ))
            .with_source(e)),
            Err(e) => Err(self.failed(&root, format!("cannot list warehouse {warehouse}"), e)),
        }
    }
}

async fn put_local(uri: &str, path: PathBuf, data: Bytes) -> Result<()> {
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir)
            .await
            .or_kind(ErrorKind::Storage, || {
                format!("cannot create directory {}", dir.display())
            })?;
    }
    let tmp = path.with_extension(format!("tmp-{}", uuid::Uuid::new_v4().simple()));
    tokio::fs::write(&tmp, &data)
        .await
        .or_kind(ErrorKind::Storage, || format!("cannot write {uri}"))?;
    tokio::fs::rename(&tmp, &path)
        .await
        .or_kind(ErrorKind::Storage, || format!("cannot write {uri}"))
}

async fn list_local(prefix: &str, dir: PathBuf) -> Result<Vec<Listed>> {
    let mut out = Vec::new();
    let mut pending = vec![dir.clone()];
    while let Some(d) = pending.pop() {
        let mut entries = match tokio::fs::read_dir(&d).await {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(
                    Error::new(ErrorKind::Storage, format!("cannot list {prefix}")).with_source(e),
                )
            }
        };
        while let Some(entry) = entries
            .next_entry()
            .await
            .or_kind(ErrorKind::Storage, || format!("cannot list {prefix}"))?
        {
            let meta = entry
                .metadata()
                .await
                .or_kind(ErrorKind::Storage, || format!("cannot list {prefix}"))?;
            if meta.is_dir() {
                pending.push(entry.path());
            } else if let Ok(rel) = entry.path().strip_prefix(&dir) {
                let modified_ms = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_millis() as i64);
                out.push(Listed {
                    uri: format!("{prefix}/{}", rel.display()),
                    size: meta.len(),
                    modified_ms,
                });
            }
        }
    }
    Ok(out)
}

/// Builds the store of `root` (`scheme://bucket`).
fn build_store(
    root: &str,
    settings: &StorageSettings,
    vended: &BTreeMap<String, String>,
) -> Result<Remote> {
    let (scheme, bucket) = root.split_once("://").unwrap_or((root, ""));
    let retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: settings.retry_backoff,
            max_backoff: settings.retry_backoff_max,
            base: 2.0,
        },
        max_retries: settings.max_retries,
        retry_timeout: settings.retry_timeout,
    };
    let mut client = ClientOptions::new()
        .with_timeout(settings.request_timeout)
        .with_connect_timeout(settings.connect_timeout);
    if let Some(allow) = settings.allow_http {
        client = client.with_allow_http(allow);
    }
    let bad_option = |key: &str, e: object_store::Error| {
        Error::config(format!(
            "storage.options.{key}: not an option of {scheme} stores"
        ))
        .with_source(e)
    };
    let built = match scheme {
        "s3" | "s3a" => {
            let (builder, credentials) = s3_builder(bucket, settings, vended)?;
            let mut builder = builder.with_retry(retry);
            if settings.allow_http.is_some() {
                builder = builder.with_client_options(client);
            } else {
                // AWS_ALLOW_HTTP from the environment stays in force.
                builder = builder
                    .with_config(
                        AmazonS3ConfigKey::Client(object_store::ClientConfigKey::Timeout),
                        format!("{}ms", settings.request_timeout.as_millis()),
                    )
                    .with_config(
                        AmazonS3ConfigKey::Client(object_store::ClientConfigKey::ConnectTimeout),
                        format!("{}ms", settings.connect_timeout.as_millis()),
                    );
            }
            for (k, v) in &settings.options {
                let key: AmazonS3ConfigKey = k.parse().map_err(|e| bad_option(k, e))?;
                builder = builder.with_config(key, v);
            }
            builder
                .build()
                .map(|s| (Arc::new(s) as Arc<dyn ObjectStore>, credentials))
        }
        "gs" => {
            let mut builder = GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry)
                .with_client_options(client);
            for (k, v) in &settings.options {
                let key: GoogleConfigKey = k.parse().map_err(|e| bad_option(k, e))?;
                builder = builder.with_config(key, v);
            }
            let credentials = if settings.options.contains_key("google_service_account") {
                "storage.options.google_service_account".to_string()
            } else if std::env::var_os("GOOGLE_SERVICE_ACCOUNT").is_some() {
                "environment (GOOGLE_SERVICE_ACCOUNT)".to_string()
            } else if std::env::var_os("GOOGLE_APPLICATION_CREDENTIALS").is_some() {
                "environment (GOOGLE_APPLICATION_CREDENTIALS)".to_string()
            } else {
                "application default credentials (gcloud or instance metadata)".to_string()
            };
            builder
                .build()
                .map(|s| (Arc::new(s) as Arc<dyn ObjectStore>, credentials))
        }
        _ => {
            let mut builder = MicrosoftAzureBuilder::from_env()
                .with_url(root)
                .with_retry(retry)
                .with_client_options(client);
            for (k, v) in &settings.options {
                let key: AzureConfigKey = k.parse().map_err(|e| bad_option(k, e))?;
                builder = builder.with_config(key, v);
            }
            let mut credentials = if settings.options.keys().any(|k| k.contains("key")) {
                "storage.options".to_string()
            } else if std::env::var_os("AZURE_STORAGE_ACCOUNT_KEY").is_some() {
                "environment (AZURE_STORAGE_ACCOUNT_KEY)".to_string()
            } else {
                "Azure managed identity or environment".to_string()
            };
            if let Some((_, sas)) = vended.iter().find(|(k, _)| k.starts_with("adls.sas-token")) {
                builder = builder.with_config(AzureConfigKey::SasKey, sas);
                credentials = "a SAS token vended by the REST catalog".to_string();
            }
            builder
                .build()
                .map(|s| (Arc::new(s) as Arc<dyn ObjectStore>, credentials))
        }
    };
    let (store, credentials) = built.map_err(|e| {
        Error::config(format!(
            "storage: cannot set up access to {root}; check the storage settings"
        ))
        .with_source(e)
    })?;
    Ok(Remote { store, credentials })
}

/// The S3 builder for `bucket`: the standard environment, then the settings, then properties
/// a catalog vended; credentials from, in order, vended properties, `storage.access_key_id`,
/// `AWS_ACCESS_KEY_ID`, the shared credentials profile, web identity (`AWS_WEB_IDENTITY_TOKEN_FILE`
/// and `AWS_ROLE_ARN`), container credentials and instance metadata. Returns the builder and
/// where its credentials come from, for error messages.
fn s3_builder(
    bucket: &str,
    settings: &StorageSettings,
    vended: &BTreeMap<String, String>,
) -> Result<(AmazonS3Builder, String)> {
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let profile_name = settings
        .profile
        .clone()
        .or_else(|| env("AWS_PROFILE"))
        .unwrap_or_else(|| "default".into());
    let profile = read_profile(&profile_name);
    let region = vended
        .get("s3.region")
        .or(vended.get("client.region"))
        .cloned()
        .or_else(|| settings.region.clone())
        .or_else(|| env("AWS_REGION"))
        .or_else(|| env("AWS_DEFAULT_REGION"))
        .or_else(|| profile.as_ref().and_then(|p| p.region.clone()));
    if let Some(r) = region {
        b = b.with_region(r);
    }
    if let Some(e) = vended.get("s3.endpoint").or(settings.endpoint.as_ref()) {
        b = b.with_endpoint(e);
    }
    if settings.virtual_hosted_style {
        b = b.with_virtual_hosted_style_request(true);
    }
    if vended.get("s3.path-style-access").map(String::as_str) == Some("true") {
        b = b.with_virtual_hosted_style_request(false);
    }
    let static_keys = |b: AmazonS3Builder, id: &str, secret: &str, token: Option<&String>| {
        let b = b.with_access_key_id(id).with_secret_access_key(secret);
        match token {
            Some(t) => b.with_token(t),
            None => b,
        }
    };
    let source = if let (Some(id), Some(secret)) = (
        vended.get("s3.access-key-id"),
        vended.get("s3.secret-access-key"),
    ) {
        b = static_keys(b, id, secret, vended.get("s3.session-token"));
        "credentials vended by the REST catalog".to_string()
    } else if let (Some(id), Some(secret)) = (&settings.access_key_id, &settings.secret_access_key)
    {
        b = static_keys(b, id, secret, settings.session_token.as_ref());
        "storage.access_key_id and storage.secret_access_key".to_string()
    } else if env("AWS_ACCESS_KEY_ID").is_some() {
        "environment (AWS_ACCESS_KEY_ID)".to_string()
    } else if let Some(p) = profile.filter(|p| p.key_id.is_some() && p.secret.is_some()) {
        let (id, secret) = (p.key_id.unwrap_or_default(), p.secret.unwrap_or_default());
        b = static_keys(b, &id, &secret, p.token.as_ref());
        format!("profile {profile_name} in {}", p.file)
    } else if env("AWS_WEB_IDENTITY_TOKEN_FILE").is_some() && env("AWS_ROLE_ARN").is_some() {
        "web identity (AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_ARN)".to_string()
    } else if env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI").is_some()
        || env("AWS_CONTAINER_CREDENTIALS_FULL_URI").is_some()
    {
        "container credentials (AWS_CONTAINER_CREDENTIALS_*)".to_string()
    } else {
        "instance metadata (no credentials configured)".to_string()
    };
    Ok((b, source))
}

/// Static credentials and region of one profile of the AWS shared files.
struct Profile {
    key_id: Option<String>,
    secret: Option<String>,
    token: Option<String>,
    region: Option<String>,
    file: String,
}

/// Reads `profile` from `AWS_SHARED_CREDENTIALS_FILE` (default `~/.aws/credentials`) and
/// `AWS_CONFIG_FILE` (default `~/.aws/config`); static keys only (no SSO or role chains).
fn read_profile(profile: &str) -> Option<Profile> {
    let home = std::env::var("HOME").unwrap_or_default();
    let file = |var: &str, default: &str| {
        std::env::var(var).unwrap_or_else(|_| format!("{home}/.aws/{default}"))
    };
    let credentials_file = file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
    let config_file = file("AWS_CONFIG_FILE", "config");
    let creds = std::fs::read_to_string(&credentials_file)
        .ok()
        .map(|t| ini_section(&t, profile))
        .unwrap_or_default();
    let config_section = if profile == "default" {
        "default".to_string()
    } else {
        format!("profile {profile}")
    };
    let config = std::fs::read_to_string(&config_file)
        .ok()
        .map(|t| ini_section(&t, &config_section))
        .unwrap_or_default();
    if creds.is_empty() && config.is_empty() {
        return None;
    }
    let get = |k: &str| creds.get(k).or_else(|| config.get(k)).cloned();
    Some(Profile {
        key_id: get("aws_access_key_id"),
        secret: get("aws_secret_access_key"),
        token: get("aws_session_token"),
        region: config
            .get("region")
            .or_else(|| creds.get("region"))
            .cloned(),
        file: if creds.is_empty() {
            config_file
        } else {
            credentials_file
        },
    })
}

/// The `key = value` pairs of `[section]` in INI text.
fn ini_section(text: &str, section: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
        } else if inside {
            if let Some((k, v)) = line.split_once('=') {
                out.insert(k.trim().to_string(), v.trim().to_string());
            }
        }
    }
    out
}

/// Turns a warehouse setting (a local path, relative or absolute, or a URL) into a URL string
/// without a trailing slash.
pub fn normalize_location(location: &str) -> Result<String> {
    let trimmed = location.trim_end_matches('/');
    if trimmed.contains("://") {
        return Ok(trimmed.to_string());
    }
    let path = std::path::Path::new(trimmed);
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .or_kind(ErrorKind::Storage, || {
                "cannot read the working directory".into()
            })?
            .join(path)
    };
    // Literal, not percent-encoded: see the module comment.
    Ok(format!("file://{}", abs.display())
        .trim_end_matches('/')
        .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn percent_signs_are_literal_path_characters() {
        let dir = tempfile::tempdir().unwrap();
        let uri = format!("file://{}/region=us%2Fwest/f.parquet", dir.path().display());
        let io = FileIO::default();
        io.put(&uri, Bytes::from_static(b"x")).await.unwrap();
        assert!(dir.path().join("region=us%2Fwest/f.parquet").exists());
        assert_eq!(io.get(&uri).await.unwrap(), Bytes::from_static(b"x"));
        io.delete(&uri).await.unwrap();
        io.delete(&uri).await.unwrap();
        assert!(io.get("hdfs://nn/key").await.is_err());
    }

    #[test]
    fn object_keys_are_literal() {
        let Location::Remote { root, path } =
            locate("s3://bucket/wh/t/region=us%2Fwest/f.parquet").unwrap()
        else {
            panic!("s3 is remote");
        };
        assert_eq!(root, "s3://bucket");
        assert_eq!(path.as_ref(), "wh/t/region=us%2Fwest/f.parquet");
        let Location::Remote { root, .. } =
            locate("abfss://c@acct.dfs.core.windows.net/wh").unwrap()
        else {
            panic!("abfss is remote");
        };
        assert_eq!(root, "abfss://c@acct.dfs.core.windows.net");
        assert!(locate("s3:///key").is_err());
        assert!(locate("ftp://h/k").is_err());
    }

    #[test]
    fn profiles_are_read_from_ini_sections() {
        let text = "[default]\naws_access_key_id = A\n[other]\naws_access_key_id=B\naws_secret_access_key = S\n";
        assert_eq!(ini_section(text, "other")["aws_access_key_id"], "B");
        assert_eq!(ini_section(text, "default")["aws_access_key_id"], "A");
        assert!(ini_section(text, "missing").is_empty());
    }
}
