"""Step-time profiling, the fitted goodput model, and scheduling hints.

The adaptive batch size and the cluster scheduler both need a model of how
fast this job runs for a given configuration (nodes, replicas, per-replica
batch). The model is fitted to the job's own measurements:

* every training step is timed from the moment the batch is handed to the
  user until the user asks for the next one, which covers forward, backward
  and the optimizer step but *not* data loading (a slow input pipeline must not
  be mistaken for slow compute);
* times are summed per key ``(num_nodes, num_replicas, atomic_bsz)``, split
  into accumulation steps (no gradient sync) and optimizer steps (with sync);
* rank 0 refits :class:`adaptdl.goodput.PerfParams` about every
  :func:`adaptdl.env.fit_interval` seconds and, when a supervisor is known,
  posts the result as scheduling hints.

Gradient statistics (:func:`update_grad_params`) come from the data-parallel
wrapper; the training progress in scale-invariant iterations comes from its
scaling rule. All of it is one checkpointed state, so a restarted job keeps its
profile (including the measurements at other replica counts) and does not
have to relearn its model.
"""

from __future__ import annotations

import collections
import logging
import math
import pickle
import time
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

from adaptdl import _procstate, checkpoint, env, goodput
from adaptdl.torch import epoch

__all__ = [
    "get_goodput_fn",
    "get_progress",
    "get_sched_hints",
    "profile_step_commit",
    "profile_step_start",
    "profile_sync_time",
    "remaining_iterations",
    "set_batch_size",
    "set_dataset_size",
    "set_epoch_progress",
    "update_grad_params",
    "update_progress",
]

logger = logging.getLogger(__name__)

ProfileKey = tuple[int, int, int]

_PROFILE_FIELDS = (
    "accum_step_time",
    "accum_count",
    "optim_step_time",
    "optim_sync_time",
    "optim_count",
)


def _new_entry() -> dict[str, float]:
    return dict.fromkeys(_PROFILE_FIELDS, 0.0)


class _MetricsState(checkpoint.State):
    """Everything the goodput model is built from, saved with each checkpoint."""

    _adaptdl_internal = True  # forgotten in a forked test replica (_procstate)
    _adaptdl_owns_name = True  # a name checkpoint reserves for the library

    def __init__(self) -> None:
        super().__init__("adaptdl-metrics")
        self.profile: dict[ProfileKey, dict[str, float]] = collections.defaultdict(_new_entry)
        self.perf_params: goodput.PerfParams | None = None
        self.grad_params: dict[str, tuple[float, float]] = {}
        self.init_batch_size: int | None = None
        self.max_batch_size: int | None = None
        self.local_bsz_bounds: tuple[int | None, int | None] | None = None
        self.gradient_accumulation = False
        self.progress = 0.0
        # Not checkpointed: the training loader reports them again on its loops.
        self.dataset_size: int | None = None
        self.epoch_progress: float | None = None
        # Not checkpointed: per-process bookkeeping of the step being timed.
        self.step_start: float | None = None
        self.step_atomic_bsz = 0
        self.step_sync_time = 0.0
        self.last_fit: float | None = None
        # The job's shape and fit interval, read from the environment once per
        # process on the first commit: they cannot change while it runs (a
        # rescale restarts the process), and parsing them costs more than the
        # rest of the per-step bookkeeping together.
        self.env_cache: tuple[int, int, bool, float] | None = None

    def save(self, fileobj: IO[bytes]) -> None:
        payload = {
            "profile": {key: dict(value) for key, value in self.profile.items()},
            "perf_params": None if self.perf_params is None else tuple(self.perf_params),
            "grad_params": dict(self.grad_params),
            "init_batch_size": self.init_batch_size,
            "max_batch_size": self.max_batch_size,
            "local_bsz_bounds": self.local_bsz_bounds,
            "gradient_accumulation": self.gradient_accumulation,
            "progress": self.progress,
        }
        pickle.dump(payload, fileobj)

    def load(self, fileobj: IO[bytes]) -> None:
        payload = pickle.load(fileobj)  # noqa: S301 - our own checkpoint
        self.profile = collections.defaultdict(_new_entry)
        for key, value in payload["profile"].items():
            self.profile[tuple(key)].update(value)
        perf = payload["perf_params"]
        self.perf_params = None if perf is None else goodput.PerfParams(*perf)
        self.grad_params = dict(payload["grad_params"])
        self.init_batch_size = payload["init_batch_size"]
        self.max_batch_size = payload["max_batch_size"]
        self.local_bsz_bounds = payload["local_bsz_bounds"]
        self.gradient_accumulation = payload["gradient_accumulation"]
        self.progress = payload["progress"]


_STATE: _MetricsState | None = None


def _state() -> _MetricsState:
    """The process-wide metrics state, created and restored on first use."""
    global _STATE
    if _STATE is None:
        _STATE = _MetricsState()
        checkpoint.load_state(_STATE)
    return _STATE


def profile_step_start(atomic_bsz: int) -> None:
    """Start timing a step that processes ``atomic_bsz`` samples on this replica.

    A step of no samples (a custom loader profiling before its batch size is
    decided) is not timed: the performance model has no such configuration,
    and one such entry would make every later fit fail.
    """
    state = _state()
    if atomic_bsz < 1:
        state.step_start = None
        return
    state.step_start = time.perf_counter()
    state.step_atomic_bsz = int(atomic_bsz)
    state.step_sync_time = 0.0


def profile_sync_time(sync_time: float) -> None:
    """Add ``sync_time`` seconds of gradient synchronisation to the current step."""
    if not math.isfinite(sync_time) or sync_time < 0:
        logger.debug("ignoring invalid sync time %r", sync_time)
        return
    _state().step_sync_time += float(sync_time)


def profile_step_commit(accumulation_step: bool = False) -> None:
    """Record the step started by :func:`profile_step_start`.

    Args:
        accumulation_step: True for a step whose gradients are only
            accumulated locally (no all-reduce, no optimizer step).
    """
    state = _state()
    if state.step_start is None:
        return
    elapsed = time.perf_counter() - state.step_start
    cached = state.env_cache
    if cached is None:
        cached = (env.num_nodes(), env.num_replicas(), env.replica_rank() == 0, env.fit_interval())
        state.env_cache = cached
    nodes, replicas, is_rank0, fit_interval = cached
    entry = state.profile[(nodes, replicas, state.step_atomic_bsz)]
    if accumulation_step:
        entry["accum_step_time"] += elapsed
        entry["accum_count"] += 1
    else:
        entry["optim_step_time"] += elapsed
        entry["optim_sync_time"] += state.step_sync_time
        entry["optim_count"] += 1
    state.step_start = None
    state.step_sync_time = 0.0
    if accumulation_step:
        return
    now = time.monotonic()
    if state.last_fit is None:
        state.last_fit = now
    elif is_rank0 and now - state.last_fit >= fit_interval:
        _fit_perf_params()
        _report_sched_hints()
        state.last_fit = time.monotonic()


def update_grad_params(key: str, sqr: float, var: float) -> None:
    """Record the gradient statistics of one data-parallel model under ``key``.

    The goodput model uses the sum over all keys, so a job that trains several
    models (e.g. a GAN) is judged on all of them together.
    """
    if not (math.isfinite(sqr) and math.isfinite(var)):
        logger.debug("ignoring non-finite gradient statistics %r, %r", sqr, var)
        return
    _state().grad_params[str(key)] = (float(sqr), float(var))


def update_progress(progress: float) -> None:
    """Set the training progress, in scale-invariant iterations."""
    _state().progress = float(progress)


def get_progress() -> float:
    """The training progress, in scale-invariant iterations."""
    return _state().progress


def set_dataset_size(size: int) -> None:
    """Record how many samples one pass of the training loader covers."""
    _state().dataset_size = int(size)


def set_epoch_progress(per_epoch: float) -> None:
    """Record the progress one epoch has made on average so far."""
    _state().epoch_progress = float(per_epoch)


def remaining_iterations() -> float | None:
    """Optimizer steps at the initial batch size left until the target epoch.

    The work left is ``E * P - progress`` for the target epoch ``E`` of
    :func:`~adaptdl.torch.epoch.remaining_epochs_until`, with ``P`` the
    scale-invariant progress of one epoch: as measured over the epochs
    finished so far, or until one has, ``N / B0`` (one pass of the training
    loader's ``N`` samples at ``B0``; a pass whose last batch is short makes
    a little more). None while the dataset size, the initial batch size or
    the target is unknown, or outside an epoch loop.
    """
    state = _state()
    target = epoch.target_epoch()
    if not state.dataset_size or not state.init_batch_size or target is None:
        return None
    per_epoch = state.epoch_progress or state.dataset_size / state.init_batch_size
    return max(target * per_epoch - state.progress, 0.0)


def set_batch_size(
    init_batch_size: int,
    max_batch_size: int | None,
    local_bsz_bounds: tuple[int | None, int | None] | None,
    gradient_accumulation: bool,
) -> None:
    """Record the batch-size limits of the training loader (for the model and hints)."""
    state = _state()
    state.init_batch_size = int(init_batch_size)
    state.max_batch_size = None if max_batch_size is None else int(max_batch_size)
    state.local_bsz_bounds = None if local_bsz_bounds is None else tuple(local_bsz_bounds)  # type: ignore[assignment]
    state.gradient_accumulation = bool(gradient_accumulation)


def _grad_params() -> goodput.GradParams | None:
    state = _state()
    if not state.grad_params:
        return None
    sqr = sum(value[0] for value in state.grad_params.values())
    var = sum(value[1] for value in state.grad_params.values())
    return goodput.GradParams(sqr, var)


def get_goodput_fn() -> goodput.GoodputFunction | None:
    """The goodput model of this job, or None until perf and grad params are known."""
    state = _state()
    grad = _grad_params()
    if state.perf_params is None or grad is None or state.init_batch_size is None:
        return None
    if not grad.sqr > 0:
        # A |G|^2 estimate at or below zero (noise, or the one-replica
        # differenced estimator under momentum, whose consecutive gradients
        # can be anti-correlated) would mean an infinite noise scale: the model
        # would promise perfect scaling to the largest batch and AdaScale would
        # raise the learning rate by the full scale, which diverged in the
        # time-to-target benchmark. Unknown is safer: keep the batch size.
        logger.debug("gradient signal estimate %r is not positive; no goodput model", grad.sqr)
        return None
    grad = goodput.GradParams(grad.sqr, max(grad.var, 0.0))
    try:
        return goodput.GoodputFunction(state.perf_params, grad, state.init_batch_size)
    except (TypeError, ValueError):
        logger.warning("unusable goodput model %s, %s", state.perf_params, grad, exc_info=True)
        return None


def _fit_perf_params() -> None:
    """Refit the performance model to every profiled configuration with optimizer steps."""
    state = _state()
    # Entries of no samples (recorded by older versions) cannot be fitted.
    keys = [key for key, entry in state.profile.items() if entry["optim_count"] > 0 and key[2] > 0]
    if not keys:
        return
    nodes, replicas, atomic, t_acc, t_opt = [], [], [], [], []
    for key in keys:
        entry = state.profile[key]
        # The non-sync part of an optimizer step is a sample of compute time
        # too. One replica communicates nothing (the model gives it no network
        # time), so what the timer saw from its last gradient to the optimizer
        # step (DDP's bookkeeping, the user's clipping or logging) is compute
        # there; taken as sync it made the model predict one replica's steps
        # several times too fast.
        sync = entry["optim_sync_time"] if key[1] > 1 else 0.0
        compute = entry["accum_step_time"] + entry["optim_step_time"] - sync
        count = entry["accum_count"] + entry["optim_count"]
        nodes.append(key[0])
        replicas.append(key[1])
        atomic.append(key[2])
        t_acc.append(max(compute / count, 1e-8))
        t_opt.append(max(entry["optim_step_time"] / entry["optim_count"], 1e-8))
    try:
        perf = goodput.fit_perf_params(
            np.array(nodes),
            np.array(replicas),
            np.array(atomic),
            np.array(t_acc),
            np.array(t_opt),
        )
    except Exception:  # a failed fit must never stop training
        logger.warning("fitting the performance model failed", exc_info=True)
        return
    if not all(math.isfinite(float(value)) for value in perf):
        logger.warning("ignoring a non-finite performance model %s", perf)
        return
    state.perf_params = perf
    logger.debug("fitted %s", perf)


_GAMMA_RANGE = (1.0, 10.0)
"""Valid range of the sync-overlap exponent (as ``adaptdl.sched_hints.GAMMA_RANGE``)."""

_MIN_GRAD_VAR = 1e-12
"""Smallest gradient variance sent: the scheduler's model divides by it, so it must be > 0."""


def _valid_perf(perf: goodput.PerfParams) -> dict[str, float] | None:
    """The performance model in wire form, made valid, or None if it is unusable.

    The fit can yield a NaN (degenerate profile) or, from rounding, a slightly
    negative coefficient or a ``gamma`` a hair outside ``[1, 10]``. NaN/inf
    drops the whole model (there is no sensible stand-in); small violations
    are clamped, because the hints' validation would otherwise reject the
    whole post.
    """
    values: dict[str, float] = {}
    for name, value in zip(goodput.PerfParams._fields, perf):
        number = float(value)
        if not math.isfinite(number):
            return None
        if name == "gamma":
            number = min(max(number, _GAMMA_RANGE[0]), _GAMMA_RANGE[1])
        values[name] = max(number, 0.0)
    return values


def get_sched_hints() -> dict[str, Any]:
    """The scheduling hints of this job, with the wire names of the supervisor API.

    Fields that are unknown (or not finite) are None, never NaN, so the JSON
    body is always valid. Gradient statistics are clamped to what the
    scheduler accepts (``norm >= 0``, ``var > 0``): the estimators can dip
    below zero from noise, and one bad read-out must not make the supervisor
    reject, or the job crash on, the whole post.
    """
    state = _state()
    hints: dict[str, Any] = {
        "initBatchSize": state.init_batch_size or 0,
        "maxBatchSize": state.max_batch_size or state.init_batch_size or 0,
        "localBszBounds": None,
        "gradientAccumulation": state.gradient_accumulation,
        "maxProfiledReplicas": max((key[1] for key in state.profile), default=0),
        "perfParams": None,
        "gradParams": None,
        "remainingIterations": remaining_iterations(),
    }
    if state.local_bsz_bounds is not None:
        hints["localBszBounds"] = list(state.local_bsz_bounds)
    if state.perf_params is not None:
        hints["perfParams"] = _valid_perf(state.perf_params)
    grad = _grad_params()
    if grad is not None and math.isfinite(grad.sqr) and math.isfinite(grad.var):
        hints["gradParams"] = {
            "norm": max(float(grad.sqr), 0.0),
            "var": max(float(grad.var), _MIN_GRAD_VAR),
        }
    return hints


def _report_sched_hints() -> None:
    """Post the hints to the supervisor (a no-op without one); never raises.

    Hints are advisory: a failure to build or post them is logged and
    training goes on, because losing one report only delays a rescale while
    an exception here would kill a healthy job.
    """
    try:
        if env.supervisor_url() is None:
            return
    except env.EnvironmentVariableError:
        logger.warning("not posting scheduling hints", exc_info=True)
        return
    job_id = env.job_id()
    if job_id is None:
        logger.debug("no ADAPTDL_JOB_ID, not posting scheduling hints")
        return
    # Imported here: only rank 0 of a supervised job ever posts hints.
    from adaptdl import sched_hints

    try:
        hints: Mapping[str, Any] = get_sched_hints()
        sched_hints.post_sched_hints(hints, job_id)
    except (TypeError, ValueError):
        logger.warning("not posting invalid scheduling hints", exc_info=True)


@_procstate.register_reset
def _reset_for_tests() -> None:
    """Forget the in-memory state and unregister it (test helper)."""
    global _STATE
    if _STATE is not None:
        _STATE.unregister()
    _STATE = None
