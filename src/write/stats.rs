//! Per-column statistics gathered while rows are appended, turned into the manifest's
//! value/null/NaN counts and truncated lower/upper bounds.

use inlet_iceberg::types::{Range, Value};

/// Bounds of strings and binaries are truncated to this many characters/bytes, as Iceberg's
/// default `truncate(16)` metrics mode does.
pub const TRUNCATE_BOUNDS: usize = 16;

/// Statistics of one column of one file.
#[derive(Debug, Clone, Default)]
pub struct ColumnStats {
    pub values: i64,
    pub nulls: i64,
    pub nans: i64,
    pub range: Range,
}

impl ColumnStats {
    /// Accounts one value.
    pub fn update(&mut self, v: &Value) {
        self.values += 1;
        match v {
            Value::Null => self.nulls += 1,
            Value::Float(x) if x.is_nan() => self.nans += 1,
            Value::Double(x) if x.is_nan() => self.nans += 1,
            _ => self.range.add(v),
        }
    }

    /// The lower bound in single-value form, truncated for strings and binaries.
    pub fn lower_bound(&self) -> Option<Vec<u8>> {
        match self.range.min.as_ref()? {
            Value::String(s) => Some(
                s.chars()
                    .take(TRUNCATE_BOUNDS)
                    .collect::<String>()
                    .into_bytes(),
            ),
            Value::Binary(b) => Some(b.iter().take(TRUNCATE_BOUNDS).copied().collect()),
            v => v.to_bound_bytes(),
        }
    }

    /// The upper bound in single-value form. A truncated string or binary bound is rounded up
    /// (last unit incremented) so it still bounds the column; `None` when no such bound exists.
    pub fn upper_bound(&self) -> Option<Vec<u8>> {
        match self.range.max.as_ref()? {
            Value::String(s) if s.chars().count() > TRUNCATE_BOUNDS => {
                let mut chars: Vec<char> = s.chars().take(TRUNCATE_BOUNDS).collect();
                while let Some(last) = chars.pop() {
                    if let Some(next) =
                        (last as u32 + 1..=char::MAX as u32).find_map(char::from_u32)
                    {
                        chars.push(next);
                        return Some(chars.into_iter().collect::<String>().into_bytes());
                    }
                }
                None
            }
            Value::Binary(b) if b.len() > TRUNCATE_BOUNDS => {
                let mut bytes = b[..TRUNCATE_BOUNDS].to_vec();
                while let Some(last) = bytes.pop() {
                    if last < u8::MAX {
                        bytes.push(last + 1);
                        return Some(bytes);
                    }
                }
                None
            }
            v => v.to_bound_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_skip_nulls_and_nans() {
        let mut s = ColumnStats::default();
        for v in [
            Value::Double(2.0),
            Value::Null,
            Value::Double(f64::NAN),
            Value::Double(-1.0),
        ] {
            s.update(&v);
        }
        assert_eq!((s.values, s.nulls, s.nans), (4, 1, 1));
        assert_eq!(s.range.min, Some(Value::Double(-1.0)));
        assert_eq!(s.range.max, Some(Value::Double(2.0)));
    }

    #[test]
    fn truncated_upper_bounds_still_bound() {
        let mut s = ColumnStats::default();
        s.update(&Value::String("a".repeat(20)));
        assert_eq!(s.lower_bound().unwrap(), "a".repeat(16).into_bytes());
        assert_eq!(
            s.upper_bound().unwrap(),
            format!("{}b", "a".repeat(15)).into_bytes()
        );
        let mut b = ColumnStats::default();
        b.update(&Value::Binary(vec![0xff; 20]));
        assert_eq!(b.upper_bound(), None);
        let mut short = ColumnStats::default();
        short.update(&Value::String("zz".into()));
        assert_eq!(short.upper_bound().unwrap(), b"zz".to_vec());
    }
}
