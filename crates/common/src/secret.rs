//! Secrets in settings: `${env:NAME}` and `${file:/path}` references, resolved where a value is
//! used, and the redaction of what must never reach a log or a dump.

use crate::error::{Error, Result};

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

    #[test]
    fn secrets_resolve_from_env_and_files() {
        assert_eq!(resolve_secret("k", "plain").unwrap(), "plain");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "s3cret\n").unwrap();
        assert_eq!(
            resolve_secret("k", &format!("${{file:{}}}", file.display())).unwrap(),
            "s3cret"
        );
        assert_eq!(
            resolve_secret("k", "${env:PATH}").unwrap(),
            std::env::var("PATH").unwrap()
        );
        let err = resolve_secret(
            "kafka.properties.sasl.password",
            "${env:INLET_TEST_SURELY_UNSET}",
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("kafka.properties.sasl.password"),
            "{err}"
        );
        assert!(resolve_secret("k", "${vault:x}").is_err());
    }

    #[test]
    fn secret_keys_are_recognised() {
        assert!(is_secret_key("sasl.password"));
        assert!(is_secret_key("sasl.oauthbearer.client.secret"));
        assert!(!is_secret_key("bootstrap.servers"));
    }
}
