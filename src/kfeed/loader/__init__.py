"""Loader: Kafka messages -> batches of tensors on the device, exactly once.

The consumer half of the data flow, as a pipeline of stages, each in its
own module (docs/ARCHITECTURE.md draws them, with one batch's path):

- fetch (``fetch.Fetcher``): the ``Source``, the assignment, pending
  messages, bounded-epoch ends;
- build (``build.SlotBuilder`` / ``build.RecordBuilder``): pending messages
  decoded into a ``BufferPool`` slot, in order, shuffled or packed;
- ledger (``ledger.Ledger`` / ``ledger.OrderLedger``): what was handed out,
  what may be committed, ``state_dict()``;
- device (``kfeed.device.DeviceCopier``): the slot's copy to the device;
- output (``kfeed.outputs``): the batch as torch, numpy, JAX or Arrow.

Beside them, ``merge.merge_states`` makes one state of every rank's, for a
job of any number of ranks (``Loader.merge_states``).

``feeder.Feeder`` runs fetch, build and (on CUDA) the copy on the loader's
thread; ``Loader``, here, is the caller's side: ``next()`` takes a ready
batch, makes the CPU copy, moves the ledger, and commits. Offsets follow
the rule in DESIGN.md: a batch's offsets are committed only once the caller
asks for the batch after it (so the step that used it has finished), on
``commit()``, or on ``close()``; ``state_dict()`` holds the position after
every batch handed out, and a new loader given it resumes exactly there.

NOTE [ Loader Shutdown Logic ]
==============================
Two threads, one queue, one stop event::

    caller thread                         feeder thread (daemon)
    -------------                         ----------------------
    next(): ready.get(timeout) <--------- ready.put(batch | _END | _Failure)
    close(): stop.set(); pool.close() --> sees stop within one poll interval,
             join(feeder, timeout)         puts nothing more, returns
             thread "kfeed-close": commit used positions, source.close();
             join(it, timeout)

- The feeder never blocks without a timeout: ``consume``, ``pool.acquire`` and
  ``ready.put`` all wait at most ``_POLL_S`` and re-check ``stop``. Only a
  synchronous commit on a revoke and a dead-letter flush wait longer, up to
  ``connect_timeout_s``; ``close()`` waits that plus 5 s, then raises
  ``LoaderError`` naming the stage the thread is stuck in (``Status.doing``)
  and leaves the consumer open rather than close it under the thread.
- The final commit and the consumer's close run on a thread of their own,
  "kfeed-close", given as long again. With every broker down, librdkafka's
  synchronous commit waits out the group session (45 s by default), and so
  does the revoke's commit when the consumer leaves its group; its close
  then looks for the group's coordinator for ever (librdkafka#3740). Past the
  limit ``close()`` raises ``LoaderError`` naming the stage, and that thread
  goes on in the background; what was used since the last commit that went
  through is read again by the group's next reader (a ``state_dict()`` the
  caller saved is exact all the same).
- The commit at the end of a bounded read, made once the thread has ended,
  runs on a thread of its own too ("kfeed-commit"), given as long: with every
  broker down it waited for ever, and the loop never ended. Past the limit
  ``next()`` raises ``LoaderError``, and the consumer is left to that thread:
  ``close()`` then calls it no more.
- The thread holds no reference to the ``Loader`` (only to ``Feeder``), so a
  dropped loader is garbage-collected and ``__del__`` runs ``close()``.
- An exception in the feeder travels to the caller as ``_Failure`` and is
  re-raised by the next ``next()`` as ``LoaderError`` naming where it happened
  (or as itself, for kfeed's own errors).
- Only the caller thread commits after the feeder is gone; while it runs, the
  feeder commits only from inside a rebalance callback. ``lock`` guards the
  positions, never a call to Kafka: a commit is computed under it and made
  after it, and recorded only once the broker acknowledged it.
- NOTE [ One thread calls the consumer ]: confluent-kafka lets one thread
  at a time into a Consumer, and a thread that waits for it may wait as long
  as another keeps calling (the loader's thread calls ``consume()`` in a
  loop). So while the loader's thread runs, only it calls the consumer: the
  caller's commits go to ``Fetcher.commits`` and are made between two
  fetches; ``stats()`` reads what the consumer's callbacks noted. The caller
  calls the consumer itself only before the thread starts and after it ended.
- ``close()`` is idempotent; a ``with`` block that exits on an exception
  commits only the batches before the current one (its step did not finish).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import torch
from torch.utils.data import get_worker_info

from kfeed import metrics
from kfeed._kafka import broker_count, client_config, within
from kfeed.badrecords import BadRecordPolicy, BadRecords
from kfeed.device import DeviceCopier
from kfeed.errors import ConfigError, KfeedError, LoaderError, first_line
from kfeed.formats import RecordFormat
from kfeed.loader import merge
from kfeed.loader.agreement import EpochAgreement, from_rank0, shared_run
from kfeed.loader.build import Handoff, RecordBuilder, SlotBuilder
from kfeed.loader.config import LoaderConfig, dist_ready
from kfeed.loader.feeder import END, Failure, Feeder
from kfeed.loader.fetch import POLL_S, Fetcher, Status, no_revoke_hook
from kfeed.loader.ledger import Ledger, OrderLedger, no_reset_hook, state_positions
from kfeed.loader.tuning import (
    AUTO_START,
    GrownBatches,
    HELD_BESIDES_QUEUE,
    PrefetchTuner,
    memory_plan,
    memory_settings,
)
from kfeed.mix import Mix, Mixer, _mix_difference, _same_mix, _splitmix
from kfeed.outputs import converter
from kfeed.pool import BufferPool
from kfeed.schema import Format, Schema
from kfeed.sources import (
    TP,
    KafkaSource,
    MemorySource,
    Position,
    Source,
    consumer_config,
    group_share,
)
from kfeed.tokens import Pack, Packer, PackInfo, Shuffle

__all__ = ["Loader", "Batch", "BadRecordPolicy", "LoaderConfig", "memory_loader"]

log = logging.getLogger("kfeed.loader")

# Counts of a pipeline's stages, which a new epoch's pipeline starts again: stats()
# adds the earlier ones' (``Loader._carried``), so that counters only grow.
_CARRIED = ("samples_decoded", "bytes", "bad_records", "commits", "commit_failures",
            "dead_lettered", "rebalances", "fetch_s", "decode_s", "copy_s")
_SOURCE_COUNTS = ("commits", "commit_failures", "dead_lettered")  # the source's own

_MAX_SUPERSEDED = 256  # and this many runs whose commits it accounts for
_STATE_VERSION = 1
# Lent slots left to a loop that keeps its batches: a few are a loop that
# keeps the last ones for a while (a moving average, a log line); more, under
# a memory cap, are said (``_say_kept``).
_KEPT_FEW = 16


class Batch(dict):
    """A mapping field -> tensor ``[n, *shape]`` on the loader's device.

    ``offsets`` maps ``(topic, partition)`` to ``(first, end)`` positions,
    each ``(offset, skip)``: where the batch's records start and where the
    next batch continues. With ``shuffle``, ``pack`` or a ``kfeed.Mix``
    records do not come in offset ranges and ``offsets`` is empty: the
    loader's ``state_dict()`` says where to resume.

    A variable-length field without ``pack`` is ``NAME`` (the records'
    elements, 1-D) and ``NAME_offsets`` (``[n + 1]`` int64).

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
        # [k, batch, ...] tensors (of numpy batches too) and fail on the
        # epoch's shorter last batch. (batch_size=None converts, keeping ndim.)
        new = dict(*args, **kwargs)
        for key, value in new.items():
            old = self.get(key)
            if isinstance(value, torch.Tensor) and hasattr(old, "ndim") and \
                    value.dim() == old.ndim + 1:
                raise ConfigError(STACKED)
        super().update(new)


STACKED = ("kfeed yields whole batches: a DataLoader with batch_size set would stack them; "
           "use DataLoader(dataset, batch_size=None) and give the batch size to "
           "KafkaIterableDataset")


class Loader:
    """An iterator of batches from Kafka topics, already on ``device``.

    ``kafka_config`` is the librdkafka settings dict (``bootstrap.servers``
    and ``group.id`` at least); kfeed's own settings are the keyword
    arguments, checked by ``LoaderConfig``. See the module docstring for
    the offset rule.

    Up to ``prefetch`` batches wait ready. On CUDA their copies to
    ``device`` are already issued; with the one being filled and the one the
    caller holds, the device holds at most ``prefetch + 2`` batches, and the
    host three pinned pool slots. On the CPU there is no copy: a batch's
    tensors are a pool slot's, the caller's to keep as long as it likes; the
    slot is refilled once the caller let go of them (NOTE [ Lent slots ] in
    ``kfeed.pool``).

    A message the codec rejects never reaches a batch: ``on_bad_record``
    sends it to ``<topic>.dlq`` (default; each message at most once, see
    NOTE [ One copy per bad message ] in ``kfeed.sources``), skips it, or
    raises ``DecodeError``. Warnings come at most once per reason every few
    seconds. When the first ``fail_fast`` messages read are all rejected (a
    schema that does not match the topic, say), ``next()`` raises one
    ``DecodeError`` that says what the loader expects and what the topic
    holds, and nothing was dead-lettered or committed; ``fail_fast=None``
    never does. ``dlq_config`` holds the librdkafka settings (e.g.
    ``sasl.username``) of a principal allowed to create and write the
    dead-letter topics, when the consumer's own should not be.

    ``format``: ``"block"`` (kfeed's own, from ``kfeed.Producer``),
    ``"raw"``, or for topics that other services write, one record per
    message, ``kfeed.Avro(registry=...)`` / ``kfeed.Avro(schema=...)`` (see
    ``kfeed.avro``), ``kfeed.Protobuf(message=...)`` (see
    ``kfeed.protobuf``) or ``"json"`` / ``kfeed.Json()`` (see
    ``kfeed.jsonformat``); these read in offset order.

    ``topics``: a topic, a list of topics read as one stream, or a
    ``kfeed.Mix`` of topics in set proportions (see ``kfeed.mix``).

    Where the read starts, for a partition nobody committed (or, but for
    ``"committed"``, whatever was committed): ``start="committed"``
    (default; the earliest where nothing is), ``"earliest"``, ``"latest"``, a
    ``datetime`` (the first record at or after it), or a window's
    ``{(topic, partition): offset}`` (partitions it does not name: their
    earliest). ``until`` makes the read bounded: ``None`` streams;
    ``"end"`` stops at each partition's end as it was at the start; a
    ``datetime`` before the first record at or after it; a
    ``{(topic, partition): offset}`` before that offset (partitions it does
    not name: their end at the start; an offset past the end stops at the
    end, with a warning). Each end is resolved once, when the partition is
    first assigned, so records written later are not read.

    ``pack=kfeed.Pack(...)`` (a schema with a variable-length token field)
    makes each batch ``batch_size`` packed rows of documents; without it, a
    variable-length field comes jagged: ``NAME`` (the elements) and
    ``NAME_offsets`` (see NOTE [ Jagged fields ] in ``kfeed.loader.build``);
    ``shuffle=kfeed.Shuffle(...)`` shuffles records through a seeded buffer.
    Both keep ``state_dict()`` exact (see ``OrderLedger``).

    ``output``: what a batch is handed out as: ``"torch"`` (default), a
    ``Batch`` of tensors; ``"numpy"`` or ``"jax"``, a ``Batch`` of arrays;
    ``"arrow"``, a ``pyarrow.RecordBatch``. Each is a view of the batch,
    not a copy, valid as long as the caller holds it (see ``kfeed.outputs``).
    """

    def __init__(
        self,
        kafka_config: Mapping[str, Any] | None,
        topics: str | Sequence[str] | Mix,
        schema: Schema,
        batch_size: int,
        *,
        device: str | torch.device | None = None,
        format: str | Format | RecordFormat = "block",
        prefetch: int | str = 2,
        max_memory_bytes: int | None = None,
        until: str | datetime | Mapping[TP, int] | None = None,
        epochs: int | None = None,
        start: str | datetime | Mapping[TP, int] = "committed",
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
        output: str = "torch",
        source: Source | None = None,
    ) -> None:
        config = LoaderConfig(
            topics, schema, batch_size, device=device, format=format, prefetch=prefetch,
            max_memory_bytes=max_memory_bytes,
            until=until, epochs=epochs, start=start, on_bad_record=on_bad_record,
            fail_fast=fail_fast,
            dlq_config=dlq_config, drop_last=drop_last, max_wait_ms=max_wait_ms, rank=rank,
            world_size=world_size, assignment=assignment,
            commit_interval_ms=commit_interval_ms, connect_timeout_s=connect_timeout_s,
            pack=pack, shuffle=shuffle, on_revoke=on_revoke, output=output)
        self._begin(kafka_config, config, source)

    @classmethod
    def from_config(cls, kafka_config: Mapping[str, Any] | None, config: LoaderConfig,
                    source: Source | None = None, *, one_epoch: bool = False,
                    run: str | None = None) -> Loader:
        """A loader of ``config`` (a ``LoaderConfig``, checked when it was made).

        ``one_epoch``: the loader reads one epoch of ``epochs=``, and each
        epoch gets a loader of its own (``KafkaIterableDataset``), so a map
        ``until=`` must name every partition: one it leaves out would end
        where its end is at each epoch's start. ``run``: the run it shares
        with other loaders of its job (DataLoader workers), whose commits it
        follows whatever its ``start`` (NOTE [ Whose commits win ]).
        """
        if not isinstance(config, LoaderConfig):
            raise ConfigError("config must be a kfeed.LoaderConfig")
        self = cls.__new__(cls)
        self._run = run
        self._begin(kafka_config, config, source, one_epoch)
        return self

    def _begin(self, kafka_config: Mapping[str, Any] | None, config: LoaderConfig,
               source: Source | None, one_epoch: bool = False) -> None:
        # NOTE [ Epochs ]: with epochs=N each epoch is a pipeline of its own
        # (_setup), over the window resolved at the first one's start.
        self._base = config
        self._made_alone = not dist_ready()  # its rank and world size were not the job's then
        self._kafka_config = kafka_config
        self._given_source = source
        # Called each time next()'s wait for data finds no batch within POLL_S;
        # an exception it raises leaves that wait with nothing half done (kfeed
        # train's StopGuard: a signal noted while next() committed is acted on).
        self._on_wait: Callable[[], None] | None = None
        self._epoch = 0
        self._epoch_finished = False
        # epochs=: the window's start and end offsets, and the records to skip
        # at a start the group committed part-way into a message.
        self._window: tuple[dict[TP, int], dict[TP, int], dict[TP, int]] | None = None
        # start= and until= maps are checked against the partitions once, at
        # the first start (with ``one_epoch``, until= must name them all).
        self._maps_checked = False
        self._until_names_all = one_epoch and config.epochs is not None
        # assignment="static": the partitions this rank was dealt and every
        # partition there was, as a state records them; those of a loaded
        # state, checked against the first deal (NOTE [ A static state covers
        # its rank's partitions ]).
        self._static: dict[str, list[list[Any]]] | None = None
        self._loaded_static: dict[str, list[list[Any]]] | None = None
        # Under max_memory_bytes: the brokers the fetches are sized for, counted
        # at the first pipeline's start (NOTE [ librdkafka's memory ]).
        self._brokers: int | None = None
        # The stages and _carried, swapped together by _rebuild: stats() from
        # another thread in between counted the old stages twice.
        self._stages_lock = threading.RLock()
        self._setup(kafka_config, self._epoch_config(), source)

    def _epoch_config(self) -> LoaderConfig:
        """The configuration of the current epoch: its seeds, and the window once resolved."""
        base = self._base
        if base.epochs is None:
            return base
        seed = _epoch_seed
        changes: dict[str, Any] = {}
        if base.shuffle is not None:
            changes["shuffle"] = Shuffle(base.shuffle.buffer, seed(base.shuffle.seed, self._epoch))
        if base.mix is not None:
            changes["mix"] = dataclasses.replace(base.mix, seed=seed(base.mix.seed, self._epoch))
        if self._window is not None:
            changes["start"], changes["until"] = self._window[:2]
        return base.replace(**changes)

    def _setup(self, kafka_config: Mapping[str, Any] | None, config: LoaderConfig,
               source: Source | None) -> None:
        c = self.config = config
        self.schema, self.format, self.topics = c.schema, c.format, list(c.topics)
        self.batch_size, self.device, self.until = c.batch_size, c.device, c.until
        self.rank, self.world_size = c.rank, c.world_size
        self.assignment_mode = c.assignment
        self._commit_interval = c.commit_interval_ms / 1000.0
        self._last_commit = 0.0
        # Set first: __del__ runs close() even when a later line raises.
        self._closed = True
        # Where the brokers are, for the metrics' lag in seconds (None: not Kafka).
        self._connection: dict[str, Any] | None = None
        user_config: Mapping[str, Any] | None = None  # the user's librdkafka settings
        # Those a fetch is in flight from at once (NOTE [ librdkafka's memory ]):
        # counted at the first pipeline's start, kept by an epoch's.
        brokers = self._brokers or 1
        if source is None:
            if kafka_config is None:
                kafka_config = {}
            if isinstance(kafka_config, Mapping):  # (KafkaSource refuses anything else)
                user_config = kafka_config
        elif c.dlq_config is not None:
            raise ConfigError("dlq_config applies to Kafka topics, not to a given source")
        self._copier = DeviceCopier(self.device)
        packer = Packer(c.pack, c.batch_size) if c.pack is not None else None
        # CUDA: one filling, the others still being copied out (a slot is
        # given back as soon as its copy is issued, and refilled once it is
        # done). CPU: slots are lent to the caller, and more are made while
        # the caller holds them all.
        # Pinned only for a CUDA device: pinning is for the copy to it, and
        # costs page-locked host memory and start-up time otherwise.
        depth = AUTO_START if c.prefetch == "auto" else c.prefetch
        slots = 3 if self._copier.cuda else depth + 2
        self._pool = BufferPool(c.schema, c.batch_size, slots=slots, packer=packer,
                                pin=self._copier.cuda, most_lent=depth + HELD_BESIDES_QUEUE - 1)
        batch_bytes = self._pool.nbytes // len(self._pool)

        def plan(batch_bytes: int) -> tuple[tuple[int, int] | None, int]:
            return memory_plan(
                c.max_memory_bytes, user_config, prefetch=c.prefetch, batch_bytes=batch_bytes,
                record_size=c.schema.record_size,
                shuffled_records=(c.shuffle.buffer + c.batch_size if c.shuffle is not None
                                  and c.pack is None and not c.jagged else 0),
                mixing=c.mix is not None, brokers=brokers)

        held, ceiling = plan(batch_bytes)  # (a cap too small for one broker: said at once)
        if source is None:
            if user_config is not None and c.max_memory_bytes is not None:
                # librdkafka's buffers within the cap, shared by the brokers,
                # counted once the settings that ask no broker are known good.
                if self._brokers is None:
                    consumer_config(user_config)
                    brokers = self._brokers = broker_count(
                        user_config, min(c.connect_timeout_s, 5.0), c.topics)
                    held, ceiling = plan(batch_bytes)
                kafka_config = {**user_config,
                                **memory_settings(c.max_memory_bytes, user_config, brokers)}
            source = KafkaSource(kafka_config, c.topics, ends=c.bounded or c.mix is not None,
                                 connect_timeout=c.connect_timeout_s, dlq_config=c.dlq_config)
            self._connection = client_config(kafka_config)
        self._source = source
        # Names this loader and the ones resumed from its checkpoints, and
        # this run of them, in every commit (NOTE [ Whose commits win ] in
        # kfeed.loader.ledger).
        source.lineage = uuid.uuid4().hex[:16]
        source.run = getattr(self, "_run", None) or uuid.uuid4().hex[:12]
        self._lineages = [source.lineage]  # newest first, see Ledger.lineages
        # NOTE [ Batches that grow ]: a variable-length field's batches (no pack=)
        # are as large as their records, and a slot grows to the largest it
        # held: what the cap leaves room for is asked again as the slots grow.
        self._grown = GrownBatches(self._pool, plan, c) \
            if c.jagged and c.max_memory_bytes is not None else None
        self._kept_said = False  # (a loop that keeps its batches: said once)
        self._status = Status()
        # What holds the consumer past its time limit (a commit no broker
        # answers), if anything: the consumer is then never called again.
        self._held: str | None = None
        mixer = None
        if c.mix is not None:
            mixer = Mixer(c.mix, c.batch_size, bounded=c.bounded)
        elif c.epochs is not None and c.records:  # an epoch's order: NOTE [ Epochs ]
            mixer = Mixer.in_turn(c.batch_size, bounded=c.bounded)
        self._ledger: Ledger = (OrderLedger(source, c.start, c.shuffle, packer, mixer)
                                if c.records else Ledger(source, c.start))
        self._ledger.lineages = set(self._lineages)
        self._ledger.run = source.run
        self._ledger.cover_all = c.assignment == "group"
        self._bad = BadRecords(c.schema, c.format, c.on_bad_record, source,
                               fail_fast=c.fail_fast,
                               topics=None if c.mix is None else list(c.mix.topics))
        stop = threading.Event()  # set by close(); every wait of the thread watches it
        source.stopping = stop
        fetcher = Fetcher(source, self._ledger, bounded=c.bounded, until=c.until,
                          batch_size=c.batch_size,
                          status=self._status, stop=stop)
        self._fetcher = fetcher
        stop_args = dict(batch_size=c.batch_size, max_wait_s=c.max_wait_ms / 1000.0,
                         capped=c.max_memory_bytes is not None)
        builder: SlotBuilder
        if isinstance(self._ledger, OrderLedger):
            builder = RecordBuilder(fetcher, self._ledger, c.schema, c.format, self._bad,
                                    stop=stop, packer=packer, held_bytes=held, **stop_args)
        else:
            builder = SlotBuilder(fetcher, self._ledger, c.schema, c.format, self._bad,
                                  stop=stop, **stop_args)
        self._builder = builder
        self._feeder = Feeder(fetcher, builder, self._ledger, self._bad, self._pool,
                              self._copier, prefetch=depth, drop_last=c.drop_last,
                              assignment=None, hook_revoke=c.on_revoke is not None,
                              status=self._status, stop=stop)
        self._tuner = (PrefetchTuner(self._feeder.ready, self._pool, ceiling)
                       if c.prefetch == "auto" else None)
        self._on_revoke = c.on_revoke
        self._in_hook = False
        # Batches handed out whose steps may still run: the next next() marks them
        # used. One, unless threads share the loader: then a next() from any of
        # them marks every batch handed out before it (commits may run a batch
        # a thread ahead of the steps; they never fall short of them).
        self._current: list[Batch] = []
        self._convert = converter(c.output, c.schema, c.pack is not None)  # None: torch
        self._agreement: EpochAgreement | None = None
        self._ahead: Any = None  # with ranks: the next step's item, taken a step early
        # A batch whose hand-out failed (its conversion raised): the next
        # next() hands it out in its place, so that none is skipped.
        self._again: Handoff | None = None
        self._broken: BaseException | None = None  # with ranks: such a failure ends the read
        self._failed: BaseException | None = None  # the loader's thread stopped at this error
        self._exhausted = False
        self._closed = False
        self._fresh = True  # this pipeline handed out no batch yet
        if not hasattr(self, "_batches"):  # the first pipeline: counters for the loader's life
            self._wait_s = 0.0          # waited in next() after the first batch
            self._startup_s = 0.0       # from the first next() to the first batch
            self._longest_wait_s = 0.0
            self._batches = 0
            self._samples_out = 0
            self._t0: float | None = None       # first next()
            self._t_first: float | None = None  # first batch handed out
            # The rates' clock stops at a read's end and at close (then ``_t_end``),
            # and the time to the next epoch's first next() is left out.
            self._t_end: float | None = None
            self._paused_s = 0.0
            self._wait_hist = metrics.Histogram(metrics.WAIT_BUCKETS_S)
            self._waiting_since: float | None = None  # next() waits since then
            self._stall_lock = threading.Lock()  # _wait_s and _waiting_since, together
            self._wait_shown = 0.0  # the most stats() said was waited
            self._latency_hist = metrics.Histogram(metrics.LATENCY_BUCKETS_S)
            # The earlier epochs' pipelines' counts (their stages are made anew).
            self._carried: dict[str, Any] = {}
        metrics.register(self)

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError("the loader is closed")

    @property
    def cuda_index(self) -> int | None:
        """The CUDA device the batches go to (``device="cuda"``: the current one when
        the loader was made); None off CUDA."""
        return self._copier.index

    # -- iteration ------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        self._check_open()  # (with epochs, the next loop would open it again)
        epochs = self._base.epochs
        if epochs is not None and self._epoch_finished and self._epoch + 1 < epochs:
            self._epoch += 1  # the next for-loop reads the next epoch
            self._rebuild()
        return self

    # -- epochs (NOTE [ Epochs ]) -------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch being read, or read next (``epochs=N``); 0 without epochs."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next, as ``DistributedSampler.set_epoch``.

        Called while another epoch is being read (its loop left early, e.g.
        after a number of steps per epoch), it leaves that epoch: the batches
        used are committed, and the rest of it is not read. The epoch being
        read itself goes on at the next loop.
        """
        self._check_open()
        epoch = self._base.check_epoch(epoch, "Loader")
        reading = self._feeder.thread is not None and not self._epoch_finished
        if epoch == self._epoch and (reading or self._feeder.thread is None):
            return
        if reading:
            log.info("set_epoch(%d): epoch %d left after %d batches; the rest of it is not read",
                     epoch, self._epoch, self._batches)
        self._epoch = epoch
        self._rebuild()

    def _rebuild(self) -> None:
        """A new pipeline for the current epoch, of the same lineage (the old one closed)."""
        lineages = self._lineages
        with self._ledger.lock:
            superseded = self._ledger.superseded.union(self._ledger.seen_runs)
        self.close()
        stats = self.stats()  # the counts so far, which the new stages start again from
        # (A source given to the loader goes on into the next epoch, counting on.)
        kept = _SOURCE_COUNTS if self._given_source is not None else ()
        with self._stages_lock:
            self._carried = {k: stats[k] for k in (*_CARRIED, "bad_by_reason", "mix")
                             if k not in kept and k in stats}
            self._epoch_finished = False
            self._setup(self._kafka_config, self._epoch_config(), self._given_source)
        self._lineages = lineages
        self._source.lineage = lineages[0]
        self._ledger.lineages = set(lineages)
        self._ledger.superseded = superseded

    def _resolve_window(self) -> tuple[dict[TP, int], dict[TP, int], dict[TP, int]]:
        """Where the window starts and ends in every partition, now."""
        source, ledger = self._source, self._ledger
        self._status.doing = "resolving the window (start and until)"
        parts = source.partitions()
        starts = ledger.start_positions(parts, source.committed(parts))
        return ({tp: off for tp, (off, _skip) in starts.items()},
                self._fetcher.ends_of(parts),
                {tp: skip for tp, (_off, skip) in starts.items() if skip})

    def _check_maps(self) -> None:
        """start= and until= maps name partitions of the topics, start= offsets within
        them and before until='s (ConfigError if not)."""
        self._maps_checked = True
        if self._until_names_all and isinstance(self._base.until, datetime) \
                and self._base.until.timestamp() > time.time():
            # Each epoch's loader would end at the newest record it finds.
            raise ConfigError(
                f"until={self._base.until.isoformat()} is in the future: with epochs=, each "
                f"epoch of a KafkaIterableDataset opens a new loader, which would end at the "
                f"newest record it finds, so epochs would differ; give a time past")
        if isinstance(self._base.until, datetime) \
                and (ahead := self._base.until.timestamp() - time.time()) > 0:
            # Resolved once, now (as a map past the end is): a read that ended
            # at the end of the topic said nothing of the time it was given.
            log.warning("until=%s is %.0f s ahead: the read stops at each partition's end "
                        "now (the window is resolved once, at the start: records written "
                        "later are not read); leave until= out to go on streaming",
                        self._base.until.isoformat(), ahead)
        maps = [(name, m) for name, m in (("start", self._base.start),
                                          ("until", self._base.until)) if isinstance(m, Mapping)]
        if not maps:
            return
        self._status.doing = "checking start= and until= against the partitions"
        parts = set(self._source.partitions())
        for name, offsets in maps:
            unknown = sorted(tp for tp in offsets if tp not in parts)
            if unknown:
                t = unknown[0][0]
                n = sum(1 for topic, _p in parts if topic == t)
                raise ConfigError(f"{name}: {unknown[0]!r} is not a partition of {t}, which has "
                                  + (f"{n} (0..{n - 1})" if n else "none"))
        start, until = self._base.start, self._base.until
        # (Each partition's watermarks asked once, for both maps.)
        marks = {tp: self._source.watermarks(tp) for tp in {
            *(start if isinstance(start, Mapping) else ()),
            *(until if self._until_names_all and isinstance(until, Mapping) else ())}}
        for tp, offset in (start.items() if isinstance(start, Mapping) else ()):
            # Past the end, librdkafka's reset would start at the partition's
            # first record, before the window, in silence.
            low, high = marks[tp]
            where = f"{tp[0]}[{tp[1]}]"
            if offset > high:
                raise ConfigError(f"start= names offset {offset} of {where}, past its end "
                                  f"({high}; it holds {low}..{high - 1}): give an offset up to "
                                  f"{high}")
            if isinstance(until, Mapping) and tp in until and until[tp] < offset:
                raise ConfigError(f"until= names offset {until[tp]} of {where}, before its "
                                  f"start= offset {offset}: the window would hold nothing")
            if offset < low:
                log.warning("start= names offset %d of %s, deleted by retention: the read "
                            "starts at its first record, %d", offset, where, low)
        if self._until_names_all and isinstance(until, Mapping):
            # Each epoch's loader would stop at the end it finds: records
            # written between epochs would be in the later ones only.
            for tp, offset in until.items():
                high = marks[tp][1]
                if offset > high:
                    raise ConfigError(
                        f"until= names offset {offset} of {tp[0]}[{tp[1]}], past its end "
                        f"({high}): with epochs=, each epoch of a KafkaIterableDataset opens a "
                        f"new loader, which would stop at the end it finds; give offsets up "
                        f"to the ends")
            missing = sorted(parts - set(until))
            if missing:
                raise ConfigError(
                    f"until: with epochs=, each epoch of a KafkaIterableDataset opens a new "
                    f"loader, which would find the end of a partition until= does not name "
                    f"anew: name every partition ({len(missing)} missing, e.g. "
                    f"{missing[0]!r}), or give until= a datetime")

    def _start(self) -> None:
        f = self._feeder
        if self._t0 is None:  # startup_s counts the brokers' answers below too
            self._t0 = time.monotonic()
        if self._made_alone and dist_ready() and get_worker_info() is None \
                and torch.distributed.get_world_size() != self.world_size:
            # Every rank would read as the one reader: each record once per rank.
            raise ConfigError(
                f"the loader was made before torch.distributed.init_process_group, as rank "
                f"{self.rank} of {self.world_size}, and the job has "
                f"{torch.distributed.get_world_size()} ranks: make it after "
                f"init_process_group, or pass rank= and world_size=")
        if not self._maps_checked:
            self._check_maps()
        if self._base.epochs is not None:
            if self._window is None:
                # The ranks of a job read one window: rank 0's, resolved
                # before any of them committed.
                ranks = self.world_size > 1 and dist_ready() and get_worker_info() is None
                mine = self._resolve_window() if not ranks or self.rank == 0 else None
                self._window = from_rank0(mine) if ranks else mine
            # Every epoch reads the same window, resolved once.
            self._ledger.start, self._fetcher.until, self._ledger.start_skips = self._window
        if self.assignment_mode == "static":
            parts = self._source.partitions()
            mix = self.config.mix
            # Every rank checks every topic, so that all of them refuse alike,
            # not only those left without a partition.
            if mix is None:
                if len(parts) < self.world_size:
                    raise ConfigError(
                        f"the topics have {len(parts)} partitions, fewer than the "
                        f"{self.world_size} readers (ranks, times DataLoader workers): with "
                        f"assignment='static' each reads partitions of its own")
                f.assignment = [tp for i, tp in enumerate(parts)
                                if i % self.world_size == self.rank]
            else:  # each topic's partitions dealt out on their own: every rank mixes them all
                lacking = [t for t in mix.topics
                           if sum(1 for tp in parts if tp[0] == t) < self.world_size]
                if lacking:
                    raise ConfigError(
                        f"{lacking} {'has' if len(lacking) == 1 else 'have'} fewer partitions "
                        f"than the {self.world_size} ranks: in a mixture with "
                        f"assignment='static' every rank reads every topic, so each needs at "
                        f"least {self.world_size} partitions")
                f.assignment = [tp for t in mix.topics
                                for i, tp in enumerate(sorted(p for p in parts if p[0] == t))
                                if i % self.world_size == self.rank]
            self._check_static_cover(f.assignment, parts)
        elif self.world_size > 1 and dist_ready() and get_worker_info() is None:
            if self.config.bounded:
                self._check_group_ranks(self._source.partitions())
            # Partitions move between the ranks: each must believe the
            # others' commits, and not a crashed run's (NOTE [ Whose commits
            # win ]). Once, before the first assignment.
            run = shared_run(self._source.run or "")
            self._source.run = self._ledger.run = run
        f.start()

    def __next__(self) -> Batch:
        self._check_open()
        f = self._feeder
        if f.thread is None:
            self._start()
        # The caller asks for a new batch: the step that used the last one is
        # over. Its records are given up as used if a revoke is waiting for the
        # hook, which runs before a commit that the loader's thread would make
        # only once the hook ran.
        self._mark_used()
        self._give_up_revoked()
        self._commit_if_due()
        if self._broken is not None:
            raise LoaderError(f"the loader stopped at a batch it could not hand out: "
                              f"{self._broken!r}") from self._broken
        if self._failed is not None:
            # Never a StopIteration: a read that failed must not look like one that ended.
            raise LoaderError(f"the loader stopped at an error an earlier next() raised "
                              f"({first_line(self._failed)}): open a new loader to read on, "
                              f"from the last state_dict() or the group's commits"
                              ) from self._failed
        if self._exhausted:
            raise StopIteration
        t = time.monotonic()
        if self._agreement is None and self.config.bounded and self.world_size > 1 \
                and dist_ready() and get_worker_info() is None:  # (no collectives in workers)
            self._agreement = EpochAgreement()
        # A wait after the first batch is the data stall: stats() counts it while it
        # lasts, and one cut short (a signal, close(), an error) counts as well. A
        # later epoch's first wait (its consumer joins the group) is between
        # epochs, as the first one's is startup: the clock stopped at the last
        # epoch's end (``_t_end``) goes on at its first batch.
        between = self._fresh and self._t_end is not None
        self._waiting_since = t if self._t_first is not None and not between else None
        try:
            return self._next_batch(f, t)
        except StopIteration:  # the end of a bounded read: no stall
            self._waiting_since = None
            raise
        except BaseException:
            if self._waiting_since is not None:
                self._waited(time.monotonic() - t)
            raise
        finally:
            f.ready.made_room()  # NOTE [ Room is made last ]

    def _next_batch(self, f: Any, t: float) -> Batch:
        ready = not f.ready.empty()  # a batch was there: waiting for it was no data stall
        if self._again is not None:
            item, self._again, ready = self._again, None, True
        else:
            item = self._take() if self._agreement is None else self._agreed()
        batch = None
        while batch is None:
            if item is END:
                # The wait for the end, which stats() counted as it went (a
                # counter never goes down); not the final commit after it.
                if self._waiting_since is not None:
                    self._waited(time.monotonic() - t)
                self._exhausted = True
                if self._agreement is not None:  # END in place of a dropped batch
                    self._agreement.finish()
                if self._feeder.epoch_over:  # it ends right after END
                    self._feeder.join(self.config.connect_timeout_s + 5.0)
                self._ledger.finish(self._fetcher.ends, self._fetcher.read_to, self._fetcher.done)
                self._commit(asynchronous=False)
                self._epoch_finished = True
                self._stop_clock()
                raise StopIteration
            batch = self._hand_out(item)
            if batch is None:  # dropped by a rebalance that came after _take
                item = self._take() if self._agreement is None else self._instead()
        if self._t_first is None:
            self._t_first = time.monotonic()
            self._startup_s = self._t_first - (self._t0 or t)
        elif self._fresh and self._t_end is not None:  # a later epoch's first batch
            self._paused_s += time.monotonic() - self._t_end
            self._t_end = None
        else:
            now = time.monotonic()
            waited = now - t
            self._waited(waited)
            if self._tuner is not None:
                self._tuner.observe(0.0 if ready else waited, now)
        if self._grown is not None:
            self._grown.check(self._tuner)
        if self._pool.forgotten > _KEPT_FEW and not self._kept_said and \
                self.config.max_memory_bytes is not None:
            self._say_kept()
        self._fresh = False
        return batch

    def _say_kept(self) -> None:
        """The loop keeps its batches past their steps: said once, as the memory grows."""
        log.warning(
            "the loop keeps the batches it was handed past their steps (%d so far): each "
            "is its own memory, beside the %d bytes of max_memory_bytes, and the loader "
            "makes a new slot for each; drop them (or copy what you keep) to stay within "
            "the cap", self._pool.forgotten, self.config.max_memory_bytes)
        self._kept_said = True

    def _stop_clock(self) -> None:
        if self._t_end is None and self._t_first is not None:
            self._t_end = time.monotonic()
        elif self._t_first is None and self._t0 is not None and not self._startup_s:
            # Ended (or closed) before a first batch: the wait for it so far, kept.
            self._startup_s = time.monotonic() - self._t0

    def _waited(self, waited: float) -> None:
        with self._stall_lock:  # (stats() reads the two together)
            self._waiting_since = None
            self._wait_s += waited
        self._longest_wait_s = max(self._longest_wait_s, waited)
        self._wait_hist.observe(waited)

    def _check_group_ranks(self, parts: list[TP]) -> None:
        """Ranks in a group that some would be left without a partition: every rank refuses.

        A bounded epoch's ranks agree on its end each step (``EpochAgreement``),
        and a rank that never gets a batch never asks: the others wait on it
        until the collective times out. The range assignor (librdkafka's
        default) deals each topic's partitions apart (``group_share``).
        """
        counts = {t: sum(1 for tp in parts if tp[0] == t) for t in self.topics}
        have, how, dealt_apart = group_share(counts, self.config.mix is not None,
                                             self._kafka_config or {})
        if have >= self.world_size:
            return
        given = ", ".join(f"{t} has {n}" for t, n in counts.items())
        raise ConfigError(
            f"{self.world_size} ranks share the partitions in a consumer group ({given}; "
            f"{how}): a rank without one would leave the others waiting at the bounded "
            f"epoch's end for ever; use at most {have} rank{'s' if have != 1 else ''}, more "
            f"partitions"
            f"{', partition.assignment.strategy=roundrobin' if dealt_apart else ''} or "
            f"assignment='static'")

    def _check_static_cover(self, assignment: list[TP], parts: list[TP]) -> None:
        """NOTE [ A static state covers its rank's partitions ]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A static rank's state holds the positions of the partitions it was
        dealt alone. Loaded by a rank dealt others (a partition or a topic
        added, another number of ranks, one rank's state loaded by all), a
        partition it does not name starts at the group's commit, which the
        rank that read it made past its checkpoint before the job died (its
        lineage is not this state's, so its commit wins): those records are
        lost. So a state names what it covers and the partitions there were,
        and a rank dealt one it does not cover, of those there were, stops
        here; a merged state covers every rank's partitions.
        """
        self._static = {"covers": sorted(map(list, assignment)),
                        "of": sorted(map(list, parts))}
        loaded, self._loaded_static = self._loaded_static, None
        if loaded is None:
            return
        covered = {tuple(tp) for tp in loaded["covers"]}
        known = {tuple(tp) for tp in loaded["of"]}
        missing = [tp for tp in assignment if tp in known and tp not in covered]
        if missing:
            raise ConfigError(
                f"rank {self.rank} of {self.world_size} is dealt {sorted(missing)[:4]}"
                f"{' ...' if len(missing) > 4 else ''}, whose positions the state it loaded "
                f"does not hold: it is one rank's state, and the ranks' partitions changed "
                f"(a partition or topic added, another number of ranks); load "
                f"Loader.merge_states(every rank's state) on every rank instead")

    def _agreed(self) -> Any:
        """The next item, or ``END`` once any rank has run out (see ``EpochAgreement``)."""
        ag = self._agreement
        assert ag is not None
        if self._ahead is None:  # the first step: this batch's question goes out now
            self._ahead = self._take()
            ag.post(self._ahead is not END)
        item = self._ahead
        # One batch ahead: its question goes out now, and is answered by the
        # time the next step asks, so no step waits on a collective.
        self._ahead = END if item is END else self._take()
        ag.post(self._ahead is not END)
        if ag.answer():
            return item
        if self._fresh:  # before the epoch's first step: a job of this size reads nothing
            log.warning(
                "rank %d: the epoch ends before its first step: %s, and ranks stop at the "
                "same step; what the ranks have left is read by a job of another size, or "
                "by one process, from the saved states", self.rank,
                "this rank has nothing left to read" if item is END else
                "another rank has nothing left to read (with assignment='static', in its "
                "own partitions)")
        for held in (item, self._ahead):  # not handed out: their records stay unread
            if held is not END:
                held.release(self._pool)
        ag.drain()
        self._ahead = END
        return END

    def _instead(self) -> Any:
        """The item in place of one a rebalance dropped, with ranks in agreement.

        The batch held one step ahead comes first, in offset order; what
        takes its place was asked about already (it was there). Taken from
        the queue instead, it would be handed out before the one held.
        """
        item = self._ahead
        if item is not END:
            self._ahead = self._take()
        return item

    def _take(self) -> Any:
        f = self._feeder
        while True:
            try:
                item = f.ready.get(timeout=POLL_S)
            except queue.Empty:
                if self._on_wait is not None:
                    self._on_wait()
                self._give_up_revoked()  # the thread may be waiting for it
                # A caught-up stream: the batch before this wait was used, and
                # is committed while the caller waits for more, not after.
                self._commit_if_due()
                if f.thread is not None and not f.thread.is_alive() and f.ready.empty():
                    if self._closed:
                        raise LoaderError("the loader was closed, by another thread, while "
                                          "next() waited for a batch") from None
                    if self._exhausted or f.epoch_over:  # another thread's next() took END
                        return END
                    raise LoaderError("the loader thread stopped without a reason") from None
                continue
            if self._source.ended is not None and not isinstance(item, Failure):
                item = Failure(self._source.ended, "reading")  # NOTE [ A fenced member stops at once ]
            if isinstance(item, Failure):
                self._exhausted = True
                exc = self._failed = item.exc
                if isinstance(exc, KfeedError):
                    raise exc
                tb = "".join(traceback.format_exception(exc))
                raise LoaderError(f"error in the loader thread while {item.where}:\n{tb}") from exc
            if item is END:
                # A bad record's copy that failed is known once the copies
                # are acknowledged: the read failed, it did not end.
                try:
                    self._source.settle()
                except KfeedError as e:
                    self._exhausted = True
                    self._failed = e
                    raise
                return item
            with self._ledger.lock:
                if item.gen == self._ledger.gen and item.rows == 0:
                    # NOTE [ Batches of no rows ]: in offset order, messages
                    # the codec all rejected make no batch, yet their
                    # positions come in their place in the queue (packed:
                    # the empty documents after the last batch, its
                    # acknowledgements): every batch before was handed out,
                    # and used (next() marked the last one), so they are
                    # handed out and used as they are taken.
                    self._pass_over(item)
                    f.ready.made_room()
                    continue
                if item.gen == self._ledger.gen:
                    return item
            item.release(self._pool)  # from before a rebalance
            f.ready.made_room()

    def _take_rejected(self) -> None:
        """At close: positions of rejected messages queued next, as ``_take`` takes them.

        Only those right behind what was handed out: a batch not handed out
        ends it (it, and what follows, is read again by the next reader), the
        one a conversion failed on, or the one ranks took a step ahead, too.
        """
        if self._again is not None or self._ahead not in (None, END):
            return
        f = self._feeder
        while not f.ready.empty():
            item = f.ready.get(timeout=0)
            f.ready.made_room()
            if not isinstance(item, Handoff) or item.rows:
                return
            with self._ledger.lock:
                if item.gen == self._ledger.gen:
                    self._pass_over(item)

    def _pass_over(self, item: Handoff) -> None:
        """A batch of no rows, its messages all rejected (or its documents all empty):
        past them (under the ledger's lock)."""
        self._ledger.accept(item.end, item.acks, item.pack_offset)
        self._ledger.mark_used(item.offsets())

    def _hand_out(self, out: Handoff) -> Any:
        ledger = self._ledger
        offsets = out.offsets()  # (through an order: only jagged records in offset order)
        batch = Batch(out.tensors, out.rows, offsets, out.info)
        # The tensors are recorded for the caller's stream first: JAX's DLPack
        # import orders its own stream after the caller's. And the batch is
        # converted before it counts as handed out: a conversion that fails
        # leaves its records unread, never committed, and the next next()
        # hands it out again. With ranks, whose steps go in lockstep, the
        # read ends there instead.
        try:
            self._copier.adopt(out.tensors, out.recorded)
            handed = batch if self._convert is None else self._convert(batch)
        except BaseException as e:
            if self._agreement is None:
                self._again = out
            else:
                self._broken = e
            raise
        with ledger.lock:
            if out.gen != ledger.gen:
                # A rebalance happened after _take: the caller's next() takes
                # the next batch instead.
                return None
            ledger.accept(out.end, out.acks, out.pack_offset)
            self._current.append(batch)
        if out.newest_ms > 0:
            self._latency_hist.observe(max(0.0, time.time() - out.newest_ms / 1000.0))
        self._batches += 1
        self._samples_out += out.rows
        return handed

    def _mark_used(self) -> None:
        # Under the lock: another thread's next() may hand out or mark at once.
        with self._ledger.lock:
            current, self._current = self._current, []
            for batch in current:
                self._ledger.mark_used(batch.offsets)

    def _commit_if_due(self) -> None:
        now = time.monotonic()
        if self._batches and now - self._last_commit >= self._commit_interval:
            self._commit(asynchronous=self._commit_interval > 0)
            self._last_commit = now

    def _give_up_revoked(self) -> bool:
        """Give up partitions the thread is revoking, at a step boundary (caller's thread),
        after ``on_revoke`` if there is one (NOTE [ A revoke waits for the step ]);
        whether there were any."""
        tps = self._feeder.take_revoking()
        if tps is None:
            return False
        try:
            if self._on_revoke is not None:
                self._in_hook = True
                self._on_revoke(tps)
        finally:
            self._in_hook = False
            # Given up here, before this thread can hand out another batch.
            self._feeder.revoked_by_caller(self._ledger.revoke(tps))
        return True

    def _due(self) -> tuple[dict[TP, Any], bool]:
        """The positions to commit, and whether the loader's thread is there to make it."""
        ledger, fetcher = self._ledger, self._fetcher
        with ledger.lock:
            ledger.committed.update(self._source.acknowledged())
            # Only partitions this loader was given: a loaded state also
            # holds the other ranks' ones, which they commit themselves.
            alive = self._feeder.alive()
            return ledger.to_commit(lambda tp: tp in fetcher.assigned or not alive), alive

    def _commit(self, asynchronous: bool) -> None:
        todo, alive = self._due()
        if not todo or self._held is not None:
            return
        fetcher = self._fetcher
        if alive:
            # The consumer takes calls from one thread at a time, and the
            # loader's thread is in consume() most of the time: it makes the
            # commit, between two fetches (NOTE [ One thread calls the consumer ]).
            if fetcher.commits.put(todo, wait=not asynchronous,
                                   timeout=self.config.connect_timeout_s + 5.0,
                                   while_waiting=None if self._in_hook else self._give_up_revoked,
                                   alive=self._feeder.alive,
                                   wake=self._feeder.ready.poke):
                return
            # The thread ended (a bounded read's end) without making it: made here.
            todo, alive = self._due()
            if not todo:
                return
        if asynchronous:
            fetcher.commit_now(todo, asynchronous=True)
            return
        # The thread is gone (the epoch's end): outside the lock, and bounded,
        # for against brokers that do not answer the commit waits for ever
        # (NOTE [ Loader Shutdown Logic ]).
        limit = self.config.connect_timeout_s + 5.0
        self._status.doing = "making the commit (Source.commit)"
        if not within(lambda: fetcher.commit_now(todo, asynchronous=False), "kfeed-commit",
                      limit):
            self._held = "making the commit at the end of the read (Source.commit)"
            raise LoaderError(
                f"the offset commit at the end of the read did not finish within {limit:g}s, "
                f"most likely because no broker answers: every batch was handed out, and "
                f"records used since the last commit that went through will be read again by "
                f"the next reader of the group; the consumer is left to that commit")

    def commit(self) -> None:
        """Commit every batch handed out so far, including the current one.

        A revoke waiting for the ``on_revoke`` hook has it run here first.
        Refused once the loader is closed: ``close()`` committed what it
        could, and the batch a failed step held is not to be committed.
        """
        self._check_open()
        self._mark_used()
        # Inside the on_revoke hook the loader's thread waits for the hook:
        # the revoke itself commits the partitions going, synchronously, and
        # the others go with the next commit.
        gave_up = not self._in_hook and self._give_up_revoked()
        self._commit(asynchronous=self._in_hook)
        if gave_up:  # the revoke commits those, on the loader's thread: made before we return
            self._feeder.wait_revoke_committed(self.config.connect_timeout_s + 5.0)

    # -- checkpoints ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: per partition, the position after the batches handed out."""
        self._source.settle()  # the state may point past bad records: their copies are safe
        with self._ledger.lock:
            state = self._ledger.state()
            superseded = sorted(self._ledger.superseded.union(self._ledger.seen_runs))
        out = {
            "version": _STATE_VERSION,
            "schema_fingerprint": self.schema.fingerprint,
            "format": self.format.value,
            "topics": list(self.topics),
            "lineages": list(self._lineages),
            "superseded": superseded[-_MAX_SUPERSEDED:],
            **state,
        }
        static = self._static or self._loaded_static
        if self.assignment_mode == "static" and static is not None:
            out["static"] = static
        if self._base.epochs is not None:
            window = None if self._window is None else {
                name: [[t, p, o] for (t, p), o in sorted(ends.items())]
                for name, ends in zip(("start", "until", "skips"), self._window, strict=True)}
            out["epochs"] = {"epoch": self._epoch, "finished": self._epoch_finished,
                             "window": window}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``; its positions win over committed offsets."""
        self._check_open()
        if self._feeder.thread is not None:
            raise ConfigError("load_state_dict must be called before iterating")
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ConfigError(f"not a kfeed loader state (version {_STATE_VERSION})")
        if state.get("schema_fingerprint") != self.schema.fingerprint:
            raise ConfigError("the state was saved with another schema")
        if state.get("format") != self.format.value:
            raise ConfigError(f"the state was saved for format {state.get('format')!r}")
        # A loader may read topics its state does not name (one added to the
        # job), not the other way round: their positions would go unread.
        saved = state.get("topics")
        if not isinstance(saved, list) or not set(saved) <= set(self.topics):
            raise ConfigError(f"the state was saved by a loader of topics {saved}; this one "
                              f"reads {list(self.topics)}, without "
                              f"{sorted(set(saved or []) - set(self.topics))}")
        if (state.get("epochs") is None) != (self._base.epochs is None):
            raise ConfigError("the state was saved by a loader " + (
                "with epochs=" if self._base.epochs is None else "without epochs="))
        if ("order" in state) != isinstance(self._ledger, OrderLedger) or \
                ("mix" in state) != (getattr(self._ledger, "mixer", None) is not None):
            with self._ledger.lock:  # says what differs, before anything changes
                self._ledger.load_state(state)
        if state.get("epochs") is not None:
            self._check_epoch_seeds(state)
        epoch, window = self._epoch, self._window
        try:
            mid_epoch = state.get("epochs") is None or self._load_epoch(state["epochs"])
            if mid_epoch:  # (between epochs, the next one starts afresh)
                with self._ledger.lock:
                    self._ledger.load_state(state)
        except ConfigError:
            # A refused state changes nothing: not the epoch, nor the part of
            # it the ledger had taken before it found what differs.
            self._epoch, self._window = epoch, window
            self._rebuild()
            raise
        # A resumed loader carries on its state's lineage: the commits of a
        # run killed before its first checkpoint are then its own too.
        # Every one: a merged state holds one per rank, and a commit of a lineage
        # left out would count as another reader's and win over the state.
        # (Merges dedupe them; a resume adds none: their number stays the job's
        # largest world size.)
        resumed = [x for x in state.get("lineages", []) if isinstance(x, str)]
        if resumed:
            self._lineages = resumed
            self._source.lineage = resumed[0]
            self._ledger.lineages = set(self._lineages)
        self._ledger.superseded = {x for x in state.get("superseded", []) if isinstance(x, str)}
        self._loaded_static = merge.static_cover(state)
        # The readers that saved the state used records of these topics, with
        # this schema and format (checked above): their messages decode, and
        # bad ones right after its positions are stray ones, routed as any
        # later ones are, not a schema that does not match (fail_fast).
        used = {t for t, _p in state_positions(state) if t in self.topics}
        if used:
            self._bad.good(used)

    def _check_epoch_seeds(self, state: Mapping[str, Any]) -> None:
        """With ``epochs=``, the state's Mix and Shuffle against this loader's for the
        state's epoch, before the epoch changes. Each epoch's seeds derive from
        those given (``_epoch_seed``): a difference names the given ones."""
        base = self._base
        try:
            epoch = int(state["epochs"]["epoch"])
        except (KeyError, TypeError, ValueError):
            return  # (_load_epoch says what is wrong with it)
        saved_mix = state["mix"].get("mix") if isinstance(state.get("mix"), Mapping) else None
        if base.mix is not None and saved_mix is not None:
            want = dataclasses.replace(base.mix, seed=_epoch_seed(base.mix.seed, epoch))
            if not _same_mix(saved_mix, want.describe()):
                seeds = (f"its seed is not this loader's Mix(seed={base.mix.seed}), "
                         f"from which epoch {epoch}'s order is dealt")
                raise ConfigError(f"the state was saved by another mixture: "
                                  f"{_mix_difference(saved_mix, want.describe(), seeds)}; "
                                  f"resume with the mixture it was saved with")
        order = state.get("order")
        if isinstance(order, Mapping) and bool(order.get("buffer")) != (base.shuffle is not None):
            raise ConfigError("the state was saved " + (
                f"with a shuffle (buffer {order.get('buffer')}), this loader has none"
                if base.shuffle is None else "without a shuffle, this loader has one"))
        if base.shuffle is not None and isinstance(order, Mapping) and (
                order.get("buffer"), order.get("seed")) != (
                base.shuffle.buffer, _epoch_seed(base.shuffle.seed, epoch)):
            raise ConfigError(
                f"the state was saved with another shuffle than this loader's "
                f"Shuffle(buffer={base.shuffle.buffer}, seed={base.shuffle.seed}), "
                f"from which epoch {epoch}'s is dealt" + (
                    f" (its buffer {order.get('buffer')})"
                    if order.get("buffer") != base.shuffle.buffer else "")
                + "; resume with the shuffle it was saved with")

    def _load_epoch(self, saved: Mapping[str, Any]) -> bool:
        """The epoch and window of a state; whether its positions are to load (mid-epoch)."""
        try:
            epoch, finished = int(saved["epoch"]), bool(saved["finished"])
            window = saved["window"]
            if window is not None:
                window = tuple({(str(t), int(p)): int(o) for t, p, o in window.get(name, [])}
                               for name in ("start", "until", "skips"))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a loader state: its epochs: {e!r}") from None
        self._window = window
        self._epoch = epoch + 1 if finished else epoch
        if self._epoch >= (self._base.epochs or 0):  # every epoch read
            self._epoch = self._base.epochs - 1  # type: ignore[operator]
            self._rebuild()
            self._exhausted = self._epoch_finished = True
            return False
        self._rebuild()
        return not finished

    @staticmethod
    def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One state for a job of any number of ranks, from each rank's ``state_dict()``.

        Gather every rank's state at one step (e.g. with
        ``torch.distributed.all_gather_object``), merge them, and give the
        merged state to every rank of the next job, however many it has:
        together they read exactly what the saving ranks had not handed
        out (NOTE [ Elastic resume ]). In offset order a partition's
        position is the furthest any rank saved; with ``shuffle``, ``pack``
        or a ``kfeed.Mix``, what each rank held back (its shuffle buffer,
        the documents its packer had not finished) is merged too. Every
        rank's lineage is kept, so that no rank's commits, which run ahead
        of the checkpoint, win over it.
        """
        return merge.merge_states(states, _STATE_VERSION)

    # -- observability --------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Throughput, bad records, lag per partition and time spent waiting in next().

        ``lag``: messages past what was handed out, per partition held;
        ``lag_unknown``: the partitions held whose lag is not known yet (a
        stream's partitions not fetched from, for about a second after they
        are assigned), left out of ``lag``. ``startup_s``: from the first
        next() to the first batch; while that batch has not come, the time so
        far.

        Also what ``kfeed.metrics`` publishes: ``group``, ``bad_by_reason``,
        ``wait_histogram`` (the waits in next() after the first batch),
        ``latency_histogram`` (from each batch's newest record's Kafka
        timestamp to its hand-out; in offset order only), ``commits`` (sent),
        ``commit_failures``, ``dead_lettered``, ``rebalances`` (assignments
        received), the seconds spent by stage (``fetch_s`` in consume,
        ``decode_s`` decoding, ordering and packing, ``copy_s`` issuing device
        copies), ``pool_slots_in_use``, and ``held_bytes``: what a shuffle or a
        mixture holds beside the pool (message values and documents, which
        ``max_memory_bytes`` does not cover).
        """
        with self._stages_lock:  # the stages and the counts carried past them, together
            ledger, fetcher, builder, source = self._ledger, self._fetcher, self._builder, \
                self._source
            feeder, bad, pool, carried = self._feeder, self._bad, self._pool, self._carried
        # Rates and stall are over the steady state, from the first batch on
        # to the read's end or close (the time between epochs left out);
        # joining the group and the first fetch show as startup_s.
        now = time.monotonic() if self._t_end is None else self._t_end
        elapsed = now - self._t_first - self._paused_s if self._t_first is not None else 0.0
        with self._stall_lock:  # a wait under way (next() on another thread), and those before
            since, wait_s = self._waiting_since, self._wait_s
            waiting = max(0.0, now - since) if since is not None else 0.0
            # A wait ends a moment after a scrape that counted it up to now:
            # the counter never goes down (Prometheus would read a reset).
            wait_s = self._wait_shown = max(self._wait_shown, wait_s + waiting)
        with ledger.lock:  # (after a message's last record: the next offset, lag 0)
            positions = {tp: ledger._whole(tp, pos)[0] for tp, pos in ledger.delivered().items()}
        if self._exhausted and feeder.epoch_over:
            # Everything up to each partition's end at the start was read;
            # what lies between the last record and that end (transaction
            # markers) is no lag.
            for tp, end in fetcher.ends.items():
                if tp in positions:
                    positions[tp] = max(positions[tp], end)
        # The partitions held now: one given up in a rebalance is its new owner's to report.
        assigned = fetcher.assigned
        # (Copies, taken whole under the GIL: the loader's thread adds to these dicts,
        # and a scrape iterating them as it did would fail.)
        lag = {f"{t}[{p}]": n
               for (t, p), n in sorted(source.lag(positions, dict(fetcher.ends)).items())
               if (t, p) in assigned}
        # A stream's partition not fetched from yet, before librdkafka's
        # first statistics: its end is not known (nothing asks the brokers
        # from here), so neither is its lag, and a sum over ``lag`` is short.
        lag_unknown = sorted(name for name in (f"{t}[{p}]" for t, p in list(assigned))
                             if name not in lag)
        reasons = dict(carried.get("bad_by_reason", {}))
        for why, n in dict(bad.by_reason).items():
            reasons[why] = reasons.get(why, 0) + n
        stats = {
            "samples": self._samples_out,
            "samples_decoded": builder.samples,
            "bytes": builder.value_bytes,
            "batches": self._batches,
            # Until the first batch, the wait for it so far: a loader stuck
            # before it (brokers, a group that assigns nothing) shows.
            "startup_s": (self._startup_s if self._t_first is not None or self._t0 is None
                          or self._startup_s else time.monotonic() - self._t0),
            "elapsed_s": elapsed,
            "samples_per_s": self._samples_out / elapsed if elapsed > 0 else 0.0,
            "mb_per_s": ((builder.value_bytes + carried.get("bytes", 0)) / elapsed / 1e6
                         if elapsed > 0 else 0.0),
            "bad_records": bad.count,
            "lag": lag,
            "lag_unknown": lag_unknown,
            "wait_s": wait_s,
            "longest_wait_s": max(self._longest_wait_s, waiting),
            "stall_fraction": wait_s / elapsed if elapsed > 0 else 0.0,
            "pool_bytes": pool.nbytes,
            "held_bytes": builder.held_bytes(),
            "group": source.group_id,
            "bad_by_reason": reasons,
            "wait_histogram": self._wait_hist,
            "latency_histogram": self._latency_hist,
            "commits": source.commits_sent,
            "commit_failures": source.commit_failures,
            "dead_lettered": source.dead_lettered,
            "rebalances": fetcher.rebalances,
            "fetch_s": fetcher.fetch_s,
            "decode_s": builder.decode_s,
            "copy_s": feeder.copy_s,
            "pool_slots_in_use": pool.in_use(),
            "prefetch": feeder.ready.size,
            "epoch": self._epoch,
            **self._mix_stats(ledger, self.config.mix, carried),
        }
        for key in _CARRIED:
            stats[key] += carried.get(key, 0)
        return stats

    @staticmethod
    def _mix_stats(ledger: Ledger, mix: Mix | None, carried: dict[str, Any]) -> dict[str, Any]:
        mixer = getattr(ledger, "mixer", None)
        if mixer is None or mix is None:
            return {}
        before = carried.get("mix", {})  # (the earlier epochs')
        return {"mix": {t: int(n) + before.get(t, 0)
                        for t, n in zip(mixer.sources, mixer.per_source, strict=True)},
                "mix_waiting_for": mixer.stalled_on}

    # -- shutdown (see NOTE [ Loader Shutdown Logic ]) -------------------------

    def lag_target(self) -> tuple[dict[str, Any], str, list[str]] | None:
        """(connection settings, group, topics) whose lag the metrics ask the brokers for.

        None for a source other than Kafka, or once closed.
        """
        if self._connection is None or self._closed:
            return None
        return self._connection, self._source.group_id, self.topics

    def close(self, *, commit_current: bool = True, timeout_s: float | None = None) -> None:
        """Stop the thread, commit what was used, close the consumer.

        The thread stops within one poll interval, unless a call into Kafka
        holds it (a commit or a dead-letter flush waits up to
        ``connect_timeout_s``); the final commit and the consumer's close
        then run on a thread of their own. Each of the two is given
        ``timeout_s`` (default: ``connect_timeout_s`` plus 5 s); past it,
        ``LoaderError`` names where it is stuck (NOTE [ Loader Shutdown Logic ]).
        """
        if self._closed:
            return
        self._closed = True
        # Closed, it is no longer published, even while a traceback keeps it alive.
        metrics.LIVE.discard(self)
        self._stop_clock()
        if commit_current:  # before the thread stops: a revoke waiting for this step commits it
            self._mark_used()
        f = self._feeder
        f.stop.set()
        self._pool.close()
        limit = self.config.connect_timeout_s + 5.0 if timeout_s is None else timeout_s
        if f.thread is not None:
            f.thread.join(limit)
            if f.thread.is_alive():
                # Closing the consumer under a thread still inside it is not
                # safe: it stays open, and the daemon thread dies with the
                # process.
                raise LoaderError(f"the loader thread did not stop within {limit:g}s: it is "
                                  f"stuck {self._status.doing}; the consumer was left open")
        if commit_current:
            self._take_rejected()
        self._bad.flush()
        if self._held is not None:
            # Closing the consumer under the commit still inside it is not safe.
            log.info("the consumer was left open: a thread is still %s", self._held)
            return
        if sys.is_finalizing():
            # (A loader collected at exit: a thread started now never runs,
            # and start() would wait for it for ever.)
            self._shut_down()
        elif not within(self._shut_down, "kfeed-close", limit):
            raise LoaderError(
                f"the consumer did not close within {limit:g}s: it is stuck "
                f"{self._status.doing}, because no broker answers or the group is "
                f"rebalancing, held up by a member that stopped without leaving; it goes on "
                f"closing in the background, and records used since the last commit that "
                f"went through will be read again by the next reader of the group")

    def _shut_down(self) -> None:
        """The final commit and the consumer's close (on the thread ``kfeed-close``); then
        the first of their errors, if any, is raised."""
        failed: list[BaseException] = []
        try:
            if not (self._ledger.failed and not self._ledger.handed_any):
                # (A read that failed before its first batch moved nothing:
                # committing its start positions would only make them look
                # read, to a later start="latest" say.)
                self._status.doing = "making the final commit (Source.commit)"
                todo, _alive = self._due()  # (the thread has stopped)
                if todo:
                    self._fetcher.commit_now(todo, asynchronous=False)
        except KfeedError as e:
            log.warning("final commit failed: %s", e)
        except BaseException as e:  # noqa: BLE001 - raised once the consumer is closed
            failed.append(e)
        try:
            self._status.doing = "closing the consumer (Source.close)"
            # Closing leaves the group, a revoke of every partition: it commits
            # nothing more than the final commit above, which has what is due.
            # (Of its own it commits what was handed out: the batch in hand
            # too, which close(commit_current=False) leaves to be read again.)
            self._fetcher.before_revoke = _commit_nothing
            self._source.close()
        except BaseException as e:  # noqa: BLE001 - as above
            failed.append(e)
        finally:
            # The stages call each other back (the revoke hook into the
            # feeder, the order's reset into the build stage, the source's
            # rebalance callbacks into the fetch stage): reference cycles.
            # Cut, a closed pipeline's memory (pool slots, fetched messages,
            # held values) goes as soon as nothing else holds it, rather than
            # at the cyclic collector's next full pass.
            self._fetcher.before_revoke = no_revoke_hook
            if isinstance(self._ledger, OrderLedger):
                self._ledger.on_reset = no_reset_hook
        if failed:
            raise failed[0]

    def __len__(self) -> int:
        # What a torch DataLoader given the Loader itself asks (its sampler's
        # range(len(dataset))): "object of type 'Loader' has no len()" said
        # nothing of what to do. A TypeError, as that was: list(), tqdm and
        # Lightning take a TypeError from len() as "no length" and go on.
        raise TypeError("a Loader is a stream of whole batches, with no length: iterate it "
                        "itself (for batch in loader), or give a torch DataLoader "
                        "kfeed.KafkaIterableDataset(...) with batch_size=None")

    def __bool__(self) -> bool:
        return True  # (not len(): a loader is never empty as a container)

    def __reduce__(self) -> Any:
        raise ConfigError("a Loader holds a Kafka consumer and a thread, which no pickle "
                          "carries: make one in each process instead, or give a torch "
                          "DataLoader kfeed.KafkaIterableDataset, which does (a state to carry "
                          "over is state_dict())")

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(commit_current=exc_type is None)

    def __del__(self) -> None:
        try:
            self.close(commit_current=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn things down
            pass


def _commit_nothing(tps: list[TP]) -> dict[TP, Position]:
    """The revoke hook of a closing loader: no commit (see ``Loader._shut_down``)."""
    return {}


# NOTE [ Epochs ]
# ~~~~~~~~~~~~~~~
# Loader(..., until=..., epochs=N) reads a bounded window N times. Each
# for-loop that runs to its end reads one epoch; the next for-loop reads
# the next one. A loop left early leaves its epoch open, and the next goes
# on inside it; set_epoch(e) moves to epoch e, as
# DistributedSampler.set_epoch does, leaving the rest of the one before unread. At the first epoch's start the window
# is resolved to offsets in every partition (Loader._resolve_window: start
# through the ledger's rules, until through Fetcher.ends_of), and every
# epoch reads exactly that window: records written later are not in it.
# Each epoch is a pipeline of its own (Loader._rebuild: a new consumer, the
# same lineage, a new run, so the last epoch's commits at the window's end
# are not taken for a position), with its own seeds for the shuffle and the
# mixture, drawn from the seed and the epoch number (epoch 0 keeps the
# seed). So that an epoch's order depends on those alone, its records go
# into the shuffle buffer in a fixed order, every partition in turn
# (Mixer.in_turn), whenever they go through an order at all (shuffle, pack,
# a jagged field, a mixture); without one, batches are in offset order per
# partition, interleaved as the brokers answer. state_dict() holds the
# epoch and the window: a state saved inside epoch k resumes inside it; one
# saved after its end starts epoch k + 1.


def _epoch_seed(seed: int, epoch: int) -> int:
    """Epoch 0 keeps the seed; every other epoch gets its own, from the seed and its number."""
    if epoch == 0:
        return seed
    # The (epoch)th SplitMix64 output from the seed: the mixer's own generator.
    return _splitmix((seed + (epoch - 1) * 0x9E3779B97F4A7C15) & (2**64 - 1))[1]


def memory_loader(values: Any, schema: Schema, batch_size: int, **kwargs: Any) -> Loader:
    """A Loader over recorded message values (see ``MemorySource``)."""
    loop = kwargs.pop("loop", False)
    return Loader(None, "memory", schema, batch_size,
                  source=MemorySource(values, loop=loop), **kwargs)
