//! Decoding: Kafka message bytes → typed change records aligned with the table's columns.

pub mod debezium;
mod values;

use std::fmt;

use crate::config::TimeUnit;
use crate::error::Result;
use crate::table::types::{Type, Value};

pub use values::convert;

/// The kind of change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Insert.
    Create,
    /// Snapshot read of an existing row.
    Read,
    /// Update.
    Update,
    /// Delete.
    Delete,
}

impl Op {
    /// Debezium's one-letter code, stored in changelog tables.
    pub fn code(self) -> &'static str {
        match self {
            Op::Create => "c",
            Op::Read => "r",
            Op::Update => "u",
            Op::Delete => "d",
        }
    }
}

/// A row in table column order.
pub type Row = Vec<Value>;

/// One component of a record version; versions compare component by component.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum VersionPart {
    Int(i128),
    Text(String),
}

/// A record's position in the upstream change order (binlog position, LSN, ...).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Version(pub Vec<VersionPart>);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            match p {
                VersionPart::Int(v) => write!(f, "{v}")?,
                VersionPart::Text(t) => f.write_str(t)?,
            }
        }
        Ok(())
    }
}

/// A decoded change.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangeRecord {
    pub op: Op,
    /// Row before the change, where the format carries it.
    pub before: Option<Row>,
    /// Row after the change; `None` for deletes.
    pub after: Option<Row>,
    /// Upstream order, where the format carries it.
    pub version: Option<Version>,
    /// When the change happened in the source database, in milliseconds since the epoch.
    pub source_ts_ms: Option<i64>,
}

/// What a message decodes to.
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded {
    Change(ChangeRecord),
    /// A null-valued message that only lets Kafka compaction drop a deleted key.
    Tombstone,
}

/// A table column as decoders see it.
#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    pub ty: Type,
    pub required: bool,
    /// Unit of integer time values when the message has no schema.
    pub time_unit: TimeUnit,
}

/// Turns a Kafka message into a change record.
pub trait Decoder: Send + Sync {
    /// Decodes one message. Errors name the offending field; the caller adds topic, partition
    /// and offset.
    fn decode(&self, key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Decoded>;
}
