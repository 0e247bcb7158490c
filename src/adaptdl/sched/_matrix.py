"""Dense matrix views of jobs, nodes and allocations shared by the policies.

Both goodput-driven policies (:mod:`adaptdl.sched._pollux` and
:mod:`adaptdl.sched._adaptdl`) reason about the cluster as small integer
matrices: resources per node, resources per replica, replicas per (job, node).
Building those views in one place keeps the validation (and its error
messages) identical between them.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from adaptdl.sched._types import MAX_COUNT, Allocation, JobInfo, NodeInfo

__all__: list[str] = []

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def resource_keys(jobs: Mapping[str, JobInfo], nodes: Mapping[str, NodeInfo]) -> list[str]:
    """Every resource type named by a job or a node, sorted for determinism."""
    keys: set[str] = set()
    for job in jobs.values():
        keys.update(job.resources)
    for node in nodes.values():
        keys.update(node.resources)
    return sorted(keys)


def node_capacity(nodes: Sequence[NodeInfo], keys: Sequence[str]) -> IntArray:
    """``cap[n, r]``: capacity of node ``n`` for resource ``keys[r]``."""
    cap = np.zeros((len(nodes), len(keys)), dtype=np.int64)
    for n, node in enumerate(nodes):
        for r, key in enumerate(keys):
            cap[n, r] = int(node.resources.get(key, 0))
    return cap


def job_demand(names: Sequence[str], jobs: Mapping[str, JobInfo], keys: Sequence[str]) -> IntArray:
    """``res[j, r]``: resources one replica of job ``names[j]`` needs.

    Raises:
        ValueError: a job requests no positive resource; such a job could get
            unboundedly many replicas, which no policy can reason about.
    """
    res = np.zeros((len(names), len(keys)), dtype=np.int64)
    for j, name in enumerate(names):
        for r, key in enumerate(keys):
            res[j, r] = int(jobs[name].resources.get(key, 0))
        if not res[j].any():
            raise ValueError(
                f"jobs[{name!r}].resources={dict(jobs[name].resources)!r}: a replica "
                "must request at least one positive resource (e.g. {'gpu': 1})"
            )
    return res


def replicas_fitting(avail: IntArray, res: IntArray) -> IntArray:
    """``out[j, n]``: replicas of job ``j`` that fit into ``avail[n]`` alone.

    Args:
        avail: ``(N, R)`` free resources per node (may be negative: treated as 0).
        res: ``(J, R)`` resources per replica; every row has a positive entry.
    """
    avail = np.maximum(avail, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(
            res[:, None, :] > 0,
            avail[None, :, :] // np.maximum(res[:, None, :], 1),
            np.iinfo(np.int64).max,
        )
    out: IntArray = ratio.min(axis=2).astype(np.int64)
    return out


def allocation_matrix(
    names: Sequence[str],
    previous: Mapping[str, Allocation],
    columns: Mapping[str, int],
    num_columns: int,
) -> IntArray:
    """``X[j, n]``: replicas of ``names[j]`` on column ``n`` in ``previous``.

    Replicas on nodes that no longer exist are dropped: keeping what is left
    of such a job then looks unchanged, though the executor must restart it
    (callers that charge restarts check for lost nodes themselves).
    """
    base = np.zeros((len(names), num_columns), dtype=np.int64)
    for j, name in enumerate(names):
        for node in previous.get(name, ()):
            col = columns.get(node)
            if col is not None:
                base[j, col] += 1
    return base


def matrix_to_allocation(row: npt.NDArray[np.integer], columns: Sequence[str]) -> Allocation:
    """One job's replica counts per column as node names, grouped by node."""
    out: list[str] = []
    for col in np.flatnonzero(row):
        out.extend([columns[int(col)]] * int(row[col]))
    return tuple(out)


def restart_factor(job: JobInfo, now: float, delay: float) -> float:
    """Pollux's discount for re-allocating a job: ``max(age - restarts*delay, 0) / (age + delay)``.

    A young job or one restarted often has spent a large part of its life
    re-starting; moving it again would waste a comparable fraction, so the
    goodput of any changed allocation is discounted by this factor.
    """
    age = max(now - job.submission_time, 0.0)
    if age + delay <= 0.0:
        return 1.0  # restarts are free and the job is brand new: nothing to lose
    return max(age - job.num_restarts * delay, 0.0) / (age + delay)


def remaining_work(name: str, job: JobInfo) -> float | None:
    """Seconds the job still needs on one replica, or None if it does not say.

    Computed from :attr:`JobInfo.remaining_iterations` and
    :attr:`JobInfo.step_time_fn` (the same oracle Optimus uses). It ranks jobs
    by size; it is not a completion-time prediction, since it ignores the
    speedup of more replicas and larger batches.

    Raises:
        ValueError: the step time or iteration count is negative or not
            finite; the message names the job.
    """
    if job.remaining_iterations is None or job.step_time_fn is None:
        return None
    iterations = float(job.remaining_iterations)
    raw = job.step_time_fn(1)
    try:
        step = float(raw)
    except (TypeError, ValueError):
        raise ValueError(
            f"job {name!r}: step_time_fn(1) returned {raw!r}, expected a number >= 0"
        ) from None
    if not (math.isfinite(iterations) and iterations >= 0):
        raise ValueError(
            f"job {name!r}: remaining_iterations={iterations!r}, expected a number >= 0"
        )
    if not (math.isfinite(step) and step >= 0):
        raise ValueError(f"job {name!r}: step_time_fn(1) returned {step!r}, expected >= 0")
    return iterations * step


def evaluate_speedup(
    name: str, job: JobInfo, num_nodes: IntArray, replicas: IntArray
) -> FloatArray:
    """Call a job's speedup function on arrays and check the result.

    Raises:
        ValueError: the function returned negative or non-finite values, or
            the wrong shape; the message names the job.
    """
    if num_nodes.size == 0:
        return np.zeros(0, dtype=np.float64)
    raw = job.speedup_fn(num_nodes, replicas)
    try:
        values = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"jobs[{name!r}].speedup_fn returned {raw!r} for nodes={num_nodes!r}, "
            f"replicas={replicas!r}: expected numbers"
        ) from None
    if values.shape != num_nodes.shape:
        try:
            values = np.broadcast_to(values, num_nodes.shape).astype(np.float64)
        except ValueError:
            raise ValueError(
                f"jobs[{name!r}].speedup_fn returned shape {values.shape} for inputs of "
                f"shape {num_nodes.shape}: return one speedup per (nodes, replicas) pair"
            ) from None
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(
            f"jobs[{name!r}].speedup_fn returned {values!r} for nodes={num_nodes!r}, "
            f"replicas={replicas!r}: speedups must be finite and non-negative"
        )
    return values


def fair_share_config(dom_share: float, num_nodes: int, num_jobs: int) -> tuple[int, int]:
    """The (nodes, replicas) a job would get under an equal split of the cluster.

    Pollux re-bases each job's speedup on this configuration so that "1.0"
    means "as fast as with a fair share", which makes speedups of different
    jobs comparable inside a fairness-weighted objective. The replicas are
    capped at 2**31 - 1, as every replica count is (a job with a tiny share
    of nodes counted in millicores would otherwise exceed it).
    """
    if dom_share <= 0:
        return 1, 1
    replicas = min(max(math.ceil(1.0 / (dom_share * max(num_jobs, 1)) - 1e-9), 1), MAX_COUNT)
    nodes = max(math.ceil(num_nodes * dom_share - 1e-9), 1)
    return min(nodes, replicas), replicas


def surviving_allocations(
    previous: Mapping[str, Allocation],
    jobs: Mapping[str, JobInfo],
    nodes: Mapping[str, NodeInfo],
    resource: str,
    pinned: Mapping[str, Allocation],
) -> dict[str, Allocation]:
    """Previous allocations of active jobs that still fit, one GPU per replica.

    A job that lost a node (preempted, drained) lost its replicas there and
    must restart anyway, so it is treated as unallocated rather than making the
    whole round fail. So is a job on a node that shrank below what the kept
    allocations use: the ``pinned`` jobs (from :func:`pinned_allocations`,
    which the caller needs too) count first, then the others in submission
    order, and the first that overflows a node is dropped. A non-preemptible
    job that is not pinned (the pinned ones no longer fit together) is an
    ordinary job this round, its replica limits included.
    """
    used: dict[str, int] = dict.fromkeys(nodes, 0)
    out: dict[str, Allocation] = {}
    keys = [key for key in previous if key in jobs and previous[key]]
    keys.sort(key=lambda k: (k not in pinned, jobs[k].submission_time, k))
    for key in keys:
        alloc = tuple(previous[key])
        if not all(node in nodes for node in alloc):
            continue
        need = collections.Counter(alloc)
        fits = all(
            used[node] + count <= int(nodes[node].resources.get(resource, 0))
            for node, count in need.items()
        )
        job = jobs[key]
        if key not in pinned and not job.min_replicas <= len(alloc) <= job.max_replicas:
            continue
        if fits:
            out[key] = alloc
            for node, count in need.items():
                used[node] += count
    return out


def check_one_gpu_per_replica(policy: str, jobs: Mapping[str, JobInfo], resource: str) -> None:
    """Reject jobs the GPU-counting baselines cannot place correctly.

    Tiresias and Optimus hand out GPUs, one per replica, as in the Pollux
    evaluation; a replica that needs two GPUs, or another resource, would be
    placed wrongly (a node overfilled), so it is an error instead.

    Raises:
        ValueError: a job's replica needs anything but exactly one ``resource``.
    """
    for key, job in jobs.items():
        check_replica_shape(policy, f"jobs[{key!r}]", job, resource)


def check_replica_shape(policy: str, label: str, job: JobInfo, resource: str) -> None:
    """:func:`check_one_gpu_per_replica` for one job, named by ``label`` in errors."""
    needs = {name: value for name, value in job.resources.items() if value}
    if needs != {resource: 1}:
        raise ValueError(
            f"{label}.resources={dict(job.resources)!r}: {policy} places one "
            f"{resource!r} per replica and nothing else; use the adaptdl or pollux policy "
            "for other replica shapes"
        )


def in_previous_order(
    allocations: Mapping[str, Allocation], previous: Mapping[str, Allocation]
) -> dict[str, Allocation]:
    """The decision with each unchanged allocation spelled as before.

    Executors compare allocations as tuples; the same replicas per node listed
    in another order would look like a move and restart the job for nothing.
    """
    out: dict[str, Allocation] = {}
    for key, alloc in allocations.items():
        before = tuple(previous.get(key, ()))
        same = alloc != before and collections.Counter(alloc) == collections.Counter(before)
        out[key] = before if same else tuple(alloc)
    return out


def take_from_most_free(free: dict[str, int], count: int) -> list[str]:
    """Take ``count`` GPUs, repeatedly from the node with the most free ones.

    Ties go to the first node in natural name order (``n2`` before ``n10``),
    so decisions do not depend on the order of the ``nodes`` mapping.

    Raises:
        ValueError: fewer than ``count`` GPUs are free.
    """
    taken: list[str] = []
    names = sorted(free, key=natural_key)
    while len(taken) < count:
        best = None
        best_free = 0
        for node in names:
            available = free[node]
            if available > best_free:
                best, best_free = node, available
        if best is None:
            raise ValueError(f"cannot place {count} replicas: only {len(taken)} GPUs free")
        num = min(best_free, count - len(taken))
        taken.extend([best] * num)
        free[best] -= num
    return taken


_ASCII_DIGITS = re.compile(r"([0-9]+)")


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders digit runs by value: ``n2`` before ``n10``.

    The name itself comes last, so names equal by value (``n1``, ``n01``)
    still have one order.
    """
    # ASCII digits only: int() rejects some characters isdigit() accepts ("²").
    chunks = tuple(
        (0, int(part)) if _ASCII_DIGITS.fullmatch(part) else (1, part)
        for part in _ASCII_DIGITS.split(name)
        if part
    )
    return (*chunks, (2, name))
