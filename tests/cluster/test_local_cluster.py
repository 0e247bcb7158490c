"""End-to-end tests of the local cluster with real replica processes.

The job is examples/jobs/counter.py, a PyTorch-free job that follows the
replica protocol (discovery, hints, checkpoint on SIGTERM, exit 143), so these
tests exercise the scheduler, backend and supervisor in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from adaptdl.cluster import ClusterClient, Phase
from tests.cluster.conftest import (
    InProcessCluster,
    children,
    counter_spec,
    expected_total,
    log_steps,
    start_test_daemon,
    wait_for,
)

pytestmark = pytest.mark.cluster


def _result(home: Path, name: str) -> dict[str, float]:
    result: dict[str, float] = json.loads(
        (home / "jobs" / name / "share" / "result.json").read_text()
    )
    return result


def test_two_jobs_share_slots_and_are_resized_while_running(
    local_cluster: InProcessCluster,
) -> None:
    backend = local_cluster.backend
    backend.submit(counter_spec("big", "--steps", "160", "--step-time", "0.1", "--hints"))
    backend.submit(
        counter_spec("small", "--steps", "60", "--step-time", "0.1", "--hints", max_replicas=2)
    )
    finished = (Phase.SUCCEEDED, Phase.FAILED)
    wait_for(lambda: all(job.phase in finished for job in backend.jobs().values()), 90, "both jobs")
    jobs = backend.jobs()
    for name, steps in (("big", 160), ("small", 60)):
        assert jobs[name].phase is Phase.SUCCEEDED, (name, jobs[name].message)
        # Same answer as an uninterrupted run, however often it was rescaled.
        assert _result(local_cluster.home, name) == {
            "steps": steps,
            "total": expected_total(steps),
        }
    resized = [name for name, job in jobs.items() if job.restarts > 0]
    assert resized, "no job was resized"
    for name in resized:
        kinds = [event.kind for event in backend.events(name)]
        assert "Checkpointed" in kinds  # replicas exited with 143 on request
        log = (local_cluster.home / "jobs" / name / "logs" / "replica-0.log").read_text()
        assert "restored step" in log
        printed = log_steps(local_cluster.home / "jobs" / name / "logs" / "replica-0.log")
        assert printed[-1] == (160 if name == "big" else 60)
    # The scheduler grew a job beyond one replica after its hints said so.
    assert any(
        "replicas 2" in (local_cluster.home / "jobs" / name / "logs" / "replica-0.log").read_text()
        for name in jobs
    )


def test_failing_script_marks_the_job_failed_with_its_traceback(
    local_cluster: InProcessCluster,
) -> None:
    backend = local_cluster.backend
    backend.submit(counter_spec("crash", "--steps", "50", "--fail-at", "3", max_restarts=1))
    wait_for(lambda: backend.jobs()["crash"].phase is Phase.FAILED, 30, "job failed")
    job = backend.jobs()["crash"]
    assert job.failures == 2  # first attempt plus one restart
    assert job.message is not None
    assert job.message.startswith("replica 0 exited with code 1")
    assert "RuntimeError: counter job failed on purpose at step 3" in job.message
    kinds = [event.kind for event in backend.events("crash")]
    assert kinds.count("Restarting") == 1 and kinds[-1] == "Failed"
    log = (local_cluster.home / "jobs" / "crash" / "logs" / "replica-0.log").read_text()
    assert log.count("===== adaptdl: restart group") == 2  # logs kept across restarts
    assert "Traceback (most recent call last)" in log


def test_replica_that_cannot_start_fails_the_job_and_frees_its_slots(
    local_cluster: InProcessCluster, tmp_path: Path
) -> None:
    backend = local_cluster.backend
    python, missing = backend.python, tmp_path / "no-such-python"
    backend.python = str(missing)  # the interpreter went away (a broken venv)
    backend.submit(counter_spec("nowhere", "--steps", "5"))
    wait_for(lambda: backend.jobs()["nowhere"].phase is Phase.FAILED, 30, "job failed")
    job = backend.jobs()["nowhere"]
    assert job.message is not None and job.message.startswith("cannot start replica 0:")
    assert str(missing) in job.message
    events = backend.events("nowhere")
    assert events[-1].kind == "Failed" and events[-1].message == job.message
    row = backend.store.get("nowhere")
    assert row is not None and row.allocation == [] and row.replicas == []
    backend.python = python
    backend.submit(counter_spec("after", "--steps", "3"))  # the freed slots run it
    wait_for(lambda: backend.jobs()["after"].phase is Phase.SUCCEEDED, 60, "next job done")


def test_killed_replica_resumes_from_its_checkpoint(local_cluster: InProcessCluster) -> None:
    backend = local_cluster.backend
    backend.submit(
        counter_spec("victim", "--steps", "120", "--step-time", "0.05", "--checkpoint-every", "5")
    )
    log = local_cluster.home / "jobs" / "victim" / "logs" / "replica-0.log"
    wait_for(lambda: len(log_steps(log)) >= 30, 40, "30 steps")
    shim = backend.store.get("victim").replicas[0]["pid"]  # type: ignore[union-attr]
    (child,) = children(shim)
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: backend.jobs()["victim"].phase is Phase.SUCCEEDED, 60, "job done")
    job = backend.jobs()["victim"]
    assert job.failures == 1 and job.restarts == 1
    assert "killed by SIGKILL" in (job.message or "")
    text = log.read_text()
    restored = int(text.split("restored step ")[1].split()[0])
    assert restored >= 25  # resumed from its last checkpoint, not from zero
    assert _result(local_cluster.home, "victim") == {"steps": 120, "total": expected_total(120)}


def test_killing_and_restarting_the_daemon_loses_no_job(daemon_home: Path) -> None:
    client = start_test_daemon(daemon_home)
    client.submit(counter_spec("survivor", "--steps", "600", "--step-time", "0.05"))
    client.submit(counter_spec("queued", "--steps", "20", "--step-time", "0.05", min_replicas=3))
    log = daemon_home / "jobs" / "survivor" / "logs" / "replica-0.log"
    wait_for(lambda: len(log_steps(log)) >= 10, 40, "survivor running")
    wait_for(lambda: client.describe("survivor")["phase"] == "Running", 10, "Running")
    os.kill(client.pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{client.pid}").exists() or _zombie(client.pid), 10, "exit")

    client = start_test_daemon(daemon_home)
    jobs = {job["name"]: job for job in client.jobs()}
    assert set(jobs) == {"survivor", "queued"}
    events = client.describe("survivor")["events"]
    assert any(e["kind"] == "Adopted" and "1 of 1 replicas" in e["message"] for e in events)

    def done() -> bool:
        return all(job["phase"] == "Succeeded" for job in client.jobs())

    wait_for(done, 120, "both jobs succeeded")
    survivor = client.describe("survivor")
    assert survivor["restarts"] == 0  # kept running through the daemon restart
    assert _result(daemon_home, "survivor") == {"steps": 600, "total": expected_total(600)}
    assert _result(daemon_home, "queued") == {"steps": 20, "total": expected_total(20)}
    assert isinstance(ClusterClient(daemon_home).cluster()["slots"], int)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_concurrent_starts_share_one_daemon(daemon_home: Path) -> None:
    """Two racing starts, then a third: one daemon, and every caller can use it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_test_daemon, daemon_home) for _ in range(2)]
        clients = [future.result(timeout=60) for future in futures]
    assert clients[0].pid == clients[1].pid
    # Exactly one caller launched it (the CLI says "started" only there).
    assert sorted(client.started_here for client in clients) == [False, True]
    late = start_test_daemon(daemon_home)  # must not unlink the live daemon.json
    assert late.pid == clients[0].pid and not late.started_here
    for client in [*clients, late, ClusterClient(daemon_home)]:
        assert client.cluster()["pid"] == clients[0].pid
        assert client.jobs() == []
    log = (daemon_home / "daemon.log").read_text()
    assert log.count("adaptdl daemon serving") == 1


def test_daemon_json_is_private(daemon_home: Path) -> None:
    client = start_test_daemon(daemon_home)
    assert client.cluster()["pid"] == client.pid
    assert stat.S_IMODE(daemon_home.stat().st_mode) == 0o700
    for name in ("daemon.json", "state.db"):
        assert stat.S_IMODE((daemon_home / name).stat().st_mode) == 0o600, name


def test_a_stopped_daemon_leaves_no_zombie_in_the_process_that_started_it(
    daemon_home: Path,
) -> None:
    # Its Popen was dropped: the exited daemon stayed a zombie child of the
    # caller until some later Popen collected it (another test's, maybe).
    client = start_test_daemon(daemon_home, warm_start=False)
    assert client.pid in children(os.getpid())
    assert client.shutdown(stop_jobs=True, wait=30)
    deadline = time.monotonic() + 10
    while client.pid in children(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.pid not in children(os.getpid())
