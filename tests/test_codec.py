"""The block and raw codecs, checked against a pure-Python reference.

The ``oracle_*`` functions below write the wire format of docs/FORMAT.md with
``struct``; they exist only to check kfeed's Cython codec. No broker needed.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import struct
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kfeed
from kfeed import ConfigError, Schema
from kfeed import schema as schema_module

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
]

SEEDS_SCHEMA = {"features": ("float32", (768,)), "label": ("int64", ()), "id": ("int64", ())}
# Pinned: a change here means every block already in Kafka stops decoding.
SEEDS_FINGERPRINT = 0x7BFFD511DAA08153

from reasons import (  # noqa: E402 - the documented reason strings
    TOMBSTONE, NOT_BYTES, SHORT, MAGIC, VERSION, FLAGS, HEADER_LEN, FINGERPRINT, COUNT, LENGTH, RAW_SIZE,
)

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the oracle: docs/FORMAT.md in struct ------------------------------------

# magic, version, flags, header_len, count, reserved, fingerprint, body_len
_HEADER = struct.Struct("<4sBBHIIQQ")


def oracle_fingerprint(fields: list[tuple[str, str, tuple[int, ...]]]) -> int:
    canonical = json.dumps([[n, d, list(s)] for n, d, s, *_ in fields], separators=(",", ":"))
    digest = hashlib.blake2b(b"kfeed.schema.v1:" + canonical.encode(), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0]


def oracle_block(
    schema: Schema,
    columns: list[bytes],
    count: int,
    *,
    magic: bytes = b"KFDB",
    version: int = 1,
    flags: int = 0,
    header_len: int = 32,
    reserved: int = 0,
    fingerprint: int | None = None,
    extension: bytes | None = None,
    body_len: int | None = None,
    count_field: int | None = None,
) -> bytes:
    """A block value from per-field column bytes (each ``count * nbytes`` long)."""
    ext = bytes(header_len - 32) if extension is None else extension
    body = b"".join(c + bytes(-len(c) % 8) for c in columns)
    header = _HEADER.pack(
        magic,
        version,
        flags,
        header_len,
        count if count_field is None else count_field,
        reserved,
        oracle_fingerprint(schema.fields) if fingerprint is None else fingerprint,
        len(ext) + len(body) if body_len is None else body_len,
    )
    return header + ext + body


def oracle_blocks(schema: Schema, arrays: dict[str, np.ndarray], n: int, per: int) -> list[bytes]:
    out = []
    for s in range(0, n, per):
        k = min(per, n - s)
        cols = [arrays[f.name][s : s + k].tobytes() for f in schema.fields]
        out.append(oracle_block(schema, cols, k))
    return out


def oracle_raw(schema: Schema, arrays: dict[str, np.ndarray], n: int) -> list[bytes]:
    return [b"".join(arrays[f.name][r].tobytes() for f in schema.fields) for r in range(n)]


# -- helpers -----------------------------------------------------------------


def random_columns(schema: Schema, n: int, seed: int) -> dict[str, np.ndarray]:
    """Arbitrary bit patterns (NaNs included) in each field's storage dtype."""
    rng = np.random.default_rng(seed)
    cols = {}
    for f in schema.fields:
        shape = (n, *f.shape)
        if f.dtype == "bool":
            cols[f.name] = rng.integers(0, 2, shape).astype(np.bool_)
        else:
            raw = rng.integers(0, 256, n * f.nbytes, dtype=np.uint8)
            cols[f.name] = raw.view(f.storage).reshape(shape)
    return cols


def as_torch(f, arr: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if f.dtype == "bfloat16" else t


def as_bytes(x) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def rows_bytes(out, name: str, a: int, b: int) -> bytes:
    return as_bytes(out[name][a:b])


SMALL = Schema({"v": ("int32", (3,)), "k": ("int64", ())})
SENTINEL = -7


def small_columns(first: int, n: int) -> dict[str, np.ndarray]:
    k = np.arange(first, first + n, dtype=np.int64)
    return {"v": (k[:, None] * 10 + np.arange(3)).astype(np.int32), "k": k}


def sentinel_out(capacity: int) -> dict[str, np.ndarray]:
    return {
        "v": np.full((capacity, 3), SENTINEL, np.int32),
        "k": np.full(capacity, SENTINEL, np.int64),
    }


def assert_rows(out, keys: list[int], capacity: int) -> None:
    """``out`` holds exactly the records ``keys`` in order, then untouched rows."""
    n = len(keys)
    np.testing.assert_array_equal(out["k"][:n], keys)
    np.testing.assert_array_equal(out["v"][:n], np.array(keys)[:, None] * 10 + np.arange(3))
    assert (out["k"][n:capacity] == SENTINEL).all()
    assert (out["v"][n:capacity] == SENTINEL).all()


# -- round trips -------------------------------------------------------------

shapes = st.lists(st.integers(1, 4), max_size=3).map(tuple)
names = st.text(alphabet="abxyz_é9", min_size=1, max_size=5)


@st.composite
def schemas_with(draw, dtype: str):
    """A schema with a field of ``dtype`` somewhere among 0..3 others."""
    others = draw(st.lists(st.tuples(st.sampled_from(DTYPES), shapes), max_size=3))
    specs = others + [(dtype, draw(shapes))]
    order = draw(st.permutations(range(len(specs))))
    field_names = draw(st.lists(names, min_size=len(specs), max_size=len(specs), unique=True))
    return Schema({field_names[i]: specs[j] for i, j in enumerate(order)})


@pytest.mark.parametrize("dtype", DTYPES)
@FAST
@given(
    data=st.data(),
    n=st.integers(0, 9),
    seed=st.integers(0, 2**32 - 1),
    per=st.integers(1, 4),
    torch_in=st.booleans(),
    like=st.sampled_from(["numpy", "torch"]),
)
def test_round_trip_matches_oracle(dtype, data, n, seed, per, torch_in, like):
    schema = data.draw(schemas_with(dtype))
    arrays = random_columns(schema, n, seed)
    columns = {f.name: as_torch(f, arrays[f.name]) for f in schema.fields} if torch_in else arrays

    blocks = schema.encode_blocks(columns, per)
    raws = schema.encode_raw(columns)
    assert blocks == oracle_blocks(schema, arrays, n, per)
    assert raws == oracle_raw(schema, arrays, n)
    assert schema.fingerprint == oracle_fingerprint(schema.fields)

    for fmt, values in (("block", blocks), ("raw", raws)):
        out = schema.empty(n, like=like)
        assert schema.decode_into(values, out, format=fmt) == (n, len(values), [], 0)
        for f in schema.fields:
            if like == "torch":
                assert out[f.name].dtype == f.torch_dtype
            assert as_bytes(out[f.name]) == arrays[f.name].tobytes(), (fmt, f.name)


@FAST
@given(
    data=st.data(),
    n=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
    extra=st.integers(0, 4).map(lambda k: 8 * k),
    reserved=st.integers(0, 2**32 - 1),
)
def test_oracle_blocks_with_a_longer_header_decode(data, n, seed, extra, reserved):
    # header_len may grow (in steps of 8) without a version change: a version-1
    # reader skips the extension and the reserved word.
    schema = data.draw(schemas_with(data.draw(st.sampled_from(DTYPES))))
    arrays = random_columns(schema, n, seed)
    ext = np.random.default_rng(seed).integers(0, 256, extra, dtype=np.uint8).tobytes()
    value = oracle_block(
        schema,
        [arrays[f.name].tobytes() for f in schema.fields],
        n,
        header_len=32 + extra,
        extension=ext,
        reserved=reserved,
    )
    out = schema.empty(n + 1)
    assert schema.decode_into([value], out) == (n, 1, [], 0)
    for f in schema.fields:
        assert out[f.name][:n].tobytes() == arrays[f.name].tobytes()


def test_bfloat16_tensors_round_trip_as_bfloat16():
    schema = Schema({"w": ("bfloat16", (4,))})
    x = torch.tensor(
        [[1.5, -2.0, 3.25, 1e-3], [0.0, -0.0, float("inf"), 7.0]], dtype=torch.bfloat16
    )
    out = schema.empty(2, like="torch")
    assert schema.decode_into(schema.encode_blocks({"w": x}), out).rows == 2
    assert out["w"].dtype == torch.bfloat16
    assert torch.equal(out["w"], x)
    # The wire holds the same 2-byte words as the numpy (uint16) spelling.
    words = x.view(torch.int16).numpy().view(np.uint16)
    assert schema.encode_blocks({"w": words}) == schema.encode_blocks({"w": x})
    raw = schema.empty(2)
    schema.decode_into(schema.encode_raw({"w": x}), raw, format="raw")
    assert raw["w"].dtype == np.uint16
    np.testing.assert_array_equal(raw["w"], words)


def test_non_contiguous_columns_encode_like_contiguous_ones():
    schema = Schema({"m": ("float32", (3,)), "t": ("int16", ())})
    base = np.arange(24, dtype=np.float32).reshape(3, 8)
    m = base.T[:, :3]  # (8, 3), strided
    t = torch.arange(16, dtype=torch.int16)[::2]
    assert not m.flags.c_contiguous and not t.is_contiguous()
    contiguous = {"m": np.ascontiguousarray(m), "t": t.contiguous().numpy()}
    assert schema.encode_blocks({"m": m, "t": t}, 3) == schema.encode_blocks(contiguous, 3)
    assert schema.encode_raw({"m": m, "t": t}) == schema.encode_raw(contiguous)


def test_worked_example_of_format_md():
    # The exact bytes shown in docs/FORMAT.md.
    schema = Schema({"x": ("int16", ()), "y": ("float32", (2,))})
    value = schema.encode_block(
        {"x": np.array([1, -2, 3], np.int16), "y": np.arange(6, dtype=np.float32).reshape(3, 2)}
    )
    assert schema.fingerprint == 0xFF75CD57C394FC0B
    assert value == bytes.fromhex(
        "4b464442 01 00 2000 03000000 00000000 0bfc94c357cd75ff 2000000000000000"
        "0100 feff 0300 0000"
        "00000000 0000803f 00000040 00004040 00008040 0000a040"
    )
    assert schema.block_nbytes(3) == len(value) == 64


def test_padding_bytes_are_not_checked():
    schema = Schema({"x": ("int16", ())})
    value = bytearray(schema.encode_block({"x": np.array([1, -2, 3], np.int16)}))
    assert value[38:40] == b"\0\0"
    value[38:40] = b"\xff\xff"
    out = schema.empty(3)
    assert schema.decode_into([bytes(value)], out) == (3, 1, [], 0)
    np.testing.assert_array_equal(out["x"], [1, -2, 3])


def test_block_header_fields():
    value = SMALL.encode_block(small_columns(0, 5))
    magic, version, flags, header_len, count, reserved, fp, body = _HEADER.unpack_from(value)
    assert (magic, version, flags, header_len, count, reserved) == (b"KFDB", 1, 0, 32, 5, 0)
    assert fp == SMALL.fingerprint
    assert body == len(value) - 32
    # v: 5 * 12 = 60 bytes padded to 64, then k at offset 32 + 64.
    assert len(value) == 32 + 64 + 40 == SMALL.block_nbytes(5)
    assert value[32 + 60 : 32 + 64] == bytes(4)
    assert struct.unpack_from("<q", value, 32 + 64)[0] == 0


def test_encode_blocks_splits_into_block_records():
    values = SMALL.encode_blocks(small_columns(0, 10), block_records=4)
    assert [_HEADER.unpack_from(v)[4] for v in values] == [4, 4, 2]
    assert SMALL.encode_blocks(small_columns(0, 0)) == []
    with pytest.raises(ConfigError, match="block_records"):
        SMALL.encode_blocks(small_columns(0, 3), block_records=0)


def test_an_empty_block_is_valid_and_holds_nothing():
    empty = SMALL.encode_block(small_columns(0, 0))
    assert len(empty) == 32 == SMALL.block_nbytes(0)
    assert empty == oracle_block(SMALL, [b"", b""], 0)
    out = sentinel_out(4)
    good = SMALL.encode_block(small_columns(1, 2))
    assert SMALL.decode_into([empty, good, empty], out) == (2, 3, [], 0)
    assert_rows(out, [1, 2], 4)


# -- rejection ---------------------------------------------------------------


def _patched(value: bytes, offset: int, fmt: str, field: int) -> bytes:
    b = bytearray(value)
    struct.pack_into(fmt, b, offset, field)
    return bytes(b)


GOOD = SMALL.encode_block(small_columns(100, 2))  # 32 + 24 + 16 bytes
OTHER = Schema({"w": ("int32", (3,)), "k": ("int64", ())})  # same sizes, another name

released = memoryview(b"x" * SMALL.record_size)
released.release()

BAD_BLOCKS = [
    (b"KFDC" + GOOD[4:], MAGIC),
    (bytes(4) + GOOD[4:], MAGIC),
    (b"BDFK" + GOOD[4:], MAGIC),
    (_patched(GOOD, 4, "<B", 0), VERSION),
    (_patched(GOOD, 4, "<B", 2), VERSION),
    (_patched(GOOD, 4, "<B", 255), VERSION),
    (_patched(GOOD, 5, "<B", 1), FLAGS),
    (_patched(GOOD, 5, "<B", 0x80), FLAGS),
    (_patched(GOOD, 6, "<H", 0), HEADER_LEN),
    (_patched(GOOD, 6, "<H", 24), HEADER_LEN),
    (_patched(GOOD, 6, "<H", 31), HEADER_LEN),
    (_patched(GOOD, 6, "<H", 36), HEADER_LEN),
    (_patched(GOOD, 6, "<H", 0xFFF8), HEADER_LEN),  # longer than the value
    (_patched(GOOD, 6, "<H", 40), LENGTH),  # a legal length the size does not have room for
    (_patched(GOOD, 16, "<Q", SMALL.fingerprint ^ 1), FINGERPRINT),
    (OTHER.encode_block({"w": np.zeros((2, 3), np.int32), "k": np.arange(2)}), FINGERPRINT),
    (_patched(GOOD, 8, "<I", 3), LENGTH),
    (_patched(GOOD, 8, "<I", 1), LENGTH),
    (_patched(GOOD, 8, "<I", 0), LENGTH),
    (_patched(GOOD, 8, "<I", 0xFFFFFFFF), LENGTH),
    (_patched(GOOD, 24, "<Q", len(GOOD) - 31), LENGTH),
    (_patched(GOOD, 24, "<Q", len(GOOD) - 33), LENGTH),
    (_patched(GOOD, 24, "<Q", 2**64 - 1), LENGTH),
    (GOOD[:-1], LENGTH),
    (GOOD[:-8], LENGTH),
    (GOOD[:32], LENGTH),
    (GOOD + bytes(1), LENGTH),
    (GOOD + bytes(8), LENGTH),
    (GOOD[:31], SHORT),
    (b"", SHORT),
    (b"KFDB", SHORT),
    (None, TOMBSTONE),
    (12345, NOT_BYTES),
    ("KFDB text", NOT_BYTES),
    (object(), NOT_BYTES),
    ([1, 2, 3], NOT_BYTES),
    (memoryview(bytearray(GOOD * 2))[::2], NOT_BYTES),  # not contiguous
    (released, NOT_BYTES),
]


@pytest.mark.parametrize(
    ("bad", "reason"), BAD_BLOCKS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_BLOCKS)]
)
def test_a_bad_block_is_rejected_whole_and_its_neighbours_decode(bad, reason):
    values = [
        bad,
        SMALL.encode_block(small_columns(0, 2)),
        bad,
        SMALL.encode_block(small_columns(2, 3)),
        bad,
    ]
    out = sentinel_out(8)
    result = SMALL.decode_into(values, out)
    assert result == (5, 5, [(0, reason), (2, reason), (4, reason)], 0)
    assert_rows(out, [0, 1, 2, 3, 4], 8)

    alone = sentinel_out(8)
    assert SMALL.decode_into([bad], alone, split=True) == (0, 1, [(0, reason)], 0)
    assert_rows(alone, [], 8)


RAW_GOOD = SMALL.encode_raw(small_columns(100, 1))[0]

BAD_RAW = [
    (RAW_GOOD[:-1], RAW_SIZE),
    (RAW_GOOD + b"\0", RAW_SIZE),
    (b"", RAW_SIZE),
    (SMALL.encode_block(small_columns(100, 1)), RAW_SIZE),
    (None, TOMBSTONE),
    (3.5, NOT_BYTES),
    ("x" * SMALL.record_size, NOT_BYTES),
    (memoryview(bytearray(RAW_GOOD * 2))[::2], NOT_BYTES),
    (released, NOT_BYTES),
]


@pytest.mark.parametrize(
    ("bad", "reason"), BAD_RAW, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_RAW)]
)
def test_a_bad_raw_value_is_rejected_and_its_neighbours_decode(bad, reason):
    good = SMALL.encode_raw(small_columns(0, 3))
    values = [bad, good[0], bad, good[1], good[2], bad]
    out = sentinel_out(5)
    result = SMALL.decode_into(values, out, format="raw")
    assert result == (3, 6, [(0, reason), (2, reason), (5, reason)], 0)
    assert_rows(out, [0, 1, 2], 5)


def test_every_reason_is_exercised():
    # A reason the codec can give but these tests never provoke is untested.
    used = {r for _, r in BAD_BLOCKS + BAD_RAW} | {COUNT}
    assert set(kfeed._codec.REASONS.values()) == used


def test_a_released_memoryview_is_rejected_not_raised():
    # Regression: the buffer protocol raises ValueError for a released view,
    # which escaped decode and lost the whole batch.
    view = memoryview(GOOD)
    view.release()
    out = sentinel_out(4)
    good = SMALL.encode_block(small_columns(0, 2))
    assert SMALL.decode_into([view, good], out) == (2, 2, [(0, NOT_BYTES)], 0)
    assert_rows(out, [0, 1], 4)


def untouchable(nbytes: int) -> np.ndarray:
    """``nbytes`` of address space that may be neither read nor written, as a uint8 array.

    Any touch is a segfault, so an output over it proves that a decode wrote
    nothing, and it costs no memory however big the rows it stands for.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, nbytes, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
    weakref.finalize(arr, libc.munmap, addr, nbytes)
    return arr


@pytest.mark.skipif(not hasattr(mmap, "MAP_ANONYMOUS"), reason="needs POSIX mmap")
@pytest.mark.parametrize("split", [False, True])
def test_a_count_that_would_overflow_is_rejected(split, monkeypatch):
    # 2**31 records of 2**33 bytes is 2**64: the size would wrap to 0, so a
    # bare 32-byte header would otherwise look consistent. (A Schema refuses
    # records over 2 GiB, Kafka's largest message; the codec checks anyway.)
    monkeypatch.setattr(schema_module, "_MAX_RECORD", 2**40)
    huge = Schema({"big": ("uint8", (2**33,))})
    header = oracle_block(huge, [], 0, count_field=2**31, body_len=0)
    assert len(header) == 32
    # A one-row output nothing may touch: a write through it would crash.
    target = huge.bind({"big": untouchable(2**33).reshape(1, 2**33)})
    assert target.capacity == 1
    assert huge.decode_into([header], target, split=split) == (0, 1, [(0, COUNT)], 0)
    max_count = (2**63 - 1) // 2**33
    over = oracle_block(huge, [], 0, count_field=max_count + 1, body_len=0)
    assert huge.decode_into([over], target).bad == [(0, COUNT)]
    at_limit = oracle_block(huge, [], 0, count_field=max_count, body_len=0)
    assert huge.decode_into([at_limit], target).bad == [(0, LENGTH)]


def test_decode_stops_before_a_block_that_would_overflow():
    values = [SMALL.encode_block(small_columns(4 * i, 4)) for i in range(5)]
    out = sentinel_out(10)
    assert SMALL.decode_into(values, out) == (8, 2, [], 0)
    assert_rows(out, list(range(8)), 10)
    # The caller resumes at values[consumed] with a fresh buffer.
    rest = sentinel_out(12)
    assert SMALL.decode_into(values[2:], rest) == (12, 3, [], 0)
    assert_rows(rest, list(range(8, 20)), 12)


def test_decode_stops_when_out_is_full():
    values = SMALL.encode_raw(small_columns(0, 5))
    out = sentinel_out(3)
    assert SMALL.decode_into(values, out, format="raw") == (3, 3, [], 0)
    assert_rows(out, [0, 1, 2], 3)
    # Bad values past the full point are not consumed either: they are seen next time.
    assert SMALL.decode_into([values[0], None], sentinel_out(1), format="raw") == (1, 1, [], 0)


def test_decode_from_a_row():
    out = sentinel_out(6)
    values = [SMALL.encode_block(small_columns(0, 2))]
    assert SMALL.decode_into(values, out, row=3) == (2, 1, [], 0)
    assert (out["k"][:3] == SENTINEL).all() and (out["v"][:3] == SENTINEL).all()
    np.testing.assert_array_equal(out["k"][3:], [0, 1, SENTINEL])
    assert SMALL.decode_into(values, out, row=6) == (0, 0, [], 0)


def test_split_fills_out_exactly_and_reports_partial():
    values = [SMALL.encode_block(small_columns(0, 4)), SMALL.encode_block(small_columns(4, 4))]
    out = sentinel_out(6)
    assert SMALL.decode_into(values, out, split=True) == (6, 1, [], 2)
    assert_rows(out, list(range(6)), 6)
    rest = sentinel_out(6)
    assert SMALL.decode_into(values[1:], rest, start=2) == (2, 1, [], 0)
    assert_rows(rest, [6, 7], 6)


@FAST
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    capacity=st.integers(1, 7),
    bad_at=st.sets(st.integers(0, 8), max_size=2),
)
def test_split_and_resume_gives_the_rows_of_one_big_decode(counts, capacity, bad_at):
    values, first = [], 0
    for c in counts:
        values.append(SMALL.encode_block(small_columns(first, c)))
        first += c
    for i in sorted(bad_at):
        values.insert(min(i, len(values)), GOOD[:-1])
    total = first

    whole = sentinel_out(total + 1)
    big = SMALL.decode_into(values, whole, split=True)
    assert (big.rows, big.consumed, big.partial) == (total, len(values), 0)

    got_k, got_v, bad = [], [], []
    pos, start = 0, 0
    for _ in range(10 * (len(values) + total) + 10):
        if pos == len(values):
            break
        out = sentinel_out(capacity)
        r = SMALL.decode_into(values[pos:], out, split=True, start=start)
        assert r.rows <= capacity and (out["k"][r.rows :] == SENTINEL).all()
        got_k.append(out["k"][: r.rows].copy())
        got_v.append(out["v"][: r.rows].copy())
        bad += [(pos + i, why) for i, why in r.bad]
        pos, start = pos + r.consumed, r.partial
    assert pos == len(values)
    np.testing.assert_array_equal(np.concatenate(got_k), whole["k"][:total])
    np.testing.assert_array_equal(np.concatenate(got_v), whole["v"][:total])
    assert bad == big.bad


def test_start_skips_records_of_the_first_value_only():
    values = [SMALL.encode_block(small_columns(0, 3)), SMALL.encode_block(small_columns(3, 2))]
    out = sentinel_out(5)
    assert SMALL.decode_into(values, out, start=2) == (3, 2, [], 0)
    assert_rows(out, [2, 3, 4], 5)
    # A start past the end of the block takes none of it.
    assert SMALL.decode_into(values[:1], sentinel_out(2), start=9) == (0, 1, [], 0)


# -- value types -------------------------------------------------------------


@pytest.mark.parametrize(
    "wrap",
    [
        bytes,
        bytearray,
        memoryview,
        lambda b: memoryview(b"pad" + b + b"tail")[3 : 3 + len(b)],
        lambda b: np.frombuffer(b, np.uint8),
    ],
    ids=["bytes", "bytearray", "memoryview", "memoryview-slice", "numpy"],
)
def test_bytes_like_values_decode_like_bytes(wrap):
    blocks = [SMALL.encode_block(small_columns(0, 2)), SMALL.encode_block(small_columns(2, 3))]
    out = sentinel_out(6)
    assert SMALL.decode_into([wrap(v) for v in blocks], out) == (5, 2, [], 0)
    assert_rows(out, [0, 1, 2, 3, 4], 6)
    raws = SMALL.encode_raw(small_columns(0, 3))
    out = sentinel_out(4)
    assert SMALL.decode_into([wrap(v) for v in raws], out, format="raw") == (3, 3, [], 0)
    assert_rows(out, [0, 1, 2], 4)


def test_values_may_be_any_iterable():
    blocks = (SMALL.encode_block(small_columns(i, 1)) for i in range(3))
    out = sentinel_out(3)
    assert SMALL.decode_into(blocks, out) == (3, 3, [], 0)
    assert_rows(out, [0, 1, 2], 3)


def test_a_bound_target_is_reused():
    out = sentinel_out(4)
    target = SMALL.bind(out)
    assert target.capacity == 4
    SMALL.decode_into([SMALL.encode_block(small_columns(0, 2))], target)
    SMALL.decode_into([SMALL.encode_block(small_columns(2, 2))], target, row=2)
    assert_rows(out, [0, 1, 2, 3], 4)


# -- schema and argument validation -----------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"feat": ("float8", (3,))}, "'feat'.*unknown dtype"),
        ({"feat": ("complex64", ())}, "'feat'.*unknown dtype"),
        ({"feat": (object, ())}, "'feat'.*unknown dtype"),
        ({"feat": ("float32", (0,))}, "'feat'.*positive"),
        ({"feat": ("float32", (-1,))}, "'feat'.*positive"),
        ({"feat": ("float32", (3, 0))}, "'feat'.*positive"),
        ({"feat": ("float32", (None,))}, "'feat'.*variable-length"),
        ({"feat": ("float32", (2.0,))}, "'feat'.*shape"),
        ({"feat": ("float32", (True,))}, "'feat'.*shape"),
        ({"feat": ("float32", "3")}, "'feat'.*shape"),
        ({"feat": ("float32",)}, "'feat'.*expected \\(dtype, shape\\)"),
        ({"feat": "float32"}, "'feat'.*expected \\(dtype, shape\\)"),
        ({"ok": ("int8", ()), "": ("int8", ())}, "non-empty strings"),
        ({"ok": ("int8", ()), 3: ("int8", ())}, "non-empty strings"),
        ({}, "at least one field"),
    ],
)
def test_bad_schemas_raise_config_error_naming_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        Schema(fields)


def test_a_list_with_a_duplicate_name_is_not_a_schema():
    # A dict cannot hold a duplicate name; a list of pairs could, so it is refused.
    with pytest.raises(ConfigError, match=r"^a schema is a dict \{name: \(dtype, shape\)\}, "
                       "got list$"):
        Schema([("a", ("int8", ())), ("a", ("int16", ()))])
    with pytest.raises(ConfigError, match="^a schema needs at least one field"):
        Schema({})


def test_config_error_is_a_value_error_and_a_kfeed_error():
    with pytest.raises(ValueError):
        Schema({})
    with pytest.raises(kfeed.KfeedError):
        Schema({})


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        ({"k": np.zeros(2, np.int64)}, "'v' is missing"),
        ({"v": np.zeros((2, 3), np.int64), "k": np.zeros(2, np.int64)}, "'v'.*dtype"),
        ({"v": np.zeros((2, 3), np.int32), "k": np.zeros(2, np.float64)}, "'k'.*dtype"),
        ({"v": np.zeros((2, 4), np.int32), "k": np.zeros(2, np.int64)}, "'v'.*shape"),
        ({"v": np.zeros((2,), np.int32), "k": np.zeros(2, np.int64)}, "'v'.*shape"),
        ({"v": np.zeros((2, 3), np.int32), "k": np.zeros((2, 1), np.int64)}, "'k'.*shape"),
        ({"v": np.zeros((2, 3), np.int32), "k": np.int64(1)}, "'k'.*shape"),
        ({"v": np.zeros((2, 3), np.int32), "k": np.zeros(3, np.int64)}, "'k' has 3 rows"),
        ({"v": torch.zeros(2, 3), "k": torch.zeros(2, dtype=torch.int64)}, "'v'.*dtype"),
        (
            {"v": np.zeros((2, 3), np.int32), "k": np.zeros(2, np.int64), "extra": np.zeros(2)},
            "not in the schema.*extra",
        ),
        ([("v", np.zeros((2, 3), np.int32))], "mapping"),
    ],
)
def test_bad_columns_raise_config_error_naming_the_field(columns, match):
    for encode in (SMALL.encode_block, SMALL.encode_blocks, SMALL.encode_raw):
        with pytest.raises(ConfigError, match=match):
            encode(columns)


@pytest.mark.parametrize(
    ("out", "match"),
    [
        ({"k": np.zeros(2, np.int64)}, "'v' is missing"),
        ({"v": np.zeros((2, 3), np.int64), "k": np.zeros(2, np.int64)}, "'v'.*dtype"),
        ({"v": np.zeros((2, 4), np.int32), "k": np.zeros(2, np.int64)}, "'v'.*shape"),
        ({"v": np.zeros((2, 3), np.int32, order="F"), "k": np.zeros(2, np.int64)}, "'v'.*contig"),
        ({"v": np.zeros((4, 3), np.int32)[::2], "k": np.zeros(2, np.int64)}, "'v'.*contiguous"),
        ({"v": np.zeros((2, 3), np.int32), "k": np.zeros(3, np.int64)}, "'k'.*3 rows"),
        ({"v": [[0, 0, 0]], "k": np.zeros(1, np.int64)}, "'v'.*numpy array or a torch tensor"),
        ({"v": torch.zeros(2, 3, dtype=torch.int64), "k": torch.zeros(2).long()}, "'v'.*dtype"),
        ({"v": torch.zeros(3, 2, dtype=torch.int32).T, "k": torch.zeros(2).long()}, "'v'.*contig"),
        ({"v": torch.zeros(2, 3, dtype=torch.int32), "k": torch.zeros(2, 1).long()}, "'k'.*shape"),
    ],
)
def test_bad_outputs_raise_config_error_naming_the_field(out, match):
    with pytest.raises(ConfigError, match=match):
        SMALL.decode_into([GOOD], out)


def test_a_read_only_output_is_refused():
    out = sentinel_out(2)
    out["k"].flags.writeable = False
    with pytest.raises(ConfigError, match="'k'.*read-only"):
        SMALL.decode_into([GOOD], out)


def test_a_target_holds_the_buffers_it_was_bound_to():
    out = {"v": torch.zeros(2, 3, dtype=torch.int32), "k": np.zeros(2, np.int64)}
    target = SMALL.bind(out)
    assert target.pointers.tolist() == [out["v"].data_ptr(), out["k"].ctypes.data]
    bf = Schema({"w": ("bfloat16", (2,))})
    w = torch.zeros(3, 2, dtype=torch.bfloat16)
    assert bf.bind({"w": w}).pointers.tolist() == [w.data_ptr()]
    with pytest.raises(ValueError, match="cannot resize"):
        out["k"].resize(4)  # held by the target: its memory may not move


def test_the_codec_takes_buffers_never_addresses():
    layout = SMALL._layout
    address = np.array([sentinel_out(2)["v"].ctypes.data, 0], np.uint64)
    with pytest.raises(TypeError, match="expected kfeed._codec.Out"):
        kfeed._codec.decode(layout, [GOOD], address, 0, True, 0, False)
    with pytest.raises(ValueError, match="^out 'v' must be a writable C-contiguous buffer, got int"):
        kfeed._codec.Out(layout, [int(address[0]), np.zeros(2, np.int64)])
    with pytest.raises(ValueError, match="^out 'k' must be a writable C-contiguous buffer, got bytes"):
        kfeed._codec.Out(layout, [np.zeros((2, 3), np.int32), bytes(16)])


@pytest.mark.parametrize(
    ("buffers", "match"),
    [
        ([np.zeros(25, np.uint8), np.zeros(2, np.int64)],
         "^out 'v' holds 25 bytes, not a whole number of 12-byte rows$"),
        ([np.zeros((2, 3), np.int32), np.zeros(3, np.int64)], "^out 'k' has 3 rows, out 'v' has 2$"),
        ([np.zeros((2, 3), np.int32)], "^one buffer per field is needed: 2 fields, 1 buffers$"),
        ([np.zeros((2, 3), np.int32), None], "^out 'k' needs a buffer$"),
    ],
)
def test_out_buffers_hold_whole_rows_the_same_number_for_every_field(buffers, match):
    with pytest.raises(ValueError, match=match):
        kfeed._codec.Out(SMALL._layout, buffers)


def test_a_target_of_another_schema_is_refused_before_any_write():
    out = sentinel_out(2)
    target = SMALL.bind(out)
    wider = Schema({"v": ("int32", (4,)), "k": ("int64", ())})  # 16-byte rows of v
    value = wider.encode_block({"v": np.ones((2, 4), np.int32), "k": np.ones(2, np.int64)})
    with pytest.raises(ConfigError, match="^out 'v' holds 24 bytes, less than 2 rows of this layout$"):
        wider.decode_into([value], target)
    assert_rows(out, [], 2)


@pytest.mark.parametrize("encode", ["encode_blocks", "encode_raw"])
def test_the_encoders_check_every_column_holds_n_records(encode):
    layout, cols = SMALL._layout, small_columns(0, 3)
    v, k = cols["v"].view(np.uint8).reshape(-1), cols["k"].view(np.uint8).reshape(-1)
    args = (64,) if encode == "encode_blocks" else ()
    fn = getattr(kfeed._codec, encode)
    with pytest.raises(ValueError, match=r"^every column must hold 3 records; got "
                                         r"'v' 3 \(36 bytes\), 'k' 2 \(16 bytes\)$"):
        fn(layout, [v, k[:16]], 3, *args)
    # n past the columns' end would have read beyond them.
    with pytest.raises(ValueError, match=r"^every column must hold 4 records; got "
                                         r"'v' 3 \(36 bytes\), 'k' 3 \(24 bytes\)$"):
        fn(layout, [v, k], 4, *args)
    with pytest.raises(ValueError, match=r"'k' 2.5 \(20 bytes\)"):
        fn(layout, [v, k[:20]], 3, *args)
    with pytest.raises(ValueError, match="^one column per field is needed: 2 fields, 1 columns$"):
        fn(layout, [v], 3, *args)
    assert fn(layout, [v, k], 3, *args) == getattr(SMALL, encode)(cols)


def test_decode_counts_gives_the_rows_of_each_value():
    blocks = [SMALL.encode_block(small_columns(10 * i, i)) for i in range(4)]  # 0..3 records
    values = [blocks[2], None, blocks[0], blocks[3], blocks[2], blocks[1]]
    out = sentinel_out(5)
    result, counts = SMALL.decode_counts(values, out, split=True, start=1)
    assert result == (5, 4, [(1, TOMBSTONE)], 1)
    assert counts.dtype == np.int64
    # The first skips one record; the fifth gives one before the output is
    # full (partial); the last is not reached.
    assert counts.tolist() == [1, 0, 0, 3, 1, 0]
    assert_rows(out, [21, 30, 31, 32, 20], 5)
    result, counts = SMALL.decode_counts(iter([blocks[2], blocks[3]]), out, row=3)
    assert (result, counts.tolist()) == ((2, 1, [], 0), [2, 0])
    assert_rows(out, [21, 30, 31, 20, 21], 5)


def test_take_copies_the_rows_picked_in_order():
    stage = {"v": (np.arange(5)[:, None] * 10 + np.arange(3)).astype(np.int32),
             "k": np.arange(5, dtype=np.int64)}
    out = sentinel_out(6)
    SMALL.take(stage, [4, 0, 4, 2], out, row=1)
    np.testing.assert_array_equal(out["k"], [SENTINEL, 4, 0, 4, 2, SENTINEL])
    np.testing.assert_array_equal(out["v"][1:5], stage["v"][[4, 0, 4, 2]])
    assert (out["v"][[0, 5]] == SENTINEL).all()
    with pytest.raises(ConfigError, match="^row 5 is outside the source \\(5 rows\\)$"):
        SMALL.take(stage, [0, 5], out)
    with pytest.raises(ConfigError, match="^row -1 is outside the source \\(5 rows\\)$"):
        SMALL.take(stage, np.array([-1]), out)
    with pytest.raises(ConfigError, match="^3 rows from row 4 overflow the output \\(6 rows\\)$"):
        SMALL.take(stage, [0, 1, 2], out, row=4)
    with pytest.raises(ConfigError, match="^rows must be a 1-D array of ints$"):
        SMALL.take(stage, [0.5], out)
    np.testing.assert_array_equal(out["k"], [SENTINEL, 4, 0, 4, 2, SENTINEL])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"row": 3}, "row"),
        ({"row": -1}, "row"),
        ({"format": "json"}, "format"),
        ({"start": -1}, "start"),
        ({"format": "raw", "start": 1}, "start"),
    ],
)
def test_bad_decode_arguments_raise_config_error(kwargs, match):
    out = sentinel_out(2)
    with pytest.raises(ConfigError, match=match):
        SMALL.decode_into([GOOD], out, **kwargs)
    assert_rows(out, [], 2)


# -- fingerprint -------------------------------------------------------------


def test_the_seeds_fingerprint_is_pinned():
    schema = Schema(SEEDS_SCHEMA)
    assert schema.fingerprint == SEEDS_FINGERPRINT
    assert schema.record_size == 3088
    value = schema.encode_block(
        {
            "features": np.zeros((1, 768), np.float32),
            "label": np.zeros(1, np.int64),
            "id": np.zeros(1, np.int64),
        }
    )
    assert value[16:24] == SEEDS_FINGERPRINT.to_bytes(8, "little")


@pytest.mark.parametrize(
    "changed",
    [
        {"feature": ("float32", (768,)), "label": ("int64", ()), "id": ("int64", ())},
        {"features": ("float16", (768,)), "label": ("int64", ()), "id": ("int64", ())},
        {"features": ("float32", (767,)), "label": ("int64", ()), "id": ("int64", ())},
        {"features": ("float32", (768, 1)), "label": ("int64", ()), "id": ("int64", ())},
        {"features": ("float32", (768,)), "label": ("int64", (1,)), "id": ("int64", ())},
        {"features": ("float32", (768,)), "label": ("uint64", ()), "id": ("int64", ())},
        {"features": ("float32", (768,)), "id": ("int64", ()), "label": ("int64", ())},
        {"label": ("int64", ()), "features": ("float32", (768,)), "id": ("int64", ())},
        {"features": ("float32", (768,)), "label": ("int64", ())},
        {**SEEDS_SCHEMA, "w": ("bool", ())},
    ],
)
def test_any_change_of_name_dtype_shape_or_order_changes_the_fingerprint(changed):
    assert Schema(changed).fingerprint != SEEDS_FINGERPRINT


def test_dtype_spellings_give_one_fingerprint():
    spellings = ["float32", np.float32, np.dtype("float32"), torch.float32, "torch.float32"]
    prints = {Schema({"x": (d, (2, 3)), "y": ("int64", 1)}).fingerprint for d in spellings}
    assert prints == {Schema({"x": ("float32", (2, 3)), "y": ("int64", (1,))}).fingerprint}
    assert Schema({"x": ("float32", [2, 3])}) == Schema({"x": ("float32", (2, 3))})


@FAST
@given(data=st.data())
def test_fingerprint_matches_the_documented_recipe(data):
    schema = data.draw(schemas_with(data.draw(st.sampled_from(DTYPES))))
    assert schema.fingerprint == oracle_fingerprint(schema.fields)
    assert Schema(schema.to_dict()).fingerprint == schema.fingerprint
