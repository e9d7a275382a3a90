"""The shape of a local cluster: node ids, ports, broker settings, state files.

Pure data and file formats, no processes. ``_tool`` starts and stops nodes
from what is written here; ``docker-compose.yml`` mirrors the settings of
:func:`node_properties` for 3 nodes (``tests/test_compose.py`` holds them
together).
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kfeed.errors import ClusterError, ConfigError

DEFAULT_DIR = Path(".kfeed/cluster")
DEFAULT_PORT = 39092
# Controllers listen at a fixed distance above the brokers so that one base
# port describes the whole layout.
CONTROLLER_PORT_OFFSET = 100
HOST = "127.0.0.1"
NODE_COUNTS = (1, 3)

STATE_FILE = "cluster.json"
LOG4J_FILE = "log4j2.properties"
# Held (flock) by up, down and start_node, so that two of them never work on
# one folder at once.
LOCK_FILE = "cluster.lock"
_STATE_VERSION = 1

# INFO to a size-capped file per node: enough to diagnose a failed start, and
# long soak runs cannot fill the disk. ``kafka.logs.dir`` is set per node on
# the java command line.
LOG4J_CONFIG = """\
status = warn
name = kfeed-local-kafka
appender.server.type = RollingFile
appender.server.name = server
appender.server.fileName = ${sys:kafka.logs.dir}/server.log
appender.server.filePattern = ${sys:kafka.logs.dir}/server.log.%i
appender.server.layout.type = PatternLayout
appender.server.layout.pattern = [%d] %p %m (%c)%n
appender.server.policies.type = Policies
appender.server.policies.size.type = SizeBasedTriggeringPolicy
appender.server.policies.size.size = 50MB
appender.server.strategy.type = DefaultRolloverStrategy
appender.server.strategy.max = 2
rootLogger.level = INFO
rootLogger.appenderRef.server.ref = server
"""


class UsageError(ClusterError):
    """A request its caller can correct: a folder with no cluster, a layout that contradicts one.

    Still a ``ClusterError`` for Python callers; the CLI exits 2 on it, as on
    any other mistake in its arguments.
    """


def replication_factor(nodes: int) -> int:
    return min(nodes, 3)


def min_insync_replicas(nodes: int) -> int:
    # One replica may fail while acks=all writes still succeed.
    return max(1, replication_factor(nodes) - 1)


def node_properties(
    node_id: int,
    nodes: int = 3,
    *,
    port: int = DEFAULT_PORT,
    dir: Path | str = DEFAULT_DIR,
    overrides: dict[str, str] | None = None,
) -> dict[str, str]:
    """The ``server.properties`` of node ``node_id`` (1-based) in a ``nodes``-node layout.

    Node ``i`` serves clients on ``port + i - 1`` and its controller on
    ``port + 100 + i - 1``; its data lives under ``dir/node-<i>``.
    """
    layout = Layout(nodes=nodes, port=port, cluster_id="", overrides=dict(overrides or {}))
    return layout.properties(node_id, Path(dir))


def new_cluster_id() -> str:
    """A random cluster id in the form ``kafka-storage random-uuid`` prints."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        # Kafka rejects ids that would parse as command-line flags.
        if not text.startswith("-"):
            return text


@dataclass(frozen=True)
class NodePaths:
    """Where one node keeps its files inside the state folder."""

    root: Path

    @property
    def properties(self) -> Path:
        return self.root / "server.properties"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def made_here(self) -> bool:
        """Whether the tool made this node folder: its properties keep its data in it."""
        try:
            text = self.properties.read_text(encoding="latin-1")  # (as Java reads it)
        except OSError:
            return False
        return f"log.dirs={_escape(str(self.data))}" in text.splitlines()

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def server_log(self) -> Path:
        return self.logs / "server.log"

    @property
    def stdout(self) -> Path:
        return self.root / "stdout.log"

    @property
    def pid(self) -> Path:
        return self.root / "kafka.pid"

    @property
    def formatted(self) -> bool:
        return (self.data / "meta.properties").is_file()


@dataclass(frozen=True)
class Layout:
    """Node count, ports and cluster id: everything ``cluster.json`` records."""

    nodes: int
    port: int
    cluster_id: str
    overrides: dict[str, str] = field(default_factory=dict)
    # SASL_SSL client listener, SCRAM users and ACLs (see ``_secure``).
    secure: bool = False

    def __post_init__(self) -> None:
        if self.nodes not in NODE_COUNTS:
            raise ConfigError(f"nodes must be one of {NODE_COUNTS}, not {self.nodes}")
        highest = self.port + CONTROLLER_PORT_OFFSET + self.nodes - 1
        if not 1024 <= self.port or highest > 65535:
            top = 65535 - CONTROLLER_PORT_OFFSET - self.nodes + 1
            raise ConfigError(
                f"base port {self.port} leaves the range 1024..65535 for this layout: choose one from 1024 to {top}"
            )

    @property
    def node_ids(self) -> range:
        return range(1, self.nodes + 1)

    def broker_port(self, node_id: int) -> int:
        return self.port + self._index(node_id)

    def controller_port(self, node_id: int) -> int:
        return self.port + CONTROLLER_PORT_OFFSET + self._index(node_id)

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{HOST}:{self.broker_port(n)}" for n in self.node_ids)

    def node_paths(self, state_dir: Path, node_id: int) -> NodePaths:
        self._index(node_id)
        return NodePaths(state_dir / f"node-{node_id}")

    @property
    def security_protocol(self) -> str:
        return "SASL_SSL" if self.secure else "PLAINTEXT"

    def properties(self, node_id: int, state_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Node ``node_id``'s settings; ``extra`` (the secure listeners) comes before the overrides."""
        paths = self.node_paths(state_dir, node_id)
        factor = str(replication_factor(self.nodes))
        min_isr = str(min_insync_replicas(self.nodes))
        voters = ",".join(f"{n}@{HOST}:{self.controller_port(n)}" for n in self.node_ids)
        client = f"PLAINTEXT://{HOST}:{self.broker_port(node_id)}"
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node_id),
            "controller.quorum.voters": voters,
            "listeners": f"{client},CONTROLLER://{HOST}:{self.controller_port(node_id)}",
            "advertised.listeners": client,
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "log.dirs": str(paths.data),
            "num.partitions": "4",
            "default.replication.factor": factor,
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": factor,
            # Few internal partitions: each one costs startup time on 2 cores.
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": factor,
            "transaction.state.log.min.isr": min_isr,
            "transaction.state.log.num.partitions": "10",
            "share.coordinator.state.topic.replication.factor": factor,
            "share.coordinator.state.topic.min.isr": min_isr,
            # Tests join groups one after another; the default 3 s delay would
            # add up across the suite.
            "group.initial.rebalance.delay.ms": "0",
            # Kafka 4's consumer group protocol takes the session timeout from
            # the broker (45 s, and no less); let a group ask for a classic-like
            # 6 s (the group config consumer.session.timeout.ms), and heartbeats
            # as frequent as classic ones may be, so a killed trainer's
            # partitions move on as soon as with the classic protocol. The
            # defaults (45 s, 5 s) stay what a group gets unless it asks.
            "group.consumer.min.session.timeout.ms": "6000",
            "group.consumer.min.heartbeat.interval.ms": "500",
            # A typo in a topic name must fail, not create a new topic.
            "auto.create.topics.enable": "false",
        }
        props.update(extra or {})
        props.update(self.overrides)
        return props

    def with_settings(self, overrides: dict[str, str] | None, unset: Iterable[str] = ()) -> Layout:
        """This layout with ``overrides`` added (or replaced) and the ``unset`` keys removed."""
        unset = list(unset)
        both = sorted(set(overrides or {}) & set(unset))
        if both:
            raise ConfigError(f"--set and --unset both name {both[0]}: pick one")
        unknown = [key for key in unset if key not in self.overrides]
        if unknown:
            kept = ", ".join(sorted(self.overrides)) or "none"
            raise ConfigError(f"--unset {unknown[0]}: not among the cluster's --set settings ({kept})")
        kept_settings = {k: v for k, v in self.overrides.items() if k not in unset}
        return replace(self, overrides={**kept_settings, **(overrides or {})})

    def save(self, state_dir: Path) -> None:
        state = {"version": _STATE_VERSION, **asdict(self), "bootstrap": self.bootstrap}
        state["controller_port"] = self.controller_port(1)
        _write_atomic(state_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")

    @classmethod
    def load(cls, state_dir: Path) -> Layout | None:
        """The layout recorded in ``state_dir``, or None when there is none."""
        path = state_dir / STATE_FILE
        try:
            state = json.loads(path.read_text())
            overrides = state.get("overrides", {})
            if not isinstance(overrides, dict):
                raise TypeError(f"overrides is {json.dumps(overrides)}, not an object")
            return cls(
                nodes=int(state["nodes"]),
                port=int(state["port"]),
                cluster_id=str(state["cluster_id"]),
                overrides={str(k): str(v) for k, v in overrides.items()},
                secure=bool(state.get("secure", False)),
            )
        except (FileNotFoundError, NotADirectoryError):  # a folder below a file holds nothing
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ClusterError(f"unreadable cluster state {path}: {exc}") from exc

    def _index(self, node_id: int) -> int:
        if node_id not in self.node_ids:
            raise ClusterError(f"no node {node_id} in a {self.nodes}-node cluster")
        return node_id - 1


def write_properties(path: Path, props: dict[str, str], private: bool = False) -> None:
    """Write a Java properties file; ``private`` (it holds a password) makes it owner-only."""
    lines = [f"{_escape(key)}={_escape(value)}\n" for key, value in props.items()]
    if private:
        write_private(path, "".join(lines))
    else:
        _write_atomic(path, "".join(lines))


def _escape(text: str) -> str:
    """``text`` as a properties file holds it: Java reads the file as ISO-8859-1, then its escapes."""
    out = []
    # A backslash starts an escape, even in values.
    for char in text.replace("\\", "\\\\"):
        if char.isascii():
            out.append(char)
        else:  # \uXXXX, in the UTF-16 code units of Java's strings
            units = char.encode("utf-16-be")
            out += (f"\\u{units[i : i + 2].hex()}" for i in range(0, len(units), 2))
    return "".join(out)


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, readable by its owner only from the first byte on."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    tmp.replace(path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
