#!/usr/bin/env python3
"""Compare every table of a database with the Iceberg table inlet made of it, value by value.

The database side is `SELECT *` of each table with every value fetched as the server's text
(PostgreSQL through psycopg2 with `TimeZone=UTC` and `IntervalStyle=iso_8601`; MySQL/MariaDB
through PyMySQL); the Iceberg side is a pyiceberg scan of `<namespace>.<table>` (timestamps,
dates and times read as their integer encodings, so values outside Python's datetime range
compare too). Rows are matched by the database's primary key. Both sides are brought to one
canonical form per database type, and the forms must be equal:

- integers exactly; real/float as float32 bits, double precision as float64 bits (NaN equals
  NaN only; -0.0 differs from 0.0);
- numeric(p,s)/decimal(p,s) and money as their decimal text with the column's scale; numeric
  without a scale as an exact decimal value (Debezium's VariableScaleDecimal drops trailing
  zeros, so the scale cannot be kept);
- date as days, time as microseconds of the day, timestamp as microseconds since the epoch
  (timestamptz at UTC), timetz as microseconds of the day at UTC (Debezium's ZonedTime keeps
  no offset), interval in string mode as (months, days, microseconds), seconds rounded to the
  microsecond (Debezium formats them from a double: 3.695962 s arrives as 3.695961999 s);
- MySQL's zero dates (0000-00-00) as null, which is what Debezium sends for them;
- bytes as bytes; bit(1) as a boolean, bit(n)/varbit as the unsigned integer of the bits
  (Debezium's Bits are its little-endian bytes); hstore as a map; arrays element by element;
  text-like types (char, varchar, text, json, jsonb, xml, enum, uuid, inet, cidr, macaddr,
  ltree, set) as text.

The capture's Debezium settings (`--set key=value`, as `debezium_capture.py` takes them) decide
what the table can hold; unset ones are Debezium's defaults. A setting that loses or reshapes
values is modelled exactly, and nothing else is forgiven:

- `decimal.handling.mode=string`: decimals and money arrive as their plain text (with the
  column's scale), which the table must hold as text;
- `time.precision.mode=connect`: time and timestamp go through Connect's millisecond types, so
  the database value is expected truncated to the millisecond (Debezium's loss, not inlet's);
  dates, timetz and timestamptz are unaffected;
- `binary.handling.mode=hex|base64`: bytes arrive as a plain string, which the table must hold as
  text that decodes to the bytes;
- `interval.handling.mode=numeric` (the default): Debezium's microseconds, computed in doubles
  with months of 30.4375 days (MicroDuration.durationMicros); `string`: the exact ISO text;
- `bigint.unsigned.handling.mode=long` (the default): Debezium sends unsigned bigints as Java
  longs, so values above 2^63 - 1 are expected wrapped negative (Debezium's loss); `precise`: the
  exact value;
- `enable.time.adjuster` (MySQL) must be `false`: its moving of years 0-99 is not modelled.

    compare_db.py --kind postgres --host H --port P --user U --password PW --database DB \
        --uri sqlite:////abs/catalog.db --catalog NAME --warehouse file:///abs/warehouse \
        --namespace NS [--exclude capture_done ...] [--set decimal.handling.mode=string ...]

Prints one JSON object: per table the row counts, the column types on both sides and the
number of mismatches; `mismatches` (the first 200: table, key, column, db, table values) and
`mismatch_count`. Exit code 0 when it could compare (mismatches or not), 1 otherwise.
"""

import argparse
import base64
import datetime
import decimal
import json
import math
import re
import struct
import sys

decimal.getcontext().prec = 400

MISSING = object()

# Debezium's defaults of the settings that decide what a table can hold.
SETTINGS = {
    "decimal.handling.mode": "precise",
    "time.precision.mode": "adaptive",
    "binary.handling.mode": "bytes",
    "interval.handling.mode": "numeric",
    "bigint.unsigned.handling.mode": "long",
    "enable.time.adjuster": "true",
}
# The values this comparison models. The time adjuster is not modelled (it moves years 0-99 of
# MySQL dates); it only exists for MySQL, so a MySQL run must turn it off.
MODELLED = {
    "decimal.handling.mode": ("precise", "string"),
    "time.precision.mode": ("adaptive", "connect"),
    "binary.handling.mode": ("bytes", "hex", "base64"),
    "interval.handling.mode": ("numeric", "string"),
    "bigint.unsigned.handling.mode": ("long", "precise"),
    "enable.time.adjuster": ("false",),
}


def read_settings(pairs, kind):
    """The `--set key=value` pairs over the defaults; a setting the comparison does not model
    is an error, so a run cannot pass by a setting nobody accounted for."""
    for kv in pairs:
        k, _, v = kv.partition("=")
        if v not in MODELLED.get(k, ()):
            raise SystemExit(f"--set {kv}: not modelled; known: {MODELLED}")
        SETTINGS[k] = v
    if kind == "mysql" and SETTINGS["enable.time.adjuster"] != "false":
        raise SystemExit("--set enable.time.adjuster=false: its year adjustment is not modelled")


# --- calendar arithmetic beyond Python's datetime range --------------------
def days_from_civil(y, m, d):
    """Days since 1970-01-01 of a proleptic Gregorian date (astronomical year numbering)."""
    y -= m <= 2
    era = y // 400  # floor division: Hinnant's algorithm with Python's integers
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def micros_of_clock(text):
    """Microseconds of `HH:MM:SS[.ffffff]` (hours may exceed 24, a sign may lead)."""
    sign = -1 if text.startswith("-") else 1
    text = text.lstrip("+-")
    h, m, s = text.split(":")
    sec, _, frac = s.partition(".")
    micros = int(frac.ljust(6, "0")[:6]) if frac else 0
    return sign * (((int(h) * 60 + int(m)) * 60 + int(sec)) * 1_000_000 + micros)


def offset_seconds(text):
    """Seconds of a UTC offset such as `+05`, `-05:30`, `+05:30:15` or `Z`."""
    if text in ("Z", ""):
        return 0
    sign = -1 if text[0] == "-" else 1
    parts = [int(p) for p in text[1:].split(":")] + [0, 0]
    return sign * (parts[0] * 3600 + parts[1] * 60 + parts[2])


DATE_RE = re.compile(r"^([+-]?\d{4,})-(\d{2})-(\d{2})")


def parse_date_days(text):
    bc = text.endswith(" BC")
    m = DATE_RE.match(text)
    y = int(m.group(1))
    if bc:
        y = 1 - y
    return days_from_civil(y, int(m.group(2)), int(m.group(3)))


TS_RE = re.compile(r"^([+-]?\d{4,}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2}(?:\.\d+)?)(Z|[+-]\d{2}(?::?\d{2}){0,2})?( BC)?$")


def parse_timestamp_micros(text):
    """Microseconds since the epoch of a PostgreSQL, MySQL or ISO timestamp text (at UTC when
    it carries an offset)."""
    m = TS_RE.match(text)
    if not m:
        raise ValueError(f"unparsed timestamp {text!r}")
    date = m.group(1) + (" BC" if m.group(4) else "")
    days = parse_date_days(date)
    micros = days * 86_400_000_000 + micros_of_clock(m.group(2))
    if m.group(3):
        off = m.group(3)
        if off != "Z" and ":" not in off and len(off) > 3:
            off = off[:3] + ":" + off[3:]
        micros -= offset_seconds(off) * 1_000_000
    return micros


TIMETZ_RE = re.compile(r"^(\d{2}:\d{2}:\d{2}(?:\.\d+)?)(Z|[+-]\d{2}(?::\d{2}){0,2})$")


def parse_timetz_utc(text):
    m = TIMETZ_RE.match(text)
    if not m:
        raise ValueError(f"unparsed timetz {text!r}")
    return (micros_of_clock(m.group(1)) - offset_seconds(m.group(2)) * 1_000_000) % 86_400_000_000


ISO_INTERVAL_RE = re.compile(
    r"^P(?:(-?\d+)Y)?(?:(-?\d+)M)?(?:(-?\d+)W)?(?:(-?\d+)D)?"
    r"(?:T(?:(-?\d+)H)?(?:(-?\d+)M)?(?:(-?\d+(?:\.\d+)?)S)?)?$")


def parse_interval(text):
    """(months, days, microseconds) of an ISO 8601 interval with signed parts."""
    m = ISO_INTERVAL_RE.match(text)
    if not m:
        raise ValueError(f"unparsed interval {text!r}")
    y, mo, w, d, h, mi, s = m.groups()
    months = int(y or 0) * 12 + int(mo or 0)
    days = int(w or 0) * 7 + int(d or 0)
    secs = decimal.Decimal(s or 0)
    # Rounded to PostgreSQL's resolution, the microsecond: Debezium's string mode formats the
    # seconds from a double (3.695962 arrives as 3.695961999).
    micros = (int(h or 0) * 3600 + int(mi or 0) * 60) * 1_000_000 + int(
        (secs * 1_000_000).to_integral_value(rounding=decimal.ROUND_HALF_EVEN))
    return (months, days, micros)


def micro_duration(months, days, micros):
    """Debezium's numeric interval: MicroDuration.durationMicros(years, months, days, hours,
    minutes, seconds, 30.4375) in Java doubles, of PGInterval's parts (hours, minutes and
    seconds carry the interval's sign; seconds = whole + micros / 1e6), truncated to a long.
    Its months of 30.4375 days and its doubles are Debezium's approximation, not inlet's; so is
    the saturation of Java's double-to-long cast (178000000 years arrives as 2^63 - 1)."""
    sign = -1 if micros < 0 else 1
    rest = abs(micros)
    hours, rest = divmod(rest, 3_600_000_000)
    minutes, rest = divmod(rest, 60_000_000)
    whole, frac = divmod(rest, 1_000_000)
    seconds = float(sign * whole) + float(sign * frac) / 1_000_000
    total_days = float(months) * 30.4375 + float(days)
    total_seconds = ((total_days * 24.0 + float(sign * hours)) * 60.0 + float(sign * minutes)) * 60.0 + seconds
    return max(-(2**63), min(2**63 - 1, int(total_seconds * 1_000_000.0 + 0.0)))


def connect_millis(micros):
    """A time or timestamp as Debezium sends it under `time.precision.mode=connect`: Connect's
    Time and Timestamp hold milliseconds, so it drops the microseconds (toward the past)."""
    if SETTINGS["time.precision.mode"] == "connect":
        return micros // 1000 * 1000
    return micros


def plain(d):
    """The plain text of a Decimal (no exponent)."""
    return format(d, "f")


def float_bits(x, fmt):
    if isinstance(x, str):
        x = float(x)
    if math.isnan(x):
        return "NaN"
    return struct.pack(fmt, x).hex()


def parse_pg_array(text):
    """Elements of a one-dimensional PostgreSQL array literal (None for NULL)."""
    assert text[0] == "{" and text[-1] == "}", text
    out, i, body = [], 0, text[1:-1]
    if body == "":
        return out
    while i <= len(body):
        if i < len(body) and body[i] == '"':
            i += 1
            buf = []
            while body[i] != '"':
                if body[i] == "\\":
                    i += 1
                buf.append(body[i])
                i += 1
            out.append("".join(buf))
            i += 1
        else:
            j = body.find(",", i)
            j = len(body) if j < 0 else j
            tok = body[i:j]
            out.append(None if tok == "NULL" else tok)
            i = j
        i += 1  # the comma
    return out


HSTORE_RE = re.compile(r'"((?:[^"\\]|\\.)*)"=>(NULL|"((?:[^"\\]|\\.)*)")')


def parse_hstore(text):
    unescape = lambda s: re.sub(r"\\(.)", r"\1", s)
    return {unescape(m.group(1)): None if m.group(2) == "NULL" else unescape(m.group(3))
            for m in HSTORE_RE.finditer(text)}


# --- canonical forms ------------------------------------------------------------
class Column:
    """A database column: its name and how its values are canonicalised."""

    def __init__(self, name, kind, decl, scale=None, element=None):
        self.name = name
        self.kind = kind          # canonical kind, see canon_db
        self.decl = decl          # the declared type, for the report
        self.scale = scale
        self.element = element    # element kind of arrays


def canon_db(col, text, kind=None):
    """Canonical form of the database's text of a value; a text it cannot read (PostgreSQL's
    infinity, say) stays as it is, so it differs from whatever the table holds."""
    try:
        return canon_db_text(col, text, kind)
    except (ValueError, AttributeError, TypeError, decimal.InvalidOperation):
        return ("unreadable", text)


def canon_db_text(col, text, kind=None):
    kind = kind or col.kind
    if text is None:
        return None
    if kind == "uint" and SETTINGS["bigint.unsigned.handling.mode"] == "long":
        # Debezium's `long` mode sends an unsigned bigint as a Java long: above 2^63 - 1 it
        # wraps negative. That is Debezium's loss; the table must hold what Debezium sent.
        n = int(text)
        return n - 2**64 if n >= 2**63 else n
    if kind in ("int", "uint"):
        return int(text)
    if kind == "decimal":
        return plain(decimal.Decimal(text))
    if kind == "free_decimal":
        return decimal.Decimal(text)
    if kind == "money":
        neg = "-" in text or text.startswith("(")
        digits = re.sub(r"[^0-9.]", "", text)
        return plain(decimal.Decimal(("-" if neg else "") + digits))
    if kind == "float32":
        return float_bits(text, "<f")
    if kind == "float64":
        return float_bits(text, "<d")
    if kind == "bool":
        return text in ("t", "true", "1", True, 1)
    if kind == "bytes":
        if isinstance(text, (bytes, bytearray, memoryview)):
            return bytes(text)
        assert text.startswith("\\x"), text
        return bytes.fromhex(text[2:])
    if kind in ("date", "timestamp", "timestamptz") and text.startswith("0000-00-00"):
        # MySQL's zero date is no date: Debezium sends null (the nearest thing a table holds).
        return None
    if kind == "date":
        return parse_date_days(text)
    if kind == "time":
        return connect_millis(micros_of_clock(text))
    if kind == "timetz":
        return parse_timetz_utc(text)
    if kind == "timestamp":
        return connect_millis(parse_timestamp_micros(text))
    if kind == "timestamptz":
        return parse_timestamp_micros(text)
    if kind == "interval":
        if SETTINGS["interval.handling.mode"] == "numeric":
            return micro_duration(*parse_interval(text))
        return parse_interval(text)
    if kind == "bit1":
        return text == "1"
    if kind == "bits":
        if getattr(col, "mysql", False):
            return int(text)
        return int(text, 2) if text else 0
    if kind == "geometry":
        srid, _, wkb = text.partition(":")
        return (int(srid), bytes.fromhex(wkb))
    if kind == "hstore":
        return parse_hstore(text)
    if kind == "uuid":
        return text.lower()
    if kind == "array":
        return [canon_db_text(col, e, col.element) for e in parse_pg_array(text)]
    return text


def canon_table(col, v, kind=None):
    """Canonical form of a value read from the Iceberg table, for the database column `col`;
    MISSING-free: a value of an unexpected shape is returned as is, so it differs."""
    kind = kind or col.kind
    if v is None:
        return None
    if kind == "int":
        return v if isinstance(v, int) and not isinstance(v, bool) else ("?", v)
    if kind == "uint" and SETTINGS["bigint.unsigned.handling.mode"] == "long":
        return v if isinstance(v, int) and not isinstance(v, bool) else ("?", v)
    if kind == "uint":
        if isinstance(v, decimal.Decimal) and v == v.to_integral_value():
            return int(v)
        if isinstance(v, str) and v.isdigit():
            return int(v)
        return v if isinstance(v, int) and not isinstance(v, bool) else ("?", v)
    if kind == "geometry":
        # Debezium's Geometry struct: WKB and an SRID it leaves null for 0. inlet keeps the
        # struct as its JSON text, WKB in base64.
        if isinstance(v, str):
            try:
                parsed = json.loads(v)
                v = {"srid": parsed.get("srid"), "wkb": base64.b64decode(parsed["wkb"])}
            except (ValueError, KeyError, TypeError, AttributeError):
                return ("?", v)
        if isinstance(v, dict) and isinstance(v.get("wkb"), (bytes, bytearray)):
            return (v.get("srid") or 0, bytes(v["wkb"]))
        return ("?", v)
    if kind in ("decimal", "money", "free_decimal") and SETTINGS["decimal.handling.mode"] == "string":
        # Debezium's text (BigDecimal.toPlainString), held as text: compared as that text,
        # and as an exact value for numeric without scale (whose scale the text may not keep).
        if not isinstance(v, str) or not re.fullmatch(r"-?\d+(\.\d+)?", v):
            return ("?", v)
        return decimal.Decimal(v) if kind == "free_decimal" else v
    if kind == "decimal":
        if isinstance(v, decimal.Decimal):
            return plain(v)
        return v if isinstance(v, str) else ("?", v)
    if kind == "money":
        return plain(v) if isinstance(v, decimal.Decimal) else v
    if kind == "free_decimal":
        if isinstance(v, decimal.Decimal):
            return v
        # Text as a database prints a numeric: digits, no exponent.
        if isinstance(v, str) and re.fullmatch(r"-?\d+(\.\d+)?", v):
            return decimal.Decimal(v)
        return ("?", v)
    if kind == "float32":
        return float_bits(v, "<f") if isinstance(v, float) else ("?", v)
    if kind == "float64":
        return float_bits(v, "<d") if isinstance(v, float) else ("?", v)
    if kind == "bytes":
        mode = SETTINGS["binary.handling.mode"]
        if mode == "bytes":
            return bytes(v) if isinstance(v, (bytes, bytearray, memoryview)) else ("?", v)
        # A plain Connect string without a logical name: the table holds the text.
        if not isinstance(v, str):
            return ("?", v)
        try:
            return bytes.fromhex(v) if mode == "hex" else base64.b64decode(v, validate=True)
        except ValueError:
            return ("?", v)
    if kind in ("date", "time", "timestamp", "timestamptz"):
        if isinstance(v, int):
            return v
        if isinstance(v, str):
            try:
                if kind == "date":
                    return parse_date_days(v)
                if kind == "time":
                    return micros_of_clock(v)
                return parse_timestamp_micros(v)
            except (ValueError, AttributeError):
                return ("?", v)
        return ("?", v)
    if kind == "timetz":
        if isinstance(v, int):
            return v
        try:
            return parse_timetz_utc(v)
        except (ValueError, TypeError):
            return ("?", v)
    if kind == "interval":
        if SETTINGS["interval.handling.mode"] == "numeric":
            return v if isinstance(v, int) and not isinstance(v, bool) else ("?", v)
        if isinstance(v, str):
            try:
                return parse_interval(v)
            except ValueError:
                return ("?", v)
        return ("?", v)
    if kind == "bit1":
        return v if isinstance(v, bool) else ("?", v)
    if kind == "bits":
        if isinstance(v, (bytes, bytearray)):
            return int.from_bytes(bytes(v), "little")
        return ("?", v)
    if kind == "hstore":
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError:
                return ("?", v)
        if isinstance(v, list):
            return dict(v)
        return v
    if kind == "uuid":
        import uuid
        if isinstance(v, uuid.UUID):
            return str(v)
        if isinstance(v, (bytes, bytearray)) and len(v) == 16:
            return str(uuid.UUID(bytes=bytes(v)))
        return v.lower() if isinstance(v, str) else ("?", v)
    if kind == "array":
        # inlet keeps an array as its JSON text (Iceberg lists are not written yet).
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                return ("?", v)
        if not isinstance(v, list):
            return ("?", v)
        return [canon_table(col, e, col.element) for e in v]
    return v


def shown(v):
    """A JSON-friendly rendering of a canonical value for the report."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, decimal.Decimal):
        return plain(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        return "0x" + (b[:40].hex() + ("..." if len(b) > 40 else ""))
    if isinstance(v, (list, tuple)):
        return [shown(x) for x in v]
    if isinstance(v, dict):
        return {str(k): shown(x) for k, x in v.items()}
    return str(v)


def short(v):
    v = shown(v)
    if isinstance(v, str) and len(v) > 120:
        return v[:60] + f"...({len(v)} chars)..." + v[-20:]
    return v


# --- PostgreSQL ---------------------------------------------------------------
PG_KINDS = {
    "int2": "int", "int4": "int", "int8": "int", "float4": "float32", "float8": "float64",
    "money": "money", "bool": "bool", "bytea": "bytes", "date": "date", "time": "time",
    "timetz": "timetz", "timestamp": "timestamp", "timestamptz": "timestamptz",
    "interval": "interval", "uuid": "uuid", "hstore": "hstore",
}


def pg_kind(typname, typmod, typcategory):
    if typname == "numeric":
        if typmod < 0:
            return "free_decimal", None
        return "decimal", (typmod - 4) & 0xFFFF
    if typname == "bit":
        return ("bit1" if typmod == 1 else "bits"), None
    if typname == "varbit":
        return "bits", None
    return PG_KINDS.get(typname, "text"), None


def pg_tables(args):
    import psycopg2

    conn = psycopg2.connect(host=args.host, port=args.port, user=args.user,
                            password=args.password, dbname=args.database,
                            options="-c TimeZone=UTC -c IntervalStyle=iso_8601 -c extra_float_digits=1")
    conn.set_session(readonly=True)
    cur = conn.cursor()
    cur.execute("""SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE n.nspname = %s AND c.relkind = 'r' ORDER BY 1""", (args.schema,))
    names = [r[0] for r in cur.fetchall() if r[0] not in args.exclude]
    out = {}
    for name in names:
        cur.execute("""
            SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typname, a.atttypmod,
                   t.typcategory, et.typname, a.attnum = ANY(coalesce(i.indkey::int2[], '{}'))
            FROM pg_attribute a
            JOIN pg_type t ON t.oid = a.atttypid
            LEFT JOIN pg_type et ON et.oid = t.typelem AND t.typcategory = 'A'
            LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary
            WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped
            ORDER BY a.attnum""", (f'{args.schema}."{name}"',))
        cols, key = [], []
        for attname, decl, typname, typmod, cat, elem, is_key in cur.fetchall():
            if cat == "A":
                ekind, _ = pg_kind(elem, typmod, "")
                col = Column(attname, "array", decl, element=ekind)
            else:
                kind, scale = pg_kind(typname, typmod, cat)
                col = Column(attname, kind, decl, scale=scale)
            cols.append(col)
            if is_key:
                key.append(attname)
        # Every column of every row (`SELECT *`) as the server's text: the parsing is ours, so
        # nothing is rounded on the way.
        # (char(n) and inet are fetched as they are: their casts to text would drop char's
        # padding and add a host address's /32 or /128.)
        as_is = lambda c: c.decl.startswith("character(") or c.decl == "inet"
        select = [quote_pg(c.name) + ("" if as_is(c) else "::text") for c in cols]
        cur.execute(f'SELECT {", ".join(select)} FROM {args.schema}."{name}"')
        out[name] = (cols, key, cur.fetchall())
    conn.close()
    return out


def quote_pg(name):
    return '"' + name.replace('"', '""') + '"'


# --- MySQL / MariaDB ---------------------------------------------------------
def my_kind(data_type, column_type):
    t = data_type.lower()
    ct = column_type.lower()
    if t == "bigint" and "unsigned" in ct:
        return "uint"
    if t in ("tinyint", "smallint", "mediumint", "int", "bigint", "year"):
        return "int"
    if t == "decimal":
        return "decimal"
    if t == "float":
        return "float32"
    if t == "double":
        return "float64"
    if t in ("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"):
        return "bytes"
    if t == "bit":
        return "bit1" if ct == "bit(1)" else "bits"
    if t == "date":
        return "date"
    if t == "datetime":
        return "timestamp"
    if t == "timestamp":
        return "timestamptz"
    if t == "time":
        return "time"
    if t in ("geometry", "point", "linestring", "polygon", "multipoint", "multilinestring",
             "multipolygon", "geometrycollection"):
        return "geometry"
    return "text"


def my_select(col):
    """How one column is fetched: as text the comparator parses, exactly."""
    q = f"`{col.name}`"
    if col.kind == "bytes":
        return f"CONCAT('\\\\x', LOWER(HEX({q})))"
    if col.kind in ("bits", "bit1"):
        return f"CAST({q} + 0 AS CHAR)"
    if col.kind == "float32":
        # FLOAT widened to DOUBLE is exact; the server prints doubles in their shortest form.
        return f"CAST(CAST({q} AS DOUBLE) AS CHAR)"
    if col.kind == "geometry":
        return f"CONCAT(ST_SRID({q}), ':', HEX(ST_AsWKB({q})))"
    return f"CAST({q} AS CHAR)"


def my_tables(args):
    import pymysql

    conn = pymysql.connect(host=args.host, port=args.port, user=args.user, password=args.password,
                           database=args.database, charset="utf8mb4",
                           init_command="SET time_zone = '+00:00'")
    cur = conn.cursor()
    cur.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s "
                "AND table_type = 'BASE TABLE' ORDER BY 1", (args.database,))
    names = [r[0] for r in cur.fetchall() if r[0] not in args.exclude]
    out = {}
    for name in names:
        cur.execute("""SELECT column_name, data_type, column_type, column_key
                       FROM information_schema.columns WHERE table_schema = %s AND table_name = %s
                       ORDER BY ordinal_position""", (args.database, name))
        cols, key = [], []
        for cname, dtype, ctype, ckey in cur.fetchall():
            col = Column(cname, my_kind(dtype, ctype), ctype)
            col.mysql = True
            cols.append(col)
            if ckey == "PRI":
                key.append(cname)
        cur.execute(f"SELECT {', '.join(my_select(c) for c in cols)} FROM `{name}`")
        out[name] = (cols, key, [tuple(r) for r in cur.fetchall()])
    conn.close()
    return out


# --- Iceberg -----------------------------------------------------------------
def read_iceberg(catalog, ident):
    import pyarrow as pa

    table = catalog.load_table(ident)
    arrow = table.scan().to_arrow()
    cols = {}
    for i, field in enumerate(arrow.schema):
        arr = arrow.column(i)
        t = field.type
        if pa.types.is_timestamp(t) or pa.types.is_time(t):
            arr = arr.cast(pa.int64())
        elif pa.types.is_date32(t):
            arr = arr.cast(pa.int32())
        cols[field.name] = arr.to_pylist()
    types = {f.name: str(f.field_type) for f in table.schema().fields}
    required = {f.name: f.required for f in table.schema().fields}
    order = [f.name for f in table.schema().fields]
    rows = [{n: cols[n][i] for n in cols} for i in range(arrow.num_rows)]
    return rows, types, required, order


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", required=True, choices=["postgres", "mysql"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--user", required=True)
    ap.add_argument("--password", required=True)
    ap.add_argument("--database", required=True)
    ap.add_argument("--schema", default="public", help="PostgreSQL schema")
    ap.add_argument("--uri", required=True)
    ap.add_argument("--catalog", default="inlet")
    ap.add_argument("--warehouse", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--exclude", action="append", default=[])
    ap.add_argument("--set", action="append", default=[], help="the capture's Debezium setting key=value")
    args = ap.parse_args()
    read_settings(args.set, args.kind)

    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.exceptions import NoSuchTableError

    catalog = SqlCatalog(args.catalog, uri=args.uri, warehouse=args.warehouse, init_catalog_tables="false")
    db = pg_tables(args) if args.kind == "postgres" else my_tables(args)

    report = {"tables": {}, "mismatches": [], "mismatch_count": 0}

    def mismatch(table, key, column, dbv, tv, what="value"):
        report["mismatch_count"] += 1
        report["tables"][table]["mismatches"] += 1
        if len(report["mismatches"]) < 200:
            report["mismatches"].append({"table": table, "key": key, "column": column, "what": what,
                                         "db": short(dbv), "iceberg": short(tv)})

    for name, (cols, key, rows) in db.items():
        entry = report["tables"][name] = {"db_rows": len(rows), "table_rows": None, "mismatches": 0,
                                          "key": key, "columns": {}}
        try:
            trows, ttypes, required, order = read_iceberg(catalog, f"{args.namespace}.{name}")
        except NoSuchTableError:
            mismatch(name, None, None, f"{len(rows)} rows", "no such table", "table")
            continue
        entry["table_rows"] = len(trows)
        entry["iceberg_columns"] = order
        for c in cols:
            entry["columns"][c.name] = {"db": c.decl, "iceberg": ttypes.get(c.name)}
            if c.name not in ttypes:
                mismatch(name, None, c.name, c.decl, "no such column", "column")
        for k in key:
            if k in required and not required[k]:
                mismatch(name, None, k, "primary key", "optional column", "key column not required")
        db_order = [c.name for c in cols]
        t_order = [n for n in order if n in db_order]
        if t_order != [n for n in db_order if n in order]:
            mismatch(name, None, None, db_order, t_order, "column order")
        by_name = {c.name: c for c in cols}

        def key_of(values, canon):
            return tuple(json.dumps(shown(canon(by_name[k], values.get(k))), sort_keys=True) for k in key)

        dbmap = {}
        for r in rows:
            values = {c.name: v for c, v in zip(cols, r)}
            dbmap[key_of(values, canon_db)] = {c.name: canon_db(c, values[c.name]) for c in cols}
        tmap = {}
        for r in trows:
            k = key_of(r, canon_table)
            if k in tmap:
                mismatch(name, [json.loads(x) for x in k], None, "one row", "duplicate key", "duplicate")
            tmap[k] = {c.name: canon_table(c, r.get(c.name)) if c.name in r else MISSING for c in cols}
        for k in sorted(set(dbmap) | set(tmap)):
            shown_key = [json.loads(x) for x in k]
            if k not in tmap:
                mismatch(name, shown_key, None, "row", "missing", "row")
                continue
            if k not in dbmap:
                mismatch(name, shown_key, None, "no row", "extra row", "row")
                continue
            for c in cols:
                dv, tv = dbmap[k][c.name], tmap[k][c.name]
                if tv is MISSING:
                    continue
                if dv != tv or type(dv) is not type(tv):
                    mismatch(name, shown_key, c.name, dv, tv)
    json.dump(report, sys.stdout, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
