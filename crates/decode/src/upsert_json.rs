//! Plain rows keyed by primary key: the Kafka key holds the key columns (a JSON object, or for a
//! single-column primary key a bare value), the value the whole row as a JSON object. A row is
//! an upsert, decoded as a create; a null value deletes the key, its before image built from
//! the key. No version: the Kafka offset orders changes.

use std::sync::Arc;

use serde_json::Value as Json;

use super::{json_kind, json_object, Decoded, Decoder, Image, Op, RawChange};
use inlet_common::error::{Error, Result};

/// Decodes plain upsert JSON.
#[derive(Debug, Default)]
pub struct UpsertJson {
    /// The table's primary key, naming the column of a bare key value.
    primary_key: Vec<String>,
}

impl UpsertJson {
    pub fn new(primary_key: &[String]) -> UpsertJson {
        UpsertJson {
            primary_key: primary_key.to_vec(),
        }
    }

    /// The key columns and their values; `None` without a key.
    fn key_image(&self, key: Option<&[u8]>) -> Result<Option<Image>> {
        let Some(bytes) = key else {
            return Ok(None);
        };
        let value = match serde_json::from_slice::<Json>(bytes) {
            Ok(Json::Object(o)) => return Ok(Some(o)),
            Ok(Json::Null) => return Ok(None),
            Ok(scalar @ (Json::Bool(_) | Json::Number(_) | Json::String(_))) => scalar,
            Ok(other) => {
                return Err(Error::decode(format!(
                    "key: expected an object of key columns or a single value, found {}",
                    json_kind(&other)
                )))
            }
            // A bare text key, as string serializers write it.
            Err(_) => Json::String(
                std::str::from_utf8(bytes)
                    .map_err(|_| Error::decode("key: neither JSON nor UTF-8 text"))?
                    .to_string(),
            ),
        };
        match self.primary_key.as_slice() {
            [column] => Ok(Some(Image::from_iter([(column.clone(), value)]))),
            columns => Err(Error::decode(format!(
                "key: a bare key value needs exactly one table.primary_key column, the table has {}; send the key as a JSON object of its columns",
                columns.len()
            ))),
        }
    }
}

impl Decoder for UpsertJson {
    fn decode(&self, key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Vec<Decoded>> {
        let key = self.key_image(key)?;
        let row = match value {
            Some(bytes) => json_object(bytes)?,
            None => None,
        };
        let names = key
            .as_ref()
            .map_or_else(|| self.primary_key.clone(), |k| k.keys().cloned().collect());
        let (op, before, after) = match (row, key) {
            (Some(mut row), key) => {
                // Key columns the row leaves out come from the key.
                for (column, value) in key.into_iter().flatten() {
                    row.entry(column).or_insert(value);
                }
                (Op::Create, None, Some(row))
            }
            (None, Some(key)) => (Op::Delete, Some(key), None),
            (None, None) => {
                return Err(Error::decode(
                    "key: missing; a null value deletes the row its key names",
                ))
            }
        };
        Ok(vec![Decoded::Change(RawChange {
            op,
            source: None,
            before,
            after,
            fields: Arc::default(),
            version: None,
            source_ts_ms: None,
            key: names,
        })])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_cases() {
        crate::golden::run("upsert_json", &UpsertJson::new(&["id".to_string()]));
    }

    #[test]
    fn bare_keys_need_one_key_column() {
        let two = UpsertJson::new(&["a".to_string(), "b".to_string()]);
        let err = two.decode(Some(b"5"), None).unwrap_err();
        assert!(err.to_string().contains("exactly one"), "{err}");
        let got = two.decode(Some(br#"{"a": 1, "b": "x"}"#), None).unwrap();
        let [Decoded::Change(raw)] = got.as_slice() else {
            panic!("expected one change")
        };
        assert_eq!(raw.op, Op::Delete);
        assert_eq!(raw.key.len(), 2);
        assert!(UpsertJson::new(&[])
            .decode(Some(&[0xff, 0xfe]), None)
            .is_err());
    }
}
