//! Iceberg primitive types and values: parsing from config, JSON names for table metadata,
//! Arrow types for data files, and the spec's single-value binary form used for bounds.

use std::cmp::Ordering;
use std::fmt;

use arrow_schema::{DataType, TimeUnit};

use inlet_common::error::{Error, Result};

/// An Iceberg primitive type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Type {
    Boolean,
    Int,
    Long,
    Float,
    Double,
    Decimal { precision: u8, scale: u8 },
    Date,
    Time,
    Timestamp,
    TimestampTz,
    String,
    Binary,
}

/// The type names accepted in configuration, for error messages.
pub const TYPE_NAMES: &str = "boolean, int, long, float, double, decimal(P,S), date, time, \
                              timestamp, timestamptz, string, binary";

impl Type {
    /// The type's zero value (false, 0, the epoch, empty text or bytes).
    pub fn zero(self) -> Value {
        match self {
            Type::Boolean => Value::Boolean(false),
            Type::Int => Value::Int(0),
            Type::Long => Value::Long(0),
            Type::Float => Value::Float(0.0),
            Type::Double => Value::Double(0.0),
            Type::Decimal { .. } => Value::Decimal(0),
            Type::Date => Value::Date(0),
            Type::Time => Value::Time(0),
            Type::Timestamp => Value::Timestamp(0),
            Type::TimestampTz => Value::TimestampTz(0),
            Type::String => Value::String(String::new()),
            Type::Binary => Value::Binary(Vec::new()),
        }
    }

    /// Parses an Iceberg type name (`long`, `decimal(10,2)`, `timestamptz`, ...).
    pub fn parse(text: &str) -> Result<Type> {
        let t = text.trim().to_ascii_lowercase();
        let ty = match t.as_str() {
            "boolean" => Type::Boolean,
            "int" | "integer" => Type::Int,
            "long" | "bigint" => Type::Long,
            "float" => Type::Float,
            "double" => Type::Double,
            "date" => Type::Date,
            "time" => Type::Time,
            "timestamp" => Type::Timestamp,
            "timestamptz" => Type::TimestampTz,
            "string" => Type::String,
            "binary" => Type::Binary,
            _ => {
                let inner = t
                    .strip_prefix("decimal(")
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| {
                        Error::config(format!("unknown type \"{text}\"; expected {TYPE_NAMES}"))
                    })?;
                let mut parts = inner.split(',').map(|p| p.trim().parse::<u8>());
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(Ok(precision)), Some(Ok(scale)), None)
                        if (1..=38).contains(&precision) && scale <= precision =>
                    {
                        Type::Decimal { precision, scale }
                    }
                    _ => {
                        return Err(Error::config(format!(
                            "bad decimal type \"{text}\"; expected decimal(P,S) with 1 <= P <= 38 and S <= P"
                        )))
                    }
                }
            }
        };
        Ok(ty)
    }

    /// The name used in Iceberg table metadata JSON.
    pub fn iceberg_name(&self) -> String {
        match self {
            Type::Boolean => "boolean".into(),
            Type::Int => "int".into(),
            Type::Long => "long".into(),
            Type::Float => "float".into(),
            Type::Double => "double".into(),
            Type::Decimal { precision, scale } => format!("decimal({precision}, {scale})"),
            Type::Date => "date".into(),
            Type::Time => "time".into(),
            Type::Timestamp => "timestamp".into(),
            Type::TimestampTz => "timestamptz".into(),
            Type::String => "string".into(),
            Type::Binary => "binary".into(),
        }
    }

    /// Whether a column of this type takes `v` as it is: null, or a value of exactly this type.
    pub fn holds(&self, v: &Value) -> bool {
        matches!(
            (self, v),
            (_, Value::Null)
                | (Type::Boolean, Value::Boolean(_))
                | (Type::Int, Value::Int(_))
                | (Type::Long, Value::Long(_))
                | (Type::Float, Value::Float(_))
                | (Type::Double, Value::Double(_))
                | (Type::Decimal { .. }, Value::Decimal(_))
                | (Type::Date, Value::Date(_))
                | (Type::Time, Value::Time(_))
                | (Type::Timestamp, Value::Timestamp(_))
                | (Type::TimestampTz, Value::TimestampTz(_))
                | (Type::String, Value::String(_))
                | (Type::Binary, Value::Binary(_))
        )
    }

    /// The Arrow type data files are written with.
    pub fn arrow_type(&self) -> DataType {
        match self {
            Type::Boolean => DataType::Boolean,
            Type::Int => DataType::Int32,
            Type::Long => DataType::Int64,
            Type::Float => DataType::Float32,
            Type::Double => DataType::Float64,
            Type::Decimal { precision, scale } => DataType::Decimal128(*precision, *scale as i8),
            Type::Date => DataType::Date32,
            Type::Time => DataType::Time64(TimeUnit::Microsecond),
            Type::Timestamp => DataType::Timestamp(TimeUnit::Microsecond, None),
            Type::TimestampTz => DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into())),
            Type::String => DataType::Utf8,
            Type::Binary => DataType::Binary,
        }
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.iceberg_name())
    }
}

/// A value of an Iceberg primitive type, in the spec's physical representation
/// (dates in days, times and timestamps in microseconds, decimals unscaled).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Boolean(bool),
    Int(i32),
    Long(i64),
    Float(f32),
    Double(f64),
    Decimal(i128),
    Date(i32),
    Time(i64),
    Timestamp(i64),
    TimestampTz(i64),
    String(String),
    Binary(Vec<u8>),
}

impl Value {
    /// Whether this is SQL NULL.
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }

    /// Orders two non-null values of the same type; `None` for NaN or mismatched types.
    pub fn partial_cmp_same(&self, other: &Value) -> Option<Ordering> {
        use Value::*;
        match (self, other) {
            (Boolean(a), Boolean(b)) => Some(a.cmp(b)),
            (Int(a), Int(b)) | (Date(a), Date(b)) => Some(a.cmp(b)),
            (Long(a), Long(b))
            | (Time(a), Time(b))
            | (Timestamp(a), Timestamp(b))
            | (TimestampTz(a), TimestampTz(b)) => Some(a.cmp(b)),
            (Float(a), Float(b)) => a.partial_cmp(b),
            (Double(a), Double(b)) => a.partial_cmp(b),
            (Decimal(a), Decimal(b)) => Some(a.cmp(b)),
            (String(a), String(b)) => Some(a.cmp(b)),
            (Binary(a), Binary(b)) => Some(a.cmp(b)),
            _ => None,
        }
    }

    /// Rough in-memory size, for buffer accounting.
    pub fn approx_bytes(&self) -> usize {
        match self {
            Value::String(s) => s.len() + 8,
            Value::Binary(b) => b.len() + 8,
            Value::Decimal(_) => 16,
            _ => 8,
        }
    }

    /// The spec's single-value binary serialization (Appendix D), used for column bounds.
    pub fn to_bound_bytes(&self) -> Option<Vec<u8>> {
        Some(match self {
            Value::Null => return None,
            Value::Boolean(b) => vec![u8::from(*b)],
            Value::Int(v) | Value::Date(v) => v.to_le_bytes().to_vec(),
            Value::Long(v) | Value::Time(v) | Value::Timestamp(v) | Value::TimestampTz(v) => {
                v.to_le_bytes().to_vec()
            }
            Value::Float(v) => v.to_le_bytes().to_vec(),
            Value::Double(v) => v.to_le_bytes().to_vec(),
            Value::Decimal(v) => decimal_min_bytes(*v),
            Value::String(s) => s.as_bytes().to_vec(),
            Value::Binary(b) => b.clone(),
        })
    }

    /// Reads a value of `ty` back from its single-value binary form.
    pub fn from_bound_bytes(ty: Type, bytes: &[u8]) -> Option<Value> {
        let arr4 = || <[u8; 4]>::try_from(bytes).ok();
        let arr8 = || <[u8; 8]>::try_from(bytes).ok();
        Some(match ty {
            Type::Boolean => Value::Boolean(*bytes.first()? != 0),
            Type::Int => Value::Int(i32::from_le_bytes(arr4()?)),
            Type::Date => Value::Date(i32::from_le_bytes(arr4()?)),
            Type::Long => Value::Long(i64::from_le_bytes(arr8()?)),
            Type::Time => Value::Time(i64::from_le_bytes(arr8()?)),
            Type::Timestamp => Value::Timestamp(i64::from_le_bytes(arr8()?)),
            Type::TimestampTz => Value::TimestampTz(i64::from_le_bytes(arr8()?)),
            Type::Float => Value::Float(f32::from_le_bytes(arr4()?)),
            Type::Double => Value::Double(f64::from_le_bytes(arr8()?)),
            Type::Decimal { .. } => {
                if bytes.is_empty() || bytes.len() > 16 {
                    return None;
                }
                let fill = if bytes[0] & 0x80 != 0 { 0xff } else { 0 };
                let mut buf = [fill; 16];
                buf[16 - bytes.len()..].copy_from_slice(bytes);
                Value::Decimal(i128::from_be_bytes(buf))
            }
            Type::String => Value::String(String::from_utf8(bytes.to_vec()).ok()?),
            Type::Binary => Value::Binary(bytes.to_vec()),
        })
    }
}

/// Running minimum and maximum of the non-null, non-NaN values seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Range {
    pub min: Option<Value>,
    pub max: Option<Value>,
}

impl Range {
    /// Widens the range to include `v`; NULL and NaN are ignored.
    pub fn add(&mut self, v: &Value) {
        let nan = matches!(v, Value::Float(x) if x.is_nan())
            || matches!(v, Value::Double(x) if x.is_nan());
        if v.is_null() || nan {
            return;
        }
        if self
            .min
            .as_ref()
            .is_none_or(|m| v.partial_cmp_same(m) == Some(Ordering::Less))
        {
            self.min = Some(v.clone());
        }
        if self
            .max
            .as_ref()
            .is_none_or(|m| v.partial_cmp_same(m) == Some(Ordering::Greater))
        {
            self.max = Some(v.clone());
        }
    }
}

/// Encodes values as a self-describing byte string (a tag byte per value, fixed-width
/// big-endian numbers with the sign bit flipped, length-prefixed strings): primary keys,
/// partition tuples and stored rows in the key index. Equal tuples encode equally.
pub fn encode_values<'a, I>(values: I) -> Vec<u8>
where
    I: IntoIterator<Item = &'a Value>,
    I::IntoIter: Clone,
{
    let values = values.into_iter();
    // Sized exactly: a pending row is kept as this buffer, and growing it took three
    // reallocations a row.
    let mut out = Vec::with_capacity(encoded_values_len(values.clone()));
    encode_values_into(values, &mut out);
    out
}

/// The length of [`encode_values`]'s encoding of `values`.
pub fn encoded_values_len<'a>(values: impl IntoIterator<Item = &'a Value>) -> usize {
    values
        .into_iter()
        .map(|v| match v {
            Value::Null => 1,
            Value::Boolean(_) => 2,
            Value::Int(_) | Value::Float(_) | Value::Date(_) => 5,
            Value::Long(_)
            | Value::Double(_)
            | Value::Time(_)
            | Value::Timestamp(_)
            | Value::TimestampTz(_) => 9,
            Value::Decimal(_) => 17,
            Value::String(t) => 5 + t.len(),
            Value::Binary(b) => 5 + b.len(),
        })
        .sum()
}

/// Appends `values`, encoded as [`encode_values`] does, to `out`.
pub fn encode_values_into<'a>(values: impl IntoIterator<Item = &'a Value>, out: &mut Vec<u8>) {
    for v in values {
        match v {
            Value::Null => out.push(0),
            Value::Boolean(b) => out.extend_from_slice(&[1, u8::from(*b)]),
            Value::Int(x) => {
                out.push(2);
                out.extend_from_slice(&((*x as u32) ^ (1 << 31)).to_be_bytes());
            }
            Value::Long(x) => {
                out.push(3);
                out.extend_from_slice(&((*x as u64) ^ (1 << 63)).to_be_bytes());
            }
            Value::Float(x) => {
                out.push(4);
                out.extend_from_slice(&x.to_bits().to_be_bytes());
            }
            Value::Double(x) => {
                out.push(5);
                out.extend_from_slice(&x.to_bits().to_be_bytes());
            }
            Value::Decimal(x) => {
                out.push(6);
                out.extend_from_slice(&((*x as u128) ^ (1 << 127)).to_be_bytes());
            }
            Value::Date(x) => {
                out.push(7);
                out.extend_from_slice(&((*x as u32) ^ (1 << 31)).to_be_bytes());
            }
            Value::Time(x) | Value::Timestamp(x) | Value::TimestampTz(x) => {
                out.push(match v {
                    Value::Time(_) => 8,
                    Value::Timestamp(_) => 9,
                    _ => 10,
                });
                out.extend_from_slice(&((*x as u64) ^ (1 << 63)).to_be_bytes());
            }
            Value::String(t) => {
                out.push(11);
                out.extend_from_slice(&(t.len() as u32).to_be_bytes());
                out.extend_from_slice(t.as_bytes());
            }
            Value::Binary(b) => {
                out.push(12);
                out.extend_from_slice(&(b.len() as u32).to_be_bytes());
                out.extend_from_slice(b);
            }
        }
    }
}

/// Reads fixed-width big-endian integers and length-prefixed byte strings off a slice; every
/// read is bounds-checked and yields `None` past the end.
pub struct ByteReader<'a>(pub &'a [u8]);

impl<'a> ByteReader<'a> {
    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = tail;
        Some(head)
    }

    /// A big-endian `u32`.
    pub fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    /// A big-endian `u64`.
    pub fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }

    /// A `u32`-length-prefixed byte string.
    pub fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    /// Whether everything was read.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Decodes what [`encode_values`] wrote; `None` if the bytes are not such an encoding.
pub fn decode_values(bytes: &[u8]) -> Option<Vec<Value>> {
    let mut out = Vec::with_capacity(count_values(bytes)?);
    decode_values_into(bytes, &mut out)?;
    Some(out)
}

/// [`decode_values`] into `out`, in place of what it held: a text or binary value decoded
/// where `out` held one of the same kind reuses that one's buffer, so rows decoded one after
/// another into the same vector allocate only when a value outgrows the last.
pub fn decode_values_into(bytes: &[u8], out: &mut Vec<Value>) -> Option<()> {
    let mut b = ByteReader(bytes);
    let mut n = 0;
    while let Some(tag) = b.take(1) {
        let slot = out.get_mut(n);
        let value = match (tag[0], slot) {
            (11, Some(Value::String(old))) => {
                old.clear();
                old.push_str(std::str::from_utf8(b.bytes()?).ok()?);
                None
            }
            (12, Some(Value::Binary(old))) => {
                old.clear();
                old.extend_from_slice(b.bytes()?);
                None
            }
            (11, _) => Some(Value::String(
                std::str::from_utf8(b.bytes()?).ok()?.to_owned(),
            )),
            (12, _) => Some(Value::Binary(b.bytes()?.to_vec())),
            (0, _) => Some(Value::Null),
            (1, _) => Some(Value::Boolean(b.take(1)?[0] != 0)),
            (2, _) => Some(Value::Int((b.u32()? ^ (1 << 31)) as i32)),
            (3, _) => Some(Value::Long((b.u64()? ^ (1 << 63)) as i64)),
            (4, _) => Some(Value::Float(f32::from_bits(b.u32()?))),
            (5, _) => Some(Value::Double(f64::from_bits(b.u64()?))),
            (6, _) => Some(Value::Decimal(
                (u128::from_be_bytes(b.take(16)?.try_into().ok()?) ^ (1 << 127)) as i128,
            )),
            (7, _) => Some(Value::Date((b.u32()? ^ (1 << 31)) as i32)),
            (8, _) => Some(Value::Time((b.u64()? ^ (1 << 63)) as i64)),
            (9, _) => Some(Value::Timestamp((b.u64()? ^ (1 << 63)) as i64)),
            (10, _) => Some(Value::TimestampTz((b.u64()? ^ (1 << 63)) as i64)),
            _ => return None,
        };
        match value {
            Some(v) if n < out.len() => out[n] = v,
            Some(v) => out.push(v),
            None => {}
        }
        n += 1;
    }
    out.truncate(n);
    Some(())
}

/// How many values [`encode_values`] wrote into `bytes`, read off the tags and lengths alone.
fn count_values(bytes: &[u8]) -> Option<usize> {
    let mut b = ByteReader(bytes);
    let mut n = 0;
    while let Some(tag) = b.take(1) {
        match tag[0] {
            0 => {}
            1 => _ = b.take(1)?,
            2 | 4 | 7 => _ = b.take(4)?,
            3 | 5 | 8..=10 => _ = b.take(8)?,
            6 => _ = b.take(16)?,
            11 | 12 => _ = b.bytes()?,
            _ => return None,
        }
        n += 1;
    }
    Some(n)
}

/// Big-endian two's complement in the fewest bytes that keep the sign, as the spec stores
/// decimals.
pub fn decimal_min_bytes(v: i128) -> Vec<u8> {
    let bytes = v.to_be_bytes();
    let mut start = 0;
    while start < 15 {
        let (b, next) = (bytes[start], bytes[start + 1]);
        let redundant = (b == 0 && next & 0x80 == 0) || (b == 0xff && next & 0x80 != 0);
        if !redundant {
            break;
        }
        start += 1;
    }
    bytes[start..].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_types_and_rejects_unknown_ones() {
        assert_eq!(
            Type::parse("decimal(10, 2)").unwrap(),
            Type::Decimal {
                precision: 10,
                scale: 2
            }
        );
        assert_eq!(Type::parse("TimestampTZ").unwrap(), Type::TimestampTz);
        let err = Type::parse("varchar").unwrap_err().to_string();
        assert!(err.contains("unknown type \"varchar\""), "{err}");
        assert!(Type::parse("decimal(40,2)").is_err());
        assert!(Type::parse("decimal(4,5)").is_err());
    }

    #[test]
    fn value_tuples_round_trip() {
        let values = vec![
            Value::Null,
            Value::Boolean(true),
            Value::Int(-5),
            Value::Long(i64::MIN),
            Value::Float(1.5),
            Value::Double(-0.25),
            Value::Decimal(-12345),
            Value::Date(-1),
            Value::Time(5),
            Value::Timestamp(-7),
            Value::TimestampTz(7),
            Value::String("a/b".into()),
            Value::Binary(vec![0, 255]),
        ];
        let bytes = encode_values(&values);
        assert_eq!(bytes.capacity(), bytes.len(), "sized exactly up front");
        assert_eq!(encoded_values_len(&values), bytes.len());
        assert_eq!(decode_values(&bytes).unwrap(), values);
        assert_eq!(count_values(&bytes), Some(values.len()));
        for cut in 0..bytes.len() {
            if count_values(&bytes[..cut]).is_none() {
                assert!(decode_values(&bytes[..cut]).is_none());
            }
        }
        assert!(decode_values(&bytes[..bytes.len() - 1]).is_none());
        // Integer keys sort numerically.
        assert!(encode_values(&[Value::Long(-1)]) < encode_values(&[Value::Long(1)]));
    }

    #[test]
    fn rows_decoded_into_one_vector_replace_what_it_held() {
        let rows = [
            vec![
                Value::Long(1),
                Value::String("a long first text".into()),
                Value::Null,
            ],
            vec![
                Value::Long(2),
                Value::String("b".into()),
                Value::Binary(vec![1, 2]),
            ],
            // Kinds change places, and rows get shorter and longer.
            vec![Value::String("c".into()), Value::Long(3)],
            vec![],
            vec![
                Value::Binary(vec![]),
                Value::String(String::new()),
                Value::Binary(vec![9; 40]),
                Value::Decimal(-1),
            ],
            vec![
                Value::Long(4),
                Value::String("a long first text, longer".into()),
            ],
        ];
        let mut out = vec![Value::Null; 7];
        for row in &rows {
            decode_values_into(&encode_values(row), &mut out).unwrap();
            assert_eq!(&out, row);
        }
        // The text buffer of the first row serves the second.
        decode_values_into(&encode_values(&rows[0]), &mut out).unwrap();
        let Value::String(first) = &out[1] else {
            panic!()
        };
        let buffer = first.as_ptr();
        decode_values_into(&encode_values(&rows[1]), &mut out).unwrap();
        let Value::String(second) = &out[1] else {
            panic!()
        };
        assert_eq!(second.as_ptr(), buffer);
        let bytes = encode_values(&rows[4]);
        assert!(decode_values_into(&bytes[..bytes.len() - 1], &mut out).is_none());
    }

    #[test]
    fn bound_bytes_follow_the_spec() {
        assert_eq!(Value::Int(1).to_bound_bytes().unwrap(), vec![1, 0, 0, 0]);
        assert_eq!(Value::Long(-1).to_bound_bytes().unwrap(), vec![0xff; 8]);
        assert_eq!(decimal_min_bytes(0), vec![0]);
        assert_eq!(decimal_min_bytes(127), vec![0x7f]);
        assert_eq!(decimal_min_bytes(128), vec![0x00, 0x80]);
        assert_eq!(decimal_min_bytes(-1), vec![0xff]);
        assert_eq!(decimal_min_bytes(-129), vec![0xff, 0x7f]);
        for v in [
            0i128,
            1,
            -1,
            127,
            128,
            -128,
            -129,
            1_234_567_890_123,
            i128::MIN,
            i128::MAX,
        ] {
            let ty = Type::Decimal {
                precision: 38,
                scale: 0,
            };
            let back = Value::from_bound_bytes(ty, &decimal_min_bytes(v)).unwrap();
            assert_eq!(back, Value::Decimal(v));
        }
    }
}
