"""Profiling accounting, the performance fit, hints, and persistence across restarts."""

from __future__ import annotations

import json
import logging
import math
import time
import types
from typing import Any

import numpy as np
import pytest

from adaptdl import checkpoint, collective, env, goodput
from adaptdl.testing import run_elastic
from adaptdl.torch import _metrics


def _step(atomic_bsz: int, accumulation: bool, sync: float = 0.0) -> None:
    _metrics.profile_step_start(atomic_bsz)
    if sync:
        _metrics.profile_sync_time(sync)
        _metrics.profile_sync_time(sync)
    _metrics.profile_step_commit(accumulation)


def test_profile_accounting_without_accumulation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "2")
    monkeypatch.setenv("ADAPTDL_NUM_NODES", "1")
    for _ in range(3):
        _step(8, False, sync=0.25)
    _step(16, False)
    profile = _metrics._state().profile
    assert set(profile) == {(1, 2, 8), (1, 2, 16)}
    entry = profile[(1, 2, 8)]
    assert entry["optim_count"] == 3 and entry["accum_count"] == 0
    assert entry["optim_sync_time"] == pytest.approx(1.5)
    assert entry["optim_step_time"] >= 0


def test_profile_accounting_with_accumulation() -> None:
    for _ in range(4):
        _step(8, True)
    _step(8, False, sync=0.1)
    entry = _metrics._state().profile[(1, 1, 8)]
    assert entry["accum_count"] == 4 and entry["optim_count"] == 1
    assert entry["optim_sync_time"] == pytest.approx(0.2)
    # A commit without a start does nothing.
    _metrics.profile_step_commit(False)
    assert entry["optim_count"] == 1


@pytest.fixture
def step_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A fake step timer, advanced by hand, so that a busy machine adds no time."""
    clock = [1000.0]
    monkeypatch.setattr(
        _metrics,
        "time",
        types.SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic),
    )
    return clock


def test_step_time_excludes_time_outside_the_step(step_clock: list[float]) -> None:
    _metrics.profile_step_start(4)
    step_clock[0] += 0.05
    _metrics.profile_step_commit(False)
    step_clock[0] += 1.0  # e.g. data loading: not part of any step
    _metrics.profile_step_start(4)
    _metrics.profile_step_commit(False)
    entry = _metrics._state().profile[(1, 1, 4)]
    assert entry["optim_step_time"] == pytest.approx(0.05)


def test_grad_params_are_summed_and_goodput_needs_everything() -> None:
    assert _metrics.get_goodput_fn() is None
    _metrics.set_batch_size(32, 256, (8, 64), False)
    _metrics.update_grad_params("a", 1.0, 2.0)
    _metrics.update_grad_params("b", 0.5, 1.0)
    _metrics.update_grad_params("a", 2.0, 4.0)  # replaces a's previous entry
    _metrics.update_grad_params("c", float("nan"), 1.0)  # ignored
    assert _metrics._grad_params() == goodput.GradParams(2.5, 5.0)
    assert _metrics.get_goodput_fn() is None  # no perf params yet
    _metrics._state().perf_params = goodput.PerfParams(0.1, 0.01, 0.1, 0.01, 0.1, 0.01, 1.0)
    fn = _metrics.get_goodput_fn()
    assert fn is not None and fn.init_batch_size == 32
    # A non-positive signal estimate means "unknown", not "infinite noise scale".
    _metrics.update_grad_params("a", -3.0, 4.0)
    assert _metrics._grad_params() == goodput.GradParams(-2.5, 5.0)
    assert _metrics.get_goodput_fn() is None


@pytest.mark.parametrize("rank", [0, 1])
def test_fit_runs_on_rank0_after_the_interval(
    monkeypatch: pytest.MonkeyPatch, step_clock: list[float], rank: int
) -> None:
    monkeypatch.setenv("ADAPTDL_FIT_INTERVAL", "0")
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", str(rank))
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "2")
    _metrics.set_batch_size(16, 128, None, False)
    for bsz, t in ((8, 0.01), (16, 0.02), (32, 0.04)):
        for _ in range(3):
            _metrics.profile_step_start(bsz)
            step_clock[0] += t
            _metrics.profile_step_commit(False)
    perf = _metrics._state().perf_params
    if rank != 0:
        assert perf is None  # only rank 0 fits
        return
    assert perf is not None
    assert all(math.isfinite(v) for v in perf)
    # The fitted compute time follows the measured 1.25 ms per sample.
    for bsz, t in ((8, 0.01), (16, 0.02), (32, 0.04)):
        assert perf.alpha_c + perf.beta_c * bsz == pytest.approx(t, rel=0.05)
    assert perf.beta_c == pytest.approx(1.25e-3, rel=0.05)


def test_a_step_of_no_samples_is_not_profiled_and_cannot_block_the_fit(
    monkeypatch: pytest.MonkeyPatch, step_clock: list[float]
) -> None:
    # A custom loader may profile before its batch size is decided (0).
    _metrics.profile_step_start(0)
    step_clock[0] += 0.01
    _metrics.profile_step_commit(False)
    assert dict(_metrics._state().profile) == {}
    # An entry of no samples restored from an older checkpoint is skipped.
    _metrics._state().profile[(1, 1, 0)].update(optim_step_time=0.01, optim_count=1)
    for bsz, t in ((8, 0.01), (16, 0.02), (32, 0.04)):
        for _ in range(3):
            _metrics.profile_step_start(bsz)
            step_clock[0] += t
            _metrics.profile_step_commit(False)
    _metrics._fit_perf_params()
    perf = _metrics._state().perf_params
    assert perf is not None
    assert perf.beta_c == pytest.approx(1.25e-3, rel=0.05)


@pytest.mark.parametrize("replicas", [1, 2])
def test_one_replica_has_no_sync_time_in_the_fit(
    monkeypatch: pytest.MonkeyPatch, step_clock: list[float], replicas: int
) -> None:
    # The "sync" window (last gradient to optimizer step) of one replica
    # holds no communication; subtracted from compute, the model predicted
    # its steps ~20x too fast.
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", str(replicas))
    monkeypatch.setenv("ADAPTDL_NUM_NODES", "1")
    for bsz in (8, 16, 32):
        for _ in range(3):
            _metrics.profile_step_start(bsz)
            _metrics.profile_sync_time(0.02)
            step_clock[0] += 0.001 + 1e-4 * bsz + 0.02
            _metrics.profile_step_commit(False)
    _metrics._fit_perf_params()
    perf = _metrics._state().perf_params
    assert perf is not None
    t_acc, t_opt = _model_times(perf, replicas, [8, 16, 32])
    for bsz, measured in zip((8, 16, 32), t_opt):
        assert measured == pytest.approx(0.021 + 1e-4 * bsz, rel=0.05)
    if replicas == 1:
        assert t_acc == pytest.approx(t_opt)  # all of it is compute
    else:
        assert perf.beta_c == pytest.approx(1e-4, rel=0.05)  # the sync is network time


def _model_times(
    perf: goodput.PerfParams, replicas: int, atomic: list[int]
) -> tuple[list[float], list[float]]:
    from adaptdl import _goodput

    ones = np.ones(len(atomic))
    t_acc, t_opt = _goodput.step_times(tuple(perf), ones, ones * replicas, np.array(atomic))
    return t_acc.tolist(), t_opt.tolist()


def test_hints_never_carry_nan() -> None:
    hints = _metrics.get_sched_hints()
    assert hints["perfParams"] is None and hints["gradParams"] is None
    _metrics.set_batch_size(16, 128, (None, 32), True)
    _metrics.update_grad_params("m", 1.0, 3.0)
    _metrics._state().perf_params = goodput.PerfParams(0.1, float("nan"), 0.1, 0.01, 0.1, 0.01, 1.0)
    _step(16, False)
    hints = _metrics.get_sched_hints()
    assert hints["perfParams"] is None  # a NaN field drops the whole model
    assert hints["gradParams"] == {"norm": 1.0, "var": 3.0}
    assert hints["initBatchSize"] == 16 and hints["maxBatchSize"] == 128
    assert hints["localBszBounds"] == [None, 32] and hints["gradientAccumulation"] is True
    assert hints["maxProfiledReplicas"] == 1
    json.dumps(hints, allow_nan=False)


@pytest.mark.parametrize(
    ("sqr", "var", "gamma"),
    [(-0.5, 0.0, 0.5), (2.0, -1.0, 12.0), (0.0, 1e-30, 1.0), (-1e-9, 3.0, 10.0)],
)
def test_hints_are_always_valid_for_the_scheduler(sqr: float, var: float, gamma: float) -> None:
    from adaptdl.sched_hints import GAMMA_RANGE, SchedHints

    _metrics.set_batch_size(16, 128, None, False)
    _metrics.update_grad_params("m", sqr, var)
    _metrics._state().perf_params = goodput.PerfParams(0.1, 0.01, 0.1, 0.01, 0.1, -1e-12, gamma)
    hints = _metrics.get_sched_hints()
    checked = SchedHints.from_json(hints)  # raises ValueError on an invalid field
    assert checked.grad_params is not None and checked.perf_params is not None
    assert checked.grad_params.sqr >= 0 and checked.grad_params.var > 0
    assert GAMMA_RANGE[0] <= checked.perf_params.gamma <= GAMMA_RANGE[1]
    assert checked.perf_params.beta_r == 0.0  # clamped from -1e-12


def test_a_failing_hint_post_never_stops_training(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import adaptdl.sched_hints as sched_hints

    def reject(hints: Any, key: str) -> bool:
        raise ValueError("gradParams.var must be > 0")

    monkeypatch.setattr(sched_hints, "post_sched_hints", reject)
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("ADAPTDL_JOB_ID", "ns/job")
    _metrics._report_sched_hints()
    assert "not posting invalid scheduling hints" in caplog.text


def test_a_malformed_supervisor_url_costs_only_the_hints(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import adaptdl.sched_hints as sched_hints

    posted: list[Any] = []
    monkeypatch.setattr(sched_hints, "post_sched_hints", lambda h, k: posted.append((h, k)))
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", "supervisor:8080")
    monkeypatch.setenv("ADAPTDL_JOB_ID", "ns/job")
    with caplog.at_level(logging.WARNING, logger="adaptdl.torch._metrics"):
        _metrics._report_sched_hints()  # never raises: training goes on
    assert posted == []
    assert "ADAPTDL_SUPERVISOR_URL='supervisor:8080' is invalid" in caplog.text


def test_hints_are_posted_only_with_a_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[Any] = []
    import adaptdl.sched_hints as sched_hints

    monkeypatch.setattr(sched_hints, "post_sched_hints", lambda h, k: posted.append((h, k)))
    _metrics._report_sched_hints()
    assert posted == []
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("ADAPTDL_JOB_ID", "ns/job")
    _metrics._report_sched_hints()
    assert posted and posted[0][1] == "ns/job"


def _persist_job(max_replicas: int) -> Any:
    collective.initialize()
    replicas = env.num_replicas()
    _step(4 * replicas, False, sync=0.01)
    _step(4 * replicas, False, sync=0.01)
    _metrics.update_progress(_metrics.get_progress() + 1.0)
    keys = sorted(_metrics._state().profile)
    progress = _metrics.get_progress()
    checkpoint.save_all_states()
    collective.teardown()
    if replicas < max_replicas:
        return replicas + 1  # restart with one more replica
    return keys, progress


def test_profile_persists_across_restarts_with_1_to_4_replicas() -> None:
    result = run_elastic(_persist_job, 1, args=(4,), timeout=90)
    assert [g.num_replicas for g in result.generations] == [1, 2, 3, 4]
    keys, progress = result.final.results[0]
    assert keys == [(1, 1, 4), (1, 2, 8), (1, 3, 12), (1, 4, 16)]
    assert progress == 4.0
