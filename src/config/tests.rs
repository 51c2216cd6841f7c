//! Tests of loading and validating configurations.

use super::load::*;
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
        inlet_iceberg::catalog::CatalogSettings::Rest(r) => {
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

    let unset = format!("{MINIMAL}metrics:\n  admin_token: \"${{env:INLET_TEST_NO_SUCH_VAR}}\"\n");
    let err = Config::from_yaml_with_env(&unset).unwrap_err().to_string();
    assert!(err.contains("metrics.admin_token"), "{err}");
    let empty = format!("{MINIMAL}metrics:\n  admin_token: \"\"\n");
    let err = Config::from_yaml_with_env(&empty).unwrap_err().to_string();
    assert!(err.contains("metrics.admin_token: is empty"), "{err}");
}
