"""Elastic resume: one loader state from the states of every rank of a job.

Where it sits: beside the ledger, outside the pipeline. Each rank's
``Loader.state_dict()`` (the ledger's positions, and with an order its
held records, unfinished documents and mixture) is gathered at one step;
``merge_states`` makes them one state that a job of any number of ranks
loads (``Loader.merge_states``, NOTE [ Elastic resume ]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kfeed.errors import ConfigError
from kfeed.loader.ledger import _key, state_positions
from kfeed.mix import _mix_difference, _same_mix
from kfeed.tokens import ShuffleBuffer

__all__ = ["merge_states", "static_cover"]


# NOTE [ Elastic resume ]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A job saved on N ranks resumes on M. A state of records in offset order
# is a position per partition, and merging takes the furthest. A state of
# an order (shuffle, pack, a Mix: OrderLedger) says per partition where
# every record was handed out below (the watermark) and read below (the read
# position); between the two, a record was handed out unless the rank still
# held it: in its shuffle buffer (``held``), or emitted into batches and
# documents not handed out yet (``outbox``, its first document maybe part-way
# out, ``pack_offset`` tokens). _merge_orders makes one order state of them:
# every partition's entry (each rank's own), and every held or unfinished
# record as one outbox, rank after rank, so each comes out again first, in
# that order; a document part-way out is cut by the tokens already out
# (``partial``, which the build stage applies as the document comes out; the
# count includes the EOS, so one that covers every token still owes the EOS,
# which the packer gives for the document cut to nothing: Chunk's ``owed``).
# A merge keeps the largest count a document has in any rank's state.
# Each rank of the new job keeps the partitions it is given and drops the
# rest (OrderLedger.positions), so together they read each record not
# handed out exactly once. Until its first assignment a rank holds the whole
# merged order; its state names those partitions ``inherited``, and a merge
# takes each partition from the rank that read it (one copy where none did),
# so a job can checkpoint before all its ranks had a batch. The shuffle goes
# on from rank 0's generator and a mixture from rank 0's round robin: the
# order after a change of size is a new one, the records are the same.



def merge_states(states: Sequence[Mapping[str, Any]], version: int) -> dict[str, Any]:
    """One state from each rank's ``state_dict()`` (of state ``version``): see
    ``Loader.merge_states``."""
    states = list(states)
    if not states:
        raise ConfigError("merge_states needs at least one state")
    first = states[0]
    for st in states:
        if not isinstance(st, Mapping) or st.get("version") != version:
            raise ConfigError(f"not a kfeed loader state (version {version})")
        for key in ("schema_fingerprint", "format", "topics", "pack"):
            if st.get(key) != first.get(key):
                raise ConfigError(f"the states differ in {key}")
        if (("order" in st) != ("order" in first) or ("mix" in st) != ("mix" in first)
                or (st.get("epochs") is None) != (first.get("epochs") is None)):
            raise ConfigError("the states come from loaders of different kinds "
                              "(with and without shuffle, pack, a Mix or epochs)")
    positions: dict[str, dict[int, list[int]]] = {}
    lineages: list[str] = []
    superseded: set[str] = set()
    for st in states:
        for (topic, part), pos in state_positions(st).items():
            merged = positions.setdefault(topic, {})
            if part not in merged or pos > tuple(merged[part]):
                merged[part] = list(pos)
        lineages += [x for x in st.get("lineages", []) if x not in lineages]
        superseded.update(st.get("superseded", []))
    out = {**first, "positions": positions, "lineages": lineages,
           "superseded": sorted(superseded)}
    covers = [static_cover(st) for st in states]
    out.pop("static", None)
    if all(c is not None for c in covers):  # every rank's partitions
        out["static"] = {key: [list(tp) for tp in sorted(
            {tuple(tp) for c in covers for tp in c[key]})] for key in ("covers", "of")}
    if first.get("epochs") is not None:
        out["epochs"] = _merge_epochs(states, covers)
    if "order" in first:
        try:
            out.update(_merge_orders(states))
        except KeyError as e:  # a state cut or edited
            raise ConfigError(f"not a kfeed loader state: its order or mixture lacks "
                              f"{e!r}") from e
    return out


def static_cover(state: Mapping[str, Any]) -> dict[str, list[list[Any]]] | None:
    """A static rank's state's ``static``: the partitions it covers and those there were
    (NOTE [ A static state covers its rank's partitions ]); None for a state without."""
    static = state.get("static")
    if static is None:
        return None
    try:
        out = {key: [[str(t), int(p)] for t, p in static[key]] for key in ("covers", "of")}
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"not a kfeed loader state: its static is {static!r}, not "
                          f"{{'covers': [[topic, partition], ...], 'of': [...]}}") from None
    return out


def _merge_epochs(states: list[Mapping[str, Any]],
                  covers: list[dict[str, list[list[Any]]] | None]) -> dict[str, Any]:
    """The epoch of states saved by the ranks of a job with ``epochs=N``.

    They must be in one epoch, over one window. It counts as finished only
    if every rank finished it: a rank that finished early (no agreement
    between the ranks stopped the others with it) leaves the rest of the
    epoch to the new job, whose positions already pass what that rank read.
    """
    saved = [st["epochs"] for st in states]
    numbers = sorted({int(e["epoch"]) for e in saved})
    if len(numbers) > 1:
        raise ConfigError(f"the states are of different epochs ({', '.join(map(str, numbers[:-1]))}"
                          f" and {numbers[-1]}): gather every rank's state at one step")
    return {**saved[0], "window": _merge_windows(states, covers),
            "finished": all(bool(e["finished"]) for e in saved)}


def _merge_windows(states: list[Mapping[str, Any]],
                   covers: list[dict[str, list[list[Any]]] | None]
                   ) -> dict[str, list[list[Any]]] | None:
    """The epoch's window of the ranks' states: a partition's ends are those of the rank
    that reads it (its static cover, ``covers[i]``, else its positions).

    Without torch.distributed each rank resolves the window itself, at its
    first batch (none yet: None): a rank that started after another had
    committed, or more was written, has other ends for that rank's
    partitions, which it never reads.
    """
    windows = [(i, st["epochs"]["window"]) for i, st in enumerate(states)
               if st["epochs"]["window"] is not None]
    if not windows:
        return None
    readers: dict[tuple[str, int], set[int]] = {}
    for i, (st, cover) in enumerate(zip(states, covers, strict=True)):
        tps = ({(t, p) for t, p in cover["covers"]} if cover is not None
               else set(state_positions(st)))
        for tp in tps:
            readers.setdefault(tp, set()).add(i)
    out: dict[str, list[list[Any]]] = {}
    for name in ("start", "until", "skips"):
        ends: dict[tuple[str, int], dict[int, int]] = {}
        for i, window in windows:
            for t, p, o in window.get(name, []):
                ends.setdefault((str(t), int(p)), {})[i] = int(o)
        merged = []
        for tp, by_rank in sorted(ends.items()):
            if name == "skips":  # a window without the partition skips none of it
                by_rank = {i: by_rank.get(i, 0) for i, _w in windows}
            values = set(by_rank.values())
            if len(values) > 1:
                values = {o for i, o in by_rank.items() if i in readers.get(tp, ())}
            if len(values) != 1:
                raise ConfigError(f"the states differ in their epochs' window at {tp}, "
                                  f"which no one rank reads: gather every rank's state of "
                                  f"one job at one step")
            merged.append([*tp, values.pop()])
        out[name] = [e for e in merged if name != "skips" or e[2]]
    return out


def _merge_orders(states: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The order, unfinished documents and mixture of several ranks' states, as one."""
    orders = [st["order"] for st in states]
    first = orders[0]
    if any((o.get("buffer"), o.get("seed")) != (first.get("buffer"), first.get("seed"))
           for o in orders):
        raise ConfigError("the states differ in their Shuffle")
    # Which rank's order each partition comes from: the rank that read it;
    # one that only holds it as loaded, not assigned yet (``inherited``: a
    # rank saved before its first assignment), gives it where none read it.
    owner: dict[tuple[str, int], int] = {}
    copies: dict[tuple[str, int], int] = {}
    for i, (st, order) in enumerate(zip(states, orders, strict=True)):
        inherited = {tuple(tp) for tp in st.get("inherited", [])}
        for entry in order["partitions"]:
            tp = tuple(entry[0])
            if tp in inherited:
                copies.setdefault(tp, i)
            elif tp in owner:
                raise ConfigError(f"partition {tp} is in two of the states: merge the "
                                  f"states of one step of one job, one per rank")
            else:
                owner[tp] = i
    owner = {**copies, **owner}
    seen = set(owner)
    entries, outbox, partial, allow = [], [], [], []
    for i, (st, order) in enumerate(zip(states, orders, strict=True)):
        mine = ShuffleBuffer.without(order, {tp for tp, j in owner.items() if j != i})
        entries += mine["partitions"]
        outbox += list(mine["outbox"]) + list(mine["held"])
        allow += mine.get("allow", [])  # commit notes being followed
        partial += [list(k) for k in st.get("partial", []) if owner.get(tuple(k[0]), i) == i]
        if mine["outbox"] and order["outbox"][0] == mine["outbox"][0] \
                and int(st.get("pack_offset", 0)):
            partial.append([*order["outbox"][0], int(st["pack_offset"])])
    merged = {**first, "partitions": entries, "held": [], "outbox": outbox,
              # (a count: ranks holding the same loaded order count it once)
              "emitted": sum(int(o["emitted"]) for st, o in zip(states, orders, strict=True)
                             if not st.get("inherited"))
              + max([int(o["emitted"]) for st, o in zip(states, orders, strict=True)
                     if st.get("inherited")], default=0)}
    merged.pop("allow", None)
    if allow:
        merged["allow"] = allow
    # Partitions a rank gave up: the furthest one, unless a rank holds it.
    carried: dict[tuple[str, int], list[Any]] = {}
    for st in states:
        for t, p, o, s, note in st.get("carried", []):
            tp = (t, p)
            if tp not in seen and (tp not in carried or (o, s) > tuple(carried[tp][2:4])):
                carried[tp] = [t, p, o, s, note]
    # A document's tokens out only grow: where ranks name it twice (one holds
    # it, another kept an older count from an earlier merge), the most.
    most: dict[Any, tuple[list[Any], int]] = {}
    for *key, n in partial:
        k = _key(key)
        most[k] = (key, max(most[k][1], int(n)) if k in most else int(n))
    partial = [[*key, n] for key, n in most.values()]
    out: dict[str, Any] = {"order": merged, "pack_offset": 0, "partial": partial,
                           "carried": [carried[tp] for tp in sorted(carried)]}
    if "mix" in states[0]:
        mixes = [st["mix"] for st in states]
        for m in mixes[1:]:  # compared as a resume compares them: {a: 1} is {a: 0.5}
            if not isinstance(m.get("mix"), Mapping) or not _same_mix(m["mix"],
                                                                       mixes[0].get("mix")):
                said = _mix_difference(m.get("mix"), mixes[0]["mix"])
                raise ConfigError(f"the states differ in their Mix: "
                                  f"{said.replace('this loader', 'the first state')}")
        # Rank 0's round robin goes on. A source ran out (Mix(exhausted="repeat"):
        # at least once) where it ran out on every rank that held its partitions
        # (each rank's window names them): forgetting it read a source meant to
        # be read once a second time, after the others ran out. Whether a source
        # is live is found out again from the partitions each rank gets. A
        # source a rank was about to read again let records out in its window
        # (its count restarted at 0, which would read as an empty window).
        n = len(mixes[0]["live"])
        topics = mixes[0]["mix"]["topics"]
        again = {m.get("to_repeat") for m in mixes} - {None}
        since = [sum(int(m.get("since", [0] * n)[k]) for m in mixes) for k in range(n)]
        held = [{str(e[0]) for e in st.get("window", [])} for st in states]
        ran_out = []
        for k, topic in enumerate(topics):
            holders = [m for m, h in zip(mixes, held, strict=True) if topic in h] or mixes
            ran_out.append(all(bool(m.get("ran_out", [False] * n)[k]) for m in holders))
        out["mix"] = {**mixes[0], "ended": False, "live": [True] * n, "to_repeat": None,
                      "ran_out": ran_out,
                      "since": [max(c, 1) if k in again else c for k, c in enumerate(since)]}
        # Mix(exhausted="repeat"): each partition's window start, and its round:
        # the furthest, where a rank that holds it and one that only loaded it
        # both name it (rounds only grow).
        if any("window" in st for st in states):
            out["window"] = list({tuple(e[:2]): e for st in states
                                  for e in st.get("window", [])}.values())
        if any("rounds" in st for st in states):
            rounds: dict[tuple[Any, ...], int] = {}
            for st in states:
                for t, p, r in st.get("rounds", []):
                    rounds[(t, p)] = max(rounds.get((t, p), 0), int(r))
            out["rounds"] = [[t, p, r] for (t, p), r in sorted(rounds.items())]
    return out
