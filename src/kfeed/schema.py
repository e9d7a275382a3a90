"""Schemas: named fields of fixed shape, and the entry points of the codec.

A ``Schema`` sits at both ends of the data flow. The producer encodes columns
of samples into message values with it; the loader decodes message values into
the buffer pool with it. The byte layout lives in ``ext/_codec.pyx`` and is
documented in docs/FORMAT.md; this module checks arguments and hands the codec
numpy views of arrays and tensors, whose buffers the codec holds and bounds
itself (it takes no addresses).

One field may instead be variable-length, shape ``(None,)``: token documents
for language-model training. Such a schema encodes from a list of 1-D arrays
(one per document) or from ``(flat, lengths)``, and decodes with
``decode_documents`` into one flat array plus one length per document, which
``kfeed.tokens.Packer`` packs into ``[batch, seq_len]`` rows, or the loader
hands out jagged (elements and offsets) beside the fixed fields.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, NamedTuple

import numpy as np

from kfeed import _codec
from kfeed.errors import ConfigError

__all__ = ["Schema", "Field", "DecodeResult", "Documents", "Format"]

# Schema dtype name -> numpy dtype that stores it. bfloat16 has no numpy dtype:
# it travels as 2-byte words and becomes torch.bfloat16 in the pool.
_STORAGE = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}

# The dtypes a variable-length field may have: token ids and the like.
_VARLEN_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")

# Elements of one document in a block: its offsets are uint32.
_MAX_DOC_ELEMENTS = 0xFFFFFFFF
# Kafka's largest message (its sizes are int32): a fixed-shape record must fit in one.
_MAX_RECORD = 2**31 - 1


class Format(str, Enum):
    """How records are laid out in message values (docs/FORMAT.md)."""

    BLOCK = "block"
    RAW = "raw"

    @classmethod
    def parse(cls, value: str | Format) -> Format:
        try:
            return cls(value)
        except ValueError:
            hint = ""
            if isinstance(value, type):  # the class, not one: format=kfeed.Json
                hint = f" (the class: did you mean kfeed.{value.__name__}()?)"
            elif value in ("avro", "protobuf"):  # these need their schemas' source
                hint = f" (say where its schemas come from: kfeed.{value.title()}(registry=...))"
            raise ConfigError(f"format must be 'block', 'raw', 'json', 'arrow', kfeed.Json(), "
                              f"kfeed.Arrow(), kfeed.Avro(...) or kfeed.Protobuf(...), got "
                              f"{value!r}{hint}") from None


class Field(NamedTuple):
    """One field: its name, dtype and shape; for records others write, where it comes from.

    ``source``: the dotted path of the record field it is read from (Avro,
    Protobuf, JSON); None means the field's own name. ``default``: the value
    a null or missing source takes; None means such a record is bad. Neither
    changes the schema's fingerprint: kfeed's own blocks do not use them.
    """

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    source: str | None = None
    default: Any = None

    @property
    def path(self) -> tuple[str, ...]:
        """The record field it is read from, as a path of names."""
        return source_path(self.source or self.name)

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype of the bytes on the wire and in numpy outputs."""
        return _STORAGE[self.dtype]

    @property
    def variable(self) -> bool:
        """Whether this field's length varies per record (shape ``(None,)``)."""
        return self.shape == (None,)

    @property
    def nbytes(self) -> int:
        """Bytes of one record's value of this field; 0 for a variable-length field."""
        if self.variable:
            return 0
        return self.storage.itemsize * math.prod(self.shape)  # type: ignore[arg-type]

    @property
    def torch_dtype(self) -> Any:
        import torch

        if self.dtype == "bfloat16":
            return torch.bfloat16
        return getattr(torch, self.dtype)


class DecodeResult(NamedTuple):
    """What ``Schema.decode_into`` did.

    rows: rows written. consumed: values fully used (resume at this index).
    bad: ``(index, reason)`` for each value rejected whole. partial: when
    ``split=True`` let a block straddle the end of ``out``, the number of its
    records taken so far (resume at ``values[consumed]`` with ``start=partial``).
    """

    rows: int
    consumed: int
    bad: list[tuple[int, str]]
    partial: int = 0


class Documents(NamedTuple):
    """What ``Schema.decode_documents`` gives: documents, flat, no object per document.

    tokens: the variable-length field of every document taken, concatenated
    (1-D, the field's dtype). lengths: int64, each document's length in
    elements (``lengths.sum() == len(tokens)``). counts: int64, one per value,
    the documents taken from it (0 for a rejected value), so document ``d``
    came from value ``np.searchsorted(np.cumsum(counts), d, "right")``.
    bad: ``(index, reason)`` for each value rejected whole. columns: the fixed
    fields, ``[len(lengths), *shape]`` each.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray
    bad: list[tuple[int, str]]
    columns: dict[str, np.ndarray]


class Target(NamedTuple):
    """Output buffers bound once: the codec's hold on them, capacity, and the owners."""

    out: _codec.Out
    capacity: int
    owners: tuple[Any, ...]

    @property
    def pointers(self) -> np.ndarray:
        """Where each field's buffer starts (uint64), for inspection only."""
        return np.array(self.out.addresses, np.uint64)


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch")


class Schema:
    """Named fields of numpy dtypes, in declared order.

    Every field has a fixed shape, except that at most one field may be
    variable-length: an integer dtype and shape ``(None,)`` (token ids).

    >>> s = Schema({"features": ("float32", (768,)), "label": ("int64", ())})
    >>> s.record_size
    3080
    >>> Schema({"tokens": ("int32", (None,))}).varlen.name
    'tokens'
    """

    __slots__ = ("fields", "record_size", "fingerprint", "varlen", "_layout", "_doc_layout",
                 "_by_name")

    def __init__(self, fields: Mapping[str, tuple[str, Sequence[int | None]]]) -> None:
        if isinstance(fields, Schema):
            fields = fields.to_dict()
        if not isinstance(fields, Mapping):
            raise ConfigError(f"a schema is a dict {{name: (dtype, shape)}}, got "
                              f"{type(fields).__name__}")
        if not fields:
            raise ConfigError("a schema needs at least one field, as {name: (dtype, shape)}")
        parsed = []
        for name, spec in fields.items():
            parsed.append(_parse_field(name, spec))
        self.fields: tuple[Field, ...] = tuple(parsed)
        self._by_name = {f.name: f for f in self.fields}
        variable = [f for f in self.fields if f.variable]
        if len(variable) > 1:
            raise ConfigError(
                f"at most one variable-length field per schema, got "
                f"{', '.join(repr(f.name) for f in variable)}"
            )
        # The variable-length field, or None. record_size then counts the
        # fixed fields only.
        self.varlen: Field | None = variable[0] if variable else None
        self.record_size = sum(f.nbytes for f in self.fields)
        if self.record_size > _MAX_RECORD:
            raise ConfigError(
                f"a record of these fields takes {self.record_size} bytes; one must fit in a "
                f"Kafka message, at most {_MAX_RECORD} bytes: "
                + ", ".join(f"{f.name!r} {f.dtype}{list(f.shape)} {f.nbytes}" for f in self.fields))
        canonical = json.dumps(
            [[f.name, f.dtype, list(f.shape)] for f in self.fields], separators=(",", ":")
        )
        digest = hashlib.blake2b(
            b"kfeed.schema.v1:" + canonical.encode(), digest_size=8
        ).digest()
        self.fingerprint = int.from_bytes(digest, "little")
        self._layout: _codec.Layout | None = None
        self._doc_layout: _codec.DocLayout | None = None
        if self.varlen is None:
            self._layout = _codec.Layout(
                [f.nbytes for f in self.fields], self.fingerprint, self.names
            )
        else:
            self._doc_layout = _codec.DocLayout(
                [f.nbytes for f in self.fields],
                self.fields.index(self.varlen),
                self.varlen.storage.itemsize,
                self.fingerprint,
                self.names,
            )

    # -- description ---------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def __getitem__(self, name: str) -> Field:
        return self._by_name[name]

    def __len__(self) -> int:
        return len(self.fields)

    def to_dict(self) -> dict[str, tuple[Any, ...]]:
        return {f.name: (f.dtype, f.shape, *_options(f)) for f in self.fields}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and other.fields == self.fields

    def __hash__(self) -> int:
        return hash(self.fields)

    def __repr__(self) -> str:
        return f"Schema({self.to_dict()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields: the codec's layouts are made again, so a
        # schema travels to spawned and forkserver DataLoader workers.
        return (Schema, (self.to_dict(),))

    def block_nbytes(self, count: int, elements: int = 0) -> int:
        """Size of a block message value holding ``count`` records.

        With a variable-length field, ``elements`` is the number of its
        elements in all ``count`` records together.
        """
        if self._doc_layout is not None:
            return self._doc_layout.block_nbytes(count, elements)
        if elements:
            raise ConfigError("elements applies only to a schema with a variable-length field")
        return self._layout.block_nbytes(count)  # type: ignore[union-attr]

    def _fixed_only(self, what: str) -> _codec.Layout:
        if self._layout is None:
            name = self.varlen.name if self.varlen is not None else "?"
            raise ConfigError(
                f"{what} needs fixed-shape fields; {name!r} is variable-length: decode it "
                f"with decode_documents and pack it with kfeed.tokens.Packer"
            )
        return self._layout

    # -- encode --------------------------------------------------------------

    def _columns(self, columns: Mapping[str, Any]) -> tuple[list[np.ndarray], int, list[Any]]:
        """Check columns against the schema; give flat uint8 views and N.

        For a variable-length field the view holds every record's elements,
        concatenated; ``_doc_columns`` also gives their offsets.
        """
        if self.varlen is not None:
            views, _offsets, n, owners = self._doc_columns(columns)
            return views, n, owners
        return self._fixed_columns(columns, None)

    def _fixed_columns(
        self, columns: Mapping[str, Any], n: int | None
    ) -> tuple[list[np.ndarray], int, list[Any]]:
        arrays, n = self._checked_columns(columns, n)
        views, owners = [], []
        for arr in arrays.values():
            if arr is None:  # the variable-length field
                views.append(None)
                continue
            arr = np.ascontiguousarray(arr)
            owners.append(arr)
            views.append(arr.reshape(-1).view(np.uint8))
        return views, n, owners

    def _checked_columns(
        self, columns: Mapping[str, Any], n: int | None
    ) -> tuple[dict[str, np.ndarray | None], int]:
        """The fixed-shape columns checked against the schema, as numpy arrays in the
        fields' order, copied nowhere (strided ones stay so); None for a variable-length
        field. And N."""
        if not isinstance(columns, Mapping):
            raise ConfigError("columns must be a mapping of field name -> array")
        extra = set(columns) - set(self._by_name)
        if extra:
            raise ConfigError(f"columns not in the schema: {sorted(extra)}")
        arrays: dict[str, np.ndarray | None] = {}
        for f in self.fields:
            if f.name not in columns:
                raise ConfigError(f"field {f.name!r} is missing from the columns")
            if f.variable:
                arrays[f.name] = None
                continue
            arr = _as_numpy(f, columns[f.name])
            if arr.ndim == 0 or arr.shape[1:] != f.shape:
                raise ConfigError(
                    f"field {f.name!r}: expected shape (N, {', '.join(map(str, f.shape))}) "
                    f"got {tuple(arr.shape)}".replace("(N, )", "(N,)")
                )
            if n is None:
                n = arr.shape[0]
            elif arr.shape[0] != n:
                raise ConfigError(
                    f"field {f.name!r} has {arr.shape[0]} rows, other fields have {n}"
                )
            arrays[f.name] = arr
        return arrays, int(n or 0)

    def _doc_columns(
        self, columns: Mapping[str, Any]
    ) -> tuple[list[np.ndarray], np.ndarray, int, list[Any]]:
        """Columns of a schema with a variable-length field: views, offsets, N, owners."""
        f = self.varlen
        assert f is not None
        if not isinstance(columns, Mapping):
            raise ConfigError("columns must be a mapping of field name -> array")
        if f.name not in columns:
            raise ConfigError(f"field {f.name!r} is missing from the columns")
        flat, offsets = _documents(f, columns[f.name])
        n = len(offsets) - 1
        views, n, owners = self._fixed_columns(columns, n)
        views[self.fields.index(f)] = flat.view(np.uint8)
        owners.append(flat)
        return views, offsets, n, owners

    def encode_blocks(
        self, columns: Mapping[str, Any], block_records: int = 64, *,
        block_bytes: int | None = None,
    ) -> list[bytes]:
        """Pack N samples into block values of at most ``block_records`` each.

        With a variable-length field, the column is a list of 1-D arrays (one
        per document) or a tuple ``(flat, lengths)``; ``block_bytes`` then
        also closes a block before it would grow past that many bytes (a
        document bigger than that gets a block of its own), e.g. Kafka's
        ``message.max.bytes``.
        """
        if not isinstance(block_records, int) or not 1 <= block_records <= 0xFFFFFFFF:
            raise ConfigError(f"block_records must be a positive int, got {block_records!r}")
        if self._doc_layout is None:
            if block_bytes is not None:
                raise ConfigError(
                    "block_bytes applies only to a schema with a variable-length field; "
                    "size fixed records with block_records"
                )
            views, n, _owners = self._columns(columns)
            try:
                return _codec.encode_blocks(self._layout, views, n, block_records)
            except ValueError as e:
                raise _config_error(e) from None
        if block_bytes is not None and (
            not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes < 40
        ):
            raise ConfigError(f"block_bytes must be an int >= 40, got {block_bytes!r}")
        views, offsets, n, _owners = self._doc_columns(columns)
        if n == 0:
            return []
        try:
            return _codec.encode_doc_blocks(
                self._doc_layout, views, offsets, n, block_records, block_bytes or 0
            )
        except ValueError as e:
            raise _config_error(e) from None

    def encode_block(self, columns: Mapping[str, Any]) -> bytes:
        """All N samples as one block value."""
        if self._doc_layout is not None:
            views, offsets, n, _owners = self._doc_columns(columns)
            if n > 0xFFFFFFFF or offsets[-1] > _MAX_DOC_ELEMENTS:
                raise ConfigError(
                    f"a block holds at most 2**32-1 records and 2**32-1 elements, got "
                    f"{n} records of {int(offsets[-1])} elements"
                )
            try:
                return _codec.encode_doc_blocks(
                    self._doc_layout, views, offsets, n, max(n, 1), 0
                )[0]
            except ValueError as e:
                raise _config_error(e) from None
        views, n, _owners = self._columns(columns)
        if n == 0:
            return _codec.empty_block(self._layout)
        if n > 0xFFFFFFFF:
            raise ConfigError(f"a block holds at most 2**32-1 records, got {n}")
        try:
            return _codec.encode_blocks(self._layout, views, n, n)[0]
        except ValueError as e:
            raise _config_error(e) from None

    def encode_raw(self, columns: Mapping[str, Any]) -> list[bytes]:
        """One raw value per sample: the fields concatenated in schema order.

        With a variable-length field (which must then be the only field), one
        value per document: its elements' bytes.
        """
        if self._doc_layout is not None:
            self._raw_documents_only()
            views, offsets, n, _owners = self._doc_columns(columns)
            try:
                return _codec.encode_doc_raw(self._doc_layout, views[0], offsets, n)
            except ValueError as e:
                raise _config_error(e) from None
        views, n, _owners = self._columns(columns)
        try:
            return _codec.encode_raw(self._layout, views, n)
        except ValueError as e:
            raise _config_error(e) from None

    def _raw_documents_only(self) -> None:
        if len(self.fields) != 1:
            raise ConfigError(
                f"the raw format of a schema with a variable-length field holds that field "
                f"only (one document per value); this schema also has "
                f"{', '.join(repr(f.name) for f in self.fields if not f.variable)}: use blocks"
            )

    # -- decode --------------------------------------------------------------

    def empty(self, n: int, *, like: str = "numpy", pin_memory: bool = False) -> dict[str, Any]:
        """Uninitialised output buffers for ``n`` records: numpy or torch."""
        self._fixed_only("empty")
        if like == "numpy":
            return {f.name: np.empty((n, *f.shape), f.storage) for f in self.fields}
        if like == "torch":
            import torch

            return {
                f.name: torch.empty((n, *f.shape), dtype=f.torch_dtype, pin_memory=pin_memory)
                for f in self.fields
            }
        raise ConfigError(f"like must be 'numpy' or 'torch', got {like!r}")

    def bind(self, out: Mapping[str, Any]) -> Target:
        """Check output buffers once and hold them for many decodes."""
        layout = self._fixed_only("bind")
        if not isinstance(out, Mapping):
            raise ConfigError("out must be a mapping of field name -> array or tensor")
        views = []
        capacity = None
        owners = []
        for f in self.fields:
            if f.name not in out:
                raise ConfigError(f"field {f.name!r} is missing from out")
            buf = out[f.name]
            view = _out_view(f, buf)
            rows = int(view.shape[0])
            if capacity is None:
                capacity = rows
            elif rows != capacity:
                raise ConfigError(f"out[{f.name!r}] has {rows} rows, other fields have {capacity}")
            views.append(view)
            owners.append(buf)
        try:
            held = _codec.Out(layout, views)
        except ValueError as e:
            raise _config_error(e) from None
        return Target(held, int(held.capacity), tuple(owners))

    def decode_into(
        self,
        values: Sequence[Any],
        out: Mapping[str, Any] | Target,
        row: int = 0,
        format: str | Format = "block",
        *,
        start: int = 0,
        split: bool = False,
    ) -> DecodeResult:
        """Decode message values into ``out`` from ``row`` on.

        Stops before a value that would overflow ``out`` (or, with ``split``,
        fills ``out`` with part of a block and reports ``partial``). A bad
        value is rejected whole and listed in ``bad``; values after it go on.
        """
        return self._decode("decode_into", values, out, row, format, start, split, None)

    def decode_counts(
        self,
        values: Sequence[Any],
        out: Mapping[str, Any] | Target,
        row: int = 0,
        format: str | Format = "block",
        *,
        start: int = 0,
        split: bool = False,
    ) -> tuple[DecodeResult, np.ndarray]:
        """``decode_into``, and how many rows each value gave.

        The counts are int64, one per value: the rows value ``i`` wrote (0 if
        it was rejected or not reached), so row ``row + counts[:i].sum() + k``
        holds record ``k`` (after ``start``, for the first value) of value
        ``i``. A caller that decodes many values into a staging area at once
        knows from them which record each staged row is.
        """
        if not isinstance(values, (list, tuple)):
            values = list(values)
        counts = np.zeros(len(values), np.int64)
        return self._decode("decode_counts", values, out, row, format, start, split,
                            counts), counts

    def _decode(self, what: str, values: Sequence[Any], out: Mapping[str, Any] | Target,
                row: int, format: str | Format, start: int, split: bool,
                counts: np.ndarray | None) -> DecodeResult:
        layout = self._fixed_only(what)
        target = out if isinstance(out, Target) else self.bind(out)
        fmt = Format.parse(format)
        if not isinstance(row, int) or not 0 <= row <= target.capacity:
            raise ConfigError(f"row must be in 0..{target.capacity}, got {row!r}")
        if (not isinstance(start, int) or isinstance(start, bool)
                or not 0 <= start <= 0xFFFFFFFF or (start and fmt is Format.RAW)):
            raise ConfigError(
                f"start must be 0 for raw values and in 0..2**32-1 for blocks, got {start!r}")
        try:
            if counts is None:
                rows, consumed, partial, bad = _codec.decode(
                    layout, values, target.out, row, fmt is Format.BLOCK, start, split
                )
            else:
                rows, consumed, partial, bad = _codec.decode_counted(
                    layout, values, target.out, row, fmt is Format.BLOCK, start, split, counts
                )
        except ValueError as e:  # a target bound for rows of another size
            raise ConfigError(str(e)) from None
        return DecodeResult(rows, consumed, bad, partial)

    def take(self, source: Mapping[str, Any] | Target, rows: Any,
             out: Mapping[str, Any] | Target, row: int = 0) -> None:
        """Copy rows ``rows`` of ``source`` to ``out`` from ``row`` on, every field.

        One call, without the GIL and with no Python object per record, for a
        batch of records picked by index (a shuffle's picks) out of a staging
        area that ``decode_counts`` filled. ``rows``: 1-D ints; each must be
        a row of ``source``, and ``out`` must have room from ``row`` on.
        """
        layout = self._fixed_only("take")
        src = source if isinstance(source, Target) else self.bind(source)
        dst = out if isinstance(out, Target) else self.bind(out)
        idx = np.asarray(rows)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise ConfigError("rows must be a 1-D array of ints")
        if not isinstance(row, int) or not 0 <= row <= dst.capacity:
            raise ConfigError(f"row must be in 0..{dst.capacity}, got {row!r}")
        try:
            _codec.gather(layout, src.out, np.ascontiguousarray(idx, np.int64), dst.out, row)
        except (IndexError, ValueError) as e:
            raise ConfigError(str(e)) from None

    def hold(self, format: str | Format = "block", *, limit: int = 0) -> _codec.Held:
        """A store of message values whose records are read back one by one (a shuffle's).

        ``Held.add(values, pids, offsets)`` checks the values whole, as
        ``decode_into`` does, and keeps the good ones; each record is named
        by an *item*. ``Held.gather(items, target.out, row)`` copies records
        picked by item straight from their values into a bound target, one
        call without the GIL, and lets them go; ``Held.drop(items)`` lets
        records go uncopied. A value is released once all its records are
        gone; past ``limit`` bytes held (0: none), values with few records
        left are compacted (their records copied out, the value let go).
        See ``_codec.Held``.
        """
        if not isinstance(limit, int) or limit < 0:
            raise ConfigError(f"limit must be an int >= 0, got {limit!r}")
        return _codec.Held(self._fixed_only("hold"), Format.parse(format) is Format.BLOCK,
                           limit)

    def decode_documents(
        self, values: Sequence[Any], format: str | Format = "block", *, start: int = 0
    ) -> Documents:
        """Decode every document in ``values`` (a schema with a variable-length field).

        Gives one flat array of the variable-length field plus one length per
        document, and the fixed fields' rows; see ``Documents``. A bad value
        (including a block whose offsets are not monotone, do not start at 0,
        or do not end where the value does) is rejected whole and listed in
        ``bad``; the values after it go on. ``start`` documents of the first
        value are skipped (taken before, when resuming inside a block).
        """
        if self._doc_layout is None:
            raise ConfigError(
                "decode_documents needs a schema with a variable-length field; "
                "decode fixed-shape records with decode_into"
            )
        fmt = Format.parse(format)
        if fmt is Format.RAW:
            self._raw_documents_only()
        if not isinstance(start, int) or isinstance(start, bool) or start < 0 or (
            start and fmt is Format.RAW
        ):
            raise ConfigError(f"start must be 0 for raw values and >= 0 for blocks, got {start!r}")
        elements, lengths, counts, fixed, bad = _codec.decode_documents(
            self._doc_layout, values, fmt is Format.BLOCK, start
        )
        assert self.varlen is not None
        tokens = elements.view(self.varlen.storage)
        columns = {
            f.name: raw.view(f.storage).reshape(len(lengths), *f.shape)
            for f, raw in zip(self.fields, fixed)
            if raw is not None
        }
        return Documents(tokens, lengths, counts, bad, columns)


def _parse_field(name: object, spec: object) -> Field:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"field names must be non-empty strings, got {name!r}")
    if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
        raise ConfigError(f"field {name!r}: expected (dtype, shape) or (dtype, shape, "
                          f"{{'source': ..., 'default': ...}}), got {spec!r}")
    dtype, shape = spec[:2]
    source, default = _parse_options(name, spec[2] if len(spec) == 3 else {})
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        dtype = np.dtype(dtype).name
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in _STORAGE:
        raise ConfigError(
            f"field {name!r}: unknown dtype {spec[0]!r}; one of {', '.join(_STORAGE)}"
        )
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise ConfigError(f"field {name!r}: shape must be a tuple of ints, got {shape!r}")
    if any(d is None for d in shape):
        if len(shape) != 1:
            raise ConfigError(
                f"field {name!r}: a variable-length field must be 1-D, shape (None,); "
                f"got {tuple(shape)}"
            )
        if dtype not in _VARLEN_DTYPES:
            raise ConfigError(
                f"field {name!r}: a variable-length field needs an integer dtype "
                f"({', '.join(_VARLEN_DTYPES)}), got {dtype}"
            )
        if default is not None:  # a whole document: a 1-D sequence of any length
            if np.ndim(default) != 1:
                raise ConfigError(f"field {name!r}: the default of a variable-length field is "
                                  f"a document, a 1-D sequence (e.g. []), got {default!r}")
            n = len(default)
            default = _frozen(_default_value(name, dtype, (n,), default).tolist()) if n else ()
        return Field(name, dtype, (None,), source, default)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in shape):
        raise ConfigError(f"field {name!r}: shape must be a tuple of ints, got {shape!r}")
    if any(d <= 0 for d in shape):
        raise ConfigError(f"field {name!r}: dimensions must be positive, got {tuple(shape)}")
    shape = tuple(int(d) for d in shape)
    if default is not None:
        default = _default_value(name, dtype, shape, default)
        default = default.item() if default.ndim == 0 else _frozen(default.tolist())
    return Field(name, dtype, shape, source, default)


def _default_value(name: str, dtype: str, shape: tuple[int, ...], default: Any) -> np.ndarray:
    # As values are read (numpy's same_kind casting), and an integer must fit.
    storage = _STORAGE[dtype]
    try:
        given = np.asarray(default)
        value = np.broadcast_to(given, shape)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"field {name!r}: default {default!r} does not fit shape {shape} "
                          f"({e})") from None
    ints = given.dtype.kind in "iub" and storage.kind in "iub"
    if dtype == "bfloat16" or not (ints or np.can_cast(given.dtype, storage, "same_kind")):
        raise ConfigError(f"field {name!r}: default {default!r} is not a {dtype} value")
    out = value.astype(storage)
    if ints and not (out == value).all():
        raise ConfigError(f"field {name!r}: default {default!r} does not fit {dtype}")
    return out


def _frozen(value: Any) -> Any:
    # Nested tuples, so that a Field (and a Schema) stays hashable.
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _parse_options(name: str, options: object) -> tuple[str | None, Any]:
    if not isinstance(options, Mapping):
        raise ConfigError(f"field {name!r}: options must be a dict, got {options!r}")
    unknown = set(options) - {"source", "default"}
    if unknown:
        raise ConfigError(f"field {name!r}: unknown options {sorted(unknown)}; "
                          f"known: 'source', 'default'")
    source = options.get("source")
    if source is not None and (not isinstance(source, str) or not all(source_path(source))):
        raise ConfigError(f"field {name!r}: source must be a dotted path like 'user.age' (a "
                          f"key with a dot in its name: 'user\\.age'), got {source!r}")
    return source, options.get("default")


_DOT = re.compile(r"(?<!\\)\.")


def source_path(source: str) -> tuple[str, ...]:
    """A dotted ``source`` as its path of names: ``"user.age"`` is key ``age`` in the
    record ``user``, ``"user\\.age"`` the one key ``user.age`` (a record flattened
    by Kafka Connect's Flatten, say)."""
    return tuple(part.replace("\\.", ".") for part in _DOT.split(source))


def _options(f: Field) -> tuple[dict[str, Any], ...]:
    options = {k: v for k, v in (("source", f.source), ("default", f.default)) if v is not None}
    return (options,) if options else ()


def _as_numpy(f: Field, col: Any) -> np.ndarray:
    """A numpy view of a column (numpy array or CPU tensor), dtype checked."""
    if _is_tensor(col):
        if col.device.type != "cpu":
            raise ConfigError(f"field {f.name!r}: tensors must be on the CPU, got {col.device}")
        if str(col.dtype).removeprefix("torch.") != f.dtype:
            raise ConfigError(f"field {f.name!r}: expected dtype {f.dtype}, got {col.dtype}")
        if f.dtype == "bfloat16":
            import torch

            col = col.view(torch.int16)
        arr = col.detach().numpy()
        return arr.view(f.storage)
    try:
        arr = np.asarray(col)
    except ValueError as e:  # a ragged nested list, say
        raise ConfigError(f"field {f.name!r}: not an array of rows of shape {f.shape} "
                          f"({e})") from None
    if f.dtype == "bfloat16" and arr.dtype.name == "bfloat16" and arr.dtype.itemsize == 2:
        return arr.view(f.storage)  # ml_dtypes' (JAX's) bfloat16: its bits are the storage
    if arr.dtype != f.storage:
        if f.dtype == "bfloat16":
            raise ConfigError(f"field {f.name!r}: expected dtype bfloat16 (a torch.bfloat16 "
                              f"tensor, a numpy array of ml_dtypes' bfloat16, or its bits as "
                              f"uint16), got {arr.dtype}")
        # Never cast here (a cast may lose values), but say how: a Python list of
        # whole numbers is int64 to numpy whatever the field.
        how = (f"np.asarray(values, {f.storage.name!r})" if not isinstance(col, np.ndarray)
               else f".astype({f.storage.name!r})")
        raise ConfigError(f"field {f.name!r}: expected dtype {f.storage}, got {arr.dtype}: "
                          f"convert it first ({how})")
    return arr


def _documents(f: Field, col: Any) -> tuple[np.ndarray, np.ndarray]:
    """A variable-length column as (flat elements, int64 offsets[N + 1]).

    ``col`` is a tuple ``(flat, lengths)``, or a list (any sequence but a
    tuple, or a numpy object array) of 1-D arrays, one per document.
    """
    if isinstance(col, tuple):
        if len(col) != 2:
            raise ConfigError(
                f"field {f.name!r}: a tuple must be (flat, lengths); pass documents as a list"
            )
        flat = _as_numpy(f, col[0])
        if flat.ndim != 1:
            raise ConfigError(f"field {f.name!r}: flat must be 1-D, got shape {flat.shape}")
        lengths = np.asarray(col[1].numpy() if _is_tensor(col[1]) else col[1])
        if lengths.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu"):
            raise ConfigError(f"field {f.name!r}: lengths must be a 1-D array of ints")
        lengths = lengths.astype(np.int64)
        if lengths.size and lengths.min() < 0:
            raise ConfigError(f"field {f.name!r}: lengths must be >= 0")
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] != len(flat):
            raise ConfigError(
                f"field {f.name!r}: lengths add up to {int(offsets[-1])}, flat holds {len(flat)}"
            )
    elif isinstance(col, (list, np.ndarray)) or (
        isinstance(col, Sequence) and not isinstance(col, (str, bytes))
    ):
        if isinstance(col, np.ndarray) and col.dtype != object:
            raise ConfigError(
                f"field {f.name!r}: pass documents as a list of 1-D arrays or as "
                f"(flat, lengths), not one {col.ndim}-D array"
            )
        docs = [_as_numpy(f, d) for d in col]
        for i, d in enumerate(docs):
            if d.ndim != 1:
                raise ConfigError(
                    f"field {f.name!r}: document {i} must be 1-D, got shape {d.shape}"
                )
        lengths = np.fromiter((len(d) for d in docs), np.int64, count=len(docs))
        offsets = np.zeros(len(docs) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate(docs) if docs else np.empty(0, f.storage)
    else:
        raise ConfigError(
            f"field {f.name!r}: expected a list of 1-D arrays or (flat, lengths), "
            f"got {type(col).__name__}"
        )
    if len(lengths) and int(lengths.max()) > _MAX_DOC_ELEMENTS:
        raise ConfigError(f"field {f.name!r}: a document holds at most 2**32-1 elements")
    return np.ascontiguousarray(flat), offsets


def _config_error(e: ValueError) -> ConfigError:
    """The codec's argument errors as ConfigError (the checks here should catch them first)."""
    return e if isinstance(e, ConfigError) else ConfigError(str(e))


def _out_view(f: Field, buf: Any) -> np.ndarray:
    """A numpy view of an output buffer (numpy array or CPU tensor), checked."""
    if _is_tensor(buf):
        if buf.device.type != "cpu":
            raise ConfigError(f"out[{f.name!r}] must be a CPU tensor, got {buf.device}")
        if buf.dtype != f.torch_dtype:
            raise ConfigError(f"out[{f.name!r}]: expected dtype {f.torch_dtype}, got {buf.dtype}")
        if buf.dim() == 0 or tuple(buf.shape[1:]) != f.shape or not buf.is_contiguous():
            raise ConfigError(
                f"out[{f.name!r}] must be contiguous with shape (n, *{f.shape}), got {tuple(buf.shape)}"
            )
        if f.dtype == "bfloat16":  # numpy has no bfloat16: its 2-byte words
            import torch

            buf = buf.view(torch.int16)
        return buf.detach().numpy()
    if not isinstance(buf, np.ndarray):
        raise ConfigError(f"out[{f.name!r}] must be a numpy array or a torch tensor")
    if buf.dtype != f.storage:
        raise ConfigError(f"out[{f.name!r}]: expected dtype {f.storage}, got {buf.dtype}")
    if buf.ndim == 0 or buf.shape[1:] != f.shape or not buf.flags.c_contiguous:
        raise ConfigError(
            f"out[{f.name!r}] must be contiguous with shape (n, *{f.shape}), got {buf.shape}"
        )
    if not buf.flags.writeable:
        raise ConfigError(f"out[{f.name!r}] is read-only")
    return buf
