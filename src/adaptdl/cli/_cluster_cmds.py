"""``adaptdl cluster|submit|ls|describe|logs|cp|delete``: the local cluster CLI.

Every command finds the daemon of one *home* directory (``--home``, else
``ADAPTDL_HOME``, else ``~/.adaptdl``) through ``<home>/daemon.json`` and talks
to its HTTP API; ``submit`` starts a daemon when none runs. A daemon started by
either reuses the options the last daemon of that home was given (saved in
``<home>/daemon-settings.json``) unless they are given again or ``--defaults``
is passed, and says so; the options of every start become the saved ones.
``logs`` and ``cp`` read the job's files directly, since client and cluster
share the machine.
User mistakes raise :class:`~adaptdl.cli.CLIError` naming what to fix, and
change nothing.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import errno
import importlib
import importlib.machinery
import json
import math
import os
import posixpath
import re
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from http import HTTPStatus
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, TextIO

from adaptdl import env
from adaptdl._plugins import PluginImportError, import_plugins
from adaptdl.cli import CLIError, _plugin_search_dir
from adaptdl.cluster import (
    DEFAULT_HOST,
    DEFAULT_INTERVAL,
    DEFAULT_POLICY,
    PYTHON_COMMANDS,
    SETTINGS_FILE,
    BackendError,
    ClusterAPIError,
    ClusterClient,
    DaemonNotAnsweringError,
    DaemonNotRunningError,
    JobSpec,
    JobSpecError,
    backend_names,
    check_command,
    check_launchable,
    check_listen_address,
    default_home,
    detect_gpus,
    gpu_slot_shortfall,
    load_daemon_settings,
    load_job_file,
    parse_policy_options,
    parse_preload,
    start_daemon,
    validate_job_name,
)
from adaptdl.sched import MAX_COUNT

__all__ = ["register"]

_FINISHED = ("Succeeded", "Failed")
#: Seconds ``logs -f`` keeps following without a daemon before it gives up.
FOLLOW_WITHOUT_DAEMON = 120.0


# ---------------------------------------------------------------------- helpers


def _home(args: argparse.Namespace) -> Path:
    """The cluster home the command addresses.

    Raises:
        CLIError: it exists but is not a directory (every later message would
            otherwise blame a file inside it).
    """
    if args.home is not None and not args.home.strip():
        raise CLIError(f"--home {args.home!r}: expected a directory (or leave --home out)", code=2)
    home = Path(args.home).expanduser().resolve() if args.home else default_home()
    if args.home:
        source = f"--home {args.home}"
    elif env.get_str("ADAPTDL_HOME"):
        source = f"ADAPTDL_HOME={env.get_str('ADAPTDL_HOME')}"
    else:
        source = "the default home (set ADAPTDL_HOME or pass --home to use another)"
    blocker = next((p for p in home.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise CLIError(
            f"{source}: {blocker} is a file, so no directory {home} can be made below it; "
            "pass a directory for the cluster's state (it is created if missing)"
        )
    if home.exists() and not home.is_dir():
        raise CLIError(
            f"{source}: {home} is a file, not a directory; pass a directory for the cluster's "
            f"state (it is created if missing)"
        )
    return home


def _job_name(value: str) -> str:
    """An argparse type for job names: an empty one would address the job list.

    Names no job can have (job names are checked at submission) are refused
    before they reach a URL: undecodable bytes or 70,000 characters used to
    end in a traceback or "Request-URI Too Long". Other unknown names get
    the daemon's "no job named ...".
    """
    if not value.strip():
        raise argparse.ArgumentTypeError(f"invalid job name {value!r}: expected a non-empty name")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"invalid job name {value!r}: not valid UTF-8, so no job has it"
        ) from None
    if len(value) > 63:
        raise argparse.ArgumentTypeError(
            f"invalid job name {value[:40]!r}... ({len(value)} characters): job names have "
            "at most 63"
        )
    return value


def _check_utf8(what: str, value: str) -> None:
    """Refuse text that came from undecodable bytes (a file name in another encoding)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        raise CLIError(
            f"{what} {shown!r} is not valid UTF-8 (a name written in another encoding?); "
            "rename it, or pass the job its value another way"
        ) from None


def _client(args: argparse.Namespace) -> ClusterClient:
    try:
        return ClusterClient(_home(args))
    except DaemonNotRunningError as exc:
        raise CLIError(str(exc)) from None


def _call(function: Any, *call_args: Any) -> Any:
    """Run a client call, turning API and connection errors into CLI errors."""
    try:
        return function(*call_args)
    except ClusterAPIError as exc:
        raise CLIError(str(exc)) from None
    except DaemonNotRunningError as exc:
        raise CLIError(str(exc)) from None


def _add_home(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home", default=None, help="cluster home (default: $ADAPTDL_HOME or ~/.adaptdl)"
    )


def _add_daemon_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    default: Any = argparse.SUPPRESS if suppress else None
    parser.add_argument(
        "--slots", type=int, default=default, help="replica slots (default: GPUs, else cores)"
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=default,
        help=f"seconds between scheduling rounds (default {DEFAULT_INTERVAL:g})",
    )
    parser.add_argument(
        "--policy", default=default, help=f"scheduling policy (default {DEFAULT_POLICY})"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=default,
        help="seconds replicas get to checkpoint after SIGTERM (default 30)",
    )
    parser.add_argument(
        "--host",
        default=default,
        help=f"interface the supervisor binds (default {DEFAULT_HOST}: this machine only; "
        "0.0.0.0: every interface)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=default,
        help="supervisor port (default 0: the last daemon's port if free, so surviving "
        "replicas reach the new daemon, else any free one)",
    )
    parser.add_argument(
        "--policy-option",
        action="append",
        default=argparse.SUPPRESS if suppress else [],
        metavar="KEY=VALUE",
        help="policy keyword argument, e.g. restart_delay=10 (repeatable)",
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=argparse.SUPPRESS if suppress else [],
        help="module the daemon imports first (may register policies)",
    )
    parser.add_argument(
        "--no-warm-start",
        dest="warm_start",
        action="store_false",
        default=argparse.SUPPRESS if suppress else None,
        help="start replicas as fresh interpreters instead of forking a pre-warmed one",
    )
    parser.add_argument(
        "--warm-start",
        dest="warm_start",
        action="store_true",
        default=argparse.SUPPRESS,
        help="fork replicas from a pre-warmed interpreter (the default; undoes a saved "
        "--no-warm-start)",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=argparse.SUPPRESS if suppress else [],
        metavar="MODULE[,MODULE]",
        help="modules the warm-start process imports besides numpy, torch, adaptdl.torch",
    )
    parser.add_argument(
        "--defaults",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="when starting a daemon, start from the defaults instead of the options the "
        f"last one was given (saved in HOME/{SETTINGS_FILE}; by default they are reused); "
        "the options of this start then replace the saved ones",
    )


def _add_submit_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    default: Any = argparse.SUPPRESS if suppress else None
    parser.add_argument(
        "-f", "--jobfile", default=default, help="AdaptDLJob YAML (default DIR/adaptdljob.yaml)"
    )
    parser.add_argument("-n", "--name", default=default, help="job name")
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=default,
        help="fewest replicas the job runs with (default 0: it may wait for any)",
    )
    parser.add_argument(
        "--max-replicas",
        type=int,
        default=default,
        help="most replicas the scheduler may give it (default: no limit)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=default,
        help="replica failures tolerated before the job fails (default 3)",
    )
    parser.add_argument(
        "--tensorboard",
        metavar="NAME",
        default=default,
        help="give the job $ADAPTDL_TENSORBOARD_LOGDIR of this TensorBoard instance "
        "(see 'adaptdl tensorboard create')",
    )
    if not suppress:  # after the script, only _take_dockerfile's form counts
        parser.add_argument(
            "-d",
            "--dockerfile",
            metavar="PATH",
            default=None,
            help="accepted for the original CLI and ignored: the local cluster runs jobs in "
            "this machine's Python environment and builds no image (after the script, only "
            "a path whose file name contains 'Dockerfile'; other -d go to the job)",
        )
    _add_daemon_options(parser, suppress)
    if suppress:
        parser.add_argument("--home", default=argparse.SUPPRESS)


def _check_daemon_options(args: argparse.Namespace) -> None:
    if args.slots is not None and not 1 <= args.slots <= MAX_COUNT:
        raise CLIError(f"--slots={args.slots}: expected an integer from 1 to 2**31 - 1", code=2)
    try:
        preload = parse_preload(getattr(args, "preload", []))
    except ValueError as exc:
        raise CLIError(str(exc), code=2) from None
    for module in preload:
        _check_importable("--preload", module)
    if preload and getattr(args, "warm_start", True) is False:
        # Preloading happens in the warm-start process, which this start has none of.
        print(
            f"adaptdl: warning: --preload {','.join(preload)} has no effect with "
            "--no-warm-start (modules are preloaded into the warm-start process)",
            file=sys.stderr,
        )
    if args.host is not None and not args.host.strip():
        raise CLIError(
            f"--host {args.host!r}: expected an interface address or name, e.g. "
            f"{DEFAULT_HOST} (this machine only) or 0.0.0.0 (every interface)",
            code=2,
        )
    if args.host is not None:
        try:
            args.host.encode("idna")
        except UnicodeError as exc:  # an empty or over-long label: a typo, not the network
            raise CLIError(f"--host {args.host!r}: not a valid host name ({exc})", code=2) from None
    if args.port is not None and not 0 <= args.port <= 65535:
        raise CLIError(f"--port={args.port}: expected a TCP port between 0 and 65535", code=2)
    if args.interval is not None and not (math.isfinite(args.interval) and args.interval > 0):
        raise CLIError(f"--interval={args.interval}: expected a positive number of seconds", code=2)
    if args.grace is not None and not (math.isfinite(args.grace) and args.grace >= 0):
        raise CLIError(f"--grace={args.grace}: expected a number of seconds >= 0", code=2)
    where = _plugin_dir(args)
    try:
        import_plugins(args.plugin, where)
    except PluginImportError as exc:
        raise CLIError(str(exc), code=exc.exit_code) from None
    _check_policy(args.policy or DEFAULT_POLICY, args.policy_option)
    if getattr(args, "backend", None) is not None:
        if args.backend not in backend_names():
            raise CLIError(
                f"--backend: unknown backend {args.backend!r}; valid backends: "
                f"{', '.join(backend_names())} (a --plugin module may register more)",
                code=2,
            )


def _plugin_dir(args: argparse.Namespace) -> str | None:
    """Where the ``--plugin`` modules that are not installed are found.

    The directory the command runs in, as for ``adaptdl simulate``; plugins
    reused from the saved settings keep the directory of the start that gave
    them.
    """
    if not args.plugin:
        return None
    if getattr(args, "plugin_dir", None) is None:
        args.plugin_dir = _plugin_search_dir()
    return str(args.plugin_dir)


def _check_importable(option: str, module: str) -> None:
    """Fail now if ``module``'s top-level package cannot be found.

    Only the top-level name is looked up, and nothing is imported: a preload
    can be heavy (or fail only where it runs), and finding ``a.b`` would
    import ``a``. The warm-start process logs a submodule it cannot import.
    """
    top = module.split(".")[0]
    try:
        found = (
            top in sys.modules
            or top in sys.builtin_module_names
            or importlib.machinery.PathFinder.find_spec(top) is not None
        )
    except Exception as exc:  # noqa: BLE001 - a broken path entry: say so, not a traceback
        raise CLIError(f"{option} {module}: cannot look up {top!r}: {exc}") from None
    if not found:
        raise CLIError(
            f"{option} {module}: no module named {top!r} is importable by {sys.executable}; "
            f"check the spelling, or install it in that environment"
        )


def _check_policy(policy: str, items: Sequence[str]) -> None:
    """Build the policy once here, so a bad option fails now, not in the daemon.

    Raises:
        CLIError: the policy is unknown, or refuses an option; the message
            names the ``--policy-option`` and its value.
    """
    from adaptdl.sched import get_policy, policy_names

    if policy not in policy_names():
        # The registry's own message would also list the simulator baselines.
        raise CLIError(
            f"--policy: unknown policy {policy!r}; on a cluster use one of: "
            f"{', '.join(_cluster_policies())} (a --plugin module may register more)",
            code=2,
        )
    try:
        options = parse_policy_options(items)
    except ValueError as exc:
        raise CLIError(f"--policy-option: {exc}", code=2) from None
    try:
        built = get_policy(policy, **options)
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise CLIError(_policy_error(policy, options, exc), code=2) from None
    if not built.cluster_ready:
        raise CLIError(
            f"--policy {policy}: a simulator baseline, it needs what only a simulator knows "
            f"(fixed gang sizes, an oracle of remaining work); on a cluster use one of: "
            f"{', '.join(_cluster_policies())}",
            code=2,
        )


def _cluster_policies() -> list[str]:
    """Registered policies a cluster can run (built with their defaults to ask).

    Only for error messages: a plugin's factory that needs options, or fails
    with its defaults, is left out rather than breaking the message.
    """
    from adaptdl.sched import get_policy, policy_names

    ready = []
    for name in policy_names():
        try:
            if get_policy(name).cluster_ready:
                ready.append(name)
        except Exception:  # noqa: BLE001, S112 - someone else's factory
            continue
    return ready


def _policy_error(policy: str, options: dict[str, Any], error: Exception) -> str:
    """Say which ``--policy-option`` the policy refused, and why, in the user's terms.

    A policy given ``restart_delay="abc"`` fails deep inside with something
    like "'<' not supported between instances of 'str' and 'int'"; trying
    the options one at a time finds the culprit. A value that is not JSON
    reaches the policy as text, which is the likely mistake when it then
    fails with a ``TypeError``.
    """
    from adaptdl.sched import get_policy, policy_factory

    try:
        policy_factory(policy)
    except ValueError:
        return f"policy {policy!r}: {error}"  # unknown: the message lists the valid ones
    for key, value in options.items():
        try:
            get_policy(policy, **{key: value})
        except (TypeError, ValueError, ArithmeticError) as single:
            reason = str(single)
            if "unexpected keyword argument" in reason:
                reason = f"policy {policy!r} has no option {key!r}"
            elif isinstance(single, TypeError) and isinstance(value, str):
                reason = (
                    f"expected a number or another JSON value, not the text {value!r} "
                    f"(policy {policy!r}: {single})"
                )
            shown = json.dumps(value) if not isinstance(value, str) else value
            return f"--policy-option {key}={shown}: {reason}"
    return f"policy {policy!r}: {error}"  # the options are refused only together


_DAEMON_OPTIONS = ("slots", "interval", "policy", "grace", "host", "port", "backend")
_LIST_OPTIONS = ("policy_option", "plugin", "preload")


def _given_daemon_options(args: argparse.Namespace) -> list[str]:
    """The daemon options given on this command line, as the user wrote them."""
    given = [f"--{name}" for name in _DAEMON_OPTIONS if getattr(args, name, None) is not None]
    given += [f"--{name.replace('_', '-')}" for name in _LIST_OPTIONS if getattr(args, name, [])]
    warm_start = getattr(args, "warm_start", None)
    if warm_start is not None:
        given.append("--warm-start" if warm_start else "--no-warm-start")
    if getattr(args, "defaults", False):
        given.append("--defaults")
    return given


def _warn_running(
    args: argparse.Namespace, client: ClusterClient, given: list[str] | None = None
) -> None:
    """Validate daemon options and say that a running daemon ignores them.

    Args:
        given: The options given, when ``args`` has since been filled from
            saved settings (default: read from ``args``).
    """
    _check_daemon_options(args)
    if given is None:
        given = _given_daemon_options(args)
    if given:
        print(
            f"adaptdl: warning: the cluster is already running (pid {client.pid}); "
            f"{', '.join(given)} apply only when it starts: run 'adaptdl cluster stop' first",
            file=sys.stderr,
        )


def _reuse_settings(args: argparse.Namespace, home: Path) -> dict[str, list[str]]:
    """Fill the daemon options not given from the last daemon's saved settings.

    Policy options are reused only with the policy they were meant for.

    Returns:
        The reused settings by attribute name, each written as options, for
        the user to see.
    """
    if getattr(args, "defaults", False):
        return {}
    try:
        saved = load_daemon_settings(home)
    except ValueError as exc:
        raise CLIError(f"{exc}; delete the file, or pass --defaults to ignore it") from None
    same_policy = args.policy is None or args.policy == saved.get("policy", DEFAULT_POLICY)
    reused: dict[str, list[str]] = {}
    for key, value in saved.items():
        flag = f"--{key.replace('_', '-')}"
        if key == "plugin_dir":
            continue  # it goes with the saved plugins, below
        if key in _LIST_OPTIONS:
            if getattr(args, key, []) or (key == "policy_option" and not same_policy):
                continue
            setattr(args, key, list(value))
            reused[key] = [f"{flag} {item}" for item in value]
            if key == "plugin" and "plugin_dir" in saved:
                args.plugin_dir = saved["plugin_dir"]
        elif key == "warm_start":
            if getattr(args, "warm_start", None) is None:
                args.warm_start = value
                reused[key] = ["--warm-start" if value else "--no-warm-start"]
        elif getattr(args, key, None) is None:
            setattr(args, key, value)
            text = f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
            reused[key] = [text]
    return reused


def _check_slots_against_gpus(args: argparse.Namespace, *, saved: bool, settings: Path) -> None:
    """Refuse more slots than GPUs; lower saved ones to the GPUs there are now.

    Each slot is one GPU. A saved ``--slots`` may come from a start with more
    GPUs visible (another ``CUDA_VISIBLE_DEVICES``): that start worked, so
    this one uses the GPUs there are, with a warning, instead of failing.
    """
    if args.slots is None:
        return
    gpus = detect_gpus()
    shortfall = gpu_slot_shortfall(args.slots, gpus)
    if shortfall is None:
        return
    if not saved:
        raise CLIError(f"--slots {args.slots}: {shortfall}", code=2)
    print(
        f"adaptdl: warning: the saved --slots {args.slots} (from {settings}) is more than "
        f"the {len(gpus)} GPUs visible now; the cluster uses {len(gpus)}",
        file=sys.stderr,
    )
    args.slots = len(gpus)


def _start(args: argparse.Namespace) -> ClusterClient:
    """Start a daemon with the options given, else the saved ones, else defaults."""
    home = _home(args)
    reused = _reuse_settings(args, home)
    if reused:
        shown = ", ".join(text for texts in reused.values() for text in texts)
        print(
            f"reusing the settings of the last cluster in {home}: {shown} "
            f"(from {home / SETTINGS_FILE}; options given now override them, --defaults "
            "starts from the defaults instead)"
        )
    _check_daemon_options(args)
    _check_slots_against_gpus(args, saved="slots" in reused, settings=home / SETTINGS_FILE)
    try:
        check_listen_address(
            DEFAULT_HOST if args.host is None else args.host,
            args.port or 0,
            saved=[key for key in ("host", "port") if key in reused],
            settings=str(home / SETTINGS_FILE),
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        return start_daemon(
            home,
            slots=args.slots,
            interval=args.interval,
            policy=args.policy,
            grace=args.grace,
            host=args.host,
            port=args.port,
            plugins=args.plugin,
            plugin_dir=_plugin_dir(args),
            policy_options=parse_policy_options(args.policy_option),
            warm_start=getattr(args, "warm_start", None) is not False,
            preload=getattr(args, "preload", []),
            backend=getattr(args, "backend", None),
        )
    except RuntimeError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot start a cluster in {home}: {exc}") from None


def _started(client: ClusterClient, home: Path) -> str:
    """What a just-started daemon runs with, for the user."""
    info = _call(client.cluster)
    return (
        f"{client.url} (home {home}, {info['slots']} {info['slotResource']} slots, "
        f"policy {info['policy']}, interval {info['interval']:g}s)"
    )


def _age(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 172800:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    )


def _replicas_cell(job: dict[str, Any]) -> str:
    running = job["replicas"]
    wanted = len(job["allocation"])
    if job["phase"] in _FINISHED:
        return "-"
    return str(running) if running == wanted else f"{running}->{wanted}"


#: The ``ls`` columns' meaning, for its help.
LS_HELP = (
    "DURATION is the time from a job's first start to its completion, "
    "or until now while it is not finished, time spent pending or preempted since "
    "included ('-' if it never started). AGE is the time "
    "since it was submitted, for finished jobs too."
)


def job_rows(jobs: Iterable[dict[str, Any]], now: float) -> list[list[str]]:
    """The ``ls`` table, header first (shared with the demo); see :data:`LS_HELP`."""
    rows = [["NAME", "STATUS", "REPLICAS", "RESTARTS", "BATCH", "GOODPUT", "DURATION", "AGE"]]
    for job in jobs:
        started = job["started"]
        rows.append(
            [
                job["name"],
                job["phase"],
                _replicas_cell(job),
                str(job["restarts"]),
                "-" if job["batchSize"] is None else str(job["batchSize"]),
                "-" if job["goodput"] is None else f"{job['goodput']:.1f}",
                "-" if started is None else _age((job["completed"] or now) - started),
                _age(now - job["submitted"]),
            ]
        )
    return rows


# ---------------------------------------------------------------------- cluster


#: Seconds ``cluster start`` waits for a daemon that is stopping to exit.
STOPPING_WAIT = 300.0


def _wait_until_stopped(client: ClusterClient) -> bool:
    """If the running daemon is stopping, wait for it to exit; whether it was stopping."""
    try:
        draining = bool(client.cluster().get("draining"))
    except (ClusterAPIError, DaemonNotRunningError):
        draining = True  # it stopped answering between two calls: it is going away
    if not draining:
        return False
    print(
        f"adaptdl: the cluster daemon (pid {client.pid}) is stopping; waiting for it to exit "
        "before starting a new one",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + STOPPING_WAIT
    while time.monotonic() < deadline:
        try:
            ClusterClient(client.home).cluster()
        except (ClusterAPIError, DaemonNotRunningError):
            return True
        time.sleep(0.5)
    raise CLIError(
        f"the cluster daemon (pid {client.pid}) is still stopping after {STOPPING_WAIT:g} s; "
        "try again once 'adaptdl cluster status' says it has gone"
    )


def _cmd_cluster_start(args: argparse.Namespace) -> int:
    home = _home(args)
    try:
        client = ClusterClient(home)
        if _wait_until_stopped(client):
            raise DaemonNotRunningError("stopped")  # start a new one below
    except DaemonNotAnsweringError as exc:
        raise CLIError(str(exc)) from None  # it holds the lock: no other can start
    except DaemonNotRunningError:
        given = _given_daemon_options(args)
        client = _start(args)
        if client.started_here:
            print(f"adaptdl cluster started: {_started(client, home)}")
            return 0
        _warn_running(args, client, given)  # another command started it a moment ago
    else:
        _warn_running(args, client)
    print(f"adaptdl cluster already running: {client.url} (home {home}, pid {client.pid})")
    return 0


#: Seconds ``cluster stop`` waits for the daemon to exit (more with a long --grace).
_STOP_WAIT = 60.0
#: Beyond the daemon's --grace: its own margin (5 s) and a slow machine's.
_STOP_MARGIN = 30.0


def _cmd_cluster_stop(args: argparse.Namespace) -> int:
    try:
        client = ClusterClient(_home(args))
    except DaemonNotAnsweringError as exc:
        raise CLIError(str(exc)) from None  # it holds the lock and its jobs: not stopped
    except DaemonNotRunningError:
        # Stopping what is stopped succeeds, as with service managers.
        print(f"adaptdl cluster is not running (home {_home(args)}); nothing to stop")
        return 0
    active = sum(1 for job in _call(client.jobs) if job["phase"] not in _FINISHED)
    grace = _call(client.cluster).get("grace")
    stopping_jobs = _call(lambda: client.request_shutdown(stop_jobs=not args.leave_jobs))
    if stopping_jobs == args.leave_jobs:  # an earlier stop decided it
        print(
            "adaptdl: note: a stop was already under way "
            + ("and stops the jobs" if stopping_jobs else "and leaves the jobs running"),
            file=sys.stderr,
        )
    # The daemon gives replicas its --grace to checkpoint, then its own margin.
    wait = _STOP_WAIT
    if stopping_jobs and isinstance(grace, (int, float)):
        wait = max(wait, float(grace) + _STOP_MARGIN)
    if not client.wait_stopped(wait):
        raise CLIError(
            f"the daemon (pid {client.pid}) is still stopping: replicas are still "
            "checkpointing; 'adaptdl cluster status' shows when it has gone"
        )
    if not active:
        print(f"adaptdl cluster stopped (home {client.home})")
    elif not stopping_jobs:
        print(f"adaptdl cluster stopped (home {client.home}); jobs keep running")
    else:
        # Not "checkpointed": a replica that ignored SIGTERM for the grace
        # period was killed, and resumes from its previous checkpoint.
        print(
            f"adaptdl cluster stopped (home {client.home}); its jobs resume from their "
            "last checkpoint at the next start"
        )
    return 0


def _cmd_cluster_status(args: argparse.Namespace) -> int:
    client = _client(args)
    info = _call(client.cluster)
    jobs = _call(client.jobs)
    active = sum(1 for job in jobs if job["phase"] not in _FINISHED)
    print(f"url:       {client.url}")
    print(f"pid:       {info['pid']}")
    print(f"home:      {info['home']}")
    print(f"backend:   {info['backend']}")
    print(f"slots:     {info['usedSlots']}/{info['slots']} {info['slotResource']} in use")
    rounds = info["rounds"]
    plural = "round" if rounds == 1 else "rounds"
    print(f"policy:    {info['policy']} (every {info['interval']:g}s, {rounds} {plural})")
    failure = info.get("policyError")
    if failure:
        when = _age(max(time.time() - failure["time"], 0.0))
        print(
            f"error:     {when} ago: {failure['message']}; allocations unchanged (see daemon.log)"
        )
    print(f"jobs:      {active} active, {len(jobs) - active} finished")
    print(f"uptime:    {_age(time.time() - info['started'])}")
    return 0


# ---------------------------------------------------------------------- jobs


def _random_name(stem: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")[:50] or "job"
    return f"{base}-{secrets.token_hex(2)}"


def _is_python(program: str) -> bool:
    return program in PYTHON_COMMANDS or os.path.basename(program).startswith("python")


def _check_program(spec: JobSpec) -> None:
    """Fail early when the job's program, given with a ``/``, cannot be started.

    A program without a ``/`` is looked up on the ``PATH`` of the replicas,
    which is the daemon's environment plus the job's ``env``; the backend
    checks it at submission (:func:`~adaptdl.cluster.check_command`), where
    that environment is known. ``python``/``python3`` are the cluster's own
    interpreter and need no check.
    """
    program = spec.command[0]
    if program in PYTHON_COMMANDS or "/" not in program:
        return
    workdir = Path(spec.working_dir)
    path = Path(program) if os.path.isabs(program) else workdir / program
    if not path.is_file():
        raise CLIError(f"command {program!r} of job {spec.name!r} was not found ({path})")
    if not os.access(path, os.X_OK):
        raise CLIError(
            f"command {program!r} of job {spec.name!r} is not executable: run "
            f"'chmod +x {path}', or start it through its interpreter (e.g. 'python {program}')"
        )


def _check_script(spec: JobSpec) -> None:
    """Fail early when the program, or the script of ``python SCRIPT``, does not exist."""
    _check_program(spec)
    if not _is_python(spec.command[0]):
        return
    rest = list(spec.command[1:]) + list(spec.args)
    if not rest or rest[0].startswith("-"):
        return  # python -m module, python -c code: nothing to check
    script = Path(rest[0])
    if not script.is_absolute():
        script = Path(spec.working_dir) / script
    if not script.is_file():
        hint = ""
        local = Path(spec.working_dir) / script.name
        if Path(rest[0]).is_absolute() and local.is_file():
            # A job file written for a container image (the original's
            # hello-world COPYs its script to /root/...).
            hint = (
                f"; {local} exists: the local cluster runs jobs in their directory, not in "
                f"a container image, so name the script {script.name!r} in the command"
            )
        raise CLIError(f"script {rest[0]!r} not found in {spec.working_dir}{hint}")


#: Suffixes of job files, which ``submit`` takes as ``-f`` when given as the target.
_JOB_FILE_SUFFIXES = (".yaml", ".yml")
#: Suffixes of files ``python FILE`` runs (a file without a suffix is run too).
_PYTHON_SUFFIXES = (".py", ".pyw", ".pyc", ".pyz")


def _build_spec(args: argparse.Namespace, job_args: list[str]) -> JobSpec:
    if not args.target.strip():
        raise CLIError(f"script or project directory {args.target!r}: expected a path", code=2)
    if args.jobfile is not None and not args.jobfile.strip():
        raise CLIError(f"-f {args.jobfile!r}: expected a job file", code=2)
    _check_utf8("script or project directory", os.path.abspath(args.target))
    if args.jobfile is not None:
        _check_utf8("job file", os.path.abspath(args.jobfile))
    for arg in job_args:
        _check_utf8("job argument", arg)
    target = Path(args.target).expanduser()
    if not target.exists():
        raise CLIError(f"script or project directory {str(target)!r} does not exist")
    if not target.is_file() and not target.is_dir():
        raise CLIError(
            f"script or project directory {str(target)!r} is neither a file nor a directory"
        )
    if target.is_file() and target.suffix.lower() in _JOB_FILE_SUFFIXES:
        # "adaptdl submit job.yaml" means the job file, not a script to run with python.
        if args.jobfile is not None:
            raise CLIError(
                f"{str(target)!r} is a job file and -f {args.jobfile!r} names another; "
                "pass a script or a directory with -f"
            )
        args.jobfile = str(target)
        target = target.parent
    elif target.is_file() and target.suffix and target.suffix.lower() not in _PYTHON_SUFFIXES:
        raise CLIError(
            f"{str(target)!r} is not a Python script: submit runs scripts with python; "
            "for another program, write a job file with its command and pass it with -f"
        )
    if args.name is not None:
        try:
            validate_job_name(args.name)
        except JobSpecError as exc:
            raise CLIError(f"--name {args.name!r}: {exc}", code=2) from None
    # Absolute but not resolved: a script that is a symlink into another
    # directory still runs in the directory it was submitted from. (Unless
    # dropping ".." as text would name another file: "link/../x.py".)
    absolute = Path(os.path.abspath(target))
    target = absolute if absolute.exists() and absolute.samefile(target) else target.resolve()
    workdir = target if target.is_dir() else target.parent
    jobfile = Path(args.jobfile).expanduser() if args.jobfile else None
    if jobfile is None and target.is_dir() and (target / "adaptdljob.yaml").is_file():
        jobfile = target / "adaptdljob.yaml"
    overrides: dict[str, Any] = {
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
    }
    try:
        if jobfile is not None:
            spec = load_job_file(
                jobfile,
                name=args.name,
                working_dir=str(workdir),
                args=job_args if job_args or getattr(args, "job_args_given", False) else None,
                **overrides,
            )
            if target.is_file():  # an explicit script replaces the file's command
                spec = _replace(spec, command=("python", str(target)))
        else:
            script = target if target.is_file() else target / "main.py"
            if not script.is_file():
                raise CLIError(
                    f"{str(target)!r} has neither adaptdljob.yaml nor main.py; pass a script "
                    "or -f JOBFILE"
                )
            spec = JobSpec(
                name=args.name or _random_name(script.stem if target.is_file() else target.name),
                command=("python", str(script)),
                args=tuple(job_args),
                working_dir=str(workdir),
                min_replicas=0 if args.min_replicas is None else args.min_replicas,
                max_replicas=MAX_COUNT if args.max_replicas is None else args.max_replicas,
            )
        if args.max_restarts is not None:
            spec = _replace(spec, max_restarts=args.max_restarts)
    except JobSpecError as exc:
        raise CLIError(str(exc)) from None
    try:
        check_launchable(spec)
    except JobSpecError as exc:
        raise CLIError(f"{jobfile}: {exc}" if jobfile is not None else str(exc)) from None
    try:
        _check_script(spec)
    except CLIError as exc:
        if jobfile is None or target.is_file():
            raise
        raise CLIError(f"{jobfile}: {exc}") from None  # the command came from the file
    return spec


def _replace(spec: JobSpec, **changes: Any) -> JobSpec:
    data = spec.to_json()
    names = {
        "command": "command",
        "max_restarts": "maxRestarts",
        "env": "env",
    }
    for key, value in changes.items():
        data[names[key]] = list(value) if isinstance(value, tuple) else value
    return JobSpec.from_json(data)


class _RecordingParser(argparse.ArgumentParser):
    """An ArgumentParser that remembers its long option names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.long_options: list[str] = []

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.long_options += [name for name in action.option_strings if name.startswith("--")]
        return action


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether ``a`` becomes ``b`` by one insertion, deletion, substitution or swap."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        return len(diff) == 1 or (
            len(diff) == 2
            and diff[1] == diff[0] + 1
            and a[diff[0]] == b[diff[1]]
            and a[diff[1]] == b[diff[0]]
        )
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = 0
    while i < len(short) and short[i] == long[i]:
        i += 1
    return short[i:] == long[i + 1 :]


def _refuse_misspelt_options(job_args: list[str], options: list[str]) -> None:
    """Refuse a job argument that is a near miss of a submit option.

    Without ``--``, arguments after the script that are not submit options go
    to the job, so ``--max-replica 2`` would silently reach the script instead
    of bounding the job. Near misses are: the same multi-word option up to
    case, ``_`` for ``-`` or a trailing ``s``; one typo away from it, or a
    prefix of only it (``--max-rep``); one typo away from a one-word option
    of ten letters or more (``--tensorbord``). Shorter one-word options are
    left alone: ``--hosts``, ``--reload`` or ``--internal`` may well be the
    job's own.
    """

    def norm(option: str) -> str:
        return option.lower().replace("_", "-").rstrip("s")

    multi_word = {norm(option): option for option in options if "-" in option[2:]}
    long_words = [option for option in options if "-" not in option[2:] and len(option) >= 12]
    for arg in job_args:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg.split("=", 1)[0]
        if name in options:
            continue
        match = multi_word.get(norm(name))
        if match is None:
            close = [
                option
                for option in [*multi_word.values(), *long_words]
                if _one_edit_apart(name.lower(), option)
                # A one-word option's plural or singular may be the job's own.
                and (option in multi_word.values() or norm(name) != norm(option))
            ]
            prefixed = [
                option
                for option in multi_word.values()
                if len(name) >= 7 and option.startswith(name.lower())
            ]
            candidates = sorted(set(close) | (set(prefixed) if len(prefixed) == 1 else set()))
            match = candidates[0] if len(candidates) == 1 else None
        if match is not None and match != name:
            raise CLIError(
                f"submit: {arg!r} is not a submit option; did you mean {match}? (an "
                "argument meant for the job goes after '--': adaptdl submit SCRIPT -- ARGS)",
                code=2,
            )


def _take_dockerfile(args: argparse.Namespace, words: list[str]) -> list[str]:
    """Remove the original CLI's ``-d Dockerfile`` from the words after the script.

    Only a value whose file name contains "Dockerfile" is taken, as in the
    documentation's ``submit . -d tutorial/Dockerfile``: a job's own ``-d
    /data`` after the script still reaches the job.
    """
    kept: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        value: str | None = None
        if word in ("-d", "--dockerfile") and index + 1 < len(words):
            value, step = words[index + 1], 2
        elif word.startswith("--dockerfile="):
            value, step = word.partition("=")[2], 1
        if value is not None and "dockerfile" in os.path.basename(value).lower():
            args.dockerfile = value
            index += step
            continue
        kept.append(word)
        index += 1
    return kept


def _split_submit_args(args: argparse.Namespace) -> list[str]:
    """Find the script, separate submit options after it from the job's arguments.

    Everything after the first ``--`` that follows the script goes to the
    job unchanged, a second ``--`` included; everything between the script
    and that ``--`` must be a submit option. Without ``--``, submit options
    are recognised wherever they stand and the other arguments go to the
    job, as in the original CLI; so ``adaptdl submit main.py -f job.yaml``
    never silently passes ``-f`` to the script.

    The script and what follows it are one ``REMAINDER`` positional, because
    argparse would otherwise swallow a ``--`` right after the script and
    the job's own options would be taken for submit options.

    Returns:
        The job's arguments; ``args.target`` is set to the script or directory.
    """
    rest = list(args.command_line)
    if rest[:1] == ["--"]:  # "submit -- SCRIPT ...": argparse keeps that "--"
        rest = rest[1:]
    if not rest:
        raise CLIError("missing SCRIPT_OR_DIR: the script or project directory to submit", code=2)
    args.target, rest = rest[0], rest[1:]
    # No abbreviations: "--min" meant for the job must not become --min-replicas.
    extra = _RecordingParser(prog="adaptdl submit", add_help=False, allow_abbrev=False)
    _add_submit_options(extra, suppress=True)

    def usage_error(message: str) -> NoReturn:
        # One message and argparse's usage exit status, as for the same
        # option given before the script.
        raise CLIError(f"submit: {message}", code=2)

    extra.error = usage_error  # type: ignore[method-assign]
    head: list[str] = rest
    tail: list[str] | None = None
    if "--" in rest:
        index = rest.index("--")
        head, tail = rest[:index], rest[index + 1 :]
    if "--help" in head:
        # A submit option here too (the job's own --help goes after '--'):
        # it was passed to the script, which was submitted and run. The
        # short -h is left to the job: scripts use it for other things.
        from adaptdl.cli import build_parser

        build_parser().parse_args(["submit", "--help"])  # prints the help and exits 0
    head = _take_dockerfile(args, head)
    parsed, unknown = extra.parse_known_args(head)
    if tail is None:
        _refuse_misspelt_options(unknown, extra.long_options)
        tail, unknown = unknown, []
    if unknown:
        raise CLIError(
            f"unknown submit options {' '.join(unknown)}; job arguments go after '--'", code=2
        )
    for key, value in vars(parsed).items():
        if isinstance(value, list):  # repeatable options: both sides of the script count
            setattr(args, key, list(getattr(args, key)) + value)
        else:
            setattr(args, key, value)
    # A bare trailing "--" still replaces a job file's args (with none).
    args.job_args_given = "--" in rest
    return tail


def _cmd_submit(args: argparse.Namespace) -> int:
    job_args = _split_submit_args(args)
    for option, least in (("min_replicas", 0), ("max_replicas", 1), ("max_restarts", 0)):
        value = getattr(args, option)
        if value is not None and value < least:
            raise CLIError(f"--{option.replace('_', '-')}={value}: must be >= {least}", code=2)
        if value is not None and value > MAX_COUNT:
            raise CLIError(f"--{option.replace('_', '-')}={value}: must be <= {MAX_COUNT}", code=2)
    low, high = args.min_replicas, args.max_replicas
    if low is not None and high is not None and low > high:
        raise CLIError(f"--min-replicas={low} is greater than --max-replicas={high}", code=2)
    spec = _build_spec(args, job_args)
    if args.dockerfile is not None:
        print(
            f"adaptdl: warning: -d {args.dockerfile} ignored: the local cluster runs jobs in "
            "this machine's Python environment and builds no image",
            file=sys.stderr,
        )
    if args.tensorboard is not None:
        from adaptdl.cli._tensorboard import tensorboard_logdir

        logdir = tensorboard_logdir(_home(args), args.tensorboard, "--tensorboard")
        preset = spec.env.get("ADAPTDL_TENSORBOARD_LOGDIR")
        if preset is not None and preset != str(logdir):
            print(
                f"adaptdl: warning: --tensorboard {args.tensorboard} replaces the job file's "
                f"ADAPTDL_TENSORBOARD_LOGDIR={preset}",
                file=sys.stderr,
            )
        spec = _replace(spec, env={**spec.env, "ADAPTDL_TENSORBOARD_LOGDIR": str(logdir)})
    try:
        client = ClusterClient(_home(args))
    except DaemonNotAnsweringError as exc:
        raise CLIError(str(exc)) from None  # it holds the lock: no other can start
    except DaemonNotRunningError:
        # The daemon started here inherits this environment, and so its
        # replicas' PATH: a program they would not find is refused before
        # a daemon is started for it. A running daemon checks with its own.
        try:
            check_command(spec, os.environ)
        except BackendError as exc:
            raise CLIError(str(exc)) from None
        given = _given_daemon_options(args)
        client = _start(args)
        if client.started_here:
            print(f"started an adaptdl cluster at {_started(client, client.home)}")
        else:  # another command started one a moment ago: that one is used
            _warn_running(args, client, given)
        try:
            status = _submit_spec(client, spec, generated=args.name is None)
        except CLIError as exc:
            if not client.started_here:
                raise
            # Not stopped: another command may already be using it.
            raise CLIError(
                f"{exc} (the cluster started for it keeps running; 'adaptdl cluster stop "
                f"--home {client.home}' stops it)",
                exc.code,
            ) from None
    else:
        _warn_running(args, client)
        status = _submit_spec(client, spec, generated=args.name is None)
    print(f"job {status['name']} submitted")
    return 0


#: Fresh names tried when a generated one is taken (each of 65536 suffixes).
_NAME_TRIES = 16


def _submit_spec(client: ClusterClient, spec: JobSpec, *, generated: bool) -> dict[str, Any]:
    """Submit ``spec``; a generated name that is taken is replaced by another.

    Finished jobs keep their names until deleted, so after some hundreds of
    submissions of one script a random suffix meets a taken one; the user
    never chose it, so "pick another --name" would be the wrong answer.
    """
    tries = 1
    while True:
        try:
            return dict(client.submit(spec))
        except ClusterAPIError as exc:
            if not (generated and exc.status == HTTPStatus.CONFLICT and tries < _NAME_TRIES):
                raise CLIError(str(exc)) from None
        except DaemonNotRunningError as exc:
            raise CLIError(str(exc)) from None
        tries += 1
        stem = spec.name.rsplit("-", 1)[0]
        spec = dataclasses.replace(spec, name=_random_name(stem))


def _cmd_ls(args: argparse.Namespace) -> int:
    client = _client(args)
    jobs = _call(client.jobs)
    if not jobs:
        print("no jobs")
        return 0
    print(_table(job_rows(jobs, time.time())))
    return 0


def _fmt_time(value: float | None) -> str:
    if value is None:
        return "-"
    return datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S")


def _cmd_describe(args: argparse.Namespace) -> int:
    client = _client(args)
    job = _call(client.describe, args.job)
    spec = job["spec"]
    top = "unbounded" if spec["maxReplicas"] >= 2**31 - 1 else spec["maxReplicas"]
    lines = [
        f"Name:         {job['name']}",
        f"Status:       {job['phase']}" + (f" ({job['reason']})" if job["reason"] else ""),
        f"Command:      {shlex.join(spec['command'] + spec['args'])}",
        f"Directory:    {spec['workingDir']}",
        f"Replicas:     {job['replicas']} running, {len(job['allocation'])} allocated "
        f"(min {spec['minReplicas']}, max {top})",
        f"Restarts:     {job['restarts']} (failures {job['failures']} of maxRestarts "
        f"{spec['maxRestarts']})",
        f"Batch size:   {job['batchSize'] if job['batchSize'] is not None else '-'}",
        f"Goodput:      {job['goodput']:.2f}" if job["goodput"] is not None else "Goodput:      -",
        f"Submitted:    {_fmt_time(job['submitted'])}",
        f"Started:      {_fmt_time(job['started'])}",
        f"Completed:    {_fmt_time(job['completed'])}",
        f"Service:      {job['attainedService']:.1f} slot-seconds",
        f"Checkpoint:   {job['paths'].get('checkpoint', '-')}",
        f"Share:        {job['paths'].get('share', '-')}",
        f"Logs:         {job['paths'].get('logs', '-')}",
    ]
    if job.get("hints"):
        keys = ", ".join(sorted(job["hints"]))
        lines.append(f"Hints:        {keys}")
    if job.get("waiting"):
        lines.append(f"Waiting:      {job['waiting']}")
    if job["message"]:
        title = "Error" if job["phase"] == "Failed" else "Last failure"
        lines.append(f"{title}:")
        lines.extend(f"  {line}" for line in job["message"].splitlines())
    lines.append("Events:")
    for event in job["events"]:
        stamp = datetime.fromtimestamp(event["time"]).strftime("%H:%M:%S")
        lines.append(f"  {stamp}  {event['kind']:<13} {event['message']}")
    print("\n".join(lines))
    return 0


_LOG_BLOCK = 1 << 20  # bytes read at a time: a log of any size prints in flat memory


def _tail_offset(handle: BinaryIO, end: int, count: int) -> int:
    """Offset of the last ``count`` lines of the file's first ``end`` bytes, read backwards.

    Lines end with ``\n``; a last line without one counts as a line, as with
    ``tail -n``.
    """
    if count == 0:
        return end
    position = end
    if end > 0:
        handle.seek(end - 1)
        if handle.read(1) == b"\n":
            position = end - 1  # the final newline ends the last line, it starts none
    needed = count
    while position > 0:
        size = min(_LOG_BLOCK, position)
        handle.seek(position - size)
        block = handle.read(size)
        cut = len(block)
        while (cut := block.rfind(b"\n", 0, cut)) >= 0:
            needed -= 1
            if needed == 0:
                return position - size + cut + 1
        position -= size
    return 0


def _copy_log(
    handle: BinaryIO, start: int, stop: int | None, out: TextIO, decoder: codecs.IncrementalDecoder
) -> int:
    """Print bytes ``start`` to ``stop`` (or to the end) of a log in blocks; returns the end."""
    handle.seek(start)
    position = start
    while stop is None or position < stop:
        chunk = handle.read(_LOG_BLOCK if stop is None else min(_LOG_BLOCK, stop - position))
        if not chunk:
            break
        position += len(chunk)
        out.write(decoder.decode(chunk))
    out.flush()
    return position


def _cmd_logs(args: argparse.Namespace) -> int:
    if args.rank < 0:
        raise CLIError(f"--rank={args.rank}: must be >= 0", code=2)
    if args.tail is not None and args.tail < 0:
        raise CLIError(
            f"--tail={args.tail}: must be >= 0 (the number of last lines to print)", code=2
        )
    client = _client(args)
    job = _call(client.describe, args.job)
    path = Path(job["paths"]["logs"]) / f"replica-{args.rank}.log"
    if not path.exists() and not args.follow:
        if job["phase"] in _FINISHED:
            raise CLIError(
                f"job {args.job!r} ({job['phase']}) has no log for rank {args.rank}: no replica "
                "of that rank ever ran"
            )
        raise CLIError(f"job {args.job!r} has no log for rank {args.rank} (yet): {path}")
    out = sys.stdout
    position = 0
    # Incremental: a character split between two reads is not garbled.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if path.exists() and args.tail is not None:
        with open(path, "rb") as handle:
            end = os.fstat(handle.fileno()).st_size  # bytes appended later follow below
            start = _tail_offset(handle, end, args.tail)
            position = _copy_log(handle, start, end, out, decoder)
    gone_since: float | None = None  # when the daemon stopped answering
    # A job deleted and submitted again under its name between two polls is
    # another job with a log of its own: that ends the follow like a deletion.
    # The job is asked before each read, so none of the new log is printed.
    submitted = job.get("submitted")
    current: dict[str, Any] | None = job
    while True:
        if current is not None and current.get("submitted") != submitted:
            print(
                f"adaptdl: job {args.job!r} was deleted (a new job of that name runs now)",
                file=sys.stderr,
                flush=True,
            )
            return 0
        if path.exists():
            with open(path, "rb") as handle:
                position = _copy_log(handle, position, None, out, decoder)
        if not args.follow:
            return 0
        # The phase was read before the copy: a finished job's log is complete.
        if current is not None and current["phase"] in _FINISHED:
            if not path.exists():
                raise CLIError(f"job {args.job!r} finished without a log for rank {args.rank}")
            if path.stat().st_size == position:
                return 0
        time.sleep(0.5)
        try:
            if gone_since is not None:
                client = ClusterClient(_home(args))  # a restarted daemon may use a new port
            current = client.describe(args.job)
        except ClusterAPIError as exc:
            if exc.status != 404:
                raise CLIError(str(exc)) from None
            print(f"adaptdl: job {args.job!r} was deleted", file=sys.stderr, flush=True)
            return 0
        except DaemonNotRunningError as exc:
            # Replicas outlive a daemon restart: keep following the file.
            current = None
            now = time.monotonic()
            if gone_since is None:
                gone_since = now
                print(
                    f"adaptdl: the cluster daemon stopped answering; still following the log "
                    f"(for up to {FOLLOW_WITHOUT_DAEMON:g} s until it is back)",
                    file=sys.stderr,
                    flush=True,
                )
            elif now - gone_since > FOLLOW_WITHOUT_DAEMON:
                raise CLIError(f"{exc} (for {FOLLOW_WITHOUT_DAEMON:g} s)") from None
            continue
        if gone_since is not None:
            print("adaptdl: the cluster daemon is back", file=sys.stderr, flush=True)
            gone_since = None


_K8S_MOUNTS = {"/adaptdl/checkpoint": "checkpoint", "/adaptdl/share": "share"}
#: The folders of a job that ``cp`` copies from.
_CP_FOLDERS = ("share", "checkpoint", "logs")


def _cp_relative(raw: str) -> str:
    """The job-relative path ``cp`` copies, checked before any daemon is asked.

    Normalised as text first, so ``share/../run`` cannot reach the job's
    private folders; symlinks are checked against the folder after resolving.

    Raises:
        CLIError: the path names no allowed folder of the job.
    """
    rel = raw
    for mount, sub in _K8S_MOUNTS.items():
        if raw == mount or raw.startswith(mount + "/"):
            rel = sub + raw[len(mount) :]
    rel = posixpath.normpath(rel.lstrip("/")) if rel.strip("/") else ""
    if rel.split("/", 1)[0] not in _CP_FOLDERS:
        raise CLIError(
            f"path {raw!r}: expected share/..., checkpoint/... or logs/... "
            "(or /adaptdl/share/..., /adaptdl/checkpoint/...)",
            code=2,
        )
    return rel


def _copy_file(source: Path, target: Path) -> None:
    """Copy a file over ``target``; a link there is replaced, not written through."""
    if target.is_symlink():
        target.unlink()
    shutil.copy2(source, target)


def _copy_tree(source: Path, target: Path) -> None:
    """Copy a directory into ``target``, merging with what is there, as ``cp -r`` does.

    Links are copied as links: following them could copy a whole dataset, or
    files from outside the job, out of a share. A link or file already at a
    link's or file's place is replaced (``shutil.copytree`` failed on an
    existing link, so copying a folder twice did not work); a directory is
    never replaced by a file or link, nor a file or link by a directory.

    Raises:
        shutil.Error: some entries failed; the rest were copied.
    """
    failures: list[tuple[str, str, str]] = []
    if target.is_symlink():
        raise FileExistsError(errno.EEXIST, "a link is in the way of a directory", str(target))
    target.mkdir(exist_ok=True)
    for entry in sorted(source.iterdir()):
        there = target / entry.name
        try:
            if entry.is_symlink():
                if there.is_dir() and not there.is_symlink():
                    raise IsADirectoryError(errno.EISDIR, "a directory is in the way", str(there))
                if there.is_symlink() or there.exists():
                    there.unlink()
                there.symlink_to(os.readlink(entry))
            elif entry.is_dir():
                if there.is_symlink() or (there.exists() and not there.is_dir()):
                    raise NotADirectoryError(
                        errno.ENOTDIR, "a file or link is in the way of a directory", str(there)
                    )
                _copy_tree(entry, there)
            elif there.is_dir() and not there.is_symlink():
                raise IsADirectoryError(errno.EISDIR, "a directory is in the way", str(there))
            else:
                _copy_file(entry, there)
        except shutil.Error as exc:
            failures.extend(exc.args[0])
        except OSError as exc:
            failures.append((str(entry), str(there), _copy_error(exc)))
    try:
        shutil.copystat(source, target)
    except OSError as exc:
        failures.append((str(source), str(target), _copy_error(exc)))
    if failures:
        raise shutil.Error(failures)


def _copy_error(exc: OSError) -> str:
    """One line for a failed copy; ``shutil.Error`` carries a list of failures."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list):
        failures = exc.args[0]
        if failures and isinstance(failures[0], tuple) and len(failures[0]) == 3:
            first = failures[0][2]
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            return f"{first}{more}"
    if exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc.strerror or exc)


def _cmd_cp(args: argparse.Namespace) -> int:
    if ":" not in args.source:
        raise CLIError(
            f"source {args.source!r}: expected JOB:PATH, e.g. myjob:share/result.txt", code=2
        )
    name, raw = args.source.split(":", 1)
    try:
        _job_name(name)
    except argparse.ArgumentTypeError as exc:
        raise CLIError(f"source {args.source!r}: {exc}", code=2) from None
    if not args.dest.strip():
        raise CLIError(f"DEST {args.dest!r}: expected a file or directory path", code=2)
    rel = _cp_relative(raw)
    client = _client(args)
    job = _call(client.describe, name)
    root = Path(job["paths"]["share"]).parent.resolve()
    folder = (root / rel.split("/", 1)[0]).resolve()
    source = (root / rel).resolve()
    if folder not in source.parents and source != folder:
        raise CLIError(f"path {raw!r} leaves the job's {rel.split('/', 1)[0]} folder")
    if not source.exists():
        raise CLIError(f"job {name!r} has no {rel!r} ({source})")
    # "DIR/" names a directory, as for cp: a missing one is an error, not a
    # file of that name.
    as_dir = args.dest.endswith(("/", os.sep))
    dest = Path(args.dest).expanduser()
    if as_dir and not dest.is_dir():
        raise CLIError(f"DEST {args.dest!r}: no such directory")
    target = dest / source.name if dest.is_dir() else dest
    if not target.parent.is_dir():
        raise CLIError(f"destination directory {str(target.parent)!r} does not exist")
    try:
        if source.is_dir():
            if target.exists() and not target.is_dir():
                raise CLIError(f"DEST {str(target)!r} is a file; cannot copy a directory onto it")
            inside = target.resolve()
            if inside == source or source in inside.parents:
                raise CLIError(
                    f"DEST {str(target)!r} is inside {name}:{rel}; cannot copy a directory "
                    "into itself"
                )
            _copy_tree(source, target)
        else:
            if target.resolve() == source:
                raise CLIError(f"DEST {str(target)!r} is {name}:{rel} itself")
            _copy_file(source, target)
    except OSError as exc:
        raise CLIError(f"cannot copy {name}:{rel} to {str(dest)!r}: {_copy_error(exc)}") from None
    print(f"copied {name}:{rel} to {target}")
    if source.is_dir() and not any(source.iterdir()):
        note = (
            " (a job checkpoints only when it is stopped or rescaled)"
            if rel.split("/", 1)[0] == "checkpoint"
            else ""
        )
        print(f"adaptdl: note: {name}:{rel} is empty{note}", file=sys.stderr)
    return 0


def _cmd_delete(args: argparse.Namespace) -> int:
    client = _client(args)
    _call(client.delete, args.job)
    print(
        f"job {args.job} deleted: running replicas stop, then its checkpoint, logs and "
        "files are removed"
    )
    return 0


# ---------------------------------------------------------------------- register


def register(subparsers: Any) -> None:
    """Add the cluster commands to the ``adaptdl`` parser."""
    cluster = subparsers.add_parser("cluster", help="start, stop or inspect the local cluster")
    actions = cluster.add_subparsers(dest="cluster_command", metavar="ACTION")
    cluster.set_defaults(func=lambda args: (cluster.print_help(sys.stderr), 2)[1])

    start = actions.add_parser("start", help="start the cluster daemon in the background")
    _add_home(start)
    _add_daemon_options(start)
    # Not a submit option: after the script, a job's own --backend (gloo,
    # nccl) must reach the job.
    start.add_argument(
        "--backend",
        default=None,
        help="where replicas run (default local: process groups on this machine; a --plugin "
        "may register others)",
    )
    start.set_defaults(func=_cmd_cluster_start)

    stop = actions.add_parser("stop", help="checkpoint every job and stop the daemon")
    _add_home(stop)
    stop.add_argument(
        "--leave-jobs", action="store_true", help="stop only the daemon; jobs keep running"
    )
    stop.set_defaults(func=_cmd_cluster_stop)

    status = actions.add_parser("status", help="show the daemon and its slots")
    _add_home(status)
    status.set_defaults(func=_cmd_cluster_status)

    submit = subparsers.add_parser(
        "submit",
        help="submit a script or project directory as an elastic job",
        usage="%(prog)s [options] SCRIPT_OR_DIR [options] [-- ARGS ...]",
        description="Submit SCRIPT_OR_DIR: a Python script, a directory (its "
        "adaptdljob.yaml, else its main.py) or a job file (.yaml, as with -f). Everything "
        "after the first '--' that follows it goes to the job unchanged (a second '--' "
        "included) and replaces the args of a job file; submit options may stand before or "
        "after SCRIPT_OR_DIR, but not after that '--'. Without '--', other arguments after "
        "SCRIPT_OR_DIR go to the job, except near misses of submit options, which are "
        "refused.",
    )
    _add_submit_options(submit)
    _add_home(submit)
    submit.add_argument(
        "command_line",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT_OR_DIR [-- ARGS ...]",
        help="the script or project directory, then the job's arguments after '--'",
    )
    submit.set_defaults(func=_cmd_submit)

    ls = subparsers.add_parser("ls", help="list jobs", description=f"List jobs. {LS_HELP}")
    _add_home(ls)
    ls.set_defaults(func=_cmd_ls)

    describe = subparsers.add_parser("describe", help="show a job, its events and errors")
    _add_home(describe)
    describe.add_argument("job", type=_job_name)
    describe.set_defaults(func=_cmd_describe)

    logs = subparsers.add_parser("logs", help="print a replica's log")
    _add_home(logs)
    logs.add_argument("job", type=_job_name)
    logs.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    logs.add_argument("--rank", type=int, default=0, help="replica rank (default 0)")
    logs.add_argument("--tail", type=int, default=None, help="only the last N lines first")
    logs.set_defaults(func=_cmd_logs)

    cp = subparsers.add_parser(
        "cp",
        help="copy a file or directory out of a job's share, checkpoint or logs",
        description="Copy a file or directory out of a job. Like 'cp -r', an existing file "
        "at DEST is replaced and a directory is merged into an existing one; symlinks inside "
        "a copied directory are copied as links.",
    )
    _add_home(cp)
    cp.add_argument(
        "source",
        metavar="JOB:PATH",
        help="the job and a path under share/, checkpoint/ or logs/ (or /adaptdl/share/..., "
        "/adaptdl/checkpoint/... as inside a job)",
    )
    cp.add_argument(
        "dest", metavar="DEST", help="a file, or an existing directory to copy into ('DIR/')"
    )
    cp.set_defaults(func=_cmd_cp)

    delete = subparsers.add_parser("delete", help="delete a job")
    _add_home(delete)
    delete.add_argument("job", type=_job_name)
    delete.set_defaults(func=_cmd_delete)
