//! The command line and configuration: every shipped YAML loads and validates, mistakes name the
//! offending key, environment overrides apply, and the checked-in JSON Schema matches the types.

use std::path::{Path, PathBuf};
use std::process::Command;

fn inlet(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_inlet"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run inlet");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
}

/// Pipeline configs found in a YAML file: the file itself when it is one, or the `inlet.yaml`
/// entries of ConfigMaps in a Kubernetes manifest.
fn pipeline_configs(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut configs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_yaml::Value::deserialize(doc)
            .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()));
        if value.get("pipeline_id").is_some() {
            configs.push(text.clone());
        } else if let Some(embedded) = value
            .get("data")
            .and_then(|d| d.get("inlet.yaml"))
            .and_then(|v| v.as_str())
        {
            configs.push(embedded.to_string());
        }
    }
    configs
}

use serde::Deserialize;

#[test]
fn every_shipped_yaml_loads_and_every_pipeline_config_validates() {
    let mut files = Vec::new();
    for dir in ["connectors", "deploy"] {
        yaml_files(&root().join(dir), &mut files);
    }
    assert!(!files.is_empty(), "no YAML under connectors/ or deploy/");
    let mut validated = 0;
    for f in &files {
        for config in pipeline_configs(f) {
            // Secrets the file reads from the environment are provided where it is deployed.
            let secrets: Vec<String> = config
                .split("${env:")
                .skip(1)
                .filter_map(|rest| rest.split('}').next())
                .map(str::to_string)
                .collect();
            let env: Vec<(&str, &str)> = secrets.iter().map(|n| (n.as_str(), "x")).collect();
            let tmp = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(tmp.path(), config).unwrap();
            let (code, _, err) = inlet(
                &["validate", "--config", tmp.path().to_str().unwrap()],
                &env,
            );
            assert_eq!(code, 0, "{} does not validate: {err}", f.display());
            validated += 1;
        }
    }
    assert!(
        validated >= 3,
        "expected the connector examples and the k8s ConfigMap, found {validated}"
    );
}

const GOOD: &str = r#"pipeline_id: p
kafka: {bootstrap_servers: "localhost:9092", group_id: g, topics: [t]}
table:
  namespace: db
  name: t
  columns: [{name: id, type: long, required: true}]
catalog: {uri: "sqlite:///tmp/x.db"}
"#;

fn validate_text(text: &str, env: &[(&str, &str)]) -> (i32, String, String) {
    let tmp = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(tmp.path(), text).unwrap();
    inlet(&["validate", "--config", tmp.path().to_str().unwrap()], env)
}

#[test]
fn unknown_key_and_wrong_type_fail_naming_the_key() {
    let (code, _, err) = validate_text(
        &GOOD.replace("pipeline_id: p", "pipeline_id: p\npipline: x"),
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("pipline"), "{err}");

    let (code, _, err) = validate_text(&format!("{GOOD}checkpoint: {{max_records: many}}\n"), &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("checkpoint.max_records"), "{err}");

    let (code, _, err) = validate_text(&GOOD.replace("type: long", "type: lng"), &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("table.columns[0].type") && err.contains("unknown type \"lng\""),
        "{err}"
    );
}

#[test]
fn environment_overrides_the_file() {
    let (code, out, err) = validate_text(
        GOOD,
        &[
            ("INLET__CHECKPOINT__INTERVAL_MS", "1234"),
            ("INLET__KAFKA__GROUP_ID", "from-env"),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("interval_ms: 1234"), "{out}");
    assert!(out.contains("group_id: from-env"), "{out}");
}

#[test]
fn checked_in_json_schema_matches_the_config_types() {
    let (code, out, _) = inlet(&["config-schema"], &[]);
    assert_eq!(code, 0);
    let checked_in = std::fs::read_to_string(root().join("schemas/config.schema.json")).unwrap();
    assert!(
        out == checked_in,
        "schemas/config.schema.json is stale; regenerate it with `make schema`"
    );
}

#[test]
fn demo_runs_end_to_end_on_embedded_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = inlet(
        &[
            "demo",
            "--dir",
            dir.path().to_str().unwrap(),
            "--orders",
            "600",
            "--schemas",
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    // 600 creates, 200 payments, 20 shipments, 15 date corrections (cross-partition moves)
    // and 24 deletes: each change is one changelog row; 576 orders stay live.
    assert!(
        out.contains("shop.orders_changelog (Changelog): 859 rows"),
        "{out}"
    );
    assert!(out.contains("shop.orders (Upsert): 576 rows"), "{out}");
    assert!(dir.path().join("catalog.db").exists());
    assert!(dir.path().join("inlet-demo-orders.yaml").exists());
}

#[test]
fn validate_messages_speak_in_config_terms() {
    let cases: Vec<(String, Vec<&str>)> = vec![
        (
            GOOD.replace("catalog:", "format: {type: debezium-jsn}\ncatalog:"),
            vec![
                "format.type: unknown value \"debezium-jsn\"; expected one of debezium-json, debezium-avro, canal-json, maxwell-json, ogg-json, changelog-json, upsert-json",
            ],
        ),
        (
            GOOD.replace("  name: t\n", "  name: t\n  mode: upsrt\n"),
            vec!["table.mode: unknown value \"upsrt\"; expected one of changelog, upsert"],
        ),
        (
            GOOD.replace("type: long, required: true", "type: long, time_unit: secs"),
            vec!["table.columns[0].time_unit: unknown value \"secs\"; expected one of millis, micros, nanos"],
        ),
        (
            GOOD.replace(
                "kafka: {bootstrap_servers: \"localhost:9092\", group_id: g, topics: [t]}\n",
                "",
            ),
            vec!["kafka: this required section is missing"],
        ),
        (
            GOOD.replace("group_id: g, ", ""),
            vec!["kafka.group_id: this required setting is missing"],
        ),
        (
            format!("{GOOD}metrics: {{listen: localhost}}\n"),
            vec!["metrics.listen: \"localhost\" is not host:port"],
        ),
        (
            GOOD.replace("sqlite:///tmp/x.db", "catalog.db"),
            vec!["catalog.uri: \"catalog.db\" is not a catalog URI; use sqlite:///"],
        ),
        (
            GOOD.replace(
                "topics: [t]}",
                "topics: [t], properties: {sasl.password: \"${env:INLET_TEST_SURELY_UNSET}\"}}",
            ),
            vec!["kafka.properties.sasl.password: environment variable INLET_TEST_SURELY_UNSET is not set"],
        ),
        (
            format!("{GOOD}errors: {{policy: dead-letter, dead_letter_topic: t}}\n"),
            vec!["errors.dead_letter_topic: \"t\" is also in kafka.topics"],
        ),
    ];
    for (text, wanted) in cases {
        let (code, _, err) = validate_text(&text, &[]);
        assert_eq!(code, 2, "{text}\n{err}");
        for w in wanted {
            assert!(err.contains(w), "expected {w:?} in: {err}");
        }
        assert!(
            !err.contains("variant constructor")
                && !err.contains("unit value")
                && !err.contains(": .:"),
            "{err}"
        );
    }
}

#[test]
fn empty_sections_mean_their_defaults() {
    let (code, out, err) = validate_text(
        &format!("{GOOD}checkpoint:\nmetrics:\nhealth:\nerrors:\n"),
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("interval_ms: 60000"), "{out}");
    assert!(out.contains("listen: 0.0.0.0:9464"), "{out}");
    assert!(out.contains("fault_grace_ms: 60000"), "{out}");
}

#[test]
fn list_settings_take_comma_separated_values_from_the_environment() {
    let (code, out, err) = validate_text(
        GOOD,
        &[
            ("INLET__KAFKA__TOPICS", "orders,customers"),
            ("INLET__TABLE__PRIMARY_KEY", "id"),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("topics:\n  - orders\n  - customers\n"),
        "{out}"
    );
    assert!(out.contains("primary_key:\n  - id\n"), "{out}");
}
