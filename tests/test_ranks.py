"""Two ranks (gloo, CPU) over one topic: a static split that ends together."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from test_agreement import run_two_ranks

import kfeed
from kfeed.synthetic import synthetic_columns, synthetic_schema

pytestmark = pytest.mark.integration

WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, kfeed
    from kfeed.synthetic import synthetic_schema
    dist.init_process_group("gloo", init_method="env://")
    bootstrap, topic = sys.argv[1], sys.argv[2]
    loader = kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": "ranks-" + topic}, topic,
                          synthetic_schema(), 256, device="cpu", until="end", assignment="static")
    steps, ids = 0, []
    for batch in loader:
        steps += 1
        ids += batch["id"].tolist()
    loader.close()
    print("RESULT", dist.get_rank(), steps, len(ids), len(set(ids)), flush=True)
    dist.destroy_process_group()
""")


def test_two_ranks_stop_at_the_same_step(bootstrap, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=2)
    # Uneven partitions: rank 0 (partition 0) has 3x the data of rank 1.
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, synthetic_schema(),
                        partitioner=lambda key, n: 0 if int(key) < 3000 else 1) as p:
        ids = np.arange(4000)
        p.send(synthetic_columns(ids), keys=ids)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = run_two_ranks(script, bootstrap, topic)
    # Partition 1 holds 1000 samples: 4 batches (3 of 256 and one of 232).
    assert results[0][0] == results[1][0] == 4
    assert results[1][1] == results[1][2] == 1000
    assert results[0][1] == results[0][2] == 4 * 256
