//! Pipeline configuration: built-in defaults → YAML file → `INLET__SECTION__KEY` environment
//! variables. Unknown keys are errors; every default lives in a `default_*` function here.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::table::transform::Transform;
use crate::table::types::Type;

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

/// Message format.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FormatConfig {
    /// The message format.
    #[serde(rename = "type", default = "default_format")]
    pub kind: FormatKind,
    /// `debezium-avro`: the Confluent-compatible schema registry that resolves schema ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_registry: Option<SchemaRegistryConfig>,
    /// `debezium-avro` without a registry: a directory of writer schemas named `<schema id>.avsc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schemas_dir: Option<String>,
    /// Debezium formats: the value Debezium sends for a column a change does not carry (its
    /// `unavailable.value.placeholder`; PostgreSQL's TOASTed values an update left unchanged),
    /// as text, bytes, a one-element array or a map of it. Such a column keeps the value the
    /// table holds (upsert tables; a key without a row follows `errors.policy`) or is written
    /// null (changelog tables). Empty: no value is taken for the placeholder.
    #[serde(default = "default_unavailable_value_placeholder")]
    pub unavailable_value_placeholder: String,
}

impl Default for FormatConfig {
    fn default() -> Self {
        FormatConfig {
            kind: default_format(),
            schema_registry: None,
            schemas_dir: None,
            unavailable_value_placeholder: default_unavailable_value_placeholder(),
        }
    }
}

/// Debezium's own default for `unavailable.value.placeholder`.
fn default_unavailable_value_placeholder() -> String {
    "__debezium_unavailable_value".into()
}

/// A Confluent-compatible schema registry.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SchemaRegistryConfig {
    /// Base URL, e.g. `https://registry:8081`.
    pub url: String,
    /// Basic-auth user; `${env:NAME}` and `${file:/path}` are resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Basic-auth password; `${env:NAME}` and `${file:/path}` are resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// PEM file of the CA that signs the registry's certificate, when not a system CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_location: Option<String>,
    /// Timeout of one registry request.
    #[serde(default = "default_registry_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_registry_timeout_ms() -> u64 {
    10_000
}

/// Supported message formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum FormatKind {
    /// Debezium change events as JSON, with or without the `schema`/`payload` envelope.
    DebeziumJson,
    /// Debezium change events as Avro in the Confluent wire format (magic byte, schema id).
    DebeziumAvro,
    /// Canal's JSON messages (`data`/`old` row arrays, `type`, `pkNames`).
    CanalJson,
    /// Maxwell's JSON messages (`type`, `data`, `old`, `xid`, `position`).
    MaxwellJson,
    /// Oracle GoldenGate JSON (`op_type`, `before`, `after`, `pos`).
    OggJson,
    /// Flink's changelog JSON (`op` +I/-U/+U/-D with `data`).
    ChangelogJson,
    /// Plain rows: the Kafka key holds the primary key, the value the row, a null value deletes.
    UpsertJson,
}

fn default_format() -> FormatKind {
    FormatKind::DebeziumJson
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

/// Unit of an integer time value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TimeUnit {
    Millis,
    Micros,
    Nanos,
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
    pub fn settings(&self) -> Result<crate::table::catalog::CatalogSettings> {
        use crate::source::resolve_secret;
        use crate::table::catalog::CatalogSettings;
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
        Ok(CatalogSettings::Rest(crate::table::rest::RestSettings {
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
    crate::table::io::DEFAULT_REQUEST_TIMEOUT_MS
}

fn default_storage_connect_timeout_ms() -> u64 {
    crate::table::io::DEFAULT_CONNECT_TIMEOUT_MS
}

fn default_storage_max_retries() -> usize {
    crate::table::io::DEFAULT_MAX_RETRIES
}

fn default_storage_retry_backoff_ms() -> u64 {
    crate::table::io::DEFAULT_RETRY_BACKOFF_MS
}

fn default_storage_retry_backoff_max_ms() -> u64 {
    crate::table::io::DEFAULT_RETRY_BACKOFF_MAX_MS
}

fn default_storage_retry_timeout_ms() -> u64 {
    crate::table::io::DEFAULT_RETRY_TIMEOUT_MS
}

fn default_upload_concurrency() -> usize {
    crate::table::io::DEFAULT_UPLOAD_CONCURRENCY
}

fn default_multipart_part_bytes() -> usize {
    crate::table::io::DEFAULT_MULTIPART_PART_BYTES
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
    pub fn settings(&self) -> Result<crate::table::io::StorageSettings> {
        use crate::source::resolve_secret;
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
        Ok(crate::table::io::StorageSettings {
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

impl Config {
    /// Loads a YAML file, applies `INLET__SECTION__KEY` overrides and validates the result.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::config(format!("cannot read config file {}", path.display())).with_source(e)
        })?;
        Self::from_yaml_with_env(&text)
    }

    /// Parses YAML text, applies environment overrides and validates.
    pub fn from_yaml_with_env(text: &str) -> Result<Config> {
        Self::from_yaml_and_vars(text, std::env::vars())
    }

    /// Parses YAML text with `vars` as the environment. An empty section (`checkpoint:` with
    /// nothing below) means its defaults; list settings take comma-separated values from the
    /// environment (`INLET__KAFKA__TOPICS=a,b`); errors name the setting in config terms.
    pub fn from_yaml_and_vars(
        text: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config> {
        let schema = schema_value();
        let defs = schema.get("$defs").cloned().unwrap_or_default();
        let mut doc: serde_yaml::Value = serde_yaml::from_str(text)
            .map_err(|e| Error::config(format!("the configuration is not valid YAML: {e}")))?;
        if doc.is_null() {
            doc = serde_yaml::Value::Mapping(Default::default());
        }
        fill_empty_sections(&mut doc, &schema, &defs);
        let yaml = serde_yaml::to_string(&doc)
            .map_err(|e| Error::config(format!("cannot re-read the configuration: {e}")))?;
        let lists = list_settings(&schema, &defs);
        let mut scalars = config::Map::new();
        let mut overrides = Vec::new();
        for (name, value) in vars {
            let Some(rest) = name.strip_prefix("INLET__") else {
                continue;
            };
            let key = rest.to_lowercase().replace("__", ".");
            if lists.contains(&key) {
                let items: Vec<String> = value
                    .split(',')
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
                    .collect();
                overrides.push((key, items));
            } else {
                scalars.insert(name, value);
            }
        }
        let mut builder = config::Config::builder()
            .add_source(config::File::from_str(&yaml, config::FileFormat::Yaml))
            .add_source(
                config::Environment::with_prefix("INLET")
                    .prefix_separator("__")
                    .separator("__")
                    .source(Some(scalars)),
            );
        for (key, items) in overrides {
            builder = builder
                .set_override(key.as_str(), items)
                .map_err(|e| Error::config(format!("{key}: {e}")))?;
        }
        let layered = builder
            .build()
            .map_err(|e| Error::config(format!("cannot parse configuration: {e}")))?;
        let config: Config = serde_path_to_error::deserialize(layered).map_err(|e| {
            let path = e.path().to_string();
            explain(&schema, &defs, &path, &e.into_inner().to_string())
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks cross-field rules serde cannot express. Every message names the setting and the fix.
    pub fn validate(&self) -> Result<()> {
        let t = &self.table;
        if self.pipeline_id.trim().is_empty() {
            return Err(Error::config("pipeline_id: must not be empty"));
        }
        if self.kafka.topics.is_empty() && self.kafka.topic_pattern.is_none() {
            return Err(Error::config(
                "kafka.topics: list at least one topic, or set kafka.topic_pattern",
            ));
        }
        if self.kafka.topic_pattern.is_some() && self.routing.is_none() {
            return Err(Error::config(
                "kafka.topic_pattern: a pattern's topics are many tables; configure routing (routing.by: source or topic)",
            ));
        }
        self.validate_connections()?;
        let dead_letters = self.errors.policy == BadRecordPolicy::DeadLetter
            || t.on_incompatible_change == SchemaChangePolicy::DeadLetter;
        if dead_letters
            && self
                .errors
                .dead_letter_topic
                .as_deref()
                .is_none_or(|t| t.trim().is_empty())
        {
            return Err(Error::config(
                "errors.dead_letter_topic: dead-lettering records needs a topic; name one (e.g. inlet.dlq)",
            ));
        }
        if t.on_incompatible_change == SchemaChangePolicy::DeadLetter
            && self.errors.policy != BadRecordPolicy::DeadLetter
        {
            // A producer is created only under the dead-letter policy.
            return Err(Error::config(
                "table.on_incompatible_change: dead-letter also needs errors.policy: dead-letter",
            ));
        }
        if self.format.kind == FormatKind::DebeziumAvro
            && self.format.schema_registry.is_none()
            && self.format.schemas_dir.is_none()
        {
            return Err(Error::config(
                "format: debezium-avro needs format.schema_registry.url or format.schemas_dir to resolve schema ids",
            ));
        }
        match &self.routing {
            Some(_) if !t.columns.is_empty() => {
                return Err(Error::config(
                    "table.columns: with routing, each table's columns come from its changes; remove table.columns",
                ))
            }
            None if t.namespace.trim().is_empty() || t.name.trim().is_empty() => {
                return Err(Error::config(
                    "table.name: name the table (table.namespace and table.name), or configure routing",
                ))
            }
            _ => {}
        }
        for (pattern, ty) in &t.column_types {
            Type::parse(ty)
                .map_err(|e| Error::config(format!("table.column_types[\"{pattern}\"]: {e}")))?;
        }
        // Without columns the table is created from the first change's fields.
        let declared = !t.columns.is_empty();
        let mut names = HashSet::new();
        for (i, c) in t.columns.iter().enumerate() {
            Type::parse(&c.ty)
                .map_err(|e| Error::config(format!("table.columns[{i}].type: {}", e.message())))?;
            if !names.insert(c.name.as_str()) {
                return Err(Error::config(format!(
                    "table.columns[{i}].name: column \"{}\" is listed twice",
                    c.name
                )));
            }
            if t.mode == TableMode::Changelog && CHANGELOG_COLUMNS.iter().any(|m| m.0 == c.name) {
                return Err(Error::config(format!(
                    "table.columns[{i}].name: \"{}\" is a changelog metadata column; rename the column",
                    c.name
                )));
            }
        }
        for (i, k) in t.primary_key.iter().enumerate() {
            if declared && !names.contains(k.as_str()) {
                return Err(Error::config(format!(
                    "table.primary_key[{i}]: \"{k}\" is not a column; add it to table.columns"
                )));
            }
        }
        if t.mode == TableMode::Upsert {
            if t.primary_key.is_empty() && declared {
                return Err(Error::config(
                    "table.primary_key: upsert tables need a primary key; list its columns",
                ));
            }
            if names.contains("_version") {
                return Err(Error::config(
                    "table.columns: \"_version\" is the upsert version column; rename the column",
                ));
            }
            // Routed, each table's shards follow the one topic its changes come from.
            if self.routing.is_none() && self.kafka.topics.len() != 1 {
                return Err(Error::config(
                    "kafka.topics: an upsert table reads one topic keyed by primary key, so each key lives in one partition; to sync many tables from their own topics, configure routing",
                ));
            }
            if let (Some(n), true) = (t.buckets, declared) {
                let key_type = t
                    .columns
                    .iter()
                    .find(|c| t.primary_key.first() == Some(&c.name))
                    .map(|c| Type::parse(&c.ty))
                    .transpose()?;
                let hashable =
                    key_type.is_some_and(|ty| Transform::Bucket(1).result_type(ty).is_ok());
                if n == 0 || t.primary_key.len() != 1 || !hashable {
                    return Err(Error::config(
                        "table.buckets: needs a positive count and a single-column primary key of a hashable type (not float, double or boolean); remove it for dynamic buckets",
                    ));
                }
            }
            if t.target_rows_per_bucket == 0 {
                return Err(Error::config(
                    "table.target_rows_per_bucket: must be positive",
                ));
            }
        }
        for (column, aggregate) in t.aggregations.iter().filter(|_| declared) {
            let Some(c) = t.columns.iter().find(|c| &c.name == column) else {
                return Err(Error::config(format!(
                    "table.aggregations.{column}: not a column; add it to table.columns"
                )));
            };
            let ty = Type::parse(&c.ty)?;
            let numeric = matches!(
                ty,
                Type::Int | Type::Long | Type::Float | Type::Double | Type::Decimal { .. }
            );
            let fits = match aggregate {
                Aggregate::Sum => numeric,
                Aggregate::Count => matches!(ty, Type::Int | Type::Long),
                Aggregate::Min | Aggregate::Max => !matches!(ty, Type::Boolean | Type::Binary),
                Aggregate::LastNonNull | Aggregate::FirstNonNull => true,
            };
            if !fits || t.primary_key.contains(column) {
                return Err(Error::config(format!(
                    "table.aggregations.{column}: {aggregate:?} does not apply to {} column {column}",
                    if t.primary_key.contains(column) { "primary key".to_string() } else { ty.to_string() }
                )));
            }
        }
        if t.buckets.is_some() && t.mode != TableMode::Upsert {
            return Err(Error::config(
                "table.buckets: only upsert tables have buckets; remove it",
            ));
        }
        if !t.aggregations.is_empty() && t.merge_engine != MergeEngine::Aggregation {
            return Err(Error::config(
                "table.aggregations: only used with merge_engine: aggregation; set it or remove the aggregations",
            ));
        }
        for (i, v) in t.version_columns.iter().enumerate() {
            if declared && !names.contains(v.as_str()) {
                return Err(Error::config(format!(
                    "table.version_columns[{i}]: \"{v}\" is not a column; add it to table.columns"
                )));
            }
        }
        let mut part_names = HashSet::new();
        for (i, p) in t.partition_by.iter().enumerate() {
            let col = t.columns.iter().find(|c| c.name == p.column);
            if declared && col.is_none() {
                return Err(Error::config(format!(
                    "table.partition_by[{i}].column: \"{}\" is not a column; add it to table.columns",
                    p.column
                )));
            }
            let transform = Transform::parse(&p.transform).map_err(|e| {
                Error::config(format!(
                    "table.partition_by[{i}].transform: {}",
                    e.message()
                ))
            })?;
            if let Some(col) = col {
                let ty = Type::parse(&col.ty)?;
                transform.result_type(ty).map_err(|e| {
                    Error::config(format!(
                        "table.partition_by[{i}].transform: {}",
                        e.message()
                    ))
                })?;
            }
            if !part_names.insert(partition_field_name(p, transform)) {
                return Err(Error::config(format!(
                    "table.partition_by[{i}]: duplicate partition field name; set `name`"
                )));
            }
        }
        if let Some(field) = &self.services.partition_time_field {
            let named = t.partition_by.iter().any(|p| {
                p.column == *field
                    || Transform::parse(&p.transform)
                        .is_ok_and(|tr| partition_field_name(p, tr) == *field)
            });
            if !t.partition_by.is_empty() && !named {
                return Err(Error::config(format!(
                    "services.partition_time_field: \"{field}\" is neither a partition field nor the column of one in table.partition_by"
                )));
            }
        }
        if self.catalog.kind == CatalogKind::Rest
            && !(self.catalog.uri.starts_with("http://")
                || self.catalog.uri.starts_with("https://"))
        {
            return Err(Error::config(format!(
                "catalog.uri: \"{}\" is not an http(s) URL; a REST catalog needs its base URL, e.g. https://catalog:8181",
                self.catalog.uri
            )));
        }
        if self.storage.upload_concurrency == 0 {
            return Err(Error::config(
                "storage.upload_concurrency: must be positive",
            ));
        }
        let c = &self.checkpoint;
        if c.interval_ms == 0 || c.max_records == 0 || c.max_buffered_bytes == 0 {
            return Err(Error::config(
                "checkpoint: interval_ms, max_records and max_buffered_bytes must be positive",
            ));
        }
        let sv = &self.services;
        if sv.orphan_min_age_ms < self.orphan_floor_ms() {
            return Err(Error::config(format!(
                "services.orphan_min_age_ms: {} is below {}, what a commit in flight may take (an hour, or twice checkpoint.interval_ms plus checkpoint.commit_timeout_ms); raise it",
                sv.orphan_min_age_ms,
                self.orphan_floor_ms()
            )));
        }
        if sv.interval_ms == 0 || sv.expire_batch == 0 || sv.snapshots_min == 0 {
            return Err(Error::config(
                "services: interval_ms, expire_batch and snapshots_min must be positive",
            ));
        }
        if sv.partition_interval_ms == 0 {
            return Err(Error::config(
                "services.partition_interval_ms: must be positive",
            ));
        }
        if let Some(url) = &sv.mark_done_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(Error::config(format!(
                    "services.mark_done_url: \"{url}\" is not an http(s) URL"
                )));
            }
            if sv.mark_done_idle_ms.is_none() {
                return Err(Error::config(
                    "services.mark_done_url: set services.mark_done_idle_ms too, which turns mark-done on",
                ));
            }
        }
        if t.target_file_bytes < 1024 * 1024 {
            return Err(Error::config(
                "table.target_file_bytes: must be at least 1048576 (1 MiB)",
            ));
        }
        Ok(())
    }

    /// Checks the settings that name other systems: values that cannot work are rejected here
    /// rather than retried at run time.
    fn validate_connections(&self) -> Result<()> {
        let k = &self.kafka;
        if k.bootstrap_servers.split(',').any(|s| s.trim().is_empty()) {
            return Err(Error::config(format!(
                "kafka.bootstrap_servers: \"{}\" has an empty entry; list host:port pairs separated by commas",
                k.bootstrap_servers
            )));
        }
        if k.group_id.trim().is_empty() {
            return Err(Error::config("kafka.group_id: must not be empty"));
        }
        if let Some(i) = k.topics.iter().position(|t| t.trim().is_empty()) {
            return Err(Error::config(format!(
                "kafka.topics[{i}]: must not be empty"
            )));
        }
        for (key, value) in &k.properties {
            resolve_secret(&format!("kafka.properties.{key}"), value)?;
        }
        if let Some(path) = k.properties.get("ssl.certificate.location") {
            check_client_certificate(path)?;
        }
        if let Some(r) = &self.format.schema_registry {
            if !(r.url.starts_with("http://") || r.url.starts_with("https://")) {
                return Err(Error::config(format!(
                    "format.schema_registry.url: \"{}\" is not an http:// or https:// URL",
                    r.url
                )));
            }
            for (key, value) in [("username", &r.username), ("password", &r.password)] {
                if let Some(v) = value {
                    resolve_secret(&format!("format.schema_registry.{key}"), v)?;
                }
            }
        }
        let pattern = k.topic_pattern.as_deref().map(topic_regex).transpose()?;
        if let Some(dlq) = &self.errors.dead_letter_topic {
            if k.topics.contains(dlq) {
                return Err(Error::config(format!(
                    "errors.dead_letter_topic: \"{dlq}\" is also in kafka.topics, so dead letters would be read again; use a topic of their own"
                )));
            }
            if pattern.as_ref().is_some_and(|p| p.is_match(dlq)) {
                return Err(Error::config(format!(
                    "errors.dead_letter_topic: \"{dlq}\" matches kafka.topic_pattern, so dead letters would be read again; use a topic the pattern leaves out"
                )));
            }
        }
        if self.catalog.kind == CatalogKind::Sql {
            check_catalog_uri(&self.catalog.uri)?;
        }
        if self.catalog.kind == CatalogKind::Sql && self.catalog.warehouse.trim().is_empty() {
            return Err(Error::config(
                "catalog.warehouse: must not be empty; name a directory or a file://, s3://, gs:// or abfss:// URL",
            ));
        }
        let listen = &self.metrics.listen;
        if !listen.is_empty() {
            let port = listen
                .rsplit_once(':')
                .filter(|(host, _)| !host.is_empty())
                .and_then(|(_, port)| port.parse::<u16>().ok());
            if port.is_none() {
                return Err(Error::config(format!(
                    "metrics.listen: \"{listen}\" is not host:port; use e.g. 0.0.0.0:9464 (all interfaces) or 127.0.0.1:9464, or \"\" to disable the endpoint"
                )));
            }
        }
        self.metrics.resolved_admin_token()?;
        if self.health.probe_interval_ms == 0 {
            return Err(Error::config("health.probe_interval_ms: must be positive"));
        }
        Ok(())
    }

    /// The configuration as YAML with secrets replaced by `***`.
    pub fn redacted_yaml(&self) -> String {
        let mut copy = self.clone();
        for (k, v) in copy.kafka.properties.iter_mut() {
            if is_secret_key(k) {
                *v = "***".into();
            }
        }
        copy.catalog.uri = redact_url_password(&copy.catalog.uri);
        let hide = |v: &mut Option<String>| {
            if let Some(v) = v.as_mut().filter(|v| !v.starts_with("${")) {
                *v = "***".into();
            }
        };
        hide(&mut copy.catalog.token);
        hide(&mut copy.catalog.credential);
        hide(&mut copy.storage.secret_access_key);
        hide(&mut copy.storage.session_token);
        hide(&mut copy.metrics.admin_token);
        for (k, v) in copy
            .catalog
            .headers
            .iter_mut()
            .chain(copy.storage.options.iter_mut())
        {
            if (is_secret_key(k) || k.to_ascii_lowercase().contains("key")) && !v.starts_with("${")
            {
                *v = "***".into();
            }
        }
        serde_yaml::to_string(&copy).unwrap_or_else(|e| format!("# cannot render config: {e}"))
    }

    /// The config's JSON Schema, generated from these types.
    pub fn json_schema() -> String {
        let schema = schemars::schema_for!(Config);
        serde_json::to_string_pretty(&schema).unwrap_or_default() + "\n"
    }
}

impl Config {
    /// A Markdown reference of every setting, generated from the JSON Schema (so from the doc
    /// comments and `default_*` functions above); the README embeds it.
    pub fn reference_markdown() -> String {
        let schema: serde_json::Value =
            serde_json::to_value(schemars::schema_for!(Config)).unwrap_or_default();
        let defs = schema.get("$defs").cloned().unwrap_or_default();
        let mut out =
            String::from("| setting | type | default | description |\n|---|---|---|---|\n");
        fn type_of(p: &serde_json::Value, defs: &serde_json::Value) -> String {
            if let Some(r) = p.get("$ref").and_then(|r| r.as_str()) {
                let name = r.rsplit('/').next().unwrap_or(r);
                let def = &defs[name];
                if let Some(options) = def.get("oneOf").or_else(|| def.get("enum")) {
                    let names: Vec<String> = options
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|o| {
                            o.get("const")
                                .or(Some(o))
                                .and_then(|c| c.as_str())
                                .map(|c| format!("`{c}`"))
                        })
                        .collect();
                    return names.join(" \\| ");
                }
                return "section".into();
            }
            match p.get("type") {
                Some(serde_json::Value::String(t)) if t == "array" => {
                    format!(
                        "list of {}",
                        type_of(p.get("items").unwrap_or(&serde_json::Value::Null), defs)
                    )
                }
                Some(serde_json::Value::String(t)) if t == "object" => "map".into(),
                Some(serde_json::Value::String(t)) => t.clone(),
                Some(serde_json::Value::Array(ts)) => ts
                    .iter()
                    .filter_map(|t| t.as_str())
                    .filter(|t| *t != "null")
                    .collect::<Vec<_>>()
                    .join("/"),
                _ => "section".into(),
            }
        }
        fn walk(prefix: &str, obj: &serde_json::Value, defs: &serde_json::Value, out: &mut String) {
            let required: Vec<&str> = obj
                .get("required")
                .and_then(|r| r.as_array())
                .into_iter()
                .flatten()
                .filter_map(|r| r.as_str())
                .collect();
            let Some(props) = obj.get("properties").and_then(|p| p.as_object()) else {
                return;
            };
            for (name, p) in props {
                let key = if prefix.is_empty() {
                    name.clone()
                } else {
                    format!("{prefix}.{name}")
                };
                let ty = type_of(p, defs);
                let default = match p.get("default") {
                    Some(d) if !d.is_object() => format!("`{d}`"),
                    _ if required.contains(&name.as_str()) => "required".into(),
                    _ => String::new(),
                };
                let doc = p
                    .get("description")
                    .and_then(|d| d.as_str())
                    .unwrap_or("")
                    .replace('\n', " ");
                let target = p
                    .get("$ref")
                    .or_else(|| p.get("items").and_then(|i| i.get("$ref")))
                    .and_then(|r| r.as_str())
                    .map(|r| &defs[r.rsplit('/').next().unwrap_or(r)]);
                let nested = target.filter(|t| t.get("properties").is_some());
                let shown_key = if p.get("items").is_some() && nested.is_some() {
                    format!("{key}[]")
                } else {
                    key.clone()
                };
                if nested.is_none() || ty != "section" {
                    out.push_str(&format!(
                        "| `{shown_key}` | {} | {default} | {doc} |\n",
                        if nested.is_some() { "list" } else { &ty }
                    ));
                }
                if let Some(t) = nested {
                    walk(&shown_key, t, defs, out);
                }
            }
        }
        walk("", &schema, &defs, &mut out);
        out
    }
}

/// The partition field name a partition config yields.
pub fn partition_field_name(p: &PartitionConfig, transform: Transform) -> String {
    match (&p.name, transform.field_suffix()) {
        (Some(n), _) => n.clone(),
        (None, None) => p.column.clone(),
        (None, Some(suffix)) => format!("{}_{suffix}", p.column),
    }
}

/// The client certificate of `kafka.properties.ssl.certificate.location`, if it is a PEM file
/// that can be read, must be valid now: a broker refuses an expired one, and under TLS 1.3 the
/// client sees only a closed connection, which it would retry forever. A file that cannot be
/// read is left to librdkafka, which names it when the client is created.
fn check_client_certificate(path: &str) -> Result<()> {
    const KEY: &str = "kafka.properties.ssl.certificate.location";
    let Ok(pem) = std::fs::read(path) else {
        return Ok(());
    };
    let Ok(cert) = openssl::x509::X509::from_pem(&pem) else {
        return Ok(());
    };
    let now = openssl::asn1::Asn1Time::days_from_now(0).map_err(|e| {
        Error::new(
            crate::error::ErrorKind::Internal,
            format!("reading the clock: {e}"),
        )
    })?;
    if cert.not_after() < now {
        return Err(Error::config(format!(
            "{KEY}: the certificate in {path} expired on {}; renew it",
            cert.not_after()
        )));
    }
    if cert.not_before() > now {
        return Err(Error::config(format!(
            "{KEY}: the certificate in {path} is valid only from {}; check the clock or the certificate",
            cert.not_before()
        )));
    }
    Ok(())
}

/// `kafka.topic_pattern` as a regular expression matching whole topic names. librdkafka
/// matches it with POSIX extended syntax, so the constructs only Perl-style engines know
/// (`\d`, `(?i)`, lazy quantifiers, ...) are refused rather than matched differently.
pub fn topic_regex(pattern: &str) -> Result<regex::Regex> {
    const KEY: &str = "kafka.topic_pattern";
    if pattern.trim().is_empty() {
        return Err(Error::config(format!("{KEY}: must not be empty")));
    }
    let perl = [
        "(?", "*?", "+?", "??", "\\d", "\\D", "\\w", "\\W", "\\s", "\\S", "\\b",
    ];
    if let Some(p) = perl.iter().find(|p| pattern.contains(*p)) {
        return Err(Error::config(format!(
            "{KEY}: \"{p}\" is not POSIX extended regular expression syntax, which the Kafka client matches topics with; use bracket expressions such as [0-9] or [a-z_]"
        )));
    }
    regex::Regex::new(&format!("^(?:{pattern})$"))
        .map_err(|e| Error::config(format!("{KEY}: not a regular expression: {e}")))
}

impl KafkaConfig {
    /// What the consumer subscribes to: the listed topics, and the pattern as librdkafka
    /// takes one (a leading `^`), anchored so it matches whole names.
    pub fn subscription(&self) -> Vec<String> {
        let mut out = self.topics.clone();
        if let Some(p) = &self.topic_pattern {
            out.push(format!("^({p})$"));
        }
        out
    }
}

/// Resolves `${env:NAME}` and `${file:/path}` values, so secrets stay out of config files and
/// dotted librdkafka keys (which environment overrides cannot address) can still take them.
/// Errors name `setting`.
pub fn resolve_secret(setting: &str, value: &str) -> Result<String> {
    let Some(inner) = value.strip_prefix("${").and_then(|v| v.strip_suffix('}')) else {
        return Ok(value.to_string());
    };
    if let Some(name) = inner.strip_prefix("env:") {
        return std::env::var(name).map_err(|_| {
            Error::config(format!(
                "{setting}: environment variable {name} is not set; set it or change the reference"
            ))
        });
    }
    if let Some(path) = inner.strip_prefix("file:") {
        return std::fs::read_to_string(path)
            .map(|s| s.trim_end_matches(['\n', '\r']).to_string())
            .map_err(|e| {
                Error::config(format!("{setting}: cannot read secret file {path}")).with_source(e)
            });
    }
    Err(Error::config(format!(
        "{setting}: unknown reference {value}; use ${{env:NAME}} or ${{file:/path}}"
    )))
}

/// Checks that a catalog URI names a database the SQL catalog supports.
fn check_catalog_uri(uri: &str) -> Result<()> {
    let scheme = uri.split_once("://").map(|(s, _)| s);
    let base = scheme.map(|s| s.split('+').next().unwrap_or(s));
    match base {
        Some("sqlite" | "postgres" | "postgresql") if uri.len() > scheme.map_or(0, str::len) + 3 => Ok(()),
        _ => Err(Error::config(format!(
            "catalog.uri: \"{}\" is not a catalog URI; use sqlite:///abs/path/catalog.db, sqlite://relative.db or postgresql://user@host:5432/db",
            redact_url_password(uri)
        ))),
    }
}

/// The config's JSON Schema as a value.
fn schema_value() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(Config)).unwrap_or_default()
}

/// A property's schema with references (and `Option`'s `anyOf [T, null]`) followed.
fn resolve<'a>(p: &'a serde_json::Value, defs: &'a serde_json::Value) -> &'a serde_json::Value {
    if let Some(r) = p.get("$ref").and_then(|r| r.as_str()) {
        return &defs[r.rsplit('/').next().unwrap_or(r)];
    }
    if let Some(first) = p
        .get("anyOf")
        .and_then(|a| a.as_array())
        .and_then(|a| a.iter().find(|v| v.get("$ref").is_some()))
    {
        return resolve(first, defs);
    }
    p
}

/// Replaces empty (null) sections with empty mappings, so their defaults apply.
fn fill_empty_sections(
    doc: &mut serde_yaml::Value,
    schema: &serde_json::Value,
    defs: &serde_json::Value,
) {
    let (Some(map), Some(props)) = (
        doc.as_mapping_mut(),
        schema.get("properties").and_then(|p| p.as_object()),
    ) else {
        return;
    };
    for (name, p) in props {
        let section = resolve(p, defs);
        if section.get("properties").is_none() {
            continue;
        }
        let key = serde_yaml::Value::String(name.clone());
        if let Some(value) = map.get_mut(&key) {
            if value.is_null() {
                *value = serde_yaml::Value::Mapping(Default::default());
            }
            fill_empty_sections(value, section, defs);
        }
    }
}

/// Dotted names of the settings that are lists of plain values (`kafka.topics`, ...).
fn list_settings(schema: &serde_json::Value, defs: &serde_json::Value) -> HashSet<String> {
    fn walk(
        prefix: &str,
        obj: &serde_json::Value,
        defs: &serde_json::Value,
        out: &mut HashSet<String>,
    ) {
        let Some(props) = obj.get("properties").and_then(|p| p.as_object()) else {
            return;
        };
        for (name, p) in props {
            let key = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            let items = p.get("items").map(|i| resolve(i, defs));
            if items.is_some_and(|i| i.get("properties").is_none()) {
                out.insert(key);
            } else if items.is_none() {
                walk(&key, resolve(p, defs), defs, out);
            }
        }
    }
    let mut out = HashSet::new();
    walk("", schema, defs, &mut out);
    out
}

/// The schema of the setting at a serde path such as `table.columns[0].time_unit`.
fn schema_at<'a>(
    schema: &'a serde_json::Value,
    defs: &'a serde_json::Value,
    path: &str,
) -> Option<&'a serde_json::Value> {
    let mut at = schema;
    for segment in path.split('.').filter(|s| !s.is_empty()) {
        let mut parts = segment.split('[');
        let name = parts.next()?;
        at = resolve(at.get("properties")?.get(name)?, defs);
        for _ in parts {
            at = resolve(at.get("items")?, defs);
        }
    }
    Some(at)
}

/// The values an enum setting takes, as written in the config.
fn enum_values(p: &serde_json::Value) -> Vec<String> {
    p.get("oneOf")
        .or_else(|| p.get("enum"))
        .and_then(|o| o.as_array())
        .into_iter()
        .flatten()
        .filter_map(|o| o.get("const").or(Some(o)).and_then(|c| c.as_str()))
        .map(str::to_string)
        .collect()
}

/// Turns a deserialization error at `path` into a message in config terms: the setting's
/// dotted name, and for enum settings the values it takes.
fn explain(
    schema: &serde_json::Value,
    defs: &serde_json::Value,
    path: &str,
    message: &str,
) -> Error {
    let path = if path == "." { "" } else { path };
    let join = |name: &str| {
        if path.is_empty() {
            name.to_string()
        } else {
            format!("{path}.{name}")
        }
    };
    // serde names the missing field; the config crate names its whole path.
    let missing = message
        .strip_prefix("missing field `")
        .and_then(|m| m.split('`').next())
        .map(join)
        .or_else(|| {
            message
                .split_once("missing configuration field \"")
                .and_then(|(_, m)| m.split('"').next())
                .map(str::to_string)
        });
    if let Some(key) = missing {
        let what = match schema_at(schema, defs, &key) {
            Some(p) if p.get("properties").is_some() => "section",
            _ => "setting",
        };
        return Error::config(format!("{key}: this required {what} is missing"));
    }
    if let Some(p) = schema_at(schema, defs, path) {
        let values = enum_values(p);
        if !values.is_empty() {
            let given = message
                .split_once("variant constructor ")
                .map(|(_, v)| v.split(" for key `").next().unwrap_or(v).trim().to_string())
                .or_else(|| {
                    message
                        .split_once("unknown variant `")
                        .and_then(|(_, v)| v.split('`').next())
                        .map(str::to_string)
                });
            let given = given.map_or(String::new(), |g| format!(" \"{g}\""));
            return Error::config(format!(
                "{path}: unknown value{given}; expected one of {}",
                values.join(", ")
            ));
        }
    }
    let message = if message.starts_with("invalid type: unit value") {
        "the key has no value; give it one"
    } else {
        message
    };
    if path.is_empty() {
        Error::config(message.to_string())
    } else {
        Error::config(format!("{path}: {message}"))
    }
}

/// Whether a property key names a secret whose value must not be shown.
pub fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["password", "secret", "token", "key.pem", "jaas"]
        .iter()
        .any(|s| k.contains(s))
}

/// Replaces the password of a URL's user info with `***`.
pub fn redact_url_password(uri: &str) -> String {
    match url::Url::parse(uri) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => uri.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
pipeline_id: p1
kafka:
  bootstrap_servers: "localhost:9092"
  group_id: g
  topics: [t]
  properties:
    session.timeout.ms: 6000
    sasl.password: hunter2
table:
  namespace: db
  name: orders
  columns:
    - {name: id, type: long, required: true}
    - {name: created, type: timestamptz}
  primary_key: [id]
  partition_by:
    - {column: created, transform: day}
catalog:
  uri: "postgresql://u:pw@localhost/db"
"#;

    #[test]
    fn loads_minimal_config_with_defaults() {
        let c = Config::from_yaml_with_env(MINIMAL).unwrap();
        assert_eq!(c.checkpoint.interval_ms, default_interval_ms());
        assert_eq!(c.kafka.properties["session.timeout.ms"], "6000");
        assert_eq!(c.catalog.name, "inlet");
        let shown = c.redacted_yaml();
        assert!(
            !shown.contains("hunter2") && !shown.contains(":pw@"),
            "{shown}"
        );
    }

    #[test]
    fn unknown_key_is_named() {
        let text = MINIMAL.replace(
            "  primary_key: [id]",
            "  primary_key: [id]\n  partiton_by: []",
        );
        let err = Config::from_yaml_with_env(&text).unwrap_err().to_string();
        assert!(err.contains("partiton_by"), "{err}");
    }

    #[test]
    fn column_types_name_a_bad_type() {
        let text = MINIMAL.replace(
            "  primary_key: [id]",
            "  primary_key: [id]\n  column_types: {\"*.t\": long, \"d\": intervall}",
        );
        let err = Config::from_yaml_with_env(&text).unwrap_err().to_string();
        assert!(err.contains("table.column_types[\"d\"]"), "{err}");
    }

    #[test]
    fn a_topic_pattern_needs_routing_and_matches_whole_names() {
        let routed = "  topics: []\n  topic_pattern: 'dbserver1[.]inventory[.].*'";
        let text = MINIMAL
            .replace("  topics: [t]", routed)
            .replace("  primary_key: [id]", "  mode: upsert\n  primary_key: [id]");
        let err = Config::from_yaml_with_env(&text).unwrap_err().to_string();
        assert!(
            err.contains("kafka.topic_pattern") && err.contains("routing"),
            "{err}"
        );

        // Routed upsert tables read many topics, each table its own.
        let text = text
            .replace("  columns:\n    - {name: id, type: long, required: true}\n    - {name: created, type: timestamptz}\n", "")
            .replace("catalog:", "routing: {by: source}\ncatalog:");
        let c = Config::from_yaml_with_env(&text).unwrap();
        assert_eq!(
            c.kafka.subscription(),
            vec!["^(dbserver1[.]inventory[.].*)$"]
        );
        let re = topic_regex(c.kafka.topic_pattern.as_deref().unwrap()).unwrap();
        assert!(re.is_match("dbserver1.inventory.orders"));
        assert!(!re.is_match("dbserver1.inventory"));
        assert!(!re.is_match("x.dbserver1.inventory.orders"));
        let listed = text.replace(routed, "  topics: [a, b]");
        Config::from_yaml_with_env(&listed).unwrap();

        // The dead-letter topic cannot be one the pattern reads.
        let dlq = text.replace(
            "catalog:",
            "errors: {policy: dead-letter, dead_letter_topic: dbserver1.inventory.dlq}\ncatalog:",
        );
        let err = Config::from_yaml_with_env(&dlq).unwrap_err().to_string();
        assert!(err.contains("errors.dead_letter_topic"), "{err}");
        // Perl-only syntax would match differently in the Kafka client.
        let perl = text.replace("dbserver1[.]inventory[.].*", "db\\d+[.].*");
        let err = Config::from_yaml_with_env(&perl).unwrap_err().to_string();
        assert!(
            err.contains("kafka.topic_pattern") && err.contains("[0-9]"),
            "{err}"
        );
        let broken = text.replace("dbserver1[.]inventory[.].*", "db(");
        let err = Config::from_yaml_with_env(&broken).unwrap_err().to_string();
        assert!(err.contains("kafka.topic_pattern"), "{err}");
    }

    #[test]
    fn an_upsert_table_without_routing_reads_one_topic() {
        let text = MINIMAL
            .replace("  topics: [t]", "  topics: [t, u]")
            .replace("  primary_key: [id]", "  mode: upsert\n  primary_key: [id]");
        let err = Config::from_yaml_with_env(&text).unwrap_err().to_string();
        assert!(
            err.contains("kafka.topics") && err.contains("routing"),
            "{err}"
        );
    }

    #[test]
    fn wrong_type_is_named_with_its_path() {
        let text = MINIMAL.replace("catalog:", "checkpoint:\n  interval_ms: soon\ncatalog:");
        let err = Config::from_yaml_with_env(&text).unwrap_err().to_string();
        assert!(err.contains("checkpoint.interval_ms"), "{err}");
    }

    #[test]
    fn bad_transform_names_the_setting_and_the_choices() {
        let text = MINIMAL.replace("transform: day", "transform: dayz");
        let err = Config::from_yaml_with_env(&text).unwrap_err().to_string();
        assert!(err.contains("table.partition_by[0].transform"), "{err}");
        assert!(
            err.contains("expected identity, year, month, day, hour"),
            "{err}"
        );
    }

    #[test]
    fn storage_and_rest_catalog_settings_resolve_and_redact() {
        std::env::set_var("INLET_TEST_STORAGE_SECRET", "s3cr3t");
        let text = MINIMAL.replace(
            "catalog:\n  uri: \"postgresql://u:pw@localhost/db\"\n",
            "catalog:\n  type: rest\n  uri: \"https://catalog:8181\"\n  token: tok3n\n  headers: {X-Api-Key: k3y}\nstorage:\n  endpoint: \"http://minio:9000\"\n  access_key_id: AK\n  secret_access_key: \"${env:INLET_TEST_STORAGE_SECRET}\"\n  options: {azure_storage_account_key: plainkey}\n",
        );
        let c = Config::from_yaml_with_env(&text).unwrap();
        let s = c.storage.settings().unwrap();
        assert_eq!(s.secret_access_key.as_deref(), Some("s3cr3t"));
        assert_eq!(s.endpoint.as_deref(), Some("http://minio:9000"));
        assert_eq!(s.upload_concurrency, default_upload_concurrency());
        match c.catalog.settings().unwrap() {
            crate::table::catalog::CatalogSettings::Rest(r) => {
                assert_eq!(r.token.as_deref(), Some("tok3n"));
                assert_eq!(r.headers["X-Api-Key"], "k3y");
            }
            other => panic!("{other:?}"),
        }
        let shown = c.redacted_yaml();
        for secret in ["tok3n", "k3y", "plainkey", "s3cr3t"] {
            assert!(!shown.contains(secret), "{secret} shown: {shown}");
        }
        let bad = text.replace("uri: \"https://catalog:8181\"", "uri: \"sqlite://x.db\"");
        let err = Config::from_yaml_with_env(&bad).unwrap_err().to_string();
        assert!(err.contains("catalog.uri"), "{err}");
    }

    #[test]
    fn admin_token_resolves_from_env_or_file_and_is_redacted() {
        let c = Config::from_yaml_with_env(MINIMAL).unwrap();
        assert_eq!(
            c.metrics.resolved_admin_token().unwrap(),
            None,
            "off by default"
        );

        let literal = format!("{MINIMAL}metrics:\n  admin_token: adm1n-t0ken\n");
        let c = Config::from_yaml_with_env(&literal).unwrap();
        assert_eq!(
            c.metrics.resolved_admin_token().unwrap().as_deref(),
            Some("adm1n-t0ken")
        );
        let shown = c.redacted_yaml();
        assert!(!shown.contains("adm1n-t0ken"), "{shown}");
        assert!(shown.contains("admin_token: '***'"), "{shown}");

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "fr0m-f1le\n").unwrap();
        let vars = [(
            "INLET__METRICS__ADMIN_TOKEN".to_string(),
            format!("${{file:{}}}", file.display()),
        )];
        let c = Config::from_yaml_and_vars(MINIMAL, vars).unwrap();
        assert_eq!(
            c.metrics.resolved_admin_token().unwrap().as_deref(),
            Some("fr0m-f1le")
        );
        assert!(!c.redacted_yaml().contains("fr0m-f1le"));

        let unset =
            format!("{MINIMAL}metrics:\n  admin_token: \"${{env:INLET_TEST_NO_SUCH_VAR}}\"\n");
        let err = Config::from_yaml_with_env(&unset).unwrap_err().to_string();
        assert!(err.contains("metrics.admin_token"), "{err}");
        let empty = format!("{MINIMAL}metrics:\n  admin_token: \"\"\n");
        let err = Config::from_yaml_with_env(&empty).unwrap_err().to_string();
        assert!(err.contains("metrics.admin_token: is empty"), "{err}");
    }

    #[test]
    fn secret_keys_are_recognised() {
        assert!(is_secret_key("sasl.password"));
        assert!(is_secret_key("sasl.oauthbearer.client.secret"));
        assert!(!is_secret_key("bootstrap.servers"));
    }
}
