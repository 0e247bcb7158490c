"""Helpers shared by the AdaptiveDataParallel / noise-scale / scaling-rule tests.

``FakeLoader`` stands in for the AdaptDL loader where a test needs exact
control over the per-replica batch and the accumulation schedule (the real
loader decides those itself). It implements the helper interface that
``adaptdl.torch.parallel`` and ``adaptdl.torch.scaling_rules`` read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

import adaptdl.torch.parallel as parallel_module
import adaptdl.torch.scaling_rules as rules_module
from adaptdl.testing import free_port


class FakeLoader:
    """The parts of ``AdaptiveDataLoaderHelper`` that the model wrapper uses."""

    def __init__(
        self,
        batch_size: int,
        local_bsz: int,
        accumulation_steps: int = 0,
        max_batch_size: int | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.current_local_bsz = local_bsz
        self.accumulation_steps = accumulation_steps
        self.max_batch_size = max_batch_size  # None: autoscaling is off
        self.training = True
        self._count = 0

    @property
    def autoscaling(self) -> bool:
        return self.max_batch_size is not None and self.max_batch_size > self.batch_size

    def is_accum_step(self) -> bool:
        return self._count < self.accumulation_steps

    def is_optim_step(self) -> bool:
        return not self.is_accum_step()

    def advance(self) -> None:
        """Move to the next micro-batch (what the real loader does between batches)."""
        self._count = 0 if self.is_optim_step() else self._count + 1

    def train(self) -> None:
        self.training = True


@contextlib.contextmanager
def fake_loader(loader: FakeLoader | None) -> Iterator[FakeLoader | None]:
    """Make ``loader`` the current data loader as seen by ADP and the scaling rules."""
    saved = (parallel_module.current_dataloader, rules_module.current_dataloader)
    parallel_module.current_dataloader = lambda: loader  # type: ignore[assignment]
    rules_module.current_dataloader = lambda: loader  # type: ignore[assignment]
    try:
        yield loader
    finally:
        parallel_module.current_dataloader, rules_module.current_dataloader = saved


@contextlib.contextmanager
def local_group() -> Iterator[None]:
    """A gloo process group of one, torn down afterwards (so later forks start clean)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: FakeLoader,
    inputs: torch.Tensor,
    loss_fn: object,
) -> torch.Tensor:
    """One micro-batch the way a user writes it: zero_grad, forward, backward, step."""
    optimizer.zero_grad()
    output = model(inputs)
    loss = loss_fn(output)  # type: ignore[operator]
    loss.backward()
    optimizer.step()
    loader.advance()
    return loss.detach()
