"""remaining_epochs_until, current_epoch and finished_epochs, in process and across restarts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import adaptdl.torch as adt
from adaptdl import collective, env
from adaptdl.testing import run_elastic


def test_epochs_continue_across_loops() -> None:
    assert adt.current_epoch() is None and adt.finished_epochs() == 0
    seen = []
    for epoch in adt.remaining_epochs_until(3):
        assert adt.current_epoch() == epoch == adt.finished_epochs()
        seen.append(epoch)
    assert seen == [0, 1, 2] and adt.finished_epochs() == 3
    assert list(adt.remaining_epochs_until(5)) == [3, 4]
    assert list(adt.remaining_epochs_until(2)) == []
    assert adt.current_epoch() is None


def test_break_counts_the_epoch_and_nesting_is_rejected() -> None:
    for epoch in adt.remaining_epochs_until(10):
        with pytest.raises(RuntimeError, match="nested"):
            next(adt.remaining_epochs_until(20))
        if epoch == 1:
            break
    assert adt.finished_epochs() == 2


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_invalid_epoch_is_rejected(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="epoch"):
        next(adt.remaining_epochs_until(bad))


def _job() -> Any:
    adt.init_process_group("gloo")
    epochs = []
    for epoch in adt.remaining_epochs_until(10):
        epochs.append(epoch)
        if env.num_restarts() == 0 and epoch == 5:
            # Checkpoint-and-exit from code; acted on at the next epoch boundary.
            adt.request_checkpoint(exit=True)
    collective.teardown()
    return epochs


def test_restart_replays_nothing_after_an_epoch_boundary_exit() -> None:
    result = run_elastic(_job, [1, 2], timeout=60)
    assert result.generations[0].exit_codes == [143]
    # The request was seen at the boundary after epoch 5: the restart goes on at 6.
    assert result.final.results[0] == [6, 7, 8, 9]
    assert result.final.results[1] == [6, 7, 8, 9]


def _mid_epoch_job() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    adt.init_process_group("gloo")
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(20)), batch_size=4)
    epochs = []
    for epoch in adt.remaining_epochs_until(10):
        epochs.append(epoch)
        for i, _ in enumerate(loader):
            if env.num_restarts() == 0 and epoch == 5 and i == 1:
                adt.request_checkpoint(exit=True)
    collective.teardown()
    return epochs


@pytest.mark.usefixtures("agree_every_step")
def test_restart_in_the_middle_of_an_epoch_replays_it() -> None:
    result = run_elastic(_mid_epoch_job, [1, 2], timeout=60)
    assert result.final.results[0] == [5, 6, 7, 8, 9]


def test_target_epoch_is_a_side_effect_free_query() -> None:
    from adaptdl.torch import epoch

    assert epoch.target_epoch() is None
    assert epoch._STATE is None  # asking did not create or register the state
    loop = adt.remaining_epochs_until(4)
    next(loop)
    assert epoch.target_epoch() == 4
    loop.close()
    # Leaving early (break, or an exception) clears it too: it stayed 4, and
    # the scheduler kept hearing of the skipped epochs as work left.
    assert epoch.target_epoch() is None
    for number in adt.remaining_epochs_until(100):
        if number == 2:
            break
    assert epoch.target_epoch() is None
    with pytest.raises(KeyError):
        for _ in adt.remaining_epochs_until(200):
            raise KeyError("boom")
    assert epoch.target_epoch() is None


def test_numpy_integers_are_epoch_numbers() -> None:
    # np.int64 (e.g. from a config array) was refused while batch_size took it.
    assert list(adt.remaining_epochs_until(np.int64(2))) == [0, 1]


def test_checkpoints_drop_the_states_of_finished_epochs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unregistered at the end of their epoch, they were still carried over
    # from checkpoint to checkpoint: 42 files after 20 epochs, growing.
    import torch
    from torch.utils.data import TensorDataset

    from adaptdl import checkpoint

    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    for _ in adt.remaining_epochs_until(6):
        stats = adt.Accumulator()  # made anew every epoch, as the tutorial does
        loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=4)
        for (x,) in loader:
            stats["n"] += len(x)
            adt.request_checkpoint()  # checkpoint-and-continue
        with stats.synchronized():
            pass
    latest = checkpoint.latest_checkpoint()
    assert latest is not None
    assert sorted(os.listdir(latest)) == [
        "adaptdl-accumulator-epoch5-0",
        "adaptdl-dataloader-epoch5-0",
        "adaptdl-epoch",
        "adaptdl-metrics",
    ]
