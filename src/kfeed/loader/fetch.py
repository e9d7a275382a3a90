"""The fetch stage: messages from the source, in bulk, with the assignment they belong to.

``Fetcher`` runs on the loader's thread. It opens the ``Source`` (Kafka or
memory), asks it for messages about a batch's worth at a time, and keeps
the ones not yet decoded as *pending*. It follows the assignment: on an
assign it asks the ledger where each partition starts; on a revoke it drops
what it held, lets the ledger commit the positions given up, and tells the
build stage (``ledger.gen`` moves on). For a bounded epoch it knows each
partition's end at the start and pauses a partition once it got there. It
knows nothing of slots, decoding or tensors.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

from kfeed import _fetch
from kfeed.errors import ConsumeError, KfeedError
from kfeed.loader.ledger import Ledger
from kfeed.sources import TP, Position, Source

__all__ = ["Fetcher", "Status", "POLL_S", "no_revoke_hook"]

log = logging.getLogger("kfeed.loader")

POLL_S = 0.1  # the longest any wait of the loader's thread goes without looking at stop
SERVE_S = 0.5  # the longest the thread goes without polling the consumer
HOLD_S = 2.0  # a full queue and enough pending: the longest without a poll (NOTE [ Serving ])


# Messages the first fetch asks for at most (Fetcher.messages_for).
FIRST_FETCH = 4


def no_revoke_hook(_tps: list[TP]) -> None:
    """No on_revoke hook to wait for: a revoke gives the partitions up itself."""
    return None


def _is_eof(err: Any) -> bool:
    from confluent_kafka import KafkaError

    return bool(err.code() == KafkaError._PARTITION_EOF)


class Status:
    """What the loader's thread is doing now, for ``close()`` to name if it hangs."""

    __slots__ = ("doing",)

    def __init__(self) -> None:
        self.doing = "starting"


class Commits:
    """Commits the caller's thread asks for, made by the loader's thread between fetches.

    See NOTE [ One thread calls the consumer ] in ``kfeed/loader/__init__.py``.
    Asynchronous requests merge (the newest position per partition wins); a
    synchronous one waits until the loader's thread made it, and raises what
    it raised.
    """

    def __init__(self, stop: threading.Event, status: Status) -> None:
        self._lock = threading.Lock()
        self._status = status
        self._todo: dict[TP, Position] = {}
        self._waiters: list[list[Any]] = []  # [done event, error]
        self._stop = stop

    def put(self, positions: dict[TP, Position], *, wait: bool, timeout: float,
            while_waiting: Callable[[], object] | None = None,
            alive: Callable[[], bool] | None = None,
            wake: Callable[[], None] | None = None) -> bool:
        """Ask for a commit; with ``wait``, return once it is made.

        ``while_waiting`` runs every ``POLL_S`` of the wait: the caller's share
        of what the loader's thread may be waiting for meanwhile (the
        ``on_revoke`` hook), so that neither waits on the other. False when
        the thread ended without making it (``alive``: a bounded read's end,
        reached while the commit was asked): nothing asked is left queued, and
        the caller makes the commit itself. ``wake``: what has the thread look
        at the commits now if it waits for room in the ready queue (else it
        would at its next POLL_S, a tenth of a second on each step).
        """
        waiter: list[Any] = [threading.Event(), None]
        with self._lock:
            self._todo.update(positions)
            if wait:
                self._waiters.append(waiter)
        if not wait:
            return True
        if wake is not None:
            wake()
        deadline = time.monotonic() + timeout
        while not waiter[0].wait(POLL_S):
            if while_waiting is not None:
                while_waiting()
            if alive is not None and not alive():
                with self._lock:
                    if waiter[0].is_set():  # (made as it ended)
                        break
                    # Left queued, an older position could be committed by a
                    # later epoch's thread over what the caller commits now.
                    self._todo, self._waiters = {}, [w for w in self._waiters
                                                     if w is not waiter]
                return False
            if self._stop.is_set():  # close(), from another thread
                if waiter[0].is_set():  # (made meanwhile)
                    break
                raise ConsumeError(f"the loader was closed before its thread made the commit; "
                                   f"it was {self._status.doing}")
            if time.monotonic() >= deadline:
                raise ConsumeError(f"the loader's thread did not make the commit within "
                                   f"{timeout:g}s; it is {self._status.doing}")
        if waiter[1] is not None:
            raise waiter[1]
        return True

    def again(self, todo: dict[TP, Position], waiters: list[list[Any]]) -> None:
        """Put back what ``take`` gave, to be made later (newer positions win)."""
        with self._lock:
            self._todo = {**todo, **self._todo}
            self._waiters = waiters + self._waiters

    def take(self) -> tuple[dict[TP, Position], list[list[Any]]]:
        with self._lock:
            todo, waiters = self._todo, self._waiters
            self._todo, self._waiters = {}, []
        return todo, waiters


class Fetcher:
    """Pending messages, the assignment, and bounded-epoch ends."""

    def __init__(self, source: Source, ledger: Ledger, *, bounded: bool, batch_size: int,
                 status: Status, stop: threading.Event, until: Any = None) -> None:
        self.source = source
        self.commits = Commits(stop, status)
        self.ledger = ledger
        self.bounded = bounded
        # Where a bounded read ends: "end" (the high watermarks at the start),
        # a datetime (the first offset at or after it), or {tp: offset}.
        self.until = "end" if bounded and until is None else until
        self.batch_size = batch_size
        self.status = status
        self.fetch_s = 0.0    # in Source.consume, for metrics
        self.rebalances = 0   # assignments received
        # Run inside a revoke, before anything is given up (the on_revoke hook);
        # the positions given up, if it gave them up itself.
        self.before_revoke: Callable[[list[TP]], dict[TP, Position] | None] = no_revoke_hook
        # Cleared as the caller gives revoked partitions up (Feeder.revoked_by_caller),
        # set once the revoke's commit of them was made (or failed).
        self.revoke_committed = threading.Event()
        self.revoke_committed.set()
        self.assigned: set[TP] = set()
        self.ends: dict[TP, int] = {}   # bounded epoch: high watermarks at start
        self.done: set[TP] = set()      # bounded epoch: partitions read to their end
        self.read_to: dict[TP, int] = {}  # bounded epoch: the next offset of each partition
        self.skip: dict[TP, Position] = {}  # records to skip in a straddling block
        self.starts: dict[TP, Position] = {}  # partitions assigned during the current fetch
        self.fetched: set[TP] = set()  # partitions that delivered since their assignment
        self.kept: set[TP] = set()  # kept through an incremental revoke: to read again
        # An unbounded read: the partitions at their end for now (an EOF event
        # came, and no record since), with the offset it named; ``ends_seen``
        # counts its changes (a mixture lets their turns pass: kfeed.mix).
        self.at_end: dict[TP, int] = {}
        self.ends_seen = 0
        # Messages fetched and not yet decoded: msgs[i:], the first of which
        # has its first ``start`` records decoded already; ``runs`` groups
        # msgs into stretches of one partition, (start, stop, tp).
        self.msgs: list[Any] = []
        self.vals: list[Any] = []
        self.runs: list[tuple[int, int, TP]] = []
        self.i = 0
        self.start = 0
        self.records_per_msg = 1.0
        self.learned = False  # records_per_msg is a guess until the first fetch is decoded
        self.bytes_per_msg = 0.0  # of the values fetched so far (0: none yet)
        self.last_poll = time.monotonic()
        # NOTE [ Serving ]: the most messages one fetch took (what the pending
        # ones may hold), and the partitions serve() paused to poll for
        # events alone; ``kept_paused``: those a mixture paused for itself
        # (all once it ``ended``).
        self.fetch_most = 1
        self.held: set[TP] = set()
        self.kept_paused: set[TP] = set()
        self.mixer: Any = None
        # When the oldest pending message was fetched (the call's start): a
        # batch's max_wait runs from there (SlotBuilder.fill).
        self.pending_since = self.last_poll

    # -- opening ------------------------------------------------------------

    def open(self, assignment: list[TP] | None) -> None:
        if self.bounded or self.ledger.cover_all:
            # Here, not inside a callback of consume(): librdkafka aborts on a
            # poll made from within one, and listing topics polls.
            self.status.doing = "reading the topics' partitions"
            self.ledger.partitions = self.source.partitions()
        if self.bounded:
            self.status.doing = "reading where the window ends"
            self.ends.update(self.ends_of(self.ledger.partitions))
        self.status.doing = "opening the source"
        self.source.open(self.on_assign, self.on_revoke, assignment)

    # -- assignment (inside the source's callbacks, on the loader's thread) ---

    def on_assign(self, tps: list[TP]) -> dict[TP, Position]:
        self.rebalances += 1
        positions = self.ledger.positions(tps, self.assigned | set(tps))
        self._starting(positions)
        self.starts.update(positions)
        self.assigned.update(tps)
        self.fetched.difference_update(tps)
        self._not_at_end(tps)
        done_now = [tp for tp in tps if tp in self.done]
        if done_now:
            self.source.pause(done_now)
        log.info("assigned %s at %s", sorted(tps), positions)
        return positions

    def _starting(self, positions: dict[TP, Position]) -> None:
        """Partitions (re)start at ``positions``: a straddled block, a bounded epoch's end."""
        for tp, (off, skip) in positions.items():
            if skip:
                self.skip[tp] = (off, skip)
            else:
                self.skip.pop(tp, None)
            if self.bounded:
                self.read_to[tp] = off
                end = self.ends.get(tp)
                if end is None:  # a partition added after the epoch began
                    end = self.ends[tp] = self.ends_of([tp])[tp]
                if off >= end:
                    self.done.add(tp)
                else:  # back after a rebalance, with records left to read
                    self.done.discard(tp)

    def ends_of(self, tps: list[TP]) -> dict[TP, int]:
        """Where the window ends in each of ``tps``, resolved now (once per partition)."""
        until = self.until
        if isinstance(until, datetime):
            return self.source.offsets_for_time(tps, until)
        out = {}
        for tp in tps:
            end = self.source.watermarks(tp)[1]  # "end", or a partition the map does not name
            if isinstance(until, Mapping) and tp in until:
                if until[tp] > end:
                    # Past the end: the read would wait there for records
                    # written later, which a window does not read.
                    log.warning("until= names offset %d of %s[%d], which ends at %d now: "
                                "the read stops there (records written later are not read)",
                                until[tp], tp[0], tp[1], end)
                end = min(end, until[tp])
            out[tp] = end
        return out

    def _restart(self, kept: set[TP]) -> None:
        """After an incremental revoke: read the partitions kept again from the ledger's positions.

        The revoke dropped every batch not handed out, and every pending
        message, of all partitions; under an eager protocol each partition is
        assigned again and starts where the ledger says, but the partitions
        an incremental rebalance leaves in place go on fetching from where
        they were. So they are sought back. Only those that delivered
        messages since their assignment (so librdkafka's fetcher runs and a
        seek holds); the others are still where they were assigned.
        """
        positions = self.ledger.positions(sorted(kept), self.assigned)
        self._starting(positions)
        moved = {tp: pos for tp, pos in positions.items() if tp in self.fetched}
        if moved:
            self.source.seek(moved)
        self._not_at_end(moved)  # (the others are where they were: their ends stand)
        again = [tp for tp in kept if tp not in self.done]
        self.source.resume(again)
        self.source.pause([tp for tp in kept if tp in self.done])
        log.info("kept %s, read again from %s", sorted(kept), positions)

    def on_revoke(self, tps: list[TP]) -> None:
        # Batches not yet handed out are dropped: their records will be read
        # again, by us or by the partitions' new owner, from the handed-out
        # positions, which are committed now so that owner starts right.
        if self.source.incremental:
            self.kept |= self.assigned - set(tps)
        # With an on_revoke hook the caller runs it and gives the partitions
        # up right after, on its own thread, so no batch is handed out in
        # between and the hook's checkpoint is exactly what is committed.
        mine = self.before_revoke(tps)
        if mine is None:
            mine = self.ledger.revoke(tps)
        if self.ledger.failed and not self.ledger.handed_any:
            mine = {}  # nothing was read: see Loader.close
        self.status.doing = "committing the revoked partitions (Source.commit)"
        log.info("revoke commits %s", {tp: pos[:2] for tp, pos in mine.items()})
        try:  # no network call under the lock: next() needs it
            self.source.settle()
            acked = self.source.commit(mine, asynchronous=False)
            with self.ledger.lock:
                self.ledger.committed.update(acked)
        except KfeedError as e:  # partitions may already be lost to another member
            log.warning("commit on revoke failed: %s", e)
        finally:
            self.revoke_committed.set()
        self._clear()
        self.skip.clear()
        self.assigned.difference_update(tps)
        self.fetched.difference_update(tps)
        self.kept.difference_update(tps)
        self._not_at_end(tps)
        log.info("revoked %s", sorted(tps))

    # -- fetching -------------------------------------------------------------

    def all_done(self) -> bool:
        """A bounded epoch: every assigned partition read to its end, nothing pending."""
        return bool(self.assigned) and self.assigned <= self.done and not self.pending()

    def pending(self) -> bool:
        return self.i < len(self.msgs)

    def messages_for(self, rows: int) -> int:
        """Messages to ask for, to get about ``rows`` records.

        Before the first fetch is decoded a message may hold one record or
        thousands (a block): the first fetch asks for FIRST_FETCH messages at
        most, not a batch's worth of messages, which from a block topic would
        be hundreds of batches (all held at once by a shuffle, say).
        """
        if not self.learned:
            return max(1, min(rows, FIRST_FETCH))
        return max(1, min(10000, math.ceil(rows / self.records_per_msg)))

    def messages_within(self, nbytes: int) -> int:
        """About how many messages ``nbytes`` of values hold (at least 1)."""
        return max(1, int(nbytes // self.bytes_per_msg)) if self.bytes_per_msg else 10000

    def learn(self, rows: float, messages: int, *, least: float = 1.0) -> None:
        """``messages`` good messages held ``rows`` records: for ``messages_for``.

        ``least``: the fewest rows a message may count for. A record is a
        row (a message holds one at least); a packed row takes several
        messages' documents, so those count for a fraction of one.
        """
        if messages <= 0:
            return
        seen = max(least, rows / messages)
        # The first fetch's figure stands alone: the 1.0 guessed before it
        # would make the next fetches ask a block topic for far too much.
        self.records_per_msg = 0.8 * self.records_per_msg + 0.2 * seen if self.learned else seen
        self.learned = True

    def fetch(self, n: int | None = None, timeout: float = POLL_S, *, ahead: int = 0,
              serving: bool = False) -> None:
        """Consume up to ``n`` messages (about a batch's worth by default) onto the pending ones.

        ``ahead``: up to this many more, of those already fetched from the
        brokers, without waiting for them. A consume() waits until it has all
        it asked for or its timeout is over, so asking a trickling stream for
        more than a batch would hold the batch back; a backlog, though, is
        taken in fewer, bigger calls (NOTE [ Fetching ahead ]).
        """
        if n is None:
            n = self.messages_for(self.batch_size)
        if self.bounded:
            # A consume() waits out its timeout for messages the window no
            # longer holds: the one fetching the window's last messages asks
            # for those alone, and is back as soon as they are in.
            n = max(1, self._window_left(n))
        if not serving:
            self.fetch_most = n + ahead
            if self.held:
                self._release()
        self._commit()
        gen = self.ledger.gen
        self.starts = {}
        self.last_poll = time.monotonic()
        self.status.doing = "fetching messages (Source.consume)"
        t = self.last_poll
        msgs = self.source.consume(n + ahead, 0.0) if ahead > 0 else []
        if len(msgs) < n:
            before = self.ledger.gen
            more = self.source.consume(n - len(msgs), timeout)
            if self.ledger.gen != before:
                # A rebalance inside the second call: the first one's messages
                # are of the assignment before it, whose new start positions
                # do not count them. They are read again from there (a
                # partition kept through an incremental revoke, from where the
                # ledger stands, as it has moved on: ``_restart``).
                self.fetched.update(tp for tp in _fetch.partitions(msgs) if tp in self.kept)
                msgs = more
            else:
                msgs += more
        self.fetch_s += time.monotonic() - t
        self.status.doing = "decoding"
        if self.ledger.gen != gen:
            msgs = self._after_rebalance(msgs)
        # One pass in C: no Python work per message (a raw or Avro topic has
        # one record per message).
        keep, vals, runs, errors, done = _fetch.scan(msgs, self.ends if self.bounded else None)
        if vals:
            size = _fetch.value_bytes(vals, 0, len(vals)) / len(vals)
            self.bytes_per_msg = (0.8 * self.bytes_per_msg + 0.2 * size if self.bytes_per_msg
                                  else size)
        for m, err in errors:
            self._on_message_error(m, err)
        for tp in done:
            self.mark_done(tp)
        if self.at_end:  # records written after an end seen: not at its end any more
            self._not_at_end([tp for _s, e, tp in runs
                              if keep[e - 1].offset() >= self.at_end.get(tp, math.inf)])
        self.fetched.update(tp for _s, _e, tp in runs)
        if self.bounded:
            for _s, e, tp in runs:
                self.read_to[tp] = keep[e - 1].offset() + 1
        if self.pending():
            i, held = self.i, len(self.msgs) - self.i
            runs = [(max(s - i, 0), e - i, tp) for s, e, tp in self.runs if e > i] + \
                [(s + held, e + held, tp) for s, e, tp in runs]
            keep = self.msgs[i:] + keep
            vals = self.vals[i:] + vals
        else:
            self.start = 0
            # Nothing was pending: what this fetch brought arrived after its call began.
            self.pending_since = t
        self.msgs, self.vals, self.runs, self.i = keep, vals, runs, 0

    def _window_left(self, most: int) -> int:
        """A bounded epoch: how many messages its window may still hold, ``most`` at most.

        At most: offsets the window's ends leave, over partitions not read to
        their end. Compaction and transaction markers make it fewer; a fetch
        asking for more than come back waits its timeout, as without a window.
        """
        left = 0
        for tp in self.assigned:
            if tp in self.done:
                continue
            at, end = self.read_to.get(tp), self.ends.get(tp)
            if at is None or end is None:
                return most  # not known
            left += max(0, end - at)
            if left >= most:
                break
        return min(left, most)

    def rewind(self, positions: dict[TP, int]) -> None:
        """Read partitions again from ``positions`` (a mixture's next round)."""
        self.source.seek({tp: (off, 0) for tp, off in positions.items()})
        self.read_to.update(positions)
        self._not_at_end(positions)

    def spans(self, lo: int, hi: int) -> Iterator[tuple[TP, int, int]]:
        """``(tp, a, b)``: pending messages ``a..b-1`` of ``lo..hi-1`` are from partition ``tp``."""
        for s, e, tp in self.runs:
            if e <= lo:
                continue
            if s >= hi:
                return
            yield tp, max(s, lo), min(e, hi)

    def _clear(self) -> None:
        self.msgs, self.vals, self.runs, self.i, self.start = [], [], [], 0, 0

    def commit_asked(self) -> None:
        """Make the commits the caller asked for, from a thread that fetches no more.

        The thread waiting to hand over the epoch's end (or its failure) does
        this, as the caller's ``next()`` may wait on a synchronous commit
        before it takes from the queue. A commit that fails is the waiting
        caller's error, or a warning.
        """
        try:
            self._commit()
        except Exception as e:  # noqa: BLE001 - the thread is on its way out
            log.warning("commit failed: %s", e)

    def _commit(self) -> None:
        """Make the commits the caller asked for (see ``Commits``)."""
        todo, waiters = self.commits.take()
        if not todo and not waiters:
            return
        self.status.doing = "committing (Source.commit)"
        error = None
        try:
            self.commit_now({tp: pos for tp, pos in todo.items() if tp in self.assigned},
                            asynchronous=not waiters)
        except KfeedError as e:
            if getattr(e, "after_poll", False):
                # Made again after the next consume(), which takes the
                # group's new assignment; a caller waiting keeps waiting.
                log.info("commit deferred to the next poll: %s", e)
                self.commits.again(todo, waiters)
                return
            if not waiters:
                log.warning("commit failed: %s", e)
            error = e
        for waiter in waiters:
            waiter[1] = error
            waiter[0].set()

    def commit_now(self, positions: dict[TP, Position], *, asynchronous: bool) -> None:
        """Commit ``positions``; record what the broker acknowledged already.

        Dead-letter copies first: a bad record's offset is committed only once
        its copy is safe. Called by the loader's thread, or by the caller's once
        that thread is gone (NOTE [ One thread calls the consumer ]).
        """
        self.source.settle()
        acked = self.source.commit(positions, asynchronous=asynchronous)
        if acked:  # an asynchronous commit is recorded when its answer comes
            with self.ledger.lock:
                self.ledger.committed.update(acked)

    def _after_rebalance(self, msgs: list[Any]) -> list[Any]:
        """A rebalance ran inside this fetch: keep only what belongs to the new assignment.

        librdkafka drops the messages it fetched for an assignment that
        changed since (its fetch version barrier), so those kept are read
        from the positions the assignment gave. What this call returned of
        revoked partitions, of partitions kept through an incremental revoke
        (read again, see ``_restart``), or from below a new start, is dropped
        here all the same. No seek right after an assign: librdkafka fails it.
        """
        kept, self.kept = self.kept, set()
        starts = self.starts
        # A kept partition whose messages are dropped here has moved on too.
        self.fetched.update(tp for tp in ((m.topic(), m.partition()) for m in msgs
                                          if m.error() is None) if tp in kept)
        sought = kept & self.fetched  # (by _restart)

        def current(m: Any) -> bool:
            tp = (m.topic(), m.partition())
            if m.error() is not None:  # (the end of one sought back is seen again after)
                return tp in self.assigned and not (tp in sought and _is_eof(m.error()))
            start = starts.get(tp)
            return tp in self.assigned and tp not in kept and (
                start is None or m.offset() >= start[0])

        out = [m for m in msgs if current(m)]
        # Should a partition assigned in this call still show records fetched
        # before its revoke, its offsets go back where the new fetch starts:
        # keep only what comes after the last such step back.
        last: dict[TP, int] = {}
        restart: dict[TP, int] = {}
        for i, m in enumerate(out):
            tp = (m.topic(), m.partition())
            if tp in starts and m.error() is None:
                if tp in last and m.offset() <= last[tp]:
                    restart[tp] = i
                last[tp] = m.offset()
        if restart:
            out = [m for i, m in enumerate(out)
                   if i >= restart.get((m.topic(), m.partition()), 0)]
        if len(out) < len(msgs):
            log.info("dropped %d messages fetched across a rebalance", len(msgs) - len(out))
        kept &= self.assigned
        if kept:
            self._restart(kept)
        return out

    def serve(self) -> None:
        """While the thread waits, or works from records it holds, poll the consumer.

        A member that stops polling holds up every rebalance of its group
        (until max.poll.interval.ms): with ranks in one group that step
        together, a rank whose queue is full would wait on one that waits
        for its partitions. Polling also serves librdkafka's statistics,
        where ``stats()`` finds each partition's end. At most one message
        comes back; it waits with the pending ones, as many as one fetch
        takes at most (NOTE [ Serving ]).
        """
        # NOTE [ Serving ]
        # ~~~~~~~~~~~~~~~~
        # Each poll takes a message if one is there, so a caller slower than
        # one message a poll (a step longer than POLL_S, in a full queue) had
        # the pending messages grow without end: 240 in a minute, past
        # max_memory_bytes too (docs/RELIABILITY.md). Once they hold what one
        # fetch takes at most (``fetch_most``), serve() stops polling; if a
        # poll is then HOLD_S old, it pauses every partition and polls for
        # the group's events alone, until the next fetch for a batch resumes
        # them (``_release``). A pause drops librdkafka's pre-fetched messages
        # of the partition (fetched again on resume), so it is kept for a
        # caller that slow; a rebalance waits HOLD_S more at most.
        if len(self.msgs) - self.i >= self.fetch_most:
            if not self.held and time.monotonic() - self.last_poll < HOLD_S:
                self._commit()  # (as a poll would: a caller may wait on one)
                return
            self.held = set(self.assigned)
            self.source.pause(sorted(self.held))  # (again if the builder resumed one)
        self.fetch(1, 0, serving=True)

    def _release(self) -> None:
        """Resume what serve() paused, but for the partitions paused for other reasons."""
        held, self.held = self.held, set()
        if self.mixer is not None and self.mixer.ended:
            return
        self.source.resume(sorted(tp for tp in held if tp in self.assigned
                                  and tp not in self.done and tp not in self.kept_paused))

    def serve_if_due(self) -> None:
        if time.monotonic() - self.last_poll >= SERVE_S:
            self.serve()

    def take(self) -> tuple[list[Any], list[Any], list[tuple[int, int, TP]]]:
        """Every pending message, its value, and their runs of one partition; none is pending after."""
        i = self.i
        msgs, vals = self.msgs[i:], self.vals[i:]
        runs = [(max(s - i, 0), e - i, tp) for s, e, tp in self.runs if e > i]
        self._clear()
        return msgs, vals, runs

    def _on_message_error(self, m: Any, err: Any) -> None:
        tp = (m.topic(), m.partition())
        if _is_eof(err):
            end = self.ends.get(tp)
            if self.bounded and end is not None and m.offset() >= end:
                self.mark_done(tp)
            elif not self.bounded and tp in self.assigned and self.at_end.get(tp) != m.offset():
                self.at_end[tp] = m.offset()
                self.ends_seen += 1
            return
        raise ConsumeError(f"consume error: {err.str()}", topic=tp[0], partition=tp[1],
                           code=err.code())

    def _not_at_end(self, tps: Any) -> None:
        """``tps`` may have records to read: assigned, sought, or records came."""
        for tp in tps:
            if self.at_end.pop(tp, None) is not None:
                self.ends_seen += 1

    def mark_done(self, tp: TP) -> None:
        if tp not in self.done:
            self.done.add(tp)
            self.source.pause([tp])
