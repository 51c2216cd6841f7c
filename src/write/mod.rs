//! Writing: a partition fan-out over rolling Parquet files. Each closed file becomes a plain
//! `DataFile` value (path, partition, counts, stats) plus its bytes, for the committer.

pub mod cap;
pub mod deletes;
pub mod parquet;
pub mod stats;

use std::collections::HashMap;
use std::sync::Arc;

use inlet_common::error::{Error, ErrorKind, Result};
use inlet_iceberg::manifest::{DataFile, FileContent};
use inlet_iceberg::transform::{escape_path_value, Transform};
use inlet_iceberg::types::Value;
use parquet::{ParquetFile, WriteColumn};

/// A finished data file: its manifest description and its content.
pub struct WrittenFile {
    pub data_file: DataFile,
    pub bytes: Vec<u8>,
    /// The writer's number for the file, as `DataWriter::write_to` reported it.
    pub slot: u64,
}

/// A partition field as the writer applies it.
#[derive(Debug, Clone)]
pub struct PartitionColumn {
    /// Index of the source column in the row.
    pub source: usize,
    pub transform: Transform,
    pub name: String,
}

struct OpenFile {
    partition: Vec<Value>,
    path: String,
    slot: u64,
    file: ParquetFile,
}

/// Fans rows out to one rolling Parquet file per partition.
pub struct DataWriter {
    columns: Arc<[WriteColumn]>,
    partition: Vec<PartitionColumn>,
    data_location: String,
    target_file_bytes: usize,
    /// By the partition values (encoded) and bucket of the rows they take: a row finds its
    /// file without naming its partition.
    open: HashMap<Vec<u8>, OpenFile>,
    /// Where a row's file key is encoded.
    scratch: Vec<u8>,
    finished: Vec<WrittenFile>,
    finished_bytes: usize,
    /// The caller's part of file names, before each writer's own unique part.
    name_prefix: String,
    file_prefix: String,
    file_seq: u64,
}

impl DataWriter {
    /// A writer for files under `{table_location}/data`, named `{file_prefix}-<uuid>-<n>`.
    pub fn new(
        columns: Vec<WriteColumn>,
        partition: Vec<PartitionColumn>,
        table_location: &str,
        target_file_bytes: u64,
        file_prefix: &str,
    ) -> Self {
        DataWriter {
            columns: columns.into(),
            partition,
            data_location: format!("{table_location}/data"),
            target_file_bytes: target_file_bytes as usize,
            open: HashMap::new(),
            scratch: Vec::new(),
            finished: Vec::new(),
            finished_bytes: 0,
            name_prefix: file_prefix.to_string(),
            file_prefix: format!("{file_prefix}{}", uuid::Uuid::new_v4()),
            file_seq: 0,
        }
    }

    /// The partition values of a row and its Hive-style relative path.
    pub fn partition_of(&self, row: &[Value]) -> (Vec<Value>, String) {
        let mut values = Vec::with_capacity(self.partition.len());
        let mut path = String::new();
        for p in &self.partition {
            let v = p.transform.apply(&row[p.source]);
            if !path.is_empty() {
                path.push('/');
            }
            path.push_str(&escape_path_value(&p.name));
            path.push('=');
            path.push_str(&escape_path_value(&p.transform.to_human_string(&v)));
            values.push(v);
        }
        (values, path)
    }

    /// The partition values of a row.
    pub fn partition_values(&self, row: &[Value]) -> Vec<Value> {
        let mut values = Vec::with_capacity(self.partition.len());
        self.partition_values_into(row, &mut values);
        values
    }

    /// [`DataWriter::partition_values`] into `out`, in place of what it held.
    pub fn partition_values_into(&self, row: &[Value], out: &mut Vec<Value>) {
        out.clear();
        out.extend(
            self.partition
                .iter()
                .map(|p| p.transform.apply(&row[p.source])),
        );
    }

    /// Takes the rows written so far (open and finished files) out as a writer of their own,
    /// to close on another thread; this one goes on with new files of the same layout.
    pub fn detach(&mut self) -> DataWriter {
        let mut fresh = DataWriter {
            columns: self.columns.clone(),
            partition: self.partition.clone(),
            data_location: self.data_location.clone(),
            target_file_bytes: self.target_file_bytes,
            open: HashMap::new(),
            scratch: Vec::new(),
            finished: Vec::new(),
            finished_bytes: 0,
            // Names stay unique: the new writer has a new uuid of its own.
            file_prefix: format!("{}{}", self.name_prefix, uuid::Uuid::new_v4()),
            name_prefix: self.name_prefix.clone(),
            file_seq: 0,
        };
        std::mem::swap(self, &mut fresh);
        fresh
    }

    /// Partition values as the current schema types them: values recorded before a source
    /// column was widened (int → long, float → double) are widened alike.
    pub fn promote_partition(&self, values: &mut [Value]) {
        for (v, p) in values.iter_mut().zip(&self.partition) {
            let source = self.columns.get(p.source).map(|c| c.ty);
            let Some(ty) = source.and_then(|t| p.transform.result_type(t).ok()) else {
                continue;
            };
            *v = match (std::mem::replace(v, Value::Null), ty) {
                (Value::Int(i), inlet_iceberg::types::Type::Long) => Value::Long(i64::from(i)),
                (Value::Float(f), inlet_iceberg::types::Type::Double) => {
                    Value::Double(f64::from(f))
                }
                (other, _) => other,
            };
        }
    }

    /// Appends a row to the file of its partition, rolling the file at the target size.
    pub fn write(&mut self, mut row: Vec<Value>) -> Result<()> {
        self.write_to(&mut row, None).map(|_| ())
    }

    /// Appends a row to the file of its partition and `bucket` (a `bucket-N` directory below
    /// the partition); returns the file's slot and the row's position in it.
    pub fn write_to(&mut self, row: &mut [Value], bucket: Option<u32>) -> Result<(u64, u64)> {
        if row.len() != self.columns.len() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "row has {} values, table has {} columns",
                    row.len(),
                    self.columns.len()
                ),
            ));
        }
        let mut key = std::mem::take(&mut self.scratch);
        key.clear();
        for p in &self.partition {
            let v = p.transform.apply(&row[p.source]);
            inlet_iceberg::types::encode_values_into([&v], &mut key);
        }
        key.extend_from_slice(&bucket.map_or(0, |b| u64::from(b) + 1).to_be_bytes());
        let file = match self.open.get_mut(key.as_slice()) {
            Some(file) => file,
            None => {
                let (values, mut path) = self.partition_of(row);
                if let Some(b) = bucket {
                    if !path.is_empty() {
                        path.push('/');
                    }
                    path.push_str(&format!("bucket-{b}"));
                }
                self.file_seq += 1;
                let file = OpenFile {
                    partition: values,
                    path,
                    slot: self.file_seq,
                    file: ParquetFile::new(self.columns.clone())?,
                };
                self.open.entry(key.clone()).or_insert(file)
            }
        };
        let position = file.file.rows() as u64;
        let slot = file.slot;
        file.file.push(row)?;
        if file.file.estimated_bytes() >= self.target_file_bytes {
            if let Some(f) = self.open.remove(key.as_slice()) {
                self.finish_file(f)?;
            }
        }
        self.scratch = key;
        Ok((slot, position))
    }

    fn finish_file(&mut self, f: OpenFile) -> Result<()> {
        if f.file.rows() == 0 {
            return Ok(());
        }
        let (bytes, m) = f.file.finish()?;
        let dir = if f.path.is_empty() {
            self.data_location.clone()
        } else {
            format!("{}/{}", self.data_location, f.path)
        };
        let file_path = format!("{dir}/{}-{:05}.parquet", self.file_prefix, f.slot);
        self.finished_bytes += bytes.len();
        let data_file = m.into_data_file(FileContent::Data, file_path, f.partition, bytes.len());
        self.finished.push(WrittenFile {
            data_file,
            bytes,
            slot: f.slot,
        });
        Ok(())
    }

    /// Files finished by rolling since the last call; upload them early to free memory.
    pub fn take_finished(&mut self) -> Vec<WrittenFile> {
        self.finished_bytes = 0;
        std::mem::take(&mut self.finished)
    }

    /// Finishes every open file and returns all files not yet taken.
    pub fn close(&mut self) -> Result<Vec<WrittenFile>> {
        let mut open: Vec<OpenFile> = self.open.drain().map(|(_, f)| f).collect();
        open.sort_by(|a, b| a.path.cmp(&b.path));
        for f in open {
            self.finish_file(f)?;
        }
        Ok(self.take_finished())
    }

    /// Finishes every open file and writes later rows with `columns`, partitioned by
    /// `partition` (the table's schema changed: columns added, widened, or dropped and renamed
    /// by another engine, which may move partition sources).
    pub fn change_columns(
        &mut self,
        columns: Vec<WriteColumn>,
        partition: Vec<PartitionColumn>,
    ) -> Result<()> {
        let mut open: Vec<OpenFile> = self.open.drain().map(|(_, f)| f).collect();
        open.sort_by(|a, b| a.path.cmp(&b.path));
        for f in open {
            self.finish_file(f)?;
        }
        self.columns = columns.into();
        self.partition = partition;
        Ok(())
    }

    /// Fills nulls in required columns with the type's zero value, for rows written only to be
    /// deleted in the same snapshot (a delete's before image may hold just the key).
    pub fn fill_required(&self, row: &mut [Value]) {
        for (value, column) in row.iter_mut().zip(self.columns.iter()) {
            if column.required && value.is_null() {
                *value = column.ty.zero();
            }
        }
    }

    /// How many columns rows must have.
    pub fn column_count(&self) -> usize {
        self.columns.len()
    }

    /// Drops everything buffered (used when the records will be read again).
    pub fn abort(&mut self) {
        self.open.clear();
        self.finished.clear();
        self.finished_bytes = 0;
    }

    /// Bytes held in memory: open files plus finished files not yet taken.
    pub fn buffered_bytes(&self) -> usize {
        self.finished_bytes
            + self
                .open
                .values()
                .map(|f| f.file.estimated_bytes())
                .sum::<usize>()
    }
}

/// Whether a file changes what the index of `shard` holds: a data file of the shard's or of
/// another engine (whose rows every shard's index takes), or a delete file naming one (or not
/// saying which file it names).
pub fn touches_shard(shard: u32, f: &DataFile) -> bool {
    let reads = |path: &str| file_shard(path).is_none_or(|s| s == shard);
    match f.content {
        FileContent::Data => reads(&f.file_path),
        _ => deletes::may_name(f, shard, reads),
    }
}

/// Data files of shard `s` are named `s<s>-...`, so the shard's files can be found again.
pub fn shard_file_prefix(shard: u32) -> String {
    format!("s{shard:05}")
}

/// The shard whose prefix a data file's name carries; `None` for files another engine wrote.
pub fn file_shard(path: &str) -> Option<u32> {
    let name = path.rsplit('/').next()?;
    let digits = name.strip_prefix('s')?.get(..5)?;
    if name.as_bytes().get(6) != Some(&b'-') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}
