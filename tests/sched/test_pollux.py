"""Tests of the Pollux genetic-search policy."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest

from adaptdl.goodput import GoodputFunction, GradParams, PerfParams
from adaptdl.sched import JobInfo, NodeInfo, PolluxPolicy, SpeedupFunction, get_policy
from adaptdl.sched._pollux import (
    _binary_tournament,
    _crowding,
    _nondominated_ranks,
    _power_mean,
)
from adaptdl.sched._types import check_decision


def goodput_speedup(rng: np.random.Generator) -> SpeedupFunction:
    perf = PerfParams(
        alpha_c=0.02 * rng.uniform(0.5, 2),
        beta_c=0.001 * rng.uniform(0.5, 2),
        alpha_n=0.1 * rng.uniform(0.5, 2),
        beta_n=0.01 * rng.uniform(0.5, 2),
        alpha_r=0.03 * rng.uniform(0.5, 2),
        beta_r=0.003 * rng.uniform(0.5, 2),
        gamma=float(rng.uniform(1.0, 2.0)),
    )
    grad = GradParams(sqr=1.0, var=float(rng.uniform(10, 1000)))
    fn = GoodputFunction(perf, grad, 128)
    return SpeedupFunction(fn, max_batch_size=4096, atomic_bsz_range=(32, 256), accumulation=True)


def used_gpus(allocations: Any) -> Counter[str]:
    used: Counter[str] = Counter()
    for alloc in allocations.values():
        used.update(alloc)
    return used


@pytest.mark.parametrize("num_nodes", [1, 2, 4, 8, 16])
def test_optimize_three_rounds(num_nodes: int) -> None:
    """16 jobs on 1..16 nodes: every round fits and uses the cluster."""
    rng = np.random.default_rng(num_nodes)
    jobs = {
        f"job-{i}": JobInfo(
            {"gpu": 1},
            goodput_speedup(rng),
            submission_time=float(i),
            attained_service=float(rng.uniform(0, 1000)),
            min_replicas=int(i % 4 == 0),
            max_replicas=int(rng.choice([1, 2, 4, 8, 64])),
        )
        for i in range(16)
    }
    nodes = {f"node-{i}": NodeInfo({"gpu": 4}) for i in range(num_nodes)}
    policy = PolluxPolicy(seed=1, population=50, generations=20)
    previous: dict[str, tuple[str, ...]] = {}
    for r in range(3):
        decision = policy.optimize(jobs, nodes, previous, now=600.0 + 60 * r)
        used = used_gpus(decision.allocations)
        assert all(count <= 4 for count in used.values())
        assert set(used) <= set(nodes)
        for name, alloc in decision.allocations.items():
            if alloc:
                assert jobs[name].min_replicas <= len(alloc) <= jobs[name].max_replicas
                assert len(set(alloc)) <= 16
        # With 16 jobs, at least min(16, GPUs) replicas are handed out: the
        # harmonic mean punishes every job left without resources.
        assert sum(used.values()) >= min(16, 4 * num_nodes)
        previous = {k: v for k, v in decision.allocations.items() if v}
    assert decision.desired_nodes is None


def test_same_seed_reproduces_decisions() -> None:
    rng = np.random.default_rng(0)
    jobs = {
        f"j{i}": JobInfo({"gpu": 1}, goodput_speedup(rng), submission_time=float(i))
        for i in range(8)
    }
    nodes = {f"n{i}": NodeInfo({"gpu": 4}) for i in range(4)}
    runs = []
    for seed in (3, 3):
        policy = PolluxPolicy(seed=seed, population=20, generations=10)
        runs.append(
            [dict(policy.optimize(jobs, nodes, {}, now=100.0 + t).allocations) for t in (0, 60)]
        )
    assert runs[0] == runs[1]


def test_osdi_objective_prefers_spreading_to_starving() -> None:
    """Four identical linear jobs on 4 GPUs: the harmonic mean gives each one GPU."""
    jobs = {
        f"j{i}": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0, max_replicas=4)
        for i in range(4)
    }
    nodes = {"n0": NodeInfo({"gpu": 4})}
    decision = PolluxPolicy(seed=0, population=40, generations=40).optimize(
        jobs, nodes, {}, now=1e6
    )
    assert sorted(len(a) for a in decision.allocations.values()) == [1, 1, 1, 1]


def test_young_job_is_not_restarted() -> None:
    """Age-aware restart factor: a 60 s old job keeps its allocation."""
    nodes = {"n0": NodeInfo({"gpu": 4})}
    young = JobInfo({"gpu": 1}, lambda n, r: r, submission_time=940.0, num_restarts=3)
    decision = PolluxPolicy(seed=0, generations=30).optimize(
        {"young": young}, nodes, {"young": ("n0", "n0")}, now=1000.0
    )
    # max(60 - 3*30, 0) / 90 == 0: any change is worthless, so it stays.
    assert decision.allocations["young"] == ("n0", "n0")


def test_pinned_non_preemptible_job_keeps_allocation() -> None:
    jobs = {
        "pinned": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0, preemptible=False),
        "other": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0, attained_service=0),
    }
    nodes = {"a": NodeInfo({"gpu": 2}), "b": NodeInfo({"gpu": 2})}
    previous = {"pinned": ("a", "b")}
    decision = PolluxPolicy(seed=0, population=20, generations=10).optimize(
        jobs, nodes, previous, now=1e5
    )
    assert decision.allocations["pinned"] == ("a", "b")
    assert Counter(decision.allocations["other"]) <= Counter({"a": 1, "b": 1})


@pytest.mark.parametrize("flavour", ["osdi", "released"])
def test_non_preemptible_job_that_lost_a_node_is_placed_again(flavour: str) -> None:
    job = JobInfo(
        {"gpu": 1},
        lambda n, r: r,
        submission_time=0.0,
        min_replicas=4,
        max_replicas=4,
        preemptible=False,
    )
    nodes = {"n0": NodeInfo({"gpu": 4})}
    policy = PolluxPolicy(flavour=flavour, seed=0, population=20, generations=20)
    # n1 is gone: holding the job at its 2 surviving replicas breaks min_replicas.
    decision = policy.optimize({"a": job}, nodes, {"a": ("n0", "n0", "n1", "n1")}, now=1e5)
    assert decision.allocations["a"] == ("n0",) * 4


def test_released_result_fits_the_desired_cluster_size() -> None:
    jobs = {"j": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0, max_replicas=2)}
    nodes = {f"n{i}": NodeInfo({"gpu": 4}) for i in range(4)}
    for seed in range(3):
        policy = PolluxPolicy(flavour="released", population=50, generations=30, seed=seed)
        # Spread over n0 and n3, its utility is 0.25 (two replicas on the 8
        # GPUs of the nodes it uses); on one node it is 0.5, the band's middle.
        decision = policy.optimize(jobs, nodes, {"j": ("n0", "n3")}, now=1e4)
        assert decision.desired_nodes == 1
        # Shrinking to the desired size keeps the first node only.
        assert set(decision.allocations["j"]) == {"n0"}


def test_released_utility_counts_only_the_nodes_a_solution_uses() -> None:
    # Two replicas on n3 use half of the nodes they occupy: within the band,
    # so the cluster keeps its size although n0-n2 are idle (as the released
    # scheduler does; its utility is not relative to the whole cluster).
    jobs = {"j": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0, max_replicas=2)}
    nodes = {f"n{i}": NodeInfo({"gpu": 4}) for i in range(4)}
    policy = PolluxPolicy(flavour="released", population=50, generations=30, seed=0)
    decision = policy.optimize(jobs, nodes, {"j": ("n3", "n3")}, now=1e4)
    assert decision.desired_nodes == 4
    assert decision.allocations["j"] == ("n3", "n3")


def test_released_near_equal_utilities_are_ties_that_favour_more_nodes() -> None:
    # 0.175 and 0.17500000000000002 occur on real fronts: exact comparison
    # broke such ties towards fewer nodes.
    from types import SimpleNamespace

    policy = PolluxPolicy(flavour="released")
    f1 = np.array([-1.0, -0.9, -0.5])
    f2 = np.array([4.0, 2.0, 1.0])
    utility = np.array([0.175, 0.17500000000000002, 0.1])
    front = np.arange(3)
    prob: Any = SimpleNamespace(num_real=4)
    assert policy._autoscale(prob, f1, f2, utility, front) == (0, 4)
    # Only solutions at the band's low end or above size the cluster.
    utility = np.array([0.2, 0.4, 0.9])
    assert policy._autoscale(prob, f1, f2, utility, front) == (1, 2)


def test_noavoid_option_is_accepted_and_avoid_rule_holds() -> None:
    jobs = {
        f"j{i}": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=float(i), max_replicas=6)
        for i in range(3)
    }
    nodes = {f"n{i}": NodeInfo({"gpu": 4}) for i in range(4)}
    avoid = PolluxPolicy(seed=0, population=30, generations=30).optimize(jobs, nodes, {}, 1e5)
    on_node: Counter[str] = Counter()
    for alloc in avoid.allocations.values():
        if len(set(alloc)) > 1:
            on_node.update(set(alloc))
    assert on_node and max(on_node.values()) <= 1
    noavoid = PolluxPolicy(seed=0, population=30, generations=30, interference_avoidance=False)
    decision = noavoid.optimize(jobs, nodes, {}, 1e5)
    assert sum(len(a) for a in decision.allocations.values()) <= 16
    # Without the repair step the search keeps a node shared by two
    # distributed jobs (6 linear replicas each do not fit whole nodes).
    shared: Counter[str] = Counter()
    for alloc in decision.allocations.values():
        if len(set(alloc)) > 1:
            shared.update(set(alloc))
    assert max(shared.values(), default=0) >= 2, decision.allocations


@pytest.mark.parametrize(
    ("free", "min_replicas", "expected"),
    [
        ({"a": 0, "b": 2}, 0, ("b",)),
        ({"a": 4, "b": 2}, 3, ("a", "a", "a")),
        ({"a": 1, "b": 2}, 3, ()),
        ({}, 0, ()),
    ],
)
def test_allocate_job(free: dict[str, int], min_replicas: int, expected: tuple[str, ...]) -> None:
    job = JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0, min_replicas=min_replicas)
    nodes = {name: NodeInfo({"gpu": count}) for name, count in free.items()}
    assert PolluxPolicy().allocate_job(job, nodes) == expected


def test_released_desired_nodes_grows_for_scalable_jobs() -> None:
    """Linear jobs keep utility at 1 whatever the size: the cluster should grow."""
    jobs = {
        f"j{i}": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=float(i), max_replicas=8)
        for i in range(4)
    }
    nodes = {"n0": NodeInfo({"gpu": 4})}
    policy = get_policy("pollux", flavour="released", seed=0, population=40, generations=40)
    decision = policy.optimize(jobs, nodes, {}, now=1e5)
    assert decision.desired_nodes is not None and decision.desired_nodes > 1
    assert set(used_gpus(decision.allocations)) <= {"n0"}


def test_released_desired_nodes_shrinks_when_underused() -> None:
    """One job that cannot use more than one GPU: utility is low, shrink to 1 node."""
    jobs = {"j": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0, max_replicas=1)}
    nodes = {f"n{i}": NodeInfo({"gpu": 4}) for i in range(4)}
    policy = get_policy("pollux", flavour="released", seed=0, population=20, generations=20)
    decision = policy.optimize(jobs, nodes, {}, now=1e5)
    assert decision.desired_nodes == 1
    assert len(decision.allocations["j"]) == 1


@pytest.mark.parametrize(("num_nodes", "num_jobs"), [(8, 4), (8, 16), (16, 12)])
def test_released_fills_the_real_nodes_of_larger_clusters(num_nodes: int, num_jobs: int) -> None:
    # Mutation touches about one unused cell per job anywhere in the 2N
    # columns, so nearly every child used the last virtual columns: on 8 or
    # more nodes the only solution left within the real nodes was the empty
    # one, and every job got nothing while the policy asked for more nodes.
    jobs = {
        f"j{i}": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=float(i), max_replicas=8)
        for i in range(num_jobs)
    }
    nodes = {f"n{i}": NodeInfo({"gpu": 4}) for i in range(num_nodes)}
    policy = get_policy("pollux", flavour="released", seed=0)
    decision = policy.optimize(jobs, nodes, {}, now=1e5)
    gpus = used_gpus(decision.allocations)
    assert set(gpus) <= set(nodes) and max(gpus.values()) <= 4
    # Linear jobs use at least half of what they can (interference avoidance
    # leaves holes), and jobs that could use more GPUs than the cluster has
    # ask for more nodes.
    assert sum(gpus.values()) >= 0.5 * min(4 * num_nodes, 8 * num_jobs)
    assert decision.desired_nodes is not None
    if 8 * num_jobs > 4 * num_nodes:
        assert decision.desired_nodes > num_nodes


def test_released_keeps_size_inside_band() -> None:
    # Speedup 2.4 on 4 replicas: utility 0.6 on one 4-GPU node, inside the band.
    jobs = {
        "j": JobInfo(
            {"gpu": 1},
            lambda n, r: np.asarray(r, float) * 0.6 if np.ndim(r) else r * 0.6,
            submission_time=0.0,
            max_replicas=4,
        )
    }
    nodes = {"n0": NodeInfo({"gpu": 4})}
    policy = PolluxPolicy(flavour="released", seed=0, population=20, generations=30)
    decision = policy.optimize(jobs, nodes, {}, now=1e5)
    assert len(decision.allocations["j"]) == 4
    assert decision.desired_nodes == 1


@pytest.mark.parametrize(
    "options",
    [
        {"flavour": "paper"},
        {"population": 0},
        {"generations": -1},
        {"max_nodes_per_job": 0},
        {"p": float("nan")},
        {"crossover_prob": 1.5},
        {"utility_band": (0.7, 0.3)},
    ],
)
def test_bad_options_name_the_argument(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        PolluxPolicy(**options)


def test_nondominated_ranks_match_brute_force() -> None:
    rng = np.random.default_rng(0)
    f1 = rng.integers(0, 6, 60).astype(float)
    f2 = rng.integers(0, 6, 60).astype(float)
    ranks = _nondominated_ranks(f1, f2)
    remaining = set(range(60))
    front = 0
    while remaining:
        current = {
            i
            for i in remaining
            if not any(
                f1[k] <= f1[i] and f2[k] <= f2[i] and (f1[k] < f1[i] or f2[k] < f2[i])
                for k in remaining
            )
        }
        assert {i for i in range(60) if ranks[i] == front} == current
        remaining -= current
        front += 1


def test_crowding_boundaries_are_infinite() -> None:
    f1 = np.array([0.0, 1.0, 2.0, 3.0])
    f2 = np.array([3.0, 2.0, 1.0, 0.0])
    crowd = _crowding(f1, f2, np.zeros(4, dtype=np.int64))
    assert np.isinf(crowd[0]) and np.isinf(crowd[3])
    assert np.allclose(crowd[1:3], [4 / 3, 4 / 3])


@pytest.mark.parametrize("p", [-1.0, 0.0, 1.0])
def test_power_mean(p: float) -> None:
    values = np.array([[1.0, 4.0]])
    expected = {-1.0: 1.6, 0.0: 2.0, 1.0: 2.5}[p]
    assert _power_mean(values, p)[0] == pytest.approx(expected)


def test_population_carries_over_when_jobs_and_nodes_change() -> None:
    rng = np.random.default_rng(5)
    policy = PolluxPolicy(seed=0, population=20, generations=5)
    jobs = {
        f"j{i}": JobInfo({"gpu": 1}, goodput_speedup(rng), submission_time=float(i))
        for i in range(5)
    }
    nodes = {f"n{i}": NodeInfo({"gpu": 4}) for i in range(3)}
    previous: dict[str, tuple[str, ...]] = {}
    for step, (drop_job, add_node) in enumerate(itertools.product([False, True], repeat=2)):
        if drop_job:
            jobs.pop(sorted(jobs)[0], None)
        if add_node:
            nodes[f"extra{step}"] = NodeInfo({"gpu": 2})
        decision = policy.optimize(jobs, nodes, previous, now=100.0 * (step + 1))
        used = used_gpus(decision.allocations)
        assert all(used[n] <= nodes[n].resources["gpu"] for n in used)
        assert set(decision.allocations) == set(jobs)
        previous = {k: v for k, v in decision.allocations.items() if v}


def test_a_search_too_long_for_one_round_is_refused() -> None:
    # generations=10**8 froze a live daemon in its first round.
    with pytest.raises(ValueError, match="at most 1000000 candidate evaluations per round"):
        PolluxPolicy(generations=10**8)
    PolluxPolicy(population=1000, generations=1000)  # the limit itself is fine


def test_the_seed_must_be_a_non_negative_int() -> None:
    # None would draw from the OS: two runs would differ.
    for bad, error in ((None, TypeError), (True, TypeError), ("x", TypeError), (-1, ValueError)):
        with pytest.raises(error, match="seed="):
            PolluxPolicy(seed=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("flavour", ["osdi", "released"])
def test_keeping_what_is_left_of_a_job_that_lost_a_node_counts_as_a_restart(
    flavour: str,
) -> None:
    # The executor restarts such a job whatever is decided, so its surviving
    # replicas must not look free of the restart penalty.
    jobs = {"j": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0, num_restarts=0)}
    nodes = {"n0": NodeInfo({"gpu": 4})}
    policy = PolluxPolicy(flavour=flavour)
    values = []
    for previous in ({"j": ("n0", "n0")}, {"j": ("n0", "n0", "gone", "gone")}):
        prob = policy._build(jobs, nodes, previous, 1000.0)
        f1, _, _ = policy._evaluate(prob, prob.base[None].copy())
        values.append(float(f1[0]))
    factor = 0.9 if flavour == "released" else 1000.0 / 1030.0
    assert values[1] == pytest.approx(values[0] * factor, rel=1e-3)


def test_tournament_prefers_dominance_then_crowding() -> None:
    # 0 dominates 1 although 1 is less crowded; 2 and 3 are mutually
    # non-dominated, so the less crowded 3 wins; equals go to the coin.
    f1 = np.array([0.0, 1.0, 0.0, 1.0])
    f2 = np.array([0.0, 1.0, 1.0, 0.0])
    crowd = np.array([0.0, np.inf, 5.0, 5.0])
    a = np.array([0, 1, 2, 3, 2, 2])
    b = np.array([1, 0, 3, 2, 3, 3])
    crowd_b = crowd.copy()
    crowd_b[3] = 6.0
    coin = np.array([False, False, True, False, True, False])
    assert _binary_tournament(a, b, f1, f2, crowd, coin).tolist() == [0, 0, 2, 2, 2, 3]
    assert _binary_tournament(a[2:4], b[2:4], f1, f2, crowd_b, coin[2:4]).tolist() == [3, 3]
    # Drawn by permutations, 1 meets only itself about 1 time in 16, and
    # every other pairing beats it.
    policy = PolluxPolicy(seed=3)
    winners = policy._tournament(f1, f2, np.zeros(4), 400)
    assert len(winners) == 400 and {0, 2, 3} <= set(winners.tolist())
    assert (winners == 1).mean() < 0.15


def test_crowding_gives_copies_no_credit() -> None:
    f1 = np.array([0.0, 1.0, 1.0, 2.0, 3.0])
    f2 = np.array([3.0, 2.0, 2.0, 1.0, 0.0])
    crowd = _crowding(f1, f2, np.zeros(5, dtype=np.int64))
    assert np.isinf(crowd[0]) and np.isinf(crowd[4])
    assert crowd[2] == 0.0
    # The surviving copy is measured as if the other were not there.
    alone = _crowding(np.delete(f1, 2), np.delete(f2, 2), np.zeros(4, dtype=np.int64))
    assert crowd[[0, 1, 3, 4]].tolist() == alone.tolist()
    assert crowd[1] == pytest.approx(4 / 3)


def test_each_generation_breeds_a_full_brood_of_new_children() -> None:
    # pymoo's mating loop, which the paper's search used, keeps breeding until
    # it has `population` distinct new children; two tries left a third short.
    rng = np.random.default_rng(7)
    jobs = {
        f"j{i}": JobInfo(
            {"gpu": 1},
            lambda n, r: r**0.8,
            submission_time=float(i),
            attained_service=float(rng.uniform(0, 1e4)),
        )
        for i in range(10)
    }
    nodes = {f"n{i}": NodeInfo({"gpu": 4}) for i in range(16)}
    policy = PolluxPolicy(seed=1, population=100, generations=20)
    sizes: list[int] = []
    evaluate = policy._evaluate

    def counting(prob: Any, x: Any) -> Any:
        sizes.append(len(x))
        return evaluate(prob, x)

    policy._evaluate = counting  # type: ignore[method-assign]
    policy.optimize(jobs, nodes, {}, now=1e4)
    broods = sizes[1:]  # the first call scores the initial population
    assert len(broods) == 20
    assert np.median(broods) == 100 and min(broods) >= 90


def test_released_refuses_a_node_named_like_its_virtual_nodes() -> None:
    # A real "~virtual-0" was taken for a virtual node and its job evicted.
    policy = PolluxPolicy(flavour="released", population=4, generations=1, seed=0)
    nodes = {"~virtual-0": NodeInfo({"gpu": 4}), "n1": NodeInfo({"gpu": 4})}
    jobs = {"a": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0, preemptible=False)}
    with pytest.raises(ValueError, match="nodes: '~virtual-0': names starting with"):
        policy.optimize(jobs, nodes, {"a": ("~virtual-0",) * 4}, 60.0)


@pytest.mark.parametrize("flavour", ["osdi", "released"])
def test_a_node_of_32767_replicas_does_not_wrap_the_genome(flavour: str) -> None:
    # Mutation computed the span of a cell in 16 bits: a node holding
    # 2**15 - 1 replicas gave -32768, negative cells and no GPUs at all.
    jobs = {k: JobInfo({"cpu": 1}, lambda n, r: r, submission_time=0.0) for k in "ab"}
    nodes = {"n0": NodeInfo({"cpu": 32767})}
    policy = PolluxPolicy(flavour=flavour, seed=0, population=20, generations=5)
    decision = policy.optimize(jobs, nodes, {}, now=100.0)
    check_decision(decision, jobs, nodes, {})
    assert sum(len(v) for v in decision.allocations.values()) > 16000


def test_last_rounds_large_cells_do_not_wrap_when_nodes_shrink() -> None:
    # The previous Pareto set (64-bit, cells up to 40000) was copied into a
    # 16-bit genome: cells wrapped negative and the repair overfilled nodes.
    jobs = {k: JobInfo({"cpu": 1}, lambda n, r: r, submission_time=0.0) for k in "abc"}
    previous = {"a": ("n0",) * 40000 + ("n1",) * 30000, "b": ("n0",) * 20000, "c": ("n0",) * 20000}
    policy = PolluxPolicy(flavour="osdi", seed=0, population=20, generations=5)
    policy.optimize(jobs, {n: NodeInfo({"cpu": 80000}) for n in ("n0", "n1")}, previous, now=1000.0)
    nodes = {n: NodeInfo({"cpu": 30000}) for n in ("n0", "n1")}
    decision = policy.optimize(jobs, nodes, {}, now=1060.0)
    check_decision(decision, jobs, nodes, {})


def test_tables_too_large_for_memory_are_refused_by_name() -> None:
    # A node of 10**8 one-cpu replicas failed with numpy's MemoryError.
    jobs = {"a": JobInfo({"cpu": 1}, lambda n, r: r, submission_time=0.0)}
    nodes = {f"n{i}": NodeInfo({"cpu": 10**8}) for i in range(4)}
    policy = PolluxPolicy(seed=0, population=10, generations=2)
    with pytest.raises(ValueError, match=r"job 'a' could take up to 400000000 replicas"):
        policy.optimize(jobs, nodes, {}, now=10.0)
    jobs = {"a": JobInfo({"cpu": 1}, lambda n, r: r, submission_time=0.0, max_replicas=8)}
    assert len(policy.optimize(jobs, nodes, {}, now=10.0).allocations["a"]) == 8


def test_osdi_utility_uses_the_re_based_speedups() -> None:
    # The original re-based the speedup function itself, so its second
    # objective saw fair-share speedups; here it used speedups over 1 replica.
    jobs = {"a": JobInfo({"gpu": 1}, lambda n, r: r, submission_time=0.0)}
    nodes = {f"n{i:02d}": NodeInfo({"gpu": 4}) for i in range(16)}
    policy = PolluxPolicy(seed=0)
    problem = policy._build(jobs, nodes, {}, 100.0)
    genome = np.zeros((1, 1, 16), problem.base.dtype)
    genome[0, 0, 0] = 4  # 4 GPUs of one node; the fair share is 64 GPUs
    _, f2, utility = policy._evaluate(problem, genome)
    assert utility[0] == pytest.approx(4 / 64 / 4)
    assert f2[0] == -utility[0]
