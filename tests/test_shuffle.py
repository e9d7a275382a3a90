"""The seeded shuffle buffer: nothing lost or repeated, deterministic, exact across resumes.

The tests simulate a source: partitions of records keyed (partition, offset,
sub), consumed in an interleaved order, and after a stop re-read from the
shuffle's watermarks the way a Kafka consumer would. No broker needed.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kfeed import ConfigError, KfeedError, Schema
from kfeed.tokens import Pack, Packer, Shuffle, ShuffleBuffer

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- a simulated source ----------------------------------------------------------


def make_partitions(sizes: list[int], per_offset: int, seed: int) -> dict[object, list[tuple]]:
    """Per partition, its records in Kafka order: (offset, sub) with 1..per_offset subs."""
    rng = np.random.default_rng(seed)
    parts: dict[object, list[tuple]] = {}
    for i, size in enumerate(sizes):
        name = ("topic", i) if i % 2 else i  # partitions may be any hashable
        recs = []
        offset = 10 * i
        while len(recs) < size:
            for sub in range(int(rng.integers(1, per_offset + 1))):
                recs.append((offset, sub))
            offset += int(rng.integers(1, 3))
        parts[name] = recs[:size]
    return parts


def interleave(streams: dict[object, list[tuple]], seed: int) -> list[tuple]:
    """A consumption order: records of each partition stay in order."""
    rng = np.random.default_rng(seed)
    cursors = {p: 0 for p in streams}
    out = []
    while True:
        live = [p for p in streams if cursors[p] < len(streams[p])]
        if not live:
            return out
        p = live[int(rng.integers(len(live)))]
        o, s = streams[p][cursors[p]]
        cursors[p] += 1
        out.append((p, o, s))


def item(key: tuple) -> str:
    return f"{key[0]}@{key[1]}.{key[2]}"


def push_all(buf: ShuffleBuffer, order: list[tuple]) -> list[tuple]:
    out = []
    for p, o, s in order:
        out += buf.push(p, o, item((p, o, s)), sub=s)
    return out


def keys_of(emitted: list[tuple]) -> list[tuple]:
    for key, it in emitted:
        assert it == item(key)  # the record travels with its key
    return [key for key, _ in emitted]


def uninterrupted(parts, order, shuffle: Shuffle) -> list[tuple]:
    buf = ShuffleBuffer(shuffle)
    return keys_of(push_all(buf, order) + buf.drain())


def reread(parts, buf: ShuffleBuffer, order: list[tuple], seed: int) -> list[tuple]:
    """What a consumer re-reading from the watermarks sees after ``buf.load_state``.

    Each partition from its watermark offset, in Kafka order. The records past
    the read positions come in their original order (``order``), which is
    what an identical continuation needs; the older ones, already emitted or
    held, are interleaved at random, each before its partition's newer ones.
    """
    read = {p: tuple(r) for p, _w, r in buf.state()["partitions"]}
    starts = buf.resume_offsets()
    new = [k for k in order if k[0] not in read or (k[1], k[2]) >= read[k[0]]]
    old = {p: [(p, o, s) for o, s in recs if p in read and o >= starts[p] and (o, s) < read[p]]
           for p, recs in parts.items()}
    rng = np.random.default_rng(seed)
    out, i = [], 0
    while i < len(new) or any(old.values()):
        choices = [p for p in old if old[p]]
        if i < len(new) and not old[new[i][0]]:
            choices.append(None)
        pick = choices[int(rng.integers(len(choices)))]
        if pick is None:
            out.append(new[i])
            i += 1
        else:
            out.append(old[pick].pop(0))
    return out


# -- permutation and determinism ----------------------------------------------------


@FAST
@given(sizes=st.lists(st.integers(0, 60), min_size=1, max_size=4), per=st.integers(1, 4),
       buffer=st.integers(1, 40), seed=st.integers(0, 2**64 - 1))
def test_the_output_is_a_permutation_of_the_input(sizes, per, buffer, seed):
    parts = make_partitions(sizes, per, seed % 1000)
    order = interleave(parts, seed % 997)
    got = uninterrupted(parts, order, Shuffle(buffer, seed))
    assert sorted(got, key=repr) == sorted(order, key=repr)
    assert len(set(got)) == len(got) == sum(sizes)


def test_the_order_depends_only_on_the_seed_and_the_input_order():
    parts = make_partitions([200, 150, 100], 3, 0)
    order = interleave(parts, 1)
    a = uninterrupted(parts, order, Shuffle(64, 7))
    assert a == uninterrupted(parts, order, Shuffle(64, 7))
    assert a != uninterrupted(parts, order, Shuffle(64, 8))
    assert a != order


def test_the_generator_is_splitmix64():
    # The generator is part of the resume contract: a change here breaks the
    # continuation of every saved state. Reference values of SplitMix64 from
    # seed 1234567 (Vigna's splitmix64.c).
    buf = ShuffleBuffer(Shuffle(1, seed=1234567))
    assert [buf._draw(2**64) for _ in range(3)] == [
        6457827717110365317, 3203168211198807973, 9817491932198370423]


def test_it_actually_shuffles():
    n, buffer = 5000, 500
    buf = ShuffleBuffer(Shuffle(buffer, seed=3))
    got = keys_of(push_all(buf, [(0, i, 0) for i in range(n)]) + buf.drain())
    offsets = np.array([o for _, o, _ in got])
    displacement = np.abs(offsets - np.arange(n))
    assert displacement.mean() > buffer / 2
    # ...yet the order still follows the input's at the scale of the whole stream.
    assert np.corrcoef(offsets, np.arange(n))[0, 1] > 0.9


def test_a_repeated_record_is_skipped():
    buf = ShuffleBuffer(Shuffle(2, seed=0))
    order = [(0, 0, 0), (0, 1, 0), (0, 1, 0), (0, 0, 0), (0, 2, 0), (0, 2, 1), (0, 2, 0)]
    got = keys_of(push_all(buf, order) + buf.drain())
    assert sorted(got) == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 2, 1)]
    assert buf.skipped == 3


# -- exact resume -------------------------------------------------------------------


@FAST
@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=4), per=st.integers(1, 3),
       buffer=st.integers(1, 20), seed=st.integers(0, 2**64 - 1), ack=st.booleans(),
       data=st.data())
def test_a_resume_continues_exactly_like_an_uninterrupted_run(sizes, per, buffer, seed, ack,
                                                              data):
    parts = make_partitions(sizes, per, seed % 1000)
    order = interleave(parts, seed % 991)
    shuffle = Shuffle(buffer, seed)
    want = uninterrupted(parts, order, shuffle)

    got: list[tuple] = []  # what the downstream really used
    todo = order  # what the consumer reads, in its order
    state = None
    for stop in sorted(data.draw(st.lists(st.integers(0, len(order)), max_size=3))) + [None]:
        buf = ShuffleBuffer(shuffle, ack=ack)
        if state is not None:
            buf.load_state(json.loads(json.dumps(state)))  # it survives JSON
            todo = reread(parts, buf, order, seed % 13)
        n = len(todo) if stop is None else min(stop, len(todo))
        emitted = keys_of(push_all(buf, todo[:n]))
        if stop is None:
            got += emitted + keys_of(buf.drain())
            break
        # With ack, the downstream used only part of what came out; the rest
        # dies with it and must come out again after the resume.
        used = data.draw(st.integers(0, len(emitted))) if ack else len(emitted)
        if ack:
            buf.ack(used)
        got += emitted[:used]
        state = buf.state()
        assert len(state["held"]) <= buffer
        assert ack or state["outbox"] == []
    assert got == want


def test_the_state_says_where_to_re_read_and_is_bounded():
    buf = ShuffleBuffer(Shuffle(3, seed=5))
    push_all(buf, [(0, i, 0) for i in range(100)] + [(1, i, s) for i in range(5) for s in (0, 1)])
    state = buf.state()
    assert len(state["held"]) == 3 and state["outbox"] == []
    marks = buf.watermarks()
    held = {tuple(k) for k in state["held"]}
    for p, (o, s) in marks.items():
        # Below the watermark nothing is held; the watermark itself is held or the read end.
        assert all((ho, hs) >= (o, s) for hp, ho, hs in held if hp == p)
    assert buf.resume_offsets() == {p: o for p, (o, _) in marks.items()}
    assert state["emitted"] == 110 - 3


def test_records_pushed_during_a_restore_wait_for_the_held_ones():
    shuffle = Shuffle(2, seed=9)
    first = ShuffleBuffer(shuffle)
    push_all(first, [(0, 0, 0), (0, 1, 0), (0, 2, 0)])
    state = first.state()
    held = sorted(tuple(k) for k in state["held"])
    resumed = ShuffleBuffer(shuffle)
    resumed.load_state(state)
    assert resumed.restoring and len(resumed) == 2
    assert resumed.push(0, 3, "new") == []  # past the read position: waits
    assert resumed.push(*held[0][:2], "a") == []
    out = resumed.push(*held[1][:2], "b")
    assert resumed.restoring is False and len(out) == 1  # the new one went in, one came out


def test_drain_with_records_never_pushed_again_raises():
    buf = ShuffleBuffer(Shuffle(4, seed=0))
    push_all(buf, [(0, i, 0) for i in range(3)])
    resumed = ShuffleBuffer(Shuffle(4, seed=0))
    resumed.load_state(buf.state())
    resumed.push(0, 0, "x")
    with pytest.raises(KfeedError, match="2 records of the loaded state were never pushed"):
        resumed.drain()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buffer": 0}, "buffer"),
        ({"buffer": -1}, "buffer"),
        ({"buffer": 2.5}, "buffer"),
        ({"buffer": 4, "seed": -1}, "seed"),
        ({"buffer": 4, "seed": 2**64}, "seed"),
        ({"buffer": 4, "seed": "1"}, "seed"),
    ],
)
def test_bad_shuffles_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Shuffle(**kwargs)


def test_bad_states_and_calls_raise_config_error():
    state = ShuffleBuffer(Shuffle(4, seed=1)).state()
    with pytest.raises(ConfigError, match="buffer=4, seed=1"):
        ShuffleBuffer(Shuffle(4, seed=2)).load_state(state)
    with pytest.raises(ConfigError, match="buffer=4, seed=1"):
        ShuffleBuffer(Shuffle(5, seed=1)).load_state(state)
    with pytest.raises(ConfigError, match="not a shuffle state"):
        ShuffleBuffer(Shuffle(4, seed=1)).load_state({"version": 1})
    with pytest.raises(ConfigError, match="version"):
        ShuffleBuffer(Shuffle(4, seed=1)).load_state({**state, "version": 99})
    # A state damaged by hand raised IndexError, OverflowError or TypeError from
    # inside, or loaded records past their partition's read position: the
    # buffer then waited for them for ever, holding every record after.
    full = ShuffleBuffer(Shuffle(4, seed=1), ack=True)
    for o in range(10):
        full.push(("t", 0), o, o)
    good = full.state()
    assert good["held"][0] == [("t", 0), 0, 0] and good["partitions"][0][2] == [9, 1]
    for damage, match in [
            (lambda s: s["partitions"][0].__setitem__(2, [5]), "not enough values"),
            (lambda s: s["held"][0].__setitem__(1, 2**70), "is not an offset"),
            (lambda s: s["partitions"][0][2].__setitem__(0, 2**70), "is not an offset"),
            (lambda s: s["held"][0].__setitem__(0, {"a": 1}), "unhashable"),
            (lambda s: s["held"][0].__setitem__(1, 3.5), "float"),
            (lambda s: s.__setitem__("emitted", -5), "is not an offset"),
            (lambda s: s.__setitem__("allow", [[["t", 0], [3], []]]), "not enough values"),
            (lambda s: s["held"][0].__setitem__(1, 10**6),
             r"record \[\('t', 0\), 1000000, 0\] is past where its partition was read to, "
             r"\[9, 1\]"),
            (lambda s: s["outbox"][0].__setitem__(0, ("u", 9)),
             "of a partition it does not list")]:
        damaged = copy.deepcopy(good)
        damage(damaged)
        with pytest.raises(ConfigError, match="^not a shuffle state: .*" + match):
            ShuffleBuffer(Shuffle(4, seed=1), ack=True).load_state(damaged)
    ShuffleBuffer(Shuffle(4, seed=1), ack=True).load_state(copy.deepcopy(good))
    buf = ShuffleBuffer(Shuffle(4, seed=1))
    buf.push(0, 0, "x")
    with pytest.raises(ConfigError, match="before the first push"):
        buf.load_state(state)
    with pytest.raises(ConfigError, match="ack=True"):
        buf.ack(1)
    acked = ShuffleBuffer(Shuffle(1, seed=1), ack=True)
    acked.push(0, 0, "x")
    acked.push(0, 1, "y")
    with pytest.raises(ConfigError, match="1 records are waiting"):
        acked.ack(2)


# -- fixed-shape records and packed documents ------------------------------------------


def test_fixed_shape_records_from_blocks_shuffle_exactly_once():
    schema = Schema({"id": ("int64", ()), "x": ("float32", (4,))})
    blocks = {p: schema.encode_blocks({"id": np.arange(p * 1000, p * 1000 + 300),
                                       "x": np.zeros((300, 4), np.float32)}, 32) for p in (0, 1)}
    out = {"id": np.empty(64, np.int64), "x": np.empty((64, 4), np.float32)}
    buf = ShuffleBuffer(Shuffle(100, seed=4))
    emitted = []
    for offset in range(10):
        for p in (0, 1):
            res = schema.decode_into([blocks[p][offset]], out)
            for sub in range(res.rows):
                emitted += buf.push(p, offset, int(out["id"][sub]), sub=sub)
    emitted += buf.drain()
    ids = [it for _, it in emitted]
    assert sorted(ids) == list(range(300)) + list(range(1000, 1300))
    assert ids != sorted(ids)


def run_shuffled_packing(parts_docs, order, shuffle, pack, batch_size, stops):
    """A loader in miniature: shuffle documents, pack them, stop and resume at batch
    boundaries (state = shuffle state + packer state); every batch's tokens."""
    parts = {p: [(o, 0) for o in range(len(docs))] for p, docs in parts_docs.items()}
    batches: list[np.ndarray] = []
    state = None
    todo = order
    stops = sorted(stops)
    while True:
        buf = ShuffleBuffer(shuffle, ack=True)
        packer = Packer(pack, batch_size)
        out = packer.empty()
        if state is not None:
            buf.load_state(state["shuffle"])
            packer.load_state(state["packer"])
            todo = reread(parts, buf, order, len(batches))
        stop = stops.pop(0) if stops else None
        i = 0
        finished = False
        while True:
            info = packer.next_batch(out)
            if info is None:
                if finished:
                    return batches
                if i < len(todo):
                    p, o, _ = todo[i]
                    i += 1
                    emitted = buf.push(p, o, parts_docs[p][o])
                else:
                    emitted = buf.drain()
                    finished = True
                if emitted:
                    packer.feed(*_flat([it for _, it in emitted]))
                if finished:
                    packer.finish()
                continue
            batches.append(out["tokens"][: info.rows].copy())
            buf.ack(info.documents)  # the step that used the batch finished
            if stop is not None and len(batches) >= stop:
                state = {"shuffle": buf.state(), "packer": packer.state()}
                break


def _flat(docs):
    lengths = np.array([len(d) for d in docs], np.int64)
    return (np.concatenate(docs) if docs else np.empty(0, np.int32)), lengths


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=3), seed=st.integers(0, 1000),
       buffer=st.integers(1, 12), seq_len=st.integers(1, 24), batch_size=st.integers(1, 3),
       split_long=st.booleans(), stops=st.lists(st.integers(1, 30), max_size=3))
def test_shuffled_packing_resumes_token_exact(sizes, seed, buffer, seq_len, batch_size,
                                              split_long, stops):
    rng = np.random.default_rng(seed)
    parts_docs = {p: [rng.integers(3, 1000, int(rng.choice([0, 1, 5, 40]))).astype(np.int32)
                      for _ in range(n)] for p, n in enumerate(sizes)}
    order = interleave({p: [(o, 0) for o in range(n)] for p, n in enumerate(sizes)}, seed)
    shuffle = Shuffle(buffer, seed)
    pack = Pack(seq_len, eos_id=1, pad_id=0, split_long=split_long)
    whole = run_shuffled_packing(parts_docs, order, shuffle, pack, batch_size, [])
    resumed = run_shuffled_packing(parts_docs, order, shuffle, pack, batch_size, stops)
    assert len(resumed) == len(whole)
    for a, b in zip(resumed, whole):
        np.testing.assert_array_equal(a, b)
    tokens = np.concatenate([b.reshape(-1) for b in whole]) if whole else np.empty(0)
    total = sum(len(d) for docs in parts_docs.values() for d in docs)
    assert not split_long or (tokens >= 3).sum() == total


# -- many records per call, and the state format ---------------------------------------


def reference_order(records: list[tuple], size: int, seed: int) -> list[tuple]:
    """The reservoir in plain Python, the oracle of ``push_many``: keys emitted, then drained."""
    mask = 2**64 - 1
    rng = seed

    def draw(n: int) -> int:
        nonlocal rng
        rng = s = (rng + 0x9E3779B97F4A7C15) & mask
        z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return ((z ^ (z >> 31)) * n) >> 64

    held: list[tuple] = []
    arrived: dict = {}
    out = []
    for p, o, s in records:
        if p in arrived and (o, s) < arrived[p]:
            continue  # a repeat
        arrived[p] = (o, s + 1)
        if len(held) < size:
            held.append((p, o, s))
            continue
        j = draw(size)
        out.append(held[j])
        held[j] = (p, o, s)
    while held:
        j = draw(len(held))
        out.append(held[j])
        held[j] = held[-1]
        held.pop()
    return out


@FAST
@given(sizes=st.lists(st.integers(0, 80), min_size=1, max_size=3), per=st.integers(1, 4),
       buffer=st.integers(1, 30), seed=st.integers(0, 2**64 - 1), data=st.data())
def test_push_many_emits_what_the_reference_reservoir_emits(sizes, per, buffer, seed, data):
    parts = make_partitions(sizes, per, seed % 1000)
    order = interleave(parts, seed % 997)
    # Repeats here and there, as a re-read would bring them.
    dups = data.draw(st.lists(st.integers(0, max(0, len(order) - 1)), max_size=5))
    for i in sorted(set(dups), reverse=True):
        if order:
            order.insert(i + 1, order[i])
    buf = ShuffleBuffer(Shuffle(buffer, seed))
    items = {}
    rows = []
    for n, (p, o, s) in enumerate(order):
        rows.append([buf.pid(p), o, s, n])
        items[n] = (p, o, s)
    recs = np.array(rows, np.int64).reshape(-1, 4)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(recs)), max_size=4)))
    emitted, skipped = [], []
    for a, b in zip([0] + cuts, cuts + [len(recs)]):
        e, s = buf.push_many(recs[a:b])
        emitted += e.tolist()
        skipped += s.tolist()
    emitted += buf.drain_many().tolist()
    want = reference_order(order, buffer, seed)
    assert [items[it] for _p, _o, _s, it in emitted] == want
    assert [(buf._parts[p], o, s) for p, o, s, _ in emitted] == want
    assert len(skipped) == buf.skipped == len(order) - len(want)


def test_in_order_push_many_emits_every_record_as_pushed():
    buf = ShuffleBuffer(None, ack=True)
    recs = np.array([[buf.pid("a"), 5, s, 10 + s] for s in range(4)], np.int64)
    buf.seek("a", 5, 2)  # the first two were delivered before
    emitted, skipped = buf.push_many(recs)
    assert emitted[:, 3].tolist() == [12, 13] and skipped.tolist() == [10, 11]
    assert buf.watermarks() == {"a": (5, 2)}
    buf.ack(1)
    assert buf.watermarks() == {"a": (5, 3)}


def test_push_many_refuses_partition_ids_pid_never_gave():
    # Accepted and emitted, after which state() and watermarks() raised numpy's
    # ValueError ("key 1 names partition id 2, not one of the 1 known").
    buf = ShuffleBuffer(Shuffle(buffer=2, seed=0))
    buf.pid("topic-0")
    for bad in (2, -1):
        with pytest.raises(ConfigError, match=r"the ids pid\(\) gave are 0..0$"):
            buf.push_many(np.array([[0, 0, 0, 10], [bad, 0, 0, 11]], np.int64))
    assert buf.push_many(np.array([[0, 0, 0, 10]], np.int64))[0].tolist() == []
    assert buf.watermarks() == {"topic-0": (0, 0)}  # held in the buffer: nothing read past


# The state and the emitted order of a run of the buffer as it was before
# push_many (one record per call, in Python): the format and the order are
# part of every saved checkpoint.
GOLDEN_STATE = {
    "version": 1, "buffer": 3, "seed": 42, "rng": 18054082321272548835, "emitted": 2,
    "partitions": [["a", [0, 1], [5, 2]], [["t", 1], [0, 1], [5, 2]]],
    "held": [["a", 5, 1], ["a", 5, 0], [["t", 1], 5, 1]],
    "outbox": [["a", 1, 0], ["a", 0, 1], ["a", 1, 1], [["t", 1], 0, 1], [["t", 1], 1, 1],
               ["a", 2, 0], [["t", 1], 1, 0], [["t", 1], 2, 1], ["a", 2, 1], ["a", 3, 0],
               [["t", 1], 3, 0], [["t", 1], 3, 1], ["a", 4, 0], ["a", 3, 1], [["t", 1], 4, 0],
               ["a", 4, 1], [["t", 1], 4, 1], [["t", 1], 2, 0], [["t", 1], 5, 0]],
}
GOLDEN_FIRST = [(("t", 1), 0, 0), ("a", 0, 0)]  # the two acknowledged


def test_the_state_format_and_the_order_are_those_of_saved_checkpoints():
    buf = ShuffleBuffer(Shuffle(3, seed=42), ack=True)
    out = []
    for o in range(6):
        for p in ("a", ("t", 1)):
            for s in range(2):
                out += buf.push(p, o, f"{p}{o}.{s}", s)
    buf.ack(2)
    assert [k for k, _ in out[:2]] == GOLDEN_FIRST
    assert json.loads(json.dumps(buf.state())) == GOLDEN_STATE
    assert [k for k, _ in out[2:]] == [_as_key(k) for k in GOLDEN_STATE["outbox"]]
    resumed = ShuffleBuffer(Shuffle(3, seed=42), ack=True)
    resumed.load_state(GOLDEN_STATE)
    assert json.loads(json.dumps(resumed.state())) == GOLDEN_STATE


def _as_key(k: list) -> tuple:
    p = tuple(k[0]) if isinstance(k[0], list) else k[0]
    return (p, k[1], k[2])


def test_used_watermarks_stay_where_the_last_mark_used_left_them():
    buf = ShuffleBuffer(None, ack=True, track_used=True)
    for o in range(5):
        buf.push(0, o, o)
    buf.ack(2)
    buf.mark_used()
    buf.ack(2)  # handed out, its step not over
    assert buf.watermarks(used=True) == {0: (2, 0)}
    assert buf.watermarks() == {0: (4, 0)}
    buf.mark_used()
    assert buf.watermarks(used=True) == {0: (4, 0)}
    assert buf.state()["outbox"] == [[0, 4, 0]]


def test_remap_moves_every_item_held_waiting_or_to_replay():
    first = ShuffleBuffer(Shuffle(2, seed=1), ack=True)
    push_all(first, [(0, i, 0) for i in range(4)])
    first.ack(1)
    state = first.state()
    held = [tuple(k) for k in state["held"]]
    outbox = [tuple(k) for k in state["outbox"]]
    buf = ShuffleBuffer(Shuffle(2, seed=1), ack=True)
    buf.load_state(state)
    p = buf.pid(0)
    emitted, _ = buf.push_many(np.array([[p, *held[0][1:], 10], [p, 9, 0, 11]], np.int64))
    assert len(emitted) == 0 and sorted(buf.items().tolist()) == [10, 11]
    buf.remap(np.arange(20, dtype=np.int64) + 100)
    assert sorted(buf.items().tolist()) == [110, 111]
    rest = [[p, o, s, 20 + i] for i, (_p, o, s) in enumerate(sorted(held[1:] + outbox))]
    emitted, _ = buf.push_many(np.array(rest, np.int64))
    assert not buf.restoring
    # The outbox comes out first, then the record that waited goes in:
    # every item once, moved ones by their new number.
    assert emitted[:len(outbox), 1:3].tolist() == [list(k[1:]) for k in outbox]
    assert sorted(emitted[:, 3].tolist() + buf.items().tolist()) == \
        sorted([110, 111] + [r[3] for r in rest])


def test_records_are_the_rows_a_fetch_pushes() -> None:
    from kfeed import _pack

    rows = _pack.records(np.array([3, 0, 4]), np.array([10, 11, 12]), np.array([2, 0, 3]), 5)
    assert rows.tolist() == [[3, 10, 0, 5], [3, 10, 1, 6], [4, 12, 0, 7], [4, 12, 1, 8],
                             [4, 12, 2, 9]]
    assert _pack.records(*(np.zeros(0, np.int64),) * 3, 0).shape == (0, 4)
    with pytest.raises(ValueError, match="negative"):
        _pack.records(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([-1]), 0)
    with pytest.raises(ValueError, match="one pid"):
        _pack.records(np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), 0)


def test_a_buffer_that_cannot_fit_in_memory_is_one_clear_error() -> None:
    # numpy's MemoryError ("Unable to allocate 29.1 TiB") came out of Loader().
    import kfeed
    from kfeed.loader import memory_loader

    schema = Schema({"id": ("int64", ())})
    with pytest.raises(ConfigError, match=r"^Shuffle\(buffer=1,000,000,000,000\) does not fit "
                                          r"in memory here \(its index alone takes "
                                          r"29,802.3 GiB, before the records it holds\): a "
                                          r"smaller buffer$"):
        memory_loader([], schema, 8, device="cpu", shuffle=kfeed.Shuffle(10**12))
