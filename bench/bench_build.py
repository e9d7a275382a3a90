"""The build stage against its baselines, from memory (no broker), in one run.

Two ratios the loader's pipeline must hold (bench/RESULTS.md, "Build stage"):

- ``shuffled / in order``: a fixed-shape stream (the seeds' 768 float32
  features, label, id) through ``Loader(shuffle=Shuffle(buffer=...))``
  against the same stream through a plain ``Loader``; target >= 0.7x;
- ``Loader(pack=...) / Packer``: token documents through
  ``Loader(pack=Pack(...))`` end to end (decode, order, pack, hand-out)
  against the ``Packer`` alone packing the same documents, already decoded,
  into the same rows; target >= 0.8x. Beside it, ``bare_handover``: the
  least any threaded loader does, as the bound on that ratio here; and the
  same documents one a message, as topics others write hold them.

And, for information, a wide schema: 100 float32 scalar fields against the
same bytes as one ``(100,)`` field (``wide_ratio``).

Both sides of a ratio run interleaved, ``--repeat`` times, and the best
of each is kept. Run: ``python bench/bench_build.py [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import gc
import queue
import threading
import time
from typing import Any

import numpy as np

import kfeed
from kfeed.loader import memory_loader
from kfeed.synthetic import synthetic_columns, synthetic_schema


def start_clock() -> float:
    """The time, once the objects of the runs before are collected.

    A closed loader's objects are freed by the cyclic collector, whose full
    pass (~170 ms) would otherwise land inside whichever run comes next.
    """
    gc.collect()
    return time.perf_counter()


# With --cpu: per stream, the CPU time of the loader's thread and of the
# caller, and the batches, over every run ({name: [thread_s, caller_s, batches]}).
CPU: dict[str, list[float]] = {}


def _drain(loader: kfeed.Loader, cpu: str | None = None) -> int:
    """Every batch of ``loader``; the samples. ``cpu``: the stream's name in ``CPU``."""
    n = batches = 0
    thread_s = 0.0
    clock = None
    caller = time.thread_time()
    with loader:
        for batch in loader:
            n += batch.size
            batches += 1
            if cpu is not None:  # read each batch: the thread is gone after the last
                try:
                    if clock is None:
                        clock = time.pthread_getcpuclockid(loader._feeder.thread.ident)
                    thread_s = time.clock_gettime(clock)
                except OSError:  # it ended (the read's last batches were queued)
                    pass
    if cpu is not None:
        acc = CPU.setdefault(cpu, [0.0, 0.0, 0])
        acc[0] += thread_s
        acc[1] += time.thread_time() - caller
        acc[2] += batches
    return n


def _best_rates(streams: dict[str, tuple[list[bytes], kfeed.Schema, dict[str, Any]]],
                samples: int, repeat: int, cpu: bool = False) -> dict[str, float]:
    """Samples/s of each stream ``{name: (values, schema, Loader kwargs)}`` from memory,
    batches of 256: the best of ``repeat`` runs, the streams interleaved."""
    best = {name: 0.0 for name in streams}
    for _ in range(repeat):
        for name, (values, schema, kw) in streams.items():
            t = start_clock()
            n = _drain(memory_loader(values, schema, 256, device="cpu", until="end", **kw),
                       name if cpu else None)
            best[name] = max(best[name], n / (time.perf_counter() - t))
            assert n == samples
    return best


def shuffle_ratio(samples: int, buffer: int, repeat: int, cpu: bool = False
                  ) -> tuple[float, float]:
    schema = synthetic_schema()
    values = schema.encode_blocks(synthetic_columns(np.arange(samples)), 64)
    best = _best_rates({"order": (values, schema, {}),
                        "shuffled": (values, schema,
                                     {"shuffle": kfeed.Shuffle(buffer=buffer, seed=0)})},
                       samples, repeat, cpu)
    return best["order"], best["shuffled"]


def wide_ratio(samples: int, fields: int, repeat: int) -> tuple[float, float]:
    """Records of ``fields`` float32 scalars against the same bytes as one ``(fields,)`` field.

    A wide tabular schema (a recommender's or a fraud model's features) costs
    per field per batch what a field of many elements costs once: the
    pool's check of a lent slot, the views handed out. Samples/s, best of
    ``repeat``, interleaved.
    """
    rng = np.random.default_rng(0)
    flat = rng.standard_normal((samples, fields)).astype(np.float32)
    wide = kfeed.Schema({f"f{i}": ("float32", ()) for i in range(fields)})
    one = kfeed.Schema({"f": ("float32", (fields,))})
    best = _best_rates(
        {"wide": (wide.encode_blocks({f"f{i}": flat[:, i].copy() for i in range(fields)}, 64),
                  wide, {}),
         "one": (one.encode_blocks({"f": flat}, 64), one, {})}, samples, repeat)
    return best["wide"], best["one"]


def bare_handover(pack: kfeed.Pack, rows: int, flat: np.ndarray, lengths: np.ndarray) -> int:
    """The least a threaded loader does: pack in a thread, hand over, detach; tokens out.

    The ``Packer`` fed the decoded documents packs each batch into the next
    of 3 buffers in turn (one being filled, two ready at most), a queue hands
    it to this thread, which detaches its tensors as the loader's ``next()``
    would. No Kafka, no decode, no ledger, no pool: a bound on the ratio any
    loader that hands batches across threads can reach here.
    """
    packer = kfeed.Packer(pack, rows)
    packer.feed(flat, lengths)
    packer.finish()
    buffers = [packer.empty(like="torch") for _ in range(3)]
    targets = [packer.bind(b) for b in buffers]
    ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
    room = threading.Semaphore(2)

    def fill() -> None:
        i = 0
        while True:
            room.acquire()
            info = packer.next_batch(targets[i % 3])
            ready.put(None if info is None else (buffers[i % 3], info.tokens))
            if info is None:
                return
            i += 1

    thread = threading.Thread(target=fill)
    thread.start()
    tokens = 0
    while (item := ready.get()) is not None:
        room.release()
        _batch = {name: t.detach() for name, t in item[0].items()}
        tokens += item[1]
    thread.join()
    return tokens


def pack_ratio(docs: int, seq_len: int, rows: int, repeat: int, cpu: bool = False
               ) -> tuple[float, float, float, float]:
    schema = kfeed.Schema({"tokens": ("uint16", (None,))})
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, docs).astype(np.int64), 1, 4 * seq_len)
    flat = rng.integers(0, 50000, int(lengths.sum())).astype(np.uint16)
    values = schema.encode_blocks({"tokens": (flat, lengths)}, 64, block_bytes=1 << 20)
    # As a topic others write holds them: one document a message.
    singles = schema.encode_raw({"tokens": (flat, lengths)})
    pack = kfeed.Pack(seq_len=seq_len, eos_id=65535, pad_id=0)
    tokens_total = int(lengths.sum()) + docs  # with an EOS each
    best = {"packer": 0.0, "loader": 0.0, "bare": 0.0, "singles": 0.0}
    for _ in range(repeat):
        t = start_clock()
        bare_handover(pack, rows, flat, lengths)
        best["bare"] = max(best["bare"], tokens_total / (time.perf_counter() - t))
        t = start_clock()
        packer = kfeed.Packer(pack, rows)
        out = packer.empty(like="numpy")
        target = packer.bind(out)
        packer.feed(flat, lengths)
        packer.finish()
        while packer.next_batch(target) is not None:
            pass
        best["packer"] = max(best["packer"], tokens_total / (time.perf_counter() - t))
        t = start_clock()
        _drain(memory_loader(values, schema, rows, device="cpu", until="end", pack=pack),
               "packed" if cpu else None)
        best["loader"] = max(best["loader"], tokens_total / (time.perf_counter() - t))
        t = start_clock()
        _drain(memory_loader(singles, schema, rows, device="cpu", until="end", pack=pack,
                             format="raw"))
        best["singles"] = max(best["singles"], tokens_total / (time.perf_counter() - t))
    return best["packer"], best["loader"], best["bare"], best["singles"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--samples", type=int, default=50_000)
    p.add_argument("--buffer", type=int, default=10_000)
    p.add_argument("--docs", type=int, default=20_000)
    p.add_argument("--cpu", action="store_true",
                   help="also print the CPU time a batch of the loader's thread and the caller")
    args = p.parse_args()
    order, shuffled = shuffle_ratio(args.samples, args.buffer, args.repeat, args.cpu)
    print(f"| fixed-shape stream, shuffle(buffer={args.buffer}) | {shuffled:,.0f} samples/s | "
          f"in order {order:,.0f} samples/s | {shuffled / order:.2f}x (target >= 0.7x) |")
    packer, loader, bare, singles = pack_ratio(args.docs, 2048, 8, args.repeat, args.cpu)
    print(f"| Loader(pack=Pack(seq_len=2048)), [8, 2048] rows | {loader / 1e6:,.1f} M tokens/s | "
          f"Packer alone {packer / 1e6:,.1f} M tokens/s | {loader / packer:.2f}x "
          f"(target >= 0.8x) |")
    print(f"| bare hand-over: the Packer in a thread, 3 buffers, a queue | "
          f"{bare / 1e6:,.1f} M tokens/s | Packer alone | {bare / packer:.2f}x (the bound) |")
    print(f"| Loader(pack=...), one document a message (format=raw) | {singles / 1e6:,.1f} M "
          f"tokens/s | in blocks of 64 | {singles / loader:.2f}x (information) |")
    wide, one = wide_ratio(args.samples * 4, 100, args.repeat)
    print(f"| 100 float32 fields | {wide:,.0f} samples/s | one (100,) field, the same bytes "
          f"{one:,.0f} samples/s | {wide / one:.2f}x (information) |")
    for name, (thread_s, caller_s, batches) in CPU.items():
        print(f"CPU a batch, {name}: loader's thread {thread_s / batches * 1e6:.1f} us, "
              f"caller {caller_s / batches * 1e6:.1f} us ({int(batches)} batches)")


if __name__ == "__main__":
    main()
