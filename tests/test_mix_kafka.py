"""Mixtures and windows against a real Apache Kafka (the cluster fixture).

The memory source proves the rules (tests/test_mix.py); here the brokers'
own timing decides what each fetch holds, which must not change the stream.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone

import numpy as np
import pytest

import kfeed
from kfeed.synthetic import synthetic_columns, synthetic_schema

pytestmark = pytest.mark.integration

SCHEMA = synthetic_schema()
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def produce(bootstrap: str, topic: str, ids: np.ndarray) -> None:
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as p:
        p.send(synthetic_columns(ids), keys=ids)


def mix_topics(bootstrap: str, make_topic) -> dict[str, str]:
    """Three topics of 3, 2 and 1 partitions; source k's ids are k * 10**6 + i."""
    names = {}
    for k, (name, (parts, n)) in enumerate(
            {"web": (3, 6000), "code": (2, 3000), "math": (1, 1000)}.items()):
        names[name] = make_topic(partitions=parts)
        produce(bootstrap, names[name], k * 10**6 + np.arange(n))
    return names


def read(bootstrap: str, mix: kfeed.Mix, *, stop: int | None = None, state=None, **kwargs):
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    loader = kfeed.Loader(config, mix, SCHEMA, 128, device="cpu", until="end", **kwargs)
    if state is not None:
        loader.load_state_dict(state)
    got = []
    with loader:
        for i, batch in enumerate(loader):
            assert np.array_equal(batch["features"].numpy(),
                                  synthetic_columns(batch["id"].numpy())["features"])
            got.append(batch["id"].numpy().copy())
            if stop is not None and i + 1 == stop:
                return got, loader.state_dict()
        return got, loader.stats()


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(500, seed=1)])
def test_a_mixture_of_real_topics_is_the_same_stream_every_time_and_resumes_into_it(
        bootstrap, make_topic, shuffle):
    names = mix_topics(bootstrap, make_topic)
    mix = kfeed.Mix({names[t]: w for t, w in WEIGHTS.items()}, seed=7, exhausted="renormalize")
    whole, stats = read(bootstrap, mix, shuffle=shuffle)
    ids = np.concatenate(whole)
    assert len(ids) == len(np.unique(ids)) == 10_000
    assert stats["mix"] == {names["web"]: 6000, names["code"]: 3000, names["math"]: 1000}
    # The proportions hold while every source has records (math ends at ~10,000 * 0.1 / 0.1).
    if shuffle is None:
        src = ids[:9000] // 10**6
        for k, w in enumerate(WEIGHTS.values()):
            dev = np.cumsum(src == k) - np.arange(1, len(src) + 1) * w
            assert dev.max() - dev.min() < 2.0
    again, _ = read(bootstrap, mix, shuffle=shuffle)
    np.testing.assert_array_equal(np.concatenate(again), ids)  # other fetches, same stream
    first, state = read(bootstrap, mix, shuffle=shuffle, stop=23)
    rest, _ = read(bootstrap, mix, shuffle=shuffle, state=state)
    np.testing.assert_array_equal(np.concatenate(first + rest), ids)


def test_a_window_by_time_reads_the_records_written_inside_it(bootstrap, make_topic):
    topic = make_topic(partitions=2)
    produce(bootstrap, topic, np.arange(0, 1000))
    time.sleep(0.05)
    start = datetime.now(timezone.utc)
    time.sleep(0.05)
    produce(bootstrap, topic, np.arange(1000, 2500))
    time.sleep(0.05)
    until = datetime.now(timezone.utc)
    time.sleep(0.05)
    produce(bootstrap, topic, np.arange(2500, 3000))
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    with kfeed.Loader(config, topic, SCHEMA, 100, device="cpu", start=start,
                      until=until) as loader:
        ids = np.sort(np.concatenate([b["id"].numpy() for b in loader]))
    np.testing.assert_array_equal(ids, np.arange(1000, 2500))


def test_epochs_read_the_window_resolved_at_the_start_each_in_its_own_order(bootstrap,
                                                                             make_topic):
    topic = make_topic(partitions=3)
    produce(bootstrap, topic, np.arange(3000))
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    kw = {"device": "cpu", "until": "end", "epochs": 2, "shuffle": kfeed.Shuffle(400, seed=3)}
    loader = kfeed.Loader(config, topic, SCHEMA, 100, **kw)
    first = np.concatenate([b["id"].numpy() for b in loader])
    state = loader.state_dict()  # between the epochs: with the window
    produce(bootstrap, topic, np.arange(3000, 4000))  # after the window was resolved
    second = np.concatenate([b["id"].numpy() for b in loader])
    assert loader.epoch == 1
    loader.close()
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(3000))
    assert not np.array_equal(first, second)
    # Another job from that state: epoch 1 next, epoch 0 on request, each the same again.
    for epoch, want in ((1, second), (0, first)):
        again = kfeed.Loader({**config, "group.id": uuid.uuid4().hex}, topic, SCHEMA, 100, **kw)
        again.load_state_dict(state)
        again.set_epoch(epoch)
        np.testing.assert_array_equal(np.concatenate([b["id"].numpy() for b in again]), want)
        again.close()


def test_repeat_reads_a_small_topic_again_and_resumes_into_the_same_stream(bootstrap,
                                                                          make_topic):
    small, big = make_topic(partitions=1), make_topic(partitions=2)
    produce(bootstrap, small, np.arange(300))
    produce(bootstrap, big, 10**6 + np.arange(2000))
    mix = kfeed.Mix({small: 0.5, big: 0.5}, seed=3, exhausted="repeat")
    whole, stats = read(bootstrap, mix, shuffle=kfeed.Shuffle(200, seed=1))
    ids = np.concatenate(whole)
    b = ids[ids >= 10**6]
    assert sorted(b.tolist()) == list(range(10**6, 10**6 + 2000))  # the big one once
    a = ids[ids < 10**6]
    assert abs(len(a) - 2000) <= 1 and np.bincount(a).min() >= 6  # the small one 6-7 times
    first, state = read(bootstrap, mix, shuffle=kfeed.Shuffle(200, seed=1), stop=19)
    assert any(r >= 2 for _t, _p, r in state["rounds"])
    rest, _ = read(bootstrap, mix, shuffle=kfeed.Shuffle(200, seed=1), state=state)
    np.testing.assert_array_equal(np.concatenate(first + rest), ids)


def produce_to(bootstrap: str, topic: str, partition: int, ids: np.ndarray) -> None:
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA,
                        partitioner=lambda _key, _n: partition) as p:
        p.send(synthetic_columns(ids), keys=ids)


def test_an_unbounded_mixture_is_not_held_up_by_an_idle_partition(bootstrap, make_topic):
    # Topic a is keyed: partition 0 holds a few records, 1 the rest, 2 none
    # (a key not seen yet). Waiting on 2's turn would hold the mixture up at
    # once; its turns pass while the brokers say it is at its end.
    a, b = make_topic(partitions=3), make_topic(partitions=1)
    produce_to(bootstrap, a, 0, np.arange(5))
    produce_to(bootstrap, a, 1, np.arange(5, 1000))
    produce(bootstrap, b, 10**6 + np.arange(1000))
    mix = kfeed.Mix({a: 0.5, b: 0.5}, seed=1)
    config = {"bootstrap.servers": bootstrap}

    def reader() -> tuple[kfeed.Loader, list[int], threading.Thread]:
        loader = kfeed.Loader({**config, "group.id": uuid.uuid4().hex}, mix, SCHEMA, 100,
                              device="cpu", max_wait_ms=50)
        got: list[int] = []

        def read() -> None:
            try:
                for batch in loader:
                    got.extend(batch["id"].tolist())
            except kfeed.LoaderError:  # closed
                pass

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return loader, got, thread

    def wait_for(got: list[int], n: int) -> None:
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(got) >= n, f"the mixture waits, after {len(got)} records"

    streams = []
    for run in range(2):
        loader, got, thread = reader()
        wait_for(got, 2000)
        if run:  # a key seen at last: partition 2 takes its turns again
            produce_to(bootstrap, a, 2, np.arange(2000, 2010))
            produce(bootstrap, b, 10**6 + np.arange(1000, 1010))
            wait_for(got, 2020)
        loader.close()
        thread.join(30)
        streams.append(got)
    first, second = streams
    assert sorted(first) == [*range(1000), *range(10**6, 10**6 + 1000)]
    # Over records already written the stream is the records' alone: the
    # second read mixes them alike, whatever its fetches held.
    assert second[:2000] == first
    assert sorted(second[2000:]) == [*range(2000, 2010), *range(10**6 + 1000, 10**6 + 1010)]
