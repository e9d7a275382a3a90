"""Loader with ``pack=`` and ``shuffle=`` through the in-memory source: no broker needed.

The packed batches are checked against the pure-Python packer of test_pack.py;
resumes against an uninterrupted run, batch for batch (one partition, whose
order is fixed) or document for document (several partitions, whose
interleaving depends on how fetches fall).
"""

from __future__ import annotations

import json
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from records import CountingSource
from test_pack import oracle_batches
from test_shuffle import reference_order

import kfeed
from kfeed import ConfigError, Pack, Schema, Shuffle
from kfeed.loader import memory_loader

TOKENS = Schema({"tokens": ("int32", (None,))})
EOS = 100_000  # above every token id the documents use


def make_docs(n: int, seed: int, max_len: int = 700) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, size=n)
    lengths[rng.random(n) < 0.05] = 0  # some empty documents
    return [rng.integers(1, 50_000, size=int(k), dtype=np.int32) for k in lengths]


def as_numpy(batch: kfeed.loader.Batch) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in batch.items()}


def run(values, schema, batch_size, stop=None, state=None, **kwargs):
    """Batches of one loader (the first ``stop`` only), and its state after them."""
    loader = memory_loader(values, schema, batch_size, until="end", **kwargs)
    if state is not None:
        loader.load_state_dict(state)
    got = []
    for batch in loader:
        got.append(as_numpy(batch))
        if stop is not None and len(got) == stop:
            break
    state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint goes through JSON fine
    loader.close()
    return got, state


def documents(batches: list[dict[str, np.ndarray]]) -> Counter:
    """The documents in packed batches, cut at EOS (padding left out)."""
    stream = np.concatenate([b["tokens"][b["doc_ids"] >= 0] for b in batches])
    pieces = np.split(stream, np.flatnonzero(stream == EOS) + 1)
    assert pieces[-1].size == 0, "the stream must end with an EOS"
    return Counter(bytes(p[:-1].astype(np.int32)) for p in pieces[:-1])


def want_documents(docs: list[np.ndarray]) -> Counter:
    return Counter(bytes(d) for d in docs if len(d))


def assert_batches_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


# -- packing ---------------------------------------------------------------------


@pytest.mark.parametrize(("seq_len", "batch_size", "split_long", "per_block"),
                         [(128, 8, True, 16), (64, 3, True, 1), (256, 4, False, 7), (1000, 2, True, 50)])
def test_packed_batches_equal_the_oracle(seq_len, batch_size, split_long, per_block) -> None:
    docs = make_docs(600, seed=seq_len)
    pack = Pack(seq_len=seq_len, eos_id=EOS, pad_id=-1, split_long=split_long)
    got, _ = run(TOKENS.encode_blocks({"tokens": docs}, per_block), TOKENS, batch_size, pack=pack)
    want = oracle_batches([d.tolist() for d in docs], pack, batch_size)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for k in ("tokens", "position_ids", "doc_ids"):
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)
        np.testing.assert_array_equal(g["cu_seqlens"], w["cu_seqlens"])


def test_packed_batches_are_typed_for_training_and_carry_the_pack_info() -> None:
    docs = make_docs(200, seed=1)
    pack = Pack(seq_len=128, eos_id=EOS)
    loader = memory_loader(TOKENS.encode_blocks({"tokens": docs}, 8), TOKENS, 4, pack=pack,
                           until="end")
    batch = next(loader)
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (4, 128)
    assert batch["position_ids"].shape == (4, 128) and batch["doc_ids"].shape == (4, 128)
    assert batch["cu_seqlens"].dtype == torch.int32
    info = batch.pack
    assert batch["cu_seqlens"].shape == (info.segments + 1,)
    assert batch["cu_seqlens"][-1].item() == 4 * 128 and info.tokens + info.padding == 4 * 128
    assert batch.offsets == {}
    loader.close()


@pytest.mark.parametrize("stop", [1, 2, 17, 60])
def test_a_resume_continues_inside_the_document_with_the_identical_next_batch(stop) -> None:
    docs = make_docs(500, seed=7)
    values = TOKENS.encode_blocks({"tokens": docs}, 8)
    pack = Pack(seq_len=192, eos_id=EOS)
    whole, _ = run(values, TOKENS, 4, pack=pack)
    first, state = run(values, TOKENS, 4, stop=stop, pack=pack)
    rest, _ = run(values, TOKENS, 4, state=state, pack=pack)
    assert_batches_equal(first + rest, whole)


def test_a_resume_with_another_pad_id_places_every_token_as_before() -> None:
    # pad_id only fills the rows' ends: a state saved with another one was
    # refused ("the state was saved with pack [192, 100000, 0, True] ...").
    docs = make_docs(300, seed=11)
    values = TOKENS.encode_blocks({"tokens": docs}, 8)
    whole, _ = run(values, TOKENS, 4, pack=Pack(seq_len=192, eos_id=EOS))
    first, state = run(values, TOKENS, 4, stop=5, pack=Pack(seq_len=192, eos_id=EOS))
    rest, _ = run(values, TOKENS, 4, state=state, pack=Pack(seq_len=192, eos_id=EOS,
                                                            pad_id=-1))
    assert len(first) + len(rest) == len(whole)
    padded = 0
    for got, want in zip(rest, whole[len(first):], strict=True):
        pad = got["tokens"] == -1
        padded += int(pad.sum())
        np.testing.assert_array_equal(want["tokens"][pad], 0)
        np.testing.assert_array_equal(got["tokens"][~pad], want["tokens"][~pad])
        np.testing.assert_array_equal(got["cu_seqlens"], want["cu_seqlens"])
    assert padded > 0
    with pytest.raises(ConfigError, match="the state was saved with pack"):
        run(values, TOKENS, 4, state=state, pack=Pack(seq_len=192, eos_id=EOS,
                                                       split_long=False))


def test_a_partly_emitted_document_is_in_the_state_and_not_committed() -> None:
    docs = [np.arange(1, 1001, dtype=np.int32)]  # one document of 1,000 tokens (+ EOS)
    values = TOKENS.encode_raw({"tokens": docs})
    loader = memory_loader(values, TOKENS, 2, format="raw", pack=Pack(seq_len=100, eos_id=EOS),
                           until="end")
    next(loader)
    next(loader)  # the first batch's step is over
    state = loader.state_dict()
    assert state["pack_offset"] == 400
    assert state["positions"] == {"memory": {0: [0, 0]}}
    loader.commit()
    # Nothing is committed past a document with tokens still to come.
    assert loader._source.committed_positions[("memory", 0)] == (0, 0)
    loader.close(commit_current=False)


@pytest.mark.parametrize("shuffle", [None, Shuffle(buffer=2, seed=0)])
@pytest.mark.parametrize("apart", [False, True])
def test_empty_documents_after_the_last_batch_are_committed_with_the_read(shuffle,
                                                                          apart) -> None:
    # The last batch filled its rows exactly; the empty document after it went
    # with no batch and was never acknowledged: the read committed (0, 2), one
    # record short of the message's end, its lag 1 for ever and the message
    # read again by the next run. In the same message or one of its own.
    docs = [np.arange(1, 4, dtype=np.int32), np.arange(4, 7, dtype=np.int32),
            np.empty(0, np.int32)]
    values = (TOKENS.encode_blocks({"tokens": docs[:2]}, 2)
              + TOKENS.encode_blocks({"tokens": docs[2:]}, 1) if apart
              else TOKENS.encode_blocks({"tokens": docs}, 3))
    end = len(values)
    source = kfeed.MemorySource(values)
    with kfeed.Loader(None, "memory", TOKENS, 1, source=source, until="end", device="cpu",
                      pack=Pack(seq_len=4, eos_id=EOS), shuffle=shuffle) as loader:
        got = [b["tokens"].tolist() for b in loader]
        state = loader.state_dict()
    assert sorted(got) == [[[1, 2, 3, EOS]], [[4, 5, 6, EOS]]]
    assert source.committed_positions[("memory", 0)] == (end, 0)
    assert state["order"]["outbox"] == [] and state["order"]["held"] == []
    rest, _ = run(values, TOKENS, 1, state=state, pack=Pack(seq_len=4, eos_id=EOS),
                  shuffle=shuffle)
    assert rest == []


@pytest.mark.parametrize("shuffle", [None, Shuffle(buffer=64, seed=9)])
@pytest.mark.parametrize("stop", [1, 40, 300])
def test_several_partitions_resume_with_every_document_once(shuffle, stop) -> None:
    docs = make_docs(1500, seed=3, max_len=400)
    values = {0: TOKENS.encode_blocks({"tokens": docs[:500]}, 8),
              1: TOKENS.encode_blocks({"tokens": docs[500:1200]}, 5),
              2: TOKENS.encode_blocks({"tokens": docs[1200:]}, 1)}
    pack = Pack(seq_len=256, eos_id=EOS)
    first, state = run(values, TOKENS, 4, stop=stop, pack=pack, shuffle=shuffle)
    rest, _ = run(values, TOKENS, 4, state=state, pack=pack, shuffle=shuffle)
    assert documents(first + rest) == want_documents(docs)


def test_a_restart_from_the_commit_gives_the_eos_a_batch_ended_before() -> None:
    # A batch can end right after a document's last token, before its EOS. A
    # reader that takes over from the group's commit (its note says how many
    # tokens of that document are out) cut the document to nothing and gave no
    # EOS: the next document was glued on. (One partition: the reader that takes
    # over goes on with the same document, so the documents are whole in order.)
    rng = np.random.default_rng(4)
    docs = [rng.integers(1, 500, int(k), dtype=np.int32) for k in rng.integers(0, 25, 120)]
    values = {0: TOKENS.encode_blocks({"tokens": docs}, 7)}
    pack = Pack(seq_len=16, eos_id=EOS, pad_id=0)
    whole, _ = run(values, TOKENS, 3, pack=pack)
    assert documents(whole) == want_documents(docs)
    for stop in range(1, len(whole)):
        source = kfeed.MemorySource(values)
        first = kfeed.Loader(None, "memory", TOKENS, 3, source=source, until="end", device="cpu",
                             pack=pack)
        got = [as_numpy(b) for _, b in zip(range(stop), first)]
        first.close()  # commits what was used, with its note
        with kfeed.Loader(None, "memory", TOKENS, 3, source=source, until="end", device="cpu",
                          pack=pack) as second:
            got += [as_numpy(b) for b in second]
        assert documents(got) == want_documents(docs), stop


def test_a_stream_short_of_a_batch_yields_a_partial_batch_once_max_wait_is_over() -> None:
    # A streaming loader (no until=) whose topic holds far less than one
    # [8, 128] batch: after max_wait_ms the packer's tokens go out anyway.
    docs = make_docs(6, seed=4, max_len=60)
    values = TOKENS.encode_blocks({"tokens": docs}, 2)
    pack = Pack(seq_len=128, eos_id=EOS, pad_id=-1)
    loader = memory_loader(values, TOKENS, 8, pack=pack, max_wait_ms=50)
    got: list = []
    taker = threading.Thread(target=lambda: got.append(next(loader)), daemon=True)
    taker.start()
    taker.join(10)  # without the partial batch, next() would wait for ever
    assert got, "no batch 10 s after max_wait_ms=50"
    batch = got[0]
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    real = sum(len(d) + 1 for d in docs if len(d))
    assert batch.pack.rows == -(-real // 128) < 8
    assert batch["tokens"].shape == (batch.pack.rows, 128)
    assert documents([as_numpy(batch)]) == want_documents(docs)
    # The state covers every document: a resume has nothing left to read.
    rest, _ = run(values, TOKENS, 8, state=state, pack=pack)
    assert rest == []


@pytest.mark.parametrize("shuffle", [None, Shuffle(buffer=500, seed=0)],
                         ids=["in order", "shuffled"])
def test_a_message_a_document_is_fetched_a_few_batches_at_a_time(shuffle) -> None:
    # Topics others write hold one document a message: a fetch asked for a
    # message a row took a fetch (and its work) for every few documents.
    from kfeed.loader.tuning import fetch_ahead

    docs = make_docs(3000, seed=5)
    source = CountingSource([TOKENS.encode_raw({"tokens": [d]})[0] for d in docs])
    pack = Pack(seq_len=1024, eos_id=EOS, pad_id=0)
    with kfeed.Loader(None, "memory", TOKENS, 4, source=source, device="cpu",
                      until="end", format="raw", pack=pack, shuffle=shuffle) as loader:
        batches = [as_numpy(b) for b in loader]
        ahead = fetch_ahead(False)
    asked = [n for n, _timeout, _given in source.asked]
    assert documents(batches) == want_documents(docs)
    assert len(asked) < len(batches) / 2
    per_row = np.mean([len(d) + 1 for d in docs]) / 1024  # rows of tokens a message
    assert max(asked) <= 2 * (1 + ahead) * 4 / per_row


def test_packing_efficiency_on_a_realistic_length_mix() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(500), 0.8, size=2000).astype(int), 1, 20_000)
    docs = [rng.integers(1, 50_000, size=int(n), dtype=np.int32) for n in lengths]
    got, _ = run(TOKENS.encode_blocks({"tokens": docs}, 16), TOKENS, 8,
                 pack=Pack(seq_len=2048, eos_id=EOS))
    real = sum(int((b["doc_ids"] >= 0).sum()) for b in got)
    total = sum(b["tokens"].size for b in got)
    assert real == int(lengths.sum()) + len(docs)  # every token and one EOS per document
    assert real / total >= 0.99


def test_bad_documents_go_to_the_dead_letter_queue_and_the_good_ones_all_arrive() -> None:
    docs = make_docs(300, seed=5)
    values = TOKENS.encode_blocks({"tokens": docs}, 10)
    corrupt = [3, 11, 29]
    for i in corrupt:
        values[i] = values[i][:-3]  # truncated: rejected whole
    loader = memory_loader(values, TOKENS, 4, pack=Pack(seq_len=128, eos_id=EOS), until="end")
    got = [as_numpy(b) for b in loader]
    lost = {j for i in corrupt for j in range(10 * i, 10 * i + 10)}
    assert documents(got) == want_documents([d for j, d in enumerate(docs) if j not in lost])
    dead = loader._source.dead_letters
    assert sorted(m.offset() for m, _ in dead) == corrupt
    assert loader.stats()["bad_records"] == 3


# -- shuffling -------------------------------------------------------------------

SAMPLES = Schema({"x": ("float32", (3,)), "id": ("int64", ())})


def sample_values(n: int, per_block: int) -> list[bytes]:
    ids = np.arange(n)
    x = np.stack([ids, ids * 2, ids * 3], 1).astype(np.float32)
    return SAMPLES.encode_blocks({"x": x, "id": ids}, per_block)


def ids_of(batches: list[dict]) -> np.ndarray:
    return np.concatenate([b["id"] for b in batches])


def test_shuffled_samples_are_a_seeded_permutation() -> None:
    values = sample_values(5000, 64)
    a, _ = run(values, SAMPLES, 100, shuffle=Shuffle(buffer=500, seed=3))
    b, _ = run(values, SAMPLES, 100, shuffle=Shuffle(buffer=500, seed=3))
    c, _ = run(values, SAMPLES, 100, shuffle=Shuffle(buffer=500, seed=4))
    ids = ids_of(a)
    np.testing.assert_array_equal(np.sort(ids), np.arange(5000))
    np.testing.assert_array_equal(ids, ids_of(b))
    assert not np.array_equal(ids, np.arange(5000)) and not np.array_equal(ids, ids_of(c))
    for batch in a:  # rows stay whole
        np.testing.assert_array_equal(batch["x"], np.stack([batch["id"]] * 3, 1) * [1, 2, 3])


@pytest.mark.parametrize("stop", [1, 13, 49])
@pytest.mark.parametrize("fmt", ["block", "raw"])
def test_a_shuffled_resume_gives_the_identical_order(stop, fmt) -> None:
    if fmt == "block":
        values = sample_values(5000, 64)
    else:
        ids = np.arange(5000)
        values = SAMPLES.encode_raw({"x": np.zeros((5000, 3), np.float32), "id": ids})
    shuffle = Shuffle(buffer=300, seed=11)
    whole, _ = run(values, SAMPLES, 100, format=fmt, shuffle=shuffle)
    first, state = run(values, SAMPLES, 100, stop=stop, format=fmt, shuffle=shuffle)
    rest, _ = run(values, SAMPLES, 100, state=state, format=fmt, shuffle=shuffle)
    np.testing.assert_array_equal(ids_of(first + rest), ids_of(whole))


def test_a_shuffled_resume_across_partitions_loses_and_repeats_nothing() -> None:
    values = {0: sample_values(3000, 64), 1: sample_values(2000, 10)}
    shuffle = Shuffle(buffer=400, seed=1)
    first, state = run(values, SAMPLES, 128, stop=9, shuffle=shuffle)
    rest, _ = run(values, SAMPLES, 128, state=state, shuffle=shuffle)
    got = np.sort(ids_of(first + rest))
    np.testing.assert_array_equal(got, np.sort(np.concatenate([np.arange(3000), np.arange(2000)])))


@pytest.mark.parametrize(("buffer", "per_block", "fmt"), [(100, 10, "block"), (700, 64, "block"),
                                                         (50, 1, "raw")])
def test_shuffled_samples_of_one_partition_come_in_the_reservoirs_order(buffer, per_block,
                                                                         fmt) -> None:
    # One partition: the records reach the order in offset order however the
    # fetches fall, so the batches follow the reference reservoir exactly,
    # through the staging ring's moves (a small buffer moves rows often).
    n = 4000
    if fmt == "block":
        values = sample_values(n, per_block)
        keys = [(0, i // per_block, i % per_block) for i in range(n)]
    else:
        ids = np.arange(n)
        x = np.stack([ids, ids * 2, ids * 3], 1).astype(np.float32)
        values = SAMPLES.encode_raw({"x": x, "id": ids})
        keys = [(0, i, 0) for i in range(n)]
    got, _ = run(values, SAMPLES, 64, format=fmt, shuffle=Shuffle(buffer=buffer, seed=5))
    ids = ids_of(got)
    want = [o * per_block + s if fmt == "block" else o
            for _p, o, s in reference_order(keys, buffer, 5)]
    np.testing.assert_array_equal(ids, want)
    for batch in got:  # rows stay whole
        np.testing.assert_array_equal(batch["x"], np.stack([batch["id"]] * 3, 1) * [1, 2, 3])


def test_held_values_go_once_their_records_are_gathered_or_dropped() -> None:
    # What a shuffle holds: records stay in their message values, picked by
    # item in any order straight into a batch; a value goes with its last record.
    held = SAMPLES.hold("block")
    values = sample_values(200, 64) + [None, b"not a block"]  # 64, 64, 64, 8, then two bad
    n = len(values)
    recs, counts, bad = held.add(values, np.arange(n, dtype=np.int64) % 2,
                                 np.arange(n, dtype=np.int64) + 100)
    assert counts.tolist() == [64, 64, 64, 8, 0, 0]
    assert [i for i, _ in bad] == [4, 5]
    assert recs[:, 0].tolist() == [i % 2 for i in range(4) for _ in range(counts[i])]
    assert recs[:, 1].tolist() == [i + 100 for i in range(4) for _ in range(counts[i])]
    np.testing.assert_array_equal(recs[:, 2], np.arange(200) % 64)
    assert (held.values, held.records) == (4, 200)
    items = recs[:, 3]
    order = np.random.default_rng(3).permutation(200)
    out = SAMPLES.empty(100)
    target = SAMPLES.bind(out)
    held.gather(items[order[:100]], target.out, 0)
    np.testing.assert_array_equal(out["id"], order[:100])
    np.testing.assert_array_equal(out["x"], np.stack([order[:100]] * 3, 1) * [1, 2, 3])
    assert held.records == 100
    gone = set(range(4)) - {int(i) // 64 for i in order[100:]}
    assert held.values == 4 - len(gone)
    held.drop(items[order[100:150]])
    held.gather(items[order[150:]], target.out, 0)
    np.testing.assert_array_equal(out["id"][:50], order[150:])
    assert (held.values, held.records, held.nbytes) == (0, 0, 0)
    with pytest.raises(IndexError):  # every record went: no item names one
        held.gather(items[:1], target.out, 0)
    # A bad item changes nothing; a clear lets every value go.
    recs, _, _ = held.add(values[:2], np.zeros(2, np.int64), np.zeros(2, np.int64))
    with pytest.raises(IndexError):
        held.gather(np.array([recs[0, 3], recs[1, 3], (7 << 32)], np.int64), target.out, 0)
    with pytest.raises(IndexError):
        held.drop(np.array([recs[-1, 3] + 1], np.int64))  # past its value's records
    assert held.records == 128
    held.clear()
    assert (held.values, held.records, held.nbytes) == (0, 0, 0)


def test_held_values_with_few_records_left_are_compacted_past_the_limit() -> None:
    values = sample_values(256, 64)
    held = SAMPLES.hold("block", limit=1)  # past it at once: compact what may be
    zeros = np.zeros(4, np.int64)
    recs, _, _ = held.add(values, zeros, zeros)
    items = recs[:, 3]
    assert held.compacted == 0  # every record left: nothing to gain
    # Values 0 and 1 keep 10 records (their rows and flags weigh less than a
    # quarter of the value), 2 keeps 20 (more), 3 all 64; an add compacts.
    keep = np.r_[54:64, 64 + 54:128, 128 + 44:192, 192:256]
    held.drop(np.setdiff1d(items, items[keep]))
    before = held.nbytes
    held.add([], np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert held.compacted == 2 and held.values == 4
    assert before - held.nbytes == 2 * (len(values[0]) + 64 - 10 * (SAMPLES.record_size + 5))
    out = SAMPLES.empty(len(keep))
    order = np.random.default_rng(1).permutation(keep)
    held.gather(items[order], SAMPLES.bind(out).out, 0)
    np.testing.assert_array_equal(out["id"], order)
    np.testing.assert_array_equal(out["x"], np.stack([order] * 3, 1) * [1, 2, 3])
    assert (held.values, held.records, held.nbytes) == (0, 0, 0)


# -- configuration -----------------------------------------------------------------


def test_bad_pack_and_shuffle_settings_are_config_errors() -> None:
    values = sample_values(10, 5)
    with pytest.raises(ConfigError, match="variable-length"):
        memory_loader(values, SAMPLES, 4, pack=Pack(seq_len=8, eos_id=0))
    with pytest.raises(ConfigError, match="shuffle= takes it with pack= only"):
        memory_loader([], TOKENS, 4, shuffle=kfeed.Shuffle(buffer=8))
    with pytest.raises(ConfigError, match="'tokens_offsets': batches hold the offsets"):
        memory_loader([], kfeed.Schema({"tokens": ("int32", (None,)),
                                         "tokens_offsets": ("int64", ())}), 4)
    with pytest.raises(ConfigError, match="kfeed.Pack"):
        memory_loader([], TOKENS, 4, pack={"seq_len": 8})
    with pytest.raises(ConfigError, match="kfeed.Shuffle"):
        memory_loader(values, SAMPLES, 4, shuffle=100)


def test_a_state_from_another_setting_is_refused() -> None:
    docs = make_docs(50, seed=2)
    values = TOKENS.encode_blocks({"tokens": docs}, 8)
    _, packed = run(values, TOKENS, 2, stop=1, pack=Pack(seq_len=64, eos_id=EOS))
    with pytest.raises(ConfigError, match="pack"):
        memory_loader(values, TOKENS, 2, pack=Pack(seq_len=32, eos_id=EOS)).load_state_dict(packed)
    with pytest.raises(ConfigError, match="Shuffle"):
        memory_loader(values, TOKENS, 2, pack=Pack(seq_len=64, eos_id=EOS),
                      shuffle=Shuffle(buffer=8)).load_state_dict(packed)
    plain_values = sample_values(100, 10)
    _, plain = run(plain_values, SAMPLES, 10, stop=1)
    with pytest.raises(ConfigError, match="reading in offset order"):
        memory_loader(plain_values, SAMPLES, 10, shuffle=Shuffle(buffer=8)).load_state_dict(plain)
    _, shuffled = run(plain_values, SAMPLES, 10, stop=1, shuffle=Shuffle(buffer=8))
    with pytest.raises(ConfigError, match="with shuffle"):
        memory_loader(plain_values, SAMPLES, 10).load_state_dict(shuffled)


@pytest.mark.parametrize("shuffle", [None, Shuffle(4, seed=0)], ids=["in-order", "shuffled"])
def test_drop_last_drops_the_short_last_packed_batch(shuffle) -> None:
    # The packer said its batch was the last only at the call after it, once
    # drop_last had looked: the short batch [1, 16] was handed out.
    values = TOKENS.encode_blocks({"tokens": [np.arange(1, 20, dtype=np.int32)] * 10}, 3)
    shapes = {}
    for drop in (False, True):
        with memory_loader(values, TOKENS, 4, pack=Pack(seq_len=16, eos_id=0), until="end",
                           drop_last=drop, shuffle=shuffle, device="cpu") as loader:
            shapes[drop] = [tuple(b["tokens"].shape) for b in loader]
    assert shapes[False] == [(4, 16)] * 3 + [(1, 16)]  # 200 tokens, 12.5 rows
    assert shapes[True] == [(4, 16)] * 3


def test_numpy_integers_in_pack_and_shuffle_become_ints_that_a_state_keeps() -> None:
    # Hyperparameters from a numpy array: the seed overflowed in the shuffle
    # buffer, and numpy scalars in state_dict() failed json.dumps and
    # torch.load's default (weights_only).
    import io

    hp = np.array([16, 0, 4, 7])
    shuffle = Shuffle(buffer=hp[2], seed=np.uint64(hp[3]))
    pack = Pack(seq_len=hp[0], eos_id=hp[1], pad_id=np.int32(0))
    assert [type(v) for v in (shuffle.buffer, shuffle.seed, pack.seq_len, pack.eos_id,
                              pack.pad_id)] == [int] * 5
    values = TOKENS.encode_blocks({"tokens": [np.arange(1, 30, dtype=np.int32)] * 10}, 2)
    with memory_loader(values, TOKENS, 2, pack=pack, shuffle=Shuffle(buffer=hp[2], seed=hp[3]),
                       until="end", device="cpu") as loader:
        next(loader)
        state = loader.state_dict()
    assert json.loads(json.dumps(state)) is not None
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    assert torch.load(buf)["loader"]["pack"] == state["pack"]
