//! Loading a pipeline's configuration (defaults, then the YAML file, then `INLET__SECTION__KEY` environment variables) and validating it, naming the offending setting.

use std::collections::HashSet;
use std::path::Path;

use super::schema::{explain, fill_empty_sections, list_settings, schema_value};
use super::FormatKind;
use super::{
    partition_field_name, Aggregate, BadRecordPolicy, CatalogKind, Config, KafkaConfig,
    MergeEngine, SchemaChangePolicy, TableMode, CHANGELOG_COLUMNS,
};
use inlet_common::error::{Error, Result};
use inlet_common::secret::{is_secret_key, redact_url_password, resolve_secret};
use inlet_iceberg::transform::Transform;
use inlet_iceberg::types::Type;

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
    pub(super) fn validate_connections(&self) -> Result<()> {
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

/// The client certificate of `kafka.properties.ssl.certificate.location`, if it is a PEM file
/// that can be read, must be valid now: a broker refuses an expired one, and under TLS 1.3 the
/// client sees only a closed connection, which it would retry forever. A file that cannot be
/// read is left to librdkafka, which names it when the client is created.
pub(super) fn check_client_certificate(path: &str) -> Result<()> {
    const KEY: &str = "kafka.properties.ssl.certificate.location";
    let Ok(pem) = std::fs::read(path) else {
        return Ok(());
    };
    let Ok(cert) = openssl::x509::X509::from_pem(&pem) else {
        return Ok(());
    };
    let now = openssl::asn1::Asn1Time::days_from_now(0).map_err(|e| {
        Error::new(
            inlet_common::error::ErrorKind::Internal,
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

/// Checks that a catalog URI names a database the SQL catalog supports.
pub(super) fn check_catalog_uri(uri: &str) -> Result<()> {
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
