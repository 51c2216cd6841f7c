//! Pipeline configuration: built-in defaults → YAML file → `INLET__SECTION__KEY` environment
//! variables. Unknown keys are errors; every default lives in a `default_*` function here.

mod load;
mod schema;
#[cfg(test)]
mod tests;

pub use load::topic_regex;

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use inlet_common::error::{Error, Result};
use inlet_iceberg::transform::Transform;
use inlet_iceberg::types::Type;

use inlet_common::secret::resolve_secret;
pub use inlet_decode::config::{FormatConfig, FormatKind, SchemaRegistryConfig, TimeUnit};

/// One pipeline: Kafka topics in, one Iceberg table out.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Identifies this pipeline in snapshot summaries; source offsets are tracked per pipeline id,
    /// so changing it makes the pipeline start over from the topics' beginning.
    pub pipeline_id: String,
    /// Where change records come from.
    pub kafka: KafkaConfig,
    /// How Kafka messages are decoded.
    #[serde(default)]
    pub format: FormatConfig,
    /// The Iceberg table written.
    pub table: TableConfig,
    /// The Iceberg catalog and warehouse.
    pub catalog: CatalogConfig,
    /// How object stores (S3, GCS, Azure) are reached; local warehouses need nothing here.
    #[serde(default)]
    pub storage: StorageConfig,
    /// When buffered changes are committed.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// The Prometheus endpoint.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// The key index of upsert tables.
    #[serde(default)]
    pub index: IndexConfig,
    /// What happens to records that cannot be decoded or applied.
    #[serde(default)]
    pub errors: ErrorsConfig,
    /// Readiness: how the broker, catalog and storage are probed and how long a fault is
    /// tolerated before `/health/ready` fails.
    #[serde(default)]
    pub health: HealthConfig,
    /// Table services that keep the tables fast as they age: snapshot expiry, orphan-file
    /// cleanup, removal of old metadata files and manifest merging. `inlet maintain` runs them
    /// once with the same settings.
    #[serde(default)]
    pub services: ServicesConfig,
    /// How the pipeline uses the machine's cores.
    #[serde(default)]
    pub pipeline: PipelineConfig,
    /// Many tables from one pipeline (database sync): each change goes to the table its
    /// upstream table or topic names; tables are created from the changes' own fields. Unset:
    /// every change goes to `table`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingConfig>,
}

/// Routing changes to many tables.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// What names a change's table: `source`, the upstream table the change itself names
    /// (Debezium `source.db`/`source.table`, Canal and Maxwell `database`/`table`, GoldenGate
    /// `table`), or `topic`, the Kafka topic it came from.
    #[serde(default)]
    pub by: RouteBy,
    /// Iceberg namespace of a routed table; `{database}`, `{schema}`, `{table}` and `{topic}`
    /// are replaced. Characters other than letters, digits and `_` become `_`.
    #[serde(default = "default_route_namespace")]
    pub namespace: String,
    /// Iceberg table name of a routed table, with the same placeholders.
    #[serde(default = "default_route_name")]
    pub name: String,
    /// Upstream tables (or topics, under `by: topic`) not to write, as patterns like
    /// `table.source_tables` (`*` matches any run of characters).
    #[serde(default)]
    pub exclude: Vec<String>,
}

/// What names a routed change's table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RouteBy {
    #[default]
    Source,
    Topic,
}

fn default_route_namespace() -> String {
    "{database}".into()
}

fn default_route_name() -> String {
    "{table}".into()
}

/// Handling of bad records: malformed messages, wrong types, unknown operations, changes the
/// table's schema cannot take.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorsConfig {
    /// `fail` stops the pipeline with an error naming the record; `skip` drops the record;
    /// `dead-letter` sends it to `dead_letter_topic`. Skipped and dead-lettered records are
    /// counted by reason, and their offsets commit with the checkpoint like any other.
    #[serde(default)]
    pub policy: BadRecordPolicy,
    /// Topic receiving dead letters: the original key and value, with headers naming the
    /// error, source topic, partition, offset and time. Produced with the `kafka` settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_topic: Option<String>,
}

/// What to do with a bad record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum BadRecordPolicy {
    #[default]
    Fail,
    Skip,
    DeadLetter,
}

/// What to do when a change does not fit the table's schema and cannot be evolved into it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SchemaChangePolicy {
    /// Stop with an error naming the table, column, old and new type.
    #[default]
    Fail,
    /// Route the record through `errors` as if its policy were `dead-letter`.
    DeadLetter,
}

/// Where and how the key index of upsert tables is kept.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct IndexConfig {
    /// Local directory of the index (one RocksDB per shard below it). Keep it on a persistent
    /// volume: a lost index is rebuilt from the table, which takes time on large tables.
    #[serde(default = "default_index_dir")]
    pub dir: String,
    /// Forget keys not written for this many seconds. An expired key that appears again is
    /// taken as new: its old row stays and the table then holds the key twice. Only for keys
    /// known never to recur after this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
    /// RocksDB block cache, shared by the indexes of every shard and table of the process, so
    /// the index's memory does not grow with the partitions an instance is assigned.
    #[serde(default = "default_block_cache_bytes")]
    pub block_cache_bytes: u64,
    /// How often each shard's index is copied beside the table (under its location's
    /// `inlet-index/`), so a member that takes a partition over on another host downloads it
    /// and catches up instead of rebuilding it from every data file. The first copy follows
    /// the first commit after an assignment. 0 turns copies off.
    #[serde(default = "default_copy_interval_ms")]
    pub copy_interval_ms: u64,
}

fn default_copy_interval_ms() -> u64 {
    10 * 60 * 1000
}

fn default_index_dir() -> String {
    "index".into()
}

fn default_block_cache_bytes() -> u64 {
    256 * 1024 * 1024
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            dir: default_index_dir(),
            ttl_secs: None,
            block_cache_bytes: default_block_cache_bytes(),
            copy_interval_ms: default_copy_interval_ms(),
        }
    }
}

/// How rows of the same key combine in upsert tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum MergeEngine {
    /// The newest version wins.
    Deduplicate,
    /// The first row of a key is kept; later changes, deletes included, are ignored.
    FirstRow,
    /// Non-null fields of a newer record overwrite the stored row's fields.
    PartialUpdate,
    /// Columns combine by `table.aggregations` (sum, min, max, count, last_non_null,
    /// first_non_null); other non-key columns keep the last non-null value.
    Aggregation,
}

/// How the aggregation merge engine combines a column's stored and new value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Aggregate {
    Sum,
    Min,
    Max,
    /// Number of changes applied to the key (the column must be int or long).
    Count,
    LastNonNull,
    FirstNonNull,
}

fn default_merge_engine() -> MergeEngine {
    MergeEngine::Deduplicate
}

fn default_target_rows_per_bucket() -> u64 {
    2_000_000
}

/// Kafka consumer settings.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Comma-separated `host:port` list of brokers.
    pub bootstrap_servers: String,
    /// Consumer group. Offsets committed to it are advisory (for lag tools); the table's latest
    /// snapshot is where consumption resumes.
    pub group_id: String,
    /// Topics consumed into the table (with `routing`, into the tables their changes name).
    #[serde(default)]
    pub topics: Vec<String>,
    /// A regular expression (POSIX extended, as librdkafka matches it) every topic it matches
    /// in full is consumed too, including topics created while the pipeline runs (seen within
    /// 10 s): Debezium's topic per table, say `dbserver1\.inventory\..*`. Needs `routing`.
    /// Debezium's own topics it matches (heartbeats, transaction metadata, schema changes)
    /// are read and skipped, counted by reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic_pattern: Option<String>,
    /// Extra librdkafka properties (`security.protocol`, `sasl.mechanism`, ...). A value
    /// `${env:NAME}` or `${file:/path}` is read from the environment or a file at startup, which
    /// keeps secrets such as `sasl.password` out of the file; values of keys naming a password or
    /// secret are redacted in logs. inlet sets `fetch.queue.backoff.ms: 10` and
    /// `max.partition.fetch.bytes: 8388608` (librdkafka's defaults, 1000 and 1 MiB, leave a fast
    /// pipeline waiting for fetches); these override them.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// Where reading starts when the table has snapshots but none records this pipeline's
    /// offsets (another engine expired them, or the table was written before this pipeline
    /// existed): `fail` stops with an error naming this setting; `earliest` reads the topics
    /// from the beginning (changelog tables then get those changes again); `latest` reads only
    /// changes produced from now on. A table without snapshots always starts at the beginning.
    /// With `routing`, each routed table follows it when its first change arrives: `fail`
    /// stops, `earliest` writes every change read into it (from where the pipeline's other
    /// tables resume), `latest` only changes produced after that moment.
    #[serde(default)]
    pub start_without_offsets: StartWithoutOffsets,
}

/// Where reading starts when the table holds no offsets of this pipeline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum StartWithoutOffsets {
    #[default]
    Fail,
    Earliest,
    Latest,
}

/// How changes are applied to the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum TableMode {
    /// Every change event is appended as a row with `_op`, `_version`, `_source_ts`,
    /// `_kafka_partition` and `_kafka_offset` columns (audit and ODS tables).
    Changelog,
    /// One live row per primary key, in the partition its latest value names: an update or
    /// delete writes an Iceberg position delete for the old row. Adds a `_version` column.
    Upsert,
}

fn default_mode() -> TableMode {
    TableMode::Changelog
}

/// The Iceberg table.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TableConfig {
    /// Namespace (database) of the table. With `routing`, names come from the routing
    /// templates instead and this is ignored.
    #[serde(default)]
    pub namespace: String,
    /// Table name (ignored with `routing`).
    #[serde(default)]
    pub name: String,
    /// How changes are applied.
    #[serde(default = "default_mode")]
    pub mode: TableMode,
    /// Columns, in table order. Field ids are assigned in this order when the table is created.
    /// Empty: the table is created from the first change's own fields (and with `routing`,
    /// every routed table is).
    #[serde(default)]
    pub columns: Vec<ColumnConfig>,
    /// Types of columns created from changes (new tables, new columns), overriding the type
    /// their source field maps to: `column` or `table.column` (a table pattern as in
    /// `table.source_tables`; `*` matches any run of characters) → an Iceberg type. For
    /// instance a MySQL TIME that holds durations: `{"*.duration": long}` keeps microseconds,
    /// `string` its `[-]H:MM:SS.ffffff` text.
    #[serde(default)]
    pub column_types: BTreeMap<String, String>,
    /// Primary key columns; recorded as the schema's identifier fields.
    #[serde(default)]
    pub primary_key: Vec<String>,
    /// Partition fields, in order.
    #[serde(default)]
    pub partition_by: Vec<PartitionConfig>,
    /// Upsert tables: how records of one key combine.
    #[serde(default = "default_merge_engine")]
    pub merge_engine: MergeEngine,
    /// Upsert tables: columns whose values, compared in order, order the changes of a key (e.g.
    /// `[updated_at]`); ties, and deletes whose before image lacks the columns, are ordered by
    /// `version_position`. Empty: `version_position` alone.
    #[serde(default)]
    pub version_columns: Vec<String>,
    /// Upsert tables: the position that orders a key's changes (after `version_columns`):
    /// `source`, the format's own position (MySQL binlog file, position and row; PostgreSQL
    /// LSN; Maxwell and GoldenGate positions), else the Kafka offset; `kafka-offset`, the Kafka
    /// offset always, for sources whose positions can go backwards (a MySQL failover or binlog
    /// reset restarts file and position).
    #[serde(default)]
    pub version_position: VersionPosition,
    /// Upsert tables with `merge_engine: aggregation`: the aggregate of each listed column.
    #[serde(default)]
    pub aggregations: BTreeMap<String, Aggregate>,
    /// Upsert tables: a fixed number of buckets. The Iceberg `bucket[N]` transform of the
    /// (single-column) primary key becomes a partition field, so engines can prune and join on
    /// it. Unset: dynamic buckets sized by `target_rows_per_bucket`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buckets: Option<u32>,
    /// Upsert tables: a partition's dynamic bucket takes new keys until it holds this many rows.
    #[serde(default = "default_target_rows_per_bucket")]
    pub target_rows_per_bucket: u64,
    /// Data files roll over once they reach about this many bytes.
    #[serde(default = "default_target_file_bytes")]
    pub target_file_bytes: u64,
    /// Most partitions one checkpoint may add to the table, so that a bad timestamp or
    /// partition value cannot create thousands at once; a change past it follows
    /// `errors.policy` (reason `too_many_partitions`), and the next checkpoint may add as many
    /// again. 0: no cap.
    #[serde(default = "default_max_new_partitions_per_checkpoint")]
    pub max_new_partitions_per_checkpoint: u32,
    /// Table properties set when the table is created.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// Only changes of these upstream tables are written, as `database.table` or
    /// `schema.table` patterns where `*` matches any run of characters (e.g.
    /// `[inventory.orders]`, `[shop.order_*]`). Changes of other tables are skipped and
    /// counted (`inlet_decode_skipped_total{reason="other_table"}`), so one topic carrying a
    /// whole database (Canal, Maxwell) can feed one pipeline per table. Empty: every change;
    /// changes whose format names no table always pass.
    #[serde(default)]
    pub source_tables: Vec<String>,
    /// Add a nullable column when records carry a field the table lacks, and widen int→long,
    /// float→double, decimal(P,S)→decimal(P2,S) when the source does.
    #[serde(default = "default_true")]
    pub evolve_schema: bool,
    /// A change the schema cannot take (e.g. string into int): `fail` or `dead-letter`.
    #[serde(default)]
    pub on_incompatible_change: SchemaChangePolicy,
}

fn default_true() -> bool {
    true
}

fn default_max_new_partitions_per_checkpoint() -> u32 {
    1000
}

fn default_target_file_bytes() -> u64 {
    128 * 1024 * 1024
}

/// What orders the changes of a key after the configured version columns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum VersionPosition {
    #[default]
    Source,
    KafkaOffset,
}

/// A column.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ColumnConfig {
    /// Column name, as the change records name the field.
    pub name: String,
    /// Iceberg type: boolean, int, long, float, double, decimal(P,S), date, time, timestamp,
    /// timestamptz, string, binary.
    #[serde(rename = "type")]
    pub ty: String,
    /// Whether the column is NOT NULL.
    #[serde(default)]
    pub required: bool,
    /// Column documentation stored in the table schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub doc: Option<String>,
    /// Unit of integer time values in messages without a schema (with a schema, Debezium's
    /// logical type names decide).
    #[serde(default = "default_time_unit")]
    pub time_unit: TimeUnit,
}

fn default_time_unit() -> TimeUnit {
    TimeUnit::Millis
}

/// A partition field.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PartitionConfig {
    /// Source column.
    pub column: String,
    /// identity, year, month, day, hour, truncate[W] or bucket[N].
    #[serde(default = "default_transform")]
    pub transform: String,
    /// Partition field name; defaults to the column name (identity) or `<column>_<transform>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

fn default_transform() -> String {
    "identity".into()
}

/// Catalog and warehouse.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CatalogConfig {
    /// `sql` (Iceberg's JDBC catalog tables in SQLite or PostgreSQL) or `rest` (an Iceberg REST
    /// catalog server).
    #[serde(rename = "type", default)]
    pub kind: CatalogKind,
    /// `sql`: the database, `sqlite:///abs/path/catalog.db`, `sqlite://relative.db` or
    /// `postgresql://user@host:5432/db` (same tables as Iceberg's JDBC catalog and pyiceberg's
    /// SqlCatalog). `rest`: the server's base URL, e.g. `https://catalog:8181` (without `/v1`).
    #[serde(default = "default_catalog_uri")]
    pub uri: String,
    /// `sql`: the catalog name (the `catalog_name` column), as readers configure it.
    #[serde(default = "default_catalog_name")]
    pub name: String,
    /// `sql`: where new tables go, a local directory or a `file://`, `s3://bucket/prefix`,
    /// `gs://bucket/prefix`, `az://container/prefix` or `abfss://container@account.dfs.core.windows.net/prefix`
    /// URL. `rest`: the warehouse name or location sent to the server's `/v1/config` (none
    /// when left at the default); the server places the tables.
    #[serde(default = "default_warehouse")]
    pub warehouse: String,
    /// `rest`: a bearer token sent as `Authorization: Bearer`; `${env:NAME}` and
    /// `${file:/path}` are resolved at startup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// `rest`: OAuth2 client credentials `client_id:client_secret`, exchanged for a token at
    /// `oauth2_server_uri` (client-credentials grant), renewed before it expires and once more
    /// when the catalog answers 401; `${env:NAME}` and `${file:/path}` are resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
    /// `rest`: the OAuth2 token endpoint (an identity provider's, for Polaris, Lakekeeper or
    /// Unity set ups that use one); default `{uri}/v1/oauth/tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oauth2_server_uri: Option<String>,
    /// `rest`: the OAuth2 scope requested with `credential`.
    #[serde(default = "default_oauth2_scope")]
    pub scope: String,
    /// `rest`: extra HTTP headers sent with every request (e.g. `X-API-Key`); values take
    /// `${env:NAME}` and `${file:/path}`.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// `rest`: ask the server for storage credentials scoped to each table
    /// (`X-Iceberg-Access-Delegation: vended-credentials`); used when it hands them out.
    #[serde(default = "default_true")]
    pub vended_credentials: bool,
    /// `rest`: timeout of one catalog request.
    #[serde(default = "default_catalog_timeout_ms")]
    pub request_timeout_ms: u64,
}

impl CatalogConfig {
    /// The settings the catalog layer takes, with `${env:…}`/`${file:…}` secrets resolved.
    pub fn settings(&self) -> Result<inlet_iceberg::catalog::CatalogSettings> {
        use inlet_iceberg::catalog::CatalogSettings;
        if self.kind == CatalogKind::Sql {
            return Ok(CatalogSettings::Sql {
                uri: self.uri.clone(),
                name: self.name.clone(),
            });
        }
        let credential = match &self.credential {
            None => None,
            Some(c) => {
                let c = resolve_secret("catalog.credential", c)?;
                let (id, secret) = c.split_once(':').ok_or_else(|| {
                    Error::config("catalog.credential: expected client_id:client_secret")
                })?;
                Some((id.to_string(), secret.to_string()))
            }
        };
        let headers = self
            .headers
            .iter()
            .map(|(k, v)| {
                Ok((
                    k.clone(),
                    resolve_secret(&format!("catalog.headers.{k}"), v)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(CatalogSettings::Rest(inlet_iceberg::rest::RestSettings {
            uri: self.uri.clone(),
            // The SQL default directory name means nothing to a REST server: left unsent.
            warehouse: Some(self.warehouse.clone())
                .filter(|w| !w.is_empty() && *w != default_warehouse()),
            token: self
                .token
                .as_ref()
                .map(|t| resolve_secret("catalog.token", t))
                .transpose()?,
            credential,
            oauth2_server_uri: self.oauth2_server_uri.clone(),
            scope: self.scope.clone(),
            headers,
            vended_credentials: self.vended_credentials,
            request_timeout: std::time::Duration::from_millis(self.request_timeout_ms),
        }))
    }
}

/// Which kind of Iceberg catalog holds the tables.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum CatalogKind {
    /// Iceberg's JDBC catalog tables in SQLite or PostgreSQL.
    #[default]
    Sql,
    /// An Iceberg REST catalog server.
    Rest,
}

fn default_catalog_uri() -> String {
    "sqlite://inlet-catalog.db".into()
}

fn default_catalog_name() -> String {
    "inlet".into()
}

fn default_warehouse() -> String {
    "warehouse".into()
}

fn default_oauth2_scope() -> String {
    "catalog".into()
}

fn default_catalog_timeout_ms() -> u64 {
    30_000
}

/// Object storage access. Every unset field falls back to the provider's standard environment:
/// `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
/// `AWS_REGION`, `AWS_ALLOW_HTTP`, `AWS_PROFILE`, `AWS_WEB_IDENTITY_TOKEN_FILE` +
/// `AWS_ROLE_ARN` for S3; `GOOGLE_SERVICE_ACCOUNT`/`GOOGLE_APPLICATION_CREDENTIALS` for GCS;
/// `AZURE_STORAGE_ACCOUNT_NAME`/`AZURE_STORAGE_ACCOUNT_KEY` for Azure.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StorageConfig {
    /// S3 region (default `AWS_REGION`, the profile's region, else `us-east-1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// S3-compatible endpoint URL, e.g. `http://minio:9000` (default `AWS_ENDPOINT_URL`, else AWS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Address buckets as `https://bucket.host/key` (AWS's virtual-hosted style) instead of
    /// `https://host/bucket/key` (path style, which S3-compatible servers expect).
    #[serde(default)]
    pub virtual_hosted_style: bool,
    /// Allow an `http://` endpoint (default `AWS_ALLOW_HTTP`, else no).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_http: Option<bool>,
    /// S3 access key id; `${env:NAME}` and `${file:/path}` are resolved. Unset: the standard
    /// credential chain (environment, profile, web identity, container, instance metadata).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_key_id: Option<String>,
    /// S3 secret access key; `${env:NAME}` and `${file:/path}` are resolved; redacted in logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_access_key: Option<String>,
    /// S3 session token for temporary credentials; `${env:NAME}` and `${file:/path}` are resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_token: Option<String>,
    /// Profile of the AWS shared credentials and config files (default `AWS_PROFILE`, else
    /// `default`); static keys and region only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Further options of the store by `object_store` key, for GCS and Azure in particular
    /// (`google_service_account`, `azure_storage_account_name`, `azure_storage_account_key`,
    /// `azure_storage_sas_key`, ...); values take `${env:NAME}` and `${file:/path}`.
    #[serde(default)]
    pub options: BTreeMap<String, String>,
    /// Timeout of one storage request.
    #[serde(default = "default_storage_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Timeout of connecting to the store.
    #[serde(default = "default_storage_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Retries of a failed request (5xx, throttling, connection errors) before the
    /// checkpoint fails and the pipeline restarts from the table's offsets.
    #[serde(default = "default_storage_max_retries")]
    pub max_retries: usize,
    /// First backoff between retries; it doubles each time up to `retry_backoff_max_ms`.
    #[serde(default = "default_storage_retry_backoff_ms")]
    pub retry_backoff_ms: u64,
    /// Longest backoff between retries.
    #[serde(default = "default_storage_retry_backoff_max_ms")]
    pub retry_backoff_max_ms: u64,
    /// Most time spent retrying one request.
    #[serde(default = "default_storage_retry_timeout_ms")]
    pub retry_timeout_ms: u64,
    /// Files of one checkpoint uploaded at once.
    #[serde(default = "default_upload_concurrency")]
    pub upload_concurrency: usize,
    /// Files larger than this are uploaded in parts of this size (multipart upload; at least
    /// 5 MiB, the S3 minimum).
    #[serde(default = "default_multipart_part_bytes")]
    pub multipart_part_bytes: usize,
}

fn default_storage_request_timeout_ms() -> u64 {
    inlet_iceberg::io::DEFAULT_REQUEST_TIMEOUT_MS
}

fn default_storage_connect_timeout_ms() -> u64 {
    inlet_iceberg::io::DEFAULT_CONNECT_TIMEOUT_MS
}

fn default_storage_max_retries() -> usize {
    inlet_iceberg::io::DEFAULT_MAX_RETRIES
}

fn default_storage_retry_backoff_ms() -> u64 {
    inlet_iceberg::io::DEFAULT_RETRY_BACKOFF_MS
}

fn default_storage_retry_backoff_max_ms() -> u64 {
    inlet_iceberg::io::DEFAULT_RETRY_BACKOFF_MAX_MS
}

fn default_storage_retry_timeout_ms() -> u64 {
    inlet_iceberg::io::DEFAULT_RETRY_TIMEOUT_MS
}

fn default_upload_concurrency() -> usize {
    inlet_iceberg::io::DEFAULT_UPLOAD_CONCURRENCY
}

fn default_multipart_part_bytes() -> usize {
    inlet_iceberg::io::DEFAULT_MULTIPART_PART_BYTES
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            region: None,
            endpoint: None,
            virtual_hosted_style: false,
            allow_http: None,
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            profile: None,
            options: BTreeMap::new(),
            request_timeout_ms: default_storage_request_timeout_ms(),
            connect_timeout_ms: default_storage_connect_timeout_ms(),
            max_retries: default_storage_max_retries(),
            retry_backoff_ms: default_storage_retry_backoff_ms(),
            retry_backoff_max_ms: default_storage_retry_backoff_max_ms(),
            retry_timeout_ms: default_storage_retry_timeout_ms(),
            upload_concurrency: default_upload_concurrency(),
            multipart_part_bytes: default_multipart_part_bytes(),
        }
    }
}

impl StorageConfig {
    /// The settings the file layer takes, with `${env:…}`/`${file:…}` secrets resolved.
    pub fn settings(&self) -> Result<inlet_iceberg::io::StorageSettings> {
        use std::time::Duration;
        let secret = |key: &str, v: &Option<String>| {
            v.as_ref()
                .map(|v| resolve_secret(&format!("storage.{key}"), v))
                .transpose()
        };
        let options = self
            .options
            .iter()
            .map(|(k, v)| {
                Ok((
                    k.clone(),
                    resolve_secret(&format!("storage.options.{k}"), v)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(inlet_iceberg::io::StorageSettings {
            region: self.region.clone(),
            endpoint: self.endpoint.clone(),
            virtual_hosted_style: self.virtual_hosted_style,
            allow_http: self.allow_http,
            access_key_id: secret("access_key_id", &self.access_key_id)?,
            secret_access_key: secret("secret_access_key", &self.secret_access_key)?,
            session_token: secret("session_token", &self.session_token)?,
            profile: self.profile.clone(),
            options,
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            max_retries: self.max_retries,
            retry_backoff: Duration::from_millis(self.retry_backoff_ms),
            retry_backoff_max: Duration::from_millis(self.retry_backoff_max_ms),
            retry_timeout: Duration::from_millis(self.retry_timeout_ms),
            upload_concurrency: self.upload_concurrency,
            multipart_part_bytes: self.multipart_part_bytes,
        })
    }
}

/// How the pipeline spreads its work over threads.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Threads that decode messages and write checkpoint files, and index shards recovered at
    /// once when partitions are assigned; 0 means one per core. Changes are still applied in
    /// each partition's order.
    #[serde(default)]
    pub workers: usize,
}

impl PipelineConfig {
    /// The configured worker count, or the machine's cores.
    pub fn worker_count(&self) -> usize {
        match self.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}

/// Checkpoint policy: whichever limit is reached first triggers a commit.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Longest time between commits while data is buffered.
    #[serde(default = "default_interval_ms")]
    pub interval_ms: u64,
    /// Most change records buffered before a commit.
    #[serde(default = "default_max_records")]
    pub max_records: u64,
    /// Most bytes buffered (encoded and pending rows) before a commit.
    #[serde(default = "default_max_buffered_bytes")]
    pub max_buffered_bytes: u64,
    /// Attempts of a commit that lost the catalog's compare-and-swap to another writer
    /// (rebased each time) before the checkpoint is abandoned and its records re-read.
    #[serde(default = "default_commit_retries")]
    pub commit_retries: u32,
    /// How long a commit keeps retrying catalog and storage failures (capped exponential
    /// backoff, 0.1 s doubling to 10 s) before the checkpoint is abandoned, the pipeline
    /// restarts and its records are read again. Long enough to ride out a catalog restart.
    #[serde(default = "default_commit_timeout_ms")]
    pub commit_timeout_ms: u64,
    /// On SIGTERM or SIGINT, how long the final checkpoint may take; past it the process exits
    /// without it (its records are read again on the next start). Keep it below the pod's
    /// termination grace period.
    #[serde(default = "default_shutdown_timeout_ms")]
    pub shutdown_timeout_ms: u64,
}

fn default_interval_ms() -> u64 {
    60_000
}

fn default_max_records() -> u64 {
    1_000_000
}

fn default_max_buffered_bytes() -> u64 {
    512 * 1024 * 1024
}

fn default_commit_retries() -> u32 {
    10
}

fn default_commit_timeout_ms() -> u64 {
    120_000
}

fn default_shutdown_timeout_ms() -> u64 {
    30_000
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            interval_ms: default_interval_ms(),
            max_records: default_max_records(),
            max_buffered_bytes: default_max_buffered_bytes(),
            commit_retries: default_commit_retries(),
            commit_timeout_ms: default_commit_timeout_ms(),
            shutdown_timeout_ms: default_shutdown_timeout_ms(),
        }
    }
}

/// Metrics endpoint.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address serving `/metrics` and `/health`; empty disables the endpoint.
    #[serde(default = "default_metrics_listen")]
    pub listen: String,
    /// Bearer token that admin actions on the same address (`POST /errors/skip`) require as
    /// `Authorization: Bearer <token>`; unset, they are refused, since everyone who can scrape
    /// `/metrics` reaches them. `${env:NAME}` and `${file:/path}` are resolved when the process
    /// starts; redacted in logs.
    #[serde(default)]
    pub admin_token: Option<String>,
}

fn default_metrics_listen() -> String {
    "0.0.0.0:9464".into()
}

impl MetricsConfig {
    /// The admin token with `${env:…}`/`${file:…}` resolved; `None` when admin actions are off.
    pub fn resolved_admin_token(&self) -> Result<Option<String>> {
        let Some(token) = &self.admin_token else {
            return Ok(None);
        };
        let token = resolve_secret("metrics.admin_token", token)?;
        if token.trim().is_empty() {
            return Err(Error::config(
                "metrics.admin_token: is empty; set a long random token, or remove the setting to refuse admin actions",
            ));
        }
        Ok(Some(token))
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: default_metrics_listen(),
            admin_token: None,
        }
    }
}

/// Readiness probing.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    /// How often the broker (with the topics' metadata), the catalog and the storage (a small
    /// probe file under `catalog.warehouse`) are checked while the pipeline runs.
    #[serde(default = "default_probe_interval_ms")]
    pub probe_interval_ms: u64,
    /// How long a broker, catalog or storage fault may last before `/health/ready` fails and
    /// `inlet_health_check_ok` turns 0. Faults are retried all along; a component that has not
    /// answered once since the process started fails readiness at once.
    #[serde(default = "default_fault_grace_ms")]
    pub fault_grace_ms: u64,
}

fn default_probe_interval_ms() -> u64 {
    10_000
}

fn default_fault_grace_ms() -> u64 {
    60_000
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            probe_interval_ms: default_probe_interval_ms(),
            fault_grace_ms: default_fault_grace_ms(),
        }
    }
}

/// Table services.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServicesConfig {
    /// Whether the running pipeline expires snapshots and removes orphan files itself, in the
    /// background every `interval_ms` (`inlet maintain` runs them regardless).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// How often the running pipeline starts snapshot expiry and orphan cleanup (after a
    /// checkpoint, never two runs at once).
    #[serde(default = "default_services_interval_ms")]
    pub interval_ms: u64,
    /// Snapshots younger than this are kept; the window is never shorter than twice
    /// `checkpoint.interval_ms`, so an index restored from a recent copy can still catch up.
    #[serde(default = "default_snapshot_min_age_ms")]
    pub snapshot_min_age_ms: u64,
    /// Newest snapshots of the table's history always kept, however old (the head and every
    /// branch and tag, such as inlet's `inlet-<pipeline_id>`, are kept too).
    #[serde(default = "default_snapshots_min")]
    pub snapshots_min: u32,
    /// Most snapshots one expiry run removes, oldest first; the rest wait for the next run.
    #[serde(default = "default_expire_batch")]
    pub expire_batch: u32,
    /// Files under the table's `data/` and `metadata/` that no metadata reaches are deleted
    /// once older than this; at least an hour and twice the checkpoint interval plus the
    /// commit timeout, so files of a commit still in flight are never touched.
    #[serde(default = "default_orphan_min_age_ms")]
    pub orphan_min_age_ms: u64,
    /// Metadata files a table keeps beside the current one; older ones are deleted after each
    /// commit. Set as `write.metadata.previous-versions-max` and
    /// `write.metadata.delete-after-commit.enabled` on tables inlet creates (`table.properties`
    /// overrides them; existing tables follow their own properties).
    #[serde(default = "default_metadata_versions_max")]
    pub metadata_versions_max: u32,
    /// Upsert tables: whether each shard's writer compacts its own files right after a
    /// checkpoint (a `replace` snapshot with the same offsets, committed after the
    /// checkpoint's): data files with many deleted rows or delete files are rewritten without
    /// them, small files of a partition and bucket are packed. Changelog tables: whether
    /// `inlet maintain` packs small files of a partition (up to `compact_budget_bytes` a run).
    #[serde(default = "default_true")]
    pub compact: bool,
    /// Compaction runs after every this many checkpoints, and after every checkpoint during
    /// whose reading the pipeline waited for the source at least half the time (it has CPU to
    /// spare).
    #[serde(default = "default_compact_every_checkpoints")]
    pub compact_every_checkpoints: u32,
    /// Whether compaction goes on while the source is idle: when a run left files due
    /// (`inlet_compact_backlog_files`) and nothing is buffered, runs follow one another, each
    /// within its budget, until none is due. A change arriving meanwhile waits at most one
    /// run's budget for its checkpoint.
    #[serde(default = "default_true")]
    pub compact_when_idle: bool,
    /// A data file with at least this share of its rows deleted is rewritten.
    #[serde(default = "default_compact_delete_ratio")]
    pub compact_delete_ratio: f64,
    /// A data file with at least this many position-delete files is rewritten.
    #[serde(default = "default_compact_max_delete_files")]
    pub compact_max_delete_files: u32,
    /// Most bytes of data and delete files one compaction reads (their rows are held in
    /// memory while rewritten); the rest waits for the next (`inlet_compact_backlog_files`), so
    /// a checkpoint is never held up for long. One file larger than this is still rewritten
    /// whole when it is due.
    #[serde(default = "default_compact_budget_bytes")]
    pub compact_budget_bytes: u64,
    /// Longest time one compaction spends rewriting, in milliseconds; 0 means a fifth of
    /// `checkpoint.interval_ms`. Files still due when it is spent wait for the next run
    /// (`inlet_compact_backlog_files`). The first due rewrite of a run always runs, so
    /// compaction progresses however short this is.
    #[serde(default)]
    pub compact_budget_ms: u64,
    /// Partition retention (Paimon's `partition.expiration-time`), in milliseconds; 0 keeps
    /// every partition. A partition expires once its time (`partition_expiration_strategy`) is
    /// older than this; its files are dropped in a `delete` snapshot, each upsert shard dropping
    /// its own together with their index entries. Checked every `partition_interval_ms`.
    #[serde(default)]
    pub partition_expiration_ms: u64,
    /// What a partition's time is for retention: `values-time`, the end of the time range its
    /// values name (`day=2026-01-02` ends at 2026-01-03T00:00Z), or `update-time`, when a
    /// snapshot last added a file to it.
    #[serde(default)]
    pub partition_expiration_strategy: PartitionExpirationStrategy,
    /// The partition field whose values give a partition's time range, by partition field or
    /// source column name; unset takes the partition spec's first `year`, `month`, `day` or
    /// `hour` field, else its first identity field on a date or timestamp column.
    #[serde(default)]
    pub partition_time_field: Option<String>,
    /// Partition mark-done (Flink's partition commit): a partition is done once the table's
    /// watermark (the least, over its source partitions, of the newest committed source time,
    /// or the commit time for an idle one) has passed the end of its time range by
    /// this many milliseconds. Unset: off. Done partitions get a `_SUCCESS` file and an HTTP
    /// report (`mark_done_url`); the table property `inlet.done-through-ms` records how far.
    #[serde(default)]
    pub mark_done_idle_ms: Option<u64>,
    /// Where mark-done POSTs a JSON report of each done partition (`table`, `partition`,
    /// `path`, `watermark_ms`); unset sends none. Sent at least once: a crash before the done
    /// list commits sends it again, with the same body.
    #[serde(default)]
    pub mark_done_url: Option<String>,
    /// How often the running pipeline checks partition retention and mark-done (after a
    /// checkpoint), in milliseconds.
    #[serde(default = "default_partition_interval_ms")]
    pub partition_interval_ms: u64,
}

/// What a partition's time is, for retention.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PartitionExpirationStrategy {
    /// The end of the time range the partition's values name.
    #[default]
    ValuesTime,
    /// When a snapshot last added a file to the partition (a compaction's rewrite counts).
    UpdateTime,
}

fn default_partition_interval_ms() -> u64 {
    60_000
}

fn default_compact_every_checkpoints() -> u32 {
    10
}

fn default_compact_delete_ratio() -> f64 {
    0.3
}

fn default_compact_max_delete_files() -> u32 {
    10
}

fn default_compact_budget_bytes() -> u64 {
    64 * 1024 * 1024
}

fn default_services_interval_ms() -> u64 {
    3_600_000
}

fn default_snapshot_min_age_ms() -> u64 {
    3_600_000
}

fn default_snapshots_min() -> u32 {
    10
}

fn default_expire_batch() -> u32 {
    1_000
}

fn default_orphan_min_age_ms() -> u64 {
    3 * 24 * 3_600_000
}

fn default_metadata_versions_max() -> u32 {
    100
}

impl Default for ServicesConfig {
    fn default() -> Self {
        ServicesConfig {
            enabled: true,
            interval_ms: default_services_interval_ms(),
            snapshot_min_age_ms: default_snapshot_min_age_ms(),
            snapshots_min: default_snapshots_min(),
            expire_batch: default_expire_batch(),
            orphan_min_age_ms: default_orphan_min_age_ms(),
            metadata_versions_max: default_metadata_versions_max(),
            compact: true,
            compact_every_checkpoints: default_compact_every_checkpoints(),
            compact_when_idle: true,
            compact_delete_ratio: default_compact_delete_ratio(),
            compact_max_delete_files: default_compact_max_delete_files(),
            compact_budget_bytes: default_compact_budget_bytes(),
            compact_budget_ms: 0,
            partition_expiration_ms: 0,
            partition_expiration_strategy: PartitionExpirationStrategy::ValuesTime,
            partition_time_field: None,
            mark_done_idle_ms: None,
            mark_done_url: None,
            partition_interval_ms: default_partition_interval_ms(),
        }
    }
}

impl Config {
    /// The snapshot-age window expiry keeps: `services.snapshot_min_age_ms`, never shorter
    /// than two checkpoint intervals.
    pub fn snapshot_window_ms(&self) -> u64 {
        self.services
            .snapshot_min_age_ms
            .max(2 * self.checkpoint.interval_ms)
    }

    /// The youngest an orphan file may be: below it a commit may still be on its way.
    pub fn orphan_floor_ms(&self) -> u64 {
        (2 * (self.checkpoint.interval_ms + self.checkpoint.commit_timeout_ms)).max(3_600_000)
    }
}

/// The metadata columns of changelog tables, in order, with their types.
pub const CHANGELOG_COLUMNS: [(&str, Type, bool); 5] = [
    ("_op", Type::String, true),
    ("_version", Type::String, false),
    ("_source_ts", Type::TimestampTz, false),
    ("_kafka_partition", Type::Int, true),
    ("_kafka_offset", Type::Long, true),
];

/// The partition field name a partition config yields.
pub fn partition_field_name(p: &PartitionConfig, transform: Transform) -> String {
    match (&p.name, transform.field_suffix()) {
        (Some(n), _) => n.clone(),
        (None, None) => p.column.clone(),
        (None, Some(suffix)) => format!("{}_{suffix}", p.column),
    }
}
