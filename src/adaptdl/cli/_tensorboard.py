"""``adaptdl tensorboard create|ls|proxy|delete``: shared TensorBoard log directories.

The original CLI deployed a TensorBoard server on Kubernetes with a volume
that every job submitted with ``--tensorboard NAME`` mounted, and passed its
path to the job as ``ADAPTDL_TENSORBOARD_LOGDIR``. On the local cluster a
TensorBoard instance is a directory, ``<home>/tensorboard/NAME``: ``submit
--tensorboard NAME`` gives the job that path, jobs write to
``$ADAPTDL_TENSORBOARD_LOGDIR/<job-name>`` as the documentation shows, and
``proxy`` serves the directory with the ``tensorboard`` program (installed
separately: ``pip install tensorboard``).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from adaptdl.cli import CLIError
from adaptdl.cli._cluster_cmds import _add_home, _home

__all__ = ["register", "tensorboard_logdir"]

_FOLDER = "tensorboard"


#: Names as Kubernetes objects have them (the original made a deployment of each).
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _checked_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise CLIError(
            f"TensorBoard name {name!r}: use at most 63 lower-case letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return name


def tensorboard_logdir(home: Path, name: str, option: str = "TensorBoard") -> Path:
    """The log directory of an existing TensorBoard instance.

    Args:
        home: The cluster home.
        name: The instance's name.
        option: How the caller names the argument in errors.

    Raises:
        CLIError: the name is invalid, or no instance of that name exists.
    """
    _checked_name(name)
    logdir = home / _FOLDER / name
    if not logdir.is_dir():
        raise CLIError(
            f"{option} {name!r}: no TensorBoard of that name in {home}; create it with "
            f"'adaptdl tensorboard create {name}'"
        )
    return logdir


def _cmd_create(args: argparse.Namespace) -> int:
    home = _home(args)
    logdir = home / _FOLDER / _checked_name(args.name)
    if logdir.exists():
        raise CLIError(f"TensorBoard {args.name!r} already exists ({logdir})")
    logdir.mkdir(parents=True)
    print(f"tensorboard {args.name} created: jobs submitted with --tensorboard {args.name}")
    print(f"write to $ADAPTDL_TENSORBOARD_LOGDIR/<job-name>, here {logdir}/<job-name>")
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    root = _home(args) / _FOLDER
    names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not names:
        print("no TensorBoard instances ('adaptdl tensorboard create NAME' makes one)")
        return 0
    width = max(len("NAME"), *(len(n) for n in names))
    print(f"{'NAME':<{width}}  JOBS  LOGDIR")
    for name in names:
        jobs = sum(1 for p in (root / name).iterdir() if p.is_dir())
        print(f"{name:<{width}}  {jobs:>4}  {root / name}")
    return 0


def _cmd_delete(args: argparse.Namespace) -> int:
    logdir = tensorboard_logdir(_home(args), args.name)
    shutil.rmtree(logdir)
    print(f"tensorboard {args.name} deleted (with its logs)")
    return 0


def _cmd_proxy(args: argparse.Namespace) -> int:
    logdir = tensorboard_logdir(_home(args), args.name)
    if not 1 <= args.port <= 65535:
        raise CLIError(f"--port={args.port}: expected a TCP port between 1 and 65535")
    if importlib.util.find_spec("tensorboard") is None:
        raise CLIError(
            "TensorBoard is not installed in this environment; install it with "
            "'pip install tensorboard', then run this command again"
        )
    command = [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        str(logdir),
        "--host",
        "localhost",
        "--port",
        str(args.port),
    ]
    print(f"Proxying to TensorBoard instance {args.name} at http://localhost:{args.port}")
    process = subprocess.Popen(command)  # noqa: S603 - our own interpreter and arguments
    try:
        code = process.wait()
    except KeyboardInterrupt:
        process.terminate()
        process.wait()
        return 0
    if code != 0:
        raise CLIError(f"tensorboard exited with status {code}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``tensorboard`` and its actions."""
    parser = subparsers.add_parser(
        "tensorboard",
        help="create, list, serve or delete shared TensorBoard log directories",
        description="A TensorBoard instance is a log directory in the cluster home; jobs "
        "submitted with --tensorboard NAME find it in $ADAPTDL_TENSORBOARD_LOGDIR.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="create a TensorBoard instance")
    create.add_argument("name", metavar="NAME")
    create.set_defaults(func=_cmd_create)
    ls = actions.add_parser("ls", help="list TensorBoard instances")
    ls.set_defaults(func=_cmd_ls)
    proxy = actions.add_parser("proxy", help="serve an instance at http://localhost:PORT")
    proxy.add_argument("name", metavar="NAME")
    proxy.add_argument("-p", "--port", type=int, default=6006, help="local port (default 6006)")
    proxy.set_defaults(func=_cmd_proxy)
    delete = actions.add_parser("delete", help="delete an instance and its logs")
    delete.add_argument("name", metavar="NAME")
    delete.set_defaults(func=_cmd_delete)
    for action in (create, ls, proxy, delete):
        _add_home(action)
