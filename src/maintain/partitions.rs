//! What the partition services need to know of a partition: the time range its values name
//! (from the spec's time field: a `year`, `month`, `day` or `hour` transform, or an identity
//! field on a date or timestamp column), its directory, and the live files it holds.

use std::collections::BTreeMap;

use chrono::{Datelike, NaiveDate};

use inlet_common::error::{Error, Result};
use inlet_iceberg::manifest::{FileContent, ManifestEntry, ManifestFile, PartitionType};
use inlet_iceberg::metadata::TableMetadata;
use inlet_iceberg::transform::{escape_path_value, Transform};
use inlet_iceberg::types::{encode_values, Type, Value};

const MS_PER_HOUR: i64 = 3_600_000;
const MS_PER_DAY: i64 = 24 * MS_PER_HOUR;

/// The partition field that gives partitions their time.
#[derive(Debug, Clone)]
pub struct TimeField {
    /// Position among the partition spec's fields (and a data file's partition values).
    pub position: usize,
    pub name: String,
    pub transform: Transform,
}

impl TimeField {
    /// The time field of the table's current spec: the one named `configured` (by partition
    /// field or source column), else the first `year`/`month`/`day`/`hour` field, else the
    /// first identity field on a date or timestamp column. `None` if it has none.
    pub fn of(meta: &TableMetadata, configured: Option<&str>) -> Result<Option<TimeField>> {
        let spec = meta.default_spec()?;
        let schema = meta.current_schema()?;
        let source_type = |id: i32| {
            schema
                .fields
                .iter()
                .find(|f| f.id == id)
                .and_then(|f| f.primitive().ok().map(|t| (f.name.as_str(), t)))
        };
        let mut fields = Vec::new();
        for (position, f) in spec.fields.iter().enumerate() {
            let transform = f.transform()?;
            let source = source_type(f.source_id);
            let timed = match transform {
                Transform::Year | Transform::Month | Transform::Day | Transform::Hour => Some(0),
                Transform::Identity => match source.map(|(_, t)| t) {
                    Some(Type::Date | Type::Timestamp | Type::TimestampTz) => Some(1),
                    _ => None,
                },
                _ => None,
            };
            fields.push((position, f, transform, source.map(|(n, _)| n), timed));
        }
        if let Some(want) = configured {
            let found = fields
                .iter()
                .find(|(_, f, _, source, _)| f.name == want || *source == Some(want));
            return match found {
                Some((position, f, transform, _, Some(_))) => Ok(Some(TimeField {
                    position: *position,
                    name: f.name.clone(),
                    transform: *transform,
                })),
                Some((_, f, transform, _, None)) => Err(Error::config(format!(
                    "services.partition_time_field: partition field {} ({transform}) names no time range; use a year, month, day or hour field, or an identity field on a date or timestamp column",
                    f.name
                ))),
                None => Err(Error::config(format!(
                    "services.partition_time_field: \"{want}\" is no partition field of the table, nor the column of one"
                ))),
            };
        }
        let best = fields
            .iter()
            .filter_map(|(position, f, transform, _, rank)| {
                rank.map(|r| (r, *position, f, *transform))
            })
            .min_by_key(|(rank, position, _, _)| (*rank, *position));
        Ok(best.map(|(_, position, f, transform)| TimeField {
            position,
            name: f.name.clone(),
            transform,
        }))
    }

    /// The ends (ms) of the time ranges of the first and the last partition a manifest holds,
    /// from its manifest-list entry's bounds; `None` if it does not say (no bounds, another
    /// partition spec).
    pub fn manifest_ends(&self, meta: &TableMetadata, m: &ManifestFile) -> Option<(i64, i64)> {
        let spec = meta.default_spec().ok()?;
        if m.partition_spec_id != spec.spec_id {
            return None;
        }
        let ptype = PartitionType::new(spec, meta.current_schema().ok()?).ok()?;
        let ty = ptype.fields.get(self.position)?.2;
        let summary = m.partitions.as_ref()?.get(self.position)?;
        let end = |bound: &Option<Vec<u8>>| {
            let value = Value::from_bound_bytes(ty, bound.as_deref()?)?;
            let mut values = vec![Value::Null; self.position + 1];
            values[self.position] = value;
            self.range_ms(&values).map(|(_, end)| end)
        };
        Some((end(&summary.lower_bound)?, end(&summary.upper_bound)?))
    }

    /// The time range `[start, end)` in ms since the epoch that a partition's values name;
    /// `None` for a null value or one of another partition spec.
    pub fn range_ms(&self, partition: &[Value]) -> Option<(i64, i64)> {
        let value = partition.get(self.position)?;
        let month_start = |months: i64| {
            let year = 1970 + months.div_euclid(12);
            let month = months.rem_euclid(12) as u32 + 1;
            NaiveDate::from_ymd_opt(i32::try_from(year).ok()?, month, 1)
                .map(|d| days_since_epoch(d) * MS_PER_DAY)
        };
        match (self.transform, value) {
            (Transform::Year, Value::Int(y)) => {
                let y = i64::from(*y);
                Some((month_start(y * 12)?, month_start((y + 1) * 12)?))
            }
            (Transform::Month, Value::Int(m)) => {
                let m = i64::from(*m);
                Some((month_start(m)?, month_start(m + 1)?))
            }
            (Transform::Day | Transform::Identity, Value::Date(d)) => {
                let start = i64::from(*d) * MS_PER_DAY;
                Some((start, start + MS_PER_DAY))
            }
            // Some writers type `day` results as int.
            (Transform::Day, Value::Int(d)) => {
                let start = i64::from(*d) * MS_PER_DAY;
                Some((start, start + MS_PER_DAY))
            }
            (Transform::Hour, Value::Int(h)) => {
                let start = i64::from(*h) * MS_PER_HOUR;
                Some((start, start + MS_PER_HOUR))
            }
            (Transform::Identity, Value::Timestamp(us) | Value::TimestampTz(us)) => {
                let ms = us.div_euclid(1000);
                Some((ms, ms + 1))
            }
            _ => None,
        }
    }
}

fn days_since_epoch(d: NaiveDate) -> i64 {
    i64::from(d.num_days_from_ce()) - i64::from(NaiveDate::default().num_days_from_ce())
}

/// One partition of a table as its live files show it.
#[derive(Debug, Clone)]
pub struct Partition {
    pub values: Vec<Value>,
    /// `name=value/...` below the table's `data/`, as inlet writes it.
    pub path: String,
    /// The time range its values name.
    pub range_ms: (i64, i64),
    /// Its live data and delete files.
    pub files: Vec<ManifestEntry>,
}

impl Partition {
    /// Rows in its live data files, deleted ones included.
    pub fn rows(&self) -> i64 {
        self.files
            .iter()
            .filter(|e| e.data_file.content == FileContent::Data)
            .map(|e| e.data_file.record_count)
            .sum()
    }
}

/// The relative directory of a partition: Hive-style `name=value` segments in spec order.
pub fn partition_path(meta: &TableMetadata, values: &[Value]) -> Result<String> {
    let spec = meta.default_spec()?;
    let mut path = String::new();
    for (f, v) in spec.fields.iter().zip(values) {
        if !path.is_empty() {
            path.push('/');
        }
        path.push_str(&escape_path_value(&f.name));
        path.push('=');
        path.push_str(&escape_path_value(&f.transform()?.to_human_string(v)));
    }
    Ok(path)
}

/// The table's partitions with a time range, by encoded values, from its live `entries`.
/// Files of another partition spec (fewer or more values than the current one) are left out.
pub fn partitions(
    meta: &TableMetadata,
    field: &TimeField,
    entries: &[ManifestEntry],
) -> Result<BTreeMap<Vec<u8>, Partition>> {
    let width = meta.default_spec()?.fields.len();
    let mut out: BTreeMap<Vec<u8>, Partition> = BTreeMap::new();
    for e in entries {
        let values = &e.data_file.partition;
        if values.len() != width {
            continue;
        }
        let Some(range_ms) = field.range_ms(values) else {
            continue;
        };
        let key = encode_values(values);
        if let Some(p) = out.get_mut(&key) {
            p.files.push(e.clone());
            continue;
        }
        out.insert(
            key,
            Partition {
                values: values.clone(),
                path: partition_path(meta, values)?,
                range_ms,
                files: vec![e.clone()],
            },
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(transform: Transform) -> TimeField {
        TimeField {
            position: 0,
            name: "t".into(),
            transform,
        }
    }

    #[test]
    fn time_ranges_follow_the_transform() {
        let day = 20_455; // 2026-01-02
        let start = day as i64 * MS_PER_DAY;
        assert_eq!(
            field(Transform::Day).range_ms(&[Value::Date(day)]),
            Some((start, start + MS_PER_DAY))
        );
        assert_eq!(
            field(Transform::Identity).range_ms(&[Value::Date(day)]),
            Some((start, start + MS_PER_DAY))
        );
        let hour = day * 24 + 5;
        assert_eq!(
            field(Transform::Hour).range_ms(&[Value::Int(hour)]),
            Some((start + 5 * MS_PER_HOUR, start + 6 * MS_PER_HOUR))
        );
        // 2026-02 is month 56 * 12 + 1 since 1970-01.
        let feb = 56 * 12 + 1;
        let (s, e) = field(Transform::Month)
            .range_ms(&[Value::Int(feb)])
            .unwrap();
        assert_eq!(
            chrono::DateTime::from_timestamp_millis(s)
                .unwrap()
                .to_rfc3339(),
            "2026-02-01T00:00:00+00:00"
        );
        assert_eq!(
            chrono::DateTime::from_timestamp_millis(e)
                .unwrap()
                .to_rfc3339(),
            "2026-03-01T00:00:00+00:00"
        );
        let (s, e) = field(Transform::Year).range_ms(&[Value::Int(56)]).unwrap();
        assert_eq!(
            chrono::DateTime::from_timestamp_millis(s)
                .unwrap()
                .to_rfc3339(),
            "2026-01-01T00:00:00+00:00"
        );
        assert_eq!(
            chrono::DateTime::from_timestamp_millis(e)
                .unwrap()
                .to_rfc3339(),
            "2027-01-01T00:00:00+00:00"
        );
        assert_eq!(field(Transform::Day).range_ms(&[Value::Null]), None);
        assert_eq!(field(Transform::Day).range_ms(&[]), None);
    }

    fn metadata(partition: Vec<(String, Transform, String)>) -> TableMetadata {
        let def = inlet_iceberg::TableDefinition {
            columns: vec![
                ("id".into(), Type::Long, true, None),
                ("region".into(), Type::String, false, None),
                ("created_at".into(), Type::TimestampTz, false, None),
                ("born".into(), Type::Date, false, None),
            ],
            identifier: vec!["id".into()],
            partition,
            properties: Default::default(),
        };
        def.new_metadata("file:///t").unwrap()
    }

    fn by(column: &str, transform: &str) -> (String, Transform, String) {
        let t = Transform::parse(transform).unwrap();
        let name = match t.field_suffix() {
            Some(suffix) => format!("{column}_{suffix}"),
            None => column.to_string(),
        };
        (column.into(), t, name)
    }

    #[test]
    fn a_manifests_bounds_give_the_ends_of_its_first_and_last_partition() {
        use inlet_iceberg::manifest::FieldSummary;
        let meta = metadata(vec![by("region", "identity"), by("created_at", "day")]);
        let field = TimeField::of(&meta, None).unwrap().unwrap();
        let summary = |lower: Option<Value>, upper: Option<Value>| FieldSummary {
            contains_null: false,
            contains_nan: None,
            lower_bound: lower.and_then(|v| v.to_bound_bytes()),
            upper_bound: upper.and_then(|v| v.to_bound_bytes()),
        };
        let mut m = ManifestFile {
            manifest_path: "m.avro".into(),
            manifest_length: 1,
            partition_spec_id: meta.default_spec().unwrap().spec_id,
            content: 0,
            sequence_number: 1,
            min_sequence_number: 1,
            added_snapshot_id: 1,
            added_files_count: 1,
            existing_files_count: 0,
            deleted_files_count: 0,
            added_rows_count: 1,
            existing_rows_count: 0,
            deleted_rows_count: 0,
            partitions: Some(vec![
                summary(None, None),
                summary(Some(Value::Date(20_454)), Some(Value::Date(20_456))),
            ]),
        };
        assert_eq!(
            field.manifest_ends(&meta, &m),
            Some((20_455 * MS_PER_DAY, 20_457 * MS_PER_DAY))
        );
        m.partitions = Some(vec![summary(None, None), summary(None, None)]);
        assert_eq!(field.manifest_ends(&meta, &m), None);
        m.partitions = None;
        assert_eq!(field.manifest_ends(&meta, &m), None);
    }

    #[test]
    fn the_time_field_is_configured_or_the_first_time_transform() {
        let meta = metadata(vec![by("region", "identity"), by("created_at", "day")]);
        let f = TimeField::of(&meta, None).unwrap().unwrap();
        assert_eq!((f.position, f.name.as_str()), (1, "created_at_day"));
        let f = TimeField::of(&meta, Some("created_at")).unwrap().unwrap();
        assert_eq!(f.position, 1);
        let err = TimeField::of(&meta, Some("region")).unwrap_err();
        assert!(err.message().contains("names no time range"), "{err}");
        let err = TimeField::of(&meta, Some("nope")).unwrap_err();
        assert!(err.message().contains("no partition field"), "{err}");
        // An identity date column counts, after any time transform.
        let meta = metadata(vec![by("born", "identity"), by("created_at", "month")]);
        let f = TimeField::of(&meta, None).unwrap().unwrap();
        assert_eq!(f.name, "created_at_month");
        let meta = metadata(vec![by("region", "identity"), by("born", "identity")]);
        assert_eq!(TimeField::of(&meta, None).unwrap().unwrap().name, "born");
        let meta = metadata(vec![by("region", "identity")]);
        assert!(TimeField::of(&meta, None).unwrap().is_none());
    }
}
