"""kfeed.Mix: several topics in set proportions, deterministic, exactly once, resumable.

The mixer alone (``kfeed.mix.Mixer``) against its promises: proportions in
every window, an order that does not depend on how records arrive; then
loaders over a ``MemorySource`` of several topics: every record once, the
proportions, an exact resume (fixed shapes, shuffled, packed), the two
``exhausted`` rules, a weight schedule, ranks, a bounded queue, and topics of
JSON, Avro and Protobuf events mixed into the very stream their blocks give.
"""

from __future__ import annotations

import threading
import time
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kfeed import (
    ConfigError,
    KafkaIterableDataset,
    LoaderConfig,
    LoaderError,
    Loader,
    MemorySource,
    Mix,
    Pack,
    Packer,
    Schema,
    Shuffle,
)
from kfeed.loader import build, memory_loader
from kfeed.loader.tuning import fetch_ahead
from kfeed.mix import Mixer

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NONE_KNOWN = (np.zeros((0, 2), np.int64), np.zeros(0, np.uint8))
IDS = Schema({"id": ("int64", ())})


def mixed_sources(weights: dict[str, float], n: int, seed: int = 0) -> np.ndarray:
    """The source index of each of ``n`` records a Mixer lets out, every source plentiful."""
    names = list(weights)
    m = Mixer(Mix(weights, seed=seed), 8, bounded=False)
    m.assign({(t, 0): i for i, t in enumerate(names)})
    recs = np.array([(i, o, 0, 0) for i in range(len(names)) for o in range(n)], np.int64)
    m.push(recs, *NONE_KNOWN)
    return m.take()[:n, 0]


def window_deviation(src: np.ndarray, weights: list[float]) -> float:
    """The largest |count - n * share| of any source over any window of consecutive records."""
    p = np.asarray(weights) / sum(weights)
    worst = 0.0
    for s, share in enumerate(p):
        prefix = np.concatenate([[0], np.cumsum(src == s)]) - np.arange(len(src) + 1) * share
        worst = max(worst, float(prefix.max() - prefix.min()))
    return worst


# -- the mixer ---------------------------------------------------------------------------


@FAST
@given(weights=st.lists(st.floats(0.001, 100), min_size=1, max_size=5),
       seed=st.integers(0, 2**64 - 1))
def test_every_window_holds_the_proportions_within_two_records(weights, seed):
    names = {f"t{i}": w for i, w in enumerate(weights)}
    src = mixed_sources(names, 3000, seed)
    assert len(src) == 3000
    # A binomial draw of n records strays by about sqrt(n w (1-w)); this stays under 2.
    assert window_deviation(src, weights) < 2.0


@FAST
@given(sizes=st.lists(st.integers(0, 60), min_size=2, max_size=4),
       parts=st.lists(st.integers(1, 3), min_size=4, max_size=4),
       seed=st.integers(0, 2**32), data=st.data())
def test_the_order_depends_on_the_records_never_on_how_they_arrive(sizes, parts, seed, data):
    names = [f"t{i}" for i in range(len(sizes))]
    tps = [(t, p) for t, n in zip(names, parts, strict=False) for p in range(n)]
    pid = {tp: i for i, tp in enumerate(tps)}
    recs = [(pid[tp], o, 0, 1000 * pid[tp] + o) for tp in tps
            for o in range(sizes[names.index(tp[0])])]
    weights = {t: float(i + 1) for i, t in enumerate(names)}

    def run(chunks: list[list[tuple]]) -> np.ndarray:
        m = Mixer(Mix(weights, seed=seed, exhausted="renormalize"), 4, bounded=True)
        m.assign(pid)
        out = []
        for c in chunks:
            out.append(m.push(np.array(c, np.int64).reshape(-1, 4), *NONE_KNOWN))
            out.append(m.take())
        m.done(list(pid.values()))
        out.append(m.take())
        assert m.ended
        return np.concatenate(out)

    whole = run([recs])
    # The same records, fetched in another interleaving of partitions and in pieces.
    by_part = {i: [r for r in recs if r[0] == i] for i in pid.values()}
    chunks: list[list[tuple]] = []
    while any(by_part.values()):
        p = data.draw(st.sampled_from([i for i, rs in by_part.items() if rs]))
        k = data.draw(st.integers(1, len(by_part[p])))
        chunks.append(by_part[p][:k])
        by_part[p] = by_part[p][k:]
    again = run(chunks)
    np.testing.assert_array_equal(again, whole)
    assert sorted(whole[:, 3].tolist()) == sorted(r[3] for r in recs)  # each record once


def test_partitions_of_a_source_take_turns_and_a_finished_one_leaves_the_ring():
    m = Mixer(Mix({"a": 1.0}), 4, bounded=True)
    m.assign({("a", 0): 0, ("a", 1): 1, ("a", 2): 2})
    recs = np.array([(0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 0, 2), (2, 0, 0, 3), (2, 1, 0, 4),
                     (2, 2, 0, 5)], np.int64)
    m.push(recs, *NONE_KNOWN)
    first = m.take()
    assert first[:, 3].tolist() == [0, 2, 3, 1]  # partition 1 has nothing more: it waits
    assert m.stalled_on == "a"
    m.done([1])
    assert m.take()[:, 3].tolist() == [4]  # 1 left the ring; then 0, empty, not done
    m.done([0])
    assert m.take()[:, 3].tolist() == [5] and not m.ended
    m.done([2])
    assert len(m.take()) == 0 and m.ended


def test_an_idle_partition_passes_its_turn_and_a_waiting_one_holds_its_source():
    m = Mixer(Mix({"a": 1.0}), 4, bounded=False)
    m.assign({("a", 0): 0, ("a", 1): 1, ("a", 2): 2})
    recs = np.array([(0, 0, 0, 0), (0, 1, 0, 1), (2, 0, 0, 2), (2, 1, 0, 3)], np.int64)
    m.push(recs, *NONE_KNOWN)
    assert m.take()[:, 3].tolist() == [0]  # 1 has nothing and is not known idle: it waits
    assert m.stalled_on == "a"
    m.idle([1])  # at its end for now: its turns pass
    assert m.take()[:, 3].tolist() == [2, 1, 3]
    assert m.stalled_on == "a"  # 0 waits (not idle), though 1 is
    m.idle([0, 1, 2])
    assert len(m.take()) == 0 and m.stalled_on == "a"  # every one idle: the source waits
    m.push(np.array([(1, 0, 0, 4), (0, 2, 0, 5)], np.int64), *NONE_KNOWN)
    assert m.take()[:, 3].tolist() == [5, 4]  # idle ones with records take their turns
    assert not m.ended


def idle_key_values(a0: int = 4) -> dict:
    """Topic a: partition 0 holds ``a0`` records (a rare key), partition 1 many; b: one."""
    ids = {("a", 0): range(a0), ("a", 1): range(1000, 1200 - a0), ("b", 0): range(2000, 2200)}
    return {tp: IDS.encode_raw({"id": np.array(list(r), np.int64)}) for tp, r in ids.items()}


def _ids_until(loader: Loader, n: int, seconds: float = 30) -> list[int]:
    """The first ``n`` ids ``loader`` (unbounded) hands out, read in a thread; fails if they
    do not come in time. The loader is closed."""
    got: list[int] = []

    def read() -> None:
        try:
            for b in loader:
                got.extend(b["id"].tolist())
                if len(got) >= n:
                    return
        except LoaderError:  # closed while it waited: the assert below says why
            pass

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(seconds)
    loader.close()
    thread.join(10)
    assert len(got) >= n, f"the mixture waits, after {len(got)} records"
    return got


@pytest.mark.parametrize("most", [None, 3])
def test_an_unbounded_mixture_is_not_held_up_by_a_partition_at_its_end(most):
    # Partition a/0 (a rare key) ends after 4 records: waiting on its turn
    # would hold topic a, and the mixture, up after a dozen records.
    source = MemorySource(idle_key_values(), eof=True, most=most)
    loader = Loader(None, Mix({"a": 0.5, "b": 0.5}, seed=3), IDS, 8, source=source,
                    device="cpu", format="raw", max_wait_ms=20)
    got = _ids_until(loader, 400)
    assert sorted(got) == sorted(set(got)) == [*range(4), *range(1000, 1196),
                                               *range(2000, 2200)]
    # Over records already written the order is still the records' alone: the
    # same stream however the fetches came (most=3: three messages a fetch).
    plain = Loader(None, Mix({"a": 0.5, "b": 0.5}, seed=3), IDS, 8, device="cpu", format="raw",
                   source=MemorySource(idle_key_values(), eof=True), max_wait_ms=20)
    assert got == _ids_until(plain, 400)
    src = np.array([i >= 2000 for i in got])  # b's records, about every other one
    assert abs(int(src[:200].sum()) - 100) <= 2


def test_a_state_saved_while_a_topic_waits_at_its_end_is_the_same_whatever_the_fetches():
    # Topic a runs out after 8 records; which of its partitions' end events
    # came first depends on the fetches, and must not change the state.
    def values(more: bool) -> dict:
        ids = {("a", 0): [*range(4), *(range(100, 110) if more else [])],
               ("a", 1): [*range(10, 14), *(range(200, 210) if more else [])],
               ("b", 0): range(2000, 2400)}
        return {tp: IDS.encode_raw({"id": np.array(list(r), np.int64)}) for tp, r in ids.items()}

    mix = Mix({"a": 0.5, "b": 0.5})
    states, streams = [], []
    for most in (None, 1, 3):
        loader = Loader(None, mix, IDS, 4, source=MemorySource(values(False), eof=True, most=most),
                        device="cpu", format="raw", max_wait_ms=20)
        batches = iter(loader)
        first = [i for _ in range(4) for i in next(batches)["id"].tolist()]
        assert sorted(i for i in first if i < 2000) == [*range(4), *range(10, 14)]
        mixer, deadline = loader._ledger.mixer, time.monotonic() + 30
        while True:  # until the mixer took with both of a's partitions known idle
            with loader._ledger.lock:
                pids = {tp: pid for pid, tp in mixer.partitions().items()}
                if all(mixer._idle[pids[("a", p)]] for p in (0, 1)):
                    break
            assert time.monotonic() < deadline, "no end event came"
            time.sleep(0.01)
        states.append(loader.state_dict())
        loader.close()
        resumed = Loader(None, mix, IDS, 4, source=MemorySource(values(True), eof=True),
                         device="cpu", format="raw", max_wait_ms=20)
        resumed.load_state_dict(states[-1])
        streams.append(first + _ids_until(resumed, 40))
    assert states[0]["mix"] == states[1]["mix"] == states[2]["mix"]
    assert streams[0] == streams[1] == streams[2]


def test_an_empty_partition_kept_through_an_incremental_revoke_still_passes_its_turn():
    # a/0 gives only its end event; a/2 is revoked: a/0, not sought back (it
    # delivered nothing), is still at its end and gives no end event again.
    ids = {("a", 0): [], ("a", 1): range(1000, 1400), ("a", 2): range(5000, 5400),
           ("b", 0): range(2000, 2800)}
    source = MemorySource({tp: IDS.encode_raw({"id": np.array(list(r), np.int64)})
                           for tp, r in ids.items()}, topic="a", eof=True, most=8,
                          incremental=True)
    source.rebalance(6, revoke=[2])
    loader = Loader(None, Mix({"a": 0.5, "b": 0.5}, seed=3), IDS, 8, source=source,
                    device="cpu", format="raw", max_wait_ms=20)
    got = _ids_until(loader, 400)
    assert len(got) == len(set(got))


def test_a_partition_written_again_takes_its_turns_again():
    source = MemorySource(idle_key_values(), eof=True)
    loader = Loader(None, Mix({"a": 0.5, "b": 0.5}), IDS, 8, source=source, device="cpu",
                    format="raw", max_wait_ms=20)
    got: list[int] = []
    with loader:
        for b in loader:
            got.extend(b["id"].tolist())
            if len(got) == 40:  # a/0 was read to its end long ago
                source.append(("a", 0), IDS.encode_raw({"id": np.arange(100, 110)}))
            if len(got) >= 160:
                break
    assert len(got) == len(set(got))
    a = [i for i in got if i < 2000]
    k = a.index(100)
    assert a[k:k + 20:2] == list(range(100, 110))  # every other turn of topic a again


@pytest.mark.parametrize("kwargs, match", [
    ({"weights": {}}, "non-empty dict"),
    ({"weights": {"a": -1.0}}, "finite number >= 0"),
    ({"weights": {"a": float("nan")}}, "finite number >= 0"),
    ({"weights": {"a": 0.0, "b": 0.0}}, "at least one weight"),
    ({"weights": {"a": True}}, "finite number >= 0"),
    ({"weights": {"a": 10**400, "b": 1}}, "finite number >= 0"),
    ({"weights": {"a": 1e308, "b": 1e308}}, "add up past the largest float"),
    ({"weights": ["a", "b"]}, "dict {topic: weight} or a callable"),
    ({"weights": {"a": 1.0}, "exhausted": "forever"}, "'stop', 'renormalize' or 'repeat'"),
    ({"weights": {"a": 1.0}, "seed": -1}, "seed must be an int"),
    ({"weights": {"a": 1.0}, "seed": True}, "seed must be an int"),
    ({"weights": {"a": 1.0}, "seed": np.bool_(True)}, "seed must be an int"),
    ({"weights": {"a": 1.0}, "seed": 1.0}, "seed must be an int"),
    ({"weights": lambda step: 1 / 0}, "schedule failed at step 0"),
])
def test_bad_mixtures_say_what_is_wrong(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Mix(**kwargs)


def test_numpy_weights_are_numbers_and_a_tiny_weight_still_takes_turns():
    mix = Mix({"a": np.float32(0.75), "b": np.int64(1)})
    assert mix.weights == {"a": 0.75, "b": 1.0}
    # A Decimal was refused as not "a finite number >= 0".
    assert Mix({"a": Decimal("0.5"), "b": Fraction(1, 2)}).weights == {"a": 0.5, "b": 0.5}
    seeded = Mix({"a": 1.0}, seed=np.uint64(2**63))  # a numpy integer seed, as an int
    assert seeded.seed == 2**63 and type(seeded.seed) is int
    assert Mix(lambda step: {"a": np.float64(1), "b": 0}).weights_at(0, ("a", "b")) == \
        {"a": 1.0, "b": 0.0}
    mixer = Mixer(Mix({"a": 1.0, "b": 1e-12}), 8, bounded=True)
    mixer._weights_for(0)
    assert mixer.weights.tolist() == [1 << 32, 1]  # b not rounded to nothing


def test_a_schedule_must_keep_its_topics():
    mix = Mix(lambda step: {"a": 1.0, "b": 1.0} if step < 2 else {"a": 1.0})
    assert mix.topics == ("a", "b")
    with pytest.raises(ConfigError, match="step 2 names"):
        mix.weights_at(2, mix.topics)


# -- loaders over several topics ---------------------------------------------------------

ROWS = Schema({"id": ("int64", ()), "x": ("float32", (2,))})
SOURCES = {"web": (0, 2, 600), "code": (1, 3, 300), "math": (2, 1, 200)}  # index, parts, per part
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def row_values(fmt: str = "block", sources: dict = SOURCES) -> dict:
    values = {}
    for t, (k, nparts, n) in sources.items():
        for p in range(nparts):
            cols = {"id": np.arange(n) + k * 10**6 + p * 10**4, "x": np.zeros((n, 2), np.float32)}
            values[(t, p)] = (ROWS.encode_blocks(cols, 16) if fmt == "block"
                              else ROWS.encode_raw(cols))
    return values


def read(values: dict, mix: Mix, schema: Schema = ROWS, batch_size: int = 32, *,
         stop: int | None = None, state: dict | None = None, key: str = "id", **kwargs):
    """Batches' ``key`` column (or the packed tokens), and the state at ``stop`` or the stats."""
    loader = Loader(None, mix, schema, batch_size, source=MemorySource(values), device="cpu",
                    **{"until": "end", **kwargs})
    if state is not None:
        loader.load_state_dict(state)
    got = []
    with loader:
        for i, batch in enumerate(loader):
            got.append(batch[key].numpy().copy())
            if stop is not None and i + 1 == stop:
                return got, loader.state_dict()
        return got, loader.stats()


@pytest.mark.parametrize("exhausted", ["renormalize", "stop"])
@pytest.mark.parametrize("shuffle", [None, Shuffle(100, seed=1)])
def test_a_topic_of_another_schema_in_a_mixture_fails_the_read_as_alone(exhausted, shuffle):
    # The good records of the other topics proved the schema for all: the
    # mixture read on without the topic (renormalize), or read nothing (stop),
    # with a warning per message, where the topic alone fails the read.
    from kfeed import DecodeError

    other = Schema({"tokens": ("int32", (None,))})
    values = {**row_values(sources={"web": (0, 1, 300)}),
              ("code", 0): other.encode_blocks({"tokens": [np.arange(3, dtype=np.int32)] * 64}, 8)}
    with pytest.raises(DecodeError, match=r"^all 8 messages of code \(in the mixture\) read so "
                                          r"far were rejected: schema mismatch.* None of them "
                                          r"was dead-lettered or committed"):
        read(values, Mix({"web": 0.5, "code": 0.5}, exhausted=exhausted),
             on_bad_record="skip", shuffle=shuffle)
    # A stray bad message of one topic is dead-lettered once that topic decodes.
    values[("code", 0)] = ROWS.encode_blocks({"id": np.arange(10**6, 10**6 + 64),
                                              "x": np.zeros((64, 2), np.float32)}, 8)
    values[("code", 0)].insert(0, b"garbage")
    got, stats = read(values, Mix({"web": 0.5, "code": 0.5}, exhausted="renormalize"),
                      on_bad_record="skip", shuffle=shuffle)
    assert len(np.concatenate(got)) == 364 and stats["bad_records"] == 1


def test_every_record_once_in_the_proportions_until_the_first_source_runs_out():
    got, stats = read(row_values(), Mix(WEIGHTS, seed=3))
    ids = np.concatenate(got)
    assert len(np.unique(ids)) == len(ids)
    # "stop": math (200 records at 0.1) runs out after about 2000 records.
    assert stats["mix"] == {"web": 1200, "code": 600, "math": 200}
    assert window_deviation(ids // 10**6, list(WEIGHTS.values())) < 2.0
    # Within a source, each partition's records in offset order.
    for p in range(3):
        mine = ids[(ids // 10**4) == 10**2 + p]
        assert np.all(np.diff(mine) == 1)


def test_renormalize_reads_everything_and_keeps_the_others_proportions():
    got, stats = read(row_values(), Mix(WEIGHTS, seed=3, exhausted="renormalize"))
    ids = np.concatenate(got)
    want = sum(nparts * n for _k, nparts, n in SOURCES.values())
    assert len(ids) == len(np.unique(ids)) == want
    assert stats["mix"] == {"web": 1200, "code": 900, "math": 200}
    # After math ran out, web and code went on 2 : 1.
    src = ids // 10**6
    after = src[np.nonzero(src == 2)[0][-1] + 1:]
    after = after[: np.nonzero(after == 0)[0][-1] + 1]  # while both still had records
    assert window_deviation(after, [0.6, 0.3, 0.0]) < 2.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_renormalize_resumes_exactly_after_a_source_ran_out_with_records_still_held(seed):
    # The state says c ran out; a resume reads c's partition again from below
    # its end (records the shuffle still held), and took that as c being back:
    # its weight shifted the others' turns until the partition was done again.
    sources = {"a": (0, 1, 1500), "b": (1, 1, 1500), "d": (3, 1, 1500), "c": (2, 1, 60)}
    values = row_values(sources=sources)
    mix = Mix({"a": 0.3, "b": 0.25, "d": 0.2, "c": 0.25}, seed=seed, exhausted="renormalize")
    kw = {"batch_size": 8, "shuffle": Shuffle(300, seed=1)}
    whole = np.concatenate(read(values, mix, **kw)[0])
    for stop in (40, 60):
        first, state = read(values, mix, stop=stop, **kw)
        assert state["mix"]["live"] == [True, True, True, False]  # c ran out already
        rest, _ = read(values, mix, state=state, **kw)
        np.testing.assert_array_equal(np.concatenate(first + rest), whole)


def test_the_same_seed_gives_the_same_stream_and_another_seed_another():
    a = np.concatenate(read(row_values(), Mix(WEIGHTS, seed=5))[0])
    b = np.concatenate(read(row_values("raw"), Mix(WEIGHTS, seed=5), format="raw")[0])
    c = np.concatenate(read(row_values(), Mix(WEIGHTS, seed=6))[0])
    np.testing.assert_array_equal(a, b)  # blocks or raw records: the same stream
    assert not np.array_equal(a, c)


def event_values(fmt: str) -> tuple[dict, object]:
    """``row_values``' records as one event a message, written by the format's own tools."""
    import io
    import json

    import fastavro
    from records import message_class

    import kfeed

    writer = {"type": "record", "name": "Row", "fields": [
        {"name": "id", "type": "long"}, {"name": "x", "type": {"type": "array", "items": "float"}}]}
    row = message_class("mixrow", "Row", [("id", "int64", False), ("x", "float", True)])

    def avro(event: dict) -> bytes:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, fastavro.parse_schema(writer), event)
        return buf.getvalue()

    write, record_format = {
        "json": (lambda e: json.dumps(e).encode(), kfeed.Json()),
        "avro": (avro, kfeed.Avro(schema=writer)),
        "protobuf": (lambda e: row(**e).SerializeToString(), kfeed.Protobuf(message=row)),
    }[fmt]
    values = {}
    for t, (k, nparts, n) in SOURCES.items():
        for p in range(nparts):
            values[(t, p)] = [write({"id": int(i), "x": [0.0, 0.0]})
                              for i in np.arange(n) + k * 10**6 + p * 10**4]
    return values, record_format


@pytest.mark.parametrize("shuffle", [None, Shuffle(100, seed=2)])
@pytest.mark.parametrize("fmt", ["json", "avro", "protobuf"])
def test_a_mixture_of_topics_others_write_is_the_stream_of_blocks_and_resumes_into_it(
        fmt, shuffle):
    pytest.importorskip("fastavro")
    values, record_format = event_values(fmt)
    mix = Mix(WEIGHTS, seed=5, exhausted="renormalize")
    blocks = np.concatenate(read(row_values(), mix, shuffle=shuffle)[0])
    events = np.concatenate(read(values, mix, format=record_format, shuffle=shuffle)[0])
    np.testing.assert_array_equal(events, blocks)  # the order is the records', not the format's
    first, state = read(values, mix, stop=9, format=record_format, shuffle=shuffle)
    rest, _ = read(values, mix, state=state, format=record_format, shuffle=shuffle)
    np.testing.assert_array_equal(np.concatenate(first + rest), blocks)


@pytest.mark.parametrize("stop", [1, 7, 40])
@pytest.mark.parametrize("shuffle", [None, Shuffle(100, seed=2)])
def test_a_resume_gives_the_stream_of_an_uninterrupted_run(stop, shuffle):
    mix = Mix(WEIGHTS, seed=1, exhausted="renormalize")
    whole = np.concatenate(read(row_values(), mix, shuffle=shuffle)[0])
    first, state = read(row_values(), mix, shuffle=shuffle, stop=stop)
    rest, _ = read(row_values(), mix, shuffle=shuffle, state=state)
    np.testing.assert_array_equal(np.concatenate(first + rest), whole)
    assert state["mix"]["mixed"] >= stop * 32


@pytest.mark.parametrize("exhausted", ["stop", "renormalize", "repeat"])
def test_a_state_saved_at_the_end_of_a_read_starts_the_next_read_on_new_records(exhausted):
    # The state said the mixture was over, and the next bounded read, loaded
    # from it, took that as its own end: it read nothing of the records
    # written since, where plain topics read them. With "repeat", it went on
    # in the last reading of the sources read again (records of the first
    # read), and ended when the first source ran out, as if it were "stop".
    mix = Mix(WEIGHTS, seed=1, exhausted=exhausted)
    source = MemorySource(row_values())
    with Loader(None, mix, ROWS, 32, source=source, device="cpu", until="end") as loader:
        first = np.concatenate([b["id"].numpy().copy() for b in loader])
        state = loader.state_dict()
    more, new = row_values(), []  # 100 records more in each partition, after the others
    for t, (k, nparts, n) in SOURCES.items():
        for p in range(nparts):
            ids = np.arange(n, n + 100) + k * 10**6 + p * 10**4
            more[(t, p)] = more[(t, p)] + ROWS.encode_blocks(
                {"id": ids, "x": np.zeros((100, 2), np.float32)}, 16)
            new.append(ids)
    new = np.sort(np.concatenate(new))
    second = np.concatenate(read(more, mix, state=state)[0])
    if exhausted == "stop":
        assert len(second) and not np.intersect1d(first, second).size
    else:  # every new record, and none of the first read's
        assert np.array_equal(np.unique(second), new)
    if exhausted == "renormalize":  # once
        assert len(second) == len(new)
    if exhausted == "repeat":
        # What a read that goes on from the group's commits reads (its round
        # robin starts afresh, so how often each is read again may differ).
        grouped = MemorySource(more)
        grouped.committed_positions.update(source.committed_positions)
        with Loader(None, mix, ROWS, 32, source=grouped, device="cpu", until="end") as loader:
            from_group = np.concatenate([b["id"].numpy().copy() for b in loader])
        assert np.array_equal(np.unique(from_group), new)
        assert len(second) > len(new)  # some read again


@pytest.mark.parametrize("shuffle", [None, Shuffle(100, seed=2)])
def test_a_state_saved_after_the_mixture_ended_hands_out_the_rest_and_ends(shuffle):
    # The mixer has ended, but batches it mixed are still to come: a resume
    # hands them out as the uninterrupted run does, and reads nothing more.
    mix = Mix(WEIGHTS, seed=1, exhausted="renormalize")
    whole = read(row_values(), mix, shuffle=shuffle)[0]
    first, state = read(row_values(), mix, shuffle=shuffle, stop=len(whole) - 1)
    assert state["mix"]["ended"]
    rest, _ = read(row_values(), mix, shuffle=shuffle, state=state)
    np.testing.assert_array_equal(np.concatenate(first + rest), np.concatenate(whole))


TOKENS = Schema({"tokens": ("int32", (None,))})


def token_values(seed: int = 0) -> tuple[dict, dict]:
    """Token documents per topic; each document's first token names it (>= 3)."""
    rng = np.random.default_rng(seed)
    values, docs = {}, {}
    for t, (k, nparts, n) in SOURCES.items():
        for p in range(nparts):
            mine = []
            for d in range(n // 4):
                doc = rng.integers(3, 30000, int(rng.integers(1, 90))).astype(np.int32)
                doc[0] = 100000 * (k + 1) + 1000 * p + d
                mine.append(doc)
                docs[int(doc[0])] = doc
            values[(t, p)] = TOKENS.encode_blocks({"tokens": mine}, 7)
    return values, docs


def documents(batches: list[np.ndarray], eos: int = 2) -> list[np.ndarray]:
    flat = np.concatenate([b.reshape(-1) for b in batches])
    cut = np.nonzero(flat == eos)[0]
    return [d for d in np.split(flat, cut + 1) if len(d) and d[0] != 0]


@pytest.mark.parametrize("shuffle", [None, Shuffle(30, seed=9)])
def test_packed_mixtures_resume_token_exact_with_every_document_once(shuffle):
    values, docs = token_values()
    mix = Mix(WEIGHTS, seed=4, exhausted="renormalize")
    kw = {"pack": Pack(64, eos_id=2, pad_id=0), "shuffle": shuffle, "key": "tokens"}
    whole, _ = read(values, mix, TOKENS, 4, **kw)
    first, state = read(values, mix, TOKENS, 4, stop=9, **kw)
    assert state["pack_offset"] >= 0 and "mix" in state
    rest, _ = read(values, mix, TOKENS, 4, state=state, **kw)
    np.testing.assert_array_equal(np.concatenate(first + rest), np.concatenate(whole))
    got = documents(whole)
    assert sorted(int(d[0]) for d in got) == sorted(docs)
    for d in got:
        np.testing.assert_array_equal(d[:-1], docs[int(d[0])])


def test_variable_length_fields_come_jagged_from_a_mixture():
    values, docs = token_values(1)
    got, stats = read(values, Mix(WEIGHTS, exhausted="renormalize"), TOKENS, 8, key="tokens")
    flat = np.concatenate(got)
    assert sorted(int(t) for t in flat if t >= 100000) == sorted(docs)
    assert sum(stats["mix"].values()) == len(docs)


def test_a_weight_schedule_changes_the_proportions_at_its_steps():
    def schedule(step: int) -> dict[str, float]:
        return {"web": 1.0, "code": 0.0, "math": 0.0} if step < 10 else \
            {"web": 0.0, "code": 1.0, "math": 0.0}

    got, _ = read(row_values(), Mix(schedule), batch_size=32, stop=15)
    src = np.concatenate(got) // 10**6
    assert np.all(src[:320] == 0) and np.all(src[320:] == 1)


def test_a_state_resumes_only_with_a_schedule_that_weighted_the_steps_mixed_alike():
    # Any schedule was taken with a state: one edited since gave another
    # stream than the run it resumed, and nothing said so.
    def schedule(switch: int):
        return lambda step: ({"web": 1.0, "code": 0.0, "math": 0.0} if step < switch else
                             {"web": 0.0, "code": 1.0, "math": 0.0})

    whole, _ = read(row_values(), Mix(schedule(10)), batch_size=32, stop=15)
    first, state = read(row_values(), Mix(schedule(10)), batch_size=32, stop=7)
    assert state["mix"]["schedule"][0] == [0, [1 << 32, 0, 0]]
    # The same schedule: the same stream.
    rest, _ = read(row_values(), Mix(schedule(10)), batch_size=32, state=state, stop=8)
    np.testing.assert_array_equal(np.concatenate(first + rest), np.concatenate(whole))
    # One that differs only at steps not mixed yet resumes (the rest follows it).
    now = state["mix"]["schedule"][-1][0]  # (the mixer may be ahead of the batches out)
    assert now >= 7

    def edited(step: int) -> dict[str, float]:
        return schedule(10)(step) if step <= now else {"web": 0.0, "code": 0.0, "math": 1.0}

    read(row_values(), Mix(edited), batch_size=32, state=state, stop=1)
    # One that weighted a step already mixed otherwise does not.
    with pytest.raises(ConfigError, match=r"the state was saved by a mixture whose schedule "
                                          r"weighted \{web: 1, code: 0, math: 0\} at step 4, "
                                          r"and this loader's schedule weights \{web: 0, "
                                          r"code: 1, math: 0\} there: resume with the schedule"):
        read(row_values(), Mix(schedule(3)), batch_size=32, state=state)


def test_a_source_a_schedule_weights_0_at_first_is_waited_for_not_taken_as_read(caplog):
    # A warm-up on a (12 records, which run out during it), then a and b 1:1.
    # "repeat" reads a again until b's turn comes (it ended at once, b unread);
    # "renormalize" has nothing to draw while b weighs 0, and says so.
    sources = {"a": (0, 1, 12), "b": (1, 1, 40)}

    def warmup(step: int) -> dict[str, float]:
        return {"a": 1.0, "b": 0.0} if step < 3 else {"a": 1.0, "b": 1.0}

    with caplog.at_level("WARNING", logger="kfeed"):
        got, stats = read(row_values(sources=sources), Mix(warmup, exhausted="repeat"),
                          batch_size=8)
    # (A schedule that kept b at 0 would read a again for ever: said once.)
    assert caplog.text.count("exhausted='repeat': b has not run out, and the schedule weights "
                             "it 0 at step 1: the other sources are read again until it "
                             "weights b above 0") == 1, caplog.text
    caplog.clear()
    ids = np.concatenate(got)
    b = ids[ids >= 10**6]
    assert sorted(b.tolist()) == list(range(10**6, 10**6 + 40))
    assert np.all(ids[:24] < 10**6)  # the warm-up's three steps, a alone
    with caplog.at_level("WARNING", logger="kfeed"):
        got, _ = read(row_values(sources=sources), Mix(warmup, exhausted="renormalize"),
                      batch_size=8)
    assert len(np.concatenate(got)) == 12
    assert ("the mixture ends at step 1 with records of b left unread: the schedule weights "
            "it 0 now, and no other source has records left") in caplog.text


def test_a_topic_weighted_0_throughout_is_not_said_to_be_left_unread(caplog):
    # "...left unread: the schedule weights it 0 now" came at every epoch's end,
    # of a mixture with no schedule.
    with caplog.at_level("WARNING", logger="kfeed"):
        got, _ = read(row_values(sources={"a": (0, 1, 12), "b": (1, 1, 40)}),
                      Mix({"a": 1.0, "b": 0.0}, exhausted="renormalize"), batch_size=8)
    assert len(np.concatenate(got)) == 12 and "left unread" not in caplog.text


def test_a_stop_mixture_with_a_topic_empty_in_the_window_says_why_it_reads_nothing(caplog):
    # Every epoch was empty, without a word.
    values = {**row_values(sources={"a": (0, 1, 40)}), ("b", 0): []}
    with caplog.at_level("WARNING", logger="kfeed"):
        got, _ = read(values, Mix({"a": 1.0, "b": 1.0}), batch_size=8)
    assert got == []
    assert ("exhausted='stop': b has no records left in the window, so the mixture ends at its "
            "first turn, after 0 records; exhausted='renormalize' reads the others without it"
            ) in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kfeed"):
        read(row_values(), Mix(WEIGHTS, seed=3))  # one that ran out after its records: no word
    assert "no records left in the window" not in caplog.text


def test_a_state_of_a_mixture_loaded_without_one_says_so():
    # It named the placeholder mixture of an epoch's order: "this loader mixes
    # {'topics': ['*'], ...}".
    shuffle = Shuffle(16, seed=0)
    _, state = read(row_values(), Mix(WEIGHTS, seed=1), stop=2, epochs=2, shuffle=shuffle)
    loader = Loader(None, list(WEIGHTS), ROWS, 8, source=MemorySource(row_values()),
                    device="cpu", until="end", epochs=2, shuffle=shuffle)
    with pytest.raises(ConfigError, match=r"this loader has no kfeed\.Mix$"):
        loader.load_state_dict(state)
    loader.close()


def test_a_state_must_come_from_the_same_mixture():
    _, state = read(row_values(), Mix(WEIGHTS, seed=1), stop=2)
    with pytest.raises(ConfigError, match=r"^the state was saved by another mixture: its seed 1, "
                                          r"this loader's 2; resume with the mixture it was saved with$"):
        read(row_values(), Mix(WEIGHTS, seed=2), state=state)
    # The same weights, written in another order: the message printed both mixtures
    # whole, whose weights it sorts, so nothing it showed differed but a list of topics.
    with pytest.raises(ConfigError, match=r"^the state was saved by another mixture: its topics in "
                                          r"the order \['web', 'code', 'math'\], this loader's "
                                          r"\['math', 'code', 'web'\] \(the order of the weights' keys "
                                          r"is part of the mixture: the seed deals turns by it\); "):
        read(row_values(), Mix(dict(reversed(WEIGHTS.items())), seed=1), state=state)
    with pytest.raises(ConfigError, match="without a kfeed.Mix|of a kfeed.Mix"):
        read(row_values(), list(WEIGHTS), shuffle=Shuffle(10), state=state)
    # The same topics in offset order: the message blamed shuffle or pack, which
    # neither loader has.
    with pytest.raises(ConfigError, match="saved by a loader with a kfeed.Mix; this one reads "
                                          "in offset order"):
        read(row_values(), list(WEIGHTS), state=state)
    _, plain = read(row_values(), list(WEIGHTS), stop=2)
    with pytest.raises(ConfigError, match="saved by a loader reading in offset order .*; this "
                                          "one has a kfeed.Mix"):
        read(row_values(), Mix(WEIGHTS, seed=1), state=plain)
    with pytest.raises(ConfigError, match=r"saved by another mixture: its weights \{'code': 0.3, "
                                          r"'math': 0.1, 'web': 0.6\}, this loader's \{'code': 0.3, "
                                          r"'math': 0.2, 'web': 0.5\}; resume"):
        read(row_values(), Mix({"web": 0.5, "code": 0.3, "math": 0.2}, seed=1), state=state)


def test_an_epochs_state_of_another_mixture_names_the_seeds_given_and_changes_nothing():
    # With epochs=, each epoch's seeds derive from those given: the message
    # named two derived 64-bit seeds the user never wrote, and the refused
    # state had already moved the loader to its epoch (a caller that went on
    # skipped epoch 0).
    shuffle = Shuffle(16, seed=0)
    with Loader(None, Mix(WEIGHTS, seed=1), ROWS, 32, source=MemorySource(row_values()),
                device="cpu", until="end", epochs=3, shuffle=shuffle) as loader:
        for _ in loader:  # epoch 0
            pass
        next(iter(loader))
        state = loader.state_dict()
    assert state["epochs"]["epoch"] == 1
    whole = np.concatenate(read(row_values(), Mix(WEIGHTS, seed=2), epochs=3,
                                shuffle=shuffle)[0])
    for mix, shuffled, match in [
            (Mix(WEIGHTS, seed=2), shuffle,
             r"^the state was saved by another mixture: its seed is not this loader's "
             r"Mix\(seed=2\), from which epoch 1's order is dealt; resume with the mixture"),
            (Mix(WEIGHTS, seed=1), Shuffle(16, seed=5),
             r"^the state was saved with another shuffle than this loader's Shuffle\(buffer=16, "
             r"seed=5\), from which epoch 1's is dealt; resume with the shuffle"),
            (Mix(WEIGHTS, seed=1), Shuffle(8, seed=0), r"\(its buffer 16\); resume"),
            (Mix(WEIGHTS, seed=1), None, r"^the state was saved with a shuffle \(buffer 16\), "
                                         r"this loader has none$"),
            # A damaged state found so after the epoch was taken from it.
            (Mix(WEIGHTS, seed=1), shuffle,
             r"^not a loader state: its partial documents, window")]:
        if match.startswith("^not"):
            state = {**state, "window": [["web"]]}
        loader = Loader(None, mix, ROWS, 32, source=MemorySource(row_values()), device="cpu",
                        until="end", epochs=3, shuffle=shuffled)
        with pytest.raises(ConfigError, match=match):
            loader.load_state_dict(state)
        assert loader.epoch == 0
        if mix.seed == 2:  # the loader reads as if no state was given
            with loader:
                got = np.concatenate([b["id"].numpy().copy() for b in loader])
            np.testing.assert_array_equal(got, whole[:len(got)])
        loader.close()


def test_a_mix_hashes_as_a_frozen_value_does():
    # hash(Mix(...)) raised TypeError (its weights are a dict), and so did the
    # hash of a LoaderConfig holding one.
    a, b = Mix(dict(WEIGHTS), seed=1), Mix(dict(WEIGHTS), seed=1)
    assert a == b and hash(a) == hash(b) and len({a, b, Mix(WEIGHTS, seed=2)}) == 2
    assert hash(Mix(lambda step: WEIGHTS)) is not None
    config = LoaderConfig(a, ROWS, 8)
    assert hash(config) == hash(LoaderConfig(b, ROWS, 8))


def test_the_same_weights_at_another_scale_resume_the_same_stream():
    # {6, 3, 1} mixes as {0.6, 0.3, 0.1} does (weights are normalized), but a
    # state saved by one was refused by the other.
    whole, _ = read(row_values(), Mix(WEIGHTS, seed=1))
    _, state = read(row_values(), Mix(WEIGHTS, seed=1), stop=2)
    rest, _ = read(row_values(), Mix({"web": 6, "code": 3, "math": 1}, seed=1), state=state)
    assert np.array_equal(np.concatenate(whole[2:]), np.concatenate(rest))


def test_static_ranks_each_mix_their_share_of_every_topic():
    sources = {**SOURCES, "math": (2, 2, 100)}
    seen = []
    for rank in range(2):
        got, stats = read(row_values(sources=sources), Mix(WEIGHTS, exhausted="renormalize"),
                          rank=rank, world_size=2, assignment="static")
        seen.append(np.concatenate(got))
        assert all(n > 0 for n in stats["mix"].values())
    ids = np.concatenate(seen)
    assert len(ids) == len(np.unique(ids)) == sum(n * k for _i, k, n in sources.values())
    for rank in range(2):  # every rank refuses, not only the one left without math
        with pytest.raises(ConfigError, match="\\['math'\\] has fewer partitions than the 2 "
                                              "ranks"):
            read(row_values(), Mix(WEIGHTS), rank=rank, world_size=2, assignment="static")


def test_a_source_that_runs_ahead_is_paused_so_the_queue_stays_bounded(monkeypatch):
    # Streaming, a record per message: code, one record in a hundred of the
    # mixture, comes as fast as web; what a fetch brings of it piles up.
    # The mixer's bytes, shared by the two partitions: 1,024 records each.
    monkeypatch.setattr(build, "_MIX_QUEUE_BYTES", 2 * 1024 * ROWS.record_size)
    cols = {"id": np.arange(2000), "x": np.zeros((2000, 2), np.float32)}
    values = {("web", 0): ROWS.encode_raw(cols), ("code", 0): ROWS.encode_raw(cols)}
    source = MemorySource(values, loop=True)
    loader = Loader(None, Mix({"web": 0.99, "code": 0.01}), ROWS, 256, source=source,
                    device="cpu", format="raw")
    with loader:
        for i, _batch in enumerate(loader):
            assert loader._builder.mix_queue == 1024
            queued = loader._ledger.mixer.queued()  # type: ignore[attr-defined]
            # At most the cap, and what one fetch brought on top: a batch,
            # and what it took ahead (NOTE [ Fetching ahead ]).
            ahead = fetch_ahead(False)
            assert queued.max() <= loader._builder.mix_queue + (1 + ahead) * 256
            if i == 60:  # (it drains at 2.5 records a batch: resumed only after ~200)
                break
        assert ("code", 0) in source._paused
        assert loader._builder.paused == {("code", 0)}
    stats = loader.stats()
    assert stats["mix"]["code"] / sum(stats["mix"].values()) == pytest.approx(0.01, abs=0.002)


def test_a_topic_of_large_documents_queues_its_share_in_bytes(caplog):
    # The queues' share was counted in records of the average size so far,
    # which the small documents of the heavy topic set: the topic of 200 KB
    # documents queued 51 MiB in 1,000 batches (325 MiB in 8,000), under a
    # max_memory_bytes that gives the queues 16 MiB.
    tokens = Schema({"tokens": ("int32", (None,))})
    rng = np.random.default_rng(0)
    small = [rng.integers(3, 1000, 10, dtype=np.int32) for _ in range(4000)]  # 40 B
    large = [rng.integers(3, 1000, 50_000, dtype=np.int32) for _ in range(40)]  # 200 KB
    source = MemorySource({("web", 0): tokens.encode_blocks({"tokens": small}, 64),
                           ("code", 0): tokens.encode_blocks({"tokens": large}, 1)}, loop=True)
    cap = 32 << 20
    with Loader(None, Mix({"web": 0.99, "code": 0.01}, seed=0), tokens, 16, device="cpu",
                source=source, max_memory_bytes=cap, pack=Pack(seq_len=1024, eos_id=2)) as ld:
        held, paused = [], 0
        for i, _batch in enumerate(ld):
            held.append(ld.stats()["held_bytes"])
            paused += ("code", 0) in ld._builder.paused  # it piles up, and waits
            if i == 1000:
                break
        assert paused and ld.stats()["mix"]["code"] > 0
    assert max(held) <= ld._builder.mix_bytes <= cap // 2, max(held)
    # A shuffle under a cap, with no mixture, says nothing of a mixture's queues.
    caplog.clear()
    rows = Schema({"id": ("int64", ())})
    with memory_loader(rows.encode_blocks({"id": np.arange(4096)}, 64), rows, 256, loop=True,
                       device="cpu", max_memory_bytes=cap, shuffle=Shuffle(buffer=1000)) as ld:
        next(ld)
    assert not [r for r in caplog.records if "mixture" in r.getMessage()]


class ThreadNoting(MemorySource):
    """A ``MemorySource`` noting the thread of each ``resume()`` (a consumer lets one
    thread in at a time: NOTE [ One thread calls the consumer ])."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.resumed_on: list[str] = []

    def resume(self, tps) -> None:
        self.resumed_on.append(threading.current_thread().name)
        super().resume(tps)


def test_a_revoke_the_caller_gives_up_resumes_the_mixtures_pauses_on_the_loaders_thread(
        monkeypatch):
    # A revoke waits for the caller's step (NOTE [ A revoke waits for the
    # step ]); the caller gives the partitions up, which rebuilds the order
    # and lifts the mixture's pauses. Lifted from the caller's thread, the
    # consumer's resume() waited for the loader's thread, inside consume()
    # waiting for the caller: the read, and the group's rebalance, stopped.
    monkeypatch.setattr(build, "_MIX_QUEUE_BYTES", 2 * 1024 * ROWS.record_size)
    cols = {"id": np.arange(2000), "x": np.zeros((2000, 2), np.float32)}
    values = {("web", 0): ROWS.encode_raw(cols), ("web", 1): ROWS.encode_raw(cols),
              ("code", 0): ROWS.encode_raw(cols)}
    # (Incremental: the memory source scripts rebalances of one topic's partitions.)
    source = ThreadNoting(values, topic="web", loop=True, incremental=True)
    source.rebalance(40, revoke=[1])
    loader = Loader(None, Mix({"web": 0.99, "code": 0.01}), ROWS, 256, source=source,
                    device="cpu", format="raw")
    with loader:
        for i, _batch in enumerate(loader):
            if i == 20:
                assert ("code", 0) in source._paused  # the mixture paused it
            if source.calls > 60:
                break
    assert loader._fetcher.rebalances == 1
    assert source.resumed_on and set(source.resumed_on) == {"kfeed-loader"}


# -- windows -----------------------------------------------------------------------------


def test_a_window_of_offsets_reads_exactly_its_records():
    start = {("web", 0): 100, ("code", 2): 250}
    until = {("web", 0): 130, ("web", 1): 5, ("math", 0): 0}
    got, _stats = read(row_values("raw"), ["web", "code", "math"], start=start, until=until,
                      format="raw")
    ids = np.sort(np.concatenate(got))
    want = np.concatenate([
        np.arange(100, 130),                       # web 0: 100..129
        10**4 + np.arange(5),                      # web 1: 0..4
        10**6 + np.arange(300),                    # code 0, 1: all (not named)
        10**6 + 10**4 + np.arange(300),
        10**6 + 2 * 10**4 + np.arange(250, 300),   # code 2: from 250 to its end
    ])                                             # math: until 0, nothing
    np.testing.assert_array_equal(ids, np.sort(want))


@pytest.mark.parametrize("kwargs, match", [
    ({"until": {("web", 0): -1}}, "int >= 0"),
    ({"until": {"web": 3}}, "keys must be \\(topic, partition\\)"),
    ({"start": {("elsewhere", 0): 3}}, "not a partition of the topics"),
    ({"until": "tomorrow"}, "until must be None"),
    ({"start": 5}, "start must be 'committed'"),
])
def test_bad_windows_say_what_is_wrong(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Loader(None, ["web", "code"], ROWS, 8, source=MemorySource(row_values()), **kwargs)


# -- epochs ------------------------------------------------------------------------------


def epoch_loader(**kwargs):
    kwargs = {"until": "end", "epochs": 3, "shuffle": Shuffle(64, seed=8), **kwargs}
    return Loader(None, "memory", ROWS, 32, source=MemorySource(
        {p: v for (t, p), v in row_values().items() if t == "web"}), device="cpu", **kwargs)


def epoch_ids(loader) -> np.ndarray:
    return np.concatenate([b["id"].numpy().copy() for b in loader] or [np.empty(0, np.int64)])


def test_each_epoch_reads_the_window_once_in_its_own_reproducible_order():
    loader = epoch_loader()
    epochs = [epoch_ids(loader) for _ in range(4)]  # a fourth loop finds nothing more
    assert len(epochs[3]) == 0 and loader.epoch == 2
    for ids in epochs[:3]:
        assert sorted(ids.tolist()) == sorted(epochs[0].tolist()) and len(ids) == 1200
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    again = epoch_loader()
    again.set_epoch(2)  # as DistributedSampler.set_epoch: straight to epoch 2's order
    np.testing.assert_array_equal(epoch_ids(again), epochs[2])


def test_the_records_mixed_are_counted_over_every_epoch():
    # They restarted at each epoch, while the other counters went on.
    loader = Loader(None, Mix(WEIGHTS, seed=1, exhausted="renormalize"), ROWS, 32,
                    source=MemorySource(row_values()), device="cpu", until="end", epochs=2)
    with loader:
        n = [len(epoch_ids(loader)) for _ in range(2)]
        stats = loader.stats()
    assert n[0] == n[1] > 0
    assert sum(stats["mix"].values()) == stats["samples"] == 2 * n[0]


@pytest.mark.parametrize("stop", [5, 37])  # inside epoch 1; at its very end
def test_a_resume_inside_an_epoch_goes_on_inside_it(stop):
    whole = [epoch_ids(ld) for ld in [epoch_loader()] for _ in range(3)]
    loader = epoch_loader()
    epoch_ids(loader)  # epoch 0
    got = []
    for i, batch in enumerate(loader):  # epoch 1, stopped
        got.append(batch["id"].numpy().copy())
        if i + 1 == stop:
            break
    state = loader.state_dict()
    assert state["epochs"]["epoch"] == 1
    resumed = epoch_loader()
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    rest = epoch_ids(resumed)
    np.testing.assert_array_equal(np.concatenate(got + [rest]), whole[1])
    np.testing.assert_array_equal(epoch_ids(resumed), whole[2])
    assert resumed.epoch == 2 and len(epoch_ids(resumed)) == 0


def test_a_state_saved_between_epochs_starts_the_next_one():
    loader = epoch_loader(epochs=2)
    first = epoch_ids(loader)
    state = loader.state_dict()
    assert state["epochs"]["finished"]
    resumed = epoch_loader(epochs=2)
    resumed.load_state_dict(state)
    second = epoch_ids(resumed)
    assert resumed.epoch == 1 and sorted(second.tolist()) == sorted(first.tolist())
    assert len(epoch_ids(resumed)) == 0


def test_epochs_start_where_the_group_committed_inside_a_message():
    # A group committed part-way into a block (offset 1, 5 of its 10 records
    # used): every epoch's window starts after them, as a read without epochs does.
    values = {0: ROWS.encode_blocks({"id": np.arange(100), "x": np.zeros((100, 2), np.float32)},
                                    10)}
    source = MemorySource(values)
    with Loader(None, "memory", ROWS, 5, source=source, device="cpu", until="end") as first:
        used = np.concatenate([next(first)["id"].numpy().copy() for _ in range(3)])
    assert used.tolist() == list(range(15)) and source.committed_positions == {("memory", 0): (1, 5)}
    with Loader(None, "memory", ROWS, 5, source=source, device="cpu", until="end",
                epochs=2) as loader:
        epochs = [epoch_ids(loader) for _ in range(2)]
        state = loader.state_dict()
    assert [e.tolist() for e in epochs] == [list(range(15, 100))] * 2
    resumed = Loader(None, "memory", ROWS, 5, source=source, device="cpu", until="end",
                     epochs=3)
    resumed.load_state_dict(state)  # the window's start, skip included, comes back with it
    assert epoch_ids(resumed).tolist() == list(range(15, 100))


def test_bad_epochs_say_what_is_wrong():
    with pytest.raises(ConfigError, match="bounded window"):
        epoch_loader(until=None)
    with pytest.raises(ConfigError, match="epochs must be"):
        epoch_loader(epochs=0)
    loader = epoch_loader()
    with pytest.raises(ConfigError, match="epoch must be an int in 0..2"):
        loader.set_epoch(3)
    loader.set_epoch(np.int64(1))  # a numpy integer, as an int
    assert loader.epoch == 1 and type(loader.epoch) is int
    loader.close()


def test_set_epoch_leaves_an_epoch_left_early():
    # Steps per epoch, as with DistributedSampler: a loop left early, then
    # set_epoch(next). It raised "epoch 0 is being read"; now the next epoch
    # is read whole, in its own order, and set_epoch of the epoch being read
    # lets it go on.
    whole = epoch_loader()
    orders = [epoch_ids(whole).tolist() for _ in range(3)]
    whole.close()
    loader = epoch_loader()
    for epoch, steps in ((0, 2), (1, 3), (2, None)):
        loader.set_epoch(epoch)
        got = []
        for step, batch in enumerate(loader):
            got += batch["id"].tolist()
            if step + 1 == steps:
                break
        assert got == (orders[epoch][:steps * 32] if steps else orders[epoch])
    loader.set_epoch(1)
    first = next(iter(loader))["id"].tolist()
    loader.set_epoch(1)  # the epoch being read: it goes on
    assert first + [i for b in loader for i in b["id"].tolist()] == orders[1]
    loader.close()


@pytest.mark.parametrize("incremental", [False, True])
def test_a_mixture_through_rebalances_loses_nothing(incremental):
    cols = {"id": np.arange(4000), "x": np.zeros((4000, 2), np.float32)}
    values = {p: ROWS.encode_blocks({k: v[p::4] for k, v in cols.items()}, 10) for p in range(4)}
    source = MemorySource(values, incremental=incremental, most=4)
    if incremental:
        source.rebalance(5, revoke=[2, 3])
        source.rebalance(9, assign=[2, 3])
    else:
        source.rebalance(5, revoke=[0, 1, 2, 3], assign=[0, 1])
        source.rebalance(9, revoke=[0, 1], assign=[0, 1, 2, 3])
    loader = Loader(None, Mix({"memory": 1.0}), ROWS, 64, source=source, device="cpu",
                    until="end")
    with loader:
        ids = np.concatenate([b["id"].numpy().copy() for b in loader])
    assert set(ids.tolist()) == set(range(4000))


def repeat_values() -> dict:
    values = {}
    for t, k, n in (("a", 0, 25), ("b", 1, 100)):
        for p in range(2):
            cols = {"id": np.arange(n) + k * 10**6 + p * 10**4,
                    "x": np.zeros((n, 2), np.float32)}
            values[(t, p)] = ROWS.encode_blocks(cols, 7)
    return values


def test_repeat_reads_a_source_again_until_every_source_ran_out_once():
    got, stats = read(repeat_values(), Mix({"a": 0.5, "b": 0.5}, seed=2, exhausted="repeat"),
                      batch_size=16)
    ids = np.concatenate(got)
    b = ids[ids >= 10**6]
    assert sorted(b.tolist()) == sorted(set(b.tolist())) and len(b) == 200  # b once
    a = ids[ids < 10**6]
    counts = np.bincount(a % 10**4 + 25 * (a // 10**4), minlength=50)
    # a four times over (and the first record of a fifth reading, drawn before b ran out)
    assert len(a) - len(b) in (0, 1) and counts.min() == 4 and counts.max() <= 5
    assert window_deviation((ids >= 10**6).astype(np.int64), [0.5, 0.5]) < 2.0
    assert stats["mix"] == {"a": len(a), "b": 200}


@pytest.mark.parametrize("shuffle", [None, Shuffle(20, seed=1)])
def test_a_repeat_read_to_its_end_commits_every_topic_at_its_end(shuffle):
    # The repeated topic's commit was its place in the reading in progress:
    # the next read from the group read the rest of that reading again.
    src = MemorySource(repeat_values())
    loader = Loader(None, Mix({"a": 0.5, "b": 0.5}, seed=2, exhausted="repeat"), ROWS, 16,
                    source=src, device="cpu", until="end", shuffle=shuffle)
    with loader:
        assert len(epoch_ids(loader)) > 250
    committed = src.committed(list(repeat_values()))
    # a: its window's end, read four times over. b, read once: its end, not
    # (14, 2) after the last record of its last message, which is lag 1.
    assert {tp: (c.offset, c.skip) for tp, c in committed.items()} == {
        ("a", 0): (4, 0), ("a", 1): (4, 0), ("b", 0): (15, 0), ("b", 1): (15, 0)}
    again = Loader(None, Mix({"a": 0.5, "b": 0.5}, seed=2, exhausted="repeat"), ROWS, 16,
                   source=src, device="cpu", until="end", shuffle=shuffle)
    with again:
        assert len(epoch_ids(again)) == 0


@pytest.mark.parametrize("shuffle", [None, Shuffle(20, seed=1)])
@pytest.mark.parametrize("stop", [2, 5, 9])  # before a ran out, in its second, in its third reading
def test_a_repeat_stopped_and_read_on_from_the_group_reads_the_topic_read_once_once(shuffle, stop):
    # The commits carried no note under "repeat", not even for b, which is
    # never read again: the records the shuffle held above b's commit, and
    # used, came again from the group.
    src = MemorySource(repeat_values())

    def loader() -> Loader:
        return Loader(None, Mix({"a": 0.5, "b": 0.5}, seed=2, exhausted="repeat"), ROWS, 16,
                      source=src, device="cpu", until="end", shuffle=shuffle)

    with loader() as first:
        batches = iter(first)
        seen = [i for _ in range(stop) for i in next(batches)["id"].tolist()]
    with loader() as again:
        seen += epoch_ids(again).tolist()
    b = [i for i in seen if i >= 10**6]
    assert len(b) == len(set(b)) == 200


@pytest.mark.parametrize("stop", [3, 9])
def test_a_packed_repeat_read_on_from_the_group_cuts_the_document_part_way_out(stop):
    # The commit's note said nothing of the tokens of web's document part way
    # out: read on from the group, it came whole again after its first part.
    values, docs = token_values()
    values = {tp: v for tp, v in values.items() if tp[0] in ("web", "math")}
    src = MemorySource(values)

    def loader() -> Loader:
        return Loader(None, Mix({"web": 0.8, "math": 0.2}, seed=4, exhausted="repeat"), TOKENS,
                      4, source=src, device="cpu", until="end", pack=Pack(64, eos_id=2, pad_id=0))

    with loader() as first:
        batches = iter(first)
        got = [next(batches)["tokens"].numpy().copy() for _ in range(stop)]
    with loader() as again:
        got += [b["tokens"].numpy().copy() for b in again]
    web = [d for d in documents(got) if d[0] < 200000]
    assert sorted(int(d[0]) for d in web) == sorted(k for k in docs if k < 200000)
    for d in web:
        np.testing.assert_array_equal(d[:-1], docs[int(d[0])])


@pytest.mark.parametrize("stop", [3, 8, 11])  # a in its first, second and third reading
def test_repeat_resumes_inside_a_reading_exactly(stop):
    mix = Mix({"a": 0.5, "b": 0.5}, seed=2, exhausted="repeat")
    kw = {"batch_size": 16, "shuffle": Shuffle(20, seed=1)}
    whole = np.concatenate(read(repeat_values(), mix, **kw)[0])
    first, state = read(repeat_values(), mix, stop=stop, **kw)
    rest, _ = read(repeat_values(), mix, state=state, **kw)
    np.testing.assert_array_equal(np.concatenate(first + rest), whole)
    assert all(0 <= pos[0] <= 15 for parts in state["positions"].values()
               for pos in parts.values())  # Kafka offsets, whatever the reading


def test_repeat_drops_a_source_with_nothing_in_its_window():
    values = repeat_values()
    values[("a", 0)], values[("a", 1)] = [], []
    got, stats = read(values, Mix({"a": 0.5, "b": 0.5}, exhausted="repeat"), batch_size=16)
    assert len(np.concatenate(got)) == 200 and stats["mix"] == {"a": 0, "b": 200}


def test_repeat_ends_though_a_source_of_weight_0_never_runs_out():
    # z is never drawn, so it never runs out: the read ends once the others did
    # (it went on reading a and b again forever).
    values = repeat_values()
    values[("z", 0)] = ROWS.encode_blocks({"id": np.arange(5) + 9 * 10**6,
                                           "x": np.zeros((5, 2), np.float32)}, 7)
    got, stats = read(values, Mix({"a": 0.5, "b": 0.5, "z": 0.0}, seed=2, exhausted="repeat"),
                      batch_size=16)
    assert stats["mix"]["b"] == 200 and stats["mix"]["z"] == 0
    assert sum(len(g) for g in got) == stats["mix"]["a"] + 200


def test_a_merged_state_reads_again_a_source_that_was_about_to_be(monkeypatch):
    # A rank saved its state as source a ran out and was to be read again (its
    # count since its start at 0): the merged state read as "a's window is
    # empty" and dropped a for good.
    mix = Mix({"a": 0.5, "b": 0.5}, seed=2, exhausted="repeat")
    values = {k: v for k, v in repeat_values().items()}
    values[("a", 0)] = ROWS.encode_blocks({"id": np.arange(15), "x": np.zeros((15, 2),
                                                                                np.float32)}, 5)

    def job(state: dict | None) -> list:
        got = []
        for rank in range(2):
            got += read(values, mix, batch_size=16, state=state, rank=rank, world_size=2,
                        assignment="static")[0]
        return got

    # The state is taken while the feeder holds a, run out, before it reads it
    # again (which it would do at once, before a state_dict came, but for this).
    held = threading.Event()
    read_again = build.RecordBuilder._read_again

    def hold(self):
        if self.mixer is not None and self.mixer.to_repeat is not None:
            held.set()
            return False
        return read_again(self)

    states = []
    with monkeypatch.context() as m:
        m.setattr(build.RecordBuilder, "_read_again", hold)
        # Rank 0's a (15 records) runs out in its 2nd batch, rank 1's (25) in its 4th.
        for rank, stop in enumerate([1, 3]):
            held.clear()
            loader = Loader(None, mix, ROWS, 16, source=MemorySource(values), device="cpu",
                            until="end", rank=rank, world_size=2, assignment="static")
            with loader:
                for i, _batch in enumerate(loader):
                    if i + 1 == stop:
                        break
                assert held.wait(30)
                states.append(loader.state_dict())
    assert all(st["mix"]["to_repeat"] == 0 for st in states)
    unmerged = [np.concatenate(read(values, mix, batch_size=16, state=st, rank=rank,
                                    world_size=2, assignment="static")[0])
                for rank, st in enumerate(states)]
    rest = job(Loader.merge_states(states))
    a_rest = sum(int((r < 10**6).sum()) for r in rest)
    assert a_rest == sum(int((u < 10**6).sum()) for u in unmerged)
    assert sum(int((r >= 10**6).sum()) for r in rest) == \
        sum(int((u >= 10**6).sum()) for u in unmerged)
    assert a_rest > 100  # a goes on beside b (37 of b's 152 when it was dropped)


def small_a_values(a_records: int = 5, empty_a0: bool = False) -> dict:
    values = repeat_values()
    for p in range(2):
        n = 0 if (empty_a0 and p == 0) else a_records
        values[("a", p)] = ROWS.encode_blocks(
            {"id": np.arange(n) + p * 10**4, "x": np.zeros((n, 2), np.float32)}, 2)
    return values


@pytest.mark.parametrize("stop", [2, 5, 9])
def test_repeat_resumes_with_several_readings_held_in_the_shuffle(stop):
    # A small source read again many times while a large shuffle still holds
    # records of its first readings: they come back first, a reading at a time.
    mix = Mix({"a": 0.5, "b": 0.5}, seed=4, exhausted="repeat")
    kw = {"batch_size": 16, "shuffle": Shuffle(120, seed=2)}
    whole = np.concatenate(read(small_a_values(), mix, **kw)[0])
    first, state = read(small_a_values(), mix, stop=stop, **kw)
    assert max(r for _t, _p, r in state["rounds"]) >= 2
    rest, _ = read(small_a_values(), mix, state=state, **kw)
    np.testing.assert_array_equal(np.concatenate(first + rest), whole)


@pytest.mark.parametrize("shuffle", [None, Shuffle(5, seed=1)])
def test_a_repeat_state_saved_again_before_its_first_batch_keeps_its_rounds(shuffle):
    # A job resumed and checkpointed again before its first step (or a rank
    # that saves before its first batch): the loaded rounds were not in the
    # state, and a resume from it stopped reading the source read again
    # (24 of 40 records).
    ids = Schema({"id": ("int64", ())})
    values = {("a", 0): ids.encode_blocks({"id": np.array([0])}, 1),  # read again and again
              ("b", 0): ids.encode_blocks({"id": np.arange(1000, 1020)}, 1)}
    mix = Mix({"a": 0.5, "b": 0.5}, seed=0, exhausted="repeat")
    kw = {"batch_size": 4, "shuffle": shuffle}
    whole = np.concatenate(read(values, mix, ids, **kw)[0])
    assert len(whole) == 40
    first, state = read(values, mix, ids, stop=1, **kw)
    assert state["rounds"]
    loader = Loader(None, mix, ids, 4, source=MemorySource(values), device="cpu", until="end",
                    shuffle=shuffle)
    loader.load_state_dict(state)
    with loader:
        again = loader.state_dict()
    assert again["rounds"] == state["rounds"]
    rest, _ = read(values, mix, ids, state=again, **kw)
    np.testing.assert_array_equal(np.concatenate(first + rest), whole)
    # Merged with states naming the partition in an earlier round, or in none,
    # the furthest round is kept, once.
    (t, p, r), = state["rounds"]
    for other in ([[t, p, 1]], []):
        merged = Loader.merge_states([{**again, "rounds": other}, again])
        assert merged["rounds"] == state["rounds"]


def test_repeat_with_a_partition_empty_in_the_window_does_not_stall():
    got, stats = read(small_a_values(empty_a0=True), Mix({"a": 0.5, "b": 0.5},
                                                          exhausted="repeat"), batch_size=16)
    ids = np.concatenate(got)
    assert stats["mix"]["b"] == 200 and abs(stats["mix"]["a"] - 200) <= 1
    assert set(ids[ids < 10**6].tolist()) == set(range(10**4, 10**4 + 5))


def _ids_within(loader: Loader, seconds: float = 60) -> list[int]:
    """Every id ``loader`` hands out, read in a thread: fails if it has not ended in time."""
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.extend(
        i for b in loader for i in b["id"].tolist()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"next() waits for ever, after {len(got)} records"
    return got


def test_repeat_resumed_on_a_rank_whose_partitions_of_a_source_are_empty_ends() -> None:
    # The merged state counts the source's records the other rank mixed, so
    # it runs out here to be read again, with nothing to read: next() waited
    # for ever.
    values = {("a", 0): IDS.encode_blocks({"id": np.arange(0, 20)}, 5),
              ("a", 1): IDS.encode_blocks({"id": np.arange(100, 120)}, 5),
              ("b", 0): IDS.encode_blocks({"id": np.arange(1000, 1030)}, 5),
              ("b", 1): []}
    mix = Mix({"a": 0.5, "b": 0.5}, seed=0, exhausted="repeat")

    def loader(rank: int) -> Loader:
        return Loader(None, mix, IDS, 4, source=MemorySource(values), device="cpu",
                      until="end", rank=rank, world_size=2, assignment="static")

    states, first = [], {}
    for rank in range(2):
        with loader(rank) as ld:
            first[rank] = next(iter(ld))["id"].tolist()
            states.append(ld.state_dict())
    with loader(1) as ld:
        ld.load_state_dict(Loader.merge_states(states))
        rest = _ids_within(ld)
    assert sorted(first[1] + rest) == list(range(100, 120))


def test_repeat_reads_a_source_again_from_inside_the_message_this_read_started_in() -> None:
    # The group had used a's records 0..14 (commit (1, 5), inside the second
    # message of 10): every reading after the first read 10..14 again.
    values = {("a", 0): IDS.encode_blocks({"id": np.arange(0, 20)}, 10),
              ("b", 0): IDS.encode_blocks({"id": np.arange(1000, 1060)}, 10)}
    source = MemorySource(values)
    with Loader(None, Mix({"a": 1.0, "b": 0.0}), IDS, 5, source=source, device="cpu",
                until="end") as first:
        batches = iter(first)
        assert [i for _ in range(3) for i in next(batches)["id"].tolist()] == list(range(15))
    assert source.committed_positions[("a", 0)] == (1, 5)
    again = Loader(None, Mix({"a": 0.5, "b": 0.5}, exhausted="repeat"), IDS, 5,
                   source=source, device="cpu", until="end")
    with again:
        a = [i for i in _ids_within(again) if i < 1000]
    assert a == [15, 16, 17, 18, 19] * (len(a) // 5) and len(a) >= 10


def test_repeat_through_an_incremental_rebalance_reads_the_big_source_once():
    source = MemorySource(small_a_values(), incremental=True)
    values = small_a_values()
    source = MemorySource(values, incremental=True, most=4)
    loader = Loader(None, Mix({"a": 0.5, "b": 0.5}, exhausted="repeat"), ROWS, 16,
                    source=source, device="cpu", until="end", shuffle=Shuffle(40, seed=1))
    with loader:
        ids = []
        for i, batch in enumerate(loader):
            ids.append(batch["id"].numpy().copy())
            if i == 3:  # the loader keeps a's partitions, loses and regains b's
                source._script.append((source.calls + 1, [("b", 1)], []))
                source._script.append((source.calls + 4, [], [("b", 1)]))
    ids = np.concatenate(ids)
    b = ids[ids >= 10**6]
    assert set(b.tolist()) == set(np.concatenate([10**6 + np.arange(100),
                                                  10**6 + 10**4 + np.arange(100)]).tolist())


def test_a_dataset_reads_the_epoch_set_as_the_loader_does():
    values = {p: v for (t, p), v in row_values().items() if t == "web"}
    ends = {("memory", p): len(v) for p, v in values.items()}
    kwargs = {"start": "earliest", "until": ends, "epochs": 3, "shuffle": Shuffle(64, seed=8),
              "device": "cpu"}
    loader = Loader(None, "memory", ROWS, 32, source=MemorySource(values), **kwargs)
    want = [epoch_ids(loader) for _ in range(3)]
    ds = KafkaIterableDataset(None, "memory", ROWS, 32, source=MemorySource(values),
                              **kwargs)
    for epoch in (0, 2, 1):
        ds.set_epoch(epoch)
        np.testing.assert_array_equal(epoch_ids(iter(ds)), want[epoch])
    with pytest.raises(ConfigError, match="epoch must be an int in 0..2"):
        ds.set_epoch(3)
    for change in ({"until": "end"}, {"start": "committed"}):
        with pytest.raises(ConfigError, match="would find the window's ends anew"):
            KafkaIterableDataset(None, "memory", ROWS, 32, source=MemorySource(values),
                                 **{**kwargs, **change})


def test_a_member_given_only_topics_of_weight_zero_says_why_it_hands_out_nothing(caplog):
    import threading
    import time

    values = {(t, 0): ROWS.encode_blocks({"id": np.arange(50), "x": np.zeros((50, 2), np.float32)},
                                         10) for t in ("a", "b")}
    # Unbounded, in a group that gave this member only topic b's partition.
    loader = Loader(None, Mix({"a": 1.0, "b": 0.0}), ROWS, 8, device="cpu",
                    source=MemorySource(values, first=[("b", 0)]))
    got: list[int] = []
    raised: list[str] = []

    def read() -> None:
        try:
            got.extend(b.size for b in loader)
        except LoaderError as e:
            raised.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    with caplog.at_level("WARNING", logger="kfeed.loader"):
        reader.start()
        deadline = time.monotonic() + 30
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
        loader.close()
        reader.join(30)
    assert got == [] and not reader.is_alive()
    assert raised == ["the loader was closed, by another thread, while next() waited for a batch"]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [  # each once, though the loader asked the mixer again and again
        "this loader holds no partition of ['a']: the mixture goes on without them, in the "
        "others' proportions",
        "this member holds partitions only of topic b, whose weight in the mixture is 0 now: "
        "it hands out nothing until it is given a partition of a topic weighted above 0"], lines


def test_a_schedule_starts_again_at_step_0_each_epoch():
    # As the README says: with epochs=N the schedule's step counts within the epoch.
    steps: list[int] = []

    def schedule(step: int) -> dict[str, float]:
        steps.append(step)
        return {"web": 1.0, "code": 1.0}

    sources = {"web": (0, 1, 64), "code": (1, 1, 64)}
    loader = Loader(None, Mix(schedule), ROWS, 16, source=MemorySource(row_values(sources=sources)),
                    device="cpu", until="end", epochs=2)
    with loader:
        for _ in range(2):
            steps.clear()
            assert sum(b.size for b in loader) == 128
            assert min(steps) == 0 and max(steps) == 8


def test_fetches_of_a_packed_mixture_count_the_repeats_of_earlier_fetches_against_them() -> None:
    # A fetch's repeats were counted against the fetch being added, whatever
    # fetch they were of: that one could go while documents of it were still
    # to go out ("a document the order emitted is not held"), and the earlier
    # one was held for ever.
    fetches = build._Fetches()
    tokens = np.arange(12, dtype=np.int32)
    fetches.add(0, tokens[:6], np.array([2, 2, 2]))      # documents 0, 1, 2
    fetches.add(3, tokens[6:], np.array([3, 3]))         # documents 3, 4
    fetches.drop(np.array([1, 4]))  # a repeat of each, found while the second came in
    assert {k: e[2] for k, e in fetches.held.items()} == {0: 2, 3: 1}
    packer = Packer(Pack(seq_len=16, eos_id=99), 1)
    fetches.feed(packer, np.array([0, 3, 2]), None)
    assert fetches.held == {}  # each went once its last document went out
    packer.finish()
    out = packer.empty()
    packer.next_batch(out)
    assert out["tokens"][0, :10].tolist() == [0, 1, 99, 6, 7, 8, 99, 4, 5, 99]
    fetches.drop(np.array([7, -1]))  # of no fetch held: passed over
