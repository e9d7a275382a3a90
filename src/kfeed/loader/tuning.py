"""The tune stage: queue depth and librdkafka's buffers, within a memory cap.

Where it sits: beside the hand-over between the loader's thread and the
caller. ``Loader(prefetch="auto")`` deepens the ready queue while the
training loop waits for batches that the thread could have made ahead;
``max_memory_bytes`` bounds what the loader holds: librdkafka's pre-fetch
queue and fetches (``memory_settings``), the records a shuffle or a mixture
holds (``held_budget``), and the batches made ahead (the tuner's ceiling, or
a ``ConfigError`` for a fixed ``prefetch`` or shuffle buffer that does not
fit). Neither ever changes the batch size: only how far ahead the loader
reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from kfeed.errors import ConfigError

__all__ = ["FETCH_AHEAD", "CapTooSmall", "PrefetchTuner", "fetch_ahead", "memory_plan",
           "memory_settings"]

log = logging.getLogger("kfeed.loader")

# prefetch="auto" starts here and deepens at most to AUTO_MAX (or the cap).
AUTO_START = 2
AUTO_MAX = 64
# A window is at least this long and this many batches.
WINDOW_S = 0.5
WINDOW_BATCHES = 8
# The caller waiting more than this share of a window is a stall worth a deeper queue.
STALL = 0.01
# Batches the pool may hold besides the queue: on the CPU it keeps track of
# depth + 4 lent slots (the queue, the caller's batch, the one before it
# whose references may linger, and one more), plus the one filling.
HELD_BESIDES_QUEUE = 5
# Batches' worth of messages a fetch may take ahead of what its batch needs,
# of those librdkafka holds already (NOTE [ Fetching ahead ] in loader/build.py):
# FETCH_AHEAD_BYTES of values, from FETCH_AHEAD to FETCH_AHEAD_MOST batches, or
# under max_memory_bytes FETCH_AHEAD (the cap counts them, prefetch_ceiling).
FETCH_AHEAD = 4
FETCH_AHEAD_MOST = 16
FETCH_AHEAD_BYTES = 16 << 20
# NOTE [ librdkafka's memory ]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Of max_memory_bytes, librdkafka's pre-fetch queue takes an eighth
# (queued.max.messages.kbytes) and its fetches a sixteenth, shared by the
# brokers (fetch.max.bytes of each: a consumer has one fetch in flight per
# broker). What it holds is counted as the queue and three times the fetches:
# the queue's size is checked before a fetch is sent, not when it lands, so
# each broker's response may land past it; each response is one buffer,
# kept whole while any of its messages lives (queued, or pending in the
# loader); and one more per broker is in flight. Measured with 2 MiB
# records, a 128 MiB cap and 3 brokers, when the fetches took an eighth each,
# not shared: the queue held 44 to 50 MiB against its 16, and librdkafka
# 70 to 120 MiB in all against the 32 counted; the process went 183 MiB past
# its start. The brokers are those leading the topics' partitions, counted
# once, when the loader starts (``_kafka.broker_count``); a fetch is 1 MiB
# at least (librdkafka's message.max.bytes), so many brokers may take more.
_RDKAFKA_SHARE = 8
_FETCH_SHARE = 16
_FETCHES_HELD = 3


# Of max_memory_bytes, what a shuffle or a mixture holds takes up to a half
# (the records in their message values, a mixture's queues), where there is
# one; the batches made ahead get what is left.
_HELD_SHARE = 2
# Message values held for a shuffle's records weigh up to this many times
# the records themselves: a value is compacted once a quarter of it or less
# is left (NOTE [ Held records ] in loader/build.py).
_HELD_WORST = 4


# librdkafka's ranges: fetch.max.bytes <= 2147483135, queued.max.messages.kbytes
# <= 2097151; and fetch.max.bytes >= message.max.bytes (default 1000000).
_FETCH_MAX = 2147483135


def memory_settings(cap: int, kafka_config: Mapping[str, Any], brokers: int = 1
                    ) -> dict[str, Any]:
    """librdkafka's buffer settings within ``cap`` bytes, where the user did not set them.

    ``brokers``: how many the consumer may fetch from, each with a fetch of
    its own (NOTE [ librdkafka's memory ]).
    """
    message_max = int(kafka_config.get("message.max.bytes", 1_000_000))
    least = max(1 << 20, message_max)
    queue = min(_FETCH_MAX, max(least, cap // _RDKAFKA_SHARE))
    fetch = min(_FETCH_MAX, max(least, cap // _FETCH_SHARE // max(1, brokers)))
    wanted = {"queued.max.messages.kbytes": min(2097151, max(1024, queue >> 10)),
              "fetch.max.bytes": fetch,
              "max.partition.fetch.bytes": min(8 << 20, fetch)}
    return {k: v for k, v in wanted.items() if k not in kafka_config}


def rdkafka_bytes(kafka_config: Mapping[str, Any], brokers: int = 1) -> int:
    """What librdkafka may hold with these settings (NOTE [ librdkafka's memory ])."""
    queue_kb = kafka_config.get("queued.max.messages.kbytes")
    fetch = kafka_config.get("fetch.max.bytes")
    return (int(queue_kb) << 10 if queue_kb is not None else 0) + \
        _FETCHES_HELD * max(1, brokers) * int(fetch or 0)


class CapTooSmall(ConfigError):
    """``max_memory_bytes`` below what the loader's settings need; ``least`` fits them."""

    def __init__(self, message: str, least: int) -> None:
        super().__init__(message)
        self.least = least


def memory_plan(cap: int | None, kafka_config: Mapping[str, Any] | None, *,
                prefetch: int | str, batch_bytes: int, shuffled_records: int, record_size: int,
                mixing: bool, brokers: int = 1) -> tuple[tuple[int, int] | None, int]:
    """What ``held_budget`` and ``prefetch_ceiling`` give for ``cap``.

    ``kafka_config``: the user's librdkafka settings (None: not Kafka, no
    librdkafka buffers), fetching from ``brokers``. A cap too small raises
    ``CapTooSmall`` naming the least cap, in whole MiB, that fits the same
    settings.
    """

    def plan(cap: int | None) -> tuple[tuple[int, int] | None, int]:
        rdkafka = 0
        if cap is not None and kafka_config is not None:
            rdkafka = rdkafka_bytes(
                {**kafka_config, **memory_settings(cap, kafka_config, brokers)}, brokers)
        held = held_budget(cap, shuffled_records=shuffled_records, record_size=record_size,
                           mixing=mixing)
        budget = batches_budget(cap, rdkafka, batch_bytes, held[0] if held else 0)
        return held, prefetch_ceiling(prefetch, cap, budget, batch_bytes)

    def fits(cap: int) -> bool:
        try:
            plan(cap)
        except ConfigError:
            return False
        return True

    try:
        return plan(cap)
    except ConfigError as e:
        if cap is None:
            raise
        lo, hi = cap >> 20, max(1, cap >> 19)  # MiB: lo does not fit
        while not fits(hi << 20):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid << 20) else (mid, hi)
        raise CapTooSmall(f"{e}; the least max_memory_bytes these settings fit in is "
                          f"{hi << 20} ({hi} MiB)", hi << 20) from None


def held_budget(cap: int | None, *, shuffled_records: int, record_size: int, mixing: bool
                ) -> tuple[int, int] | None:
    """Bytes a shuffle's or a mixture's records may take of ``cap``, and of those the
    mixture's queues (None: no cap, or none held).

    ``shuffled_records``: the records a shuffle of fixed shapes holds (its
    buffer and a batch), 0 for none; its values may weigh ``_HELD_WORST``
    times as much, which must fit, or it is a ``ConfigError``; a mixture's
    queues get the rest. (The documents a shuffle of documents holds depend
    on their lengths: not counted.)
    """
    if cap is None or not (shuffled_records or mixing):
        return None
    share = cap // _HELD_SHARE
    need = _HELD_WORST * shuffled_records * record_size
    if need > share:
        raise ConfigError(
            f"max_memory_bytes={cap} leaves {share} bytes for the records a shuffle holds; "
            f"its {shuffled_records} records of {record_size} bytes (the buffer and a batch) "
            f"may hold up to {need} bytes of message values: a larger max_memory_bytes or a "
            f"smaller Shuffle(buffer=)")
    return share, share - need


def batches_budget(cap: int | None, rdkafka: int, batch_bytes: int, held: int = 0
                   ) -> int | None:
    """How many batches of ``batch_bytes`` the cap leaves beside librdkafka's ``rdkafka``
    bytes and the ``held`` bytes of a shuffle's or a mixture's records."""
    if cap is None:
        return None
    return max(0, cap - rdkafka - held) // max(1, batch_bytes)


def fetch_ahead(capped: bool) -> int:
    """The most batches' worth a fetch takes ahead (the messages' bytes bound it too).

    ``capped``: under ``max_memory_bytes``, whose share for batches goes to
    the ready queue first.
    """
    return FETCH_AHEAD if capped else FETCH_AHEAD_MOST


def prefetch_ceiling(prefetch: int | str, cap: int | None, budget: int | None,
                     batch_bytes: int) -> int:
    """The deepest queue allowed: ``prefetch`` itself, or for "auto" what the cap leaves."""
    depth = AUTO_MAX if prefetch == "auto" else int(prefetch)
    if budget is None:
        return depth
    besides = HELD_BESIDES_QUEUE + FETCH_AHEAD
    fits = budget - besides
    if fits < 1 or (prefetch != "auto" and fits < depth):
        need = (max(1, depth if prefetch != "auto" else 1) + besides) * batch_bytes
        raise ConfigError(
            f"max_memory_bytes={cap} leaves room for {max(budget, 0)} batches of "
            f"{batch_bytes} bytes beside librdkafka's buffers (and a shuffle's or a mixture's "
            f"records, if any); prefetch={prefetch!r} needs "
            f"{need} bytes for its batches (the queue, {HELD_BESIDES_QUEUE} more and "
            f"{FETCH_AHEAD} fetched ahead)")
    return min(depth, fits)


class PrefetchTuner:
    """prefetch="auto": the ready queue deepens while the caller waits and the thread idles.

    ``observe(stalled, now)`` after each batch handed out, ``stalled`` the
    time the caller waited for it when none was ready (a wait for a batch
    already queued is the hand-over's cost, not a stall). At the end of a
    window, if the caller stalled more than ``STALL`` of it and the loader's
    thread found the queue full in it (the loop's demand comes in bursts the
    queue is too short to cover; a loader that is simply slower never fills
    it, and a deeper queue would not help), the depth doubles, up to the
    ceiling. ``changes`` keeps every decision: (time, old, new, stall).
    """

    def __init__(self, ready: Any, pool: Any, ceiling: int) -> None:
        self.ready = ready
        self.pool = pool
        self.ceiling = ceiling
        self.depth = min(AUTO_START, ceiling)
        self._set(self.depth)
        self.changes: list[tuple[float, int, int, float]] = []
        self._start: float | None = None
        self._waited = 0.0
        self._batches = 0
        self._full = ready.full_count

    def _set(self, depth: int) -> None:
        self.ready.resize(depth)
        self.pool.most_lent = depth + HELD_BESIDES_QUEUE - 1

    def observe(self, stalled: float, now: float) -> None:
        if self._start is None:
            self._start = now
            return
        self._waited += stalled
        self._batches += 1
        span = now - self._start
        if span < WINDOW_S or self._batches < WINDOW_BATCHES:
            return
        stall = self._waited / span
        full = self.ready.full_count != self._full
        if stall > STALL and full and self.depth < self.ceiling:
            new = min(self.ceiling, self.depth * 2)
            log.info("prefetch %d -> %d: the loop waited %.1f%% of the last %.1f s while the "
                     "loader's queue was full at times", self.depth, new, 100 * stall, span)
            self.changes.append((now, self.depth, new, stall))
            self.depth = new
            self._set(new)
        self._start, self._waited, self._batches = now, 0.0, 0
        self._full = self.ready.full_count


class GrownBatches:
    """NOTE [ Batches that grow ]: the cap asked again as a variable-length field's
    batches grow (``check`` after each batch handed out, on the caller's thread).

    The pool's slots start with room for ``JAGGED_START`` elements a record
    and grow to the largest batch each held, so the batches the cap was
    planned for at the start were far smaller than those it holds later.
    Once the largest slot grows, ``plan`` (``memory_plan`` for a batch of that
    size) says how deep the queue may be: ``prefetch="auto"`` stays within it
    (shallower at once if it is past it); a fixed ``prefetch`` past it is
    said once, as a warning, for the read goes on.
    """

    def __init__(self, pool: Any, plan: Any, config: Any) -> None:
        self.pool = pool
        self.plan = plan
        self.config = config
        self.seen = max(s.nbytes for s in pool.slots)
        self.warned = False

    def check(self, tuner: PrefetchTuner | None) -> None:
        largest = max(s.nbytes for s in self.pool.slots)
        if largest <= self.seen:
            return
        self.seen = largest
        try:
            depth = self.plan(largest)[1]
        except ConfigError:
            depth = 0
        cap = self.config.max_memory_bytes
        if tuner is not None:
            tuner.ceiling = max(1, depth)
            if tuner.depth > tuner.ceiling:
                log.info("prefetch %d -> %d: the batches grew to %d bytes (a variable-length "
                         "field), and max_memory_bytes=%d holds %d of them", tuner.depth,
                         tuner.ceiling, largest, cap, tuner.ceiling)
                tuner.changes.append((time.monotonic(), tuner.depth, tuner.ceiling, 0.0))
                tuner.depth = tuner.ceiling
                tuner._set(tuner.depth)
            if depth >= 1:
                return
        elif depth >= self.config.prefetch:
            return
        if not self.warned:
            self.warned = True
            log.warning(
                "the batches grew to %d bytes (their variable-length field's records are "
                "larger than at the start): prefetch=%s and the batches held beside it no "
                "longer fit max_memory_bytes=%d; a smaller batch_size or prefetch, or a larger "
                "cap, keeps the loader within it", largest, self.config.prefetch, cap)

