"""The Loader's own settings: where its pool lives, how it shuts down. No broker."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import kfeed
from kfeed.sources import MemorySource
from kfeed.synthetic import synthetic_columns, synthetic_schema

SCHEMA = synthetic_schema()


def test_a_cpu_loader_never_pins_even_where_cuda_exists(monkeypatch) -> None:
    # Pinning is for the copy to a CUDA device; on a CUDA machine a
    # device="cpu" loader pinned anyway. Here CUDA is made to look present:
    # a pin would fail, so the loader must not ask for one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    values = SCHEMA.encode_blocks(synthetic_columns(np.arange(64)), 8)
    with kfeed.Loader(None, "memory", SCHEMA, 16, device="cpu", until="end",
                      source=MemorySource(values)) as ld:
        assert ld._pool.pinned is False
        assert sum(b.size for b in ld) == 64


class _StuckSource(MemorySource):
    """A source whose consume() hangs until ``release`` is set, like a call lost in Kafka."""

    def __init__(self, values) -> None:
        super().__init__(values)
        self.release = threading.Event()

    def consume(self, max_messages: int, timeout: float):
        self.release.wait(30)
        return []


def test_close_names_the_stage_a_stuck_thread_is_in() -> None:
    src = _StuckSource(SCHEMA.encode_blocks(synthetic_columns(np.arange(8)), 8))
    ld = kfeed.Loader(None, "memory", SCHEMA, 16, device="cpu", source=src, max_wait_ms=50)
    ld._start()
    deadline = time.monotonic() + 10
    while ld._status.doing != "fetching messages (Source.consume)" and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(kfeed.LoaderError) as e:
        ld.close(timeout_s=0.3)
    src.release.set()
    assert str(e.value) == ("the loader thread did not stop within 0.3s: it is stuck fetching "
                            "messages (Source.consume); the consumer was left open")
    ld._feeder.thread.join(5)
    assert not ld._feeder.thread.is_alive()


class _AsyncSource(MemorySource):
    """Asynchronous commits that the broker never answers (a coordinator gone, say)."""

    def commit(self, positions, asynchronous):
        if asynchronous:
            self.lost = getattr(self, "lost", []) + [dict(positions)]
            return {}
        return super().commit(positions, asynchronous)


def test_an_unanswered_asynchronous_commit_is_made_again_when_the_loader_closes() -> None:
    src = _AsyncSource(SCHEMA.encode_blocks(synthetic_columns(np.arange(64)), 8))
    ld = kfeed.Loader(None, "memory", SCHEMA, 16, device="cpu", source=src, until="end",
                      commit_interval_ms=0.001, prefetch=1)
    for _ in range(2):
        next(ld)
    next(ld)  # marks the second batch used: an asynchronous commit, never answered
    # The loader's thread makes it while it waits to queue the epoch's end
    # (the fourth batch fills the queue).
    # (Asked-for commits merge until that thread makes them: the newest wins.)
    deadline = time.monotonic() + 10
    while not getattr(src, "lost", None) or src.lost[-1] != {("memory", 0): (4, 0)}:
        assert time.monotonic() < deadline, getattr(src, "lost", None)
        time.sleep(0.01)
    ld.close(commit_current=False)
    # Recorded as committed only on an answer: close() commits it again,
    # synchronously (before, it counted as done and close() skipped it).
    assert src.commits == [{("memory", 0): (4, 0)}]


def test_a_commit_waits_for_the_dead_letter_copies_before_it() -> None:
    order = []

    class Recording(MemorySource):
        def settle(self):
            order.append("settle")

        def commit(self, positions, asynchronous):
            order.append("commit")
            return super().commit(positions, asynchronous)

    good = SCHEMA.encode_blocks(synthetic_columns(np.arange(32)), 8)
    src = Recording(good[:2] + [b"junk"] + good[2:])
    with kfeed.Loader(None, "memory", SCHEMA, 8, device="cpu", source=src, until="end") as ld:
        assert sum(b.size for b in ld) == 32
        ld.state_dict()
    assert order and all(order[i - 1] == "settle" for i, x in enumerate(order) if x == "commit")
    assert order[-1] == "settle" or order[-2:] == ["settle", "commit"]
    assert len(src.dead_letters) == 1


def test_a_wait_under_way_or_cut_short_counts_as_the_stall() -> None:
    # A trainer starved after its first batch showed 0% stall while next() waited,
    # and a wait a close() cut short was never counted.
    values = SCHEMA.encode_blocks(synthetic_columns(np.arange(16)), 16)
    ld = kfeed.Loader(None, "memory", SCHEMA, 16, device="cpu", source=MemorySource(values))
    next(ld)  # the only batch; the stream then has nothing new
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            next(ld)
        except kfeed.LoaderError as e:
            failed.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    during = ld.stats()
    assert during["wait_s"] >= 0.4 and during["longest_wait_s"] >= 0.4
    assert during["stall_fraction"] > 0.5
    ld.close()
    waiter.join(10)
    assert failed and "closed" in str(failed[0])
    after = ld.stats()
    assert after["wait_s"] >= during["wait_s"] and sum(after["wait_histogram"].counts) == 1


def test_a_commit_wait_cut_short_by_close_says_so_not_a_timeout() -> None:
    # close() from another thread ended the wait after 1 s with "did not make
    # the commit within 8s".
    from kfeed.loader.fetch import Commits, Status

    stop, status = threading.Event(), Status()
    status.doing = "fetching"
    commits = Commits(stop, status)
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(kfeed.ConsumeError, match="^the loader was closed before its thread "
                                                 "made the commit; it was fetching$"):
        commits.put({("t", 0): (5, 0)}, wait=True, timeout=30)
    commits = Commits(threading.Event(), status)
    with pytest.raises(kfeed.ConsumeError, match="did not make the commit within 0.2s"):
        commits.put({("t", 0): (5, 0)}, wait=True, timeout=0.2)
