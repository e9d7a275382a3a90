"""The clusters this user started, wherever their state folders are.

A state folder is found relative to the current directory, so from anywhere
else ``kfeed cluster status`` could not see a cluster that runs. Each start
therefore leaves a record in the user's kfeed cache,
``<cache>/clusters/<key>.json`` (``<cache>`` is ``$XDG_CACHE_HOME/kfeed`` or
``~/.cache/kfeed``, the jars' cache; ``$KFEED_CLUSTER_REGISTRY`` names another
folder of records), one per state folder: the folder, node count, bootstrap
servers, whether it is secure, the node pids and when it started.

A record says where to look, never what runs: whether a cluster is running
is asked of its pid files and ``/proc`` (``_procs``) each time, so a record
whose processes are gone reads as stopped, and one whose state folder is gone
is deleted as it is read. ``_tool`` keeps the records current on start, stop
and wipe; a record that cannot be written costs a warning, never a start.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kfeed.cluster import _jars
from kfeed.cluster._layout import STATE_FILE, Layout, NodePaths
from kfeed.cluster._procs import running_pid
from kfeed.errors import ClusterError

logger = logging.getLogger("kfeed.cluster")

REGISTRY_ENV = "KFEED_CLUSTER_REGISTRY"
_VERSION = 1


@dataclass(frozen=True)
class Record:
    """One recorded cluster, with the nodes found running when it was read."""

    dir: Path
    cluster_id: str
    nodes: int
    port: int
    bootstrap: str
    secure: bool
    # Node id -> pid as last recorded; ``running`` is what runs now.
    pids: dict[int, int] = field(default_factory=dict)
    started_at: str | None = None
    stopped_at: str | None = None
    running: dict[int, int] = field(default_factory=dict)

    @property
    def is_running(self) -> bool:
        return bool(self.running)

    def line(self) -> str:
        """``DIR  N node(s)  BOOTSTRAP  running|stopped[  secure]``, as ``kfeed cluster list`` prints it."""
        nodes = f"{self.nodes} node{'s' if self.nodes != 1 else ''}"
        state = "running" if self.is_running else "stopped"
        secure = "  secure" if self.secure else ""
        return f"{self.dir}  {nodes}  {self.bootstrap}  {state}{secure}"


def registry_dir() -> Path:
    """The folder of cluster records."""
    override = os.environ.get(REGISTRY_ENV)
    if override:
        return Path(override).expanduser()
    return _jars.cache_root() / "clusters"


def record_path(state_dir: Path) -> Path:
    # One record per state folder, so a restart or a second `up` rewrites it
    # in place; a hash, because the folder's path does not fit a file name.
    key = hashlib.sha256(os.fsencode(state_dir)).hexdigest()[:16]
    return registry_dir() / f"{key}.json"


def update(layout: Layout, state_dir: Path) -> None:
    """Record which nodes of the cluster in ``state_dir`` run now.

    A cluster that was never recorded and runs nothing stays unrecorded. The
    start time survives while any node kept running; a cluster that comes back
    from stopped starts anew.
    """
    try:
        previous = _read(record_path(state_dir))
    except ClusterError:
        previous = None
    pids = _running(layout, state_dir)
    if previous is None and not pids:
        return
    now = _now()
    if pids:
        kept = previous is not None and any(previous.pids.get(n) == pid for n, pid in pids.items())
        started_at = previous.started_at if kept and previous is not None else now
        stopped_at = None
    else:
        started_at = previous.started_at if previous is not None else None
        stopped_at = now
    record = {
        "version": _VERSION,
        "dir": str(state_dir),
        "cluster_id": layout.cluster_id,
        "nodes": layout.nodes,
        "port": layout.port,
        "bootstrap": layout.bootstrap,
        "secure": layout.secure,
        "pids": {str(n): pid for n, pid in pids.items()},
        "started_at": started_at,
        "stopped_at": stopped_at,
    }
    try:
        _write(record_path(state_dir), json.dumps(record, indent=2) + "\n")
    except OSError as exc:
        logger.warning("could not record the cluster in %s at %s: %s", state_dir, registry_dir(), exc)


def forget(state_dir: Path) -> None:
    """Delete the record of ``state_dir``, if any."""
    try:
        record_path(state_dir).unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not delete the record of %s from %s: %s", state_dir, registry_dir(), exc)


def records() -> list[Record]:
    """Every recorded cluster whose state folder still exists, sorted by folder.

    Records whose folder holds no cluster any more, and records that cannot be
    parsed, are deleted on the way.
    """
    folder = registry_dir()
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError as exc:
        logger.warning("cannot read the cluster records in %s: %s", folder, exc)
        return []
    found = []
    for path in paths:
        try:
            record = _read(path)
        except ClusterError as exc:
            logger.warning("%s; deleting it", exc)
            path.unlink(missing_ok=True)
            continue
        if record is None:
            continue  # deleted by a concurrent `down --wipe`
        if not (record.dir / STATE_FILE).is_file():
            logger.info("the cluster recorded in %s is gone (%s); deleting the record", path, record.dir)
            path.unlink(missing_ok=True)
            continue
        found.append(record)
    return sorted(found, key=lambda record: str(record.dir))


def running() -> list[Record]:
    return [record for record in records() if record.is_running]


def _read(path: Path) -> Record | None:
    try:
        state = json.loads(path.read_text())
        record = Record(
            dir=Path(state["dir"]),
            cluster_id=str(state["cluster_id"]),
            nodes=int(state["nodes"]),
            port=int(state["port"]),
            bootstrap=str(state["bootstrap"]),
            secure=bool(state.get("secure", False)),
            pids={int(n): int(pid) for n, pid in state.get("pids", {}).items()},
            started_at=state.get("started_at"),
            stopped_at=state.get("stopped_at"),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ClusterError(f"unreadable cluster record {path}: {exc}") from exc
    if not record.dir.is_absolute():
        raise ClusterError(f"unreadable cluster record {path}: dir {record.dir} is not absolute")
    try:
        layout = Layout.load(record.dir)
    except (ClusterError, ValueError):
        layout = None
    if layout is None:
        # No readable cluster.json: ask the pid files of the recorded nodes.
        pids = {n: pid for n in range(1, record.nodes + 1) if (pid := running_pid(_node(record.dir, n)))}
    else:
        pids = _running(layout, record.dir)
    return Record(**{**record.__dict__, "running": pids})


def _running(layout: Layout, state_dir: Path) -> dict[int, int]:
    pids = {n: running_pid(layout.node_paths(state_dir, n)) for n in layout.node_ids}
    return {n: pid for n, pid in pids.items() if pid is not None}


def _node(state_dir: Path, node_id: int) -> NodePaths:
    return NodePaths(state_dir / f"node-{node_id}")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # A private temporary name: two starts in other folders may write at once.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
