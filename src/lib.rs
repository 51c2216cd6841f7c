//! inlet streams database change data (CDC) from Kafka into Apache Iceberg tables, exactly once.
//!
//! A record's path: [`source`] (the Kafka consumer, claims of partitions) → [`decode`] (bytes
//! to a typed change record, the `inlet-decode` crate) → [`upsert`] (per shard: the key
//! [`index`] drops stale versions and locates the old row, the `inlet-index` crate) → [`write`]
//! (Parquet data and position-delete files) → [`commit`] (one snapshot with the source offsets,
//! fenced by epochs), over the Iceberg [`table`] layer (the `inlet-iceberg` crate). [`pipeline`]
//! wires them: routing, the shard workers and the checkpoint coordinator; [`rebuild`] recovers an
//! index from the table, [`maintain`] runs the table services, [`health`], [`metrics`] and
//! [`http`] tell operators how it goes. Modules only import modules below them (`tests/layers.rs`
//! checks): config → metrics → health → write → upsert → commit → rebuild → source → maintain →
//! dlq, monitor → pipeline → supervisor → the CLI.

pub mod alloc;
pub mod bench;
pub mod bench_sync;
pub mod bench_table;
pub mod commit;
pub mod config;
pub mod demo;
pub mod dlq;
pub mod health;
pub mod http;
pub mod maintain;
pub mod metrics;
pub mod monitor;
pub mod pipeline;
pub mod rebuild;
pub mod source;
pub mod supervisor;
pub mod upsert;
pub mod write;

// The layers below the daemon, under the names the daemon's modules and tests use.
pub use inlet_common::{error, failpoint, version};
pub use inlet_decode as decode;
pub use inlet_iceberg as table;
pub use inlet_index as index;

pub use error::{Error, ErrorKind, Result};

#[cfg(test)]
mod docs {
    //! The docs' configuration and metrics references are generated from the code, and the
    //! bad-record reasons they list are the code's; these tests fail when they drift
    //! (`INLET_BLESS=1 cargo test --lib docs` rewrites the references).

    use std::path::{Path, PathBuf};

    fn doc(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("docs")
            .join(name)
    }

    /// Checks (or with `INLET_BLESS`, rewrites) the generated section `name` of `file`.
    fn generated(file: &str, name: &str, body: &str) {
        let path = doc(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let start = format!("<!-- {name}:start -->\n");
        let end = format!("<!-- {name}:end -->");
        let (Some(a), Some(b)) = (text.find(&start), text.find(&end)) else {
            panic!("docs/{file} lacks the markers of section {name}");
        };
        let updated = format!("{}{start}{body}{}", &text[..a], &text[b..]);
        if std::env::var("INLET_BLESS").is_ok() {
            std::fs::write(&path, &updated).unwrap();
        }
        assert!(
            updated == text,
            "docs/{file}: section {name} is stale; rerun with INLET_BLESS=1"
        );
    }

    #[test]
    fn references_match_the_code() {
        generated(
            "configuration.md",
            "config-reference",
            &crate::config::Config::reference_markdown(),
        );
        generated(
            "metrics.md",
            "metrics-reference",
            &crate::metrics::metrics().reference_markdown(),
        );
    }

    #[test]
    fn every_bad_record_reason_is_listed() {
        let text = std::fs::read_to_string(doc("configuration.md"))
            .unwrap()
            .replace("\n  ", " ");
        let listed = text
            .split_once("`inlet_bad_records_total{reason,action}` (reasons ")
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(list, _)| list)
            .expect("docs/configuration.md names the reasons of inlet_bad_records_total");
        for r in crate::decode::reason::ALL {
            assert!(listed.contains(&format!("`{r}`")), "{r} missing: {listed}");
        }
    }

    #[test]
    fn the_readme_example_is_a_valid_configuration() {
        let readme =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
                .unwrap();
        let yaml = readme
            .split_once("```yaml\n")
            .and_then(|(_, rest)| rest.split_once("```"))
            .map(|(yaml, _)| yaml)
            .expect("the README shows a configuration");
        let cfg = crate::config::Config::from_yaml_and_vars(yaml, std::iter::empty())
            .unwrap_or_else(|e| panic!("the README's example: {e}"));
        assert_eq!(cfg.table.primary_key, ["id"]);
    }
}
