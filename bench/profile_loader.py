"""The workload that ``make profile`` runs under py-spy, and the summary of its samples.

``run``: read a block topic (``kfeed produce --synthetic``) from its earliest
offset to its end with ``kfeed.Loader``, ``--epochs`` times, each time with a
fresh consumer group, doing nothing with the batches but asking for the next.
That keeps the loader as busy as it can be, so the profile shows the loader's
own costs. Prints the loader's ``stats()`` per epoch.

    python bench/profile_loader.py run --topic T [--bootstrap HOST:PORT]
                                       [--epochs 3] [--batch 256] [--device D]

``summarize``: read py-spy's ``--format raw`` output (collapsed stacks, one
``frame;frame;... count`` line each; recorded with ``--threads``, the first
frame names the thread) and print, per thread name (the feeder threads of
several Loaders together, unless ``--per-thread``) and over all threads, the
share of samples by innermost function (self) and by function anywhere in the
stack (inclusive). Raw addresses (unsymbolised libc frames) are skipped when finding
the innermost function. A sample whose innermost function is a wait (a lock,
a condition, a sleep, a poll) or the GIL is counted apart, so the top costs
are the ones that burn CPU. Samples taken while importing modules, and
samples with no Python frame at all (interpreter start-up and shutdown), are
left out unless ``--imports``.

    python bench/profile_loader.py summarize RAW [--top 12] [--per-thread] [--imports]
                                                 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import uuid
from collections import Counter, defaultdict
from typing import Any

# Innermost frames that mean "this thread is waiting, not working".
_WAIT = re.compile(
    r"^(pthread_cond_(timed|clock)?wait|sem_(timed|clock)?wait|__futex_abstimed_wait\w*|"
    r"do_futex_wait|futex_wait|syscall|epoll_wait|poll|ppoll|select|pselect|nanosleep|"
    r"clock_nanosleep|sleep|usleep|cnd_(timed)?wait|PyThread_acquire_lock_timed|"
    r"acquire_timed|lock_PyThread_acquire_lock|recv|recvmsg|read|"
    r"Condition\.wait|Event\.wait|Thread\._wait_for_tstate_lock|Thread\.join|sleep)\b")
_GIL = re.compile(r"^(take_gil|drop_gil|PyEval_RestoreThread|PyEval_AcquireThread)\b")
_PY_FRAME = re.compile(r"\.py(x)?:\d+\)$|\(<frozen ")
_ADDRESS = re.compile(r"^0x[0-9a-fA-F]+ \(")
_THREAD = re.compile(r"^thread \((\w+)\)(?::\s*(.*))?$")


# -- run ---------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    import kfeed
    from kfeed.synthetic import synthetic_schema

    bootstrap = args.bootstrap or os.environ.get("KFEED_BOOTSTRAP")
    if not bootstrap:
        sys.stderr.write("profile_loader: give --bootstrap or set KFEED_BOOTSTRAP\n")
        return 2
    schema = synthetic_schema()
    total = 0
    t_all = time.perf_counter()
    for epoch in range(args.epochs):
        config = {"bootstrap.servers": bootstrap,
                  "group.id": f"kfeed-profile-{uuid.uuid4().hex[:8]}"}
        with kfeed.Loader(config, args.topic, schema, batch_size=args.batch, until="end",
                          start="earliest", device=args.device) as loader:
            n = 0
            for batch in loader:
                n += batch.size
            st = loader.stats()
        total += n
        print(f"epoch {epoch}: {n:,} samples, {st['samples_per_s']:,.0f} samples/s, "
              f"{st['mb_per_s']:,.1f} MB/s, start-up {st['startup_s']:.2f} s, waited in next() "
              f"{100 * st['stall_fraction']:.1f} % of the time, device {loader.device}", flush=True)
        if n == 0:
            sys.stderr.write(f"profile_loader: topic {args.topic!r} gave no samples\n")
            return 1
    print(f"{total:,} samples in {time.perf_counter() - t_all:.1f} s over {args.epochs} epochs")
    return 0


# -- summarize ---------------------------------------------------------------


def _frame_name(frame: str) -> str:
    """``func (file.py:12)`` -> ``func (file.py)``: a function, whatever its line."""
    return re.sub(r":\d+\)$", ")", frame.strip())


def read_raw(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue
            stacks.append((stack.split(";"), n))
    return stacks


def summarize(stacks: list[tuple[list[str], int]], top: int,
              imports: bool = False, per_thread: bool = False) -> dict[str, Any]:
    """Per thread: samples waiting / on the GIL / busy; busy samples by innermost
    function (self) and every sample by function anywhere in the stack (inclusive)."""
    names: dict[str, str] = {}
    for frames, _n in stacks:
        m = _THREAD.match(frames[0]) if frames else None
        if m and m.group(2):
            names[m.group(1)] = m.group(2)
    kinds: dict[str, Counter[str]] = defaultdict(Counter)        # thread -> busy/wait/gil
    self_busy: dict[str, Counter[str]] = defaultdict(Counter)    # thread -> leaf -> n
    self_wait: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)    # thread -> func -> n
    tids: dict[str, set[str]] = defaultdict(set)
    skipped = 0
    for frames, n in stacks:
        rest = [f for f in frames if not f.startswith("process ")]
        m = _THREAD.match(rest[0]) if rest else None
        if m:
            rest.pop(0)
            tid = m.group(1)
            name = names.get(tid, "?")
            # Threads of one name (a Loader per epoch: kfeed-loader) merge by default.
            thread = f"{name} ({tid})" if per_thread or name == "?" else name
            tids[thread].add(tid)
        else:
            thread = "all threads"
        if not imports and any(f.startswith("_find_and_load (") for f in rest):
            skipped += n  # start-up: importing modules
            continue
        if not imports and not any(_PY_FRAME.search(f) for f in rest):
            skipped += n  # no Python code on the stack: interpreter start-up or shutdown
            continue
        funcs = [_frame_name(f) for f in rest if not _ADDRESS.match(f)] or ["<no symbol>"]
        leaf = funcs[-1]
        bare = leaf.split(" (")[0]
        kind = "gil" if _GIL.match(bare) else "wait" if _WAIT.match(bare) else "busy"
        kinds[thread][kind] += n
        (self_busy if kind == "busy" else self_wait)[thread][leaf] += n
        for func in set(funcs):
            inclusive[thread][func] += n
    total = sum(sum(k.values()) for k in kinds.values())
    busy_all: Counter[str] = Counter()
    for c in self_busy.values():
        busy_all.update(c)
    n_busy = sum(busy_all.values())
    out: dict[str, Any] = {
        "samples": total,
        "skipped_startup_samples": skipped,
        "busy": n_busy,
        "wait": sum(k["wait"] for k in kinds.values()),
        "gil": sum(k["gil"] for k in kinds.values()),
        "top_busy_self": [
            {"function": f, "samples": c, "pct_all": 100 * c / max(1, total),
             "pct_busy": 100 * c / max(1, n_busy)}
            for f, c in busy_all.most_common(top)
        ],
        "threads": [],
    }
    for thread, k in sorted(kinds.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(k.values())
        out["threads"].append({
            "thread": thread, "os_threads": len(tids[thread]) or 1,
            "samples": n, "pct": 100 * n / max(1, total),
            "busy_pct": 100 * k["busy"] / n, "wait_pct": 100 * k["wait"] / n,
            "gil_pct": 100 * k["gil"] / n,
            "self_busy": [{"function": f, "pct": 100 * c / n}
                          for f, c in self_busy[thread].most_common(top)],
            "self_wait": [{"function": f, "pct": 100 * c / n}
                          for f, c in self_wait[thread].most_common(4)],
            "inclusive": [{"function": f, "pct": 100 * c / n}
                          for f, c in inclusive[thread].most_common(top + 8)],
        })
    return out


def cmd_summarize(args: argparse.Namespace) -> int:
    stacks = read_raw(args.raw)
    s = summarize(stacks, args.top, imports=args.imports, per_thread=args.per_thread)
    if not s["samples"]:
        sys.stderr.write(f"profile_loader: no samples in {args.raw}\n")
        return 1
    t = s["samples"]
    print(f"{t:,} samples in {args.raw}"
          + ("" if args.imports else f" ({s['skipped_startup_samples']:,} more, importing "
             f"modules or with no Python frame: start-up and shutdown, left out)")
          + f": {100 * s['busy'] / t:.1f} % busy, {100 * s['wait'] / t:.1f} % waiting (lock, "
          f"condition, sleep, poll), {100 * s['gil'] / t:.1f} % waiting for the GIL")
    print("\nTop costs over all threads, busy samples by innermost function "
          "(% of all samples / % of busy samples):")
    for i, r in enumerate(s["top_busy_self"], 1):
        print(f"  {i:2}. {r['pct_all']:5.1f} % / {r['pct_busy']:5.1f} %  {r['function']}")
    for th in s["threads"]:
        many = f" ({th['os_threads']} threads)" if th["os_threads"] > 1 else ""
        print(f"\nthread {th['thread']}{many}: {th['samples']:,} samples "
              f"({th['pct']:.1f} % of all): busy {th['busy_pct']:.1f} %, "
              f"waiting {th['wait_pct']:.1f} %, GIL {th['gil_pct']:.1f} %")
        print("  busy, by innermost function (% of the thread's samples):")
        for r in th["self_busy"]:
            print(f"    {r['pct']:5.1f} %  {r['function']}")
        print("  waiting in:")
        for r in th["self_wait"]:
            print(f"    {r['pct']:5.1f} %  {r['function']}")
        print("  inclusive (anywhere in the stack, busy or not):")
        for r in th["inclusive"]:
            print(f"    {r['pct']:5.1f} %  {r['function']}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(s, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="read a block topic to its end with kfeed.Loader")
    r.add_argument("--topic", required=True)
    r.add_argument("--bootstrap", default=None, help="default: $KFEED_BOOTSTRAP")
    r.add_argument("--epochs", type=int, default=3)
    r.add_argument("--batch", type=int, default=256)
    r.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    s = sub.add_parser("summarize", help="aggregate py-spy --format raw output")
    s.add_argument("raw")
    s.add_argument("--top", type=int, default=12)
    s.add_argument("--per-thread", action="store_true",
                   help="one table per OS thread (default: threads of one name together)")
    s.add_argument("--imports", action="store_true",
                   help="keep the start-up and shutdown samples (imports, no Python frame)")
    s.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_summarize(args)


if __name__ == "__main__":
    sys.exit(main())
