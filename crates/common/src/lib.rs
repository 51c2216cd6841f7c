//! What every layer of inlet shares: the one error type with its kinds, a record's version and
//! its byte encoding, secrets in settings, and the named crash points of the crash tests.

pub mod error;
pub mod failpoint;
pub mod secret;
pub mod version;

pub use error::{Error, ErrorKind, Result, ResultExt};
