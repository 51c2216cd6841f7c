//! The format's settings (`format:` in a pipeline's YAML, and the time unit of integer time
//! columns): the decoders read them, the daemon's configuration embeds them.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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

/// Unit of an integer time value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TimeUnit {
    Millis,
    Micros,
    Nanos,
}
