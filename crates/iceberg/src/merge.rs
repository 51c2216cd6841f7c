//! Manifest merging: each commit adds a manifest or two, so the manifest list would grow with
//! the table's history. When a snapshot's list holds more small manifests of one kind (data or
//! deletes, per partition spec) than `commit.manifest.min-count-to-merge`, they are rewritten
//! into manifests of about `commit.manifest.target-size-bytes`, as Iceberg's own writers do.
//! Merged entries keep their files' snapshot ids and sequence numbers, so readers apply
//! position deletes exactly as before.

use std::collections::BTreeMap;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use super::manifest::{self, EntryStatus, ManifestEntry, ManifestFile};
use super::Table;
use inlet_common::error::Result;

/// Table property: whether commits merge small manifests.
pub const MERGE_ENABLED: &str = "commit.manifest-merge.enabled";
/// Table property: the size merged manifests aim at.
pub const TARGET_SIZE_BYTES: &str = "commit.manifest.target-size-bytes";
/// Table property: how many small manifests of one kind a list may hold before they merge.
pub const MIN_COUNT_TO_MERGE: &str = "commit.manifest.min-count-to-merge";

/// Iceberg's defaults of the properties above.
pub const DEFAULT_TARGET_SIZE_BYTES: i64 = 8 * 1024 * 1024;
pub const DEFAULT_MIN_COUNT_TO_MERGE: usize = 100;

/// When and how far manifests merge, from a table's properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergePolicy {
    pub enabled: bool,
    pub target_bytes: i64,
    pub min_count: usize,
}

impl MergePolicy {
    /// The policy `properties` ask for, Iceberg's defaults where they are silent.
    pub fn of(properties: &BTreeMap<String, String>) -> MergePolicy {
        let get = |k: &str| properties.get(k).map(|v| v.trim());
        MergePolicy {
            enabled: get(MERGE_ENABLED).is_none_or(|v| !v.eq_ignore_ascii_case("false")),
            target_bytes: get(TARGET_SIZE_BYTES)
                .and_then(|v| v.parse().ok())
                .filter(|v| *v > 0)
                .unwrap_or(DEFAULT_TARGET_SIZE_BYTES),
            min_count: get(MIN_COUNT_TO_MERGE)
                .and_then(|v| v.parse().ok())
                .filter(|v| *v >= 2)
                .unwrap_or(DEFAULT_MIN_COUNT_TO_MERGE),
        }
    }

    /// The bins of `group` (small manifests of one kind, in list order) to merge: consecutive
    /// runs up to the target size; a bin of one manifest stays as it is.
    fn bins(&self, group: &[usize], lengths: &[i64]) -> Vec<Vec<usize>> {
        let mut bins: Vec<Vec<usize>> = Vec::new();
        let mut size = 0;
        for &i in group {
            match bins.last_mut() {
                Some(bin) if size + lengths[i] <= self.target_bytes => {
                    bin.push(i);
                    size += lengths[i];
                }
                _ => {
                    bins.push(vec![i]);
                    size = lengths[i];
                }
            }
        }
        bins.retain(|b| b.len() > 1);
        bins
    }
}

/// The result of merging a manifest list.
pub struct Merged {
    /// The list to commit.
    pub manifests: Vec<ManifestFile>,
    /// Manifests written for it; if the commit does not land they are garbage.
    pub written: Vec<String>,
    /// How many manifests were merged away.
    pub merged: usize,
}

/// Merges the small manifests of `manifests` (a parent snapshot's list) where the table's
/// policy asks for it, for a new snapshot `snapshot_id` with `sequence_number`. Without
/// anything to merge, or when merging fails (a manifest it cannot read or write), the list
/// comes back as it was: merging never stops a commit.
pub async fn merge_manifests(
    table: &Table,
    manifests: Vec<ManifestFile>,
    snapshot_id: i64,
    sequence_number: i64,
) -> Result<Merged> {
    match try_merge(table, manifests.clone(), snapshot_id, sequence_number).await {
        Ok(merged) => Ok(merged),
        Err(e) => {
            tracing::warn!(error = %e, "Cannot merge manifests; committing the list as it is");
            Ok(Merged {
                manifests,
                written: Vec::new(),
                merged: 0,
            })
        }
    }
}

async fn try_merge(
    table: &Table,
    manifests: Vec<ManifestFile>,
    snapshot_id: i64,
    sequence_number: i64,
) -> Result<Merged> {
    let policy = MergePolicy::of(&table.metadata.properties);
    let unchanged = |manifests| Merged {
        manifests,
        written: Vec::new(),
        merged: 0,
    };
    if !policy.enabled {
        return Ok(unchanged(manifests));
    }
    let mut groups: BTreeMap<(i32, i32), Vec<usize>> = BTreeMap::new();
    for (i, m) in manifests.iter().enumerate() {
        if m.manifest_length < policy.target_bytes {
            groups
                .entry((m.content, m.partition_spec_id))
                .or_default()
                .push(i);
        }
    }
    let lengths: Vec<i64> = manifests.iter().map(|m| m.manifest_length).collect();
    let bins: Vec<Vec<usize>> = groups
        .values()
        .filter(|g| g.len() > policy.min_count)
        .flat_map(|g| policy.bins(g, &lengths))
        .collect();
    if bins.is_empty() {
        return Ok(unchanged(manifests));
    }
    let mut replaced = vec![None; manifests.len()];
    let mut written = Vec::new();
    let mut merged = 0;
    for bin in &bins {
        let m = merge_bin(table, &manifests, bin, snapshot_id, sequence_number).await?;
        written.push(m.manifest_path.clone());
        merged += bin.len();
        // The merged manifest takes the place of the bin's first member.
        replaced[bin[0]] = Some(Some(m));
        for &i in &bin[1..] {
            replaced[i] = Some(None);
        }
    }
    let manifests = manifests
        .into_iter()
        .zip(replaced)
        .filter_map(|(m, r)| match r {
            None => Some(m),
            Some(merged) => merged,
        })
        .collect();
    Ok(Merged {
        manifests,
        written,
        merged,
    })
}

/// Reads the manifests of `bin` and writes their live entries as one manifest of existing
/// files.
async fn merge_bin(
    table: &Table,
    manifests: &[ManifestFile],
    bin: &[usize],
    snapshot_id: i64,
    sequence_number: i64,
) -> Result<ManifestFile> {
    let schema = table.metadata.current_schema()?;
    let first = &manifests[bin[0]];
    let spec = table
        .metadata
        .partition_specs
        .iter()
        .find(|s| s.spec_id == first.partition_spec_id)
        .ok_or_else(|| {
            inlet_common::error::Error::metadata(format!(
                "manifest {} uses unknown spec {}",
                first.manifest_path, first.partition_spec_id
            ))
        })?;
    let ptype = table.manifest_partition_type(first, schema)?;
    let io = table.io.clone();
    let members: Vec<ManifestFile> = bin.iter().map(|&i| manifests[i].clone()).collect();
    let fetched: Vec<(ManifestFile, Bytes)> = futures::stream::iter(members)
        .map(move |m| {
            let io = io.clone();
            async move {
                let bytes = io.get(&m.manifest_path).await?;
                Ok::<_, crate::Error>((m, bytes))
            }
        })
        .buffered(table.io.upload_concurrency())
        .try_collect()
        .await?;
    let mut entries = Vec::new();
    for (m, bytes) in fetched {
        for e in manifest::read_manifest(&bytes, &ptype)? {
            if e.status == EntryStatus::Deleted {
                // A removal matters only to the snapshot that made it.
                continue;
            }
            // Only added entries inherit; existing ones carry their own values.
            entries.push(ManifestEntry {
                status: EntryStatus::Existing,
                snapshot_id: Some(e.snapshot_id.unwrap_or(m.added_snapshot_id)),
                sequence_number: Some(e.sequence_number.unwrap_or(m.sequence_number)),
                file_sequence_number: Some(e.file_sequence_number.unwrap_or(m.sequence_number)),
                data_file: e.data_file,
            });
        }
    }
    let bytes = manifest::write_manifest(&entries, schema, spec, &ptype)?;
    let path = format!(
        "{}/metadata/{}-m-merged.avro",
        table.metadata.location,
        uuid::Uuid::new_v4()
    );
    let length = bytes.len() as i64;
    table.io.put(&path, Bytes::from(bytes)).await?;
    let files: Vec<&manifest::DataFile> = entries.iter().map(|e| &e.data_file).collect();
    Ok(ManifestFile {
        manifest_path: path,
        manifest_length: length,
        partition_spec_id: first.partition_spec_id,
        content: first.content,
        sequence_number,
        min_sequence_number: entries
            .iter()
            .filter_map(|e| e.sequence_number)
            .min()
            .unwrap_or(sequence_number),
        added_snapshot_id: snapshot_id,
        added_files_count: 0,
        existing_files_count: entries.len() as i32,
        deleted_files_count: 0,
        added_rows_count: 0,
        existing_rows_count: entries.iter().map(|e| e.data_file.record_count).sum(),
        deleted_rows_count: 0,
        partitions: Some(manifest::summarize_partitions(&files, &ptype)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_reads_iceberg_properties_with_their_defaults() {
        let none = MergePolicy::of(&BTreeMap::new());
        assert_eq!(
            none,
            MergePolicy {
                enabled: true,
                target_bytes: DEFAULT_TARGET_SIZE_BYTES,
                min_count: DEFAULT_MIN_COUNT_TO_MERGE
            }
        );
        let props = BTreeMap::from([
            (MERGE_ENABLED.to_string(), "FALSE".to_string()),
            (TARGET_SIZE_BYTES.to_string(), "1000".to_string()),
            (MIN_COUNT_TO_MERGE.to_string(), "5".to_string()),
        ]);
        let p = MergePolicy::of(&props);
        assert!(!p.enabled);
        assert_eq!((p.target_bytes, p.min_count), (1000, 5));
    }

    #[test]
    fn bins_fill_up_to_the_target_and_leave_singletons_alone() {
        let p = MergePolicy {
            enabled: true,
            target_bytes: 100,
            min_count: 2,
        };
        let lengths = [40, 40, 40, 90, 10];
        assert_eq!(
            p.bins(&[0, 1, 2, 3, 4], &lengths),
            vec![vec![0, 1], vec![3, 4]]
        );
    }
}
