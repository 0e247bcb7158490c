"""ElasticSampler and AdaptiveDataLoader: partitioning, resumption, batch-size decisions."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import adaptdl.torch as adt
from adaptdl import collective, env
from adaptdl.testing import run_elastic
from adaptdl.torch import _metrics
from adaptdl.torch.data import ElasticSampler, shuffle_seed


def _set_replicas(monkeypatch: pytest.MonkeyPatch, rank: int, replicas: int) -> None:
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", str(rank))
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", str(replicas))


# ----------------------------------------------------------------- sampler
@pytest.mark.parametrize("size", [1, 7, 10, 64])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("index", [0, 3, 13])
def test_sampler_partitions_evenly_and_covers_everything(
    monkeypatch: pytest.MonkeyPatch, size: int, replicas: int, index: int
) -> None:
    dataset = list(range(size))
    shares = []
    for rank in range(replicas):
        _set_replicas(monkeypatch, rank, replicas)
        sampler = ElasticSampler(dataset, shuffle=True)
        sampler.set_epoch(2, index)
        share = list(sampler)
        assert len(share) == len(sampler) == math.ceil((size - index % size) / replicas)
        shares.append(share)
    # Every rank has the same length; together they cover the rest of the pass.
    assert len({len(s) for s in shares}) == 1
    _set_replicas(monkeypatch, 0, 1)
    single = ElasticSampler(dataset, shuffle=True)
    single.set_epoch(2, index)
    remaining = list(single)
    covered = {i for share in shares for i in share}
    assert covered == set(remaining)
    # At most one padded (repeated) sample per rank.
    assert sum(len(s) for s in shares) - len(remaining) < replicas


def test_sampler_shuffle_is_deterministic_per_epoch() -> None:
    dataset = list(range(50))
    a, b = ElasticSampler(dataset), ElasticSampler(dataset)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    b.set_epoch(4)
    assert list(a) != list(b)
    assert sorted(b) == dataset
    # Passes within an epoch differ too (index // len selects the pass).
    b.set_epoch(3, 50)
    assert list(b) != list(a) and sorted(b) == dataset
    unshuffled = ElasticSampler(dataset, shuffle=False)
    unshuffled.set_epoch(7, 5)
    assert list(unshuffled) == dataset[5:]


def test_sampler_resume_continues_the_same_permutation(monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = list(range(30))
    full = ElasticSampler(dataset)
    full.set_epoch(1)
    order = list(full)
    _set_replicas(monkeypatch, 1, 3)
    resumed = ElasticSampler(dataset)
    resumed.set_epoch(1, 12)
    assert list(resumed) == order[13::3]


@pytest.mark.parametrize("size", [7, 37, 64])
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_a_resumed_pass_pads_like_an_uninterrupted_one(
    monkeypatch: pytest.MonkeyPatch, size: int, replicas: int
) -> None:
    # The padding sample depended on the resume point, so a restart at the
    # same replica count trained on another last step than a run without one.
    for rank in range(replicas):
        _set_replicas(monkeypatch, rank, replicas)
        full = ElasticSampler(list(range(size)))
        full.set_epoch(4)
        order = list(full)
        for step in range(1, len(order)):
            resumed = ElasticSampler(list(range(size)))
            resumed.set_epoch(4, step * replicas)
            assert list(resumed) == order[step:], (rank, step)


def test_shuffle_does_not_depend_on_the_hash_seed() -> None:
    code = (
        "from adaptdl.torch.data import ElasticSampler, shuffle_seed;"
        "s = ElasticSampler(list(range(20))); s.set_epoch(5, 40);"
        "print(shuffle_seed(5, 2), list(s))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    sampler = ElasticSampler(list(range(20)))
    sampler.set_epoch(5, 40)
    assert out == f"{shuffle_seed(5, 2)} {list(sampler)}"


def test_sampler_rejects_bad_arguments() -> None:
    sampler = ElasticSampler(list(range(4)))
    with pytest.raises(ValueError, match="index"):
        sampler.set_epoch(0, -1)
    with pytest.raises(TypeError, match="epoch"):
        sampler.set_epoch("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dataset"):
        ElasticSampler(iter(range(3)))  # type: ignore[arg-type]


def test_rejected_set_epoch_changes_nothing() -> None:
    sampler = ElasticSampler(list(range(10)))
    sampler.set_epoch(0, 4)
    before = list(sampler)
    with pytest.raises(ValueError, match="index must be >= 0, got -1"):
        sampler.set_epoch(7, -1)
    assert (sampler.epoch, sampler.index) == (0, 4)
    assert list(sampler) == before


def test_sampler_follows_the_topology_when_iterated(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_replicas(monkeypatch, 0, 1)
    sampler = ElasticSampler(list(range(10)), shuffle=False)
    _set_replicas(monkeypatch, 1, 2)
    assert (sampler.rank, sampler.num_replicas, len(sampler)) == (1, 2, 5)
    assert list(sampler) == [1, 3, 5, 7, 9]


# ----------------------------------------------------------------- loader, in process
def _dataset(size: int) -> TensorDataset:
    return TensorDataset(torch.arange(size))


def test_loader_validates_arguments() -> None:
    dataset = _dataset(10)
    with pytest.raises(ValueError, match="sampler"):
        adt.AdaptiveDataLoader(dataset, batch_size=2, sampler=list(range(10)))
    with pytest.raises(ValueError, match="batch_sampler"):
        adt.AdaptiveDataLoader(dataset, batch_size=2, batch_sampler=[[0, 1]])
    with pytest.raises(ValueError, match="batch_size"):
        adt.AdaptiveDataLoader(dataset, batch_size=0)
    loader = adt.AdaptiveDataLoader(dataset, batch_size=4)
    with pytest.raises(ValueError, match="max_batch_size=2"):
        loader.autoscale_batch_size(2)
    with pytest.raises(ValueError, match=r"batch_size=9007199254740993 must be <= 2\*\*53"):
        adt.AdaptiveDataLoader(dataset, batch_size=2**53 + 1)
    with pytest.raises(ValueError, match=rf"max_batch_size={10**20} .*<= 2\*\*53"):
        loader.autoscale_batch_size(10**20)
    with pytest.raises(ValueError, match=rf"local_bsz_bounds=\(1, {10**20}\): max exceeds 2\*\*53"):
        loader.autoscale_batch_size(16, local_bsz_bounds=(1, 10**20))
    with pytest.raises(ValueError, match="local_bsz_bounds"):
        loader.autoscale_batch_size(16, local_bsz_bounds=(8, 16))
    with pytest.raises(ValueError, match="local_bsz_bounds"):
        loader.autoscale_batch_size(16, local_bsz_bounds=(1, 2))
    with pytest.raises(ValueError, match="min exceeds max"):
        loader.autoscale_batch_size(16, local_bsz_bounds=(5, 3))
    with pytest.raises(TypeError, match="gradient_accumulation"):
        loader.autoscale_batch_size(16, gradient_accumulation="yes")  # type: ignore[arg-type]
    # Bounds of the wrong type are TypeErrors and, as the original documented
    # (and raised), ValueErrors: scripts catching ValueError missed them.
    for args in [(16.0,), (16, (2.5, 8)), (16, 5), (16, (2,))]:
        for kind in (TypeError, ValueError):
            with pytest.raises(kind, match="max_batch_size|local_bsz_bounds"):
                loader.autoscale_batch_size(*args)  # type: ignore[arg-type]
    loader.autoscale_batch_size(16, local_bsz_bounds=(None, 8), gradient_accumulation=True)
    assert loader._elastic.max_batch_size == 16
    assert loader._elastic.local_bsz_bounds == (None, 8)
    assert loader.training


def test_loader_one_pass_and_properties() -> None:
    loader = adt.AdaptiveDataLoader(_dataset(10), batch_size=4, drop_last=False)
    assert adt.current_dataloader() is None
    seen = []
    for epoch in adt.remaining_epochs_until(1):
        assert epoch == 0
        for (batch,) in loader:
            helper = adt.current_dataloader()
            assert helper is loader._elastic
            assert loader.current_local_bsz == 4 and loader.current_batch_size == 4
            assert helper.is_optim_step() and not helper.is_accum_step()
            seen.extend(batch.tolist())
    assert sorted(seen) == list(range(10))
    assert loader.current_local_bsz is None
    assert adt.current_dataloader() is None


def test_max_batch_size_and_current_index_are_none_when_not_applicable() -> None:
    loader = adt.AdaptiveDataLoader(_dataset(6), batch_size=2)
    helper = loader._elastic
    # No autoscaling configured: no maximum batch size (not B0).
    assert helper.max_batch_size is None and not helper.autoscaling
    # Not being iterated: no position (not 0).
    assert helper.current_index is None
    assert [helper.current_index for _ in loader] == [0, 2, 4]
    assert helper.current_index is None
    loader.autoscale_batch_size(2)  # enabled, though it cannot grow
    assert helper.max_batch_size == 2 and not helper.autoscaling


def test_nested_iteration_and_creation_are_rejected() -> None:
    a = adt.AdaptiveDataLoader(_dataset(4), batch_size=2)
    b = adt.AdaptiveDataLoader(_dataset(4), batch_size=2)
    for _ in a:
        with pytest.raises(RuntimeError, match="already being iterated"):
            next(iter(b))
        with pytest.raises(RuntimeError, match="cannot be created"):
            adt.AdaptiveDataLoader(_dataset(4), batch_size=2)
        with pytest.raises(RuntimeError, match="cannot be created"):
            adt.Accumulator()
        break
    assert adt.current_dataloader() is None


def test_break_and_reiterate() -> None:
    loader = adt.AdaptiveDataLoader(_dataset(12), batch_size=3, shuffle=True)
    for _ in adt.remaining_epochs_until(1):
        first = []
        for i, (batch,) in enumerate(loader):
            first.extend(batch.tolist())
            if i == 1:
                break
        assert adt.current_dataloader() is None
        second = [x for (batch,) in loader for x in batch.tolist()]
        # A broken loop does not resume: the next loop is a complete pass.
        assert sorted(second) == list(range(12))
        assert len(first) == 6


def test_worker_processes_get_rank_dependent_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptdl.torch.data import _WorkerInit

    calls = []
    init0 = _WorkerInit(2, calls.append)
    init1 = _WorkerInit(2, None)
    _set_replicas(monkeypatch, 0, 2)
    torch.manual_seed(5)
    init0(0)
    a = torch.rand(1).item()
    # The rank is read when the worker starts, not when the loader was made.
    _set_replicas(monkeypatch, 1, 2)
    torch.manual_seed(5)
    init1(0)
    b = torch.rand(1).item()
    assert a != b and calls == [0]


class _FakeGoodput:
    """A goodput model whose best configuration is set by the test."""

    def __init__(self, best: tuple[int, int], values: dict[tuple[int, int], float]):
        self.best = best
        self.values = values

    def optimize(self, *args: Any, **kwargs: Any) -> tuple[float, int, int]:
        return self.values[self.best], self.best[0], self.best[1]

    def evaluate(self, nodes: int, replicas: int, local: int, accum: int) -> float:
        return self.values[(local, accum)]


def test_decisions_follow_goodput_with_hysteresis(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = adt.AdaptiveDataLoader(_dataset(64), batch_size=4)
    helper = loader._elastic
    assert helper._decide() == (4, 0)  # not training: no autoscaling
    loader.autoscale_batch_size(32)
    assert helper._decide() == (4, 0)  # no model yet
    values = {(4, 0): 1.0, (8, 0): 1.04, (16, 0): 1.5}
    fake = _FakeGoodput((8, 0), values)
    monkeypatch.setattr(_metrics, "get_goodput_fn", lambda: fake)
    # First decision (nothing adopted yet): take the optimum unconditionally.
    assert helper._decide() == (8, 0)
    helper._adopt((4, 0))
    # 4% better is below the 5% threshold: keep the current choice.
    assert helper._decide() == (4, 0)
    fake.best = (16, 0)
    assert helper._decide() == (16, 0)


# ----------------------------------------------------------------- multi-process
def _restart_job(sizes: list[int]) -> Any:
    """Check local batch sizes ceil(10/K); stop mid-epoch; return the next size."""
    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    replicas = env.num_replicas()
    loader = adt.AdaptiveDataLoader(_dataset(100), batch_size=10, shuffle=True)
    seen: list[tuple[int, int, list[int]]] = []
    log = Path(env.share_path() or "", f"gen{env.num_restarts()}-rank{env.replica_rank()}.json")
    for epoch in adt.remaining_epochs_until(3):
        for (batch,) in loader:
            assert loader.current_local_bsz == math.ceil(10 / replicas)
            assert len(batch) <= math.ceil(10 / replicas)
            seen.append((epoch, loader._elastic.current_index, [int(x) for x in batch]))
            # A checkpoint exit returns nothing: the share directory keeps what was seen.
            log.write_text(json.dumps(seen))
            if env.num_restarts() < len(sizes) and loader._elastic.current_index >= 40:
                adt.request_checkpoint(exit=True)
    collective.teardown()
    return seen


@pytest.mark.usefixtures("agree_every_step")
def test_loader_restarts_across_replica_counts() -> None:
    result = run_elastic(_restart_job, [1, 4, 2], args=([4, 2],), timeout=120)
    assert [g.num_replicas for g in result.generations] == [1, 4, 2]
    assert result.generations[0].exit_codes == [143]
    assert result.generations[1].exit_codes == [143] * 4
    # The last generation resumed epoch 0 after the position the 4 replicas reached.
    final = result.final.results[0]
    assert final[0][0] == 0 and final[0][1] >= 40
    assert {epoch for epoch, _, _ in final} == {0, 1, 2}
    # Each generation starts where the previous one stopped, and epoch 0
    # over all generations and replicas covers every sample once (the
    # sampler pads the last batch only).
    share = Path(result.share_dir)
    seen = [
        [json.loads((share / f"gen{g}-rank{r}.json").read_text()) for r in range(gen.num_replicas)]
        for g, gen in enumerate(result.generations)
    ]
    assert seen[2][0] == [list(row) for row in final]
    stops = [max(i for e, i, _ in gen[0] if e == 0) for gen in seen[:2]]
    starts = [min(i for e, i, _ in gen[0] if e == 0) for gen in seen[1:]]
    # The index recorded with a batch is where it began, and the step of
    # that batch (the last before the exit) was still taken: K * ceil(10 / K).
    assert starts == [stops[0] + 10, stops[1] + 12]
    epoch0 = [
        x for gen in seen for report in gen for e, _, batch in report if e == 0 for x in batch
    ]
    assert set(epoch0) == set(range(100))
    assert len(epoch0) < 100 + 2  # at most one padded sample (2 replicas, 100 samples)


def _loops_outside_epochs_job(interrupt: bool) -> Any:
    """Two shuffled loops without remaining_epochs_until; interrupted in the second."""
    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    loader = adt.AdaptiveDataLoader(_dataset(20), batch_size=4, shuffle=True)
    batches: list[list[int]] = []
    loops = 1 if env.num_restarts() else 2  # after the restart: only the resumed loop
    for _ in range(loops):
        batches.append([])
        for (batch,) in loader:
            batches[-1].extend(int(x) for x in batch)
            first_run = interrupt and env.num_restarts() == 0
            if first_run and len(batches) == 2 and len(batches[-1]) == 8:
                adt.request_checkpoint(exit=True)
    collective.teardown()
    return batches


@pytest.mark.usefixtures("agree_every_step")
def test_loop_outside_epochs_resumes_with_the_same_shuffle() -> None:
    interrupted = run_elastic(_loops_outside_epochs_job, [1, 1], args=(True,), timeout=120)
    before = interrupted.generations[0]
    assert before.exit_codes == [143]
    resumed = interrupted.final.results[0][0]
    # A reference run that is never interrupted sees the same second loop.
    reference = run_elastic(_loops_outside_epochs_job, 1, args=(False,), timeout=120)
    full_second_loop = reference.final.results[0][1]
    assert sorted(full_second_loop) == list(range(20))
    assert resumed == full_second_loop[len(full_second_loop) - len(resumed) :]
    assert len(resumed) == 20 - 8 - 4  # one more batch ran before the agreed stop


def _before_and_after_epochs_job(interrupt: bool) -> Any:
    """One loader iterated before the epoch loop, in it, and after it."""
    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    loader = adt.AdaptiveDataLoader(_dataset(20), batch_size=4, shuffle=True)
    before = [int(x) for (batch,) in loader for x in batch]
    for _ in adt.remaining_epochs_until(2):
        for _batch in loader:
            pass
    after: list[int] = []
    for (batch,) in loader:
        after.extend(int(x) for x in batch)
        if interrupt and env.num_restarts() == 0 and len(after) == 8:
            adt.request_checkpoint(exit=True)
    collective.teardown()
    return before, after


@pytest.mark.usefixtures("agree_every_step")
def test_a_loop_after_the_epoch_loop_resumes_itself_not_the_loop_before() -> None:
    interrupted = run_elastic(_before_and_after_epochs_job, [1, 2], args=(True,), timeout=120)
    assert interrupted.generations[0].exit_codes == [143]
    reference = run_elastic(_before_and_after_epochs_job, 1, args=(False,), timeout=120)
    _, full_after = reference.final.results[0]
    assert sorted(full_after) == list(range(20))
    # Code outside epoch loops runs again: the loop before the epochs makes a
    # whole pass (it used to resume at the position saved in the loop after).
    before, resumed = interrupted.final.results[0]
    before_rank1, resumed_rank1 = interrupted.final.results[1]
    assert sorted(before + before_rank1) == list(range(20))
    # The interrupted loop continues where it stopped, with the same shuffle.
    done = 8 + 4  # one more batch ran before the agreed stop
    assert sorted(resumed + resumed_rank1) == sorted(full_after[done:])


def _two_loaders_after_epochs_job(interrupt: bool) -> Any:
    """A validation pass, then a shuffled test pass interrupted by a checkpoint."""
    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    val = adt.AdaptiveDataLoader(_dataset(8), batch_size=4)
    test = adt.AdaptiveDataLoader(_dataset(20), batch_size=4, shuffle=True)
    for _ in adt.remaining_epochs_until(1):
        pass
    for _batch in val:
        pass
    seen: list[int] = []
    for (batch,) in test:
        seen.extend(int(x) for x in batch)
        if interrupt and env.num_restarts() == 0 and len(seen) == 8:
            adt.request_checkpoint(exit=True)
    collective.teardown()
    return seen


@pytest.mark.usefixtures("agree_every_step")
def test_the_second_loader_after_the_epochs_resumes_with_its_shuffle() -> None:
    # The validation loader runs again first after the restart; that must not
    # move the test loader's loop count (and so its position and shuffle).
    interrupted = run_elastic(_two_loaders_after_epochs_job, [1, 1], args=(True,), timeout=120)
    assert interrupted.generations[0].exit_codes == [143]
    full = run_elastic(_two_loaders_after_epochs_job, 1, args=(False,), timeout=120)
    full_pass = full.final.results[0]
    assert sorted(full_pass) == list(range(20))
    assert interrupted.final.results[0] == full_pass[12:]


def _autoscaled_outside_job(interrupt: bool, log_dir: str) -> None:
    """An autoscaled loop outside epochs that lasts several passes; logs each batch."""
    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    loader = adt.AdaptiveDataLoader(_dataset(20), batch_size=4, shuffle=True)
    loader.autoscale_batch_size(64)
    generation = env.num_restarts()
    with open(os.path.join(log_dir, f"{generation}.jsonl"), "a") as log:
        for step, (batch,) in enumerate(loader):
            # A quarter of a B0 step of progress each: the loop lasts 4 passes.
            _metrics.update_progress(_metrics.get_progress() + 0.25)
            log.write(json.dumps(batch.tolist()) + "\n")
            log.flush()  # the checkpoint exit does not return here
            if interrupt and generation == 0 and step == 7:
                adt.request_checkpoint(exit=True)
    collective.teardown()


def _logged(log_dir: Path) -> list[list[int]]:
    return [
        json.loads(line)
        for name in sorted(os.listdir(log_dir))
        for line in (log_dir / name).read_text().splitlines()
    ]


@pytest.mark.usefixtures("agree_every_step")
def test_an_autoscaled_loop_outside_epochs_ends_where_it_would_have(tmp_path: Path) -> None:
    # Its progress target is relative to its start; a resumed loop used to
    # take a whole loop's progress again (30 steps instead of 20).
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    full.mkdir()
    interrupted.mkdir()
    run_elastic(_autoscaled_outside_job, 1, args=(False, str(full)), timeout=60)
    run_elastic(_autoscaled_outside_job, [1, 1], args=(True, str(interrupted)), timeout=60)
    assert len(_logged(full)) == 20
    assert _logged(interrupted) == _logged(full)


def test_a_mid_loop_position_from_an_older_checkpoint_resumes_the_first_unfinished_loop() -> None:
    import io
    import pickle

    from adaptdl.torch.data import _LoaderState

    # The format before the resume map: the position alone, for whichever loop.
    old = {"current_index": 8, "end_index": 20, "last_position": {None: 0}}
    restored = _LoaderState("restored-old-loader-state")
    restored.load(io.BytesIO(pickle.dumps(old)))
    # Its shuffle was seeded with the running count of loops outside epochs.
    assert restored.legacy == {"index": 8, "end": 20, "seed": 1}
    assert restored.last_position == {-1: 0}
    # Saved again before it is used, it keeps the position.
    buffer = io.BytesIO()
    restored.save(buffer)
    again = _LoaderState("restored-again")
    again.load(io.BytesIO(buffer.getvalue()))
    assert again.legacy == {"index": 8, "end": 20, "seed": 1} and again.resume == {}


def _switch_job() -> Any:
    """Autoscaling with a scripted goodput model: all replicas switch at one step."""
    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    loader = adt.AdaptiveDataLoader(_dataset(240), batch_size=8, shuffle=True)
    loader.autoscale_batch_size(64)
    fake = _FakeGoodput((4, 0), {(4, 0): 1.0, (8, 0): 2.0, (16, 0): 4.0})
    _metrics.get_goodput_fn = lambda: fake  # type: ignore[assignment]
    steps = []
    samples = []
    for _ in adt.remaining_epochs_until(1):
        for i, (batch,) in enumerate(loader):
            steps.append(loader.current_local_bsz)
            samples.extend(batch.tolist())
            if i == 3:
                fake.best = (8, 0)
            if i == 8:
                fake.best = (16, 0)
    collective.teardown()
    return steps, samples


@pytest.mark.usefixtures("agree_every_step")
def test_midpass_switch_happens_on_the_same_step_everywhere() -> None:
    result = run_elastic(_switch_job, 2, env={"ADAPTDL_DECIDE_INTERVAL": "0"}, timeout=120)
    (steps0, samples0), (steps1, samples1) = result.final.results
    assert steps0 == steps1
    assert steps0[0] == 4 and 8 in steps0 and steps0[-1] == 16
    # Still exactly one pass over the data, despite two mid-pass switches.
    assert sorted(samples0 + samples1) == list(range(240))


def _target_step_job(stop_step: int) -> Any:
    """An autoscaled loop (kept at B0 by its goodput model) asked to checkpoint near its end."""
    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    data = torch.utils.data.TensorDataset(
        torch.randn(100, 3, generator=torch.Generator().manual_seed(0))
    )
    loader = adt.AdaptiveDataLoader(data, batch_size=8, drop_last=True)
    loader.autoscale_batch_size(64, local_bsz_bounds=(1, 8))
    fake = _FakeGoodput((8, 0), {(8, 0): 1.0})
    _metrics.get_goodput_fn = lambda: fake  # type: ignore[assignment]
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    adp = adt.AdaptiveDataParallel(model, optimizer)
    steps = []
    for epoch in adt.remaining_epochs_until(2):
        for (x,) in loader:
            steps.append((epoch, loader._elastic.current_index))
            adp(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if env.num_restarts() == 0 and len(steps) == stop_step:
                adt.request_checkpoint(exit=True)
    collective.teardown()
    return steps, _metrics.get_progress()


@pytest.mark.usefixtures("agree_every_step")
def test_a_checkpoint_where_an_autoscaled_loop_ends_resumes_after_that_loop() -> None:
    # Asked at step 13, the checkpoint lands with the agreement of step 14,
    # the loop's last. The checkpoint was acted on first, so the restarted
    # loop resumed at index 116, took a 15th step, and epoch 1 one fewer.
    steps, progress = run_elastic(_target_step_job, 1, args=(-1,), timeout=120).final.results[0]
    assert [index for epoch, index in steps if epoch == 0][-2:] == [100, 108]
    restarted = run_elastic(_target_step_job, [1, 1], args=(13,), timeout=120)
    assert restarted.generations[0].exit_codes == [143]
    after, progress_after = restarted.final.results[0]
    assert after == [step for step in steps if step[0] == 1]  # epoch 0 was over
    assert progress_after == progress


def test_loader_state_keeps_the_batch_size_decision() -> None:
    import io

    from adaptdl.torch.data import _LoaderState

    loader = adt.AdaptiveDataLoader(_dataset(16), batch_size=4)
    helper = loader._elastic
    helper._adopt((8, 2))
    helper._state.last_position[3] = 1
    buffer = io.BytesIO()
    helper._state.save(buffer)
    buffer.seek(0)
    restored = _LoaderState("restored-loader-state")
    restored.load(buffer)
    assert (restored.local_bsz, restored.accum_steps, restored.num_replicas) == (8, 2, 1)
    assert restored.last_position == {3: 1}
    assert helper.current_batch_size == 8 * 3


# ----------------------------------------------------------------- remaining work
@pytest.mark.parametrize(
    ("batch_size", "expected"),
    [
        # 100 samples at B0 = 10 is 10 steps per epoch; 3 epochs are 30 in all.
        (10, [20.0, 10.0, 0.0]),
        # At B0 = 32 a pass takes 4 steps, not 3.125: N / B0 until an epoch
        # has finished, then the measured progress per epoch.
        (32, [3 * 100 / 32 - 4, 4.0, 0.0]),
    ],
)
def test_training_loader_reports_remaining_iterations(
    batch_size: int, expected: list[float]
) -> None:
    from adaptdl.torch.parallel import AdaptiveDataParallel
    from tests.torch._adp_helpers import local_group

    def remaining() -> Any:
        return _metrics.get_sched_hints()["remainingIterations"]

    with local_group():
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        adp = AdaptiveDataParallel(model, optimizer, name="remaining")
        loader = adt.AdaptiveDataLoader(_dataset(100), batch_size=batch_size)
        assert remaining() is None
        reported = []
        for _ in adt.remaining_epochs_until(3):
            for (batch,) in loader:
                optimizer.zero_grad()
                adp(batch.float()[:, None] / 100).square().mean().backward()
                optimizer.step()
            reported.append(remaining())
        assert reported == pytest.approx(expected)
        assert remaining() is None  # after the loop the work left is unknown
        # A later, longer loop: 2 more epochs.
        epochs = adt.remaining_epochs_until(5)
        next(epochs)
        assert remaining() == pytest.approx(2 * (10.0 if batch_size == 10 else 4.0))
        epochs.close()


class _CustomLoader(adt.AdaptiveDataLoaderMixin):
    """A custom loader written against the documented helper API only."""

    def __init__(self, data: torch.Tensor, batch_size: int) -> None:
        super().__init__(batch_size)
        self.data = data

    def __iter__(self) -> Any:
        helper = self._elastic
        with helper.context():
            if helper.skipdone():
                return
            replicas, rank = env.num_replicas(), env.replica_rank()
            local = math.ceil(helper.batch_size / replicas)
            while helper.current_index < len(self.data):
                start = helper.current_index + rank * local
                with helper.profile(helper.training):
                    yield self.data[start : start + local]
                    helper.current_index += replicas * local


def _custom_loader_job() -> Any:
    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    loader = _CustomLoader(torch.arange(400), batch_size=4)
    seen: list[tuple[int, int]] = []
    for epoch in adt.remaining_epochs_until(2):
        for step, batch in enumerate(loader):
            seen.extend((epoch, int(x)) for x in batch)
            if env.num_restarts() == 0 and epoch == 0 and step == 3:
                adt.request_checkpoint(exit=True)
    collective.teardown()
    return seen


@pytest.mark.usefixtures("agree_every_step")
def test_custom_loader_profile_acts_on_a_checkpoint_request() -> None:
    # profile() alone (no private loader hooks) must checkpoint and exit at
    # the agreed step, and the restart must resume right after it.
    result = run_elastic(_custom_loader_job, [2, 2], timeout=120)
    first, second = result.generations
    assert first.exit_codes == [143, 143]
    assert second.exit_codes == [0, 0]
    before = sorted(x for part in first.results if part for _, x in part)
    after = [pair for part in result.final.results for pair in part]
    epoch0 = sorted(x for epoch, x in after if epoch == 0)
    epoch1 = sorted(x for epoch, x in after if epoch == 1)
    assert epoch1 == list(range(400))
    # Steps 0-3 ran, and step 4 too: the request reaches the agreement of the next step.
    assert epoch0 == list(range(20, 400))
    assert before == []  # the first generation returns nothing: it exited


def _autoscaled_epochs_job() -> Any:
    """Fast steps, so agreements are MAX_AGREE_STEPS apart unless capped."""
    import torch.nn.functional as F

    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(600, 5, generator=generator)
    dataset = TensorDataset(inputs, inputs[:, :2].argmax(1))
    loader = adt.AdaptiveDataLoader(dataset, batch_size=16, drop_last=True)
    loader.autoscale_batch_size(256, local_bsz_bounds=(16, 16))
    model = torch.nn.Linear(5, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = adt.AdaptiveDataParallel(model, optimizer)
    steps = []
    for _ in adt.remaining_epochs_until(3):
        steps.append(0)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps[-1] += 1
    collective.teardown()
    return steps, _metrics.get_progress()


def test_autoscaled_loop_ends_near_its_progress_target(monkeypatch: pytest.MonkeyPatch) -> None:
    import adaptdl.torch.data as data_module

    # Agreements as rare as allowed: every MAX_AGREE_STEPS (200) steps.
    monkeypatch.setattr(data_module, "AGREE_INTERVAL", 1e6)
    steps, progress = run_elastic(_autoscaled_epochs_job, 1, timeout=120).final.results[0]
    # One epoch is one pass at batch 16: 600 / 16 = 37.5 steps of progress
    # (a pass is 37 steps with drop_last). Without the cap the first epoch ran
    # two whole passes (74 steps); now each ends within two steps of the target.
    assert all(37 <= count <= 40 for count in steps), steps
    assert 3 * 37.5 <= progress <= 3 * 37.5 + 3


def _empty_tail_job(interrupt: bool) -> Any:
    """An autoscaled drop_last loop checkpointed after the last full batch of a pass."""
    import torch.nn.functional as F

    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(250, 4, generator=generator)
    dataset = TensorDataset(inputs, inputs.sum(1, keepdim=True))
    loader = adt.AdaptiveDataLoader(dataset, batch_size=8, shuffle=True, drop_last=True)
    loader.autoscale_batch_size(128, local_bsz_bounds=(None, 16))
    fake = _FakeGoodput((16, 0), {(8, 0): 1.0, (16, 0): 2.0})
    _metrics.get_goodput_fn = lambda: fake  # type: ignore[assignment]
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = adt.AdaptiveDataParallel(model, optimizer)
    steps = 0
    for _ in adt.remaining_epochs_until(1):
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            steps += 1
            # The request takes effect after the next step: 15 batches of 16
            # leave 10 samples, fewer than one batch, which drop_last drops.
            if interrupt and env.num_restarts() == 0 and steps == 14:
                adt.request_checkpoint(exit=True)
    collective.teardown()
    return steps, _metrics.get_progress()


@pytest.mark.usefixtures("agree_every_step")
def test_an_autoscaled_loop_resumed_at_an_empty_tail_still_reaches_its_target() -> None:
    # The resumed stretch yielded no batch, which read as "nothing reports
    # progress": the epoch ended at 17.6 of its 31.25 steps of progress.
    reference = run_elastic(_empty_tail_job, 1, args=(False,), timeout=120)
    ref_steps, ref_progress = reference.final.results[0]
    assert ref_progress >= 250 / 8 and ref_steps > 15  # a second pass was needed
    interrupted = run_elastic(_empty_tail_job, [1, 1], args=(True,), timeout=120)
    assert interrupted.generations[0].exit_codes == [143]
    steps, progress = interrupted.final.results[0]
    assert 15 + steps == ref_steps
    assert progress == pytest.approx(ref_progress)


def test_sampler_topology_can_be_assigned(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_replicas(monkeypatch, 0, 1)
    sampler = ElasticSampler(list(range(10)), shuffle=False)
    sampler.num_replicas = 2
    sampler.rank = 1
    assert list(sampler) == [1, 3, 5, 7, 9] and len(sampler) == 5
    sampler.rank = 2
    with pytest.raises(ValueError, match="rank=2 must be below num_replicas=2"):
        list(sampler)
    with pytest.raises(ValueError, match="num_replicas"):
        sampler.num_replicas = 0
    # The environment's rank is checked against the assigned count.
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", "2")
    fresh = ElasticSampler(list(range(8)), shuffle=False)
    fresh.num_replicas = 4
    assert list(fresh) == [2, 6]


def _batch_size_job() -> Any:
    adt.init_process_group("gloo")
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(66)), batch_size=64)
    # A whole pass: leaving the loop early would leave the replicas' step
    # agreements unmatched when one of them tears the collective down.
    sizes = [len(x) for (x,) in loader]
    collective.teardown()
    return [loader.batch_size, sizes[0]]


def test_loader_batch_size_is_the_global_one_whatever_the_replica_count() -> None:
    # As in the original (LEGWScale's warm-up reads it); replicas load their share.
    for replicas, local in ((1, 64), (3, 22)):
        result = run_elastic(_batch_size_job, replicas, timeout=60)
        assert result.final.results == [[64, local]] * replicas


def _len_after_restart_job() -> list[tuple[int, int, int, int]]:
    """Per epoch: (restart, epoch, len(loader) before its loop, steps taken)."""
    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    restart = env.num_restarts()
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(40)), batch_size=4)
    rows = []
    for epoch in adt.remaining_epochs_until(3):
        before, steps = len(loader), 0
        for _ in loader:
            steps += 1
            if restart == 0 and steps == 3:
                adt.request_checkpoint(exit=True)
        rows.append((restart, epoch, before, steps))
    collective.teardown()
    return rows


@pytest.mark.usefixtures("agree_every_step")
def test_len_counts_a_whole_pass_in_the_epochs_after_a_resumed_one() -> None:
    # It counted from the resume point of the pass before: 6 instead of 10.
    result = run_elastic(_len_after_restart_job, [1, 1], timeout=120)
    assert result.final.results[0] == [(1, 0, 10, 6), (1, 1, 10, 10), (1, 2, 10, 10)]


def test_a_refused_nested_loop_leaves_the_running_ones_length_alone() -> None:
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(40)), batch_size=4)
    running = iter(loader)
    next(running)
    loader.sampler.index = 20  # as in a pass a restart resumed half-way
    with pytest.raises(RuntimeError, match="already being iterated"):
        next(iter(loader))
    assert len(loader) == 5  # what is left of the resumed pass, not a whole one
    running.close()
    assert len(loader) == 10


def test_len_counts_this_replicas_steps_before_the_first_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "2")
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(100)), batch_size=10)
    assert loader.batch_size == 10
    assert len(loader) == 10  # 50 samples of this replica, 5 per step


def test_to_tensorboard_groups_the_tags_under_the_prefix() -> None:
    # As the original does, a "/" ends a prefix that lacks one; an earlier
    # change prepended it as given, renaming existing dashboards' tags.
    scalars: dict[str, float] = {}

    class Writer:
        def add_scalar(self, tag: str, value: float, step: int) -> None:
            scalars[tag] = value

    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=4)
    names = ["Accumulation_Steps", "Local_Batch_Size", "Total_Batch_Size"]
    for prefix, expected in [("adaptdl", "adaptdl/"), ("Train/", "Train/"), ("", "")]:
        scalars.clear()
        loader.to_tensorboard(Writer(), 0, tag_prefix=prefix)
        assert sorted(scalars) == [expected + name for name in names]
    with pytest.raises(TypeError, match="tag_prefix must be a str"):
        loader.to_tensorboard(Writer(), 0, tag_prefix=None)  # type: ignore[arg-type]


def test_numpy_booleans_are_accepted_where_a_bool_is() -> None:
    loader = adt.AdaptiveDataLoader(
        TensorDataset(torch.arange(8)), batch_size=4, shuffle=np.bool_(True)
    )
    assert loader.sampler.shuffle is True  # type: ignore[attr-defined]
    loader.autoscale_batch_size(8, gradient_accumulation=np.bool_(False))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shuffle must be a bool"):
        adt.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=4, shuffle=1)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("abc", TypeError, "num_workers must be an int, got str: 'abc'"),
        (1.5, TypeError, "num_workers must be an int, got float: 1.5"),  # failed at iteration
        (-1, ValueError, "num_workers must be >= 0, got -1"),
    ],
)
def test_num_workers_is_checked_by_name(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        adt.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=4, num_workers=value)


def test_an_iterable_dataset_is_refused_by_name() -> None:
    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(10))

        def __len__(self) -> int:
            return 10

    # torch's own error blamed a sampler option the user never passed.
    with pytest.raises(TypeError, match="dataset=Stream: .*IterableDataset is not supported"):
        adt.AdaptiveDataLoader(Stream(), batch_size=2)


def test_a_loader_kept_past_the_epoch_it_was_created_in_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its state left the checkpoints when that epoch ended: a restart in a
    # later epoch silently replayed the samples already trained on.
    kept = accumulator = None
    before = adt.AdaptiveDataLoader(_dataset(8), batch_size=4)
    with caplog.at_level("WARNING", logger="adaptdl.torch.epoch"):
        for _ in adt.remaining_epochs_until(3):
            if kept is None:
                kept = adt.AdaptiveDataLoader(_dataset(8), batch_size=4)
            fresh = adt.AdaptiveDataLoader(_dataset(8), batch_size=4)
            for loader in (before, kept, fresh):
                assert sum(len(batch) for (batch,) in loader) == 8
            if accumulator is None:
                accumulator = adt.Accumulator()
            with accumulator.synchronized():
                pass
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages  # once per object, not once per epoch
    assert messages[0].startswith("an AdaptiveDataLoader was created inside epoch 0 and is ")
    assert "used in epoch 1: checkpoints no longer save its state" in messages[0]
    assert messages[1].startswith("an Accumulator was created inside epoch 0")
