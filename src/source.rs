//! The Kafka source: a consumer-group member whose assigned partitions start at the offsets the
//! table's latest snapshot records (the table is the source of truth; group commits are only
//! for lag dashboards).

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc;

use crate::commit::{table_offsets, Offsets};
use crate::config::{is_secret_key, KafkaConfig, StartWithoutOffsets};
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::metrics::metrics;
use crate::table::catalog::Catalog;
use crate::table::io::FileIO;
use crate::table::Table;

/// A change of partition ownership, seen by the pipeline before the next message.
#[derive(Debug)]
pub enum SourceEvent {
    /// Partitions now owned, with the table offset each was positioned at (`None`: the table
    /// has none, reading starts at the beginning or, as configured, the end).
    Assigned(Vec<(String, i32, Option<i64>)>),
    /// All partitions were taken away; buffered records must be dropped.
    Revoked,
    /// The table offsets could not be read, so the assignment was refused.
    Failed(Error),
}

/// Where the consumer finds the tables to read its offsets from on assignment.
pub struct TableRef {
    pub catalog: Catalog,
    pub io: FileIO,
    /// The pipeline's one table; `None` when it routes to many, which are found in the catalog.
    pub table: Option<(String, String)>,
    pub pipeline_id: String,
    /// Where to start when the one table has snapshots but none of this pipeline.
    pub start_without_offsets: StartWithoutOffsets,
}

/// Where the pipeline resumes: per partition, the highest offset any of its tables records, and
/// where partitions without one start. Checkpoints commit to all their tables atomically, so a
/// table behind that offset simply had no changes since, and a table that cannot be read does
/// not stop the others: changes routed to it fail when they reach it.
pub async fn resume_offsets(t: &TableRef) -> Result<(Offsets, Offset)> {
    let names = match &t.table {
        Some(name) => vec![name.clone()],
        None => t.catalog.list_tables().await?,
    };
    let mut out = Offsets::new();
    let mut start = Offset::Beginning;
    for (namespace, name) in names {
        let loaded = Table::load(&t.catalog, &t.io, &namespace, &name).await;
        let table = match loaded {
            Ok(Some(table)) => table,
            Ok(None) => continue,
            Err(e) if t.table.is_none() => {
                tracing::warn!(table = %format!("{namespace}.{name}"), error = %e, "Cannot read a table of the catalog; leaving it out of the resume offsets");
                continue;
            }
            Err(e) => return Err(e),
        };
        let meta = &table.metadata;
        if t.table.is_some()
            && meta.current_snapshot().is_some()
            && meta.last_snapshot_of(&t.pipeline_id).is_none()
        {
            start = match t.start_without_offsets {
                StartWithoutOffsets::Earliest => Offset::Beginning,
                StartWithoutOffsets::Latest => Offset::End,
                StartWithoutOffsets::Fail => {
                    return Err(Error::config(format!(
                        "table {namespace}.{name} has snapshots but none records the offsets of pipeline {} \
                         (expired by another engine, or written before this pipeline); set \
                         kafka.start_without_offsets to earliest (read the topics again from the \
                         beginning) or latest (only new changes)",
                        t.pipeline_id
                    )));
                }
            };
            tracing::warn!(table = %format!("{namespace}.{name}"), start = ?t.start_without_offsets, "The table holds no offsets of this pipeline; starting as kafka.start_without_offsets says");
        }
        for (topic, parts) in table_offsets(meta, &t.pipeline_id)? {
            let merged = out.entry(topic).or_default();
            for (p, offset) in parts {
                let at = merged.entry(p).or_insert(offset);
                *at = (*at).max(offset);
            }
        }
    }
    Ok((out, start))
}

/// The consumer's callbacks: positions partitions on assignment and reports lag.
pub struct SourceContext {
    table: TableRef,
    events: mpsc::UnboundedSender<SourceEvent>,
    runtime: tokio::runtime::Handle,
}

impl SourceContext {
    fn load_offsets(&self) -> Result<(Offsets, Offset)> {
        let t = &self.table;
        // Rebalance callbacks run inside the consumer's poll on a runtime worker; reading the
        // catalog there keeps the partition from ever fetching at a wrong position.
        tokio::task::block_in_place(|| self.runtime.block_on(resume_offsets(t)))
    }
}

impl ClientContext for SourceContext {
    fn stats(&self, statistics: Statistics) {
        for (topic, t) in &statistics.topics {
            for (p, part) in &t.partitions {
                if *p >= 0 && part.consumer_lag >= 0 {
                    metrics()
                        .lag
                        .with_label_values(&[topic.as_str(), &p.to_string()])
                        .set(part.consumer_lag);
                }
            }
        }
    }
}

impl ConsumerContext for SourceContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let (offsets, start) = match self.load_offsets() {
                    Ok(o) => o,
                    Err(e) => {
                        tracing::error!(error = %e, "Cannot read table offsets; refusing the assignment");
                        let _ = consumer.unassign();
                        let _ = self.events.send(SourceEvent::Failed(e));
                        return;
                    }
                };
                let mut assigned = Vec::new();
                let owned: Vec<(String, i32)> = tpl
                    .elements()
                    .iter()
                    .map(|e| (e.topic().to_string(), e.partition()))
                    .collect();
                for (topic, p) in owned {
                    let at = offsets.get(&topic).and_then(|m| m.get(&p)).copied();
                    let offset = at.map_or(start, Offset::Offset);
                    if let Err(e) = tpl_set(tpl, &topic, p, offset) {
                        let _ = self.events.send(SourceEvent::Failed(kafka_error(e)));
                        return;
                    }
                    assigned.push((topic, p, at));
                }
                tracing::info!(
                    partitions = tpl.count(),
                    "Partitions assigned at table offsets"
                );
                if let Err(e) = consumer.assign(tpl) {
                    let _ = self.events.send(SourceEvent::Failed(kafka_error(e)));
                    return;
                }
                let _ = self.events.send(SourceEvent::Assigned(assigned));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                tracing::info!(partitions = tpl.count(), "Partitions revoked");
                // A partition this member no longer owns must not keep reporting its last lag.
                metrics().lag.reset();
                let _ = self.events.send(SourceEvent::Revoked);
                let _ = consumer.unassign();
            }
            other => {
                tracing::error!(error = ?other, "Rebalance failed");
                let _ = self.events.send(SourceEvent::Revoked);
                let _ = consumer.unassign();
            }
        }
    }
}

fn kafka_error(e: rdkafka::error::KafkaError) -> Error {
    Error::new(ErrorKind::Kafka, "cannot assign partitions").with_source(e)
}

fn tpl_set(tpl: &mut TopicPartitionList, topic: &str, p: i32, offset: Offset) -> KafkaResult<()> {
    tpl.set_partition_offset(topic, p, offset)
}

/// Creates the group consumer and subscribes it to the configured topics.
pub fn consumer(
    cfg: &KafkaConfig,
    table: TableRef,
) -> Result<(
    StreamConsumer<SourceContext>,
    mpsc::UnboundedReceiver<SourceEvent>,
)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &cfg.bootstrap_servers)
        .set("group.id", &cfg.group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("partition.assignment.strategy", "range,roundrobin")
        .set("statistics.interval.ms", "10000")
        .set("client.id", "inlet");
    for (k, v) in &cfg.properties {
        if matches!(
            k.as_str(),
            "enable.auto.commit" | "group.protocol" | "partition.assignment.strategy"
        ) {
            return Err(Error::config(format!(
                "kafka.properties.{k}: inlet manages this setting itself; remove it"
            )));
        }
        client.set(k, resolve_secret(&format!("kafka.properties.{k}"), v)?);
    }
    let shown: Vec<String> = cfg
        .properties
        .iter()
        .map(|(k, v)| {
            if is_secret_key(k) {
                format!("{k}=***")
            } else {
                format!("{k}={v}")
            }
        })
        .collect();
    tracing::debug!(properties = ?shown, "Kafka consumer properties");
    let context = SourceContext {
        table,
        events: tx,
        runtime: tokio::runtime::Handle::current(),
    };
    let consumer: StreamConsumer<SourceContext> = client
        .create_with_context(context)
        .or_kind(ErrorKind::Kafka, || "cannot create Kafka consumer".into())?;
    let topics: Vec<&str> = cfg.topics.iter().map(String::as_str).collect();
    consumer.subscribe(&topics).or_kind(ErrorKind::Kafka, || {
        format!("cannot subscribe to {topics:?}")
    })?;
    Ok((consumer, rx))
}

/// Resolves `${env:NAME}` and `${file:/path}` values, so secrets stay out of config files and
/// dotted librdkafka keys (which environment overrides cannot address) can still take them.
pub fn resolve_secret(setting: &str, value: &str) -> Result<String> {
    let Some(inner) = value.strip_prefix("${").and_then(|v| v.strip_suffix('}')) else {
        return Ok(value.to_string());
    };
    if let Some(name) = inner.strip_prefix("env:") {
        return std::env::var(name).map_err(|_| {
            Error::config(format!("{setting}: environment variable {name} is not set"))
        });
    }
    if let Some(path) = inner.strip_prefix("file:") {
        return std::fs::read_to_string(path)
            .map(|s| s.trim_end_matches(['\n', '\r']).to_string())
            .map_err(|e| {
                Error::config(format!("{setting}: cannot read secret file {path}")).with_source(e)
            });
    }
    Err(Error::config(format!(
        "{setting}: unknown reference {value}; use ${{env:NAME}} or ${{file:/path}}"
    )))
}

/// How many partitions `topic` has: the shard count of upsert tables.
pub fn partition_count(consumer: &StreamConsumer<SourceContext>, topic: &str) -> Result<u32> {
    let metadata = tokio::task::block_in_place(|| {
        consumer.fetch_metadata(Some(topic), Duration::from_secs(30))
    })
    .or_kind(ErrorKind::Kafka, || {
        format!("cannot read the metadata of topic {topic}")
    })?;
    let count = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map_or(0, |t| t.partitions().len());
    if count == 0 {
        return Err(Error::new(
            ErrorKind::Kafka,
            format!("topic {topic} does not exist or has no partitions"),
        ));
    }
    Ok(count as u32)
}

/// Records committed offsets in the consumer group, for lag tools. Failures are only logged:
/// the table, not the group, decides where reading resumes.
pub fn commit_group_offsets(consumer: &StreamConsumer<SourceContext>, offsets: &Offsets) {
    let mut tpl = TopicPartitionList::new();
    for (topic, parts) in offsets {
        for (p, next) in parts {
            let _ = tpl.add_partition_offset(topic, *p, Offset::Offset(*next));
        }
    }
    if tpl.count() > 0 {
        if let Err(e) = consumer.commit(&tpl, rdkafka::consumer::CommitMode::Async) {
            tracing::warn!(error = %e, "Cannot commit group offsets (advisory only)");
        }
    }
}

/// How long the pipeline waits for a message before checking timers.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_resolve_from_env_and_files() {
        assert_eq!(resolve_secret("k", "plain").unwrap(), "plain");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "s3cret\n").unwrap();
        assert_eq!(
            resolve_secret("k", &format!("${{file:{}}}", file.display())).unwrap(),
            "s3cret"
        );
        assert_eq!(
            resolve_secret("k", "${env:PATH}").unwrap(),
            std::env::var("PATH").unwrap()
        );
        let err = resolve_secret(
            "kafka.properties.sasl.password",
            "${env:INLET_TEST_SURELY_UNSET}",
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("kafka.properties.sasl.password"),
            "{err}"
        );
        assert!(resolve_secret("k", "${vault:x}").is_err());
    }
}
