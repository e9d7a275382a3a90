"""A three-topic mixture against one topic, from memory (no broker), in one run.

Two figures for bench/RESULTS.md ("Mixtures"):

- ``mixture / single``: the same records read as one topic of three
  partitions, and as three topics of one partition each holding 60%, 30%
  and 10% of them, mixed ``Mix({a: .6, b: .3, c: .1})``, so both read every
  record at the same total rate. Fixed-shape rows (the seeds' 768 float32
  features) and packed token documents (``pack=Pack(2048)``). Target >= 0.9x.
- proportions: ``--records`` (default 1M) small records mixed, each source's
  share against its weight, and the largest deviation from ``n * weight``
  seen in any window of consecutive records.

Both sides of a ratio run interleaved, ``--repeat`` times, and the best of
each is kept. Run: ``python bench/bench_mix.py [--repeat 3] [--records 1000000]``.

With ``--bootstrap HOST:PORT`` the two ratios are measured against that
Kafka instead: the same messages are written once to one topic of three
partitions and to three topics of one partition, and each loader reads
them in a group of its own, from the earliest offset to the end.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import numpy as np

import kfeed
from bench_build import _drain, start_clock
from kfeed.synthetic import synthetic_columns, synthetic_schema

WEIGHTS = {"a": 0.6, "b": 0.3, "c": 0.1}


def _split(values: list[bytes]) -> tuple[dict[Any, list[bytes]], dict[Any, list[bytes]]]:
    """The same messages as one topic of 3 partitions, and as 3 topics in the weights' shares."""
    single = {("one", p): values[p::3] for p in range(3)}
    cuts = np.cumsum([int(len(values) * w) for w in WEIGHTS.values()])[:-1]
    mixed = {(t, 0): list(part) for t, part in zip(WEIGHTS, np.split(np.array(values, object),
                                                                     cuts), strict=True)}
    return single, mixed


def _write(bootstrap: str, parts: dict[Any, list[bytes]]) -> dict[Any, str]:
    """``parts`` ({(topic, partition): values}) written to new topics; their names, by topic."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    run = uuid.uuid4().hex[:8]
    names = {t: f"mix-{t}-{run}" for t, _p in parts}
    counts = {t: 1 + max(p for t_, p in parts if t_ == t) for t in names}
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(names[t], n, 1) for t, n in counts.items()]).values():
        f.result()
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                         "batch.size": 1 << 20, "message.max.bytes": 1 << 24})
    for (t, p), values in parts.items():
        for v in values:
            while True:
                try:
                    producer.produce(names[t], v, partition=p)
                    break
                except BufferError:
                    producer.poll(0.1)
    if producer.flush(120):
        raise RuntimeError("messages not delivered")
    return names


def ratio(values: list[bytes], schema: kfeed.Schema, batch_size: int, repeat: int,
          bootstrap: str | None = None, **kwargs: Any) -> tuple[float, float, int]:
    single, mixed = _split(values)
    if bootstrap is not None:
        one, three = _write(bootstrap, single), _write(bootstrap, mixed)
    best = {"single": 0.0, "mixture": 0.0}
    counts = {}
    for _ in range(repeat):
        for name in best:
            if name == "single":
                topics: Any = "one" if bootstrap is None else one["one"]
                source = kfeed.MemorySource(single)
            else:
                topics = kfeed.Mix(WEIGHTS if bootstrap is None else
                                   {three[t]: w for t, w in WEIGHTS.items()},
                                   seed=0, exhausted="renormalize")
                source = kfeed.MemorySource(mixed)
            if bootstrap is None:
                loader = kfeed.Loader(None, topics, schema, batch_size, source=source,
                                      device="cpu", until="end", **kwargs)
            else:
                config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
                loader = kfeed.Loader(config, topics, schema, batch_size, device="cpu",
                                      until="end", start="earliest", **kwargs)
            t = start_clock()
            n = _drain(loader)
            best[name] = max(best[name], n / (time.perf_counter() - t))
            counts[name] = n
    assert counts["single"] == counts["mixture"], counts
    return best["single"], best["mixture"], counts["single"]


def proportions(records: int) -> dict[str, Any]:
    schema = kfeed.Schema({"id": ("int64", ())})
    values = {}
    for k, (t, w) in enumerate(WEIGHTS.items()):
        n = int(records * w) + 1000
        values[(t, 0)] = schema.encode_blocks({"id": np.arange(n) + k * 10**9}, 256)
    loader = kfeed.Loader(None, kfeed.Mix(WEIGHTS, seed=0), schema, 4096,
                          source=kfeed.MemorySource(values), device="cpu", until="end")
    got = []
    with loader:
        for batch in loader:
            got.append(batch["id"].numpy() // 10**9)
            if sum(len(g) for g in got) >= records:
                break
    src = np.concatenate(got)[:records]
    out: dict[str, Any] = {"records": len(src)}
    for k, (t, w) in enumerate(WEIGHTS.items()):
        prefix = np.concatenate([[0], np.cumsum(src == k)]) - np.arange(len(src) + 1) * w
        out[t] = {"weight": w, "share": float((src == k).mean()),
                  "largest window deviation": float(prefix.max() - prefix.min())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--documents", type=int, default=60_000)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--bootstrap", default=None, help="measure against this Kafka")
    args = ap.parse_args()

    schema = synthetic_schema()
    rows = schema.encode_blocks(synthetic_columns(np.arange(args.samples)), 64)
    one, mix, n = ratio(rows, schema, 256, args.repeat, args.bootstrap)
    print(f"rows    ({n} x 768 float32): single {one:12,.0f} samples/s  mixture {mix:12,.0f}"
          f"  ratio {mix / one:.2f}x (target >= 0.9)")

    tokens = kfeed.Schema({"tokens": ("int32", (None,))})
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(6.0, 1.0, args.documents).astype(np.int64) + 1, 16384)
    docs = [rng.integers(3, 50000, n_, dtype=np.int32) for n_ in lengths]
    values = tokens.encode_blocks({"tokens": docs}, 16)
    one, mix, n = ratio(values, tokens, 8, args.repeat, args.bootstrap,
                        pack=kfeed.Pack(2048, eos_id=2))
    print(f"packed  ({len(docs)} documents, {int(lengths.sum()):,} tokens): single {one:10,.0f} "
          f"rows/s  mixture {mix:10,.0f}  ratio {mix / one:.2f}x (target >= 0.9)")

    t = start_clock()
    props = proportions(args.records)
    print(f"proportions over {props.pop('records'):,} records "
          f"({time.perf_counter() - t:.1f} s):")
    for topic, p in props.items():
        print(f"  {topic}: weight {p['weight']:.2f}  share {p['share']:.6f}  "
              f"largest deviation in any window {p['largest window deviation']:.3f} records")


if __name__ == "__main__":
    main()
