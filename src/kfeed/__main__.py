"""``python -m kfeed`` and the ``kfeed`` command: ``kfeed.cli.main``.

Kept apart from ``kfeed.cli`` so that a Ctrl-C or SIGTERM while the command
line still loads its modules ends it with one line and exit status 130 or
143, as later.
"""

import signal
import sys

from kfeed.errors import Interrupted


def run() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, Interrupted.handler)
    Interrupted.keep_lost()
    try:
        from kfeed.cli import main

        return main()
    except KeyboardInterrupt as e:
        signum = Interrupted.caught()
        print("kfeed: interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", signum or signal.SIGINT)


if __name__ == "__main__":
    raise SystemExit(run())
