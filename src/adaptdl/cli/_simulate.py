"""``adaptdl simulate``: run scheduling policies over trace workloads.

Every (policy, workload) pair is one independent simulation, run in a pool of
worker processes (``--jobs``). Workers are started with the *spawn* method and
single-threaded BLAS: each simulation does many tiny numeric operations, for
which multi-threaded BLAS on a shared machine is many times slower. Workers
report progress after every tick through a queue, and the parent draws one
text progress bar on stderr, then prints a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue as queue_mod
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from adaptdl.cli import CLIError

__all__ = ["register", "run"]

_LOG = logging.getLogger(__name__)

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

# Set in each worker by _init_worker: where to send progress messages.
_PROGRESS_QUEUE: Any = None


def register(subparsers: Any) -> None:
    """Add the ``simulate`` sub-command."""
    from adaptdl.sched import policy_names

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
    parser.add_argument("workloads", nargs="+", metavar="WORKLOAD", help="workload CSV file(s)")
    parser.add_argument(
        "--policy",
        default="tiresias",
        help="policy name, or several separated by commas to compare (default: tiresias; "
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
        help="write DIR/<policy>/summary.json and DIR/jct.png",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(4, os.cpu_count() or 1)),
        help="simulations run in parallel (default: min(4, CPUs))",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    parser.set_defaults(func=run)


def _check_options(args: argparse.Namespace) -> list[str]:
    policies = [p.strip() for p in str(args.policy).split(",") if p.strip()]
    if not policies:
        raise CLIError("--policy: expected at least one policy name")
    if len(set(policies)) != len(policies):
        raise CLIError(f"--policy {args.policy}: a policy is listed twice")
    from adaptdl.sched import policy_names

    known = policy_names()
    for name in policies:
        if name not in known:
            raise CLIError(f"--policy: unknown policy {name!r}; valid policies: {', '.join(known)}")
    if args.nodes < 1:
        raise CLIError(f"--nodes {args.nodes}: need at least 1 node")
    if args.gpus_per_node < 1:
        raise CLIError(f"--gpus-per-node {args.gpus_per_node}: need at least 1 GPU per node")
    if not (args.interval >= 1 and math.isfinite(args.interval)):
        raise CLIError(f"--interval {args.interval}: must be a finite number of seconds >= 1")
    if not 0.0 <= args.interference < 1.0:
        raise CLIError(f"--interference {args.interference}: must be in [0, 1)")
    if args.jobs < 1:
        raise CLIError(f"--jobs {args.jobs}: must be at least 1")
    if args.seed < 0:
        raise CLIError(f"--seed {args.seed}: must be an integer >= 0")
    if args.output is not None:
        output = Path(args.output)
        if output.exists() and not output.is_dir():
            raise CLIError(f"--output {output}: exists and is not a directory")
    return policies


def _check_output(output: Path) -> None:
    """Fail before hours of simulation, not after, when results cannot be written."""
    import tempfile

    try:
        output.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output):
            pass
    except OSError as exc:
        raise CLIError(f"--output {output}: cannot write there ({exc.strerror or exc})") from None


def _init_worker(progress_queue: Any) -> None:
    global _PROGRESS_QUEUE
    _PROGRESS_QUEUE = progress_queue


def _run_one(task: int, workload: str, policy: str, options: dict[str, Any]) -> dict[str, Any]:
    """Worker entry point: one simulation, returned as plain data."""
    from adaptdl.sim import simulate

    last = [0.0]

    def report(now: float, done: int, total: int) -> None:
        clock = time.monotonic()
        if _PROGRESS_QUEUE is not None and (clock - last[0] > 0.1 or done == total):
            last[0] = clock
            _PROGRESS_QUEUE.put((task, now, done, total))

    result = simulate(workload, policy, progress=report, **options)
    return {
        "policy": policy,
        "workload": result.workload,
        "jcts": result.jcts,
        "summary": result.summary(),
        "wall_time": result.wall_time,
        "policy_time": result.policy_time,
    }


class _ProgressBar:
    """One line on stderr: overall completed jobs plus the slowest task's clock."""

    def __init__(self, totals: dict[int, int], stream: TextIO, enabled: bool) -> None:
        self.done = dict.fromkeys(totals, 0)
        self.clock = dict.fromkeys(totals, 0.0)
        self.totals = totals
        self.stream = stream
        self.enabled = enabled
        self.finished = 0
        self.start = time.monotonic()
        self.tty = stream.isatty()
        self._last_line = ""
        self._last_draw = 0.0

    def update(self, task: int, now: float, done: int) -> None:
        self.done[task] = done
        self.clock[task] = now

    def draw(self) -> None:
        if not self.enabled:
            return
        total = sum(self.totals.values())
        done = sum(self.done.values())
        width = 30
        filled = int(width * done / total) if total else width
        bar = "#" * filled + "-" * (width - filled)
        clock = max(self.clock.values()) / 3600 if self.clock else 0.0
        line = (
            f"[{bar}] {done}/{total} jobs, {self.finished}/{len(self.totals)} runs, "
            f"simulated {clock:.1f} h"
        )
        now = time.monotonic()
        if line == self._last_line or (not self.tty and now - self._last_draw < 5.0):
            return
        self._last_line, self._last_draw = line, now
        # A terminal gets one line redrawn in place; a log file gets a line
        # every few seconds instead of thousands of carriage returns.
        self.stream.write(f"\r{line} " if self.tty else f"{line}\n")
        self.stream.flush()

    def interrupt(self) -> None:
        """End the bar's line so that a message printed next starts on its own."""
        if self.enabled and self.tty and self._last_line:
            self.stream.write("\n")
            self.stream.flush()
            self._last_line = ""

    def close(self) -> None:
        if self.enabled:
            self._last_draw = 0.0
            self.draw()
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()


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


def _write_outputs(output: Path, policies: list[str], rows: list[dict[str, Any]]) -> list[Path]:
    """Write ``<policy>/summary.json`` (published format) and ``jct.png``."""
    written: list[Path] = []
    try:
        output.mkdir(parents=True, exist_ok=True)
        for policy in policies:
            mine = [row for row in rows if row["policy"] == policy]
            jcts = {row["workload"]: row["jcts"] for row in mine}
            avgs = {row["workload"]: row["summary"]["avg_jct"] for row in mine}
            summary = {
                "jcts": jcts,
                "avgs": avgs,
                "mean": sum(avgs.values()) / len(avgs) if avgs else math.nan,
            }
            folder = output / policy
            folder.mkdir(exist_ok=True)
            path = folder / "summary.json"
            path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
            written.append(path)
    except OSError as exc:
        raise CLIError(f"--output {output}: cannot write results ({exc})") from None
    plot = _plot(output / "jct.png", policies, rows)
    if plot is not None:
        written.append(plot)
    return written


def _plot(path: Path, policies: list[str], rows: list[dict[str, Any]]) -> Path | None:
    """CDF of JCTs per policy (all workloads pooled), or None without matplotlib."""
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

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in policies:
        values = np.sort(
            [jct for row in rows if row["policy"] == policy for jct in row["jcts"].values()]
        )
        if values.size == 0:
            continue
        cdf = np.arange(1, values.size + 1) / values.size
        avg = float(values.mean())
        ax.step(values / 3600, cdf, where="post", label=f"{policy} (avg {avg / 3600:.2f} h)")
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("JCT distribution")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise CLIError(f"--output: cannot write {path} ({exc})") from None
    finally:
        plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    """Run every (policy, workload) simulation and print the comparison table."""
    from adaptdl.sim import (
        Simulator,
        TraceError,
        WorkloadError,
        find_traces_dir,
        load_applications,
        make_policy,
        read_workload,
    )

    policies = _check_options(args)
    try:
        traces = find_traces_dir(args.traces)
        apps = load_applications(traces)
    except TraceError as exc:
        raise CLIError(f"--traces: {exc}") from None
    workloads: list[str] = []
    totals: dict[int, int] = {}
    stems: dict[str, str] = {}
    job_counts: dict[str, int] = {}
    for raw in args.workloads:
        path = Path(raw)
        try:
            jobs = read_workload(path, apps)
        except WorkloadError as exc:
            raise CLIError(str(exc)) from None
        if path.stem in stems:
            raise CLIError(
                f"workloads {stems[path.stem]} and {raw} have the same name {path.stem!r}; "
                "rename one (results are keyed by file name)"
            )
        stems[path.stem] = raw
        workloads.append(str(path))
        job_counts[str(path)] = len(jobs)
        for job in jobs:
            most = apps[job.application].max_gpus_per_node
            if args.gpus_per_node > most:
                raise CLIError(
                    f"--gpus-per-node {args.gpus_per_node}: the {job.application} traces "
                    f"(used by {raw}) measure at most {most} GPUs per node"
                )
        for policy in policies:
            try:
                # Building the simulator runs every check that does not need a run.
                Simulator(
                    jobs,
                    make_policy(policy, args.seed),
                    apps,
                    nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node,
                    interval=args.interval,
                    interference=args.interference,
                    seed=args.seed,
                )
            except ValueError as exc:
                raise CLIError(f"{policy} on {raw}: {exc}") from None
    if args.output is not None:
        _check_output(Path(args.output))  # after the inputs: no empty folder on bad input
    tasks = [(policy, workload) for policy in policies for workload in workloads]
    for index, (_, workload) in enumerate(tasks):
        totals[index] = job_counts[workload]
    options = {
        "traces_dir": str(traces),
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "interval": args.interval,
        "interference": args.interference,
        "seed": args.seed,
    }
    for name in _THREAD_VARS:
        os.environ.setdefault(name, "1")
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    progress_queue = ctx.Queue()
    bar = _ProgressBar(totals, sys.stderr, enabled=not args.no_progress)
    results: dict[int, dict[str, Any]] = {}
    failures: list[tuple[str, str]] = []
    workers = min(args.jobs, len(tasks))
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(progress_queue,)
    ) as pool:
        futures: dict[Future[dict[str, Any]], int] = {
            pool.submit(_run_one, index, workload, policy, options): index
            for index, (policy, workload) in enumerate(tasks)
        }
        pending = set(futures)
        try:
            while pending:
                try:
                    task, now, done, _total = progress_queue.get(timeout=0.2)
                    bar.update(task, now, done)
                    while True:
                        task, now, done, _total = progress_queue.get_nowait()
                        bar.update(task, now, done)
                except queue_mod.Empty:
                    pass
                for future in [f for f in pending if f.done()]:
                    pending.discard(future)
                    index = futures[future]
                    policy, workload = tasks[index]
                    try:
                        results[index] = future.result()
                    except (TraceError, WorkloadError, ValueError, RuntimeError) as exc:
                        # Report now, keep the other runs going: their results still count.
                        failures.append((policy, workload))
                        bar.interrupt()
                        print(f"adaptdl: error: {policy} on {workload}: {exc}", file=sys.stderr)
                    bar.finished += 1
                    bar.update(index, bar.clock[index], totals[index])
                bar.draw()
        except KeyboardInterrupt:
            for future in pending:
                future.cancel()
            raise
    bar.close()
    rows = [results[index] for index in range(len(tasks)) if index in results]
    if rows:
        print(_format_table(rows))
        if args.output:
            # A policy's summary.json averages over every workload, so only
            # policies whose runs all succeeded get one.
            done = [name for name in policies if all(name != failed for failed, _ in failures)]
            for name in policies:
                stale = Path(args.output) / name / "summary.json"
                if name not in done and stale.exists():
                    print(f"not updated (a run failed): {stale}", file=sys.stderr)
            if done:
                for path in _write_outputs(Path(args.output), done, rows):
                    print(f"wrote {path}")
    if failures:
        raise CLIError(
            f"{len(failures)} of {len(tasks)} simulations failed "
            f"({', '.join(f'{policy} on {workload}' for policy, workload in failures)}); "
            + ("the table shows the others" if rows else "no results")
        )
    return 0
