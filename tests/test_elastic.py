"""Elastic resume: a state saved by N ranks, merged, loaded by a job of M ranks.

On the memory source, ranks with static assignment: N loaders read, each
stops after some batches and saves its state; ``Loader.merge_states`` makes
one of them; M loaders given it read to the end. Every record (or token) is
delivered exactly once over both jobs: the records each old rank had read
but not handed out (its shuffle buffer, its packer's unfinished documents,
batches waiting in its queue) included. NOTE [ Elastic resume ].
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kfeed import ConfigError, Loader, MemorySource, Mix, Pack, Schema, Shuffle

ROWS = Schema({"id": ("int64", ())})
TOKENS = Schema({"tokens": ("int32", (None,))})

ELASTIC = settings(max_examples=30, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def rank_loader(values, rank, world, *, state=None, topics="memory", schema=ROWS, **kw):
    loader = Loader(None, topics, schema, kw.pop("batch_size", 16),
                    source=MemorySource(values), device="cpu", until="end", rank=rank,
                    world_size=world, assignment="static", **kw)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def run_job(values, world, stops, state, key, **kw):
    """Each rank reads (up to its stop, None: to the end; 0: saves before its first batch);
    what it handed out, and its state."""
    out, states = [], []
    for rank in range(world):
        loader = rank_loader(values, rank, world, state=state, **kw)
        with loader:
            for i, batch in enumerate(loader if stops is None or stops[rank] else ()):
                out.append(batch[key].numpy().copy())
                if stops is not None and i + 1 == stops[rank]:
                    break
            states.append(loader.state_dict())
    return out, states


def row_parts(sizes, per_block):
    vals, k = {}, 0
    for p, n in enumerate(sizes):
        ids = np.arange(k, k + n)
        k += n
        vals[p] = ROWS.encode_blocks({"id": ids}, per_block)
    return vals, k


@ELASTIC
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
       per_block=st.integers(1, 20), n=st.integers(1, 4), m=st.integers(1, 4),
       shuffle=st.one_of(st.none(), st.integers(1, 60)), data=st.data())
def test_rows_saved_by_n_ranks_are_read_once_by_m(sizes, per_block, n, m, shuffle, data):
    parts = len(sizes)
    n, m = min(n, parts), min(m, parts)
    values, total = row_parts(sizes, per_block)
    stops = [data.draw(st.integers(1, 12)) for _ in range(n)]
    kw = {"shuffle": Shuffle(shuffle, seed=3) if shuffle else None}
    first, states = run_job(values, n, stops, None, "id", **kw)
    rest, _ = run_job(values, m, None, Loader.merge_states(states), "id", **kw)
    ids = np.concatenate(first + rest) if first + rest else np.empty(0, np.int64)
    assert sorted(ids.tolist()) == list(range(total))


@ELASTIC
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
       n=st.integers(1, 4), m=st.integers(1, 4), k=st.one_of(st.none(), st.integers(1, 4)),
       seq_len=st.integers(4, 40), shuffle=st.one_of(st.none(), st.integers(1, 20)),
       data=st.data())
def test_tokens_saved_by_n_ranks_are_read_once_by_m_partial_documents_too(
        sizes, n, m, k, seq_len, shuffle, data):
    # With k: the m ranks stop too, and k ranks read the rest (two changes of size).
    parts = len(sizes)
    n, m = min(n, parts), min(m, parts)
    rng = np.random.default_rng(sum(sizes) + seq_len)
    values, tokens, token = {}, [], 3
    for p, count in enumerate(sizes):
        docs = []
        for _ in range(count):
            length = int(rng.choice([1, 3, 17, 60]))
            docs.append(np.arange(token, token + length, dtype=np.int32))  # every token once
            token += length
        tokens += [t for d in docs for t in d.tolist()]
        values[p] = TOKENS.encode_blocks({"tokens": docs}, int(rng.integers(1, 6)))
    stops = [data.draw(st.integers(1, 8)) for _ in range(n)]
    kw = {"schema": TOKENS, "batch_size": 2, "pack": Pack(seq_len, eos_id=2, pad_id=0),
          "shuffle": Shuffle(shuffle, seed=5) if shuffle else None}
    first, states = run_job(values, n, stops, None, "tokens", **kw)
    if k is not None:
        more, states = run_job(values, m, [data.draw(st.integers(1, 8)) for _ in range(m)],
                               Loader.merge_states(states), "tokens", **kw)
        first += more
        m = min(k, parts)
    rest, _ = run_job(values, m, None, Loader.merge_states(states), "tokens", **kw)
    got = np.concatenate([b.reshape(-1) for b in first + rest]) if first + rest \
        else np.empty(0, np.int32)
    assert (got == 2).sum() == sum(sizes)  # an EOS a document
    got = got[got >= 3]  # less padding and EOS
    assert Counter(got.tolist()) == Counter(tokens)


def test_long_documents_through_two_changes_of_size_come_out_once():
    # 4 ranks, then 2, then 3: a document part-way out at the first merge went
    # further on its new rank, while the other rank of the second job kept the
    # first merge's count for it; the second merge let that stale count win
    # and 32 tokens came out twice.
    values, tokens, k = {}, [], 3
    for p in range(4):
        docs = [np.arange(k + 300 * d, k + 300 * (d + 1), dtype=np.int32) for d in range(3)]
        k += 900
        tokens += [t for d in docs for t in d.tolist()]
        values[p] = TOKENS.encode_blocks({"tokens": docs}, 1)
    kw = {"schema": TOKENS, "batch_size": 2, "pack": Pack(16, eos_id=2, pad_id=0)}
    first, states = run_job(values, 4, [1, 1, 1, 1], None, "tokens", **kw)
    mid, states = run_job(values, 2, [1, 1], Loader.merge_states(states), "tokens", **kw)
    rest, _ = run_job(values, 3, None, Loader.merge_states(states), "tokens", **kw)
    got = np.concatenate([b.reshape(-1) for b in first + mid + rest])
    assert Counter(got[got >= 3].tolist()) == Counter(tokens)


def test_a_mixture_saved_by_two_ranks_is_read_once_by_three():
    values = {}
    k = 0
    for t in ("a", "b"):
        for p in range(6):
            values[(t, p)] = ROWS.encode_blocks({"id": np.arange(k, k + 90)}, 7)
            k += 90
    mix = Mix({"a": 0.7, "b": 0.3}, seed=1, exhausted="renormalize")
    kw = {"topics": mix, "shuffle": Shuffle(25, seed=2)}
    first, states = run_job(values, 2, [5, 9], None, "id", **kw)
    rest, _ = run_job(values, 3, None, Loader.merge_states(states), "id", **kw)
    ids = np.concatenate(first + rest)
    assert sorted(ids.tolist()) == list(range(k))


@pytest.mark.parametrize("kind", ["shuffle", "pack", "mix"])
def test_states_saved_before_a_resumed_ranks_first_batch_merge_again(kind):
    # A job resumed from a merged state checkpoints while some ranks have
    # not had their first batch: those hold the whole merged state, not
    # assigned yet. Merged again, each partition comes from the rank that
    # read it, or from one copy; every record comes out once over 3 jobs.
    if kind == "pack":
        rng = np.random.default_rng(1)
        docs = [[1000 * p + 100 * d + 10 + np.arange(int(rng.integers(1, 40)), dtype=np.int32)
                 for d in range(9)] for p in range(4)]
        values = {p: TOKENS.encode_blocks({"tokens": docs[p]}, 3) for p in range(4)}
        expect = Counter(t for part in docs for d in part for t in d.tolist())
        kw = {"schema": TOKENS, "batch_size": 2, "key": "tokens",
              "pack": Pack(16, eos_id=2, pad_id=1), "shuffle": Shuffle(6, seed=3)}
    else:
        values, total = row_parts([60, 45, 80, 30], 5)
        expect = Counter(range(total))
        kw = {"key": "id", "shuffle": Shuffle(10, seed=1), "batch_size": 8}
        if kind == "mix":
            kw["topics"] = Mix({"memory": 1.0}, seed=4)
    key = kw.pop("key")
    first, states = run_job(values, 2, [3, 2], None, key, **kw)
    second, states = run_job(values, 3, [0, 2, 0], Loader.merge_states(states), key, **kw)
    assert states[0]["inherited"] and not states[1]["inherited"]
    rest, _ = run_job(values, 2, None, Loader.merge_states(states), key, **kw)
    got = np.concatenate([b.reshape(-1) for b in first + second + rest])
    assert Counter(got[got >= 3].tolist() if kind == "pack" else got.tolist()) == expect


def test_states_of_different_loaders_do_not_merge():
    values, _ = row_parts([50, 50], 5)
    _, plain = run_job(values, 2, [1, 1], None, "id")
    _, shuffled = run_job(values, 2, [1, 1], None, "id", shuffle=Shuffle(4))
    with pytest.raises(ConfigError, match="different kinds"):
        Loader.merge_states([plain[0], shuffled[1]])
    with pytest.raises(ConfigError, match="in two of the states"):
        Loader.merge_states([shuffled[0], shuffled[0]])
    _, other = run_job(values, 2, [1, 1], None, "id", shuffle=Shuffle(5))
    with pytest.raises(ConfigError, match="differ in their Shuffle"):
        Loader.merge_states([shuffled[0], other[1]])


def test_mixture_states_merge_as_a_resume_compares_them_and_a_cut_one_is_refused():
    # The merge compared the states' mixtures as saved: Mix({a: .5, b: .5}) did
    # not merge with Mix({a: 1, b: 1}), the same order, which a resume takes,
    # and its error said not how they differ. A cut state raised a KeyError.
    vals = {(t, p): ROWS.encode_blocks({"id": k * 1000 + p * 100 + np.arange(50)}, 5)
            for k, t in enumerate("ab") for p in range(2)}

    def mix(weights, seed=1):
        return Mix(weights, seed=seed, exhausted="renormalize")

    out, half = run_job(vals, 2, [2, 1], None, "id", topics=mix({"a": .5, "b": .5}))
    _, one = run_job(vals, 2, [2, 1], None, "id", topics=mix({"a": 1, "b": 1}))
    rest, _ = run_job(vals, 1, None, Loader.merge_states([half[0], one[1]]), "id",
                      topics=mix({"a": 1, "b": 1}))
    assert sorted(np.concatenate(out + rest).tolist()) == [
        k * 1000 + p * 100 + i for k in range(2) for p in range(2) for i in range(50)]
    _, other = run_job(vals, 2, [2, 1], None, "id", topics=mix({"a": .5, "b": .5}, seed=2))
    with pytest.raises(ConfigError, match="differ in their Mix: its seed 2, the first state's 1"):
        Loader.merge_states([half[0], other[1]])
    cut = {**half[1], "mix": {k: v for k, v in half[1]["mix"].items() if k != "live"}}
    with pytest.raises(ConfigError, match=r"not a kfeed loader state: .*KeyError\('live'\)"):
        Loader.merge_states([cut, half[0]])


def test_what_the_ranks_held_back_is_in_the_merged_state_and_comes_out_once():
    rng = np.random.default_rng(0)
    values, tokens, k = {}, [], 3
    for p in range(3):
        docs = []
        for _ in range(40):
            length = int(rng.integers(1, 40))
            docs.append(np.arange(k, k + length, dtype=np.int32))
            k += length
        tokens += [t for d in docs for t in d.tolist()]
        values[p] = TOKENS.encode_blocks({"tokens": docs}, 4)
    kw = {"schema": TOKENS, "batch_size": 2, "pack": Pack(16, eos_id=2, pad_id=0),
          "shuffle": Shuffle(10, seed=5)}
    first, states = run_job(values, 3, [3, 2, 4], None, "tokens", **kw)
    merged = Loader.merge_states(states)
    held = sum(len(s["order"]["held"]) + len(s["order"]["outbox"]) for s in states)
    assert len(merged["order"]["outbox"]) == held > 3 * 10 - 3  # the buffers, about full
    assert len(merged["partial"]) == sum(1 for s in states if s["pack_offset"]) >= 1
    rest, _ = run_job(values, 2, None, merged, "tokens", **kw)
    got = np.concatenate([b.reshape(-1) for b in first + rest])
    assert Counter(got[got >= 3].tolist()) == Counter(tokens)


def test_group_mode_ranks_keep_the_merged_state_of_the_partitions_they_are_given():
    values, total = row_parts([120, 80, 200, 50], 6)
    kw = {"shuffle": Shuffle(30, seed=1)}
    first, states = run_job(values, 2, [4, 6], None, "id", **kw)
    merged = Loader.merge_states(states)
    rest = []
    for mine in ([0, 2], [1, 3]):  # the group's first assignment splits the partitions
        loader = Loader(None, "memory", ROWS, 16, source=MemorySource(values, first=mine),
                        device="cpu", until="end", **kw)
        loader.load_state_dict(merged)
        with loader:
            rest += [b["id"].numpy().copy() for b in loader]
    ids = np.concatenate(first + rest)
    assert sorted(ids.tolist()) == list(range(total))


@pytest.mark.parametrize("exhausted", ["stop", "renormalize"])
def test_a_mixture_one_rank_finished_is_read_to_the_end_by_the_new_ranks(exhausted):
    values, k = {}, 0
    for t, n in (("a", 400), ("b", 400)):
        for p in range(2):  # rank 0: partition 0 of each topic, rank 1: partition 1
            n_here = n if p == 1 else 20
            values[(t, p)] = ROWS.encode_blocks({"id": np.arange(k, k + n_here)}, 5)
            k += n_here
    mix = Mix({"a": 0.5, "b": 0.5}, seed=1, exhausted=exhausted)
    kw = {"topics": mix, "batch_size": 8}
    first, states = run_job(values, 2, [100, 3], None, "id", **kw)  # rank 0 runs out
    assert states[0]["mix"]["ended"] and not states[1]["mix"]["ended"]
    rest, _ = run_job(values, 1, None,
                      Loader.merge_states(states), "id", **kw)
    ids = np.concatenate(first + rest)
    assert len(ids) == len(np.unique(ids))
    if exhausted == "renormalize":  # every record, once
        assert sorted(ids.tolist()) == list(range(k))
    else:  # the new ranks went on where rank 1 stood: more than the old job read
        assert len(rest) > 0


@pytest.mark.parametrize("stops", [[7, 8], [8, 8]])
def test_a_repeated_mixture_keeps_which_sources_ran_out_through_a_merge(stops):
    # Mix(exhausted="repeat"): a (2 x 30) is read again until b (2 x 40) runs out
    # once. The merged state forgot that both had run out on every rank, so b
    # was read a second time after a ran out again.
    values = {}
    for k, (t, n) in enumerate((("a", 30), ("b", 40))):
        for p in range(2):
            values[(t, p)] = ROWS.encode_blocks({"id": np.arange(n) + k * 10**6 + p * 10**4}, 2)
    mix = Mix({"a": 0.5, "b": 0.5}, seed=0, exhausted="repeat")
    kw = {"topics": mix, "shuffle": Shuffle(12, seed=1), "batch_size": 8}
    first, states = run_job(values, 2, stops, None, "id", **kw)
    assert [st["mix"]["ran_out"] for st in states] == [[True, True]] * 2
    rest, _ = run_job(values, 2, None, Loader.merge_states(states), "id", **kw)
    ids = np.concatenate(first + rest)
    b = Counter(ids[ids >= 10**6].tolist())
    assert len(b) == 80 and set(b.values()) == {1}
    # One rank, in order: its state through merge_states gives the very stream
    # the state gives (a shuffle's held records would come first).
    kw.pop("shuffle")
    whole, _ = run_job(values, 1, None, None, "id", **kw)
    for stop in (4, 8):
        head, (state,) = run_job(values, 1, [stop], None, "id", **kw)
        plain, _ = run_job(values, 1, None, state, "id", **kw)
        merged, _ = run_job(values, 1, None, Loader.merge_states([state]), "id", **kw)
        assert np.array_equal(np.concatenate(head + merged), np.concatenate(head + plain))
        assert np.array_equal(np.concatenate(head + plain), np.concatenate(whole))


def test_an_epoch_one_rank_finished_and_another_did_not_is_read_to_its_end():
    # Rank 0's partition is short: it finishes epoch 0 while rank 1 is in the middle of it.
    values = {0: ROWS.encode_blocks({"id": np.arange(0, 20)}, 5),
              1: ROWS.encode_blocks({"id": np.arange(20, 420)}, 5)}
    kw = {"batch_size": 8, "epochs": 2}
    first, states = run_job(values, 2, [100, 3], None, "id", **kw)
    assert [s["epochs"]["finished"] for s in states] == [True, False]
    merged = Loader.merge_states(states)
    assert merged["epochs"]["epoch"] == 0 and not merged["epochs"]["finished"]
    loader = rank_loader(values, 0, 1, state=merged, **kw)
    with loader:
        rest = [b["id"].numpy().copy() for b in loader]  # the rest of epoch 0
        again = [b["id"].numpy().copy() for b in loader]  # epoch 1
    assert sorted(np.concatenate(first + rest).tolist()) == list(range(420))
    assert sorted(np.concatenate(again).tolist()) == list(range(420))


def test_states_of_different_epochs_do_not_merge():
    values = {0: ROWS.encode_blocks({"id": np.arange(0, 20)}, 5),
              1: ROWS.encode_blocks({"id": np.arange(20, 420)}, 5)}
    kw = {"batch_size": 8, "epochs": 3}
    _, states = run_job(values, 2, [100, 3], None, "id", **kw)
    ahead = rank_loader(values, 0, 2, state=states[0], **kw)
    with ahead:
        for _ in ahead:  # rank 0 reads epoch 1 too
            pass
        later = ahead.state_dict()
    assert later["epochs"]["epoch"] == 1
    with pytest.raises(ConfigError, match=r"the states are of different epochs \(0 and 1\)"):
        Loader.merge_states([later, states[1]])
    _, plain = run_job(values, 2, [1, 1], None, "id", batch_size=8)
    with pytest.raises(ConfigError, match="different kinds"):
        Loader.merge_states([plain[0], states[1]])


@pytest.mark.parametrize("late", ["after_commits", "before_its_first_batch"])
def test_ranks_that_resolved_their_window_apart_merge(late):
    # Without torch.distributed each rank resolves the epoch's window at its
    # first batch: a rank that started after another committed had another
    # start for that rank's partition (or, saved before its first batch, no
    # window), and the states did not merge ("differ in their epochs' window").
    rank = static_ranks({p: np.arange(p * 100, p * 100 + 40) for p in range(2)}, 4, 8,
                        epochs=2, commit_interval_ms=0)
    a, b = rank(0, 2), rank(1, 2)
    got = [next(a)["id"].numpy().copy() for _ in range(3)]
    if late == "after_commits":
        got += [next(b)["id"].numpy().copy() for _ in range(3)]
    states = [a.state_dict(), b.state_dict()]
    a.close()
    b.close()
    if late == "after_commits":
        starts = [s["epochs"]["window"]["start"] for s in states]
        assert starts[0] != starts[1]  # rank 1 saw rank 0's commits
    else:
        assert states[1]["epochs"]["window"] is None
    merged = Loader.merge_states(states)
    assert merged["epochs"]["window"]["start"] == states[0]["epochs"]["window"]["start"]
    one = rank(0, 1)
    one.load_state_dict(merged)
    with one:
        rest = [b["id"].numpy().copy() for b in one]
    assert sorted(np.concatenate(got + rest).tolist()) == [*range(40), *range(100, 140)]


def test_windows_that_differ_where_no_rank_reads_do_not_merge():
    values = {p: ROWS.encode_blocks({"id": np.arange(p * 100, p * 100 + 40)}, 4)
              for p in range(2)}
    _, states = run_job(values, 2, [1, 1], None, "id", batch_size=8, epochs=2)
    other = json.loads(json.dumps(states[1]))
    other["epochs"]["window"]["until"][0][2] -= 1  # rank 0's partition, which rank 1 never reads
    assert Loader.merge_states([states[0], other])["epochs"] == \
        Loader.merge_states(states)["epochs"]
    both = json.loads(json.dumps(states[0]))
    both["epochs"]["window"]["until"][0][2] -= 2
    # Hand-made: both name the partition as theirs, at different ends.
    both["static"] = other["static"] = {"covers": [["memory", 0], ["memory", 1]],
                                        "of": [["memory", 0], ["memory", 1]]}
    with pytest.raises(ConfigError, match=r"differ in their epochs' window at \('memory', 0\)"):
        Loader.merge_states([both, other])


def static_ranks(ids: dict[int, np.ndarray], per_block: int, batch_size: int, **kw):
    """``loader(rank, world_size)``: static ranks over partitions of ``ids``, whose
    commits go where every loader made by it reads them, as a Kafka group's do;
    ``kw``: more Loader arguments."""
    rows = Schema({"id": ("int64", ())})
    values = {p: rows.encode_blocks({"id": v}, per_block) for p, v in ids.items()}
    shared: tuple[dict, dict, dict] = ({}, {}, {})

    def loader(rank: int, size: int) -> Loader:
        source = MemorySource(values)
        source.committed_positions, source.committed_by, source.committed_notes = shared
        return Loader(None, "memory", rows, batch_size, source=source, device="cpu",
                      until="end", rank=rank, world_size=size, assignment="static", **kw)
    return loader


def test_a_merged_state_of_more_than_64_ranks_keeps_every_lineage():
    # The loader kept the first 64 lineages: the commits rank 64 made after the
    # checkpoint, before the job died, then counted as another reader's and won
    # over the state, and 50 of its records were never read again.
    world = 65
    loader = static_ranks({p: np.arange(p * 1000, p * 1000 + 100 * (p == 64))
                           for p in range(world)}, 5, 10)
    trained, states = [], []
    for rank in range(world):
        with loader(rank, world) as ld:
            it = iter(ld)
            if rank == 64:
                trained += [i for _ in range(2) for i in next(it)["id"].tolist()]
            states.append(ld.state_dict())  # the checkpoint: every rank at one step
            if rank == 64:
                for _ in range(5):  # read (and committed) after it; then the job dies
                    next(it)
    merged = Loader.merge_states(states)
    assert len(merged["lineages"]) == world
    resumed = loader(0, 1)
    resumed.load_state_dict(merged)
    with resumed:
        trained += [i for b in resumed for i in b["id"].tolist()]
        assert len(resumed.state_dict()["lineages"]) == world
    assert Counter(trained) == Counter(range(64000, 64100))


def test_one_static_ranks_state_is_refused_where_it_does_not_cover_the_ranks_partitions():
    # One rank's state, loaded by a job of another size: the partitions it did
    # not hold started at the commits the other rank made after the checkpoint
    # before the job died (24 of 160 records lost). A merged state covers them.
    loader = static_ranks({p: np.arange(p * 40, p * 40 + 40) for p in range(4)}, 4, 8)
    trained, states = [], []
    for rank in range(2):
        with loader(rank, 2) as ld:
            it = iter(ld)
            trained += [i for _ in range(2) for i in next(it)["id"].tolist()]
            states.append(ld.state_dict())  # the checkpoint, at step 2
            for _ in range(3):  # read and committed after it; then the job dies
                next(it)
    assert states[0]["static"] == {"covers": [["memory", 0], ["memory", 2]],
                                   "of": [["memory", p] for p in range(4)]}
    alone = loader(0, 1)
    alone.load_state_dict(json.loads(json.dumps(states[0])))
    with pytest.raises(ConfigError, match=(
            r"^rank 0 of 1 is dealt \[\('memory', 1\), \('memory', 3\)\], whose positions the "
            r"state it loaded does not hold: .* load Loader.merge_states\(every rank's state\) "
            r"on every rank instead$")):
        next(alone)
    alone.close()
    # The same rank of the same job takes its own state; a merged one goes anywhere.
    again = loader(1, 2)
    again.load_state_dict(states[1])
    assert set(next(again)["id"].tolist()) <= {*range(40, 80), *range(120, 160)}  # its own
    again.close()
    merged = Loader.merge_states(states)
    assert merged["static"]["covers"] == [["memory", p] for p in range(4)]
    resumed = loader(0, 1)
    resumed.load_state_dict(merged)
    with resumed:
        trained += [i for b in resumed for i in b["id"].tolist()]
    assert Counter(trained) == Counter(range(160))
