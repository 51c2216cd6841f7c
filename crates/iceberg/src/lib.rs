//! Iceberg tables: metadata, manifests, catalogs and storage. `spec`-like modules are pure data;
//! `Table` ties them to a catalog and a file store.

pub mod avro;
pub mod catalog;
#[cfg(test)]
mod golden;
pub mod io;
pub mod keys;
pub mod manifest;
pub mod merge;
pub mod metadata;
pub mod rest;
pub mod scan;
pub mod transform;
pub mod types;

use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::{json, Map};

use catalog::Catalog;
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use io::FileIO;
use manifest::{read_manifest, read_manifest_list, ManifestEntry, ManifestFile, PartitionType};
use metadata::{
    MetadataLogEntry, PartitionField, PartitionSpec, Schema, SchemaField, TableMetadata,
};
use types::Type;

/// First partition field id, as the spec reserves ids below it for columns.
pub const FIRST_PARTITION_FIELD_ID: i32 = 1000;

/// What a table should look like when inlet creates it.
#[derive(Debug, Clone)]
pub struct TableDefinition {
    /// Columns in order: name, type, required, doc.
    pub columns: Vec<(String, Type, bool, Option<String>)>,
    /// Identifier (primary key) column names.
    pub identifier: Vec<String>,
    /// Partition fields: source column, transform, field name.
    pub partition: Vec<(String, transform::Transform, String)>,
    /// Table properties.
    pub properties: BTreeMap<String, String>,
}

impl TableDefinition {
    /// Builds v2 metadata for a new table at `location`.
    pub fn new_metadata(&self, location: &str) -> Result<TableMetadata> {
        let fields: Vec<SchemaField> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, (name, ty, required, doc))| SchemaField {
                id: i as i32 + 1,
                name: name.clone(),
                required: *required,
                ty: json!(ty.iceberg_name()),
                doc: doc.clone(),
                extra: Map::new(),
            })
            .collect();
        let id_of = |name: &str| fields.iter().find(|f| f.name == name).map(|f| f.id);
        let identifier_field_ids = self
            .identifier
            .iter()
            .map(|n| {
                id_of(n)
                    .ok_or_else(|| Error::config(format!("primary key column {n} is not a column")))
            })
            .collect::<Result<Vec<_>>>()?;
        let partition_fields = self
            .partition
            .iter()
            .enumerate()
            .map(|(i, (col, t, name))| {
                Ok(PartitionField {
                    source_id: id_of(col).ok_or_else(|| {
                        Error::config(format!("partition column {col} is not a column"))
                    })?,
                    field_id: FIRST_PARTITION_FIELD_ID + i as i32,
                    name: name.clone(),
                    transform: t.to_string(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut properties = self.properties.clone();
        properties
            .entry("write.parquet.compression-codec".into())
            .or_insert_with(|| "zstd".into());
        Ok(TableMetadata {
            format_version: 2,
            table_uuid: uuid::Uuid::new_v4().to_string(),
            location: location.to_string(),
            last_sequence_number: 0,
            last_updated_ms: now_ms(),
            last_column_id: fields.len() as i32,
            current_schema_id: 0,
            schemas: vec![Schema {
                kind: "struct".into(),
                schema_id: 0,
                identifier_field_ids,
                fields,
            }],
            default_spec_id: 0,
            last_partition_id: FIRST_PARTITION_FIELD_ID - 1 + partition_fields.len() as i32,
            partition_specs: vec![PartitionSpec {
                spec_id: 0,
                fields: partition_fields,
            }],
            properties,
            current_snapshot_id: None,
            snapshots: vec![],
            snapshot_log: vec![],
            metadata_log: vec![],
            sort_orders: vec![json!({"order-id": 0, "fields": []})],
            default_sort_order_id: 0,
            refs: BTreeMap::new(),
            extra: Map::new(),
        })
    }

    /// Checks that an existing table can take this definition's rows: every defined column the
    /// table has by name has the same type or one it was widened to; a defined column the table
    /// lacks was renamed or dropped by another engine, which the table's schema decides (a
    /// warning says so); the primary key columns must be there. Columns the table gained since
    /// may be anywhere. The partition spec must be the same.
    pub fn check_compatible(&self, meta: &TableMetadata) -> Result<()> {
        let schema = meta.current_schema()?;
        let existing: Vec<(String, Type)> = schema
            .fields
            .iter()
            .map(|f| Ok((f.name.clone(), f.primitive()?)))
            .collect::<Result<_>>()?;
        let show = |cols: &[(String, Type)]| {
            cols.iter()
                .map(|(n, t)| format!("{n} {t}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut missing = Vec::new();
        for (name, wanted, _, _) in &self.columns {
            match existing.iter().find(|(n, _)| n == name) {
                Some((_, has)) if has == wanted || widened(*wanted, *has) => {}
                Some((_, has)) => {
                    return Err(Error::config(format!(
                        "table.columns: column {name} is {wanted} in the config but {has} in the existing table [{}]; make table.columns match the table",
                        show(&existing)
                    )))
                }
                None if self.identifier.contains(name) => {
                    return Err(Error::config(format!(
                        "table.primary_key: column {name} is not in the existing table [{}]",
                        show(&existing)
                    )))
                }
                None => missing.push(name.as_str()),
            }
        }
        if !missing.is_empty() {
            tracing::warn!(
                columns = ?missing,
                "Configured columns are not in the existing table (renamed or dropped by another engine); the table's schema is used"
            );
        }
        let spec = meta.default_spec()?;
        let existing_spec: Vec<(i32, String)> = spec
            .fields
            .iter()
            .map(|f| (f.source_id, f.transform.clone()))
            .collect();
        let wanted_spec: Vec<(i32, String)> = self
            .partition
            .iter()
            .map(|(col, t, _)| {
                let id = schema
                    .fields
                    .iter()
                    .find(|f| &f.name == col)
                    .map_or(-1, |f| f.id);
                (id, t.to_string())
            })
            .collect();
        // A source column renamed by another engine is matched by position in the spec.
        let same = existing_spec.len() == wanted_spec.len()
            && existing_spec
                .iter()
                .zip(&wanted_spec)
                .all(|(e, w)| e.1 == w.1 && (e.0 == w.0 || w.0 == -1));
        if !same {
            return Err(Error::config(
                "table.partition_by: differs from the existing table's partition spec; make it match the table",
            ));
        }
        Ok(())
    }
}

/// Milliseconds since the epoch, now.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// The current metadata file of a table of a SQL catalog, with its location; `None` if the
/// catalog does not know the table. A file the catalog still points at that storage does not
/// have is a broken table, which no retry mends; one removed after another writer moved the
/// pointer on (old metadata files are cleaned up) is read again at the new pointer.
async fn read_current(
    sql: &catalog::SqlCatalog,
    io: &FileIO,
    namespace: &str,
    name: &str,
) -> Result<Option<(String, Bytes)>> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        let Some(location) = sql.metadata_location(namespace, name).await? else {
            return Ok(None);
        };
        let e = match io.get(&location).await {
            Ok(bytes) => return Ok(Some((location, bytes))),
            Err(e) => e,
        };
        if attempts >= 3 || io.head(&location).await?.is_some() {
            return Err(e);
        }
        if sql.metadata_location(namespace, name).await?.as_deref() == Some(&location) {
            return Err(Error::metadata(format!(
                "table {namespace}.{name}: its current metadata file {location} does not exist"
            )));
        }
    }
}

/// A loaded table: its metadata and where it came from.
#[derive(Clone)]
pub struct Table {
    pub namespace: String,
    pub name: String,
    pub metadata: TableMetadata,
    pub metadata_location: String,
    pub catalog: Catalog,
    pub io: FileIO,
}

impl Table {
    /// Loads the table, or `None` if the catalog does not know it.
    pub async fn load(
        catalog: &Catalog,
        io: &FileIO,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Table>> {
        let (location, metadata, io) = match catalog {
            Catalog::Sql(sql) => {
                let Some((location, bytes)) = read_current(sql, io, namespace, name).await? else {
                    return Ok(None);
                };
                let metadata: TableMetadata = serde_json::from_slice(&bytes)
                    .or_kind(ErrorKind::Metadata, || {
                        format!("cannot parse table metadata {location}")
                    })?;
                (location, metadata, io.clone())
            }
            Catalog::Rest(rest) => {
                let Some(loaded) = rest.load(namespace, name).await? else {
                    return Ok(None);
                };
                let io = io.with_vended(loaded.storage);
                (loaded.metadata_location, loaded.metadata, io)
            }
        };
        if metadata.format_version != 2 {
            return Err(Error::metadata(format!(
                "table {namespace}.{name} is format version {}; inlet writes format version 2",
                metadata.format_version
            )));
        }
        Ok(Some(Table {
            namespace: namespace.into(),
            name: name.into(),
            metadata,
            metadata_location: location,
            catalog: catalog.clone(),
            io,
        }))
    }

    /// Loads the table, creating it from `def` under `warehouse` when missing.
    pub async fn load_or_create(
        catalog: &Catalog,
        io: &FileIO,
        namespace: &str,
        name: &str,
        warehouse: &str,
        def: &TableDefinition,
    ) -> Result<Table> {
        if let Some(t) = Self::load(catalog, io, namespace, name).await? {
            def.check_compatible(&t.metadata)?;
            return Ok(t);
        }
        catalog.ensure_namespace(namespace).await?;
        let location = format!("{warehouse}/{namespace}.db/{name}");
        let metadata = def.new_metadata(&location)?;
        match catalog {
            Catalog::Sql(sql) => {
                let file = metadata_file_uri(&location, 0);
                write_metadata(io, &file, &metadata).await?;
                if !sql.create_table(namespace, name, &file).await? {
                    // Someone else created it meanwhile; theirs wins.
                    let _ = io.delete(&file).await;
                }
            }
            // The server places the table and writes its first metadata file; if someone else
            // created it meanwhile, theirs wins.
            Catalog::Rest(rest) => {
                rest.create(namespace, name, &metadata).await?;
            }
        }
        let table = Self::load(catalog, io, namespace, name)
            .await?
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Catalog,
                    format!("table {namespace}.{name} vanished after creation"),
                )
            })?;
        def.check_compatible(&table.metadata)?;
        Ok(table)
    }

    /// Re-reads the current metadata from the catalog.
    pub async fn refresh(&mut self) -> Result<()> {
        let fresh = Self::load(&self.catalog, &self.io, &self.namespace, &self.name)
            .await?
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Catalog,
                    format!("table {}.{} was dropped", self.namespace, self.name),
                )
            })?;
        *self = fresh;
        Ok(())
    }

    /// Writes `next` as a new metadata file and swaps it in. `Ok(false)` means another writer
    /// committed first; the caller refreshes and rebases.
    pub async fn try_commit(&mut self, next: TableMetadata) -> Result<bool> {
        commit_tables(&mut [self], vec![next]).await
    }

    /// Writes `next` as this table's next metadata file; returns the file's location and the
    /// earlier metadata files that fell out of its `metadata-log`.
    async fn write_next(&self, next: &mut TableMetadata) -> Result<(String, Vec<String>)> {
        next.metadata_log.push(MetadataLogEntry {
            timestamp_ms: self.metadata.last_updated_ms,
            metadata_file: self.metadata_location.clone(),
        });
        let keep = next
            .properties
            .get(PREVIOUS_VERSIONS_MAX)
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(DEFAULT_PREVIOUS_VERSIONS_MAX);
        let mut dropped = Vec::new();
        if next.metadata_log.len() > keep {
            let drop = next.metadata_log.len() - keep;
            dropped = next
                .metadata_log
                .drain(..drop)
                .map(|e| e.metadata_file)
                .collect();
        }
        let version = metadata_version(&self.metadata_location).map_or(0, |v| v + 1);
        let file = metadata_file_uri(&next.location, version);
        write_metadata(&self.io, &file, next).await?;
        Ok((file, dropped))
    }

    /// The partition type a manifest's entries use (its own spec, the given schema).
    pub fn manifest_partition_type(
        &self,
        m: &ManifestFile,
        schema: &metadata::Schema,
    ) -> Result<PartitionType> {
        let spec = self
            .metadata
            .partition_specs
            .iter()
            .find(|s| s.spec_id == m.partition_spec_id)
            .ok_or_else(|| {
                Error::metadata(format!(
                    "manifest {} uses unknown spec {}",
                    m.manifest_path, m.partition_spec_id
                ))
            })?;
        PartitionType::new(spec, schema)
    }

    /// The partition type of the default spec.
    pub fn partition_type(&self) -> Result<PartitionType> {
        PartitionType::new(
            self.metadata.default_spec()?,
            self.metadata.current_schema()?,
        )
    }

    /// The files a snapshot added and removed. Only manifests the snapshot wrote can hold them.
    pub async fn changes_of(
        &self,
        snapshot: &metadata::Snapshot,
    ) -> Result<(Vec<manifest::DataFile>, Vec<manifest::DataFile>)> {
        let schema = self.metadata.current_schema()?;
        let list = read_manifest_list(&self.io.get(&snapshot.manifest_list).await?)?;
        let (mut added, mut removed) = (Vec::new(), Vec::new());
        for m in list
            .iter()
            .filter(|m| m.added_snapshot_id == snapshot.snapshot_id)
        {
            let ptype = self.manifest_partition_type(m, schema)?;
            for e in read_manifest(&self.io.get(&m.manifest_path).await?, &ptype)? {
                if e.snapshot_id.unwrap_or(m.added_snapshot_id) != snapshot.snapshot_id {
                    continue;
                }
                match e.status {
                    manifest::EntryStatus::Added => added.push(e.data_file),
                    manifest::EntryStatus::Deleted => removed.push(e.data_file),
                    manifest::EntryStatus::Existing => {}
                }
            }
        }
        Ok((added, removed))
    }

    /// All live entries (data and delete files) of the current snapshot, with inherited
    /// sequence numbers filled in.
    pub async fn live_entries(&self) -> Result<Vec<ManifestEntry>> {
        self.live_entries_in(|_| true).await
    }

    /// [`Table::live_entries`] of the manifests `wanted` keeps (judged by their manifest-list
    /// entry: partition bounds, sequence number), the others not read.
    pub async fn live_entries_in(
        &self,
        wanted: impl Fn(&manifest::ManifestFile) -> bool,
    ) -> Result<Vec<ManifestEntry>> {
        match self.metadata.current_snapshot() {
            Some(snapshot) => self.entries_of(snapshot, wanted).await,
            None => Ok(vec![]),
        }
    }

    /// The live entries of `snapshot`, of the manifests `wanted` keeps.
    pub async fn entries_of(
        &self,
        snapshot: &metadata::Snapshot,
        wanted: impl Fn(&manifest::ManifestFile) -> bool,
    ) -> Result<Vec<ManifestEntry>> {
        let schema = self.metadata.current_schema()?;
        let list = read_manifest_list(&self.io.get(&snapshot.manifest_list).await?)?;
        let mut out = Vec::new();
        for m in list.into_iter().filter(|m| wanted(m)) {
            let ptype = self.manifest_partition_type(&m, schema)?;
            for mut e in read_manifest(&self.io.get(&m.manifest_path).await?, &ptype)? {
                if e.status == manifest::EntryStatus::Deleted {
                    continue;
                }
                e.snapshot_id.get_or_insert(m.added_snapshot_id);
                e.sequence_number.get_or_insert(m.sequence_number);
                e.file_sequence_number.get_or_insert(m.sequence_number);
                out.push(e);
            }
        }
        Ok(out)
    }
}

/// Table property: how many earlier metadata files `metadata-log` keeps.
pub const PREVIOUS_VERSIONS_MAX: &str = "write.metadata.previous-versions-max";
/// Iceberg's default of [`PREVIOUS_VERSIONS_MAX`].
pub const DEFAULT_PREVIOUS_VERSIONS_MAX: usize = 100;
/// Table property: whether a commit deletes the metadata files that fell out of the log.
pub const DELETE_AFTER_COMMIT: &str = "write.metadata.delete-after-commit.enabled";

/// Whether `meta` asks for old metadata files to be deleted after a commit (Iceberg's default
/// is not to).
pub fn deletes_old_metadata(meta: &TableMetadata) -> bool {
    meta.properties
        .get(DELETE_AFTER_COMMIT)
        .is_some_and(|v| v.eq_ignore_ascii_case("true"))
}

/// Metadata files removed after commits since the process started (a reader's metrics export
/// it; the table layer keeps no metrics of its own).
static METADATA_FILES_REMOVED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many old metadata files commits of this process removed.
pub fn metadata_files_removed() -> u64 {
    METADATA_FILES_REMOVED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Deletes metadata files a commit dropped from the log. Failures only leave files behind for
/// orphan cleanup, so they are logged, not returned.
async fn delete_dropped(io: &FileIO, files: &[String]) {
    for f in files {
        if let Err(e) = io.delete(f).await {
            tracing::warn!(file = %f, error = %e, "Cannot delete an old metadata file; orphan cleanup will");
        }
    }
    METADATA_FILES_REMOVED.fetch_add(files.len() as u64, std::sync::atomic::Ordering::Relaxed);
}

async fn write_metadata(io: &FileIO, uri: &str, metadata: &TableMetadata) -> Result<()> {
    // Compact: the file is rewritten whole on every commit and read by every reader.
    let json = serde_json::to_vec(metadata).or_kind(ErrorKind::Internal, || {
        "cannot serialise table metadata".into()
    })?;
    io.put(uri, Bytes::from(json)).await
}

fn metadata_file_uri(location: &str, version: u64) -> String {
    format!(
        "{location}/metadata/{version:05}-{}.metadata.json",
        uuid::Uuid::new_v4()
    )
}

/// The version number in a `NNNNN-uuid.metadata.json` file name.
fn metadata_version(uri: &str) -> Option<u64> {
    let name = uri.rsplit('/').next()?;
    name.split('-').next()?.parse().ok()
}

/// Whether the Iceberg spec allows widening `from` to `to` (int→long, float→double, decimal
/// precision increase).
pub fn widened(from: Type, to: Type) -> bool {
    match (from, to) {
        (Type::Int, Type::Long) | (Type::Float, Type::Double) => true,
        (
            Type::Decimal {
                precision: p,
                scale: s,
            },
            Type::Decimal {
                precision: p2,
                scale: s2,
            },
        ) => s == s2 && p2 > p,
        _ => false,
    }
}

/// Commits new metadata to several tables of one catalog at once, so readers see all of them
/// or none: a SQL catalog gets each metadata file written, then every table's pointer swapped in
/// one transaction; a REST catalog gets the changes as requirements and updates, in one
/// transaction where there are several tables. `Ok(false)` means another writer changed one of
/// the tables first; nothing was swapped and the caller refreshes and rebases.
/// The crash tests' `after_metadata_write` step, for commits of checkpoints (a claim's commit,
/// checkpoint id 0, passes).
fn crash_if_checkpoint(nexts: &[TableMetadata]) {
    let checkpoint = nexts.iter().any(|n| {
        n.current_snapshot()
            .and_then(|s| s.checkpoint_id())
            .is_some_and(|id| id > 0)
    });
    if checkpoint {
        inlet_common::failpoint::crash_point("after_metadata_write");
    }
}

pub async fn commit_tables(tables: &mut [&mut Table], nexts: Vec<TableMetadata>) -> Result<bool> {
    let Some(first) = tables.first() else {
        return Ok(true);
    };
    let catalog = first.catalog.clone();
    match catalog {
        Catalog::Sql(sql) => commit_sql(&sql, tables, nexts).await,
        Catalog::Rest(rest) => {
            crash_if_checkpoint(&nexts);
            let changes: Vec<rest::Change<'_>> = tables
                .iter()
                .zip(&nexts)
                .map(|(t, next)| rest::Change {
                    namespace: &t.namespace,
                    name: &t.name,
                    base: &t.metadata,
                    next,
                })
                .collect();
            match rest.commit(&changes).await? {
                rest::Committed::Conflict => Ok(false),
                rest::Committed::Landed(loaded) => {
                    for (table, now) in tables.iter_mut().zip(loaded) {
                        table.metadata = now.metadata;
                        table.metadata_location = now.metadata_location;
                    }
                    Ok(true)
                }
            }
        }
    }
}

async fn commit_sql(
    catalog: &catalog::SqlCatalog,
    tables: &mut [&mut Table],
    nexts: Vec<TableMetadata>,
) -> Result<bool> {
    let mut files = Vec::with_capacity(tables.len());
    let mut dropped = Vec::with_capacity(tables.len());
    let mut nexts = nexts;
    for (table, next) in tables.iter().zip(nexts.iter_mut()) {
        let (file, old) = table.write_next(next).await?;
        files.push(file);
        dropped.push(old);
    }
    crash_if_checkpoint(&nexts);
    let swaps: Vec<(&str, &str, &str, &str)> = tables
        .iter()
        .zip(&files)
        .map(|(t, f)| {
            (
                t.namespace.as_str(),
                t.name.as_str(),
                t.metadata_location.as_str(),
                f.as_str(),
            )
        })
        .collect();
    if catalog.swap_all(&swaps).await? {
        for (((table, next), file), old) in tables.iter_mut().zip(nexts).zip(files).zip(dropped) {
            if deletes_old_metadata(&next) {
                delete_dropped(&table.io, &old).await;
            }
            table.metadata = next;
            table.metadata_location = file;
        }
        Ok(true)
    } else {
        for (table, file) in tables.iter().zip(&files) {
            let _ = table.io.delete(file).await;
        }
        Ok(false)
    }
}
