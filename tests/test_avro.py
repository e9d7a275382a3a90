"""Avro topics as other services write them: kfeed's batches against confluent-kafka's own reader.

The values come from confluent-kafka's ``AvroSerializer`` (Confluent framing,
schemas registered in its in-memory registry client, ``mock://``) and from
fastavro's ``schemaless_writer``; never from kfeed. Every field of every
record kfeed decodes must equal what ``AvroDeserializer`` returns.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import uuid

import fastavro
import numpy as np
import pytest
from confluent_kafka import Producer as KafkaProducer
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from records import check_packed_documents, damage, decode_all, read_columns, read_dlq

import kfeed
from kfeed import avro, formats
from kfeed.sources import MemorySource

TOPIC = "clicks"
CTX = SerializationContext(TOPIC, MessageField.VALUE)
N_FEATURES = 16

USER = {
    "type": "record", "name": "User", "fields": [
        {"name": "age", "type": "int"},
        {"name": "country", "type": {"type": "enum", "name": "Country",
                                     "symbols": ["US", "DE", "FR", "JP"]}},
        {"name": "weights", "type": {"type": "array", "items": "double"}},
        {"name": "tags", "type": {"type": "map", "values": "string"}},
    ],
}
V1 = {
    "type": "record", "name": "Click", "namespace": "shop.events", "fields": [
        {"name": "id", "type": "long"},
        {"name": "features", "type": {"type": "array", "items": "float"}},
        {"name": "label", "type": "int"},
        {"name": "score", "type": ["null", "double"], "default": None},
        {"name": "user", "type": ["null", USER], "default": None},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "note", "type": "string"},
        {"name": "digest", "type": {"type": "fixed", "name": "Digest", "size": 4}},
    ],
}
# The schema evolves mid-topic: label widens to long, a field is added.
V2 = json.loads(json.dumps(V1))
V2["fields"][2]["type"] = "long"
V2["fields"].append({"name": "extra", "type": "float", "default": 0.0})

SCHEMA = kfeed.Schema({
    "id": ("int64", ()),
    "features": ("float32", (N_FEATURES,)),
    "label": ("int32", ()),
    "score": ("float32", (), {"default": -1.0}),
    "age": ("int16", (), {"source": "user.age", "default": -1}),
    "country": ("int8", (), {"source": "user.country", "default": -1}),
    "weights": ("float32", (3,), {"source": "user.weights", "default": 0.0}),
    "ts": ("int64", ()),
    "day": ("int32", ()),
    "digest": ("uint8", (4,)),
    "extra": ("float32", (), {"default": 0.0}),
})
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def make_record(i: int, rng: np.random.Generator) -> dict:
    return {
        "id": i,
        "features": rng.standard_normal(N_FEATURES).astype(np.float32).tolist(),
        "label": int(rng.integers(-1000, 1000)),
        "score": None if i % 3 == 0 else float(rng.standard_normal()),
        "user": None if i % 5 == 0 else {
            "age": int(rng.integers(0, 100)),
            "country": ["US", "DE", "FR", "JP"][i % 4],
            "weights": rng.standard_normal(3).tolist(),
            "tags": {f"k{j}": "v" * j for j in range(i % 3)},
        },
        "ts": EPOCH + dt.timedelta(milliseconds=1_700_000_000_000 + i),
        "day": dt.date(2024, 1, 1) + dt.timedelta(days=i % 400),
        "note": "n" * (i % 17),
        "digest": int(i).to_bytes(4, "little"),
    }


def expected_columns(records: list[dict]) -> dict[str, np.ndarray]:
    """The columns kfeed should give, from what confluent-kafka's deserializer returned."""
    cols: dict[str, list] = {f.name: [] for f in SCHEMA.fields}
    symbols = USER["fields"][1]["type"]["symbols"]
    for r in records:
        user = r["user"]
        cols["id"].append(r["id"])
        cols["features"].append(r["features"])
        cols["label"].append(r["label"])
        cols["score"].append(-1.0 if r["score"] is None else r["score"])
        cols["age"].append(-1 if user is None else user["age"])
        cols["country"].append(-1 if user is None else symbols.index(user["country"]))
        cols["weights"].append([0.0] * 3 if user is None else user["weights"])
        cols["ts"].append((r["ts"] - EPOCH) // dt.timedelta(milliseconds=1))
        cols["day"].append((r["day"] - dt.date(1970, 1, 1)).days)
        cols["digest"].append(list(r["digest"]))
        cols["extra"].append(r.get("extra", 0.0))
    return {f.name: np.array(cols[f.name]).astype(f.storage) for f in SCHEMA.fields}


@pytest.fixture
def registry() -> SchemaRegistryClient:
    # The in-memory registry keeps its schemas per client: kfeed gets this one.
    return SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})


def serialized(registry: SchemaRegistryClient, n: int) -> tuple[list[bytes], list[dict]]:
    """n records, the first half written with V1 and the rest with V2, and how they read back."""
    rng = np.random.default_rng(7)
    first = AvroSerializer(registry, json.dumps(V1))
    second = AvroSerializer(registry, json.dumps(V2))
    values = []
    for i in range(n):
        rec = make_record(i, rng)
        if i >= n // 2:
            rec["extra"] = float(i) / 8
            values.append(second(rec, CTX))
        else:
            values.append(first(rec, CTX))
    reader = AvroDeserializer(registry)
    return values, [reader(v, CTX) for v in values]


def test_every_field_equals_confluent_kafkas_deserializer_across_a_schema_change(registry):
    values, records = serialized(registry, 10_000)
    assert values[0][1:5] != values[-1][1:5]  # two schema ids in the topic
    got, bad = decode_all(kfeed.Avro(registry=registry).decoder(SCHEMA), SCHEMA, values)
    assert bad == []
    want = expected_columns(records)
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(got[f.name], want[f.name], err_msg=f.name)
    # Both branches of every union, and both schemas, were really exercised.
    assert (got["score"] == -1).any() and (got["score"] != -1).any()
    assert (got["age"] == -1).any() and (got["age"] != -1).any()
    assert set(np.unique(got["country"])) == {-1, 0, 1, 2, 3}
    assert (got["extra"][:5000] == 0).all() and (got["extra"][5001:] > 0).all()


def test_plain_avro_without_framing_from_fastavro():
    parsed = fastavro.parse_schema(json.loads(json.dumps(V1)))
    rng = np.random.default_rng(3)
    records, values = [], []
    for i in range(500):
        rec = make_record(i, rng)
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, rec)
        values.append(buf.getvalue())
        buf.seek(0)
        records.append(fastavro.schemaless_reader(buf, parsed, None))
    got, bad = decode_all(kfeed.Avro(schema=V1).decoder(SCHEMA), SCHEMA, values, rows=64)
    assert bad == []
    want = expected_columns(records)
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(got[f.name], want[f.name], err_msg=f.name)


def corrupt_values(registry: SchemaRegistryClient) -> tuple[list[bytes], dict[int, str]]:
    """Good values with corrupt ones between them; for each corrupt one, a part of its reason."""
    rng = np.random.default_rng(1)
    write = AvroSerializer(registry, json.dumps(V1))
    good = [write(make_record(i, rng), CTX) for i in range(6)]
    short = make_record(100, rng)
    short["features"] = short["features"][:-1]
    old = make_record(101, rng)
    old["user"] = dict(old["user"] or make_record(1, rng)["user"], age=40_000)
    values = [
        good[0],
        b"\x01" + good[1][1:],                              # wrong magic byte
        good[1],
        b"\x00" + (9999).to_bytes(4, "big") + good[2][5:],  # an id the registry lacks
        good[2][:-3],                                       # truncated
        good[3],
        write(short, CTX),                                  # 15 features, not 16
        b"\x00\x00",                                        # shorter than the framing
        write(old, CTX),                                    # 40000 in an int16
        good[3] + b"\x00",                                  # a byte after the record
        good[4],
    ]
    reasons = {1: "magic byte 1, expected 0", 3: "schema id 9999 is not in the registry",
               4: "truncated", 6: "array of 15 items does not match the field's shape at "
               "features", 7: "too short for the Confluent framing",
               8: "40000 does not fit field 'age' (int16) at user.age",
               9: "1 bytes left after the record"}
    return values, reasons


def test_corrupt_frames_are_rejected_whole_with_a_reason_and_neighbours_are_intact(registry):
    values, reasons = corrupt_values(registry)
    got, bad = decode_all(kfeed.Avro(registry=registry).decoder(SCHEMA), SCHEMA, values, rows=4)
    assert [i for i, _ in bad] == sorted(reasons)
    for i, why in bad:
        assert reasons[i] in why, (i, why)
    assert got["id"].tolist() == [0, 1, 3, 4]


def test_a_schema_id_the_registry_had_not_yet_is_asked_again(registry, monkeypatch):
    # A value of a schema registered a moment after it was first met (a
    # registry replica behind its leader) was bad for the loader's life: the
    # registry's "no such id" was kept as the id's plan for good.
    import kfeed.formats

    rng = np.random.default_rng(3)
    first = AvroSerializer(registry, json.dumps(V1))(make_record(0, rng), CTX)
    # The writer's registry, ahead of the one the loader asks: V2 is its next id.
    ahead = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
    assert AvroSerializer(ahead, json.dumps(V1))(make_record(0, rng), CTX)[1:5] == first[1:5]
    later = AvroSerializer(ahead, json.dumps(V2))(dict(make_record(1, rng), extra=0.5), CTX)
    sid = int.from_bytes(later[1:5], "big")
    decoder = kfeed.Avro(registry=registry).decoder(SCHEMA)
    _got, bad = decode_all(decoder, SCHEMA, [first, later])
    assert bad == [(1, f"schema id {sid} is not in the registry")]
    assert registry.register_schema("loader-side", Schema(json.dumps(V2), "AVRO")) == sid
    _got, bad = decode_all(decoder, SCHEMA, [later])
    assert len(bad) == 1  # asked again once ABSENT_RETRY_S passed, not at every record
    monkeypatch.setattr(kfeed.formats, "ABSENT_RETRY_S", 0.0)
    got, bad = decode_all(decoder, SCHEMA, [first, later])
    assert bad == [] and got["id"].tolist() == [0, 1]


def test_a_writer_schema_without_a_field_of_a_default_is_said_once(registry, caplog):
    # A writer that renamed 'age' to 'years' (with an alias, which only an
    # Avro reader's schema honours) was read with age's default, in silence.
    schema = kfeed.Schema({"id": ("int64", ()), "age": ("int32", (), {"default": -1})})

    def writer(field: dict) -> str:
        return json.dumps({"type": "record", "name": "P", "fields": [
            {"name": "id", "type": "long"}, field]})

    values = [AvroSerializer(registry, writer({"name": "age", "type": "int"}))(
        {"id": 0, "age": 30}, CTX)]
    values += [AvroSerializer(registry, writer({"name": "years", "type": "int",
                                                "aliases": ["age"]}))({"id": i, "years": 40},
                                                                      CTX) for i in (1, 2)]
    values.append(AvroSerializer(registry, writer({"name": "age", "type": "string"}))(
        {"id": 3, "age": "x"}, CTX))  # given, as what it cannot be: bad, not a default
    renamed = int.from_bytes(values[1][1:5], "big")
    with caplog.at_level("WARNING", logger="kfeed"):
        got, bad = decode_all(kfeed.Avro(registry=registry).decoder(schema), schema, values)
    assert got["id"].tolist() == [0, 1, 2] and got["age"].tolist() == [30, -1, -1]
    assert [i for i, _ in bad] == [3]
    said = [r.getMessage() for r in caplog.records if "gives no value" in r.getMessage()]
    assert said == [f"schema id {renamed} gives no value for 'age' (source 'age', default -1): "
                    f"its records read the default; Avro fields are matched by name, so a "
                    f"field the writer renamed reads so too"]


def test_schema_references_to_other_subjects_read_as_confluent_kafkas_deserializer(registry):
    # A named type registered under a subject of its own, which itself refers
    # to another: the writer schema alone names them without defining them.
    from confluent_kafka.schema_registry import SchemaReference

    def register(subject: str, schema: dict, refs: list) -> SchemaReference:
        registry.register_schema(subject, Schema(json.dumps(schema), "AVRO", refs))
        return SchemaReference(subject, subject, registry.get_latest_version(subject).version)

    unit = register("acme.Unit", {"type": "enum", "name": "Unit", "namespace": "acme",
                                  "symbols": ["G", "KG"]}, [])
    weight = register("acme.Weight", {"type": "record", "name": "Weight", "namespace": "acme",
                                      "fields": [{"name": "value", "type": "double"},
                                                 {"name": "unit", "type": "acme.Unit"}]}, [unit])
    parcel = Schema(json.dumps({"type": "record", "name": "Parcel", "namespace": "acme",
                                "fields": [{"name": "id", "type": "long"},
                                           {"name": "weight", "type": "acme.Weight"}]}),
                    "AVRO", [weight])
    registry.register_schema("parcels-value", parcel)
    ctx = SerializationContext("parcels", MessageField.VALUE)
    serialize = AvroSerializer(registry, parcel, conf={"auto.register.schemas": False,
                                                       "use.latest.version": True})
    records = [{"id": i, "weight": {"value": i / 4, "unit": ["G", "KG"][i % 2]}}
               for i in range(5)]
    values = [serialize(r, ctx) for r in records]
    schema = kfeed.Schema({"id": ("int64", ()),
                           "kg": ("float32", (), {"source": "weight.value"}),
                           "unit": ("int8", (), {"source": "weight.unit"})})
    got, bad = decode_all(kfeed.Avro(registry=registry).decoder(schema), schema, values)
    want = [AvroDeserializer(registry)(v, ctx) for v in values]
    assert bad == []
    assert got["id"].tolist() == [w["id"] for w in want]
    assert got["kg"].tolist() == [w["weight"]["value"] for w in want]
    assert got["unit"].tolist() == [["G", "KG"].index(w["weight"]["unit"]) for w in want]


def test_null_without_default_and_a_type_the_field_cannot_take():
    writer = {"type": "record", "name": "R", "fields": [
        {"name": "x", "type": ["null", "long"]},
        {"name": "name", "type": "string"},
    ]}
    parsed = fastavro.parse_schema(writer)

    def value(rec):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, rec)
        return buf.getvalue()

    vals = [value({"x": 5, "name": "a"}), value({"x": None, "name": "b"})]
    schema = kfeed.Schema({"x": ("int64", ())})
    out = {"x": np.zeros(4, np.int64)}
    res = kfeed.Avro(schema=writer).decoder(schema).decode_into(vals, schema.bind(out), 0)
    assert res.rows == 1 and out["x"][0] == 5
    assert res.bad == [(1, "field 'x': missing or null, and no default")]

    as_float = kfeed.Schema({"name": ("float32", ())})
    res = kfeed.Avro(schema=writer).decoder(as_float).decode_into(
        vals, as_float.bind({"name": np.zeros(4, np.float32)}), 0)
    assert res.rows == 0
    assert res.bad[0][1] == ("cannot be read at name: a string cannot be field 'name' "
                             "(float32)")
    # A double never goes into an integer field (numpy's same_kind casting).
    with_double = {"type": "record", "name": "D", "fields": [{"name": "x", "type": "double"}]}
    res = kfeed.Avro(schema=with_double).decoder(schema).decode_into(
        [b"\x00" * 8], schema.bind(out), 0)
    assert res.rows == 0 and "a double cannot be field 'x' (int64)" in res.bad[0][1]


def test_recursive_types_are_skipped_and_bounded():
    node = {"type": "record", "name": "Node", "fields": [
        {"name": "v", "type": "long"},
        {"name": "next", "type": ["null", "Node"]},
    ]}
    writer = {"type": "record", "name": "Top", "fields": [
        {"name": "id", "type": "long"}, {"name": "list", "type": node}]}
    parsed = fastavro.parse_schema(writer)
    chain = None
    for v in range(50):
        chain = {"v": v, "next": chain}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, {"id": 7, "list": chain})
    schema = kfeed.Schema({"id": ("int64", ()), "head": ("int64", (), {"source": "list.v"})})
    out = {"id": np.zeros(2, np.int64), "head": np.zeros(2, np.int64)}
    # Nested deeper than the decoder goes: a bad record, not a crashed stack.
    deep = b"\x0e" + b"\x00\x02" * 5000 + b"\x00\x00"
    res = kfeed.Avro(schema=writer).decoder(schema).decode_into(
        [buf.getvalue(), deep], schema.bind(out), 0)
    assert res.rows == 1 and out["id"][0] == 7 and out["head"][0] == 49
    assert res.bad[0][0] == 1 and "nested deeper than" in res.bad[0][1]


def test_records_nest_200_deep_through_their_unions_and_no_deeper():
    # The bound counted unions and arrays too, so a linked list failed at 101
    # records, "nested deeper than 200".
    node = {"type": "record", "name": "Node", "fields": [
        {"name": "id", "type": "long"}, {"name": "next", "type": ["null", "Node"]}]}
    parsed = fastavro.parse_schema(node)
    schema = kfeed.Schema({"id": ("int64", ())})
    values = []
    for depth in (101, 200, 201):
        chain = None
        for i in range(depth, 0, -1):
            chain = {"id": depth, "next": chain}
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, chain)
        values.append(buf.getvalue())
    out = {"id": np.zeros(3, np.int64)}
    res = kfeed.Avro(schema=node).decoder(schema).decode_into(values, schema.bind(out), 0)
    assert res.rows == 2 and out["id"][:2].tolist() == [101, 200]
    assert res.bad == [(2, "records nested deeper than 200 at next")]


def test_items_of_no_bytes_past_the_bound_say_so_not_truncated():
    writer = {"type": "record", "name": "R", "fields": [
        {"name": "id", "type": "long"}, {"name": "flags", "type": {"type": "array", "items": "null"}}]}
    parsed = fastavro.parse_schema(writer)
    schema = kfeed.Schema({"id": ("int64", ())})
    values = []
    for n in (65_536, 200_000):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, {"id": n, "flags": [None] * n})
        values.append(buf.getvalue())
    out = {"id": np.zeros(2, np.int64)}
    res = kfeed.Avro(schema=writer).decoder(schema).decode_into(values, schema.bind(out), 0)
    assert res.rows == 1 and out["id"][0] == 65_536
    assert res.bad == [(1, "a block of 200,000 items: past the record's bytes plus 65,536, the "
                           "bound on items that take no bytes (nulls, empty records) at flags")]


def test_a_truncated_value_names_the_field_it_ran_out_in_read_or_skipped():
    # "truncated" alone, wherever the value ran out but inside an array.
    writer = {"type": "record", "name": "R", "fields": [
        {"name": "id", "type": "long"}, {"name": "note", "type": "string"},
        {"name": "score", "type": "double"},
        {"name": "user", "type": {"type": "record", "name": "U", "fields": [
            {"name": "age", "type": "int"}, {"name": "tag", "type": "string"}]}}]}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(writer), {
        "id": 1, "note": "a note", "score": 0.5, "user": {"age": 3, "tag": "abc"}})
    value = buf.getvalue()  # id 1 byte, note 1 + 6, score 8, age 1, tag 1 + 3
    schema = kfeed.Schema({"id": ("int64", ()), "score": ("float64", ())})
    cuts = {0: "id", 4: "note", 10: "score", 16: "user.age", 18: "user.tag"}
    res = kfeed.Avro(schema=writer).decoder(schema).decode_into(
        [value[:cut] for cut in cuts], schema.bind(schema.empty(len(cuts))), 0)
    assert res.rows == 0
    assert res.bad == [(k, f"truncated at {where}") for k, where in enumerate(cuts.values())]


def _colors(symbols: list[str]) -> dict:
    return {"type": "record", "name": "Event", "namespace": "shop", "fields": [
        {"name": "id", "type": "long"},
        {"name": "color", "type": {"type": "enum", "name": "Color", "symbols": symbols}}]}


def test_enum_symbols_are_read_by_name_where_enums_names_them(registry, caplog):
    # A symbol added in the middle (compatible in Avro) moved BLUE from 1 to 2:
    # the same symbol read as two numbers, in silence.
    first = AvroSerializer(registry, json.dumps(_colors(["RED", "BLUE"])))
    second = AvroSerializer(registry, json.dumps(_colors(["RED", "GREEN", "BLUE"])))
    values = [first({"id": 0, "color": "BLUE"}, CTX), first({"id": 1, "color": "RED"}, CTX),
              second({"id": 2, "color": "BLUE"}, CTX), second({"id": 3, "color": "GREEN"}, CTX)]
    schema = kfeed.Schema({"id": ("int64", ()), "color": ("int32", ())})
    fmt = kfeed.Avro(registry=registry, enums={"shop.Color": ["RED", "GREEN", "BLUE"]})
    got, bad = decode_all(fmt.decoder(schema), schema, values)
    assert bad == [] and got["color"].tolist() == [2, 0, 2, 1]
    # Its short name does too; a symbol it does not name makes the record bad.
    fmt = kfeed.Avro(registry=registry, enums={"Color": ["BLUE", "RED"]})
    got, bad = decode_all(fmt.decoder(schema), schema, values)
    assert got["id"].tolist() == [0, 1, 2] and got["color"].tolist() == [0, 1, 0]
    assert bad == [(3, "the writer's enum symbol 'GREEN' is not among those enums= names at "
                       "color")]
    # Not named: the writer's index, and a warning where a writer renumbers.
    got, bad = decode_all(kfeed.Avro(registry=registry).decoder(schema), schema, values)
    assert bad == [] and got["color"].tolist() == [1, 0, 2, 1]
    assert "numbers the symbols of enum shop.Color otherwise" in caplog.text
    assert "BLUE moved" in caplog.text and "kfeed.Avro(enums={'shop.Color': [...]})" in caplog.text
    # A symbol the first schema lacked, moved by a later one: checked against
    # the schema that numbered it first (BLUE 2, then 3, read in silence).
    caplog.clear()
    values = [AvroSerializer(registry, json.dumps(_colors(symbols)))({"id": k, "color": "BLUE"
                                                                      if k else "RED"}, CTX)
              for k, symbols in enumerate([["RED", "GREEN"], ["RED", "GREEN", "BLUE"],
                                           ["RED", "GREEN", "YELLOW", "BLUE"]])]
    got, bad = decode_all(kfeed.Avro(registry=registry).decoder(schema), schema, values)
    assert bad == [] and got["color"].tolist() == [0, 2, 3]
    ids = [int.from_bytes(v[1:5], "big") for v in values]
    assert [r.getMessage() for r in caplog.records if "enum" in r.getMessage()] == [
        f"schema id {ids[2]} numbers the symbols of enum shop.Color otherwise than schema id "
        f"{ids[1]} (BLUE moved): the field reads each writer's index, so the same symbol "
        f"reads as two numbers; give kfeed.Avro(enums={{'shop.Color': [...]}}) to read "
        f"symbols by name"]
    with pytest.raises(kfeed.ConfigError, match=r"enums\['Color'\] must be a list of distinct"):
        kfeed.Avro(registry=registry, enums={"Color": ["RED", "RED"]})
    spec = kfeed.Avro(registry={"url": "mock://x"}, enums={"Color": ["RED"]})
    assert pickle.loads(pickle.dumps(spec)).enums == {"Color": ["RED"]}


def _stamped(unit: str, name: str = "Stamped") -> dict:
    ts = {"type": "long", "logicalType": f"timestamp-{unit}"}
    return {"type": "record", "name": name, "namespace": "shop", "fields": [
        {"name": "id", "type": "long"}, {"name": "ts", "type": ts},
        {"name": "seen", "type": {"type": "array", "items": ts}},
        {"name": "paid", "type": ["null", {**ts, "logicalType": f"local-timestamp-{unit}"}],
         "default": None}]}


def test_timestamps_read_in_one_unit_across_writers_of_another(registry, caplog):
    # A writer moving a field from timestamp-millis to timestamp-micros (a change
    # Avro's resolution allows) made the field's numbers 1,000 times larger from
    # that record on, in silence.
    millis = AvroSerializer(registry, json.dumps(_stamped("millis")))
    micros = AvroSerializer(registry, json.dumps(_stamped("micros")))
    local = dt.datetime(1970, 1, 1)
    stamps = [EPOCH + dt.timedelta(microseconds=us) for us in
              (1_700_000_000_123_000, -1_500, 0, 1_700_000_000_123_456, -1_000)]
    values = []
    for i, t in enumerate(stamps):
        write = millis if i < 2 else micros  # the first two hold whole milliseconds only
        if i < 2:
            t = t.replace(microsecond=t.microsecond // 1000 * 1000)
        values.append(write({"id": i, "ts": t, "seen": [t, t + dt.timedelta(days=1)],
                             "paid": None if i == 2 else local + (t - EPOCH)}, CTX))
    read = [AvroDeserializer(registry)(v, CTX) for v in values]
    us = np.array([(r["ts"] - EPOCH) // dt.timedelta(microseconds=1) for r in read])
    schema = kfeed.Schema({"id": ("int64", ()), "ts": ("int64", ()), "seen": ("int64", (2,)),
                           "paid": ("int64", (), {"default": -1})})
    for unit, want in (("us", us), ("ns", us * 1000),
                       ("ms", np.array(us, "datetime64[us]").astype("datetime64[ms]")
                        .astype(np.int64))):
        got, bad = decode_all(kfeed.Avro(registry=registry, timestamps=unit).decoder(schema),
                              schema, values)
        assert bad == [], unit
        np.testing.assert_array_equal(got["ts"], want, err_msg=unit)
        day = {"ms": 86_400_000, "us": 86_400_000_000, "ns": 86_400_000_000_000}[unit]
        np.testing.assert_array_equal(got["seen"], np.stack([want, want + day], 1))
        np.testing.assert_array_equal(got["paid"], np.where(got["id"] == 2, -1, want))
    assert got["ts"][1] == -2  # -1,500 us, rounded down to -2 ms as numpy's cast does
    assert "mixes units" not in caplog.text
    # As written: each writer's unit, and a warning that names the fix.
    got, bad = decode_all(kfeed.Avro(registry=registry).decoder(schema), schema, values)
    assert bad == [] and got["ts"].tolist() == [us[0] // 1000, -2, *us[2:].tolist()]
    assert re.search(r"schema id \d+ writes field 'ts' as timestamp-micros, schema id \d+ as "
                     r"timestamp-millis: read as written, the field mixes units; give "
                     r"kfeed.Avro\(timestamps='us'\)", caplog.text)
    # Nanoseconds (written as the long they are), and a value no int64 holds in them.
    nanos = fastavro.parse_schema(_stamped("nanos", "Nanos"))
    plain = []
    for t in (1_700_000_000_123_456_789, -1_500_001):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, nanos, {"id": 0, "ts": t, "seen": [t, t], "paid": t})
        plain.append(buf.getvalue())
    fmt = kfeed.Avro(schema=_stamped("nanos", "Nanos"), timestamps="us")
    got, bad = decode_all(fmt.decoder(schema), schema, plain)
    assert bad == [] and got["ts"].tolist() == [1_700_000_000_123_456, -1_501]
    late = [millis({"id": 9, "ts": EPOCH + dt.timedelta(days=107_000), "seen": [EPOCH, EPOCH],
                    "paid": None}, CTX)]  # about 2263: past int64 in nanoseconds
    got, bad = decode_all(kfeed.Avro(registry=registry, timestamps="ns").decoder(schema),
                          schema, late + values[:1])
    assert bad == [(0, "timestamp 9244800000000 does not fit int64 in the unit timestamps= "
                       "asks at ts")] and got["id"].tolist() == [0]
    for wrong in ("s", ["us"]):
        with pytest.raises(kfeed.ConfigError, match="timestamps must be 'ms', 'us' or 'ns'"):
            kfeed.Avro(registry=registry, timestamps=wrong)
    # A writer that drops the logical type (or gives one that is no str, which
    # Avro ignores) writes a long of no unit: read as written, and said.
    caplog.clear()
    plain = _stamped("millis")
    plain["fields"][1]["type"] = {"type": "long", "logicalType": {"not": "a str"}}
    later = AvroSerializer(registry, json.dumps(plain))({"id": 7, "ts": 1_700_000_000_123_456,
                                                        "seen": [EPOCH, EPOCH]}, CTX)
    got, bad = decode_all(kfeed.Avro(registry=registry, timestamps="us").decoder(schema),
                          schema, values[:1] + [later])
    assert bad == [] and got["ts"].tolist() == [us[0], 1_700_000_000_123_456]
    assert re.search(r"schema id \d+ writes field 'ts' as a long without a logical type, schema "
                     r"id \d+ as timestamp-millis: a long without a timestamp logical type has "
                     r"no unit to read it in, so the field may mix units", caplog.text)
    spec = kfeed.Avro(registry={"url": "mock://x"}, timestamps="ms")
    assert pickle.loads(pickle.dumps(spec)).timestamps == "ms"
    # kfeed convert takes it too.
    from kfeed import cli

    args = cli.build_parser().parse_args(["convert", "--from-topic", "a", "--to-topic", "b",
                                          "--format", "avro", "--registry", "http://r:8081",
                                          "--timestamps", "us"])
    assert cli._wire_format(args).timestamps == "us"


def test_configuration_mistakes_get_one_clear_line(registry):
    with pytest.raises(kfeed.ConfigError, match="needs schema= .* or registry="):
        kfeed.Avro()
    with pytest.raises(kfeed.ConfigError, match="not JSON"):
        kfeed.Avro(schema="{not json")
    with pytest.raises(kfeed.ConfigError, match="unknown Avro type 'Missing'"):
        kfeed.Avro(schema={"type": "record", "name": "R",
                           "fields": [{"name": "a", "type": "Missing"}]}).decoder(SCHEMA)
    with pytest.raises(kfeed.ConfigError, match="bool, integer, float32 or float64"):
        kfeed.Avro(schema=V1).decoder(kfeed.Schema({"id": ("bfloat16", ())}))
    # A malformed writer schema: a field without a type or a name, or not an
    # object, was a KeyError or TypeError; enum symbols and fixed sizes of
    # other types were taken ("AB" as ['A', 'B'], true as 1).
    for field, what in (({"name": "a"}, "{'name': 'a'}"), ({"type": "long"}, "{'type': 'long'}"),
                        ("a", "a"), ({"name": 1, "type": "long"}, "{'name': 1, ")):
        with pytest.raises(kfeed.ConfigError, match=re.escape(
                f"Avro record 'R': field 0 must be an object with a name and a type, got {what}")):
            kfeed.Avro(schema={"type": "record", "name": "R", "fields": [field]}).decoder(SCHEMA)
    for kind, bad, match in (("enum", {"symbols": "AB"}, "needs a list of symbols"),
                             ("fixed", {"size": True}, "needs a size")):
        with pytest.raises(kfeed.ConfigError, match=match):
            kfeed.Avro(schema={"type": "record", "name": "R", "fields": [
                {"name": "id", "type": {"type": kind, "name": "E", **bad}}]}).decoder(SCHEMA)
    with pytest.raises(kfeed.ConfigError, match="gives one field, 'tokens': leave 'id' out"):
        kfeed.LoaderConfig(("t",), kfeed.Schema({"tokens": ("int32", (None,)),
                                                 "id": ("int64", ())}), 8,
                           format=kfeed.Avro(schema=V1), pack=kfeed.Pack(seq_len=8, eos_id=0))
    with pytest.raises(kfeed.ConfigError, match="variable-length: read it with pack="):
        kfeed.Avro(schema=V1).decoder(kfeed.Schema({"tokens": ("int32", (None,))})).decode_into(
            [], None, 0)
    with pytest.raises(kfeed.ConfigError, match="give registry= its config dict"):
        pickle.dumps(kfeed.Avro(registry=registry))
    spec = kfeed.Avro(registry={"url": "mock://x"})
    assert pickle.loads(pickle.dumps(spec)).registry == {"url": "mock://x"}
    # Registry settings the client refuses: here, not in the first batch's traceback.
    with pytest.raises(kfeed.ConfigError, match="^registry: Unrecognized properties: "
                       "basic.auth.userinfo$"):
        kfeed.Avro(registry={"url": "http://r:8081", "basic.auth.userinfo": "u:p"})
    with pytest.raises(kfeed.ConfigError, match="^registry: basic.auth.user.info must be"):
        kfeed.Protobuf(registry={"url": "http://r:8081", "basic.auth.user.info": "u"})
    # A registry that cannot be reached, named in the error of the producer's encoder.
    with pytest.raises(kfeed.ProduceError, match=r"^cannot register the Avro schema under "
                       r"t-value with the registry at http://127\.0\.0\.1:9: "):
        kfeed.Avro(registry={"url": "http://127.0.0.1:9"}).encoder(kfeed.Schema(
            {"x": ("float32", ())}), "t")


def test_a_registry_that_does_not_answer_fails_the_read_and_skips_nothing(monkeypatch, registry,
                                                                          caplog):
    values, _ = serialized(registry, 4)
    monkeypatch.setattr(formats, "REGISTRY_RETRY_S", 1.0)
    # Nothing listens on this loopback port: every request is refused. The
    # url's password shows in no warning and no error.
    url = "http://sr-user:s3cret@127.0.0.1:9,https://sr-user:s3cret@127.0.0.1:10"
    decoder = kfeed.Avro(registry={"url": url}).decoder(SCHEMA)
    out = {f.name: np.zeros((4, *f.shape), f.storage) for f in SCHEMA.fields}
    with caplog.at_level(logging.WARNING, logger="kfeed"):
        with pytest.raises(kfeed.ConsumeError, match="did not give schema id 1") as info:
            decoder.decode_into(values, SCHEMA.bind(out), 0)
    assert "s3cret" not in caplog.text + str(info.value)
    assert "the registry at http://sr-user:***@127.0.0.1:9,https://sr-user:***@127.0.0.1:10" \
        in str(info.value)
    assert caplog.records  # it asked again, and said so


@pytest.mark.integration
def test_a_registry_that_hangs_fails_the_read_in_time(monkeypatch, _schema_registry) -> None:
    # Its requests had no timeout: a registry whose process was stopped held
    # the read (and close(), and a producer) for as long as it was stopped.
    import signal

    from kfeed.cluster import _schema_registry as registry_process

    url, state_dir = _schema_registry
    pid = registry_process.running_pid(state_dir)
    assert pid is not None
    monkeypatch.setattr(formats, "REGISTRY_REQUEST_S", 1.0)
    monkeypatch.setattr(formats, "REGISTRY_RETRY_S", 2.0)
    values = [b"\x00" + (987654).to_bytes(4, "big") + b"\x02"] * 2  # an id it never gave
    decoder = kfeed.Avro(registry={"url": url}).decoder(SCHEMA)
    out = {f.name: np.zeros((2, *f.shape), f.storage) for f in SCHEMA.fields}
    raised: list[BaseException] = []

    def read() -> None:
        try:
            decoder.decode_into(values, SCHEMA.bind(out), 0)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            raised.append(e)

    os.kill(pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=read, daemon=True)
        t0 = time.monotonic()
        thread.start()
        thread.join(30)
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not thread.is_alive(), "the read still waits on the stopped registry"
    assert len(raised) == 1 and isinstance(raised[0], kfeed.ConsumeError), raised
    assert "did not give schema id 987654 within 2 s" in str(raised[0])
    assert took < 10, took


def test_a_registry_that_does_not_answer_is_asked_for_the_whole_wait(monkeypatch) -> None:
    # It gave up as soon as the next pause would pass the deadline: after
    # 25-27 s of the 30 its error said.
    monkeypatch.setattr(formats, "REGISTRY_RETRY_S", 2.0)
    asked: list[float] = []

    def unanswered() -> None:
        asked.append(time.monotonic())
        raise ConnectionError("refused")

    t0 = time.monotonic()
    with pytest.raises(kfeed.ConsumeError, match="did not give schema id 7 within 2 s"):
        formats.ask_registry(unanswered, "schema id 7", "the registry")
    assert time.monotonic() - t0 >= 2.0 and asked[-1] - t0 >= 1.9, asked


def test_a_registry_refusal_no_wait_mends_is_said_at_once(monkeypatch) -> None:
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    answers = {"login": SchemaRegistryError(401, 40101, "Unauthorized"),
               "url": SchemaRegistryError(404, -1, "Unknown Schema Registry Error: b''"),
               "id": SchemaRegistryError(404, 40403, "Schema not found")}
    asked = []

    def call(what):
        def answer():
            asked.append(what)
            raise answers[what]
        return answer

    where = "the registry at http://r:8081"
    t0 = time.monotonic()
    with pytest.raises(kfeed.ConsumeError, match=r"^the registry at http://r:8081 refused to "
                       r"give schema id 3 \(HTTP 401\): check the registry's "
                       r"basic.auth.user.info"):
        formats.ask_registry(call("login"), "schema id 3", where)
    # A 404 without a registry's error code: the url serves something else.
    with pytest.raises(kfeed.ConsumeError, match=r"answer is not the Schema Registry API's.*"
                       r"url of the API's root"):
        formats.ask_registry(call("url"), "schema id 3", where)
    assert formats.ask_registry(call("id"), "schema id 3", where) is None  # truly not there
    assert time.monotonic() - t0 < 1 and asked == ["login", "url", "id"]


def test_closing_a_loader_ends_its_wait_for_the_registry(caplog, registry) -> None:
    # close() waited out the 30 s the registry is asked for.
    values, _ = serialized(registry, 4)
    caplog.set_level("WARNING", "kfeed.formats")
    ld = kfeed.Loader(None, "memory", SCHEMA, 4, source=MemorySource(values), device="cpu",
                      format=kfeed.Avro(registry={"url": "http://127.0.0.1:9"}))
    got: list[BaseException] = []

    def read() -> None:
        try:
            next(ld)
        except BaseException as e:  # noqa: BLE001 - what next() ends with is checked below
            got.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 20
    while caplog.text.count("asking again") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "the registry at http://127.0.0.1:9: " in caplog.text
    t0 = time.monotonic()
    ld.close()
    assert time.monotonic() - t0 < 2
    reader.join(5)
    assert len(got) == 1 and "closed" in str(got[0])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_values_never_crash_and_never_half_write(data):
    rng = np.random.default_rng(5)
    parsed = fastavro.parse_schema(json.loads(json.dumps(V1)))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, make_record(11, rng))
    good = buf.getvalue()
    mutated = damage(data, bytearray(good), list(range(256)),
                     [b"\xff" * k + b"\x01" for k in (1, 5, 12)], rounds=(1, 4))
    out = {f.name: np.full((2, *f.shape), 7, f.storage) for f in SCHEMA.fields}
    decoder = kfeed.Avro(schema=V1).decoder(SCHEMA)
    res = decoder.decode_into([bytes(mutated), good], SCHEMA.bind(out), 0)
    assert res.consumed == 2 and res.rows + len(res.bad) == 2
    # The good value after it always lands whole, in the row after the good ones.
    assert out["id"][res.rows - 1] == 11
    assert out["digest"][res.rows - 1].tolist() == list((11).to_bytes(4, "little"))


def produce_clicks(bootstrap: str, topic: str, registry: SchemaRegistryClient
                   ) -> tuple[list[dict], dict[bytes, str]]:
    """10,000 records by ``AvroSerializer`` (a schema change at the half) into ``topic``,
    corrupt frames among them; how they read back, and each corrupt value's reason."""
    values, records = serialized(registry, 10_000)
    corrupt, reasons = corrupt_values(registry)
    bad = {corrupt[i]: why for i, why in reasons.items()}
    p = KafkaProducer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for i, v in enumerate(values):
        p.produce(topic, v, key=str(i).encode())
        if i == 5000:
            for b in bad:
                p.produce(topic, b, key=b"bad")
        p.poll(0)
    assert p.flush(60) == 0
    return records, bad


def check_clicks(cols: dict[str, np.ndarray], records: list[dict], bootstrap: str, topic: str,
                 bad: dict[bytes, str]) -> None:
    """Each record once and equal to what the deserializer read; each bad one dead-lettered."""
    order = np.argsort(cols["id"], kind="stable")
    np.testing.assert_array_equal(cols["id"][order], np.arange(10_000))  # each record once
    want = expected_columns(records)
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(cols[f.name][order], want[f.name], err_msg=f.name)
    dead = read_dlq(bootstrap, topic, len(bad))
    assert sorted(m.value() for m in dead) == sorted(bad)
    for m in dead:
        assert bad[m.value()] in dict(m.headers())["kfeed.reason"].decode()


@pytest.mark.integration
def test_loader_reads_a_topic_written_by_confluent_kafkas_serializer(bootstrap, make_topic,
                                                                     schema_registry):
    # A real Schema Registry, asked over HTTP by the serializer and by kfeed.
    registry = SchemaRegistryClient({"url": schema_registry})
    topic = make_topic(partitions=3)
    records, bad = produce_clicks(bootstrap, topic, registry)
    cols = read_columns(bootstrap, topic, SCHEMA, kfeed.Avro(registry={"url": schema_registry}),
                        batch_size=512)
    check_clicks(cols, records, bootstrap, topic, bad)


@pytest.mark.integration
def test_a_field_added_with_a_default_keeps_the_subject_backward_compatible(
        bootstrap, make_topic, schema_registry):
    # kfeed's writer schema had no Avro default: the registry refused the new
    # schema under BACKWARD compatibility (409), default or not.
    topic = make_topic(partitions=1)
    SchemaRegistryClient({"url": schema_registry}).set_compatibility(f"{topic}-value",
                                                                     "BACKWARD")
    config = {"bootstrap.servers": bootstrap}
    fmt = kfeed.Avro(registry={"url": schema_registry})
    old = kfeed.Schema({"id": ("int64", ())})
    new = kfeed.Schema({"id": ("int64", ()), "score": ("float32", (2,), {"default": 0.5})})
    with kfeed.Producer(config, topic, old, format=fmt) as p:
        p.send({"id": np.arange(3)})
    with kfeed.Producer(config, topic, new, format=fmt) as p:
        p.send({"id": np.arange(3, 5), "score": np.ones((2, 2), np.float32)})
    cols = read_columns(bootstrap, topic, new, fmt, batch_size=5)
    assert cols["id"].tolist() == [0, 1, 2, 3, 4]
    assert cols["score"].tolist() == [[0.5, 0.5]] * 3 + [[1.0, 1.0]] * 2


# -- token documents: pack= ---------------------------------------------------------------

DOC = {
    "type": "record", "name": "Doc", "namespace": "corpus", "fields": [
        {"name": "id", "type": "long"},
        {"name": "body", "type": {"type": "record", "name": "Body", "fields": [
            {"name": "ids", "type": ["null", {"type": "array", "items": "int"}]},
            {"name": "text", "type": "string"},
        ]}},
        {"name": "meta", "type": {"type": "map", "values": "string"}},
    ],
}


def doc_values(registry: SchemaRegistryClient, n: int, seed: int = 5
               ) -> tuple[list[bytes], list[dict]]:
    """n documents by ``AvroSerializer``; how ``AvroDeserializer`` reads them back."""
    rng = np.random.default_rng(seed)
    ser = AvroSerializer(registry, json.dumps(DOC))
    records = [{"id": i, "meta": {"lang": "en"},
                "body": {"ids": rng.integers(1, 65535, int(rng.integers(0, 700))).tolist()
                         if i % 50 else None,
                         "text": "téxt " * int(rng.integers(0, 5))}}
               for i in range(n)]
    values = [ser(r, CTX) for r in records]
    de = AvroDeserializer(registry)
    return values, [de(v, CTX) for v in values]


def test_token_documents_pack_as_kfeeds_own_and_resume_exactly(registry):
    values, records = doc_values(registry, 1500)
    values[7] = values[7][:-3]            # truncated: rejected whole
    schema = kfeed.Schema({"tokens": ("uint16", (None,), {"source": "body.ids",
                                                          "default": [3, 3]})})
    docs = [None if i == 7 else [3, 3] if r["body"]["ids"] is None else r["body"]["ids"]
            for i, r in enumerate(records)]
    check_packed_documents(values, schema, kfeed.Avro(registry=registry), docs,
                           kfeed.Pack(seq_len=256, eos_id=65535, pad_id=0))


def test_documents_equal_the_deserializers_arrays_and_strings(registry):
    values, records = doc_values(registry, 300)
    ids = kfeed.Avro(registry=registry).decoder(kfeed.Schema(
        {"tokens": ("int32", (None,), {"source": "body.ids"})})).decode_documents(values)
    has = [r["body"]["ids"] is not None for r in records]
    assert [i for i, why in ids.bad] == [i for i, h in enumerate(has) if not h]
    assert all("missing or null" in why for _, why in ids.bad)
    assert ids.lengths.tolist() == [len(r["body"]["ids"]) for r, h in zip(records, has) if h]
    assert ids.tokens.tolist() == [t for r in records for t in r["body"]["ids"] or []]
    # A string as a document of its UTF-8 bytes; uint16 ids do not fit int8.
    text = kfeed.Avro(registry=registry).decoder(kfeed.Schema(
        {"text": ("uint8", (None,), {"source": "body.text"})})).decode_documents(values)
    assert text.tokens.tobytes() == "".join(r["body"]["text"] for r in records).encode()
    small = kfeed.Avro(registry=registry).decoder(kfeed.Schema(
        {"tokens": ("int8", (None,), {"source": "body.ids"})})).decode_documents(values[1:3])
    assert [why for _, why in small.bad] == ["{} does not fit field 'tokens' (int8) at "
                                             "body.ids[]".format(records[k]["body"]["ids"][0])
                                             for k in (1, 2)]
    with pytest.raises(kfeed.ConfigError, match="default of a variable-length field is a "
                                                "document, a 1-D sequence"):
        kfeed.Schema({"t": ("int32", (None,), {"default": 5})})


@pytest.mark.parametrize("text", [b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"abc\xe2\x82"])
def test_a_string_read_into_a_document_that_is_not_utf8_is_a_bad_record(text):
    # Such a string went into the tokens as it was, where the AvroDeserializer
    # refuses the record. Skipped strings stay unchecked, as protobuf's.
    parsed = fastavro.parse_schema(json.loads(json.dumps(DOC)))
    values = []
    for i, body in enumerate(["ab", "x", "\u00e9\u4e2d\U0001f600"]):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, {"id": i, "meta": {},
                                                 "body": {"ids": None, "text": body}})
        values.append(buf.getvalue())
    bad = values[1].replace(b"\x02x", bytes([2 * len(text)]) + text)  # its "x", replaced
    with pytest.raises(UnicodeDecodeError):
        fastavro.schemaless_reader(io.BytesIO(bad), parsed)
    got = kfeed.Avro(schema=DOC).decoder(kfeed.Schema(
        {"text": ("uint8", (None,), {"source": "body.text"})})).decode_documents(
            [values[0], bad, values[2]])
    assert got.bad == [(1, "a string that is not UTF-8 at body.text")]
    assert got.tokens.tobytes() == "ab\u00e9\u4e2d\U0001f600".encode()
    ids, why = decode_all(kfeed.Avro(schema=DOC).decoder(kfeed.Schema({"id": ("int64", ())})),
                          kfeed.Schema({"id": ("int64", ())}), [values[0], bad])
    assert ids["id"].tolist() == [0, 1] and why == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_documents_never_crash_and_read_as_fastavro_reads_them(data):
    parsed = fastavro.parse_schema(json.loads(json.dumps(DOC)))
    buf = io.BytesIO()
    n = data.draw(st.integers(0, 40))
    fastavro.schemaless_writer(buf, parsed, {"id": 3, "meta": {"k": "v"},
                                             "body": {"ids": list(range(-n, n)), "text": "ab"}})
    mutated = bytes(damage(data, bytearray(buf.getvalue()), list(range(256)),
                           [b"\xff" * k + b"\x01" for k in (1, 5, 12)], rounds=(1, 4)))
    schema = kfeed.Schema({"t": ("int16", (None,), {"source": "body.ids"})})
    got = kfeed.Avro(schema=DOC).decoder(schema).decode_documents([mutated, buf.getvalue()])
    tokens = got.tokens.tolist()
    assert got.counts[1] == 1 and tokens[len(tokens) - 2 * n:] == list(range(-n, n))
    if got.counts[0]:
        # kfeed took it whole: fastavro reads the same document from it (its
        # strings as bytes: kfeed skips them without checking their UTF-8).
        as_bytes = fastavro.parse_schema(json.loads(json.dumps(DOC).replace('"string"',
                                                                            '"bytes"')))
        try:
            want = fastavro.schemaless_reader(io.BytesIO(mutated), as_bytes)
        except UnicodeDecodeError:
            return  # a map's key, which fastavro decodes and kfeed skips unread
        assert tokens[:got.lengths[0]] == want["body"]["ids"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_documents_with_fields_beside_read_as_fastavro_reads_them(data):
    # One pass for both: the id into its row, the array into the document.
    parsed = fastavro.parse_schema(json.loads(json.dumps(DOC)))
    values, raw = [], []
    for i in range(data.draw(st.integers(1, 4))):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, {"id": 10 + i, "meta": {},
                                                 "body": {"ids": list(range(i * 3)), "text": ""}})
        raw.append(buf.getvalue())
        values.append(bytes(damage(data, bytearray(raw[-1]), list(range(256)),
                                   [b"\xff" * k + b"\x01" for k in (1, 5, 12)], rounds=(0, 2))))
    schema = kfeed.Schema({"id": ("int64", ()),
                           "tokens": ("int32", (None,), {"source": "body.ids"})})
    got = kfeed.Avro(schema=DOC).decoder(schema).decode_documents(values)
    good = [i for i, c in enumerate(got.counts) if c]
    assert len(got.columns["id"]) == len(got.lengths) == len(good)
    as_bytes = fastavro.parse_schema(json.loads(json.dumps(DOC).replace('"string"', '"bytes"')))
    start = 0
    for k, i in enumerate(good):
        n = got.lengths[k]
        try:
            want = fastavro.schemaless_reader(io.BytesIO(values[i]), as_bytes)
        except UnicodeDecodeError:
            start += n
            continue  # a map's key, which fastavro decodes and kfeed skips unread
        assert got.columns["id"][k] == want["id"]
        assert got.tokens[start:start + n].tolist() == want["body"]["ids"]
        start += n


@pytest.mark.integration
def test_a_schema_id_in_a_header_is_named_in_the_reason(bootstrap, make_topic, registry):
    # confluent-kafka's serializers can put the schema's id in a header (the
    # value is then bare Avro): kfeed said "too short for the Confluent framing"
    # or "schema id N is not in the registry" (N from the record's own bytes).
    from confluent_kafka.schema_registry import header_schema_id_serializer

    topic = make_topic(partitions=1)
    write = AvroSerializer(registry, json.dumps(V1),
                           conf={"schema.id.serializer": header_schema_id_serializer})
    rng = np.random.default_rng(5)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(40):
        headers: list = []
        value = write(make_record(i, rng), SerializationContext(topic, MessageField.VALUE,
                                                                headers))
        p.produce(topic, value, headers=headers)
    assert p.flush(30) == 0
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    with kfeed.Loader(config, topic, SCHEMA, batch_size=8, until="end", device="cpu",
                      format=kfeed.Avro(registry=registry)) as loader:
        with pytest.raises(kfeed.DecodeError, match=r"^all 32 messages read so far were "
                           r"rejected.*its writer put the schema id in the __value_schema_id "
                           r"header, as confluent-kafka's header_schema_id_serializer does"):
            next(iter(loader))


@pytest.mark.integration
def test_loader_packs_an_avro_topic_of_documents(bootstrap, make_topic, registry):
    topic = make_topic(partitions=2)
    values, records = doc_values(registry, 3000, seed=8)
    p = KafkaProducer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for v in values:
        p.produce(topic, v)
    assert p.flush(60) == 0
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    schema = kfeed.Schema({"tokens": ("int32", (None,), {"source": "body.ids", "default": []})})
    pack = kfeed.Pack(seq_len=512, eos_id=-1, pad_id=0)
    seen = []
    with kfeed.Loader(config, topic, schema, 8, device="cpu", until="end",
                      format=kfeed.Avro(registry=registry), pack=pack) as loader:
        for batch in loader:
            t = batch["tokens"]
            seen.append(t[(t != 0) & (t != -1)].clone())
    got = np.sort(np.concatenate([s.numpy() for s in seen]))
    want = np.sort(np.array([t for r in records for t in r["body"]["ids"] or []], np.int32))
    np.testing.assert_array_equal(got, want)


# -- writing: kfeed.Producer(format=kfeed.Avro(...)) ---------------------------------------

WRITE = kfeed.Schema({
    "id": ("int64", ()),
    "features": ("float32", (5,)),
    "grid": ("int16", (2, 3)),
    "score": ("float64", ()),
    "ok": ("bool", ()),
    "count": ("uint32", ()),
    "age": ("uint8", (), {"source": "user.age"}),
    "vip": ("bool", (), {"source": "user.flags.vip"}),
})


def write_columns(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64, endpoint=True)
    ids[:2] = [-2**63, 2**63 - 1]
    score = rng.standard_normal(n)
    score[:3] = [np.nan, np.inf, -0.0]
    return {"id": ids, "features": rng.standard_normal((n, 5)).astype(np.float32),
            "grid": rng.integers(-2**15, 2**15, (n, 2, 3)).astype(np.int16), "score": score,
            "ok": rng.integers(0, 2, n).astype(bool),
            "count": rng.integers(0, 2**32, n).astype(np.uint32),
            "age": rng.integers(0, 256, n).astype(np.uint8),
            "vip": rng.integers(0, 2, n).astype(bool)}


def as_avro(cols: dict[str, np.ndarray], i: int) -> dict:
    """Row ``i`` as confluent-kafka's deserializer returns it."""
    return {"id": int(cols["id"][i]), "features": cols["features"][i].tolist(),
            "grid": cols["grid"][i].tolist(), "score": float(cols["score"][i]),
            "ok": bool(cols["ok"][i]), "count": int(cols["count"][i]),
            "user": {"age": int(cols["age"][i]), "flags": {"vip": bool(cols["vip"][i])}}}


def same_record(got: dict, want: dict) -> bool:
    # NaN compares unequal to itself; json text of both sides compares it as a name.
    return json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


def test_written_values_read_back_by_confluent_kafkas_deserializer_and_by_kfeed(registry):
    n = 2000
    cols = write_columns(n)
    encoder = kfeed.Avro(registry=registry).encoder(WRITE, TOPIC)
    values = encoder.encode(cols)
    assert registry.get_latest_version(f"{TOPIC}-value").schema_id == encoder.schema_id
    reader = AvroDeserializer(registry)
    for i, v in enumerate(values):
        assert v[:5] == b"\0" + encoder.schema_id.to_bytes(4, "big")
        assert same_record(reader(v, CTX), as_avro(cols, i)), i
    out, bad = decode_all(kfeed.Avro(registry=registry).decoder(WRITE), WRITE, values)
    assert not bad
    for f in WRITE.fields:
        np.testing.assert_array_equal(out[f.name], cols[f.name], err_msg=f.name)


def test_without_a_registry_the_writer_schema_must_be_kfeeds_own():
    schema = avro.writer_schema(WRITE)
    assert schema["fields"][6] == {"name": "user", "type": {
        "type": "record", "name": "user", "namespace": "kfeed.path", "fields": [
            {"name": "age", "type": "int"},
            {"name": "flags", "type": {"type": "record", "name": "user_flags",
                                       "namespace": "kfeed.path.user",
                                       "fields": [{"name": "vip", "type": "boolean"}]}}]}}
    cols = write_columns(50, seed=1)
    values = kfeed.Avro(schema=schema).encoder(WRITE, TOPIC).encode(cols)
    # As writer_schema gave it before nested records had namespaces: the same bytes.
    old = json.loads(json.dumps(schema).replace('"namespace": "kfeed.path.user", ', "")
                     .replace('"namespace": "kfeed.path", ', ""))
    assert "kfeed.path" not in json.dumps(old)
    assert kfeed.Avro(schema=old).encoder(WRITE, TOPIC).encode(cols) == values
    # Paths whose records were both named kfeed.a_b (and one under Record, the
    # root's name): kfeed wrote a schema that defined a name twice, which the
    # registries refuse and fastavro cannot parse.
    clash = kfeed.Schema({"p": ("int64", (), {"source": "a.b.c"}),
                          "q": ("int32", (), {"source": "a_b.c"}),
                          "r": ("int32", (), {"source": "Record.x"})})
    clash_cols = {"p": np.arange(5), "q": np.arange(5, dtype=np.int32) + 10,
                  "r": np.arange(5, dtype=np.int32) + 20}
    writer = avro.writer_schema(clash)
    parsed = fastavro.parse_schema(json.loads(json.dumps(writer)))
    encoded = kfeed.Avro(schema=writer).encoder(clash, TOPIC).encode(clash_cols)
    assert [fastavro.schemaless_reader(io.BytesIO(v), parsed, None) for v in encoded][4] == {
        "a": {"b": {"c": 4}}, "a_b": {"c": 14}, "Record": {"x": 24}}
    out, bad = decode_all(kfeed.Avro(schema=writer).decoder(clash), clash, encoded)
    assert not bad and all(np.array_equal(out[k], v) for k, v in clash_cols.items())
    parsed = fastavro.parse_schema(json.loads(json.dumps(schema)))
    for i, v in enumerate(values):
        assert same_record(fastavro.schemaless_reader(io.BytesIO(v), parsed, None),
                           as_avro(cols, i))
    with pytest.raises(kfeed.ConfigError, match="derives from the kfeed Schema"):
        kfeed.Avro(schema=V1).encoder(WRITE, TOPIC)
    with pytest.raises(kfeed.ConfigError, match="no type for uint64"):
        avro.writer_schema(kfeed.Schema({"x": ("uint64", ())}))
    with pytest.raises(kfeed.ConfigError, match="both a value and a record"):
        avro.writer_schema(kfeed.Schema({"a": ("int32", ()),
                                         "b": ("int32", (), {"source": "a.x"})}))
    with pytest.raises(kfeed.ConfigError, match="two fields are written at a"):
        avro.writer_schema(kfeed.Schema({"a": ("int32", ()), "b": ("int32", (), {"source": "a"})}))
    with pytest.raises(kfeed.ConfigError, match="not an Avro name"):
        avro.writer_schema(kfeed.Schema({"a": ("int32", (), {"source": "user.first-name"})}))
    with pytest.raises(kfeed.ConfigError, match="field .age. has 9 rows, other fields have 50"):
        kfeed.Avro(schema=schema).encoder(WRITE, TOPIC).encode({**cols, "age": cols["age"][:9]})


def test_kfeed_avro_is_there_after_import_kfeed_alone():
    # As the README writes it: an AttributeError unless kfeed.avro was imported first.
    done = subprocess.run([sys.executable, "-c", "import kfeed; print(kfeed.avro.writer_schema("
                           "kfeed.Schema({'a': ('int32', ())}))['name'], kfeed.metrics.serve)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("Record <function serve"), done.stderr


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                 "uint32", "float32", "float64"]), min_size=1, max_size=6),
       st.integers(1, 3), st.integers(0, 2**31))
def test_any_numeric_schema_round_trips_through_kfeeds_writer_and_fastavro(dtypes, dim, seed):
    rng = np.random.default_rng(seed)
    fields = {f"f{i}": (d, () if i % 2 else (dim,)) for i, d in enumerate(dtypes)}
    schema = kfeed.Schema(fields)
    n = 7
    cols = {}
    for f in schema.fields:
        shape = (n, *f.shape)
        if f.dtype == "bool":
            cols[f.name] = rng.integers(0, 2, shape).astype(bool)
        elif f.dtype.startswith("float"):
            cols[f.name] = rng.standard_normal(shape).astype(f.dtype) * 1e30
        else:
            info = np.iinfo(f.dtype)
            cols[f.name] = rng.integers(info.min, info.max, shape, dtype=f.dtype, endpoint=True)
    writer = avro.writer_schema(schema)
    values = kfeed.Avro(schema=writer).encoder(schema, TOPIC).encode(cols)
    parsed = fastavro.parse_schema(json.loads(json.dumps(writer)))
    for i, v in enumerate(values):
        rec = fastavro.schemaless_reader(io.BytesIO(v), parsed, None)
        for f in schema.fields:
            np.testing.assert_array_equal(np.array(rec[f.name], dtype=f.storage),
                                          cols[f.name][i])
    out, bad = decode_all(kfeed.Avro(schema=writer).decoder(schema), schema, values)
    assert not bad
    for f in schema.fields:
        np.testing.assert_array_equal(out[f.name], cols[f.name])


@pytest.mark.integration
def test_the_producer_writes_a_topic_the_loader_and_confluent_kafka_read(bootstrap, make_topic,
                                                                         registry):
    topic = make_topic(partitions=3)
    n = 3000
    cols = write_columns(n, seed=2)
    cols["id"] = np.arange(n)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, WRITE,
                        format=kfeed.Avro(registry=registry)) as p:
        p.send(cols, keys=cols["id"])
    out = read_columns(bootstrap, topic, WRITE, kfeed.Avro(registry=registry))
    order = np.argsort(out["id"])
    np.testing.assert_array_equal(out["id"][order], np.arange(n))
    for f in WRITE.fields:
        np.testing.assert_array_equal(out[f.name][order], cols[f.name], err_msg=f.name)


@pytest.mark.integration
def test_kfeed_produce_format_avro_writes_framed_records(bootstrap, make_topic):
    import os

    from confluent_kafka import Consumer

    from kfeed.synthetic import synthetic_columns, synthetic_schema

    topic = make_topic(partitions=1)
    env = {**os.environ, "KFEED_BOOTSTRAP": bootstrap}
    done = subprocess.run([sys.executable, "-m", "kfeed", "produce", "--topic", topic,
                           "--synthetic", "40", "--format", "avro", "--registry",
                           f"mock://{uuid.uuid4().hex}"], env=env, check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "auto.offset.reset": "earliest", "enable.partition.eof": True})
    c.subscribe([topic])
    values = []
    while True:
        m = c.poll(10)
        assert m is not None
        if m.error():
            break
        values.append(m.value())
    c.close()
    schema = synthetic_schema()
    parsed = fastavro.parse_schema(json.loads(json.dumps(avro.writer_schema(schema))))
    want = synthetic_columns(range(40))
    assert len(values) == 40
    for v in values:
        assert v[0] == 0  # the Confluent framing: a zero byte, then the schema id
        rec = fastavro.schemaless_reader(io.BytesIO(v[5:]), parsed, None)
        i = rec["id"]
        np.testing.assert_array_equal(np.float32(rec["features"]), want["features"][i])
        assert rec["label"] == want["label"][i]


def zigzag(v: int) -> bytes:
    """An Avro long, as a writer puts it."""
    z, out = (v << 1) ^ (v >> 63), bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    return bytes(out + bytes([z]))


def test_empty_items_are_bounded_per_record_not_per_block():
    # 3-byte blocks of 65,536 empty records each passed the bound, block after
    # block: 70 s to decode a 1 MB value, without the GIL and without a way to stop.
    writer = {"type": "record", "name": "R", "fields": [
        {"name": "marks", "type": {"type": "array", "items": {
            "type": "record", "name": "Mark", "fields": []}}},
        {"name": "n", "type": "int"}]}
    schema = kfeed.Schema({"n": ("int32", ())})
    decoder = kfeed.Avro(schema=writer).decoder(schema)
    forged = zigzag(65536) * 100 + zigzag(0) + zigzag(7)
    fine = zigzag(60000) + zigzag(0) + zigzag(7)  # as many as a record may loop over
    cols, bad = decode_all(decoder, schema, [forged, fine])
    assert cols["n"].tolist() == [7] and [(i, why) for i, why in bad] == [
        (0, "a block of 65,536 items: past the record's bytes plus 65,536, the bound on "
            "items that take no bytes (nulls, empty records) at marks")], bad


@pytest.mark.parametrize("item", ["float", "double"])
def test_long_runs_of_floats_split_in_blocks_land_whole_at_every_alignment(item):
    # Runs of 1 KB and more are streamed around the cache: a head to 16 bytes, lines of 64,
    # then a tail; every split of the array in blocks and every row start moves all three.
    dtype = np.float32 if item == "float" else np.float64
    rng = np.random.default_rng(5)
    for n in (256, 257, 261, 300, 515, 1031):
        writer = {"type": "record", "name": "R", "fields": [
            {"name": "tag", "type": "int"}, {"name": "v", "type": {"type": "array", "items": item}}]}
        schema = kfeed.Schema({"tag": ("int32", ()), "v": (dtype.__name__, (n,))})
        want = rng.standard_normal((9, n)).astype(dtype)
        values = []
        for r, split in enumerate([n, 1, 3, 255, 256, n - 1, n - 17, n // 2, 2]):
            blocks = [(0, split), (split, n)] if split < n else [(0, n)]
            body = bytearray(zigzag(r))
            for a, b in blocks:
                if r % 2:  # a block that says its size in bytes too
                    body += zigzag(-(b - a)) + zigzag((b - a) * dtype().itemsize)
                else:
                    body += zigzag(b - a)
                body += want[r, a:b].tobytes()
            values.append(bytes(body + b"\x00"))
        got, bad = decode_all(kfeed.Avro(schema=writer).decoder(schema), schema, values, rows=4)
        assert bad == []
        np.testing.assert_array_equal(got["tag"], np.arange(9))
        np.testing.assert_array_equal(got["v"], want, err_msg=f"{n} {item}s")


def test_a_source_through_an_avro_map_or_array_is_refused() -> None:
    # attrs.score through a map<double>: the value was there, and the field took
    # its default (-1.0) without a word, or every record was bad without one.
    field = ("float64", (), {"source": "attrs.score", "default": -1.0})
    schema = kfeed.Schema({"id": ("int64", ()), "score": field})
    for kind, attrs, where in [
            ("map", {"type": "map", "values": "double"}, "attrs"),
            ("array", {"type": "array", "items": "double"}, "attrs"),
            ("map", ["null", {"type": "map", "values": "double"}], "attrs")]:
        writer = {"type": "record", "name": "E", "fields": [{"name": "id", "type": "long"},
                                                              {"name": "attrs", "type": attrs}]}
        with pytest.raises(kfeed.ConfigError) as e:
            kfeed.Loader(None, "memory", schema, 4, source=kfeed.MemorySource([]),
                         device="cpu", format=kfeed.Avro(schema=writer))
        assert str(e.value) == (f"field 'score': {where} is an Avro {kind}, not a record to "
                                f"read 'attrs.score' from: give a source through records only "
                                f"(kfeed skips maps and reads arrays whole)"), attrs
    # A union of null and a record: a null gives the default, as before.
    rec = {"type": "record", "name": "A", "fields": [{"name": "score", "type": "double"}]}
    writer = {"type": "record", "name": "E", "fields": [{"name": "id", "type": "long"},
                                                          {"name": "attrs",
                                                           "type": ["null", rec]}]}
    kfeed.Loader(None, "memory", schema, 4, source=kfeed.MemorySource([]), device="cpu",
                 format=kfeed.Avro(schema=writer)).close()


def test_a_nullable_value_schema_reads_its_record_and_a_null_is_a_bad_record():
    # ["null", Record] at the top, which AvroSerializer takes and its
    # deserializer reads: "the writer schema is 'union'; kfeed reads Avro
    # records", for every message, with no way to read the topic.
    record = {"type": "record", "name": "R", "fields": [{"name": "id", "type": "long"},
                                                        {"name": "x", "type": "double"}]}
    writer = fastavro.parse_schema(["null", record])
    values = []
    for i in range(5):
        out = io.BytesIO()
        fastavro.schemaless_writer(out, writer, None if i == 2 else {"id": i, "x": i * 1.5})
        values.append(out.getvalue())
    schema = kfeed.Schema({"id": ("int64", ()), "x": ("float32", ())})
    src = kfeed.MemorySource(values)
    with kfeed.Loader(None, "memory", schema, 8, device="cpu", source=src, until="end",
                      format=kfeed.Avro(schema=["null", record])) as ld:
        batches = list(ld)
    assert [b["id"].tolist() for b in batches] == [[0, 1, 3, 4]]
    assert batches[0]["x"].tolist() == [0.0, 1.5, 4.5, 6.0]
    assert [reason for _m, reason in src.dead_letters] == [
        "field 'id': missing or null, and no default"]
