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

* a DDP communication hook (:meth:`~torch.nn.parallel.DistributedDataParallel.register_comm_hook`)
  sees each bucket of the *local* gradient before it is all-reduced, launches
  the all-reduce itself, and sees the *averaged* gradient in the future's
  continuation;
* accumulation micro-batches run under DDP's ``require_backward_grad_sync =
  False`` (no communication at all); while accumulating, per-parameter
  :meth:`torch.Tensor.register_hook` hooks, installed only once accumulation
  is first used, measure each micro-batch's local gradient before it is added
  into ``.grad``, so ``c = replicas x micro-batches``;
* the hook also divides the bucket by ``replicas x micro-batches`` instead of
  DDP's ``replicas``, so ``.grad`` is the mean over the whole batch.

Cheap by construction: only one optimizer step in ``measure_every`` is
measured (each measurement standing for that many steps); there is no extra
collective per step, because the sum of the local norms over replicas is
all-reduced for ``stats_interval`` measurements at a time; and there is no
device synchronisation, because on a GPU all statistics, the moving averages
and the finiteness checks live in device tensors. After each optimizer step a
non-blocking copy to pinned host memory is started and picked up, once its
CUDA event has completed, by the next host read-out (``sqr_avg``, ``gain``,
the learning-rate factors). On a GPU the host view therefore lags the device
by one or two steps, which is immaterial for an average whose time constant
is about a thousand steps; on the CPU it is always current.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from adaptdl.torch._gns_hook import gns_comm_hook

__all__ = ["AdamGradientNoiseScale", "GradientNoiseScale"]

logger = logging.getLogger(__name__)

_SMOOTHING = 0.999
"""Per-unit-scale factor of the moving averages (``0.999 ** S`` per step)."""

_VAR_FLOOR = 1e-6
"""Lower bound of each group's variance read-out, so the gain stays defined."""

_ADAM_WARMUP_STEPS = 5
"""Adam steps before its second moment is trusted as a preconditioner."""

_FloatArray = npt.NDArray[np.float64]


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _sum_sq(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of squares as a float64 scalar tensor, computed at the tensor's speed.

    A float64 reduction over a float32 bucket costs about six times as much
    on a CPU as the native one; the native reduction (pairwise summation) is
    accurate to ~1e-7 relative, far below the estimator's own noise, and an
    overflow only yields inf, which the update rejects.
    """
    flat = tensor.reshape(-1)
    if flat.dtype in (torch.float32, torch.float64):
        return torch.dot(flat, flat).to(torch.float64)
    norm: torch.Tensor = torch.linalg.vector_norm(flat, dtype=torch.float32)
    return norm.square().to(torch.float64)


def _sum_parts(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """Sum per-bucket statistics (usually one or two buckets, so plain adds)."""
    values = iter(parts.values())
    result = next(values)
    for value in values:
        result = result + value
    return result


@dataclasses.dataclass
class _Observation:
    """One optimizer step's raw statistics, waiting to enter the moving averages."""

    local_sum: torch.Tensor
    total: torch.Tensor
    count: int
    scale: float
    loss_scale: float
    reduce: bool
    reset: bool
    steps: int


class _Layout:
    """Where each parameter of one bucket lives in its flat buffer."""

    def __init__(self, params: Sequence[torch.Tensor], group_of: dict[int, int]) -> None:
        self.segments: list[tuple[int, int, int, torch.Tensor]] = []
        offset = 0
        for param in params:
            numel = param.numel()
            self.segments.append((group_of.get(id(param), 0), offset, offset + numel, param))
            offset += numel
        self.numel = offset
        # Consecutive parameters of the same group merged into one run, so an
        # unpreconditioned bucket of one group costs a single reduction.
        runs: list[tuple[int, int, int]] = []
        for group, start, end, _ in self.segments:
            if runs and runs[-1][0] == group and runs[-1][2] == start:
                runs[-1] = (group, runs[-1][1], end)
            else:
                runs.append((group, start, end))
        self.runs = runs


class GradientNoiseScale:
    """Estimates ``|G|^2`` and ``tr(Sigma)`` per parameter group and tracks progress.

    Creating the object registers a communication hook on ``adp`` (DDP
    accepts one hook per model). :class:`~adaptdl.torch.AdaptiveDataParallel`
    creates it for you. On a plain DDP model every backward counts as one
    optimizer step, and :meth:`reset_accumulation` must be called after each
    step (the scaling rules' ``zero_grad`` does that).

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

    measure_every: int = 4
    """Optimizer steps per measurement of the noise statistics.

    Measuring costs two reductions over the gradient (plus, for one replica,
    a copy), which on a small CPU model is several percent of a step. The
    averages smooth over ~1000 steps anyway, so measuring one step in four
    (each measurement weighted as four steps) loses little precision and
    removes three quarters of the cost. Set it to 1 to measure every step.
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
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
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
        self._pending_copy: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._progress = 0.0
        self._prev_scale = 0.0
        self._biased = False

        # Per-window (one optimizer step's micro-batches) bookkeeping.
        self._accum_count = 0
        self._window_index = -1
        self._measuring = True
        self._storing = True
        self._should_zero_grad = True
        self._window_closed = False
        self._sync_pending = False
        self._micro_active = False
        self._micro_local: torch.Tensor | None = None
        self._bucket_local: dict[int, torch.Tensor] = {}
        self._bucket_total: dict[int, torch.Tensor] = {}
        self._differenced = False
        self._pair_valid = True
        # One replica: bucket index -> (layout key, gradient, its squared norm, window).
        self._prev_buckets: dict[int, tuple[tuple[int, ...], torch.Tensor, torch.Tensor, int]] = {}
        # Observations whose local terms still need summing over replicas; see
        # stats_interval.
        self._pending: list[_Observation] = []
        self._layouts: dict[tuple[int, ...], _Layout] = {}
        self._micro_handles: list[Any] = []
        self.measuring_enabled = True
        """False skips the noise measurement of the steps that start from now on.

        AdaptiveDataParallel turns it off for steps outside an
        AdaptiveDataLoader, whose batch size (and hence scale) is unknown.
        Every replica sets it alike, so they still flush at the same steps.
        """
        self._sync_start: float | torch.cuda.Event | None = None
        self._sync_end: float | torch.cuda.Event | None = None
        self._sync_time: float | None = None

        adp.register_comm_hook(self, gns_comm_hook)

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
        self._clear_window()
        self._should_zero_grad = True

    def set_accum_scale(self, accum_scale: float) -> None:
        """Set the per-micro-batch scale; a change discards a partial accumulation.

        Gradients accumulated at one scale cannot be combined with micro-batches
        of another (the estimator's ``S`` would be wrong), so a change resets.

        Raises:
            ValueError: ``accum_scale`` is not a positive finite number.
        """
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

    def get_progress(self) -> float:
        """Training progress in scale-invariant iterations (the sum of gains)."""
        return self._progress

    def set_progress(self, progress: float) -> None:
        """Set the training progress.

        Raises:
            ValueError: ``progress`` is negative or not finite.
        """
        if isinstance(progress, bool) or not isinstance(progress, int | float):
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
        scale = _check_positive("scale", scale)
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
        """Everything needed to resume the estimates after a restart (CPU values)."""
        self._refresh_host(block=True)
        return {
            "ema": self._ema.detach().cpu().tolist(),
            "skipped": float(self._skipped.item()),
            "sqr_avg": self._sqr_host.tolist(),
            "var_avg": self._var_host.tolist(),
            "progress": self._progress,
            "prev_scale": self._prev_scale,
            "biased": self._biased,
            "accum_scale": self._accum_scale,
        }

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
        self._pending_copy = None
        # The averages are authoritative; the stored read-outs only cover
        # groups that never had an update.
        self._apply_host(ema.flatten().numpy(), warn=False)
        self._progress = float(state["progress"])
        self._prev_scale = float(state["prev_scale"])
        self._biased = bool(state["biased"])
        self._accum_scale = float(state["accum_scale"])

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
        if self._micro_active and not self._micro_handles:
            self._install_micro_hooks()
        self._accum_count += 1
        self._should_zero_grad = sync
        if sync:
            self._window_closed = True

    def _prepare_accumulation(self) -> None:
        """Install the per-micro-batch hooks before the first accumulating backward."""
        if not self._micro_handles:
            self._install_micro_hooks()

    def _install_micro_hooks(self) -> None:
        for index, group in enumerate(self._params_of_group):
            for param in group:
                if param.requires_grad:
                    hook = self._make_micro_hook(index, param)
                    handle = param.register_hook(hook)  # type: ignore[no-untyped-call]
                    self._micro_handles.append(handle)

    def _make_micro_hook(
        self, index: int, param: torch.Tensor
    ) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if self._micro_active and self._measuring:
                sqr = self._sqr_norm(grad, param)
                if self._micro_local is None:
                    self._micro_local = torch.zeros(
                        self._num_groups, dtype=torch.float64, device=sqr.device
                    )
                self._micro_local[index] += sqr
            return None

        return hook

    def _sqr_norm(self, grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        precond = self._preconditioner(param) if self._uses_preconditioner() else None
        if precond is not None:
            grad = grad.reshape(param.shape) / precond
        return _sum_sq(grad)

    def _layout(self, params: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], _Layout]:
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None:
            layout = _Layout(params, self._group_of)
            self._layouts[key] = layout
        return key, layout

    def _group_sqr(self, flat: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """Per-group squared norms of a flat bucket, preconditioned if needed."""
        parts: list[torch.Tensor | None] = [None] * self._num_groups
        if self._uses_preconditioner():
            pieces: Iterable[tuple[int, torch.Tensor]] = (
                (group, self._sqr_norm(flat[start:end], param))
                for group, start, end, param in layout.segments
            )
        else:
            pieces = ((group, _sum_sq(flat[start:end])) for group, start, end in layout.runs)
        for group, value in pieces:
            previous = parts[group]
            parts[group] = value if previous is None else previous + value
        return self._stack_groups(parts, flat.device)

    def _group_dot(self, flat: torch.Tensor, other: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """Per-group inner products of two flat buckets of the same layout."""
        parts: list[torch.Tensor | None] = [None] * self._num_groups
        if self._uses_preconditioner():
            for group, start, end, param in layout.segments:
                precond = self._preconditioner(param)
                a = flat[start:end].reshape(-1)
                b = other[start:end].reshape(-1)
                if precond is not None:
                    inv = precond.reshape(-1).reciprocal()
                    a, b = a * inv, b * inv
                value = torch.dot(a, b).to(torch.float64)
                previous = parts[group]
                parts[group] = value if previous is None else previous + value
        else:
            for group, start, end in layout.runs:
                a, b = flat[start:end], other[start:end]
                if a.dtype not in (torch.float32, torch.float64):
                    a, b = a.float(), b.float()
                value = torch.dot(a, b).to(torch.float64)
                previous = parts[group]
                parts[group] = value if previous is None else previous + value
        return self._stack_groups(parts, flat.device)

    def _stack_groups(self, parts: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        if self._num_groups == 1 and parts[0] is not None:
            return parts[0].reshape(1)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack([zero if p is None else p for p in parts])

    def _on_bucket(
        self,
        bucket: dist.GradBucket,  # type: ignore[name-defined]
    ) -> torch.futures.Future[torch.Tensor]:
        if self._accum_count == 0:
            # A backward that AdaptiveDataParallel.forward did not announce
            # (a plain DDP model): it is a whole optimizer step by itself.
            self._on_backward_start(True)
        buffer = bucket.buffer()
        index = bucket.index()
        is_last = bucket.is_last()
        micro = max(self._accum_count, 1)
        replicas = self._world_size
        measuring = self._measuring
        # Layouts are only needed on measured (or, one replica, stored) steps.
        if measuring or self._storing:
            key, layout = self._layout(bucket.parameters())
        self._sync_pending = self._sync_pending or measuring
        self._differenced = self._num_replicas == 1 and not self._micro_active
        if self._differenced:
            if measuring or self._storing:
                self._observe_differenced(index, key, layout, buffer, measuring, self._storing)
        else:
            self._prev_buckets.clear()
            if measuring and not self._micro_active:
                self._bucket_local[index] = self._group_sqr(buffer, layout)
        if is_last:
            self._sync_start = self._timestamp()
        divisor = replicas * micro
        if divisor != 1:
            buffer.div_(divisor)
        if replicas > 1:
            future = dist.all_reduce(buffer, group=self._group, async_op=True).get_future()
        else:
            future = torch.futures.Future()
            future.set_result([buffer])

        def after(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            averaged = fut.value()[0]
            if measuring and not self._differenced:
                self._bucket_total[index] = self._group_sqr(averaged, layout)
            if is_last:
                self._sync_end = self._timestamp()
            return averaged

        result: torch.futures.Future[torch.Tensor] = future.then(after)
        return result

    def _observe_differenced(
        self,
        index: int,
        key: tuple[int, ...],
        layout: _Layout,
        buffer: torch.Tensor,
        measure: bool,
        store: bool,
    ) -> None:
        """Pair this step's bucket with the previous step's (one replica, no accumulation).

        ``store`` keeps this step's gradient for the next (measured) step;
        ``measure`` pairs this step with the stored one.
        """
        current = self._group_sqr(buffer, layout)
        previous = self._prev_buckets.get(index)
        valid = (
            previous is not None
            and previous[0] == key
            and previous[1].numel() == buffer.numel()
            and previous[3] == self._window_index - 1
        )
        if measure:
            if valid and previous is not None:
                _, prev, prev_sqr, _ = previous
                # |(g + p)/2|^2 = (|g|^2 + |p|^2 + 2 g.p) / 4, reusing last step's |p|^2.
                cross = self._group_dot(buffer, prev, layout)
                self._bucket_local[index] = prev_sqr + current
                self._bucket_total[index] = (prev_sqr + current + 2.0 * cross) * 0.25
            else:
                self._pair_valid = False
        if store:
            if previous is not None and previous[1].numel() == buffer.numel():
                previous[1].copy_(buffer)
                saved = previous[1]
            else:
                saved = buffer.detach().clone()
            self._prev_buckets[index] = (key, saved, current, self._window_index)

    def _local_terms(self) -> torch.Tensor | None:
        if self._micro_active:
            return self._micro_local
        if not self._bucket_local:
            return None
        return _sum_parts(self._bucket_local)

    def _timestamp(self) -> float | torch.cuda.Event:
        if self._device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def _clear_window(self) -> None:
        self._accum_count = 0
        self._window_closed = False
        self._sync_pending = False
        self._micro_active = False
        self._micro_local = None
        # Cleared in place: this runs every step, and nothing keeps the dicts.
        self._bucket_local.clear()
        self._bucket_total.clear()
        self._pair_valid = True

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
        start, end = self._sync_start, self._sync_end
        if start is None or end is None:
            return None
        if isinstance(start, float) and isinstance(end, float):
            self._sync_start = self._sync_end = None
            return max(end - start, 0.0)
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            if not end.query():  # type: ignore[no-untyped-call]
                return None  # read it on a later step rather than wait
            self._sync_start = self._sync_end = None
            return float(start.elapsed_time(end)) / 1e3
        return None

    def _finalize(self) -> float | None:
        """Fold this step's observations into the moving averages.

        Called by the scaling rule just before the optimizer step of a
        synchronising step. Returns the sync time measured for the step, if
        available, so the caller can report it to the profiler.
        """
        sync_time = self._collect_sync_time()
        if not self._sync_pending:
            return sync_time
        self._sync_pending = False
        micro = max(self._accum_count, 1)
        scale = self._accum_scale * micro
        local_sum: torch.Tensor | None
        if self._differenced:
            if not self._pair_valid or not self._bucket_local:
                return sync_time
            count = 2
            scale = 2.0 * self._accum_scale
            local_sum = _sum_parts(self._bucket_local)
            total = _sum_parts(self._bucket_total)
        else:
            count = self._num_replicas * micro
            local_sum = self._local_terms()
            if local_sum is None:
                # Every rank must contribute to the later all-reduce.
                local_sum = torch.zeros(self._num_groups, dtype=torch.float64, device=self._device)
            total = _sum_parts(self._bucket_total)
        loss_scale = self._loss_scale()
        if loss_scale is None:
            message = (
                "skipping the gradient-noise update of this step: the GradScaler loss "
                "scale is zero or not finite"
            )
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            return sync_time
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
                loss_scale,
                reduce=reduce,
                reset=reset,
                steps=max(1, int(self.measure_every)),
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
        the same number of them, and :meth:`State.sync` flushes everywhere
        before a checkpoint.
        """
        pending, self._pending = self._pending, []
        reduced = [obs for obs in pending if obs.reduce]
        if reduced and self._world_size > 1:
            stacked = torch.stack([obs.local_sum for obs in reduced])
            dist.all_reduce(stacked, group=self._group)
            for obs, row in zip(reduced, stacked.unbind(0)):
                obs.local_sum = row
        for obs in pending:
            if obs.reset:
                self._ema.zero_()
            self._update(obs.local_sum, obs.total, obs.count, obs.scale, obs.loss_scale, obs.steps)

    def _update(
        self,
        local_sum: torch.Tensor,
        total: torch.Tensor,
        count: int,
        scale: float,
        loss_scale: float,
        steps: int = 1,
    ) -> None:
        """Apply one estimator update to the averages, rejecting non-finite values.

        ``steps`` is how many optimizer steps the measurement stands for.
        """
        inv = 1.0 / (loss_scale * loss_scale)
        theta = _SMOOTHING ** (scale * steps)
        if self._ema.device.type == "cpu":
            # Nothing to overlap with on a CPU, and a dozen tiny tensor ops cost
            # far more dispatch time than the same arithmetic in numpy.
            self._update_host(local_sum, total, count, scale, inv, theta)
            return
        local = local_sum.to(self._ema.device) * (inv / count)
        total = total.to(self._ema.device) * inv
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
        inv: float,
        theta: float,
    ) -> None:
        """The CPU twin of the device update: the same arithmetic on numpy views."""
        local = local_sum.detach().numpy() * (inv / count)
        total_np = total.detach().numpy() * inv
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
        if self._ema.device.type == "cpu":
            values = np.concatenate([self._ema.numpy().ravel(), [float(self._skipped)]])
            self._apply_host(values, warn=True)
            return
        packed = torch.cat([self._ema.flatten(), self._skipped.reshape(1)])
        if packed.device.type == "cuda":
            if self._pending_copy is not None:
                return  # the previous read-back is still in flight; keep it
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._pending_copy = (host, event)
        else:
            self._pending_copy = (packed.clone(), None)
        self._refresh_host()

    def _refresh_host(self, block: bool = False) -> None:
        pending = self._pending_copy
        if pending is None:
            return
        host, event = pending
        if event is not None:
            if block:
                event.synchronize()
            elif not event.query():  # type: ignore[no-untyped-call]
                return
        self._pending_copy = None
        self._apply_host(host.numpy().astype(np.float64), warn=True)

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
                "non-finite gradients (NaN/inf loss?); the estimates keep their previous values"
            )
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        self._skipped_host = skipped


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
