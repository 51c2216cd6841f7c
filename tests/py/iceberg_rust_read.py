#!/usr/bin/env python3
"""Read an Iceberg table with iceberg-rust (pyiceberg-core's DataFusion table provider, which
plans the scan, applies deletes and reads the files itself) and print the selected columns
of every row as a JSON list.

    iceberg_rust_read.py --metadata s3://bucket/t/metadata/00003-....metadata.json \
                         --columns _kafka_partition,_kafka_offset \
                         [--prop s3.endpoint=http://127.0.0.1:9000 --prop s3.access-key-id=...]
"""

import argparse
import json
import sys

from datafusion import SessionContext
from pyiceberg_core.datafusion import IcebergDataFusionTable


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metadata", required=True, help="the table's current metadata file")
    ap.add_argument("--columns", required=True, help="comma-separated column names")
    ap.add_argument("--prop", action="append", default=[], help="FileIO property key=value")
    args = ap.parse_args()

    props = dict(p.split("=", 1) for p in args.prop)
    table = IcebergDataFusionTable(["inlet", "table"], args.metadata, props)
    ctx = SessionContext()
    ctx.register_table("t", table)
    columns = ", ".join(f'"{c}"' for c in args.columns.split(","))
    rows = ctx.sql(f"SELECT {columns} FROM t").to_pylist()
    json.dump(rows, sys.stdout, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
