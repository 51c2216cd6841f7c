//! Tests of the upsert engine: shards, sinks, saved batches and stored rows.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use inlet_common::error::{Error, ErrorKind};
use inlet_decode::{ChangeRecord, Op};
use inlet_iceberg::types::{encode_values, Value};
use inlet_index::{IndexBatch, IndexEntry, InlineBytes, Marker, RowLocation};

use super::row::*;
use super::saved::*;
use super::shard::*;
use super::sink::*;
use super::*;

/// A sink over rows `(id long, v string)` keyed by `id`, for a topic of `shards` partitions.
fn sink(dir: &Path, shards: u32) -> UpsertSink {
    let column = |id, name: &str, ty| crate::write::parquet::WriteColumn {
        field_id: id,
        name: name.into(),
        ty,
        required: false,
    };
    UpsertSink::new(
        UpsertSpec {
            key_columns: vec![0],
            merge: MergeEngine::Deduplicate,
            aggregates: vec![None, None],
            fixed_buckets: None,
            target_rows_per_bucket: 100,
            shards,
            fields: vec![(1, Type::Long), (2, Type::String)],
        },
        vec![],
        dir.to_path_buf(),
        crate::config::IndexConfig {
            dir: dir.display().to_string(),
            ttl_secs: None,
            block_cache_bytes: 1 << 20,
            copy_interval_ms: 0,
        },
        WriterTemplate {
            columns: vec![
                column(1, "id", inlet_iceberg::types::Type::Long),
                column(2, "v", inlet_iceberg::types::Type::String),
                column(3, "_version", inlet_iceberg::types::Type::Binary),
            ],
            partition: vec![],
            location: format!("file://{}", dir.display()),
            target_file_bytes: 1 << 20,
        },
    )
}

fn update(before: i64, after: i64) -> ChangeRecord {
    let row = |id| vec![Value::Long(id), Value::String(format!("v{id}"))];
    ChangeRecord {
        op: Op::Update,
        before: Some(row(before)),
        after: Some(row(after)),
        version: None,
        source_ts_ms: None,
    }
}

#[test]
fn stored_rows_read_by_field_id_across_schema_changes() {
    let stored = encode_row(
        &[1, 2, 3],
        &[Value::Long(1), Value::Int(5), Value::String("a".into())],
    );
    // Another engine dropped nothing, moved field 3 before 2, widened 2 and added 4.
    let now = [
        (1, Type::Long),
        (3, Type::String),
        (2, Type::Long),
        (4, Type::String),
    ];
    assert_eq!(
        decode_row(&stored, &now).unwrap(),
        vec![
            Value::Long(1),
            Value::String("a".into()),
            Value::Long(5),
            Value::Null
        ]
    );
    // Field 2 dropped.
    assert_eq!(
        decode_row(&stored, &[(1, Type::Long), (3, Type::String)]).unwrap(),
        vec![Value::Long(1), Value::String("a".into())]
    );
    // A row stored before rows carried field ids is positional.
    let old = encode_values(&[Value::Long(1), Value::Int(5)]);
    assert_eq!(
        decode_row(&old, &[(1, Type::Long), (2, Type::Long), (3, Type::String)]).unwrap(),
        vec![Value::Long(1), Value::Long(5), Value::Null]
    );
    assert!(decode_row(&stored[..stored.len() - 1], &now).is_none());
}

proptest::proptest! {
    /// Keys short and long, sharing prefixes and zero bytes, where the integer order and
    /// the bytewise order could part.
    #[test]
    fn changes_sort_in_their_keys_bytewise_order(
        keys in proptest::collection::hash_set(
            proptest::collection::vec(proptest::sample::select(vec![0u8, 1, 0x7f, 0xff]), 0..40),
            0..200,
        )
    ) {
        let pending = || Pending {
            version: InlineBytes::default(),
            located: false,
            row: None,
            ghost: None,
            unresolved: None,
        };
        let changes: Changes = keys
            .iter()
            .map(|k| (InlineBytes::from(k.as_slice()), pending()))
            .collect();
        let got: Vec<&[u8]> = sorted_changes(&changes).into_iter().map(|(k, _)| &k[..]).collect();
        let mut want: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        want.sort();
        proptest::prop_assert_eq!(got, want);
    }
}

#[test]
fn a_key_change_whose_old_key_may_be_elsewhere_goes_to_the_errors_policy() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = sink(dir.path(), 2);
    sink.open_shard("t", 0).unwrap();
    let err = sink.accept("t", 0, 5, &update(7, 8), &[]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Decode);
    assert_eq!(err.reason(), inlet_decode::reason::KEY_CHANGE_UNOWNED);
    assert!(err.to_string().contains("does not own"), "{err}");
    // With every partition owned, an old key no shard holds may still be on its way in
    // another partition: without a comparable version that cannot be told apart from a key
    // gone already.
    sink.open_shard("t", 1).unwrap();
    let err = sink.accept("t", 0, 6, &update(7, 8), &[]).unwrap_err();
    assert_eq!(err.reason(), inlet_decode::reason::KEY_CHANGE_UNORDERED);
    // With source positions every shard records the old key's delete, and its insert
    // arriving later is stale.
    let mut change = update(7, 8);
    change.version = Some(inlet_decode::Version(vec![inlet_decode::VersionPart::Int(
        20,
    )]));
    assert_eq!(
        sink.accept("t", 0, 6, &change, &[]).unwrap(),
        Outcome::Applied
    );
    let mut insert = update(7, 7);
    (insert.op, insert.before) = (Op::Create, None);
    insert.version = Some(inlet_decode::Version(vec![inlet_decode::VersionPart::Int(
        10,
    )]));
    for p in [0, 1] {
        assert_eq!(
            sink.accept("t", p, 1, &insert, &[]).unwrap(),
            Outcome::Stale
        );
    }
}

/// Writes a checkpoint of every shard of `sink` as the pipeline does (files kept in
/// `files` by path, read back from there), applies its index batch as committed, and
/// returns the rows it wrote as `(id, v)`.
fn checkpoint(
    sink: &mut UpsertSink,
    files: &mut HashMap<String, Vec<u8>>,
    id: u64,
) -> BTreeMap<i64, Value> {
    let (jobs, _) = sink.detach().unwrap();
    write_checkpoint(sink, files, jobs, id)
}

/// [`checkpoint`] of jobs detached already.
fn write_checkpoint(
    sink: &mut UpsertSink,
    files: &mut HashMap<String, Vec<u8>>,
    jobs: Vec<ShardJob>,
    id: u64,
) -> BTreeMap<i64, Value> {
    let mut layouts = Vec::new();
    let mut rows = BTreeMap::new();
    for job in jobs {
        let read = |path: &str| {
            files
                .get(path)
                .map(|b| bytes::Bytes::from(b.clone()))
                .ok_or_else(|| Error::new(ErrorKind::Storage, format!("no file {path}")))
        };
        let mut written = job.write("writer", id, &format!("t{id}"), &read).unwrap();
        for f in &written.data {
            files.insert(f.data_file.file_path.clone(), f.bytes.clone());
            let read = inlet_iceberg::scan::read_columns(
                bytes::Bytes::from(f.bytes.clone()),
                &[("id", Type::Long), ("v", Type::String)],
            )
            .unwrap();
            for row in read {
                let Value::Long(k) = row[0] else {
                    panic!("{row:?}")
                };
                rows.insert(k, row[1].clone());
            }
        }
        let marker = Marker {
            snapshot_id: id as i64,
            sequence_number: id as i64,
        };
        written.apply(marker).unwrap();
        layouts.push(written.into_layout());
    }
    sink.attach(layouts);
    rows
}

/// A column a change leaves unchanged (Debezium's TOAST placeholder) keeps the key's value:
/// from the change pending before it, from the committed row when the checkpoint is
/// written, through a checkpoint in flight; a key without a row has none to keep.
#[test]
fn unavailable_values_keep_the_stored_value() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = sink(dir.path(), 1);
    sink.open_shard("t", 0).unwrap();
    let mut files = HashMap::new();
    let mut offset = 0;
    let mut change = |sink: &mut UpsertSink, id: i64, v: Option<&str>| {
        offset += 1;
        let unavailable: &[u16] = if v.is_none() { &[1] } else { &[] };
        let value = Value::String(v.unwrap_or("__debezium_unavailable_value").into());
        let record = ChangeRecord {
            op: Op::Update,
            before: None,
            after: Some(vec![Value::Long(id), value]),
            version: None,
            source_ts_ms: None,
        };
        sink.accept("t", 0, offset, &record, unavailable)
    };
    let text = |s: &str| Value::String(s.into());
    change(&mut sink, 1, Some("stored-1")).unwrap();
    change(&mut sink, 2, Some("stored-2")).unwrap();
    let first = checkpoint(&mut sink, &mut files, 1);
    assert_eq!(first[&1], text("stored-1"));

    // Committed row only: read back from its file when the checkpoint is written.
    change(&mut sink, 1, None).unwrap();
    // A pending row: taken from it at once.
    change(&mut sink, 2, Some("new-2")).unwrap();
    change(&mut sink, 2, None).unwrap();
    // No row to keep a value from.
    let err = change(&mut sink, 3, None).unwrap_err();
    assert_eq!(err.reason(), inlet_decode::reason::UNAVAILABLE_VALUE);
    assert!(err.to_string().ends_with("columns=v"), "{err}");
    let second = checkpoint(&mut sink, &mut files, 2);
    assert_eq!(second[&1], text("stored-1"));
    assert_eq!(second[&2], text("new-2"));
    assert!(!second.contains_key(&3));

    // A change arriving while its key's unresolved change is in flight stays unresolved,
    // and reads the row that checkpoint writes.
    change(&mut sink, 1, None).unwrap();
    let (jobs, _) = sink.detach().unwrap();
    change(&mut sink, 1, None).unwrap();
    write_checkpoint(&mut sink, &mut files, jobs, 3);
    let fourth = checkpoint(&mut sink, &mut files, 4);
    assert_eq!(fourth[&1], text("stored-1"));
    // The placeholder itself is never written.
    for f in files.values() {
        let rows = inlet_iceberg::scan::read_columns(
            bytes::Bytes::from(f.clone()),
            &[("v", Type::String)],
        )
        .unwrap();
        assert!(!rows
            .iter()
            .any(|r| r[0] == text("__debezium_unavailable_value")));
    }
}

/// The buffered bytes that bound a checkpoint count each pending key once, at its latest
/// change, and nothing once the changes are taken out as a checkpoint.
#[test]
fn buffered_bytes_count_each_pending_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = sink(dir.path(), 1);
    sink.open_shard("t", 0).unwrap();
    let insert = |id: i64, offset: i64| {
        let mut change = update(id, id);
        (change.op, change.before) = (Op::Create, None);
        change.version = Some(inlet_decode::Version(vec![inlet_decode::VersionPart::Int(
            offset.into(),
        )]));
        change
    };
    assert_eq!(sink.buffered_bytes(), 0);
    sink.accept("t", 0, 1, &insert(1, 1), &[]).unwrap();
    let one = sink.buffered_bytes();
    assert!(one > std::mem::size_of::<Pending>(), "{one}");
    for offset in 2..10 {
        sink.accept("t", 0, offset, &insert(1, offset), &[])
            .unwrap();
    }
    assert_eq!(sink.buffered_bytes(), one);
    sink.accept("t", 0, 10, &insert(2, 10), &[]).unwrap();
    assert_eq!(sink.buffered_bytes(), 2 * one);
    let (jobs, _) = sink.detach().unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(sink.buffered_bytes(), 0);
}

/// A schema change remaps pending rows, which changes their sizes; the count follows, so a
/// later change of the key subtracts what its row holds now.
#[test]
fn buffered_bytes_follow_pending_rows_remapped_by_a_schema_change() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = sink(dir.path(), 1);
    sink.open_shard("t", 0).unwrap();
    let mut insert = update(1, 1);
    (insert.op, insert.before) = (Op::Create, None);
    sink.accept("t", 0, 1, &insert, &[]).unwrap();
    let mut spec = sink.spec.clone();
    spec.fields.push((4, Type::String));
    spec.aggregates.push(None);
    let (columns, partition) = (sink.writer.columns.clone(), sink.writer.partition.clone());
    sink.change_layout(spec, vec![], columns, partition)
        .unwrap();
    let remapped = sink.buffered_bytes();
    let shard = sink.shard_mut("t", 0).unwrap();
    let exact: usize = shard.pending.iter().map(|(k, p)| p.bytes(k)).sum();
    assert_eq!(remapped, exact);
    insert
        .after
        .as_mut()
        .unwrap()
        .push(Value::String("x".repeat(100)));
    sink.accept("t", 0, 2, &insert, &[]).unwrap();
    let shard = sink.shard_mut("t", 0).unwrap();
    let exact: usize = shard.pending.iter().map(|(k, p)| p.bytes(k)).sum();
    assert_eq!(sink.buffered_bytes(), exact);
}

#[test]
fn aggregates_combine_old_and_new_values() {
    use Value::*;
    assert_eq!(
        aggregate(Some(Aggregate::Sum), Decimal(150), Decimal(25)),
        Decimal(175)
    );
    assert_eq!(aggregate(Some(Aggregate::Sum), Null, Long(2)), Long(2));
    assert_eq!(aggregate(Some(Aggregate::Sum), Long(2), Null), Long(2));
    assert_eq!(aggregate(Some(Aggregate::Min), Long(2), Long(1)), Long(1));
    assert_eq!(aggregate(Some(Aggregate::Max), Long(2), Long(1)), Long(2));
    assert_eq!(aggregate(Some(Aggregate::Count), Null, Long(9)), Long(1));
    assert_eq!(aggregate(Some(Aggregate::Count), Long(3), Null), Long(4));
    assert_eq!(
        aggregate(Some(Aggregate::FirstNonNull), Long(3), Long(4)),
        Long(3)
    );
    assert_eq!(
        aggregate(Some(Aggregate::LastNonNull), Long(3), Null),
        Long(3)
    );
    assert_eq!(aggregate(None, Long(3), Long(4)), Long(4));
}

#[test]
fn saved_batches_round_trip_and_reject_truncation() {
    let entry = IndexEntry {
        version: vec![1, 2],
        location: Some(RowLocation {
            partition_id: 3,
            bucket: 4,
            file_id: 5,
            position: 6,
        }),
        row: Some(vec![7]),
        written_at_secs: 8,
    };
    let batch = IndexBatch {
        entries: vec![(b"k".to_vec(), entry)],
        removed: vec![b"gone".to_vec()],
        partitions: vec![(1, b"p".to_vec())],
        files: vec![(9, "file:///x.parquet".into())],
        removed_files: vec![2],
        bucket_counts: vec![((1, 0), 10)],
        marker: None,
    };
    for base in [
        None,
        Some(Marker {
            snapshot_id: 7,
            sequence_number: 3,
        }),
    ] {
        let bytes = encode_batch("w", 42, base, &batch);
        assert_eq!(bytes.capacity(), bytes.len(), "sized exactly up front");
        let back = decode_batch(&bytes).unwrap();
        assert_eq!((back.writer.as_str(), back.checkpoint), ("w", 42));
        assert_eq!(back.base, base);
        assert_eq!(
            encode_batch(&back.writer, back.checkpoint, back.base, &back.batch),
            bytes
        );
        for cut in 0..bytes.len() {
            assert!(
                decode_batch(&bytes[..cut]).is_none(),
                "prefix of {cut} decoded"
            );
        }
    }
}
