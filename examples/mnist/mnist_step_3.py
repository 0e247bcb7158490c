"""MNIST tutorial, step 3: let AdaptDL choose the batch size.

``autoscale_batch_size`` lets the global batch grow up to 1028 (with 32 to 128
samples per replica) whenever the fitted goodput model predicts faster
training; the learning rate follows through AdaScale.
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
    test_loss = 0.0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)
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

    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()


if __name__ == "__main__":
    main()
