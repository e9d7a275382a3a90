"""GPU check: host-to-device bandwidth and data stall, without a broker.

Recorded message values replay through kfeed's in-memory source
(``kfeed.loader.memory_loader`` over ``kfeed.MemorySource``), so they take the
loader's own decode -> pinned pool -> side-stream copy path; no Kafka is
involved. The workload is the seeds' sample: 768 float32 features, an int64
label and an int64 id (3,088 bytes), ``--samples`` of them (default 100,000),
encoded as block messages of 64 records with ``Schema.encode_blocks``.

a. Host-to-device bandwidth for batches of ``--batch`` (256) samples, all three
   fields, ``--copies`` batches per method, timed with ``time.perf_counter``
   between two ``torch.cuda.synchronize()``:

   - ``kfeed pinned pool``: ``DeviceCopier.copy`` of a filled ``BufferPool``
     slot, the call the loader's thread makes once a slot is filled (pinned
     slot, side stream, ``non_blocking=True``, an event per copy). The slots
     are a small ring, as in the loader.
   - ``pin_memory() per batch``: ``t.pin_memory().to(device, non_blocking=True)``
     on distinct pageable batches (torch's caching host allocator keeps the
     pinned blocks, so this is a host memcpy plus the DMA).
   - ``pageable .to(device)``: ``t.to(device)`` on distinct pageable batches.
   - ``kfeed Loader end to end``: ``next(loader)`` with no model step: decode on
     the feeder thread, pool, copy. Its GB/s is the loader's delivery ceiling.

b. Data stall. A model step of about ``--step-ms`` (2 ms) on the device: the
   batch's features through a chain of ``[batch, H] @ [H, H]`` products
   (``tanh`` between them), the number of products calibrated at start with
   CUDA events. Each step ends with ``torch.cuda.synchronize()`` (what a loop
   that reads ``loss.item()`` every step does), so the host never runs ahead of
   the GPU and every second the host waits for a batch is a second the GPU
   sits idle. The loop, identical for both feeders::

       batch = next(it)                   # start-up: not counted
       sync; t0 = perf_counter()
       repeat --steps times:
           step(batch); sync
           batch = next(it)               # timed: the wait for data
       total = perf_counter() - t0

   Data stall % = time waiting for the next batch / total. For kfeed the wait
   is ``loader.stats()["wait_s"]`` (time in ``next()`` waiting for a ready
   slot); for ``torch.utils.data.DataLoader(dataset, batch_size=256,
   pin_memory=True, num_workers=N)`` over a map-style dataset of the same
   samples (decoded by kfeed into numpy arrays; ``__getitem__`` returns one
   sample, the default collate stacks them), it is ``perf_counter`` around
   ``next()``. The ``+copy`` column adds the host-side cost of issuing the
   device copy (kfeed: the whole ``next()``; DataLoader: ``next()`` plus
   ``.to(device, non_blocking=True)`` of each field). ``GPU busy %`` is steps x
   the calibrated step time / total.

c. The host runs ahead. The same step in a loop that reads the loss back only
   every N steps (1, 10, 100), as a training loop does when it logs: between
   reads the host queues steps ahead of the GPU, so a feeder that keeps up is
   hidden. ``busy %`` is the loop time with one fixed batch already on the
   device divided by the loop time with the feeder: 100 % means the GPU never
   waited for data. For kfeed and for the DataLoader with the largest
   ``--workers``.

Without CUDA it refuses to run unless ``--device cpu`` is given; then it runs
the same code on the CPU (no pinning, a matmul step on the CPU with one torch
thread) as a smoke test, and says in its output that the figures are not GPU
figures.

    python bench/gpu_check.py [--device cuda|cpu] [--samples N] [--steps S]
                              [--workers 4,8] [--json PATH]

e. Integrity: a bounded read of the recording with no synchronisation, the
   loop moving between two streams every 7 batches; every id must arrive once
   and in order (``integrity``).

Exit status: 0; 1 when the integrity check fails; 2 on a usage error or when
CUDA is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import sys
import time
from typing import Any

FEATURES = 768
BLOCK_RECORDS = 64
CHUNK = 8192  # samples generated per chunk, a multiple of BLOCK_RECORDS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="kfeed GPU check: host-to-device bandwidth and data stall (no broker)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda, and an error without it; 'cpu' is a smoke run")
    p.add_argument("--samples", type=int, default=100_000, help="recorded samples (default 100000)")
    p.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    p.add_argument("--copies", type=int, default=2000,
                   help="batches copied per bandwidth method (default 2000)")
    p.add_argument("--steps", type=int, default=1500,
                   help="model steps per data-stall run (default 1500, about 3 s at 2 ms)")
    p.add_argument("--step-ms", type=float, default=2.0, help="model step time to calibrate to")
    p.add_argument("--hidden", type=int, default=None,
                   help="width of the step's matmuls (default 4096 on cuda, 512 on cpu)")
    p.add_argument("--workers", default="4,8",
                   help="DataLoader num_workers values, comma-separated (default 4,8)")
    p.add_argument("--prefetch", type=int, default=2, help="kfeed Loader prefetch (default 2)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    args = p.parse_args(argv)
    try:
        args.workers = [int(w) for w in str(args.workers).split(",") if w.strip() != ""]
    except ValueError:
        p.error(f"--workers takes comma-separated ints, got {args.workers!r}")
    if any(w < 0 for w in args.workers):
        p.error("--workers values must be >= 0")
    if args.batch <= 0 or args.samples < args.batch:
        p.error("need --batch > 0 and --samples >= --batch")
    if args.copies <= 0 or args.steps <= 0 or args.step_ms <= 0:
        p.error("--copies, --steps and --step-ms must be > 0")
    return args


# -- set-up ------------------------------------------------------------------


def pick_device(requested: str | None) -> Any:
    import torch

    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = ("torch was built without CUDA" if torch.version.cuda is None
               else "torch has CUDA but sees no GPU (driver, CUDA_VISIBLE_DEVICES?)")
        sys.stderr.write(
            f"gpu_check: CUDA is not available ({why}; torch {torch.__version__}).\n"
            "  This check measures a GPU. For a smoke run on the CPU pass --device cpu;\n"
            "  its figures are then not GPU figures.\n")
        raise SystemExit(2)
    return torch.device("cuda", torch.cuda.current_device())


def environment(device: Any) -> dict[str, Any]:
    import numpy as np
    import torch

    import kfeed

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": np.__version__,
        "kfeed": kfeed.__version__,
        "device": str(device),
        "gpu": device.type == "cuda",
    }
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        env["gpu_name"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = round(prop.total_memory / 2**30, 1)
        env["gpu_sms"] = prop.multi_processor_count
        env["gpu_capability"] = f"{prop.major}.{prop.minor}"
        env["cuda_driver"] = _driver_version()
    return env


def _driver_version() -> str | None:
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return None


def make_workload(n: int) -> tuple[Any, list[bytes], dict[str, Any]]:
    """The schema, the recorded block values, and the samples decoded back by kfeed."""
    import numpy as np

    from kfeed.synthetic import synthetic_columns, synthetic_schema

    schema = synthetic_schema()
    values: list[bytes] = []
    for i in range(0, n, CHUNK):
        cols = synthetic_columns(np.arange(i, min(n, i + CHUNK)))
        values.extend(schema.encode_blocks(cols, BLOCK_RECORDS))
    decoded = schema.empty(n)  # numpy
    res = schema.decode_into(values, decoded, 0, "block")
    if res.rows != n or res.bad:
        raise RuntimeError(f"decoding the recording gave {res.rows} rows, {len(res.bad)} bad")
    if not np.array_equal(decoded["id"], np.arange(n)):
        raise RuntimeError("decoded ids do not match the recording")
    return schema, values, decoded


class Syncer:
    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self._sync = (lambda: torch.cuda.synchronize(device)) if self.cuda else (lambda: None)

    def __call__(self) -> None:
        self._sync()


# -- a. host-to-device bandwidth ---------------------------------------------


def _timed(fn: Any, n: int, sync: Syncer, warm: int = 20) -> float:
    for i in range(warm):
        fn(i)
    sync()
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    sync()
    return time.perf_counter() - t


def bandwidth(args: argparse.Namespace, device: Any, schema: Any, values: list[bytes],
              decoded: dict[str, Any], sync: Syncer) -> list[dict[str, Any]]:
    import torch

    from kfeed.device import DeviceCopier
    from kfeed.loader import memory_loader
    from kfeed.pool import BufferPool

    cuda = device.type == "cuda"
    b = args.batch
    nbytes = b * schema.record_size
    rows: list[dict[str, Any]] = []

    def row(name: str, seconds: float | None, n: int, note: str = "") -> None:
        if seconds is None:
            rows.append({"method": name, "gb_per_s": None, "us_per_batch": None, "note": note})
            return
        rows.append({"method": name, "gb_per_s": nbytes * n / seconds / 1e9,
                     "us_per_batch": seconds / n * 1e6, "batches": n, "note": note})

    # kfeed's pool: a ring of slots filled by the codec, copied as the loader's thread does.
    pool = BufferPool(schema, b, slots=args.prefetch + 2)
    copier = DeviceCopier(device)
    slots = []
    per_batch = math.ceil(b / BLOCK_RECORDS)
    for k in range(len(pool)):
        slot = pool.acquire(timeout=1.0)
        first = (k * per_batch) % max(1, len(values) - per_batch)
        res = schema.decode_into(values[first:first + per_batch + 1], slot.target, 0, "block",
                                 split=True)
        if res.rows != b:
            raise RuntimeError(f"filled a slot with {res.rows} rows, expected {b}")
        slot.rows = res.rows
        slots.append(slot)

    def kfeed_copy(i: int) -> None:
        slot = slots[i % len(slots)]
        if cuda:
            _tensors, slot.event, _recorded = copier.copy(slot)
        else:  # no device stage on the CPU: the slot's own tensors are lent (BufferPool.lend)
            _tensors = slot.view()

    pin_note = "pinned" if pool.pinned else "not pinned (no CUDA)"
    row("kfeed pinned pool (DeviceCopier.copy)", _timed(kfeed_copy, args.copies, sync),
        args.copies, pin_note)
    for slot in slots:
        pool.release(slot, slot.event)

    # Distinct pageable batches, views into the decoded arrays.
    nb = len(decoded["id"]) // b
    host = [{k: torch.from_numpy(a[j * b:(j + 1) * b]) for k, a in decoded.items()}
            for j in range(min(nb, args.copies))]

    if cuda:
        def pinned_copy(i: int) -> None:
            for t in host[i % len(host)].values():
                t.pin_memory().to(device, non_blocking=True)

        row("tensor.pin_memory().to(dev, non_blocking)", _timed(pinned_copy, args.copies, sync),
            args.copies)

        def pageable_copy(i: int) -> None:
            for t in host[i % len(host)].values():
                t.to(device)

        row("pageable tensor.to(dev)", _timed(pageable_copy, args.copies, sync), args.copies)
    else:
        row("tensor.pin_memory().to(dev, non_blocking)", None, 0, "n/a: pinning needs CUDA")

        def pageable_copy(i: int) -> None:
            for t in host[i % len(host)].values():
                t.to(device, copy=True)  # on the CPU a plain .to() is a no-op

        row("pageable tensor.to(dev, copy=True)", _timed(pageable_copy, args.copies, sync),
            args.copies, "CPU memcpy")

    # The whole loader path, no model step: decode + pool + copy.
    with memory_loader(values, schema, b, device=device, loop=True,
                       prefetch=args.prefetch) as loader:
        it = iter(loader)
        seconds = _timed(lambda _i: next(it), args.copies, sync, warm=20)
    row("kfeed Loader end to end (no model step)", seconds, args.copies,
        "decode + pool + copy")
    return rows


# -- b. data stall -----------------------------------------------------------


class Step:
    """A model step of about ``step_ms``: features -> chain of H x H matmuls."""

    def __init__(self, device: Any, hidden: int) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.device = device
        self.w_in = (torch.randn(FEATURES, hidden, generator=g) / FEATURES ** 0.5).to(device)
        self.w = (torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(device)
        self.reps = 1
        self.hidden = hidden

    def __call__(self, features: Any) -> Any:
        import torch

        h = features @ self.w_in
        for _ in range(self.reps):
            h = torch.tanh(h @ self.w)
        return h.sum()


def _step_ms(step: Step, x: Any, n: int, cuda: bool) -> float:
    import torch

    for _ in range(3):
        step(x)
    if cuda:
        torch.cuda.synchronize(step.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            step(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    t = time.perf_counter()
    for _ in range(n):
        step(x)
    return (time.perf_counter() - t) / n * 1e3


def calibrate(step: Step, x: Any, target_ms: float, cuda: bool) -> float:
    """Set ``step.reps`` so that one step takes about ``target_ms``; return the measured ms."""
    step.reps = 0
    base = _step_ms(step, x, 20, cuda)
    step.reps = 4
    per = max((_step_ms(step, x, 20, cuda) - base) / 4, 1e-4)
    step.reps = max(1, round((target_ms - base) / per))
    return _step_ms(step, x, 50, cuda)


def train_loop(get: Any, step: Step, steps: int, sync: Syncer) -> dict[str, float]:
    t = time.perf_counter()
    batch = get()  # start-up: workers, group join, first fill; not counted
    startup = time.perf_counter() - t
    sync()
    wait = longest = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        step(batch["features"])
        sync()  # the step is over: the host does not run ahead of the GPU
        t = time.perf_counter()
        batch = get()
        dt = time.perf_counter() - t
        wait += dt
        longest = max(longest, dt)
    total = time.perf_counter() - t0
    return {"total_s": total, "wait_s": wait, "longest_wait_s": longest, "startup_s": startup,
            "step_ms": (total - wait) / steps * 1e3}


class SampleDataset:
    """Map-style dataset over the decoded arrays: one sample per ``__getitem__``."""

    def __init__(self, cols: dict[str, Any]) -> None:
        self.features, self.label, self.id = cols["features"], cols["label"], cols["id"]

    def __len__(self) -> int:
        return len(self.id)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        return {"features": torch.from_numpy(self.features[i]), "label": int(self.label[i]),
                "id": int(self.id[i])}


class CyclicSampler:
    """Indices 0..n-1 in order, repeated until ``total`` have been given."""

    def __init__(self, n: int, total: int) -> None:
        self.n, self.total = n, total

    def __iter__(self) -> Any:
        n = self.n
        return (i % n for i in range(self.total))

    def __len__(self) -> int:
        return self.total


def _dataloader_loop(dl: Any, device: Any, step: Step, steps: int,
                     sync: Syncer) -> tuple[dict[str, float], list[float]]:
    """``train_loop`` over a DataLoader; also the time of each ``next()`` alone."""
    its = [iter(dl)]
    waits: list[float] = []  # perf_counter around each next(), the first one included

    def get() -> dict[str, Any]:
        t = time.perf_counter()
        batch = next(its[0])
        waits.append(time.perf_counter() - t)
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    try:
        return train_loop(get, step, steps, sync), waits
    finally:
        its.clear()  # the last reference: the iterator shuts its workers down


def data_stall(args: argparse.Namespace, device: Any, schema: Any, values: list[bytes],
               decoded: dict[str, Any],
               sync: Syncer) -> tuple[dict[str, Any], list[dict[str, Any]], Step]:
    import torch
    from torch.utils.data import DataLoader

    from kfeed.loader import memory_loader

    cuda = device.type == "cuda"
    b = args.batch
    hidden = args.hidden or (4096 if cuda else 512)
    step = Step(device, hidden)
    x = torch.from_numpy(decoded["features"][:b]).to(device)
    step_ms = calibrate(step, x, args.step_ms, cuda)
    model = {"hidden": hidden, "matmuls": step.reps, "step_ms": step_ms,
             "timer": "CUDA events" if cuda else "perf_counter"}
    print(f"  model step: [{b}x{FEATURES}]@[{FEATURES}x{hidden}], then {step.reps} x "
          f"tanh([{b}x{hidden}]@[{hidden}x{hidden}]): {step_ms:.3f} ms "
          f"({model['timer']}; target {args.step_ms:g} ms)", flush=True)
    rows: list[dict[str, Any]] = []

    def add(name: str, r: dict[str, float], wait_s: float, samples: int,
            extra: dict[str, Any]) -> None:
        total = r["total_s"]
        rows.append({
            "feeder": name,
            "stall_pct": 100 * wait_s / total,
            "stall_incl_copy_pct": 100 * r["wait_s"] / total,
            "gpu_busy_pct": 100 * args.steps * step_ms / 1e3 / total,
            "samples_per_s": samples / total,
            "longest_wait_ms": r["longest_wait_s"] * 1e3,
            "step_ms_in_loop": r["step_ms"],
            "startup_s": r["startup_s"],
            "loop_s": total,
            "steps": args.steps,
            **extra,
        })

    # kfeed: the loader's own decode/pool/prefetch/copy path over the recording.
    loader = memory_loader(values, schema, b, device=device, loop=True, prefetch=args.prefetch)
    try:
        it = iter(loader)
        r = train_loop(lambda: next(it), step, args.steps, sync)
        st = loader.stats()
    finally:
        loader.close()
    add(f"kfeed Loader (prefetch={args.prefetch})", r, st["wait_s"], args.steps * b,
        {"stats_stall_fraction": st["stall_fraction"], "stats_wait_s": st["wait_s"],
         "stats_elapsed_s": st["elapsed_s"], "pool_pinned": loader._pool.pinned})
    print(f"  {rows[-1]['feeder']}: done in {r['total_s']:.1f} s", flush=True)

    # torch DataLoader over the same samples, one sample per __getitem__.
    ds = SampleDataset(decoded)
    for w in args.workers:
        dl = DataLoader(ds, batch_size=b, sampler=CyclicSampler(len(ds), (args.steps + 2) * b),
                        num_workers=w, pin_memory=cuda, drop_last=True)
        r, waits = _dataloader_loop(dl, device, step, args.steps, sync)
        add(f"DataLoader(num_workers={w}, pin_memory={cuda})", r, sum(waits[1:]),
            args.steps * b, {"num_workers": w})
        print(f"  {rows[-1]['feeder']}: done in {r['total_s']:.1f} s", flush=True)
    return model, rows, step


# -- c. the host runs ahead --------------------------------------------------


def run_ahead_loop(get: Any, step: Step, steps: int, every: int, sync: Syncer) -> float:
    """Seconds for ``steps`` steps that read the loss every ``every`` steps, nothing else."""
    batch = get()
    step(batch["features"])
    sync()
    t = time.perf_counter()
    for i in range(steps):
        loss = step(batch["features"])
        if i % every == every - 1:
            loss.item()
        batch = get()
    sync()
    return time.perf_counter() - t


def run_ahead(args: argparse.Namespace, device: Any, schema: Any, values: list[bytes],
              decoded: dict[str, Any], step: Step, sync: Syncer) -> list[dict[str, Any]]:
    """GPU time used vs a loop that feeds one fixed batch from device memory.

    A training loop synchronises only when it reads a value back (here the
    loss, every ``every`` steps); in between, the host queues steps ahead of
    the GPU and a fast enough feeder is hidden. ``busy %`` = the fixed batch's
    loop time / the feeder's: 100 means the GPU never waited for data.
    """
    import torch
    from torch.utils.data import DataLoader

    from kfeed.loader import memory_loader

    b = args.batch
    fixed = {"features": torch.from_numpy(decoded["features"][:b]).to(device)}
    workers = max(args.workers) if args.workers else 0
    ds = SampleDataset(decoded)
    rows = []
    for every in (1, 10, 100):
        ideal = run_ahead_loop(lambda: fixed, step, args.steps, every, sync)
        with memory_loader(values, schema, b, device=device, loop=True,
                           prefetch=args.prefetch) as loader:
            it = iter(loader)
            t_kfeed = run_ahead_loop(lambda: next(it), step, args.steps, every, sync)
        dl = DataLoader(ds, batch_size=b, sampler=CyclicSampler(len(ds), (args.steps + 2) * b),
                        num_workers=workers, pin_memory=device.type == "cuda", drop_last=True)
        its = [iter(dl)]

        def dl_get() -> dict[str, Any]:
            return {k: v.to(device, non_blocking=True) for k, v in next(its[0]).items()}

        t_dl = run_ahead_loop(dl_get, step, args.steps, every, sync)
        its.clear()
        rows.append({"every": every, "fixed_s": ideal, "kfeed_s": t_kfeed,
                     "dataloader_s": t_dl, "dataloader_workers": workers,
                     "kfeed_busy_pct": 100 * ideal / t_kfeed,
                     "dataloader_busy_pct": 100 * ideal / t_dl})
        print(f"  loss read every {every} steps: done", flush=True)
    return rows


# -- output ------------------------------------------------------------------


def _f(v: Any, spec: str) -> str:
    return format("n/a" if v is None else v, spec.replace(".2f", "").replace(".1f", "")
                  if v is None else spec)


def scrape_gpu_metrics(device: Any, schema: Any, values: list[bytes], batch: int
                       ) -> dict[str, Any]:
    """``kfeed_gpu_*`` as a Prometheus scrape reads them, a loader on ``device`` alive.

    Skipped, with the reason, without prometheus_client or nvidia-ml-py.
    """
    try:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        import pynvml  # noqa: F401 - the reader's dependency, checked here to say so
    except ImportError as e:
        return {"lines": [f"skipped: {e}"], "samples": []}
    from kfeed import metrics
    from kfeed.loader import memory_loader

    server = metrics.serve(0)
    try:
        with memory_loader(values, schema, batch, device=device, until="end") as loader:
            next(iter(loader))
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            with urllib.request.urlopen(url) as answer:
                text = answer.read().decode()
    finally:
        server.shutdown()
    samples = [{"name": s.name, "labels": s.labels, "value": s.value}
               for f in text_string_to_metric_families(text) if f.name.startswith("kfeed_gpu_")
               for s in f.samples]
    lines = [f"{s['name']}{s['labels']} = {s['value']:g}" for s in samples]
    return {"lines": lines or ["none published (see the kfeed.metrics log)"],
            "samples": samples}


def integrity(device: Any, schema: Any, values: list[bytes], decoded: dict[str, Any],
              step: Step) -> dict[str, Any]:
    """Every id once and in order while the host runs ahead, on two streams in turn.

    No step synchronises: the host queues steps ahead of the GPU, and each
    batch is dropped once its step is queued, so a batch's memory reused
    before its stream used it (a missing ``record_stream``, a wait on the
    wrong stream) shows as a wrong id. Every 7 batches the loop moves to
    another stream, around ``next()`` as well, so ``adopt`` must order that
    stream and record the tensors for it.
    """
    import numpy as np
    import torch

    from kfeed.loader import memory_loader

    n = len(decoded["id"])
    streams = [torch.cuda.current_stream(device), torch.cuda.Stream(device)] \
        if device.type == "cuda" else [None, None]
    kept = []
    with memory_loader(values, schema, 256, device=device, until="end") as loader:
        it = iter(loader)
        for i in itertools.count():
            s = streams[(i // 7) % 2]
            with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
                batch = next(it, None)
                if batch is None:
                    break
                step(batch["features"])
                kept.append(batch["id"].clone())
            del batch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ids = torch.cat(kept).cpu().numpy()
    return {"ids": int(len(ids)), "samples": n, "batches": len(kept),
            "ok": bool(np.array_equal(ids, np.arange(n)))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = pick_device(args.device)
    if device.type == "cpu":
        import torch

        # One intra-op thread: the CPU "model step" then does not spin
        # OpenMP threads against the feeder thread or the DataLoader workers.
        torch.set_num_threads(1)
    sync = Syncer(device)
    env = environment(device)
    gpu = env["gpu"]
    print("kfeed GPU check (bench/gpu_check.py): in-memory source, no broker")
    if gpu:
        print(f"  GPU: {env['gpu_name']} ({env['gpu_sms']} SMs, {env['gpu_memory_gib']} GiB, "
              f"compute {env['gpu_capability']}), driver CUDA {env['cuda_driver'] or '?'}")
    else:
        print("  *** CPU RUN (--device cpu): these are NOT GPU figures. No pinned memory,")
        print("  *** no host-to-device copy, the model step runs on the CPU. Smoke test only.")
    print(f"  torch {env['torch']} (CUDA {env['torch_cuda'] or 'none'}), Python {env['python']}, "
          f"numpy {env['numpy']}, kfeed {env['kfeed']}, {env['cpus']} CPUs, {env['platform']}")

    t = time.perf_counter()
    schema, values, decoded = make_workload(args.samples)
    b = args.batch
    batch_bytes = b * schema.record_size
    print(f"  workload: {args.samples:,} samples of {schema.record_size:,} B (768 float32 + int64 "
          f"label + int64 id) in {len(values):,} block messages of {BLOCK_RECORDS}; "
          f"batch {b} = {batch_bytes:,} B; built in {time.perf_counter() - t:.1f} s", flush=True)

    t = time.perf_counter()
    bw = bandwidth(args, device, schema, values, decoded, sync)
    t_bw = time.perf_counter() - t
    print()
    print(f"a. Host-to-device copy, batches of {b} samples ({batch_bytes:,} B, all three fields), "
          f"{args.copies} batches each ({t_bw:.1f} s)"
          + ("" if gpu else "  [CPU: NOT GPU FIGURES]"))
    print(f"  {'method':<44} {'GB/s':>8} {'us/batch':>9}  note")
    for r in bw:
        print(f"  {r['method']:<44} {_f(r['gb_per_s'], '>8.2f')} {_f(r['us_per_batch'], '>9.1f')}"
              f"  {r['note']}")

    print()
    print(f"b. Data stall: {args.steps} steps of a ~{args.step_ms:g} ms model step, synchronised "
          f"every step" + ("" if gpu else "  [CPU: NOT GPU FIGURES]"), flush=True)
    t = time.perf_counter()
    model, stall, step = data_stall(args, device, schema, values, decoded, sync)
    t_stall = time.perf_counter() - t
    print(f"  {'feeder':<44} {'stall %':>7} {'+copy %':>7} {'busy %':>7} {'step ms':>7} "
          f"{'samples/s':>10} {'max wait ms':>11} {'startup s':>9}")
    for r in stall:
        print(f"  {r['feeder']:<44} {r['stall_pct']:7.2f} {r['stall_incl_copy_pct']:7.2f} "
              f"{r['gpu_busy_pct']:7.1f} {r['step_ms_in_loop']:7.3f} {r['samples_per_s']:10,.0f} "
              f"{r['longest_wait_ms']:11.2f} {r['startup_s']:9.2f}")
    k = stall[0]
    print(f"  (stall % = wait for the next batch / loop time: kfeed from loader.stats()['wait_s'], "
          f"DataLoader from perf_counter around next(); +copy % adds issuing the device copy; "
          f"busy % = steps x {model['step_ms']:.3f} ms / loop time. kfeed stats() "
          f"stall_fraction: {100 * k['stats_stall_fraction']:.2f} %.)")

    print()
    print(f"c. The host runs ahead: {args.steps} steps, the loss read back every N steps, "
          f"GPU busy vs one fixed batch on the device"
          + ("" if gpu else "  [CPU: NOT GPU FIGURES]"), flush=True)
    t = time.perf_counter()
    ahead = run_ahead(args, device, schema, values, decoded, step, sync)
    t_ahead = time.perf_counter() - t
    w = ahead[0]["dataloader_workers"]
    print(f"  {'loss read every':>15} {'fixed s':>8} {'kfeed s':>8} {'kfeed busy %':>12} "
          f"{'DataLoader(' + str(w) + ') s':>16} {'busy %':>7}")
    for r in ahead:
        print(f"  {r['every']:>15} {r['fixed_s']:8.3f} {r['kfeed_s']:8.3f} "
              f"{r['kfeed_busy_pct']:12.1f} {r['dataloader_s']:16.3f} "
              f"{r['dataloader_busy_pct']:7.1f}")

    print()
    print("d. GPU metrics: a scrape of kfeed.metrics.serve while a loader feeds the device")
    gpu_metrics = scrape_gpu_metrics(device, schema, values, b)
    for line in gpu_metrics["lines"]:
        print(f"  {line}")
    print()
    print("e. Integrity: every id once and in order, the host running ahead on two streams")
    check = integrity(device, schema, values, decoded, step)
    print(f"  {check['ids']:,} ids of {check['samples']:,} in {check['batches']} batches: "
          + ("in order, each once" if check["ok"] else "WRONG"))
    total = time.perf_counter() - t_start
    print(f"\nTotal {total:.1f} s (bandwidth {t_bw:.1f} s, data stall {t_stall:.1f} s, "
          f"run ahead {t_ahead:.1f} s)."
          + ("" if gpu else "  CPU RUN: NOT GPU FIGURES."))

    if args.json_path:
        out = {"env": env, "gpu_figures": gpu,
               "config": {"samples": args.samples, "batch": b, "batch_bytes": batch_bytes,
                          "copies": args.copies, "steps": args.steps,
                          "step_ms_target": args.step_ms, "workers": args.workers,
                          "prefetch": args.prefetch, "block_records": BLOCK_RECORDS},
               "bandwidth": bw, "model": model, "stall": stall, "run_ahead": ahead,
               "gpu_metrics": gpu_metrics, "integrity": check, "seconds": total}
        if not gpu:
            out["warning"] = "CPU run (--device cpu): not GPU figures"
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json_path}")
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
