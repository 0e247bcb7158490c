"""The finished MNIST tutorial: an elastic, adaptive-batch-size AdaptDL job.

Local run (trains in seconds on a CPU)::

    python examples/mnist/main.py --epochs 5
    python examples/mnist/main.py --autoscale-bsz --gradient-accumulation

(one replica grows its batch only by accumulating gradients, hence the second
flag; with several replicas ``--autoscale-bsz`` alone suffices).

Checkpoint-restart: with ``ADAPTDL_CHECKPOINT_PATH=ckpt`` set, Ctrl-C saves a
checkpoint and exits; running the same command again resumes at the same
epoch and batch. Distributed: start one process per replica with
``ADAPTDL_MASTER_ADDR``, ``ADAPTDL_MASTER_PORT``, ``ADAPTDL_NUM_REPLICAS`` and
``ADAPTDL_REPLICA_RANK`` (and a shared ``ADAPTDL_CHECKPOINT_PATH``); the
checkpoint can be resumed with any number of replicas.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from common import Net, add_data_arguments, load_datasets
from torch import optim
from torch.optim.lr_scheduler import StepLR

import adaptdl.torch
from adaptdl import env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="AdaptDL MNIST example")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size B0")
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--gamma", type=float, default=0.7, help="LR decay per epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=0, help="batches between logs")
    parser.add_argument(
        "--autoscale-bsz", action="store_true", help="let AdaptDL grow the batch size"
    )
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--max-local-bsz", type=int, default=256)
    parser.add_argument(
        "--gradient-accumulation",
        action="store_true",
        help="let autoscaling accumulate micro-batches (a single replica needs it to grow)",
    )
    parser.add_argument(
        "--target-accuracy", type=float, default=None, help="stop once reached (0..1)"
    )
    parser.add_argument("--json-out", default=None, help="write per-epoch metrics here")
    add_data_arguments(parser)
    return parser.parse_args(argv)


def train(
    args: argparse.Namespace,
    model: torch.nn.Module,
    device: torch.device,
    train_loader: adaptdl.torch.AdaptiveDataLoader,
    optimizer: optim.Optimizer,
    epoch: int,
) -> tuple[float, int | None]:
    """One pass; the mean loss and the batch size of its last step."""
    model.train()
    stats = adaptdl.torch.Accumulator()
    batch_size = None
    for batch_idx, (data, target) in enumerate(train_loader):
        batch_size = train_loader.current_batch_size  # None outside the loop
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        stats["loss_sum"] += loss.item() * len(target)
        stats["total"] += len(target)
        if args.log_interval and batch_idx % args.log_interval == 0 and env.replica_rank() == 0:
            # The loader's global position: after a restart it continues here.
            loader = adaptdl.torch.current_dataloader()
            position = loader.current_index if loader is not None else 0
            print(
                f"Train Epoch: {epoch} [{position}/{len(train_loader.dataset)}]"  # type: ignore[arg-type]
                f"\tLoss: {loss.item():.6f}\tbatch size {train_loader.current_batch_size}",
                flush=True,
            )
    with stats.synchronized():
        return float(stats["loss_sum"] / max(stats["total"], 1)), batch_size


def test(
    model: torch.nn.Module,
    device: torch.device,
    test_loader: adaptdl.torch.AdaptiveDataLoader,
) -> tuple[float, float]:
    model.eval()
    stats = adaptdl.torch.Accumulator()
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            stats["test_loss"] += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            stats["correct"] += pred.eq(target.view_as(pred)).sum().item()
    with stats.synchronized():
        size = len(test_loader.dataset)  # type: ignore[arg-type]
        return float(stats["test_loss"] / size), float(stats["correct"] / size)


def run(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Train; return one record per epoch (loss, accuracy, batch size, wall time)."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    adaptdl.torch.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    dataset1, dataset2 = load_datasets(args.data, args.data_dir)
    if args.batch_size > len(dataset1):  # type: ignore[arg-type]
        # drop_last would leave no batch at all: say so rather than fail later.
        raise SystemExit(
            f"--batch-size {args.batch_size}: larger than the training set "
            f"({len(dataset1)} samples)"  # type: ignore[arg-type]
        )
    train_loader = adaptdl.torch.AdaptiveDataLoader(
        dataset1, batch_size=args.batch_size, shuffle=True, drop_last=True
    )
    test_loader = adaptdl.torch.AdaptiveDataLoader(dataset2, batch_size=args.test_batch_size)
    if args.autoscale_bsz:
        train_loader.autoscale_batch_size(
            args.max_batch_size,
            local_bsz_bounds=(None, max(args.max_local_bsz, args.batch_size)),
            gradient_accumulation=args.gradient_accumulation,
        )

    model = Net().to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    model = adaptdl.torch.AdaptiveDataParallel(model, optimizer, scheduler)

    batch_size: int | None = args.batch_size
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    for epoch in adaptdl.torch.remaining_epochs_until(args.epochs):
        train_loss, last_batch = train(args, model, device, train_loader, optimizer, epoch)
        # A pass a restart resumed after its last step ran none: keep the last size.
        batch_size = last_batch if last_batch is not None else batch_size
        test_loss, accuracy = test(model, device, test_loader)
        scheduler.step()
        record = {
            "epoch": epoch,
            "train_loss": train_loss,
            "test_loss": test_loss,
            "accuracy": accuracy,
            "batch_size": batch_size,
            "seconds": time.perf_counter() - start,
        }
        records.append(record)
        if env.replica_rank() == 0:
            print(
                f"Epoch {epoch}: train loss {train_loss:.4f}, test loss {test_loss:.4f}, "
                f"accuracy {100 * accuracy:.1f}%, batch size {batch_size}",
                flush=True,
            )
        if args.target_accuracy is not None and accuracy >= args.target_accuracy:
            break
    if args.json_out and env.replica_rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump(records, f)
    return records


if __name__ == "__main__":
    run()
