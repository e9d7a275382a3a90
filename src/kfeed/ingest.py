"""Sample files into columns: the first stage of ``kfeed produce --from``.

In the data flow this sits before the producer::

    .npz / .npy / .parquet / ... / s3:// / postgresql://
        --open_rows------>  Rows: a batch of rows at a time, in the same order each run
        --batch_columns-->  {field: numpy array, one row a sample}
        --schema_for----->  kfeed.Schema
        --Producer.send-->  a topic, in transactions that record the rows sent
                            (``kfeed.resume``; the CLI's ``_send_stream``)

(Token corpora take the other road, ``kfeed.text``: documents, not rows.)

Columns become fields by stated rules, so that what reaches the topic is
what the reader expects, or the run stops with the column's name, its type
and what to do (before anything is sent when the mistake shows in the first
batch; else after the rows before it, which a ``--resume`` goes on after):

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

A numpy array of more than two dimensions keeps its row shape (``T[H, W]``).
It knows nothing of Kafka or torch; errors are ``ConfigError``s whose text
names the file, the field and the flag that fixes it.
"""

from __future__ import annotations

import bisect
import contextlib
import fnmatch
import hashlib
import itertools
import os
import re
import socket
import threading
import time
import urllib.parse
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kfeed.errors import ConfigError, KfeedError, first_line

__all__ = [
    "DATASET_FORMATS",
    "DEFAULT_FIELDS",
    "DTYPES",
    "SUFFIXES",
    "TRAIN_FIELDS",
    "NumpyRows",
    "ReadAhead",
    "Rows",
    "batch_columns",
    "is_stream",
    "no_password",
    "not_samples",
    "open_rows",
    "parse_pairs",
    "read_columns",
    "same_schema",
    "schema_for",
    "skip_documents",
    "source_key",
    "stream_fields",
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

    ``fields`` maps each field to its column (Parquet, Arrow, CSV, JSON Lines) or array
    (``.npz``; a ``.npy`` holds one array, named after the file's stem);
    by default ``features``, ``label`` and ``id``. ``dtypes`` maps a field to
    a dtype to cast it to; ``fills`` maps a field to the value that replaces
    its nulls (a numpy file has none). The file is read as ``kfeed produce``
    streams it (``open_rows``), every batch at once.
    """
    path = Path(path)
    if path.suffix.lower() not in (*SUFFIXES, *DATASET_FORMATS) or not path.is_file():
        raise not_samples(str(path))
    dtypes, fills = dict(dtypes or {}), dict(fills or {})
    given = dict(fields or {})
    rows = open_rows(str(path), column_types={given.get(f, f): d for f, d in dtypes.items()})
    try:
        fields = stream_fields(rows, fields, dtypes, fills)
        parts: list[dict[str, np.ndarray]] = []
        for batch in rows.batches(sorted(set(fields.values()))):
            first = schema_for(parts[0]) if parts else None
            parts.append(batch_columns(path.name, batch, fields, dtypes, fills, first))
    finally:
        rows.close()
    if not parts:
        raise ConfigError(f"{path.name} holds no rows: nothing to read")
    for part in parts[1:]:
        same_schema(schema_for(parts[0]), part, path.name)
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def not_samples(source: str) -> ConfigError:
    """The mistake of a ``--from`` that names no sample file kfeed reads."""
    path = Path(source)
    if not path.exists():
        return ConfigError(f"--from {path}: no such file: check the path")
    known = ", ".join(dict.fromkeys([*SUFFIXES, *DATASET_FORMATS]))
    return ConfigError(f"--from {path}: samples come from {known} files (.jsonl with "
                       f"--field), a folder or a glob of them, not "
                       f"{path.suffix or 'a file with no suffix'}: convert it, or give a "
                       f".txt or .jsonl corpus for token documents")


def field_order(fields: Mapping[str, str]) -> dict[str, str]:
    """``fields`` ({field: column}) in the order records hold them: those ``kfeed
    train`` reads first, as it reads them (features, label, id), then the
    others as given. The order of the --field flags is not the records'
    (the schema's fingerprint depends on it): given id first, every record
    was refused by kfeed train."""
    return {**{name: fields[name] for name in TRAIN_FIELDS if name in fields}, **fields}


def schema_for(columns: Mapping[str, np.ndarray]) -> Any:
    """The schema of columns (``batch_columns``, ``read_columns``): each field's dtype and
    row shape."""
    from kfeed.schema import Schema

    return Schema({name: (arr.dtype.name, arr.shape[1:]) for name, arr in columns.items()})


# -- Arrow columns ------------------------------------------------------------------


def _element_type(kind: Any) -> tuple[bool, Any]:
    """Whether an Arrow type is a list (of any kind), and the type of its elements (or itself)."""
    import pyarrow as pa

    is_list = (pa.types.is_list(kind) or pa.types.is_large_list(kind)
               or pa.types.is_fixed_size_list(kind))
    return is_list, kind.value_type if is_list else kind


def _arrow_column(file: str, name: str, src: str, col: Any, fill: str | None) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    where = f"column {src!r} of {file}"
    kind = col.type
    is_list, value_type = _element_type(kind)
    if pa.types.is_null(value_type) and fill is not None:
        # Only nulls (an empty CSV column reads so): the fill's own type, which --dtype may cast.
        value_type = _fill_type(name, fill)
        col = col.cast(pa.list_(value_type) if is_list else value_type)
        kind = col.type
    if not _numeric(value_type) and not pa.types.is_null(value_type):
        what = f"list<{value_type}>" if is_list else str(kind)
        raise ConfigError(f"{where} is {what}: kfeed produce sends numbers and fixed-length "
                          f"lists of numbers; leave the column out (--field picks the columns) "
                          f"or convert it to numbers first")
    nulls = col.null_count
    if is_list:
        values = pc.list_flatten(col)
        nulls += values.null_count
    if nulls and fill is None:
        # (A CSV's nan is one: many writers mean a missing value by it.)
        what = " (an empty cell, NA, NULL or nan)" if file.lower().endswith(".csv") else ""
        raise ConfigError(f"{where} (field {name!r}) has {nulls} null value(s){what}: give "
                          f"--fill {name}=VALUE to replace them, or drop those rows")
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
    if not len(widths):
        raise ConfigError(f"{where} (field {name!r}) holds only null lists: their length, "
                          f"which the field needs, is unknown; drop the column or its rows")
    width = int(widths[0])
    if not width:
        raise ConfigError(f"{where} (field {name!r}) holds only empty lists: a field needs an "
                          f"element a row at least; leave the column out (--field picks the "
                          f"columns) or fill the lists first")
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


def _fill_type(name: str, fill: str) -> Any:
    """The type a --fill value reads as on its own: bool, int64 or float64."""
    import pyarrow as pa

    if fill.lower() in ("true", "false"):
        return pa.bool_()
    for parse, kind in ((int, pa.int64()), (float, pa.float64())):
        try:
            parse(fill)
            return kind
        except ValueError:
            pass
    raise ConfigError(f"--fill {name}={fill}: not a number, and the column holds only nulls: "
                      f"give a number, or true or false")


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
    if not arr.dtype.isnative:  # a big-endian .npy: the same values, in this machine's order
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if 0 in arr.shape[1:]:
        raise ConfigError(f"{where} (field {name!r}) has rows of shape {arr.shape[1:]}, which "
                          f"hold no value: a field needs an element a row at least")
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
    if target.kind in "iub" and arr.size:
        info = np.iinfo(target) if target.kind != "b" else np.iinfo(np.uint8)
        top = info.max if target.kind != "b" else 1
        # Python ints: compared exactly (a float's whole values, checked above, not as
        # floats, where 2**63 - 1 rounds up to 2**63), and abs() of int64's least is no
        # overflow.
        low, high = int(arr.min()), int(arr.max())
        # (past 20 digits, as a float: not a 300-digit integer)
        shown = "..".join(f"{v:.6g}" if abs(v) >= 10**20 else str(v) for v in (low, high))
        if low < info.min or high > top:
            raise ConfigError(f"--dtype {name}={cast}: {where} holds values {shown}, "
                              f"outside {cast if target.kind != 'b' else 'bool (0 or 1)'}: "
                              f"pick a wider dtype")
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(arr.astype(target))
    if target.kind == "f" and have.kind == "f":
        over = np.isinf(out) & np.isfinite(arr)
        if over.any():
            raise ConfigError(f"--dtype {name}={cast}: {where} holds {int(over.sum())} value(s) "
                              f"past {cast}'s range (up to {np.finfo(target).max:g}): pick a "
                              f"wider dtype")
    elif target.kind == "f" and have.kind in "iu":
        with np.errstate(invalid="ignore"):
            inexact = out.astype(have) != arr
        if inexact.any():
            raise ConfigError(f"--dtype {name}={cast}: {where} holds {int(inexact.sum())} "
                              f"value(s) that {cast} cannot hold exactly (integers past "
                              f"2**{np.finfo(target).nmant + 1}): pick a wider dtype")
    return out


def _described(arr: np.ndarray) -> str:
    if arr.ndim == 1:
        return arr.dtype.name
    return f"{arr.dtype.name}[{', '.join(str(n) for n in arr.shape[1:])}]"


# -- rows streamed from files, object stores and databases --------------------------

# File suffixes a dataset is read by, and pyarrow.dataset's name of each format.
DATASET_FORMATS = {".parquet": "parquet", ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc",
                   ".csv": "csv", ".jsonl": "json", ".ndjson": "json"}
_GLOB = "*?["
# Files up to this size are looked into for blank lines only (_blank): one
# read each as the folder is listed, a request each in an object store, so
# only for files too small to hold more than a row or two.
_BLANK_BYTES = 256


def _is_glob(source: str) -> bool:
    """Whether ``source`` is a pattern: it holds ``*?[`` and names no path (a file or
    folder whose name holds them is read as named)."""
    return any(c in source for c in _GLOB) and not Path(source).exists()

# Rows a batch holds at most as it leaves the reader: one producer call.
STREAM_BATCH_ROWS = 65536
# ... and at most about this many bytes, where the rows' size is known (one row at least).
STREAM_BATCH_BYTES = 64 << 20
# Batches pyarrow decodes ahead of the one taken (besides ReadAhead's queue).
READ_AHEAD_BATCHES = 1
# The bytes of a batch of a query's result, as the ADBC driver streams it.
QUERY_BATCH_BYTES = 4 << 20


def is_stream(source: str | None, query: str | None, fields_given: bool) -> bool:
    """Whether ``--from`` names rows read through pyarrow (or a database) a batch at a time.

    A URI (``s3://``, ``gs://``, ``hdfs://``, ``file://``, ``postgresql://``), a
    directory, a glob, or a file of a suffix in ``DATASET_FORMATS`` or ``SUFFIXES``
    (numpy files, through ``NumpyRows``). ``.jsonl``
    is a token corpus unless ``--field`` maps its keys to fields (``.ndjson``
    never is one).
    """
    if query is not None:
        return True
    if source is None:
        return False
    if "://" in source or Path(source).is_dir():
        return True
    if _is_glob(source):
        return True
    suffix = Path(source).suffix.lower()
    if suffix == ".jsonl":
        return fields_given
    return suffix in DATASET_FORMATS or suffix in SUFFIXES


# How long a GCS request is retried unless the URI says (retry_limit_seconds=).
GCS_RETRY_S = 60
# The options of a gs:// URI, as pyarrow's GcsFileSystem takes them, and anonymous.
_GCS_OPTIONS = {"endpoint_override": str, "scheme": str, "retry_limit_seconds": float,
                "project_id": str}


def remote_filesystem(base: str, query: str) -> tuple[Any, str]:
    """pyarrow's file system for the URI ``base?query``, and the path in it.

    pyarrow reads a URI's options from its query. ``gs://`` is made here
    (``_gcs``) and ``hdfs://`` may be (``_hdfs``); the rest is pyarrow's.
    """
    import pyarrow.fs as pafs

    if base.startswith("hdfs://"):
        return _hdfs(base, query)
    if base.startswith("gs://"):
        return _gcs(base, urllib.parse.parse_qs(query, keep_blank_values=True))
    return pafs.FileSystem.from_uri(f"{base}?{query}" if query else base)


def _gcs(base: str, params: dict[str, list[str]]) -> tuple[Any, str]:
    """pyarrow's ``GcsFileSystem`` with a gs:// URI's options, and two of kfeed's own.

    ``anonymous=true`` (pyarrow's GCS URIs have no such option): a public
    bucket, or a GCS emulator, read without Google credentials, which pyarrow
    otherwise looks for (and on a machine without them, asks the cloud
    metadata server for). And a request is retried for ``GCS_RETRY_S``
    unless ``retry_limit_seconds`` says: pyarrow's client, left to its
    default, retries for minutes (still at it after 2 here), so a wrong or
    dead endpoint looks like a hang.
    """
    import datetime

    import pyarrow.fs as pafs

    flag = params.pop("anonymous", ["false"])[-1].lower()
    if flag not in ("true", "false"):
        raise ConfigError(f"--from {base}: anonymous={flag!r}: say true or false")
    options: dict[str, Any] = {}
    for key, values in params.items():
        kind = _GCS_OPTIONS.get(key)
        if kind is None:
            raise ConfigError(f"--from {base}: unknown option {key!r} for gs://; known: "
                              f"anonymous, {', '.join(_GCS_OPTIONS)}")
        try:
            options[key] = kind(values[-1])
        except ValueError:
            raise ConfigError(f"--from {base}: {key}={values[-1]!r} is not a number") from None
    options["retry_time_limit"] = datetime.timedelta(
        seconds=options.pop("retry_limit_seconds", GCS_RETRY_S))
    return pafs.GcsFileSystem(anonymous=flag == "true", **options), base[len("gs://"):]


def _hdfs(base: str, query: str) -> tuple[Any, str]:
    """HDFS through pyarrow's ``HadoopFileSystem`` (Hadoop's libhdfs), else hdfs-native.

    pyarrow needs a JVM and libhdfs from a Hadoop installation on the
    client; without them, the hdfs-native package (a client of HDFS's own
    protocol, ``pip install 'kfeed[hdfs]'``) reads the same URIs through
    pyarrow's fsspec bridge. It takes its settings from ``HADOOP_CONF_DIR``,
    not from the URI.
    """
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(f"{base}?{query}" if query else base)
    except OSError as e:  # no JVM or no libhdfs here
        why = first_line(e)
    try:
        from hdfs_native.fsspec import HdfsFileSystem
    except ImportError:
        raise ConfigError(f"--from {base}: pyarrow reads hdfs:// through Hadoop's libhdfs and "
                          f"cannot load it here ({why}): set JAVA_HOME, HADOOP_HOME and "
                          f"CLASSPATH as pyarrow's HadoopFileSystem asks, or install "
                          f"hdfs-native (pip install 'kfeed[hdfs]')") from None
    if query:
        raise ConfigError(f"--from {base}?{query}: the options of an hdfs:// URI are libhdfs' "
                          f"(not loadable here: {why}); hdfs-native takes its settings from "
                          f"HADOOP_CONF_DIR: leave the query out")
    where = urllib.parse.urlsplit(base)
    if where.hostname and where.port:
        # hdfs-native retries a NameNode that refuses without end: ask first.
        try:
            socket.create_connection((where.hostname, where.port), timeout=10).close()
        except OSError as e:
            raise ConfigError(f"--from {base}: no NameNode answers at {where.hostname}:"
                              f"{where.port} ({e}): check the address") from None
    fs = HdfsFileSystem(host=where.hostname, port=where.port)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), where.path or "/"


class Rows:
    """A source's rows, a ``pyarrow.RecordBatch`` at a time, always in the same order.

    ``name`` names it in messages (a file's name, the query's database);
    ``where`` the file the latest batch came from, where there are several.
    ``batches(columns, skip)`` reads only ``columns`` and leaves out the first
    ``skip`` rows (a resume): files wholly before them are not opened when
    their row counts are in their metadata (Parquet, Arrow), the rest are
    read and dropped. ``total`` is the row count when known without reading.
    """

    name = ""
    where = ""  # the file the latest batch came from (for messages), if files
    total: int | None = None
    schema: Any = None  # the pyarrow schema of the rows
    nulls = True  # whether a column may hold nulls (--fill)

    def names(self) -> list[str]:
        raise NotImplementedError

    def no_column(self, name: str, src: str) -> ConfigError:
        """The mistake of field ``name`` read from ``src``, which the rows do not have."""
        return ConfigError(f"{self.name} has no column {src!r} for field {name!r} (it has: "
                           f"{', '.join(self.names())}): map the field with --field "
                           f"{name}=COLUMN")

    def batches(self, columns: list[str], skip: int = 0) -> Iterator[Any]:
        raise NotImplementedError

    def mark(self, rows: int) -> str | None:
        """What must not change for a resume after ``rows`` rows to be exact (None: a
        query, whose ORDER BY is the user's to keep)."""
        return None

    def check_mark(self, mark: str | None, rows: int) -> None:
        """Refuse to resume after ``rows`` rows where ``mark`` no longer holds."""

    def cancel(self) -> None:
        """Stop a read under way, from another thread, where the source can."""

    def close(self) -> None:
        pass


class DatasetRows(Rows):
    """Files through ``pyarrow.fs`` and ``pyarrow.dataset``: one, a directory or a glob."""

    def __init__(self, source: str, column_types: Mapping[str, str] | None = None) -> None:
        import pyarrow as pa
        import pyarrow.dataset as ds
        import pyarrow.fs as pafs

        self.source = source
        self._ends: list[int] = []  # where each file read so far ends, in rows
        # Per file: its size and modification time (ns; None where the file
        # system keeps none), which a rewrite changes (``mark``).
        self._stamps: dict[str, tuple[int, int | None]] = {}
        said = shown(source)  # in messages: no credentials
        base, params = split_params(source)
        cut = min((base.find(c) for c in _GLOB if c in base), default=-1)
        if cut >= 0 and "://" not in base and os.path.exists(base):
            cut = -1  # a local file or folder whose name has [, ? or *: that one
        pattern = None
        if cut >= 0:  # a glob: list the folder before its first wildcard
            slash = base.rfind("/", 0, cut) + 1
            # ... past local folders whose names hold one (run[2024]/*.parquet).
            while "://" not in base and (end := base.find("/", slash)) > 0 \
                    and os.path.isdir(base[:end]):
                slash = end + 1
            pattern = base[slash:]
            base = base[:slash] or "."
        remote = "://" in base
        try:
            if remote:
                fs, path = remote_filesystem(base, params)
            else:
                # Links resolved, as the job's key has them (``source_key``): the
                # files' names go in its marks, which a resume through a link checks.
                fs, path = pafs.LocalFileSystem(), os.path.realpath(base)
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.File and pattern is None:
                if info.size == 0 or _blank(fs, path, info.size):
                    raise ConfigError(f"--from {said}: an empty file"
                                      f"{' (only blank lines)' if info.size else ''}, which "
                                      f"holds no rows: check the path")
                files = [path]
                self._stamps = {path: _stamp(info)}
            elif info.type == pafs.FileType.Directory:
                found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
                # As pyarrow's own discovery: no file whose name, or any folder's
                # below the one listed, starts with "_" or "." (a writer's
                # _temporary/ or .staging/ files, _SUCCESS, .crc).
                top = path.rstrip("/") + "/"
                # (An empty file holds no rows: pyarrow refuses an empty CSV or
                # JSON file, or one of blank lines, and one of a folder's would
                # stop the run.)
                kept = [f for f in found if f.type == pafs.FileType.File and f.size != 0
                        and not _hidden(f.path[len(top):] if f.path.startswith(top)
                                        else Path(f.path).name)
                        and not _blank(fs, f.path, f.size)]
                files = sorted(f.path for f in kept)
                self._stamps = {f.path: _stamp(f) for f in kept}
            else:
                raise ConfigError(f"--from {said}: no such file or directory: check the path")
        except ConfigError:
            raise
        except (pa.ArrowException, OSError, ValueError) as e:
            raise ConfigError(f"--from {said}: cannot open it ({first_line(e)}): check the "
                              f"address, and for object stores the endpoint, region and "
                              f"credentials (as pyarrow takes them)") from None
        if pattern is not None:
            # The pattern in the file system's own paths ("bucket/key" for a URI).
            want = f"{path.rstrip('/')}/{pattern}"
            files = [f for f in files if _glob_match(f, want)]
        kinds = {DATASET_FORMATS.get(Path(f).suffix.lower()) for f in files}
        if not files:
            raise ConfigError(f"--from {said}: no files there"
                              f"{' match the pattern' if pattern else ''}: check the path")
        if None in kinds or len(kinds) > 1:
            suffixes = sorted({Path(f).suffix or "(none)" for f in files})
            corpus = (": a text corpus is one file, --from corpus.txt (documents "
                      "separated by blank lines)" if ".txt" in suffixes else "")
            if {".npz", ".npy"} & set(suffixes):
                corpus = (": a numpy file is read on its own, --from FILE.npz (join the "
                          "arrays into one file, or write the rows as Parquet files)")
            raise ConfigError(f"--from {said}: the files are {', '.join(suffixes)}: a run "
                              f"reads one format, one of {', '.join(DATASET_FORMATS)}{corpus}")
        self.format = kinds.pop()
        self.files = files
        self.name = Path(files[0]).name if len(files) == 1 else said
        self._given: set[str] = set()
        try:
            lists: set[str] = set()
            if self.format == "json" and column_types:
                # A list column's --dtype is its elements' (as the first rows have it).
                guessed = ds.dataset(files, filesystem=fs, format="json").schema
                lists = {c for c in column_types
                         if c in guessed.names and _element_type(guessed.field(c).type)[0]}
            fmt, types = _file_format(self.format, column_types or {}, lists)
            # The Arrow types --dtype gave (a value they do not read is not a guess).
            self._given = {str(t) for t in types.values()}
            self.dataset = ds.dataset(files, filesystem=fs, format=fmt)
            schema = self.dataset.schema
            self._scan_schema = None
            if self.format == "json" and types:
                # A JSON dataset guesses its schema from the first block, whatever the
                # parse options say: the columns' types go in the dataset's schema.
                schema = pa.schema([pa.field(f.name, types.get(f.name, f.type)) for f in schema])
                self.dataset = ds.dataset(files, filesystem=fs, format=fmt, schema=schema)
                self._scan_schema = schema
        except (pa.ArrowException, OSError) as e:
            why = first_line(e)
            if self.format in ("csv", "json") and _another_kind(why):
                # A value in the first block that the column's type does not read.
                raise _kind_error(self.name, why, self._given) from None
            raise ConfigError(f"{self.name}: not {_FILE_KINDS[self.format]} ({why}): "
                              f"check the file") from None
        if self.format in ("parquet", "ipc"):
            fragments = list(self.dataset.get_fragments())
            counts = [self._count(f) for f in fragments]
            self.total = sum(counts)
            # pyarrow takes a dataset's columns from its first file, and a file
            # of no rows may lack some of the others' (it is left out): the first
            # file with rows says them then.
            if counts and not counts[0] and self.total:
                schema = next(f for f, n in zip(fragments, counts) if n).physical_schema
                self.dataset = ds.dataset(files, filesystem=fs, format=fmt, schema=schema)
        self.schema = schema

    def mark(self, rows: int) -> str | None:
        """The files wholly or partly in the first ``rows`` rows, as ``N:digest`` of their
        names, sizes and modification times: a file added, removed or changed among
        them moves what the row count skips (a file added before the end sent it twice
        and skipped another; one rewritten at the same size, its first rows twice and
        its last never)."""
        done = bisect.bisect_right(self._ends, rows)  # files whose every row is sent
        partly = rows > (self._ends[done - 1] if done else 0) and done < len(self.files)
        n = done + int(partly)
        return f"{n}:{self._digest(n)}"

    def check_mark(self, mark: str | None, rows: int) -> None:
        if not mark:
            return  # (progress recorded before marks were)
        n, _, digest = mark.partition(":")
        if not n.isdigit() or int(n) > len(self.files) or \
                digest not in (self._digest(int(n)), self._digest(int(n), times=False)):
            raise ConfigError(
                f"--resume: --from {shown(self.source)} changed since the {rows:,} rows were "
                f"sent (a file added, removed or changed among the ones they came from): "
                f"skipping {rows:,} rows would send some twice and others never; send it "
                f"whole with --resend (to a new topic, or after deleting this one's records), "
                f"or put new files in a folder of their own")

    def _digest(self, n: int, times: bool = True) -> str:
        """Of the first ``n`` files; ``times=False``: as marks recorded before kfeed kept
        the modification times were (names and sizes)."""
        text = "\0".join(f"{f}\0{self._stamps[f][0]}" + (f"\0{self._stamps[f][1]}" if times
                                                          else "")
                         for f in self.files[:n])
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def _count(self, fragment: Any) -> int:
        """``fragment``'s rows, from its metadata; a file that is not what its name says
        is a ConfigError naming it."""
        import pyarrow as pa

        try:
            return int(fragment.count_rows())
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(f"{Path(fragment.path).name}: not {_FILE_KINDS[self.format]} "
                              f"({first_line(e)}): check the file") from None

    def names(self) -> list[str]:
        return list(self.schema.names)

    def batches(self, columns: list[str], skip: int = 0) -> Iterator[Any]:
        fragments = list(self.dataset.get_fragments())
        self._ends = []
        if self.format in ("parquet", "ipc"):  # files wholly skipped, by their metadata
            while skip and fragments:
                n = self._count(fragments[0])
                if n > skip:
                    break
                skip -= n
                fragments.pop(0)
                self._ends.append((self._ends[-1] if self._ends else 0) + n)
        yield from _skip_rows(self._read(fragments, columns), skip,
                              f"--from {shown(self.source)}: it holds fewer rows than the "
                              f"{{}} more that --resume would leave out: it changed since the "
                              f"last run")

    def _read(self, fragments: list[Any], columns: list[str]) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.dataset as ds

        # pyarrow's scan reads ahead on its own threads: up to 16 batches,
        # and for Parquet a whole file's column chunks at once (pre_buffer),
        # all held while the producer waits on the brokers (2.7 GB seen for
        # 17 MB batches; 1.2 GB still with the read-aheads at 1). Here it
        # decodes on ReadAhead's thread, whose one batch ahead is all the
        # reading ahead, so memory stays a few batches whatever the file's
        # size; on two cores it also read 1.2 GB/s against 0.75-0.95 with threads.
        options = ds.ParquetFragmentScanOptions(pre_buffer=False) \
            if self.format == "parquet" else None
        for fragment in fragments:
            self.where = Path(fragment.path).name
            try:
                missing = [c for c in columns if c not in fragment.physical_schema.names]
            except (pa.ArrowException, OSError) as e:
                raise KfeedError(f"{self.where}: {first_line(e)}") from None
            rows = self._ends[-1] if self._ends else 0
            if missing and self.format in ("parquet", "ipc") and not self._count(fragment):
                self._ends.append(rows)  # no rows, so no value is missing (a writer's empty part)
                continue
            if missing:
                raise ConfigError(f"{self.where} has no column {missing[0]!r}, which the files "
                                  f"before it have: give every file the same columns")
            try:
                # In the file's order: a resume counts on it.
                for batch in fragment.to_batches(columns=columns,
                                                 batch_size=_rows_a_batch(self.schema, columns),
                                                 batch_readahead=READ_AHEAD_BATCHES,
                                                 fragment_readahead=1,
                                                 fragment_scan_options=options,
                                                 use_threads=False, schema=self._scan_schema):
                    rows += batch.num_rows
                    yield batch
            except (pa.ArrowException, OSError) as e:
                why = first_line(e)
                if self.format in ("csv", "json") and _another_kind(why):
                    # A type kfeed will not guess at: a mistake in the command
                    # (exit 2) while nothing is sent, else a failure that says
                    # how many rows were (cli._send_stream).
                    raise _kind_error(Path(fragment.path).name, why, self._given) from None
                raise KfeedError(f"{Path(fragment.path).name}: {why}") from None
            self._ends.append(rows)  # where each file ends, in rows (mark)


def _another_kind(why: str) -> bool:
    """Whether pyarrow's error ``why`` is a CSV or JSON value its column's type does not read."""
    return any(says in why for says in ("conversion error", "changed from",
                                        "Failed to convert JSON"))


def _kind_error(name: str, why: str, given: set[str]) -> ConfigError:
    """The error of file ``name`` holding a value its column's type does not read
    (pyarrow's ``why``, less the path it may repeat)."""
    why = why.rpartition("Invalid: ")[2]
    return ConfigError(f"{name}: {why} ({_type_hint(why, given)})")


def _type_hint(why: str, given: set[str]) -> str:
    """What to do about a CSV or JSON value of another type than its column's.

    A number where whole numbers (or empty cells) came before is a type the
    first rows guessed wrong, which ``--dtype`` names, unless ``--dtype``
    gave that type (``given``: Arrow type names): the value is the mistake
    then. Text, or a list where numbers came before (or a number where lists
    did), no dtype reads.
    """
    to = re.search(r"(?:conversion error to|convert JSON to) (\w+)", why)
    if to is not None and to.group(1) in given:
        return (f"a value that the field's --dtype, read as {to.group(1)}, does not take: fix "
                f"that value in the file, or give the field a --dtype that takes it")
    value = re.search(r"invalid value '(.*)'$|couldn't parse:(.*)$", why)
    changed = re.search(r"changed from (\w+) to (\w+)", why)
    if value is not None:
        try:
            float(value.group(value.lastindex))  # (whichever of the two matched)
            numeric = True
        except ValueError:
            numeric = False
    else:
        numeric = changed is not None and {changed.group(1), changed.group(2)} <= {
            "number", "null"}
    if numeric:
        return ("a column's type is guessed from the file's first rows: give the field's "
                "with --dtype FIELD=DTYPE")
    return ("a field holds numbers, or lists of them, in every row: fix that value in the "
            "file, or leave its column out")


class QueryRows(Rows):
    """A query's result from PostgreSQL through ADBC, streamed in Arrow batches.

    The query runs once for a plain run: the result opened to learn its
    schema is the one the first ``batches`` call reads, and a later call
    that skips at least the rows given so far (``--resume`` after the first
    batch was checked) reads on in it. Only a call that needs rows already
    read runs the query again.
    """

    def __init__(self, source: str, query: str) -> None:
        if not source.startswith(("postgresql://", "postgres://")):
            raise ConfigError(f"--query reads from a database: --from postgresql://..., "
                              f"not {shown(source)}")
        try:
            import adbc_driver_postgresql.dbapi as pg
        except ImportError:
            raise ConfigError("--from postgresql:// needs the ADBC driver: pip install "
                              "'kfeed[postgres]'") from None
        self.source, self.query = source, query
        self.name = f"the query on {source.split('@')[-1].split('?')[0]}"
        self._cursor: Any = None
        self._reader: Any = None
        self._end = 0  # rows of the current result read so far
        self._last: tuple[int, Any] | None = None  # the last batch read, and its first row
        self._calling: threading.Event | None = None  # set when the latest call ended
        try:
            self._conn = self._call(lambda: pg.connect(source))
        except Exception as e:  # noqa: BLE001 - the driver's errors are its own classes
            raise ConfigError(f"--from {shown(source)}: cannot connect "
                              f"({first_line(e)})") from None
        try:
            self._run()
            self.schema = self._reader.schema
        except BaseException:
            self.close()
            raise

    def _run(self) -> None:
        if self._cursor is not None:
            self._cursor.close()
        self._cursor = self._conn.cursor()
        self._reader, self._end, self._last = None, 0, None
        cursor = self._cursor

        def start() -> Any:
            # Batches of about this many bytes: memory stays bounded whatever the result.
            cursor.adbc_statement.set_options(
                **{"adbc.postgresql.batch_size_hint_bytes": str(QUERY_BATCH_BYTES)})
            cursor.execute(self.query)
            return cursor.fetch_record_batch()

        try:
            self._reader = self._call(start)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--query: {first_line(e)}") from None

    def _read(self) -> Iterator[Any]:
        """The current result's batches from where its reading got to."""
        reader = self._reader
        while True:
            try:
                batch = self._call(lambda: next(reader, None))
            except Exception as e:  # noqa: BLE001 - the driver's errors are its own classes
                # An error in the result (a division by zero in row 150,000, a
                # connection lost): the rows before it are good, which the
                # command says, with the --resume that goes on after them.
                raise KfeedError(f"--query: {first_line(e)}") from None
            if batch is None:
                return
            self._last = (self._end, batch)
            self._end += batch.num_rows
            yield batch

    def names(self) -> list[str]:
        return list(self.schema.names)

    def batches(self, columns: list[str], skip: int = 0) -> Iterator[Any]:
        if self._reader is None or (self._last is not None and skip < self._last[0]):
            self._run()  # rows before the last batch read are wanted again
        head: list[Any] = []
        if self._last is not None and skip < self._end:
            first, batch = self._last
            head, skip = [batch], skip - first
        else:
            skip -= self._end
        batches = (b.select(columns) for b in itertools.chain(head, self._read()))
        yield from _skip_rows(batches, skip,
                              "--query gave fewer rows than the {} more that --resume would "
                              "leave out: its result changed since the last run (give it an "
                              "ORDER BY on a unique key)")

    def cancel(self) -> None:
        """Stop the query under way, from any thread (its call into the driver raises)."""
        if self._cursor is not None:
            with contextlib.suppress(Exception):
                self._cursor.adbc_cancel()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, a call into the driver that may block for long, made so that a
        signal stops it.

        A call into C holds the main thread until it returns, and the command's
        SIGINT/SIGTERM handlers run only when it does: a slow query held Ctrl-C
        for as long as it ran. On the main thread, the call runs in a thread of
        its own while this one waits in steps of 0.1 s; an interrupt then
        cancels the query, again each step (it may not have started), for at
        most ``CANCEL_WAIT_S``. A call still under way after that is left
        behind, and ``close()`` leaves the connection to the process's exit: to
        close it under the call crashes the driver. (Off the main thread the
        ADBC driver also leaves SIGINT to the command; on it, its own handler's
        cancel came out as a query error.)
        """
        if threading.current_thread() is not threading.main_thread():
            return fn()
        out: list[tuple[bool, Any]] = []
        # (Not Thread.join: interrupted, Python 3.11's marks a thread still
        # running as stopped.)
        done = self._calling = threading.Event()

        def run() -> None:
            try:
                out.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - raised on the main thread
                out.append((False, e))
            finally:
                done.set()

        threading.Thread(target=run, name="kfeed-query", daemon=True).start()
        try:
            while not done.wait(0.1):
                pass
        except BaseException:
            deadline = time.monotonic() + CANCEL_WAIT_S
            while not done.is_set() and time.monotonic() < deadline:
                self.cancel()
                with contextlib.suppress(BaseException):  # (the signal delivered again)
                    done.wait(0.1)
            raise
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._calling is not None and not self._calling.is_set():
            return  # (see _call)
        for closable in (self._cursor, getattr(self, "_conn", None)):
            if closable is not None:
                try:
                    closable.close()
                except Exception:  # noqa: BLE001, S110 - closing what may be broken
                    pass
        self._cursor = self._reader = None


# How long a call into the database driver, or a read-ahead's read, is given
# to end once cancelled (a signal, a close) before it is left behind.
CANCEL_WAIT_S = 5.0


# What np.load raises for a file that is not what its name says, or is cut short.
_NUMPY_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def _stamp(info: Any) -> tuple[int, int | None]:
    """A pyarrow ``FileInfo``'s size and modification time (ns; None where not kept)."""
    return int(info.size), info.mtime_ns


class NumpyRows(Rows):
    """The arrays of a ``.npz`` archive, or the one array of a ``.npy`` file (named
    after the file's stem), a slice of rows at a time.

    A ``.npy`` is memory-mapped, so it is read as it is sent whatever its
    size; an ``.npz`` member is read whole when its column is first asked
    for (numpy cannot map a zip member). Skipping rows for a resume is a
    slice. A sample file has no nulls (``nulls``), and its mark is its size
    (as a dataset's files are marked).
    """

    nulls = False

    def __init__(self, source: str) -> None:
        path = Path(source)
        if not path.is_file():
            raise not_samples(source) if not path.exists() else \
                ConfigError(f"--from {path}: not a file: check the path")
        self.path, self.name = path, path.name
        self.one = path.suffix.lower() == ".npy"
        what = "numpy array" if self.one else "numpy .npz"
        try:
            self._data: Any = np.load(path, mmap_mode="r" if self.one else None,
                                      allow_pickle=False)
        except _NUMPY_ERRORS as e:
            raise ConfigError(f"{path.name}: not a {what} file ({first_line(e)}): check the "
                              f"file") from None
        if self.one and not isinstance(self._data, np.ndarray):
            self._data.close()
            raise ConfigError(f"{path.name}: an .npz archive, not one .npy array: name it "
                              f"{path.stem}.npz")
        if not self.one and isinstance(self._data, np.ndarray):
            raise ConfigError(f"{path.name}: one .npy array, not an .npz archive: name it "
                              f"{path.stem}.npy and map it with --field FIELD={path.stem}")
        self.total = len(self._data) if self.one and self._data.ndim else None
        stat = path.stat()
        self._size, self._mtime = stat.st_size, stat.st_mtime_ns

    def names(self) -> list[str]:
        return [self.path.stem] if self.one else list(self._data.files)

    def no_column(self, name: str, src: str) -> ConfigError:
        stem = self.path.stem
        if self.one:
            return ConfigError(f"{self.name} holds one array, named {stem!r} after the file: "
                               f"map it to one field with --field FIELD={stem} (e.g. --field "
                               f"features={stem})")
        return ConfigError(f"{self.name} has no array {src!r} for field {name!r} (it has: "
                           f"{', '.join(self.names()) or 'none'}): map the field with "
                           f"--field {name}=ARRAY")

    def _array(self, src: str) -> np.ndarray:
        if self.one:
            return self._data  # type: ignore[no-any-return]
        try:
            return self._data[src]  # type: ignore[no-any-return]
        except ValueError as e:  # an object array: numpy refuses it without pickles
            raise ConfigError(f"{self.name}: array {src!r} holds Python objects ({e}): save "
                              f"it as a numeric array") from None
        except _NUMPY_ERRORS as e:  # the archive cut short
            raise ConfigError(f"{self.name}: array {src!r} cannot be read ({first_line(e)}): "
                              f"check the file") from None

    def batches(self, columns: list[str], skip: int = 0) -> Iterator[Any]:
        arrays = {src: self._array(src) for src in columns}
        for src, arr in arrays.items():
            if arr.ndim == 0:
                raise ConfigError(f"{src!r} of {self.name} is a single value, not one per "
                                  f"sample: give an array with a row per sample")
        counts = {src: len(arr) for src, arr in arrays.items()}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{src} {n}" for src, n in counts.items())
            raise ConfigError(f"{self.name}: the arrays have different row counts ({listed}): "
                              f"every array needs one row per sample")
        self.total = n = next(iter(counts.values()), 0)
        if skip > n:
            raise KfeedError(f"--from {self.path}: it holds fewer rows than the {skip - n} "
                             f"more that --resume would leave out: it changed since the last "
                             f"run")
        step = _batch_rows(sum(arr[:1].nbytes for arr in arrays.values()))
        for i in range(skip, n, step):
            yield _Slice({src: arr[i:i + step] for src, arr in arrays.items()})

    def mark(self, rows: int) -> str | None:
        return f"1:{self._size}:{self._mtime}"

    def check_mark(self, mark: str | None, rows: int) -> None:
        # ("1:SIZE": recorded before kfeed kept the modification time.)
        if mark and mark not in (self.mark(rows), f"1:{self._size}"):
            raise ConfigError(
                f"--resume: --from {self.path} changed since the {rows:,} rows were sent (its "
                f"size or modification time is not what it was): skipping {rows:,} rows would send some twice and "
                f"others never; send it whole with --resend (to a new topic, or after "
                f"deleting this one's records)")

    def close(self) -> None:
        if not self.one:
            self._data.close()


class _Slice:
    """Rows of a sample file's arrays, as ``batch_columns`` takes a RecordBatch's."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.num_rows = len(next(iter(arrays.values())))

    def column(self, src: str) -> np.ndarray:
        return self.arrays[src]


def _rows_a_batch(schema: Any, columns: list[str]) -> int:
    """Rows a batch of ``columns`` holds: ``STREAM_BATCH_ROWS``, fewer where rows of fixed
    size would weigh more than ``STREAM_BATCH_BYTES`` together."""
    import pyarrow as pa

    row = 0
    for name in columns:
        kind, width = schema.field(name).type, 1
        while pa.types.is_fixed_size_list(kind):
            width *= kind.list_size
            kind = kind.value_type
        try:
            row += width * max(kind.bit_width // 8, 1)
        except ValueError:  # no fixed width (strings, variable lists): a guess of 8 bytes
            row += 8
    return _batch_rows(row)


def _batch_rows(row_bytes: int) -> int:
    """Rows a batch holds, given a row's bytes: ``STREAM_BATCH_ROWS``, fewer where they
    would weigh more than ``STREAM_BATCH_BYTES`` together, one at least."""
    return max(1, min(STREAM_BATCH_ROWS, STREAM_BATCH_BYTES // max(row_bytes, 1)))


def _skip_rows(batches: Iterable[Any], skip: int, short: str) -> Iterator[Any]:
    """``batches`` less their first ``skip`` rows; ``short.format(rows missing)`` if too few."""
    for batch in batches:
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        if skip:
            batch, skip = batch.slice(skip), 0
        yield batch
    if skip:
        raise KfeedError(short.format(skip))


# What a file of each pyarrow format is, in messages.
_FILE_KINDS = {"parquet": "a parquet file", "csv": "a csv file", "json": "a json file",
               "ipc": "an Arrow IPC file (the file format, which .arrow and .feather "
                      "name; a stream is not read)"}


def open_rows(source: str, query: str | None = None,
              column_types: Mapping[str, str] | None = None) -> Rows:
    """The rows ``--from`` (and ``--query``) name (see ``is_stream``); ``column_types``
    (``{column: dtype}``, from ``--dtype``) is what CSV and JSON columns are read as."""
    if query is not None:
        return QueryRows(source, query)
    if source.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"--from {shown(source)}: give the rows to read with "
                          f"--query \"SELECT ...\"")
    if Path(source).suffix.lower() in (".npz", ".npy") and "://" not in source \
            and not _is_glob(source):
        return NumpyRows(source)  # (a glob of them: DatasetRows says they are read one a run)
    return DatasetRows(source, column_types)


def _file_format(kind: str, column_types: Mapping[str, str], lists: set[str] = frozenset()
                 ) -> tuple[Any, dict[str, Any]]:
    """pyarrow's format of ``kind`` files, and the Arrow types of ``column_types``
    (of their elements for the JSON columns in ``lists``).
    CSV and JSON columns are read as their
    ``--dtype`` says: left to pyarrow, a column's type is guessed from the file's
    first block, and a later value of another type (2.5 after whole numbers, a
    number after empty cells) stops the read. A CSV value may hold newlines
    inside quotes, as RFC 4180 has it."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    # Read wide, in the dtype's kind: the cast to the dtype checks the range (_settle).
    wide = {"i": pa.int64(), "u": pa.int64(), "f": pa.float64(), "b": pa.bool_()}
    types = {c: pa.uint64() if d == "uint64" else wide[np.dtype(d).kind]
             for c, d in column_types.items() if d in DTYPES and d != "bfloat16"}
    types = {c: pa.list_(t) if c in lists else t for c, t in types.items()}
    if kind == "csv":
        import pyarrow.csv as pacsv

        return ds.CsvFileFormat(parse_options=pacsv.ParseOptions(newlines_in_values=True),
                                convert_options=pacsv.ConvertOptions(column_types=types)), types
    if kind == "json" and types:
        import pyarrow.json as pajson

        return ds.JsonFileFormat(parse_options=pajson.ParseOptions(
            explicit_schema=pa.schema(types), unexpected_field_behavior="infer")), types
    return kind, types


class ReadAhead:
    """``items``, produced by a thread of their own up to ``depth`` ahead.

    Reading and decoding the next batch (pyarrow and the ADBC driver work
    without the GIL) then overlaps sending the current one. ``take`` waits
    for the next item at most ``timeout`` seconds, so a caller holding
    something that expires (an open transaction) need not wait on a slow
    source. An error in the thread is raised at the item it stopped before.
    ``close()`` (or an error in the reader) stops the thread and closes
    ``items`` before it returns, so the source can be closed after it. A read
    still under way after 0.1 s is ``cancel()``ed (a slow query's), and left
    behind ``CANCEL_WAIT_S`` later: then ``stuck`` is True, and the source,
    still in use by the thread, must not be closed.
    """

    _END = object()

    def __init__(self, items: Iterator[Any], depth: int = 2,
                 cancel: Callable[[], None] | None = None) -> None:
        import queue

        self._items = items
        self._cancel = cancel
        self.stuck = False
        self._out: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._ended = threading.Event()  # (not Thread.join: see QueryRows._call)
        threading.Thread(target=self._run, name="kfeed-read-ahead", daemon=True).start()

    def _put(self, entry: tuple[Any, BaseException | None]) -> None:
        import queue

        while not self._stop.is_set():
            try:
                self._out.put(entry, timeout=0.1)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        try:
            for item in self._items:
                self._put((item, None))
                if self._stop.is_set():
                    return
            self._put((self._END, None))
        except BaseException as e:  # noqa: BLE001 - handed to the reader, raised there
            self._put((self._END, e))
        finally:
            close = getattr(self._items, "close", None)
            try:
                if close is not None:
                    close()
            finally:
                self._ended.set()

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self) -> Any:
        return self.take(None)

    def take(self, timeout: float | None) -> Any:
        """The next item; ``TimeoutError`` if none came within ``timeout``
        seconds (``None``: wait), ``StopIteration`` after the last."""
        import queue

        if self._done:
            raise StopIteration
        try:
            item, error = self._out.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no item within {timeout} s") from None
        if item is self._END:
            self.close()
            if error is not None:
                raise error
            raise StopIteration
        return item

    def close(self) -> None:
        import queue

        self._done = True
        self._stop.set()
        deadline = None
        while not self._ended.is_set():
            try:  # make room for a put under way, then wait for the thread
                self._out.get_nowait()
            except queue.Empty:
                pass
            if self._ended.wait(0.1):
                break
            if deadline is None:  # a read under way, which may take long
                if self._cancel is not None:
                    self._cancel()
                deadline = time.monotonic() + CANCEL_WAIT_S
            elif time.monotonic() > deadline:
                self.stuck = True
                return


def stream_fields(rows: Rows, fields: Mapping[str, str] | None,
                  dtypes: Mapping[str, str], fills: Mapping[str, str]) -> dict[str, str]:
    """``fields`` (default ``DEFAULT_FIELDS``) checked against the rows' columns and flags."""
    import pyarrow as pa

    fields = field_order(fields or DEFAULT_FIELDS)
    names = rows.names()
    for name, src in fields.items():
        if src not in names:
            raise rows.no_column(name, src)
        if names.count(src) > 1:
            raise ConfigError(f"{rows.name} has {names.count(src)} columns named {src!r}, which "
                              f"field {name!r} reads: give each a name of its own (in a query, "
                              f"... AS other_name)")
    for src in fields.values():
        _check_database_type(rows, src)
    _check_flags(fields, dtypes, fills)
    if fills and not rows.nulls:
        raise ConfigError(f"--fill replaces the nulls of Arrow columns; {rows.name} has none: "
                          f"leave --fill out")
    for name, fill in fills.items():  # a bad value is a mistake before any row is sent
        _, kind = _element_type(rows.schema.field(fields[name]).type)
        if pa.types.is_null(kind):
            _fill_type(name, fill)
        elif _numeric(kind):
            _fill_scalar(name, fill, kind)
    return fields


# PostgreSQL's unsigned 32-bit types, which the ADBC driver reads as int32: a value
# past 2**31 - 1 came out negative.
_PG_UNSIGNED = ("oid", "xid", "cid", "regclass", "regtype", "regproc", "regprocedure",
                "regoper", "regoperator", "regconfig", "regdictionary", "regnamespace",
                "regrole", "regcollation")


def _check_database_type(rows: Rows, src: str) -> None:
    """Refuse a query's column whose database type the driver reads as another number."""
    if rows.schema is None:  # a numpy file's: no database
        return
    meta = rows.schema.field(src).metadata or {}
    # (The ADBC driver names each column's type; its older releases, only those it
    # cannot read.)
    typname = (meta.get(b"POSTGRESQL:type") or meta.get(b"ADBC:postgresql:typname")
               or b"").decode()
    if typname in _PG_UNSIGNED:
        raise ConfigError(f"column {src!r} of {rows.name} is PostgreSQL's {typname}, an "
                          f"unsigned 32-bit number that the driver reads as int32 (a value "
                          f"past 2**31 - 1 negative): cast it in the query ({src}::bigint)")
    if typname == "numeric":
        raise ConfigError(f"column {src!r} of {rows.name} is PostgreSQL's numeric, which "
                          f"kfeed produce cannot send: cast it in the query ({src}::float8, "
                          f"or {src}::bigint for whole numbers)")


def _check_flags(fields: Mapping[str, str], dtypes: Mapping[str, str],
                 fills: Mapping[str, str]) -> None:
    """Refuse a --dtype or --fill of a field not read, and a dtype kfeed cannot cast to."""
    for flag, given in (("--dtype", dtypes), ("--fill", fills)):
        for name, value in given.items():
            if name not in fields:
                raise ConfigError(f"{flag} {name}={value}: no field {name!r} is read (the fields "
                                  f"are {', '.join(fields)}): name one of them, or add it with "
                                  f"--field {name}=COLUMN")
    for name, dtype in dtypes.items():
        if dtype not in DTYPES:
            raise ConfigError(f"--dtype {name}={dtype}: not a dtype kfeed can cast to: "
                              f"use one of {', '.join(DTYPES)}")


def batch_columns(name: str, batch: Any, fields: Mapping[str, str],
                  dtypes: Mapping[str, str], fills: Mapping[str, str],
                  first: Any = None) -> dict[str, np.ndarray]:
    """A batch's columns as ``{field: array}``, by the module's rules: a RecordBatch's,
    or a sample file's (``NumpyRows``: numpy already).

    ``first``: the schema of the run's first batch. A column of nulls alone, with a
    --fill, takes its fields' dtypes and row shapes: its own type gives neither (a
    JSON Lines file's nulls read as Arrow's null type, a list's length is unknown).
    """
    out = {}
    for field, src in fields.items():
        col, fill = batch.column(src), fills.get(field)
        if isinstance(col, np.ndarray):  # a numpy file's
            out[field] = _settle(name, field, src, col, dtypes.get(field))
            continue
        if first is not None and fill is not None and len(col) and col.null_count == len(col):
            col = _filled(first[field], fill, len(col))
        else:
            col = _arrow_column(name, field, src, col, fill)
        out[field] = _settle(name, field, src, col, dtypes.get(field))
    return out


def _filled(field: Any, fill: str, n: int) -> np.ndarray:
    """``n`` rows of ``field`` (a ``Field``), each value ``fill``."""
    import pyarrow as pa

    value = _fill_scalar(field.name, fill, pa.from_numpy_dtype(field.storage)).as_py()
    return np.full((n, *field.shape), value, field.storage)


def same_schema(schema: Any, cols: dict[str, Any], where: str) -> None:
    """Refuse a later batch (of file ``where``) that gives other fields than the first."""
    later = schema_for(cols)
    if later != schema:
        raise ConfigError(f"{where}: a later batch gives {later} where the first gave {schema}: "
                          f"give every file and row the same columns and list lengths")


def _blank(fs: Any, path: str, size: int) -> bool:
    """Whether a small CSV or JSON lines file holds only whitespace (no rows; pyarrow
    refuses it). Larger files are not read here: one of blank lines that large is
    refused by name when it is read."""
    if size > _BLANK_BYTES or DATASET_FORMATS.get(Path(path).suffix.lower()) not in ("csv",
                                                                                   "json"):
        return False
    try:
        with fs.open_input_stream(path) as f:
            return not f.read().strip()
    except OSError:
        return False  # said when the file is read


def _hidden(relative: str) -> bool:
    """Whether a listed file's path below the listed folder has a part starting "_" or "."."""
    return any(part.startswith(("_", ".")) for part in relative.split("/") if part)


def split_params(source: str) -> tuple[str, str]:
    """``(address, query parameters)`` of ``--from``: a URI's ``?k=v&...``, a path's none.

    A "?" is a glob's wildcard in a path, and in a URI unless what follows the
    last one reads as parameters (``k=v``, no "/"):
    ``s3://b/part-?.parquet?endpoint_override=...`` is a glob and a parameter.
    """
    if "://" not in source:
        return source, ""
    base, mark, params = source.rpartition("?")
    if not mark or "=" not in params or "/" in params:
        return source, ""
    return base, params


def _glob_match(path: str, pattern: str) -> bool:
    """Whether ``path`` matches ``pattern`` part by part: a wildcard never spans a "/",
    but a part ``**`` matches zero or more folders (as Python's glob, Spark and DuckDB)."""
    return _parts_match(path.strip("/").split("/"), pattern.strip("/").split("/"))


def _parts_match(parts: list[str], want: list[str]) -> bool:
    if not want:
        return not parts
    if want[0] == "**":
        return any(_parts_match(parts[i:], want[1:]) for i in range(len(parts) + 1))
    # A part named as it is (a folder run[2024]) matches as well as by pattern.
    return bool(parts) and (parts[0] == want[0] or fnmatch.fnmatchcase(parts[0], want[0])) \
        and _parts_match(parts[1:], want[1:])


# Query parameters of a URI that hold secrets: left out of its key and of messages.
_SECRET_PARAMS = ("key", "secret", "token", "password", "credential", "session")


def source_key(source: str) -> str:
    """``source`` as it names an ingestion job: no password, no secret parameters, the
    other parameters sorted; so a rotated credential does not make it another job.

    A local path is made absolute, its links resolved: ``data``, ``data/`` and
    ``./data`` are one job, and ``data`` in another folder is another.
    """
    if "://" not in source:
        return os.path.realpath(source)
    base, params = _uri_params(source, hide=_job_uri)
    kept = sorted(p for p in params if not _secret(p))
    return f"{base}?{'&'.join(kept)}" if kept else base


def _job_uri(uri: str) -> str:
    """``uri`` with what comes between "://" and its last "@" as ``user:***``.

    Not ``no_password``: a user named with and without a password (read from
    ``~/.pgpass``) is one job, and this is how jobs were first named, which the
    progress recorded in Kafka keeps (another name would orphan it, and a plain
    rerun would send every row again).
    """
    parts = _each_uri(uri)
    if len(parts) > 1:
        return ",".join(map(_job_uri, parts))
    head, at, rest = uri.rpartition("@")
    if not at:
        return uri
    scheme, _, user = head.partition("://")
    return f"{scheme}://{user.split(':')[0]}:***@{rest}"


def shown(source: str) -> str:
    """``source`` for messages: a URI's password and secret parameters as ``***``."""
    if "://" not in source:
        return source
    base, params = _uri_params(source)
    kept = [f"{p.split('=')[0]}=***" if _secret(p) else p for p in params]
    return f"{base}?{'&'.join(kept)}" if kept else base


def _uri_params(uri: str, hide: Callable[[str], str] | None = None) -> tuple[str, list[str]]:
    """A URI without its password (as ``hide``, default ``no_password``, leaves it out),
    and its query parameters."""
    base, params = split_params((hide or no_password)(uri))
    return base, [p for p in params.split("&") if p]


def _secret(param: str) -> bool:
    return any(s in param.split("=")[0].lower() for s in _SECRET_PARAMS)


def _each_uri(uri: str) -> list[str]:
    """A comma-joined list of URIs (a registry's), one by one."""
    return re.split(r",(?=[A-Za-z][A-Za-z0-9+.-]*://)", uri)


def no_password(uri: str) -> str:
    """A URI (a database's, a registry's; several joined by commas) with each
    password left out, for messages."""
    parts = _each_uri(uri)
    if len(parts) > 1:
        return ",".join(map(no_password, parts))
    scheme, sep, rest = uri.partition("://")
    # Only what comes before the path holds a user's password (as libpq reads it, a
    # "?" or "#" in the password too): an "@" in the path is the path's.
    authority, slash, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return uri
    return f"{scheme}://{userinfo.split(':')[0]}:***@{host}{slash}{path}"


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
