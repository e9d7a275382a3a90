"""``python -m kfeed``: the same as the ``kfeed`` command."""

from kfeed.cli import main

raise SystemExit(main())
