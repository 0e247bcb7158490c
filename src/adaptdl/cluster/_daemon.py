"""The local cluster daemon: store, backend, supervisor and controller in one process.

Started in the background by ``adaptdl cluster start`` (or by ``adaptdl
submit`` when none runs) as ``python -m adaptdl.cli._daemon --home DIR``;
that entry point, not this module, sets up logging.
It holds an exclusive lock on ``<home>/daemon.lock`` so two daemons never
manage the same jobs, writes ``<home>/daemon.json`` (URL, pid and the admin
token, mode 0600) for the CLI, and keeps the supervisor on the same port
across restarts when it can, so replicas that survive a daemon restart still
reach it. Once it serves, it records the options it was given (those that
differ from the defaults) in ``<home>/daemon-settings.json``; the CLI reuses
them when it starts the next daemon of that home, so a cluster keeps its slots,
policy and the like across ``cluster stop`` and an automatic start by
``submit``. A supervisor that cannot listen on ``--host``/``--port`` ends the
daemon with a one-line error naming the option.

With the local backend the daemon also keeps a warm-start *zygote*: a helper
that has imported torch (``--preload`` adds modules) and forks the replicas
of ``python SCRIPT`` jobs, so a rescale does not pay for interpreter start-up
and imports again (``--no-warm-start`` turns it off). It is stopped with the
daemon; replicas it forked keep running and are re-adopted like the others.

Stopping: ``POST /api/shutdown`` (``adaptdl cluster stop``) checkpoints and
stops every job, which resumes on the next start; SIGTERM or SIGINT stop only
the daemon and leave replicas running, to be re-adopted; ``kill -9`` does the
same, less tidily.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import functools
import json
import logging
import math
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from adaptdl._plugins import PluginImportError, import_plugins
from adaptdl.cluster._backend import BackendError, get_backend
from adaptdl.cluster._controller import Controller
from adaptdl.cluster._store import private_dir
from adaptdl.cluster._supervisor import DEFAULT_MAX_CONNECTIONS, Supervisor
from adaptdl.cluster._zygote import parse_preload
from adaptdl.sched import DEFAULT_POLICY, MAX_COUNT

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_INTERVAL",
    "EXIT_LOCKED",
    "DEFAULT_POLICY",
    "ListenError",
    "SETTINGS_FILE",
    "DaemonConfig",
    "check_listen_address",
    "daemon_settings",
    "load_daemon_settings",
    "parse_config",
    "parse_policy_options",
    "run_daemon",
    "stop_services",
]

_LOG = logging.getLogger(__name__)

#: Seconds between full scheduling rounds (the original scheduler used 60).
DEFAULT_INTERVAL = 30.0
#: Where the supervisor listens unless ``--host`` says otherwise: this machine only.
DEFAULT_HOST = "127.0.0.1"
#: Exit status of a daemon that found another one holding ``daemon.lock``.
EXIT_LOCKED = 3
#: The options the last daemon of a home ran with, in that home.
SETTINGS_FILE = "daemon-settings.json"
#: Options recorded there, with the JSON types they must have.
_SETTINGS: dict[str, tuple[type, ...]] = {
    "slots": (int,),
    "interval": (int, float),
    "policy": (str,),
    "grace": (int, float),
    "host": (str,),
    "port": (int,),
    "plugin": (list,),
    "plugin_dir": (str,),
    "policy_option": (list,),
    "warm_start": (bool,),
    "preload": (list,),
    "backend": (str,),
}


class DaemonConfig(argparse.Namespace):
    """Parsed daemon options (see :func:`build_parser`)."""

    home: str
    slots: int | None
    interval: float
    tick: float
    policy: str
    host: str
    port: int
    grace: float
    backend: str
    plugin: list[str]
    plugin_dir: str | None
    policy_option: list[str]
    warm_start: bool
    preload: list[str]


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a slot count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if not 1 <= value <= MAX_COUNT:  # the scheduler's limit on a node's resources
        raise argparse.ArgumentTypeError(f"{value}: expected an integer from 1 to 2**31 - 1")
    return value


def _seconds(text: str, *, zero: bool) -> float:
    """A finite number of seconds, > 0 (or >= 0 with ``zero``); NaN and inf are refused.

    A NaN interval would compare false with every clock reading, so the
    scheduler would never run a round.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        expected = ">= 0" if zero else "> 0"
        raise argparse.ArgumentTypeError(f"{text}: expected a finite number of seconds {expected}")
    return value


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value}: expected a TCP port between 0 and 65535")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Options of the daemon process (``python -m adaptdl.cli._daemon``).

    Values are checked here, so a daemon started by hand (or through
    :func:`~adaptdl.cluster.start_daemon`) with a bad one ends with a usage
    error naming it, before it takes the lock or starts anything.
    """
    positive = functools.partial(_seconds, zero=False)
    non_negative = functools.partial(_seconds, zero=True)
    parser = argparse.ArgumentParser(prog="adaptdl-daemon", description=__doc__)
    parser.add_argument("--home", required=True, help="cluster home directory")
    parser.add_argument("--slots", type=_positive_int, default=None, help="replica slots")
    parser.add_argument("--interval", type=positive, default=DEFAULT_INTERVAL)
    parser.add_argument("--tick", type=positive, default=0.25)
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=_port, default=0, help="0: reuse the last port, else any")
    parser.add_argument("--grace", type=non_negative, default=30.0, help="checkpoint grace seconds")
    parser.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of the policy (VALUE parsed as JSON when it can be)",
    )
    parser.add_argument(
        "--no-warm-start",
        dest="warm_start",
        action="store_false",
        help="start every replica as a fresh interpreter (local backend; default: fork "
        "replicas of 'python SCRIPT' jobs from a process that has imported torch already)",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE[,MODULE]",
        help="modules the warm-start process imports besides numpy, torch, adaptdl.torch "
        "(and the modules they load lazily)",
    )
    parser.add_argument(
        "--backend", default="local", help="where replicas run: a registered backend name"
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        help="module to import first (it may register policies or backends)",
    )
    parser.add_argument(
        "--plugin-dir",
        default=None,
        metavar="DIR",
        help="directory searched for --plugin modules after the installed ones (the daemon "
        "runs in its home; 'adaptdl cluster start' passes the directory it was run in)",
    )
    return parser


def parse_policy_options(items: Sequence[str]) -> dict[str, Any]:
    """Turn ``KEY=VALUE`` strings into keyword arguments (JSON values when valid).

    Raises:
        ValueError: an item has no ``=`` or an empty key.
    """
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"policy option {item!r}: expected KEY=VALUE")
        try:
            options[key.strip()] = json.loads(raw)
        except ValueError:
            options[key.strip()] = raw
    return options


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a left-over file keeps its old mode through O_CREAT
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)


def daemon_settings(config: DaemonConfig) -> dict[str, Any]:
    """The options of ``config`` that differ from the defaults, by attribute name."""
    parser = build_parser()
    return {
        key: getattr(config, key)
        for key in _SETTINGS
        if getattr(config, key) != parser.get_default(key)
    }


def load_daemon_settings(home: str | Path) -> dict[str, Any]:
    """The options the last daemon of ``home`` was given (see :data:`SETTINGS_FILE`).

    Keys are option names as attributes (``slots``, ``policy_option``, ...).

    Returns:
        An empty dict when no daemon recorded any.

    Raises:
        ValueError: the file cannot be read or is malformed; the message
            names it.
    """
    path = Path(home) / SETTINGS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the saved daemon settings: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of daemon settings, got {data!r}")
    for key, value in data.items():
        types = _SETTINGS.get(key)
        if types is None:
            raise ValueError(f"{path}: unknown daemon setting {key!r}")
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise ValueError(f"{path}: daemon setting {key}={value!r} has the wrong type")
        if isinstance(value, list) and not all(isinstance(item, str) for item in value):
            raise ValueError(f"{path}: daemon setting {key}={value!r}: expected strings")
    return data


class ListenError(ValueError):
    """The supervisor cannot listen on ``--host``/``--port``; one line naming the option."""


def _listen_error(
    host: str, port: int, exc: OSError, saved: Collection[str] = (), settings: str = ""
) -> str:
    """A one-line message for a supervisor that cannot listen, naming the option.

    Args:
        host: The ``--host`` value.
        port: The ``--port`` value (0: any free port).
        exc: What binding (or resolving ``host``) raised.
        saved: Which of ``"host"`` and ``"port"`` came from the saved settings
            of the last daemon rather than from the user.
        settings: The file those saved settings are in.
    """
    reason = exc.strerror or str(exc)
    bad_host = isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
    option = "port" if port and not bad_host else "host"
    if option in saved:
        fix = "--port 0 for any free port" if option == "port" else f"--host {DEFAULT_HOST}"
        hint = (
            f" (the {option} was reused from the last cluster's settings in {settings}: "
            f"pass {fix}, or --defaults to start from the defaults)"
        )
    elif bad_host:
        hint = " (give an IPv4 address or name of this machine, e.g. 127.0.0.1 or 0.0.0.0)"
    elif exc.errno == errno.EADDRINUSE:
        hint = " (another program listens there: pick a free port, or leave --port out)"
    else:
        hint = ""
    if option == "port":
        return f"--port {port}: cannot listen on {host}:{port}: {reason}" + hint
    return f"--host {host!r}: cannot listen on it: {reason}" + hint


def _resolve(
    host: str, port: int, saved: Collection[str] = (), settings: str = ""
) -> tuple[Any, ...]:
    """The IPv4 socket address of ``host:port``, as the supervisor binds it.

    Resolving first turns every bad ``--host`` into one error: binding with
    an unencodable name raises ``TypeError`` rather than ``OSError``.

    Raises:
        ListenError: ``host`` is not a name or address of this machine.
    """
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ListenError(_listen_error(host, port, exc, saved, settings)) from None
    except UnicodeError as exc:  # an IDNA label that cannot be encoded
        raise ListenError(f"--host {host!r}: not a valid host name ({exc})") from None
    return tuple(infos[0][4])


def check_listen_address(
    host: str, port: int, *, saved: Collection[str] = (), settings: str = ""
) -> None:
    """Check that the supervisor could listen on ``host:port`` (0: any port).

    The daemon binds the same way a moment later, so a typo in ``--host`` or
    a busy ``--port`` is reported before a daemon is started.

    Args:
        host: The interface (``""`` would mean every one: callers reject it).
        port: The port; 0 for any free one.
        saved: Which of ``"host"`` and ``"port"`` came from the saved settings
            of the last daemon; the message then says so and how to override.
        settings: The file those saved settings are in.

    Raises:
        ListenError: it cannot; the message names ``--host`` or ``--port``.
    """
    address = _resolve(host, port, saved, settings)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            sock.bind(address)
        except OSError as exc:
            raise ListenError(_listen_error(host, port, exc, saved, settings)) from None


def _make_supervisor(
    config: DaemonConfig, home: Path, backend: Any, token: str, **kwargs: Any
) -> Supervisor:
    """Bind the supervisor, preferring the port a previous daemon used.

    Raises:
        ListenError: it cannot bind or resolve ``--host``/``--port``; other
            errors (reading or writing ``supervisor.port``) pass through.
    """
    _resolve(config.host, config.port)
    port_file = home / "supervisor.port"
    candidates = [config.port] if config.port else []
    if not config.port and port_file.exists():
        with contextlib.suppress(ValueError):
            candidates.append(int(port_file.read_text().strip()))
    candidates.append(0)
    error: OSError | None = None
    for port in candidates:
        try:
            supervisor = Supervisor(
                backend, admin_token=token, host=config.host, port=port, **kwargs
            )
        except OSError as exc:
            error = exc
            if config.port:
                break
            continue
        try:
            port_file.write_text(str(supervisor.server.server_address[1]))
        except BaseException:
            supervisor.close()
            raise
        return supervisor
    raise ListenError(
        _listen_error(config.host, config.port, error or OSError("cannot bind the supervisor"))
    )


def _lock(fd: int, patience: float) -> bool:
    """Take the exclusive lock, retrying briefly.

    Clients probe the lock with a momentary shared lock to find a running
    daemon; a start that coincides with a probe must not give up.
    """
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def run_daemon(config: DaemonConfig) -> int:
    """Run until shut down; returns the process exit status."""
    from adaptdl.sched import get_policy

    home = Path(config.home).expanduser().resolve()
    private_dir(home)
    # Not opened with O_TRUNC: a daemon that loses the race must not erase the
    # winner's pid, which start_daemon reads to find the daemon that runs.
    lock_fd = os.open(home / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    if not _lock(lock_fd, patience=0.5):
        os.close(lock_fd)
        print(f"another adaptdl daemon already manages {home}", file=sys.stderr)
        return EXIT_LOCKED
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, str(os.getpid()).encode(), 0)
    try:
        if not config.host.strip():
            raise ValueError(f"--host {config.host!r}: expected an interface address or name")
        import_plugins(config.plugin, config.plugin_dir)
        policy = get_policy(config.policy, **parse_policy_options(config.policy_option))
        preload = parse_preload(config.preload)
    except (PluginImportError, TypeError, ValueError) as exc:
        os.close(lock_fd)  # a corrected start may follow at once
        print(str(exc), file=sys.stderr)
        return 2
    extra: dict[str, Any] = {}
    if config.backend == "local":  # warm start is a feature of the local backend only
        extra = {"warm_start": config.warm_start, "preload": preload}
    try:
        backend = get_backend(
            config.backend, home=home, slots=config.slots, grace_period=config.grace, **extra
        )
    except (BackendError, TypeError, ValueError) as exc:
        os.close(lock_fd)
        print(f"--backend {config.backend}: cannot start: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    stop_jobs = {"value": False}
    services: list[Supervisor] = []  # the supervisor, once it exists
    shutdown_lock = threading.Lock()

    def request_shutdown(with_jobs: bool) -> bool:
        """Begin the shutdown; the first request decides whether jobs stop.

        A later one cannot change it (jobs may be checkpointing already, or
        left running); it learns the mode in effect from the return value.
        """
        with shutdown_lock:
            if not stop.is_set():
                stop_jobs["value"] = with_jobs
            for service in services:
                service.begin_shutdown()  # a signal, too, refuses new jobs
            stop.set()
            return stop_jobs["value"]

    controller = Controller(
        backend, policy, interval=config.interval, tick=config.tick, policy_name=config.policy
    )
    token = secrets.token_urlsafe(32)
    started = time.time()
    try:
        resource = backend.slot_resource()
        slots = sum(node.resources.get(resource, 0) for node in backend.nodes().values())
        supervisor = _make_supervisor(
            config,
            home,
            backend,
            token,
            # Each replica may hold a discovery long poll while its group starts.
            max_connections=DEFAULT_MAX_CONNECTIONS + 2 * slots,
            on_change=controller.wake,
            on_shutdown=request_shutdown,
            info=lambda: {
                "pid": os.getpid(),
                "home": str(home),
                "policy": config.policy,
                "policyOptions": parse_policy_options(config.policy_option),
                "interval": config.interval,
                "grace": config.grace,
                "started": started,
                "rounds": controller.rounds,
                "policyError": _policy_error(controller),
            },
        )
    except BaseException as exc:
        if isinstance(exc, ListenError):
            print(str(exc), file=sys.stderr)
        try:
            backend.shutdown(stop_jobs=False)  # the zygote, if one started
        finally:
            backend.close()
            os.close(lock_fd)
        if isinstance(exc, ListenError):
            return 2
        raise
    services.append(supervisor)
    backend.supervisor_url = supervisor.url
    supervisor.start()
    _write_json(home / SETTINGS_FILE, daemon_settings(config))
    _write_json(
        home / "daemon.json",
        {
            "pid": os.getpid(),
            "url": supervisor.url,
            "token": token,
            "home": str(home),
            "policy": config.policy,
            "interval": config.interval,
            "started": started,
        },
    )

    def on_signal(signum: int, frame: Any) -> None:
        del frame
        _LOG.info("received %s: stopping the daemon, leaving jobs running", signum)
        request_shutdown(False)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _LOG.info(
        "adaptdl daemon serving %s (home %s, policy %s, %s)",
        supervisor.url,
        home,
        config.policy,
        {k: v.resources for k, v in backend.nodes().items()},
    )
    worker = threading.Thread(target=controller.run, args=(stop,), name="adaptdl-controller")
    worker.start()
    code = 0
    while not stop.is_set():
        stop.wait(0.5)
        if not worker.is_alive() and not stop.is_set():
            # A daemon that answers but no longer schedules is worse than none:
            # stop, leaving the jobs running for the next daemon to adopt.
            _LOG.error(
                "the controller thread ended unexpectedly; stopping the daemon and leaving "
                "jobs running (start it again to resume scheduling)"
            )
            request_shutdown(False)
            code = 1
    worker.join()
    try:
        stop_services(backend, supervisor, stop_jobs=stop_jobs["value"])
    finally:
        with contextlib.suppress(FileNotFoundError):
            (home / "daemon.json").unlink()
    _LOG.info("adaptdl daemon stopped")
    return code


def _policy_error(controller: Controller) -> dict[str, Any] | None:
    """The policy's latest failure, for ``cluster status``, or None."""
    failure = controller.last_policy_error
    return None if failure is None else {"time": failure[0], "message": failure[1]}


def stop_services(backend: Any, supervisor: Supervisor, *, stop_jobs: bool) -> None:
    """Stop the backend (draining jobs), then the HTTP service, then the store.

    The supervisor keeps serving while jobs checkpoint (replicas may upload
    hints on the way out) and is closed before the backend's store, so no
    request thread meets a closed database.
    """
    try:
        backend.shutdown(stop_jobs=stop_jobs)
    finally:
        try:
            supervisor.close()
        finally:
            backend.close()


def parse_config(argv: Sequence[str] | None = None) -> DaemonConfig:
    """The daemon's options from its command line (``sys.argv`` if None)."""
    return build_parser().parse_args(argv, namespace=DaemonConfig())
