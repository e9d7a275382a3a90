"""Variable-length fields (token documents): schema, block and raw codecs.

``oracle_doc_block`` writes the layout of docs/FORMAT.md with ``struct``; it
exists only to check kfeed's Cython codec. No broker needed.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kfeed
from kfeed import ConfigError, Schema
from kfeed import schema as schema_module

INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FIXED_DTYPES = ["bool", "int16", "int64", "float32", "bfloat16", "float64"]

from reasons import (  # noqa: E402 - the documented reason strings
    TOMBSTONE, NOT_BYTES, SHORT, MAGIC, VERSION, FLAGS, HEADER_LEN, FINGERPRINT, COUNT, LENGTH, OFFSETS_START, OFFSETS_ORDER, OFFSETS_END, RAW_ITEMSIZE,
)

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOKENS = Schema({"tokens": ("int32", (None,))})
# Pinned: a change here means every token block already in Kafka stops decoding.
TOKENS_FINGERPRINT = 0x55AD2F6E8640BD07

# -- the oracle: docs/FORMAT.md in struct --------------------------------------

_HEADER = struct.Struct("<4sBBHIIQQ")


def oracle_fingerprint(fields) -> int:
    canonical = json.dumps([[n, d, list(s)] for n, d, s, *_ in fields], separators=(",", ":"))
    digest = hashlib.blake2b(b"kfeed.schema.v1:" + canonical.encode(), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0]


def oracle_doc_block(schema: Schema, docs: list[np.ndarray], fixed: dict[str, np.ndarray], *,
                     flags: int = 1, offsets: list[int] | None = None) -> bytes:
    n = len(docs)
    parts = []
    for f in schema.fields:
        if f.variable:
            offs = offsets if offsets is not None else [0, *np.cumsum([len(d) for d in docs])]
            parts.append(struct.pack(f"<{len(offs)}I", *offs))
            parts.append(b"".join(np.asarray(d, f.storage).tobytes() for d in docs))
        else:
            parts.append(np.ascontiguousarray(fixed[f.name]).tobytes())
    body = b"".join(p + bytes(-len(p) % 8) for p in parts)
    header = _HEADER.pack(b"KFDB", 1, flags, 32, n, 0, oracle_fingerprint(schema.fields),
                          len(body))
    return header + body


# -- helpers ---------------------------------------------------------------------


def random_docs(dtype: str, lengths: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    return [rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True) for n in lengths]


def random_fixed(schema: Schema, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for f in schema.fields:
        if f.variable:
            continue
        raw = rng.integers(0, 256, n * f.nbytes, dtype=np.uint8)
        if f.dtype == "bool":
            raw = raw & 1
        out[f.name] = raw.view(f.storage).reshape(n, *f.shape)
    return out


lengths_st = st.lists(
    st.one_of(st.just(0), st.just(1), st.integers(2, 20), st.integers(200, 700)), max_size=12
)
shapes = st.lists(st.integers(1, 3), max_size=2).map(tuple)


@st.composite
def doc_schemas(draw):
    """A variable-length field among 0..2 fixed ones, anywhere."""
    dtype = draw(st.sampled_from(INT_DTYPES))
    others = draw(st.lists(st.tuples(st.sampled_from(FIXED_DTYPES), shapes), max_size=2))
    at = draw(st.integers(0, len(others)))
    specs = others[:at] + [(dtype, (None,))] + others[at:]
    return Schema({f"f{i}": spec for i, spec in enumerate(specs)})


def assert_documents(got: kfeed.schema.Documents, schema: Schema, docs, fixed, first: int = 0):
    docs = docs[first:]
    assert got.tokens.dtype == schema.varlen.storage
    assert got.lengths.tolist() == [len(d) for d in docs]
    want = np.concatenate(docs) if docs else np.empty(0, schema.varlen.storage)
    np.testing.assert_array_equal(got.tokens, want)
    assert set(got.columns) == set(fixed)
    for name, col in fixed.items():
        assert got.columns[name].tobytes() == np.ascontiguousarray(col[first:]).tobytes()


# -- schema ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_every_integer_dtype_may_be_variable_length(dtype):
    schema = Schema({"label": ("int64", ()), "tokens": (dtype, (None,))})
    assert schema.varlen == schema["tokens"] and schema["tokens"].variable
    assert schema["tokens"].shape == (None,) and schema["tokens"].nbytes == 0
    assert schema.record_size == 8  # the fixed fields only
    assert Schema({"t": (np.dtype(dtype), [None])}) == Schema({"t": (dtype, (None,))})


def test_a_fixed_schema_has_no_variable_field():
    assert Schema({"x": ("float32", (3,))}).varlen is None


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"t": ("float32", (None,))}, "'t'.*variable-length.*integer dtype"),
        ({"t": ("bfloat16", (None,))}, "'t'.*integer dtype"),
        ({"t": ("bool", (None,))}, "'t'.*integer dtype"),
        ({"t": ("int32", (None, 3))}, "'t'.*1-D"),
        ({"t": ("int32", (3, None))}, "'t'.*1-D"),
        ({"t": ("int32", (None, None))}, "'t'.*1-D"),
        ({"a": ("int32", (None,)), "b": ("uint16", (None,))}, "at most one.*'a', 'b'"),
    ],
)
def test_unsupported_variable_fields_raise_config_error(fields, match):
    with pytest.raises(ConfigError, match=match):
        Schema(fields)


def test_the_token_fingerprint_is_pinned_and_differs_from_fixed_shapes():
    assert TOKENS.fingerprint == TOKENS_FINGERPRINT
    assert TOKENS.fingerprint == oracle_fingerprint([("tokens", "int32", [None])])
    others = [Schema({"tokens": ("int32", s)}) for s in [(), (1,), (2,)]]
    others += [Schema({"tokens": (d, (None,))}) for d in ("uint32", "int64")]
    assert len({TOKENS.fingerprint, *(o.fingerprint for o in others)}) == 1 + len(others)


def test_the_fixed_only_entry_points_point_to_decode_documents():
    for call in (lambda: TOKENS.decode_into([], {}), lambda: TOKENS.bind({}),
                 lambda: TOKENS.empty(4)):
        with pytest.raises(ConfigError, match="'tokens' is variable-length.*decode_documents"):
            call()
    with pytest.raises(ConfigError, match="decode_into"):
        Schema({"x": ("int8", ())}).decode_documents([])


# -- round trips against the oracle -----------------------------------------------


@FAST
@given(schema=doc_schemas(), lengths=lengths_st, per=st.integers(1, 5), seed=st.integers(0, 2**32),
       flat_form=st.booleans(), data=st.data())
def test_blocks_match_the_oracle_and_decode_back(schema, lengths, per, seed, flat_form, data):
    f = schema.varlen
    docs = random_docs(f.dtype, lengths, seed)
    fixed = random_fixed(schema, len(docs), seed)
    column = (np.concatenate(docs) if docs else np.empty(0, f.storage),
              np.array(lengths, np.int64)) if flat_form else docs
    blocks = schema.encode_blocks({f.name: column, **fixed}, per)
    want = [
        oracle_doc_block(schema, docs[s : s + per], {n: c[s : s + per] for n, c in fixed.items()})
        for s in range(0, len(docs), per)
    ]
    assert blocks == want
    assert all(len(b) == schema.block_nbytes(min(per, len(docs) - i * per),
                                             sum(lengths[i * per : (i + 1) * per]))
               for i, b in enumerate(blocks))
    one = schema.encode_block({f.name: column, **fixed})
    assert one == oracle_doc_block(schema, docs, fixed)

    got = schema.decode_documents(blocks)
    assert got.bad == [] and got.counts.tolist() == [len(docs[s : s + per])
                                                     for s in range(0, len(docs), per)]
    assert_documents(got, schema, docs, fixed)
    start = data.draw(st.integers(0, per + 1))
    skipped = schema.decode_documents(blocks, start=start)
    assert_documents(skipped, schema, docs, fixed, min(start, per, len(docs)))
    assert_documents(schema.decode_documents([one]), schema, docs, fixed)


@FAST
@given(dtype=st.sampled_from(INT_DTYPES), lengths=lengths_st, seed=st.integers(0, 2**32))
def test_raw_values_are_one_document_each(dtype, lengths, seed):
    schema = Schema({"tokens": (dtype, (None,))})
    docs = random_docs(dtype, lengths, seed)
    values = schema.encode_raw({"tokens": docs})
    assert values == [d.tobytes() for d in docs]
    flat = np.concatenate(docs) if docs else np.empty(0, dtype)
    assert schema.encode_raw({"tokens": (flat, lengths)}) == values
    got = schema.decode_documents(values, "raw")
    assert got.bad == [] and got.counts.tolist() == [1] * len(docs)
    assert_documents(got, schema, docs, {})


def test_the_worked_example_of_format_md():
    schema = Schema({"id": ("int64", ()), "tokens": ("uint16", (None,))})
    assert schema.fingerprint == 0x386EA7470423E545
    value = schema.encode_block({
        "id": np.array([7, 8, 9]),
        "tokens": [np.array([5, 6, 7], np.uint16), np.array([], np.uint16),
                   np.array([258], np.uint16)],
    })
    assert value.hex() == (
        "4b46444201012000" "0300000000000000" "45e5230447a76e38" "3000000000000000"
        "0700000000000000" "0800000000000000" "0900000000000000"
        "0000000003000000" "0300000004000000" "0500060007000201"
    )
    got = schema.decode_documents([value])
    assert got.tokens.tolist() == [5, 6, 7, 258] and got.lengths.tolist() == [3, 0, 1]
    assert got.columns["id"].tolist() == [7, 8, 9]


def test_an_empty_block_holds_the_offsets_table_only():
    empty = TOKENS.encode_block({"tokens": []})
    assert len(empty) == 40 == TOKENS.block_nbytes(0)
    assert empty == oracle_doc_block(TOKENS, [], {})
    assert TOKENS.encode_blocks({"tokens": []}) == []
    got = TOKENS.decode_documents([empty, empty])
    assert (got.tokens.size, got.lengths.size, got.counts.tolist(), got.bad) == (0, 0, [0, 0], [])


def test_block_bytes_closes_blocks_early_and_a_big_document_gets_its_own():
    docs = random_docs("int32", [10, 10, 10, 100, 10, 0, 0, 10], 1)
    blocks = TOKENS.encode_blocks({"tokens": docs}, 64, block_bytes=128)
    counts = [struct.unpack_from("<I", b, 8)[0] for b in blocks]
    assert sum(counts) == len(docs)
    assert all(len(b) <= 128 or c == 1 for b, c in zip(blocks, counts))
    # Two documents of 10 int32 make 32 + 16 + 80 = 128 bytes; a third would not fit.
    assert counts == [2, 1, 1, 3, 1]
    assert_documents(TOKENS.decode_documents(blocks), TOKENS, docs, {})
    with pytest.raises(ConfigError, match="block_bytes"):
        TOKENS.encode_blocks({"tokens": docs}, block_bytes=8)
    with pytest.raises(ConfigError, match="block_bytes"):
        Schema({"x": ("int8", ())}).encode_blocks({"x": np.zeros(3, np.int8)}, block_bytes=1000)


def test_fixed_columns_may_be_torch_and_documents_any_sequence():
    schema = Schema({"w": ("float32", (2,)), "tokens": ("uint16", (None,))})
    docs = random_docs("uint16", [3, 0, 5], 2)
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    a = schema.encode_block({"w": w, "tokens": docs})
    b = schema.encode_block({"w": torch.from_numpy(w),
                             "tokens": [torch.from_numpy(d.astype(np.int32)).to(torch.uint16)
                                        for d in docs]})
    c = schema.encode_block({"w": w, "tokens": np.array(docs, dtype=object)})
    assert a == b == c


# -- rejection ----------------------------------------------------------------------

DOCS3 = [np.array([1, 2, 3], np.int32), np.array([], np.int32), np.array([4, 5], np.int32)]
GOOD = TOKENS.encode_block({"tokens": DOCS3})  # 32 + 16 (offsets) + 24 (values) bytes


def _patched(value: bytes, offset: int, fmt: str, field: int) -> bytes:
    b = bytearray(value)
    struct.pack_into(fmt, b, offset, field)
    return bytes(b)


UINT32_TOKENS = Schema({"tokens": ("uint32", (None,))})
FIXED_TOKENS = Schema({"tokens": ("int32", (2,))})


def _with_offsets(offsets: list[int]) -> bytes:
    return oracle_doc_block(TOKENS, DOCS3, {}, offsets=offsets)


BAD_BLOCKS = [
    (_with_offsets([1, 3, 3, 5]), OFFSETS_START),
    (_with_offsets([2, 3, 3, 5]), OFFSETS_START),
    (_with_offsets([0, 3, 2, 5]), OFFSETS_ORDER),
    (_with_offsets([0, 3, 3, 2]), OFFSETS_ORDER),
    (_with_offsets([0, 2**32 - 1, 3, 5]), OFFSETS_ORDER),
    (_with_offsets([0, 3, 3, 7]), OFFSETS_END),  # 28 -> 32 bytes of values, the value has 24
    (_with_offsets([0, 3, 3, 8]), OFFSETS_END),
    (_with_offsets([0, 3, 3, 4]), OFFSETS_END),  # 16 bytes, the value has 24
    (_with_offsets([0, 3, 3, 2**32 - 1]), OFFSETS_END),
    (_patched(GOOD, 8, "<I", 2), OFFSETS_END),  # count 2: offsets [0, 3, 3]: 3 != 5
    (_patched(GOOD, 8, "<I", 4), OFFSETS_ORDER),  # count 4: the fifth offset is token 1
    (_patched(GOOD, 8, "<I", 20), LENGTH),  # the table runs past the value
    (_patched(GOOD, 8, "<I", 0xFFFFFFFF), LENGTH),
    (GOOD[:-8], LENGTH),
    (_patched(GOOD[:-8], 24, "<Q", len(GOOD) - 40), OFFSETS_END),
    (GOOD + bytes(8), LENGTH),
    (_patched(GOOD, 5, "<B", 0), FLAGS),  # a fixed-layout flag on a variable-length schema
    (_patched(GOOD, 5, "<B", 3), FLAGS),
    (_patched(GOOD, 16, "<Q", TOKENS.fingerprint ^ 1), FINGERPRINT),
    (UINT32_TOKENS.encode_block({"tokens": [np.arange(3, dtype=np.uint32)]}), FINGERPRINT),
    (FIXED_TOKENS.encode_block({"tokens": np.zeros((2, 2), np.int32)}), FLAGS),
    (_patched(GOOD, 6, "<H", 24), HEADER_LEN),
    (_patched(GOOD, 4, "<B", 2), VERSION),
    (b"KFDC" + GOOD[4:], MAGIC),
    (GOOD[:31], SHORT),
    (None, TOMBSTONE),
    ("text", NOT_BYTES),
]


@pytest.mark.parametrize(
    ("bad", "reason"), BAD_BLOCKS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_BLOCKS)]
)
def test_a_bad_block_is_rejected_whole_and_its_neighbours_decode(bad, reason):
    good2 = TOKENS.encode_block({"tokens": DOCS3[:1]})
    got = TOKENS.decode_documents([bad, GOOD, bad, good2, bad])
    assert got.bad == [(0, reason), (2, reason), (4, reason)]
    assert got.counts.tolist() == [0, 3, 0, 1, 0]
    assert_documents(got, TOKENS, DOCS3 + DOCS3[:1], {})


def test_a_last_offset_wrong_only_within_the_padding_is_not_detectable():
    # Documented in docs/FORMAT.md: 6 int32 elements end at the same multiple
    # of 8 as 5, so the block is consistent and the padding decodes as a 0.
    got = TOKENS.decode_documents([_with_offsets([0, 3, 3, 6])])
    assert got.bad == [] and got.lengths.tolist() == [3, 0, 3]
    assert got.tokens.tolist() == [1, 2, 3, 4, 5, 0]


def test_a_count_that_would_overflow_is_rejected(monkeypatch):
    # (A Schema refuses records over 2 GiB, Kafka's largest message; the codec
    # checks anyway.)
    monkeypatch.setattr(schema_module, "_MAX_RECORD", 2**40)
    big = Schema({"big": ("uint8", (2**31,)), "tokens": ("int32", (None,))})
    value = oracle_doc_block(big, [], {"big": np.zeros((0, 2**31), np.uint8)})
    value = _patched(value, 8, "<I", 0xFFFFFFFF)
    assert big.decode_documents([value]).bad == [(0, COUNT)]


BAD_RAW = [
    (b"\x01\x02\x03", RAW_ITEMSIZE),
    (b"\x01\x02\x03\x04\x05", RAW_ITEMSIZE),
    (None, TOMBSTONE),
    (3.5, NOT_BYTES),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_RAW)
def test_a_bad_raw_value_is_rejected_and_its_neighbours_decode(bad, reason):
    values = [bad, *TOKENS.encode_raw({"tokens": DOCS3}), bad]
    got = TOKENS.decode_documents(values, "raw")
    assert got.bad == [(0, reason), (4, reason)]
    assert got.counts.tolist() == [0, 1, 1, 1, 0]
    assert_documents(got, TOKENS, DOCS3, {})


def test_every_documents_reason_is_exercised():
    used = {r for _, r in BAD_BLOCKS + BAD_RAW}
    assert set(kfeed._codec.DOC_REASONS.values()) <= used
    # The fixed codec's reasons are untouched: a fixed schema never gives these.
    assert not set(kfeed._codec.DOC_REASONS.values()) & set(kfeed._codec.REASONS.values())


def test_a_fixed_schema_rejects_a_variable_length_block():
    fixed = Schema({"tokens": ("int32", (3,))})
    out = {"tokens": np.zeros((4, 3), np.int32)}
    assert fixed.decode_into([GOOD], out).bad == [(0, FLAGS)]


def test_bytes_like_values_and_start():
    values = [bytearray(GOOD), memoryview(GOOD), np.frombuffer(GOOD, np.uint8)]
    got = TOKENS.decode_documents(values, start=2)
    assert got.counts.tolist() == [1, 3, 3]
    assert_documents(got, TOKENS, DOCS3[2:] + DOCS3 + DOCS3, {})
    assert TOKENS.decode_documents([GOOD], start=9).counts.tolist() == [0]
    with pytest.raises(ConfigError, match="start"):
        TOKENS.decode_documents([GOOD], "raw", start=1)
    with pytest.raises(ConfigError, match="start"):
        TOKENS.decode_documents([GOOD], start=-1)


def test_raw_needs_a_schema_of_the_variable_field_alone():
    schema = Schema({"id": ("int64", ()), "tokens": ("int32", (None,))})
    with pytest.raises(ConfigError, match="raw format.*'id'.*use blocks"):
        schema.encode_raw({"id": np.arange(1), "tokens": DOCS3[:1]})
    with pytest.raises(ConfigError, match="raw format"):
        schema.decode_documents([b""], "raw")
    assert TOKENS.decode_documents([b""], "raw").lengths.tolist() == [0]  # an empty document


def test_a_column_of_another_dtype_says_how_to_convert_it():
    # Never cast (a cast may lose values), but a Python list of whole numbers is
    # int64 to numpy whatever the field: the error said only the dtypes.
    schema = kfeed.Schema({"x": ("int32", ())})
    with pytest.raises(ConfigError, match=r"^field 'x': expected dtype int32, got int64: "
                                          r"convert it first \(np.asarray\(values, "
                                          r"'int32'\)\)$"):
        schema.encode_block({"x": [1, 2, 3]})
    with pytest.raises(ConfigError, match=r"got float64: convert it first \(.astype\("
                                          r"'int32'\)\)$"):
        schema.encode_block({"x": np.ones(3)})


@pytest.mark.parametrize(
    ("column", "match"),
    [
        ((np.arange(5, dtype=np.int32), [2, 2]), "add up to 4, flat holds 5"),
        ((np.arange(4, dtype=np.int32), [5, -1]), ">= 0"),
        ((np.arange(4, dtype=np.int32), [2.0, 2.0]), "lengths must be a 1-D array of ints"),
        ((np.arange(4, dtype=np.int32), [2, 2], [1]), "tuple must be \\(flat, lengths\\)"),
        ((np.arange(4, dtype=np.int32).reshape(2, 2), [2, 2]), "flat must be 1-D"),
        ((np.arange(4, dtype=np.int64), [4]), "expected dtype int32"),
        ([np.arange(4, dtype=np.int64)], "expected dtype int32"),
        ([np.zeros((2, 2), np.int32)], "document 0 must be 1-D"),
        (np.zeros((2, 2), np.int32), "not one 2-D array"),
        (7, "expected a list of 1-D arrays"),
    ],
)
def test_bad_document_columns_raise_config_error(column, match):
    for encode in (TOKENS.encode_block, TOKENS.encode_blocks, TOKENS.encode_raw):
        with pytest.raises(ConfigError, match=match):
            encode({"tokens": column})


def test_fixed_columns_must_match_the_document_count():
    schema = Schema({"id": ("int64", ()), "tokens": ("int32", (None,))})
    with pytest.raises(ConfigError, match="'id' has 2 rows, other fields have 3"):
        schema.encode_blocks({"id": np.arange(2), "tokens": DOCS3})
    with pytest.raises(ConfigError, match="'tokens' is missing"):
        schema.encode_blocks({"id": np.arange(2)})


# -- the document encoders check their own inputs -------------------------------

IDS = Schema({"id": ("int64", ()), "tokens": ("int32", (None,))})


def ids_columns(n_ids: int, n_tokens: int) -> list[np.ndarray]:
    return [np.arange(n_ids, dtype=np.int64).view(np.uint8),
            np.arange(n_tokens, dtype=np.int32).view(np.uint8)]


@pytest.mark.parametrize(
    ("columns", "offsets", "match"),
    [
        (ids_columns(3, 5), [0, 2, 2], "^offsets must hold n \\+ 1 = 4 entries, got 3$"),
        (ids_columns(3, 5), [1, 2, 3, 5], "^offsets must start at 0, got 1$"),
        (ids_columns(3, 5), [0, 3, 2, 5], "^offsets decrease at document 1$"),
        (ids_columns(3, 5), [0, 2, 2, 6],
         "^column 'tokens' holds 20 bytes, the offsets say 6 elements of 4$"),
        (ids_columns(3, 5)[:1], [0, 2, 2, 5], "^one column per field is needed: 2 fields, 1 columns$"),
        (ids_columns(2, 5), [0, 2, 2, 5],
         "^every column must hold 3 records; got 'id' 2 \\(16 bytes\\)$"),
        (ids_columns(4, 5), [0, 2, 2, 5],
         "^every column must hold 3 records; got 'id' 4 \\(32 bytes\\)$"),
    ],
)
def test_the_document_block_encoder_checks_columns_and_offsets(columns, offsets, match):
    # Past the end of a column, or with offsets going back, it would read
    # outside the caller's buffers.
    with pytest.raises(ValueError, match=match):
        kfeed._codec.encode_doc_blocks(IDS._doc_layout, columns, np.array(offsets, np.int64),
                                       3, 64, 0)


def test_the_document_raw_encoder_checks_offsets_against_the_elements():
    layout, elements = TOKENS._doc_layout, np.arange(5, dtype=np.int32).view(np.uint8)
    with pytest.raises(ValueError, match="^column 'tokens' holds 20 bytes, the offsets say 7"):
        kfeed._codec.encode_doc_raw(layout, elements, np.array([0, 3, 7], np.int64), 2)
    with pytest.raises(ValueError, match="^offsets decrease at document 0$"):
        kfeed._codec.encode_doc_raw(layout, elements, np.array([0, -1, 5], np.int64), 2)
    assert kfeed._codec.encode_doc_raw(layout, elements, np.array([0, 3, 5], np.int64), 2) == (
        TOKENS.encode_raw({"tokens": [np.arange(3, dtype=np.int32), np.arange(3, 5, dtype=np.int32)]})
    )


def test_an_empty_document_block_is_written_by_the_one_header_writer():
    # Both kinds of empty block: a fixed schema's (header alone) and a
    # document schema's (header and a one-entry offsets table).
    fixed = Schema({"x": ("int8", ())})
    assert fixed.encode_block({"x": np.zeros(0, np.int8)}) == _HEADER.pack(
        b"KFDB", 1, 0, 32, 0, 0, fixed.fingerprint, 0)
    assert TOKENS.encode_block({"tokens": []}) == oracle_doc_block(TOKENS, [], {})
