"""Start, watch and stop the nodes of a local Apache Kafka cluster.

Each node is a detached JVM (``kafka.Kafka``) whose pid file lives in the
state folder, so any later process (the CLI, a test, a fault injector) can
find it again. A pid is only ever signalled after ``/proc/<pid>/cmdline``
shows that it is a ``java`` running ``kafka.Kafka`` with that node's
properties file (``_procs``), except by a start that fails: it also kills
what it launched itself and has not yet become the JVM. Each start and stop
also updates the user's record of the cluster (``_registry``).

``up``, ``down`` and ``start_node`` hold an exclusive lock on the state
folder's ``cluster.lock`` while they work, so two of them never race over
one folder. ``down(wipe=True)`` deletes only what the tool made there; a
folder that holds other files and no ``cluster.json`` is never made a
cluster's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kfeed.cluster import _jars, _registry, _schema_registry, _secure
from kfeed.cluster._layout import (
    CONTROLLER_PORT_OFFSET,
    DEFAULT_DIR,
    DEFAULT_PORT,
    HOST,
    LOCK_FILE,
    LOG4J_CONFIG,
    LOG4J_FILE,
    NODE_COUNTS,
    STATE_FILE,
    Layout,
    NodePaths,
    UsageError,
    new_cluster_id,
    write_properties,
)
from kfeed.cluster._procs import (
    has_exited,
    is_launching,
    is_node_jvm,
    pid_file_pid,
    running_pid,
    runs_kafka,
    serves_elsewhere,
)
from kfeed.errors import ClusterError, ConfigError

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
# How long down waits for another command's hold on the folder: longer than
# a default up or a down of 3 nodes takes. up waits its own timeout.
LOCK_WAIT_S = 180.0
_LOCK_POLL_S = 0.1


class NoAnswer(ClusterError):
    """:func:`status` of a cluster whose nodes run but do not answer; ``state`` holds what is known.

    ``state`` is :func:`status`'s dict with ``brokers`` set to None.
    """

    def __init__(self, message: str, state: dict[str, Any]) -> None:
        super().__init__(message)
        self.state = state


def up(
    nodes: int | None = None,
    dir: Path | str = DEFAULT_DIR,
    port: int | None = None,
    timeout: float = 120.0,
    *,
    overrides: dict[str, str] | None = None,
    unset: Iterable[str] = (),
    secure: bool | None = None,
) -> str:
    """Start the cluster in ``dir`` (creating it if needed); return its bootstrap servers.

    ``nodes``, ``port`` and ``secure`` default to what ``dir`` already holds,
    else 1, 39092 and plaintext. Returns once every broker is registered and
    answers metadata requests; nodes that were already running are left alone.

    ``overrides`` adds broker settings and ``unset`` removes ones added
    before. They are kept in ``cluster.json`` once a start with them has
    succeeded; on a cluster that already runs they are kept at once and apply
    from its next start. ``dir`` must be new, empty, or a cluster's folder.

    ``secure=True`` serves clients on SASL_SSL (SCRAM-SHA-512) with ACLs on;
    :func:`secure_client_config` gives the settings to connect with.
    """
    layout, _ = ensure_up(nodes, dir, port, timeout, overrides=overrides, unset=unset, secure=secure)
    return layout.bootstrap


def ensure_up(
    nodes: int | None,
    dir: Path | str,
    port: int | None,
    timeout: float,
    *,
    overrides: dict[str, str] | None = None,
    unset: Iterable[str] = (),
    secure: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Layout, list[int]]:
    """:func:`up`, also returning the ids of the nodes it started (empty: it was up).

    ``progress`` receives a note before a slow step (the first Maven run, a
    wait for another command's hold on the folder).
    """
    if not timeout > 0:
        raise ConfigError(f"timeout must be above 0 s, not {timeout}")
    state_dir = _state_dir(dir)
    _check_folder(state_dir, dir)
    with _locked(state_dir, dir, timeout, progress):
        saved = _load(state_dir, dir)
        recorded = _layout_for(saved, dir, nodes, port, secure)
        layout = recorded.with_settings(overrides, unset)
        missing = [n for n in layout.node_ids if running_pid(layout.node_paths(state_dir, n)) is None]
        if missing:
            try:
                # cluster.json keeps the settings it had until a start with the new ones succeeds.
                _start(layout, state_dir, missing, layout.node_ids, timeout, progress, recorded=recorded)
            except ClusterError as exc:
                raise _name_the_setting(exc, layout, recorded, overrides or {}, dir) from exc
            layout.save(state_dir)
        else:
            _wait_ready(layout, state_dir, {}, layout.node_ids, timeout)
            if layout != recorded:
                layout.save(state_dir)  # for the next start; the running nodes keep theirs
            # A cluster started before records were kept is recorded now.
            _registry.update(layout, state_dir)
    return layout, missing


def down(dir: Path | str = DEFAULT_DIR, wipe: bool = False) -> list[int]:
    """Stop every node of the cluster in ``dir``; return the ids it stopped.

    With ``wipe`` what the tool made in the state folder (``cluster.json``,
    the nodes' data and logs, the secure material) is deleted too, and the
    folder itself once nothing else is left in it. Raises ``UsageError`` when
    ``dir`` holds no cluster. An unreadable ``cluster.json`` stops ``down``,
    but not ``down(wipe=True)``, which then stops whichever node JVMs of the
    folder still run.
    """
    return ensure_down(dir, wipe)[0]


def ensure_down(
    dir: Path | str, wipe: bool = False, progress: Callable[[str], None] | None = None
) -> tuple[list[int], int | None]:
    """:func:`down`, also returning the pid of the Schema Registry it stopped (None: none ran).

    ``progress`` receives a note before a wait for another command's hold on the folder.
    """
    state_dir = _state_dir(dir)
    _check_not_a_file(state_dir, dir)
    if not (state_dir / STATE_FILE).is_file():
        _registry.forget(state_dir)
        raise _no_cluster(dir)
    with _locked(state_dir, dir, LOCK_WAIT_S, progress):
        try:
            layout = _load(state_dir, dir)
        except ClusterError as exc:
            if not wipe:
                raise
            layout = None
            # Any node that may have been: _stop signals only a JVM proven to be one.
            nodes = Layout(nodes=max(NODE_COUNTS), port=DEFAULT_PORT, cluster_id="")
            paths = [nodes.node_paths(state_dir, n) for n in nodes.node_ids]
            if not any(p.made_here or running_pid(p) is not None for p in paths):
                # (The tool writes cluster.json whole, so an unreadable one is most
                # likely not its own: a folder of the user's, which a wipe would empty.)
                raise ClusterError(
                    f"{exc.__cause__ or exc}, and no node folder in {dir} is one this tool "
                    f"made: it wipes no folder it cannot tell is a kfeed cluster's; delete "
                    f"the files yourself") from exc
        else:
            if layout is None:  # wiped by another down while this one waited
                raise _no_cluster(dir)
            nodes = layout
        try:
            registry = _schema_registry.stop(state_dir)
            stopped = _stop(nodes, state_dir, nodes.node_ids)
        finally:
            if layout is not None:
                _registry.update(layout, state_dir)
        if wipe:
            _wipe(state_dir, nodes.node_ids)
            _registry.forget(state_dir)
            logger.info("wiped %s", dir)
    return stopped, registry


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
    state = {
        "dir": str(state_dir),
        "bootstrap": layout.bootstrap,
        "cluster_id": layout.cluster_id,
        "security_protocol": layout.security_protocol,
        "client_settings": str(_secure.SecurePaths.of(state_dir).user(_secure.ADMIN)) if layout.secure else None,
        "nodes": nodes,
        "brokers": None,
        "schema_registry": _schema_registry.url(state_dir),
    }
    try:
        brokers = _registered_brokers(_admin(layout, state_dir), timeout)
    except Exception as exc:  # librdkafka raises KafkaException with varied codes
        message = f"the cluster in {dir} does not answer at {layout.bootstrap}: {_kafka_text(exc)}"
        raise NoAnswer(message, state) from exc
    return {**state, "brokers": sorted(brokers)}


def start_schema_registry(
    dir: Path | str = DEFAULT_DIR,
    port: int | None = None,
    timeout: float = _schema_registry.START_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
) -> str:
    """Run a Schema Registry (Apicurio) for the folder ``dir`` on ``port``; its URL once it answers.

    ``port`` defaults to the one it runs on already, else 38081; another port
    than the running one's is refused.

    The URL is the Confluent-compatible API (``http://127.0.0.1:PORT/apis/ccompat/v7``),
    what ``kfeed.Avro(registry={"url": ...})`` and confluent-kafka's serializers take.
    ``down`` stops it with the nodes. ``dir`` need not hold a cluster.
    """
    return _schema_registry.start(_state_dir(dir), schema_registry_port(dir, port), timeout, progress)


def schema_registry_port(dir: Path | str, port: int | None = None) -> int:
    """The port the Schema Registry of ``dir`` serves on, or would: its running one's, else ``port`` or 38081.

    Raises when ``port`` is not the running one's, or is taken.
    """
    state_dir = _state_dir(dir)
    running = _schema_registry.running_port(state_dir)
    if running is None:
        port = port or _schema_registry.DEFAULT_PORT
        if _in_use(port):
            raise ClusterError(
                f"port {port} (the Schema Registry's) is already in use on {HOST}: "
                "free it or choose another port (--schema-registry-port)"
            )
        return port
    if port not in (None, running):
        raise UsageError(
            f"the Schema Registry of {dir} already runs on port {running}: drop --schema-registry-port {port},"
            f" or stop it first with: kfeed cluster down --dir {dir}"
        )
    return running


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
    _existing_layout(state_dir, dir)
    with _locked(state_dir, dir, timeout):
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
    layout = _load(state_dir, shown)
    if layout is None:
        raise _no_cluster(shown)
    return layout


def _no_cluster(shown: Path | str) -> UsageError:
    return UsageError(
        f"no cluster in {shown} (start one with: kfeed cluster up --dir {shown};"
        " kfeed cluster list shows the others)"
    )


def _load(state_dir: Path, shown: Path | str) -> Layout | None:
    """The layout in ``cluster.json``, None without one; a failure to read it names the way out."""
    _check_not_a_file(state_dir, shown)
    try:
        return Layout.load(state_dir)
    except ClusterError as exc:
        raise ClusterError(
            f"{exc}: restore the file, or delete this cluster's files and stop its nodes with:"
            f" kfeed cluster down --dir {shown} --wipe"
        ) from exc


def _check_not_a_file(state_dir: Path, shown: Path | str) -> None:
    if state_dir.exists() and not state_dir.is_dir():
        raise UsageError(f"{shown} is a file, not a cluster's folder: pass --dir a folder")


def _own_names(node_ids: Iterable[int]) -> list[str]:
    """What the tool writes in a state folder, in the order a wipe deletes it (the lock last)."""
    files = [f"node-{n}" for n in node_ids]
    files += [_secure.SECURE_DIR, _schema_registry.FOLDER, LOG4J_FILE, f".{LOG4J_FILE}.tmp"]
    # cluster.json late: a wipe cut short is still a cluster that the next wipe finishes.
    return [*files, f".{STATE_FILE}.tmp", STATE_FILE, LOCK_FILE]


def _check_folder(state_dir: Path, shown: Path | str) -> None:
    """Refuse to make a cluster in a folder that holds other files and no ``cluster.json``.

    Without ``cluster.json`` the folder is no cluster's yet, so a ``secure/`` or
    ``log4j2.properties`` there is the user's: a start would overwrite it and a
    wipe delete it. Only the lock, a cut-short write's temporary files and a
    Schema Registry's folder are the tool's.
    """
    _check_not_a_file(state_dir, shown)
    if "," in str(state_dir):
        # log.dirs and -Dlog4j2.configurationFile are comma-separated lists.
        raise UsageError(
            f"the path of {state_dir} holds a comma, which Kafka reads as a list separator: "
            "pass --dir a folder whose path has none"
        )
    if not state_dir.is_dir() or (state_dir / STATE_FILE).exists():
        return
    # (and a Schema Registry's, which start_schema_registry runs without a cluster)
    own = {LOCK_FILE, f".{STATE_FILE}.tmp", f".{LOG4J_FILE}.tmp", _schema_registry.FOLDER}
    others = sorted(entry.name for entry in state_dir.iterdir() if entry.name not in own)
    if others:
        raise UsageError(
            f"{shown} holds files ({others[0]}{', ...' if len(others) > 1 else ''}) and no {STATE_FILE}: "
            "not a kfeed cluster's folder; pass --dir a new or empty folder"
        )


def _wipe(state_dir: Path, node_ids: Iterable[int]) -> None:
    """Delete what the tool made in ``state_dir``, then the folder if nothing else is left in it."""
    for name in _own_names(node_ids):
        path = state_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # the user's own files stay, and so does the folder
        if state_dir != Path.cwd():
            state_dir.rmdir()


@contextlib.contextmanager
def _locked(
    state_dir: Path, shown: Path | str, wait_s: float, progress: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Hold the exclusive lock of ``state_dir`` (making the folder if needed) for the block.

    Waits up to ``wait_s`` for another holder, then fails in one line. A
    folder this made and left holding only the lock file is removed again;
    in a folder that was there before, the lock file this made is.
    """
    made = next((p for p in reversed([state_dir, *state_dir.parents]) if not p.exists()), None)
    path = state_dir / LOCK_FILE
    lock_made = not path.exists()
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UsageError(
                f"cannot write in {shown} ({exc.strerror}: {exc.filename}): pass --dir a folder you can write"
            ) from exc
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                        raise ClusterError(
                            f"another kfeed cluster command{f' (pid {holder})' if holder else ''} still works"
                            f" on {shown} after {wait_s:.0f} s: run this again once it has finished"
                        ) from None
                    if not waiting and progress is not None:
                        progress(f"waiting for another kfeed cluster command on {shown}")
                    waiting = True
                    time.sleep(_LOCK_POLL_S)
            # A wipe deletes the lock file while it holds it; a lock on that
            # deleted file would exclude no one, so take the new one.
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            held = os.fstat(fd)
            if current is None or (current.st_dev, current.st_ino) != (held.st_dev, held.st_ino):
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        break
    try:
        yield
    finally:
        if made is not None or lock_made:
            _remove_if_only_lock(state_dir, made, fd)
        os.close(fd)


def _remove_if_only_lock(state_dir: Path, made: Path | None, fd: int) -> None:
    # After a start that failed before writing anything (no java, say), the
    # folder it made for its lock is taken away again (``made``: the first
    # folder it made; None: the folder was there, and only the lock file
    # goes): only while the lock file there is still the one held, not one
    # a later command made.
    try:
        if [entry.name for entry in state_dir.iterdir()] != [LOCK_FILE]:
            return
        current, held = os.stat(state_dir / LOCK_FILE), os.fstat(fd)
        if (current.st_dev, current.st_ino) != (held.st_dev, held.st_ino):
            return
        (state_dir / LOCK_FILE).unlink()
        if made is None:
            return
        folder = state_dir
        while True:
            folder.rmdir()
            if folder == made:
                return
            folder = folder.parent
    except OSError:
        return


def _secure_layout(state_dir: Path, shown: Path | str) -> Layout:
    layout = _existing_layout(state_dir, shown)
    if not layout.secure:
        raise UsageError(f"the cluster in {shown} is not secure (start one with: kfeed cluster up --secure)")
    return layout


def _layout_for(
    existing: Layout | None,
    shown: Path | str,
    nodes: int | None,
    port: int | None,
    secure: bool | None = None,
) -> Layout:
    """The recorded layout that ``up`` asks for: ``existing``, or a new one without settings."""
    if existing is None:
        return Layout(
            nodes=nodes or 1,
            port=DEFAULT_PORT if port is None else port,
            cluster_id=new_cluster_id(),
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
    return existing


def _name_the_setting(
    exc: ClusterError, layout: Layout, recorded: Layout, given: dict[str, str], shown: Path | str
) -> ClusterError:
    """``exc`` with a note on the broker setting its first line names, if one was set with --set."""
    first, newline, rest = str(exc).partition("\n")
    named = [key for key in layout.overrides if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w.])", first)]
    if not named:
        return exc
    key = named[0]
    if recorded.overrides.get(key) == layout.overrides[key]:  # (given again, or not)
        note = f"{key} comes from an earlier --set: remove it with kfeed cluster up --dir {shown} --unset {key}"
    elif key in given:
        note = f"--set {key}={given[key]} was not kept"
    else:
        return exc
    return type(exc)(f"{first} ({note}){newline}{rest}")


def _start(
    layout: Layout,
    state_dir: Path,
    node_ids: list[int],
    awaited: Iterable[int],
    timeout: float,
    progress: Callable[[str], None] | None = None,
    *,
    recorded: Layout | None = None,
) -> dict[int, int]:
    """Launch ``node_ids`` and wait for the ``awaited`` brokers; on failure stop what it launched.

    The nodes run with ``layout``'s settings; ``cluster.json`` is written from
    ``recorded`` (default ``layout``).
    """
    java = _jars.java()
    _check_ports(layout, node_ids)
    libs = _jars.jars(progress)
    _prepare(layout, state_dir, recorded or layout)
    _format(java, libs, layout, state_dir, node_ids)
    started: dict[int, int] = {}
    # Where each log ends now: a failure is told from this start's lines, not an earlier one's.
    since = {n: _log_sizes(layout.node_paths(state_dir, n)) for n in node_ids}
    try:
        for node_id in node_ids:
            paths = layout.node_paths(state_dir, node_id)
            # Known as started before the wait for its exec: an interrupt in
            # that wait stops it too (a slow wrapper on its way to java).
            started[node_id] = _launch(java, libs, state_dir, paths)
            _await_exec(started[node_id], paths)
            logger.info("started %s (pid %d)", paths.root.name, started[node_id])
        if awaited:
            _wait_ready(layout, state_dir, started, awaited, timeout, since=since)
    except BaseException:
        _kill_unexeced(layout, state_dir, started)
        _stop(layout, state_dir, started)
        raise
    _registry.update(layout, state_dir)
    return started


def _kill_unexeced(layout: Layout, state_dir: Path, started: dict[int, int]) -> None:
    """SIGKILL the launched nodes still on their way to exec java (a slow wrapper); wait until they are gone.

    ``_stop`` knows only JVMs, and each of these would become one, unknown to any later command.
    """
    killed: dict[int, Path] = {}
    for node_id, pid in started.items():
        properties = layout.node_paths(state_dir, node_id).properties
        if is_launching(pid, properties) and not is_node_jvm(pid, properties):
            logger.info("killing node %d (pid %d) before it became java", node_id, pid)
            _signal(pid, signal.SIGKILL)
            killed[pid] = properties
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(is_launching(pid, path) for pid, path in killed.items()):
        time.sleep(0.01)


def _prepare(layout: Layout, state_dir: Path, recorded: Layout) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    if layout.secure:
        formatted = any(layout.node_paths(state_dir, n).formatted for n in layout.node_ids)
        _secure.ensure_material(layout, state_dir, formatted)
    # Before the format: the cluster id must be on record before any node's data holds it.
    recorded.save(state_dir)
    (state_dir / LOG4J_FILE).write_text(LOG4J_CONFIG)
    for node_id in layout.node_ids:
        paths = layout.node_paths(state_dir, node_id)
        paths.logs.mkdir(parents=True, exist_ok=True)
        extra = _secure.broker_properties(layout, node_id, state_dir) if layout.secure else None
        # A secure node's properties hold the broker's own password.
        write_properties(paths.properties, layout.properties(node_id, state_dir, extra), private=layout.secure)


def _format(java: str, libs: Path, layout: Layout, state_dir: Path, node_ids: list[int]) -> None:
    todo = [layout.node_paths(state_dir, n) for n in node_ids]
    for paths in todo:
        _check_cluster_id(paths, layout, state_dir)
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
    try:
        outputs = [proc.communicate()[0] for proc in procs]
    except BaseException:
        # (A Ctrl-C or SIGTERM of ``up``: left running, they wrote into the
        # folder after a wipe.)
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
    failures = []
    for paths, proc, output in zip(todo, procs, outputs):
        if proc.returncode != 0:
            # The tool checks the settings too, so a bad --set can stop it here.
            reason = next(filter(None, map(_java_exception, output.splitlines())), None)
            why = f": {reason}" if reason else ":"
            failures.append(f"formatting {paths.data} failed{why}\n{_last_lines(output)}")
    if failures:
        raise ClusterError("\n".join(failures))


def _check_cluster_id(paths: NodePaths, layout: Layout, state_dir: Path) -> None:
    """Refuse a node whose data a cluster of another id formatted: Kafka's node waits
    for ever to join its quorum (INCONSISTENT_CLUSTER_ID), and up for its timeout."""
    try:
        lines = (paths.data / "meta.properties").read_text(encoding="latin-1").splitlines()
    except OSError:
        return
    found = next((line.split("=", 1)[1].strip() for line in lines
                  if line.startswith("cluster.id=")), None)
    if found is not None and found != layout.cluster_id:
        raise ClusterError(
            f"{paths.data} holds the data of cluster {found}, not of this folder's "
            f"{layout.cluster_id}: move it away, or start over with: kfeed cluster down "
            f"--dir {state_dir} --wipe")


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
    return pid


def _await_exec(pid: int, paths: NodePaths) -> None:
    """Wait until ``pid`` shows the JVM's command line, or gives up being able to.

    The shell prints the pid as soon as it forks, before the child has become
    java; until then ``/proc`` shows a shell (or nothing), which ``status``
    would take for a dead node. ``_wait_ready`` asks ``is_launching`` instead.
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


def cluster_port_of(port: int, nodes: int | None, dir: Path | str, base: int | None) -> str | None:
    """Which of the cluster's own ports ``port`` is ("broker of node 1"), for the cluster
    that ``up`` with these arguments starts or finds in ``dir``; None if none."""
    try:
        saved = Layout.load(_state_dir(dir))
    except (ClusterError, OSError):
        saved = None  # (up reports what is wrong with it)
    layout = saved or Layout(nodes=nodes or 1, port=DEFAULT_PORT if base is None else base,
                             cluster_id="")
    return next((f"{role} of node {node_id}" for node_id, role, p in
                 _ports(layout, layout.node_ids) if p == port), None)


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
    layout: Layout,
    state_dir: Path,
    started: dict[int, int],
    awaited: Iterable[int],
    timeout: float,
    *,
    since: dict[int, dict[Path, int]] | None = None,
) -> None:
    """Return once every ``awaited`` broker is registered and its own listener accepts connections.

    Registration alone is not enough after a fast restart: the controller may
    still list the previous incarnation of the node. ``since`` holds, per
    node, where its logs ended before this start (:func:`_log_sizes`).
    """
    since = since or {}
    awaited = set(awaited)
    deadline = time.monotonic() + timeout
    admin = None
    while True:
        for node_id, pid in started.items():
            paths = layout.node_paths(state_dir, node_id)
            # Not running_pid: a slow wrapper may take any time to exec java.
            if not is_launching(pid, paths.properties):
                reason = _log_reason(paths, since.get(node_id))
                if reason is None:
                    raise ClusterError(f"node {node_id} exited while starting; {_log_tail(paths, since.get(node_id))}")
                raise ClusterError(
                    f"node {node_id} exited while starting: {reason}\n{_log_tail(paths, since.get(node_id))}"
                )
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
            tail = _log_tail(paths, since.get(pending[0]))
            raise ClusterError(f"nodes {pending} not ready after {timeout:.0f} s; {tail}")
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


def _kafka_text(exc: Exception) -> str:
    """The message of a KafkaException's KafkaError, not the error object's repr."""
    error = exc.args[0] if exc.args else None
    text = getattr(error, "str", None)
    return text() if callable(text) else str(exc)


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
            stale = pid_file_pid(paths)
            if stale is not None and runs_kafka(stale) and not serves_elsewhere(stale):
                # Its folder was moved or renamed while it ran: the pid file is
                # all that still finds it (moved back, a later down stops it).
                logger.warning("node %d: pid %d runs Kafka, but not from %s (was the folder "
                               "moved while it ran?); left running: stop it with kill %d",
                               node_id, stale, paths.properties.parent, stale)
                continue
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
    """Wait until the nodes' processes are gone, every thread and port of them; return those left at the timeout."""
    deadline = time.monotonic() + timeout
    pids = {n: pid_file_pid(paths) for n, paths in nodes.items()}
    left = dict(nodes)
    while left:
        left = {
            n: paths for n, paths in left.items()
            if running_pid(paths) is not None or (pids[n] is not None and not has_exited(pids[n]))
        }
        if not left or time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)
    return left


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# A Java exception's first line: ``[Caused by: ]package.Name(Exception|Error)[: message]``.
_JAVA_EXCEPTION = re.compile(r"^(?:Caused by: )?(?:[\w$]+\.)*([\w$]*(?:Exception|Error))(?::\s*(.*))?$")


def _java_exception(line: str) -> str | None:
    """``ConfigException: Invalid value ...`` from a line that starts a Java exception, else None."""
    line = line.strip().removeprefix('Exception in thread "main" ')
    match = _JAVA_EXCEPTION.match(line)
    if match is None:
        return None
    return f"{match[1]}: {match[2]}" if match[2] else match[1]


def _log_sizes(paths: NodePaths) -> dict[Path, int]:
    """Where the node's logs end now."""
    sizes = {}
    for log in (paths.server_log, paths.stdout):
        with contextlib.suppress(OSError):
            sizes[log] = log.stat().st_size
    return sizes


def _read_log(log: Path, since: dict[Path, int] | None) -> str:
    start = (since or {}).get(log, 0)
    with log.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < start:
            start = 0  # rolled over since
        # The end is enough, and a log can be tens of megabytes.
        file.seek(max(start, size - _LOG_TAIL_BYTES))
        return file.read().decode(errors="replace")


def _log_reason(paths: NodePaths, since: dict[Path, int] | None = None) -> str | None:
    """Why the node stopped, from its logs: the exception after its first ERROR line, else that line."""
    for log in (paths.server_log, paths.stdout):
        try:
            lines = _read_log(log, since).splitlines()
        except OSError:
            continue
        first = None
        for i, line in enumerate(lines):
            if " ERROR " not in line:
                continue
            # "ERROR Exiting Kafka due to fatal exception" says little; the
            # exception printed under it says what was wrong.
            exception = _java_exception(lines[i + 1]) if i + 1 < len(lines) else None
            if exception is not None:
                return exception
            first = first or line.split(" ERROR ", 1)[1].strip()
        if first is not None:
            return first
    return None


def _log_tail(paths: NodePaths, since: dict[Path, int] | None = None) -> str:
    parts = []
    for log in (paths.server_log, paths.stdout):
        try:
            text = _read_log(log, since)
        except OSError:
            continue
        if text.strip():
            parts.append(f"last lines of {log}:\n{_last_lines(text)}")
    return "\n".join(parts) if parts else f"no log output in {paths.root}"


def _last_lines(text: str, count: int = _LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-count:])
