"""Rebalances played by the memory source: the loader's revoke and assign logic, step by step.

No broker: ``MemorySource.rebalance`` runs the callbacks inside ``consume()``
at a chosen call, eager or incremental, while batches are queued and a slot
is half filled. Whatever the script, no record is lost; in offset order
every record is handed out exactly once, and the positions committed on a
revoke are those of the batches handed out before it.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import kfeed
from kfeed.sources import MemorySource
from kfeed.synthetic import synthetic_columns, synthetic_schema

SCHEMA = synthetic_schema()
TOKENS = kfeed.Schema({"tokens": ("int32", (None,))})
PARTS, BLOCKS, PER_BLOCK = 3, 40, 8  # 960 records


def sample_values() -> dict[int, list[bytes]]:
    out = {}
    for p in range(PARTS):
        ids = np.arange(p * 10_000, p * 10_000 + BLOCKS * PER_BLOCK)
        out[p] = SCHEMA.encode_blocks(synthetic_columns(ids), PER_BLOCK)
    return out


def all_ids() -> np.ndarray:
    return np.concatenate([np.arange(p * 10_000, p * 10_000 + BLOCKS * PER_BLOCK)
                           for p in range(PARTS)])


# Each script: (incremental, [(call, revoke, assign), ...]).
SCRIPTS = {
    "eager, all back": (False, [(3, [0, 1, 2], [0, 1, 2])]),
    "eager, one away and back": (False, [(2, [0, 1, 2], [1, 2]), (6, [1, 2], [0, 1, 2])]),
    "eager, many": (False, [(c, [0, 1, 2], [0, 1, 2]) for c in (2, 3, 5, 8, 13)]),
    "incremental, one away and back": (True, [(3, [0], []), (7, [], [0])]),
    "incremental, moves": (True, [(2, [1], []), (4, [], [1]), (5, [0, 2], []),
                                  (9, [], [2, 0])]),
}


def run(source: MemorySource, batch_size: int, **kwargs) -> list[kfeed.loader.Batch]:
    with kfeed.Loader(None, "memory", kwargs.pop("schema", SCHEMA), batch_size, device="cpu",
                      until="end", source=source, prefetch=3, **kwargs) as ld:
        return [b for b in ld]


@pytest.mark.parametrize("name", list(SCRIPTS))
@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(buffer=64, seed=3)],
                         ids=["in order", "shuffled"])
def test_every_record_once_whatever_the_rebalances(name, shuffle) -> None:
    incremental, script = SCRIPTS[name]
    src = MemorySource(sample_values(), incremental=incremental, most=4)
    for call, revoke, assign in script:
        src.rebalance(call, revoke=revoke, assign=assign)
    batches = run(src, 20, shuffle=shuffle)
    ids = np.concatenate([b["id"].numpy() for b in batches])
    assert src.calls >= max(c for c, _r, _a in script), "the script did not play"
    assert np.array_equal(np.unique(ids), np.sort(all_ids()))  # nothing lost
    # Nothing repeated, shuffled too: the revoke's commit notes what the
    # shuffle delivered above the watermark (NOTE [ Commit notes ]).
    assert len(ids) == len(all_ids())


@pytest.mark.parametrize("call", [10, 20])
def test_a_shuffled_partition_kept_through_an_incremental_revoke_keeps_its_order(call) -> None:
    # Partition 1 goes and comes back; 0 and 2 stay. Their commits, made at
    # each step, are this loader's own: of the batches used, with a note of
    # what the shuffle used above them. The partitions kept took such a
    # commit at their order's watermark for another member's and read again
    # from it, and the batch in hand came again (15 to 20 records of 960).
    noted: list = []

    class Noting(MemorySource):
        def commit(self, positions, asynchronous):
            out = super().commit(positions, asynchronous)
            noted.extend(n for n in self.committed_notes.values() if n)
            return out

    src = Noting(sample_values(), incremental=True, most=4)
    src.rebalance(call, revoke=[1])
    src.rebalance(call + 6, assign=[1])
    ids = []
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      prefetch=3, shuffle=kfeed.Shuffle(buffer=64, seed=3),
                      commit_interval_ms=0) as ld:
        for batch in ld:
            time.sleep(0.01)  # the step: the thread commits, and runs ahead
            ids.append(batch["id"].numpy().copy())
    assert src.calls >= call + 6, "the script did not play"
    assert noted, "no commit with a note: the case is not played"
    got = np.concatenate(ids)
    assert np.array_equal(np.unique(got), np.sort(all_ids()))
    assert len(got) == len(all_ids())


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_revoke_commits_no_batch_whose_step_is_still_running(name) -> None:
    # The loader's thread gave revoked partitions up at once, committing what
    # was handed out: the batch whose step was still running too, which a
    # trainer killed in that step never trained and nobody read again.
    done: dict = {}  # per partition, the end of the batches whose step is over
    early: list = []

    class Watched(MemorySource):
        def commit(self, positions, asynchronous):
            early.extend((tp, pos[:2], done.get(tp)) for tp, pos in positions.items()
                         if tuple(pos[:2]) > done.get(tp, (0, 0)))
            return super().commit(positions, asynchronous)

    incremental, script = SCRIPTS[name]
    src = Watched(sample_values(), incremental=incremental, most=4)
    for call, revoke, assign in script:
        src.rebalance(call, revoke=revoke, assign=assign)
    ids = []
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      prefetch=3) as ld:
        for batch in ld:
            time.sleep(0.01)  # the step, while the thread fetches (and rebalances)
            ids.append(batch["id"].numpy().copy())
            for tp, (_first, end) in batch.offsets.items():
                done[tp] = max(done.get(tp, (0, 0)), tuple(end))
    assert src.calls >= max(c for c, _r, _a in script), "the script did not play"
    assert early == []
    assert np.array_equal(np.sort(np.concatenate(ids)), np.sort(all_ids()))


def test_a_loader_in_order_after_a_shuffled_one_says_what_it_reads_again(caplog) -> None:
    # The shuffled loader's commit notes which records above its position it
    # used; a loader in offset order cannot skip them and read them again, silently.
    src = MemorySource(sample_values())
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", source=src, until="end",
                      shuffle=kfeed.Shuffle(buffer=64, seed=3)) as ld:
        first = [next(ld)["id"].numpy().copy() for _ in range(3)]
    assert any(n for n in src.committed_notes.values())
    with caplog.at_level(logging.WARNING, logger="kfeed.loader"):
        ids = np.concatenate([b["id"].numpy() for b in run(src, 20)])
    said = [r.getMessage() for r in caplog.records if "reads them again" in r.getMessage()]
    assert said and said[0].startswith("memory[") and said[0].endswith(
        "this loader reads in offset order and reads them again: read with the same "
        "shuffle= and pack= to skip them"), said
    assert len(np.intersect1d(np.concatenate(first), ids)) > 0  # as it says


@pytest.mark.parametrize("incremental", [False, True], ids=["eager", "incremental"])
def test_a_rebalance_inside_a_fetch_ahead_loses_and_repeats_nothing(incremental) -> None:
    # A fetch takes what is there first (consume(n + ahead, 0)), then waits
    # for the rest of its batch (NOTE [ Fetching ahead ]). A rebalance inside
    # that second call must drop what the first one brought, which the new
    # start positions do not count (a partition kept through it is read
    # again from the ledger's position). Each script lands on several calls,
    # with sources that hand out 2, 3 or 5 messages a call.
    for most in (2, 3, 5):
        for call in range(2, 9):
            if incremental:  # partitions given, then one taken while they are first read
                src = MemorySource(sample_values(), incremental=True, most=most, first=[0])
                src.rebalance(call, assign=[1, 2])
                src.rebalance(call + 1, revoke=[0])
                src.rebalance(call + 2, assign=[0])
            else:
                src = MemorySource(sample_values(), most=most)
                src.rebalance(call, revoke=[0, 1, 2], assign=[0, 1, 2])
            ids = np.concatenate([b["id"].numpy() for b in run(src, 20)])
            assert src.calls > call + 2, "the script did not play"
            assert np.array_equal(np.sort(ids), np.sort(all_ids())), (most, call)


@pytest.mark.parametrize("incremental", [False, True], ids=["eager", "incremental"])
def test_packed_documents_once_whatever_the_rebalances(incremental) -> None:
    # Documents of lengths 1..40 with their id as every token.
    docs = {p: [np.full(1 + (i * 7 + p) % 40, p * 1000 + i, np.int32) for i in range(60)]
            for p in range(2)}
    # One document per message: enough consume() calls for the script to play
    # before a partition reaches its end.
    values = {p: TOKENS.encode_blocks({"tokens": d}, 1) for p, d in docs.items()}
    src = MemorySource(values, incremental=incremental, most=4)
    if incremental:
        src.rebalance(3, revoke=[1])
        src.rebalance(6, assign=[1])
    else:
        src.rebalance(3, revoke=[0, 1], assign=[0])
        src.rebalance(6, revoke=[0], assign=[0, 1])
    batches = run(src, 4, schema=TOKENS, pack=kfeed.Pack(seq_len=32, eos_id=-1, pad_id=-2))
    assert src.calls >= 6, "the script did not play"
    tokens = np.concatenate([b["tokens"].numpy().ravel() for b in batches])
    tokens = tokens[(tokens != -1) & (tokens != -2)]
    ids, counts = np.unique(tokens, return_counts=True)
    lengths = {int(d[0]): len(d) for p in range(2) for d in docs[p]}
    # Every token once: committed offsets never pass a document with tokens
    # still to come, and the commit's note says how many are out, so a
    # revoked partition's next reader cuts them (NOTE [ Commit notes ]).
    assert sorted(lengths) == ids.tolist()
    assert [int(c) for c in counts] == [lengths[int(i)] for i in ids]


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_a_drained_read_given_more_partitions_reads_them_too(packed) -> None:
    # A bounded read of partition 0 alone is over: the shuffle gave up what
    # it held (drained), and the last batches are on their way. An
    # incremental assign, which revokes nothing, then gives it 1 and 2
    # (another member left). Their records went into the shuffle and stayed
    # there, and the read ended without them; packed, the packer that had
    # finished refused them ("feed after finish()").
    if packed:  # a document's tokens are its id, as many as its length
        docs = [np.full(1 + (i * 7 + p) % 40, p * 1000 + i, np.int32)
                for p in range(PARTS) for i in range(60)]
        values = {p: TOKENS.encode_blocks({"tokens": docs[p * 60:(p + 1) * 60]}, 4)
                  for p in range(PARTS)}
        kw: dict = {"schema": TOKENS, "pack": kfeed.Pack(seq_len=32, eos_id=-1, pad_id=-2)}
        want = np.concatenate(docs).tolist()
    else:
        values, kw, want = sample_values(), {}, all_ids().tolist()
    at = 6 if packed else 12  # the consume() after partition 0's last message
    src = MemorySource(values, incremental=True, most=4, first=[0])
    src.rebalance(at, assign=[1, 2])
    got = []
    with kfeed.Loader(None, "memory", kw.pop("schema", SCHEMA), 1 if packed else 4,
                      device="cpu", until="end", source=src, prefetch=1,
                      shuffle=kfeed.Shuffle(buffer=400, seed=1), **kw) as ld:
        for batch in ld:
            if src.calls < at:  # slow steps: the thread waits, and polls (Fetcher.serve)
                time.sleep(0.03)
            got.append(batch["tokens" if packed else "id"].numpy().ravel().copy())
    assert src.calls > at, "the script did not play"
    ids = np.concatenate(got)
    assert sorted(ids[ids >= 0].tolist()) == sorted(want)  # (less EOS and padding)


def test_the_revoke_commits_what_was_handed_out_before_it() -> None:
    src = MemorySource(sample_values(), most=4)
    src.rebalance(4, revoke=[0, 1, 2], assign=[0, 1, 2])
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      prefetch=3, commit_interval_ms=10**9) as ld:
        handed: dict[tuple[str, int], tuple[int, int]] = {}
        for b in ld:
            before = len(src.commits)
            for tp, (_first, end) in b.offsets.items():
                handed[tp] = end
            if len(src.commits) > before:
                break
        # The revoke ran inside the fetch for a later batch: what it
        # committed is at most what was handed out by then, never past it.
    revoke_commit = src.commits[0]
    for tp, pos in revoke_commit.items():
        assert pos <= handed.get(tp, (0, 0)) or pos[0] == 0


def test_commit_returns_once_the_revoke_it_gave_partitions_up_to_made_its_commit() -> None:
    # A revoke waits for the step (NOTE [ A revoke waits for the step ]);
    # commit() gives the partitions up, and the revoke commits them on the
    # loader's thread. commit() found nothing of its own to commit and
    # returned before that commit was made: a process that died then lost it,
    # and the batch in hand came again.
    class Slow(MemorySource):
        def commit(self, positions, asynchronous):
            time.sleep(0.3)
            return super().commit(positions, asynchronous)

    src = Slow(sample_values(), incremental=True, most=3)
    src.rebalance(2, revoke=[0, 1, 2])
    with kfeed.Loader(None, "memory", SCHEMA, 4, device="cpu", until="end", source=src,
                      prefetch=4, commit_interval_ms=10**9) as ld:
        next(ld)
        batch = next(ld)
        deadline = time.monotonic() + 10
        while ld._feeder.revoking is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the thread plays the revoke, and waits for the step
        assert ld._feeder.revoking is not None, "no revoke waited for the step"
        ld.commit()
        assert {tp: src.committed_positions.get(tp) for tp in batch.offsets} == \
            {tp: tuple(end) for tp, (_first, end) in batch.offsets.items()}


def test_the_on_revoke_hook_runs_at_a_step_boundary_with_the_partitions_going() -> None:
    src = MemorySource(sample_values(), most=4)
    src.rebalance(5, revoke=[0, 1, 2], assign=[1, 2])
    seen: list[tuple[list, dict, int]] = []
    steps = {"n": 0}

    def hook(tps):
        # Runs in the caller's thread inside next(): the step before is over,
        # so the state is exactly what was handed out, and a checkpoint here
        # is what the loader then commits for the partitions going.
        seen.append((sorted(tps), ld.state_dict()["positions"], len(src.commits)))

    ld = kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      on_revoke=hook)
    with ld:
        for _b in ld:
            steps["n"] += 1
    assert len(seen) == 1
    tps, positions, commits_before = seen[0]
    assert tps == [("memory", 0), ("memory", 1), ("memory", 2)]
    committed_on_revoke = src.commits[commits_before]  # the revoke's own, right after the hook
    assert {p: list(pos) for (_t, p), pos in committed_on_revoke.items()} == \
        {int(p): pos for p, pos in positions["memory"].items()}
    assert steps["n"] > 0


def test_records_fetched_before_a_revoke_never_pass_for_the_new_assignments() -> None:
    # A consume() call that ran a revoke and an assign of partition 0 at
    # offset 3 returns, say, records 5 and 6 fetched before the revoke, then
    # the new fetch from 3: only the new fetch is kept. Records of a revoked
    # partition, and from below a new start, go too.
    from kfeed._fetch import Record
    from kfeed.loader.fetch import Fetcher, Status
    from kfeed.loader.ledger import Ledger

    src = MemorySource({0: [b""] * 10, 1: [b""] * 10})
    ledger = Ledger(src, "earliest")
    fetcher = Fetcher(src, ledger, bounded=False, batch_size=8, status=Status(),
                      stop=__import__("threading").Event())
    fetcher.assigned = {("memory", 0)}
    fetcher.starts = {("memory", 0): (3, 0)}

    def rec(p: int, off: int) -> Record:
        return Record("memory", p, off, b"", 0)

    got = fetcher._after_rebalance([rec(0, 5), rec(1, 7), rec(0, 6), rec(0, 2), rec(0, 3),
                                    rec(0, 4)])
    assert [(m.partition(), m.offset()) for m in got] == [(0, 3), (0, 4)]


# -- whose commits win over a loaded state (NOTE [ Whose commits win ]) -------------------


def resumed_exactly(src: MemorySource, state: dict, before: list, played: int = 0,
                    **kw) -> None:
    """Resume ``state`` from ``src`` to the end: with ``before``, every record once."""
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      prefetch=3, **kw) as ld:
        ld.load_state_dict(state)
        after = [b for b in ld]
    assert src.calls > played, "the script did not play"
    ids = np.concatenate([b["id"].numpy() for b in before + after])
    assert len(ids) == len(all_ids())
    assert np.array_equal(np.sort(ids), np.sort(all_ids()))


ORDERS = {"in order": {}, "shuffled": {"shuffle": kfeed.Shuffle(buffer=30, seed=1)}}


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_partition_assigned_later_resumes_from_the_state_not_a_crashed_runs_commit(
        order) -> None:
    # A first run hands out a few batches and checkpoints; it then reads on,
    # commits past the checkpoint, and dies. Its reading after the
    # checkpoint is lost with it. Shuffled, the records the state's order had
    # used above its positions of 1 and 2 came again: the order let those go
    # at the first assignment, and with them what it knew of them.
    kw = ORDERS[order]
    first = MemorySource(sample_values())
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", source=first, **kw) as ld:
        before = [next(ld) for _ in range(6)]
        state = ld.state_dict()
    lineage = state["lineages"][0]
    src = MemorySource(sample_values(), incremental=True, first=[0], most=4)
    for p in range(PARTS):
        src.committed_positions[("memory", p)] = (BLOCKS - 5, 0)
        src.committed_by[("memory", p)] = (lineage, "crashed-run")
    # The restart is first given partition 0 alone, as a cooperative group
    # does while the crashed members' sessions run out, and 1 and 2 later.
    src.rebalance(4, assign=[1, 2])
    resumed_exactly(src, state, before, played=4, **kw)


def test_a_member_s_commit_at_the_state_s_position_with_a_note_wins_over_the_state() -> None:
    # A shuffled member checkpoints and commits that position, with the note
    # of the records it used above it (as the commit of a revoke whose hook
    # saved the state). Another member takes the partitions from the commits,
    # uses a batch, and commits the same offsets with a note of what it used
    # above them. A resume of the state took its own order on that tie, and
    # handed out that member's records again.
    def sharing(src: MemorySource, commits: tuple) -> MemorySource:
        src.committed_positions, src.committed_by, src.committed_notes = commits
        return src

    commits: tuple = ({}, {}, {})
    shuffle = kfeed.Shuffle(buffer=40, seed=7)
    with kfeed.Loader(None, "memory", SCHEMA, 12, device="cpu", shuffle=shuffle,
                      source=sharing(MemorySource(sample_values()), commits)) as a:
        before = [next(a) for _ in range(3)]
        state = a.state_dict()
        a.commit()
        at = dict(commits[0])
        a.close(commit_current=False)
    with kfeed.Loader(None, "memory", SCHEMA, 12, device="cpu", shuffle=shuffle,
                      source=sharing(MemorySource(sample_values()), commits)) as b:
        before.append(next(b))
    assert {tp: pos for tp, pos in commits[0].items() if pos == at[tp]}, \
        "no commit of the other member at the state's position: the case is not played"
    resumed_exactly(sharing(MemorySource(sample_values()), commits), state, before,
                    shuffle=shuffle)


def _ledger(start: str = "committed", loaded: bool = True) -> tuple:
    from kfeed.loader.ledger import Ledger

    src = MemorySource(sample_values())
    ledger = Ledger(src, start)
    ledger.lineages, ledger.run = {"chain"}, "this-run"
    if loaded:
        ledger.load_state({"positions": {"memory": {p: [10, 0] for p in range(PARTS)}}})
    return src, ledger


@pytest.mark.parametrize("by, run, at, starts", [
    ("chain", "crashed-run", 20, 10),  # the chain's earlier run: lost with it
    ("chain", None, 20, 10),           # the same, written before commits named their run
    ("chain", "this-run", 20, 20),     # another rank of this run read on
    ("other", "other-run", 20, 20),    # another member read on
    ("other", "other-run", 5, 10),     # behind the state
    ("chain", "this-run", 5, 10),
])
@pytest.mark.parametrize("when", ["first", "later"])
def test_whose_commit_wins_over_the_loaded_state(by, run, at, starts, when) -> None:
    src, ledger = _ledger()
    tp = ("memory", 1)
    src.committed_positions[tp] = (at, 0)
    src.committed_by[tp] = (by, run)
    if when == "later":  # given first partition 0 alone, then partition 1
        ledger.positions([("memory", 0)], {("memory", 0)})
        owned = {("memory", 0), tp}
    else:
        owned = {tp}
    assert ledger.positions([tp], owned)[tp] == (starts, 0)


@pytest.mark.parametrize("run, starts", [("this-run", 20), ("other-run", 0)])
def test_without_a_state_a_commit_of_this_run_wins_over_start_earliest(run, starts) -> None:
    src, ledger = _ledger(start="earliest", loaded=False)
    tp = ("memory", 2)
    src.committed_positions[tp] = (20, 0)
    src.committed_by[tp] = ("another-rank", run)
    assert ledger.positions([tp], {tp})[tp] == (starts, 0)


def test_a_restart_from_scratch_outranks_the_commits_of_the_run_it_replaced() -> None:
    # A run crashed before its first checkpoint, having committed past where
    # the restart from scratch (start="earliest") will checkpoint. The
    # restart's state must outrank those commits when it is resumed in turn,
    # even for a partition assigned late.
    def crashed_commits(src: MemorySource) -> None:
        for p in range(PARTS):
            src.committed_positions[("memory", p)] = (BLOCKS - 5, 0)
            src.committed_by[("memory", p)] = ("crashed-lineage", "crashed-run")

    first = MemorySource(sample_values())
    crashed_commits(first)
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", source=first,
                      start="earliest") as ld:
        before = [next(ld) for _ in range(6)]
        state = ld.state_dict()
    assert "crashed-lineage/crashed-run" in state["superseded"]
    src = MemorySource(sample_values(), incremental=True, first=[0], most=4)
    crashed_commits(src)
    src.rebalance(4, assign=[1, 2])
    resumed_exactly(src, state, before)


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_state_covers_the_partitions_its_loader_was_not_given_yet(order) -> None:
    # NOTE [ A state covers every partition ]: a restart from scratch gets
    # partition 0 alone while the crashed run's members still hold 1 and 2,
    # and checkpoints; those come only to the run after it. Shuffled, the
    # state left 1 and 2 out, and the run after it started them at the
    # crashed run's commit: 560 records lost.
    kw = ORDERS[order]

    def crashed_commits(src: MemorySource) -> None:
        for p in (1, 2):
            src.committed_positions[("memory", p)] = (BLOCKS - 5, 0)
            src.committed_by[("memory", p)] = ("crashed-lineage", "crashed-run")

    first = MemorySource(sample_values(), incremental=True, first=[0])
    crashed_commits(first)
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", source=first,
                      start="earliest", **kw) as ld:
        before = [next(ld) for _ in range(6)]
        state = ld.state_dict()
    assert state["superseded"] == ["crashed-lineage/crashed-run"]
    if kw:  # given up partitions are carried: [topic, partition, offset, skip, note]
        assert [c[:4] for c in state["carried"]] == [["memory", 1, 0, 0], ["memory", 2, 0, 0]]
    else:
        assert state["positions"]["memory"][1] == [0, 0] == state["positions"]["memory"][2]
    src = MemorySource(sample_values(), incremental=True, first=[0], most=4)
    crashed_commits(src)
    src.rebalance(2, assign=[1, 2])  # before partition 0 ends the epoch
    resumed_exactly(src, state, before, played=2, **kw)


# -- commit notes (NOTE [ Commit notes ] in kfeed/loader/ledger.py) -------------


def _stop_and_go_on(src: MemorySource, steps: int, **kwargs) -> tuple[list, list]:
    """A loader reads ``steps`` batches and closes; a second, with no state, goes on from
    the commits. Their batches."""
    schema, batch = kwargs.pop("schema", SCHEMA), kwargs.pop("batch", 20)
    with kfeed.Loader(None, "memory", schema, batch, device="cpu", until="end", source=src,
                      **kwargs) as ld:
        first = [next(ld) for _ in range(steps)]
    return first, run(src, batch, schema=schema, start="committed", **kwargs)


@pytest.mark.parametrize("steps", [1, 7, 20])
def test_a_restart_from_the_commits_alone_repeats_nothing_a_shuffle_used(steps) -> None:
    src = MemorySource(sample_values())
    first, second = _stop_and_go_on(src, steps, shuffle=kfeed.Shuffle(buffer=200, seed=1))
    ids = np.concatenate([b["id"].numpy() for b in first + second])
    assert len(ids) == len(all_ids())
    assert np.array_equal(np.sort(ids), np.sort(all_ids()))
    # The shuffle used records far above the committed offsets: the note did the work.
    assert any(len(pos) > 2 for c in src.commits for pos in c.values())


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(buffer=30, seed=2)],
                         ids=["in order", "shuffled"])
def test_a_restart_from_the_commits_alone_cuts_the_tokens_already_out(shuffle) -> None:
    docs = {p: [np.full(1 + (i * 11 + p) % 70, p * 1000 + i, np.int32) for i in range(80)]
            for p in range(2)}
    values = {p: TOKENS.encode_blocks({"tokens": d}, 3) for p, d in docs.items()}
    src = MemorySource(values)
    pack = kfeed.Pack(seq_len=32, eos_id=-1, pad_id=-2)
    first, second = _stop_and_go_on(src, 9, schema=TOKENS, pack=pack, shuffle=shuffle, batch=4)
    tokens = np.concatenate([b["tokens"].numpy().ravel() for b in first + second])
    tokens = tokens[(tokens != -1) & (tokens != -2)]
    ids, counts = np.unique(tokens, return_counts=True)
    lengths = {int(d[0]): len(d) for p in range(2) for d in docs[p]}
    assert sorted(lengths) == ids.tolist()
    assert [int(c) for c in counts] == [lengths[int(i)] for i in ids]  # every token once


def test_a_note_too_long_for_kafka_is_left_out_and_then_records_come_again(caplog) -> None:
    # One partition, a shuffle holding 5,000 records, 6,000 out: the keys
    # not used yet, about one character each once compressed, are past the
    # 4096 characters Kafka keeps by default.
    values = {0: SCHEMA.encode_blocks(synthetic_columns(np.arange(12000)), 8)}
    src = MemorySource(values)
    shuffle = kfeed.Shuffle(buffer=5000, seed=1)
    with caplog.at_level("WARNING", logger="kfeed.sources"), \
            kfeed.Loader(None, "memory", SCHEMA, 200, device="cpu", until="end", source=src,
                         shuffle=shuffle) as ld:
        first = [next(ld) for _ in range(30)]
    assert src.committed_notes[("memory", 0)] is None
    assert "does not fit the commit's metadata" in caplog.text
    second = run(src, 200, start="committed", shuffle=shuffle)
    ids = np.concatenate([b["id"].numpy() for b in first + second])
    assert np.array_equal(np.unique(ids), np.arange(12000))  # nothing lost
    assert len(ids) > 12000  # what the shuffle used above the offset came again


def test_the_note_codec_round_trips_and_refuses_what_is_not_a_note() -> None:
    from kfeed.loader.ledger import decode_note, encode_note

    keys = np.array([[100, 3], [100, 7], [105, 0], [4000, 12]], np.int64)
    text = encode_note((100, 3), (4001, 0), keys, {(105, 0): 17})
    assert "," not in text and "=" not in text  # fits in the commit's metadata fields
    read, got, partial = decode_note(100, text)
    assert read == (4001, 0)
    assert got == [tuple(k) for k in keys.tolist()]
    assert partial == {(105, 0): 17}
    for bad in ["", "not base64!", text[:-4], "eJwDAAAAAAE"]:
        with pytest.raises(ValueError):
            decode_note(100, bad)
    # An offset delta past 32 bits has no note: the records come again, none is lost.
    assert encode_note((0, 0), (1 << 33, 0), np.empty((0, 2), np.int64), {}) is None


def test_allow_skips_what_the_note_says_was_used_and_survives_a_state() -> None:
    from kfeed.tokens import ShuffleBuffer

    buf = ShuffleBuffer(None, ack=True)
    buf.seek("p", 10, 2)
    buf.allow("p", (12, 0), [(10, 4), (11, 1)])
    state = buf.state()
    assert state["allow"] == [["p", [12, 0], [[10, 4], [11, 1]]]]
    again = ShuffleBuffer(None, ack=True)
    again.load_state(state)
    for b in (buf, again):
        rows = np.array([[b.pid("p"), o, s, i] for i, (o, s) in enumerate(
            [(10, 2), (10, 3), (10, 4), (11, 0), (11, 1), (12, 0), (12, 1)])], np.int64)
        emitted, skipped = b.push_many(rows)
        assert [tuple(r) for r in emitted[:, 1:3].tolist()] == [(10, 4), (11, 1), (12, 0), (12, 1)]
        assert sorted(skipped.tolist()) == [0, 1, 3]
        assert "allow" not in b.state()  # read past the note: forgotten


def test_a_start_of_its_own_does_not_follow_a_note_on_the_same_offset() -> None:
    # A shuffle's commits stay at offset 0 while its notes grow. A new job
    # that starts at the earliest offset (not at the commit) reads everything.
    src = MemorySource(sample_values())
    shuffle = kfeed.Shuffle(buffer=200, seed=1)
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      shuffle=shuffle) as ld:
        for _ in range(3):
            next(ld)
    assert any(src.committed_notes.values())
    assert all(pos[0] == 0 for pos in src.committed_positions.values())
    ids = np.concatenate([b["id"].numpy() for b in run(src, 20, start="earliest",
                                                       shuffle=shuffle)])
    assert np.array_equal(np.sort(ids), np.sort(all_ids()))


@pytest.mark.parametrize("in_hand", [True, False], ids=["batch in hand", "all used"])
def test_after_a_rebuild_a_used_commit_claims_nothing_of_the_batch_in_hand(in_hand) -> None:
    # The current batch is handed out, not used; a revoke of another
    # partition rebuilds the order, which then no longer knows it. A commit
    # then (close(commit_current=False)) must not note those records as used.
    # With every batch handed out used (a revoke the caller gives up at a
    # step's boundary, in next()) the rebuilt order knows: the commit keeps
    # its note. (It had none: if that commit was the last, before a crash,
    # what the shuffle had used above it came again from the next reader.)
    from kfeed.loader.ledger import OrderLedger

    src = MemorySource({0: [b""], 1: [b""]})
    ledger = OrderLedger(src, "earliest", kfeed.Shuffle(buffer=4, seed=1), None)
    p, q = ("memory", 0), ("memory", 1)
    order = ledger.order
    for tp in (p, q):
        order.seek(tp, 0)
        ledger.seen.add(tp)
    rows = np.array([[order.pid(tp), off, 0, i] for i, (tp, off) in enumerate(
        [(tp, off) for off in range(10) for tp in (p, q)])], np.int64)
    order.push_many(rows)
    ledger.accept({}, 3, 0)
    ledger.mark_used({})
    if in_hand:
        ledger.accept({}, 3, 0)  # the batch in hand
    ledger.give_up([q])
    todo = ledger.to_commit(lambda tp: True)
    if not in_hand:
        assert len(todo[p]) == 3  # its note
        return
    assert len(todo[p]) == 2  # a position, no note: records may come again, none is lost
    ledger.mark_used({})  # the step is over: notes again
    assert len(ledger.to_commit(lambda tp: True)[p]) == 3


def test_merged_states_keep_every_ranks_notes() -> None:
    from kfeed.loader.merge import _merge_orders
    from kfeed.tokens import ShuffleBuffer

    def state(tp):
        buf = ShuffleBuffer(None, ack=True)
        buf.seek(tp, 10, 0)
        buf.allow(tp, (20, 0), [(12, 0)])
        return {"order": buf.state(), "pack_offset": 0, "partial": []}

    merged = _merge_orders([state(("t", 0)), state(("t", 1))])
    assert [e[0] for e in merged["order"]["allow"]] == [("t", 0), ("t", 1)]


def test_a_rebalance_after_the_epoch_was_read_whole_gives_the_records_back() -> None:
    # With epochs, records go through the partitions' ring (Mixer.in_turn).
    # The caller holds its first batch while the loader's thread reads the
    # whole epoch into the shuffle and waits for room in the queue, polling;
    # then a rebalance gives back every record not handed out. The epoch
    # must read them again: it used to end there, 940 of 960 records short.
    import time

    src = MemorySource(sample_values(), most=4)
    src.rebalance(40, revoke=[0, 1, 2], assign=[0, 1, 2])
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      prefetch=3, epochs=2, shuffle=kfeed.Shuffle(buffer=2000, seed=4)) as ld:
        it = iter(ld)
        first = [next(it)["id"].numpy()]
        deadline = time.monotonic() + 30
        while src.calls <= 40 and time.monotonic() < deadline:  # the thread polls meanwhile
            time.sleep(0.01)
        first += [b["id"].numpy() for b in it]
        second = [b["id"].numpy() for b in ld]
    assert src.calls > 40, "the script did not play"
    for epoch in (first, second):
        ids = np.concatenate(epoch)
        assert np.array_equal(np.sort(ids), np.sort(all_ids()))


def test_in_order_a_note_needs_no_key_per_document_in_flight(caplog) -> None:
    # Thousands of short documents a batch, and more fetched ahead: past the
    # keys a note can list. In order, what was not used yet is all that was
    # read from the first such document on, so the note names that one alone
    # (its tokens already out), and a restart from the commits repeats nothing.
    lengths = [1 + i % 3 if i % 97 else 900 for i in range(60000)]
    docs = [np.full(n, i, np.int32) for i, n in enumerate(lengths)]
    src = MemorySource({0: TOKENS.encode_blocks({"tokens": docs}, 500)})
    pack = kfeed.Pack(seq_len=1024, eos_id=-1, pad_id=-2)
    with caplog.at_level("WARNING", logger="kfeed.loader"):
        first, second = _stop_and_go_on(src, 2, schema=TOKENS, pack=pack, batch=48)
    assert "too many for the commit's note" not in caplog.text
    assert first[-1]["tokens"][-1, -1] >= 0  # the first loader stopped inside a document
    tokens = np.concatenate([b["tokens"].numpy().ravel() for b in first + second])
    ids, counts = np.unique(tokens[tokens >= 0], return_counts=True)
    assert ids.tolist() == list(range(60000))
    assert counts.tolist() == lengths  # every token once


# -- synchronous commits never wait on a thread that waits on the caller ---------------


def _read_all(ld: kfeed.Loader, step_s: float, commit_from: int | None = None) -> np.ndarray:
    """Every id of ``ld``, each step taking ``step_s``; ``loader.commit()`` from step ``commit_from``."""
    ids = []
    with ld:
        for k, batch in enumerate(ld):
            ids.append(batch["id"].numpy().copy())
            time.sleep(step_s)  # the training step: the loader's thread runs ahead meanwhile
            if commit_from is not None and k >= commit_from:
                ld.commit()
    return np.concatenate(ids)


@pytest.mark.parametrize("how", ["commit_interval_ms=0", "commit() in the last steps"])
def test_a_synchronous_commit_at_the_end_of_an_epoch_is_made(how) -> None:
    # The thread, its last batch queued, waits for room to say the epoch is
    # over; the caller's next() waits for its commit first. The thread makes
    # commits while it waits, so neither waits out the commit's timeout.
    kw = {"commit_interval_ms": 0} if how.startswith("commit_interval") else {}
    src = MemorySource(sample_values())
    ld = kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", prefetch=2,
                      source=src, connect_timeout_s=1.0, **kw)
    t0 = time.monotonic()
    ids = _read_all(ld, 0.02, commit_from=None if kw else 44)
    assert np.array_equal(np.sort(ids), np.sort(all_ids()))
    assert time.monotonic() - t0 < 5.0  # 48 steps of 20 ms; a wait out would be 6 s more
    assert src.committed_positions == {("memory", p): (BLOCKS, 0) for p in range(PARTS)}


@pytest.mark.parametrize("how", ["commit_interval_ms=0", "commit() every step"])
def test_a_synchronous_commit_runs_the_on_revoke_hook_the_thread_waits_for(how) -> None:
    # A revoke comes while the caller is in its step: the thread waits for the
    # caller to run on_revoke, and the caller's commit, made by that thread,
    # must not wait for it first.
    src = MemorySource(sample_values(), most=4)
    src.rebalance(5, revoke=[0, 1, 2], assign=[0, 1, 2])
    hooked: list[list] = []
    kw = {"commit_interval_ms": 0} if how.startswith("commit_interval") else {}
    ld = kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      on_revoke=hooked.append, connect_timeout_s=1.0, **kw)
    t0 = time.monotonic()
    ids = _read_all(ld, 0.15, commit_from=None if kw else 0)
    assert src.calls > 5, "the script did not play"
    assert hooked == [[("memory", 0), ("memory", 1), ("memory", 2)]]
    assert np.array_equal(np.sort(ids), np.sort(all_ids()))
    assert time.monotonic() - t0 < 48 * 0.15 + 4.0  # no wait out of 6 s


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_resume_given_part_of_a_state_keeps_what_another_member_read_since(order) -> None:
    # A holds partition 1 alone and checkpoints (its state carries 0 at its
    # start). Another member B, of another lineage, then reads both to their
    # ends. R resumes A's state, given partition 1 alone. Its state saved 0 at
    # A's position and B's run as superseded, so a resume of R's state read
    # partition 0 again (320 records); and its commit took partition 1 back
    # from B's end to A's position, so a member starting from the commits
    # read those again (offset order).
    commits: tuple = ({}, {}, {})

    def source(**kw) -> MemorySource:
        src = MemorySource(sample_values(), **kw)
        src.committed_positions, src.committed_by, src.committed_notes = commits
        return src

    def read(state: dict | None = None, **kw) -> tuple[list, dict]:
        with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end",
                          commit_interval_ms=0, source=source(**kw), **ORDERS[order]) as ld:
            if state is not None:
                ld.load_state_dict(state)
            return [i for b in ld for i in b["id"].tolist()], ld.state_dict()

    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", source=source(first=[1]),
                      **ORDERS[order]) as a:
        got = next(a)["id"].tolist()
        state = a.state_dict()
    b, _ = read()
    r, r_state = read(state, first=[1])
    assert r == [], "R read what B had read"
    again, _ = read(r_state)
    fresh, _ = read()
    assert again == [] and fresh == []
    assert sorted(got + b) == sorted(set(got + b)) and len(set(got + b)) == len(all_ids())


@pytest.mark.parametrize("seed", [1, 7])  # B's commit at A's position with a note; past it
def test_a_resume_given_part_of_a_state_keeps_what_another_member_used_above_its_position(
        seed) -> None:
    # As above, shuffled, but B reads one batch of partition 0 and commits
    # with its first record still in its buffer: at the position A's state
    # carries 0 at, with a note of the records it used above. R carried A's
    # position and note, B's run adopted as superseded: a resume of R's state
    # read B's batch again (20 records).
    commits: tuple = ({}, {}, {})
    shuffle = kfeed.Shuffle(buffer=30, seed=seed)

    def loader(**kw) -> kfeed.Loader:
        src = MemorySource(sample_values(), **kw)
        src.committed_positions, src.committed_by, src.committed_notes = commits
        return kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end",
                            commit_interval_ms=0, source=src, shuffle=shuffle)

    with loader(first=[1]) as a:
        got = next(a)["id"].tolist()
        state = a.state_dict()
    with loader(first=[0]) as b:
        got += next(b)["id"].tolist()
        b.commit()
    assert commits[0][("memory", 0)] == ((0, 0) if seed == 1 else (0, 1))
    assert commits[2][("memory", 0)], "B's commit has no note"
    with loader(first=[1]) as r:
        r.load_state_dict(state)
        got += [i for b in r for i in b["id"].tolist()]
        r_state = r.state_dict()
    with loader() as again:
        again.load_state_dict(r_state)
        got += [i for b in again for i in b["id"].tolist()]
    assert len(got) == len(set(got)) == len(all_ids())


def _restarted(src: MemorySource, values: dict) -> MemorySource:
    """The same group's committed offsets, a new member (no script, every partition)."""
    again = MemorySource(values)
    again.committed_positions = dict(src.committed_positions)
    again.committed_by = dict(src.committed_by)
    again.committed_notes = dict(src.committed_notes)
    return again


@pytest.mark.parametrize("start", ["committed", "latest"])
@pytest.mark.parametrize("order", ["shuffled", "packed"])
def test_a_state_saved_after_a_revoke_carries_the_partition_given_up(order, start) -> None:
    # Partition 1 goes to another member, which never commits; the state is
    # saved after. The job resumes from it and gets partition 1 back: its only
    # commit is this loader's own, taken for lost (an earlier run of its
    # chain), so the state must say where it was given up, note and all;
    # else it was read again from the start (a repeat) or from "latest" (a loss).
    if order == "shuffled":
        values, schema, field = sample_values(), SCHEMA, "id"
        kw: dict = {"shuffle": kfeed.Shuffle(buffer=30, seed=1)}
        want = np.sort(all_ids())
    else:  # documents of distinct token values, cut across batches
        docs = {p: [np.full(1 + (i * 11 + p) % 70, p * 1000 + i, np.int32) for i in range(80)]
                for p in range(PARTS)}
        values = {p: TOKENS.encode_blocks({"tokens": d}, 3) for p, d in docs.items()}
        schema, field = TOKENS, "tokens"
        kw = {"pack": kfeed.Pack(seq_len=32, eos_id=-1, pad_id=-2),
              "shuffle": kfeed.Shuffle(buffer=10, seed=1)}
        want = np.sort(np.concatenate([d for p in docs for d in docs[p]]))
    src = MemorySource(values, most=4)
    src.rebalance(6, revoke=[0, 1, 2], assign=[0, 2])
    batch = 20 if order == "shuffled" else 4
    got = []
    with kfeed.Loader(None, "memory", schema, batch, device="cpu", until="end", source=src,
                      start=start if start == "committed" else "earliest", **kw) as ld:
        for b in ld:
            got.append(b[field].numpy().ravel().copy())
            if src.calls > 12:
                state = ld.state_dict()
                break
    assert ("memory", 1) in src.committed_positions, "partition 1 was not given up"
    assert [tuple(c[:2]) for c in state["carried"]] == [("memory", 1)]
    with kfeed.Loader(None, "memory", schema, batch, device="cpu", until="end",
                      source=_restarted(src, values), start=start, **kw) as ld:
        ld.load_state_dict(state)
        got += [b[field].numpy().ravel().copy() for b in ld]
    out = np.concatenate(got)
    assert np.array_equal(np.sort(out[out >= 0]), want)


def _fail_the_third_hand_out(ld: kfeed.Loader) -> None:
    """The loader's conversion to its output raises once, at the third batch."""
    real, calls = ld._convert, []

    def flaky(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("transient")
        return real(batch)

    ld._convert = flaky


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(buffer=30, seed=2)],
                         ids=["in order", "shuffled"])
def test_a_batch_whose_hand_out_failed_comes_with_the_next_call(shuffle) -> None:
    # The conversion to the output raises once, after the batch left the
    # queue (a transient DLPack error, a KeyboardInterrupt in that window):
    # a caller that goes on gets that batch next, and the ledger skips nothing.
    src = MemorySource(sample_values())
    got = []
    with kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      shuffle=shuffle, output="numpy") as ld:
        _fail_the_third_hand_out(ld)
        failed = 0
        while True:
            try:
                batch = next(ld)
            except StopIteration:
                break
            except RuntimeError:
                failed += 1
                continue
            got.append(batch["id"].copy())
    assert failed == 1
    ids = np.concatenate(got)
    assert np.array_equal(np.sort(ids), np.sort(all_ids()))
    # Every partition committed at its end: past its last block, or past its last record.
    assert all(pos[:2] in ((BLOCKS, 0), (BLOCKS - 1, PER_BLOCK))
               for pos in src.committed_positions.values())
    assert len(src.committed_positions) == PARTS


def test_a_close_after_a_failed_hand_out_commits_nothing_past_the_batch_held() -> None:
    # close() passes over the batches of rejected messages queued right after
    # what was handed out; it passed over those after the batch held for the
    # next call too, and committed past it: its records were lost (ids 20-29).
    schema = kfeed.Schema({"id": ("int32", ())})
    values = schema.encode_blocks({"id": np.arange(30, dtype=np.int32)}, 10) + [b"garbage"]
    src = MemorySource({0: values})
    ld = kfeed.Loader(None, "memory", schema, 10, source=src, until="end", device="cpu",
                      output="numpy", on_bad_record="skip")
    _fail_the_third_hand_out(ld)
    try:
        assert [int(next(ld)["id"][0]) for _ in range(2)] == [0, 10]
        deadline = time.monotonic() + 10
        while ld._feeder.ready._items.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the batch of 20-29, and the bad message's, are queued
        with pytest.raises(RuntimeError, match="transient"):
            next(ld)
    finally:
        ld.close()
    assert src.committed_positions[("memory", 0)] == (2, 0)
    with kfeed.Loader(None, "memory", schema, 10, source=src, until="end", device="cpu",
                      on_bad_record="skip") as again:
        assert [int(i) for b in again for i in b["id"]] == list(range(20, 30))


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(buffer=64, seed=5)], ids=["in order", "shuffled"])
@pytest.mark.parametrize("failed", [True, False], ids=["step failed", "step over"])
def test_a_loader_closed_while_a_revoke_waits_commits_what_close_commits(shuffle, failed) -> None:
    # The revoke waits for the caller's step (NOTE [ A revoke waits for the
    # step ]). A close() in that step ends the wait, and the revoke, still
    # inside the consumer's rebalance, makes the partitions' commit for their
    # next owner. It committed every batch handed out: the one of a step that
    # failed too (close(commit_current=False)), never trained and never read again.
    commits: list = []

    class Watched(MemorySource):
        def commit(self, positions, asynchronous):
            commits.append({tp: tuple(pos[:2]) for tp, pos in positions.items()})
            return super().commit(positions, asynchronous)

    src = Watched(sample_values(), most=2)
    ld = kfeed.Loader(None, "memory", SCHEMA, 20, device="cpu", until="end", source=src,
                      prefetch=2, shuffle=shuffle)
    used = [next(ld)["id"].numpy().copy()]
    in_hand = next(ld)["id"].numpy().copy()
    for _ in range(20):  # until a rebalance lands while a step runs
        at = src.calls + 1
        src.rebalance(at, revoke=[0, 1, 2], assign=[0, 1, 2])
        deadline = time.monotonic() + 2
        while ld._feeder.revoking is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if ld._feeder.revoking is not None:
            break
        used.append(in_hand)  # the thread waits for room: one more step
        in_hand = next(ld)["id"].numpy().copy()
    assert ld._feeder.revoking is not None, "no revoke came while a step ran"
    commits.clear()
    ld.close(commit_current=not failed)
    assert commits, "the revoke committed nothing"
    # What the group holds now: a reader after it (as the closed one read) reads the rest.
    after = np.concatenate([b["id"].numpy() for b in run(src, 20, shuffle=shuffle)])
    read = np.concatenate(used + ([] if failed else [in_hand]) + [after])
    assert np.array_equal(np.sort(read), np.sort(all_ids())), (
        f"lost {len(np.setdiff1d(all_ids(), read))}, repeated {len(read) - len(np.unique(read))}")
