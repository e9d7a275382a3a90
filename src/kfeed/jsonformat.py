"""JSON events, one object per message, decoded straight into the batch.

Where it sits: in the build stage, like ``kfeed.avro``; and at the producer,
whose ``send`` writes columns as JSON objects with ``format=kfeed.Json()``. The kfeed ``Schema``
is compiled once into a ``_codec.JsonPlan``: the keys, level by level, that
lead to its fields. ``JsonDecoder.decode_into`` parses a fetch of values in
one Cython pass into the pool slot (no GIL, no Python object per record):
values the schema wants are parsed into the field's dtype where they lie,
the rest skipped.

Fields map to keys by name, or by a dotted ``source`` through nested objects.
Values convert as numpy's ``same_kind`` casting allows, from what
``json.loads`` would give: an integer into any integer field it fits or a
float field, a number with a fraction or exponent into float fields only,
``true``/``false`` into any field. Arrays fill a fixed shape exactly (nested
arrays for more dimensions). A missing key or ``null`` takes the field's
``default`` or makes the record bad; so does a value of another kind. A value
that begins with a zero byte carries the Confluent JSON Schema framing (zero
byte, schema id), which is skipped: the JSON Schema itself is not consulted.
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
    JaggedDecoder,
    RecordFormat,
    codes,
    defaults,
    fixed_layout,
    one_field,
)
from kfeed.schema import DecodeResult, Documents, Schema, Target

__all__ = ["Json", "JsonDecoder"]


class Json(RecordFormat):
    """Message values that are JSON objects: ``Loader(..., format=kfeed.Json())`` (or "json").

    With ``pack=``, the schema's one field is variable-length: an array of
    numbers (token ids) in each object, at the field's path.
    """

    value = "json"
    documents = True

    def decoder(self, schema: Schema) -> Decoder:
        if JaggedDecoder.wanted(schema):
            return JaggedDecoder(self, schema)
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


class JsonDecoder(Decoder):
    """One kfeed Schema's reader of JSON objects: rows, or (a token field) documents."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.varlen = schema.varlen
        if self.varlen is not None:
            one_field(schema, "JSON")
            self.path = [key.encode() for key in self.varlen.path]
            self.code = codes(schema)[0]
            self.default = defaults(schema)[0]
            return
        self.layout = fixed_layout(schema, "JSON")
        self.plan = compile_plan(schema)

    def decode_into(self, values: Sequence[Any], out: Target, row: int) -> DecodeResult:
        """Decode values into ``out`` from ``row`` on: one row per good value."""
        if self.varlen is not None:
            raise ConfigError(f"field {self.varlen.name!r} is variable-length: read it with "
                              f"pack=kfeed.Pack(...)")
        if not isinstance(values, (list, tuple)):
            values = list(values)
        rows, consumed, bad = _codec.json_decode(self.layout, self.plan, values, out.out, row)
        return DecodeResult(rows, consumed, bad)

    def decode_documents(self, values: Sequence[Any]) -> Documents:
        """Each object's array at the token field's path, flat; a bad object gives none."""
        if self.varlen is None:
            raise ConfigError("decode_documents needs a schema with a variable-length field")
        if not isinstance(values, (list, tuple)):
            values = list(values)
        tokens, lengths, counts, bad = _codec.json_documents(values, self.path, self.code,
                                                             self.default)
        return Documents(np.frombuffer(tokens, self.varlen.storage), lengths, counts, bad, {})


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
    field_codes = codes(schema)
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
    return _codec.JsonPlan(fixed_layout(schema, "JSON"), np.array(nodes, np.int64).reshape(-1, 5),
                           np.array(keys, np.int64).reshape(-1, 3), bytes(names), field_codes,
                           [f.shape for f in schema.fields], defaults(schema), notes)
