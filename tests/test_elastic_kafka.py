"""Elastic resume against a real Apache Kafka: a job killed and restarted on another number of ranks.

A data-parallel job (torch.distributed over gloo, a shuffle buffer; its
partitions assigned statically, or by the consumer group) checkpoints every few steps: rank 0 writes the merged
``state_dict()`` of every rank and the length of every rank's log. The whole
job is SIGKILLed after a random number of steps (the ranks halt there, their
loaders still fetching, so the kill always lands between checkpoints and never
after the stream's end), and starts again on the other number of ranks: 2 ranks
become 3, 3 become 2, and so on. Every id is trained exactly
once over all runs, the records the dead ranks' shuffle buffers held too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from test_faults import columns, count_ids, report

import kfeed

pytestmark = pytest.mark.integration

SCHEMA = kfeed.Schema({"x": ("float32", (16,)), "id": ("int64", ())})

RANK = """
import json, os, sys, time, torch.distributed as dist, kfeed
from test_elastic_kafka import SCHEMA
dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
bootstrap, topic, group, folder, run, every, assignment, halt = sys.argv[1:9]
checkpoint = os.path.join(folder, "checkpoint.json")
saved = None
if os.path.exists(checkpoint):
    with open(checkpoint) as f:
        saved = json.load(f)
config = {"bootstrap.servers": bootstrap, "group.id": group}
if assignment == "group":  # the killed job's members leave the group within 6 s
    config.update({"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000})
loader = kfeed.Loader(config, topic, SCHEMA, 40,
                      until="end", device="cpu", assignment=assignment,
                      shuffle=kfeed.Shuffle(300, seed=4),
                      start="earliest" if saved is None else "committed")
step, steps = 0, 0
if saved is not None:
    loader.load_state_dict(saved["loader"])
    step = saved["step"]
with open(os.path.join(folder, f"run{run}-rank{rank}.log"), "wb") as log:
    for batch in loader:
        log.write((" ".join(map(str, batch["id"].tolist())) + "\\n").encode())
        step += 1
        if step % int(every) == 0:
            log.flush()
            states, sizes = [None] * world, [None] * world
            dist.all_gather_object(states, loader.state_dict())
            dist.all_gather_object(sizes, log.tell())
            if rank == 0:
                with open(checkpoint + ".tmp", "w") as f:
                    json.dump({"loader": kfeed.Loader.merge_states(states), "step": step,
                               "run": int(run), "world": world, "logs": sizes}, f)
                os.replace(checkpoint + ".tmp", checkpoint)
            dist.barrier()
        time.sleep(0.01)  # a training step
        steps += 1
        if steps == int(halt):  # the crash point: wait here to be SIGKILLed
            log.flush()
            open(os.path.join(folder, f"halt{run}-rank{rank}"), "w").close()
            time.sleep(3600)
states = [None] * world
dist.all_gather_object(states, loader.state_dict())
if rank == 0:
    with open(os.path.join(folder, "end.json"), "w") as f:
        json.dump(kfeed.Loader.merge_states(states), f)
loader.close()
dist.destroy_process_group()
"""


# The numbers of ranks of the job's runs, each killed but the last: `make test`
# crosses 2 -> 3 and 3 -> 2 once; `pytest -m slow` twice.
@pytest.mark.parametrize("worlds", [(2, 3, 2), pytest.param((2, 3, 2, 3, 2),
                                                            marks=pytest.mark.slow)])
@pytest.mark.parametrize("assignment", ["static", "group"])
def test_a_job_killed_between_checkpoints_resumes_on_another_number_of_ranks(
        bootstrap, make_topic, tmp_path, assignment, worlds) -> None:
    n, every = 6000, 4
    topic = make_topic(partitions=6)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as p:
        ids = np.arange(n)
        p.send(columns(ids), keys=ids)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    group = uuid.uuid4().hex

    def start(run: int, world: int, halt: int = 0) -> list[subprocess.Popen[bytes]]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
        return [subprocess.Popen([sys.executable, str(script), bootstrap, topic, group,
                                  str(tmp_path), str(run), str(every), assignment,
                                  str(halt)],
                                 env={**env, "RANK": str(r)},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                for r in range(world)]

    def cut_logs(last_run: int) -> None:
        """What the runs after the checkpoint trained is trained again: drop it from the logs."""
        ck_path = tmp_path / "checkpoint.json"
        ck = json.loads(ck_path.read_text()) if ck_path.exists() else {"run": -1, "logs": []}
        for run in range(ck["run"], last_run + 1):
            for f in tmp_path.glob(f"run{run}-rank*.log"):
                rank = int(f.stem.rsplit("rank", 1)[1])
                keep = ck["logs"][rank] if run == ck["run"] else 0
                with f.open("r+b") as fh:
                    fh.truncate(keep)

    rng = np.random.default_rng(5)
    kills, crossings = 0, []
    for run, world in enumerate(worlds[:-1]):
        ck_path = tmp_path / "checkpoint.json"
        if ck_path.exists():
            crossings.append((json.loads(ck_path.read_text())["world"], world))
        # Steps trained by the run, then a crash (the last run goes to the end):
        # at most 11 steps of 3 ranks' 40 ids a run, so four runs never reach
        # the end of the 6000 ids.
        procs = start(run, world, halt=int(rng.integers(6, 12)))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and all(p.poll() is None for p in procs) \
                and len(list(tmp_path.glob(f"halt{run}-rank*"))) < world:
            time.sleep(0.005)
        ended = {rank: p.returncode for rank, p in enumerate(procs) if p.poll() is not None}
        for p in procs:  # the job crashes: every rank dies
            p.kill()
        errors = [p.communicate()[1].decode()[-2000:] for p in procs]
        assert not ended, f"run {run} ended before its crash point: {ended} {errors}"
        assert len(list(tmp_path.glob(f"halt{run}-rank*"))) == world, \
            f"run {run} did not reach its crash point in 90 s: {errors}"
        kills += 1
        cut_logs(run)
    last = len(worlds) - 1
    crossings.append((json.loads((tmp_path / "checkpoint.json").read_text())["world"],
                      worlds[last]))
    procs = start(last, worlds[last])
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-3000:]
    trained = np.array([int(x) for f in tmp_path.glob("run*-rank*.log")
                        for x in f.read_text().split()], np.int64)
    # The ranks stop at the same step; what one rank had left is the next epoch's.
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group}, topic, SCHEMA, 500,
                      until="end", device="cpu", assignment="static",
                      shuffle=kfeed.Shuffle(300, seed=4)) as rest:
        rest.load_state_dict(json.loads((tmp_path / "end.json").read_text()))
        left = np.concatenate([b["id"].numpy() for b in rest] or [np.empty(0, np.int64)])
    lost, dup = count_ids(np.concatenate([trained, left]), n)
    report(f"elastic_resume_2_3_ranks_{assignment}", samples=n, faults=kills, lost=lost,
           duplicated=dup,
           resumes=" ".join(f"{a}->{b}" for a, b in crossings),
           left_for_the_next_epoch=len(left))
    assert (2, 3) in crossings and (3, 2) in crossings, crossings
    assert (lost, dup) == (0, 0)
