"""Topics others write (Avro, Protobuf): kfeed's loader against what users write today.

Against the broker that ``$KFEED_BOOTSTRAP`` names, on fresh uuid topics (4
partitions) written by confluent-kafka's ``AvroSerializer`` and
``ProtobufSerializer`` (Confluent framing; schemas in confluent-kafka's
in-memory registry client, shared by every contender). Two workloads per
format (bench/RESULTS.md, "Avro" and "Protobuf"):

- ``3 KB``: a 768-float array, a long id, an int label, a double score;
- ``200 B``: a dozen scalars (longs, ints, doubles, a float, a boolean, an
  enum) and a string of about 140 characters.

Contenders, each reading its topic from the earliest offset to the end with a
fresh group, batches of 256 as CPU tensors:

- ``kfeed``: ``Loader(format=kfeed.Avro(registry=...))`` or
  ``kfeed.Protobuf(message=..., registry=...)``, ``until="end"``;
- Avro: ``AvroDeserializer loop`` (confluent-kafka's deserializer per
  message) and ``fastavro loop`` (``schemaless_reader`` on the bytes after
  the 5-byte framing); Protobuf: ``ParseFromString loop`` (the generated
  class's ``FromString`` on the bytes after the 6-byte framing); each copies
  the fields into preallocated numpy batches, ``torch.from_numpy`` per batch;
- ``ceiling``: ``consume(2048)`` with kfeed's consumer settings, touching
  nothing but ``error()``.

And a micro-benchmark without a broker: 4,096 framed 3 KB Avro records
decoded by ``AvroDecoder.decode_into`` against ``memcpy`` of the same bytes
(``np.copyto`` of one buffer).

``--formats documents`` (no broker): token documents (arrays of int ids),
framed, through ``decode_documents`` against a fastavro or
``ParseFromString`` loop into one flat array and lengths (tokens/s).

``--formats jagged`` (no broker): Avro and JSON events whose array is read
as a fixed shape against the same array read as a jagged field, through the
loader from memory (records/s).

``--formats pbmemory`` (no broker): the Protobuf workloads through the
loader from a ``MemorySource`` against the ``ParseFromString`` loop over the
same values, so that the ratio is the decoding's, not the broker's; the
loader in batches of 256, as everywhere here, and of 1024, the batch size of
the issue's example.

``--formats arrow`` (no broker): the same records as kfeed blocks and as
Arrow IPC messages (``format="arrow"``) through the loader from memory.

``--formats convert``: ``kfeed.convert`` of each Avro topic into a block
topic (records/s), and the loader on the block topic against the loader on
the Avro topic, interleaved.

Each contender runs ``--repeat`` times, interleaved; the best run counts.
Run: ``python bench/bench_formats.py [--formats avro,protobuf,json,convert] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import fastavro
import msgspec
import numpy as np
import orjson
import pyarrow as pa
import simdjson
import torch
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from pyarrow import json as pa_json

import kfeed
from kfeed.sources import CONSUMER_DEFAULTS

BATCH = 256

BIG = {"type": "record", "name": "Big", "fields": [
    {"name": "id", "type": "long"},
    {"name": "features", "type": {"type": "array", "items": "float"}},
    {"name": "label", "type": "int"},
    {"name": "score", "type": ["null", "double"]},
]}
BIG_SCHEMA = kfeed.Schema({"id": ("int64", ()), "features": ("float32", (768,)),
                           "label": ("int64", ()),
                           "score": ("float32", (), {"default": 0.0})})
# Protobuf's twin: a proto3 double without presence sends 0 as nothing, so no default.
BIG_PB_SCHEMA = kfeed.Schema({"id": ("int64", ()), "features": ("float32", (768,)),
                              "label": ("int64", ()), "score": ("float32", ())})
SMALL_FIELDS = ([("id", "long"), ("a", "long"), ("b", "long"), ("c", "int"), ("d", "int"),
                 ("x", "double"), ("y", "double"), ("z", "double"), ("w", "float"),
                 ("flag", "boolean")])
SMALL = {"type": "record", "name": "Small", "fields": [
    *({"name": n, "type": t} for n, t in SMALL_FIELDS),
    {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["a", "b", "c"]}},
    {"name": "note", "type": "string"},
]}
_DTYPE = {"long": "int64", "int": "int32", "double": "float64", "float": "float32",
          "boolean": "bool"}
SMALL_SCHEMA = kfeed.Schema({**{n: (_DTYPE[t], ()) for n, t in SMALL_FIELDS},
                             "kind": ("int8", ())})


def big_record(i: int, rng: np.random.Generator) -> dict:
    return {"id": i, "features": rng.standard_normal(768).astype(np.float32).tolist(),
            "label": i % 10, "score": None if i % 4 == 0 else float(i)}


def small_record(i: int, rng: np.random.Generator) -> dict:
    return {"id": i, "a": i * 3, "b": -i, "c": i % 1000, "d": 7, "x": i / 3, "y": 0.5,
            "z": -1.25, "w": 2.0, "flag": bool(i % 2), "kind": "abc"[i % 3],
            "note": f"user-{i % 977}:" + "x" * 130}


def produce(bootstrap: str, topic: str, serialize: Callable[[int, np.random.Generator], bytes],
            n: int) -> int:
    """n values from ``serialize(i, rng)`` into a new 4-partition topic; their mean size."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 4, 1)])[topic].result()
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "batch.size": 1 << 20})
    rng = np.random.default_rng(0)
    nbytes = 0
    for i in range(n):
        v = serialize(i, rng)
        nbytes += len(v)
        while True:
            try:
                p.produce(topic, v)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    assert p.flush(120) == 0
    return nbytes // n


def consumer(bootstrap: str, topic: str) -> Consumer:
    c = Consumer({**CONSUMER_DEFAULTS, "bootstrap.servers": bootstrap,
                  "group.id": uuid.uuid4().hex, "enable.partition.eof": True})
    c.subscribe([topic])
    return c


def drain(bootstrap: str, topic: str, n: int, per_message: Callable[[Any], None] | None,
          flush: Callable[[], None] | None) -> int:
    """consume(2048) to the end of 4 partitions; ``per_message`` on each value."""
    c = consumer(bootstrap, topic)
    seen, eofs = 0, set()
    while seen < n or len(eofs) < 4:
        for m in c.consume(2048, 0.1):
            err = m.error()
            if err is not None:
                if err.code() == -191:  # _PARTITION_EOF
                    eofs.add(m.partition())
                continue
            eofs.discard(m.partition())
            seen += 1
            if per_message is not None:
                per_message(m.value())
    if flush is not None:
        flush()
    c.close()
    return seen


def batched_loop(schema: kfeed.Schema, read: Callable[[bytes], dict]) -> tuple[Callable, Callable]:
    """A loop body that decodes each value with ``read`` into preallocated numpy batches."""
    cols = {f.name: np.zeros((BATCH, *f.shape), f.storage) for f in schema.fields}
    names = [f.name for f in schema.fields]
    state = {"row": 0, "batches": 0}

    def per_message(value: bytes) -> None:
        rec = read(value)
        r = state["row"]
        for name in names:
            v = rec.get(name)
            cols[name][r] = 0 if v is None else v
        state["row"] = r + 1
        if r + 1 == BATCH:
            flush()

    def flush() -> None:
        if state["row"]:
            {k: torch.from_numpy(v[:state["row"]]) for k, v in cols.items()}
            state["batches"] += 1
            state["row"] = 0

    return per_message, flush


def run_kfeed(bootstrap: str, topic: str, schema: kfeed.Schema, fmt: Any) -> int:
    n = 0
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    with kfeed.Loader(config, topic, schema, BATCH, device="cpu", until="end",
                      format=fmt) as loader:
        for batch in loader:
            n += batch.size
    return n


def enum_index(symbols: list[str]) -> Callable[[dict], dict]:
    def fix(rec: dict) -> dict:
        if "kind" in rec:
            rec["kind"] = symbols.index(rec["kind"])
        return rec
    return fix


def avro_runs(bootstrap: str, registry: Any, big: bool, n: int
              ) -> tuple[str, kfeed.Schema, dict[str, Callable[[], int]]]:
    writer, schema, make = (BIG, BIG_SCHEMA, big_record) if big else \
        (SMALL, SMALL_SCHEMA, small_record)
    topic = f"bench-avro-{uuid.uuid4().hex[:8]}"
    ctx = SerializationContext(topic, MessageField.VALUE)
    ser = AvroSerializer(registry, json.dumps(writer))
    size = produce(bootstrap, topic, lambda i, rng: ser(make(i, rng), ctx), n)
    fix = enum_index(["a", "b", "c"])
    parsed = fastavro.parse_schema(writer)

    def deserializer() -> int:
        des = AvroDeserializer(registry)
        per, flush = batched_loop(schema, lambda v: fix(des(v, ctx)))
        return drain(bootstrap, topic, n, per, flush)

    def fast() -> int:
        per, flush = batched_loop(
            schema, lambda v: fix(fastavro.schemaless_reader(io.BytesIO(v[5:]), parsed, None)))
        return drain(bootstrap, topic, n, per, flush)

    return topic, size, {
        "kfeed": lambda: run_kfeed(bootstrap, topic, schema, kfeed.Avro(registry=registry)),
        "AvroDeserializer loop": deserializer,
        "fastavro loop": fast,
        "ceiling": lambda: drain(bootstrap, topic, n, None, None),
    }


def _pb_classes() -> tuple[type, type]:
    """The Protobuf twins of BIG and SMALL, as protoc would generate them."""
    f = descriptor_pb2.FieldDescriptorProto
    types = {"long": f.TYPE_INT64, "int": f.TYPE_INT32, "double": f.TYPE_DOUBLE,
             "float": f.TYPE_FLOAT, "boolean": f.TYPE_BOOL}
    fdp = descriptor_pb2.FileDescriptorProto(name="bench_formats.proto", package="bench",
                                             syntax="proto3")
    kind = fdp.enum_type.add(name="Kind")
    for i, name in enumerate("abc"):
        kind.value.add(name=name.upper(), number=i)
    big = fdp.message_type.add(name="Big")
    big.field.add(name="id", number=1, type=f.TYPE_INT64, label=f.LABEL_OPTIONAL)
    big.field.add(name="features", number=2, type=f.TYPE_FLOAT, label=f.LABEL_REPEATED)
    big.field.add(name="label", number=3, type=f.TYPE_INT32, label=f.LABEL_OPTIONAL)
    big.field.add(name="score", number=4, type=f.TYPE_DOUBLE, label=f.LABEL_OPTIONAL)
    small = fdp.message_type.add(name="Small")
    for number, (name, t) in enumerate(SMALL_FIELDS, 1):
        small.field.add(name=name, number=number, type=types[t], label=f.LABEL_OPTIONAL)
    small.field.add(name="kind", number=20, type=f.TYPE_ENUM, type_name=".bench.Kind",
                    label=f.LABEL_OPTIONAL)
    small.field.add(name="note", number=21, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"bench.{name}"))
                 for name in ("Big", "Small"))


def _framing(value: bytes) -> int:
    """Bytes of Confluent Protobuf framing: magic, schema id, the message-index varints."""
    at, count = 5, None
    while count is None or count > 0:
        shift = v = 0
        while True:
            byte = value[at]
            at += 1
            v |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        count = (v >> 1) if count is None else count - 1
    return at


def protobuf_runs(bootstrap: str, registry: Any, big: bool, n: int
                  ) -> tuple[str, kfeed.Schema, dict[str, Callable[[], int]]]:
    big_cls, small_cls = _pb_classes()
    cls, schema, make = (big_cls, BIG_PB_SCHEMA, big_record) if big else \
        (small_cls, SMALL_SCHEMA, small_record)
    topic = f"bench-protobuf-{uuid.uuid4().hex[:8]}"
    ctx = SerializationContext(topic, MessageField.VALUE)
    ser = ProtobufSerializer(cls, registry, {"use.deprecated.format": False})

    def serialize(i: int, rng: np.random.Generator) -> bytes:
        rec = make(i, rng)
        if "kind" in rec:
            rec["kind"] = "abc".index(rec["kind"])
        if rec.get("score", 0) is None:
            rec["score"] = 0.0
        return ser(cls(**rec), ctx)

    size = produce(bootstrap, topic, serialize, n)
    names = [f.name for f in schema.fields]
    skip = _framing(serialize(0, np.random.default_rng(0)))

    def parse() -> int:
        def read(v: bytes) -> dict:
            m = cls.FromString(v[skip:])
            return {name: getattr(m, name) for name in names}
        per, flush = batched_loop(schema, read)
        return drain(bootstrap, topic, n, per, flush)

    return topic, size, {
        "kfeed": lambda: run_kfeed(bootstrap, topic, schema,
                                   kfeed.Protobuf(message=cls, registry=registry)),
        "ParseFromString loop": parse,
        "ceiling": lambda: drain(bootstrap, topic, n, None, None),
    }


def as_consumed(values: list[bytes]) -> list[bytes]:
    """The same values, each a new bytes object, one after another in memory.

    A consumer's ``consume()`` makes its messages' values in turn: 3,081-byte
    values read from a local broker lay 3,136 bytes apart in 996 of 1,000
    steps. Made between the serializer's own objects, they lay scattered,
    and a decode that streams them read them at half the speed.
    """
    blob = b"".join(values)
    out, at = [], 0
    for v in values:
        out.append(blob[at:at + len(v)])
        at += len(v)
    return out


def protobuf_memory(registry: Any, big: bool, n: int, repeat: int) -> tuple[int, dict[str, float]]:
    """Protobuf without a broker: the loader from memory against the ParseFromString loop.

    The same framed values (``ProtobufSerializer``) in a list: ``kfeed`` reads
    them through ``Loader(format=kfeed.Protobuf(...))`` from a ``MemorySource``
    (its thread, decode into the pool's slots, the hand-over), the loop
    parses each and fills numpy batches as in ``protobuf_runs``. Records/s,
    best of ``repeat``, interleaved.
    """
    big_cls, small_cls = _pb_classes()
    cls, schema, make = (big_cls, BIG_PB_SCHEMA, big_record) if big else \
        (small_cls, SMALL_SCHEMA, small_record)
    ctx = SerializationContext("memory", MessageField.VALUE)
    ser = ProtobufSerializer(cls, registry, {"use.deprecated.format": False})
    rng = np.random.default_rng(2)
    values = []
    for i in range(n):
        rec = make(i, rng)
        if "kind" in rec:
            rec["kind"] = "abc".index(rec["kind"])
        if rec.get("score", 0) is None:
            rec["score"] = 0.0
        values.append(ser(cls(**rec), ctx))
    values = as_consumed(values)
    names = [f.name for f in schema.fields]
    skip = _framing(values[0])

    def loader(batch_size: int = BATCH) -> tuple[int, float]:
        got = 0
        source = kfeed.MemorySource(values)  # (its message objects made before the clock)
        t = time.perf_counter()
        with kfeed.Loader(None, "memory", schema, batch_size, device="cpu", until="end",
                          source=source,
                          format=kfeed.Protobuf(message=cls, registry=registry)) as ld:
            for batch in ld:
                got += batch.size
        return got, time.perf_counter() - t

    def parse() -> tuple[int, float]:
        def read(v: bytes) -> dict:
            m = cls.FromString(v[skip:])
            return {name: getattr(m, name) for name in names}
        t = time.perf_counter()
        per, flush = batched_loop(schema, read)
        for v in values:
            per(v)
        flush()
        return n, time.perf_counter() - t

    # The loader's per-batch work (slot, hand-over, ledger) weighs less at
    # the batch size of the issue's example, 1024: both, for information.
    runs = {"kfeed": loader, "kfeed, batch_size=1024": lambda: loader(1024),
            "ParseFromString loop": parse}
    best = dict.fromkeys(runs, 0.0)
    for _ in range(repeat):
        for name, run in runs.items():
            got, seconds = run()
            best[name] = max(best[name], got / seconds)
            assert got == n, (name, got, n)
    return len(values[0]), best


def json_runs(bootstrap: str, registry: Any, big: bool, n: int
              ) -> tuple[str, kfeed.Schema, dict[str, Callable[[], int]]]:
    schema, make = (BIG_SCHEMA, big_record) if big else (SMALL_SCHEMA, small_record)
    topic = f"bench-json-{uuid.uuid4().hex[:8]}"
    size = produce(bootstrap, topic, lambda i, rng: _json_event(make(i, rng)), n)

    def loop(loads: Callable[[bytes], Any]) -> Callable[[], int]:
        def run() -> int:
            per, flush = batched_loop(schema, loads)
            return drain(bootstrap, topic, n, per, flush)
        return run

    return topic, size, {
        "kfeed": lambda: run_kfeed(bootstrap, topic, schema, kfeed.Json()),
        "json.loads loop": loop(json.loads),
        "orjson loop": loop(orjson.loads),
        "msgspec loop": loop(msgspec.json.Decoder().decode),
        "ceiling": lambda: drain(bootstrap, topic, n, None, None),
    }


def _json_event(rec: dict) -> bytes:
    rec = dict(rec)
    if "kind" in rec:
        rec["kind"] = "abc".index(rec["kind"])
    return json.dumps(rec).encode()


def json_micro(big: bool, repeat: int) -> dict[str, float]:
    """4,096 JSON events decoded into numpy columns, each library its best way (records/s)."""
    schema, make = (BIG_SCHEMA, big_record) if big else (SMALL_SCHEMA, small_record)
    rng = np.random.default_rng(2)
    values = [_json_event(make(i, rng)) for i in range(4096)]
    names = [f.name for f in schema.fields]
    out = {f.name: np.zeros((4096, *f.shape), f.storage) for f in schema.fields}
    target = schema.bind(out)
    decoder = kfeed.Json().decoder(schema)

    def fill(records: Any) -> None:
        for r, rec in enumerate(records):
            for name in names:
                v = rec.get(name)
                out[name][r] = 0 if v is None else v

    parser = simdjson.Parser()

    def simd() -> None:
        for r, v in enumerate(values):
            doc = parser.parse(v)
            for name in names:
                x = doc.get(name)
                out[name][r] = 0 if x is None else (x.as_list() if hasattr(x, "as_list") else x)
            del doc

    def arrow() -> None:
        table = pa_json.read_json(io.BytesIO(b"\n".join(values)))
        for name in names:
            col = table.column(name).combine_chunks()
            if pa.types.is_list(col.type):
                out[name][:] = col.flatten().to_numpy(zero_copy_only=False).reshape(
                    out[name].shape)
            else:
                zero = False if pa.types.is_boolean(col.type) else 0
                out[name][:] = col.fill_null(zero).to_numpy(zero_copy_only=False)

    whole = msgspec.json.Decoder(list[dict])
    runs = {
        "kfeed": lambda: decoder.decode_into(values, target, 0),
        "json.loads": lambda: fill(json.loads(v) for v in values),
        "orjson": lambda: fill(orjson.loads(v) for v in values),
        "msgspec (one decode of the fetch)": lambda: fill(whole.decode(b"[" + b",".join(values)
                                                                        + b"]")),
        "simdjson": simd,
        "pyarrow.json.read_json (the fetch)": arrow,
    }
    best = dict.fromkeys(runs, 0.0)
    for _ in range(repeat * 3):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            best[name] = max(best[name], 4096 / (time.perf_counter() - t))
    return best


def micro(registry: Any, repeat: int) -> tuple[float, float]:
    """4,096 framed 3 KB records: decode_into against memcpy of the same bytes (GB/s)."""
    ser = AvroSerializer(registry, json.dumps(BIG))
    ctx = SerializationContext("micro", MessageField.VALUE)
    rng = np.random.default_rng(1)
    values = [ser(big_record(i, rng), ctx) for i in range(4096)]
    nbytes = sum(len(v) for v in values)
    decoder = kfeed.Avro(registry=registry).decoder(BIG_SCHEMA)
    out = {f.name: np.zeros((4096, *f.shape), f.storage) for f in BIG_SCHEMA.fields}
    target = BIG_SCHEMA.bind(out)
    src = np.frombuffer(b"".join(values), np.uint8)
    dst = np.empty_like(src)
    best = {"decode": 0.0, "memcpy": 0.0}
    for _ in range(repeat * 20):
        t = time.perf_counter()
        res = decoder.decode_into(values, target, 0)
        best["decode"] = max(best["decode"], nbytes / (time.perf_counter() - t))
        assert res.rows == 4096
        t = time.perf_counter()
        np.copyto(dst, src)
        best["memcpy"] = max(best["memcpy"], nbytes / (time.perf_counter() - t))
    return best["decode"] / 1e9, best["memcpy"] / 1e9


def convert_runs(bootstrap: str, registry: Any, big: bool, n: int, repeat: int) -> None:
    """``kfeed.convert`` of an Avro topic to blocks, and the loader on both topics."""
    schema = BIG_SCHEMA if big else SMALL_SCHEMA
    avro_topic, size, _runs = avro_runs(bootstrap, registry, big, n)
    fmt = kfeed.Avro(registry=registry)
    best = {"convert": 0.0, "loader on the Avro topic": 0.0, "loader on the block topic": 0.0}
    topics = [avro_topic]
    for _ in range(repeat):
        blocks = f"{avro_topic}.blocks-{uuid.uuid4().hex[:6]}"
        topics.append(blocks)
        t = time.perf_counter()
        stats = kfeed.convert({"bootstrap.servers": bootstrap}, avro_topic, blocks, schema,
                              format=fmt)
        best["convert"] = max(best["convert"], stats.records / (time.perf_counter() - t))
        assert stats.records == n, stats
        for name, topic, f in (("loader on the Avro topic", avro_topic, fmt),
                               ("loader on the block topic", blocks, "block")):
            t = time.perf_counter()
            got = run_kfeed(bootstrap, topic, schema, f)
            best[name] = max(best[name], got / (time.perf_counter() - t))
            assert got == n, (name, got, n)
    AdminClient({"bootstrap.servers": bootstrap}).delete_topics(topics)
    print(f"\nconvert, {'3 KB' if big else '200 B'} Avro events ({size} bytes each, {n:,}), "
          f"records/s, best of {repeat}:")
    print(f"| kfeed.convert, Avro -> blocks (transactions of up to 10,000 messages) | "
          f"{best['convert']:,.0f} ({best['convert'] * size / 1e6:,.1f} MB/s in) |")
    for name in ("loader on the Avro topic", "loader on the block topic"):
        print(f"| {name} | {best[name]:,.0f} |")
    print(f"| block topic / Avro topic | "
          f"{best['loader on the block topic'] / best['loader on the Avro topic']:.2f}x |")


def documents_micro(registry: Any, repeat: int) -> dict[str, dict[str, float]]:
    """Token documents (about 500 int ids each), framed: kfeed's decode_documents against
    the per-message loops users write (to one flat array and lengths), tokens/s."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50_000, int(rng.integers(100, 900))).tolist() for _ in range(2000)]
    ntok = sum(len(d) for d in docs)
    ctx = SerializationContext("docs", MessageField.VALUE)
    writer = {"type": "record", "name": "Doc", "fields": [
        {"name": "id", "type": "long"}, {"name": "ids", "type": {"type": "array",
                                                                 "items": "int"}}]}
    avro_vals = [AvroSerializer(registry, json.dumps(writer))({"id": i, "ids": d}, ctx)
                 for i, d in enumerate(docs)]
    parsed = fastavro.parse_schema(writer)
    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="bench_doc.proto", package="bench",
                                             syntax="proto3")
    m = fdp.message_type.add(name="Doc")
    m.field.add(name="id", number=1, type=f.TYPE_INT64, label=f.LABEL_OPTIONAL)
    m.field.add(name="ids", number=2, type=f.TYPE_INT32, label=f.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    doc = message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Doc"))
    pb_vals = [ProtobufSerializer(doc, registry, {"use.deprecated.format": False})(
        doc(id=i, ids=d), ctx) for i, d in enumerate(docs)]
    schema = kfeed.Schema({"tokens": ("int32", (None,), {"source": "ids"})})
    avro_dec = kfeed.Avro(registry=registry).decoder(schema)
    pb_dec = kfeed.Protobuf(message=doc, registry=registry).decoder(schema)

    def flat(arrays: list[Any]) -> None:
        lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
        np.concatenate([np.asarray(a, np.int32) for a in arrays]), lengths

    runs = {
        "avro": {"kfeed": lambda: avro_dec.decode_documents(avro_vals),
                 "fastavro loop": lambda: flat([fastavro.schemaless_reader(
                     io.BytesIO(v[5:]), parsed, None)["ids"] for v in avro_vals])},
        "protobuf": {"kfeed": lambda: pb_dec.decode_documents(pb_vals),
                     "ParseFromString loop": lambda: flat([doc.FromString(v[6:]).ids
                                                           for v in pb_vals])},
    }
    best: dict[str, dict[str, float]] = {k: dict.fromkeys(r, 0.0) for k, r in runs.items()}
    for _ in range(repeat):
        for fmt, contenders in runs.items():
            for name, run in contenders.items():
                t = time.perf_counter()
                run()
                best[fmt][name] = max(best[fmt][name], ntok / (time.perf_counter() - t))
    return best


def jagged_micro(registry: Any, repeat: int) -> dict[str, dict[str, float]]:
    """Events with a 20-long array, as Avro and as JSON, through the loader from memory,
    records/s: the array as a fixed shape against the same array as a jagged field
    (elements, offsets)."""
    writer = {"type": "record", "name": "View", "fields": [
        {"name": "id", "type": "long"},
        {"name": "features", "type": {"type": "array", "items": "float"}},
        {"name": "recent", "type": {"type": "array", "items": "long"}}]}
    ser = AvroSerializer(registry, json.dumps(writer))
    ctx = SerializationContext("views", MessageField.VALUE)
    rng = np.random.default_rng(0)
    events = [{"id": i, "features": rng.standard_normal(16).tolist(),
               "recent": rng.integers(0, 10**9, 20).tolist()} for i in range(50_000)]
    inputs = {"Avro": ([ser(e, ctx) for e in events], kfeed.Avro(registry=registry)),
              "JSON": ([json.dumps(e).encode() for e in events], kfeed.Json())}
    schemas = {
        "fixed shape (20,)": kfeed.Schema({"id": ("int64", ()), "features": ("float32", (16,)),
                                           "recent": ("int64", (20,))}),
        "jagged (None,)": kfeed.Schema({"id": ("int64", ()), "features": ("float32", (16,)),
                                        "recent": ("int64", (None,))}),
    }
    best = {fmt: dict.fromkeys(schemas, 0.0) for fmt in inputs}
    for _ in range(repeat):
        for fmt, (vals, record_format) in inputs.items():
            for name, schema in schemas.items():
                best[fmt][name] = max(best[fmt][name], loader_rate(vals, schema, record_format))
    return best


def loader_rate(values: list[bytes], schema: kfeed.Schema, fmt: Any) -> float:
    """Records/s of a loader reading ``values`` of format ``fmt`` from memory to their end.

    The garbage of the runs before is collected first, off the clock: a
    closed loader's message objects wait for the cyclic collector, whose
    full pass (170 ms beside this script's 50,000 events) would otherwise
    land in every other run.
    """
    from kfeed.loader import memory_loader

    gc.collect()
    t = time.perf_counter()
    n = 0
    with memory_loader(values, schema, 256, device="cpu", until="end", format=fmt) as loader:
        for batch in loader:
            n += batch.size
    return n / (time.perf_counter() - t)


def arrow_micro(repeat: int) -> list[tuple[str, dict[str, float]]]:
    """The same records as kfeed blocks and as Arrow IPC messages, through the loader from
    memory, records/s: the seeds' 3 KB rows and 200 B rows (a dozen numeric columns and a
    16-float vector), 64 records a message for both, and Arrow at 1,024 a message too."""
    from kfeed.arrowformat import ArrowEncoder
    from kfeed.synthetic import synthetic_columns, synthetic_schema

    big = synthetic_schema()
    small = kfeed.Schema({**{f"c{i}": ("int64" if i % 2 else "float64", ()) for i in range(12)},
                          "vec": ("float32", (16,))})
    rng = np.random.default_rng(0)
    n_small = 200_000
    cases = [("3 KB rows", big, synthetic_columns(np.arange(60_000))),
             ("200 B rows", small, {**{f"c{i}": (rng.integers(0, 10**9, n_small) if i % 2 else
                                                 rng.standard_normal(n_small))
                                       for i in range(12)},
                                    "vec": rng.standard_normal((n_small, 16), np.float32)})]
    out = []
    for label, schema, cols in cases:
        values = {"block, 64 a message": ("block", schema.encode_blocks(cols, 64)),
                  "arrow, 64 a message": ("arrow", ArrowEncoder(schema).encode_blocks(
                      cols, 64, 1 << 30)),
                  "arrow, 1024 a message": ("arrow", ArrowEncoder(schema).encode_blocks(
                      cols, 1024, 1 << 30))}
        best = dict.fromkeys(values, 0.0)
        for _ in range(repeat):
            for name, (fmt, vals) in values.items():
                best[name] = max(best[name], loader_rate(vals, schema, fmt))
        out.append((label, best))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap", default=os.environ.get("KFEED_BOOTSTRAP"))
    p.add_argument("--formats", default="avro,protobuf,json")
    p.add_argument("--samples", type=int, default=60_000)
    p.add_argument("--small-samples", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    registry = SchemaRegistryClient.new_client({"url": "mock://bench"})
    formats = args.formats.split(",")
    if not args.bootstrap and set(formats) - {"documents", "jagged", "arrow", "pbmemory"}:
        raise SystemExit("set KFEED_BOOTSTRAP or --bootstrap (e.g. kfeed cluster up)")
    if "documents" in formats:
        for fmt, best in documents_micro(registry, args.repeat).items():
            print(f"\n{fmt} token documents (2,000 of 100-900 int ids), tokens/s, "
                  f"best of {args.repeat}:")
            for name, rate in best.items():
                ratio = "" if name == "kfeed" else f" | kfeed / this = {best['kfeed'] / rate:.2f}x"
                print(f"| {name} | {rate:,.0f}{ratio} |")
        formats.remove("documents")
    if "arrow" in formats:
        for label, best in arrow_micro(args.repeat):
            block = best["block, 64 a message"]
            print(f"\n{label} through the loader from memory, records/s, best of {args.repeat}:")
            for name, rate in best.items():
                ratio = "" if name.startswith("block") else f" | this / block = {rate / block:.2f}x"
                print(f"| {name} | {rate:,.0f}{ratio} |")
        formats.remove("arrow")
    if "pbmemory" in formats:
        for label, big, n in (("3 KB", True, args.samples), ("200 B", False, args.small_samples)):
            size, best = protobuf_memory(registry, big, n, args.repeat)
            print(f"\nprotobuf from memory, {label} events ({size} bytes each, {n:,} of them), "
                  f"records/s, best of {args.repeat}:")
            loop = best["ParseFromString loop"]
            for name, rate in best.items():
                ratio = "" if name == "ParseFromString loop" else \
                    f" | this / loop = {rate / loop:.2f}x (target >= 10x)"
                print(f"| {name} | {rate:,.0f}{ratio} |")
        formats.remove("pbmemory")
    if "jagged" in formats:
        for fmt, best in jagged_micro(registry, args.repeat).items():
            print(f"\n{fmt} events (id, 16 floats, 20 longs) through the loader from memory, "
                  f"records/s, best of {args.repeat}:")
            for name, rate in best.items():
                print(f"| {name} | {rate:,.0f} |")
            print(f"| jagged / fixed | "
                  f"{best['jagged (None,)'] / best['fixed shape (20,)']:.2f}x |")
        formats.remove("jagged")
    if not formats:
        return
    if "avro" in formats:
        decode, memcpy = micro(registry, args.repeat)
        print(f"| Avro decode, 4,096 records of 3 KB | {decode:.2f} GB/s | memcpy "
              f"{memcpy:.2f} GB/s | {decode / memcpy:.2f}x (target >= 0.5x) |")
    if "json" in formats:
        for label, big in (("3 KB", True), ("200 B", False)):
            best = json_micro(big, args.repeat)
            print(f"\nJSON decode of 4,096 {label} events into numpy columns, records/s:")
            for name, rate in best.items():
                ratio = "" if name == "kfeed" else f" | kfeed / this = {best['kfeed'] / rate:.2f}x"
                print(f"| {name} | {rate:,.0f}{ratio} |")
    if "convert" in formats:
        for big, n in ((True, args.samples), (False, args.small_samples)):
            convert_runs(args.bootstrap, registry, big, n, args.repeat)
        formats.remove("convert")
    admin = AdminClient({"bootstrap.servers": args.bootstrap})
    makers = {"avro": avro_runs, "protobuf": protobuf_runs, "json": json_runs}
    for fmt in formats:
        for label, big, n in (("3 KB", True, args.samples), ("200 B", False, args.small_samples)):
            topic, size, runs = makers[fmt](args.bootstrap, registry, big, n)
            best = dict.fromkeys(runs, 0.0)
            for _ in range(args.repeat):
                for name, run in runs.items():
                    t = time.perf_counter()
                    got = run()
                    best[name] = max(best[name], got / (time.perf_counter() - t))
                    assert got == n, (name, got, n)
            admin.delete_topics([topic])
            k = best["kfeed"]
            print(f"\n{fmt}, {label} events ({size} bytes each, {n:,} of them), records/s, "
                  f"best of {args.repeat}:")
            for name, rate in best.items():
                ratio = "" if name == "kfeed" else f" | kfeed / this = {k / rate:.2f}x"
                print(f"| {name} | {rate:,.0f}{ratio} |")


if __name__ == "__main__":
    main()
