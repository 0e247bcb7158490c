"""Linear regression with AdaptDL: a small convex task for tests and demos.

The data are ``y = X w* + noise`` with a fixed seed. As training converges the
true gradient shrinks while the per-sample gradient noise does not, so the
gradient noise scale grows and, with ``--autoscale-bsz``, AdaptDL grows the
batch size over training. A single replica can only grow its batch by
accumulating gradients, so run it alone with both flags::

    python examples/linear_regression/main.py --epochs 10 --autoscale-bsz \
        --gradient-accumulation

(set ``ADAPTDL_FIT_INTERVAL=1 ADAPTDL_DECIDE_INTERVAL=1`` to see decisions in
seconds instead of the default 30 s). With two or more replicas
``--autoscale-bsz`` alone is enough.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils.data import TensorDataset

import adaptdl.torch
from adaptdl import env

TRUE_WEIGHT = torch.linspace(-2.0, 2.0, 16)
TRUE_BIAS = 0.5


def make_dataset(size: int = 8192, noise: float = 0.5, seed: int = 0) -> TensorDataset:
    """The same synthetic regression data in every process."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, TRUE_WEIGHT.numel(), generator=generator)
    y = x @ TRUE_WEIGHT + TRUE_BIAS + noise * torch.randn(size, generator=generator)
    return TensorDataset(x, y.unsqueeze(1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="AdaptDL linear regression")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--autoscale-bsz", action="store_true")
    # AdaScale multiplies the learning rate by up to the scale B/B0 once noise
    # dominates; this loss has curvature 2, so lr * B/B0 must stay below 1.
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--gradient-accumulation", action="store_true")
    parser.add_argument("--size", type=int, default=8192)
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Train; return per-epoch records with the loss and the batch sizes used."""
    args = parse_args(argv)
    if args.batch_size > args.size:
        # drop_last would leave no batch at all: say so rather than fail later.
        raise SystemExit(f"--batch-size {args.batch_size}: larger than --size {args.size}")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    adaptdl.torch.init_process_group("gloo")
    loader = adaptdl.torch.AdaptiveDataLoader(
        make_dataset(args.size), batch_size=args.batch_size, shuffle=True, drop_last=True
    )
    if args.autoscale_bsz:
        loader.autoscale_batch_size(
            args.max_batch_size, gradient_accumulation=args.gradient_accumulation
        )
    model = torch.nn.Linear(TRUE_WEIGHT.numel(), 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model = adaptdl.torch.AdaptiveDataParallel(model, optimizer)
    records = []
    for epoch in adaptdl.torch.remaining_epochs_until(args.epochs):
        stats = adaptdl.torch.Accumulator()
        batch_sizes: list[int] = []  # in the order used, repeats dropped
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            stats["loss_sum"] += loss.item() * len(y)
            stats["count"] += len(y)
            if not batch_sizes or batch_sizes[-1] != loader.current_batch_size:
                batch_sizes.append(loader.current_batch_size)
        with stats.synchronized():
            mean_loss = stats["loss_sum"] / stats["count"]
        record = {
            "epoch": epoch,
            "loss": mean_loss,
            "batch_sizes": batch_sizes,
            "weight_error": float((model.module.weight.detach()[0] - TRUE_WEIGHT).norm()),
        }
        records.append(record)
        if env.replica_rank() == 0:
            print(
                f"epoch {epoch}: loss {mean_loss:.4f}, batch sizes {record['batch_sizes']}, "
                f"|w - w*| = {record['weight_error']:.3f}",
                flush=True,
            )
    return records


if __name__ == "__main__":
    run()
