"""Fixtures shared by the whole suite: a real Kafka cluster, fresh topics and groups.

Unit tests (no marker) never touch a broker. Tests marked ``integration`` get
the ``bootstrap`` fixture automatically: the cluster that ``KFEED_BOOTSTRAP``
names (``make test`` starts a 3-node one and sets it, with
``KFEED_CLUSTER_DIR``), or else a 1-node cluster that this test run starts with
``kfeed.cluster`` in a temporary folder and always stops. Tests marked
``cluster3`` are skipped when fewer than 3 brokers answer. ``schema_registry``
starts a real Schema Registry (``kfeed.cluster.start_schema_registry``) for the
tests that ask for it.
"""

from __future__ import annotations

import faulthandler
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Where the search for free ports starts: away from the default 39092 and make
# test's 29092, so the session cluster never collides with one a developer keeps
# running.
FALLBACK_PORT = 39392
TOPIC_TIMEOUT_S = 60.0


# A crash in native code (librdkafka's assertions abort) ends pytest with no
# summary, and the stacks of every thread that the fault handler prints are
# long enough to push the crashing one out of a CI log's tail. With
# KFEED_CRASH_LOG set (``make test`` sets it, with ``-p no:faulthandler``),
# they go to that file after the name of the test that was running, and
# ``make test`` prints its head when pytest did not end by itself.
_crash_log: Any = None


def pytest_configure(config: pytest.Config) -> None:
    global _crash_log
    path = os.environ.get("KFEED_CRASH_LOG")
    if path:
        _crash_log = open(path, "w")  # noqa: SIM115 - open until the process ends
        faulthandler.enable(_crash_log, all_threads=True)


def pytest_runtest_logstart(nodeid: str) -> None:
    if _crash_log is not None:
        _crash_log.seek(0)
        _crash_log.write(f"running {nodeid}\n")
        _crash_log.truncate()
        _crash_log.flush()


@pytest.fixture(scope="session")
def _cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path | None]]:
    from kfeed import cluster

    servers = os.environ.get("KFEED_BOOTSTRAP")
    state = os.environ.get("KFEED_CLUSTER_DIR")
    if servers or state:
        yield (servers or cluster.bootstrap(state)), (Path(state) if state else None)
        return
    state_dir = tmp_path_factory.mktemp("kfeed-cluster")
    servers = cluster.up(nodes=1, dir=state_dir, port=cluster.free_port_base(1, FALLBACK_PORT))
    try:
        yield servers, state_dir
    finally:
        cluster.down(state_dir, wipe=True)


@pytest.fixture(scope="session")
def schema_registry(_schema_registry: tuple[str, Path]) -> str:
    """The URL of a real Schema Registry (Apicurio, started here; stopped after the session)."""
    return _schema_registry[0]


@pytest.fixture(scope="session")
def _schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The Schema Registry's URL and the folder it runs for (``kfeed.cluster``'s).

    Under ``make test`` it runs for the test cluster's folder, so the cluster's
    ``down`` stops it even when pytest was killed before its teardown (one left
    there by such a run is stopped first).
    """
    import socket

    from kfeed import cluster

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    state = os.environ.get("KFEED_CLUSTER_DIR")
    state_dir = Path(state) if state else tmp_path_factory.mktemp("kfeed-schema-registry")
    cluster.stop_schema_registry(state_dir)
    url = cluster.start_schema_registry(state_dir, port)
    try:
        yield url, state_dir
    finally:
        assert cluster.stop_schema_registry(state_dir) is not None, "it was not running"


@pytest.fixture(scope="session")
def bootstrap(_cluster: tuple[str, Path | None]) -> str:
    """The bootstrap servers of the test cluster, e.g. ``127.0.0.1:39092,...``."""
    return _cluster[0]


@pytest.fixture(scope="session")
def cluster_dir(_cluster: tuple[str, Path | None]) -> Path | None:
    """The state folder of the test cluster, for fault injection; None for an external cluster."""
    return _cluster[1]


@pytest.fixture(scope="session")
def broker_count(bootstrap: str) -> int:
    """How many brokers the test cluster's metadata lists."""
    return len(_admin(bootstrap).list_topics(timeout=30).brokers)


@pytest.fixture(autouse=True)
def _cluster_markers(request: pytest.FixtureRequest) -> None:
    # Fixtures stay lazy, so unit tests never start a cluster.
    node = request.node
    if node.get_closest_marker("integration") or node.get_closest_marker("cluster3"):
        request.getfixturevalue("bootstrap")
    if node.get_closest_marker("cluster3"):
        count = request.getfixturevalue("broker_count")
        if count < 3:
            pytest.skip(f"needs the 3-node cluster (make test starts one); this one has {count} broker(s)")


@pytest.fixture
def make_topic(bootstrap: str, broker_count: int) -> Iterator[Callable[..., str]]:
    """A factory ``make_topic(partitions=4, replication=None, config=None) -> name``.

    Each call creates a fresh uuid-named topic (replication defaults to
    min(3, brokers)) and waits until every partition has a leader; the topics
    are deleted at teardown.
    """
    from confluent_kafka.admin import NewTopic

    admin = _admin(bootstrap)
    created: list[str] = []

    def make(partitions: int = 4, replication: int | None = None, config: dict[str, Any] | None = None) -> str:
        name = f"kfeed-test-{uuid.uuid4().hex}"
        factor = replication if replication is not None else min(3, broker_count)
        topic = NewTopic(
            name,
            num_partitions=partitions,
            replication_factor=factor,
            config={key: str(value) for key, value in (config or {}).items()},
        )
        admin.create_topics([topic], operation_timeout=TOPIC_TIMEOUT_S)[name].result(timeout=TOPIC_TIMEOUT_S)
        created.append(name)
        _wait_for_leaders(admin, name, partitions)
        return name

    yield make
    if created:
        for future in admin.delete_topics(created, operation_timeout=TOPIC_TIMEOUT_S).values():
            try:
                future.result(timeout=TOPIC_TIMEOUT_S)
            except Exception:  # best effort: a fault test may have left a node down
                pass


@pytest.fixture
def topic(make_topic: Callable[..., str]) -> str:
    """A fresh topic with 4 partitions."""
    return make_topic(partitions=4)


@pytest.fixture
def group_id() -> str:
    """A fresh consumer group id."""
    return f"kfeed-test-{uuid.uuid4().hex}"


def _admin(bootstrap: str) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap})


def _wait_for_leaders(admin: Any, name: str, partitions: int) -> None:
    # CreateTopics returns before every broker's metadata has the new leaders;
    # a producer started right away would log UNKNOWN_TOPIC_OR_PART.
    deadline = time.monotonic() + TOPIC_TIMEOUT_S
    while True:
        meta = admin.list_topics(topic=name, timeout=10).topics.get(name)
        if (
            meta is not None
            and meta.error is None
            and len(meta.partitions) == partitions
            and all(p.leader >= 0 for p in meta.partitions.values())
        ):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topic {name} has no leader for every partition after {TOPIC_TIMEOUT_S:.0f} s")
        time.sleep(0.1)
