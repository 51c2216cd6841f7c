//! The deployment files: alert rules pass their `promtool` tests (each alert fires on its
//! failure and stays quiet without it), the Kubernetes manifests validate against the API
//! schemas and probe the health endpoints, and every metric the rules and the dashboard use
//! is one inlet exports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tool(env: &str, fallback: &str) -> PathBuf {
    let path = std::env::var_os(env)
        .map(PathBuf::from)
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or_else(|| PathBuf::from(fallback));
    let found = Command::new(&path).arg("--version").output().is_ok();
    assert!(
        found,
        "{} not found; run `scripts/test-env.sh` first (or set {env})",
        path.display()
    );
    path
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run tool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn yaml(path: &Path) -> serde_yaml::Value {
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn every_alert_fires_in_its_promtool_test_and_stays_quiet_without_its_failure() {
    let promtool = tool("INLET_TEST_PROMTOOL", "promtool");
    let rules = root().join("deploy/prometheus/alerts.yaml");
    let tests = root().join("tests/prometheus/alerts.test.yaml");
    run(Command::new(&promtool).args(["check", "rules"]).arg(&rules));
    let out = run(Command::new(&promtool).args(["test", "rules"]).arg(&tests));
    assert!(out.contains("SUCCESS"), "{out}");

    let alerts: BTreeSet<String> = yaml(&rules)["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap().iter())
        .filter_map(|r| r["alert"].as_str().map(str::to_string))
        .collect();
    assert!(alerts.len() >= 10, "{alerts:?}");
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for test in yaml(&tests)["tests"].as_sequence().unwrap() {
        for case in test["alert_rule_test"].as_sequence().unwrap() {
            let name = case["alertname"].as_str().unwrap().to_string();
            match case["exp_alerts"].as_sequence() {
                Some(a) if !a.is_empty() => fires.insert(name),
                _ => quiet.insert(name),
            };
        }
    }
    let untested: Vec<_> = alerts.difference(&fires).collect();
    assert!(
        untested.is_empty(),
        "alerts no test makes fire: {untested:?}"
    );
    let unchecked: Vec<_> = alerts.difference(&quiet).collect();
    assert!(
        unchecked.is_empty(),
        "alerts no test checks for staying quiet: {unchecked:?}"
    );
}

#[test]
fn kubernetes_manifests_validate_and_probe_the_health_endpoints() {
    let python = tool("INLET_TEST_PYTHON", "python3");
    let manifest = root().join("deploy/k8s/statefulset.yaml");
    let validator = python.with_file_name("kubernetes-validate");
    run(Command::new(validator)
        .args(["--strict", "--kubernetes-version", "1.30"])
        .arg(&manifest));

    let text = std::fs::read_to_string(&manifest).unwrap();
    let mut probes = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        use serde::Deserialize;
        let v = serde_yaml::Value::deserialize(doc).unwrap();
        if v["kind"] != "StatefulSet" {
            continue;
        }
        for c in v["spec"]["template"]["spec"]["containers"]
            .as_sequence()
            .unwrap()
        {
            for probe in ["livenessProbe", "readinessProbe"] {
                probes.push((
                    probe,
                    c[probe]["httpGet"]["path"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                ));
            }
        }
    }
    assert_eq!(
        probes,
        [
            ("livenessProbe", "/health/live".to_string()),
            ("readinessProbe", "/health/ready".to_string())
        ]
    );
}

/// `inlet_…` names in a text, with histogram series suffixes taken off.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("inlet_") {
        let start = i + at;
        let preceded =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let name = &text[start..end];
        if !preceded {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            out.insert(base.to_string());
        }
        i = end;
    }
    out
}

#[test]
fn rules_and_dashboard_use_only_metrics_inlet_exports() {
    let exported = metric_names(&inlet::metrics::metrics().reference_markdown());
    let rules = std::fs::read_to_string(root().join("deploy/prometheus/alerts.yaml")).unwrap();
    let dashboard =
        std::fs::read_to_string(root().join("deploy/grafana/inlet-dashboard.json")).unwrap();
    for (file, text) in [
        ("alerts.yaml", &rules),
        ("inlet-dashboard.json", &dashboard),
    ] {
        let unknown: Vec<_> = metric_names(text)
            .into_iter()
            .filter(|n| !exported.contains(n))
            .collect();
        assert!(
            unknown.is_empty(),
            "{file} uses unknown metrics: {unknown:?}"
        );
    }
    let panels: serde_json::Value =
        serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let exprs: Vec<&str> = panels["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
        .collect();
    assert!(exprs
        .iter()
        .any(|e| e.contains("inlet_commit_freshness_seconds")));
    for wanted in [
        "inlet_commit_freshness_seconds",
        "inlet_health_failures_total",
        "inlet_commit_checkpoints_total",
        "inlet_pipeline_restarts_total",
        "inlet_health_check_ok",
    ] {
        assert!(dashboard.contains(wanted), "the dashboard lacks {wanted}");
    }
}
