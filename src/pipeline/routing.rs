//! Which table each change goes to, under `routing`, and opening routed tables.

use std::collections::{BTreeMap, HashMap};

use rdkafka::consumer::Consumer;

use crate::config::{RouteBy, TableMode};
use crate::source;
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};
use inlet_decode::{glob, reason, RawChange};

use super::lake::Lake;
use super::lake::{definition_from_change, table_definition};
use super::sink::other_topic;
use super::sink::TableSink;
use super::{Pipeline, TableName};

/// The tables a pipeline writes, and where it finds them.
pub(super) struct Tables {
    pub(super) lake: Lake,
    /// The tables written so far, by name.
    pub(super) sinks: BTreeMap<TableName, TableSink>,
    /// Tables that took changes since their finished files were last uploaded.
    pub(super) touched: Vec<TableName>,
    /// Upsert tables not opened because a change came from a topic other than the one their
    /// commits name, with that topic: further such changes are refused without loading them.
    pub(super) bound_elsewhere: HashMap<TableName, String>,
    /// The one upsert table of a pipeline without routing: its shards (the partitions of the
    /// one topic).
    pub(super) shards: u32,
}

impl Tables {
    /// The table `name`, or without a name the one table of a pipeline without routing.
    pub(super) fn sink(&self, name: Option<&TableName>) -> Option<&TableSink> {
        match name {
            Some(name) => self.sinks.get(name),
            None => self.sinks.values().next(),
        }
    }
}

impl Pipeline {
    /// Loads a table first seen in a change, creating it from the change's fields if missing.
    pub(super) async fn open_routed(
        &mut self,
        name: &TableName,
        raw: &RawChange,
        topic: &str,
    ) -> Result<()> {
        let table = match self.tables.lake.load(&name.0, &name.1).await? {
            Some(table) => table,
            None => {
                let def = if self.cfg.table.columns.is_empty() {
                    definition_from_change(&self.cfg, raw)?
                } else {
                    table_definition(&self.cfg)?
                };
                let table = format!("{}.{}", name.0, name.1);
                let columns = def.columns.len();
                if self.cfg.routing.is_some() {
                    tracing::info!(%table, columns, "Creating a table for a new upstream table");
                } else {
                    tracing::info!(%table, columns, "Creating the table from the first change's fields");
                }
                self.tables
                    .lake
                    .load_or_create(&name.0, &name.1, &def)
                    .await?
            }
        };
        // An upsert table's shards follow one topic for good: the one its commits name.
        if self.cfg.table.mode == TableMode::Upsert {
            let own = crate::commit::table_shard_topic(&table.metadata, &self.cfg.pipeline_id);
            if let Some(own) = own.filter(|own| own != topic) {
                let e = other_topic(&format!("{}.{}", name.0, name.1), &own);
                self.tables.bound_elsewhere.insert(name.clone(), own);
                return Err(e);
            }
            self.tables.bound_elsewhere.remove(name);
        }
        self.add_table(table, topic).await?;
        self.watch_table_storage(name).await?;
        let owned: Vec<(String, i32)> = self
            .ownership
            .assigned
            .iter()
            .filter(|(t, _)| {
                let own = self
                    .tables
                    .sinks
                    .get(name)
                    .and_then(|s| s.shard_topic.as_ref());
                own.is_none_or(|own| own == t)
            })
            .cloned()
            .collect();
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
    pub(super) fn start_without_offsets(
        &mut self,
        name: &TableName,
        partitions: &[(String, i32)],
    ) -> Result<()> {
        let Some(sink) = self.tables.sinks.get_mut(name) else {
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
                    if sink.shard_topic.as_ref().is_some_and(|own| own != topic) {
                        continue;
                    }
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
    pub(super) fn route(&self, raw: &RawChange, topic: &str) -> Result<TableName> {
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
    pub(super) fn wanted(&self, raw: &RawChange, topic: &str) -> bool {
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
}
