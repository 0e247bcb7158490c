"""Tiresias: a two-queue discretised two-dimensional least-attained-service policy.

Tiresias (NSDI'19) schedules fixed-size gangs without knowing job lengths.
Jobs start in a high-priority queue and are demoted once they have consumed a
threshold of GPU-time, so short jobs finish quickly while long ones cannot
starve the short ones. Within a queue jobs run first-come first-served; a gang
that does not fit in the GPUs left over is skipped, letting smaller jobs
behind it backfill. This implementation follows the baseline of the Pollux
(OSDI'21) evaluation: two queues, a 16 GPU-hour threshold, no promotion, and
placement that only counts GPUs (a gang may be spread over several nodes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

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
    check_real_types,
    check_round,
    pinned_allocations,
    register_policy,
)

__all__ = ["TiresiasPolicy"]

_LOG = logging.getLogger(__name__)

_RUNNING = "RUNNING"
_PENDING = "PENDING"


class TiresiasPolicy(Policy):
    """Discretised 2D-LAS with two queues for fixed-size GPU gangs.

    Each job's gang size is :attr:`JobInfo.requested_replicas`. The policy
    keeps its own queues and per-job executed time between rounds; executed
    time grows by the time between consecutive calls while the job was
    running (restart delays included), taken from ``now``. A running job that
    is not preemptible keeps its allocation and is served before the queues.

    Args:
        queue_threshold: GPU-seconds after which a job is demoted to the
            low-priority queue (16 GPU-hours by default).
        resource: Resource name counted as GPUs.
    """

    name = "tiresias"
    gang_scheduled = True
    cluster_ready = False  # needs each job's fixed gang size

    def __init__(self, queue_threshold: float = 16 * 3600.0, resource: str = "gpu") -> None:
        check_real_types(queue_threshold=queue_threshold)
        check_name_type("resource", resource)
        if not queue_threshold > 0:
            raise ValueError(f"queue_threshold={queue_threshold!r}: must be > 0 GPU-seconds")
        self._threshold = queue_threshold
        self._resource = resource
        self._queues: tuple[list[str], list[str]] = ([], [])
        self._status: dict[str, str] = {}
        self._last_check: dict[str, int] = {}
        self._executed: dict[str, int] = {}

    @staticmethod
    def _gang(label: str, job: JobInfo) -> int:
        """The job's gang size, checked; ``label`` names the job in errors."""
        if job.requested_replicas is None:
            raise ValueError(
                f"{label}: Tiresias needs JobInfo.requested_replicas (its fixed gang size)"
            )
        if job.requested_replicas < 1:
            raise ValueError(f"{label}: requested_replicas={job.requested_replicas} must be >= 1")
        if not max(job.min_replicas, 1) <= job.requested_replicas <= job.max_replicas:
            raise ValueError(
                f"{label}: requested_replicas={job.requested_replicas} is outside its "
                f"bounds min_replicas={job.min_replicas}, max_replicas={job.max_replicas}; "
                "Tiresias runs a job only on its whole gang, so the gang size must lie "
                "within them"
            )
        return job.requested_replicas

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        """Update the queues at time ``now`` and decide which gangs run where."""
        check_round(jobs, nodes, previous, now)
        event_time = int(now)
        check_one_gpu_per_replica(self.name, jobs, self._resource)
        gangs = {key: self._gang(f"job {key!r}", job) for key, job in jobs.items()}
        queue0, queue1 = self._queues
        queue0[:] = [key for key in queue0 if key in jobs]
        queue1[:] = [key for key in queue1 if key in jobs]
        self._status = {k: v for k, v in self._status.items() if k in jobs}
        self._last_check = {k: v for k, v in self._last_check.items() if k in jobs}
        self._executed = {k: v for k, v in self._executed.items() if k in jobs}
        held = pinned_allocations(jobs, nodes, previous)
        allocations = {
            key: alloc
            for key, alloc in surviving_allocations(
                previous, jobs, nodes, self._resource, held
            ).items()
            if len(alloc) == gangs[key] or key in held
        }
        # New jobs join the queue in submission order, whatever the dict order.
        arrivals = [key for key in jobs if key not in self._status]
        # Same-time arrivals by natural name order (j-9 before j-10), which is
        # the file order of numbered workloads.
        for key in sorted(arrivals, key=lambda k: (jobs[k].submission_time, natural_key(k))):
            self._status[key] = _PENDING
            queue0.append(key)
        # Jobs demoted together join Q1 in queue order, not in dict order.
        for key in sorted(jobs, key=lambda k: (jobs[k].submission_time, natural_key(k))):
            if self._status[key] == _RUNNING:
                # A clock that stepped back adds nothing (never subtracts).
                elapsed = max(event_time - self._last_check.get(key, 0), 0)
                self._executed[key] = self._executed.get(key, 0) + elapsed
                if key in queue0 and self._executed[key] * gangs[key] >= self._threshold:
                    queue0.remove(key)
                    queue1.append(key)
                    _LOG.debug("job %s demoted to the low-priority queue", key)
            self._last_check[key] = max(event_time, self._last_check.get(key, event_time))
        free_count = sum(int(n.resources.get(self._resource, 0)) for n in nodes.values())
        # A running non-preemptible gang is never preempted: it is served first.
        pinned = {key for key in allocations if key in held}
        for key in pinned:
            free_count -= len(allocations[key])
            self._status[key] = _RUNNING
        for queue in (queue0, queue1):
            for key in queue:
                if key in pinned:
                    continue
                if gangs[key] <= free_count:
                    free_count -= gangs[key]
                    self._status[key] = _RUNNING
                else:
                    self._status[key] = _PENDING
                    allocations.pop(key, None)
        free = {name: int(n.resources.get(self._resource, 0)) for name, n in nodes.items()}
        for alloc in allocations.values():
            for node in alloc:
                free[node] -= 1
        for queue in (queue0, queue1):
            for key in queue:
                if self._status[key] == _RUNNING and key not in allocations:
                    allocations[key] = tuple(take_from_most_free(free, gangs[key]))
        return Decision(allocations=allocations)

    def allocate_job(self, job: JobInfo, nodes: Mapping[str, NodeInfo]) -> Allocation:
        """Fast path for a new arrival: its whole gang on the free GPUs, or nothing.

        Like :meth:`optimize`, the gang may span nodes, taken from the node
        with the most free GPUs first. ``nodes`` must describe *free* resources.
        """
        check_new_job(job, nodes)
        check_replica_shape(self.name, "job", job, self._resource)
        gang = self._gang("the new job", job)
        free = {name: int(node.resources.get(self._resource, 0)) for name, node in nodes.items()}
        if sum(free.values()) < gang:
            return ()
        return tuple(take_from_most_free(free, gang))

    def queue_of(self, key: str) -> int | None:
        """0 or 1 for a known job's queue, None for an unknown one (for tests)."""
        for index, queue in enumerate(self._queues):
            if key in queue:
                return index
        return None


register_policy("tiresias", TiresiasPolicy)
