//! One table a pipeline writes ([`TableSink`]): how changes are typed for its columns, follow
//! its schema, and reach its writer or its upsert engine.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value as Json;

use crate::commit::{table_offsets, Offsets, SchemaChange};
use crate::config::{Config, FormatKind, TableMode, CHANGELOG_COLUMNS};
use crate::metrics::metrics;
use crate::upsert::{Outcome, UpsertSink, UpsertSpec, WriterTemplate};
use crate::write::cap::{Admit, CapField, PartitionCap};
use crate::write::parquet::WriteColumn;
use crate::write::{DataWriter, PartitionColumn, WrittenFile};
use inlet_common::error::{Error, ErrorKind, Result};
use inlet_decode::pool::Typed;
use inlet_decode::{unavailable_columns, ChangeRecord, Column, Op, RawChange, Shape};
use inlet_iceberg::manifest::{DataFile, FileContent};
use inlet_iceberg::metadata::SchemaField;
use inlet_iceberg::types::{Type, Value};
use inlet_iceberg::Table;

use super::table_label;
use inlet_iceberg::keys::UPSERT_VERSION_COLUMN;
use inlet_iceberg::metadata::new_column_position;

/// Where each value of a written row comes from.
#[derive(Debug, Clone, Copy)]
pub(super) enum Slot {
    /// The decoded row's value at this position.
    User(usize),
    /// The changelog metadata column at this position of [`CHANGELOG_COLUMNS`].
    Meta(usize),
}

/// One table a pipeline writes: its writer, its upsert engine and what it holds uncommitted.
pub(super) struct TableSink {
    pub(super) table: Table,
    /// The table's data columns, which decoded changes are typed for; a schema change makes a
    /// new one, so changes typed ahead for the old one are told apart.
    pub(super) shape: Arc<Shape>,
    /// Changelog tables: the written row's values in table column order.
    pub(super) layout: Vec<Slot>,
    pub(super) writer: DataWriter,
    /// Upsert tables: the shards and their indexes.
    pub(super) upsert: Option<UpsertSink>,
    /// Upsert tables: the one topic whose partitions are the shards (a key lives in one of its
    /// partitions); changes from any other topic are refused.
    pub(super) shard_topic: Option<String>,
    /// Topics whose changes reached the table since the last commit: its next checkpoint
    /// records their offsets.
    pub(super) fed: BTreeSet<String>,
    /// Listed in the pipeline's tables touched since their finished files were last uploaded.
    pub(super) touched: bool,
    /// A schema change made since the last commit, committed with the next checkpoint.
    pub(super) schema_change: Option<SchemaChange>,
    /// Files finished by rolling or a schema change, awaiting upload.
    pub(super) rolled: Vec<WrittenFile>,
    /// Files uploaded for the next commit.
    pub(super) uploaded: Vec<DataFile>,
    /// Changes written since the last commit.
    pub(super) changes: u64,
    /// The table's own offsets for this pipeline as last seen: the fence of its next commit.
    pub(super) committed: Offsets,
    /// A routed table with snapshots but none of this pipeline, under
    /// `kafka.start_without_offsets: latest`: per partition, the end of the topic when the table
    /// was first routed to; changes before it are not written to the table.
    pub(super) skip_below: Offsets,
    /// Newest source timestamp (ms) of the changes written since the last commit.
    pub(super) newest_source_ms: Option<i64>,
    /// Upsert tables: the share of stale changes per partition, to tell when a source's
    /// positions went backwards.
    pub(super) stale_watch: BTreeMap<String, BTreeMap<i32, StaleWatch>>,
    /// The partitions a checkpoint may add.
    pub(super) partitions: PartitionCap,
}

/// Counts a partition's changes in windows, and says when most of a window was stale after a
/// window that was not: what a source whose positions restarted (MySQL failover, binlog reset)
/// looks like.
#[derive(Default)]
pub(super) struct StaleWatch {
    pub(super) changes: u32,
    pub(super) stale: u32,
    /// Whether the last full window was mostly stale.
    pub(super) alarmed: bool,
}

impl StaleWatch {
    const WINDOW: u32 = 1000;

    /// Counts a change; `Some(stale share)` when a window ends mostly stale after one that
    /// was not.
    pub(super) fn count(&mut self, stale: bool) -> Option<f64> {
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
    /// Opens the table for writing; an upsert table's shards are the `shards` partitions of
    /// `shard_topic`.
    pub(super) fn open(
        cfg: &Config,
        table: Table,
        shards: u32,
        shard_topic: Option<String>,
        index_root: PathBuf,
    ) -> Result<TableSink> {
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
                .get(inlet_iceberg::keys::SUMMARY_SOURCE_TS)
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
            shard_topic: upsert.as_ref().and(shard_topic),
            upsert,
            fed: BTreeSet::new(),
            touched: false,
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
    pub(super) fn has_changes(&self) -> bool {
        self.changes > 0
            || self.schema_change.is_some()
            || !self.rolled.is_empty()
            || !self.uploaded.is_empty()
    }

    /// Drops everything uncommitted (partitions were revoked); the index shards of owned
    /// partitions stay open.
    pub(super) fn abort(&mut self) -> Result<()> {
        self.writer.abort();
        self.rolled.clear();
        self.uploaded.clear();
        self.changes = 0;
        self.fed.clear();
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
    pub(super) async fn refresh(&mut self, cfg: &Config) -> Result<()> {
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
    pub(super) fn apply(
        &mut self,
        cfg: &Config,
        raw: &RawChange,
        typed: Option<&mut Typed>,
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
        if let Some(own) = self.shard_topic.as_deref().filter(|own| *own != topic) {
            return Err(other_topic(&table_label(&self.table), own));
        }
        // Typed on a decoding thread for this very shape, with nothing to change in it: the
        // schema stays, and the record is what typing here would give.
        let elided = typed.as_ref().is_some_and(|t| t.elided);
        let typed = typed
            .filter(|t| Arc::ptr_eq(&t.shape, &self.shape))
            .filter(|t| !(cfg.table.evolve_schema && t.needs_change));
        let mut typed_here;
        let record: &mut ChangeRecord = match typed {
            // Left in the message: its values are freed with its batch, off this thread.
            Some(t) => match &mut t.record {
                Ok(record) => record,
                Err(e) => {
                    let e = std::mem::replace(e, Error::new(ErrorKind::Internal, "taken"));
                    return Err(self.incompatible(raw, &e).unwrap_or(e));
                }
            },
            // `Pipeline::accept` decodes such a change again in full before it gets here.
            None if elided => {
                return Err(Error::new(
                    ErrorKind::Internal,
                    "a change typed without its images reached a table of another shape",
                ))
            }
            None => {
                self.evolve(cfg, raw)?;
                typed_here = self
                    .shape
                    .record(raw)
                    .map_err(|e| self.incompatible(raw, &e).unwrap_or(e))?;
                &mut typed_here
            }
        };
        // Columns the change leaves unchanged, in Debezium's words.
        let mut unavailable = Vec::new();
        let placeholder = cfg.format.unavailable_value_placeholder.as_str();
        if matches!(
            cfg.format.kind,
            FormatKind::DebeziumJson | FormatKind::DebeziumAvro
        ) && !placeholder.is_empty()
        {
            if let Some(after) = record.after.as_deref() {
                unavailable_columns(after, placeholder, &mut unavailable);
            }
        }
        if let Some(after) = record.after.as_deref() {
            self.admit_partition(after)?;
        }
        let m = metrics();
        if let Some(sink) = self.upsert.as_mut() {
            let outcome = sink.accept(topic, partition, offset, record, &unavailable)?;
            match outcome {
                Outcome::Applied if !unavailable.is_empty() => m
                    .unavailable_values
                    .with_label_values(&["kept"])
                    .inc_by(unavailable.len() as u64),
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
                     table.version_columns or table.version_position: kafka-offset (docs/operating.md: sources whose \
                     positions go backwards)"
                );
            }
        } else if record.op == Op::Update && record.after.is_none() {
            // A retraction (Flink's `-U`): the `+U` after it is the change.
            m.skipped.with_label_values(&["update_before"]).inc();
        } else {
            // A changelog row records the change as it came, and the value this one did not
            // carry is unknown.
            if let Some(after) = record.after.as_mut() {
                for c in &unavailable {
                    after[usize::from(*c)] = Value::Null;
                }
                m.unavailable_values
                    .with_label_values(&["null"])
                    .inc_by(unavailable.len() as u64);
            }
            // The written row keeps the change's values.
            let record = ChangeRecord {
                before: record.before.take(),
                after: record.after.take(),
                version: record.version.take(),
                ..*record
            };
            let row = self.changelog_row(record, partition, offset)?;
            tokio::task::block_in_place(|| self.writer.write(row))?;
        }
        self.changes += 1;
        if !self.fed.contains(topic) {
            self.fed.insert(topic.to_string());
        }
        Ok(())
    }

    /// Whether the table's index shards include `topic`'s partitions: an upsert table's
    /// follow its one topic.
    pub(super) fn reads_shards_of(&self, topic: &str) -> bool {
        self.upsert.is_some() && self.shard_topic.as_deref() == Some(topic)
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
        .because(inlet_decode::reason::TOO_MANY_PARTITIONS))
    }

    /// Adds the change's new fields as nullable columns and widens columns whose source type
    /// widened, per the Iceberg spec's promotions. The new schema commits with the next
    /// checkpoint, together with the first rows that use it.
    /// Whether writing `raw` changes the table's schema.
    pub(super) fn needs_schema_change(
        &self,
        cfg: &Config,
        raw: &RawChange,
        typed: Option<&Typed>,
    ) -> bool {
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
                inlet_iceberg::widened(c.ty, declared).then(|| (c.name.clone(), declared))
            })
            .collect();
        let added: Vec<(String, Type)> = raw
            .new_fields(self.shape.columns())
            .into_iter()
            .map(|(name, ty)| {
                let ty = super::lake::configured_type(cfg, raw, &name).unwrap_or(ty);
                (name, ty)
            })
            .collect();
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
                        d != c.ty && !holds(c.ty, d) && !inlet_iceberg::widened(c.ty, d)
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

/// An upsert table's key lives in one partition of one topic: a change of the table from
/// another topic may hold a key a shard of the first holds, so it is refused rather than
/// written twice.
pub(super) fn other_topic(table: &str, own: &str) -> Error {
    Error::decode(format!(
        "upsert table {table} takes its changes from topic {own} (its keys live in that topic's partitions); \
         a change of it from a second topic could duplicate its keys. Route the second topic to another \
         table (routing.name, routing.exclude), or send the table's changes through one topic"
    ))
    .because(inlet_decode::reason::OTHER_TOPIC)
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

/// The columns data files are written with and the partition fields applied to rows.
fn writer_layout(cfg: &Config, table: &Table) -> Result<(Vec<WriteColumn>, Vec<PartitionColumn>)> {
    let schema = table.metadata.current_schema()?;
    let mut write_columns = WriteColumn::of_schema(schema)?;
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
pub(super) fn holds(column: Type, source: Type) -> bool {
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
