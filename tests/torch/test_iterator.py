"""AdaptiveBPTTIterator: layout, equal step counts across ranks, resumption."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import adaptdl.torch as adt
from adaptdl import collective, env
from adaptdl.testing import run_elastic
from adaptdl.torch.iterator import AdaptiveBPTTIterator


def test_single_replica_windows_cover_the_stream() -> None:
    tokens = torch.arange(100)
    it = AdaptiveBPTTIterator(tokens, batch_size=4, bptt_len=6)
    rows = math.ceil(100 / 4)
    assert len(it) == math.ceil((rows - 1) / 6)
    texts, targets = [], []
    for _ in adt.remaining_epochs_until(1):
        for text, target in it:
            assert text.shape == target.shape and text.shape[1] == 4
            assert text.shape[0] <= 6
            texts.append(text)
            targets.append(target)
    text = torch.cat(texts)
    target = torch.cat(targets)
    assert len(texts) == len(it)
    # Columns are contiguous pieces of the stream; targets are shifted by one.
    assert torch.equal(text[:, 0], torch.arange(rows - 1))
    assert torch.equal(target[:, 0], torch.arange(1, rows))
    assert torch.equal(text[:, 1], torch.arange(rows, 2 * rows - 1))


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="1-D"):
        AdaptiveBPTTIterator(torch.zeros(3, 3, dtype=torch.long), 2, 2)
    with pytest.raises(TypeError, match="integer"):
        AdaptiveBPTTIterator(torch.zeros(10), 2, 2)
    with pytest.raises(ValueError, match="bptt_len"):
        AdaptiveBPTTIterator(torch.arange(10), 2, 0)
    with pytest.raises(ValueError, match="max_batch_size"):
        AdaptiveBPTTIterator(torch.arange(10), 2, 2, local_bsz_bounds=(1, 4))
    it = AdaptiveBPTTIterator(list(range(50)), 2, 3, max_batch_size=8, local_bsz_bounds=(1, 4))
    assert it._elastic.max_batch_size == 8
    # A stream with no (text, target) pair for any replica count looped over
    # nothing; the docstring promised this error.
    for count in (1, 5, 8):
        with pytest.raises(
            ValueError, match=f"dataset has {count} tokens, too few for batch_size=8"
        ):
            AdaptiveBPTTIterator(torch.arange(count), 8, 3)
    assert len(AdaptiveBPTTIterator(torch.arange(9), 8, 3)) == 1
    # torchtext's Iterator options that mean nothing for a stream are taken.
    it = AdaptiveBPTTIterator(torch.arange(40), 2, 3, repeat=False, shuffle=True, sort=False)
    batch = next(iter(it))
    text, target = batch  # unpacks, and reads as the original's torchtext batches
    assert batch.text is text and batch.target is target
    assert torch.equal(batch.target, batch.text + 1)
    with pytest.raises(ValueError, match="repeat=True: an AdaptDL loop is one pass"):
        AdaptiveBPTTIterator(torch.arange(40), 2, 3, repeat=True)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['sort_key'\]"):
        AdaptiveBPTTIterator(torch.arange(40), 2, 3, sort_key=len)
    # numpy integers are ints here as for batch_size (bptt_len was refused).
    assert AdaptiveBPTTIterator(torch.arange(10), 2, np.int64(3)).bptt_len == 3


def _job(stop: bool) -> Any:
    adt.init_process_group("gloo")
    it = AdaptiveBPTTIterator(torch.arange(960), batch_size=8, bptt_len=5)
    rows = []
    for _ in adt.remaining_epochs_until(1):
        for text, _target in it:
            rows.append((it._elastic.current_index, text.shape[1], int(text[0, 0])))
            if stop and env.num_restarts() == 0 and len(rows) == 4:
                adt.request_checkpoint(exit=True)
    collective.teardown()
    return rows


@pytest.mark.usefixtures("agree_every_step")
def test_ranks_take_equal_steps_and_resume_rescales() -> None:
    result = run_elastic(_job, [2, 3], args=(True,), timeout=60)
    assert result.generations[0].exit_codes == [143, 143]
    ranks = result.final.results
    assert len({len(r) for r in ranks}) == 1  # same number of steps on every rank
    # 3 replicas: local batch ceil(8/3)=3 streams, 320 rows. The first generation
    # (local 4, 240 rows) stopped after 5 steps of 2x5 rows = row 50 of 240, so
    # the resume row is ceil(50 * 320 / 240) = 67.
    assert ranks[0][0][:2] == (67, 3)
    first_rows = [r[0][2] for r in ranks]
    assert first_rows == [67, 72, 77]  # rank r starts bptt_len * r rows later
    uninterrupted = run_elastic(_job, 3, args=(False,), timeout=60).final.results
    assert len(uninterrupted[0]) > len(ranks[0])


def test_a_refused_iterator_or_accumulator_leaves_no_checkpoint_name() -> None:
    # Each refused construction left its state registered: saved in every
    # checkpoint, and later loaders' names shifted by the number of failures.
    from adaptdl import checkpoint
    from adaptdl.torch import Accumulator
    from adaptdl.torch.iterator import AdaptiveBPTTIterator

    def per_object() -> list[str]:
        names = [state.name for state in checkpoint.registered_states()]
        return [name for name in names if name.startswith(("adaptdl-dataloader", "adaptdl-acc"))]

    before = per_object()
    tokens = torch.arange(100)
    for bad in (
        {"dataset": torch.arange(3)},
        {"max_batch_size": 2},
        {"local_bsz_bounds": (1, 8)},
        {"pad_value": "x"},
        {"pad_value": 1.7},
    ):
        with pytest.raises((TypeError, ValueError)):
            AdaptiveBPTTIterator(**{"dataset": tokens, "batch_size": 4, "bptt_len": 2, **bad})
    with pytest.raises(TypeError, match="Accumulator expects initial values as a mapping"):
        Accumulator(5)  # type: ignore[arg-type]
    assert per_object() == before
