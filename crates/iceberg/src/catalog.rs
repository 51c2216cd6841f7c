//! Catalogs: where each table's current metadata is recorded, and the compare-and-swap that
//! commits to it. Two kinds behind one [`Catalog`]: the Iceberg SQL catalog (the tables of
//! Iceberg's JDBC catalog, `iceberg_tables` and `iceberg_namespace_properties`, on SQLite or
//! PostgreSQL, as pyiceberg's SqlCatalog and Java's JdbcCatalog read them; a commit is a
//! compare-and-swap on `metadata_location`) and an Iceberg REST catalog server
//! ([`super::rest`]).

use std::time::Duration;

use sqlx::any::{install_default_drivers, AnyPoolOptions};
use sqlx::{AnyConnection, AnyPool, Connection, Row};

use super::rest::{RestCatalog, RestSettings};
use inlet_common::error::{Error, ErrorKind, Result, ResultExt};

/// How to reach a catalog.
#[derive(Debug, Clone)]
pub enum CatalogSettings {
    /// A SQL catalog: database URI and catalog name.
    Sql { uri: String, name: String },
    /// A REST catalog server.
    Rest(RestSettings),
}

/// A connected catalog of either kind.
#[derive(Clone)]
pub enum Catalog {
    Sql(SqlCatalog),
    Rest(RestCatalog),
}

impl Catalog {
    /// Connects (and for SQL creates the catalog tables if missing).
    pub async fn connect(settings: &CatalogSettings) -> Result<Catalog> {
        Ok(match settings {
            CatalogSettings::Sql { uri, name } => {
                Catalog::Sql(SqlCatalog::connect(uri, name).await?)
            }
            CatalogSettings::Rest(s) => Catalog::Rest(RestCatalog::connect(s.clone()).await?),
        })
    }

    /// Makes the namespace exist.
    pub async fn ensure_namespace(&self, namespace: &str) -> Result<()> {
        match self {
            Catalog::Sql(c) => c.ensure_namespace(namespace).await,
            Catalog::Rest(c) => c.ensure_namespace(namespace).await,
        }
    }

    /// Every table of the catalog, as (namespace, name).
    pub async fn list_tables(&self) -> Result<Vec<(String, String)>> {
        match self {
            Catalog::Sql(c) => c.list_tables().await,
            Catalog::Rest(c) => c.list_tables().await,
        }
    }

    /// Every table of the catalog, with its current metadata location where listing shows it
    /// (SQL; a REST catalog shows it only when a table is loaded).
    pub async fn list_locations(&self) -> Result<Vec<((String, String), Option<String>)>> {
        match self {
            Catalog::Sql(c) => c.list_locations().await,
            Catalog::Rest(c) => Ok(c
                .list_tables()
                .await?
                .into_iter()
                .map(|t| (t, None))
                .collect()),
        }
    }

    /// Whether several tables commit in one atomic transaction.
    pub fn multi_table(&self) -> bool {
        match self {
            Catalog::Sql(_) => true,
            Catalog::Rest(c) => c.multi_table(),
        }
    }

    /// Checks the catalog answers: looks `table` up, or lists the tables.
    pub async fn probe(&self, table: Option<&(String, String)>) -> Result<()> {
        match (self, table) {
            (Catalog::Sql(c), Some((ns, name))) => c.metadata_location(ns, name).await.map(|_| ()),
            (Catalog::Rest(c), Some((ns, name))) => c.load(ns, name).await.map(|_| ()),
            (c, None) => c.list_tables().await.map(|_| ()),
        }
    }

    /// Whether the catalog chooses where new tables go (REST) rather than the warehouse
    /// setting (SQL).
    pub fn places_tables(&self) -> bool {
        matches!(self, Catalog::Rest(_))
    }
}

/// How long connecting to the catalog database (or waiting for a pooled connection) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A connected SQL catalog.
#[derive(Clone)]
pub struct SqlCatalog {
    pool: AnyPool,
    name: String,
    /// The URI with its password redacted, for messages.
    shown: String,
    /// The sqlx URI, for a direct connection that names why the pool has none.
    target: String,
}

/// Turns a database error into ours. Faults only a change of `catalog.uri` or of the database
/// can fix (rejected credentials, a missing database, a read-only or unopenable SQLite file)
/// are configuration errors naming the setting, its value and the fix; the rest are transient.
fn classify(shown: &str, what: &str, e: sqlx::Error) -> Error {
    let fix = match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            match code.as_ref() {
                "28P01" | "28000" => Some("PostgreSQL rejected the credentials; fix the user and password in catalog.uri (or PGPASSWORD)"),
                "3D000" => Some("the database does not exist; create it or fix its name in catalog.uri"),
                "42501" => Some("the user may not use the catalog tables; grant it access or use another user in catalog.uri"),
                // SQLite primary result codes (of extended ones): PERM, READONLY, CANTOPEN,
                // AUTH, NOTADB.
                n => match n.parse::<i32>().map(|c| c & 0xff) {
                    Ok(3 | 8 | 14 | 23 | 26) => Some("make the SQLite file and its directory writable by this process, or point catalog.uri at a writable location"),
                    _ => None,
                },
            }
        }
        _ => None,
    };
    match fix {
        Some(fix) => Error::config(format!("catalog.uri: {what} {shown}: {e}; {fix}")),
        None => Error::new(ErrorKind::Catalog, format!("{what} {shown}")).with_source(e),
    }
}

/// Turns SQLAlchemy-style URIs (`postgresql+psycopg2://`, `sqlite:////abs`) into sqlx ones.
fn sqlx_uri(uri: &str) -> Result<String> {
    let (scheme, rest) = uri.split_once("://").ok_or_else(|| {
        Error::config(format!(
            "catalog.uri: \"{uri}\" is not a URI; use sqlite:///abs/path.db or postgresql://host/db"
        ))
    })?;
    let base = scheme.split('+').next().unwrap_or(scheme);
    match base {
        "sqlite" => {
            let path = rest.strip_prefix('/').map_or(rest.to_string(), |p| {
                // `sqlite:////abs` (SQLAlchemy) and `sqlite:///abs` both mean /abs.
                format!("/{}", p.trim_start_matches('/'))
            });
            if let Some(dir) = std::path::Path::new(&path).parent() {
                if !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir).map_err(|e| {
                        Error::config(format!(
                            "catalog.uri: cannot create the directory {} of the SQLite catalog {uri}: {e}; create it writable by this process or point catalog.uri elsewhere",
                            dir.display()
                        ))
                    })?;
                }
            }
            let sep = if path.contains('?') { '&' } else { '?' };
            Ok(format!("sqlite://{path}{sep}mode=rwc"))
        }
        "postgres" | "postgresql" => Ok(format!("postgres://{rest}")),
        other => Err(Error::config(format!(
            "catalog.uri: unsupported database \"{other}\"; use sqlite or postgresql"
        ))),
    }
}

impl SqlCatalog {
    /// Connects and creates the catalog tables if they are missing.
    pub async fn connect(uri: &str, name: &str) -> Result<SqlCatalog> {
        install_default_drivers();
        let target = sqlx_uri(uri)?;
        let sqlite = target.starts_with("sqlite:");
        let shown = inlet_common::secret::redact_url_password(uri);
        // One connection first: its error names the cause, where the pool only times out.
        match tokio::time::timeout(CONNECT_TIMEOUT, AnyConnection::connect(&target)).await {
            Err(_) => {
                return Err(Error::new(
                    ErrorKind::Catalog,
                    format!(
                        "cannot connect to catalog {shown}: no answer within {}s",
                        CONNECT_TIMEOUT.as_secs()
                    ),
                ))
            }
            Ok(Err(e)) => return Err(classify(&shown, "cannot connect to catalog", e)),
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
            }
        }
        // No idle timeout or lifetime: they start sqlx's reaper task, which was seen polled
        // in a loop while a runtime shut down, holding that shutdown up for good. A connection
        // is tested before each use instead, so one the server dropped is replaced.
        let pool = AnyPoolOptions::new()
            .max_connections(if sqlite { 1 } else { 4 })
            .min_connections(0)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(true)
            .acquire_timeout(CONNECT_TIMEOUT)
            .connect(&target)
            .await
            .map_err(|e| classify(&shown, "cannot connect to catalog", e))?;
        if sqlite {
            // SQLite opens a file it may not write read-only; find out now, not at the first
            // commit.
            let mut conn = pool
                .acquire()
                .await
                .map_err(|e| classify(&shown, "cannot open catalog", e))?;
            sqlx::query("BEGIN IMMEDIATE")
                .execute(&mut *conn)
                .await
                .map_err(|e| classify(&shown, "cannot write to catalog", e))?;
            let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
        }
        for ddl in [
            "CREATE TABLE IF NOT EXISTS iceberg_tables (
                catalog_name VARCHAR(255) NOT NULL,
                table_namespace VARCHAR(255) NOT NULL,
                table_name VARCHAR(255) NOT NULL,
                metadata_location VARCHAR(1000),
                previous_metadata_location VARCHAR(1000),
                PRIMARY KEY (catalog_name, table_namespace, table_name))",
            "CREATE TABLE IF NOT EXISTS iceberg_namespace_properties (
                catalog_name VARCHAR(255) NOT NULL,
                namespace VARCHAR(255) NOT NULL,
                property_key VARCHAR(255) NOT NULL,
                property_value VARCHAR(1000),
                PRIMARY KEY (catalog_name, namespace, property_key))",
        ] {
            // PostgreSQL's CREATE TABLE IF NOT EXISTS is not safe against a concurrent creator
            // (it fails on the catalog's unique index); once that creator is done it succeeds.
            let mut attempt = 0;
            loop {
                attempt += 1;
                match sqlx::query(ddl).execute(&pool).await {
                    Ok(_) => break,
                    Err(_) if attempt < 5 => {
                        tokio::time::sleep(std::time::Duration::from_millis(100 * attempt)).await
                    }
                    Err(e) => {
                        return Err(classify(&shown, "cannot create the catalog tables in", e))
                    }
                }
            }
        }
        Ok(SqlCatalog {
            pool,
            name: name.to_string(),
            shown,
            target,
        })
    }

    /// Turns a failed query into ours. A pool that found no connection within its timeout only
    /// says so; one direct connection then names the cause (refused, unknown host, rejected
    /// credentials), the way the first connection at start does.
    async fn failed(&self, what: &str, e: sqlx::Error) -> Error {
        if !matches!(e, sqlx::Error::PoolTimedOut) {
            return classify(&self.shown, what, e);
        }
        match tokio::time::timeout(CONNECT_TIMEOUT, AnyConnection::connect(&self.target)).await {
            Ok(Err(cause)) => classify(&self.shown, what, cause),
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
                Error::new(
                    ErrorKind::Catalog,
                    format!(
                        "{what} {}: every pooled connection stayed busy for {}s",
                        self.shown,
                        CONNECT_TIMEOUT.as_secs()
                    ),
                )
            }
            Err(_) => Error::new(
                ErrorKind::Catalog,
                format!(
                    "{what} {}: the database does not answer (no connection within {}s)",
                    self.shown,
                    CONNECT_TIMEOUT.as_secs()
                ),
            ),
        }
    }

    /// Makes the namespace exist the way pyiceberg records it (an `exists` property).
    pub async fn ensure_namespace(&self, namespace: &str) -> Result<()> {
        let exists = sqlx::query(
            "SELECT COUNT(*) FROM iceberg_namespace_properties WHERE catalog_name = $1 AND namespace = $2",
        )
        .bind(&self.name)
        .bind(namespace)
        .fetch_one(&self.pool)
        .await
        .and_then(|r| r.try_get(0));
        let exists: i64 = match exists {
            Ok(n) => n,
            Err(e) => {
                return Err(self
                    .failed(&format!("cannot look up namespace {namespace} in"), e)
                    .await)
            }
        };
        if exists == 0 {
            // A concurrent creator may win; the row it wrote is just as good.
            let _ = sqlx::query(
                "INSERT INTO iceberg_namespace_properties (catalog_name, namespace, property_key, property_value) VALUES ($1, $2, 'exists', 'true')",
            )
            .bind(&self.name)
            .bind(namespace)
            .execute(&self.pool)
            .await;
        }
        Ok(())
    }

    /// The current metadata location of a table, if the table exists.
    pub async fn metadata_location(&self, namespace: &str, table: &str) -> Result<Option<String>> {
        let row = sqlx::query(
            "SELECT metadata_location FROM iceberg_tables WHERE catalog_name = $1 AND table_namespace = $2 AND table_name = $3",
        )
        .bind(&self.name)
        .bind(namespace)
        .bind(table)
        .fetch_optional(&self.pool)
        .await;
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                return Err(self
                    .failed(&format!("cannot load table {namespace}.{table} from"), e)
                    .await)
            }
        };
        match row {
            None => Ok(None),
            Some(r) => r
                .try_get::<Option<String>, _>(0)
                .or_kind(ErrorKind::Catalog, || "bad metadata_location column".into()),
        }
    }

    /// Registers a new table. Returns false if it already exists.
    pub async fn create_table(&self, namespace: &str, table: &str, location: &str) -> Result<bool> {
        let result = sqlx::query(
            "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, metadata_location, previous_metadata_location) VALUES ($1, $2, $3, $4, NULL)",
        )
        .bind(&self.name)
        .bind(namespace)
        .bind(table)
        .bind(location)
        .execute(&self.pool)
        .await;
        match result {
            Ok(_) => Ok(true),
            Err(e) => {
                if self.metadata_location(namespace, table).await?.is_some() {
                    Ok(false)
                } else {
                    Err(Error::new(
                        ErrorKind::Catalog,
                        format!("cannot create table {namespace}.{table}"),
                    )
                    .with_source(e))
                }
            }
        }
    }

    /// Swaps one table's metadata pointer if it still is `expected` (compare-and-swap).
    pub async fn swap(
        &self,
        namespace: &str,
        table: &str,
        expected: &str,
        new: &str,
    ) -> Result<bool> {
        self.swap_all(&[(namespace, table, expected, new)]).await
    }

    /// Swaps several tables' metadata pointers in one transaction: all of them if every
    /// table still points at its expected file, none otherwise. Items are
    /// `(namespace, table, expected, new)`.
    pub async fn swap_all(&self, swaps: &[(&str, &str, &str, &str)]) -> Result<bool> {
        let failed = |e: sqlx::Error| classify(&self.shown, "cannot commit to catalog", e);
        let mut tx = match self.pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return Err(self.failed("cannot commit to catalog", e).await),
        };
        for (namespace, table, expected, new) in swaps {
            let result = sqlx::query(
                "UPDATE iceberg_tables SET metadata_location = $1, previous_metadata_location = $2 WHERE catalog_name = $3 AND table_namespace = $4 AND table_name = $5 AND metadata_location = $2",
            )
            .bind(*new)
            .bind(*expected)
            .bind(&self.name)
            .bind(*namespace)
            .bind(*table)
            .execute(&mut *tx)
            .await
            .map_err(|e| classify(&self.shown, &format!("cannot commit table {namespace}.{table} to catalog"), e))?;
            if result.rows_affected() != 1 {
                tx.rollback().await.map_err(failed)?;
                return Ok(false);
            }
        }
        tx.commit().await.map_err(failed)?;
        Ok(true)
    }

    /// Every table of this catalog, as (namespace, name).
    pub async fn list_tables(&self) -> Result<Vec<(String, String)>> {
        Ok(self
            .list_locations()
            .await?
            .into_iter()
            .map(|(t, _)| t)
            .collect())
    }

    /// Every table of this catalog, as (namespace, name), with its current metadata location.
    pub async fn list_locations(&self) -> Result<Vec<((String, String), Option<String>)>> {
        let rows = sqlx::query(
            "SELECT table_namespace, table_name, metadata_location FROM iceberg_tables WHERE catalog_name = $1 ORDER BY table_namespace, table_name",
        )
        .bind(&self.name)
        .fetch_all(&self.pool)
        .await;
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => return Err(self.failed("cannot list the tables of", e).await),
        };
        rows.iter()
            .map(|r| Ok(((r.try_get(0)?, r.try_get(1)?), r.try_get(2)?)))
            .collect::<std::result::Result<_, sqlx::Error>>()
            .or_kind(ErrorKind::Catalog, || "bad iceberg_tables row".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlalchemy_uris_map_to_sqlx() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("c.db");
        let want = format!("sqlite://{}?mode=rwc", db.display());
        assert_eq!(
            sqlx_uri(&format!("sqlite:///{}", db.display())).unwrap(),
            want
        );
        assert_eq!(
            sqlx_uri(&format!("sqlite://{}", db.display())).unwrap(),
            want
        );
        assert_eq!(
            sqlx_uri("postgresql+psycopg2://u@h/db").unwrap(),
            "postgres://u@h/db"
        );
        assert!(sqlx_uri("mysql://h/db").is_err());
    }

    #[tokio::test]
    async fn swap_is_a_compare_and_swap() {
        let dir = tempfile::tempdir().unwrap();
        let uri = format!("sqlite://{}/cat.db", dir.path().display());
        let cat = SqlCatalog::connect(&uri, "c").await.unwrap();
        cat.ensure_namespace("ns").await.unwrap();
        assert!(cat.create_table("ns", "t", "m0").await.unwrap());
        assert!(!cat.create_table("ns", "t", "other").await.unwrap());
        assert!(cat.swap("ns", "t", "m0", "m1").await.unwrap());
        assert!(!cat.swap("ns", "t", "m0", "m2").await.unwrap());
        assert_eq!(
            cat.metadata_location("ns", "t").await.unwrap().unwrap(),
            "m1"
        );
    }

    #[tokio::test]
    async fn swap_all_is_all_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let uri = format!("sqlite://{}/cat.db", dir.path().display());
        let cat = SqlCatalog::connect(&uri, "c").await.unwrap();
        cat.ensure_namespace("ns").await.unwrap();
        for t in ["a", "b"] {
            assert!(cat.create_table("ns", t, &format!("{t}0")).await.unwrap());
        }
        // b is not at b9: neither table moves.
        assert!(!cat
            .swap_all(&[("ns", "a", "a0", "a1"), ("ns", "b", "b9", "b1")])
            .await
            .unwrap());
        assert_eq!(
            cat.metadata_location("ns", "a").await.unwrap().unwrap(),
            "a0"
        );
        assert!(cat
            .swap_all(&[("ns", "a", "a0", "a1"), ("ns", "b", "b0", "b1")])
            .await
            .unwrap());
        assert_eq!(
            cat.metadata_location("ns", "b").await.unwrap().unwrap(),
            "b1"
        );
        assert_eq!(
            cat.list_tables().await.unwrap(),
            vec![
                ("ns".to_string(), "a".to_string()),
                ("ns".into(), "b".into())
            ]
        );
    }
}
