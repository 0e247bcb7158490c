"""Optimus with an oracle: greedy GPU allocation by marginal completion-time gain.

Optimus (EuroSys'18) models each job's remaining time as remaining iterations
times the step time on ``r`` GPUs and hands out GPUs one at a time to the job
whose remaining time would drop the most. The Pollux (OSDI'21) evaluation
gives it an *oracle*: the exact remaining iterations and the exact measured
step times, so the baseline is not handicapped by prediction error. Batch
sizes stay fixed; only GPU counts change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from adaptdl.sched._matrix import (
    check_one_gpu_per_replica,
    check_replica_shape,
    natural_key,
    surviving_allocations,
    take_from_most_free,
)
from adaptdl.sched._types import (
    Allocation,
    Decision,
    JobInfo,
    NodeInfo,
    Policy,
    check_name_type,
    check_new_job,
    check_round,
    pinned_allocations,
    register_policy,
)

__all__ = ["OptimusPolicy"]


class OptimusPolicy(Policy):
    """Greedy marginal-gain allocation from an oracle of step times.

    Every job needs :attr:`JobInfo.step_time_fn` (seconds per iteration on
    ``r`` packed GPUs) and :attr:`JobInfo.remaining_iterations`; a job never
    gets more than :attr:`JobInfo.max_replicas` GPUs, and starts with
    ``max(min_replicas, 1)`` or none. A running job that is not preemptible
    keeps its allocation.

    Args:
        resource: Resource name counted as GPUs.
    """

    name = "optimus"
    cluster_ready = False  # needs an oracle the cluster cannot give

    def __init__(self, resource: str = "gpu") -> None:
        check_name_type("resource", resource)
        self._resource = resource

    @staticmethod
    def _oracle(label: str, job: JobInfo) -> tuple[Callable[[int], float], float]:
        """The job's step-time oracle and remaining iterations; ``label`` names it in errors."""
        if job.step_time_fn is None or job.remaining_iterations is None:
            raise ValueError(
                f"{label}: Optimus needs JobInfo.step_time_fn and remaining_iterations"
            )
        return job.step_time_fn, float(job.remaining_iterations)

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        """Give every job one GPU in order, then the rest by largest marginal gain."""
        check_round(jobs, nodes, previous, now)
        check_one_gpu_per_replica(self.name, jobs, self._resource)
        oracles = {key: self._oracle(f"job {key!r}", job) for key, job in jobs.items()}
        # Ties between jobs go by submission order, never by the dict order.
        order = sorted(jobs, key=lambda k: (jobs[k].submission_time, natural_key(k)))
        rank = {key: index for index, key in enumerate(order)}
        memo: dict[tuple[str, int], float] = {}

        def step_time(key: str, replicas: int) -> float:
            value = memo.get((key, replicas))
            if value is None:
                raw = oracles[key][0](replicas)
                try:
                    value = float(raw)
                except (TypeError, ValueError):
                    value = math.nan
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(
                        f"job {key!r}: step_time_fn({replicas}) returned {raw!r}, "
                        "expected a finite number >= 0"
                    )
                memo[key, replicas] = value
            return value

        def gain(key: str, replicas: int) -> float:
            if replicas + 1 > jobs[key].max_replicas:
                return 0.0
            remaining = oracles[key][1]
            return (step_time(key, replicas) - step_time(key, replicas + 1)) * remaining

        free_count = sum(int(n.resources.get(self._resource, 0)) for n in nodes.values())
        # Running non-preemptible jobs keep their allocation and take no part.
        pinned = pinned_allocations(jobs, nodes, previous)
        survivors = surviving_allocations(previous, jobs, nodes, self._resource, pinned)
        free_count -= sum(len(alloc) for alloc in pinned.values())
        replicas: dict[str, int] = {}
        gains: dict[str, float] = {}
        for key in sorted(order, key=lambda k: jobs[k].min_replicas):
            if key in pinned:
                continue
            first = max(jobs[key].min_replicas, 1)
            if free_count < first or jobs[key].max_replicas < first:
                replicas[key] = 0
                gains[key] = 0.0
                continue
            replicas[key] = first
            free_count -= first
            gains[key] = gain(key, first)
        while free_count > 0:
            best, best_gain = None, 0.0
            for key, value in gains.items():
                if value > best_gain:
                    best, best_gain = key, value
            if best is None:
                break
            replicas[best] += 1
            free_count -= 1
            gains[best] = gain(best, replicas[best])
        allocations: dict[str, Allocation] = dict(pinned)
        for key, count in replicas.items():
            alloc = survivors.get(key, ())
            if count > 0 and len(alloc) == count:
                allocations[key] = alloc
        free = {name: int(n.resources.get(self._resource, 0)) for name, n in nodes.items()}
        for alloc in allocations.values():
            for node in alloc:
                free[node] -= 1
        for key in sorted(replicas, key=lambda k: (replicas[k], rank[k])):
            if replicas[key] > 0 and key not in allocations:
                allocations[key] = tuple(take_from_most_free(free, replicas[key]))
        return Decision(allocations=allocations)

    def allocate_job(self, job: JobInfo, nodes: Mapping[str, NodeInfo]) -> Allocation:
        """Fast path for a new arrival, refusing the jobs :meth:`optimize` refuses.

        Otherwise as :meth:`Policy.allocate_job`: ``max(min_replicas, 1)``
        GPUs on one node with room, or ``()``.
        """
        check_new_job(job, nodes)
        check_replica_shape(self.name, "job", job, self._resource)
        self._oracle("the new job", job)
        return super().allocate_job(job, nodes)


register_policy("optimus", OptimusPolicy)
