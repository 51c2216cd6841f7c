//! inlet streams database change data (CDC) from Kafka into Apache Iceberg tables, exactly once.
//!
//! Stages, in the order a record passes them: [`source`] → [`decode`] → [`write`] →
//! [`commit`], over the Iceberg [`table`] layer; [`pipeline`] wires them together.

pub mod alloc;
pub mod bench;
pub mod bench_sync;
pub mod bench_table;
pub mod commit;
pub mod config;
pub mod decode;
pub mod demo;
pub mod dlq;
pub mod error;
pub mod failpoint;
pub mod health;
pub mod index;
pub mod maintain;
pub mod metrics;
pub mod monitor;
pub mod pipeline;
pub mod rebuild;
pub mod source;
pub mod supervisor;
pub mod table;
pub mod upsert;
pub mod write;

pub use error::{Error, ErrorKind, Result};

#[cfg(test)]
mod readme {
    //! The README's configuration and metrics references are generated from the code; this
    //! test fails when they drift (`INLET_BLESS=1 cargo test readme` rewrites them).

    fn replace_section(text: &str, name: &str, body: &str) -> String {
        let start = format!("<!-- {name}:start -->\n");
        let end = format!("<!-- {name}:end -->");
        let (Some(a), Some(b)) = (text.find(&start), text.find(&end)) else {
            panic!("README.md lacks the markers of section {name}");
        };
        format!("{}{start}{body}{}", &text[..a], &text[b..])
    }

    #[test]
    fn readme_references_match_the_code() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
        let text = std::fs::read_to_string(&path).unwrap();
        let mut updated = replace_section(
            &text,
            "config-reference",
            &crate::config::Config::reference_markdown(),
        );
        updated = replace_section(
            &updated,
            "metrics-reference",
            &crate::metrics::metrics().reference_markdown(),
        );
        if std::env::var("INLET_BLESS").is_ok() {
            std::fs::write(&path, &updated).unwrap();
        }
        assert!(
            updated == text,
            "README.md references are stale; rerun with INLET_BLESS=1"
        );
    }
}
