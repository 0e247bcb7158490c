"""The Pollux policy: a genetic search over (job x node) replica matrices.

Pollux (OSDI'21) co-adapts resources and batch sizes: every job reports a
goodput-based speedup function, and the scheduler searches for the matrix
``X[j, n]`` (replicas of job ``j`` on node ``n``) that maximises a fairness-
weighted sum of speedups. The search is an NSGA-II-style genetic algorithm with
problem-specific operators; this module reimplements it with every operator
vectorised over the whole population, so one round (100 individuals x 100
generations) costs milliseconds rather than seconds.

Two flavours are provided:

* ``"osdi"`` (default): the variant evaluated in the paper. Jobs are ordered by
  attained service, speedups are re-based on the fair-share configuration, the
  objective is a power mean (``p = -1``) with an age-aware restart factor, and
  the second objective is cluster utility, from the re-based speedups as in
  the original (which re-based the speedup function itself).
* ``"released"``: the variant of the released scheduler. Jobs are ordered by
  ``min_replicas`` then submission time, the objective is a plain sum with a
  flat 10 % restart penalty, and the second objective is the cluster size over
  real plus virtual nodes, which drives ``Decision.desired_nodes``
  (autoscaling). Its operators are the released scheduler's, but a child's
  cluster size is drawn after mutation rather than before: drawn before,
  mutation spread nearly every child over the last columns, and on 8 or more
  nodes no solution within the real nodes but the empty one survived.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from adaptdl._checks import check_bool
from adaptdl.sched._matrix import (
    FloatArray,
    IntArray,
    allocation_matrix,
    evaluate_speedup,
    fair_share_config,
    in_previous_order,
    job_demand,
    matrix_to_allocation,
    node_capacity,
    replicas_fitting,
    resource_keys,
    restart_factor,
)
from adaptdl.sched._types import (
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

__all__ = ["PolluxPolicy"]

Flavour = Literal["osdi", "released"]
BoolArray = npt.NDArray[np.bool_]

_EPSILON = 1e-3  # keeps a job with zero speedup from sending the power mean to 0/inf
_VIRTUAL_PREFIX = "~virtual-"
_INT_MAX = int(np.iinfo(np.int64).max)

#: Most candidate evaluations (population x generations) one round may do.
_MAX_SEARCH = 1_000_000

#: Most memory the speedup lookup tables (jobs x nodes x replicas) may take:
#: a node holding millions of replicas would otherwise fail in numpy.
_MAX_TABLE_BYTES = 2 * 2**30

#: Broods bred per generation until ``population`` new, distinct children
#: are found (pymoo's mating loop, which the original used, tries 100 times).
_MATING_TRIES = 100


@dataclass(frozen=True)
class _Problem:
    """Everything one round's search needs, as dense arrays in priority order."""

    job_names: tuple[str, ...]
    columns: tuple[str, ...]  # node names; virtual columns last (released flavour)
    num_real: int
    cap: IntArray  # (N, R) capacity per column
    res: IntArray  # (J, R) resources per replica
    base: IntArray  # (J, N) current allocation
    pinned: BoolArray  # (J,) non-preemptible jobs that already run
    lost: BoolArray  # (J,) jobs that lost a node: every row of theirs restarts
    max_cell: IntArray  # (J, N) replicas a node can hold for a job alone
    max_total: IntArray  # (J,) per-job replica cap
    min_total: IntArray  # (J,) per-job replica floor (0: may be paused)
    min_cell: IntArray  # (J, N) min_replicas placed greedily on the first nodes
    table: FloatArray  # (J, nodes+1, replicas+1) objective speedup per config
    weight: FloatArray  # (J,) dom_share x number of columns
    change_factor: FloatArray  # (J,) multiplier for changed rows


def _cluster_size(x: IntArray) -> IntArray:
    """One past the last column each individual uses (0 if it uses none)."""
    used = np.any(x > 0, axis=1)
    last = x.shape[2] - np.argmax(used[:, ::-1], axis=1)
    return np.where(used.any(axis=1), last, 0).astype(np.int64)


def _power_mean(values: FloatArray, p: float) -> FloatArray:
    """Power mean over the last axis; ``p = 0`` is the geometric mean."""
    if p == 0.0:
        result: FloatArray = np.exp(np.mean(np.log(values), axis=-1))
        return result
    return np.asarray(np.mean(values**p, axis=-1) ** (1.0 / p), dtype=np.float64)


def _nondominated_ranks(f1: FloatArray, f2: FloatArray) -> IntArray:
    """Front index (0 = Pareto front) of each point, both objectives minimised.

    For two objectives, sweeping points by ``(f1, f2)`` and keeping the last
    (smallest-``f2``) point of each front gives every front's dominance test in
    O(1); the fronts' keys stay sorted, so a binary search finds the first front
    that does not dominate the point: O(n log n) in all.
    """
    order = np.lexsort((f2, f1))
    ranks = np.empty(len(f1), dtype=np.int64)
    keys: list[tuple[float, float]] = []  # (f2, f1) of each front's last point
    for idx in order:
        key = (float(f2[idx]), float(f1[idx]))
        front = bisect.bisect_left(keys, key)
        if front == len(keys):
            keys.append(key)
        else:
            keys[front] = key
        ranks[idx] = front
    return ranks


def _crowding_of_distinct(f1: FloatArray, f2: FloatArray, ranks: IntArray) -> FloatArray:
    """NSGA-II crowding distance within each front of distinct points (ends infinite).

    Vectorised over all fronts: sort by (front, objective), and a point's
    neighbours are the adjacent entries of the same front.
    """
    size = len(f1)
    crowd = np.zeros(size, dtype=np.float64)
    if size == 0:
        return crowd
    for values in (f1, f2):
        order = np.lexsort((values, ranks))
        sorted_ranks = ranks[order]
        sorted_values = values[order]
        first = np.ones(size, dtype=bool)
        first[1:] = sorted_ranks[1:] != sorted_ranks[:-1]
        last = np.ones(size, dtype=bool)
        last[:-1] = sorted_ranks[1:] != sorted_ranks[:-1]
        starts = np.flatnonzero(first)
        lows = sorted_values[starts]
        highs = np.maximum.reduceat(sorted_values, starts)
        span = np.repeat(highs - lows, np.diff(np.append(starts, size)))
        dist = np.full(size, np.inf)
        inner = ~(first | last)
        idx = np.flatnonzero(inner)
        with np.errstate(divide="ignore", invalid="ignore"):
            gaps = (sorted_values[idx + 1] - sorted_values[idx - 1]) / span[idx]
        dist[idx] = np.where(span[idx] > 0, gaps, 0.0)
        crowd[order] += dist
    return crowd


def _crowding(f1: FloatArray, f2: FloatArray, ranks: IntArray) -> FloatArray:
    """NSGA-II crowding distance, copies counted once (as pymoo does).

    A point equal in both objectives to an earlier one of its front gets no
    crowding credit, and the others' distances are measured without the
    copies, so a copy neither crowds out nor shields its twin.
    """
    size = len(f1)
    order = np.lexsort((np.arange(size), f2, f1, ranks))
    same = np.zeros(size, dtype=bool)
    same[1:] = (
        (ranks[order][1:] == ranks[order][:-1])
        & (f1[order][1:] == f1[order][:-1])
        & (f2[order][1:] == f2[order][:-1])
    )
    keep = np.ones(size, dtype=bool)
    keep[order[same]] = False
    crowd = np.zeros(size, dtype=np.float64)
    crowd[keep] = _crowding_of_distinct(f1[keep], f2[keep], ranks[keep])
    return crowd


def _binary_tournament(
    a: IntArray, b: IntArray, f1: FloatArray, f2: FloatArray, crowd: FloatArray, coin: BoolArray
) -> IntArray:
    """Winner of each pair ``a[i]``, ``b[i]`` (objectives minimised).

    One that dominates the other wins; otherwise the larger crowding
    distance; otherwise ``coin`` picks ``a``.
    """
    a_le = (f1[a] <= f1[b]) & (f2[a] <= f2[b])
    b_le = (f1[b] <= f1[a]) & (f2[b] <= f2[a])
    a_dom = a_le & ~b_le
    b_dom = b_le & ~a_le
    a_wins = a_dom | (~b_dom & ((crowd[a] > crowd[b]) | ((crowd[a] == crowd[b]) & coin)))
    winners: IntArray = np.where(a_wins, a, b)
    return winners


class PolluxPolicy(Policy):
    """Pollux: goodput-driven co-adaptive scheduling by genetic search.

    Args:
        flavour: ``"osdi"`` (the paper's policy) or ``"released"`` (the
            released scheduler's objective plus autoscaling output).
        p: Fairness exponent of the power mean (osdi flavour); ``-1`` is the
            harmonic mean, ``0`` the geometric mean, ``1`` the arithmetic mean.
        population: GA population size (and offspring per generation).
        generations: GA generations per round.
        seed: Seed of the policy's own random generator; the same seed and
            inputs give the same decisions.
        interference_avoidance: Allow at most one distributed job per node.
            ``False`` reproduces the paper's "noavoid" experiment.
        max_nodes_per_job: Most nodes one job may span; ``None`` (the
            default) means 16 for the osdi flavour, as in the paper's
            simulator, and no limit for the released one, whose repair has
            none.
        restart_delay: Seconds one restart costs (the ``delta`` of the
            age-aware restart factor, osdi flavour).
        restart_penalty: Flat penalty for a changed allocation (released).
        crossover_prob: Probability that a selected pair is crossed over.
        utility_band: Target cluster-utility band for autoscaling (released).
        node_template: Resources of a node the cluster could add (released);
            defaults to the per-resource maximum over the current nodes.
    """

    name = "pollux"
    #: Jobs under this policy adapt their batch size to their allocation.
    adaptive_batch = True

    def __init__(
        self,
        *,
        flavour: Flavour = "osdi",
        p: float = -1.0,
        population: int = 100,
        generations: int = 100,
        seed: int = 0,
        interference_avoidance: bool = True,
        max_nodes_per_job: int | None = None,
        restart_delay: float = 30.0,
        restart_penalty: float = 0.1,
        crossover_prob: float = 0.9,
        utility_band: tuple[float, float] = (0.35, 0.65),
        node_template: NodeInfo | None = None,
    ) -> None:
        if flavour not in ("osdi", "released"):
            raise ValueError(f"flavour={flavour!r}: expected 'osdi' or 'released'")
        check_real_types(
            p=p,
            restart_delay=restart_delay,
            restart_penalty=restart_penalty,
            crossover_prob=crossover_prob,
        )
        check_bool("interference_avoidance", interference_avoidance)
        if not isinstance(utility_band, (tuple, list)) or len(utility_band) != 2:
            raise TypeError(f"utility_band={utility_band!r}: expected a pair (low, high)")
        check_real_types(**{"utility_band[0]": utility_band[0], "utility_band[1]": utility_band[1]})
        if not math.isfinite(p):
            raise ValueError(f"p={p!r}: expected a finite fairness exponent")
        for label, number in (
            ("seed", seed),
            ("population", population),
            ("generations", generations),
        ):
            check_int_type(label, number)
        if seed < 0:
            raise ValueError(f"seed={seed!r}: expected an integer >= 0")
        if population < 1:
            raise ValueError(f"population={population!r}: expected at least 1")
        if generations < 0:
            raise ValueError(f"generations={generations!r}: expected >= 0")
        if population * max(generations, 1) > _MAX_SEARCH:
            # A round that long would stall a live cluster's daemon for hours.
            raise ValueError(
                f"population={population!r}, generations={generations!r}: at most "
                f"{_MAX_SEARCH} candidate evaluations per round (population x generations; "
                "the default is 100 x 100)"
            )
        if max_nodes_per_job is None:
            max_nodes_per_job = 16 if flavour == "osdi" else _INT_MAX
        check_int_type("max_nodes_per_job", max_nodes_per_job)
        if max_nodes_per_job < 1:
            raise ValueError(f"max_nodes_per_job={max_nodes_per_job!r}: expected >= 1")
        if not (math.isfinite(restart_delay) and restart_delay >= 0):
            raise ValueError(f"restart_delay={restart_delay!r}: expected a finite number >= 0")
        if node_template is not None and not isinstance(node_template, NodeInfo):
            raise TypeError(f"node_template={node_template!r}: expected a NodeInfo or None")
        if not 0.0 <= restart_penalty <= 1.0:
            raise ValueError(f"restart_penalty={restart_penalty!r}: expected within [0, 1]")
        if not 0.0 <= crossover_prob <= 1.0:
            raise ValueError(f"crossover_prob={crossover_prob!r}: expected within [0, 1]")
        low, high = utility_band
        if not 0.0 <= low <= high:
            raise ValueError(f"utility_band={utility_band!r}: expected 0 <= low <= high")
        self.flavour: Flavour = flavour
        self.p = float(p)
        self.population = int(population)
        self.generations = int(generations)
        self.seed = seed
        self.interference_avoidance = bool(interference_avoidance)
        self.max_nodes_per_job = int(max_nodes_per_job)
        self.restart_delay = float(restart_delay)
        self.restart_penalty = float(restart_penalty)
        self.crossover_prob = float(crossover_prob)
        self.utility_band = (float(low), float(high))
        self.node_template = node_template
        self._rng = np.random.default_rng(seed)
        # The previous round's Pareto set, to seed the next round's search.
        self._pareto: tuple[tuple[str, ...], tuple[str, ...], int, IntArray] | None = None

    # ------------------------------------------------------------------ setup

    def _job_order(
        self, jobs: Mapping[str, JobInfo], pinned: Mapping[str, bool]
    ) -> tuple[str, ...]:
        """Priority order: pinned jobs first, then the flavour's ordering.

        The repair step hands contested resources to earlier jobs, so this
        order is the policy's notion of priority.
        """

        def key(name: str) -> tuple[Any, ...]:
            job = jobs[name]
            if self.flavour == "osdi":
                return (not pinned[name], job.attained_service, job.submission_time, name)
            return (not pinned[name], job.min_replicas, job.submission_time, name)

        return tuple(sorted(jobs, key=key))

    def _columns(self, nodes: Mapping[str, NodeInfo]) -> tuple[list[str], list[NodeInfo]]:
        """Real node columns, plus as many virtual template nodes (released)."""
        if self.flavour == "osdi":
            names = sorted(nodes)
        else:
            names = sorted(nodes, key=lambda n: (nodes[n].preemptible, n))
        infos = [nodes[n] for n in names]
        if self.flavour == "released" and nodes:
            template = self.node_template
            if template is None:
                keys = sorted({k for info in infos for k in info.resources})
                template = NodeInfo(
                    {k: max(int(info.resources.get(k, 0)) for info in infos) for k in keys},
                    preemptible=True,
                )
            for i in range(len(names)):
                names.append(f"{_VIRTUAL_PREFIX}{i}")
                infos.append(template)
        return names, infos

    def _build(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> _Problem:
        columns, infos = self._columns(nodes)
        col_index = {name: i for i, name in enumerate(columns)}
        keys = resource_keys(jobs, nodes)
        cap = node_capacity(infos, keys)
        # A non-preemptible job that lost a node must restart anyway: it is
        # re-placed like a new job, not held at what is left of it.
        # Nor is one whose nodes shrank below its allocation, alone or with
        # the other pinned jobs: held there, the capacity repair would cut it
        # below its min_replicas.
        held = pinned_allocations(jobs, nodes, previous)
        pinned_by_name = {name: name in held for name in jobs}
        names = self._job_order(jobs, pinned_by_name)
        res = job_demand(names, jobs, keys)
        base = allocation_matrix(names, previous, col_index, len(columns))
        pinned = np.array([pinned_by_name[n] for n in names], dtype=bool)
        lost = np.array(
            [any(n not in nodes for n in previous.get(j, ())) for j in names], dtype=bool
        )
        # Pinned jobs' resources are not up for grabs: mutation sizes the
        # other jobs' cells against what the pinned ones leave free.
        pinned_use = (base[pinned, :, None] * res[pinned, None, :]).sum(axis=0)
        max_cell = replicas_fitting(cap - pinned_use, res)
        max_cell[pinned] = base[pinned]
        num_jobs = len(names)
        max_total = np.array([jobs[n].max_replicas for n in names], dtype=np.int64)
        min_total = np.array([jobs[n].min_replicas for n in names], dtype=np.int64)
        max_total[pinned] = np.maximum(max_total[pinned], base[pinned].sum(axis=1))
        min_total[pinned] = 0
        # The released mutation's floor: each job's min_replicas on the first
        # columns that hold them (none for a job that cannot fit them).
        ahead = np.cumsum(max_cell, axis=1) - max_cell
        min_cell = np.clip(min_total[:, None] - ahead, 0, max_cell)
        min_cell[min_cell.sum(axis=1) < min_total] = 0

        # Dominant share of one replica, relative to all columns.
        total = cap.sum(axis=0).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            shares = np.where(total > 0, res / np.where(total > 0, total, 1.0), 0.0)
        dom_share = shares.max(axis=1) if shares.size else np.zeros(num_jobs)
        weight = dom_share * len(columns)

        # Speedup lookup tables indexed by (nodes used, replicas).
        node_limit = max(min(self.max_nodes_per_job, len(columns)), 1)
        per_node = max_cell.max(axis=1) if len(columns) else np.zeros(num_jobs, np.int64)
        top = -np.sort(-max_cell, axis=1)[:, :node_limit].sum(axis=1)
        reach = np.minimum(max_total, np.maximum(top, base.sum(axis=1)))
        width = int(reach.max()) + 1 if num_jobs else 1
        table_bytes = num_jobs * (node_limit + 1) * width * 8
        if table_bytes > _MAX_TABLE_BYTES:
            widest = names[int(np.argmax(reach))]
            raise ValueError(
                f"jobs: job {widest!r} could take up to {int(reach.max())} replicas on these "
                f"nodes, and pollux's speedup tables would need {table_bytes / 2**30:.1f} GiB "
                f"(at most {_MAX_TABLE_BYTES / 2**30:.0f}); give it a max_replicas"
            )
        table = np.zeros((num_jobs, node_limit + 1, width), dtype=np.float64)
        factor = np.ones(num_jobs, dtype=np.float64)
        real_nodes = len(nodes)
        for j, name in enumerate(names):
            job = jobs[name]
            n_grid, r_grid = np.meshgrid(
                np.arange(1, node_limit + 1), np.arange(1, width), indexing="ij"
            )
            valid = (
                (r_grid >= n_grid)
                & (r_grid <= reach[j])
                & (r_grid <= n_grid * max(int(per_node[j]), int(base[j].max(initial=0))))
            )
            nn = n_grid[valid].astype(np.int64)
            rr = r_grid[valid].astype(np.int64)
            values = evaluate_speedup(name, job, nn, rr)
            if self.flavour == "osdi":
                fair_nodes, fair_reps = fair_share_config(float(dom_share[j]), real_nodes, num_jobs)
                fair = evaluate_speedup(name, job, np.array([fair_nodes]), np.array([fair_reps]))[0]
                table[j, nn, rr] = values / fair if fair > 0 else values
                factor[j] = restart_factor(job, now, self.restart_delay)
            else:
                table[j, nn, rr] = values
                factor[j] = 1.0 - self.restart_penalty
        # A narrow genome dtype keeps the population in cache: the GA is
        # memory-bound, and cells never exceed one node's replica count.
        narrow = max(int(max_cell.max(initial=0)), int(base.max(initial=0))) < 2**15
        genome = np.int16 if narrow else np.int64
        base = base.astype(genome)
        max_cell = max_cell.astype(genome)
        return _Problem(
            job_names=names,
            columns=tuple(columns),
            num_real=real_nodes,
            cap=cap,
            res=res,
            base=base,
            pinned=pinned,
            lost=lost,
            max_cell=max_cell,
            max_total=max_total,
            min_total=min_total,
            min_cell=min_cell.astype(genome),
            table=table,
            weight=weight,
            change_factor=factor,
        )

    def _initial_population(self, prob: _Problem) -> IntArray:
        """The previous Pareto set mapped onto this round's jobs and nodes.

        Rows of departed jobs and columns of departed nodes are dropped; new
        jobs and nodes start empty. New real nodes inherit the previous round's
        virtual columns in order (the released flavour's autoscaling: a virtual
        node the search filled is the node the cluster just added). On the
        first round the population is just the current allocation.
        """
        if self._pareto is None:
            first: IntArray = prob.base[None].copy()
            return first
        old_jobs, old_cols, old_real, old_x = self._pareto
        seed = np.zeros((len(old_x), len(prob.job_names), len(prob.columns)), dtype=prob.base.dtype)
        job_map = {name: j for j, name in enumerate(old_jobs)}
        col_map = {name: i for i, name in enumerate(old_cols[:old_real])}
        spare_virtual = list(range(old_real, len(old_cols)))
        targets: list[tuple[int, int]] = []
        for new_col, name in enumerate(prob.columns[: prob.num_real]):
            if name in col_map:
                targets.append((new_col, col_map[name]))
            elif spare_virtual:
                targets.append((new_col, spare_virtual.pop(0)))
        for offset, new_col in enumerate(range(prob.num_real, len(prob.columns))):
            if offset < len(spare_virtual):
                targets.append((new_col, spare_virtual[offset]))
        rows = [(j, job_map[name]) for j, name in enumerate(prob.job_names) if name in job_map]
        if rows and targets:
            new_rows, old_rows = (np.array(v) for v in zip(*rows))
            new_cols, old_cols_idx = (np.array(v) for v in zip(*targets))
            # Capped before the cast: last round's cells may exceed this
            # round's nodes, and a narrow genome would wrap them negative.
            cap = prob.max_cell[new_rows[:, None], new_cols[None, :]].astype(np.int64)
            old = old_x[:, old_rows[:, None], old_cols_idx[None, :]].astype(np.int64)
            seed[:, new_rows[:, None], new_cols[None, :]] = np.minimum(old, cap[None])
        return seed

    # ------------------------------------------------------------- operators

    def _repair(self, prob: _Problem, x: IntArray) -> IntArray:
        """Make every individual feasible, favouring earlier jobs.

        Steps, in order: pinned rows are restored; cells are capped by what a
        node can hold for the job; at most one distributed job per node
        (interference avoidance); per-job replica cap and node-count cap,
        trimming nodes in random order; node capacity, with earlier jobs
        keeping theirs; rows below ``min_replicas`` are cleared.
        """
        x = np.minimum(x, prob.max_cell[None])
        x[:, prob.pinned] = prob.base[prob.pinned]
        if self.interference_avoidance:
            used = x > 0
            distributed = used.sum(axis=2) > 1
            mask = used & distributed[:, :, None]
            clash = mask & (np.cumsum(mask, axis=1, dtype=np.int16) > 1)
            # Pinned rows come first and never lose a node, even to each other.
            clash[:, prob.pinned] = False
            x[clash] = 0
        # Per-job caps; only the (few) offending rows are shuffled and trimmed.
        over = (x.sum(axis=2) > prob.max_total[None]) | (
            (x > 0).sum(axis=2) > self.max_nodes_per_job
        )
        if over.any():
            rows = x[over]
            limit = np.broadcast_to(prob.max_total[None], over.shape)[over]
            order = np.argsort(self._rng.random(rows.shape), axis=1)
            shuffled = np.take_along_axis(rows, order, axis=1)
            capped = np.minimum(np.cumsum(shuffled, axis=1), limit[:, None])
            trimmed = capped.copy()
            trimmed[:, 1:] -= capped[:, :-1]
            occupied = trimmed > 0
            trimmed[occupied & (np.cumsum(occupied, axis=1) > self.max_nodes_per_job)] = 0
            np.put_along_axis(rows, order, trimmed, axis=1)
            x[over] = rows
            x[:, prob.pinned] = prob.base[prob.pinned]
        # Node capacity: running totals over jobs in priority order, computed
        # only for individuals that oversubscribe some node.
        if prob.res.shape[1] == 1:
            per = prob.res[:, 0]
            used_one = np.einsum("pjn,j->pn", x, per)
            bad = np.any(used_one > prob.cap[None, :, 0], axis=1)
            if bad.any():
                sub = x[bad]
                cum = np.minimum(
                    np.cumsum(sub * per[None, :, None], axis=1), prob.cap[None, None, :, 0]
                )
                granted = cum.copy()
                granted[:, 1:] -= cum[:, :-1]
                x[bad] = np.minimum(sub, granted // per[None, :, None])
        else:
            used_res = np.matmul(x.transpose(0, 2, 1), prob.res)
            bad = np.any(used_res > prob.cap[None], axis=(1, 2))
            if bad.any():
                sub = x[bad]
                demand = sub[:, :, :, None] * prob.res[None, :, None, :]
                cum = np.minimum(np.cumsum(demand, axis=1), prob.cap[None, None])
                granted = cum.copy()
                granted[:, 1:] -= cum[:, :-1]
                res = prob.res[None, :, None, :]
                fit = np.where(res > 0, granted // np.maximum(res, 1), _INT_MAX)
                x[bad] = np.minimum(sub, fit.min(axis=3))
        short = x.sum(axis=2) < prob.min_total[None]
        x[short] = 0
        return x

    def _mutate(self, prob: _Problem, x: IntArray) -> IntArray:
        """The flavour's mutation, applied to every individual."""
        if self.flavour == "osdi":
            return self._mutate_osdi(prob, x)
        return self._mutate_released(prob, x)

    def _mutate_released(self, prob: _Problem, x: IntArray) -> IntArray:
        """The released scheduler's mutation: about one used and one unused cell per row.

        Each cell of a row changes with probability one over the number of
        cells in the row alike (used or unused) to a uniform value between the
        job's floor there (its ``min_replicas`` placed on the first nodes) and
        what the node can hold for it; cells then rise to that floor.
        """
        rng = self._rng
        used = x > 0
        count = used.sum(axis=2, keepdims=True)
        alike = np.where(used, count, x.shape[2] - count)
        change = rng.random(x.shape, dtype=np.float32) < 1.0 / np.maximum(alike, 1)
        if change.any():
            # In 64 bits: a node's maximum of 2**15 - 1 overflows a narrow genome.
            low = prob.min_cell[np.nonzero(change)[1:]].astype(np.int64)
            span = prob.max_cell[np.nonzero(change)[1:]].astype(np.int64) - low + 1
            x[change] = low + (rng.random(len(low)) * span).astype(np.int64)
        return np.maximum(x, prob.min_cell[None])

    def _mutate_osdi(self, prob: _Problem, x: IntArray) -> IntArray:
        """The paper's three-part mutation, applied to every individual.

        (1) Each row is reset to the current allocation with probability 0.1;
        (2) 10 % of rows have each cell zeroed with probability 0.1; (3) a cell
        on a node with room for one more of the job's replicas grows to a
        uniform value in ``[current, max]`` with probability
        ``p1 + p2 - p1*p2``, where ``p1`` is one over the number of jobs one
        more replica of which fits the node's free resources and ``p2`` one
        over those of them already on it (if this job is one of them): growth
        concentrates on few jobs per node.
        """
        rng = self._rng
        pop, num_jobs, num_cols = x.shape
        rows = rng.random((2, pop, num_jobs), dtype=np.float32)
        x = np.where((rows[0] < 0.1)[:, :, None], prob.base[None], x)
        picked = rows[1] < 0.1
        if picked.any():
            sub = x[picked]
            sub[rng.random(sub.shape, dtype=np.float32) < 0.1] = 0
            x[picked] = sub
        if prob.res.shape[1] == 1:
            free = prob.cap[None, :, 0] - np.einsum("pjn,j->pn", x, prob.res[:, 0])
            room = free[:, None, :] >= prob.res[None, :, 0, None]
        else:
            free = prob.cap[None] - np.matmul(x.transpose(0, 2, 1), prob.res)
            room = np.all(free[:, None, :, :] >= prob.res[None, :, None, :], axis=3)
        # p1 counts the jobs one more replica of which fits the node's free
        # resources, p2 those of them already on it (not a per-round count:
        # with replicas of unequal sizes, which jobs fit changes as it fills).
        fits_on = room & (x > 0)
        p1 = (1.0 / np.maximum(room.sum(axis=1, keepdims=True), 1)).astype(np.float32)
        p2 = (1.0 / np.maximum(fits_on.sum(axis=1, keepdims=True), 1)).astype(np.float32)
        prob_grow = np.where(fits_on, p1 + p2 - p1 * p2, p1)
        room &= prob.max_cell[None] > x
        grow = room & (rng.random(x.shape, dtype=np.float32) < prob_grow)
        if grow.any():
            current = x[grow].astype(np.int64)
            span = prob.max_cell[np.nonzero(grow)[1:]].astype(np.int64) - current + 1
            x[grow] = current + (rng.random(len(current)) * span).astype(np.int64)
        return x

    def _offspring(self, prob: _Problem, a: IntArray, b: IntArray) -> IntArray:
        """Children of parents ``a[i]``, ``b[i]``, by crossover and mutation (unrepaired).

        In the released flavour each child's cluster size (one past its last
        used column) is drawn between the smaller parent's and the larger of
        the other parent's and its own, and the columns beyond it are cleared,
        after mutation: mutation touches about one unused cell
        per job, anywhere, so with a dozen jobs nearly every child would use
        the last columns, and the search would stop finding solutions that
        fit the real nodes (it then scheduled nothing and asked for more).
        """
        children = self._mutate(prob, self._crossover(a, b))
        if self.flavour == "osdi":
            return children
        sizes = np.stack([_cluster_size(a), _cluster_size(b)])
        low = np.tile(sizes.min(axis=0), 2)
        high = np.maximum(np.tile(sizes.max(axis=0), 2), _cluster_size(children))
        size = low + (self._rng.random(len(low)) * (high - low + 1)).astype(np.int64)
        beyond = np.arange(a.shape[2])[None, :] >= size[:, None]  # (children, columns)
        return np.where(beyond[:, None, :], 0, children)

    def _crossover(self, a: IntArray, b: IntArray) -> IntArray:
        """One-point crossover over job rows; each pair gives two children."""
        pairs, num_jobs, _ = a.shape
        cross: BoolArray = np.less(self._rng.random(pairs), self.crossover_prob)
        # A cut at 0 copies the parents, as the original's cut over [0, J) does.
        cut = np.asarray(self._rng.integers(0, num_jobs, size=pairs), dtype=np.int64)
        top = (np.arange(num_jobs)[None, :] < cut[:, None]) | ~cross[:, None]
        child1 = np.where(top[:, :, None], a, b)
        child2 = np.where(top[:, :, None], b, a)
        return np.concatenate([child1, child2])

    def _evaluate(self, prob: _Problem, x: IntArray) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Both objectives (minimised) and the cluster utility of every individual."""
        pop = len(x)
        num_jobs = len(prob.job_names)
        if num_jobs == 0:
            return np.zeros(pop), np.zeros(pop), np.zeros(pop)
        nodes_used = np.minimum((x > 0).sum(axis=2), prob.table.shape[1] - 1)
        replicas = np.minimum(x.sum(axis=2), prob.table.shape[2] - 1)
        j_idx = np.arange(num_jobs)[None, :]
        speedup = prob.table[j_idx, nodes_used, replicas]
        # Keeping what is left of a job that lost a node restarts it too.
        changed = np.any(x != prob.base[None], axis=2) | prob.lost[None]
        value = speedup * prob.weight[None] * np.where(changed, prob.change_factor[None], 1.0)
        # The objective's speedups: osdi's re-based ones, as the original
        # changed the speedup function's base for both objectives.
        per_replica = np.where(replicas > 0, speedup / np.maximum(replicas, 1), 0.0)
        demand = replicas[:, :, None] * prob.res[None].astype(np.float64)
        # Utility is relative to the nodes a solution uses, not the cluster:
        # it measures how well the allocated nodes are used.
        col_used: BoolArray = np.any(x > 0, axis=1)
        active = col_used.astype(np.float64) @ prob.cap.astype(np.float64)
        if self.flavour == "osdi":
            f1 = -_power_mean(value + _EPSILON, self.p)
            f2_size = None
        else:
            f1 = -value.sum(axis=1)
            last = np.where(
                col_used.any(axis=1), x.shape[2] - np.argmax(col_used[:, ::-1], axis=1), 0
            )
            f2_size = last.astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(active[:, None, :] > 0, demand / active[:, None, :], 0.0)
        utility: FloatArray = (per_replica[:, :, None] * share).sum(axis=1).max(axis=1)
        if f2_size is None:
            return f1, -utility, utility
        return f1, f2_size, utility

    def _tournament(
        self, f1: FloatArray, f2: FloatArray, crowd: FloatArray, count: int
    ) -> IntArray:
        """NSGA-II binary tournament: the dominating one wins, else the less crowded.

        Contestants are drawn from concatenated random permutations of the
        population, so every individual enters about equally often.
        """
        size = len(f1)
        perms = -(-2 * count // size)
        drawn = np.concatenate([self._rng.permutation(size) for _ in range(perms)])
        a, b = drawn[:count], drawn[count : 2 * count]
        coin = self._rng.random(count) < 0.5
        return _binary_tournament(a, b, f1, f2, crowd, coin)

    @staticmethod
    def _hash(x: IntArray, weights: IntArray) -> IntArray:
        flat = x.reshape(len(x), -1)
        hashed: IntArray = flat @ weights
        return hashed

    # --------------------------------------------------------------- search

    def _search(
        self, prob: _Problem
    ) -> tuple[IntArray, FloatArray, FloatArray, FloatArray, IntArray]:
        """Run the GA; returns final population, f1, f2, utility and ranks."""
        pop = self._repair(prob, self._initial_population(prob))
        if len(pop) == 0:
            pop = self._repair(prob, prob.base[None].copy())
        weights = self._rng.integers(
            1, 2**61, size=len(prob.job_names) * len(prob.columns), dtype=np.int64
        )
        _, first = np.unique(self._hash(pop, weights), return_index=True)
        pop = pop[np.sort(first)]
        f1, f2, utility = self._evaluate(prob, pop)
        ranks = _nondominated_ranks(f1, f2)
        crowd = _crowding(f1, f2, ranks)
        for _ in range(self.generations):
            offspring_parts: list[IntArray] = []
            seen = self._hash(pop, weights)
            needed = self.population
            for _attempt in range(_MATING_TRIES):
                pairs = (needed + 1) // 2
                parents = self._tournament(f1, f2, crowd, 2 * pairs)
                children = self._offspring(prob, pop[parents[:pairs]], pop[parents[pairs:]])
                children = self._repair(prob, children)
                hashes = self._hash(children, weights)
                _, first = np.unique(hashes, return_index=True)
                fresh = np.zeros(len(children), dtype=bool)
                fresh[first] = True
                fresh &= ~np.isin(hashes, seen)
                keep = np.flatnonzero(fresh)[:needed]
                if len(keep):
                    offspring_parts.append(children[keep])
                    seen = np.concatenate([seen, hashes[keep]])
                    needed -= len(keep)
                # A brood of nothing new means the population has converged:
                # further tries would cost a brood each and find no more.
                if needed == 0 or len(keep) == 0:
                    break
            if not offspring_parts:
                continue
            offspring = np.concatenate(offspring_parts)
            o1, o2, o_util = self._evaluate(prob, offspring)
            merged = np.concatenate([pop, offspring])
            m1 = np.concatenate([f1, o1])
            m2 = np.concatenate([f2, o2])
            m_util = np.concatenate([utility, o_util])
            m_ranks = _nondominated_ranks(m1, m2)
            m_crowd = _crowding(m1, m2, m_ranks)
            survivors = np.lexsort((-m_crowd, m_ranks))[: self.population]
            pop, f1, f2, utility = (
                merged[survivors],
                m1[survivors],
                m2[survivors],
                m_util[survivors],
            )
            ranks, crowd = m_ranks[survivors], m_crowd[survivors]
        return pop, f1, f2, utility, ranks

    # ------------------------------------------------------------ interface

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        """Search for the allocation maximising the fairness-weighted goodput.

        Returns a :class:`Decision` whose ``desired_nodes`` is set by the
        released flavour (autoscaling) and None for the osdi flavour.
        """
        check_round(jobs, nodes, previous, now)
        if self.flavour == "released":
            taken = sorted(name for name in nodes if name.startswith(_VIRTUAL_PREFIX))
            if taken:
                raise ValueError(
                    f"nodes: {taken[0]!r}: names starting with {_VIRTUAL_PREFIX!r} are the "
                    "released flavour's virtual (autoscaling) nodes; rename the node"
                )
        if not jobs:
            self._pareto = None
            return Decision({}, None if self.flavour == "osdi" else 0)
        if not nodes:
            return Decision({name: () for name in jobs}, None if self.flavour == "osdi" else 1)
        prob = self._build(jobs, nodes, previous, now)
        pop, f1, f2, utility, ranks = self._search(prob)
        front = np.flatnonzero(ranks == 0)
        self._pareto = (prob.job_names, prob.columns, prob.num_real, pop[front].copy())
        desired: int | None = None
        if self.flavour == "osdi":
            chosen = int(front[np.argmin(f1[front])])
        else:
            chosen, desired = self._autoscale(prob, f1, f2, utility, front)
        row_alloc = pop[chosen].copy() if chosen >= 0 else np.zeros_like(pop[0])
        # A job placed partly on virtual nodes waits for the cluster to grow:
        # allocations only ever name real nodes.
        row_alloc[row_alloc[:, prob.num_real :].sum(axis=1) > 0] = 0
        allocations = {
            name: matrix_to_allocation(row_alloc[j], prob.columns)
            for j, name in enumerate(prob.job_names)
        }
        return Decision(in_previous_order(allocations, previous), desired)

    def _autoscale(
        self,
        prob: _Problem,
        f1: FloatArray,
        f2: FloatArray,
        utility: FloatArray,
        front: IntArray,
    ) -> tuple[int, int]:
        """Pick the solution within the real nodes and the desired cluster size.

        The best solution that fits on the real nodes is kept if its cluster
        utility lies in the target band; otherwise the cluster should grow or
        shrink to the Pareto solution of utility at least the band's low end
        that is closest to the band's middle (ties favour more nodes, since an
        idle node is cheaper than a starved job), or, if none reaches the low
        end, the Pareto solution of highest utility. When it should shrink,
        the result is the best solution on the nodes that remain (none if no
        solution fits them), so acting on the desired size evicts nobody.
        """
        low, high = self.utility_band
        middle = (low + high) / 2
        within = f2 <= prob.num_real
        if np.any(within):
            candidates = np.flatnonzero(within)
        else:
            candidates = np.flatnonzero(f2 == f2.min())
        chosen = int(candidates[np.argmin(f1[candidates])])
        if low <= utility[chosen] <= high:
            return chosen, prob.num_real
        pool = front[utility[front] >= low]
        if len(pool) == 0:
            # No solution reaches the band (e.g. jobs that cannot fill one
            # node): the released scheduler then keeps the size, so such a
            # cluster never shrinks; the best-used solution sizes it instead.
            pool = front
        distance = np.abs(utility[pool] - middle)
        # Near-equal distances (float noise) are ties, which favour more nodes.
        close = pool[np.isclose(distance, distance.min())]
        best = close[np.argmax(f2[close])]
        desired = max(int(f2[best]), 1)
        if desired < prob.num_real:
            fitting = np.flatnonzero(f2 <= desired)
            if len(fitting) == 0:
                return -1, desired
            chosen = int(fitting[np.argmin(f1[fitting])])
        return chosen, desired


def _make_pollux(**options: Any) -> Policy:
    return PolluxPolicy(**options)


register_policy("pollux", _make_pollux)
