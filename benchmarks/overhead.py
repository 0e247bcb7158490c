"""Benchmark: step-time overhead of AdaptiveDataParallel + AdaptiveDataLoader over DDP.

Two local replicas (real processes through :mod:`adaptdl.testing`, gloo, one
thread each) train the same MLP on the same synthetic data with the same
per-replica batch, once with plain ``DistributedDataParallel`` and a
``DataLoader`` over a ``DistributedSampler``, once with
``AdaptiveDataParallel`` and ``AdaptiveDataLoader`` (AdaScale, gradient-noise
measurement, profiling and the loader's periodic agreement collective, about
every 0.1 s, all on).

A third variant, plain DDP with only the gradient-noise measurement and
AdaScale (``GradientNoiseScale`` on a DDP model, same DataLoader), separates
the cost of the statistics from that of the adaptive data loader.

The variants alternate block by block (the order rotates every round, so
slow drifts of a shared machine hit all equally), every block is one pass
over the data and starts after a barrier, and the result is the median over
blocks of the
per-block ratio ``ADP step time / DDP step time`` (wall clock, rank 0). The
target is <= 1.03. On a shared, oversubscribed host the wall-clock ratio is
dominated by scheduling noise, so the process CPU time per step (all threads,
which includes gloo's and the collectives' background threads) is reported
next to it as a steadier measure of the work added.

Usage::

    python benchmarks/overhead.py            # full run
    python benchmarks/overhead.py --smoke    # a few steps, for CI
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import at_least, command_line, write_results

import adaptdl.torch as adl
from adaptdl.testing import run_elastic
from adaptdl.torch.data import AdaptiveDataLoader
from adaptdl.torch.gradient_noise_scale import GradientNoiseScale
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.scaling_rules import AdaScale

IN_FEATURES = 256
HIDDEN = 512
CLASSES = 10


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def _train_pass(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Any
) -> tuple[float, float]:
    """One pass over ``loader``; returns wall and process-CPU seconds per step."""
    dist.barrier()
    steps = 0
    start, start_cpu = time.perf_counter(), time.process_time()
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        steps += 1
    steps = max(steps, 1)
    return (time.perf_counter() - start) / steps, (time.process_time() - start_cpu) / steps


def _replica(steps: int, rounds: int, warmup: int, local_bsz: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    replicas = dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    size = steps * local_bsz * replicas
    dataset = torch.utils.data.TensorDataset(
        torch.randn(size, IN_FEATURES, generator=generator),
        torch.randint(0, CLASSES, (size,), generator=generator),
    )
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    plain_loader = torch.utils.data.DataLoader(
        dataset, batch_size=local_bsz, sampler=sampler, drop_last=True
    )

    # 1. The baseline: DDP and a DataLoader over a DistributedSampler.
    ddp_model = torch.nn.parallel.DistributedDataParallel(_mlp())
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)

    # 2. DDP plus only the gradient-noise hook and AdaScale, same loader: the
    #    cost of the statistics alone, without the adaptive data loader.
    gns_model = torch.nn.parallel.DistributedDataParallel(_mlp())
    gns_optimizer = torch.optim.SGD(gns_model.parameters(), lr=0.01, momentum=0.9)
    gns_model.gns = GradientNoiseScale(gns_model, gns_optimizer)  # type: ignore[assignment]
    AdaScale().initialize(gns_model, gns_optimizer, patch_optimizer=True)

    # 3. The full AdaptDL stack.
    adp_module = _mlp()
    adp_optimizer = torch.optim.SGD(adp_module.parameters(), lr=0.01, momentum=0.9)
    adp_model = AdaptiveDataParallel(adp_module, adp_optimizer, name="overhead-adp")
    adp_loader = AdaptiveDataLoader(
        dataset, batch_size=local_bsz * replicas, shuffle=True, drop_last=True
    )
    epochs = iter(adl.remaining_epochs_until(2 * (rounds + warmup)))

    def run_ddp() -> tuple[float, float]:
        return _train_pass(ddp_model, ddp_optimizer, plain_loader)

    def run_gns() -> tuple[float, float]:
        return _train_pass(gns_model, gns_optimizer, plain_loader)

    def run_adp() -> tuple[float, float]:
        next(epochs)
        return _train_pass(adp_model, adp_optimizer, adp_loader)

    variants = [("ddp", run_ddp), ("gns", run_gns), ("adp", run_adp)]
    results = []
    for index in range(rounds + warmup):
        sampler.set_epoch(index)
        # Rotate the order every round, so no variant always runs first.
        shift = index % len(variants)
        timings = {name: run() for name, run in variants[shift:] + variants[:shift]}
        if index >= warmup:
            results.append(timings)
        if dist.get_rank() == 0:
            print(f"overhead: round {index + 1}/{rounds + warmup}", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only (CI)")
    parser.add_argument("--steps", type=at_least(1), default=None, help="steps per block")
    parser.add_argument("--rounds", type=at_least(1), default=None, help="measured block pairs")
    parser.add_argument("--local-bsz", type=at_least(1), default=64, help="per-replica batch size")
    parser.add_argument("--replicas", type=at_least(1), default=2)
    args = parser.parse_args()
    steps = args.steps if args.steps is not None else (5 if args.smoke else 100)
    rounds = args.rounds if args.rounds is not None else (2 if args.smoke else 40)
    warmup = 1
    result = run_elastic(
        _replica,
        args.replicas,
        args=(steps, rounds, warmup, args.local_bsz),
        timeout=600,
        env={"OMP_NUM_THREADS": "1"},
    )
    rows: list[dict[str, Any]] = []
    for rank, blocks in enumerate(result.final.results):
        for index, timings in enumerate(blocks):
            (ddp_wall, ddp_cpu), (gns_wall, gns_cpu), (adp_wall, adp_cpu) = (
                timings["ddp"],
                timings["gns"],
                timings["adp"],
            )
            rows.append(
                {
                    "rank": rank,
                    "block": index,
                    "ddp_ms": 1e3 * ddp_wall,
                    "gns_ms": 1e3 * gns_wall,
                    "adp_ms": 1e3 * adp_wall,
                    "ratio": adp_wall / ddp_wall,
                    "gns_ratio": gns_wall / ddp_wall,
                    "ddp_cpu_ms": 1e3 * ddp_cpu,
                    "gns_cpu_ms": 1e3 * gns_cpu,
                    "adp_cpu_ms": 1e3 * adp_cpu,
                    "cpu_ratio": adp_cpu / ddp_cpu,
                    "gns_cpu_ratio": gns_cpu / ddp_cpu,
                }
            )
    ratios = [row["ratio"] for row in rows if row["rank"] == 0]
    median_ratio = statistics.median(ratios)
    # Every column is the median over all ranks' blocks (the headline wall
    # ratio, over rank 0's only, is median_ratio in the meta).
    summary: dict[str, Any] = {"rank": "all", "block": "median"}
    for key in rows[0]:
        if key not in summary:
            summary[key] = statistics.median(row[key] for row in rows)
    median_cpu_ratio = summary["cpu_ratio"]
    rows.append(summary)
    meta = {
        "command": command_line("overhead.py"),
        "replicas": args.replicas,
        "threads_per_replica": 1,
        "backend": "gloo",
        "model": f"MLP {IN_FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}",
        "local_batch_size": args.local_bsz,
        "steps_per_block": steps,
        "measured_block_pairs": rounds,
        "median_ratio": median_ratio,
        "median_cpu_ratio": median_cpu_ratio,
        "median_gns_ratio": summary["gns_ratio"],
        "median_gns_cpu_ratio": summary["gns_cpu_ratio"],
        "target_ratio": 1.03,
    }
    write_results("overhead_smoke" if args.smoke else "overhead", rows, meta)
    print(
        f"median ADP/DDP step-time ratio over {len(ratios)} block pairs: {median_ratio:.3f} "
        f"(wall, rank 0); {median_cpu_ratio:.3f} (process CPU time, all ranks); "
        f"DDP + noise statistics only: {summary['gns_ratio']:.3f} wall, "
        f"{summary['gns_cpu_ratio']:.3f} CPU"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
