//! Iceberg partition transforms (identity, year, month, day, hour, truncate, bucket) and the
//! Hive-style `name=value` path segments derived from them.

use std::fmt;

use chrono::{DateTime, Datelike, NaiveDate, Timelike};

use super::types::{decimal_min_bytes, Type, Value};
use inlet_common::error::{Error, Result};

/// The path segment value of a NULL partition value, as Hive names it.
pub const NULL_PARTITION: &str = "__HIVE_DEFAULT_PARTITION__";

const MICROS_PER_DAY: i64 = 86_400_000_000;
const MICROS_PER_HOUR: i64 = 3_600_000_000;

/// A partition transform.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transform {
    Identity,
    Year,
    Month,
    Day,
    Hour,
    Truncate(u32),
    Bucket(u32),
}

/// The transform names accepted in configuration, for error messages.
pub const TRANSFORM_NAMES: &str = "identity, year, month, day, hour, truncate[W], bucket[N]";

impl Transform {
    /// Parses the spec's transform string (`day`, `bucket[16]`, `truncate[4]`, ...).
    pub fn parse(text: &str) -> Result<Transform> {
        let t = text.trim();
        let bracketed = |prefix: &str| -> Option<Result<u32>> {
            let inner = t
                .strip_prefix(prefix)?
                .strip_prefix('[')?
                .strip_suffix(']')?;
            Some(match inner.trim().parse::<u32>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(Error::config(format!(
                    "transform \"{text}\" needs a positive integer in brackets, e.g. {prefix}[16]"
                ))),
            })
        };
        Ok(match t {
            "identity" => Transform::Identity,
            "year" | "years" => Transform::Year,
            "month" | "months" => Transform::Month,
            "day" | "days" => Transform::Day,
            "hour" | "hours" => Transform::Hour,
            _ => {
                if let Some(w) = bracketed("truncate") {
                    Transform::Truncate(w?)
                } else if let Some(n) = bracketed("bucket") {
                    Transform::Bucket(n?)
                } else {
                    return Err(Error::config(format!(
                        "unknown transform \"{text}\"; expected {TRANSFORM_NAMES}"
                    )));
                }
            }
        })
    }

    /// The type of the transformed value, or an error if the transform does not apply to `source`.
    pub fn result_type(&self, source: Type) -> Result<Type> {
        let bad = || {
            Err(Error::config(format!(
                "transform {self} cannot be applied to a column of type {source}"
            )))
        };
        match self {
            Transform::Identity => Ok(source),
            Transform::Year | Transform::Month => match source {
                Type::Date | Type::Timestamp | Type::TimestampTz => Ok(Type::Int),
                _ => bad(),
            },
            Transform::Day => match source {
                Type::Date | Type::Timestamp | Type::TimestampTz => Ok(Type::Date),
                _ => bad(),
            },
            Transform::Hour => match source {
                Type::Timestamp | Type::TimestampTz => Ok(Type::Int),
                _ => bad(),
            },
            Transform::Truncate(_) => match source {
                Type::Int | Type::Long | Type::Decimal { .. } | Type::String | Type::Binary => {
                    Ok(source)
                }
                _ => bad(),
            },
            Transform::Bucket(_) => match source {
                Type::Boolean | Type::Float | Type::Double => bad(),
                _ => Ok(Type::Int),
            },
        }
    }

    /// The suffix of the default partition field name (`ts_day`, `id_bucket`).
    pub fn field_suffix(&self) -> Option<&'static str> {
        match self {
            Transform::Identity => None,
            Transform::Year => Some("year"),
            Transform::Month => Some("month"),
            Transform::Day => Some("day"),
            Transform::Hour => Some("hour"),
            Transform::Truncate(_) => Some("trunc"),
            Transform::Bucket(_) => Some("bucket"),
        }
    }

    /// Applies the transform; NULL maps to NULL.
    pub fn apply(&self, value: &Value) -> Value {
        match (self, value) {
            (_, Value::Null) => Value::Null,
            (Transform::Identity, v) => v.clone(),
            (Transform::Year, v) => date_of(v).map_or(Value::Null, |d| Value::Int(d.year() - 1970)),
            (Transform::Month, v) => date_of(v).map_or(Value::Null, |d| {
                Value::Int((d.year() - 1970) * 12 + d.month0() as i32)
            }),
            (Transform::Day, Value::Date(d)) => Value::Date(*d),
            (Transform::Day, Value::Timestamp(us) | Value::TimestampTz(us)) => {
                Value::Date(us.div_euclid(MICROS_PER_DAY) as i32)
            }
            (Transform::Hour, Value::Timestamp(us) | Value::TimestampTz(us)) => {
                Value::Int(us.div_euclid(MICROS_PER_HOUR) as i32)
            }
            (Transform::Truncate(w), v) => truncate(*w, v),
            (Transform::Bucket(n), v) => match bucket_hash(v) {
                Some(h) => Value::Int(((h & i32::MAX) % *n as i32).max(0)),
                None => Value::Null,
            },
            _ => Value::Null,
        }
    }

    /// The human-readable form of a transformed value, as used in partition paths.
    pub fn to_human_string(&self, value: &Value) -> String {
        match (self, value) {
            (_, Value::Null) => NULL_PARTITION.to_string(),
            (Transform::Year, Value::Int(y)) => format!("{}", 1970 + y),
            (Transform::Month, Value::Int(m)) => {
                format!("{:04}-{:02}", 1970 + m.div_euclid(12), m.rem_euclid(12) + 1)
            }
            (Transform::Hour, Value::Int(h)) => {
                match DateTime::from_timestamp(*h as i64 * 3600, 0) {
                    Some(t) => format!("{}-{:02}", t.date_naive(), t.hour()),
                    None => h.to_string(),
                }
            }
            (_, v) => human_value(v),
        }
    }
}

impl fmt::Display for Transform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transform::Identity => f.write_str("identity"),
            Transform::Year => f.write_str("year"),
            Transform::Month => f.write_str("month"),
            Transform::Day => f.write_str("day"),
            Transform::Hour => f.write_str("hour"),
            Transform::Truncate(w) => write!(f, "truncate[{w}]"),
            Transform::Bucket(n) => write!(f, "bucket[{n}]"),
        }
    }
}

fn date_of(value: &Value) -> Option<NaiveDate> {
    match value {
        Value::Date(d) => epoch_date().checked_add_signed(chrono::Duration::days(*d as i64)),
        Value::Timestamp(us) | Value::TimestampTz(us) => {
            DateTime::from_timestamp_micros(*us).map(|t| t.date_naive())
        }
        _ => None,
    }
}

fn epoch_date() -> NaiveDate {
    NaiveDate::default()
}

fn truncate(w: u32, value: &Value) -> Value {
    match value {
        Value::Int(v) => Value::Int(v - v.rem_euclid(w as i32)),
        Value::Long(v) => Value::Long(v - v.rem_euclid(w as i64)),
        Value::Decimal(v) => Value::Decimal(v - v.rem_euclid(w as i128)),
        Value::String(s) => Value::String(s.chars().take(w as usize).collect()),
        Value::Binary(b) => Value::Binary(b.iter().take(w as usize).copied().collect()),
        _ => Value::Null,
    }
}

/// The spec's 32-bit murmur3 hash of a value, as the `bucket` transform uses it.
pub fn bucket_hash(value: &Value) -> Option<i32> {
    let bytes = match value {
        Value::Int(v) | Value::Date(v) => (*v as i64).to_le_bytes().to_vec(),
        Value::Long(v) | Value::Time(v) | Value::Timestamp(v) | Value::TimestampTz(v) => {
            v.to_le_bytes().to_vec()
        }
        Value::Decimal(v) => decimal_min_bytes(*v),
        Value::String(s) => s.as_bytes().to_vec(),
        Value::Binary(b) => b.clone(),
        _ => return None,
    };
    Some(murmur3_x86_32(&bytes, 0) as i32)
}

/// MurmurHash3 x86 32-bit.
pub fn murmur3_x86_32(data: &[u8], seed: u32) -> u32 {
    const C1: u32 = 0xcc9e_2d51;
    const C2: u32 = 0x1b87_3593;
    let mut h = seed;
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(C1).rotate_left(15).wrapping_mul(C2);
        h ^= k;
        h = h.rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64);
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        let mut k = 0u32;
        for (i, b) in tail.iter().enumerate() {
            k |= (*b as u32) << (8 * i);
        }
        k = k.wrapping_mul(C1).rotate_left(15).wrapping_mul(C2);
        h ^= k;
    }
    h ^= data.len() as u32;
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// A value as text, the way partition paths and logs show it.
pub fn human_value(value: &Value) -> String {
    match value {
        Value::Null => NULL_PARTITION.to_string(),
        Value::Boolean(b) => b.to_string(),
        Value::Int(v) => v.to_string(),
        Value::Long(v) => v.to_string(),
        Value::Float(v) => v.to_string(),
        Value::Double(v) => v.to_string(),
        Value::Decimal(v) => v.to_string(),
        Value::Date(d) => date_of(&Value::Date(*d)).map_or(d.to_string(), |d| d.to_string()),
        Value::Time(us) => {
            let secs = us.div_euclid(1_000_000);
            format!(
                "{:02}:{:02}:{:02}.{:06}",
                secs / 3600,
                secs / 60 % 60,
                secs % 60,
                us.rem_euclid(1_000_000)
            )
        }
        Value::Timestamp(us) | Value::TimestampTz(us) => DateTime::from_timestamp_micros(*us)
            .map_or(us.to_string(), |t| {
                t.naive_utc().format("%Y-%m-%dT%H:%M:%S%.f").to_string()
            }),
        Value::String(s) => s.clone(),
        Value::Binary(b) => b.iter().map(|x| format!("{x:02x}")).collect(),
    }
}

/// Escapes a partition value for a path segment the way Hive does, so `/`, `=`, `%` and
/// control characters cannot change the directory structure.
pub fn escape_path_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let escape = c.is_control()
            || matches!(
                c,
                '"' | '#' | '%' | '\'' | '*' | '/' | ':' | '=' | '?' | '\\' | '{' | '[' | ']' | '^'
            );
        if escape {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    match out.as_str() {
        // A bare `.` or `..` value stays inside `name=..`, but escaping keeps tools that split
        // on `=` from seeing a relative path.
        "." => "%2E".to_string(),
        ".." => "%2E%2E".to_string(),
        _ => out,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(v: Value) -> i32 {
        bucket_hash(&v).unwrap()
    }

    #[test]
    fn bucket_hash_matches_the_spec_test_vectors() {
        assert_eq!(hash(Value::Int(34)), 2017239379);
        assert_eq!(hash(Value::Long(34)), 2017239379);
        assert_eq!(hash(Value::Decimal(1420)), -500754589);
        assert_eq!(hash(Value::Date(17486)), -653330422);
        assert_eq!(hash(Value::Time(81_068_000_000)), -662762989);
        assert_eq!(hash(Value::Timestamp(1_510_871_468_000_000)), -2047944441);
        assert_eq!(hash(Value::TimestampTz(1_510_871_468_000_000)), -2047944441);
        assert_eq!(hash(Value::String("iceberg".into())), 1210000089);
        assert_eq!(hash(Value::Binary(vec![0, 1, 2, 3])), -188683207);
    }

    #[test]
    fn time_transforms_floor_toward_negative_infinity() {
        let before_epoch = Value::Timestamp(-1);
        assert_eq!(Transform::Day.apply(&before_epoch), Value::Date(-1));
        assert_eq!(Transform::Hour.apply(&before_epoch), Value::Int(-1));
        assert_eq!(Transform::Year.apply(&before_epoch), Value::Int(-1));
        assert_eq!(Transform::Month.apply(&before_epoch), Value::Int(-1));
        let ts = Value::TimestampTz(1_510_871_468_000_000); // 2017-11-16T22:31:08Z
        assert_eq!(Transform::Year.apply(&ts), Value::Int(47));
        assert_eq!(Transform::Month.apply(&ts), Value::Int(47 * 12 + 10));
        assert_eq!(Transform::Day.apply(&ts), Value::Date(17486));
        assert_eq!(
            Transform::Hour.to_human_string(&Transform::Hour.apply(&ts)),
            "2017-11-16-22"
        );
        assert_eq!(
            Transform::Day.to_human_string(&Value::Date(17486)),
            "2017-11-16"
        );
        assert_eq!(
            Transform::Month.to_human_string(&Value::Int(47 * 12 + 10)),
            "2017-11"
        );
    }

    #[test]
    fn truncate_follows_the_spec() {
        assert_eq!(
            Transform::Truncate(10).apply(&Value::Int(-1)),
            Value::Int(-10)
        );
        assert_eq!(
            Transform::Truncate(10).apply(&Value::Long(15)),
            Value::Long(10)
        );
        assert_eq!(
            Transform::Truncate(50).apply(&Value::Decimal(1065)),
            Value::Decimal(1050)
        );
        assert_eq!(
            Transform::Truncate(3).apply(&Value::String("iceberg".into())),
            Value::String("ice".into())
        );
    }

    #[test]
    fn parses_transforms_with_clear_errors() {
        assert_eq!(
            Transform::parse("bucket[16]").unwrap(),
            Transform::Bucket(16)
        );
        assert_eq!(
            Transform::parse("truncate[4]").unwrap(),
            Transform::Truncate(4)
        );
        let err = Transform::parse("dayz").unwrap_err().to_string();
        assert!(
            err.contains("expected identity, year, month, day, hour"),
            "{err}"
        );
        assert!(Transform::parse("bucket[0]").is_err());
        assert!(Transform::Hour.result_type(Type::Date).is_err());
    }

    #[test]
    fn path_values_cannot_escape_their_segment() {
        assert_eq!(escape_path_value("a/b=c"), "a%2Fb%3Dc");
        assert_eq!(escape_path_value(".."), "%2E%2E");
        assert_eq!(escape_path_value("50%"), "50%25");
        assert_eq!(escape_path_value(""), "");
        assert_eq!(escape_path_value("ünï code"), "ünï code");
    }
}
