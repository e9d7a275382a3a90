"""The Cython packer against a pure-Python packer used as the oracle.

``oracle_batches`` below restates the packing rules of ``kfeed.tokens`` with
lists; it exists only to check ``kfeed.tokens.Packer``. No broker needed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kfeed import ConfigError, KfeedError, Schema
from kfeed.tokens import Pack, Packer, PackInfo

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the oracle ------------------------------------------------------------------


def oracle_rows(docs: list[list[int]], pack: Pack) -> tuple[list[list[tuple[int, list[int]]]], int]:
    """The stream's rows, each a list of (document index, tokens) segments; truncations."""
    L = pack.seq_len
    rows: list[list[tuple[int, list[int]]]] = []
    row: list[tuple[int, list[int]]] = []
    used = truncated = 0
    for i, d in enumerate(docs):
        if not d:
            continue
        unit = list(d) + ([] if pack.eos_id is None else [pack.eos_id])
        if pack.split_long:
            pos = 0
            while pos < len(unit):
                take = min(len(unit) - pos, L - used)
                row.append((i, unit[pos : pos + take]))
                used += take
                pos += take
                if used == L:
                    rows.append(row)
                    row, used = [], 0
        else:
            if len(unit) > L:
                unit = unit[:L]
                truncated += 1
            if len(unit) > L - used:
                rows.append(row)
                row, used = [], 0
            row.append((i, unit))
            used += len(unit)
            if used == L:
                rows.append(row)
                row, used = [], 0
    if row:
        rows.append(row)
    return rows, truncated


def oracle_batches(docs: list[list[int]], pack: Pack, batch_size: int) -> list[dict]:
    """Every batch of the stream: the arrays and the PackInfo numbers."""
    L = pack.seq_len
    rows, _ = oracle_rows(docs, pack)
    batches = []
    for b in range(0, len(rows), batch_size):
        chunk = rows[b : b + batch_size]
        tokens, pos, ids, cu = [], [], [], []
        ordinal: dict[int, int] = {}
        for r, row in enumerate(chunk):
            t_row, p_row, d_row = [], [], []
            for i, seg in row:
                cu.append(r * L + len(t_row))
                t_row += seg
                p_row += list(range(len(seg)))
                d_row += [ordinal.setdefault(i, len(ordinal))] * len(seg)
            if len(t_row) < L:
                cu.append(r * L + len(t_row))
                n = L - len(t_row)
                t_row += [pack.pad_id] * n
                p_row += list(range(n))
                d_row += [-1] * n
            tokens.append(t_row)
            pos.append(p_row)
            ids.append(d_row)
        seglens = np.diff(cu + [len(chunk) * L])
        real = sum(len(seg) for row in chunk for _, seg in row)
        batches.append({
            "rows": len(chunk),
            "tokens": np.array(tokens, np.int64).reshape(len(chunk), L),
            "position_ids": np.array(pos, np.int64).reshape(len(chunk), L),
            "doc_ids": np.array(ids, np.int64).reshape(len(chunk), L),
            "cu_seqlens": np.array(cu + [len(chunk) * L], np.int64),
            "segments": len(cu),
            "max_seqlen": int(seglens.max()),
            "real": real,
        })
    return batches


# -- helpers -----------------------------------------------------------------------


def flat(docs: list[list[int]], dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(d) for d in docs], np.int64)
    tokens = np.array([t for d in docs for t in d], dtype)
    return tokens, lengths


def feed_in_chunks(packer: Packer, docs: list[list[int]], cuts: list[int], dtype=np.int32) -> None:
    bounds = sorted({0, len(docs), *[c % (len(docs) + 1) for c in cuts]})
    for a, b in zip(bounds, bounds[1:]):
        packer.feed(*flat(docs[a:b], dtype))


def run(packer: Packer, out: dict, docs: list[list[int]], cuts: list[int]) -> list[dict]:
    """Feed in chunks, asking for a batch after each feed, then finish: the batches."""
    got = []
    bounds = sorted({0, len(docs), *[c % (len(docs) + 1) for c in cuts]})
    for a, b in zip(bounds, bounds[1:]):
        packer.feed(*flat(docs[a:b]))
        while (info := packer.next_batch(out)) is not None:
            got.append(snapshot(out, info))
    packer.finish()
    while (info := packer.next_batch(out)) is not None:
        got.append(snapshot(out, info))
    return got


def snapshot(out: dict, info: PackInfo) -> dict:
    rows = info.rows
    return {
        "info": info,
        "rows": rows,
        "tokens": np.asarray(out["tokens"])[:rows].astype(np.int64),
        "position_ids": np.asarray(out["position_ids"])[:rows].astype(np.int64),
        "doc_ids": np.asarray(out["doc_ids"])[:rows].astype(np.int64),
        "cu_full": np.asarray(out["cu_seqlens"]).astype(np.int64).copy(),
    }


def assert_same(got: list[dict], want: list[dict], seq_len: int) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["rows"] == w["rows"]
        for k in ("tokens", "position_ids", "doc_ids"):
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)
        info = g["info"]
        assert info.segments == w["segments"]
        assert info.max_seqlen == w["max_seqlen"]
        assert info.tokens == w["real"]
        assert info.padding == w["rows"] * seq_len - w["real"]
        cu = g["cu_full"]
        np.testing.assert_array_equal(cu[: info.segments + 1], w["cu_seqlens"])


def lengths_strategy(seq_len_max: int = 16, batch_max: int = 4):
    """Document lengths: empty, one token, short, longer than L, longer than B * L."""
    return st.lists(
        st.one_of(
            st.just(0),
            st.just(1),
            st.integers(2, 12),
            st.integers(seq_len_max, 3 * seq_len_max),
            st.integers(seq_len_max * batch_max, seq_len_max * batch_max * 2 + 3),
        ),
        max_size=30,
    )


def make_docs(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50_000, n).tolist() for n in lengths]


# -- the oracle holds --------------------------------------------------------------


@FAST
@given(
    lengths=lengths_strategy(),
    seq_len=st.integers(1, 16),
    batch_size=st.integers(1, 4),
    eos=st.sampled_from([None, 0, 50_001]),
    split_long=st.booleans(),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_packed_batches_equal_the_oracle(lengths, seq_len, batch_size, eos, split_long, cuts,
                                         seed):
    docs = make_docs(lengths, seed)
    pack = Pack(seq_len, eos_id=eos, pad_id=-5, split_long=split_long)
    packer = Packer(pack, batch_size)
    got = run(packer, packer.empty(), docs, cuts)
    want = oracle_batches(docs, pack, batch_size)
    assert_same(got, want, seq_len)
    assert packer.truncated == oracle_rows(docs, pack)[1]
    assert packer.state()["docs"] == len(docs)
    assert packer.pending_documents == 0


@FAST
@given(
    lengths=lengths_strategy(),
    seq_len=st.integers(1, 16),
    batch_size=st.integers(1, 4),
    eos=st.sampled_from([None, 7]),
    split_long=st.booleans(),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_a_resume_from_state_gives_the_identical_next_batches(
    lengths, seq_len, batch_size, eos, split_long, cuts, seed, data
):
    docs = make_docs(lengths, seed)
    pack = Pack(seq_len, eos_id=eos, split_long=split_long)
    want = oracle_batches(docs, pack, batch_size)
    packer = Packer(pack, batch_size)
    out = packer.empty()
    stop = data.draw(st.integers(0, len(want)))
    got = []
    packer.feed(*flat(docs))
    packer.finish()
    for _ in range(stop):
        got.append(snapshot(out, packer.next_batch(out)))
    state = packer.state()
    if not split_long:
        assert state["offset"] == 0

    # A new packer, fed from the first document not yet packed whole.
    resumed = Packer(pack, batch_size)
    resumed.load_state(state)
    got += run(resumed, resumed.empty(), docs[state["docs"] :], cuts)
    assert_same(got, want, seq_len)


@FAST
@given(lengths=lengths_strategy(), seq_len=st.integers(1, 16), batch_size=st.integers(1, 4),
       eos=st.sampled_from([None, 3]), seed=st.integers(0, 2**32 - 1))
def test_the_state_names_the_tokens_already_out(lengths, seq_len, batch_size, eos, seed):
    # docs[:D] out whole plus K tokens of docs[D] is exactly the stream so far.
    docs = make_docs(lengths, seed)
    pack = Pack(seq_len, eos_id=eos, split_long=True)
    packer = Packer(pack, batch_size)
    out = packer.empty()
    packer.feed(*flat(docs))
    packer.finish()
    stream: list[int] = []
    units = [d + ([] if eos is None or not d else [eos]) for d in docs]
    while (info := packer.next_batch(out)) is not None:
        real = out["tokens"][: info.rows].reshape(-1)[out["doc_ids"][: info.rows].reshape(-1) >= 0]
        stream += real.tolist()
        d, k = packer.state()["docs"], packer.state()["offset"]
        expect = [t for u in units[:d] for t in u] + (units[d][:k] if k else [])
        assert stream == expect


@FAST
@given(
    lengths=lengths_strategy(),
    seq_len=st.integers(1, 16),
    batch_size=st.integers(1, 4),
    eos=st.sampled_from([None, 3]),
    split_long=st.booleans(),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    flushes=st.lists(st.booleans(), min_size=8, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_partial_batches_cut_rows_short_and_lose_or_repeat_no_token(
    lengths, seq_len, batch_size, eos, split_long, cuts, flushes, seed
):
    # What a trickling stream does: after some feeds the loader's max_wait
    # runs out and whatever is fed goes out as a partial batch.
    docs = make_docs(lengths, seed)
    pack = Pack(seq_len, eos_id=eos, pad_id=-5, split_long=split_long)
    packer = Packer(pack, batch_size)
    out = packer.empty()
    rows_want, _ = oracle_rows(docs, pack)
    want = [t for row in rows_want for _, seg in row for t in seg]  # the real-token stream
    units = [d + ([] if eos is None or not d else [eos]) for d in docs]
    stream: list[int] = []

    def take(info: PackInfo | None, partial: bool) -> None:
        if info is None:
            return
        assert info.rows == batch_size or partial
        ids = out["doc_ids"][: info.rows].reshape(-1)
        stream.extend(out["tokens"][: info.rows].reshape(-1)[ids >= 0].tolist())
        assert info.tokens + info.padding == info.rows * seq_len
        if split_long:  # the state names exactly the tokens out so far
            d, k = packer.state()["docs"], packer.state()["offset"]
            assert stream == [t for u in units[:d] for t in u] + (units[d][:k] if k else [])

    bounds = sorted({0, len(docs), *[c % (len(docs) + 1) for c in cuts]})
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        packer.feed(*flat(docs[a:b]))
        while (info := packer.next_batch(out)) is not None:
            take(info, partial=False)
        if flushes[i % len(flushes)]:
            take(packer.next_batch(out, partial=True), partial=True)
            # Less than a batch was pending, so the partial batch took every
            # token (empty documents may wait for the next batch with tokens).
            assert packer.pending_tokens == 0
    packer.finish()
    while (info := packer.next_batch(out)) is not None:
        take(info, partial=True)
    assert stream == want
    assert packer.pending_documents == 0


def test_a_worked_example():
    pack = Pack(8, eos_id=99, pad_id=0)
    packer = Packer(pack, 2)
    out = packer.empty()
    out["cu_seqlens"][:] = -7
    packer.feed(np.arange(1, 12, dtype=np.int32), [3, 0, 5, 3])
    assert packer.next_batch(out) is None  # 14 tokens cannot fill 2 x 8
    packer.finish()
    info = packer.next_batch(out)
    assert info == PackInfo(rows=2, segments=5, max_seqlen=4, tokens=14, padding=2, documents=4,
                            truncated=0)
    np.testing.assert_array_equal(out["tokens"], [[1, 2, 3, 99, 4, 5, 6, 7],
                                                  [8, 99, 9, 10, 11, 99, 0, 0]])
    np.testing.assert_array_equal(out["position_ids"], [[0, 1, 2, 3, 0, 1, 2, 3],
                                                        [0, 1, 0, 1, 2, 3, 0, 1]])
    np.testing.assert_array_equal(out["doc_ids"], [[0, 0, 0, 0, 1, 1, 1, 1],
                                                   [1, 1, 2, 2, 2, 2, -1, -1]])
    np.testing.assert_array_equal(out["cu_seqlens"][:6], [0, 4, 8, 10, 14, 16])
    assert (out["cu_seqlens"][6:] == -7).all()  # past segments + 1: not written
    assert packer.next_batch(out) is None


def test_split_long_false_truncates_without_eos_and_counts():
    pack = Pack(4, eos_id=9, pad_id=0, split_long=False)
    packer = Packer(pack, 3)
    out = packer.empty()
    # 6 tokens: cut to 4, EOS dropped; 3 tokens + EOS = 4 fits a row; 1 + EOS.
    packer.feed(np.array([1, 2, 3, 4, 5, 6, 7, 7, 7, 8], np.int32), [6, 3, 1])
    packer.finish()
    info = packer.next_batch(out)
    assert (info.rows, info.truncated, info.tokens, info.padding) == (3, 1, 10, 2)
    np.testing.assert_array_equal(out["tokens"], [[1, 2, 3, 4], [7, 7, 7, 9], [8, 9, 0, 0]])
    assert packer.truncated == 1


def test_split_long_pads_only_the_last_row():
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(np.log(500), 1.0, 400).astype(np.int64) + 1
    packer = Packer(Pack(2048, eos_id=2), 8)
    out = packer.empty()
    packer.feed(rng.integers(0, 50_000, lengths.sum()).astype(np.int32), lengths)
    packer.finish()
    infos = []
    while (info := packer.next_batch(out)) is not None:
        infos.append(info)
    assert sum(i.padding for i in infos) < 2048
    assert all(i.padding == 0 for i in infos[:-1])
    assert packer.tokens == lengths.sum() + len(lengths)
    assert packer.efficiency > 0.99


def test_next_batch_waits_for_a_whole_batch_then_the_state_is_unchanged():
    packer = Packer(Pack(4, eos_id=None, split_long=False), 2)
    out = packer.empty()
    packer.feed(np.arange(3, dtype=np.int32), [3])
    assert packer.next_batch(out) is None
    # 2 * 3 >= 2 * 4: worth trying, but the second row's end is not known yet.
    packer.feed(np.arange(3, dtype=np.int32), [3])
    assert packer.next_batch(out) is None
    assert packer.state() == {"docs": 0, "offset": 0}
    packer.feed(np.arange(1, dtype=np.int32), [1])
    info = packer.next_batch(out)
    assert (info.rows, info.documents, info.tokens, info.padding) == (2, 3, 7, 1)
    assert out["tokens"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 0]]
    assert packer.state() == {"docs": 3, "offset": 0}


# -- invariants and dtypes ---------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_strategy(), seq_len=st.integers(1, 16), batch_size=st.integers(1, 4),
       split_long=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_positions_restart_exactly_where_cu_seqlens_starts_a_segment(
    lengths, seq_len, batch_size, split_long, seed
):
    docs = make_docs(lengths, seed)
    packer = Packer(Pack(seq_len, eos_id=1, pad_id=0, split_long=split_long), batch_size)
    out = packer.empty()
    packer.feed(*flat(docs))
    packer.finish()
    while (info := packer.next_batch(out)) is not None:
        pos = out["position_ids"][: info.rows].reshape(-1)
        cu = out["cu_seqlens"][: info.segments + 1]
        np.testing.assert_array_equal(np.flatnonzero(pos == 0), cu[:-1])
        lens = np.diff(cu)
        assert lens.min() >= 1 and lens.max() == info.max_seqlen
        ids = out["doc_ids"][: info.rows].reshape(-1)
        assert (ids[ids >= 0] == np.maximum.accumulate(ids)[ids >= 0]).all()  # in feed order
        assert (out["tokens"][: info.rows].reshape(-1)[ids < 0] == 0).all()


@pytest.mark.parametrize("src", ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                                 "uint64"])
@pytest.mark.parametrize("dst", ["int32", "int64"])
def test_every_token_dtype_packs_into_int32_and_int64(src, dst):
    info = np.iinfo(src)
    values = np.array([0, 1, min(info.max, 2**31 - 1), max(info.min, -(2**31)), 100], src)
    packer = Packer(Pack(3, eos_id=-1, pad_id=-2), 3)
    out = packer.empty(token_dtype=dst, position_dtype=dst, doc_dtype=dst)
    packer.feed(values, [2, 3])
    packer.finish()
    info_ = packer.next_batch(out)
    assert info_.rows == 3
    want = [int(values[0]), int(values[1]), -1, int(values[2]), int(values[3]), int(values[4]),
            -1, -2, -2]
    assert out["tokens"].dtype == np.dtype(dst)
    assert out["tokens"].reshape(-1)[:9].tolist() == want


def test_torch_outputs_and_only_the_buffers_given_are_written():
    packer = Packer(Pack(4, eos_id=0), 2)
    out = packer.empty(like="torch")
    assert out["tokens"].dtype == torch.int64 and out["cu_seqlens"].dtype == torch.int32
    packer.feed(np.arange(1, 8, dtype=np.uint16), [7])
    assert packer.next_batch(out).rows == 2
    assert out["tokens"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 0]]
    only = {"tokens": torch.full((2, 4), -9, dtype=torch.int32)}
    other = Packer(Pack(4, eos_id=0), 2)
    other.feed(np.arange(1, 8, dtype=np.uint16), [7])
    assert other.next_batch(only).rows == 2
    assert only["tokens"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 0]]


def test_feed_copies_unless_told_not_to():
    tokens = np.arange(1, 9, dtype=np.int32)
    copied, shared = Packer(Pack(4, eos_id=None), 2), Packer(Pack(4, eos_id=None), 2)
    copied.feed(tokens, [8])
    shared.feed(tokens, [8], copy=False)
    tokens[:] = 0  # the caller reuses its buffer
    a, b = copied.empty(), shared.empty()
    assert copied.next_batch(a).rows == shared.next_batch(b).rows == 2
    assert a["tokens"].reshape(-1).tolist() == list(range(1, 9))
    assert b["tokens"].reshape(-1).tolist() == [0] * 8  # copy=False: the caller's promise


def test_a_partial_batch_never_swallows_empty_documents_unreported():
    # Mid-stream, every document the state counts as packed was reported in
    # some PackInfo: the loader acknowledges records by PackInfo.documents.
    packer = Packer(Pack(4, eos_id=9), 2)
    out = packer.empty()
    reported = 0
    for lengths in ([5], [0], [0, 0], [3], [0]):
        packer.feed(np.arange(1, 1 + sum(lengths), dtype=np.int32), lengths)
        info = packer.next_batch(out, partial=True)
        reported += info.documents if info is not None else 0
        assert packer.state()["docs"] == reported
    assert reported == 5 and packer.pending_documents == 1  # the empty one waits


def test_a_target_bound_for_another_shape_is_refused():
    target = Packer(Pack(4, eos_id=1), 2).bind(Packer(Pack(4, eos_id=1), 2).empty())
    with pytest.raises(ConfigError, match="bound for \\[2, 4\\]"):
        Packer(Pack(4, eos_id=1), 3).next_batch(target)


def test_documents_decoded_from_blocks_pack_like_the_oracle():
    schema = Schema({"tokens": ("uint16", (None,))})
    docs = make_docs([0, 5, 1, 40, 3, 0, 17, 2, 90], 3)
    values = schema.encode_blocks({"tokens": [np.array(d, np.uint16) for d in docs]}, 4)
    decoded = schema.decode_documents(values)
    pack = Pack(16, eos_id=0)
    packer = Packer(pack, 3)
    out = packer.empty()
    packer.feed(decoded.tokens, decoded.lengths)
    packer.finish()
    got = []
    while (info := packer.next_batch(out)) is not None:
        got.append(snapshot(out, info))
    assert_same(got, oracle_batches(docs, pack, 3), 16)


# -- configuration errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0, "eos_id": 1}, "seq_len"),
        ({"seq_len": -3, "eos_id": 1}, "seq_len"),
        ({"seq_len": True, "eos_id": 1}, "seq_len"),
        ({"seq_len": 2.0, "eos_id": 1}, "seq_len"),
        ({"seq_len": 8, "eos_id": 2**31}, "eos_id"),
        ({"seq_len": 8, "eos_id": "2"}, "eos_id"),
        ({"seq_len": 8, "eos_id": 1, "pad_id": None}, "pad_id"),
        ({"seq_len": 8, "eos_id": 1, "split_long": 1}, "split_long"),
    ],
)
def test_bad_packs_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Pack(**kwargs)


def test_pack_is_frozen():
    with pytest.raises(AttributeError):
        Pack(8, eos_id=1).seq_len = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("out", "match"),
    [
        ({}, "needs 'tokens'"),
        ({"tokens": np.zeros((2, 4), np.int64), "labels": np.zeros((2, 4))}, "unknown keys"),
        ({"tokens": np.zeros((2, 5), np.int64)}, "shape"),
        ({"tokens": np.zeros((2, 4), np.float32)}, "dtype"),
        ({"tokens": np.zeros((2, 4), np.uint16)}, "dtype"),
        ({"tokens": np.zeros((4, 2), np.int64).T}, "contiguous"),
        ({"tokens": [[0] * 4] * 2}, "numpy array or a torch tensor"),
        ({"tokens": np.zeros((2, 4), np.int64), "cu_seqlens": np.zeros(8, np.int32)}, "at least 9"),
        ({"tokens": np.zeros((2, 4), np.int64), "cu_seqlens": np.zeros(9, np.int64)}, "int32"),
        ({"tokens": np.zeros((2, 4), np.int64), "doc_ids": np.zeros((2, 4), np.int16)}, "dtype"),
    ],
)
def test_bad_outputs_raise_config_error(out, match):
    packer = Packer(Pack(4, eos_id=1), 2)
    with pytest.raises(ConfigError, match=match):
        packer.bind(out)


def test_a_read_only_output_is_refused():
    out = np.zeros((2, 4), np.int64)
    out.flags.writeable = False
    with pytest.raises(ConfigError, match="read-only"):
        Packer(Pack(4, eos_id=1), 2).bind({"tokens": out})


def test_bad_feeds_raise_config_error():
    packer = Packer(Pack(4, eos_id=1), 2)
    with pytest.raises(ConfigError, match="add up"):
        packer.feed(np.arange(5, dtype=np.int32), [2, 2])
    with pytest.raises(ConfigError, match=">= 0"):
        packer.feed(np.arange(2, dtype=np.int32), [3, -1])
    with pytest.raises(ConfigError, match="integer dtype"):
        packer.feed(np.zeros(2, np.float32), [2])
    # owed= with split_long=False: its EOS was written, yet not counted in
    # pending_tokens (a partial batch never came; later the count went to -1).
    with pytest.raises(ConfigError, match="owed= is for split_long=True"):
        Packer(Pack(4, eos_id=9, split_long=False), 1).feed(
            np.empty(0, np.int32), [0], owed=np.array([True]))
    packer.feed(np.arange(2, dtype=np.int32), [2])
    with pytest.raises(ConfigError, match="stay int32"):
        packer.feed(np.arange(2, dtype=np.int64), [2])
    packer.finish()
    with pytest.raises(ConfigError, match="finish"):
        packer.feed(np.arange(2, dtype=np.int32), [2])


def test_bad_states_raise_config_error():
    packer = Packer(Pack(4, eos_id=1), 2)
    for bad in ({"docs": -1, "offset": 0}, {"docs": 0}, {"docs": 1, "offset": 2, "x": 0}, None):
        with pytest.raises(ConfigError, match="packer state"):
            packer.load_state(bad)
    with pytest.raises(ConfigError, match="split_long=False"):
        Packer(Pack(4, eos_id=1, split_long=False), 2).load_state({"docs": 3, "offset": 2})
    resumed = Packer(Pack(4, eos_id=1), 2)
    resumed.load_state({"docs": 3, "offset": 4})
    with pytest.raises(ConfigError, match="wrong document"):
        resumed.feed(np.arange(3, dtype=np.int32), [3])  # 3 + EOS = 4 tokens: all out already
    packer.feed(np.arange(2, dtype=np.int32), [2])
    with pytest.raises(ConfigError, match="before the first feed"):
        packer.load_state({"docs": 0, "offset": 0})


# -- the Cython core takes buffers, never addresses -------------------------------

from kfeed import _pack  # noqa: E402 - the private core, for the checks it makes itself


def test_the_core_has_no_address_to_take():
    assert not hasattr(_pack, "address")
    tokens = np.zeros((2, 4), np.int64)
    with pytest.raises(ValueError, match="^tokens must be a writable C-contiguous buffer"):
        _pack.Outputs(2, 4, tokens.ctypes.data)
    with pytest.raises(ValueError, match="^tokens must be a C-contiguous buffer"):
        _pack.Chunk(12345, np.zeros(1, np.int64))


@pytest.mark.parametrize(
    ("buffers", "match"),
    [
        ({"tokens": np.zeros(7, np.int64)}, "^tokens holds 7 elements, needs 8$"),
        ({"tokens": np.zeros(9, np.int32)}, "^tokens holds 9 elements, needs 8$"),
        ({"tokens": np.zeros(8, np.uint32)}, "^tokens must hold int32 or int64, got format 'I'$"),
        ({"tokens": np.zeros(8, np.float64)}, "^tokens must hold int32 or int64, got format 'd'$"),
        ({"tokens": np.zeros(8, ">i8")}, "^tokens must hold int32 or int64, got format '>q'$"),
        ({"tokens": np.zeros(16, np.int64)[::2]}, "^tokens must be a writable C-contiguous"),
        ({"tokens": np.zeros(8), "position_ids": np.zeros(8, np.int32)[:7]},
         "^tokens must hold int32"),
        ({"tokens": np.zeros(8, np.int64), "position_ids": np.zeros(7, np.int32)},
         "^position_ids holds 7 elements, needs 8$"),
        ({"tokens": np.zeros(8, np.int64), "doc_ids": np.zeros(9, np.int64)},
         "^doc_ids holds 9 elements, needs 8$"),
        ({"tokens": np.zeros(8, np.int64), "cu_seqlens": np.zeros(8, np.int32)},
         "^cu_seqlens holds 8 elements, needs at least 9$"),
        ({"tokens": np.zeros(8, np.int64), "cu_seqlens": np.zeros(9, np.int64)},
         "^cu_seqlens must hold int32$"),
        ({"tokens": b"\0" * 64}, "^tokens must be a writable C-contiguous buffer"),
        ({"tokens": None}, "^the token buffer is required$"),
    ],
)
def test_outputs_check_every_buffer_against_rows_and_seq_len(buffers, match):
    with pytest.raises(ValueError, match=match):
        _pack.Outputs(2, 4, **buffers)


def test_outputs_hold_their_buffers():
    tokens = np.zeros((2, 4), np.int64)
    out = _pack.Outputs(2, 4, tokens)
    with pytest.raises(ValueError, match="cannot resize"):
        tokens.resize(100)  # held: its memory may not move
    del out
    tokens.resize(100)


@pytest.mark.parametrize(
    ("tokens", "offsets", "match"),
    [
        (np.arange(5, dtype=np.int32), [1, 3, 5], "^offsets must start at 0, got 1$"),
        (np.arange(5, dtype=np.int32), [0, 3, 2, 5], "^offsets decrease at document 1$"),
        (np.arange(5, dtype=np.int32), [0, 3, 6], "^the offsets end at 6, tokens holds 5$"),
        (np.arange(5, dtype=np.int32), [0, 3, 4], "^the offsets end at 4, tokens holds 5$"),
        (np.arange(5, dtype=np.int32), [], "^offsets needs ndocs \\+ 1 entries$"),
        (np.arange(4, dtype=np.float32), [0, 4], "^tokens must hold native integers, got format 'f'$"),
        (np.arange(10, dtype=np.int32)[::2], [0, 5], "^tokens must be a C-contiguous buffer"),
    ],
)
def test_a_chunk_checks_its_offsets_against_its_tokens(tokens, offsets, match):
    with pytest.raises(ValueError, match=match):
        _pack.Chunk(tokens, np.array(offsets, np.int64))


def test_the_core_refuses_a_cursor_outside_the_document():
    # A cursor past the document's end would have the loop write before the
    # segment it starts: the core checks it against the chunk.
    core = _pack.Core(4, True, 9, 0, True)
    chunk = _pack.Chunk(np.arange(5, dtype=np.int32), np.array([0, 3, 5], np.int64))
    tokens = np.full((2, 4), -1, np.int64)
    out = _pack.Outputs(2, 4, tokens)
    for doc, off in [(0, 4), (1, 3), (0, -1), (2, 1)]:
        with pytest.raises(ValueError, match=f"^off {off} is outside document {doc} "):
            core.batch(out, [chunk], doc, off, True)
    assert (tokens == -1).all()
    with pytest.raises(TypeError):
        core.batch(out, [(None, None, 0, 0, 2)], 0, 0, True)
    # Inside it, packing goes on from the cursor: document 0's last token and EOS.
    assert core.batch(out, [chunk], 0, 2, True)[3] == 2
    assert tokens.tolist() == [[2, 9, 3, 4], [9, 0, 0, 0]]


def test_the_core_refuses_a_cursor_with_split_long_false():
    core = _pack.Core(4, True, 9, 0, False)
    chunk = _pack.Chunk(np.arange(5, dtype=np.int32), np.array([0, 3, 5], np.int64))
    out = _pack.Outputs(2, 4, np.zeros((2, 4), np.int64))
    with pytest.raises(ValueError, match="^off 1 is outside document 0 "):
        core.batch(out, [chunk], 0, 1, True)


def test_a_packer_target_over_torch_tensors_writes_into_them():
    packer = Packer(Pack(4, eos_id=9), 2)
    out = packer.empty(like="torch", token_dtype="int32")
    target = packer.bind(out)
    packer.feed(np.array([1, 2, 3, 4, 5], np.int16), [3, 2])
    packer.finish()
    assert packer.next_batch(target).rows == 2
    assert out["tokens"].tolist() == [[1, 2, 3, 9], [4, 5, 9, 0]]
    assert out["cu_seqlens"][:4].tolist() == [0, 4, 7, 8]


# -- the shuffle's reservoir loops ----------------------------------------------------


def _reservoir_args(size=2, nparts=1, recs=((0, 0, 0, 0),), emitted=None, skipped=None):
    held = np.zeros((max(size, 1), 4), np.int64)
    parts = np.zeros((nparts, 4), np.int64)
    known = np.zeros((nparts, 2), np.uint8)
    recs = np.array(recs, np.int64).reshape(-1, 4)
    out = np.zeros((len(recs) if emitted is None else emitted, 4), np.int64)
    skip = np.zeros(len(recs) if skipped is None else skipped, np.int64)
    return held, parts, known, recs, out, skip


def test_the_reservoir_loops_refuse_what_would_go_outside_their_arrays():
    held, parts, known, recs, out, skip = _reservoir_args(recs=[(1, 0, 0, 0)])
    with pytest.raises(ValueError, match="record 0 names partition id 1, not one of the 1 known"):
        _pack.reservoir_push(0, 2, 0, held, parts, known, recs, True, out, skip)
    held, parts, known, recs, out, skip = _reservoir_args()
    with pytest.raises(ValueError, match="held has 2 rows, needs 3"):
        _pack.reservoir_push(0, 3, 0, held, parts, known, recs, True, out, skip)
    with pytest.raises(ValueError, match="3 records held in a reservoir of 2"):
        _pack.reservoir_push(0, 2, 3, held, parts, known, recs, True, out, skip)
    _, _, _, _, out0, skip0 = _reservoir_args(emitted=0, skipped=0)
    with pytest.raises(ValueError, match="emitted has 0 rows, needs 1"):
        _pack.reservoir_push(0, 2, 0, held, parts, known, recs, True, out0, skip)
    with pytest.raises(ValueError, match="skipped has 0 entries, needs 1"):
        _pack.reservoir_push(0, 2, 0, held, parts, known, recs, True, out, skip0)
    with pytest.raises(ValueError, match="known needs 2 flags per partition"):
        _pack.reservoir_push(0, 2, 0, held, parts, np.zeros((1, 1), np.uint8), recs, True,
                             out, skip)
    with pytest.raises(ValueError, match="emitted has 0 rows, needs 2"):
        _pack.reservoir_drain(0, 2, held, out0)
    marks = np.zeros((1, 2), np.int64)
    with pytest.raises(ValueError, match="key 0 names partition id 1"):
        _pack.key_minima(np.array([[1, 0, 0]], np.int64), marks, np.zeros(1, np.uint8))


def test_the_reservoir_loop_skips_repeats_and_keeps_the_positions():
    held, parts, known, recs, out, skip = _reservoir_args(
        size=0, recs=[(0, 3, 0, 7), (0, 3, 1, 8), (0, 3, 1, 9), (0, 2, 0, 10), (0, 4, 0, 11)])
    rng, n, ne, ns = _pack.reservoir_push(5, 0, 0, held, parts, known, recs, True, out, skip)
    assert (rng, n, ne, ns) == (5, 0, 3, 2)  # in order: no draw
    assert out[:3, 3].tolist() == [7, 8, 11] and skip[:2].tolist() == [9, 10]
    assert parts[0].tolist() == [4, 1, 4, 1] and known[0].tolist() == [1, 1]
    marks = np.array([[9, 9]], np.int64)
    flags = np.ones(1, np.uint8)
    _pack.key_minima(out[:3], marks, flags)
    assert marks[0].tolist() == [3, 0]


def test_documents_are_packed_from_several_fetches_in_the_order_asked_and_checked_first():
    a = np.arange(10, dtype=np.int32)            # fetch 0: documents [0:3], [3:10]
    b = np.arange(100, 106, dtype=np.int32)      # fetch 1: documents [0:2], [2:2], [2:6]
    starts = [np.array([0, 3, 10]), np.array([0, 2, 2, 6])]
    fetch_of = np.array([1, 0, 1, 0, 1], np.int64)
    local = np.array([2, 1, 0, 0, 1], np.int64)
    pack = Pack(seq_len=32, eos_id=999, pad_id=0)

    def packed(cut, docs, owed=None):
        """The batch of the gathered feed, checked against ``feed`` of ``docs`` copied out."""
        out = []
        for gathered in (True, False):
            packer = Packer(pack, 1)
            if gathered:
                packer._feed_gathered([a, b], starts, fetch_of, local, cut)
            else:
                packer.feed(np.concatenate(docs), [len(d) for d in docs], owed=owed)
            packer.finish()
            buf = packer.empty()
            for v in buf.values():  # (cu_seqlens past the segments is left unwritten)
                v[...] = -1
            assert packer.next_batch(buf) is not None
            out.append(buf)
        for k in out[0]:
            np.testing.assert_array_equal(out[0][k], out[1][k], err_msg=k)
        return out[0]["tokens"][0].tolist()

    got = packed(None, [b[2:6], a[3:10], b[0:2], a[0:3], b[2:2]])
    assert got == [102, 103, 104, 105, 999, *range(3, 10), 999, 100, 101, 999, 0, 1, 2, 999,
                   *[0] * 12]
    # Less the tokens already out; one cut to nothing still gives its EOS.
    cut = np.array([1, 0, 5, 0, 0], np.int64)
    got = packed(cut, [b[3:6], a[3:10], b[2:2], a[0:3], b[2:2]],
                 owed=np.array([0, 0, 1, 0, 0], np.uint8))
    assert got == [103, 104, 105, 999, *range(3, 10), 999, 999, 0, 1, 2, 999, *[0] * 15]
    views = [a.view(np.uint8), b.view(np.uint8)]
    none = np.empty(0, np.int64)
    for bad_fetch, bad_local, match in ((2, 0, "document 0: 0 of fetch 2"),
                                        (0, 2, "document 0: 2 of fetch 0"),
                                        (-1, 0, "document 0: 0 of fetch -1")):
        with pytest.raises(ValueError, match=match):
            _pack.gather_documents(views, starts, np.array([bad_fetch]), np.array([bad_local]),
                                   none, "int32")
    with pytest.raises(ValueError, match=r"tokens 0 to 11 \(less 0\) of 10"):
        _pack.gather_documents(views, [np.array([0, 11]), starts[1]], np.array([0]),
                               np.array([0]), none, "int32")
    with pytest.raises(ValueError, match="less -1"):
        _pack.gather_documents(views, starts, np.array([0]), np.array([0]), np.array([-1]),
                               "int32")
    with pytest.raises(ValueError, match="a fetch and a document per id"):
        _pack.gather_documents(views, starts[:1], fetch_of, local, none, "int32")
    with pytest.raises(ValueError, match="an integer dtype"):
        _pack.gather_documents(views, starts, fetch_of, local, none, "float32")
    # The packer's front says it as kfeed's own bug, which it would be.
    with pytest.raises(KfeedError, match="a bug in kfeed"):
        Packer(pack, 1)._feed_gathered([a], starts[:1], np.array([0]), np.array([5]), None)
