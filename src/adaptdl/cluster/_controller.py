"""The controller: the one place where a scheduling policy meets a backend.

Every ``tick`` the controller lets the backend reconcile (start groups, notice
exits, finish checkpoints). Every ``interval`` seconds, and at once when a job
completes, fails or is deleted, it runs the policy's full optimisation over
all active jobs and hands changed allocations to the backend. A job that
arrives gets the policy's fast path (:meth:`~adaptdl.sched.Policy.allocate_job`
on the free slots) so it starts without waiting for the next round.

What the policy knows about a job comes from the hints the job uploads: with
a fitted performance model (``perfParams`` and ``initBatchSize``) the speedup
is the goodput model's, with the batch size re-optimised for each size;
without, it is linear. Either way a job may grow to at most twice the largest
replica count it has profiled, so the model is never trusted far beyond the
data it was fitted on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from adaptdl.cluster._backend import Backend, JobNotFoundError, JobStatus, Phase
from adaptdl.sched import (
    Allocation,
    DecisionError,
    JobInfo,
    NodeInfo,
    Policy,
    check_allocation,
    check_decision,
    copy_nodes,
    linear_speedup,
)

__all__ = ["Controller", "job_info", "predict_batch_and_goodput", "waiting_reason"]

_LOG = logging.getLogger(__name__)

#: Seconds a policy round may take before the controller warns: the round
#: runs on the thread that notices job exits.
SLOW_ROUND = 5.0


def _goodput_function(hints: Mapping[str, Any]) -> Any | None:
    """The job's goodput model from its hints, or None without a fitted model."""
    perf = hints.get("perfParams")
    init_bsz = hints.get("initBatchSize")
    if not perf or not init_bsz:
        return None
    from adaptdl.goodput import GoodputFunction, GradParams, PerfParams

    grad = hints.get("gradParams") or {}
    grad_params = GradParams(float(grad.get("norm", 0.0)), float(grad.get("var", 1.0)))
    if not grad:
        grad_params = GradParams(0.0, 1.0)  # unknown noise: efficiency 1
    perf_params = PerfParams(**{key: float(value) for key, value in perf.items()})
    return GoodputFunction(perf_params, grad_params, int(init_bsz))


def _bsz_options(
    hints: Mapping[str, Any],
) -> tuple[int | None, tuple[int | None, int | None] | None, bool]:
    max_bsz = hints.get("maxBatchSize") or None
    bounds = hints.get("localBszBounds")
    atomic_range = None
    if bounds:
        low, high = bounds[0], bounds[1]
        atomic_range = (None if low is None else int(low), None if high is None else int(high))
    return (
        int(max_bsz) if max_bsz else None,
        atomic_range,
        bool(hints.get("gradientAccumulation", False)),
    )


def _speedup_function(hints: Mapping[str, Any]) -> Any | None:
    """The job's :class:`~adaptdl.sched.SpeedupFunction`, or None without a fitted model.

    Raises:
        ValueError: the model has no goodput at one replica.
    """
    goodput_fn = _goodput_function(hints)
    if goodput_fn is None:
        return None
    from adaptdl.sched import SpeedupFunction

    max_bsz, atomic_range, accumulation = _bsz_options(hints)
    with np.errstate(all="ignore"):  # overflows end as a refused zero goodput
        return SpeedupFunction(goodput_fn, max_bsz, atomic_range, accumulation)


def check_model(hints: Mapping[str, Any]) -> None:
    """Refuse (validated) hints whose goodput model the scheduler could not use.

    Raises:
        ValueError: it says why, naming the hints.
    """
    try:
        _speedup_function(hints)
    except (ValueError, ArithmeticError) as exc:
        raise ValueError(f"the hints give no usable goodput model: {exc}") from None


#: Jobs whose model gave non-finite speedups, warned about once each.
_WARNED_SPEEDUP: set[tuple[str, float]] = set()
#: Jobs whose hints gave no model at all, logged once each.
_WARNED_MODEL: set[tuple[str, float]] = set()


class _Guarded:
    """A job's speedup function whose non-finite or negative values read as 0.

    Hints pass validation one value at a time, yet some combinations
    overflow inside the goodput model; a policy refuses a nan speedup and
    raises, which would stop the round for every job. Read as 0, such a
    configuration is simply never chosen.
    """

    def __init__(self, inner: Callable[..., Any], job: tuple[str, float]) -> None:
        self._inner = inner
        self._job = job

    def __call__(self, num_nodes: Any, num_replicas: Any) -> Any:
        with np.errstate(all="ignore"):
            raw = np.asarray(self._inner(num_nodes, num_replicas), dtype=np.float64)
        bad = ~np.isfinite(raw) | (raw < 0)
        if bad.any():
            if self._job not in _WARNED_SPEEDUP:
                _WARNED_SPEEDUP.add(self._job)
                _LOG.warning(
                    "job %s: its goodput model gives no finite speedup for some "
                    "configurations (e.g. %s replicas); the scheduler will not choose them",
                    self._job[0],
                    np.broadcast_to(np.asarray(num_replicas), raw.shape)[bad].ravel()[:3].tolist(),
                )
            raw = np.where(bad, 0.0, raw)
        return raw if raw.ndim else float(raw)


def job_info(status: JobStatus, resource: str) -> JobInfo:
    """Describe a job to a policy, from its spec and latest hints.

    Args:
        status: The job's snapshot.
        resource: The resource key one replica consumes.
    """
    spec = status.spec
    hints = dict(status.hints or {})
    profiled = int(hints.get("maxProfiledReplicas") or 0)
    max_replicas = min(max(2 * profiled, 1), spec.max_replicas)
    speedup: Callable[..., Any] = linear_speedup
    remaining: float | None = None
    step_time: Callable[[int], float] | None = None
    model = _speedup_function(hints) if spec.preemptible else None
    if model is not None:
        goodput_fn = model.goodput_fn
        max_bsz, atomic_range, accumulation = _bsz_options(hints)
        speedup = _Guarded(model, (spec.name, status.submitted))
        # No more replicas than the largest batch has smallest micro-batches
        # (as the original: an unknown maxBatchSize is B0, an unknown lower
        # bound 1); at least one, so the atomic range wins over maxBatchSize.
        largest = max_bsz or goodput_fn.init_batch_size
        smallest = atomic_range[0] if atomic_range and atomic_range[0] else 1
        max_replicas = min(max_replicas, max(int(largest // smallest), 1))
        if hints.get("remainingIterations") is not None:
            step_time = _init_batch_step_time(goodput_fn, atomic_range, accumulation)
            try:
                # The policy calls it inside its round: a model that cannot
                # answer must fail here, where only this job falls back.
                with np.errstate(all="ignore"):
                    seconds = step_time(1)
                if not (math.isfinite(seconds) and seconds > 0):
                    raise ValueError(f"step time {seconds!r} at one replica")
            except (ValueError, ArithmeticError) as exc:
                _LOG.warning(
                    "job %s: no remaining-work estimate from its hints (%s)", spec.name, exc
                )
                step_time = None
            else:
                remaining = float(hints["remainingIterations"])
    max_replicas = max(max_replicas, spec.min_replicas)
    return JobInfo(
        resources={resource: 1},
        speedup_fn=speedup,
        submission_time=status.submitted,
        attained_service=status.attained_service,
        num_restarts=max(status.restarts, 0),
        min_replicas=spec.min_replicas,
        max_replicas=max_replicas,
        preemptible=spec.preemptible,
        step_time_fn=step_time,
        remaining_iterations=remaining,
    )


def _init_batch_step_time(
    goodput_fn: Any,
    atomic_range: tuple[int | None, int | None] | None,
    accumulation: bool,
) -> Callable[[int], float]:
    """Seconds per optimizer step at the initial batch size on ``r`` replicas of one node.

    With the job's ``remainingIterations`` hint this is its remaining work,
    by which the ``adaptdl`` policy lets short jobs finish first. The step is
    split into micro-batches by the model's own rule (``optimize`` with no
    larger batch allowed), within the job's ``localBszBounds``, as the job
    itself runs it.
    """

    low = atomic_range[0] if atomic_range and atomic_range[0] else 1

    def step_time(replicas: int) -> float:
        # A smallest micro-batch above B0 / replicas makes the step larger
        # than B0, as the job itself would run it.
        largest = max(goodput_fn.init_batch_size, low * replicas)
        _, atomic, accum = goodput_fn.optimize(
            1,
            replicas,
            max_batch_size=largest,
            atomic_bsz_range=atomic_range,
            accumulation=accumulation,
        )
        samples = float(goodput_fn.throughput(1, replicas, atomic, accum))
        return replicas * int(atomic) * (int(accum) + 1) / samples

    return step_time


def predict_batch_and_goodput(
    hints: Mapping[str, Any] | None, replicas: int, nodes: int = 1
) -> tuple[int | None, float | None]:
    """Global batch size and goodput the job's model predicts at this size.

    Without a fitted model (or while the job holds no replicas) the batch size
    is the one the job last reported (``globalBatchSize``, else
    ``initBatchSize``) and the goodput is unknown.
    """
    if not hints:
        return None, None
    reported = hints.get("globalBatchSize") or hints.get("initBatchSize")
    goodput_fn = _goodput_function(hints) if replicas > 0 else None
    if goodput_fn is None:
        return (int(reported) if reported else None, None)
    max_bsz, atomic_range, accumulation = _bsz_options(hints)
    with np.errstate(all="ignore"):  # an overflowing model reads as "unknown" below
        goodput, atomic, accum = goodput_fn.optimize(
            nodes,
            replicas,
            max_batch_size=max_bsz,
            atomic_bsz_range=atomic_range,
            accumulation=accumulation,
        )
    batch = int(replicas * int(atomic) * (int(accum) + 1))
    value = float(goodput)
    return batch, (value if math.isfinite(value) else None)


class Controller:
    """Runs a policy against a backend.

    Args:
        backend: Where jobs run.
        policy: The scheduling policy.
        interval: Seconds between full optimisation rounds.
        tick: Seconds between reconciliations (how fast exits are noticed).
        clock: Wall clock, replaceable in tests.
        policy_name: The name the policy was registered under, for messages
            (default: its ``name`` attribute, else its class name).

    A policy that raises, or returns a decision that
    :func:`~adaptdl.sched.check_decision` refuses, changes nothing: the jobs
    keep their allocations, the error is logged and kept in
    :attr:`last_policy_error` (``adaptdl cluster status`` shows it), and new
    jobs are still offered to :meth:`~adaptdl.sched.Policy.allocate_job`.
    """

    def __init__(
        self,
        backend: Backend,
        policy: Policy,
        *,
        interval: float = 60.0,
        tick: float = 0.25,
        clock: Callable[[], float] = time.time,
        policy_name: str | None = None,
    ) -> None:
        for name, value in (("interval", interval), ("tick", tick)):
            # NaN compares false with everything: a NaN interval never schedules.
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r}: expected a finite number of seconds > 0")
        self.backend = backend
        self.policy = policy
        self.interval = interval
        self.tick = tick
        self._clock = clock
        self._wakeup = threading.Event()
        self._active: dict[str, float] = {}  # name: submission time
        self._last_optimize = -math.inf
        self._force = False
        self._force_lock = threading.Lock()
        self._metrics_key: dict[str, tuple[Any, ...]] = {}
        self.rounds = 0
        self.policy_name = policy_name or policy.name or type(policy).__name__
        #: ``(time, message)`` of the policy's latest failure, cleared by the
        #: next round it completes.
        self.last_policy_error: tuple[float, str] | None = None

    def wake(self, *, optimize: bool = False) -> None:
        """Step soon (a job arrived); with ``optimize`` also run a full round."""
        if optimize:
            with self._force_lock:
                self._force = True
        self._wakeup.set()

    def step(self) -> None:
        """Reconcile once, then schedule if anything calls for it."""
        # Consumed before the snapshot below: a wake(optimize=True) from now
        # on may not be reflected in it, so it gets a round of its own.
        with self._force_lock:
            force, self._force = self._force, False
        now = self._clock()
        self.backend.reconcile(now)
        jobs = self.backend.jobs(include_finished=False)
        # Jobs are told apart by name and submission time, so a job deleted
        # and resubmitted under its name between two steps is both a
        # departure and an arrival.
        active = {name: status.submitted for name, status in jobs.items()}
        gone = {name for name, submitted in self._active.items() if active.get(name) != submitted}
        arrivals = [
            name
            for name, status in jobs.items()
            if self._active.get(name) != status.submitted
            and status.restarts < 0
            and not status.allocation
        ]
        self._active = active
        due = now - self._last_optimize >= self.interval
        if jobs and (due or gone or force):
            self._last_optimize = now
            if not self._optimize(jobs, now) and arrivals:
                self._allocate_arrivals(jobs, arrivals)  # new jobs need not wait for a fix
        elif arrivals:
            self._allocate_arrivals(jobs, arrivals)
        elif not jobs:
            self._last_optimize = -math.inf  # the next arrival starts a round at once
        self._update_metrics(jobs)

    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set; errors are logged and the loop goes on."""
        while not stop.is_set():
            # Cleared before the step, not after: a wake() that arrives while
            # the step runs (a submit, a delete) must trigger the next step at
            # once rather than be swallowed until the next tick.
            self._wakeup.clear()
            try:
                self.step()
            except (Exception, SystemExit):  # SystemExit would end the thread silently
                _LOG.exception("controller step failed")
            self._wakeup.wait(self.tick)

    # ------------------------------------------------------------------ policy

    def _infos(self, jobs: Mapping[str, JobStatus]) -> dict[str, JobInfo]:
        resource = self.backend.slot_resource()
        infos = {}
        for name, status in jobs.items():
            if status.reason == "Deleting":
                continue
            try:
                infos[name] = job_info(status, resource)
            except Exception as exc:  # a bad model must not stop the others
                # Once per job, not every round (the supervisor refuses such
                # hints now; older ones may still be in the store).
                key = (name, status.submitted)
                if key not in _WARNED_MODEL:
                    _WARNED_MODEL.add(key)
                    _LOG.error(
                        "cannot build the goodput model of job %s; using linear: %s",
                        name,
                        exc,
                        exc_info=not isinstance(exc, ValueError | ArithmeticError),
                    )
                # Up to the replicas it has now: a bad model alone must not
                # shrink (and so restart) a running job.
                keep = min(len(status.allocation), status.spec.max_replicas)
                infos[name] = JobInfo(
                    resources={resource: 1},
                    speedup_fn=linear_speedup,
                    submission_time=status.submitted,
                    min_replicas=status.spec.min_replicas,
                    max_replicas=max(1, status.spec.min_replicas, keep),
                    preemptible=status.spec.preemptible,
                )
        return infos

    def _policy_failed(self, what: str, exc: BaseException) -> None:
        message = f"policy {self.policy_name!r} {what}: {exc}"
        _LOG.error(
            "%s; allocations unchanged", message, exc_info=not isinstance(exc, DecisionError)
        )
        self.last_policy_error = (self._clock(), message)

    def _optimize(self, jobs: Mapping[str, JobStatus], now: float) -> bool:
        """One full round; False when the policy failed (nothing was changed)."""
        infos = self._infos(jobs)
        if not infos:
            return True
        nodes = self.backend.nodes()
        previous = {name: tuple(jobs[name].allocation) for name in infos}
        started = time.perf_counter()
        try:
            # Copies: a policy (perhaps a plugin) that edits its inputs must
            # not change what its decision is checked against.
            decision = self.policy.optimize(dict(infos), copy_nodes(nodes), dict(previous), now)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - perhaps a plugin's bug: keep the cluster up
            self._policy_failed(f"raised {type(exc).__name__} in optimize()", exc)
            return False
        try:
            chosen = check_decision(decision, infos, nodes, previous)
        except DecisionError as exc:
            self._policy_failed("made a decision the cluster cannot carry out", exc)
            return False
        self.rounds += 1
        self.last_policy_error = None
        elapsed = time.perf_counter() - started
        _LOG.log(
            logging.WARNING if elapsed > SLOW_ROUND else logging.INFO,
            "policy %s planned %d jobs in %.3fs%s",
            self.policy_name,
            len(infos),
            elapsed,
            " (slow: job exits and arrivals wait for the round)" if elapsed > SLOW_ROUND else "",
        )
        for name in infos:
            allocation = chosen.get(name, ())
            # The same replicas listed in another order are not a move.
            if Counter(allocation) != Counter(previous[name]):
                self._set_allocation(name, allocation)
        return True

    def _set_allocation(self, name: str, allocation: Allocation) -> None:
        try:
            self.backend.set_allocation(name, allocation)
        except JobNotFoundError:  # deleted during the round: the others still apply
            _LOG.debug("job %s was deleted during the round", name)

    def _allocate_arrivals(self, jobs: Mapping[str, JobStatus], arrivals: list[str]) -> None:
        resource = self.backend.slot_resource()
        nodes = self.backend.nodes()
        used: Counter[str] = Counter()
        for status in jobs.values():
            used.update(status.allocation)
        infos = self._infos({name: jobs[name] for name in arrivals})
        for name in sorted(arrivals, key=lambda n: jobs[n].submitted):
            if name not in infos:
                continue
            free = {
                node: NodeInfo(
                    resources={resource: max(info.resources.get(resource, 0) - used[node], 0)},
                    preemptible=info.preemptible,
                    gpu_type=info.gpu_type,
                )
                for node, info in nodes.items()
            }
            try:
                allocation = self.policy.allocate_job(infos[name], copy_nodes(free))
                if not isinstance(allocation, (tuple, list)) or not all(
                    isinstance(node, str) for node in allocation
                ):
                    raise DecisionError(
                        f"returned {allocation!r} for job {name!r}, expected a tuple of node names"
                    )
                allocation = tuple(allocation)
                check_allocation(name, allocation, infos[name], free)
            except DecisionError as exc:
                self._policy_failed(
                    "made an allocate_job() decision the cluster cannot carry out", exc
                )
                continue
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - as in _optimize
                self._policy_failed(f"raised {type(exc).__name__} in allocate_job()", exc)
                continue
            if allocation:
                self._set_allocation(name, allocation)
                used.update(allocation)

    def _update_metrics(self, jobs: Mapping[str, JobStatus]) -> None:
        for name, status in jobs.items():
            replicas = status.replicas or len(status.allocation)
            key = (replicas, len(set(status.allocation)), repr(status.hints))
            if self._metrics_key.get(name) == key:
                continue
            self._metrics_key[name] = key
            try:
                batch, goodput = predict_batch_and_goodput(
                    status.hints, replicas, max(len(set(status.allocation)), 1)
                )
            except Exception:
                _LOG.exception("cannot predict the goodput of job %s", name)
                continue
            self.backend.set_metrics(name, batch, goodput)
        for name in list(self._metrics_key):
            if name not in jobs:
                del self._metrics_key[name]


def waiting_reason(
    status: JobStatus, jobs: Mapping[str, JobStatus], slots: int, now: float | None = None
) -> str | None:
    """Why a job is not running, in words, or None when it is.

    Args:
        now: The current time, for a held-back restart (default: the clock).
    """
    if status.phase is not Phase.PENDING:
        return None
    if status.allocation:
        busy = sum(other.replicas for other in jobs.values() if other.name != status.name)
        if len(status.allocation) > slots - busy:
            return (
                f"allocated {len(status.allocation)} replicas; waiting for other jobs to "
                "checkpoint and release their slots"
            )
        left = (status.not_before or 0.0) - (time.time() if now is None else now)
        if left > 0:
            return f"allocated; restarts in {math.ceil(left)}s (restart back-off, see events)"
        return "allocated; starting"
    others = sorted(
        f"{other.name} ({len(other.allocation)})"
        for other in jobs.values()
        if other.name != status.name and other.allocation
    )
    need = max(status.spec.min_replicas, 1)
    if need > slots:
        # Accepted by a cluster with more slots, then restarted with fewer.
        return (
            f"cannot start: minReplicas={need} but this cluster has only {slots} slots; "
            f"restart the cluster with --slots {need} or more, or delete the job"
        )
    taken = sum(len(other.allocation) for other in jobs.values() if other.name != status.name)
    held = f"; held by {', '.join(others)}" if others else ""
    return (
        f"waiting for the scheduler: needs {need} of {slots} slots, "
        f"{max(slots - taken, 0)} free{held}"
    )
