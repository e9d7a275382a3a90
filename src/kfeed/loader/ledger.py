"""The ledger stage: what was handed out, what may be committed, and the state.

The offset rule of DESIGN.md lives here. Per partition the ledger keeps three
positions, each ``(offset, skip)``:

- *handed*: after every record of the batches handed to the caller; this is
  what ``state_dict()`` saves, so a resume repeats and skips nothing;
- *used*: after every batch whose step finished (the caller asked for the
  next one); this is what may be committed;
- *committed*: what the broker acknowledged, so a commit that failed or was
  never answered is made again.

It also decides where a newly assigned partition starts: where this loader
left it, or the loaded state's position, unless somebody committed past
it whose reading is not lost: another member of the group, or another rank
of this run of the job. The commits of this loader's chain's earlier runs
are lost with them, and never win (NOTE [ Whose commits win ]).

NOTE [ Whose commits win ]
~~~~~~~~~~~~~~~~~~~~~~~~~
Every commit names its *lineage* (the chain of loaders a checkpoint was
handed down: a trainer and every run resumed from its checkpoints) and its
*run* (one start of the job; its ranks share it, ``Loader`` agrees on it
over ``torch.distributed``). A resumed loader holds the lineages of the
state it loaded. A committed position past the loaded state is

- the chain's own, from an earlier run: that run read past the checkpoint
  and died; what it read is lost with it, so the state wins (the same for a
  run the state was saved knowing of, see below);
- from a rank of this run, or a member of another lineage: read after the
  state was saved and not lost, so it wins. Through an order (shuffle,
  pack) it wins at the state's own position too when it has a note: the
  records that member used above the position are in its note alone (a
  state saved in an ``on_revoke`` hook, whose partition another member
  took from the revoke's commit and read on in). Not once the partition is
  read here: a commit at its order's watermark is then this loader's own,
  and its order knows the batches handed out since.

A job's ranks restarted together must tell the second case from the
first while partitions move between them, and only a shared run can: two
restarts from one checkpoint resume the same lineage. Without
``torch.distributed`` each rank is its own run, and a partition that moves
from one rank to another is read again from the state (repeated, never
lost).

NOTE [ A state covers every partition ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At its first assignment a loader in group mode reads the committed offsets
of every partition of its topics, decides where each would start, and
notes the run of every commit it saw of another lineage (``seen_runs``,
saved with the state as ``superseded``): its state accounts for them, and
a loader resumed from it takes those runs' commits for lost. Its own
decisions do not change: the member that made one may be alive and go on.
Its state then holds a position for every partition, the ones it does not
hold too (``carried``: from the
state it loaded, where it gave one back, or where it would have started
one). So a job restarted before the crashed members' sessions ran out,
which gets some partitions only later, still saves them; without that, a
resume would take the crashed run's commit for them (its ids lost with
the crashed run's log), or a restart from scratch (``start="earliest"``)
would save states that such a commit overrules. Merged states take the
furthest position per partition, so a rank's carried one never wins over
the owner's. A superseded run can only make a resume read again, never
skip.

Two ledgers: ``Ledger`` for batches made in offset order, and
``OrderLedger`` for records that go through a ``ShuffleBuffer`` (shuffle or
pack), where the order itself says what was delivered.

Every method that reads or writes the positions runs under ``lock``, and no
method calls Kafka while holding it.

NOTE [ Commit notes ]
~~~~~~~~~~~~~~~~~~~~~
Through an order (``shuffle``, ``pack``) records are used out of offset
order: a shuffle uses records far above the committed position, a packer
hands out the first tokens of a document whose record it has not finished.
The committed position alone (below it every record was used) would make
whoever reads the partition next from the commit use those again: another
member after a rebalance, the group's next epoch, a restart without a
state. So ``OrderLedger`` notes, with each commit of such a partition,
where its reading got to and the keys ``(offset, sub)`` between the
committed position and there that were *not* used (held by the shuffle, in
batches not used yet), with the tokens already out of a document part-way
out (``encode_note``; ``rest=`` in the commit's metadata, see
``kfeed.sources.Committed``). The keys not used are at most the shuffle's
buffer and the batches in flight, where the used ones would grow with the
stream. A loader that starts the partition at that commit (``positions``)
skips every other record below that point (``ShuffleBuffer.allow``) and
cuts the tokens already out: nothing is repeated. Kafka keeps at most
``offset.metadata.max.bytes`` of metadata (4096 by default); a note that
does not fit is left out with a warning, and the records used above the
position then come again. In order (``pack`` without a shuffle) every
record not used yet is one read from the committed position on, so when
they are too many to list (thousands of short documents a batch) the note
names only the first, for the tokens of its document already out.
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
import zlib
from collections.abc import Callable, Container, Mapping
from datetime import datetime
from typing import Any

import numpy as np

from kfeed.errors import ConfigError, ConsumeError
from kfeed.mix import Mixer, as_int
from kfeed.sources import TP, Committed, Position, Source
from kfeed.tokens import Key, Packer, Shuffle, ShuffleBuffer

__all__ = ["Ledger", "OrderLedger", "by_topic", "encode_note", "decode_note", "no_reset_hook"]

log = logging.getLogger("kfeed.loader")

# A decoded note larger than this is not one of ours (NOTE [ Commit notes ]).
_NOTE_MAX = 1 << 24
# Keys not used past this many make a note longer than Kafka keeps (about one
# character a key, random ones; half that only when they run in long rows):
# not worth encoding.
_NOTE_KEYS_MAX = 8192


def encode_note(position: Position, read: tuple[int, int], keys: np.ndarray,
                partial: Mapping[tuple[int, int], int]) -> str | None:
    """A partition's commit note (NOTE [ Commit notes ]); None if it cannot be written.

    ``keys``: rows ``[offset, sub]`` in order, the records from ``position``
    up to ``read`` not used; ``partial``: tokens already out of some of
    them. Little-endian uint32s (read, counts, offset deltas, subs, the
    partial entries), zlib, URL-safe base64.
    """
    base = int(position[0])
    keys = np.asarray(keys, np.int64).reshape(-1, 2)
    head = np.array([read[0] - base, read[1], len(keys), len(partial)], np.int64)
    parts = [head, np.diff(keys[:, 0], prepend=base), keys[:, 1]]
    parts += [np.array([o - base, s, n], np.int64) for (o, s), n in sorted(partial.items())]
    words = np.concatenate(parts)
    if words.min() < 0 or words.max() >= 1 << 32:
        return None
    return base64.urlsafe_b64encode(zlib.compress(words.astype("<u4").tobytes())) \
        .decode().rstrip("=")


def decode_note(offset: int, text: str) -> tuple[tuple[int, int], list[tuple[int, int]],
                                                 dict[tuple[int, int], int]]:
    """``encode_note``'s ``read``, keys and partial documents, for a commit at ``offset``.

    Raises ValueError if ``text`` is not such a note.
    """
    try:
        packed = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
        z = zlib.decompressobj()
        raw = z.decompress(packed, _NOTE_MAX)
    except (binascii.Error, zlib.error) as e:
        raise ValueError(f"not a commit note: {e}") from None
    if not z.eof or z.unused_data or len(raw) % 4 or len(raw) < 16:
        raise ValueError("not a commit note: its size")
    w = np.frombuffer(raw, "<u4").astype(np.int64)
    n, m = int(w[2]), int(w[3])
    if len(w) != 4 + 2 * n + 3 * m:
        raise ValueError("not a commit note: its counts")
    offsets = offset + np.cumsum(w[4:4 + n])
    keys = list(zip(offsets.tolist(), w[4 + n:4 + 2 * n].tolist(), strict=True))
    rows = w[4 + 2 * n:].reshape(-1, 3).tolist()
    partial = {(offset + o, s): t for o, s, t in rows}
    return (offset + int(w[0]), int(w[1])), keys, partial



def by_topic(positions: Mapping[TP, Position]) -> dict[str, dict[int, list[int]]]:
    """Positions as a state holds them: topic -> partition -> [offset, skip]."""
    out: dict[str, dict[int, list[int]]] = {}
    for (topic, part), (off, skip) in sorted(positions.items()):
        out.setdefault(topic, {})[part] = [off, skip]
    return out


class Ledger:
    """Positions of batches made in offset order."""

    def __init__(self, source: Source, start: str | datetime | Mapping[TP, int]) -> None:
        self.source = source
        self.start = start
        # An epochs= window's start as the group committed it, part-way into a
        # message: records to skip there (Loader._resolve_window).
        self.start_skips: dict[TP, int] = {}
        self.lock = threading.Lock()
        # Bumped by every revoke: batches made before it are not handed out.
        self.gen = 0
        self.handed: dict[TP, Position] = {}
        self.used: dict[TP, Position] = {}
        self.committed: dict[TP, Position] = {}
        self.handed_any = False
        self.failed = False  # the loader's thread failed: see Loader.close
        # Partitions this loader was ever given.
        self.seen: set[TP] = set()
        # Where each partition this loader does not hold stands, as far as it
        # knows: the loaded state's, where it gave one back, or where it
        # would have started one (NOTE [ A state covers every partition ]).
        self.carried: dict[TP, Position] = {}
        # A loaded state's partitions not yet checked against what the brokers
        # still keep (``retained``).
        self.unchecked: set[TP] = set()
        # Once a bounded read is over (``finish``): per partition read whole, the
        # position after its last record, or None, and its end.
        self.read_whole: dict[TP, tuple[Position | None, Position]] = {}
        # Whether the state covers every partition of the topics (group
        # mode; a static rank's state covers its own).
        self.cover_all = False
        self.partitions: list[TP] = []  # every partition of the topics, read at open
        self.decided = False  # the first assignment has been decided
        # This loader's lineages and run; the runs whose commits its state
        # accounts for: loaded, and seen at its first assignment (NOTE [ A
        # state covers every partition ]), as "lineage/run".
        self.lineages: set[str | None] = set()
        self.run: str | None = None
        self.superseded: set[str] = set()
        self.seen_runs: list[str] = []

    # -- assignment (feeder thread, inside the source's callbacks) -------------

    def positions(self, tps: list[TP], owned: set[TP]) -> dict[TP, Position]:
        """Where each of ``tps`` (re)starts: the state's position, or ``start``.

        ``owned`` is every partition the loader holds once ``tps`` are
        assigned (an incremental rebalance assigns only the ones it adds).
        A loaded state's position wins over the committed offset, unless a
        member whose reading is not lost committed past it (NOTE [ Whose
        commits win ]).
        """
        first, scope = self._scope(tps)
        committed = self.source.committed(scope)
        with self.lock:
            for tp in [tp for tp in self.handed if tp not in owned]:
                # A loaded state's partition that another member owns now:
                # carried, for the state and in case it comes back.
                self.carried[tp] = self.handed.pop(tp)
                self.used.pop(tp, None)
            known = {tp: self._newer(self.handed[tp], committed.get(tp))
                     for tp in tps if tp in self.handed}
        need = [tp for tp in tps if tp not in known]
        followed: set[TP] = set()
        positions = {**known, **self.start_positions(need, committed, followed)}
        for tp in sorted(followed):
            c = committed.get(tp)
            if c is not None and c.rest:
                # The records a shuffle or a packer used above the position,
                # which only a loader with an order skips (NOTE [ Commit notes ]).
                log.warning("%s[%d]: the group's commit was made by a loader with shuffle= "
                            "or pack=, which used records above offset %d; this loader "
                            "reads in offset order and reads them again: read with the same "
                            "shuffle= and pack= to skip them", tp[0], tp[1], c.offset)
        if first and self.cover_all:
            self._carry_the_rest(scope, positions, committed)
        self.retained(positions, holds=False)
        # A partition with nothing handed out yet is still part of the state:
        # without it, a resume would start it from the committed offset,
        # which may have moved on since the checkpoint. Its position is
        # committed like a used one, so the next epoch starts there too.
        with self.lock:
            for tp, pos in known.items():
                if pos != self.handed[tp]:  # a member went past the state: used up to there
                    self.used[tp] = pos
            self.handed.update(positions)
            for tp, pos in positions.items():
                self.used.setdefault(tp, pos)
            self._decided(tps, first, committed)
        return positions

    def _scope(self, tps: list[TP]) -> tuple[bool, list[TP]]:
        """Whether this is the first assignment, and the partitions whose commits it
        reads: every partition of the topics then, in group mode (NOTE [ A state
        covers every partition ])."""
        first = not self.decided
        return first, sorted(set(self.partitions) | set(tps)) if first and self.cover_all \
            else tps

    def _carry_the_rest(self, scope: list[TP], positions: Mapping[TP, Position],
                        committed: Mapping[TP, Committed | None]) -> None:
        """At the first assignment: where each partition of ``scope`` not assigned, not
        carried and not held would start, carried for the state."""
        with self.lock:
            held = self._held()
            rest = [tp for tp in scope if tp not in positions and tp not in self.carried
                    and tp not in held]
            # A loaded state's partitions carried: where a member not lost
            # went past them, there (their runs are adopted as the state's,
            # so a resume of this state would take the commit for lost); in
            # an order, to the same place with a note too, as an assigned one.
            for tp in scope:
                c, mine = committed.get(tp), self.carried.get(tp)
                if tp in positions or mine is None or c is None:
                    continue
                if self._past(tp, tuple(mine[:2]), c):
                    self.carry(tp, (c.offset, c.skip, c.rest) if c.rest else (c.offset, c.skip))
        self.carried.update(self.start_positions(rest, committed))

    def _held(self) -> Container[TP]:
        """Partitions whose positions the ledger holds apart from ``handed`` (under
        ``lock``): none in offset order."""
        return ()

    def _past(self, tp: TP, own: Position, committed: Committed | None) -> bool:
        """Whether a member whose reading is not lost committed past ``own``."""
        return self._newer(own, committed) != tuple(own)

    def _decided(self, tps: list[TP], first: bool,
                 committed: Mapping[TP, Committed | None]) -> None:
        """``tps`` are seen; the first assignment's commits noted (under ``lock``)."""
        self.seen.update(tps)
        if first:
            self._adopt(committed)
        self.decided = True

    def retained(self, positions: Mapping[TP, Position], *, holds: bool) -> None:
        """Check a loaded state's ``positions`` against the offsets the brokers keep.

        Retention may have deleted records while the job was down. Read from
        a position, the partition goes on from the first record kept, and the
        loss is said. A state whose order ``holds`` records (shuffle, pack, a
        mixture) waited for ever for the deleted ones to come back: it is
        refused, in one line. A position past the partition's end is not of
        this topic (deleted and made again under its name since): it read
        nothing, or waited for records numbered as the old topic's. Refused.
        """
        todo = [tp for tp in positions if tp in self.unchecked]
        for tp in todo:
            self.unchecked.discard(tp)
            first, end = self.source.watermarks(tp)
            at = positions[tp][0] & _OFFSET_MASK
            if at > end:
                raise ConsumeError(
                    f"{tp[0]}[{tp[1]}]: the state resumes at offset {at}, but the partition "
                    f"ends at offset {end}: the state is of another topic of that name (deleted "
                    f"and made again since, or on other brokers): load no state, to go on "
                    f"from the group's commits")
            if at >= first:
                continue
            lost = (f"{tp[0]}[{tp[1]}]: the state resumes at offset {at}, but the brokers keep "
                    f"the partition from offset {first} on: {first - at} message(s) were "
                    f"deleted (retention) before they were read")
            if holds:
                raise ConsumeError(f"{lost}, and the state holds records of them (its shuffle, "
                                   f"pack or mixture), which cannot come back: load no state, "
                                   f"to go on from the group's commits")
            log.warning("%s; reading goes on from offset %d", lost, first)

    def _newer(self, own: Position, committed: Committed | None) -> Position:
        """Our position, or the committed one if it is past ours and not lost."""
        if committed is None or self._lost(committed):
            return own
        theirs = (committed.offset, committed.skip)
        return theirs if theirs > own else own

    def _adopt(self, committed: Mapping[TP, Committed | None]) -> None:
        """Commits seen at the first assignment: their runs, for the state."""
        for c in committed.values():
            if c is not None and c.by is not None and c.by not in self.lineages \
                    and not self._ours(c):
                key = f"{c.by}/{c.run or ''}"
                if key not in self.seen_runs:
                    self.seen_runs.append(key)

    def _ours(self, committed: Committed) -> bool:
        """Whether this run committed it (this loader, or another rank of its job)."""
        return committed.run is not None and committed.run == self.run

    def _lost(self, committed: Committed) -> bool:
        """Whether an earlier run of this loader's chain committed it (lost with that run)."""
        if self._ours(committed):
            return False
        return committed.by in self.lineages \
            or f"{committed.by}/{committed.run or ''}" in self.superseded

    def start_positions(self, tps: list[TP], committed: Mapping[TP, Committed | None],
                        from_commit: set[TP] | None = None) -> dict[TP, Position]:
        """Where each of ``tps`` starts; ``from_commit`` gets those that start at the commit."""
        out: dict[TP, Position] = {}
        followed = set() if from_commit is None else from_commit
        for tp in tps:
            c = committed.get(tp)
            if c is not None and self._lost(c):
                c = None
            mine = self.carried.get(tp)
            if mine is not None:
                # Back after a revoke, where we left it; first assigned after
                # others, where the state or the first assignment put it;
                # unless a member that had it since went further (our commit
                # on revoke may have failed, e.g. with every broker down).
                out[tp] = self._newer(mine, c)
                if c is not None and out[tp] == (c.offset, c.skip):
                    followed.add(tp)
            elif c is not None and (self.start == "committed" or tp in self.seen
                                    or self._ours(c)):
                # Whatever the start, a partition another rank of this run
                # read before us goes on from there.
                out[tp] = (c.offset, c.skip)
                followed.add(tp)
            elif isinstance(self.start, datetime):
                out[tp] = (self.source.offsets_for_time([tp], self.start)[tp], 0)
            elif isinstance(self.start, Mapping):  # a window's start; unnamed: the earliest
                out[tp] = (self.start[tp], self.start_skips.get(tp, 0)) if tp in self.start \
                    else (self.source.watermarks(tp)[0], 0)
            elif self.start == "latest" and (not self.partitions or tp in self.partitions):
                out[tp] = (self.source.watermarks(tp)[1], 0)
            elif self.start == "latest":
                # Added to the topic since the read began: all of it is newer
                # than the start (from its end, the records written before the
                # group saw it, up to topic.metadata.refresh.interval.ms, were lost).
                log.info("%s[%d] was added since the read began: read from its start",
                         tp[0], tp[1])
                out[tp] = (self.source.watermarks(tp)[0], 0)
            else:  # "earliest", or "committed" with nothing committed yet
                out[tp] = (self.source.watermarks(tp)[0], 0)
        return out

    def revoke(self, tps: list[TP]) -> dict[TP, Position]:
        """Partitions go: batches not handed out are dropped; their positions, to commit."""
        with self.lock:
            self.gen += 1
            mine = self.give_up(tps)
            for tp, pos in mine.items():
                self.carry(tp, pos)
        return mine

    def revoke_used(self, tps: list[TP]) -> dict[TP, Position]:
        """Partitions go as the loader closes: as ``revoke``, but from the batches used,
        as the final commit (``close(commit_current=False)`` leaves the batch of a failed
        step out: it is read again). The positions to commit; given back in the same
        rebalance, the partitions start there too, not past the batches handed out."""
        wanted = set(tps)
        with self.lock:
            used = self.used_positions(wanted.__contains__)
        self.revoke(tps)
        with self.lock:
            for tp, pos in used.items():
                self.carry(tp, pos)
            return self._uncommitted(used)

    def carry(self, tp: TP, pos: Position) -> None:
        """Keep ``pos`` for a partition given up (under ``lock``)."""
        self.carried[tp] = (pos[0], pos[1])

    def give_up(self, tps: list[TP]) -> dict[TP, Position]:
        """Drop revoked partitions from the state (under ``lock``); their positions."""
        mine = {tp: self.handed.pop(tp) for tp in tps if tp in self.handed}
        for tp in tps:
            self.used.pop(tp, None)
        return mine

    # -- the caller's side (under ``lock``) -------------------------------------

    def accept(self, end: Mapping[TP, Position], acks: int, pack_offset: int) -> None:
        """A batch is handed out: the state moves past it."""
        self.handed_any = True
        self.handed.update(end)

    def mark_used(self, offsets: Mapping[TP, tuple[Position, Position]]) -> None:
        """The step that used a batch with these ``(first, end)`` offsets is over."""
        for tp, (_first, end) in offsets.items():
            if tp in self.handed:  # not revoked since
                self.used[tp] = end

    def to_commit(self, mine: Callable[[TP], bool]) -> dict[TP, Position]:
        """Used positions not yet acknowledged, of the partitions ``mine`` accepts."""
        return self._uncommitted(self.used_positions(mine))

    def _uncommitted(self, positions: Mapping[TP, Position]) -> dict[TP, Position]:
        """Those of ``positions`` the brokers have not acknowledged (under ``lock``)."""
        return {tp: pos for tp, pos in positions.items() if self.committed.get(tp) != pos}

    def used_positions(self, mine: Callable[[TP], bool]) -> dict[TP, Position]:
        """Per partition ``mine`` accepts, the position after the batches used (under ``lock``)."""
        return self._past_the_end({tp: pos for tp, pos in self.used.items()
                                   if tp in self.seen and mine(tp)})

    def _past_the_end(self, positions: dict[TP, Position]) -> dict[TP, Position]:
        for tp, (last, end) in self.read_whole.items():
            if tp in positions and (last is None or tuple(positions[tp][:2]) == last):
                positions[tp] = end
        return positions

    def finish(self, ends: Mapping[TP, int], read_to: Mapping[TP, int], done: set[TP]) -> None:
        """The bounded read is over. A partition read to its end (``done``) whose used
        position is after the last record fetched (``read_to``) commits its end: after
        that record a transaction's commit marker may come, and a commit before
        it left the partition's lag at 1 for ever. (A record fetched but not used,
        left by ``drop_last`` or the ranks' agreement, keeps the commit below it.)"""
        with self.lock:
            self.read_whole = {tp: ((read_to[tp], 0), (ends[tp], 0)) for tp in done
                               if tp in ends and tp in read_to}

    def delivered(self) -> dict[TP, Position]:
        """Per partition, the position after every record handed out."""
        return dict(self.handed)

    def _whole(self, tp: TP, pos: Position) -> Position:
        """``pos`` as Kafka counts it (see ``OrderLedger``; in order, it is already)."""
        return pos

    def state(self) -> dict[str, Any]:
        return {"positions": by_topic({**self.carried, **self.delivered()})}

    def load_state(self, state: Mapping[str, Any]) -> None:
        if "order" in state:
            raise ConfigError(f"the state was saved by a loader with {_order_kinds(state)}; "
                              f"this one reads in offset order: pass the same")
        handed = state_positions(state)
        self.handed.update(handed)
        self.used.update(handed)
        self.unchecked.update(handed)
        self.carried = dict(handed)


def state_positions(state: Mapping[str, Any]) -> dict[TP, Position]:
    """A state's ``positions`` ({topic: {partition: [offset, skip]}}; a JSON round
    trip makes the partitions strings), each checked: a state edited by hand
    or damaged is a ``ConfigError``, never a resume from another place."""
    out: dict[TP, Position] = {}
    positions = state.get("positions", {})
    if not isinstance(positions, Mapping):
        raise ConfigError(f"not a kfeed loader state: its positions are "
                          f"{type(positions).__name__}, not {{topic: {{partition: "
                          f"[offset, skip]}}}}")
    for topic, parts in positions.items():
        if not isinstance(parts, Mapping):
            raise ConfigError(f"not a kfeed loader state: the positions of {topic!r} are "
                              f"{parts!r}, not {{partition: [offset, skip]}}")
        for part, pos in parts.items():
            whole = isinstance(pos, (list, tuple)) and len(pos) == 2 and all(
                as_int(x) is not None and x >= 0 for x in pos)
            if not (as_int(part) is not None or (isinstance(part, str) and part.isdigit())) \
                    or not whole:
                raise ConfigError(f"not a kfeed loader state: position {pos!r} of {topic!r} "
                                  f"partition {part!r} is not [offset, skip] of a partition "
                                  f"number")
            out[(str(topic), int(part))] = (int(pos[0]), int(pos[1]))
    return out


# NOTE [ Rounds ]: a partition a mixture reads again (Mix(exhausted="repeat"))
# is keyed in the order by offset + (round << ROUND_SHIFT), so each reading
# of it comes after the last one and is not taken for repeats; positions
# leave the ledger as Kafka offsets again (_real). A partition resumed (a
# loaded state, a rebalance) starts in its watermark's round and catches up
# a round at a time to the one the order had reached (pending_rounds,
# RecordBuilder._read_again), so records held from several readings all
# come back. Commits are Kafka offsets of the current reading: after the
# first reading they go back below the end committed before. Once the
# bounded read is over (OrderLedger.finish), such a partition was read
# whole, and its commit is its window's end: a later read from the group
# goes on from there, as it does for the other topics. Only the partitions
# read again, or to be (OrderLedger._again), commit so, without a note: the
# other topics' commits carry their notes and reach their ends as in any read.
ROUND_SHIFT = 40
_OFFSET_MASK = (1 << ROUND_SHIFT) - 1


def no_reset_hook(_pack_offset: int) -> None:
    """No build stage to tell that the order was rebuilt."""
    return None


def _order_kinds(state: Mapping[str, Any]) -> str:
    """What made a saved loader's records go through an order: its Mix, shuffle, pack."""
    kinds = [name for name, on in (("a kfeed.Mix", state.get("mix") is not None),
                                   ("shuffle", bool(state["order"].get("buffer"))),
                                   ("pack", state.get("pack") is not None)) if on]
    return " and ".join(kinds) or "a variable-length field"


def _key(k: Any) -> Key:
    """A record's key from a state (JSON turns its partition tuple into a list)."""
    p, o, sub = k
    return (tuple(p) if isinstance(p, list) else p, int(o), int(sub))


class OrderLedger(Ledger):
    """Positions of records that went through a ``ShuffleBuffer``.

    Every record (a fixed-shape sample, or a document) is pushed into the
    order keyed ``(partition, offset, index in the message)``: seeded and
    shuffling with ``shuffle``, in order without. The order runs with
    acknowledgements: a record counts as delivered only when the batch
    holding it (for a document, its last token) is handed out, so the state
    taken at any moment covers exactly the batches handed out; what was
    emitted into batches still queued comes out again, in the same order,
    after a resume. With ``pack``, the state also holds how many tokens of
    the first unfinished document are already out, so a resume continues
    inside it. The same replay rebuilds the order after a rebalance, less
    the partitions revoked (their new owner re-reads them from the
    committed watermark, skipping what the commit's note says was used:
    NOTE [ Commit notes ]).

    The build stage pushes into ``order`` (a fetch's records at a time) and
    drains it. Per batch the caller's side only counts: ``accept``
    acknowledges, ``mark_used`` marks; the used positions are worked out
    from the order when a commit asks for them. Whenever the order is
    rebuilt, ``on_reset(pack_offset)`` tells the build stage to drop what
    it holds and to continue a document ``pack_offset`` tokens in.
    """

    def __init__(self, source: Source, start: str | datetime | Mapping[TP, int],
                 shuffle: Shuffle | None,
                 packer: Packer | None, mixer: Mixer | None = None) -> None:
        super().__init__(source, start)
        self.shuffle = shuffle
        self.packer = packer
        # A mixture's order, in front of the shuffle buffer (NOTE [ Mixer state ]).
        self.mixer = mixer
        self.repeat = mixer is not None and mixer.mix.exhausted == "repeat"
        self.order = ShuffleBuffer(shuffle, ack=True, track_used=True)
        self.used_stale = False  # batches were used since ``used`` was last brought up to date
        self.pack_offset = 0  # tokens of the first unacknowledged document handed out
        self.used_pack_offset = 0  # the same, as of the last batch used
        # The order was rebuilt since the last batch used, with a batch handed
        # out and not used: it no longer knows which records handed out are
        # not used yet, so used commits carry no note until the next (NOTE
        # [ Commit notes ]).
        self.notes_stale = False
        self.note_warned: set[TP] = set()  # partitions with too many keys for a note
        # Documents other than that one already part-way out, (partition,
        # offset, sub) -> tokens out: what a state merged from several ranks
        # leaves (NOTE [ Elastic resume ]); the build stage cuts them.
        self.partial: dict[Key, int] = {}
        # Partitions started from another reader's note: the position it was read to.
        self.followed: dict[TP, Position] = {}
        # The notes of the positions given up (``carried``, with them in the
        # state): a partition back after a resume skips what they say was used.
        self.carried_notes: dict[TP, str] = {}
        # Per partition, the position after the last record of the last message
        # read (``note_ends``): a commit there is the next message's offset.
        self.message_ends: dict[TP, Position] = {}
        # A mixture's partitions read again (NOTE [ Rounds ]): the round each
        # is read in, and where its reading starts.
        self.rounds: dict[TP, int] = {}
        self.window: dict[TP, int] = {}
        # A window that starts inside a message: its records before the start
        # (used before this read), which a reading again skips.
        self.window_skip: dict[TP, int] = {}
        # Saved in a round its order's records had not reached yet: read the
        # rest of the last round first, then this one from the window's start.
        self.saved_rounds: dict[TP, int] = {}
        self.pending_rounds: dict[TP, int] = {}
        self.over = False  # the bounded read is over (``finish``)
        # Partitions read again whose first reading was not all handed out when
        # the read ended: where that reading ends.
        self.first_left: dict[TP, int] = {}
        self.on_reset: Callable[[int], None] = no_reset_hook

    def positions(self, tps: list[TP], owned: set[TP]) -> dict[TP, Position]:
        # The first assignment decides every partition's start, as in offset
        # order (NOTE [ A state covers every partition ]).
        first, scope = self._scope(tps)
        committed = self.source.committed(scope)
        with self.lock:
            marks = {tp: self._real(m) for tp, m in self.order.watermarks().items()}
            # Partitions another member owns now (a loaded state's, before
            # their first assignment): given up as a revoke gives them up,
            # carried with the note of what the order used above them, so
            # that back later they skip it.
            away = sorted(tp for tp in marks if tp not in owned)
            if away:
                for tp, pos in self.give_up(away).items():
                    self.carry(tp, pos)
            # And those a member read past what we hold, or to the same place
            # with a note of records it used above it (a member that took the
            # partition from the commit of the revoke this state was saved in).
            drop = {tp for tp in tps if tp in marks and not self.rounds.get(tp)
                    and self._past(tp, marks[tp], committed.get(tp))}
            if drop:
                self._rebuild(drop)
            resume = self.order.resume_offsets()
        positions = {}
        for tp in tps:
            if tp in resume:
                positions[tp] = self._resume_round(tp, resume[tp])
        need = [tp for tp in tps if tp not in positions]
        fresh: dict[TP, Position] = {}
        if need:
            followed: set[TP] = set()
            fresh = self.start_positions(need, committed, followed)
            with self.lock:
                for tp in need:
                    # The order skips the records of a straddled block that
                    # were delivered before.
                    self.order.seek(tp, *fresh[tp])
                    self.rounds[tp] = 0
                    if tp in followed:
                        self._follow_note(tp, committed.get(tp))
                    elif tp in self.carried_notes and fresh[tp] == self.carried.get(tp):
                        # Back where this loader (or the state it loaded) gave it up.
                        pos = self.carried[tp]
                        self._follow_note(tp, Committed(pos[0], pos[1], None, None,
                                                        self.carried_notes[tp]))
            positions.update({tp: (fresh[tp][0], 0) for tp in need})
        if first and self.cover_all:
            self._carry_the_rest(scope, positions, committed)
        self.retained(positions, holds=self.order.restoring)
        for tp, (off, _skip) in positions.items():
            if tp not in self.window:
                # Where this read starts it: a fresh start's skip, or a resumed
                # one's watermark inside the message (NOTE [ Rounds ]).
                self.window[tp] = off
                skip = fresh[tp][1] if tp in fresh else (
                    marks[tp][1] if tp in marks and marks[tp][0] == off else 0)
                if skip:
                    self.window_skip[tp] = skip
        with self.lock:
            self._decided(tps, first, committed)
        return positions

    def _past(self, tp: TP, own: Position, committed: Committed | None) -> bool:
        """Whether a member whose reading is not lost committed past ``own``; or, for a
        loaded state's partition not read here yet, at it with a note (NOTE [ Commit
        notes ]): what that member used above is in its commit only. A partition this
        loader reads keeps its order on a tie: the commit there is its own, of the
        batches used, and the order knows those handed out since too (an incremental
        rebalance's partitions kept, ``Fetcher._restart``)."""
        if committed is None or self._lost(committed):
            return False
        theirs = (committed.offset, committed.skip)
        return theirs > tuple(own) or (theirs == tuple(own) and bool(committed.rest)
                                       and tp not in self.seen)

    def _held(self) -> Container[TP]:
        return self.order.watermarks()

    def _follow_note(self, tp: TP, c: Committed | None) -> None:
        """Starting ``tp`` at the commit ``c``: skip what its note says was used (NOTE [ Commit notes ]).

        Only a start that *is* the commit follows its note: a start chosen
        otherwise (a window's, a time, ``earliest``) that happens to fall on
        the same offset must not skip what somebody else used.
        """
        if c is None or not c.rest or self._again(tp) or self._lost(c):
            return
        try:
            read, keys, partial = decode_note(c.offset, c.rest)
        except ValueError as e:
            log.warning("%s[%d]: the commit's note is not kfeed's (%s); records used above "
                        "offset %d may come again", tp[0], tp[1], e, c.offset)
            return
        self.order.allow(tp, read, keys)
        self.followed[tp] = read
        for (o, sub), n in partial.items():
            self.partial[(tp, o, sub)] = n

    def _noted(self, positions: Mapping[TP, Position], *, used: bool
               ) -> dict[TP, tuple[Any, ...]]:
        """``positions`` (the order's watermarks), each with its note if it needs one."""
        if used and self.notes_stale:  # (see notes_stale)
            return dict(positions)
        rest = self.order.rest(used=used, most=_NOTE_KEYS_MAX)
        head = self.order.first_unacked(used=used)
        out: dict[TP, tuple[Any, ...]] = {}
        for tp, pos in positions.items():
            if self._again(tp):  # NOTE [ Rounds ]: its commits go back below its end
                out[tp] = pos
                continue
            read, keys = rest.get(tp, (pos, np.empty((0, 2), np.int64)))
            if keys is None and self.shuffle is None and not self.order.restoring \
                    and tuple(pos) >= tuple(self.followed.get(tp, pos)):
                # In order, every record not used yet is one read from the
                # first of them (``pos``) on: the note needs that one alone,
                # for the tokens of its document already out. (Not while
                # records another reader's note said it used lie above it.)
                read, keys = (pos[0], pos[1] + 1), np.array([pos], np.int64)
            if keys is None:  # too many for a note: the records used above come again
                if tp not in self.note_warned:
                    self.note_warned.add(tp)
                    log.warning("%s[%d]: %d+ records above the committed offset not used yet "
                                "are too many for the commit's note (Kafka keeps 4096 "
                                "characters): a reader that takes the partition over from the "
                                "commit uses records again; they are the shuffle buffer's and "
                                "the batches' in flight: a smaller Shuffle(buffer=), batch_size "
                                "or prefetch, or more partitions, keep it small",
                                tp[0], tp[1], _NOTE_KEYS_MAX)
                out[tp] = pos
                continue
            partial = {(o, sub): n for (p, o, sub), n in self.partial.items() if p == tp}
            if head is not None and head[0] == tp:
                out_now = (self.used_pack_offset if used else self.pack_offset) \
                    + self.partial.get(head, 0)
                if out_now:
                    partial[head[1:]] = out_now
            partial = {k: n for k, n in partial.items()  # (a few: rarely more than one)
                       if ((keys[:, 0] == k[0]) & (keys[:, 1] == k[1])).any()}
            if read <= tuple(pos) and not partial:
                out[tp] = pos
                continue
            note = encode_note(pos, read, keys, partial)
            out[tp] = pos if note is None else (pos[0], pos[1], note)
        return out

    def _again(self, tp: TP) -> bool:
        """Whether ``tp`` is read again, or is to be (NOTE [ Rounds ]): its positions are
        those of its reading in progress, with no note. The partitions of a repeated
        mixture's other topics, read once, commit as any others do."""
        if not self.repeat:
            return False
        if self.rounds.get(tp) or self.pending_rounds.get(tp) or self.saved_rounds.get(tp):
            return True
        read = self.order.read_position(tp)
        return read is not None and read[0] > _OFFSET_MASK

    def _real(self, pos: Position) -> Position:
        """A position of the order as a Kafka position (NOTE [ Rounds ])."""
        return (pos[0] & _OFFSET_MASK, pos[1]) if self.repeat else pos

    def before_window(self, recs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``[pid, key, sub, item]`` less those of a reading again (NOTE [ Rounds ])
        that lie before its window's start, inside the window's first message; their
        items. (The first reading starts past them: ``seek``.)"""
        if not self.window_skip or not len(recs):
            return recs, recs[:0, 3]
        drop = np.zeros(len(recs), bool)
        for tp, skip in self.window_skip.items():
            pid = self.order.known_pid(tp)
            if pid is not None:
                drop |= ((recs[:, 0] == pid) & (recs[:, 1] > _OFFSET_MASK)
                         & ((recs[:, 1] & _OFFSET_MASK) == self.window[tp]) & (recs[:, 2] < skip))
        if not drop.any():
            return recs, recs[:0, 3]
        return recs[~drop], recs[drop, 3]

    def _resume_round(self, tp: TP, resume: int) -> Position:
        """Where a partition the order holds goes on, and in which round (NOTE [ Rounds ]).

        It re-reads from its watermark, in the watermark's round. If the
        order had gone further (records of later rounds held, or a restart
        made or asked for with nothing of it read yet), those rounds follow,
        one at a time (``pending_rounds``). Had it read its round to the end
        with nothing held, it starts the next round right away: no seek is
        needed, the assignment itself starts there.
        """
        if not self.repeat:
            return (resume, 0)
        low = resume >> ROUND_SHIFT
        read = self.order.read_position(tp)
        target = max(low, self.rounds.get(tp, 0), self.pending_rounds.get(tp, 0),
                     self.saved_rounds.pop(tp, 0),  # (now in rounds or pending_rounds)
                     read[0] >> ROUND_SHIFT if read is not None else 0)
        self.rounds[tp] = low
        position = (resume & _OFFSET_MASK, 0)
        marks = self.order.watermarks()
        if target > low and read is not None and marks.get(tp) == read and tp in self.window:
            self.rounds[tp] = low + 1
            position = (self.window[tp], 0)
        if target > self.rounds[tp]:
            self.pending_rounds[tp] = target
        else:
            self.pending_rounds.pop(tp, None)
        return position

    def give_up(self, tps: list[TP]) -> dict[TP, Position]:
        for tp in tps:  # a partition back later finds its rounds again from the order
            self.rounds.pop(tp, None)
            self.pending_rounds.pop(tp, None)
            self.saved_rounds.pop(tp, None)
        marks = self.order.watermarks()
        # Whole messages as Kafka counts them, as to_commit gives them: a
        # revoke's commit (close() makes one) must not take the partition
        # back from (offset + 1, 0) to (offset, records), lag 1 for ever.
        mine = self._noted({tp: self._whole(tp, self._real(marks[tp]))
                            for tp in tps if tp in marks}, used=False)
        self._rebuild(set(tps))
        for tp in tps:  # what was used of them is committed with the revoke, or not ours
            self.used.pop(tp, None)
        self.partial = {k: n for k, n in self.partial.items() if k[0] not in tps}
        return mine

    def _rebuild(self, without: set[TP]) -> None:
        """Start again from what was handed out, as a resume would, less ``without``."""
        state = self.order.state()
        head = state["outbox"][0] if state["outbox"] else None
        kept = ShuffleBuffer.without(state, without)
        offset = self.pack_offset if head is not None and kept["outbox"][:1] == [head] else 0
        if self.mixer is not None:  # its queues go with the order; its turns stay
            self.mixer.remember_turns()
        # Every record handed out was used (a revoke given up at a step's
        # boundary): the new order's "used" is the truth, and notes stay.
        stale = self.notes_stale or self.order.unused > 0
        self._restore(kept, offset)
        self.notes_stale = stale

    def _restore(self, order_state: Mapping[str, Any] | None, pack_offset: int) -> None:
        self._update_used()  # the records the new order forgets were used or handed out
        self.order = ShuffleBuffer(self.shuffle, ack=True, track_used=True)
        if order_state is not None:
            self.order.load_state(order_state)
            self.followed.update(self.order.noted())
        self.pack_offset = self.used_pack_offset = pack_offset
        self.notes_stale = True
        self.on_reset(pack_offset)

    # -- the caller's side (under ``lock``) ---------------------------------

    def accept(self, end: Mapping[TP, Position], acks: int, pack_offset: int) -> None:
        self.handed_any = True
        self.order.ack(acks)
        self.pack_offset = pack_offset
        if self.partial:  # documents cut once: forget those all out
            marks = self.order.watermarks()
            self.partial = {k: n for k, n in self.partial.items()
                            if k[0] not in marks or k[1:] >= marks[k[0]]}

    def mark_used(self, offsets: Mapping[TP, tuple[Position, Position]]) -> None:
        # O(1) per batch: the positions are worked out when a commit asks.
        self.order.mark_used()
        self.used_pack_offset = self.pack_offset
        self.notes_stale = False
        self.used_stale = True

    def _update_used(self) -> None:
        if self.used_stale:
            self.used.update({tp: self._real(m)
                              for tp, m in self.order.watermarks(used=True).items()})
            self.used_stale = False

    def note_ends(self, recs: np.ndarray) -> None:
        """Where the last message of each partition in ``recs`` ends: rows ``[pid, offset,
        sub, item]`` of whole messages, each message's records together, in order."""
        last = np.flatnonzero(np.append(recs[1:, 0] != recs[:-1, 0], True))
        for pid, off, sub, _item in recs[last].tolist():
            self.message_ends[self.order.partition(pid)] = (off, sub + 1)

    def _whole(self, tp: TP, pos: Position) -> Position:
        """``pos``, or ``(offset + 1, 0)`` where it is right after the last record of the
        last message read: the same place, as Kafka counts it (its lag 0 there, not 1)."""
        if not self._again(tp) and self.message_ends.get(tp) == tuple(pos):
            return (pos[0] + 1, 0)
        return pos

    def used_positions(self, mine: Callable[[TP], bool]) -> dict[TP, Position]:
        self._update_used()
        return self._past_the_end(self._noted(
            {tp: self._whole(tp, pos) for tp, pos in self.used.items()
             if tp in self.seen and mine(tp)}, used=True))

    def finish(self, ends: Mapping[TP, int], read_to: Mapping[TP, int], done: set[TP]) -> None:
        """As ``Ledger.finish``; and a partition read again (NOTE [ Rounds ]) was read
        whole, so its commit is its window's end, not its place in the reading in
        progress, which a later read would go on from."""
        super().finish(ends, read_to, done)
        with self.lock:
            self.over = True
            marks = self.order.watermarks()
            for tp, n in self.rounds.items():
                if n == 0 or tp not in ends:
                    continue
                mark = marks.get(tp)
                if mark is not None and (mark[0] > _OFFSET_MASK or tuple(mark) >= (ends[tp], 0)):
                    self.read_whole[tp] = (None, (ends[tp], 0))
                else:
                    # Its first reading is not all out: the ranks' agreement
                    # stopped the read (NOTE [ Rounds ]). Its commit stays below
                    # what is left, and a state leaves the next read that
                    # (``_read_over``), not the readings that came after.
                    self.read_whole.pop(tp, None)
                    self.first_left[tp] = ends[tp]

    def carry(self, tp: TP, pos: Position) -> None:
        super().carry(tp, pos)
        if len(pos) > 2:
            self.carried_notes[tp] = pos[2]
        else:
            self.carried_notes.pop(tp, None)

    def delivered(self) -> dict[TP, Position]:
        return {tp: self._real(m) for tp, m in self.order.watermarks().items()}

    def state(self) -> dict[str, Any]:
        # The partitions in the order, and those given up since (``carried``,
        # with their notes): a resume that gets one back starts where it was
        # given up, as the revoke's commit says, which it takes for lost.
        order = self.order.state()
        head = _key(order["outbox"][0]) if order["outbox"] else None
        unacked = {_key(k) for k in order["outbox"] + order["held"]}

        def to_come(k: Key) -> bool:  # a document not read yet (a commit's note cuts it)
            read = self.order.read_position(k[0])
            return read is None or k[1:] >= read

        partial = {k: n for k, n in self.partial.items()
                   if (k in unacked or to_come(k)) and k != head}
        delivered = self.delivered()
        state = {
            "positions": by_topic(delivered),
            "carried": [[t, p, *self.carried[(t, p)], self.carried_notes.get((t, p))]
                        for t, p in sorted(self.carried) if (t, p) not in delivered],
            "order": order,
            # Partitions loaded with a state and not assigned to this loader
            # yet: the loaded state's, not its own reading (a merge takes
            # them from the rank that read them, merge._merge_orders).
            "inherited": [list(tp) for tp in sorted(
                {tuple(e[0]) for e in order["partitions"]} - self.seen)],
            "pack": self._pack_spec(),
            # The head's tokens out: the packer's count, after what was cut.
            "pack_offset": self.pack_offset + (self.partial.get(head, 0) if head else 0),
            "partial": [[list(k[0]), k[1], k[2], n] for k, n in sorted(partial.items())],
        }
        if self.mixer is not None:
            state["mix"] = self.mixer.state()
            if self.mixer.mix.exhausted == "repeat":  # where partitions read again start
                state["window"] = [[t, p, o, self.window_skip.get((t, p), 0)]
                                   for (t, p), o in sorted(self.window.items())]
                # (A loaded state's rounds stay its own until their partition
                # is assigned: a state saved before that kept none of them.)
                rounds = {**self.saved_rounds, **self.rounds, **self.pending_rounds}
                state["rounds"] = [[t, p, r] for (t, p), r in sorted(rounds.items()) if r]
                self._read_over(state)
        return state

    def _read_over(self, state: dict[str, Any]) -> None:
        """A state saved once the bounded read was over (``finish``): the partitions
        read again were read whole, so the next read starts them at their window's
        end, in their first round, as their commits do (NOTE [ Rounds ]); its
        windows are its own, and no source has run out in it yet. (From the last
        reading's positions, the next read went on with records of this one, read
        the old windows again, and ended at its first source to run out.)"""
        if not self.over:
            return
        over = {tp: end for tp, (last, end) in self.read_whole.items() if last is None}
        left = self.first_left
        order = state["order"]
        # A first reading not all out is read on from its watermark to its end,
        # its records not out yet held as they were; the later readings' are
        # no more.
        order["partitions"] = [[e[0], list(over[e[0]]), list(over[e[0]])] if e[0] in over
                               else [e[0], e[1], [left[e[0]], 0]] if e[0] in left
                               else e for e in order["partitions"]]
        for key in ("held", "outbox"):
            order[key] = [k for k in order[key] if k[0] not in over
                          and (k[0] not in left or k[1] <= _OFFSET_MASK)]
        state["positions"] = by_topic({**state_positions(state), **over})
        state["window"], state["rounds"] = [], []  # the next read's are its own
        n = len(self.mixer.sources)
        state["mix"].update(ran_out=[False] * n, since=[0] * n, to_repeat=None)

    def _pack_spec(self) -> list[Any] | None:
        """``[seq_len, eos_id, pad_id, split_long]`` of the packer, as states keep it."""
        pack = self.packer.pack if self.packer is not None else None
        return None if pack is None else [pack.seq_len, pack.eos_id, pack.pad_id, pack.split_long]

    def load_state(self, state: Mapping[str, Any]) -> None:
        if "order" not in state:
            raise ConfigError("the state was saved by a loader reading in offset order (no "
                              "shuffle, pack, kfeed.Mix or variable-length field); this one "
                              "has " + ("a kfeed.Mix" if self.mixer is not None else
                                        "pack" if self.packer is not None else
                                        "shuffle" if self.shuffle is not None else
                                        "a variable-length field"))
        want = self._pack_spec()
        if _packing(state.get("pack")) != _packing(want):
            raise ConfigError(f"the state was saved with pack {state.get('pack')}, "
                              f"this loader packs {want}")
        if (self.mixer is None) != (state.get("mix") is None):
            raise ConfigError("the state was saved by a loader " + (
                "of a kfeed.Mix; pass the same Mix" if self.mixer is None
                else "without a kfeed.Mix"))
        if self.mixer is not None:
            held = [tuple(e[0]) for e in state.get("order", {}).get("partitions", [])]
            self.mixer.load_state(state["mix"], held)
        try:
            window = [(str(w[0]), int(w[1]), int(w[2]), int(w[3]) if len(w) > 3 else 0)
                      for w in state.get("window", [])]
            self.window = {(t, p): o for t, p, o, _s in window}
            self.window_skip = {(t, p): s for t, p, _o, s in window if s}
            self.saved_rounds = {(str(t), int(p)): int(r) for t, p, r in state.get("rounds", [])}
            self.partial = {_key(k[:3]): int(k[3]) for k in state.get("partial", [])}
            carried = [((str(t), int(p)), (int(o), int(s)), n)
                       for t, p, o, s, n in state.get("carried", [])]
        except (TypeError, ValueError, IndexError) as e:
            raise ConfigError(f"not a loader state: its partial documents, window or given up "
                              f"partitions: {e!r}") from None
        self.carried = {tp: pos for tp, pos, _n in carried}
        self.carried_notes = {tp: str(n) for tp, _pos, n in carried if n}
        self._restore(state["order"], int(state.get("pack_offset", 0)))
        self.unchecked.update(self.order.resume_offsets())
        self.unchecked.update(self.carried)


def _packing(spec: Any) -> Any:
    """What of a state's pack spec places the tokens: all but ``pad_id``, which only
    fills the rows' ends, and may change from one run to the next."""
    if not isinstance(spec, (list, tuple)) or len(spec) != 4:
        return spec
    return [spec[0], spec[1], spec[3]]
