//! Bad records: the `errors` policy decides whether a record that cannot be decoded or applied
//! stops the pipeline, is dropped, or goes to a dead-letter topic. Every bad record is counted by
//! reason; logs name each reason at most once per interval.
//!
//! Dead letters are produced before the checkpoint that passes their offsets commits: the
//! checkpoint waits for the broker's acknowledgements, so a dead letter is never lost. A crash
//! between the acknowledgement and the commit re-reads the record and sends it again, so the
//! dead-letter topic is at-least-once.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};

use crate::config::{BadRecordPolicy, Config};
use crate::health::health;
use crate::metrics::metrics;
use inlet_common::error::{Error, ErrorKind, RecordAt, Result, ResultExt};
use inlet_common::secret::resolve_secret;

/// Header names of a dead letter.
pub mod header {
    pub const ERROR: &str = "inlet.error";
    pub const REASON: &str = "inlet.error.reason";
    pub const TOPIC: &str = "inlet.source.topic";
    pub const PARTITION: &str = "inlet.source.partition";
    pub const OFFSET: &str = "inlet.source.offset";
    /// The source message's timestamp, milliseconds since the epoch, when it has one.
    pub const TIMESTAMP: &str = "inlet.source.timestamp";
    /// When inlet rejected the record, milliseconds since the epoch.
    pub const FAILED_AT: &str = "inlet.failed.at";
    pub const PIPELINE: &str = "inlet.pipeline";
}

/// How often one reason is logged at most.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The source message a bad record came from.
pub struct Origin<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub timestamp_ms: Option<i64>,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
}

/// Applies the `errors` policy.
pub struct BadRecords {
    policy: BadRecordPolicy,
    pipeline_id: String,
    topic: Option<String>,
    producer: Option<FutureProducer>,
    in_flight: Vec<DeliveryFuture>,
    /// Per reason: when it was last logged and how many records since then went unlogged.
    logged: HashMap<&'static str, (Instant, u64)>,
}

impl BadRecords {
    /// The handler for `cfg.errors`; a dead-letter policy connects a producer.
    pub fn new(cfg: &Config) -> Result<BadRecords> {
        let errors = &cfg.errors;
        let producer = match errors.policy {
            BadRecordPolicy::DeadLetter => {
                let mut client = ClientConfig::new();
                client
                    .set("bootstrap.servers", &cfg.kafka.bootstrap_servers)
                    .set("client.id", "inlet-dead-letters")
                    .set("enable.idempotence", "true")
                    .set("compression.type", "zstd");
                for (k, v) in &cfg.kafka.properties {
                    if is_producer_setting(k) {
                        client.set(k, resolve_secret(&format!("kafka.properties.{k}"), v)?);
                    }
                }
                Some(
                    client
                        .create::<FutureProducer>()
                        .or_kind(ErrorKind::Kafka, || {
                            "cannot create the dead-letter producer".into()
                        })?,
                )
            }
            _ => None,
        };
        Ok(BadRecords {
            policy: errors.policy,
            pipeline_id: cfg.pipeline_id.clone(),
            topic: errors.dead_letter_topic.clone(),
            producer,
            in_flight: Vec::new(),
            logged: HashMap::new(),
        })
    }

    /// Handles one bad record: returns the error under `fail` (marked as the record the
    /// pipeline stops at, unless an operator asked to skip exactly this record), otherwise
    /// counts, logs (rate limited) and, under `dead-letter`, sends the original message on.
    pub fn handle(&mut self, error: Error, origin: &Origin<'_>) -> Result<()> {
        let reason = error.reason();
        let error = error
            .with("topic", origin.topic)
            .with("partition", origin.partition)
            .with("offset", origin.offset);
        let policy = match self.policy {
            BadRecordPolicy::Fail
                if health().skip_granted(origin.topic, origin.partition, origin.offset) =>
            {
                BadRecordPolicy::Skip
            }
            other => other,
        };
        let action = match policy {
            BadRecordPolicy::Fail => "failed",
            BadRecordPolicy::Skip => "skipped",
            BadRecordPolicy::DeadLetter => "dead_lettered",
        };
        metrics()
            .records_failed
            .with_label_values(&[reason, action])
            .inc();
        match policy {
            BadRecordPolicy::Fail => {
                return Err(error.stopped_at(RecordAt {
                    topic: origin.topic.to_string(),
                    partition: origin.partition,
                    offset: origin.offset,
                }))
            }
            BadRecordPolicy::Skip => {}
            BadRecordPolicy::DeadLetter => self.send(&error, reason, origin)?,
        }
        self.log(reason, action, &error);
        Ok(())
    }

    /// Handles a record whose change the table's schema cannot take, under the table's
    /// `on_incompatible_change: dead-letter`: dead-lettered even when `errors.policy` is `fail`.
    pub fn dead_letter(&mut self, error: Error, origin: &Origin<'_>) -> Result<()> {
        if self.producer.is_none() {
            return Err(error);
        }
        let saved = self.policy;
        self.policy = BadRecordPolicy::DeadLetter;
        let result = self.handle(error, origin);
        self.policy = saved;
        result
    }

    fn send(&mut self, error: &Error, reason: &str, origin: &Origin<'_>) -> Result<()> {
        let (Some(producer), Some(topic)) = (&self.producer, &self.topic) else {
            return Err(Error::config(
                "errors.dead_letter_topic: the dead-letter policy needs a topic",
            ));
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64)
            .to_string();
        let (partition, offset) = (origin.partition.to_string(), origin.offset.to_string());
        let message = error.to_string();
        let timestamp = origin.timestamp_ms.map(|t| t.to_string());
        let mut headers = OwnedHeaders::new();
        for (key, value) in [
            (header::ERROR, Some(message.as_str())),
            (header::REASON, Some(reason)),
            (header::TOPIC, Some(origin.topic)),
            (header::PARTITION, Some(partition.as_str())),
            (header::OFFSET, Some(offset.as_str())),
            (header::TIMESTAMP, timestamp.as_deref()),
            (header::FAILED_AT, Some(now.as_str())),
            (header::PIPELINE, Some(self.pipeline_id.as_str())),
        ] {
            if let Some(value) = value {
                headers = headers.insert(Header {
                    key,
                    value: Some(value),
                });
            }
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(k) = origin.key {
            record = record.key(k);
        }
        if let Some(v) = origin.value {
            record = record.payload(v);
        }
        let future = producer.send_result(record).map_err(|(e, _)| {
            Error::new(
                ErrorKind::Kafka,
                format!("cannot queue a dead letter to {topic}"),
            )
            .with_source(e)
        })?;
        self.in_flight.push(future);
        Ok(())
    }

    fn log(&mut self, reason: &'static str, action: &str, error: &Error) {
        let now = Instant::now();
        let entry = self.logged.entry(reason).or_insert((now - LOG_INTERVAL, 0));
        if now.duration_since(entry.0) >= LOG_INTERVAL {
            tracing::warn!(
                reason,
                action,
                more_since_last_log = entry.1,
                error = %error,
                "Bad record"
            );
            *entry = (now, 0);
        } else {
            entry.1 += 1;
        }
    }

    /// Waits until the broker has every dead letter sent so far; called before a checkpoint
    /// commits the offsets that pass them.
    pub async fn flush(&mut self) -> Result<()> {
        for future in self.in_flight.drain(..) {
            match future.await {
                Ok(Ok(_)) => {}
                Ok(Err((e, _))) => {
                    return Err(
                        Error::new(ErrorKind::Kafka, "a dead letter was not delivered")
                            .with_source(e),
                    )
                }
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::Kafka,
                        "the dead-letter producer went away before delivering",
                    ))
                }
            }
        }
        Ok(())
    }

    /// Forgets sends of records whose partitions were revoked; their next owner sends them again.
    pub fn abandon(&mut self) {
        self.in_flight.clear();
    }
}

/// Consumer-only librdkafka settings the dead-letter producer must not receive.
fn is_producer_setting(key: &str) -> bool {
    !(key.starts_with("group.")
        || key.starts_with("session.")
        || key.starts_with("heartbeat.")
        || key.starts_with("fetch.")
        || key.starts_with("auto.")
        || key.starts_with("enable.auto")
        || key.starts_with("max.poll")
        || key.starts_with("isolation.")
        || key.starts_with("partition.assignment")
        || key == "check.crcs")
}
