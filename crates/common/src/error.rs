//! The crate's one error type: a kind that retry loops look at, a message, context pairs and a
//! source.

use std::fmt;

/// What went wrong, coarse enough for retry decisions and metric labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Bad configuration; never retryable.
    Config,
    /// A record that does not fit the table or its format.
    Decode,
    /// Kafka client failures.
    Kafka,
    /// Object storage or local file failures.
    Storage,
    /// Catalog (SQL) failures.
    Catalog,
    /// The schema registry is unreachable or failing; records wait rather than fail.
    Registry,
    /// Another writer changed the table first; rebase and retry.
    CommitConflict,
    /// Table metadata that violates the spec or our expectations.
    Metadata,
    /// A change the table's schema cannot take.
    Schema,
    /// The local key index is damaged (corrupt files, undecodable entries): it is moved aside
    /// and rebuilt from the table, so a restart repairs it.
    IndexDamaged,
    /// Anything else that is a bug or an unexpected state.
    Internal,
}

impl ErrorKind {
    /// Stable lower-case name, used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Config => "config",
            ErrorKind::Decode => "decode",
            ErrorKind::Kafka => "kafka",
            ErrorKind::Storage => "storage",
            ErrorKind::Catalog => "catalog",
            ErrorKind::Registry => "registry",
            ErrorKind::CommitConflict => "commit_conflict",
            ErrorKind::Metadata => "metadata",
            ErrorKind::Schema => "schema",
            ErrorKind::IndexDamaged => "index_damaged",
            ErrorKind::Internal => "internal",
        }
    }
}

/// The crate's error.
pub struct Error {
    kind: ErrorKind,
    message: String,
    context: Vec<(&'static str, String)>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    /// Why a record is bad, as counted in metrics (`malformed`, `unknown_op`, ...).
    reason: Option<&'static str>,
    /// The record that stopped the pipeline under `errors.policy: fail`.
    record: Option<Box<RecordAt>>,
}

/// Where a record sits in Kafka.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordAt {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

impl fmt::Display for RecordAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}@{}", self.topic, self.partition, self.offset)
    }
}

/// The crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            context: Vec::new(),
            source: None,
            reason: None,
            record: None,
        }
    }

    /// Shorthand for a configuration error.
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, message)
    }

    /// Shorthand for a decode error.
    pub fn decode(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Decode, message)
    }

    /// Shorthand for a metadata error.
    pub fn metadata(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Metadata, message)
    }

    /// Adds a context pair shown after the message.
    pub fn with(mut self, key: &'static str, value: impl fmt::Display) -> Self {
        self.context.push((key, value.to_string()));
        self
    }

    /// Attaches the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Names why a record is bad (see [`Error::reason`]).
    pub fn because(mut self, reason: &'static str) -> Self {
        self.reason = Some(reason);
        self
    }

    /// Why a record is bad: the reason given, else one derived from the kind.
    pub fn reason(&self) -> &'static str {
        self.reason.unwrap_or(match self.kind {
            ErrorKind::Decode => "malformed",
            ErrorKind::Schema => "incompatible_schema",
            other => other.as_str(),
        })
    }

    /// Marks the error as the bad record at `at` stopping the pipeline (`errors.policy: fail`).
    pub fn stopped_at(mut self, at: RecordAt) -> Self {
        self.record = Some(Box::new(at));
        self
    }

    /// The bad record that stopped the pipeline, if this error is one.
    pub fn bad_record(&self) -> Option<&RecordAt> {
        self.record.as_deref()
    }

    /// The error's kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The bare message, without context.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether repeating the operation may succeed. The only thing retry loops look at.
    /// Errors are classified where they arise: a fault that only a change of configuration or
    /// environment can fix (a read-only catalog, rejected credentials) is raised as
    /// [`ErrorKind::Config`] there, naming the setting, and is never retried.
    pub fn retryable(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::CommitConflict
                | ErrorKind::Storage
                | ErrorKind::Catalog
                | ErrorKind::Kafka
                | ErrorKind::Registry
                | ErrorKind::IndexDamaged
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.message)?;
        for (k, v) in &self.context {
            write!(f, " {k}={v}")?;
        }
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {self}", self.kind.as_str())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Turns foreign errors into ours with a kind and a message saying what was being done.
pub trait ResultExt<T> {
    /// Wraps the error as `kind` with `message`.
    fn or_kind(self, kind: ErrorKind, message: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> ResultExt<T> for std::result::Result<T, E> {
    fn or_kind(self, kind: ErrorKind, message: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::new(kind, message()).with_source(e))
    }
}
