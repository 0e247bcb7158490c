"""Tests for adaptdl.goodput: model invariants, batch-size optimisation and the fit."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest
import scipy.optimize
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl._goodput import FitData, fit_loss, fit_loss_and_grad, step_times
from adaptdl.goodput import GoodputFunction, GradParams, PerfParams, fit_perf_params

# Ten random performance models and ten random gradient statistics, every
# value drawn from gamma(2, 2): a wide spread of regimes (compute- or
# network-bound, noisy or clean gradients) rather than one hand-picked case.
_RNG = np.random.default_rng(20240607)
# gamma is shifted by 1: the model (and the fit) keep it >= 1.
PERF_PARAMS = [
    PerfParams(*(float(v) + (i == 6) for i, v in enumerate(_RNG.gamma(2.0, 2.0, 7))))
    for _ in range(10)
]
GRAD_PARAMS = [GradParams(*(float(v) for v in _RNG.gamma(2.0, 2.0, 2))) for _ in range(10)]
PARAM_PAIRS = [(p, g) for p in PERF_PARAMS for g in GRAD_PARAMS]

# A realistic model (ResNet-like numbers) for the deterministic cases.
REAL_PERF = PerfParams(0.121, 0.00568, 0.0236, 0.00634, 0.0118, 0.00317, 1.14)
REAL_GRAD = GradParams(sqr=0.00136, var=0.000502)

NODES = np.array([1, 1, 1, 2, 2, 4, 4, 8])
REPLICAS = np.array([1, 2, 4, 2, 8, 4, 16, 64])

FIT_TRUTH = PerfParams(0.1, 0.01, 0.5, 1.0, 1e-6, 1e-6, 1.2)

PROPERTY = settings(max_examples=60, deadline=None)


def _grid() -> tuple[np.ndarray, ...]:
    """Every (N, K, m, s) combination of a small grid, as broadcast arrays."""
    nodes, replicas = NODES[:, None, None], REPLICAS[:, None, None]
    atomic = np.array([1, 4, 16, 64, 256, 1024])[None, :, None]
    steps = np.array([0, 1, 3])[None, None, :]
    return nodes, replicas, atomic, steps


# ------------------------------------------------------------------ invariants
@pytest.mark.parametrize("perf,grad", PARAM_PAIRS[::7])
def test_throughput_is_positive_and_finite(perf: PerfParams, grad: GradParams) -> None:
    fn = GoodputFunction(perf, grad, 128)
    result = fn.throughput(*_grid())
    assert result.shape == (len(NODES), 6, 3)
    assert np.all(np.isfinite(result)) and np.all(result > 0)


@pytest.mark.parametrize("grad", GRAD_PARAMS)
def test_efficiency_in_unit_interval_and_non_increasing(grad: GradParams) -> None:
    fn = GoodputFunction(REAL_PERF, grad, 128)
    batch = np.geomspace(128, 128 * 1000, 200)
    eff = fn.efficiency(batch)
    assert eff[0] == pytest.approx(1.0)
    assert np.all(eff > 0) and np.all(eff <= 1.0 + 1e-12)
    assert np.all(np.diff(eff) <= 1e-12)


def test_efficiency_matches_noise_scale_form() -> None:
    # (B_noise + B0) / (B_noise + B) with B_noise = B0 * var / sqr.
    fn = GoodputFunction(REAL_PERF, GradParams(sqr=2.0, var=6.0), 100)
    b_noise = 100 * 6.0 / 2.0
    for batch in (100, 250, 1000, 12345):
        assert fn.efficiency(batch) == pytest.approx((b_noise + 100) / (b_noise + batch))


def test_efficiency_degenerate_statistics() -> None:
    # sqr=var=0: the gain is 1 (no information), so efficiency is B0/B.
    fn = GoodputFunction(REAL_PERF, GradParams(0.0, 0.0), 64)
    assert fn.efficiency(256) == pytest.approx(0.25)
    # Pure noise (sqr=0): perfect scaling.
    fn = GoodputFunction(REAL_PERF, GradParams(0.0, 1.0), 64)
    assert fn.efficiency(256) == pytest.approx(1.0)


@pytest.mark.parametrize("perf", PERF_PARAMS)
def test_throughput_increasing_and_concave_in_atomic_bsz(perf: PerfParams) -> None:
    # The draws include gamma < 1 (outside the fitted range [1, 10]); the
    # invariant holds there too.
    fn = GoodputFunction(perf, REAL_GRAD, 1)
    atomic = np.linspace(1.0, 512.0, 400)
    for nodes, replicas in zip(NODES, REPLICAS):
        for steps in (0, 2):
            thr = fn.throughput(nodes, replicas, atomic, steps)
            first = np.diff(thr)
            second = np.diff(first)
            assert np.all(first > 0)
            assert np.all(second <= 1e-9 * np.max(np.abs(thr)))


@pytest.mark.parametrize("perf", PERF_PARAMS)
def test_per_replica_throughput_non_increasing_in_replicas(perf: PerfParams) -> None:
    fn = GoodputFunction(perf, REAL_GRAD, 1)
    for nodes in (1, 2, 4):
        replicas = np.arange(nodes, 65)
        for atomic in (1, 32, 512):
            per_replica = fn.throughput(nodes, replicas, atomic, 0) / replicas
            assert np.all(np.diff(per_replica) <= 1e-12 * per_replica[:-1])


def test_step_time_formula() -> None:
    perf = PerfParams(0.2, 0.01, 0.3, 0.05, 0.1, 0.02, 2.0)
    t_acc, t_opt = step_times(perf, np.array([2.0]), np.array([6.0]), np.array([10.0]))
    expect_acc = 0.2 + 0.01 * 10
    expect_net = 0.3 + 0.05 * 4
    assert t_acc[0] == pytest.approx(expect_acc)
    assert t_opt[0] == pytest.approx(math.hypot(expect_acc, expect_net))
    # One node, several replicas: the intra-node pair; K=2 has no retrogression.
    _, t_opt = step_times(perf, np.array([1.0]), np.array([2.0]), np.array([10.0]))
    assert t_opt[0] == pytest.approx(math.hypot(0.3, 0.1 + 0.02 * 1e-8))
    # A single replica does not communicate (tiny floor only).
    _, t_opt = step_times(perf, np.array([1.0]), np.array([1.0]), np.array([10.0]))
    assert t_opt[0] == pytest.approx(0.3, rel=1e-9)
    # Large gamma approaches the max without overflowing.
    _, t_opt = step_times(
        perf._replace(gamma=1e4), np.array([2.0]), np.array([6.0]), np.array([10.0])
    )
    assert t_opt[0] == pytest.approx(max(expect_acc, expect_net), rel=1e-3)


def test_goodput_is_throughput_times_efficiency() -> None:
    fn = GoodputFunction(REAL_PERF, REAL_GRAD, 128)
    thr = fn.throughput(2, 8, 64, 1)
    eff = fn.efficiency(8 * 64 * 2)
    assert fn.evaluate(2, 8, 64, 1) == pytest.approx(thr * eff)
    assert fn(2, 8, 64, 1) == fn.evaluate(2, 8, 64, 1)
    # Throughput by hand: samples per optimizer step over its duration.
    t_acc = 0.121 + 0.00568 * 64
    t_net = 0.0236 + 0.00634 * 6
    t_opt = (t_acc**1.14 + t_net**1.14) ** (1 / 1.14)
    assert thr == pytest.approx(8 * 64 * 2 / (t_acc + t_opt))


def test_scalar_only_when_all_inputs_scalar() -> None:
    fn = GoodputFunction(REAL_PERF, REAL_GRAD, 128)
    assert isinstance(fn.evaluate(1, 1, 128, 0), float)
    assert isinstance(fn.throughput(np.int64(1), 2, 64.0, 0), float)
    assert isinstance(fn.efficiency(256), float)
    array_out = fn.evaluate(1, 2, np.array([64, 128]), 0)
    assert isinstance(array_out, np.ndarray) and array_out.shape == (2,)
    # The original returned a scalar if *either* input was a scalar.
    goodput, atomic, steps = fn.optimize(1, np.array([1, 2, 4]))
    assert goodput.shape == atomic.shape == steps.shape == (3,)
    goodput, atomic, steps = fn.optimize(np.array([1]), 1)
    assert goodput.shape == (1,)
    scalar = fn.optimize(2, 4)
    assert type(scalar[0]) is float and type(scalar[1]) is int and type(scalar[2]) is int


# ------------------------------------------------------------------ optimize
def test_optimize_paper_examples() -> None:
    fn = GoodputFunction(REAL_PERF, REAL_GRAD, 128)
    # The batch size stays at B0 (the default maximum); 128/3 rounds up.
    goodput, atomic, steps = fn.optimize(1, 3)
    assert (atomic, steps) == (43, 0)
    assert goodput == pytest.approx(fn.evaluate(1, 3, 43, 0))
    # A single replica without accumulation never grows the batch.
    _, atomic, steps = fn.optimize(1, 1, max_batch_size=1280)
    assert (atomic, steps) == (128, 0)
    _, atomic, steps = fn.optimize(1, 1, max_batch_size=1280, atomic_bsz_range=(256, 512))
    assert (atomic, steps) == (256, 0)  # clamped up into the atomic range


def test_optimize_single_replica_accumulates_when_growing() -> None:
    # Noisy gradients make large batches worthwhile, so the batch grows; with
    # one replica that must happen through accumulation.
    fn = GoodputFunction(REAL_PERF, GradParams(sqr=1e-4, var=1.0), 128)
    goodput, atomic, steps = fn.optimize(1, 1, max_batch_size=4096, accumulation=True)
    assert steps >= 1
    assert atomic * (steps + 1) > 128
    assert goodput == pytest.approx(fn.evaluate(1, 1, atomic, steps))
    # Without accumulation a single replica stays at B0 although growing would pay.
    _, atomic, steps = fn.optimize(1, 1, max_batch_size=4096)
    assert (atomic, steps) == (128, 0)
    # Without the single-replica rule only one micro-batch would be needed.
    _, atomic_k2, steps_k2 = fn.optimize(1, 2, max_batch_size=4096, accumulation=True)
    assert steps_k2 == 0 and atomic_k2 > 128


def test_optimize_batch_growth_follows_noise() -> None:
    clean = GoodputFunction(REAL_PERF, GradParams(sqr=1.0, var=0.0), 128)
    noisy = GoodputFunction(REAL_PERF, GradParams(sqr=1e-4, var=1.0), 128)
    kwargs: dict[str, Any] = {"max_batch_size": 8192, "atomic_bsz_range": (16, 512)}
    _, atomic, steps = clean.optimize(2, 8, **kwargs)
    assert 8 * atomic * (steps + 1) == 128  # no noise: the smallest batch wins
    _, atomic, steps = noisy.optimize(2, 8, **kwargs)
    assert 8 * atomic * (steps + 1) > 1024


def test_optimize_accumulates_beyond_max_atomic() -> None:
    fn = GoodputFunction(REAL_PERF, GradParams(sqr=1e-4, var=1.0), 128)
    _, atomic, steps = fn.optimize(
        1, 2, max_batch_size=8192, atomic_bsz_range=(None, 64), accumulation=True
    )
    assert atomic <= 64 and steps >= 1
    _, atomic, steps = fn.optimize(1, 2, max_batch_size=8192, atomic_bsz_range=(None, 64))
    assert (atomic, steps) == (64, 0)


def test_optimize_infeasible_candidates_have_zero_goodput() -> None:
    # Without accumulation, 2 x 32 samples cannot reach B0=128.
    fn = GoodputFunction(REAL_PERF, REAL_GRAD, 128)
    goodput, atomic, steps = fn.optimize(1, np.array([2, 4]), atomic_bsz_range=(None, 32))
    assert goodput[0] == 0.0 and goodput[1] > 0.0
    assert atomic.tolist() == [32, 32] and steps.tolist() == [0, 0]


_bounds = st.fixed_dictionaries(
    {
        "pair": st.integers(0, len(PARAM_PAIRS) - 1),
        "b0": st.integers(1, 512),
        "growth": st.sampled_from([1.0, 1.5, 4.0, 37.0, 300.0]),
        "lo": st.one_of(st.none(), st.integers(1, 64)),
        "hi_extra": st.one_of(st.none(), st.integers(0, 1024)),
        "accumulation": st.booleans(),
    }
)


@PROPERTY
@given(_bounds)
def test_optimize_respects_bounds(case: dict[str, Any]) -> None:
    perf, grad = PARAM_PAIRS[case["pair"]]
    b0 = case["b0"]
    fn = GoodputFunction(perf, grad, b0)
    max_batch = b0 * case["growth"]
    lo = case["lo"]
    hi = None if case["hi_extra"] is None else (lo or 1) + case["hi_extra"]
    acc = case["accumulation"]
    goodput, atomic, steps = fn.optimize(
        NODES, REPLICAS, max_batch_size=max_batch, atomic_bsz_range=(lo, hi), accumulation=acc
    )
    lo_eff = 1 if lo is None else lo
    hi_eff = max(max_batch, lo_eff) if hi is None else hi
    batch = REPLICAS * atomic * (steps + 1)
    assert np.all(atomic >= lo_eff) and np.all(atomic <= hi_eff)
    assert np.all(steps >= 0)
    if not acc:
        assert np.all(steps == 0)
        single = REPLICAS == 1
        assert np.all(atomic[single] == np.clip(b0, lo_eff, hi_eff))
    else:
        # Growth beyond what the smallest micro-batch forces takes accumulation.
        grows = (REPLICAS == 1) & (atomic * (steps + 1) > max(b0, lo_eff))
        assert np.all(steps[grows] >= 1)
    # The total batch stays within the maximum up to rounding m up, unless the
    # minimum atomic size alone exceeds it.
    cap = np.ceil(max_batch / (REPLICAS * (steps + 1)) - 1e-9)
    assert np.all((atomic <= cap) | (atomic == lo_eff) | ((REPLICAS == 1) & (atomic == b0)))
    assert np.all(goodput >= 0)
    feasible = goodput > 0
    assert np.all(batch[feasible] >= b0)
    assert np.all(goodput[~feasible] == 0)
    if np.any(feasible):
        expect = fn.evaluate(NODES[feasible], REPLICAS[feasible], atomic[feasible], steps[feasible])
        np.testing.assert_allclose(goodput[feasible], expect, rtol=1e-12)
    # With accumulation the B0 floor is always reachable.
    if acc:
        assert np.all(feasible)


@PROPERTY
@given(
    st.integers(0, len(PARAM_PAIRS) - 1),
    st.integers(1, 256),
    st.sampled_from([2.0, 10.0, 100.0]),
)
def test_optimize_beats_initial_batch(pair: int, b0: int, growth: float) -> None:
    # B0 itself is always the first candidate for one replica; the argmax can
    # only improve on it.
    perf, grad = PARAM_PAIRS[pair]
    fn = GoodputFunction(perf, grad, b0)
    goodput, _, _ = fn.optimize(1, 1, max_batch_size=b0 * growth, accumulation=True)
    assert goodput >= fn.evaluate(1, 1, b0, 0) * (1 - 1e-12)


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "call,match",
    [
        (lambda f: f.evaluate(1, 1, 64, 0), "below init_batch_size=128"),
        (lambda f: f.evaluate(3, 2, 128, 0), "num_nodes=3.0 exceeds num_replicas=2.0"),
        (lambda f: f.evaluate(0, 1, 128, 0), "num_nodes=0.0"),
        (lambda f: f.throughput(1, 0, 128, 0), "num_replicas=0.0"),
        (lambda f: f.throughput(1, 1, 0, 0), "atomic_bsz=0.0"),
        (lambda f: f.throughput(1, 1, 128, -1), "accum_steps=-1.0"),
        (lambda f: f.throughput(1, 1, np.nan, 0), "atomic_bsz=nan"),
        (lambda f: f.throughput([1, 1], [1, 1, 1], 128, 0), "do not broadcast"),
        (lambda f: f.efficiency(0), "batch_size=0.0"),
        (lambda f: f.optimize(1, 1, max_batch_size=64), "max_batch_size=64"),
        (lambda f: f.optimize(1, 1, 256, (64, 32)), r"max_atomic=32.0 .* min_atomic=64.0"),
        (lambda f: f.optimize(1, 1, 256, (0, 32)), "min_atomic must be >= 1"),
        (lambda f: f.optimize(2, 1), "num_nodes=2.0 exceeds"),
        # Beyond 2**53 the int64 results and the batch products overflow.
        (lambda f: f.optimize(2, 2, max_batch_size=1e25), r"max_batch_size=1e\+25: .*2\*\*53"),
        (lambda f: f.optimize(2, 2, 256, (1, 1e20)), r"max_atomic=1e\+20 .*2\*\*53"),
        (lambda f: f.evaluate(1, 4, 1e308, 0), r"atomic_bsz=1e\+308: .*2\*\*53"),
        (lambda f: f.throughput(1, 4, 128, 1e20), r"accum_steps=1e\+20: .*2\*\*53"),
    ],
)
def test_invalid_arguments_raise(call: Any, match: str) -> None:
    fn = GoodputFunction(REAL_PERF, REAL_GRAD, 128)
    with pytest.raises(ValueError, match=match):
        call(fn)


@pytest.mark.parametrize("accumulation", [False, True])
def test_fractional_sizes_give_the_whole_micro_batch_that_was_evaluated(
    accumulation: bool,
) -> None:
    # optimize() evaluated m=32.5 (or max_atomic=9.5) and returned int(m), a
    # configuration with another goodput, or one evaluate() refused.
    fn = GoodputFunction(REAL_PERF, GradParams(1.0, 10.0), 32.5)
    goodput, bsz, steps = fn.optimize(1, 1, 64, accumulation=accumulation)
    assert bsz * (steps + 1) >= 32.5
    assert fn.evaluate(1, 1, bsz, steps) == pytest.approx(goodput, rel=1e-12)
    fn = GoodputFunction(REAL_PERF, GradParams(1.0, 10.0), 16)
    goodput, bsz, steps = fn.optimize(1, 2, 64, (1, 9.5), accumulation)
    assert bsz == 9 and fn.evaluate(1, 2, bsz, steps) == pytest.approx(goodput, rel=1e-12)
    with pytest.raises(ValueError, match="no whole micro-batch size lies between"):
        fn.optimize(1, 2, 64, (9.2, 9.5), accumulation)


def test_bounds_that_are_not_numbers_are_named() -> None:
    # They raised float()'s own errors, which named neither argument.
    fn = GoodputFunction(REAL_PERF, REAL_GRAD, 128)
    with pytest.raises(TypeError, match="^max_batch_size='big': expected a number"):
        fn.optimize(1, 2, "big")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"^max_batch_size=array\(\[256, 512\]\): expected"):
        fn.optimize(1, 2, np.array([256, 512]))  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"^atomic_bsz_range=\('a', None\): expected a number"):
        fn.optimize(1, 2, 1024, ("a", None))  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"^atomic_bsz_range=\(1, \[8\]\): expected a number"):
        fn.optimize(1, 2, 1024, (1, [8]))  # type: ignore[call-overload]


def test_accumulation_must_be_a_bool() -> None:
    fn = GoodputFunction(REAL_PERF, REAL_GRAD, 128)
    with pytest.raises(TypeError, match="accumulation='False': expected True or False"):
        fn.optimize(1, 1, 256, accumulation="False")  # type: ignore[call-overload]
    assert fn.optimize(1, 1, 256, accumulation=np.bool_(True))[2] >= 0


@pytest.mark.parametrize(
    "args,match",
    [
        ((REAL_PERF, REAL_GRAD, 0), "init_batch_size=0"),
        ((REAL_PERF, REAL_GRAD, float("inf")), "init_batch_size=inf"),
        ((REAL_PERF._replace(beta_c=-1.0), REAL_GRAD, 1), "perf_params.beta_c=-1.0"),
        ((REAL_PERF._replace(gamma=0.0), REAL_GRAD, 1), "perf_params.gamma=0.0"),
        # exp overflowed into a silent goodput of 0 (gamma=1e-300).
        ((REAL_PERF._replace(gamma=0.5), REAL_GRAD, 1), "perf_params.gamma=0.5: must be >= 1"),
        ((REAL_PERF._replace(alpha_c=0.0, beta_c=0.0), REAL_GRAD, 1), "alpha_c=0.0"),
        ((REAL_PERF, GradParams(float("nan"), 1.0), 1), "grad_params.sqr=nan"),
        ((REAL_PERF, GradParams(1.0, -1.0), 1), "grad_params.var=-1.0"),
        ((REAL_PERF, REAL_GRAD, 1e20), r"init_batch_size=1e\+20: .*2\*\*53"),
    ],
)
def test_invalid_construction_raises(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GoodputFunction(*args)


def test_attributes() -> None:
    fn = GoodputFunction(REAL_PERF, REAL_GRAD, 128)
    assert fn.perf_params == REAL_PERF and fn.grad_params == REAL_GRAD
    assert fn.init_batch_size == 128
    assert "GoodputFunction" in repr(fn)


# ----------------------------------------------------------------------- fit
def _synthetic(
    n: int, seed: int, noise: float, *, max_nodes: int = 8, max_per_node: int = 4
) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    nodes = rng.integers(1, max_nodes + 1, n)
    replicas = nodes * rng.integers(1, max_per_node + 1, n)
    atomic = rng.integers(1, 257, n).astype(float)
    t_acc, t_opt = step_times(FIT_TRUTH, nodes.astype(float), replicas.astype(float), atomic)
    t_acc = t_acc * rng.lognormal(0.0, noise, n)
    t_opt = t_opt * rng.lognormal(0.0, noise, n)
    return nodes, replicas, atomic, t_acc, t_opt


def _loss(params: PerfParams, data: tuple[np.ndarray, ...]) -> float:
    arrays = [np.asarray(a, dtype=float) for a in data]
    return fit_loss(np.array(params), FitData.build(*arrays))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_reaches_true_loss_on_noisy_data(seed: int) -> None:
    data = _synthetic(1000, seed, noise=0.1)
    fitted = fit_perf_params(*data)
    assert _loss(fitted, data) <= 1.1 * _loss(FIT_TRUTH, data)


def test_fit_on_noiseless_data() -> None:
    # The start values (0.1, 0.01) fit the compute times exactly here, a kink
    # of the unsmoothed RMSE where the line search used to stall.
    data = _synthetic(300, 7, noise=0.0)
    fitted = fit_perf_params(*data)
    assert _loss(fitted, data) <= _loss(FIT_TRUTH, data)
    nodes, replicas, atomic, t_acc, t_opt = data
    pred_acc, pred_opt = step_times(fitted, nodes.astype(float), replicas.astype(float), atomic)
    assert np.max(np.abs(np.log(pred_acc / t_acc))) < 0.01
    # The optimism prior on beta/alpha biases the network terms a little.
    assert np.sqrt(np.mean(np.log(pred_opt / t_opt) ** 2)) < 0.1


def test_fit_without_smoothing_is_the_originals_loss() -> None:
    # smoothing=0 is the original's loss, which the simulator replays; the
    # default keeps its stall on noiseless data away (see above).
    data = _synthetic(40, 5, noise=0.1)
    arrays = FitData.build(*[np.asarray(a, dtype=float) for a in data])
    x = np.array(FIT_TRUTH)
    nodes, replicas, atomic, t_acc, t_opt = data
    pred_acc, pred_opt = step_times(FIT_TRUTH, nodes.astype(float), replicas.astype(float), atomic)
    rmse = np.sqrt(np.mean(np.log(pred_acc / t_acc) ** 2)) + np.sqrt(
        np.mean(np.log(pred_opt / t_opt) ** 2)
    )
    exact, grad = fit_loss_and_grad(x, arrays, 0.0)
    assert exact == pytest.approx(rmse + 1e-3 * (1.2 - 1) ** 2 + 1e-2 * (2.0**2 + 1.0), rel=1e-12)
    assert fit_loss(x, arrays) != exact  # the default smooths
    # At an exact fit the kink's gradient is taken as 0, not NaN.
    exact_data = _synthetic(30, 7, noise=0.0)
    noiseless = FitData.build(*[np.asarray(a, dtype=float) for a in exact_data])
    assert np.all(np.isfinite(fit_loss_and_grad(x, noiseless, 0.0)[1]))
    fitted = fit_perf_params(*data, smoothing=0.0)
    assert _loss(fitted, data) <= 1.1 * _loss(FIT_TRUTH, data)
    for bad in (-1e-8, float("nan"), "0"):
        with pytest.raises(ValueError, match="smoothing="):
            fit_perf_params(*data, smoothing=bad)  # type: ignore[arg-type]


def test_fit_loss_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(3)
    nodes = np.array([1, 1, 1, 2, 2, 4, 1, 3], dtype=float)
    replicas = np.array([1, 2, 4, 2, 8, 16, 3, 5], dtype=float)
    atomic = rng.integers(1, 128, nodes.size).astype(float)
    data = FitData.build(nodes, replicas, atomic, rng.uniform(0.1, 2, 8), rng.uniform(0.2, 3, 8))
    for _ in range(5):
        x = rng.uniform(0.01, 1.0, 7)
        x[6] = rng.uniform(1.0, 4.0)
        _, grad = fit_loss_and_grad(x, data)
        numeric = scipy.optimize.approx_fprime(x, lambda v: fit_loss(v, data), 1e-7)
        np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-6)
        # check_grad agrees too (a scalar summary of the same comparison).
        err = scipy.optimize.check_grad(
            lambda v: fit_loss(v, data), lambda v: fit_loss_and_grad(v, data)[1], x
        )
        assert err < 1e-4 * max(1.0, float(np.linalg.norm(grad)))


def test_fit_pins_alpha_c_with_one_atomic_size() -> None:
    nodes, replicas, _, t_acc, t_opt = _synthetic(50, 4, noise=0.05)
    atomic = np.full(50, 32.0)
    fitted = fit_perf_params(nodes, replicas, atomic, t_acc, t_opt)
    assert fitted.alpha_c == pytest.approx(np.mean(t_acc) / 2)


def test_fit_pins_inter_node_params_without_multi_node_data() -> None:
    data = _synthetic(200, 5, noise=0.05, max_nodes=1)
    fitted = fit_perf_params(*data)
    # The intra-node pair is identified by the data; the inter-node pair is at
    # least 10% slower (a prior, since crossing nodes is not observed).
    assert fitted.alpha_r > 1e-6
    assert fitted.alpha_n == pytest.approx(max(1e-8, 1.1 * fitted.alpha_r))
    assert fitted.beta_n == pytest.approx(max(1e-8, 1.1 * fitted.beta_r))


def test_fit_pins_intra_node_params_without_single_node_multi_replica_data() -> None:
    nodes, replicas, atomic, t_acc, t_opt = _synthetic(200, 6, noise=0.05)
    keep = (nodes > 1) | (replicas == 1)
    fitted = fit_perf_params(nodes[keep], replicas[keep], atomic[keep], t_acc[keep], t_opt[keep])
    assert fitted.alpha_r == 1e-8 and fitted.beta_r == 1e-8
    assert fitted.alpha_n > 1e-3


def test_fit_pins_betas_without_retrogression_data() -> None:
    nodes, replicas, atomic, t_acc, t_opt = _synthetic(300, 8, noise=0.05, max_nodes=2)
    keep = replicas <= 2
    fitted = fit_perf_params(nodes[keep], replicas[keep], atomic[keep], t_acc[keep], t_opt[keep])
    assert fitted.beta_n == 1e-8 and fitted.beta_r == 1e-8
    assert fitted.alpha_n > 1e-3


@pytest.mark.parametrize(
    "keep,pinned",
    [
        ("all", set()),
        ("one_node", {2, 3}),  # no multi-node data
        ("no_single_node_multi", {4, 5}),
        ("at_most_two", {3, 5}),  # no retrogression visible
        ("one_node_at_most_two", {2, 3, 5}),
        ("single_replica", {2, 3, 4, 5}),
    ],
)
def test_fit_pinning_rules_fix_bounds(
    monkeypatch: pytest.MonkeyPatch, keep: str, pinned: set[int]
) -> None:
    nodes, replicas, atomic, t_acc, t_opt = _synthetic(300, 12, noise=0.05)
    masks = {
        "all": np.ones(nodes.size, dtype=bool),
        "one_node": nodes == 1,
        "no_single_node_multi": (nodes > 1) | (replicas == 1),
        "at_most_two": replicas <= 2,
        "one_node_at_most_two": (nodes == 1) & (replicas <= 2),
        "single_replica": replicas == 1,
    }
    mask = masks[keep]
    seen: list[Any] = []
    real_minimize = scipy.optimize.minimize

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["bounds"])
        return real_minimize(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "minimize", spy)
    fit_perf_params(nodes[mask], replicas[mask], atomic[mask], t_acc[mask], t_opt[mask])
    bounds = seen[0]
    fixed = {i for i in range(7) if bounds.lb[i] == bounds.ub[i]}
    assert fixed == pinned
    assert all(bounds.lb[i] == 1e-8 for i in pinned)
    free = [i for i in range(6) if i not in pinned]
    assert all(bounds.lb[i] == 1e-8 and bounds.ub[i] == np.inf for i in free)
    assert bounds.lb[6] == 1.0 and bounds.ub[6] == 10.0


def test_fit_respects_bounds() -> None:
    fitted = fit_perf_params(*_synthetic(200, 9, noise=0.3))
    assert all(v >= 1e-8 for v in fitted[:6])
    assert 1.0 <= fitted.gamma <= 10.0


def test_fit_handles_optimiser_non_convergence(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_minimize = scipy.optimize.minimize

    def one_iteration(*args: Any, **kwargs: Any) -> Any:
        kwargs["options"] = {"maxiter": 1}
        return real_minimize(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "minimize", one_iteration)
    data = _synthetic(100, 10, noise=0.1)
    with caplog.at_level(logging.WARNING, logger="adaptdl.goodput"):
        fitted = fit_perf_params(*data)
    assert "did not converge" in caplog.text
    start = PerfParams(0.1, 0.01, 0.1, 0.01, 0.1, 0.01, 1.001)
    assert _loss(fitted, data) < _loss(start, data)  # still the best point seen


def test_fit_handles_optimiser_exception(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(fun: Any, x0: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        fun(x0)
        raise ValueError("simulated solver failure")

    monkeypatch.setattr(scipy.optimize, "minimize", broken)
    with caplog.at_level(logging.WARNING, logger="adaptdl.goodput"):
        fitted = fit_perf_params(*_synthetic(20, 11, noise=0.1))
    assert "simulated solver failure" in caplog.text
    assert fitted.beta_c == 0.01  # the start values were the best point seen


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"num_nodes": [1, 1]}, "equal lengths"),
        ({"optim_step_time": [0.1, 0.0, 0.2]}, "optim_step_time=0.0"),
        ({"accum_step_time": [0.1, -1.0, 0.2]}, "accum_step_time=-1.0"),
        ({"atomic_bsz": [4, 0, 8]}, "atomic_bsz=0.0"),
        ({"num_nodes": [1, 3, 1]}, "num_nodes=3.0 exceeds num_replicas=2.0"),
        ({"num_replicas": [1, 2, np.inf]}, "must be finite"),
        ({"num_nodes": [[1, 1, 1]]}, "1-D"),
    ],
)
def test_fit_validation(overrides: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "num_nodes": [1, 1, 1],
        "num_replicas": [1, 2, 2],
        "atomic_bsz": [4, 8, 8],
        "accum_step_time": [0.1, 0.2, 0.2],
        "optim_step_time": [0.1, 0.3, 0.3],
    }
    args.update(overrides)
    with pytest.raises(ValueError, match=match):
        fit_perf_params(**args)


def test_fit_rejects_empty_input() -> None:
    with pytest.raises(ValueError, match="no observations"):
        fit_perf_params([], [], [], [], [])


def test_pure_noise_optimum_at_the_largest_batch_is_a_valid_int() -> None:
    """With no gradient signal every batch is equally efficient; the largest wins."""
    fn = GoodputFunction(PerfParams(0.1, 0.01, 0.5, 1.0, 0.2, 0.05, 1.2), GradParams(0.0, 1.0), 1)
    goodput, atomic, steps = fn.optimize(2, 2, max_batch_size=2**53)
    assert math.isfinite(goodput) and goodput > 0
    assert 0 < atomic <= 2**53 and steps == 0
    assert math.isfinite(fn.evaluate(1, 4, 2**53, 0))


def test_a_min_atomic_above_the_largest_batch_wins_over_the_default_max() -> None:
    # As an explicit (512, 1024) does: the model cannot run a smaller micro-batch.
    fn = GoodputFunction(*PARAM_PAIRS[0], 64)
    for bounds in ((512, None), (512, 1024)):
        _, atomic, steps = fn.optimize(1, 1, 256, bounds)
        assert (atomic, steps) == (512, 0), bounds
    with pytest.raises(ValueError, match=r"max_atomic=256.0 must be >= min_atomic=512.0"):
        fn.optimize(1, 1, 256, (512, 256))


def test_efficiency_of_gradient_statistics_near_the_float_limit() -> None:
    # var + sqr overflowed to inf and the gain came out nan, so the daemon
    # could not build a model from such hints.
    perf = PerfParams(0.1, 0.01, 0.1, 0.01, 0.1, 0.01, 1.5)
    huge = GoodputFunction(perf, GradParams(1e308, 1e308), 32)
    unit = GoodputFunction(perf, GradParams(1.0, 1.0), 32)
    sizes = np.array([32, 64, 1024])
    np.testing.assert_allclose(huge.efficiency(sizes), unit.efficiency(sizes), rtol=1e-12)
    assert huge.optimize(1, 1, max_batch_size=1024) == unit.optimize(1, 1, max_batch_size=1024)
