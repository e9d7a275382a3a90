"""Mixtures: several topics read in set proportions, in an order fixed by the seed.

In the data flow the mixer sits in the order stage, between the codec and
the shuffle buffer: ``RecordBuilder`` decodes a fetch into records (rows
``[partition id, offset, sub, item]``), the ``Mixer`` queues them per
partition and lets them out in the mixture's order, and the
``OrderLedger``'s ``ShuffleBuffer`` takes them from there (in order, or
shuffled), then the packer or the slot.

The order (``_pack.mix_take``): sources are drawn by smooth weighted round
robin, so over any n consecutive records a source of weight w has n * w
records, give or take a couple; a source's partitions take turns record by
record, in partition order. A draw waits until its record is there, so the
order depends on the seed, the weights and the records alone, never on when
the brokers answered: the same seed over the same topics gives the same
stream. The price of that: a source with no records holds up the mixture
(as with every fixed-proportion mix); a source that runs ahead is paused, so
memory stays bounded. Within a source, an unbounded read does not wait on a
partition at its end (the fetch stage saw its end-of-partition event and no
record since): its turn passes to the next partition with records, so one
idle key or a partition written slower than its siblings does not hold its
topic up. Over records already written the order is still the records'
alone (a partition is passed over only once it has none left); a turn
passed while records were still being written depends on when they came
(records behind an open transaction count as written when it ends).

NOTE [ Mixer state ]
~~~~~~~~~~~~~~~~~~~~
The mixer's state is small: the credits of the round robin, each source's
next partition, which sources ran out, and how many records were mixed
(the step of a weight schedule). It is taken under the ledger's lock with
the shuffle buffer's, whose *read* positions say where the mixed stream
stands in every partition. A resume re-reads each partition from the shuffle
buffer's watermark: records below its read position were mixed already and
go straight back to the shuffle buffer (which skips them, or puts a held
one back in its slot); the rest queue in the mixer, which, from the same
state, lets them out in the same order as the run that saved it.
"""

from __future__ import annotations

import math
import operator
import numbers
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import logging

import numpy as np

from kfeed import _pack
from kfeed.errors import ConfigError

log = logging.getLogger("kfeed.loader")

__all__ = ["Mix", "Mixer"]

_EXHAUSTED = ("stop", "renormalize", "repeat")
_SCALE = 1 << 32  # weights as integers summing to about this: the same order on every machine
_MASK64 = 2**64 - 1

Weights = Mapping[str, float]


@dataclass(frozen=True)
class Mix:
    """Several topics in set proportions: pass it to ``kfeed.Loader`` in place of the topics.

    ``weights``: ``{topic: weight}`` (any non-negative numbers; they are
    normalized), or a callable of the step returning such a dict, the same
    topics every time, for a curriculum. The step counts ``batch_size``
    records mixed (documents, with ``pack``), so it is the same on a resume;
    with ``epochs=N`` it counts within the epoch, from 0 each time.

    ``seed``: where the round robin starts; the same seed over the same
    records gives the same stream.

    ``exhausted``, for a bounded read (``until``): what happens once a source
    has no record left. ``"stop"``: the epoch ends (the other sources' records
    stay unread, and are the next read's); ``"renormalize"``: the others go on,
    in the same proportions to each other, until all ran out; ``"repeat"``: that
    source is read again from where this read started it, and the read ends
    once every source ran out at least once (a source with nothing in its
    window drops out).
    """

    weights: Weights | Callable[[int], Weights]
    seed: int = 0
    exhausted: str = "stop"
    topics: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        seed = as_int(self.seed)
        if seed is None or not 0 <= seed < 2**64:
            raise ConfigError(f"Mix seed must be an int in 0..2**64-1, got {self.seed!r}")
        object.__setattr__(self, "seed", seed)  # a numpy integer, as a Python int
        if self.exhausted not in _EXHAUSTED:
            raise ConfigError(f"Mix exhausted must be 'stop', 'renormalize' or 'repeat', "
                              f"got {self.exhausted!r}")
        if callable(self.weights):
            first = self.weights_at(0, None)
        elif isinstance(self.weights, Mapping):
            first = _checked(self.weights, None, "Mix weights")
            object.__setattr__(self, "weights", dict(first))
        else:
            raise ConfigError("Mix weights must be a dict {topic: weight} or a callable "
                              f"of the step returning one, got {type(self.weights).__name__}")
        object.__setattr__(self, "topics", tuple(first))

    def __hash__(self) -> int:  # (the generated one fails on the weights' dict)
        weights = self.weights if callable(self.weights) else frozenset(self.weights.items())
        return hash((weights, self.seed, self.exhausted, self.topics))

    @property
    def scheduled(self) -> bool:
        return callable(self.weights)

    def weights_at(self, step: int, topics: tuple[str, ...] | None) -> dict[str, float]:
        """The weights at ``step``, checked (a schedule must name the same topics)."""
        if not callable(self.weights):
            return dict(self.weights)
        try:
            got = self.weights(step)
        except Exception as e:  # the user's schedule: say where it failed
            raise ConfigError(f"the Mix weight schedule failed at step {step}: {e!r}") from e
        return _checked(got, topics, f"the Mix weight schedule at step {step}")

    def describe(self) -> dict[str, Any]:
        """What a state must match to be resumed: the topics, the seed, the rule."""
        weights = "schedule" if self.scheduled else {t: float(w) for t, w in
                                                     sorted(self.weights.items())}  # type: ignore[union-attr]
        return {"topics": list(self.topics), "seed": self.seed, "exhausted": self.exhausted,
                "weights": weights}


def _scaled(weights: Mapping[str, Any]) -> dict[str, int]:
    """Weights as the order uses them (``Mixer._weights_for``): scaled to sum to ``_SCALE``."""
    total = sum(weights.values())
    return {t: max(round(w / total * _SCALE), 1) if w > 0 else 0 for t, w in weights.items()}


def _same_mix(saved: Any, want: dict[str, Any]) -> bool:
    """Whether a state's ``describe()`` is ``want``'s mixture: its weights compared as
    the order uses them, so {a: 1, b: 1} resumes a state of {a: 0.5, b: 0.5}."""
    if not isinstance(saved, Mapping):
        return False
    a, b = saved.get("weights"), want["weights"]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        try:
            saved, want = {**saved, "weights": _scaled(a)}, {**want, "weights": _scaled(b)}
        except (TypeError, ValueError, ZeroDivisionError, OverflowError):
            return False
    return saved == want


def _mix_difference(saved: Any, want: dict[str, Any], seeds: str | None = None) -> str:
    """What makes a state's mixture (``describe()``) not ``want``, in words; ``seeds``:
    what to say where the seeds differ, if not the two seeds."""
    if not isinstance(saved, Mapping):
        return f"not a mixture ({saved!r})"
    said = []
    a, b = saved.get("topics"), want["topics"]
    if isinstance(a, list) and sorted(map(str, a)) == sorted(b) and a != b:
        said.append(f"its topics in the order {a}, this loader's {b} (the order of the "
                    f"weights' keys is part of the mixture: the seed deals turns by it)")
    elif a != b:
        said.append(f"its topics {a}, this loader's {b}")
    for key in ("seed", "exhausted"):
        if saved.get(key) != want[key]:
            said.append(seeds if key == "seed" and seeds is not None else
                        f"its {key} {saved.get(key)!r}, this loader's {want[key]!r}")
    if not said or not _same_mix({**saved, "topics": b, "seed": want["seed"],
                                  "exhausted": want["exhausted"]}, want):
        said.append(f"its weights {saved.get('weights')}, this loader's {want['weights']}")
    return "; ".join(said)


def as_int(x: Any) -> int | None:
    """``x`` as a Python int, if it is an integer (numpy's too) and no bool; else None."""
    if isinstance(x, bool) or isinstance(x, np.bool_):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _checked(weights: Any, topics: tuple[str, ...] | None, what: str) -> dict[str, float]:
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(f"{what} must be a non-empty dict {{topic: weight}}, got {weights!r}")
    out: dict[str, float] = {}
    for topic, w in weights.items():
        if not isinstance(topic, str) or not topic:
            raise ConfigError(f"{what}: topic names must be non-empty strings, got {topic!r}")
        try:
            x = float(w) if isinstance(w, (numbers.Real, Decimal)) \
                and not isinstance(w, (bool, np.bool_)) else math.nan
        except OverflowError:
            x = math.inf
        if not math.isfinite(x) or x < 0:
            raise ConfigError(f"{what}: the weight of {topic!r} must be a finite number >= 0, "
                              f"got {w!r}")
        out[topic] = x
    total = sum(out.values())
    if total <= 0:
        raise ConfigError(f"{what}: at least one weight must be above 0, got {out}")
    if not math.isfinite(total):
        raise ConfigError(f"{what}: the weights {out} add up past the largest float: "
                          f"give them on a smaller scale (only their proportions count)")
    if topics is not None:
        if set(out) != set(topics):
            raise ConfigError(f"{what} names {sorted(out)}, not the mixture's topics "
                              f"{sorted(topics)}")
        out = {t: out[t] for t in topics}
    return out


def _split(run: np.ndarray, offset: int, sub: int) -> tuple[np.ndarray, np.ndarray]:
    """A run of one partition: the records at or after ``(offset, sub)``, and those before."""
    before = (run[:, 1] < offset) | ((run[:, 1] == offset) & (run[:, 2] < sub))
    return run[~before], run[before]


def _splitmix(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


class Mixer:
    """A ``Mix`` at work: records queued per partition, let out in the mixture's order.

    The caller (``RecordBuilder``, under the ledger's lock) gives it the
    assignment (``assign``: partition -> id of the shuffle buffer), pushes each
    fetch's records (``push``, which returns those to pass straight on, see
    NOTE [ Mixer state ]), tells it which partitions were read to their end
    (``done``), and takes what may go out (``take``).
    """

    def __init__(self, mix: Mix, batch_size: int, *, bounded: bool) -> None:
        self.mix = mix
        self.batch_size = batch_size
        self.bounded = bounded
        self.sources = mix.topics
        self._index = {t: i for i, t in enumerate(self.sources)}
        n = len(self.sources)
        self.credits = np.zeros(n, np.int64)
        rng = mix.seed
        for s in range(n):  # where the round robin starts: the seed's
            rng, z = _splitmix(rng)
            self.credits[s] = z % _SCALE
        self.credits -= int(self.credits.sum()) // n
        self.live = np.ones(n, np.uint8)     # not run out (a bounded read, "renormalize")
        self.ran_out = np.zeros(n, np.uint8)  # "repeat": ran out at least once
        self.since = np.zeros(n, np.int64)    # "repeat": records let out since its last start
        self.to_repeat: int | None = None     # "repeat": the source to read again now
        self.present = np.zeros(n, np.uint8)  # with a partition in the assignment
        self.mixed = 0        # records let out: the step of a schedule is mixed // batch_size
        self.ended = False    # a bounded read: the mixture is over
        self.per_source = np.zeros(n, np.int64)  # records let out, for stats
        self.stalled_on: str | None = None  # the source the mixture waits for, if any
        self._step = -1
        self.weights = np.zeros(n, np.int64)
        # The next partition of each source (kept as a partition, not a turn
        # number, so that it survives a new assignment).
        self._next: list[Hashable | None] = [None] * n
        self._parts: dict[int, Hashable] = {}  # id -> partition, of the assignment
        self._known: set[Hashable] = set()  # the partitions of the last assignment
        self._one_source = False  # see in_turn
        self._held_said: list[int] | None = None  # see _say_held_by_schedule
        self._idle_said: tuple[Any, ...] | None = None  # (topics, weights) last warned of
        self.reset()

    @property
    def mixes(self) -> bool:
        """A mixture of topics (not ``in_turn``)."""
        return not self._one_source

    @classmethod
    def in_turn(cls, batch_size: int, *, bounded: bool) -> Mixer:
        """No mixture: every partition of every topic in one ring, in turn, record by record.

        The order of records a loader with ``epochs`` pushes into its shuffle
        buffer, so that an epoch's order depends on the seed and the records
        alone, not on which partition the brokers answered for first.
        """
        mixer = cls(Mix({"*": 1.0}), batch_size, bounded=bounded)
        mixer._one_source = True
        return mixer

    # -- the assignment and the queues ------------------------------------------

    def reset(self) -> None:
        """Drop every queued record and the assignment (the order was rebuilt)."""
        self._tail: dict[int, tuple[int, int]] = {}  # per id, the last record queued
        self.repeats: list[np.ndarray] = []  # items of records queued twice: the caller frees them
        # Each partition id queues in its own region of the pool,
        # [base, base + room), its records at [head, end).
        self._pool = np.empty((0, 4), np.int64)
        self._base = np.zeros(0, np.int64)
        self._room = np.zeros(0, np.int64)
        self._head = np.zeros(0, np.int64)
        self._end = np.zeros(0, np.int64)
        self._done = np.zeros(0, np.uint8)
        self._idle = np.zeros(0, np.uint8)
        self._src_of = np.zeros(0, np.int64)
        self._ring = np.zeros(0, np.int64)
        self._ring_start = np.zeros(len(self.sources), np.int64)
        self._ring_len = np.zeros(len(self.sources), np.int64)
        self._rr = np.zeros(len(self.sources), np.int64)
        self._parts = {}

    def _grow(self, n: int) -> None:
        """Room for partition ids below ``n``, and for ``need[p]`` more records of each."""
        have = len(self._head)
        if n <= have:
            return
        more = n - have
        at = np.full(more, len(self._pool), np.int64)
        self._base = np.concatenate([self._base, at])
        self._room = np.concatenate([self._room, np.zeros(more, np.int64)])
        self._head = np.concatenate([self._head, at])
        self._end = np.concatenate([self._end, at])
        self._done = np.concatenate([self._done, np.zeros(more, np.uint8)])
        self._idle = np.concatenate([self._idle, np.zeros(more, np.uint8)])
        self._src_of = np.concatenate([self._src_of, np.zeros(more, np.int64)])

    def _append(self, p: int, rows: np.ndarray) -> None:
        """Queue ``rows`` of partition id ``p`` at the end of its region, making room."""
        n = len(rows)
        base, room, head, end = (int(self._base[p]), int(self._room[p]), int(self._head[p]),
                                 int(self._end[p]))
        if end + n > base + room:
            kept = end - head
            if kept + n <= room and head > base:  # slide what is left to the region's start
                self._pool[base:base + kept] = self._pool[head:end]
            else:  # a bigger region for p: the pool is laid out again
                self._layout(p, max(2 * room, kept + n, 64))
                base = int(self._base[p])
            head, end = base, base + kept
        self._pool[end:end + n] = rows
        self._head[p], self._end[p] = head, end + n

    def _layout(self, p: int, room: int) -> None:
        rooms = self._room.copy()
        rooms[p] = room
        base = np.concatenate([[0], np.cumsum(rooms)[:-1]]).astype(np.int64)
        pool = np.empty((int(rooms.sum()), 4), np.int64)
        kept = self._end - self._head
        for q in np.nonzero(kept)[0].tolist():
            pool[base[q]:base[q] + kept[q]] = self._pool[self._head[q]:self._end[q]]
        self._pool, self._base, self._room = pool, base, rooms
        self._head, self._end = base.copy(), base + kept

    def assign(self, parts: Mapping[Hashable, int], *, force: bool = False) -> None:
        """The partitions to mix (``(topic, partition)`` -> id), each source's in turn.

        ``force``: lay the rings out again though the partitions are the same
        (a source read again: its partitions left its ring as they ran out).
        """
        if not force and parts == {v: k for k, v in self._parts.items()}:
            return
        self._remember_next()
        self._grow(max(parts.values(), default=-1) + 1)
        rings: list[list[int]] = [[] for _ in self.sources]
        for tp in sorted(parts):
            s = 0 if self._one_source else self._index.get(tp[0])  # type: ignore[index]
            if s is None:
                raise ConfigError(f"partition {tp} is not of the mixture's topics "
                                  f"{list(self.sources)}")
            rings[s].append(parts[tp])
        self._parts = {pid: tp for tp, pid in parts.items()}
        self.present = np.array([bool(r) for r in rings], np.uint8)
        new = set(parts) - self._known
        self._known = set(parts)
        for s, ring in enumerate(rings):  # a new partition not read to its end: the source is back
            if any(self._parts[p] in new and not self._done[p] for p in ring):
                self.live[s] = 1
        for s, ring in enumerate(rings):
            self._src_of[ring] = s
        self._ring = np.array([p for r in rings for p in r], np.int64)
        self._ring_len = np.array([len(r) for r in rings], np.int64)
        self._ring_start = np.concatenate([[0], np.cumsum(self._ring_len)[:-1]]).astype(np.int64)
        for s, ring in enumerate(rings):
            nxt = self._next[s]
            turn = [self._parts[p] for p in ring].index(nxt) \
                if nxt is not None and nxt in [self._parts[p] for p in ring] else 0
            self._rr[s] = turn

    def remember_turns(self) -> None:
        """Note each source's next partition (before the order is rebuilt by a rebalance).

        Its records go back to be read again, so the mixture is not over any
        more, and which sources ran out is found out again (as for merged
        states, ``Loader.merge_states``).
        """
        self._remember_next()
        self.ended = False
        self.live[:] = 1

    def _remember_next(self) -> None:
        for s in range(len(self.sources)):
            n = self._ring_len[s]
            if n:
                self._next[s] = self._parts[int(self._ring[self._ring_start[s] + self._rr[s]])]
            elif self._parts and self.present[s]:
                # Every partition ran out: read again, its turns start at the first.
                self._next[s] = None

    def partitions(self) -> dict[int, Hashable]:
        """The assignment: id -> partition."""
        return self._parts

    def absent(self) -> list[str]:
        """The sources without a partition in the assignment (left out of the mixture)."""
        return [t for s, t in enumerate(self.sources) if not self.present[s]]

    def done(self, pids: list[int]) -> None:
        """Exactly these partitions are read to their end (a bounded read)."""
        if pids:
            self._grow(max(pids) + 1)
        self._done[:] = 0
        self._done[pids] = 1

    def idle(self, pids: list[int]) -> None:
        """Exactly these partitions are at their end for now (an unbounded read): one
        with no record queued passes its turn to the next of its source."""
        if pids:
            self._grow(max(pids) + 1)
        self._idle[:] = 0
        self._idle[pids] = 1

    def queued(self) -> np.ndarray:
        """Records queued per partition id."""
        return self._end - self._head

    def push(self, recs: np.ndarray, arrived: np.ndarray, known: np.ndarray) -> np.ndarray:
        """Queue a fetch's records; returns those that pass straight on.

        ``arrived``/``known`` (``ShuffleBuffer.arrived()``): per id, the
        position after the last record the shuffle buffer took. A record
        below it was mixed before (a resume reads it again, NOTE [ Mixer
        state ]): it goes straight back to the shuffle buffer.
        """
        if not len(recs):
            return recs
        # A fetch comes in runs of one partition, in offset order: a run's
        # first record says whether any of it passes straight on.
        cuts = np.flatnonzero(recs[1:, 0] != recs[:-1, 0]) + 1
        bounds = [0, *cuts.tolist(), len(recs)]
        firsts = recs[bounds[:-1]].tolist()
        nknown = len(known)
        passed: list[np.ndarray] = []
        for (p, o, sub, _item), a, b in zip(firsts, bounds[:-1], bounds[1:], strict=True):
            if p >= len(self._head):
                self._grow(p + 1)
            run = recs[a:b]
            if p < nknown and known[p] and (o, sub) < (arrived[p, 0], arrived[p, 1]):
                run, below = _split(run, int(arrived[p, 0]), int(arrived[p, 1]))
                passed.append(below)
            tail = self._tail.get(p)
            if tail is not None and len(run) and (int(run[0, 1]), int(run[0, 2])) <= tail:
                # Queued already (read again): the order must not see it twice.
                run, again = _split(run, tail[0], tail[1] + 1)
                self.repeats.append(again[:, 3])
            if len(run):
                self._append(p, run)
                self._tail[p] = (int(run[-1, 1]), int(run[-1, 2]))
        if not passed:
            return recs[:0]
        return passed[0] if len(passed) == 1 else np.concatenate(passed)

    # -- the mixture ----------------------------------------------------------

    def _weights_for(self, step: int) -> None:
        if step == self._step:
            return
        self._step = step
        # (A weight above 0 is never rounded to none: its source still takes turns.)
        w = _scaled(self.mix.weights_at(step, self.sources))
        self.weights = np.array([w[t] for t in self.sources], np.int64)

    def take(self) -> np.ndarray:
        """The records that may go out now, in the mixture's order."""
        out_parts: list[np.ndarray] = []
        self._counted, self._taken = 0, []
        self.stalled_on = None
        if self.to_repeat is not None:  # waits until the caller started it again
            self.stalled_on = self.sources[self.to_repeat]
            return np.empty((0, 4), np.int64)
        while not self.ended and self._parts:
            self._weights_for(self.mixed // self.batch_size)
            limit = int((self._end - self._head).sum()) + 1
            if self.mix.scheduled:
                limit = min(limit, self.batch_size - self.mixed % self.batch_size)
            out = np.empty((limit, 4), np.int64)
            n, why, src = _pack.mix_take(
                self._pool, self._head, self._end, self._done, self._idle, self._ring,
                self._ring_start, self._ring_len, self._rr, self.weights, self.credits,
                self.live & self.present, limit, out)
            if n:
                out_parts.append(out[:n])
                self.mixed += n
            if why == _pack.MIX_LIMIT:
                if n == 0 or not self.mix.scheduled:
                    break
                continue
            if why == _pack.MIX_STALLED:
                self.stalled_on = self.sources[src]
                break
            if why == _pack.MIX_EXHAUSTED and self.mix.exhausted == "renormalize":
                self.live[src] = 0
                self.credits[src] = 0
                continue
            if why == _pack.MIX_EXHAUSTED and self.mix.exhausted == "repeat":
                self._count(out_parts)
                self.ran_out[src] = 1
                if self.since[src] == 0:  # nothing in its window: it drops out
                    self.live[src] = 0
                    self.credits[src] = 0
                    continue
                # (A source of weight 0 throughout is never drawn: it cannot run
                # out. One a schedule weights 0 now may be later: the others are
                # read again till then.)
                never = (self.weights == 0) if not self.mix.scheduled else False
                if not (self.ran_out | ~self.live.astype(bool) | ~self.present.astype(bool)
                        | never).all():
                    self._say_held_by_schedule()
                    self.to_repeat = src  # the caller starts its partitions again
                    self.since[src] = 0
                    break
            if why == _pack.MIX_NONE and not self.bounded:
                self._say_idle()  # what this member holds has no weight now
                break
            if why == _pack.MIX_NONE:
                self._say_unread()
            if why == _pack.MIX_EXHAUSTED and self.mix.exhausted == "stop":
                self._count(out_parts)
                if self.since[src] == 0:
                    log.warning("exhausted='stop': %s has no records left in the window, so the "
                                "mixture ends at its first turn, after %d records; "
                                "exhausted='renormalize' reads the others without it",
                                self.sources[src], self.mixed)
            self.ended = True  # a source ran out ("stop"), or all did
        self._count(out_parts)
        taken, self._taken = self._taken, []
        if not taken:
            return np.empty((0, 4), np.int64)
        return taken[0] if len(taken) == 1 else np.concatenate(taken)

    def _say_held_by_schedule(self) -> None:
        """Once per set of sources: the ones yet to run out all weigh 0 now, so the read
        goes on, the others read again, until the schedule weights one of them again."""
        waiting = [k for k in range(len(self.sources))
                   if not self.ran_out[k] and self.live[k] and self.present[k]]
        if not waiting or any(self.weights[k] for k in waiting) or waiting == self._held_said:
            return
        self._held_said = waiting
        names = ", ".join(self.sources[k] for k in waiting)
        log.warning("exhausted='repeat': %s %s not run out, and the schedule weights %s 0 "
                    "at step %d: the other sources are read again until it weights %s above "
                    "0; a bounded read ends only once every source ran out",
                    names, "has" if len(waiting) == 1 else "have",
                    "it" if len(waiting) == 1 else "them", self.mixed // self.batch_size,
                    names if len(waiting) == 1 else f"one of {names}")

    def _say_idle(self) -> None:
        """Once per assignment and weights: why a member of a group hands out nothing."""
        held = sorted({str(tp[0]) for tp in self._parts.values()})  # type: ignore[index]
        said = (tuple(held), tuple(self.weights.tolist()))
        if said == self._idle_said:
            return
        self._idle_said = said
        log.warning("this member holds partitions only of topic%s %s, whose weight in the "
                    "mixture is 0 now: it hands out nothing until it is given a partition of "
                    "a topic weighted above 0", "s" if len(held) > 1 else "", ", ".join(held))

    def _say_unread(self) -> None:
        """A bounded read that ends with sources left only because they weigh 0 now."""
        if not self.mix.scheduled:  # weighted 0 throughout: never drawn, as documented
            return
        pids = np.array(sorted(self._parts), np.int64)
        unread = (self._head[pids] < self._end[pids]) | (self._done[pids] == 0)
        has = np.bincount(self._src_of[pids[unread]], minlength=len(self.sources))
        left = [t for k, t in enumerate(self.sources) if self.live[k] and has[k]]
        if left:
            log.warning("the mixture ends at step %d with records of %s left unread: the "
                        "schedule weights %s 0 now, and no other source has records left",
                        self.mixed // self.batch_size, ", ".join(left),
                        "it" if len(left) == 1 else "them")

    def _count(self, out_parts: list[np.ndarray]) -> None:
        """Count the records let out so far by source (once each), and keep them."""
        new = out_parts[self._counted:]
        self._counted = len(out_parts)
        for out in new:
            by = np.bincount(self._src_of[out[:, 0]], minlength=len(self.sources))
            self.per_source += by
            self.since += by
            self._taken.append(out)

    # -- state (see NOTE [ Mixer state ]) ----------------------------------------

    def state(self) -> dict[str, Any]:
        self._remember_next()
        return {
            "mix": self.mix.describe(),
            "credits": [int(c) for c in self.credits],
            "live": [bool(x) for x in self.live],
            "next": [None if n is None else list(n) for n in self._next],  # type: ignore[arg-type]
            "mixed": self.mixed,
            "ended": self.ended,
            "to_repeat": self.to_repeat,
            "ran_out": [bool(x) for x in self.ran_out],
            "since": [int(x) for x in self.since],
            "schedule": self._schedule_marks() if self.mix.scheduled else None,
        }

    def _schedule_marks(self) -> list[list[Any]]:
        """A schedule's scaled weights at steps 0, 1, 2, 4, ... up to the step now: a state
        resumed with another schedule that differs there is refused (``load_state``)."""
        now = self.mixed // self.batch_size
        steps = sorted({0, now, *(1 << k for k in range(max(now, 1).bit_length()))})
        return [[step, self._scaled_at(step)] for step in steps if step <= now]

    def _check_schedule(self, marks: list[Any]) -> None:
        """Refuse a state whose schedule weighted a step already mixed otherwise."""
        def shares(w: list[int]) -> str:
            return "{" + ", ".join(f"{t}: {x / sum(w):.4g}" for t, x in
                                   zip(self.sources, w, strict=True)) + "}"
        for mark in marks:
            try:
                step, saved = int(mark[0]), [int(x) for x in mark[1]]
            except (TypeError, ValueError, IndexError):
                raise ConfigError(f"not a mixture state: schedule mark {mark!r}") from None
            ours = self._scaled_at(step)
            if ours != saved:
                raise ConfigError(
                    f"the state was saved by a mixture whose schedule weighted "
                    f"{shares(saved)} at step {step}, and this loader's schedule weights "
                    f"{shares(ours)} there: resume with the schedule the state was saved with")

    def _scaled_at(self, step: int) -> list[int]:
        w = _scaled(self.mix.weights_at(step, self.sources))
        return [w[t] for t in self.sources]

    def load_state(self, state: Mapping[str, Any], held: Iterable[Hashable] = ()) -> None:
        """``state`` (``state()``) saved with ``held`` assigned: those partitions are
        not new to this mixer, so a source they belong to that ran out stays out."""
        want = self.mix.describe()
        if not _same_mix(state.get("mix"), want):
            # (An epoch's order without a Mix is a mixer of one source, in turn.)
            if self._one_source:
                raise ConfigError(f"the state was saved by the mixture {state.get('mix')}, "
                                  f"this loader has no kfeed.Mix")
            raise ConfigError(f"the state was saved by another mixture: {_mix_difference(state.get('mix'), want)}; "
                              f"resume with the mixture it was saved with")
        try:
            n = len(self.sources)
            credits = [int(c) for c in state["credits"]]
            live = [bool(x) for x in state["live"]]
            nxt = [None if x is None else tuple(x) for x in state["next"]]
            mixed, ended = int(state["mixed"]), bool(state["ended"])
            if not len(credits) == len(live) == len(nxt) == n:
                raise ValueError(f"{n} sources")
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a mixture state: {e!r}") from None
        if self.mix.scheduled:
            self._check_schedule(state.get("schedule") or [])
        if ended:
            # Saved once the bounded read was over: a new read starts from it
            # (its window resolved anew, as for plain topics), which finds out
            # again which sources run out, as after a merge (``Loader.merge_states``).
            # Records mixed but not handed out yet still come first.
            live, ended = [True] * n, False
        self.credits = np.array(credits, np.int64)
        self.live = np.array(live, np.uint8)
        self.ran_out = np.array(state.get("ran_out", [False] * n), np.uint8)
        self.since = np.array(state.get("since", [0] * n), np.int64)
        self.to_repeat = state.get("to_repeat")
        self._next = nxt
        self.mixed, self.ended = mixed, ended
        self._known = set(held)
        self._step = -1
