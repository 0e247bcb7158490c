"""Tiresias: two-queue discretised 2D-LAS on fixed GPU gangs."""

from __future__ import annotations

import pytest

from adaptdl.sched import JobInfo, NodeInfo, TiresiasPolicy, get_policy, linear_speedup


def _nodes(count: int = 2, gpus: int = 4) -> dict[str, NodeInfo]:
    return {f"n{i}": NodeInfo(resources={"gpu": gpus}) for i in range(count)}


def _job(gang: int, t: float = 0.0) -> JobInfo:
    return JobInfo(
        resources={"gpu": 1}, speedup_fn=linear_speedup, submission_time=t, requested_replicas=gang
    )


def test_registered() -> None:
    assert isinstance(get_policy("tiresias"), TiresiasPolicy)


def test_gangs_in_order_with_backfill() -> None:
    policy = TiresiasPolicy()
    jobs = {"a": _job(6), "b": _job(4), "c": _job(2)}
    alloc = policy.optimize(jobs, _nodes(), {}, 60).allocations
    # a (6) runs, b (4) does not fit in the 2 left, c (2) backfills.
    assert sorted(alloc) == ["a", "c"]
    assert len(alloc["a"]) == 6 and len(alloc["c"]) == 2
    # Most-free node first, spreading the gang: n0 x4 then n1 x2.
    assert alloc["a"] == ("n0",) * 4 + ("n1",) * 2
    assert alloc["c"] == ("n1", "n1")


def test_running_jobs_keep_their_nodes() -> None:
    policy = TiresiasPolicy()
    first = policy.optimize({"a": _job(2)}, _nodes(), {}, 60).allocations
    previous = {"a": ("n1", "n1")}  # whatever the cluster did
    second = policy.optimize({"a": _job(2), "b": _job(4)}, _nodes(), previous, 120).allocations
    assert first["a"] == ("n0", "n0")
    assert second["a"] == ("n1", "n1")
    assert second["b"] == ("n0",) * 4


def test_demotion_after_threshold_and_preemption() -> None:
    # Threshold 240 GPU-s: a 4-GPU job is demoted after 60 s of running.
    policy = TiresiasPolicy(queue_threshold=240)
    nodes = _nodes(1)
    alloc = policy.optimize({"a": _job(4)}, nodes, {}, 60).allocations
    assert alloc["a"] == ("n0",) * 4 and policy.queue_of("a") == 0
    jobs = {"a": _job(4), "b": _job(4, 100)}
    alloc = policy.optimize(jobs, nodes, dict(alloc), 120).allocations
    # 60 s x 4 GPUs = 240 >= threshold: a drops to Q1, b (Q0) preempts it.
    assert policy.queue_of("a") == 1
    assert list(alloc) == ["b"]
    # b runs 60 s, reaches the threshold too and queues behind a (FIFO in Q1).
    alloc = policy.optimize(jobs, nodes, dict(alloc), 180).allocations
    assert policy.queue_of("b") == 1 and list(alloc) == ["a"]


def test_executed_time_only_while_running() -> None:
    policy = TiresiasPolicy(queue_threshold=4 * 100)
    nodes = _nodes(1)
    jobs = {"big": _job(4), "small": _job(1)}
    policy.optimize(jobs, nodes, {}, 60)  # big runs, small waits
    policy.optimize(jobs, nodes, {"big": ("n0",) * 4}, 120)
    assert policy.queue_of("small") == 0 and policy.queue_of("big") == 0  # 60 s x 4 < 400
    policy.optimize(jobs, nodes, {"big": ("n0",) * 4}, 180)
    assert policy.queue_of("big") == 1  # 120 s x 4 >= 400
    assert policy.queue_of("small") == 0  # never ran: no executed time


def test_completed_jobs_forgotten() -> None:
    policy = TiresiasPolicy()
    policy.optimize({"a": _job(1), "b": _job(1)}, _nodes(), {}, 60)
    policy.optimize({"b": _job(1)}, _nodes(), {}, 120)
    assert policy.queue_of("a") is None and policy.queue_of("b") == 0


def test_input_errors() -> None:
    policy = TiresiasPolicy()
    bad = JobInfo(resources={"gpu": 1}, speedup_fn=linear_speedup, submission_time=0.0)
    with pytest.raises(ValueError, match="requested_replicas"):
        policy.optimize({"x": bad}, _nodes(), {}, 60)
    with pytest.raises(ValueError, match="queue_threshold"):
        TiresiasPolicy(queue_threshold=0)
    # The fast path has no key: it used to call the job 'job'.
    with pytest.raises(ValueError, match="^the new job: Tiresias needs"):
        policy.allocate_job(bad, _nodes())
    two = JobInfo({"gpu": 2}, linear_speedup, 0.0, requested_replicas=1)
    with pytest.raises(ValueError, match="^job.resources={'gpu': 2}: tiresias places"):
        policy.allocate_job(two, _nodes())


@pytest.mark.parametrize(("low", "high"), [(0, 0), (3, 4)])
def test_a_gang_outside_the_replica_bounds_is_refused(low: int, high: int) -> None:
    # It used to run with 2 replicas anyway, above max_replicas=0 or below
    # min_replicas=3: decisions the job (and the simulator) would refuse.
    job = JobInfo(
        {"gpu": 1}, linear_speedup, 0.0, min_replicas=low, max_replicas=high, requested_replicas=2
    )
    message = f"'j': requested_replicas=2 is outside .*min_replicas={low}, max_replicas={high}"
    with pytest.raises(ValueError, match=message):
        TiresiasPolicy().optimize({"j": job}, _nodes(), {}, 60)
    with pytest.raises(ValueError, match="requested_replicas=2 is outside"):
        TiresiasPolicy().allocate_job(job, _nodes())


def test_allocation_on_a_vanished_node_is_replaced() -> None:
    policy = TiresiasPolicy()
    decision = policy.optimize({"a": _job(1)}, _nodes(), {"a": ("zz",)}, 60)
    assert decision.allocations["a"] and "zz" not in decision.allocations["a"]


def test_same_time_arrivals_queue_in_natural_name_order() -> None:
    # j-9 is listed before j-10 in a numbered workload; a plain string sort
    # would put j-10 first.
    jobs = {"j-10": _job(4), "j-9": _job(4)}
    alloc = TiresiasPolicy().optimize(jobs, _nodes(1), {}, 60).allocations
    assert list(alloc) == ["j-9"]


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_jobs_demoted_together_keep_their_queue_order(order: tuple[str, str]) -> None:
    policy = TiresiasPolicy(queue_threshold=100.0)
    nodes = _nodes(1)
    jobs = {key: _job(2) for key in order}
    alloc = policy.optimize(jobs, nodes, {}, 0.0).allocations
    # 100 s x 2 GPUs: both reach the threshold in the same round.
    alloc = policy.optimize(jobs, nodes, dict(alloc), 100.0).allocations
    assert policy.queue_of("a") == policy.queue_of("b") == 1
    # A new Q0 job takes half the node: the first of Q1 keeps running, whatever the dict order.
    alloc = policy.optimize({**jobs, "c": _job(2, 150.0)}, nodes, dict(alloc), 200.0).allocations
    assert sorted(key for key, value in alloc.items() if value) == ["a", "c"]


def test_names_with_non_ascii_digits_sort_without_error() -> None:
    # "²" is a digit to str.isdigit() but not to int().
    jobs = {"v1\u00b2": _job(2), "v10": _job(2), "v9": _job(2)}
    alloc = TiresiasPolicy().optimize(jobs, _nodes(1), {}, 60).allocations
    assert sorted(alloc) == ["v1\u00b2", "v9"]


def test_a_clock_that_steps_back_never_shrinks_executed_time() -> None:
    # now=10 after now=60 set the executed time to 10: service a job lost
    # for good if it was preempted before the clock caught up again.
    policy = TiresiasPolicy(queue_threshold=4 * 100)
    nodes = _nodes(1)
    jobs = {"big": _job(4)}
    running = {"big": ("n0",) * 4}
    policy.optimize(jobs, nodes, {}, 0)
    policy.optimize(jobs, nodes, running, 60)
    policy.optimize(jobs, nodes, running, 10)  # back in time: adds nothing
    assert policy._executed["big"] == 60
    policy.optimize(jobs, nodes, running, 100)  # 40 s more, from 60 s
    assert policy._executed["big"] == 100 and policy.queue_of("big") == 1
