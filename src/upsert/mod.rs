//! The upsert engine of one shard (one Kafka partition of a key-partitioned topic): version
//! dedup, merge engines, and the delete-old / insert-new pairs that keep one live row per key in
//! the partition its latest value names.
//!
//! Changes of a checkpoint collect in `pending` (latest image per key, so a key updated many
//! times before a commit is written once). At the checkpoint the shard writes each surviving
//! row, names a position delete for every committed row it replaces, and prepares the index
//! batch. The batch is saved beside the index before the commit and applied after it, so a crash
//! between the two is repaired exactly on restart.

mod row;
mod saved;
mod shard;
mod sink;
#[cfg(test)]
mod tests;

use crate::config::{Aggregate, MergeEngine};
use inlet_iceberg::types::Type;
pub use row::{decode_row, encode_row};
pub use saved::SavedBatch;
pub use shard::{
    ChangeVersion, DeleteTarget, Lent, LentShard, Prepared, Shard, ShardJob, ShardLayout,
    ShardWritten, SharedIndex,
};
pub use sink::{advance_idle, version_of, UpsertSink, WriterTemplate};

/// How a shard applies changes.
#[derive(Debug, Clone)]
pub struct UpsertSpec {
    /// Positions of the primary key columns in a row.
    pub key_columns: Vec<usize>,
    pub merge: MergeEngine,
    /// Aggregation engine: the aggregate of each column position (`None`: last non-null).
    pub aggregates: Vec<Option<Aggregate>>,
    /// Fixed buckets: `bucket[N]` of the single key column; `None` for dynamic buckets.
    pub fixed_buckets: Option<u32>,
    /// A partition's bucket takes keys until it holds this many live rows.
    pub target_rows_per_bucket: u64,
    /// Number of shards (Kafka partitions); shard `s` owns buckets `b` with `b % shards == s`.
    pub shards: u32,
    /// Field id and type of each value of a row (the table's data columns, in row order).
    pub fields: Vec<(i32, Type)>,
}

impl UpsertSpec {
    /// Whether old rows must be kept in the index (merge engines that combine old and new).
    pub fn stores_rows(&self) -> bool {
        matches!(
            self.merge,
            MergeEngine::PartialUpdate | MergeEngine::Aggregation
        )
    }
}

/// What happened to one change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It changed the key's row.
    Applied,
    /// Its version is not newer than the key's; dropped.
    Stale,
    /// The merge engine keeps the existing row (first-row).
    Ignored,
    /// A retraction waits for the change after it.
    Deferred,
}

/// The bucket of rows in files another engine wrote: counted apart from inlet's buckets, and
/// never written to (an update of such a row goes to a bucket of the shard).
pub const FOREIGN_BUCKET: u32 = u32::MAX;
