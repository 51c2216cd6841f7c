//! The logical position-delete writer. A shard's deletes of rows in its own data files go to one
//! Parquet file per partition per checkpoint, named with the shard's prefix and placed in the
//! partition's directory: updates of random keys delete rows in nearly every data file of a
//! partition, and a file per data file would add as many delete files per checkpoint as the
//! partition has data files. Deletes of rows in another engine's files, which every shard's
//! index reads, get one file per data file, as Iceberg's `write.delete.granularity=file` does.
//! Rows are `(file_path, pos, _version)` sorted by path and position, and the `file_path`
//! bounds are exact, so a reader tells which files a delete file may name.
//!
//! `_version` is inlet's own column, beyond the spec's `file_path` and `pos`: the version of the
//! change that deleted the row. A key deleted after its last committed row keeps the delete's
//! version in the table this way, so an index rebuilt from the table holds the same tombstone
//! as the one that wrote it. Readers select `file_path` and `pos` by field id and ignore it.

use std::sync::Arc;

use super::parquet::{ParquetFile, WriteColumn};
use super::WrittenFile;
use inlet_common::error::Result;
use inlet_iceberg::keys::{DELETE_VERSION_COLUMN, DELETE_VERSION_ID};
use inlet_iceberg::manifest::FileContent;
use inlet_iceberg::scan::{FILE_PATH_ID, POS_ID};
use inlet_iceberg::types::{Type, Value};

fn columns() -> Arc<[WriteColumn]> {
    Arc::from(vec![
        WriteColumn {
            field_id: FILE_PATH_ID,
            name: "file_path".into(),
            ty: Type::String,
            required: true,
        },
        WriteColumn {
            field_id: POS_ID,
            name: "pos".into(),
            ty: Type::Long,
            required: true,
        },
        WriteColumn {
            field_id: DELETE_VERSION_ID,
            name: DELETE_VERSION_COLUMN.into(),
            ty: Type::Binary,
            required: false,
        },
    ])
}

/// The data file a position-delete file names, when it names exactly one (its `file_path`
/// bounds are equal, as inlet writes them).
pub fn target_of(f: &inlet_iceberg::manifest::DataFile) -> Option<&str> {
    let lower = f.lower_bounds.get(&FILE_PATH_ID)?;
    if f.upper_bounds.get(&FILE_PATH_ID) != Some(lower) {
        return None;
    }
    std::str::from_utf8(lower).ok()
}

/// Which data files a position-delete file may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Names<'a> {
    /// Exactly this one.
    File(&'a str),
    /// Files of this shard in the bucket directories of the delete file's own directory (its
    /// partition's): a shard's grouped delete file.
    ShardFiles(u32),
    /// Any file: another engine's delete file.
    Any,
}

/// Which data files the position-delete file `f` may name.
pub fn names(f: &inlet_iceberg::manifest::DataFile) -> Names<'_> {
    if let Some(target) = target_of(f) {
        return Names::File(target);
    }
    match super::file_shard(&f.file_path) {
        Some(shard) => Names::ShardFiles(shard),
        None => Names::Any,
    }
}

/// Whether the position-delete file `f` may name a file that `reads` accepts, given that
/// `reads` accepts the files of `shard` only among inlet's own.
pub fn may_name(
    f: &inlet_iceberg::manifest::DataFile,
    shard: u32,
    reads: impl Fn(&str) -> bool,
) -> bool {
    match names(f) {
        Names::File(target) => reads(target),
        Names::ShardFiles(s) => s == shard,
        Names::Any => true,
    }
}

/// The data files a position-delete file names, with how many of their rows it deletes.
pub fn count_targets(bytes: bytes::Bytes) -> Result<Vec<(String, i64)>> {
    let mut counts: std::collections::BTreeMap<String, i64> = Default::default();
    for d in inlet_iceberg::scan::read_position_deletes(bytes)? {
        *counts.entry(d.path.clone()).or_default() += d.len() as i64;
    }
    Ok(counts.into_iter().collect())
}

/// The directory of a partition of inlet's data file `data_path` (which sits in a bucket
/// directory of its partition's).
pub fn partition_dir(data_path: &str) -> &str {
    let bucket_dir = data_path.rsplit_once('/').map_or("", |(d, _)| d);
    bucket_dir.rsplit_once('/').map_or(bucket_dir, |(d, _)| d)
}

/// One row of a position-delete file, reused from row to row: the path is copied only when it
/// changes, and the version into the buffer of the last.
struct DeleteRow([Value; 3]);

impl Default for DeleteRow {
    fn default() -> Self {
        DeleteRow([
            Value::String(String::new()),
            Value::Long(0),
            Value::Binary(Vec::new()),
        ])
    }
}

impl DeleteRow {
    fn set(&mut self, path: &str, pos: u64, version: &[u8]) -> &mut [Value] {
        let [p, position, v] = &mut self.0;
        match p {
            Value::String(p) if p == path => {}
            p => *p = Value::String(path.to_owned()),
        }
        *position = Value::Long(pos as i64);
        match v {
            Value::Binary(v) => {
                v.clear();
                v.extend_from_slice(version);
            }
            v => *v = Value::Binary(version.to_vec()),
        }
        &mut self.0
    }
}

/// Writes shard `shard`'s deletes in its own data files of one partition, `rows` as
/// `(data file, position, version)` in file and position order, into one file in the
/// partition's directory `dir`, named with the shard's prefix and `tag`.
pub fn write_grouped_deletes<'a>(
    dir: &str,
    shard: u32,
    partition: Vec<Value>,
    rows: impl IntoIterator<Item = (&'a str, u64, &'a [u8])>,
    tag: &str,
) -> Result<WrittenFile> {
    let mut file = ParquetFile::new(columns())?;
    let mut bounds: Option<(&str, &str)> = None;
    let mut row = DeleteRow::default();
    for (path, pos, version) in rows {
        let first = bounds.map_or(path, |(first, _)| first);
        bounds = Some((first, path));
        file.push(row.set(path, pos, version))?;
    }
    let (bytes, mut m) = file.finish()?;
    // Full paths, never truncated: equal bounds mean exactly one file.
    if let Some((first, last)) = bounds {
        m.lower_bounds
            .insert(FILE_PATH_ID, first.as_bytes().to_vec());
        m.upper_bounds
            .insert(FILE_PATH_ID, last.as_bytes().to_vec());
    }
    let file_path = format!(
        "{dir}/{}-deletes-{tag}.parquet",
        super::shard_file_prefix(shard)
    );
    Ok(WrittenFile {
        data_file: m.into_data_file(
            FileContent::PositionDeletes,
            file_path,
            partition,
            bytes.len(),
        ),
        bytes,
        slot: 0,
    })
}

/// Writes the deletes of `positions` (each with the version of the change that deleted the
/// row) in the data file `data_path`, whose partition is `partition`. The delete file sits next
/// to the data file, named after it and `tag`.
pub fn write_position_deletes(
    data_path: &str,
    partition: Vec<Value>,
    positions: &mut [(u64, Vec<u8>)],
    tag: &str,
) -> Result<WrittenFile> {
    positions.sort_unstable();
    let mut file = ParquetFile::new(columns())?;
    let mut row = DeleteRow::default();
    for (pos, version) in positions.iter() {
        file.push(row.set(data_path, *pos, version))?;
    }
    let (bytes, mut m) = file.finish()?;
    // Bounds of file_path are the full path, never truncated: readers match them exactly.
    m.lower_bounds
        .insert(FILE_PATH_ID, data_path.as_bytes().to_vec());
    m.upper_bounds
        .insert(FILE_PATH_ID, data_path.as_bytes().to_vec());
    let stem = data_path.strip_suffix(".parquet").unwrap_or(data_path);
    let file_path = format!("{stem}-deletes-{tag}.parquet");
    Ok(WrittenFile {
        data_file: m.into_data_file(
            FileContent::PositionDeletes,
            file_path,
            partition,
            bytes.len(),
        ),
        bytes,
        slot: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows are grouped by the file they name even when another writer did not sort them, and
    /// each keeps its own version, a null one included.
    #[test]
    fn delete_rows_read_back_grouped_by_file_with_their_versions() {
        let (a, b) = ("s3://b/t/data/a.parquet", "s3://b/t/data/b.parquet");
        let mut file = ParquetFile::new(columns()).unwrap();
        for (path, pos, version) in [
            (b, 7, Value::Binary(vec![1, 2, 3])),
            (a, 2, Value::Null),
            (b, 1, Value::Binary(vec![])),
            (a, 5, Value::Binary(vec![9])),
            (b, 3, Value::Binary(vec![4, 5])),
        ] {
            file.push(&mut [Value::String(path.into()), Value::Long(pos), version])
                .unwrap();
        }
        let (bytes, _) = file.finish().unwrap();
        let groups = inlet_iceberg::scan::read_position_deletes(bytes.into()).unwrap();
        let paths: Vec<&str> = groups.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(paths, [b, a]);
        let rows = |d: &inlet_iceberg::scan::DeletesIn| d.owned_rows().collect::<Vec<_>>();
        assert_eq!(
            rows(&groups[0]),
            [
                (7, Some(vec![1, 2, 3])),
                (1, Some(vec![])),
                (3, Some(vec![4, 5]))
            ]
        );
        assert_eq!(rows(&groups[1]), [(2, None), (5, Some(vec![9]))]);
        assert_eq!(groups[0].len(), 3);
    }

    /// A shard's deletes of one partition: one file in the partition's directory, named by the
    /// shard, rows sorted by file and position, bounds spanning the files it names.
    #[test]
    fn grouped_delete_files_name_their_shard_and_span_their_files() {
        let dir = "s3://b/t/data/day=2026-01-01";
        let a = format!("{dir}/bucket-0/s00003-a.parquet");
        let b = format!("{dir}/bucket-7/s00003-b.parquet");
        assert_eq!(partition_dir(&a), dir);
        let rows: [(&str, u64, &[u8]); 3] = [(&a, 1, &[1]), (&a, 9, &[3]), (&b, 4, &[2])];
        let f = write_grouped_deletes(dir, 3, vec![Value::Date(1)], rows, "x").unwrap();
        let d = &f.data_file;
        assert_eq!(d.file_path, format!("{dir}/s00003-deletes-x.parquet"));
        assert_eq!(d.lower_bounds[&FILE_PATH_ID], a.as_bytes());
        assert_eq!(d.upper_bounds[&FILE_PATH_ID], b.as_bytes());
        assert_eq!(target_of(d), None);
        assert_eq!(names(d), Names::ShardFiles(3));
        assert!(may_name(d, 3, |_| false));
        assert!(!may_name(d, 4, |_| true));
        let bytes = bytes::Bytes::from(f.bytes);
        assert_eq!(
            inlet_iceberg::scan::flatten_deletes(
                &inlet_iceberg::scan::read_position_deletes(bytes.clone()).unwrap()
            ),
            vec![
                (a.clone(), 1, Some(vec![1])),
                (a.clone(), 9, Some(vec![3])),
                (b.clone(), 4, Some(vec![2])),
            ]
        );
        assert_eq!(count_targets(bytes).unwrap(), vec![(a.clone(), 2), (b, 1)]);

        // Naming one file, it is that file's, as any reader sees from its bounds.
        let rows: [(&str, u64, &[u8]); 1] = [(&a, 5, &[1])];
        let f = write_grouped_deletes(dir, 3, vec![Value::Date(1)], rows, "y").unwrap();
        assert_eq!(names(&f.data_file), Names::File(&a));
    }

    #[test]
    fn delete_files_name_their_data_file_exactly() {
        let path = "file:///wh/t/data/day=2026-01-01/a-very-long-data-file-name-00001.parquet";
        let mut positions = [(9, vec![3]), (2, vec![1]), (5, vec![2])];
        let f = write_position_deletes(path, vec![Value::Date(1)], &mut positions, "x").unwrap();
        let d = &f.data_file;
        assert_eq!(d.content, FileContent::PositionDeletes);
        assert_eq!(d.record_count, 3);
        assert_eq!(d.lower_bounds[&FILE_PATH_ID], path.as_bytes());
        assert_eq!(d.upper_bounds[&FILE_PATH_ID], path.as_bytes());
        assert_eq!(d.lower_bounds[&POS_ID], 2i64.to_le_bytes());
        assert_eq!(d.upper_bounds[&POS_ID], 9i64.to_le_bytes());
        assert!(d.file_path.ends_with("-00001-deletes-x.parquet"));
        let back = inlet_iceberg::scan::read_position_deletes(bytes::Bytes::from(f.bytes)).unwrap();
        assert_eq!(
            inlet_iceberg::scan::flatten_deletes(&back),
            vec![
                (path.to_string(), 2, Some(vec![1])),
                (path.to_string(), 5, Some(vec![2])),
                (path.to_string(), 9, Some(vec![3])),
            ]
        );
    }
}
