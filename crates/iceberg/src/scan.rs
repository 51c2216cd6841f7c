//! Reading data and position-delete files back into values: the index rebuilds itself from
//! the table with these, and tests compare with them.

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Date32Type, Decimal128Type, Float32Type, Float64Type, Int32Type, Int64Type,
    Time64MicrosecondType, TimestampMicrosecondType,
};
use arrow_array::{Array, ArrayRef};
use arrow_schema::DataType;
use bytes::Bytes;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;

use super::keys::DELETE_VERSION_COLUMN;
use super::types::{Type, Value};
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};

/// Reserved field id of `file_path` in position-delete files.
pub const FILE_PATH_ID: i32 = 2147483546;
/// Reserved field id of `pos` in position-delete files.
pub const POS_ID: i32 = 2147483545;

fn value_at(array: &ArrayRef, ty: Type, i: usize) -> Value {
    if array.is_null(i) {
        return Value::Null;
    }
    match ty {
        Type::Boolean => Value::Boolean(array.as_boolean().value(i)),
        Type::Int => Value::Int(array.as_primitive::<Int32Type>().value(i)),
        // Written before the column was promoted.
        Type::Long if *array.data_type() == DataType::Int32 => {
            Value::Long(array.as_primitive::<Int32Type>().value(i).into())
        }
        Type::Long => Value::Long(array.as_primitive::<Int64Type>().value(i)),
        Type::Float => Value::Float(array.as_primitive::<Float32Type>().value(i)),
        Type::Double if *array.data_type() == DataType::Float32 => {
            Value::Double(array.as_primitive::<Float32Type>().value(i).into())
        }
        Type::Double => Value::Double(array.as_primitive::<Float64Type>().value(i)),
        Type::Decimal { .. } => Value::Decimal(array.as_primitive::<Decimal128Type>().value(i)),
        Type::Date => Value::Date(array.as_primitive::<Date32Type>().value(i)),
        Type::Time => Value::Time(array.as_primitive::<Time64MicrosecondType>().value(i)),
        Type::Timestamp => {
            Value::Timestamp(array.as_primitive::<TimestampMicrosecondType>().value(i))
        }
        Type::TimestampTz => {
            Value::TimestampTz(array.as_primitive::<TimestampMicrosecondType>().value(i))
        }
        Type::String => Value::String(str_at(array, i).to_string()),
        Type::Binary => Value::Binary(bytes_at(array, i).to_vec()),
    }
}

/// The `i`-th value of a string array. Other writers (pyarrow) use 64-bit offsets or views for
/// the same Parquet columns.
fn str_at(array: &ArrayRef, i: usize) -> &str {
    match array.data_type() {
        DataType::LargeUtf8 => array.as_string::<i64>().value(i),
        DataType::Utf8View => array.as_string_view().value(i),
        _ => array.as_string::<i32>().value(i),
    }
}

/// The `i`-th value of a binary array.
fn bytes_at(array: &ArrayRef, i: usize) -> &[u8] {
    match array.data_type() {
        DataType::LargeBinary => array.as_binary::<i64>().value(i),
        DataType::BinaryView => array.as_binary_view().value(i),
        _ => array.as_binary::<i32>().value(i),
    }
}

/// Whether [`value_at`] reads an array of `dt` as `ty`.
fn readable(dt: &DataType, ty: Type) -> bool {
    match ty {
        Type::Boolean => *dt == DataType::Boolean,
        Type::Int => *dt == DataType::Int32,
        Type::Long => matches!(dt, DataType::Int64 | DataType::Int32),
        Type::Float => *dt == DataType::Float32,
        Type::Double => matches!(dt, DataType::Float64 | DataType::Float32),
        Type::Decimal { .. } => matches!(dt, DataType::Decimal128(..)),
        Type::Date => *dt == DataType::Date32,
        Type::Time => matches!(dt, DataType::Time64(arrow_schema::TimeUnit::Microsecond)),
        Type::Timestamp | Type::TimestampTz => matches!(
            dt,
            DataType::Timestamp(arrow_schema::TimeUnit::Microsecond, _)
        ),
        Type::String => matches!(
            dt,
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
        ),
        Type::Binary => matches!(
            dt,
            DataType::Binary | DataType::LargeBinary | DataType::BinaryView
        ),
    }
}

/// Reads the named columns of a data file, row by row, in file order (so the index of a row is
/// its position). Columns are matched by name and must have the given types.
pub fn read_columns(bytes: Bytes, columns: &[(&str, Type)]) -> Result<Vec<Vec<Value>>> {
    let mut rows = Vec::new();
    for_each_batch(bytes, columns, |arrays, len| {
        for i in 0..len {
            rows.push(
                arrays
                    .iter()
                    .zip(columns)
                    .map(|(a, (_, ty))| value_at(a, *ty, i))
                    .collect(),
            );
        }
        Ok(())
    })?;
    Ok(rows)
}

/// Calls `f` with the arrays of the named columns of each batch of a file, in file order, and
/// the batch's row count.
fn for_each_batch(
    bytes: Bytes,
    columns: &[(&str, Type)],
    mut f: impl FnMut(&[ArrayRef], usize) -> Result<()>,
) -> Result<()> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes)
        .or_kind(ErrorKind::Storage, || "cannot open Parquet file".into())?;
    let schema = builder.parquet_schema();
    let mut leaves = Vec::new();
    for (name, _) in columns {
        let leaf = (0..schema.num_columns())
            .find(|i| schema.column(*i).name() == *name)
            .ok_or_else(|| Error::metadata(format!("data file has no column {name}")))?;
        leaves.push(leaf);
    }
    let mask = ProjectionMask::leaves(schema, leaves);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(8192)
        .build()
        .or_kind(ErrorKind::Storage, || "cannot read Parquet file".into())?;
    for batch in reader {
        let batch = batch.or_kind(ErrorKind::Storage, || "cannot decode Parquet batch".into())?;
        let arrays: Vec<ArrayRef> = columns
            .iter()
            .map(|(name, ty)| {
                let array = batch
                    .column_by_name(name)
                    .cloned()
                    .ok_or_else(|| Error::metadata(format!("data file has no column {name}")))?;
                if !readable(array.data_type(), *ty) {
                    return Err(Error::metadata(format!(
                        "data file column {name} holds {} where {ty} is expected",
                        array.data_type()
                    )));
                }
                Ok(array)
            })
            .collect::<Result<_>>()?;
        f(&arrays, batch.num_rows())?;
    }
    Ok(())
}

/// A column of a table to read from its data files: field id, name and type.
pub type FieldToRead<'a> = (i32, &'a str, Type);

/// Reads columns of a data file by field id, row by row in file order, as Iceberg readers do:
/// a column the file lacks (added after the file was written) reads as null, one written
/// narrower (int or float before a promotion) reads widened, and a renamed column is found by
/// its id. A file without field ids (of a writer that sets none) is matched by name.
pub fn read_fields(bytes: Bytes, fields: &[FieldToRead<'_>]) -> Result<Vec<Vec<Value>>> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes.clone())
        .or_kind(ErrorKind::Storage, || "cannot open Parquet file".into())?;
    let schema = builder.parquet_schema();
    // Top-level columns of the file: (field id, name).
    let columns: Vec<(Option<i32>, String)> = (0..schema.num_columns())
        .map(|i| schema.column(i))
        .filter(|c| c.path().parts().len() == 1)
        .map(|c| {
            let info = c.self_type().get_basic_info();
            (info.has_id().then(|| info.id()), c.name().to_string())
        })
        .collect();
    let by_id = columns.iter().any(|c| c.0.is_some());
    let found: Vec<Option<&str>> = fields
        .iter()
        .map(|(id, name, _)| {
            columns
                .iter()
                .find(|c| {
                    if by_id {
                        c.0 == Some(*id)
                    } else {
                        c.1 == *name
                    }
                })
                .map(|c| c.1.as_str())
        })
        .collect();
    let present: Vec<(&str, Type)> = found
        .iter()
        .zip(fields)
        .filter_map(|(name, f)| name.map(|n| (n, f.2)))
        .collect();
    let mut rows = read_columns(bytes, &present)?;
    if present.len() < fields.len() {
        for row in &mut rows {
            let mut read = std::mem::take(row).into_iter();
            *row = found
                .iter()
                .map(|name| match name {
                    Some(_) => read.next().unwrap_or(Value::Null),
                    None => Value::Null,
                })
                .collect();
        }
    }
    Ok(rows)
}

/// The rows of a position-delete file that name one data file, in the file's order. A
/// checkpoint's delete file names each file it touches thousands of times: the path is kept
/// once, and the versions of all rows in one buffer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeletesIn {
    pub path: String,
    positions: Vec<i64>,
    /// Where each row's version ends in `versions`; empty when the file has no `_version`
    /// column. A null version ends at `u32::MAX`.
    ends: Vec<u32>,
    versions: Vec<u8>,
}

impl DeletesIn {
    /// Rows deleted in the file.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether no row is.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Each row's position, and the version of the change that deleted it where the delete
    /// file has inlet's `_version` column.
    pub fn rows(&self) -> impl Iterator<Item = (i64, Option<&[u8]>)> + '_ {
        let mut start = 0;
        self.positions.iter().enumerate().map(move |(i, &pos)| {
            let version = self.ends.get(i).and_then(|&end| {
                if end == u32::MAX {
                    return None;
                }
                let v = self.versions.get(start..end as usize);
                start = end as usize;
                v
            });
            (pos, version)
        })
    }

    /// [`DeletesIn::rows`], owned.
    pub fn owned_rows(&self) -> impl Iterator<Item = (i64, Option<Vec<u8>>)> + '_ {
        self.rows().map(|(pos, v)| (pos, v.map(<[u8]>::to_vec)))
    }
}

/// Every row of `groups` as `(data file, position, version)` (tests compare with it).
pub fn flatten_deletes(groups: &[DeletesIn]) -> Vec<(String, i64, Option<Vec<u8>>)> {
    groups
        .iter()
        .flat_map(|d| d.owned_rows().map(|(pos, v)| (d.path.clone(), pos, v)))
        .collect()
}

/// Reads a position-delete file: its rows grouped by the data file they name, each group in
/// the file's order, with versions where the file has inlet's `_version` column.
pub fn read_position_deletes(bytes: Bytes) -> Result<Vec<DeletesIn>> {
    let has_version = ParquetRecordBatchReaderBuilder::try_new(bytes.clone())
        .or_kind(ErrorKind::Storage, || "cannot open Parquet file".into())?
        .parquet_schema()
        .columns()
        .iter()
        .any(|c| c.name() == DELETE_VERSION_COLUMN);
    let mut columns = vec![("file_path", Type::String), ("pos", Type::Long)];
    if has_version {
        columns.push((DELETE_VERSION_COLUMN, Type::Binary));
    }
    let mut groups: Vec<DeletesIn> = Vec::new();
    // Delete files are sorted by path, but a file of another writer need not be.
    let mut group_of: std::collections::HashMap<String, usize> = Default::default();
    for_each_batch(bytes, &columns, |arrays, len| {
        for i in 0..len {
            let (paths, positions) = (&arrays[0], &arrays[1]);
            let Value::Long(pos) = value_at(positions, Type::Long, i) else {
                return Err(Error::metadata("position-delete file has a null pos"));
            };
            if paths.is_null(i) {
                return Err(Error::metadata("position-delete file has a null file_path"));
            }
            let path = str_at(paths, i);
            let at = match groups.last() {
                Some(g) if g.path == path => groups.len() - 1,
                _ => *group_of.entry(path.to_string()).or_insert_with(|| {
                    groups.push(DeletesIn {
                        path: path.to_string(),
                        ..DeletesIn::default()
                    });
                    groups.len() - 1
                }),
            };
            let g = &mut groups[at];
            g.positions.push(pos);
            if let Some(versions) = arrays.get(2) {
                if versions.is_null(i) {
                    g.ends.push(u32::MAX);
                } else {
                    g.versions.extend_from_slice(bytes_at(versions, i));
                    let end = u32::try_from(g.versions.len())
                        .ok()
                        .filter(|e| *e != u32::MAX)
                        .ok_or_else(|| {
                            Error::metadata("position-delete file has over 4 GiB of versions")
                        })?;
                    g.ends.push(end);
                }
            }
        }
        Ok(())
    })?;
    Ok(groups)
}
