"""Loader behaviour through the in-memory source: no broker needed."""

from __future__ import annotations

import gc
import pickle
import re
import threading
import time

import numpy as np
import pytest
import torch

import kfeed
from kfeed.synthetic import synthetic_columns, synthetic_schema
from kfeed.loader import Loader, memory_loader
from kfeed.loader.fetch import POLL_S
from records import CountingSource, left_to_the_collector

SCHEMA = synthetic_schema()


def blocks(start: int, n: int, per_block: int = 64) -> list[bytes]:
    return SCHEMA.encode_blocks(synthetic_columns(np.arange(start, start + n)), per_block)


def collect(loader: Loader) -> np.ndarray:
    ids = [b["id"].numpy().copy() for b in loader]
    return np.concatenate(ids) if ids else np.empty(0, np.int64)


@pytest.mark.parametrize("batch_size", [1, 64, 100, 256, 1000])
def test_bounded_epoch_delivers_every_sample_once_bit_equal(batch_size: int) -> None:
    values = {0: blocks(0, 3000, 64), 1: blocks(3000, 2000, 50), 2: []}
    seen = []
    with memory_loader(values, SCHEMA, batch_size, until="end", device="cpu") as loader:
        for batch in loader:
            assert batch.size == len(batch["id"]) <= batch_size
            want = synthetic_columns(batch["id"].numpy())
            assert np.array_equal(batch["features"].numpy(), want["features"])
            assert np.array_equal(batch["label"].numpy(), want["label"])
            seen.append(batch["id"].numpy().copy())
    ids = np.concatenate(seen)
    assert np.array_equal(np.sort(ids), np.arange(5000))


def test_drop_last_drops_only_the_partial_tail() -> None:
    with memory_loader(blocks(0, 1000), SCHEMA, 256, until="end", drop_last=True,
                       device="cpu") as loader:
        sizes = [b.size for b in loader]
    assert sizes == [256, 256, 256]


@pytest.mark.parametrize("stop_after", [0, 3, 7, 12])
def test_resume_from_state_dict_repeats_and_skips_nothing(stop_after: int) -> None:
    values = {0: blocks(0, 2000, 64), 1: blocks(2000, 1500, 37)}
    first = memory_loader(values, SCHEMA, 100, until="end", device="cpu")
    got = []
    for i, batch in enumerate(first):
        got.append(batch["id"].numpy().copy())
        if i == stop_after:
            break
    state = first.state_dict()
    first.close()
    second = memory_loader(values, SCHEMA, 100, until="end", device="cpu")
    second.load_state_dict(state)
    got.append(collect(second))
    ids = np.concatenate(got)
    assert len(ids) == len(np.unique(ids)) == 3500


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(buffer=100, seed=0)],
                         ids=["in order", "shuffled"])
def test_a_state_past_the_partitions_end_is_of_another_topic_and_refused(shuffle) -> None:
    # A topic deleted and made again under its name: in offset order the
    # state read nothing, without a word; shuffled, it ended in "records of
    # the loaded state were never pushed again".
    first = memory_loader(blocks(0, 2000, 64), SCHEMA, 100, until="end", device="cpu",
                          shuffle=shuffle)
    for i, _batch in enumerate(first):
        if i == 10:
            break
    state = first.state_dict()
    first.close()
    with memory_loader(blocks(0, 300, 64), SCHEMA, 100, until="end", device="cpu",
                       shuffle=shuffle) as again:
        again.load_state_dict(state)
        with pytest.raises(kfeed.ConsumeError, match=(
                r"^memory\[0\]: the state resumes at offset \d+, but the partition ends at "
                r"offset 5: the state is of another topic of that name")):
            next(again)


def test_state_dict_rejects_another_schema() -> None:
    loader = memory_loader(blocks(0, 64), SCHEMA, 32, until="end", device="cpu")
    state = loader.state_dict()
    other = kfeed.Schema({"x": ("float32", (4,))})
    with pytest.raises(kfeed.ConfigError, match="another schema"):
        memory_loader([], other, 32, until="end", device="cpu").load_state_dict(state)
    loader.close()


def test_commits_trail_the_step() -> None:
    source = kfeed.MemorySource(blocks(0, 640, 64))
    loader = Loader(None, "memory", SCHEMA, 64, source=source, until="end", device="cpu",
                    commit_interval_ms=0)
    first = next(loader)
    assert source.committed_positions == {}  # the step using `first` has not finished
    second = next(loader)
    assert source.committed_positions[("memory", 0)] == first.offsets[("memory", 0)][1]
    assert second.offsets[("memory", 0)][0] == first.offsets[("memory", 0)][1]
    loader.close()
    assert source.committed_positions[("memory", 0)] == second.offsets[("memory", 0)][1]


def test_a_commit_every_step_waits_for_the_commit_not_for_the_thread_s_next_look() -> None:
    # The thread, waiting for room in the ready queue, made a synchronous commit
    # at its next look, a tenth of a second later: 100 steps of
    # commit_interval_ms=0 took 10 s from memory.
    source = kfeed.MemorySource(blocks(0, 64 * 50, 64))
    with Loader(None, "memory", SCHEMA, 64, source=source, until="end", device="cpu",
                commit_interval_ms=0) as loader:
        next(loader)
        t0 = time.monotonic()
        steps = sum(1 for _ in loader)
        took = time.monotonic() - t0
    assert steps == 49
    assert took < 10 * POLL_S, took  # (before: about 25 POLL_S)
    assert source.committed_positions[("memory", 0)] == (50, 0)  # (messages of 64)


def test_a_commit_asked_as_the_thread_ends_is_made_by_the_caller(monkeypatch) -> None:
    # A bounded read's thread queued its end and left; a synchronous commit asked
    # of it meanwhile (commit_interval_ms=0) waited connect_timeout_s + 5 s for
    # it, then failed the read: "it is committing (Source.commit)".
    from kfeed.loader import feeder

    run = feeder.Feeder.run

    def slow_to_leave(self) -> None:
        run(self)
        time.sleep(0.5)  # the end queued: no commit is taken from here on

    monkeypatch.setattr(feeder.Feeder, "run", slow_to_leave)
    source = kfeed.MemorySource(blocks(0, 640, 64))
    loader = Loader(None, "memory", SCHEMA, 64, source=source, until="end", device="cpu",
                    commit_interval_ms=0, connect_timeout_s=1)
    t0 = time.monotonic()
    with loader:
        assert sum(b.size for b in loader) == 640
    assert time.monotonic() - t0 < 5  # (before: a ConsumeError after 6 s)
    assert source.committed_positions[("memory", 0)] == (10, 0)


def test_a_caught_up_stream_commits_what_was_used_while_next_waits() -> None:
    # Every record used, the caller waits in next() for more: the commit of the
    # last batch waited for the next one to come (a caught-up trainer showed a
    # lag in `kfeed lag` for as long as the topic stayed quiet).
    source = kfeed.MemorySource(blocks(0, 640, 64))
    loader = Loader(None, "memory", SCHEMA, 64, source=source, device="cpu",
                    commit_interval_ms=50)
    for _ in range(10):
        last = next(loader)
    end = last.offsets[("memory", 0)][1]
    def wait() -> None:
        with pytest.raises(kfeed.LoaderError, match="closed, by another thread"):
            next(loader)

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    deadline = time.monotonic() + 10
    while source.committed_positions.get(("memory", 0)) != end and time.monotonic() < deadline:
        time.sleep(0.02)
    assert source.committed_positions.get(("memory", 0)) == end
    assert waiting.is_alive()  # still waiting for a record: the commit came from the wait
    loader.close()
    waiting.join(10)


def test_close_after_an_exception_does_not_commit_the_current_batch() -> None:
    source = kfeed.MemorySource(blocks(0, 640, 64))
    with pytest.raises(RuntimeError):
        with Loader(None, "memory", SCHEMA, 64, source=source, until="end", device="cpu",
                    commit_interval_ms=0) as loader:
            next(loader)
            current = next(loader)
            raise RuntimeError("the step failed")
    assert source.committed_positions[("memory", 0)] == current.offsets[("memory", 0)][0]


@pytest.mark.parametrize("policy", ["skip", "dead_letter"])
def test_bad_records_never_reach_a_batch(policy: str) -> None:
    good = blocks(0, 640, 64)
    values = list(good)
    values.insert(3, b"garbage")
    values.insert(7, good[0][:100])  # truncated block
    values.insert(9, None)  # tombstone
    source = kfeed.MemorySource(values)
    with Loader(None, "memory", SCHEMA, 128, source=source, until="end", device="cpu",
                on_bad_record=policy) as loader:
        ids = collect(loader)
        assert loader.stats()["bad_records"] == 3
    assert np.array_equal(np.sort(ids), np.arange(640))
    if policy == "dead_letter":
        assert sorted(m.offset() for m, _ in source.dead_letters) == [3, 7, 9]


def test_bad_record_raise_names_the_offset() -> None:
    values = blocks(0, 128, 64) + [b"x" * 40]
    with memory_loader(values, SCHEMA, 64, until="end", device="cpu",
                       on_bad_record="raise") as loader:
        with pytest.raises(kfeed.DecodeError) as info:
            collect(loader)
    assert info.value.offset == 2 and info.value.partition == 0


def test_raw_format() -> None:
    values = SCHEMA.encode_raw(synthetic_columns(np.arange(500)))
    with memory_loader(values, SCHEMA, 64, format="raw", until="end", device="cpu") as loader:
        assert np.array_equal(collect(loader), np.arange(500))


class Trickle(kfeed.MemorySource):
    """One message per consume call, 10 ms apart: a slow fetch."""

    def consume(self, max_messages: int, timeout: float) -> list:
        time.sleep(0.01)
        return super().consume(1, timeout)


@pytest.mark.parametrize("until", ["end", None])
def test_max_wait_makes_partial_batches_only_when_streaming(until) -> None:
    values = SCHEMA.encode_raw(synthetic_columns(np.arange(20)))
    loader = Loader(None, "memory", SCHEMA, 8, format="raw", until=until, device="cpu",
                    max_wait_ms=5, source=Trickle(values))
    sizes = []
    for batch in loader:
        sizes.append(batch.size)
        if sum(sizes) == 20:
            break
    loader.close()
    if until == "end":
        assert sizes == [8, 8, 4]  # a bounded epoch: full batches but the last
    else:
        assert max(sizes) < 8  # streaming: what came within max_wait


class _Clock:
    """A monotonic clock that moves only as a consume() waits (``Waiting``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Waiting(kfeed.MemorySource):
    """A message of each partition a consume(); a call asked for more waits out its
    timeout, as librdkafka's does, on ``clock``."""

    def __init__(self, values: Any, clock: _Clock) -> None:
        super().__init__(values)
        self.clock = clock

    def consume(self, max_messages: int, timeout: float) -> list:
        if max_messages > len(self._next):
            self.clock.now += timeout
        return super().consume(len(self._next), 0)


@pytest.mark.parametrize("how", ["jagged", "pack", "mix"])
def test_a_batch_of_a_trickling_stream_goes_out_max_wait_after_its_first_fetch_began(
        how, monkeypatch) -> None:
    # Read into rows of a variable-length field, packed or mixed, the clock
    # started once that fetch had returned: a batch went out up to POLL_S after
    # max_wait (203 ms at max_wait_ms=100 on a broker, one record every 50 ms).
    import types

    from kfeed.loader import build, fetch

    clock = _Clock()
    fake = types.SimpleNamespace(monotonic=clock.monotonic)
    monkeypatch.setattr(build, "time", fake)
    monkeypatch.setattr(fetch, "time", fake)
    schema = kfeed.Schema({"tokens": ("int32", (None,))})
    values = schema.encode_raw({"tokens": [np.arange(5, dtype=np.int32)] * 20})
    topics: Any = "memory"
    parts: dict = {("memory", 0): values}
    kwargs: dict[str, Any] = {"pack": kfeed.Pack(64, eos_id=0)} if how == "pack" else {}
    if how == "mix":
        topics, parts = kfeed.Mix({"a": 1.0, "b": 1.0}), {("a", 0): values[:10],
                                                          ("b", 0): values[10:]}
    with Loader(None, topics, schema, 64, source=Waiting(parts, clock), device="cpu",
                format="raw", max_wait_ms=3.5 * POLL_S * 1000, **kwargs) as loader:
        batch = next(loader)
    # Fetches of POLL_S from the first one's start: 4 of them within max_wait (5 before).
    assert (batch.pack.documents if how == "pack" else batch.size) == 4 * len(parts)


def test_lag_counts_from_the_last_batch_handed_out() -> None:
    # 1,000 one-sample messages on one partition; the feeder runs ahead by
    # prefetch batches, but the lag counts what the caller has not had yet.
    values = SCHEMA.encode_raw(synthetic_columns(np.arange(1000)))
    with memory_loader(values, SCHEMA, 100, format="raw", until="end", device="cpu",
                       prefetch=4) as loader:
        next(loader)
        next(loader)
        assert loader.stats()["lag"] == {"memory[0]": 800}
        for _ in loader:
            pass
        assert loader.stats()["lag"] == {"memory[0]": 0}


def test_streaming_yields_partial_batch_after_max_wait() -> None:
    with memory_loader(blocks(0, 10), SCHEMA, 256, max_wait_ms=50, device="cpu") as loader:
        batch = next(loader)
    assert batch.size == 10


def test_batches_are_owned_by_the_caller() -> None:
    # 64 batches kept, many more than the pool's slots: none is refilled.
    with memory_loader(blocks(0, 2048), SCHEMA, 32, until="end", device="cpu") as loader:
        kept = list(loader)
    ids = np.concatenate([b["id"].numpy() for b in kept])
    assert np.array_equal(ids, np.arange(2048))


def test_views_and_arrays_the_caller_keeps_stay_valid() -> None:
    # Every third batch kept as a view, a numpy array or not at all: the slots
    # let go of are refilled, the others never.
    kept = []
    with memory_loader(blocks(0, 4096), SCHEMA, 32, until="end", device="cpu") as loader:
        for i, batch in enumerate(loader):
            if i % 3 == 0:
                kept.append(batch["id"][1:])
            elif i % 3 == 1:
                kept.append(batch["id"].numpy())
    ids = np.concatenate([np.asarray(k) for k in kept])
    want = np.concatenate([np.arange(b * 32 + (1 if b % 3 == 0 else 0), b * 32 + 32)
                           for b in range(128) if b % 3 != 2])
    assert np.array_equal(ids, want)


def test_stats_and_stall() -> None:
    with memory_loader(blocks(0, 1024), SCHEMA, 128, until="end", device="cpu") as loader:
        collect(loader)
        st = loader.stats()
    assert st["samples"] == 1024 and st["batches"] == 8
    assert st["bytes"] == sum(len(v) for v in blocks(0, 1024))
    assert 0.0 <= st["stall_fraction"] <= 1.0


def test_a_closed_loader_of_epochs_stays_closed() -> None:
    # The next loop, set_epoch and load_state_dict each made a new pipeline and
    # read a whole epoch from a loader the user had closed.
    def made() -> Loader:
        return Loader(None, "memory", SCHEMA, 100, source=kfeed.MemorySource(blocks(0, 500)),
                      until="end", epochs=2, device="cpu")

    loader = made()
    collect(loader)
    state = loader.state_dict()
    loader.close()
    for use in (lambda: iter(loader), lambda: loader.set_epoch(1),
                lambda: loader.load_state_dict(state), lambda: next(loader)):
        with pytest.raises(kfeed.LoaderError, match="^the loader is closed$"):
            use()
    # numpy's integers are ints here too, as in Shuffle and the offset maps.
    other = Loader(None, "memory", SCHEMA, np.int64(100),
                   source=kfeed.MemorySource(blocks(0, 500)), until="end", device="cpu",
                   prefetch=np.int32(2))
    assert type(other.config.batch_size) is int and sum(b.size for b in other) == 500
    other.close()


def test_commit_after_close_is_refused_and_commits_nothing() -> None:
    # A step failed inside `with loader:`, whose close() leaves that batch
    # uncommitted; commit() after it went on to commit the failed batch (a
    # closed Kafka consumer refused it with its own "Consumer closed").
    source = kfeed.MemorySource(blocks(0, 500))
    loader = Loader(None, "memory", SCHEMA, 100, source=source, until="end", device="cpu")
    with pytest.raises(ZeroDivisionError), loader:
        for i, _batch in enumerate(loader):
            if i == 2:
                raise ZeroDivisionError
    before = dict(source.committed_positions)
    with pytest.raises(kfeed.LoaderError, match="^the loader is closed$"):
        loader.commit()
    assert source.committed_positions == before and before


def test_a_given_sources_counts_are_not_added_again_each_epoch() -> None:
    # The source given goes on into each epoch, its counts too; they were
    # added to the earlier epochs' again: commits 2/6/12/20 for 2/4/6/8.
    good = SCHEMA.encode_blocks(synthetic_columns(np.arange(100)), 10)
    source = kfeed.MemorySource(good[:5] + [b"bad"] + good[5:])
    loader = Loader(None, "memory", SCHEMA, 10, source=source, until="end", epochs=4,
                    device="cpu", fail_fast=None)
    for epoch in range(4):
        collect(loader)
        st = loader.stats()
        assert (st["commits"], st["dead_lettered"]) == (source.commits_sent,
                                                        len(source.dead_letters))
        assert st["dead_lettered"] == epoch + 1 and st["bad_records"] == epoch + 1
    loader.close()


def test_the_rates_stop_at_the_end_of_the_read_and_leave_out_the_time_between_epochs() -> None:
    # The clock ran on after the read: samples_per_s fell by 170x a second
    # after it (kfeed train's summary line read it after the final checkpoint).
    keys = ("elapsed_s", "samples_per_s", "mb_per_s", "stall_fraction")
    loader = Loader(None, "memory", SCHEMA, 128, source=kfeed.MemorySource(blocks(0, 1024)),
                    until="end", epochs=2, device="cpu")
    collect(loader)
    ended = {k: loader.stats()[k] for k in keys}
    time.sleep(0.5)
    assert {k: loader.stats()[k] for k in keys} == ended
    t = time.monotonic()
    collect(loader)  # the next epoch, half a second later
    second = time.monotonic() - t
    both = loader.stats()["elapsed_s"]
    loader.close()
    time.sleep(0.2)
    assert loader.stats()["elapsed_s"] == both <= ended["elapsed_s"] + second, (both, ended)
    assert loader.stats()["samples_per_s"] == 2048 / both


def test_the_thread_is_woken_for_room_only_once_the_batch_is_handed_out(monkeypatch) -> None:
    # NOTE [ Room is made last ]: a thread woken when next() takes a batch
    # competes for the GIL with the rest of next() (on CUDA, the stream wait).
    # Its timed wait for room is made long, so only being woken refills the queue.
    monkeypatch.setattr("kfeed.loader.feeder.POLL_S", 5.0)
    loader = memory_loader(blocks(0, 1024), SCHEMA, 32, loop=True, prefetch=1, device="cpu")
    ready_while_handing_out = []

    def convert(batch):
        time.sleep(0.3)  # GIL free: a thread told of room refills the queue now
        ready_while_handing_out.append(loader._feeder.ready._items.qsize())
        return batch

    ids = []
    try:
        next(loader)
        loader._convert = convert
        for _ in range(3):
            time.sleep(0.3)  # the queue is full again, and the thread waits for room
            ids.append(int(next(loader)["id"][0]))
    finally:
        loader._convert = None
        loader.close()
    assert ids == [32, 64, 96]
    assert ready_while_handing_out == [0, 0, 0]


def test_bad_configuration_is_a_config_error() -> None:
    for kwargs in ({"batch_size": 0}, {"until": "forever"}, {"start": "yesterday"},
                   {"on_bad_record": "ignore"}, {"format": "csv"}, {"prefetch": 0}):
        args = {"batch_size": 8, **kwargs}
        with pytest.raises(kfeed.ConfigError):
            memory_loader([], SCHEMA, device="cpu", **args)
    with pytest.raises(kfeed.ConfigError, match="group.id"):
        Loader({"bootstrap.servers": "127.0.0.1:1"}, "t", SCHEMA, 8, device="cpu")


def test_close_stops_the_thread_and_gc_cleans_up() -> None:
    # The loader's own thread, not a count of all threads: another test's may
    # end meanwhile.
    before = set(threading.enumerate())
    loader = memory_loader(blocks(0, 64), SCHEMA, 32, loop=True, device="cpu")
    next(loader)
    (thread,) = [t for t in threading.enumerate() if t not in before]
    assert thread.name == "kfeed-loader"
    del loader
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


TOKENS = kfeed.Schema({"tokens": ("int32", (None,))})
DOCUMENTS = TOKENS.encode_blocks({"tokens": [np.arange(n, dtype=np.int32) for n in range(1, 300)]},
                                 16)
CLOSED = {
    "in order": lambda: memory_loader(blocks(0, 3000), SCHEMA, 256, until="end", device="cpu"),
    "shuffled": lambda: memory_loader(blocks(0, 3000), SCHEMA, 256, until="end", device="cpu",
                                      shuffle=kfeed.Shuffle(buffer=1000, seed=0)),
    "packed": lambda: memory_loader(DOCUMENTS, TOKENS, 4, until="end", device="cpu",
                                    pack=kfeed.Pack(64, eos_id=0)),
    "jagged": lambda: memory_loader(DOCUMENTS, TOKENS, 4, until="end", device="cpu"),
    "mixture": lambda: Loader(None, kfeed.Mix({"a": 0.5, "b": 0.5}, seed=0), SCHEMA, 256,
                              until="end", device="cpu", source=kfeed.MemorySource(
                                  {("a", 0): blocks(0, 1500), ("b", 0): blocks(1500, 1500)})),
    "two epochs": lambda: memory_loader(blocks(0, 3000), SCHEMA, 256, until="end", device="cpu",
                                        epochs=2),
}


@pytest.mark.parametrize("kind", CLOSED)
def test_a_closed_loader_is_freed_at_once_not_by_the_cyclic_collector(kind: str) -> None:
    # Its pool slots, fetched messages and held values would otherwise stay
    # until the collector's next full pass: a loader a step, an epoch or a
    # job made and closed keeps its memory until then.
    def run() -> None:
        loader = CLOSED[kind]()
        with loader:
            for _ in range(loader.config.epochs or 1):
                assert sum(batch.size for batch in loader) > 0

    assert left_to_the_collector(run) == {}


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(buffer=1000, seed=0)],
                         ids=["in order", "shuffled"])
def test_the_first_fetch_asks_for_a_few_messages_until_it_knows_their_records(shuffle) -> None:
    # 64 records a message: a batch of 256 is 4 messages. Asked for a batch's
    # worth of messages before knowing that, a block topic would give 64
    # batches at once, all held (by a shuffle: as its values).
    from kfeed.loader.fetch import FIRST_FETCH
    from kfeed.loader.tuning import fetch_ahead

    source = CountingSource(blocks(0, 64 * 400))
    with Loader(None, "memory", SCHEMA, 256, source=source, device="cpu",
                until="end", shuffle=shuffle) as loader:
        assert sum(batch.size for batch in loader) == 64 * 400
        ahead = fetch_ahead(False)
    asked = [n for n, _timeout, _given in source.asked]
    assert asked[0] == FIRST_FETCH
    assert max(asked) <= (1 + ahead) * 256 // 64


@pytest.mark.parametrize("cap", [None, 1 << 30], ids=["no cap", "max_memory_bytes"])
def test_a_backlog_of_small_batches_is_fetched_16_mib_ahead(cap) -> None:
    # NOTE [ Fetching ahead ]: the work of a fetch is per call; batches of
    # 768 KB take 16 batches' worth ahead (4 under a memory cap, which counts
    # them among its batches).
    from kfeed.loader.tuning import FETCH_AHEAD, FETCH_AHEAD_MOST

    source = CountingSource(blocks(0, 64 * 400))
    with Loader(None, "memory", SCHEMA, 256, source=source, device="cpu", until="end",
                max_memory_bytes=cap) as loader:
        assert sum(batch.size for batch in loader) == 64 * 400
        assert loader._pool.slots[0].nbytes < 1 << 20
    ahead = FETCH_AHEAD if cap else FETCH_AHEAD_MOST
    assert max(n for n, _timeout, _given in source.asked) == (1 + ahead) * 256 // 64


def test_a_fetch_ahead_of_large_variable_length_rows_stays_within_16_mib() -> None:
    # A jagged batch's slot starts small, and grows to its records: sized by
    # the slot, a fetch took 16 batches ahead of 2.5 MB batches, 540 messages
    # (41 MiB), before the slots had grown.
    from kfeed.loader.tuning import FETCH_AHEAD_BYTES

    tokens = kfeed.Schema({"tokens": ("int32", (None,))})
    values = [tokens.encode_raw({"tokens": [np.full(20000, i, np.int32)]})[0]
              for i in range(600)]
    source = CountingSource(values)
    with Loader(None, "memory", tokens, 32, source=source, device="cpu", until="end",
                format="raw") as loader:
        assert sum(batch.size for batch in loader) == 600
    most = max(n for n, _timeout, _given in source.asked)
    assert most * len(values[0]) <= FETCH_AHEAD_BYTES + 32 * len(values[0]), most


def test_a_decode_is_given_no_more_messages_than_the_slot_has_rows_left(monkeypatch) -> None:
    # One record a message, fetched 16 batches ahead: each batch's decode was
    # handed every pending message (4,352), and looked at them all, so Protobuf
    # events from memory ran at 0.75x the speed they had with 4 batches ahead.
    given: list[int] = []
    decode_into = kfeed.Schema.decode_into

    def counting(self, values, *args, **kwargs):
        given.append(len(values))
        return decode_into(self, values, *args, **kwargs)

    monkeypatch.setattr(kfeed.Schema, "decode_into", counting)
    values = SCHEMA.encode_raw(synthetic_columns(np.arange(20 * 256)))
    with Loader(None, "memory", SCHEMA, 256, source=CountingSource(values), device="cpu",
                until="end", format="raw") as loader:
        ids = np.concatenate([batch["id"].numpy().copy() for batch in loader])
    np.testing.assert_array_equal(ids, np.arange(20 * 256))
    assert max(given) <= 256, given


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(buffer=1000, seed=0)],
                         ids=["in order", "shuffled"])
def test_a_bounded_read_never_waits_for_records_past_its_end(shuffle) -> None:
    # A consume() that asks for more messages than the window still holds
    # waits out its whole timeout (100 ms against Kafka) for them: the
    # fetch of the last messages asks for those alone.
    waited = []
    # Where the last fetch falls depends on how many messages are left.
    for n in range(30, 50):
        for values, records in (({0: blocks(0, 64 * n), 1: blocks(64 * n, 50 * 23, 50), 2: []},
                                 64 * n + 50 * 23), (blocks(0, 64 * n), 64 * n)):
            source = CountingSource(values)
            with Loader(None, "memory", SCHEMA, 256, source=source, device="cpu",
                        until="end", shuffle=shuffle) as loader:
                assert sum(batch.size for batch in loader) == records
            waited += [asked for asked, timeout, given in source.asked if timeout > 0 and not given]
    assert waited == []


def test_errors_in_the_thread_reach_the_caller() -> None:
    class Broken(kfeed.MemorySource):
        def consume(self, max_messages: int, timeout: float) -> list:
            raise OSError("disk on fire")

    loader = Loader(None, "memory", SCHEMA, 32, source=Broken([]), device="cpu")
    with pytest.raises(kfeed.LoaderError, match="disk on fire"):
        next(loader)
    loader.close()


def test_memory_stays_flat_over_a_long_stream() -> None:
    import tracemalloc

    with memory_loader(blocks(0, 4096), SCHEMA, 256, loop=True, device="cpu") as loader:
        for _ in range(50):
            next(loader)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(400):
            next(loader)
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
    # 400 batches are 300+ MB of samples; what stays behind must not scale with them.
    assert grown < 2 << 20


def test_bfloat16_comes_out_as_torch_bfloat16() -> None:
    schema = kfeed.Schema({"x": ("bfloat16", (3,))})
    x = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)
    with memory_loader(schema.encode_blocks({"x": x}), schema, 4, until="end",
                       device="cpu") as loader:
        batch = next(loader)
    assert batch["x"].dtype == torch.bfloat16 and torch.equal(batch["x"], x)


def test_kafka_iterable_dataset_under_a_torch_dataloader() -> None:
    source = kfeed.MemorySource(blocks(0, 640, 64))
    dataset = kfeed.KafkaIterableDataset({}, "memory", SCHEMA, 128, source=source, until="end")
    batches = list(torch.utils.data.DataLoader(dataset, batch_size=None))
    ids = torch.cat([b["id"] for b in batches]).numpy()
    assert np.array_equal(np.sort(ids), np.arange(640))
    # Another output: the DataLoader made numpy batches tensors again, and its
    # collate met JAX arrays and Arrow batches with a TypeError of its own.
    for output in ("numpy", "jax", "arrow"):
        with pytest.raises(kfeed.ConfigError, match=f"^KafkaIterableDataset yields torch "
                           f"batches, .* iterate kfeed.Loader\\(..., output='{output}'\\) "
                           f"directly$"):
            kfeed.KafkaIterableDataset({}, "memory", kfeed.Schema({"x": ("float32", (2,))}),
                                       128, source=source, output=output)
        # Said first: an int64 field under JAX asked for 64-bit types, and
        # pack= under Arrow for another output, before this refused them too.
        for kwargs in ({}, {"pack": kfeed.Pack(16, eos_id=0)}):
            schema = kfeed.Schema({"t": ("int64", (None,) if kwargs else ())})
            with pytest.raises(kfeed.ConfigError, match="^KafkaIterableDataset yields torch"):
                kfeed.KafkaIterableDataset({}, "memory", schema, 4, source=source,
                                           output=output, **kwargs)
    with pytest.raises(kfeed.ConfigError, match="^output must be one of 'torch', "):
        kfeed.KafkaIterableDataset({}, "memory", SCHEMA, 4, source=source, output="tf")


def test_a_dataset_closed_commits_no_batch_it_made_and_did_not_see_trained() -> None:
    # Closing the generator (a worker whose parent died, a DataLoader dropped)
    # closed the loader first with its default: the batch in hand, which a
    # worker had made and never handed over, was committed, and lost.
    source = kfeed.MemorySource(blocks(0, 640, 64))
    dataset = kfeed.KafkaIterableDataset({}, "memory", SCHEMA, 64, source=source,
                                         until="end", commit_interval_ms=0)
    it = iter(dataset)
    first, second = next(it), next(it)
    it.close()
    # The first batch's step was over when the second was asked for; the second's
    # is not known to be: it is read again.
    assert source.committed_positions[("memory", 0)] == second.offsets[("memory", 0)][0]
    assert first.offsets[("memory", 0)][1] == second.offsets[("memory", 0)][0]


def test_a_dataset_without_a_group_is_refused_when_made_not_in_a_worker() -> None:
    # It was said by each worker, wrapped in torch's "Caught ConfigError in
    # DataLoader worker process 0" and its traceback.
    with pytest.raises(kfeed.ConfigError, match="^kafka_config needs 'group.id'"):
        kfeed.KafkaIterableDataset({"bootstrap.servers": "127.0.0.1:9"}, "t", SCHEMA, 64)


def test_a_loader_pickled_says_what_to_do_instead() -> None:
    # TypeError: cannot pickle '_thread.RLock' object.
    with memory_loader(blocks(0, 64), SCHEMA, 32, until="end", device="cpu") as loader:
        with pytest.raises(kfeed.ConfigError, match="^a Loader holds a Kafka consumer and a "
                                                    "thread, which no pickle carries"):
            pickle.dumps(loader)


def test_a_loader_given_to_a_dataloader_says_what_to_give_it() -> None:
    # TypeError: object of type 'Loader' has no len(), from torch's sampler.
    with memory_loader(blocks(0, 64), SCHEMA, 32, until="end", device="cpu") as loader:
        with pytest.raises(TypeError, match="^a Loader is a stream of whole batches, with no "
                                            "length: .* kfeed.KafkaIterableDataset"):
            list(torch.utils.data.DataLoader(loader))
        assert loader  # still a loader, whole
        assert [b.size for b in list(loader)] == [32, 32]  # list() takes no length


def test_a_given_source_in_dataloader_workers_of_a_group_is_refused() -> None:
    # Each worker read the whole source: every record once per worker.
    parts = {0: blocks(0, 300, 30), 1: blocks(300, 300, 30)}
    dataset = kfeed.KafkaIterableDataset({}, "memory", SCHEMA, 100, until="end",
                                         source=kfeed.MemorySource(parts))
    with pytest.raises(kfeed.ConfigError, match="a given source in 2 DataLoader workers is read "
                                                "whole by each .* pass assignment='static'"):
        list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         multiprocessing_context="spawn"))


def test_dataloader_workers_deal_out_static_partitions_and_see_set_epoch() -> None:
    # Static assignment: each worker of a rank reads its own share (every
    # worker read every partition, 1,200 records of 600). Persistent workers
    # got the dataset once: set_epoch must still reach them (they replayed
    # epoch 0's order every epoch).
    parts = {0: blocks(0, 300, 30), 1: blocks(300, 300, 30)}
    dataset = kfeed.KafkaIterableDataset({}, "memory", SCHEMA, 100, until="end",
                                         source=kfeed.MemorySource(parts), assignment="static")
    ids = torch.cat([b["id"] for b in torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")]).tolist()
    assert sorted(ids) == list(range(600))

    def orders(workers: int) -> list[list[int]]:
        ds = kfeed.KafkaIterableDataset({}, "memory", SCHEMA, 50, start="earliest",
                                        until={("memory", 0): 20}, epochs=3,
                                        source=kfeed.MemorySource(blocks(0, 200, 10)),
                                        shuffle=kfeed.Shuffle(64, seed=1))
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
            multiprocessing_context="spawn" if workers else None)
        out = []
        for epoch in range(3):
            ds.set_epoch(epoch)
            out.append(torch.cat([b["id"] for b in loader]).tolist())
        return out

    alone, persistent = orders(0), orders(1)
    assert persistent == alone and alone[0] != alone[1] != alone[2]
    assert pickle.loads(pickle.dumps(dataset)).epoch == 0  # a plain copy still pickles


@pytest.mark.parametrize("window", [{"until": {("memory", 7): 1}},
                                    {"start": {("memory", 7): 9}, "until": "end"},
                                    {"start": "earliest", "until": {("memory", 2): 5}, "epochs": 2}])
def test_a_window_naming_a_partition_the_topic_lacks_is_refused(window) -> None:
    # A typo'd partition in start= or until= was ignored: the loader read the
    # whole topic.
    loader = memory_loader({0: blocks(0, 40, 4), 1: blocks(40, 40, 4)}, SCHEMA, 8,
                           device="cpu", **window)
    tp = next(iter(window["until"] if isinstance(window["until"], dict) else window["start"]))
    name = "until" if isinstance(window["until"], dict) else "start"
    with loader, pytest.raises(kfeed.ConfigError, match=re.escape(
            f"{name}: {tp!r} is not a partition of memory, which has 2 (0..1)")):
        next(iter(loader))


def test_an_until_offset_past_the_end_stops_at_the_end_and_says_so(caplog) -> None:
    # The read waited there for ever, holding its last records back; against a
    # broker it then read records written after it began.
    import logging

    loader = memory_loader({0: blocks(0, 200, 64), 1: blocks(200, 200, 64)}, SCHEMA, 64,
                           until={("memory", 0): 1000, ("memory", 1): 2}, device="cpu")
    with caplog.at_level(logging.WARNING, logger="kfeed.loader"), loader:
        ids = collect(loader)
    assert sorted(ids.tolist()) == list(range(200)) + list(range(200, 328))
    assert [r.getMessage() for r in caplog.records if "until=" in r.getMessage()] == [
        "until= names offset 1000 of memory[0], which ends at 4 now: the read stops there "
        "(records written later are not read)"]


def test_a_start_offset_past_the_end_or_after_until_is_refused() -> None:
    # Past the end, librdkafka's reset started at offset 0, before the window, in
    # silence (a stream read ids 0..99 for start 500); with until= it read nothing.
    values = {0: blocks(0, 200, 64), 1: blocks(200, 200, 64)}  # 4 messages each
    for window, line in (
            ({"start": {("memory", 0): 9}},
             "start= names offset 9 of memory[0], past its end (4; it holds 0..3): give an "
             "offset up to 4"),
            ({"start": {("memory", 1): 3}, "until": {("memory", 1): 2}},
             "until= names offset 2 of memory[1], before its start= offset 3: the window "
             "would hold nothing")):
        loader = memory_loader(values, SCHEMA, 8, device="cpu", **window)
        with loader, pytest.raises(kfeed.ConfigError, match=f"^{re.escape(line)}$"):
            next(iter(loader))
    # Numpy's integers name partitions and offsets as ints do; the end itself is a start.
    loader = memory_loader(values, SCHEMA, 64, device="cpu", until="end",
                           start={("memory", np.int64(0)): np.int64(2), ("memory", 1): 4})
    with loader:
        assert sorted(collect(loader).tolist()) == list(range(128, 200))


def test_a_dataset_of_epochs_refuses_a_window_each_epoch_would_end_anew() -> None:
    # Each epoch's loader stopped at the end it found: records written between
    # epochs were in the later ones only ([100, 150] records a partition).
    from datetime import datetime, timedelta, timezone

    values = {0: blocks(0, 200, 64), 1: blocks(200, 200, 64)}  # 4 messages each
    ends = {("memory", 0): 4, ("memory", 1): 4}
    for until, line in (
            ({**ends, ("memory", 1): 9},
             "until= names offset 9 of memory[1], past its end (4): with epochs=, each epoch "
             "of a KafkaIterableDataset opens a new loader, which would stop at the end it "
             "finds; give offsets up to the ends"),
            (datetime.now(timezone.utc) + timedelta(hours=1), "is in the future: with epochs=")):
        dataset = kfeed.KafkaIterableDataset({}, "memory", SCHEMA, 64, start="earliest",
                                             until=until, epochs=2,
                                             source=kfeed.MemorySource(values))
        with pytest.raises(kfeed.ConfigError, match=re.escape(line)):
            list(dataset)
    dataset = kfeed.KafkaIterableDataset({}, "memory", SCHEMA, 64, start="earliest",
                                         until=ends, epochs=2, source=kfeed.MemorySource(values))
    assert sum(len(b["id"]) for b in dataset) == 400


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(buffer=128, seed=0)],
                         ids=["in order", "shuffled"])
def test_a_slow_caller_does_not_make_the_pending_messages_grow(shuffle) -> None:
    # A full queue polled the consumer every 0.1 s, each poll taking a message:
    # with a step longer than that, the pending messages grew for as long as
    # the backlog lasted (240 in a minute, past max_memory_bytes too).
    from kfeed.loader.fetch import HOLD_S

    source = CountingSource(blocks(0, 64 * 300))  # a message a batch
    pending = []
    with Loader(None, "memory", SCHEMA, 64, source=source, device="cpu", until="end",
                prefetch=2, shuffle=shuffle) as loader:
        ids = []
        f = loader._fetcher
        for i, batch in enumerate(loader):
            ids += batch["id"].tolist()
            # Slow for 28 steps, and shuffled until the thread paused (on a loaded
            # machine its hold came after the 28th step once, so seen after 100).
            if i < 28 or (shuffle is not None and i < 100 and not paused_in(source)):
                time.sleep(0.25)  # 2.5 polls a step, before
                pending.append(len(f.msgs) - f.i)
        assert not getattr(f, "held", None)  # resumed once the caller took batches faster
    assert sorted(ids) == list(range(64 * 300))  # nothing lost or repeated
    # No more than one fetch takes (a batch, and what it takes ahead).
    assert max(pending) <= max(n for n, _timeout, _given in source.asked), pending
    # Shuffled, the thread makes batches from the records it holds: the pending
    # messages stay at what one fetch took, no poll comes for HOLD_S, and it
    # polls for events alone, all paused (what it asked gave nothing). In
    # order, each batch takes a pending message, and a poll takes its place.
    assert paused_in(source) or shuffle is None, source.asked
    assert 28 * 0.25 > 2 * HOLD_S


def paused_in(source: CountingSource) -> bool:
    """Whether the loader's thread polled ``source`` for events alone, every partition
    paused (asked for one message, given none)."""
    return any(n == 1 and given == 0 for n, _timeout, given in list(source.asked))


def test_a_window_of_times_says_what_it_will_read(caplog) -> None:
    # until= a time ahead ended at the topic's end without a word (a map past
    # the end said so); until= before start= read nothing without a word (two
    # maps so are a ConfigError).
    from datetime import datetime, timedelta, timezone

    now = datetime.now(timezone.utc)
    values = {0: blocks(0, 200, 64), 1: blocks(200, 200, 64)}
    with caplog.at_level("WARNING", logger="kfeed"):
        loader = Loader(None, "memory", SCHEMA, 64, source=kfeed.MemorySource(values),
                        device="cpu", start="earliest", until=now + timedelta(hours=1))
        with loader:
            assert sum(b.size for b in loader) == 400
    said = [r.getMessage() for r in caplog.records if "is 3600 s ahead" in r.getMessage()
            or "is 3599 s ahead" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        "the read stops at each partition's end now (the window is resolved once, at the "
        "start: records written later are not read); leave until= out to go on streaming"), said
    with pytest.raises(kfeed.ConfigError, match=re.escape(
            f"until={(now - timedelta(days=1)).isoformat()} is not after start="
            f"{now.isoformat()}: the window would hold nothing")):
        Loader(None, "memory", SCHEMA, 64, source=kfeed.MemorySource(values), device="cpu",
               start=now, until=now - timedelta(days=1))


def test_two_threads_reading_one_loader_both_end_with_stop_iteration() -> None:
    # The thread that did not take the end found the loader's thread gone and
    # the queue empty: "the loader thread stopped without a reason" (a race:
    # 1 to 3 runs of 5 before).
    # And two next() at once marked one batch used twice: an AttributeError inside
    # kfeed (6 runs of 20), and a final commit short of what was handed out (3).
    values = {0: blocks(0, 25_000, 64), 1: blocks(25_000, 25_000, 64)}
    for run in range(10):
        source = kfeed.MemorySource(values)
        loader = Loader(None, "memory", SCHEMA, 32, source=source, until="end", device="cpu",
                        shuffle=kfeed.Shuffle(500, seed=0) if run % 2 else None)
        ids: list[list[int]] = [[], []]
        errors: list[BaseException] = []

        def read(k: int, loader: Loader = loader, ids: list = ids) -> None:
            try:
                for batch in loader:
                    ids[k] += batch["id"].tolist()
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)

        threads = [threading.Thread(target=read, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        loader.close()
        assert errors == [] and sorted(ids[0] + ids[1]) == list(range(50_000))
        assert source.committed_positions == {("memory", p): (len(values[p]), 0)
                                              for p in (0, 1)}, run


@pytest.mark.parametrize("until", ["end", None])
def test_after_an_error_of_the_loaders_thread_next_raises_never_ends(until) -> None:
    # A caller that logged the DecodeError and went on was told StopIteration:
    # a read that failed looked like one that had ended, a stream too.
    values = blocks(0, 1000, 37)
    values.insert(10, b"\x00garbage, not a kfeed block")
    loader = memory_loader(values, SCHEMA, 50, until=until, device="cpu",
                           on_bad_record="raise")
    with pytest.raises(kfeed.DecodeError, match="offset=10"):
        for _ in loader:
            pass
    for _ in range(2):
        with pytest.raises(kfeed.LoaderError, match=r"^the loader stopped at an error an "
                           r"earlier next\(\) raised \(bad record: .*offset=10\)\): open a new "
                           r"loader to read on, from the last state_dict\(\) or the group's "
                           r"commits$"):
            next(loader)
    loader.close()


@pytest.mark.parametrize("edit, says", [
    ({"memory": {0: "12"}}, "position '12' of 'memory' partition 0 is not"),  # read as (1, 2)
    ({"memory": {0: 12}}, "position 12 of 'memory' partition 0 is not"),  # TypeError
    ({"memory": {"zero": [1, 27]}}, "position [1, 27] of 'memory' partition 'zero' is not"),
    ({"memory": {0: [1, -1]}}, "position [1, -1] of 'memory' partition 0 is not"),
    ([["memory", 0, 1, 27]], "its positions are list, not {topic: {partition: "),
])
def test_a_damaged_state_is_refused_never_read_from_another_place(edit, says) -> None:
    loader = memory_loader(blocks(0, 300, 37), SCHEMA, 64, until="end", device="cpu")
    next(loader)
    state = {**loader.state_dict(), "positions": edit}
    loader.close()
    again = memory_loader(blocks(0, 300, 37), SCHEMA, 64, until="end", device="cpu")
    with pytest.raises(kfeed.ConfigError, match="^not a kfeed loader state: " + re.escape(says)):
        again.load_state_dict(state)
    with pytest.raises(kfeed.ConfigError, match="^not a kfeed loader state: " + re.escape(says)):
        Loader.merge_states([state])
    again.close()


def test_a_state_of_other_topics_is_refused() -> None:
    # It was taken in silence: the loader read from the start, as if no state.
    def loader(topic: str, topics: list[str] | None = None) -> Loader:
        return Loader(None, topics or topic, SCHEMA, 100, until="end", device="cpu",
                      source=kfeed.MemorySource({0: blocks(0, 1000)}, topic=topic))

    old = loader("clicks-v1")
    next(iter(old))
    state = old.state_dict()
    old.close()
    new = loader("clicks-v2")
    with pytest.raises(kfeed.ConfigError, match=re.escape(
            "the state was saved by a loader of topics ['clicks-v1']; this one reads "
            "['clicks-v2'], without ['clicks-v1']")):
        new.load_state_dict(state)
    new.close()
    more = loader("clicks-v1", ["clicks-v1", "clicks-v2"])  # a topic added: its state holds
    more.load_state_dict(state)
    more.close()


def test_static_ranks_more_than_partitions_all_refuse() -> None:
    # Only the ranks left without a partition raised; the others read on,
    # towards collectives their peers would never join.
    values = {0: blocks(0, 40, 4), 1: blocks(40, 40, 4)}
    for rank in range(3):
        loader = memory_loader(values, SCHEMA, 8, device="cpu", until="end", rank=rank,
                               world_size=3, assignment="static")
        with loader, pytest.raises(kfeed.ConfigError, match=re.escape(
                "the topics have 2 partitions, fewer than the 3 readers")):
            next(iter(loader))


def test_a_datasets_epochs_refuse_an_until_that_leaves_a_partition_to_its_end_now() -> None:
    # Each epoch of a KafkaIterableDataset is a new loader: a partition until=
    # does not name ended where its end was at that epoch's start, so records
    # written between the epochs made them read different windows.
    source = kfeed.MemorySource({0: blocks(0, 40, 8), 1: blocks(40, 40, 8)})
    ds = kfeed.KafkaIterableDataset(None, "memory", SCHEMA, 8, source=source, start="earliest",
                                    until={("memory", 0): 3}, epochs=2)
    with pytest.raises(kfeed.ConfigError, match=re.escape(
            "name every partition (1 missing, e.g. ('memory', 1)), or give until= a datetime")):
        next(iter(ds))
    whole = kfeed.KafkaIterableDataset(None, "memory", SCHEMA, 8, source=source,
                                       start="earliest", epochs=2,
                                       until={("memory", 0): 3, ("memory", 1): 2})
    epochs = []
    for epoch in range(2):
        whole.set_epoch(epoch)
        epochs.append(sorted(torch.cat([b["id"] for b in whole]).tolist()))
    assert epochs[0] == epochs[1] == list(range(24)) + list(range(40, 56))


@pytest.mark.parametrize("fmt", ["raw", "block"])
@pytest.mark.parametrize("kwargs", [
    {"shuffle": kfeed.Shuffle(4, seed=1)},
    {"schema": kfeed.Schema({"x": ("int64", (None,))})},                       # jagged
    {"schema": kfeed.Schema({"x": ("int64", (None,))}), "pack": kfeed.Pack(8, eos_id=0)},
])
def test_a_partition_read_to_its_end_is_committed_at_its_end(fmt, kwargs) -> None:
    # Read through the order (shuffle, documents), the end was committed as
    # (last offset, its records): Kafka's committed offset one short of the
    # end, so `kfeed lag` and the lag metric showed 1 forever.
    kwargs = dict(kwargs)
    schema = kwargs.pop("schema", kfeed.Schema({"x": ("int64", ())}))
    cols = {"x": [np.arange(1, 3 + i % 3) for i in range(16)] if schema.varlen
            else np.arange(16)}
    values = schema.encode_raw(cols) if fmt == "raw" else schema.encode_blocks(cols, 8)
    source = kfeed.MemorySource({0: values})
    with Loader(None, "memory", schema, 2, source=source, until="end", device="cpu",
                format=fmt, **kwargs) as loader:
        for _ in loader:
            pass
    assert source.committed_positions == {("memory", 0): (len(values), 0)}


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(4, seed=1)])
def test_a_mixture_read_to_its_end_is_committed_at_the_ends(shuffle) -> None:
    schema = kfeed.Schema({"x": ("int64", ())})
    values = {("a", 0): schema.encode_blocks({"x": np.arange(16)}, 8),
              ("b", 0): schema.encode_blocks({"x": np.arange(10)}, 4)}
    source = kfeed.MemorySource(values)
    mix = kfeed.Mix({"a": 1.0, "b": 1.0}, exhausted="renormalize")
    with Loader(None, mix, schema, 2, source=source, until="end", device="cpu",
                shuffle=shuffle) as loader:
        assert sum(b.size for b in loader) == 26
    assert source.committed_positions == {("a", 0): (2, 0), ("b", 0): (3, 0)}


def test_state_holds_partitions_with_nothing_handed_out_yet() -> None:
    # A partition with no batch yet must be in the state at its start
    # position; otherwise a resume would take the committed offset, which
    # may have moved past the checkpoint.
    source = kfeed.MemorySource({0: blocks(0, 640), 1: blocks(640, 640)})
    loader = Loader(None, "memory", SCHEMA, 64, source=source, device="cpu")
    batch = next(loader)
    positions = loader.state_dict()["positions"]["memory"]
    assert set(positions) == {0, 1}
    (tp,) = batch.offsets
    other = 1 - tp[1]
    assert positions[other] == [0, 0]
    loader.close()


def test_fetch_scan_groups_runs_drops_past_the_end_and_sets_errors_aside() -> None:
    # The fetch stage's one pass in C, on confluent-kafka's own Message objects.
    from confluent_kafka import KafkaError, Message

    from kfeed import _fetch

    def msg(p: int, off: int, topic: str = "a") -> Message:
        return Message(topic=topic, partition=p, offset=off, value=b"x" * off)

    eof = Message(topic="a", partition=1, offset=3, error=KafkaError(KafkaError._PARTITION_EOF))
    msgs = [msg(0, 0), msg(0, 1), msg(1, 0), eof, msg(1, 1), msg(0, 2), msg(0, 3),
            msg(0, 0, "b"), msg(1, 2), msg(1, 3)]
    keep, vals, runs, errors, done = _fetch.scan(msgs, None)
    assert [(m.partition(), m.offset()) for m in keep] == \
        [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (0, 0), (1, 2), (1, 3)]
    assert vals == [m.value() for m in keep]
    assert runs == [(0, 2, ("a", 0)), (2, 4, ("a", 1)), (4, 6, ("a", 0)), (6, 7, ("b", 0)),
                    (7, 9, ("a", 1))]
    assert errors == [(eof, eof.error())] and done == []
    # A bounded epoch: partition a[0] ends at offset 3, a[1] at 2.
    keep, _vals, runs, _errors, done = _fetch.scan(msgs, {("a", 0): 3, ("a", 1): 2})
    assert [(m.topic(), m.partition(), m.offset()) for m in keep] == \
        [("a", 0, 0), ("a", 0, 1), ("a", 1, 0), ("a", 1, 1), ("a", 0, 2), ("b", 0, 0)]
    assert runs == [(0, 2, ("a", 0)), (2, 4, ("a", 1)), (4, 5, ("a", 0)), (5, 6, ("b", 0))]
    assert set(done) == {("a", 0), ("a", 1)}
    assert _fetch.value_bytes(vals, 1, 5) == 1 + 0 + 1 + 2
    assert _fetch.value_bytes([b"ab", None, bytearray(3)], 0, 9) == 5
    assert _fetch.partitions(msgs + [Message(partition=-1)]) == {("a", 0), ("a", 1), ("b", 0)}


@pytest.mark.parametrize("pack", [None, kfeed.Pack(seq_len=64, eos_id=0)])
def test_what_a_shuffle_holds_is_counted_and_let_go_at_the_end(pack):
    if pack is None:
        schema = kfeed.Schema({"id": ("int64", ()), "x": ("float32", (30,))})
        values = schema.encode_blocks({"id": np.arange(5000),
                                       "x": np.zeros((5000, 30), np.float32)}, 50)
    else:
        schema = kfeed.Schema({"tokens": ("int32", (None,))})
        docs = [np.arange(1, 1 + (i % 40), dtype=np.int32) for i in range(3000)]
        values = schema.encode_blocks({"tokens": docs}, 50)
    with memory_loader(values, schema, 8, device="cpu", until="end", pack=pack,
                       shuffle=kfeed.Shuffle(buffer=1000, seed=1)) as loader:
        it = iter(loader)
        next(it)
        held = loader.stats()["held_bytes"]
        # The buffer's records at the least (128 bytes each; documents 4 bytes a token),
        # in their message values, and no more than the values there are.
        assert 1000 * (128 if pack is None else 4) <= held <= sum(len(v) for v in values)
        for _ in it:
            pass
        assert loader.stats()["held_bytes"] == 0
