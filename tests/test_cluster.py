"""The local cluster tool: its lifecycle, the 3-node settings, and every failure it reports.

``make test`` runs these while its own 3-node cluster holds 39092-39094, so
every cluster started here lives in a temporary folder on a free port base of
its own, and is stopped in a ``finally``. The failure cases that stop before any
JVM starts are unmarked: they need no broker and take well under a second.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kfeed import cluster
from kfeed.cluster import _jars

SRC = Path(__file__).resolve().parents[1] / "src"
# Where the search for a free port base starts; other clusters (make test's on
# 39092, the session fallback) may hold ports on a shared machine.
FIRST_PORT = 39592


def kfeed(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kfeed cluster ARGS`` as a user would, with this checkout's sources."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "kfeed", "cluster", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def assert_fails_cleanly(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """A non-zero exit, no traceback, and one ``kfeed cluster:`` line; returns that line.

    Every needle must appear in stderr (the line, or the log tail after it).
    """
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kfeed cluster: ")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    return errors[0]


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout.strip().splitlines()[-1]


def jvms_in(state_dir: Path) -> list[int]:
    """Pids of live kafka.Kafka processes whose properties lie under ``state_dir``."""
    needle = os.fsencode(state_dir.resolve())
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"kafka.Kafka" in cmdline and needle in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A cluster state folder that is stopped and wiped whatever the test did."""
    path = tmp_path / "cluster"
    try:
        yield path
    finally:
        if (path / "cluster.json").exists():
            cluster.down(path, wipe=True)
        assert jvms_in(path) == []


@pytest.fixture
def port() -> int:
    """A base port whose 1- or 3-node layout is free now."""
    return cluster.free_port_base(3, FIRST_PORT)


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    path = tmp_path / "bin"
    path.mkdir()
    return path


def env_with_path(bin_dir: Path, **extra: str) -> dict[str, str]:
    """The environment with PATH reduced to ``bin_dir``: only the tools a test puts there exist."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "KAFKA_HOME")}
    env["PATH"] = str(bin_dir)
    env.update(extra)
    return env


def link_java(bin_dir: Path) -> None:
    java = shutil.which("java")
    if java is None:
        pytest.skip("needs java on PATH")
    (bin_dir / "java").symlink_to(java)


def write_script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def produce_and_consume(bootstrap: str, topic: str, value: bytes) -> bytes:
    """Write one message with acks=all and read the first message of ``topic`` back."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    errors: list[object] = []

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            errors.append(err)

    producer.produce(topic, value, key=b"k", on_delivery=delivered)
    assert producer.flush(30) == 0
    assert errors == []
    return consume_first(bootstrap, topic)


def consume_first(bootstrap: str, topic: str) -> bytes:
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"kfeed-test-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.subscribe([topic])
        for _ in range(60):
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                return msg.value()
        raise AssertionError(f"no message from {topic} within 60 s")
    finally:
        consumer.close()


def create_topic(bootstrap: str, partitions: int, replication: int) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"kfeed-test-{uuid.uuid4().hex}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, replication)])[name].result(timeout=60)
    return name


# -- the lifecycle of a 1-node cluster ---------------------------------------


@pytest.mark.integration
def test_one_node_lifecycle(state_dir: Path, bin_dir: Path, port: int) -> None:
    servers = f"127.0.0.1:{port}"
    d = str(state_dir)

    started = kfeed("up", "--dir", d, "--port", str(port))
    assert started.returncode == 0, started.stderr
    assert last_line(started) == servers

    status = kfeed("status", "--dir", d)
    assert status.returncode == 0, status.stderr
    assert last_line(status) == servers
    assert "node 1" in status.stdout and "alive" in status.stdout

    again = kfeed("up", "--dir", d, "--port", str(port))
    assert again.returncode == 0, again.stderr
    assert "already up" in again.stdout
    assert last_line(again) == servers

    topic = create_topic(servers, partitions=1, replication=1)
    assert produce_and_consume(servers, topic, b"hello kafka") == b"hello kafka"

    # The fault-injection API: a killed node is gone, a restarted one serves its old data.
    pid = cluster.node_pids(state_dir)[1]
    assert cluster.kill_node(state_dir, 1) == pid
    assert cluster.node_pids(state_dir) == {}
    cluster.start_node(state_dir, 1)
    assert cluster.status(state_dir)["brokers"] == [1]
    assert consume_first(servers, topic) == b"hello kafka"

    stopped = kfeed("down", "--dir", d)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped node 1" in stopped.stdout
    assert jvms_in(state_dir) == []
    assert not list(state_dir.glob("node-*/kafka.pid"))

    assert_fails_cleanly(kfeed("status", "--dir", d), "not running")

    nothing = kfeed("down", "--dir", d)
    assert nothing.returncode == 0, nothing.stderr
    assert "nothing running" in nothing.stdout

    # A second start needs neither Maven nor the network: mvn is not on PATH.
    assert _jars.cached_jars() is not None
    link_java(bin_dir)
    restarted = kfeed("up", "--dir", d, env=env_with_path(bin_dir))
    assert restarted.returncode == 0, restarted.stderr
    assert last_line(restarted) == servers
    assert consume_first(servers, topic) == b"hello kafka"  # down kept the data

    wiped = kfeed("down", "--dir", d, "--wipe")
    assert wiped.returncode == 0, wiped.stderr
    assert not state_dir.exists()
    assert jvms_in(state_dir) == []


# -- the 3-node session cluster ----------------------------------------------


@pytest.mark.cluster3
def test_three_nodes_replicate_with_min_isr_two(
    bootstrap: str, broker_count: int, make_topic: Callable[..., str]
) -> None:
    from confluent_kafka.admin import AdminClient, ConfigResource

    assert broker_count == 3
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert len(admin.describe_cluster().result(timeout=30).nodes) == 3

    topic = make_topic(partitions=3, replication=3)
    partitions = admin.list_topics(topic=topic, timeout=30).topics[topic].partitions
    assert all(len(p.replicas) == 3 and len(p.isrs) == 3 for p in partitions.values())

    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    configs = admin.describe_configs([resource])[resource].result(timeout=30)
    assert configs["min.insync.replicas"].value == "2"

    assert produce_and_consume(bootstrap, topic, b"replicated") == b"replicated"


@pytest.mark.integration
def test_status_of_the_session_cluster_ends_with_its_bootstrap(bootstrap: str, cluster_dir: Path | None) -> None:
    if cluster_dir is None:
        pytest.skip("the test cluster was not started by kfeed cluster")
    result = kfeed("status", "--dir", str(cluster_dir))
    assert result.returncode == 0, result.stderr
    assert last_line(result) == bootstrap


# -- failures, each reported in one line -------------------------------------


def test_java_missing(tmp_path: Path, bin_dir: Path, port: int) -> None:
    result = kfeed("up", "--dir", str(tmp_path / "c"), "--port", str(port), env=env_with_path(bin_dir))
    assert_fails_cleanly(result, "java not found", "install OpenJDK 17 or newer")
    assert not (tmp_path / "c").exists()


def test_java_older_than_17(tmp_path: Path, bin_dir: Path, port: int) -> None:
    write_script(bin_dir / "java", """echo 'java version "1.8.0_392"' >&2""")
    result = kfeed("up", "--dir", str(tmp_path / "c"), "--port", str(port), env=env_with_path(bin_dir))
    assert_fails_cleanly(result, "Java 8", "install OpenJDK 17 or newer")


def test_maven_missing_with_an_empty_cache(tmp_path: Path, bin_dir: Path, port: int) -> None:
    link_java(bin_dir)
    cache = tmp_path / "cache"
    env = env_with_path(bin_dir, XDG_CACHE_HOME=str(cache))
    result = kfeed("up", "--dir", str(tmp_path / "c"), "--port", str(port), env=env)
    assert_fails_cleanly(result, "mvn", "apt-get install maven")
    assert not (tmp_path / "c").exists()


def test_maven_cannot_resolve_names_the_artifact(tmp_path: Path, bin_dir: Path) -> None:
    link_java(bin_dir)
    write_script(
        bin_dir / "mvn",
        "echo '[ERROR] Failed to execute goal on project kfeed-local-kafka: Could not resolve dependencies"
        " for project io.kfeed:kfeed-local-kafka:pom:1: The following artifacts could not be resolved:"
        " org.apache.kafka:kafka_2.13:jar:4.1.1 (absent): Could not transfer artifact"
        " org.apache.kafka:kafka_2.13:jar:4.1.1 from/to central (https://repo.maven.apache.org/maven2):"
        " repo.maven.apache.org: Temporary failure in name resolution -> [Help 1]'\nexit 1",
    )
    cache = tmp_path / "cache"
    env = env_with_path(bin_dir, XDG_CACHE_HOME=str(cache))
    result = kfeed("jars", env=env)
    assert_fails_cleanly(result, "Maven could not resolve org.apache.kafka:kafka_2.13:jar:4.1.1")
    # Nothing half-written is left for the next run to trust.
    assert sorted(cache.rglob("*")) == [cache / "kfeed", cache / "kfeed" / "kafka-4.1.1"]


@pytest.mark.parametrize("offset", [0, cluster.CONTROLLER_PORT_OFFSET], ids=["broker", "controller"])
def test_port_already_taken_is_named(tmp_path: Path, port: int, offset: int) -> None:
    taken = port + offset
    with socket.socket() as holder:
        # Like the tool's own probe: a leftover TIME_WAIT must not fail the test.
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        result = kfeed("up", "--dir", str(tmp_path / "c"), "--port", str(port))
    assert_fails_cleanly(result, f"port {taken}", "already in use")
    assert jvms_in(tmp_path / "c") == []


def test_down_with_nothing_running(tmp_path: Path) -> None:
    result = kfeed("down", "--dir", str(tmp_path / "none"))
    assert result.returncode == 0, result.stderr
    assert "nothing running" in result.stdout


def test_status_without_a_cluster(tmp_path: Path) -> None:
    assert_fails_cleanly(kfeed("status", "--dir", str(tmp_path / "none")), "no cluster in")


def test_up_refuses_to_change_the_layout_of_an_existing_cluster(tmp_path: Path) -> None:
    from kfeed.cluster._layout import Layout

    Layout(nodes=3, port=41000, cluster_id="pPSYwmViQ-SqVjGzO3SKXQ").save(tmp_path)
    result = kfeed("up", "--nodes", "1", "--dir", str(tmp_path))
    assert_fails_cleanly(result, "holds a 3-node cluster on port 41000", "--wipe")


def test_the_cluster_tool_stays_light() -> None:
    # `kfeed cluster` must start fast and knows nothing of torch; the Kafka
    # client loads only when a broker is asked something.
    code = "import sys, kfeed.cluster; print(sorted({'torch', 'confluent_kafka'} & set(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_wipe_refuses_a_folder_that_is_not_a_cluster(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    assert_fails_cleanly(kfeed("down", "--dir", str(tmp_path), "--wipe"), "not a kfeed cluster")
    assert (tmp_path / "keep.txt").exists()


@pytest.mark.integration
def test_node_dying_during_start_shows_its_log_and_stops_the_others(state_dir: Path, port: int) -> None:
    # Node 2 finds data of another node id and exits at once; nodes 1 and 3
    # are healthy and must be stopped again.
    data = state_dir / "node-2" / "data"
    data.mkdir(parents=True)
    (data / "meta.properties").write_text(
        "version=1\nnode.id=99\ncluster.id=4L6g3nShT-eMCtK--X86sw\ndirectory.id=a6J4sRketHXygB3u5rHGtg\n"
    )
    result = kfeed("up", "--nodes", "3", "--dir", str(state_dir), "--port", str(port))
    error = assert_fails_cleanly(result, "server.log", "Stored node id 99")
    assert error.startswith("kfeed cluster: node 2 exited while starting")
    assert jvms_in(state_dir) == []


# -- pure helpers --------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('java version "1.8.0_392"', 8),
        ('openjdk version "21" 2023-09-19', 21),
        ("no version here", None),
    ],
)
def test_java_major_version(output: str, major: int | None) -> None:
    assert _jars.java_major_version(output) == major


def test_maven_failure_skips_our_own_project() -> None:
    output = (
        "[ERROR] Failed to execute goal on project kfeed-local-kafka: Could not resolve dependencies for project"
        " io.kfeed:kfeed-local-kafka:pom:1: Failed to collect dependencies at org.apache.kafka:kafka-tools:jar:4.1.1"
    )
    assert "org.apache.kafka:kafka-tools:jar:4.1.1" in _jars.maven_failure(output)


def test_layouts_scale_replication_with_node_count() -> None:
    one = cluster.node_properties(1, 1, port=40000, dir="/tmp/x")
    assert one["default.replication.factor"] == "1" and one["min.insync.replicas"] == "1"
    assert one["controller.quorum.voters"] == "1@127.0.0.1:40100"
    three = cluster.node_properties(3, 3, port=40000, dir="/tmp/x")
    assert three["listeners"] == "PLAINTEXT://127.0.0.1:40002,CONTROLLER://127.0.0.1:40102"
    assert three["transaction.state.log.min.isr"] == "2"
    assert three["log.dirs"] == "/tmp/x/node-3/data"
