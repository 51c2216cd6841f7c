//! The logical position-delete writer: one Parquet file per referenced data file per checkpoint,
//! rows `(file_path, pos, _version)` sorted by position, with exact `file_path` bounds so every
//! reader can tell which data file it applies to (as Iceberg's `write.delete.granularity=file`
//! does).
//!
//! `_version` is inlet's own column, beyond the spec's `file_path` and `pos`: the version of the
//! change that deleted the row. A key deleted after its last committed row keeps the delete's
//! version in the table this way, so an index rebuilt from the table holds the same tombstone
//! as the one that wrote it. Readers select `file_path` and `pos` by field id and ignore it.

use std::sync::Arc;

use super::parquet::{ParquetFile, WriteColumn};
use super::WrittenFile;
use crate::error::Result;
use crate::table::manifest::FileContent;
use crate::table::types::{Type, Value};

/// Reserved field id of `file_path` in position-delete files.
pub const FILE_PATH_ID: i32 = 2147483546;
/// Reserved field id of `pos` in position-delete files.
pub const POS_ID: i32 = 2147483545;
/// Field id of inlet's `_version` column in position-delete files: outside the spec's reserved
/// range (2147483447 and up), and delete files carry no table columns it could clash with.
pub const DELETE_VERSION_ID: i32 = 2147483000;
/// Name of inlet's version column in position-delete files.
pub const DELETE_VERSION_COLUMN: &str = "_version";

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
pub fn target_of(f: &crate::table::manifest::DataFile) -> Option<&str> {
    let lower = f.lower_bounds.get(&FILE_PATH_ID)?;
    if f.upper_bounds.get(&FILE_PATH_ID) != Some(lower) {
        return None;
    }
    std::str::from_utf8(lower).ok()
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
    for (pos, version) in positions.iter() {
        file.push(vec![
            Value::String(data_path.to_string()),
            Value::Long(*pos as i64),
            Value::Binary(version.clone()),
        ])?;
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
        let back = crate::table::scan::read_position_deletes(bytes::Bytes::from(f.bytes)).unwrap();
        assert_eq!(
            back,
            vec![
                (path.to_string(), 2, Some(vec![1])),
                (path.to_string(), 5, Some(vec![2])),
                (path.to_string(), 9, Some(vec![3])),
            ]
        );
    }
}
