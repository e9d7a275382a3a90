"""Each Loader(output=...) against output="torch", on the CPU, from memory, in one run.

The figures for bench/RESULTS.md ("Outputs"): the same block-format
messages drained by a loader of each output, ``--repeat`` times
interleaved, the best of each kept, and its rate against torch's. Two
record shapes: the seeds' rows (768 float32 features, an int64 label and
id; batches of 256) and small rows (16 float32 features and an int64 id;
batches of 4096), where a batch's per-batch cost weighs most. JAX runs
with 64-bit types on (the int64 fields stay int64, no copy).

Run: ``python bench/bench_outputs.py [--repeat 5] [--samples 200000]``.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import kfeed
from kfeed.synthetic import synthetic_columns, synthetic_schema

OUTPUTS = ("torch", "numpy", "jax", "arrow")


def drain(values: list[bytes], schema: kfeed.Schema, batch_size: int, output: str) -> int:
    loader = kfeed.Loader(None, "memory", schema, batch_size, source=kfeed.MemorySource(values),
                          device="cpu", until="end", output=output)
    n = 0
    with loader:
        for batch in loader:
            n += batch.num_rows if output == "arrow" else batch.size
    return n


def rates(values: list[bytes], schema: kfeed.Schema, batch_size: int, repeat: int
          ) -> dict[str, float]:
    best = dict.fromkeys(OUTPUTS, 0.0)
    for _ in range(repeat):
        for output in OUTPUTS:
            t = time.perf_counter()
            n = drain(values, schema, batch_size, output)
            best[output] = max(best[output], n / (time.perf_counter() - t))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--samples", type=int, default=200_000)
    args = ap.parse_args()
    jax.config.update("jax_enable_x64", True)

    rows = synthetic_schema()
    small = kfeed.Schema({"x": ("float32", (16,)), "id": ("int64", ())})
    ids = np.arange(args.samples)
    cases = [
        ("rows (768 float32), batch 256", rows,
         rows.encode_blocks(synthetic_columns(ids), 64), 256),
        ("small (16 float32), batch 4096", small,
         small.encode_blocks({"x": np.ones((len(ids), 16), np.float32), "id": ids}, 512), 4096),
    ]
    for name, schema, values, batch_size in cases:
        best = rates(values, schema, batch_size, args.repeat)
        line = "  ".join(f"{o} {best[o]:12,.0f}/s ({best[o] / best['torch']:.2f}x)"
                         for o in OUTPUTS)
        print(f"{name}: {line}")


if __name__ == "__main__":
    main()
