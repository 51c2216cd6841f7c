//! The cap on partitions one checkpoint may add to a table
//! (`table.max_new_partitions_per_checkpoint`): a bad timestamp or partition value must not
//! create thousands of partitions, each with its directories, files and manifest entries, in
//! one commit. A change that would pass the cap follows the errors policy.

use std::collections::HashSet;

use inlet_iceberg::transform::Transform;
use inlet_iceberg::types::{encode_values_into, Value};

/// Whether a change's partition may be written.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    /// The table holds the partition, or this checkpoint adds it within the cap.
    Yes,
    /// A new partition past the cap; it names the partition.
    Over(String),
}

/// One partition field as the cap reads it from a change's values.
#[derive(Debug, Clone)]
pub struct CapField {
    /// Index of the source column among the change's values.
    pub source: usize,
    pub transform: Transform,
    pub name: String,
}

/// The partitions a table holds and those the open checkpoint adds.
#[derive(Debug)]
pub struct PartitionCap {
    /// Most partitions one checkpoint adds; 0: no cap.
    limit: usize,
    fields: Vec<CapField>,
    /// Partitions the table holds, as far as known: read from it once a checkpoint reaches the
    /// cap (most never do), plus those earlier checkpoints of this process added.
    known: HashSet<String>,
    loaded: bool,
    /// Partitions the open checkpoint adds.
    added: HashSet<String>,
    /// The partitions in `known` or `added` that changes were admitted to, as their transformed
    /// values encoded ([`encode_values_into`]): a change of one of them, as most are, is
    /// admitted without naming its partition.
    admitted: HashSet<Vec<u8>>,
    /// A change's transformed values, encoded.
    scratch: Vec<u8>,
}

impl PartitionCap {
    pub fn new(limit: u32, fields: Vec<CapField>) -> PartitionCap {
        PartitionCap {
            limit: limit as usize,
            fields,
            known: HashSet::new(),
            loaded: false,
            added: HashSet::new(),
            admitted: HashSet::new(),
            scratch: Vec::new(),
        }
    }

    /// Whether the cap applies at all (a limit, a partitioned table).
    pub fn active(&self) -> bool {
        self.limit > 0 && !self.fields.is_empty()
    }

    /// Follows a schema change: the fields' source columns may have moved.
    pub fn set_fields(&mut self, fields: Vec<CapField>) {
        self.fields = fields;
        self.admitted.clear();
    }

    /// The partition of a change's values, as `name=value/...` in the fields' order.
    fn partition_of(&self, values: &[Value]) -> String {
        let transformed: Vec<Value> = self
            .fields
            .iter()
            .map(|f| {
                f.transform
                    .apply(values.get(f.source).unwrap_or(&Value::Null))
            })
            .collect();
        self.key(&transformed)
    }

    /// The key of partition values already transformed (a data file's partition tuple).
    pub fn key(&self, partition: &[Value]) -> String {
        let mut key = String::new();
        for (f, v) in self.fields.iter().zip(partition) {
            if !key.is_empty() {
                key.push('/');
            }
            key.push_str(&f.name);
            key.push('=');
            key.push_str(&f.transform.to_human_string(v));
        }
        key
    }

    /// Admits the partition of a change with `values` to the open checkpoint.
    pub fn admit(&mut self, values: &[Value]) -> Admit {
        if !self.active() {
            return Admit::Yes;
        }
        let mut encoded = std::mem::take(&mut self.scratch);
        encoded.clear();
        for f in &self.fields {
            let v = f
                .transform
                .apply(values.get(f.source).unwrap_or(&Value::Null));
            encode_values_into([&v], &mut encoded);
        }
        let admit = if self.admitted.contains(&encoded) {
            Admit::Yes
        } else {
            let admit = self.admit_new(values);
            if admit == Admit::Yes {
                self.admitted.insert(encoded.clone());
            }
            admit
        };
        self.scratch = encoded;
        admit
    }

    /// Admits the partition of `values` by its name.
    fn admit_new(&mut self, values: &[Value]) -> Admit {
        let key = self.partition_of(values);
        if self.known.contains(&key) || self.added.contains(&key) {
            return Admit::Yes;
        }
        if self.added.len() < self.limit {
            self.added.insert(key);
            return Admit::Yes;
        }
        Admit::Over(key)
    }

    /// Whether the table's own partitions have been read.
    pub fn loaded(&self) -> bool {
        self.loaded
    }

    /// Records the partitions the table holds (keys from [`PartitionCap::key`]); the open
    /// checkpoint no longer counts those as added.
    pub fn learn(&mut self, partitions: impl IntoIterator<Item = String>) {
        self.known.extend(partitions);
        self.loaded = true;
        let known = &self.known;
        self.added.retain(|k| !known.contains(k));
    }

    /// The open checkpoint committed: its partitions are the table's. Returns how many it
    /// added.
    pub fn committed(&mut self) -> usize {
        let n = self.added.len();
        self.known.extend(self.added.drain());
        n
    }

    /// The open checkpoint was abandoned.
    pub fn aborted(&mut self) {
        self.added.clear();
        self.admitted.clear();
    }

    /// The limit, for messages.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(limit: u32) -> PartitionCap {
        PartitionCap::new(
            limit,
            vec![CapField {
                source: 1,
                transform: Transform::Identity,
                name: "region".into(),
            }],
        )
    }

    fn row(region: &str) -> Vec<Value> {
        vec![Value::Long(1), Value::String(region.into())]
    }

    #[test]
    fn a_checkpoint_adds_at_most_the_limit_and_known_partitions_are_free() {
        let mut c = cap(2);
        assert_eq!(c.admit(&row("a")), Admit::Yes);
        assert_eq!(c.admit(&row("b")), Admit::Yes);
        assert_eq!(c.admit(&row("a")), Admit::Yes);
        assert_eq!(c.admit(&row("c")), Admit::Over("region=c".into()));
        // The table turns out to hold `a`: one more may be added.
        c.learn(["region=a".to_string()]);
        assert_eq!(c.admit(&row("c")), Admit::Yes);
        assert_eq!(c.admit(&row("d")), Admit::Over("region=d".into()));
        assert_eq!(c.committed(), 2);
        // The next checkpoint starts afresh; committed partitions are known.
        for r in ["b", "c", "d", "e"] {
            assert_eq!(c.admit(&row(r)), Admit::Yes, "{r}");
        }
        assert_eq!(c.admit(&row("f")), Admit::Over("region=f".into()));
        c.aborted();
        assert_eq!(c.admit(&row("f")), Admit::Yes);
        // An abandoned checkpoint's partitions are new again to the next one.
        let mut c = cap(1);
        assert_eq!(c.admit(&row("x")), Admit::Yes);
        c.aborted();
        assert_eq!(c.admit(&row("y")), Admit::Yes);
        assert_eq!(c.admit(&row("x")), Admit::Over("region=x".into()));
        // Fields that change read the changes afresh.
        c.set_fields(vec![CapField {
            source: 0,
            transform: Transform::Identity,
            name: "id".into(),
        }]);
        assert_eq!(c.admit(&row("y")), Admit::Over("id=1".into()));
    }

    #[test]
    fn no_limit_or_no_partition_admits_everything() {
        let mut c = cap(0);
        for i in 0..100 {
            assert_eq!(c.admit(&row(&i.to_string())), Admit::Yes);
        }
        let mut c = PartitionCap::new(1, vec![]);
        assert!(!c.active());
        assert_eq!(c.admit(&row("x")), Admit::Yes);
    }
}
