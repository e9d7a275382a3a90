"""prefetch="auto" against hand-picked queue depths, from memory (no broker), in one run.

The training loop here comes in bursts, as loops with evaluation, logging or
checkpoint pauses do: ``--burst`` steps that take no time, then a pause of
``--pause-ms``. A loader that reads ahead far enough fills its queue during
the pause and the burst never waits; a shallow queue makes the burst wait
for each batch. Each contender runs ``--seconds``; the figure kept is its
throughput over the window after ``--settle`` seconds (bench/RESULTS.md,
"Tuning"). Targets (issue 14): "auto" started from prefetch=2 reaches at least
0.9x the best fixed depth within 10 s, and the loader's memory stays under
``max_memory_bytes``.

Run: ``python bench/bench_tuning.py [--seconds 15 --settle 10]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import kfeed
from kfeed.loader import memory_loader

SCHEMA = kfeed.Schema({"features": ("float32", (768,)), "id": ("int64", ())})
BATCH = 1024


def values(records: int, repeat: int) -> list[bytes]:
    """Block messages of ``records`` records, the same ones ``repeat`` times (little memory)."""
    cols = {"features": np.random.default_rng(0).standard_normal((records, 768), np.float32),
            "id": np.arange(records, dtype=np.int64)}
    return list(SCHEMA.encode_blocks(cols, block_records=64)) * repeat


def run(vals: list[bytes], prefetch: int | str, args: argparse.Namespace) -> dict[str, Any]:
    cap = args.max_memory_mb << 20
    with memory_loader(vals, SCHEMA, BATCH, device="cpu", until="end", prefetch=prefetch,
                       max_memory_bytes=cap) as loader:
        it = iter(loader)
        next(it)
        t0 = time.monotonic()
        samples = settled = 0
        peak = 0
        settle_at = None
        while (now := time.monotonic()) - t0 < args.seconds:
            if settle_at is None and now - t0 >= args.settle:
                settle_at, settled = now, samples
            for _ in range(args.burst):
                samples += next(it).size
            peak = max(peak, loader.stats()["pool_bytes"])
            time.sleep(args.pause_ms / 1000)
        end = time.monotonic()
        stats = loader.stats()
        tuner = loader._tuner
        changes = [(round(t - t0, 1), old, new) for t, old, new, _ in tuner.changes] \
            if tuner is not None else []
    window = end - settle_at if settle_at is not None else 0.0
    return {"prefetch": prefetch, "all": samples / (end - t0),
            "settled": (samples - settled) / window if window else 0.0,
            "depth": stats["prefetch"], "peak_bytes": peak, "cap": cap,
            "stall": stats["stall_fraction"], "changes": changes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--settle", type=float, default=10.0)
    p.add_argument("--burst", type=int, default=60, help="steps without a pause")
    p.add_argument("--pause-ms", type=float, default=100.0)
    p.add_argument("--max-memory-mb", type=int, default=512)
    p.add_argument("--depths", default="1,2,4,8,16,32,64")
    args = p.parse_args()
    vals = values(20_000, 3000)
    fixed = [run(vals, int(d), args) for d in args.depths.split(",")]
    auto = run(vals, "auto", args)
    best = max(fixed, key=lambda r: r["settled"])
    print(f"Bursts of {args.burst} steps, then {args.pause_ms:g} ms of pause; batches of "
          f"{BATCH} x {SCHEMA.record_size} B from memory; max_memory_bytes = "
          f"{args.max_memory_mb} MiB; throughput over {args.settle:g}-{args.seconds:g} s.\n")
    print("| prefetch | samples/s after settling | samples/s overall | stall | final depth "
          "| peak pool memory (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in [*fixed, auto]:
        print(f"| {r['prefetch']} | {r['settled']:,.0f} | {r['all']:,.0f} | "
              f"{100 * r['stall']:.1f}% | {r['depth']} | {r['peak_bytes'] / 2**20:.0f} |")
    print(f"\nauto / best fixed (prefetch={best['prefetch']}) after {args.settle:g} s: "
          f"{auto['settled'] / best['settled']:.2f}x (target >= 0.9x); auto's peak memory "
          f"{auto['peak_bytes'] / 2**20:.0f} MiB of the {args.max_memory_mb} MiB cap; its "
          f"decisions (s, from, to): {auto['changes']}")


if __name__ == "__main__":
    main()
