"""Job physics and simulator rules, one test per rule, on the toy traces."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from adaptdl.sched import Allocation, Decision, JobInfo, NodeInfo, Policy
from adaptdl.sim import (
    RESTART_DELAY,
    Application,
    PolicyError,
    SimJob,
    Simulator,
    WorkloadJob,
    placement_of,
)
from tests.sim import toy


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("traces")
    toy.make_toy_traces(root, "toy")
    toy.make_toy_traces(root, "ncf")
    return root


@pytest.fixture(scope="module")
def app(traces: Path) -> Application:
    return Application(traces / "toy")


def _gain(batch: int, epoch: int, b0: int = 8) -> float:
    sqr, var = toy.grad_stats(batch, epoch)
    scale = batch / b0
    return (var + sqr) / (var / scale + sqr)


def test_placement_of_groups_consecutive_nodes() -> None:
    assert placement_of(("a", "a", "b", "c", "c", "c")) == (2, 1, 3)
    assert placement_of(()) == ()
    with pytest.raises(TypeError, match="allocation='n0n0': expected a sequence of node names"):
        placement_of("n0n0")  # type: ignore[arg-type]


def test_a_jobs_clock_only_moves_forward(app: Application) -> None:
    job = SimJob("j", app, 0.0, target_batch_size=8)
    for seconds in (-5.0, math.nan):
        with pytest.raises(ValueError, match="a job's clock only moves forward"):
            job.step(seconds)
    assert job.current_time == 0.0


def test_restart_delay_on_first_start(app: Application) -> None:
    job = SimJob("j", app, 0.0, target_batch_size=8)
    job.reallocate((1,))
    assert job.num_restarts == 0
    job.step(20)
    assert job.progress == 0.0 and job.rescale_time == RESTART_DELAY - 20
    job.step(10)
    assert job.progress == 0.0 and job.rescale_time == 0
    job.step(10)
    assert job.progress > 0.0
    job.reallocate((2,))
    assert job.num_restarts == 1 and job.rescale_time == RESTART_DELAY


def test_taking_gpus_away_costs_no_delay(app: Application) -> None:
    job = SimJob("j", app, 0.0, target_batch_size=8)
    job.reallocate((1,))
    job.step(60)
    job.reallocate(())
    before = (job.progress, job.attained_service)
    job.step(60)
    assert (job.progress, job.attained_service) == before
    assert job.current_time == 120 and job.rescale_time == 0


def test_gain_based_progress(app: Application) -> None:
    # B = B0 on one GPU: gain 1, no accumulation.
    job = SimJob("j", app, 0.0, target_batch_size=8)
    job.reallocate((1,))
    job.step(60)
    step = toy.step_time(1, 1, 8)
    assert job.progress == pytest.approx((60 - RESTART_DELAY) / step)
    # B = 32 on 2 GPUs of one node: gain = scale * efficiency.
    job = SimJob("k", app, 0.0, target_batch_size=32)
    job.reallocate((2,))
    job.step(RESTART_DELAY + 20)  # stays inside epoch 0
    assert (job.atomic_bsz, job.accum_steps) == (16, 0)
    expected = _gain(32, 0) / toy.step_time(1, 2, 16) * 20
    assert job.progress == pytest.approx(expected)
    assert _gain(32, 0) < 32 / 8


def test_accumulation_time(app: Application) -> None:
    # B = 16 on one GPU above B0: forced one accumulation step of 8.
    job = SimJob("j", app, 0.0, target_batch_size=16)
    job.reallocate((1,))
    assert (job.atomic_bsz, job.accum_steps) == (8, 1)
    job.step(RESTART_DELAY + 10)
    step, sync = toy.step_time(1, 1, 8), toy.sync_time(1, 1, 8)
    t_iter = step + 1 * (step - sync)
    assert job.progress == pytest.approx(_gain(16, 0) / t_iter * 10)


def test_epoch_boundary_rounds_to_whole_seconds(app: Application) -> None:
    job = SimJob("j", app, 0.0, target_batch_size=8)
    job.reallocate((1,))
    job.rescale_time = 0
    boundary = app.progress(1)
    goodput = 1.0 / toy.step_time(1, 1, 8)
    job.progress = boundary - 2.6 * goodput  # 2.6 s before the boundary
    job.step(10)
    assert job.epoch == 1
    # 3 whole seconds to the boundary (rounded), then 7 s in epoch 1.
    expected = app.progress(1) + 7 * goodput * 1.0
    assert job.progress == pytest.approx(expected)
    assert job.current_time == 10


def _in_last_epoch(app: Application, submitted: float, now: float, seconds_left: float) -> SimJob:
    """A job on one GPU at ``now``, ``seconds_left`` of training from its end."""
    job = SimJob("j", app, submitted, target_batch_size=8)
    job.current_time = now
    job.reallocate((1,))
    job.rescale_time = 0
    job.epoch = app.max_epochs - 1
    goodput = 1.0 / toy.step_time(1, 1, 8)
    job.progress = app.progress(app.max_epochs) - seconds_left * goodput
    return job


def test_the_rounding_never_passes_the_end_of_a_fractional_advance(app: Application) -> None:
    # 0.6 s left in a 0.6 s advance rounded up to 1 s: the job completed
    # 0.4 s after the end of the tick it ran in.
    job = _in_last_epoch(app, 0.0, 0.0, seconds_left=0.55)
    job.step(0.6)
    assert job.completion_time == 0.6
    assert job.current_time == 0.6


def test_completion_time_after_last_epoch(app: Application) -> None:
    job = _in_last_epoch(app, 100.0, 120.0, seconds_left=4.4)
    job.step(60)
    assert job.completion_time == 124.0
    assert job.jct() == 24.0
    assert job.current_time == 180.0  # the clock still runs to the tick's end


def test_attained_service_counts_delay(app: Application) -> None:
    job = SimJob("j", app, 0.0, target_batch_size=16)
    job.reallocate((2,))
    job.step(60)
    assert job.attained_service == 60 * 2


def test_remaining_iterations_and_packed_step_time(app: Application) -> None:
    job = SimJob("j", app, 0.0, target_batch_size=16)
    # rows: iteration at 16 is 400, 800, ..., 4000; completion epoch = 9
    assert job.remaining_iterations() == pytest.approx(4000 - 400)
    job.epoch = 9
    assert job.remaining_iterations() == 1.0
    # 1 GPU always accumulates in Optimus' oracle: 16 -> 2 x 8.
    job8 = SimJob("k", app, 0.0, target_batch_size=16)
    step, sync = toy.step_time(1, 1, 8), toy.sync_time(1, 1, 8)
    assert job8.packed_step_time(1, 4) == pytest.approx(step + (step - sync))
    # 8 GPUs are packed as (4, 4); 16 x 1 per GPU is below the atomic range.
    job64 = SimJob("m", app, 0.0, target_batch_size=64)
    assert job64.packed_step_time(8, 4) == pytest.approx(toy.step_time(2, 8, 8))


class _Fixed(Policy):
    """Test policy: a fixed decision, recording what it was given."""

    name = "fixed-test"

    def __init__(self, plan: Mapping[str, Allocation], adaptive: bool = False) -> None:
        self.plan = dict(plan)
        self.adaptive_batch = adaptive
        self.seen: list[dict[str, JobInfo]] = []

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        self.seen.append(dict(jobs))
        return Decision({k: v for k, v in self.plan.items() if k in jobs})


def _sim(traces: Path, jobs: list[WorkloadJob], policy: Policy, **kw: float) -> Simulator:
    from adaptdl.sim import load_applications

    return Simulator(jobs, policy, load_applications(traces), nodes=4, gpus_per_node=4, **kw)  # type: ignore[arg-type]


def test_interference_slows_distributed_jobs_sharing_nodes(traces: Path) -> None:
    jobs = [WorkloadJob(n, 0.0, "toy", 1, 16) for n in ("a", "b", "c")]
    plan = {"a": ("n0", "n1"), "b": ("n1", "n2"), "c": ("n3",)}
    slow = _sim(traces, jobs, _Fixed(plan), interference=0.5)
    fast = _sim(traces, jobs, _Fixed(plan), interference=0.0)
    for sim in (slow, fast):
        sim.tick()  # allocate
        sim.tick()  # 30 s delay + 30 s progress
    assert slow._interfering_jobs() == {"a", "b"}
    by_name = {j.name: j for j in slow.jobs}
    ref = {j.name: j for j in fast.jobs}
    assert by_name["a"].progress == pytest.approx(0.5 * ref["a"].progress)
    assert by_name["b"].progress == pytest.approx(0.5 * ref["b"].progress)
    assert by_name["c"].progress == ref["c"].progress  # single-node: never slowed


def test_tick_order_and_arrival_rounding(traces: Path) -> None:
    jobs = [WorkloadJob("a", 30.0, "toy", 1, 8), WorkloadJob("b", 61.0, "toy", 1, 8)]
    policy = _Fixed({"a": ("n0",), "b": ("n1",)})
    sim = _sim(traces, jobs, policy)
    sim.tick()
    assert sim.current_time == 60 and list(policy.seen[0]) == ["a"]
    sim.tick()
    assert list(policy.seen[1]) == ["a", "b"]
    a = sim.jobs[0]
    assert a.num_restarts == 0 and a.rescale_time == 0  # 30 s delay served in tick 2
    assert a.progress == pytest.approx(30 / toy.step_time(1, 1, 8))


def test_policy_errors_are_reported(traces: Path) -> None:
    jobs = [WorkloadJob("a", 0.0, "toy", 1, 8)]
    with pytest.raises(PolicyError, match="placed job 'a' on unknown node 'zz'"):
        _sim(traces, jobs, _Fixed({"a": ("zz",)})).tick()
    with pytest.raises(PolicyError, match="put 5 gpu on node 'n0', which has 4"):
        _sim(traces, jobs, _Fixed({"a": ("n0",) * 5})).tick()
    # The jobs on an overfilled node are named.
    two = [WorkloadJob("a", 0.0, "toy", 1, 32), WorkloadJob("b", 0.0, "toy", 1, 32)]
    over = {"a": ("n0",) * 3, "b": ("n0",) * 2}
    with pytest.raises(
        PolicyError,
        match=r"5 gpu on node 'n0', which has 4: jobs 'a' \(3 replicas\), 'b' \(2 replicas\)",
    ):
        _sim(traces, two, _Fixed(over)).tick()
    # A job that is not active (a cached old decision) says why.
    late = [WorkloadJob("a", 0.0, "toy", 1, 8), WorkloadJob("c", 500.0, "toy", 1, 8)]
    with pytest.raises(PolicyError, match="job 'c', which is not submitted until t=500s"):
        _sim(traces, late, _Returns(Decision({"a": ("n0",), "c": ("n1",)}))).tick()


def test_exploration_cap_and_ncf_pinning(traces: Path) -> None:
    jobs = [WorkloadJob("a", 0.0, "toy", 4, 32), WorkloadJob("n", 0.0, "ncf", 4, 32)]
    policy = _Fixed({"a": ("n0",), "n": ("n1",)}, adaptive=True)
    sim = _sim(traces, jobs, policy)
    sim.tick()
    info = policy.seen[-1]
    assert info["a"].max_replicas == 1 and info["n"].max_replicas == 1
    by_name = {j.name: j for j in sim.jobs}
    # ncf: fixed at the largest batch on 1 GPU; others adapt (no fixed batch).
    assert by_name["n"].target_batch_size == 64 and by_name["a"].target_batch_size is None
    # No profile yet: B = max(B0, min_local * R) = 8.
    assert by_name["a"].batch_size == 8
    sim.tick()  # profiles R = 1
    assert policy.seen[-1]["a"].max_replicas == 2
    assert policy.seen[-1]["n"].max_replicas == 1
    policy.plan["a"] = ("n0", "n0")
    sim.tick()
    sim.tick()  # profiles R = 2 -> cap min(2 * 2, 64, 64 // 8) = 4
    assert policy.seen[-1]["a"].max_replicas == 4
    policy.plan["a"] = ("n0", "n0", "n0")
    sim.tick()
    sim.tick()  # profiles R = 3 -> cap min(2 * 3, 64, 64 // 8) = 6
    assert policy.seen[-1]["a"].max_replicas == 6
    policy.plan["a"] = ("n0",) * 4 + ("n2",) * 2
    sim.tick()
    sim.tick()  # profiles R = 6 -> cap min(12, 64, max_batch // min_local = 8) = 8
    assert policy.seen[-1]["a"].max_replicas == 8
    # With a model, the agent picks the batch size from its goodput estimate.
    agent = by_name["a"].agent
    assert agent is not None and agent.choose(2, 8) is not None


def test_fixed_policy_job_info(traces: Path) -> None:
    jobs = [WorkloadJob("a", 0.0, "toy", 3, 32), WorkloadJob("n", 0.0, "ncf", 1, 64)]
    policy = _Fixed({})
    sim = _sim(traces, jobs, policy)
    sim.tick()
    info = policy.seen[-1]
    assert info["a"].requested_replicas == 3
    assert info["a"].max_replicas == 32 // 8
    assert info["n"].max_replicas == 1
    assert info["a"].remaining_iterations == pytest.approx((10 - 1) * 800 * 8 // 32)
    assert info["a"].step_time_fn is not None and info["a"].step_time_fn(2) > 0
    # Beyond max_replicas the oracle names the policy's request, not a trace gap.
    with pytest.raises(
        ValueError, match=r"'fixed-test' at t=60s asked job 'a' for step_time_fn\(5\).*=4"
    ):
        info["a"].step_time_fn(5)


def test_the_step_time_oracle_of_adaptive_jobs_stays_in_the_traces(traces: Path) -> None:
    # It used the initial batch for any replica count, and on one GPU always
    # split it for an accumulation step: below the smallest measured per-GPU
    # batch (8 here), the lookup failed for the built-in adaptdl policy and
    # for any custom policy calling step_time_fn(R) of an adaptive job.
    policy = _Fixed({}, adaptive=True)
    sim = _sim(traces, [WorkloadJob("a", 0.0, "toy", 1, 8)], policy)
    sim.tick()
    oracle = policy.seen[-1]["a"].step_time_fn
    assert oracle is not None
    # One GPU: the batch (B0 = 8) cannot be split, so it runs whole.
    assert oracle(1) == pytest.approx(toy.step_time(1, 1, 8))
    # Once the cap allows 3 replicas: B = max(B0, 8 * 3) = 24, 8 per GPU.
    by_name = {j.name: j for j in sim.jobs}
    assert by_name["a"].packed_step_time(3, 4) == pytest.approx(toy.step_time(1, 3, 8))


def test_a_fixed_batch_is_not_offered_more_gpus_than_the_traces_cover(
    traces: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # batch // min_local alone let cifar10 at 4096 be offered 128 GPUs on a
    # large cluster; the trace lookup then failed, blaming the workload.
    from adaptdl.sim import _simulate

    monkeypatch.setattr(_simulate, "MAX_EXPLORED_REPLICAS", 4)  # the traces' end, scaled down
    policy = _Fixed({})
    _sim(traces, [WorkloadJob("big", 0.0, "toy", 1, 64)], policy).tick()
    assert policy.seen[-1]["big"].max_replicas == 4  # not 64 // 8 = 8


def test_agent_fits_are_shared_and_identical(app: Application) -> None:
    from adaptdl.sim._agent import GoodputAgent

    first, second = GoodputAgent(app), GoodputAgent(app)
    samples = [(1, 1, 8, 0.2, 0.05), (1, 2, 8, 0.25, 0.08), (2, 4, 16, 0.4, 0.2)]
    for agent in (first, second):
        for nodes, reps, bsz, step, sync in samples:
            agent.observe(nodes, reps, bsz, step, sync, 1.0, 4.0)
    assert first.perf_params == second.perf_params
    assert second.num_fits == 0  # every fit came from the shared cache
    # Seeing a known configuration again does not refit.
    params = first.perf_params
    first.observe(1, 1, 8, 0.2, 0.05, 2.0, 4.0)
    assert first.perf_params is params and first.grad_params == (2.0, 4.0)


def test_agent_fits_with_the_originals_loss(pollux_data: Path) -> None:
    # The fit smoothed the RMSE (1e-8 under the root), so from these two
    # profiles the agent chose 40 samples per GPU on 4 GPUs, not the
    # original's 32, and 4 of the first 12 workload-1 jobs ended 1-48 s off.
    from adaptdl.sim import _agent, load_applications

    app = load_applications(pollux_data / "traces")["cifar10"]
    _agent._FIT_CACHE.clear()
    agent = _agent.GoodputAgent(app)
    agent.observe(1, 1, 128, *app.throughput((1,), 128), *app.grad_stats(128, 0))
    agent.observe(1, 2, 98, *app.throughput((2,), 98), *app.grad_stats(196, 0))
    assert agent.choose(1, 4) == (32, 0)
    assert agent.perf_params.alpha_r == pytest.approx(0.01039, rel=1e-3)


class _Gang(_Fixed):
    """A fixed-size policy that runs jobs only at their requested width."""

    gang_scheduled = True


def test_cluster_checks_before_the_run(traces: Path) -> None:
    from adaptdl.sim import load_applications

    apps = load_applications(traces)
    job = WorkloadJob("a", 0.0, "toy", 1, 8, origin="w.csv:2")
    with pytest.raises(ValueError, match="gpus_per_node=8: the toy traces measure at most 4"):
        Simulator([job], _Fixed({}), apps, nodes=2, gpus_per_node=8)
    wide = WorkloadJob("w", 0.0, "toy", 20, 64, origin="w.csv:3")
    with pytest.raises(ValueError, match=r"w.csv:3: job 'w' needs 20 GPUs but the cluster has 16"):
        _sim(traces, [wide], _Gang({}))
    _sim(traces, [wide], _Fixed({}))  # a policy that picks the width itself may run it
    _sim(traces, [wide], _Fixed({}, adaptive=True))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="seed="):
            _sim(traces, [job], _Fixed({}), seed=bad)
    for interval in (1e-9, 4e8, math.inf, math.nan):
        with pytest.raises(
            ValueError,
            match=rf"interval={interval!r}: must be a number of seconds from 1 to 315360000",
        ):
            _sim(traces, [job], _Fixed({}), interval=interval)


@pytest.mark.parametrize(
    ("replicas", "batch", "pattern"),
    [
        (
            1,
            128,
            r"w.csv:2: job 'a': batch size 128 is outside the range validated for toy \[8, 64\]",
        ),
        (1, 4, r"batch size 4 is outside the range"),
        # ceil(16 / 3) = 6 per GPU, below the smallest measured 8.
        (3, 16, r"w.csv:2: job 'a': batch size 16 on 3 GPU\(s\) gives toy a per-GPU batch of 6"),
        # One GPU accumulates a second micro-batch above B0: 9 -> 5 per micro-batch.
        (1, 9, r"batch size 9 on 1 GPU\(s\) gives toy a per-GPU batch of 5"),
        # No batch size given: the message says where 8 comes from.
        (
            3,
            None,
            r"job 'a' \(no batch size given: toy's smallest validated, 8\): batch size 8 on 3",
        ),
    ],
)
def test_fixed_batches_the_traces_cannot_run(
    traces: Path, replicas: int, batch: int | None, pattern: str
) -> None:
    job = WorkloadJob("a", 0.0, "toy", replicas, batch, origin="w.csv:2")
    with pytest.raises(ValueError, match=pattern):
        _sim(traces, [job], _Gang({}))
    _sim(traces, [job], _Fixed({}, adaptive=True))  # adaptive jobs choose their own batch


def test_non_adaptive_categories_are_refused_by_adaptive_policies(traces: Path) -> None:
    # Sia's "rigid" jobs were silently adapted like any other.
    columns = (("category", "category"),)
    rigid = WorkloadJob("r", 0.0, "toy", 2, 16, "w.csv:2", columns, category="rigid")
    with pytest.raises(
        ValueError, match=r"w.csv:2: column 'category': job 'r' is 'rigid', but policy"
    ):
        _sim(traces, [rigid], _Fixed({}, adaptive=True))
    _sim(traces, [rigid], _Gang({}))  # fixed-size policies run it as given
    adaptive = WorkloadJob("a", 0.0, "toy", 1, 8, category="adaptive")
    _sim(traces, [adaptive], _Fixed({}, adaptive=True))


def test_a_ceiling_split_at_the_smallest_batch_is_accepted(traces: Path) -> None:
    # ceil(63 / 7) = 9 >= 8 although 63 // 8 = 7 < ... : the split the physics uses decides.
    _sim(traces, [WorkloadJob("a", 0.0, "toy", 7, 63)], _Gang({}))


def test_a_policy_that_never_schedules_stops_the_run(traces: Path) -> None:
    from adaptdl.sim._simulate import STALL_ROUNDS

    sim = _sim(traces, [WorkloadJob("a", 0.0, "toy", 1, 8)], _Fixed({}))
    with pytest.raises(
        RuntimeError, match=f"left all 1 waiting jobs without GPUs for {STALL_ROUNDS}"
    ):
        sim.run()
    assert sim.current_time == STALL_ROUNDS * 60


class _Flip(_Fixed):
    """Test policy: moves every job to the other node each round."""

    def __init__(self) -> None:
        super().__init__({})
        self.rounds = 0

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        self.rounds += 1
        node = sorted(nodes)[self.rounds % 2]
        return Decision({name: (node,) for name in jobs})


def test_a_policy_that_restarts_jobs_faster_than_the_delay_stops_the_run(traces: Path) -> None:
    # Each move costs a 30 s restart; moving every 20 s, no job ever ran: the
    # run used to go on for the 10-year limit (about half an hour of CPU).
    from adaptdl.sim._simulate import STALL_ROUNDS

    jobs = [WorkloadJob(n, 0.0, "toy", 1, 8) for n in ("a", "b")]
    sim = _sim(traces, jobs, _Flip(), interval=20.0)
    with pytest.raises(RuntimeError, match=f"no job made progress for {STALL_ROUNDS} rounds"):
        sim.run()
    # The first round has no allocation yet; every later one restarts both jobs.
    assert sim.current_time == (STALL_ROUNDS + 1) * 20.0
    assert all(job.progress == 0.0 for job in sim.jobs)


class _Raises(_Fixed):
    """Test policy: fails on its second round, as a buggy plugin might."""

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        if previous:
            raise KeyError("oops")
        return Decision({name: ("n0",) for name in jobs})


def test_an_exception_in_the_policy_is_named_as_the_policys(traces: Path) -> None:
    from adaptdl.sim import PolicyError

    sim = _sim(traces, [WorkloadJob("a", 0.0, "toy", 1, 8)], _Raises({}))
    sim.tick()
    with pytest.raises(PolicyError, match=r"policy 'fixed-test' at t=120s raised KeyError in "):
        sim.tick()
    with pytest.raises(PolicyError) as info:
        _sim(traces, [WorkloadJob("a", 0.0, "toy", 1, 8)], _Raises({})).run()
    assert isinstance(info.value.__cause__, KeyError)


def test_restart_delays_longer_than_the_interval_are_not_a_stall(traces: Path) -> None:
    # With 1 s rounds a restart leaves a job without progress for 30 rounds;
    # only a policy that restarts it again within them is stuck.
    jobs = [WorkloadJob("a", 0.0, "toy", 1, 8)]
    sim = _sim(traces, jobs, _Fixed({"a": ("n0",)}), interval=1.0)
    sim.run(max_time=10 * 24 * 3600)
    assert sim.jobs[0].completion_time is not None


@pytest.mark.parametrize("interval", [60.0, 1.1, 7.3])
def test_idle_rounds_are_skipped_exactly(
    traces: Path, monkeypatch: pytest.MonkeyPatch, interval: float
) -> None:
    def finish(submit: float, skip: bool) -> tuple[list[float | None], int]:
        jobs = [WorkloadJob("a", 0.0, "toy", 1, 8), WorkloadJob("b", submit, "toy", 1, 8)]
        sim = _sim(traces, jobs, _Fixed({"a": ("n0",), "b": ("n1",)}), interval=interval)
        if not skip:
            monkeypatch.setattr(sim, "_skip_idle_rounds", lambda: None)
        ticks = 0
        while not sim.done:
            sim.tick()
            ticks += 1
        return [job.completion_time for job in sim.jobs], ticks

    # Arrivals after "a" ends: on a multiple of the interval, just after one, any time.
    for submit in (5000 * interval, 5000 * interval + 0.5, 30_000.0):
        skipped, few = finish(submit, skip=True)
        ticked, many = finish(submit, skip=False)
        assert skipped == ticked  # bit for bit
        assert few < many
    far, far_ticks = finish(30.0 + 60 * 10**6, skip=True)  # two years later
    assert far_ticks < 10_000  # not the 10**6 or more empty rounds in between


def test_trace_gaps_name_the_job(traces: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = WorkloadJob("a", 0.0, "toy", 1, 8, origin="w.csv:2")
    sim = _sim(traces, [job], _Fixed({"a": ("n0",)}))

    def missing(placement: tuple[int, ...], local_bsz: int) -> tuple[float, float]:
        raise ValueError("local_bsz=8 outside the measured range")

    monkeypatch.setattr(sim.jobs[0].app, "throughput", missing)
    sim.tick()
    with pytest.raises(
        ValueError, match=r"w.csv:2: job 'a' at t=60s on placement \(1,\): local_bsz"
    ):
        sim.tick()


def _ticked_clock(start: float, step: float, limit: float) -> float:
    t = start
    while t + step < limit:
        t += step
    return t


def test_the_idle_skip_lands_where_ticking_would() -> None:
    import random

    from adaptdl.sim._simulate import _advance_clock

    rng = random.Random(0)
    cases = [(0.0, 1.5, 1e4), (60.0, 1.1, 60.0), (0.0, 60.0, 0.0), (5.0, 7.3, 5.0 + 7.3)]
    for _ in range(3000):
        step = rng.choice([1.5, 1.1, 7.3, 60.0, 0.1 + 0.2 + 1, rng.uniform(1, 5000)])
        if rng.random() < 0.3:
            # Half an ulp of some binade: the additions round ties to even.
            step = float(int(step)) + 2.0 ** rng.randint(-52, -12)
        start = rng.choice([0.0, step, rng.uniform(0, 2.0 ** rng.randint(0, 40))])
        cases.append((start, step, start + rng.uniform(-1, 3000) * step))
    for start, step, limit in cases:
        assert _advance_clock(start, step, limit) == _ticked_clock(start, step, limit), (
            start,
            step,
            limit,
        )


def test_a_far_arrival_is_skipped_at_once_for_any_interval(traces: Path) -> None:
    jobs = [WorkloadJob("a", 0.0, "toy", 1, 8), WorkloadJob("b", 1e8, "toy", 1, 8)]
    sim = _sim(traces, jobs, _Fixed({"a": ("n0",), "b": ("n1",)}), interval=1.5)
    ticks = 0
    while not sim.done:
        sim.tick()
        ticks += 1
    assert ticks < 10_000  # not 6.7e7 rounds one by one
    assert sim.jobs[1].completion_time is not None and sim.jobs[1].completion_time > 1e8


def test_the_time_limit_is_named_when_an_interval_passes_it(traces: Path) -> None:
    jobs = [WorkloadJob("a", 100.0, "toy", 1, 8)]
    sim = _sim(traces, jobs, _Fixed({}), interval=1e8)
    with pytest.raises(RuntimeError) as info:
        sim.run()
    message = str(info.value)
    assert "clock reached 400000000 s, past the limit of 315360100 s" in message
    assert "(10 years after the last arrival at 100 s)" in message
    assert "only 3 rounds of interval=1e+08 s fit in that limit" in message
    assert "does the policy ever schedule them" not in message


def test_cluster_size_is_bounded(traces: Path) -> None:
    from adaptdl.sim import MAX_CLUSTER_GPUS, load_applications

    apps = load_applications(traces)
    jobs = [WorkloadJob("a", 0.0, "toy", 1, 8)]
    # Refused before building 10**8 nodes (a MemoryError before the bound).
    with pytest.raises(ValueError, match=f"at most {MAX_CLUSTER_GPUS} can be simulated"):
        Simulator(jobs, _Fixed({}), apps, nodes=10**8, gpus_per_node=4)


class _Returns(_Fixed):
    """Test policy returning whatever it was given, Decision or not."""

    def __init__(self, value: object) -> None:
        super().__init__({})
        self.value = value

    def optimize(self, jobs: Any, nodes: Any, previous: Any, now: float) -> Any:
        return self.value


def test_a_custom_policys_mistakes_name_the_policy_and_the_job(traces: Path) -> None:
    jobs = [WorkloadJob("a", 0.0, "toy", 1, 32)]  # at most 32 // 8 = 4 replicas
    with pytest.raises(
        PolicyError, match="policy 'fixed-test' at t=60s returned dict from optimize\\(\\)"
    ):
        _sim(traces, jobs, _Returns({"a": ("n0",)})).tick()
    # None was a TypeError, which the CLI reported as an internal error.
    with pytest.raises(PolicyError, match="returned NoneType from optimize\\(\\)"):
        _sim(traces, jobs, _Returns(None)).tick()
    with pytest.raises(PolicyError, match="gave job 'a' the allocation \\('n0', 'n1', 'n0'\\)"):
        _sim(traces, jobs, _Fixed({"a": ("n0", "n1", "n0")})).tick()
    with pytest.raises(PolicyError, match="gave job 'a' 8 replicas, outside its min_replicas=0"):
        _sim(traces, jobs, _Fixed({"a": ("n0",) * 4 + ("n1",) * 4})).tick()
    with pytest.raises(TypeError, match="policy=None: expected a Policy object"):
        _sim(traces, jobs, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy=<class"):
        _sim(traces, jobs, _Fixed)  # type: ignore[arg-type]


def test_the_same_replicas_in_another_order_are_not_a_restart(traces: Path) -> None:
    jobs = [WorkloadJob("a", 0.0, "toy", 4, 32)]
    policy = _Fixed({"a": ("n0", "n0", "n1", "n1")})
    sim = _sim(traces, jobs, policy)
    sim.tick()
    sim.tick()
    policy.plan["a"] = ("n1", "n1", "n0", "n0")
    sim.tick()
    policy.plan["a"] = ("n0", "n0", "n1", "n1")
    sim.tick()
    assert sim.jobs[0].num_restarts == 0


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("nodes", 4.0, TypeError, "nodes=4.0: expected an integer"),
        ("nodes", True, TypeError, "nodes=True: expected an integer"),
        ("gpus_per_node", "4", TypeError, "gpus_per_node='4': expected an integer"),
        ("interval", "60", TypeError, "interval='60': expected a number"),
        ("interval", None, TypeError, "interval=None: expected a number"),
        ("interference", True, TypeError, "interference=True: expected a number"),
        ("seed", 2**53 + 1, ValueError, "seed=9007199254740993: must be an integer from 0"),
    ],
)
def test_options_of_the_wrong_type_name_the_option(
    traces: Path, option: str, value: object, error: type[Exception], message: str
) -> None:
    from adaptdl.sim import load_applications

    options: dict[str, Any] = {"nodes": 2, "gpus_per_node": 4, option: value}
    jobs = [WorkloadJob("a", 0.0, "toy", 1, 8)]
    with pytest.raises(error, match=message):
        Simulator(jobs, _Fixed({}), load_applications(traces), **options)


def test_a_gang_wider_than_its_batch_floor_divides_still_runs(traces: Path) -> None:
    # 30 // 8 = 3, but 4 GPUs of ceil(30 / 4) = 8 samples each are measured:
    # a gang policy runs the workload's width, which the bound must allow.
    jobs = [WorkloadJob("a", 0.0, "toy", 4, 30)]
    policy = _Gang({"a": ("n0",) * 4})
    sim = _sim(traces, jobs, policy)
    sim.tick()
    assert policy.seen[-1]["a"].max_replicas == 4
    sim.tick()
    assert sim.allocations["a"] == ("n0",) * 4


class _Vandal(_Fixed):
    """Runs its plan, then edits everything it was given."""

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        decision = super().optimize(jobs, nodes, previous, now)
        for node in list(nodes):
            with contextlib.suppress(TypeError):  # resources are read-only now
                nodes[node].resources["gpu"] = 0  # type: ignore[index]
            nodes[node] = NodeInfo({"gpu": 0})  # type: ignore[index]
        jobs.clear()  # type: ignore[attr-defined]
        previous.clear()  # type: ignore[attr-defined]
        return decision


def test_a_policy_that_edits_its_inputs_does_not_edit_the_cluster(traces: Path) -> None:
    # The simulator passed its own dicts: the cluster shrank for good, and a
    # job popped from `jobs` was "not submitted" in the decision check.
    jobs = [WorkloadJob(n, 0.0, "toy", 1, 8) for n in ("a", "b")]
    plan = {"a": ("n0",), "b": ("n1",)}
    vandal, fixed = _sim(traces, jobs, _Vandal(plan)), _sim(traces, jobs, _Fixed(plan))
    vandal.run()
    fixed.run()
    assert vandal.result("w").jcts == fixed.result("w").jcts
    assert all(info.resources == {"gpu": 4} for info in vandal.nodes.values())


def test_a_run_that_ends_in_a_round_past_the_limit_is_a_result(traces: Path) -> None:
    # Every job had finished, yet the limit check said "jobs still incomplete (e.g. )".
    sim = _sim(traces, [WorkloadJob("a", 0.0, "toy", 1, 8)], _Fixed({"a": ("n0",)}), interval=2e8)
    sim.run()
    assert sim.done and sim.current_time == 4e8


def test_a_gang_wider_than_the_traces_is_refused_before_the_run(traces: Path) -> None:
    from adaptdl.sim import load_applications
    from adaptdl.sim._simulate import MAX_EXPLORED_REPLICAS

    wide = WorkloadJob("w", 0.0, "toy", 80, 640, origin="w.csv:2")
    # It failed at the first round with a trace lookup error.
    with pytest.raises(
        ValueError,
        match=f"w.csv:2: job 'w' needs 80 GPUs, but the scalability traces of toy end at "
        f"{MAX_EXPLORED_REPLICAS} replicas",
    ):
        Simulator([wide], _Gang({}), load_applications(traces), nodes=20, gpus_per_node=4)


def test_a_registered_name_is_the_results_policy(
    traces: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A variant registered under its own name was reported by its class's name.
    from adaptdl.sched import _types
    from adaptdl.sim import simulate

    monkeypatch.setitem(_types._REGISTRY, "fixed-variant", lambda: _Fixed({"a": ("n0",)}))
    jobs = [WorkloadJob("a", 0.0, "toy", 1, 8)]
    result = simulate(jobs, "fixed-variant", traces_dir=traces, nodes=4)
    assert result.policy == "fixed-variant"
