"""Simulate the scheduling policies on the Pollux workloads and compare with the paper.

Runs every policy on workloads 1-4 of the Pollux (OSDI'21) artifact (160 jobs
each, 16 nodes x 4 GPUs, 60 s interval) and reports average and p99 JCT,
makespan, restarts per job, GPU-hours and wall time, next to the published
average JCT of the same workload. For the deterministic baselines (Tiresias,
Optimus) it also counts how many of the 160 per-job JCTs match the published
ones to the second (all of them should). Randomised policies run with several
seeds (``--seeds``; 3 for Pollux by default).

Simulations run in parallel spawn-started processes with single-threaded BLAS
(``--jobs``); the reported wall time is that of each simulation alone.

Usage::

    python benchmarks/simulate.py                       # all policies, workloads 1-4
    python benchmarks/simulate.py --policies tiresias,optimus
    python benchmarks/simulate.py --smoke               # about a minute (CI skips pollux)
    python benchmarks/simulate.py --data /path/to/pollux-data

A full run merges into ``results/simulate.json``: rows of policies, workloads
or seeds it did not run are kept from the earlier file. A simulation that
fails is reported and the others' rows are still written (exit status 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    RESULTS_DIR,
    at_least,
    command_line,
    source_state,
    write_results,
)

#: The Pollux artifact's data beside the checkout (``--data`` to choose another).
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "pollux-data"
WORKLOADS = (1, 2, 3, 4)
#: Published policy names of the paper's results for each of ours.
PUBLISHED_NAME = {"tiresias": "tiresias", "optimus": "optimus", "pollux": "pollux"}


def _run(
    policy: str, data: Path, workload: Path, seed: int, max_jobs: int | None
) -> dict[str, Any]:
    from adaptdl.sim import simulate

    start = time.perf_counter()
    result = simulate(workload, policy, traces_dir=data / "traces", seed=seed, max_jobs=max_jobs)
    return {
        "jcts": result.jcts,
        "summary": result.summary(),
        "wall": time.perf_counter() - start,
        "policy": result.policy_time,
    }


def pollux_reference(published: dict[str, Any], data: Path, workload: str) -> dict[str, float]:
    """Published Pollux average and p99 JCT and makespan of one workload.

    The makespan is not published directly: it is the latest submission time
    plus JCT, with submission times read from the workload file.
    """
    import numpy as np

    from adaptdl.sim import read_workload

    jcts = published["policies"]["pollux"]["jcts"][workload]
    submitted = {
        job.name: job.submission_time
        for job in read_workload(data / "workloads" / f"{workload}.csv")
    }
    values = np.array(list(jcts.values()), dtype=float)
    return {
        "avg": float(values.mean()),
        "p99": float(np.percentile(values, 99)),
        "makespan": max(submitted[name] + jct for name, jct in jcts.items()),
    }


def _merge_earlier(
    rows: list[dict[str, Any]], tried: set[tuple[str, str, int]], name: str
) -> list[dict[str, Any]]:
    """``rows`` plus the earlier results' rows of runs this command did not try.

    A run of one policy used to replace the whole file, dropping the others'
    results that the README quotes. Each row carries the commit and date it
    was measured at, so kept rows keep theirs; a run tried now and failed
    loses its old row rather than seeming to have produced it.
    """
    try:
        earlier = json.loads((RESULTS_DIR / f"{name}.json").read_text())
        old_rows, meta = earlier["rows"], earlier["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return rows
    kept = []
    for row in old_rows:
        if (row["policy"], row["workload"], row["seed"]) in tried:
            continue
        row.setdefault("source", meta.get("source", "unknown"))
        row.setdefault("date", meta.get("date", "unknown"))
        kept.append(row)
    return kept + rows


def _parse_args() -> argparse.Namespace:
    from adaptdl.sched import policy_names

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(policy_names()))
    parser.add_argument(
        "--workloads", default=None, help="a comma-separated subset of 1,2,3,4 (all)"
    )
    parser.add_argument(
        "--seeds", type=at_least(1), default=None, help="seeds per randomised policy (3)"
    )
    parser.add_argument(
        "--randomised", default="pollux", help="policies run with several seeds (pollux)"
    )
    parser.add_argument("--jobs", type=at_least(1), default=2, help="parallel simulations")
    parser.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA,
        help="the Pollux artifact's folder (traces/, workloads/, published/)",
    )
    parser.add_argument("--smoke", action="store_true", help="workload-1 only, one seed, few jobs")
    args = parser.parse_args()
    # Each name once: a repeated one would run, and be recorded, twice.
    args.policies = list(dict.fromkeys(p for p in args.policies.split(",") if p))
    args.randomised = list(dict.fromkeys(p for p in args.randomised.split(",") if p))
    for option in ("policies", "randomised"):
        names = [p for p in getattr(args, option) if p]
        unknown = [p for p in names if p not in policy_names()]
        if unknown or (option == "policies" and not names):
            parser.error(
                f"--{option}: unknown {unknown or 'empty'}; valid: {', '.join(policy_names())}"
            )
    if args.smoke and (args.workloads is not None or args.seeds is not None):
        parser.error("--smoke runs workload 1 with one seed: leave out --workloads and --seeds")
    raw = args.workloads if args.workloads is not None else "1,2,3,4"
    try:
        args.workloads = list(dict.fromkeys(int(w) for w in raw.split(",") if w))
    except ValueError:
        args.workloads = []
    if not args.workloads or not set(args.workloads) <= set(WORKLOADS):
        parser.error(f"--workloads {raw!r}: expected a comma-separated subset of 1,2,3,4")
    if args.seeds is None:
        args.seeds = 3
    for part in ("traces", "workloads", "published"):
        if not (args.data / part).is_dir():
            parser.error(f"--data: no Pollux data ({part}/ is missing) in {args.data}")
    return args


def main() -> int:
    args = _parse_args()
    data: Path = args.data
    published = json.loads((data / "published" / "load-1.0-workloads-1-4.json").read_text())
    policies: list[str] = args.policies
    workloads: list[int] = args.workloads
    max_jobs: dict[str, int | None] = {}
    if args.smoke:
        workloads = [1]
        args.seeds = 1
    tasks: list[tuple[str, int, int]] = []
    from adaptdl.sim import is_adaptive, make_policy

    seeded = set(args.randomised)
    for policy in policies:
        randomised = policy in seeded
        # Goodput policies refit and search every round: fewer jobs in smoke runs.
        adaptive = is_adaptive(make_policy(policy))
        max_jobs[policy] = 12 if (args.smoke and adaptive) else None
        for number in workloads:
            for seed in range(args.seeds if randomised else 1):
                tasks.append((policy, number, seed))
    references = {
        f"workload-{number}": pollux_reference(published, data, f"workload-{number}")
        for number in workloads
    }
    ctx = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        futures = [
            pool.submit(
                _run,
                policy,
                data,
                data / "workloads" / f"workload-{number}.csv",
                seed,
                max_jobs[policy],
            )
            for policy, number, seed in tasks
        ]
        # Progress as runs finish (a Pollux run takes minutes); rows below
        # stay in task order.
        task_of = dict(zip(futures, tasks))
        for done, future in enumerate(as_completed(futures), 1):
            policy, number, seed = task_of[future]
            state = "failed" if future.exception() else f"{future.result()['wall']:.0f} s"
            print(
                f"[{done}/{len(futures)}] {policy} workload-{number} seed {seed}: {state}",
                file=sys.stderr,
                flush=True,
            )
        for (policy, number, seed), future in zip(tasks, futures):
            try:
                out = future.result()
            except Exception as exc:  # noqa: BLE001 - reported; the other runs go on
                failures.append(f"{policy} workload-{number} seed {seed}: {exc}")
                print(f"FAILED {failures[-1]}", file=sys.stderr, flush=True)
                continue
            summary = out["summary"]
            name = f"workload-{number}"
            row: dict[str, Any] = {
                "policy": policy,
                "workload": name,
                "seed": seed,
                "jobs": int(summary["jobs"]),
                "avg_jct_s": round(summary["avg_jct"], 1),
                "p99_jct_s": round(summary["p99_jct"], 1),
                "makespan_s": round(summary["makespan"]),
                "restarts_per_job": round(summary["restarts_per_job"], 2),
                "gpu_hours": round(summary["gpu_hours"], 1),
                "wall_s": round(out["wall"], 2),
                "policy_s": round(out["policy"], 2),
            }
            if max_jobs[policy] is None:
                pollux = references[name]
                # Ratios to the published Pollux run: the quality criteria.
                row["avg_vs_pollux"] = round(summary["avg_jct"] / pollux["avg"], 3)
                row["p99_vs_pollux"] = round(summary["p99_jct"] / pollux["p99"], 3)
                row["makespan_vs_pollux"] = round(summary["makespan"] / pollux["makespan"], 3)
            ref_name = PUBLISHED_NAME.get(policy)
            ref = published["policies"].get(ref_name) if ref_name else None
            if ref is not None and max_jobs[policy] is None:
                pub_avg = ref["avgs"][name]
                row["published_avg_s"] = round(pub_avg, 1)
                row["vs_published_pct"] = round(100 * (summary["avg_jct"] / pub_avg - 1), 2)
                jcts = ref["jcts"][name]
                row["jcts_matching"] = sum(out["jcts"].get(k) == v for k, v in jcts.items())
            rows.append(row)
            print(row, flush=True)
    name = "simulate_smoke" if args.smoke else "simulate"
    if not args.smoke:
        source, date = source_state(), datetime.datetime.now(datetime.timezone.utc)
        for row in rows:
            row["source"], row["date"] = source, date.isoformat(timespec="seconds")
        tried = {(policy, f"workload-{number}", seed) for policy, number, seed in tasks}
        rows = _merge_earlier(rows, tried, name)
    write_results(
        name,
        rows,
        {
            "command": command_line("simulate.py"),
            "cluster": "16 nodes x 4 GPUs, 60 s interval, no interference",
            "data": str(data),
            "total_wall_s": round(time.perf_counter() - start, 1),
            "parallel_jobs": args.jobs,
            "note": "wall_s is per simulation, policy_s the part inside policy.optimize; "
            "jcts_matching counts published per-job "
            "JCTs reproduced to the second (out of 160); rows of runs this command did "
            "not try are kept from the earlier results, each with its own source and date",
        },
    )
    for failure in failures:
        print(f"simulate.py: failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
