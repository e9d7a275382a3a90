"""Bad-input fuzz of the record codec: whatever a topic holds, decoding stays safe.

Anyone who can write to a topic chooses the bytes that ``Schema.decode_into``
reads, so it has to survive any of them. Hypothesis (and atheris, where it
installs) feeds it random bytes, blocks cut at every length, rewritten header
fields (counts up to 2**32-1, fingerprints, header lengths, body lengths),
zero-length and oversize values, tombstones, values that are not bytes, and
block and raw values mixed in one call, for both formats and schemas with
1-byte and odd-sized fields. Each call is checked against ``oracle_decode``, a
pure-Python reading of docs/FORMAT.md, and:

- no exception escapes, and each value's verdict and reason are the oracle's;
- nothing is written outside the rows the call reports: ``out`` is a window
  into bigger arrays whose other rows hold a sentinel, and each array ends at a
  page the process may not touch;
- a rejected value contributes no row; the rows written are exactly the good
  values' records, whole and in order, so good values around bad ones arrive;
- ``rows``, ``consumed``, ``bad`` and ``partial`` agree with one another.

Values can also lie right against an inaccessible page, so reading past a
value's end (or before its start) is a segfault rather than a silent misread.

``Schema.decode_documents`` (a schema with a variable-length field) is fuzzed
the same way against ``oracle_decode_documents``, with offsets tables
rewritten as well: every document, length, count, fixed row and reason must
be the oracle's, byte for byte.

CI runs this file twice: against the normal build, and against one with
Cython's bounds and wrap-around checks on (``KFEED_DEBUG=1``, built into a
separate folder). ``KFEED_EXPECT_DEBUG=1`` (or ``0``) makes
``test_the_build_is_the_one_expected`` insist on the one or the other.

The decoders of formats others write (``kfeed.Avro``, ``kfeed.Protobuf``,
``kfeed.Json``) are fuzzed the same way: valid values, damaged (bytes
rewritten, cut, grown, long varints, deep nesting), placed against guard
pages, into sentinel rows; each value kfeed takes must read as fastavro,
protobuf or ``json.loads`` read it, and a rejected one may have begun only the
row after the last good one. Arrow messages (``kfeed.Arrow``) are too, those
of the C reader and those it leaves to pyarrow (dictionaries, strings, lists,
nulls), with their list offsets and dictionary indices rewritten as well: each
one kfeed takes passes pyarrow's full validation and reads as pyarrow reads it.

Kafka message headers are not fuzzed: no kfeed API reads them. The producer
writes ``kfeed.fingerprint`` and ``kfeed.format`` for tools; decoding takes
values only, and a block carries its own fingerprint.

``FUZZ_EXAMPLES`` sets the examples per property (default 150); the ``slow``
soak tests run twenty times as many. Run directly, this file is an atheris
fuzzer: ``python tests/test_fuzz.py -runs=100000``; a crash file it writes
replays with ``python tests/test_fuzz.py CRASH_FILE``.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kfeed
from kfeed import ConfigError, Schema
from kfeed import schema as schema_module

REPO = Path(__file__).resolve().parent.parent

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES") or 150)
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SOAK = settings(PROPERTY, max_examples=20 * EXAMPLES)

from reasons import (  # noqa: E402 - the documented reason strings
    TOMBSTONE, NOT_BYTES, SHORT, MAGIC, VERSION, FLAGS, HEADER_LEN, FINGERPRINT, COUNT, LENGTH, RAW_SIZE,
    OFFSETS_START, OFFSETS_ORDER, OFFSETS_END, RAW_ITEMSIZE,
)
from records import damage, rows_untouched  # the formats' shared fuzz helpers

SCHEMAS = {
    # 1-byte bool rows, odd row sizes (3, 10): every column needs padding.
    "odd": Schema({"flag": ("bool", ()), "b": ("int8", (3,)), "h": ("float16", (5,))}),
    # One 1-byte field: up to 7 records fit in one column's padding.
    "bool": Schema({"x": ("bool", ())}),
    "small": Schema({"v": ("int32", (3,)), "k": ("int64", ())}),
    "mixed": Schema(
        {
            "w": ("bfloat16", (7,)),
            "d": ("float64", (2, 2)),
            "u": ("uint8", ()),
            "t": ("uint16", (1, 3)),
        }
    ),
    "seeds": Schema({"features": ("float32", (24,)), "label": ("int64", ()), "id": ("int64", ())}),
}
FORMATS = ("block", "raw")


# -- the oracle: docs/FORMAT.md in plain Python -------------------------------

# magic, version, flags, header_len, count, reserved, fingerprint, body_len
_HEADER = struct.Struct("<4sBBHIIQQ")


def align8(n: int) -> int:
    return (n + 7) & ~7


def oracle_block_nbytes(schema: Schema, count: int, header_len: int = 32) -> int:
    return header_len + sum(align8(count * f.nbytes) for f in schema.fields)


def oracle_block(
    schema: Schema, records: np.ndarray, *, header_len: int = 32, reserved: int = 0, fill: int = 0
) -> bytes:
    """A valid block holding ``records`` (one row of raw record bytes each).

    ``fill`` is the byte written into the header extension and the column
    padding, which readers must not check.
    """
    parts, at = [], 0
    for f in schema.fields:
        column = records[:, at : at + f.nbytes].tobytes()
        at += f.nbytes
        parts.append(column + bytes([fill]) * (align8(len(column)) - len(column)))
    body = bytes([fill]) * (header_len - 32) + b"".join(parts)
    header = _HEADER.pack(
        b"KFDB", 1, 0, header_len, len(records), reserved, schema.fingerprint, len(body)
    )
    return header + body


def oracle_parse(schema: Schema, value: object, fmt: str) -> tuple[str | None, list[bytes]]:
    """One value's verdict: ``(reason, [])`` if rejected, else ``(None, records)``."""
    if value is None:
        return TOMBSTONE, []
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # ValueError: a released memoryview
        return NOT_BYTES, []
    if not view.c_contiguous:
        return NOT_BYTES, []
    data = view.tobytes()
    record_size = schema.record_size
    if fmt == "raw":
        if len(data) != record_size:
            return RAW_SIZE, []
        return None, [data]
    if len(data) < 32:
        return SHORT, []
    magic, version, flags, header_len, count, _reserved, fp, body_len = _HEADER.unpack_from(data)
    if magic != b"KFDB":
        return MAGIC, []
    if version != 1:
        return VERSION, []
    if flags != 0:
        return FLAGS, []
    if header_len < 32 or header_len % 8 or header_len > len(data):
        return HEADER_LEN, []
    if fp != schema.fingerprint:
        return FINGERPRINT, []
    if count > (2**63 - 1) // record_size:
        return COUNT, []
    if body_len != len(data) - 32 or len(data) != oracle_block_nbytes(schema, count, header_len):
        return LENGTH, []
    columns, at = [], header_len
    for f in schema.fields:
        columns.append((at, f.nbytes))
        at += align8(count * f.nbytes)
    return None, [
        b"".join(data[start + i * nb : start + (i + 1) * nb] for start, nb in columns)
        for i in range(count)
    ]


def oracle_decode(
    schema: Schema,
    values: list[object],
    fmt: str,
    capacity: int,
    row: int = 0,
    start: int = 0,
    split: bool = False,
) -> tuple[tuple[int, int, list[tuple[int, str]], int], list[bytes]]:
    """What ``decode_into`` must return, and the records it must write from ``row`` on."""
    records: list[bytes] = []
    bad: list[tuple[int, str]] = []
    i, partial, at = 0, 0, row
    while i < len(values) and at < capacity:
        reason, recs = oracle_parse(schema, values[i], fmt)
        if reason is not None:
            bad.append((i, reason))
            i += 1
            continue
        first = min(start, len(recs)) if i == 0 else 0
        take = len(recs) - first
        if take > capacity - at:
            if not split:
                break
            take = capacity - at
            partial = first + take
        records += recs[first : first + take]
        at += take
        if partial:
            break
        i += 1
    return (at - row, i, bad, partial), records


# -- memory the process may not touch -----------------------------------------

PAGE = mmap.PAGESIZE
PROT_NONE = 0  # mmap has PROT_READ and PROT_WRITE but no name for "neither"
HAVE_GUARD_PAGES = hasattr(mmap, "PROT_READ")  # POSIX: mmap and mprotect
if HAVE_GUARD_PAGES:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def guarded(nbytes: int, *, at_end: bool = True) -> np.ndarray:
    """``nbytes`` of writable memory right before (or, ``at_end=False``, right
    after) a page that may not be touched: crossing that edge is a segfault, not
    a silent access to whatever the allocator put there.

    Without mprotect (Windows), plain memory: the sentinel checks still run.
    """
    if not HAVE_GUARD_PAGES:
        return np.zeros(nbytes, np.uint8)
    pages = max(1, -(-nbytes // PAGE))
    area = mmap.mmap(-1, (pages + 2) * PAGE)
    base = np.frombuffer(area, np.uint8).ctypes.data
    for page in (base, base + (pages + 1) * PAGE):
        if _libc.mprotect(page, PAGE, PROT_NONE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
    offset = PAGE + (pages * PAGE - nbytes if at_end else 0)
    # The array keeps the mapping alive; the mapping goes with the last view.
    return np.frombuffer(area, np.uint8, count=nbytes, offset=offset)


def guarded_bytes(data: bytes, *, at_end: bool = True) -> np.ndarray:
    arr = guarded(len(data), at_end=at_end)
    arr[:] = np.frombuffer(data, np.uint8)
    return arr


# -- output buffers ------------------------------------------------------------

GUARD_ROWS = 2
SENTINEL = 0xA5


Columns = dict[str, np.ndarray]


def sentinel_out(schema: Schema, capacity: int) -> tuple[Columns, Columns]:
    """``(whole, out)``: per field, ``GUARD_ROWS + capacity + GUARD_ROWS`` rows
    of sentinel bytes (ending at a guard page), and ``out``, the contiguous
    window of ``capacity`` rows in the middle that decode may write.
    """
    whole, out = {}, {}
    for f in schema.fields:
        rows = capacity + 2 * GUARD_ROWS
        raw = guarded(rows * f.nbytes)
        raw[:] = SENTINEL
        whole[f.name] = raw.reshape(rows, f.nbytes)
        arr = raw.view(f.storage).reshape(rows, *f.shape)
        out[f.name] = arr[GUARD_ROWS : GUARD_ROWS + capacity]
    return whole, out


def check_decode(
    schema: Schema,
    values: list[object],
    fmt: str,
    *,
    capacity: int,
    row: int = 0,
    start: int = 0,
    split: bool = False,
):
    """Decode ``values``, check the result and every output byte; return the result."""
    whole, out = sentinel_out(schema, capacity)
    expected, records = oracle_decode(schema, values, fmt, capacity, row, start, split)
    result = schema.decode_into(values, out, row, fmt, start=start, split=split)

    # What must hold whatever the oracle says.
    indices = [i for i, _ in result.bad]
    assert indices == sorted(set(indices)), result
    assert all(0 <= i < result.consumed for i in indices), result
    assert result.consumed <= len(values) and row + result.rows <= capacity, result
    assert result.partial == 0 or (split and fmt == "block"), result
    assert tuple(result) == expected, (
        f"decode gave {tuple(result)}, the format says {expected}"
    )

    # Every byte outside the rows written is still the sentinel; the rows
    # written are exactly the good values' records.
    if records:
        written = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), -1)
    at = 0
    for f in schema.fields:
        want = np.full_like(whole[f.name], SENTINEL)
        if records:
            lo = GUARD_ROWS + row
            want[lo : lo + len(records)] = written[:, at : at + f.nbytes]
        at += f.nbytes
        np.testing.assert_array_equal(whole[f.name], want, err_msg=f"field {f.name!r}")
    return result


# -- value builders ------------------------------------------------------------


def random_records(schema: Schema, n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, (n, schema.record_size), dtype=np.uint8)


def good_value(
    schema: Schema, fmt: str, rng: np.random.Generator, n: int = 2, extra: int = 0
) -> bytes:
    """A valid value: one raw record, or a block of ``n`` records whose header
    is ``32 + 8 * extra`` bytes, with random reserved, extension and padding bytes.
    """
    if fmt == "raw":
        return random_records(schema, 1, rng).tobytes()
    fill = int(rng.integers(0, 256))
    reserved = int(rng.integers(0, 2**32))
    records = random_records(schema, n, rng)
    return oracle_block(schema, records, header_len=32 + 8 * extra, reserved=reserved, fill=fill)


def patched(value: bytes, offset: int, fmt: str, field: int) -> bytes:
    b = bytearray(value)
    struct.pack_into(fmt, b, offset, field)
    return bytes(b)


WRAPS = (
    "bytes",
    "bytearray",
    "memoryview",
    "memoryview-slice",
    "numpy",
    "numpy-words",
    "guard-after",
    "guard-before",
    "fortran",
    "strided",
    "released",
)


def wrap(data: bytes, how: str) -> object:
    """``data`` as another kind of value (some of which are not bytes-like)."""
    if how == "bytes":
        return data
    if how == "bytearray":
        return bytearray(data)
    if how == "memoryview":
        return memoryview(data)
    if how == "memoryview-slice":
        return memoryview(b"pad" + data + b"tail")[3 : 3 + len(data)]
    if how == "numpy":
        return np.frombuffer(data, np.uint8)
    if how == "numpy-words":
        return np.frombuffer(data, np.uint16 if len(data) % 2 == 0 else np.uint8)
    if how == "guard-after":
        return memoryview(guarded_bytes(data, at_end=True))
    if how == "guard-before":
        return memoryview(guarded_bytes(data, at_end=False))
    if how == "fortran":  # not C-contiguous once it has two columns or more
        if len(data) >= 4 and len(data) % 2 == 0:
            return np.asfortranarray(np.frombuffer(data, np.uint8).reshape(2, -1))
        return data
    if how == "strided":  # not contiguous once it has two bytes or more
        spread = bytearray(2 * len(data))
        spread[::2] = data
        return memoryview(bytes(spread))[::2]
    if how == "released":
        view = memoryview(data)
        view.release()
        return view
    raise AssertionError(how)


NOT_BYTES_VALUES = [None, "KFDB text", 12345, 3.5, [1, 2, 3], object()]


# -- Hypothesis strategies -------------------------------------------------------


@st.composite
def damaged(draw, schema: Schema, value: bytes, fmt: str) -> bytes:
    """``value`` with one thing wrong (or, by chance, nothing wrong)."""
    n = len(value)
    choices = [
        st.integers(0, max(n - 1, 0)).map(lambda cut: value[:cut]),
        st.binary(min_size=1, max_size=24).map(lambda junk: value + junk),
        st.tuples(st.integers(0, max(n - 1, 0)), st.integers(0, 255)).map(
            lambda at_byte: patched(value, at_byte[0], "<B", at_byte[1]) if n else value
        ),
    ]
    if fmt == "block" and n >= 32:
        count = _HEADER.unpack_from(value)[4]
        fp = schema.fingerprint
        counts = [0, 1, max(count - 1, 0), count + 1, 2 * count + 1, 2**31, 2**32 - 2, 2**32 - 1]
        lengths = [0, 8, 24, 31, 33, 40, n - n % 8, n, n + 8, 0xFFF8, 0xFFFF]
        choices += [
            st.one_of(st.sampled_from(counts), st.integers(0, 2**32 - 1)).map(
                lambda c: patched(value, 8, "<I", c)
            ),
            st.integers(1, 2**64 - 1).map(lambda x: patched(value, 16, "<Q", fp ^ x)),
            st.one_of(st.sampled_from(lengths), st.integers(0, 0xFFFF)).map(
                lambda h: patched(value, 6, "<H", h)
            ),
            st.one_of(
                st.sampled_from([0, n - 31, max(n - 33, 0), 2**64 - 1]), st.integers(0, 2**64 - 1)
            ).map(lambda b: patched(value, 24, "<Q", b)),
            st.tuples(st.integers(0, 31), st.integers(0, 255)).map(
                lambda at_byte: patched(value, at_byte[0], "<B", at_byte[1])
            ),
            # Oversize with a body_len to match: only the column sizes give it away.
            st.integers(1, 24).map(lambda k: patched(value + bytes(k), 24, "<Q", n + k - 32)),
        ]
    return draw(st.one_of(choices))


@st.composite
def message_value(draw, schema: Schema, fmt: str) -> object:
    """One message value for a ``fmt`` decode: good, damaged, foreign, random or not bytes."""
    kinds = ["good", "good", "damaged", "damaged", "foreign", "random", "header", "not-bytes"]
    kind = draw(st.sampled_from(kinds))
    if kind == "not-bytes":
        return draw(st.sampled_from(NOT_BYTES_VALUES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n, extra = draw(st.integers(0, 4)), draw(st.integers(0, 3))
    if kind == "random":
        data = draw(st.binary(max_size=2 * oracle_block_nbytes(schema, 2)))
    elif kind == "header":
        # A plausible header for this schema in front of random bytes.
        count = draw(st.integers(0, 6))
        body = draw(st.binary(max_size=oracle_block_nbytes(schema, 6)))
        data = _HEADER.pack(b"KFDB", 1, 0, 32, count, 0, schema.fingerprint, len(body)) + body
    elif kind == "foreign":  # a good value of the other format
        data = good_value(schema, "raw" if fmt == "block" else "block", rng, n, extra)
    else:
        data = good_value(schema, fmt, rng, n, extra)
        if kind == "damaged":
            data = draw(damaged(schema, data, fmt))
    return wrap(data, draw(st.sampled_from(WRAPS)))


@st.composite
def decode_calls(draw, schema: Schema, fmt: str) -> dict:
    values = draw(st.lists(message_value(schema, fmt), max_size=8))
    capacity = draw(st.integers(0, 12))
    return {
        "values": values,
        "capacity": capacity,
        "row": draw(st.integers(0, capacity)),
        "start": draw(st.integers(0, 5)) if fmt == "block" else 0,
        "split": draw(st.booleans()),
    }


# -- properties --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(SCHEMAS))
@PROPERTY
@given(data=st.data())
def test_decode_follows_the_format_and_writes_nowhere_else(name, fmt, data):
    schema = SCHEMAS[name]
    call = data.draw(decode_calls(schema, fmt))
    check_decode(schema, call.pop("values"), fmt, **call)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
@SOAK
@given(data=st.data())
def test_soak_decode_follows_the_format_and_writes_nowhere_else(fmt, data):
    schema = SCHEMAS[data.draw(st.sampled_from(sorted(SCHEMAS)))]
    call = data.draw(decode_calls(schema, fmt))
    check_decode(schema, call.pop("values"), fmt, **call)


# -- every cut, count, header length, fingerprint bit --------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(SCHEMAS))
@PROPERTY
@given(data=st.data())
def test_held_values_follow_the_format_and_gather_reads_nowhere_else(name, fmt, data):
    """``Schema.hold``: a shuffle's values, checked whole, records gathered by item.

    Each value's verdict is the oracle's; the records of the good ones,
    gathered in any order a few at a time (some dropped instead), arrive
    whole in the rows asked for and nowhere else, from their values or
    from the rows kept when a value was compacted; an item that names no
    record held (made up, or gathered already) is an IndexError that
    changes nothing; once every record went, nothing is held.
    """
    schema = SCHEMAS[name]
    values = data.draw(st.lists(message_value(schema, fmt), max_size=8))
    n = len(values)
    held = schema.hold(fmt, limit=data.draw(st.sampled_from([0, 1, 10**9])))
    recs, counts, bad = held.add(values, np.arange(n, dtype=np.int64),
                                 np.arange(n, dtype=np.int64) * 7)
    verdicts = [oracle_parse(schema, v, fmt) for v in values]
    assert bad == [(i, why) for i, (why, _) in enumerate(verdicts) if why is not None]
    assert counts.tolist() == [len(records) for _, records in verdicts]
    keys = [(i, 7 * i, k) for i, (_, records) in enumerate(verdicts) for k in range(len(records))]
    assert [tuple(r) for r in recs[:, :3].tolist()] == keys
    records = [r for _, rs in verdicts for r in rs]
    assert held.records == len(records)
    items = recs[:, 3].copy()
    whole, out = sentinel_out(schema, len(records))
    target = schema.bind(out)
    order = data.draw(st.permutations(range(len(records))))
    made_up = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3))
    written: dict[int, bytes] = {}  # row -> record
    at = 0
    while at < len(order):
        k = data.draw(st.integers(1, len(order) - at))
        picked = np.array(order[at : at + k], np.int64)
        for bogus in made_up:
            if bogus not in set(items[order[at:]].tolist()):
                with pytest.raises(IndexError):
                    held.gather(np.append(items[picked], bogus), target.out, 0)
        if data.draw(st.booleans()):
            row = data.draw(st.integers(0, len(records) - k))
            held.gather(items[picked], target.out, row)
            for j, r in enumerate(picked.tolist()):
                written[row + j] = records[r]
        else:
            held.drop(items[picked])
        with pytest.raises(IndexError):  # gone now
            held.drop(items[picked[:1]])
        at += k
        if data.draw(st.booleans()):  # an add of nothing: past the limit, compaction
            held.add([], np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert (held.values, held.records, held.nbytes) == (0, 0, 0)
    col = 0
    for f in schema.fields:
        want = np.full_like(whole[f.name], SENTINEL)
        for row, rec in written.items():
            want[GUARD_ROWS + row] = np.frombuffer(rec[col : col + f.nbytes], np.uint8)
        col += f.nbytes
        np.testing.assert_array_equal(whole[f.name], want, err_msg=f"field {f.name!r}")


def around(schema: Schema, fmt: str, bad: object, seed: int = 0) -> list[object]:
    """``bad`` between good values, and again at both ends."""
    rng = np.random.default_rng(seed)
    good = [good_value(schema, fmt, rng, n) for n in (1, 2)]
    return [bad, good[0], bad, good[1], bad]


def assert_rejected_around(schema: Schema, fmt: str, bad: object, reason: str) -> None:
    values = around(schema, fmt, bad)
    result = check_decode(schema, values, fmt, capacity=8)
    assert result.bad == [(0, reason), (2, reason), (4, reason)]
    assert (result.rows, result.consumed) == ((3, 5) if fmt == "block" else (2, 5))


@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_block_cut_anywhere_is_rejected_whole(name, n, extra):
    schema = SCHEMAS[name]
    value = good_value(schema, "block", np.random.default_rng(n), n, extra)
    header_len = 32 + 8 * extra
    for cut in range(len(value)):
        reason = SHORT if cut < 32 else HEADER_LEN if cut < header_len else LENGTH
        # Against a guard page: reading one byte past the cut would crash.
        bad = memoryview(guarded_bytes(value[:cut]))
        result = check_decode(schema, [value, bad, value], "block", capacity=2 * n + 1)
        assert result.bad == [(1, reason)], cut


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_raw_value_of_any_other_size_is_rejected_whole(name):
    schema = SCHEMAS[name]
    good = good_value(schema, "raw", np.random.default_rng(0))
    for size in range(2 * schema.record_size + 2):
        data = (good * 3)[:size]
        after, before = guarded_bytes(data), guarded_bytes(data, at_end=False)
        values = [good, memoryview(after), memoryview(before), good]
        result = check_decode(schema, values, "raw", capacity=4)
        if size == schema.record_size:
            assert (result.rows, result.bad) == (4, [])
        else:
            assert (result.rows, result.bad) == (2, [(1, RAW_SIZE), (2, RAW_SIZE)])


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_rewritten_count_is_rejected_unless_the_lengths_still_add_up(name):
    schema = SCHEMAS[name]
    n = 3
    value = good_value(schema, "block", np.random.default_rng(1), n)
    for count in sorted({0, 1, n - 1, n + 1, n + 7, 2 * n, 2**16, 2**31, 2**32 - 2, 2**32 - 1}):
        forged = patched(value, 8, "<I", count)
        if oracle_block_nbytes(schema, count) == len(value):
            # Only a schema whose every row is under 8 bytes has such counts
            # (see test_a_count_within_the_column_padding_is_not_detected).
            assert all(f.nbytes < 8 for f in schema.fields)
            check_decode(schema, around(schema, "block", forged), "block", capacity=3 + count)
        else:
            assert_rejected_around(schema, "block", forged, LENGTH)


def test_a_count_within_the_column_padding_is_not_detected():
    # A limit of format version 1, not a codec bug: when every row is shorter
    # than 8 bytes, several counts give the same padded length, and the count
    # field is the only thing that tells them apart. A forged count there
    # decodes the padding as whole records. Kafka's record-batch CRC guards
    # against corruption on the way, and a writer that forges counts could as
    # well write any records it likes.
    schema = SCHEMAS["bool"]
    value = oracle_block(schema, np.array([[1], [0]], np.uint8), fill=7)  # 2 rows + 6 padding
    for count in range(3, 9):
        whole, out = sentinel_out(schema, 8)
        result = schema.decode_into([patched(value, 8, "<I", count)], out)
        assert (result.rows, result.bad) == (count, [])
        assert out["x"][:count].view(np.uint8).tolist() == [1, 0] + [7] * (count - 2)
    assert_rejected_around(schema, "block", patched(value, 8, "<I", 9), LENGTH)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_header_length_is_checked(name):
    # All 65,536 values of the header_len field in one call.
    schema = SCHEMAS[name]
    value = good_value(schema, "block", np.random.default_rng(2), 2, extra=1)
    values = [patched(value, 6, "<H", h) for h in range(1 << 16)]
    whole, out = sentinel_out(schema, 4)
    result = schema.decode_into(values, out)
    assert result.rows == 2 and result.consumed == len(values)
    expected = [
        (h, HEADER_LEN if h < 32 or h % 8 or h > len(value) else LENGTH)
        for h in range(1 << 16)
        if h != 40
    ]
    assert result.bad == expected
    check_decode(schema, values[:48] + values[-8:], "block", capacity=4)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_fingerprint_bit_is_checked(name):
    schema = SCHEMAS[name]
    value = good_value(schema, "block", np.random.default_rng(3), 1)
    for bit in range(64):
        forged = patched(value, 16, "<Q", schema.fingerprint ^ (1 << bit))
        assert_rejected_around(schema, "block", forged, FINGERPRINT)
    # Another schema's block, record size and all.
    other = Schema({f"_{f.name}": (f.dtype, f.shape) for f in schema.fields})
    foreign = good_value(other, "block", np.random.default_rng(3), 1)
    assert_rejected_around(schema, "block", foreign, FINGERPRINT)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_oversize_values_are_rejected_whole(name):
    schema = SCHEMAS[name]
    value = good_value(schema, "block", np.random.default_rng(4), 2)
    for k in range(1, 65):
        junk = bytes(range(k))
        assert_rejected_around(schema, "block", value + junk, LENGTH)
        # With body_len to match, the column sizes still give it away.
        matching = patched(value + junk, 24, "<Q", len(value) + k - 32)
        assert_rejected_around(schema, "block", matching, LENGTH)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_length_values_tombstones_and_non_bytes_are_rejected_whole(fmt):
    schema = SCHEMAS["odd"]
    empty_reason = SHORT if fmt == "block" else RAW_SIZE
    empties = (b"", bytearray(), memoryview(b""), np.empty(0, np.uint8), memoryview(b"abc")[1:1])
    for empty in empties:
        assert_rejected_around(schema, fmt, empty, empty_reason)
    for value in NOT_BYTES_VALUES:
        assert_rejected_around(schema, fmt, value, TOMBSTONE if value is None else NOT_BYTES)
    good = good_value(schema, fmt, np.random.default_rng(5))
    for how in ("fortran", "strided", "released"):
        assert_rejected_around(schema, fmt, wrap(good, how), NOT_BYTES)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_block_and_raw_values_mixed_in_one_call(name, fmt):
    schema = SCHEMAS[name]
    rng = np.random.default_rng(6)
    values = []
    for i in range(12):
        data = good_value(schema, FORMATS[i % 2], rng, i % 4, i % 3)
        values.append(wrap(data, WRAPS[i % len(WRAPS)]))
    check_decode(schema, values, fmt, capacity=40)


def untouchable(nbytes: int) -> np.ndarray:
    """``nbytes`` of address space that may be neither read nor written, as a uint8 array.

    Any touch is a segfault, and it costs no memory however big it is: an
    output over it proves a decode wrote nothing.
    """
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_long]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = _libc.mmap(None, nbytes, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
    weakref.finalize(arr, _libc.munmap, addr, nbytes)
    return arr


@pytest.mark.skipif(not HAVE_GUARD_PAGES, reason="needs POSIX mmap")
@pytest.mark.parametrize("shape", [(2**31 + 1,), (2**33,)])
def test_a_count_whose_size_would_wrap_around_is_refused(shape, monkeypatch):
    # The block is rejected before any size computation could overflow. The
    # one-row output lies over memory nothing may touch: a write would crash.
    # (A Schema refuses records over 2 GiB, Kafka's largest message; the codec
    # checks anyway.)
    monkeypatch.setattr(schema_module, "_MAX_RECORD", 2**40)
    schema = Schema({"big": ("uint8", shape)})
    limit = (2**63 - 1) // schema.record_size
    assert limit < 2**32 - 1
    target = schema.bind({"big": untouchable(schema.record_size).reshape(1, *shape)})
    assert target.capacity == 1

    def header(count: int) -> bytes:
        return _HEADER.pack(b"KFDB", 1, 0, 32, count, 0, schema.fingerprint, 0)

    counts = [2**32 - 1, limit + 1, limit, 1, 0]
    result = schema.decode_into([header(c) for c in counts], target)
    assert result == (0, 5, [(0, COUNT), (1, COUNT), (2, LENGTH), (3, LENGTH)], 0)


def test_a_start_past_any_block_is_a_config_error():
    schema = SCHEMAS["small"]
    value = good_value(schema, "block", np.random.default_rng(7), 2)
    whole, out = sentinel_out(schema, 2)
    assert schema.decode_into([value], out, start=2**32 - 1) == (0, 1, [], 0)
    with pytest.raises(ConfigError, match="start"):
        schema.decode_into([value], out, start=2**64)


# -- decode_documents: schemas with a variable-length field ------------------------

DOC_SCHEMAS = {
    # The variable-length field alone: raw values too, 4-byte elements.
    "tokens": Schema({"tokens": ("int32", (None,))}),
    # 1-byte elements: every element count but multiples of 8 needs padding.
    "bytes": Schema({"t": ("uint8", (None,))}),
    # Fixed fields on both sides, odd row sizes, 2-byte elements.
    "mixed": Schema({"a": ("bool", ()), "t": ("uint16", (None,)), "w": ("float16", (3,))}),
    "last": Schema({"x": ("int64", (2,)), "t": ("int64", (None,))}),
}
# Raw values hold the variable-length field only.
DOC_CALLS = [(name, "block") for name in DOC_SCHEMAS] + [
    (name, "raw") for name, s in DOC_SCHEMAS.items() if len(s.fields) == 1
]

# A document: its elements' bytes, and per field its row's bytes (None at the
# variable-length field).
Doc = tuple[bytes, tuple[bytes | None, ...]]


def doc_itemsize(schema: Schema) -> int:
    return schema.varlen.storage.itemsize


def fixed_size(schema: Schema) -> int:
    return sum(f.nbytes for f in schema.fields)


def oracle_doc_nbytes(schema: Schema, count: int, elements: int, header_len: int = 32) -> int:
    total = header_len
    for f in schema.fields:
        if f.variable:
            total += align8(4 * (count + 1)) + align8(elements * f.storage.itemsize)
        else:
            total += align8(count * f.nbytes)
    return total


def oracle_doc_block(schema: Schema, docs: list[Doc], *, header_len: int = 32,
                     reserved: int = 0, fill: int = 0) -> bytes:
    """A valid block of ``docs``; ``fill`` goes into the extension and the padding."""
    isz = doc_itemsize(schema)
    parts = []
    for i, f in enumerate(schema.fields):
        if f.variable:
            offsets = [0]
            for elements, _rows in docs:
                offsets.append(offsets[-1] + len(elements) // isz)
            parts.append(struct.pack(f"<{len(offsets)}I", *offsets))
            parts.append(b"".join(elements for elements, _rows in docs))
        else:
            parts.append(b"".join(rows[i] for _elements, rows in docs))
    body = bytes([fill]) * (header_len - 32) + b"".join(
        p + bytes([fill]) * (align8(len(p)) - len(p)) for p in parts
    )
    header = _HEADER.pack(b"KFDB", 1, 1, header_len, len(docs), reserved, schema.fingerprint,
                          len(body))
    return header + body


def oracle_parse_documents(schema: Schema, value: object, fmt: str) -> tuple[str | None, list[Doc]]:
    """One value's verdict: ``(reason, [])`` if rejected, else ``(None, documents)``."""
    if value is None:
        return TOMBSTONE, []
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return NOT_BYTES, []
    if not view.c_contiguous:
        return NOT_BYTES, []
    data = view.tobytes()
    isz = doc_itemsize(schema)
    if fmt == "raw":
        if len(data) % isz:
            return RAW_ITEMSIZE, []
        return None, [(data, (None,))]
    if len(data) < 32:
        return SHORT, []
    magic, version, flags, header_len, count, _reserved, fp, body_len = _HEADER.unpack_from(data)
    if magic != b"KFDB":
        return MAGIC, []
    if version != 1:
        return VERSION, []
    if flags != 1:
        return FLAGS, []
    if header_len < 32 or header_len % 8 or header_len > len(data):
        return HEADER_LEN, []
    if fp != schema.fingerprint:
        return FINGERPRINT, []
    if count > (2**63 - 1) // (fixed_size(schema) + 4):
        return COUNT, []
    if body_len != len(data) - 32:
        return LENGTH, []
    at, where = header_len, []
    for f in schema.fields:
        if f.variable:
            table = at
            break
        where.append(at)
        at += align8(count * f.nbytes)
    if table + 4 * (count + 1) > len(data):
        return LENGTH, []
    offsets = struct.unpack_from(f"<{count + 1}I", data, table)
    if offsets[0] != 0:
        return OFFSETS_START, []
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        return OFFSETS_ORDER, []
    if oracle_doc_nbytes(schema, count, offsets[-1], header_len) != len(data):
        return OFFSETS_END, []
    at, starts = header_len, []
    for f in schema.fields:
        starts.append(at)
        if f.variable:
            elements_at = at + align8(4 * (count + 1))
            at = elements_at + align8(offsets[-1] * isz)
        else:
            at += align8(count * f.nbytes)
    docs = []
    for d in range(count):
        rows = tuple(None if f.variable else data[c + d * f.nbytes : c + (d + 1) * f.nbytes]
                     for f, c in zip(schema.fields, starts))
        docs.append((data[elements_at + offsets[d] * isz : elements_at + offsets[d + 1] * isz],
                     rows))
    return None, docs


def oracle_decode_documents(schema: Schema, values: list[object], fmt: str, start: int) -> dict:
    """What ``decode_documents`` must give, as plain bytes and lists."""
    isz = doc_itemsize(schema)
    tokens, lengths, counts, bad = [], [], [], []
    columns: dict[str, list[bytes]] = {f.name: [] for f in schema.fields if not f.variable}
    for i, value in enumerate(values):
        reason, docs = oracle_parse_documents(schema, value, fmt)
        if reason is not None:
            bad.append((i, reason))
            counts.append(0)
            continue
        taken = docs[min(start, len(docs)) :] if i == 0 else docs
        counts.append(len(taken))
        for elements, rows in taken:
            tokens.append(elements)
            lengths.append(len(elements) // isz)
            for f, row in zip(schema.fields, rows):
                if not f.variable:
                    columns[f.name].append(row)
    return {"tokens": b"".join(tokens), "lengths": lengths, "counts": counts, "bad": bad,
            "columns": {name: b"".join(rows) for name, rows in columns.items()}}


def check_documents(schema: Schema, values: list[object], fmt: str, start: int = 0):
    """Decode ``values`` into documents and check every output byte against the oracle."""
    want = oracle_decode_documents(schema, values, fmt, start)
    got = schema.decode_documents(values, fmt, start=start)
    assert got.bad == want["bad"]
    assert got.counts.tolist() == want["counts"]
    assert got.lengths.tolist() == want["lengths"]
    assert got.tokens.dtype == schema.varlen.storage and got.tokens.ndim == 1
    assert got.tokens.tobytes() == want["tokens"]
    assert set(got.columns) == set(want["columns"])
    for f in schema.fields:
        if not f.variable:
            column = got.columns[f.name]
            assert column.shape == (len(want["lengths"]), *f.shape), f.name
            assert column.tobytes() == want["columns"][f.name], f.name
    return got


def random_docs(schema: Schema, n: int, rng: np.random.Generator) -> list[Doc]:
    isz = doc_itemsize(schema)
    docs = []
    for _ in range(n):
        elements = rng.integers(0, 256, int(rng.integers(0, 7)) * isz, dtype=np.uint8).tobytes()
        rows = tuple(None if f.variable else rng.integers(0, 256, f.nbytes, np.uint8).tobytes()
                     for f in schema.fields)
        docs.append((elements, rows))
    return docs


def good_doc_value(schema: Schema, fmt: str, rng: np.random.Generator, n: int = 2,
                   extra: int = 0) -> bytes:
    """A valid value: one raw document, or a block of ``n`` documents whose header
    is ``32 + 8 * extra`` bytes, with random reserved, extension and padding bytes.
    """
    if fmt == "raw":
        return random_docs(schema, 1, rng)[0][0]
    return oracle_doc_block(schema, random_docs(schema, n, rng), header_len=32 + 8 * extra,
                            reserved=int(rng.integers(0, 2**32)),
                            fill=int(rng.integers(0, 256)))


def offsets_table(schema: Schema, value: bytes) -> int:
    """Where a well-formed block's offsets table starts."""
    header_len, count = _HEADER.unpack_from(value)[3], _HEADER.unpack_from(value)[4]
    at = header_len
    for f in schema.fields:
        if f.variable:
            return at
        at += align8(count * f.nbytes)
    raise AssertionError("no variable-length field")


@st.composite
def damaged_offsets(draw, schema: Schema, value: bytes) -> bytes:
    """``value`` with one offset rewritten: to a neighbour's, off by one, or anything."""
    count = _HEADER.unpack_from(value)[4]
    table = offsets_table(schema, value)
    j = draw(st.integers(0, count))
    old = struct.unpack_from("<I", value, table + 4 * j)[0]
    new = draw(st.one_of(st.sampled_from([0, 1, max(old - 1, 0), old + 1, 2**32 - 1]),
                         st.integers(0, 2**32 - 1)))
    return patched(value, table + 4 * j, "<I", new)


@st.composite
def doc_value(draw, schema: Schema, fmt: str) -> object:
    """One message value for a ``fmt`` decode_documents: good, damaged, foreign, random..."""
    kinds = ["good", "good", "damaged", "damaged", "offsets", "foreign", "random", "header",
             "not-bytes"]
    kind = draw(st.sampled_from(kinds))
    if kind == "not-bytes":
        return draw(st.sampled_from(NOT_BYTES_VALUES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n, extra = draw(st.integers(0, 4)), draw(st.integers(0, 3))
    if kind == "random":
        data = draw(st.binary(max_size=2 * oracle_doc_nbytes(schema, 2, 8)))
    elif kind == "header":
        # A plausible header for this schema in front of random bytes.
        count = draw(st.integers(0, 6))
        body = draw(st.binary(max_size=oracle_doc_nbytes(schema, 6, 24)))
        data = _HEADER.pack(b"KFDB", 1, 1, 32, count, 0, schema.fingerprint, len(body)) + body
    elif kind == "foreign":  # a fixed-shape block, or a good value of the other format
        other = draw(st.sampled_from(sorted(SCHEMAS)))
        data = (good_value(SCHEMAS[other], "block", rng, n, extra) if draw(st.booleans())
                else good_doc_value(schema, "raw" if fmt == "block" else "block", rng, n, extra))
    else:
        data = good_doc_value(schema, fmt, rng, n, extra)
        if kind == "damaged":
            data = draw(damaged(schema, data, fmt))
        elif kind == "offsets" and fmt == "block":
            data = draw(damaged_offsets(schema, data))
    return wrap(data, draw(st.sampled_from(WRAPS)))


@pytest.mark.parametrize(("name", "fmt"), DOC_CALLS)
@PROPERTY
@given(data=st.data())
def test_decode_documents_follows_the_format(name, fmt, data):
    schema = DOC_SCHEMAS[name]
    values = data.draw(st.lists(doc_value(schema, fmt), max_size=8))
    start = data.draw(st.integers(0, 5)) if fmt == "block" else 0
    check_documents(schema, values, fmt, start)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
@SOAK
@given(data=st.data())
def test_soak_decode_documents_follows_the_format(fmt, data):
    schema = DOC_SCHEMAS[data.draw(st.sampled_from([n for n, f in DOC_CALLS if f == fmt]))]
    values = data.draw(st.lists(doc_value(schema, fmt), max_size=8))
    start = data.draw(st.integers(0, 5)) if fmt == "block" else 0
    check_documents(schema, values, fmt, start)


@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("name", list(DOC_SCHEMAS))
def test_a_document_block_cut_anywhere_is_rejected_whole(name, n, extra):
    schema = DOC_SCHEMAS[name]
    value = good_doc_value(schema, "block", np.random.default_rng(n), n, extra)
    for cut in range(len(value)):
        # Against a guard page: reading one byte past the cut would crash.
        bad = memoryview(guarded_bytes(value[:cut]))
        got = check_documents(schema, [value, bad, value], "block")
        assert [i for i, _ in got.bad] == [1], cut
        assert got.counts.tolist() == [n, 0, n]


@pytest.mark.parametrize("name", list(DOC_SCHEMAS))
def test_every_offset_rewritten_is_checked(name):
    schema = DOC_SCHEMAS[name]
    value = good_doc_value(schema, "block", np.random.default_rng(8), 4, 1)
    table = offsets_table(schema, value)
    values = [value]
    for j in range(5):
        for new in (0, 1, 2, 7, 8, 2**31, 2**32 - 1):
            values.append(patched(value, table + 4 * j, "<I", new))
    got = check_documents(schema, values, "block", start=2)
    assert got.bad  # most rewrites are caught; the oracle says which
    assert {reason for _, reason in got.bad} <= {OFFSETS_START, OFFSETS_ORDER, OFFSETS_END}


@pytest.mark.parametrize("name", list(DOC_SCHEMAS))
def test_every_document_header_length_is_checked(name):
    schema = DOC_SCHEMAS[name]
    value = good_doc_value(schema, "block", np.random.default_rng(9), 2, extra=1)
    values = [patched(value, 6, "<H", h) for h in range(1 << 16)]
    got = schema.decode_documents(values)
    assert got.counts.tolist() == [2 if h == 40 else 0 for h in range(1 << 16)]
    check_documents(schema, values[:48] + values[-8:], "block")


# -- the build under test ---------------------------------------------------------------


def built_with_bounds_checks(module) -> bool:
    """Whether a compiled Cython module indexes memoryviews with bounds checks.

    Cython emits ``__Pyx_RaiseBufferIndexError``, and with it the message
    below, only into a module where some typed-memoryview indexing is bounds
    checked; the codec indexes some (``offsets[i]`` in the document encoders,
    ``rows[k]`` in ``gather``). The
    ``(axis %zd)`` spelling of the message belongs to Cython's memoryview
    class, which every module carries whatever the directives.
    """
    if hasattr(module, "DEBUG"):
        return bool(module.DEBUG)
    return b"Out of bounds on buffer access (axis %d)" in Path(module.__file__).read_bytes()


def test_the_build_is_the_one_expected():
    expect = os.environ.get("KFEED_EXPECT_DEBUG")
    if expect not in ("0", "1"):
        pytest.skip("set KFEED_EXPECT_DEBUG=1 (or 0) to check which build is under test")
    codec = sys.modules["kfeed._codec"]
    package = Path(kfeed.__file__).resolve().parent
    assert Path(codec.__file__).resolve().parent == package, (codec.__file__, kfeed.__file__)
    if expect == "1":
        assert package != REPO / "src" / "kfeed", (
            f"imported the installed build from {package}; put the debug build first on PYTHONPATH"
        )
        assert built_with_bounds_checks(codec), f"{codec.__file__} has no bounds checks"
    else:
        assert not built_with_bounds_checks(codec), f"{codec.__file__} has bounds checks"


# -- atheris -------------------------------------------------------------------------


def fuzz_one_input(data: bytes) -> None:
    """One atheris input -> one decode, decode_documents, or Avro, Protobuf or JSON
    decode call, checked like the Hypothesis ones."""
    import atheris

    fdp = atheris.FuzzedDataProvider(data)
    kind = fdp.ConsumeIntInRange(0, 3)
    if kind == 1:
        fuzz_documents(fdp)
        return
    if kind == 2:
        fuzz_record_format(fdp)
        return
    schemas = list(SCHEMAS.values())
    schema = schemas[fdp.ConsumeIntInRange(0, len(schemas) - 1)]
    fmt = FORMATS[fdp.ConsumeIntInRange(0, 1)]
    capacity = fdp.ConsumeIntInRange(0, 12)
    row = fdp.ConsumeIntInRange(0, capacity)
    start = fdp.ConsumeIntInRange(0, 5) if fmt == "block" else 0
    split = fdp.ConsumeBool()
    rng = np.random.default_rng(fdp.ConsumeIntInRange(0, 2**32 - 1))
    values: list[object] = []
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        kind = fdp.ConsumeIntInRange(0, 5)
        if kind == 0:
            values.append(NOT_BYTES_VALUES[fdp.ConsumeIntInRange(0, len(NOT_BYTES_VALUES) - 1)])
            continue
        if kind == 1:
            value = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 256))
        else:
            own = fmt if kind != 2 else ("raw" if fmt == "block" else "block")
            n, extra = fdp.ConsumeIntInRange(0, 4), fdp.ConsumeIntInRange(0, 2)
            value = good_value(schema, own, rng, n, extra)
        if kind >= 4:  # damage: header fields, stray bytes, then a new length
            b = bytearray(value)
            if len(b) >= 32 and fdp.ConsumeBool():
                struct.pack_into("<I", b, 8, fdp.ConsumeIntInRange(0, 2**32 - 1))
            if len(b) >= 32 and fdp.ConsumeBool():
                struct.pack_into("<H", b, 6, fdp.ConsumeIntInRange(0, 0xFFFF))
            for _ in range(fdp.ConsumeIntInRange(0, 3)):
                if b:
                    b[fdp.ConsumeIntInRange(0, len(b) - 1)] = fdp.ConsumeIntInRange(0, 255)
            size = fdp.ConsumeIntInRange(0, len(b) + 16)
            value = bytes(b[:size]) + fdp.ConsumeBytes(max(0, size - len(b)))
        values.append(wrap(value, WRAPS[fdp.ConsumeIntInRange(0, len(WRAPS) - 1)]))
    check_decode(schema, values, fmt, capacity=capacity, row=row, start=start, split=split)


def fuzz_documents(fdp) -> None:
    """The rest of an atheris input -> one decode_documents call."""
    name, fmt = DOC_CALLS[fdp.ConsumeIntInRange(0, len(DOC_CALLS) - 1)]
    schema = DOC_SCHEMAS[name]
    start = fdp.ConsumeIntInRange(0, 5) if fmt == "block" else 0
    rng = np.random.default_rng(fdp.ConsumeIntInRange(0, 2**32 - 1))
    values: list[object] = []
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        kind = fdp.ConsumeIntInRange(0, 5)
        if kind == 0:
            values.append(NOT_BYTES_VALUES[fdp.ConsumeIntInRange(0, len(NOT_BYTES_VALUES) - 1)])
            continue
        if kind == 1:
            value = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 256))
        else:
            own = fmt if kind != 2 else ("raw" if fmt == "block" else "block")
            n, extra = fdp.ConsumeIntInRange(0, 4), fdp.ConsumeIntInRange(0, 2)
            value = good_doc_value(schema, own, rng, n, extra)
        if kind >= 4:  # damage: header fields, an offset, stray bytes, then a new length
            b = bytearray(value)
            if len(b) >= 32 and fdp.ConsumeBool():
                struct.pack_into("<I", b, 8, fdp.ConsumeIntInRange(0, 2**32 - 1))
            if len(b) >= 36 and fdp.ConsumeBool():
                at = fdp.ConsumeIntInRange(32, len(b) - 4)
                struct.pack_into("<I", b, at, fdp.ConsumeIntInRange(0, 2**32 - 1))
            for _ in range(fdp.ConsumeIntInRange(0, 3)):
                if b:
                    b[fdp.ConsumeIntInRange(0, len(b) - 1)] = fdp.ConsumeIntInRange(0, 255)
            size = fdp.ConsumeIntInRange(0, len(b) + 16)
            value = bytes(b[:size]) + fdp.ConsumeBytes(max(0, size - len(b)))
        values.append(wrap(value, WRAPS[fdp.ConsumeIntInRange(0, len(WRAPS) - 1)]))
    check_documents(schema, values, fmt, start)


def run_atheris(tmp_path: Path, runs: int) -> None:
    pytest.importorskip("atheris")
    env = {**os.environ, "KFEED_FUZZ_CODEC": sys.modules["kfeed._codec"].__file__}
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            f"-runs={runs}",
            "-seed=1",
            "-max_len=1024",
            "-len_control=0",  # long inputs (many values) from the first run on
            f"-artifact_prefix={tmp_path}/",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def test_atheris_finds_nothing(tmp_path):
    run_atheris(tmp_path, 20 * EXAMPLES)


@pytest.mark.slow
def test_soak_atheris_finds_nothing(tmp_path):
    run_atheris(tmp_path, 400 * EXAMPLES)


# -- Avro: values other services write ------------------------------------------

# Inserted where a varint is read: 10 bytes or more of continuation, then an end.
VARINTS = [b"\xff" * k + b"\x01" for k in (1, 5, 9, 12)]

AVRO_WRITER = {
    "type": "record", "name": "Event", "fields": [
        {"name": "id", "type": "long"},
        {"name": "v", "type": {"type": "array", "items": "float"}},
        {"name": "d", "type": {"type": "array", "items": "double"}},
        {"name": "who", "type": ["null", {"type": "record", "name": "Who", "fields": [
            {"name": "age", "type": "int"},
            {"name": "tags", "type": {"type": "map", "values": "string"}}]}]},
        {"name": "kind", "type": {"type": "enum", "name": "K", "symbols": ["a", "b", "c"]}},
        {"name": "ok", "type": "boolean"},
        {"name": "h", "type": {"type": "fixed", "name": "H", "size": 3}},
        {"name": "note", "type": "string"},
    ],
}
AVRO_SCHEMA = Schema({
    "id": ("int64", ()),
    "v": ("float32", (4,)),
    "d": ("float32", (2,)),
    "age": ("uint8", (), {"source": "who.age", "default": 0}),
    "kind": ("int16", ()),
    "ok": ("bool", ()),
    "h": ("uint8", (3,)),
})


def avro_record(i: int) -> dict:
    return {"id": i, "v": [i + 0.5] * 4, "d": [i * 2.0, -1.0],
            "who": None if i % 2 else {"age": i % 200, "tags": {"x": "y" * (i % 4)}},
            "kind": "abc"[i % 3], "ok": bool(i % 2), "h": bytes([i % 256] * 3),
            "note": "z" * (i % 9)}


def avro_columns(record: dict) -> dict:
    who = record["who"]
    return {"id": record["id"], "v": record["v"], "d": record["d"],
            "age": 0 if who is None else who["age"], "kind": "abc".index(record["kind"]),
            "ok": record["ok"], "h": list(record["h"])}


def avro_value(i: int) -> bytes:
    import io

    import fastavro

    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(AVRO_WRITER), avro_record(i))
    return buf.getvalue()


def check_avro(oracle: list[bytes], at_end: list[bool], capacity: int,
               enums: dict[str, list[str]] | None = None) -> None:
    """Decode ``oracle``'s values (each against a guard page) and check them against fastavro;
    ``enums``: as ``Avro(enums=)`` (a symbol it leaves out makes the record bad)."""
    import io

    import fastavro

    # kfeed skips the strings it does not read, without checking their UTF-8:
    # the oracle reads them as bytes (the same encoding), and a map as the
    # array of (key, value) records its encoding is, so its keys are bytes too.
    def keys_as_bytes(node: object) -> object:
        if isinstance(node, dict) and node.get("type") == "map":
            return {"type": "array", "items": {"type": "record", "name": "entry", "fields": [
                {"name": "key", "type": "bytes"},
                {"name": "value", "type": keys_as_bytes(node["values"])}]}}
        if isinstance(node, dict):
            return {k: keys_as_bytes(v) for k, v in node.items()}
        if isinstance(node, list):
            return [keys_as_bytes(v) for v in node]
        return node

    as_bytes = fastavro.parse_schema(keys_as_bytes(
        json.loads(json.dumps(AVRO_WRITER).replace('"string"', '"bytes"'))))
    # Right against a guard page: a read past the value's end faults.
    values = [guarded_bytes(raw, at_end=end) for raw, end in zip(oracle, at_end, strict=True)]
    whole, out = sentinel_out(AVRO_SCHEMA, capacity)
    before = {k: v.copy() for k, v in whole.items()}
    decoder = kfeed.Avro(schema=AVRO_WRITER, enums=enums).decoder(AVRO_SCHEMA)
    res = decoder.decode_into(values, AVRO_SCHEMA.bind(out), 0)
    assert 0 < res.consumed <= len(values) and res.rows <= capacity
    assert res.rows + len(res.bad) == res.consumed
    bad = {i for i, _ in res.bad}
    good = [i for i in range(res.consumed) if i not in bad]
    for row, i in enumerate(good):
        # What kfeed took, fastavro reads the same (fastavro may take more:
        # it ignores bytes after the record).
        record = fastavro.schemaless_reader(io.BytesIO(oracle[i]), as_bytes, None)
        want = avro_columns(record)
        if enums is not None:  # by name: a symbol left out is never in a row
            want["kind"] = enums["K"].index(record["kind"])
        for f in AVRO_SCHEMA.fields:
            with np.errstate(over="ignore"):  # a flipped double past float32's range: inf
                expect = np.array(want[f.name]).astype(f.storage)
            np.testing.assert_array_equal(out[f.name][row], expect, err_msg=f.name)
    # A rejected record may have begun its row (the one after the last good
    # row), never one outside the output.
    rows_untouched(whole, before, res, capacity, GUARD_ROWS)


@PROPERTY
@given(data=st.data())
def test_avro_values_decode_as_fastavro_reads_them_and_write_nowhere_else(data):
    pytest.importorskip("fastavro")
    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        raw = bytearray(avro_value(data.draw(st.integers(0, 2**40))))
        # Bytes rewritten, cut, grown; a long varint or a huge count where one is read.
        oracle.append(bytes(damage(data, raw, list(range(256)), VARINTS)))
        at_end.append(data.draw(st.booleans()))
    enums = data.draw(st.sampled_from([None, {"K": ["c", "a"]}, {"K": ["b", "c", "a", "z"]}]))
    check_avro(oracle, at_end, data.draw(st.integers(1, len(oracle) + 1)), enums)


# -- Protobuf: values other services write ---------------------------------------


def _event_class() -> type:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="fuzz_event.proto", package="fuzz",
                                             syntax="proto3")
    who = fdp.message_type.add(name="Who")
    who.field.add(name="age", number=1, type=f.TYPE_SINT32, label=f.LABEL_OPTIONAL)
    who.field.add(name="tag", number=2, type=f.TYPE_BYTES, label=f.LABEL_OPTIONAL)
    ev = fdp.message_type.add(name="Event")
    ev.field.add(name="id", number=1, type=f.TYPE_INT64, label=f.LABEL_OPTIONAL)
    ev.field.add(name="v", number=2, type=f.TYPE_FLOAT, label=f.LABEL_REPEATED)
    d = ev.field.add(name="d", number=3, type=f.TYPE_DOUBLE, label=f.LABEL_REPEATED)
    d.options.packed = False
    ev.field.add(name="who", number=4, type=f.TYPE_MESSAGE, type_name=".fuzz.Who",
                 label=f.LABEL_OPTIONAL)
    ev.field.add(name="k", number=5, type=f.TYPE_FIXED32, label=f.LABEL_OPTIONAL)
    ev.field.add(name="ok", number=6, type=f.TYPE_BOOL, label=f.LABEL_OPTIONAL)
    ev.field.add(name="note", number=7, type=f.TYPE_BYTES, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("fuzz.Event"))


PB_SCHEMA = Schema({
    "id": ("int64", ()),
    "v": ("float32", (4,)),
    "d": ("float64", (2,), {"default": 0.0}),
    "age": ("int8", (), {"source": "who.age"}),
    "k": ("uint32", ()),
    "ok": ("bool", ()),
})


def protobuf_value(event: type, i: int) -> bytes:
    m = event(id=i, v=[i + 0.5] * 4, k=i % 2**32, ok=bool(i % 2), note=bytes(i % 7))
    if i % 3:
        m.d.extend([1.0, -2.0])
    if i % 2:
        m.who.age = i % 100 - 50
    return m.SerializeToString()


def check_protobuf(event: type, oracle: list[bytes], at_end: list[bool], capacity: int) -> None:
    """Decode ``oracle``'s values (each against a guard page) and check them against protobuf."""
    values = [guarded_bytes(raw, at_end=end) for raw, end in zip(oracle, at_end, strict=True)]
    whole, out = sentinel_out(PB_SCHEMA, capacity)
    before = {k: v.copy() for k, v in whole.items()}
    res = kfeed.Protobuf(message=event).decoder(PB_SCHEMA).decode_into(
        values, PB_SCHEMA.bind(out), 0)
    assert 0 < res.consumed <= len(values) and res.rows <= capacity
    assert res.rows + len(res.bad) == res.consumed
    bad = {i for i, _ in res.bad}
    for row, i in enumerate(j for j in range(res.consumed) if j not in bad):
        parsed = event.FromString(oracle[i])  # what kfeed took, protobuf parses alike
        assert out["id"][row] == parsed.id and out["k"][row] == parsed.k
        assert out["ok"][row] == parsed.ok and out["age"][row] == parsed.who.age
        np.testing.assert_array_equal(out["v"][row], np.array(parsed.v, np.float32))
        np.testing.assert_array_equal(out["d"][row], np.array(list(parsed.d) or [0.0, 0.0]))
    rows_untouched(whole, before, res, capacity, GUARD_ROWS)


@PROPERTY
@given(data=st.data())
def test_protobuf_values_decode_as_protobuf_parses_them_and_write_nowhere_else(data):
    pytest.importorskip("google.protobuf")
    event = _event_class()
    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        raw = bytearray(protobuf_value(event, data.draw(st.integers(0, 2**40))))
        oracle.append(bytes(damage(data, raw, list(range(256)), VARINTS)))
        at_end.append(data.draw(st.booleans()))
    check_protobuf(event, oracle, at_end, data.draw(st.integers(1, len(oracle) + 1)))


# -- JSON: values other services write ---------------------------------------------

JSON_SCHEMA = Schema({
    "id": ("int64", ()),
    "v": ("float32", (2, 2)),
    "age": ("uint8", (), {"source": "who.age", "default": 0}),
    "ok": ("bool", ()),
})


JSON_FLIPS = list(b'{}[],:"\\0123456789.eE-+ntfu \x00\xff')
JSON_INSERTS = [b"[" * 300, b"9" * 25, b"e999"]


def json_value(i: int) -> bytes:
    event = {"note": "a\"b\\c" * (i % 3), "id": i, "v": [[i / 3, 1e-5], [2.5, -i]],
             "who": None if i % 2 else {"age": i % 200, "tags": [1, {"x": None}]},
             "ok": bool(i % 3)}
    return json.dumps(event).encode()


def json_loads(raw: bytes) -> Any:
    """json.loads of a value kfeed took (its Confluent framing, a zero byte first, skipped):
    kfeed checks every string as json.loads does, so json.loads takes it too."""
    return json.loads(raw[5:] if raw[:1] == b"\x00" else raw)


def check_json(oracle: list[bytes], at_end: list[bool], capacity: int) -> None:
    """Decode ``oracle``'s values (each against a guard page) and check them against json.loads."""
    values = [guarded_bytes(raw, at_end=end) for raw, end in zip(oracle, at_end, strict=True)]
    whole, out = sentinel_out(JSON_SCHEMA, capacity)
    before = {k: v.copy() for k, v in whole.items()}
    res = kfeed.Json().decoder(JSON_SCHEMA).decode_into(values, JSON_SCHEMA.bind(out), 0)
    assert 0 < res.consumed <= len(values) and res.rows <= capacity
    assert res.rows + len(res.bad) == res.consumed
    bad = {i for i, _ in res.bad}
    for row, i in enumerate(j for j in range(res.consumed) if j not in bad):
        record = json_loads(oracle[i])
        who = record.get("who") or {}
        assert out["id"][row] == record["id"] and out["ok"][row] == record["ok"]
        assert out["age"][row] == who.get("age", 0)
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(out["v"][row], np.array(record["v"], np.float32))
    rows_untouched(whole, before, res, capacity, GUARD_ROWS)


@PROPERTY
@given(data=st.data())
def test_json_values_decode_as_json_loads_reads_them_and_write_nowhere_else(data):
    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        raw = bytearray(json_value(data.draw(st.integers(-2**40, 2**40))))
        oracle.append(bytes(damage(data, raw, JSON_FLIPS, JSON_INSERTS)))
        at_end.append(data.draw(st.booleans()))
    check_json(oracle, at_end, data.draw(st.integers(1, len(oracle) + 1)))


# -- Arrow: IPC streams, read by the C reader or through pyarrow -----------------------

ARROW_SCHEMA = Schema({"id": ("int64", ()), "x": ("float32", (3,)), "m": ("uint8", (2, 2))})


def arrow_value(i: int, rows: int) -> bytes:
    from kfeed.arrowformat import ArrowEncoder

    ids = np.arange(i, i + rows)
    cols = {"id": ids, "x": np.stack([ids, -ids, ids / 2], 1).astype(np.float32),
            "m": (ids[:, None, None] + np.arange(4).reshape(1, 2, 2)).astype(np.uint8)}
    return ArrowEncoder(ARROW_SCHEMA).encode_blocks(cols, rows, 1 << 30)[0]


def arrow_oracle(raw: bytes) -> tuple[dict[str, np.ndarray] | None, str]:
    """What pyarrow reads of one value as the schema's columns, or None and why not."""
    import pyarrow as pa

    try:
        table = pa.ipc.open_stream(raw).read_all()
        if table.schema.names != list(ARROW_SCHEMA.names) or any(
                c.null_count for c in table.columns):
            return None, "other columns, or nulls"
        table = table.combine_chunks()
        n = table.num_rows
        return {"id": table["id"].to_numpy(),
                "x": table["x"].combine_chunks().flatten().to_numpy().reshape(n, 3),
                "m": table["m"].combine_chunks().storage.flatten().to_numpy().reshape(n, 2, 2)
                }, ""
    except (pa.ArrowException, OSError, ValueError, TypeError, AttributeError, KeyError) as e:
        return None, str(e)


# What a flatbuffers verifier refuses in metadata the C reader does not read (it
# checks every offset and length it reads, and runs no full verifier).
UNVERIFIED = ("Invalid flatbuffers message", "Unexpected null field")


@PROPERTY
@given(data=st.data())
def test_arrow_values_decode_as_pyarrow_reads_them_and_write_nowhere_else(data):
    from kfeed.arrowformat import ArrowDecoder

    decoder = ArrowDecoder(ARROW_SCHEMA)
    clean = arrow_value(0, 2)
    primer = ARROW_SCHEMA.empty(4)
    decoder.decode_into([clean], ARROW_SCHEMA.bind(primer), 0)  # the C reader's plan made
    assert decoder.cplan is not None
    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        raw = bytearray(arrow_value(data.draw(st.integers(0, 200)), data.draw(st.integers(1, 6))))
        # The schema message is left alone half the time, so the C reader sees the damage.
        head = 8 + int.from_bytes(raw[4:8], "little")
        body = raw[head:] if data.draw(st.booleans()) else raw
        damaged = damage(data, bytearray(body), [0, 1, 2, 3, 0x7F, 0x80, 0xFF],
                         [b"\xff\xff\xff\xff", b"\x00" * 8, b"\xff" * 8])
        oracle.append(bytes(raw[:head] + damaged if body is not raw else damaged))
        at_end.append(data.draw(st.booleans()))
    capacity = data.draw(st.integers(1, 24))
    values = [guarded_bytes(raw, at_end=end) for raw, end in zip(oracle, at_end, strict=True)]
    whole, out = sentinel_out(ARROW_SCHEMA, capacity)
    before = {k: v.copy() for k, v in whole.items()}
    res = decoder.decode_into(values, ARROW_SCHEMA.bind(out), 0, split=True)
    assert res.rows <= capacity and res.consumed <= len(values)
    bad = {i for i, _ in res.bad}
    row = 0
    for i in range(res.consumed + (1 if res.partial else 0)):
        if i in bad:
            continue
        # What kfeed took, pyarrow reads the same.
        want, why = arrow_oracle(oracle[i])
        if want is None:  # only metadata a verifier refuses, in fields kfeed does not read
            assert why.startswith(UNVERIFIED), f"value {i}: kfeed took what pyarrow refuses: {why}"
            return rows_untouched(whole, before, res, capacity, GUARD_ROWS)
        n = len(want["id"])
        if i == res.consumed:  # the value straddling the end of out
            n = res.partial
        for f in ARROW_SCHEMA.fields:
            np.testing.assert_array_equal(out[f.name][row:row + n], want[f.name][:n],
                                          err_msg=f.name)
        row += n
    assert row == res.rows
    rows_untouched(whole, before, res, capacity, GUARD_ROWS)


# Messages the C reader leaves to pyarrow: a dictionary column (with a null in
# its dictionary), fixed-size lists with null rows, and strings, binaries or
# lists into a jagged field, one or two record batches, with their offsets and
# dictionary indices rewritten as well as their bytes.
ARROW_NULLS = Schema({"p": ("int32", (), {"default": -1}),
                      "w": ("float32", (2,), {"default": 0.5}),
                      "s": ("uint8", (None,), {"default": [63]})})
ARROW_DICTIONARY = [10, None, 30, 40]


def arrow_nulls_value(data: st.DataObject) -> bytes:
    import pyarrow as pa

    n = data.draw(st.integers(0, 6))
    idx = data.draw(st.lists(st.none() | st.integers(0, 3), min_size=n, max_size=n))
    p = pa.DictionaryArray.from_arrays(pa.array(idx, pa.int8()),
                                       pa.array(ARROW_DICTIONARY, pa.int32()))
    w = pa.FixedSizeListArray.from_arrays(
        pa.array(np.arange(2 * n, dtype=np.float32)), 2,
        mask=pa.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), pa.bool_()))
    rows = data.draw(st.lists(st.none() | st.lists(st.integers(1, 127), max_size=5),
                              min_size=n, max_size=n))
    kind = data.draw(st.sampled_from(["string", "binary", "list"]))
    if kind == "list":
        col = pa.array(rows, pa.list_(pa.uint8()))
    elif kind == "binary":
        col = pa.array([None if r is None else bytes(r) for r in rows], pa.binary())
    else:
        col = pa.array([None if r is None else bytes(r).decode() for r in rows], pa.string())
    batch = pa.RecordBatch.from_arrays([p, w, col], names=["p", "w", "s"])
    cut = data.draw(st.integers(0, n)) if data.draw(st.booleans()) else None
    parts = [batch] if cut is None else [batch.slice(0, cut), batch.slice(cut)]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        for part in parts:
            writer.write_batch(part)
    return sink.getvalue().to_pybytes()


def arrow_offsets_and_indices(raw: bytes) -> list[tuple[int, int, str]]:
    """Where ``raw``'s offsets and dictionary indices lie: (start, count, struct format)."""
    import pyarrow as pa

    src = pa.py_buffer(raw)
    found = []
    for batch in pa.ipc.open_stream(src):
        n = batch.num_rows
        for col, buf, fmt, count in ((batch.column(0), 1, "<b", n), (batch.column(2), 1, "<i", n + 1)):
            b = col.buffers()[buf]
            if b is not None and b.size and 0 <= b.address - src.address < len(raw):
                found.append((b.address - src.address + col.offset * struct.calcsize(fmt),
                              count, fmt))
    return found


def arrow_nulls_oracle(raw: bytes) -> tuple[dict[str, list] | None, str]:
    """Each field's values as pyarrow reads them (defaults for nulls), or None and why not."""
    import pyarrow as pa

    expected = ["p", "w", "s"]
    try:
        table = pa.ipc.open_stream(raw).read_all()
        table.validate(full=True)
        names = table.schema.names
        # A damaged name is a column of another name: its field, absent, takes
        # its default, as every field of ARROW_NULLS has one.
        if len(names) != 3 or any(n != e and n in expected for n, e in zip(names, expected)):
            return None, f"columns {names}"
        cols = table.to_pydict()
    except (pa.ArrowException, OSError, ValueError, UnicodeDecodeError) as e:
        return None, str(e)
    rows = table.num_rows
    if "p" in names and not pa.types.is_int32(table.schema.field("p").type.value_type):
        return None, "p is not int32"
    cols = {e: cols[e] if e in names else [None] * rows for e in expected}
    if any(w is not None and None in w for w in cols["w"]):
        return None, "a null item in a row that is not null"
    if any(s is not None and not isinstance(s, (str, bytes)) and None in s for s in cols["s"]):
        return None, "a null item in a row that is not null"
    return {"p": [-1 if v is None else v for v in cols["p"]],
            "w": [[0.5, 0.5] if v is None else v for v in cols["w"]],
            "s": [[63] if v is None else list(v.encode() if isinstance(v, str) else v)
                  for v in cols["s"]]}, ""


@PROPERTY
@given(data=st.data())
def test_arrow_messages_pyarrow_reads_follow_it_damaged_offsets_and_indices_too(data):
    from kfeed.arrowformat import ArrowDecoder

    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 4))):
        raw = bytearray(arrow_nulls_value(data))
        how = data.draw(st.sampled_from(["offset or index", "bytes", "none"]))
        places = arrow_offsets_and_indices(bytes(raw))
        if how == "offset or index" and places:
            start, count, fmt = data.draw(st.sampled_from(places))
            at = start + struct.calcsize(fmt) * data.draw(st.integers(0, max(count - 1, 0)))
            old = struct.unpack_from(fmt, raw, at)[0]
            lo, hi = (-128, 127) if fmt == "<b" else (-2**31, 2**31 - 1)
            new = data.draw(st.sampled_from([old - 1, old + 1, 0, -1, 4, hi]) | st.integers(lo, hi))
            struct.pack_into(fmt, raw, at, max(lo, min(hi, new)))
        elif how == "bytes":
            raw = damage(data, raw, [0, 1, 2, 0x7F, 0x80, 0xFF], [b"\xff\xff\xff\xff", b"\x00" * 8],
                         rounds=(1, 3))
        oracle.append(bytes(raw))
        at_end.append(data.draw(st.booleans()))
    values = [guarded_bytes(raw, at_end=end) for raw, end in zip(oracle, at_end, strict=True)]
    docs = ArrowDecoder(ARROW_NULLS).decode_documents(values)
    bad = {i for i, _ in docs.bad}
    assert len(docs.counts) == len(values) and docs.lengths.sum() == len(docs.tokens)
    row = start = 0
    for i, raw in enumerate(oracle):
        if i in bad:
            continue
        want, why = arrow_nulls_oracle(raw)
        assert want is not None, f"value {i}: kfeed took what pyarrow refuses: {why}"
        n = int(docs.counts[i])
        assert n == len(want["p"])
        assert docs.columns["p"][row:row + n].tolist() == want["p"]
        assert docs.columns["w"][row:row + n].tolist() == want["w"]
        for k in range(n):
            length = int(docs.lengths[row + k])
            assert docs.tokens[start:start + length].tolist() == want["s"][k]
            start += length
        row += n
    assert row == len(docs.lengths)


TOKENS_AT = Schema({"tokens": ("int16", (None,), {"source": "doc.ids"})})


def json_document(i: int) -> bytes:
    doc = {"id": i, "doc": {"ids": [(i * 7919 + k) % 40000 - 20000 for k in range(i % 40)],
                            "text": "q\"" * (i % 3), "age": i % 300}, "z": [None, {"ids": 1}]}
    if i % 5 == 0:
        doc["doc"]["ids"].append(2**20)  # does not fit int16: a bad record
    if i % 7 == 3:
        doc["doc"]["ids"] = None  # the default, or a bad record
    return json.dumps(doc).encode()


def check_format_documents(decoder: Any, oracle: list[bytes], at_end: list[bool],
                    parse: Any) -> None:
    """Token documents out of ``oracle``'s values (guard pages), each against ``parse``.

    ``parse(raw)`` gives a value's document as the format's own reader sees
    it, or None where that reader refuses what kfeed skipped unread.
    """
    values = [guarded_bytes(raw, at_end=end) for raw, end in zip(oracle, at_end, strict=True)]
    docs = decoder.decode_documents(values)
    assert len(docs.counts) == len(values) and docs.lengths.sum() == len(docs.tokens)
    bad = {i for i, _ in docs.bad}
    assert {i for i, c in enumerate(docs.counts) if c == 0} == bad
    start = 0
    for i, raw in enumerate(oracle):
        if i in bad:
            continue
        n = docs.lengths[docs.counts[:i].sum()]
        want = parse(raw)
        if want is not None:
            np.testing.assert_array_equal(docs.tokens[start:start + n],
                                          np.array(want, docs.tokens.dtype))
        start += n


def json_ids(raw: bytes) -> list | None:
    return json_loads(raw)["doc"]["ids"]


def check_json_documents(oracle: list[bytes], at_end: list[bool]) -> None:
    check_format_documents(kfeed.Json().decoder(TOKENS_AT), oracle, at_end, json_ids)


# A jagged field beside fixed ones, read in the same pass (defaults for both kinds).
JAGGED_AT = Schema({"id": ("int64", ()),
                    "ids": ("int16", (None,), {"source": "doc.ids", "default": [7, 7]}),
                    "age": ("uint8", (), {"source": "doc.age", "default": 9})})


def check_json_jagged(oracle: list[bytes], at_end: list[bool]) -> None:
    """Documents and rows of ``oracle``'s values (guard pages), each against json.loads."""
    values = [guarded_bytes(raw, at_end=end) for raw, end in zip(oracle, at_end, strict=True)]
    docs = kfeed.Json().decoder(JAGGED_AT).decode_documents(values)
    assert len(docs.counts) == len(values) and docs.lengths.sum() == len(docs.tokens)
    bad = {i for i, _ in docs.bad}
    assert {i for i, c in enumerate(docs.counts) if c == 0} == bad
    good = [i for i in range(len(values)) if i not in bad]
    assert all(len(docs.columns[k]) == len(good) for k in ("id", "age"))
    start = 0
    for row, i in enumerate(good):
        n = docs.lengths[row]
        record = json_loads(oracle[i])
        doc = record.get("doc") or {}
        ids = [7, 7] if doc.get("ids") is None else doc["ids"]
        np.testing.assert_array_equal(docs.tokens[start:start + n], np.array(ids, np.int16))
        assert docs.columns["id"][row] == record["id"]
        assert docs.columns["age"][row] == (9 if doc.get("age") is None else doc["age"])
        start += n


@PROPERTY
@given(data=st.data())
def test_json_jagged_fields_read_as_json_loads_reads_them(data):
    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        raw = bytearray(json_document(data.draw(st.integers(0, 2**20))))
        oracle.append(bytes(damage(data, raw, JSON_FLIPS, JSON_INSERTS)))
        at_end.append(data.draw(st.booleans()))
    check_json_jagged(oracle, at_end)


def test_json_jagged_repeated_keys_null_and_missing_read_as_json_loads_reads_them():
    values = [b'{"id": 1, "doc": {"ids": [1, 2], "ids": [3]}}',
              b'{"id": 2, "doc": {"ids": [1, 2]}, "doc": {"age": 4}}',
              b'{"id": 3, "doc": null}',
              b'{"id": 4, "doc": {"ids": null, "age": null}}',
              b'{"id": 5}',
              b'{"doc": {"ids": [5]}}',
              b'{"id": 6, "doc": {"ids": [40000]}}',
              b'{"id": 7, "doc": {"ids": [], "age": 300}}',
              b'{"id": 8, "doc": {"ids": "ab"}}',
              b'{"id": 9, "doc": {"age": 4}, "doc": {"ids": [1]}}']
    check_json_jagged(values, [True] * len(values))
    docs = kfeed.Json().decoder(JAGGED_AT).decode_documents(values)
    assert docs.columns["id"].tolist() == [1, 2, 3, 4, 5, 9]
    assert docs.columns["age"].tolist() == [9, 4, 9, 9, 9, 9]  # the last "doc" has none
    assert docs.lengths.tolist() == [1, 2, 2, 2, 2, 1] and docs.tokens.tolist()[:3] == [3, 7, 7]
    assert dict(docs.bad) == {
        5: "field 'id': missing or null, and no default",
        6: "a number that does not fit the field's dtype at doc.ids",
        7: "a number that does not fit the field's dtype at doc.age",
        8: "a value of another kind than the field's at doc.ids"}
    # Rows alone too: an object's key again drops what the first one gave its fields.
    rows = [b'{"id": 1, "v": [[1, 2], [3, 4]], "ok": true, "who": {"age": 4}, "who": {}}',
            b'{"id": 2, "v": [[1, 2], [3, 4]], "ok": true, "who": {}, "who": {"age": 5}}']
    whole, out = sentinel_out(JSON_SCHEMA, 2)
    res = kfeed.Json().decoder(JSON_SCHEMA).decode_into(rows, JSON_SCHEMA.bind(out), 0)
    assert (res.rows, res.bad) == (2, []) and out["age"].tolist() == [0, 5]


TEXT_AT = Schema({"text": ("uint8", (None,), {"source": "doc.text"})})


def json_text(raw: bytes) -> list | None:
    text = json_loads(raw)["doc"]["text"]
    return list(text.encode("utf-8", "surrogatepass"))


@PROPERTY
@given(data=st.data())
def test_json_strings_read_as_bytes_as_json_loads_reads_them(data):
    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        raw = bytearray(json_document(data.draw(st.integers(0, 2**20))))
        oracle.append(bytes(damage(data, raw, JSON_FLIPS + list(b"u\\"),
                                   JSON_INSERTS + [b"\\u00e9", b"\\ud83d\\ude00", b"\\u12"])))
        at_end.append(data.draw(st.booleans()))
    check_format_documents(kfeed.Json().decoder(TEXT_AT), oracle, at_end, json_text)


AVRO_DOC_WRITER = {
    "type": "record", "name": "Doc", "fields": [
        {"name": "id", "type": "long"},
        {"name": "doc", "type": {"type": "record", "name": "D", "fields": [
            {"name": "text", "type": "string"},
            {"name": "ids", "type": ["null", {"type": "array", "items": "int"}]}]}},
    ],
}


def avro_document(i: int) -> bytes:
    import io

    import fastavro

    ids = [(i * 7919 + k) % 40000 - 20000 for k in range(i % 40)]
    if i % 5 == 0:
        ids.append(2**20)  # does not fit int16: a bad record
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(AVRO_DOC_WRITER), {
        "id": i, "doc": {"text": "q" * (i % 3), "ids": None if i % 7 == 0 else ids}})
    return buf.getvalue()


def check_avro_documents(oracle: list[bytes], at_end: list[bool]) -> None:
    import io

    import fastavro

    as_bytes = fastavro.parse_schema(
        json.loads(json.dumps(AVRO_DOC_WRITER).replace('"string"', '"bytes"')))
    decoder = kfeed.Avro(schema=AVRO_DOC_WRITER).decoder(TOKENS_AT)
    check_format_documents(decoder, oracle, at_end,
                           lambda raw: fastavro.schemaless_reader(io.BytesIO(raw), as_bytes,
                                                                  None)["doc"]["ids"])


def _doc_class() -> type:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="fuzz_doc.proto", package="fuzzdoc",
                                             syntax="proto3")
    d = fdp.message_type.add(name="D")
    d.field.add(name="text", number=1, type=f.TYPE_BYTES, label=f.LABEL_OPTIONAL)
    d.field.add(name="ids", number=2, type=f.TYPE_SINT32, label=f.LABEL_REPEATED)
    doc = fdp.message_type.add(name="Doc")
    doc.field.add(name="id", number=1, type=f.TYPE_INT64, label=f.LABEL_OPTIONAL)
    doc.field.add(name="doc", number=2, type=f.TYPE_MESSAGE, type_name=".fuzzdoc.D",
                  label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("fuzzdoc.Doc"))


def protobuf_document(doc: type, i: int) -> bytes:
    ids = [(i * 7919 + k) % 40000 - 20000 for k in range(i % 40)]
    if i % 5 == 0:
        ids.append(2**20)  # does not fit int16: a bad record
    m = doc(id=i)
    m.doc.text = b"q" * (i % 3)
    m.doc.ids.extend(ids)
    return m.SerializeToString()


def check_protobuf_documents(doc: type, oracle: list[bytes], at_end: list[bool]) -> None:
    check_format_documents(kfeed.Protobuf(message=doc).decoder(TOKENS_AT), oracle, at_end,
                           lambda raw: list(doc.FromString(raw).doc.ids))


@PROPERTY
@given(data=st.data())
def test_json_token_documents_read_as_json_loads_reads_them(data):
    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        raw = bytearray(json_document(data.draw(st.integers(0, 2**20))))
        oracle.append(bytes(damage(data, raw, JSON_FLIPS, JSON_INSERTS)))
        at_end.append(data.draw(st.booleans()))
    check_json_documents(oracle, at_end)


@PROPERTY
@given(data=st.data())
def test_avro_token_documents_read_as_fastavro_reads_them(data):
    pytest.importorskip("fastavro")
    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        raw = bytearray(avro_document(data.draw(st.integers(0, 2**20))))
        oracle.append(bytes(damage(data, raw, list(range(256)), VARINTS)))
        at_end.append(data.draw(st.booleans()))
    check_avro_documents(oracle, at_end)


@PROPERTY
@given(data=st.data())
def test_protobuf_token_documents_read_as_protobuf_parses_them(data):
    pytest.importorskip("google.protobuf")
    doc = _doc_class()
    oracle, at_end = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        raw = bytearray(protobuf_document(doc, data.draw(st.integers(0, 2**20))))
        oracle.append(bytes(damage(data, raw, list(range(256)), VARINTS)))
        at_end.append(data.draw(st.booleans()))
    check_protobuf_documents(doc, oracle, at_end)


def test_a_sint32_varint_past_32_bits_reads_as_protobuf_reads_it():
    # Found by the test above: protobuf cuts a sint32's varint to 32 bits, then zig-zags.
    pytest.importorskip("google.protobuf")
    doc = _doc_class()
    value = bytes([0x12, 0x07, 0x12, 0x05, 0x81, 0x80, 0x80, 0x80, 0x10])  # 1 + 2**32
    docs = kfeed.Protobuf(message=doc).decoder(TOKENS_AT).decode_documents([value])
    assert docs.tokens.tolist() == list(doc.FromString(value).doc.ids) == [-1]


def fuzz_record_format(fdp) -> None:
    """The rest of an atheris input -> one Avro, Protobuf or JSON decode, checked as above."""
    which = fdp.ConsumeIntInRange(0, 6)
    if which == 1:
        event = _event_class()
    if which == 5:
        doc = _doc_class()
    oracle, at_end = [], []
    for _ in range(fdp.ConsumeIntInRange(1, 5)):
        i = fdp.ConsumeIntInRange(0, 2**40)
        raw = bytearray(avro_value(i) if which == 0 else protobuf_value(event, i) if which == 1
                        else json_value(i - 2**39) if which == 2 else json_document(i)
                        if which in (3, 6) else avro_document(i) if which == 4
                        else protobuf_document(doc, i))
        text = which in (2, 3, 6)
        flips, inserts = (JSON_FLIPS, JSON_INSERTS) if text else (list(range(256)), VARINTS)
        for _ in range(fdp.ConsumeIntInRange(0, 3)):  # as records.damage does
            how = fdp.ConsumeIntInRange(0, 3)
            if how == 0 and raw:
                raw[fdp.ConsumeIntInRange(0, len(raw) - 1)] = flips[
                    fdp.ConsumeIntInRange(0, len(flips) - 1)]
            elif how == 1:
                del raw[fdp.ConsumeIntInRange(0, len(raw)):]
            elif how == 2:
                raw += fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 12))
            else:
                at = fdp.ConsumeIntInRange(0, len(raw))
                raw[at:at] = inserts[fdp.ConsumeIntInRange(0, len(inserts) - 1)]
        oracle.append(bytes(raw))
        at_end.append(fdp.ConsumeBool())
    capacity = fdp.ConsumeIntInRange(1, len(oracle) + 1)
    if which == 0:
        check_avro(oracle, at_end, capacity)
    elif which == 1:
        check_protobuf(event, oracle, at_end, capacity)
    elif which == 2:
        check_json(oracle, at_end, capacity)
    elif which == 3:
        check_json_documents(oracle, at_end)
    elif which == 4:
        check_avro_documents(oracle, at_end)
    elif which == 5:
        check_protobuf_documents(doc, oracle, at_end)
    else:
        check_json_jagged(oracle, at_end)


def _fuzz_main(argv: list[str]) -> None:
    import atheris

    # The same build as the test run that started this process.
    expected = os.environ.get("KFEED_FUZZ_CODEC")
    if expected and sys.modules["kfeed._codec"].__file__ != expected:
        raise SystemExit(f"fuzzing {sys.modules['kfeed._codec'].__file__}, expected {expected}")
    # The codec is native and gives atheris no coverage; the oracle's branches,
    # one per rejection rule, steer it towards every rule instead.
    global oracle_parse, oracle_parse_documents
    oracle_parse = atheris.instrument_func(oracle_parse)
    oracle_parse_documents = atheris.instrument_func(oracle_parse_documents)
    atheris.Setup(argv, fuzz_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    _fuzz_main(sys.argv)
