"""Loader and producer throughput against a real broker, each against named baselines;
compression per codec; end-to-end latency.

Runs against the broker that ``$KFEED_BOOTSTRAP`` (or ``--bootstrap``) names,
on fresh uuid topics (4 partitions, replication factor 1) that it deletes at
the end. Every contender reads or writes the same topics in the same run.
Workloads:

- ``features``: the seeds' sample, 768 float32 features, an int64 label and
  an int64 id (3,088 bytes), as ``kfeed produce --synthetic`` makes them,
  ``--samples`` of them (default 200,000; ``--quick``: 50,000 and one repeat);
- ``small``: 12 float32 features, an int64 label and an int64 id (64 bytes),
  ``--small-samples`` of them (default 1,000,000; ``--quick``: 200,000), to
  show what each contender pays per message;
- ``normal``: the features' layout with standard-normal values, and
  ``tokens``: 768 int32 token ids (Zipf, s = 1.0, over a 50,257-id
  vocabulary) and an int64 id (3,080 bytes), for the compression table
  (``--codec-samples`` per topic, default 100,000; ``--quick``: 25,000);
- ``stamped``: 768 float32 features, an int64 id and an int64 send time
  (3,088 bytes), for the latency runs.

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
  too, for at most ``--sync-seconds`` a run, because it is far slower. On the
  small topic the seeds loop runs for at most ``--cap-seconds``.
- ``plain consume loop``: a careful confluent-kafka loop on the raw topic with
  kfeed's consumer settings: ``consume(2048)``, a numpy copy per message into
  a preallocated batch, ``torch.from_numpy`` per batch, an asynchronous commit
  once a second.
- ``kafka-python``: the pure-Python client's ``KafkaConsumer.poll(max_records=
  2048)``, a numpy copy per message, ``np.stack`` per 256, an asynchronous
  commit once a second; with ``check_crcs=False``, and with the client's
  defaults (a pure-Python CRC32C check of every batch unless the ``crc32c``
  extension is installed) for at most ``--cap-seconds``. Skipped, with a line
  saying so, when kafka-python is not installed.
- ``kfeed Loader raw`` / ``kfeed Loader block``: ``kfeed.Loader(format=...,
  until="end", device="cpu")`` on the raw topic and on the block topic
  (64 records per message, written by ``kfeed.Producer``). The same two again
  with ``OMP_NUM_THREADS=1`` (information only): on the CPU the loader copies
  each batch, and torch's intra-op thread pool contends for the cores with
  the loader's thread and librdkafka.
- ``ceiling``: ``consume(2048)`` of the same topics with kfeed's consumer
  settings, touching nothing but ``error()`` (records = messages x records per
  message). Nothing Python-side can beat it.
- ``Java ConsumerPerformance``: Kafka's own consumer benchmark
  (``org.apache.kafka.tools.ConsumerPerformance``, the class behind
  ``kafka-consumer-perf-test``) with the Java client's defaults, from the
  jars ``kfeed cluster`` runs the broker with; its ``fetch.*`` figures, which
  leave the group join out.
- ``kcat``: ``kcat -C -e`` from the beginning to the end of each topic,
  librdkafka with its defaults and no Python, one byte printed per message;
  its wall time (start and connections included). Skipped when kcat is not
  on PATH (``make bench`` installs it with apt-get where it can).

Producer side: the seeds' producer loop (one ``produce`` per sample with a
delivery callback, zstd as the seeds configure it, and without compression)
against ``kfeed.Producer`` (raw and block) and Kafka's
``ProducerPerformance`` (``kafka-producer-perf-test``; payloads from a file of
random letters, acks=all, linger.ms=5, batch.size=1 MiB as kfeed.Producer),
once with 3,088-byte records and once with records of one block's size. Each
producer runs once.

Compression: ``kfeed.Producer(format="block", compression=codec)`` for none,
lz4, zstd and snappy (librdkafka's default level of each) on the features, the
normal features and the tokens, the bytes each topic then holds on the broker
(its segment files under ``--cluster-dir`` / ``$KFEED_CLUSTER_DIR`` when given,
else Kafka's ``LogDirsCommand``), and the kfeed Loader (block) reading each
topic.

Latency: the time from a sample's ``time.time_ns()`` stamp, taken by the
producer just before ``send()``, to the moment ``next(loader)`` returns its
batch in the reading process (both CLOCK_REALTIME on the same machine). For
each batch, the newest sample's latency (the pipeline: producer, broker,
fetch, decode, copy) and the oldest sample's (that plus the time the batch
took to fill); percentiles over batches. (a) Fixed offered loads: a paced
``kfeed.Producer`` process sends 50,000 and 10,000 samples/s (50 per
``send()``) while a streaming loader (``until=None``, ``max_wait_ms=5``)
reads, for ``--latency-seconds`` (default 10, ``--quick`` 4); the first
second is left out. The baseline reads the same stream with ``consume(32,
5 ms)`` and kfeed's decode, each call's records taken as one batch, no
Loader. (b) Saturation: a topic filled beforehand, read as fast as possible;
the latency is then the time the samples queued in Kafka.

Each contender runs in its own subprocess, so its peak RSS growth is its own
(``VmHWM`` reset through ``/proc/self/clear_refs`` after imports and input
generation) and no librdkafka state leaks between contenders. Throughput is
counted from the moment the group assigns the partitions to the last batch;
the wall time including the group join is reported beside it. Consumer runs
are interleaved across repeats; the tables give medians. The capped runs (the
seeds loop with synchronous commits, kafka-python with its defaults) run in
the first repeat only.

    python bench/bench_loader.py [--samples N] [--repeat R] [--quick] [--write]

``--quick`` is a smoke run: at 50,000 samples the block topic holds 782
messages and the start-up dominates, so its ratios are not the targets' figures.

Exit status: 0, or 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).parent))
import perf_tools  # noqa: E402

RECORD_BYTES = 3088
FEATURES = 768
SMALL_FEATURES = 12
TOKENS = 768
BLOCK_RECORDS = 64
PARTITIONS = 4
BATCH = 256
CONSUME_N = 2048
CONSUME_TIMEOUT_S = 0.1
CODECS = ("none", "lz4", "zstd", "snappy")
CODEC_DATA = ("features", "normal", "tokens")
# Latency at fixed offered loads: LAT_CHUNK samples per send(), LAT_RATE and
# LAT_RATE_LOW a second.
LAT_RATE = 50_000
LAT_RATE_LOW = 10_000
LAT_CHUNK = 50
LAT_MAX_WAIT_MS = 5.0
LAT_WARMUP_S = 1.0
# The latency producer's linger: librdkafka's default (5 ms), which kfeed.Producer keeps.
LAT_LINGER_MS = 5
SEEDS_P99_MS = 5.0
SECTION = "## Loader throughput (local 1-node Kafka)"
SECTION_CODECS = "## Compression (local 1-node Kafka)"
SECTION_LATENCY = "## End-to-end latency (local 1-node Kafka)"
RESULTS = Path(__file__).with_name("RESULTS.md")


class Workload(NamedTuple):
    record_bytes: int
    text: str


WORKLOADS = {
    "features": Workload(3088, "768 float32 + int64 label + int64 id"),
    "small": Workload(64, "12 float32 + int64 label + int64 id"),
    "normal": Workload(3088, "768 float32 standard normal + int64 label + int64 id"),
    "tokens": Workload(3080, "768 int32 Zipf token ids + int64 id"),
    "stamped": Workload(3088, "768 float32 + int64 id + int64 send time"),
}


class Topic(NamedTuple):
    workload: str
    fmt: str
    codec: str = "none"


def codec_topic(data: str, codec: str) -> str:
    """The topic kind of one cell of the compression table."""
    return f"{data}_{codec}"


TOPICS: dict[str, Topic] = {
    "raw": Topic("features", "raw"),
    "block": Topic("features", "block"),
    "seeds_zstd": Topic("features", "raw", "zstd"),
    "seeds": Topic("features", "raw"),
    # Written by ProducerPerformance: random letters of the features' sizes.
    "java_raw": Topic("features", "raw"),
    "java_block": Topic("features", "block"),
    "small_raw": Topic("small", "raw"),
    "small_block": Topic("small", "block"),
    **{codec_topic(d, c): Topic(d, "block", c) for d in CODEC_DATA for c in CODECS},
    **{key: Topic("stamped", "raw" if "raw" in key else "block")
       for key in ("lat_plain", "lat_block", "lat_plain_low", "lat_block_low", "lat_raw_low",
                   "sat_block")},
}


class Run(NamedTuple):
    """One contender: a table row, the topic it reads or writes, how it runs."""

    key: str
    label: str
    topic: str
    runner: str
    options: dict[str, Any] | None = None  # extra child spec: env, cap, sync, check_crcs, mode


# Options: "env" for the child process; "cap" names the argument that caps a run's
# seconds; "once": only in the first repeat (capped runs, information only).
ONE_THREAD = {"env": {"OMP_NUM_THREADS": "1"}}
CONSUMERS: list[Run] = [
    Run("seeds", "seeds loop: poll(1.0) + commit(msg) per message (async, the default)",
        "raw", "seeds"),
    Run("seeds_sync", "seeds loop with commit(msg, asynchronous=False)", "raw", "seeds",
        {"sync": True, "cap": "sync_seconds", "once": True}),
    Run("plain", "plain consume loop: consume(2048) + numpy copy per message", "raw", "plain"),
    Run("kp", "kafka-python: poll(2048) + numpy copy per message, check_crcs=False", "raw",
        "kafka_python", {"check_crcs": False}),
    Run("kp_crc", "kafka-python with its defaults (CRC32C checked in pure Python)", "raw",
        "kafka_python", {"check_crcs": True, "cap": "cap_seconds", "once": True}),
    Run("kfeed_raw", "kfeed Loader, format=raw", "raw", "kfeed"),
    Run("kfeed_block", "kfeed Loader, format=block (64/message)", "block", "kfeed"),
    Run("kfeed_raw_1t", "kfeed Loader, format=raw, OMP_NUM_THREADS=1", "raw", "kfeed", ONE_THREAD),
    Run("kfeed_block_1t", "kfeed Loader, format=block, OMP_NUM_THREADS=1", "block", "kfeed",
        ONE_THREAD),
    Run("ceiling_raw", "ceiling: consume(2048), raw topic, touching nothing", "raw", "ceiling"),
    Run("ceiling_block", "ceiling: consume(2048), block topic, touching nothing", "block",
        "ceiling"),
    Run("kcat_raw", "kcat -C (librdkafka defaults, no Python; wall incl. start), raw topic",
        "raw", "kcat"),
    Run("kcat_block", "kcat -C (librdkafka defaults, no Python; wall incl. start), block topic",
        "block", "kcat"),
    Run("java_raw", "Java ConsumerPerformance (Kafka's tool), raw topic", "raw", "java"),
    Run("java_block", "Java ConsumerPerformance (Kafka's tool), block topic", "block", "java"),
]
SMALL_CONSUMERS: list[Run] = [
    Run("small_seeds", "seeds loop: poll(1.0) + commit(msg) per message (async)", "small_raw",
        "seeds", {"cap": "cap_seconds"}),
    Run("small_plain", "plain consume loop: consume(2048) + numpy copy per message",
        "small_raw", "plain"),
    Run("small_kfeed_raw", "kfeed Loader, format=raw", "small_raw", "kfeed"),
    Run("small_kfeed_block", "kfeed Loader, format=block (64/message)", "small_block", "kfeed"),
    Run("small_ceiling_raw", "ceiling: consume(2048), raw topic, touching nothing", "small_raw",
        "ceiling"),
]
CODEC_CONSUMERS: list[Run] = [
    Run(f"c_{d}_{c}", f"kfeed Loader, format=block, {d}, {c}", codec_topic(d, c), "kfeed")
    for d in CODEC_DATA for c in CODECS
]
ALL_CONSUMERS = CONSUMERS + SMALL_CONSUMERS + CODEC_CONSUMERS
BASELINE = "baseline: consume(32, 5 ms) + kfeed's decode, each call a batch, no Loader (block)"


def _fixed(key: str, label: str, runner: str, rate: int) -> Run:
    return Run(key, label, key, runner, {"mode": "fixed", "rate": rate})


# Each latency run has a topic of its own, named by its key (see TOPICS).
LATENCY: list[Run] = [
    _fixed("lat_plain", BASELINE, "latency_plain", LAT_RATE),
    _fixed("lat_block", "kfeed Loader, block (50 samples per message)", "latency", LAT_RATE),
    _fixed("lat_plain_low", BASELINE, "latency_plain", LAT_RATE_LOW),
    _fixed("lat_block_low", "kfeed Loader, block (50 samples per message)", "latency",
           LAT_RATE_LOW),
    _fixed("lat_raw_low", "kfeed Loader, raw", "latency", LAT_RATE_LOW),
    Run("sat_block", "saturation (pre-filled), kfeed Loader, block", "sat_block", "latency",
        {"mode": "saturation"}),
]

# ratio name -> (numerator, denominator, target)
TARGETS = [
    ("kfeed block vs seeds loop", "kfeed_block", "seeds", 5.0),
    ("kfeed block vs block ceiling", "kfeed_block", "ceiling_block", 0.8),
    ("kfeed raw vs seeds loop", "kfeed_raw", "seeds", 1.5),
]
INFO_RATIOS = [
    ("kfeed raw vs plain consume loop", "kfeed_raw", "plain"),
    ("kfeed raw vs kafka-python (check_crcs=False)", "kfeed_raw", "kp"),
    ("kfeed block vs kafka-python (check_crcs=False)", "kfeed_block", "kp"),
    ("kfeed block, OMP_NUM_THREADS=1, vs block ceiling", "kfeed_block_1t", "ceiling_block"),
    ("kfeed block, OMP_NUM_THREADS=1, vs seeds loop", "kfeed_block_1t", "seeds"),
    ("kfeed raw, OMP_NUM_THREADS=1, vs plain consume loop", "kfeed_raw_1t", "plain"),
    ("kfeed raw vs raw ceiling", "kfeed_raw", "ceiling_raw"),
    ("kfeed raw vs kcat, raw topic", "kfeed_raw", "kcat_raw"),
    ("kfeed block vs kcat, block topic", "kfeed_block", "kcat_block"),
    ("kfeed raw vs Java ConsumerPerformance, raw topic", "kfeed_raw", "java_raw"),
    ("kfeed block vs Java ConsumerPerformance, block topic", "kfeed_block", "java_block"),
    ("plain consume loop vs seeds loop", "plain", "seeds"),
    ("kafka-python (check_crcs=False) vs seeds loop", "kp", "seeds"),
    ("seeds loop (async commit) vs seeds loop (sync commit)", "seeds", "seeds_sync"),
]
SMALL_RATIOS = [
    ("kfeed block vs seeds loop", "small_kfeed_block", "small_seeds"),
    ("kfeed raw vs seeds loop", "small_kfeed_raw", "small_seeds"),
    ("kfeed raw vs plain consume loop", "small_kfeed_raw", "small_plain"),
    ("kfeed block vs plain consume loop", "small_kfeed_block", "small_plain"),
    ("kfeed raw vs raw ceiling", "small_kfeed_raw", "small_ceiling_raw"),
    ("kfeed block vs raw ceiling", "small_kfeed_block", "small_ceiling_raw"),
]

PRODUCERS: list[Run] = [
    Run("p_seeds_zstd", "seeds producer loop: produce() per sample + callback, zstd",
        "seeds_zstd", "p_seeds"),
    Run("p_seeds", "seeds producer loop, no compression", "seeds", "p_seeds"),
    Run("p_kfeed_raw", "kfeed.Producer, format=raw", "raw", "p_kfeed"),
    Run("p_kfeed_block", "kfeed.Producer, format=block (64/message)", "block", "p_kfeed"),
    Run("p_java_raw", "Java ProducerPerformance (Kafka's tool), 3,088-byte records", "java_raw",
        "p_java"),
    Run("p_java_block", "Java ProducerPerformance, records of one block's size (64 samples)",
        "java_block", "p_java"),
]
SMALL_PRODUCERS: list[Run] = [
    Run("p_small_raw", "kfeed.Producer, format=raw", "small_raw", "p_kfeed"),
    Run("p_small_block", "kfeed.Producer, format=block (64/message)", "small_block", "p_kfeed"),
]
CODEC_PRODUCERS: list[Run] = [
    Run(f"p_{d}_{c}", f"kfeed.Producer, format=block, {d}, {c}", codec_topic(d, c), "p_kfeed")
    for d in CODEC_DATA for c in CODECS
]
ALL_PRODUCERS = PRODUCERS + SMALL_PRODUCERS + CODEC_PRODUCERS
CODEC_KINDS = {codec_topic(d, c) for d in CODEC_DATA for c in CODECS}


def codec_keys(data: str, codec: str) -> tuple[str, str]:
    """(producer key, consumer key) of one cell of the compression table."""
    return f"p_{data}_{codec}", f"c_{data}_{codec}"


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


def schema_of(workload: str) -> Any:
    from kfeed import Schema
    from kfeed.synthetic import synthetic_schema

    if workload in ("features", "normal"):
        return synthetic_schema()
    if workload == "small":
        return Schema({"features": ("float32", (SMALL_FEATURES,)), "label": ("int64", ()),
                       "id": ("int64", ())})
    if workload == "tokens":
        return Schema({"tokens": ("int32", (TOKENS,)), "id": ("int64", ())})
    if workload == "stamped":
        return Schema({"features": ("float32", (FEATURES,)), "id": ("int64", ()),
                       "sent_ns": ("int64", ())})
    raise ValueError(workload)


def chunk_columns(ids: Any, workload: str) -> dict[str, Any]:
    """The samples with these ids; each depends on its id alone (tokens: on the chunk)."""
    import numpy as np

    from kfeed.synthetic import synthetic_columns

    if workload == "normal":
        rng = np.random.default_rng([11, int(ids[0]) if len(ids) else 0])
        features = rng.standard_normal((len(ids), FEATURES), dtype=np.float32)
        return {"features": features, "label": features[:, :10].argmax(axis=1).astype(np.int64),
                "id": ids}
    if workload in ("features", "stamped"):
        cols = synthetic_columns(ids)
        if workload == "stamped":
            cols = {"features": cols["features"], "id": cols["id"],
                    "sent_ns": np.zeros(len(ids), np.int64)}
        return cols
    if workload == "small":
        # kfeed produce --synthetic's formula, 12 features wide.
        mixed = (ids[:, None] * 2654435761 + np.arange(SMALL_FEATURES) * 40503) % 65521
        features = (mixed.astype(np.float32) / 65521.0) - 0.5
        return {"features": features, "label": features.argmax(axis=1).astype(np.int64),
                "id": ids}
    if workload == "tokens":
        return {"tokens": perf_tools.zipf_tokens(ids, TOKENS), "id": ids}
    raise ValueError(workload)


def columns(n: int, workload: str = "features") -> dict[str, Any]:
    """``n`` samples of a workload, built in chunks to bound memory."""
    import numpy as np

    out = schema_of(workload).empty(n)
    step = 8192
    for i in range(0, n, step):
        chunk = chunk_columns(np.arange(i, min(n, i + step), dtype=np.int64), workload)
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


# Consumers whose close would wait for a backlog of commits: never freed, the
# child process ends with os._exit instead.
_KEEP_UNCLOSED: list[Any] = []


def run_seeds(spec: dict[str, Any], sync: bool) -> dict[str, Any]:
    import warnings

    import numpy as np
    import torch
    from confluent_kafka import Consumer, TopicPartition

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    limit = spec.get("time_limit")
    dims = spec["dims"]
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
            features = np.frombuffer(data, dtype="float32", count=dims)
            label = torch.tensor(np.frombuffer(data, dtype="int64", count=1,
                                               offset=4 * dims)[0]).long()
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
        assert features.shape == (len(batch), dims) and labels.shape == (len(batch),)
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
        _KEEP_UNCLOSED.append(probe)
    # close() would wait for every queued commit (minutes); the process ends
    # instead, and the broker drops the unread requests with the connection.
    # The consumer is kept referenced until then: freeing it closes it too.
    _KEEP_UNCLOSED.append(consumer)
    out["skip_close"] = True
    return out


def run_plain(spec: dict[str, Any]) -> dict[str, Any]:
    import struct

    import numpy as np
    import torch
    from confluent_kafka import Consumer, TopicPartition

    topic, dims = spec["topic"], spec["dims"]
    consumer = Consumer(_consumer_conf(spec, tuned=True))
    clock = Clock()
    consumer.subscribe([topic], on_assign=clock.on_assign)
    ends = Ends({int(p): e for p, e in spec["ends"].items()})
    # A ring of preallocated batches, as many as kfeed's pool holds by default.
    ring = [(np.empty((BATCH, dims), np.float32), np.empty(BATCH, np.int64),
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
            feats[rows] = np.frombuffer(v, np.float32, dims)
            labels[rows], ids[rows] = unpack(v, 4 * dims)
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


def hooked_source(spec: dict[str, Any], bounded: bool, hook: Any) -> tuple[dict[str, Any], Any]:
    """The Loader's Kafka source, calling ``hook()`` whenever partitions are assigned."""
    from kfeed.sources import KafkaSource

    class HookedSource(KafkaSource):
        def open(self, on_assign: Any, on_revoke: Any, assignment: Any) -> None:
            def hooked(tps: Any) -> Any:
                hook()
                return on_assign(tps)

            super().open(hooked, on_revoke, assignment)

    config = {"bootstrap.servers": spec["bootstrap"], "group.id": spec["group"]}
    return config, HookedSource(config, [spec["topic"]], ends=bounded, connect_timeout=30.0)


def run_kfeed(spec: dict[str, Any]) -> dict[str, Any]:
    from kfeed import Loader

    clock = Clock()
    config, source = hooked_source(spec, True, clock.on_assign)
    loader = Loader(config, spec["topic"], schema_of(spec["workload"]), BATCH, device="cpu",
                    format=spec["fmt"], until="end", start="earliest", source=source)
    samples, id_sum = 0, 0
    for batch in loader:
        assert len(batch["id"]) == batch.size
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


def run_kafka_python(spec: dict[str, Any]) -> dict[str, Any]:
    import struct

    import numpy as np
    import torch
    from kafka import ConsumerRebalanceListener, KafkaConsumer, OffsetAndMetadata, TopicPartition

    topic, dims, limit = spec["topic"], spec["dims"], spec.get("time_limit")
    clock = Clock()

    class Listener(ConsumerRebalanceListener):
        def on_partitions_assigned(self, assigned: Any) -> None:
            clock.on_assign()

        def on_partitions_revoked(self, revoked: Any) -> None:
            pass

    consumer = KafkaConsumer(bootstrap_servers=spec["bootstrap"], group_id=spec["group"],
                             auto_offset_reset="earliest", enable_auto_commit=False,
                             max_poll_records=CONSUME_N, check_crcs=spec["check_crcs"])
    consumer.subscribe([topic], listener=Listener())
    ends = Ends({int(p): e for p, e in spec["ends"].items()})
    unpack = struct.Struct("<qq").unpack_from
    rows: list[Any] = []
    labels: list[int] = []
    ids: list[int] = []
    samples, id_sum = 0, 0
    position: dict[int, int] = {}
    last_commit = time.perf_counter()

    def deliver() -> None:
        nonlocal samples, id_sum
        batch = {"features": torch.from_numpy(np.stack(rows)),
                 "label": torch.tensor(labels), "id": torch.tensor(ids)}
        samples += len(rows)
        id_sum += int(batch["id"].sum())
        rows.clear(), labels.clear(), ids.clear()

    def offsets() -> dict[Any, Any]:
        return {TopicPartition(topic, p): OffsetAndMetadata(o, "", -1)
                for p, o in position.items()}

    while not ends.all():
        for tp, msgs in consumer.poll(timeout_ms=100, max_records=CONSUME_N).items():
            for m in msgs:
                v = m.value
                rows.append(np.frombuffer(v, np.float32, dims).copy())
                label, sample_id = unpack(v, 4 * dims)
                labels.append(label)
                ids.append(sample_id)
                if len(rows) == BATCH:
                    deliver()
            p, off = tp.partition, msgs[-1].offset
            position[p] = off + 1
            if off >= ends.last[p]:
                ends.done.add(p)
        now = time.perf_counter()
        if now - last_commit >= 1.0 and position:
            consumer.commit_async(offsets())
            last_commit = now
        if limit is not None and clock.assigned is not None and now - clock.assigned >= limit:
            break
    if rows:
        deliver()
    capped = not ends.all()
    out = clock.result(samples, capped=capped, **({} if capped else {"id_sum": id_sum}))
    consumer.commit(offsets())
    consumer.close()
    return out


class Paced:
    """The paced producer process of a fixed-load latency run, started at most once."""

    def __init__(self, spec: dict[str, Any] | None) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[str] | None = None

    def start(self, *_args: Any) -> None:
        # Called on assignment: the producer starts once the reader holds the
        # partitions, so no sample waits for the group join.
        if self.spec is not None and self.proc is None:
            self.proc = child_process(self.spec, stderr=None)
            threading.Thread(target=_fail_with, args=(self.proc,), daemon=True).start()

    def report(self) -> dict[str, Any] | None:
        if self.proc is None:
            return None
        text, _ = self.proc.communicate(timeout=120)
        return json.loads(text.strip().splitlines()[-1])


class Latencies:
    """Per handed-out batch: the latency of its newest and of its oldest sample."""

    def __init__(self, warmup_ids: int) -> None:
        self.warm = warmup_ids
        self.newest: list[int] = []
        self.oldest: list[int] = []
        self.rows: list[int] = []
        self.samples = self.id_sum = 0
        self.first = self.last = 0.0

    def add(self, now_ns: int, sent: Any, ids: Any) -> None:
        self.samples += len(ids)
        self.id_sum += int(ids.sum())
        if len(ids) and ids.min() >= self.warm:
            self.newest.append(now_ns - int(sent.max()))
            self.oldest.append(now_ns - int(sent.min()))
            self.rows.append(len(ids))
            self.last = time.perf_counter()
            self.first = self.first or self.last

    def result(self, producer: dict[str, Any] | None) -> dict[str, Any]:
        import numpy as np

        span = self.last - self.first
        out: dict[str, Any] = {"samples": self.samples, "id_sum": self.id_sum,
                               "batches": len(self.rows),
                               "rows_mean": float(np.mean(self.rows)) if self.rows else 0.0,
                               "rate": sum(self.rows) / span if span > 0 else math.nan,
                               "producer": producer}
        for name, values in (("newest", self.newest), ("oldest", self.oldest)):
            ms = np.asarray(values, np.float64) / 1e6
            out[name] = [*perf_tools.percentiles(ms), float(ms.max()) if len(ms) else math.nan]
        return out


def run_latency(spec: dict[str, Any]) -> dict[str, Any]:
    """Latency per batch, from each sample's send stamp to ``next(loader)`` returning."""
    from kfeed import Loader

    fixed = spec["mode"] == "fixed"
    paced = Paced(spec.get("producer"))
    config, source = hooked_source(spec, not fixed, paced.start)
    loader = Loader(config, spec["topic"], schema_of("stamped"), BATCH, device="cpu",
                    format=spec["fmt"], until=None if fixed else "end", start="earliest",
                    max_wait_ms=spec["max_wait_ms"], source=source)
    lat = Latencies(spec["warmup_ids"])
    for batch in loader:
        lat.add(time.time_ns(), batch["sent_ns"].numpy(), batch["id"].numpy())
        if fixed and lat.samples >= spec["samples"]:
            break
    loader.close()
    return lat.result(paced.report())


def run_latency_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """The baseline: consume() with kfeed's consumer settings and the loader's wait, each
    call's messages decoded with kfeed's codec and taken as one batch; no loader thread,
    pool or copy."""
    from confluent_kafka import Consumer

    schema = schema_of("stamped")
    per = records_per_message(spec["fmt"])
    out = schema.empty(CONSUME_N)
    target = schema.bind(out)
    consumer = Consumer(_consumer_conf(spec, tuned=True))
    paced = Paced(spec["producer"])
    consumer.subscribe([spec["topic"]], on_assign=paced.start)
    lat = Latencies(spec["warmup_ids"])
    timeout = spec["max_wait_ms"] / 1000
    while lat.samples < spec["samples"]:
        msgs = consumer.consume(CONSUME_N // per, timeout)
        now = time.time_ns()
        vals = [m.value() for m in msgs if m.error() is None]
        if vals:
            rows = schema.decode_into(vals, target, 0, spec["fmt"]).rows
            lat.add(now, out["sent_ns"][:rows], out["id"][:rows])
    consumer.close()
    return lat.result(paced.report())


def _fail_with(proc: subprocess.Popen[str]) -> None:
    """Ends this process when a helper process fails (the streaming loader would wait forever)."""
    if proc.wait() != 0:
        print(f"helper process failed (exit {proc.returncode})", file=sys.stderr, flush=True)
        os._exit(3)


# -- producer contenders -----------------------------------------------------


def run_seeds_producer(spec: dict[str, Any], cols: dict[str, Any],
                       rss: PeakRss) -> dict[str, Any]:
    from confluent_kafka import Producer

    conf: dict[str, Any] = {"bootstrap.servers": spec["bootstrap"], "batch.size": 16384,
                            "linger.ms": 10, "compression.type": spec["codec"]}
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


def run_kfeed_producer(spec: dict[str, Any], cols: dict[str, Any],
                       rss: PeakRss) -> dict[str, Any]:
    from kfeed import Producer

    n = len(cols["id"])
    codec = None if spec["codec"] == "none" else spec["codec"]
    rss.start()
    t0 = time.perf_counter()
    with Producer({"bootstrap.servers": spec["bootstrap"]}, spec["topic"],
                  schema_of(spec["workload"]), format=spec["fmt"], block_records=BLOCK_RECORDS,
                  compression=codec) as producer:
        step = 8192
        for i in range(0, n, step):
            producer.send({name: a[i:i + step] for name, a in cols.items()})
    seconds = time.perf_counter() - t0
    return {"samples": n, "seconds": seconds, "wall": seconds, "messages": producer.messages,
            "value_bytes": producer.bytes}


def run_paced(spec: dict[str, Any]) -> dict[str, Any]:
    """``kfeed.Producer`` sending stamped samples, ``chunk`` per send, at ``rate`` a second
    (0: as fast as it can)."""
    import numpy as np

    from kfeed import Producer

    n, rate, chunk = spec["samples"], spec["rate"], spec["chunk"]
    features = columns(chunk, "stamped")["features"]
    conf = {"bootstrap.servers": spec["bootstrap"], "linger.ms": spec["linger_ms"]}
    behind = 0.0
    sent = 0
    with Producer(conf, spec["topic"], schema_of("stamped"), format=spec["fmt"],
                  block_records=BLOCK_RECORDS) as producer:
        t0 = time.perf_counter()
        while sent < n:
            k = min(chunk, n - sent)
            if rate:
                wait = t0 + sent / rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                else:
                    behind = max(behind, -wait)
            producer.send({"features": features[:k],
                           "id": np.arange(sent, sent + k, dtype=np.int64),
                           "sent_ns": np.full(k, time.time_ns(), np.int64)})
            sent += k
        seconds = time.perf_counter() - t0
    return {"samples": sent, "seconds": seconds, "rate": sent / seconds,
            "behind_ms": behind * 1e3}





def child(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy  # noqa: F401 - imports before the memory baseline
    import torch  # noqa: F401

    import kfeed  # noqa: F401

    rss = PeakRss()
    runner = spec["runner"]
    if runner in ("p_seeds", "p_kfeed"):
        cols = columns(spec["samples"], spec["workload"])
        out = (run_seeds_producer if runner == "p_seeds" else run_kfeed_producer)(spec, cols, rss)
    else:
        runners = {"plain": run_plain, "kfeed": run_kfeed, "ceiling": run_ceiling,
                   "kafka_python": run_kafka_python, "latency": run_latency,
                   "latency_plain": run_latency_plain, "paced": run_paced,
                   "seeds": lambda s: run_seeds(s, sync=s.get("sync", False))}
        if runner not in runners:
            raise ValueError(runner)
        rss.start()
        out = runners[runner](spec)
    out["rss_mib"] = rss.growth_mib()
    if out.pop("skip_close", False):
        print(json.dumps(out), flush=True)
        os._exit(0)
    return out


# -- orchestration -----------------------------------------------------------


def child_process(spec: dict[str, Any], stderr: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    env = {**os.environ, **spec.get("env", {})}
    return subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def run_child(spec: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    proc = child_process(spec)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{spec['key']} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['key']} failed (exit {proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def admin(bootstrap: str) -> Any:
    from confluent_kafka.admin import AdminClient

    # log_level 5: without librdkafka's info line about unserved events at close.
    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 5})


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


def kafka_python_version() -> str | None:
    try:
        import kafka
    except ImportError:
        return None
    return str(kafka.__version__)


def machine() -> str:
    import confluent_kafka
    import numpy as np
    import torch

    import kfeed
    from test_micro import cpu_and_memory

    kp = kafka_python_version()
    return (f"{cpu_and_memory()}; Python {platform.python_version()}, "
            f"Apache Kafka {kafka_version()} (1 node, same machine; Java "
            f"{perf_tools.java_version()}), librdkafka {confluent_kafka.libversion()[0]}, "
            f"confluent-kafka {confluent_kafka.__version__}, "
            f"kafka-python {kp or 'not installed'}, torch {torch.__version__}, "
            f"numpy {np.__version__}, kfeed {getattr(kfeed, '__version__', '?')}")


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _rate(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["samples"] / r["seconds"] for r in runs)


# -- running the contenders --------------------------------------------------


def topic_samples(args: argparse.Namespace, kind: str) -> int:
    workload = TOPICS[kind].workload
    if workload == "small":
        return args.small_samples
    if kind.startswith("lat_"):
        rate = next(r.options["rate"] for r in LATENCY if r.topic == kind and r.options)
        return rate * args.latency_seconds
    if kind in CODEC_KINDS:
        return args.codec_samples
    return args.samples


def records_per_message(fmt: str) -> int:
    return BLOCK_RECORDS if fmt == "block" else 1


def topic_spec(args: argparse.Namespace, run: Run, names: dict[str, str]) -> dict[str, Any]:
    """What every child needs to know about the contender and its topic."""
    t = TOPICS[run.topic]
    options = dict(run.options or {})
    cap = options.pop("cap", None)
    options.pop("once", None)
    spec = {"bootstrap": args.bootstrap, "key": run.key, "runner": run.runner,
            "topic": names[run.topic], "workload": t.workload, "fmt": t.fmt, "codec": t.codec,
            "samples": topic_samples(args, run.topic),
            "dims": SMALL_FEATURES if t.workload == "small" else FEATURES,
            "records_per_message": records_per_message(t.fmt),
            "group": f"kfeed-bench-{run.key}-{uuid.uuid4().hex}", **options}
    if cap is not None:
        spec["time_limit"] = getattr(args, cap)
    return spec


def run_producer(args: argparse.Namespace, run: Run, names: dict[str, str],
                 scratch: Path) -> dict[str, Any]:
    spec = topic_spec(args, run, names)
    if run.runner != "p_java":
        return run_child(spec)
    n, per = spec["samples"], spec["records_per_message"]
    records = math.ceil(n / per)
    size = RECORD_BYTES if per == 1 else schema_of("features").block_nbytes(per)
    payload = perf_tools.payload_file(scratch, size, 256 if per == 1 else 64)
    # kfeed.Producer's delivery settings (PRODUCER_DEFAULTS), in the Java client's words.
    props = {"acks": "all", "enable.idempotence": "true", "linger.ms": 5, "batch.size": 1 << 20}
    r = perf_tools.producer_performance(args.bootstrap, spec["topic"], records, payload, props)
    rate = r["records_per_s"] * per
    return {"samples": n, "seconds": n / rate, "wall": r["wall"], "messages": records,
            "rss_mib": None}


def run_consumer(args: argparse.Namespace, run: Run, names: dict[str, str],
                 ends: dict[str, dict[int, int]]) -> dict[str, Any]:
    spec = topic_spec(args, run, names)
    spec["ends"] = ends[run.topic]
    expected = spec["samples"]
    if run.runner == "kcat":
        messages = sum(spec["ends"].values())
        r = perf_tools.kcat_consume(args.bootstrap, spec["topic"], messages)
        return {"samples": expected, "seconds": r["wall"], "wall": r["wall"], "rss_mib": None}
    if run.runner == "java":
        messages = sum(spec["ends"].values())
        r = perf_tools.consumer_performance(args.bootstrap, spec["topic"], messages,
                                            spec["group"])
        rate = r["fetch.nMsg.sec"] * expected / messages
        return {"samples": expected, "seconds": expected / rate, "wall": r["wall"],
                "rss_mib": None}
    r = run_child(spec)
    got = r["samples"]
    want_sum = got * (got - 1) // 2 if r.get("capped") else expected * (expected - 1) // 2
    if (got != expected and not r.get("capped")) or r.get("id_sum", want_sum) != want_sum:
        raise RuntimeError(f"{run.key} delivered {got} samples (id sum {r.get('id_sum')}), "
                           f"expected {expected}")
    return r


def run_latency_case(args: argparse.Namespace, run: Run, names: dict[str, str]) -> dict[str, Any]:
    spec = topic_spec(args, run, names)
    n = spec["samples"]
    paced = {"bootstrap": args.bootstrap, "key": f"{run.key}_producer", "runner": "paced",
             "topic": spec["topic"], "fmt": spec["fmt"], "samples": n,
             "rate": spec.get("rate", 0), "chunk": LAT_CHUNK, "linger_ms": LAT_LINGER_MS}
    spec.update(max_wait_ms=LAT_MAX_WAIT_MS, warmup_ids=0)
    if spec["mode"] == "fixed":
        spec.update(producer=paced, warmup_ids=int(spec["rate"] * LAT_WARMUP_S))
        r = run_child(spec, timeout=args.latency_seconds + 180)
    else:
        # Filled as fast as the producer goes, before the loader starts.
        fill = run_child({**paced, "rate": 0, "chunk": 1024})
        r = run_child(spec)
        r["producer"] = fill
    if r["samples"] != n or r["id_sum"] != n * (n - 1) // 2:
        raise RuntimeError(f"{run.key} delivered {r['samples']} samples, expected {n}")
    return r


# -- report --------------------------------------------------------------------


def _mib(r: dict[str, Any]) -> str:
    return "- (not measured)" if r.get("rss_mib") is None else f"{r['rss_mib']:,.0f} MiB"


def consumer_table(runs: list[Run], consumers: dict[str, list[dict[str, Any]]],
                   args: argparse.Namespace) -> tuple[list[str], dict[str, float]]:
    lines = ["| consumer | samples/s | MB/s | wall (s) | peak RSS growth |",
             "|---|---|---|---|---|"]
    rates: dict[str, float] = {}
    for run in runs:
        rs = consumers.get(run.key)
        if not rs:
            continue
        rate = rates[run.key] = _rate(rs)
        notes = []
        if any(r.get("capped") for r in rs):
            cap = getattr(args, (run.options or {})["cap"])
            notes.append(f"first {statistics.median(r['samples'] for r in rs):,.0f} samples, "
                         f"{cap:g} s cap")
        if len(rs) == 1 and args.repeat > 1:
            notes.append("one run")
        note = f" ({'; '.join(notes)})" if notes else ""
        size = WORKLOADS[TOPICS[run.topic].workload].record_bytes
        mem = "- (not measured)" if rs[0].get("rss_mib") is None else f"{_med(rs, 'rss_mib'):,.0f} MiB"
        lines.append(f"| {run.label}{note} | {rate:,.0f} | {rate * size / 1e6:,.0f} "
                     f"| {_med(rs, 'wall'):.2f} | {mem} |")
    return lines, rates


def ratio_table(rates: dict[str, float], info: list[tuple[str, str, str]],
                targets: list[tuple[str, str, str, float]] = ()) -> tuple[list[str], bool]:
    lines = ["| ratio (samples/s) | value | target |", "|---|---|---|"]
    missed = False
    for name, a, b, target in targets:
        if a in rates and b in rates:
            r = rates[a] / rates[b]
            ok = r >= target
            missed |= not ok
            lines.append(f"| {name} | {r:.2f}x | >= {target}x {'ok' if ok else 'MISSED'} |")
    for name, a, b in info:
        if a in rates and b in rates:
            lines.append(f"| {name} | {rates[a] / rates[b]:.2f}x | (information) |")
    return lines, missed


def producer_table(runs: list[Run], producers: dict[str, dict[str, Any]]) -> tuple[list[str],
                                                                                  dict[str, float]]:
    lines = ["| producer (runs once) | samples/s | MB/s | messages | peak RSS growth |",
             "|---|---|---|---|---|"]
    rates: dict[str, float] = {}
    for run in runs:
        r = producers.get(run.key)
        if r is None:
            continue
        rate = rates[run.key] = r["samples"] / r["seconds"]
        size = WORKLOADS[TOPICS[run.topic].workload].record_bytes
        lines.append(f"| {run.label} | {rate:,.0f} | {rate * size / 1e6:,.0f} "
                     f"| {r.get('messages', r['samples']):,} | {_mib(r)} |")
    return lines, rates


def load_note(loads: list[float], start: str, end: str) -> str:
    text = (f"Load average (1, 5, 15 min) at start / end: {start} / {end}; 1-minute load "
            f"before each contender: {min(loads):.1f} to {max(loads):.1f}" if loads else
            f"Load average at start / end: {start} / {end}")
    cores = os.cpu_count() or 1
    first = float(start.split()[0]) if start != "?" else 0.0
    if first > 0.5 * cores or (loads and max(loads) > cores + 1):
        text += (f". Other jobs shared the machine during this run ({cores} cores; the "
                 "benchmark itself keeps about 2 busy: the broker and one contender)")
    return text + "."


def report_loader(args: argparse.Namespace, command: str, res: dict[str, Any]) -> tuple[str, bool]:
    consumers, producers = res["consumers"], res["producers"]
    lines: list[str] = []
    add = lines.append
    n = args.samples
    add(f"Machine: {res['machine']}.")
    add("")
    add(f"Workload: {n:,} samples of 3,088 bytes ({n * RECORD_BYTES / 1e6:,.0f} MB) per topic, "
        f"{PARTITIONS} partitions, batches of {BATCH} as CPU tensors; block topic: "
        f"{BLOCK_RECORDS} records per message. Medians of {args.repeat} run(s) per consumer, "
        "each in its own process with a fresh group; throughput counted from partition "
        "assignment to the last batch (wall includes the group join; for Kafka's Java tools, "
        "their own figures without the group join, and wall includes the JVM start). "
        f"MB/s = samples x sample bytes. {res['load']}")
    add("")
    add("Command (`make bench` starts a local 1-node Apache Kafka and runs it; "
        "`--write` records these tables here, in \"Compression\" and in \"End-to-end latency\"):")
    add("")
    add("```")
    add(command)
    add("```")
    add("")
    table, rates = consumer_table(CONSUMERS, consumers, args)
    lines += table
    for note in res["notes"]:
        add("")
        add(note)
    if consumers.get("seeds") and "committed" in consumers["seeds"][0]:
        runs = consumers["seeds"]
        add("")
        add(f"The seeds loop's commit(msg) sends one OffsetCommit request per message; when "
            f"its loop ended, the broker had acknowledged "
            f"{statistics.median(r['committed'] / r['samples'] for r in runs):.1%} of them "
            "(median), the rest were still queued on the coordinator connection.")
    add("")
    table, missed = ratio_table(rates, INFO_RATIOS, TARGETS)
    lines += table
    if any(k in consumers for k in ("java_raw", "java_block")):
        add("")
        add("The Java ConsumerPerformance rows run the Java client with its defaults "
            "(max.partition.fetch.bytes 1 MiB, fetch.min.bytes 1) and only count records and "
            "bytes: a reference for what Kafka's own client reads here, not a bound "
            "for librdkafka.")
    if any(r.key in consumers for r in SMALL_CONSUMERS):
        add("")
        add(f"### Small samples ({args.small_samples:,} samples of 64 bytes: "
            f"{WORKLOADS['small'].text})")
        add("")
        add("Per-message cost: the same contenders on a topic of 64-byte samples, one message "
            f"per sample (block topic: {BLOCK_RECORDS} per message).")
        add("")
        table, small_rates = consumer_table(SMALL_CONSUMERS, consumers, args)
        lines += table
        add("")
        lines += ratio_table(small_rates, SMALL_RATIOS)[0]
        small_p = producer_table(SMALL_PRODUCERS, producers)[0]
        if len(small_p) > 2:
            add("")
            lines += small_p
    add("")
    table, prates = producer_table(PRODUCERS, producers)
    if len(table) > 2:
        lines += table
    if "p_kfeed_block" in prates and "p_seeds_zstd" in prates:
        add("")
        add(f"kfeed.Producer block vs the seeds' producer loop (zstd): "
            f"{prates['p_kfeed_block'] / prates['p_seeds_zstd']:.2f}x; "
            f"vs the same loop without compression: "
            f"{prates['p_kfeed_block'] / prates['p_seeds']:.2f}x; kfeed raw vs the seeds' loop "
            f"without compression: {prates['p_kfeed_raw'] / prates['p_seeds']:.2f}x.")
    if "p_java_raw" in prates and "p_kfeed_raw" in prates:
        add(f"kfeed.Producer raw vs Java ProducerPerformance (3,088-byte records): "
            f"{prates['p_kfeed_raw'] / prates['p_java_raw']:.2f}x; kfeed.Producer block vs "
            f"ProducerPerformance with block-sized records: "
            f"{prates['p_kfeed_block'] / prates['p_java_block']:.2f}x.")
    tools = res.get("native_tools")
    if tools is not None:
        found = [f"{k} ({v})" for k, v in tools.items() if v]
        add("")
        add("kcat, kafkacat, rdkafka_performance: " + (
            "found: " + ", ".join(found) + " (kcat, where found, has its rows above)"
            if found else "not installed (none on PATH), not measured."))
    return "\n".join(lines) + "\n", missed


def report_codecs(args: argparse.Namespace, res: dict[str, Any]) -> str | None:
    consumers, producers, sizes = res["consumers"], res["producers"], res["sizes"]
    if not sizes:
        return None
    lines: list[str] = []
    add = lines.append
    add(f"Same run, machine and command as \"Loader throughput\" above. "
        f"{args.codec_samples:,} samples per topic, written by "
        "`kfeed.Producer(format=\"block\", compression=codec)` "
        f"({BLOCK_RECORDS} records per message; each codec at librdkafka's default level, "
        "compression.level=-1; librdkafka compresses each record batch, up to "
        "batch.size=1 MiB, in its broker thread), read by the kfeed Loader (block, CPU; "
        "librdkafka decompresses in its own threads). Data:")
    add("")
    add(f"- features: {WORKLOADS['features'].text}, as `kfeed produce --synthetic` makes them: "
        "each value is k/65521 - 0.5 with k = (id x 2654435761 + column x 40503) mod 65521, "
        "so it takes one of 65,521 levels set by modular arithmetic. zstd's entropy coder "
        "and its matches across a 1 MiB batch find that structure; lz4 and snappy, which "
        "only match repeated byte strings, do not. Real features are not like this;")
    add(f"- normal: {WORKLOADS['normal'].text}: what real-valued features look like to a "
        "codec (bench/test_pack.py measured 1.08x with zstd on them, see \"Token streams\");")
    add(f"- tokens: {WORKLOADS['tokens'].text}: Zipf s = 1.0 over 50,257 ids, ranks mapped "
        "to random ids, drawn independently (no repeated phrases: a lower bound for real "
        "token streams).")
    add("")
    add(f"On the broker: {res['sizes_source']}; ratio = samples x sample bytes / bytes on the "
        "broker (record batch and header overhead included, so none is just under 1); the "
        "same compressed batches cross the network twice, producer to broker and broker to "
        f"consumer. Producers run once; loaders are medians of {args.repeat} run(s); x none = "
        "against the same data uncompressed, in the same run.")
    add("")
    add("| data | codec | producer samples/s | producer MB/s | on the broker | ratio "
        "| Loader samples/s | Loader MB/s |")
    add("|---|---|---|---|---|---|---|---|")
    for data in CODEC_DATA:
        size = WORKLOADS[data].record_bytes
        base_p, base_c = codec_keys(data, "none")
        for codec in CODECS:
            pk, ck = codec_keys(data, codec)
            kind = codec_topic(data, codec)
            p, cs = producers.get(pk), consumers.get(ck)
            if p is None or kind not in sizes:
                continue
            prate = p["samples"] / p["seconds"]
            pnone = producers[base_p]["samples"] / producers[base_p]["seconds"]
            ratio = p["samples"] * size / sizes[kind]
            loader = "-"
            lmb = "-"
            if cs and consumers.get(base_c):
                crate = _rate(cs)
                loader = f"{crate:,.0f} ({crate / _rate(consumers[base_c]):.2f}x none)"
                lmb = f"{crate * size / 1e6:,.0f}"
            add(f"| {data} | {codec} | {prate:,.0f} ({prate / pnone:.2f}x none) "
                f"| {prate * size / 1e6:,.0f} | {sizes[kind] / 1e6:,.0f} MB | {ratio:.2f}x "
                f"| {loader} | {lmb} |")
    return "\n".join(lines) + "\n"


def report_latency(args: argparse.Namespace, res: dict[str, Any]) -> str | None:
    lat = res["latency"]
    if not lat:
        return None
    lines: list[str] = []
    add = lines.append
    add(f"Same run, machine and command as \"Loader throughput\" above. Samples of "
        f"{WORKLOADS['stamped'].text} (3,088 bytes); the producer stamps each sample with "
        "`time.time_ns()` just before `Producer.send()`, and the loader's process reads "
        "`time.time_ns()` as `next(loader)` returns the batch (CLOCK_REALTIME, one machine, "
        "so one clock). Per batch: newest = the latency of its most recently sent sample "
        "(producer queue and linger, broker, fetch, decode, copy), oldest = that of its "
        "first-sent sample (the newest's plus the time the batch took to fill). Percentiles "
        "are over batches.")
    add("")
    add(f"- Fixed load: a separate process sends the offered load with `kfeed.Producer` "
        f"({LAT_CHUNK} samples per `send()`, paced; linger.ms={LAT_LINGER_MS}, acks=all), "
        f"started once the loader holds the partitions, for {args.latency_seconds} s; the loader "
        f"streams (`until=None`, `max_wait_ms={LAT_MAX_WAIT_MS:g}`, batch {BATCH}), and the "
        f"first {LAT_WARMUP_S:g} s of samples are left out.")
    add(f"- Baseline: the same kind of stream read without the Loader: "
        f"`consume({CONSUME_N // BLOCK_RECORDS}, {LAT_MAX_WAIT_MS:g} ms)` with kfeed's consumer "
        "settings, each call's records decoded with kfeed's codec and taken as one batch: "
        "what librdkafka, the broker and this machine give before any batching.")
    add(f"- Saturation: {args.samples:,} samples written first, as fast as the producer goes, "
        "then read from the earliest offset as fast as the loader goes (`until=\"end\"`). "
        "Each sample's latency is then mostly the time it queued in Kafka before the "
        "loader reached it, which grows with the backlog: it measures the queue, not the "
        "loader.")
    add("")
    add("| run | offered load | delivered samples/s | batches | rows/batch "
        "| newest p50 / p99 / p99.9 / max (ms) | oldest p50 / p99 / p99.9 / max (ms) |")
    add("|---|---|---|---|---|---|---|")

    def ms(values: list[float]) -> str:
        return " / ".join(f"{v:,.1f}" for v in values)

    for run in LATENCY:
        r = lat.get(run.key)
        if r is None:
            continue
        prod = r["producer"]
        if run.options and run.options["mode"] == "fixed":
            offered = (f"{run.options['rate']:,}/s (sent {prod['rate']:,.0f}/s; at worst "
                       f"{prod['behind_ms']:,.1f} ms behind its pace)")
        else:
            offered = f"pre-filled at {prod['rate']:,.0f}/s"
        add(f"| {run.label} | {offered} | {r['rate']:,.0f} | {r['batches']:,} "
            f"| {r['rows_mean']:,.0f} | {ms(r['newest'])} | {ms(r['oldest'])} |")
    fixed = [r for r in LATENCY if r.key in lat and r.options and r.options["mode"] == "fixed"]
    if fixed:
        def p99(r: Run, which: str) -> str:
            short = "baseline" if r.runner == "latency_plain" else f"kfeed {TOPICS[r.topic].fmt}"
            return f"{short} at {r.options['rate']:,}/s {lat[r.key][which][1]:,.1f} ms"

        add("")
        add(f"The seeds quote p99 {SEEDS_P99_MS:g} ms. p99 of the newest sample here: "
            + ", ".join(p99(r, "newest") for r in fixed) + "; of the oldest: "
            + ", ".join(p99(r, "oldest") for r in fixed) + f". {res['load']}")
    return "\n".join(lines) + "\n"


def write_section(title: str, body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# kfeed benchmark results\n"
    section = f"{title}\n\n{body}"
    start = text.find(title + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(title))
        text = text[:start] + section + ("" if nxt < 0 else "\n" + text[nxt + 1:])
    RESULTS.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--bootstrap", default=os.environ.get("KFEED_BOOTSTRAP"),
                   help="host:port,... (default: $KFEED_BOOTSTRAP)")
    p.add_argument("--samples", type=int, default=None, help="samples per topic (default 200000)")
    p.add_argument("--small-samples", type=int, default=None,
                   help="samples of the 64-byte topics (default 1000000, --quick 200000)")
    p.add_argument("--codec-samples", type=int, default=None,
                   help="samples per topic of the compression table (default 100000, "
                        "--quick 25000)")
    p.add_argument("--repeat", type=int, default=None, help="runs per consumer (default 3)")
    p.add_argument("--quick", action="store_true", help="50,000 samples, one run")
    p.add_argument("--sync-seconds", type=float, default=None,
                   help="time cap of one run of the seeds loop with synchronous commits "
                        "(default 15, --quick 5)")
    p.add_argument("--cap-seconds", type=float, default=None,
                   help="time cap of one run of the seeds loop on the small topic and of "
                        "kafka-python with its defaults (default 10, --quick 4)")
    p.add_argument("--latency-seconds", type=int, default=None,
                   help="length of each fixed-load latency run (default 10, --quick 4)")
    p.add_argument("--cluster-dir", default=os.environ.get("KFEED_CLUSTER_DIR"),
                   help="the local cluster's folder, to size topics from their segment files "
                        "(default: $KFEED_CLUSTER_DIR; else Kafka's LogDirsCommand)")
    p.add_argument("--only", default=None,
                   help="comma-separated consumer or latency keys to run (skips the producer "
                        "and compression tables)")
    p.add_argument("--write", action="store_true", help=f"write the tables into {RESULTS.name}")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if not args.bootstrap:
        p.error("no broker: set KFEED_BOOTSTRAP or pass --bootstrap")
    args.samples = args.samples or (50_000 if args.quick else 200_000)
    args.small_samples = args.small_samples or (200_000 if args.quick else 1_000_000)
    args.codec_samples = args.codec_samples or (25_000 if args.quick else 100_000)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.sync_seconds = args.sync_seconds or (5.0 if args.quick else 15.0)
    args.cap_seconds = args.cap_seconds or (4.0 if args.quick else 10.0)
    args.latency_seconds = args.latency_seconds or (4 if args.quick else 10)
    command = "python bench/bench_loader.py " + " ".join(
        a for a in sys.argv[1:] if a != "--write")
    command = command.rstrip()
    started = time.monotonic()
    res: dict[str, Any] = {"machine": machine(), "consumers": {}, "producers": {}, "sizes": {},
                           "latency": {}, "notes": [], "sizes_source": ""}
    print(f"machine: {res['machine']}", flush=True)
    load0 = _load()
    loads: list[float] = []
    only = set(args.only.split(",")) if args.only else None
    consumers = [r for r in ALL_CONSUMERS if only is None or r.key in only]
    if kafka_python_version() is None:
        skipped = [r.key for r in consumers if r.runner == "kafka_python"]
        consumers = [r for r in consumers if r.runner != "kafka_python"]
        note = ("kafka-python is not installed: its contender was skipped "
                "(`pip install kafka-python` to measure it).")
        print(note + (f" ({', '.join(skipped)})" if skipped else ""), flush=True)
        res["notes"].append(note)
    if not (shutil.which("kcat") or shutil.which("kafkacat")):
        consumers = [r for r in consumers if r.runner != "kcat"]
        note = "kcat is not installed: its rows were skipped."
        print(note, flush=True)
        res["notes"].append(note)
    latency = [r for r in LATENCY if only is None or r.key in only]
    read = {r.topic for r in consumers}
    producers = ALL_PRODUCERS if only is None else [
        r for r in ALL_PRODUCERS if r.runner == "p_kfeed" and r.topic in read]
    run_id = uuid.uuid4().hex[:12]
    names = {kind: f"kfeed-bench-{kind}-{run_id}"
             for kind in sorted(read | {r.topic for r in producers + latency})}
    live = set(names.values())
    create_topics(args.bootstrap, sorted(live))
    scratch = perf_tools.scratch_dir()

    def drop(kinds: set[str]) -> None:
        gone = sorted({names[k] for k in kinds if k in names} & live)
        if gone:
            delete_topics(args.bootstrap, gone)
            live.difference_update(gone)

    try:
        for run in producers:
            loads.append(os.getloadavg()[0])
            r = res["producers"][run.key] = run_producer(args, run, names, scratch)
            print(f"[{time.monotonic() - started:5.0f} s] {run.key:18s} "
                  f"{r['samples'] / r['seconds']:>10,.0f} samples/s  "
                  f"{_mib(r):>8s}", flush=True)
        drop({r.topic for r in producers} - read)  # written only
        if only is None:
            kinds = sorted(CODEC_KINDS)
            try:
                sizes, res["sizes_source"] = perf_tools.topic_bytes(
                    args.bootstrap, [names[k] for k in kinds], args.cluster_dir)
                res["sizes"] = {k: sizes[names[k]] for k in kinds}
            except Exception as e:  # noqa: BLE001 - the table is left out, the run goes on
                print(f"warning: could not size the compression topics: {e}", file=sys.stderr)
        ends = {kind: high_watermarks(args.bootstrap, names[kind]) for kind in read}
        for i in range(args.repeat):
            for run in consumers:
                if i and (run.options or {}).get("once"):
                    continue
                loads.append(os.getloadavg()[0])
                r = run_consumer(args, run, names, ends)
                res["consumers"].setdefault(run.key, []).append(r)
                print(f"[{time.monotonic() - started:5.0f} s] run {i + 1}/{args.repeat} "
                      f"{run.key:18s} "
                      f"{r['samples'] / r['seconds']:>10,.0f} samples/s  wall {r['wall']:6.2f} s"
                      f"  {_mib(r):>8s}", flush=True)
        drop(read)
        for run in latency:
            loads.append(os.getloadavg()[0])
            r = res["latency"][run.key] = run_latency_case(args, run, names)
            print(f"[{time.monotonic() - started:5.0f} s] {run.key:18s} newest p50/p99/p99.9 "
                  f"{r['newest'][0]:7.1f} "
                  f"{r['newest'][1]:7.1f} {r['newest'][2]:7.1f} ms   oldest "
                  f"{r['oldest'][0]:7.1f} {r['oldest'][1]:7.1f} {r['oldest'][2]:7.1f} ms  "
                  f"({r['batches']} batches, {r['rows_mean']:.0f} rows)", flush=True)
            drop({run.topic})
        if only is None:
            res["native_tools"] = perf_tools.native_tools()
        else:
            res["producers"] = {}  # they only wrote what the chosen consumers read
    finally:
        drop(set(names))
        shutil.rmtree(scratch, ignore_errors=True)
    res["load"] = load_note(loads, load0, _load())
    body, missed = report_loader(args, command, res)
    sections = [(SECTION, body), (SECTION_CODECS, report_codecs(args, res)),
                (SECTION_LATENCY, report_latency(args, res))]
    for title, text in sections:
        if text is None:
            continue
        print()
        print(title)
        print()
        print(text)
        if args.write:
            write_section(title, text)
            print(f"wrote the section '{title[3:]}' of {RESULTS}")
    print(f"total {time.monotonic() - started:.0f} s")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
