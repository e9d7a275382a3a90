"""Ranks of a bounded epoch stop at the same step: two gloo processes, no broker."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from kfeed.loader.agreement import collective_device as _collective_device

WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import numpy as np
    import kfeed
    from kfeed.loader import memory_loader
    from kfeed.synthetic import synthetic_columns, synthetic_schema
    dist.init_process_group("gloo", init_method="env://")
    schema = synthetic_schema()
    # Partition 0 (rank 0) holds 3000 samples, partition 1 (rank 1) 1000.
    values = {p: schema.encode_blocks(synthetic_columns(np.arange(p * 10**6, p * 10**6 + n)), 100)
              for p, n in ((0, 3000), (1, 1000))}
    ld = memory_loader(values, schema, 256, device="cpu", until="end", assignment="static")
    steps, ids = 0, []
    for batch in ld:
        steps += 1
        ids += batch["id"].tolist()
    ld.close()
    print("RESULT", dist.get_rank(), steps, len(ids), len(set(ids)), flush=True)
    dist.destroy_process_group()
""")


def run_two_ranks(script: Path, *args: str, stderr: bool = False) -> dict[int, tuple[Any, ...]]:
    """Run ``script`` as ranks 0 and 1 of a gloo job; each rank's ``RESULT rank a b ...`` ints
    (``stderr``: the ints, then what the rank wrote to stderr)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script), *args], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    results = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err
            rank, *figures = map(int, out.split("RESULT", 1)[1].split())
            results[rank] = (*figures, err) if stderr else tuple(figures)
    finally:  # a rank that hangs must not outlive the test, holding its ports
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_the_collective_lives_where_the_backend_wants_it() -> None:
    assert _collective_device("gloo") == torch.device("cpu")
    assert _collective_device("GLOO") == torch.device("cpu")
    if torch.cuda.is_available():
        assert _collective_device("nccl").type == "cuda"
    else:
        # NCCL takes CUDA tensors only: without CUDA there is no device to name.
        with pytest.raises((RuntimeError, AssertionError)):
            _collective_device("nccl")


def test_two_ranks_with_uneven_data_stop_at_the_same_step(tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = run_two_ranks(script)
    # Rank 1's 1000 samples make 4 batches (3 x 256 + 232): both ranks stop after 4.
    assert results[0] == (4, 4 * 256, 4 * 256)
    assert results[1] == (4, 1000, 1000)


EMPTY_RANK = textwrap.dedent("""
    import logging, sys, torch.distributed as dist
    import numpy as np
    from kfeed.loader import memory_loader
    from kfeed.synthetic import synthetic_columns, synthetic_schema
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    dist.init_process_group("gloo", init_method="env://")
    schema = synthetic_schema()
    # Partition 1 (rank 1) read to its end already: nothing left in it.
    values = {0: schema.encode_blocks(synthetic_columns(np.arange(500)), 100), 1: []}
    ld = memory_loader(values, schema, 100, device="cpu", until="end", assignment="static")
    steps = sum(1 for _ in ld)
    ld.close()
    print("RESULT", dist.get_rank(), steps, flush=True)
    dist.destroy_process_group()
""")


REPEAT_STOPPED = textwrap.dedent("""
    import json, sys
    import numpy as np, torch.distributed as dist
    from kfeed import Loader, MemorySource, Mix, Schema, Shuffle
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    ids = Schema({"id": ("int64", ())})
    # Rank 0: A[0] (600, read again while B[0] lasts) and B[0] (2000); rank 1's
    # partitions are short, so its mixture ends first and the agreement stops
    # rank 0 inside a reading of A[0] again, some of A[0]'s first still held.
    every = {(t, p): range(first, first + n) for t, p, first, n in
             (("A", 0, 0, 600), ("B", 0, 10000, 2000), ("A", 1, 1000, 500),
              ("B", 1, 20000, 500))}
    values = {tp: ids.encode_blocks({"id": np.array(r)}, 10) for tp, r in every.items()}
    shuffle = Shuffle(100, seed=1) if sys.argv[1] == "1" else None

    def loader(**kw):
        return Loader(None, Mix({"A": 0.5, "B": 0.5}, exhausted="repeat"), ids, 50,
                      source=MemorySource(values), device="cpu", until="end",
                      shuffle=shuffle, **kw)
    ld = loader(assignment="static", rank=rank, world_size=2)
    got = [i for b in ld for i in b["id"].tolist()]
    states, gots = [None, None], [None, None]
    dist.all_gather_object(states, ld.state_dict())
    dist.all_gather_object(gots, got)
    ld.close()
    dist.destroy_process_group()
    rest = loader()  # the next read, from the job's merged state
    rest.load_state_dict(json.loads(json.dumps(Loader.merge_states(states))))
    with rest:
        left = [i for b in rest for i in b["id"].tolist()]
    seen = set(gots[0]) | set(gots[1]) | set(left)
    lost = sum(len(set(r) - seen) for r in every.values())
    a0_first = [i for i in gots[rank] if i < 600]
    a0_again = len([i for i in left if i < 600 and i in set(a0_first)])
    print("RESULT", rank, int(len(a0_first) < 600), lost, a0_again,
          int(list(states[0]["positions"]["A"][0]) < [60, 0]), flush=True)
""")


@pytest.mark.parametrize("shuffle", ["0", "1"])
def test_a_repeat_mixture_stopped_by_the_agreement_leaves_its_first_reading_to_the_next(
        tmp_path, shuffle) -> None:
    # The read again partitions of a rank stopped by the others counted as
    # read whole: their state and commit went to their end, and the records
    # of their first reading not handed out yet were never read (75 of 600).
    script = tmp_path / "worker.py"
    script.write_text(REPEAT_STOPPED)
    results = run_two_ranks(script, shuffle)
    stopped_inside, lost, again, behind = results[0]
    assert stopped_inside == 1  # the case: rank 0 had not handed out all of A[0] yet
    assert lost == 0
    assert again == 0  # what rank 0 handed out of A[0] is not read again
    assert behind == 1  # its own state keeps A[0] before its end


def test_a_job_whose_rank_has_nothing_left_says_why_it_reads_nothing(tmp_path) -> None:
    # Resumed at the size that left one rank's partitions read to their end, a
    # static job read nothing, resume after resume, without a word.
    script = tmp_path / "worker.py"
    script.write_text(EMPTY_RANK)
    results = run_two_ranks(script, stderr=True)
    assert results[0][:1] == results[1][:1] == (0,)
    said = {r: err for r, (_steps, err) in results.items()}
    assert "rank 0: the epoch ends before its first step: another rank has nothing left to " \
           "read" in said[0], said[0]
    assert "rank 1: the epoch ends before its first step: this rank has nothing left to " \
           "read" in said[1], said[1]


SHARED_RUN = textwrap.dedent("""
    import torch.distributed as dist
    import numpy as np
    from kfeed.loader import memory_loader
    from kfeed.synthetic import synthetic_columns, synthetic_schema
    dist.init_process_group("gloo", init_method="env://")
    schema = synthetic_schema()
    values = schema.encode_blocks(synthetic_columns(np.arange(1000)), 100)
    ld = memory_loader(values, schema, 100, device="cpu")  # group mode: partitions may move
    before = ld._source.run
    next(ld)
    print("RESULT", dist.get_rank(), int(before, 16), int(ld._source.run, 16),
          int(ld._ledger.run, 16), flush=True)
    ld.close()
    dist.destroy_process_group()
""")


def test_the_ranks_of_a_group_job_commit_as_one_run(tmp_path) -> None:
    # NOTE [ Whose commits win ]: each rank believes the others' commits
    # because they name the same run, rank 0's.
    script = tmp_path / "shared_run.py"
    script.write_text(SHARED_RUN)
    results = run_two_ranks(script)
    (own0, run0, ledger0), (own1, run1, ledger1) = results[0], results[1]
    assert own0 != own1  # each process drew its own
    assert run0 == run1 == ledger0 == ledger1 == own0


IN_ORDER = textwrap.dedent("""
    import time, torch.distributed as dist
    import numpy as np
    import kfeed
    from kfeed.sources import MemorySource
    from kfeed.synthetic import synthetic_columns, synthetic_schema
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    schema = synthetic_schema()
    values = {p: schema.encode_blocks(synthetic_columns(np.arange(p * 10**6, p * 10**6 + 2000)), 50)
              for p in range(2)}
    src = MemorySource(values, incremental=True, most=2)
    for at in (4, 9, 14):  # partition 1 leaves and comes back, batches held meanwhile
        src.rebalance(at, revoke=[1])
        src.rebalance(at + 3, assign=[1])
    ld = kfeed.Loader(None, "memory", schema, 50, device="cpu", until="end", source=src,
                      prefetch=4)
    ids, backwards = [], 0
    for batch in ld:
        got = batch["id"].tolist()
        for p in range(2):
            mine = [i for i in got if i // 10**6 == p]
            if mine and [i for i in ids if i // 10**6 == p][-1:] > mine[:1]:
                backwards += 1
        ids += got
        time.sleep(0.01)  # a step: the loader's thread runs ahead, the script plays
    ld.close()
    print("RESULT", rank, len(ids), len(set(ids)), backwards, src.calls, flush=True)
    dist.destroy_process_group()
""")


def test_a_rebalance_while_ranks_hold_a_batch_ahead_keeps_offset_order(tmp_path) -> None:
    # With ranks in agreement a batch waits one step ahead; when a rebalance
    # drops the one due, the one held ahead comes next, not a later one.
    script = tmp_path / "in_order.py"
    script.write_text(IN_ORDER)
    for rank, (n, unique, backwards, calls) in run_two_ranks(script).items():
        assert calls > 17, "the script did not play"
        assert (n, unique, backwards) == (4000, 4000, 0), rank


FINISH = textwrap.dedent("""
    import torch.distributed as dist
    from kfeed.loader.agreement import EpochAgreement
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    ag = EpochAgreement()
    # Both say they have batches 0 and 1; rank 0 then loses them to a
    # rebalance and has nothing more, rank 1 has 10 batches.
    have = 2 if rank == 0 else 10
    ag.post(have > 0)
    steps = 0
    while True:
        ag.post(have > steps + 1)
        if not ag.answer():
            ag.drain()
            break
        if rank == 0 and steps == 0:  # the batch in hand was dropped: END instead
            ag.finish()
            break
        steps += 1
    # Whatever comes next is a collective both ranks make in step.
    out = [rank]
    dist.broadcast_object_list(out, src=0)
    print("RESULT", rank, steps, out[0], flush=True)
    dist.destroy_process_group()
""")


def test_a_rank_that_runs_out_after_saying_it_had_a_batch_leaves_nobody_waiting(tmp_path) -> None:
    # Before EpochAgreement.finish, rank 0 left its questions unanswered: rank
    # 1 waited in all_reduce while rank 0 was in the next collective (a hang).
    script = tmp_path / "finish.py"
    script.write_text(FINISH)
    results = run_two_ranks(script)
    assert results[0] == (0, 0)
    assert results[1][1] == 0 and 1 <= results[1][0] <= 2  # the others stop within two steps


MADE_BEFORE = textwrap.dedent("""
    import torch.distributed as dist
    import numpy as np
    import kfeed
    from kfeed.loader import memory_loader
    schema = kfeed.Schema({"id": ("int64", ())})
    values = {p: schema.encode_blocks({"id": np.arange(p * 50, p * 50 + 50)}, 5) for p in range(4)}
    ld = memory_loader(values, schema, 10, device="cpu", until="end", assignment="static")
    dist.init_process_group("gloo", init_method="env://")
    try:
        next(ld)
        print("RESULT", dist.get_rank(), 0, flush=True)
    except kfeed.ConfigError as e:
        print("RESULT", dist.get_rank(), int(str(e).startswith(
            "the loader was made before torch.distributed.init_process_group, as rank 0 of 1, "
            "and the job has 2 ranks: make it after init_process_group, or pass rank= and "
            "world_size=")), flush=True)
    ld.close()
    dist.destroy_process_group()
""")


def test_a_loader_made_before_the_process_group_refuses_to_read_as_the_one_reader(
        tmp_path) -> None:
    # It kept rank 0 of 1: each rank read every record (each once per rank).
    script = tmp_path / "made_before.py"
    script.write_text(MADE_BEFORE)
    assert run_two_ranks(script) == {0: (1,), 1: (1,)}
