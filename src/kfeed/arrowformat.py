"""Arrow IPC streams as message values: ``format="arrow"`` (``kfeed.Arrow()``).

Where it sits: in the build stage beside ``kfeed.avro``, and at the
producer. A message value is one Arrow IPC stream: the schema, then a
record batch (more than one is read as their rows in turn). Like kfeed's
own blocks a message holds many records, so a batch may end inside one and
the ledger's ``(offset, skip)`` positions apply as they do to blocks.

Reading (``ArrowDecoder``): each Arrow schema met is read by pyarrow once
and checked against the kfeed ``Schema`` (``_Plan``). Where every field
reads one buffer of plain values (numbers, fixed-size lists and tensors of
them), a plan for the C reader is made too (``_c_plan``, ``ext/_arrow.pxi``):
it reads the framing and the record batch's metadata of each message of
that schema without the GIL, checks every offset and length, and copies
each field's rows with one ``memcpy`` per message, a fetch at a time
(``decode_into``). A message it does not take (nulls, a dictionary, a
compressed body, another schema, bool fields, damage) is read by pyarrow
instead: each field's column a numpy view of the Arrow buffer, copied into
the slot once per message, or the reason it is bad. For ``pack=`` and
jagged fields, pyarrow reads every message (``decode_documents``); for a
shuffle or a mixture of fixed-shape records, each message becomes one kfeed
block (``blocks``), which the order holds as it holds kfeed's own. No
Python object is made per record.

A field reads the column of its name (or its dotted ``source``, or its dotted
name, through struct columns) whose type is exactly the field's:

==============================  ===============================================
kfeed field                     Arrow column
==============================  ===============================================
dtype, shape ``()``             that type, or a dictionary of it
dtype, shape ``(k,)``           ``fixed_size_list<dtype>[k]``
dtype, shape ``(a, b, ...)``    ``fixed_shape_tensor(dtype, [a, b, ...])``, or
                                nested ``fixed_size_list``s
dtype, shape ``(None,)``        ``list<dtype>`` or ``large_list<dtype>``; for a
                                uint8 field also ``binary`` or ``string``
==============================  ===============================================

A column of another type, or missing, or with nulls, makes the message
bad, with a reason that names the column, unless the field has a
``default``: a null or missing value then takes it. A null inside a row
that is not null (an item, or an inner list of nested fixed-size lists)
makes it bad whatever the default. A message is
good or bad whole: never part of it in a batch. bool columns unpack from
bits (a copy); bfloat16 fields have no Arrow type and are refused. kfeed
writes the first type of each row (``arrow_type``), but nested
``fixed_size_list``s for a bool field of two or more dimensions, which
Arrow's tensors do not take.

Writing (``ArrowEncoder``, ``record_batch``): columns as the kfeed schema
maps them above, ``block_records`` rows a message, readable by pyarrow
alone; ``Producer.send`` takes a ``pyarrow.Table`` or ``RecordBatch`` in any
format (``table_columns``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kfeed import _codec
from kfeed.errors import ConfigError, first_line
from kfeed.formats import Decoder, Encoder, RecordFormat
from kfeed.schema import DecodeResult, Documents, Field, Schema, Target

__all__ = ["Arrow", "ArrowDecoder", "arrow_column", "record_batch", "table_columns"]


def _pa() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ConfigError("format='arrow' needs pyarrow: pip install pyarrow") from None
    return pyarrow


class Arrow(RecordFormat):
    """Message values that are Arrow IPC streams: ``Loader(..., format="arrow")``."""

    value = "arrow"
    documents = True
    batches = True

    def decoder(self, schema: Schema) -> Decoder:
        return ArrowDecoder(schema)

    def encoder(self, schema: Schema, topic: str) -> Encoder:
        return ArrowEncoder(schema)

    @staticmethod
    def arrow_schema(schema: Schema) -> Any:
        """The ``pyarrow.Schema`` of the record batches kfeed writes and hands out
        (``output="arrow"``) for ``schema``: e.g. for a table of a read that may
        be empty, ``pa.Table.from_batches(loader, schema=kfeed.Arrow.arrow_schema(s))``."""
        pa = _pa()
        _check(schema)
        return pa.schema([(f.name, arrow_type(f)) for f in schema.fields])

    def __repr__(self) -> str:
        return "kfeed.Arrow()"


def _check(schema: Schema) -> None:
    for f in schema.fields:
        if f.dtype == "bfloat16":
            raise ConfigError(f"field {f.name!r} is bfloat16, which Arrow has no type for: "
                              f"make it float16 or float32")


def arrow_type(field: Field) -> Any:
    """The Arrow type kfeed writes ``field`` as (the table in the module docstring)."""
    pa = _pa()
    value = pa.from_numpy_dtype(field.storage)
    if field.variable:
        return pa.large_list(value)
    if not field.shape:
        return value
    if len(field.shape) == 1 or field.dtype == "bool":  # (Arrow's tensors take no bool)
        for d in reversed(field.shape):
            value = pa.list_(value, d)
        return value
    return pa.fixed_shape_tensor(value, list(field.shape))


def arrow_column(field: Field, values: np.ndarray, offsets: np.ndarray | None = None) -> Any:
    """``values`` (``[n, *shape]``, or a variable-length field's flat elements and
    their ``offsets``) as an Arrow array of ``arrow_type(field)``, with no copy
    but for bool (Arrow's are bits)."""
    pa = _pa()
    if field.variable:
        assert offsets is not None
        return pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64, copy=False)),
                                             pa.array(values))
    flat = pa.array(values.reshape(-1))
    if not field.shape:
        return flat
    if len(field.shape) == 1 or field.dtype == "bool":
        for d in reversed(field.shape):
            flat = pa.FixedSizeListArray.from_arrays(flat, d)
        return flat
    storage = pa.FixedSizeListArray.from_arrays(flat, math.prod(field.shape))
    return pa.ExtensionArray.from_storage(arrow_type(field), storage)


def record_batch(schema: Schema, columns: Mapping[str, Any]) -> Any:
    """A ``pyarrow.RecordBatch`` of kfeed columns (a variable-length field: ``(flat, offsets)``)."""
    pa = _pa()
    arrays = []
    for f in schema.fields:
        col = columns[f.name]
        arrays.append(arrow_column(f, *col) if f.variable else arrow_column(f, col))
    return pa.RecordBatch.from_arrays(arrays, names=list(schema.names))


def table_columns(schema: Schema, table: Any) -> dict[str, Any]:
    """A ``pyarrow.Table`` or ``RecordBatch`` as the columns ``Producer.send`` takes.

    Its columns are read as the loader reads a message's (the module
    docstring); one it cannot read is a ``ConfigError`` naming it.
    """
    pa = _pa()
    if isinstance(table, pa.Table):
        table = table.combine_chunks()
        batch = (table.to_batches()[0] if table.num_rows
                 else pa.RecordBatch.from_pylist([], schema=table.schema))
    else:
        batch = table
    _check(schema)
    plan = _Plan(schema, batch.schema)
    try:
        n, cols = plan.read(batch)
    except _Bad as e:
        raise ConfigError(f"cannot send this table: {e}") from None
    out: dict[str, Any] = {}
    for f, col in zip(schema.fields, cols, strict=True):
        if f.variable:
            flat, offsets = col
            out[f.name] = (flat[offsets[0]:offsets[-1]], np.diff(offsets))
        else:
            out[f.name] = col
    assert all(len(v if not isinstance(v, tuple) else v[1]) == n for v in out.values())
    return out


class _Bad(Exception):
    """A message that no row of may reach a batch; its argument is the reason."""


class _Plan:
    """How one Arrow schema's columns give the kfeed schema's fields, checked once.

    ``read(batch)`` gives each field's values as numpy: ``[n, *shape]`` for a
    fixed shape, ``(flat, offsets)`` for the variable-length field; views of
    the Arrow buffers where they allow it.
    """

    def __init__(self, schema: Schema, arrow: Any) -> None:
        self.schema = schema
        self.arrow = arrow
        self.steps: list[tuple[Field, tuple[int, ...] | None, str]] = []
        self.reason: str | None = None
        self.read_columns: set[int] = set()  # the top-level columns the steps read
        try:
            self._match(schema, arrow)
        except UnicodeDecodeError as e:  # a damaged schema message: pyarrow decodes names late
            self.steps = []
            self.reason = f"a name in the message's Arrow schema is not UTF-8 ({e.reason})"

    def _match(self, schema: Schema, arrow: Any) -> None:
        """Each field's column and kind into ``steps``, or why none into ``reason``."""
        for f in schema.fields:
            # A dotted name is a struct path, or one column of that name, as kfeed's
            # own Arrow messages (and record batches) write it.
            where = _locate(arrow, (f.name,)) if f.source is None and len(f.path) > 1 else None
            where = where or _locate(arrow, f.path)
            if where is None:
                if f.default is None:
                    self.reason = (f"no column {'.'.join(f.path)!r} for field {f.name!r} "
                                   f"(the message has {', '.join(arrow.names) or 'no columns'})")
                    return
                self.steps.append((f, None, "default"))
                continue
            path, typ = where
            kind = _kind(f, typ)
            if kind is None:
                self.reason = (f"column {'.'.join(f.path)!r} is {typ}, but field {f.name!r} "
                               f"reads {arrow_type(f)}")
                return
            self.steps.append((f, path, kind))
        self.read_columns = {path[0] for _f, path, _k in self.steps if path is not None}

    def read(self, batch: Any) -> tuple[int, list[Any]]:
        if self.reason is not None:
            raise _Bad(self.reason)
        n = batch.num_rows
        # Buffer sizes against lengths, which pyarrow's IPC reader leaves to
        # us: of the columns read only, as the C reader checks them (a column
        # no field reads does not make a message bad, whichever reads it).
        for i, col in enumerate(batch.columns):
            try:
                if len(col) != n:
                    raise ValueError(f"{len(col)} rows in a batch of {n}")
                if i in self.read_columns:
                    col.validate()
            except (_pa().ArrowException, ValueError) as e:
                raise _Bad(f"an invalid record batch: column {batch.schema.names[i]!r}: "
                           f"{e}") from None
        out = []
        for f, path, kind in self.steps:
            if path is None:
                out.append(_filled(f, n, None, None))
                continue
            col = batch.column(path[0])
            for i in path[1:]:
                col = _child(col, i)
            if kind in _FULLY_VALIDATED:
                _validate_full(f, col)
            if kind == "plain" and not col.null_count:  # most columns: a view of the buffer
                out.append(col.to_numpy(zero_copy_only=False))
                continue
            try:
                out.append(_values(f, col, kind, n))
            except _pa().ArrowException as e:  # one message pyarrow cannot convert: bad, not fatal
                raise _Bad(f"column {'.'.join(f.path)!r}: {first_line(e)}") from None
        return n, out


# Kinds of column whose offsets or dictionary indices the fields read:
# ``validate()`` checks only that the first and last offsets are in range (a
# row between them could have a negative length), and no index at all.
_FULLY_VALIDATED = frozenset({"list", "binary", "dictionary"})


def _validate_full(f: Field, col: Any) -> None:
    """``_Bad`` unless ``col`` passes pyarrow's full validation (offsets in order,
    indices inside the dictionary)."""
    try:
        col.validate(full=True)
    except (_pa().ArrowException, ValueError) as e:
        raise _Bad(f"an invalid record batch: column {'.'.join(f.path)!r}: {e}") from None


def _locate(arrow: Any, path: tuple[str, ...]) -> tuple[tuple[int, ...], Any] | None:
    """The indexes of ``path``'s column through struct columns, and its type."""
    pa = _pa()
    names, types = arrow.names, [arrow.field(i).type for i in range(len(arrow.names))]
    found: list[int] = []
    for depth, name in enumerate(path):
        if name not in names:
            return None
        i = names.index(name)
        found.append(i)
        typ = types[i]
        if depth + 1 < len(path):
            if not pa.types.is_struct(typ):
                return None
            names = [typ.field(k).name for k in range(typ.num_fields)]
            types = [typ.field(k).type for k in range(typ.num_fields)]
    return tuple(found), typ


def _child(col: Any, i: int) -> Any:
    """A struct column's child ``i``: the struct's own nulls and slice applied."""
    return col.flatten()[i]


def _kind(f: Field, typ: Any) -> str | None:
    """How a column of ``typ`` gives field ``f``; None when it does not."""
    pa = _pa()
    want = pa.from_numpy_dtype(f.storage)
    if pa.types.is_dictionary(typ):
        return "dictionary" if not f.shape and typ.value_type == want else None
    if f.variable:
        if (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and typ.value_type == want:
            return "list"
        if f.dtype == "uint8" and (pa.types.is_binary(typ) or pa.types.is_string(typ)
                                   or pa.types.is_large_binary(typ)
                                   or pa.types.is_large_string(typ)):
            return "binary"
        return None
    if not f.shape:
        return "plain" if typ == want else None
    if isinstance(typ, pa.FixedShapeTensorType):
        # Stored in row-major order only: a permutation would reorder the elements.
        straight = typ.permutation is None or list(typ.permutation) == list(range(len(f.shape)))
        return ("tensor" if typ.value_type == want and tuple(typ.shape) == f.shape and straight
                else None)
    inner = typ
    for k in f.shape:
        if not pa.types.is_fixed_size_list(inner) or inner.list_size != k:
            return None
        inner = inner.value_type
    return "lists" if inner == want else None


def _values(f: Field, col: Any, kind: str, n: int) -> Any:
    """Field ``f``'s values from its column ``col`` of ``n`` rows (see ``_Plan.read``)."""
    name = ".".join(f.path)
    if kind == "dictionary":  # first: a null in the dictionary is a null row too
        col = col.dictionary_decode()
        kind = "plain"
    valid = None
    if col.null_count:
        if f.default is None:
            raise _Bad(f"column {name!r} has {col.null_count} null(s) and field {f.name!r} "
                       f"has no default")
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        nulls = n - int(np.count_nonzero(valid))
        if nulls != col.null_count:  # (as full validation finds: the bitmap is the truth)
            raise _Bad(f"an invalid record batch: column {name!r}: its null count, "
                       f"{col.null_count}, is not its bitmap's, {nulls}")
    if kind in ("list", "binary"):
        if n == 0:  # (its offsets buffer may be empty: a zero-length array needs none)
            return _filled(f, 0, None, (np.empty(0, f.storage), np.zeros(1, np.int64)))
        if kind == "list":
            # The offsets index the whole child array; a null list's range is
            # never read (it takes the default).
            offsets = col.offsets.to_numpy()
            items = col.values.slice(offsets[0], offsets[-1] - offsets[0])
            if items.null_count:
                # Only a null row's range, which is never read, may hold them.
                import pyarrow.compute as pc

                read = (np.repeat(valid, np.diff(offsets)) if valid is not None
                        else np.ones(len(items), np.bool_))
                if (read & ~items.is_valid().to_numpy(zero_copy_only=False)).any():
                    raise _Bad(f"column {name!r} has null items in its lists")
                items = pc.fill_null(items, _zero(items.type))
            flat = items.to_numpy(zero_copy_only=False)
            offsets = offsets - offsets[0]
        else:
            wide = _pa().types.is_large_binary(col.type) or _pa().types.is_large_string(col.type)
            bufs = col.buffers()
            offsets = np.frombuffer(bufs[1], np.int64 if wide else np.int32)[
                col.offset:col.offset + n + 1]
            flat = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None \
                else np.empty(0, np.uint8)
        return _filled(f, n, valid, (flat, offsets.astype(np.int64, copy=False)))
    if kind == "tensor":
        col = col.storage
    # Fixed-size lists: the items of the rows in the slice, null rows' too
    # (each row has its k items, whatever its validity). A null at any level
    # below the row, an inner list's or an item's, is only allowed in a null
    # row (which takes the default): elsewhere pyarrow reads None there.
    levels = len(f.shape) if kind == "lists" else 1 if kind == "tensor" else 0
    for level in range(levels):
        k = col.type.list_size
        col = col.values.slice(col.offset * k, len(col) * k)
        if level + 1 < levels and col.null_count:
            _in_null_rows(col, n, valid, f"column {name!r} has null inner lists")
    if col.null_count:
        import pyarrow.compute as pc

        _in_null_rows(col, n, valid, f"column {name!r} has null items in its lists")
        col = pc.fill_null(col, _zero(col.type))
    values = col.to_numpy(zero_copy_only=False).reshape(n, *f.shape)
    return _filled(f, n, valid, values)


def _zero(type_: Any) -> Any:
    """The scalar a null that is never read is filled with: 0, or False (no 0 of a bool)."""
    pa = _pa()
    return pa.scalar(False if pa.types.is_boolean(type_) else 0, type_)


def _in_null_rows(col: Any, n: int, valid: np.ndarray | None, reason: str) -> None:
    """``_Bad(reason)`` unless each null of ``col``, ``n`` rows' values of one size each,
    lies in a row that ``valid`` says is null."""
    ok = col.is_valid().to_numpy(zero_copy_only=False).reshape(n, -1).all(axis=1)
    if not (ok if valid is None else ok | ~valid).all():
        raise _Bad(reason)


def _filled(f: Field, n: int, valid: np.ndarray | None, values: Any) -> Any:
    """``values`` with its null rows (``valid`` False) given ``f.default``; all of them
    when there are no values (a missing column)."""
    if values is None:
        valid = np.zeros(n, np.bool_)
        values = ((np.empty(0, f.storage), np.zeros(n + 1, np.int64)) if f.variable
                  else np.empty((n, *f.shape), f.storage))
    if valid is None:
        return values
    if not f.variable:
        out = np.array(values, copy=True)
        out[~valid] = np.asarray(f.default, f.storage)
        return out
    flat, offsets = values
    default = np.asarray(f.default, f.storage).reshape(-1)
    docs = [flat[offsets[i]:offsets[i + 1]] if ok else default
            for i, ok in enumerate(valid.tolist())]
    lengths = np.fromiter((len(d) for d in docs), np.int64, n)
    return (np.concatenate(docs) if docs else np.empty(0, f.storage),
            np.concatenate([[0], np.cumsum(lengths)]))


class ArrowDecoder(Decoder):
    """Arrow IPC message values into one kfeed Schema's rows (see the module docstring)."""

    batches = True

    def __init__(self, schema: Schema) -> None:
        _pa()
        _check(schema)
        self.schema = schema
        self.plans: dict[bytes, _Plan] = {}  # by the bytes of the schema message
        # The C reader's plan of each schema met (None: that schema needs pyarrow),
        # and of the last one.
        self.cplans: dict[bytes, Any] = {}
        self.cplan: Any = None
        self.layout = schema._fixed_only("Arrow decoding") if schema.varlen is None else None

    def columns(self, value: Any) -> tuple[int, list[Any]]:
        """A message's rows and each field's values (``_Plan.read``); ``_Bad`` if it has none.

        The common message, a schema and one record batch, is read through a
        plan kept by the schema message's bytes and ``read_record_batch``
        (a third of ``open_stream``'s cost); any other stream (dictionaries,
        several batches, the pre-1.0 framing) through ``open_stream``.
        """
        pa = _pa()
        if value is None:
            raise _Bad("an empty message (no value), not an Arrow IPC stream")
        head = _schema_end(value)
        key = bytes(value[:head]) if head else None
        plan = self.plans.get(key) if key is not None else None
        if plan is not None and bytes(value[head:head + 4]) == _CONTINUATION:
            if self.layout is not None:  # the C reader takes this schema's next messages
                self.cplan = self.cplans.get(key)
            try:
                buf = pa.py_buffer(value)
                msg = pa.ipc.read_message(buf.slice(head))
                if msg.type == "record batch":
                    end = head + 8 + int.from_bytes(value[head + 4:head + 8], "little") \
                        + msg.body.size
                    # Nothing after it but the end-of-stream marker, or nothing.
                    if len(value) == end or bytes(value[end:]) == _END_OF_STREAM:
                        return plan.read(pa.ipc.read_record_batch(msg, plan.arrow))
            except (pa.ArrowException, OSError, EOFError):
                pass  # open_stream says what is wrong with it
        try:
            reader = pa.ipc.open_stream(value)
            batches = list(reader)
        except (pa.ArrowException, OSError, EOFError) as e:
            raise _Bad(f"not an Arrow IPC stream: {e}") from None
        plan = self._plan(reader.schema, key)
        if len(batches) == 1:
            return plan.read(batches[0])
        if not batches:
            return plan.read(pa.RecordBatch.from_pylist([], schema=reader.schema))
        # Each batch read and checked on its own, then joined: pyarrow's
        # concatenation would read offsets and indices before they are checked.
        return _joined(self.schema, [plan.read(b) for b in batches])

    def _plan(self, arrow: Any, key: bytes | None) -> _Plan:
        if key is not None and not _native_schema(key):
            key = None  # big-endian, or a body after the schema: open_stream every time
        plan = self.plans.get(key) if key is not None else None
        if plan is None:
            plan = _Plan(self.schema, arrow)
            if key is not None and len(self.plans) < _MOST_PLANS:
                self.plans[key] = plan
        if key is not None and self.layout is not None:
            if key not in self.cplans and len(self.cplans) < _MOST_PLANS:
                self.cplans[key] = _c_plan(self.schema, plan, key)
            self.cplan = self.cplans.get(key)
        return plan

    def decode_into(self, values: Sequence[Any], out: Target, row: int, *, start: int = 0,
                    split: bool = False) -> DecodeResult:
        """Messages into ``out`` from ``row`` on, as ``Schema.decode_into`` decodes blocks.

        ``start``: records of the first message already read. With ``split``
        a message may straddle the end of ``out``: ``partial`` then says how
        many of its records are read. Messages of the last schema met go
        through the C reader (``_codec.arrow_decode``), a run at a time; one
        it does not take goes through pyarrow (``_decode_one``), which also
        makes the plans of a new schema.
        """
        if self.schema.varlen is not None:
            raise ConfigError(f"field {self.schema.varlen.name!r} is variable-length: the loader "
                              f"reads it as a jagged field, or with pack=kfeed.Pack(...)")
        if not isinstance(values, (list, tuple)):
            values = list(values)
        rows = consumed = 0
        bad: list[tuple[int, str]] = []
        while consumed < len(values):
            first = start if consumed == 0 else 0
            if self.cplan is not None:
                try:
                    r, c, partial, stopped = _codec.arrow_decode(
                        self.cplan, self.layout, values[consumed:], out.out, row + rows, first,
                        split)
                except ValueError as e:  # an out bound for another schema's rows
                    raise ConfigError(str(e)) from None
                rows += r
                consumed += c
                if partial:
                    return DecodeResult(rows, consumed, bad, partial)
                if not stopped:
                    break  # all read, or out is full
                first = start if consumed == 0 else 0
            res = self._decode_one(values[consumed:consumed + 1], out, row + rows, first, split)
            bad.extend((consumed + i, why) for i, why in res.bad)
            rows += res.rows
            consumed += res.consumed
            if res.partial:
                return DecodeResult(rows, consumed, bad, res.partial)
            if not res.consumed:
                break  # it does not fit
        return DecodeResult(rows, consumed, bad)

    def _decode_one(self, values: Sequence[Any], out: Target, row: int, start: int,
                    split: bool) -> DecodeResult:
        """Messages into ``out`` through pyarrow: ``decode_into`` without the C reader."""
        views = [_writable(o) for o in out.owners]
        room = out.capacity - row
        rows = consumed = 0
        bad: list[tuple[int, str]] = []
        for k, value in enumerate(values):
            if rows == room:
                break
            try:
                n, cols = self.columns(value)
            except _Bad as e:
                bad.append((k, str(e)))
                consumed += 1
                continue
            first = min(start, n) if k == 0 else 0
            take = min(n - first, room - rows)
            if take < n - first and not split:
                break
            at = row + rows
            for view, col in zip(views, cols, strict=True):
                view[at:at + take] = col[first:first + take]
            rows += take
            if first + take < n:
                return DecodeResult(rows, consumed, bad, first + take)
            consumed += 1
        return DecodeResult(rows, consumed, bad)

    def decode_documents(self, values: Sequence[Any]) -> Documents:
        """Every message's records: the variable-length field flat, the others as columns."""
        var = self.schema.varlen
        if var is None:
            raise ConfigError("decode_documents needs a schema with a variable-length field")
        j = self.schema.fields.index(var)
        tokens, lengths, counts = [], [], np.zeros(len(values), np.int64)
        columns: dict[str, list[np.ndarray]] = {f.name: [] for f in self.schema.fields
                                                if not f.variable}
        bad: list[tuple[int, str]] = []
        for k, value in enumerate(values):
            try:
                n, cols = self.columns(value)
            except _Bad as e:
                bad.append((k, str(e)))
                continue
            flat, offsets = cols[j]
            tokens.append(flat[offsets[0]:offsets[-1]])
            lengths.append(np.diff(offsets))
            counts[k] = n
            for f, col in zip(self.schema.fields, cols, strict=True):
                if not f.variable:
                    columns[f.name].append(col)
        return Documents(
            np.concatenate(tokens) if tokens else np.empty(0, var.storage),
            np.concatenate(lengths) if lengths else np.empty(0, np.int64), counts, bad,
            {name: (np.concatenate(parts) if parts else
                    np.empty((0, *self.schema[name].shape), self.schema[name].storage))
             for name, parts in columns.items()})

    def blocks(self, values: Sequence[Any]) -> tuple[list[bytes], list[tuple[int, str]]]:
        """Each good message as one kfeed block of its records; the bad ones' reasons."""
        out, bad = [], []
        for k, value in enumerate(values):
            try:
                _n, cols = self.columns(value)
            except _Bad as e:
                bad.append((k, str(e)))
                continue
            out.append(self.schema.encode_block(dict(zip(self.schema.names, cols, strict=True))))
        return out, bad


def _c_plan(schema: Schema, plan: _Plan, prefix: bytes) -> Any:
    """The C reader's plan of ``plan``'s Arrow schema, or None where it needs pyarrow.

    The C reader takes fields read from one buffer of plain values: a
    numeric column (not bool: Arrow's are bits), or fixed-size lists or a
    row-major tensor of one, through struct columns or not. A dictionary
    anywhere in the schema (its batches come first), a missing column (a
    default), or a type whose buffers it does not count, and it is pyarrow.
    """
    if plan.reason is not None:
        return None
    try:
        tree = _buffer_tree(plan.arrow)
    except _Unsupported:
        return None
    nodes, buffers = tree.pop()
    data_buf, checked = [], []
    lengths = [(node, k) for top in tree for node, k in _fixed_lengths(top, 1)]
    sized = [(node.node, k) for node, k in lengths]
    wide = [(node.buffers[1], k * node.width) for node, k in lengths if node.width]
    for f, path, kind in plan.steps:
        if path is None or kind not in ("plain", "lists", "tensor") or f.dtype == "bool":
            return None
        node = tree[path[0]]
        checked.append(node.node)
        for i in path[1:]:
            node = node.children[i]
            checked.append(node.node)
        while node.children:  # fixed-size lists (a tensor's storage) down to the values
            node = node.children[0]
            checked.append(node.node)
        data_buf.append(node.buffers[1])
    return _codec.ArrowPlan(prefix, data_buf, sorted(set(checked)), sized, wide, nodes,
                            buffers)


def _fixed_lengths(node: _Node, per_row: int) -> Iterator[tuple[_Node, int]]:
    """``node`` and its descendants whose lengths are the batch's rows times a known
    count: through structs and fixed-size lists, not through variable-length lists."""
    yield node, per_row
    if node.list_size is not None:
        yield from _fixed_lengths(node.children[0], per_row * node.list_size)
    elif node.struct:
        for child in node.children:
            yield from _fixed_lengths(child, per_row)


class _Unsupported(Exception):
    """A type whose buffers the C reader does not count."""


class _Node:
    """A column's place in a record batch: its node, its buffers, its children's."""

    def __init__(self, node: int, buffers: list[int], children: list[_Node],
                 list_size: int | None = None, struct: bool = False, width: int = 0) -> None:
        self.node, self.buffers, self.children = node, buffers, children
        self.list_size, self.struct = list_size, struct  # a fixed-size list's k; a struct
        self.width = width  # bytes a value of a fixed-width type (0: another type, or bool)


def _buffer_tree(arrow: Any) -> list[Any]:
    """Each top-level column's ``_Node``, then ``(nodes, buffers)``: the counts a record
    batch of ``arrow`` has, numbered depth first as the IPC format lays them out."""
    pa = _pa()
    counts = [0, 0]

    def walk(typ: Any) -> _Node:
        if isinstance(typ, pa.BaseExtensionType):
            typ = typ.storage_type
        if pa.types.is_dictionary(typ):
            raise _Unsupported(typ)
        node = counts[0]
        counts[0] += 1
        if pa.types.is_null(typ):
            nbuf, kids = 0, []
        elif pa.types.is_struct(typ):
            nbuf, kids = 1, [typ.field(i).type for i in range(typ.num_fields)]
        elif pa.types.is_fixed_size_list(typ):
            nbuf, kids = 1, [typ.value_type]
        elif pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_map(typ):
            nbuf, kids = 2, [typ.value_type if not pa.types.is_map(typ)
                             else pa.struct([typ.key_field, typ.item_field])]
        elif (pa.types.is_binary(typ) or pa.types.is_string(typ)
              or pa.types.is_large_binary(typ) or pa.types.is_large_string(typ)):
            nbuf, kids = 3, []
        elif (pa.types.is_integer(typ) or pa.types.is_floating(typ)
              or pa.types.is_boolean(typ) or pa.types.is_temporal(typ)
              or pa.types.is_decimal(typ) or pa.types.is_fixed_size_binary(typ)):
            nbuf, kids = 2, []
        else:  # views, unions, run-end encoded, ...: variadic or other buffer counts
            raise _Unsupported(typ)
        buffers = list(range(counts[1], counts[1] + nbuf))
        counts[1] += nbuf
        width = (typ.bit_width // 8 if nbuf == 2 and not kids and not pa.types.is_boolean(typ)
                 and typ.bit_width % 8 == 0 else 0)
        return _Node(node, buffers, [walk(k) for k in kids],
                     typ.list_size if pa.types.is_fixed_size_list(typ) else None,
                     pa.types.is_struct(typ), width)

    tree: list[Any] = [walk(arrow.field(i).type) for i in range(len(arrow.names))]
    tree.append((counts[0], counts[1]))
    return tree


# Plans kept per decoder: one per Arrow schema met, which a topic has few of.
_MOST_PLANS = 256
_CONTINUATION = b"\xff\xff\xff\xff"
_END_OF_STREAM = _CONTINUATION + b"\x00\x00\x00\x00"


def _native_schema(prefix: bytes) -> bool:
    """Whether the schema message ``prefix`` is little-endian with no body after it.

    Only then are the next record batch's bytes where ``_schema_end`` says, in
    this host's order, for the C reader and for ``read_record_batch``; a
    big-endian stream is read by ``open_stream``, which swaps it.
    """
    meta = prefix[8:]

    def u16(at: int) -> int:
        return int.from_bytes(meta[at:at + 2], "little")

    def field(table: int, i: int) -> int:
        vt = table - int.from_bytes(meta[table:table + 4], "little", signed=True)
        if 4 + 2 * i + 2 > u16(vt):
            return 0
        off = u16(vt + 4 + 2 * i)
        return table + off if off else 0

    try:
        msg = int.from_bytes(meta[0:4], "little")
        kind, body, header = field(msg, 1), field(msg, 3), field(msg, 2)
        if not kind or meta[kind] != 1 or not header:  # MessageHeader.Schema
            return False
        if body and int.from_bytes(meta[body:body + 8], "little") != 0:
            return False
        schema = header + int.from_bytes(meta[header:header + 4], "little")
        endian = field(schema, 0)
        return not endian or u16(endian) == 0  # Endianness.Little
    except (IndexError, ValueError):
        return False


def _schema_end(value: Any) -> int:
    """Where a stream's first message (its schema) ends; 0 if it does not start as one."""
    if len(value) < 8 or bytes(value[:4]) != _CONTINUATION:
        return 0
    end = 8 + int.from_bytes(value[4:8], "little")
    return end if end + 8 <= len(value) else 0


def _joined(schema: Schema, parts: list[tuple[int, list[Any]]]) -> tuple[int, list[Any]]:
    """Several record batches' ``_Plan.read`` as one's: their rows in turn."""
    out: list[Any] = []
    for j, f in enumerate(schema.fields):
        if not f.variable:
            out.append(np.concatenate([cols[j] for _n, cols in parts]))
            continue
        flats, lengths = [], []
        for _n, cols in parts:
            flat, offsets = cols[j]
            flats.append(flat[offsets[0]:offsets[-1]])
            lengths.append(np.diff(offsets))
        out.append((np.concatenate(flats),
                    np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)))
    return sum(n for n, _cols in parts), out


def _writable(owner: Any) -> np.ndarray:
    """A numpy view of an output buffer (a numpy array, or a pool slot's tensor)."""
    if isinstance(owner, np.ndarray):
        return owner
    return owner.numpy()


class ArrowEncoder(Encoder):
    """Columns as Arrow IPC streams, ``rows`` records a message (the producer's ``block_records``)."""

    def __init__(self, schema: Schema) -> None:
        _pa()
        _check(schema)
        self.schema = schema

    def _prepared(self, columns: Mapping[str, Any]) -> tuple[dict[str, Any], np.ndarray]:
        """The columns as arrays (a document field as flat elements and offsets), and
        each record's bytes of values."""
        views, n, _owners = self.schema._columns(columns)
        cols: dict[str, Any] = {}
        sizes = np.full(n, self.schema.record_size, np.int64)
        for f in self.schema.fields:
            if f.variable:
                flat, offsets = _documents(columns[f.name], f)
                cols[f.name] = (flat, offsets)
                sizes += np.diff(offsets) * f.storage.itemsize + 8  # and its offset
            else:
                cols[f.name] = np.asarray(columns[f.name], f.storage).reshape(n, *f.shape)
        del views
        return cols, sizes

    def message_bytes(self, elements: int) -> int:
        """The bytes of a message of one record whose document has ``elements`` elements."""
        cols: dict[str, Any] = {}
        for f in self.schema.fields:
            cols[f.name] = ((np.zeros(elements, f.storage), np.array([0, elements]))
                            if f.variable else np.zeros((1, *f.shape), f.storage))
        return len(self._message(cols, 0, 1))

    def encode_blocks(self, columns: Mapping[str, Any], rows: int, max_bytes: int) -> list[bytes]:
        """N records as messages of at most ``rows`` records and ``max_bytes`` each.

        ConfigError, before any message is returned, for a record that alone is
        larger than ``max_bytes``.
        """
        cols, sizes = self._prepared(columns)
        n = len(sizes)
        out = []
        start = 0
        ends = np.cumsum(sizes)
        while start < n:
            base = ends[start - 1] if start else 0
            fit = int(np.searchsorted(ends, base + max_bytes, "right")) - start
            stop = start + max(1, min(rows, fit))
            while True:
                message = self._message(cols, start, stop)
                if len(message) <= max_bytes:
                    break
                if stop - start == 1:
                    raise ConfigError(f"a record is {len(message):,} bytes as an Arrow message, "
                                      f"more than a message holds ({max_bytes:,})")
                # Arrow's own bytes on top of the values (the schema, the offsets,
                # each buffer's padding): fewer rows, in proportion.
                stop = start + max(1, int((stop - start) * max_bytes / len(message) * 0.98))
            out.append(message)
            start = stop
        return out

    def _message(self, cols: dict[str, Any], start: int, stop: int) -> bytes:
        """Records ``start:stop`` of ``cols`` as one Arrow IPC stream."""
        pa = _pa()
        part = {}
        for f in self.schema.fields:
            if f.variable:
                flat, offsets = cols[f.name]
                o = offsets[start:stop + 1]
                part[f.name] = (flat[o[0]:o[-1]], o - o[0])
            else:
                part[f.name] = cols[f.name][start:stop]
        batch = record_batch(self.schema, part)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        return sink.getvalue().to_pybytes()

    def encode(self, columns: Any) -> list[bytes]:
        return self.encode_blocks(columns, 1, 1 << 62)


def _documents(column: Any, f: Field) -> tuple[np.ndarray, np.ndarray]:
    """A variable-length column as ``Producer.send`` takes it, flat with int64 offsets."""
    if isinstance(column, tuple):
        flat, lengths = column
        flat = np.asarray(flat, f.storage)
        lengths = np.asarray(lengths, np.int64)
    else:
        docs = [np.asarray(d, f.storage).reshape(-1) for d in column]
        lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
        flat = np.concatenate(docs) if docs else np.empty(0, f.storage)
    return flat, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
