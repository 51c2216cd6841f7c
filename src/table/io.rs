//! File access for table metadata and data through `object_store`, addressed by absolute URIs
//! (`file:///...`) as they appear in Iceberg metadata.

use std::sync::Arc;

use bytes::Bytes;
use object_store::{local::LocalFileSystem, path::Path as StorePath, ObjectStore, PutPayload};
use url::Url;

use crate::error::{Error, ErrorKind, Result, ResultExt};

/// Reads and writes files by URI.
#[derive(Clone)]
pub struct FileIO {
    local: Arc<LocalFileSystem>,
}

impl Default for FileIO {
    fn default() -> Self {
        FileIO {
            local: Arc::new(LocalFileSystem::new()),
        }
    }
}

impl FileIO {
    fn resolve(&self, uri: &str) -> Result<(Arc<dyn ObjectStore>, StorePath)> {
        let url = Url::parse(uri)
            .map_err(|e| Error::new(ErrorKind::Storage, format!("bad file URI {uri}")).with_source(e))?;
        match url.scheme() {
            "file" => {
                let path = url.to_file_path().map_err(|_| {
                    Error::new(ErrorKind::Storage, format!("bad local file URI {uri}"))
                })?;
                let store_path = StorePath::from_absolute_path(&path).or_kind(ErrorKind::Storage, || {
                    format!("bad local path {}", path.display())
                })?;
                Ok((self.local.clone(), store_path))
            }
            other => Err(Error::config(format!(
                "storage scheme \"{other}\" in {uri} is not supported by this build; use a local path or file:// URL"
            ))),
        }
    }

    /// Writes a whole file, creating parent directories.
    pub async fn put(&self, uri: &str, data: Bytes) -> Result<()> {
        let (store, path) = self.resolve(uri)?;
        store
            .put(&path, PutPayload::from(data))
            .await
            .or_kind(ErrorKind::Storage, || format!("cannot write {uri}"))?;
        Ok(())
    }

    /// Reads a whole file.
    pub async fn get(&self, uri: &str) -> Result<Bytes> {
        let (store, path) = self.resolve(uri)?;
        let got = store
            .get(&path)
            .await
            .or_kind(ErrorKind::Storage, || format!("cannot read {uri}"))?;
        got.bytes()
            .await
            .or_kind(ErrorKind::Storage, || format!("cannot read {uri}"))
    }

    /// Deletes a file; a missing file is not an error.
    pub async fn delete(&self, uri: &str) -> Result<()> {
        let (store, path) = self.resolve(uri)?;
        match store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(Error::new(ErrorKind::Storage, format!("cannot delete {uri}")).with_source(e)),
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
            .or_kind(ErrorKind::Storage, || "cannot read the working directory".into())?
            .join(path)
    };
    let url = Url::from_directory_path(&abs)
        .map_err(|_| Error::config(format!("catalog.warehouse: {} is not a usable path", abs.display())))?;
    Ok(url.as_str().trim_end_matches('/').to_string())
}
