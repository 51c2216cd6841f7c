#!/usr/bin/env python3
"""Writes fuzz/seeds/<target>/<case> from the golden decode cases in crates/decode/tests/golden/<format>/.

Each seed is a fuzz input in the layout of crates/decode/src/fuzzing.rs: the key's length (254 for no
key, 255 for no value), the column selector (0), the key, the value. Golden payloads follow
crates/decode/src/golden.rs: null is absent, a JSON string is raw bytes, anything else is JSON text.
A key longer than 253 bytes is dropped. Rerun after adding golden cases; the seeds are checked in.
"""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = {
    "debezium": "decode_debezium",
    "canal": "decode_canal",
    "maxwell": "decode_maxwell",
    "ogg": "decode_ogg",
    "changelog": "decode_changelog",
    "upsert_json": "decode_upsert_json",
}


def payload(v):
    if v is None:
        return None
    if isinstance(v, str):
        return v.encode()
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode()


def seed(key, value):
    if key is not None and len(key) > 253:
        key = None
    if value is None:
        return bytes([255, 0]) + (key or b"")
    if key is None:
        return bytes([254, 0]) + value
    return bytes([len(key), 0]) + key + value


def main():
    for fmt, target in TARGETS.items():
        out = ROOT / "fuzz" / "seeds" / target
        out.mkdir(parents=True, exist_ok=True)
        for old in out.iterdir():
            old.unlink()
        for case in sorted((ROOT / "crates" / "decode" / "tests" / "golden" / fmt).glob("*.json")):
            doc = json.loads(case.read_text())
            data = seed(payload(doc.get("key")), payload(doc.get("value")))
            (out / case.stem).write_bytes(data)
        print(f"{target}: {len(list(out.iterdir()))} seeds")


if __name__ == "__main__":
    main()
