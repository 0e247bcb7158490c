"""The ``adaptdl`` command line.

Each sub-command lives in its own private module that exposes
``register(subparsers)``; the module is imported only when listed in
:data:`_COMMAND_MODULES`, so optional dependencies are loaded on use.
The CLI is the only place that installs logging handlers.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser", "CLIError"]

#: Sub-command modules, in the order they appear in ``--help``.
_COMMAND_MODULES = (
    "adaptdl.cli._cluster_cmds",
    "adaptdl.cli._demo",
    "adaptdl.cli._simulate",
    "adaptdl.cli._tensorboard",
)


class CLIError(Exception):
    """A user-facing error: printed without a traceback, exit status 1 (or ``code``)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _plugin_search_dir() -> str:
    """The directory ``--plugin`` modules that are not installed are found in: this one.

    Raises:
        CLIError: the current directory was deleted.
    """
    try:
        return os.getcwd()
    except OSError as exc:
        raise CLIError(f"--plugin: the current directory is gone ({exc})") from None


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every available sub-command."""
    parser = argparse.ArgumentParser(
        prog="adaptdl",
        description="Resource-adaptive deep learning: run, schedule and simulate elastic jobs.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (repeatable)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # sub-command not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``adaptdl`` script; returns the exit status."""
    try:
        # Building the parser imports the sub-commands (scipy among them): a
        # Ctrl-C that early gets the same one-line message as later ones.
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("adaptdl: interrupted", file=sys.stderr)
        return 130
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)  # a usage error: no command given
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"adaptdl: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("adaptdl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (``adaptdl ... | head``): stop quietly,
        # and keep the interpreter's final flush of stdout from raising again.
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):
            raise  # not a real stdout: some other pipe broke
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        return 141  # 128 + SIGPIPE, as the shell reports a piped command cut short


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
