"""Tests of the default MILP-based policy."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
import scipy.optimize

from adaptdl.sched import AdaptDLPolicy, JobInfo, NodeInfo, get_policy, linear_speedup


def concave(alpha: float, node_penalty: float = 0.1) -> Any:
    def fn(num_nodes: Any, num_replicas: Any) -> Any:
        r = np.asarray(num_replicas, dtype=float)
        n = np.asarray(num_nodes, dtype=float)
        out = np.where(r > 0, r / (1 + alpha * (r - 1)), 0.0) * np.where(
            n > 1, 1 - node_penalty, 1.0
        )
        return out if out.ndim else float(out)

    return fn


def job(fn: Any = linear_speedup, **kwargs: Any) -> JobInfo:
    kwargs.setdefault("submission_time", 0.0)
    return JobInfo({"gpu": 1}, fn, **kwargs)


def nodes_of(*gpus: int) -> dict[str, NodeInfo]:
    return {f"n{i}": NodeInfo({"gpu": g}) for i, g in enumerate(gpus)}


def shape(alloc: tuple[str, ...]) -> tuple[int, int]:
    return len(set(alloc)), len(alloc)


def objective(
    decision_shapes: dict[str, tuple[int, int]], jobs: dict[str, JobInfo], p: float
) -> float:
    """Power-mean objective as the policy defines it, no restarts."""

    def transform(v: float) -> float:
        return float(np.log(v)) if p == 0 else v**p / p

    total = 0.0
    num_nodes = 2
    for name, info in jobs.items():
        n, r = decision_shapes.get(name, (0, 0))
        fair = info.speedup_fn(1, int(np.ceil(8 / len(jobs))))
        value = (info.speedup_fn(n, r) if r else 0.0) / fair * (1 / 8) * num_nodes + 1e-3
        total += transform(value) - transform(1e-3)
    return total


@pytest.mark.parametrize("p", [-1.0, 0.0, 0.5])
def test_matches_brute_force_on_small_cluster(p: float) -> None:
    jobs = {
        "a": job(concave(0.05)),
        "b": job(concave(0.3)),
        "c": job(concave(0.6), max_replicas=2),
    }
    nodes = nodes_of(4, 4)
    decision = AdaptDLPolicy(p=p).optimize(jobs, nodes, {}, now=1e12)
    got = objective({k: shape(v) for k, v in decision.allocations.items() if v}, jobs, p)
    options = [(0, 0), (1, 1), (1, 2), (1, 4), (2, 8)]
    best = -np.inf
    for combo in itertools.product(options, repeat=3):
        if sum(r for _, r in combo) > 8:
            continue
        if any(n == 2 for n, _ in combo) and sum(r for _, r in combo) > 8:
            continue
        if combo[2][1] > 2:
            continue
        whole = sum(n for n, _ in combo if n > 1)
        singles = sorted((r for n, r in combo if n == 1), reverse=True)
        if whole * 4 + sum(singles) > 8 or (whole == 2 and singles):
            continue
        best = max(best, objective(dict(zip("abc", combo)), jobs, p))
    assert got == pytest.approx(best, rel=1e-9)


def test_deterministic_across_instances() -> None:
    rng = np.random.default_rng(0)
    jobs = {
        f"j{i}": job(
            concave(float(rng.uniform(0, 0.5))), attained_service=float(i), max_replicas=16
        )
        for i in range(20)
    }
    nodes = nodes_of(*([4] * 8))
    first = AdaptDLPolicy().optimize(jobs, nodes, {}, now=5000.0)
    second = get_policy("adaptdl").optimize(jobs, nodes, {}, now=5000.0)
    assert dict(first.allocations) == dict(second.allocations)
    assert sum(len(a) for a in first.allocations.values()) == 32


def test_stable_when_nothing_changes() -> None:
    rng = np.random.default_rng(1)
    jobs = {f"j{i}": job(concave(float(rng.uniform(0, 0.5))), max_replicas=16) for i in range(10)}
    nodes = nodes_of(*([4] * 6))
    policy = AdaptDLPolicy()
    first = policy.optimize(jobs, nodes, {}, now=1e6)
    second = policy.optimize(jobs, nodes, first.allocations, now=1e6 + 60)
    assert dict(second.allocations) == dict(first.allocations)
    assert sum(len(a) for a in first.allocations.values()) == 24


def test_multi_node_jobs_take_whole_nodes() -> None:
    jobs = {"big": job(concave(0.0, 0.05), max_replicas=8), "small": job(concave(0.9))}
    nodes = nodes_of(4, 4, 4)
    decision = AdaptDLPolicy(p=1.0).optimize(jobs, nodes, {}, now=1e6)
    big = Counter(decision.allocations["big"])
    assert len(big) == 2 and set(big.values()) == {4}
    assert not set(decision.allocations["small"]) & set(big)


def test_replica_bounds() -> None:
    jobs = {
        "capped": job(max_replicas=2),
        "floor": job(concave(0.2), min_replicas=3, max_replicas=4),
    }
    decision = AdaptDLPolicy().optimize(jobs, nodes_of(4, 4), {}, now=1e6)
    assert len(decision.allocations["capped"]) == 2
    assert 3 <= len(decision.allocations["floor"]) <= 4


def test_unsatisfiable_min_replicas_gets_nothing() -> None:
    jobs = {"huge": job(min_replicas=9, max_replicas=12), "other": job(max_replicas=1)}
    decision = AdaptDLPolicy().optimize(jobs, nodes_of(4, 4), {}, now=1e6)
    assert decision.allocations["huge"] == ()
    assert len(decision.allocations["other"]) == 1


def test_restart_factor_keeps_young_job() -> None:
    # Age 60 s, 2 restarts: factor max(60 - 60, 0) / 90 = 0, so no move pays.
    young = job(submission_time=940.0, num_restarts=2, max_replicas=8)
    decision = AdaptDLPolicy().optimize({"y": young}, nodes_of(4, 4), {"y": ("n1",)}, 1000.0)
    assert decision.allocations["y"] == ("n1",)
    # An old job with the same history is moved to its best configuration.
    old = job(submission_time=0.0, num_restarts=2, max_replicas=8)
    decision = AdaptDLPolicy().optimize({"o": old}, nodes_of(4, 4), {"o": ("n1",)}, 1e6)
    assert len(decision.allocations["o"]) == 8


def test_pinned_job_keeps_odd_allocation() -> None:
    jobs = {
        "pinned": job(preemptible=False, max_replicas=8),
        "other": job(max_replicas=8),
    }
    previous = {"pinned": ("n0", "n0", "n0", "n1")}
    decision = AdaptDLPolicy().optimize(jobs, nodes_of(4, 4), previous, 1e6)
    assert decision.allocations["pinned"] == previous["pinned"]
    assert Counter(decision.allocations["other"]) <= Counter({"n1": 3})


def test_fragmented_cluster_falls_back_to_what_fits() -> None:
    pinned = {f"p{i}": job(preemptible=False, max_replicas=1) for i in range(4)}
    previous = {f"p{i}": (f"n{i}",) for i in range(4)}
    jobs = {**pinned, "wide": job(concave(0.0, 0.0), max_replicas=8)}
    decision = AdaptDLPolicy(p=1.0).optimize(jobs, nodes_of(4, 4, 4, 4), previous, 1e6)
    for name in pinned:
        assert decision.allocations[name] == previous[name]
    wide = decision.allocations["wide"]
    assert wide and len(set(wide)) == 1 and len(wide) <= 3


def test_heterogeneous_nodes_respect_capacity() -> None:
    rng = np.random.default_rng(4)
    jobs = {f"j{i}": job(concave(float(rng.uniform(0, 0.3))), max_replicas=16) for i in range(12)}
    nodes = nodes_of(8, 4, 2, 2, 1)
    decision = AdaptDLPolicy().optimize(jobs, nodes, {}, now=1e6)
    used: Counter[str] = Counter()
    for alloc in decision.allocations.values():
        used.update(alloc)
    assert all(used[n] <= nodes[n].resources["gpu"] for n in used)
    assert sum(used.values()) >= 12


def test_multiple_resource_types() -> None:
    jobs = {
        "cpu_heavy": JobInfo({"gpu": 1, "cpu": 8}, linear_speedup, 0.0, max_replicas=4),
        "gpu_only": JobInfo({"gpu": 1}, linear_speedup, 0.0, max_replicas=4),
    }
    nodes = {"n0": NodeInfo({"gpu": 4, "cpu": 16})}
    decision = AdaptDLPolicy().optimize(jobs, nodes, {}, now=1e6)
    # 16 CPUs hold two cpu_heavy replicas; the GPUs left go to gpu_only.
    assert decision.allocations["cpu_heavy"] == ("n0", "n0")
    assert decision.allocations["gpu_only"] == ("n0", "n0")


@pytest.mark.parametrize(
    "options",
    [
        {"p": 2.0},
        {"normalize": "median"},
        {"restart_delay": -1.0},
        {"max_nodes_per_job": 0},
        {"mip_rel_gap": 1.0},
        {"node_limit": 0},
        {"las_exponent": float("inf")},
        {"las_scale": 0.0},
        {"exact_max_jobs": -1},
        {"work_exponent": -1.0},
        {"work_scale": 0.0},
        {"work_floor": 0.0},
        {"work_floor": 1.5},
        {"floor_order": 0.0},
        {"floor_order": 1.2},
        {"queue_discount": 0.0},
        {"queue_discount": 1.5},
        {"queue_discount": float("nan")},
        {"p": -4.5},  # float64 cannot tell shapes apart: GPUs were left idle
        # Accepted, then a TypeError or OverflowError in some rounds only.
        {"node_limit": 2**31},
        {"max_nodes_per_job": 2**70},
    ],
)
def test_bad_options_name_the_argument(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        AdaptDLPolicy(**options)


def test_seed_is_ignored_but_checked() -> None:
    # Accepted silently before, while pollux refused the same values.
    assert AdaptDLPolicy(seed=3) is not None and AdaptDLPolicy(seed=None) is not None
    with pytest.raises(TypeError, match="seed='abc': expected an int"):
        AdaptDLPolicy(seed="abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed=1.5"):
        AdaptDLPolicy(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed=-5"):
        AdaptDLPolicy(seed=-5)


def test_bad_speedup_names_the_job() -> None:
    jobs = {"broken": job(lambda n, r: np.full(np.shape(r), np.nan))}
    with pytest.raises(ValueError, match="broken"):
        AdaptDLPolicy().optimize(jobs, nodes_of(4), {}, now=0.0)


def test_job_without_resources_is_rejected() -> None:
    jobs = {"empty": JobInfo({}, linear_speedup, 0.0)}
    with pytest.raises(ValueError, match="empty"):
        AdaptDLPolicy().optimize(jobs, nodes_of(4), {}, now=0.0)


def test_fair_and_one_normalisation_both_allocate() -> None:
    jobs = {f"j{i}": job(concave(0.1 * i), max_replicas=8) for i in range(4)}
    for normalize in ("fair", "one"):
        decision = AdaptDLPolicy(normalize=normalize).optimize(jobs, nodes_of(4, 4), {}, 1e6)
        assert sum(len(a) for a in decision.allocations.values()) == 8


def test_las_bias_gives_contested_gpu_to_least_served_job() -> None:
    jobs = {
        "served": job(attained_service=36000.0, max_replicas=1),
        "fresh": job(attained_service=60.0, max_replicas=1),
    }
    for served_first in (True, False):
        ordered = dict(sorted(jobs.items(), reverse=not served_first))
        decision = AdaptDLPolicy(las_exponent=1.0).optimize(ordered, nodes_of(1), {}, 1e6)
        assert decision.allocations["fresh"] == ("n0",)
        assert decision.allocations["served"] == ()


def sized(iterations: float | None, **kwargs: Any) -> JobInfo:
    """A linear-speedup job that reports ``iterations`` one-second steps left."""
    return job(remaining_iterations=iterations, step_time_fn=lambda r: 1.0, **kwargs)


def test_shorter_remaining_work_gets_more_gpus_and_long_job_keeps_running() -> None:
    # 12 GPUs: unweighted, either job may take the 8-GPU shape; weighted,
    # the short job does and the long one still gets a node.
    jobs = {"long": sized(1e7, max_replicas=8), "short": sized(600.0, max_replicas=8)}
    for order in (jobs, dict(reversed(jobs.items()))):
        decision = AdaptDLPolicy().optimize(order, nodes_of(4, 4, 4), {}, now=1e6)
        assert len(decision.allocations["short"]) == 8
        assert len(decision.allocations["long"]) == 4


@pytest.mark.parametrize(
    "options, long_work",
    [({}, None), ({"work_exponent": 0.0}, 1e7), ({"work_floor": 1.0}, 1e7)],
)
def test_remaining_work_bias_off_or_unknown_shares_equally(
    options: dict[str, Any], long_work: float | None
) -> None:
    jobs = {"long": sized(long_work, max_replicas=8), "short": sized(600.0, max_replicas=8)}
    if long_work is None:
        jobs["short"] = sized(None, max_replicas=8)
    decision = AdaptDLPolicy(**options).optimize(jobs, nodes_of(4, 4), {}, now=1e6)
    assert len(decision.allocations["short"]) == len(decision.allocations["long"]) == 4


def test_remaining_work_weight_has_a_floor() -> None:
    # Longer work lowers the weight only down to work_floor: with floor_order
    # 1, two long jobs of very different size compete as equals.
    policy = AdaptDLPolicy(work_floor=0.3, floor_order=1.0, queue_discount=1.0)
    weights = policy._priorities({"huge": sized(1e9), "long": sized(1e7), "short": sized(3600.0)})
    assert weights["huge"] == weights["long"] == 0.3
    assert weights["short"] == pytest.approx(1 / 1.1)


def test_long_jobs_at_the_floor_are_ordered_by_remaining_work() -> None:
    policy = AdaptDLPolicy(work_floor=0.3, floor_order=0.5, queue_discount=1.0)
    jobs = {
        "third": sized(3e7),
        "first": sized(1e7),
        "second": sized(2e7),
        "short": sized(3600.0),
        "unknown": sized(None),
    }
    weights = policy._priorities(jobs)
    # Parts 1 : 0.5 : 0.25 of the long jobs' unchanged total weight 3 x 0.3.
    assert [weights[n] for n in ("first", "second", "third")] == pytest.approx(
        [0.9 / 1.75, 0.45 / 1.75, 0.225 / 1.75]
    )
    assert weights["short"] == pytest.approx(1 / 1.1) and weights["unknown"] == 1.0
    # A lone long job keeps the floor.
    assert policy._priorities({"only": sized(1e7)}) == {"only": 0.3}


def test_many_long_jobs_never_outrank_a_short_one() -> None:
    policy = AdaptDLPolicy(work_floor=0.3, floor_order=0.7, queue_discount=1.0)
    jobs = {f"long{i:02d}": sized(1e6 * (i + 1)) for i in range(12)}
    jobs["short"] = sized(3000.0)
    weights = policy._priorities(jobs)
    long_weights = [weights[f"long{i:02d}"] for i in range(12)]
    # Ordered, capped at twice the floor, and together still 12 x the floor.
    assert long_weights == sorted(long_weights, reverse=True)
    assert max(long_weights) == pytest.approx(0.6)
    assert sum(long_weights) == pytest.approx(12 * 0.3)
    assert weights["short"] > max(long_weights)


def test_shorter_long_job_gets_more_gpus() -> None:
    jobs = {"later": sized(3e7, max_replicas=8), "sooner": sized(1e7, max_replicas=8)}
    for order in (jobs, dict(reversed(jobs.items()))):
        decision = AdaptDLPolicy(floor_order=0.3).optimize(order, nodes_of(4, 4, 4), {}, 1e6)
        assert len(decision.allocations["sooner"]) == 8
        assert len(decision.allocations["later"]) == 4
        equal = AdaptDLPolicy(floor_order=1.0).optimize(order, nodes_of(4, 4), {}, 1e6)
        assert len(equal.allocations["sooner"]) == len(equal.allocations["later"]) == 4


def test_queue_discount_ranks_every_job_by_remaining_work() -> None:
    jobs = {
        "third": sized(3e7),
        "first": sized(600.0),
        "second": sized(900.0),
        "unknown": sized(None),
    }
    plain = AdaptDLPolicy(queue_discount=1.0)._priorities(jobs)
    for order in (jobs, dict(reversed(jobs.items()))):
        weights = AdaptDLPolicy(queue_discount=0.8)._priorities(order)
        assert weights["first"] == pytest.approx(plain["first"])
        assert weights["second"] == pytest.approx(plain["second"] * 0.8)
        assert weights["third"] == pytest.approx(plain["third"] * 0.64)
        # Jobs that do not report their work are neither ranked nor discounted.
        assert weights["unknown"] == plain["unknown"] == 1.0


def test_queue_discount_stops_at_one_half() -> None:
    # 0.9 ** 7 < 0.5: from the 8th job on the factor stays at 0.5, so a long
    # job behind hundreds of short ones is not starved.
    jobs = {f"j{i:03d}": sized(1000.0 * (i + 1)) for i in range(300)}
    plain = AdaptDLPolicy(queue_discount=1.0)._priorities(jobs)
    weights = AdaptDLPolicy(queue_discount=0.9)._priorities(jobs)
    factors = [weights[name] / plain[name] for name in sorted(jobs)]
    assert factors[:8] == pytest.approx([0.9**k for k in range(7)] + [0.5])
    assert factors[-1] == pytest.approx(0.5)


def test_queue_discount_alone_ranks_equally_weighted_jobs() -> None:
    # Size bias off, so only the discount tells the jobs apart: of three jobs
    # sharing 8 GPUs as 4 + 2 + 2, the one with the least work left (named to
    # sort last) takes the 4, whatever the order of the input.
    jobs = {
        "a-most": sized(300.0, max_replicas=4),
        "b-middle": sized(200.0, max_replicas=4),
        "z-least": sized(100.0, max_replicas=4),
    }
    for order in (jobs, dict(reversed(jobs.items()))):
        policy = AdaptDLPolicy(work_exponent=0.0, queue_discount=0.5)
        decision = policy.optimize(order, nodes_of(4, 4), {}, now=1e6)
        sizes = {name: len(alloc) for name, alloc in decision.allocations.items()}
        assert sizes == {"z-least": 4, "b-middle": 2, "a-most": 2}


def test_bad_remaining_work_names_the_job() -> None:
    with pytest.raises(ValueError, match="remaining_iterations=-5.0"):
        sized(-5.0)
    # A step time that goes bad at run time is named with its job.
    jobs = {"broken": job(remaining_iterations=10.0, step_time_fn=lambda r: float("nan"))}
    with pytest.raises(ValueError, match="broken"):
        AdaptDLPolicy().optimize(jobs, nodes_of(4), {}, now=0.0)


def test_partial_integer_solve_matches_exact_on_small_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The large-scale path (re-solving only fractional jobs) stays feasible and close."""
    # An instance whose LP relaxation is fractional (two variables), so both
    # the exact MILP and the partial re-solve really run.
    jobs = {
        "j0": job(concave(0.30), max_replicas=2),
        "j1": job(concave(0.36), max_replicas=5),
        "j2": job(concave(0.09), max_replicas=2),
    }
    nodes = nodes_of(4, 3)
    real_milp = scipy.optimize.milp
    integer_solves: list[tuple[bool, float]] = []  # (some columns fixed, objective)

    def spy(c: Any, *, integrality: Any = None, bounds: Any = None, **kw: Any) -> Any:
        result = real_milp(c, integrality=integrality, bounds=bounds, **kw)
        if integrality is not None and np.all(integrality == 1) and result.x is not None:
            fixed = bool(np.any(np.asarray(bounds.lb) == np.asarray(bounds.ub)))
            integer_solves.append((fixed, -float(result.fun)))
        return result

    monkeypatch.setattr(scipy.optimize, "milp", spy)
    exact = AdaptDLPolicy(exact_max_jobs=100).optimize(jobs, nodes, {}, now=1e6)
    assert [fixed for fixed, _ in integer_solves] == [False]
    exact_value = integer_solves[0][1]
    integer_solves.clear()
    partial = AdaptDLPolicy(exact_max_jobs=0).optimize(jobs, nodes, {}, now=1e6)
    assert [fixed for fixed, _ in integer_solves] == [True]
    assert integer_solves[0][1] >= exact_value * (1 - 1e-6) - 1e-9
    for decision in (exact, partial):
        used: Counter[str] = Counter()
        for alloc in decision.allocations.values():
            used.update(alloc)
        assert used["n0"] <= 4 and used["n1"] <= 3
        assert all(decision.allocations[name] for name in jobs)


def test_current_shape_beyond_max_replicas_is_not_kept() -> None:
    # The job holds 4 GPUs but may now have at most 2 (e.g. its exploration cap).
    jobs = {"a": job(max_replicas=2, submission_time=0.0)}
    decision = AdaptDLPolicy().optimize(jobs, nodes_of(4, 4), {"a": ("n0",) * 4}, now=1e6)
    assert 1 <= len(decision.allocations["a"]) <= 2


def test_uneven_multi_node_shape_respects_node_capacity() -> None:
    # 5 replicas on 2 nodes of sizes 2 and 4: the third replica cannot go on n0.
    policy = AdaptDLPolicy()
    jobs = {"a": job(preemptible=False, max_replicas=5)}
    previous = {"a": ("n0", "n0", "n1", "n1", "n1")}
    nodes = nodes_of(2, 4)
    decision = policy.optimize(jobs, nodes, previous, now=1e6)
    assert decision.allocations["a"] == previous["a"]  # non-preemptible: kept
    used = Counter(decision.allocations["a"])
    assert used["n0"] <= 2 and used["n1"] <= 4


@pytest.mark.parametrize(
    ("gpus", "low", "high", "expected"),
    [
        ((4, 4), 6, 6, (2, 6)),  # no k x 4 shape has 6 replicas
        ((2, 2, 2), 3, 3, (2, 3)),
        ((4, 4, 4), 10, 10, (3, 10)),
        ((8, 4, 4), 10, 16, (3, 16)),  # the whole cluster: 8 + 4 + 4
    ],
)
def test_replica_bounds_between_node_multiples_still_run(
    gpus: tuple[int, ...], low: int, high: int, expected: tuple[int, int]
) -> None:
    # Before, these jobs got nothing round after round on an idle cluster.
    jobs = {"a": job(min_replicas=low, max_replicas=high, preemptible=False)}
    alloc = AdaptDLPolicy().optimize(jobs, nodes_of(*gpus), {}, 600).allocations["a"]
    assert shape(alloc) == expected


def test_unequal_nodes_still_offer_multi_node_shapes() -> None:
    # One larger node used to switch off every multi-node shape (8 of 20 GPUs).
    jobs = {"a": job(max_replicas=64)}
    alloc = AdaptDLPolicy().optimize(jobs, nodes_of(8, 4, 4, 4), {}, 600).allocations["a"]
    assert shape(alloc) == (4, 20)  # the whole cluster, each node filled
    assert Counter(alloc) == {"n0": 8, "n1": 4, "n2": 4, "n3": 4}
    # 16 replicas fit on three nodes (8 + 4 + 4), fewer than four node-fulls of 4.
    jobs = {"a": job(max_replicas=16)}
    alloc = AdaptDLPolicy().optimize(jobs, nodes_of(8, 4, 4, 4), {}, 600).allocations["a"]
    assert sorted(Counter(alloc).values()) == [4, 4, 8]


def test_cpu_only_jobs_leave_gpu_nodes_to_gpu_jobs() -> None:
    nodes = {"n0": NodeInfo({"gpu": 4, "cpu": 8}), "n1": NodeInfo({"cpu": 8})}
    jobs = {
        "a": JobInfo({"gpu": 1, "cpu": 4}, linear_speedup, submission_time=0.0, max_replicas=2),
        "b": JobInfo({"cpu": 1}, linear_speedup, submission_time=0.0, max_replicas=8),
    }
    alloc = AdaptDLPolicy().optimize(jobs, nodes, {}, 1000).allocations
    assert alloc["b"] == ("n1",) * 8
    assert alloc["a"] == ("n0", "n0")


def test_multi_node_shapes_take_the_smallest_nodes_that_fit() -> None:
    # 'a' on the two 4-GPU nodes leaves the 6-GPU node to 'b', whatever the names.
    for big in ("n0", "n9"):
        nodes = {big: NodeInfo({"gpu": 6}), "n1": NodeInfo({"gpu": 4}), "n2": NodeInfo({"gpu": 4})}
        jobs = {
            "a": job(min_replicas=8, max_replicas=8),
            "b": job(min_replicas=6, max_replicas=6),
        }
        alloc = AdaptDLPolicy().optimize(jobs, nodes, {}, 600).allocations
        assert Counter(alloc["a"]) == {"n1": 4, "n2": 4}
        assert alloc["b"] == (big,) * 6


def test_uneven_split_puts_the_extra_replicas_on_nodes_with_room() -> None:
    nodes = {"a": NodeInfo({"gpu": 3}), "b": NodeInfo({"gpu": 3})}
    nodes.update({name: NodeInfo({"gpu": 4}) for name in "cde"})
    jobs = {"j": job(min_replicas=11, max_replicas=11)}
    alloc = AdaptDLPolicy().optimize(jobs, nodes, {}, 600).allocations["j"]
    counts = Counter(alloc)
    assert sum(counts.values()) == 11 and len(counts) == 3
    assert all(counts[n] <= nodes[n].resources["gpu"] for n in counts)


def test_jobs_the_solver_planned_but_cannot_place_leave_nothing_idle() -> None:
    # Capacities summed over nodes admit c (11 cpu replicas) with g; per node
    # they do not. h, left out by the solver, still gets the free GPUs.
    nodes = {"n0": NodeInfo({"cpu": 8}), "n1": NodeInfo({"gpu": 8, "cpu": 32})}
    jobs = {
        "c": JobInfo({"cpu": 1}, linear_speedup, 0.0, min_replicas=11, max_replicas=16),
        "g": JobInfo({"gpu": 1, "cpu": 3}, linear_speedup, 0.0, min_replicas=6, max_replicas=8),
        "h": JobInfo({"gpu": 1}, linear_speedup, 0.0, min_replicas=5, max_replicas=5),
    }
    for now in (1000.0, 1060.0):
        alloc = AdaptDLPolicy().optimize(jobs, nodes, {}, now).allocations
        used_gpus = len(alloc["g"]) + len(alloc["h"])
        assert used_gpus >= 5, alloc


def test_a_running_job_whose_new_shape_does_not_fit_keeps_its_allocation() -> None:
    from adaptdl.sched._adaptdl import _Candidates

    # j runs on n0 x3 + n1 x2; the solver picked (1 node, 5 replicas), which
    # no 3-GPU node holds. It keeps what it has instead of shrinking to 3.
    cands = [
        _Candidates(
            nodes=np.array([1, 2, 1]),
            replicas=np.array([3, 5, 5]),
            utility=np.array([1.0, 3.0, 4.0]),
            keep=1,
        )
    ]
    base = np.array([[3, 2]])
    cap = np.array([[3], [3]])
    res = np.array([[1]])
    out = AdaptDLPolicy()._place(["j"], cands, [2], base, [False], cap, res)
    assert out.tolist() == [[3, 2]]


def test_the_lowest_fairness_exponent_still_fills_the_cluster() -> None:
    # At p = -8, _EPSILON ** p swamped the shapes' differences: 6 of 8 GPUs used.
    jobs = {name: job() for name in ("a", "b", "c")}
    decision = AdaptDLPolicy(p=-4.0).optimize(jobs, nodes_of(4, 4), {}, 0.0)
    assert sum(len(alloc) for alloc in decision.allocations.values()) == 8


def test_a_large_negative_las_exponent_does_not_overflow() -> None:
    # It raised a bare OverflowError that named no option.
    jobs = {"a": job(attained_service=1e6), "b": job()}
    decision = AdaptDLPolicy(las_exponent=-200.0).optimize(jobs, nodes_of(4), {}, 0.0)
    assert sum(len(alloc) for alloc in decision.allocations.values()) == 4


def test_capped_split_with_shares_that_underflowed_is_even() -> None:
    from adaptdl.sched._adaptdl import _capped_split

    parts = _capped_split(np.array([1.0, 0.0, 0.0]), total=3.0, cap=1.0)
    assert not np.isnan(parts).any() and parts.tolist() == [1.0, 1.0, 1.0]
    parts = _capped_split(np.zeros(4), total=2.0, cap=1.0)
    assert parts.tolist() == [0.5, 0.5, 0.5, 0.5]


def test_a_current_allocation_over_the_node_limit_is_not_kept() -> None:
    # The current shape was kept as a candidate whatever its node count.
    nodes = {f"n{i:02d}": NodeInfo({"gpu": 1}) for i in range(40)}
    previous = {"a": ("n00", "n01", "n02", "n03")}
    policy = AdaptDLPolicy(max_nodes_per_job=2)
    decision = policy.optimize({"a": job(submission_time=-3600.0)}, nodes, previous, 0.0)
    assert len(set(decision.allocations["a"])) <= 2


@pytest.mark.parametrize(
    ("sizes", "low", "high"),
    [
        ((8, 4), 12, 12),
        ((8, 4), 10, 10),
        ((8, 2, 2, 2), 9, 9),
        ((8, 4, 4), 16, 16),
        ((8, 4), 9, 12),
    ],
)
def test_a_job_that_fits_unequal_nodes_only_when_filled_runs(
    sizes: tuple[int, ...], low: int, high: int
) -> None:
    # Shapes and placement assumed k times the smallest node: such a job
    # waited for ever on an idle cluster that holds it.
    decision = AdaptDLPolicy().optimize(
        {"a": job(min_replicas=low, max_replicas=high)}, nodes_of(*sizes), {}, 1000.0
    )
    allocation = decision.allocations["a"]
    assert low <= len(allocation) <= high and len(allocation) == min(high, sum(sizes))
    counts = Counter(allocation)
    assert all(counts[f"n{i}"] <= size for i, size in enumerate(sizes))


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        # 3 + 3 left 1 + 1 GPUs, and b (2 replicas) waited with 2 GPUs idle.
        ({"max_replicas": 6}, {"min_replicas": 2, "max_replicas": 2}, {"a": (4, 2), "b": (0, 2)}),
        (
            {"min_replicas": 5, "max_replicas": 5},
            {"min_replicas": 3, "max_replicas": 3},
            {"a": (4, 1), "b": (0, 3)},
        ),
    ],
)
def test_a_multi_node_job_fills_nodes_and_leaves_its_remainder_on_one(
    a: dict[str, int], b: dict[str, int], expected: dict[str, tuple[int, int]]
) -> None:
    policy, previous = AdaptDLPolicy(), {}
    jobs = {"a": job(**a), "b": job(**b)}
    for now in (1000.0, 1060.0):
        previous = dict(policy.optimize(jobs, nodes_of(4, 4), previous, now).allocations)
        per_node = {
            name: (alloc.count("n0"), alloc.count("n1")) for name, alloc in previous.items()
        }
        assert per_node == expected, per_node


def test_a_fair_share_beyond_the_replica_limit_is_capped() -> None:
    # 3 nodes of 2**31-1 cpu: the fair share was ~6e9 replicas, and
    # evaluating the speedup there raised ValueError.
    from adaptdl.goodput import GoodputFunction, GradParams, PerfParams
    from adaptdl.sched import SpeedupFunction

    perf = PerfParams(0.1, 0.01, 0.1, 0.01, 1.0, 0.001, 1.1)
    speedup = SpeedupFunction(GoodputFunction(perf, GradParams(0.01, 1.0), 32), max_batch_size=1024)
    nodes = {f"n{i}": NodeInfo({"cpu": 2**31 - 1}) for i in range(3)}
    cpu_job = JobInfo({"cpu": 1}, speedup, 0.0, max_replicas=4)
    decision = AdaptDLPolicy().optimize({"a": cpu_job}, nodes, {}, 1000.0)
    assert 1 <= len(decision.allocations["a"]) <= 4


def test_a_multi_node_job_leaves_the_nodes_another_job_needs() -> None:
    # Nodes 2, 4, 8, 8: 'a' (10 replicas) took the two 8s (or 5 + 5), and 'b'
    # (8 replicas) waited for ever though 2 + 8 leaves an 8 for it.
    policy, previous = AdaptDLPolicy(), {}
    jobs = {
        "a": job(min_replicas=10, max_replicas=10),
        "b": job(min_replicas=8, max_replicas=8),
    }
    for now in (1000.0, 1060.0):
        previous = dict(policy.optimize(jobs, nodes_of(2, 4, 8, 8), previous, now).allocations)
        assert len(previous["a"]) == 10 and len(previous["b"]) == 8, previous


def test_the_node_set_of_a_multi_node_job_has_the_least_capacity_that_holds_it() -> None:
    # Runs of consecutive sizes missed "the smallest and the two largest":
    # 'b' (3 replicas) waited for ever beside 'a' on nodes 1, 2, 3, 10, 10.
    from adaptdl.sched._adaptdl import _smallest_holding

    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 7))
        full = rng.integers(1, 12, size=n)
        num = int(rng.integers(1, n + 1))
        reps = int(rng.integers(num, full.sum() + 3))
        got = _smallest_holding(np.lexsort((np.arange(n), full)), full, num, reps)
        sums = [
            int(full[list(nodes)].sum())
            for nodes in itertools.combinations(range(n), num)
            if full[list(nodes)].sum() >= reps
        ]
        if not sums:
            assert got is None
            continue
        assert got is not None and len(set(got.tolist())) == num
        assert int(full[got].sum()) == min(sums), (full, num, reps, got)
    jobs = {"a": job(min_replicas=21, max_replicas=21), "b": job(min_replicas=3, max_replicas=3)}
    decision = AdaptDLPolicy().optimize(jobs, nodes_of(1, 2, 3, 10, 10), {}, 1000.0)
    assert len(decision.allocations["a"]) == 21 and len(decision.allocations["b"]) == 3
