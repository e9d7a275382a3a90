"""The build stage: pending messages -> one batch in a pool slot.

A builder fills one ``BufferPool`` slot per call of ``fill`` and describes
what it put there in a ``Handoff``: the rows, and what the ledger needs
when the batch is handed out (where its records start and end per
partition, or how many records of the order it finished). Two builders,
one interface:

- ``SlotBuilder``: messages decoded in offset order by the schema's Cython
  codec, straight into the slot (block: one memcpy per field per message);
- ``RecordBuilder``: records through the ``OrderLedger``'s order, shuffled
  or not, into the slot (fixed shapes) or into a ``Packer`` whose rows are
  the slot (``pack``). A whole fetch at a time: the codec checks it in one
  call (fixed shapes stay in their message values, held by a
  ``_codec.Held``; documents are decoded into one flat array), the order
  takes its keys as one array, and what comes out is gathered from the
  values into the slot, or fed to the packer, in one call more. In-order
  packing feeds each fetch's documents straight to the packer. Values of
  another format (Avro, Protobuf, JSON) are decoded a fetch at a time by
  the format's decoder and held as kfeed raw records, then shuffled alike.

Topics given as a ``kfeed.Mix`` go through the ``RecordBuilder`` too: the
ledger's ``Mixer`` orders each fetch's records before the shuffle buffer
takes them (``_ordered``). A new record format is a new decoder, not an
edit of the builders. A message the codec rejects goes to ``BadRecords``
and never reaches a slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from kfeed import _fetch, _pack
from kfeed.badrecords import BadRecords
from kfeed.errors import KfeedError
from kfeed.formats import RecordFormat
from kfeed.loader.fetch import POLL_S, Fetcher
from kfeed.loader.ledger import ROUND_SHIFT, Ledger, OrderLedger
from kfeed.loader.tuning import FETCH_AHEAD, FETCH_AHEAD_BYTES, fetch_ahead
from kfeed.pool import BufferPool, Slot
from kfeed.schema import Format, Schema
from kfeed.sources import TP, Position
from kfeed.tokens import Packer, PackInfo

__all__ = ["Handoff", "SlotBuilder", "RecordBuilder"]

log = logging.getLogger("kfeed.loader")

# Held message values past this many times a shuffle's records (buffer and a
# batch) are compacted (NOTE [ Held records ]).
_HELD_LIMIT = 6
# NOTE [ Fetching ahead ]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A fetch takes, besides the records the batch needs, up to 16 MiB of message
# values more of those librdkafka has fetched already: 4 batches' worth at
# least, 16 at most, and 4 under max_memory_bytes (``tuning.fetch_ahead``,
# ``Fetcher.messages_within``), without waiting for them
# (``Fetcher.fetch(ahead=)``). The work of a fetch is per call, not per
# message (one C scan, a few array operations, the order's and the mixer's
# bookkeeping), so on a backlog fewer, bigger calls cost less: a block
# topic's batch of 256 is 4 messages, and taking 4 batches at once made a
# three-topic mixture 1.4x, a shuffled stream 1.25x and the plain stream 1.1x
# faster (bench/RESULTS.md, "Fetching ahead"); 16 batches of 768 KB in place
# of 4, a mixture 1.2x faster again, the plain stream 1.05x ("A mixture's
# gather streamed, and fetching 16 MiB ahead"). The bound is the values'
# bytes, not the slot's: a slot of variable-length rows is small until it
# has grown to its records. They wait in ``pending`` as messages, and
# librdkafka fetches more in their place: at most 16 MiB (or 4 batches, if
# more) on top of its own buffers, or under ``max_memory_bytes`` 4 batches,
# which the cap counts (``tuning.prefetch_ceiling``). A caught-up stream gets
# nothing ahead, and is asked for what its batch needs.
# NOTE [ Mixture queues ]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A mixture's sources come in at the rate Kafka gives them, which is not
# their weights: librdkafka fetches every partition alike, so a source of
# weight 0.1 arrives as fast as one of 0.6 and its records queue in the
# mixer. A partition with more than its share of _MIX_QUEUE_BYTES queued
# (the bytes shared evenly by the mixed partitions, in records of the
# values' average size so far, or, for documents, of the partition's own
# documents' average size: a topic of 200 KB documents mixed with one of
# 40 B ones queued 325 MiB, in records of the 40 B ones' average; at least
# _MIX_QUEUE_BATCHES batches) is paused until half of them went out. Each
# pause costs a fetch: librdkafka drops what it fetched ahead for the
# partition and fetches it again on resume. With 1,024 records a
# partition, a three-topic mixture of 3 KB rows from a local broker paused
# 54 times in 200,000 records and ran at 0.5x the speed it reached with 3
# pauses (bench/RESULTS.md, "Mixtures against a
# broker"). librdkafka's own queue holds up to 64 MiB by default; this is
# as much again, in the mixer instead. Under max_memory_bytes the queues get
# the cap's share (tuning.held_budget); a mixture of so many partitions that
# two batches each pass it says so once, and goes on.
_MIX_QUEUE_BYTES = 64 << 20
_MIX_QUEUE_BATCHES = 2


class Handoff:
    """A batch on its way to the caller: its slot or copy, and what the ledger must know."""

    __slots__ = ("gen", "rows", "slot", "tensors", "recorded", "first", "end", "acks",
                 "pack_offset", "info", "newest_ms")

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.rows = 0
        # The filled slot until its copy exists; then the copy's tensors (on
        # CUDA, copied already: DeviceCopier.copy).
        self.slot: Slot | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.recorded: Any = None  # the stream the copy's tensors are recorded for
        # In offset order: per partition where the batch's records start and
        # where the next batch continues.
        self.first: dict[TP, Position] = {}
        self.end: dict[TP, Position] = {}
        # Through an order: records of the order it finished, tokens of the
        # next document already out, the PackInfo.
        self.acks = 0
        self.pack_offset = 0
        self.info: PackInfo | None = None
        # In offset order: the Kafka timestamp (ms) of the newest record's
        # message, for the end-to-end latency (0: not known).
        self.newest_ms = 0

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
                 stop: threading.Event, capped: bool = False) -> None:
        self.fetcher = fetcher
        self.ledger = ledger
        self.schema = schema
        self.fmt = fmt
        self.bad = bad
        self.batch_size = batch_size
        self.bounded = fetcher.bounded
        self.max_wait_s = max_wait_s
        self.stop = stop
        self.capped = capped   # under max_memory_bytes (tuning.fetch_ahead)
        self.samples = 0       # records decoded
        # Values others wrote (Avro, Protobuf): one record each, decoded by their plans.
        self.decoder = fmt.decoder(schema) if isinstance(fmt, RecordFormat) else None
        if self.decoder is not None:
            self.decoder.stop = stop  # close() ends a wait for the schema registry
        self.value_bytes = 0   # bytes of the message values decoded
        self.decode_s = 0.0    # decoding, ordering and packing, for metrics

    def all_done(self) -> bool:
        return self.fetcher.all_done()

    def held_bytes(self) -> int:
        """Bytes of records held beside the pool and librdkafka: none in offset order."""
        return 0

    def fill(self, slot: Slot) -> Handoff:
        out = Handoff(self.ledger.gen)
        started = None
        begun = time.monotonic()
        f = self.fetcher
        while slot.rows < self.batch_size and not self.stop.is_set():
            if out.gen != self.ledger.gen:  # a rebalance dropped what we had
                slot.rows, out = 0, Handoff(self.ledger.gen)
                started = None
            if not f.pending():
                if self.bounded and f.all_done():
                    break
                if slot.rows == 0 and out.end and not self.bad.holding:
                    # Read, and all rejected: their place goes on alone, now, not
                    # once records come again (NOTE [ Batches of no rows ]).
                    break
                if not self.fetch_within(started, slot.rows):
                    break
                continue
            self._decode(slot, out)
            if started is None and slot.rows:
                # The batch's clock starts when its first record may have
                # arrived, the start of the fetch that brought it, or, for
                # records left from the last batch's fetch, when this batch
                # began (a backlog still fills whole batches).
                started = max(f.pending_since, begun)
        return out

    def fetch_within(self, started: float | None, rows: int) -> bool:
        """Fetch for a batch of ``rows`` so far, since ``started``; False once max_wait is over.

        A started batch waits at most what is left of ``max_wait``, and asks
        only for the records it still needs, so a trickling stream yields
        partial batches on time. A bounded epoch's batches are all full but
        its last, however the records trickle in: there max_wait does not apply.
        """
        f = self.fetcher
        self.bad.waiting()
        # (Nothing ahead while the records a message holds are not known yet.)
        ahead = 0
        if f.learned:
            # FETCH_AHEAD batches; beyond that, up to FETCH_AHEAD_BYTES of values.
            ahead = max(self.fetch_size(FETCH_AHEAD * self.batch_size),
                        min(self.fetch_size(fetch_ahead(self.capped) * self.batch_size),
                            f.messages_within(FETCH_AHEAD_BYTES)))
        if started is None:
            # Streaming, a fetch waits no longer than max_wait for its first
            # records, so a batch's first record never waits longer in it.
            f.fetch(self.fetch_size(self.batch_size),
                    POLL_S if self.bounded else min(POLL_S, self.max_wait_s), ahead=ahead)
            return True
        need = self.batch_size - rows
        if self.bounded:
            f.fetch(self.fetch_size(need), ahead=ahead)
            return True
        left = self.max_wait_s - (time.monotonic() - started)
        if left <= 0:
            return False
        f.fetch(self.fetch_size(need), min(POLL_S, left))
        return True

    def fetch_size(self, rows: int) -> int:
        """Messages to ask for, for about ``rows`` more records."""
        return self.fetcher.messages_for(rows)

    def _decode(self, slot: Slot, out: Handoff) -> None:
        t = time.monotonic()
        try:
            self._decode_pending(slot, out)
        finally:
            self.decode_s += time.monotonic() - t

    def _decode_pending(self, slot: Slot, out: Handoff) -> None:
        f = self.fetcher
        msgs, i = f.msgs, f.i
        # No more messages than the slot has rows left: each holds a record
        # at least, and a decode looks at every value it is given (a fetch
        # ahead of one event a message holds thousands).
        vals = f.vals[i:i + self.batch_size - slot.rows]
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
        if self.decoder is not None and self.decoder.batches:  # many records a message
            res = self.decoder.decode_into(vals, slot.target, slot.rows, start=start, split=True)
        elif self.decoder is not None:
            res = self.decoder.decode_into(vals, slot.target, slot.rows)
        else:
            res = self.schema.decode_into(vals, slot.target, slot.rows, self.fmt,
                                          start=start, split=True)
        # Per run of one partition (``Fetcher.runs``), not per message.
        for tp, a, b in f.spans(i, i + res.consumed):
            if tp not in out.first:
                out.first[tp] = (msgs[a].offset(), start if a == i else 0)
            out.end[tp] = (msgs[b - 1].offset() + 1, 0)
            out.newest_ms = max(out.newest_ms, msgs[b - 1].timestamp()[1])
        nbytes = _fetch.value_bytes(f.vals, i, i + res.consumed)
        if res.partial:
            m = msgs[i + res.consumed]
            tp = (m.topic(), m.partition())
            if tp not in out.first:
                out.first[tp] = (m.offset(), start if res.consumed == 0 else 0)
            out.end[tp] = (m.offset(), res.partial)
            # (a batch inside one message has its records' time: it was not observed)
            out.newest_ms = max(out.newest_ms, m.timestamp()[1])
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
    """Records through the ledger's order, a fetch at a time: shuffled, packed, or both.

    What the order emits goes into the slot (fixed shapes, gathered straight
    from the message values that ``held`` keeps) or into the ``Packer``
    whose rows are the slot (``pack``). The order sees each record as a row
    ``[partition id, offset, index in the message, item]``; the item names
    the record in ``held`` (NOTE [ Held records ]), or is its document
    number here.
    """

    def __init__(self, fetcher: Fetcher, ledger: OrderLedger, schema: Schema, fmt: Format,
                 bad: BadRecords, *, batch_size: int, max_wait_s: float,
                 stop: threading.Event, packer: Packer | None,
                 held_bytes: tuple[int, int] | None = None, capped: bool = False) -> None:
        super().__init__(fetcher, ledger, schema, fmt, bad, batch_size=batch_size,
                         max_wait_s=max_wait_s, stop=stop, capped=capped)
        self.order_ledger = ledger
        self.packer = packer
        self.shuffled = ledger.shuffle is not None
        # A mixture: records queue in the mixer before the order (kfeed.mix),
        # up to mix_bytes (NOTE [ Mixture queues ]). With max_memory_bytes,
        # ``held_bytes`` is what held records may take, and of those what the
        # mixture's queues may (tuning.held_budget).
        self.mixer = ledger.mixer
        self.mix_bytes = _MIX_QUEUE_BYTES if held_bytes is None else \
            min(_MIX_QUEUE_BYTES, held_bytes[1])
        self.mix_capped = held_bytes is not None  # mix_bytes is max_memory_bytes's share
        self.mix_floor_warned = False
        # Records a partition, see _backpressure (none queue without a mixer).
        self.mix_queue = self._mix_queue(1) if self.mixer is not None else 0
        # Documents differ in size from topic to topic: per partition id, the
        # bytes and the documents pushed so far, for its share in records.
        self.pid_bytes = np.zeros(0, np.int64)
        self.pid_docs = np.zeros(0, np.int64)
        self.paused: set[TP] = set()  # partitions paused while the mixture catches up
        # Those to resume once the order was rebuilt, by this thread (``_reset``).
        self.unpause: set[TP] = set()
        # (Not resumed by the fetcher's serving: NOTE [ Serving ] in loader/fetch.py.)
        fetcher.kept_paused, fetcher.mixer = self.paused, self.mixer
        self.warned_absent: set[str] = set()
        self.mix_synced: tuple[int, int, int, int] | None = None  # see _sync_mixer
        # A variable-length field without pack: batches of its elements and
        # offsets (NOTE [ Jagged fields ]); decoded documents wait in ``jagged``.
        self.jagged_field = schema.varlen if packer is None else None
        self.jagged: deque[list[Any]] = deque()
        self.doc_rows: dict[int, dict[str, np.ndarray]] = {}
        self.drained = False   # bounded epoch: the order gave up what it held
        self.finished = False  # ... and the packer its last batch
        self.packed_docs = 0   # documents of the packer's batches, acknowledged
        # Fixed shapes: the records' values, and the items emitted, not in a
        # slot yet (pending[taken:]).
        self.held = None
        if packer is None and self.jagged_field is None:
            size = ledger.shuffle.buffer if ledger.shuffle is not None else 0
            if self.mixer is not None:  # and what the mixture queues
                size += self.mix_queue
            # Values others wrote are held as kfeed raw records (NOTE [ Held records ]).
            limit = _HELD_LIMIT * (size + batch_size) * schema.record_size
            self.held = schema.hold(fmt if self.decoder is None
                                    else Format.BLOCK if self.decoder.batches else Format.RAW,
                                    limit=limit if held_bytes is None else min(limit, held_bytes[0]))
            # Another format's fetch decoded here first, and its bound form.
            self.staging: dict[str, np.ndarray] = {}
            self.staging_target: Any = None
        self.pending = np.empty(0, np.int64)
        self.taken = 0
        # Documents: those the order holds (shuffle, or a loaded state coming
        # back), by number.
        self.docs: dict[int, np.ndarray] = {}
        # A mixture in order keeps them in the fetches they came in instead:
        # documents go out a few at a time, gathered without a step per document.
        self.fetches = (_Fetches() if self.mixer is not None and not self.shuffled
                        and packer is not None else None)
        self.next_doc = 0
        ledger.on_reset = self._reset

    def fetch_size(self, rows: int) -> int:
        # Documents are learned in rows too: packed rows' worth of tokens a
        # message, or jagged rows (documents) a message (_push_documents).
        n = self.fetcher.messages_for(rows)
        # A mixture needs every source's records: a message from each
        # partition at least, for a fetch that holds one batch's worth.
        mixing = self.order_ledger.mixer is not None and self.order_ledger.mixer.mixes
        return max(n, len(self.fetcher.assigned)) if mixing else n

    def _reset(self, pack_offset: int) -> None:
        """The order was rebuilt (a revoke, a loaded state): drop what was built from it."""
        if self.packer is not None:
            self.packer = Packer(self.packer.pack, self.batch_size)
            if pack_offset:
                self.packer.load_state({"docs": 0, "offset": pack_offset})
        self.pending, self.taken = np.empty(0, np.int64), 0
        if self.held is not None:
            self.held.clear()
        self.docs.clear()
        if self.fetches is not None:
            self.fetches = _Fetches()
        self.jagged.clear()
        self.doc_rows.clear()
        self.drained = self.finished = False
        self.packed_docs = 0
        if self.mixer is not None:
            self.mixer.reset()
            self.mix_synced = None
            # Resumed at this thread's next fill, not here: a revoke the caller
            # gives up at its step runs this on the caller's thread, whose call
            # into the consumer would wait for this thread, itself inside
            # consume() waiting for the caller (NOTE [ One thread calls the
            # consumer ] in kfeed/loader/__init__.py). (Under the ledger's lock.)
            self.unpause |= self.paused
            self.paused.clear()  # (in place: the fetcher's kept_paused too)

    def all_done(self) -> bool:
        f = self.fetcher
        return (self._input_over() and (self.mixer is not None or not f.pending())
                and self.drained and self.taken == len(self.pending)
                and not self.jagged and (self.packer is None or self.finished))

    def held_bytes(self) -> int:
        """Bytes of records the order holds: a shuffle's or a mixture's values and documents.

        Read from the caller's thread while this one works: a moment's figure.
        """
        n = self.held.nbytes if self.held is not None else 0
        if self.fetches is not None:
            n += sum(int(entry[0].nbytes) for entry in list(self.fetches.held.values()))
        return n + sum(int(d.nbytes) for d in list(self.docs.values()))

    def _input_over(self) -> bool:
        """A bounded read: no record will come into the order any more."""
        if self.mixer is not None:  # (a loaded state's records still coming back count)
            return self.mixer.ended and not self.order_ledger.order.restoring
        f = self.fetcher
        return bool(f.assigned) and f.assigned <= f.done

    def fill(self, slot: Slot) -> Handoff:
        out = Handoff(self.ledger.gen)
        started = None
        begun = time.monotonic()
        f = self.fetcher
        while not self.stop.is_set():
            if out.gen != self.ledger.gen:  # a rebalance dropped what we had
                slot.rows, slot.extent, out, started = 0, {}, Handoff(self.ledger.gen), None
            if self.unpause:
                self._unpause()
            if self.drained and not self._input_over():
                self._reopen()
            if self._take_into(slot, out):
                break
            if started is None and (slot.rows or self._packing()):
                # As SlotBuilder.fill: from the start of the fetch that brought
                # the first record, not its end (up to POLL_S later: a batch
                # of a trickling stream went out max_wait + 0.1 s after it).
                started = max(f.pending_since, begun)
            if f.pending():
                self._push_pending()
            elif self._read_again():
                continue
            elif self.mixer is not None and self._mix_more():
                continue
            elif self.bounded and self._input_over():
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
        if self.jagged_field is not None:
            return self._take_jagged(slot, out)
        packer = self.packer
        if packer is not None:
            if self.finished:
                return False
            info = packer.next_batch(slot.target)
            if info is None:
                self.finished = self.drained
                # Empty documents after the read's last batch went with none:
                # acknowledged with no rows, or their commit stays before them
                # (NOTE [ Batches of no rows ]).
                out.acks = packer.state()["docs"] - self.packed_docs
                self.packed_docs += out.acks
                return out.acks > 0
            self._packed(slot, out, info)
            # The read's last batch is known as such now, not at the next call:
            # drop_last looks at all_done() before that (a short last batch
            # holds every document left, empty ones included).
            if self.drained and (info.rows < self.batch_size or not packer.pending_documents):
                self.finished = True
            return True
        n = min(self.batch_size - slot.rows, len(self.pending) - self.taken)
        if n:
            assert self.held is not None
            self.held.gather(self.pending[self.taken:self.taken + n], slot.target.out,
                             slot.rows)
            self.taken += n
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
        self.packed_docs += info.documents
        out.pack_offset = self.packer.offset
        out.info = info

    def _push_pending(self) -> None:
        t = time.monotonic()
        try:
            self._push_fetch()
            self._backpressure()
        finally:
            self.decode_s += time.monotonic() - t

    def _push_fetch(self) -> None:
        msgs, vals, runs = self.fetcher.take()
        self.value_bytes += _fetch.value_bytes(vals, 0, len(vals))
        order = self.order_ledger.order
        with self.ledger.lock:  # per run of one partition, not per message
            ids = [order.pid(tp) for _s, _e, tp in runs]
        pids = np.repeat(np.array(ids, np.int64), [e - s for s, e, _tp in runs])
        offsets = np.fromiter((m.offset() for m in msgs), np.int64, len(msgs))
        rounds = self.order_ledger.rounds
        if self.mixer is not None and any(rounds.values()):  # NOTE [ Rounds ] in ledger.py
            offsets += np.repeat(np.array([rounds.get(tp, 0) << ROUND_SHIFT
                                           for _s, _e, tp in runs], np.int64),
                                 [e - s for s, e, _tp in runs])
        if self.packer is not None or self.jagged_field is not None:
            self._push_documents(msgs, vals, pids, offsets)
        else:
            self._push_samples(msgs, vals, pids, offsets)

    def _push_documents(self, msgs: list[Any], vals: list[Any], pids: np.ndarray,
                        offsets: np.ndarray) -> None:
        docs = (self.decoder.decode_documents(vals) if self.decoder is not None
                else self.schema.decode_documents(vals, self.fmt))
        n = len(docs.lengths)
        first = self.next_doc
        self.next_doc += n
        # What a message holds, in the rows a batch is counted in: packed
        # rows of tokens (and an EOS each), or documents.
        rows = (int(docs.lengths.sum()) + n) / self.packer.pack.seq_len \
            if self.packer is not None else n
        self.fetcher.learn(rows, len(vals) - len(docs.bad), least=1e-4)
        recs = _pack.records(pids, offsets, docs.counts, first)
        if self.mixer is not None and n:
            self._count_sizes(recs[:, 0], docs.lengths)
        with self.ledger.lock:
            order = self.order_ledger.order
            # In order, a loaded state's documents come back in its order,
            # which need not be this fetch's; a mixture's come in its own.
            direct = not (self.shuffled or order.restoring or self.docs or self.mixer
                          or self.order_ledger.partial)
            emitted, skipped = self._ordered(recs)
        self.samples += n
        if n:
            self.bad.good(self._topics_of(recs) if self.bad.per_topic else None)
        for j, reason in docs.bad:
            self.bad.bad(msgs[j], reason)
        ids = emitted[:, 3]
        if direct:
            # In order and nothing held back: the fetch's documents go to the
            # packer (or wait for jagged batches) in one call, less any repeats.
            tokens, lengths, columns = docs.tokens, docs.lengths, docs.columns
            if len(ids) < n:
                keep = np.zeros(n, np.bool_)
                keep[ids - first] = True
                tokens, lengths = tokens[np.repeat(keep, lengths)], lengths[keep]
                columns = {k: v[keep] for k, v in columns.items()}
            if not len(lengths):
                return
            if self.packer is not None:
                self.packer.feed(tokens, lengths, copy=False)
            else:
                self._queue_jagged(columns, tokens, lengths,
                                   self._places(msgs, docs.counts, recs, ids - first))
            return
        if self.fetches is not None:
            self.fetches.add(first, docs.tokens, docs.lengths)
            # Skipped documents, repeats, will never be asked for; some are of
            # earlier fetches (queued in the mixer before they were found so).
            self.fetches.drop(skipped)
            self._deliver(emitted)
            return
        # The order holds documents back (a shuffle, a loaded state coming
        # back): each is kept apart, copied out of the fetch when a shuffle
        # may hold it for long.
        gone = set(skipped.tolist())
        ends = np.cumsum(docs.lengths).tolist()
        start = 0
        tokens = docs.tokens
        for d, end in enumerate(ends):
            if first + d not in gone:
                doc = tokens[start:end]
                self.docs[first + d] = doc.copy() if self.shuffled else doc
                if self.jagged_field is not None:
                    self.doc_rows[first + d] = {k: v[d] for k, v in docs.columns.items()}
            start = end
        self._deliver(emitted)

    def _push_samples(self, msgs: list[Any], vals: list[Any], pids: np.ndarray,
                      offsets: np.ndarray) -> None:
        # NOTE [ Held records ]
        # ~~~~~~~~~~~~~~~~~~~~~
        # A shuffled record stays in its message value until it goes into a
        # slot: ``held`` keeps every value with a record the order holds, or
        # that waits in ``pending``, and ``gather`` copies the records the
        # order picks straight from the values into the slot (one copy, as
        # in offset order). A value goes once its last record is gathered,
        # skipped as a repeat, or dropped with the order (``_reset``). So
        # what is held is bounded by the order: at most one value per record
        # it holds, ``buffer + batch_size`` of them. A reservoir of B records
        # fed k records per value holds about B * (ln k + 0.58) records'
        # worth of values, a value's last survivors keeping it whole: 4.7 B
        # for k = 64, where a staging ring of decoded rows held 2.2 B. Past
        # ``_HELD_LIMIT * (buffer + batch_size)`` records' worth (many
        # records per value, or an unlucky order), the values with a quarter
        # of their bytes or less left are compacted: those records are
        # copied out, their items unchanged, and the value goes. Compacting
        # sooner costs the copy it saves: at 2x, 15% of the shuffle's speed.
        # Values of another format (Avro, Protobuf, JSON) are decoded first,
        # the whole fetch in one call, and held as kfeed raw records: the
        # shuffle then works on them as on kfeed's own.
        held = self.held
        assert held is not None
        nvals = len(vals)
        if self.decoder is not None and self.decoder.batches:
            vals, pids, offsets, msgs = self._as_blocks(msgs, vals, pids, offsets)
        elif self.decoder is not None:
            vals, pids, offsets, msgs = self._as_raw(msgs, vals, pids, offsets)
        rejected = nvals - len(vals)
        recs, _counts, bad = held.add(vals, pids, offsets)
        for j, reason in bad:
            self.bad.bad(msgs[j], reason)
        with self.ledger.lock:
            emitted, skipped = self._ordered(recs)
        if len(skipped):
            held.drop(skipped)
        self._deliver(emitted)
        n = len(recs)
        if n:
            self.bad.good(self._topics_of(recs) if self.bad.per_topic else None)
        self.samples += n
        self.fetcher.learn(n, nvals - rejected - len(bad))

    def _topics_of(self, recs: np.ndarray) -> set[str]:
        """The topics of ``recs`` (rows of a pid first): per partition, not per record
        (a mixture's topic stays unproven for its whole read if it gives none)."""
        order = self.order_ledger.order
        pids = recs[:, 0]
        if not len(pids):
            return set()
        # The first of each run of one partition (a fetch's records come in
        # runs): no sort of every record, as np.unique made (4 ms a fetch of
        # 200,000 records, while no record of a mixture's topic had come yet).
        firsts = pids[np.flatnonzero(np.concatenate(([True], pids[1:] != pids[:-1])))]
        return {order.partition(p)[0] for p in set(firsts.tolist())}

    # -- a mixture (kfeed.mix) ----------------------------------------------------

    def _ordered(self, recs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Records into the order, through the mixer if there is one (under the ledger's lock)."""
        order = self.order_ledger.order
        mixer = self.mixer
        if len(recs):
            self.order_ledger.note_ends(recs)
        if mixer is None:
            return order.push_many(recs)
        self._sync_mixer()
        # Records another reader used (NOTE [ Commit notes ]), or this read's
        # window starts after (NOTE [ Rounds ]), take no turn in the mixture.
        recs, used = order.screen(recs)
        recs, before = self.order_ledger.before_window(recs)
        if len(before):
            used = np.concatenate([used, before])
        passed = mixer.push(recs, *order.arrived())
        emitted, skipped = order.push_many(passed)
        if len(used):
            skipped = np.concatenate([used, skipped])
        if mixer.repeats:  # queued twice: freed as the order's repeats are
            skipped = np.concatenate([skipped, *mixer.repeats])
            mixer.repeats.clear()
        if order.restoring:
            # The records of a loaded state are not all back: the mixture
            # waits, so that its draws stay those of the run that saved it.
            return emitted, skipped
        mixed = mixer.take()
        if not len(mixed):
            return emitted, skipped
        more, again = order.push_many(mixed)
        return np.concatenate([emitted, more]), np.concatenate([skipped, again])

    def _sync_mixer(self, *, force: bool = False) -> None:
        """The mixer's partitions are the assignment's; those read to their end are done."""
        mixer, f, order = self.mixer, self.fetcher, self.order_ledger.order
        assert mixer is not None
        # The assignment changes only with a rebalance; done partitions only
        # grow (but for a source read again, which forces this).
        now = self._mix_signature()
        if now == self.mix_synced and not force:
            return
        self.mix_synced = now
        # (A partition about to be read again is not done: NOTE [ Rounds ].)
        pending = self.order_ledger.pending_rounds
        mixer.done([order.pid(tp) for tp in f.done if tp in f.assigned and tp not in pending])
        if not self.bounded:  # at their end for now: their turns pass (kfeed.mix)
            mixer.idle([order.pid(tp) for tp in f.at_end if tp in f.assigned])
        mixer.assign({tp: order.pid(tp) for tp in f.assigned}, force=force)
        absent = [t for t in mixer.absent() if t not in self.warned_absent]
        if absent and f.assigned:
            self.warned_absent.update(absent)
            log.warning("this loader holds no partition of %s: the mixture goes on "
                        "without them, in the others' proportions", absent)

    def _mix_signature(self) -> tuple[int, int, int, int]:
        """What changes when the assignment, the partitions read to their end, or
        those at their end for now do."""
        f = self.fetcher
        return (f.rebalances, len(f.assigned), len(f.done), f.ends_seen)

    def _mix_more(self) -> bool:
        """Nothing pending: let out what the mixer can now; whether anything changed.

        Partitions read to their end since the last fetch can end a source, or
        let its turn pass to the next partition; so can one at its end for now.
        """
        mixer = self.mixer
        assert mixer is not None
        if mixer.ended or self._mix_signature() == self.mix_synced \
                or self.order_ledger.order.restoring:
            return False  # nothing changed since the last take, or a state is coming back
        with self.ledger.lock:
            self._sync_mixer()
            mixed = mixer.take()
            emitted, _skipped = self.order_ledger.order.push_many(mixed) if len(mixed) \
                else (mixed, mixed)
        self._deliver(emitted)
        if mixer.ended and not self.order_ledger.order.restoring:
            # "stop": the other sources' records stay unread.
            self.fetcher.source.pause(sorted(self.fetcher.assigned))
        self._backpressure()
        return bool(len(mixed)) or mixer.ended

    def _read_again(self) -> bool:
        """Mix(exhausted="repeat"): a source ran out; read its partitions again, a round on.

        Called with nothing pending, so no record fetched in the last round
        is keyed in the next. Whether a partition started again.
        """
        mixer, f, ledger = self.mixer, self.fetcher, self.order_ledger
        if mixer is None or (mixer.to_repeat is None and not ledger.pending_rounds):
            return False
        with ledger.lock:
            if mixer.to_repeat is not None:
                topic = mixer.sources[mixer.to_repeat]
                mine = [tp for tp in f.assigned if tp[0] == topic]
                if mine:  # (none assigned yet: once they are)
                    mixer.to_repeat = None
                for tp in mine:  # the round after the last one the order took records of
                    read = ledger.order.read_position(tp)
                    last = max(ledger.rounds.get(tp, 0),
                               read[0] >> ROUND_SHIFT if read is not None else 0)
                    ledger.pending_rounds[tp] = max(ledger.pending_rounds.get(tp, 0), last + 1)
            # Each once read to its end, a round at a time: a loaded state's
            # partition reads the records of the rounds it held back first.
            tps = sorted(tp for tp in ledger.pending_rounds if tp in f.done)
            if not tps:
                return False
            seek = []
            for tp in tps:
                ledger.rounds[tp] = ledger.rounds.get(tp, 0) + 1
                if ledger.rounds[tp] >= ledger.pending_rounds[tp]:
                    del ledger.pending_rounds[tp]
                if ledger.window[tp] < f.ends.get(tp, ledger.window[tp] + 1):
                    f.done.discard(tp)
                    seek.append(tp)
                # (An empty window: nothing to read in any round; it stays done.)
            self._sync_mixer(force=True)
            # The mixer takes again, even if nothing is read again: a source
            # whose every partition here has an empty window (after a
            # rebalance or an elastic resume) runs out again at once.
            self.mix_synced = None
        if seek:
            log.info("mixture: reading %s again from %s", seek,
                     {tp: ledger.window[tp] for tp in seek})
            f.rewind({tp: ledger.window[tp] for tp in seek})
            self.paused.difference_update(seek)
            f.source.resume(seek)
        return True

    def _mix_queue(self, partitions: int, size: int | None = None) -> int:
        """Records one of ``partitions`` mixed partitions may queue, records of ``size``
        bytes (default: the values' average so far; NOTE [ Mixture queues ])."""
        if size is None:
            size = self.value_bytes // self.samples if self.samples else self.schema.record_size
        size = max(1, size)
        least = _MIX_QUEUE_BATCHES * self.batch_size
        share = self.mix_bytes // (max(1, partitions) * size)
        if share < least and self.mix_capped and not self.mix_floor_warned:
            self.mix_floor_warned = True
            log.warning("max_memory_bytes leaves the mixture's queues %d bytes, and each of "
                        "its %d partitions queues %d batches at least (%d records of about %d "
                        "bytes): up to %d bytes. A larger max_memory_bytes, a smaller "
                        "batch_size or fewer partitions keep them within it", self.mix_bytes,
                        partitions, _MIX_QUEUE_BATCHES, least, size, partitions * least * size)
        return max(least, share)

    def _count_sizes(self, pids: np.ndarray, lengths: np.ndarray) -> None:
        """Add a fetch's documents (their partition ids, their lengths) to each
        partition's sizes."""
        k = int(pids.max()) + 1
        if k > len(self.pid_docs):
            grow = k - len(self.pid_docs)
            self.pid_bytes = np.concatenate([self.pid_bytes, np.zeros(grow, np.int64)])
            self.pid_docs = np.concatenate([self.pid_docs, np.zeros(grow, np.int64)])
        element = np.dtype(self.schema.varlen.storage).itemsize
        self.pid_bytes[:k] += np.bincount(pids, lengths * element + self.schema.record_size,
                                          k).astype(np.int64)
        self.pid_docs[:k] += np.bincount(pids, minlength=k)

    def _queue_limits(self, parts: dict[int, TP]) -> dict[int, int]:
        """Records each mixed partition may queue: a share of mix_bytes in records of its
        own documents' size where it has some (records of fixed shapes are all alike)."""
        limits = {}
        for pid in parts:
            docs = self.pid_docs[pid] if pid < len(self.pid_docs) else 0
            limits[pid] = self.mix_queue if not docs else \
                self._mix_queue(len(parts), int(self.pid_bytes[pid] // docs))
        return limits

    def _backpressure(self) -> None:
        """Pause the partitions whose records queue in the mixer; resume them once half went."""
        mixer = self.mixer
        if mixer is None or mixer.ended:
            return
        queued = mixer.queued()
        parts = mixer.partitions()
        self.mix_queue = self._mix_queue(len(parts))
        if not len(self.pid_docs) and not self.paused and \
                queued.max(initial=0) <= self.mix_queue:
            return
        limits = self._queue_limits(parts)
        over, under = [], []
        for pid, tp in parts.items():
            n = queued[pid] if pid < len(queued) else 0
            if n > limits[pid] and tp not in self.paused:
                over.append(tp)
            elif n <= limits[pid] // 2 and tp in self.paused:
                under.append(tp)
        if over:
            self.paused.update(over)
            self.fetcher.source.pause(over)
        self._resume(under)

    def _resume(self, tps: Any) -> None:
        tps = [tp for tp in tps if tp in self.paused]
        self.paused.difference_update(tps)
        self._read_on(tps)

    def _unpause(self) -> None:
        """Resume what a rebuilt order's ``_reset`` left paused, but those paused again."""
        with self.ledger.lock:
            tps, self.unpause = self.unpause, set()
        self._read_on([tp for tp in tps if tp not in self.paused])

    def _read_on(self, tps: list[TP]) -> None:
        """Resume ``tps``, those still assigned and not read to their end."""
        again = [tp for tp in tps if tp in self.fetcher.assigned and tp not in self.fetcher.done]
        if again:
            self.fetcher.source.resume(again)

    def _as_raw(self, msgs: list[Any], vals: list[Any], pids: np.ndarray, offsets: np.ndarray
                ) -> tuple[list[Any], np.ndarray, np.ndarray, list[Any]]:
        """A fetch of another format's values as kfeed raw values, its bad ones routed out."""
        assert self.decoder is not None
        n = len(vals)
        have = len(next(iter(self.staging.values()))) if self.staging else 0
        if have < n:
            self.staging = self.schema.empty(max(n, 2 * have), like="numpy")
            self.staging_target = self.schema.bind(self.staging)
        res = self.decoder.decode_into(vals, self.staging_target, 0)
        keep, kept = self._route_bad(msgs, res.bad)
        raw = self.schema.encode_raw({name: a[:res.rows] for name, a in self.staging.items()})
        return raw, pids[keep], offsets[keep], kept

    def _as_blocks(self, msgs: list[Any], vals: list[Any], pids: np.ndarray,
                   offsets: np.ndarray) -> tuple[list[Any], np.ndarray, np.ndarray, list[Any]]:
        """A fetch of Arrow values as kfeed blocks, one a message, its bad ones routed out."""
        assert self.decoder is not None
        blocks, bad = self.decoder.blocks(vals)
        keep, kept = self._route_bad(msgs, bad)
        return blocks, pids[keep], offsets[keep], kept

    def _route_bad(self, msgs: list[Any], bad: list[tuple[int, str]]) -> tuple[Any, list[Any]]:
        """The bad messages of a fetch to ``BadRecords``; which of its rows stay, and their
        messages."""
        if not bad:
            return slice(None), msgs
        mask = np.ones(len(msgs), np.bool_)
        for j, reason in bad:
            mask[j] = False
            self.bad.bad(msgs[j], reason)
        return mask, [m for m, k in zip(msgs, mask.tolist(), strict=True) if k]

    def _deliver(self, emitted: np.ndarray) -> None:
        """The order emitted these records (rows ``[pid, offset, sub, item]``): on to the batch."""
        if not len(emitted):
            return
        ids = emitted[:, 3]
        if self.packer is None and self.jagged_field is None:
            rest = self.pending[self.taken:]
            self.pending, self.taken = np.concatenate([rest, ids]), 0
            return
        cut = self._cuts(emitted)
        if self.fetches is not None:
            assert self.packer is not None
            self.fetches.feed(self.packer, ids, cut)
            return
        order = ids.tolist()
        docs = [self.docs.pop(i) for i in order]
        if cut is not None:
            docs = [d[c:] for d, c in zip(docs, cut.tolist(), strict=True)]
        lengths = np.fromiter((len(x) for x in docs), np.int64, len(docs))
        if self.jagged_field is not None:
            rows = [self.doc_rows.pop(i) for i in order]
            columns = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
            self._queue_jagged(columns, np.concatenate(docs), lengths)
            return
        assert self.packer is not None
        self.packer.feed(np.concatenate(docs), lengths, copy=False, owed=_owed(cut, lengths))

    def _cuts(self, emitted: np.ndarray) -> np.ndarray | None:
        """Tokens to cut from the front of each document: those already out (NOTE [ Elastic resume ])."""
        partial = self.order_ledger.partial
        if not partial:
            return None
        order = self.order_ledger.order
        cut = np.zeros(len(emitted), np.int64)
        for (tp, off, sub), n in partial.items():
            pid = order.known_pid(tp)
            if pid is not None:
                cut[(emitted[:, 0] == pid) & (emitted[:, 1] == off) & (emitted[:, 2] == sub)] = n
        return cut if cut.any() else None

    # NOTE [ Jagged fields ]
    # ~~~~~~~~~~~~~~~~~~~~~~
    # A variable-length field without pack comes out as two tensors: NAME,
    # the batch's records' elements one after another, and NAME_offsets,
    # batch + 1 int64 where record i's elements are NAME[off[i]:off[i+1]]
    # (torch.nested.nested_tensor_from_jagged takes them as they are). Its
    # records go through the OrderLedger in offset order, as packed
    # documents do, so state_dict() is exact and a block cut between
    # batches resumes inside it. The slot's elements tensor starts at
    # JAGGED_START per record and grows (Slot.grow) when a batch needs more.

    def _queue_jagged(self, columns: dict[str, np.ndarray], tokens: np.ndarray,
                      lengths: np.ndarray, places: np.ndarray | None = None) -> None:
        starts = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        self.jagged.append([columns, tokens, starts, 0, places])

    @staticmethod
    def _places(msgs: list[Any], counts: np.ndarray, recs: np.ndarray,
                taken: np.ndarray) -> np.ndarray:
        """Where records ``taken`` (rows of ``recs``, ``counts[j]`` of message ``j``) lie,
        for batches in offset order: rows ``[pid, offset, index in the message, whether
        the message's last, the message's time (ms)]``."""
        last = np.ones(len(recs), np.int64)
        last[:-1] = (recs[1:, 0] != recs[:-1, 0]) | (recs[1:, 1] != recs[:-1, 1])
        ms = np.fromiter((m.timestamp()[1] for m in msgs), np.int64, len(msgs))
        of = np.repeat(np.arange(len(msgs)), counts)
        return np.column_stack([recs[taken, :3], last[taken], ms[of[taken]]])

    def _take_jagged(self, slot: Slot, out: Handoff) -> bool:
        """Move waiting records into the slot; whether it is complete."""
        f = self.jagged_field
        assert f is not None
        name, offsets_name = f.name, f"{f.name}_offsets"
        while slot.rows < self.batch_size and self.jagged:
            chunk = self.jagged[0]
            columns, tokens, starts, at, places = chunk
            k = min(self.batch_size - slot.rows, len(starts) - 1 - at)
            if places is not None:
                self._place(places[at:at + k], out)
            row = slot.rows
            for field, col in columns.items():
                _host(slot.tensors[field])[row:row + k] = col[at:at + k]
            used = slot.extent.get(name, 0)
            a, b = int(starts[at]), int(starts[at + k])
            if used + b - a > len(slot.tensors[name]):
                slot.grow(name, used + b - a, slot.tensors[name].is_pinned())
            _host(slot.tensors[name])[used:used + b - a] = tokens[a:b]
            offs = _host(slot.tensors[offsets_name])
            if row == 0:
                offs[0] = 0
            offs[row + 1:row + k + 1] = starts[at + 1:at + k + 1] - a + used
            slot.extent = {name: used + b - a, offsets_name: row + k + 1}
            slot.rows += k
            out.acks += k
            chunk[3] = at + k
            if at + k == len(starts) - 1:
                self.jagged.popleft()
        return slot.rows == self.batch_size

    def _place(self, places: np.ndarray, out: Handoff) -> None:
        """Records in offset order (rows of ``_places``) go into ``out``: its offsets and time."""
        order = self.order_ledger.order
        for pid in np.unique(places[:, 0]).tolist():
            mine = places[places[:, 0] == pid]
            tp = order.partition(pid)
            if tp not in out.first:
                out.first[tp] = (int(mine[0, 1]), int(mine[0, 2]))
            _pid, off, sub, last, _ms = mine[-1].tolist()
            out.end[tp] = (off + 1, 0) if last else (off, sub + 1)
        out.newest_ms = max(out.newest_ms, int(places[:, 4].max()))

    def _reopen(self) -> None:
        """Drained, then given more partitions (an incremental assign, which revokes
        nothing and so resets nothing): their records come through the order and the
        packer as before the drain, and the read ends once they are done too. (They
        went into the order and stayed there, and the read ended without them; packed,
        the packer refused them.)"""
        self.drained = self.finished = False
        if self.packer is not None:
            self.packer.reopen()

    def _drain(self) -> None:
        with self.ledger.lock:
            emitted = self.order_ledger.order.drain_many()
        self._deliver(emitted)
        if self.packer is not None:
            self.packer.finish()
        self.drained = True


class _Fetches:
    """Decoded documents kept in the fetches they came in, by number, until they go out.

    A fetch's documents are numbered ``first, first + 1, ...`` (the items the
    order sees); ``feed(packer, ids)`` hands any of them, from any fetches, in
    the order given, to the packer, with a few numpy calls and one C call
    whatever the number of documents and fetches; no token moves until the
    packer copies it into the batch. A fetch goes once every document of it
    went out or was skipped. The fetches' firsts stay in an array, in the order they came
    (ascending), gone ones too until they outnumber those held.
    """

    def __init__(self) -> None:
        self.held: dict[int, list[Any]] = {}  # first -> [tokens, starts, documents left]
        self._firsts = np.empty(64, np.int64)  # of the fetches, [:_n]; some may be gone
        self._n = 0

    def add(self, first: int, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        starts = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        self.held[first] = [tokens, starts, len(lengths)]
        if self._n == len(self._firsts):
            gone = self._n - len(self.held) + 1
            if gone > self._n // 2:  # mostly gone ones: keep those held
                kept = np.array(sorted(self.held)[:-1], np.int64)
                self._firsts[:len(kept)] = kept
                self._n = len(kept)
            else:
                self._firsts = np.concatenate([self._firsts, np.empty(self._n, np.int64)])
        self._firsts[self._n] = first
        self._n += 1

    def drop(self, ids: np.ndarray) -> None:
        """Documents ``ids``, of any fetches held, will never go out: their fetches go sooner.

        (One of a fetch gone already is passed over: nothing of it is held.)
        """
        if not len(ids):
            return
        firsts = self._firsts[:self._n]
        at = np.searchsorted(firsts, ids, side="right") - 1
        keys = [k for k in firsts[np.unique(at[at >= 0])].tolist() if k in self.held]
        ends = [k + len(self.held[k][1]) - 1 for k in keys]  # past each one's documents
        self._gone(keys, [int(np.count_nonzero((ids >= k) & (ids < end)))
                          for k, end in zip(keys, ends, strict=True)])

    def _gone(self, keys: list[int], counts: list[int]) -> None:
        """``counts[i]`` documents of fetch ``keys[i]`` went out or will never: a fetch
        with none left goes."""
        for k, n in zip(keys, counts, strict=True):
            entry = self.held[k]
            entry[2] -= n
            if entry[2] <= 0:
                del self.held[k]

    def feed(self, packer: Packer, ids: np.ndarray, cut: np.ndarray | None) -> None:
        """Documents ``ids`` (less the first ``cut[i]`` tokens) to ``packer``, in that order.

        They stay in their fetches: the packer copies each once, straight
        into the batch (``Packer._feed_gathered``).
        """
        firsts = self._firsts[:self._n]
        at_fetch = np.searchsorted(firsts, ids, side="right") - 1
        if len(ids) and at_fetch.min() < 0:
            raise KfeedError("a document the order emitted is not held: a bug in kfeed")
        # The fetches involved, numbered 0, 1, ... in the order they came.
        count = np.bincount(at_fetch, minlength=self._n)
        used = np.flatnonzero(count)
        number = np.empty(self._n, np.int64)
        number[used] = np.arange(len(used))
        keys = firsts[used].tolist()
        try:
            entries = [self.held[k] for k in keys]
        except KeyError:
            raise KfeedError("a document the order emitted is not held: a bug in kfeed") from None
        # (the packer checks each document lies inside its fetch.)
        packer._feed_gathered([e[0] for e in entries], [e[1] for e in entries],
                              number[at_fetch], ids - firsts[at_fetch],
                              None if cut is None else cut.astype(np.int64, copy=False))
        self._gone(keys, count[used].tolist())


def _owed(cut: np.ndarray | None, lengths: np.ndarray) -> np.ndarray | None:
    """Documents cut to nothing that still give their EOS: a partial count is
    less than a document's tokens plus its EOS, so one that covers every token
    leaves the EOS (it came out with an earlier reader's last batch, or not)."""
    if cut is None:
        return None
    owed = (cut > 0) & (lengths == 0)
    return owed if owed.any() else None


def _host(t: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy, bfloat16 as its 2-byte words (as kfeed stores them)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 \
        else t.numpy()
