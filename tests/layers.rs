//! The layering holds: no import cycle between the top-level modules of any crate of the
//! workspace (Cargo already refuses a cycle between the crates themselves), and no crate below
//! the daemon names one above it. Test code (`#[cfg(test)]` items) may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace's crates, bottom to top, with the crates each may name.
const CRATES: [(&str, &[&str]); 5] = [
    ("crates/common", &[]),
    ("crates/iceberg", &["inlet_common"]),
    ("crates/index", &["inlet_common"]),
    ("crates/decode", &["inlet_common", "inlet_iceberg"]),
    (
        ".",
        &[
            "inlet_common",
            "inlet_iceberg",
            "inlet_index",
            "inlet_decode",
        ],
    ),
];

#[test]
fn no_import_cycle_between_top_level_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut failures = Vec::new();
    for (dir, _) in CRATES {
        let graph = module_graph(&root.join(dir).join("src"));
        assert!(graph.len() > 1, "{dir}: no modules found");
        for cycle in cycles(&graph) {
            failures.push(format!("{dir}: {}", cycle.join(" → ")));
        }
    }
    assert!(
        failures.is_empty(),
        "import cycles between top-level modules (a lower module imports a higher one; move \
         the shared item down to the concept it names):\n{}",
        failures.join("\n")
    );
}

#[test]
fn lower_crates_name_only_crates_below_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let all: Vec<&str> = [
        "inlet_common",
        "inlet_iceberg",
        "inlet_index",
        "inlet_decode",
    ]
    .into();
    let mut failures = Vec::new();
    for (dir, allowed) in CRATES {
        for file in rust_files(&root.join(dir).join("src")) {
            let code = without_test_code(&std::fs::read_to_string(&file).unwrap());
            for name in &all {
                let own = dir.ends_with(&name["inlet_".len()..]);
                if !own && !allowed.contains(name) && mentions(&code, &format!("{name}::")) {
                    failures.push(format!("{} names {name}", file.display()));
                }
            }
            if dir != "." && mentions(&code, "inlet::") {
                failures.push(format!("{} names the daemon", file.display()));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The checker finds what it is meant to find.
#[test]
fn the_checker_sees_cycles_and_skips_test_code() {
    let code = r#"
        use crate::{a::X, b::{self, Y}};
        fn f() { let s = "}{ crate::ignored"; let c = '{'; crate::c::go::<'static>(); }
        #[cfg(test)]
        mod tests { use crate::d::Z; fn g() { "}"; } }
        // crate::e in a comment
    "#;
    let refs = references(&without_test_code(code));
    assert_eq!(refs, BTreeSet::from(["a", "b", "c"].map(String::from)));
    let graph = BTreeMap::from([
        ("a".to_string(), BTreeSet::from(["b".to_string()])),
        ("b".to_string(), BTreeSet::from(["c".to_string()])),
        ("c".to_string(), BTreeSet::from(["a".to_string()])),
        ("d".to_string(), BTreeSet::from(["a".to_string()])),
    ]);
    assert_eq!(cycles(&graph), vec![vec!["a", "b", "c", "a"]]);
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Top-level module → the top-level modules its non-test code names through `crate::`
/// (or `super::` from a top-level file).
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in rust_files(src) {
        let rel = file.strip_prefix(src).unwrap();
        let mut parts = rel.iter().map(|p| p.to_string_lossy().into_owned());
        let first = parts.next().unwrap();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let top_level_file = rel.components().count() == 1
            || rel.file_name().is_some_and(|n| n == "mod.rs") && rel.components().count() == 2;
        let mut code = without_test_code(&std::fs::read_to_string(&file).unwrap());
        if top_level_file {
            code = code.replace("super::", "crate::");
        }
        let refs = references(&code);
        let entry = graph.entry(module.clone()).or_default();
        entry.extend(refs.into_iter().filter(|r| *r != module));
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for targets in graph.values_mut() {
        targets.retain(|t| modules.contains(t));
    }
    graph
}

/// Whether `code` holds `needle` at the start of a path (not inside a longer name).
fn mentions(code: &str, needle: &str) -> bool {
    code.match_indices(needle).any(|(at, _)| {
        !code[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

/// The first segment of every `crate::` path in `code`, `use crate::{a, b::c}` groups included.
fn references(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        if code[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group: split at commas outside nested braces.
            let (mut depth, mut start) = (0, 0);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.extend(first_segment(&group[start..i]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.extend(first_segment(&group[start..i]));
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.extend(first_segment(rest));
        }
    }
    out
}

fn first_segment(path: &str) -> Option<String> {
    // Lower case: a module (or a function of the crate root, which no module is named after);
    // `crate::Error` names an item of the crate root, which belongs to no module.
    let name: String = path
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    name.starts_with(|c: char| c.is_ascii_lowercase())
        .then_some(name)
}

/// `code` with comments, string and char literals blanked and `#[cfg(test)]` items removed.
fn without_test_code(code: &str) -> String {
    let plain = blank_literals(code);
    let mut out = String::with_capacity(plain.len());
    let mut rest = plain.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        // The item ends at its first `;` before any brace, or where its first brace closes.
        let mut depth = 0;
        let mut end = item.len();
        for (i, c) in item.char_indices() {
            match c {
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// Replaces comments and the contents of string and char literals with spaces, so braces and
/// paths inside them count for nothing.
fn blank_literals(code: &str) -> String {
    let b = code.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let starts = |s: &str| b[i..].starts_with(s.as_bytes());
        if starts("//") {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if starts("/*") {
            let end = code[i + 2..].find("*/").map_or(b.len(), |e| i + 2 + e + 2);
            out.extend(std::iter::repeat_n(b' ', end - i));
            i = end;
        } else if starts("r\"") || starts("r#") || starts("br\"") || starts("br#") {
            let from = i + usize::from(b[i] == b'b') + 1;
            let hashes = b[from..].iter().take_while(|&&c| c == b'#').count();
            if b.get(from + hashes) != Some(&b'"') {
                out.push(b[i]);
                i += 1;
                continue;
            }
            let close = format!("\"{}", "#".repeat(hashes));
            let body = from + hashes + 1;
            let end = code[body..]
                .find(&close)
                .map_or(b.len(), |e| body + e + close.len());
            out.extend(b"\"\"");
            out.extend(std::iter::repeat_n(b' ', end - i - 2));
            i = end;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            out.extend(b"\"\"");
            out.extend(std::iter::repeat_n(b' ', end - i - 2));
            i = end;
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{..}'), else a lifetime or label.
            let len = if b.get(i + 1) == Some(&b'\\') {
                code[i + 2..].find('\'').map(|e| e + 3)
            } else {
                let c = code[i + 1..].chars().next().map_or(1, char::len_utf8);
                (b.get(i + 1 + c) == Some(&b'\'')).then_some(c + 2)
            };
            match len {
                Some(n) => {
                    out.extend(std::iter::repeat_n(b' ', n));
                    i += n;
                }
                None => {
                    out.push(b'\'');
                    i += 1;
                }
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every elementary cycle through the graph's strongly connected components, one per
/// component, as a path that ends where it starts.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut done: BTreeSet<String> = BTreeSet::new();
    for start in graph.keys() {
        if done.contains(start) {
            continue;
        }
        // Depth-first search for a path back to `start`.
        let mut path = vec![start.clone()];
        let mut seen = BTreeSet::from([start.clone()]);
        if back_to(graph, start, &mut path, &mut seen) {
            done.extend(path.iter().cloned());
            path.push(start.clone());
            found.push(path);
        }
    }
    found
}

fn back_to(
    graph: &BTreeMap<String, BTreeSet<String>>,
    start: &str,
    path: &mut Vec<String>,
    seen: &mut BTreeSet<String>,
) -> bool {
    let here = path.last().unwrap().clone();
    for next in &graph[&here] {
        if next == start {
            return true;
        }
        if seen.insert(next.clone()) {
            path.push(next.clone());
            if back_to(graph, start, path, seen) {
                return true;
            }
            path.pop();
        }
    }
    false
}
