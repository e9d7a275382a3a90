"""kfeed.metrics: what a Prometheus scrape of a live loader and producer reads.

The exposition is read over HTTP and parsed with prometheus_client's own
parser; every figure must equal what ``stats()`` says, and the lag appears
under kafka_exporter's name.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kfeed
from kfeed import metrics
from kfeed.loader import memory_loader
from kfeed.synthetic import synthetic_columns, synthetic_schema

SCHEMA = synthetic_schema()


def scrape(server) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics") as answer:
        text = answer.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def sample(families: dict, name: str, **labels: str) -> float:
    found = [s.value for family in families.values() for s in family
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture
def server():
    s = metrics.serve(0)
    yield s
    s.shutdown()


def test_a_scrape_reads_what_the_loader_counts(server):
    schema = kfeed.Schema({"x": ("float32", (4,)), "id": ("int64", ())})
    values = schema.encode_blocks({"x": np.ones((1000, 4), np.float32), "id": np.arange(1000)},
                                  50)
    values[3] = b"garbage"
    with memory_loader(values, schema, 100, device="cpu", until="end",
                       on_bad_record="skip") as loader:
        for _ in loader:
            pass
        stats = loader.stats()
        got = scrape(server)
    labels = {"consumergroup": "", "topics": "memory"}
    assert sample(got, "kfeed_loader_samples_total", **labels) == stats["samples"] == 950
    assert sample(got, "kfeed_loader_batches_total", **labels) == stats["batches"] == 10
    assert sample(got, "kfeed_loader_bytes_total", **labels) == stats["bytes"]
    reasons = [s for s in got["kfeed_loader_bad_records"] if s.name.endswith("_total")]
    assert [s.value for s in reasons] == [1.0] and reasons[0].labels["reason"]
    # Every next() after the first batch is one observation of the wait (the
    # last one's is the wait for the end of the read, not the commit after it).
    assert sample(got, "kfeed_loader_wait_seconds_count", **labels) == 10
    assert sample(got, "kfeed_loader_wait_seconds_bucket", le="+Inf", **labels) == 10
    assert sample(got, "kfeed_loader_wait_seconds_sum", **labels) == pytest.approx(
        stats["wait_s"])
    assert sample(got, "kafka_consumergroup_lag", consumergroup="", topic="memory",
                  partition="0") == 0
    assert sample(got, "kfeed_loader_pool_bytes", **labels) == stats["pool_bytes"]
    assert sample(got, "kfeed_loader_held_bytes", **labels) == stats["held_bytes"] == 0
    assert sample(got, "kfeed_loader_dead_lettered_total", **labels) == 0  # skipped
    assert sample(got, "kfeed_loader_rebalances_total", **labels) == 1
    assert sample(got, "kfeed_loader_commits_total", **labels) == stats["commits"] >= 1
    assert sample(got, "kfeed_loader_commit_failures_total", **labels) == 0
    for name in ("fetch", "decode"):
        assert sample(got, "kfeed_loader_stage_seconds_total", stage=name, **labels) > 0
    assert sample(got, "kfeed_loader_stage_seconds_total", stage="copy", **labels) == 0  # CPU
    assert sample(got, "kfeed_loader_pool_slots_in_use", **labels) == stats["pool_slots_in_use"]
    # Each batch's newest record: written when the recording was made, moments ago.
    assert sample(got, "kfeed_loader_latency_seconds_count", **labels) == 10
    assert sample(got, "kfeed_loader_latency_seconds_bucket", le="60.0", **labels) == 10
    assert 0 < sample(got, "kfeed_loader_latency_seconds_sum", **labels) < 10 * 60


def test_a_wait_under_way_shows_as_stall_at_once(server):
    # The wait histogram takes a wait when it ends: a trainer starved for
    # minutes read as never stalled, then more than 100% in one window.
    schema = kfeed.Schema({"id": ("int64", ())})
    source = kfeed.MemorySource(schema.encode_blocks({"id": np.arange(20)}, 10))
    loader = kfeed.Loader(None, "memory", schema, 10, source=source, device="cpu")
    try:
        next(loader), next(loader)
        def starve() -> None:
            with contextlib.suppress(kfeed.KfeedError):
                next(loader, None)

        starved = threading.Thread(target=starve, daemon=True)
        starved.start()  # no record will come: it waits till close()
        labels = {"consumergroup": "", "topics": "memory"}
        seen = []
        for _ in range(2):
            deadline = time.monotonic() + 10
            while loader.stats()["longest_wait_s"] < 0.3 * (len(seen) + 1):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            seen.append(sample(scrape(server), "kfeed_loader_stall_seconds_total", **labels))
        assert seen[0] >= 0.3 and seen[1] >= seen[0] + 0.2, seen
        assert sample(scrape(server), "kfeed_loader_wait_seconds_count", **labels) == 1
    finally:
        loader.close()
    starved.join(10)


def test_a_loader_waiting_for_its_first_batch_shows_the_wait_so_far(server):
    # Stall and startup both read 0 while the first batch did not come (brokers
    # that do not answer, a group that assigns nothing): a stuck job looked idle.
    schema = kfeed.Schema({"id": ("int64", ())})
    loader = kfeed.Loader(None, "memory", schema, 10, device="cpu",
                          source=kfeed.MemorySource({("memory", 0): []}))

    def starve() -> None:
        with contextlib.suppress(kfeed.KfeedError):
            next(loader, None)

    starved = threading.Thread(target=starve, daemon=True)
    try:
        starved.start()  # no record will come: it waits till close()
        deadline = time.monotonic() + 10
        while loader.stats()["startup_s"] < 0.3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got = sample(scrape(server), "kfeed_loader_startup_seconds", consumergroup="",
                     topics="memory")
        assert got >= 0.3 and loader.stats()["batches"] == 0
    finally:
        loader.close()
    starved.join(10)
    # Closed, it stays what it was (it grew on after a read that ended with no batch).
    closed = loader.stats()["startup_s"]
    time.sleep(0.2)
    assert loader.stats()["startup_s"] == closed >= 0.3


def test_startup_counts_the_brokers_answers_before_the_thread_starts():
    # The clock started once the window was resolved (the brokers asked for
    # partitions, commits and ends): a loader stuck there showed startup 0.
    schema = kfeed.Schema({"id": ("int64", ())})

    class Slow(kfeed.MemorySource):
        def partitions(self):  # type: ignore[no-untyped-def]
            time.sleep(0.5)  # brokers slow to answer
            return super().partitions()

    loader = kfeed.Loader(None, "memory", schema, 10, device="cpu", until="end", epochs=2,
                          source=Slow(schema.encode_blocks({"id": np.arange(100)}, 10)))
    seen: list[float] = []
    reader = threading.Thread(target=lambda: (time.sleep(0.3), seen.append(
        loader.stats()["startup_s"])))
    with loader:
        reader.start()
        t = time.monotonic()
        next(loader)
        wall = time.monotonic() - t
        reader.join(10)
        assert seen[0] >= 0.25
        assert wall - 0.1 <= loader.stats()["startup_s"] <= wall


class _SlowSource(kfeed.MemorySource):
    """Synchronous commits take 0.4 s, and so does joining the group after the first time."""

    opened = 0

    def open(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.opened += 1
        if self.opened > 1:
            time.sleep(0.4)
        return super().open(*args, **kwargs)

    def commit(self, positions, asynchronous):  # type: ignore[no-untyped-def]
        if not asynchronous:
            time.sleep(0.4)
        return super().commit(positions, asynchronous)


def test_the_stall_counter_never_goes_down_and_an_epoch_s_join_is_no_stall():
    # The end of a read's final commit showed as stall while it lasted, then
    # went (a counter reset to Prometheus, its rate a spike); each later
    # epoch's join counted as stall, where the first epoch's is startup.
    schema = kfeed.Schema({"id": ("int64", ())})
    source = _SlowSource(schema.encode_blocks({"id": np.arange(100)}, 10))
    loader = kfeed.Loader(None, "memory", schema, 10, source=source, device="cpu",
                          until="end", epochs=2)
    seen: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(loader.stats()["wait_s"])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    with loader:
        watcher.start()
        for _ in range(2):
            assert sum(b.size for b in loader) == 100
        done.set()
        watcher.join(10)
        assert source.opened == 2
        assert all(b >= a for a, b in zip(seen, seen[1:])), \
            [(a, b) for a, b in zip(seen, seen[1:]) if b < a]
        assert loader.stats()["wait_s"] < 0.3


def test_stats_read_while_an_epoch_s_stages_are_made_count_the_old_ones_once(monkeypatch):
    # set_epoch carried the counts over before it made the new stages: a
    # scrape in between added the old stages' counts twice, and the next
    # scrape went down again (a counter reset to Prometheus).
    schema = kfeed.Schema({"id": ("int64", ())})
    loader = memory_loader(schema.encode_blocks({"id": np.arange(1000)}, 10), schema, 10,
                           device="cpu", until="end", epochs=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    setup = kfeed.Loader._setup

    def slow_setup(self, *args):  # the new stages take a while
        time.sleep(0.3)
        return setup(self, *args)

    monkeypatch.setattr(kfeed.Loader, "_setup", slow_setup)
    keys = ("bytes", "samples_decoded", "rebalances")
    before = {k: loader.stats()[k] for k in keys}
    during = {}
    reader = threading.Thread(target=lambda: (time.sleep(0.15), during.update(
        {k: loader.stats()[k] for k in keys})))
    with loader:
        reader.start()
        loader.set_epoch(1)
        reader.join(10)
        after = {k: loader.stats()[k] for k in keys}
    # (The old thread decodes on till set_epoch stops it; the new one is not
    # started yet.)
    assert before["bytes"] > 0 and during == after
    assert all(before[k] <= after[k] for k in keys)


def test_a_wait_that_ends_while_stats_are_read_is_not_counted_twice():
    # stats() read the wait under way, then (after the lag) the waits before:
    # one that ended in between was in both, and the next scrape was lower.
    schema = kfeed.Schema({"id": ("int64", ())})
    loader = kfeed.Loader(None, "memory", schema, 10, device="cpu",
                          source=kfeed.MemorySource(schema.encode_blocks(
                              {"id": np.arange(100)}, 10), loop=True))
    with loader:
        next(loader), next(loader)
        source, lag = loader._source, loader._source.lag
        loader._waiting_since = time.monotonic() - 10.0  # another thread's next(), 10 s in

        def ends_meanwhile(*args, **kwargs):  # its batch comes while stats() asks the lag
            if loader._waiting_since is not None:
                loader._waited(time.monotonic() - loader._waiting_since)
            return lag(*args, **kwargs)

        source.lag = ends_meanwhile
        first, second = loader.stats()["wait_s"], loader.stats()["wait_s"]
    assert 10.0 <= first <= second < 11.0, (first, second)


def test_brokers_away_say_so_once_not_at_every_lag_round(caplog):
    # Each round of the lag reader made clients with a logger of their own,
    # so librdkafka's "Connect ... failed" came again every round, to stderr.
    import logging

    schema = kfeed.Schema({"id": ("int64", ())})
    loader = kfeed.Loader({"bootstrap.servers": "127.0.0.1:1", "group.id": "g"}, "t", schema,
                          10, device="cpu")
    caplog.set_level(logging.INFO, logger="kfeed.librdkafka")
    server = metrics.serve(0, lag_interval_s=0.2)
    try:
        time.sleep(5)  # rounds of 1 s each (the brokers' timeout), 0.2 s apart
    finally:
        server.shutdown()
        loader.close()
    lines = [r for r in caplog.records if r.name == "kfeed.librdkafka"]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]


@pytest.mark.parametrize("batch_size", [8, 64, 100])
def test_every_batch_is_one_latency_observation(batch_size) -> None:
    # A batch that ended inside a block (batch_size under the records a
    # message holds) was no observation: 33 of 80 batches at batch_size=8.
    schema = kfeed.Schema({"id": ("int64", ())})
    source = kfeed.MemorySource(schema.encode_blocks({"id": np.arange(640)}, 64))
    with kfeed.Loader(None, "memory", schema, batch_size, source=source, until="end",
                      device="cpu") as loader:
        batches = sum(1 for _ in loader)
        assert loader.stats()["latency_histogram"].cumulative()[-1][1] == batches


def test_a_loader_closed_or_let_go_is_no_longer_published(server):
    import gc

    schema = kfeed.Schema({"id": ("int64", ())})
    values = schema.encode_blocks({"id": np.arange(10)}, 5)
    loader = memory_loader(values, schema, 5, device="cpu", until="end")
    assert sum(1 for _ in loader) == 2
    assert scrape(server)["kfeed_loader_samples"]
    loader.close()  # still referenced (as by a traceback after an error): not published
    assert not scrape(server)["kfeed_loader_samples"]
    other = memory_loader(values, schema, 5, device="cpu", until="end")
    assert sum(1 for _ in other) == 2
    assert scrape(server)["kfeed_loader_samples"]
    del other  # never closed: collected, so gone too
    gc.collect()
    assert not scrape(server)["kfeed_loader_samples"]


def test_the_lag_in_seconds_of_a_closed_loaders_group_goes_with_it():
    # The lag reader's last round (every 15 s by default) still held the
    # group of a loader closed since: a scrape published its ages.
    values = SCHEMA.encode_blocks(synthetic_columns(np.arange(64)), 16)
    ages = SimpleNamespace(ages={})
    collector = metrics._Collector(ages)

    def published() -> set[str]:
        return {s.labels["consumergroup"] for family in collector.collect()
                if family.name == "kfeed_consumergroup_lag_seconds" for s in family.samples}

    loader = kfeed.Loader(None, "memory", SCHEMA, 16, device="cpu",
                          source=kfeed.MemorySource(values))
    group = loader.stats()["group"]
    ages.ages = {(group, "memory", "0"): 12.0, ("another", "t", "0"): 3.0}
    assert published() == {group}
    loader.close()
    assert published() == set()


def test_the_lag_in_seconds_asks_for_every_topic_of_a_groups_loaders():
    # Keyed by group, the last loader's topics won: a group's loaders on two
    # topics had ages published for one of them.
    config = {"bootstrap.servers": "127.0.0.1:9"}
    loaders = [SimpleNamespace(lag_target=lambda: (config, "g", ["clicks"])),
               SimpleNamespace(lag_target=lambda: (config, "g", ["views", "clicks"])),
               SimpleNamespace(lag_target=lambda: (config, "other", ["clicks"])),
               SimpleNamespace(lag_target=lambda: None)]
    assert metrics.lag_targets(loaders) == [(config, "g", ["clicks", "views"]),
                                            (config, "other", ["clicks"])]


def test_serve_refuses_what_it_cannot_do():
    with pytest.raises(kfeed.ConfigError, match="port must be an int"):
        metrics.serve(70000)
    # (An infinite interval was taken, and the lag reader's thread died of it.)
    for bad in (float("inf"), float("nan"), 0, -1, True, "15"):
        with pytest.raises(kfeed.ConfigError, match=r"lag_interval_s must be seconds in "
                                                    r"\(0, 86400\]"):
            metrics.serve(0, lag_interval_s=bad)
    s = metrics.serve(0)
    try:
        with pytest.raises(kfeed.ConfigError, match="cannot serve metrics on 127.0.0.1:"):
            metrics.serve(s.server_port)
    finally:
        s.shutdown()
    # Shut down, the port is free: serving on it again works (it stayed bound).
    again = metrics.serve(s.server_port)
    again.shutdown()


def test_two_loaders_of_the_same_topics_are_two_series_and_epochs_only_add(server):
    schema = kfeed.Schema({"id": ("int64", ())})
    values = schema.encode_blocks({"id": np.arange(100)}, 10)
    with memory_loader(values, schema, 10, device="cpu", until="end") as a, \
            memory_loader(values, schema, 10, device="cpu", until="end", epochs=3) as b:
        assert sum(1 for _ in a) == 10
        seen = []
        for _epoch in range(3):
            assert sum(1 for _ in b) == 10
            got = scrape(server)
            series = [x for x in got["kfeed_loader_samples"] if x.name.endswith("_total")]
            assert len({tuple(sorted(x.labels.items())) for x in series}) == len(series) == 2
            seen.append(sorted(x.value for x in series))
            assert b.stats()["bytes"] == (len(seen)) * a.stats()["bytes"]
    # The loader of three epochs counts on: 100, 200, 300 samples, never back to 100.
    assert seen == [[100, 100], [100, 200], [100, 300]]


def test_without_prometheus_client_kfeed_imports_and_runs():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "import kfeed, numpy as np\n"
            "from kfeed import metrics\n"
            "from kfeed.loader import memory_loader\n"
            "s = kfeed.Schema({'id': ('int64', ())})\n"
            "l = memory_loader(s.encode_blocks({'id': np.arange(8)}, 4), s, 4, device='cpu',"
            " until='end')\n"
            "assert sum(b.size for b in l) == 8\n"
            "try:\n    metrics.serve(0)\nexcept kfeed.ConfigError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "pip install 'kfeed[metrics]'" in done.stdout


@pytest.mark.integration
def test_the_producer_and_a_kafka_loader_under_their_real_names(server, bootstrap, make_topic):
    topic = make_topic(partitions=2)
    schema = kfeed.Schema({"id": ("int64", ())})
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema) as p:
        p.send({"id": np.arange(640)})
        p.flush()
        got = scrape(server)
        assert sample(got, "kfeed_producer_samples_total", topic=topic) == 640
        assert sample(got, "kfeed_producer_messages_total", topic=topic) == p.messages == 10
        assert sample(got, "kfeed_producer_queue_messages", topic=topic) == 0
        assert sample(got, "kfeed_producer_delivery_failures_total", topic=topic) == 0
    # Closed (and still referenced, as p is): no longer published.
    assert not [x for x in scrape(server)["kfeed_producer_samples"] if x.labels["topic"] == topic]
    group = uuid.uuid4().hex
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group}, topic, schema, 64,
                      device="cpu", until="end") as loader:
        n = sum(b.size for b in loader)
        got = scrape(server)
    assert n == 640
    assert sample(got, "kfeed_loader_samples_total", consumergroup=group, topics=topic) == 640
    lags = [s for s in got["kafka_consumergroup_lag"] if s.labels["consumergroup"] == group]
    assert sorted(s.labels["partition"] for s in lags) == ["0", "1"]
    assert all(s.value == 0 for s in lags)


@pytest.mark.integration
def test_the_lag_in_seconds_is_the_age_of_the_groups_next_unread_record(bootstrap, make_topic):

    from confluent_kafka import Producer as KafkaProducer

    topic = make_topic(partitions=2)
    schema = kfeed.Schema({"id": ("int64", ())})
    # Records an hour old, a second apart: record k of a partition is k seconds younger.
    base_ms = int(time.time() * 1000) - 3_600_000
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for part, n in ((0, 100), (1, 30)):
        for k, v in enumerate(schema.encode_raw({"id": np.arange(n)})):
            p.produce(topic, v, partition=part, timestamp=base_ms + k * 1000)
    assert p.flush(30) == 0
    config = {"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}
    server = metrics.serve(0, lag_interval_s=0.3)
    try:
        with kfeed.Loader(config, topic, schema, 10, device="cpu", format="raw") as loader:
            it = iter(loader)
            for _ in range(7):
                next(it)
            loader.commit()
            deadline = time.monotonic() + 30
            while True:
                committed = {p.partition: p.committed for p in kfeed.group_lag(
                    config, config["group.id"], [topic])}
                if sum(c or 0 for c in committed.values()) == 130 - 60:
                    break
                assert time.monotonic() < deadline, committed
                time.sleep(0.2)
            want = {part: 0.0 if committed[part] == n
                    else time.time() - (base_ms + committed[part] * 1000) / 1000
                    for part, n in ((0, 100), (1, 30))}
            deadline = time.monotonic() + 30
            while True:  # a round of the lag reader after the commit
                got = {int(s.labels["partition"]): s.value for s in
                       scrape(server).get("kfeed_consumergroup_lag_seconds", [])
                       if s.labels["consumergroup"] == config["group.id"]}
                if got.keys() == {0, 1} and abs(got[0] - want[0]) < 5:
                    break
                assert time.monotonic() < deadline, got
                time.sleep(0.2)
        assert got == pytest.approx(want, abs=5)
        assert 3400 < max(got.values()) < 3700
    finally:
        server.shutdown()


# -- a real Prometheus server scrapes a running loader -------------------------------------


def prometheus_binary(tmp_root) -> str:
    """Debian's prometheus: on PATH, or unpacked once from its package into kfeed's cache."""
    import os
    import shutil

    from kfeed.cluster._jars import cache_root

    found = shutil.which("prometheus")
    if found:
        return found
    unpacked = cache_root() / "prometheus-deb"
    binary = unpacked / "usr" / "bin" / "prometheus"
    if binary.exists():
        return str(binary)
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        pytest.skip("no prometheus, and no apt-get to fetch Debian's package of it")
    work = tmp_root / "deb"
    work.mkdir()
    got = subprocess.run(["apt-get", "download", "prometheus"], cwd=work, check=False,
                         capture_output=True, timeout=600)
    if got.returncode != 0:  # the package lists may be missing or stale
        subprocess.run(["apt-get", "update"], check=True, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "download", "prometheus"], cwd=work, check=True,
                       capture_output=True, timeout=600)
    deb = next(work.glob("prometheus_*.deb"))
    tmp = unpacked.with_name(f".prometheus-deb-{os.getpid()}")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True, timeout=300)
    tmp.rename(unpacked)
    return str(binary)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def prometheus(tmp_path, server):
    """A Prometheus server scraping ``server`` every second; its query function."""
    import json
    import urllib.parse

    binary = prometheus_binary(tmp_path)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: kfeed\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{server.server_port}']}}]\n")
    with open(tmp_path / "prom.log", "wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=log)

    def query(expr: str) -> list:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]["result"]

    # Until it has scraped the endpoint once (it picks targets up about 5 s in).
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "prom.log").read_text()[-3000:]
        try:
            if query('up{job="kfeed"} == 1'):
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "prometheus did not scrape kfeed's endpoint"
        time.sleep(0.2)
    try:
        yield query
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.integration
def test_a_real_prometheus_scrapes_the_lag_and_the_rates(prometheus, bootstrap, make_topic):

    topic = make_topic(partitions=2)
    schema = kfeed.Schema({"id": ("int64", ())})
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema) as p:
        p.send({"id": np.arange(6400)}, partition=0)
        p.send({"id": np.arange(6400)}, partition=1)
    group = uuid.uuid4().hex
    loader = kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group}, topic, schema,
                          64, device="cpu", prefetch=1)
    try:
        # Read for about 4 s, slowly: a few scrapes see the counters grow.
        t0 = time.monotonic()
        it = iter(loader)
        while time.monotonic() - t0 < 4:
            next(it)
            time.sleep(0.05)
        stats = loader.stats()
        done = stats["samples"]
        deadline = time.monotonic() + 30
        while True:  # the scrape after the last batch
            got = prometheus(f'kfeed_loader_samples_total{{consumergroup="{group}"}}')
            if got and float(got[0]["value"][1]) == done:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.3)
        rate = prometheus(f'rate(kfeed_loader_samples_total{{consumergroup="{group}"}}[10s])')
        assert rate and float(rate[0]["value"][1]) > 0
        lag = prometheus(f'kafka_consumergroup_lag{{consumergroup="{group}"}}')
        by_partition = {r["metric"]["partition"]: float(r["value"][1]) for r in lag}
        want = {key.split("[")[1].rstrip("]"): n for key, n in loader.stats()["lag"].items()}
        assert set(by_partition) == {"0", "1"}
        # What Prometheus last scraped, and what the loader says now: the same
        # batches were handed out in between (none since), so the same lag.
        assert by_partition == pytest.approx({k: float(v) for k, v in want.items()})
        assert sum(by_partition.values()) == (12800 - done) / 64  # messages: blocks of 64
        # docs/grafana-kfeed.json: every panel's query is one Prometheus runs, and
        # those of the loader's panels find this loader.
        import json
        from pathlib import Path

        dashboard = json.loads((Path(__file__).parents[1] / "docs" /
                                "grafana-kfeed.json").read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                result = prometheus(target["expr"].replace("$group", group))
                if "kfeed_loader" in target["expr"] and "bad_records" not in target["expr"]:
                    assert result, (panel["title"], target["expr"])
                if "kafka_consumergroup_lag" in target["expr"]:
                    assert sum(float(r["value"][1]) for r in result) == sum(by_partition.values())
    finally:
        loader.close()


class _Nvml:
    """NVML as nvidia-ml-py presents it, for one device, its answers set by the test.

    The reader's own logic is what is tested here (which device, the units,
    what a failing device does); bench/gpu_check.py reads the real NVML on a GPU.
    """

    class NVMLError(Exception):
        pass

    def __init__(self, uuid: str, busy: int, used: int, total: int) -> None:
        self.uuid, self.busy, self.used, self.total = uuid, busy, used, total
        self.broken = False
        self.shutdowns = 0

    def nvmlShutdown(self):  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802 - NVML's names
        if uuid != self.uuid:
            raise self.NVMLError("Not Found")
        return ("handle", uuid)

    def nvmlDeviceGetUtilizationRates(self, handle):  # noqa: N802
        if self.broken:
            raise self.NVMLError("GPU is lost")
        return type("Rates", (), {"gpu": self.busy, "memory": 0})()

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        return type("Memory", (), {"used": self.used, "total": self.total,
                                   "free": self.total - self.used})()


def test_gpu_metrics_are_nvml_s_figures_for_the_devices_loaders_feed(caplog):
    nvml = _Nvml("GPU-5a1d", busy=37, used=3 << 30, total=80 << 30)
    # torch gives the UUID without NVML's "GPU-" prefix; device 1 is one NVML does not know.
    reader = metrics.GpuReader(nvml, uuid_of={0: "5a1d", 1: "0bad"}.__getitem__)
    with caplog.at_level("WARNING", logger="kfeed.metrics"):
        got = reader.read({0, 1})
        assert got == [(["0", "GPU-5a1d"], 0.37, 3 << 30, 80 << 30)]
        assert reader.read({0, 1}) == got
        nvml.broken = True
        assert reader.read({0}) == [] and reader.read({0}) == []
        nvml.broken, nvml.busy = False, 100
        assert reader.read({0}) == [(["0", "GPU-5a1d"], 1.0, 3 << 30, 80 << 30)]
    # One line for the unknown device, one for the failure, however many scrapes.
    assert [r.getMessage() for r in caplog.records] == [
        "no GPU metrics for cuda:1: NVML knows no device 0bad",
        "GPU metrics of cuda:0: GPU is lost"]
    # NVML counts its nvmlInit callers: serve()'s reader was never closed, so
    # each serve() and shutdown() left one more (the server's stop closes it).
    reader.close()
    reader.close()
    assert nvml.shutdowns == 1 and reader.read({0}) == []


def test_without_a_gpu_a_scrape_has_no_gpu_metrics(server):
    import torch

    schema = kfeed.Schema({"id": ("int64", ())})
    values = schema.encode_blocks({"id": np.arange(10)}, 5)
    with memory_loader(values, schema, 5, device="cpu", until="end") as loader:
        assert sum(1 for _ in loader) == 2
        got = scrape(server)
        assert loader.cuda_index is None
    assert got["kfeed_loader_samples"]
    if not torch.cuda.is_available():
        assert metrics.GpuReader.open() is None
    # A CPU loader feeds no GPU: nothing of NVML's is published for it.
    assert not [name for name in got if name.startswith("kfeed_gpu_")]


@pytest.mark.timeout(180)
def test_the_gpu_check_runs_on_the_cpu_and_scrapes_the_metrics(tmp_path):
    # bench/gpu_check.py is the GPU's only proof, run where a device is lent:
    # its CPU mode keeps every section of it working meanwhile.
    import json
    import pathlib

    script = pathlib.Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--samples", "3000",
                           "--copies", "10", "--steps", "10", "--workers", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert not result["gpu_figures"] and result["stall"] and result["run_ahead"]
    assert result["bandwidth"][0]["us_per_batch"] > 0
    assert result["gpu_metrics"]["samples"] == []  # a CPU loader: no GPU to report
    assert "d. GPU metrics" in done.stdout


def test_a_producer_left_by_an_exception_is_no_longer_published(bootstrap, make_topic):
    # close() took it off the endpoint; a with block left by an exception did not.
    schema = kfeed.Schema({"id": ("int64", ())})
    topic = make_topic(partitions=1)
    with pytest.raises(RuntimeError, match="the step failed"):
        with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema) as producer:
            producer.send({"id": np.arange(10)})
            assert producer in metrics.LIVE
            raise RuntimeError("the step failed")
    assert producer not in metrics.LIVE
