#!/usr/bin/env python3
"""Read an Iceberg table with DuckDB's iceberg extension and print its rows as a JSON list.

A second independent reader. The extensions come from their PyPI wheels and are loaded
by path, so nothing is downloaded at run time.

    duckdb_read.py --metadata s3://bucket/t/metadata/00003-....metadata.json \
                   [--s3-endpoint 127.0.0.1:9000 --s3-key KEY --s3-secret SECRET]
"""

import argparse
import glob
import json
import os
import sys

import duckdb


def extension(name):
    module = __import__(f"duckdb_extension_{name}")
    found = glob.glob(os.path.join(os.path.dirname(module.__file__), "extensions", "*", f"{name}.duckdb_extension"))
    if not found:
        sys.exit(f"duckdb_read.py: the {name} extension is not in its wheel")
    return found[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metadata", required=True, help="the table's current metadata file")
    ap.add_argument("--s3-endpoint", help="host:port of an S3-compatible server (path style, plain HTTP)")
    ap.add_argument("--s3-key")
    ap.add_argument("--s3-secret")
    args = ap.parse_args()

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    for name in ("avro", "httpfs", "iceberg"):
        con.execute(f"LOAD '{extension(name)}'")
    if args.s3_endpoint:
        con.execute(
            "CREATE SECRET lake (TYPE s3, KEY_ID ?, SECRET ?, ENDPOINT ?, URL_STYLE 'path', USE_SSL false, REGION 'us-east-1')",
            [args.s3_key, args.s3_secret, args.s3_endpoint],
        )
    cur = con.execute("SELECT * FROM iceberg_scan(?)", [args.metadata])
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, r)) for r in cur.fetchall()]
    json.dump(rows, sys.stdout, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
