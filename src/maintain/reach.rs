//! What a set of snapshots reaches: their manifest lists, the manifests in them and every file
//! those manifests name (in any status, so a file is kept while any kept manifest mentions it).

use std::collections::HashSet;

use futures::{StreamExt, TryStreamExt};

use inlet_common::error::Result;
use inlet_iceberg::manifest::{read_manifest, read_manifest_list, ManifestFile};
use inlet_iceberg::metadata::Snapshot;
use inlet_iceberg::Table;

/// Files reached from some snapshots, by [`key`].
#[derive(Debug, Default)]
pub struct Reach {
    pub lists: HashSet<String>,
    pub manifests: HashSet<String>,
    pub files: HashSet<String>,
    /// Every URI above as it appears in the metadata, with its size where known.
    pub uris: Vec<(String, Option<i64>)>,
}

impl Reach {
    /// Whether `uri` is one of the reached files, of any kind.
    pub fn contains(&self, uri: &str) -> bool {
        let k = key(uri);
        self.files.contains(k) || self.manifests.contains(k) || self.lists.contains(k)
    }
}

/// A URI without its scheme, so `file:/x`, `file:///x`, `s3a://b/x` and `s3://b/x` compare
/// as the same file the way readers resolve them.
pub fn key(uri: &str) -> &str {
    if let Some(rest) = uri.strip_prefix("file:") {
        return rest.trim_start_matches("//");
    }
    uri.split_once("://").map_or(uri, |(_, rest)| rest)
}

/// Reads what `snapshots` reach. Manifests named in `known` are not read again (their
/// files are known to be reached already). A missing manifest list is an error when
/// `strict`, else skipped (a snapshot whose files an earlier run already deleted).
pub async fn reach(
    table: &Table,
    snapshots: &[&Snapshot],
    known: &HashSet<String>,
    strict: bool,
) -> Result<Reach> {
    let mut out = Reach::default();
    let mut manifests: Vec<ManifestFile> = Vec::new();
    for s in snapshots {
        if !out.lists.insert(key(&s.manifest_list).to_string()) {
            continue;
        }
        if !strict && table.io.head(&s.manifest_list).await?.is_none() {
            continue;
        }
        out.uris.push((s.manifest_list.clone(), None));
        for m in read_manifest_list(&table.io.get(&s.manifest_list).await?)? {
            let k = key(&m.manifest_path).to_string();
            if !known.contains(&k) && out.manifests.insert(k) {
                out.uris
                    .push((m.manifest_path.clone(), Some(m.manifest_length)));
                manifests.push(m);
            }
        }
    }
    let schema = table.metadata.current_schema()?;
    let io = table.io.clone();
    let read: Vec<_> = futures::stream::iter(manifests)
        .map(move |m| {
            let io = io.clone();
            async move {
                // A manifest an earlier, interrupted run deleted reaches nothing any more.
                let bytes = if strict || io.head(&m.manifest_path).await?.is_some() {
                    Some(io.get(&m.manifest_path).await?)
                } else {
                    None
                };
                Ok::<_, crate::Error>((m, bytes))
            }
        })
        .buffered(table.io.upload_concurrency())
        .try_collect()
        .await?;
    for (m, bytes) in &read {
        let Some(bytes) = bytes else { continue };
        let ptype = table.manifest_partition_type(m, schema)?;
        for e in read_manifest(bytes, &ptype)? {
            let f = e.data_file;
            if out.files.insert(key(&f.file_path).to_string()) {
                out.uris.push((f.file_path, Some(f.file_size_in_bytes)));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::key;

    #[test]
    fn keys_ignore_the_scheme_spelling() {
        assert_eq!(key("file:///a/b"), "/a/b");
        assert_eq!(key("file:/a/b"), "/a/b");
        assert_eq!(key("s3a://bkt/a"), key("s3://bkt/a"));
        assert_eq!(key("/plain"), "/plain");
    }
}
