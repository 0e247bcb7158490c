"""AdaptDL's default policy: goodput-optimal configurations by integer programming.

Pollux searches the space of (job x node) replica matrices with a genetic
algorithm. Most of that space is uninteresting: a job's goodput depends on how
many nodes and replicas it has, not on which nodes, and sensible shapes are few
(a slice of one node, or whole nodes). In the spirit of Sia (SOSP'23), this
policy therefore chooses one *configuration* per job, ``(nodes, replicas)``
from a short candidate list, by a mixed-integer program, and only afterwards
places the chosen configurations onto concrete nodes:

* candidates: one node with a power-of-two number of replicas up to the node
  size (these pack a node without holes), ``k`` whole nodes for
  ``k = 2 .. max_nodes_per_job`` (``k`` times the ``k``-th largest node, and
  the ``k`` largest filled: on equal nodes the same), the job's replica bounds on the fewest
  nodes that hold them (so a job with ``min = max = 6`` on 4-GPU nodes runs),
  and the job's current shape (so keeping it is always possible);
* utility: the job's goodput speedup, normalised to its fair share of the
  cluster (as Pollux does), discounted by Pollux's age-aware restart factor if
  the configuration differs from the current one, and passed through the
  power-mean transform ``v**p / p`` (``log v`` for ``p = 0``). Maximising the
  sum of the transformed utilities maximises Pollux's power-mean objective
  exactly, within the candidate shapes, instead of approximately;
* priority: when a job says how much work it has left (the remaining
  iterations and step time Optimus also uses), its utility is weighted by
  ``max((1 + W / work_scale) ** -work_exponent, work_floor)`` with ``W`` its
  remaining seconds on one replica. With ``p = 0`` this shares contested GPUs
  in proportion to the weights, favouring short jobs as SRPT does, so they
  leave the cluster sooner; the floor keeps long jobs running at a useful rate,
  so the tail (p99 JCT, makespan) does not pay for the average. The long jobs
  held at the floor are then ordered too: they split their total weight in
  geometric proportions (``floor_order ** k`` for the ``k``-th shortest), so
  they finish one after another rather than all together at the end, as equal
  shares of several ImageNet-sized jobs would make them. Finally every job is
  discounted by ``queue_discount ** k``, ``k`` the number of jobs with less
  work left: among jobs of about the same size (a dozen DeepSpeech2 jobs
  arriving together) the one closest to done runs ahead instead of all of
  them sharing the GPUs and finishing late together, and when many jobs wait,
  the long ones yield a little more. Jobs that do not report their remaining
  work keep weight 1. On Pollux workloads 1-4 this brings the average JCT
  from 0.985x (no priority) to about 0.90x of the published Pollux runs, p99 JCT
  and makespan within 5% of theirs (``benchmarks/results/simulate.md``);
* constraints: at most one configuration per job; total replicas x resources
  within the cluster's capacity; whole nodes for multi-node jobs. Distributed
  jobs on whole nodes never share a node, so interference is avoided by
  construction;
* placement: pinned jobs and jobs whose shape did not change stay where they
  are; multi-node jobs take whole free nodes, small ones that hold them,
  filled in turn so that a remainder is left on one node (6 replicas on
  4-GPU nodes are 4 + 2, and a single-node job may use the other 2);
  single-node jobs are packed best-fit, CPU-only ones away from GPU nodes. A
  job that does not fit after all (fragmentation, or unequal nodes: the
  program sees capacities summed over nodes) keeps its current allocation if
  that still fits, else falls back to its best smaller configuration that
  does; then jobs the program left out take what is still free.

The policy is deterministic: no random numbers, and HiGHS is run without a
time limit (a node limit bounds the work instead, which does not depend on the
speed of the machine).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import scipy.optimize
import scipy.sparse
from numpy.typing import NDArray

from adaptdl.sched._matrix import (
    FloatArray,
    IntArray,
    allocation_matrix,
    evaluate_speedup,
    fair_share_config,
    in_previous_order,
    job_demand,
    node_capacity,
    remaining_work,
    replicas_fitting,
    resource_keys,
    restart_factor,
)
from adaptdl.sched._types import (
    MAX_COUNT,
    Allocation,
    Decision,
    JobInfo,
    NodeInfo,
    Policy,
    check_int_type,
    check_real_types,
    check_round,
    pinned_allocations,
    register_policy,
)

__all__ = ["AdaptDLPolicy"]

Normalize = Literal["fair", "one"]

_EPSILON = 1e-3  # utility of a job with (almost) nothing; as in Pollux's objective
#: Lowest fairness exponent: _EPSILON ** -4 = 1e12 still leaves float64 room.
_MIN_P = -4.0
#: Bound on the log of a bias factor (exp(700) is near the float64 maximum).
_MAX_LOG = 700.0
#: Smallest restart discount: a brand-new job (age 0) would otherwise value
#: every shape at exactly nothing, and spare GPUs would stay idle for a round.
_MIN_RESTART_FACTOR = 1e-3
#: Smallest factor of the queue discount: with hundreds of jobs waiting,
#: ``queue_discount ** k`` alone would starve the longest ones.
_QUEUE_DISCOUNT_FLOOR = 0.5


@dataclass(frozen=True)
class _Candidates:
    """The candidate configurations of one job and their utilities."""

    nodes: IntArray  # (C,) nodes spanned
    replicas: IntArray  # (C,) replicas
    utility: FloatArray  # (C,) transformed utility gain over running nothing
    keep: int  # index of the current shape, or -1


def _transform(values: FloatArray, p: float) -> FloatArray:
    """The increasing, concave map whose sum ranks solutions like the power mean."""
    if p == 0.0:
        return np.asarray(np.log(values), dtype=np.float64)
    return np.asarray(values**p / p, dtype=np.float64)


def _capped_split(shape: FloatArray, total: float, cap: float) -> FloatArray:
    """Scale ``shape`` to sum to ``total`` with no entry above ``cap`` (water-filling).

    Entries that would exceed ``cap`` are set to it and the rest are rescaled
    to make up the difference; if every entry is capped the sum falls short.
    """
    parts = np.zeros(len(shape))
    free = np.ones(len(shape), dtype=bool)
    while free.any():
        left = total - parts[~free].sum()
        mass = shape[free].sum()
        # Shares that underflowed to zero split what is left evenly (not NaN).
        parts[free] = shape[free] * left / mass if mass > 0 else left / free.sum()
        over = free & (parts > cap)
        if not over.any():
            break
        parts[over] = cap
        free &= ~over
    return parts


class AdaptDLPolicy(Policy):
    """Goodput-driven configuration choice by mixed-integer programming.

    Args:
        p: Fairness exponent of the power mean of normalised speedups: ``-1``
            (harmonic, Pollux's default) strongly favours giving every job
            something; ``0`` (the default: proportional fairness) shares in
            proportion to the priority weights; ``1`` maximises total goodput.
            From -4 to 1.
        normalize: ``"fair"`` divides each job's speedup by its speedup at a
            fair share of the cluster (Pollux); ``"one"`` keeps the speedup over
            one replica.
        restart_delay: Seconds one restart costs; the discount of a changed
            configuration is ``max(age - restarts*delay, 0) / (age + delay)``.
        max_nodes_per_job: Most nodes one job may span.
        mip_rel_gap: Relative optimality gap at which HiGHS may stop.
        node_limit: Branch-and-bound node limit for HiGHS (a deterministic
            bound on solver work).
        las_exponent: Least-attained-service bias: each job's utility is
            multiplied by ``(1 + attained_service / las_scale) ** -las_exponent``,
            so that, like Tiresias' LAS queues, jobs that have received little
            service (most of which are short) win contested GPUs; a negative
            exponent favours jobs that have run longest instead. 0 disables it.
        las_scale: GPU-seconds at which the LAS weight starts to fall off.
        work_exponent: Shortest-remaining-work bias: each job that reports
            its remaining work ``W`` (seconds on one replica) has its utility
            multiplied by ``max((1 + W / work_scale) ** -work_exponent,
            work_floor)``. Jobs that do not report it keep weight 1. 0
            disables it.
        work_scale: Seconds of one-replica work at which the weight starts
            to fall off (default: 10 GPU-hours).
        work_floor: Smallest weight of the size bias, in ``(0, 1]``: the long
            jobs keep at least this much priority per job between them (see
            ``floor_order`` for how they share it), which bounds how much the
            longest jobs (and so the p99 JCT and the makespan) lose to the
            short ones.
        floor_order: How the jobs held at ``work_floor`` split their total
            weight, in ``(0, 1]``: sorted by remaining work, the ``k``-th
            shortest gets a part proportional to ``floor_order ** k`` (none
            above twice the floor). Below 1 the shortest long job finishes
            first instead of every long job finishing late, and the longest
            ones fall below the floor while they wait their turn; much below
            0.6 the favoured job runs on so many GPUs that the makespan
            suffers. 1 gives them equal weights, each exactly the floor.
        queue_discount: Factor in ``(0, 1]`` applied once per job with less
            remaining work: sorted by remaining work, the ``k``-th shortest
            job's weight is multiplied by ``queue_discount ** k``, but by
            no less than 0.5, so long jobs are not starved. A gentle
            shortest-remaining-first tie-break between jobs the size bias
            weighs almost the same, which also makes the long jobs yield
            more while many jobs wait; at 0.98 it lowers the average JCT on
            Pollux workloads 1-4 by about 1%, at 0.95 or less the makespan
            passes 1.05x Pollux's. 1 disables it.
        exact_max_jobs: Up to this many jobs, a fractional LP solution is
            followed by the full integer program (exact); beyond it, only the
            jobs the LP left fractional are re-solved as integers (the LP's
            other choices are kept), which bounds the cost at large scale.
        seed: Accepted for interface uniformity with randomised policies
            (checked like theirs) and ignored: this policy is deterministic.
    """

    name = "adaptdl"
    #: Jobs under this policy adapt their batch size to their allocation.
    adaptive_batch = True

    def __init__(
        self,
        *,
        p: float = 0.0,
        normalize: Normalize = "fair",
        restart_delay: float = 30.0,
        max_nodes_per_job: int = 16,
        mip_rel_gap: float = 1e-6,
        node_limit: int = 2000,
        las_exponent: float = 0.0,
        las_scale: float = 3600.0,
        exact_max_jobs: int = 64,
        work_exponent: float = 1.0,
        work_scale: float = 36000.0,
        work_floor: float = 0.3,
        floor_order: float = 0.7,
        queue_discount: float = 0.98,
        seed: int | None = None,
    ) -> None:
        # Deterministic: nothing to seed, but a bad seed is still an error.
        if seed is not None:
            check_int_type("seed", seed)
            if seed < 0:
                raise ValueError(f"seed={seed!r}: expected an integer >= 0 or None")
        check_real_types(
            p=p,
            restart_delay=restart_delay,
            mip_rel_gap=mip_rel_gap,
            las_exponent=las_exponent,
            las_scale=las_scale,
            work_exponent=work_exponent,
            work_scale=work_scale,
            work_floor=work_floor,
            floor_order=floor_order,
            queue_discount=queue_discount,
        )
        if not (math.isfinite(p) and _MIN_P <= p <= 1.0):
            # Below _MIN_P, _EPSILON ** p swamps the differences between shapes
            # in float64, and the solver leaves GPUs idle (or gets infinities).
            raise ValueError(
                f"p={p!r}: expected an exponent from {_MIN_P:g} to 1 (concave utility)"
            )
        if normalize not in ("fair", "one"):
            raise ValueError(f"normalize={normalize!r}: expected 'fair' or 'one'")
        if not (math.isfinite(restart_delay) and restart_delay >= 0):
            raise ValueError(f"restart_delay={restart_delay!r}: expected a finite number >= 0")
        if isinstance(max_nodes_per_job, bool) or not isinstance(
            max_nodes_per_job, (int, np.integer)
        ):
            raise TypeError(f"max_nodes_per_job={max_nodes_per_job!r}: expected an int")
        if not 1 <= max_nodes_per_job <= MAX_COUNT:
            raise ValueError(
                f"max_nodes_per_job={max_nodes_per_job!r}: expected from 1 to 2**31 - 1"
            )
        if not 0.0 <= mip_rel_gap < 1.0:
            raise ValueError(f"mip_rel_gap={mip_rel_gap!r}: expected within [0, 1)")
        for label, count in (("node_limit", node_limit), ("exact_max_jobs", exact_max_jobs)):
            check_int_type(label, count)
        if not 1 <= node_limit <= MAX_COUNT:  # HiGHS keeps it in a 32-bit int
            raise ValueError(f"node_limit={node_limit!r}: expected from 1 to 2**31 - 1")
        self.p = float(p)
        self.normalize: Normalize = normalize
        self.restart_delay = float(restart_delay)
        self.max_nodes_per_job = int(max_nodes_per_job)
        self.mip_rel_gap = float(mip_rel_gap)
        self.node_limit = int(node_limit)
        if not math.isfinite(las_exponent):
            raise ValueError(f"las_exponent={las_exponent!r}: expected a finite exponent")
        if not las_scale > 0 or not math.isfinite(las_scale):
            raise ValueError(f"las_scale={las_scale!r}: expected a positive number")
        if exact_max_jobs < 0:
            raise ValueError(f"exact_max_jobs={exact_max_jobs!r}: expected >= 0")
        if not math.isfinite(work_exponent) or work_exponent < 0:
            raise ValueError(f"work_exponent={work_exponent!r}: expected a finite number >= 0")
        if not work_scale > 0 or not math.isfinite(work_scale):
            raise ValueError(f"work_scale={work_scale!r}: expected a positive number of seconds")
        if not 0.0 < work_floor <= 1.0:
            raise ValueError(f"work_floor={work_floor!r}: expected a weight in (0, 1]")
        if not 0.0 < floor_order <= 1.0:
            raise ValueError(f"floor_order={floor_order!r}: expected a ratio in (0, 1]")
        if not 0.0 < queue_discount <= 1.0:
            raise ValueError(f"queue_discount={queue_discount!r}: expected a factor in (0, 1]")
        self.exact_max_jobs = int(exact_max_jobs)
        self.las_exponent = float(las_exponent)
        self.las_scale = float(las_scale)
        self.work_exponent = float(work_exponent)
        self.work_scale = float(work_scale)
        self.work_floor = float(work_floor)
        self.floor_order = float(floor_order)
        self.queue_discount = float(queue_discount)

    # ------------------------------------------------------------ candidates

    def _candidates(
        self,
        name: str,
        job: JobInfo,
        node_slots: Sequence[int],
        current: tuple[int, int],
        weight: float,
        fair: tuple[int, int],
        factor: float,
        priority: float = 1.0,
        pinned: bool = False,
    ) -> _Candidates:
        """Candidate shapes of one job with their utilities.

        Args:
            node_slots: Replicas of this job each node holds when empty,
                largest first (nodes that hold none left out), at least the
                first ``max_nodes_per_job`` of them.
            current: The job's current ``(nodes, replicas)``, ``(0, 0)`` if none.
                It stays a candidate only within the job's replica bounds,
                unless the job is pinned (non-preemptible and running).
            weight: Dominant share of one replica times the number of nodes,
                so that a node's worth of resources has weight about 1.
            fair: The fair-share configuration used as the speedup's base.
            factor: Restart discount for a changed configuration.
            priority: The job's weight from :meth:`_priorities`.
        """
        low = max(job.min_replicas, 1)
        high = job.max_replicas
        node_size = node_slots[0] if node_slots else 0
        spans = min(self.max_nodes_per_job, len(node_slots))
        shapes: list[tuple[int, int]] = []
        size = 1
        while size <= node_size:
            shapes.append((1, size))
            size *= 2
        if node_size >= 1:
            shapes.append((1, node_size))
            shapes.append((1, min(node_size, high)))
        # k whole nodes: k node-fulls of the k-th largest size (any k nodes
        # that large), and the k largest filled (on equal nodes, the same).
        for k in range(2, spans + 1):
            shapes.append((k, k * node_slots[k - 1]))
            shapes.append((k, sum(node_slots[:k])))
        # The replica bounds themselves, on the fewest nodes that hold them, so
        # that a job whose bounds admit none of the shapes above (min = max = 6
        # on 4-GPU nodes) still runs.
        for bound in (low, high):
            for k in range(1, spans + 1):
                if sum(node_slots[:k]) >= bound:  # the k largest, filled (8 + 4 = 12)
                    shapes.append((k, bound))
                    break
        shapes = sorted({s for s in shapes if low <= s[1] <= high})
        keep = -1
        current_ok = low <= current[1] <= high and current[0] <= self.max_nodes_per_job
        if current[1] > 0 and (pinned or current_ok):
            if current not in shapes:
                shapes.append(current)
            keep = shapes.index(current)
        if not shapes:
            return _Candidates(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), -1)
        nodes = np.array([s[0] for s in shapes] + [fair[0]], dtype=np.int64)
        replicas = np.array([s[1] for s in shapes] + [fair[1]], dtype=np.int64)
        speedup = evaluate_speedup(name, job, nodes, replicas)
        nodes, replicas, base, speedup = nodes[:-1], replicas[:-1], speedup[-1], speedup[:-1]
        if self.normalize == "fair" and base > 0:
            speedup = speedup / base
        discount = np.full(len(shapes), factor)
        if keep >= 0:
            discount[keep] = 1.0
        value = speedup * discount * weight + _EPSILON
        utility = _transform(value, self.p) - _transform(np.array([_EPSILON]), self.p)[0]
        utility = utility * priority
        # Drop dominated shapes (more replicas, no more utility): they can never
        # be optimal, and fewer variables make the MILP much cheaper.
        order = np.lexsort((-utility, replicas))
        best = -np.inf
        kept: list[int] = []
        for idx in order:
            if utility[idx] > best or idx == keep:
                kept.append(int(idx))
                best = max(best, float(utility[idx]))
        kept.sort()
        keep = kept.index(keep) if keep >= 0 else -1
        sel = np.array(kept, dtype=np.int64)
        nodes, replicas, utility = nodes[sel], replicas[sel], utility[sel]
        return _Candidates(nodes, replicas, utility, keep)

    def _priorities(self, jobs: Mapping[str, JobInfo]) -> dict[str, float]:
        """Each job's utility weight from the LAS and remaining-work biases.

        Jobs at ``work_floor`` are then ordered by remaining work (see
        ``floor_order``); their total weight stays the same (with the LAS bias
        off), but none rises above ``2 * work_floor`` (or 1), so however many
        long jobs there are, none outranks a shorter job weighted above that.
        Last, the queue discount ranks every job that reports its remaining
        work (ties broken by name, so the order of ``jobs`` does not matter).
        """
        weights: dict[str, float] = {}
        at_floor: list[tuple[float, str]] = []
        known: list[tuple[float, str]] = []
        needs_work = self.work_exponent != 0 or self.queue_discount < 1.0
        for name, job in jobs.items():
            weight = 1.0
            if self.las_exponent != 0:
                service = max(job.attained_service, 0.0)
                # In logs, clipped: a large negative exponent must not overflow.
                power = -self.las_exponent * math.log1p(service / self.las_scale)
                weight *= math.exp(min(max(power, -_MAX_LOG), _MAX_LOG))
            work = remaining_work(name, job) if needs_work else None
            if work is not None:
                known.append((work, name))
                if self.work_exponent != 0:
                    size = (1.0 + work / self.work_scale) ** -self.work_exponent
                    if size <= self.work_floor:
                        at_floor.append((work, name))
                    weight *= max(size, self.work_floor)
            weights[name] = weight
        if self.floor_order < 1.0 and len(at_floor) > 1:
            at_floor.sort()
            parts = _capped_split(
                self.floor_order ** np.arange(len(at_floor), dtype=np.float64),
                len(at_floor),
                min(2.0, 1.0 / self.work_floor),
            )
            for part, (_, name) in zip(parts, at_floor):
                weights[name] *= float(part)
        if self.queue_discount < 1.0:
            known.sort()
            for rank, (_, name) in enumerate(known):
                weights[name] *= max(self.queue_discount**rank, _QUEUE_DISCOUNT_FLOOR)
        return weights

    # -------------------------------------------------------------- solving

    def _solve(
        self,
        cands: Sequence[_Candidates],
        res: IntArray,
        capacity: IntArray,
        whole_nodes: int,
        pinned: Sequence[bool],
    ) -> list[int]:
        """Choose at most one candidate per job; returns indices (-1: none)."""
        counts = np.array([len(c.nodes) for c in cands], dtype=np.int64)
        total = int(counts.sum())
        if total == 0:
            return [-1] * len(cands)
        job_of = np.repeat(np.arange(len(cands)), counts)
        nodes = np.concatenate([c.nodes for c in cands])
        replicas = np.concatenate([c.replicas for c in cands])
        utility = np.concatenate([c.utility for c in cands])
        var = np.arange(total)
        rows = [scipy.sparse.csr_matrix((np.ones(total), (job_of, var)), shape=(len(cands), total))]
        upper = [np.ones(len(cands))]
        lower = [np.zeros(len(cands))]
        # Resource capacity, per resource type.
        usage = replicas[:, None] * res[job_of]  # (V, R)
        rows.append(scipy.sparse.csr_matrix(usage.T.astype(np.float64)))
        upper.append(capacity.astype(np.float64))
        lower.append(np.full(len(capacity), -np.inf))
        # Whole nodes for multi-node shapes; pinned jobs keep theirs, which
        # the caller already took out of ``whole_nodes`` (they may overlap).
        multi = np.where(nodes > 1, nodes, 0).astype(np.float64)
        lb = np.zeros(total)
        ub = np.ones(total)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for j, cand in enumerate(cands):
            if pinned[j] and cand.keep >= 0:
                lb[offsets[j] + cand.keep] = 1.0
                multi[offsets[j] + cand.keep] = 0.0
        rows.append(scipy.sparse.csr_matrix(multi[None]))
        upper.append(np.array([float(whole_nodes)]))
        lower.append(np.array([-np.inf]))
        bounds = scipy.optimize.Bounds(lb, ub)
        constraints = scipy.optimize.LinearConstraint(
            scipy.sparse.vstack(rows).tocsr(), np.concatenate(lower), np.concatenate(upper)
        )

        # The LP relaxation of this multiple-choice knapsack is usually
        # integral already (a vertex has at most one fractional job per
        # coupling constraint); solving it first skips HiGHS' MIP machinery,
        # which costs more than the LP itself.
        def solve_integer(box: scipy.optimize.Bounds) -> Any:
            return scipy.optimize.milp(
                -utility,
                integrality=np.ones(total),
                bounds=box,
                constraints=constraints,
                options={"mip_rel_gap": self.mip_rel_gap, "node_limit": self.node_limit},
            )

        result = scipy.optimize.milp(
            -utility, integrality=np.zeros(total), bounds=bounds, constraints=constraints
        )
        if result.x is not None:
            fractional = np.abs(result.x - np.round(result.x)) > 1e-7
            if fractional.any() and len(cands) <= self.exact_max_jobs:
                result = solve_integer(bounds)
            elif fractional.any():
                # Keep the jobs the LP already decided integrally and solve the
                # integer program over the few fractional jobs only: after
                # presolve removes the fixed columns it is tiny, whereas the
                # full MIP costs seconds at a few hundred jobs.
                open_job = np.zeros(len(cands), dtype=bool)
                open_job[job_of[fractional]] = True
                fixed = ~open_job[job_of]
                rounded = np.round(result.x)
                sub = solve_integer(
                    scipy.optimize.Bounds(
                        np.where(fixed, rounded, lb), np.where(fixed, rounded, ub)
                    )
                )
                result = sub if sub.x is not None else solve_integer(bounds)
        if result.x is None:
            # Infeasible only if pinned jobs oversubscribe the cluster; keep
            # them and give nobody else anything rather than guessing.
            return [c.keep if pinned[j] else -1 for j, c in enumerate(cands)]
        chosen = np.round(result.x).astype(np.int64)
        out: list[int] = []
        for j in range(len(cands)):
            picks = np.flatnonzero(chosen[offsets[j] : offsets[j + 1]])
            out.append(int(picks[0]) if len(picks) else -1)
        return out

    # ------------------------------------------------------------- placement

    @staticmethod
    def _place_single(
        free_slots: IntArray, replicas: int, prefer: Sequence[int], foreign: NDArray[np.bool_]
    ) -> int | None:
        """Best-fit node for ``replicas`` replicas, or None.

        Nodes with resources the job does not use (GPUs, for a CPU-only job)
        come last, so they stay free for the jobs that need them.
        """
        fits = np.flatnonzero(free_slots >= replicas)
        if len(fits) == 0:
            return None
        leftover = free_slots[fits] - replicas
        preferred = np.isin(fits, np.asarray(prefer, dtype=np.int64))
        order = np.lexsort((fits, ~preferred, leftover, foreign[fits]))
        return int(fits[order[0]])

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        """Choose each job's configuration by MILP and place it on nodes."""
        check_round(jobs, nodes, previous, now)
        if not jobs:
            return Decision({})
        if not nodes:
            return Decision({name: () for name in jobs})
        node_names = sorted(nodes)
        col = {n: i for i, n in enumerate(node_names)}
        keys = resource_keys(jobs, nodes)
        cap = node_capacity([nodes[n] for n in node_names], keys)

        def valid_previous(name: str) -> bool:
            alloc = previous.get(name, ())
            return bool(alloc) and all(n in col for n in alloc)

        # Non-preemptible running jobs keep their allocation only while they
        # fit together (the rule check_decision enforces); otherwise they are
        # ordinary jobs this round, their replica limits included.
        held = pinned_allocations(jobs, nodes, previous)
        names = sorted(
            jobs,
            key=lambda n: (
                n not in held,
                jobs[n].attained_service,
                jobs[n].submission_time,
                n,
            ),
        )
        res = job_demand(names, jobs, keys)
        base = allocation_matrix(names, previous, col, len(node_names))
        # An allocation on nodes that shrank below it is re-placed like a new
        # job's: holding it (pinned) would leave the job nothing that fits.
        fits = np.all(base <= replicas_fitting(cap, res), axis=1)
        valid = [valid_previous(n) and bool(fits[j]) for j, n in enumerate(names)]
        pinned = [valid[j] and n in held for j, n in enumerate(names)]
        base[~np.array(valid, dtype=bool)] = 0

        slots = replicas_fitting(cap, res)  # (J, N) per node, empty cluster
        total = cap.sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(total > 0, res / np.where(total > 0, total, 1), 0.0)
        dom_share = share.max(axis=1)
        priority = self._priorities(jobs)
        # Each job's per-node capacity, largest first; shapes use at most
        # max_nodes_per_job of them.
        by_size = -np.sort(-slots, axis=1)[:, : self.max_nodes_per_job]
        usable = np.minimum((slots > 0).sum(axis=1), self.max_nodes_per_job)
        cands: list[_Candidates] = []
        for j, name in enumerate(names):
            job = jobs[name]
            node_slots = by_size[j, : usable[j]].tolist()
            row = base[j]
            current = (int((row > 0).sum()), int(row.sum()))
            fair = fair_share_config(float(dom_share[j]), len(node_names), len(names))
            cands.append(
                self._candidates(
                    name,
                    job,
                    node_slots,
                    current,
                    float(dom_share[j]) * len(node_names),
                    fair,
                    max(restart_factor(job, now, self.restart_delay), _MIN_RESTART_FACTOR),
                    priority=priority[name],
                    pinned=pinned[j],
                )
            )
        spread = np.array(pinned, dtype=bool) & ((base > 0).sum(axis=1) > 1)
        whole_nodes = len(node_names) - int((base[spread] > 0).any(axis=0).sum())
        choice = self._solve(cands, res, total, whole_nodes, pinned)
        allocations = self._place(names, cands, choice, base, pinned, cap, res)
        decision = {
            name: tuple(
                itertools.chain.from_iterable(
                    (node_names[n],) * int(allocations[j][n])
                    for n in np.flatnonzero(allocations[j])
                )
            )
            for j, name in enumerate(names)
        }
        return Decision(in_previous_order(decision, previous))

    def _place(
        self,
        names: Sequence[str],
        cands: Sequence[_Candidates],
        choice: Sequence[int],
        base: IntArray,
        pinned: Sequence[bool],
        cap: IntArray,
        res: IntArray,
    ) -> IntArray:
        """Turn chosen configurations into replica counts per node.

        Kept jobs first (pinned, then unchanged shapes), then new multi-node
        jobs on whole free nodes, largest first, then single-node jobs
        best-fit, largest first. Jobs that fit nowhere keep their current
        allocation if it still fits, else fall back to their best smaller
        candidate. Last, jobs the solver left out take what is still free
        (the solver sees capacities summed over nodes, so on unequal nodes or
        with several resource types its choice may not fit, and what it
        planned for a job that did not fit would otherwise stay idle).
        """
        num_jobs, num_nodes = base.shape
        out = np.zeros((num_jobs, num_nodes), dtype=np.int64)
        free = cap.copy()
        hosts_distributed = np.zeros(num_nodes, dtype=bool)

        def take(j: int, row: IntArray) -> None:
            nonlocal free
            out[j] = row
            free = free - row[:, None] * res[j][None, :]
            if (row > 0).sum() > 1:
                hosts_distributed[row > 0] = True

        pending: list[int] = []
        for j in range(num_jobs):
            c = choice[j]
            if c < 0:
                continue
            keep = c == cands[j].keep and c >= 0
            row = base[j]
            distributed = (row > 0).sum() > 1
            fits = bool(np.all(row[:, None] * res[j][None, :] <= free))
            clash = distributed and bool(np.any(hosts_distributed[row > 0]))
            if keep and fits and (pinned[j] or not clash):
                take(j, row)
            else:
                pending.append(j)

        def try_place(j: int, num: int, reps: int) -> bool:
            slots = replicas_fitting(free, res[j : j + 1])[0]
            full = replicas_fitting(cap, res[j : j + 1])[0]
            foreign = ((cap > 0) & (res[j] == 0)[None, :]).any(axis=1)
            if num == 1:
                node = self._place_single(slots, reps, np.flatnonzero(base[j]).tolist(), foreign)
                if node is None:
                    return False
                row = np.zeros(num_nodes, dtype=np.int64)
                row[node] = reps
                take(j, row)
                return True
            empty = np.flatnonzero((slots == full) & (full > 0) & ~hosts_distributed)
            if len(empty) < num:
                return False
            # Own nodes first, then the smallest that fit, so larger nodes stay
            # free for jobs that need them; name order only breaks ties. If
            # those do not hold the replicas, the least capacity that does.
            own = np.isin(empty, np.flatnonzero(base[j]))
            first = empty[np.lexsort((empty, full[empty], ~own, foreign[empty]))][:num]
            chosen = (
                first
                if full[first].sum() >= reps
                else _smallest_holding(empty[np.lexsort((empty, full[empty]))], full, num, reps)
            )
            if chosen is None:
                return False
            # Fill the nodes in turn, smallest first, each keeping at least one
            # replica for the rest: the remainder is left on one node, the
            # largest (4 + 2, not 3 + 3), where a single-node job can use it.
            row = np.zeros(num_nodes, dtype=np.int64)
            left = reps
            for index, node in enumerate(chosen[np.argsort(full[chosen], kind="stable")]):
                row[node] = min(int(full[node]), left - (num - index - 1))
                left -= int(row[node])
            take(j, row)
            return True

        def try_keep(j: int) -> bool:
            row = base[j]
            if not row.any() or not np.all(row[:, None] * res[j][None, :] <= free):
                return False
            if (row > 0).sum() > 1 and np.any(hosts_distributed[row > 0]):
                return False
            take(j, row)
            return True

        pending.sort(key=lambda j: (-cands[j].nodes[choice[j]], -cands[j].replicas[choice[j]], j))
        failed: list[int] = []
        for j in pending:
            c = choice[j]
            if not try_place(j, int(cands[j].nodes[c]), int(cands[j].replicas[c])):
                failed.append(j)

        def settle(j: int, below: float) -> None:
            """Keep j's allocation if it fits, else its best shape under ``below`` replicas."""
            if cands[j].keep >= 0 and try_keep(j):
                return
            for c in np.argsort(-cands[j].utility, kind="stable"):
                if cands[j].replicas[c] < below and try_place(
                    j, int(cands[j].nodes[c]), int(cands[j].replicas[c])
                ):
                    return

        for j in failed:
            settle(j, float(cands[j].replicas[choice[j]]))
        left_out = [j for j in range(num_jobs) if choice[j] < 0 and len(cands[j].utility)]
        left_out.sort(key=lambda j: (-float(cands[j].utility.max()), j))
        for j in left_out:
            settle(j, math.inf)
        return out


#: Search steps :func:`_smallest_holding` may take before it settles for the
#: best set found so far (a bound on the work, which does not depend on the
#: speed of the machine, so results stay deterministic).
_NODE_SET_STEPS = 20_000


def _smallest_holding(ascending: IntArray, full: IntArray, num: int, reps: int) -> IntArray | None:
    """``num`` of the nodes ``ascending`` (by capacity) that hold ``reps`` with least capacity.

    So larger nodes stay free for the jobs placed next (10 replicas on nodes
    of 2, 4, 8 and 8 take 2 + 8 and leave an 8). A branch and bound over how
    many nodes of each size to take, smallest sizes first; within a size the
    first nodes in ``ascending`` are taken, so ties are broken by order.

    Returns:
        The chosen node indices, or None when no ``num`` nodes hold ``reps``.
    """
    sizes, counts = np.unique(full[ascending], return_counts=True)
    values = [int(size) for size in sizes]
    # top[k]: the capacity of the k largest nodes; from size class i on there
    # are nodes_from[i] nodes, and any k <= nodes_from[i] largest lie there.
    top = np.concatenate(([0], np.cumsum(np.sort(full[ascending])[::-1]))).tolist()
    nodes_from = np.concatenate((np.cumsum(counts[::-1])[::-1], [0])).tolist()
    if len(ascending) < num or top[num] < reps:
        return None
    best_sum = int(top[num])  # the num largest hold them: the fallback
    best_taken: list[int] | None = None
    taken = [0] * len(values)
    steps = 0

    def search(index: int, left: int, total: int) -> None:
        nonlocal best_sum, best_taken, steps
        steps += 1
        if left == 0:
            if reps <= total and (total < best_sum or best_taken is None):
                best_sum, best_taken = total, list(taken)
            return
        if index == len(values) or steps > _NODE_SET_STEPS:
            return
        # Prune: too few nodes left, too little capacity, or no better than the best.
        if nodes_from[index] < left or total + top[left] < reps:
            return
        if total + left * values[index] > best_sum:
            return
        for take in range(min(int(counts[index]), left), -1, -1):
            taken[index] = take
            search(index + 1, left - take, total + take * values[index])
        taken[index] = 0

    search(0, num, 0)
    if best_taken is None:  # out of steps before any set: the num largest
        return np.asarray(ascending[::-1][:num], dtype=np.int64)
    chosen = [
        int(node)
        for index, value in enumerate(values)
        for node in ascending[full[ascending] == value][: best_taken[index]]
    ]
    return np.asarray(chosen, dtype=np.int64)


def _make_adaptdl(**options: Any) -> Policy:
    return AdaptDLPolicy(**options)


register_policy("adaptdl", _make_adaptdl)
