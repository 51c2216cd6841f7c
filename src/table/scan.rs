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

use super::types::{Type, Value};
use crate::error::{Error, ErrorKind, Result, ResultExt};

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
        // Other writers (pyarrow) use 64-bit offsets or views for the same Parquet columns.
        Type::String => Value::String(match array.data_type() {
            DataType::LargeUtf8 => array.as_string::<i64>().value(i).to_string(),
            DataType::Utf8View => array.as_string_view().value(i).to_string(),
            _ => array.as_string::<i32>().value(i).to_string(),
        }),
        Type::Binary => Value::Binary(match array.data_type() {
            DataType::LargeBinary => array.as_binary::<i64>().value(i).to_vec(),
            DataType::BinaryView => array.as_binary_view().value(i).to_vec(),
            _ => array.as_binary::<i32>().value(i).to_vec(),
        }),
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
    let mut rows = Vec::new();
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
        for i in 0..batch.num_rows() {
            rows.push(
                arrays
                    .iter()
                    .zip(columns)
                    .map(|(a, (_, ty))| value_at(a, *ty, i))
                    .collect(),
            );
        }
    }
    Ok(rows)
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

/// A position delete: the data file, the row's position, and (in inlet's delete files) the
/// version of the change that deleted it.
pub type PositionDelete = (String, i64, Option<Vec<u8>>);

/// Reads a position-delete file: `(file_path, pos, version)`, the version where the file has
/// inlet's `_version` column.
pub fn read_position_deletes(bytes: Bytes) -> Result<Vec<PositionDelete>> {
    let has_version = ParquetRecordBatchReaderBuilder::try_new(bytes.clone())
        .or_kind(ErrorKind::Storage, || "cannot open Parquet file".into())?
        .parquet_schema()
        .columns()
        .iter()
        .any(|c| c.name() == crate::write::deletes::DELETE_VERSION_COLUMN);
    let mut columns = vec![("file_path", Type::String), ("pos", Type::Long)];
    if has_version {
        columns.push((crate::write::deletes::DELETE_VERSION_COLUMN, Type::Binary));
    }
    read_columns(bytes, &columns)?
        .into_iter()
        .map(|mut row| {
            let version = match row.get_mut(2).map(|v| std::mem::replace(v, Value::Null)) {
                Some(Value::Binary(v)) => Some(v),
                _ => None,
            };
            match (&row[0], &row[1]) {
                (Value::String(p), Value::Long(pos)) => Ok((p.clone(), *pos, version)),
                _ => Err(Error::metadata(
                    "position-delete file has a null file_path or pos",
                )),
            }
        })
        .collect()
}
