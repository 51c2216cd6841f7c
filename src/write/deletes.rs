//! The logical position-delete writer: one Parquet file per referenced data file per checkpoint,
//! rows `(file_path, pos)` sorted by position, with exact `file_path` bounds so every reader can
//! tell which data file it applies to (as Iceberg's `write.delete.granularity=file` does).

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
    ])
}

/// Writes the deletes of `positions` in the data file `data_path`, whose partition is
/// `partition`. The delete file sits next to the data file, named after it and `tag`.
pub fn write_position_deletes(
    data_path: &str,
    partition: Vec<Value>,
    positions: &mut [u64],
    tag: &str,
) -> Result<WrittenFile> {
    positions.sort_unstable();
    let mut file = ParquetFile::new(columns())?;
    for pos in positions.iter() {
        file.push(vec![
            Value::String(data_path.to_string()),
            Value::Long(*pos as i64),
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
        let f = write_position_deletes(path, vec![Value::Date(1)], &mut [9, 2, 5], "x").unwrap();
        let d = &f.data_file;
        assert_eq!(d.content, FileContent::PositionDeletes);
        assert_eq!(d.record_count, 3);
        assert_eq!(d.lower_bounds[&FILE_PATH_ID], path.as_bytes());
        assert_eq!(d.upper_bounds[&FILE_PATH_ID], path.as_bytes());
        assert_eq!(d.lower_bounds[&POS_ID], 2i64.to_le_bytes());
        assert_eq!(d.upper_bounds[&POS_ID], 9i64.to_le_bytes());
        assert!(d.file_path.ends_with("-00001-deletes-x.parquet"));
    }
}
