"""SIGINT/SIGTERM handling: lazy installation, agreement across replicas, exit 143."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import adaptdl.torch as adt
from adaptdl import checkpoint, collective, env
from adaptdl.testing import run_elastic
from adaptdl.torch import _signal


def test_handlers_are_installed_lazily_and_once() -> None:
    before = signal.getsignal(signal.SIGTERM)
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    assert signal.getsignal(signal.SIGTERM) is before  # creating a loader changes nothing
    for _ in loader:
        break
    assert signal.getsignal(signal.SIGTERM) is _signal._handler
    assert _signal.install_handlers() is True


def test_no_handlers_outside_the_main_thread() -> None:
    results = []
    thread = threading.Thread(target=lambda: results.append(_signal.install_handlers()))
    thread.start()
    thread.join()
    assert results == [False]
    assert signal.getsignal(signal.SIGTERM) is not _signal._handler


def test_second_sigint_forces_exit() -> None:
    _signal.install_handlers()
    os.kill(os.getpid(), signal.SIGINT)
    assert _signal.get_exit_flag()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_request_checkpoint_validates_and_sets_bits() -> None:
    with pytest.raises(TypeError, match="exit"):
        adt.request_checkpoint(exit="yes")  # type: ignore[arg-type]
    adt.request_checkpoint()
    assert _signal.get_flags() == _signal.FLAG_CHECKPOINT
    _signal.clear_checkpoint_request()
    adt.request_checkpoint(exit=True)
    assert _signal.get_flags() == _signal.FLAG_EXIT


def test_checkpoint_and_continue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    steps = 0
    for _ in adt.remaining_epochs_until(2):
        for _ in loader:
            steps += 1
            if steps == 2:
                adt.request_checkpoint()
                assert checkpoint.latest_checkpoint() is None
    assert steps == 8  # kept training
    assert checkpoint.latest_checkpoint() is not None
    assert _signal.get_flags() == 0


def _job() -> Any:
    adt.init_process_group("gloo")
    rank = env.replica_rank()
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(400)), batch_size=4)
    log = Path(env.share_path() or "") / f"steps-g{env.num_restarts()}-r{rank}.json"
    steps = []
    for _epoch in adt.remaining_epochs_until(1):
        for _ in loader:
            steps.append(loader._elastic.current_index)
            log.write_text(json.dumps(steps))
            if env.num_restarts() == 0 and rank == 1 and len(steps) == 3:
                os.kill(os.getpid(), signal.SIGTERM)
    collective.teardown()
    return steps


def test_sigterm_on_one_replica_stops_all_at_the_same_step() -> None:
    result = run_elastic(_job, [2, 2], timeout=60)
    assert result.generations[0].exit_codes == [143, 143]
    share = Path(result.share_dir)
    first = [json.loads((share / f"steps-g0-r{r}.json").read_text()) for r in (0, 1)]
    assert first[0] == first[1] and len(first[0]) == 4  # acted on one step later
    resumed = result.final.results[0]
    # The restart resumes right after the last step before the exit.
    assert resumed[0] == first[0][-1] + 4
