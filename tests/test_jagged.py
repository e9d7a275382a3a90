"""Variable-length fields without pack: jagged batches of elements and offsets.

A schema with a ``(None,)`` field read without ``pack=`` gives, per batch,
``NAME`` (the records' elements, one after another) and ``NAME_offsets``
(``size + 1`` int64). Every record's elements must equal what was written
(kfeed's blocks) or what the format's own reader gives (Avro, Protobuf, JSON),
once each, across a resume from ``state_dict()``.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch
from confluent_kafka import Producer as KafkaProducer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

import kfeed
from kfeed.loader import memory_loader
from kfeed.pool import JAGGED_START

SCHEMA = kfeed.Schema({"label": ("int64", ()), "items": ("int32", (None,)),
                       "w": ("bfloat16", (2,))})


def records(batch: dict) -> list[tuple[int, list[int]]]:
    """(label, items) of each record of a batch, read through its offsets."""
    offs, items = batch["items_offsets"].tolist(), batch["items"].tolist()
    assert len(offs) == batch.size + 1 and offs[0] == 0 and offs[-1] == len(items)
    return [(label, items[offs[i]:offs[i + 1]]) for i, label in
            enumerate(batch["label"].tolist())]


def written(n: int, seed: int = 0, longest: int = 300) -> dict:
    rng = np.random.default_rng(seed)
    return {"label": np.arange(n),
            "items": [rng.integers(0, 10**6, int(rng.integers(0, longest)), dtype=np.int32)
                      for _ in range(n)],
            "w": torch.from_numpy(rng.standard_normal((n, 2)).astype(np.float32)).bfloat16()}


def test_kfeeds_blocks_give_every_record_once_across_a_resume():
    cols = written(3000, longest=4 * JAGGED_START)  # batches outgrow the slot's first size
    values = SCHEMA.encode_blocks(cols, block_records=37)  # blocks cut between batches
    want = [(i, d.tolist()) for i, d in enumerate(cols["items"])]
    with memory_loader(values, SCHEMA, 64, device="cpu", until="end") as loader:
        seen = [r for _, b in zip(range(20), loader) for r in records(b)]
        state = loader.state_dict()
        first = next(iter(loader))
        assert first["w"].dtype == torch.bfloat16 and first["w"].shape == (first.size, 2)
        assert first["items"].dtype == torch.int32 and first["items_offsets"].dtype == torch.int64
    with memory_loader(values, SCHEMA, 64, device="cpu", until="end") as loader:
        loader.load_state_dict(state)
        seen += [r for b in loader for r in records(b)]
    assert seen == want
    # A batch is what torch's jagged nested tensors take as is.
    nested = torch.nested.nested_tensor_from_jagged(first["items"], first["items_offsets"])
    assert [t.tolist() for t in nested.unbind()] == [r[1] for r in records(first)]


def test_batches_in_offset_order_say_their_offsets_and_their_latency_as_fixed_ones_do():
    # Records with a variable-length field go through the order, and their
    # batches had no offsets and no end-to-end latency: the metric was empty.
    cols = written(500, longest=20)
    fixed = kfeed.Schema({"label": ("int64", ()), "w": ("bfloat16", (2,))})
    said = {}
    for name, schema in (("jagged", SCHEMA), ("fixed", fixed)):
        values = schema.encode_blocks({k: cols[k] for k in schema.names}, block_records=37)
        with memory_loader(values, schema, 64, device="cpu", until="end") as loader:
            said[name] = [b.offsets for b in loader]
            hist = loader.stats()["latency_histogram"]
        assert hist.cumulative()[-1][1] == len(said[name]), name
    assert said["jagged"] == said["fixed"]
    assert said["jagged"][0][("memory", 0)][0] == (0, 0)
    assert said["jagged"][-1][("memory", 0)][1] == (len(values), 0)
    assert all(a[("memory", 0)][1] == b[("memory", 0)][0]
               for a, b in zip(said["jagged"], said["jagged"][1:]))


def test_a_schema_of_the_field_alone_reads_raw_values():
    schema = kfeed.Schema({"items": ("int16", (None,))})
    docs = [np.arange(k, dtype=np.int16) for k in range(200)]
    with memory_loader(schema.encode_raw({"items": docs}), schema, 32, device="cpu",
                       until="end", format="raw") as loader:
        got = []
        for b in loader:
            offs = b["items_offsets"].tolist()
            got += [b["items"][offs[i]:offs[i + 1]].tolist() for i in range(b.size)]
    assert got == [d.tolist() for d in docs]


AVRO = {
    "type": "record", "name": "View", "namespace": "shop", "fields": [
        {"name": "id", "type": "long"},
        {"name": "features", "type": {"type": "array", "items": "float"}},
        {"name": "recent", "type": ["null", {"type": "array", "items": "long"}]},
        {"name": "page", "type": "string"},
    ],
}
VIEWS = kfeed.Schema({
    "id": ("int64", ()),
    "features": ("float32", (4,)),
    "recent": ("int64", (None,), {"default": []}),   # items viewed before: any number
})


def views(registry, n: int) -> tuple[list[bytes], list[dict]]:
    rng = np.random.default_rng(1)
    ctx = SerializationContext("views", MessageField.VALUE)
    ser = AvroSerializer(registry, json.dumps(AVRO))
    recs = [{"id": i, "features": rng.standard_normal(4).tolist(),
             "recent": None if i % 9 == 0 else rng.integers(0, 10**9, int(rng.integers(0, 40)))
             .tolist(), "page": "/p" * (i % 3)} for i in range(n)]
    values = [ser(r, ctx) for r in recs]
    de = AvroDeserializer(registry)
    return values, [de(v, ctx) for v in values]


def copies(loader: kfeed.Loader) -> list[dict]:
    """Every batch of ``loader``, its tensors copied (a slot is reused once let go)."""
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def check_views(batches: list[dict], back: list[dict], skip: set[int]) -> None:
    got = {}
    for b in batches:
        offs, recent = b["recent_offsets"].tolist(), b["recent"].tolist()
        assert len(offs) == len(b["id"]) + 1 and offs[-1] == len(recent)
        for i, rid in enumerate(b["id"].tolist()):
            got[rid] = (recent[offs[i]:offs[i + 1]], b["features"][i].tolist())
    want = {r["id"]: (r["recent"] or [], np.float32(r["features"]).tolist())
            for i, r in enumerate(back) if i not in skip}
    assert got == want


def test_avro_events_with_an_array_of_any_length_equal_the_deserializers():
    registry = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
    values, back = views(registry, 2000)
    values[5] = values[5][:-4]  # truncated: rejected whole, neither pass keeps it
    with memory_loader(values, VIEWS, 100, device="cpu", until="end", on_bad_record="skip",
                       format=kfeed.Avro(registry=registry)) as loader:
        batches = copies(loader)
        assert loader.stats()["bad_records"] == 1
    check_views(batches, back, {5})


def test_json_and_protobuf_events_read_the_same_way():
    from records import message_class

    rng = np.random.default_rng(2)
    events = [{"id": i, "features": rng.standard_normal(4).tolist(),
               "recent": rng.integers(0, 10**9, int(rng.integers(0, 30))).tolist()}
              for i in range(500)]
    view = message_class("v", "View", [("id", "int64", False), ("features", "float", True),
                                       ("recent", "int64", True)])
    inputs = {"json": ([json.dumps(e).encode() for e in events], kfeed.Json()),
              "protobuf": ([view(**e).SerializeToString() for e in events],
                           kfeed.Protobuf(message=view))}
    back = [{**e, "features": np.float32(e["features"]).tolist()} for e in events]
    for values, fmt in inputs.values():
        with memory_loader(values, VIEWS, 64, device="cpu", until="end", format=fmt) as loader:
            batches = copies(loader)
        check_views(batches, back, set())


@pytest.mark.integration
def test_a_kafka_topic_of_avro_events_through_the_loader(bootstrap, make_topic):
    registry = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
    topic = make_topic(partitions=3)
    values, back = views(registry, 5000)
    p = KafkaProducer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for v in values:
        p.produce(topic, v)
    assert p.flush(60) == 0
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    with kfeed.Loader(config, topic, VIEWS, 256, device="cpu", until="end",
                      format=kfeed.Avro(registry=registry)) as loader:
        batches = copies(loader)
    check_views(batches, back, set())
