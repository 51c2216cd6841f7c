#!/usr/bin/env python3
"""Time a full scan of an Iceberg table with pyiceberg, deletes applied.

    scan_time.py METADATA_LOCATION [REPEATS]

Prints one JSON object: rows, the best of REPEATS (default 3) scan times in seconds, and the
data and delete files the scan planned. `inlet bench` runs it on each pipeline's table.
"""

import json
import sys
import time

from pyiceberg.table import StaticTable


def main():
    location = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    table = StaticTable.from_metadata(location)
    tasks = list(table.scan().plan_files())
    deletes = {d.file_path for t in tasks for d in t.delete_files}
    best = None
    rows = 0
    for _ in range(repeats):
        started = time.perf_counter()
        rows = table.scan().to_arrow().num_rows
        took = time.perf_counter() - started
        best = took if best is None else min(best, took)
    json.dump({"rows": rows, "secs": best, "data_files": len(tasks), "delete_files": len(deletes)}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
