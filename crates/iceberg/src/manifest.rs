//! Manifests and manifest lists (format v2): the values the committer turns written files into,
//! their Avro encoding with the spec's field ids, and a reader for manifests of any writer.

use std::collections::BTreeMap;

use apache_avro::types::Value as Avro;
use serde_json::json;

use super::avro::{container, Encoder};
use super::metadata::{PartitionSpec, Schema};
use super::types::{Range, Type, Value};
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};

/// What a file in a manifest holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileContent {
    Data = 0,
    PositionDeletes = 1,
    EqualityDeletes = 2,
}

impl FileContent {
    fn from_i32(v: i32) -> Result<Self> {
        match v {
            0 => Ok(FileContent::Data),
            1 => Ok(FileContent::PositionDeletes),
            2 => Ok(FileContent::EqualityDeletes),
            _ => Err(Error::metadata(format!("unknown data file content {v}"))),
        }
    }
}

/// Manifest entry status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryStatus {
    Existing = 0,
    Added = 1,
    Deleted = 2,
}

/// A data or delete file as a manifest describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct DataFile {
    pub content: FileContent,
    pub file_path: String,
    pub file_format: String,
    /// Partition values in partition-spec field order.
    pub partition: Vec<Value>,
    pub record_count: i64,
    pub file_size_in_bytes: i64,
    pub column_sizes: BTreeMap<i32, i64>,
    pub value_counts: BTreeMap<i32, i64>,
    pub null_value_counts: BTreeMap<i32, i64>,
    pub nan_value_counts: BTreeMap<i32, i64>,
    pub lower_bounds: BTreeMap<i32, Vec<u8>>,
    pub upper_bounds: BTreeMap<i32, Vec<u8>>,
    pub split_offsets: Option<Vec<i64>>,
    pub sort_order_id: Option<i32>,
}

/// One manifest entry. Sequence numbers and snapshot id of added entries are left `None` so
/// they are inherited from the manifest list, which lets a retried commit reuse the manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct ManifestEntry {
    pub status: EntryStatus,
    pub snapshot_id: Option<i64>,
    pub sequence_number: Option<i64>,
    pub file_sequence_number: Option<i64>,
    pub data_file: DataFile,
}

/// Partition field summary in a manifest list entry.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldSummary {
    pub contains_null: bool,
    pub contains_nan: Option<bool>,
    pub lower_bound: Option<Vec<u8>>,
    pub upper_bound: Option<Vec<u8>>,
}

/// A manifest list entry.
#[derive(Debug, Clone, PartialEq)]
pub struct ManifestFile {
    pub manifest_path: String,
    pub manifest_length: i64,
    pub partition_spec_id: i32,
    pub content: i32,
    pub sequence_number: i64,
    pub min_sequence_number: i64,
    pub added_snapshot_id: i64,
    pub added_files_count: i32,
    pub existing_files_count: i32,
    pub deleted_files_count: i32,
    pub added_rows_count: i64,
    pub existing_rows_count: i64,
    pub deleted_rows_count: i64,
    pub partitions: Option<Vec<FieldSummary>>,
}

/// The partition fields of a spec with their result types, in spec order.
#[derive(Debug, Clone)]
pub struct PartitionType {
    pub fields: Vec<(i32, String, Type)>,
}

impl PartitionType {
    /// Derives result types from the spec and the schema it refers to.
    pub fn new(spec: &PartitionSpec, schema: &Schema) -> Result<Self> {
        let mut fields = Vec::new();
        for f in &spec.fields {
            let source = schema
                .fields
                .iter()
                .find(|c| c.id == f.source_id)
                .ok_or_else(|| {
                    Error::metadata(format!(
                        "partition field {} refers to missing column id {}",
                        f.name, f.source_id
                    ))
                })?;
            let ty = f.transform()?.result_type(source.primitive()?)?;
            fields.push((f.field_id, f.name.clone(), ty));
        }
        Ok(PartitionType { fields })
    }
}

fn decimal_fixed_size(precision: u8) -> usize {
    (1..=16)
        .find(|n| {
            let bits = 8 * n - 1;
            bits >= 127 || 10f64.powi(precision as i32) <= 2f64.powi(bits as i32)
        })
        .unwrap_or(16)
}

fn avro_type(field_id: i32, ty: Type) -> serde_json::Value {
    match ty {
        Type::Boolean => json!("boolean"),
        Type::Int => json!("int"),
        Type::Long => json!("long"),
        Type::Float => json!("float"),
        Type::Double => json!("double"),
        Type::Date => json!({"type": "int", "logicalType": "date"}),
        Type::Time => json!({"type": "long", "logicalType": "time-micros"}),
        Type::Timestamp => {
            json!({"type": "long", "logicalType": "timestamp-micros", "adjust-to-utc": false})
        }
        Type::TimestampTz => {
            json!({"type": "long", "logicalType": "timestamp-micros", "adjust-to-utc": true})
        }
        Type::String => json!("string"),
        Type::Binary => json!("bytes"),
        Type::Decimal { precision, scale } => json!({
            "type": "fixed", "name": format!("fixed_{field_id}"),
            "size": decimal_fixed_size(precision),
            "logicalType": "decimal", "precision": precision, "scale": scale,
        }),
    }
}

fn map_type(key_id: i32, value_id: i32, value: &str) -> serde_json::Value {
    json!(["null", {
        "type": "array", "logicalType": "map",
        "items": {"type": "record", "name": format!("k{key_id}_v{value_id}"), "fields": [
            {"name": "key", "type": "int", "field-id": key_id},
            {"name": "value", "type": value, "field-id": value_id},
        ]},
    }])
}

fn manifest_schema(partition: &PartitionType) -> String {
    let partition_fields: Vec<_> = partition
        .fields
        .iter()
        .map(|(id, name, ty)| {
            json!({"name": name, "type": ["null", avro_type(*id, *ty)], "default": null, "field-id": id})
        })
        .collect();
    let opt = |name: &str, ty: serde_json::Value, id: i32| json!({"name": name, "type": ["null", ty], "default": null, "field-id": id});
    json!({"type": "record", "name": "manifest_entry", "fields": [
        {"name": "status", "type": "int", "field-id": 0},
        opt("snapshot_id", json!("long"), 1),
        opt("sequence_number", json!("long"), 3),
        opt("file_sequence_number", json!("long"), 4),
        {"name": "data_file", "field-id": 2, "type": {"type": "record", "name": "r2", "fields": [
            {"name": "content", "type": "int", "field-id": 134},
            {"name": "file_path", "type": "string", "field-id": 100},
            {"name": "file_format", "type": "string", "field-id": 101},
            {"name": "partition", "field-id": 102,
             "type": {"type": "record", "name": "r102", "fields": partition_fields}},
            {"name": "record_count", "type": "long", "field-id": 103},
            {"name": "file_size_in_bytes", "type": "long", "field-id": 104},
            {"name": "column_sizes", "type": map_type(117, 118, "long"), "default": null, "field-id": 108},
            {"name": "value_counts", "type": map_type(119, 120, "long"), "default": null, "field-id": 109},
            {"name": "null_value_counts", "type": map_type(121, 122, "long"), "default": null, "field-id": 110},
            {"name": "nan_value_counts", "type": map_type(138, 139, "long"), "default": null, "field-id": 137},
            {"name": "lower_bounds", "type": map_type(126, 127, "bytes"), "default": null, "field-id": 125},
            {"name": "upper_bounds", "type": map_type(129, 130, "bytes"), "default": null, "field-id": 128},
            opt("key_metadata", json!("bytes"), 131),
            opt("split_offsets", json!({"type": "array", "items": "long", "element-id": 133}), 132),
            opt("equality_ids", json!({"type": "array", "items": "int", "element-id": 136}), 135),
            opt("sort_order_id", json!("int"), 140),
        ]}},
    ]})
    .to_string()
}

fn manifest_list_schema() -> String {
    json!({"type": "record", "name": "manifest_file", "fields": [
        {"name": "manifest_path", "type": "string", "field-id": 500},
        {"name": "manifest_length", "type": "long", "field-id": 501},
        {"name": "partition_spec_id", "type": "int", "field-id": 502},
        {"name": "content", "type": "int", "field-id": 517},
        {"name": "sequence_number", "type": "long", "field-id": 515},
        {"name": "min_sequence_number", "type": "long", "field-id": 516},
        {"name": "added_snapshot_id", "type": "long", "field-id": 503},
        {"name": "added_files_count", "type": "int", "field-id": 504},
        {"name": "existing_files_count", "type": "int", "field-id": 505},
        {"name": "deleted_files_count", "type": "int", "field-id": 506},
        {"name": "added_rows_count", "type": "long", "field-id": 512},
        {"name": "existing_rows_count", "type": "long", "field-id": 513},
        {"name": "deleted_rows_count", "type": "long", "field-id": 514},
        {"name": "partitions", "default": null, "field-id": 507, "type": ["null", {
            "type": "array", "element-id": 508, "items": {"type": "record", "name": "r508", "fields": [
                {"name": "contains_null", "type": "boolean", "field-id": 509},
                {"name": "contains_nan", "type": ["null", "boolean"], "default": null, "field-id": 518},
                {"name": "lower_bound", "type": ["null", "bytes"], "default": null, "field-id": 510},
                {"name": "upper_bound", "type": ["null", "bytes"], "default": null, "field-id": 511},
            ]}}]},
        {"name": "key_metadata", "type": ["null", "bytes"], "default": null, "field-id": 519},
    ]})
    .to_string()
}

fn encode_partition_value(e: &mut Encoder, ty: Type, v: &Value) -> Result<()> {
    if v.is_null() {
        e.long(0);
        return Ok(());
    }
    e.long(1);
    match (ty, v) {
        (Type::Boolean, Value::Boolean(b)) => e.boolean(*b),
        (Type::Int, Value::Int(x)) | (Type::Date, Value::Date(x)) => e.long(*x as i64),
        (Type::Long, Value::Long(x))
        | (Type::Time, Value::Time(x))
        | (Type::Timestamp, Value::Timestamp(x))
        | (Type::TimestampTz, Value::TimestampTz(x)) => e.long(*x),
        (Type::Float, Value::Float(x)) => e.buf.extend_from_slice(&x.to_le_bytes()),
        (Type::Double, Value::Double(x)) => e.buf.extend_from_slice(&x.to_le_bytes()),
        (Type::String, Value::String(s)) => e.string(s),
        (Type::Binary, Value::Binary(b)) => e.bytes(b),
        (Type::Decimal { precision, .. }, Value::Decimal(x)) => {
            let size = decimal_fixed_size(precision);
            e.buf.extend_from_slice(&x.to_be_bytes()[16 - size..]);
        }
        _ => {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("partition value {v:?} does not match partition type {ty}"),
            ))
        }
    }
    Ok(())
}

fn encode_map<V>(e: &mut Encoder, map: &BTreeMap<i32, V>, f: impl Fn(&mut Encoder, &V)) {
    e.optional((!map.is_empty()).then_some(map), |e, m| {
        e.array(m.iter(), |e, (k, v)| {
            e.long(*k as i64);
            f(e, v);
        })
    });
}

/// Encodes a manifest file. `content` is `data` or `deletes`.
pub fn write_manifest(
    entries: &[ManifestEntry],
    schema: &Schema,
    spec: &PartitionSpec,
    partition: &PartitionType,
) -> Result<Vec<u8>> {
    let mut records = Vec::with_capacity(entries.len());
    let deletes = entries
        .iter()
        .any(|en| en.data_file.content != FileContent::Data);
    for entry in entries {
        let f = &entry.data_file;
        let mut e = Encoder::default();
        e.long(entry.status as i64);
        e.optional(entry.snapshot_id, |e, v| e.long(v));
        e.optional(entry.sequence_number, |e, v| e.long(v));
        e.optional(entry.file_sequence_number, |e, v| e.long(v));
        e.long(f.content as i64);
        e.string(&f.file_path);
        e.string(&f.file_format);
        if f.partition.len() != partition.fields.len() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "file {} has {} partition values, spec has {} fields",
                    f.file_path,
                    f.partition.len(),
                    partition.fields.len()
                ),
            ));
        }
        for ((_, _, ty), v) in partition.fields.iter().zip(&f.partition) {
            encode_partition_value(&mut e, *ty, v)?;
        }
        e.long(f.record_count);
        e.long(f.file_size_in_bytes);
        encode_map(&mut e, &f.column_sizes, |e, v| e.long(*v));
        encode_map(&mut e, &f.value_counts, |e, v| e.long(*v));
        encode_map(&mut e, &f.null_value_counts, |e, v| e.long(*v));
        encode_map(&mut e, &f.nan_value_counts, |e, v| e.long(*v));
        encode_map(&mut e, &f.lower_bounds, |e, v| e.bytes(v));
        encode_map(&mut e, &f.upper_bounds, |e, v| e.bytes(v));
        e.long(0); // key_metadata
        e.optional(f.split_offsets.as_ref(), |e, s| {
            e.array(s.iter(), |e, v| e.long(*v))
        });
        e.long(0); // equality_ids
        e.optional(f.sort_order_id, |e, v| e.long(v as i64));
        records.push(e.buf);
    }
    let spec_fields = serde_json::to_string(&spec.fields).or_kind(ErrorKind::Internal, || {
        "cannot serialise partition spec".into()
    })?;
    let schema_json = serde_json::to_string(schema)
        .or_kind(ErrorKind::Internal, || "cannot serialise schema".into())?;
    let meta = [
        ("schema", schema_json),
        ("schema-id", schema.schema_id.to_string()),
        ("partition-spec", spec_fields),
        ("partition-spec-id", spec.spec_id.to_string()),
        ("format-version", "2".to_string()),
        (
            "content",
            if deletes { "deletes" } else { "data" }.to_string(),
        ),
    ];
    Ok(container(&manifest_schema(partition), &meta, &records))
}

/// Encodes a manifest list for snapshot `snapshot_id`.
pub fn write_manifest_list(
    manifests: &[ManifestFile],
    snapshot_id: i64,
    parent_snapshot_id: Option<i64>,
    sequence_number: i64,
) -> Vec<u8> {
    let records: Vec<Vec<u8>> = manifests
        .iter()
        .map(|m| {
            let mut e = Encoder::default();
            e.string(&m.manifest_path);
            e.long(m.manifest_length);
            e.long(m.partition_spec_id as i64);
            e.long(m.content as i64);
            e.long(m.sequence_number);
            e.long(m.min_sequence_number);
            e.long(m.added_snapshot_id);
            e.long(m.added_files_count as i64);
            e.long(m.existing_files_count as i64);
            e.long(m.deleted_files_count as i64);
            e.long(m.added_rows_count);
            e.long(m.existing_rows_count);
            e.long(m.deleted_rows_count);
            e.optional(m.partitions.as_ref(), |e, parts| {
                e.array(parts.iter(), |e, p| {
                    e.boolean(p.contains_null);
                    e.optional(p.contains_nan, |e, b| e.boolean(b));
                    e.optional(p.lower_bound.as_ref(), |e, b| e.bytes(b));
                    e.optional(p.upper_bound.as_ref(), |e, b| e.bytes(b));
                })
            });
            e.long(0);
            e.buf
        })
        .collect();
    let meta = [
        ("snapshot-id", snapshot_id.to_string()),
        (
            "parent-snapshot-id",
            parent_snapshot_id.map_or("null".into(), |p| p.to_string()),
        ),
        ("sequence-number", sequence_number.to_string()),
        ("format-version", "2".to_string()),
    ];
    container(&manifest_list_schema(), &meta, &records)
}

/// Partition summaries (null/bounds per partition field) over the files of one manifest.
pub fn summarize_partitions(files: &[&DataFile], partition: &PartitionType) -> Vec<FieldSummary> {
    partition
        .fields
        .iter()
        .enumerate()
        .map(|(i, _)| {
            let mut summary = FieldSummary {
                contains_null: false,
                contains_nan: Some(false),
                lower_bound: None,
                upper_bound: None,
            };
            let mut range = Range::default();
            for f in files {
                let v = &f.partition[i];
                match v {
                    Value::Null => summary.contains_null = true,
                    Value::Float(x) if x.is_nan() => summary.contains_nan = Some(true),
                    Value::Double(x) if x.is_nan() => summary.contains_nan = Some(true),
                    _ => range.add(v),
                }
            }
            summary.lower_bound = range.min.as_ref().and_then(Value::to_bound_bytes);
            summary.upper_bound = range.max.as_ref().and_then(Value::to_bound_bytes);
            summary
        })
        .collect()
}

// ---- reading ----

fn unwrap_union(v: &Avro) -> &Avro {
    match v {
        Avro::Union(_, inner) => inner,
        other => other,
    }
}

fn record_fields(v: &Avro) -> Result<BTreeMap<&str, &Avro>> {
    match unwrap_union(v) {
        Avro::Record(fields) => Ok(fields
            .iter()
            .map(|(k, v)| (k.as_str(), unwrap_union(v)))
            .collect()),
        other => Err(Error::metadata(format!(
            "expected an Avro record, found {other:?}"
        ))),
    }
}

fn get<'a>(rec: &BTreeMap<&str, &'a Avro>, name: &str) -> Option<&'a Avro> {
    rec.get(name).copied().filter(|v| !matches!(v, Avro::Null))
}

fn as_i64(v: Option<&Avro>, what: &str) -> Result<i64> {
    match v {
        Some(Avro::Long(x)) => Ok(*x),
        Some(Avro::Int(x)) => Ok(*x as i64),
        _ => Err(Error::metadata(format!(
            "manifest field {what} is missing or not a number"
        ))),
    }
}

fn opt_i64(v: Option<&Avro>) -> Option<i64> {
    match v {
        Some(Avro::Long(x)) => Some(*x),
        Some(Avro::Int(x)) => Some(*x as i64),
        _ => None,
    }
}

fn as_string(v: Option<&Avro>, what: &str) -> Result<String> {
    match v {
        Some(Avro::String(s)) => Ok(s.clone()),
        _ => Err(Error::metadata(format!(
            "manifest field {what} is missing or not a string"
        ))),
    }
}

fn as_bytes(v: &Avro) -> Option<Vec<u8>> {
    match unwrap_union(v) {
        Avro::Bytes(b) | Avro::Fixed(_, b) => Some(b.clone()),
        _ => None,
    }
}

fn read_map<V>(v: Option<&Avro>, f: impl Fn(&Avro) -> Option<V>) -> Result<BTreeMap<i32, V>> {
    let mut out = BTreeMap::new();
    let items = match v {
        Some(Avro::Array(items)) => items,
        Some(Avro::Map(_)) | None => return Ok(out),
        Some(other) => {
            return Err(Error::metadata(format!(
                "expected a map array, found {other:?}"
            )))
        }
    };
    for item in items {
        let rec = record_fields(item)?;
        let key = as_i64(get(&rec, "key"), "map key")? as i32;
        if let Some(value) = get(&rec, "value").and_then(&f) {
            out.insert(key, value);
        }
    }
    Ok(out)
}

fn partition_value(ty: Type, v: &Avro) -> Result<Value> {
    let v = unwrap_union(v);
    let bad = || Error::metadata(format!("partition value {v:?} does not match type {ty}"));
    Ok(match (ty, v) {
        (_, Avro::Null) => Value::Null,
        (Type::Boolean, Avro::Boolean(b)) => Value::Boolean(*b),
        (Type::Int, Avro::Int(x)) => Value::Int(*x),
        (Type::Date, Avro::Date(x) | Avro::Int(x)) => Value::Date(*x),
        (Type::Long, Avro::Long(x)) => Value::Long(*x),
        (Type::Time, Avro::TimeMicros(x) | Avro::Long(x)) => Value::Time(*x),
        (
            Type::Timestamp,
            Avro::LocalTimestampMicros(x) | Avro::TimestampMicros(x) | Avro::Long(x),
        ) => Value::Timestamp(*x),
        (Type::TimestampTz, Avro::TimestampMicros(x) | Avro::Long(x)) => Value::TimestampTz(*x),
        (Type::Float, Avro::Float(x)) => Value::Float(*x),
        (Type::Double, Avro::Double(x)) => Value::Double(*x),
        (Type::String, Avro::String(s)) => Value::String(s.clone()),
        (Type::Binary, Avro::Bytes(b)) => Value::Binary(b.clone()),
        (Type::Decimal { .. }, Avro::Decimal(d)) => {
            let bytes = <Vec<u8>>::try_from(d).map_err(|_| bad())?;
            Value::from_bound_bytes(ty, &bytes).ok_or_else(bad)?
        }
        (Type::Decimal { .. }, Avro::Fixed(_, b) | Avro::Bytes(b)) => {
            Value::from_bound_bytes(ty, b).ok_or_else(bad)?
        }
        _ => return Err(bad()),
    })
}

/// Decodes a manifest written by any v1/v2 writer.
pub fn read_manifest(bytes: &[u8], partition: &PartitionType) -> Result<Vec<ManifestEntry>> {
    let reader = apache_avro::Reader::new(bytes).or_kind(ErrorKind::Metadata, || {
        "cannot open manifest as Avro".into()
    })?;
    let mut entries = Vec::new();
    for value in reader {
        let value = value.or_kind(ErrorKind::Metadata, || "corrupt manifest record".into())?;
        let rec = record_fields(&value)?;
        let status = match as_i64(get(&rec, "status"), "status")? {
            0 => EntryStatus::Existing,
            1 => EntryStatus::Added,
            2 => EntryStatus::Deleted,
            s => {
                return Err(Error::metadata(format!(
                    "unknown manifest entry status {s}"
                )))
            }
        };
        let df = record_fields(
            get(&rec, "data_file").ok_or_else(|| Error::metadata("entry without data_file"))?,
        )?;
        let content = match get(&df, "content") {
            Some(v) => FileContent::from_i32(as_i64(Some(v), "content")? as i32)?,
            None => FileContent::Data,
        };
        let part_rec = match get(&df, "partition") {
            Some(p) => record_fields(p)?,
            None => BTreeMap::new(),
        };
        let mut part = Vec::with_capacity(partition.fields.len());
        for (_, name, ty) in &partition.fields {
            part.push(match part_rec.get(name.as_str()) {
                Some(v) => partition_value(*ty, v)?,
                None => Value::Null,
            });
        }
        let split_offsets = match get(&df, "split_offsets") {
            Some(Avro::Array(items)) => Some(
                items
                    .iter()
                    .filter_map(|v| opt_i64(Some(unwrap_union(v))))
                    .collect(),
            ),
            _ => None,
        };
        entries.push(ManifestEntry {
            status,
            snapshot_id: opt_i64(get(&rec, "snapshot_id")),
            sequence_number: opt_i64(get(&rec, "sequence_number")),
            file_sequence_number: opt_i64(get(&rec, "file_sequence_number")),
            data_file: DataFile {
                content,
                file_path: as_string(get(&df, "file_path"), "file_path")?,
                file_format: as_string(get(&df, "file_format"), "file_format")?,
                partition: part,
                record_count: as_i64(get(&df, "record_count"), "record_count")?,
                file_size_in_bytes: as_i64(get(&df, "file_size_in_bytes"), "file_size_in_bytes")?,
                column_sizes: read_map(get(&df, "column_sizes"), |v| {
                    opt_i64(Some(unwrap_union(v)))
                })?,
                value_counts: read_map(get(&df, "value_counts"), |v| {
                    opt_i64(Some(unwrap_union(v)))
                })?,
                null_value_counts: read_map(get(&df, "null_value_counts"), |v| {
                    opt_i64(Some(unwrap_union(v)))
                })?,
                nan_value_counts: read_map(get(&df, "nan_value_counts"), |v| {
                    opt_i64(Some(unwrap_union(v)))
                })?,
                lower_bounds: read_map(get(&df, "lower_bounds"), as_bytes)?,
                upper_bounds: read_map(get(&df, "upper_bounds"), as_bytes)?,
                split_offsets,
                sort_order_id: opt_i64(get(&df, "sort_order_id")).map(|v| v as i32),
            },
        });
    }
    Ok(entries)
}

/// Decodes a manifest list written by any v2 writer.
pub fn read_manifest_list(bytes: &[u8]) -> Result<Vec<ManifestFile>> {
    let reader = apache_avro::Reader::new(bytes).or_kind(ErrorKind::Metadata, || {
        "cannot open manifest list as Avro".into()
    })?;
    let mut out = Vec::new();
    for value in reader {
        let value = value.or_kind(ErrorKind::Metadata, || {
            "corrupt manifest list record".into()
        })?;
        let rec = record_fields(&value)?;
        let partitions = match get(&rec, "partitions") {
            Some(Avro::Array(items)) => Some(
                items
                    .iter()
                    .map(|item| {
                        let p = record_fields(item)?;
                        Ok(FieldSummary {
                            contains_null: matches!(
                                get(&p, "contains_null"),
                                Some(Avro::Boolean(true))
                            ),
                            contains_nan: match get(&p, "contains_nan") {
                                Some(Avro::Boolean(b)) => Some(*b),
                                _ => None,
                            },
                            lower_bound: get(&p, "lower_bound").and_then(as_bytes),
                            upper_bound: get(&p, "upper_bound").and_then(as_bytes),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
            _ => None,
        };
        let count = |name: &str| opt_i64(get(&rec, name)).unwrap_or(0);
        out.push(ManifestFile {
            manifest_path: as_string(get(&rec, "manifest_path"), "manifest_path")?,
            manifest_length: as_i64(get(&rec, "manifest_length"), "manifest_length")?,
            partition_spec_id: as_i64(get(&rec, "partition_spec_id"), "partition_spec_id")? as i32,
            content: count("content") as i32,
            sequence_number: count("sequence_number"),
            min_sequence_number: count("min_sequence_number"),
            added_snapshot_id: as_i64(get(&rec, "added_snapshot_id"), "added_snapshot_id")?,
            added_files_count: count("added_files_count") as i32,
            existing_files_count: count("existing_files_count") as i32,
            deleted_files_count: count("deleted_files_count") as i32,
            added_rows_count: count("added_rows_count"),
            existing_rows_count: count("existing_rows_count"),
            deleted_rows_count: count("deleted_rows_count"),
            partitions,
        });
    }
    Ok(out)
}
