//! Debezium change events as Avro in the Confluent wire format: byte 0 is the magic byte 0,
//! bytes 1..5 the writer schema's id (big-endian), the rest one Avro binary datum. The envelope
//! (`before`, `after`, `source`, `op`, `ts_ms`) becomes the same [`RawChange`] the JSON decoder
//! makes of the same event: bytes and decimals as base64 strings, and the schema's
//! `connect.name`/`connect.parameters` properties (or plain Avro logical types) as field types.
//!
//! # Schema ids
//!
//! An id is resolved on its first use: from `<format.schemas_dir>/<id>.avsc` when a schema
//! directory is configured and holds that file, else from the registry (`GET
//! {format.schema_registry.url}/schemas/ids/{id}`). The answer is kept by id for the life of the
//! process, including "no such id" and "not a valid Avro schema", so no id is looked up twice;
//! callers decoding the same new id at once wait for the one lookup. Only failures that may pass
//! (registry unreachable or answering 5xx after its retries) are not kept: they surface as
//! retryable `Registry` errors and the next message asks again. Registry calls block, so inside
//! a multi-threaded tokio runtime they run under `block_in_place`, which lets the runtime move
//! its other tasks off this worker meanwhile.
//!
//! # Corrupt input
//!
//! Before apache-avro decodes a datum, a scan walks it against the writer schema without
//! allocating: every length must fit in the bytes left, array and map items are bounded by the
//! datum's size, nesting depth is bounded, and the datum must end exactly where the input does.
//! A corrupt length therefore cannot make the decoder allocate gigabytes, and a truncated datum
//! is an error rather than a record with trailing nulls (apache-avro reads a string or union cut
//! off at the end of input as null).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use apache_avro::schema::{Name, Namespace, ResolvedSchema, Schema};
use apache_avro::types::Value as Avro;
use base64::Engine;
use serde_json::{Map, Number, Value as Json};

use super::debezium::{connect_iceberg_type, control_message, envelope_change};
use super::registry::Registry;
use super::{json_kind, reason, Decoded, Decoder, FieldMap, FieldType, FieldTypes};
use crate::config::FormatConfig;
use inlet_common::error::{Error, ErrorKind, Result};

/// Decodes Debezium Avro.
pub struct DebeziumAvro {
    schemas: Schemas,
}

impl DebeziumAvro {
    /// A decoder resolving schema ids through `format`'s schema directory and registry.
    pub fn new(format: &FormatConfig) -> Result<DebeziumAvro> {
        let registry = format
            .schema_registry
            .as_ref()
            .map(Registry::new)
            .transpose()?;
        let dir = format.schemas_dir.as_ref().map(PathBuf::from);
        if registry.is_none() && dir.is_none() {
            return Err(Error::config(
                "format: debezium-avro needs format.schema_registry.url or format.schemas_dir to resolve schema ids",
            ));
        }
        Ok(DebeziumAvro {
            schemas: Schemas {
                dir,
                registry,
                by_id: Mutex::new(HashMap::new()),
            },
        })
    }

    /// Key column names: the fields of the key's record schema, when the key is in the wire
    /// format and its schema is known.
    fn key_columns(&self, key: Option<&[u8]>) -> Result<Vec<String>> {
        let Some((id, _)) = key.and_then(|k| framed(k).ok()) else {
            return Ok(Vec::new());
        };
        match self.schemas.get(id) {
            Ok(writer) => Ok(writer.record_fields.clone()),
            // Key names are informative; a key schema that cannot be had does not fail the change.
            Err(e) if e.kind() == ErrorKind::Decode => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }
}

impl Decoder for DebeziumAvro {
    fn decode(&self, key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Vec<Decoded>> {
        let Some(bytes) = value else {
            return Ok(vec![Decoded::Tombstone]);
        };
        let (id, datum) = framed(bytes)?;
        let writer = self.schemas.get(id)?;
        let payload = match writer.read(datum).map_err(|e| e.with("schema_id", id))? {
            Json::Object(o) => o,
            other => {
                return Err(Error::decode(format!(
                    "expected a Debezium envelope record, found {}",
                    json_kind(&other)
                ))
                .with("schema_id", id))
            }
        };
        if let Some(why) = control_message(&payload) {
            return Ok(vec![Decoded::Skipped(why)]);
        }
        let key = self.key_columns(key)?;
        envelope_change(payload, writer.fields.clone(), key).map(|c| vec![Decoded::Change(c)])
    }
}

/// The schema id and datum of a message in the Confluent wire format.
fn framed(bytes: &[u8]) -> Result<(u32, &[u8])> {
    match bytes {
        [0, a, b, c, d, datum @ ..] => Ok((u32::from_be_bytes([*a, *b, *c, *d]), datum)),
        [magic, _, _, _, _, ..] => Err(Error::decode(format!(
            "magic byte is {magic}, expected 0: not in the Confluent Avro wire format"
        ))),
        _ => Err(Error::decode(format!(
            "{} bytes are too short for the Confluent wire format's 5-byte header",
            bytes.len()
        ))),
    }
}

/// Writer schemas by id, each looked up once.
struct Schemas {
    dir: Option<PathBuf>,
    registry: Option<Registry>,
    /// One slot per id seen; a slot's lock is held during its lookup so concurrent callers of
    /// the same id wait for it instead of asking again.
    by_id: Mutex<HashMap<u32, Arc<Mutex<Option<Lookup>>>>>,
}

/// A settled answer for an id: its schema, or why there is none.
type Lookup = std::result::Result<Arc<Writer>, Refusal>;

#[derive(Debug, Clone)]
struct Refusal {
    reason: &'static str,
    message: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere cannot leave a half-written map entry or slot: both are set in one step.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Schemas {
    fn get(&self, id: u32) -> Result<Arc<Writer>> {
        let slot = lock(&self.by_id).entry(id).or_default().clone();
        let mut slot = lock(&slot);
        let lookup = match &*slot {
            Some(settled) => settled.clone(),
            None => {
                let fresh = self.load(id)?;
                *slot = Some(fresh.clone());
                fresh
            }
        };
        lookup.map_err(|r| Error::decode(r.message).because(r.reason))
    }

    /// Looks `id` up; an error is a failure that may pass and is not kept.
    fn load(&self, id: u32) -> Result<Lookup> {
        let refuse = |message: String| Refusal {
            reason: reason::UNKNOWN_SCHEMA,
            message,
        };
        let mut places = Vec::new();
        let mut found = None;
        if let Some(dir) = &self.dir {
            let path = dir.join(format!("{id}.avsc"));
            match std::fs::read_to_string(&path) {
                Ok(text) => found = Some((text, path.display().to_string())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    places.push(dir.display().to_string())
                }
                Err(e) => {
                    return Err(Error::new(
                        ErrorKind::Storage,
                        format!("cannot read schema file {}", path.display()),
                    )
                    .with_source(e))
                }
            }
        }
        if let (None, Some(registry)) = (&found, &self.registry) {
            match off_reactor(|| registry.schema(id)) {
                Ok(Some(text)) => found = Some((text, "the schema registry".to_string())),
                Ok(None) => places.push("the schema registry".to_string()),
                Err(e) if e.kind() == ErrorKind::Decode => {
                    return Ok(Err(Refusal {
                        reason: e.reason(),
                        message: e.to_string(),
                    }))
                }
                Err(e) => return Err(e.with("schema_id", id)),
            }
        }
        let Some((text, from)) = found else {
            return Ok(Err(refuse(format!(
                "schema id {id} is unknown to {}",
                places.join(" and ")
            ))));
        };
        Ok(match Writer::parse(&text) {
            Ok(writer) => {
                tracing::info!(schema_id = id, from = %from, "Loaded Avro writer schema");
                Ok(Arc::new(writer))
            }
            Err(why) => Err(refuse(format!("schema id {id} from {from}: {why}"))),
        })
    }
}

/// Runs blocking `f` so that a multi-threaded tokio runtime moves its other tasks elsewhere
/// meanwhile; outside one (tests, a current-thread runtime) it simply runs.
fn off_reactor<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// A parsed writer schema and what is derived from it once.
struct Writer {
    schema: Schema,
    /// Named types by full name, for following references during the scan.
    names: HashMap<Name, Schema>,
    /// What the envelope's schema says about the row images' fields.
    fields: FieldTypes,
    /// Field names of a record schema: a key schema's columns.
    record_fields: Vec<String>,
}

/// Nesting the scan follows before calling a datum malformed; recursion beyond it could
/// overflow the stack of apache-avro's recursive decoder.
const MAX_DEPTH: usize = 64;

/// Array and map items a datum may hold beyond one per byte (items of types that encode to no
/// bytes, such as null).
const MAX_EMPTY_ITEMS: usize = 1 << 16;

impl Writer {
    fn parse(text: &str) -> std::result::Result<Writer, String> {
        let json: Json = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let schema = Schema::parse(&json).map_err(|e| format!("not an Avro schema: {e}"))?;
        let names = ResolvedSchema::try_from(&schema)
            .map_err(|e| format!("unresolvable Avro schema: {e}"))?
            .get_names()
            .iter()
            .map(|(name, s)| (name.clone(), (*s).clone()))
            .collect();
        let record_fields = match &schema {
            Schema::Record(r) => r.fields.iter().map(|f| f.name.clone()).collect(),
            _ => Vec::new(),
        };
        Ok(Writer {
            fields: Arc::new(image_field_types(&json)),
            schema,
            names,
            record_fields,
        })
    }

    /// Decodes one datum into JSON values as the Debezium JSON converter would write them.
    fn read(&self, datum: &[u8]) -> Result<Json> {
        let mut scan = Scan {
            rest: datum,
            names: &self.names,
            items_left: datum.len() + MAX_EMPTY_ITEMS,
        };
        scan.skip(&self.schema, &None, 0)
            .map_err(|why| Error::decode(format!("Avro datum: {why}")))?;
        if !scan.rest.is_empty() {
            return Err(Error::decode(format!(
                "Avro datum: {} bytes after its end",
                scan.rest.len()
            )));
        }
        let mut input = datum;
        let value = apache_avro::from_avro_datum(&self.schema, &mut input, None)
            .map_err(|e| Error::decode(format!("Avro datum: {e}")))?;
        to_json(value).map_err(|why| Error::decode(format!("Avro datum: {why}")))
    }
}

/// Walks a datum against its schema, checking that it is complete and that every length fits.
struct Scan<'a> {
    rest: &'a [u8],
    names: &'a HashMap<Name, Schema>,
    items_left: usize,
}

type Scanned = std::result::Result<(), String>;

impl Scan<'_> {
    fn take(&mut self, n: usize) -> Scanned {
        if n > self.rest.len() {
            return Err(format!(
                "truncated: {n} bytes needed, {} left",
                self.rest.len()
            ));
        }
        self.rest = &self.rest[n..];
        Ok(())
    }

    /// A zig-zag varint, as Avro encodes int and long.
    fn long(&mut self) -> std::result::Result<i64, String> {
        let mut raw: u64 = 0;
        for i in 0..10 {
            let Some((&b, rest)) = self.rest.split_first() else {
                return Err("truncated inside a number".into());
            };
            self.rest = rest;
            raw |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok((raw >> 1) as i64 ^ -((raw & 1) as i64));
            }
        }
        Err("a number longer than 10 bytes".into())
    }

    fn int(&mut self) -> Scanned {
        let v = self.long()?;
        i32::try_from(v)
            .map(drop)
            .map_err(|_| format!("{v} is out of range for an int"))
    }

    /// A length that must fit in what is left.
    fn sized(&mut self) -> Scanned {
        let n = self.long()?;
        let n = usize::try_from(n).map_err(|_| format!("negative length {n}"))?;
        self.take(n)
    }

    /// Array or map blocks: counts (negative ones followed by a byte size), ending with 0.
    fn blocks(&mut self, mut item: impl FnMut(&mut Self) -> Scanned) -> Scanned {
        loop {
            let count = self.long()?;
            if count == 0 {
                return Ok(());
            }
            if count < 0 {
                let size = self.long()?;
                if size < 0 {
                    return Err(format!("negative block size {size}"));
                }
            }
            let count = usize::try_from(count.unsigned_abs())
                .ok()
                .filter(|n| *n <= self.items_left)
                .ok_or_else(|| format!("a block of {count} items cannot fit in the datum"))?;
            self.items_left -= count;
            for _ in 0..count {
                item(self)?;
            }
        }
    }

    fn skip(&mut self, schema: &Schema, ns: &Namespace, depth: usize) -> Scanned {
        if depth > MAX_DEPTH {
            return Err(format!("nested deeper than {MAX_DEPTH} levels"));
        }
        let depth = depth + 1;
        match schema {
            Schema::Null => Ok(()),
            Schema::Boolean => match self.rest.first() {
                Some(0 | 1) => self.take(1),
                Some(b) => Err(format!("{b} is not a boolean")),
                None => Err("truncated inside a boolean".into()),
            },
            Schema::Int | Schema::Date | Schema::TimeMillis => self.int(),
            Schema::Long
            | Schema::TimeMicros
            | Schema::TimestampMillis
            | Schema::TimestampMicros
            | Schema::TimestampNanos
            | Schema::LocalTimestampMillis
            | Schema::LocalTimestampMicros
            | Schema::LocalTimestampNanos => self.long().map(drop),
            Schema::Float => self.take(4),
            Schema::Double => self.take(8),
            Schema::Duration => self.take(12),
            // apache-avro reads uuids and big decimals length-prefixed, like bytes and strings.
            Schema::Bytes | Schema::String | Schema::Uuid | Schema::BigDecimal => self.sized(),
            Schema::Fixed(f) => self.take(f.size),
            Schema::Decimal(d) => self.skip(&d.inner, ns, depth),
            Schema::Enum(e) => {
                let i = self.long()?;
                if usize::try_from(i).is_ok_and(|i| i < e.symbols.len()) {
                    Ok(())
                } else {
                    Err(format!("enum index {i} out of range"))
                }
            }
            Schema::Union(u) => {
                let i = self.long()?;
                let variant = usize::try_from(i)
                    .ok()
                    .and_then(|i| u.variants().get(i))
                    .ok_or_else(|| format!("union index {i} out of range"))?;
                self.skip(variant, ns, depth)
            }
            Schema::Array(a) => self.blocks(|s| s.skip(&a.items, ns, depth)),
            Schema::Map(m) => self.blocks(|s| {
                s.sized()?;
                s.skip(&m.types, ns, depth)
            }),
            Schema::Record(r) => {
                let inner = r.name.fully_qualified_name(ns).namespace;
                r.fields
                    .iter()
                    .try_for_each(|f| self.skip(&f.schema, &inner, depth))
            }
            Schema::Ref { name } => {
                let full = name.fully_qualified_name(ns);
                let names = self.names;
                let target = names
                    .get(&full)
                    .ok_or_else(|| format!("reference to unknown type {full}"))?;
                self.skip(target, &full.namespace, depth)
            }
        }
    }
}

/// An Avro value as Debezium's JSON converter writes the same field.
fn to_json(v: Avro) -> std::result::Result<Json, String> {
    let base64 = |b: &[u8]| Json::String(base64::engine::general_purpose::STANDARD.encode(b));
    Ok(match v {
        Avro::Null => Json::Null,
        Avro::Boolean(b) => Json::Bool(b),
        Avro::Int(n) | Avro::Date(n) | Avro::TimeMillis(n) => Json::from(n),
        Avro::Long(n)
        | Avro::TimeMicros(n)
        | Avro::TimestampMillis(n)
        | Avro::TimestampMicros(n)
        | Avro::TimestampNanos(n)
        | Avro::LocalTimestampMillis(n)
        | Avro::LocalTimestampMicros(n)
        | Avro::LocalTimestampNanos(n) => Json::from(n),
        Avro::Float(f) => float(f64::from(f)),
        Avro::Double(f) => float(f),
        Avro::Bytes(b) | Avro::Fixed(_, b) => base64(&b),
        Avro::String(s) | Avro::Enum(_, s) => Json::String(s),
        Avro::Decimal(d) => {
            base64(&<Vec<u8>>::try_from(&d).map_err(|e| format!("unreadable decimal: {e}"))?)
        }
        Avro::BigDecimal(d) => Json::String(d.to_string()),
        Avro::Uuid(u) => Json::String(u.to_string()),
        Avro::Duration(d) => base64(&<[u8; 12]>::from(d)),
        Avro::Union(_, inner) => to_json(*inner)?,
        Avro::Array(items) => {
            Json::Array(items.into_iter().map(to_json).collect::<Result<_, _>>()?)
        }
        Avro::Map(entries) => Json::Object(
            entries
                .into_iter()
                .map(|(k, v)| Ok((k, to_json(v)?)))
                .collect::<Result<Map<_, _>, String>>()?,
        ),
        Avro::Record(fields) => Json::Object(
            fields
                .into_iter()
                .map(|(k, v)| Ok((k, to_json(v)?)))
                .collect::<Result<Map<_, _>, String>>()?,
        ),
    })
}

/// JSON cannot hold NaN or infinities; Debezium writes them as these strings.
fn float(f: f64) -> Json {
    match Number::from_f64(f) {
        Some(n) => Json::Number(n),
        None if f.is_nan() => Json::String("NaN".into()),
        None if f > 0.0 => Json::String("Infinity".into()),
        None => Json::String("-Infinity".into()),
    }
}

/// Field types of the envelope's row images, read from the schema's JSON: parsed Avro schemas
/// drop the properties of primitive types, and those (`connect.name`, `connect.parameters`,
/// `connect.type`) carry Debezium's logical types.
fn image_field_types(schema: &Json) -> FieldMap {
    let mut named = HashMap::new();
    collect_named(schema, "", &mut named);
    let mut out = FieldMap::default();
    let Some((envelope, ns)) = resolve(schema, "", &named) else {
        return out;
    };
    let image = envelope
        .get("fields")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
        .filter(|f| {
            matches!(
                f.get("name").and_then(Json::as_str),
                Some("before" | "after")
            )
        })
        .find_map(|f| {
            let (record, ns) = resolve(non_null(f.get("type")?), &ns, &named)?;
            Some((record.get("fields")?.as_array()?, ns))
        });
    let Some((fields, ns)) = image else {
        return out;
    };
    for (position, f) in fields.iter().enumerate() {
        let (Some(name), Some(ty)) = (f.get("name").and_then(Json::as_str), f.get("type")) else {
            continue;
        };
        if let Some((ty, _)) = resolve(non_null(ty), &ns, &named) {
            let field = FieldType {
                position: Some(position as u32),
                ..field_type(ty)
            };
            out.insert(name.to_string(), field);
        }
    }
    out
}

/// The Debezium/Connect view of one Avro field type (already resolved, without its null branch).
fn field_type(ty: &Json) -> FieldType {
    let prop = |k: &str| ty.get(k);
    let avro_type = match ty {
        Json::String(s) => s.as_str(),
        _ => prop("type").and_then(Json::as_str).unwrap_or(""),
    };
    let parameter = |k: &str| {
        prop("connect.parameters")
            .and_then(|p| p.get(k))
            .and_then(Json::as_str)
            .and_then(|s| s.parse::<u32>().ok())
    };
    let attribute = |k: &str| {
        prop(k)
            .and_then(Json::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    };
    let logical = prop("connect.name").and_then(Json::as_str).or_else(|| {
        // Plain Avro logical types, for writers that are not Kafka Connect.
        Some(match prop("logicalType")?.as_str()? {
            "decimal" => "org.apache.kafka.connect.data.Decimal",
            "date" => "org.apache.kafka.connect.data.Date",
            "time-millis" => "org.apache.kafka.connect.data.Time",
            "time-micros" => "io.debezium.time.MicroTime",
            "timestamp-millis" | "local-timestamp-millis" => {
                "org.apache.kafka.connect.data.Timestamp"
            }
            "timestamp-micros" | "local-timestamp-micros" => "io.debezium.time.MicroTimestamp",
            "timestamp-nanos" | "local-timestamp-nanos" => "io.debezium.time.NanoTimestamp",
            _ => return None,
        })
    });
    let connect_type = prop("connect.type")
        .and_then(Json::as_str)
        .or(match avro_type {
            "int" => Some("int32"),
            "long" => Some("int64"),
            "float" => Some("float"),
            "double" => Some("double"),
            "boolean" => Some("boolean"),
            "string" | "enum" => Some("string"),
            "bytes" | "fixed" => Some("bytes"),
            "record" => Some("struct"),
            "array" => Some("array"),
            "map" => Some("map"),
            _ => None,
        });
    let scale = parameter("scale").or_else(|| attribute("scale"));
    let precision = parameter("connect.decimal.precision").or_else(|| attribute("precision"));
    FieldType {
        declared: connect_iceberg_type(connect_type, logical, scale, precision),
        logical: logical.map(str::to_string),
        connect_type: connect_type.map(str::to_string),
        scale,
        position: None,
    }
}

/// The first branch of a union that is not null; other types as they are.
fn non_null(ty: &Json) -> &Json {
    match ty {
        Json::Array(branches) => branches
            .iter()
            .find(|b| b.as_str() != Some("null"))
            .unwrap_or(ty),
        other => other,
    }
}

const PRIMITIVES: [&str; 8] = [
    "null", "boolean", "int", "long", "float", "double", "bytes", "string",
];

/// A named type's full name and the namespace its contents inherit.
fn full_name(def: &Json, enclosing: &str) -> Option<(String, String)> {
    let name = def.get("name")?.as_str()?;
    if let Some((ns, _)) = name.rsplit_once('.') {
        return Some((name.to_string(), ns.to_string()));
    }
    let ns = def
        .get("namespace")
        .and_then(Json::as_str)
        .unwrap_or(enclosing);
    let full = if ns.is_empty() {
        name.to_string()
    } else {
        format!("{ns}.{name}")
    };
    Some((full, ns.to_string()))
}

/// Records, enums and fixed types defined anywhere in `node`, by full name.
fn collect_named<'a>(node: &'a Json, ns: &str, out: &mut HashMap<String, &'a Json>) {
    match node {
        Json::Array(branches) => branches.iter().for_each(|b| collect_named(b, ns, out)),
        Json::Object(o) => match o.get("type") {
            Some(Json::String(t))
                if matches!(t.as_str(), "record" | "error" | "enum" | "fixed") =>
            {
                let Some((full, inner)) = full_name(node, ns) else {
                    return;
                };
                out.insert(full, node);
                for f in o
                    .get("fields")
                    .and_then(Json::as_array)
                    .into_iter()
                    .flatten()
                {
                    if let Some(ty) = f.get("type") {
                        collect_named(ty, &inner, out);
                    }
                }
            }
            Some(Json::String(t)) if t == "array" => {
                if let Some(items) = o.get("items") {
                    collect_named(items, ns, out);
                }
            }
            Some(Json::String(t)) if t == "map" => {
                if let Some(values) = o.get("values") {
                    collect_named(values, ns, out);
                }
            }
            Some(nested @ (Json::Object(_) | Json::Array(_))) => collect_named(nested, ns, out),
            _ => {}
        },
        _ => {}
    }
}

/// Follows a reference to a named type; returns the definition and the namespace inside it.
fn resolve<'a>(
    ty: &'a Json,
    ns: &str,
    named: &HashMap<String, &'a Json>,
) -> Option<(&'a Json, String)> {
    match ty {
        Json::String(s) if PRIMITIVES.contains(&s.as_str()) => Some((ty, ns.to_string())),
        Json::String(s) => {
            let qualified = if s.contains('.') || ns.is_empty() {
                s.clone()
            } else {
                format!("{ns}.{s}")
            };
            let def = named.get(&qualified).or_else(|| named.get(s))?;
            let (_, inner) = full_name(def, ns)?;
            Some((def, inner))
        }
        Json::Object(_) => {
            let inner = full_name(ty, ns).map_or_else(|| ns.to_string(), |(_, inner)| inner);
            Some((ty, inner))
        }
        _ => None,
    }
}

#[cfg(test)]
mod golden {
    //! Golden cases in `tests/golden/debezium-avro/`: each file names writer schemas from its
    //! `schemas/` directory by id, gives the event as JSON (encoded here with apache-avro's
    //! writer and the wire header), the table's columns and the expected change record or error.
    //! A case with `same_event_as` takes event, columns and expectation from the Debezium JSON
    //! golden file of that name, and must also decode to the very same raw change.

    use super::*;
    use crate::debezium::DebeziumJson;
    use crate::golden::{columns, row_json};
    use crate::{Column, Shape};
    use apache_avro::Decimal;
    use serde_json::json;
    use std::path::Path;

    pub(crate) fn dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/debezium-avro")
    }

    /// An offline decoder over the golden writer schemas.
    pub(crate) fn decoder() -> DebeziumAvro {
        DebeziumAvro::new(&FormatConfig {
            kind: crate::config::FormatKind::DebeziumAvro,
            schema_registry: None,
            schemas_dir: Some(dir().join("schemas").display().to_string()),
            ..FormatConfig::default()
        })
        .unwrap()
    }

    pub(crate) fn schema_text(id: u32) -> String {
        std::fs::read_to_string(dir().join(format!("schemas/{id}.avsc"))).unwrap()
    }

    /// `event` encoded with writer schema `id` in the Confluent wire format.
    pub(crate) fn encode(id: u32, event: &Json) -> Vec<u8> {
        let writer = Writer::parse(&schema_text(id)).unwrap();
        let value = avro_value(event, &writer.schema, &writer.names, &None);
        let mut out = vec![0];
        out.extend_from_slice(&id.to_be_bytes());
        out.extend(apache_avro::to_avro_datum(&writer.schema, value).unwrap());
        out
    }

    fn bytes(v: &Json) -> Vec<u8> {
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap()
    }

    /// JSON as the Avro value of `schema`: bytes and decimals in base64, unions by nullness.
    fn avro_value(
        v: &Json,
        schema: &Schema,
        names: &HashMap<Name, Schema>,
        ns: &Namespace,
    ) -> Avro {
        let int = || i32::try_from(v.as_i64().unwrap()).unwrap();
        let long = || v.as_i64().unwrap();
        match schema {
            Schema::Null => Avro::Null,
            Schema::Boolean => Avro::Boolean(v.as_bool().unwrap()),
            Schema::Int => Avro::Int(int()),
            Schema::Date => Avro::Date(int()),
            Schema::TimeMillis => Avro::TimeMillis(int()),
            Schema::Long => Avro::Long(long()),
            Schema::TimeMicros => Avro::TimeMicros(long()),
            Schema::TimestampMillis => Avro::TimestampMillis(long()),
            Schema::TimestampMicros => Avro::TimestampMicros(long()),
            Schema::Float => Avro::Float(v.as_f64().unwrap() as f32),
            Schema::Double => Avro::Double(v.as_f64().unwrap()),
            Schema::Bytes => Avro::Bytes(bytes(v)),
            Schema::String => Avro::String(v.as_str().unwrap().into()),
            Schema::Decimal(_) => Avro::Decimal(Decimal::from(bytes(v))),
            Schema::Enum(e) => {
                let s = v.as_str().unwrap();
                let i = e.symbols.iter().position(|x| x == s).unwrap();
                Avro::Enum(i as u32, s.into())
            }
            Schema::Union(u) => {
                let (i, branch) = u
                    .variants()
                    .iter()
                    .enumerate()
                    .find(|(_, b)| (**b == Schema::Null) == v.is_null())
                    .unwrap();
                Avro::Union(i as u32, Box::new(avro_value(v, branch, names, ns)))
            }
            Schema::Record(r) => {
                let inner = r.name.fully_qualified_name(ns).namespace;
                Avro::Record(
                    r.fields
                        .iter()
                        .map(|f| {
                            let fv = v.get(&f.name).unwrap_or(&Json::Null);
                            (f.name.clone(), avro_value(fv, &f.schema, names, &inner))
                        })
                        .collect(),
                )
            }
            Schema::Ref { name } => {
                let full = name.fully_qualified_name(ns);
                avro_value(v, &names[&full], names, &full.namespace)
            }
            other => panic!("the test encoder lacks {other:?}"),
        }
    }

    /// The message bytes of a case's value, with its `wire` damage applied.
    fn value_bytes(case: &Json, event: &Json) -> Option<Vec<u8>> {
        let id = case["value_schema_id"].as_u64()? as u32;
        let mut bytes = encode(id, event);
        let wire = &case["wire"];
        if let Some(magic) = wire["magic"].as_u64() {
            bytes[0] = magic as u8;
        }
        if let Some(id) = wire["schema_id"].as_u64() {
            bytes[1..5].copy_from_slice(&(id as u32).to_be_bytes());
        }
        if let Some(n) = wire["truncate"].as_u64() {
            bytes.truncate(bytes.len() - n as usize);
        }
        if let Some(extra) = wire["append_hex"].as_str() {
            bytes.extend(
                (0..extra.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&extra[i..i + 2], 16).unwrap()),
            );
        }
        Some(bytes)
    }

    #[test]
    fn golden_cases() {
        let mut files: Vec<_> = std::fs::read_dir(dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        files.sort();
        assert!(
            files.len() >= 9,
            "golden cases missing in {}",
            dir().display()
        );
        let decoder = decoder();
        let mut seeds = Vec::new();
        for path in files {
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let mut case: Json =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let mut json_event = None;
            if let Some(other) = case["same_event_as"].as_str() {
                let file = dir().join("../debezium").join(other);
                let original: Json =
                    serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
                case["columns"] = original["columns"].clone();
                case["expect"] = original["expect"].clone();
                case["key"] = original["key"]["payload"].clone();
                case["value"] = original["value"]["payload"].clone();
                json_event = Some(original);
            }
            let columns: Vec<Column> = columns(&case);
            let value = value_bytes(&case, &case["value"]);
            let key = case["key_schema_id"]
                .as_u64()
                .map(|id| encode(id as u32, &case["key"]));
            let decoded = decoder.decode(key.as_deref(), value.as_deref());
            seeds.push((
                name.trim_end_matches(".json").to_string(),
                crate::fuzzing::seed(key.as_deref(), value.as_deref()),
            ));
            let expect = &case["expect"];
            if let Some(want) = expect.get("error_contains").and_then(Json::as_str) {
                let err = decoded.expect_err(&name);
                assert!(
                    err.to_string().contains(want),
                    "{name}: error {err} lacks {want:?}"
                );
                assert_eq!(json!(err.reason()), expect["reason"], "{name}: reason");
                continue;
            }
            let mut decoded = decoded.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(decoded.len(), 1, "{name}: one change per message");
            let raw = match decoded.remove(0) {
                Decoded::Tombstone => {
                    assert!(expect.get("tombstone").is_some(), "{name}: tombstone");
                    continue;
                }
                Decoded::Change(raw) => raw,
                Decoded::Skipped(why) => {
                    assert_eq!(json!(why), expect["skipped"], "{name}: skipped");
                    continue;
                }
            };
            if let Some(original) = json_event {
                let Decoded::Change(from_json) = DebeziumJson
                    .decode(
                        Some(original["key"].to_string().as_bytes()),
                        Some(original["value"].to_string().as_bytes()),
                    )
                    .unwrap()
                    .remove(0)
                else {
                    panic!("{name}: the JSON event is not a change")
                };
                assert_eq!(raw, from_json, "{name}: Avro and JSON decode alike");
            }
            assert_eq!(
                json!(raw.key),
                case.get("expect_key").cloned().unwrap_or(json!(["id"])),
                "{name}: key"
            );
            let rec = Shape::new(columns.clone())
                .record(&raw)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(json!(rec.op.code()), expect["op"], "{name}: op");
            assert_eq!(
                row_json(&columns, &rec.before),
                expect["before"],
                "{name}: before"
            );
            assert_eq!(
                row_json(&columns, &rec.after),
                expect["after"],
                "{name}: after"
            );
            assert_eq!(
                rec.version.map_or(Json::Null, |v| json!(v.to_string())),
                expect["version"],
                "{name}: version"
            );
            assert_eq!(
                rec.source_ts_ms.map_or(Json::Null, |v| json!(v)),
                expect["source_ts_ms"],
                "{name}: ts"
            );
            if let Some(declared) = case.get("expect_declared") {
                let got: Map<String, Json> = raw
                    .fields
                    .iter()
                    .map(|(k, f)| (k.clone(), json!(f.declared.map(|t| t.to_string()))))
                    .collect();
                assert_eq!(&Json::Object(got), declared, "{name}: declared types");
            }
        }
        check_fuzz_seeds(&seeds);
    }

    /// The `decode_avro` fuzz target starts from these messages: `fuzz/seeds/decode_avro/`
    /// must hold them (`INLET_BLESS=1` rewrites the directory).
    fn check_fuzz_seeds(seeds: &[(String, Vec<u8>)]) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/decode_avro");
        if std::env::var_os("INLET_BLESS").is_some() {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            for (name, bytes) in seeds {
                std::fs::write(dir.join(name), bytes).unwrap();
            }
        }
        for (name, bytes) in seeds {
            let stored = std::fs::read(dir.join(name))
                .unwrap_or_else(|e| panic!("fuzz seed {name}: {e}; run with INLET_BLESS=1"));
            assert_eq!(
                &stored, bytes,
                "fuzz seed {name} is stale; run with INLET_BLESS=1"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::golden::{decoder, encode, schema_text};
    use super::*;
    use crate::config::{FormatKind, SchemaRegistryConfig};
    use crate::registry::test_server;
    use serde_json::json;
    use std::time::Duration;

    fn mysql_event() -> Json {
        let original: Json = serde_json::from_str(
            &std::fs::read_to_string(
                super::golden::dir().join("../debezium/01_mysql_create_all_logical_types.json"),
            )
            .unwrap(),
        )
        .unwrap();
        original["value"]["payload"].clone()
    }

    fn registry_format(url: &str) -> FormatConfig {
        FormatConfig {
            kind: FormatKind::DebeziumAvro,
            schema_registry: Some(SchemaRegistryConfig {
                url: url.to_string(),
                username: None,
                password: None,
                ca_location: None,
                timeout_ms: 5_000,
            }),
            schemas_dir: None,
            ..FormatConfig::default()
        }
    }

    /// A registry serving the golden schemas; other ids are not found.
    fn registry() -> test_server::Server {
        test_server::start(None, |_, r| {
            let id: u32 = r.path.rsplit('/').next().unwrap().parse().unwrap();
            match std::fs::read_to_string(super::golden::dir().join(format!("schemas/{id}.avsc"))) {
                Ok(text) => (200, json!({ "schema": text }).to_string()),
                Err(_) => (
                    404,
                    json!({"error_code": 40403, "message": "Schema not found"}).to_string(),
                ),
            }
        })
    }

    fn assert_malformed(result: Result<Vec<Decoded>>, context: &str) {
        match result {
            Ok(d) => panic!("{context}: decoded {d:?}"),
            Err(e) => assert_eq!(e.reason(), reason::MALFORMED, "{context}: {e}"),
        }
    }

    #[test]
    fn every_truncation_is_malformed() {
        let decoder = decoder();
        let message = encode(1, &mysql_event());
        assert!(decoder.decode(None, Some(&message)).is_ok());
        for n in 0..message.len() {
            assert_malformed(
                decoder.decode(None, Some(&message[..n])),
                &format!("{n} bytes"),
            );
        }
    }

    #[test]
    fn damaged_bytes_never_panic() {
        let decoder = decoder();
        let message = encode(1, &mysql_event());
        let mut outcomes = [0usize; 2];
        for i in 5..message.len() {
            for damage in [0xff, 0x80, 0x7f, 0x01, 0x00] {
                let mut bad = message.clone();
                bad[i] ^= damage;
                outcomes[usize::from(decoder.decode(None, Some(&bad)).is_ok())] += 1;
            }
        }
        assert!(outcomes[0] > 0, "some damage must be detected");
    }

    #[test]
    fn corrupt_lengths_and_counts_fail_without_allocating() {
        let strings = Writer::parse(
            r#"{"type":"record","name":"R","fields":[{"name":"s","type":"string"}]}"#,
        )
        .unwrap();
        // Zig-zag varint of 2^62: a string "length" of 4 EiB.
        let huge = [0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01];
        let err = strings.read(&huge).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");

        let nulls = Writer::parse(r#"{"type":"array","items":"null"}"#).unwrap();
        // A block of 2^40 nulls encodes in 6 bytes.
        let mut block = Vec::new();
        let mut n: u64 = (1u64 << 40) << 1;
        while n >= 0x80 {
            block.push((n as u8) | 0x80);
            n >>= 7;
        }
        block.extend([n as u8, 0]);
        let err = nulls.read(&block).unwrap_err();
        assert!(err.to_string().contains("cannot fit"), "{err}");
        // A modest array of nulls is fine.
        assert_eq!(
            nulls.read(&[20, 0]).unwrap(),
            Json::Array(vec![Json::Null; 10])
        );
    }

    #[test]
    fn deep_nesting_is_malformed_not_a_stack_overflow() {
        let list = Writer::parse(
            r#"{"type":"record","name":"Node","fields":[{"name":"next","type":["null","Node"]}]}"#,
        )
        .unwrap();
        let mut datum = vec![2u8; 100_000];
        datum.push(0);
        let err = list.read(&datum).unwrap_err();
        assert!(err.to_string().contains("nested deeper"), "{err}");
        assert_eq!(
            list.read(&[2, 2, 0]).unwrap(),
            json!({"next": {"next": {"next": null}}})
        );
    }

    #[test]
    fn values_map_like_the_json_converter() {
        let w = Writer::parse(
            r#"{"type":"record","name":"R","fields":[
                {"name":"f","type":"float"},{"name":"d","type":"double"},
                {"name":"x","type":{"type":"fixed","name":"F","size":2}},
                {"name":"e","type":{"type":"enum","name":"E","symbols":["a","b"]}},
                {"name":"m","type":{"type":"map","values":"long"}}]}"#,
        )
        .unwrap();
        let mut datum = Vec::new();
        datum.extend(f32::NAN.to_le_bytes());
        datum.extend(f64::NEG_INFINITY.to_le_bytes());
        datum.extend([0xde, 0xad, 2, 2, 2, b'k', 6, 0]);
        assert_eq!(
            w.read(&datum).unwrap(),
            json!({"f": "NaN", "d": "-Infinity", "x": "3q0=", "e": "b", "m": {"k": 3}})
        );
    }

    #[test]
    fn field_types_follow_connect_properties_then_avro_logical_types() {
        let fields = Writer::parse(&schema_text(3)).unwrap().fields;
        let get = |name: &str| fields.get(name).unwrap_or_else(|| panic!("{name}"));
        let total = get("total");
        assert_eq!(
            total.logical.as_deref(),
            Some("org.apache.kafka.connect.data.Decimal")
        );
        assert_eq!(total.connect_type.as_deref(), Some("bytes"));
        assert_eq!(total.scale, Some(2));
        assert_eq!(get("small").connect_type.as_deref(), Some("int16"));
        // A named type used a second time is a reference by name.
        assert_eq!(
            get("adjustment").logical.as_deref(),
            Some("io.debezium.data.VariableScaleDecimal")
        );
        assert_eq!(
            get("plain_time").logical.as_deref(),
            Some("io.debezium.time.MicroTime")
        );
        assert_eq!(get("channel").connect_type.as_deref(), Some("string"));
    }

    #[test]
    fn wire_header_errors() {
        let decoder = decoder();
        assert_malformed(decoder.decode(None, Some(&[])), "empty");
        assert_malformed(decoder.decode(None, Some(&[0, 0, 0])), "short");
        let err = decoder
            .decode(None, Some(&[b'{', 0, 0, 0, 1, 2]))
            .unwrap_err();
        assert!(err.to_string().contains("magic byte is 123"), "{err}");
        assert!(matches!(
            decoder.decode(None, None).unwrap()[..],
            [Decoded::Tombstone]
        ));
    }

    #[test]
    fn offline_directory_misses_and_bad_files_are_unknown_schemas() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("5.avsc"), "{\"type\": \"recor").unwrap();
        std::fs::write(dir.path().join("1.avsc"), schema_text(1)).unwrap();
        let decoder = DebeziumAvro::new(&FormatConfig {
            kind: FormatKind::DebeziumAvro,
            schema_registry: None,
            schemas_dir: Some(dir.path().display().to_string()),
            ..FormatConfig::default()
        })
        .unwrap();
        let event = encode(1, &mysql_event());
        assert!(decoder.decode(None, Some(&event)).is_ok());
        let mut other = event.clone();
        other[4] = 5;
        let err = decoder.decode(None, Some(&other)).unwrap_err();
        assert_eq!(err.reason(), reason::UNKNOWN_SCHEMA);
        assert!(err.to_string().contains("not JSON"), "{err}");
        other[4] = 6;
        let err = decoder.decode(None, Some(&other)).unwrap_err();
        assert_eq!(err.reason(), reason::UNKNOWN_SCHEMA);
        assert!(err.to_string().contains("schema id 6 is unknown"), "{err}");
    }

    #[test]
    fn registry_ids_are_fetched_once() {
        let server = registry();
        let decoder = DebeziumAvro::new(&registry_format(&server.url)).unwrap();
        let key = encode(2, &json!({"id": 1}));
        let value = encode(1, &mysql_event());
        for _ in 0..3 {
            let decoded = decoder.decode(Some(&key), Some(&value)).unwrap();
            let [Decoded::Change(raw)] = &decoded[..] else {
                panic!("{decoded:?}")
            };
            assert_eq!(raw.key, ["id"]);
        }
        let mut unknown = value.clone();
        unknown[1..5].copy_from_slice(&77u32.to_be_bytes());
        for _ in 0..2 {
            let err = decoder.decode(None, Some(&unknown)).unwrap_err();
            assert_eq!(err.reason(), reason::UNKNOWN_SCHEMA);
            assert!(err.to_string().contains("schema id 77"), "{err}");
        }
        let mut paths: Vec<String> = server
            .requests
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.path.clone())
            .collect();
        paths.sort();
        assert_eq!(
            paths,
            ["/schemas/ids/1", "/schemas/ids/2", "/schemas/ids/77"]
        );
    }

    #[test]
    fn directory_first_then_registry() {
        let server = registry();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("1.avsc"), schema_text(1)).unwrap();
        let mut format = registry_format(&server.url);
        format.schemas_dir = Some(dir.path().display().to_string());
        let decoder = DebeziumAvro::new(&format).unwrap();
        let key = encode(2, &json!({"id": 1}));
        decoder
            .decode(Some(&key), Some(&encode(1, &mysql_event())))
            .unwrap();
        assert_eq!(server.requests.lock().unwrap()[0].path, "/schemas/ids/2");
        assert_eq!(server.count(), 1);
    }

    #[test]
    fn registry_outage_is_retryable_and_not_remembered() {
        let server = test_server::start(None, |n, r| {
            if n < 3 {
                (503, String::new())
            } else {
                let id = r.path.rsplit('/').next().unwrap();
                let text = schema_text(id.parse().unwrap());
                (200, json!({ "schema": text }).to_string())
            }
        });
        let decoder = DebeziumAvro::new(&registry_format(&server.url)).unwrap();
        let value = encode(1, &mysql_event());
        let err = decoder.decode(None, Some(&value)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Registry);
        assert!(err.retryable());
        assert!(decoder.decode(None, Some(&value)).is_ok());
        assert_eq!(server.count(), 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn decodes_on_a_multi_thread_runtime() {
        let server = registry();
        let decoder = DebeziumAvro::new(&registry_format(&server.url)).unwrap();
        let value = encode(1, &mysql_event());
        // Another task keeps running while a worker waits on the registry.
        let ticker = tokio::spawn(async { tokio::time::sleep(Duration::from_millis(1)).await });
        assert!(decoder.decode(None, Some(&value)).is_ok());
        ticker.await.unwrap();
        assert_eq!(server.count(), 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn decodes_on_a_current_thread_runtime() {
        let server = registry();
        let decoder = DebeziumAvro::new(&registry_format(&server.url)).unwrap();
        assert!(decoder
            .decode(None, Some(&encode(1, &mysql_event())))
            .is_ok());
    }
}
