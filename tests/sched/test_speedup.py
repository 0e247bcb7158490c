"""Tests for adaptdl.sched.SpeedupFunction."""

from __future__ import annotations

import copy
import pickle
from typing import Any
from unittest import mock

import numpy as np
import pytest

from adaptdl.goodput import GoodputFunction, GradParams, PerfParams
from adaptdl.sched import JobInfo, SpeedupFunction

PERF = PerfParams(0.121, 0.00568, 0.0236, 0.00634, 0.0118, 0.00317, 1.14)
GRAD = GradParams(sqr=0.00136, var=0.000502)
BOUNDS: dict[str, Any] = {
    "max_batch_size": 4096,
    "atomic_bsz_range": (32, 256),
    "accumulation": True,
}


class SqrtGoodput(GoodputFunction):
    """A mock model whose best goodput is sqrt(replicas), counting optimize calls."""

    def __init__(self) -> None:
        super().__init__(PERF, GRAD, 32)
        self.calls: list[tuple[np.ndarray, np.ndarray]] = []

    def optimize(self, num_nodes: Any, num_replicas: Any, *args: Any, **kwargs: Any) -> Any:
        nodes = np.asarray(num_nodes)
        replicas = np.asarray(num_replicas)
        self.calls.append((nodes.copy(), replicas.copy()))
        goodput = np.sqrt(replicas.astype(float))
        atomic = np.full(replicas.shape, 32, dtype=np.int64)
        steps = np.zeros(replicas.shape, dtype=np.int64)
        if nodes.ndim == 0 and replicas.ndim == 0:
            return float(goodput), 32, 0
        return goodput, atomic, steps


def _real() -> GoodputFunction:
    return GoodputFunction(PERF, GRAD, 128)


def test_sqrt_mock_speedup() -> None:
    fn = SqrtGoodput()
    speedup = SpeedupFunction(fn)
    assert speedup(1, 1) == 1.0
    assert speedup(0, 0) == 0.0
    assert speedup(1, 4) == pytest.approx(2.0)
    replicas = np.arange(1, 100)
    nodes = np.ones_like(replicas)
    np.testing.assert_allclose(speedup(nodes, replicas), np.sqrt(replicas))


def test_scalar_and_array_shapes() -> None:
    speedup = SpeedupFunction(SqrtGoodput())
    assert isinstance(speedup(2, 4), float)
    assert isinstance(speedup(np.int64(2), np.int64(4)), float)
    out = speedup(np.array([[1, 1], [2, 0]]), np.array([[1, 4], [9, 0]]))
    assert out.shape == (2, 2)
    np.testing.assert_allclose(out, [[1.0, 2.0], [3.0, 0.0]])
    # Broadcasting a scalar against an array.
    assert speedup(1, np.array([1, 4, 16])).tolist() == [1.0, 2.0, 4.0]
    assert speedup(np.zeros((3, 0), dtype=int), np.zeros((3, 0), dtype=int)).shape == (3, 0)


def test_memoisation_batches_unique_unseen_pairs() -> None:
    fn = SqrtGoodput()
    speedup = SpeedupFunction(fn, mem_size=8)
    assert len(fn.calls) == 1  # the base, optimize(1, 1)
    nodes = np.array([1, 1, 2, 1, 2, 0, 1, 3, 3])
    replicas = np.array([2, 2, 4, 1, 4, 0, 2, 20, 20])  # (3, 20) is beyond the table
    speedup(nodes, replicas)
    assert len(fn.calls) == 2
    called = set(zip(fn.calls[1][0].tolist(), fn.calls[1][1].tolist()))
    assert called == {(1, 2), (2, 4), (3, 20)}  # unique, unseen, no (0, 0)
    assert len(fn.calls[1][0]) == 3
    # Everything is memoised now, in and beyond the table.
    for _ in range(3):
        speedup(nodes, replicas)
        speedup(3, 20)
        speedup(2, 4)
    assert len(fn.calls) == 2
    # A mix of known and new pairs computes only the new ones.
    speedup(np.array([1, 4, 5]), np.array([2, 30, 7]))
    assert len(fn.calls) == 3
    assert set(zip(fn.calls[2][0].tolist(), fn.calls[2][1].tolist())) == {(4, 30), (5, 7)}


def test_memoisation_with_real_model_counts_optimize_calls() -> None:
    fn = _real()
    with mock.patch.object(fn, "optimize", wraps=fn.optimize) as spy:
        speedup = SpeedupFunction(fn, **BOUNDS)
        assert spy.call_count == 1
        replicas = np.arange(1, 64)
        nodes = (replicas + 3) // 4
        first = speedup(nodes, replicas)
        assert spy.call_count == 2
        second = speedup(nodes, replicas)
        assert spy.call_count == 2
        for n, k in zip(nodes[::7], replicas[::7]):
            speedup(int(n), int(k))
        assert spy.call_count == 2
        for args in spy.call_args_list:
            assert args.kwargs == BOUNDS
    np.testing.assert_array_equal(first, second)


def test_matches_goodput_optimize() -> None:
    fn = _real()
    speedup = SpeedupFunction(fn, **BOUNDS)
    base = fn.optimize(1, 1, **BOUNDS)[0]
    assert speedup.base_goodput == base
    assert speedup.goodput_fn is fn
    assert speedup.max_batch_size == 4096 and speedup.atomic_bsz_range == (32, 256)
    assert speedup.accumulation is True
    nodes = np.array([1, 1, 2, 4, 8, 10])
    replicas = np.array([2, 4, 8, 16, 40, 80])
    goodput, atomic, steps = fn.optimize(nodes, replicas, **BOUNDS)
    np.testing.assert_allclose(speedup(nodes, replicas), goodput / base, rtol=1e-12)
    np.testing.assert_allclose(speedup.goodput(nodes, replicas), goodput, rtol=1e-12)
    got_atomic, got_steps = speedup.configuration(nodes, replicas)
    np.testing.assert_array_equal(got_atomic, atomic)
    np.testing.assert_array_equal(got_steps, steps)
    assert speedup.configuration(0, 0) == (0, 0)
    assert speedup.configuration(2, 8) == (int(atomic[2]), int(steps[2]))
    assert speedup.goodput(2, 8) == pytest.approx(goodput[2])
    # Co-adaptation: more replicas favour larger total batches.
    total = replicas * got_atomic * (got_steps + 1)
    assert total[-1] > total[0]


def test_with_base_returns_new_object_sharing_the_memo() -> None:
    fn = SqrtGoodput()
    speedup = SpeedupFunction(fn)
    speedup(np.array([1, 2]), np.array([4, 16]))
    calls = len(fn.calls)
    fair = speedup.with_base(1, 4)
    assert fair is not speedup
    assert len(fn.calls) == calls  # (1, 4) was already memoised
    assert fair(1, 4) == pytest.approx(1.0)
    assert fair(2, 16) == pytest.approx(2.0)
    assert fair(0, 0) == 0.0
    # The original is unchanged.
    assert speedup.base_goodput == 1.0
    assert speedup(1, 4) == pytest.approx(2.0)
    # Pairs computed through either object are visible to both.
    fair(3, 9)
    calls = len(fn.calls)
    assert speedup(3, 9) == pytest.approx(3.0)
    assert len(fn.calls) == calls
    with pytest.raises(ValueError, match="num_nodes=2 exceeds num_replicas=1"):
        speedup.with_base(2, 1)
    with pytest.raises(ValueError, match="expected scalars"):
        speedup.with_base(np.array([1, 1]), np.array([1, 2]))  # type: ignore[arg-type]
    # It used to blame max_atomic and the initial batch size.
    with pytest.raises(ValueError, match=r"with_base\(num_nodes=0, num_replicas=0\): the base"):
        speedup.with_base(0, 0)


def test_zero_base_goodput_is_rejected() -> None:
    # Without accumulation one replica cannot reach B0=128 with 64 samples.
    with pytest.raises(ValueError, match="goodput at num_nodes=1, num_replicas=1 is 0.0"):
        SpeedupFunction(_real(), atomic_bsz_range=(None, 64))
    speedup = SpeedupFunction(_real(), max_batch_size=256, atomic_bsz_range=(None, 256))
    assert speedup(1, 2) > 0


@pytest.mark.parametrize(
    "nodes,replicas,error,match",
    [
        (2, 1, ValueError, "num_nodes=2 exceeds num_replicas=1"),
        (-1, 2, ValueError, "num_nodes=-1: must be >= 0"),
        (0, 3, ValueError, "num_nodes=0 with num_replicas=3"),
        (1, 0, ValueError, "num_nodes=1 exceeds num_replicas=0"),
        (np.array([1, 3]), np.array([2, 2]), ValueError, "num_nodes=3 exceeds num_replicas=2"),
        (np.array([1, 1]), np.array([1, 1, 1]), ValueError, "do not broadcast"),
        (1.5, 2, ValueError, "num_nodes=1.5: expected whole numbers"),
        (1, "2", TypeError, "num_replicas='2': expected integer counts"),
        (True, 1, TypeError, "num_nodes=True"),
    ],
)
def test_invalid_pairs_raise(nodes: Any, replicas: Any, error: type, match: str) -> None:
    speedup = SpeedupFunction(SqrtGoodput())
    with pytest.raises(error, match=match):
        speedup(nodes, replicas)
    with pytest.raises(error, match=match):
        speedup.configuration(nodes, replicas)


def test_whole_floats_are_accepted() -> None:
    speedup = SpeedupFunction(SqrtGoodput())
    assert speedup(1.0, 4.0) == pytest.approx(2.0)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"mem_size": 1}, ValueError, "mem_size=1"),
        ({"mem_size": 4.0}, TypeError, "mem_size=4.0"),
        ({"max_batch_size": 64}, ValueError, "max_batch_size=64"),
        ({"atomic_bsz_range": (64, 32)}, ValueError, "min_atomic=64"),
        # A truthy string turned accumulation on.
        ({"accumulation": "no"}, TypeError, "accumulation='no': expected True or False"),
    ],
)
def test_invalid_construction(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SpeedupFunction(_real(), **kwargs)


def test_rejects_non_goodput_function() -> None:
    with pytest.raises(TypeError, match="expected a GoodputFunction"):
        SpeedupFunction(lambda n, k: k)  # type: ignore[arg-type]


def test_is_a_job_speedup_fn() -> None:
    speedup = SpeedupFunction(_real(), **BOUNDS)
    job = JobInfo(resources={"gpu": 1}, speedup_fn=speedup, submission_time=0.0)
    assert job.speedup_fn(1, 1) == 1.0
    # Speedup grows with replicas for this model, sub-linearly.
    values = speedup(np.ones(4, dtype=int), np.array([1, 2, 4, 8]))
    assert np.all(np.diff(values) > 0)
    assert np.all(values <= np.array([1, 2, 4, 8]) + 1e-9)
    assert "SpeedupFunction" in repr(speedup)


def test_pickle_and_deepcopy_keep_the_memo() -> None:
    speedup = SpeedupFunction(_real(), **BOUNDS)
    expected = speedup(np.array([1, 2, 5]), np.array([4, 8, 40]))
    for clone in (pickle.loads(pickle.dumps(speedup)), copy.deepcopy(speedup)):
        with mock.patch.object(clone.goodput_fn, "optimize") as spy:
            np.testing.assert_array_equal(
                clone(np.array([1, 2, 5]), np.array([4, 8, 40])), expected
            )
            assert spy.call_count == 0  # served from the copied memo
        assert clone(3, 12) == pytest.approx(speedup(3, 12))


def test_huge_counts_and_memo_sizes_are_refused() -> None:
    speedup = SpeedupFunction(_real())
    # Counts of 2**32 would collide in the memo's packed keys; 2**63 wrapped.
    for replicas in (2**31, 2**32 + 40, 2**63, 1e20):
        with pytest.raises(ValueError, match="num_replicas=.*: must be below 2\\*\\*31"):
            speedup(1, replicas)
    with pytest.raises(ValueError, match="mem_size=1000000: must be from 2"):
        SpeedupFunction(_real(), mem_size=10**6)
