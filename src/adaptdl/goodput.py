"""The goodput model: how fast a job trains, and how useful each sample is.

Goodput is throughput (samples per second, from a fitted model of step time)
multiplied by statistical efficiency (how much progress a sample makes at a
given total batch size, from the gradient noise scale). Pollux-style
scheduling maximises goodput jointly over resources and batch size: a job
given more replicas can use a larger batch, but each sample of a larger batch
is worth less, so the best batch size depends on the allocation.

Notation used throughout: ``num_nodes`` (N), ``num_replicas`` (K),
``atomic_bsz`` (m, the per-replica micro-batch), ``accum_steps`` (s, the
number of *extra* micro-batches accumulated before each optimizer step), so the
total batch is ``B = K * m * (s + 1)``; ``init_batch_size`` (B0) is the batch
size the job's hyper-parameters were tuned for.

Every function is vectorised: arguments may be scalars or broadcastable
arrays, and the result is a Python scalar only when every argument is a
scalar.
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple, overload

import numpy as np
import scipy.optimize
from numpy.typing import ArrayLike, NDArray

from adaptdl._checks import check_bool
from adaptdl._goodput import (
    MAX_BATCH_SIZE,
    NET_FLOOR,
    NUM_CANDIDATES,
    RMSE_SMOOTH,
    ROUND_EPS,
    FitData,
    fit_loss_and_grad,
    step_times,
)

__all__ = ["GoodputFunction", "GradParams", "PerfParams", "fit_perf_params"]

_LOG = logging.getLogger(__name__)

_Scalar = int | float | np.integer[Any] | np.floating[Any]
_FloatArray = NDArray[np.float64]
_IntArray = NDArray[np.int64]


class PerfParams(NamedTuple):
    """Fitted parameters of the step-time model.

    Attributes:
        alpha_c: Constant compute time of a micro-batch (seconds).
        beta_c: Compute time per sample of a micro-batch (seconds/sample).
        alpha_n: Constant all-reduce time across nodes.
        beta_n: Extra inter-node all-reduce time per replica beyond two.
        alpha_r: Constant all-reduce time between replicas on one node.
        beta_r: Extra intra-node all-reduce time per replica beyond two.
        gamma: Overlap of compute and communication as a p-norm exponent:
            1 means none (times add), large values mean full overlap (max).
    """

    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float


class GradParams(NamedTuple):
    """Gradient statistics measured at the initial batch size.

    Attributes:
        sqr: Squared norm of the true gradient, ``|g|^2``.
        var: Trace of the gradient covariance at batch size ``B0``.
    """

    sqr: float
    var: float


def _is_scalar(*values: ArrayLike) -> bool:
    return all(np.ndim(v) == 0 for v in values)


def _as_float(name: str, value: ArrayLike) -> _FloatArray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}={value!r}: expected numbers or an array of numbers") from exc
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}={value!r}: every value must be finite")
    return arr


def _first_bad(arr: NDArray[Any], bad: NDArray[np.bool_]) -> Any:
    return arr[bad].flat[0].item()


def _validate_config(
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
) -> tuple[_FloatArray, _FloatArray]:
    nodes = _as_float("num_nodes", num_nodes)
    replicas = _as_float("num_replicas", num_replicas)
    if np.any(bad := nodes < 1):
        raise ValueError(f"num_nodes={_first_bad(nodes, bad)!r}: must be >= 1")
    if np.any(bad := replicas < 1):
        raise ValueError(f"num_replicas={_first_bad(replicas, bad)!r}: must be >= 1")
    try:
        nodes, replicas = np.broadcast_arrays(nodes, replicas)
    except ValueError as exc:
        raise ValueError(
            f"num_nodes (shape {nodes.shape}) and num_replicas (shape {replicas.shape}) "
            "do not broadcast together"
        ) from exc
    if np.any(bad := nodes > replicas):
        raise ValueError(
            f"num_nodes={_first_bad(nodes, bad)!r} exceeds "
            f"num_replicas={_first_bad(replicas, bad)!r}: every node hosts at least one replica"
        )
    return nodes, replicas


def _validate_perf_params(perf_params: PerfParams) -> PerfParams:
    try:
        params = PerfParams(*(float(v) for v in perf_params))
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"perf_params={perf_params!r}: expected 7 numbers "
            "(alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r, gamma)"
        ) from exc
    for name, value in params._asdict().items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"perf_params.{name}={value!r}: must be finite and >= 0")
    # Below 1 the overlapped compute and sync would take longer than run one
    # after the other; the fit and the scheduler hints use [1, 10] too.
    if params.gamma < 1:
        raise ValueError(
            f"perf_params.gamma={params.gamma!r}: must be >= 1 (1 means no overlap of "
            "compute and gradient sync)"
        )
    if params.alpha_c + params.beta_c <= 0:
        raise ValueError(
            f"perf_params.alpha_c={params.alpha_c!r} and beta_c={params.beta_c!r}: "
            "at least one must be > 0, otherwise a step takes no time"
        )
    return params


# Gradient statistics above this are rescaled before the efficiency's sums.
_GRAD_RESCALE = 1e150


def _validate_grad_params(grad_params: GradParams) -> GradParams:
    try:
        params = GradParams(*(float(v) for v in grad_params))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"grad_params={grad_params!r}: expected 2 numbers (sqr, var)") from exc
    for name, value in params._asdict().items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"grad_params.{name}={value!r}: must be finite and >= 0")
    return params


class GoodputFunction:
    """Goodput of one job as a function of its resources and batch size.

    Args:
        perf_params: Step-time model, usually from :func:`fit_perf_params`.
        grad_params: Gradient statistics at ``init_batch_size``.
        init_batch_size: The batch size the job was tuned for (B0). Goodput is
            only defined for total batch sizes of at least B0, because the
            efficiency model measures the loss of progress relative to it.

    Raises:
        ValueError: A parameter is negative, non-finite or otherwise unusable.
    """

    def __init__(
        self,
        perf_params: PerfParams,
        grad_params: GradParams,
        init_batch_size: float,
    ) -> None:
        self._perf_params = _validate_perf_params(perf_params)
        self._grad_params = _validate_grad_params(grad_params)
        try:
            b0 = float(init_batch_size)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"init_batch_size={init_batch_size!r}: expected a number") from exc
        if not math.isfinite(b0) or not 0 < b0 <= MAX_BATCH_SIZE:
            raise ValueError(f"init_batch_size={init_batch_size!r}: must be > 0 and <= 2**53")
        self._init_batch_size = b0

    @property
    def perf_params(self) -> PerfParams:
        """The step-time model parameters."""
        return self._perf_params

    @property
    def grad_params(self) -> GradParams:
        """The gradient statistics at the initial batch size."""
        return self._grad_params

    @property
    def init_batch_size(self) -> float:
        """The batch size B0 the job was tuned for."""
        return self._init_batch_size

    def __repr__(self) -> str:
        return (
            f"GoodputFunction({self._perf_params!r}, {self._grad_params!r}, "
            f"init_batch_size={self._init_batch_size!r})"
        )

    # ----------------------------------------------------------------- model
    def _throughput(
        self,
        num_nodes: _FloatArray,
        num_replicas: _FloatArray,
        atomic_bsz: NDArray[Any],
        accum_steps: NDArray[Any],
    ) -> _FloatArray:
        t_acc, t_opt = step_times(self._perf_params, num_nodes, num_replicas, atomic_bsz)
        batch = num_replicas * atomic_bsz * (accum_steps + 1)
        with np.errstate(invalid="ignore", over="ignore"):
            # 0 * inf is nan: an overflowed micro-step time must not poison
            # the configurations that take no micro-steps.
            accumulating = np.where(accum_steps > 0, accum_steps * t_acc, 0.0)
            return np.asarray(batch / (accumulating + t_opt), dtype=np.float64)

    def _efficiency(self, batch_size: NDArray[Any]) -> _FloatArray:
        sqr, var = self._grad_params
        top = max(sqr, var)
        if top > _GRAD_RESCALE:
            # The gain depends only on the ratio of the two; near the float
            # limit their sum overflowed and the gain came out nan.
            sqr, var = sqr / top, var / top
        scale = np.asarray(batch_size, dtype=np.float64) / self._init_batch_size
        denom = var / scale + sqr
        with np.errstate(divide="ignore", invalid="ignore"):
            gain = np.where(denom > 0, (var + sqr) / np.where(denom > 0, denom, 1.0), 1.0)
        return np.asarray(gain / scale, dtype=np.float64)

    def _validate_step(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        atomic_bsz: ArrayLike,
        accum_steps: ArrayLike,
    ) -> tuple[_FloatArray, _FloatArray, _FloatArray, _FloatArray]:
        nodes, replicas = _validate_config(num_nodes, num_replicas)
        bsz = _as_float("atomic_bsz", atomic_bsz)
        steps = _as_float("accum_steps", accum_steps)
        if np.any(bad := (bsz <= 0) | (bsz > MAX_BATCH_SIZE)):
            raise ValueError(f"atomic_bsz={_first_bad(bsz, bad)!r}: must be > 0 and <= 2**53")
        if np.any(bad := (steps < 0) | (steps > MAX_BATCH_SIZE)):
            raise ValueError(f"accum_steps={_first_bad(steps, bad)!r}: must be >= 0 and <= 2**53")
        try:
            nodes, replicas, bsz, steps = np.broadcast_arrays(nodes, replicas, bsz, steps)
        except ValueError as exc:
            raise ValueError(
                "num_nodes, num_replicas, atomic_bsz and accum_steps do not broadcast "
                f"together (shapes {np.shape(num_nodes)}, {np.shape(num_replicas)}, "
                f"{np.shape(atomic_bsz)}, {np.shape(accum_steps)})"
            ) from exc
        return nodes, replicas, bsz, steps

    @overload
    def throughput(
        self,
        num_nodes: _Scalar,
        num_replicas: _Scalar,
        atomic_bsz: _Scalar,
        accum_steps: _Scalar,
    ) -> float: ...

    @overload
    def throughput(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        atomic_bsz: ArrayLike,
        accum_steps: ArrayLike,
    ) -> _FloatArray: ...

    def throughput(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        atomic_bsz: ArrayLike,
        accum_steps: ArrayLike,
    ) -> _FloatArray | float:
        """Training samples processed per second.

        One optimizer step processes ``K * m * (s + 1)`` samples and takes
        ``s`` accumulation steps plus one synchronising step.

        Raises:
            ValueError: A configuration is invalid (fewer than one node or
                replica, more nodes than replicas, non-positive batch, negative
                accumulation steps) or the shapes do not broadcast.
        """
        args = self._validate_step(num_nodes, num_replicas, atomic_bsz, accum_steps)
        result = self._throughput(*args)
        if _is_scalar(num_nodes, num_replicas, atomic_bsz, accum_steps):
            return float(result)
        return result

    @overload
    def efficiency(self, batch_size: _Scalar) -> float: ...

    @overload
    def efficiency(self, batch_size: ArrayLike) -> _FloatArray: ...

    def efficiency(self, batch_size: ArrayLike) -> _FloatArray | float:
        """Statistical efficiency of a total batch size relative to B0.

        With ``S = B / B0`` and the gain ``r = (var + sqr) / (var / S + sqr)``,
        the efficiency is ``r / S``: the progress per sample at batch ``B``
        relative to the progress per sample at ``B0``. It is 1 at ``B0`` and
        decreases towards ``B_noise / B`` once ``B`` exceeds the gradient
        noise scale. (Below B0 the formula exceeds 1; ``evaluate`` never
        goes there.)

        Raises:
            ValueError: A batch size is not positive.
        """
        batch = _as_float("batch_size", batch_size)
        if np.any(bad := batch <= 0):
            raise ValueError(f"batch_size={_first_bad(batch, bad)!r}: must be > 0")
        result = self._efficiency(batch)
        if _is_scalar(batch_size):
            return float(result)
        return result

    @overload
    def evaluate(
        self,
        num_nodes: _Scalar,
        num_replicas: _Scalar,
        atomic_bsz: _Scalar,
        accum_steps: _Scalar,
    ) -> float: ...

    @overload
    def evaluate(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        atomic_bsz: ArrayLike,
        accum_steps: ArrayLike,
    ) -> _FloatArray: ...

    def evaluate(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        atomic_bsz: ArrayLike,
        accum_steps: ArrayLike,
    ) -> _FloatArray | float:
        """Goodput: throughput times statistical efficiency.

        Raises:
            ValueError: A configuration is invalid (see :meth:`throughput`) or
                its total batch ``K * m * (s + 1)`` is below ``init_batch_size``.
        """
        nodes, replicas, bsz, steps = self._validate_step(
            num_nodes, num_replicas, atomic_bsz, accum_steps
        )
        batch = replicas * bsz * (steps + 1)
        if np.any(bad := batch < self._init_batch_size):
            raise ValueError(
                f"total batch size num_replicas*atomic_bsz*(accum_steps+1)="
                f"{_first_bad(batch, bad)!r} is below init_batch_size="
                f"{self._init_batch_size!r}: goodput is only defined from the initial "
                "batch size upwards"
            )
        result = self._throughput(nodes, replicas, bsz, steps) * self._efficiency(batch)
        if _is_scalar(num_nodes, num_replicas, atomic_bsz, accum_steps):
            return float(result)
        return np.asarray(result, dtype=np.float64)

    __call__ = evaluate

    # -------------------------------------------------------------- optimize
    @overload
    def optimize(
        self,
        num_nodes: _Scalar,
        num_replicas: _Scalar,
        max_batch_size: float | None = None,
        atomic_bsz_range: tuple[float | None, float | None] | None = None,
        accumulation: bool = False,
    ) -> tuple[float, int, int]: ...

    @overload
    def optimize(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        max_batch_size: float | None = None,
        atomic_bsz_range: tuple[float | None, float | None] | None = None,
        accumulation: bool = False,
    ) -> tuple[_FloatArray, _IntArray, _IntArray]: ...

    def optimize(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        max_batch_size: float | None = None,
        atomic_bsz_range: tuple[float | None, float | None] | None = None,
        accumulation: bool = False,
    ) -> tuple[_FloatArray, _IntArray, _IntArray] | tuple[float, int, int]:
        """Choose the micro-batch size and accumulation steps with the best goodput.

        For each configuration, 50 total batch sizes spaced geometrically from
        ``max(B0, min_atomic * K)`` to ``max_batch_size`` are tried. Each is
        split into ``m`` and ``s``: with accumulation, ``s`` is the fewest extra
        micro-batches that keep ``m <= max_atomic``, and a single replica
        growing beyond B0 always accumulates (one micro-batch per step gives
        only a biased gradient-noise estimate). Without accumulation ``s = 0``
        and a single replica keeps ``m = B0`` (it cannot grow the batch
        without accumulating). ``m`` is rounded up (so the batch may exceed a
        candidate by less than ``K * (s + 1)``) and clamped into the atomic
        range; the atomic range wins over ``max_batch_size`` when
        ``min_atomic * K`` exceeds it. Candidates whose total batch ends
        up below B0 (possible only without accumulation when ``max_atomic``
        is too small) get goodput 0 instead of raising, so a vectorised
        caller still gets an answer for every configuration.

        Args:
            num_nodes: Nodes, scalar or array.
            num_replicas: Replicas, scalar or array broadcastable with
                ``num_nodes``.
            max_batch_size: Largest total batch size; defaults to B0 (no
                batch growth).
            atomic_bsz_range: ``(min_atomic, max_atomic)``; either may be None
                for 1 and ``max_batch_size`` respectively (or ``min_atomic``
                when that is larger: the smallest micro-batch a model can
                run wins over a batch-size cap it does not fit under).
            accumulation: Whether gradient accumulation may be used.

        Returns:
            ``(goodput, atomic_bsz, accum_steps)``, Python scalars when both
            ``num_nodes`` and ``num_replicas`` are scalars, else arrays of
            their broadcast shape.

        Raises:
            ValueError: Invalid configurations, ``max_batch_size`` below B0, or
                an atomic range with ``min_atomic < 1``,
                ``min_atomic > max_atomic`` or no whole size between them.
            TypeError: ``accumulation`` is not a bool.
        """
        nodes, replicas = _validate_config(num_nodes, num_replicas)
        check_bool("accumulation", accumulation)
        b0 = self._init_batch_size
        max_batch, lo, hi = _validate_bounds(b0, max_batch_size, atomic_bsz_range)
        goodput, bsz, steps = self._optimize(nodes, replicas, max_batch, lo, hi, accumulation)
        if _is_scalar(num_nodes, num_replicas):
            return float(goodput), int(bsz), int(steps)
        return goodput, bsz, steps

    def _optimize(
        self,
        nodes: _FloatArray,
        replicas: _FloatArray,
        max_batch: float,
        lo: float,
        hi: float,
        accumulation: bool,
    ) -> tuple[_FloatArray, _IntArray, _IntArray]:
        b0 = self._init_batch_size
        start = np.maximum(b0, lo * replicas)
        # Shape (NUM_CANDIDATES, *config shape); the candidate axis comes first.
        candidates = np.geomspace(start, np.full_like(start, max_batch), NUM_CANDIDATES)
        local = candidates / replicas
        single = replicas == 1
        if accumulation:
            steps = np.maximum(np.ceil(local / hi - ROUND_EPS) - 1.0, 0.0)
            steps = np.where(single & (local > b0 + ROUND_EPS), np.maximum(steps, 1.0), steps)
            bsz = np.ceil(local / (steps + 1.0) - ROUND_EPS)
        else:
            steps = np.zeros_like(local)
            # A fractional B0 still needs a whole micro-batch that reaches it.
            bsz = np.where(single, math.ceil(b0 - ROUND_EPS), np.ceil(local - ROUND_EPS))
        bsz = np.clip(bsz, lo, hi)
        batch = replicas * bsz * (steps + 1.0)
        goodput = self._throughput(nodes, replicas, bsz, steps) * self._efficiency(batch)
        goodput = np.where(batch >= b0 * (1.0 - ROUND_EPS), goodput, 0.0)
        best = np.argmax(goodput, axis=0)[np.newaxis]
        best_goodput = np.take_along_axis(goodput, best, axis=0)[0]
        best_bsz = np.take_along_axis(bsz, best, axis=0)[0]
        best_steps = np.take_along_axis(steps, best, axis=0)[0]
        return (
            np.asarray(best_goodput, dtype=np.float64),
            np.asarray(best_bsz, dtype=np.int64),
            np.asarray(best_steps, dtype=np.int64),
        )


def _bound_number(name: str, given: object, value: object) -> float:
    """``value`` (part of the argument ``name``, given as ``given``) as a float.

    Raises:
        TypeError: it is not a number (an array of several, a word, None...).
    """
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{name}={given!r}: expected a number, got {value!r}") from None


def _validate_bounds(
    b0: float,
    max_batch_size: float | None,
    atomic_bsz_range: tuple[float | None, float | None] | None,
) -> tuple[float, float, float]:
    """Resolve the defaults of ``optimize``'s bounds and check them."""
    if max_batch_size is None:
        max_batch = b0
    else:
        max_batch = _bound_number("max_batch_size", max_batch_size, max_batch_size)
        if not math.isfinite(max_batch) or not b0 <= max_batch <= MAX_BATCH_SIZE:
            raise ValueError(
                f"max_batch_size={max_batch_size!r}: must be >= init_batch_size={b0!r} and <= 2**53"
            )
    if atomic_bsz_range is None:
        atomic_bsz_range = (None, None)
    try:
        lo_arg, hi_arg = atomic_bsz_range
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"atomic_bsz_range={atomic_bsz_range!r}: expected (min_atomic, max_atomic)"
        ) from exc
    lo = 1.0 if lo_arg is None else _bound_number("atomic_bsz_range", atomic_bsz_range, lo_arg)
    # An explicit min_atomic above the largest batch wins over the default max.
    hi = (
        max(max_batch, lo)
        if hi_arg is None
        else _bound_number("atomic_bsz_range", atomic_bsz_range, hi_arg)
    )
    if not math.isfinite(lo) or lo < 1:
        raise ValueError(f"atomic_bsz_range={atomic_bsz_range!r}: min_atomic must be >= 1")
    if not math.isfinite(hi) or hi < lo or hi > MAX_BATCH_SIZE:
        raise ValueError(
            f"atomic_bsz_range={atomic_bsz_range!r}: max_atomic={hi!r} must be >= "
            f"min_atomic={lo!r} and <= 2**53"
        )
    # Micro-batches are whole samples: fractional bounds shrink to the whole
    # sizes inside them, so the size returned is the size evaluated. The
    # default max_atomic (the largest batch) rounds up: it is no real limit.
    whole_lo = math.ceil(lo - ROUND_EPS)
    whole_hi = math.ceil(hi - ROUND_EPS) if hi_arg is None else math.floor(hi + ROUND_EPS)
    if whole_hi < whole_lo:
        raise ValueError(
            f"atomic_bsz_range={atomic_bsz_range!r}: no whole micro-batch size lies "
            f"between min_atomic={lo!r} and max_atomic={hi!r}"
        )
    return max_batch, float(whole_lo), float(whole_hi)


# ------------------------------------------------------------------- fitting
_START = (0.1, 0.01, 0.1, 0.01, 0.1, 0.01, 1.001)
_LOWER = (NET_FLOOR,) * 6 + (1.0,)
_UPPER = (math.inf,) * 6 + (10.0,)


def _fit_array(name: str, value: ArrayLike) -> _FloatArray:
    arr = _as_float(name, value)
    if arr.ndim > 1:
        raise ValueError(f"{name} has shape {arr.shape}: expected a 1-D array of observations")
    return np.atleast_1d(arr)


def fit_perf_params(
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
    atomic_bsz: ArrayLike,
    accum_step_time: ArrayLike,
    optim_step_time: ArrayLike,
    *,
    smoothing: float = RMSE_SMOOTH,
) -> PerfParams:
    """Fit the step-time model to profiled step times.

    Minimises the RMSE of log step times (accumulation and optimizer steps)
    with weak priors (gamma near 1, little retrogression) by L-BFGS-B with an
    exact gradient. Parameters the data cannot identify are pinned:

    * one distinct ``atomic_bsz``: ``alpha_c`` is fixed to half the mean
      accumulation time, splitting it evenly between the constant and the
      per-sample term (optimistic about larger batches);
    * no multi-node observation: ``alpha_n``, ``beta_n`` at their lower bound,
      and afterwards raised to at least 1.1 times the intra-node values, as
      crossing nodes is assumed to be no faster than staying on one;
    * no single-node multi-replica observation: ``alpha_r``, ``beta_r`` at
      their lower bound;
    * no observation with more than 2 replicas: both betas at their lower
      bound (retrogression cannot be seen).

    Args:
        num_nodes: Nodes of each observation.
        num_replicas: Replicas of each observation.
        atomic_bsz: Per-replica micro-batch of each observation.
        accum_step_time: Mean seconds per accumulation (non-syncing) step.
        optim_step_time: Mean seconds per optimizer (syncing) step.
        smoothing: Added to each mean squared log error before its square
            root. The default rounds off the kink of the RMSE at an exact fit,
            where the original's line search stalled (e.g. when the start
            values already fit one of the two step times); 0 is the original's
            loss exactly, which the simulator uses to replay its agent.

    Returns:
        The fitted :class:`PerfParams`. If the optimiser does not converge, a
        warning is logged and the best parameters it found are returned.

    Raises:
        ValueError: The arrays are empty, differ in length, hold invalid
            configurations or non-positive times.
    """
    arrays = {
        "num_nodes": _fit_array("num_nodes", num_nodes),
        "num_replicas": _fit_array("num_replicas", num_replicas),
        "atomic_bsz": _fit_array("atomic_bsz", atomic_bsz),
        "accum_step_time": _fit_array("accum_step_time", accum_step_time),
        "optim_step_time": _fit_array("optim_step_time", optim_step_time),
    }
    lengths = {name: arr.shape[0] for name, arr in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"fit_perf_params: arrays must have equal lengths, got {lengths}")
    if lengths["num_nodes"] == 0:
        raise ValueError("fit_perf_params: no observations (all arrays are empty)")
    nodes, replicas = _validate_config(arrays["num_nodes"], arrays["num_replicas"])
    bsz = arrays["atomic_bsz"]
    if np.any(bad := bsz <= 0):
        raise ValueError(f"atomic_bsz={_first_bad(bsz, bad)!r}: must be > 0")
    for name in ("accum_step_time", "optim_step_time"):
        times = arrays[name]
        if np.any(bad := times <= 0):
            raise ValueError(f"{name}={_first_bad(times, bad)!r}: step times must be > 0")
    if not (isinstance(smoothing, (int, float)) and math.isfinite(smoothing) and smoothing >= 0):
        raise ValueError(f"smoothing={smoothing!r}: expected a finite number >= 0")
    accum_time = arrays["accum_step_time"]
    data = FitData.build(nodes, replicas, bsz, accum_time, arrays["optim_step_time"])

    start = np.array(_START, dtype=np.float64)
    lower = np.array(_LOWER, dtype=np.float64)
    upper = np.array(_UPPER, dtype=np.float64)

    def pin(index: int, value: float) -> None:
        start[index] = lower[index] = upper[index] = value

    if np.unique(bsz).size == 1:
        pin(0, float(np.mean(accum_time)) / 2.0)
    no_multi_node = not np.any(nodes > 1)
    if no_multi_node:
        pin(2, _LOWER[2])
        pin(3, _LOWER[3])
    if not np.any((nodes == 1) & (replicas > 1)):
        pin(4, _LOWER[4])
        pin(5, _LOWER[5])
    if not np.any(replicas > 2):
        pin(3, _LOWER[3])
        pin(5, _LOWER[5])

    best = _minimize(data, start, lower, upper, float(smoothing))
    params = PerfParams(*(float(v) for v in best))
    if no_multi_node:
        params = params._replace(
            alpha_n=max(params.alpha_n, 1.1 * params.alpha_r),
            beta_n=max(params.beta_n, 1.1 * params.beta_r),
        )
    _LOG.debug("fitted %s on %d observations", params, lengths["num_nodes"])
    return params


def _minimize(
    data: FitData,
    start: _FloatArray,
    lower: _FloatArray,
    upper: _FloatArray,
    smoothing: float,
) -> _FloatArray:
    """Run L-BFGS-B and return the best point seen, even if it did not converge."""
    best_x = start.copy()
    best_loss = math.inf

    def objective(x: _FloatArray) -> tuple[float, _FloatArray]:
        nonlocal best_x, best_loss
        loss, grad = fit_loss_and_grad(x, data, smoothing)
        if not math.isfinite(loss) or not np.all(np.isfinite(grad)):
            # Tell the line search this point is bad without poisoning it with NaN.
            return 1e30, np.zeros_like(x)
        if loss < best_loss:
            best_loss = loss
            best_x = x.copy()
        return loss, grad

    try:
        result = scipy.optimize.minimize(
            objective,
            start,
            jac=True,
            method="L-BFGS-B",
            bounds=scipy.optimize.Bounds(lower, upper),
        )
    except (ValueError, FloatingPointError, ArithmeticError) as exc:
        _LOG.warning("perf-params fit failed (%s); using the best parameters found", exc)
        return np.asarray(np.clip(best_x, lower, upper), dtype=np.float64)
    if not result.success:
        _LOG.warning(
            "perf-params fit did not converge (%s); using the best parameters found (loss %.4g)",
            result.message,
            best_loss,
        )
    return np.asarray(np.clip(best_x, lower, upper), dtype=np.float64)
