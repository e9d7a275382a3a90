"""Protobuf topics as other services write them: kfeed's batches against protobuf's own parser.

The message classes are built from a FileDescriptorProto at import (what
protoc's generated code does), the values written by confluent-kafka's
``ProtobufSerializer`` (Confluent framing) or by ``SerializeToString``.
Every field of every record kfeed decodes must equal what
``ProtobufDeserializer`` (or ``ParseFromString``) gives.
"""

from __future__ import annotations

import pickle
import re
import uuid
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Producer as KafkaProducer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.protobuf import (
    ProtobufDeserializer,
    ProtobufSerializer,
)
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from records import check_packed_documents, damage, decode_all, read_columns, read_dlq

import kfeed

F = descriptor_pb2.FieldDescriptorProto
N = 8
CTX = SerializationContext("clicks", MessageField.VALUE)
CONF = {"use.deprecated.format": False}


def _classes() -> tuple[type, type]:
    """Click as the reader knows it, and a newer Click with two more fields."""
    out = []
    for version in (1, 2):
        fdp = descriptor_pb2.FileDescriptorProto(name=f"clicks_v{version}.proto",
                                                 package=f"shop.v{version}", syntax="proto3")
        kind = fdp.enum_type.add(name="Kind")
        for i, name in enumerate(("VIEW", "CLICK", "BUY")):
            kind.value.add(name=name, number=i)
        user = fdp.message_type.add(name="User")
        user.field.add(name="age", number=1, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
        user.field.add(name="country", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        # proto3 optional (presence, a oneof of one): its default reads where it is absent.
        user.oneof_decl.add(name="_score")
        user.field.add(name="score", number=3, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL,
                       proto3_optional=True, oneof_index=0)
        click = fdp.message_type.add(name="Click")
        add = click.field.add
        pkg = f".shop.v{version}"
        add(name="id", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
        add(name="features", number=2, type=F.TYPE_FLOAT, label=F.LABEL_REPEATED)  # packed
        weights = add(name="weights", number=3, type=F.TYPE_DOUBLE, label=F.LABEL_REPEATED)
        weights.options.packed = False                                         # unpacked
        add(name="label", number=4, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)  # negatives
        add(name="delta", number=5, type=F.TYPE_SINT64, label=F.LABEL_OPTIONAL)
        add(name="big", number=6, type=F.TYPE_UINT64, label=F.LABEL_OPTIONAL)
        add(name="flag", number=7, type=F.TYPE_BOOL, label=F.LABEL_OPTIONAL)
        add(name="kind", number=8, type=F.TYPE_ENUM, type_name=f"{pkg}.Kind",
            label=F.LABEL_OPTIONAL)
        add(name="f32", number=9, type=F.TYPE_FIXED32, label=F.LABEL_OPTIONAL)
        add(name="s64", number=10, type=F.TYPE_SFIXED64, label=F.LABEL_OPTIONAL)
        add(name="note", number=11, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        add(name="blob", number=12, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
        add(name="user", number=13, type=F.TYPE_MESSAGE, type_name=f"{pkg}.User",
            label=F.LABEL_OPTIONAL)
        if version == 2:  # fields the reader does not know: skipped
            add(name="extra", number=20, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
            add(name="more", number=21, type=F.TYPE_INT64, label=F.LABEL_REPEATED)
        pool = descriptor_pool.DescriptorPool()
        pool.Add(fdp)
        out.append(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"shop.v{version}.Click")))
    return out[0], out[1]


Click, ClickV2 = _classes()
SCHEMA = kfeed.Schema({
    "id": ("int64", ()),
    "features": ("float32", (N,)),
    "weights": ("float32", (2,), {"default": 0.0}),
    "label": ("int32", ()),
    "delta": ("int64", ()),
    "big": ("uint64", ()),
    "flag": ("bool", ()),
    "kind": ("int8", ()),
    "f32": ("float64", ()),
    "s64": ("int64", ()),
    "age": ("int16", (), {"source": "user.age"}),
    "score": ("float32", (), {"source": "user.score", "default": -1.0}),
})


def make(cls: type, i: int, rng: np.random.Generator) -> object:
    m = cls(id=i, features=rng.standard_normal(N).astype(np.float32).tolist(),
            label=int(rng.integers(-2**31, 2**31)), delta=int(rng.integers(-2**62, 2**62)),
            big=int(rng.integers(0, 2**63)) * 2 + 1, flag=bool(i % 2), kind=i % 3,
            f32=int(rng.integers(0, 2**32)), s64=-i * 1_000_003,
            note="n" * (i % 7), blob=bytes(i % 5))
    if i % 3:
        m.weights.extend([float(i), -float(i)])
    if i % 4:
        m.user.age = int(rng.integers(-100, 100))
        m.user.country = "DE"
        if i % 8:  # some set to 0.0: with presence, a 0 read as 0, not the default
            m.user.score = float(i) / 4 if i % 5 else 0.0
    if cls is ClickV2:
        m.extra = "x" * (i % 11)
        m.more.extend(range(i % 4))
    return m


def expected(msgs: list) -> dict[str, np.ndarray]:
    cols: dict[str, list] = {f.name: [] for f in SCHEMA.fields}
    for m in msgs:
        for f in SCHEMA.fields:
            if f.name == "age":
                v = m.user.age
            elif f.name == "score":
                v = m.user.score if m.HasField("user") and m.user.HasField("score") else -1.0
            elif f.name == "weights":
                v = list(m.weights) or [0.0, 0.0]
            elif f.name == "features":
                v = list(m.features)
            else:
                v = getattr(m, f.name)
            cols[f.name].append(v)
    return {f.name: np.array(cols[f.name], dtype=f.storage) for f in SCHEMA.fields}


@pytest.fixture
def registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})


def serialized(registry, n: int) -> tuple[list[bytes], list]:
    """n records, the second half by a newer writer with fields the reader does not know."""
    rng = np.random.default_rng(3)
    old = ProtobufSerializer(Click, registry, CONF)
    new = ProtobufSerializer(ClickV2, registry, {**CONF, "auto.register.schemas": True})
    values = []
    for i in range(n):
        values.append(old(make(Click, i, rng), CTX) if i < n // 2
                      else new(make(ClickV2, i, rng), CTX))
    reader = ProtobufDeserializer(Click, CONF)
    return values, [reader(v, CTX) for v in values]


def test_every_field_equals_confluent_kafkas_deserializer(registry):
    values, msgs = serialized(registry, 10_000)
    got, bad = decode_all(kfeed.Protobuf(message=Click, registry=registry).decoder(SCHEMA),
                          SCHEMA, values)
    assert bad == []
    want = expected(msgs)
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(got[f.name], want[f.name], err_msg=f.name)
    assert (got["label"] < 0).any() and (got["big"] > 2**63).any()
    assert (got["weights"] == 0).all(axis=1).any() and (got["score"] == -1).any()


def test_without_the_class_each_schema_id_is_read_from_the_registry(registry):
    from confluent_kafka.schema_registry import Schema

    # Two writer schemas (Click is the file's second message), read with no generated code.
    values, msgs = serialized(registry, 2_000)
    got, bad = decode_all(kfeed.Protobuf(registry=registry).decoder(SCHEMA), SCHEMA, values)
    assert bad == []
    want = expected(msgs)
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(got[f.name], want[f.name], err_msg=f.name)
    # Ids the registry does not have, or has as something else: bad records, with the reason.
    avro_id = registry.register_schema("other-value", Schema('"long"', "AVRO"))
    text_id = registry.register_schema("text-value", Schema(
        'syntax = "proto3"; message M { int64 id = 1; }', "PROTOBUF"))
    frame = values[0][5:]
    odd = [b"\x00" + i.to_bytes(4, "big") + frame for i in (99_999, avro_id)]
    odd.append(values[0][:5] + b"\x02\x0e" + values[0][6:])  # message index 7: none
    decoder = kfeed.Protobuf(registry=registry).decoder(SCHEMA)
    got, bad = decode_all(decoder, SCHEMA, [*odd, values[1]])
    assert got["id"].tolist() == [msgs[1].id]
    assert [why for _, why in bad] == [
        "schema id 99999 is not in the registry",
        f"schema id {avro_id} is AVRO, not Protobuf",
        (f"schema id {int.from_bytes(values[0][1:5], 'big')}: clicks_v1.proto has no message "
         f"at indexes [7]")]
    # A schema given as .proto text is no record's fault: every record of it
    # was dead-lettered. Reading stops, saying what to give.
    with pytest.raises(kfeed.ConsumeError, match=r"as \.proto text.*Protobuf\(message=\.\.\."):
        decode_all(decoder, SCHEMA, [b"\x00" + text_id.to_bytes(4, "big") + frame])
    with pytest.raises(kfeed.ConfigError, match="writing Protobuf needs message="):
        kfeed.Protobuf(registry=registry).encoder(SCHEMA, "t")


def test_without_the_class_a_schema_importing_well_known_types_reads(registry):
    from google.protobuf import timestamp_pb2

    fdp = descriptor_pb2.FileDescriptorProto(name="event.proto", package="ev", syntax="proto3",
                                             dependency=["google/protobuf/timestamp.proto"])
    ev = fdp.message_type.add(name="Event")
    ev.field.add(name="id", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    ev.field.add(name="at", number=2, type=F.TYPE_MESSAGE,
                 type_name=".google.protobuf.Timestamp", label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(timestamp_pb2.DESCRIPTOR.serialized_pb))
    pool.Add(fdp)
    event = message_factory.GetMessageClass(pool.FindMessageTypeByName("ev.Event"))
    schema = kfeed.Schema({"id": ("int64", ()), "sec": ("int64", (), {"source": "at.seconds"})})
    # Referenced as a schema of its own, or left to the reader as a known type.
    for conf in (CONF, {**CONF, "skip.known.types": False}):
        write = ProtobufSerializer(event, registry, conf)
        values = [write(event(id=i, at={"seconds": 100 + i}), CTX) for i in range(5)]
        got, bad = decode_all(kfeed.Protobuf(registry=registry).decoder(schema), schema, values)
        assert bad == [] and got["sec"].tolist() == [100, 101, 102, 103, 104]
    # The message whole into a number: the line named neither its type nor the way in.
    with pytest.raises(kfeed.ConfigError, match=re.escape(
            "field 'at' (int64) cannot take at, a message (google.protobuf.Timestamp): read "
            "its numbers into fields of their own, with {\"source\": \"at.seconds\"} and "
            "{\"source\": \"at.nanos\"}")):
        kfeed.Protobuf(message=event).decoder(kfeed.Schema({"at": ("int64", ())}))
    # A repeated one has no source to read through: no source is offered.
    ev.field.add(name="ats", number=3, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                 type_name=".google.protobuf.Timestamp")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(timestamp_pb2.DESCRIPTOR.serialized_pb))
    pool.Add(fdp)
    events = message_factory.GetMessageClass(pool.FindMessageTypeByName("ev.Event"))
    with pytest.raises(kfeed.ConfigError) as refused:
        kfeed.Protobuf(message=events).decoder(kfeed.Schema({"ats": ("int64", (2,))}))
    assert str(refused.value) == ("field 'ats' (int64 of shape (2,)) cannot take ats, a "
                                  "repeated message")


def _event_class(version: int) -> type:
    """shop.Ev as two writers had it: v1 with ``gone``, v2 without it and with ``added``."""
    fdp = descriptor_pb2.FileDescriptorProto(name=f"ev_v{version}.proto", package="shop",
                                             syntax="proto3")
    ev = fdp.message_type.add(name="Ev")
    ev.field.add(name="id", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    if version == 1:
        ev.field.add(name="gone", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    else:
        ev.field.add(name="added", number=3, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.Ev"))


def test_without_the_class_a_field_one_writer_lacks_reads_its_default(registry, caplog):
    # Every record of the writer without the field was bad, default or not.
    # Then the default was read in silence, also where a writer had renamed
    # the field (a rename changes no byte of a Protobuf record): it is said,
    # once per writer schema.
    values = []
    for version in (1, 2):
        cls = _event_class(version)
        write = ProtobufSerializer(cls, registry, CONF)
        extra = {"gone": 50} if version == 1 else {"added": 70}
        values += [write(cls(id=version * 10 + i, **{k: v + i for k, v in extra.items()}), CTX)
                   for i in range(3)]
    ids = [int.from_bytes(values[i][1:5], "big") for i in (0, 3)]
    schema = kfeed.Schema({"id": ("int64", ()), "added": ("int64", (), {"default": -7}),
                           "gone": ("int64", (), {"default": -1})})
    # A 0 of a writer that has the field (proto3, no presence: sent as nothing)
    # reads 0, as protobuf reads it; it read the default.
    values.append(write(cls(id=23, added=0), CTX))
    with caplog.at_level("WARNING", logger="kfeed"):
        got, bad = decode_all(kfeed.Protobuf(registry=registry).decoder(schema), schema,
                              values)
    said = [r.getMessage() for r in caplog.records if "gives no value" in r.getMessage()]
    assert said == [f"schema id {sid} gives no value for {name!r} (source {name!r}, default "
                    f"{default}): its records read the default; Protobuf fields are matched "
                    f"by name, so a field the writer renamed reads so too"
                    for sid, name, default in ((ids[0], "added", -7), (ids[1], "gone", -1))]
    assert bad == []
    assert got["id"].tolist() == [10, 11, 12, 20, 21, 22, 23]
    assert got["added"].tolist() == [-7, -7, -7, 70, 71, 72, 0]
    assert got["gone"].tolist() == [50, 51, 52, -1, -1, -1, -1]
    # With the class, such a default could only replace zeros: refused.
    with pytest.raises(kfeed.ConfigError, match="'added': added is a proto3 int64 without "
                                                "presence, where a 0 is sent as nothing"):
        kfeed.Protobuf(message=_event_class(2)).decoder(schema)
    # Without a default, the records of the writer lacking it are bad, saying so.
    schema = kfeed.Schema({"id": ("int64", ()), "added": ("int64", ())})
    got, bad = decode_all(kfeed.Protobuf(registry=registry).decoder(schema), schema, values)
    assert got["added"].tolist() == [70, 71, 72, 0]
    assert [i for i, _ in bad] == [0, 1, 2]
    assert "shop.Ev has no field 'added'" in bad[0][1] and "a default for the field" in bad[0][1]
    # A generated class must have every field still.
    with pytest.raises(kfeed.ConfigError, match="shop.Ev has no field 'added'"):
        kfeed.Protobuf(message=_event_class(1)).decoder(schema)


def test_two_fields_of_one_source_are_refused() -> None:
    # The plan kept the last: 'label' read as zeros beside 'label_f', in silence.
    schema = kfeed.Schema({"label": ("int32", ()),
                           "label_f": ("float32", (), {"source": "label"})})
    for fmt in (kfeed.Protobuf(message=Click), kfeed.Json(),
                kfeed.Avro(schema={"type": "record", "name": "R",
                                   "fields": [{"name": "label", "type": "int"}]})):
        with pytest.raises(kfeed.ConfigError, match="^fields 'label' and 'label_f' both "
                           "read 'label' of the .* records: each is read into one"):
            fmt.decoder(schema)


def test_a_truncated_value_names_the_field_it_ran_out_in() -> None:
    # "truncated" alone, wherever the value ran out but in a scalar read.
    v1 = _event_class(1)
    value = v1(id=300, gone=1 << 40).SerializeToString()  # tag, 2 bytes; tag, 6 bytes
    schema = kfeed.Schema({"id": ("int64", ())})
    wire = _tag(1, 1) + b"\x01\x02"  # id as a fixed64, cut short (a field read, its type wrong)
    res = kfeed.Protobuf(message=v1).decoder(schema).decode_into(
        [value[:2], value[:6], wire], schema.bind(schema.empty(3)), 0)
    assert res.rows == 0
    assert res.bad == [(0, "truncated at id"),
                       (1, "truncated in field number 2, which the schema does not read"),
                       (2, "truncated at id")]


def _one_field_class(package: str, message: str, field: str, number: int, type_: int,
                     syntax: str = "proto3") -> type:
    """The class of ``package.message``, of one optional field."""
    fdp = descriptor_pb2.FileDescriptorProto(name=f"{package}.proto", package=package,
                                             syntax=syntax)
    fdp.message_type.add(name=message).field.add(name=field, number=number, type=type_,
                                                 label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{message}"))


def test_a_uint64_past_int64_into_float32_rounds_once_as_numpy_casts_it() -> None:
    # It went through a double first: 2**63 + 2**39 + 1 became 2**63 (a tie, to
    # even), where numpy's cast of the uint64 gives 2**63 + 2**40.
    big = _one_field_class("big", "Big", "v", 1, F.TYPE_UINT64)
    xs = [2**63 + 2**39 + 1, 2**63 + 3 * 2**39 + 7, 2**64 - 1]
    for dtype in ("float32", "float64"):
        schema = kfeed.Schema({"v": (dtype, ())})
        out = schema.empty(len(xs))
        res = kfeed.Protobuf(message=big).decoder(schema).decode_into(
            [big(v=x).SerializeToString() for x in xs], schema.bind(out), 0)
        assert res.rows == 3 and res.bad == []
        assert out["v"].tolist() == np.array(xs, np.uint64).astype(dtype).tolist(), dtype


def test_plain_values_without_framing():
    rng = np.random.default_rng(4)
    msgs = [make(Click, i, rng) for i in range(300)]
    got, bad = decode_all(kfeed.Protobuf(message=Click).decoder(SCHEMA), SCHEMA,
                          [m.SerializeToString() for m in msgs], rows=64)
    assert bad == []
    want = expected([Click.FromString(m.SerializeToString()) for m in msgs])
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(got[f.name], want[f.name], err_msg=f.name)


def test_tags_and_lengths_longer_than_5_bytes_are_bad_as_protobuf_refuses_them():
    # They were read as any varint, up to 10 bytes, where protobuf's parser
    # refuses the message.
    ids = kfeed.Schema({"id": ("int64", ())})
    values = {
        "tag in 6 bytes": b"\x88\x80\x80\x80\x80\x00" + b"\x05",
        "tag in 10 bytes": b"\x88" + b"\x80" * 8 + b"\x00" + b"\x05",
        "packed length in 6 bytes": b"\x12\x84\x80\x80\x80\x80\x00" + b"\x00" * 4,
        "tag past 32 bits": b"\xf8\xff\xff\xff\x1f\x05",
        "length in 5 bytes": b"\x12\x84\x80\x80\x80\x00" + b"\x00" * 4 + b"\x08\x05",
        "tag in 5 bytes": b"\x88\x80\x80\x80\x00" + b"\x05",
    }
    for why, v in list(values.items())[:4]:
        with pytest.raises(DecodeError):
            Click.FromString(v)
    assert [Click.FromString(v).id for v in list(values.values())[4:]] == [5, 5]
    got, bad = decode_all(kfeed.Protobuf(message=Click).decoder(ids), ids, list(values.values()))
    assert got["id"].tolist() == [5, 5]
    assert [i for i, _why in bad] == [0, 1, 2, 3]
    assert [why for _i, why in bad][:3] == [
        "malformed varint", "malformed varint",
        "malformed varint in field number 2, which the schema does not read"]


def _proto2_class() -> type:
    fdp = descriptor_pb2.FileDescriptorProto(name="legacy.proto", package="legacy",
                                             syntax="proto2")
    m = fdp.message_type.add(name="Reading")
    m.field.add(name="id", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    m.field.add(name="level", number=2, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL,
                default_value="-42")
    m.field.add(name="ratio", number=3, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL,
                default_value="0.5")
    m.field.add(name="big", number=4, type=F.TYPE_UINT64, label=F.LABEL_OPTIONAL)
    m.field.add(name="pair", number=5, type=F.TYPE_UINT64, label=F.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("legacy.Reading"))


def test_proto2_defaults_groups_and_values_past_int64_read_as_protobuf_reads_them():
    Reading = _proto2_class()

    def tag(number: int, wire: int) -> bytes:
        return bytes([number << 3 | wire])

    # An unknown group (field 9, wire types 3 and 4) holding a nested group:
    # skipped, as protobuf keeps it among the unknown fields.
    group = tag(9, 3) + tag(1, 0) + b"\x03" + tag(2, 3) + tag(1, 0) + b"\x04" + tag(2, 4) \
        + tag(9, 4)
    values = [Reading(id=1).SerializeToString(),
              Reading(id=2, level=-3, ratio=2.5).SerializeToString(),
              Reading(id=3).SerializeToString() + group,
              Reading(id=4, big=2**63 + 5).SerializeToString(),          # past int64
              Reading(id=5, pair=[2**63] * 3).SerializeToString(),      # 3 of 2
              Reading(id=6).SerializeToString() + tag(9, 4),              # an end alone
              Reading(id=7).SerializeToString() + tag(9, 3) + tag(1, 0) + b"\x03" + tag(8, 4)]
    schema = kfeed.Schema({"id": ("int64", ()), "level": ("int32", ()), "ratio": ("float32", ()),
                           "big": ("int64", (), {"default": 0}),
                           "pair": ("uint64", (2,), {"default": [0, 0]})})
    got, bad = decode_all(kfeed.Protobuf(message=Reading).decoder(schema), schema, values)
    want = [Reading.FromString(v) for v in values[:3]]
    assert got["id"].tolist() == [1, 2, 3]
    assert got["level"].tolist() == [w.level for w in want] == [-42, -3, -42]
    assert got["ratio"].tolist() == [w.ratio for w in want] == [0.5, 2.5, 0.5]
    assert bad == [(3, "9223372036854775813 does not fit field 'big' (int64) at big"),
                   (4, "field 'pair': 3 values do not match its shape at pair"),
                   (5, "bad tag (field number 0, a group's end without its start, "
                       "or wire type 6 or 7)"),
                   (6, "bad tag (field number 0, a group's end without its start, "
                       "or wire type 6 or 7)")]
    # A declared default the field cannot hold is a mistake in the schema.
    with pytest.raises(kfeed.ConfigError, match=r"^field 'level' \(uint8\) cannot hold -42, "
                                                r"the proto2 default of level: give the field"):
        kfeed.Protobuf(message=Reading).decoder(kfeed.Schema({"level": ("uint8", ())}))
    kfeed.Protobuf(message=Reading).decoder(kfeed.Schema({"level": ("uint8", (), {"default": 0})}))


def _last_wins_class() -> type:
    """M: two scalars, and a oneof of two ints and a message of repeated fields."""
    fdp = descriptor_pb2.FileDescriptorProto(name="lastwins.proto", package="lastwins",
                                             syntax="proto3")
    c = fdp.message_type.add(name="C")
    c.field.add(name="r", number=1, type=F.TYPE_INT32, label=F.LABEL_REPEATED)
    c.field.add(name="v", number=2, type=F.TYPE_FLOAT, label=F.LABEL_REPEATED)  # packed
    m = fdp.message_type.add(name="M")
    m.oneof_decl.add(name="o")
    m.field.add(name="small", number=1, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
    m.field.add(name="u", number=2, type=F.TYPE_UINT64, label=F.LABEL_OPTIONAL)
    m.field.add(name="a", number=3, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL, oneof_index=0)
    m.field.add(name="b", number=4, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL, oneof_index=0)
    m.field.add(name="c", number=5, type=F.TYPE_MESSAGE, type_name=".lastwins.C",
                label=F.LABEL_OPTIONAL, oneof_index=0)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("lastwins.M"))


def test_a_value_protobuf_drops_does_not_make_the_record_bad():
    # Protobuf keeps a field's last value, and a oneof member read clears the
    # others (serialized messages concatenated merge): a value a field cannot
    # take that protobuf drops is no part of the record. One it keeps is.
    M = _last_wins_class()
    C = M.DESCRIPTOR.fields_by_name["c"].message_type._concrete_class

    def of(*parts: Any) -> bytes:
        return b"".join(M(**kw).SerializeToString() for kw in parts)

    kept = [of({"small": 1000}, {"small": 5}),                   # the last one fits
            of({"u": 2**64 - 1}, {"u": 7}),                      # past int64, then 7
            of({"a": 1000}, {"b": 1}),                           # a cleared by b
            of({"c": C(r=[1000, 1, 3])}, {"b": 1}, {"c": C(r=[7, 8])}),  # c cleared, again
            of({"c": C(v=[1, 2, 3])}, {"a": 1}, {"c": C(v=[4, 5])}),     # packed floats
            of({"c": C(r=[1])}, {"c": C(r=[2])})]                # merged: [1, 2]
    refused = [of({"small": 5}, {"small": 1000}),                # the last one does not fit
               of({"b": 1}, {"a": 1000}),
               of({"c": C(r=[1000, 1])}, {"c": C()}),            # merged: 1000 stays
               of({"c": C(r=[1, 2, 3])}),
               of({"c": C(v=[1, 2])}, {"c": C(v=[3])}),          # merged: 3 floats
               of({"c": C(r=[1, 2])}, {"a": 1}, {"c": C(r=[7, 2**20])})]
    schema = kfeed.Schema({"small": ("int8", ()), "u": ("int64", ()), "a": ("int8", ()),
                           "r": ("int8", (2,), {"source": "c.r", "default": [0, 0]}),
                           "v": ("float32", (2,), {"source": "c.v", "default": [0, 0]})})
    got, bad = decode_all(kfeed.Protobuf(message=M).decoder(schema), schema, kept + refused)
    assert bad == [(6, "1000 does not fit field 'small' (int8) at small"),
                   (7, "1000 does not fit field 'a' (int8) at a"),
                   (8, "1000 does not fit field 'r' (int8) at c.r"),
                   (9, "field 'r': 3 values do not match its shape at c.r"),
                   (10, "field 'v': 3 values do not match its shape at c.v"),
                   (11, "1048576 does not fit field 'r' (int8) at c.r")]
    want = [M.FromString(v) for v in kept]
    assert got["small"].tolist() == [w.small for w in want] == [5, 0, 0, 0, 0, 0]
    assert got["u"].tolist() == [w.u for w in want] == [0, 7, 0, 0, 0, 0]
    assert got["a"].tolist() == [w.a for w in want] == [0, 0, 0, 0, 0, 0]
    assert got["r"].tolist() == [list(w.c.r) or [0, 0] for w in want]
    assert got["r"].tolist()[3:] == [[7, 8], [0, 0], [1, 2]]
    assert got["v"].tolist() == [list(w.c.v) or [0, 0] for w in want]
    assert got["v"].tolist()[4] == [4.0, 5.0]


def _tag(number: int, wire: int) -> bytes:
    return bytes([number << 3 | wire])


def test_a_closed_enum_s_unknown_values_are_left_aside_as_protobuf_leaves_them():
    # proto2 enums are closed: a value none of the enum's is kept among the
    # unknown fields, the field (and its oneof) as it was, an absent field
    # reading as the enum's first value; packed or not, a repeated field
    # keeps only the known values.
    fdp = descriptor_pb2.FileDescriptorProto(name="closed.proto", package="closed",
                                             syntax="proto2")
    color = fdp.enum_type.add(name="Color")
    for name, number in (("RED", 3), ("BLUE", -2), ("GREEN", 7)):
        color.value.add(name=name, number=number)
    m = fdp.message_type.add(name="Paint")
    m.oneof_decl.add(name="choice")
    m.field.add(name="c", number=1, type=F.TYPE_ENUM, type_name=".closed.Color",
                label=F.LABEL_OPTIONAL)
    m.field.add(name="cs", number=2, type=F.TYPE_ENUM, type_name=".closed.Color",
                label=F.LABEL_REPEATED)
    m.field.add(name="cp", number=3, type=F.TYPE_ENUM, type_name=".closed.Color",
                label=F.LABEL_REPEATED, options=descriptor_pb2.FieldOptions(packed=True))
    m.field.add(name="pick", number=4, type=F.TYPE_ENUM, type_name=".closed.Color",
                label=F.LABEL_OPTIONAL, oneof_index=0)
    m.field.add(name="other", number=5, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL,
                oneof_index=0)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    Paint = message_factory.GetMessageClass(pool.FindMessageTypeByName("closed.Paint"))

    varint = _varint
    rng = np.random.default_rng(5)
    values = []
    for _ in range(400):
        parts = []
        for _ in range(int(rng.integers(0, 6))):
            number = int(rng.integers(1, 6))
            v = int(rng.choice([3, -2, 7, 0, 1, 9, -1, 2**31 - 1]))
            if number == 3 and rng.random() < 0.7:
                body = b"".join(varint(int(rng.choice([3, -2, 7, 0, 5])))
                                for _ in range(int(rng.integers(0, 4))))
                parts.append(_tag(3, 2) + varint(len(body)) + body)
            else:
                parts.append(_tag(number, 0) + varint(v))
        values.append(b"".join(parts))
    schema = kfeed.Schema({"c": ("int32", ()), "pick": ("int32", (), {"default": 100}),
                           "other": ("int32", (), {"default": 200})})
    got, bad = decode_all(kfeed.Protobuf(message=Paint).decoder(schema), schema, values,
                          rows=len(values))
    assert bad == []
    want = [Paint.FromString(v) for v in values]
    assert got["c"].tolist() == [w.c for w in want]
    assert got["pick"].tolist() == [w.pick if w.HasField("pick") else 100 for w in want]
    assert got["other"].tolist() == [w.other if w.HasField("other") else 200 for w in want]
    for name in ("cs", "cp"):  # unpacked, packed
        docs = kfeed.Protobuf(message=Paint).decoder(kfeed.Schema({name: ("int64", (None,))}))
        out = docs.decode_documents(values)
        assert out.bad == []
        assert out.tokens.tolist() == [x for w in want for x in getattr(w, name)]
    assert {w.c for w in want} == {3, -2, 7} and any(len(w.cp) for w in want)


def test_a_known_field_in_another_wire_type_reads_as_protobuf_parses_it():
    # protobuf parses a known field sent in another wire type as an unknown
    # field: the message parses, the field keeps what it had (unset, if
    # nothing set it). A repeated scalar may come packed or unpacked, either
    # way. A group's end alone, or wire type 6 or 7, fails the parse.
    rng = np.random.default_rng(8)
    base = Click(id=7, features=rng.standard_normal(N).astype(np.float32).tolist(), label=-3,
                 f32=9, flag=True, user={"age": 4, "score": 1.5}).SerializeToString()
    no_lists = Click(id=8, label=5, user={"age": 6}).SerializeToString()
    half = np.arange(N // 2, dtype=np.float32)
    user_age_as_fixed64 = _tag(1, 1) + bytes(8)
    values = [
        base + _tag(1, 5) + b"\x01\x00\x00\x00",                 # id (int64) as fixed32
        base + _tag(1, 1) + bytes(range(8)),                     # ... as fixed64
        base + _tag(1, 2) + b"\x02\x01\x02",                     # ... as bytes (not repeated)
        base + _tag(1, 3) + _tag(1, 0) + b"\x05" + _tag(1, 4),    # ... as a group
        _tag(1, 5) + b"\x01\x00\x00\x00" + base,                 # before the field itself
        base + _tag(13, 0) + b"\x07",                            # user (a message) as varint
        base + _tag(13, 2) + bytes([len(user_age_as_fixed64)]) + user_age_as_fixed64,
        base + _tag(9, 0) + b"\x05",                             # f32 (fixed32) as varint
        base + _tag(7, 5) + b"\x00\x00\x00\x00",                 # flag (bool) as fixed32
        base + _tag(2, 0) + b"\x01",                             # features as varint
        base + _tag(3, 5) + b"\x00\x00\x80\x3f",                 # weights (double) as float
        # features packed and unpacked in one message; weights (unpacked) packed.
        no_lists + _tag(2, 2) + bytes([4 * len(half)]) + half.tobytes()
        + b"".join(_tag(2, 5) + x.tobytes() for x in half + 10)
        + _tag(3, 2) + b"\x10" + np.array([1.5, -2.5]).tobytes(),
        base + _tag(1, 4),                                       # a group's end alone
        base + _tag(1, 7),                                       # wire type 7
        base + _tag(13, 6),
    ]
    parsed = []
    for v in values:
        try:
            parsed.append(Click.FromString(v))
        except DecodeError:
            parsed.append(None)
    assert [p is None for p in parsed] == [False] * 12 + [True] * 3
    got, bad = decode_all(kfeed.Protobuf(message=Click).decoder(SCHEMA), SCHEMA, values)
    want = expected([p for p in parsed if p is not None])
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(got[f.name], want[f.name], err_msg=f.name)
    assert got["id"].tolist() == [7] * 11 + [8]
    assert got["features"][-1].tolist() == [*half, *(half + 10)]
    assert bad == [(i, "bad tag (field number 0, a group's end without its start, "
                       "or wire type 6 or 7)") for i in (12, 13, 14)]


def _oneof_class() -> type:
    fdp = descriptor_pb2.FileDescriptorProto(name="pick.proto", package="pick", syntax="proto3")
    inner = fdp.message_type.add(name="Inner")
    inner.field.add(name="x", number=1, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
    inner.field.add(name="r", number=2, type=F.TYPE_INT32, label=F.LABEL_REPEATED)
    ev = fdp.message_type.add(name="Event")
    for name in ("choice", "pick", "_opt"):
        ev.oneof_decl.add(name=name)
    add = ev.field.add
    add(name="id", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    add(name="a", number=2, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL, oneof_index=0)
    add(name="b", number=3, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL, oneof_index=0)
    add(name="c", number=4, type=F.TYPE_MESSAGE, type_name=".pick.Inner",
        label=F.LABEL_OPTIONAL, oneof_index=0)
    add(name="s", number=5, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL, oneof_index=0)
    add(name="raw", number=9, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL, oneof_index=0)
    add(name="opt", number=6, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL, oneof_index=2,
        proto3_optional=True)
    add(name="p", number=8, type=F.TYPE_SINT64, label=F.LABEL_OPTIONAL, oneof_index=1)
    add(name="q", number=10, type=F.TYPE_FIXED32, label=F.LABEL_OPTIONAL, oneof_index=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("pick.Event"))


def test_oneof_members_on_the_wire_leave_the_last_one_as_protobuf_does():
    # Two members of one oneof in a message: protobuf keeps the one parsed
    # last, and the others read as unset (their default), whether the schema
    # reads the last one or not; a message member again merges into itself.
    # A proto3 optional field is a oneof of its own, and a member in another
    # wire type is an unknown field, which leaves the oneof as it was.
    event = _oneof_class()
    schema = kfeed.Schema({"id": ("int64", ()), "a": ("int32", ()),
                           "b": ("float64", (), {"default": -1.0}),
                           "x": ("int32", (), {"source": "c.x"}),
                           "r": ("int32", (2,), {"source": "c.r", "default": [0, 0]}),
                           "opt": ("int32", ()), "p": ("int64", ())})
    cases = [
        [{"a": 5}, {"b": 2.5}], [{"b": 2.5}, {"a": 5}],
        [{"c": {"x": 3, "r": [1, 2]}}, {"a": 7}], [{"a": 7}, {"c": {"x": 3}}],
        [{"c": {"x": 3}}, {"c": {"r": [1, 2]}}], [{"c": {"x": 3}}, {"a": 1}, {"c": {"r": [1, 2]}}],
        [{"a": 5}, {"s": "hi"}], [{"a": 5}, {"raw": b"\x00"}], [{"s": "hi"}, {"b": 0.0}],
        [{"p": -3}, {"q": 9}], [{"q": 9}, {"p": -3}], [{"opt": 4}, {"a": 1}, {"opt": 5}],
        [{"b": 1.5}, {"a": 2}, {"b": 2.5}, {"c": {"x": 1}}, {"a": 3}],
    ]
    values = [b"".join(event(id=i, **piece).SerializeToString() for piece in pieces)
              for i, pieces in enumerate(cases)]
    values.append(event(id=99, a=5).SerializeToString() + _tag(3, 0) + b"\x01")  # b as varint
    msgs = [event.FromString(v) for v in values]
    assert [m.WhichOneof("choice") for m in msgs] == [
        "b", "a", "a", "c", "c", "c", "s", "raw", "b", None, None, "a", "a", "a"]
    got, bad = decode_all(kfeed.Protobuf(message=event).decoder(schema), schema, values)
    assert bad == []
    assert got["id"].tolist() == [m.id for m in msgs]
    assert got["a"].tolist() == [m.a for m in msgs]
    assert got["b"].tolist() == [m.b if m.HasField("b") else -1.0 for m in msgs]
    assert got["x"].tolist() == [m.c.x for m in msgs]
    assert got["r"].tolist() == [list(m.c.r) or [0, 0] for m in msgs]
    assert got["opt"].tolist() == [m.opt for m in msgs]
    assert got["p"].tolist() == [m.p for m in msgs]
    # A member read as a document: unset by a later member, it is empty.
    text = kfeed.Schema({"raw": ("uint8", (None,))})
    docs = kfeed.Protobuf(message=event).decoder(text).decode_documents(
        [event(raw=b"abc").SerializeToString() + event(a=1).SerializeToString(),
         event(a=1).SerializeToString() + event(raw=b"xy").SerializeToString()])
    assert not docs.bad and docs.lengths.tolist() == [0, 2] and docs.tokens.tobytes() == b"xy"


def test_corrupt_values_are_rejected_whole_with_a_reason(registry):
    rng = np.random.default_rng(5)
    write = ProtobufSerializer(Click, registry, CONF)
    good = [write(make(Click, i, rng), CTX) for i in range(4)]
    short = make(Click, 100, rng)
    del short.features[-1]
    loud = make(Click, 101, rng)
    loud.user.age = 40_000
    values = [
        good[0],
        b"\x01" + good[1][1:],                      # wrong magic byte
        good[1][:-2],                               # truncated
        write(short, CTX),                          # 7 features, not 8
        write(loud, CTX),                           # 40000 in an int16
        good[0][:5] + b"\x7f" + good[0][6:],        # a message-index count of -64
        good[0][:7] + b"\x0d\x00\x00\x80\x3f",      # id as fixed32, unknown: no features
        b"\x00\x00\x00",                            # shorter than the framing
        good[2],
    ]
    reasons = {1: "magic byte 1, expected 0", 2: "truncated",
               3: "field 'features': 7 values do not match its shape",
               4: "40000 does not fit field 'age' (int16) at user.age",
               5: "malformed message-index array",
               6: "field 'features': repeated field absent, and no default",
               7: "too short for the Confluent framing"}
    got, bad = decode_all(kfeed.Protobuf(message=Click, registry=registry).decoder(SCHEMA),
                          SCHEMA, values, rows=3)
    assert [i for i, _ in bad] == sorted(reasons)
    for i, why in bad:
        assert reasons[i] in why, (i, why)
    assert got["id"].tolist() == [0, 2]


def test_configuration_mistakes_get_one_clear_line(registry):
    with pytest.raises(kfeed.ConfigError, match="needs message= .* or registry="):
        kfeed.Protobuf()
    with pytest.raises(kfeed.ConfigError, match="message= must be a generated message class"):
        kfeed.Protobuf(message="Click")
    with pytest.raises(kfeed.ConfigError, match="shop.v1.Click has no field 'nope'"):
        kfeed.Protobuf(message=Click).decoder(kfeed.Schema({"nope": ("int64", ())}))
    with pytest.raises(kfeed.ConfigError, match=r"'note' \(float32\) cannot take note, a string"):
        kfeed.Protobuf(message=Click).decoder(kfeed.Schema({"note": ("float32", ())}))
    with pytest.raises(kfeed.ConfigError, match="cannot take features, a repeated float"):
        kfeed.Protobuf(message=Click).decoder(kfeed.Schema({"features": ("float32", ())}))
    with pytest.raises(kfeed.ConfigError, match="cannot take label, a int32"):
        kfeed.Protobuf(message=Click).decoder(kfeed.Schema({"label": ("bool", ())}))
    with pytest.raises(kfeed.ConfigError, match="not a message to read 'id.x' from"):
        kfeed.Protobuf(message=Click).decoder(
            kfeed.Schema({"x": ("int64", (), {"source": "id.x"})}))
    with pytest.raises(kfeed.ConfigError, match="give registry= its config dict"):
        pickle.dumps(kfeed.Protobuf(message=Click, registry=registry))
    with pytest.raises(kfeed.ConfigError, match=r"'label' \(int32 of shape \(None,\)\) cannot "
                                                r"take label, a int32"):
        kfeed.Protobuf(message=Click).decoder(kfeed.Schema({"label": ("int32", (None,))}))
    with pytest.raises(kfeed.ConfigError, match="cannot take features, a repeated float"):
        kfeed.Protobuf(message=Click).decoder(kfeed.Schema({"features": ("int32", (None,))}))
    with pytest.raises(kfeed.ConfigError, match="cannot take note, a string"):
        kfeed.Protobuf(message=Click).decoder(kfeed.Schema({"note": ("int32", (None,))}))


def _doc_class(text: int = F.TYPE_STRING) -> type:
    fdp = descriptor_pb2.FileDescriptorProto(name="doc.proto", package="corpus", syntax="proto3")
    doc = fdp.message_type.add(name="Doc")
    doc.field.add(name="id", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    doc.field.add(name="ids", number=2, type=F.TYPE_UINT32, label=F.LABEL_REPEATED)  # packed
    unpacked = doc.field.add(name="unpacked", number=3, type=F.TYPE_INT32,
                             label=F.LABEL_REPEATED)
    unpacked.options.packed = False
    doc.field.add(name="text", number=4, type=text, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("corpus.Doc"))


Doc = _doc_class()


def _only(name: str) -> type:
    """Doc with just the field ``name``: protobuf skips the others unread, as kfeed does
    (it would reject a value for a malformed field that kfeed, not reading it, skips)."""
    full = descriptor_pb2.DescriptorProto()
    Doc.DESCRIPTOR.CopyToProto(full)
    fdp = descriptor_pb2.FileDescriptorProto(name=f"only_{name}.proto", package=f"only_{name}",
                                             syntax="proto3")
    fdp.message_type.add(name="Doc").field.add().CopyFrom(
        next(f for f in full.field if f.name == name))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"only_{name}.Doc"))


def test_a_string_document_absent_or_present_and_empty_reads_as_protobuf_reads_it():
    # An absent proto2 string with a declared default read as an empty
    # document, not "abc"; a proto3 optional string sent as "" took the
    # field's default, as if it were absent.
    fdp = descriptor_pb2.FileDescriptorProto(name="strs.proto", package="strs", syntax="proto2")
    fdp.message_type.add(name="Old").field.add(name="s", number=1, type=F.TYPE_STRING,
                                               label=F.LABEL_OPTIONAL, default_value="abc")
    new = descriptor_pb2.FileDescriptorProto(name="strs3.proto", package="strs3",
                                             syntax="proto3")
    m = new.message_type.add(name="New")
    m.oneof_decl.add(name="_s")
    m.field.add(name="s", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL,
                proto3_optional=True, oneof_index=0)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    pool.Add(new)
    old_cls, new_cls = (message_factory.GetMessageClass(pool.FindMessageTypeByName(n))
                        for n in ("strs.Old", "strs3.New"))
    text = kfeed.Schema({"s": ("uint8", (None,))})
    docs = kfeed.Protobuf(message=old_cls).decoder(text).decode_documents([b""])
    assert (bytes(docs.tokens), docs.bad) == (old_cls.FromString(b"").s.encode(), [])
    with_default = kfeed.Schema({"s": ("uint8", (None,), {"default": list(b"N/A")})})
    values = [new_cls(s="").SerializeToString(), b""]
    docs = kfeed.Protobuf(message=new_cls).decoder(with_default).decode_documents(values)
    assert docs.lengths.tolist() == [0, 3] and bytes(docs.tokens) == b"N/A"
    assert new_cls.FromString(values[0]).HasField("s")


def test_a_string_document_that_is_not_utf8_is_bad_where_protobuf_refuses_it():
    # proto3 checks a string is UTF-8, proto2 does not: kfeed read both.
    text = kfeed.Schema({"text": ("uint8", (None,))})
    values = [b"\x22\x02ok", b"\x22\x02\xff\xfe", b"\x22\x03\xed\xa0\x80",  # a surrogate
              b"\x22\x02\xc0\x80", "é€😀".encode().join([b"\x22\x09", b""])]
    verdicts = []
    for v in values:
        try:
            Doc.FromString(v)
            verdicts.append(True)
        except DecodeError:
            verdicts.append(False)
    assert verdicts == [True, False, False, False, True]
    docs = kfeed.Protobuf(message=Doc).decoder(text).decode_documents(values)
    assert [i for i, _why in docs.bad] == [1, 2, 3]
    assert docs.bad[0][1] == "field 'text': a string that is not UTF-8 at text (as protobuf refuses it)"
    lax = _one_field_class("lax", "Doc", "text", 4, F.TYPE_STRING, syntax="proto2")
    assert lax.FromString(values[1]).text == b"\xff\xfe"  # (protobuf's bytes, unchecked)
    docs = kfeed.Protobuf(message=lax).decoder(text).decode_documents(values)
    assert docs.bad == [] and bytes(docs.tokens[2:4]) == b"\xff\xfe"


def doc_values(registry, n: int) -> tuple[list[bytes], list]:
    """n documents by ``ProtobufSerializer``; how ``ProtobufDeserializer`` reads them back."""
    rng = np.random.default_rng(5)
    ser = ProtobufSerializer(Doc, registry, CONF)
    values = []
    for i in range(n):
        ids = rng.integers(1, 65535, int(rng.integers(0, 700))).tolist()
        values.append(ser(Doc(id=i, ids=ids, unpacked=ids[:50],
                              text="t\u00e9xt " * int(rng.integers(0, 5))), CTX))
    reader = ProtobufDeserializer(Doc, CONF)
    return values, [reader(v, CTX) for v in values]


def test_token_documents_pack_as_kfeeds_own_and_resume_exactly(registry):
    values, msgs = doc_values(registry, 1500)
    values[7] = values[7] + b"\x08"   # a tag without its value: rejected whole
    # proto3 cannot tell an empty repeated field from an absent one: both take the default.
    docs = [None if i == 7 else list(m.ids) or [3, 3] for i, m in enumerate(msgs)]
    schema = kfeed.Schema({"tokens": ("uint16", (None,), {"source": "ids", "default": [3, 3]})})
    check_packed_documents(values, schema, kfeed.Protobuf(message=Doc, registry=registry), docs,
                           kfeed.Pack(seq_len=256, eos_id=65535, pad_id=0))


def test_documents_equal_the_deserializers_repeated_fields_and_strings(registry):
    values, msgs = doc_values(registry, 300)
    fmt = kfeed.Protobuf(message=Doc, registry=registry)
    for name in ("ids", "unpacked"):
        got = fmt.decoder(kfeed.Schema({"t": ("int32", (None,), {"source": name})})
                          ).decode_documents(values)
        assert not got.bad
        assert got.lengths.tolist() == [len(getattr(m, name)) for m in msgs]
        assert got.tokens.tolist() == [t for m in msgs for t in getattr(m, name)]
    text = fmt.decoder(kfeed.Schema({"text": ("uint8", (None,))})).decode_documents(values)
    assert text.tokens.tobytes() == "".join(m.text for m in msgs).encode()
    assert text.lengths.tolist() == [len(m.text.encode()) for m in msgs]
    small = fmt.decoder(kfeed.Schema({"t": ("uint8", (None,), {"source": "ids"})})
                        ).decode_documents(values[:20])
    assert {i for i, _ in small.bad} == {i for i, m in enumerate(msgs[:20])
                                         if max(m.ids, default=0) > 255}
    assert all("does not fit field 't' (uint8) at ids" in why for _, why in small.bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_values_never_crash_and_decode_as_protobuf_parses_them(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    good = make(Click, 7, rng).SerializeToString()
    raw = damage(data, bytearray(good), list(range(256)),
                 [b"\xff" * k + b"\x01" for k in (1, 5, 12)], rounds=(1, 4))
    out = {f.name: np.zeros((2, *f.shape), f.storage) for f in SCHEMA.fields}
    decoder = kfeed.Protobuf(message=Click).decoder(SCHEMA)
    res = decoder.decode_into([bytes(raw), good], SCHEMA.bind(out), 0)
    assert res.consumed == 2 and res.rows + len(res.bad) == 2
    assert out["id"][res.rows - 1] == 7  # the good value after it lands whole
    if not res.bad:
        # kfeed took it: protobuf's own parser reads the same fields (it may
        # refuse a string kfeed skipped for its UTF-8; kfeed reads no string).
        try:
            parsed = Click.FromString(bytes(raw))
        except Exception:  # noqa: BLE001 - DecodeError, or a RuntimeError on bad UTF-8
            return
        want = expected([parsed])
        for f in SCHEMA.fields:
            if f.name in ("features", "weights") and \
                    len(getattr(parsed, f.name)) not in (0, f.shape[0]):
                continue
            np.testing.assert_array_equal(out[f.name][0], want[f.name][0], err_msg=f.name)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_documents_never_crash_and_read_as_protobuf_parses_them(data):
    n = data.draw(st.integers(0, 40))
    good = Doc(id=3, ids=range(n), unpacked=range(n), text="ab").SerializeToString()
    raw = bytes(damage(data, bytearray(good), list(range(256)),
                       [b"\xff" * k + b"\x01" for k in (1, 5, 12)], rounds=(1, 4)))
    name = data.draw(st.sampled_from(["ids", "unpacked"]))
    schema = kfeed.Schema({"t": ("int64", (None,), {"source": name})})
    got = kfeed.Protobuf(message=Doc).decoder(schema).decode_documents([raw, good])
    assert got.counts[1] == 1 and got.tokens[len(got.tokens) - n:].tolist() == list(range(n))
    if got.counts[0]:  # kfeed took it whole: protobuf parses the same document from it
        parsed = _only(name).FromString(raw)
        assert got.tokens[:got.lengths[0]].tolist() == list(getattr(parsed, name))


@pytest.mark.integration
def test_loader_reads_a_topic_written_by_confluent_kafkas_serializer(bootstrap, make_topic,
                                                                     registry):
    topic = make_topic(partitions=3)
    values, msgs = serialized(registry, 10_000)
    bad_values = [b"\x01" + values[0][1:], values[1][:-2]]
    p = KafkaProducer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for i, v in enumerate(values):
        p.produce(topic, v)
        if i == 4000:
            for b in bad_values:
                p.produce(topic, b)
        p.poll(0)
    assert p.flush(60) == 0
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    got: dict[str, list] = {f.name: [] for f in SCHEMA.fields}
    with kfeed.Loader(config, topic, SCHEMA, 512, device="cpu", until="end",
                      format=kfeed.Protobuf(message=Click, registry=registry)) as loader:
        for batch in loader:
            for name, parts in got.items():
                parts.append(batch[name].numpy().copy())
    cols = {k: np.concatenate(v) for k, v in got.items()}
    order = np.argsort(cols["id"])
    np.testing.assert_array_equal(cols["id"][order], np.arange(10_000))
    want = expected(msgs)
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(cols[f.name][order], want[f.name], err_msg=f.name)
    dead = read_dlq(bootstrap, topic, len(bad_values))
    assert sorted(m.value() for m in dead) == sorted(bad_values)


@pytest.mark.integration
def test_a_real_registry_gives_the_schemas_and_no_class_is_needed(bootstrap, make_topic,
                                                                  schema_registry):
    registry = SchemaRegistryClient({"url": schema_registry})
    topic = make_topic(partitions=2)
    values, msgs = serialized(registry, 3_000)
    p = KafkaProducer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for v in values:
        p.produce(topic, v)
    assert p.flush(60) == 0
    cols = read_columns(bootstrap, topic, SCHEMA,
                        kfeed.Protobuf(registry={"url": schema_registry}), batch_size=256)
    order = np.argsort(cols["id"])
    want = expected(msgs)
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(cols[f.name][order], want[f.name], err_msg=f.name)


# -- writing: kfeed.Producer(format=kfeed.Protobuf(...)) -----------------------------------


def write_columns(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(9)
    return {
        "id": np.arange(n, dtype=np.int64), "features": rng.standard_normal((n, N), np.float32),
        "weights": rng.standard_normal((n, 2)).astype(np.float32),
        "label": rng.integers(-2**31, 2**31, n).astype(np.int32),
        "delta": rng.integers(-2**62, 2**62, n), "big": rng.integers(0, 2**64, n, np.uint64,
                                                                     endpoint=False),
        "flag": rng.integers(0, 2, n).astype(bool), "kind": (np.arange(n) % 3).astype(np.int8),
        "f32": rng.integers(0, 2**32, n).astype(np.float64),
        "s64": rng.integers(-2**63, 2**63 - 1, n, endpoint=True),
        "age": rng.integers(-100, 100, n).astype(np.int16),
        "score": rng.standard_normal(n).astype(np.float32),
    }


def test_written_values_read_back_by_confluent_kafkas_deserializer_and_by_kfeed(registry):
    n = 500
    cols = write_columns(n)
    values = kfeed.Protobuf(message=Click, registry=registry).encoder(SCHEMA, "clicks").encode(
        cols)
    reader = ProtobufDeserializer(Click, CONF)
    msgs = [reader(v, CTX) for v in values]
    assert [m.id for m in msgs] == list(range(n))
    assert registry.get_latest_version("clicks-value").schema_id == int.from_bytes(
        values[0][1:5], "big")
    want = expected(msgs)  # what the deserializer read, as kfeed columns
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(want[f.name], cols[f.name], err_msg=f.name)
    out, bad = decode_all(kfeed.Protobuf(message=Click, registry=registry).decoder(SCHEMA),
                          SCHEMA, values)
    assert not bad
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(out[f.name], cols[f.name], err_msg=f.name)
    # Without a registry: the bare messages.
    plain = kfeed.Protobuf(message=Click.DESCRIPTOR).encoder(SCHEMA, "clicks").encode(cols)
    assert [Click.FromString(v).id for v in plain] == list(range(n))
    with pytest.raises(kfeed.ConfigError, match="0.5 is not a whole number, and f32 is an"):
        kfeed.Protobuf(message=Click).encoder(SCHEMA, "clicks").encode(
            {**cols, "f32": np.full(n, 0.5)})
    # A value the message field cannot hold was protobuf's bare "ValueError: Value
    # out of range", naming no field.
    with pytest.raises(kfeed.ConfigError, match=r"^field 'f32', row 3: -1 does not fit f32, of "
                                                r"type fixed32 \(Value out of range: -1\)$"):
        kfeed.Protobuf(message=Click).encoder(SCHEMA, "clicks").encode(
            {**cols, "f32": np.where(np.arange(n) == 3, -1.0, 1.0)})
    with pytest.raises(kfeed.ConfigError, match="has no field 'nope'"):
        kfeed.Protobuf(message=Click).encoder(kfeed.Schema({"nope": ("int32", ())}), "clicks")


@pytest.mark.integration
def test_the_producer_writes_protobuf_the_loader_reads(bootstrap, make_topic, registry):
    topic = make_topic(partitions=2)
    n = 1000
    cols = write_columns(n)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA,
                        format=kfeed.Protobuf(message=Click, registry=registry)) as p:
        p.send(cols, keys=cols["id"])
    out = read_columns(bootstrap, topic, SCHEMA, kfeed.Protobuf(message=Click, registry=registry))
    order = np.argsort(out["id"])
    for f in SCHEMA.fields:
        np.testing.assert_array_equal(out[f.name][order], cols[f.name], err_msg=f.name)


SAMPLE_PROTO = '''
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto
fdp = descriptor_pb2.FileDescriptorProto(name="sample.proto", package="demo", syntax="proto3")
m = fdp.message_type.add(name="Sample")
m.field.add(name="features", number=1, type=F.TYPE_FLOAT, label=F.LABEL_REPEATED)
m.field.add(name="label", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
m.field.add(name="id", number=3, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
pool = descriptor_pool.DescriptorPool()
pool.Add(fdp)
Sample = message_factory.GetMessageClass(pool.FindMessageTypeByName("demo.Sample"))
'''


@pytest.mark.integration
def test_kfeed_produce_format_protobuf_writes_the_message_class(bootstrap, make_topic, tmp_path):
    import os
    import subprocess
    import sys

    from confluent_kafka import Consumer

    from kfeed.synthetic import synthetic_columns

    (tmp_path / "sample_pb2.py").write_text(SAMPLE_PROTO)
    topic = make_topic(partitions=1)
    env = {**os.environ, "KFEED_BOOTSTRAP": bootstrap, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "kfeed", "produce", "--topic", topic,
                           "--synthetic", "30", "--format", "protobuf", "--proto",
                           "sample_pb2:Sample"], env=env, check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import importlib.util

    spec = importlib.util.spec_from_file_location("sample_pb2", tmp_path / "sample_pb2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the same class, in this process
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "auto.offset.reset": "earliest", "enable.partition.eof": True})
    c.subscribe([topic])
    got = []
    while (m := c.poll(10)) is not None and not m.error():
        got.append(module.Sample.FromString(m.value()))
    c.close()
    want = synthetic_columns(range(30))
    assert sorted(s.id for s in got) == list(range(30))
    for s in got:
        np.testing.assert_array_equal(np.float32(s.features), want["features"][s.id])
        assert s.label == want["label"][s.id]



def test_a_ten_byte_varint_reads_as_protobuf_reads_it():
    # The 10th byte's bits past bit 63 made the record bad ("malformed
    # varint"); protobuf ignores them.
    from records import message_class

    cls = message_class("v10", "M", [("a", "int64", False), ("b", "sint64", False)])
    values = [bytes([0x08]) + b"\xff" * 9 + b"\x7f",
              bytes([0x10]) + b"\xca\x92\x88\x80\xd5\xb7\xa5\x88\xc4\x44",
              bytes([0x08]) + b"\xff" * 10 + b"\x01"]  # 11 bytes: malformed for both
    with pytest.raises(Exception):
        cls.FromString(values[2])
    want = [cls.FromString(v) for v in values[:2]]
    schema = kfeed.Schema({"a": ("int64", ()), "b": ("int64", ())})
    cols, bad = decode_all(kfeed.Protobuf(message=cls).decoder(schema), schema, values)
    assert bad == [(2, "malformed varint at a")], bad
    assert cols["a"].tolist() == [w.a for w in want] and cols["a"][0] == -1
    assert cols["b"].tolist() == [w.b for w in want]


def test_messages_nested_as_deep_as_protobuf_reads_them_are_read():
    # The record itself counted as a level: one nested 100 deep (which
    # protobuf reads; 101 it refuses) was "nested deeper than 100".
    fdp = descriptor_pb2.FileDescriptorProto(name="deep.proto", package="deep", syntax="proto3")
    node = fdp.message_type.add(name="Node")
    node.field.add(name="x", number=1, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
    node.field.add(name="next", number=2, type=F.TYPE_MESSAGE, type_name=".deep.Node",
                   label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("deep.Node"))

    def nested(depth: int) -> bytes:
        inner = b"\x08\x07"  # x = 7
        for _ in range(depth):
            inner = b"\x12" + _varint(len(inner)) + inner
        return inner

    values = [nested(100), nested(101)]
    assert cls.FromString(values[0])
    with pytest.raises(Exception):
        cls.FromString(values[1])
    for depth, value in zip((100, 101), values, strict=True):
        schema = kfeed.Schema({"x": ("int32", (), {"source": ".".join(["next"] * depth
                                                                       + ["x"])})})
        cols, bad = decode_all(kfeed.Protobuf(message=cls).decoder(schema), schema, [value])
        assert (cols["x"].tolist(), bad) == (([7], []) if depth == 100 else
                                             ([], [(0, "nested deeper than 100")]))


def _varint(n: int) -> bytes:
    """``n`` as a protobuf varint (a negative one as its 64-bit two's complement)."""
    n &= (1 << 64) - 1
    out = b""
    while True:
        out += bytes([n & 0x7F | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def test_fields_in_any_order_and_repeated_read_as_protobuf_reads_them():
    # The decoder tries the entry after the last one read, then that one
    # again, before searching the message's entries (writers send fields in
    # their numbers' order, an unpacked repeated field's elements in a row):
    # fields out of order, repeated (the last wins), unknown between known
    # ones, and the packed and unpacked elements of one field interleaved
    # must still read as protobuf parses them.
    from records import message_class

    cls = message_class("anyorder", "M", [("a", "int64", False), ("b", "double", False),
                                          ("c", "sint32", False), ("v", "float", True)])

    def field(number: int, wire: int, payload: bytes) -> bytes:
        return bytes([number << 3 | wire]) + payload

    def floats(*xs: float) -> bytes:
        body = np.array(xs, np.float32).tobytes()
        return bytes([len(body)]) + body

    one = np.float32(1.5).tobytes()
    a7, a9 = field(1, 0, b"\x07"), field(1, 0, b"\x09")
    b = field(2, 1, np.float64(-2.25).tobytes())
    c = field(3, 0, b"\x05")  # zig-zag -3
    unknown = field(9, 2, b"\x03xyz")
    values = [
        a7 + b + c + field(4, 2, floats(1, 2)),                      # in order
        field(4, 2, floats(1, 2)) + c + b + a7,                      # reversed
        a7 + b + a9 + c + a7 + field(4, 2, floats(3, 4)),            # a thrice: the last wins
        c + unknown + field(4, 5, one) + a9 + field(4, 2, floats(2)) + unknown + b,
        a7 + b + c + field(4, 5, one) + field(4, 5, one),            # unpacked, in a row
        field(4, 5, one) + field(4, 5, one) + a9 + a7 + b + b + c,   # and again after it
    ]
    want = [cls.FromString(v) for v in values]
    schema = kfeed.Schema({"a": ("int64", ()), "b": ("float64", ()), "c": ("int32", ()),
                           "v": ("float32", (2,))})
    cols, bad = decode_all(kfeed.Protobuf(message=cls).decoder(schema), schema, values)
    assert bad == []
    assert cols["a"].tolist() == [w.a for w in want] == [7, 7, 7, 9, 7, 7]
    assert cols["b"].tolist() == [w.b for w in want]
    assert cols["c"].tolist() == [w.c for w in want] == [-3] * 6
    assert cols["v"].tolist() == [list(w.v) for w in want]


SCALARS = [("i64", "int64", "int64"), ("i32", "int32", "int32"), ("w", "int32", "int64"),
           ("b", "bool", "bool"), ("d", "double", "float64"), ("dn", "double", "float32"),
           ("f", "float", "float32"), ("fw", "float", "float64")]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_scalars_stored_as_read_equal_protobuf_s_values_cast_as_numpy_casts(data):
    # Scalars of the kinds most events hold go into their field's element as
    # they are read (the decoder's direct store): every value of each kind,
    # negatives' ten-byte varints, a bool's varint past 1, doubles past
    # float32's range, NaN and infinities, and the values cut or changed on
    # the wire, read as protobuf parses them, cast as numpy casts them, and
    # bad where protobuf refuses them.
    from records import message_class

    cls = message_class("direct", "M", [(name, kind, False) for name, kind, _ in SCALARS])
    schema = kfeed.Schema({name: (dtype, ()) for name, _, dtype in SCALARS})
    floats = st.floats(allow_nan=True, allow_infinity=True)
    draws = {"int64": st.integers(-2**63, 2**63 - 1), "int32": st.integers(-2**31, 2**31 - 1),
             "bool": st.booleans(), "double": floats, "float": st.floats(width=32)}
    values = []
    for _ in range(data.draw(st.integers(1, 6))):
        present = {name: data.draw(draws[kind]) for name, kind, _ in SCALARS
                   if data.draw(st.booleans())}
        raw = bytearray(cls(**present).SerializeToString())
        if data.draw(st.booleans()):  # a bool sent as 2, as a writer may
            raw += b"\x20\x02"
        values.append(bytes(damage(data, raw, [0x00, 0x7F, 0x80, 0xFF, 0x09, 0x0D], [b"\x80"])))
    cols, bad = decode_all(kfeed.Protobuf(message=cls).decoder(schema), schema, values)
    good = []
    for i, value in enumerate(values):
        try:
            parsed = cls.FromString(value)
        except DecodeError:
            parsed = None
        assert (parsed is None) == (i in {j for j, _ in bad}), (i, value, bad)
        if parsed is not None:
            good.append(parsed)
    for name, _, dtype in SCALARS:
        with np.errstate(over="ignore"):
            want = np.array([getattr(m, name) for m in good]).astype(dtype)
        np.testing.assert_array_equal(cols[name], want, err_msg=name)


def test_a_signaling_nan_and_a_bad_tag_read_as_before_the_direct_stores():
    # A float sent as a signaling NaN reads quiet, as protobuf's double and
    # numpy's cast give it (the direct store kept its bits); a malformed tag
    # after a stored field names no field (it took the value stored before
    # for a field number).
    from records import message_class

    cls = message_class("snan", "M", [("f", "float", False), ("w", "float", False),
                                      ("a", "int64", False), ("u", "uint32", False)])
    schema = kfeed.Schema({"f": ("float32", ()), "w": ("float64", ()), "a": ("int64", ()),
                           "u": ("int64", ())})
    snan = bytes.fromhex("0100807f")  # 0x7f800001
    values = [b"\x0d" + snan + b"\x15" + snan,
              b"\x18\x05" + b"\x80" * 11, b"\x20\x05" + b"\x80" * 11, b"\x20\x05\x80"]
    cols, bad = decode_all(kfeed.Protobuf(message=cls).decoder(schema), schema, values)
    parsed = cls.FromString(values[0])
    assert cols["f"][:1].view(np.uint32).tolist() == \
        np.array([parsed.f], np.float32).view(np.uint32).tolist() == [0x7FC00001]
    assert cols["w"][:1].view(np.uint64).tolist() == \
        np.array([parsed.w], np.float64).view(np.uint64).tolist()
    assert bad == [(1, "malformed varint"), (2, "malformed varint"), (3, "truncated")], bad
