"""The local cluster tool: its lifecycle, the 3-node settings, and every failure it reports.

``make test`` runs these while its own 3-node cluster holds 29092-29094, so
every cluster started here lives in a temporary folder on a free port base of
its own, and is stopped in a ``finally``. The failure cases that stop before any
JVM starts are unmarked: they need no broker and take well under a second.

Every test gets a cluster registry of its own (``KFEED_CLUSTER_REGISTRY``), so
none reads or writes the user's records. The registry's unit tests run
stand-in processes (a sleeping Python named ``java`` with ``kafka.Kafka`` on
its command line) in place of nodes.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kfeed import cluster
from kfeed.cluster import _jars, _registry, _tool
from kfeed.cluster._procs import has_exited
from kfeed.cluster._layout import LOCK_FILE, STATE_FILE, Layout, new_cluster_id, write_properties
from kfeed.errors import ClusterError

SRC = Path(__file__).resolve().parents[1] / "src"
# Where the search for a free port base starts; other clusters (make test's on
# 29092, the session fallback) may hold ports on a shared machine. Below the
# kernel's ephemeral ports (32768-60999): there a client's outgoing connection
# can take a killed node's port before the node is started again.
FIRST_PORT = 29592


def kfeed(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kfeed cluster ARGS`` as a user would, with this checkout's sources."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "kfeed", "cluster", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A registry of this test's own: no test reads or writes the user's real cluster records."""
    path = tmp_path / "registry"
    monkeypatch.setenv(_registry.REGISTRY_ENV, str(path))
    return path


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


# A process whose main thread has exited while another thread still listens:
# what a killed JVM looks like for a moment, its command line already empty.
_MAIN_THREAD_GONE = """
import ctypes, socket, sys, threading, time
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
threading.Thread(target=time.sleep, args=(600,)).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_node_whose_threads_still_exit_has_not_exited_and_holds_its_port() -> None:
    child = subprocess.Popen([sys.executable, "-c", _MAIN_THREAD_GONE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        deadline = time.monotonic() + 30
        while not Path(f"/proc/{child.pid}/status").read_text().count("State:\tZ"):
            assert time.monotonic() < deadline, "the child's main thread never exited"
            time.sleep(0.05)
        assert Path(f"/proc/{child.pid}/cmdline").read_bytes() == b""
        assert not has_exited(child.pid)
        assert _tool._in_use(port)
    finally:
        child.kill()
        child.wait()
    assert has_exited(child.pid)
    assert not _tool._in_use(port)


def test_a_zombie_of_one_thread_has_exited_and_a_live_process_has_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while "State:\tZ" not in Path(f"/proc/{child.pid}/status").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert has_exited(child.pid)
    child.wait()
    assert not has_exited(os.getpid())


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


def test_a_taken_port_among_the_ephemeral_ones_says_why_it_may_be_taken() -> None:
    low, high = _tool._ephemeral_ports()
    base = cluster.free_port_base(1, low + 5000)
    assert low <= base <= high
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base))  # bound, not listening: as a connection's local end
        with pytest.raises(ClusterError) as e:
            _tool._check_ports(Layout(nodes=1, port=base, cluster_id=""), [1])
        holder.listen()  # a server there (another cluster, say): no such guess
        with pytest.raises(ClusterError) as served:
            _tool._check_ports(Layout(nodes=1, port=base, cluster_id=""), [1])
    assert str(served.value) == (f"port {base} (broker of node 1) is already in use on "
                                 f"127.0.0.1: free it or choose another base port (--port)")
    assert str(e.value) == (
        f"port {base} (broker of node 1) is already in use on 127.0.0.1: free it or choose "
        f"another base port (--port) (ports {low}-{high} are also the local ends of outgoing "
        f"connections, so one can hold it while its node is down: a base port below {low} "
        f"avoids that)")


@pytest.mark.parametrize("wipe", [[], ["--wipe"]], ids=["down", "wipe"])
def test_down_of_a_folder_without_a_cluster_exits_2_as_status_does(tmp_path: Path, wipe: list[str]) -> None:
    none = tmp_path / "none"
    result = kfeed("down", "--dir", str(none), *wipe)
    assert result.returncode == 2
    assert result.stdout == ""
    assert only_error(result) == (
        f"kfeed cluster: no cluster in {none} (start one with: kfeed cluster up --dir {none};"
        " kfeed cluster list shows the others)"
    )
    assert not none.exists()


def test_status_without_a_cluster(tmp_path: Path) -> None:
    result = kfeed("status", "--dir", str(tmp_path / "none"))
    assert_fails_cleanly(result, "no cluster in")
    assert result.returncode == 2


def test_up_refuses_to_change_the_layout_of_an_existing_cluster(tmp_path: Path) -> None:
    from kfeed.cluster._layout import Layout

    Layout(nodes=3, port=41000, cluster_id="pPSYwmViQ-SqVjGzO3SKXQ").save(tmp_path)
    result = kfeed("up", "--nodes", "1", "--dir", str(tmp_path))
    assert_fails_cleanly(result, "holds a 3-node cluster on port 41000", "--wipe")
    assert result.returncode == 2


def test_the_cluster_tool_stays_light() -> None:
    # `kfeed cluster` must start fast and knows nothing of torch; the Kafka
    # client loads only when a broker is asked something.
    code = "import sys, kfeed.cluster; print(sorted({'torch', 'confluent_kafka'} & set(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_status_from_anywhere_imports_no_torch(elsewhere: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kfeed", "cluster", "status"],
        capture_output=True, text=True, env=env, cwd=elsewhere, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    modules = [line.rsplit("|", 1)[-1].strip() for line in lines]
    assert "kfeed.cluster._registry" in modules  # the import log was read
    assert [m for m in modules if m.split(".")[0] == "torch"] == []
    assert result.returncode == 1


def test_wipe_refuses_a_folder_that_is_not_a_cluster(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    result = kfeed("down", "--dir", str(tmp_path), "--wipe")
    assert_fails_cleanly(result, f"no cluster in {tmp_path}")
    assert result.returncode == 2
    assert (tmp_path / "keep.txt").exists()


# -- the state folder: only the tool's own files, one command at a time -------


def test_up_refuses_a_folder_of_other_files(tmp_path: Path, bin_dir: Path) -> None:
    user = tmp_path / "project"
    (user / "src").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    # No java on PATH: an up that accepted the folder would fail later, with exit 1.
    result = kfeed("up", "--dir", str(user), "--port", "41000", env=env_with_path(bin_dir))
    assert result.returncode == 2
    assert only_error(result) == (
        f"kfeed cluster: {user} holds files (notes.txt, ...) and no cluster.json: not a kfeed cluster's folder;"
        " pass --dir a new or empty folder"
    )
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt", "src"]


def test_wipe_deletes_the_clusters_own_files_and_nothing_else(tmp_path: Path) -> None:
    # A cluster folder that also holds files of the user's (made by hand, or
    # by a kfeed that took any folder): a wipe leaves those and the folder.
    state = tmp_path / "cluster"
    layout = Layout(nodes=3, port=41000, cluster_id=new_cluster_id())
    state.mkdir()
    layout.save(state)
    for node_id in layout.node_ids:
        (layout.node_paths(state, node_id).data).mkdir(parents=True)
        (layout.node_paths(state, node_id).data / "meta.properties").write_text("")
    for own in ("log4j2.properties", "secure/ca.pem", "schema-registry/port"):
        (state / own).parent.mkdir(exist_ok=True)
        (state / own).write_text("")
    (state / "notes.txt").write_text("mine")
    (state / "node-9").mkdir()  # not a node of this layout

    result = kfeed("down", "--dir", str(state), "--wipe")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"nothing running in {state}", f"wiped {state} (the other files there are kept)"]
    assert sorted(p.name for p in state.iterdir()) == ["node-9", "notes.txt"]
    assert _registry.records() == []


def test_up_waits_for_another_commands_hold_on_the_folder_and_then_gives_up_in_one_line(
    tmp_path: Path, bin_dir: Path
) -> None:
    state = tmp_path / "c"
    state.mkdir()
    Layout(nodes=1, port=41000, cluster_id=new_cluster_id()).save(state)
    with open(state / LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("4242\n")
        lock.flush()
        result = kfeed("up", "--dir", str(state), "--timeout", "0.5", env=env_with_path(bin_dir))
    error = assert_fails_cleanly(result, f"waiting for another kfeed cluster command on {state}")
    assert error == (
        f"kfeed cluster: another kfeed cluster command (pid 4242) still works on {state} after 0 s:"
        " run this again once it has finished"
    )


def waiting_for_the_lock(state: Path, stderr: Path, args: list[str], env: dict[str, str]
                         ) -> subprocess.Popen[str]:
    """``kfeed cluster ARGS``, started while this test holds ``state``'s lock, once it says it
    waits for it; the lock is let go on return."""
    with open(state / LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(stderr, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kfeed", "cluster", *args], stdout=subprocess.PIPE,
                stderr=err, stdin=subprocess.DEVNULL, env=env, text=True,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while "waiting for another" not in stderr.read_text():
                assert proc.poll() is None, stderr.read_text()
                assert time.monotonic() < deadline, f"{args[0]} waited without a word"
                time.sleep(0.05)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return proc


def test_up_goes_on_once_the_other_command_lets_go_of_the_folder(tmp_path: Path, bin_dir: Path) -> None:
    state = tmp_path / "c"
    state.mkdir()
    Layout(nodes=1, port=41000, cluster_id=new_cluster_id()).save(state)
    stderr = tmp_path / "stderr"
    proc = waiting_for_the_lock(state, stderr, ["up", "--dir", str(state), "--timeout", "60"],
                                env_with_path(bin_dir, PYTHONPATH=str(SRC)))
    # Let go: up goes on to its next step, finding java, which this PATH lacks.
    assert proc.wait(timeout=30) == 1
    assert stderr.read_text().splitlines()[-1].startswith("kfeed cluster: java not found on PATH")


def test_a_lock_whose_file_a_wipe_deleted_is_taken_again_on_the_new_file(tmp_path: Path) -> None:
    state = tmp_path / "c"
    waiting = threading.Event()
    held_by_second: list[bool] = []

    def second() -> None:
        with _tool._locked(state, state, 30, progress=lambda _note: waiting.set()):
            # Held on the file now at the path: a third open of it cannot lock it.
            with open(state / LOCK_FILE) as third:
                try:
                    fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held_by_second.append(False)
                except BlockingIOError:
                    held_by_second.append(True)

    with _tool._locked(state, state, 30):
        thread = threading.Thread(target=second)
        thread.start()
        assert waiting.wait(30)
        shutil.rmtree(state)  # as down --wipe does, lock file included
    thread.join(30)
    assert held_by_second == [True]


def test_a_folder_made_only_for_the_lock_is_removed_when_up_fails_early(tmp_path: Path, bin_dir: Path) -> None:
    result = kfeed("up", "--dir", str(tmp_path / "a" / "b"), "--port", "41000", env=env_with_path(bin_dir))
    assert_fails_cleanly(result, "java not found")
    assert not (tmp_path / "a").exists()


def test_a_lock_file_made_in_an_existing_folder_is_removed_when_up_fails_early(
    tmp_path: Path, bin_dir: Path
) -> None:
    # The folder stayed, as it should, but held cluster.lock for ever after.
    state = tmp_path / "mine"
    state.mkdir()
    result = kfeed("up", "--dir", str(state), "--port", "41000", env=env_with_path(bin_dir))
    assert_fails_cleanly(result, "java not found")
    assert state.is_dir() and list(state.iterdir()) == []


@pytest.mark.parametrize("command", [["up"], ["status"], ["down"], ["down", "--wipe"]], ids=" ".join)
def test_a_file_as_dir_is_named(tmp_path: Path, bin_dir: Path, command: list[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    result = kfeed(*command, "--dir", str(afile), env=env_with_path(bin_dir))
    assert result.returncode == 2
    assert only_error(result) == f"kfeed cluster: {afile} is a file, not a cluster's folder: pass --dir a folder"
    assert afile.read_text() == "mine"


def test_an_unreadable_cluster_json_names_the_way_out_and_wipe_takes_it(tmp_path: Path) -> None:
    state = (tmp_path / "c").resolve()
    (state / "node-1" / "data").mkdir(parents=True)
    layout = Layout(nodes=1, port=41000, cluster_id=new_cluster_id())
    write_properties(state / "node-1" / "server.properties", layout.properties(1, state))
    (state / STATE_FILE).write_text("{not json")
    status = kfeed("status", "--dir", str(state))
    assert status.returncode == 1
    error = only_error(status)
    assert error.startswith(f"kfeed cluster: unreadable cluster state {state / STATE_FILE}: ")
    assert error.endswith(
        f": restore the file, or delete this cluster's files and stop its nodes with:"
        f" kfeed cluster down --dir {state} --wipe"
    )
    wiped = kfeed("down", "--dir", str(state), "--wipe")
    assert wiped.returncode == 0, wiped.stderr
    assert wiped.stdout.splitlines() == [f"nothing running in {state}", f"wiped {state}"]
    assert not state.exists()


def test_a_wipe_leaves_a_folder_it_cannot_tell_is_a_clusters(tmp_path: Path) -> None:
    # Any cluster.json it could not read was taken for a cluster's: a user's
    # folder with one of its own lost its node-1/, secure/ and log4j2.properties.
    user = tmp_path / "app"
    for name in ("node-1", "secure"):
        (user / name).mkdir(parents=True)
        (user / name / "notes.txt").write_text("mine")
    (user / STATE_FILE).write_text('{"name": "my app"}')
    (user / "log4j2.properties").write_text("# mine")
    wiped = kfeed("down", "--dir", str(user), "--wipe")
    assert wiped.returncode == 1
    assert only_error(wiped) == (
        f"kfeed cluster: unreadable cluster state {user / STATE_FILE}: 'nodes', and no node "
        f"folder in {user} is one this tool made: it wipes no folder it cannot tell is a "
        f"kfeed cluster's; delete the files yourself")
    for name in ("node-1/notes.txt", "secure/notes.txt"):
        assert (user / name).read_text() == "mine"
    assert (user / "log4j2.properties").read_text() == "# mine"
    assert (user / STATE_FILE).read_text() == '{"name": "my app"}'


def test_up_refuses_a_folder_whose_files_are_named_like_the_tools_without_a_cluster_json(
    tmp_path: Path, bin_dir: Path
) -> None:
    # Without cluster.json they are the user's: a start would overwrite them and a wipe delete them.
    user = tmp_path / "project"
    (user / "secure").mkdir(parents=True)
    (user / "secure" / "notes.txt").write_text("mine")
    (user / "log4j2.properties").write_text("# mine")
    (user / LOCK_FILE).write_text("")
    # No java on PATH: an up that accepted the folder would fail later, with exit 1.
    result = kfeed("up", "--dir", str(user), "--port", "41000", env=env_with_path(bin_dir))
    assert result.returncode == 2
    assert only_error(result) == (
        f"kfeed cluster: {user} holds files (log4j2.properties, ...) and no cluster.json: not a kfeed cluster's"
        " folder; pass --dir a new or empty folder"
    )
    assert (user / "secure" / "notes.txt").read_text() == "mine"
    assert (user / "log4j2.properties").read_text() == "# mine"


def test_up_refuses_a_path_with_a_comma(tmp_path: Path, bin_dir: Path) -> None:
    # log.dirs is a comma-separated list: Kafka would write into the folders on either side.
    state = tmp_path / "x,y"
    result = kfeed("up", "--dir", str(state), "--port", "41000", env=env_with_path(bin_dir))
    assert result.returncode == 2
    assert only_error(result) == (
        f"kfeed cluster: the path of {state} holds a comma, which Kafka reads as a list separator:"
        " pass --dir a folder whose path has none"
    )
    assert list(tmp_path.iterdir()) == [tmp_path / "bin"]


@pytest.mark.parametrize("command", [["up"], ["status"], ["down"], ["down", "--wipe"]], ids=" ".join)
def test_a_dir_below_a_file_is_named_in_one_line(tmp_path: Path, bin_dir: Path, command: list[str]) -> None:
    below = tmp_path / "afile" / "sub"
    (tmp_path / "afile").write_text("mine")
    result = kfeed(*command, "--dir", str(below), env=env_with_path(bin_dir))
    assert result.returncode == 2
    if command == ["up"]:
        expected = f"cannot write in {below} (Not a directory: {below}): pass --dir a folder you can write"
    else:
        expected = (
            f"no cluster in {below} (start one with: kfeed cluster up --dir {below};"
            " kfeed cluster list shows the others)"
        )
    assert only_error(result) == f"kfeed cluster: {expected}"
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("overrides", [None, ["num.partitions=4"]], ids=["null", "list"])
def test_overrides_that_are_not_an_object_are_an_unreadable_state_that_wipe_takes(
    standins: StandIns, overrides: object
) -> None:
    state = standins.start("a", 41000)
    proc = standins.procs[state][0]
    saved = json.loads((state / STATE_FILE).read_text())
    (state / STATE_FILE).write_text(json.dumps({**saved, "overrides": overrides}))
    status = kfeed("status", "--dir", str(state))
    assert status.returncode == 1
    assert only_error(status).startswith(
        f"kfeed cluster: unreadable cluster state {state / STATE_FILE}: overrides is {json.dumps(overrides)},"
        " not an object: restore the file"
    )
    listed = kfeed("list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == f"{state}  1 node  127.0.0.1:41000  running\n"
    wiped = kfeed("down", "--dir", str(state), "--wipe")
    assert wiped.returncode == 0, wiped.stderr
    assert wiped.stdout.splitlines() == [f"stopped node 1 in {state}", f"wiped {state}"]
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert not state.exists()


def test_a_node_whose_pid_file_was_lost_is_still_found_and_stopped(standins: StandIns) -> None:
    # Reported stopped: an up said its own port was taken, and a down --wipe
    # deleted the data under the running node.
    state = standins.start("a", 41000)
    proc = standins.procs[state][0]
    (state / "node-1" / "kafka.pid").write_text("")
    listed = kfeed("list")
    assert listed.stdout == f"{state}  1 node  127.0.0.1:41000  running\n", listed.stderr
    down = kfeed("down", "--dir", str(state))
    assert down.returncode == 0, down.stderr
    assert down.stdout.splitlines() == [f"stopped node 1 in {state}"]
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_a_copied_folder_s_pid_file_names_no_node_to_kill(standins: StandIns) -> None:
    # The copy's pid file names the running cluster's node: down told the user
    # to kill it ("left running: stop it with kill PID"), at every down again.
    state = standins.start("b", 41010)
    copy = state.with_name("b2")
    shutil.copytree(state, copy)
    for _ in range(2):
        down = kfeed("down", "--dir", str(copy))
        assert down.returncode == 0, down.stderr
        assert down.stdout.splitlines() == [f"nothing running in {copy}"]
        assert "kill" not in down.stderr, down.stderr
    assert not (copy / "node-1" / "kafka.pid").exists()
    assert standins.procs[state][0].poll() is None  # the other cluster's node runs on


def test_an_interrupted_format_leaves_no_storage_tool_running(tmp_path: Path, monkeypatch) -> None:
    # A Ctrl-C of up while the nodes' storage was formatted left those JVMs
    # running: they wrote into the folder after a wipe, and the next up failed.
    java = tmp_path / "java"
    java.write_text("#!/bin/sh\nexec sleep 60\n")
    java.chmod(0o755)
    layout = Layout(nodes=3, port=41000, cluster_id=new_cluster_id())
    state = tmp_path / "c"
    for n in layout.node_ids:
        layout.node_paths(state, n).root.mkdir(parents=True)
    children: list[subprocess.Popen[str]] = []
    popen = subprocess.Popen

    def started(*args: object, **kwargs: object) -> subprocess.Popen[str]:
        children.append(popen(*args, **kwargs))  # type: ignore[call-overload]
        return children[-1]

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_tool.subprocess, "Popen", started)
    before = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            _tool._format(str(java), tmp_path, layout, state, list(layout.node_ids))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert len(children) == 3 and all(p.poll() is not None for p in children)


def test_a_node_s_data_of_another_cluster_is_refused_before_the_start(tmp_path: Path) -> None:
    # Kafka's node waited to join its quorum (INCONSISTENT_CLUSTER_ID) and up
    # for its whole timeout, then said "not ready" over a tail of log lines.
    layout = Layout(nodes=1, port=41000, cluster_id=new_cluster_id())
    state = tmp_path / "c"
    data = layout.node_paths(state, 1).data
    data.mkdir(parents=True)
    (data / "meta.properties").write_text("version=1\ncluster.id=OtherCluster0000000000\n")
    with pytest.raises(ClusterError, match="^" + re.escape(
            f"{data} holds the data of cluster OtherCluster0000000000, not of this folder's "
            f"{layout.cluster_id}: move it away, or start over with: kfeed cluster down --dir "
            f"{state} --wipe") + "$"):
        _tool._format("no-java-needed", tmp_path, layout, state, [1])


def test_down_says_it_waits_for_another_commands_hold_on_the_folder(tmp_path: Path) -> None:
    state = tmp_path / "c"
    state.mkdir()
    Layout(nodes=1, port=41000, cluster_id=new_cluster_id()).save(state)
    stderr = tmp_path / "stderr"
    proc = waiting_for_the_lock(state, stderr, ["down", "--dir", str(state)],
                                dict(os.environ, PYTHONPATH=str(SRC)))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert stderr.read_text() == f"waiting for another kfeed cluster command on {state}\n"
    assert out == f"nothing running in {state}\n"


def test_a_wipe_of_the_current_directory_says_nothing_was_kept_when_nothing_was(tmp_path: Path) -> None:
    state = tmp_path / "c"
    state.mkdir()
    Layout(nodes=1, port=41000, cluster_id=new_cluster_id()).save(state)
    result = kfeed("down", "--dir", ".", "--wipe", cwd=state)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["nothing running in .", "wiped ."]
    assert list(state.iterdir()) == []  # the current directory itself stays


# -- broker settings (--set, --unset) ------------------------------------------


@pytest.fixture
def fake_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, str]]:
    """Starts that run no JVM: each records its settings; num.partitions=abc fails as the broker would."""
    started: list[dict[str, str]] = []
    monkeypatch.setattr(_jars, "java", lambda: "java")
    monkeypatch.setattr(_jars, "jars", lambda progress=None: tmp_path)
    monkeypatch.setattr(_tool, "_format", lambda *args: None)
    monkeypatch.setattr(_tool, "_launch", lambda java, libs, state_dir, paths: 0)
    monkeypatch.setattr(_tool, "_stop", lambda *args: [])

    def wait_ready(layout: Layout, *args: object, **kwargs: object) -> None:
        started.append(dict(layout.overrides))
        if layout.overrides.get("num.partitions") == "abc":
            raise ClusterError(
                "node 1 exited while starting: ConfigException: Invalid value abc for configuration"
                " num.partitions: Not a number of type INT\nlast lines of server.log:\n..."
            )

    monkeypatch.setattr(_tool, "_wait_ready", wait_ready)
    return started


def saved_overrides(state: Path) -> dict[str, str]:
    layout = Layout.load(state)
    assert layout is not None
    return layout.overrides


def test_a_setting_is_kept_only_once_a_start_with_it_has_succeeded(
    tmp_path: Path, port: int, fake_start: list[dict[str, str]]
) -> None:
    state = tmp_path / "c"
    with pytest.raises(ClusterError) as bad:
        cluster.up(dir=state, port=port, overrides={"num.partitions": "abc"})
    assert str(bad.value).splitlines()[0] == (
        "node 1 exited while starting: ConfigException: Invalid value abc for configuration num.partitions:"
        " Not a number of type INT (--set num.partitions=abc was not kept)"
    )
    assert saved_overrides(state) == {}
    # So a plain up starts as before the mistake.
    cluster.up(dir=state)
    cluster.up(dir=state, overrides={"log.retention.hours": "1"})
    assert fake_start == [{"num.partitions": "abc"}, {}, {"log.retention.hours": "1"}]
    assert saved_overrides(state) == {"log.retention.hours": "1"}


def test_unset_removes_a_kept_setting_that_stops_the_start(
    tmp_path: Path, port: int, fake_start: list[dict[str, str]]
) -> None:
    state = tmp_path / "c"
    state.mkdir()
    kept = {"num.partitions": "abc", "log.retention.hours": "1"}
    Layout(nodes=1, port=port, cluster_id=new_cluster_id(), overrides=kept).save(state)
    with pytest.raises(ClusterError) as bad:
        cluster.up(dir=state)
    assert str(bad.value).splitlines()[0].endswith(
        f"(num.partitions comes from an earlier --set: remove it with kfeed cluster up --dir {state}"
        " --unset num.partitions)"
    )
    assert saved_overrides(state) == kept
    cluster.up(dir=state, unset=["num.partitions"])
    assert saved_overrides(state) == {"log.retention.hours": "1"}


def test_a_node_that_exits_is_reported_with_the_exception_under_its_error_line(tmp_path: Path) -> None:
    state = tmp_path / "c"
    layout = Layout(nodes=1, port=41000, cluster_id=new_cluster_id())
    paths = layout.node_paths(state, 1)
    paths.logs.mkdir(parents=True)
    earlier = "[2026-01-01 00:00:00,000] ERROR Exiting Kafka due to fatal exception (kafka.Kafka$)\n"
    paths.server_log.write_text(
        earlier
        + "java.lang.RuntimeException: an earlier start's reason\n"
        + "[2026-01-01 00:01:00,000] INFO Registered `kafka:type=kafka.Log4jController` MBean\n"
    )
    since = _tool._log_sizes(paths)
    with paths.server_log.open("a") as log:
        log.write(
            "[2026-01-01 00:02:00,000] INFO starting (kafka.Kafka$)\n"
            + earlier
            + "org.apache.kafka.common.config.ConfigException: Invalid value abc for configuration"
            " num.partitions: Not a number of type INT\n"
            "\tat org.apache.kafka.common.config.ConfigDef.parseType(ConfigDef.java:776)\n"
            "\tat kafka.Kafka.main(Kafka.scala)\n"
            + "[2026-01-01 00:02:01,000] INFO shutting down (kafka.Kafka$)\n" * 30
        )
    reason = (
        "node 1 exited while starting: ConfigException: Invalid value abc for configuration num.partitions:"
        " Not a number of type INT"
    )
    # Not running (no pid file): reported at once.
    with pytest.raises(ClusterError) as e:
        _tool._wait_ready(layout, state, {1: 0}, [1], 5)
    assert str(e.value).splitlines()[0] == reason.replace(
        "ConfigException: Invalid value abc for configuration num.partitions: Not a number of type INT",
        "RuntimeException: an earlier start's reason",
    )
    with pytest.raises(ClusterError) as e:
        _tool._wait_ready(layout, state, {1: 0}, [1], 5, since={1: since})
    assert str(e.value).splitlines()[0] == reason
    assert str(e.value).splitlines()[1] == f"last lines of {paths.server_log}:"


@pytest.mark.parametrize("exec_after_s", [0.5, 600], ids=["late", "never"])
def test_a_java_slow_to_exec_the_jvm_is_waited_for_and_never_left_running(
    tmp_path: Path, port: int, monkeypatch: pytest.MonkeyPatch, exec_after_s: float
) -> None:
    # A wrapper named java (a version manager's shim) that execs a stand-in JVM
    # late or never: up must not call it exited while it still runs, nor leave
    # it behind when the start fails (the stand-in never answers).
    standin = tmp_path / "standin-bin" / "java"
    standin.parent.mkdir()
    standin.symlink_to(sys.executable)
    wrapper = tmp_path / "wrapper-bin" / "java"
    wrapper.parent.mkdir()
    wrapper.write_text(
        f"#!{sys.executable}\nimport os, sys, time\ntime.sleep({exec_after_s})\n"
        f"os.execv({str(standin)!r}, [{str(standin)!r}, '-c', 'import time; time.sleep(600)', *sys.argv[1:]])\n"
    )
    wrapper.chmod(0o755)
    monkeypatch.setattr(_jars, "java", lambda: str(wrapper))
    monkeypatch.setattr(_jars, "jars", lambda progress=None: tmp_path)
    monkeypatch.setattr(_tool, "_format", lambda *args: None)
    monkeypatch.setattr(_tool, "_EXEC_WAIT_S", 0.1)
    state = tmp_path / "c"
    try:
        with pytest.raises(ClusterError) as e:
            cluster.up(dir=state, port=port, timeout=2)
        assert str(e.value).startswith("nodes [1] not ready after 2 s")
        # Neither the stand-in nor a wrapper yet to exec it (its command line names the state folder too).
        assert jvms_in(state) == []
    finally:
        for pid in jvms_in(state):
            os.kill(pid, signal.SIGKILL)


def test_a_ctrl_c_while_java_is_on_its_way_to_the_jvm_leaves_nothing_running(
    tmp_path: Path, port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node was known as started only once its wrapper had become java: a
    # Ctrl-C in that wait left it running, unknown to every later command.
    wrapper = tmp_path / "wrapper-bin" / "java"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    wrapper.chmod(0o755)
    monkeypatch.setattr(_jars, "java", lambda: str(wrapper))
    monkeypatch.setattr(_jars, "jars", lambda progress=None: tmp_path)
    monkeypatch.setattr(_tool, "_format", lambda *args: None)

    def interrupted(pid: int, paths: object) -> None:
        deadline = time.monotonic() + 10  # the wrapper runs, then the Ctrl-C comes
        while not jvms_in(state) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise KeyboardInterrupt

    monkeypatch.setattr(_tool, "_await_exec", interrupted)
    state = tmp_path / "c"
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster.up(dir=state, port=port, timeout=30)
        assert jvms_in(state) == []
    finally:
        for pid in jvms_in(state):
            os.kill(pid, signal.SIGKILL)


def test_java_home_without_java_says_to_fix_or_unset_it(tmp_path: Path, bin_dir: Path) -> None:
    link_java(bin_dir)
    env = env_with_path(bin_dir, JAVA_HOME=str(tmp_path / "nonexistent"))
    result = kfeed("up", "--dir", str(tmp_path / "c"), "--port", "41000", env=env)
    assert only_error(result) == (
        f"kfeed cluster: JAVA_HOME={tmp_path / 'nonexistent'} has no bin/java: fix JAVA_HOME,"
        f" or unset it to use {bin_dir / 'java'} from PATH"
    )
    assert result.returncode == 1


def test_jars_help_says_what_it_does() -> None:
    result = kfeed("jars", "--help")
    assert result.returncode == 0
    assert "Print the folder of the Kafka broker jars" in result.stdout


@pytest.mark.integration
def test_a_bad_setting_names_the_brokers_reason_and_is_not_kept(state_dir: Path, port: int) -> None:
    d = str(state_dir)
    bad = kfeed("up", "--dir", d, "--port", str(port), "--set", "num.partitions=abc")
    error = assert_fails_cleanly(bad)
    assert error.endswith(
        "failed: ConfigException: Invalid value abc for configuration num.partitions: Not a number of type INT"
        " (--set num.partitions=abc was not kept)"
    )
    assert saved_overrides(state_dir) == {}
    assert jvms_in(state_dir) == []
    started = kfeed("up", "--dir", d)
    assert started.returncode == 0, started.stderr
    assert last_line(started) == f"127.0.0.1:{port}"


@pytest.mark.integration
def test_node_dying_during_start_shows_its_log_and_stops_the_others(state_dir: Path, port: int) -> None:
    # Node 2 finds data of another node id and exits at once; nodes 1 and 3
    # are healthy and must be stopped again.
    state_dir.mkdir()
    layout = Layout(nodes=3, port=port, cluster_id=new_cluster_id())
    layout.save(state_dir)
    data = state_dir / "node-2" / "data"
    data.mkdir(parents=True)
    (data / "meta.properties").write_text(  # (this cluster's id: another's is refused before)
        f"version=1\nnode.id=99\ncluster.id={layout.cluster_id}\ndirectory.id=a6J4sRketHXygB3u5rHGtg\n"
    )
    result = kfeed("up", "--nodes", "3", "--dir", str(state_dir), "--port", str(port))
    error = assert_fails_cleanly(result, "server.log", "Stored node id 99")
    assert error.startswith("kfeed cluster: node 2 exited while starting")
    assert jvms_in(state_dir) == []


# -- the registry: the user's clusters, found from any directory ---------------

HERE = "no cluster in .kfeed/cluster; the clusters recorded:"


class StandIns:
    """Recorded clusters whose nodes are stand-in processes instead of JVMs.

    A stand-in is a Python that sleeps under the name ``java`` with
    ``kafka.Kafka`` and its node's properties file on the command line: all
    that the tool checks before it reports a node as running or signals it,
    at none of a JVM's cost. Nothing answers on their ports.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.java = root / "standin-bin" / "java"
        self.java.parent.mkdir()
        self.java.symlink_to(sys.executable)
        self.procs: dict[Path, list[subprocess.Popen[bytes]]] = {}

    def start(self, name: str, port: int, *, secure: bool = False) -> Path:
        """A running 1-node cluster in ``root/name``, recorded as ``up`` records it."""
        state_dir = (self.root / name).resolve()
        layout = Layout(nodes=1, port=port, cluster_id=new_cluster_id(), secure=secure)
        state_dir.mkdir(parents=True)
        layout.save(state_dir)
        paths = layout.node_paths(state_dir, 1)
        paths.root.mkdir()
        paths.properties.write_text("")
        self.procs[state_dir] = [self.spawn(str(self.java), "kafka.Kafka", str(paths.properties))]
        paths.pid.write_text(f"{self.procs[state_dir][0].pid}\n")
        _registry.update(layout, state_dir)
        return state_dir

    def spawn(self, *argv: str) -> subprocess.Popen[bytes]:
        """``argv[0]`` sleeping, with ``argv[1:]`` on its command line; returns once ``/proc`` shows them."""
        proc = subprocess.Popen([argv[0], "-c", "import time; time.sleep(600)", *argv[1:]], stdin=subprocess.DEVNULL)
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        # The child may still be mid-exec when Popen returns (vfork): its
        # command line is empty until exec has set it up.
        while not cmdline.read_bytes():
            assert proc.poll() is None, "the stand-in exited"
        return proc

    def stop(self, state_dir: Path) -> None:
        """Kill the stand-ins behind the registry's back, as a crash would."""
        for proc in self.procs.pop(state_dir):
            proc.kill()
            proc.wait()

    def alive(self, state_dir: Path) -> bool:
        return all(proc.poll() is None for proc in self.procs[state_dir])

    def close(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                proc.kill()
                proc.wait()


@pytest.fixture
def standins(tmp_path: Path) -> Iterator[StandIns]:
    fakes = StandIns(tmp_path)
    try:
        yield fakes
    finally:
        fakes.close()


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory with no cluster in it."""
    path = tmp_path / "elsewhere"
    path.mkdir()
    return path


def only_error(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a failed command (no traceback, nothing else)."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_registry_records_a_start_reads_stopped_once_the_processes_are_gone_and_prunes_a_wiped_folder(
    standins: StandIns, registry: Path
) -> None:
    a = standins.start("a", 41000)
    [file] = registry.glob("*.json")
    saved = json.loads(file.read_text())
    pid = standins.procs[a][0].pid
    assert {k: saved[k] for k in ("dir", "nodes", "port", "bootstrap", "secure", "pids", "stopped_at")} == {
        "dir": str(a), "nodes": 1, "port": 41000, "bootstrap": "127.0.0.1:41000", "secure": False,
        "pids": {"1": pid}, "stopped_at": None,
    }  # fmt: skip
    assert saved["started_at"].endswith("+00:00")

    [record] = _registry.records()
    assert record.running == {1: pid}
    assert record.line() == f"{a}  1 node  127.0.0.1:41000  running"

    standins.stop(a)
    [record] = _registry.records()
    assert not record.is_running
    assert record.line() == f"{a}  1 node  127.0.0.1:41000  stopped"
    assert file.exists()

    shutil.rmtree(a)
    assert _registry.records() == []
    assert not file.exists()


def test_the_start_time_lasts_while_a_node_keeps_running_and_a_stop_is_timed(
    standins: StandIns, monkeypatch: pytest.MonkeyPatch
) -> None:
    times = iter(["t1", "t2", "t3", "t4"])
    monkeypatch.setattr(_registry, "_now", lambda: next(times))

    def saved(state_dir: Path) -> tuple[object, object, object]:
        record = json.loads(_registry.record_path(state_dir).read_text())
        return record["started_at"], record["stopped_at"], record["pids"]

    a = standins.start("a", 41000)
    layout = Layout.load(a)
    assert layout is not None
    first = standins.procs[a][0].pid
    assert saved(a) == ("t1", None, {"1": first})
    _registry.update(layout, a)  # `up` on a cluster already up
    assert saved(a) == ("t1", None, {"1": first})
    standins.stop(a)
    _registry.update(layout, a)
    assert saved(a) == ("t1", "t3", {})
    paths = layout.node_paths(a, 1)
    standins.procs[a] = [standins.spawn(str(standins.java), "kafka.Kafka", str(paths.properties))]
    paths.pid.write_text(f"{standins.procs[a][0].pid}\n")
    _registry.update(layout, a)
    assert saved(a) == ("t4", None, {"1": standins.procs[a][0].pid})


def test_an_unreadable_record_is_deleted(registry: Path) -> None:
    registry.mkdir()
    (registry / "0123456789abcdef.json").write_text("{not json")
    assert _registry.records() == []
    assert list(registry.iterdir()) == []


def test_a_registry_that_cannot_be_written_costs_a_warning_not_the_start(
    standins: StandIns, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(_registry.REGISTRY_ENV, str(blocker))
    with caplog.at_level("WARNING", logger="kfeed.cluster"):
        standins.start("a", 41000)
    assert [r.getMessage().split(" at ")[0] for r in caplog.records] == [
        f"could not record the cluster in {(tmp_path / 'a').resolve()}"
    ]


def test_list_prints_one_line_per_recorded_cluster(standins: StandIns, elsewhere: Path) -> None:
    a = standins.start("a", 41000)
    b = standins.start("b", 41010, secure=True)
    standins.stop(b)
    result = kfeed("list", cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{a}  1 node  127.0.0.1:41000  running",
        f"{b}  1 node  127.0.0.1:41010  stopped  secure",
    ]


def test_list_with_nothing_recorded(elsewhere: Path, registry: Path) -> None:
    result = kfeed("list", cwd=elsewhere)
    assert result.returncode == 0
    assert result.stdout == ""
    assert only_error(result) == f"no cluster recorded in {registry} (start one with: kfeed cluster up)"


@pytest.mark.parametrize("command", ["status", "down"])
def test_several_running_ask_for_dir(standins: StandIns, elsewhere: Path, command: str) -> None:
    a = standins.start("a", 41000)
    b = standins.start("b", 41010)
    result = kfeed(command, cwd=elsewhere)
    assert result.returncode == 2
    expected = f"kfeed cluster: 2 clusters are running; pick one with: kfeed cluster {command} --dir DIR"
    assert only_error(result) == expected
    listed = [f"{a}  1 node  127.0.0.1:41000  running", f"{b}  1 node  127.0.0.1:41010  running"]
    assert result.stdout.splitlines() == ([HERE] if command == "status" else []) + listed
    assert standins.alive(a) and standins.alive(b)


def test_status_elsewhere_with_one_running_is_that_clusters_status(
    standins: StandIns, elsewhere: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kfeed.cli import main

    a = standins.start("a", 41000)
    b = standins.start("b", 41010)
    standins.stop(b)
    asked = []

    def status(dir: Path) -> dict[str, object]:
        # Stand-ins answer no metadata request; the real answer is the integration test's.
        asked.append(dir)
        node = {"id": 1, "pid": 7, "alive": True, "port": 41000, "controller_port": 41100}
        return {"bootstrap": "127.0.0.1:41000", "client_settings": None, "nodes": [node], "brokers": [1]}

    monkeypatch.setattr(_tool, "status", status)
    monkeypatch.chdir(elsewhere)
    assert main(["cluster", "status"]) == 0
    assert asked == [a]
    assert capsys.readouterr().out.splitlines() == [
        HERE,
        f"{a}  1 node  127.0.0.1:41000  running",
        f"{b}  1 node  127.0.0.1:41010  stopped",
        f"status of the one running, {a}:",
        "node 1  pid 7  alive  registered  port 41000",
        "127.0.0.1:41000",
    ]


def test_status_elsewhere_with_none_running(standins: StandIns, elsewhere: Path) -> None:
    a = standins.start("a", 41000)
    standins.stop(a)
    result = kfeed("status", cwd=elsewhere)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [HERE, f"{a}  1 node  127.0.0.1:41000  stopped"]
    assert only_error(result) == f"kfeed cluster: none of them is running (start one with: kfeed cluster up --dir {a})"


def test_status_elsewhere_with_nothing_recorded(elsewhere: Path) -> None:
    result = kfeed("status", cwd=elsewhere)
    assert result.returncode == 1
    assert result.stdout == ""
    assert only_error(result) == (
        "kfeed cluster: no cluster in .kfeed/cluster and none recorded (start one with: kfeed cluster up)"
    )


def test_status_of_a_stopped_cluster_here_names_the_one_running_elsewhere(standins: StandIns, tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / ".kfeed" / "cluster").mkdir(parents=True)
    Layout(nodes=1, port=41020, cluster_id=new_cluster_id()).save(project / ".kfeed" / "cluster")
    a = standins.start("a", 41000)
    result = kfeed("status", cwd=project)
    assert result.returncode == 1
    assert only_error(result) == (
        "kfeed cluster: the cluster in .kfeed/cluster is not running (start it with: kfeed cluster up --dir"
        f" .kfeed/cluster); another cluster runs in {a} (127.0.0.1:41000)"
    )


def test_down_elsewhere_stops_the_one_running(standins: StandIns, elsewhere: Path) -> None:
    a = standins.start("a", 41000)
    proc = standins.procs[a][0]
    result = kfeed("down", cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"no cluster in .kfeed/cluster; stopping the one running, {a}",
        f"stopped node 1 in {a}",
    ]
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert not (a / "node-1" / "kafka.pid").exists()
    [record] = _registry.records()
    assert (record.pids, record.is_running, record.stopped_at is not None) == ({}, False, True)
    nothing = kfeed("down", cwd=elsewhere)
    assert nothing.stdout == "nothing running in .kfeed/cluster\n"


def test_down_wipe_elsewhere_wants_the_dir_named(standins: StandIns, elsewhere: Path) -> None:
    a = standins.start("a", 41000)
    result = kfeed("down", "--wipe", cwd=elsewhere)
    assert result.returncode == 2
    assert only_error(result) == (
        "kfeed cluster: no cluster in .kfeed/cluster, and --wipe deletes data: name the running one with"
        f" kfeed cluster down --dir {a} --wipe"
    )
    assert standins.alive(a) and (a / "cluster.json").exists()


@pytest.mark.parametrize(
    "impostor",
    ["not java", "another folder's node", "not kafka.Kafka"],
)
def test_a_recorded_pid_that_is_not_the_node_is_never_reported_or_signalled(
    standins: StandIns, elsewhere: Path, registry: Path, impostor: str
) -> None:
    a = (standins.root / "a").resolve()
    layout = Layout(nodes=1, port=41000, cluster_id=new_cluster_id())
    a.mkdir()
    layout.save(a)
    paths = layout.node_paths(a, 1)
    paths.root.mkdir()
    argv = {
        "not java": [sys.executable, "kafka.Kafka", str(paths.properties)],
        "another folder's node": [str(standins.java), "kafka.Kafka", str(standins.root / "b/node-1/server.properties")],
        "not kafka.Kafka": [str(standins.java), "kafka.tools.StorageTool", str(paths.properties)],
    }[impostor]
    proc = standins.spawn(*argv)
    standins.procs[a] = [proc]
    paths.pid.write_text(f"{proc.pid}\n")
    # The record names the pid too, as if the node had once run under it.
    registry.mkdir()
    record = {"dir": str(a), "cluster_id": layout.cluster_id, "nodes": 1, "port": 41000,
              "bootstrap": layout.bootstrap, "secure": False, "pids": {"1": proc.pid}}  # fmt: skip
    _registry.record_path(a).write_text(json.dumps(record))

    assert [r.is_running for r in _registry.records()] == [False]
    assert kfeed("down", cwd=elsewhere).stdout == "nothing running in .kfeed/cluster\n"
    assert kfeed("down", "--dir", str(a)).stdout == f"nothing running in {a}\n"
    assert proc.poll() is None


def test_set_on_a_running_cluster_is_kept_for_its_next_start(
    standins: StandIns, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kfeed.cli import main

    a = standins.start("a", 41000)
    # Stand-ins answer no metadata request; the real answer is the integration test's.
    monkeypatch.setattr(_tool, "_wait_ready", lambda *args, **kwargs: None)
    node = {"id": 1, "pid": 7, "alive": True, "port": 41000, "controller_port": 41100}
    state = {"bootstrap": "127.0.0.1:41000", "client_settings": None, "nodes": [node], "brokers": [1]}
    monkeypatch.setattr(_tool, "status", lambda dir: state)
    assert main(["cluster", "up", "--dir", str(a), "--set", "log.retention.hours=1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"already up in {a}; the settings are kept in {a / STATE_FILE} and apply from its next start"
        f" (kfeed cluster down --dir {a}, then kfeed cluster up --dir {a})"
    )
    assert saved_overrides(a) == {"log.retention.hours": "1"}
    assert standins.alive(a)
    assert main(["cluster", "up", "--dir", str(a), "--unset", "log.retention.hours"]) == 0
    assert saved_overrides(a) == {}


def test_status_of_nodes_that_do_not_answer_prints_them_and_the_reason(standins: StandIns) -> None:
    # A stand-in runs but answers nothing, as a hung (SIGSTOPped) broker does.
    port = cluster.free_port_base(1, FIRST_PORT)
    a = standins.start("a", port)
    pid = standins.procs[a][0].pid
    result = kfeed("status", "--dir", str(a))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"node 1  pid {pid}  alive  no-answer  port {port}"]
    error = only_error(result)
    assert error.startswith(f"kfeed cluster: the cluster in {a} does not answer at 127.0.0.1:{port}: ")
    assert "KafkaError{" not in error and "Local:" in error


def test_up_names_a_cluster_running_in_another_folder(standins: StandIns, tmp_path: Path, bin_dir: Path) -> None:
    a = standins.start("a", 41000)
    # No java on PATH: up stops right after its note, before any port or JVM.
    result = kfeed("up", "--dir", str(tmp_path / "new"), "--port", "41030", env=env_with_path(bin_dir))
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == f"note: another cluster runs in {a} (127.0.0.1:41000)"
    assert lines[1].startswith("kfeed cluster: java not found on PATH")


def test_up_in_the_folder_of_the_running_cluster_adds_no_note(standins: StandIns, tmp_path: Path) -> None:
    standins.start("a", 41000)
    # The relative --dir is the same folder; the stand-in never answers, so up times out at once.
    result = kfeed("up", "--dir", "a", "--timeout", "0.1", cwd=tmp_path)
    assert only_error(result).startswith("kfeed cluster: nodes [1] not ready after 0 s")


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["up", "--nodes", "2"], "argument --nodes: invalid choice: 2 (choose from 1, 3)"
                                 " (see: kfeed cluster up --help)"),
        (["up", "--set", "oops"], "--set wants KEY=VALUE, not 'oops'"),
        (["up", "--port", "80"], "base port 80 leaves the range 1024..65535 for this layout:"
                                 " choose one from 1024 to 65435"),
        (["up", "--port", "0"], "base port 0 leaves the range 1024..65535 for this layout:"
                                " choose one from 1024 to 65435"),
        (["status", "--dir", "none"], "no cluster in none (start one with: kfeed cluster up --dir none;"
                                      " kfeed cluster list shows the others)"),
        (["list", "--all"], "unrecognized arguments: --all (see: kfeed cluster list --help)"),
        (["up", "--timeout", "-5"], "argument --timeout: wants a number of seconds above 0, not '-5'"
                                    " (see: kfeed cluster up --help)"),
        (["up", "--timeout", "0"], "argument --timeout: wants a number of seconds above 0, not '0'"
                                   " (see: kfeed cluster up --help)"),
        (["up", "--schema-registry", "--schema-registry-port", "0"],
         "argument --schema-registry-port: wants a port from 1024 to 65535, not '0'"
         " (see: kfeed cluster up --help)"),
        (["up", "--schema-registry-port", "28081"], "--schema-registry-port needs --schema-registry"
                                                    " (add it, or drop the port)"),
        (["up", "--unset", "num.partitions"], "--unset num.partitions: not among the cluster's --set"
                                              " settings (none)"),
        (["up", "--set", "a=1", "--unset", "a"], "--set and --unset both name a: pick one"),
        # The second line went into server.properties as a setting of its own.
        (["up", "--set", "num.partitions=8\nauto.create.topics.enable=true"],
         "--set 'num.partitions=8\\nauto.create.topics.enable=true': one setting a --set, on one "
         "line"),
        # It started the cluster, then blamed the port the cluster had just taken.
        (["up", "--port", "31992", "--schema-registry", "--schema-registry-port", "32092"],
         "the Schema Registry's port 32092 is the cluster's own (controller of node 1): choose "
         "another with --schema-registry-port"),
    ],
    ids=["nodes", "set", "port", "port0", "dir", "extra", "timeout-5", "timeout0", "registry-port0",
         "registry-port-alone", "unset-unknown", "set-and-unset", "set-two-lines",
         "registry-port-the-cluster-s"],
)  # fmt: skip
def test_a_mistake_in_the_arguments_is_one_line_and_exit_2(
    elsewhere: Path, bin_dir: Path, args: list[str], error: str
) -> None:
    # No java on PATH: a mistake that got past the checks would fail there, with exit 1, starting nothing.
    env = env_with_path(bin_dir)
    result = kfeed(*args, "--dir", "c", env=env, cwd=elsewhere) if args[0] == "up" else kfeed(*args, cwd=elsewhere)
    assert result.returncode == 2
    assert only_error(result) == f"kfeed cluster: {error}"
    assert not (elsewhere / "c").exists()


@pytest.mark.integration
def test_status_and_down_find_the_cluster_from_another_directory(
    state_dir: Path, port: int, elsewhere: Path
) -> None:
    servers = f"127.0.0.1:{port}"
    started = kfeed("up", "--dir", str(state_dir), "--port", str(port))
    assert started.returncode == 0, started.stderr
    d = state_dir.resolve()

    status = kfeed("status", cwd=elsewhere)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[:3] == [HERE, f"{d}  1 node  {servers}  running", f"status of the one running, {d}:"]
    assert lines[3].startswith("node 1  pid ") and lines[3].endswith(f"  alive  registered  port {port}")
    assert lines[-1] == servers  # what `kfeed cluster status | tail -n 1` reads
    assert len(lines) == 5

    stopped = kfeed("down", cwd=elsewhere)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.splitlines() == [
        f"no cluster in .kfeed/cluster; stopping the one running, {d}",
        f"stopped node 1 in {d}",
    ]
    assert jvms_in(state_dir) == []
    assert kfeed("list", cwd=elsewhere).stdout == f"{d}  1 node  {servers}  stopped\n"

    wiped = kfeed("down", "--dir", str(state_dir), "--wipe")
    assert wiped.returncode == 0, wiped.stderr
    assert kfeed("list", cwd=elsewhere).stdout == ""


# -- the Schema Registry beside a cluster ----------------------------------------


def standin_schema_registry(standins: StandIns, state_dir: Path, port: int) -> subprocess.Popen[bytes]:
    """A sleeping stand-in that the tool takes for the Schema Registry of ``state_dir`` on ``port``."""
    folder = state_dir / "schema-registry"
    folder.mkdir(parents=True)
    runner = "/opt/apicurio-registry-app-3.0.9-runner.jar"
    proc = standins.spawn(str(standins.java), f"-Dquarkus.http.port={port}", "-jar", runner)
    standins.procs.setdefault(state_dir.resolve(), []).append(proc)
    (folder / "pid").write_text(str(proc.pid))
    (folder / "port").write_text(str(port))
    return proc


def test_up_checks_the_schema_registry_port_before_it_starts_anything(
    tmp_path: Path, bin_dir: Path, port: int
) -> None:
    taken = cluster.free_port_base(1, port + 10)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        # No java on PATH: an up that went ahead would fail there instead.
        result = kfeed(
            "up", "--dir", str(tmp_path / "c"), "--port", str(port), "--schema-registry",
            "--schema-registry-port", str(taken), env=env_with_path(bin_dir),
        )  # fmt: skip
    assert result.returncode == 1
    assert only_error(result) == (
        f"kfeed cluster: port {taken} (the Schema Registry's) is already in use on 127.0.0.1:"
        " free it or choose another port (--schema-registry-port)"
    )
    assert not (tmp_path / "c").exists()


def test_up_refuses_a_schema_registry_port_other_than_the_running_ones(
    standins: StandIns, tmp_path: Path, bin_dir: Path
) -> None:
    state = tmp_path / "c"
    proc = standin_schema_registry(standins, state, 41600)
    result = kfeed(
        "up", "--dir", str(state), "--schema-registry", "--schema-registry-port", "41610", env=env_with_path(bin_dir)
    )
    assert result.returncode == 2
    assert only_error(result) == (
        f"kfeed cluster: the Schema Registry of {state} already runs on port 41600: drop --schema-registry-port"
        f" 41610, or stop it first with: kfeed cluster down --dir {state}"
    )
    assert proc.poll() is None
    assert _tool.schema_registry_port(state) == _tool.schema_registry_port(state, 41600) == 41600


def test_down_says_it_stopped_the_schema_registry(standins: StandIns, tmp_path: Path) -> None:
    state = tmp_path / "c"
    state.mkdir()
    Layout(nodes=1, port=41000, cluster_id=new_cluster_id()).save(state)  # its node is down
    proc = standin_schema_registry(standins, state, 41600)
    result = kfeed("down", "--dir", str(state))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"stopped the schema registry in {state}\n"
    assert proc.wait(timeout=10) == -signal.SIGTERM
    again = kfeed("down", "--dir", str(state))
    assert again.stdout == f"nothing running in {state}\n"


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


# Reads a properties file as Kafka does (java.util.Properties.load of a stream:
# ISO-8859-1, then the escapes) and prints each key and value as code points.
READ_PROPERTIES_JAVA = """
import java.io.FileInputStream;
import java.util.Properties;

public class ReadProperties {
    static String codes(Object text) {
        StringBuilder out = new StringBuilder();
        ((String) text).codePoints().forEach(c -> out.append(c).append(' '));
        return out.toString().trim();
    }

    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        try (FileInputStream in = new FileInputStream(args[0])) {
            props.load(in);
        }
        props.forEach((key, value) -> System.out.println(codes(key) + "=" + codes(value)));
    }
}
"""


def test_java_reads_the_properties_written_for_a_non_ascii_folder_as_they_were_given(tmp_path: Path) -> None:
    java = shutil.which("java")
    if java is None:
        pytest.skip("needs java on PATH")
    source = tmp_path / "ReadProperties.java"
    source.write_text(READ_PROPERTIES_JAVA)
    props = {**cluster.node_properties(1, 1, dir=tmp_path / "données 😀"), "a\\b": "c\\d é"}
    path = tmp_path / "server.properties"
    write_properties(path, props)
    out = subprocess.run([java, str(source), str(path)], capture_output=True, text=True, check=True).stdout

    def text(codes: str) -> str:
        return "".join(chr(int(code)) for code in codes.split())

    read = {}
    for line in out.splitlines():
        key, value = line.split("=")
        read[text(key)] = text(value)
    assert read == props
    assert path.read_bytes().isascii()
