//! inlet streams database change data (CDC) from Kafka into Apache Iceberg tables, exactly once.
//!
//! Stages, in the order a record passes them: [`source`] → [`decode`] → [`write`] →
//! [`commit`], over the Iceberg [`table`] layer; [`pipeline`] wires them together.

pub mod commit;
pub mod config;
pub mod decode;
pub mod demo;
pub mod error;
pub mod failpoint;
pub mod metrics;
pub mod pipeline;
pub mod source;
pub mod table;
pub mod write;

pub use error::{Error, ErrorKind, Result};
