//! The catalog and storage a pipeline writes to, and the definitions of the tables it creates.

use crate::config::{Config, TableMode, CHANGELOG_COLUMNS};
use crate::health::health;
use crate::metrics::Component;
use inlet_common::error::{Error, ErrorKind, Result};
use inlet_decode::{infer_type, reason, RawChange};
use inlet_iceberg::catalog::Catalog;
use inlet_iceberg::io::{normalize_location, FileIO};
use inlet_iceberg::keys::{PRIMARY_KEY_PROPERTY, UPSERT_VERSION_COLUMN};
use inlet_iceberg::transform::Transform;
use inlet_iceberg::types::Type;
use inlet_iceberg::{Table, TableDefinition};

/// An Iceberg table's namespace and name.
pub type TableName = (String, String);

/// A column of a new table: name, type, whether required, documentation.
pub(super) type ColumnDef = (String, Type, bool, Option<String>);

/// The table definition a config's `table.columns` ask for.
pub fn table_definition(cfg: &Config) -> Result<TableDefinition> {
    let t = &cfg.table;
    let columns = t
        .columns
        .iter()
        .map(|c| {
            // Changelog rows of deletes carry only what the before image has, which for
            // PostgreSQL's default replica identity is the key; other columns must be nullable.
            let required =
                c.required && (t.mode != TableMode::Changelog || t.primary_key.contains(&c.name));
            Ok((c.name.clone(), Type::parse(&c.ty)?, required, c.doc.clone()))
        })
        .collect::<Result<Vec<_>>>()?;
    definition(cfg, columns, &t.primary_key)
}

/// The type `table.column_types` gives column `name` of the change's table, if any: a pattern
/// `column` names it in every table, `table.column` in the tables the table part matches.
pub fn configured_type(cfg: &Config, raw: &RawChange, name: &str) -> Option<Type> {
    cfg.table.column_types.iter().find_map(|(pattern, ty)| {
        let (table, column) = match pattern.rsplit_once('.') {
            Some((table, column)) => (Some(table), column),
            None => (None, pattern.as_str()),
        };
        let table_matches = match (table, &raw.source) {
            (None, _) => true,
            (Some(t), Some(source)) => source.matches(t),
            (Some(_), None) => false,
        };
        (table_matches && inlet_decode::glob(column, name))
            .then(|| Type::parse(ty).ok())
            .flatten()
    })
}

/// A table definition from a change's own fields: every field of its image, typed as the
/// message's schema declares or its value suggests (string while only nulls were seen);
/// nullable except the primary key, which is `table.primary_key` or the key the change names.
pub fn definition_from_change(cfg: &Config, raw: &RawChange) -> Result<TableDefinition> {
    let key = if cfg.table.primary_key.is_empty() {
        raw.key.clone()
    } else {
        cfg.table.primary_key.clone()
    };
    if cfg.table.mode == TableMode::Upsert && key.is_empty() {
        return Err(Error::config(
            "table.primary_key: the change names no primary key to create its upsert table with; list the key columns",
        ));
    }
    let image = raw
        .image()
        .ok_or_else(|| Error::decode("change has neither before nor after image"))?;
    for k in &key {
        if !image.contains_key(k) {
            return Err(Error::decode(format!(
                "primary key column \"{k}\" is missing from the change"
            ))
            .because(reason::INCOMPATIBLE_SCHEMA));
        }
    }
    let reserved: Vec<&str> = match cfg.table.mode {
        TableMode::Changelog => CHANGELOG_COLUMNS.iter().map(|c| c.0).collect(),
        TableMode::Upsert => vec![UPSERT_VERSION_COLUMN],
    };
    let columns = raw
        .fields_in_order()
        .into_iter()
        .map(|(name, value)| {
            if reserved.contains(&name.as_str()) {
                return Err(Error::new(
                    ErrorKind::Schema,
                    format!(
                        "upstream column \"{name}\" collides with inlet's own column of that name"
                    ),
                ));
            }
            let ty = configured_type(cfg, raw, name)
                .or_else(|| raw.fields.get(name).and_then(|f| f.declared))
                .or_else(|| infer_type(value))
                .unwrap_or(Type::String);
            Ok((name.clone(), ty, key.contains(name), None))
        })
        .collect::<Result<Vec<_>>>()?;
    definition(cfg, columns, &key)
}

/// The definition of a table of `columns` under the config's mode, partitioning and buckets.
/// Partition fields whose column the table lacks are left out.
fn definition(
    cfg: &Config,
    mut columns: Vec<ColumnDef>,
    key: &[String],
) -> Result<TableDefinition> {
    let t = &cfg.table;
    let mut partition = Vec::new();
    for p in &t.partition_by {
        if !columns.iter().any(|c| c.0 == p.column) {
            tracing::warn!(column = %p.column, "Partition column missing from the table; not partitioning by it");
            continue;
        }
        let transform = Transform::parse(&p.transform)?;
        partition.push((
            p.column.clone(),
            transform,
            crate::config::partition_field_name(p, transform),
        ));
    }
    if let (TableMode::Upsert, Some(n), [k]) = (t.mode, t.buckets, key) {
        partition.push((k.clone(), Transform::Bucket(n), format!("{k}_bucket")));
    }
    match t.mode {
        TableMode::Changelog => {
            for (name, ty, required) in CHANGELOG_COLUMNS {
                columns.push((name.to_string(), ty, required, None));
            }
        }
        TableMode::Upsert => columns.push((
            UPSERT_VERSION_COLUMN.to_string(),
            Type::Binary,
            false,
            Some("Order of the row's change (binlog position, LSN or configured columns), encoded to compare bytewise".into()),
        )),
    }
    // Identifier fields mean "uniquely identifies a row", which holds in upsert tables only; a
    // changelog table has many rows per key and records the upstream key as a property.
    let mut properties = t.properties.clone();
    for (k, v) in crate::maintain::table_properties(&cfg.services) {
        properties.entry(k).or_insert(v);
    }
    let identifier = match t.mode {
        TableMode::Upsert => key.to_vec(),
        TableMode::Changelog => {
            if !key.is_empty() {
                properties.insert(PRIMARY_KEY_PROPERTY.into(), key.join(","));
            }
            Vec::new()
        }
    };
    Ok(TableDefinition {
        columns,
        identifier,
        partition,
        properties,
    })
}

/// Opens the catalog, then loads or creates the configured table.
pub async fn open_table(cfg: &Config) -> Result<Table> {
    let lake = Lake::connect(cfg).await?;
    lake.load_or_create(
        &cfg.table.namespace,
        &cfg.table.name,
        &table_definition(cfg)?,
    )
    .await
}

/// The catalog and storage a pipeline's tables live in.
pub(super) struct Lake {
    pub(super) catalog: Catalog,
    pub(super) io: FileIO,
    pub(super) warehouse: String,
    /// The file the storage probe writes.
    pub(super) probe_file: String,
}

impl Lake {
    pub(super) async fn connect(cfg: &Config) -> Result<Lake> {
        let catalog = match Catalog::connect(&cfg.catalog.settings()?).await {
            Ok(c) => c,
            Err(e) => {
                health().failed_with(&e);
                return Err(e);
            }
        };
        health().succeeded(Component::Catalog);
        if cfg.routing.is_some() && !catalog.multi_table() {
            return Err(Error::config(
                "routing: the REST catalog offers no multi-table transactions, so the tables of one checkpoint cannot commit atomically; run one pipeline per table instead",
            ));
        }
        let io = FileIO::new(cfg.storage.settings()?);
        let warehouse = normalize_location(&cfg.catalog.warehouse)?;
        // A REST catalog places the tables itself: no warehouse to probe here.
        let probe_file = if catalog.places_tables() {
            String::new()
        } else {
            io.check(&warehouse).await?;
            let file = crate::monitor::probe_file(&warehouse, &cfg.pipeline_id);
            crate::monitor::check_warehouse(
                &io,
                &file,
                &cfg.catalog.warehouse,
                "catalog.warehouse",
            )
            .await?;
            file
        };
        Ok(Lake {
            catalog,
            io,
            warehouse,
            probe_file,
        })
    }

    pub(super) async fn load(&self, namespace: &str, name: &str) -> Result<Option<Table>> {
        Table::load(&self.catalog, &self.io, namespace, name).await
    }

    pub(super) async fn load_or_create(
        &self,
        namespace: &str,
        name: &str,
        def: &TableDefinition,
    ) -> Result<Table> {
        Table::load_or_create(
            &self.catalog,
            &self.io,
            namespace,
            name,
            &self.warehouse,
            def,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `column` names a column in every table, `table.column` in the tables it matches.
    #[test]
    fn configured_types_follow_table_and_column_patterns() {
        let yaml = r#"
pipeline_id: p
kafka: {bootstrap_servers: "b:9092", group_id: g, topics: [t]}
table:
  mode: upsert
  column_types: {"shop.durations.t": long, "*.d*": string, "n": "decimal(20,0)"}
routing: {}
catalog: {uri: "sqlite://c.db"}
"#;
        let cfg = Config::from_yaml_with_env(yaml).unwrap();
        let raw = |db: &str, table: &str| RawChange {
            op: inlet_decode::Op::Create,
            source: Some(inlet_decode::SourceTable {
                database: Some(db.into()),
                schema: None,
                table: table.into(),
            }),
            before: None,
            after: None,
            fields: Default::default(),
            version: None,
            source_ts_ms: None,
            key: Vec::new(),
        };
        let durations = raw("shop", "durations");
        assert_eq!(configured_type(&cfg, &durations, "t"), Some(Type::Long));
        assert_eq!(configured_type(&cfg, &raw("other", "durations"), "t"), None);
        assert_eq!(
            configured_type(&cfg, &durations, "done"),
            Some(Type::String)
        );
        assert_eq!(
            configured_type(&cfg, &raw("x", "y"), "n"),
            Some(Type::Decimal {
                precision: 20,
                scale: 0
            })
        );
        assert_eq!(configured_type(&cfg, &raw("x", "y"), "m"), None);
    }
}
