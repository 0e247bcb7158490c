"""Rescale latency: from a new allocation to the first training step at the new size.

A job (by default the MNIST example, on CPU) runs on the local backend; this
script plays the controller: it changes the job's allocation, reconciles every
10 ms, and times each phase of the checkpoint-restart that follows:

* ``checkpoint``: allocation changed -> every old replica has exited (SIGTERM,
  the library checkpoints at the next step, exit 143), split into ``react``
  (until ``save_all_states`` starts: the next step boundary and the
  collective that agrees to stop), ``save``, ``teardown`` (from the end of the
  save to the interpreter's exit) and ``reap`` (until the backend notices);
* ``launch``: -> the new group's processes are spawned (backend reaction);
* ``process_start``: -> the new interpreters run (shim + Python start-up);
* ``imports``: -> ``torch`` and ``adaptdl.torch`` are imported;
* ``rendezvous``: time inside ``init_process_group`` (discovery + collectives);
* ``restore``: time inside ``adaptdl.checkpoint.load_state``;
* ``other``: the rest until the first optimizer step ends (model and data
  set-up, the step itself);
* ``total``: allocation changed -> first step done on every new replica.

Per-replica times come from ``_rescale_probe.py``, which wraps the script.
Writes ``benchmarks/results/rescale.{json,md}``. ``--smoke`` runs one resize and writes
``rescale_smoke.{json,md}`` instead.

``--start`` picks how the backend starts replicas: ``cold`` (a fresh
interpreter per replica), ``warm`` (forked from the backend's pre-warmed
zygote, which has imported torch, adaptdl.torch and ``--preload``), or
``both`` (the default: the whole sequence cold, then warm, one results file
with a ``start`` column so the two are compared under the same load).

    python benchmarks/rescale.py [--smoke] [--start both] [--script examples/mnist/main.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from adaptdl.cluster import JobSpec, LocalBackend, Phase, Supervisor, parse_preload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import at_least, command_line, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "_rescale_probe.py"


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    # Replicas append while this polls: a last line without its newline is unfinished.
    lines = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def _wait(backend: LocalBackend, predicate: Any, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        backend.reconcile(time.time())
        if predicate():
            return time.time()
        for job in backend.jobs().values():
            if job.phase is Phase.FAILED or job.failures:
                raise RuntimeError(
                    f"job {job.name} failed while waiting for {what}:\n{job.message}"
                )
            if job.phase is Phase.SUCCEEDED:
                raise RuntimeError(
                    f"job {job.name} finished while waiting for {what}: give it more work "
                    "(--args) or train less per size (--warmup)"
                )
        time.sleep(0.01)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def _first_steps(events_file: Path, group: int) -> list[dict[str, Any]]:
    return [e for e in _events(events_file) if e["group"] == group and e["event"] == "first_step"]


def _event_time(backend: LocalBackend, name: str, kind: str, after: float) -> float:
    times = [e.time for e in backend.events(name) if e.kind == kind and e.time >= after]
    return min(times) if times else float("nan")


def measure(
    backend: LocalBackend, name: str, events_file: Path, old: int, new: int, warmup: float
) -> dict[str, Any]:
    """Resize ``name`` from ``old`` to ``new`` replicas and time the phases."""
    status = backend.jobs()[name]
    group = status.restarts
    time.sleep(warmup)  # let the current group train for a while
    t0 = time.time()
    backend.set_allocation(name, ("local",) * new)
    t_exit = _wait(
        backend,
        lambda: (
            backend.jobs()[name].restarts > group or backend.jobs()[name].phase is Phase.PENDING
        ),
        120,
        "the old replicas to checkpoint",
    )
    new_group = group + 1
    _wait(
        backend,
        lambda: len(_first_steps(events_file, new_group)) == new,
        300,
        f"the first step on {new} replicas",
    )
    t_exit = _event_time(backend, name, "Checkpointed", t0)
    t_launch = _event_time(backend, name, "Started", t0)
    old_events = [e for e in _events(events_file) if e["group"] == group]
    events = [e for e in _events(events_file) if e["group"] == new_group]

    def old_t(kind: str) -> float:
        times = [e["t"] for e in old_events if e["event"] == kind]
        return max(times) if times else float("nan")

    def latest(kind: str) -> float:
        return float(max(e["t"] for e in events if e["event"] == kind))

    def duration(kind: str) -> float:
        per_rank: dict[int, float] = {}
        for event in events:
            if event["event"] == kind:
                per_rank[event["rank"]] = per_rank.get(event["rank"], 0.0) + event["duration"]
        return max(per_rank.values()) if per_rank else 0.0

    t_start, t_imports, t_first = (
        latest("process_start"),
        latest("imports_done"),
        latest("first_step"),
    )
    rendezvous, restore = duration("rendezvous"), duration("restore")
    return {
        "resize": f"{old}->{new}",
        "checkpoint_s": round(t_exit - t0, 3),
        "ckpt_react_s": round(old_t("save_start") - t0, 3),
        "ckpt_save_s": round(old_t("save_end") - old_t("save_start"), 3),
        "ckpt_teardown_s": round(old_t("exit") - old_t("save_end"), 3),
        "ckpt_reap_s": round(t_exit - old_t("exit"), 3),
        "launch_s": round(t_launch - t_exit, 3),
        "process_start_s": round(t_start - t_launch, 3),
        "imports_s": round(t_imports - t_start, 3),
        "rendezvous_s": round(rendezvous, 3),
        "restore_s": round(restore, 3),
        "other_s": round(t_first - t_imports - rendezvous - restore, 3),
        "total_s": round(t_first - t0, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one resize (1->2) only")
    parser.add_argument("--script", default=str(ROOT / "examples" / "mnist" / "main.py"))
    parser.add_argument(
        "--args", default="--epochs 100", help="arguments of the script (one string)"
    )
    parser.add_argument(
        "--warmup", type=at_least(0, float), default=5.0, help="seconds to train per size"
    )
    parser.add_argument(
        "--start",
        choices=("cold", "warm", "both"),
        default="both",
        help="start replicas as fresh interpreters, forked from the zygote, or both in turn",
    )
    parser.add_argument(
        "--preload",
        default="sklearn.datasets",
        help="extra modules the warm-start zygote imports (comma-separated; the MNIST "
        "example loads its data with scikit-learn)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the sequence this many times per mode, alternating modes (noise check)",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        print(f"rescale.py: --repeat={args.repeat}: expected a positive integer", file=sys.stderr)
        return 2
    script = Path(args.script).resolve()
    if not script.is_file():
        print(f"rescale.py: script {str(script)!r} not found", file=sys.stderr)
        return 2
    try:
        preload = parse_preload([args.preload])
    except ValueError as exc:
        print(f"rescale.py: {exc}", file=sys.stderr)
        return 2
    # The zygote only logs a preload it cannot import; the numbers would
    # then silently measure start-ups without it.
    missing = [name for name in preload if importlib.util.find_spec(name.split(".")[0]) is None]
    if missing:
        print(f"rescale.py: --preload: no module named {missing[0]!r}", file=sys.stderr)
        return 2
    sizes = [1, 2] if args.smoke else [1, 2, 1, 3]
    load_at_start = round(os.getloadavg()[0], 2)  # timings here depend on other work
    modes = ["cold", "warm"] if args.start == "both" else [args.start]
    rows = []
    for run in range(1, args.repeat + 1):
        for mode in modes:  # alternated so both see the same drift in load
            for row in run_sequence(script, args.args, sizes, args.warmup, mode, preload):
                rows.append({"start": mode, "run": run, **row})
    medians = {
        mode: statistics.median(row["total_s"] for row in rows if row["start"] == mode)
        for mode in modes
    }
    write_results(
        "rescale_smoke" if args.smoke else "rescale",
        rows,
        {
            "command": command_line("rescale.py", argv),
            "script": str(script.relative_to(ROOT)) if ROOT in script.parents else str(script),
            "script_args": args.args,
            "device": "cpu",
            "loadavg_1m_at_start": load_at_start,
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
            "preload_warm": args.preload,
            "median_total_s": medians,
            "target_total_s": 3.0,
        },
    )
    return 0


def run_sequence(
    script: Path,
    script_args: str,
    sizes: list[int],
    warmup: float,
    mode: str,
    preload: list[str],
) -> list[dict[str, Any]]:
    """Run the job through ``sizes`` with ``mode`` start-up; one row per resize."""
    with tempfile.TemporaryDirectory(prefix="adaptdl-rescale-") as tmp:
        backend = LocalBackend(
            Path(tmp) / "home",
            slots=max(sizes),
            gpus=[],
            grace_period=60,
            warm_start=mode == "warm",
            preload=preload,
        )
        if mode == "warm" and not backend.wait_warm(300):
            raise RuntimeError(
                "the warm-start zygote did not become ready:\n"
                + (backend.home / "zygote.log").read_text()
            )
        supervisor = Supervisor(backend, admin_token="bench")
        backend.supervisor_url = supervisor.url
        supervisor.start()
        events_file = Path(tmp) / "events.jsonl"
        spec = JobSpec(
            name="rescale",
            command=("python", str(PROBE), str(events_file), str(script)),
            args=tuple(shlex.split(script_args)),
            working_dir=str(script.parent),
        )
        rows: list[dict[str, Any]] = []
        try:
            backend.submit(spec)
            backend.set_allocation("rescale", ("local",) * sizes[0])
            _wait(
                backend,
                lambda: len(_first_steps(events_file, 0)) == sizes[0],
                300,
                "the first step",
            )
            for old, new in zip(sizes, sizes[1:]):
                row = measure(backend, "rescale", events_file, old, new, warmup)
                print(json.dumps({"start": mode, **row}), flush=True)
                rows.append(row)
        finally:
            backend.delete("rescale")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and backend.jobs():
                backend.reconcile(time.time())
                time.sleep(0.05)
            backend.shutdown(stop_jobs=True, timeout=30)
            supervisor.close()
    return rows


if __name__ == "__main__":
    sys.exit(main())
