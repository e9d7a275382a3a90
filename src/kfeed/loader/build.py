"""The build stage: pending messages -> one batch in a pool slot.

A builder fills one ``BufferPool`` slot per call of ``fill`` and describes
what it put there in a ``Handoff``: the rows, and what the ledger needs
when the batch is handed out (where its records start and end per
partition, or how many records of the order it finished). Two builders,
one interface:

- ``SlotBuilder``: messages decoded in offset order by the schema's Cython
  codec, straight into the slot (block: one memcpy per field per message);
- ``RecordBuilder``: records one by one through the ``OrderLedger``'s
  order, shuffled or not, into the slot (fixed shapes) or into a
  ``Packer`` whose rows are the slot (``pack``).

A new record format or a mixer of topics is a new builder. A message the
codec rejects goes to ``BadRecords`` and never reaches a slot.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from kfeed.badrecords import BadRecords
from kfeed.loader.fetch import POLL_S, Fetcher
from kfeed.loader.ledger import Ledger, OrderLedger
from kfeed.pool import BufferPool, Slot
from kfeed.schema import Format, Schema
from kfeed.sources import TP, Position
from kfeed.tokens import Packer, PackInfo

__all__ = ["Handoff", "SlotBuilder", "RecordBuilder"]

_STAGE_ROWS = 1024  # records decoded at a time on the fixed-shape shuffle path


class Handoff:
    """A batch on its way to the caller: its slot or copy, and what the ledger must know."""

    __slots__ = ("gen", "rows", "slot", "tensors", "event", "first", "end", "acks",
                 "pack_offset", "info")

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.rows = 0
        # The filled slot until its copy exists; then the copy's tensors (and
        # on CUDA the event that ends it).
        self.slot: Slot | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.event: Any = None
        # In offset order: per partition where the batch's records start and
        # where the next batch continues.
        self.first: dict[TP, Position] = {}
        self.end: dict[TP, Position] = {}
        # Through an order: records of the order it finished, tokens of the
        # next document already out, the PackInfo.
        self.acks = 0
        self.pack_offset = 0
        self.info: PackInfo | None = None

    def release(self, pool: BufferPool, event: Any = None) -> None:
        """Give the slot back (once its copy is issued, or the batch is dropped)."""
        if self.slot is not None:
            pool.release(self.slot, event)
            self.slot = None

    def offsets(self) -> dict[TP, tuple[Position, Position]]:
        return {tp: (self.first.get(tp, end), end) for tp, end in self.end.items()}


class SlotBuilder:
    """Decodes pending messages in offset order straight into the slot."""

    def __init__(self, fetcher: Fetcher, ledger: Ledger, schema: Schema, fmt: Format,
                 bad: BadRecords, *, batch_size: int, max_wait_s: float,
                 stop: threading.Event) -> None:
        self.fetcher = fetcher
        self.ledger = ledger
        self.schema = schema
        self.fmt = fmt
        self.bad = bad
        self.batch_size = batch_size
        self.bounded = fetcher.bounded
        self.max_wait_s = max_wait_s
        self.stop = stop
        self.samples = 0       # records decoded
        self.value_bytes = 0   # bytes of the message values decoded

    def all_done(self) -> bool:
        return self.fetcher.all_done()

    def fill(self, slot: Slot) -> Handoff:
        out = Handoff(self.ledger.gen)
        started = None
        f = self.fetcher
        while slot.rows < self.batch_size and not self.stop.is_set():
            if out.gen != self.ledger.gen:  # a rebalance dropped what we had
                slot.rows, out = 0, Handoff(self.ledger.gen)
                started = None
            if not f.pending():
                if self.bounded and f.all_done():
                    break
                if not self.fetch_within(started, slot.rows):
                    break
                continue
            self._decode(slot, out)
            if started is None and slot.rows:
                started = time.monotonic()
        return out

    def fetch_within(self, started: float | None, rows: int) -> bool:
        """Fetch for a batch that holds ``rows`` since ``started``; False once max_wait is over.

        A started batch waits at most what is left of ``max_wait``, and asks
        only for the records it still needs, so a trickling stream yields
        partial batches on time. A bounded epoch's batches are all full but
        its last, however the records trickle in: there max_wait does not apply.
        """
        f = self.fetcher
        if started is None:
            f.fetch()
            return True
        need = self.batch_size - rows
        if self.bounded:
            f.fetch(f.messages_for(need))
            return True
        left = self.max_wait_s - (time.monotonic() - started)
        if left <= 0:
            return False
        f.fetch(f.messages_for(need), min(POLL_S, left))
        return True

    def _decode(self, slot: Slot, out: Handoff) -> None:
        f = self.fetcher
        msgs, i = f.msgs, f.i
        vals = f.vals[i:]
        start = f.start
        if f.skip:
            # Resuming inside a block: decode that partition's first message on
            # its own, skipping the records handed out before.
            m = msgs[i]
            tp = (m.topic(), m.partition())
            sk = f.skip.get(tp)
            if sk is not None and m.offset() >= sk[0]:
                del f.skip[tp]
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
            if tp not in out.first:
                out.first[tp] = (off, start if j == i else 0)
            out.end[tp] = (off + 1, 0)
            v = f.vals[j]
            nbytes += len(v) if v is not None else 0
        if res.partial:
            m = msgs[i + res.consumed]
            tp = (m.topic(), m.partition())
            if tp not in out.first:
                out.first[tp] = (m.offset(), start if res.consumed == 0 else 0)
            out.end[tp] = (m.offset(), res.partial)
        if res.rows:
            self.bad.good()
        for k, reason in res.bad:
            self.bad.bad(msgs[i + k], reason)
        self.value_bytes += nbytes
        self.samples += res.rows
        slot.rows += res.rows
        f.learn(res.rows, res.consumed - len(res.bad))
        f.i = i + res.consumed
        f.start = res.partial


class RecordBuilder(SlotBuilder):
    """Records one by one through the ledger's order: shuffled, packed, or both.

    What the order emits goes into the slot (fixed shapes) or into the
    ``Packer`` whose rows are the slot (``pack``).
    """

    def __init__(self, fetcher: Fetcher, ledger: OrderLedger, schema: Schema, fmt: Format,
                 bad: BadRecords, *, batch_size: int, max_wait_s: float,
                 stop: threading.Event, packer: Packer | None) -> None:
        super().__init__(fetcher, ledger, schema, fmt, bad, batch_size=batch_size,
                         max_wait_s=max_wait_s, stop=stop)
        self.order_ledger = ledger
        self.packer = packer
        self.shuffled = ledger.shuffle is not None
        self.out: deque[tuple[np.ndarray, ...]] = deque()  # emitted samples not in a slot yet
        self.drained = False   # bounded epoch: the order gave up what it held
        self.finished = False  # ... and the packer its last batch
        self.stage: dict[str, np.ndarray] = {}
        if packer is None:
            self.stage = self.schema.empty(_STAGE_ROWS, like="numpy")
            self.stage_target = self.schema.bind(self.stage)
        self.arrays: dict[int, list[np.ndarray]] = {}  # slot index -> numpy views
        ledger.on_reset = self._reset

    def _reset(self, pack_offset: int) -> None:
        """The order was rebuilt (a revoke, a loaded state): drop what was built from it."""
        if self.packer is not None:
            self.packer = Packer(self.packer.pack, self.batch_size)
            if pack_offset:
                self.packer.load_state({"docs": 0, "offset": pack_offset})
        self.out.clear()
        self.drained = self.finished = False

    def all_done(self) -> bool:
        return (self.fetcher.all_done() and self.drained and not self.out
                and (self.packer is None or self.finished))

    def fill(self, slot: Slot) -> Handoff:
        out = Handoff(self.ledger.gen)
        started = None
        f = self.fetcher
        while not self.stop.is_set():
            if out.gen != self.ledger.gen:  # a rebalance dropped what we had
                slot.rows, slot.extent, out, started = 0, {}, Handoff(self.ledger.gen), None
            if self._take_into(slot, out):
                break
            if started is None and (slot.rows or self._packing()):
                started = time.monotonic()
            if f.pending():
                self._push_pending()
            elif self.bounded and f.assigned and f.assigned <= f.done:
                if self.drained:
                    break  # the end of the epoch: a partial batch, or none
                self._drain()
            elif not self.fetch_within(started, slot.rows):
                # max_wait is over: what the packer holds goes out, its last
                # row padded, rather than wait for a whole batch.
                if self.packer is not None and not self.finished:
                    self._packed(slot, out, self.packer.next_batch(slot.target, partial=True))
                break
        return out

    def _packing(self) -> bool:
        """Whether the packer holds tokens of a batch to come."""
        return self.packer is not None and self.packer.pending_tokens > 0

    def _take_into(self, slot: Slot, out: Handoff) -> bool:
        """Move emitted records into the slot; whether it is complete."""
        packer = self.packer
        if packer is not None:
            if self.finished:
                return False
            info = packer.next_batch(slot.target)
            if info is None:
                self.finished = self.drained
                return False
            self._packed(slot, out, info)
            return True
        n = min(self.batch_size - slot.rows, len(self.out))
        if n:
            arrays = self._arrays(slot)
            for row in range(slot.rows, slot.rows + n):
                for a, v in zip(arrays, self.out.popleft()):
                    a[row] = v
            slot.rows += n
            out.acks += n
        return slot.rows == self.batch_size

    def _packed(self, slot: Slot, out: Handoff, info: PackInfo | None) -> None:
        """The packer wrote ``info`` (None: nothing) into ``slot``."""
        if info is None:
            return
        assert self.packer is not None
        slot.rows = info.rows
        slot.extent = {"cu_seqlens": info.segments + 1}
        out.acks = info.documents
        out.pack_offset = self.packer.state()["offset"]
        out.info = info

    def _arrays(self, slot: Slot) -> list[np.ndarray]:
        arrays = self.arrays.get(slot.index)
        if arrays is None:
            arrays = []
            for fd in self.schema.fields:
                t = slot.tensors[fd.name]
                if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its 2-byte words
                    t = t.view(torch.int16)
                arrays.append(t.numpy().view(fd.storage))
            self.arrays[slot.index] = arrays
        return arrays

    def _push_pending(self) -> None:
        msgs, vals = self.fetcher.take()
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
        copy = self.shuffled
        tokens, counts = docs.tokens, docs.counts.tolist()
        emitted: list[Any] = []
        d = 0
        with self.ledger.lock:
            push = self.order_ledger.order.push
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
            self.bad.good()
        for j, reason in docs.bad:
            self.bad.bad(msgs[j], reason)
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
                    self.bad.bad(m, res.bad[0][1])
                    break
                if res.rows:
                    self.bad.good()
                with self.ledger.lock:
                    for r in range(res.rows):
                        emitted += self.order_ledger.order.push(
                            tp, off, tuple(a[r].copy() for a in stage), start + r)
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
        with self.ledger.lock:
            emitted = self.order_ledger.order.drain()
        self._deliver(emitted)
        if self.packer is not None:
            self.packer.finish()
        self.drained = True
