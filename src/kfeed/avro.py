"""Avro records, as other services write them, decoded straight into the batch.

Where it sits: in the build stage, in place of kfeed's own codec. The loader
hands a fetch of message values to ``AvroDecoder.decode_into``, which writes
one row per message into the pool slot through ``_codec.avro_decode`` (Cython,
no GIL, no Python object per record).

Each writer schema is compiled once, against the kfeed ``Schema``, into a
plan (``_codec.AvroPlan``): one node per writer type, read into a field or
skipped. Fields map to record fields by name, or by their dotted ``source``;
record fields the schema does not name are skipped. Values convert as
numpy's ``same_kind`` casting allows (int into int64 or float32, double into
float32); an integer that does not fit, a value of another kind, an array of
the wrong length, or a null without a ``default`` makes the record bad, with
a reason naming where.

With a ``registry``, values carry the Confluent framing (a zero byte, the
4-byte big-endian schema id, the Avro binary), and each id's writer schema is
fetched once and compiled; so a topic whose schema evolves just works.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kfeed import _codec
from kfeed.errors import ConfigError, ProduceError
from kfeed.formats import (
    Absent,
    Encoder,
    PlanDecoder,
    RecordFormat,
    checked_registry,
    codes,
    defaults,
    fixed_layout,
    plan_layout,
    registry_client,
    registry_where,
)
from kfeed.schema import Field, Schema

__all__ = ["Avro", "AvroDecoder", "AvroEncoder", "writer_schema"]

log = logging.getLogger("kfeed.avro")

_PRIMITIVES = ("null", "boolean", "int", "long", "float", "double", "bytes", "string")
# The unit of each timestamp logical type (a long), and what one of it is in ns.
_UNITS = {"timestamp-millis": "ms", "timestamp-micros": "us", "timestamp-nanos": "ns",
          "local-timestamp-millis": "ms", "local-timestamp-micros": "us",
          "local-timestamp-nanos": "ns"}
_NS = {"ms": 1_000_000, "us": 1_000, "ns": 1}
_FLOATS = ("float32", "float64")


class Avro(RecordFormat):
    """Message values in Avro: ``Loader(..., format=kfeed.Avro(...))``.

    ``registry``: where writer schemas come from, for values in the
    Confluent wire format. The dict that confluent-kafka's
    ``SchemaRegistryClient`` takes (``{"url": ...}``, basic auth, TLS), or a
    client already made (anything with ``get_schema(schema_id)``).

    ``schema``: the writer schema (a dict, its JSON text, or the path of an
    ``.avsc`` file), for topics whose values are plain Avro binary, without
    the framing.

    ``enums``: per enum type (its full name, or its name), the symbols in
    the order whose index a field reads: ``{"shop.Color": ["RED", "GREEN",
    "BLUE"]}``. A symbol is then read by name, whatever its index in a
    writer schema, and a symbol not listed makes the record bad. An enum
    not named reads as the writer's index, which a writer schema that adds
    a symbol before others changes (the loader warns when it does).

    ``timestamps``: ``"ms"``, ``"us"`` or ``"ns"``: every timestamp (a long
    of logical type ``timestamp-millis``, ``-micros`` or ``-nanos``, local
    ones too) reads in that unit, whatever unit its writer schema gives;
    a finer unit into a coarser one rounds down. None (the default): as
    written, which a writer schema that changes a field's unit changes
    (the loader warns when one does).
    """

    value = "avro"
    documents = True

    def __init__(self, schema: Mapping[str, Any] | str | Path | None = None,
                 registry: Mapping[str, Any] | Any | None = None,
                 enums: Mapping[str, Sequence[str]] | None = None,
                 timestamps: str | None = None) -> None:
        if (schema is None) == (registry is None):
            raise ConfigError("kfeed.Avro needs schema= (values without framing) or "
                              "registry= (values in the Confluent wire format), not both")
        self.schema = _load_schema(schema) if schema is not None else None
        self.registry = checked_registry(registry)
        self.enums = _checked_enums(enums)
        if timestamps is not None and (not isinstance(timestamps, str) or timestamps not in _NS):
            raise ConfigError(f"timestamps must be 'ms', 'us' or 'ns' (the unit every "
                              f"timestamp reads in), or None (as written), got {timestamps!r}")
        self.timestamps = timestamps
        self._client: Any = None

    @property
    def framed(self) -> bool:
        return self.registry is not None

    def client(self) -> Any:
        """The decoders' registry client, made once from the config dict."""
        if self._client is None:
            self._client = registry_client(self.registry, "kfeed.Avro", reading=True)
        return self._client

    def decoder(self, schema: Schema) -> AvroDecoder:
        return AvroDecoder(self, schema)

    def encoder(self, schema: Schema, topic: str) -> AvroEncoder:
        """The producer's writer of ``schema`` rows to ``topic`` (see ``AvroEncoder``)."""
        return AvroEncoder(self, schema, topic)

    def __repr__(self) -> str:
        return "Avro(registry=...)" if self.framed else "Avro(schema=...)"

    def __reduce__(self) -> tuple[Any, ...]:
        # A client does not cross to DataLoader workers; its config does.
        if self.framed and not isinstance(self.registry, Mapping):
            raise ConfigError("a kfeed.Avro made with a registry client cannot be sent to "
                              "DataLoader workers; give registry= its config dict instead")
        return (Avro, (self.schema, self.registry, self.enums or None, self.timestamps))


class AvroDecoder(PlanDecoder):
    """One kfeed Schema's reader of Avro values: a plan per writer schema, made once."""

    what = "Avro"

    def __init__(self, fmt: Avro, schema: Schema) -> None:
        self.fmt = fmt
        single = compile_plan(fmt.schema, schema, enums=fmt.enums, timestamps=fmt.timestamps) \
            if fmt.schema is not None else None
        super().__init__(schema, fmt.framed, single, _codec.avro_decode, _codec.avro_documents)
        # Per enum read by its writer's index: each symbol's index, and the id
        # of the first schema that numbered it so (see _check_enums).
        self.enum_symbols: dict[str, dict[str, tuple[int, int]]] = {}
        # Per field read from a long: its first writer's timestamp logical type
        # ("long": none), and that schema's id (see _check_units).
        self.units: dict[str, tuple[int, str]] = {}

    def plan_for(self, schema_id: int) -> Any:
        """The plan of a schema id, or the reason its records are bad."""
        registered = self.registered(schema_id)
        if registered is None:
            return Absent(f"schema id {schema_id} is not in the registry")
        kind = getattr(registered, "schema_type", "AVRO") or "AVRO"
        if kind != "AVRO":
            return f"schema id {schema_id} is {kind}, not Avro"
        try:
            named = _referenced(self.fmt.client(), registered, self.ask)
            enums: dict[str, list[str]] = {}
            unread: list[str] = []
            units: dict[str, str] = {}
            plan = compile_plan(_load_schema(registered.schema_str), self.schema, named,
                                self.fmt.enums, enums, unread, self.fmt.timestamps, units)
            self._check_enums(schema_id, enums)
            self._check_units(schema_id, units)
            self.say_unread(schema_id, unread)
            return plan
        except ConfigError as e:
            log.warning("schema id %d cannot be read: %s", schema_id, e)
            return f"schema id {schema_id}: {e}"


    def _check_enums(self, schema_id: int, enums: Mapping[str, list[str]]) -> None:
        """Warn where a writer schema gives a symbol another index than an earlier one
        (any earlier one: a symbol the first schema lacked is numbered by a later)."""
        for name, symbols in enums.items():
            known = self.enum_symbols.setdefault(name, {})
            moved = [(x, known[x][1]) for i, x in enumerate(symbols)
                     if x in known and known[x][0] != i]
            for i, x in enumerate(symbols):
                known.setdefault(x, (i, schema_id))
            if moved:
                ids = sorted({other for _x, other in moved})
                log.warning("schema id %d numbers the symbols of enum %s otherwise than "
                            "schema id %s (%s moved): the field reads each writer's index, "
                            "so the same symbol reads as two numbers; give kfeed.Avro(enums="
                            "{%r: [...]}) to read symbols by name", schema_id, name,
                            ", ".join(map(str, ids)), ", ".join(x for x, _other in moved), name)


    def _check_units(self, schema_id: int, units: Mapping[str, str]) -> None:
        """Warn where a writer schema gives a field's timestamps in another unit than an
        earlier one did and they are read as written, or gives or drops a unit."""
        for name, logical in units.items():
            first_id, first = self.units.setdefault(name, (schema_id, logical))
            if logical == first:
                continue
            if "long" in (logical, first):
                log.warning("schema id %d writes field %r as %s, schema id %d as %s: a long "
                            "without a timestamp logical type has no unit to read it in, so "
                            "the field may mix units", schema_id, name, _logical(logical),
                            first_id, _logical(first))
            elif self.fmt.timestamps is None and _UNITS[logical] != _UNITS[first]:
                log.warning("schema id %d writes field %r as %s, schema id %d as %s: read as "
                            "written, the field mixes units; give kfeed.Avro(timestamps='us') "
                            "(or 'ms', 'ns') to read every timestamp in one unit",
                            schema_id, name, logical, first_id, first)


def _logical(logical: str) -> str:
    return "a long without a logical type" if logical == "long" else logical


def _checked_enums(enums: Any) -> dict[str, list[str]]:
    """``enums=`` of ``Avro``: enum name -> its symbols, each a distinct str."""
    if enums is None:
        return {}
    if not isinstance(enums, Mapping):
        raise ConfigError(f"enums must map enum names to their symbols, e.g. "
                          f"{{'shop.Color': ['RED', 'GREEN']}}, got {enums!r}")
    out = {}
    for name, symbols in enums.items():
        if not isinstance(name, str) or isinstance(symbols, str) or \
                not isinstance(symbols, Sequence) or \
                not all(isinstance(x, str) for x in symbols) or len(set(symbols)) != len(symbols):
            raise ConfigError(f"enums[{name!r}] must be a list of distinct symbol names, "
                              f"got {symbols!r}")
        out[name] = list(symbols)
    return out


def _referenced(client: Any, registered: Any, ask: Callable[..., Any]) -> list[Any]:
    """The schemas a registered one refers to (Confluent schema references: named
    types registered under subjects of their own), what they refer to first."""
    out: list[Any] = []
    seen: set[tuple[str, int]] = set()

    def add(schema: Any) -> None:
        for ref in getattr(schema, "references", None) or []:
            key = (ref.subject, ref.version)
            if key in seen:
                continue
            seen.add(key)
            got = ask(lambda ref=ref: client.get_version(ref.subject, ref.version),
                      f"{ref.name} ({ref.subject} version {ref.version})")
            if got is None:
                raise ConfigError(f"it refers to {ref.name}, which the registry does not have "
                                  f"({ref.subject} version {ref.version})")
            add(got.schema)
            out.append(_load_schema(got.schema.schema_str))

    add(registered)
    return out


# -- writer schemas ----------------------------------------------------------------


class AvroEncoder(Encoder):
    """Writes rows of a kfeed Schema as Avro values: ``encode(columns) -> [bytes]``.

    The writer schema is ``writer_schema(schema)``. With a registry it is
    registered under ``<topic>-value`` (Confluent's topic name strategy) when
    the encoder is made, and every value carries the Confluent framing with
    its id. Without one, ``Avro(schema=...)`` must be that very schema, and
    values are plain Avro binary.
    """

    def __init__(self, fmt: Avro, schema: Schema, topic: str) -> None:
        self.layout = fixed_layout(schema, "Avro")
        self.writer = writer_schema(schema)
        self.codes = codes(schema)
        self.shapes = [list(f.shape) for f in schema.fields]
        self.order = _write_order(schema, self.writer)
        self.schema = schema
        if fmt.framed:
            self.schema_id = _register(registry_client(fmt.registry, "kfeed.Avro"),
                                       f"{topic}-value", self.writer,
                                       registry_where(fmt.registry))
            self.prefix = b"\0" + self.schema_id.to_bytes(4, "big")
        else:
            # (Nested records' namespaces aside: writer_schema gave them none
            # before, and the values are the same bytes either way.)
            if _without_namespaces(fmt.schema) != _without_namespaces(self.writer):
                raise ConfigError(
                    "kfeed writes Avro with the schema it derives from the kfeed Schema: pass "
                    "format=kfeed.Avro(registry=...) to register it, or "
                    "kfeed.Avro(schema=kfeed.avro.writer_schema(schema)) for values without "
                    "the framing")
            self.schema_id = None
            self.prefix = b""

    def encode(self, columns: Any) -> list[bytes]:
        _views, n, owners = self.schema._fixed_columns(columns, None)
        return _codec.avro_encode(self.layout, owners, n, self.order, self.codes, self.shapes,
                                  self.prefix)


# dtype -> the Avro type it is written as (uint64 has none: Avro's long is signed).
_WRITE_TYPES = {"bool": "boolean", "int8": "int", "int16": "int", "int32": "int",
                "uint8": "int", "uint16": "int", "uint32": "long", "int64": "long",
                "float32": "float", "float64": "double"}
_AVRO_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def writer_schema(schema: Schema, name: str = "Record") -> dict[str, Any]:
    """The Avro schema kfeed writes ``schema``'s rows with.

    One field per kfeed field, at its dotted ``source`` (nested records named
    after their path, ``user`` or ``user_address``, each in a namespace of the
    path above it, so no two share a full name); a shape becomes nested
    arrays of the element type; bool is ``boolean``, int8 to uint16 and int32
    ``int``, uint32 and int64 ``long``, float32 ``float``, float64 ``double``.
    A field with a ``default`` has it as its Avro default. kfeed's Avro
    decoder reads it back value for value.
    """
    fixed_layout(schema, "Avro")
    root: dict[str, Any] = {"type": "record", "name": name, "namespace": "kfeed",
                            "fields": []}
    records = {(): root}
    for f in schema.fields:
        avro_type = _WRITE_TYPES.get(f.dtype)
        if avro_type is None:
            raise ConfigError(f"field {f.name!r}: Avro has no type for {f.dtype} (its long is "
                              f"signed): use int64")
        for part in f.path:
            if not _AVRO_NAME.fullmatch(part):
                raise ConfigError(f"field {f.name!r}: {part!r} is not an Avro name "
                                  f"([A-Za-z_][A-Za-z0-9_]*)")
        t: Any = avro_type
        for _ in f.shape:
            t = {"type": "array", "items": t}
        parent = _record_at(records, f.path[:-1], f.name)
        if any(x["name"] == f.path[-1] for x in parent["fields"]):
            raise ConfigError(f"field {f.name!r}: two fields are written at "
                              f"{'.'.join(f.path)}")
        field: dict[str, Any] = {"name": f.path[-1], "type": t}
        if f.default is not None:
            # So that a field added to a topic's schema keeps it compatible
            # (BACKWARD, the registries' default): a reader of the new
            # schema reads the default from records written before it.
            field["default"] = np.full(f.shape, f.default, f.storage).tolist()
        parent["fields"].append(field)
    return root


def _without_namespaces(schema: Any) -> Any:
    """``schema`` without the namespaces ``writer_schema`` gives its nested records."""
    if isinstance(schema, list):
        return [_without_namespaces(x) for x in schema]
    if not isinstance(schema, Mapping):
        return schema
    return {k: _without_namespaces(v) for k, v in schema.items()
            if not (k == "namespace" and str(v).startswith("kfeed.path"))}


def _record_at(records: dict[tuple[str, ...], Any], path: tuple[str, ...], field: str) -> Any:
    """The nested record at ``path``, made (with its parents) on first use."""
    if path in records:
        return records[path]
    parent = _record_at(records, path[:-1], field)
    if any(x["name"] == path[-1] for x in parent["fields"]):
        raise ConfigError(f"field {field!r}: {'.'.join(path)} is both a value and a record")
    # Named after its path, in a namespace of the path above it: "a.b" is
    # kfeed.path.a.a_b and "a_b" kfeed.path.a_b, never the same full name
    # (nor the root's, kfeed.Record); the simple names, which schema
    # resolution and the registries' compatibility compare, are as before.
    record = {"type": "record", "name": "_".join(path),
              "namespace": ".".join(("kfeed", "path", *path[:-1])), "fields": []}
    parent["fields"].append({"name": path[-1], "type": record})
    records[path] = record
    return record


def _write_order(schema: Schema, writer: dict[str, Any]) -> list[int]:
    """Field indices in the order ``writer`` (``writer_schema(schema)``) meets them, depth first."""
    index = {f.path: i for i, f in enumerate(schema.fields)}
    order: list[int] = []

    def walk(record: Any, path: tuple[str, ...]) -> None:
        for x in record["fields"]:
            here = (*path, x["name"])
            if isinstance(x["type"], dict) and x["type"]["type"] == "record":
                walk(x["type"], here)
            else:
                order.append(index[here])

    walk(writer, ())
    return order


def _register(client: Any, subject: str, writer: Any, where: str) -> int:
    """Register ``writer`` under ``subject``; its schema id."""
    try:
        from confluent_kafka.schema_registry import Schema as RegistrySchema
    except ImportError as e:
        raise ConfigError("writing Avro with a registry needs confluent-kafka's schema "
                          "registry client: pip install 'confluent-kafka[avro]'") from e
    try:
        return int(client.register_schema(subject, RegistrySchema(json.dumps(writer), "AVRO")))
    except Exception as e:  # the registry client raises errors of many kinds
        raise ProduceError(f"cannot register the Avro schema under {subject} with {where}: "
                           f"{e}") from e


def _load_schema(schema: Mapping[str, Any] | str | Path | list[Any]) -> Any:
    """A writer schema as parsed JSON, from a dict, JSON text or an .avsc path."""
    if isinstance(schema, Path) or (isinstance(schema, str) and schema.endswith(".avsc")):
        try:
            schema = Path(schema).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read the Avro schema {schema}: {e.strerror}") from None
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except json.JSONDecodeError:
            if schema in _PRIMITIVES:
                return schema
            raise ConfigError(f"the Avro schema is not JSON: {schema[:80]!r}") from None
    if isinstance(schema, (Mapping, list)):
        return schema
    raise ConfigError(f"an Avro schema is a dict, JSON text or an .avsc path, got "
                      f"{type(schema).__name__}")


class _Names:
    """Named types (records, enums, fixed) by full name, as the specification resolves them."""

    def __init__(self) -> None:
        self.types: dict[str, dict[str, Any]] = {}

    def resolve(self, s: Any, ns: str) -> Any:
        """The schema ``s`` with every named reference replaced by its definition."""
        if isinstance(s, str):
            if s in _PRIMITIVES:
                return {"type": s}
            full = s if "." in s else (f"{ns}.{s}" if ns else s)
            for name in (full, s):
                if name in self.types:
                    return self.types[name]
            raise ConfigError(f"unknown Avro type {s!r}")
        if isinstance(s, list):
            return {"type": "union", "branches": [self.resolve(b, ns) for b in s]}
        if not isinstance(s, Mapping) or "type" not in s:
            raise ConfigError(f"not an Avro schema: {str(s)[:80]}")
        t = s["type"]
        if isinstance(t, (Mapping, list)) or (isinstance(t, str) and t not in _PRIMITIVES
                                               and t not in ("record", "error", "enum",
                                                             "fixed", "array", "map")):
            return self.resolve(t, ns)
        if t in _PRIMITIVES:
            logical = s.get("logicalType")  # (other logical types, or not a str: ignored)
            return {"type": t, "logical": logical} if t == "long" and isinstance(
                logical, str) and logical in _UNITS else {"type": t}
        if t in ("record", "error", "enum", "fixed"):
            name = s.get("name")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"an Avro {t} needs a name")
            space = s.get("namespace", ns) if "." not in name else name.rsplit(".", 1)[0]
            full = name if "." in name else (f"{space}.{name}" if space else name)
            node: dict[str, Any] = {"type": "record" if t == "error" else t, "name": full}
            self.types[full] = node  # before the fields: a record may refer to itself
            if t == "enum":
                symbols = s.get("symbols")
                if not (isinstance(symbols, list)
                        and all(isinstance(x, str) and x for x in symbols)):
                    raise ConfigError(f"Avro enum {full!r} needs a list of symbols (names), "
                                      f"got {symbols!r}")
                node["symbols"] = list(symbols)
            elif t == "fixed":
                size = s.get("size")
                if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                    raise ConfigError(f"Avro fixed {full!r} needs a size (an int >= 0), "
                                      f"got {size!r}")
                node["size"] = size
            else:
                fields = s.get("fields")
                if not isinstance(fields, list):
                    raise ConfigError(f"Avro record {full!r} needs a list of fields")
                node["fields"] = []
                for i, f in enumerate(fields):
                    if not (isinstance(f, Mapping) and isinstance(f.get("name"), str)
                            and f["name"] and "type" in f):
                        raise ConfigError(f"Avro record {full!r}: field {i} must be an object "
                                          f"with a name and a type, got {str(f)[:80]}")
                    node["fields"].append((f["name"], self.resolve(f["type"], space or "")))
            return node
        if t == "array":
            return {"type": "array", "items": self.resolve(s.get("items"), ns)}
        return {"type": "map", "values": self.resolve(s.get("values"), ns)}


# -- plans -------------------------------------------------------------------------


class _Compiler:
    """Writer schema + kfeed Schema -> the node arrays of an ``AvroPlan``."""

    def __init__(self, schema: Schema, enums: Mapping[str, list[str]],
                 timestamps: str | None) -> None:
        self.schema = schema
        self.timestamps = timestamps  # Avro(timestamps=): the unit they read in
        self.units: dict[str, str] = {}  # a long's timestamp logical type ("long": none)
        self.codes = codes(schema)
        self.enums = enums  # Avro(enums=): symbols read by name
        self.symbols: list[int] = []  # their numbers, per writer symbol (AvroPlan)
        self.symbol_names: dict[int, list[str]] = {}  # the writer's, by node
        self.read_enums: dict[str, list[str]] = {}  # enums read by the writer's index
        self.nodes: list[list[int]] = []
        self.kids: list[int] = []
        self.notes: list[str] = []
        self.skipped: dict[int, int] = {}  # id(type) -> its skip node, shared
        self.given: set[str] = set()  # the fields some record of the writer gives

    def node(self, kind: str, note: str, field: int = -1, size: int = 0,
             stride: int = 0) -> int:
        code = self.codes[field] if field >= 0 else 0
        if field >= 0:
            self.given.add(self.schema.fields[field].name)
        self.nodes.append([_codec.AVRO_KINDS[kind], field, code, size, stride, 0, 0])
        self.notes.append(note)
        return len(self.nodes) - 1

    def children(self, i: int, kids: list[int]) -> int:
        self.nodes[i][5] = len(self.kids)
        self.nodes[i][6] = len(kids)
        self.kids.extend(kids)
        return i

    def walk(self, t: dict[str, Any], targets: dict[tuple[str, ...], int], path: str,
             branch: bool = False) -> int:
        """Node of writer type ``t`` at ``path``; ``targets``: rest of a field's path -> field.
        ``branch``: ``t`` is a branch of a union of which another branch is a record."""
        if () in targets:
            f = targets[()]
            return self.value(t, f, self.schema.fields[f].shape, path, True)
        if not targets:
            return self.skip(t, path)
        kind = t["type"]
        if kind == "record":
            i = self.node("record", path or "the record")
            kids = []
            for name, ft in t["fields"]:
                sub = {p[1:]: f for p, f in targets.items() if p[0] == name}
                kids.append(self.walk(ft, sub, f"{path}.{name}" if path else name))
            return self.children(i, kids)
        if kind == "union":
            # A branch that is no record (null, say) leaves the fields missing;
            # some branch must be able to give them.
            record = any(b["type"] == "record" for b in t["branches"])
            i = self.node("union", path)
            return self.children(i, [self.walk(b, targets, path, record)
                                     for b in t["branches"]])
        if kind in ("map", "array") and not branch:
            # Never a record: the fields would always be missing, and take their
            # default without a word although the value is there.
            rest, f = next(iter(targets.items()))
            raise ConfigError(f"field {self.schema.fields[f].name!r}: {path} is an Avro {kind}, "
                              f"not a record to read {'.'.join((path, *rest))!r} from: give a "
                              f"source through records only (kfeed skips maps and reads "
                              f"arrays whole)")
        # Not a record (null, say): the fields below it are missing (their default, or bad).
        return self.skip(t, path)

    def skip(self, t: dict[str, Any], path: str) -> int:
        key = id(t)
        if key in self.skipped:
            return self.skipped[key]
        kind = t["type"]
        if kind in _PRIMITIVES:
            return self.node(kind, path)
        if kind in ("fixed", "enum"):
            return self.node(kind, path, size=t["size"] if kind == "fixed" else len(t["symbols"]))
        i = self.node(kind, path)
        if "name" in t:
            self.skipped[key] = i  # before the children: recursive types end here
        if kind == "record":
            return self.children(i, [self.skip(ft, f"{path}.{n}" if path else n)
                                     for n, ft in t["fields"]])
        if kind == "union":
            return self.children(i, [self.skip(b, path) for b in t["branches"]])
        if kind == "array":
            return self.children(i, [self.skip(t["items"], f"{path}[]")])
        return self.children(i, [self.skip(t["values"], f"{path}{{}}")])

    def value(self, t: dict[str, Any], f: int, dims: tuple[int, ...], path: str,
              whole: bool) -> int:
        """Node reading writer type ``t`` into field ``f``, ``dims`` of its shape left."""
        field = self.schema.fields[f]
        kind = t["type"]
        if kind == "union":
            i = self.node("union", path, f)
            return self.children(i, [self.value(b, f, dims, path, whole) for b in t["branches"]])
        if kind == "null":
            # A null field takes its default; a null element fails the record.
            return self.node("null", path) if whole else self.node("null", path, f)
        if kind == "array":
            if not dims:
                return self.bad(field, "an array", path)
            size = -1 if dims[0] is None else dims[0]  # -1: a document, any length
            i = self.node("array", path, f, size=size, stride=math.prod(dims[1:]))
            return self.children(i, [self.value(t["items"], f, dims[1:], f"{path}[]", False)])
        if kind in ("bytes", "string") and dims == (None,) and field.dtype in ("uint8", "int8"):
            return self.node(kind, path, f, size=-1)  # a document of its bytes
        if kind == "fixed":
            if field.dtype not in ("uint8", "int8") or dims != (t["size"],):
                return self.bad(field, f"fixed({t['size']})", path)
            return self.node("fixed", path, f, size=t["size"])
        if dims:
            return self.bad(field, f"a single {kind}", path)
        ok = {"boolean": True,
              "int": field.dtype != "bool", "long": field.dtype != "bool",
              "enum": field.dtype != "bool",
              "float": field.dtype in _FLOATS, "double": field.dtype in _FLOATS}
        if not ok.get(kind, False):
            return self.bad(field, f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}", path)
        if kind == "long":
            return self.long(t.get("logical"), f, path)
        if kind != "enum":
            return self.node(kind, path, f)
        symbols = t["symbols"]
        given = self.enums.get(t["name"], self.enums.get(t["name"].rsplit(".", 1)[-1]))
        if given is None:
            self.read_enums[t["name"]] = symbols
            return self.node(kind, path, f, size=len(symbols))
        stride = len(self.symbols) + 1
        self.symbols += [given.index(x) if x in given else -1 for x in symbols]
        i = self.node(kind, path, f, size=len(symbols), stride=stride)
        self.symbol_names[i] = list(symbols)
        return i

    def long(self, logical: str | None, f: int, path: str) -> int:
        """Node reading a long into field ``f``; a timestamp in ``timestamps``' unit, if given."""
        self.units.setdefault(self.schema.fields[f].name, logical or "long")
        if self.timestamps is None or logical is None:
            return self.node("long", path, f)
        have, want = _NS[_UNITS[logical]], _NS[self.timestamps]
        return self.node("long", path, f, size=have // want if have > want else 0,
                         stride=want // have if want > have else 0)

    def bad(self, field: Field, what: str, path: str) -> int:
        self.given.add(field.name)  # (given, as something it cannot be: a bad record)
        shape = "" if not field.shape else f" of shape {field.shape}"
        return self.node("bad", f"{path}: {what} cannot be field {field.name!r} "
                                f"({field.dtype}{shape})")


def compile_plan(writer: Any, schema: Schema, named: Sequence[Any] = (),
                 enums: Mapping[str, list[str]] | None = None,
                 read_enums: dict[str, list[str]] | None = None,
                 unread: list[str] | None = None, timestamps: str | None = None,
                 units: dict[str, str] | None = None) -> Any:
    """The ``_codec.AvroPlan`` reading records of ``writer`` into ``schema``'s fields;
    ``named``: schemas defining the named types that ``writer`` refers to;
    ``enums``: as ``Avro(enums=)``. ``read_enums`` gets the enums read by
    the writer's index, with their symbols; ``unread`` the fields with a
    default that no record of ``writer`` gives a value for; ``timestamps``: as
    ``Avro(timestamps=)``; ``units`` gets the writer's timestamp logical
    type of each field read from a long ("long": none)."""
    names = _Names()
    for ref in named:
        names.resolve(ref, "")
    root = names.resolve(writer, "")
    # A union of a record and null (a nullable value: ["null", Record]) reads as the
    # record; a null one lacks every field (their defaults, or a bad record).
    if not (root["type"] == "record" or root["type"] == "union" and any(
            b["type"] == "record" for b in root["branches"])):
        raise ConfigError(f"the writer schema is {root['type']!r}; kfeed reads Avro records "
                          f"(or a union with a record branch)")
    layout = plan_layout(schema, "Avro")  # the dtypes checked first
    c = _Compiler(schema, enums or {}, timestamps)
    c.walk(root, {f.path: i for i, f in enumerate(schema.fields)}, "")
    if read_enums is not None:
        read_enums.update(c.read_enums)
    if units is not None:
        units.update(c.units)
    if unread is not None:
        unread.extend(f.name for f in schema.fields
                      if f.name not in c.given and f.default is not None)
    nodes = np.array(c.nodes, np.int64).reshape(-1, 7)
    varfield = -1 if schema.varlen is None else schema.fields.index(schema.varlen)
    return _codec.AvroPlan(layout, nodes, np.array(c.kids, np.int64), c.codes,
                           defaults(schema), c.notes, varfield,
                           np.array(c.symbols, np.int64), c.symbol_names)

