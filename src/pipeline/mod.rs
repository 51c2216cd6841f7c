//! One pipeline: source → decode → route → write → commit. Changes go to one
//! table, or with `routing` to the table their upstream table or topic names (created from the
//! changes' own fields when missing). A checkpoint commits every table that changed in one
//! catalog transaction, carrying the same offsets, so the pipeline resumes where its newest
//! checkpoint ended. Checkpoints fire on time, record count or buffered bytes; a rebalance drops
//! what is buffered so the new owner of a partition re-reads it from the tables' offsets.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::Message;
use serde_json::Value as Json;
use tokio::sync::{mpsc, watch};

use crate::commit::{table_offsets, Checkpoint, Committer, Epochs, Offsets, SchemaChange};
use crate::config::{Config, RouteBy, SchemaChangePolicy, TableMode, CHANGELOG_COLUMNS};
use crate::decode::pool::{DecodePool, DecodedMessage, Message as SourceMessage, Typed};
use crate::decode::{
    decoder_for, glob, infer_type, reason, ChangeRecord, Column, Decoded, Op, RawChange, Shape,
};
use crate::dlq::{BadRecords, Origin};
use crate::source::CommitGate;

mod checkpoint;
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::health::{health, Component, PipelineState};
use crate::metrics::metrics;
use crate::rebuild::copies::{self, Copier, CopyManifest};
use crate::source::{self, SourceContext, SourceEvent, TableRef};
use crate::table::catalog::Catalog;
use crate::table::io::{normalize_location, FileIO};
use crate::table::manifest::{DataFile, FileContent};
use crate::table::metadata::SchemaField;
use crate::table::transform::Transform;
use crate::table::types::{Type, Value};
use crate::table::{Table, TableDefinition};
use crate::upsert::{Outcome, UpsertSink, UpsertSpec, WriterTemplate};
use crate::write::cap::{Admit, CapField, PartitionCap};
use crate::write::parquet::WriteColumn;
use crate::write::{DataWriter, PartitionColumn, WrittenFile};

/// The column upsert tables add: each row's version, so the index can be rebuilt exactly.
pub const UPSERT_VERSION_COLUMN: &str = "_version";

/// Where a column inlet adds goes in `fields`: before an upsert table's trailing `_version`,
/// else (a changelog table, or one whose columns another engine added after `_version`) last,
/// so the data columns only ever grow at their end.
pub fn new_column_position(fields: &[SchemaField]) -> usize {
    match fields.last() {
        Some(f) if f.name == UPSERT_VERSION_COLUMN => fields.len() - 1,
        _ => fields.len(),
    }
}

/// Table property of changelog tables naming the upstream primary key (comma-separated), which
/// their schema does not declare as identifier fields.
pub const PRIMARY_KEY_PROPERTY: &str = "inlet.primary-key";

/// An Iceberg table's namespace and name.
pub type TableName = (String, String);

/// A column of a new table: name, type, whether required, documentation.
type ColumnDef = (String, Type, bool, Option<String>);

/// The table definition a config's `table.columns` ask for.
pub fn table_definition(cfg: &Config) -> Result<TableDefinition> {
    let t = &cfg.table;
    let columns = t
        .columns
        .iter()
        .map(|c| {
            // Changelog rows of deletes carry only what the before image has, which for
            // PostgreSQL's default replica identity is the key; other columns must be nullable.
            let required =
                c.required && (t.mode != TableMode::Changelog || t.primary_key.contains(&c.name));
            Ok((c.name.clone(), Type::parse(&c.ty)?, required, c.doc.clone()))
        })
        .collect::<Result<Vec<_>>>()?;
    definition(cfg, columns, &t.primary_key)
}

/// A table definition from a change's own fields: every field of its image, typed as the
/// message's schema declares or its value suggests (string while only nulls were seen);
/// nullable except the primary key, which is `table.primary_key` or the key the change names.
pub fn definition_from_change(cfg: &Config, raw: &RawChange) -> Result<TableDefinition> {
    let key = if cfg.table.primary_key.is_empty() {
        raw.key.clone()
    } else {
        cfg.table.primary_key.clone()
    };
    if cfg.table.mode == TableMode::Upsert && key.is_empty() {
        return Err(Error::config(
            "table.primary_key: the change names no primary key to create its upsert table with; list the key columns",
        ));
    }
    let image = raw
        .image()
        .ok_or_else(|| Error::decode("change has neither before nor after image"))?;
    for k in &key {
        if !image.contains_key(k) {
            return Err(Error::decode(format!(
                "primary key column \"{k}\" is missing from the change"
            ))
            .because(reason::INCOMPATIBLE_SCHEMA));
        }
    }
    let reserved: Vec<&str> = match cfg.table.mode {
        TableMode::Changelog => CHANGELOG_COLUMNS.iter().map(|c| c.0).collect(),
        TableMode::Upsert => vec![UPSERT_VERSION_COLUMN],
    };
    let columns = image
        .iter()
        .map(|(name, value)| {
            if reserved.contains(&name.as_str()) {
                return Err(Error::new(
                    ErrorKind::Schema,
                    format!(
                        "upstream column \"{name}\" collides with inlet's own column of that name"
                    ),
                ));
            }
            let ty = raw
                .fields
                .get(name)
                .and_then(|f| f.declared)
                .or_else(|| infer_type(value))
                .unwrap_or(Type::String);
            Ok((name.clone(), ty, key.contains(name), None))
        })
        .collect::<Result<Vec<_>>>()?;
    definition(cfg, columns, &key)
}

/// The definition of a table of `columns` under the config's mode, partitioning and buckets.
/// Partition fields whose column the table lacks are left out.
fn definition(
    cfg: &Config,
    mut columns: Vec<ColumnDef>,
    key: &[String],
) -> Result<TableDefinition> {
    let t = &cfg.table;
    let mut partition = Vec::new();
    for p in &t.partition_by {
        if !columns.iter().any(|c| c.0 == p.column) {
            tracing::warn!(column = %p.column, "Partition column missing from the table; not partitioning by it");
            continue;
        }
        let transform = Transform::parse(&p.transform)?;
        partition.push((
            p.column.clone(),
            transform,
            crate::config::partition_field_name(p, transform),
        ));
    }
    if let (TableMode::Upsert, Some(n), [k]) = (t.mode, t.buckets, key) {
        partition.push((k.clone(), Transform::Bucket(n), format!("{k}_bucket")));
    }
    match t.mode {
        TableMode::Changelog => {
            for (name, ty, required) in CHANGELOG_COLUMNS {
                columns.push((name.to_string(), ty, required, None));
            }
        }
        TableMode::Upsert => columns.push((
            UPSERT_VERSION_COLUMN.to_string(),
            Type::Binary,
            false,
            Some("Order of the row's change (binlog position, LSN or configured columns), encoded to compare bytewise".into()),
        )),
    }
    // Identifier fields mean "uniquely identifies a row", which holds in upsert tables only; a
    // changelog table has many rows per key and records the upstream key as a property.
    let mut properties = t.properties.clone();
    for (k, v) in crate::maintain::table_properties(&cfg.services) {
        properties.entry(k).or_insert(v);
    }
    let identifier = match t.mode {
        TableMode::Upsert => key.to_vec(),
        TableMode::Changelog => {
            if !key.is_empty() {
                properties.insert(PRIMARY_KEY_PROPERTY.into(), key.join(","));
            }
            Vec::new()
        }
    };
    Ok(TableDefinition {
        columns,
        identifier,
        partition,
        properties,
    })
}

/// Opens the catalog, then loads or creates the configured table.
pub async fn open_table(cfg: &Config) -> Result<Table> {
    let lake = Lake::connect(cfg).await?;
    lake.load_or_create(
        &cfg.table.namespace,
        &cfg.table.name,
        &table_definition(cfg)?,
    )
    .await
}

/// The catalog and storage a pipeline's tables live in.
struct Lake {
    catalog: Catalog,
    io: FileIO,
    warehouse: String,
    /// The file the storage probe writes.
    probe_file: String,
}

impl Lake {
    async fn connect(cfg: &Config) -> Result<Lake> {
        let catalog = match Catalog::connect(&cfg.catalog.settings()?).await {
            Ok(c) => c,
            Err(e) => {
                health().failed_with(&e);
                return Err(e);
            }
        };
        health().succeeded(Component::Catalog);
        if cfg.routing.is_some() && !catalog.multi_table() {
            return Err(Error::config(
                "routing: the REST catalog offers no multi-table transactions, so the tables of one checkpoint cannot commit atomically; run one pipeline per table instead",
            ));
        }
        let io = FileIO::new(cfg.storage.settings()?);
        let warehouse = normalize_location(&cfg.catalog.warehouse)?;
        // A REST catalog places the tables itself: no warehouse to probe here.
        let probe_file = if catalog.places_tables() {
            String::new()
        } else {
            io.check(&warehouse).await?;
            let file = crate::monitor::probe_file(&warehouse, &cfg.pipeline_id);
            crate::monitor::check_warehouse(
                &io,
                &file,
                &cfg.catalog.warehouse,
                "catalog.warehouse",
            )
            .await?;
            file
        };
        Ok(Lake {
            catalog,
            io,
            warehouse,
            probe_file,
        })
    }

    async fn load(&self, namespace: &str, name: &str) -> Result<Option<Table>> {
        Table::load(&self.catalog, &self.io, namespace, name).await
    }

    async fn load_or_create(
        &self,
        namespace: &str,
        name: &str,
        def: &TableDefinition,
    ) -> Result<Table> {
        Table::load_or_create(
            &self.catalog,
            &self.io,
            namespace,
            name,
            &self.warehouse,
            def,
        )
        .await
    }
}

/// What a checkpoint has gathered so far, across tables.
#[derive(Default)]
struct Pending {
    records: u64,
    since: Option<Instant>,
    /// Next offset to read per partition that has advanced since the last commit.
    end: Offsets,
    /// The first buffered offset per partition: where reading starts again if the buffered
    /// records are dropped.
    first: Offsets,
    /// The newest source time (ms) of the changes read per partition.
    newest: crate::commit::Watermarks,
}

/// Where each value of a written row comes from.
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// The decoded row's value at this position.
    User(usize),
    /// The changelog metadata column at this position of [`CHANGELOG_COLUMNS`].
    Meta(usize),
}

/// One table a pipeline writes: its writer, its upsert engine and what it holds uncommitted.
struct TableSink {
    table: Table,
    /// The table's data columns, which decoded changes are typed for; a schema change makes a
    /// new one, so changes typed ahead for the old one are told apart.
    shape: Arc<Shape>,
    /// Changelog tables: the written row's values in table column order.
    layout: Vec<Slot>,
    writer: DataWriter,
    /// Upsert tables: the shards and their indexes.
    upsert: Option<UpsertSink>,
    /// A schema change made since the last commit, committed with the next checkpoint.
    schema_change: Option<SchemaChange>,
    /// Files finished by rolling or a schema change, awaiting upload.
    rolled: Vec<WrittenFile>,
    /// Files uploaded for the next commit.
    uploaded: Vec<DataFile>,
    /// Changes written since the last commit.
    changes: u64,
    /// The table's own offsets for this pipeline as last seen: the fence of its next commit.
    committed: Offsets,
    /// A routed table with snapshots but none of this pipeline, under
    /// `kafka.start_without_offsets: latest`: per partition, the end of the topic when the table
    /// was first routed to; changes before it are not written to the table.
    skip_below: Offsets,
    /// Newest source timestamp (ms) of the changes written since the last commit.
    newest_source_ms: Option<i64>,
    /// Upsert tables: the share of stale changes per partition, to tell when a source's
    /// positions went backwards.
    stale_watch: BTreeMap<String, BTreeMap<i32, StaleWatch>>,
    /// The partitions a checkpoint may add.
    partitions: PartitionCap,
}

/// Counts a partition's changes in windows, and says when most of a window was stale after a
/// window that was not: what a source whose positions restarted (MySQL failover, binlog reset)
/// looks like.
#[derive(Default)]
struct StaleWatch {
    changes: u32,
    stale: u32,
    /// Whether the last full window was mostly stale.
    alarmed: bool,
}

impl StaleWatch {
    const WINDOW: u32 = 1000;

    /// Counts a change; `Some(stale share)` when a window ends mostly stale after one that
    /// was not.
    fn count(&mut self, stale: bool) -> Option<f64> {
        self.changes += 1;
        self.stale += u32::from(stale);
        if self.changes < Self::WINDOW {
            return None;
        }
        let share = f64::from(self.stale) / f64::from(self.changes);
        let was = std::mem::replace(&mut self.alarmed, share > 0.9);
        (self.stale, self.changes) = (0, 0);
        (self.alarmed && !was).then_some(share)
    }
}

impl TableSink {
    fn open(cfg: &Config, table: Table, shards: u32, index_root: PathBuf) -> Result<TableSink> {
        let (write_columns, partition) = writer_layout(cfg, &table)?;
        let (shape, layout) = data_columns(cfg, &write_columns);
        let partitions = PartitionCap::new(
            cfg.table.max_new_partitions_per_checkpoint,
            cap_fields(&write_columns, &partition, &shape),
        );
        let upsert = match cfg.table.mode {
            TableMode::Changelog => None,
            TableMode::Upsert => {
                let mut sink =
                    upsert_sink(cfg, &table, &shape, &write_columns, &partition, index_root)?;
                sink.spec.shards = shards;
                Some(sink)
            }
        };
        let writer = DataWriter::new(
            write_columns,
            partition,
            &table.metadata.location,
            cfg.table.target_file_bytes,
            "",
        );
        let committed = table_offsets(&table.metadata, &cfg.pipeline_id)?;
        let label = table_label(&table);
        metrics().rows_written.with_label_values(&[&label]);
        metrics().partitions_created.with_label_values(&[&label]);
        if let Some(last) = table.metadata.last_snapshot_of(&cfg.pipeline_id) {
            metrics()
                .last_commit
                .with_label_values(&[&label])
                .set(last.timestamp_ms as f64 / 1000.0);
        }
        // Freshness is known from the start, not from the first commit of this process.
        let committed_source_ms = table.metadata.lineage().find_map(|s| {
            s.summary
                .get(crate::commit::SUMMARY_SOURCE_TS)
                .and_then(|v| v.parse::<i64>().ok())
        });
        if let Some(ms) = committed_source_ms {
            metrics().committed_source_time(&label, ms);
        }
        Ok(TableSink {
            table,
            shape: Arc::new(shape),
            layout,
            writer,
            upsert,
            schema_change: None,
            rolled: Vec::new(),
            uploaded: Vec::new(),
            changes: 0,
            committed,
            skip_below: Offsets::new(),
            newest_source_ms: None,
            stale_watch: BTreeMap::new(),
            partitions,
        })
    }

    /// Whether the next checkpoint has anything to commit to this table.
    fn has_changes(&self) -> bool {
        self.changes > 0
            || self.schema_change.is_some()
            || !self.rolled.is_empty()
            || !self.uploaded.is_empty()
    }

    /// Drops everything uncommitted (partitions were revoked); the index shards of owned
    /// partitions stay open.
    fn abort(&mut self) -> Result<()> {
        self.writer.abort();
        self.rolled.clear();
        self.uploaded.clear();
        self.changes = 0;
        self.newest_source_ms = None;
        self.partitions.aborted();
        if let Some(sink) = self.upsert.as_mut() {
            tokio::task::block_in_place(|| sink.discard_all())?;
        }
        if let Some(change) = self.schema_change.take() {
            // The schema change was never committed: forget it, and reload before reuse.
            tracing::debug!(
                schema_id = change.schema.schema_id,
                "Dropping an uncommitted schema change"
            );
        }
        Ok(())
    }

    /// Re-reads the table and rebuilds the writer for its current schema.
    async fn refresh(&mut self, cfg: &Config) -> Result<()> {
        self.table.refresh().await?;
        self.committed = table_offsets(&self.table.metadata, &cfg.pipeline_id)?;
        self.follow_schema(cfg)
    }

    /// Types and writes later changes with the table's current schema; open files finish.
    fn follow_schema(&mut self, cfg: &Config) -> Result<()> {
        let (write_columns, partition) = writer_layout(cfg, &self.table)?;
        let (shape, layout) = data_columns(cfg, &write_columns);
        self.partitions
            .set_fields(cap_fields(&write_columns, &partition, &shape));
        self.shape = Arc::new(shape);
        self.layout = layout;
        if let Some(upsert) = self.upsert.as_mut() {
            let (spec, versions) = upsert_spec(cfg, &self.table, &self.shape, &write_columns)?;
            upsert.change_layout(spec, versions, write_columns.clone(), partition.clone())?;
        }
        tokio::task::block_in_place(|| self.writer.change_columns(write_columns, partition))?;
        self.rolled.extend(self.writer.take_finished());
        Ok(())
    }

    /// Evolves the schema if the change needs it, types the change and writes it.
    fn apply(
        &mut self,
        cfg: &Config,
        raw: &RawChange,
        typed: Option<Typed>,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> Result<()> {
        // Read again because another table resumes earlier; this table holds it already (or,
        // following only new changes, never takes it).
        let below = |o: &Offsets| {
            o.get(topic)
                .and_then(|c| c.get(&partition))
                .is_some_and(|at| offset < *at)
        };
        if below(&self.committed) || below(&self.skip_below) {
            metrics()
                .skipped
                .with_label_values(&["already_committed"])
                .inc();
            return Ok(());
        }
        // Typed on a decoding thread for this very shape, with nothing to change in it: the
        // schema stays, and the record is what typing here would give.
        let elided = typed.as_ref().is_some_and(|t| t.elided);
        let typed = typed
            .filter(|t| Arc::ptr_eq(&t.shape, &self.shape))
            .filter(|t| !(cfg.table.evolve_schema && t.needs_change));
        let record = match typed {
            Some(t) => t.record,
            // `Pipeline::accept` decodes such a change again in full before it gets here.
            None if elided => {
                return Err(Error::new(
                    ErrorKind::Internal,
                    "a change typed without its images reached a table of another shape",
                ))
            }
            None => {
                self.evolve(cfg, raw)?;
                self.shape.record(raw)
            }
        }
        .map_err(|e| self.incompatible(raw, &e).unwrap_or(e))?;
        if let Some(after) = record.after.as_deref() {
            self.admit_partition(after)?;
        }
        let m = metrics();
        if let Some(sink) = self.upsert.as_mut() {
            let outcome = sink.accept(topic, partition, offset, record)?;
            match outcome {
                Outcome::Applied | Outcome::Deferred => {}
                Outcome::Stale => m
                    .stale
                    .with_label_values(&[topic, &partition.to_string()])
                    .inc(),
                Outcome::Ignored => m.ignored.inc(),
            }
            if !self.stale_watch.contains_key(topic) {
                self.stale_watch.insert(topic.to_string(), BTreeMap::new());
            }
            let watch = self
                .stale_watch
                .get_mut(topic)
                .expect("the topic's watches were just added")
                .entry(partition)
                .or_default();
            if let Some(share) = watch.count(outcome == Outcome::Stale) {
                tracing::error!(
                    table = %format!("{}.{}", self.table.namespace, self.table.name),
                    topic,
                    partition,
                    stale_percent = (share * 100.0) as u32,
                    "Most changes of this partition are older than what the table holds and are dropped; \
                     if the source's positions went backwards (failover, binlog reset), order by \
                     table.version_columns or table.version_position: kafka-offset (README: sources whose \
                     positions go backwards)"
                );
            }
        } else if record.op == Op::Update && record.after.is_none() {
            // A retraction (Flink's `-U`): the `+U` after it is the change.
            m.skipped.with_label_values(&["update_before"]).inc();
        } else {
            let row = self.changelog_row(record, partition, offset)?;
            tokio::task::block_in_place(|| self.writer.write(row))?;
        }
        self.changes += 1;
        Ok(())
    }
    /// Admits the partition a change writes to under `table.max_new_partitions_per_checkpoint`.
    /// The table's own partitions are read only once a checkpoint reaches the cap.
    fn admit_partition(&mut self, after: &[Value]) -> Result<()> {
        let key = match self.partitions.admit(after) {
            Admit::Yes => return Ok(()),
            Admit::Over(key) => key,
        };
        if !self.partitions.loaded() {
            let entries = tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(self.table.live_entries())
            })?;
            let held: Vec<String> = entries
                .iter()
                .filter(|e| e.data_file.content == FileContent::Data)
                .map(|e| self.partitions.key(&e.data_file.partition))
                .collect();
            self.partitions.learn(held);
            if self.partitions.admit(after) == Admit::Yes {
                return Ok(());
            }
        }
        Err(Error::decode(format!(
            "the change would add partition {key} to {}.{}, past table.max_new_partitions_per_checkpoint ({}) new partitions in this checkpoint; \
             a wrong timestamp or partition value upstream? If this many new partitions are expected, raise the limit",
            self.table.namespace,
            self.table.name,
            self.partitions.limit()
        ))
        .because(crate::decode::reason::TOO_MANY_PARTITIONS))
    }

    /// Adds the change's new fields as nullable columns and widens columns whose source type
    /// widened, per the Iceberg spec's promotions. The new schema commits with the next
    /// checkpoint, together with the first rows that use it.
    /// Whether writing `raw` changes the table's schema.
    fn needs_schema_change(&self, cfg: &Config, raw: &RawChange, typed: Option<&Typed>) -> bool {
        cfg.table.evolve_schema
            && match typed.filter(|t| Arc::ptr_eq(&t.shape, &self.shape)) {
                Some(t) => t.needs_change,
                None => self.shape.needs_change(raw),
            }
    }

    fn evolve(&mut self, cfg: &Config, raw: &RawChange) -> Result<()> {
        if !cfg.table.evolve_schema {
            return Ok(());
        }
        let promoted: Vec<(String, Type)> = self
            .shape
            .columns()
            .iter()
            .filter_map(|c| {
                let declared = raw.fields.get(&c.name).and_then(|f| f.declared)?;
                crate::table::widened(c.ty, declared).then(|| (c.name.clone(), declared))
            })
            .collect();
        let added = raw.new_fields(self.shape.columns());
        if added.is_empty() && promoted.is_empty() {
            return Ok(());
        }
        self.change_schema(cfg, &added, &promoted)
    }

    /// A value failed to convert: if the message's schema declares a column with a type the
    /// table's column cannot take or be widened to, that is a schema change, named as such.
    fn incompatible(&self, raw: &RawChange, error: &Error) -> Option<Error> {
        let c = self.shape.columns().iter().find(|c| {
            error.message().contains(&format!(".{}: ", c.name))
                && raw
                    .fields
                    .get(&c.name)
                    .and_then(|f| f.declared)
                    .is_some_and(|d| {
                        d != c.ty && !holds(c.ty, d) && !crate::table::widened(c.ty, d)
                    })
        })?;
        let declared = raw.fields[&c.name].declared?;
        Some(
            Error::new(
                ErrorKind::Schema,
                format!(
                    "table {}.{} column \"{}\" is {} but the source now sends {declared}; \
                     Iceberg cannot change {} to {declared}: add a new column upstream, or set \
                     table.on_incompatible_change: dead-letter to divert these records",
                    self.table.namespace, self.table.name, c.name, c.ty, c.ty
                ),
            )
            .with("column", &c.name),
        )
    }

    fn change_schema(
        &mut self,
        cfg: &Config,
        added: &[(String, Type)],
        promoted: &[(String, Type)],
    ) -> Result<()> {
        let meta = &mut self.table.metadata;
        let (base_schema_id, base_last_column_id) = match &self.schema_change {
            Some(c) => (c.base_schema_id, c.base_last_column_id),
            None => (meta.current_schema_id, meta.last_column_id),
        };
        let mut schema = meta.current_schema()?.clone();
        let m = metrics();
        for (name, ty) in promoted {
            if let Some(f) = schema.fields.iter_mut().find(|f| &f.name == name) {
                tracing::info!(column = %name, from = %f.ty, to = %ty, "Widening a column");
                f.ty = Json::String(ty.to_string());
                m.schema_changes.with_label_values(&["promote"]).inc();
            }
        }
        for (name, ty) in added {
            meta.last_column_id += 1;
            tracing::info!(column = %name, r#type = %ty, field_id = meta.last_column_id, "Adding a column");
            let at = match self.upsert {
                Some(_) => new_column_position(&schema.fields),
                None => schema.fields.len(),
            };
            schema.fields.insert(
                at,
                SchemaField {
                    id: meta.last_column_id,
                    name: name.clone(),
                    required: false,
                    ty: Json::String(ty.to_string()),
                    doc: None,
                    extra: Default::default(),
                },
            );
            m.schema_changes.with_label_values(&["add_column"]).inc();
        }
        schema.schema_id = meta.schemas.iter().map(|s| s.schema_id).max().unwrap_or(0) + 1;
        meta.current_schema_id = schema.schema_id;
        meta.schemas.push(schema.clone());
        self.schema_change = Some(SchemaChange {
            schema,
            base_schema_id,
            base_last_column_id,
        });
        self.follow_schema(cfg)
    }

    fn changelog_row(
        &self,
        record: ChangeRecord,
        partition: i32,
        offset: i64,
    ) -> Result<Vec<Value>> {
        let op = record.op;
        let mut values = record
            .after
            .or(record.before)
            .ok_or_else(|| Error::decode("change has neither before nor after image"))?;
        let mut meta = [
            Value::String(op.code().to_string()),
            record
                .version
                .map_or(Value::Null, |v| Value::String(v.to_string())),
            record.source_ts_ms.map_or(Value::Null, |ms| {
                Value::TimestampTz(ms.saturating_mul(1000))
            }),
            Value::Int(partition),
            Value::Long(offset),
        ];
        Ok(self
            .layout
            .iter()
            .map(|slot| match *slot {
                Slot::User(i) => std::mem::replace(&mut values[i], Value::Null),
                Slot::Meta(i) => std::mem::replace(&mut meta[i], Value::Null),
            })
            .collect())
    }
}

/// An index shard taken out of its table while it is brought level with the table.
struct Recovering {
    name: TableName,
    topic: String,
    partition: i32,
    shard: crate::upsert::Shard,
    spec: crate::upsert::UpsertSpec,
    table: Table,
    started: Instant,
    /// Where its index came from: `local`, or `copy` when restored from its copy.
    source: &'static str,
}

/// A checkpoint on its way (see [`checkpoint`]).
struct InFlight {
    handle: tokio::task::JoinHandle<Result<checkpoint::Done>>,
    id: u64,
    started: Instant,
    /// Where its partitions resume once it landed.
    end: Offsets,
    records: u64,
    /// The partitions it adds to each table.
    added: Vec<(TableName, usize)>,
    /// Whether the loop waited for the source at least half the time while its records were
    /// read: the pipeline has time to spare.
    spare: bool,
}

/// A compaction running beside consumption: it holds the upsert tables' shard layouts until it
/// ends, and the next checkpoint waits for it.
struct Compacting {
    handle: tokio::task::JoinHandle<Result<Vec<CompactedTable>>>,
    started: Instant,
}

/// One table compacted: the table as the compaction left it, and the layouts to give back.
struct CompactedTable {
    name: TableName,
    /// Whether the compaction committed a snapshot.
    committed: bool,
    /// Files it left due.
    backlog: usize,
    table: Table,
    layouts: Vec<((String, i32), crate::upsert::ShardLayout)>,
}

/// A running pipeline.
pub struct Pipeline {
    cfg: Config,
    lake: Lake,
    /// Decodes batches of messages on the worker threads, in order.
    decode: DecodePool,
    bad: BadRecords,
    committer: Committer,
    consumer: Arc<StreamConsumer<SourceContext>>,
    events: mpsc::UnboundedReceiver<SourceEvent>,
    /// The tables written so far, by name.
    tables: BTreeMap<TableName, TableSink>,
    /// Tables that took changes since their finished files were last uploaded.
    touched: Vec<TableName>,
    /// Where the owned partitions resume: the offsets of the newest checkpoint.
    committed: Offsets,
    /// Partitions this member owns.
    assigned: HashSet<(String, i32)>,
    /// The owner epoch this member claimed for each partition it owns.
    epochs: Epochs,
    pending: Pending,
    next_checkpoint_id: u64,
    /// Upsert tables: index shards per table (the partitions of the one topic).
    shards: u32,
    /// Kafka timestamp (ms) of the message being applied, for changes that carry none.
    message_ts: Option<i64>,
    /// The message being accepted has applied none of its changes yet.
    clean_stop: bool,
    /// Broker, catalog and storage probes; stop with the pipeline.
    monitor: crate::monitor::Monitor,
    /// Copies of the index shards beside the tables.
    copier: Copier,
    /// Snapshot expiry and orphan cleanup in the background.
    services: crate::maintain::Scheduler,
    /// Upsert tables: inline compaction after checkpoints.
    compactor: Option<crate::maintain::compact::Compactor>,
    /// Since the last checkpoint began: when, and how long the loop waited for the source.
    cycle: (Instant, Duration),
    /// The compaction running while records are read, if any.
    compacting: Option<Compacting>,
    /// The checkpoint being written and committed while the next one's records are read.
    inflight: Option<InFlight>,
    /// Closed while a checkpoint commits; partitions are given up only when it is open.
    gate: Arc<CommitGate>,
    /// Partition retention and mark-done after checkpoints.
    partition_services: Option<crate::maintain::PartitionServices>,
    /// When each owned partition last delivered a record, for the watermarks of idle ones.
    last_seen: crate::maintain::done::LastSeen,
    /// Shutting down: checkpoints still commit, index copies and compaction wait for the next
    /// start (see [`Pipeline::after_commit`]).
    stopping: bool,
    /// Where claims of assigned partitions find the tables, and commit as this member.
    table_ref: Arc<TableRef>,
    /// Claims of newly assigned partitions, running beside the pipeline.
    claiming: Vec<Claiming>,
    consumed: ConsumedCounters,
}

/// A claim of the partitions one assignment brought, running in its own task.
struct Claiming {
    /// The assignment's number (see [`source::Claims`]).
    n: u64,
    parts: Vec<(String, i32)>,
    task: tokio::task::JoinHandle<Result<source::Claimed>>,
}

impl Pipeline {
    /// Connects to the catalog and Kafka. A configured table is created now if missing;
    /// routed tables (and a table without configured columns) when their first change arrives.
    pub async fn start(cfg: Config) -> Result<Pipeline> {
        let lake = Lake::connect(&cfg).await?;
        let single = cfg
            .routing
            .is_none()
            .then(|| (cfg.table.namespace.clone(), cfg.table.name.clone()));
        let committer = Committer {
            pipeline_id: cfg.pipeline_id.clone(),
            writer_id: uuid::Uuid::new_v4().to_string(),
            retries: cfg.checkpoint.commit_retries.max(1),
            retry_for: Duration::from_millis(cfg.checkpoint.commit_timeout_ms),
        };
        let table_ref = TableRef {
            catalog: lake.catalog.clone(),
            io: lake.io.clone(),
            table: single.clone(),
            pipeline_id: cfg.pipeline_id.clone(),
            start_without_offsets: cfg.kafka.start_without_offsets,
            committer: committer.clone(),
            foreign: Default::default(),
        };
        let gate = Arc::new(CommitGate::default());
        let (consumer, events) = source::consumer(
            &cfg.kafka,
            gate.clone(),
            Duration::from_millis(cfg.checkpoint.commit_timeout_ms),
        )?;
        let consumer = Arc::new(consumer);
        let shards = match cfg.table.mode {
            TableMode::Upsert => source::partition_count(&consumer, &cfg.kafka.topics[0])?,
            TableMode::Changelog => 1,
        };
        let monitor = crate::monitor::spawn(crate::monitor::Probes {
            consumer: consumer.clone(),
            topics: cfg.kafka.topics.clone(),
            catalog: lake.catalog.clone(),
            table: single.clone(),
            storage: (!lake.probe_file.is_empty()).then(|| crate::monitor::StorageProbe {
                io: lake.io.clone(),
                file: lake.probe_file.clone(),
            }),
            interval: Duration::from_millis(cfg.health.probe_interval_ms),
        });
        let mut pipeline = Pipeline {
            decode: DecodePool::new(
                decoder_for(&cfg.format, &cfg.table.primary_key)?,
                cfg.pipeline.worker_count(),
            )?,
            bad: BadRecords::new(&cfg)?,
            lake,
            committer,
            consumer,
            events,
            tables: BTreeMap::new(),
            touched: Vec::new(),
            committed: Offsets::new(),
            assigned: HashSet::new(),
            epochs: Epochs::new(),
            pending: Pending::default(),
            next_checkpoint_id: 1,
            shards,
            message_ts: None,
            clean_stop: true,
            monitor,
            copier: Copier::new(cfg.index.copy_interval_ms),
            services: crate::maintain::Scheduler::new(&cfg),
            compactor: crate::maintain::compact::Compactor::new(&cfg),
            cycle: (Instant::now(), Duration::ZERO),
            partition_services: crate::maintain::PartitionServices::new(&cfg),
            last_seen: Default::default(),
            stopping: false,
            inflight: None,
            compacting: None,
            gate,
            table_ref: Arc::new(table_ref),
            claiming: Vec::new(),
            consumed: ConsumedCounters::default(),
            cfg,
        };
        if let Some((namespace, name)) = single {
            let table = if pipeline.cfg.table.columns.is_empty() {
                pipeline.lake.load(&namespace, &name).await?
            } else {
                let def = table_definition(&pipeline.cfg)?;
                Some(
                    pipeline
                        .lake
                        .load_or_create(&namespace, &name, &def)
                        .await?,
                )
            };
            if let Some(table) = table {
                pipeline.add_table(table)?;
                pipeline.watch_table_storage(&(namespace, name)).await?;
            }
        }
        tracing::info!(
            tables = ?pipeline.tables.keys().map(|(n, t)| format!("{n}.{t}")).collect::<Vec<_>>(),
            routing = pipeline.cfg.routing.is_some(),
            topics = ?pipeline.cfg.kafka.topics,
            "Pipeline started"
        );
        Ok(pipeline)
    }

    /// Starts writing `table`.
    fn add_table(&mut self, table: Table) -> Result<&mut TableSink> {
        let key = (table.namespace.clone(), table.name.clone());
        let root = std::path::Path::new(&self.cfg.index.dir).join(&self.cfg.pipeline_id);
        let index_root = match self.cfg.routing {
            // Kept where single-table pipelines always had it.
            None => root,
            Some(_) => root.join(format!("{}.{}", key.0, key.1)),
        };
        tracing::info!(table = %format!("{}.{}", key.0, key.1), location = %table.metadata.location, "Writing table");
        let sink = TableSink::open(&self.cfg, table, self.shards, index_root)?;
        Ok(self.tables.entry(key).or_insert(sink))
    }

    /// Where the catalog places the tables (REST), checks the storage below the first table's
    /// location with the table's own credentials (vended ones included), so wrong credentials
    /// stop the pipeline at start naming the bucket, and keeps probing it for readiness.
    async fn watch_table_storage(&mut self, key: &TableName) -> Result<()> {
        if self.monitor.watches_storage() {
            return Ok(());
        }
        let Some(sink) = self.tables.get(key) else {
            return Ok(());
        };
        let (io, location) = (sink.table.io.clone(), sink.table.metadata.location.clone());
        io.check(&location).await?;
        let file = crate::monitor::probe_file(&location, &self.cfg.pipeline_id);
        // The REST catalog chose the location; its warehouse is the thing to change.
        crate::monitor::check_warehouse(&io, &file, &location, "the REST catalog's warehouse")
            .await?;
        self.monitor
            .watch_storage(crate::monitor::StorageProbe { io, file });
        Ok(())
    }

    /// Runs until `shutdown` turns true, then commits what is buffered and returns. The
    /// consumer has left the group when this returns, so a pipeline started next in the same
    /// process (after a skip or a new configuration) joins a group without it.
    pub async fn run(mut self, shutdown: watch::Receiver<bool>) -> Result<()> {
        let result = self.run_loop(shutdown).await;
        // A checkpoint in flight ends before the indexes it writes close.
        let settled = self.settle().await;
        self.close().await;
        result.and(settled)
    }

    /// Stops the probes and claims, then closes the consumer once nothing else holds it.
    async fn close(mut self) {
        self.monitor.stop().await;
        // A claim still running is of no use: the partitions go back to the group.
        for claim in self.claiming.drain(..) {
            claim.task.abort();
        }
        let consumer = self.consumer.clone();
        drop(self);
        // A probe's blocking metadata read may still hold it for a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&consumer) > 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Closing leaves the group; librdkafka blocks for it.
        let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
    }

    async fn run_loop(&mut self, mut shutdown: watch::Receiver<bool>) -> Result<()> {
        let interval = Duration::from_millis(self.cfg.checkpoint.interval_ms);
        let consumer = self.consumer.clone();
        // Batches decode on the workers while earlier ones are applied: one per worker, and
        // one more so a worker never waits for the next.
        let depth = self.cfg.pipeline.worker_count() + 1;
        health().set_pipeline(PipelineState::Running);
        loop {
            // Rebalance callbacks ran inside recv(); apply them before the next batch, so a
            // revoke drops the batches read ahead of it.
            self.handle_events().await?;
            self.publish_shape();
            while self.decode.in_flight() < depth {
                let batch = ready_batch(&consumer, BATCH_MESSAGES);
                if batch.is_empty() {
                    break;
                }
                self.decode.send(batch);
            }
            if self.decode.in_flight() == 0 {
                let waiting = Instant::now();
                let mut idle = false;
                tokio::select! {
                    biased;
                    _ = shutdown.changed() => {
                        if *shutdown.borrow() {
                            break;
                        }
                    }
                    msg = tokio::time::timeout(source::POLL_INTERVAL, consumer.recv()) => {
                        match msg {
                            Err(_) => idle = true,
                            Ok(Err(e)) => source::consumer_error(&e, &e.to_string()),
                            Ok(Ok(m)) => {
                                let mut batch = vec![source_message(&m, &mut None)];
                                drop(m);
                                batch.extend(ready_batch(&consumer, BATCH_MESSAGES - 1));
                                self.decode.send(batch);
                            }
                        }
                    }
                }
                idle_for("source", waiting);
                self.cycle.1 += waiting.elapsed();
                if idle {
                    self.settle_if_done().await?;
                    self.compact_when_idle()?;
                }
            } else {
                if *shutdown.borrow() {
                    break;
                }
                self.handle_events().await?;
                let waiting = Instant::now();
                let next = self.decode.next().await;
                idle_for("decode", waiting);
                if let Some(batch) = next {
                    let mut batch = batch?;
                    for d in &mut batch {
                        if !self.owns(&d.message.topic, d.message.partition) {
                            continue;
                        }
                        if let Err(e) = self.accept(d).await {
                            self.commit_before_stop(&e).await;
                            return Err(e);
                        }
                        // `checkpoint.max_records` holds within a batch too.
                        if self.checkpoint_due(interval) {
                            self.settle().await?;
                            self.begin_checkpoint().await?;
                        }
                    }
                    self.decode.recycle(batch);
                    self.upload_finished().await?;
                }
            }
            self.handle_events().await?;
            self.settle_if_done().await?;
            if self.checkpoint_due(interval) {
                // One checkpoint in flight: the next waits for it.
                self.settle().await?;
                self.begin_checkpoint().await?;
            }
        }
        self.stopping = true;
        self.settle().await?;
        if self.pending.records > 0 {
            self.checkpoint().await?;
        }
        Ok(())
    }

    /// Under `errors.policy: fail` the pipeline stops at a bad record, possibly for hours:
    /// the records before it commit first, so the table is as fresh as the source allows while
    /// it waits. Only when nothing of the bad message was applied (a multi-row message that
    /// fails midway would otherwise commit part of itself and apply it again later).
    async fn commit_before_stop(&mut self, e: &Error) {
        if e.bad_record().is_none() || !self.clean_stop || self.pending.records == 0 {
            return;
        }
        match self.checkpoint().await {
            Ok(()) => tracing::info!("Committed the records before the bad record"),
            Err(c) => {
                tracing::warn!(error = %c, "Cannot commit the records before the bad record; they are read again")
            }
        }
    }

    fn owns(&self, topic: &str, partition: i32) -> bool {
        self.assigned.contains(&(topic.to_string(), partition))
    }

    /// Applies what the consumer reported (assignments, revocations, failures) and takes over
    /// the partitions whose claims finished meanwhile.
    async fn handle_events(&mut self) -> Result<()> {
        loop {
            while let Ok(event) = self.events.try_recv() {
                match event {
                    SourceEvent::Assigned(parts, n) => self.claim(parts, n),
                    SourceEvent::Revoked(parts) => {
                        // Revocations change the shards a checkpoint in flight writes: it
                        // lands first.
                        self.settle().await?;
                        self.revoke(parts)?;
                    }
                    SourceEvent::Fatal(e) => return Err(e),
                    SourceEvent::Failed(e) => {
                        return Err(e.with("while", "partition assignment"));
                    }
                }
            }
            if !self.finish_claims().await? {
                return Ok(());
            }
        }
    }

    /// Starts claiming partitions the group just assigned, in a task of its own: the consumer
    /// keeps polling (and the member stays in its group) however long the catalog takes.
    fn claim(&mut self, parts: Vec<(String, i32)>, n: u64) {
        self.monitor.wake();
        let (table, claims) = (
            self.table_ref.clone(),
            self.consumer.context().claims.clone(),
        );
        let claimed = parts.clone();
        let task = tokio::spawn(async move {
            let current = || !claims.current(&claimed, n).is_empty();
            claim_partitions_while(&table, &claimed, current).await
        });
        self.claiming.push(Claiming { n, parts, task });
    }

    /// Takes over the partitions of every finished claim that are still waiting for it:
    /// brings their index shards level with the table, then gives them to the consumer at the
    /// table's offsets. Whether any claim finished.
    async fn finish_claims(&mut self) -> Result<bool> {
        let mut finished = false;
        while let Some(at) = self.claiming.iter().position(|c| c.task.is_finished()) {
            finished = true;
            let Claiming { n, parts, task } = self.claiming.swap_remove(at);
            let claims = self.consumer.context().claims.clone();
            let result = task.await.map_err(|e| {
                Error::new(ErrorKind::Internal, "partition claim task failed").with_source(e)
            })?;
            let live = claims.current(&parts, n);
            let (offsets, start, mut epochs) = match result {
                Ok(claimed) => claimed,
                Err(e) if live.is_empty() => {
                    tracing::info!(error = %e, "A claim of partitions revoked meanwhile failed; nothing to take over");
                    continue;
                }
                Err(e) => {
                    health().failed_with(&e);
                    tracing::error!(error = %e, "Cannot claim the assigned partitions in the table");
                    return Err(e.with("while", "claiming assigned partitions"));
                }
            };
            if live.is_empty() {
                continue;
            }
            for (topic, ps) in epochs.iter_mut() {
                ps.retain(|p, _| live.contains(&(topic.clone(), *p)));
            }
            let positions: Vec<(String, i32, Option<i64>)> = live
                .iter()
                .map(|(t, p)| {
                    let at = offsets.get(t).and_then(|m| m.get(p)).copied();
                    (t.clone(), *p, at)
                })
                .collect();
            tracing::info!(
                partitions = positions.len(),
                positions = %source::describe_positions(&positions),
                epochs = %source::describe_epochs(&epochs),
                assignment = n,
                "Partitions assigned at table offsets"
            );
            source::track_assignment(&positions, start == rdkafka::Offset::End);
            for (topic, ps) in &epochs {
                for (p, e) in ps {
                    metrics()
                        .owner_epoch
                        .with_label_values(&[topic.as_str(), &p.to_string()])
                        .set(*e);
                }
            }
            self.take_over(positions.clone(), epochs).await?;
            // Revoked (or assigned again) while their shards recovered: not this claim's.
            let readable = claims.done(&live, n);
            let given: Vec<_> = positions
                .into_iter()
                .filter(|(t, p, _)| readable.contains(&(t.clone(), *p)))
                .collect();
            source::assign_claimed(&self.consumer, &given, start)?;
        }
        Ok(finished)
    }

    /// Makes claimed partitions this member's: the tables move on to what the claim (and other
    /// members' commits) left, and each index shard is brought level with its table.
    async fn take_over(
        &mut self,
        parts: Vec<(String, i32, Option<i64>)>,
        epochs: Epochs,
    ) -> Result<()> {
        // Shards and tables change under a checkpoint in flight: it lands first.
        self.settle().await?;
        for (topic, ps) in epochs {
            self.epochs.entry(topic).or_default().extend(ps);
        }
        // The claim moved the tables on; other members may have committed too.
        for sink in self.tables.values_mut() {
            sink.refresh(&self.cfg).await?;
        }
        let added: Vec<(String, i32)> = parts.iter().map(|(t, p, _)| (t.clone(), *p)).collect();
        let names: Vec<TableName> = self.tables.keys().cloned().collect();
        for name in &names {
            self.start_without_offsets(name, &added)?;
        }
        let mut recovering = Vec::new();
        for (topic, p, _) in &parts {
            for name in &names {
                recovering.extend(self.open_shard(name, topic, *p).await?);
            }
        }
        self.recover_shards(recovering).await?;
        for (topic, p, at) in parts {
            if let Some(at) = at {
                self.committed
                    .entry(topic.clone())
                    .or_default()
                    .insert(p, at);
            }
            self.last_seen.saw(&topic, p);
            self.assigned.insert((topic, p));
        }
        // Ready once the shards' indexes are level with the table.
        health().assigned(self.assigned.iter().cloned().collect());
        Ok(())
    }

    /// Reads owned partitions again from the given offsets (others are skipped: their next
    /// owner positions them).
    fn rewind(&mut self, rewind: BTreeMap<(String, i32), i64>) -> Result<()> {
        for ((topic, p), at) in rewind {
            if !self.assigned.contains(&(topic.clone(), p)) {
                continue;
            }
            self.consumer
                .seek(
                    &topic,
                    p,
                    rdkafka::Offset::Offset(at),
                    Duration::from_secs(10),
                )
                .or_kind(ErrorKind::Kafka, || {
                    format!("cannot read {topic}/{p} again from {at}")
                })?;
        }
        Ok(())
    }

    /// Gives up revoked partitions. Buffered records of a revoked partition cannot commit any
    /// more, and they share files and checkpoints with the partitions kept: every buffered
    /// record is dropped, and the kept partitions read again from their first dropped record.
    fn revoke(&mut self, parts: Vec<(String, i32)>) -> Result<()> {
        let buffered = parts
            .iter()
            .any(|(t, p)| self.pending.end.get(t).is_some_and(|m| m.contains_key(p)));
        for (topic, p) in &parts {
            self.assigned.remove(&(topic.clone(), *p));
            for map in [&mut self.epochs, &mut self.committed] {
                if let Some(m) = map.get_mut(topic) {
                    m.remove(p);
                }
            }
        }
        // Batches read ahead are dropped too: a partition revoked now may come back before
        // they would be applied, positioned where the table says.
        let mut rewind: BTreeMap<(String, i32), i64> = self
            .decode
            .drop_ahead()
            .into_iter()
            .map(|(t, p, at)| ((t.to_string(), p), at))
            .collect();
        if buffered {
            tracing::warn!(
                records = self.pending.records,
                revoked = parts.len(),
                kept = self.assigned.len(),
                "Dropping buffered records: their partitions were revoked, and the next owner reads them again"
            );
            for (t, ps) in &self.pending.first {
                for (p, at) in ps {
                    let to = rewind.entry((t.clone(), *p)).or_insert(*at);
                    *to = (*to).min(*at);
                }
            }
            for sink in self.tables.values_mut() {
                sink.abort()?;
            }
            self.touched.clear();
            self.bad.abandon();
            self.pending = Pending::default();
            self.show_buffered();
        }
        self.rewind(rewind)?;
        for sink in self.tables.values_mut() {
            if let Some(upsert) = sink.upsert.as_mut() {
                upsert.close(&parts);
            }
        }
        self.copier.forget(&parts);
        if self.assigned.is_empty() {
            health().revoked();
        } else {
            health().assigned(self.assigned.iter().cloned().collect());
        }
        Ok(())
    }

    /// Records finished index copies and starts the ones due, after a commit.
    async fn copy_indexes(&mut self) -> Result<()> {
        self.copier.collect().await;
        for sink in self.tables.values() {
            let Some(upsert) = sink.upsert.as_ref() else {
                continue;
            };
            let label = table_label(&sink.table);
            for ((topic, p), shard) in upsert.open_shards() {
                let key = (label.clone(), topic.clone(), *p);
                if !self.copier.due(&key) {
                    continue;
                }
                let (Some(marker), Some(epoch)) = (
                    shard.marker()?,
                    self.epochs.get(topic).and_then(|m| m.get(p)).copied(),
                ) else {
                    continue;
                };
                let manifest = CopyManifest {
                    pipeline: self.cfg.pipeline_id.clone(),
                    topic: topic.clone(),
                    partition: *p,
                    epoch,
                    snapshot_id: marker.snapshot_id,
                    sequence_number: marker.sequence_number,
                    files: vec![],
                };
                let remote = copies::shard_dir(
                    &sink.table.metadata.location,
                    &self.cfg.pipeline_id,
                    topic,
                    *p,
                );
                let local = upsert.shard_dir(topic, *p).join("copy");
                let started = tokio::task::block_in_place(|| {
                    self.copier.start(
                        key,
                        shard.index(),
                        local,
                        sink.table.io.clone(),
                        remote,
                        manifest,
                    )
                });
                if let Err(e) = started {
                    metrics().index_copies.with_label_values(&["failed"]).inc();
                    tracing::warn!(topic, partition = p, error = %e, "Cannot copy an index shard");
                }
            }
        }
        Ok(())
    }

    /// Upsert tables: opens the index shard of an owned partition (restoring it from its copy
    /// beside the table when there is none here) and takes it out of its table, for
    /// [`Pipeline::recover_shards`] to bring level with the table.
    async fn open_shard(
        &mut self,
        name: &TableName,
        topic: &str,
        partition: i32,
    ) -> Result<Option<Recovering>> {
        let started = Instant::now();
        let Some(sink) = self.tables.get_mut(name) else {
            return Ok(None);
        };
        let Some(upsert) = sink.upsert.as_mut() else {
            return Ok(None);
        };
        let spec = upsert.spec.clone();
        let dir = upsert.shard_dir(topic, partition);
        let table = sink.table.clone();
        // No index here (a new host, a lost volume): the newest copy beside the table, if any.
        let mut source = "local";
        if !dir.join("db").join("CURRENT").exists() {
            let pointer = copies::pointers(&table.metadata, &self.cfg.pipeline_id)?
                .get(topic)
                .and_then(|m| m.get(&partition))
                .cloned();
            if let Some(uri) = pointer {
                let (io, db) = (table.io.clone(), dir.join("db"));
                std::fs::create_dir_all(&dir).or_kind(ErrorKind::Storage, || {
                    format!("cannot create index directory {}", dir.display())
                })?;
                let _ = std::fs::remove_dir_all(&db);
                let task = tokio::spawn(async move { copies::download(&io, &uri, &db).await });
                match source::poll_while(&self.consumer, task).await? {
                    Ok(Ok((copy, _))) => {
                        source = "copy";
                        tracing::info!(
                            topic,
                            partition,
                            epoch = copy.epoch,
                            snapshot_id = copy.snapshot_id,
                            seconds = started.elapsed().as_secs_f64(),
                            "Index restored from its copy beside the table"
                        );
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(topic, partition, error = %e, "Cannot restore the index from its copy; rebuilding it from the table");
                        let _ = std::fs::remove_dir_all(dir.join("db"));
                    }
                    Err(e) => {
                        return Err(
                            Error::new(ErrorKind::Internal, "index download task failed")
                                .with_source(e),
                        )
                    }
                }
            }
        }
        let Some(upsert) = self.tables.get_mut(name).and_then(|s| s.upsert.as_mut()) else {
            return Ok(None);
        };
        tokio::task::block_in_place(|| upsert.open_shard(topic, partition))?;
        let shard = upsert
            .take_shard(topic, partition)
            .ok_or_else(|| Error::new(ErrorKind::Internal, "opened shard vanished"))?;
        Ok(Some(Recovering {
            name: name.clone(),
            topic: topic.to_string(),
            partition,
            shard,
            spec,
            table,
            started,
            source,
        }))
    }

    /// Brings the shards level with their tables (a catch-up or a whole rebuild each), up to
    /// `pipeline.workers` at once on threads of their own: shards are independent, and a
    /// rebuild keeps a core busy. Meanwhile this task keeps polling the consumer with every
    /// partition paused, so a long rebuild never outlasts `max.poll.interval.ms` and costs the
    /// group a rebalance. Every shard goes back to its table; the first failure is returned.
    async fn recover_shards(&mut self, recovering: Vec<Recovering>) -> Result<()> {
        if recovering.is_empty() {
            return Ok(());
        }
        let pipeline = self.cfg.pipeline_id.clone();
        let workers = self.cfg.pipeline.worker_count();
        let task = tokio::spawn(crate::rebuild::on_workers(
            recovering,
            workers,
            move |mut r: Recovering| {
                let pipeline = pipeline.clone();
                async move {
                    crate::failpoint::delay_point("recovery").await;
                    let result = crate::rebuild::recover(
                        &mut r.shard,
                        &r.spec,
                        &r.table,
                        &pipeline,
                        &r.topic,
                        r.partition,
                    )
                    .await;
                    (r, result)
                }
            },
        ));
        let done = source::poll_while(&self.consumer, task)
            .await?
            .map_err(|e| {
                Error::new(ErrorKind::Internal, "index recovery task failed").with_source(e)
            })?;
        let mut failed = None;
        for joined in done {
            let (r, result) = joined.map_err(|e| {
                Error::new(ErrorKind::Internal, "index recovery task failed").with_source(e)
            })?;
            if let Some(upsert) = self.tables.get_mut(&r.name).and_then(|s| s.upsert.as_mut()) {
                upsert.put_shard(&r.topic, r.partition, r.shard);
            }
            let source = match result {
                Ok(crate::rebuild::Recovery::Rebuilt { .. }) => "rebuild",
                Ok(_) => r.source,
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            };
            let m = metrics();
            m.index_restores.with_label_values(&[source]).inc();
            m.index_restore_seconds
                .with_label_values(&[source])
                .observe(r.started.elapsed().as_secs_f64());
        }
        failed.map_or(Ok(()), Err)
    }

    /// Decodes, routes and applies one message; bad records go through the `errors` policy.
    async fn accept(&mut self, d: &mut DecodedMessage) -> Result<()> {
        let m = metrics();
        let DecodedMessage {
            message,
            decoded,
            typed,
        } = d;
        let mut decoded = std::mem::replace(decoded, Ok(Vec::new()));
        let mut typed = std::mem::take(typed);
        // A change typed with its images left out, for a shape the table has left since: the
        // message is decoded again, in full.
        if typed.iter().flatten().any(|t| t.elided && !self.takes(t)) {
            decoded = self
                .decode
                .decoder()
                .decode(message.key.as_deref(), message.payload.as_deref());
            typed.clear();
        }
        let mut typed = typed.into_iter();
        let (topic, partition, offset) = (&*message.topic, message.partition, message.offset);
        self.consumed.counter(topic, partition).inc();
        self.message_ts = message.timestamp_ms;
        let origin = || Origin {
            topic,
            partition,
            offset,
            timestamp_ms: message.timestamp_ms,
            key: message.key.as_deref(),
            value: message.payload.as_deref(),
        };
        // Whether a stop at this message leaves nothing of it buffered (see `run`).
        self.clean_stop = true;
        match decoded {
            Err(e) => self.reject(e, &origin())?,
            Ok(changes) => {
                for decoded in &changes {
                    let typed = typed.next().flatten();
                    match decoded {
                        Decoded::Change(raw) if !self.wanted(raw, topic) => {
                            m.skipped.with_label_values(&["other_table"]).inc()
                        }
                        Decoded::Change(raw) => {
                            m.records_decoded.inc();
                            if let Err(e) = self.apply(raw, typed, topic, partition, offset).await {
                                self.reject(e, &origin())?;
                            }
                            self.clean_stop = false;
                        }
                        Decoded::Tombstone => m.tombstones.inc(),
                        Decoded::Skipped(why) => m.skipped.with_label_values(&[why]).inc(),
                    }
                }
                // Back into the message, to be dropped with its batch off this thread.
                d.decoded = Ok(changes);
            }
        }
        partition_entry(&mut self.pending.end, topic).insert(partition, offset + 1);
        partition_entry(&mut self.pending.first, topic)
            .entry(partition)
            .or_insert(offset);
        self.pending.records += 1;
        self.last_seen.saw(topic, partition);
        self.show_buffered();
        if self.pending.since.is_none() {
            self.pending.since = Some(Instant::now());
            health().buffering();
        }
        Ok(())
    }

    /// Whether the table takes a change typed on a decoding thread as it is (see
    /// [`TableSink::apply`]).
    fn takes(&self, typed: &Typed) -> bool {
        self.cfg.routing.is_none()
            && self.tables.values().next().is_some_and(|sink| {
                Arc::ptr_eq(&sink.shape, &typed.shape)
                    && !(self.cfg.table.evolve_schema && typed.needs_change)
            })
    }

    /// Has the decoding threads type changes for the table's current shape, where every change
    /// goes to the one table (no routing).
    fn publish_shape(&mut self) {
        let shape = match &self.cfg.routing {
            Some(_) => None,
            None => self.tables.values().next().map(|s| s.shape.clone()),
        };
        let published = self.decode.typing_for();
        let same = match (&shape, published) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if !same {
            self.decode.type_for(shape);
        }
    }

    /// Routes a change to its table (opening or creating it) and writes it there.
    async fn apply(
        &mut self,
        raw: &RawChange,
        typed: Option<Typed>,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> Result<()> {
        let name = self.route(raw, topic)?;
        if !self.tables.contains_key(&name) {
            self.open_routed(&name, raw).await?;
        }
        // A schema change rewrites the table's metadata, which the checkpoint or compaction in
        // flight commits from: it lands first.
        if self.busy()
            && self
                .tables
                .get(&name)
                .is_some_and(|s| s.needs_schema_change(&self.cfg, raw, typed.as_ref()))
        {
            self.settle().await?;
        }
        let Some(sink) = self.tables.get_mut(&name) else {
            return Err(Error::new(ErrorKind::Internal, "routed table vanished"));
        };
        let ts = raw.source_ts_ms.or(self.message_ts);
        sink.apply(&self.cfg, raw, typed, topic, partition, offset)?;
        sink.newest_source_ms = sink.newest_source_ms.max(ts);
        if let Some(ts) = ts {
            crate::maintain::done::observe(&mut self.pending.newest, topic, partition, ts);
        }
        if !self.touched.contains(&name) {
            self.touched.push(name);
        }
        Ok(())
    }

    /// Loads a table first seen in a change, creating it from the change's fields if missing.
    async fn open_routed(&mut self, name: &TableName, raw: &RawChange) -> Result<()> {
        let table = match self.lake.load(&name.0, &name.1).await? {
            Some(table) => table,
            None => {
                let def = if self.cfg.table.columns.is_empty() {
                    definition_from_change(&self.cfg, raw)?
                } else {
                    table_definition(&self.cfg)?
                };
                tracing::info!(table = %format!("{}.{}", name.0, name.1), columns = def.columns.len(), "Creating a table for a new upstream table");
                self.lake.load_or_create(&name.0, &name.1, &def).await?
            }
        };
        self.add_table(table)?;
        self.watch_table_storage(name).await?;
        let owned: Vec<(String, i32)> = self.assigned.iter().cloned().collect();
        self.start_without_offsets(name, &owned)?;
        let mut recovering = Vec::new();
        for (topic, p) in owned {
            recovering.extend(self.open_shard(name, &topic, p).await?);
        }
        self.recover_shards(recovering).await
    }

    /// A routed table that has snapshots but none with this pipeline's offsets (another engine
    /// expired them, or the table was written before the pipeline) follows
    /// `kafka.start_without_offsets`, as a single-table pipeline's table does on assignment:
    /// `fail` stops naming the setting, `latest` writes only changes produced from now on (past
    /// the topic's end in each of `partitions`), `earliest` writes every change read.
    fn start_without_offsets(
        &mut self,
        name: &TableName,
        partitions: &[(String, i32)],
    ) -> Result<()> {
        let Some(sink) = self.tables.get_mut(name) else {
            return Ok(());
        };
        let meta = &sink.table.metadata;
        if self.cfg.routing.is_none()
            || meta.current_snapshot().is_none()
            || meta.last_snapshot_of(&self.cfg.pipeline_id).is_some()
        {
            return Ok(());
        }
        let label = format!("{}.{}", name.0, name.1);
        let policy = self.cfg.kafka.start_without_offsets;
        match policy {
            crate::config::StartWithoutOffsets::Fail => {
                return Err(Error::config(format!(
                    "routed table {label} has snapshots but none records the offsets of pipeline {} \
                     (expired by another engine, or written before this pipeline); set \
                     kafka.start_without_offsets to earliest (write every change read into it) or \
                     latest (only new changes)",
                    self.cfg.pipeline_id
                )));
            }
            crate::config::StartWithoutOffsets::Earliest => {}
            crate::config::StartWithoutOffsets::Latest => {
                for (topic, p) in partitions {
                    if sink
                        .skip_below
                        .get(topic)
                        .is_some_and(|m| m.contains_key(p))
                    {
                        continue;
                    }
                    let (_, high) = tokio::task::block_in_place(|| {
                        self.consumer
                            .fetch_watermarks(topic, *p, source::METADATA_TIMEOUT)
                    })
                    .or_kind(ErrorKind::Kafka, || {
                        format!("cannot read where {topic}/{p} ends")
                    })?;
                    sink.skip_below
                        .entry(topic.clone())
                        .or_default()
                        .insert(*p, high);
                }
            }
        }
        tracing::warn!(table = %label, start = ?policy, "The routed table holds no offsets of this pipeline; writing to it as kafka.start_without_offsets says");
        Ok(())
    }

    /// The table a change goes to.
    fn route(&self, raw: &RawChange, topic: &str) -> Result<TableName> {
        let Some(routing) = &self.cfg.routing else {
            return Ok((
                self.cfg.table.namespace.clone(),
                self.cfg.table.name.clone(),
            ));
        };
        let (database, schema, table) = match routing.by {
            RouteBy::Topic => (None, None, topic),
            RouteBy::Source => {
                let source = raw.source.as_ref().ok_or_else(|| {
                    Error::decode(
                        "the change names no upstream table to route by; use routing.by: topic",
                    )
                    .because(reason::MALFORMED)
                })?;
                (
                    source.database.as_deref(),
                    source.schema.as_deref(),
                    source.table.as_str(),
                )
            }
        };
        let fill = |template: &str| {
            let text = template
                .replace("{database}", database.unwrap_or(""))
                .replace("{schema}", schema.unwrap_or(""))
                .replace("{table}", table)
                .replace("{topic}", topic);
            let name: String = text
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            let name = name.trim_matches('_').to_string();
            if name.is_empty() {
                Err(Error::decode(format!(
                    "routing template \"{template}\" gives an empty name for this change"
                )))
            } else {
                Ok(name)
            }
        };
        Ok((fill(&routing.namespace)?, fill(&routing.name)?))
    }

    /// Whether the change's upstream table (or topic, under topic routing) is one the
    /// configuration selects.
    fn wanted(&self, raw: &RawChange, topic: &str) -> bool {
        let include = &self.cfg.table.source_tables;
        let exclude = self
            .cfg
            .routing
            .as_ref()
            .map_or(&[][..], |r| &r.exclude[..]);
        let by_topic = self
            .cfg
            .routing
            .as_ref()
            .is_some_and(|r| r.by == RouteBy::Topic);
        let matches = |pattern: &String| match (&raw.source, by_topic) {
            (_, true) => glob(pattern, topic),
            (Some(source), false) => source.matches(pattern),
            (None, false) => false,
        };
        if raw.source.is_none() && !by_topic {
            return true;
        }
        (include.is_empty() || include.iter().any(matches)) && !exclude.iter().any(matches)
    }

    /// Routes an error of one record: record-level errors follow the policies, anything else
    /// (storage, index, bugs) stops the pipeline.
    fn reject(&mut self, error: Error, origin: &Origin<'_>) -> Result<()> {
        match error.kind() {
            ErrorKind::Schema
                if self.cfg.table.on_incompatible_change == SchemaChangePolicy::DeadLetter =>
            {
                self.bad.dead_letter(error, origin)
            }
            ErrorKind::Decode | ErrorKind::Schema => self.bad.handle(error, origin),
            _ => Err(error
                .with("topic", origin.topic)
                .with("partition", origin.partition)
                .with("offset", origin.offset)),
        }
    }

    fn checkpoint_due(&self, interval: Duration) -> bool {
        let c = &self.cfg.checkpoint;
        let p = &self.pending;
        if p.records == 0 {
            return false;
        }
        if p.records >= c.max_records || p.since.is_some_and(|s| s.elapsed() >= interval) {
            return true;
        }
        // Summing open files costs a walk over them; every 256 records is often enough.
        if p.records % 256 == 0 {
            let buffered: usize = self
                .tables
                .values()
                .map(|s| {
                    s.writer.buffered_bytes() + s.upsert.as_ref().map_or(0, |u| u.buffered_bytes())
                })
                .sum();
            metrics().buffered_bytes.set(buffered as i64);
            return buffered as u64 >= c.max_buffered_bytes;
        }
        false
    }

    /// Uploads files the writers rolled over, so memory holds only open files. A failed upload
    /// fails the checkpoint those files belong to.
    async fn upload_finished(&mut self) -> Result<()> {
        let result = self.upload_rolled().await;
        if let Err(e) = &result {
            checkpoint_failed(e);
        }
        result
    }

    async fn upload_rolled(&mut self) -> Result<()> {
        for name in std::mem::take(&mut self.touched) {
            let Some(sink) = self.tables.get_mut(&name) else {
                continue;
            };
            let mut files = std::mem::take(&mut sink.rolled);
            files.extend(sink.writer.take_finished());
            if !files.is_empty() {
                let uploaded =
                    checkpoint::put_files(&sink.table.io, files, &table_label(&sink.table)).await?;
                sink.uploaded.extend(uploaded);
            }
        }
        Ok(())
    }

    /// Commits what is buffered and waits for it (and for any checkpoint in flight).
    async fn checkpoint(&mut self) -> Result<()> {
        self.settle().await?;
        self.begin_checkpoint().await?;
        self.settle().await
    }

    /// Whether a checkpoint or a compaction is in flight.
    fn busy(&self) -> bool {
        self.inflight.is_some() || self.compacting.is_some()
    }

    /// Waits for the checkpoint in flight and for the compaction it may start, if any, and
    /// takes their results.
    async fn settle(&mut self) -> Result<()> {
        self.settle_checkpoint().await?;
        self.settle_compaction().await
    }

    /// Waits for the checkpoint in flight, if any, and takes its result.
    async fn settle_checkpoint(&mut self) -> Result<()> {
        let Some(inflight) = self.inflight.as_mut() else {
            return Ok(());
        };
        let waited = Instant::now();
        let done = (&mut inflight.handle).await.unwrap_or_else(|e| {
            Err(Error::new(ErrorKind::Internal, "a checkpoint task failed").with_source(e))
        });
        let result = self.complete_checkpoint(done).await;
        metrics()
            .checkpoint_blocking
            .inc_by(waited.elapsed().as_secs_f64());
        result
    }

    /// Takes the result of the checkpoint or compaction in flight if it has ended, without
    /// waiting.
    async fn settle_if_done(&mut self) -> Result<()> {
        if self
            .inflight
            .as_ref()
            .is_some_and(|f| f.handle.is_finished())
        {
            self.settle_checkpoint().await?;
        }
        if self
            .compacting
            .as_ref()
            .is_some_and(|c| c.handle.is_finished())
        {
            self.settle_compaction().await?;
        }
        Ok(())
    }

    /// Starts a checkpoint of what is buffered: its changes leave the tables' writers and shards
    /// for a task that writes, uploads and commits them while the next records are read (see
    /// [`checkpoint`]). No checkpoint may be in flight.
    async fn begin_checkpoint(&mut self) -> Result<()> {
        let started = Instant::now();
        let result = self.start_job().await;
        metrics()
            .checkpoint_blocking
            .inc_by(started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            checkpoint_failed(e);
        }
        result
    }

    async fn start_job(&mut self) -> Result<()> {
        if self.busy() {
            return Err(Error::new(
                ErrorKind::Internal,
                "a checkpoint started while another or a compaction was in flight",
            ));
        }
        // A held retraction is not in this checkpoint: its partition commits up to it, so that
        // a restart reads it again.
        for sink in self.tables.values() {
            for ((topic, p), offset) in sink.upsert.iter().flat_map(|u| u.held_offsets()) {
                if let Some(end) = self.pending.end.get_mut(topic).and_then(|m| m.get_mut(p)) {
                    *end = (*end).min(offset);
                }
            }
        }
        let touched: Vec<(String, i32)> = self
            .pending
            .end
            .iter()
            .flat_map(|(t, parts)| parts.keys().map(move |p| (t.clone(), *p)))
            .collect();
        let checkpoint_id = self.next_checkpoint_id;
        self.next_checkpoint_id += 1;
        // Tables that changed; if none did (only tombstones, skipped or bad records), one table
        // records the offsets: the pipeline resumes at the highest offsets of any of its tables.
        let mut names: Vec<TableName> = self
            .tables
            .iter()
            .filter(|(_, s)| s.has_changes())
            .map(|(n, _)| n.clone())
            .collect();
        if names.is_empty() {
            names = self.tables.keys().take(1).cloned().collect();
        }
        // Every partition read is committed under the epoch this member claimed for it.
        let mut epochs = Epochs::new();
        for (topic, p) in &touched {
            if let Some(e) = self.epochs.get(topic).and_then(|m| m.get(p)) {
                epochs.entry(topic.clone()).or_default().insert(*p, *e);
            }
        }
        let watermarks = crate::maintain::done::checkpoint_watermarks(
            &self.pending.newest,
            self.assigned.iter(),
            &self.committed,
            &self.last_seen,
            Duration::from_millis(self.cfg.checkpoint.interval_ms),
            crate::table::now_ms(),
        );
        // Dead letters must be on the broker before the offsets that pass them commit.
        self.bad.flush().await?;
        if names.is_empty() {
            // No table exists yet (every record was bad or skipped): nothing can hold the
            // offsets, so these records are read again after a restart.
            self.pending = Pending::default();
            return Ok(());
        }
        let mut tables = Vec::with_capacity(names.len());
        let mut added = Vec::with_capacity(names.len());
        for name in &names {
            let Some(sink) = self.tables.get_mut(name) else {
                continue;
            };
            let label = table_label(&sink.table);
            let (shards, idle) = match sink.upsert.as_mut() {
                Some(u) => u.detach()?,
                None => (Vec::new(), Vec::new()),
            };
            let mut start = Offsets::new();
            for (topic, ps) in &self.pending.end {
                for p in ps.keys() {
                    if let Some(at) = sink.committed.get(topic).and_then(|c| c.get(p)) {
                        start.entry(topic.clone()).or_default().insert(*p, *at);
                    }
                }
            }
            sink.changes = 0;
            added.push((name.clone(), sink.partitions.committed()));
            tables.push(checkpoint::TableJob {
                name: name.clone(),
                table: sink.table.clone(),
                rolled: std::mem::take(&mut sink.rolled),
                writer: Some(sink.writer.detach()),
                uploaded: std::mem::take(&mut sink.uploaded),
                shards,
                idle,
                checkpoint: Checkpoint {
                    id: checkpoint_id,
                    files: Vec::new(),
                    deletes: Vec::new(),
                    start,
                    end: self.pending.end.clone(),
                    schema: sink.schema_change.take(),
                    epochs: epochs.clone(),
                    claim: false,
                    copies: self.copier.take_ready(&label),
                    source_ms: sink.newest_source_ms.take(),
                    index_markers: Vec::new(),
                    watermarks: watermarks.clone(),
                },
            });
        }
        let job = checkpoint::Job {
            id: checkpoint_id,
            committer: self.committer.clone(),
            tables,
        };
        let (began, waited) = std::mem::replace(&mut self.cycle, (Instant::now(), Duration::ZERO));
        let spare = waited >= began.elapsed() / 2;
        let pending = std::mem::take(&mut self.pending);
        self.inflight = Some(InFlight {
            handle: checkpoint::start(job, self.gate.clone()),
            id: checkpoint_id,
            started: Instant::now(),
            end: pending.end,
            records: pending.records,
            added,
            spare,
        });
        self.show_buffered();
        Ok(())
    }

    /// `inlet_write_buffered_records`: records read and not yet committed, buffered or in the
    /// checkpoint in flight (a shutdown then knows it leaves records behind).
    fn show_buffered(&self) {
        let inflight = self.inflight.as_ref().map_or(0, |f| f.records);
        metrics()
            .buffered_records
            .set((self.pending.records + inflight) as i64);
    }

    /// Takes a checkpoint's result: on success the tables, offsets and shard layouts move on,
    /// and the work that follows a commit runs (index copies, compaction, retention).
    async fn complete_checkpoint(&mut self, done: Result<checkpoint::Done>) -> Result<()> {
        let Some(inflight) = self.inflight.take() else {
            return Ok(());
        };
        self.show_buffered();
        let done = match done {
            Ok(d) => d,
            Err(e) => {
                checkpoint_failed(&e);
                return Err(e);
            }
        };
        health().succeeded(Component::Catalog);
        health().succeeded(Component::Storage);
        let m = metrics();
        let mut files = 0;
        let mut snapshots = Vec::new();
        for t in done.tables {
            snapshots.push(t.snapshot_id);
            files += t.files;
            let Some(sink) = self.tables.get_mut(&t.name) else {
                continue;
            };
            sink.table = t.table;
            if let Some(upsert) = sink.upsert.as_mut() {
                upsert.attach(t.layouts);
            }
            for (topic, ps) in &t.checkpoint.end {
                sink.committed.entry(topic.clone()).or_default().extend(ps);
            }
            let label = table_label(&sink.table);
            if let Some((_, n)) = inflight.added.iter().find(|(n, _)| *n == t.name) {
                m.partitions_created
                    .with_label_values(&[&label])
                    .inc_by(*n as u64);
            }
            m.last_commit
                .with_label_values(&[&label])
                .set(crate::table::now_ms() as f64 / 1000.0);
            if let Some(ms) = t.checkpoint.source_ms {
                m.committed_source_time(&label, ms);
            }
        }
        m.checkpoints.with_label_values(&[done.result]).inc();
        m.commit_duration
            .observe(inflight.started.elapsed().as_secs_f64());
        for (topic, ps) in &inflight.end {
            self.committed.entry(topic.clone()).or_default().extend(ps);
        }
        source::commit_group_offsets(&self.consumer, &inflight.end);
        source::track_committed(&inflight.end);
        health().checkpoint_done(Ok(()));
        m.buffered_bytes.set(
            self.tables
                .values()
                .map(|s| s.writer.buffered_bytes())
                .sum::<usize>() as i64,
        );
        tracing::info!(
            checkpoint = inflight.id,
            snapshot_id = snapshots.first().copied().unwrap_or_default(),
            tables = snapshots.len(),
            records = inflight.records,
            files,
            result = done.result,
            // Read while it was written and committed.
            records_meanwhile = self.pending.records,
            elapsed_ms = inflight.started.elapsed().as_millis() as u64,
            "Checkpoint committed"
        );
        self.after_commit(inflight.spare).await
    }

    /// Index copies, compaction, the partition services and the table services, each when
    /// due. While shutting down, no copies and no compaction: the process leaves once what it
    /// read is committed (and its partitions retained and marked as they are due), and the
    /// next start, here or on another host, copies and rewrites.
    async fn after_commit(&mut self, spare: bool) -> Result<()> {
        self.partition_tables().await?;
        if !self.stopping {
            self.copy_indexes().await?;
            if self.compactor.as_mut().is_some_and(|c| c.due(spare)) {
                self.start_compaction()?;
            }
        }
        let tables = &self.tables;
        self.services
            .after_checkpoint(|| tables.values().map(|s| s.table.clone()).collect());
        Ok(())
    }
}

impl Pipeline {
    /// Upsert tables: each shard compacts its own files, as a checkpoint of its own that moves
    /// no offsets (see `maintain::compact`). The compaction runs in a task of its own while
    /// records are read and applied; the shards lend it their layouts, and the next checkpoint
    /// (or anything else that changes shards or tables) waits for it ([`Pipeline::settle`]).
    fn start_compaction(&mut self) -> Result<()> {
        let Some(compactor) = self.compactor.as_mut() else {
            return Ok(());
        };
        let run = compactor.start();
        let mut tables = Vec::new();
        for (name, sink) in &mut self.tables {
            let Some(upsert) = sink.upsert.as_mut() else {
                continue;
            };
            let checkpoint = self.next_checkpoint_id;
            self.next_checkpoint_id += 1;
            tables.push((
                name.clone(),
                sink.table.clone(),
                upsert.lend()?,
                checkpoint,
                sink.committed.clone(),
            ));
        }
        if tables.is_empty() {
            return Ok(());
        }
        let (committer, epochs) = (self.committer.clone(), self.epochs.clone());
        let handle = checkpoint::gated(self.gate.clone(), async move {
            let mut done = Vec::with_capacity(tables.len());
            for (name, mut table, mut lent, checkpoint, fence) in tables {
                let compacted = run
                    .run(
                        &mut table, &mut lent, &committer, checkpoint, &fence, &epochs,
                    )
                    .await?;
                // Tests hold a compaction here to see records read meanwhile.
                crate::failpoint::delay_point("after_compaction").await;
                done.push(CompactedTable {
                    name,
                    committed: compacted.snapshot_id.is_some(),
                    backlog: compacted.backlog,
                    table,
                    layouts: lent.into_layouts(),
                });
            }
            Ok(done)
        });
        self.compacting = Some(Compacting {
            handle,
            started: Instant::now(),
        });
        Ok(())
    }

    /// The source is idle: when nothing is buffered or in flight and the last compaction left
    /// files due, another run starts (`services.compact_when_idle`).
    fn compact_when_idle(&mut self) -> Result<()> {
        let due = self.compactor.as_ref().is_some_and(|c| c.due_when_idle());
        if !due || self.stopping || self.pending.records > 0 || self.busy() {
            return Ok(());
        }
        self.start_compaction()
    }

    /// Waits for the compaction in flight, if any: the tables move on to its snapshots and the
    /// shards take their layouts back. An error means a commit's outcome is unknown, and the
    /// pipeline restarts (recovery applies the saved batches iff the snapshot landed).
    async fn settle_compaction(&mut self) -> Result<()> {
        let Some(compacting) = self.compacting.take() else {
            return Ok(());
        };
        let waited = Instant::now();
        let done = compacting.handle.await.unwrap_or_else(|e| {
            Err(Error::new(ErrorKind::Internal, "a compaction task failed").with_source(e))
        });
        metrics()
            .checkpoint_blocking
            .inc_by(waited.elapsed().as_secs_f64());
        let (mut committed, mut backlog) = (0, 0);
        for t in done? {
            committed += usize::from(t.committed);
            backlog += t.backlog;
            let Some(sink) = self.tables.get_mut(&t.name) else {
                continue;
            };
            sink.table = t.table;
            if let Some(upsert) = sink.upsert.as_mut() {
                upsert.attach(t.layouts);
            }
        }
        if let Some(c) = self.compactor.as_mut() {
            c.ran(backlog, committed > 0);
        }
        if committed > 0 {
            tracing::info!(
                tables = committed,
                backlog,
                elapsed_ms = compacting.started.elapsed().as_millis() as u64,
                // Read while it ran.
                records_meanwhile = self.pending.records,
                "Compaction landed"
            );
        }
        Ok(())
    }
}

impl Pipeline {
    /// Partition retention and mark-done, when due (see `maintain::PartitionServices`); an
    /// upsert table's shards drop their files as a checkpoint of their own, like compaction.
    async fn partition_tables(&mut self) -> Result<()> {
        let Some(services) = self.partition_services.as_mut() else {
            return Ok(());
        };
        if !services.due() {
            return Ok(());
        }
        for sink in self.tables.values_mut() {
            let checkpoint = self.next_checkpoint_id;
            self.next_checkpoint_id += 1;
            services
                .run(
                    &mut sink.table,
                    sink.upsert.as_mut(),
                    &self.committer,
                    checkpoint,
                    &sink.committed,
                    &self.epochs,
                    &self.assigned,
                    crate::table::now_ms(),
                )
                .await?;
        }
        Ok(())
    }
}

/// Claims `parts`, trying again after a transient fault (a catalog restarting) for as long as
/// they are still this member's to claim.
async fn claim_partitions_while(
    table: &TableRef,
    parts: &[(String, i32)],
    current: impl Fn() -> bool + Copy,
) -> Result<source::Claimed> {
    let mut delay = Duration::from_millis(200);
    loop {
        match source::claim_partitions(table, parts, current).await {
            Err(e) if e.retryable() && current() => {
                health().failed_with(&e);
                tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "Cannot claim assigned partitions yet; trying again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            other => return other,
        }
    }
}

/// Messages decoded as one batch at most.
const BATCH_MESSAGES: usize = 512;

/// A message as the pipeline keeps it once read.
/// The offsets of `topic`'s partitions, added if missing; a topic already present costs no
/// allocation (this runs for every record).
fn partition_entry<'a>(offsets: &'a mut Offsets, topic: &str) -> &'a mut BTreeMap<i32, i64> {
    if !offsets.contains_key(topic) {
        offsets.insert(topic.to_string(), BTreeMap::new());
    }
    offsets
        .get_mut(topic)
        .expect("the topic's offsets were just added")
}

/// Each partition's `inlet_source_records_consumed_total` series, looked up once.
#[derive(Default)]
struct ConsumedCounters(HashMap<String, HashMap<i32, prometheus::IntCounter>>);

impl ConsumedCounters {
    fn counter(&mut self, topic: &str, partition: i32) -> &prometheus::IntCounter {
        if !self.0.contains_key(topic) {
            self.0.insert(topic.to_string(), HashMap::new());
        }
        self.0
            .get_mut(topic)
            .expect("the topic's counters were just added")
            .entry(partition)
            .or_insert_with(|| {
                metrics()
                    .records_consumed
                    .with_label_values(&[topic, &partition.to_string()])
            })
    }
}

/// Counts time the pipeline waited with no change to apply.
fn idle_for(what: &str, since: Instant) {
    metrics()
        .idle
        .with_label_values(&[what])
        .inc_by(since.elapsed().as_secs_f64());
}

/// The message, detached from the consumer. `topic` is the topic name of the message before
/// it, shared when this one is of the same topic (as most are) rather than copied again.
fn source_message(
    m: &rdkafka::message::BorrowedMessage<'_>,
    topic: &mut Option<Arc<str>>,
) -> SourceMessage {
    let name = m.topic();
    let topic = match topic {
        Some(t) if **t == *name => t.clone(),
        _ => topic.insert(Arc::from(name)).clone(),
    };
    SourceMessage {
        topic,
        partition: m.partition(),
        offset: m.offset(),
        timestamp_ms: m.timestamp().to_millis(),
        key: m.key().map(<[u8]>::to_vec),
        payload: m.payload().map(<[u8]>::to_vec),
    }
}

/// Up to `max` messages the consumer holds already, without waiting for more.
fn ready_batch(consumer: &StreamConsumer<SourceContext>, max: usize) -> Vec<SourceMessage> {
    use futures::FutureExt;
    let mut topic = None;
    let mut batch = Vec::new();
    while batch.len() < max {
        match consumer.recv().now_or_never() {
            Some(Ok(m)) => batch.push(source_message(&m, &mut topic)),
            Some(Err(e)) => {
                source::consumer_error(&e, &e.to_string());
                break;
            }
            None => break,
        }
    }
    batch
}

/// Builds a table's upsert sink: its layout (see [`upsert_spec`]) and where its index lives.
fn upsert_sink(
    cfg: &Config,
    table: &Table,
    shape: &Shape,
    columns: &[WriteColumn],
    partition: &[PartitionColumn],
    index_root: PathBuf,
) -> Result<UpsertSink> {
    let t = &cfg.table;
    let (spec, version_columns) = upsert_spec(cfg, table, shape, columns)?;
    let template = WriterTemplate {
        columns: columns.to_vec(),
        partition: partition.to_vec(),
        location: table.metadata.location.clone(),
        target_file_bytes: t.target_file_bytes,
    };
    let mut sink = UpsertSink::new(
        spec,
        version_columns,
        index_root,
        cfg.index.clone(),
        template,
    );
    sink.order_by_offset(t.version_position == crate::config::VersionPosition::KafkaOffset);
    Ok(sink)
}

/// How an upsert table's rows are laid out: key and aggregate positions and the field id of
/// each of its data columns (`shape`), and the positions of `table.version_columns`.
fn upsert_spec(
    cfg: &Config,
    table: &Table,
    shape: &Shape,
    columns: &[WriteColumn],
) -> Result<(UpsertSpec, Vec<usize>)> {
    let t = &cfg.table;
    let name = format!("{}.{}", table.namespace, table.name);
    let position = |column: &String| {
        shape
            .columns()
            .iter()
            .position(|c| &c.name == column)
            .ok_or_else(|| Error::config(format!("column {column} is not in table {name}")))
    };
    let schema = table.metadata.current_schema()?;
    let key_names: Vec<String> = schema
        .identifier_field_ids
        .iter()
        .filter_map(|id| schema.fields.iter().find(|f| f.id == *id))
        .map(|f| f.name.clone())
        .collect();
    let key_names = if key_names.is_empty() {
        t.primary_key.clone()
    } else {
        key_names
    };
    if key_names.is_empty() {
        return Err(Error::config(format!(
            "table {name} has no primary key (identifier fields); set table.primary_key"
        )));
    }
    let key_columns = key_names.iter().map(position).collect::<Result<Vec<_>>>()?;
    let version_columns = t
        .version_columns
        .iter()
        .map(position)
        .collect::<Result<Vec<_>>>()?;
    let fields = shape
        .columns()
        .iter()
        .map(|c| {
            let id = columns
                .iter()
                .find(|w| w.name == c.name)
                .map(|w| w.field_id);
            Ok((
                id.ok_or_else(|| Error::metadata(format!("column {} has no field id", c.name)))?,
                c.ty,
            ))
        })
        .collect::<Result<_>>()?;
    let spec = UpsertSpec {
        key_columns,
        merge: t.merge_engine,
        fixed_buckets: t.buckets,
        aggregates: shape
            .columns()
            .iter()
            .map(|c| t.aggregations.get(&c.name).copied())
            .collect(),
        target_rows_per_bucket: t.target_rows_per_bucket,
        shards: 1,
        fields,
    };
    Ok((spec, version_columns))
}

/// The upsert sink of the configured table, as a single-table pipeline opens it.
pub fn upsert_sink_for(cfg: &Config, table: &Table) -> Result<UpsertSink> {
    let (columns, partition) = writer_layout(cfg, table)?;
    let (shape, _) = data_columns(cfg, &columns);
    let root = std::path::Path::new(&cfg.index.dir).join(&cfg.pipeline_id);
    upsert_sink(cfg, table, &shape, &columns, &partition, root)
}

/// Counts a failed checkpoint and shows it in health.
fn checkpoint_failed(e: &Error) {
    metrics().checkpoints.with_label_values(&["failed"]).inc();
    health().failed_with(e);
    health().checkpoint_done(Err(e));
}

/// A table as its metrics label it.
fn table_label(table: &Table) -> String {
    format!("{}.{}", table.namespace, table.name)
}

/// The columns data files are written with and the partition fields applied to rows.
/// The partition fields as the cap reads them from a change's values (the table's data
/// columns); a field whose source is none of them (a changelog metadata column) reads null.
fn cap_fields(
    write_columns: &[WriteColumn],
    partition: &[PartitionColumn],
    shape: &Shape,
) -> Vec<CapField> {
    partition
        .iter()
        .map(|p| {
            let name = write_columns.get(p.source).map(|c| c.name.as_str());
            CapField {
                source: shape
                    .columns()
                    .iter()
                    .position(|c| Some(c.name.as_str()) == name)
                    .unwrap_or(usize::MAX),
                transform: p.transform,
                name: p.name.clone(),
            }
        })
        .collect()
}

fn writer_layout(cfg: &Config, table: &Table) -> Result<(Vec<WriteColumn>, Vec<PartitionColumn>)> {
    let schema = table.metadata.current_schema()?;
    let mut write_columns: Vec<WriteColumn> = schema
        .fields
        .iter()
        .map(|f| {
            Ok(WriteColumn {
                field_id: f.id,
                name: f.name.clone(),
                ty: f.primitive()?,
                required: f.required,
            })
        })
        .collect::<Result<_>>()?;
    // Upsert rows end with `_version`, wherever another engine's columns put it in the schema
    // (readers find columns by field id, not by place).
    if cfg.table.mode == TableMode::Upsert {
        if let Some(at) = write_columns
            .iter()
            .position(|c| c.name == UPSERT_VERSION_COLUMN)
        {
            let version = write_columns.remove(at);
            write_columns.push(version);
        }
    }
    let partition = table
        .metadata
        .default_spec()?
        .fields
        .iter()
        .map(|pf| {
            let source = write_columns
                .iter()
                .position(|c| c.field_id == pf.source_id)
                .ok_or_else(|| {
                    Error::metadata(format!("partition field {} has no source column", pf.name))
                })?;
            Ok(PartitionColumn {
                source,
                transform: pf.transform()?,
                name: pf.name.clone(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((write_columns, partition))
}

/// The table's data columns (all but inlet's own metadata columns) as decoders type them, and
/// where each written value comes from.
fn data_columns(cfg: &Config, write_columns: &[WriteColumn]) -> (Shape, Vec<Slot>) {
    let mut columns = Vec::new();
    let mut layout = Vec::new();
    for w in write_columns {
        let meta = match cfg.table.mode {
            TableMode::Changelog => CHANGELOG_COLUMNS.iter().position(|c| c.0 == w.name),
            TableMode::Upsert => None,
        };
        if let Some(i) = meta {
            layout.push(Slot::Meta(i));
            continue;
        }
        if cfg.table.mode == TableMode::Upsert && w.name == UPSERT_VERSION_COLUMN {
            continue;
        }
        let time_unit = cfg
            .table
            .columns
            .iter()
            .find(|c| c.name == w.name)
            .map_or(crate::config::TimeUnit::Millis, |c| c.time_unit);
        layout.push(Slot::User(columns.len()));
        columns.push(Column {
            name: w.name.clone(),
            ty: w.ty,
            required: w.required,
            time_unit,
        });
    }
    (Shape::new(columns), layout)
}

/// Whether a column of type `column` takes values of the narrower source type `source` as is.
fn holds(column: Type, source: Type) -> bool {
    matches!(
        (column, source),
        (Type::Long, Type::Int)
            | (Type::Double, Type::Float | Type::Int | Type::Long)
            | (Type::String, _)
            | (
                Type::Timestamp | Type::TimestampTz,
                Type::Timestamp | Type::TimestampTz
            )
    ) || matches!(
        (column, source),
        (Type::Decimal { precision: p, scale: s }, Type::Decimal { precision: p2, scale: s2 })
            if s == s2 && p2 <= p
    )
}
