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
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::table::manifest::{DataFile, FileContent};
use crate::table::types::{Type, Value};

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
    pub fn of_schema(schema: &crate::table::metadata::Schema) -> Result<Vec<WriteColumn>> {
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
    pending: Vec<Vec<Value>>,
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
        Ok(ParquetFile {
            columns,
            schema,
            writer,
            pending: Vec::with_capacity(BATCH_ROWS),
            pending_bytes: 0,
            rows: 0,
            stats,
        })
    }

    /// Appends a row (values in column order). Encodes a batch every `BATCH_ROWS` rows.
    pub fn push(&mut self, mut row: Vec<Value>) -> Result<()> {
        // Values kept from before a column was widened (rows stored in the index) take the
        // column's new type.
        for (v, c) in row.iter_mut().zip(self.columns.iter()) {
            match (c.ty, &*v) {
                (Type::Long, Value::Int(x)) => *v = Value::Long(i64::from(*x)),
                (Type::Double, Value::Float(x)) => *v = Value::Double(f64::from(*x)),
                _ => {}
            }
        }
        for (s, v) in self.stats.iter_mut().zip(&row) {
            s.update(v);
        }
        self.pending_bytes += row.iter().map(Value::approx_bytes).sum::<usize>();
        self.pending.push(row);
        self.rows += 1;
        if self.pending.len() >= BATCH_ROWS {
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
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = to_batch(&self.schema, &self.columns, &self.pending)?;
        self.writer
            .write(&batch)
            .or_kind(ErrorKind::Internal, || "cannot encode Parquet batch".into())?;
        self.pending.clear();
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

macro_rules! build {
    ($builder:expr, $rows:expr, $i:expr, $col:expr, $pat:pat => $val:expr) => {{
        let mut b = $builder;
        for row in $rows {
            match &row[$i] {
                Value::Null => b.append_null(),
                $pat => b.append_value($val),
                other => return Err(mismatch($col, other)),
            }
        }
        Arc::new(b.finish()) as ArrayRef
    }};
}

/// Builds an Arrow batch from rows whose values match the column types.
pub fn to_batch(
    schema: &Arc<ArrowSchema>,
    columns: &[WriteColumn],
    rows: &[Vec<Value>],
) -> Result<RecordBatch> {
    let n = rows.len();
    let mut arrays = Vec::with_capacity(columns.len());
    for (i, col) in columns.iter().enumerate() {
        let array = match col.ty {
            Type::Boolean => {
                build!(BooleanBuilder::with_capacity(n), rows, i, col, Value::Boolean(v) => *v)
            }
            Type::Int => build!(Int32Builder::with_capacity(n), rows, i, col, Value::Int(v) => *v),
            Type::Long => {
                build!(Int64Builder::with_capacity(n), rows, i, col, Value::Long(v) => *v)
            }
            Type::Float => {
                build!(Float32Builder::with_capacity(n), rows, i, col, Value::Float(v) => *v)
            }
            Type::Double => {
                build!(Float64Builder::with_capacity(n), rows, i, col, Value::Double(v) => *v)
            }
            Type::Decimal { precision, scale } => build!(
                Decimal128Builder::with_capacity(n)
                    .with_precision_and_scale(precision, scale as i8)
                    .or_kind(ErrorKind::Internal, || format!("bad decimal type {}", col.ty))?,
                rows, i, col, Value::Decimal(v) => *v),
            Type::Date => {
                build!(Date32Builder::with_capacity(n), rows, i, col, Value::Date(v) => *v)
            }
            Type::Time => {
                build!(Time64MicrosecondBuilder::with_capacity(n), rows, i, col, Value::Time(v) => *v)
            }
            Type::Timestamp => {
                build!(TimestampMicrosecondBuilder::with_capacity(n), rows, i, col, Value::Timestamp(v) => *v)
            }
            Type::TimestampTz => build!(
                TimestampMicrosecondBuilder::with_capacity(n).with_timezone("+00:00"),
                rows, i, col, Value::TimestampTz(v) => *v),
            Type::String => {
                build!(StringBuilder::with_capacity(n, n * 16), rows, i, col, Value::String(v) => v)
            }
            Type::Binary => {
                build!(BinaryBuilder::with_capacity(n, n * 16), rows, i, col, Value::Binary(v) => v)
            }
        };
        arrays.push(array);
    }
    RecordBatch::try_new(schema.clone(), arrays).or_kind(ErrorKind::Internal, || {
        "cannot assemble an Arrow batch".into()
    })
}
