//! One pipeline: source → decode → write → commit, in one task. Checkpoints fire on time,
//! record count or buffered bytes; a rebalance drops what is buffered so the new owner of a
//! partition re-reads it from the table's offsets.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::consumer::StreamConsumer;
use rdkafka::message::BorrowedMessage;
use rdkafka::Message;
use serde_json::Value as Json;
use tokio::sync::{mpsc, watch};

use crate::commit::{Checkpoint, CommitOutcome, Committer, Offsets};
use crate::config::{Config, SchemaChangePolicy, TableMode, CHANGELOG_COLUMNS};
use crate::decode::{decoder_for, ChangeRecord, Column, Decoded, Decoder, RawChange, Shape};
use crate::dlq::{BadRecords, Origin};
use crate::error::{Error, ErrorKind, Result};
use crate::index::Marker;
use crate::metrics::metrics;
use crate::source::{self, SourceContext, SourceEvent, TableRef};
use crate::table::catalog::SqlCatalog;
use crate::table::io::{normalize_location, FileIO};
use crate::table::manifest::DataFile;
use crate::table::metadata::{Schema, SchemaField};
use crate::table::transform::Transform;
use crate::table::types::{Type, Value};
use crate::table::{Table, TableDefinition};
use crate::upsert::{Outcome, UpsertSink, UpsertSpec, WriterTemplate};
use crate::write::parquet::WriteColumn;
use crate::write::{DataWriter, PartitionColumn};

/// The column upsert tables add: each row's version, so the index can be rebuilt exactly.
pub const UPSERT_VERSION_COLUMN: &str = "_version";

/// The table definition a config asks for.
pub fn table_definition(cfg: &Config) -> Result<TableDefinition> {
    let t = &cfg.table;
    let mut columns = Vec::new();
    for c in &t.columns {
        // Changelog rows of deletes carry only what the before image has, which for
        // PostgreSQL's default replica identity is the key; other columns must be nullable.
        let required =
            c.required && (t.mode != TableMode::Changelog || t.primary_key.contains(&c.name));
        columns.push((c.name.clone(), Type::parse(&c.ty)?, required, c.doc.clone()));
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
    let partition = t
        .partition_by
        .iter()
        .map(|p| {
            let transform = Transform::parse(&p.transform)?;
            Ok((
                p.column.clone(),
                transform,
                crate::config::partition_field_name(p, transform),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut partition = partition;
    if let (TableMode::Upsert, Some(n), [key]) = (t.mode, t.buckets, t.primary_key.as_slice()) {
        partition.push((key.clone(), Transform::Bucket(n), format!("{key}_bucket")));
    }
    Ok(TableDefinition {
        columns,
        identifier: t.primary_key.clone(),
        partition,
        properties: t.properties.clone(),
    })
}

/// Opens the catalog, then loads or creates the table.
pub async fn open_table(cfg: &Config) -> Result<Table> {
    let catalog = SqlCatalog::connect(&cfg.catalog.uri, &cfg.catalog.name).await?;
    let io = FileIO::default();
    let warehouse = normalize_location(&cfg.catalog.warehouse)?;
    let def = table_definition(cfg)?;
    Table::load_or_create(
        &catalog,
        &io,
        &cfg.table.namespace,
        &cfg.table.name,
        &warehouse,
        &def,
    )
    .await
}

/// What a checkpoint has gathered so far.
#[derive(Default)]
struct Pending {
    records: u64,
    since: Option<Instant>,
    uploaded: Vec<DataFile>,
    /// Next offset to read per partition that has advanced since the last commit.
    end: Offsets,
}

/// Where each value of a written row comes from.
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// The decoded row's value at this position.
    User(usize),
    /// The changelog metadata column at this position of [`CHANGELOG_COLUMNS`].
    Meta(usize),
}

/// A running pipeline.
pub struct Pipeline {
    cfg: Config,
    table: Table,
    decoder: Box<dyn Decoder>,
    /// The table's data columns, which decoded changes are typed for.
    shape: Shape,
    /// Changelog tables: the written row's values in table column order.
    layout: Vec<Slot>,
    bad: BadRecords,
    /// A schema change made since the last commit, committed with the next checkpoint.
    schema_change: Option<Schema>,
    /// Files finished by a schema change, awaiting upload.
    rolled: Vec<crate::write::WrittenFile>,
    writer: DataWriter,
    committer: Committer,
    consumer: Arc<StreamConsumer<SourceContext>>,
    events: mpsc::UnboundedReceiver<SourceEvent>,
    /// Table offsets of the owned partitions as of the last commit or assignment.
    committed: Offsets,
    /// Partitions this member owns.
    assigned: HashSet<(String, i32)>,
    pending: Pending,
    next_checkpoint_id: u64,
    /// Upsert tables: the shards and their indexes.
    upsert: Option<UpsertSink>,
}

impl Pipeline {
    /// Connects to the catalog and Kafka; the table is created if missing.
    pub async fn start(cfg: Config) -> Result<Pipeline> {
        let table = open_table(&cfg).await?;
        let (write_columns, partition) = writer_layout(&table)?;
        let (shape, layout) = data_columns(&cfg, &write_columns);
        let upsert = match cfg.table.mode {
            TableMode::Changelog => None,
            TableMode::Upsert => Some(upsert_sink(&cfg, &table, &write_columns, &partition)?),
        };
        let writer = DataWriter::new(
            write_columns,
            partition,
            &table.metadata.location,
            cfg.table.target_file_bytes,
            "",
        );
        let table_ref = TableRef {
            catalog: table.catalog.clone(),
            io: table.io.clone(),
            namespace: table.namespace.clone(),
            name: table.name.clone(),
            pipeline_id: cfg.pipeline_id.clone(),
        };
        let (consumer, events) = source::consumer(&cfg.kafka, table_ref)?;
        let consumer = Arc::new(consumer);
        let mut upsert = upsert;
        if let Some(sink) = upsert.as_mut() {
            sink.spec.shards = source::partition_count(&consumer, &cfg.kafka.topics[0])?;
        }
        let committer = Committer {
            pipeline_id: cfg.pipeline_id.clone(),
            writer_id: uuid::Uuid::new_v4().to_string(),
            retries: cfg.checkpoint.commit_retries.max(1),
        };
        tracing::info!(
            table = %format!("{}.{}", table.namespace, table.name),
            location = %table.metadata.location,
            topics = ?cfg.kafka.topics,
            "Pipeline started"
        );
        Ok(Pipeline {
            decoder: decoder_for(&cfg.format, &cfg.table.primary_key)?,
            shape,
            layout,
            bad: BadRecords::new(&cfg)?,
            schema_change: None,
            rolled: Vec::new(),
            cfg,
            table,
            writer,
            committer,
            consumer,
            events,
            committed: Offsets::new(),
            assigned: HashSet::new(),
            pending: Pending::default(),
            next_checkpoint_id: 1,
            upsert,
        })
    }

    /// Runs until `shutdown` turns true, then commits what is buffered and returns.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> Result<()> {
        let interval = Duration::from_millis(self.cfg.checkpoint.interval_ms);
        let consumer = self.consumer.clone();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.changed() => {
                    if *shutdown.borrow() {
                        break;
                    }
                }
                msg = tokio::time::timeout(source::POLL_INTERVAL, consumer.recv()) => {
                    // Rebalance callbacks ran inside recv(); apply them before the message.
                    self.handle_events().await?;
                    match msg {
                        Err(_) => {}
                        Ok(Err(e)) => tracing::warn!(error = %e, "Kafka consumer error"),
                        Ok(Ok(m)) => {
                            if self.owns(m.topic(), m.partition()) {
                                self.accept(&m)?;
                                self.upload_finished().await?;
                            }
                        }
                    }
                }
            }
            self.handle_events().await?;
            if self.checkpoint_due(interval) {
                self.checkpoint().await?;
            }
        }
        if self.pending.records > 0 {
            self.checkpoint().await?;
        }
        Ok(())
    }

    fn owns(&self, topic: &str, partition: i32) -> bool {
        self.assigned.contains(&(topic.to_string(), partition))
    }

    async fn handle_events(&mut self) -> Result<()> {
        while let Ok(event) = self.events.try_recv() {
            match event {
                SourceEvent::Assigned(parts) => {
                    if self.upsert.is_some() {
                        self.table.refresh().await?;
                    }
                    for (topic, p, at) in parts {
                        if let Some(sink) = self.upsert.as_mut() {
                            let spec = sink.spec.clone();
                            let shard = tokio::task::block_in_place(|| sink.open_shard(&topic, p))?;
                            crate::rebuild::recover(
                                shard,
                                &spec,
                                &self.table,
                                &self.cfg.pipeline_id,
                                &topic,
                                p,
                            )
                            .await?;
                        }
                        if let Some(at) = at {
                            self.committed
                                .entry(topic.clone())
                                .or_default()
                                .insert(p, at);
                        }
                        self.assigned.insert((topic, p));
                    }
                }
                SourceEvent::Revoked => {
                    if self.pending.records > 0 {
                        tracing::warn!(
                            records = self.pending.records,
                            "Dropping buffered records of revoked partitions; their next owner reads them again"
                        );
                    }
                    self.writer.abort();
                    self.rolled.clear();
                    self.bad.abandon();
                    if let Some(sink) = self.upsert.as_mut() {
                        sink.close_all();
                    }
                    self.pending = Pending::default();
                    self.assigned.clear();
                    self.committed.clear();
                }
                SourceEvent::Failed(why) => {
                    return Err(Error::new(
                        ErrorKind::Kafka,
                        format!("partition assignment failed: {why}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Decodes and applies one message; bad records go through the `errors` policy.
    fn accept(&mut self, message: &BorrowedMessage<'_>) -> Result<()> {
        let m = metrics();
        m.records_consumed.inc();
        let (topic, partition, offset) = (message.topic(), message.partition(), message.offset());
        let origin = || Origin {
            topic,
            partition,
            offset,
            timestamp_ms: message.timestamp().to_millis(),
            key: message.key(),
            value: message.payload(),
        };
        match self.decoder.decode(message.key(), message.payload()) {
            // A record-level error follows the policies; an unreachable schema registry stops
            // the pipeline (retryably) rather than skipping records.
            Err(e) => self.reject(e, &origin())?,
            Ok(changes) => {
                for decoded in changes {
                    match decoded {
                        Decoded::Change(raw) if !self.wanted(&raw) => {
                            m.skipped.with_label_values(&["other_table"]).inc()
                        }
                        Decoded::Change(raw) => {
                            m.records_decoded.inc();
                            if let Err(e) = self.apply(raw, topic, partition, offset) {
                                self.reject(e, &origin())?;
                            }
                        }
                        Decoded::Tombstone => m.tombstones.inc(),
                        Decoded::Skipped(why) => m.skipped.with_label_values(&[why]).inc(),
                    }
                }
            }
        }
        self.pending
            .end
            .entry(topic.to_string())
            .or_default()
            .insert(partition, offset + 1);
        self.pending.records += 1;
        self.pending.since.get_or_insert_with(Instant::now);
        Ok(())
    }

    /// Whether the change's upstream table is one `table.source_tables` selects.
    fn wanted(&self, raw: &RawChange) -> bool {
        let patterns = &self.cfg.table.source_tables;
        match &raw.source {
            Some(source) if !patterns.is_empty() => patterns.iter().any(|p| source.matches(p)),
            _ => true,
        }
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

    /// Evolves the schema if the change needs it, types the change and writes it.
    fn apply(&mut self, raw: RawChange, topic: &str, partition: i32, offset: i64) -> Result<()> {
        self.evolve(&raw)?;
        let record = self
            .shape
            .record(&raw)
            .map_err(|e| self.incompatible(&raw, &e).unwrap_or(e))?;
        let m = metrics();
        if let Some(sink) = self.upsert.as_mut() {
            match sink.accept(topic, partition, offset, record)? {
                Outcome::Applied => {}
                Outcome::Stale => m.stale.inc(),
                Outcome::Ignored => m.ignored.inc(),
            }
        } else {
            let row = self.changelog_row(record, partition, offset)?;
            tokio::task::block_in_place(|| self.writer.write(row))?;
            m.rows_written.inc();
        }
        Ok(())
    }

    /// Adds the change's new fields as nullable columns and widens columns whose source type
    /// widened, per the Iceberg spec's promotions. The new schema commits with the next
    /// checkpoint, together with the first rows that use it.
    fn evolve(&mut self, raw: &RawChange) -> Result<()> {
        if !self.cfg.table.evolve_schema {
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
        let table_name = format!("{}.{}", self.table.namespace, self.table.name);
        if self.upsert.is_some() {
            let names: Vec<&str> = added
                .iter()
                .chain(&promoted)
                .map(|(n, _)| n.as_str())
                .collect();
            return Err(Error::new(
                ErrorKind::Schema,
                format!(
                    "table {table_name}: the source added or widened {names:?}; upsert tables do \
                     not evolve their schema while running: add the columns to table.columns, \
                     alter the table, and restart"
                ),
            ));
        }
        self.change_schema(&added, &promoted)
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
        added: &[(String, Type)],
        promoted: &[(String, Type)],
    ) -> Result<()> {
        let meta = &mut self.table.metadata;
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
            schema.fields.push(SchemaField {
                id: meta.last_column_id,
                name: name.clone(),
                required: false,
                ty: Json::String(ty.to_string()),
                doc: None,
                extra: Default::default(),
            });
            m.schema_changes.with_label_values(&["add_column"]).inc();
        }
        schema.schema_id = meta.schemas.iter().map(|s| s.schema_id).max().unwrap_or(0) + 1;
        meta.current_schema_id = schema.schema_id;
        meta.schemas.push(schema.clone());
        self.schema_change = Some(schema);
        let (write_columns, _) = writer_layout(&self.table)?;
        let (shape, layout) = data_columns(&self.cfg, &write_columns);
        self.shape = shape;
        self.layout = layout;
        tokio::task::block_in_place(|| self.writer.change_columns(write_columns))?;
        self.rolled.extend(self.writer.take_finished());
        Ok(())
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
            let buffered = self.writer.buffered_bytes()
                + self.upsert.as_ref().map_or(0, |u| u.buffered_bytes());
            metrics().buffered_bytes.set(buffered as i64);
            return buffered as u64 >= c.max_buffered_bytes;
        }
        false
    }

    /// Uploads files the writer rolled over, so memory holds only open files.
    async fn upload_finished(&mut self) -> Result<()> {
        let mut files = std::mem::take(&mut self.rolled);
        files.extend(self.writer.take_finished());
        self.upload(files).await
    }

    async fn upload(&mut self, files: Vec<crate::write::WrittenFile>) -> Result<()> {
        let uploaded = put_files(&self.table.io, files).await?;
        self.pending.uploaded.extend(uploaded);
        Ok(())
    }

    /// Closes the open files, uploads them and commits one snapshot with the offsets.
    async fn checkpoint(&mut self) -> Result<()> {
        let started = Instant::now();
        let m = metrics();
        let mut files = std::mem::take(&mut self.rolled);
        files.extend(tokio::task::block_in_place(|| self.writer.close())?);
        // Dead letters must be on the broker before the offsets that pass them commit.
        self.bad.flush().await?;
        let touched: Vec<(String, i32)> = self
            .pending
            .end
            .iter()
            .flat_map(|(t, parts)| parts.keys().map(move |p| (t.clone(), *p)))
            .collect();
        let writer_id = self.committer.writer_id.clone();
        let checkpoint_id = self.next_checkpoint_id;
        let prepared = match self.upsert.as_mut() {
            Some(sink) => Some(tokio::task::block_in_place(|| {
                sink.prepare(&touched, &writer_id, checkpoint_id)
            })?),
            None => None,
        };
        crate::failpoint::crash_point("before_upload");
        self.upload(files).await?;
        let (mut deletes, mut shard_batches) = (Vec::new(), Vec::new());
        if let Some(p) = prepared {
            m.position_deletes.inc_by(
                p.deletes
                    .iter()
                    .map(|f| f.data_file.record_count as u64)
                    .sum(),
            );
            self.upload(p.data).await?;
            deletes = put_files(&self.table.io, p.deletes).await?;
            shard_batches = p.shards;
        }
        crate::failpoint::crash_point("after_upload");
        let mut start = Offsets::new();
        for (topic, parts) in &self.pending.end {
            for p in parts.keys() {
                if let Some(at) = self.committed.get(topic).and_then(|c| c.get(p)) {
                    start.entry(topic.clone()).or_default().insert(*p, *at);
                }
            }
        }
        let cp = Checkpoint {
            schema: self.schema_change.clone(),
            id: self.next_checkpoint_id,
            files: std::mem::take(&mut self.pending.uploaded),
            deletes,
            start,
            end: std::mem::take(&mut self.pending.end),
        };
        let records = self.pending.records;
        match self.committer.commit(&mut self.table, &cp).await {
            Ok(outcome) => {
                let (result, snapshot_id) = match outcome {
                    CommitOutcome::Committed { snapshot_id, .. } => ("committed", snapshot_id),
                    CommitOutcome::AlreadyCommitted { snapshot_id } => {
                        ("already_committed", snapshot_id)
                    }
                };
                crate::failpoint::crash_point("after_commit");
                if let Some(sink) = self.upsert.as_mut() {
                    let snapshot = self
                        .table
                        .metadata
                        .snapshots
                        .iter()
                        .find(|s| s.snapshot_id == snapshot_id)
                        .ok_or_else(|| {
                            Error::new(
                                ErrorKind::Internal,
                                format!("committed snapshot {snapshot_id} is not in the table"),
                            )
                        })?;
                    let marker = Marker {
                        snapshot_id,
                        sequence_number: snapshot.sequence_number,
                    };
                    tokio::task::block_in_place(|| sink.finish(shard_batches, marker))?;
                }
                m.checkpoints.with_label_values(&[result]).inc();
                m.commit_duration.observe(started.elapsed().as_secs_f64());
                for (topic, parts) in &cp.end {
                    self.committed
                        .entry(topic.clone())
                        .or_default()
                        .extend(parts);
                }
                source::commit_group_offsets(&self.consumer, &cp.end);
                self.pending = Pending::default();
                self.schema_change = None;
                self.next_checkpoint_id += 1;
                m.buffered_bytes.set(self.writer.buffered_bytes() as i64);
                tracing::info!(
                    checkpoint = cp.id,
                    snapshot_id,
                    records,
                    files = cp.files.len(),
                    result,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "Checkpoint committed"
                );
                Ok(())
            }
            Err(e) => {
                m.checkpoints.with_label_values(&["failed"]).inc();
                Err(e.with("checkpoint", cp.id))
            }
        }
    }
}

/// Builds the upsert sink: key and version column positions, shard count, index location.
fn upsert_sink(
    cfg: &Config,
    table: &Table,
    columns: &[WriteColumn],
    partition: &[PartitionColumn],
) -> Result<UpsertSink> {
    let t = &cfg.table;
    let position = |name: &String| {
        t.columns
            .iter()
            .position(|c| &c.name == name)
            .ok_or_else(|| Error::config(format!("column {name} is not in table.columns")))
    };
    let key_columns = t
        .primary_key
        .iter()
        .map(position)
        .collect::<Result<Vec<_>>>()?;
    let version_columns = t
        .version_columns
        .iter()
        .map(position)
        .collect::<Result<Vec<_>>>()?;
    let spec = UpsertSpec {
        key_columns,
        merge: t.merge_engine,
        fixed_buckets: t.buckets,
        aggregates: t
            .columns
            .iter()
            .map(|c| t.aggregations.get(&c.name).copied())
            .collect(),
        target_rows_per_bucket: t.target_rows_per_bucket,
        shards: 1,
    };
    let index_root = std::path::Path::new(&cfg.index.dir).join(&cfg.pipeline_id);
    let template = WriterTemplate {
        columns: columns.to_vec(),
        partition: partition.to_vec(),
        location: table.metadata.location.clone(),
        target_file_bytes: t.target_file_bytes,
    };
    Ok(UpsertSink::new(
        spec,
        version_columns,
        index_root,
        cfg.index.clone(),
        template,
    ))
}

/// Uploads files; returns their manifest descriptions.
async fn put_files(io: &FileIO, files: Vec<crate::write::WrittenFile>) -> Result<Vec<DataFile>> {
    let m = metrics();
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let len = f.bytes.len() as u64;
        io.put(&f.data_file.file_path, Bytes::from(f.bytes)).await?;
        m.files_written.inc();
        m.bytes_written.inc_by(len);
        out.push(f.data_file);
    }
    Ok(out)
}

/// The columns data files are written with and the partition fields applied to rows.
fn writer_layout(table: &Table) -> Result<(Vec<WriteColumn>, Vec<PartitionColumn>)> {
    let schema = table.metadata.current_schema()?;
    let write_columns: Vec<WriteColumn> = schema
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
    let partition = table
        .metadata
        .default_spec()?
        .fields
        .iter()
        .map(|pf| {
            let source = schema
                .fields
                .iter()
                .position(|f| f.id == pf.source_id)
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

/// The upsert sink a config asks for, on an opened table.
pub fn upsert_sink_for(cfg: &Config, table: &Table) -> Result<UpsertSink> {
    let (columns, partition) = writer_layout(table)?;
    upsert_sink(cfg, table, &columns, &partition)
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
