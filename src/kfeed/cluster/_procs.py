"""Which live processes are the nodes of a local cluster.

Everything that signals a node, or reports one as running, asks here first.
A pid alone proves nothing (pids are reused, pid files outlive their
processes), so a pid counts as a node only while ``/proc/<pid>/cmdline``
shows a ``java`` running ``kafka.Kafka`` with that node's own properties
file, whose path lies inside the cluster's state folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from kfeed.cluster._layout import NodePaths


def is_node_jvm(pid: int, properties: Path) -> bool:
    """Whether ``pid`` is a live JVM running ``kafka.Kafka`` with ``properties``."""
    args = _node_args(pid, properties)
    return args is not None and os.path.basename(args[0]).startswith(b"java")


def is_launching(pid: int, properties: Path) -> bool:
    """Whether ``pid``, just launched as the node, still runs: as its JVM, or on the way to exec it.

    Before the exec the process is the launching shell or a wrapper named
    ``java`` (a version manager's shim), whose command line holds the JVM's
    arguments. Only for a pid this process launched: from a pid file, such a
    process proves nothing.
    """
    return _node_args(pid, properties) is not None


def _node_args(pid: int, properties: Path) -> list[bytes] | None:
    if pid <= 0:
        return None
    try:
        # A zombie's cmdline is empty, so an exited node reads as not running
        # even before its parent collects it.
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return args if b"kafka.Kafka" in args and os.fsencode(properties) in args else None


def runs_kafka(pid: int) -> bool:
    """Whether ``pid`` is a Kafka node's JVM, of whatever folder (a folder moved since)."""
    try:
        return b"kafka.Kafka" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


def has_exited(pid: int) -> bool:
    """Whether every thread of ``pid`` has finished exiting, so its sockets are closed.

    A killed JVM's command line reads empty as soon as its main thread lets
    go of the memory, while it and dozens of other threads are still on the
    way out, holding the node's listening sockets. Only a zombie whose other
    threads are gone (or a pid collected already) holds nothing.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return fields.get("State", "").split()[:1] in (["Z"], ["X"]) and fields.get("Threads", "").strip() in ("", "1")


def pid_file_pid(paths: NodePaths) -> int | None:
    """The pid the node's pid file names, whether or not it still runs."""
    try:
        return int(paths.pid.read_text().strip())
    except (OSError, ValueError):
        return None


def running_pid(paths: NodePaths) -> int | None:
    """The node's live JVM: the pid in its pid file, if that process is it; else one
    found by its command line (a pid file lost or emptied: the node was reported
    stopped, and a wipe deleted its data under it)."""
    pid = pid_file_pid(paths)
    if pid is not None and is_node_jvm(pid, paths.properties):
        return pid
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and is_node_jvm(int(entry.name), paths.properties):
            return int(entry.name)
    return None


def serves_elsewhere(pid: int) -> bool:
    """Whether ``pid`` is a Kafka node of a folder that is still there: another cluster's,
    not one moved while it ran."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        properties = Path(os.fsdecode(args[args.index(b"kafka.Kafka") + 1]))
    except (OSError, ValueError, IndexError):
        return False
    return properties.is_file()
