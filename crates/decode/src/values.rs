//! JSON field values → Iceberg values of a column's type, honouring Debezium and Kafka Connect
//! logical types when the message carries a schema and the column's `time_unit` when it does not.

use base64::Engine;
use chrono::{DateTime, NaiveDate, NaiveDateTime, NaiveTime, Timelike};
use serde_json::Value as Json;

use super::Column;
use crate::config::TimeUnit;
use inlet_iceberg::types::{Type, Value};

/// What the message's own schema says about a field.
#[derive(Debug, Default, Clone, Copy)]
pub struct FieldHint<'a> {
    /// Connect schema `name` (`io.debezium.time.MicroTimestamp`, ...).
    pub logical: Option<&'a str>,
    /// Connect schema `type` (`int64`, `bytes`, `string`, ...).
    pub connect_type: Option<&'a str>,
    /// Decimal scale from the schema's parameters.
    pub scale: Option<u32>,
}

/// Logical name for binary values sent as ISO-8859-1 text, one character per byte (Canal's
/// binary and blob columns).
pub const LATIN1_BINARY: &str = "latin1-binary";

/// Converts one JSON field value into `column`'s type. The error says what was expected and found.
pub fn convert(v: &Json, column: &Column, hint: FieldHint<'_>) -> Result<Value, String> {
    if v.is_null() {
        return if column.required {
            Err("is required but null".into())
        } else {
            Ok(Value::Null)
        };
    }
    let mismatch = || format!("expected {}, found {}", column.ty, short(v));
    let ty = column.ty;
    if let Json::String(s) = v {
        // MySQL stores invalid dates as zero dates; Maxwell and Canal pass them on verbatim.
        if s.starts_with("0000-00-00")
            && matches!(ty, Type::Date | Type::Timestamp | Type::TimestampTz)
        {
            return if column.required {
                Err(format!("zero date {} in a required column", short(v)))
            } else {
                Ok(Value::Null)
            };
        }
    }
    Ok(match ty {
        Type::Boolean => match v {
            Json::Bool(b) => Value::Boolean(*b),
            Json::Number(n) if n.as_i64() == Some(0) || n.as_i64() == Some(1) => {
                Value::Boolean(n.as_i64() == Some(1))
            }
            Json::String(s) if s == "true" || s == "false" => Value::Boolean(s == "true"),
            // MySQL's TINYINT(1) as text (Canal).
            Json::String(s) if s == "1" || s == "0" => Value::Boolean(s == "1"),
            _ => return Err(mismatch()),
        },
        Type::Int => {
            let n = integer(v).ok_or_else(mismatch)?;
            Value::Int(i32::try_from(n).map_err(|_| format!("{n} does not fit int"))?)
        }
        Type::Long => Value::Long(integer(v).ok_or_else(mismatch)?),
        Type::Float => Value::Float(float(v).ok_or_else(mismatch)? as f32),
        Type::Double => Value::Double(float(v).ok_or_else(mismatch)?),
        Type::String => match decimal_text(v, hint) {
            Some(text) => Value::String(text?),
            None if time_unit(hint).is_some() && v.is_number() => {
                let unit = time_unit(hint).unwrap_or(TimeUnit::Micros);
                Value::String(duration_text(to_micros(
                    integer(v).ok_or_else(mismatch)?,
                    unit,
                )))
            }
            None => match v {
                Json::String(s) => Value::String(s.clone()),
                other => Value::String(other.to_string()),
            },
        },
        Type::Binary => match v {
            Json::String(s) if hint.logical == Some(LATIN1_BINARY) => Value::Binary(
                s.chars()
                    .map(u8::try_from)
                    .collect::<Result<_, _>>()
                    .map_err(|_| format!("expected ISO-8859-1 binary text, found {}", short(v)))?,
            ),
            Json::String(s) => Value::Binary(
                base64::engine::general_purpose::STANDARD
                    .decode(s)
                    .map_err(|_| format!("expected base64 binary, found {}", short(v)))?,
            ),
            _ => return Err(mismatch()),
        },
        Type::Decimal { precision, scale } => {
            let (unscaled, from_scale) = decimal(v, hint, scale).ok_or_else(mismatch)?;
            let value = rescale(unscaled, from_scale, scale as u32)
                .ok_or_else(|| format!("{} does not fit {ty} without rounding", short(v)))?;
            if value.unsigned_abs() >= 10u128.pow(precision as u32) {
                return Err(format!("{} exceeds the precision of {ty}", short(v)));
            }
            Value::Decimal(value)
        }
        Type::Date => match v {
            Json::String(s) => Value::Date(
                parse_date(s).ok_or_else(|| format!("expected a date, found {}", short(v)))?,
            ),
            _ => {
                let n = integer(v).ok_or_else(mismatch)?;
                // Connect's Timestamp type on a date column means milliseconds.
                let days = match hint.logical {
                    Some(
                        "org.apache.kafka.connect.data.Timestamp" | "io.debezium.time.Timestamp",
                    ) => n.div_euclid(86_400_000),
                    _ => n,
                };
                Value::Date(i32::try_from(days).map_err(|_| mismatch())?)
            }
        },
        Type::Time => match v {
            Json::String(s) => Value::Time(
                parse_time(s).ok_or_else(|| format!("expected a time, found {}", short(v)))?,
            ),
            _ => {
                let n = integer(v).ok_or_else(mismatch)?;
                let unit = time_unit(hint).unwrap_or(column.time_unit);
                time_of_day(to_micros(n, unit))?
            }
        },
        Type::Timestamp | Type::TimestampTz => {
            let micros = match v {
                Json::String(s) => parse_timestamp(s)
                    .ok_or_else(|| format!("expected a timestamp, found {}", short(v)))?,
                _ => return timestamp_of(integer(v).ok_or_else(mismatch)?, column, hint),
            };
            ts_value(ty, micros)
        }
    })
}

/// A timestamp column's value of an integer field: in the unit its logical type names, else
/// the column's.
fn timestamp_of(n: i64, column: &Column, hint: FieldHint<'_>) -> Result<Value, String> {
    let ty = column.ty;
    let unit = match hint.logical {
        Some("io.debezium.time.Timestamp" | "org.apache.kafka.connect.data.Timestamp") => {
            TimeUnit::Millis
        }
        Some("io.debezium.time.MicroTimestamp") => TimeUnit::Micros,
        Some("io.debezium.time.NanoTimestamp") => TimeUnit::Nanos,
        Some("io.debezium.time.Date" | "org.apache.kafka.connect.data.Date") => {
            let micros = n
                .checked_mul(86_400_000_000)
                .ok_or_else(|| format!("{n} days is out of range for {ty}"))?;
            return Ok(ts_value(ty, micros));
        }
        _ => column.time_unit,
    };
    Ok(ts_value(ty, to_micros(n, unit)))
}

/// A field's value as read from JSON text: what [`convert`] needs of it, with a string
/// borrowed from the text where the text holds it unescaped.
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar<'a> {
    Null,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(std::borrow::Cow<'a, str>),
    /// An array or object.
    Other(Json),
}

impl Scalar<'_> {
    pub fn is_null(&self) -> bool {
        matches!(self, Scalar::Null)
    }

    /// The JSON value the text holds, as `serde_json` reads it.
    pub fn into_json(self) -> Json {
        match self {
            Scalar::Null => Json::Null,
            Scalar::Bool(b) => Json::Bool(b),
            Scalar::U64(n) => Json::Number(n.into()),
            Scalar::I64(n) => Json::Number(n.into()),
            Scalar::F64(f) => serde_json::Number::from_f64(f).map_or(Json::Null, Json::Number),
            Scalar::Str(s) => Json::String(s.into_owned()),
            Scalar::Other(v) => v,
        }
    }
}

/// [`convert`] of the scalar's JSON value: the everyday fields (text into strings and
/// decimals, integers into integers and timestamps) without building the value, the rest
/// through it.
pub fn convert_scalar(
    v: Scalar<'_>,
    column: &Column,
    hint: FieldHint<'_>,
) -> Result<Value, String> {
    let int = match v {
        Scalar::I64(n) => Some(n),
        Scalar::U64(n) => i64::try_from(n).ok(),
        _ => None,
    };
    match (v, column.ty) {
        (Scalar::Null, _) if column.required => Err("is required but null".into()),
        (Scalar::Null, _) => Ok(Value::Null),
        (Scalar::Str(s), Type::String) if !is_decimal(hint) => Ok(Value::String(s.into_owned())),
        (Scalar::Bool(b), Type::Boolean) => Ok(Value::Boolean(b)),
        (_, Type::Long) if int.is_some() => Ok(Value::Long(int.unwrap_or_default())),
        (_, Type::Int) if int.is_some_and(|n| i32::try_from(n).is_ok()) => {
            Ok(Value::Int(int.unwrap_or_default() as i32))
        }
        (_, Type::Timestamp | Type::TimestampTz) if int.is_some() => {
            timestamp_of(int.unwrap_or_default(), column, hint)
        }
        (Scalar::Str(s), Type::Decimal { precision, scale })
            if hint.connect_type != Some("bytes") =>
        {
            let fits = parse_decimal_text(&s)
                .and_then(|(unscaled, from)| rescale(unscaled, from, scale as u32))
                .filter(|d| d.unsigned_abs() < 10u128.pow(precision as u32));
            match fits {
                Some(d) => Ok(Value::Decimal(d)),
                // Its error message, or the base64 reading.
                None => convert(&Scalar::Str(s).into_json(), column, hint),
            }
        }
        (v, _) => convert(&v.into_json(), column, hint),
    }
}

/// Connect's and Debezium's decimal types: a value is base64 bytes of its unscaled integer,
/// with a fixed scale (`Decimal`) or its own (`VariableScaleDecimal`).
const DECIMAL: &str = "org.apache.kafka.connect.data.Decimal";
const VARIABLE_DECIMAL: &str = "io.debezium.data.VariableScaleDecimal";

fn is_decimal(hint: FieldHint<'_>) -> bool {
    matches!(hint.logical, Some(DECIMAL | VARIABLE_DECIMAL))
}

/// The exact text of a decimal field's value for a `string` column (numerics without scale,
/// or wider than Iceberg's 38 digits): `None` where the field is no decimal; an error where its
/// value is not one.
fn decimal_text(v: &Json, hint: FieldHint<'_>) -> Option<Result<String, String>> {
    if !is_decimal(hint) {
        return None;
    }
    let bad = || format!("expected a decimal, found {}", short(v));
    let (bytes, scale) = match (hint.logical?, v) {
        (VARIABLE_DECIMAL, Json::Object(o)) => {
            let scale = o.get("scale").and_then(Json::as_i64);
            let bytes = o.get("value").and_then(Json::as_str);
            match (scale, bytes) {
                (Some(scale), Some(bytes)) => (bytes, scale),
                _ => return Some(Err(bad())),
            }
        }
        (DECIMAL, Json::String(s)) if hint.connect_type == Some("bytes") => {
            (s.as_str(), i64::from(hint.scale.unwrap_or(0)))
        }
        // `decimal.handling.mode: string` (and text decimals of other formats) as they came.
        (DECIMAL | VARIABLE_DECIMAL, Json::String(s)) => {
            return Some(parse_decimal_text(s).map(|_| s.clone()).ok_or_else(bad))
        }
        (DECIMAL | VARIABLE_DECIMAL, Json::Number(n)) => return Some(Ok(n.to_string())),
        _ => return Some(Err(bad())),
    };
    Some(
        base64::engine::general_purpose::STANDARD
            .decode(bytes)
            .ok()
            .filter(|raw| !raw.is_empty())
            .map(|raw| scaled_text(&signed_digits(&raw), scale))
            .ok_or_else(bad),
    )
}

/// The decimal digits of a big-endian two's-complement integer of any length, with a leading
/// `-` if negative.
fn signed_digits(raw: &[u8]) -> String {
    let negative = raw.first().is_some_and(|b| b & 0x80 != 0);
    let mut magnitude: Vec<u8> = raw.to_vec();
    if negative {
        // Two's complement: invert and add one.
        for b in magnitude.iter_mut() {
            *b = !*b;
        }
        for b in magnitude.iter_mut().rev() {
            let (sum, carry) = b.overflowing_add(1);
            *b = sum;
            if !carry {
                break;
            }
        }
    }
    // Long division by 10^19 of the base-256 number, most significant byte first.
    let mut chunks = Vec::new();
    while magnitude.iter().any(|b| *b != 0) {
        let mut rest: u128 = 0;
        for b in magnitude.iter_mut() {
            let cur = (rest << 8) | u128::from(*b);
            *b = (cur / 10_000_000_000_000_000_000) as u8;
            rest = cur % 10_000_000_000_000_000_000;
        }
        chunks.push(rest as u64);
    }
    let mut out = String::from(if negative { "-" } else { "" });
    match chunks.split_last() {
        None => out.push('0'),
        Some((first, rest)) => {
            out.push_str(&first.to_string());
            for c in rest.iter().rev() {
                out.push_str(&format!("{c:019}"));
            }
        }
    }
    out
}

/// `digits` (an integer's text) divided by 10^`scale`, as the database prints it: `12345`
/// at scale 3 is `12.345`, at scale 6 `0.012345`, at scale -2 `1234500`.
fn scaled_text(digits: &str, scale: i64) -> String {
    let (sign, digits) = match digits.strip_prefix('-') {
        Some(d) => ("-", d),
        None => ("", digits),
    };
    if scale <= 0 {
        let zeros = if digits == "0" { 0 } else { (-scale) as usize };
        return format!("{sign}{digits}{}", "0".repeat(zeros));
    }
    let scale = scale as usize;
    let padded = if digits.len() <= scale {
        format!("{}{digits}", "0".repeat(scale + 1 - digits.len()))
    } else {
        digits.to_string()
    };
    let (int, frac) = padded.split_at(padded.len() - scale);
    format!("{sign}{int}.{frac}")
}

/// The unit of an integer time field's logical type.
fn time_unit(hint: FieldHint<'_>) -> Option<TimeUnit> {
    match hint.logical? {
        "io.debezium.time.Time" | "org.apache.kafka.connect.data.Time" => Some(TimeUnit::Millis),
        "io.debezium.time.MicroTime" => Some(TimeUnit::Micros),
        "io.debezium.time.NanoTime" => Some(TimeUnit::Nanos),
        _ => None,
    }
}

/// An Iceberg `time` holds a time of day, 00:00 up to (not including) 24:00. MySQL's TIME
/// also holds durations (up to ±838 h) and negative values, and PostgreSQL's time holds
/// 24:00:00: none of them is a time of day.
fn time_of_day(micros: i64) -> Result<Value, String> {
    const DAY: i64 = 86_400_000_000;
    if (0..DAY).contains(&micros) {
        return Ok(Value::Time(micros));
    }
    Err(format!(
        "{} is no time of day (00:00:00 up to 24:00:00), so a time column cannot hold it \
         without changing it; give the column a long (microseconds) or string type \
         (table.column_types) to keep such values",
        duration_text(micros)
    ))
}

/// A time or duration as MySQL prints it: `[-]H:MM:SS`, with six fraction digits when it
/// has a fraction (`838:59:59`, `-00:00:00.000001`).
fn duration_text(micros: i64) -> String {
    let sign = if micros < 0 { "-" } else { "" };
    let m = micros.unsigned_abs();
    let (secs, frac) = (m / 1_000_000, m % 1_000_000);
    let (h, mi, se) = (secs / 3600, secs / 60 % 60, secs % 60);
    if frac == 0 {
        format!("{sign}{h:02}:{mi:02}:{se:02}")
    } else {
        format!("{sign}{h:02}:{mi:02}:{se:02}.{frac:06}")
    }
}

fn ts_value(ty: Type, micros: i64) -> Value {
    if ty == Type::TimestampTz {
        Value::TimestampTz(micros)
    } else {
        Value::Timestamp(micros)
    }
}

fn short(v: &Json) -> String {
    let s = v.to_string();
    if s.len() > 64 {
        let cut = (0..=61).rev().find(|i| s.is_char_boundary(*i)).unwrap_or(0);
        format!("{}...", &s[..cut])
    } else {
        s
    }
}

fn integer(v: &Json) -> Option<i64> {
    match v {
        Json::Number(n) => n.as_i64().or_else(|| {
            let f = n.as_f64()?;
            (f.fract() == 0.0 && f.abs() < 9.0e18).then_some(f as i64)
        }),
        Json::String(s) => s.trim().parse().ok(),
        Json::Bool(b) => Some(i64::from(*b)),
        _ => None,
    }
}

fn float(v: &Json) -> Option<f64> {
    match v {
        Json::Number(n) => n.as_f64(),
        Json::String(s) => match s.as_str() {
            "NaN" => Some(f64::NAN),
            "Infinity" => Some(f64::INFINITY),
            "-Infinity" => Some(f64::NEG_INFINITY),
            other => other.trim().parse().ok(),
        },
        _ => None,
    }
}

fn to_micros(n: i64, unit: TimeUnit) -> i64 {
    match unit {
        TimeUnit::Millis => n.saturating_mul(1000),
        TimeUnit::Micros => n,
        TimeUnit::Nanos => n.div_euclid(1000),
    }
}

/// A decimal as (unscaled, scale) from a decimal string, a JSON number, Connect's base64 bytes
/// or Debezium's `VariableScaleDecimal` struct.
fn decimal(v: &Json, hint: FieldHint<'_>, column_scale: u8) -> Option<(i128, u32)> {
    match v {
        Json::Number(n) => parse_decimal_text(&n.to_string()),
        Json::String(s) => {
            let bytes_schema = hint.connect_type == Some("bytes");
            if !bytes_schema {
                if let Some(d) = parse_decimal_text(s) {
                    return Some(d);
                }
            }
            let raw = base64::engine::general_purpose::STANDARD.decode(s).ok()?;
            Some((
                unscaled_from_be(&raw)?,
                hint.scale.unwrap_or(column_scale as u32),
            ))
        }
        Json::Object(o) => {
            let scale = o.get("scale")?.as_u64()? as u32;
            let raw = base64::engine::general_purpose::STANDARD
                .decode(o.get("value")?.as_str()?)
                .ok()?;
            Some((unscaled_from_be(&raw)?, scale))
        }
        _ => None,
    }
}

fn unscaled_from_be(raw: &[u8]) -> Option<i128> {
    if raw.is_empty() || raw.len() > 16 {
        return None;
    }
    let fill = if raw[0] & 0x80 != 0 { 0xff } else { 0 };
    let mut buf = [fill; 16];
    buf[16 - raw.len()..].copy_from_slice(raw);
    Some(i128::from_be_bytes(buf))
}

/// Parses `-12.340`, `1e3`, `5` into (unscaled, scale).
fn parse_decimal_text(s: &str) -> Option<(i128, u32)> {
    let s = s.trim();
    let (mantissa, exp) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], s[i + 1..].parse::<i32>().ok()?),
        None => (s, 0),
    };
    let (neg, digits) = match mantissa.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, mantissa.strip_prefix('+').unwrap_or(mantissa)),
    };
    let (int_part, frac_part) = digits.split_once('.').unwrap_or((digits, ""));
    if int_part.is_empty() && frac_part.is_empty() {
        return None;
    }
    if !int_part
        .bytes()
        .chain(frac_part.bytes())
        .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let mut unscaled = digits_value(int_part, frac_part)?;
    // i64: an exponent near i32::MIN overflows i32.
    let mut scale = frac_part.len() as i64 - i64::from(exp);
    if scale < 0 {
        unscaled = unscaled.checked_mul(10i128.checked_pow(u32::try_from(-scale).ok()?)?)?;
        scale = 0;
    }
    Some((
        if neg { -unscaled } else { unscaled },
        u32::try_from(scale).ok()?,
    ))
}

/// Two runs of ASCII digits read as one integer; `None` where it overflows.
fn digits_value(int_part: &str, frac_part: &str) -> Option<i128> {
    int_part
        .bytes()
        .chain(frac_part.bytes())
        .try_fold(0i128, |n, b| {
            n.checked_mul(10)?.checked_add(i128::from(b - b'0'))
        })
}

/// Changes scale without losing digits; `None` if digits would be lost or it overflows.
fn rescale(unscaled: i128, from: u32, to: u32) -> Option<i128> {
    if from <= to {
        unscaled.checked_mul(10i128.checked_pow(to - from)?)
    } else {
        let div = 10i128.checked_pow(from - to)?;
        (unscaled % div == 0).then_some(unscaled / div)
    }
}

fn parse_date(s: &str) -> Option<i32> {
    let d = NaiveDate::parse_from_str(s.get(..10)?, "%Y-%m-%d").ok()?;
    Some((d - NaiveDate::default()).num_days() as i32)
}

fn parse_time(s: &str) -> Option<i64> {
    let s = s.trim_end_matches('Z');
    let t = NaiveTime::parse_from_str(s, "%H:%M:%S%.f").ok()?;
    Some(t.num_seconds_from_midnight() as i64 * 1_000_000 + (t.nanosecond() / 1000) as i64)
}

/// ISO-8601 with or without offset; a value without offset is taken as UTC.
fn parse_timestamp(s: &str) -> Option<i64> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Some(t.timestamp_micros());
    }
    // The last form is GoldenGate's default for dates and timestamps.
    for fmt in [
        "%Y-%m-%dT%H:%M:%S%.f",
        "%Y-%m-%d %H:%M:%S%.f",
        "%Y-%m-%d:%H:%M:%S%.f",
    ] {
        if let Ok(t) = NaiveDateTime::parse_from_str(s, fmt) {
            return Some(t.and_utc().timestamp_micros());
        }
    }
    for fmt in ["%Y-%m-%d %H:%M:%S%.f%#z", "%Y-%m-%dT%H:%M:%S%.f%#z"] {
        if let Ok(t) = DateTime::parse_from_str(s, fmt) {
            return Some(t.timestamp_micros());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn col(ty: &str) -> Column {
        Column {
            name: "c".into(),
            ty: Type::parse(ty).unwrap(),
            required: false,
            time_unit: TimeUnit::Millis,
        }
    }

    fn hint(logical: &'static str) -> FieldHint<'static> {
        FieldHint {
            logical: Some(logical),
            ..FieldHint::default()
        }
    }

    #[test]
    fn decimals_from_every_handling_mode() {
        let c = col("decimal(10,2)");
        let none = FieldHint::default();
        assert_eq!(
            convert(&json!("12.3"), &c, none).unwrap(),
            Value::Decimal(1230)
        );
        assert_eq!(
            convert(&json!(12.34), &c, none).unwrap(),
            Value::Decimal(1234)
        );
        let bytes = FieldHint {
            connect_type: Some("bytes"),
            scale: Some(2),
            ..none
        };
        // 0x04D2 = 1234 → 12.34
        assert_eq!(
            convert(&json!("BNI="), &c, bytes).unwrap(),
            Value::Decimal(1234)
        );
        assert_eq!(
            convert(&json!({"scale": 1, "value": "ew=="}), &c, none).unwrap(),
            Value::Decimal(1230)
        );
        assert!(convert(&json!("1.234"), &c, none)
            .unwrap_err()
            .contains("without rounding"));
        assert!(convert(&json!("123456789.1"), &c, none)
            .unwrap_err()
            .contains("precision"));
        assert!(convert(&json!("1e-2147483648"), &c, none)
            .unwrap_err()
            .contains("without rounding"));
    }

    /// Numerics without scale and decimals wider than 38 digits land as the exact text the
    /// database prints, whatever their length, sign or scale.
    #[test]
    fn wide_and_unscaled_decimals_keep_their_exact_text() {
        let c = col("string");
        let variable = hint(VARIABLE_DECIMAL);
        let b64 = |raw: &[u8]| base64::engine::general_purpose::STANDARD.encode(raw);
        let text = |v: Json, h: FieldHint<'_>| match convert(&v, &c, h).unwrap() {
            Value::String(s) => s,
            other => panic!("{other:?}"),
        };
        // The value of the issue: {"scale":5,"value":"/uS2"} is 0xFEE4B6, -72,522 at scale 5.
        assert_eq!(
            text(json!({"scale": 5, "value": "/uS2"}), variable),
            "-0.72522"
        );
        assert_eq!(
            text(
                json!({"scale": 5, "value": b64(&[0x02, 0x49, 0xF0])}),
                variable
            ),
            "1.50000"
        );
        assert_eq!(text(json!({"scale": 0, "value": b64(&[0])}), variable), "0");
        assert_eq!(
            text(json!({"scale": 3, "value": b64(&[0xff])}), variable),
            "-0.001"
        );
        // 30 digits, beyond any i128 fraction of 38 digits once scaled, and 40 bytes long.
        let big = "123456789012345678901234567890123456789012345678901234567890";
        let mut raw = vec![0u8];
        for d in big.bytes() {
            let mut carry = u32::from(d - b'0');
            for byte in raw.iter_mut().rev() {
                let v = u32::from(*byte) * 10 + carry;
                *byte = v as u8;
                carry = v >> 8;
            }
            while carry > 0 {
                raw.insert(0, carry as u8);
                carry >>= 8;
            }
        }
        if raw[0] & 0x80 != 0 {
            raw.insert(0, 0);
        }
        assert_eq!(
            text(json!({"scale": 30, "value": b64(&raw)}), variable),
            "123456789012345678901234567890.123456789012345678901234567890"
        );
        let negated: Vec<u8> = {
            let mut n: Vec<u8> = raw.iter().map(|b| !b).collect();
            for b in n.iter_mut().rev() {
                let (sum, carry) = b.overflowing_add(1);
                *b = sum;
                if !carry {
                    break;
                }
            }
            n
        };
        assert_eq!(
            text(json!({"scale": 59, "value": b64(&negated)}), variable),
            "-1.23456789012345678901234567890123456789012345678901234567890"
        );
        // A fixed-scale Connect decimal wider than 38 digits (MySQL decimal(65,30)).
        let wide = FieldHint {
            logical: Some(DECIMAL),
            connect_type: Some("bytes"),
            scale: Some(30),
        };
        assert_eq!(
            text(json!(b64(&raw)), wide),
            "123456789012345678901234567890.123456789012345678901234567890"
        );
        // decimal.handling.mode: string sends the text itself.
        assert_eq!(
            text(
                json!("-12.500"),
                FieldHint {
                    connect_type: Some("string"),
                    ..variable
                }
            ),
            "-12.500"
        );
        assert!(convert(&json!({"scale": 1}), &c, variable)
            .unwrap_err()
            .contains("expected a decimal"));
        assert!(convert(&json!("not base64!"), &c, wide)
            .unwrap_err()
            .contains("expected a decimal"));
        // The text reader's path agrees.
        assert_eq!(
            convert_scalar(
                Scalar::Str(b64(&[0x04, 0xD2]).into()),
                &c,
                FieldHint {
                    scale: Some(2),
                    ..wide
                }
            ),
            Ok(Value::String("12.34".into()))
        );
    }

    proptest::proptest! {
        /// Any integer's digits as the two's-complement bytes Connect sends of it, at any scale.
        #[test]
        fn decimal_text_matches_the_integer(n in proptest::num::i128::ANY, scale in 0i64..45) {
            let raw = n.to_be_bytes();
            // Connect sends the shortest form; any sign-extended form reads the same.
            let fill = if n < 0 { 0xff } else { 0 };
            let skip = (0..15)
                .take_while(|i| raw[*i] == fill && (raw[i + 1] & 0x80) == (fill & 0x80))
                .count();
            let digits = signed_digits(&raw[skip..]);
            proptest::prop_assert_eq!(&digits, &n.to_string());
            let text = scaled_text(&digits, scale);
            let (unscaled, at) = parse_decimal_text(&text).unwrap();
            proptest::prop_assert_eq!((unscaled, i64::from(at)), (n, scale));
        }

        /// Every double printed the ways connectors print them (Java's `Double.toString`
        /// switches to `1.2345E11` forms; Rust's shortest and exponent forms) reads back as the
        /// same bits, and every float as the same float.
        #[test]
        fn floats_read_back_exactly(bits in proptest::num::u64::ANY, fbits in proptest::num::u32::ANY) {
            let x = f64::from_bits(bits);
            if x.is_finite() {
                for text in [format!("{x}"), format!("{x:e}"), format!("{x:E}"), format!("{x:?}")] {
                    let v: Json = serde_json::from_str(&text).unwrap();
                    let got = convert(&v, &col("double"), FieldHint::default()).unwrap();
                    proptest::prop_assert_eq!(format!("{got:?}"), format!("{:?}", Value::Double(x)), "{}", text);
                    let got = convert(&json!(text.clone()), &col("double"), FieldHint::default()).unwrap();
                    proptest::prop_assert_eq!(format!("{got:?}"), format!("{:?}", Value::Double(x)), "{}", text);
                }
            }
            let f = f32::from_bits(fbits);
            if f.is_finite() {
                for text in [format!("{f}"), format!("{f:e}")] {
                    let v: Json = serde_json::from_str(&text).unwrap();
                    let got = convert(&v, &col("float"), FieldHint::default()).unwrap();
                    proptest::prop_assert_eq!(format!("{got:?}"), format!("{:?}", Value::Float(f)), "{}", text);
                }
            }
        }
    }

    /// The value of the issue, in Java's exponent form, and the cases around it.
    #[test]
    fn doubles_in_exponent_form_are_the_nearest_double() {
        for (text, expect) in [
            ("3.7209423666139844E11", 372094236661.39844f64),
            ("-0.0", -0.0),
            ("4.9E-324", 4.9e-324),
            ("1.7976931348623157E308", f64::MAX),
            ("2.2250738585072014E-308", f64::MIN_POSITIVE),
        ] {
            let v: Json = serde_json::from_str(text).unwrap();
            match convert(&v, &col("double"), FieldHint::default()).unwrap() {
                Value::Double(d) => assert_eq!(d.to_bits(), expect.to_bits(), "{text}"),
                other => panic!("{other:?}"),
            }
        }
    }

    /// MySQL TIME durations and negative times are no time of day: an error, never wrapped.
    #[test]
    fn times_outside_a_day_are_refused() {
        let micro = hint("io.debezium.time.MicroTime");
        assert_eq!(
            convert(&json!(86_399_999_999i64), &col("time"), micro).unwrap(),
            Value::Time(86_399_999_999)
        );
        for bad in [-1i64, 86_400_000_000, 3_020_399_000_000] {
            assert!(convert(&json!(bad), &col("time"), micro)
                .unwrap_err()
                .contains("no time of day"));
        }
        // A long column holds a duration as microseconds, a string column as MySQL prints it.
        assert_eq!(
            convert(&json!(-1), &col("long"), micro).unwrap(),
            Value::Long(-1)
        );
        for (micros, text) in [
            (-1i64, "-00:00:00.000001"),
            (3_020_399_000_000, "838:59:59"),
            (-3_020_399_000_000, "-838:59:59"),
            (86_400_000_000, "24:00:00"),
            (45_296_500_000, "12:34:56.500000"),
        ] {
            assert_eq!(
                convert(&json!(micros), &col("string"), micro).unwrap(),
                Value::String(text.into())
            );
        }
        assert!(convert(&json!(86_400_000_000i64), &col("time"), micro)
            .unwrap_err()
            .contains("24:00:00 is no time of day"));
    }

    #[test]
    fn timestamps_follow_logical_types_then_column_unit() {
        let c = col("timestamptz");
        let ms = 1_700_000_000_123i64;
        assert_eq!(
            convert(&json!(ms), &c, hint("io.debezium.time.Timestamp")).unwrap(),
            Value::TimestampTz(ms * 1000)
        );
        assert_eq!(
            convert(
                &json!(ms * 1000 + 456),
                &c,
                hint("io.debezium.time.MicroTimestamp")
            )
            .unwrap(),
            Value::TimestampTz(ms * 1000 + 456)
        );
        assert_eq!(
            convert(
                &json!(ms * 1_000_000 + 456_789),
                &c,
                hint("io.debezium.time.NanoTimestamp")
            )
            .unwrap(),
            Value::TimestampTz(ms * 1000 + 456)
        );
        assert_eq!(
            convert(
                &json!("2023-11-14T22:13:20.123Z"),
                &c,
                hint("io.debezium.time.ZonedTimestamp")
            )
            .unwrap(),
            Value::TimestampTz(ms * 1000)
        );
        assert_eq!(
            convert(&json!(ms), &c, FieldHint::default()).unwrap(),
            Value::TimestampTz(ms * 1000)
        );
        let mut micros_col = col("timestamp");
        micros_col.time_unit = TimeUnit::Micros;
        assert_eq!(
            convert(&json!(5), &micros_col, FieldHint::default()).unwrap(),
            Value::Timestamp(5)
        );
    }

    #[test]
    fn dates_times_and_nulls() {
        assert_eq!(
            convert(&json!(19000), &col("date"), hint("io.debezium.time.Date")).unwrap(),
            Value::Date(19000)
        );
        assert!(convert(
            &json!(i64::MAX),
            &col("timestamp"),
            hint("io.debezium.time.Date")
        )
        .unwrap_err()
        .contains("out of range"));
        assert_eq!(
            convert(&json!("1970-01-02"), &col("date"), FieldHint::default()).unwrap(),
            Value::Date(1)
        );
        assert_eq!(
            convert(
                &json!(3_600_000_001i64),
                &col("time"),
                hint("io.debezium.time.MicroTime")
            )
            .unwrap(),
            Value::Time(3_600_000_001)
        );
        assert_eq!(
            convert(&json!("01:00:00.5"), &col("time"), FieldHint::default()).unwrap(),
            Value::Time(3_600_500_000)
        );
        let mut req = col("long");
        req.required = true;
        assert!(convert(&Json::Null, &req, FieldHint::default())
            .unwrap_err()
            .contains("required"));
        assert_eq!(
            convert(&Json::Null, &col("long"), FieldHint::default()).unwrap(),
            Value::Null
        );
    }

    #[test]
    fn scalars_reject_what_does_not_fit() {
        assert!(convert(&json!(3_000_000_000i64), &col("int"), FieldHint::default()).is_err());
        assert!(convert(&json!("abc"), &col("long"), FieldHint::default())
            .unwrap_err()
            .contains("expected long"));
        assert_eq!(
            convert(&json!(1), &col("boolean"), FieldHint::default()).unwrap(),
            Value::Boolean(true)
        );
        assert_eq!(
            convert(&json!({"a": 1}), &col("string"), FieldHint::default()).unwrap(),
            Value::String("{\"a\":1}".into())
        );
        assert_eq!(
            convert(&json!("AAEC"), &col("binary"), FieldHint::default()).unwrap(),
            Value::Binary(vec![0, 1, 2])
        );
    }

    #[test]
    fn text_forms_from_binlog_tools() {
        let none = FieldHint::default();
        let ts = |s: &str| convert(&json!(s), &col("timestamp"), none).unwrap();
        // 2024-03-15T10:20:30Z
        let base = 1_710_498_030_000_000i64;
        assert_eq!(ts("2024-03-15 10:20:30"), Value::Timestamp(base));
        assert_eq!(
            ts("2024-03-15 10:20:30.123"),
            Value::Timestamp(base + 123_000)
        );
        assert_eq!(
            ts("2024-03-15 10:20:30.123456"),
            Value::Timestamp(base + 123_456)
        );
        assert_eq!(ts("2024-03-15:10:20:30"), Value::Timestamp(base));
        assert_eq!(
            ts("2024-03-15:10:20:30.5"),
            Value::Timestamp(base + 500_000)
        );
        assert_eq!(
            convert(&json!("2024-03-15:10:20:30"), &col("date"), none).unwrap(),
            Value::Date(19797)
        );
        assert_eq!(
            convert(&json!("1"), &col("boolean"), none).unwrap(),
            Value::Boolean(true)
        );
        assert_eq!(
            convert(&json!("0"), &col("boolean"), none).unwrap(),
            Value::Boolean(false)
        );
        assert!(convert(&json!("2"), &col("boolean"), none).is_err());
        assert_eq!(
            convert(&json!("-42"), &col("int"), none).unwrap(),
            Value::Int(-42)
        );
        assert_eq!(
            convert(&json!("2.5"), &col("double"), none).unwrap(),
            Value::Double(2.5)
        );
        assert_eq!(
            convert(&json!("18446744073709551615"), &col("decimal(20,0)"), none).unwrap(),
            Value::Decimal(18_446_744_073_709_551_615)
        );
    }

    #[test]
    fn zero_dates_are_null_unless_required() {
        let none = FieldHint::default();
        for ty in ["date", "timestamp", "timestamptz"] {
            assert_eq!(
                convert(&json!("0000-00-00 00:00:00"), &col(ty), none).unwrap(),
                Value::Null
            );
        }
        let mut req = col("date");
        req.required = true;
        assert!(convert(&json!("0000-00-00"), &req, none)
            .unwrap_err()
            .contains("zero date"));
        assert_eq!(
            convert(&json!("0000-00-00"), &col("string"), none).unwrap(),
            Value::String("0000-00-00".into())
        );
    }

    #[test]
    fn latin1_binary_keeps_every_byte() {
        let c = col("binary");
        let latin1 = hint(LATIN1_BINARY);
        assert_eq!(
            convert(&json!("\u{0}\u{7f}\u{ff}A"), &c, latin1).unwrap(),
            Value::Binary(vec![0, 0x7f, 0xff, b'A'])
        );
        assert!(convert(&json!("\u{100}"), &c, latin1)
            .unwrap_err()
            .contains("ISO-8859-1"));
        // Without the hint the same text is base64.
        assert_eq!(
            convert(&json!("AAEC"), &c, FieldHint::default()).unwrap(),
            Value::Binary(vec![0, 1, 2])
        );
    }

    fn scalars() -> impl proptest::strategy::Strategy<Value = Scalar<'static>> {
        use proptest::prelude::*;
        let texts = prop::sample::select(vec![
            "",
            "0",
            "-0",
            "12.3",
            "-12.345",
            "+5",
            "1e3",
            "1E-2",
            "12345678.90",
            "123456789.1",
            "99999999999999999999999999999999999999",
            "999999999999999999999999999999999999999",
            "1.234",
            " 7 ",
            "abc",
            "BNI=",
            "ew==",
            "true",
            "false",
            "1",
            "NaN",
            "Infinity",
            "2024-02-29",
            "2024-02-29T12:34:56Z",
            "2024-02-29 12:34:56.123",
            "12:34:56.5",
            "0000-00-00 00:00:00",
            "0000-00-00",
            "2147483648",
            "-9223372036854775808",
            "é",
        ]);
        prop_oneof![
            Just(Scalar::Null),
            any::<bool>().prop_map(Scalar::Bool),
            any::<u64>().prop_map(Scalar::U64),
            prop::sample::select(vec![
                0u64,
                1,
                2_147_483_647,
                2_147_483_648,
                i64::MAX as u64,
                i64::MAX as u64 + 1,
                u64::MAX
            ])
            .prop_map(Scalar::U64),
            any::<i64>().prop_map(Scalar::I64),
            prop::sample::select(vec![-1i64, -2_147_483_648, -2_147_483_649, i64::MIN])
                .prop_map(Scalar::I64),
            prop::sample::select(vec![0.0f64, 1.5, -2.0, 1e300, 12.34, 9.5e18])
                .prop_map(Scalar::F64),
            texts.prop_map(|t| Scalar::Str(t.into())),
            "[0-9.eE+-]{0,12}".prop_map(|t| Scalar::Str(t.into())),
            Just(Scalar::Other(json!({"scale": 1, "value": "ew=="}))),
            Just(Scalar::Other(json!([1, 2]))),
        ]
    }

    proptest::proptest! {
        #[test]
        fn digits_read_as_the_string_of_them_parses(int_part in "[0-9]{0,30}", frac_part in "[0-9]{0,15}") {
            let joined = format!("{int_part}{frac_part}");
            let expected = if joined.is_empty() { Some(0) } else { joined.parse::<i128>().ok() };
            proptest::prop_assert_eq!(digits_value(&int_part, &frac_part), expected);
        }

        #[test]
        fn scalars_convert_as_their_json_values_do(
            v in scalars(),
            ty in proptest::sample::select(vec![
                "boolean", "int", "long", "float", "double", "string", "binary",
                "decimal(10,2)", "decimal(38,0)", "date", "time", "timestamp", "timestamptz",
            ]),
            logical in proptest::sample::select(vec![
                None, Some("io.debezium.time.Timestamp"), Some("io.debezium.time.MicroTimestamp"),
                Some("io.debezium.time.NanoTimestamp"), Some("io.debezium.time.Date"),
                Some(LATIN1_BINARY),
            ]),
            bytes in proptest::bool::ANY,
            required in proptest::bool::ANY,
        ) {
            let column = Column { required, ..col(ty) };
            let hint = FieldHint {
                logical,
                connect_type: bytes.then_some("bytes"),
                scale: bytes.then_some(2),
            };
            let json = v.clone().into_json();
            // Compared as printed: a NaN double equals no other.
            proptest::prop_assert_eq!(
                format!("{:?}", convert_scalar(v, &column, hint)),
                format!("{:?}", convert(&json, &column, hint))
            );
        }
    }
}
