//! The physical file writer: rows → Arrow batches → one in-memory Parquet file (zstd) with
//! Iceberg field ids, closing into the bytes plus the manifest metrics of the file.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arrow_array::builder::{
    BinaryBuilder, BooleanBuilder, Date32Builder, Decimal128Builder, Float32Builder,
    Float64Builder, Int32Builder, Int64Builder, StringBuilder, Time64MicrosecondBuilder,
    TimestampMicrosecondBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{Field, Schema as ArrowSchema};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use super::stats::ColumnStats;
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_iceberg::manifest::{DataFile, FileContent};
use inlet_iceberg::types::{Type, Value};

/// Rows are encoded in batches of this many.
const BATCH_ROWS: usize = 8192;

/// A table column as the writer needs it.
#[derive(Debug, Clone)]
pub struct WriteColumn {
    pub field_id: i32,
    pub name: String,
    pub ty: Type,
    pub required: bool,
}

impl WriteColumn {
    /// The columns of `schema`, in its order.
    pub fn of_schema(schema: &inlet_iceberg::metadata::Schema) -> Result<Vec<WriteColumn>> {
        schema
            .fields
            .iter()
            .map(|f| {
                Ok(WriteColumn {
                    field_id: f.id,
                    name: f.name.clone(),
                    ty: f.primitive()?,
                    required: f.required,
                })
            })
            .collect()
    }
}

/// The Arrow schema of data files, with `PARQUET:field_id` on every field.
pub fn arrow_schema(columns: &[WriteColumn]) -> Arc<ArrowSchema> {
    let fields: Vec<Field> = columns
        .iter()
        .map(|c| {
            Field::new(&c.name, c.ty.arrow_type(), !c.required).with_metadata(HashMap::from([(
                "PARQUET:field_id".to_string(),
                c.field_id.to_string(),
            )]))
        })
        .collect();
    Arc::new(ArrowSchema::new(fields))
}

/// Metrics of a closed file, in manifest terms.
#[derive(Debug, Clone, Default)]
pub struct FileMetrics {
    pub record_count: i64,
    pub column_sizes: BTreeMap<i32, i64>,
    pub value_counts: BTreeMap<i32, i64>,
    pub null_value_counts: BTreeMap<i32, i64>,
    pub nan_value_counts: BTreeMap<i32, i64>,
    pub lower_bounds: BTreeMap<i32, Vec<u8>>,
    pub upper_bounds: BTreeMap<i32, Vec<u8>>,
    pub split_offsets: Vec<i64>,
}

impl FileMetrics {
    /// The manifest description of a file of `size` bytes with these metrics.
    pub fn into_data_file(
        self,
        content: FileContent,
        file_path: String,
        partition: Vec<Value>,
        size: usize,
    ) -> DataFile {
        DataFile {
            content,
            file_path,
            file_format: "PARQUET".into(),
            partition,
            record_count: self.record_count,
            file_size_in_bytes: size as i64,
            column_sizes: self.column_sizes,
            value_counts: self.value_counts,
            null_value_counts: self.null_value_counts,
            nan_value_counts: self.nan_value_counts,
            lower_bounds: self.lower_bounds,
            upper_bounds: self.upper_bounds,
            split_offsets: Some(self.split_offsets),
            sort_order_id: None,
        }
    }
}

/// One Parquet file being written in memory.
pub struct ParquetFile {
    columns: Arc<[WriteColumn]>,
    schema: Arc<ArrowSchema>,
    writer: ArrowWriter<Vec<u8>>,
    /// The batch being gathered, a builder per column: a row's values go straight into them.
    builders: Vec<ColumnBuilder>,
    /// Rows in the builders, and about the bytes they hold.
    pending: usize,
    pending_bytes: usize,
    rows: i64,
    stats: Vec<ColumnStats>,
}

impl ParquetFile {
    /// Starts a file.
    pub fn new(columns: Arc<[WriteColumn]>) -> Result<Self> {
        let schema = arrow_schema(&columns);
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::default()))
            .set_created_by(concat!("inlet ", env!("CARGO_PKG_VERSION")).to_string())
            .build();
        let writer = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(props))
            .or_kind(ErrorKind::Internal, || {
                "cannot start a Parquet writer".into()
            })?;
        let stats = vec![ColumnStats::default(); columns.len()];
        let builders = columns
            .iter()
            .map(ColumnBuilder::new)
            .collect::<Result<_>>()?;
        Ok(ParquetFile {
            columns,
            schema,
            writer,
            builders,
            pending: 0,
            pending_bytes: 0,
            rows: 0,
            stats,
        })
    }

    /// Appends a row (values in column order). Encodes a batch every `BATCH_ROWS` rows. The
    /// row is the caller's to reuse: values widened to their column's type stay widened.
    pub fn push(&mut self, row: &mut [Value]) -> Result<()> {
        // Values kept from before a column was widened (rows stored in the index) take the
        // column's new type.
        for (v, c) in row.iter_mut().zip(self.columns.iter()) {
            match (c.ty, &*v) {
                (Type::Long, Value::Int(x)) => *v = Value::Long(i64::from(*x)),
                (Type::Double, Value::Float(x)) => *v = Value::Double(f64::from(*x)),
                _ => {}
            }
        }
        // Checked whole before any builder takes a value, so the builders stay level.
        if let Some((c, v)) = self.columns.iter().zip(&*row).find(|(c, v)| !c.ty.holds(v)) {
            return Err(mismatch(c, v));
        }
        for (s, v) in self.stats.iter_mut().zip(&*row) {
            s.update(v);
        }
        self.pending_bytes += row.iter().map(Value::approx_bytes).sum::<usize>();
        for (b, v) in self.builders.iter_mut().zip(&*row) {
            b.append(v);
        }
        self.pending += 1;
        self.rows += 1;
        if self.pending >= BATCH_ROWS {
            self.flush_batch()?;
        }
        Ok(())
    }

    /// Rows appended so far.
    pub fn rows(&self) -> i64 {
        self.rows
    }

    /// Bytes this file occupies now: encoded data plus buffered rows.
    pub fn estimated_bytes(&self) -> usize {
        self.writer.bytes_written() + self.writer.in_progress_size() + self.pending_bytes
    }

    fn flush_batch(&mut self) -> Result<()> {
        if self.pending == 0 {
            return Ok(());
        }
        let arrays = self
            .builders
            .iter_mut()
            .map(ColumnBuilder::finish)
            .collect();
        let batch = RecordBatch::try_new(self.schema.clone(), arrays)
            .or_kind(ErrorKind::Internal, || {
                "cannot assemble an Arrow batch".into()
            })?;
        self.writer
            .write(&batch)
            .or_kind(ErrorKind::Internal, || "cannot encode Parquet batch".into())?;
        self.pending = 0;
        self.pending_bytes = 0;
        Ok(())
    }

    /// Finishes the file: its bytes and metrics.
    pub fn finish(mut self) -> Result<(Vec<u8>, FileMetrics)> {
        self.flush_batch()?;
        let meta = self
            .writer
            .finish()
            .or_kind(ErrorKind::Internal, || "cannot finish Parquet file".into())?;
        let bytes = std::mem::take(self.writer.inner_mut());
        let mut m = FileMetrics {
            record_count: self.rows,
            ..FileMetrics::default()
        };
        for rg in meta.row_groups() {
            if let Some(offset) = rg
                .file_offset()
                .or_else(|| rg.columns().first().map(|c| c.file_offset()))
            {
                m.split_offsets.push(offset);
            }
            for (i, col) in rg.columns().iter().enumerate() {
                *m.column_sizes.entry(self.columns[i].field_id).or_default() +=
                    col.compressed_size();
            }
        }
        for (c, s) in self.columns.iter().zip(&self.stats) {
            m.value_counts.insert(c.field_id, s.values);
            m.null_value_counts.insert(c.field_id, s.nulls);
            if matches!(c.ty, Type::Float | Type::Double) {
                m.nan_value_counts.insert(c.field_id, s.nans);
            }
            if let Some(b) = s.lower_bound() {
                m.lower_bounds.insert(c.field_id, b);
            }
            if let Some(b) = s.upper_bound() {
                m.upper_bounds.insert(c.field_id, b);
            }
        }
        Ok((bytes, m))
    }
}

fn mismatch(col: &WriteColumn, v: &Value) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!(
            "value {v:?} does not match column {} of type {}",
            col.name, col.ty
        ),
    )
}

/// One column of the batch being gathered, in the Arrow builder of its type.
enum ColumnBuilder {
    Boolean(BooleanBuilder),
    Int(Int32Builder),
    Long(Int64Builder),
    Float(Float32Builder),
    Double(Float64Builder),
    Decimal(Decimal128Builder),
    Date(Date32Builder),
    Time(Time64MicrosecondBuilder),
    Timestamp(TimestampMicrosecondBuilder),
    String(StringBuilder),
    Binary(BinaryBuilder),
}

impl ColumnBuilder {
    fn new(col: &WriteColumn) -> Result<ColumnBuilder> {
        Ok(match col.ty {
            Type::Boolean => ColumnBuilder::Boolean(BooleanBuilder::new()),
            Type::Int => ColumnBuilder::Int(Int32Builder::new()),
            Type::Long => ColumnBuilder::Long(Int64Builder::new()),
            Type::Float => ColumnBuilder::Float(Float32Builder::new()),
            Type::Double => ColumnBuilder::Double(Float64Builder::new()),
            Type::Decimal { precision, scale } => ColumnBuilder::Decimal(
                Decimal128Builder::new()
                    .with_precision_and_scale(precision, scale as i8)
                    .or_kind(ErrorKind::Internal, || {
                        format!("bad decimal type {}", col.ty)
                    })?,
            ),
            Type::Date => ColumnBuilder::Date(Date32Builder::new()),
            Type::Time => ColumnBuilder::Time(Time64MicrosecondBuilder::new()),
            Type::Timestamp => ColumnBuilder::Timestamp(TimestampMicrosecondBuilder::new()),
            Type::TimestampTz => {
                ColumnBuilder::Timestamp(TimestampMicrosecondBuilder::new().with_timezone("+00:00"))
            }
            Type::String => ColumnBuilder::String(StringBuilder::new()),
            Type::Binary => ColumnBuilder::Binary(BinaryBuilder::new()),
        })
    }

    /// Appends a value the column's type holds ([`Type::holds`]); anything else is null.
    fn append(&mut self, v: &Value) {
        match (self, v) {
            (ColumnBuilder::Boolean(b), Value::Boolean(x)) => b.append_value(*x),
            (ColumnBuilder::Int(b), Value::Int(x)) => b.append_value(*x),
            (ColumnBuilder::Long(b), Value::Long(x)) => b.append_value(*x),
            (ColumnBuilder::Float(b), Value::Float(x)) => b.append_value(*x),
            (ColumnBuilder::Double(b), Value::Double(x)) => b.append_value(*x),
            (ColumnBuilder::Decimal(b), Value::Decimal(x)) => b.append_value(*x),
            (ColumnBuilder::Date(b), Value::Date(x)) => b.append_value(*x),
            (ColumnBuilder::Time(b), Value::Time(x)) => b.append_value(*x),
            (ColumnBuilder::Timestamp(b), Value::Timestamp(x) | Value::TimestampTz(x)) => {
                b.append_value(*x)
            }
            (ColumnBuilder::String(b), Value::String(x)) => b.append_value(x),
            (ColumnBuilder::Binary(b), Value::Binary(x)) => b.append_value(x),
            (b, _) => b.append_null(),
        }
    }

    fn append_null(&mut self) {
        match self {
            ColumnBuilder::Boolean(b) => b.append_null(),
            ColumnBuilder::Int(b) => b.append_null(),
            ColumnBuilder::Long(b) => b.append_null(),
            ColumnBuilder::Float(b) => b.append_null(),
            ColumnBuilder::Double(b) => b.append_null(),
            ColumnBuilder::Decimal(b) => b.append_null(),
            ColumnBuilder::Date(b) => b.append_null(),
            ColumnBuilder::Time(b) => b.append_null(),
            ColumnBuilder::Timestamp(b) => b.append_null(),
            ColumnBuilder::String(b) => b.append_null(),
            ColumnBuilder::Binary(b) => b.append_null(),
        }
    }

    /// The values appended since the last call, as an array; the builder starts empty.
    fn finish(&mut self) -> ArrayRef {
        match self {
            ColumnBuilder::Boolean(b) => Arc::new(b.finish()),
            ColumnBuilder::Int(b) => Arc::new(b.finish()),
            ColumnBuilder::Long(b) => Arc::new(b.finish()),
            ColumnBuilder::Float(b) => Arc::new(b.finish()),
            ColumnBuilder::Double(b) => Arc::new(b.finish()),
            ColumnBuilder::Decimal(b) => Arc::new(b.finish()),
            ColumnBuilder::Date(b) => Arc::new(b.finish()),
            ColumnBuilder::Time(b) => Arc::new(b.finish()),
            ColumnBuilder::Timestamp(b) => Arc::new(b.finish()),
            ColumnBuilder::String(b) => Arc::new(b.finish()),
            ColumnBuilder::Binary(b) => Arc::new(b.finish()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(field_id: i32, ty: Type) -> WriteColumn {
        WriteColumn {
            field_id,
            name: format!("c{field_id}"),
            ty,
            required: false,
        }
    }

    /// A value of `ty` for row `i`.
    fn value(ty: Type, i: i64) -> Value {
        match ty {
            Type::Boolean => Value::Boolean(i % 3 == 0),
            Type::Int => Value::Int(i as i32),
            Type::Long => Value::Long(-i),
            Type::Float => Value::Float(i as f32 / 2.0),
            Type::Double => Value::Double(i as f64 / 4.0),
            Type::Decimal { .. } => Value::Decimal(i as i128 * 100 + 1),
            Type::Date => Value::Date(i as i32),
            Type::Time => Value::Time(i * 1_000),
            Type::Timestamp => Value::Timestamp(i * 1_000_000),
            Type::TimestampTz => Value::TimestampTz(-i * 1_000_000),
            Type::String => Value::String(format!("s{i}")),
            Type::Binary => Value::Binary(i.to_be_bytes().to_vec()),
        }
    }

    /// Row `i` of every type, nulls in turn, so each column's builder sees both.
    fn row(i: i64) -> Vec<Value> {
        let types = inlet_decode::fuzzing::TYPES;
        let null_at = i as usize % (types.len() + 1);
        (0..)
            .zip(types)
            .map(|(at, ty)| {
                if at == null_at {
                    Value::Null
                } else {
                    value(ty, i)
                }
            })
            .collect()
    }

    #[test]
    fn rows_read_back_across_batches_and_a_rejected_row_leaves_nothing() {
        let columns: Vec<WriteColumn> = (1..)
            .zip(inlet_decode::fuzzing::TYPES)
            .map(|(id, ty)| column(id, ty))
            .collect();
        let mut file = ParquetFile::new(columns.clone().into()).unwrap();
        // Two full batches and part of a third: builders are reused after each batch.
        let n = 2 * BATCH_ROWS as i64 + 77;
        for i in 0..n {
            file.push(&mut row(i)).unwrap();
            if i == 5 {
                // A string where a long goes: refused before any column takes a value.
                let mut bad = row(i);
                bad[2] = Value::String("x".into());
                assert!(file.push(&mut bad).is_err());
            }
        }
        assert_eq!(file.rows(), n);
        let (bytes, metrics) = file.finish().unwrap();
        assert_eq!(metrics.record_count, n);
        let asked: Vec<(&str, Type)> = columns.iter().map(|c| (c.name.as_str(), c.ty)).collect();
        let back = inlet_iceberg::scan::read_columns(bytes.into(), &asked).unwrap();
        let expected: Vec<Vec<Value>> = (0..n).map(row).collect();
        assert_eq!(back.len(), expected.len());
        assert!(back == expected, "rows read back differ");
    }
}
