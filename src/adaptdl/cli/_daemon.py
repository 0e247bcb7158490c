"""``python -m adaptdl.cli._daemon``: the local cluster daemon process.

``adaptdl cluster start`` (and ``adaptdl submit`` when no daemon runs) starts
this in the background; it can also be run in the foreground. It lives with
the CLI because, as a program, it is the one that sets up logging handlers;
the daemon itself (:mod:`adaptdl.cluster._daemon`) only logs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from adaptdl.cluster._daemon import parse_config, run_daemon

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the daemon's options, install a log handler and run it."""
    config = parse_config(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_daemon(config)


if __name__ == "__main__":
    sys.exit(main())
