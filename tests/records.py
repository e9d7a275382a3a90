"""What several test files share, most of it for the formats others write.

``decode_all`` runs values through a decoder as the loader does, a bounded
output at a time; ``damage`` rewrites a value the ways the fuzz tests try;
``sentinel_check`` says a decode wrote nowhere but its rows; ``read_dlq``
reads a dead-letter topic back; ``check_packed_documents`` reads token
documents with ``pack=`` against kfeed's own raw token messages;
``kfeed_cli`` runs the command line against a cluster; ``message_class``
makes a proto3 message class of scalar and repeated fields;
``left_to_the_collector`` lists the kfeed objects only the cyclic garbage
collector would free; ``CountingSource`` is a memory source that notes each
``consume()`` it is asked for.
"""

from __future__ import annotations

import os
import gc
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

import kfeed


def kfeed_cli(bootstrap: str, *args: str, env: dict[str, str] | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``kfeed ARGS`` in a process of its own, against the brokers at ``bootstrap``."""
    return subprocess.run([sys.executable, "-m", "kfeed", *args], check=False,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {}), "KFEED_BOOTSTRAP": bootstrap})


def decode_all(decoder: Any, schema: kfeed.Schema, values: list,
               rows: int = 1000) -> tuple[dict[str, np.ndarray], list[tuple[int, str]]]:
    """Every value through ``decode_into`` a ``rows``-row output at a time: columns and bad."""
    out = {f.name: np.zeros((rows, *f.shape), f.storage) for f in schema.fields}
    target = schema.bind(out)
    got: dict[str, list[np.ndarray]] = {f.name: [] for f in schema.fields}
    bad: list[tuple[int, str]] = []
    i = 0
    while i < len(values):
        res = decoder.decode_into(values[i:], target, 0)
        assert res.consumed > 0
        for name, parts in got.items():
            parts.append(out[name][:res.rows].copy())
        bad.extend((i + k, why) for k, why in res.bad)
        i += res.consumed
    return {k: np.concatenate(v) for k, v in got.items()}, bad


def damage(data: st.DataObject, raw: bytearray, flips: list[int], inserts: list[bytes],
           rounds: tuple[int, int] = (0, 3)) -> bytearray:
    """Rewrite ``raw`` a few times: a byte to one of ``flips``, cut, grown, an insert."""
    for _ in range(data.draw(st.integers(*rounds))):
        how = data.draw(st.sampled_from(["flip", "cut", "grow", "insert"]))
        if how == "flip" and raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.sampled_from(flips))
        elif how == "cut":
            del raw[data.draw(st.integers(0, len(raw))):]
        elif how == "grow":
            raw += data.draw(st.binary(max_size=12))
        else:
            at = data.draw(st.integers(0, len(raw)))
            raw[at:at] = data.draw(st.sampled_from(inserts))
    return raw


def rows_untouched(whole: dict[str, np.ndarray], before: dict[str, np.ndarray], res: Any,
                   capacity: int, guard: int) -> None:
    """Nothing written outside the output, nor past the row a rejected value may begin."""
    scribbled = res.rows + (1 if res.bad and res.rows < capacity else 0)
    for name, arr in whole.items():
        untouched = np.r_[0:guard, guard + scribbled:len(arr)]
        assert (arr[untouched] == before[name][untouched]).all(), name


def read_dlq(bootstrap: str, topic: str, count: int, timeout: float = 60.0) -> list[Any]:
    """The messages of ``topic``'s dead-letter topic, once ``count`` arrived (or the timeout)."""
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "auto.offset.reset": "earliest"})
    c.subscribe([f"{topic}.dlq"])
    dead: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(dead) < count and time.monotonic() < deadline:
        dead += [m for m in c.consume(10, 1.0) if m.error() is None]
    c.close()
    return dead



def read_columns(bootstrap: str, topic: str, schema: kfeed.Schema, fmt: Any = "block",
                 batch_size: int = 256) -> dict[str, np.ndarray]:
    """Every record of ``topic`` as kfeed's loader reads it to the end, column by column."""
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    got: dict[str, list[np.ndarray]] = {f.name: [] for f in schema.fields}
    with kfeed.Loader(config, topic, schema, batch_size, device="cpu", until="end",
                      format=fmt) as loader:
        for batch in loader:
            for name, parts in got.items():
                parts.append(batch[name].numpy().copy())
    return {f.name: np.concatenate(got[f.name]) if got[f.name]
            else np.empty((0, *f.shape), f.storage) for f in schema.fields}


def check_packed_documents(values: list, schema: kfeed.Schema, fmt: Any,
                           docs: list, pack: kfeed.Pack) -> None:
    """``values`` of ``fmt`` packed: the batches kfeed's raw token messages of ``docs`` give.

    ``docs[i]`` is value i's document, or None where the value is bad (an
    empty document takes its place in the raw messages). Shuffled, stopped
    and resumed from ``state_dict()``, every token arrives once. The token
    ids must be neither the pad nor the EOS.
    """
    import torch

    from kfeed.loader import memory_loader

    name = schema.varlen.name
    raw = kfeed.Schema({name: (schema.varlen.dtype, (None,))})
    empty = np.zeros(0, raw.varlen.storage)
    same = raw.encode_raw({name: [empty if d is None else np.asarray(d, raw.varlen.storage)
                                  for d in docs]})

    def batches(vals: list, sch: kfeed.Schema, f: Any) -> list[dict]:
        with memory_loader(vals, sch, 8, device="cpu", until="end", pack=pack,
                           format=f) as loader:
            return [{k: v.clone() for k, v in b.items()} for b in loader]

    got, want = batches(values, schema, fmt), batches(same, raw, "raw")
    assert len(got) == len(want) > 20
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    shuffle = kfeed.Shuffle(buffer=200, seed=1)
    with memory_loader(values, schema, 8, device="cpu", until="end", pack=pack,
                       format=fmt, shuffle=shuffle) as first:
        seen = [b[name][b[name] != pack.pad_id].clone() for _, b in zip(range(20), first)]
        state = first.state_dict()
    with memory_loader(values, schema, 8, device="cpu", until="end", pack=pack,
                       format=fmt, shuffle=shuffle) as second:
        second.load_state_dict(state)
        seen += [b[name][b[name] != pack.pad_id] for b in second]
    tokens = torch.cat(seen).numpy()
    tokens = tokens[tokens != pack.eos_id]
    every = np.concatenate([np.asarray(d, raw.varlen.storage) for d in docs if d is not None])
    assert np.array_equal(np.sort(tokens), np.sort(every.astype(tokens.dtype)))


def message_class(package: str, name: str, fields: list[tuple[str, str, bool]]) -> type:
    """A proto3 message class: ``fields`` as (name, type such as "int64", repeated), numbered 1..."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name=f"{package}.proto", package=package,
                                             syntax="proto3")
    m = fdp.message_type.add(name=name)
    for number, (field, kind, repeated) in enumerate(fields, 1):
        m.field.add(name=field, number=number, type=getattr(f, f"TYPE_{kind.upper()}"),
                    label=f.LABEL_REPEATED if repeated else f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))


def left_to_the_collector(run: Callable[[], Any]) -> dict[str, int]:
    """The kfeed objects, by type, that ``run()`` leaves in reference cycles.

    Reference counting frees everything else once ``run`` returns; these
    wait for the cyclic collector's next full pass. Runs ``run`` once first,
    so that what a first call caches (imports, compiled plans) is not counted.
    """
    run()
    gc.collect()
    gc.disable()
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return dict(Counter(type(o).__qualname__ for o in gc.garbage
                            if (type(o).__module__ or "").startswith("kfeed")))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


class CountingSource(kfeed.MemorySource):
    """A ``MemorySource`` noting each ``consume()``: ``(max_messages, timeout, messages given)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[int, float, int]] = []

    def consume(self, max_messages: int, timeout: float) -> list[Any]:
        out = super().consume(max_messages, timeout)
        self.asked.append((max_messages, timeout, len(out)))
        return out
