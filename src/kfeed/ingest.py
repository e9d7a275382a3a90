"""Sample files into columns: the first stage of ``kfeed produce --from``.

In the data flow this sits before the producer::

    .npz / .npy / .parquet  --read_columns-->  {field: numpy array, one row a sample}
                            --schema_for---->  kfeed.Schema
                            --Producer.send->  a topic

(Token corpora take the other road, ``kfeed.text``: documents, not rows.)

Columns become fields by stated rules, so that what reaches the topic is
what the reader expects, or the run stops before sending anything with the
column's name, its type and what to do:

- a column of int8..int64, uint8..uint64, float16/32/64 or bool keeps its
  dtype, one value a sample;
- a fixed-length list column (every row the same length W) of those becomes a
  ``T[W]`` field; ragged or nested lists, strings, timestamps, decimals,
  structs and dictionaries are refused;
- nulls are refused, with their count, unless ``fill`` gives a value;
- ``dtypes`` casts a field (float to int only when every value is whole,
  ints only within the target's range);
- a field named like one ``kfeed train`` reads (``TRAIN_FIELDS``: features
  float32, label int64, id int64) must have that dtype, or ``dtypes`` must
  name one for it: a cast to the train dtype, or its own dtype to keep it on
  purpose. This is what stops list<double> features from becoming float64
  records that ``kfeed train`` rejects one by one.

It knows nothing of Kafka or torch; errors are ``ConfigError``s whose text
names the file, the field and the flag that fixes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kfeed.errors import ConfigError, KfeedError

__all__ = [
    "DEFAULT_FIELDS",
    "DTYPES",
    "SUFFIXES",
    "TRAIN_FIELDS",
    "parse_pairs",
    "read_columns",
    "schema_for",
    "skip_documents",
]

SUFFIXES = (".npz", ".npy", ".parquet")

# What `kfeed train --task mlp` reads; the shape of features is free here.
TRAIN_FIELDS = {"features": "float32", "label": "int64", "id": "int64"}

# Without --field, the columns of these names are read.
DEFAULT_FIELDS = {name: name for name in TRAIN_FIELDS}

# The dtypes a column may keep or be cast to (bfloat16 has no numpy dtype to
# cast through).
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64")


def parse_pairs(items: Iterable[str], flag: str, right: str) -> dict[str, str]:
    """``["a=b", ...]`` from a repeatable ``flag FIELD=right`` option, checked."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag} {item!r} is not FIELD={right}: write it as e.g. "
                              f"{flag} {key or 'features'}={value or right}")
        if key in out:
            raise ConfigError(f"{flag} names field {key!r} twice: give it once")
        out[key] = value
    return out


def read_columns(
    path: str | Path,
    fields: Mapping[str, str] | None = None,
    *,
    dtypes: Mapping[str, str] | None = None,
    fills: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """The columns of a sample file as ``{field: array}``, by the module's rules.

    ``fields`` maps each field to its column (``.parquet``) or array
    (``.npz``; a ``.npy`` holds one array, named after the file's stem);
    by default ``features``, ``label`` and ``id``. ``dtypes`` maps a field to
    a dtype to cast it to; ``fills`` maps a field to the value that replaces
    its nulls (Parquet only).
    """
    path = Path(path)
    fields = dict(fields or DEFAULT_FIELDS)
    dtypes = dict(dtypes or {})
    fills = dict(fills or {})
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(f"--from {path}: samples come from {', '.join(SUFFIXES)}, not "
                          f"{path.suffix or 'a file with no suffix'}: convert it, or give a "
                          f".txt or .jsonl corpus for token documents")
    if not path.is_file():
        raise ConfigError(f"--from {path}: no such file: check the path")
    for flag, given in (("--dtype", dtypes), ("--fill", fills)):
        for name, value in given.items():
            if name not in fields:
                raise ConfigError(f"{flag} {name}={value}: no field {name!r} is read (the fields are "
                                  f"{', '.join(fields)}): name one of them, or add it with "
                                  f"--field {name}=COLUMN")
    for name, dtype in dtypes.items():
        if dtype not in DTYPES:
            raise ConfigError(f"--dtype {name}={dtype}: not a dtype kfeed can cast to: "
                              f"use one of {', '.join(DTYPES)}")
    if fills and suffix != ".parquet":
        raise ConfigError(f"--fill replaces the nulls of Parquet columns; {path.name} has "
                          f"none: leave --fill out")
    if suffix == ".parquet":
        raw = dict(_read_parquet(path, fields, fills))
    else:
        raw = dict(_read_numpy(path, fields))
    out = {name: _settle(path.name, name, fields[name], arr, dtypes.get(name))
           for name, arr in raw.items()}
    counts = {name: len(arr) for name, arr in out.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{n} {c}" for n, c in counts.items())
        raise ConfigError(f"{path.name}: the fields have different row counts ({listed}): "
                          f"every column needs one value per sample")
    return out


def schema_for(columns: Mapping[str, np.ndarray]) -> Any:
    """The schema of columns ``read_columns`` returned: each field's dtype and row shape."""
    from kfeed.schema import Schema

    return Schema({name: (arr.dtype.name, arr.shape[1:]) for name, arr in columns.items()})


# -- numpy files -------------------------------------------------------------------


def _read_numpy(path: Path, fields: Mapping[str, str]) -> Iterator[tuple[str, np.ndarray]]:
    if path.suffix.lower() == ".npy":
        stem = path.stem
        if len(fields) != 1 or next(iter(fields.values())) != stem:
            raise ConfigError(f"{path.name} holds one array, named {stem!r} after the file: map "
                              f"it to one field with --field FIELD={stem} (e.g. --field "
                              f"features={stem})")
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path.name}: not a numpy array file ({e}): check the file") from None
        yield next(iter(fields)), arr
        return
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path.name}: not a numpy .npz file ({e}): check the file") from None
    with data:
        names = list(data.files)
        for name, src in fields.items():
            if src not in names:
                raise ConfigError(f"{path.name} has no array {src!r} for field {name!r} (it has: "
                                  f"{', '.join(names) or 'none'}): map the field with "
                                  f"--field {name}=ARRAY")
            try:
                arr = data[src]
            except ValueError as e:  # an object array: numpy refuses it without pickles
                raise ConfigError(f"{path.name}: array {src!r} (field {name!r}) holds Python "
                                  f"objects ({e}): save it as a numeric array") from None
            yield name, arr


# -- Parquet -----------------------------------------------------------------------


def _read_parquet(path: Path, fields: Mapping[str, str],
                  fills: Mapping[str, str]) -> Iterator[tuple[str, np.ndarray]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path.name}: not a Parquet file ({e}): check the file") from None
    names = pf.schema_arrow.names
    for name, src in fields.items():
        if src not in names:
            raise ConfigError(f"{path.name} has no column {src!r} for field {name!r} (it has: "
                              f"{', '.join(names)}): map the field with --field {name}=COLUMN")
    table = pf.read(columns=sorted(set(fields.values())))
    for name, src in fields.items():
        col = table.column(src).combine_chunks()
        yield name, _arrow_column(path.name, name, src, col, fills.get(name))


def _arrow_column(file: str, name: str, src: str, col: Any, fill: str | None) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    where = f"column {src!r} of {file}"
    kind = col.type
    is_list = (pa.types.is_list(kind) or pa.types.is_large_list(kind)
               or pa.types.is_fixed_size_list(kind))
    value_type = kind.value_type if is_list else kind
    if not _numeric(value_type):
        what = f"list<{value_type}>" if is_list else str(kind)
        raise ConfigError(f"{where} is {what}: kfeed produce sends numbers and fixed-length "
                          f"lists of numbers; leave the column out (--field picks the columns) "
                          f"or convert it to numbers first")
    nulls = col.null_count
    if is_list:
        values = pc.list_flatten(col)
        nulls += values.null_count
    if nulls and fill is None:
        raise ConfigError(f"{where} (field {name!r}) has {nulls} null value(s): give --fill "
                          f"{name}=VALUE to replace them, or drop those rows")
    if not is_list:
        if nulls:
            col = pc.fill_null(col, _fill_scalar(name, fill, kind))
        return np.asarray(col.to_numpy(zero_copy_only=False))
    valid = ~np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    lengths = np.asarray(pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False))
    widths = np.unique(lengths[valid])
    if len(widths) > 1:
        raise ConfigError(f"{where} (field {name!r}) holds lists of different lengths "
                          f"({int(widths[0])} to {int(widths[-1])}): a field needs one "
                          f"length in every row; pad or cut the lists first")
    width = int(widths[0]) if len(widths) else 0
    if values.null_count:
        values = pc.fill_null(values, _fill_scalar(name, fill, value_type))
    flat = np.asarray(values.to_numpy(zero_copy_only=False))
    rows = flat.reshape(int(valid.sum()), width)
    if valid.all():
        return rows
    out = np.full((len(col), width), _fill_scalar(name, fill, value_type).as_py(),
                  dtype=rows.dtype)
    out[valid] = rows
    return out


def _numeric(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind)
                or pa.types.is_boolean(kind))


def _fill_scalar(name: str, fill: Any, kind: Any) -> Any:
    import pyarrow as pa

    try:
        if pa.types.is_boolean(kind):
            if fill.lower() not in ("true", "false", "0", "1"):
                raise ValueError(fill)
            value: Any = fill.lower() in ("true", "1")
        elif pa.types.is_integer(kind):
            value = int(fill)
        else:
            value = float(fill)
        return pa.scalar(value, type=kind)
    except (ValueError, OverflowError, pa.ArrowException):
        raise ConfigError(f"--fill {name}={fill}: not a value of the column's type {kind}: "
                          f"give one (a whole number for an int column)") from None


# -- the dtype rules ---------------------------------------------------------------


def _settle(file: str, name: str, src: str, arr: np.ndarray, cast: str | None) -> np.ndarray:
    """``arr`` as the field's array: dtype checked against the rules, cast if asked."""
    where = f"{src!r} of {file}"
    if arr.ndim == 0:
        raise ConfigError(f"{where} (field {name!r}) is a single value, not one per sample: "
                          f"give an array with a row per sample")
    have = arr.dtype
    if have.name not in DTYPES:
        raise ConfigError(f"{where} (field {name!r}) has dtype {have}, which kfeed cannot send: "
                          f"convert it to one of {', '.join(DTYPES)}")
    if cast is None:
        want = TRAIN_FIELDS.get(name)
        if want is not None and have.name != want:
            raise ConfigError(
                f"{where} (field {name!r}) is {_described(arr)} but kfeed train reads {name} as "
                f"{want}: pass --dtype {name}={want} to cast it, or --dtype {name}={have.name} "
                f"to keep {have.name}")
        return np.ascontiguousarray(arr)
    target = np.dtype(cast)
    if target == have:
        return np.ascontiguousarray(arr)
    if target.kind in "iub" and have.kind == "f":
        whole = np.isfinite(arr) & (arr == np.trunc(arr))
        if not whole.all():
            raise ConfigError(f"--dtype {name}={cast}: {where} holds {int((~whole).sum())} value(s) "
                              f"that are not whole numbers: round them first, or keep {have.name}")
    if target.kind in "iu" and arr.size:
        info = np.iinfo(target)
        low, high = arr.min(), arr.max()
        if low < info.min or high > info.max:
            raise ConfigError(f"--dtype {name}={cast}: {where} holds values {low}..{high}, "
                              f"outside {cast}: pick a wider dtype")
    return np.ascontiguousarray(arr.astype(target))


def _described(arr: np.ndarray) -> str:
    if arr.ndim == 1:
        return arr.dtype.name
    return f"{arr.dtype.name}[{', '.join(str(n) for n in arr.shape[1:])}]"


# -- token documents ---------------------------------------------------------------


def skip_documents(chunks: Iterator[Any], n: int, where: str) -> Iterator[Any]:
    """``chunks`` (``kfeed.text.Chunk``) less their first ``n`` documents."""
    for chunk in chunks:
        if n >= len(chunk):
            n -= len(chunk)
            continue
        if n:
            # Not _replace: Chunk's len() counts documents, which _make trips on.
            sliced = {f: getattr(chunk, f)[n:] for f in ("texts", "ids", "keys")
                      if getattr(chunk, f) is not None}
            chunk = type(chunk)(**{**chunk._asdict(), **sliced})
            n = 0
        yield chunk
    if n:
        raise KfeedError(f"{where}--skip-docs leaves out more documents than there are: "
                         f"give a smaller --skip-docs")
