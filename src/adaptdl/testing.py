"""A multi-process harness that runs a function as an elastic AdaptDL job.

Elastic behaviour (restarts with a different number of replicas, checkpoints
that survive a restart, collectives between real processes) cannot be tested
inside one process, so every multi-process test in this project goes through
:func:`run_elastic`. It plays the part of the cluster: each *generation* starts
``n`` real processes with the ``ADAPTDL_*`` environment a launcher would give
them, waits for all of them, and decides from the outcome whether to start
another generation and with how many replicas.

Two ways to request a restart mirror the two ways a real job restarts:

* rank 0 *returns* an ``int > 0`` (the original test-suite convention: the
  return value is the next replica count), or
* every rank *exits* with :data:`CHECKPOINT_EXIT_CODE` (143, what a replica does
  after it checkpointed on a scheduler signal); the next count is then taken
  from the ``replicas`` schedule.

Everything else (an exception, another exit code, a hang) raises
:class:`ReplicaError` after all remaining processes were killed, so a broken
test fails fast instead of leaving orphans behind.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from adaptdl import _procstate

__all__ = [
    "CHECKPOINT_EXIT_CODE",
    "MAX_REPLICAS",
    "ElasticResult",
    "Generation",
    "ReplicaError",
    "elastic_multiprocessing",
    "free_port",
    "run_elastic",
]

logger = logging.getLogger(__name__)

CHECKPOINT_EXIT_CODE = 143
"""Exit code of a replica that checkpointed and stopped so the job can be rescaled."""

# A replica killed by SIGTERM (the shell reports that as 143 as well) counts as
# a checkpoint-and-exit, because that is what the default SIGTERM action means
# for a replica that never installed a handler.
_CHECKPOINT_EXIT_CODES = frozenset({CHECKPOINT_EXIT_CODE, -signal.SIGTERM})

# Seconds a replica that reported a failure gets to exit with its own code.
_REPORT_EXIT_WAIT = 10.0
# Seconds to wait for a killed process to be reaped before giving up on it.
_REAP_TIMEOUT = 5.0
# Seconds between a replica's checks that the harness still runs.
_ORPHAN_POLL = 0.5
# The longest single wait; select() and poll() refuse larger timeouts.
_MAX_WAIT = 3600.0
#: Most replicas one generation may run: each is a real process on this machine.
MAX_REPLICAS = 256
# Variables the harness sets per generation: ``env`` may not override them.
_HARNESS_OWNED = {
    "ADAPTDL_CHECKPOINT_PATH": "pass checkpoint_dir instead",
    "ADAPTDL_MASTER_PORT": "the harness picks a fresh port per generation",
    "ADAPTDL_REPLICA_RANK": "each replica gets its own rank",
    "ADAPTDL_NUM_REPLICAS": "pass replicas instead",
    "ADAPTDL_NUM_RESTARTS": "it counts the generations",
}


class ReplicaError(RuntimeError):
    """A replica failed, the run timed out, or the restart schedule ran out.

    Attributes:
        generation: the 0-based generation that failed.
        rank: the first failing rank, or None when no single rank is to blame
            (a timeout of several ranks, an exhausted schedule).
        exit_code: that rank's exit code, or None.
        traceback: the traceback text of the exception the rank raised, or
            None when it did not raise one.
    """

    def __init__(
        self,
        message: str,
        *,
        generation: int,
        rank: int | None = None,
        exit_code: int | None = None,
        traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.generation = generation
        self.rank = rank
        self.exit_code = exit_code
        self.traceback = traceback

    def __reduce__(self) -> tuple[Any, ...]:
        # The keyword-only arguments would be lost by the default pickling,
        # so the error could not cross a process pool.
        return (
            _rebuild_replica_error,
            (str(self), self.generation, self.rank, self.exit_code, self.traceback),
        )


def _rebuild_replica_error(
    message: str,
    generation: int,
    rank: int | None,
    exit_code: int | None,
    traceback: str | None,
) -> ReplicaError:
    return ReplicaError(
        message, generation=generation, rank=rank, exit_code=exit_code, traceback=traceback
    )


@dataclass(frozen=True)
class Generation:
    """The outcome of one generation of replicas.

    Attributes:
        num_replicas: how many replicas the generation ran.
        results: the return value of each rank (None for a rank that exited
            with :data:`CHECKPOINT_EXIT_CODE` instead of returning).
        exit_codes: the exit code of each rank; negative values are signals,
            as in :attr:`multiprocessing.Process.exitcode`.
    """

    num_replicas: int
    results: list[Any]
    exit_codes: list[int]


@dataclass(frozen=True)
class ElasticResult:
    """Everything :func:`run_elastic` observed, for assertions in tests.

    Attributes:
        generations: one entry per generation, in order.
        checkpoint_dir: the ``ADAPTDL_CHECKPOINT_PATH`` every generation shared.
        share_dir: the ``ADAPTDL_SHARE_PATH`` every generation shared.
    """

    generations: list[Generation] = field(default_factory=list)
    checkpoint_dir: str = ""
    share_dir: str = ""

    @property
    def final(self) -> Generation:
        """The last generation, whose rank-0 result ended the run."""
        if not self.generations:
            raise ValueError("the run has no generations")
        return self.generations[-1]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    The port is only reserved while this function runs; the harness picks a
    fresh one per generation so a lingering socket of an earlier generation
    (TIME_WAIT) can never collide with the next one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# Temporary directories created by the harness, removed when the creating
# process exits (children end with os._exit and never run atexit handlers, and
# the pid check keeps a forked child from deleting them anyway).
_TEMP_DIRS: list[str] = []
_CREATOR_PID = os.getpid()


def _remove_temp_dirs() -> None:
    if os.getpid() != _CREATOR_PID:
        return
    for path in _TEMP_DIRS:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_temp_dirs)


def _make_temp_dir(prefix: str) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    _TEMP_DIRS.append(path)
    return path


def _report(conn: multiprocessing.connection.Connection, message: tuple[str, Any]) -> None:
    """Send ``message`` by value with the standard pickle.

    ``Connection.send`` would pass a tensor as a shared-memory handle, which
    is gone once the replica has exited: the harness then read nothing.
    """
    conn.send_bytes(pickle.dumps(message))


def _die_with_harness(parent: int | None) -> None:
    """Kill this replica and its process group once its parent is gone.

    A harness killed by SIGTERM or SIGKILL (a cancelled CI job) runs no
    cleanup, and its replicas, each in a process group of its own, would run on
    as orphans. Polling the parent pid works for every start method: a
    forkserver parent (``parent`` None: whoever started this process) exits
    with the harness too.
    """
    if parent is None:
        parent = os.getppid()
    while True:
        time.sleep(_ORPHAN_POLL)
        if os.getppid() != parent:
            if os.getpgrp() == os.getpid():
                with contextlib.suppress(OSError):
                    os.killpg(os.getpid(), signal.SIGKILL)
            os._exit(1)


def _child_main(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    conn: multiprocessing.connection.Connection,
    harness: int | None,
    forked: bool,
) -> None:
    """Body of one replica process: set up the environment, run ``func``, report.

    The replica becomes the leader of its own process group so the harness can
    kill it together with anything it started (data-loader workers, servers).
    It starts like a fresh process: without the test process's ``ADAPTDL_*``
    variables or, when ``forked``, the AdaptDL state it would inherit. It
    kills itself once ``harness``, its parent's pid (None: whichever process
    started it), is gone.
    A ``SystemExit`` is re-raised: its code is the replica's exit code (143 for
    checkpoint-and-exit); ``sys.exit()`` or ``sys.exit(0)`` counts as returning
    None, any other code is a failure reported with its traceback.
    """
    threading.Thread(
        target=_die_with_harness, args=(harness,), name="adaptdl-harness-watch", daemon=True
    ).start()
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    for key in [k for k in os.environ if k.startswith("ADAPTDL_")]:
        del os.environ[key]
    os.environ.update(env)
    if forked:
        # A spawned replica is fresh: resetting it would only drop the states
        # that importing the user's module (to unpickle func) just created.
        _procstate.forget_inherited_state()
    try:
        value = func(*args)
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            # sys.exit() is how scripts end; it counts as returning None.
            _report(conn, ("ok", None))
        elif exc.code != CHECKPOINT_EXIT_CODE:
            # sys.exit("message") prints only to stderr; keep it in the error.
            _report(conn, ("error", traceback.format_exc()))
        conn.close()
        raise
    except BaseException:
        _report(conn, ("error", traceback.format_exc()))
        conn.close()
        raise SystemExit(1) from None
    try:
        _report(conn, ("ok", value))
    except Exception:
        _report(
            conn,
            (
                "error",
                "the return value could not be sent to the harness (it must be "
                "picklable):\n" + traceback.format_exc(),
            ),
        )
        conn.close()
        raise SystemExit(1) from None
    conn.close()


@dataclass
class _Replica:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    message: tuple[str, Any] | None = None
    exit_code: int | None = None
    eof: bool = False

    def drain(self) -> None:
        """Read the replica's report if one is waiting, without blocking."""
        if self.message is not None:
            return
        try:
            if not self.eof and self.conn.poll():
                self.message = pickle.loads(self.conn.recv_bytes())  # noqa: S301 - our child
        except (EOFError, OSError):
            self.eof = True

    @property
    def traceback(self) -> str | None:
        if self.message is not None and self.message[0] == "error":
            return str(self.message[1])
        return None

    @property
    def failed(self) -> bool:
        """True once the replica is known to have failed (not just finished)."""
        if self.traceback is not None:
            return True
        if self.exit_code is None:
            return False
        # Exit code 0 without a report (os._exit(0)) counts as returning None.
        return self.exit_code != 0 and self.exit_code not in _CHECKPOINT_EXIT_CODES


def _kill(replicas: Sequence[_Replica]) -> None:
    """Kill every replica and its process group, then reap them."""
    for replica in replicas:
        pid = replica.process.pid
        if pid is None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            os.killpg(pid, signal.SIGKILL)
        if replica.process.exitcode is None:
            with contextlib.suppress(Exception):
                replica.process.kill()
    for replica in replicas:
        replica.process.join(_REAP_TIMEOUT)
        if replica.exit_code is None:
            replica.exit_code = replica.process.exitcode
        replica.drain()
        replica.conn.close()


def _describe_failure(replica: _Replica, generation: int, num_replicas: int) -> str:
    text = (
        f"replica rank {replica.rank} of {num_replicas} in generation {generation} "
        f"failed with exit code {replica.exit_code}"
    )
    if replica.traceback is not None:
        text += f":\n{replica.traceback}"
    return text


def _run_generation(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    base_env: dict[str, str],
    generation: int,
    num_replicas: int,
    ctx: multiprocessing.context.BaseContext,
    deadline: float,
    timeout: float,
    timeout_hint: str = "",
) -> Generation:
    port = free_port()
    method = ctx.get_start_method()
    # A forkserver, not this process, is a forkserver replica's parent.
    harness = None if method == "forkserver" else os.getpid()
    replicas: list[_Replica] = []
    try:
        for rank in range(num_replicas):
            if time.monotonic() > deadline:
                # Starting many replicas takes long too: the limit holds here.
                _kill(replicas)
                raise ReplicaError(
                    f"run_elastic timed out after {timeout} s in generation {generation} "
                    f"while starting its replicas ({rank} of {num_replicas} started, and "
                    "killed)" + timeout_hint,
                    generation=generation,
                )
            env = dict(base_env)
            env.update(
                ADAPTDL_MASTER_PORT=str(port),
                ADAPTDL_REPLICA_RANK=str(rank),
                ADAPTDL_NUM_REPLICAS=str(num_replicas),
                ADAPTDL_NUM_RESTARTS=str(generation),
            )
            recv_conn, send_conn = ctx.Pipe(duplex=False)
            process = ctx.Process(  # type: ignore[attr-defined]
                target=_child_main,
                args=(func, args, env, send_conn, harness, method == "fork"),
                name=f"adaptdl-replica-g{generation}-r{rank}",
                daemon=False,
            )
            try:
                process.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                send_conn.close()
                recv_conn.close()
                raise TypeError(
                    f"args must be picklable with start_method={method!r}, or use "
                    f"start_method='fork': {type(exc).__name__}: {exc}"
                ) from exc
            with contextlib.suppress(OSError):
                os.setpgid(process.pid, process.pid)
            send_conn.close()
            replicas.append(_Replica(rank, process, recv_conn))
        logger.debug("generation %d started %d replicas on port %d", generation, num_replicas, port)

        running = {id(r): r for r in replicas}
        while running:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stuck = sorted(r.rank for r in running.values())
                _kill(replicas)
                raise ReplicaError(
                    f"run_elastic timed out after {timeout} s in generation {generation}; "
                    f"ranks {stuck} of {num_replicas} were still running and were killed"
                    + timeout_hint,
                    generation=generation,
                    rank=stuck[0] if len(stuck) == 1 else None,
                )
            waitables: list[Any] = []
            owner: dict[Any, _Replica] = {}
            for replica in running.values():
                waitables.append(replica.process.sentinel)
                owner[replica.process.sentinel] = replica
                if replica.message is None and not replica.eof:
                    waitables.append(replica.conn)
                    owner[replica.conn] = replica
            for ready in multiprocessing.connection.wait(
                waitables, timeout=min(remaining, _MAX_WAIT)
            ):
                replica = owner[ready]
                if ready is replica.conn:
                    # On EOF without a report drain() marks the pipe closed and
                    # the exit code, seen through the sentinel, tells why.
                    replica.drain()
                else:
                    replica.process.join()
                    replica.exit_code = replica.process.exitcode
                    replica.drain()
                    running.pop(id(replica), None)
                if replica.failed:
                    if replica.exit_code is None:
                        # Its report came first: let it exit on its own, so
                        # its exit code is its own and not our SIGKILL's.
                        grace = min(_REPORT_EXIT_WAIT, deadline - time.monotonic())
                        replica.process.join(max(grace, 0.0))
                        replica.exit_code = replica.process.exitcode
                    _kill(replicas)
                    raise ReplicaError(
                        _describe_failure(replica, generation, num_replicas),
                        generation=generation,
                        rank=replica.rank,
                        exit_code=replica.exit_code,
                        traceback=replica.traceback,
                    )
    except BaseException:
        _kill(replicas)
        raise
    # Everyone exited; still sweep the process groups for stray grandchildren.
    _kill(replicas)
    return Generation(
        num_replicas=num_replicas,
        results=[r.message[1] if r.message is not None else None for r in replicas],
        exit_codes=[r.exit_code if r.exit_code is not None else -1 for r in replicas],
    )


def _check_count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REPLICAS:
        raise ValueError(
            f"{what} must be an int from 1 to {MAX_REPLICAS} (replicas are processes on "
            f"this machine), got {value!r}"
        )
    return value


def _check_env(env: object) -> dict[str, str]:
    """``env`` as a dict, refused unless every item could be an environment variable."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise TypeError(f"env must be a mapping of str to str, got {type(env).__name__}: {env!r}")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"env must map str to str, got {key!r}: {value!r}")
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"env key {key!r}: not a variable name (empty, '=' or a NUL byte)")
        if "\0" in value:
            raise ValueError(f"env[{key!r}]={value!r}: a value cannot hold a NUL byte")
        if key in _HARNESS_OWNED:
            raise ValueError(
                f"env may not set {key} (got {value!r}): the harness sets it for every "
                f"generation; {_HARNESS_OWNED[key]}"
            )
    return dict(env)


def run_elastic(
    func: Callable[..., Any],
    replicas: int | Sequence[int],
    *,
    args: tuple[Any, ...] = (),
    env: Mapping[str, str] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    timeout: float = 120.0,
    start_method: str = "fork",
) -> ElasticResult:
    """Run ``func(*args)`` as an elastic job of real processes, generation by generation.

    Generation ``g`` starts its replicas with ``ADAPTDL_CHECKPOINT_PATH``,
    ``ADAPTDL_SHARE_PATH``, ``ADAPTDL_JOB_ID``, ``ADAPTDL_JOB_TOKEN`` (shared by
    all generations), ``ADAPTDL_MASTER_ADDR=127.0.0.1``, a fresh
    ``ADAPTDL_MASTER_PORT``, ``ADAPTDL_REPLICA_RANK``, ``ADAPTDL_NUM_REPLICAS``,
    ``ADAPTDL_NUM_NODES=1`` and ``ADAPTDL_NUM_RESTARTS=g``, then ``env``. No
    other ``ADAPTDL_*`` variable of this process reaches them. A forked
    replica forgets AdaptDL's own process-wide state (its checkpoint states,
    epochs, loaders, metrics, collectives), so it starts like a fresh process;
    a user's checkpoint states stay registered, and one the replica creates
    again under the same name replaces the inherited copy.

    After a generation:

    * every rank returned: rank 0's value decides; an ``int > 0`` starts the
      next generation with that many replicas, anything else (None, 0, any
      other object) ends the run;
    * every rank exited with :data:`CHECKPOINT_EXIT_CODE`: the next generation
      runs ``replicas[g + 1]`` replicas;
    * anything else raises :class:`ReplicaError`.

    Args:
        func: the replica body. With ``start_method="fork"`` any callable
            works; other start methods need a picklable, module-level function.
        replicas: the replica count of generation 0, or the schedule of counts
            per generation (``[1, 2, 3]``: generation 0 runs 1 replica,
            generation 1 runs 2, generation 2 runs 3). Return-value restarts
            override the schedule for the generation they start.
        args: positional arguments for ``func`` (picklable unless forking).
        env: extra environment variables, applied over the job-wide ones
            (``ADAPTDL_JOB_ID``, ``ADAPTDL_JOB_TOKEN``, ...); the variables
            the harness sets per generation (checkpoint path, port, rank,
            replica count, restarts) are refused.
        checkpoint_dir: the shared checkpoint directory; a temporary directory
            (removed when this process exits normally; a process killed by a
            signal such as SIGTERM leaves it, as it leaves the share
            directory) when None.
        timeout: wall-clock seconds for the whole run, all generations
            together (``math.inf`` for no limit); on expiry every replica is
            killed. Replicas also kill themselves and their process groups
            when this process dies.
        start_method: the :mod:`multiprocessing` start method. ``fork`` (the
            default) needs this process to have no ``torch.distributed``
            default group, which a forked replica could neither use nor
            replace. A forked replica ends with ``os._exit`` (it must not run
            this process's exit handlers), so ``atexit`` handlers registered
            in the replica do not run either; with ``spawn`` they do.

    Returns:
        The generations and the shared directories.

    Raises:
        TypeError: ``func`` is not callable, ``args`` is not a tuple,
            ``env`` does not map str to str, or ``func`` and ``args`` cannot
            be pickled for a start method other than ``fork``.
        ValueError: an argument is invalid.
        RuntimeError: ``fork`` was asked for while ``torch.distributed`` is
            initialized in this process.
        ReplicaError: a replica raised or exited abnormally, the run timed
            out, the restart schedule was exhausted, or a generation ended with
            a replica count from rank 0 below 0 or above :data:`MAX_REPLICAS`.
    """
    if not callable(func):
        raise TypeError(f"func must be callable, got {func!r}")
    if isinstance(replicas, int) and not isinstance(replicas, bool):
        schedule = [_check_count(replicas, "replicas")]
    elif isinstance(replicas, Sequence) and not isinstance(replicas, str | bytes):
        if len(replicas) == 0:
            raise ValueError("replicas must be a positive int or a non-empty sequence, got []")
        schedule = [_check_count(n, f"replicas[{i}]") for i, n in enumerate(replicas)]
    else:
        raise ValueError(f"replicas must be a positive int or a sequence of them, got {replicas!r}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}: {args!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    methods = multiprocessing.get_all_start_methods()
    if start_method not in methods:
        raise ValueError(f"start_method must be one of {methods}, got {start_method!r}")
    ctx = multiprocessing.get_context(start_method)
    extra_env = _check_env(env)
    if checkpoint_dir is not None:
        if not isinstance(checkpoint_dir, str | os.PathLike):
            raise TypeError(
                f"checkpoint_dir must be a path (str or os.PathLike), got "
                f"{type(checkpoint_dir).__name__}: {checkpoint_dir!r}"
            )
        if "\0" in os.fsdecode(os.fspath(checkpoint_dir)):
            raise ValueError(f"checkpoint_dir={checkpoint_dir!r}: a path cannot hold a NUL byte")
    if start_method == "fork":
        _check_forkable()
    else:
        # func alone: args may hold a Queue or a Lock, which only pickles
        # while a process is being started.
        try:
            multiprocessing.reduction.ForkingPickler.dumps(func)
        except Exception as exc:
            raise TypeError(
                f"func must be picklable with start_method={start_method!r} (a "
                f"module-level function, not a lambda or a nested one), or use "
                f"start_method='fork': {type(exc).__name__}: {exc}"
            ) from exc

    ckpt = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt is None:
        ckpt = _make_temp_dir("adaptdl-ckpt-")
    else:
        if os.path.exists(ckpt) and not os.path.isdir(ckpt):
            raise ValueError(f"checkpoint_dir must be a directory, got the file {ckpt!r}")
        try:
            os.makedirs(ckpt, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"checkpoint_dir {ckpt!r} cannot be created: {exc}") from exc
    share = _make_temp_dir("adaptdl-share-")
    base_env = {
        "ADAPTDL_CHECKPOINT_PATH": ckpt,
        "ADAPTDL_SHARE_PATH": share,
        "ADAPTDL_JOB_ID": f"test/{uuid.uuid4().hex}",
        "ADAPTDL_JOB_TOKEN": secrets.token_hex(16),
        "ADAPTDL_MASTER_ADDR": "127.0.0.1",
        "ADAPTDL_NUM_NODES": "1",
    }
    base_env.update(extra_env)

    deadline = time.monotonic() + float(timeout)
    generations: list[Generation] = []
    num_replicas = schedule[0]
    returned = 0  # restarts rank 0 asked for by returning an int
    while True:
        g = len(generations)
        hint = ""
        if returned >= 10:
            hint = (
                f" (rank 0 asked for {returned} restarts by returning an int > 0, which "
                "starts another generation with that many replicas; return None to stop)"
            )
        outcome = _run_generation(
            func, args, base_env, g, num_replicas, ctx, deadline, float(timeout), hint
        )
        generations.append(outcome)
        rank0_code = outcome.exit_codes[0]
        restarting = [code in _CHECKPOINT_EXIT_CODES for code in outcome.exit_codes]
        if any(restarting) and not all(restarting):
            raise ReplicaError(
                f"generation {g} ended inconsistently: exit codes {outcome.exit_codes} mix "
                f"{CHECKPOINT_EXIT_CODE} (checkpoint and restart) with normal returns; "
                "every rank must do the same",
                generation=g,
                exit_code=rank0_code,
            )
        if rank0_code in _CHECKPOINT_EXIT_CODES:
            if g + 1 >= len(schedule):
                raise ReplicaError(
                    f"generation {g} exited with code {CHECKPOINT_EXIT_CODE} to restart, but "
                    f"the replicas schedule {schedule} has no entry for generation {g + 1}",
                    generation=g,
                    exit_code=rank0_code,
                )
            num_replicas = schedule[g + 1]
            continue
        value = outcome.results[0]
        if isinstance(value, int) and not isinstance(value, bool) and value != 0:
            if not 0 < value <= MAX_REPLICAS:
                raise ReplicaError(
                    f"rank 0 of generation {g} returned {value!r}; return an int from 1 to "
                    f"{MAX_REPLICAS} to restart with that many replicas, or None/0 to stop",
                    generation=g,
                    rank=0,
                    exit_code=rank0_code,
                )
            num_replicas = value
            returned += 1
            continue
        return ElasticResult(
            generations=generations,
            checkpoint_dir=ckpt,
            share_dir=base_env["ADAPTDL_SHARE_PATH"],
        )


def _check_forkable() -> None:
    # Looked up, not imported: the harness must not pull torch in.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "this process has an initialized torch.distributed default group, which forked "
            "replicas would inherit and could not replace; call "
            "torch.distributed.destroy_process_group() before run_elastic, or pass "
            "start_method='spawn'"
        )


def elastic_multiprocessing(func: Callable[..., Any]) -> Callable[..., None]:
    """Decorate a test so that calling it runs it through :func:`run_elastic`.

    Kept for tests written against the original ``conftest`` helper: the
    decorated function starts with one replica and its rank-0 return value
    drives restarts. Positional and keyword arguments (pytest fixtures such as
    ``tmp_path``) are passed to every replica. The call returns None, as a
    pytest test must, and raises :class:`ReplicaError` when a replica fails;
    use :func:`run_elastic` to inspect the generations. It needs the ``fork``
    start method, because the original module attribute now names the
    wrapper and ``func`` cannot be pickled.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        body = functools.partial(func, **kwargs) if kwargs else func
        run_elastic(body, 1, args=args)

    return wrapper
