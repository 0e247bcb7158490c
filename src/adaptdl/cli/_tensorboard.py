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
import os
import re
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

from adaptdl.cli import CLIError
from adaptdl.cli._cluster_cmds import _FINISHED, _add_home, _home
from adaptdl.cluster import (
    STORE_FILE,
    ClusterAPIError,
    ClusterClient,
    DaemonNotRunningError,
    Store,
    check_listen_address,
)

__all__ = ["register", "tensorboard_logdir"]

_FOLDER = "tensorboard"


#: Names as Kubernetes objects have them (the original made a deployment of each).
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _checked_name(name: str, option: str = "TensorBoard name") -> str:
    """``name`` if it is a valid instance name; a usage error naming ``option`` if not."""
    if not _NAME.fullmatch(name):
        raise CLIError(
            f"{option} {name!r}: use at most 63 lower-case letters, digits and '-', "
            "starting and ending with a letter or digit",
            code=2,
        )
    return name


def _root(home: Path) -> Path:
    """``<home>/tensorboard``, refused if something other than a folder is there."""
    root = home / _FOLDER
    if root.exists() and not root.is_dir():
        raise CLIError(f"{root} is not a directory; move it away to keep TensorBoard logs there")
    return root


def tensorboard_logdir(home: Path, name: str, option: str = "TensorBoard") -> Path:
    """The log directory of an existing TensorBoard instance.

    Args:
        home: The cluster home.
        name: The instance's name.
        option: How the caller names the argument in errors.

    Raises:
        CLIError: the name is invalid, or no instance of that name exists.
    """
    _checked_name(name, "TensorBoard name" if option == "TensorBoard" else option)
    logdir = _root(home) / name
    if logdir.is_symlink() or not logdir.is_dir():
        raise CLIError(
            f"{option} {name!r}: no TensorBoard of that name in {home}; create it with "
            f"'adaptdl tensorboard create {name}'"
        )
    return logdir


def _cmd_create(args: argparse.Namespace) -> int:
    logdir = _root(_home(args)) / _checked_name(args.name)
    if logdir.exists() or logdir.is_symlink():
        raise CLIError(f"TensorBoard {args.name!r} already exists ({logdir})")
    try:
        logdir.mkdir(parents=True)
    except OSError as exc:
        raise CLIError(f"cannot create {logdir}: {exc.strerror or exc}") from None
    print(f"tensorboard {args.name} created: jobs submitted with --tensorboard {args.name}")
    print(f"write to $ADAPTDL_TENSORBOARD_LOGDIR/<job-name>, here {logdir}/<job-name>")
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    root = _root(_home(args))
    # As everywhere else here, a symlink is not an instance; nor is a folder
    # whose name no other command accepts (made by hand, say).
    folders = (
        sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())
        if root.is_dir()
        else []
    )
    names = [n for n in folders if _NAME.fullmatch(n)]
    others = [n for n in folders if not _NAME.fullmatch(n)]
    if others:
        print(
            f"adaptdl: note: {len(others)} folder(s) in {root} are not TensorBoard instances "
            f"(not a valid name), left out: {', '.join(others)}",
            file=sys.stderr,
        )
    if not names:
        print("no TensorBoard instances ('adaptdl tensorboard create NAME' makes one)")
        return 0
    width = max(len("NAME"), *(len(n) for n in names))
    # LOGS: jobs that have written here; WRITING: unfinished jobs attached to
    # it ("-" when neither the daemon nor its job store can tell).
    print(f"{'NAME':<{width}}  LOGS  WRITING  LOGDIR")
    attached = _attached(_home(args))
    for name in names:
        logs = sum(1 for p in (root / name).iterdir() if p.is_dir())
        writing = "-" if attached is None else str(len(attached.get(str(root / name), [])))
        print(f"{name:<{width}}  {logs:>4}  {writing:>7}  {root / name}")
    return 0


def _attached(home: Path) -> dict[str, list[str]] | None:
    """Unfinished jobs of this home's cluster by their TensorBoard logdir.

    Asks the daemon; when none answers, reads its job store, since replicas
    outlive a daemon stopped with ``--leave-jobs`` and a stopped cluster's
    unfinished jobs write again once it starts. None when neither works
    (unknown rather than none).
    """
    try:
        client = ClusterClient(home)
        jobs = client.jobs()
    except (DaemonNotRunningError, ClusterAPIError):
        return _attached_from_store(home)
    found: dict[str, list[str]] = {}
    for job in jobs:
        if job["phase"] in _FINISHED:
            continue
        try:
            env = client.describe(job["name"])["spec"].get("env") or {}
        except ClusterAPIError:
            continue  # deleted meanwhile
        except DaemonNotRunningError:
            return None
        logdir = env.get("ADAPTDL_TENSORBOARD_LOGDIR")
        if logdir:
            found.setdefault(str(logdir), []).append(str(job["name"]))
    return found


def _attached_from_store(home: Path) -> dict[str, list[str]] | None:
    """:func:`_attached` from ``<home>/state.db`` while no daemon answers."""
    path = home / STORE_FILE
    if not path.is_file():
        return {}  # no cluster ever ran here
    try:
        store = Store(path)
    except (OSError, ValueError, sqlite3.Error):  # ValueError: StoreError, a corrupt file
        return None
    try:
        rows = store.all(active_only=True)
    except sqlite3.Error:
        return None
    finally:
        store.close()
    found: dict[str, list[str]] = {}
    for row in rows:
        env = row.spec.get("env") if isinstance(row.spec, dict) else None
        logdir = env.get("ADAPTDL_TENSORBOARD_LOGDIR") if isinstance(env, dict) else None
        if logdir:
            found.setdefault(str(logdir), []).append(row.name)
    return found


def _cmd_delete(args: argparse.Namespace) -> int:
    home = _home(args)
    logdir = tensorboard_logdir(home, args.name)
    attached = _attached(home)
    if attached is None and not args.force:
        raise CLIError(
            f"cannot tell whether jobs still write to TensorBoard {args.name!r}: the cluster "
            f"in {home} does not answer and its job store cannot be read; start it "
            "('adaptdl cluster start') and try again, or pass --force"
        )
    writers = (attached or {}).get(str(logdir), [])
    if writers and not args.force:
        raise CLIError(
            f"TensorBoard {args.name!r} is in use by unfinished jobs ({', '.join(writers)}), "
            "which would write to deleted files; delete them first, or pass --force"
        )
    try:
        shutil.rmtree(logdir)
    except OSError as exc:
        raise CLIError(f"cannot delete {logdir}: {exc.strerror or exc}") from None
    print(f"tensorboard {args.name} deleted (with its logs)")
    return 0


def _cmd_proxy(args: argparse.Namespace) -> int:
    logdir = tensorboard_logdir(_home(args), args.name)
    if args.port is not None and not 0 <= args.port <= 65535:
        raise CLIError(f"--port={args.port}: expected a TCP port between 0 and 65535", code=2)
    if args.port:
        # TensorBoard replaces this process: its own failure to listen would
        # exit with its status (255), not the CLI's 1.
        try:
            check_listen_address("localhost", args.port)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    try:
        # The module run below, not just a "tensorboard" folder on sys.path.
        found = importlib.util.find_spec("tensorboard.main") is not None
    except ImportError:
        found = False
    if not found:
        raise CLIError(
            "TensorBoard is not installed in this environment; install it with "
            "'pip install tensorboard', then run this command again"
        )
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
    command += ["--host", "localhost"]
    if args.port is not None:
        command += ["--port", str(args.port)]
    print(f"starting TensorBoard for instance {args.name} ({logdir}); it prints its address")
    sys.stdout.flush()
    sys.stderr.flush()
    # TensorBoard takes this process's place: Ctrl-C, kill and the exit
    # status reach it directly, and no server is left behind holding the port.
    os.execv(sys.executable, command)
    return 0  # not reached


def register(subparsers: Any) -> None:
    """Add ``tensorboard`` and its actions."""
    parser = subparsers.add_parser(
        "tensorboard",
        help="create, list, serve or delete shared TensorBoard log directories",
        description="A TensorBoard instance is a log directory in the cluster home; jobs "
        "submitted with --tensorboard NAME find it in $ADAPTDL_TENSORBOARD_LOGDIR.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    parser.set_defaults(func=lambda args: (parser.print_help(sys.stderr), 2)[1])
    create = actions.add_parser("create", help="create a TensorBoard instance")
    create.add_argument("name", metavar="NAME")
    create.set_defaults(func=_cmd_create)
    ls = actions.add_parser("ls", help="list TensorBoard instances")
    ls.set_defaults(func=_cmd_ls)
    proxy = actions.add_parser("proxy", help="serve an instance at http://localhost:PORT")
    proxy.add_argument("name", metavar="NAME")
    proxy.add_argument(
        "-p",
        "--port",
        type=int,
        default=None,
        help="local port (default: TensorBoard's, 6006 or the next free one; 0: any)",
    )
    proxy.set_defaults(func=_cmd_proxy)
    delete = actions.add_parser("delete", help="delete an instance and its logs")
    delete.add_argument("name", metavar="NAME")
    delete.add_argument(
        "--force", action="store_true", help="delete even while running jobs write to it"
    )
    delete.set_defaults(func=_cmd_delete)
    for action in (create, ls, proxy, delete):
        _add_home(action)
