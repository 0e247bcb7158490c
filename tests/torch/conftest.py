"""Shared fixtures of the adaptdl.torch tests.

adaptdl.torch keeps process-wide state (the checkpoint registry, the epoch
counter, loader positions, metrics, signal flags, the collectives). Tests run
in one pytest process and fork replicas from it, so every test starts from a
clean slate here; a forked replica then starts exactly like a fresh process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

import adaptdl.torch  # noqa: F401 - registers its state with _procstate
from adaptdl import _procstate, checkpoint, collective

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

_ADAPTDL_VARS = (
    "ADAPTDL_CHECKPOINT_PATH",
    "ADAPTDL_MASTER_ADDR",
    "ADAPTDL_MASTER_PORT",
    "ADAPTDL_NUM_REPLICAS",
    "ADAPTDL_REPLICA_RANK",
    "ADAPTDL_NUM_RESTARTS",
    "ADAPTDL_NUM_NODES",
    "ADAPTDL_SUPERVISOR_URL",
    "ADAPTDL_JOB_ID",
    "ADAPTDL_SCHED_VERSION",
    "ADAPTDL_FIT_INTERVAL",
    "ADAPTDL_DECIDE_INTERVAL",
)


def reset_adaptdl_torch() -> None:
    """Forget all process-wide adaptdl.torch state (what a forked replica forgets too)."""
    collective.teardown()
    checkpoint.clear_registry()  # the user-level states of earlier tests too
    _procstate.forget_inherited_state()


@pytest.fixture(autouse=True)
def clean_adaptdl_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run every test with fresh adaptdl.torch state and no inherited ADAPTDL_* variables."""
    for name in _ADAPTDL_VARS:
        monkeypatch.delenv(name, raising=False)
    reset_adaptdl_torch()
    yield
    reset_adaptdl_torch()


@pytest.fixture
def agree_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make data loaders agree on every step, as if each step took AGREE_INTERVAL.

    Tests whose steps take microseconds but that check the exact step at which
    a request or a batch-size switch takes effect use it; forked replicas
    inherit the patched module attribute.
    """
    import adaptdl.torch.data as data_module

    monkeypatch.setattr(data_module, "AGREE_INTERVAL", 0.0)
