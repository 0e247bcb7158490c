"""The local backend on its own: GPU slots, submission checks, deletion."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from adaptdl.cluster import BackendError, JobNotFoundError, JobSpec, LocalBackend, Phase

PRINT_ENV = (
    "import os; print('visible', os.environ['CUDA_VISIBLE_DEVICES'], "
    "'rank', os.environ['ADAPTDL_REPLICA_RANK'], 'of', os.environ['ADAPTDL_NUM_REPLICAS'])"
)


def _run_until(backend: LocalBackend, name: str, phases: set[Phase], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        backend.reconcile(time.time())
        if name not in backend.jobs() or backend.jobs()[name].phase in phases:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} did not reach {phases}")


def test_each_replica_sees_one_gpu(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, gpus=[3, 5, 6])
    assert backend.slot_resource() == "gpu"
    assert backend.nodes()["local"].resources == {"gpu": 3}
    backend.submit(JobSpec(name="g", command=("python", "-c", PRINT_ENV), working_dir="."))
    backend.set_allocation("g", ("local", "local"))
    _run_until(backend, "g", {Phase.SUCCEEDED, Phase.FAILED})
    assert backend.jobs()["g"].phase is Phase.SUCCEEDED
    logs = tmp_path / "jobs" / "g" / "logs"
    assert "visible 3 rank 0 of 2" in (logs / "replica-0.log").read_text()
    assert "visible 5 rank 1 of 2" in (logs / "replica-1.log").read_text()
    backend.shutdown(stop_jobs=False)


def test_submission_checks(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, slots=2, gpus=[])
    spec = JobSpec(name="a", command=("python", "-c", "pass"), working_dir=".")
    backend.submit(spec)
    with pytest.raises(BackendError, match="a job named 'a' already exists"):
        backend.submit(spec)
    with pytest.raises(BackendError, match="minReplicas=3 but this cluster has only 2 cpu"):
        backend.submit(JobSpec(name="b", command=("x",), min_replicas=3, working_dir="."))
    with pytest.raises(BackendError, match="working directory '/nonexistent' does not exist"):
        backend.submit(JobSpec(name="c", command=("x",), working_dir="/nonexistent"))
    with pytest.raises(JobNotFoundError, match="no job named 'zzz'"):
        backend.delete("zzz")
    with pytest.raises(BackendError, match="exceeds 2 slots"):
        backend.set_allocation("a", ("local",) * 3)
    assert set(backend.jobs()) == {"a"}
    backend.shutdown(stop_jobs=False)


def test_delete_stops_a_running_job_and_forgets_it(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, slots=1, gpus=[], grace_period=5)
    sleeper = "import time; time.sleep(60)"
    backend.submit(JobSpec(name="s", command=("python", "-c", sleeper), working_dir="."))
    backend.set_allocation("s", ("local",))
    _run_until(backend, "s", {Phase.STARTING, Phase.RUNNING})
    pid = backend.store.get("s").replicas[0]["pid"]  # type: ignore[union-attr]
    backend.delete("s")
    assert backend.jobs()["s"].reason == "Deleting"
    _run_until(backend, "s", set())
    assert "s" not in backend.jobs()
    assert not (tmp_path / "jobs" / "s").exists()
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    backend.shutdown(stop_jobs=False)
