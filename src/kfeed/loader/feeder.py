"""The loader's thread: fetch, build, copy, hand over, until stopped.

``Feeder.run`` is the whole loop of the thread named ``kfeed-loader``: take
a free pool slot, let the build stage fill it from the fetch stage, issue
its copy to the device (on the CPU: lend its tensors to the caller), and put it in
the ready queue. The queue holds at most ``prefetch`` batches; the thread
polls the consumer while it waits (see ``Fetcher.serve``). How it stops is
NOTE [ Loader Shutdown Logic ] in ``kfeed/loader/__init__.py``.

The thread holds no reference to the ``Loader``, so a loader dropped
without ``close()`` is still garbage-collected.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any

from kfeed.badrecords import BadRecords
from kfeed.device import DeviceCopier
from kfeed.errors import ConsumeError
from kfeed.loader.build import SlotBuilder
from kfeed.loader.fetch import POLL_S, Fetcher, Status
from kfeed.loader.ledger import Ledger
from kfeed.pool import BufferPool
from kfeed.sources import TP, Position

__all__ = ["Feeder", "Failure", "END"]

log = logging.getLogger("kfeed.loader")

END = object()  # the end of a bounded epoch, after its last batch

# How long a revoke waits for the caller's step to end, with no on_revoke hook
# (NOTE [ A revoke waits for the step ]).
REVOKE_WAIT_S = 10.0


class Ready:
    """The batches ready for the caller: at most ``size``, first in first out.

    ``queue.Queue`` makes a Python condition wait per blocked call, 15 us a
    batch handed over with two batches ready; this is a C ``SimpleQueue`` and
    one C lock the caller releases to say there is room again, 7 us. Both
    ends wait at most the timeout they give and re-check.

    NOTE [ Room is made last ]
    ==========================
    Taking a batch does not wake the thread: ``next()`` says there is room
    only once the batch is handed out. Woken at the take, the thread took
    the GIL each time the caller's CUDA calls (the stream wait and
    ``record_stream`` of ``DeviceCopier.adopt``) let it go, and held it
    through its own Python: 60-80 us of a 2 ms step inside ``next()`` on an
    H200, where the GPU waits for every microsecond of it. Woken last, the
    thread fills the next slot while the caller launches its step, whose
    kernels queue ahead of the GPU (bench/RESULTS.md, "GPU check"). For the
    same reason the thread waits for its copy to the device before it
    queues the batch: ``next()`` then has no stream wait to make, only the
    look at the caller's current stream.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.full_count = 0  # puts that found the queue full (the tune stage reads it)
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room = threading.Lock()  # held while the thread may wait for room
        self._room.acquire()
        self._poked = False  # the next put that finds no room returns at once (poke)

    def resize(self, size: int) -> None:
        """Hold up to ``size`` items from now on (a waiting ``put`` sees it at once)."""
        self.size = size
        if self._room.locked():
            with contextlib.suppress(RuntimeError):
                self._room.release()

    def put(self, item: Any, timeout: float) -> bool:
        """Queue ``item`` once there is room; False if there is none within ``timeout``."""
        if self._items.qsize() >= self.size:
            self.full_count += 1
            if not self._poked:
                self._room.acquire(timeout=timeout)
            if self._items.qsize() >= self.size:
                self._poked = False
                return False
        self._items.put(item)
        return True

    def poke(self) -> None:
        """Have the put that waits for room, or the next one that would, return now.

        The caller asks for a synchronous commit, which the thread makes
        between puts: woken only by ``made_room``, whose one release a put
        under way may take first, it made it at its POLL_S, a tenth of a
        second on every step of ``commit_interval_ms=0``.
        """
        self._poked = True
        self.made_room()

    def get(self, timeout: float) -> Any:
        """The oldest item; raises ``queue.Empty`` if none comes within ``timeout``.

        The room it leaves is said by ``made_room``, which the caller's
        ``next()`` calls last (NOTE [ Room is made last ]).
        """
        return self._items.get(timeout=timeout)

    def made_room(self) -> None:
        """Wake the thread if it waits for room."""
        if self._room.locked():
            with contextlib.suppress(RuntimeError):  # released already: room was said
                self._room.release()

    def empty(self) -> bool:
        return self._items.empty()


class Failure:
    """An exception of the thread, on its way to the caller's ``next()``."""

    def __init__(self, exc: BaseException, where: str) -> None:
        self.exc = exc
        self.where = where


class Feeder:
    """The thread's loop, and the hand-over of the on_revoke hook to the caller."""

    def __init__(self, fetcher: Fetcher, builder: SlotBuilder, ledger: Ledger,
                 bad: BadRecords, pool: BufferPool, copier: DeviceCopier, *, prefetch: int,
                 drop_last: bool, assignment: list[TP] | None, hook_revoke: bool,
                 status: Status, stop: threading.Event) -> None:
        self.fetcher = fetcher
        self.builder = builder
        self.ledger = ledger
        self.bad = bad
        self.pool = pool
        self.copier = copier
        self.bounded = fetcher.bounded
        self.drop_last = drop_last
        self.batch_size = pool.batch_size
        self.assignment = assignment
        self.status = status
        self.ready = Ready(prefetch)
        self.stop = stop
        self.thread: threading.Thread | None = None
        self.epoch_over = False
        self.copy_s = 0.0  # issuing device copies, for metrics
        # A revoke: the thread posts the partitions, the caller gives them up
        # inside next() (after the on_revoke hook, if any) and sets revoke_done.
        self.hook_revoke = hook_revoke
        self.revoking: list[TP] | None = None
        self.revoked: dict[TP, Position] | None = None
        self.revoke_done = threading.Event()
        fetcher.before_revoke = self._wait_for_caller

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="kfeed-loader", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def run(self) -> None:
        where = "opening the source"
        try:
            self.copier.bind_thread()
            self.fetcher.open(self.assignment)
            where = "filling a batch"
            self._loop()
            if self.bounded and not self.stop.is_set():
                self.bad.end_of_read()
                self.bad.flush()
            self.epoch_over = True
            self._put(END)
        except BaseException as e:  # noqa: BLE001 - everything goes to the caller
            log.debug("the loader's thread failed while %s", where, exc_info=True)
            self.ledger.failed = True
            self._put(Failure(e, where))

    def _loop(self) -> None:
        builder, fetcher, pool = self.builder, self.fetcher, self.pool
        while not self.stop.is_set():
            self.status.doing = "waiting for a free pool slot (BufferPool.acquire)"
            slot = pool.acquire(timeout=POLL_S)
            if slot is None:
                fetcher.serve()
                continue
            out = builder.fill(slot)
            out.slot = slot
            finished = self.bounded and builder.all_done()
            if slot.rows == 0 or (finished and self.drop_last and slot.rows < self.batch_size):
                out.release(pool)
                # Messages read and all rejected (a partition's last ones, say),
                # or empty documents after the last packed batch: no batch, but
                # the ledger must move past them in turn, or they are read again
                # for ever (NOTE [ Batches of no rows ]).
                if slot.rows == 0 and (out.end or out.acks) and not self.bad.holding \
                        and not self._put(out, serve=True):
                    return
                if finished or self.stop.is_set():
                    return
                continue
            out.rows = slot.rows
            if self.copier.cuda:
                # Issued here, the copy overlaps the caller's current step. The
                # thread waits for it (without the GIL), so that next() has no
                # stream wait to make (NOTE [ Room is made last ]).
                t = time.monotonic()
                out.tensors, event, out.recorded = self.copier.copy(slot)
                event.synchronize()
                self.copy_s += time.monotonic() - t
                out.release(pool)
            else:  # the slot's own tensors go to the caller
                out.tensors = pool.lend(slot)
                out.slot = None
            if not self._put(out, serve=True):
                return
            fetcher.serve_if_due()  # batches made from records held: no fetch for a while
            # A rebalance while the batch waited for room (the consumer is
            # served meanwhile) may have given records back to read: then
            # the epoch is not over yet, whatever it looked like before.
            if finished and out.gen == self.ledger.gen:
                return

    def _put(self, item: Any, serve: bool = False) -> bool:
        """Queue ``item``; meanwhile poll the consumer (``serve``), or at least make commits.

        The caller's ``next()`` may wait for a synchronous commit, which only
        this thread makes, before it takes from the queue: a thread waiting
        for room with the epoch's end or a failure makes it too.
        """
        self.status.doing = "queueing a batch for the caller"
        while not self.stop.is_set():
            if self.ready.put(item, timeout=POLL_S):
                return True
            if serve:
                self.fetcher.serve()
            else:
                self.fetcher.commit_asked()
        return False

    def _wait_for_caller(self, tps: list[TP]) -> dict[TP, Position] | None:
        """Wait until the caller gave ``tps`` up at a step boundary: the positions given up.

        NOTE [ A revoke waits for the step ]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A revoke commits the partitions' positions, for their next owner to
        start from. Made by this thread at once, it committed what was handed
        out, the batch whose step was still running too: a trainer that then
        died never trained it, and nobody read it again. So the revoke waits
        for the caller's next ``next()`` or ``commit()`` (or its wait for a
        batch), where that step is over: the caller gives the partitions up
        there, before it can take another batch, and the commit holds every
        batch used and no other. The wait holds up the group's rebalance by a
        step at most. With an ``on_revoke`` hook the caller runs the hook
        first, and the wait has no end but ``close()``; without one, a caller
        away longer than ``REVOKE_WAIT_S`` (an evaluation, say) is not waited
        for: the thread gives the partitions up itself, the batch in hand
        counted as used.

        A ``close()`` ends the wait too. The revoke, still inside the
        consumer's rebalance, then commits what the final commit would have:
        the batches used (``close()`` marks the batch in hand used first,
        unless its step failed), not everything handed out.

        None: the revoke gives them up itself (that wait ran out).
        """
        self.revoke_done.clear()
        self.revoked = None
        with self.ledger.lock:
            self.revoking = list(tps)
        self.status.doing = ("waiting for the caller to run on_revoke" if self.hook_revoke else
                             "waiting for the caller's step to end, to give partitions up")
        deadline = None if self.hook_revoke else time.monotonic() + REVOKE_WAIT_S
        while True:
            if self.stop.is_set():
                with self.ledger.lock:
                    self.revoking = None
                return self.ledger.revoke_used(tps)
            if self.revoke_done.wait(POLL_S):
                break
            if deadline is not None and time.monotonic() > deadline:
                with self.ledger.lock:
                    if self.revoking is not None:  # not taken by the caller: not waited for
                        self.revoking = None
                        log.info("the caller did not come back within %gs: the thread "
                                 "gives %s up, the batch in hand counted as used",
                                 REVOKE_WAIT_S, sorted(tps))
                        return None
                deadline = None  # taken: the caller is giving them up now
        return self.revoked

    def take_revoking(self) -> list[TP] | None:
        with self.ledger.lock:
            tps, self.revoking = self.revoking, None
        return tps

    def revoked_by_caller(self, positions: dict[TP, Position]) -> None:
        """The caller ran the hook and gave the partitions up: the revoke goes on."""
        self.revoked = positions
        self.fetcher.revoke_committed.clear()
        self.revoke_done.set()

    def wait_revoke_committed(self, timeout: float) -> None:
        """Until the revoke whose partitions the caller gave up made its commit (a
        ``commit()`` promises every batch handed out committed, those of the
        partitions going too); not past the thread's end."""
        deadline = time.monotonic() + timeout
        while not self.fetcher.revoke_committed.wait(POLL_S):
            if self.stop.is_set() or not self.alive():
                return
            if time.monotonic() >= deadline:
                raise ConsumeError(f"the loader's thread did not make the revoke's commit "
                                   f"within {timeout:g}s; it is {self.status.doing}")
