#!/usr/bin/env python3
"""Change an Iceberg table as another engine would, through pyiceberg's SqlCatalog.

The tests use it to check that inlet keeps a table exact when other engines rewrite, delete,
expire snapshots or change the schema between (or during) its runs.

    foreign_writer.py --uri sqlite:////abs/catalog.db --catalog NAME \
                      --warehouse file:///abs/warehouse --table ns.table ACTION [ARGS]

Actions:
    rewrite                   overwrite the table with its own rows (a compaction: every data
                              file replaced by files of this engine, deletes applied)
    delete FILTER             copy-on-write delete of the rows matching FILTER (e.g. "id < 40")
    expire                    expire every snapshot but the table's ref heads
    remove-tag NAME           remove a tag
    append-json ROWS          append rows given as a JSON list of objects (binary columns as hex)
    add-column NAME TYPE      add an optional column (string, long, int)
    rename-column OLD NEW     rename a column
    drop-column NAME          drop a column
    widen-column NAME TYPE    widen a column's type (int to long)
    snapshot-ids              print the ids of the snapshots the table keeps, one per line
"""

import argparse
import datetime
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uri", required=True)
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--warehouse", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("action")
    ap.add_argument("args", nargs="*")
    args = ap.parse_args()

    import pyarrow as pa
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.types import IntegerType, LongType, StringType

    catalog = SqlCatalog(args.catalog, uri=args.uri, warehouse=args.warehouse, init_catalog_tables="false")
    table = catalog.load_table(args.table)
    action, rest = args.action, args.args

    if action == "rewrite":
        rows = table.scan().to_arrow()
        table.overwrite(rows, overwrite_filter=AlwaysTrue())
    elif action == "delete":
        table.delete(delete_filter=rest[0])
    elif action == "expire":
        future = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
        table.maintenance.expire_snapshots().older_than(future).commit()
    elif action == "remove-tag":
        table.manage_snapshots().remove_tag(rest[0]).commit()
    elif action == "append-json":
        schema = table.schema().as_arrow()
        rows = json.loads(rest[0])
        for r in rows:
            for f in schema:
                binary = pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)
                if binary and isinstance(r.get(f.name), str):
                    r[f.name] = bytes.fromhex(r[f.name])
        table.append(pa.Table.from_pylist(rows, schema=schema))
    elif action == "add-column":
        types = {"string": StringType(), "long": LongType(), "int": IntegerType()}
        with table.update_schema() as update:
            update.add_column(rest[0], types[rest[1]])
    elif action == "rename-column":
        with table.update_schema() as update:
            update.rename_column(rest[0], rest[1])
    elif action == "drop-column":
        with table.update_schema() as update:
            update.delete_column(rest[0])
    elif action == "widen-column":
        types = {"long": LongType()}
        with table.update_schema() as update:
            update.update_column(rest[0], field_type=types[rest[1]])
    elif action == "snapshot-ids":
        for s in table.snapshots():
            print(s.snapshot_id)
    else:
        print(f"foreign_writer.py: unknown action {action}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
