"""Benchmark of adaptdl.collective: start-up time and allreduce latency.

Runs 2 and 4 local replicas (real processes through adaptdl.testing) and
measures, inside the replicas:

* ``init_s``: the slowest rank's :func:`adaptdl.collective.initialize`, i.e.
  the time until the whole job is connected (the original paid a fixed 5 s);
* the median and 90th percentile latency of a small-object allreduce, a
  1 MiB numpy allreduce and a small broadcast, as seen by rank 0.

Usage::

    python benchmarks/collective.py            # full run
    python benchmarks/collective.py --smoke    # a few iterations, for CI
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
from _common import command_line, write_results

from adaptdl import collective
from adaptdl.testing import run_elastic

ARRAY_BYTES = 1 << 20


def _time_op(op: Any, iterations: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        op()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    return samples


def _replica(iterations: int, warmup: int) -> dict[str, Any]:
    start = time.perf_counter()
    collective.initialize()
    init_s = time.perf_counter() - start
    small = {"loss": 0.5, "count": 3}
    array = np.ones(ARRAY_BYTES // 8, dtype=np.float64)
    samples = {
        "allreduce small": _time_op(
            lambda: collective.allreduce(dict(small), lambda a, b: a), iterations, warmup
        ),
        "allreduce 1 MiB array": _time_op(
            lambda: collective.allreduce(array.copy()), iterations, warmup
        ),
        "broadcast small": _time_op(lambda: collective.broadcast(small), iterations, warmup),
    }
    collective.teardown()
    return {"init_s": init_s, "samples": samples}


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few iterations only (CI)")
    parser.add_argument("--iterations", type=int, default=None, help="timed iterations per op")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    if args.iterations is not None and args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    if any(n < 1 for n in args.replicas):
        parser.error(f"--replicas must all be >= 1, got {args.replicas}")
    iterations = args.iterations if args.iterations is not None else (5 if args.smoke else 200)
    warmup = 1 if args.smoke else 10

    rows: list[dict[str, Any]] = []
    for n in args.replicas:
        result = run_elastic(_replica, n, args=(iterations, warmup), timeout=300)
        outs = result.generations[0].results
        init_s = max(out["init_s"] for out in outs)
        for op, samples in outs[0]["samples"].items():
            rows.append(
                {
                    "replicas": n,
                    "operation": op,
                    "init_ms": init_s * 1e3,
                    "median_ms": statistics.median(samples) * 1e3,
                    "p90_ms": _percentile(samples, 90) * 1e3,
                    "iterations": len(samples),
                }
            )
            print(
                f"replicas={n} {op:24s} init={init_s * 1e3:7.1f} ms "
                f"median={rows[-1]['median_ms']:8.3f} ms p90={rows[-1]['p90_ms']:8.3f} ms",
                flush=True,
            )
    meta = {
        "command": command_line("collective.py", argv),
        "iterations": iterations,
        "warmup": warmup,
        "array_bytes": ARRAY_BYTES,
        "note": "latencies measured on rank 0; init_ms is the slowest rank's initialize()",
    }
    write_results("collective_smoke" if args.smoke else "collective", rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
