"""The controller: job descriptions from hints, arrivals, completions, capacity checks."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adaptdl.cluster import (
    Controller,
    JobSpec,
    JobStatus,
    LocalBackend,
    Phase,
    job_info,
    predict_batch_and_goodput,
    waiting_reason,
)
from adaptdl.sched import Allocation, Decision, JobInfo, NodeInfo, Policy, linear_speedup

PERF = {
    "alpha_c": 0.01,
    "beta_c": 0.001,
    "alpha_n": 0.05,
    "beta_n": 0.01,
    "alpha_r": 0.02,
    "beta_r": 0.005,
    "gamma": 1.5,
}


def _status(hints: Mapping[str, object] | None = None, **spec_fields: object) -> JobStatus:
    spec = JobSpec(name="j", command=("python", "x.py"), **spec_fields)  # type: ignore[arg-type]
    return JobStatus(spec=spec, phase=Phase.RUNNING, submitted=100.0, hints=hints, restarts=2)


def test_job_without_hints_is_linear_and_starts_small() -> None:
    info = job_info(_status(max_replicas=8), "cpu")
    assert info.speedup_fn is linear_speedup
    assert (info.min_replicas, info.max_replicas) == (0, 1)
    assert info.resources == {"cpu": 1}
    assert info.num_restarts == 2 and info.submission_time == 100.0


def test_exploration_is_capped_at_twice_the_profiled_replicas() -> None:
    assert job_info(_status({"maxProfiledReplicas": 3}, max_replicas=8), "gpu").max_replicas == 6
    assert job_info(_status({"maxProfiledReplicas": 3}, max_replicas=4), "gpu").max_replicas == 4
    # minReplicas always wins over the cap.
    assert job_info(_status(None, min_replicas=3, max_replicas=8), "gpu").max_replicas == 3


def test_hints_with_a_model_give_a_goodput_speedup() -> None:
    hints = {
        "initBatchSize": 64,
        "maxBatchSize": 1024,
        "localBszBounds": [None, 128],
        "maxProfiledReplicas": 4,
        "perfParams": PERF,
        "gradParams": {"norm": 0.01, "var": 1.0},
    }
    info = job_info(_status(hints, max_replicas=16), "gpu")
    assert info.speedup_fn is not linear_speedup
    assert info.speedup_fn(1, 1) == pytest.approx(1.0)
    assert 1.0 < info.speedup_fn(1, 4) <= 4.0
    assert info.max_replicas == 8
    batch, goodput = predict_batch_and_goodput(hints, 4)
    assert batch is not None and 64 <= batch <= 1024 and batch % 4 == 0
    assert goodput is not None and goodput > 0
    # Non-preemptible jobs are never modelled: they keep their allocation.
    assert job_info(_status(hints, preemptible=False), "gpu").speedup_fn is linear_speedup


def test_remaining_iterations_hint_gives_the_policy_remaining_work() -> None:
    from adaptdl.goodput import GoodputFunction, GradParams, PerfParams
    from adaptdl.sched._matrix import remaining_work

    hints = {"initBatchSize": 64, "perfParams": PERF, "remainingIterations": 500.0}
    info = job_info(_status(hints, max_replicas=16), "gpu")
    assert info.remaining_iterations == 500.0 and info.step_time_fn is not None
    model = GoodputFunction(PerfParams(**PERF), GradParams(0.0, 1.0), 64)
    one_step = 64 / model.throughput(1, 1, 64, 0)
    assert info.step_time_fn(1) == pytest.approx(one_step)
    assert info.step_time_fn(4) == pytest.approx(64 / model.throughput(1, 4, 16, 0))
    assert remaining_work("j", info) == pytest.approx(500 * one_step)
    # Without a step-time model the work is unknown, whatever the job says.
    bare = job_info(_status({"initBatchSize": 64, "remainingIterations": 500.0}), "gpu")
    assert bare.remaining_iterations is None and remaining_work("j", bare) is None
    assert job_info(_status({"initBatchSize": 64, "perfParams": PERF}), "gpu").step_time_fn is None
    # A local batch above the job's bounds runs as accumulated micro-batches.
    bounded_hints = {**hints, "localBszBounds": [4, 24], "gradientAccumulation": True}
    bounded = job_info(_status(bounded_hints, max_replicas=16), "gpu")
    assert bounded.step_time_fn is not None
    # 64 samples on one replica under a cap of 24: three micro-batches of 22.
    assert bounded.step_time_fn(1) == pytest.approx(3 * 22 / model.throughput(1, 1, 22, 2))
    assert bounded.step_time_fn(4) == pytest.approx(64 / model.throughput(1, 4, 16, 0))
    assert bounded.step_time_fn(1) > one_step  # three micro-steps pay the fixed cost thrice


#: Hints whose smallest micro-batch (128) exceeds the initial batch size (64).
_LARGE_MICRO_BATCH = {
    "initBatchSize": 64,
    "maxBatchSize": 1024,
    "localBszBounds": [128, None],
    "perfParams": PERF,
    "remainingIterations": 100.0,
}


def test_hints_with_a_smallest_micro_batch_above_b0_or_the_largest_batch() -> None:
    from adaptdl.goodput import GoodputFunction, GradParams, PerfParams

    model = GoodputFunction(PerfParams(**PERF), GradParams(0.0, 1.0), 64)
    # Micro-batches of at least 128 > B0 = 64: a step runs 128 samples. Before,
    # building its step time raised inside every round and no job got GPUs.
    hints = _LARGE_MICRO_BATCH
    info = job_info(_status(hints, max_replicas=16), "gpu")
    assert info.step_time_fn is not None
    assert info.step_time_fn(1) == pytest.approx(128 / model.throughput(1, 1, 128, 0))
    # Smallest micro-batch above maxBatchSize: still one replica, never zero.
    small = {**hints, "maxBatchSize": 100, "localBszBounds": [128, 256]}
    assert job_info(_status(small, max_replicas=16), "gpu").max_replicas == 1


def test_replicas_are_capped_by_the_batch_even_without_max_batch_size() -> None:
    # The cap maxB / min_local applied only when both were given: a job
    # without maxBatchSize (B0 is then its largest batch) was offered 16
    # replicas at a global batch of 16 x 64 = 1024.
    hints = {"perfParams": PERF, "initBatchSize": 128, "maxProfiledReplicas": 8}
    bounded = {**hints, "localBszBounds": [64, 256]}
    assert job_info(_status(bounded, max_replicas=32), "gpu").max_replicas == 2
    low_only = {**hints, "localBszBounds": [16, None]}
    assert job_info(_status(low_only, max_replicas=32), "gpu").max_replicas == 8
    # Neither: B0 over one sample per replica.
    small = {**hints, "initBatchSize": 8}
    assert job_info(_status(small, max_replicas=32), "gpu").max_replicas == 8


def test_unusual_hints_of_one_job_do_not_stop_the_round(tmp_path: Path) -> None:
    from adaptdl.cluster import JobSpec as Spec
    from adaptdl.sched import get_policy

    backend = LocalBackend(tmp_path, slots=4, gpus=[])
    controller = Controller(backend, get_policy("adaptdl"), interval=60.0, clock=lambda: 1000.0)
    for name in ("good", "bad"):
        backend.submit(Spec(name=name, command=("python", "-c", "pass"), working_dir="."))
    backend.set_hints("bad", {**_LARGE_MICRO_BATCH, "maxProfiledReplicas": 1})
    controller.step()  # raised ValueError (max_atomic 64 < min_atomic 128) every round
    jobs = backend.jobs()
    assert jobs["good"].allocation and jobs["bad"].allocation
    backend.shutdown(stop_jobs=False)


def test_a_job_whose_hints_give_no_model_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Hints stored before the supervisor refused them: an ERROR with a
    # traceback every round.
    from adaptdl.sched import get_policy

    backend = LocalBackend(tmp_path, slots=4, gpus=[])
    controller = Controller(backend, get_policy("adaptdl"), interval=60.0, clock=lambda: 1000.0)
    backend.submit(JobSpec(name="bad", command=("python", "-c", "pass"), working_dir="."))
    backend.set_hints(
        "bad", {"perfParams": PERF, "initBatchSize": 128, "localBszBounds": [None, 64]}
    )
    with caplog.at_level("ERROR", logger="adaptdl.cluster._controller"):
        for _ in range(3):
            controller.step()
    errors = [r for r in caplog.records if "cannot build the goodput model" in r.getMessage()]
    assert len(errors) == 1 and not errors[0].exc_info
    assert "goodput at num_nodes=1, num_replicas=1 is 0.0" in errors[0].getMessage()
    assert backend.jobs()["bad"].allocation
    backend.shutdown(stop_jobs=False)


def test_prediction_without_a_model_reports_the_jobs_batch_size() -> None:
    assert predict_batch_and_goodput(None, 2) == (None, None)
    assert predict_batch_and_goodput({"initBatchSize": 32}, 2) == (32, None)
    assert predict_batch_and_goodput({"initBatchSize": 32, "globalBatchSize": 96}, 2) == (
        96,
        None,
    )


class _Recording(Policy):
    """Gives every job ``plan`` (``grant`` replicas on the local node); counts calls."""

    name = "recording"

    def __init__(self, grant: int) -> None:
        self.plan: Allocation = ("local",) * grant
        self.rounds = 0
        self.arrivals = 0

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        self.rounds += 1
        return Decision({name: self.plan for name in jobs})

    def allocate_job(self, job: JobInfo, nodes: Mapping[str, NodeInfo]) -> Allocation:
        self.arrivals += 1
        return super().allocate_job(job, nodes)


def _submit(backend: Any, name: str) -> None:
    """Submit a job that the policy may give up to 16 replicas.

    A job's ``max_replicas`` is twice the replicas it has profiled (the
    exploration cap); without hints a new job may get only one.
    """
    backend.submit(_spec(name))
    backend.set_hints(name, {"maxProfiledReplicas": 8})


def _spec(name: str, min_replicas: int = 0, preemptible: bool = True) -> JobSpec:
    return JobSpec(
        name=name,
        command=("python", "-c", "pass"),
        working_dir=".",
        min_replicas=min_replicas,
        preemptible=preemptible,
    )


def _setup(
    tmp_path: Path, slots: int, grant: int
) -> tuple[LocalBackend, _Recording, list[float], Controller]:
    """A local backend, a recording policy and a controller on a settable clock."""
    backend = LocalBackend(tmp_path, slots=slots, gpus=[])
    policy = _Recording(grant=grant)
    clock = [1000.0]
    controller = Controller(backend, policy, interval=60.0, clock=lambda: clock[0])
    return backend, policy, clock, controller


def test_rounds_run_on_schedule_and_arrivals_take_the_fast_path(tmp_path: Path) -> None:
    backend, policy, clock, controller = _setup(tmp_path, slots=4, grant=2)
    controller.step()  # empty cluster: nothing to plan
    assert policy.rounds == 0
    _submit(backend, "a")
    controller.step()  # the first job starts a round at once
    assert policy.rounds == 1
    assert backend.jobs()["a"].allocation == ("local", "local")
    _submit(backend, "b")
    clock[0] += 1
    controller.step()  # arrival between rounds: allocate_job on the free slots
    assert (policy.rounds, policy.arrivals) == (1, 1)
    assert backend.jobs()["b"].allocation == ("local",)
    clock[0] += 60
    controller.step()  # interval elapsed
    assert policy.rounds == 2
    backend.shutdown(stop_jobs=True, timeout=10)


def test_a_job_resubmitted_between_steps_is_scheduled_at_once(tmp_path: Path) -> None:
    """Deleted and submitted again under its name: a departure and an arrival."""
    backend, policy, clock, controller = _setup(tmp_path, slots=4, grant=2)
    _submit(backend, "a")
    controller.step()
    assert policy.rounds == 1
    backend.delete("a")  # not started yet: forgotten at once
    assert "a" not in backend.jobs()
    _submit(backend, "a")
    assert backend.jobs()["a"].allocation == ()
    clock[0] += 1
    controller.step()  # not due, but the old 'a' left: a round at once
    assert policy.rounds == 2
    assert backend.jobs()["a"].allocation == ("local", "local")
    backend.shutdown(stop_jobs=True, timeout=10)


def test_a_decision_over_capacity_is_ignored(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, slots=2, gpus=[])
    controller = Controller(backend, _Recording(grant=3), interval=1.0)
    _submit(backend, "a")
    controller.step()
    # The round is refused, but the new job still gets the fast path.
    assert backend.jobs()["a"].allocation == ("local",)
    assert controller.rounds == 0
    assert controller.last_policy_error is not None
    assert (
        "policy 'recording' made a decision the cluster cannot carry out: put 3 cpu on "
        in (controller.last_policy_error[1])
    )
    backend.shutdown(stop_jobs=False)


class _Bad(_Recording):
    """Breaks one rule in ``optimize`` (``mode``); ``allocate_job`` as given."""

    name = "bad"

    def __init__(self, mode: str, arrival: Any = None) -> None:
        super().__init__(grant=1)
        self.mode = mode
        self.arrival = arrival

    def optimize(self, jobs: Any, nodes: Any, previous: Any, now: float) -> Any:
        self.rounds += 1
        if self.mode == "raise":
            raise KeyError("oops")
        if self.mode == "exit":
            raise SystemExit(3)
        if self.mode == "dict":
            return {name: ("local",) for name in jobs}
        if self.mode == "max":
            return Decision({name: ("local",) * 3 for name in jobs})
        if self.mode == "move":  # shrinks every job to nothing
            return Decision({})
        return Decision({name: self.plan for name in jobs})

    def allocate_job(self, job: JobInfo, nodes: Mapping[str, NodeInfo]) -> Allocation:
        if self.arrival is not None:
            return self.arrival  # type: ignore[no-any-return]
        return super().allocate_job(job, nodes)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("raise", "policy 'bad' raised KeyError in optimize(): 'oops'"),
        # It ended the controller's thread silently: nothing was scheduled again.
        ("exit", "policy 'bad' raised SystemExit in optimize(): 3"),
        ("dict", "returned dict from optimize(), expected a Decision"),
        ("max", "gave job 'a' 3 replicas, outside its min_replicas=0 and max_replicas=2"),
    ],
)
def test_a_failing_policy_changes_nothing_and_says_so(
    tmp_path: Path, mode: str, message: str
) -> None:
    # A plugin policy could exceed a job's maxReplicas; one that raised left
    # only a bare "controller step failed" in the log and new jobs waiting.
    backend = LocalBackend(tmp_path, slots=4, gpus=[])
    clock = [1000.0]
    controller = Controller(backend, _Bad(mode), interval=60.0, clock=lambda: clock[0])
    backend.submit(_spec("a"))
    backend.set_hints("a", {"maxProfiledReplicas": 1})  # at most 2 replicas
    controller.step()
    assert controller.rounds == 0
    assert controller.last_policy_error is not None
    assert controller.last_policy_error[0] == 1000.0
    assert message in controller.last_policy_error[1]
    # The arrival still got allocate_job's replicas, and they are kept.
    assert backend.jobs()["a"].allocation == ("local",)
    clock[0] += 60
    controller.step()
    assert backend.jobs()["a"].allocation == ("local",)
    backend.shutdown(stop_jobs=False)


def test_a_non_preemptible_job_keeps_its_allocation_whatever_the_policy_says(
    tmp_path: Path,
) -> None:
    backend = _TwoNodes(tmp_path)
    clock = [1000.0]
    policy = _Bad("move")
    controller = Controller(backend, policy, interval=60.0, clock=lambda: clock[0])
    backend.submit(_spec("np", preemptible=False))
    backend.held["np"] = ("n0", "n0")
    controller.step()
    assert backend.calls == []  # not stopped
    assert controller.last_policy_error is not None
    assert "job 'np' from ('n0', 'n0') to ()" in controller.last_policy_error[1]
    assert "not preemptible" in controller.last_policy_error[1]
    # A round that keeps it is carried out, and clears the error.
    policy.mode = "plan"
    policy.plan = ("n0", "n0")
    clock[0] += 60
    controller.step()
    assert controller.rounds == 1 and controller.last_policy_error is None
    backend.shutdown(stop_jobs=False)


@pytest.mark.parametrize(
    ("arrival", "message"),
    [
        (("local",) * 2, "gave job 'a' 2 replicas, outside its min_replicas=0 and max_replicas=1"),
        (("local",) * 9, "put 9 cpu on node 'local', which has"),
        (("elsewhere",), "placed job 'a' on unknown node 'elsewhere'"),
        ("local", "returned 'local' for job 'a', expected a tuple of node names"),
    ],
)
def test_a_bad_arrival_allocation_is_refused(tmp_path: Path, arrival: Any, message: str) -> None:
    backend = LocalBackend(tmp_path, slots=4, gpus=[])
    clock = [1000.0]
    policy = _Bad("plan", arrival=arrival)
    controller = Controller(backend, policy, interval=60.0, clock=lambda: clock[0])
    controller.step()  # the empty cluster's round is done: the next job is an arrival
    clock[0] = 1001.0
    controller._last_optimize = clock[0]  # no round due
    backend.submit(_spec("a"))
    controller.step()
    assert backend.jobs()["a"].allocation == ()
    assert controller.last_policy_error is not None
    assert message in controller.last_policy_error[1]
    assert "allocate_job()" in controller.last_policy_error[1]
    backend.shutdown(stop_jobs=False)


def test_the_control_loop_survives_a_system_exit(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, slots=4, gpus=[])
    controller = Controller(backend, _Bad("plan"), interval=60.0)
    steps = []

    def step() -> None:
        steps.append(1)
        if len(steps) == 1:
            raise SystemExit(3)
        stop.set()

    controller.step = step  # type: ignore[method-assign]
    stop = threading.Event()
    controller.tick = 0.01
    worker = threading.Thread(target=controller.run, args=(stop,))
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and len(steps) == 2
    backend.shutdown(stop_jobs=False)


def test_waiting_reason_names_the_jobs_holding_slots() -> None:
    waiting = JobStatus(spec=_spec("w"), phase=Phase.PENDING, submitted=0.0)
    holder = JobStatus(
        spec=_spec("h"), phase=Phase.RUNNING, submitted=0.0, allocation=("local",) * 4, replicas=4
    )
    reason = waiting_reason(waiting, {"w": waiting, "h": holder}, 4)
    assert reason == "waiting for the scheduler: needs 1 of 4 slots, 0 free; held by h (4)"
    assert waiting_reason(holder, {"h": holder}, 4) is None
    # A job accepted by a larger cluster, which then restarted with fewer slots.
    wide = JobStatus(spec=_spec("x", min_replicas=6), phase=Phase.PENDING, submitted=0.0)
    assert waiting_reason(wide, {"x": wide}, 4) == (
        "cannot start: minReplicas=6 but this cluster has only 4 slots; restart the cluster "
        "with --slots 6 or more, or delete the job"
    )


def test_a_wake_during_a_step_is_not_lost(tmp_path: Path) -> None:
    """wake(optimize=True) after a step read the jobs still gets a round of its own."""
    backend, policy, clock, controller = _setup(tmp_path, slots=2, grant=1)
    _submit(backend, "a")
    snapshot = backend.jobs
    calls = [0]

    def jobs_then_wake(*, include_finished: bool = True) -> dict[str, JobStatus]:
        out = snapshot(include_finished=include_finished)
        calls[0] += 1
        if calls[0] == 1:  # a submit lands just after the step read the jobs
            controller.wake(optimize=True)
        return out

    backend.jobs = jobs_then_wake  # type: ignore[method-assign]
    controller.step()  # first round: due anyway
    assert policy.rounds == 1
    clock[0] += 1
    controller.step()  # not due, but the wake-up asked for a round
    assert policy.rounds == 2
    controller.step()
    assert policy.rounds == 2
    backend.shutdown(stop_jobs=False)


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0])
def test_an_interval_or_tick_that_is_not_a_positive_finite_number_is_refused(
    tmp_path: Path, value: float
) -> None:
    """A NaN interval compares false with every clock reading: no round would ever run."""
    backend = LocalBackend(tmp_path, slots=1, gpus=[])
    try:
        with pytest.raises(ValueError, match=r"interval=.*: expected a finite number of seconds"):
            Controller(backend, _Recording(grant=1), interval=value)
        with pytest.raises(ValueError, match=r"tick=.*: expected a finite number of seconds"):
            Controller(backend, _Recording(grant=1), tick=value)
    finally:
        backend.shutdown(stop_jobs=False)


class _TwoNodes(LocalBackend):
    """A local backend that reports two nodes and records allocations instead of starting."""

    def __init__(self, home: Path) -> None:
        super().__init__(home, slots=4, gpus=[])
        self.calls: list[tuple[str, Allocation]] = []
        self.held: dict[str, Allocation] = {}

    def nodes(self) -> dict[str, NodeInfo]:
        return {"n0": NodeInfo({"cpu": 4}), "n1": NodeInfo({"cpu": 4})}

    def set_allocation(self, name: str, allocation: Allocation) -> None:
        self.calls.append((name, allocation))
        self.held[name] = allocation

    def jobs(self, *, include_finished: bool = True) -> dict[str, Any]:
        return {
            name: dataclasses.replace(status, allocation=self.held.get(name, ()))
            for name, status in super().jobs(include_finished=include_finished).items()
        }


def test_the_same_replicas_in_another_order_do_not_restart_a_job(tmp_path: Path) -> None:
    backend = _TwoNodes(tmp_path)
    policy = _Recording(grant=0)
    policy.plan = ("n0", "n0", "n1", "n1")
    clock = [1000.0]
    controller = Controller(backend, policy, interval=60.0, clock=lambda: clock[0])
    _submit(backend, "a")
    controller.step()
    assert backend.calls == [("a", ("n0", "n0", "n1", "n1"))]
    policy.plan = ("n1", "n1", "n0", "n0")
    clock[0] += 60
    controller.step()
    assert policy.rounds == 2 and len(backend.calls) == 1  # not a move
    policy.plan = ("n1", "n1", "n1", "n0")
    clock[0] += 60
    controller.step()
    assert backend.calls[-1] == ("a", ("n1", "n1", "n1", "n0"))
    backend.shutdown(stop_jobs=False)


def test_a_job_whose_model_fails_keeps_its_replicas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The linear fallback capped it at max(1, minReplicas), so a running job
    # was shrunk (and restarted) because of its model alone.
    import adaptdl.cluster._controller as controller_module

    def broken(status: JobStatus, resource: str) -> JobInfo:
        raise ValueError("goodput at num_nodes=1, num_replicas=1 is nan")

    monkeypatch.setattr(controller_module, "job_info", broken)
    backend = LocalBackend(tmp_path, slots=4, gpus=[])
    controller = Controller(backend, _Recording(grant=1), interval=60.0)
    running = dataclasses.replace(
        _status(max_replicas=8), allocation=("local",) * 3, phase=Phase.RUNNING
    )
    small = dataclasses.replace(_status(max_replicas=2), allocation=("local",) * 3)
    infos = controller._infos({"running": running, "small": small, "new": _status()})
    assert infos["running"].max_replicas == 3
    assert infos["small"].max_replicas == 2  # never above the spec's maximum
    assert infos["new"].max_replicas == 1
    assert infos["running"].speedup_fn is linear_speedup
    backend.shutdown(stop_jobs=False)


class _EditsNodes(_Recording):
    """Grants its plan, then zeroes the capacity of every node it was shown."""

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        decision = super().optimize(jobs, nodes, previous, now)
        for info in nodes.values():
            with contextlib.suppress(TypeError):  # resources are read-only now
                info.resources["cpu"] = 0  # type: ignore[index]
        return decision


def test_a_policy_that_edits_the_nodes_does_not_change_the_capacity_check(
    tmp_path: Path,
) -> None:
    # The decision was checked against the nodes the policy had just edited.
    backend = LocalBackend(tmp_path, slots=4, gpus=[])
    controller = Controller(backend, _EditsNodes(grant=2), interval=60.0)
    _submit(backend, "a")
    controller.step()
    assert backend.jobs()["a"].allocation == ("local", "local")
    assert all(info.resources["cpu"] == 4 for info in backend.nodes().values())
    backend.shutdown(stop_jobs=True, timeout=10)


_OVERFLOWING = {
    "initBatchSize": 64,
    "localBszBounds": [1, None],
    "maxBatchSize": 2**30,
    "maxProfiledReplicas": 4,
    "gradientAccumulation": True,
    "gradParams": {"norm": 1e-12, "var": 1.0},
    "perfParams": {
        "alpha_c": 1.0,
        "beta_c": 1e300,
        "alpha_n": 1e-12,
        "beta_n": 1.0,
        "alpha_r": 1.0,
        "beta_r": 0.0,
        "gamma": 1.0,
    },
}


def test_hints_that_overflow_the_model_do_not_stop_every_round(tmp_path: Path) -> None:
    # Each value passes validation, but together they made the speedup nan
    # (0 micro-steps times an infinite micro-step time), the policy raised,
    # and no job was rescheduled until the job was deleted.
    from adaptdl.sched import get_policy

    info = job_info(_status(_OVERFLOWING, max_replicas=8), "cpu")
    values = info.speedup_fn(np.ones(8, dtype=int), np.arange(1, 9))
    assert np.all(np.isfinite(values)) and np.all(values >= 0)
    backend = LocalBackend(tmp_path, slots=4, gpus=[])
    controller = Controller(backend, get_policy("adaptdl"), interval=60.0, clock=lambda: 1000.0)
    for name in ("good", "bad"):
        backend.submit(JobSpec(name=name, command=("python", "-c", "pass"), working_dir="."))
    backend.set_hints("bad", {**_OVERFLOWING, "remainingIterations": 100.0})
    backend.set_hints("good", {"maxProfiledReplicas": 2})
    controller.step()
    assert controller.rounds == 1 and controller.last_policy_error is None
    assert backend.jobs()["good"].allocation
    backend.shutdown(stop_jobs=False)


def test_random_valid_hints_give_finite_speedups() -> None:
    rng = np.random.default_rng(7)
    for _ in range(60):
        perf = {
            key: float(10.0 ** rng.uniform(-12, 300)) if rng.random() < 0.5 else float(rng.random())
            for key in ("alpha_c", "beta_c", "alpha_n", "beta_n", "alpha_r", "beta_r")
        }
        perf["gamma"] = float(rng.uniform(1.0, 10.0))
        hints = {
            **_OVERFLOWING,
            "perfParams": perf,
            "gradParams": {"norm": float(10.0 ** rng.uniform(-12, 12)), "var": float(rng.random())},
            "gradientAccumulation": bool(rng.random() < 0.8),
        }
        try:
            info = job_info(_status(hints, max_replicas=8), "cpu")
        except (ValueError, ArithmeticError):
            continue  # refused outright: the controller falls back to linear
        values = info.speedup_fn(np.array([1, 1, 2, 4]), np.array([1, 4, 2, 8]))
        assert np.all(np.isfinite(values)) and np.all(values >= 0), (hints, values)


def test_a_job_deleted_during_a_round_does_not_abort_it(tmp_path: Path) -> None:
    # set_allocation raised JobNotFoundError for it, and the jobs after it
    # kept their old allocations until the next tick.
    backend = _TwoNodes(tmp_path)
    original = backend.set_allocation

    def deleted_first(name: str, allocation: Allocation) -> None:
        if name == "a":
            from adaptdl.cluster import JobNotFoundError

            raise JobNotFoundError(name)
        original(name, allocation)

    backend.set_allocation = deleted_first  # type: ignore[method-assign]
    policy = _Recording(grant=1)
    policy.plan = ("n0",)
    controller = Controller(backend, policy, interval=60.0, clock=lambda: 1000.0)
    _submit(backend, "a")
    _submit(backend, "b")
    controller.step()
    assert backend.calls == [("b", ("n0",))]
    assert controller.rounds == 1
    backend.shutdown(stop_jobs=False)


def test_an_infinite_step_time_is_no_remaining_work_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Policies refuse a non-finite step time, which would stop every round.
    import adaptdl.cluster._controller as controller_module

    monkeypatch.setattr(
        controller_module, "_init_batch_step_time", lambda *args: lambda replicas: math.inf
    )
    hints = {"initBatchSize": 64, "perfParams": PERF, "remainingIterations": 100.0}
    info = job_info(_status(hints, max_replicas=8), "cpu")
    assert info.step_time_fn is None and info.remaining_iterations is None
