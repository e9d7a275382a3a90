"""kfeed.metrics: what a Prometheus scrape of a live loader and producer reads.

The exposition is read over HTTP and parsed with prometheus_client's own
parser; every figure must equal what ``stats()`` says, and the lag appears
under kafka_exporter's name.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
import uuid

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kfeed
from kfeed import metrics
from kfeed.loader import memory_loader


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
    # Every next() after the first batch is one observation of the wait.
    assert sample(got, "kfeed_loader_wait_seconds_count", **labels) == 9
    assert sample(got, "kfeed_loader_wait_seconds_bucket", le="+Inf", **labels) == 9
    assert sample(got, "kfeed_loader_wait_seconds_sum", **labels) == pytest.approx(
        stats["wait_s"])
    assert sample(got, "kafka_consumergroup_lag", consumergroup="", topic="memory",
                  partition="0") == 0
    assert sample(got, "kfeed_loader_pool_bytes", **labels) == stats["pool_bytes"]


def test_a_loader_let_go_is_no_longer_published(server):
    schema = kfeed.Schema({"id": ("int64", ())})
    loader = memory_loader(schema.encode_blocks({"id": np.arange(10)}, 5), schema, 5,
                           device="cpu", until="end")
    assert sum(1 for _ in loader) == 2
    assert "kfeed_loader_samples" in scrape(server)
    loader.close()
    del loader
    import gc

    gc.collect()
    assert not scrape(server)["kfeed_loader_samples"]


def test_serve_refuses_what_it_cannot_do():
    with pytest.raises(kfeed.ConfigError, match="port must be an int"):
        metrics.serve(70000)
    s = metrics.serve(0)
    try:
        with pytest.raises(kfeed.ConfigError, match="cannot serve metrics on 127.0.0.1:"):
            metrics.serve(s.server_port)
    finally:
        s.shutdown()


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
