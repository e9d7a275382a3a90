"""``kfeed cluster up|status|down|jars``: the command-line face of the cluster tool.

The only part of the cluster tool that prints. Output that scripts read goes
to stdout, with the bootstrap servers as the last line; a failure is one line
``kfeed cluster: <why>`` on stderr (plus a log excerpt when a node died) and
exit status 1.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kfeed.cluster import _jars, _tool
from kfeed.cluster._layout import CONTROLLER_PORT_OFFSET, DEFAULT_DIR, DEFAULT_PORT, NODE_COUNTS
from kfeed.errors import ConfigError, KfeedError

Command = Callable[[argparse.Namespace], int]


def register(subparsers: Any) -> None:
    """Add ``cluster`` and its subcommands to the ``kfeed`` parser."""
    parser = subparsers.add_parser(
        "cluster",
        help="a local Apache Kafka cluster (KRaft, 127.0.0.1)",
        description="Run a real Apache Kafka cluster on 127.0.0.1, from jars that Maven fetches once.",
    )
    commands = parser.add_subparsers(dest="cluster_command", required=True)

    up = commands.add_parser("up", help="start the cluster; return once every broker is registered")
    up.add_argument("--nodes", type=int, choices=NODE_COUNTS, help="node count of a new cluster (default 1)")
    _add_dir(up)
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
        "--timeout", type=float, default=120.0, metavar="SECONDS", help="how long to wait for the brokers (default 120)"
    )
    up.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra broker setting, kept for later starts (repeatable)",
    )
    up.set_defaults(func=_up)

    status = commands.add_parser("status", help="print the nodes, then the bootstrap servers; fail if down")
    _add_dir(status)
    status.set_defaults(func=_status)

    down = commands.add_parser("down", help="stop the nodes, keeping their data unless --wipe")
    _add_dir(down)
    down.add_argument("--wipe", action="store_true", help="also delete the state folder")
    down.set_defaults(func=_down)

    jars = commands.add_parser("jars", help="fetch the Kafka jars if needed and print their folder")
    jars.set_defaults(func=_jars_command)


def _add_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help=f"state folder of the cluster (default {DEFAULT_DIR})"
    )


def _reported(command: Command) -> Command:
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except KfeedError as exc:
            print(f"kfeed cluster: {exc}", file=sys.stderr)
            return 1

    return run


@_reported
def _up(args: argparse.Namespace) -> int:
    overrides = dict(_setting(text) for text in args.overrides)
    _, started = _tool.ensure_up(
        args.nodes, args.dir, args.port, args.timeout, overrides=overrides, secure=args.secure, progress=_note
    )
    if started:
        print(f"started node{'s' if len(started) > 1 else ''} {_ids(started)} in {args.dir}")
    else:
        print(f"already up in {args.dir}")
    _print_status(_tool.status(args.dir))
    return 0


@_reported
def _status(args: argparse.Namespace) -> int:
    _print_status(_tool.status(args.dir))
    return 0


@_reported
def _down(args: argparse.Namespace) -> int:
    existed = args.dir.exists()
    stopped = _tool.down(args.dir, wipe=args.wipe)
    if stopped:
        print(f"stopped node{'s' if len(stopped) > 1 else ''} {_ids(stopped)} in {args.dir}")
    else:
        print(f"nothing running in {args.dir}")
    if args.wipe and existed and not args.dir.exists():
        print(f"wiped {args.dir}")
    return 0


@_reported
def _jars_command(args: argparse.Namespace) -> int:
    print(_jars.jars(progress=_note))
    return 0


def _note(text: str) -> None:
    # stderr, so that stdout stays what scripts read.
    print(text, file=sys.stderr, flush=True)


def _print_status(state: dict[str, Any]) -> None:
    if state["client_settings"] is not None:
        # Where the password lives, never the password.
        protocol, settings = state["security_protocol"], state["client_settings"]
        print(f"security {protocol} (SCRAM-SHA-512, ACLs on)  admin settings {settings}")
    for node in state["nodes"]:
        pid = node["pid"] if node["pid"] is not None else "-"
        alive = "alive" if node["alive"] else "dead"
        registered = "registered" if node["id"] in state["brokers"] else "unregistered"
        print(f"node {node['id']}  pid {pid}  {alive}  {registered}  port {node['port']}")
    print(state["bootstrap"])


def _setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set wants KEY=VALUE, not {text!r}")
    return key.strip(), value


def _ids(node_ids: list[int]) -> str:
    return ", ".join(str(n) for n in node_ids)
