"""JSON events, one object per message, decoded straight into the batch.

Where it sits: in the build stage, like ``kfeed.avro``; and at the producer,
whose ``send`` writes columns as JSON objects with ``format=kfeed.Json()``. The kfeed ``Schema``
is compiled once into a ``_codec.JsonPlan``: the keys, level by level, that
lead to its fields. ``JsonDecoder.decode_into`` parses a fetch of values in
one Cython pass into the pool slot (no GIL, no Python object per record):
values the schema wants are parsed into the field's dtype where they lie,
the rest skipped. With a variable-length field, ``decode_documents`` reads
it into one growing buffer and the other fields into rows, in the same pass.

Fields map to keys by name, or by a dotted ``source`` through nested objects.
Values convert as numpy's ``same_kind`` casting allows, from what
``json.loads`` would give: an integer into any integer field it fits or a
float field, a number with a fraction or exponent into float fields only,
``true``/``false`` into any field. Arrays fill a fixed shape exactly (nested
arrays for more dimensions). A missing key or ``null`` takes the field's
``default`` or makes the record bad; so does a value of another kind. A value
that begins with a zero byte carries the Confluent JSON Schema framing (zero
byte, schema id), which is skipped: the JSON Schema itself is not consulted.
Every string, read or skipped, key or value, is checked as ``json.loads``
checks it (no raw control character, only JSON's escapes, valid UTF-8): a
record ``json.loads`` refuses is a bad record, with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from kfeed import _codec
from kfeed.errors import ConfigError
from kfeed.formats import (
    Decoder,
    Encoder,
    PlanDecoder,
    RecordFormat,
    codes,
    defaults,
    fixed_layout,
    plan_layout,
)
from kfeed.schema import Schema

__all__ = ["Json", "JsonDecoder"]


class Json(RecordFormat):
    """Message values that are JSON objects: ``Loader(..., format=kfeed.Json())`` (or "json").

    A variable-length field (an array of numbers, or a string as bytes) is
    read beside the others in the same pass: a jagged field, or token ids
    for ``pack=``.
    """

    value = "json"
    documents = True

    def decoder(self, schema: Schema) -> Decoder:
        return JsonDecoder(schema)

    def encoder(self, schema: Schema, topic: str) -> Encoder:
        self.decoder(schema)  # its fields checked now: numeric, fixed shapes, paths
        return _JsonEncoder(self, schema)

    def encode(self, schema: Schema, columns: Any) -> list[bytes]:
        """N samples as N JSON objects, fields nested by their dotted ``source``.

        Floats are written as Python's ``json`` writes doubles (NaN and
        Infinity included), so a loader reads back the very same values.
        """
        fixed_layout(schema, "JSON")
        _paths(schema)  # a path that is both a value and an object is refused here
        _views, n, owners = schema._fixed_columns(columns, None)
        lists = [owner.reshape(n, *f.shape).tolist()
                 for f, owner in zip(schema.fields, owners, strict=True)]
        paths = [f.path for f in schema.fields]
        out = []
        for i in range(n):
            record: dict[str, Any] = {}
            for path, values in zip(paths, lists, strict=True):
                node = record
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = values[i]
            out.append(json.dumps(record, separators=(",", ":")).encode())
        return out

    def __repr__(self) -> str:
        return "Json()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Json)

    def __hash__(self) -> int:
        return hash(Json)


class _JsonEncoder(Encoder):
    def __init__(self, fmt: Json, schema: Schema) -> None:
        self.fmt = fmt
        self.schema = schema

    def encode(self, columns: Any) -> list[bytes]:
        return self.fmt.encode(self.schema, columns)


class JsonDecoder(PlanDecoder):
    """One kfeed Schema's reader of JSON objects: rows, or documents beside rows.

    One plan for every value (the JSON Schema of a framed value is not
    consulted), so the codec never asks for another.
    """

    what = "JSON"

    def __init__(self, schema: Schema) -> None:
        super().__init__(schema, False, compile_plan(schema), _decode, _documents)


def _decode(layout: Any, plan: Any, values: Sequence[Any], out: Any, row: int,
            framed: bool) -> tuple[int, int, list[tuple[int, str]], None]:
    return (*_codec.json_decode(layout, plan, values, out, row), None)


def _documents(layout: Any, plan: Any, values: Sequence[Any], framed: bool, code: int,
               out: Any) -> tuple[bytes, Any, Any, list[tuple[int, str]], None]:
    return (*_codec.json_documents(layout, plan, values, out), None)


def _paths(schema: Schema) -> None:
    """Refuse fields whose paths make one key both a value and an object."""
    values = {f.path: f for f in schema.fields}
    for f in schema.fields:
        for k in range(1, len(f.path)):
            if f.path[:k] in values:
                other = values[f.path[:k]]
                raise ConfigError(f"fields {other.name!r} and {f.name!r}: "
                                  f"{'.'.join(f.path[:k])} cannot be both a value and an object")


def compile_plan(schema: Schema) -> Any:
    """The ``_codec.JsonPlan`` of ``schema``'s fields, as paths of keys."""
    _paths(schema)
    layout = plan_layout(schema, "JSON")
    field_codes = codes(schema)
    var = -1 if schema.varlen is None else schema.fields.index(schema.varlen)
    nodes: list[list[int]] = []
    keys: list[tuple[int, int, int]] = []
    notes: list[str] = []
    names = bytearray()

    def level(targets: dict[tuple[str, ...], int], path: str) -> int:
        index = len(nodes)
        nodes.append([0, -1, 0, 0, 0])
        notes.append(path or "the object")
        by_first: dict[str, dict[tuple[str, ...], int]] = {}
        for rest, f in targets.items():
            by_first.setdefault(rest[0], {})[rest[1:]] = f
        children = []
        for key, sub in by_first.items():
            where = f"{path}.{key}" if path else key
            if () in sub:  # a value (_paths made sure nothing lies below it)
                f = sub[()]
                nodes.append([1, f, field_codes[f], 0, 0])
                notes.append(where)
                child = len(nodes) - 1
            else:
                child = level(sub, where)
            encoded = key.encode()
            children.append((child, len(names), len(encoded)))
            names.extend(encoded)
        nodes[index][3] = len(keys)
        nodes[index][4] = len(children)
        keys.extend(children)
        return index

    level({f.path: i for i, f in enumerate(schema.fields)}, "")
    return _codec.JsonPlan(layout, np.array(nodes, np.int64).reshape(-1, 5),
                           np.array(keys, np.int64).reshape(-1, 3), bytes(names), field_codes,
                           [() if f.variable else f.shape for f in schema.fields],
                           defaults(schema), notes, var)
