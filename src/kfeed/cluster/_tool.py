"""Start, watch and stop the nodes of a local Apache Kafka cluster.

Each node is a detached JVM (``kafka.Kafka``) whose pid file lives in the
state folder, so any later process (the CLI, a test, a fault injector) can
find it again. A pid is only ever signalled after ``/proc/<pid>/cmdline``
shows that it is a ``java`` running ``kafka.Kafka`` with that node's
properties file (``_procs``). Each start and stop also updates the user's
record of the cluster (``_registry``).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kfeed.cluster import _jars, _registry, _schema_registry, _secure
from kfeed.cluster._layout import (
    CONTROLLER_PORT_OFFSET,
    DEFAULT_DIR,
    DEFAULT_PORT,
    HOST,
    LOG4J_CONFIG,
    LOG4J_FILE,
    STATE_FILE,
    Layout,
    NodePaths,
    UsageError,
    new_cluster_id,
    write_properties,
)
from kfeed.cluster._procs import is_node_jvm, running_pid
from kfeed.errors import ClusterError

logger = logging.getLogger("kfeed.cluster")
# librdkafka's own log lines (connection refused while a node boots) are
# queued for this logger and never polled, so they stay off the terminal.
_rdkafka_logger = logging.getLogger("kfeed.cluster.librdkafka")

HEAP = "512m"
_JVM_FLAGS = (
    f"-Xmx{HEAP}",
    f"-Xms{HEAP}",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-Djava.awt.headless=true",
)
STOP_GRACE_S = 20.0
_POLL_S = 0.25
_EXEC_WAIT_S = 5.0
_LOG_TAIL_LINES = 20
_LOG_TAIL_BYTES = 64 * 1024


def up(
    nodes: int | None = None,
    dir: Path | str = DEFAULT_DIR,
    port: int | None = None,
    timeout: float = 120.0,
    *,
    overrides: dict[str, str] | None = None,
    secure: bool | None = None,
) -> str:
    """Start the cluster in ``dir`` (creating it if needed); return its bootstrap servers.

    ``nodes``, ``port`` and ``secure`` default to what ``dir`` already holds,
    else 1, 39092 and plaintext. Returns once every broker is registered and
    answers metadata requests; nodes that were already running are left alone.

    ``secure=True`` serves clients on SASL_SSL (SCRAM-SHA-512) with ACLs on;
    :func:`secure_client_config` gives the settings to connect with.
    """
    layout, _ = ensure_up(nodes, dir, port, timeout, overrides=overrides, secure=secure)
    return layout.bootstrap


def ensure_up(
    nodes: int | None,
    dir: Path | str,
    port: int | None,
    timeout: float,
    *,
    overrides: dict[str, str] | None = None,
    secure: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Layout, list[int]]:
    """:func:`up`, also returning the ids of the nodes it started (empty: it was up).

    ``progress`` receives a note before a slow step (the first Maven run).
    """
    state_dir = _state_dir(dir)
    layout = _layout_for(state_dir, dir, nodes, port, overrides, secure)
    missing = [n for n in layout.node_ids if running_pid(layout.node_paths(state_dir, n)) is None]
    if missing:
        _start(layout, state_dir, missing, layout.node_ids, timeout, progress)
    else:
        _wait_ready(layout, state_dir, {}, layout.node_ids, timeout)
        # A cluster started before records were kept is recorded now.
        _registry.update(layout, state_dir)
    return layout, missing


def down(dir: Path | str = DEFAULT_DIR, wipe: bool = False) -> list[int]:
    """Stop every node of the cluster in ``dir``; return the ids it stopped.

    With ``wipe`` the state folder (topics, offsets, logs) is deleted too.
    """
    state_dir = _state_dir(dir)
    layout = Layout.load(state_dir)
    if layout is None:
        _registry.forget(state_dir)
        if wipe and state_dir.exists():
            raise UsageError(
                f"{dir} holds no {STATE_FILE}: not a kfeed cluster, so not wiping it"
                " (kfeed cluster list shows the clusters)"
            )
        return []
    try:
        _schema_registry.stop(state_dir)
        stopped = _stop(layout, state_dir, layout.node_ids)
    finally:
        _registry.update(layout, state_dir)
    if wipe:
        shutil.rmtree(state_dir)
        _registry.forget(state_dir)
        logger.info("wiped %s", dir)
    return stopped


def status(dir: Path | str = DEFAULT_DIR, timeout: float = 5.0) -> dict[str, Any]:
    """The cluster's nodes and registered brokers; raises ClusterError when it does not answer.

    The result holds ``dir``, ``bootstrap``, ``cluster_id``,
    ``security_protocol`` (``PLAINTEXT`` or ``SASL_SSL``), ``client_settings``
    (for a secure cluster, the file with the admin's librdkafka settings, else
    None), ``nodes`` (one dict per node: ``id``, ``pid``, ``alive``, ``port``,
    ``controller_port``), ``brokers`` (the ids that metadata lists) and
    ``schema_registry`` (its URL when ``up --schema-registry`` started one,
    else None). A secure cluster is asked as its admin user.
    """
    state_dir = _state_dir(dir)
    layout = _existing_layout(state_dir, dir)
    nodes = []
    for node_id in layout.node_ids:
        pid = running_pid(layout.node_paths(state_dir, node_id))
        nodes.append(
            {
                "id": node_id,
                "pid": pid,
                "alive": pid is not None,
                "port": layout.broker_port(node_id),
                "controller_port": layout.controller_port(node_id),
            }
        )
    if not any(node["alive"] for node in nodes):
        raise ClusterError(f"the cluster in {dir} is not running (start it with: kfeed cluster up --dir {dir})")
    try:
        brokers = _registered_brokers(_admin(layout, state_dir), timeout)
    except Exception as exc:  # librdkafka raises KafkaException with varied codes
        raise ClusterError(f"the cluster in {dir} does not answer at {layout.bootstrap}: {exc}") from exc
    return {
        "dir": str(state_dir),
        "bootstrap": layout.bootstrap,
        "cluster_id": layout.cluster_id,
        "security_protocol": layout.security_protocol,
        "client_settings": str(_secure.SecurePaths.of(state_dir).user(_secure.ADMIN)) if layout.secure else None,
        "nodes": nodes,
        "brokers": sorted(brokers),
        "schema_registry": _schema_registry.url(state_dir),
    }


def start_schema_registry(
    dir: Path | str = DEFAULT_DIR,
    port: int = _schema_registry.DEFAULT_PORT,
    timeout: float = _schema_registry.START_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
) -> str:
    """Run a Schema Registry (Apicurio) for the folder ``dir`` on ``port``; its URL once it answers.

    The URL is the Confluent-compatible API (``http://127.0.0.1:PORT/apis/ccompat/v7``),
    what ``kfeed.Avro(registry={"url": ...})`` and confluent-kafka's serializers take.
    ``down`` stops it with the nodes. ``dir`` need not hold a cluster.
    """
    if _in_use(port) and _schema_registry.url(_state_dir(dir)) is None:
        raise ClusterError(f"port {port} is in use: pass another port")
    return _schema_registry.start(_state_dir(dir), port, timeout, progress)


def stop_schema_registry(dir: Path | str = DEFAULT_DIR) -> int | None:
    """Stop the Schema Registry started for ``dir``; its pid, or None if none ran."""
    return _schema_registry.stop(_state_dir(dir))


def bootstrap(dir: Path | str = DEFAULT_DIR) -> str:
    """The bootstrap servers of the cluster in ``dir``, from its state file (no network)."""
    state_dir = _state_dir(dir)
    return _existing_layout(state_dir, dir).bootstrap


def secure_client_config(dir: Path | str = DEFAULT_DIR, user: str = _secure.ADMIN) -> dict[str, str]:
    """The librdkafka settings with which ``user`` connects to the secure cluster in ``dir``.

    ``bootstrap.servers``, ``security.protocol=SASL_SSL``,
    ``sasl.mechanisms=SCRAM-SHA-512``, ``sasl.username``, ``sasl.password``
    and ``ssl.ca.location``: pass them (plus ``group.id``) as a Producer's or
    Loader's ``kafka_config``. ``user`` is ``admin`` (a super user) or one
    made by :func:`add_user`. Read from the state folder; no network.
    """
    state_dir = _state_dir(dir)
    _secure_layout(state_dir, dir)
    return _secure.client_config(state_dir, user)


def add_user(
    dir: Path | str, name: str, password: str | None = None, *, timeout: float = 30.0
) -> dict[str, str]:
    """Create SCRAM-SHA-512 user ``name`` (or reset its password) on the running secure cluster.

    The password is random unless given. It is stored, owner-only, in the
    state folder; the user's librdkafka settings are returned, as
    :func:`secure_client_config` gives them later. A new user may do nothing
    until :func:`grant` allows it.
    """
    state_dir = _state_dir(dir)
    layout = _secure_layout(state_dir, dir)
    _secure.add_user(_admin(layout, state_dir), layout, state_dir, name, password, timeout)
    return _secure.client_config(state_dir, name)


def grant(
    dir: Path | str,
    principal: str,
    operations: str | Iterable[str],
    *,
    topic: str | None = None,
    group: str | None = None,
    transactional_id: str | None = None,
    cluster: bool = False,
    prefixed: bool = False,
    timeout: float = 30.0,
) -> None:
    """Allow ``principal`` (``"alice"`` or ``"User:alice"``) ``operations`` on the named resources.

    ``operations`` are Kafka's names: ``READ``, ``WRITE``, ``DESCRIBE``,
    ``CREATE``, ``ALL``, ... A consumer needs READ (and DESCRIBE) on its topic
    and READ on its group; a producer WRITE and DESCRIBE on its topic, and
    IDEMPOTENT_WRITE on the cluster only for brokers older than 3.0.
    ``prefixed`` makes each name a prefix. ACLs are created as the admin.
    """
    state_dir = _state_dir(dir)
    layout = _secure_layout(state_dir, dir)
    resources = {
        "topic": topic,
        "group": group,
        "transactional_id": transactional_id,
        "cluster": "kafka-cluster" if cluster else None,
    }
    _secure.grant(_admin(layout, state_dir), principal, operations, resources, prefixed, timeout)


def node_pids(dir: Path | str = DEFAULT_DIR) -> dict[int, int]:
    """Node id -> pid, for the nodes of ``dir`` that are running now."""
    state_dir = _state_dir(dir)
    layout = _existing_layout(state_dir, dir)
    pids = {n: running_pid(layout.node_paths(state_dir, n)) for n in layout.node_ids}
    return {n: pid for n, pid in pids.items() if pid is not None}


def kill_node(
    dir: Path | str,
    node_id: int,
    sig: int = signal.SIGKILL,
    *,
    wait: bool = True,
    timeout: float = 60.0,
) -> int:
    """Send ``sig`` to one node; with ``wait``, return once it has exited. Returns its pid."""
    state_dir = _state_dir(dir)
    layout = _existing_layout(state_dir, dir)
    paths = layout.node_paths(state_dir, node_id)
    pid = running_pid(paths)
    if pid is None:
        raise ClusterError(f"node {node_id} of the cluster in {dir} is not running")
    logger.info("sending signal %s to node %d (pid %d)", sig, node_id, pid)
    _signal(pid, sig)
    if wait:
        if _wait_exited({node_id: paths}, timeout):
            raise ClusterError(f"node {node_id} (pid {pid}) still runs {timeout:.0f} s after signal {sig}")
        paths.pid.unlink(missing_ok=True)
        _registry.update(layout, state_dir)
    return pid


def start_node(dir: Path | str, node_id: int, wait: bool = True, timeout: float = 120.0) -> int:
    """Restart one node of an existing cluster; with ``wait``, until it is registered again.

    Returns its pid. A node that already runs is left alone.
    """
    state_dir = _state_dir(dir)
    layout = _existing_layout(state_dir, dir)
    paths = layout.node_paths(state_dir, node_id)
    pid = running_pid(paths)
    if pid is not None:
        return pid
    if not paths.formatted:
        raise ClusterError(f"node {node_id} in {dir} was never formatted: run kfeed cluster up --dir {dir}")
    awaited = [node_id] if wait else []
    return _start(layout, state_dir, [node_id], awaited, timeout)[node_id]


def _state_dir(dir: Path | str) -> Path:
    # Absolute, because the path is matched against /proc/<pid>/cmdline later.
    return Path(dir).expanduser().resolve()


def _existing_layout(state_dir: Path, shown: Path | str) -> Layout:
    layout = Layout.load(state_dir)
    if layout is None:
        raise UsageError(
            f"no cluster in {shown} (start one with: kfeed cluster up --dir {shown};"
            " kfeed cluster list shows the others)"
        )
    return layout


def _secure_layout(state_dir: Path, shown: Path | str) -> Layout:
    layout = _existing_layout(state_dir, shown)
    if not layout.secure:
        raise UsageError(f"the cluster in {shown} is not secure (start one with: kfeed cluster up --secure)")
    return layout


def _layout_for(
    state_dir: Path,
    shown: Path | str,
    nodes: int | None,
    port: int | None,
    overrides: dict[str, str] | None,
    secure: bool | None = None,
) -> Layout:
    existing = Layout.load(state_dir)
    if existing is None:
        return Layout(
            nodes=nodes or 1,
            port=DEFAULT_PORT if port is None else port,
            cluster_id=new_cluster_id(),
            overrides=dict(overrides or {}),
            secure=bool(secure),
        )
    asked = (nodes or existing.nodes, existing.port if port is None else port)
    if asked != (existing.nodes, existing.port):
        raise UsageError(
            f"{shown} holds a {existing.nodes}-node cluster on port {existing.port}; "
            f"to replace it run: kfeed cluster down --dir {shown} --wipe"
        )
    if secure is not None and secure != existing.secure:
        kind = "secure (SASL_SSL)" if existing.secure else "plaintext"
        raise UsageError(
            f"{shown} holds a {kind} cluster; to replace it run: kfeed cluster down --dir {shown} --wipe"
        )
    if overrides:
        return Layout(
            nodes=existing.nodes,
            port=existing.port,
            cluster_id=existing.cluster_id,
            overrides={**existing.overrides, **overrides},
            secure=existing.secure,
        )
    return existing


def _start(
    layout: Layout,
    state_dir: Path,
    node_ids: list[int],
    awaited: Iterable[int],
    timeout: float,
    progress: Callable[[str], None] | None = None,
) -> dict[int, int]:
    """Launch ``node_ids`` and wait for the ``awaited`` brokers; on failure stop what it launched."""
    java = _jars.java()
    _check_ports(layout, node_ids)
    libs = _jars.jars(progress)
    _prepare(layout, state_dir)
    _format(java, libs, layout, state_dir, node_ids)
    started: dict[int, int] = {}
    try:
        for node_id in node_ids:
            started[node_id] = _launch(java, libs, state_dir, layout.node_paths(state_dir, node_id))
        if awaited:
            _wait_ready(layout, state_dir, started, awaited, timeout)
    except BaseException:
        _stop(layout, state_dir, started)
        raise
    _registry.update(layout, state_dir)
    return started


def _prepare(layout: Layout, state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    if layout.secure:
        formatted = any(layout.node_paths(state_dir, n).formatted for n in layout.node_ids)
        _secure.ensure_material(layout, state_dir, formatted)
    layout.save(state_dir)
    (state_dir / LOG4J_FILE).write_text(LOG4J_CONFIG)
    for node_id in layout.node_ids:
        paths = layout.node_paths(state_dir, node_id)
        paths.logs.mkdir(parents=True, exist_ok=True)
        extra = _secure.broker_properties(layout, node_id, state_dir) if layout.secure else None
        # A secure node's properties hold the broker's own password.
        write_properties(paths.properties, layout.properties(node_id, state_dir, extra), private=layout.secure)


def _format(java: str, libs: Path, layout: Layout, state_dir: Path, node_ids: list[int]) -> None:
    todo = [layout.node_paths(state_dir, n) for n in node_ids]
    todo = [paths for paths in todo if not paths.formatted]
    if not todo:
        return
    # Computed once: every node's bootstrap metadata must hold the same users.
    users = _secure.format_args(state_dir) if layout.secure else []
    # One JVM per node, side by side: each takes a couple of seconds to boot.
    procs = [
        subprocess.Popen(
            [
                java, "-Xmx256m", *_log_flags(state_dir, paths), "-cp", f"{libs}/*",
                "kafka.tools.StorageTool", "format", "--ignore-formatted",
                "-t", layout.cluster_id, "-c", str(paths.properties), *users,
            ],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for paths in todo
    ]
    failures = []
    for paths, proc in zip(todo, procs):
        output, _ = proc.communicate()
        if proc.returncode != 0:
            failures.append(f"formatting {paths.data} failed:\n{_last_lines(output)}")
    if failures:
        raise ClusterError("\n".join(failures))


def _log_flags(state_dir: Path, paths: NodePaths) -> list[str]:
    return [f"-Dkafka.logs.dir={paths.logs}", f"-Dlog4j2.configurationFile={state_dir / LOG4J_FILE}"]


def _launch(java: str, libs: Path, state_dir: Path, paths: NodePaths) -> int:
    cmd = [java, *_JVM_FLAGS, *_log_flags(state_dir, paths), "-cp", f"{libs}/*", "kafka.Kafka", str(paths.properties)]
    # A throwaway shell starts the JVM in the background and exits, so the JVM
    # is re-parented away from us: it outlives this process, and a long-lived
    # parent (a test session) never collects it as a zombie or warns about it.
    # start_new_session keeps terminal signals (Ctrl-C) away from the node.
    script = 'log=$1; shift; "$@" >>"$log" 2>&1 </dev/null & echo $!'
    try:
        out = subprocess.run(
            ["/bin/sh", "-c", script, "sh", str(paths.stdout), *cmd],
            capture_output=True, text=True, check=True, start_new_session=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        pid = int(out.stdout.strip())
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        raise ClusterError(f"could not launch node {paths.root.name}: {exc}") from exc
    paths.pid.write_text(f"{pid}\n")
    _await_exec(pid, paths)
    logger.info("started %s (pid %d)", paths.root.name, pid)
    return pid


def _await_exec(pid: int, paths: NodePaths) -> None:
    """Wait until ``pid`` shows the JVM's command line, or gives up being able to.

    The shell prints the pid as soon as it forks, before the child has become
    java; until then ``/proc`` shows a shell (or nothing), which every later
    check would take for a dead node.
    """
    deadline = time.monotonic() + _EXEC_WAIT_S
    while not is_node_jvm(pid, paths.properties) and time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return  # exec failed; _wait_ready reports it with the log
        time.sleep(0.01)


def free_port_base(nodes: int = 1, start: int = DEFAULT_PORT, step: int = 10) -> int:
    """The first base port from ``start`` (in ``step``s) whose whole ``nodes``-node layout is free."""
    for base in range(start, 65536 - CONTROLLER_PORT_OFFSET - nodes, step):
        layout = Layout(nodes=nodes, port=base, cluster_id="")
        if not any(_in_use(port) for _, _, port in _ports(layout, layout.node_ids)):
            return base
    raise ClusterError(f"no free base port from {start} for {nodes} node(s)")


def _check_ports(layout: Layout, node_ids: Iterable[int]) -> None:
    for node_id, role, port in _ports(layout, node_ids):
        if _in_use(port):
            low, high = _ephemeral_ports()
            why = (f" (ports {low}-{high} are also the local ends of outgoing connections, "
                   f"so one can hold it while its node is down: a base port below {low} "
                   f"avoids that)" if low <= port <= high and not _listening(port) else "")
            raise ClusterError(
                f"port {port} ({role} of node {node_id}) is already in use on {HOST}: "
                f"free it or choose another base port (--port){why}"
            )


def _listening(port: int) -> bool:
    """Whether a server takes connections on ``port`` (another cluster, say)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((HOST, port)) == 0


def _ephemeral_ports() -> tuple[int, int]:
    """The ports the kernel picks the local ends of outgoing connections from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _ports(layout: Layout, node_ids: Iterable[int]) -> list[tuple[int, str, int]]:
    return [
        (node_id, role, port)
        for node_id in node_ids
        for role, port in (("broker", layout.broker_port(node_id)), ("controller", layout.controller_port(node_id)))
    ]


def _in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the JVM does: a port in TIME_WAIT from the last run is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ClusterError(f"cannot bind {HOST}:{port}: {exc.strerror}") from exc
            return True
    return False


def _wait_ready(
    layout: Layout, state_dir: Path, started: dict[int, int], awaited: Iterable[int], timeout: float
) -> None:
    """Return once every ``awaited`` broker is registered and its own listener accepts connections.

    Registration alone is not enough after a fast restart: the controller may
    still list the previous incarnation of the node.
    """
    awaited = set(awaited)
    deadline = time.monotonic() + timeout
    admin = None
    while True:
        for node_id in started:
            paths = layout.node_paths(state_dir, node_id)
            if running_pid(paths) is None:
                raise ClusterError(f"node {node_id} exited while starting; {_log_tail(paths)}")
        pending = sorted(n for n in awaited if not _accepts(layout.broker_port(n)))
        if not pending:
            admin = admin or _admin(layout, state_dir)
            try:
                registered = _registered_brokers(admin, 2.0)
            except Exception as exc:  # librdkafka raises KafkaException while nodes boot
                logger.debug("metadata not ready: %s", exc)
                registered = set()
            pending = sorted(awaited - registered)
            if not pending:
                return
        if time.monotonic() > deadline:
            paths = layout.node_paths(state_dir, pending[0])
            raise ClusterError(f"nodes {pending} not ready after {timeout:.0f} s; {_log_tail(paths)}")
        time.sleep(_POLL_S)


def _admin(layout: Layout, state_dir: Path) -> Any:
    """An admin client of the cluster; of a secure one, logged in as its admin user."""
    from confluent_kafka.admin import AdminClient

    config: dict[str, Any] = {"bootstrap.servers": layout.bootstrap}
    if layout.secure:
        config.update(_secure.client_config(state_dir, _secure.ADMIN))
    config["logger"] = _rdkafka_logger
    return AdminClient(config)


def _registered_brokers(admin: Any, timeout: float) -> set[int]:
    return set(admin.list_topics(timeout=timeout).brokers)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return True
    except OSError:
        return False


def _stop(layout: Layout, state_dir: Path, node_ids: Iterable[int]) -> list[int]:
    """SIGTERM the running ones of ``node_ids``, SIGKILL what outlives the grace period."""
    running = {}
    for node_id in node_ids:
        paths = layout.node_paths(state_dir, node_id)
        pid = running_pid(paths)
        if pid is None:
            paths.pid.unlink(missing_ok=True)
            continue
        running[node_id] = paths
        logger.info("stopping node %d (pid %d)", node_id, pid)
        _signal(pid, signal.SIGTERM)
    # All at once: a combined node waits for the controller quorum while it
    # shuts down, so stopping them one by one would be slower, not safer.
    left = _wait_exited(running, STOP_GRACE_S)
    for node_id, paths in left.items():
        pid = running_pid(paths)
        if pid is not None:
            logger.warning("node %d (pid %d) ignored SIGTERM for %.0f s; killing it", node_id, pid, STOP_GRACE_S)
            _signal(pid, signal.SIGKILL)
    if _wait_exited(left, STOP_GRACE_S):
        raise ClusterError(f"nodes {sorted(left)} did not exit even after SIGKILL")
    for paths in running.values():
        paths.pid.unlink(missing_ok=True)
    return sorted(running)


def _wait_exited(nodes: dict[int, NodePaths], timeout: float) -> dict[int, NodePaths]:
    """Wait until the nodes' processes are gone; return those still running at the timeout."""
    deadline = time.monotonic() + timeout
    left = dict(nodes)
    while left:
        left = {n: paths for n, paths in left.items() if running_pid(paths) is not None}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)
    return left


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _log_tail(paths: NodePaths) -> str:
    parts = []
    for log in (paths.server_log, paths.stdout):
        try:
            with log.open("rb") as file:
                # The end is enough, and a log can be tens of megabytes.
                file.seek(max(0, log.stat().st_size - _LOG_TAIL_BYTES))
                text = file.read().decode(errors="replace")
        except OSError:
            continue
        if text.strip():
            # Why it stopped is often above the shutdown's own lines.
            errors = [line for line in text.splitlines() if " ERROR " in line][:3]
            why = "".join(f"{line}\n" for line in errors)
            parts.append(f"{why}last lines of {log}:\n{_last_lines(text)}")
    return "\n".join(parts) if parts else f"no log output in {paths.root}"


def _last_lines(text: str, count: int = _LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-count:])
