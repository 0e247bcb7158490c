"""Warm-start launcher: replicas forked from a pre-warmed Python process.

A rescale restarts every replica, and a fresh interpreter spends seconds of
CPU importing ``torch`` (more with scikit-learn or torchvision) before it can
restore its checkpoint. The *zygote* is one long-lived helper process per
local backend that has imported those modules once; a replica is then a
``fork`` of it, so its own ``import torch`` finds the module already loaded.

The zygote is started by the daemon as ``python _zygote.py --preload
MODULES`` (by path, importing only the standard library before the preloads)
and speaks JSON lines over its stdin and stdout:

* zygote -> daemon ``{"ready": true, ...}`` once the preloads are imported;
* daemon -> zygote ``{"id": N, "argv": [...], "cwd": ..., "env": {...},
  "log": ..., "exit_file": ...}``, answered by ``{"id": N, "pid": PID}`` or
  ``{"id": N, "error": TEXT}`` (the daemon then uses the cold path);
* zygote -> daemon ``{"exit": PID, "code": CODE}`` when a replica has ended
  and its exit code is on disk.

Each launch forks twice, mirroring the cold path's ``_replica.py`` shim: the
first child (the *shim*, recorded pid) leads a new session, ignores
SIGTERM/SIGINT and waits for the second (the *replica*), which runs the
script as ``__main__``; the shim ends what the replica left in its session
and writes the replica's exit code to the exit file exactly as
``_replica.py`` does (with that file's functions). A daemon restarted after ``kill -9``
therefore re-adopts warm and cold replicas alike, and the zygote itself may
die without taking any replica with it (the shims are in their own sessions
and only the zygote's bookkeeping is lost). The zygote writes the exit file
for a shim that was itself killed by a signal, which the cold path can only
report through the daemon's ``Popen``.

Forking is only safe from a single-threaded process, so the zygote refuses
to fork (the daemon falls back to the cold path) when it has more than one
Python thread; it never runs torch operations, which would start thread
pools. Forked children inherit the parent's random state, so the replica
reseeds Python's ``random``, NumPy's global generator and, when this torch
build seeds its default generator nondeterministically at start-up (a fresh
process would get a new seed), torch's default generator.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.machinery
import importlib.util
import io
import json
import logging
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, ModuleType, TracebackType
from typing import IO, Any

__all__ = ["DEFAULT_PRELOAD", "Zygote", "ZygoteError", "parse_preload"]

_LOG = logging.getLogger(__name__)

#: Modules every zygote imports (a missing one is skipped, not fatal). Besides
#: the obvious ones: every ``torch.optim`` optimizer's constructor imports
#: ``torch._dynamo`` on first use (2.5-4 s of CPU, more than ``import torch``
#: itself), and ``adaptdl.torch.parallel`` is loaded lazily by
#: ``adaptdl.torch.AdaptiveDataParallel``; preloading them is what lets the
#: first step of a warm replica follow its imports within a fraction of a second.
DEFAULT_PRELOAD: tuple[str, ...] = (
    "numpy",
    "torch",
    "torch._dynamo",
    "adaptdl.torch",
    "adaptdl.torch.parallel",
)
#: The seed a torch build with a fixed default seed gives every fresh process.
_TORCH_FIXED_SEED = 67280421310721
#: Environment variables read when the interpreter starts or when the
#: preloaded libraries are loaded (dynamic linker, torch, OpenMP, MKL,
#: OpenBLAS); a replica whose value differs from the zygote's must start cold.
#: The exempt ones are applied again in the replica.
_STARTUP_PREFIXES = (
    "PYTHON",
    "LD_",
    "TORCH_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    # The locale decides the standard streams' encoding at start-up.
    "LC_",
    "LANG",
)
_STARTUP_EXEMPT = frozenset({"PYTHONUNBUFFERED", "OMP_NUM_THREADS"})
_SELF = str(Path(__file__).resolve())


def _load_shim() -> ModuleType:
    """The cold path's shim module, ``_replica.py``, loaded by path.

    The zygote imports no package before its preloads (a failed import of
    ``adaptdl`` must only skip a preload), and ``_replica.py`` needs only the
    standard library; its shims then end a replica's leftovers exactly as
    cold shims do.
    """
    path = Path(_SELF).with_name("_replica.py")
    spec = importlib.util.spec_from_file_location("_adaptdl_replica_shim", path)
    if spec is None or spec.loader is None:  # pragma: no cover - the file ships with us
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SHIM = _load_shim()


class ZygoteError(RuntimeError):
    """The zygote is not running, not ready, or could not launch a replica."""


def parse_preload(items: Sequence[str]) -> list[str]:
    """Flatten ``--preload A,B --preload C`` into module names.

    Raises:
        ValueError: a name is not a dotted Python identifier.
    """
    names: list[str] = []
    for item in items:
        for raw in item.split(","):
            name = raw.strip()
            if not name:
                continue
            if not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"--preload {item!r}: {name!r} is not a module name")
            if name not in names:
                names.append(name)
    return names


def startup_env_differs(env: Mapping[str, str], base: Mapping[str, str]) -> list[str]:
    """Start-up variables (``PYTHON*``, ``LD_*``, ``TORCH_*``...) whose values differ.

    A forked replica cannot honour, say, a different ``PYTHONPATH``,
    ``PYTHONHASHSEED`` or ``LD_PRELOAD``: those were applied when the zygote
    started or loaded torch.
    """
    keys = {key for key in (*env, *base) if key.startswith(_STARTUP_PREFIXES)}
    return sorted(key for key in keys - _STARTUP_EXEMPT if env.get(key) != base.get(key))


# ---------------------------------------------------------------------- daemon side


class Zygote:
    """The daemon's handle on one zygote process.

    :meth:`start` returns at once; the preloads are imported in the
    background and :attr:`ready` turns true when they are done, so a daemon
    starts as fast as before and launches cold until then.

    Args:
        python: Interpreter to run (the one replicas would use).
        preload: Modules to import before serving.
        env: Environment of the zygote (that of the replicas without the
            per-replica ``ADAPTDL_*`` variables).
        log_path: File that receives the zygote's own stderr.
    """

    def __init__(
        self, python: str, preload: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> None:
        self.python = python
        self.preload = list(preload)
        self.env = dict(env)
        self.log_path = log_path
        self.info: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._cond = threading.Condition()
        self._ready = False
        self._dead = False
        self._stopping = False
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._pending: set[int] = set()
        self._exits: dict[int, int] = {}
        #: Launch requests given up on: a late reply's replica is killed.
        self._abandoned: set[int] = set()
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The zygote's process id (None before :meth:`start`)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def ready(self) -> bool:
        """Whether the zygote has imported its preloads and is serving."""
        with self._cond:
            return self._ready and not self._dead

    @property
    def dead(self) -> bool:
        """Whether the zygote process has gone (or never started)."""
        with self._cond:
            return self._dead

    def start(self) -> None:
        """Start the process; raises :class:`ZygoteError` if it cannot be spawned."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            try:
                self._proc = subprocess.Popen(
                    [
                        self.python,
                        _SELF,
                        "--preload",
                        ",".join(self.preload),
                        # Only a label: a forked replica keeps the zygote's
                        # command line (and /proc environ), so this is how
                        # ps, pgrep -f and clean-up scripts find its cluster.
                        "--cluster",
                        str(self.log_path.parent),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=self.env,
                    cwd=str(self.log_path.parent),
                    start_new_session=True,  # a Ctrl-C at the daemon's terminal spares it
                )
            except OSError as exc:
                with self._cond:
                    self._dead = True
                raise ZygoteError(f"cannot start the zygote with {self.python!r}: {exc}") from exc
        self._reader = threading.Thread(
            target=self._read, name="adaptdl-zygote-reader", daemon=True
        )
        self._reader.start()

    def wait_ready(self, timeout: float) -> bool:
        """Block until the zygote is ready or dead; returns :attr:`ready`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._ready and not self._dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._ready and not self._dead

    def launch(
        self,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        log: Path,
        exit_file: Path,
        grace: float = 30.0,
        timeout: float = 10.0,
    ) -> int:
        """Fork a replica running ``python argv...``; returns the shim's pid.

        ``grace`` is how long processes the replica leaves behind get between
        SIGTERM and SIGKILL from its shim (see ``_replica.py``).

        Raises:
            ZygoteError: the zygote is not ready, died, refused (its reason is
                the message) or did not answer within ``timeout`` seconds.
        """
        with self._cond:
            if not self._ready or self._dead:
                raise ZygoteError("the zygote is not ready")
            self._next_id += 1
            ident = self._next_id
        request = {
            "id": ident,
            "argv": list(argv),
            "cwd": cwd,
            "env": dict(env),
            "log": str(log),
            "exit_file": str(exit_file),
            "grace": float(grace),
        }
        self._send(request)
        deadline = time.monotonic() + timeout
        with self._cond:
            while ident not in self._replies and not self._dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            reply = self._replies.pop(ident, None)
            if reply is None:
                if not self._dead:
                    # A zygote that does not answer is broken: end it. It may
                    # have forked the replica already and its reply may still
                    # be in the pipe; the reader kills that untracked replica.
                    self._abandoned.add(ident)
                    self._kill_locked()
                raise ZygoteError("the zygote died or did not answer a launch request")
            if "error" in reply:
                raise ZygoteError(str(reply["error"]))
            return int(reply["pid"])

    def pending(self, pid: int) -> bool:
        """Whether ``pid`` is a live zygote's replica whose exit is not yet reported.

        Between a shim's death and the zygote's report the pid is a zombie or
        gone while its exit file may still be unwritten (the zygote writes it
        for killed shims); this closes that window for the backend.
        """
        with self._cond:
            return pid in self._pending and not self._dead

    def exit_code(self, pid: int) -> int | None:
        """The exit code the zygote reported for ``pid``, if any."""
        with self._cond:
            return self._exits.get(pid)

    def stop(self, timeout: float = 5.0) -> None:
        """End the zygote (its replicas keep running in their own sessions)."""
        proc = self._proc
        with self._cond:
            self._stopping = True
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the zygote leaves its loop
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join(timeout)  # it marks the zygote dead at EOF

    def kill(self) -> None:
        """SIGKILL the zygote (tests use this to exercise the fallback)."""
        with self._cond:
            self._kill_locked()

    def _kill_locked(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.kill()

    def _send(self, message: Mapping[str, Any]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise ZygoteError("the zygote is not running")
        data = (json.dumps(message) + "\n").encode()
        try:
            with self._send_lock:
                proc.stdin.write(data)
                proc.stdin.flush()
        except (OSError, ValueError) as exc:  # ValueError: closed pipe object
            with self._cond:
                self._dead = True
                self._cond.notify_all()
            raise ZygoteError(f"the zygote is gone: {exc}") from exc

    def _read(self) -> None:
        """Reader thread: replies, readiness and exit reports; EOF = death."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None  # noqa: S101 - set by start()
        for raw in proc.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                _LOG.warning("zygote sent a malformed line: %r", raw[:200])
                continue
            with self._cond:
                if message.get("ready"):
                    self._ready = True
                    self.info = message
                    _LOG.info(
                        "zygote %s ready: preloaded %s%s",
                        proc.pid,
                        ", ".join(message.get("modules", [])) or "nothing",
                        f" (skipped {message['failed']})" if message.get("failed") else "",
                    )
                elif "exit" in message:
                    pid = int(message["exit"])
                    self._exits[pid] = int(message["code"])
                    self._pending.discard(pid)
                elif "id" in message and int(message["id"]) in self._abandoned:
                    self._abandoned.discard(int(message["id"]))
                    if "pid" in message:
                        _kill_abandoned(int(message["pid"]))
                elif "id" in message:
                    if "pid" in message:
                        # Before any exit report for it can be read (same stream).
                        self._pending.add(int(message["pid"]))
                    self._replies[int(message["id"])] = message
                self._cond.notify_all()
        proc.stdout.close()
        code = proc.wait()
        with self._cond:
            stopping = self._stopping
        if not stopping:  # logged before waiters learn of the death
            _LOG.warning(
                "zygote %s exited with code %s; replicas launch cold until it is restarted "
                "(its log: %s)",
                proc.pid,
                code,
                self.log_path,
            )
        with self._cond:
            self._dead = True
            self._cond.notify_all()


def _kill_abandoned(pid: int) -> None:
    """SIGKILL the replica of a launch that timed out (its shim leads a session)."""
    _LOG.warning("killing replica %s: its launch request had timed out", pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# ---------------------------------------------------------------------- zygote side


class _Task:
    """What the forked replica runs once it has left the zygote's loop."""

    def __init__(self, argv: list[str], env: dict[str, str], reseed_torch: bool) -> None:
        self.argv = argv
        self.env = env
        self.reseed_torch = reseed_torch


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Do nothing: SIGCHLD needs a handler for the wakeup fd to fire."""
    del signum, frame


class _Server:
    """The zygote's loop: read requests, fork, reap, report."""

    def __init__(self, proto_in: int, proto_out: int, reseed_torch: bool) -> None:
        self.proto_in = proto_in
        self.proto_out = proto_out
        self.reseed_torch = reseed_torch
        self.launched: dict[int, str] = {}  # shim pid -> exit file
        self.buffer = b""
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def send(self, message: Mapping[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self.proto_out, data) :]

    def serve(self) -> _Task | None:
        """Serve until EOF; returns a task only in a forked replica."""
        signal.signal(signal.SIGCHLD, _ignore)  # a handler so the wakeup fd fires
        signal.set_wakeup_fd(self.wake_w)
        while True:
            readable, _, _ = select.select([self.proto_in, self.wake_r], [], [], 5.0)
            if self.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_r, 512):
                        pass
            try:
                self.reap()
            except BrokenPipeError:
                return None  # the daemon is gone
            if self.proto_in not in readable:
                continue
            chunk = os.read(self.proto_in, 65536)
            if not chunk:
                return None
            self.buffer += chunk
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                try:
                    request = json.loads(line)
                except ValueError:
                    continue  # not from our daemon; nothing to answer
                if not isinstance(request, dict):
                    continue
                try:
                    task = self.handle(request)
                except BrokenPipeError:
                    return None
                if task is not None:
                    return task

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            exit_file = self.launched.pop(pid, None)
            if exit_file is None:
                continue  # a shim that failed during set-up; already answered
            code = os.waitstatus_to_exitcode(status)
            if code < 0 and not os.path.exists(exit_file):
                # The shim itself was killed (kill -9 of the group): record
                # the signal, as the daemon's Popen would on the cold path,
                # and that the shim did not end its session.
                with contextlib.suppress(OSError):
                    open(_SHIM.killed_marker(exit_file), "w").close()  # noqa: SIM115
                with contextlib.suppress(OSError):
                    _SHIM.write_exit(exit_file, code)
            self.send({"exit": pid, "code": code})

    def handle(self, request: dict[str, Any]) -> _Task | None:
        ident = request.get("id")
        try:
            argv = [str(item) for item in request["argv"]]
            cwd, log, exit_file = str(request["cwd"]), str(request["log"]), request["exit_file"]
            env = {str(key): str(value) for key, value in request["env"].items()}
            grace = float(request.get("grace", _SHIM.DEFAULT_GRACE))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            self.send({"id": ident, "error": f"malformed request: {exc!r}"})
            return None
        if not os.path.isdir(cwd):
            self.send({"id": ident, "error": f"working directory {cwd!r} does not exist"})
            return None
        script = argv[0] if argv else ""
        if not os.path.isfile(os.path.join(cwd, script)):
            self.send({"id": ident, "error": f"script {script!r} not found in {cwd!r}"})
            return None
        threads = threading.active_count()
        if threads != 1:
            self.send({"id": ident, "error": f"zygote has {threads} threads; unsafe to fork"})
            return None
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the shim
            os.close(ready_r)
            os.close(go_w)
            try:
                return self._become_shim(argv, cwd, env, log, str(exit_file), grace, ready_w, go_r)
            except BaseException:  # noqa: BLE001 - report any set-up failure and leave
                with contextlib.suppress(BaseException):
                    os.write(ready_w, traceback.format_exc().encode()[-2000:])
                os._exit(127)
        os.close(ready_w)
        os.close(go_r)
        answer = _read_all(ready_r)
        os.close(ready_r)
        if answer == b"ok":
            self.launched[pid] = str(exit_file)
            # The reply first: should this zygote be killed right after the
            # go, the daemon still learns the pid (and kills it if it had
            # given up on this launch).
            self.send({"id": ident, "pid": pid})
            with contextlib.suppress(OSError):
                os.write(go_w, _GO)
        else:
            self.send({"id": ident, "error": answer.decode(errors="replace") or "shim died"})
        os.close(go_w)
        return None

    def _become_shim(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        log: str,
        exit_file: str,
        grace: float,
        ready: int,
        go: int,
    ) -> _Task | None:
        """In the first child: set up the session, then run and wait for the replica.

        The replica starts only once the zygote has answered the daemon
        (``go``). A shim whose set-up outlasts the daemon's patience finds
        the zygote killed (end of file on ``go``) and leaves without running
        it: the daemon has started that rank cold instead.
        """
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _SHIM.watch_stop_signals()
        for fd in (self.proto_in, self.proto_out, self.wake_r, self.wake_w):
            os.close(fd)
        log_fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        os.write(ready, b"ok")
        os.close(ready)
        if _read_all(go) != _GO:
            os._exit(0)  # given up on: no pid file, no exit file, no replica
        os.close(go)
        _SHIM.record_pid(exit_file)
        child = os.fork()
        if child == 0:  # the replica
            return _Task(argv, env, self.reseed_torch)
        _SHIM.record_child(exit_file, child)
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
        code = os.waitstatus_to_exitcode(status)
        _SHIM.end_session(grace)  # what the replica left behind, as the cold shim does
        _SHIM.write_exit(exit_file, code)
        os._exit(128 - code if code < 0 else code)


#: What the zygote sends a shim once the daemon has its pid: run the replica.
_GO = b"g"


def _read_all(fd: int) -> bytes:
    """Everything until end of file on ``fd``."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        except OSError:
            return data
        if not chunk:
            return data
        data += chunk


def _reopen_stdio(env: Mapping[str, str]) -> None:
    """Fresh ``sys.std*`` objects on fds 0-2, as a new interpreter would make."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"

    def text(fd: int, errors: str, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        stream: IO[bytes] = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            stream,
            encoding=encoding,
            errors=errors,
            line_buffering=line_buffering,
            write_through=unbuffered,
        )

    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = text(1, "strict", os.isatty(1))
    sys.stderr = text(2, "backslashreplace", True)
    # sys.__std*__ keep the zygote's objects: they wrap the same fds 0-2 and
    # never close them (closefd=False), so they stay usable.


def _reseed(task: _Task) -> None:
    """Give this replica random state of its own (fork copied the zygote's)."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        if task.reseed_torch:
            torch.seed()
        threads = task.env.get("OMP_NUM_THREADS", "")
        if threads.isascii() and threads.isdecimal() and int(threads) > 0:
            # OpenMP read the zygote's environment when torch was loaded.
            torch.set_num_threads(int(threads))


def _adopt_start_state() -> None:
    """Redo what the interpreter and the preloads derived from the zygote's start.

    The zygote imported modules in its own working directory and
    environment; a replica has the job's. ``TZ`` is read once by the C
    library, ``tempfile`` caches ``TMPDIR``, and ``multiprocessing``
    remembers the directory it was imported in (a spawned child resolves
    relative paths against it).
    """
    if hasattr(time, "tzset"):
        time.tzset()
    if "tempfile" in sys.modules:
        import tempfile

        tempfile.tempdir = None  # documented: recomputed from TMPDIR on next use
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        setattr(process, "ORIGINAL_DIR", os.getcwd())  # noqa: B010 - untyped module global


def _run_main(script: str, path: str) -> None:
    """Run ``script`` (absolute: ``path``) as ``__main__``, as ``python script.py`` would.

    That gives an absolute ``__file__`` (since Python 3.9) but leaves
    ``sys.argv[0]`` as typed; :func:`runpy.run_path` sets both to the path
    it is given, so a source file is compiled and run here instead. What
    is not source (a directory, a zip archive, a ``.pyc`` file) still goes
    through runpy, which runs those as the interpreter does.
    """
    if not os.path.isfile(path) or zipfile.is_zipfile(path):
        runpy.run_path(script, run_name="__main__")
        return
    with io.open_code(path) as handle:
        source = handle.read()
    if path.endswith(".pyc") or source[:4] == importlib.util.MAGIC_NUMBER:
        runpy.run_path(script, run_name="__main__")
        return
    code = compile(source, path, "exec", dont_inherit=True)
    main = ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    namespace = vars(main)
    namespace["__cached__"] = None
    namespace["__builtins__"] = builtins
    sys.modules["__main__"] = main
    exec(code, namespace)  # noqa: S102 - running the job's script is the point


def _run(task: _Task) -> int:
    """Run the replica's script as ``__main__`` like ``python script.py`` would."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _reopen_stdio(task.env)
    _reseed(task)
    script = task.argv[0]
    sys.argv = list(task.argv)
    sys.orig_argv = [sys.executable, *task.argv]
    # What ``python script.py`` puts first (the zygote removed its own
    # entry): the script's directory, symbolic links resolved.
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    # Before the script runs: it may change directory.
    path = os.path.abspath(script)
    _adopt_start_state()
    try:
        _run_main(script, path)
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter's own handling: exit status, or death by SIGINT
    except BaseException as exc:  # noqa: BLE001 - printed like an uncaught exception
        tb: TracebackType | None = exc.__traceback__
        # Drop the launcher's frames so the traceback starts in the script
        # (named by its absolute path, or as typed when runpy ran it).
        while tb is not None and tb.tb_frame.f_code.co_filename not in (path, script):
            tb = tb.tb_next
        if tb is not None:
            exc = exc.with_traceback(tb)
        elif isinstance(exc, SyntaxError):
            exc = exc.with_traceback(None)  # as Python shows it: file, line, caret
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1
    return 0


def _preload(names: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    loaded: list[str] = []
    failed: dict[str, str] = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure only skips it
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"adaptdl zygote: cannot preload {name}: {exc}", file=sys.stderr, flush=True)
        else:
            loaded.append(name)
    return loaded, failed


def main(argv: Sequence[str]) -> int:
    """Zygote entry point: preload, report ready, serve until stdin closes."""
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(_SELF):
        del sys.path[0]  # run by path: this package directory is not for imports
    preload: list[str] = []
    args = list(argv)
    while args:
        item = args.pop(0)
        if item == "--preload" and args:
            preload.extend(parse_preload([args.pop(0)]))
        elif item == "--cluster" and args:
            args.pop(0)  # a label for ps (see Zygote.start)
        else:
            print(
                f"usage: _zygote.py [--preload MODULE[,MODULE]] [--cluster HOME]; got {item!r}",
                file=sys.stderr,
            )
            return 2
    # The protocol gets private descriptors; stray prints of imported modules
    # (and of the zygote) go to its log instead of corrupting it.
    proto_in, proto_out = os.dup(0), os.dup(1)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.close(null_fd)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loaded, failed = _preload(preload)
    torch = sys.modules.get("torch")
    reseed_torch = torch is not None and torch.initial_seed() != _TORCH_FIXED_SEED
    server = _Server(proto_in, proto_out, reseed_torch)
    server.send(
        {
            "ready": True,
            "pid": os.getpid(),
            "modules": loaded,
            "failed": failed,
            "python_threads": threading.active_count(),
            "native_threads": _native_threads(),
        }
    )
    task = server.serve()
    if task is None:
        return 0
    return _run(task)


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
