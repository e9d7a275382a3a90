"""Token streams against a real Apache Kafka: packed (and shuffled) batches survive kills.

A trainer process packs documents from a topic, appends every batch it is
handed (tokens, position_ids, doc_ids) to a log, and checkpoints its loader
state with the log's length every few steps. It is SIGKILLed at random
points and resumed from its last checkpoint each time, the log cut back to
the checkpoint. The log must equal that of an uninterrupted run, byte for
byte: nothing before a checkpoint comes again, nothing after it is lost, and
a document cut by a batch boundary continues at the right token.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import kfeed

pytestmark = pytest.mark.integration

SCHEMA = kfeed.Schema({"tokens": ("int32", (None,))})
EOS = 100_000
SEQ_LEN, ROWS = 128, 4

TRAINER = """
import os, sys, numpy as np, torch, kfeed
bootstrap, topic, ckpt, log, shuffle, group = sys.argv[1:7]
schema = kfeed.Schema({"tokens": ("int32", (None,))})
loader = kfeed.Loader(
    {"bootstrap.servers": bootstrap, "group.id": group}, topic, schema, %(rows)d,
    device="cpu", until="end", assignment="static",
    pack=kfeed.Pack(seq_len=%(seq_len)d, eos_id=%(eos)d, pad_id=-1),
    shuffle=kfeed.Shuffle(buffer=int(shuffle), seed=5) if int(shuffle) else None)
size = 0
if os.path.exists(ckpt):
    saved = torch.load(ckpt, weights_only=False)
    loader.load_state_dict(saved["loader"])
    size = saved["log_bytes"]
with open(log, "r+b" if os.path.exists(log) else "wb") as f:
    f.truncate(size)
    f.seek(size)
    for step, batch in enumerate(loader, 1):
        f.write(np.int32(batch.size).tobytes())
        for name in ("tokens", "position_ids", "doc_ids"):
            f.write(batch[name].numpy().astype(np.int32).tobytes())
        if step %% 5 == 0:
            f.flush()
            torch.save({"loader": loader.state_dict(), "log_bytes": f.tell()}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
loader.close()
""" % {"rows": ROWS, "seq_len": SEQ_LEN, "eos": EOS}


def make_docs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(200), 0.9, size=n).astype(int), 0, 3000)
    return [rng.integers(1, 50_000, size=int(k), dtype=np.int32) for k in lengths]


def trainer(bootstrap: str, topic: str, ckpt: Path, log: Path, shuffle: int) -> list[str]:
    # One group per series of runs: a resumed run's state must win over the
    # offsets its killed predecessors committed.
    return [sys.executable, "-c", TRAINER, bootstrap, topic, str(ckpt), str(log), str(shuffle),
            f"kfeed-tokens-{ckpt.stem}"]


def log_documents(data: bytes) -> Counter:
    """The documents in a log of batches (rows, then tokens, position_ids, doc_ids)."""
    words = np.frombuffer(data, np.int32)
    i, parts = 0, []
    while i < len(words):
        n = int(words[i]) * SEQ_LEN
        tokens, doc_ids = words[i + 1:i + 1 + n], words[i + 1 + 2 * n:i + 1 + 3 * n]
        parts.append(tokens[doc_ids >= 0])
        i += 1 + 3 * n
    stream = np.concatenate(parts)
    pieces = np.split(stream, np.flatnonzero(stream == EOS) + 1)
    return Counter(bytes(p[:-1]) for p in pieces[:-1])


@pytest.mark.parametrize("shuffle", [0, 50], ids=["in-order", "shuffled"])
def test_killed_and_resumed_packing_equals_an_uninterrupted_run_token_for_token(
        bootstrap, make_topic, tmp_path, shuffle) -> None:
    from test_faults import report

    topic = make_topic(partitions=1)  # one partition: the uninterrupted order is fixed
    docs = make_docs(2500, seed=shuffle)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA, block_records=16) as p:
        p.send({"tokens": docs})

    ref_log = tmp_path / "ref.bin"
    done = subprocess.run(trainer(bootstrap, topic, tmp_path / "ref.pt", ref_log, shuffle),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    reference = ref_log.read_bytes()
    assert log_documents(reference) == Counter(bytes(d) for d in docs if len(d))

    ckpt, log = tmp_path / "ck.pt", tmp_path / "run.bin"
    batch_bytes = 4 + 3 * ROWS * SEQ_LEN * 4
    rng = np.random.default_rng(shuffle + 1)
    kills = 0
    for _ in range(5):
        before = log.stat().st_size if log.exists() else 0
        proc = subprocess.Popen(trainer(bootstrap, topic, ckpt, log, shuffle),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        target = before + int(rng.integers(3, 60)) * batch_bytes  # between checkpoints or on one
        deadline = time.monotonic() + 60
        while (time.monotonic() < deadline and proc.poll() is None
               and (not log.exists() or log.stat().st_size < target)):
            time.sleep(0.005)
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.wait()
    done = subprocess.run(trainer(bootstrap, topic, ckpt, log, shuffle),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    resumed = log.read_bytes()
    same = resumed == reference
    report(f"token_stream_kills_{'shuffled' if shuffle else 'in_order'}", documents=len(docs),
           tokens=int(sum(len(d) for d in docs)), faults=kills, batches=len(reference) // batch_bytes,
           equal_to_uninterrupted=same)
    assert kills == 5
    assert len(resumed) == len(reference)
    assert same
