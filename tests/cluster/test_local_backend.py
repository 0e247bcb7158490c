"""The local backend on its own: GPU slots, submission checks, deletion."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from adaptdl.cluster import (
    BackendError,
    JobNotFoundError,
    JobSpec,
    JobSpecError,
    LocalBackend,
    Phase,
    detect_gpus,
)
from adaptdl.cluster._store import Store
from tests.cluster.conftest import LEAVER, WITH_WORKER, check_leftovers_ended, running

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


@pytest.mark.parametrize(
    ("gpus", "visible"),
    [([3, 5, 6], ("3", "5")), (["GPU-aaaa", "MIG-bbbb"], ("GPU-aaaa", "MIG-bbbb"))],
)
def test_each_replica_sees_one_gpu(
    tmp_path: Path, gpus: list[int | str], visible: tuple[str, str]
) -> None:
    backend = LocalBackend(tmp_path, gpus=gpus)
    assert backend.slot_resource() == "gpu"
    assert backend.nodes()["local"].resources == {"gpu": len(gpus)}
    backend.submit(JobSpec(name="g", command=("python", "-c", PRINT_ENV), working_dir="."))
    backend.set_allocation("g", ("local", "local"))
    _run_until(backend, "g", {Phase.SUCCEEDED, Phase.FAILED})
    assert backend.jobs()["g"].phase is Phase.SUCCEEDED
    logs = tmp_path / "jobs" / "g" / "logs"
    for rank, device in enumerate(visible):
        assert f"visible {device} rank {rank} of 2" in (logs / f"replica-{rank}.log").read_text()
    backend.shutdown(stop_jobs=False)


_MIG_LISTING = """\
GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d5ba0d6-aaaa)
  MIG 3g.20gb     Device  0: (UUID: MIG-11111111-aaaa)
  MIG 3g.20gb     Device  1: (UUID: MIG-22222222-aaaa)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-7e7ba0d6-bbbb)
"""


def test_detect_gpus_counts_uuids_and_mig_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for visible, expected in (
        ("GPU-aaaa,GPU-bbbb", ["GPU-aaaa", "GPU-bbbb"]),
        ("MIG-1111, MIG-2222", ["MIG-1111", "MIG-2222"]),
        ("MIG-GPU-aaaa/1/0", ["MIG-GPU-aaaa/1/0"]),  # the pre-R470 MIG form
        ("0,2", ["0", "2"]),
        ("1,-1,2", ["1"]),  # CUDA stops at the first invalid entry
        ("1,\u00b2,2", ["1"]),  # a superscript digit is not an index: no crash
        ("\u0661", []),  # nor an Arabic-Indic one
        ("", []),
    ):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert detect_gpus() == expected, visible
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\ncat <<'END'\n{_MIG_LISTING}END\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(tool.parent), os.environ["PATH"]]))
    # UUIDs, not nvidia-smi's PCI-order indices, which CUDA may number otherwise.
    assert detect_gpus() == ["MIG-11111111-aaaa", "MIG-22222222-aaaa", "GPU-7e7ba0d6-bbbb"]
    # A GPU in MIG mode with no instance is listed like a whole GPU; the MIG
    # mode query drops it (and a failing query drops nothing).
    modes = "GPU-5d5ba0d6-aaaa, Enabled\nGPU-7e7ba0d6-bbbb, {mode}\nGPU-9f, Enabled\n"
    query = (
        'if [ "$1" = "--query-gpu=uuid,mig.mode.current" ]; then\n'
        "cat <<END\n{modes}END\nexit {rc}\nfi\n"
    )
    for mode, rc, expected in (
        ("Enabled", 0, ["MIG-11111111-aaaa", "MIG-22222222-aaaa"]),
        ("Disabled", 0, ["MIG-11111111-aaaa", "MIG-22222222-aaaa", "GPU-7e7ba0d6-bbbb"]),
        ("[N/A]", 0, ["MIG-11111111-aaaa", "MIG-22222222-aaaa", "GPU-7e7ba0d6-bbbb"]),
        ("Enabled", 6, ["MIG-11111111-aaaa", "MIG-22222222-aaaa", "GPU-7e7ba0d6-bbbb"]),
    ):
        script = query.format(modes=modes.format(mode=mode), rc=rc)
        tool.write_text(f"#!/bin/sh\n{script}cat <<'END'\n{_MIG_LISTING}END\n")
        assert detect_gpus() == expected, (mode, rc)
    tool.write_text("#!/bin/sh\necho 'GPU 0: Some GPU'\necho 'GPU 1: Some GPU'\n")
    assert detect_gpus() == ["0", "1"]  # no UUID printed: the index
    # A container without nvidia-smi: the runtime's list gives the GPUs.
    monkeypatch.setenv("PATH", str(tmp_path))
    for visible, expected in (
        ("GPU-aaaa,GPU-bbbb", ["GPU-aaaa", "GPU-bbbb"]),
        ("2,3", ["0", "1"]),  # renumbered from 0 inside the container
        ("all", []),
        ("none", []),
    ):
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", visible)
        assert detect_gpus() == expected, visible


def test_bad_gpu_ids_are_rejected(tmp_path: Path) -> None:
    for bad, message in (
        ([-1], "gpus contains -1"),
        (["x"], "gpus contains 'x'"),
        ([1, "1"], "twice"),
        (["\u00b2"], "gpus contains '\u00b2': expected an index >= 0 \\(ASCII digits\\)"),
    ):
        with pytest.raises(ValueError, match=message):
            LocalBackend(tmp_path / "bad", gpus=bad)
    # More slots than GPUs used to be cut to the GPU count without a word.
    with pytest.raises(ValueError, match=r"slots=4: this machine has 2 GPUs \(0, 1\)"):
        LocalBackend(tmp_path / "few", slots=4, gpus=[0, 1])
    assert not (tmp_path / "few").exists()
    fewer = LocalBackend(tmp_path / "fewer", slots=1, gpus=[0, 1])
    assert fewer.nodes()["local"].resources == {"gpu": 1}
    fewer.close()


def test_a_command_must_be_on_the_replicas_path_at_submission(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "mytool").write_text("#!/bin/sh\necho ran\n")
    (tools / "mytool").chmod(0o755)
    backend = LocalBackend(tmp_path / "home", slots=1, gpus=[])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the daemon's environment
    spec = JobSpec(name="t", command=("mytool",), working_dir=str(tools))
    with pytest.raises(BackendError) as info:
        backend.submit(spec)
    assert str(info.value).startswith(
        "command 'mytool' of job 't' is not on the PATH of the cluster's replicas "
        "(/usr/bin:/bin): a command without a '/' is looked up there"
    )
    assert "write './mytool' to run the file there" in str(info.value)
    missing = JobSpec(name="t", command=("no-such-tool",), working_dir=str(tools))
    with pytest.raises(BackendError, match="'no-such-tool' of job 't' was not found on the PATH"):
        backend.submit(missing)
    assert backend.jobs() == {}
    # PATH in the job's env is the replicas' PATH; relative entries count from
    # the job's directory, where the replicas start.
    for path in (f"{tools}:/usr/bin:/bin", ".:/usr/bin:/bin"):
        name = f"t{len(backend.jobs())}"
        env = {"PATH": path}
        backend.submit(JobSpec(name=name, command=("mytool",), env=env, working_dir=str(tools)))
    backend.set_allocation("t0", ("local",))
    _run_until(backend, "t0", {Phase.SUCCEEDED, Phase.FAILED})
    assert backend.jobs()["t0"].phase is Phase.SUCCEEDED
    assert "ran" in (tmp_path / "home" / "jobs" / "t0" / "logs" / "replica-0.log").read_text()
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


def test_a_stored_unlaunchable_job_fails_alone(tmp_path: Path) -> None:
    """A job with a NUL byte stored by an older version fails; the others still run."""
    backend = LocalBackend(tmp_path, slots=2, gpus=[], warm_start=False)
    bad = JobSpec(name="bad", command=("python", "-c", "pass", "a\0b"), working_dir=".")
    with pytest.raises(BackendError, match=r"job 'bad': command\[3\]=.*contains a NUL byte"):
        backend.submit(bad)
    backend.submit(JobSpec(name="ok", command=("python", "-c", "pass"), working_dir="."))
    row = backend.store.get("ok")
    assert row is not None
    backend.store.insert(dataclasses.replace(row, name="bad", spec=bad.to_json()))
    assert set(backend.jobs()) == {"ok", "bad"}
    backend.set_allocation("bad", ("local",))
    backend.set_allocation("ok", ("local",))
    _run_until(backend, "bad", {Phase.FAILED, Phase.SUCCEEDED})
    _run_until(backend, "ok", {Phase.FAILED, Phase.SUCCEEDED})
    jobs = backend.jobs()
    assert (jobs["bad"].phase, jobs["bad"].reason) == (Phase.FAILED, "LaunchError")
    assert jobs["ok"].phase is Phase.SUCCEEDED
    backend.shutdown(stop_jobs=False)


def test_a_job_stored_by_a_version_that_checked_less_still_loads(tmp_path: Path) -> None:
    # Counts beyond 2**31-1 (maxRestarts: 10000000000, "retry for ever") and
    # boolean env values were accepted before; reading one back raised, and
    # every listing and scheduling round failed with it.
    backend = LocalBackend(tmp_path, slots=1, gpus=[], warm_start=False)
    backend.submit(JobSpec(name="ok", command=("python", "-c", "pass"), working_dir="."))
    row = backend.store.get("ok")
    assert row is not None
    old = {**row.spec, "maxReplicas": 2**40, "maxRestarts": 10**10, "env": {"FLAG": True}}
    backend.store.insert(dataclasses.replace(row, name="old", spec={**old, "name": "old"}))
    spec = backend.jobs()["old"].spec
    assert (spec.max_replicas, spec.max_restarts, spec.env) == (
        2**31 - 1,
        2**31 - 1,
        {"FLAG": "True"},
    )
    # The API still refuses such values where they come in.
    with pytest.raises(JobSpecError, match="maxReplicas=1099511627776"):
        JobSpec.from_json({**old, "env": {}})
    backend.shutdown(stop_jobs=False)


def test_any_launch_error_fails_the_job_instead_of_relaunching_it(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, slots=1, gpus=[], warm_start=False)
    backend.submit(JobSpec(name="l", command=("python", "-c", "pass"), working_dir="."))
    # A replica's log path that cannot be opened (here: a directory).
    (tmp_path / "jobs" / "l" / "logs" / "replica-0.log").mkdir(parents=True)
    backend.set_allocation("l", ("local",))
    _run_until(backend, "l", {Phase.FAILED, Phase.SUCCEEDED})
    job = backend.jobs()["l"]
    assert job.phase is Phase.FAILED
    assert job.reason == "LaunchError"
    assert "cannot start replica 0: [Errno 21] Is a directory" in (job.message or "")
    assert job.restarts == 0
    backend.shutdown(stop_jobs=False)


@pytest.mark.parametrize("max_restarts", [0, 2])
def test_a_shortage_of_descriptors_at_launch_counts_as_one_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_restarts: int
) -> None:
    # EMFILE at launch failed the job for good, whatever its maxRestarts.
    from adaptdl.cluster import _local

    real = subprocess.Popen
    calls = []

    def popen(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(*args, **kwargs)

    monkeypatch.setattr(_local.subprocess, "Popen", popen)
    backend = LocalBackend(tmp_path, slots=1, gpus=[], warm_start=False, restart_delay=0.1)
    spec = JobSpec(name="l", command=("python", "-c", "pass"), max_restarts=max_restarts)
    backend.submit(spec)
    backend.set_allocation("l", ("local",))
    _run_until(backend, "l", {Phase.FAILED, Phase.SUCCEEDED})
    job = backend.jobs()["l"]
    kinds = [(event.kind, event.message) for event in backend.events("l")]
    if max_restarts == 0:
        assert (job.phase, job.reason) == (Phase.FAILED, "LaunchError")
        assert "Too many open files; gave up after 1 failures (maxRestarts=0)" in kinds[-1][1]
    else:
        assert job.phase is Phase.SUCCEEDED, kinds
        assert any(
            kind == "Restarting" and "Too many open files" in text and "failure 1 of" in text
            for kind, text in kinds
        ), kinds
    backend.shutdown(stop_jobs=False)


def test_replicas_left_running_at_shutdown_are_reaped_when_they_end(tmp_path: Path) -> None:
    # shutdown(stop_jobs=False) dropped its shims unwaited: each stayed a
    # zombie of this process until the backend object was collected.
    backend = LocalBackend(tmp_path, slots=1, gpus=[], warm_start=False)
    code = "import time; time.sleep(1)"
    backend.submit(JobSpec(name="s", command=("python", "-c", code), working_dir="."))
    backend.set_allocation("s", ("local",))
    _run_until(backend, "s", {Phase.RUNNING})
    shims = list(backend._procs)
    assert shims
    backend.shutdown(stop_jobs=False)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in shims) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in shims)  # exited and reaped


def test_replicas_started_before_a_launch_error_are_reaped(tmp_path: Path) -> None:
    # Rank 0 started, rank 1 could not: rank 0 was killed but left a zombie.
    children_file = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    # Children of earlier tests may exit (and wait to be reaped) meanwhile:
    # only the ones this test starts count.
    earlier = set(children_file.read_text().split())
    backend = LocalBackend(tmp_path, slots=2, gpus=[], warm_start=False)
    code = "import time; time.sleep(60)"
    backend.submit(JobSpec(name="l", command=("python", "-c", code), working_dir="."))
    (tmp_path / "jobs" / "l" / "logs" / "replica-1.log").mkdir(parents=True)
    backend.set_allocation("l", ("local", "local"))
    _run_until(backend, "l", {Phase.FAILED, Phase.SUCCEEDED})
    assert backend.jobs()["l"].reason == "LaunchError"
    assert backend._procs == {}
    zombies = [
        pid
        for pid in set(children_file.read_text().split()) - earlier
        if (_replica_stat := Path(f"/proc/{pid}/stat")).exists()
        and _replica_stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    ]
    assert zombies == []
    backend.shutdown(stop_jobs=False)


@pytest.mark.parametrize(
    ("stop_reason", "kind", "phase"),
    [("shutdown", "Interrupted", Phase.PENDING), (None, "Failed", Phase.FAILED)],
)
def test_a_lost_exit_code_is_a_failure_only_if_the_cluster_did_not_kill_it(
    tmp_path: Path, stop_reason: str | None, kind: str, phase: Phase
) -> None:
    # A replica adopted after a daemon restart is not the daemon's child: when
    # the cluster SIGKILLs it at the end of the grace period its code is lost.
    from adaptdl.cluster._local import EXIT_LOST

    backend = LocalBackend(tmp_path, slots=1, gpus=[])
    backend.submit(JobSpec(name="a", command=("python",), working_dir=".", max_restarts=0))
    backend.store.update("a", stop_reason=stop_reason)
    row = backend.store.get("a")
    assert row is not None
    events = backend._finish_group(row, [EXIT_LOST], time.time())
    assert events[-1].kind == kind
    assert backend.jobs()["a"].phase is phase
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


def test_a_grace_period_is_kept_when_the_wall_clock_steps_back(tmp_path: Path) -> None:
    # The grace period compared wall-clock times: with the clock stepped
    # back an hour, a replica ignoring SIGTERM kept its slot for that hour.
    backend = LocalBackend(tmp_path, slots=1, gpus=[], grace_period=1)
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    backend.submit(JobSpec(name="s", command=("python", "-c", stubborn), working_dir="."))
    backend.set_allocation("s", ("local",))
    _run_until(backend, "s", {Phase.RUNNING})
    log = tmp_path / "jobs" / "s" / "logs" / "replica-0.log"
    deadline = time.monotonic() + 20
    while "ready" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "the replica did not start"
        time.sleep(0.05)
    backend.delete("s")
    started = time.monotonic()
    while "s" in backend.jobs():
        assert time.monotonic() - started < 25, "the grace period did not end"
        backend.reconcile(time.time() - 3600)  # the wall clock, an hour behind
        time.sleep(0.05)
    backend.shutdown(stop_jobs=False)


@pytest.mark.parametrize("delete", [False, True], ids=["finished", "deleted"])
def test_processes_a_replica_leaves_behind_end_with_it(tmp_path: Path, delete: bool) -> None:
    """Leftovers in the replica's session get SIGTERM, then SIGKILL after the grace period."""
    (tmp_path / "leaver.py").write_text(LEAVER)
    backend = LocalBackend(tmp_path / "home", slots=1, gpus=[], grace_period=2)
    args = ("wait",) if delete else ()
    backend.submit(
        JobSpec(name="l", command=("python", "leaver.py"), args=args, working_dir=str(tmp_path))
    )
    backend.set_allocation("l", ("local",))
    pids = backend.job_dir("l") / "share" / "pids.json"
    deadline = time.monotonic() + 30
    while not pids.exists() and time.monotonic() < deadline:
        backend.reconcile(time.time())
        time.sleep(0.05)
    saved = pids.read_bytes()  # deleting the job removes its directory
    if delete:
        backend.delete("l")
        _run_until(backend, "l", set())
        assert "l" not in backend.jobs()
    else:
        _run_until(backend, "l", {Phase.SUCCEEDED, Phase.FAILED})
        assert backend.jobs()["l"].phase is Phase.SUCCEEDED
    (tmp_path / "pids.json").write_bytes(saved)
    check_leftovers_ended(tmp_path)
    backend.shutdown(stop_jobs=False)


def test_a_deleted_jobs_name_is_refused_until_it_is_gone_then_starts_fresh(
    tmp_path: Path,
) -> None:
    backend = LocalBackend(tmp_path, slots=1, gpus=[], grace_period=5)
    spec = JobSpec(name="s", command=("python", "-c", "import time; time.sleep(60)"))
    backend.submit(spec)
    with pytest.raises(BackendError, match=r"a job named 's' already exists \(Pending\)"):
        backend.submit(spec)
    backend.set_allocation("s", ("local",))
    _run_until(backend, "s", {Phase.STARTING, Phase.RUNNING})
    (tmp_path / "jobs" / "s" / "checkpoint" / "state").write_text("old")
    backend.delete("s")
    with pytest.raises(BackendError, match="job 's' is still being deleted") as info:
        backend.submit(spec)
    assert "already exists" not in str(info.value)
    _run_until(backend, "s", set())
    assert backend.submit(spec).phase is Phase.PENDING
    assert not (tmp_path / "jobs" / "s" / "checkpoint" / "state").exists()
    assert [event.kind for event in backend.events("s")] == ["Submitted"]
    backend.shutdown(stop_jobs=False)


#: A replica that says "ready" once its SIGTERM handler is in place, and on
#: SIGTERM saves a marker after ``SAVE_SECONDS`` and exits with 143.
_CHECKPOINTER = """
import os, signal, sys, time
delay = float(sys.argv[1])
marker = os.path.join(os.environ["ADAPTDL_CHECKPOINT_PATH"], "saved")
def on_term(signum, frame):
    time.sleep(delay)
    open(marker, "w").write("x")
    print("checkpointed", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
print("resumed" if os.path.exists(marker) else "fresh", "ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _ready(backend: LocalBackend, name: str, times: int = 1) -> bool:
    log = backend.job_dir(name) / "logs" / "replica-0.log"
    return log.exists() and log.read_text().count(" ready") >= times


def test_shutdown_drains_jobs_without_restarting_them(tmp_path: Path) -> None:
    """A job that checkpoints first is not restarted while another still saves."""
    script = tmp_path / "checkpointer.py"
    script.write_text(_CHECKPOINTER)
    home = tmp_path / "home"
    backend = LocalBackend(home, slots=2, gpus=[], grace_period=10)
    try:
        for name, delay in (("fast", "0"), ("slow", "1.5")):
            backend.submit(
                JobSpec(name=name, command=("python", str(script)), args=(delay,), working_dir=".")
            )
            backend.set_allocation(name, ("local",))
        deadline = time.monotonic() + 20
        while not (_ready(backend, "fast") and _ready(backend, "slow")):
            assert time.monotonic() < deadline, "replicas did not start"
            backend.reconcile(time.time())
            time.sleep(0.05)
        rows = {name: backend.store.get(name) for name in ("fast", "slow")}
        pids = [int(r["pid"]) for row in rows.values() if row for r in row.replicas]
        started = time.monotonic()
        backend.shutdown(stop_jobs=True, timeout=30.0)
        assert time.monotonic() - started < 25.0, "shutdown ran to its timeout"
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()

        # Nothing was restarted, and both jobs resume from their checkpoints.
        again = LocalBackend(home, slots=2, gpus=[], grace_period=10)
        for name, row in rows.items():
            assert row is not None
            stored = again.store.get(name)
            assert stored is not None and stored.grp == row.grp, name
            assert stored.phase == Phase.PENDING.value and stored.replicas == []
            assert (again.job_dir(name) / "checkpoint" / "saved").exists()
        deadline = time.monotonic() + 20
        while not (_ready(again, "fast", 2) and _ready(again, "slow", 2)):
            assert time.monotonic() < deadline, "jobs did not resume"
            again.reconcile(time.time())
            time.sleep(0.05)
        for name in rows:
            log = (again.job_dir(name) / "logs" / "replica-0.log").read_text()
            assert log.count("restart group") == 2 and "resumed ready" in log, name
        again.shutdown(stop_jobs=True, timeout=8.0)
    finally:  # a failing run must not leave replicas behind
        _kill_replicas(home)


def _kill_replicas(home: Path) -> None:
    store = Store(home / "state.db")
    try:
        for row in store.all():
            for replica in row.replicas:
                with contextlib.suppress(OSError):
                    os.killpg(int(replica["pid"]), signal.SIGKILL)
    finally:
        store.close()


def test_unrequested_checkpoint_exit_restarts_after_the_delay(tmp_path: Path) -> None:
    # Exit 143 means "checkpointed, restart me"; when the daemon did not ask
    # for it, the restart waits restart_delay, so such a job cannot spin.
    backend = LocalBackend(tmp_path, slots=2, gpus=[], restart_delay=1.0)
    command = ("python", "-c", "import sys; sys.exit(143)")
    backend.submit(JobSpec(name="e", command=command, working_dir="."))

    def checkpointed() -> list[Any]:
        return [e for e in backend.events("e") if e.kind == "Checkpointed"]

    # Count the exits in the 2 s after the first (a loaded machine starts slowly).
    deadline, window = time.monotonic() + 30.0, None
    while time.monotonic() < (deadline if window is None else window):
        if not backend.jobs()["e"].allocation:
            backend.set_allocation("e", ("local",))
        backend.reconcile(time.time())
        if window is None and checkpointed():
            window = time.monotonic() + 2.0
        time.sleep(0.05)
    events = checkpointed()
    assert 1 <= len(events) <= 3, [e.message for e in events]  # at once, it was dozens
    assert "without being asked to; restarting in 1s" in events[0].message
    if len(events) > 1:  # each one within the window doubles the delay
        assert "without being asked to; restarting in 2s" in events[1].message
    assert backend.jobs()["e"].failures == 0
    # Ten in the last ten minutes: capped at five minutes; old ones do not count.
    now = time.time()
    for age in [*range(10), 700]:
        backend.store.add_event("e", "Checkpointed", "x without being asked to; y", now - age)
    assert backend._unasked_delay("e", now) == 300.0
    assert backend._unasked_delay("e", now + 601) == 1.0
    backend.shutdown(stop_jobs=False)


def test_an_unasked_checkpoint_exit_of_a_non_preemptible_job_is_a_failure(
    tmp_path: Path,
) -> None:
    # It restarted forever with a growing back-off; the original counts a 143
    # exit of a job that may not be preempted as a pod failure.
    backend = LocalBackend(tmp_path, slots=2, gpus=[], restart_delay=0.1)
    command = ("python", "-c", "import sys; sys.exit(143)")
    spec = JobSpec(name="np", command=command, working_dir=".", preemptible=False, max_restarts=1)
    backend.submit(spec)
    deadline = time.monotonic() + 60.0
    while backend.jobs()["np"].phase is not Phase.FAILED:
        assert time.monotonic() < deadline, [e.message for e in backend.events("np")]
        if not backend.jobs()["np"].allocation:
            backend.set_allocation("np", ("local",))
        backend.reconcile(time.time())
        time.sleep(0.05)
    status = backend.jobs()["np"]
    assert status.failures == 2
    message = status.message or ""
    assert "a replica exited to be restarted (code 143, or SIGTERM) without the daemon" in message
    assert "not preemptible" in message and "exit codes by rank: [143]" in message
    assert not [e for e in backend.events("np") if e.kind == "Checkpointed"]
    backend.shutdown(stop_jobs=False)


def test_a_held_back_restart_is_shown_as_such(tmp_path: Path) -> None:
    # describe said "allocated; starting" for up to five minutes of back-off.
    from adaptdl.cluster import waiting_reason

    backend = LocalBackend(tmp_path, slots=2, gpus=[], restart_delay=60.0)
    command = ("python", "-c", "import sys; sys.exit(143)")
    backend.submit(JobSpec(name="e", command=command, working_dir="."))
    backend.set_allocation("e", ("local",))
    assert backend.jobs()["e"].not_before is None
    deadline = time.monotonic() + 30.0
    while not any(e.kind == "Checkpointed" for e in backend.events("e")):
        assert time.monotonic() < deadline, "the replica did not exit"
        backend.reconcile(time.time())
        time.sleep(0.05)
    status = backend.jobs()["e"]
    assert status.phase is Phase.PENDING and status.not_before is not None
    assert 50 < status.not_before - time.time() <= 60
    assert status.to_json()["notBefore"] == status.not_before
    reason = waiting_reason(status, backend.jobs(), 2)
    assert reason is not None and reason.startswith("allocated; restarts in ")
    assert "restart back-off" in reason
    backend.shutdown(stop_jobs=False)


def test_a_restart_header_starts_its_own_line(tmp_path: Path) -> None:
    # After a progress bar cut off mid-line, the header was glued to it and
    # the demo's header pattern (anchored at the line start) missed it.
    backend = LocalBackend(tmp_path, slots=1, gpus=[])
    for ending in ("epoch 3: 50%|#####     | loss 0.5", "done\n", ""):
        log = backend._log_path("j", 0)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(ending)
        backend._open_log("j", 0, 1, 1).close()
        lines = log.read_text().splitlines()
        assert lines[-1].startswith("===== adaptdl: restart group 1, replica 0 of 1"), lines
        assert log.read_text().startswith(ending)
        assert len(lines) == (2 if ending else 1)
    backend.close()


def _wait_warm_launch(backend: LocalBackend, name: str, pids: Path) -> None:
    deadline = time.monotonic() + 60
    while not pids.exists():
        assert time.monotonic() < deadline, "the replica did not start"
        backend.reconcile(time.time())
        time.sleep(0.05)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_processes_of_a_replica_whose_shim_was_killed_are_stopped(
    tmp_path: Path, warm: bool
) -> None:
    # The shim alone was killed: its replica's processes ran on beside the
    # relaunched group, and the event blamed a SIGKILL of the replica.
    (tmp_path / "leaver.py").write_text(LEAVER)
    backend = LocalBackend(
        tmp_path / "home", slots=1, gpus=[], grace_period=2, warm_start=warm, restart_delay=60
    )
    try:
        if warm:
            backend.reconcile(time.time())
            assert backend.wait_warm(60)
        backend.submit(
            JobSpec(
                name="o", command=("python", "leaver.py"), args=("wait",), working_dir=str(tmp_path)
            )
        )
        backend.set_allocation("o", ("local",))
        pids = backend.job_dir("o") / "share" / "pids.json"
        _wait_warm_launch(backend, "o", pids)
        saved = pids.read_bytes()
        shim = int(backend.store.get("o").replicas[0]["pid"])  # type: ignore[union-attr]
        os.kill(shim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while backend.jobs()["o"].phase is not Phase.PENDING:
            assert time.monotonic() < deadline, [e.message for e in backend.events("o")]
            backend.reconcile(time.time())
            time.sleep(0.05)
        messages = [event.message for event in backend.events("o")]
        assert any(
            f"replica 0's shim (pid {shim}) died and left" in message for message in messages
        ), messages
        (tmp_path / "pids.json").write_bytes(saved)
        check_leftovers_ended(tmp_path)  # the replica itself is gone too
        assert not _replica_processes(shim)
    finally:
        backend.shutdown(stop_jobs=False)


def _replica_processes(leader: int) -> list[int]:
    from adaptdl.cluster._replica import leftovers

    return leftovers(leader)


@pytest.mark.parametrize(
    ("launched", "late", "stubborn"),
    [(2, False, False), (2, True, False), (2, True, True), (3, False, False)],
    ids=["interrupted", "late", "late-stubborn", "complete"],
)
def test_a_shim_the_last_daemon_launched_but_never_recorded_is_adopted(
    tmp_path: Path, launched: int, late: bool, stubborn: bool
) -> None:
    # A daemon killed between starting a shim and recording its pid left
    # that replica running for good beside the relaunched group. Now the
    # next daemon finds it by its pid file: an interrupted launch is stopped
    # whole and launched again, a complete one runs on. A late one found
    # after the others were SIGKILLed gets its own grace period and SIGKILL.
    ignore = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if stubborn else ""
    (tmp_path / "sleep.py").write_text(f"{ignore}import time\ntime.sleep(120)\n")
    home = tmp_path / "home"
    backend = LocalBackend(home, slots=3, gpus=[], grace_period=2)
    backend.submit(
        JobSpec(
            name="u",
            command=("python", "sleep.py"),
            working_dir=str(tmp_path),
            min_replicas=3,
            max_replicas=3,
        )
    )
    backend.set_allocation("u", ("local",) * 3)
    backend.reconcile(time.time())
    row = backend.store.get("u")
    assert row is not None and len(row.replicas) == 3
    run = backend.job_dir("u") / "run"
    deadline = time.monotonic() + 30
    while not all((run / f"g0-r{rank}.shim.pid").exists() for rank in range(3)):
        assert time.monotonic() < deadline, "the shims wrote no pid files"
        time.sleep(0.05)
    pids = [int(replica["pid"]) for replica in row.replicas]
    if launched == 2:  # rank 2 never started
        os.killpg(pids[2], signal.SIGKILL)
        (run / "g0-r2.shim.pid").unlink()
    # The store as the daemon left it: only rank 0 recorded.
    backend.store.update("u", replicas=row.replicas[:1])
    backend._procs.clear()  # a new daemon is not the shims' parent
    backend.close()
    pid_file = run / "g0-r1.shim.pid"
    written = pid_file.read_bytes()
    if late:  # rank 1's shim writes its pid file only after the next daemon recovered
        pid_file.unlink()

    restarted = LocalBackend(home, slots=3, gpus=[], grace_period=2)
    try:
        messages = [event.message for event in restarted.events("u")]
        alive = 1 if late else launched
        assert f"daemon restarted: {alive} of 3 replicas of restart group 0 still alive" in messages
        if late:
            pid_file.write_bytes(written)
        if launched == 3:
            restarted.reconcile(time.time())
            group = restarted.store.get("u")
            assert group is not None and group.grp == 0
            assert [int(replica["pid"]) for replica in group.replicas] == pids
            return
        deadline = time.monotonic() + 30
        while running(pids[1]) or not any(
            "restart group 1" in event.message for event in restarted.events("u")
        ):
            assert time.monotonic() < deadline, [e.message for e in restarted.events("u")]
            restarted.reconcile(time.time())
            time.sleep(0.05)
        group = restarted.store.get("u")
        assert group is not None and group.grp == 1 and len(group.replicas) == 3
    finally:
        restarted.shutdown(stop_jobs=True, timeout=10)
        # A shim records its replica's exit, then exits itself: a moment later.
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in pids):
            assert time.monotonic() < deadline, [pid for pid in pids if running(pid)]
            time.sleep(0.05)


def test_a_job_that_ended_while_no_daemon_ran_completes_when_it_ended(tmp_path: Path) -> None:
    # Its completion was the next daemon's start, so DURATION counted the downtime.
    (tmp_path / "quick.py").write_text("pass\n")
    home = tmp_path / "home"
    backend = LocalBackend(home, slots=1, gpus=[])
    backend.submit(JobSpec(name="q", command=("python", "quick.py"), working_dir=str(tmp_path)))
    backend.set_allocation("q", ("local",))
    backend.reconcile(time.time())
    exit_file = backend.job_dir("q") / "run" / "g0-r0.exit"
    deadline = time.monotonic() + 30
    while not exit_file.exists():
        assert time.monotonic() < deadline, "the replica did not end"
        time.sleep(0.05)
    backend._procs.clear()  # the daemon dies without noticing
    backend.close()
    time.sleep(2.5)
    restarted = LocalBackend(home, slots=1, gpus=[])
    try:
        restarted.reconcile(time.time())
        status = restarted.jobs()["q"]
        assert status.phase is Phase.SUCCEEDED
        row = restarted.store.get("q")
        assert row is not None and row.completed == exit_file.stat().st_mtime
        assert time.time() - row.completed > 2
    finally:
        restarted.shutdown(stop_jobs=False)


def test_only_a_shim_that_did_not_end_its_session_orphans_what_is_left(tmp_path: Path) -> None:
    # A shim that gave up on unkillable leftovers wrote its code itself: the
    # replica ended (no "shim died" failure). One the zygote recorded as
    # killed, or one with no exit file, left its processes unattended.
    backend = LocalBackend(tmp_path / "home", slots=1, gpus=[])
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "time.sleep(0.5)"
    )
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    leader.wait(30)  # the session leader is gone, its child lives on
    try:
        backend.submit(JobSpec(name="s", command=("python", "x.py"), working_dir=str(tmp_path)))
        row = dataclasses.replace(
            backend.store.get("s"),  # type: ignore[arg-type]
            grp=0,
            replicas=[{"rank": 0, "pid": leader.pid, "start": None}],
        )
        run = backend.job_dir("s") / "run"
        run.mkdir(parents=True, exist_ok=True)
        assert backend._exit_codes(row) == ([None], [(0, 1)])  # no exit file
        (run / "g0-r0.exit").write_text("-9")
        assert backend._exit_codes(row) == ([-9], [])  # the shim's own record
        (run / "g0-r0.shim-killed").touch()
        assert backend._exit_codes(row) == ([None], [(0, 1)])  # the zygote's record
    finally:
        from adaptdl.cluster._replica import leftovers

        for pid in leftovers(leader.pid):
            os.kill(pid, signal.SIGKILL)
        backend.shutdown(stop_jobs=False)


_GROUP_LEAVER = """
import pathlib, signal, subprocess, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
helper = subprocess.Popen(["sleep", "1000"], process_group=0)
pathlib.Path("helper.pid").write_text(str(helper.pid))
time.sleep(1000)
"""


def test_a_helper_in_a_process_group_of_its_own_ends_with_a_killed_replica(
    tmp_path: Path,
) -> None:
    # SIGKILL went to the shim's process group only; a helper that had left
    # it (same session) ran on after delete, holding its GPU.
    (tmp_path / "leaver.py").write_text(_GROUP_LEAVER)
    backend = LocalBackend(tmp_path / "home", slots=1, gpus=[], grace_period=1)
    helper = 0
    try:
        spec = JobSpec(name="g", command=("python", "leaver.py"), working_dir=str(tmp_path))
        backend.submit(spec)
        backend.set_allocation("g", ("local",))
        pid_file = tmp_path / "helper.pid"
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the replica did not start its helper"
            backend.reconcile(time.time())
            time.sleep(0.05)
        helper = int(pid_file.read_text())
        assert running(helper)
        backend.delete("g")
        _run_until(backend, "g", set(), timeout=30)
        assert "g" not in backend.jobs()
        deadline = time.monotonic() + 5
        while running(helper):
            assert time.monotonic() < deadline, "the helper outlived its replica"
            time.sleep(0.05)
    finally:
        backend.shutdown(stop_jobs=True, timeout=10)
        if helper and running(helper):
            os.kill(helper, signal.SIGKILL)


def test_a_job_marked_deleted_but_still_running_is_stopped(tmp_path: Path) -> None:
    # delete() marks the row, then begins the stop: a daemon that died in
    # between left the job running for good, and deleting again did nothing.
    backend = LocalBackend(tmp_path / "home", slots=1, gpus=[], grace_period=5)
    try:
        spec = JobSpec(
            name="d", command=("python", "-c", "import time; time.sleep(60)"), working_dir="."
        )
        backend.submit(spec)
        backend.set_allocation("d", ("local",))
        _run_until(backend, "d", {Phase.STARTING, Phase.RUNNING})
        backend.store.update("d", deleted=1)  # the first half of delete()
        backend.delete("d")  # again: it used to return at once
        assert backend.jobs()["d"].phase is Phase.STOPPING
        _run_until(backend, "d", set(), timeout=30)
        assert "d" not in backend.jobs()
        backend.submit(spec)  # and the name is free again
        backend.store.update("d", deleted=1)
        backend.set_allocation("d", ("local",))
        _run_until(backend, "d", set(), timeout=30)
        assert "d" not in backend.jobs()
    finally:
        backend.shutdown(stop_jobs=True, timeout=10)


def test_a_deleted_jobs_files_are_removed_outside_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rmtree ran under the backend's lock: a large checkpoint held every
    # request (submit, hints, discovery) for seconds.
    import shutil
    import threading

    backend = LocalBackend(tmp_path / "home", slots=1, gpus=[])
    removed_by: list[str] = []
    real_rmtree = shutil.rmtree

    def recording_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        removed_by.append(threading.current_thread().name)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", recording_rmtree)
    try:
        backend.submit(JobSpec(name="big", command=("python", "-c", "pass"), working_dir="."))
        checkpoint = backend.job_dir("big") / "checkpoint"
        for index in range(200):
            (checkpoint / f"shard-{index}").write_bytes(b"x" * 100)
        with backend._lock:  # held, as every request holds it
            backend.delete("big")  # not started: forgotten at once
            assert not backend.job_dir("big").exists()
            trash = backend.home / "trash"
            deadline = time.monotonic() + 10
            while any(trash.iterdir()):
                assert time.monotonic() < deadline, "the discarded directory was not deleted"
                time.sleep(0.05)
        # Deleted while the lock was held elsewhere: by another thread.
        assert removed_by == ["adaptdl-discard"]
        # A directory left half-deleted by an earlier daemon is removed at start.
        (trash / "old-1234" / "checkpoint").mkdir(parents=True)
    finally:
        backend.shutdown(stop_jobs=False)
    again = LocalBackend(tmp_path / "home", slots=1, gpus=[])
    try:
        deadline = time.monotonic() + 10
        while (again.home / "trash" / "old-1234").exists():
            assert time.monotonic() < deadline, "the leftover was not deleted"
            time.sleep(0.05)
    finally:
        again.shutdown(stop_jobs=False)


def test_a_stop_signals_the_replica_not_its_workers(tmp_path: Path) -> None:
    # SIGTERM went to the whole process group: PyTorch's loader workers died
    # of it, and the replica crashed (exit 1) before it could checkpoint.
    backend = LocalBackend(tmp_path, slots=2, gpus=[], grace_period=10)
    backend.submit(JobSpec(name="w", command=("python", "-c", WITH_WORKER), working_dir="."))
    backend.set_allocation("w", ("local",))
    log = tmp_path / "jobs" / "w" / "logs" / "replica-0.log"
    deadline = time.monotonic() + 30
    while "waiting" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "the replica did not start"
        backend.reconcile(time.time())
        time.sleep(0.05)
    backend.set_allocation("w", ("local", "local"))  # a rescale: checkpoint and restart
    share = tmp_path / "jobs" / "w" / "share"
    deadline = time.monotonic() + 30
    while not ((share / "worker-termed").exists() and (share / "worker-at-stop").exists()):
        assert time.monotonic() < deadline, "the stop did not end the replica's worker"
        backend.reconcile(time.time())
        time.sleep(0.05)
    # The worker outlived the stop request; the shim ended it after the
    # replica exited, as it ends whatever a replica leaves behind.
    assert (share / "worker-at-stop").read_text() == "alive"
    deadline = time.monotonic() + 30
    while not any(e.kind == "Checkpointed" for e in backend.events("w")):
        assert time.monotonic() < deadline, [e.message for e in backend.events("w")]
        backend.reconcile(time.time())
        time.sleep(0.05)
    assert backend.jobs()["w"].failures == 0
    backend.delete("w")
    _run_until(backend, "w", set())
    backend.shutdown(stop_jobs=False)
