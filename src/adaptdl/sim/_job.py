"""One simulated training job: its true progress under the trace physics.

A :class:`SimJob` advances in simulated seconds under the placement it was
last given. Its progress is measured in steps at the model's smallest batch
size B0; a step at total batch B is worth ``gain = (var + sqr) / (var / scale
+ sqr)`` of them (``scale = B / B0``), which is how a larger batch trades
statistical efficiency for throughput. Epoch boundaries are fixed amounts of
progress and crossing one costs a whole number of seconds (the artifact rounds
there, and the published completion times depend on it).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from adaptdl.sim._trace import Application

__all__ = ["RESTART_DELAY", "BatchChooser", "SimJob", "placement_of"]

#: Seconds without progress after every (re)allocation, the first one included.
RESTART_DELAY = 30


def placement_of(allocation: tuple[str, ...]) -> tuple[int, ...]:
    """GPUs per node, grouping consecutive equal node names in order.

    Raises:
        TypeError: ``allocation`` is a string (one node name per replica is
            expected, and a string would be read one character per replica).
    """
    if isinstance(allocation, str):
        raise TypeError(
            f"allocation={allocation!r}: expected a sequence of node names, one per replica"
        )
    placement: list[int] = []
    previous: str | None = None
    for node in allocation:
        if node == previous and placement:
            placement[-1] += 1
        else:
            placement.append(1)
        previous = node
    return tuple(placement)


class BatchChooser(Protocol):
    """The job-side agent of an adaptive-batch policy (see :mod:`._agent`)."""

    def observe(
        self,
        num_nodes: int,
        num_replicas: int,
        atomic_bsz: int,
        step_time: float,
        sync_time: float,
        grad_sqr: float,
        grad_var: float,
    ) -> None:
        """Record a measurement of the configuration the job just ran."""

    def choose(self, num_nodes: int, num_replicas: int) -> tuple[int, int] | None:
        """``(atomic_bsz, accum_steps)`` for an allocation, or None if no model yet."""

    def speedup_fn(self) -> Any:
        """The speedup function the scheduler sees for this job."""


class SimJob:
    """State of one job in the simulation.

    Attributes:
        name: Job name.
        app: Ground truth of the job's model.
        submission_time: Arrival time (seconds).
        requested_replicas: GPU count from the workload (fixed-size policies).
        target_batch_size: Fixed total batch size, or None to adapt it.
        agent: Batch-size agent of an adaptive policy, or None.
        completion_time: When the last epoch ended, or None while running.
        current_time: The job's own clock (always equal to the cluster's
            between ticks).
        rescale_time: Restart delay still to be served.
        placement: GPUs per node of the current allocation.
        atomic_bsz: Per-GPU micro-batch size.
        accum_steps: Extra micro-batches accumulated per optimizer step.
        progress: Cumulative progress in B0 steps.
        epoch: Completed epochs.
        attained_service: GPU-seconds held so far (restart delays included).
        num_restarts: None before the first allocation, then restarts so far.
        profiled: ``(nodes, replicas, atomic_bsz)`` configurations run so far.
        max_profiled_replicas: Most replicas among ``profiled`` (the
            exploration cap of adaptive policies doubles it).
        history: ``(time, placement)`` at every change of allocation, the
            first start included (``()``: all GPUs taken away).
    """

    __slots__ = (
        "name",
        "app",
        "submission_time",
        "requested_replicas",
        "target_batch_size",
        "agent",
        "completion_time",
        "current_time",
        "rescale_time",
        "placement",
        "atomic_bsz",
        "accum_steps",
        "progress",
        "epoch",
        "attained_service",
        "num_restarts",
        "profiled",
        "max_profiled_replicas",
        "history",
    )

    def __init__(
        self,
        name: str,
        app: Application,
        submission_time: float,
        *,
        requested_replicas: int = 1,
        target_batch_size: int | None = None,
        agent: BatchChooser | None = None,
    ) -> None:
        self.name = name
        self.app = app
        self.submission_time = submission_time
        self.requested_replicas = requested_replicas
        self.target_batch_size = target_batch_size
        self.agent = agent
        self.completion_time: float | None = None
        self.current_time: float = 0.0
        self.rescale_time: float = 0.0
        self.placement: tuple[int, ...] = ()
        self.atomic_bsz = 0
        self.accum_steps = 0
        self.progress = 0.0
        self.epoch = 0
        self.history: list[tuple[float, tuple[int, ...]]] = []
        self.attained_service: float = 0.0
        self.num_restarts: int | None = None
        self.profiled: set[tuple[int, int, int]] = set()
        self.max_profiled_replicas = 0

    @property
    def batch_size(self) -> int:
        """Total batch size of the current configuration (0 without GPUs)."""
        return sum(self.placement) * self.atomic_bsz * (self.accum_steps + 1)

    def update_local_bsz(self) -> None:
        """Re-choose the per-GPU batch and accumulation for the placement.

        Fixed-batch jobs split their total batch; adaptive jobs ask their
        agent, falling back to ``max(B0, min_local * R)`` until the agent has
        a throughput model. The atomic batch is then capped so the total stays
        within the validated range.
        """
        app = self.app
        num_replicas = sum(self.placement)
        num_nodes = len(self.placement)
        if num_replicas == 0:
            self.atomic_bsz = 0
            return
        batch = self.target_batch_size
        chosen = None
        if batch is None and self.agent is not None:
            chosen = self.agent.choose(num_nodes, num_replicas)
        if chosen is not None:
            self.atomic_bsz, self.accum_steps = chosen
        else:
            if batch is None:
                batch = max(app.init_batch_size, app.min_local_bsz * num_replicas)
            self.atomic_bsz, self.accum_steps = app.fixed_config(
                num_replicas, batch, force_accum=batch > app.init_batch_size
            )
            return
        count = num_replicas * (self.accum_steps + 1)
        self.atomic_bsz = min(self.atomic_bsz, int(app.max_batch_size / count))

    def reallocate(self, placement: tuple[int, ...]) -> None:
        """Move the job to a new placement (``()`` takes all GPUs away).

        Every non-empty allocation, the first included, costs
        :data:`RESTART_DELAY` seconds; only later ones count as restarts.
        """
        self.history.append((self.current_time, placement))
        if placement:
            self.placement = placement
            self.update_local_bsz()
            self.rescale_time = RESTART_DELAY
            self.num_restarts = 0 if self.num_restarts is None else self.num_restarts + 1
        else:
            self.placement = ()
            self.atomic_bsz = 0

    def step(self, seconds: float, interference: float = 0.0) -> None:
        """Advance the job's clock by ``seconds`` under its current placement.

        Raises:
            ValueError: ``seconds`` is negative or not a number.
        """
        if not seconds >= 0:
            raise ValueError(f"seconds={seconds!r}: a job's clock only moves forward (>= 0)")
        if not self.placement or self.completion_time is not None:
            self.current_time += seconds
            return
        gpus = sum(self.placement)
        delay = min(self.rescale_time, seconds)
        self.current_time += delay
        self.attained_service += delay * gpus
        self.rescale_time -= delay
        seconds -= delay
        app = self.app
        while seconds > 0 and self.completion_time is None:
            placement = self.placement
            num_replicas = gpus
            atomic = self.atomic_bsz
            batch_size = num_replicas * atomic * (self.accum_steps + 1)
            scale = batch_size / app.init_batch_size
            step_time, sync_time = app.throughput(placement, atomic)
            grad_sqr, grad_var = app.grad_stats(batch_size, self.epoch)
            gain = (grad_var + grad_sqr) / (grad_var / scale + grad_sqr)
            key = (len(placement), num_replicas, atomic)
            if key not in self.profiled:
                self.profiled.add(key)
                self.max_profiled_replicas = max(self.max_profiled_replicas, num_replicas)
            if self.agent is not None:
                self.agent.observe(
                    len(placement), num_replicas, atomic, step_time, sync_time, grad_sqr, grad_var
                )
            total_time = step_time + (step_time - sync_time) * self.accum_steps
            goodput = gain / total_time * (1.0 - interference)
            next_progress = app.progress(self.epoch + 1)
            if self.progress + goodput * seconds < next_progress:
                self.progress += goodput * seconds
                self.current_time += seconds
                self.attained_service += seconds * gpus
                seconds = 0
            else:
                self.epoch += 1
                # Whole seconds; never past the end of the advance, which
                # only a fractional interval could otherwise reach.
                delta = min(round(float((next_progress - self.progress) / goodput)), seconds)
                if self.epoch > app.max_epochs - 1:
                    self.completion_time = self.current_time + delta
                self.progress = next_progress
                self.current_time += delta
                self.attained_service += delta * gpus
                seconds -= delta
            self.update_local_bsz()
        self.current_time += seconds

    def remaining_iterations(self) -> float:
        """Exact optimizer steps left at the fixed batch size (Optimus' oracle)."""
        app = self.app
        batch = self.target_batch_size or app.init_batch_size
        completion_epoch = app.max_epochs - 1
        if self.epoch >= completion_epoch:
            return 1.0
        return app.iteration(batch, completion_epoch) - app.iteration(batch, self.epoch)

    def packed_step_time(self, num_replicas: int, gpus_per_node: int) -> float:
        """Seconds per optimizer step on ``num_replicas`` GPUs packed onto nodes.

        This is Optimus' oracle: the trace step time for the placement
        ``(g, g, ..., rest)`` at the job's fixed batch, with at least one
        accumulation step on a single GPU.
        """
        app = self.app
        full, rest = divmod(num_replicas, gpus_per_node)
        placement = (gpus_per_node,) * full + ((rest,) if rest else ())
        batch = self.target_batch_size
        if batch is None:
            # An adaptive job never runs below the smallest per-GPU batch
            # (section 6: B = max(B0, min_local * R) before any profile).
            batch = max(app.init_batch_size, app.min_local_bsz * num_replicas)
        atomic, accum = app.fixed_config(num_replicas, batch, force_accum=True)
        if atomic < app.min_local_bsz and accum > 0:
            # A batch already at the smallest per-GPU size cannot be split
            # for the forced accumulation: run it whole. (Never the case on
            # the published traces, where Optimus' results are reproduced.)
            atomic, accum = app.fixed_config(num_replicas, batch, force_accum=False)
        step_time, sync_time = app.throughput(placement, atomic)
        return step_time + (step_time - sync_time) * accum

    def jct(self) -> float:
        """Completion time minus submission time (``nan`` if incomplete)."""
        if self.completion_time is None:
            return math.nan
        return self.completion_time - self.submission_time
