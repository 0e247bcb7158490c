"""Optimus + oracle: greedy GPU allocation by marginal gain."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from adaptdl.sched import JobInfo, NodeInfo, OptimusPolicy, get_policy, linear_speedup


def _nodes(count: int = 2, gpus: int = 4) -> dict[str, NodeInfo]:
    return {f"n{i}": NodeInfo(resources={"gpu": gpus}) for i in range(count)}


def _job(step: Callable[[int], float], remaining: float, cap: int = 64, t: float = 0.0) -> JobInfo:
    return JobInfo(
        resources={"gpu": 1},
        speedup_fn=linear_speedup,
        submission_time=t,
        max_replicas=cap,
        step_time_fn=step,
        remaining_iterations=remaining,
    )


def _amdahl(serial: float) -> Callable[[int], float]:
    return lambda r: serial + (1.0 - serial) / r


def test_registered() -> None:
    assert isinstance(get_policy("optimus"), OptimusPolicy)


def test_one_gpu_each_then_largest_marginal_gain() -> None:
    jobs = {
        "scalable": _job(_amdahl(0.0), 1000),
        "serial": _job(_amdahl(0.9), 1000),
    }
    alloc = OptimusPolicy().optimize(jobs, _nodes(), {}, 60).allocations
    # Perfectly scalable job gains most from each extra GPU.
    assert len(alloc["serial"]) >= 1
    assert len(alloc["scalable"]) > len(alloc["serial"])
    assert len(alloc["scalable"]) + len(alloc["serial"]) == 8


def test_remaining_work_weights_the_gain() -> None:
    same = _amdahl(0.0)
    jobs = {"short": _job(same, 10), "long": _job(same, 10_000)}
    alloc = OptimusPolicy().optimize(jobs, _nodes(1), {}, 60).allocations
    assert len(alloc["long"]) == 3 and len(alloc["short"]) == 1


def test_max_replicas_and_no_gain_stop() -> None:
    jobs = {"capped": _job(_amdahl(0.0), 1000, cap=2), "flat": _job(lambda r: 1.0, 1000)}
    alloc = OptimusPolicy().optimize(jobs, _nodes(), {}, 60).allocations
    assert len(alloc["capped"]) == 2
    assert len(alloc["flat"]) == 1  # zero gain: spare GPUs stay idle


def test_more_jobs_than_gpus() -> None:
    jobs = {f"j{i}": _job(_amdahl(0.5), 100, t=i) for i in range(6)}
    alloc = OptimusPolicy().optimize(jobs, _nodes(1), {}, 60).allocations
    assert sorted(alloc) == ["j0", "j1", "j2", "j3"]  # submission order


def test_unchanged_count_keeps_nodes_others_take_most_free() -> None:
    jobs = {"a": _job(lambda r: 1.0, 100), "b": _job(_amdahl(0.0), 100, cap=3)}
    previous = {"a": ("n1",), "b": ("n1",)}
    alloc = OptimusPolicy().optimize(jobs, _nodes(), previous, 60).allocations
    assert alloc["a"] == ("n1",)  # same count: kept
    assert alloc["b"] == ("n0",) * 3  # grew: re-placed on the most-free node


def test_missing_oracle() -> None:
    bad = JobInfo(resources={"gpu": 1}, speedup_fn=linear_speedup, submission_time=0.0)
    with pytest.raises(ValueError, match="step_time_fn and remaining_iterations"):
        OptimusPolicy().optimize({"x": bad}, _nodes(), {}, 60)


def test_allocate_job_refuses_what_optimize_refuses() -> None:
    # The fast path used to start jobs that the next round then failed on.
    bad = JobInfo(resources={"gpu": 1}, speedup_fn=linear_speedup, submission_time=0.0)
    with pytest.raises(ValueError, match="^the new job: Optimus needs JobInfo.step_time_fn"):
        OptimusPolicy().allocate_job(bad, _nodes())
    two = JobInfo(
        {"gpu": 2}, linear_speedup, 0.0, step_time_fn=_amdahl(0.1), remaining_iterations=9
    )
    with pytest.raises(ValueError, match="job.resources={'gpu': 2}: optimus places one 'gpu'"):
        OptimusPolicy().allocate_job(two, _nodes())
    assert OptimusPolicy().allocate_job(_job(_amdahl(0.1), 9), _nodes()) == ("n0",)


def test_same_time_arrivals_go_in_natural_name_order() -> None:
    jobs = {f"j-{i}": _job(_amdahl(0.5), 100) for i in (10, 9, 11, 8, 12)}
    alloc = OptimusPolicy().optimize(jobs, _nodes(1), {}, 60).allocations
    assert sorted(alloc) == ["j-10", "j-11", "j-8", "j-9"]  # j-12 is last: no GPU left
