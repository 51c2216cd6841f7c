//! File access for table metadata and data, addressed by the URIs that appear in Iceberg
//! metadata. A `file://` URI names a local path literally: `%` in a partition directory such as
//! `region=us%2Fwest` is part of the name, as Iceberg's other readers take it, never an escape.

use std::path::PathBuf;

use bytes::Bytes;

use crate::error::{Error, ErrorKind, Result, ResultExt};

/// Reads and writes files by URI.
#[derive(Clone, Default)]
pub struct FileIO {}

impl FileIO {
    fn local_path(uri: &str) -> Result<PathBuf> {
        let rest = uri
            .strip_prefix("file://")
            .or_else(|| uri.strip_prefix("file:"))
            .ok_or_else(|| {
                Error::config(format!(
                    "storage location {uri} is not supported by this build; use a local path or file:// URL"
                ))
            })?;
        if !rest.starts_with('/') {
            return Err(Error::new(
                ErrorKind::Storage,
                format!("file URI {uri} is not absolute"),
            ));
        }
        Ok(PathBuf::from(rest))
    }

    /// Writes a whole file, creating parent directories. The content appears atomically
    /// (written aside, then renamed), so no reader sees a partial file.
    pub async fn put(&self, uri: &str, data: Bytes) -> Result<()> {
        let path = Self::local_path(uri)?;
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .or_kind(ErrorKind::Storage, || {
                    format!("cannot create directory {}", dir.display())
                })?;
        }
        let tmp = path.with_extension(format!("tmp-{}", uuid::Uuid::new_v4().simple()));
        tokio::fs::write(&tmp, &data)
            .await
            .or_kind(ErrorKind::Storage, || format!("cannot write {uri}"))?;
        tokio::fs::rename(&tmp, &path)
            .await
            .or_kind(ErrorKind::Storage, || format!("cannot write {uri}"))
    }

    /// Reads a whole file.
    pub async fn get(&self, uri: &str) -> Result<Bytes> {
        let path = Self::local_path(uri)?;
        tokio::fs::read(&path)
            .await
            .map(Bytes::from)
            .or_kind(ErrorKind::Storage, || format!("cannot read {uri}"))
    }

    /// Deletes a file; a missing file is not an error.
    pub async fn delete(&self, uri: &str) -> Result<()> {
        let path = Self::local_path(uri)?;
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => {
                Err(Error::new(ErrorKind::Storage, format!("cannot delete {uri}")).with_source(e))
            }
        }
    }
}

/// Turns a warehouse setting (a local path, relative or absolute, or a URL) into a URL string
/// without a trailing slash.
pub fn normalize_location(location: &str) -> Result<String> {
    let trimmed = location.trim_end_matches('/');
    if trimmed.contains("://") {
        return Ok(trimmed.to_string());
    }
    let path = std::path::Path::new(trimmed);
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .or_kind(ErrorKind::Storage, || {
                "cannot read the working directory".into()
            })?
            .join(path)
    };
    // Literal, not percent-encoded: see the module comment.
    Ok(format!("file://{}", abs.display())
        .trim_end_matches('/')
        .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn percent_signs_are_literal_path_characters() {
        let dir = tempfile::tempdir().unwrap();
        let uri = format!("file://{}/region=us%2Fwest/f.parquet", dir.path().display());
        let io = FileIO::default();
        io.put(&uri, Bytes::from_static(b"x")).await.unwrap();
        assert!(dir.path().join("region=us%2Fwest/f.parquet").exists());
        assert_eq!(io.get(&uri).await.unwrap(), Bytes::from_static(b"x"));
        io.delete(&uri).await.unwrap();
        io.delete(&uri).await.unwrap();
        assert!(io.get("s3://bucket/key").await.is_err());
    }
}
