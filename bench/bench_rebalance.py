"""A member joins a group mid-stream: how long until it reads, and how long the other waits.

For each group protocol kfeed supports (``kfeed.sources.group_protocol``):
eager (classic, range), cooperative (classic, cooperative-sticky) and
consumer (Kafka 4's KIP-848 protocol), loader A streams a 4-partition topic
with a 20 ms step; after 20 batches loader B joins the same group. Measured:

- ``join_s``: from B's first ``next()`` to its first batch;
- ``a_stall_s``: A's longest wait in ``next()`` from B's start on (the
  rebalance's cost to the member already reading);
- ``lost`` / ``repeated``: ids missing or read twice (must be 0 / 0).

Needs a broker (``KFEED_BOOTSTRAP``, e.g. from ``kfeed cluster status``).
Run: ``python bench/bench_rebalance.py [--repeat 3] [--write]``; ``--write``
puts the table in bench/RESULTS.md under "Group protocols".
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from pathlib import Path

import numpy as np

import kfeed
from kfeed.synthetic import synthetic_columns, synthetic_schema

PROTOCOLS = {
    "eager": {"group.protocol": "classic", "partition.assignment.strategy": "range"},
    "cooperative": {"group.protocol": "classic",
                    "partition.assignment.strategy": "cooperative-sticky"},
    "consumer": {"group.protocol": "consumer"},
}
SCHEMA = synthetic_schema()
N = 16_000


def one_run(bootstrap: str, topic: str, extra: dict[str, str]) -> dict[str, float]:
    group = f"kfeed-bench-{uuid.uuid4().hex}"
    config = {"bootstrap.servers": bootstrap, "group.id": group, **extra}
    ids: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    a_reading, b_reading = threading.Event(), threading.Event()
    out: dict[str, float] = {}

    def member(name: str) -> None:
        with kfeed.Loader(config, topic, SCHEMA, 64, device="cpu", until="end") as ld:
            it, i, longest = iter(ld), 0, 0.0
            t0 = time.monotonic()
            while True:
                t = time.monotonic()
                batch = next(it, None)
                waited = time.monotonic() - t
                if batch is None:
                    break
                if name == "b" and i == 0:
                    out["join_s"] = time.monotonic() - t0
                    b_reading.set()
                if name == "a" and "b_started" in out and i > 0:
                    longest = max(longest, waited)
                ids[name].append(batch["id"].numpy().copy())
                if name == "a" and i == 20:
                    a_reading.set()
                # A's steps are slower until B reads, so that A still holds
                # partitions when B gets its share.
                time.sleep(0.02 if b_reading.is_set() else 0.06)
                i += 1
            if name == "a":
                out["a_stall_s"] = longest

    a = threading.Thread(target=member, args=("a",))
    a.start()
    if not a_reading.wait(60):
        raise RuntimeError("loader A read nothing")
    out["b_started"] = time.monotonic()
    b = threading.Thread(target=member, args=("b",))
    b.start()
    a.join(300)
    b.join(300)
    got = np.concatenate(ids["a"] + ids["b"])
    out["lost"] = float(N - len(np.unique(got)))
    out["repeated"] = float(len(got) - len(np.unique(got)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--write", action="store_true", help="record the table in bench/RESULTS.md")
    args = p.parse_args()
    bootstrap = os.environ.get("KFEED_BOOTSTRAP")
    if not bootstrap:
        raise SystemExit("set KFEED_BOOTSTRAP to the brokers (kfeed cluster status prints them)")
    topic = f"kfeed-bench-rebalance-{uuid.uuid4().hex[:8]}"
    kfeed.create_topic({"bootstrap.servers": bootstrap}, topic, partitions=4)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as prod:
        prod.send(synthetic_columns(np.arange(N)), keys=np.arange(N))
    rows = []
    for name, extra in PROTOCOLS.items():
        runs = [one_run(bootstrap, topic, extra) for _ in range(args.repeat)]
        join = [r["join_s"] for r in runs]
        stall = [r["a_stall_s"] for r in runs]
        row = (f"| {name} | {statistics.median(join):.2f} ({min(join):.2f}-{max(join):.2f}) | "
               f"{statistics.median(stall):.2f} ({min(stall):.2f}-{max(stall):.2f}) | "
               f"{int(sum(r['lost'] for r in runs))} / {int(sum(r['repeated'] for r in runs))} |")
        print(row, flush=True)
        rows.append(row)
    table = ("| protocol | join to first batch, s: median (min-max) | "
             "reading member's longest wait, s | lost / repeated |\n|---|---|---|---|\n"
             + "\n".join(rows) + "\n")
    print(table)
    if args.write:
        path = Path(__file__).with_name("RESULTS.md")
        text = path.read_text()
        head = "## Group protocols\n"
        block = (f"{head}\n`python bench/bench_rebalance.py --repeat {args.repeat}` against the "
                 "3-node test cluster (broker defaults: 3 s classic heartbeats, 5 s consumer-"
                 "protocol heartbeats), 16,000 samples in 4 partitions, a 20 ms step:\n\n"
                 + table)
        if head in text:
            start = text.index(head)
            end = text.find("\n## ", start + len(head))
            text = text[:start] + block + (text[end:] if end >= 0 else "")
        else:
            text = text.rstrip() + "\n\n" + block
        path.write_text(text)


if __name__ == "__main__":
    main()
