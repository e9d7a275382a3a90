"""Schemas: named fixed-shape fields, and the entry points of the codec.

A ``Schema`` sits at both ends of the data flow. The producer encodes columns
of samples into message values with it; the loader decodes message values into
the buffer pool with it. The byte layout lives in ``ext/_codec.pyx`` and is
documented in docs/FORMAT.md; this module checks arguments and turns arrays
and tensors into the raw pointers the codec works on.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, NamedTuple

import numpy as np

from kfeed import _codec
from kfeed.errors import ConfigError

__all__ = ["Schema", "Field", "DecodeResult", "Format"]

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


class Format(str, Enum):
    """How records are laid out in message values (docs/FORMAT.md)."""

    BLOCK = "block"
    RAW = "raw"

    @classmethod
    def parse(cls, value: str | Format) -> Format:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"format must be 'block' or 'raw', got {value!r}") from None


class Field(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype of the bytes on the wire and in numpy outputs."""
        return _STORAGE[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of one record's value of this field."""
        return self.storage.itemsize * math.prod(self.shape)

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


class Target(NamedTuple):
    """Output buffers bound once: raw pointers, capacity, and the owners."""

    pointers: np.ndarray
    capacity: int
    owners: tuple[Any, ...]


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch")


class Schema:
    """Named fixed-shape fields of numpy dtypes, in declared order.

    >>> s = Schema({"features": ("float32", (768,)), "label": ("int64", ())})
    >>> s.record_size
    3080
    """

    __slots__ = ("fields", "record_size", "fingerprint", "_layout", "_by_name")

    def __init__(self, fields: Mapping[str, tuple[str, Sequence[int]]]) -> None:
        if isinstance(fields, Schema):
            fields = fields.to_dict()
        if not isinstance(fields, Mapping) or not fields:
            raise ConfigError("a schema needs at least one field, as {name: (dtype, shape)}")
        parsed = []
        for name, spec in fields.items():
            parsed.append(_parse_field(name, spec))
        self.fields: tuple[Field, ...] = tuple(parsed)
        self._by_name = {f.name: f for f in self.fields}
        self.record_size = sum(f.nbytes for f in self.fields)
        canonical = json.dumps(
            [[f.name, f.dtype, list(f.shape)] for f in self.fields], separators=(",", ":")
        )
        digest = hashlib.blake2b(
            b"kfeed.schema.v1:" + canonical.encode(), digest_size=8
        ).digest()
        self.fingerprint = int.from_bytes(digest, "little")
        self._layout = _codec.Layout([f.nbytes for f in self.fields], self.fingerprint)

    # -- description ---------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def __getitem__(self, name: str) -> Field:
        return self._by_name[name]

    def __len__(self) -> int:
        return len(self.fields)

    def to_dict(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {f.name: (f.dtype, f.shape) for f in self.fields}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and other.fields == self.fields

    def __hash__(self) -> int:
        return hash(self.fields)

    def __repr__(self) -> str:
        return f"Schema({self.to_dict()!r})"

    def block_nbytes(self, count: int) -> int:
        """Size of a block message value holding ``count`` records."""
        return self._layout.block_nbytes(count)

    # -- encode --------------------------------------------------------------

    def _columns(self, columns: Mapping[str, Any]) -> tuple[list[np.ndarray], int, list[Any]]:
        """Check columns against the schema; give flat uint8 views and N."""
        if not isinstance(columns, Mapping):
            raise ConfigError("columns must be a mapping of field name -> array")
        extra = set(columns) - set(self._by_name)
        if extra:
            raise ConfigError(f"columns not in the schema: {sorted(extra)}")
        views, owners, n = [], [], None
        for f in self.fields:
            if f.name not in columns:
                raise ConfigError(f"field {f.name!r} is missing from the columns")
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
            arr = np.ascontiguousarray(arr)
            owners.append(arr)
            views.append(arr.reshape(-1).view(np.uint8))
        return views, int(n or 0), owners

    def encode_blocks(self, columns: Mapping[str, Any], block_records: int = 64) -> list[bytes]:
        """Pack N samples into block values of at most ``block_records`` each."""
        if not isinstance(block_records, int) or not 1 <= block_records <= 0xFFFFFFFF:
            raise ConfigError(f"block_records must be a positive int, got {block_records!r}")
        views, n, _owners = self._columns(columns)
        return _codec.encode_blocks(self._layout, views, n, block_records)

    def encode_block(self, columns: Mapping[str, Any]) -> bytes:
        """All N samples as one block value."""
        views, n, _owners = self._columns(columns)
        if n == 0:
            return self._empty_block()
        if n > 0xFFFFFFFF:
            raise ConfigError(f"a block holds at most 2**32-1 records, got {n}")
        return _codec.encode_blocks(self._layout, views, n, n)[0]

    def _empty_block(self) -> bytes:
        # Valid but holds nothing; the codec only writes blocks of >= 1 record.
        header = bytearray(32)
        header[0:4] = b"KFDB"
        header[4] = 1
        header[6] = 32
        header[16:24] = self.fingerprint.to_bytes(8, "little")
        return bytes(header)  # body length 0

    def encode_raw(self, columns: Mapping[str, Any]) -> list[bytes]:
        """One raw value per sample: the fields concatenated in schema order."""
        views, n, _owners = self._columns(columns)
        return _codec.encode_raw(self._layout, views, n)

    # -- decode --------------------------------------------------------------

    def empty(self, n: int, *, like: str = "numpy", pin_memory: bool = False) -> dict[str, Any]:
        """Uninitialised output buffers for ``n`` records: numpy or torch."""
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
        """Check output buffers once and keep their pointers for many decodes."""
        if not isinstance(out, Mapping):
            raise ConfigError("out must be a mapping of field name -> array or tensor")
        pointers = np.empty(len(self.fields), np.uint64)
        capacity = None
        owners = []
        for i, f in enumerate(self.fields):
            if f.name not in out:
                raise ConfigError(f"field {f.name!r} is missing from out")
            buf = out[f.name]
            pointers[i], rows = _out_pointer(f, buf)
            if capacity is None:
                capacity = rows
            elif rows != capacity:
                raise ConfigError(f"out[{f.name!r}] has {rows} rows, other fields have {capacity}")
            owners.append(buf)
        return Target(pointers, int(capacity or 0), tuple(owners))

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
        target = out if isinstance(out, Target) else self.bind(out)
        fmt = Format.parse(format)
        if not isinstance(row, int) or not 0 <= row <= target.capacity:
            raise ConfigError(f"row must be in 0..{target.capacity}, got {row!r}")
        if not isinstance(start, int) or start < 0 or (start and fmt is Format.RAW):
            raise ConfigError(f"start must be 0 for raw values and >= 0 for blocks, got {start!r}")
        rows, consumed, partial, bad = _codec.decode(
            self._layout,
            values,
            target.pointers,
            target.capacity,
            row,
            fmt is Format.BLOCK,
            start,
            split,
        )
        return DecodeResult(rows, consumed, bad, partial)


def _parse_field(name: object, spec: object) -> Field:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"field names must be non-empty strings, got {name!r}")
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise ConfigError(f"field {name!r}: expected (dtype, shape), got {spec!r}")
    dtype, shape = spec
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
        raise ConfigError(f"field {name!r}: variable-length dimensions are not supported yet")
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in shape):
        raise ConfigError(f"field {name!r}: shape must be a tuple of ints, got {shape!r}")
    if any(d <= 0 for d in shape):
        raise ConfigError(f"field {name!r}: dimensions must be positive, got {tuple(shape)}")
    return Field(name, dtype, tuple(int(d) for d in shape))


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
    arr = np.asarray(col)
    if arr.dtype != f.storage:
        raise ConfigError(f"field {f.name!r}: expected dtype {f.storage}, got {arr.dtype}")
    return arr


def _out_pointer(f: Field, buf: Any) -> tuple[int, int]:
    """Address of row 0 of an output buffer, and its row count."""
    if _is_tensor(buf):
        if buf.device.type != "cpu":
            raise ConfigError(f"out[{f.name!r}] must be a CPU tensor, got {buf.device}")
        if buf.dtype != f.torch_dtype:
            raise ConfigError(f"out[{f.name!r}]: expected dtype {f.torch_dtype}, got {buf.dtype}")
        if buf.dim() == 0 or tuple(buf.shape[1:]) != f.shape or not buf.is_contiguous():
            raise ConfigError(
                f"out[{f.name!r}] must be contiguous with shape (n, *{f.shape}), got {tuple(buf.shape)}"
            )
        return buf.data_ptr(), int(buf.shape[0])
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
    return buf.__array_interface__["data"][0], int(buf.shape[0])
