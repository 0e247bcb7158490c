"""MNIST tutorial, step 5: statistics summed over replicas with an Accumulator.

Each replica sees only its share of the test set; the Accumulator sums the
loss and the number of correct predictions over all replicas (and across
restarts) when ``synchronized()`` is entered.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import Net, add_data_arguments, load_datasets
from torch import optim
from torch.optim.lr_scheduler import StepLR

import adaptdl.torch


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]"
                f"\tLoss: {loss.item():.6f}"
            )


def test(model, device, test_loader):
    model.eval()
    stats = adaptdl.torch.Accumulator()  # Changed in step 5
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            # CHANGED:
            stats["test_loss"] += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            stats["correct"] += pred.eq(target.view_as(pred)).sum().item()
    with stats.synchronized():  # Changed in step 5
        test_loss = stats["test_loss"] / len(test_loader.dataset)  # Changed
        correct = stats["correct"]  # Changed in step 5
        print(
            f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/"
            f"{len(test_loader.dataset)} ({100.0 * correct / len(test_loader.dataset):.0f}%)\n"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description="MNIST example")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    add_data_arguments(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    dataset1, dataset2 = load_datasets(args.data, args.data_dir)
    train_loader = adaptdl.torch.AdaptiveDataLoader(
        dataset1, batch_size=args.batch_size, shuffle=True, drop_last=True
    )
    test_loader = adaptdl.torch.AdaptiveDataLoader(dataset2, batch_size=args.test_batch_size)
    train_loader.autoscale_batch_size(1028, local_bsz_bounds=(32, 128))

    adaptdl.torch.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model = Net().to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    model = adaptdl.torch.AdaptiveDataParallel(model, optimizer, scheduler)

    for epoch in adaptdl.torch.remaining_epochs_until(args.epochs):  # Changed
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()


if __name__ == "__main__":
    main()
