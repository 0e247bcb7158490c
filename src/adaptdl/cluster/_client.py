"""Talking to a local cluster daemon: find it, start it, call its API.

The daemon advertises itself in ``<home>/daemon.json`` (URL, pid, admin
token). :class:`ClusterClient` reads that file and speaks JSON over HTTP with
the standard library only, so the CLI starts fast and needs nothing extra.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from adaptdl import env
from adaptdl.cluster._reap import reap_in_background
from adaptdl.cluster._spec import JobSpec
from adaptdl.cluster._store import private_dir

__all__ = [
    "ClusterAPIError",
    "ClusterClient",
    "DaemonNotAnsweringError",
    "DaemonNotRunningError",
    "DaemonTimeoutError",
    "default_home",
    "start_daemon",
]

_LOG = logging.getLogger(__name__)


def default_home() -> Path:
    """The cluster home: ``ADAPTDL_HOME`` or ``~/.adaptdl``."""
    return Path(env.home()).resolve()


class DaemonNotRunningError(RuntimeError):
    """No daemon answers for a home directory."""


class DaemonNotAnsweringError(DaemonNotRunningError):
    """A daemon holds the home's lock but does not answer (stopped or hung)."""


class DaemonTimeoutError(DaemonNotRunningError):
    """The daemon took longer than the client's timeout to answer a request."""


#: Seconds a client waits for a daemon that holds its lock but does not
#: answer, in case it is in the last moments of stopping.
_SETTLE_SECONDS = 2.0

#: Seconds the client waits for a request that changes state (submit,
#: delete, shutdown).
CHANGE_TIMEOUT = 90.0


class ClusterAPIError(RuntimeError):
    """The daemon refused a request; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClusterClient:
    """Client of the daemon that manages ``home``.

    Raises:
        DaemonNotRunningError: no ``daemon.json``, or the daemon it names does
            not answer ``/healthz``.
    """

    def __init__(self, home: str | Path | None = None, *, timeout: float = 10.0) -> None:
        self.home = Path(home).expanduser().resolve() if home else default_home()
        self.timeout = timeout
        #: True when :func:`start_daemon` launched this daemon itself (not when
        #: it found one that another caller had started a moment earlier).
        self.started_here = False
        info_file = self.home / "daemon.json"
        try:
            info = json.loads(info_file.read_text())
            self.url: str = info["url"]
            self._token: str = info["token"]
            self.pid: int = int(info["pid"])
        except (OSError, ValueError, KeyError):
            raise DaemonNotRunningError(
                f"no adaptdl cluster daemon is running for {self.home} "
                "(start one with: adaptdl cluster start)"
            ) from None
        if not self.healthy() and not self._answers_soon(info_file):
            if not info_file.exists():
                raise DaemonNotRunningError(
                    f"no adaptdl cluster daemon is running for {self.home} (it has just "
                    "stopped; start one with: adaptdl cluster start)"
                )
            if _pid_alive(self.pid) and _lock_holder(self.home) == self.pid:
                # Starting another would only wait for its lock: say so.
                raise DaemonNotAnsweringError(
                    f"the adaptdl cluster daemon for {self.home} (pid {self.pid}) runs but "
                    f"does not answer at {self.url} (stopped or hung?); resume it "
                    f"(kill -CONT {self.pid}) or end it (kill {self.pid}), then try again"
                )
            raise DaemonNotRunningError(
                f"the adaptdl cluster daemon for {self.home} (pid {self.pid}, {self.url}) is "
                "not reachable; restart it with: adaptdl cluster start"
            )

    def _answers_soon(self, info_file: Path) -> bool:
        """Wait briefly while a daemon that does not answer may be stopping.

        A daemon that is stopping closes its HTTP service a moment before it
        removes ``daemon.json`` and exits; a call in between would otherwise
        report a stopped (SIGSTOPped) or hung daemon.

        Returns:
            Whether the daemon answered after all. False once it has gone
            (the callers then report it as not running), or after
            :data:`_SETTLE_SECONDS`.
        """
        if _lock_holder(self.home) != self.pid:
            return False  # a stale record: no daemon of it is stopping
        deadline = time.monotonic() + _SETTLE_SECONDS
        while time.monotonic() < deadline:
            if not info_file.exists() or not _pid_alive(self.pid):
                return False
            time.sleep(0.1)
            if self.healthy(timeout=max(deadline - time.monotonic(), 0.1)):
                return True
        return False

    def healthy(self, timeout: float = 2.0) -> bool:
        """Whether the daemon recorded in ``daemon.json`` answers ``/healthz``.

        An answer from another process (a daemon of another home that took
        over the port after this one died) does not count.

        Args:
            timeout: Seconds to wait for the answer.
        """
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=timeout) as response:
                if response.status != 200:
                    return False
                body = json.loads(response.read() or b"null")
        except (OSError, urllib.error.URLError, ValueError):
            return False
        pid = body.get("pid") if isinstance(body, dict) else None
        return pid is None or pid == self.pid

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """Call the API; returns the decoded JSON body.

        Raises:
            ClusterAPIError: the daemon answered with an error status.
            DaemonNotRunningError: the daemon went away.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"},
        )
        # A change may wait for the state database (up to its 30 s busy
        # timeout) or for a launch holding the backend: give it that long.
        timeout = self.timeout if method == "GET" else max(self.timeout, CHANGE_TIMEOUT)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                message = str(exc.reason)
            raise ClusterAPIError(exc.code, str(message)) from None
        except (OSError, urllib.error.URLError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError):
                # Not "stopped answering": a submit may still go through, and
                # a retry would then be refused as a duplicate.
                after = (
                    ""
                    if method == "GET"
                    else "; it may still carry it out: check with 'adaptdl ls' before retrying"
                )
                raise DaemonTimeoutError(
                    f"the adaptdl cluster daemon at {self.url} did not answer {method} {path} "
                    f"within {timeout:g}s{after}"
                ) from None
            raise DaemonNotRunningError(
                f"the adaptdl cluster daemon at {self.url} stopped answering: {exc}"
            ) from None

    def cluster(self) -> dict[str, Any]:
        """Cluster summary (slots, policy, interval, ...)."""
        result: dict[str, Any] = self.request("GET", "/api/cluster")
        return result

    def jobs(self) -> list[dict[str, Any]]:
        """Every job's status."""
        result: list[dict[str, Any]] = self.request("GET", "/api/jobs")
        return result

    def describe(self, name: str) -> dict[str, Any]:
        """One job's status, events and why it waits."""
        result: dict[str, Any] = self.request("GET", f"/api/jobs/{quote(name, safe='')}")
        return result

    def submit(self, spec: JobSpec) -> dict[str, Any]:
        """Submit a job; returns its status."""
        result: dict[str, Any] = self.request("POST", "/api/jobs", spec.to_json())
        return result

    def delete(self, name: str) -> None:
        """Delete a job (its replicas checkpoint and stop)."""
        self.request("DELETE", f"/api/jobs/{quote(name, safe='')}")

    def shutdown(self, *, stop_jobs: bool = True, wait: float = 60.0) -> bool:
        """Stop the daemon; with ``stop_jobs`` jobs checkpoint first.

        Returns:
            Whether the daemon exited within ``wait`` seconds (it may still be
            waiting for replicas to checkpoint).
        """
        self.request_shutdown(stop_jobs=stop_jobs)
        return self.wait_stopped(wait)

    def request_shutdown(self, *, stop_jobs: bool = True) -> bool:
        """Ask the daemon to stop, without waiting.

        Returns:
            Whether its jobs are stopped: a shutdown already under way keeps
            the mode its first request chose.
        """
        reply = self.request("POST", "/api/shutdown", {"stopJobs": stop_jobs})
        return bool(reply.get("stopJobs", stop_jobs)) if isinstance(reply, dict) else stop_jobs

    def wait_stopped(self, wait: float) -> bool:
        """Whether the daemon process exited within ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _pid_alive(self.pid):
            time.sleep(0.1)
        return not _pid_alive(self.pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def start_daemon(
    home: str | Path | None = None,
    *,
    slots: int | None = None,
    interval: float | None = None,
    policy: str | None = None,
    grace: float | None = None,
    host: str | None = None,
    port: int | None = None,
    plugins: Sequence[str] = (),
    plugin_dir: str | None = None,
    policy_options: Mapping[str, Any] | None = None,
    wait: float = 30.0,
    warm_start: bool = True,
    preload: Sequence[str] = (),
    backend: str | None = None,
) -> ClusterClient:
    """Start a daemon for ``home`` in the background (its own session).

    Returns a client once it answers. Its output goes to ``<home>/daemon.log``.
    When a daemon already holds ``<home>/daemon.lock`` (it runs, or another
    caller started it a moment ago), no second one is kept: the returned
    client talks to the daemon holding the lock, and its ``started_here`` is
    False (the options given here did not reach that daemon).

    ``backend`` names a registered backend (default ``local``); a plugin's
    backend is registered by one of ``plugins``.

    ``plugin_dir`` is where the daemon looks for ``plugins`` that are not
    installed (after the installed modules): it runs in ``home``, so a module
    beside the caller is found only through it.

    Raises:
        RuntimeError: the daemon exited or did not answer within ``wait``
            seconds; the message holds the end of its log.
    """
    root = private_dir(Path(home).expanduser().resolve() if home else default_home())
    argv = [sys.executable, "-m", "adaptdl.cli._daemon", "--home", str(root)]
    if slots is not None:
        argv += ["--slots", str(slots)]
    if interval is not None:
        argv += ["--interval", str(interval)]
    if policy is not None:
        argv += ["--policy", policy]
    if grace is not None:
        argv += ["--grace", str(grace)]
    if host is not None:
        argv += ["--host", host]
    if port is not None:
        argv += ["--port", str(port)]
    for plugin in plugins:
        argv += ["--plugin", plugin]
    if plugin_dir is not None:
        argv += ["--plugin-dir", plugin_dir]
    for key, value in (policy_options or {}).items():
        argv += ["--policy-option", f"{key}={json.dumps(value)}"]
    if not warm_start:
        argv.append("--no-warm-start")
    for module in preload:
        argv += ["--preload", module]
    if backend is not None:
        argv += ["--backend", backend]
    log_path = root / "daemon.log"
    deadline = time.monotonic() + wait
    while True:
        holder = _lock_holder(root)
        if holder and not _pid_alive(holder):
            holder = None  # it is exiting; the new daemon waits a moment for the lock
        if holder is not None:  # a daemon runs (or is starting) already: use it
            client = _attach(root, holder, deadline)
            if client is not None:
                return client
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"another adaptdl daemon (pid {holder or 'unknown'}) holds "
                    f"{root / 'daemon.lock'} but does not answer; stop it or try again"
                )
            time.sleep(0.1)  # it is exiting (it was stopping, or killed): then start one
            continue
        # daemon.json is not removed first: it may belong to a live daemon that
        # wins the lock race against the one started here; only a daemon.json
        # naming the new process (or the lock holder) is accepted.
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=str(root),
            )
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                client = _try_client(root)
                if client is not None and client.pid == proc.pid:
                    client.started_here = True
                    reap_in_background(proc)  # collected whenever it stops
                    return client
                time.sleep(0.1)
        except BaseException:
            # Interrupted (Ctrl-C) while waiting: the daemon, in its own session,
            # would run on unseen; it has no jobs yet, so it is simply stopped.
            proc.terminate()
            reap_in_background(proc)
            raise
        if proc.poll() != _EXIT_LOCKED or time.monotonic() >= deadline:
            break
        # Another start won the race (or probed the lock at that instant):
        # look for the winner again.
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
    if proc.poll() is None:
        proc.terminate()
        reap_in_background(proc)
    raise RuntimeError(f"the adaptdl cluster daemon did not start (log {log_path}):\n{tail}")


#: Exit status of a daemon that found ``daemon.lock`` held (see ``_daemon``).
_EXIT_LOCKED = 3


def _lock_holder(root: Path) -> int | None:
    """Pid of the daemon holding ``<root>/daemon.lock``, or None when it is free.

    A holder that has not written its pid yet counts as ``0`` (unknown).
    """
    path = root / "daemon.lock"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raw = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(raw) if raw.isascii() and raw.isdecimal() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _try_client(root: Path) -> ClusterClient | None:
    try:
        return ClusterClient(root)
    except DaemonNotRunningError:
        return None


def _attach(root: Path, holder: int, deadline: float) -> ClusterClient | None:
    """A client of the daemon holding the lock once it answers; None if it exits first.

    Also None when ``deadline`` passes first.
    """
    while True:
        client = _try_client(root)
        if client is not None and (client.pid == holder or not holder):
            return client
        current = _lock_holder(root)
        if current is None:
            return None  # the holder exited (or never wrote its pid and did)
        if current and current != holder:
            holder = current
        if holder and not _pid_alive(holder):
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
