//! Golden tests of the metadata layer: files written by pyiceberg are read exactly, and what
//! inlet writes matches checked-in fixtures and reads back unchanged.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value as Json;

use super::manifest::*;
use super::metadata::TableMetadata;
use super::transform::Transform;
use super::types::{Type, Value};
use super::TableDefinition;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/iceberg")
        .join(name)
}

fn pyiceberg_metadata() -> TableMetadata {
    serde_json::from_slice(&std::fs::read(fixture("pyiceberg-table-metadata.json")).unwrap())
        .unwrap()
}

/// Compares with a checked-in fixture; `INLET_BLESS=1` rewrites the fixture instead.
fn assert_golden(name: &str, actual: &Json) {
    let path = fixture(name);
    let text = serde_json::to_string_pretty(actual).unwrap() + "\n";
    if std::env::var("INLET_BLESS").is_ok() {
        std::fs::write(&path, &text).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(expected == text, "{name} differs from what inlet writes; if the change is intended, rerun with INLET_BLESS=1");
}

#[test]
fn reads_and_round_trips_pyiceberg_table_metadata() {
    let raw: Json =
        serde_json::from_slice(&std::fs::read(fixture("pyiceberg-table-metadata.json")).unwrap())
            .unwrap();
    let meta = pyiceberg_metadata();
    assert_eq!(meta.format_version, 2);
    assert_eq!(meta.current_schema().unwrap().identifier_field_ids, vec![1]);
    assert_eq!(
        meta.default_spec().unwrap().fields[0].transform().unwrap(),
        Transform::Day
    );
    // Nothing is lost when inlet rewrites another writer's metadata.
    assert_eq!(serde_json::to_value(&meta).unwrap(), raw);
}

#[test]
fn reads_pyiceberg_manifests() {
    let meta = pyiceberg_metadata();
    let ptype =
        PartitionType::new(meta.default_spec().unwrap(), meta.current_schema().unwrap()).unwrap();
    assert_eq!(
        ptype.fields.iter().map(|f| f.2).collect::<Vec<_>>(),
        vec![Type::Date, Type::String, Type::Int]
    );
    let list = read_manifest_list(&std::fs::read(fixture("pyiceberg-manifest-list.avro")).unwrap())
        .unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(
        (list[0].added_files_count, list[0].added_rows_count),
        (2, 2)
    );
    assert_eq!(list[0].added_snapshot_id, meta.current_snapshot_id.unwrap());
    let entries = read_manifest(
        &std::fs::read(fixture("pyiceberg-manifest.avro")).unwrap(),
        &ptype,
    )
    .unwrap();
    let partitions: Vec<_> = entries
        .iter()
        .map(|e| e.data_file.partition.clone())
        .collect();
    assert_eq!(
        partitions,
        vec![
            vec![
                Value::Date(19727),
                Value::String("eu".into()),
                Value::Int(0)
            ],
            vec![Value::Date(19728), Value::Null, Value::Int(0)],
        ]
    );
    let first = &entries[0].data_file;
    assert_eq!(first.record_count, 1);
    assert_eq!(
        Value::from_bound_bytes(Type::Long, &first.lower_bounds[&1]),
        Some(Value::Long(1))
    );
    assert_eq!(
        Value::from_bound_bytes(
            Type::Decimal {
                precision: 10,
                scale: 2
            },
            &first.upper_bounds[&3]
        ),
        Some(Value::Decimal(150))
    );
    // pyiceberg's bucket[4] of id 1 agrees with ours.
    assert_eq!(Transform::Bucket(4).apply(&Value::Long(1)), Value::Int(0));
}

fn sample_files() -> Vec<DataFile> {
    let bounds = |v: i64| BTreeMap::from([(1, v.to_le_bytes().to_vec())]);
    vec![
        DataFile {
            content: FileContent::Data,
            file_path: "file:///wh/t/data/ts_day=2024-01-05/region=eu/a.parquet".into(),
            file_format: "PARQUET".into(),
            partition: vec![
                Value::Date(19727),
                Value::String("eu".into()),
                Value::Int(3),
            ],
            record_count: 10,
            file_size_in_bytes: 1234,
            column_sizes: BTreeMap::from([(1, 100), (2, 50)]),
            value_counts: BTreeMap::from([(1, 10), (2, 10)]),
            null_value_counts: BTreeMap::from([(1, 0), (2, 1)]),
            nan_value_counts: BTreeMap::new(),
            lower_bounds: bounds(-5),
            upper_bounds: bounds(500),
            split_offsets: Some(vec![4]),
            sort_order_id: None,
        },
        DataFile {
            partition: vec![Value::Null, Value::Null, Value::Null],
            file_path: "file:///wh/t/data/x.parquet".into(),
            column_sizes: BTreeMap::new(),
            split_offsets: None,
            ..empty_file()
        },
    ]
}

fn empty_file() -> DataFile {
    DataFile {
        content: FileContent::Data,
        file_path: String::new(),
        file_format: "PARQUET".into(),
        partition: vec![],
        record_count: 1,
        file_size_in_bytes: 1,
        column_sizes: BTreeMap::new(),
        value_counts: BTreeMap::new(),
        null_value_counts: BTreeMap::new(),
        nan_value_counts: BTreeMap::new(),
        lower_bounds: BTreeMap::new(),
        upper_bounds: BTreeMap::new(),
        split_offsets: None,
        sort_order_id: None,
    }
}

#[test]
fn manifests_round_trip_and_match_the_fixture_schema() {
    let meta = pyiceberg_metadata();
    let schema = meta.current_schema().unwrap();
    let spec = meta.default_spec().unwrap();
    let ptype = PartitionType::new(spec, schema).unwrap();
    let entries: Vec<ManifestEntry> = sample_files()
        .into_iter()
        .map(|f| ManifestEntry {
            status: EntryStatus::Added,
            snapshot_id: None,
            sequence_number: None,
            file_sequence_number: None,
            data_file: f,
        })
        .collect();
    let bytes = write_manifest(&entries, schema, spec, &ptype).unwrap();
    assert_eq!(read_manifest(&bytes, &ptype).unwrap(), entries);

    let header = super::avro::header_metadata(&bytes).unwrap();
    assert_eq!(header["format-version"], b"2");
    assert_eq!(header["content"], b"data");
    // The schema as written, with its field ids, is what readers rely on.
    let written: Json = serde_json::from_slice(&header["avro.schema"]).unwrap();
    assert_golden("inlet-manifest-entry-schema.json", &written);

    let files: Vec<&DataFile> = entries.iter().map(|e| &e.data_file).collect();
    let summary = summarize_partitions(&files, &ptype);
    assert!(summary[1].contains_null);
    let mf = ManifestFile {
        manifest_path: "file:///wh/t/metadata/m0.avro".into(),
        manifest_length: bytes.len() as i64,
        partition_spec_id: 0,
        content: 0,
        sequence_number: 7,
        min_sequence_number: 7,
        added_snapshot_id: 42,
        added_files_count: 2,
        existing_files_count: 0,
        deleted_files_count: 0,
        added_rows_count: 11,
        existing_rows_count: 0,
        deleted_rows_count: 0,
        partitions: Some(summary),
    };
    let list = write_manifest_list(std::slice::from_ref(&mf), 42, Some(41), 7);
    assert_eq!(read_manifest_list(&list).unwrap(), vec![mf]);
}

#[test]
fn new_table_metadata_matches_the_fixture() {
    let def = TableDefinition {
        columns: vec![
            ("id".into(), Type::Long, true, Some("order id".into())),
            (
                "amount".into(),
                Type::Decimal {
                    precision: 10,
                    scale: 2,
                },
                false,
                None,
            ),
            ("created_at".into(), Type::TimestampTz, false, None),
        ],
        identifier: vec!["id".into()],
        partition: vec![
            ("created_at".into(), Transform::Day, "created_at_day".into()),
            ("id".into(), Transform::Bucket(8), "id_bucket".into()),
        ],
        properties: BTreeMap::new(),
    };
    let mut meta = def.new_metadata("file:///wh/db.db/t").unwrap();
    meta.table_uuid = "00000000-0000-0000-0000-000000000000".into();
    meta.last_updated_ms = 0;
    assert_golden(
        "inlet-table-metadata.json",
        &serde_json::to_value(&meta).unwrap(),
    );
}
