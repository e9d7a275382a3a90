"""Loader and producer throughput against a real broker, each against named baselines.

Runs against the broker that ``$KFEED_BOOTSTRAP`` (or ``--bootstrap``) names,
on fresh uuid topics (4 partitions, replication factor 1) that it deletes at
the end. The workload is the seeds' sample: 768 float32 features, an int64
label and an int64 id (3,088 bytes), ``--samples`` of them (default 200,000;
``--quick``: 50,000 and one repeat).

Consumer side, every contender delivering batches of 256 samples as CPU
tensors, reading a topic from its earliest offset to its end with a fresh
consumer group:

- ``seeds loop``: the seeds' training loop on the raw topic: ``poll(1.0)`` per
  message, ``np.frombuffer``, ``torch.tensor(label)``, ``consumer.commit(msg)``
  per message, ``torch.stack`` per batch. In confluent-kafka ``commit(msg)`` is
  asynchronous by default, so that is what the seeds measure: one OffsetCommit
  request per message, which the broker serves one at a time, so the run also
  reports how many of them were acknowledged when the loop ended. The variant
  with ``asynchronous=False`` (what a kafka-python port would do) is measured
  too, for at most ``--sync-seconds`` a run, because it is far slower.
- ``plain consume loop``: a careful confluent-kafka loop on the raw topic with
  kfeed's consumer settings: ``consume(2048)``, a numpy copy per message into
  a preallocated batch, ``torch.from_numpy`` per batch, an asynchronous commit
  once a second.
- ``kfeed Loader raw`` / ``kfeed Loader block``: ``kfeed.Loader(format=...,
  until="end", device="cpu")`` on the raw topic and on the block topic
  (64 records per message, written by ``kfeed.Producer``). The same two again
  with ``OMP_NUM_THREADS=1`` (information only): on the CPU the loader clones
  each batch, and torch's intra-op thread pool contends for the cores with
  the loader's thread and librdkafka.
- ``ceiling``: ``consume(2048)`` of the same topics with kfeed's consumer
  settings, touching nothing but ``error()`` (records = messages x records per
  message). Nothing Python-side can beat it.

Producer side: the seeds' producer loop (one ``produce`` per sample with a
delivery callback, zstd as the seeds configure it, and without compression)
against ``kfeed.Producer`` (raw and block). Each producer runs once.

Each contender runs in its own subprocess, so its peak RSS growth is its own
(``VmHWM`` reset through ``/proc/self/clear_refs`` after imports and input
generation) and no librdkafka state leaks between contenders. Throughput is
counted from the moment the group assigns the partitions to the last batch;
the wall time including the group join is reported beside it. Consumer runs
are interleaved across repeats; the table gives medians.

    python bench/bench_loader.py [--samples N] [--repeat R] [--quick] [--write]

``--quick`` is a smoke run: at 50,000 samples the block topic holds 782
messages and the start-up dominates, so its ratios are not the targets' figures.

Exit status: 0, or 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

RECORD_BYTES = 3088
FEATURES = 768
BLOCK_RECORDS = 64
PARTITIONS = 4
BATCH = 256
CONSUME_N = 2048
CONSUME_TIMEOUT_S = 0.1
SECTION = "## Loader throughput (local 1-node Kafka)"
RESULTS = Path(__file__).with_name("RESULTS.md")

# ratio name -> (numerator, denominator, target)
TARGETS = [
    ("kfeed block vs seeds loop", "kfeed_block", "seeds", 5.0),
    ("kfeed block vs block ceiling", "kfeed_block", "ceiling_block", 0.8),
    ("kfeed raw vs seeds loop", "kfeed_raw", "seeds", 1.5),
]
INFO_RATIOS = [
    ("kfeed raw vs plain consume loop", "kfeed_raw", "plain"),
    ("kfeed block, OMP_NUM_THREADS=1, vs block ceiling", "kfeed_block_1t", "ceiling_block"),
    ("kfeed block, OMP_NUM_THREADS=1, vs seeds loop", "kfeed_block_1t", "seeds"),
    ("kfeed raw, OMP_NUM_THREADS=1, vs plain consume loop", "kfeed_raw_1t", "plain"),
    ("kfeed raw vs raw ceiling", "kfeed_raw", "ceiling_raw"),
    ("plain consume loop vs seeds loop", "plain", "seeds"),
    ("seeds loop (async commit) vs seeds loop (sync commit)", "seeds", "seeds_sync"),
]

CONSUMERS: list[tuple[str, str, str]] = [
    # key, label, topic kind
    ("seeds", "seeds loop: poll(1.0) + commit(msg) per message (async, the default)", "raw"),
    ("seeds_sync", "seeds loop with commit(msg, asynchronous=False)", "raw"),
    ("plain", "plain consume loop: consume(2048) + numpy copy per message", "raw"),
    ("kfeed_raw", "kfeed Loader, format=raw", "raw"),
    ("kfeed_block", "kfeed Loader, format=block (64/message)", "block"),
    ("kfeed_raw_1t", "kfeed Loader, format=raw, OMP_NUM_THREADS=1", "raw"),
    ("kfeed_block_1t", "kfeed Loader, format=block, OMP_NUM_THREADS=1", "block"),
    ("ceiling_raw", "ceiling: consume(2048), raw topic, touching nothing", "raw"),
    ("ceiling_block", "ceiling: consume(2048), block topic, touching nothing", "block"),
]
# Run with one intra-op torch thread: shows what the CPU copy of each batch
# costs when torch's thread pool fights the loader's thread and librdkafka for
# the cores (information only; the targets use torch's defaults).
CHILD_ENV = {"kfeed_raw_1t": {"OMP_NUM_THREADS": "1"}, "kfeed_block_1t": {"OMP_NUM_THREADS": "1"}}
PRODUCERS: list[tuple[str, str, str]] = [
    ("p_seeds_zstd", "seeds producer loop: produce() per sample + callback, zstd", "seeds_zstd"),
    ("p_seeds", "seeds producer loop, no compression", "seeds"),
    ("p_kfeed_raw", "kfeed.Producer, format=raw", "raw"),
    ("p_kfeed_block", "kfeed.Producer, format=block (64/message)", "block"),
]


# -- memory ------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Peak resident memory growth of this process from ``start()`` on."""

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self.base = _status_kib("VmRSS")

    def growth_mib(self) -> float:
        return max(0, _status_kib("VmHWM") - self.base) / 1024


# -- inputs ------------------------------------------------------------------


def columns(n: int) -> dict[str, Any]:
    """The samples of ``kfeed produce --synthetic``, built in chunks to bound memory."""
    import numpy as np

    from kfeed.cli import synthetic_columns

    out = {"features": np.empty((n, FEATURES), np.float32),
           "label": np.empty(n, np.int64), "id": np.empty(n, np.int64)}
    step = 8192
    for i in range(0, n, step):
        chunk = synthetic_columns(np.arange(i, min(n, i + step)))
        for name, a in chunk.items():
            out[name][i:i + len(a)] = a
    return out


# -- consumer contenders (run in a child process) ---------------------------


class Clock:
    """Marks when partitions were first assigned; throughput is counted from there."""

    def __init__(self) -> None:
        self.created = time.perf_counter()
        self.assigned: float | None = None

    def on_assign(self, *_args: Any) -> None:
        if self.assigned is None:
            self.assigned = time.perf_counter()

    def result(self, samples: int, **extra: Any) -> dict[str, Any]:
        end = time.perf_counter()
        start = self.assigned if self.assigned is not None else self.created
        return {"samples": samples, "seconds": end - start, "wall": end - self.created, **extra}


class Ends:
    """Stop rule of the hand-written loops: every partition at EOF, or at its
    last offset (the high watermark read before the run)."""

    def __init__(self, ends: dict[int, int]) -> None:
        self.last = {p: e - 1 for p, e in ends.items()}
        self.done: set[int] = {p for p, e in ends.items() if e == 0}

    def all(self) -> bool:
        return len(self.done) == len(self.last)

    def error(self, msg: Any) -> None:
        from confluent_kafka import KafkaError, KafkaException

        err = msg.error()
        if err.code() == KafkaError._PARTITION_EOF:
            self.done.add(msg.partition())
        else:
            raise KafkaException(err)


def _consumer_conf(spec: dict[str, Any], tuned: bool) -> dict[str, Any]:
    from kfeed.sources import CONSUMER_DEFAULTS

    base: dict[str, Any] = dict(CONSUMER_DEFAULTS) if tuned else {
        # What the seeds set (kafka-python style names, in librdkafka's words).
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "fetch.max.bytes": 1048576,
    }
    base.update({"bootstrap.servers": spec["bootstrap"], "group.id": spec["group"],
                 "enable.partition.eof": True})
    return base


def run_seeds(spec: dict[str, Any], sync: bool) -> dict[str, Any]:
    import warnings

    import numpy as np
    import torch
    from confluent_kafka import Consumer, TopicPartition

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    limit = spec.get("time_limit")
    consumer = Consumer(_consumer_conf(spec, tuned=False))
    clock = Clock()
    consumer.subscribe([spec["topic"]], on_assign=clock.on_assign)
    ends = Ends({int(p): e for p, e in spec["ends"].items()})
    samples = 0
    while not ends.all():
        batch = []
        for _ in range(BATCH):
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            if msg.error():
                ends.error(msg)
                if ends.all():
                    break
                continue
            data = msg.value()
            features = np.frombuffer(data, dtype="float32", count=FEATURES)
            label = torch.tensor(np.frombuffer(data, dtype="int64", count=1, offset=3072)[0]).long()
            batch.append((features, label))
            if sync:
                consumer.commit(msg, asynchronous=False)
            else:
                consumer.commit(msg)  # the seeds' call: asynchronous in confluent-kafka
            if msg.offset() >= ends.last[msg.partition()]:
                ends.done.add(msg.partition())
                if ends.all():
                    break
        if not batch:
            continue
        features = torch.stack([torch.from_numpy(x[0]) for x in batch])
        labels = torch.stack([x[1] for x in batch])
        assert features.shape == (len(batch), FEATURES) and labels.shape == (len(batch),)
        samples += len(batch)
        if limit is not None and clock.assigned is not None \
                and time.perf_counter() - clock.assigned >= limit:
            break
    out = clock.result(samples, capped=not ends.all())
    if not sync:
        # Each commit(msg) above sent an OffsetCommit request of its own. The
        # broker serves one request per connection at a time, so most are
        # still queued when the loop ends (and heartbeats queue behind them).
        # How far the group's committed offsets got, asked over another
        # connection, shows the backlog.
        probe = Consumer({"bootstrap.servers": spec["bootstrap"], "group.id": spec["group"]})
        parts = probe.committed([TopicPartition(spec["topic"], p) for p in ends.last],
                                timeout=30)
        out["committed"] = sum(max(0, tp.offset) for tp in parts)
    # close() would wait for every queued commit (minutes); the process ends
    # instead, and the broker drops the unread requests with the connection.
    out["skip_close"] = True
    return out


def run_plain(spec: dict[str, Any]) -> dict[str, Any]:
    import struct

    import numpy as np
    import torch
    from confluent_kafka import Consumer, TopicPartition

    topic = spec["topic"]
    consumer = Consumer(_consumer_conf(spec, tuned=True))
    clock = Clock()
    consumer.subscribe([topic], on_assign=clock.on_assign)
    ends = Ends({int(p): e for p, e in spec["ends"].items()})
    # A ring of preallocated batches, as many as kfeed's pool holds by default.
    ring = [(np.empty((BATCH, FEATURES), np.float32), np.empty(BATCH, np.int64),
             np.empty(BATCH, np.int64)) for _ in range(4)]
    unpack = struct.Struct("<qq").unpack_from
    slot, rows, samples, id_sum = 0, 0, 0, 0
    feats, labels, ids = ring[0]
    position: dict[int, int] = {}
    last_commit = time.perf_counter()

    def deliver(n: int) -> None:
        nonlocal samples, id_sum
        batch = {"features": torch.from_numpy(feats[:n]), "label": torch.from_numpy(labels[:n]),
                 "id": torch.from_numpy(ids[:n])}
        samples += n
        id_sum += int(batch["id"].numpy().sum())

    while not ends.all():
        msgs = consumer.consume(CONSUME_N, CONSUME_TIMEOUT_S)
        for m in msgs:
            if m.error() is not None:
                ends.error(m)
                continue
            v = m.value()
            feats[rows] = np.frombuffer(v, np.float32, FEATURES)
            labels[rows], ids[rows] = unpack(v, 3072)
            rows += 1
            if rows == BATCH:
                deliver(rows)
                slot = (slot + 1) % len(ring)
                feats, labels, ids = ring[slot]
                rows = 0
            p, off = m.partition(), m.offset()
            position[p] = off + 1
            if off >= ends.last[p]:
                ends.done.add(p)
        now = time.perf_counter()
        if now - last_commit >= 1.0 and position:
            consumer.commit(offsets=[TopicPartition(topic, p, o) for p, o in position.items()],
                            asynchronous=True)
            last_commit = now
    if rows:
        deliver(rows)
    consumer.commit(offsets=[TopicPartition(topic, p, o) for p, o in position.items()],
                    asynchronous=False)
    out = clock.result(samples, id_sum=id_sum)
    consumer.close()
    return out


def run_kfeed(spec: dict[str, Any], fmt: str) -> dict[str, Any]:
    from kfeed import Loader
    from kfeed.cli import synthetic_schema
    from kfeed.sources import KafkaSource

    clock = Clock()

    class TimedSource(KafkaSource):
        def open(self, on_assign: Any, on_revoke: Any, assignment: Any) -> None:
            def timed(tps: Any) -> Any:
                clock.on_assign()
                return on_assign(tps)

            super().open(timed, on_revoke, assignment)

    config = {"bootstrap.servers": spec["bootstrap"], "group.id": spec["group"]}
    source = TimedSource(config, [spec["topic"]], bounded=True, connect_timeout=30.0)
    loader = Loader(config, spec["topic"], synthetic_schema(), BATCH, device="cpu", format=fmt,
                    until="end", start="earliest", source=source)
    samples, id_sum = 0, 0
    for batch in loader:
        assert batch["features"].shape[1] == FEATURES
        samples += batch.size
        id_sum += int(batch["id"].numpy().sum())
    out = clock.result(samples, id_sum=id_sum)
    out["stall_fraction"] = loader.stats()["stall_fraction"]
    loader.close()
    return out


def run_ceiling(spec: dict[str, Any]) -> dict[str, Any]:
    from confluent_kafka import Consumer

    consumer = Consumer(_consumer_conf(spec, tuned=True))
    clock = Clock()
    consumer.subscribe([spec["topic"]], on_assign=clock.on_assign)
    ends = Ends({int(p): e for p, e in spec["ends"].items()})
    total = sum(spec["ends"].values())
    messages = 0
    while not ends.all() and messages < total:
        msgs = consumer.consume(CONSUME_N, CONSUME_TIMEOUT_S)
        events = 0
        for m in msgs:
            if m.error() is not None:
                ends.error(m)
                events += 1
        messages += len(msgs) - events
    # Blocks at the end of a producer's chunk may hold fewer records.
    records = spec["samples"] if messages == total else messages * spec["records_per_message"]
    out = clock.result(records, messages=messages)
    consumer.close()
    return out


# -- producer contenders -----------------------------------------------------


def run_seeds_producer(spec: dict[str, Any], cols: dict[str, Any], rss: PeakRss,
                       compression: str | None) -> dict[str, Any]:
    from confluent_kafka import Producer

    conf: dict[str, Any] = {"bootstrap.servers": spec["bootstrap"], "batch.size": 16384,
                            "linger.ms": 10}
    if compression:
        conf["compression.type"] = compression
    producer = Producer(conf)
    failed: list[Any] = []

    def delivery_report(err: Any, msg: Any) -> None:
        if err is not None:
            failed.append(err)

    features, labels, ids = cols["features"], cols["label"], cols["id"]
    topic = spec["topic"]
    rss.start()
    t0 = time.perf_counter()
    for i in range(len(ids)):
        value = features[i].tobytes() + labels[i].tobytes() + ids[i].tobytes()
        while True:
            try:
                producer.produce(topic=topic, value=value, callback=delivery_report)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    left = producer.flush(120)
    seconds = time.perf_counter() - t0
    if left or failed:
        raise RuntimeError(f"{len(failed)} failed, {left} left")
    return {"samples": len(ids), "seconds": seconds, "wall": seconds}


def run_kfeed_producer(spec: dict[str, Any], cols: dict[str, Any], rss: PeakRss,
                       fmt: str) -> dict[str, Any]:
    from kfeed import Producer
    from kfeed.cli import synthetic_schema

    n = len(cols["id"])
    rss.start()
    t0 = time.perf_counter()
    with Producer({"bootstrap.servers": spec["bootstrap"]}, spec["topic"], synthetic_schema(),
                  format=fmt, block_records=BLOCK_RECORDS) as producer:
        step = 8192
        for i in range(0, n, step):
            producer.send({name: a[i:i + step] for name, a in cols.items()})
    seconds = time.perf_counter() - t0
    return {"samples": n, "seconds": seconds, "wall": seconds, "messages": producer.messages}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy  # noqa: F401 - imports before the memory baseline
    import torch  # noqa: F401

    import kfeed  # noqa: F401

    rss = PeakRss()
    kind = spec["kind"]
    if kind.startswith("p_"):
        cols = columns(spec["samples"])
        if kind == "p_seeds_zstd":
            out = run_seeds_producer(spec, cols, rss, "zstd")
        elif kind == "p_seeds":
            out = run_seeds_producer(spec, cols, rss, None)
        else:
            out = run_kfeed_producer(spec, cols, rss, "raw" if kind == "p_kfeed_raw" else "block")
    else:
        rss.start()
        if kind in ("seeds", "seeds_sync"):
            out = run_seeds(spec, sync=kind == "seeds_sync")
        elif kind == "plain":
            out = run_plain(spec)
        elif kind.startswith("kfeed_"):
            out = run_kfeed(spec, "raw" if kind.startswith("kfeed_raw") else "block")
        elif kind.startswith("ceiling_"):
            out = run_ceiling(spec)
        else:
            raise ValueError(kind)
    out["rss_mib"] = rss.growth_mib()
    if out.pop("skip_close", False):
        print(json.dumps(out), flush=True)
        os._exit(0)
    return out


# -- orchestration -----------------------------------------------------------


def run_child(spec: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    env = {**os.environ, **CHILD_ENV.get(spec["kind"], {})}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{spec['kind']} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def admin(bootstrap: str) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap})


def create_topics(bootstrap: str, names: list[str]) -> None:
    from confluent_kafka.admin import NewTopic

    a = admin(bootstrap)  # kept alive until the futures complete
    futures = a.create_topics(
        [NewTopic(t, num_partitions=PARTITIONS, replication_factor=1) for t in names])
    for f in futures.values():
        f.result(60)
    # The producers look the topics up at once; wait until metadata has them.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        md = a.list_topics(timeout=10).topics
        if all(t in md and md[t].error is None and len(md[t].partitions) == PARTITIONS
               for t in names):
            return
        time.sleep(0.2)
    raise RuntimeError("created topics did not appear in metadata")


def delete_topics(bootstrap: str, names: list[str]) -> None:
    try:
        a = admin(bootstrap)
        for f in a.delete_topics(names).values():
            f.result(60)
    except Exception as e:  # noqa: BLE001 - cleanup only
        print(f"warning: could not delete topics: {e}", file=sys.stderr)


def high_watermarks(bootstrap: str, topic: str) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-wm-{uuid.uuid4().hex}"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in range(PARTITIONS)}
    finally:
        c.close()


def kafka_version() -> str:
    try:
        from importlib import resources

        pom = resources.files("kfeed.cluster").joinpath("pom.xml").read_text()
        m = re.search(r"<kafka.version>([^<]+)</kafka.version>", pom)
        return m.group(1) if m else "?"
    except Exception:  # noqa: BLE001
        return "?"


def machine() -> str:
    import confluent_kafka
    import numpy as np
    import torch

    import kfeed

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    return (f"{os.cpu_count()} cores, {mem} memory, {model}; Python {platform.python_version()}, "
            f"Apache Kafka {kafka_version()} (1 node, same machine), "
            f"librdkafka {confluent_kafka.libversion()[0]}, confluent-kafka "
            f"{confluent_kafka.__version__}, torch {torch.__version__}, numpy {np.__version__}, "
            f"kfeed {getattr(kfeed, '__version__', '?')}")


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _rate(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["samples"] / r["seconds"] for r in runs)


def report(args: argparse.Namespace, command: str, consumers: dict[str, list[dict[str, Any]]],
           producers: dict[str, dict[str, Any]], info: str,
           loads: tuple[str, str]) -> tuple[str, bool]:
    lines: list[str] = []
    add = lines.append
    n = args.samples
    add(f"Machine: {info}.")
    add("")
    add(f"Workload: {n:,} samples of 3,088 bytes ({n * RECORD_BYTES / 1e6:,.0f} MB) per topic, "
        f"{PARTITIONS} partitions, batches of {BATCH} as CPU tensors; block topic: "
        f"{BLOCK_RECORDS} records per message. Medians of {args.repeat} run(s) per consumer, "
        "each in its own process with a fresh group; throughput counted from partition "
        "assignment to the last batch (wall includes the group join). MB/s = samples x 3,088 B. "
        f"Load average at start / end: {loads[0]} / {loads[1]}.")
    add("")
    add("Command (`make bench` starts a local 1-node Apache Kafka and runs it; "
        "`--write` records these tables here):")
    add("")
    add("```")
    add(command)
    add("```")
    add("")
    add("| consumer | samples/s | MB/s | wall (s) | peak RSS growth |")
    add("|---|---|---|---|---|")
    rates: dict[str, float] = {}
    for key, label, _kind in CONSUMERS:
        runs = consumers.get(key)
        if not runs:
            continue
        rate = rates[key] = _rate(runs)
        note = ""
        if key == "seeds_sync":
            note = f" (first {statistics.median(r['samples'] for r in runs):,.0f} samples)"
        add(f"| {label}{note} | {rate:,.0f} | {rate * RECORD_BYTES / 1e6:,.0f} "
            f"| {_med(runs, 'wall'):.2f} | {_med(runs, 'rss_mib'):,.0f} MiB |")
    if consumers.get("seeds") and "committed" in consumers["seeds"][0]:
        runs = consumers["seeds"]
        add("")
        add(f"The seeds loop's commit(msg) sends one OffsetCommit request per message; when "
            f"its loop ended, the broker had acknowledged "
            f"{statistics.median(r['committed'] / r['samples'] for r in runs):.1%} of them "
            "(median), the rest were still queued on the coordinator connection.")
    add("")
    add("| ratio (samples/s) | value | target |")
    add("|---|---|---|")
    missed = False
    for name, a, b, target in TARGETS:
        if a in rates and b in rates:
            r = rates[a] / rates[b]
            ok = r >= target
            missed |= not ok
            add(f"| {name} | {r:.2f}x | >= {target}x {'ok' if ok else 'MISSED'} |")
    for name, a, b in INFO_RATIOS:
        if a in rates and b in rates:
            add(f"| {name} | {rates[a] / rates[b]:.2f}x | (information) |")
    add("")
    add("| producer (runs once) | samples/s | MB/s | messages | peak RSS growth |")
    add("|---|---|---|---|---|")
    prates: dict[str, float] = {}
    for key, label, _kind in PRODUCERS:
        r = producers.get(key)
        if r is None:
            continue
        rate = prates[key] = r["samples"] / r["seconds"]
        msgs = r.get("messages", r["samples"])
        add(f"| {label} | {rate:,.0f} | {rate * RECORD_BYTES / 1e6:,.0f} | {msgs:,} "
            f"| {r['rss_mib']:,.0f} MiB |")
    if "p_kfeed_block" in prates and "p_seeds_zstd" in prates:
        add("")
        add(f"kfeed.Producer block vs the seeds' producer loop (zstd): "
            f"{prates['p_kfeed_block'] / prates['p_seeds_zstd']:.2f}x; "
            f"vs the same loop without compression: "
            f"{prates['p_kfeed_block'] / prates['p_seeds']:.2f}x; kfeed raw vs the seeds' loop "
            f"without compression: {prates['p_kfeed_raw'] / prates['p_seeds']:.2f}x.")
    return "\n".join(lines) + "\n", missed


def write_section(body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# kfeed benchmark results\n"
    section = f"{SECTION}\n\n{body}"
    start = text.find(SECTION + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("" if nxt < 0 else "\n" + text[nxt + 1:])
    RESULTS.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--bootstrap", default=os.environ.get("KFEED_BOOTSTRAP"),
                   help="host:port,... (default: $KFEED_BOOTSTRAP)")
    p.add_argument("--samples", type=int, default=None, help="samples per topic (default 200000)")
    p.add_argument("--repeat", type=int, default=None, help="runs per consumer (default 3)")
    p.add_argument("--quick", action="store_true", help="50,000 samples, one run")
    p.add_argument("--sync-seconds", type=float, default=None,
                   help="time cap of one run of the seeds loop with synchronous commits "
                        "(default 15, --quick 5)")
    p.add_argument("--only", default=None,
                   help="comma-separated consumer keys to run (skips the producer table)")
    p.add_argument("--write", action="store_true", help=f"write the tables into {RESULTS.name}")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if not args.bootstrap:
        p.error("no broker: set KFEED_BOOTSTRAP or pass --bootstrap")
    args.samples = args.samples or (50_000 if args.quick else 200_000)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.sync_seconds = args.sync_seconds or (5.0 if args.quick else 15.0)
    command = "python bench/bench_loader.py " + " ".join(
        a for a in sys.argv[1:] if a != "--write")
    command = command.rstrip()
    info = machine()
    print(f"machine: {info}", flush=True)
    load0 = _load()
    run = uuid.uuid4().hex[:12]
    topics = {kind: f"kfeed-bench-{kind}-{run}" for kind in ("raw", "block", "seeds_zstd", "seeds")}
    only = set(args.only.split(",")) if args.only else None
    create_topics(args.bootstrap, list(topics.values()))
    base = {"bootstrap": args.bootstrap, "samples": args.samples}
    consumers: dict[str, list[dict[str, Any]]] = {}
    producers: dict[str, dict[str, Any]] = {}
    try:
        for key, _label, kind in PRODUCERS:
            if only is not None and key not in ("p_kfeed_raw", "p_kfeed_block"):
                continue
            r = producers[key] = run_child({**base, "kind": key, "topic": topics[kind]})
            print(f"{key:14s} {r['samples'] / r['seconds']:>10,.0f} samples/s  "
                  f"{r['rss_mib']:6.0f} MiB", flush=True)
        if only is not None:
            producers = {}
        ends = {kind: high_watermarks(args.bootstrap, topics[kind]) for kind in ("raw", "block")}
        per_msg = {"raw": 1, "block": BLOCK_RECORDS}
        for i in range(args.repeat):
            for key, _label, kind in CONSUMERS:
                if only is not None and key not in only:
                    continue
                spec = {**base, "kind": key, "topic": topics[kind], "ends": ends[kind],
                        "records_per_message": per_msg[kind],
                        "group": f"kfeed-bench-{key}-{uuid.uuid4().hex}"}
                if key == "seeds_sync":
                    spec["time_limit"] = args.sync_seconds
                r = run_child(spec)
                expected = args.samples if key != "seeds_sync" else r["samples"]
                if r["samples"] != expected or r.get("id_sum", expected * (expected - 1) // 2) \
                        != expected * (expected - 1) // 2:
                    raise RuntimeError(f"{key} delivered {r['samples']} samples "
                                       f"(id sum {r.get('id_sum')}), expected {expected}")
                consumers.setdefault(key, []).append(r)
                print(f"run {i + 1}/{args.repeat} {key:14s} {r['samples'] / r['seconds']:>10,.0f} "
                      f"samples/s  wall {r['wall']:6.2f} s  {r['rss_mib']:6.0f} MiB", flush=True)
    finally:
        delete_topics(args.bootstrap, list(topics.values()))
    body, missed = report(args, command, consumers, producers, info, (load0, _load()))
    print()
    print(body)
    if args.write:
        write_section(body)
        print(f"wrote the section '{SECTION[3:]}' of {RESULTS}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
