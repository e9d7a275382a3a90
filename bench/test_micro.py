"""Micro-benchmarks of the hot path, each against a named baseline in the same run.

The workload is the seeds' record: 768 float32 features, an int64 label and an
int64 id (3,088 bytes).

- block decode: 4,096 records in blocks of 64, into a preallocated 4,096-row
  output, against a memcpy of the same bytes (``np.copyto`` between
  preallocated arrays). Target: >= 0.7x memcpy's bandwidth.
- raw decode: 4,096 one-record messages, against what a naive loader does
  (``np.frombuffer`` + copy per message per field, then ``np.stack``).
  Target: >= 10x.
- partitions_for: 100,000 keys, against a pure-Python port of Java's murmur2.
  Target: >= 20x.

``pytest --benchmark-only bench/`` runs them under pytest-benchmark (each
records bytes and records in ``extra_info``); ``python bench/test_micro.py``
prints a table of medians, ratios and peak traced memory.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from kfeed import Schema, partitions_for

SCHEMA = Schema({"features": ("float32", (768,)), "label": ("int64", ()), "id": ("int64", ())})
RECORDS = 4096
BLOCK_RECORDS = 64
NUM_KEYS = 100_000
NUM_PARTITIONS = 48
PAYLOAD = RECORDS * SCHEMA.record_size  # 12,648,448 bytes

TARGETS = {"block": 0.7, "raw": 10.0, "partition": 20.0}


# -- workload ----------------------------------------------------------------


def columns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "features": rng.standard_normal((RECORDS, 768), dtype=np.float32),
        "label": rng.integers(0, 1000, RECORDS, dtype=np.int64),
        "id": np.arange(RECORDS, dtype=np.int64),
    }


def keys() -> list[bytes]:
    return [b"user-%08d" % i for i in range(NUM_KEYS)]


# -- kfeed and its baselines -------------------------------------------------


def kfeed_decode(values: list[bytes], target, fmt: str) -> int:
    result = SCHEMA.decode_into(values, target, format=fmt)
    assert result.rows == RECORDS and not result.bad
    return result.rows


def memcpy(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src)


def naive_raw(values: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    features, labels, ids = [], [], []
    for v in values:
        features.append(np.frombuffer(v, np.float32, 768, 0).copy())
        labels.append(np.frombuffer(v, np.int64, 1, 3072).copy())
        ids.append(np.frombuffer(v, np.int64, 1, 3080).copy())
    return np.stack(features), np.concatenate(labels), np.concatenate(ids)


def python_murmur2(data: bytes) -> int:
    """Java's Utils.murmur2, ported line by line (the baseline, not kfeed's code)."""
    length = len(data)
    m = 0x5BD1E995
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail, rest = length & ~3, length % 4
    if rest >= 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def python_partitions(ks: list[bytes], n: int) -> list[int]:
    return [(python_murmur2(k) & 0x7FFFFFFF) % n for k in ks]


# -- fixtures shared by both modes -------------------------------------------


class Workload:
    """Inputs and preallocated outputs, built once."""

    def __init__(self) -> None:
        cols = columns()
        self.columns = cols
        self.blocks = SCHEMA.encode_blocks(cols, BLOCK_RECORDS)
        self.raws = SCHEMA.encode_raw(cols)
        self.out = {name: np.zeros_like(a) for name, a in cols.items()}
        self.target = SCHEMA.bind(self.out)
        self.src = np.frombuffer(b"".join(self.raws), np.uint8).copy()
        self.dst = np.zeros_like(self.src)
        self.keys = keys()
        assert self.src.nbytes == PAYLOAD


def check(w: Workload) -> None:
    """Each pair computes the same thing, so the timings compare like with like."""
    kfeed_decode(w.blocks, w.target, "block")
    for name, a in w.columns.items():
        assert np.array_equal(w.out[name], a)
    for got, name in zip(naive_raw(w.raws), ("features", "label", "id")):
        assert np.array_equal(got, w.columns[name])
    assert partitions_for(w.keys[:1000], NUM_PARTITIONS).tolist() == python_partitions(
        w.keys[:1000], NUM_PARTITIONS
    )


# -- pytest-benchmark --------------------------------------------------------

@functools.cache
def _workload() -> Workload:
    w = Workload()
    check(w)
    return w


def _info(benchmark, group: str, **info) -> None:
    benchmark.group = group
    benchmark.extra_info.update(info)


def test_block_decode(benchmark):
    w = _workload()
    _info(benchmark, "block decode", bytes=PAYLOAD, records=RECORDS, block_records=BLOCK_RECORDS,
          baseline="memcpy", target=f">= {TARGETS['block']}x memcpy bandwidth")
    benchmark(kfeed_decode, w.blocks, w.target, "block")


def test_block_decode_baseline_memcpy(benchmark):
    w = _workload()
    _info(benchmark, "block decode", bytes=PAYLOAD, records=RECORDS)
    benchmark(memcpy, w.dst, w.src)


def test_raw_decode(benchmark):
    w = _workload()
    _info(benchmark, "raw decode", bytes=PAYLOAD, records=RECORDS, messages=RECORDS,
          baseline="naive numpy loader", target=f">= {TARGETS['raw']}x")
    benchmark(kfeed_decode, w.raws, w.target, "raw")


def test_raw_decode_baseline_naive_numpy(benchmark):
    w = _workload()
    _info(benchmark, "raw decode", bytes=PAYLOAD, records=RECORDS, messages=RECORDS)
    benchmark(naive_raw, w.raws)


def test_partitions_for(benchmark):
    w = _workload()
    _info(benchmark, "partitions_for", keys=NUM_KEYS, num_partitions=NUM_PARTITIONS,
          baseline="pure-Python murmur2", target=f">= {TARGETS['partition']}x")
    benchmark(partitions_for, w.keys, NUM_PARTITIONS)


def test_partitions_for_baseline_python(benchmark):
    w = _workload()
    _info(benchmark, "partitions_for", keys=NUM_KEYS, num_partitions=NUM_PARTITIONS)
    benchmark.pedantic(python_partitions, (w.keys, NUM_PARTITIONS), rounds=3, iterations=1)


# -- script mode -------------------------------------------------------------


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm: first-touch page faults, caches
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_traced(fn: Callable[[], object]) -> int:
    """Peak bytes that Python and numpy allocate during one call."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def cpu_and_memory() -> str:
    """``"N cores, M GiB memory, CPU model"`` of this machine."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = "?"
    try:
        mem = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    return f"{os.cpu_count()} cores, {mem} memory, {model}"


def machine() -> str:
    import torch

    return (f"{cpu_and_memory()}; Python {platform.python_version()}, numpy {np.__version__}, "
            f"torch {torch.__version__}")


def main() -> int:
    w = Workload()
    check(w)
    cases = [
        (
            "block decode, 4096 rec in 64/block",
            "memcpy (np.copyto)",
            lambda: kfeed_decode(w.blocks, w.target, "block"),
            lambda: memcpy(w.dst, w.src),
            "block",
            51,
        ),
        (
            "raw decode, 4096 messages",
            "naive numpy loader",
            lambda: kfeed_decode(w.raws, w.target, "raw"),
            lambda: naive_raw(w.raws),
            "raw",
            21,
        ),
        (
            "partitions_for, 100k keys",
            "pure-Python murmur2",
            lambda: partitions_for(w.keys, NUM_PARTITIONS),
            lambda: python_partitions(w.keys, NUM_PARTITIONS),
            "partition",
            5,
        ),
    ]
    print(f"machine: {machine()}")
    print(f"payload: {RECORDS} records x {SCHEMA.record_size} B = {PAYLOAD / 1e6:.2f} MB; "
          "medians of repeated runs; peak = tracemalloc peak of one call\n")
    print("| case | kfeed | baseline | ratio | target | kfeed peak | baseline peak |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for name, base_name, ours, theirs, key, repeat in cases:
        t_ours = median_seconds(ours, repeat)
        t_base = median_seconds(theirs, repeat)
        ratio = t_base / t_ours
        target = TARGETS[key]
        failed += ratio < target
        ours_text, base_text = f"{t_ours * 1e3:.3f} ms", f"{base_name}: {t_base * 1e3:.3f} ms"
        if key != "partition":
            ours_text += f" ({PAYLOAD / t_ours / 1e9:.2f} GB/s)"
            base_text += f" ({PAYLOAD / t_base / 1e9:.2f} GB/s)"
        print(
            f"| {name} | {ours_text} | {base_text} | {ratio:.2f}x "
            f"| >= {target}x {'ok' if ratio >= target else 'MISSED'} "
            f"| {peak_traced(ours) / 1024:.1f} KiB | {peak_traced(theirs) / 1024:.1f} KiB |"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
