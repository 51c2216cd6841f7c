//! inlet's own names in a table, in one place: the columns it adds, what each snapshot of a
//! pipeline records in its summary (the commit protocol: who wrote it, which checkpoint, the source
//! offsets and owner epochs it commits, what the index needs to catch up), and the table
//! properties inlet sets. Engines ignore keys they do not know; these all start with `inlet.`.

// Columns.

/// The column upsert tables add: each row's version, so the index can be rebuilt exactly.
pub const UPSERT_VERSION_COLUMN: &str = "_version";

/// Field id of inlet's `_version` column in position-delete files: outside the spec's reserved
/// range (2147483447 and up), and delete files carry no table columns it could clash with.
pub const DELETE_VERSION_ID: i32 = 2147483000;
/// Name of inlet's version column in position-delete files.
pub const DELETE_VERSION_COLUMN: &str = "_version";

// Snapshot summaries.

/// Snapshot summary key: the pipeline that wrote the snapshot.
pub const SUMMARY_PIPELINE: &str = "inlet.pipeline-id";

/// Snapshot summary key: the process that wrote the snapshot.
pub const SUMMARY_WRITER: &str = "inlet.writer-id";

/// Snapshot summary key: the checkpoint id, increasing per pipeline.
pub const SUMMARY_CHECKPOINT: &str = "inlet.checkpoint-id";

/// Snapshot summary key: the source offsets (JSON `{topic: {partition: next_offset}}`).
pub const SUMMARY_OFFSETS: &str = "inlet.offsets";

/// Snapshot summary key: the owner epoch of each source partition: topic → partition → epoch.
/// A member that takes a partition over raises its epoch in a commit of its own before it
/// writes, and every later commit of an older epoch is refused.
pub const SUMMARY_EPOCHS: &str = "inlet.epochs";

/// Snapshot summary key: per source partition of the pipeline, its watermark (ms): the newest
/// source time of the last checkpoint that read from it, or the time of the last checkpoint it
/// was idle in. Carried forward by every snapshot of the pipeline like the offsets; mark-done
/// reads the least.
pub const SUMMARY_WATERMARKS: &str = "inlet.watermarks";

/// The newest source timestamp (ms) of the changes the table holds.
pub const SUMMARY_SOURCE_TS: &str = "inlet.source-ts-ms";

/// Snapshot summary key: the topic whose partitions are an upsert table's index shards (a
/// routed pipeline reads many topics; each upsert table takes its changes from one).
pub const SUMMARY_SHARD_TOPIC: &str = "inlet.shard-topic";

/// Snapshot summary key: the newest index copy of each partition: topic → partition → URI of
/// its manifest.
pub const SUMMARY_INDEX_COPIES: &str = "inlet.index-copies";

/// Snapshot summary key: the table service that made a snapshot of the pipeline which is no
/// checkpoint of its (a compaction, a partition retention). An index whose marker is before
/// such a snapshot is not current.
pub const SUMMARY_MAINTENANCE: &str = "inlet.maintenance";

// Table properties.

/// Table property of changelog tables naming the upstream primary key (comma-separated), which
/// their schema does not declare as identifier fields.
pub const PRIMARY_KEY_PROPERTY: &str = "inlet.primary-key";

/// Table property: partitions whose time range ends at or before this (ms) are done.
pub const DONE_THROUGH: &str = "inlet.done-through-ms";

/// Table property: the table's last sequence number when partitions were last marked; files
/// added after it in a done partition are late.
pub const DONE_SEQUENCE: &str = "inlet.done-sequence-number";
