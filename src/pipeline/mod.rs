//! One pipeline: source → decode → route → write → commit. Changes go to one
//! table, or with `routing` to the table their upstream table or topic names (created from the
//! changes' own fields when missing). A checkpoint commits every table that changed in one
//! catalog transaction, carrying the same offsets, so the pipeline resumes where its newest
//! checkpoint ended. Checkpoints fire on time, record count or buffered bytes; a rebalance drops
//! what is buffered so the new owner of a partition re-reads it from the tables' offsets.

mod checkpoint;
mod coordinator;
mod lake;
mod maintenance;
mod partitions;
mod routing;
mod sink;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::IntCounter;
use rdkafka::consumer::StreamConsumer;
use rdkafka::Message;
use tokio::sync::watch;

use crate::commit::{Committer, Epochs, Offsets};
use crate::config::{Config, SchemaChangePolicy, TableMode};
use crate::dlq::{BadRecords, Origin};
use crate::health::{health, PipelineState};
use crate::metrics::metrics;
use crate::rebuild::copies::Copier;
use crate::source::{self, CommitGate, SourceContext, TableRef};
use inlet_common::error::{Error, ErrorKind, Result};
use inlet_decode::pool::{DecodePool, DecodedMessage, Message as SourceMessage, Typed};
use inlet_decode::{decoder_for, Decoded, RawChange};
use inlet_iceberg::Table;

pub use lake::{definition_from_change, open_table, table_definition, TableName};
pub use sink::upsert_sink_for;

use coordinator::{Checkpoints, Pending};
use lake::Lake;
use maintenance::TableServices;
use partitions::Ownership;
use routing::Tables;
use sink::TableSink;

/// A running pipeline.
pub struct Pipeline {
    cfg: Config,
    /// Decodes batches of messages on the worker threads, in order.
    decode: DecodePool,
    bad: BadRecords,
    consumer: Arc<StreamConsumer<SourceContext>>,
    /// The tables, their sinks, and which table each change goes to.
    tables: Tables,
    /// Assigned partitions, their epochs and the claims running for them.
    ownership: Ownership,
    /// The checkpoint being gathered, the one committing, and the commits' fences.
    checkpoints: Checkpoints,
    /// Index copies, compaction, and the services that run after checkpoints.
    services: TableServices,
    /// Kafka timestamp (ms) of the message being applied, for changes that carry none.
    message_ts: Option<i64>,
    /// The message being accepted has applied none of its changes yet.
    clean_stop: bool,
    /// Broker, catalog and storage probes; stop with the pipeline.
    monitor: crate::monitor::Monitor,
    consumed: ConsumedCounters,
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
        // The one upsert table's shards are its topic's partitions; routed tables learn theirs
        // from the topic of their first change.
        let shards = match (cfg.table.mode, &single) {
            (TableMode::Upsert, Some(_)) => {
                source::partition_count(&consumer, &cfg.kafka.topics[0]).await?
            }
            _ => 1,
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
            consumer,
            tables: Tables {
                lake,
                sinks: BTreeMap::new(),
                touched: Vec::new(),
                bound_elsewhere: HashMap::new(),
                shards,
            },
            ownership: Ownership {
                events,
                assigned: HashSet::new(),
                epochs: Epochs::new(),
                claiming: Vec::new(),
                table_ref: Arc::new(table_ref),
            },
            checkpoints: Checkpoints {
                committer,
                committed: Offsets::new(),
                pending: Pending::default(),
                next_checkpoint_id: 1,
                inflight: None,
                gate,
                cycle: (Instant::now(), Duration::ZERO),
                stopping: false,
            },
            services: TableServices {
                copier: Copier::new(cfg.index.copy_interval_ms),
                scheduler: crate::maintain::Scheduler::new(&cfg),
                compactor: crate::maintain::compact::Compactor::new(&cfg),
                compacting: None,
                partition_services: crate::maintain::PartitionServices::new(&cfg),
                last_seen: Default::default(),
            },
            message_ts: None,
            clean_stop: true,
            monitor,
            consumed: ConsumedCounters::default(),
            cfg,
        };
        if let Some((namespace, name)) = single {
            let table = if pipeline.cfg.table.columns.is_empty() {
                pipeline.tables.lake.load(&namespace, &name).await?
            } else {
                let def = table_definition(&pipeline.cfg)?;
                Some(
                    pipeline
                        .tables
                        .lake
                        .load_or_create(&namespace, &name, &def)
                        .await?,
                )
            };
            if let Some(table) = table {
                let topic = pipeline.cfg.kafka.topics[0].clone();
                pipeline.add_table(table, &topic).await?;
                pipeline.watch_table_storage(&(namespace, name)).await?;
            }
        }
        tracing::info!(
            tables = ?pipeline.tables.sinks.keys().map(|(n, t)| format!("{n}.{t}")).collect::<Vec<_>>(),
            routing = pipeline.cfg.routing.is_some(),
            topics = ?pipeline.cfg.kafka.subscription(),
            "Pipeline started"
        );
        Ok(pipeline)
    }

    /// Starts writing `table`, whose changes (an upsert table's shards) come from `topic`.
    async fn add_table(&mut self, table: Table, topic: &str) -> Result<&mut TableSink> {
        let key = (table.namespace.clone(), table.name.clone());
        let upsert = self.cfg.table.mode == TableMode::Upsert;
        let shards = match &self.cfg.routing {
            Some(_) if upsert => source::partition_count(&self.consumer, topic).await?,
            _ => self.tables.shards,
        };
        let root = std::path::Path::new(&self.cfg.index.dir).join(&self.cfg.pipeline_id);
        let index_root = match self.cfg.routing {
            // Kept where single-table pipelines always had it.
            None => root,
            Some(_) => root.join(format!("{}.{}", key.0, key.1)),
        };
        tracing::info!(table = %format!("{}.{}", key.0, key.1), location = %table.metadata.location, "Writing table");
        let sink = TableSink::open(
            &self.cfg,
            table,
            shards,
            upsert.then(|| topic.to_string()),
            index_root,
        )?;
        Ok(self.tables.sinks.entry(key).or_insert(sink))
    }

    /// Where the catalog places the tables (REST), checks the storage below the first table's
    /// location with the table's own credentials (vended ones included), so wrong credentials
    /// stop the pipeline at start naming the bucket, and keeps probing it for readiness.
    async fn watch_table_storage(&mut self, key: &TableName) -> Result<()> {
        if self.monitor.watches_storage() {
            return Ok(());
        }
        let Some(sink) = self.tables.sinks.get(key) else {
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
        for claim in self.ownership.claiming.drain(..) {
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
                self.checkpoints.cycle.1 += waiting.elapsed();
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
                    // The clock is read once a batch for the records' arrival, and every 64
                    // records for the checkpoint's interval.
                    let now = Instant::now();
                    // The partition of the messages before, with its consumed-records series
                    // where this member owns it: asked once for a run of messages of one
                    // partition (ownership is a set keyed by `String`, series a map of maps),
                    // and the run's arrival noted once, since its messages share `now`.
                    let mut run: Option<(Arc<str>, i32, Option<IntCounter>)> = None;
                    for d in &mut batch {
                        let (topic, partition) = (&d.message.topic, d.message.partition);
                        if !matches!(&run, Some((t, p, _)) if Arc::ptr_eq(t, topic) && *p == partition)
                        {
                            let consumed = self.ownership.owns(topic, partition).then(|| {
                                self.services.last_seen.saw_at(topic, partition, now);
                                self.consumed.counter(topic, partition).clone()
                            });
                            run = Some((topic.clone(), partition, consumed));
                        }
                        let Some((_, _, Some(consumed))) = &run else {
                            continue;
                        };
                        consumed.inc();
                        if let Err(e) = self.accept(d).await {
                            self.commit_before_stop(&e).await;
                            return Err(e);
                        }
                        // `checkpoint.max_records` holds within a batch too.
                        let records = self.checkpoints.pending.records;
                        if (records % 64 == 0 || records >= self.cfg.checkpoint.max_records)
                            && self.checkpoint_due(interval)
                        {
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
        self.checkpoints.stopping = true;
        self.settle().await?;
        if self.checkpoints.pending.records > 0 {
            self.checkpoint().await?;
        }
        Ok(())
    }

    /// Under `errors.policy: fail` the pipeline stops at a bad record, possibly for hours:
    /// the records before it commit first, so the table is as fresh as the source allows while
    /// it waits. Only when nothing of the bad message was applied (a multi-row message that
    /// fails midway would otherwise commit part of itself and apply it again later).
    async fn commit_before_stop(&mut self, e: &Error) {
        if e.bad_record().is_none() || !self.clean_stop || self.checkpoints.pending.records == 0 {
            return;
        }
        match self.checkpoint().await {
            Ok(()) => tracing::info!("Committed the records before the bad record"),
            Err(c) => {
                tracing::warn!(error = %c, "Cannot commit the records before the bad record; they are read again")
            }
        }
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
        // A change typed with its images left out, for a shape the table has left since: the
        // message is decoded again, in full.
        if typed.iter().flatten().any(|t| t.elided && !self.takes(t)) {
            decoded = self
                .decode
                .decoder()
                .decode(message.key.as_deref(), message.payload.as_deref());
            typed.clear();
        }
        // The typed changes stay in the message, to be freed with its batch off this thread.
        let mut typed = typed.iter_mut();
        let (topic, partition, offset) = (&*message.topic, message.partition, message.offset);
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
                    let typed = typed.next().and_then(Option::as_mut);
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
        partition_entry(&mut self.checkpoints.pending.end, topic).insert(partition, offset + 1);
        partition_entry(&mut self.checkpoints.pending.first, topic)
            .entry(partition)
            .or_insert(offset);
        self.checkpoints.pending.records += 1;
        self.checkpoints.show_buffered();
        if self.checkpoints.pending.since.is_none() {
            self.checkpoints.pending.since = Some(Instant::now());
            health().buffering();
        }
        Ok(())
    }

    /// Whether the table takes a change typed on a decoding thread as it is (see
    /// [`TableSink::apply`]).
    fn takes(&self, typed: &Typed) -> bool {
        self.cfg.routing.is_none()
            && self.tables.sinks.values().next().is_some_and(|sink| {
                Arc::ptr_eq(&sink.shape, &typed.shape)
                    && !(self.cfg.table.evolve_schema && typed.needs_change)
            })
    }

    /// Has the decoding threads type changes for the table's current shape, where every change
    /// goes to the one table (no routing).
    fn publish_shape(&mut self) {
        let shape = match &self.cfg.routing {
            Some(_) => None,
            None => self.tables.sinks.values().next().map(|s| s.shape.clone()),
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
        typed: Option<&mut Typed>,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> Result<()> {
        // Without routing, the one table once it is open: found without naming it (a name
        // cloned and compared for every change).
        let name = match &self.cfg.routing {
            None if !self.tables.sinks.is_empty() => None,
            _ => Some(self.route(raw, topic)?),
        };
        if let Some(name) = &name {
            if let Some(own) = self
                .tables
                .bound_elsewhere
                .get(name)
                .filter(|own| *own != topic)
            {
                return Err(sink::other_topic(&format!("{}.{}", name.0, name.1), own));
            }
            if !self.tables.sinks.contains_key(name) {
                self.open_routed(name, raw, topic).await?;
            }
        }
        // A schema change rewrites the table's metadata, which the checkpoint or compaction in
        // flight commits from: it lands first.
        if self.busy()
            && self
                .tables
                .sink(name.as_ref())
                .is_some_and(|s| s.needs_schema_change(&self.cfg, raw, typed.as_deref()))
        {
            self.settle().await?;
        }
        let cfg = &self.cfg;
        let sink = match &name {
            Some(name) => self.tables.sinks.get_mut(name),
            None => self.tables.sinks.values_mut().next(),
        };
        let Some(sink) = sink else {
            return Err(Error::new(ErrorKind::Internal, "routed table vanished"));
        };
        let ts = raw.source_ts_ms.or(self.message_ts);
        sink.apply(cfg, raw, typed, topic, partition, offset)
            .map_err(|e| match e.kind() {
                // A bad record names its table: under routing one topic feeds many.
                ErrorKind::Decode => e.with("table", table_label(&sink.table)),
                _ => e,
            })?;
        sink.newest_source_ms = sink.newest_source_ms.max(ts);
        // Noted once per table until its files are next uploaded: a flag, not a search of the
        // list (a database sync touches hundreds of tables between uploads).
        let first_touch = !std::mem::replace(&mut sink.touched, true);
        if let Some(ts) = ts {
            crate::maintain::done::observe(
                &mut self.checkpoints.pending.newest,
                topic,
                partition,
                ts,
            );
        }
        match name {
            Some(name) if first_touch => self.tables.touched.push(name),
            None if first_touch => self
                .tables
                .touched
                .extend(self.tables.sinks.keys().cloned()),
            _ => {}
        }
        Ok(())
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
}

/// Messages decoded as one batch at most.
const BATCH_MESSAGES: usize = 512;

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
struct ConsumedCounters(HashMap<String, HashMap<i32, IntCounter>>);

impl ConsumedCounters {
    fn counter(&mut self, topic: &str, partition: i32) -> &IntCounter {
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
    use futures::{FutureExt, StreamExt};
    let mut topic = None;
    let mut batch = Vec::new();
    // One stream for the batch: `recv` sets one up (and registers its waker) per message.
    let mut stream = consumer.stream();
    while batch.len() < max {
        match stream.next().now_or_never().flatten() {
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

/// A table as its metrics label it.
fn table_label(table: &Table) -> String {
    format!("{}.{}", table.namespace, table.name)
}
