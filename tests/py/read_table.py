#!/usr/bin/env python3
"""Read an Iceberg table through pyiceberg's SqlCatalog or RestCatalog and print it as one
JSON object.

This is an independent reader: the test suite uses it to check that what inlet
commits is readable by another Iceberg implementation, not just by inlet itself.

    read_table.py --uri sqlite:////abs/catalog.db --catalog NAME \
                  --warehouse file:///abs/warehouse --table ns.table [--no-rows]
    read_table.py --rest http://127.0.0.1:8181 --token T --table ns.table \
                  [--prop s3.endpoint=http://127.0.0.1:9000 --prop s3.access-key-id=...]

Exit codes: 0 ok, 2 table/namespace/catalog missing, 1 anything else.
"""

import argparse
import datetime
import decimal
import json
import math
import os
import sys
import uuid


def jsonable(v):
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        # NaN/inf are not valid JSON.
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (datetime.datetime, datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, datetime.timedelta):
        return str(v)
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        # Arrow maps come back as lists of (key, value) tuples.
        return [jsonable(x) for x in v]
    return str(v)


def die(code, msg):
    print(f"read_table.py: {msg}", file=sys.stderr)
    sys.exit(code)


def bound_map(m):
    return {str(k): bytes(v).hex() for k, v in sorted((m or {}).items())}


def count_map(m):
    return {str(k): v for k, v in sorted((m or {}).items())}


def describe_files(table, snapshot):
    if snapshot is None:
        return []
    specs = table.specs()
    out = []
    for manifest in snapshot.manifests(table.io):
        spec = specs[manifest.partition_spec_id]
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            f = entry.data_file
            partition = {pf.name: jsonable(f.partition[i]) for i, pf in enumerate(spec.fields)}
            out.append({
                "file_path": f.file_path,
                "content": f.content.name.lower(),
                "file_format": f.file_format.name,
                "record_count": f.record_count,
                "file_size_in_bytes": f.file_size_in_bytes,
                "spec_id": manifest.partition_spec_id,
                "partition": partition,
                "status": entry.status.name.lower(),
                "snapshot_id": entry.snapshot_id,
                "sequence_number": entry.sequence_number,
                "file_sequence_number": entry.file_sequence_number,
                "value_counts": count_map(f.value_counts),
                "null_value_counts": count_map(f.null_value_counts),
                "lower_bounds": bound_map(f.lower_bounds),
                "upper_bounds": bound_map(f.upper_bounds),
                "equality_ids": f.equality_ids,
                "manifest_path": manifest.manifest_path,
            })
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uri", help="SQLAlchemy URI: sqlite:////abs/path.db or postgresql+psycopg2://...")
    ap.add_argument("--catalog", default="inlet", help="catalog_name as stored in the catalog tables")
    ap.add_argument("--warehouse", help="file:///abs/path or s3://bucket/prefix")
    ap.add_argument("--rest", help="base URL of an Iceberg REST catalog (instead of --uri)")
    ap.add_argument("--token", help="bearer token of the REST catalog")
    ap.add_argument("--prop", action="append", default=[],
                    help="catalog/FileIO property key=value (s3.endpoint, s3.access-key-id, ...)")
    ap.add_argument("--table", required=True, help="namespace.table")
    ap.add_argument("--snapshot-id", type=int,
                    help="read this snapshot instead of the current one (a pinned reader)")
    ap.add_argument("--no-rows", action="store_true",
                    help="skip the scan (pyiceberg cannot apply equality deletes); print rows: null")
    args = ap.parse_args()

    props = dict(p.split("=", 1) for p in args.prop)
    if args.rest:
        from pyiceberg.catalog.rest import RestCatalog
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError
        catalog = RestCatalog("rest", uri=args.rest, token=args.token, **props)
        try:
            table = catalog.load_table(args.table)
        except (NoSuchTableError, NoSuchNamespaceError) as e:
            die(2, f"table {args.table} not found in the REST catalog at {args.rest}: {e}")
        return describe(args, table)
    if not args.uri or not args.warehouse:
        die(1, "--uri and --warehouse are needed without --rest")
    # SQLAlchemy would silently create an empty sqlite file; a missing file is a test failure.
    if args.uri.startswith("sqlite:///"):
        path = args.uri[len("sqlite:///"):]
        if path and path != ":memory:" and not os.path.exists(path):
            die(2, f"catalog database {path} does not exist")

    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError
    from sqlalchemy.exc import OperationalError, ProgrammingError

    # The reader must never create or migrate the catalog tables it is checking.
    catalog = SqlCatalog(args.catalog, uri=args.uri, warehouse=args.warehouse, init_catalog_tables="false", **props)
    try:
        table = catalog.load_table(args.table)
    except (NoSuchTableError, NoSuchNamespaceError) as e:
        die(2, f"table {args.table} not found in catalog {args.catalog!r} at {args.uri}: {e}")
    except (OperationalError, ProgrammingError) as e:
        die(2, f"catalog tables unreadable at {args.uri}: {e.orig}")
    describe(args, table)


def describe(args, table):

    if args.snapshot_id is None:
        snapshot = table.current_snapshot()
    else:
        snapshot = table.snapshot_by_id(args.snapshot_id)
        if snapshot is None:
            die(1, f"table {args.table} has no snapshot {args.snapshot_id}")
    rows = None
    if not args.no_rows:
        try:
            scan = table.scan() if args.snapshot_id is None else table.scan(snapshot_id=args.snapshot_id)
            rows = jsonable(scan.to_arrow().to_pylist())
        except (ValueError, NotImplementedError) as e:
            if "equality delete" in str(e):
                die(1, f"{e} (use --no-rows to inspect files only)")
            raise

    schema = table.schema()
    out = {
        "rows": rows,
        "snapshot": None if snapshot is None else {
            "snapshot_id": snapshot.snapshot_id,
            "parent_snapshot_id": snapshot.parent_snapshot_id,
            "sequence_number": snapshot.sequence_number,
            "timestamp_ms": snapshot.timestamp_ms,
            "schema_id": snapshot.schema_id,
            "manifest_list": snapshot.manifest_list,
            "summary": {k: str(v) for k, v in snapshot.summary.model_dump().items()} if snapshot.summary else {},
        },
        "files": describe_files(table, snapshot),
        "schema": [
            {"id": f.field_id, "name": f.name, "type": str(f.field_type), "required": f.required}
            for f in schema.fields
        ],
        "identifier_field_ids": sorted(schema.identifier_field_ids),
        "partition_spec": [
            {"source_id": pf.source_id, "field_id": pf.field_id, "name": pf.name, "transform": str(pf.transform)}
            for pf in table.spec().fields
        ],
        "format_version": table.format_version,
        "metadata_location": table.metadata_location,
        "properties": dict(table.properties),
        "snapshot_count": len(table.snapshots()),
    }
    json.dump(out, sys.stdout, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
