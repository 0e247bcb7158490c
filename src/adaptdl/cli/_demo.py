"""``adaptdl demo``: three real training jobs sharing a local cluster.

The demo starts a cluster daemon in its own temporary home (unless ``--home``
is given), submits three example jobs that scale differently, and shows a
live table while the scheduler resizes them: replicas, the batch size the
goodput model picked, predicted goodput, training progress and restarts.
When every job has finished it prints a summary (job completion times,
restarts, batch sizes seen) and, for each resize, the last loss logged before
the checkpoint and the first one after the restore, which shows that training
continued where it stopped instead of starting over. The batch sizes in the
summary are those the jobs' logs report using (the live table's BATCH column
is the scheduler's prediction, as in ``adaptdl ls``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from adaptdl.cli import CLIError
from adaptdl.cli._cluster_cmds import _check_daemon_options, _home, job_rows
from adaptdl.cli._signals import handling
from adaptdl.cluster import (
    SETTINGS_FILE,
    ClusterAPIError,
    ClusterClient,
    DaemonNotAnsweringError,
    DaemonNotRunningError,
    JobSpec,
    detect_gpus,
    gpu_slot_shortfall,
    parse_policy_options,
    start_daemon,
)

__all__ = ["register", "DemoJob", "DEMO_JOBS", "batch_sizes", "resize_losses"]

_FINISHED = ("Succeeded", "Failed")
#: Seconds the demo's replicas get to checkpoint.
_GRACE = 60.0
#: Replica slots by default: enough for one job to grow while two others run.
_SLOTS = 4
_LOSS_RE = re.compile(r"loss[\s=:]+([-+0-9.eE]+)", re.IGNORECASE)
_PROGRESS_RE = re.compile(r"(epoch\s*[=:]?\s*\d+(?:\s*/\s*\d+)?|step\s*\d+)", re.IGNORECASE)
_BATCH_RE = re.compile(r"batch sizes?\s*[=:]?\s*(\[[\d,\s]*\]|\d+)", re.IGNORECASE)
_HEADER_RE = re.compile(r"^===== adaptdl: restart group (\d+), replica \d+ of (\d+)", re.M)


@dataclass(frozen=True)
class DemoJob:
    """One job of the demo.

    Attributes:
        name: Job name.
        script: Script path relative to the examples directory.
        args: Arguments of the script.
        max_replicas: Cap on replicas, which sets how far the job can scale.
        min_replicas: Replicas it needs to run at all.
        env: Extra environment (e.g. a short refit interval for the demo).
        delay: Seconds after the demo starts before it is submitted.
    """

    name: str
    script: str
    args: tuple[str, ...] = ()
    max_replicas: int = 4
    min_replicas: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0


#: Refit the throughput model and re-decide batch sizes every few seconds, so
#: a demo of under a minute sees several scheduling rounds.
_FAST = {"ADAPTDL_FIT_INTERVAL": "5", "ADAPTDL_DECIDE_INTERVAL": "5"}

DEMO_JOBS: tuple[DemoJob, ...] = (
    # Scales well: a CNN whose batch size AdaptDL may grow with more replicas.
    DemoJob(
        name="mnist",
        script="mnist/main.py",
        args=("--epochs", "60", "--autoscale-bsz", "--log-interval", "5"),
        max_replicas=4,
        env=_FAST,
    ),
    # Scales poorly: a tiny model whose steps are dominated by synchronisation.
    DemoJob(
        name="linreg",
        script="linear_regression/main.py",
        args=("--epochs", "80", "--autoscale-bsz", "--max-batch-size", "256"),
        max_replicas=2,
        env=_FAST,
    ),
    # Arrives later, with a fixed batch size: the others must make room.
    DemoJob(
        name="mnist-fixed",
        script="mnist/main.py",
        args=("--epochs", "50", "--log-interval", "5"),
        max_replicas=3,
        env=_FAST,
        # While the others still run (they take about 20 s): it must get slots.
        delay=12.0,
    ),
)


def _examples_dir(arg: str | None) -> Path:
    if arg:
        path = Path(arg).expanduser().resolve()
    else:
        import adaptdl

        path = Path(adaptdl.__file__).resolve().parents[2] / "examples"
    if not path.is_dir():
        raise CLIError(
            f"examples directory {str(path)!r} not found; run the demo from a source "
            "checkout or pass --examples DIR"
        )
    return path


def _spec(job: DemoJob, examples: Path) -> JobSpec:
    script = examples / job.script
    if not script.is_file():
        raise CLIError(f"demo script {str(script)!r} is missing")
    return JobSpec(
        name=job.name,
        command=("python", str(script)),
        args=job.args,
        env=dict(job.env),
        working_dir=str(script.parent),
        min_replicas=job.min_replicas,
        max_replicas=job.max_replicas,
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _progress(log: str) -> str:
    """The epoch/step and loss of the latest log line that reports a loss.

    Both come from the same line, so the column never pairs one line's epoch
    with another line's loss.
    """
    return _where(log[-4000:], last=True) or "-"


def _loss_on_line(line: str) -> str | None:
    """The first loss on a log line ("train loss 0.1, test loss 0.2" -> 0.1)."""
    found = _LOSS_RE.search(line)
    return found.group(1) if found else None


def _losses(text: str) -> list[str]:
    return [loss for loss in map(_loss_on_line, text.splitlines()) if loss is not None]


def _where(text: str, last: bool) -> str | None:
    """The epoch/step and loss of the last (or first) log line with a loss."""
    lines = [line for line in text.splitlines() if _loss_on_line(line) is not None]
    if not lines:
        return None
    line = lines[-1] if last else lines[0]
    progress = _PROGRESS_RE.search(line)
    loss = _loss_on_line(line)
    where = re.sub(r"\s+", " ", progress.group(1)) + ", " if progress else ""
    return f"{where}loss {loss}"


def resize_losses(log: str) -> list[tuple[int, int, str | None, int, str | None]]:
    """For every restart group after the first: where training was before and after.

    Returns tuples ``(group, replicas_before, last_before, replicas_after,
    first_after)`` parsed from a rank-0 log that holds one header line per
    restart group; ``last_before`` and ``first_after`` read like
    ``"Epoch: 11, loss 0.1020"`` (the first loss of a log line counts).
    """
    headers = list(_HEADER_RE.finditer(log))
    out = []
    for index in range(1, len(headers)):
        previous, current = headers[index - 1], headers[index]
        end = headers[index + 1].start() if index + 1 < len(headers) else len(log)
        out.append(
            (
                int(current.group(1)),
                int(previous.group(2)),
                _where(log[previous.end() : current.start()], last=True),
                int(current.group(2)),
                _where(log[current.end() : end], last=False),
            )
        )
    return out


def _render(
    jobs: Sequence[dict[str, Any]], logs: Mapping[str, str], elapsed: float, info: str
) -> str:
    rows = job_rows(jobs, time.time())
    rows[0].append("PROGRESS")
    for row, job in zip(rows[1:], jobs):
        row.append(_progress(logs.get(job["name"], "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    )
    return f"adaptdl demo: {info}, {elapsed:5.0f}s elapsed\n{table}\n"


def _demo_policy_options(args: argparse.Namespace) -> dict[str, Any]:
    """Check the demo's options as ``adaptdl cluster start`` checks its own.

    Runs before anything is created, so a bad option leaves no temporary
    home and starts no daemon.

    Returns:
        The policy options to start the daemon with.

    Raises:
        CLIError: an option is invalid; the message names it.
    """
    gpus = detect_gpus()
    if args.slots is None:
        # One slot per GPU where there are GPUs; a smaller machine still runs it.
        args.slots = min(_SLOTS, len(gpus)) if gpus else _SLOTS
    items = list(args.policy_option)
    if args.policy == "adaptdl" and not items:
        # A local restart costs seconds, not the half minute of a pod restart.
        items = ["restart_delay=10"]
    _check_daemon_options(
        argparse.Namespace(
            slots=args.slots,
            interval=args.interval,
            policy=args.policy,
            policy_option=items,
            grace=_GRACE,
            host=None,
            port=None,
            plugin=[],
            preload=[],
        )
    )
    shortfall = gpu_slot_shortfall(args.slots, gpus)
    if shortfall is not None:
        raise CLIError(f"--slots {args.slots}: {shortfall}", code=2)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise CLIError(f"--timeout={args.timeout}: expected a positive number of seconds", code=2)
    return parse_policy_options(items)  # already checked: cannot fail here


def _start_demo_cluster(
    args: argparse.Namespace, options: dict[str, Any]
) -> tuple[Path, bool, ClusterClient]:
    """Start the demo's daemon, in a new temporary home unless ``--home`` is given.

    A temporary home is removed again when its daemon does not start, unless
    it holds the daemon's log, which the error names. A ``--home``'s saved
    daemon settings are put back once the demo's daemon has started.

    Returns:
        The home, whether it is temporary, and a client of its daemon.
    """
    temporary = args.home is None
    saved: bytes | None = None
    if not temporary:
        home = _home(args)
        with contextlib.suppress(FileNotFoundError):
            saved = (home / SETTINGS_FILE).read_bytes()
        try:
            ClusterClient(home)
        except DaemonNotAnsweringError as exc:
            raise CLIError(str(exc)) from None
        except DaemonNotRunningError:
            pass
        else:
            raise CLIError(f"a cluster already runs in {home}; use another --home")
    else:
        home = Path(tempfile.mkdtemp(prefix="adaptdl-demo-"))
    try:
        client = start_daemon(
            home,
            slots=args.slots,
            interval=args.interval,
            policy=args.policy,
            grace=_GRACE,
            policy_options=options,
        )
    except (RuntimeError, OSError) as exc:
        if temporary and not (home / "daemon.log").exists():
            shutil.rmtree(home, ignore_errors=True)  # else the error names the log in it
        raise CLIError(f"cannot start the demo's cluster in {home}: {exc}") from None
    finally:
        if not temporary:
            _restore_settings(home, saved)
    if not client.started_here:
        # Another command started a daemon there at the same moment: it is
        # not the demo's to use, nor to stop.
        raise CLIError(f"a cluster already runs in {home}; use another --home")
    return home, temporary, client


def _restore_settings(home: Path, saved: bytes | None) -> None:
    """Put back the settings file the demo's daemon replaced in a ``--home``.

    The daemon records its options for the next ``cluster start`` there; the
    demo's short rounds and restart delay must not become the user's.
    """
    path = home / SETTINGS_FILE
    try:
        if saved is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(saved)
    except OSError as exc:
        print(f"adaptdl: warning: cannot restore {path}: {exc}", file=sys.stderr)


def _foreign_jobs(client: ClusterClient, home: Path, names: Collection[str]) -> list[str]:
    """The jobs of ``home`` that the demo did not submit (a ``--home`` in use).

    Raises:
        CLIError: one of them has the name of a demo job; nothing was submitted.
    """
    jobs = {job["name"]: job["phase"] for job in client.jobs()}
    taken = [name for name in names if name in jobs]
    if taken:
        listed = ", ".join(f"{name} ({jobs[name]})" for name in taken)
        raise CLIError(
            f"{home} already holds jobs named like the demo's: {listed}; use another --home, "
            f"or delete them ('adaptdl cluster start --home {home}', then "
            f"'adaptdl delete --home {home} NAME')"
        )
    return sorted(jobs)


def _check_demo_needs() -> None:
    """The demo jobs train on scikit-learn's bundled digits: say so before they fail."""
    import importlib.util

    for module, package in (("torch", "torch"), ("sklearn", "scikit-learn")):
        if importlib.util.find_spec(module) is None:
            raise CLIError(
                f"adaptdl demo needs {package} in this Python environment (the demo jobs "
                f"import it): pip install {package}"
            )


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """Raise KeyboardInterrupt, so a SIGTERM or SIGHUP cleans up as Ctrl-C does."""
    raise KeyboardInterrupt


#: The daemon runs in its own session: a SIGTERM (``timeout``, a CI cancel) or
#: SIGHUP (a closed terminal) that ended only this process left the daemon and
#: the demo's jobs running.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.keep and args.clean:
        raise CLIError(
            "--keep and --clean: --clean deletes the home of the cluster --keep leaves "
            "running; give one of them",
            code=2,
        )
    _check_demo_needs()
    examples = _examples_dir(args.examples)
    specs = [(job, _spec(job, examples)) for job in DEMO_JOBS]
    options = _demo_policy_options(args)
    with handling(_STOP_SIGNALS, _interrupt):
        home, temporary, client = _start_demo_cluster(args, options)
        failed: list[str] | None = None  # None until the demo has run to its end
        try:
            failed = _run_demo(args, client, home, specs)
        except (ClusterAPIError, DaemonNotRunningError) as exc:
            raise CLIError(f"demo lost its cluster: {exc}") from None
        finally:
            _clean_up(args, client, home, temporary, failed)
    if failed:
        print(f"adaptdl demo: jobs not succeeded: {', '.join(failed)}", file=sys.stderr)
        if not temporary and not args.keep:
            print(
                f"adaptdl demo: they resume from their checkpoints when a cluster next starts "
                f"in {home}; delete them there ('adaptdl delete --home {home} NAME') if "
                "you do not want that",
                file=sys.stderr,
            )
        return 1
    return 0


def _clean_up(
    args: argparse.Namespace,
    client: ClusterClient,
    home: Path,
    temporary: bool,
    failed: list[str] | None,
) -> None:
    """Stop the demo's cluster (unless ``--keep``) and say where its logs are.

    A second SIGTERM or SIGHUP meanwhile is ignored: cut short, the cleanup
    would leave the daemon and the jobs running.
    """
    with handling(_STOP_SIGNALS, signal.SIG_IGN):
        if not args.keep:
            with contextlib.suppress(ClusterAPIError, DaemonNotRunningError):
                client.shutdown(stop_jobs=True, wait=90.0)
        # A failed demo keeps its home even with --clean: the logs say why.
        if temporary and args.clean and failed == []:
            shutil.rmtree(home, ignore_errors=True)
        else:
            print(
                f"\nLogs: {home}/jobs/<job>/logs/replica-<rank>.log (daemon: {home}/daemon.log)",
                flush=True,
            )
        if args.keep:
            print(f"The cluster keeps running: adaptdl cluster stop --home {home}", flush=True)


def _run_demo(
    args: argparse.Namespace,
    client: ClusterClient,
    home: Path,
    specs: Sequence[tuple[DemoJob, JobSpec]],
) -> list[str]:
    """Submit the jobs, show the live table until they finish, print the summary.

    Returns:
        The demo's jobs that did not succeed (timed out, or failed).
    """
    others = _foreign_jobs(client, home, [job.name for job, _ in specs])
    info = client.cluster()
    summary = (
        f"{info['slots']} {info['slotResource']} slots, policy {info['policy']}, "
        f"rounds every {info['interval']:g}s"
    )
    header = f"adaptdl demo: cluster at {client.url}, home {home} ({summary})\n"
    if others:
        header += (
            f"adaptdl demo: {home} also holds {len(others)} other job(s) ({', '.join(others)}); "
            "the demo shows only its own, which share the slots with them\n"
        )
    print(header, end="", flush=True)
    started = time.time()
    pending = list(specs)
    names = {job.name for job, _ in specs}
    replicas_seen: dict[str, list[int]] = {name: [] for name in names}
    tty = sys.stdout.isatty()
    last_frame = ""
    last_print = 0.0
    while True:
        elapsed = time.time() - started
        for item in list(pending):
            if elapsed >= item[0].delay:
                client.submit(item[1])
                pending.remove(item)
        jobs = [job for job in client.jobs() if job["name"] in names]
        logs = {job["name"]: _read(Path(job["paths"]["logs"]) / "replica-0.log") for job in jobs}
        for job in jobs:
            seen = replicas_seen[job["name"]]
            if job["replicas"] and (not seen or seen[-1] != job["replicas"]):
                seen.append(job["replicas"])
        frame = _render(jobs, logs, elapsed, summary)
        shape = [(j["phase"], j["replicas"], j["restarts"], j["batchSize"]) for j in jobs]
        if tty:
            # The whole screen is redrawn: the header is part of every frame.
            sys.stdout.write("\x1b[H\x1b[J" + header + frame)
            sys.stdout.flush()
        elif str(shape) != last_frame or time.time() - last_print >= 15:
            print(frame, flush=True)
            last_frame, last_print = str(shape), time.time()
        if not pending and jobs and all(job["phase"] in _FINISHED for job in jobs):
            break
        if elapsed > args.timeout:
            print(f"adaptdl demo: timed out after {args.timeout:.0f}s", flush=True)
            break
        time.sleep(1.0)
    _summary(client, started, names, replicas_seen)
    return sorted(
        job["name"] for job in client.jobs() if job["name"] in names and job["phase"] != "Succeeded"
    )


def batch_sizes(log: str) -> list[int]:
    """The batch sizes a job's log reports, in order, repeats dropped.

    Reads ``batch size N`` and ``batch sizes [N, M, ...]``, as the examples
    print them, so the summary shows what the job used, not what the
    scheduler predicted it would.
    """
    sizes: list[int] = []
    for found in _BATCH_RE.finditer(log):
        for text in re.findall(r"\d+", found.group(1)):
            if not sizes or sizes[-1] != int(text):
                sizes.append(int(text))
    return sizes


def _shown(values: Sequence[int], most: int = 6) -> str:
    """``a -> b -> c``, the middle elided when there are more than ``most``."""
    text = [str(value) for value in values]
    if len(text) > most:
        text = [*text[: most // 2], "...", *text[-(most // 2) :]]
    return " -> ".join(text) or "-"


def _summary(
    client: ClusterClient,
    started: float,
    names: Collection[str],
    replicas_seen: Mapping[str, list[int]],
) -> None:
    print("\nSummary")
    rows = [["JOB", "STATUS", "JCT", "RESTARTS", "REPLICAS SEEN", "BATCH SIZES USED"]]
    resizes = []
    for job in client.jobs():
        name = job["name"]
        if name not in names:
            continue  # not the demo's: it was in the --home given
        end = job["completed"] or time.time()
        log = _read(Path(job["paths"]["logs"]) / "replica-0.log")
        rows.append(
            [
                name,
                job["phase"],
                f"{end - job['submitted']:.0f}s",
                str(job["restarts"]),
                _shown(replicas_seen.get(name, [])),
                _shown(batch_sizes(log)),
            ]
        )
        events = client.describe(name)["events"]
        checkpointed = sum(1 for event in events if event["kind"] == "Checkpointed")
        for group, before_n, before, after_n, after in resize_losses(log):
            resizes.append((name, group, before_n, before, after_n, after))
        if checkpointed and not resize_losses(log):
            resizes.append((name, -1, 0, None, 0, None))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(f"\nTotal time: {time.time() - started:.0f}s")
    if not resizes:
        print("No job was resized while running.")
        return
    print("\nResizes (rank-0 loss right before the checkpoint and right after the restore):")
    for name, group, before_n, before, after_n, after in resizes:
        if group < 0:
            continue
        print(
            f"  {name}: restart group {group}, {before_n} -> {after_n} replicas: "
            f"last before [{before or '?'}], first after [{after or '?'}]"
        )


def register(subparsers: Any) -> None:
    """Add ``adaptdl demo``."""
    demo = subparsers.add_parser(
        "demo", help="run three example jobs on a local cluster and watch them resize"
    )
    demo.add_argument("--home", default=None, help="cluster home (default: a temporary one)")
    demo.add_argument(
        "--slots",
        type=int,
        default=None,
        help=f"replica slots (default {_SLOTS}, at most one per GPU; CPU slots may share cores)",
    )
    # Rounds every 5 s: the jobs last about 20 s, and with 10 s rounds the
    # resize sometimes came only after linreg had finished.
    demo.add_argument(
        "--interval", type=float, default=5.0, help="seconds between rounds (default 5)"
    )
    demo.add_argument("--policy", default="adaptdl", help="scheduling policy (default adaptdl)")
    demo.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy keyword argument (default for adaptdl: restart_delay=10)",
    )
    demo.add_argument(
        "--timeout", type=float, default=540.0, help="give up after TIMEOUT seconds (default 540)"
    )
    demo.add_argument("--examples", default=None, help="examples directory (default: the repo's)")
    demo.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    demo.add_argument("--clean", action="store_true", help="delete the temporary home at the end")
    demo.set_defaults(func=_cmd_demo)
