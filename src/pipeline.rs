//! One pipeline: source → decode → write → commit, in one task. Checkpoints fire on time,
//! record count or buffered bytes; a rebalance drops what is buffered so the new owner of a
//! partition re-reads it from the table's offsets.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::consumer::StreamConsumer;
use rdkafka::Message;
use tokio::sync::{mpsc, watch};

use crate::commit::{Checkpoint, CommitOutcome, Committer, Offsets};
use crate::config::{Config, TableMode, CHANGELOG_COLUMNS};
use crate::decode::debezium::DebeziumJson;
use crate::decode::{ChangeRecord, Column, Decoded, Decoder};
use crate::error::{Error, ErrorKind, Result};
use crate::index::Marker;
use crate::metrics::metrics;
use crate::source::{self, SourceContext, SourceEvent, TableRef};
use crate::table::catalog::SqlCatalog;
use crate::table::io::{normalize_location, FileIO};
use crate::table::manifest::DataFile;
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

/// A running pipeline.
pub struct Pipeline {
    cfg: Config,
    table: Table,
    decoder: Box<dyn Decoder>,
    writer: DataWriter,
    committer: Committer,
    consumer: StreamConsumer<SourceContext>,
    events: mpsc::UnboundedReceiver<SourceEvent>,
    /// Table offsets of the owned partitions as of the last commit or assignment.
    committed: Offsets,
    /// Partitions this member owns.
    assigned: HashSet<(String, i32)>,
    pending: Pending,
    next_checkpoint_id: u64,
    user_columns: usize,
    /// Upsert tables: the shards and their indexes.
    upsert: Option<UpsertSink>,
}

impl Pipeline {
    /// Connects to the catalog and Kafka; the table is created if missing.
    pub async fn start(cfg: Config) -> Result<Pipeline> {
        let table = open_table(&cfg).await?;
        let (write_columns, partition) = writer_layout(&table)?;
        let decode_columns: Vec<Column> = cfg
            .table
            .columns
            .iter()
            .map(|c| {
                let required = write_columns.iter().any(|w| w.name == c.name && w.required);
                Ok(Column {
                    name: c.name.clone(),
                    ty: Type::parse(&c.ty)?,
                    required,
                    time_unit: c.time_unit,
                })
            })
            .collect::<Result<_>>()?;
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
            user_columns: decode_columns.len(),
            decoder: Box::new(DebeziumJson::new(decode_columns)),
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
        loop {
            tokio::select! {
                biased;
                _ = shutdown.changed() => {
                    if *shutdown.borrow() {
                        break;
                    }
                }
                msg = tokio::time::timeout(source::POLL_INTERVAL, self.consumer.recv()) => {
                    let item = match msg {
                        Err(_) => None,
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "Kafka consumer error");
                            None
                        }
                        Ok(Ok(m)) => Some((
                            m.topic().to_string(),
                            m.partition(),
                            m.offset(),
                            self.decoder.decode(m.key(), m.payload()),
                        )),
                    };
                    // Rebalance callbacks ran inside recv(); apply them before the message.
                    self.handle_events().await?;
                    if let Some((topic, partition, offset, decoded)) = item {
                        if self.owns(&topic, partition) {
                            self.accept(decoded, &topic, partition, offset)?;
                            self.upload_finished().await?;
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

    fn accept(
        &mut self,
        decoded: Result<Decoded>,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> Result<()> {
        let m = metrics();
        m.records_consumed.inc();
        match decoded {
            Ok(Decoded::Change(record)) => {
                m.records_decoded.inc();
                if let Some(sink) = self.upsert.as_mut() {
                    let outcome = sink.accept(topic, partition, offset, record).map_err(|e| {
                        e.with("topic", topic)
                            .with("partition", partition)
                            .with("offset", offset)
                    })?;
                    match outcome {
                        Outcome::Applied => {}
                        Outcome::Stale => m.stale.inc(),
                        Outcome::Ignored => m.ignored.inc(),
                    }
                } else {
                    let row = self.changelog_row(record, partition, offset)?;
                    tokio::task::block_in_place(|| self.writer.write(row))?;
                    m.rows_written.inc();
                }
            }
            Ok(Decoded::Tombstone) => m.tombstones.inc(),
            Err(e) => {
                m.records_failed
                    .with_label_values(&[e.kind().as_str()])
                    .inc();
                return Err(e
                    .with("topic", topic)
                    .with("partition", partition)
                    .with("offset", offset));
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

    fn changelog_row(
        &self,
        record: ChangeRecord,
        partition: i32,
        offset: i64,
    ) -> Result<Vec<Value>> {
        let op = record.op;
        let mut row = record
            .after
            .or(record.before)
            .ok_or_else(|| Error::decode("change has neither before nor after image"))?;
        debug_assert_eq!(row.len(), self.user_columns);
        row.push(Value::String(op.code().to_string()));
        row.push(
            record
                .version
                .map_or(Value::Null, |v| Value::String(v.to_string())),
        );
        row.push(record.source_ts_ms.map_or(Value::Null, |ms| {
            Value::TimestampTz(ms.saturating_mul(1000))
        }));
        row.push(Value::Int(partition));
        row.push(Value::Long(offset));
        Ok(row)
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
        let files = self.writer.take_finished();
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
        let files = tokio::task::block_in_place(|| self.writer.close())?;
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
