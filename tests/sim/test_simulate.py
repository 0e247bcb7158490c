"""End-to-end simulations: published fidelity and every registered policy."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest

from adaptdl.sched import get_policy, policy_names
from adaptdl.sim import (
    SimResult,
    TraceError,
    find_traces_dir,
    is_adaptive,
    make_policy,
    simulate,
)


def _published(data: Path, policy: str, workload: str) -> dict[str, int]:
    doc = json.loads((data / "published" / "load-1.0-workloads-1-4.json").read_text())
    jcts: dict[str, int] = doc["policies"][policy]["jcts"][workload]
    return jcts


def _check_fidelity(data: Path, policy: str, number: int) -> None:
    workload = f"workload-{number}"
    result = simulate(data / "workloads" / f"{workload}.csv", policy, traces_dir=data / "traces")
    published = _published(data, policy, workload)
    assert set(result.jcts) == set(published)
    mismatches = {
        name: (result.jcts[name], jct)
        for name, jct in published.items()
        if result.jcts[name] != jct
    }
    assert not mismatches, f"{len(mismatches)} JCTs differ (ours, published): {mismatches}"


@pytest.mark.parametrize("number", [1, 2, 3, 4])
@pytest.mark.parametrize("policy", ["tiresias", "optimus"])
def test_fidelity_every_published_jct(pollux_data: Path, policy: str, number: int) -> None:
    """All 160 JCTs of each workload match the published ones to the second.

    Tiresias and Optimus are deterministic, so any difference is a physics or
    policy bug; the 8 runs take a few seconds, so they all run in CI.
    """
    _check_fidelity(pollux_data, policy, number)


@pytest.mark.parametrize("name", policy_names())
def test_reduced_workload_every_policy(pollux_data: Path, name: str) -> None:
    policy = make_policy(name, seed=1)
    # Goodput policies refit models and search every round: fewer jobs, and a
    # shorter genetic search where the policy has one, keep CI fast.
    max_jobs = 30
    if is_adaptive(policy):
        max_jobs = 8
        if "generations" in inspect.signature(type(policy)).parameters:
            policy = get_policy(name, seed=1, generations=10)
    progress: list[tuple[float, int, int]] = []
    result = simulate(
        pollux_data / "workloads" / "workload-1.csv",
        policy,
        traces_dir=pollux_data / "traces",
        max_jobs=max_jobs,
        progress=lambda *args: progress.append(args),
    )
    assert isinstance(result, SimResult) and len(result.jobs) == max_jobs
    summary = result.summary()
    assert 0 < summary["p50_jct"] <= summary["p99_jct"] <= summary["makespan"]
    assert summary["gpu_hours"] > 0 and summary["restarts_per_job"] >= 0
    gpus = 16 * 4
    for job in result.jobs:
        assert job.jct >= 30  # at least the first start's delay
        assert job.completion_time == job.submission_time + job.jct
        # The allocation log: round times, each start a restart but the first.
        times = [when for when, _ in job.allocations]
        assert times == sorted(times) and job.submission_time <= job.start_time <= times[0]
        assert all(when % 60 == 0 for when in times)
        starts = [placement for _, placement in job.allocations if placement]
        assert len(starts) == job.num_restarts + 1
        assert all(0 < sum(placement) <= gpus for placement in starts)
        assert job.start_time + 30 <= job.completion_time
    assert progress[-1][1:] == (max_jobs, max_jobs)
    assert math.isclose(progress[-1][0] % 60, 0.0)


def test_find_traces_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ADAPTDL_SIM_TRACES", str(tmp_path))
    assert find_traces_dir() == tmp_path
    assert find_traces_dir(tmp_path / "x") == tmp_path / "x"
    with pytest.raises(TraceError, match="trace directory not found"):
        simulate(tmp_path / "w.csv", "tiresias", traces_dir=tmp_path / "nope")
    # ADAPTDL_SIM_TRACES naming a file was reported as "not found".
    (tmp_path / "file").write_text("")
    with pytest.raises(TraceError, match="is a file, not a trace directory"):
        simulate(tmp_path / "w.csv", "tiresias", traces_dir=tmp_path / "file")


def test_options_validated(pollux_data: Path) -> None:
    with pytest.raises(ValueError, match="interference"):
        simulate(
            pollux_data / "workloads" / "workload-1.csv",
            "tiresias",
            traces_dir=pollux_data / "traces",
            interference=1.5,
        )
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")


def test_max_jobs_must_be_positive(pollux_data: Path) -> None:
    workload = pollux_data / "workloads" / "workload-1.csv"
    with pytest.raises(ValueError, match="max_jobs=0: must be an integer >= 1"):
        simulate(workload, "tiresias", traces_dir=pollux_data / "traces", max_jobs=0)


def test_search_ignores_folders_without_model_traces(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("ADAPTDL_SIM_TRACES", raising=False)
    tmp_path = tmp_path.resolve()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "traces" / "model").mkdir(parents=True)  # a generic name: never searched
    (tmp_path / "traces" / "model" / "placements.csv").write_text("placement\n")
    (tmp_path / "pollux-data" / "traces" / "notes").mkdir(parents=True)  # no model folder
    try:
        found: Path | None = find_traces_dir()  # the checkout's shared data, when present
    except TraceError:
        found = None
    assert found not in (tmp_path / "traces", tmp_path / "pollux-data" / "traces")
    (tmp_path / "pollux-data" / "traces" / "toy").mkdir()
    (tmp_path / "pollux-data" / "traces" / "toy" / "placements.csv").write_text("placement\n")
    assert find_traces_dir() == tmp_path / "pollux-data" / "traces"


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"submission_time": math.nan}, "WorkloadError", "submission_time=nan: expected a number"),
        ({"submission_time": 1e18}, "WorkloadError", "submission_time=1e\\+18"),
        ({"submission_time": "10"}, "WorkloadError", "submission_time='10'"),
        ({"num_replicas": 0}, "WorkloadError", "num_replicas=0: expected an integer from 1"),
        ({"batch_size": 128.5}, "WorkloadError", "batch_size=128.5: expected an integer from 1"),
        # A file's cells stop at 2**31 - 1; jobs built in code failed only at
        # the first round, in a message that did not name the job.
        ({"num_replicas": 2**40}, "WorkloadError", "num_replicas=1099511627776: expected an"),
        ({"batch_size": 2**31}, "WorkloadError", "batch_size=2147483648: expected an"),
        ({"name": 5}, "WorkloadError", "name=5: expected a non-empty string"),
        ({"application": ""}, "WorkloadError", "application='': expected a model name"),
    ],
)
def test_jobs_built_in_code_are_checked_like_a_files(
    pollux_data: Path, fields: dict[str, object], error: str, message: str
) -> None:
    from adaptdl.sim import WorkloadError, WorkloadJob

    options: dict[str, object] = {
        "name": "a",
        "submission_time": 0.0,
        "application": "cifar10",
        "num_replicas": 1,
        "batch_size": None,
    }
    options.update(fields)
    job = WorkloadJob(**options)  # type: ignore[arg-type]
    with pytest.raises(WorkloadError, match=f"workload job 0 \\(.*\\): {message}"):
        simulate([job], "tiresias", traces_dir=pollux_data / "traces")


def test_simulate_names_a_bytes_path_and_a_name_that_is_not_a_string(pollux_data: Path) -> None:
    traces = pollux_data / "traces"
    # Bytes are a Sequence: it failed as "workload job 0: expected a WorkloadJob, got 47".
    with pytest.raises(TypeError, match="workload_path=b'/w.csv': expected a str or os.PathLike"):
        simulate(b"/w.csv", "tiresias", traces_dir=traces)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name=123: expected the workload's name as a str"):
        simulate([], "tiresias", traces_dir=traces, name=123)  # type: ignore[arg-type]


def test_a_workload_built_in_code_needs_unique_jobs(pollux_data: Path) -> None:
    from adaptdl.sim import WorkloadError, WorkloadJob

    traces = pollux_data / "traces"
    job = WorkloadJob("a", 0.0, "cifar10", 1, None)
    with pytest.raises(WorkloadError, match="workload: no jobs"):
        simulate([], "tiresias", traces_dir=traces)
    with pytest.raises(
        WorkloadError, match="workload job 1 \\('a'\\): name='a': expected a unique"
    ):
        simulate([job, job], "tiresias", traces_dir=traces)
    with pytest.raises(TypeError, match="workload job 0: expected a WorkloadJob, got 'a'"):
        simulate(["a"], "tiresias", traces_dir=traces)  # type: ignore[list-item]


def test_the_seed_builds_a_named_policy_and_is_recorded_only_then(pollux_data: Path) -> None:
    from adaptdl.sim import WorkloadJob

    traces = pollux_data / "traces"
    jobs = [WorkloadJob("a", 0.0, "cifar10", 1, None)]
    assert simulate(jobs, "pollux", traces_dir=traces).options["seed"] == 0
    assert simulate(jobs, "pollux", traces_dir=traces, seed=3).options["seed"] == 3
    assert "seed" not in simulate(jobs, get_policy("tiresias"), traces_dir=traces).options
    # Tiresias takes no seed: a seed sweep must not file identical runs under several.
    assert "seed" not in simulate(jobs, "tiresias", traces_dir=traces, seed=3).options
    with pytest.raises(ValueError, match="seed=2 with a policy object"):
        simulate(jobs, get_policy("pollux"), traces_dir=traces, seed=2)
    with pytest.raises(ValueError, match="seed=-1: must be an integer from 0 to 2\\*\\*53"):
        simulate(jobs, "pollux", traces_dir=traces, seed=-1)


def test_numpy_numbers_and_a_category_in_capitals_are_taken_as_a_file_gives_them(
    pollux_data: Path,
) -> None:
    # float32 times (a DataFrame column) failed inside the clock's Fractions,
    # and "Adaptive" was refused from code though a file's cell is lowercased.
    import numpy as np

    from adaptdl.sim import WorkloadJob

    traces = pollux_data / "traces"
    jobs = [WorkloadJob("a", np.float32(1e6), "ncf", 1, None, category="Adaptive")]
    result = simulate(jobs, "adaptdl", traces_dir=traces, interval=np.float32(60))
    assert type(result.jobs[0].jct) is float and result.jobs[0].jct > 0
    plain = simulate([WorkloadJob("a", 1e6, "ncf", 1, None)], "adaptdl", traces_dir=traces)
    assert result.jobs[0].jct == plain.jobs[0].jct


def test_a_simulator_files_its_result_under_the_name_given(pollux_data: Path) -> None:
    from adaptdl.sim import Simulator, WorkloadJob, load_applications

    apps = load_applications(pollux_data / "traces")
    jobs = [WorkloadJob("a", 0.0, "cifar10", 1, None)]
    sim = Simulator(jobs, get_policy("tiresias"), apps, policy_name="tiresias-variant")
    sim.run()
    assert sim.result("w", 0.0).policy == "tiresias-variant"
    with pytest.raises(TypeError, match="policy_name=5"):
        Simulator(jobs, get_policy("tiresias"), apps, policy_name=5)  # type: ignore[arg-type]


def test_autoscaling_requests_are_logged_once_not_acted_on(
    pollux_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from adaptdl.sched import Decision, Policy
    from adaptdl.sim import WorkloadJob

    class Grow(Policy):
        name = "grow"

        def optimize(self, jobs, nodes, previous, now):  # type: ignore[no-untyped-def]
            node = sorted(nodes)[0]
            return Decision({name: (node,) for name in jobs}, desired_nodes=99)

        def allocate_job(self, job, nodes):  # type: ignore[no-untyped-def]
            return ()

    jobs = [WorkloadJob("a", 0.0, "cifar10", 1, None), WorkloadJob("b", 0.0, "ncf", 1, None)]
    with caplog.at_level("WARNING", logger="adaptdl.sim._simulate"):
        result = simulate(jobs, Grow(), traces_dir=pollux_data / "traces", nodes=2)
    assert result.options["nodes"] == 2
    warnings = [r for r in caplog.records if "asks for 99 nodes" in r.getMessage()]
    assert len(warnings) == 1 and "autoscaling is not simulated" in warnings[0].getMessage()


def test_a_policy_misusing_a_callback_is_a_policy_error(pollux_data: Path) -> None:
    from adaptdl.sched import Decision, Policy
    from adaptdl.sim import PolicyError, WorkloadJob

    class Probe(Policy):
        name = "probe"

        def optimize(self, jobs, nodes, previous, now):  # type: ignore[no-untyped-def]
            for info in jobs.values():
                info.step_time_fn(10**9)  # no trace has this many replicas
            return Decision({})

        def allocate_job(self, job, nodes):  # type: ignore[no-untyped-def]
            return ()

    jobs = [WorkloadJob("a", 0.0, "cifar10", 1, 128)]
    with pytest.raises(PolicyError):
        simulate(jobs, Probe(), traces_dir=pollux_data / "traces")
