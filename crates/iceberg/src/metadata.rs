//! Iceberg table metadata (format v2) as serde data. Keys we do not model are kept in `extra`
//! maps so a table touched by other engines round-trips without loss.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use super::transform::Transform;
use super::types::Type;
use crate::keys::{
    SUMMARY_CHECKPOINT, SUMMARY_EPOCHS, SUMMARY_OFFSETS, SUMMARY_PIPELINE, UPSERT_VERSION_COLUMN,
};
use inlet_common::error::{Error, Result};

/// Where a column inlet adds goes in `fields`: before an upsert table's trailing `_version`,
/// else (a changelog table, or one whose columns another engine added after `_version`) last,
/// so the data columns only ever grow at their end.
pub fn new_column_position(fields: &[SchemaField]) -> usize {
    match fields.last() {
        Some(f) if f.name == UPSERT_VERSION_COLUMN => fields.len() - 1,
        _ => fields.len(),
    }
}

/// The tag inlet keeps on the newest snapshot `pipeline` committed.
pub fn pipeline_tag(pipeline: &str) -> String {
    format!("inlet-{pipeline}")
}

/// The root of a `*.metadata.json` file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct TableMetadata {
    pub format_version: u8,
    pub table_uuid: String,
    pub location: String,
    pub last_sequence_number: i64,
    pub last_updated_ms: i64,
    pub last_column_id: i32,
    pub current_schema_id: i32,
    pub schemas: Vec<Schema>,
    pub default_spec_id: i32,
    pub partition_specs: Vec<PartitionSpec>,
    pub last_partition_id: i32,
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "snapshot_id_or_none"
    )]
    pub current_snapshot_id: Option<i64>,
    #[serde(default)]
    pub snapshots: Vec<Snapshot>,
    #[serde(default)]
    pub snapshot_log: Vec<SnapshotLogEntry>,
    #[serde(default)]
    pub metadata_log: Vec<MetadataLogEntry>,
    pub sort_orders: Vec<Json>,
    pub default_sort_order_id: i32,
    #[serde(default)]
    pub refs: BTreeMap<String, SnapshotRef>,
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

fn snapshot_id_or_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    let id = Option::<i64>::deserialize(d)?;
    Ok(id.filter(|id| *id != -1))
}

/// A table schema.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Schema {
    #[serde(rename = "type")]
    pub kind: String,
    pub schema_id: i32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub identifier_field_ids: Vec<i32>,
    pub fields: Vec<SchemaField>,
}

/// A top-level schema field. Nested types are kept as raw JSON; inlet writes primitives only.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SchemaField {
    pub id: i32,
    pub name: String,
    pub required: bool,
    #[serde(rename = "type")]
    pub ty: Json,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub doc: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

impl SchemaField {
    /// The field's primitive type, or an error naming the field if it is nested.
    pub fn primitive(&self) -> Result<Type> {
        match &self.ty {
            Json::String(name) => Type::parse(name).map_err(|_| {
                Error::metadata(format!(
                    "column \"{}\" has type {name}, which inlet cannot write",
                    self.name
                ))
            }),
            other => Err(Error::metadata(format!(
                "column \"{}\" has nested type {other}, which inlet cannot write",
                self.name
            ))),
        }
    }
}

/// A partition spec.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct PartitionSpec {
    pub spec_id: i32,
    pub fields: Vec<PartitionField>,
}

/// One partition field.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct PartitionField {
    pub source_id: i32,
    pub field_id: i32,
    pub name: String,
    pub transform: String,
}

impl PartitionField {
    /// The parsed transform.
    pub fn transform(&self) -> Result<Transform> {
        Transform::parse(&self.transform)
    }
}

/// A snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Snapshot {
    pub snapshot_id: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_snapshot_id: Option<i64>,
    pub sequence_number: i64,
    pub timestamp_ms: i64,
    pub manifest_list: String,
    pub summary: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_id: Option<i32>,
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

/// An entry of `snapshot-log`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct SnapshotLogEntry {
    pub timestamp_ms: i64,
    pub snapshot_id: i64,
}

/// An entry of `metadata-log`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct MetadataLogEntry {
    pub timestamp_ms: i64,
    pub metadata_file: String,
}

/// A named reference (branch or tag).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct SnapshotRef {
    pub snapshot_id: i64,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

impl TableMetadata {
    /// The current schema.
    pub fn current_schema(&self) -> Result<&Schema> {
        self.schemas
            .iter()
            .find(|s| s.schema_id == self.current_schema_id)
            .ok_or_else(|| Error::metadata("current-schema-id names no schema"))
    }

    /// The default partition spec.
    pub fn default_spec(&self) -> Result<&PartitionSpec> {
        self.partition_specs
            .iter()
            .find(|s| s.spec_id == self.default_spec_id)
            .ok_or_else(|| Error::metadata("default-spec-id names no partition spec"))
    }

    /// The current snapshot, if any.
    pub fn current_snapshot(&self) -> Option<&Snapshot> {
        let id = self.current_snapshot_id?;
        // The head is nearly always the newest snapshot, at the end.
        self.snapshots.iter().rev().find(|s| s.snapshot_id == id)
    }

    /// Snapshots of the current lineage, newest first. Parents are looked up by id through a
    /// map built on the first step past the head, so a full walk costs one pass over the
    /// snapshots, not one per step.
    pub fn lineage(&self) -> impl Iterator<Item = &Snapshot> {
        let mut next = self.current_snapshot_id;
        let mut by_id: Option<std::collections::HashMap<i64, &Snapshot>> = None;
        let mut first = true;
        std::iter::from_fn(move || {
            let id = next?;
            let snap = if std::mem::take(&mut first) {
                self.snapshots.iter().rev().find(|s| s.snapshot_id == id)?
            } else {
                let map = by_id.get_or_insert_with(|| {
                    self.snapshots.iter().map(|s| (s.snapshot_id, s)).collect()
                });
                *map.get(&id)?
            };
            next = snap.parent_snapshot_id;
            Some(snap)
        })
    }

    /// The newest snapshot in the current lineage written by `pipeline`, else the one its tag
    /// names (the lineage may have been cut by another engine's snapshot expiry).
    pub fn last_snapshot_of(&self, pipeline: &str) -> Option<&Snapshot> {
        let ours =
            |s: &&Snapshot| s.summary.get(SUMMARY_PIPELINE).map(String::as_str) == Some(pipeline);
        self.lineage().find(ours).or_else(|| {
            let tagged = self.refs.get(&pipeline_tag(pipeline))?.snapshot_id;
            self.snapshots
                .iter()
                .find(|s| s.snapshot_id == tagged)
                .filter(ours)
        })
    }

    /// A snapshot id unused in this table, positive as engines expect.
    pub fn new_snapshot_id(&self) -> i64 {
        loop {
            let id = (uuid::Uuid::new_v4().as_u64_pair().0 & (i64::MAX as u64)) as i64;
            if id != 0 && !self.snapshots.iter().any(|s| s.snapshot_id == id) {
                return id;
            }
        }
    }
}

impl Snapshot {
    /// The checkpoint id recorded by inlet, if this snapshot is one of its commits.
    pub fn checkpoint_id(&self) -> Option<u64> {
        self.summary.get(SUMMARY_CHECKPOINT)?.parse().ok()
    }

    /// The source offsets recorded by inlet: topic → partition → next offset to read.
    pub fn offsets(&self) -> Result<BTreeMap<String, BTreeMap<i32, i64>>> {
        self.partition_map(SUMMARY_OFFSETS)
    }

    /// The owner epochs recorded by inlet: topic → partition → epoch (none before any claim).
    pub fn epochs(&self) -> Result<BTreeMap<String, BTreeMap<i32, i64>>> {
        self.partition_map(SUMMARY_EPOCHS)
    }

    fn partition_map(&self, key: &str) -> Result<BTreeMap<String, BTreeMap<i32, i64>>> {
        match self.summary.get(key) {
            None => Ok(BTreeMap::new()),
            Some(text) => serde_json::from_str(text).map_err(|e| {
                Error::metadata(format!(
                    "snapshot {} has an unreadable {key}",
                    self.snapshot_id
                ))
                .with_source(e)
            }),
        }
    }
}
