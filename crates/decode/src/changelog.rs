//! Flink's changelog JSON: `{"data": {...}, "op": "+I" | "-U" | "+U" | "-D"}`, one row per
//! message. Flink splits an update into `-U`, the row before it, and `+U`, the row after it.
//! A `-U` decodes as an update with only a before image (a retraction): changelog tables skip
//! it, upsert tables pair it with the change after it, which tells whether the key changed.
//! No version: the Kafka offset orders changes.

use std::sync::Arc;

use serde_json::Value as Json;

use super::{json_object, reason, take_object, Decoded, Decoder, Op, RawChange};
use inlet_common::error::{Error, Result};

/// Decodes Flink changelog JSON.
#[derive(Debug, Default)]
pub struct ChangelogJson;

impl Decoder for ChangelogJson {
    fn decode(&self, _key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Vec<Decoded>> {
        let Some(bytes) = value else {
            return Ok(vec![Decoded::Tombstone]);
        };
        let Some(mut doc) = json_object(bytes)? else {
            return Ok(vec![Decoded::Tombstone]);
        };
        let op = match doc.get("op").and_then(Json::as_str) {
            Some("+I") => Op::Create,
            Some("+U" | "-U") => Op::Update,
            Some("-D") => Op::Delete,
            Some(other) => {
                return Err(Error::decode(format!(
                    "op: unknown operation \"{other}\"; expected +I, -U, +U or -D"
                ))
                .because(reason::UNKNOWN_OP))
            }
            None => {
                return Err(Error::decode(
                    "op: missing; this is not a changelog-json message",
                ))
            }
        };
        let data = take_object(&mut doc, "data")?
            .ok_or_else(|| Error::decode("data: missing; a change needs its row"))?;
        let retraction = doc.get("op").and_then(Json::as_str) == Some("-U");
        let (before, after) = match op {
            Op::Delete => (Some(data), None),
            _ if retraction => (Some(data), None),
            _ => (None, Some(data)),
        };
        Ok(vec![Decoded::Change(RawChange {
            op,
            source: None,
            before,
            after,
            fields: Arc::default(),
            version: None,
            source_ts_ms: None,
            key: Vec::new(),
        })])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn golden_cases() {
        crate::golden::run("changelog", &super::ChangelogJson);
    }
}
