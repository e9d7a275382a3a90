"""Loader: Kafka messages -> batches of tensors on the device, exactly once.

This is the consumer half of the data flow. A background thread (the feeder)
consumes messages in bulk from a ``Source``, decodes them with the schema's
Cython codec straight into a free ``BufferPool`` slot and queues the batch.
On CUDA the feeder also issues the slot's copy to the device
(``kfeed.device``) before queueing it, so the copy overlaps the step before
it, and the caller's ``next()`` only orders its stream after the copy; on the
CPU ``next()`` makes the copy (a memcpy, which then runs beside the feeder's
next decode). Offsets follow the rule in
DESIGN.md: a batch's offsets are committed only once the caller asks for the
batch after it (so the step that used it has finished), on ``commit()``, or
on ``close()``; ``state_dict()`` holds the position after every batch handed
out, and a new loader given it resumes exactly there.

NOTE [ Loader Shutdown Logic ]
==============================
Two threads, one queue, one stop event::

    caller thread                         feeder thread (daemon)
    -------------                         ----------------------
    next(): ready.get(timeout) <--------- ready.put(batch | _END | _Failure)
    close(): stop.set(); pool.close() --> sees stop within one poll interval,
             join(feeder, timeout)         puts nothing more, returns
             commit used positions
             source.close()

- The feeder never blocks without a timeout: ``consume``, ``pool.acquire`` and
  ``ready.put`` all wait at most ``_POLL_S`` and re-check ``stop``. Only a
  synchronous commit on a revoke and a dead-letter flush wait longer, up to
  ``connect_timeout_s``; ``close()`` waits that plus 5 s, then raises
  ``LoaderError`` naming the stage the thread is stuck in (``_Feeder.doing``)
  and leaves the consumer open rather than close it under the thread.
- The feeder holds no reference to the ``Loader`` (only to ``_Feeder``), so a
  dropped loader is garbage-collected and ``__del__`` runs ``close()``.
- An exception in the feeder travels to the caller as ``_Failure`` and is
  re-raised by the next ``next()`` as ``LoaderError`` naming where it happened
  (or as itself, for kfeed's own errors).
- Only the caller thread commits after the feeder is gone; while it runs, the
  feeder commits only from inside a rebalance callback. ``lock`` guards the
  positions, never a call to Kafka: a commit is computed under it and made
  after it, and recorded only once the broker acknowledged it.
- ``close()`` is idempotent; a ``with`` block that exits on an exception
  commits only the batches before the current one (its step did not finish).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np
import torch

from kfeed.badrecords import BadRecordPolicy, BadRecords
from kfeed.device import DeviceCopier, default_device
from kfeed.errors import ConfigError, ConsumeError, KfeedError, LoaderError
from kfeed.pool import BufferPool, Slot
from kfeed.schema import Format, Schema
from kfeed.sources import TP, Committed, KafkaSource, MemorySource, Position, Source
from kfeed.tokens import Pack, Packer, PackInfo, Shuffle, ShuffleBuffer

__all__ = ["Loader", "Batch", "BadRecordPolicy"]

log = logging.getLogger(__name__)

_POLL_S = 0.1
_SERVE_S = 0.5  # the longest the feeder goes without polling the consumer
_MAX_LINEAGES = 64  # a state remembers this many loaders it descends from
_STATE_VERSION = 1


class Batch(dict):
    """A mapping field -> tensor ``[n, *shape]`` on the loader's device.

    ``offsets`` maps ``(topic, partition)`` to ``(first, end)`` positions,
    each ``(offset, skip)``: where the batch's records start and where the
    next batch continues. With ``shuffle`` or ``pack`` records do not come
    in offset ranges and ``offsets`` is empty: the loader's ``state_dict()``
    says where to resume.

    With ``pack``, the mapping holds ``tokens``, ``position_ids``,
    ``doc_ids`` (``[n, seq_len]``) and ``cu_seqlens`` (the segments' starts
    and the total, int32), and ``pack`` is the ``PackInfo`` (``max_seqlen``,
    ``tokens``, ``padding``, ...).
    """

    __slots__ = ("offsets", "size", "pack")

    def __init__(self, tensors: dict[str, torch.Tensor], size: int,
                 offsets: dict[TP, tuple[Position, Position]],
                 pack: PackInfo | None = None) -> None:
        super().__init__(tensors)
        self.size = size
        self.offsets = offsets
        self.pack = pack

    def update(self, *args: Any, **kwargs: Any) -> None:
        # torch's default_collate copies the first item and update()s it with
        # the items stacked: with DataLoader(batch_size=k) that would make
        # [k, batch, ...] tensors and fail on the epoch's shorter last batch.
        new = dict(*args, **kwargs)
        for key, value in new.items():
            old = self.get(key)
            if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor) and \
                    value.dim() == old.dim() + 1:
                raise ConfigError(
                    "kfeed yields whole batches: a DataLoader with batch_size set would stack "
                    "them; use DataLoader(dataset, batch_size=None) and give the batch size "
                    "to KafkaIterableDataset")
        super().update(new)


class _Failure:
    def __init__(self, exc: BaseException, where: str) -> None:
        self.exc = exc
        self.where = where


_END = object()


class _BatchMeta:
    """A batch on its way to the caller: the copy, and what the loader must know of it."""

    __slots__ = ("gen", "first", "end", "acks", "pack_offset", "info", "rows", "slot",
                 "tensors", "event")

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.rows = 0
        self.slot: Slot | None = None               # CPU: the filled slot, still to copy
        self.tensors: dict[str, torch.Tensor] = {}  # CUDA: on the device, copy issued
        self.event: Any = None                      # CUDA: the copy's event
        self.first: dict[TP, Position] = {}
        self.end: dict[TP, Position] = {}
        # Record mode (see _RecordFeeder): records of the order this batch
        # finished, tokens of the next document already out, the PackInfo.
        self.acks = 0
        self.pack_offset = 0
        self.info: PackInfo | None = None


class _Feeder:
    """The background thread's state. Holds no reference to the Loader."""

    def __init__(self, source: Source, schema: Schema, fmt: Format, pool: BufferPool,
                 copier: DeviceCopier, prefetch: int, *, bounded: bool, drop_last: bool,
                 max_wait_s: float, on_bad: BadRecords, start: Any,
                 assignment: list[TP] | None) -> None:
        self.source = source
        self.schema = schema
        self.block = fmt is Format.BLOCK
        self.fmt = fmt
        self.pool = pool
        self.copier = copier
        self.batch_size = pool.batch_size
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.bounded = bounded
        self.drop_last = drop_last
        self.max_wait_s = max_wait_s
        self.on_bad = on_bad
        self.start = start
        self.assignment = assignment
        self.thread: threading.Thread | None = None
        # Shared with the caller under ``lock``.
        self.gen = 0
        self.handed: dict[TP, Position] = {}   # after every batch handed out
        self.used: dict[TP, Position] = {}     # after every batch whose step finished
        self.committed: dict[TP, Position] = {}
        # Feeder-only state.
        self.assigned: set[TP] = set()
        self.seen: set[TP] = set()
        self.released: dict[TP, Position] = {}  # where we were when a partition was revoked
        self.skip: dict[TP, Position] = {}     # records to skip in a straddling block
        self.ends: dict[TP, int] = {}          # bounded epoch: high watermarks at start
        self.done: set[TP] = set()
        self.pend_msgs: list[Any] = []
        self.pend_vals: list[Any] = []
        self.pend_i = 0
        self.pend_start = 0
        self.records_per_msg = 1.0
        self.last_poll = time.monotonic()  # the last consume() call
        self.starts: dict[TP, Position] = {}  # partitions assigned during the current fetch
        # Lineages whose commits never win over the state: this loader's own,
        # and those of the loaders whose state it resumed (see Committed).
        self.lineages: set[str | None] = set()
        # The on_revoke hook: the feeder posts the partitions, the caller runs
        # the hook inside next() and sets revoke_done.
        self.hook_revoke = False
        self.revoking: list[TP] | None = None
        self.revoke_done = threading.Event()
        # Counters (read by stats() without the lock; ints are atomic enough).
        self.samples = 0
        self.value_bytes = 0
        self.epoch_over = False
        self.failed = False
        self.handed_any = False
        self.doing = "starting"  # what the thread does now, named by close() if it hangs

    # -- thread ---------------------------------------------------------------

    def run(self) -> None:
        where = "opening the source"
        try:
            self.copier.bind_thread()
            if self.bounded:
                where = "reading the high watermarks"
                for tp in self.source.partitions():
                    self.ends[tp] = self.source.watermarks(tp)[1]
            where = "opening the source"
            self.source.open(self._on_assign, self._on_revoke, self.assignment)
            where = "filling a batch"
            while not self.stop.is_set():
                self.doing = "waiting for a free pool slot (BufferPool.acquire)"
                slot = self.pool.acquire(timeout=_POLL_S)
                if slot is None:
                    self._serve()
                    continue
                meta = self._fill(slot)
                finished = self.bounded and self._all_done()
                if slot.rows == 0 or (finished and self.drop_last and slot.rows < self.batch_size):
                    self.pool.release(slot)
                    if finished or self.stop.is_set():
                        break
                    continue
                meta.rows = slot.rows
                if self.copier.cuda:
                    # Issued here, the copy overlaps the caller's current step.
                    meta.tensors, meta.event = self.copier.copy(slot)
                    self.pool.release(slot, meta.event)
                else:
                    meta.slot = slot  # the caller copies it (see _hand_out)
                if not self._put(meta, serve=True):
                    return
                if time.monotonic() - self.last_poll >= _SERVE_S:
                    self._serve()  # batches made from records held: no fetch for a while
                if finished:
                    break
            if self.bounded and not self.stop.is_set():
                self.on_bad.end_of_read()
            self.epoch_over = True
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - everything goes to the caller
            log.debug("feeder failed while %s", where, exc_info=True)
            self.failed = True
            self._put(_Failure(e, where))

    def _put(self, item: Any, serve: bool = False) -> bool:
        self.doing = "queueing a batch for the caller"
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                if serve:
                    self._serve()
        return False

    # -- assignment (called from inside consume, on the feeder thread) --------

    def _positions(self, tps: list[TP]) -> dict[TP, Position]:
        """Where each newly assigned partition starts: the state's position, or ``start``.

        A loaded state's position wins over the committed offset, unless
        another member (another lineage, see ``Committed``) committed past
        it: that member read the partition after this state was saved.
        """
        committed = self.source.committed(tps)
        with self.lock:
            for tp in [tp for tp in self.handed if tp not in tps]:
                # A loaded state's partition that another member owns now.
                del self.handed[tp]
                self.used.pop(tp, None)
            known = {tp: self._newer(self.handed[tp], committed.get(tp))
                     for tp in tps if tp in self.handed}
        need = [tp for tp in tps if tp not in known]
        positions = {**known, **self._start_positions(need, committed)}
        # A partition with nothing handed out yet is still part of the state:
        # without it, a resume would start it from the committed offset,
        # which may have moved on since the checkpoint. Its position is
        # committed like a used one, so the next epoch starts there too.
        with self.lock:
            self.handed.update(positions)
            for tp, pos in positions.items():
                self.used.setdefault(tp, pos)
        return positions

    def _newer(self, own: Position, committed: Committed | None) -> Position:
        """Our position, or the committed one if another member committed past it."""
        if committed is None or committed.by in self.lineages:
            return own
        theirs = (committed.offset, committed.skip)
        return theirs if theirs > own else own

    def _on_assign(self, tps: list[TP]) -> dict[TP, Position]:
        positions = self._positions(tps)
        for tp in tps:
            off, skip = positions[tp]
            if skip:
                self.skip[tp] = (off, skip)
            if self.bounded:
                end = self.ends.get(tp)
                if end is None:  # a partition added after the epoch began
                    end = self.ends[tp] = self.source.watermarks(tp)[1]
                if off >= end:
                    self.done.add(tp)
                else:  # back after a rebalance, with records left to read
                    self.done.discard(tp)
        self.starts.update(positions)
        self.assigned.update(tps)
        self.seen.update(tps)
        done_now = [tp for tp in tps if tp in self.done]
        if done_now:
            self.source.pause(done_now)
        log.info("assigned %s at %s", sorted(tps), positions)
        return positions

    def _start_positions(self, tps: list[TP],
                         committed: Mapping[TP, Committed | None]) -> dict[TP, Position]:
        out: dict[TP, Position] = {}
        for tp in tps:
            c = committed.get(tp)
            mine = self.released.get(tp)
            if mine is not None:
                # Back after a revoke: where we left it, unless a member that
                # had it since went further (our commit on revoke may have
                # failed, e.g. with every broker down).
                out[tp] = mine if c is None else max(mine, (c.offset, c.skip))
            elif c is not None and (self.start == "committed" or tp in self.seen):
                out[tp] = (c.offset, c.skip)
            elif isinstance(self.start, datetime):
                out[tp] = (self.source.offsets_for_time([tp], self.start)[tp], 0)
            elif self.start == "latest":
                out[tp] = (self.source.watermarks(tp)[1], 0)
            else:  # "earliest", or "committed" with nothing committed yet
                out[tp] = (self.source.watermarks(tp)[0], 0)
        return out

    def _wait_for_caller(self, tps: list[TP]) -> None:
        """With an ``on_revoke`` hook: wait until the caller ran it at a step boundary."""
        if not self.hook_revoke or self.stop.is_set():
            return
        self.revoke_done.clear()
        with self.lock:
            self.revoking = list(tps)
        while not self.revoke_done.wait(_POLL_S) and not self.stop.is_set():
            pass

    def _on_revoke(self, tps: list[TP]) -> None:
        # Batches not yet handed out are dropped: their records will be read
        # again, by us or by the partitions' new owner, from the handed-out
        # positions, which are committed now so that owner starts right.
        self._wait_for_caller(tps)
        with self.lock:
            self.gen += 1
            mine = self._give_up(tps)
            self.released.update(mine)
        if self.failed and not self.handed_any:
            mine = {}  # nothing was read: see Loader.close
        self.doing = "committing the revoked partitions (Source.commit)"
        log.info("revoke commits %s", mine)
        try:  # no network call under the lock: next() needs it
            self.source.settle()
            acked = self.source.commit(mine, asynchronous=False)
            with self.lock:
                self.committed.update(acked)
        except KfeedError as e:  # partitions may already be lost to another member
            log.warning("commit on revoke failed: %s", e)
        self.pend_msgs, self.pend_vals, self.pend_i, self.pend_start = [], [], 0, 0
        self.skip.clear()
        self.assigned.difference_update(tps)
        log.info("revoked %s", sorted(tps))

    def _give_up(self, tps: list[TP]) -> dict[TP, Position]:
        """Drop revoked partitions from the state (under ``lock``); their positions."""
        mine = {tp: self.handed.pop(tp) for tp in tps if tp in self.handed}
        for tp in tps:
            self.used.pop(tp, None)
        return mine

    # -- filling a slot -------------------------------------------------------

    def _all_done(self) -> bool:
        return bool(self.assigned) and self.assigned <= self.done and not self._pending()

    def _pending(self) -> bool:
        return self.pend_i < len(self.pend_msgs)

    def _fill(self, slot: Slot) -> _BatchMeta:
        meta = _BatchMeta(self.gen)
        started = None
        while slot.rows < self.batch_size and not self.stop.is_set():
            if meta.gen != self.gen:  # a rebalance dropped what we had
                slot.rows, meta = 0, _BatchMeta(self.gen)
                started = None
            if not self._pending():
                if self.bounded and self._all_done():
                    break
                if not self._fetch_within(started, slot.rows):
                    break
                continue
            self._decode(slot, meta)
            if started is None and slot.rows:
                started = time.monotonic()
        return meta

    def _messages_for(self, rows: int) -> int:
        """Messages to ask for, to get about ``rows`` records."""
        return max(1, min(10000, math.ceil(rows / self.records_per_msg)))

    def _fetch_within(self, started: float | None, rows: int) -> bool:
        """Fetch for a batch that holds ``rows`` since ``started``; False once max_wait is over.

        A started batch waits at most what is left of ``max_wait``, and asks
        only for the records it still needs, so a trickling stream yields
        partial batches on time. A bounded epoch's batches are all full but
        its last, however the records trickle in: there max_wait does not apply.
        """
        if started is None:
            self._fetch()
            return True
        need = self.batch_size - rows
        if self.bounded:
            self._fetch(self._messages_for(need))
            return True
        left = self.max_wait_s - (time.monotonic() - started)
        if left <= 0:
            return False
        self._fetch(self._messages_for(need), min(_POLL_S, left))
        return True

    def _fetch(self, n: int | None = None, timeout: float = _POLL_S) -> None:
        """Consume up to ``n`` messages (about a batch's worth by default) onto the pending ones."""
        if n is None:
            n = self._messages_for(self.batch_size)
        gen = self.gen
        self.starts = {}
        self.last_poll = time.monotonic()
        self.doing = "fetching messages (Source.consume)"
        msgs = self.source.consume(n, timeout)
        self.doing = "decoding"
        if self.gen != gen:
            # A rebalance ran inside this call. What it returned may hold
            # records fetched for the old assignment before the revoke, which
            # would land after our positions were reset (repeated, or, past
            # the shuffle's read position, making the re-read ones look like
            # repeats). Drop it all and read the partitions assigned in this
            # call again from where they start.
            if self.starts:
                self.source.seek(self.starts)
            if msgs:
                log.info("dropped %d messages fetched across a rebalance", len(msgs))
            msgs = []
        keep, vals = [], []
        bounded = self.bounded
        for m in msgs:
            err = m.error()
            if err is not None:
                self._on_message_error(m, err)
                continue
            if bounded:
                tp = (m.topic(), m.partition())
                end = self.ends.get(tp)
                off = m.offset()
                if end is not None and off >= end - 1:
                    self._mark_done(tp)
                    if off >= end:
                        continue
            keep.append(m)
            vals.append(m.value())
        if self._pending():
            keep = self.pend_msgs[self.pend_i:] + keep
            vals = self.pend_vals[self.pend_i:] + vals
        else:
            self.pend_start = 0
        self.pend_msgs, self.pend_vals, self.pend_i = keep, vals, 0

    def _serve(self) -> None:
        """While the feeder waits, or works from records it holds, poll the consumer.

        A member that stops polling holds up every rebalance of its group
        (until max.poll.interval.ms): with ranks in one group that step
        together, a rank whose queue is full would wait on one that waits
        for its partitions. Polling also serves librdkafka's statistics,
        where ``stats()`` finds each partition's end. At most one message
        comes back; it waits with the pending ones.
        """
        self._fetch(1, 0)

    def _on_message_error(self, m: Any, err: Any) -> None:
        from confluent_kafka import KafkaError

        tp = (m.topic(), m.partition())
        if err.code() == KafkaError._PARTITION_EOF:
            end = self.ends.get(tp)
            if self.bounded and end is not None and m.offset() >= end:
                self._mark_done(tp)
            return
        raise ConsumeError(f"consume error: {err.str()}", topic=tp[0], partition=tp[1],
                           code=err.code())

    def _mark_done(self, tp: TP) -> None:
        if tp not in self.done:
            self.done.add(tp)
            self.source.pause([tp])

    def _decode(self, slot: Slot, meta: _BatchMeta) -> None:
        msgs, i = self.pend_msgs, self.pend_i
        vals = self.pend_vals[i:]
        start = self.pend_start
        if self.skip:
            # Resuming inside a block: decode that partition's first message on
            # its own, skipping the records handed out before.
            m = msgs[i]
            tp = (m.topic(), m.partition())
            sk = self.skip.get(tp)
            if sk is not None and m.offset() >= sk[0]:
                del self.skip[tp]
                if m.offset() == sk[0]:
                    start = max(start, sk[1])
            vals = vals[:1]
        res = self.schema.decode_into(vals, slot.target, slot.rows, self.fmt,
                                      start=start, split=True)
        nbytes = 0
        for j in range(i, i + res.consumed):
            m = msgs[j]
            tp = (m.topic(), m.partition())
            off = m.offset()
            if tp not in meta.first:
                meta.first[tp] = (off, start if j == i else 0)
            meta.end[tp] = (off + 1, 0)
            v = self.pend_vals[j]
            nbytes += len(v) if v is not None else 0
        if res.partial:
            m = msgs[i + res.consumed]
            tp = (m.topic(), m.partition())
            if tp not in meta.first:
                meta.first[tp] = (m.offset(), start if res.consumed == 0 else 0)
            meta.end[tp] = (m.offset(), res.partial)
        if res.rows:
            self.on_bad.good()
        for k, reason in res.bad:
            self.on_bad.bad(msgs[i + k], reason)
        self.value_bytes += nbytes
        self.samples += res.rows
        slot.rows += res.rows
        if res.consumed:
            good = res.consumed - len(res.bad)
            if good > 0:
                self.records_per_msg = 0.8 * self.records_per_msg + 0.2 * max(1.0, res.rows / good)
        self.pend_i = i + res.consumed
        self.pend_start = res.partial

    # -- the caller's side (called by the Loader, under ``lock``) ---------------

    def accept(self, meta: _BatchMeta) -> None:
        """A batch is handed out: the state moves past it."""
        self.handed_any = True
        self.handed.update(meta.end)

    def mark_used(self, batch: Batch) -> None:
        """The step that used ``batch`` is over: its positions may be committed."""
        for tp, (_first, end) in batch.offsets.items():
            if tp in self.handed:  # not revoked since
                self.used[tp] = end

    def state(self) -> dict[str, Any]:
        return {"positions": _by_topic(self.delivered())}

    def delivered(self) -> dict[TP, Position]:
        """Per partition, the position after every record handed out (under ``lock``)."""
        return dict(self.handed)

    def load_state(self, state: Mapping[str, Any]) -> None:
        if "order" in state:
            raise ConfigError("the state was saved by a loader with shuffle or pack")
        handed: dict[TP, Position] = {}
        for topic, parts in state.get("positions", {}).items():
            for part, (off, skip) in parts.items():
                handed[(topic, int(part))] = (int(off), int(skip))
        self.handed.update(handed)
        self.used.update(handed)



_STAGE_ROWS = 1024  # records decoded at a time on the shuffle path


class _RecordFeeder(_Feeder):
    """The feeder for ``shuffle`` and ``pack``: records one by one, through an order.

    Every record (a fixed-shape sample, or a document) is pushed into a
    ``ShuffleBuffer`` keyed ``(partition, offset, index in the message)``:
    seeded and shuffling with ``shuffle``, in order without. What it emits
    goes into the slot (fixed shapes) or into a ``Packer`` whose rows are the
    slot (``pack``). The buffer runs with acknowledgements: a record counts as
    delivered only when the batch holding it (for a document, its last token)
    is handed out, so ``state()`` taken at any moment covers exactly the
    batches handed out; what was emitted into batches still queued comes out
    again, in the same order, after a resume. With ``pack``, the state also
    holds how many tokens of the first unfinished document are already out,
    so a resume continues inside it. The same replay rebuilds the order after
    a rebalance, less the partitions revoked (their new owner re-reads them
    from the committed watermark, which with ``shuffle`` may repeat records
    emitted above it).
    """

    def __init__(self, *args: Any, shuffle: Shuffle | None, packer: Packer | None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shuffle = shuffle
        self.packer = packer
        self.order = ShuffleBuffer(shuffle, ack=True)
        self.out: deque[tuple[np.ndarray, ...]] = deque()  # emitted samples not in a slot yet
        self.drained = False   # bounded epoch: the order gave up what it held
        self.finished = False  # ... and the packer its last batch
        self.pack_offset = 0   # tokens of the first unacknowledged document handed out
        self.stage: dict[str, np.ndarray] = {}
        if packer is None:
            self.stage = self.schema.empty(_STAGE_ROWS, like="numpy")
            self.stage_target = self.schema.bind(self.stage)
        self.arrays: dict[int, list[np.ndarray]] = {}  # slot index -> numpy views

    # -- assignment -------------------------------------------------------------

    def _positions(self, tps: list[TP]) -> dict[TP, Position]:
        committed = self.source.committed(tps)
        with self.lock:
            marks = self.order.watermarks()
            # Partitions another member owns now, or read past what we hold.
            drop = {tp for tp in marks if tp not in tps}
            drop.update(tp for tp in tps
                        if tp in marks and self._newer(marks[tp], committed.get(tp)) != marks[tp])
            if drop:
                self._rebuild(drop)
            resume = self.order.resume_offsets()
        positions = {tp: (resume[tp], 0) for tp in tps if tp in resume}
        need = [tp for tp in tps if tp not in positions]
        if need:
            fresh = self._start_positions(need, committed)
            with self.lock:
                for tp in need:
                    # The order skips the records of a straddled block that
                    # were delivered before.
                    self.order.seek(tp, *fresh[tp])
            positions.update({tp: (fresh[tp][0], 0) for tp in need})
        return positions

    def _give_up(self, tps: list[TP]) -> dict[TP, Position]:
        marks = self.order.watermarks()
        mine = {tp: marks[tp] for tp in tps if tp in marks}
        self._rebuild(set(tps))
        return mine

    def _rebuild(self, without: set[TP]) -> None:
        """Start again from what was handed out, as a resume would, less ``without``."""
        state = self.order.state()
        head = state["outbox"][0] if state["outbox"] else None
        kept = ShuffleBuffer.without(state, without)
        offset = self.pack_offset if head is not None and kept["outbox"][:1] == [head] else 0
        self._restore(kept, offset)

    def _restore(self, order_state: Mapping[str, Any] | None, pack_offset: int) -> None:
        self.order = ShuffleBuffer(self.shuffle, ack=True)
        if order_state is not None:
            self.order.load_state(order_state)
        if self.packer is not None:
            self.packer = Packer(self.packer.pack, self.batch_size)
            if pack_offset:
                self.packer.load_state({"docs": 0, "offset": pack_offset})
        self.pack_offset = pack_offset
        self.out.clear()
        self.drained = self.finished = False

    # -- filling a slot -------------------------------------------------------

    def _all_done(self) -> bool:
        return (super()._all_done() and self.drained and not self.out
                and (self.packer is None or self.finished))

    def _fill(self, slot: Slot) -> _BatchMeta:
        meta = _BatchMeta(self.gen)
        started = None
        while not self.stop.is_set():
            if meta.gen != self.gen:  # a rebalance dropped what we had
                slot.rows, slot.extent, meta, started = 0, {}, _BatchMeta(self.gen), None
            if self._take_into(slot, meta):
                break
            if started is None and (slot.rows or self._packing()):
                started = time.monotonic()
            if self._pending():
                self._push_pending()
            elif self.bounded and self.assigned and self.assigned <= self.done:
                if self.drained:
                    break  # the end of the epoch: a partial batch, or none
                self._drain()
            elif not self._fetch_within(started, slot.rows):
                # max_wait is over: what the packer holds goes out, its last
                # row padded, rather than wait for a whole batch.
                if self.packer is not None and not self.finished:
                    self._packed(slot, meta, self.packer.next_batch(slot.target, partial=True))
                break
        return meta

    def _packing(self) -> bool:
        """Whether the packer holds tokens of a batch to come."""
        return self.packer is not None and self.packer.pending_tokens > 0

    def _take_into(self, slot: Slot, meta: _BatchMeta) -> bool:
        """Move emitted records into the slot; whether it is complete."""
        packer = self.packer
        if packer is not None:
            if self.finished:
                return False
            info = packer.next_batch(slot.target)
            if info is None:
                self.finished = self.drained
                return False
            self._packed(slot, meta, info)
            return True
        n = min(self.batch_size - slot.rows, len(self.out))
        if n:
            arrays = self._arrays(slot)
            for row in range(slot.rows, slot.rows + n):
                for a, v in zip(arrays, self.out.popleft()):
                    a[row] = v
            slot.rows += n
            meta.acks += n
        return slot.rows == self.batch_size

    def _packed(self, slot: Slot, meta: _BatchMeta, info: PackInfo | None) -> None:
        """The packer wrote ``info`` (None: nothing) into ``slot``."""
        if info is None:
            return
        assert self.packer is not None
        slot.rows = info.rows
        slot.extent = {"cu_seqlens": info.segments + 1}
        meta.acks = info.documents
        meta.pack_offset = self.packer.state()["offset"]
        meta.info = info

    def _arrays(self, slot: Slot) -> list[np.ndarray]:
        arrays = self.arrays.get(slot.index)
        if arrays is None:
            arrays = []
            for f in self.schema.fields:
                t = slot.tensors[f.name]
                if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its 2-byte words
                    t = t.view(torch.int16)
                arrays.append(t.numpy().view(f.storage))
            self.arrays[slot.index] = arrays
        return arrays

    def _push_pending(self) -> None:
        msgs, vals = self.pend_msgs[self.pend_i:], self.pend_vals[self.pend_i:]
        self.pend_msgs, self.pend_vals, self.pend_i, self.pend_start = [], [], 0, 0
        self.value_bytes += sum(len(v) for v in vals if v is not None)
        if self.packer is not None:
            self._push_documents(msgs, vals)
        else:
            self._push_samples(msgs, vals)

    def _push_documents(self, msgs: list[Any], vals: list[Any]) -> None:
        docs = self.schema.decode_documents(vals, self.fmt)
        bad = dict(docs.bad)
        ends = np.cumsum(docs.lengths)
        starts = ends - docs.lengths
        # A shuffle holds documents for long: copy them out of the chunk.
        copy = self.shuffle is not None
        tokens, counts = docs.tokens, docs.counts.tolist()
        emitted: list[Any] = []
        d = 0
        with self.lock:
            push = self.order.push
            for j, m in enumerate(msgs):
                if j in bad:
                    continue
                tp, off = (m.topic(), m.partition()), m.offset()
                for sub in range(counts[j]):
                    doc = tokens[starts[d]:ends[d]]
                    emitted += push(tp, off, doc.copy() if copy else doc, sub)
                    d += 1
        self.samples += d
        if d:
            self.on_bad.good()
        for j, reason in docs.bad:
            self.on_bad.bad(msgs[j], reason)
        self._deliver(emitted)

    def _push_samples(self, msgs: list[Any], vals: list[Any]) -> None:
        stage = list(self.stage.values())
        emitted: list[Any] = []
        for m, v in zip(msgs, vals):
            tp, off = (m.topic(), m.partition()), m.offset()
            start = 0
            while True:
                res = self.schema.decode_into([v], self.stage_target, 0, self.fmt,
                                              start=start, split=True)
                if res.bad:
                    self.on_bad.bad(m, res.bad[0][1])
                    break
                if res.rows:
                    self.on_bad.good()
                with self.lock:
                    for r in range(res.rows):
                        emitted += self.order.push(tp, off, tuple(a[r].copy() for a in stage),
                                                   start + r)
                self.samples += res.rows
                if not res.partial:
                    break
                start = res.partial
        self._deliver(emitted)

    def _deliver(self, emitted: list[Any]) -> None:
        if not emitted:
            return
        if self.packer is None:
            self.out.extend(item for _key, item in emitted)
            return
        docs = [item for _key, item in emitted]
        lengths = np.fromiter((len(x) for x in docs), np.int64, len(docs))
        self.packer.feed(np.concatenate(docs), lengths, copy=False)

    def _drain(self) -> None:
        with self.lock:
            emitted = self.order.drain()
        self._deliver(emitted)
        if self.packer is not None:
            self.packer.finish()
        self.drained = True

    # -- the caller's side (under ``lock``) ---------------------------------

    def accept(self, meta: _BatchMeta) -> None:
        self.handed_any = True
        self.order.ack(meta.acks)
        self.pack_offset = meta.pack_offset

    def mark_used(self, batch: Batch) -> None:
        self.used.update(self.order.watermarks())

    def delivered(self) -> dict[TP, Position]:
        return self.order.watermarks()

    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            "order": self.order.state(),
            "pack": self._pack_spec(),
            "pack_offset": self.pack_offset,
        }

    def _pack_spec(self) -> list[Any] | None:
        pack = self.packer.pack if self.packer is not None else None
        return None if pack is None else [pack.seq_len, pack.eos_id, pack.pad_id, pack.split_long]

    def load_state(self, state: Mapping[str, Any]) -> None:
        if "order" not in state:
            raise ConfigError("the state was saved by a loader without shuffle or pack")
        want = self._pack_spec()
        if state.get("pack") != want:
            raise ConfigError(f"the state was saved with pack {state.get('pack')}, "
                              f"this loader packs {want}")
        self._restore(state["order"], int(state.get("pack_offset", 0)))


class Loader:
    """An iterator of batches from Kafka topics, already on ``device``.

    ``kafka_config`` is the librdkafka settings dict (``bootstrap.servers``
    and ``group.id`` at least); kfeed's own settings are the keyword
    arguments. See the module docstring for the offset rule.

    Up to ``prefetch`` batches wait ready. On CUDA their copies to
    ``device`` are already issued; with the one being filled and the one the
    caller holds, the device holds at most ``prefetch + 2`` batches, and the
    host three pinned pool slots. On the CPU the host holds ``prefetch + 2``
    slots and ``next()`` copies each batch into tensors the caller owns.

    A message the codec rejects never reaches a batch: ``on_bad_record``
    sends it to ``<topic>.dlq`` (default; each message at most once, see
    ``KafkaSource.dead_letter``), skips it, or raises ``DecodeError``.
    Warnings come at most once per reason every few seconds. When the first
    ``fail_fast`` messages read are all rejected (a schema that does not
    match the topic, say), ``next()`` raises one ``DecodeError`` that says
    what the loader expects and what the topic holds, and nothing was
    dead-lettered or committed; ``fail_fast=None`` never does.
    ``dlq_config`` holds the librdkafka settings (e.g. ``sasl.username``)
    of a principal allowed to create and write the dead-letter topics,
    when the consumer's own should not be.

    ``pack=kfeed.Pack(...)`` (a schema with a variable-length token field)
    makes each batch ``batch_size`` packed rows of documents;
    ``shuffle=kfeed.Shuffle(...)`` shuffles records through a seeded buffer.
    Both keep ``state_dict()`` exact (see ``_RecordFeeder``).
    """

    def __init__(
        self,
        kafka_config: Mapping[str, Any] | None,
        topics: str | Sequence[str],
        schema: Schema,
        batch_size: int,
        *,
        device: str | torch.device | None = None,
        format: str | Format = "block",
        prefetch: int = 2,
        until: str | None = None,
        start: str | datetime = "committed",
        on_bad_record: str | BadRecordPolicy = "dead_letter",
        fail_fast: int | None = 32,
        dlq_config: Mapping[str, Any] | None = None,
        drop_last: bool = False,
        max_wait_ms: float = 200.0,
        rank: int | None = None,
        world_size: int | None = None,
        assignment: str = "group",
        commit_interval_ms: float = 1000.0,
        connect_timeout_s: float = 30.0,
        pack: Pack | None = None,
        shuffle: Shuffle | None = None,
        on_revoke: Callable[[list[TP]], None] | None = None,
        source: Source | None = None,
    ) -> None:
        if isinstance(topics, str):
            topics = [topics]
        topics = list(topics)
        if not topics or not all(isinstance(t, str) and t for t in topics):
            raise ConfigError(f"topics must be a topic name or a list of them, got {topics!r}")
        if not isinstance(schema, Schema):
            raise ConfigError("schema must be a kfeed.Schema")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(f"prefetch must be an int >= 1, got {prefetch!r}")
        if until not in (None, "end"):
            raise ConfigError(f"until must be None (stream) or 'end', got {until!r}")
        if not (isinstance(start, datetime) or start in ("committed", "earliest", "latest")):
            raise ConfigError(
                f"start must be 'committed', 'earliest', 'latest' or a datetime, got {start!r}")
        try:
            policy = BadRecordPolicy(on_bad_record)
        except ValueError:
            raise ConfigError(
                f"on_bad_record must be 'dead_letter', 'skip' or 'raise', got {on_bad_record!r}"
            ) from None
        if dlq_config is not None and not isinstance(dlq_config, Mapping):
            raise ConfigError("dlq_config must be a dict of librdkafka settings (the "
                              "connection and login of the dead-letter producer)")
        if fail_fast is not None and (not isinstance(fail_fast, int) or fail_fast < 1):
            raise ConfigError(f"fail_fast must be None or an int >= 1, got {fail_fast!r}")
        if on_revoke is not None and not callable(on_revoke):
            raise ConfigError("on_revoke must be a callable taking the revoked partitions")
        if assignment not in ("group", "static"):
            raise ConfigError(f"assignment must be 'group' or 'static', got {assignment!r}")
        if max_wait_ms <= 0 or commit_interval_ms < 0 or connect_timeout_s <= 0:
            raise ConfigError("max_wait_ms and connect_timeout_s must be > 0, "
                              "commit_interval_ms >= 0")
        fmt = Format.parse(format)
        if pack is not None and not isinstance(pack, Pack):
            raise ConfigError(f"pack must be a kfeed.Pack, got {type(pack).__name__}")
        if shuffle is not None and not isinstance(shuffle, Shuffle):
            raise ConfigError(f"shuffle must be a kfeed.Shuffle, got {type(shuffle).__name__}")
        if pack is not None and schema.varlen is None:
            raise ConfigError("pack needs a schema with a variable-length token field, "
                              "e.g. {'tokens': ('int32', (None,))}")
        if pack is None and schema.varlen is not None:
            raise ConfigError(f"the schema's variable-length field {schema.varlen.name!r} "
                              f"needs pack=kfeed.Pack(seq_len=..., eos_id=...) to make batches")
        rank, world_size = _rank_and_world(rank, world_size)
        self.schema = schema
        self.format = fmt
        self.topics = topics
        self.batch_size = batch_size
        self.device = _check_device(device)
        self.until = until
        self.rank, self.world_size = rank, world_size
        self.assignment_mode = assignment
        self._commit_interval = commit_interval_ms / 1000.0
        self._connect_timeout = connect_timeout_s
        self._last_commit = 0.0
        if source is None:
            source = KafkaSource(kafka_config or {}, topics, bounded=until == "end",
                                 connect_timeout=connect_timeout_s, dlq_config=dlq_config)
        elif dlq_config is not None:
            raise ConfigError("dlq_config applies to Kafka topics, not to a given source")
        self._source = source
        # Names this loader and the ones resumed from its checkpoints in every
        # commit (see kfeed.sources.Committed).
        source.lineage = uuid.uuid4().hex[:16]
        self._lineages = [source.lineage]  # newest first, see _Feeder.lineages
        self._on_revoke = on_revoke
        self._group = (kafka_config or {}).get("group.id")
        self._copier = DeviceCopier(self.device)
        packer = Packer(pack, batch_size) if pack is not None else None
        # CUDA: one filling, the others still being copied out (a slot is
        # given back as soon as its copy is issued, and refilled once it is
        # done). CPU: a slot waits in the queue until next() copies it.
        slots = 3 if self._copier.cuda else prefetch + 2
        # Pinned only for a CUDA device: pinning is for the copy to it, and
        # costs page-locked host memory and start-up time otherwise.
        self._pool = BufferPool(schema, batch_size, slots=slots, packer=packer,
                                pin=self._copier.cuda)
        args = (source, schema, fmt, self._pool, self._copier, prefetch)
        kwargs = dict(bounded=until == "end", drop_last=drop_last,
                      max_wait_s=max_wait_ms / 1000.0,
                      on_bad=BadRecords(schema, fmt, policy, source, fail_fast=fail_fast),
                      start=start,
                      assignment=None)
        self._feeder: _Feeder
        if pack is None and shuffle is None:
            self._feeder = _Feeder(*args, **kwargs)
        else:
            self._feeder = _RecordFeeder(*args, **kwargs, shuffle=shuffle, packer=packer)
        self._feeder.hook_revoke = on_revoke is not None
        self._feeder.lineages = set(self._lineages)
        self._current: Batch | None = None
        self._agreement: _EpochAgreement | None = None
        self._ahead: Any = None  # with ranks: the next step's item, taken a step early
        self._closed = False
        self._exhausted = False
        self._wait_s = 0.0          # waited in next() after the first batch
        self._startup_s = 0.0       # from the first next() to the first batch
        self._longest_wait_s = 0.0
        self._batches = 0
        self._samples_out = 0
        self._t0: float | None = None       # first next()
        self._t_first: float | None = None  # first batch handed out

    # -- iteration ------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def _start(self) -> None:
        f = self._feeder
        if self.assignment_mode == "static":
            parts = self._source.partitions()
            f.assignment = [tp for i, tp in enumerate(parts) if i % self.world_size == self.rank]
            if not f.assignment:
                raise ConfigError(
                    f"rank {self.rank} of {self.world_size} gets no partition: "
                    f"the topics have only {len(parts)}")
        f.thread = threading.Thread(target=f.run, name="kfeed-loader", daemon=True)
        f.thread.start()
        self._t0 = time.monotonic()

    def __next__(self) -> Batch:
        if self._closed:
            raise LoaderError("the loader is closed")
        f = self._feeder
        if f.thread is None:
            self._start()
        # The caller asks for a new batch: the step that used the last one is over.
        self._mark_used()
        self._run_revoke_hook()
        if self._exhausted:
            raise StopIteration
        t = time.monotonic()
        if self._agreement is None and self.until == "end" and self.world_size > 1 \
                and _dist_ready():
            self._agreement = _EpochAgreement()
        item = self._take() if self._agreement is None else self._agreed()
        batch = None
        while batch is None:
            if item is _END:
                self._exhausted = True
                self._commit(asynchronous=False)
                raise StopIteration
            batch = self._hand_out(item)
            if batch is None:  # dropped by a rebalance that came after _take
                item = self._take()
        if self._t_first is None:
            self._t_first = time.monotonic()
            self._startup_s = self._t_first - (self._t0 or t)
        else:
            waited = time.monotonic() - t
            self._wait_s += waited
            self._longest_wait_s = max(self._longest_wait_s, waited)
        return batch

    def _agreed(self) -> Any:
        """The next item, or ``_END`` once any rank has run out (see ``_EpochAgreement``)."""
        ag = self._agreement
        assert ag is not None
        if self._ahead is None:  # the first step: this batch's question goes out now
            self._ahead = self._take()
            ag.post(self._ahead is not _END)
        item = self._ahead
        # One batch ahead: its question goes out now, and is answered by the
        # time the next step asks, so no step waits on a collective.
        self._ahead = _END if item is _END else self._take()
        ag.post(self._ahead is not _END)
        if ag.answer():
            return item
        for held in (item, self._ahead):  # not handed out: their records stay unread
            if held is not _END:
                self._drop(held)
        ag.drain()
        self._ahead = _END
        return _END

    def _take(self) -> Any:
        f = self._feeder
        while True:
            try:
                item = f.ready.get(timeout=_POLL_S)
            except queue.Empty:
                self._run_revoke_hook()  # the feeder may be waiting for it
                if f.thread is not None and not f.thread.is_alive() and f.ready.empty():
                    raise LoaderError("the loader thread stopped without a reason") from None
                continue
            if isinstance(item, _Failure):
                self._exhausted = True
                exc = item.exc
                if isinstance(exc, KfeedError):
                    raise exc
                tb = "".join(traceback.format_exception(exc))
                raise LoaderError(f"error in the loader thread while {item.where}:\n{tb}") from exc
            if item is _END:
                return item
            with f.lock:
                if item.gen == f.gen:
                    return item
            self._drop(item)  # from before a rebalance

    def _drop(self, meta: _BatchMeta) -> None:
        """Give back the batch's slot, if it still holds one."""
        if meta.slot is not None:
            self._pool.release(meta.slot)
            meta.slot = None

    def _hand_out(self, meta: _BatchMeta) -> Batch | None:
        f = self._feeder
        if meta.slot is not None:  # CPU: copied before the batch counts as handed out
            meta.tensors, _ = self._copier.copy(meta.slot)
            self._drop(meta)
        with f.lock:
            if meta.gen != f.gen:
                # A rebalance happened after _take: the caller's next() takes
                # the next batch instead.
                self._drop(meta)
                return None
            f.accept(meta)
        self._copier.adopt(meta.tensors, meta.event)
        offsets = {tp: (meta.first.get(tp, end), end) for tp, end in meta.end.items()}
        batch = Batch(meta.tensors, meta.rows, offsets, meta.info)
        self._current = batch
        self._batches += 1
        self._samples_out += meta.rows
        return batch

    def _mark_used(self) -> None:
        if self._current is None:
            return
        f = self._feeder
        with f.lock:
            f.mark_used(self._current)
        self._current = None
        now = time.monotonic()
        if now - self._last_commit >= self._commit_interval:
            self._commit(asynchronous=self._commit_interval > 0)
            self._last_commit = now

    def _run_revoke_hook(self) -> None:
        """Run ``on_revoke`` for partitions the feeder is about to give up (caller's thread)."""
        f = self._feeder
        with f.lock:
            tps, f.revoking = f.revoking, None
        if tps is None:
            return
        try:
            assert self._on_revoke is not None
            self._on_revoke(tps)
        finally:
            f.revoke_done.set()

    def _commit(self, asynchronous: bool) -> None:
        f = self._feeder
        with f.lock:
            f.committed.update(self._source.acknowledged())
            # Only partitions this loader was given: a loaded state also
            # holds the other ranks' ones, which they commit themselves.
            todo = {tp: pos for tp, pos in f.used.items()
                    if f.committed.get(tp) != pos and tp in f.seen
                    and (tp in f.assigned or f.thread is None or not f.thread.is_alive())}
        if not todo:
            return
        # Outside the lock: a synchronous commit may retry for seconds, and
        # the feeder's revoke takes the lock too. Dead-letter copies first:
        # a bad record's offset is committed only once its copy is safe.
        self._source.settle()
        acked = self._source.commit(todo, asynchronous=asynchronous)
        if acked:  # an asynchronous commit is recorded when its answer comes
            with f.lock:
                f.committed.update(acked)

    def commit(self) -> None:
        """Commit every batch handed out so far, including the current one."""
        self._mark_used()
        self._commit(asynchronous=False)

    # -- checkpoints ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: per partition, the position after the batches handed out."""
        f = self._feeder
        self._source.settle()  # the state may point past bad records: their copies are safe
        with f.lock:
            state = f.state()
        return {
            "version": _STATE_VERSION,
            "schema_fingerprint": self.schema.fingerprint,
            "format": self.format.value,
            "topics": list(self.topics),
            "lineages": list(self._lineages),
            **state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``; its positions win over committed offsets."""
        if self._feeder.thread is not None:
            raise ConfigError("load_state_dict must be called before iterating")
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ConfigError(f"not a kfeed loader state (version {_STATE_VERSION})")
        if state.get("schema_fingerprint") != self.schema.fingerprint:
            raise ConfigError("the state was saved with another schema")
        if state.get("format") != self.format.value:
            raise ConfigError(f"the state was saved for format {state.get('format')!r}")
        with self._feeder.lock:
            self._feeder.load_state(state)
        # A resumed loader carries on its state's lineage: the commits of a
        # run killed before its first checkpoint are then its own too.
        resumed = [x for x in state.get("lineages", []) if isinstance(x, str)]
        if resumed:
            self._lineages = resumed[:_MAX_LINEAGES]
            self._source.lineage = resumed[0]
            self._feeder.lineages = set(self._lineages)

    @staticmethod
    def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One state for every rank of a job, from each rank's ``state_dict()`` at one step.

        In group mode a partition may be assigned to another rank after a
        restart, so every rank loads the merged state: per partition the
        furthest position, and every rank's lineage, so that no rank's
        commits (which run ahead of the checkpoint) win over it. The states
        must come from the same step of every rank (e.g. gathered with
        ``torch.distributed.all_gather_object``); with ``shuffle`` or
        ``pack`` use ``assignment="static"`` and save each rank's own state.
        """
        states = list(states)
        if not states:
            raise ConfigError("merge_states needs at least one state")
        first = states[0]
        for st in states:
            if not isinstance(st, Mapping) or st.get("version") != _STATE_VERSION:
                raise ConfigError(f"not a kfeed loader state (version {_STATE_VERSION})")
            if "order" in st:
                raise ConfigError("states with shuffle or pack cannot be merged: use "
                                  "assignment='static' and save each rank's own state")
            for key in ("schema_fingerprint", "format", "topics"):
                if st.get(key) != first.get(key):
                    raise ConfigError(f"the states differ in {key}")
        positions: dict[str, dict[int, list[int]]] = {}
        lineages: list[str] = []
        for st in states:
            for topic, parts in st.get("positions", {}).items():
                merged = positions.setdefault(topic, {})
                for part, pos in parts.items():
                    part = int(part)
                    if part not in merged or tuple(pos) > tuple(merged[part]):
                        merged[part] = [int(pos[0]), int(pos[1])]
            lineages += [x for x in st.get("lineages", []) if x not in lineages]
        return {**first, "positions": positions, "lineages": lineages}

    # -- observability --------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Throughput, bad records, lag per partition and time spent waiting in next()."""
        f = self._feeder
        # Rates and stall are over the steady state, from the first batch on;
        # joining the group and the first fetch show as startup_s.
        elapsed = time.monotonic() - self._t_first if self._t_first is not None else 0.0
        with f.lock:
            positions = {tp: off for tp, (off, _skip) in f.delivered().items()}
        if self._exhausted and f.epoch_over:
            # Everything up to each partition's end at the start was read;
            # what lies between the last record and that end (transaction
            # markers) is no lag.
            for tp, end in f.ends.items():
                if tp in positions:
                    positions[tp] = max(positions[tp], end)
        lag = {f"{t}[{p}]": n for (t, p), n in sorted(self._source.lag(positions).items())}
        return {
            "samples": self._samples_out,
            "samples_decoded": f.samples,
            "bytes": f.value_bytes,
            "batches": self._batches,
            "startup_s": self._startup_s,
            "elapsed_s": elapsed,
            "samples_per_s": self._samples_out / elapsed if elapsed > 0 else 0.0,
            "mb_per_s": f.value_bytes / elapsed / 1e6 if elapsed > 0 else 0.0,
            "bad_records": f.on_bad.count,
            "lag": lag,
            "wait_s": self._wait_s,
            "longest_wait_s": self._longest_wait_s,
            "stall_fraction": self._wait_s / elapsed if elapsed > 0 else 0.0,
            "pool_bytes": self._pool.nbytes,
        }

    # -- shutdown (see NOTE [ Loader Shutdown Logic ]) -------------------------

    def close(self, *, commit_current: bool = True, timeout_s: float | None = None) -> None:
        """Stop the thread, commit what was used, close the consumer.

        The thread stops within one poll interval, unless a call into Kafka
        holds it (a commit or a dead-letter flush waits up to
        ``connect_timeout_s``): after ``timeout_s`` (default: that plus 5 s)
        ``LoaderError`` names where it is stuck.
        """
        if self._closed:
            return
        self._closed = True
        f = self._feeder
        f.stop.set()
        self._pool.close()
        if f.thread is not None:
            limit = self._connect_timeout + 5.0 if timeout_s is None else timeout_s
            f.thread.join(limit)
            if f.thread.is_alive():
                # Closing the consumer under a thread still inside it is not
                # safe: it stays open, and the daemon thread dies with the
                # process.
                raise LoaderError(f"the loader thread did not stop within {limit:g}s: it is "
                                  f"stuck {f.doing}; the consumer was left open")
        try:
            if commit_current:
                self._mark_used()
            if not (f.failed and not f.handed_any):
                # (A read that failed before its first batch moved nothing:
                # committing its start positions would only make them look
                # read, to a later start="latest" say.)
                self._commit(asynchronous=False)
        except KfeedError as e:
            log.warning("final commit failed: %s", e)
        finally:
            self._source.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(commit_current=exc_type is None)

    def __del__(self) -> None:
        try:
            self.close(commit_current=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn things down
            pass


def _by_topic(positions: Mapping[TP, Position]) -> dict[str, dict[int, list[int]]]:
    """Positions as the state holds them: topic -> partition -> [offset, skip]."""
    out: dict[str, dict[int, list[int]]] = {}
    for (topic, part), (off, skip) in sorted(positions.items()):
        out.setdefault(topic, {})[part] = [off, skip]
    return out


def _check_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={str(device)!r}, but torch sees no CUDA device "
                              "(torch.cuda.is_available() is False): pass device='cpu', "
                              "or leave device unset to take cuda only where there is one")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device={str(device)!r}, but torch sees "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"device={str(device)!r}: kfeed copies batches to 'cuda' or 'cpu'")
    return dev


def _collective_device(backend: str) -> torch.device:
    """Where a collective's tensor must live: NCCL takes only CUDA tensors."""
    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _EpochAgreement:
    """Ranks of a bounded epoch stop at the same step, so DDP never waits on one that ran out.

    Each step, every rank posts whether it has the batch of the step after
    (an asynchronous ``all_reduce(MIN)``), and reads the answer for this
    step, posted one step earlier: by then it has long arrived, so the step
    waits on no collective and no device sync. The tensor lives on the
    default group's device (CUDA for NCCL, which refuses CPU tensors); on
    CUDA the collective and the copy of its answer to pinned host memory
    run on a side stream, so reading the answer waits for them alone, not
    for the training stream.
    """

    def __init__(self) -> None:
        self.device = _collective_device(torch.distributed.get_backend())
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._posted: deque[tuple[Any, torch.Tensor, Any]] = deque()

    def post(self, have: bool) -> None:
        value = torch.tensor([1 if have else 0], dtype=torch.int32)
        if not self.cuda:
            work = torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN,
                                                async_op=True)
            self._posted.append((work, value, None))
            return
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        with torch.cuda.stream(self._stream):
            t = value.to(self.device, non_blocking=True)
            work = torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN,
                                                async_op=True)
            work.wait()  # orders the side stream after the collective
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._posted.append((work, host, event))

    def answer(self) -> bool:
        """Whether every rank has the batch of the oldest question still open."""
        work, value, event = self._posted.popleft()
        if event is None:
            work.wait()
        else:
            event.synchronize()
        return bool(value.item())

    def drain(self) -> None:
        while self._posted:
            self.answer()


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if _dist_ready():
        rank = torch.distributed.get_rank() if rank is None else rank
        world_size = torch.distributed.get_world_size() if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int)
            and 0 <= rank < world_size):
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def memory_loader(values: Any, schema: Schema, batch_size: int, **kwargs: Any) -> Loader:
    """A Loader over recorded message values (see ``MemorySource``)."""
    loop = kwargs.pop("loop", False)
    return Loader(None, "memory", schema, batch_size,
                  source=MemorySource(values, loop=loop), **kwargs)
