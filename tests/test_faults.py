"""Fault proofs on the 3-node cluster: nothing lost, nothing repeated.

Replication factor 3, min.insync.replicas 2, acks=all and an idempotent
producer. Each test records its figures (samples, faults injected, lost,
duplicated) in the test report; docs/RELIABILITY.md quotes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import kfeed
from kfeed import cluster

pytestmark = [pytest.mark.integration, pytest.mark.cluster3]

# Small samples keep 200k of them quick to move on two cores.
SCHEMA = kfeed.Schema({"x": ("float32", (16,)), "id": ("int64", ())})


def columns(ids: np.ndarray) -> dict[str, np.ndarray]:
    return {"x": (ids[:, None] * 0.5 + np.arange(16)).astype(np.float32), "id": ids}


def report(name: str, **figures: object) -> None:
    line = json.dumps({"test": name, **figures})
    print(f"RELIABILITY {line}")
    out = Path(__file__).resolve().parent.parent / ".kfeed" / "reliability.jsonl"
    out.parent.mkdir(exist_ok=True)
    with out.open("a") as f:
        f.write(line + "\n")


def count_ids(ids: np.ndarray, n: int) -> tuple[int, int]:
    """(lost, duplicated) of ids against 0..n-1."""
    counts = np.bincount(ids, minlength=n)[:n]
    return int((counts == 0).sum()), int((counts > 1).sum())


def read_topic(bootstrap: str, topic: str, schema: kfeed.Schema = SCHEMA) -> np.ndarray:
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                      schema, 4096, until="end", device="cpu") as ld:
        return np.concatenate([b["id"].numpy().copy() for b in ld])


def read_until(bootstrap: str, topic: str, count: int, schema: kfeed.Schema = SCHEMA,
               timeout: float = 30.0) -> np.ndarray:
    """Read the topic's committed content until it holds ``count`` records.

    commit_transaction returns before the commit markers reach every partition;
    until they do, that transaction is not yet part of the topic's visible
    content, so a bounded epoch that starts in between ends before it (its records
    stay for the next epoch). Aborted records must never show up in any read.
    """
    deadline = time.monotonic() + timeout
    while True:
        ids = read_topic(bootstrap, topic, schema)
        if len(ids) >= count or time.monotonic() > deadline:
            return ids
        time.sleep(0.5)


def wait_registered(cluster_dir: Path, node_id: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if node_id in cluster.status(cluster_dir)["brokers"]:
                return
        except kfeed.ClusterError:
            pass  # no node answers yet: they are all still starting
        time.sleep(0.5)
    raise AssertionError(f"node {node_id} did not register again within {timeout:g}s")


@pytest.fixture
def live_cluster(cluster_dir):
    if cluster_dir is None:
        pytest.skip("fault injection needs the cluster's state folder (KFEED_CLUSTER_DIR)")
    yield cluster_dir
    # Whatever a test did, leave every node running for the next one.
    for node_id in range(1, 4):
        if node_id not in cluster.node_pids(cluster_dir):
            cluster.start_node(cluster_dir, node_id)


def test_broker_killed_mid_stream_loses_and_repeats_nothing(bootstrap, make_topic,
                                                             live_cluster) -> None:
    n = 200_000
    topic = make_topic(partitions=4, replication=3)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as p:
                for i in range(0, n, 2000):
                    ids = np.arange(i, i + 2000)
                    p.send(columns(ids), keys=ids)
                    time.sleep(0.01)  # a live stream, not one burst
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    seen = np.zeros(n, np.int64)
    progress = {"total": 0}
    ld = kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                      SCHEMA, 1024, device="cpu", max_wait_ms=100)

    def train() -> None:
        try:
            while progress["total"] < n:
                ids = next(ld)["id"].numpy()  # no exception may escape the training loop
                np.add.at(seen, ids, 1)
                progress["total"] += len(ids)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    producer = threading.Thread(target=produce)
    trainer = threading.Thread(target=train)
    t_start = time.monotonic()
    producer.start()
    trainer.start()
    while progress["total"] < n // 4 and trainer.is_alive():
        time.sleep(0.05)
    victim = 2
    t0 = time.monotonic()
    print(f"kill after {t0 - t_start:.1f}s", flush=True)
    cluster.kill_node(live_cluster, victim)
    time.sleep(8)
    cluster.start_node(live_cluster, victim, wait=False)
    while producer.is_alive() and time.monotonic() - t0 < 150:
        print(f"{time.monotonic() - t0:6.1f}s seen {progress['total']}", flush=True)
        producer.join(5)
    trainer.join(max(1.0, 150 - 8))
    stuck = trainer.is_alive()
    print(f"trainer done {time.monotonic() - t0:.1f}s after the kill", flush=True)
    stats = ld.stats()
    ld.close()
    trainer.join(10)
    assert not errors, errors
    assert not stuck, f"the loader saw {progress['total']} of {n} samples: {stats}"
    lost, dup = count_ids(np.repeat(np.arange(n), seen), n)
    wait_registered(live_cluster, victim)
    t1 = time.monotonic()
    stored_lost, stored_dup = count_ids(read_topic(bootstrap, topic), n)
    print(f"read back in {time.monotonic() - t1:.1f}s", flush=True)
    report("broker_loss", samples=n, faults=1, loader_lost=lost, loader_duplicated=dup,
           topic_lost=stored_lost, topic_duplicated=stored_dup,
           longest_wait_s=round(stats["longest_wait_s"], 3), stall_s=round(stats["wait_s"], 3))
    assert (lost, dup) == (0, 0)
    assert (stored_lost, stored_dup) == (0, 0)
    assert stats["longest_wait_s"] > 0


def test_trainer_killed_five_times_resumes_exactly(bootstrap, make_topic, tmp_path) -> None:
    from test_loader_kafka import produce, trained_ids

    topic = make_topic(partitions=3, replication=3)
    n = 12_000
    produce(bootstrap, topic, 0, n)
    ckpt, log = tmp_path / "ck.pt", tmp_path / "ids.txt"
    cmd = [sys.executable, "-m", "kfeed", "train", "--bootstrap-servers", bootstrap,
           "--topic", topic, "--group-id", uuid.uuid4().hex, "--until-end", "--batch-size", "100",
           "--checkpoint", str(ckpt), "--checkpoint-every", "7", "--log-ids", str(log),
           "--device", "cpu", "--resume", "--log-every", "1000000"]
    rng = np.random.default_rng(7)
    kills = 0
    for _ in range(5):
        before = log.read_text().count("\n") if log.exists() else 0
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        target = before + int(rng.integers(3, 25))  # a random point, between checkpoints or not
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and (
                not log.exists() or log.read_text().count("\n") < target):
            time.sleep(0.01)
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.wait()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    lost, dup = count_ids(np.array(trained_ids(log.read_text())), n)
    report("trainer_crash", samples=n, faults=kills, lost=lost, duplicated=dup)
    assert kills == 5
    assert (lost, dup) == (0, 0)


# One rank of the two-rank group test: a trainer whose model is the list of
# ids it trained on. Every K steps it checkpoints that list and
# loader.state_dict() together, then commits (periodic commits are off), so
# the group's committed offsets never run ahead of a checkpoint: the closest
# the Loader's API comes today to coordinating commits with checkpoints.
GROUP_RANK = """
import json, os, sys, time, kfeed
from test_faults import SCHEMA
bootstrap, topic, group, ckpt, every = sys.argv[1:6]

def save(payload):
    with open(ckpt + ".tmp", "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(ckpt + ".tmp", ckpt)  # a kill mid-write never leaves a torn checkpoint

saved = {"state": None, "ids": [], "step": 0}
if os.path.exists(ckpt):
    with open(ckpt) as f:
        saved = json.load(f)
ids, step = saved["ids"], saved["step"]
# The shortest session the brokers allow, so a killed rank's partitions move soon.
config = {"bootstrap.servers": bootstrap, "group.id": group, "session.timeout.ms": 6000,
          "heartbeat.interval.ms": 500}
loader = kfeed.Loader(config, topic, SCHEMA, 50, until="end", device="cpu",
                      commit_interval_ms=1e12)
if saved["state"] is not None:
    loader.load_state_dict(saved["state"])
log = open(ckpt + ".log", "a", buffering=1)
log.write(f"# resumed at step {step}\\n")
for batch in loader:
    batch_ids = batch["id"].tolist()
    ids += batch_ids
    step += 1
    log.write(" ".join(map(str, batch_ids)) + "\\n")
    if step % int(every) == 0:
        save({"state": loader.state_dict(), "ids": ids, "step": step})
        loader.commit()
    time.sleep(0.05)  # a training step
save({"state": loader.state_dict(), "ids": ids, "step": step})
loader.close()
log.write("# done\\n")
"""


class NotExactlyOnce(AssertionError):
    """The ranks' checkpoints together do not hold every id of the topic exactly once."""


@pytest.mark.xfail(
    raises=NotExactlyOnce, strict=True,
    reason="group mode: a rank's loader state keeps a position for every partition it was ever "
    "assigned, and a partition that comes back to it (after a revoke, or to a rank resumed from "
    "its checkpoint) starts from that position rather than from the group's committed offset, "
    "so it reads again what the other rank trained meanwhile (two runs: 4,000 and 2,357 of "
    "8,000 ids held twice). Commits on revoke also run past the last checkpoint, "
    "so a loss is possible when a partition moves after a kill. See docs/RELIABILITY.md.")
def test_two_ranks_in_a_group_killed_resume_exactly(bootstrap, make_topic, tmp_path) -> None:
    import os

    partitions, n, every = 4, 8000, 5
    topic = make_topic(partitions=partitions, replication=3)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as p:
        ids = np.arange(n)
        p.send(columns(ids), keys=ids)
    script = tmp_path / "rank.py"
    script.write_text(GROUP_RANK)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    group = uuid.uuid4().hex
    ckpts = [tmp_path / f"rank{r}.json" for r in (0, 1)]

    def start(r: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, str(script), bootstrap, topic, group,
                                 str(ckpts[r]), str(every)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def steps(r: int) -> int:
        log = Path(f"{ckpts[r]}.log")
        return log.read_text().count("\n") if log.exists() else 0

    rng = np.random.default_rng(11)
    procs = [start(0), start(1)]
    kills = [0, 0]
    for r in (0, 1, 0, 1, 0, 1):  # both ranks, in turn
        target = steps(r) + int(rng.integers(3, 15))  # a random point, between checkpoints or not
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and procs[r].poll() is None and steps(r) < target:
            time.sleep(0.01)
        if procs[r].poll() is None:
            procs[r].kill()
            procs[r].wait()
            kills[r] += 1
            procs[r] = start(r)  # resumes from its own last checkpoint
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-3000:]
    assert min(kills) >= 2 and sum(kills) >= 5, kills

    # What counts is what the checkpoints hold: a killed run's steps after its
    # last checkpoint are trained again (by it, or by the partition's new owner).
    held = np.zeros(n, np.int64)
    for path in ckpts:
        np.add.at(held, np.array(json.loads(path.read_text())["ids"], np.int64), 1)
    part = np.array([kfeed.partition_for(str(i), partitions) for i in range(n)])
    per_partition = {int(q): {"lost": int((held[part == q] == 0).sum()),
                              "duplicated": int((held[part == q] > 1).sum())}
                     for q in range(partitions)}
    lost, dup = int((held == 0).sum()), int((held > 1).sum())
    report("trainer_crash_two_ranks", samples=n, faults=sum(kills), lost=lost, duplicated=dup,
           kills_per_rank=kills, per_partition=per_partition)
    if (lost, dup) != (0, 0):
        raise NotExactlyOnce(f"{lost} ids lost and {dup} duplicated across the two ranks' "
                             f"checkpoints; per partition {per_partition}")


KILLED_TXN = """
import os, signal, sys, numpy as np, kfeed
from test_faults import SCHEMA, columns
bootstrap, topic, txn = sys.argv[1:4]
p = kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA, transactional_id=txn)
with p.transaction():
    p.send(columns(np.arange(0, 500)))
p._producer.begin_transaction()
p.send(columns(np.arange(500, 1000)))
p._producer.flush(30)  # the open transaction's records are in the log
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_transactions_aborted_or_killed_are_never_visible(bootstrap, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=2, replication=3)
    txn = uuid.uuid4().hex
    script = tmp_path / "killed_txn.py"
    script.write_text(KILLED_TXN)
    env = {"PYTHONPATH": str(Path(__file__).parent)}
    import os

    proc = subprocess.run([sys.executable, str(script), bootstrap, topic, txn],
                          env={**os.environ, **env}, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    # The restarted producer (same transactional id) fences the dead one,
    # which aborts its open transaction; then it aborts one of its own.
    p = kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA, transactional_id=txn)
    with pytest.raises(RuntimeError):
        with p.transaction():
            p.send(columns(np.arange(1000, 1500)))
            p._producer.flush(30)
            raise RuntimeError("aborted on purpose")
    with p.transaction():
        p.send(columns(np.arange(1500, 2000)))
    want = np.r_[np.arange(0, 500), np.arange(1500, 2000)]
    ids = read_until(bootstrap, topic, len(want))
    report("transactions", samples=2000, faults=2, visible_from_aborted=int(
        np.isin(ids, np.r_[np.arange(500, 1500)]).sum()))
    assert np.array_equal(np.sort(ids), want)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_backpressure_keeps_memory_bounded_and_drops_nothing(bootstrap, make_topic) -> None:
    from kfeed.cli import synthetic_columns, synthetic_schema

    schema = synthetic_schema()
    topic = make_topic(partitions=4, replication=3)
    n = 120_000  # 370 MB of samples, produced much faster than the trainer takes them
    # The producer runs in its own process, so RSS below is the trainer's alone.
    producer = subprocess.Popen([sys.executable, "-m", "kfeed", "produce", "--bootstrap-servers",
                                 bootstrap, "--topic", topic, "--synthetic", str(n)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = np.zeros(n, np.int64)
    peak, max_lag, total, base = 0, 0, 0, None
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                      schema, 256, device="cpu", max_wait_ms=200) as ld:
        while total < n:
            ids = next(ld)["id"].numpy()
            np.add.at(seen, ids, 1)
            total += len(ids)
            time.sleep(0.01)  # a slow training step
            if base is None and total >= 20 * 256:
                base = rss_bytes()  # torch, librdkafka and the pool are all set up by now
            if base is not None:
                peak = max(peak, rss_bytes() - base)
            max_lag = max(max_lag, sum(ld.stats()["lag"].values()))
        pool = ld.stats()["pool_bytes"]
    lost, dup = count_ids(np.repeat(np.arange(n), seen), n)
    # librdkafka's pre-fetch queue is capped by queued.max.messages.kbytes
    # (64 MiB for the whole consumer, set explicitly); with fetches in flight
    # and the pool that bounds the growth far below the 370 MB that went through.
    report("backpressure", samples=n, lost=lost, duplicated=dup, peak_rss_growth_mb=round(
        peak / 2**20, 1), max_lag_messages=max_lag, pool_mb=round(pool / 2**20, 1))
    assert producer.wait(60) == 0
    assert (lost, dup) == (0, 0)
    assert max_lag > 0
    assert peak < 200 * 2**20


def test_topic_deleted_mid_stream_is_a_clear_error(bootstrap, make_topic) -> None:
    from confluent_kafka.admin import AdminClient

    from kfeed.cli import synthetic_schema
    from test_loader_kafka import produce

    topic = make_topic(partitions=2, replication=3)
    produce(bootstrap, topic, 0, 2000)
    ld = kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                      synthetic_schema(), 256,
                      device="cpu")
    next(ld)
    admin = AdminClient({"bootstrap.servers": bootstrap})  # must outlive the future
    admin.delete_topics([topic])[topic].result(30)
    t0 = time.monotonic()
    with pytest.raises(kfeed.ConsumeError, match="(?i)unknown topic|unknown partition|not available"):
        for _ in range(100_000):
            next(ld)
    assert time.monotonic() - t0 < 60
    ld.close()


def test_all_brokers_down_for_30s_then_back_resumes_cleanly(bootstrap, make_topic,
                                                            live_cluster) -> None:
    topic = make_topic(partitions=2, replication=3)
    n = 20_000
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as p:
        p.send(columns(np.arange(n // 2)))
    seen = np.zeros(n, np.int64)
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                      SCHEMA, 500, device="cpu", max_wait_ms=100) as ld:
        total = 0
        while total < n // 2:
            ids = next(ld)["id"].numpy()
            np.add.at(seen, ids, 1)
            total += len(ids)
        for node_id in (1, 2, 3):
            cluster.kill_node(live_cluster, node_id)
        time.sleep(30)
        for node_id in (1, 2, 3):
            cluster.start_node(live_cluster, node_id, wait=False)
        for node_id in (1, 2, 3):
            wait_registered(live_cluster, node_id, timeout=120)
        with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as p:
            p.send(columns(np.arange(n // 2, n)))
        while total < n:
            ids = next(ld)["id"].numpy()  # the loader rides out the outage
            np.add.at(seen, ids, 1)
            total += len(ids)
        stall = ld.stats()["longest_wait_s"]
    lost, dup = count_ids(np.repeat(np.arange(n), seen), n)
    report("all_brokers_down_30s", samples=n, faults=3, lost=lost, duplicated=dup,
           longest_wait_s=round(stall, 1))
    assert (lost, dup) == (0, 0)
