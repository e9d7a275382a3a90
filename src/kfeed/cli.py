"""The ``kfeed`` command: the outermost layer.

It uses the cluster tool, the producer and the loader; nothing imports it.
Only this module prints.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kfeed import cluster


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kfeed", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    cluster.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
