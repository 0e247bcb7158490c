"""``adaptdl simulate``: run scheduling policies over trace workloads.

Every (policy, workload) pair is one independent simulation, run by a few
worker processes (``--jobs``). Workers are started with the *spawn* method and
single-threaded BLAS: each simulation does many tiny numeric operations, for
which multi-threaded BLAS on a shared machine is many times slower.

The parent reads and checks every input, and every path it will write, before
any simulation starts; workers get the parsed jobs, never a path, so a
workload from a pipe is read once and simulated exactly as checked. The
parent hands out one run at a time over a pipe per worker, so it always knows
which run a worker holds: a worker that dies (killed, out of memory) costs
only that run, which is tried once more in a fresh worker. Workers report
progress after every tick over the same pipe; the parent draws one text
progress bar on stderr, then prints a table on stdout. On SIGINT or SIGTERM
the parent stops its workers at once and exits 130 or 143.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import math
import os
import secrets
import signal
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from adaptdl.cli import CLIError, _plugin_search_dir
from adaptdl.cli._signals import handling

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnProcess

    from adaptdl.sim import WorkloadJob

__all__ = ["register", "run"]

_LOG = logging.getLogger(__name__)

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

#: Times one run is started: a run whose worker dies is tried once more.
_MAX_ATTEMPTS = 2

#: Seconds a stopped worker gets to exit on SIGTERM before it is killed.
_STOP_GRACE = 1.0

#: The signals that stop a simulation run (and that workers leave to the parent).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: How errors name the workload read from standard input.
_STDIN = "- (standard input)"


def register(subparsers: Any) -> None:
    """Add the ``simulate`` sub-command."""
    from adaptdl.sched import DEFAULT_POLICY, policy_names

    parser = subparsers.add_parser(
        "simulate",
        help="simulate scheduling policies on trace workloads",
        description=(
            "Simulate a GPU cluster running WORKLOAD files (CSV: name,time,application,"
            "num_replicas,batch_size) under one or more scheduling policies, using "
            "measured traces of each model. Prints average/p50/p99 JCT, makespan, "
            "restarts per job and GPU-hours per policy and workload."
        ),
    )
    parser.add_argument(
        "workloads",
        nargs="+",
        metavar="WORKLOAD",
        help="workload CSV file(s); - reads one from standard input (named 'stdin')",
    )
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help="policy name, or several separated by commas to compare (default: "
        f"{DEFAULT_POLICY}; "
        f"registered: {', '.join(policy_names())})",
    )
    parser.add_argument("--nodes", type=int, default=16, help="nodes in the cluster (16)")
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node (4)")
    parser.add_argument(
        "--interval", type=float, default=60.0, help="seconds between scheduling rounds (60)"
    )
    parser.add_argument(
        "--interference",
        type=float,
        default=0.0,
        help="slowdown of distributed jobs sharing a node, in [0, 1) (0)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of randomised policies (0)")
    parser.add_argument(
        "--max-jobs",
        type=int,
        default=None,
        metavar="N",
        help="simulate only the first N jobs of each workload file (default: all)",
    )
    parser.add_argument(
        "--traces",
        metavar="DIR",
        default=None,
        help="trace folder with one sub-folder per model "
        "(default: $ADAPTDL_SIM_TRACES, else shared/pollux-data/traces nearby)",
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        default=None,
        help="write DIR/<policy>/summary.json (the published format, plus a 'cluster' "
        "field naming the options) and DIR/jct.png",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(4, os.cpu_count() or 1)),
        help="simulations run in parallel (default: min(4, CPUs))",
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="module that registers policies (adaptdl.sched.register_policy) at import; "
        "imported here and in every worker, from the current directory or PYTHONPATH "
        "(repeatable)",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    parser.set_defaults(func=run)


def _import_plugins(modules: Sequence[str]) -> None:
    """Import the ``--plugin`` modules, so that the policies they register exist.

    The current directory is appended to ``sys.path`` (last, so that its
    files cannot hide installed modules, in this process or in the workers,
    which are spawned with this ``sys.path`` and import the same modules).
    """
    from adaptdl._plugins import PluginImportError, import_plugins

    try:
        import_plugins(modules, _plugin_search_dir() if modules else None)
    except PluginImportError as exc:
        raise CLIError(str(exc), code=exc.exit_code) from None


def _check_options(args: argparse.Namespace) -> list[str]:
    from adaptdl.sim import MAX_CLUSTER_GPUS, MAX_RUN_TIME, MAX_SEED

    policies = [p.strip() for p in str(args.policy).split(",")]
    if not any(policies):
        raise CLIError("--policy: expected at least one policy name", code=2)
    if not all(policies):
        # A doubled comma is most likely a name deleted by mistake.
        position = policies.index("") + 1
        raise CLIError(f"--policy {args.policy}: empty policy name at position {position}", code=2)
    if len(set(policies)) != len(policies):
        raise CLIError(f"--policy {args.policy}: a policy is listed twice", code=2)
    from adaptdl.sched import policy_names

    known = policy_names()
    for name in policies:
        if name not in known:
            raise CLIError(
                f"--policy: unknown policy {name!r}; valid policies: {', '.join(known)}", code=2
            )
    if args.nodes < 1:
        raise CLIError(f"--nodes {args.nodes}: need at least 1 node", code=2)
    if args.gpus_per_node < 1:
        raise CLIError(
            f"--gpus-per-node {args.gpus_per_node}: need at least 1 GPU per node", code=2
        )
    if args.nodes * args.gpus_per_node > MAX_CLUSTER_GPUS:
        raise CLIError(
            f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node}: "
            f"{args.nodes * args.gpus_per_node} GPUs; at most {MAX_CLUSTER_GPUS} can be simulated",
            code=2,
        )
    if not 1 <= args.interval <= MAX_RUN_TIME:
        raise CLIError(
            f"--interval {args.interval:g}: must be a number of seconds from 1 to "
            f"{MAX_RUN_TIME:.0f} (10 years)",
            code=2,
        )
    if not 0.0 <= args.interference < 1.0:
        raise CLIError(f"--interference {args.interference}: must be in [0, 1)", code=2)
    if args.jobs < 1:
        raise CLIError(f"--jobs {args.jobs}: must be at least 1", code=2)
    if not 0 <= args.seed <= MAX_SEED:
        raise CLIError(f"--seed {args.seed}: must be an integer from 0 to 2**53", code=2)
    if args.max_jobs is not None and args.max_jobs < 1:
        raise CLIError(f"--max-jobs {args.max_jobs}: must be at least 1", code=2)
    if args.output is not None:
        if args.output == "":
            raise CLIError("--output '': expected a directory path", code=2)
        output = Path(args.output)
        if output.exists() and not output.is_dir():
            raise CLIError(f"--output {output}: exists and is not a directory", code=2)
    return policies


def _output_files(output: Path, policies: Sequence[str]) -> list[Path]:
    """Every file a run writes under ``output``."""
    return [output / policy / "summary.json" for policy in policies] + [output / "jct.png"]


def _check_writable(folder: Path, output: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise CLIError(
            f"--output {output}: cannot write in {folder} ({exc.strerror or exc})"
        ) from None


def _check_output(output: Path, policies: Sequence[str]) -> list[Path]:
    """Fail before hours of simulation, not after, when results cannot be written.

    Checks every path a run writes: ``output`` itself (created here), each
    ``<policy>/`` folder (created only when results are written, so a failed
    check leaves none behind) and each file, which must not be a folder.

    Returns:
        The folders created here, deepest first, for :func:`_remove_if_empty`.
    """
    created = [output, *output.parents]
    created = created[: next(i for i, folder in enumerate(created) if folder.exists())]
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"--output {output}: cannot write there ({exc.strerror or exc})") from None
    _check_writable(output, output)
    for path in _output_files(output, policies):
        folder = path.parent
        if folder != output and os.path.lexists(folder):
            if not folder.is_dir():
                raise CLIError(f"--output {output}: {folder} exists and is not a directory")
            _check_writable(folder, output)
        if os.path.lexists(path) and not path.is_file():
            raise CLIError(f"--output {output}: {path} exists and is not a regular file")
    return created


def _remove_if_empty(folders: Sequence[Path]) -> None:
    """Remove folders this run created and left empty (nothing written), deepest first."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return  # not empty (results were written), or gone


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(temporary_path)``, then move the file to ``path``.

    A failure (or an interrupt) midway leaves the previous file intact
    instead of a truncated one.
    """
    name = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    # os.open, not mkstemp: the file gets the usual umask-based permissions.
    os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(name)
        os.replace(name, path)
    except BaseException:
        name.unlink(missing_ok=True)
        raise


def _write_text_atomically(path: Path, text: str) -> None:
    _write_atomically(path, lambda name: name.write_text(text))


def _say(message: str) -> None:
    """Print ``message`` on stderr, if it can still be written.

    A closed, full or unread stderr must not cost the runs or their results:
    those go to stdout and ``--output``.
    """
    try:
        if sys.stderr is not None:
            print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class _ParentGone(BaseException):
    """The parent closed its end of the pipe: the worker has no one to report to."""


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    try:
        conn.send(message)
    except OSError:
        raise _ParentGone from None


def _worker_main(conn: Connection, options: dict[str, Any]) -> None:
    """Worker process: run the simulations the parent sends until told to stop.

    SIGINT is ignored: on Ctrl-C the whole process group gets it, and the
    parent, not each worker, decides what stops. The parent blocks SIGINT and
    SIGTERM while starting a worker, so a signal arriving before this point
    waits here instead of interrupting the interpreter's start-up.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_STOP_SIGNALS))
    run_options = dict(options)
    plugins = run_options.pop("plugins", ())
    run_options.pop("max_jobs", None)  # the parent truncated the workloads already
    plugin_error = None
    try:
        _import_plugins(plugins)
    except CLIError as exc:
        # The parent imported them: a failure only here is each run's error.
        plugin_error = f"in a simulation worker: {exc}"
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            task, policy, name, jobs = message
            if plugin_error is not None:
                _send(conn, ("failed", task, plugin_error))
                continue
            _send(conn, _run_one(conn, task, policy, name, jobs, run_options))
    except _ParentGone:
        return


def _run_one(
    conn: Connection,
    task: int,
    policy: str,
    name: str,
    jobs: list[WorkloadJob],
    options: dict[str, Any],
) -> tuple[Any, ...]:
    """One simulation, as ``("done", task, row)`` or ``("failed", task, message)``."""
    from adaptdl.sim import PolicyError, TraceError, WorkloadError, simulate

    last = [0.0]

    def report(now: float, done: int, total: int) -> None:
        clock = time.monotonic()
        if clock - last[0] > 0.1 or done == total:
            last[0] = clock
            _send(conn, ("progress", task, now, done))

    try:
        result = simulate(jobs, policy, progress=report, name=name, **options)
    except PolicyError as exc:
        # Most likely a plugin's bug: its traceback from the optimize() call down.
        cause = exc.__cause__
        trace = "".join(traceback.format_exception(cause)) if cause is not None else ""
        return ("failed", task, f"{exc}\n{trace.rstrip()}".rstrip())
    except (TraceError, WorkloadError, ValueError, RuntimeError) as exc:
        return ("failed", task, str(exc))
    except Exception:  # a bug: report it with its traceback, keep the other runs
        return ("failed", task, f"internal error\n{traceback.format_exc().rstrip()}")
    row = {
        "policy": policy,
        "workload": result.workload,
        "jcts": result.jcts,
        "summary": result.summary(),
        "wall_time": result.wall_time,
        "policy_time": result.policy_time,
    }
    return ("done", task, row)


class _Stopped(BaseException):
    """The parent got SIGTERM.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception``
    on the way swallows it.
    """


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back (delivered on exit), e.g. while forking a worker."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(_STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM (main thread only) while the workers are being stopped."""
    with handling(_STOP_SIGNALS, signal.SIG_IGN):
        yield


@contextmanager
def _sigterm_stops() -> Iterator[None]:
    """Turn SIGTERM into :class:`_Stopped`, so that the workers get stopped too."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Stopped

    with handling([signal.SIGTERM], handler):
        yield


def _death(exitcode: int | None) -> str:
    """How a worker process ended, in words."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (out of memory?)" if exitcode == -signal.SIGKILL else ""
        return f"its worker process was killed by {name}{hint}"
    return f"its worker process exited with status {exitcode}"


@dataclass
class _Worker:
    process: SpawnProcess
    conn: Connection
    task: int | None = None


@dataclass
class _Pool:
    """Worker processes that run (policy, workload) simulations one at a time each.

    Attributes:
        tasks: Per run: (policy, workload name, jobs).
        results: Finished runs' table rows, by run index.
        failures: Failed runs' messages, by run index.
    """

    tasks: list[tuple[str, str, list[WorkloadJob]]]
    size: int
    options: dict[str, Any]
    bar: _ProgressBar
    labels: list[str]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    workers: list[_Worker] = field(default_factory=list)

    def run(self) -> None:
        """Run every task; returns when each has a result or a failure."""
        import multiprocessing
        from multiprocessing.connection import wait

        ctx = multiprocessing.get_context("spawn")
        pending = deque(range(len(self.tasks)))
        attempts = [0] * len(self.tasks)
        while len(self.results) + len(self.failures) < len(self.tasks):
            while pending and len(self.workers) < self.size:
                self._start(ctx)
            for worker in self.workers:
                if worker.task is None and pending:
                    self._assign(worker, pending.popleft(), attempts)
            handles: list[Any] = [w.conn for w in self.workers if not w.conn.closed]
            handles += [w.process.sentinel for w in self.workers]
            wait(handles, timeout=0.2)
            for worker in list(self.workers):
                self._drain(worker)
                if worker.process.exitcode is None and not worker.conn.closed:
                    continue
                worker.process.join()
                self._drain(worker)  # what it sent between the last look and its exit
                self.workers.remove(worker)
                worker.conn.close()
                task = worker.task
                if task is None:
                    continue
                why = _death(worker.process.exitcode)
                self.bar.interrupt()
                if attempts[task] < _MAX_ATTEMPTS:
                    _say(f"adaptdl: warning: {self.labels[task]}: {why}; running it again")
                    pending.appendleft(task)
                else:
                    self._fail(task, f"{why} (twice)")
            self.bar.draw()

    def _start(self, ctx: Any) -> None:
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_worker_main, args=(child, self.options), daemon=True)
        with _signals_deferred():
            process.start()
            self.workers.append(_Worker(process, parent))
        child.close()

    def _assign(self, worker: _Worker, task: int, attempts: list[int]) -> None:
        worker.task = task
        attempts[task] += 1
        self.bar.start(task)
        policy, name, jobs = self.tasks[task]
        try:
            worker.conn.send((task, policy, name, jobs))
        except OSError:
            worker.conn.close()  # died before taking it: handled with the exit

    def _drain(self, worker: _Worker) -> None:
        """Handle every message the worker has sent so far."""
        while not worker.conn.closed:
            try:
                if not worker.conn.poll():
                    return
                message = worker.conn.recv()
            except (EOFError, OSError):
                worker.conn.close()
                return
            kind, task = message[0], message[1]
            if kind == "progress":
                self.bar.update(task, message[2], message[3])
                continue
            worker.task = None
            if kind == "done":
                self.results[task] = message[2]
                self.bar.finish(task)
            else:
                self.bar.interrupt()
                self._fail(task, message[2])

    def _fail(self, task: int, message: str) -> None:
        # Report now, keep the other runs going: their results still count.
        self.failures[task] = message
        self.bar.finish(task, failed=True)
        _say(f"adaptdl: error: {self.labels[task]}: {message}")

    def close(self) -> None:
        """Ask idle workers to exit; stop any that are still running a simulation."""
        for worker in self.workers:
            if worker.task is None and not worker.conn.closed:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
        self.stop(grace=5.0, terminate_idle=False)

    def stop(self, grace: float = _STOP_GRACE, terminate_idle: bool = True) -> int:
        """Stop every worker within about ``grace`` seconds; returns how many were busy."""
        busy = sum(1 for worker in self.workers if worker.task is not None)
        for worker in self.workers:
            if worker.process.is_alive() and (terminate_idle or worker.task is not None):
                worker.process.terminate()
        deadline = time.monotonic() + grace
        for worker in self.workers:
            worker.process.join(max(deadline - time.monotonic(), 0.0))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self.workers.clear()
        return busy


class _ProgressBar:
    """One line on stderr: overall completed jobs plus the slowest running task's clock.

    Finished runs no longer count for the clock (it would otherwise stay at
    the longest finished run's makespan while the others catch up).
    """

    def __init__(self, totals: dict[int, int], stream: TextIO | None, enabled: bool) -> None:
        self.done = dict.fromkeys(totals, 0)
        self.clock = dict.fromkeys(totals, 0.0)
        self.totals = totals
        self.stream = stream
        self.enabled = enabled and stream is not None  # None: stderr was closed
        self.finished = 0
        self.failed = 0
        self.running: set[int] = set()
        self.tty = False
        if self.enabled and stream is not None:
            try:
                self.tty = stream.isatty()
            except (OSError, ValueError):
                pass  # a stream that cannot say is drawn as a log file
        self._last_line = ""
        self._last_draw = 0.0

    def _write(self, text: str) -> None:
        """Write to the stream; if that fails, stop drawing (the runs go on)."""
        if not self.enabled or self.stream is None:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            # A full disk, a reader gone (EPIPE) or a terminal gone (EIO): the
            # bar is a courtesy, the results are not.
            self.enabled = False

    def update(self, task: int, now: float, done: int) -> None:
        self.done[task] = done
        self.clock[task] = now

    def start(self, task: int) -> None:
        """A worker took ``task`` (again, after a worker died: from the start)."""
        self.running.add(task)
        self.update(task, 0.0, 0)

    def finish(self, task: int, failed: bool = False) -> None:
        self.running.discard(task)
        self.finished += 1
        self.failed += int(failed)
        if not failed:  # a failed run's jobs did not complete
            self.done[task] = self.totals[task]

    def draw(self) -> None:
        if not self.enabled:
            return
        total = sum(self.totals.values())
        done = sum(self.done.values())
        width = 30
        filled = int(width * done / total) if total else width
        bar = "#" * filled + "-" * (width - filled)
        running = [self.clock[task] for task in self.running]
        clock = (min(running) if running else max(self.clock.values(), default=0.0)) / 3600
        line = (
            f"[{bar}] {done}/{total} jobs, {self.finished}/{len(self.totals)} runs"
            + (f" ({self.failed} failed)" if self.failed else "")
            + f", simulated {clock:.1f} h"
        )
        now = time.monotonic()
        if line == self._last_line or (not self.tty and now - self._last_draw < 5.0):
            return
        self._last_line, self._last_draw = line, now
        # A terminal gets one line redrawn in place; a log file gets a line
        # every few seconds instead of thousands of carriage returns.
        self._write(f"\r{line} " if self.tty else f"{line}\n")

    def interrupt(self) -> None:
        """End the bar's line so that a message printed next starts on its own."""
        if self.enabled and self.tty and self._last_line:
            self._write("\n")
            self._last_line = ""

    def close(self) -> None:
        if self.enabled:
            self._last_draw = 0.0
            self.draw()
            if self.tty:
                self._write("\n")


def _format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "policy",
        "workload",
        "jobs",
        "avg JCT (s)",
        "p50 JCT (s)",
        "p99 JCT (s)",
        "makespan (s)",
        "restarts/job",
        "GPU-hours",
        "wall (s)",
        "policy (s)",
    )
    lines = [header]
    for row in rows:
        s = row["summary"]
        lines.append(
            (
                row["policy"],
                row["workload"],
                f"{s['jobs']:.0f}",
                f"{s['avg_jct']:.1f}",
                f"{s['p50_jct']:.1f}",
                f"{s['p99_jct']:.1f}",
                f"{s['makespan']:.0f}",
                f"{s['restarts_per_job']:.2f}",
                f"{s['gpu_hours']:.1f}",
                f"{row['wall_time']:.1f}",
                f"{row['policy_time']:.1f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for index, line in enumerate(lines):
        cells = [
            cell.ljust(width) if col < 2 else cell.rjust(width)
            for col, (cell, width) in enumerate(zip(line, widths))
        ]
        out.append("  ".join(cells).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _cluster_label(options: dict[str, Any]) -> str:
    """The run's cluster in words, as the published results' ``cluster`` field gives it."""
    interference = options["interference"]
    return (
        f"{options['nodes']} nodes x {options['gpus_per_node']} GPUs, "
        f"{_exact(options['interval'])} s interval, "
        + (f"interference {_exact(interference)}" if interference else "no interference")
        # A policy that takes no seed records none: its runs are the same for any.
        + (f", seed {options['seed']}" if "seed" in options else "")
        # A truncated workload is another experiment: it must not be merged
        # into (and averaged with) the summary of whole ones.
        + (f", first {options['max_jobs']} jobs" if options.get("max_jobs") else "")
    )


def _exact(value: float) -> str:
    """``value`` in the fewest digits that read back as the same number.

    Not ``:g``: its six digits made runs with different options (600 and
    600.0004 s) look like one cluster, and their results were merged.
    """
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


@dataclass(frozen=True)
class _Setup:
    """What makes two runs' results comparable: the cluster and the traces."""

    cluster: str
    traces: str

    def matches(self, summary: dict[str, Any]) -> bool:
        # Summaries of older versions record no traces: the cluster decides.
        recorded = summary.get("traces", self.traces)
        return summary.get("cluster") == self.cluster and recorded == self.traces


def _setup(options: dict[str, Any]) -> _Setup:
    return _Setup(_cluster_label(options), str(Path(options["traces_dir"]).resolve()))


def _check_mergeable(
    output: Path, policies: Sequence[str], setup: _Setup, workloads: set[str]
) -> None:
    """Refuse, before any run, to overwrite results that this run would not replace.

    A summary keeps the workloads of earlier runs into the same ``--output``
    only if they ran on the same cluster and traces; dropping other runs'
    finished results to make room for this one's would lose them.
    """
    for policy in policies:
        path = output / policy / "summary.json"
        earlier = _read_summary(path) if path.exists() else None
        if earlier is None or setup.matches(earlier):
            continue
        others = sorted(set(earlier["avgs"]) - workloads)
        if others:
            recorded = earlier.get("cluster") or "an unrecorded cluster"
            if earlier.get("cluster") == setup.cluster:
                recorded += f", traces {earlier.get('traces')}"
            raise CLIError(
                f"--output {output}: {path} holds results of {', '.join(others)} from a run "
                f"on {recorded}, not this run's {setup.cluster}, traces {setup.traces}; "
                "choose another --output (or remove that file)",
                code=2,
            )


def _read_summary(path: Path) -> dict[str, Any] | None:
    """A ``summary.json`` written earlier, or None if absent or not one of ours."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    jcts, avgs = data.get("jcts"), data.get("avgs")
    if not isinstance(jcts, dict) or not isinstance(avgs, dict):
        return None
    # Merged into this run's summary and plot: every value must be what this
    # module writes, or the finished run would fail at the end.
    if not all(_is_number(value) for value in avgs.values()):
        return None
    for per_job in jcts.values():
        if not isinstance(per_job, dict) or not all(_is_number(v) for v in per_job.values()):
            return None
    return data


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _merge_summary(
    path: Path, rows: list[dict[str, Any]], setup: _Setup
) -> tuple[dict[str, Any], list[str]]:
    """One policy's summary: this run's workloads plus those of an earlier run kept.

    Workloads simulated one run at a time into the same ``--output`` add up
    to one summary, as the published files cover workloads 1-4; a workload
    run again replaces its earlier result. Results from another cluster or
    traces are not mixed in (:func:`_check_mergeable` refused to run if that
    would drop any); a file that cannot be read is replaced. Returns the
    summary and notes saying what was kept or replaced.
    """
    jcts: dict[str, dict[str, float]] = {
        row["workload"]: {
            # Whole seconds as integers, as in the published files.
            name: int(jct) if float(jct).is_integer() else jct
            for name, jct in row["jcts"].items()
        }
        for row in rows
    }
    avgs: dict[str, float] = {row["workload"]: row["summary"]["avg_jct"] for row in rows}
    notes: list[str] = []
    exists = path.exists()
    earlier = _read_summary(path) if exists else None
    if exists and earlier is None:
        notes.append(f"replaced a file that is not a readable summary: {path}")
    elif earlier is not None:
        others = sorted(set(earlier["avgs"]) - set(avgs))
        if others and setup.matches(earlier):
            for workload in others:
                jcts[workload] = earlier["jcts"].get(workload, {})
                avgs[workload] = earlier["avgs"][workload]
            notes.append(f"kept the earlier results of {', '.join(others)} in {path}")
        elif others:
            recorded = earlier.get("cluster") or "an unrecorded cluster"
            notes.append(
                f"replaced the results of {', '.join(others)} from an earlier run on "
                f"another cluster or traces ({recorded}): {path}"
            )
    summary = {
        "jcts": dict(sorted(jcts.items())),
        "avgs": dict(sorted(avgs.items())),
        "mean": sum(avgs.values()) / len(avgs) if avgs else math.nan,
        "cluster": setup.cluster,
        "traces": setup.traces,
    }
    return summary, notes


@dataclass
class _Written:
    """What :func:`_write_outputs` did: reported whether or not it finished.

    Attributes:
        files: The files written.
        notes: Earlier results kept in, or replaced by, the summaries.
        workloads: Every workload the written summaries cover.
        error: The error that stopped the rest, if any.
    """

    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    workloads: set[str] = field(default_factory=set)
    error: CLIError | None = None


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder/.summary.lock`` while the body runs.

    Runs started side by side with the same ``--output`` each read, merge and
    rename the summary; without the lock, one of them dropped the workloads
    the other had just written. A file system without locks (some network
    mounts) writes unlocked, as before, rather than not at all.
    """
    fd = None
    try:
        # Not through a symlink: the lock must not create a file elsewhere.
        fd = os.open(folder / ".summary.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        _LOG.warning("cannot lock %s (%s); writing without a lock", folder, exc)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _write_outputs(
    output: Path, policies: list[str], rows: list[dict[str, Any]], setup: _Setup
) -> _Written:
    """Write ``<policy>/summary.json`` (published format) and ``jct.png``.

    Each file is written under a temporary name and then renamed, so a
    failure midway never leaves a truncated file (every path was checked by
    :func:`_check_output` before the runs).
    """
    done = _Written()
    summaries: dict[str, dict[str, Any]] = {}
    try:
        output.mkdir(parents=True, exist_ok=True)
        for policy in policies:
            folder = output / policy
            path = folder / "summary.json"
            mine = [row for row in rows if row["policy"] == policy]
            folder.mkdir(exist_ok=True)
            with _locked(folder):
                summary, merged = _merge_summary(path, mine, setup)
                text = json.dumps(summary, indent=2, sort_keys=True) + "\n"
                _write_text_atomically(path, text)
            done.files.append(path)
            done.notes += merged
            done.workloads.update(summary["avgs"])
            summaries[policy] = summary
    except OSError as exc:
        done.error = CLIError(f"--output {output}: cannot write results ({exc})")
        return done
    try:
        plot = _plot(output / "jct.png", summaries, done.notes)
    except CLIError as exc:
        done.error = exc
        return done
    if plot is not None:
        done.files.append(plot)
    return done


def _older_results(
    output: Path, policies: list[str], setup: _Setup, workloads: set[str]
) -> list[str]:
    """Notes on other policies' ``summary.json`` under ``output`` that do not compare.

    Those from a run on another cluster, or over other workloads than this
    run's summaries cover, would mislead when set beside them, and cannot be
    told apart afterwards unless someone says so now.
    """
    notes = []
    for path in sorted(output.glob("*/summary.json")):
        if path.parent.name in policies:
            continue
        data = _read_summary(path)
        if data is None or data.get("cluster") is None:
            continue  # files without the field (older versions) cannot be told apart
        if not setup.matches(data):
            notes.append(f"left from an earlier run on another cluster or traces: {path}")
        elif workloads and set(data["avgs"]) != workloads:
            notes.append(
                f"left from an earlier run over other workloads (it covers "
                f"{', '.join(sorted(data['avgs']))}; this run's results cover "
                f"{', '.join(sorted(workloads))}): {path}"
            )
    return notes


def _plot(path: Path, summaries: dict[str, dict[str, Any]], notes: list[str]) -> Path | None:
    """CDF of JCTs per policy (workloads pooled), or None without matplotlib.

    Only the workloads every policy's summary covers are drawn (earlier runs
    merged into one summary may cover more): policies compared over
    different jobs would mislead. The legend gives the mean of those
    workloads' averages, which is each summary's ``mean`` when they are all
    of its workloads. Appends to ``notes`` what was left out.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _LOG.warning(
            "matplotlib is not installed; skipping %s (pip install adaptdl[dashboard])", path
        )
        return None
    import numpy as np

    covered = [set(summary["avgs"]) for summary in summaries.values()]
    workloads = set.intersection(*covered) if covered else set()
    if not workloads:
        notes.append(f"not drawn: the policies' summaries share no workload: {path}")
        return None
    extra = sorted(set.union(*covered) - workloads)
    if extra:
        notes.append(
            f"{path} compares only the workloads every policy covers "
            f"({', '.join(sorted(workloads))}), not {', '.join(extra)}"
        )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, summary in summaries.items():
        values = np.sort(
            [jct for name in workloads for jct in summary["jcts"].get(name, {}).values()]
        )
        if values.size == 0:
            continue
        cdf = np.arange(1, values.size + 1) / values.size
        mean = float(np.mean([summary["avgs"][name] for name in workloads]))
        ax.step(values / 3600, cdf, where="post", label=f"{policy} (mean {mean / 3600:.2f} h)")
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours)")
    ax.set_ylabel("fraction of jobs")
    count = len(workloads)
    ax.set_title(f"JCT distribution ({count} workload{'s' if count != 1 else ''} pooled)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        _write_atomically(path, lambda name: fig.savefig(name, dpi=120, format="png"))
    except OSError as exc:
        raise CLIError(f"--output: cannot write {path} ({exc})") from None
    finally:
        plt.close(fig)
    return path


def _load_traces(explicit: str | None) -> tuple[Path, dict[str, Any]]:
    """The trace folder and its models; errors name where the folder came from."""
    from adaptdl import env
    from adaptdl.sim import TraceError, find_traces_dir, load_applications

    try:
        traces = find_traces_dir(explicit)
        return traces, load_applications(traces)
    except TraceError as exc:
        if explicit is not None:
            if not Path(explicit).is_dir():
                raise CLIError(f"--traces {explicit}: not a directory", code=2) from None
            source = "--traces: "
        elif env.sim_traces():
            source = "ADAPTDL_SIM_TRACES: "  # not a flag the user never passed
        else:
            source = ""  # the search's message says where it looked
        raise CLIError(f"{source}{exc}") from None


def run(args: argparse.Namespace) -> int:
    """Run every (policy, workload) simulation and print the comparison table."""
    from adaptdl.sim import Simulator, WorkloadError, make_policy, read_workload

    _import_plugins(args.plugin)
    policies = _check_options(args)
    traces, apps = _load_traces(args.traces)
    workloads: list[tuple[str, str, list[WorkloadJob]]] = []  # (argument, name, jobs)
    stems: dict[str, str] = {}
    if args.workloads.count("-") > 1:
        raise CLIError(f"{_STDIN} is given more than once; it can be read only once", code=2)
    for raw in args.workloads:
        path = _workload_path(raw)
        try:
            # Read once: a pipe cannot be read again, and the workers must
            # simulate exactly the jobs checked here.
            jobs = read_workload(path, apps)
        except WorkloadError as exc:
            raise CLIError(_stdin_named(str(exc), raw, path)) from None
        if raw == "-":
            # Later errors (the simulator's, the workers') name the jobs' origin.
            jobs = [
                dataclasses.replace(job, origin=_stdin_named(job.origin, raw, path)) for job in jobs
            ]
        if args.max_jobs is not None and len(jobs) > args.max_jobs:
            jobs = jobs[: args.max_jobs]  # the whole file was checked all the same
            args.truncated = True  # labels the summary: not comparable with whole files
        if path.stem in stems:
            raise CLIError(
                f"workloads {stems[path.stem]} and {raw} have the same name {path.stem!r}; "
                "rename one (results are keyed by file name)"
            )
        stems[path.stem] = raw
        workloads.append((str(path), path.stem, jobs))
        for job in jobs:
            most = apps[job.application].max_gpus_per_node
            if args.gpus_per_node > most:
                raise CLIError(
                    f"--gpus-per-node {args.gpus_per_node}: the {job.application} traces "
                    f"(used by {raw}) measure at most {most} GPUs per node",
                    code=2,
                )
        for policy in policies:
            try:
                built = make_policy(policy, args.seed)
            except Exception as exc:  # noqa: BLE001 - a user's factory may raise anything
                raise CLIError(
                    f"{policy}: its factory failed: {type(exc).__name__}: {exc}"
                ) from None
            try:
                # Building the simulator runs every check that does not need a run.
                Simulator(
                    jobs,
                    built,
                    apps,
                    nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node,
                    interval=args.interval,
                    interference=args.interference,
                    seed=args.seed,
                )
            except (ValueError, TypeError) as exc:
                message = str(exc)
                # A message that already names the file and line needs no more.
                shown_as = _stdin_named(str(path), raw, path)
                where = "" if message.startswith(shown_as) else f" on {raw}"
                raise CLIError(f"{policy}{where}: {message}") from None
    output = Path(args.output) if args.output is not None else None
    # After the inputs: no empty folder on bad input; and removed again when
    # nothing gets written (interrupted, or every run failed).
    created = _check_output(output, policies) if output is not None else []
    if output is not None:
        try:
            _check_mergeable(
                output,
                policies,
                _setup(_run_options(args, traces)),
                {name for _, name, _ in workloads},
            )
        except CLIError:
            _remove_if_empty(created)
            raise
    try:
        return _run_pool(args, policies, workloads, traces, output)
    finally:
        _remove_if_empty(created)


def _stdin_named(message: str, raw: str, path: Path) -> str:
    """``message`` with a leading ``/dev/stdin`` named as the argument ``-`` it came from."""
    if raw == "-" and message.startswith(str(path)):
        return _STDIN + message[len(str(path)) :]
    return message


def _workload_path(raw: str) -> Path:
    """The file of the WORKLOAD argument ``raw``; ``-`` is standard input.

    Standard input is read through ``/dev/stdin`` so that it is read like
    any file (and named ``stdin``, as when that path is given).
    """
    if raw != "-":
        return Path(raw)
    if sys.stdin is None:  # started with descriptor 0 closed
        raise CLIError(f"{_STDIN}: it is closed; give the workload's file instead")
    try:
        interactive = sys.stdin.isatty()
    except (OSError, ValueError):
        interactive = False  # closed since: reading says so
    if interactive:
        _say("adaptdl simulate: reading a workload CSV from the terminal (end it with Ctrl-D)")
    return Path("/dev/stdin")


def _run_options(args: argparse.Namespace, traces: Path) -> dict[str, Any]:
    """What every worker's simulation is built from (and the summary records)."""
    return {
        "traces_dir": str(traces),
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "interval": args.interval,
        "interference": args.interference,
        "seed": args.seed,
        "plugins": list(args.plugin),
        "max_jobs": args.max_jobs if getattr(args, "truncated", False) else None,
    }


def _run_pool(
    args: argparse.Namespace,
    policies: list[str],
    workloads: list[tuple[str, str, list[WorkloadJob]]],
    traces: Path,
    output: Path | None,
) -> int:
    """Run every (policy, workload) simulation in worker processes and report them."""
    runs = [(policy, workload) for policy in policies for workload in workloads]
    tasks = [(policy, name, jobs) for policy, (_, name, jobs) in runs]
    labels = [f"{policy} on {raw}" for policy, (raw, _, _) in runs]
    totals = {index: len(jobs) for index, (_, _, jobs) in enumerate(tasks)}
    options = _run_options(args, traces)
    for name in _THREAD_VARS:
        os.environ.setdefault(name, "1")
    bar = _ProgressBar(totals, sys.stderr, enabled=not args.no_progress)
    pool = _Pool(tasks, min(args.jobs, len(tasks)), options, bar, labels)
    with _sigterm_stops():
        try:
            pool.run()
            pool.close()
        except (KeyboardInterrupt, _Stopped) as exc:
            with _signals_ignored():  # a second signal must not cut the cleanup short
                busy = pool.stop()
                bar.interrupt()
            sigint = isinstance(exc, KeyboardInterrupt)
            raise CLIError(
                f"{'interrupted (SIGINT)' if sigint else 'terminated (SIGTERM)'}: stopped "
                f"{busy} running simulation(s); nothing was printed or written",
                code=130 if sigint else 143,
            ) from None
        finally:
            with _signals_ignored():
                pool.stop()
        try:
            bar.close()
            return _report(pool, policies, output, _setup(options))
        except _Stopped:
            # Files are replaced whole, so each is the old or the new version.
            raise CLIError("terminated (SIGTERM) while printing results", code=143) from None


def _report(pool: _Pool, policies: list[str], output: Path | None, setup: _Setup) -> int:
    """Write the outputs, print the table and sum up failures; returns the exit status.

    Files come first: a reader that closes stdout early (``| head``) or a
    full disk behind it must not cost the results of a long run.
    """
    tasks, labels = pool.tasks, pool.labels
    results, failures = pool.results, pool.failures
    rows = [results[index] for index in range(len(tasks)) if index in results]
    written: list[Path] = []
    write_error: CLIError | None = None
    notes: list[str] = []
    covered: set[str] = set()
    if rows and output is not None:
        # A policy's summary.json averages over every workload, so only
        # policies whose runs all succeeded get one.
        failed = {tasks[index][0] for index in failures}
        done = [name for name in policies if name not in failed]
        for name in policies:
            stale = output / name / "summary.json"
            if name not in done and stale.exists():
                notes.append(f"not updated (a run failed): {stale}")
        if done:
            outcome = _write_outputs(output, done, rows, setup)
            written, write_error = outcome.files, outcome.error
            notes += outcome.notes
            covered = outcome.workloads
        notes += _older_results(output, policies, setup, covered)
    if rows:
        try:
            if sys.stdout is None:
                raise OSError("it is closed")
            print(_format_table(rows))
            for path in written:
                print(f"wrote {path}")
            sys.stdout.flush()
        except BrokenPipeError:
            for note in notes:  # stderr may still be read
                _say(note)
            if write_error is not None:
                _say(f"adaptdl: error: {write_error}")
            raise
        except OSError as exc:
            saved = f"; the files were written ({', '.join(map(str, written))})" if written else ""
            raise CLIError(
                f"cannot print the results to standard output ({exc.strerror or exc}){saved}"
            ) from None
    for note in notes:
        _say(note)
    if write_error is not None:
        raise write_error
    if failures:
        raise CLIError(
            f"{len(failures)} of {len(tasks)} simulations failed "
            f"({', '.join(labels[index] for index in sorted(failures))}); "
            + ("the table shows the others" if rows else "no results")
        )
    return 0
