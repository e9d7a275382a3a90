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


EPOCHS_WORKER = textwrap.dedent("""
    import json, sys, threading, time, numpy as np, torch.distributed as dist, kfeed
    from kfeed.synthetic import synthetic_columns, synthetic_schema
    dist.init_process_group("gloo", init_method="env://")
    bootstrap, topic, folder, shuffled = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    rank = dist.get_rank()
    config = {"bootstrap.servers": bootstrap, "group.id": "epochs-" + topic}
    # In a group each epoch begins with rebalances, while a rank may have read its
    # records whole already: nothing may be lost or repeated, and no rank hang.
    shuffle = kfeed.Shuffle(buffer=300, seed=0) if shuffled == "1" else None
    loader = kfeed.Loader(config, topic, synthetic_schema(), 100, device="cpu", until="end",
                          epochs=2, shuffle=shuffle)

    def more():  # records keep coming while the ranks start: not in the window
        with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, synthetic_schema()) as p:
            for k in range(20):
                ids = np.arange(10000 + 100 * k, 10100 + 100 * k)
                p.send(synthetic_columns(ids), keys=ids)
                p.flush()
                time.sleep(0.05)

    if rank == 0:
        writer = threading.Thread(target=more)
        writer.start()
    else:
        time.sleep(1.0)  # so that a window of its own would end elsewhere
    for epoch in range(2):
        ids = [i for batch in loader for i in batch["id"].tolist()]
        with open(f"{folder}/rank{rank}-epoch{epoch}.json", "w") as f:
            json.dump(ids, f)
    window = loader.state_dict()["epochs"]["window"]
    loader.close()
    if rank == 0:
        writer.join()
    print("RESULT", rank, sum(o for _t, _p, o in window["until"]),
          sum(o for _t, _p, o in window["start"]), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("shuffled", ["0", "1"], ids=["in order", "shuffled"])
def test_ranks_in_a_group_read_one_window_every_epoch(bootstrap, make_topic, tmp_path,
                                                      shuffled) -> None:
    topic = make_topic(partitions=4)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, synthetic_schema()) as p:
        ids = np.arange(4000)
        p.send(synthetic_columns(ids), keys=ids)
    script = tmp_path / "worker.py"
    script.write_text(EPOCHS_WORKER)
    results = run_two_ranks(script, bootstrap, topic, str(tmp_path), shuffled)
    assert results[0] == results[1]  # rank 0's window, on both ranks
    import json

    epochs: list[set[int]] = []
    for epoch in range(2):
        got = [json.loads((tmp_path / f"rank{r}-epoch{epoch}.json").read_text())
               for r in range(2)]
        both = got[0] + got[1]
        assert len(both) == len(set(both))  # each record once in the epoch
        epochs.append(set(both))
        # The ranks stop at the same step (DistributedSampler's drop_last): a rank may
        # leave some of its records to the window's next reading.
        assert len(both) >= 4000 - 2 * 4 * 100
    # Both epochs read the one window: records written after it was resolved are in neither.
    last = max(epochs[0] | epochs[1])
    assert last < 12000 - 100 * 3  # the writer went on for a second after rank 0 resolved it


GROUP_WORKER = textwrap.dedent("""
    import sys, torch.distributed as dist, kfeed
    from kfeed.synthetic import synthetic_schema
    dist.init_process_group("gloo", init_method="env://")
    bootstrap, topics, strategy = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
    config = {"bootstrap.servers": bootstrap, "group.id": "group-ranks-" + topics[0]}
    if strategy != "default":
        config["partition.assignment.strategy"] = strategy
    loader = kfeed.Loader(config, topics, synthetic_schema(), 100, device="cpu", until="end")
    try:
        ids = [i for batch in loader for i in batch["id"].tolist()]
        print("RESULT", dist.get_rank(), len(ids), flush=True)
    except kfeed.ConfigError as e:
        print(e, file=sys.stderr)
        print("RESULT", dist.get_rank(), -1, flush=True)
    loader.close()
    dist.destroy_process_group()
""")


def test_ranks_of_a_group_that_one_would_be_left_without_a_partition_refuse_together(
        bootstrap, make_topic, tmp_path) -> None:
    # The rank left without a partition never asked the bounded epoch's question,
    # and the other waited on it until gloo's timeout (30 minutes).
    one, other = make_topic(partitions=1), make_topic(partitions=1)
    for topic, first in ((one, 0), (other, 1000)):
        with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, synthetic_schema()) as p:
            p.send(synthetic_columns(np.arange(first, first + 300)))
    script = tmp_path / "group_worker.py"
    script.write_text(GROUP_WORKER)
    # One partition for two ranks; two topics of one, which the range assignor
    # (the default) deals apart, both to one rank.
    assert run_two_ranks(script, bootstrap, one, "default") == {0: (-1,), 1: (-1,)}
    assert run_two_ranks(script, bootstrap, f"{one},{other}", "default") == {0: (-1,), 1: (-1,)}
    # Spread by roundrobin, each rank reads one topic to its end.
    assert run_two_ranks(script, bootstrap, f"{other},{one}", "roundrobin") == {0: (300,),
                                                                               1: (300,)}
