//! Rows as the index stores them (with their field ids, so a row outlives schema changes), and how merge engines combine an old row with a new one.

use std::collections::HashMap;

use crate::config::Aggregate;
use inlet_iceberg::types::{decode_values, encode_values, ByteReader, Type, Value};

/// Stored rows start with this byte (never the tag of a value), the count of their values
/// and each value's field id, then the values: see [`encode_row`].
pub(super) const ROW_WITH_FIELDS: u8 = 0xF1;

/// A row as the index keeps it for merge engines: its values with the field id of each, so a
/// row stored before another engine dropped, moved or widened columns reads right after.
pub fn encode_row(field_ids: &[i32], row: &[Value]) -> Vec<u8> {
    let mut out = Vec::with_capacity(3 + 4 * field_ids.len() + 16 * row.len());
    out.push(ROW_WITH_FIELDS);
    out.extend_from_slice(&(field_ids.len() as u16).to_be_bytes());
    for id in field_ids {
        out.extend_from_slice(&id.to_be_bytes());
    }
    out.extend(encode_values(row));
    out
}

/// A stored row as a row of `fields` (field id and type of each value): values found by field
/// id and widened to the column's type; columns the row lacks are null. Rows stored before
/// field ids were (plain values) are positional: data columns then only grew at their end.
pub fn decode_row(bytes: &[u8], fields: &[(i32, Type)]) -> Option<Vec<Value>> {
    let Some((&ROW_WITH_FIELDS, rest)) = bytes.split_first() else {
        let mut values = decode_values(bytes)?;
        values.resize(fields.len(), Value::Null);
        return Some(
            values
                .into_iter()
                .zip(fields)
                .map(|(v, (_, ty))| widen(v, *ty))
                .collect(),
        );
    };
    let mut b = ByteReader(rest);
    let count = u16::from_be_bytes(b.take(2)?.try_into().ok()?) as usize;
    let ids = (0..count)
        .map(|_| Some(i32::from_be_bytes(b.take(4)?.try_into().ok()?)))
        .collect::<Option<Vec<i32>>>()?;
    let values = decode_values(b.0)?;
    if values.len() != ids.len() {
        return None;
    }
    Some(remap(values, &ids, fields))
}

/// `row`, whose values have field ids `from`, as a row of `to`.
pub(super) fn remap(row: Vec<Value>, from: &[i32], to: &[(i32, Type)]) -> Vec<Value> {
    let mut by_id: HashMap<i32, Value> = from.iter().copied().zip(row).collect();
    to.iter()
        .map(|(id, ty)| widen(by_id.remove(id).unwrap_or(Value::Null), *ty))
        .collect()
}

/// A value written before its column was promoted (int to long, float to double), widened.
pub(super) fn widen(v: Value, ty: Type) -> Value {
    match (v, ty) {
        (Value::Int(x), Type::Long) => Value::Long(x.into()),
        (Value::Float(x), Type::Double) => Value::Double(x.into()),
        (v, _) => v,
    }
}

/// Combines a stored and a new value of one column.
pub(super) fn aggregate(how: Option<Aggregate>, old: Value, new: Value) -> Value {
    use Value::*;
    match (how, old, new) {
        (Some(Aggregate::Count), Null, _) => Long(1),
        (Some(Aggregate::Count), Int(n), _) => Int(n + 1),
        (Some(Aggregate::Count), Long(n), _) => Long(n + 1),
        (Some(Aggregate::FirstNonNull), old, new) => {
            if old.is_null() {
                new
            } else {
                old
            }
        }
        (_, old, Null) => old,
        (_, Null, new) => new,
        (Some(Aggregate::Sum), Int(a), Int(b)) => Int(a.wrapping_add(b)),
        (Some(Aggregate::Sum), Long(a), Long(b)) => Long(a.wrapping_add(b)),
        (Some(Aggregate::Sum), Float(a), Float(b)) => Float(a + b),
        (Some(Aggregate::Sum), Double(a), Double(b)) => Double(a + b),
        (Some(Aggregate::Sum), Decimal(a), Decimal(b)) => Decimal(a.wrapping_add(b)),
        (Some(Aggregate::Min), old, new) => {
            if new.partial_cmp_same(&old) == Some(std::cmp::Ordering::Less) {
                new
            } else {
                old
            }
        }
        (Some(Aggregate::Max), old, new) => {
            if new.partial_cmp_same(&old) == Some(std::cmp::Ordering::Greater) {
                new
            } else {
                old
            }
        }
        (_, _, new) => new,
    }
}
