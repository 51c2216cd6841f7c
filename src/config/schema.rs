//! The configuration's JSON Schema: the generated reference, and what loading reads from it (list settings, empty sections, the values of enum settings for error messages).

use std::collections::HashSet;

use super::Config;
use inlet_common::error::Error;

impl Config {
    /// A Markdown reference of every setting, generated from the JSON Schema (so from the doc
    /// comments and `default_*` functions above); docs/configuration.md embeds it.
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

/// The config's JSON Schema as a value.
pub(super) fn schema_value() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(Config)).unwrap_or_default()
}

/// A property's schema with references (and `Option`'s `anyOf [T, null]`) followed.
pub(super) fn resolve<'a>(
    p: &'a serde_json::Value,
    defs: &'a serde_json::Value,
) -> &'a serde_json::Value {
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
pub(super) fn fill_empty_sections(
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
pub(super) fn list_settings(
    schema: &serde_json::Value,
    defs: &serde_json::Value,
) -> HashSet<String> {
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
pub(super) fn schema_at<'a>(
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
pub(super) fn enum_values(p: &serde_json::Value) -> Vec<String> {
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
pub(super) fn explain(
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
