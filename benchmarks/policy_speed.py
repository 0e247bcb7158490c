"""Time one scheduling round of the goodput-driven policies.

Scenarios: the paper's cluster (16 nodes x 4 GPUs, about 30 active jobs) and
a large one (256 nodes x 8 GPUs = 2048 GPUs, 500 jobs). Jobs carry realistic
speedup functions: :class:`adaptdl.sched.SpeedupFunction` over a
:class:`adaptdl.goodput.GoodputFunction` with random but plausible step-time
and gradient-noise parameters, so the policies pay for batch-size
re-optimisation (memoised across rounds, as in a real scheduler).

Each round feeds the previous round's allocations back in, with time moving
on by 60 s, so the timings are of the steady state, not of a cold start.
Pollux on the large cluster runs with fewer generations (its cost is linear in
them); the row says how many.

Usage::

    python benchmarks/policy_speed.py            # full run
    python benchmarks/policy_speed.py --smoke    # seconds, for CI
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import at_least, command_line, write_results  # noqa: E402

from adaptdl.goodput import GoodputFunction, GradParams, PerfParams  # noqa: E402
from adaptdl.sched import (  # noqa: E402
    Allocation,
    JobInfo,
    NodeInfo,
    SpeedupFunction,
    get_policy,
)


def random_speedup(rng: np.random.Generator) -> SpeedupFunction:
    """A speedup function with parameters in the range real jobs show."""
    b0 = float(rng.choice([32, 64, 128, 256]))
    perf = PerfParams(
        alpha_c=float(rng.uniform(0.01, 0.1)),
        beta_c=float(rng.uniform(1e-4, 2e-3)),
        alpha_n=float(rng.uniform(0.05, 0.5)),
        beta_n=float(rng.uniform(1e-3, 0.02)),
        alpha_r=float(rng.uniform(0.01, 0.1)),
        beta_r=float(rng.uniform(1e-4, 5e-3)),
        gamma=float(rng.uniform(1.0, 3.0)),
    )
    grad = GradParams(sqr=1.0, var=float(rng.uniform(1.0, 1e3)))
    fn = GoodputFunction(perf, grad, b0)
    return SpeedupFunction(
        fn, max_batch_size=b0 * 32, atomic_bsz_range=(b0 / 8, b0 * 2), accumulation=True
    )


def _step_time(replicas: int) -> float:
    """Seconds per iteration on one replica: remaining work is iterations x this."""
    return 0.25


def make_jobs(count: int, rng: np.random.Generator, now: float) -> dict[str, JobInfo]:
    jobs = {}
    for i in range(count):
        jobs[f"job-{i:04d}"] = JobInfo(
            resources={"gpu": 1},
            speedup_fn=random_speedup(rng),
            submission_time=float(rng.uniform(0, now)),
            attained_service=float(rng.exponential(3600 * 4)),
            num_restarts=int(rng.integers(0, 5)),
            max_replicas=int(rng.choice([1, 2, 4, 8, 16, 32, 64])),
            # Heavy-tailed remaining work (minutes to days on one GPU), so
            # the adaptdl policy's remaining-work weights are exercised.
            step_time_fn=_step_time,
            remaining_iterations=float(rng.lognormal(10.0, 2.0)),
        )
    return jobs


def time_rounds(
    policy_name: str,
    options: dict[str, Any],
    jobs: dict[str, JobInfo],
    nodes: dict[str, NodeInfo],
    rounds: int,
) -> dict[str, Any]:
    policy = get_policy(policy_name, **options)
    previous: dict[str, Allocation] = {}
    now = 36000.0
    # One warm-up round: memoised speedups and, for Pollux, a Pareto set.
    decision = policy.optimize(jobs, nodes, previous, now)
    previous = {k: v for k, v in decision.allocations.items() if v}
    times = []
    cpu_times = []
    for _ in range(rounds):
        now += 60.0
        start = time.perf_counter()
        cpu_start = time.process_time()
        decision = policy.optimize(jobs, nodes, previous, now)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        previous = {k: v for k, v in decision.allocations.items() if v}
    used = sum(len(a) for a in previous.values())
    return {
        "median_ms": statistics.median(times) * 1e3,
        "max_ms": max(times) * 1e3,
        # CPU time of this process: on a shared machine wall time also counts
        # other processes' turns, CPU time does not.
        "cpu_median_ms": statistics.median(cpu_times) * 1e3,
        "rounds": rounds,
        "gpus_used": used,
        "jobs_running": len(previous),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few rounds")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds per adaptdl case (default 7, 2 with --smoke); pollux's genetic "
        "search is timed over 3 rounds",
    )
    parser.add_argument("--seed", type=at_least(0), default=0)
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.smoke:
        scenarios = [("smoke", 4, 4, 8)]
        rounds = args.rounds if args.rounds is not None else 2
        pollux_options: dict[str, dict[str, Any]] = {"smoke": {"generations": 5}}
    else:
        scenarios = [("64 GPUs", 16, 4, 30), ("2048 GPUs", 256, 8, 500)]
        rounds = args.rounds if args.rounds is not None else 7
        pollux_options = {"64 GPUs": {}, "2048 GPUs": {"generations": 2}}
    rows = []
    for label, num_nodes, gpus, num_jobs in scenarios:
        nodes = {f"node-{i:03d}": NodeInfo({"gpu": gpus}) for i in range(num_nodes)}
        for policy_name, options in (
            ("adaptdl", {}),
            ("pollux", {"seed": args.seed, **pollux_options[label]}),
        ):
            # The same jobs for each policy, with fresh speedup memos: shared
            # ones would give the second policy the first one's lookups.
            jobs = make_jobs(num_jobs, np.random.default_rng(args.seed), now=36000.0)
            result = time_rounds(
                policy_name, options, jobs, nodes, rounds if policy_name == "adaptdl" else 3
            )
            row = {
                "scenario": label,
                "policy": policy_name,
                "options": ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults",
                "nodes": num_nodes,
                "gpus": num_nodes * gpus,
                "jobs": num_jobs,
                **result,
            }
            rows.append(row)
            print(row, flush=True)
    write_results(
        "policy_speed_smoke" if args.smoke else "policy_speed",
        rows,
        {"command": command_line("policy_speed.py", argv), "seed": args.seed},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
