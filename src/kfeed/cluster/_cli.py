"""``kfeed cluster up|status|down|list|jars``: the command-line face of the cluster tool.

The only part of the cluster tool that prints. Output that scripts read goes
to stdout, with the bootstrap servers as the last line of ``up`` and
``status``. A failure is one line ``kfeed cluster: <why>`` on stderr (plus a
log excerpt when a node died): exit status 2 when the arguments were at fault
(the line names the fix), 1 otherwise.

``status`` and ``down`` without ``--dir`` look in ``.kfeed/cluster`` under the
current directory first; when that holds no cluster they turn to the clusters
this user started anywhere (``_registry``), and act on the one that runs.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from kfeed.cluster import _jars, _registry, _schema_registry, _tool
from kfeed.cluster._layout import (
    CONTROLLER_PORT_OFFSET,
    DEFAULT_DIR,
    DEFAULT_PORT,
    NODE_COUNTS,
    STATE_FILE,
    UsageError,
)
from kfeed.errors import ClusterError, ConfigError, KfeedError

Command = Callable[[argparse.Namespace], int]
USAGE_EXIT = 2


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser whose argument errors are one line, like every other mistake."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"kfeed cluster: {message} (see: {self.prog} --help)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        # Left over, an unknown argument would reach the top parser, whose
        # error is its usage and a second line; kfeed takes none anyway.
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def register(subparsers: Any) -> None:
    """Add ``cluster`` and its subcommands to the ``kfeed`` parser."""
    parser = subparsers.add_parser(
        "cluster",
        help="a local Apache Kafka cluster (KRaft, 127.0.0.1)",
        description="Run a real Apache Kafka cluster on 127.0.0.1, from jars that Maven fetches once.",
    )
    commands = parser.add_subparsers(dest="cluster_command", required=True, parser_class=_Parser)

    up = commands.add_parser("up", help="start the cluster; return once every broker is registered")
    up.add_argument("--nodes", type=int, choices=NODE_COUNTS, help="node count of a new cluster (default 1)")
    up.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help=f"state folder of the cluster (default {DEFAULT_DIR})"
    )
    up.add_argument(
        "--port",
        type=int,
        metavar="BASE",
        help=f"client port of node 1 for a new cluster (default {DEFAULT_PORT}); node i listens on "
        f"BASE+i-1, its controller on BASE+{CONTROLLER_PORT_OFFSET}+i-1",
    )
    up.add_argument(
        "--secure",
        action="store_true",
        default=None,
        help="a new cluster serves clients on SASL_SSL (SCRAM-SHA-512 users, TLS from its own CA) with ACLs on",
    )
    up.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        metavar="SECONDS",
        help="how long to wait for the brokers (default 120)",
    )
    up.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra broker setting, kept in cluster.json once a start with it succeeds; "
        "on a running cluster it is kept at once and applies from the next start (repeatable)",
    )
    up.add_argument(
        "--unset",
        action="append",
        default=[],
        metavar="KEY",
        help="remove a setting an earlier --set kept, as --set would (repeatable)",
    )
    up.add_argument(
        "--schema-registry",
        action="store_true",
        help="also run a Schema Registry (Apicurio, Confluent-compatible API) on 127.0.0.1; "
        "Maven fetches it once",
    )
    up.add_argument(
        "--schema-registry-port",
        type=_port,
        default=None,
        metavar="PORT",
        help=f"its port, 1024 to 65535 (default {_schema_registry.DEFAULT_PORT}); only with --schema-registry",
    )
    up.set_defaults(func=_up)

    status = commands.add_parser(
        "status",
        help="print the nodes, then the bootstrap servers; fail if no node answers",
        description="Print the nodes, then the bootstrap servers as the last line; exit 1 if no node answers "
        "(a node dead or unregistered beside others that answer is shown so, with exit 0: the cluster serves). "
        f"Without --dir and with no cluster in {DEFAULT_DIR}: list the clusters recorded for this user, "
        "then the status of the one that runs (exit 2 when several run).",
    )
    _add_found_dir(status)
    status.set_defaults(func=_status)

    down = commands.add_parser(
        "down",
        help="stop the nodes, keeping their data unless --wipe",
        description=f"Stop the nodes, keeping their data unless --wipe. Without --dir and with no cluster in "
        f"{DEFAULT_DIR}: stop the one running cluster recorded for this user (exit 2 when several run, "
        "or with --wipe: name it with --dir).",
    )
    _add_found_dir(down)
    down.add_argument(
        "--wipe",
        action="store_true",
        help="also delete the cluster's files (data, logs, cluster.json), and the folder when nothing else is in it",
    )
    down.set_defaults(func=_down)

    listing = commands.add_parser(
        "list",
        help="every cluster recorded for this user, running or stopped",
        description="One line per cluster this user started, from any folder: "
        "DIR  NODES  BOOTSTRAP  running|stopped, plus 'secure' for a secure one.",
    )
    listing.set_defaults(func=_list)

    jars = commands.add_parser(
        "jars",
        help="fetch the Kafka jars if needed and print their folder",
        description="Print the folder of the Kafka broker jars that up runs: $KAFKA_HOME/libs when KAFKA_HOME "
        "is set, else the user's cache, which Maven fills once (about a minute) when it is empty.",
    )
    jars.set_defaults(func=_jars_command)


def _add_found_dir(parser: argparse.ArgumentParser) -> None:
    # None, not DEFAULT_DIR: an absent --dir may be resolved through the records.
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"state folder of the cluster (default {DEFAULT_DIR} if it holds one, "
        "else the one running cluster recorded for this user)",
    )


def _reported(command: Command) -> Command:
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (UsageError, ConfigError) as exc:
            print(f"kfeed cluster: {exc}", file=sys.stderr)
            return USAGE_EXIT
        except KfeedError as exc:
            print(f"kfeed cluster: {exc}", file=sys.stderr)
            return 1

    return run


@_reported
def _up(args: argparse.Namespace) -> int:
    if args.schema_registry_port is not None and not args.schema_registry:
        raise UsageError("--schema-registry-port needs --schema-registry (add it, or drop the port)")
    overrides = dict(_setting(text) for text in args.overrides)
    unset = [_key(text) for text in args.unset]
    # Before anything starts: a taken or contradicting port must not leave a cluster half up.
    registry_port = _tool.schema_registry_port(args.dir, args.schema_registry_port) if args.schema_registry else None
    clash = None if registry_port is None else \
        _tool.cluster_port_of(registry_port, args.nodes, args.dir, args.port)
    if clash is not None:
        raise UsageError(f"the Schema Registry's port {registry_port} is the cluster's own ({clash}): "
                         f"choose another with --schema-registry-port")
    here = _absolute(args.dir)
    others = [record for record in _registry.running() if record.dir != here]
    if others:
        _note(f"note: {_describe(others)}")
    _, started = _tool.ensure_up(
        args.nodes,
        args.dir,
        args.port,
        args.timeout,
        overrides=overrides,
        unset=unset,
        secure=args.secure,
        progress=_note,
    )
    if started:
        print(f"started node{'s' if len(started) > 1 else ''} {_ids(started)} in {args.dir}")
    elif overrides or unset:
        print(
            f"already up in {args.dir}; the settings are kept in {args.dir / STATE_FILE} and apply from its next "
            f"start (kfeed cluster down --dir {args.dir}, then kfeed cluster up --dir {args.dir})"
        )
    else:
        print(f"already up in {args.dir}")
    if registry_port is not None:
        _tool.start_schema_registry(args.dir, registry_port, args.timeout, progress=_note)
    _show_status(args.dir)
    return 0


@_reported
def _status(args: argparse.Namespace) -> int:
    if args.dir is not None:
        _show_status(args.dir)
        return 0
    if _holds_cluster(DEFAULT_DIR):
        try:
            _show_status(DEFAULT_DIR)
        except ClusterError as exc:
            others = _registry.running() if not _tool.node_pids(DEFAULT_DIR) else []
            if others:
                raise ClusterError(f"{exc}; {_describe(others)}") from exc
            raise
        return 0
    records = _registry.records()
    if not records:
        raise ClusterError(f"no cluster in {DEFAULT_DIR} and none recorded (start one with: kfeed cluster up)")
    print(f"no cluster in {DEFAULT_DIR}; the clusters recorded:")
    for record in records:
        print(record.line())
    running = [record for record in records if record.is_running]
    if len(running) > 1:
        raise UsageError(f"{len(running)} clusters are running; pick one with: kfeed cluster status --dir DIR")
    if not running:
        hint = records[0].dir if len(records) == 1 else "DIR"
        raise ClusterError(f"none of them is running (start one with: kfeed cluster up --dir {hint})")
    print(f"status of the one running, {running[0].dir}:")
    _show_status(running[0].dir)
    return 0


@_reported
def _down(args: argparse.Namespace) -> int:
    dir = args.dir if args.dir is not None else DEFAULT_DIR
    if args.dir is None and not _holds_cluster(DEFAULT_DIR):
        running = _registry.running()
        if len(running) > 1:
            for record in running:
                print(record.line())
            raise UsageError(f"{len(running)} clusters are running; pick one with: kfeed cluster down --dir DIR")
        if running and args.wipe:
            # Deleting data takes a folder the user named, not one found for them.
            raise UsageError(
                f"no cluster in {DEFAULT_DIR}, and --wipe deletes data: name the running one with "
                f"kfeed cluster down --dir {running[0].dir} --wipe"
            )
        if running:
            dir = running[0].dir
            print(f"no cluster in {DEFAULT_DIR}; stopping the one running, {dir}")
        else:
            print(f"nothing running in {dir}")
            return 0
    stopped, registry = _tool.ensure_down(dir, wipe=args.wipe, progress=_note)
    if stopped:
        print(f"stopped node{'s' if len(stopped) > 1 else ''} {_ids(stopped)} in {dir}")
    if registry is not None:
        print(f"stopped the schema registry in {dir}")
    if not stopped and registry is None:
        print(f"nothing running in {dir}")
    if args.wipe:
        # The current directory stays even when nothing is left in it.
        kept = " (the other files there are kept)" if dir.exists() and any(dir.iterdir()) else ""
        print(f"wiped {dir}{kept}")
    return 0


@_reported
def _list(args: argparse.Namespace) -> int:
    records = _registry.records()
    if not records:
        _note(f"no cluster recorded in {_registry.registry_dir()} (start one with: kfeed cluster up)")
    for record in records:
        print(record.line())
    return 0


@_reported
def _jars_command(args: argparse.Namespace) -> int:
    print(_jars.jars(progress=_note))
    return 0


def _note(text: str) -> None:
    # stderr, so that stdout stays what scripts read.
    print(text, file=sys.stderr, flush=True)


def _holds_cluster(dir: Path) -> bool:
    return (dir / STATE_FILE).is_file()


def _absolute(dir: Path) -> Path:
    # As the records hold it.
    return dir.expanduser().resolve()


def _describe(others: list[_registry.Record]) -> str:
    if len(others) == 1:
        return f"another cluster runs in {others[0].dir} ({others[0].bootstrap})"
    return f"{len(others)} other clusters run (kfeed cluster list shows them)"


def _show_status(dir: Path) -> None:
    """Print the status of the cluster in ``dir``; of one that does not answer, its node lines first."""
    try:
        state = _tool.status(dir)
    except _tool.NoAnswer as exc:
        _print_nodes(exc.state)
        raise
    _print_status(state)


def _print_status(state: dict[str, Any]) -> None:
    if state["client_settings"] is not None:
        # Where the password lives, never the password.
        protocol, settings = state["security_protocol"], state["client_settings"]
        print(f"security {protocol} (SCRAM-SHA-512, ACLs on)  admin settings {settings}")
    _print_nodes(state)
    if state.get("schema_registry"):
        print(f"schema registry {state['schema_registry']}")
    print(state["bootstrap"])


def _print_nodes(state: dict[str, Any]) -> None:
    for node in state["nodes"]:
        pid = node["pid"] if node["pid"] is not None else "-"
        alive = "alive" if node["alive"] else "dead"
        if state["brokers"] is None:
            registered = "no-answer"
        else:
            registered = "registered" if node["id"] in state["brokers"] else "unregistered"
        print(f"node {node['id']}  pid {pid}  {alive}  {registered}  port {node['port']}")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"wants a number of seconds above 0, not {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1024 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"wants a port from 1024 to 65535, not {text!r}")
    return value


def _key(text: str) -> str:
    if not text.strip() or "=" in text:
        raise ConfigError(f"--unset wants a KEY that an earlier --set gave, not {text!r}")
    return text.strip()


def _setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set wants KEY=VALUE, not {text!r}")
    if any(c in text for c in "\r\n"):  # a second line would be a second setting
        raise ConfigError(f"--set {text!r}: one setting a --set, on one line")
    return key.strip(), value


def _ids(node_ids: list[int]) -> str:
    return ", ".join(str(n) for n in node_ids)
