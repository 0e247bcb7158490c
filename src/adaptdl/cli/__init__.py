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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

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


class _Parser(argparse.ArgumentParser):
    """An argument parser whose ``--help`` on stdout can fail like any other output.

    argparse ignores a failed write of its help, so ``adaptdl --help | head``
    exited 0 (or 120 from the interpreter's last flush) instead of 141. Help
    printed elsewhere (stderr, after a usage error) still ignores a failed
    write, as argparse does: the exit status already says what went wrong.
    Sub-command parsers inherit the class.
    """

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        if file is not None:
            super().print_help(file)
            return
        if sys.stdout is not None:
            sys.stdout.write(self.format_help())
            sys.stdout.flush()


class _CommandParser(_Parser):
    """A sub-command's parser: it reports arguments it does not take itself.

    argparse hands them up to the top-level parser, whose usage line
    (``adaptdl [-h] [-v] COMMAND ...``) does not show what the command takes.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every available sub-command."""
    parser = _Parser(
        prog="adaptdl",
        description="Resource-adaptive deep learning: run, schedule and simulate elastic jobs.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (repeatable)"
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_CommandParser
    )
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
    except BrokenPipeError:  # from --help (see _Parser)
        if _silence_stdout():
            return _PIPE_CLOSED
        raise
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
        if _silence_stdout():
            return _PIPE_CLOSED
        raise


def _silence_stdout() -> bool:
    """After stdout's reader went away (``adaptdl ... | head``): stop quietly.

    Points standard output at /dev/null, so the interpreter's final flush
    does not raise again. Returns False when stdout is not a real file (then
    some other pipe broke, and the error stands).
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    return True


#: Exit status of a command whose output pipe closed: 128 + SIGPIPE, as the
#: shell reports a piped command cut short.
_PIPE_CLOSED = 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
