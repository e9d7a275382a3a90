"""Formats other services write (Avro, Protobuf, JSON): what they share.

Where it sits: the build stage. ``Loader(format=...)`` takes a
``RecordFormat``; ``SlotBuilder`` asks it for a decoder of the loader's
``Schema`` and hands that decoder a fetch of message values at a time. The
decoder writes one row per message straight into the pool slot (Cython, no
GIL, no Python object per record), rejecting a message whole with a reason.
``kfeed.avro``, ``kfeed.protobuf`` and ``kfeed.jsonformat`` are the formats.
``resolve`` turns what ``format=`` was given into the format object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kfeed import _codec
from kfeed.errors import ConfigError
from kfeed.schema import DecodeResult, Documents, Format, Schema, Target

__all__ = ["Decoder", "Encoder", "RecordFormat", "resolve"]

_NUMERIC = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float32", "float64")


class Decoder:
    """Decodes message values of one format into one kfeed Schema's rows."""

    def decode_into(self, values: Sequence[Any], out: Target, row: int) -> DecodeResult:
        raise NotImplementedError

    def decode_documents(self, values: Sequence[Any]) -> Documents:
        """The schema's variable-length field of each value (for ``pack=``)."""
        raise NotImplementedError


class RecordFormat:
    """A format of one record per message; ``value`` names it (in ``state_dict()``)."""

    value = ""
    # Whether its decoder reads a variable-length token field (``pack=``).
    documents = False

    def decoder(self, schema: Schema) -> Decoder:
        raise NotImplementedError

    def encoder(self, schema: Schema, topic: str) -> Encoder:
        """The producer's writer of ``schema`` rows to ``topic``, in this format."""
        raise ConfigError(f"the producer writes block, raw, json, avro or protobuf, not {self!r}")


class Encoder:
    """Writes rows of one kfeed Schema as message values of one format."""

    def encode(self, columns: Any) -> list[bytes]:
        raise NotImplementedError


def resolve(value: str | Format | RecordFormat) -> Format | RecordFormat:
    """``format=`` as the loader and the producer use it: "json" is ``kfeed.Json()``."""
    if isinstance(value, RecordFormat):
        return value
    if value == "json":
        from kfeed.jsonformat import Json  # it builds on this module

        return Json()
    return Format.parse(value)


def registry_client(registry: Any, who: str) -> Any:
    """A Schema Registry client from its config dict, or the client given."""
    if not isinstance(registry, Mapping):
        return registry
    try:
        from confluent_kafka.schema_registry import SchemaRegistryClient
    except ImportError as e:
        raise ConfigError(f"{who}(registry=...) needs confluent-kafka's schema registry "
                          "client: pip install 'confluent-kafka[schemaregistry]'") from e
    # new_client: a "mock://" url gives confluent-kafka's in-memory registry.
    make = getattr(SchemaRegistryClient, "new_client", SchemaRegistryClient)
    return make(dict(registry))


def fixed_layout(schema: Schema, what: str) -> Any:
    """The schema's codec layout, once its fields are all numeric and of fixed shape."""
    layout = schema._fixed_only(f"{what} decoding")
    for f in schema.fields:
        if f.dtype not in _NUMERIC:
            raise ConfigError(f"field {f.name!r}: {what} values decode into bool, integer, "
                              f"float32 or float64 fields, not {f.dtype}")
    return layout


def document_layout(schema: Schema, what: str) -> Any:
    """The codec layout of a schema of one token field, read as documents (``pack=``).

    The field's row is one element as far as the layout knows; the decoders
    grow each document as they read it.
    """
    f = schema.varlen
    assert f is not None
    if len(schema.fields) != 1:
        others = ", ".join(repr(x.name) for x in schema.fields if x is not f)
        raise ConfigError(f"a {what} topic packed into token rows gives one field, "
                          f"{f.name!r}: leave {others} out of the schema")
    return _codec.Layout([f.storage.itemsize], schema.fingerprint, schema.names)


def codes(schema: Schema) -> list[int]:
    """Each field's element code, as the Cython decoders store elements."""
    return [_codec.AVRO_CODES[f.dtype] for f in schema.fields]


def defaults(schema: Schema) -> list[bytes | None]:
    """One row of each field's default, as bytes; None where it has none.

    A variable-length field's default is a whole document, of any length.
    """
    return [None if f.default is None
            else np.asarray(f.default, f.storage).tobytes() if f.variable
            else np.full(f.shape, f.default, f.storage).tobytes()
            for f in schema.fields]
