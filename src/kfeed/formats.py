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

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kfeed import _codec
from kfeed.errors import ConfigError, ConsumeError
from kfeed.schema import DecodeResult, Documents, Format, Schema, Target

__all__ = ["Decoder", "Encoder", "PlanDecoder", "RecordFormat", "resolve"]

log = logging.getLogger("kfeed.formats")

# A registry that does not answer is asked again for this long, then the
# loader fails with ConsumeError: a record is never skipped for want of its schema.
REGISTRY_RETRY_S = 30.0
# The longest one request to a registry waits for its answer (registry_client).
REGISTRY_REQUEST_S = 10.0

# A schema id the registry did not have is asked of it again after this long:
# a registry replica behind its leader, or one restored, has it soon after;
# its records until then are bad (the reason says the registry had no such id).
ABSENT_RETRY_S = 10.0


class Absent(str):
    """The reason ``plan_for`` gives for a key the registry did not have: asked again
    after ``ABSENT_RETRY_S``, where any other reason stands for the read's life."""

    __slots__ = ()


_NUMERIC = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float32", "float64")


class Decoder:
    """Decodes message values of one format into one kfeed Schema's rows."""

    # Many records a message (see RecordFormat.batches): decode_into then takes
    # start= and split=, as Schema.decode_into does for blocks.
    batches = False
    # Set by whoever runs the decoder: a wait for the schema registry ends with it.
    stop: threading.Event | None = None

    def decode_into(self, values: Sequence[Any], out: Target, row: int) -> DecodeResult:
        raise NotImplementedError

    def decode_documents(self, values: Sequence[Any]) -> Documents:
        """The schema's variable-length field of each value (for ``pack=``)."""
        raise NotImplementedError


class PlanDecoder(Decoder):
    """A decoder through Cython plans: one given, or one per writer schema the values name.

    ``single``: the plan of every value, or None: then each value's
    Confluent framing names its writer schema, and ``plan_for(key)`` makes
    the plan of a key the codec meets first (a schema id, or a schema id
    and message indexes), or says why its values are bad; it is asked once
    per key. ``decode(layout, plans, values, out, row, framed)`` and
    ``documents(layout, plans, values, framed, code)`` are the codec's entry
    points; both stop at a key without a plan and say which (``need``).
    """

    what = ""
    fmt: Any = None  # the format, with its registry (see registered())

    def __init__(self, schema: Schema, framed: bool, single: Any, decode: Callable[..., Any],
                 documents: Callable[..., Any]) -> None:
        self.schema = schema
        self.framed = framed
        self.single = single
        self.plans: dict[Any, Any] = {}
        self.absent: dict[Any, float] = {}  # key -> when the registry said it had none
        self._decode = decode
        self._documents = documents
        self.layout = plan_layout(schema, self.what)

    def plan_for(self, key: Any) -> Any:
        raise NotImplementedError

    def say_unread(self, schema_id: int, names: Sequence[str]) -> None:
        """Warn, once per writer schema, of the fields with a default that it gives no
        value for: its records read their default, without a bad record to say so."""
        if not names:
            return
        fields = {f.name: f for f in self.schema.fields}
        which = ", ".join(f"{n!r} (source {fields[n].source or n!r}, default "
                          f"{fields[n].default!r})" for n in names)
        log.warning("schema id %d gives no value for %s: its records read the default; "
                    "%s fields are matched by name, so a field the writer renamed reads so "
                    "too", schema_id, which, self.what)

    def _learn(self, key: Any) -> None:
        """The plan of ``key`` (or why its values are bad), asked of ``plan_for``."""
        self.plans[key] = plan = self.plan_for(key)
        if isinstance(plan, Absent):
            self.absent[key] = time.monotonic()

    def _ask_again(self) -> None:
        """Forget the keys the registry had none of, ``ABSENT_RETRY_S`` ago and more."""
        now = time.monotonic()
        for key, since in list(self.absent.items()):
            if now - since >= ABSENT_RETRY_S:
                del self.absent[key], self.plans[key]

    def ask(self, call: Callable[[], Any], what: str) -> Any:
        """``call()``'s answer from the format's registry (see ``ask_registry``)."""
        return ask_registry(call, what, registry_where(self.fmt.registry), self.stop)

    def registered(self, schema_id: int, fmt: str | None = None) -> Any:
        """The registered schema of ``schema_id`` (None: the registry has no such id)."""
        client = self.fmt.client()
        log.info("fetching the writer schema of id %d from the registry", schema_id)
        return self.ask(lambda: client.get_schema(schema_id, None, fmt) if fmt
                        else client.get_schema(schema_id), f"schema id {schema_id}")

    def decode_into(self, values: Sequence[Any], out: Target, row: int) -> DecodeResult:
        """Decode values into ``out`` from ``row`` on: one row per good value.

        A rejected value adds no row, but may have begun writing the row after
        the last good one (which the next good value overwrites); nothing
        outside ``out`` is ever written.
        """
        if self.schema.varlen is not None:
            raise ConfigError(f"field {self.schema.varlen.name!r} is variable-length: read it "
                              f"with pack=kfeed.Pack(...)")
        if not isinstance(values, (list, tuple)):
            values = list(values)
        if self.absent:
            self._ask_again()
        plans = self.single if self.single is not None else self.plans
        rows = consumed = 0
        bad: list[tuple[int, str]] = []
        while True:
            r, c, b, need = self._decode(self.layout, plans,
                                         values[consumed:] if consumed else values, out.out,
                                         row + rows, self.framed)
            bad.extend((consumed + i, why) for i, why in b)
            rows += r
            consumed += c
            if need is None:
                return DecodeResult(rows, consumed, bad)
            self._learn(need)

    def decode_documents(self, values: Sequence[Any]) -> Documents:
        """Each record's token field, flat; a bad record gives none."""
        f = self.schema.varlen
        if f is None:
            raise ConfigError("decode_documents needs a schema with a variable-length field")
        if not isinstance(values, (list, tuple)):
            values = list(values)
        code = codes(self.schema)[self.schema.fields.index(f)]
        if self.absent:
            self._ask_again()
        plans = self.single if self.single is not None else self.plans
        parts, lengths, counts = [], [], []
        rows: dict[str, list[np.ndarray]] = {x.name: [] for x in self.schema.fields
                                             if not x.variable}
        bad: list[tuple[int, str]] = []
        done = 0
        while True:
            out = self._rows_out(len(values) - done) if rows else None
            tokens, lens, cnts, b, need = self._documents(
                self.layout, plans, values[done:] if done else values, self.framed, code,
                None if out is None else out[0])
            if out is not None:
                for x, buf in zip(self.schema.fields, out[1], strict=True):
                    if not x.variable:
                        rows[x.name].append(buf[:len(lens)].view(x.storage)
                                            .reshape(len(lens), *x.shape))
            parts.append(tokens)
            lengths.append(lens)
            counts.append(cnts)
            bad.extend((done + i, why) for i, why in b)
            done += len(cnts)
            if need is None:
                break
            self._learn(need)
        columns = {name: np.concatenate(parts_) for name, parts_ in rows.items()}
        return Documents(np.frombuffer(b"".join(parts), f.storage), np.concatenate(lengths),
                         np.concatenate(counts), bad, columns)

    def _rows_out(self, n: int) -> tuple[Any, list[np.ndarray]]:
        """The codec's output for the fields beside the document: ``n`` rows each."""
        bufs = [np.empty((n, x.storage.itemsize if x.variable else x.nbytes), np.uint8)
                for x in self.schema.fields]
        return _codec.Out(self.layout, bufs), bufs


class Stopped(Exception):
    """The loader or convert was stopped while it waited for the registry."""


def ask_registry(call: Callable[[], Any], what: str, where: str,
                 stop: threading.Event | None = None) -> Any:
    """``call()``'s answer; None when the registry says it has no such thing.

    "Not found" is a 404 with a registry error code (404xx); a 404 without
    one is a url that serves no registry, and a refused login (401, 403) or
    another refusal is said at once: no wait mends them. A registry that
    does not answer is asked again, with a growing pause, for
    ``REGISTRY_RETRY_S``; then ``ConsumeError``: a record is never rejected
    for want of an answer. ``stop``, once set, ends the wait (``Stopped``).
    """
    deadline = time.monotonic() + REGISTRY_RETRY_S
    delay = 0.1
    while True:
        try:
            return call()
        except Exception as e:  # the registry client raises errors of many kinds
            status = getattr(e, "http_status_code", None)
            code = getattr(e, "error_code", None)
            if status == 404 and isinstance(code, int) and 40400 <= code < 40500:
                return None
            if status == 404:
                raise ConsumeError(f"{where} has no {what}, and its answer is not the Schema "
                                   f"Registry API's ({e}): give the url of the API's root, "
                                   f"e.g. http://registry:8081 (Apicurio's: "
                                   f".../apis/ccompat/v7)") from e
            if status in (401, 403):
                raise ConsumeError(f"{where} refused to give {what} (HTTP {status}): check "
                                   f"the registry's basic.auth.user.info (or "
                                   f"bearer.auth.* settings)") from e
            if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
                raise ConsumeError(f"{where} refused to give {what}: {e}") from e
            left = deadline - time.monotonic()
            if left <= 0:  # (it gave up up to 5 s early, where the next pause passed it)
                raise ConsumeError(f"{where} did not give {what} "
                                   f"within {REGISTRY_RETRY_S:.0f} s: {e}") from e
            delay = min(delay, left)
            log.warning("%s: %s; asking again in %.1f s", where, e, delay)
            if stop is None:
                time.sleep(delay)
            elif stop.wait(delay):
                raise Stopped from e
            delay = min(delay * 2, 5.0)


class RecordFormat:
    """A format of one record per message; ``value`` names it (in ``state_dict()``)."""

    value = ""
    # Whether its decoder reads a variable-length token field (``pack=``).
    documents = False
    # Whether a message holds many records, as kfeed's blocks do (Arrow): its
    # decoder then reads from a record inside a message (``start``), and the
    # producer writes ``block_records`` records a message.
    batches = False

    def decoder(self, schema: Schema) -> Decoder:
        raise NotImplementedError

    def encoder(self, schema: Schema, topic: str) -> Encoder:
        """The producer's writer of ``schema`` rows to ``topic``, in this format."""
        raise ConfigError(f"the producer writes block, raw, json, arrow, avro or protobuf, "
                          f"not {self!r}")


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
    if value == "arrow":
        from kfeed.arrowformat import Arrow

        return Arrow()
    return Format.parse(value)


def registry_url_ok(url: Any) -> bool:
    """Whether ``url`` is one or more http://, https:// (or mock://, confluent-kafka's
    in-memory registry) addresses, joined by commas."""
    parts = url.split(",") if isinstance(url, str) else []
    return bool(parts) and all(u.strip().startswith(("http://", "https://", "mock://"))
                               for u in parts)


def checked_registry(registry: Any) -> Any:
    """``registry=`` of a format, checked where it is given: a client, or a config dict
    whose url(s) a client can reach (checked when the client is made, too late)."""
    if registry is None:
        return None
    if isinstance(registry, Mapping):
        url = registry.get("url")
        if not registry_url_ok(url):
            from kfeed.ingest import no_password

            shown = no_password(url) if isinstance(url, str) else url
            raise ConfigError(f"registry url {shown!r} is not an http:// or https:// address: "
                              f"give e.g. {{'url': 'http://registry:8081'}}")
        try:  # the client checks its settings when made (no request yet)
            registry_client(registry, "the format")
        except (ValueError, TypeError) as e:
            raise ConfigError(f"registry: {e}") from None
        return registry
    if not callable(getattr(registry, "get_schema", None)):
        raise ConfigError("registry must be a SchemaRegistryClient config dict "
                          "({'url': ...}) or a client with get_schema(schema_id)")
    return registry


def registry_where(registry: Any) -> str:
    """The registry in a message: its url, or the client given."""
    if isinstance(registry, Mapping):
        from kfeed.ingest import no_password

        return f"the registry at {no_password(str(registry.get('url')))}"
    return f"the registry client {type(registry).__name__}"


def registry_client(registry: Any, who: str, reading: bool = False) -> Any:
    """A Schema Registry client from its config dict, or the client given.

    ``reading``: for decoders, which ask again themselves (``ask_registry``,
    watching their stop): the client's own retries, 7 s of them by default,
    are off unless the dict sets ``max.retries``.

    A request waits ``REGISTRY_REQUEST_S`` at most unless the dict sets
    ``timeout``: the client's own default is none, and a registry that hung
    (its process stopped, a network that drops packets) held every read and
    write for as long as it hung, with no error and no way to stop it.
    """
    if not isinstance(registry, Mapping):
        return registry
    registry = {"timeout": REGISTRY_REQUEST_S, **registry}
    if reading:
        registry = {"max.retries": 0, **registry}
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
    _numeric(schema, what)
    return layout


def _numeric(schema: Schema, what: str) -> None:
    """Refuse a field whose dtype the decoders of ``what`` do not write."""
    for f in schema.fields:
        if f.dtype not in _NUMERIC:
            raise ConfigError(f"field {f.name!r}: {what} values decode into bool, integer, "
                              f"float32 or float64 fields, not {f.dtype}")


def one_field(schema: Schema, what: str) -> None:
    """Refuse fields beside the token field of a topic of ``what`` packed into rows."""
    f = schema.varlen
    assert f is not None
    if len(schema.fields) != 1:
        others = ", ".join(repr(x.name) for x in schema.fields if x is not f)
        raise ConfigError(f"a {what} topic packed into token rows gives one field, "
                          f"{f.name!r}: leave {others} out of the schema")


def document_layout(schema: Schema, what: str) -> Any:
    """The codec layout of a schema with a variable-length field, read as documents.

    That field's row is one element as far as the layout knows (the
    decoders grow each document as they read it); the other fields' rows
    are theirs. Their dtypes are checked as ``fixed_layout`` checks them.
    """
    assert schema.varlen is not None
    _numeric(schema, what)
    return _codec.Layout([x.storage.itemsize if x.variable else x.nbytes
                          for x in schema.fields], schema.fingerprint, schema.names)


def plan_layout(schema: Schema, what: str) -> Any:
    """The layout a plan of ``what`` writes: fixed-shape rows, or (one token field) documents.

    A plan reads each record field into one kfeed field: two fields of one
    ``source`` are refused (the plans kept the last, and the other read as
    missing, or as zeros).
    """
    by_path: dict[tuple[str, ...], str] = {}
    for f in schema.fields:
        other = by_path.setdefault(f.path, f.name)
        if other != f.name:
            raise ConfigError(f"fields {other!r} and {f.name!r} both read "
                              f"{'.'.join(f.path)!r} of the {what} records: each is read "
                              f"into one kfeed field; leave one out, and convert its values "
                              f"after the batch")
    if schema.varlen is not None:
        return document_layout(schema, what)
    return fixed_layout(schema, what)


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
