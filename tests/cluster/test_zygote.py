"""Warm start: replicas forked from the pre-warmed zygote behave like cold ones."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptdl.cluster import JobSpec, LocalBackend, Phase, parse_preload
from adaptdl.cluster._daemon import build_parser
from adaptdl.cluster._zygote import startup_env_differs
from tests.cluster.conftest import (
    LEAVER,
    WITH_WORKER,
    check_leftovers_ended,
    children,
    counter_spec,
    log_steps,
    start_test_daemon,
    wait_for,
)

#: Reports how it was started, then behaves as its first argument says.
SCRIPT = """
import json, os, random, signal, sys, time
warm = "torch" in sys.modules  # only a zygote's fork has torch before importing it
import numpy, torch
report = {
    "warm": warm,
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "name": __name__,
    "path0": sys.path[0],
    "path_rest": sys.path[1:],
    "rank": os.environ["ADAPTDL_REPLICA_RANK"],
    "extra": os.environ.get("EXTRA"),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "session_leader": os.getsid(0),
    "random": random.random(),
    "numpy": float(numpy.random.rand()),
    "torch_seed": torch.initial_seed(),
    "threads": torch.get_num_threads(),
}
print("REPORT " + json.dumps(report), flush=True)
mode = sys.argv[1]
if mode == "fail":
    raise RuntimeError("failing on purpose")
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "term":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
if mode in ("term", "hang"):
    print("waiting", flush=True)
    time.sleep(120)
"""


def _until(backend: LocalBackend, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        backend.reconcile(time.time())
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("work")
    (path / "probe.py").write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    """One warm backend for the module: each zygote imports torch (seconds of CPU)."""
    backend = LocalBackend(
        tmp_path_factory.mktemp("home"), slots=4, gpus=[], grace_period=10, warm_start=True
    )
    backend.restart_delay = 0.1
    assert backend.wait_warm(120), (backend.home / "zygote.log").read_text()
    yield backend
    for name in list(backend.jobs()):
        backend.delete(name)
    backend.shutdown(stop_jobs=True, timeout=20)


def _submit(backend: LocalBackend, workdir: Path, name: str, *args: str, **fields: Any) -> None:
    spec = JobSpec(
        name=name,
        command=("python", "probe.py"),
        args=args,
        working_dir=str(workdir),
        **fields,
    )
    backend.submit(spec)
    backend.set_allocation(name, ("local",) * int(fields.get("min_replicas", 1)))


def _log(backend: LocalBackend, name: str, rank: int = 0) -> str:
    path = backend.job_dir(name) / "logs" / f"replica-{rank}.log"
    return path.read_text() if path.exists() else ""


def _reports(backend: LocalBackend, name: str, rank: int = 0) -> list[dict[str, Any]]:
    return [
        json.loads(line.split(" ", 1)[1])
        for line in _log(backend, name, rank).splitlines()
        if line.startswith("REPORT ")
    ]


def _finished(backend: LocalBackend, name: str) -> bool:
    return backend.jobs()[name].phase in (Phase.SUCCEEDED, Phase.FAILED)


def _exit_code(backend: LocalBackend, name: str, group: int = 0, rank: int = 0) -> int | None:
    path = backend.job_dir(name) / "run" / f"g{group}-r{rank}.exit"
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_warm_replicas_get_env_argv_cwd_log_and_fresh_rng(
    warm: LocalBackend, workdir: Path
) -> None:
    _submit(warm, workdir, "ok", "ok", "x y", min_replicas=2, env={"EXTRA": "yes"})
    _until(warm, lambda: _finished(warm, "ok"), 60, "job ok to finish")
    assert warm.jobs()["ok"].phase is Phase.SUCCEEDED
    fresh_path = json.loads(
        subprocess.run(
            [warm.python, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    )
    (first,) = _reports(warm, "ok", 0)
    (second,) = _reports(warm, "ok", 1)
    pid = None
    for rank, report in enumerate((first, second)):
        assert report["warm"] is True, "replica was not forked from the zygote"
        assert report["argv"] == ["probe.py", "ok", "x y"]
        assert report["cwd"] == str(workdir)
        assert report["name"] == "__main__"
        assert report["path0"] == str(workdir)
        assert report["path_rest"] == fresh_path  # the interpreter's own entries, all there
        assert report["rank"] == str(rank)
        assert report["extra"] == "yes"
        assert report["sigterm_default"] and report["sigint_default"]
        # OMP_NUM_THREADS (1 for a CPU slot) is applied again after the fork.
        assert report["threads"] == int(os.environ.get("OMP_NUM_THREADS", "1"))
        assert report["session_leader"] != pid
        pid = report["session_leader"]
    assert _log(warm, "ok", 0).startswith("===== adaptdl: restart group 0, replica 0 of 2")
    # Forked replicas must not share the zygote's random state.
    for key in ("random", "numpy", "torch_seed"):
        assert first[key] != second[key], key
    assert _exit_code(warm, "ok", rank=0) == 0 and _exit_code(warm, "ok", rank=1) == 0


#: Checks what a warm replica inherits from the zygote's own start.
SPAWNER = """
import json, multiprocessing, os, sys, tempfile, time
warm = "torch" in sys.modules


def double(x):
    return 2 * x


if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        doubled = pool.map(double, [1, 2])
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().decode()
    report = {
        "warm": warm,
        "file": __file__,
        "doubled": doubled,
        "tmp": tempfile.gettempdir(),
        "tzname": list(time.tzname),
        "cmdline": cmdline,
    }
    print("REPORT " + json.dumps(report), flush=True)
"""


def test_a_warm_replica_is_started_like_a_cold_one(
    warm: LocalBackend, workdir: Path, tmp_path: Path
) -> None:
    # With a relative script, __file__ stayed relative and multiprocessing
    # resolved it against the zygote's directory: every spawned worker
    # failed (FileNotFoundError) and the pool respawned them forever. TZ
    # and TMPDIR kept the zygote's values.
    (workdir / "spawner.py").write_text(SPAWNER)
    (tmp_path / "tmp").mkdir()
    spec = JobSpec(
        name="spawner",
        command=("python", "spawner.py"),
        working_dir=str(workdir),
        env={"TMPDIR": str(tmp_path / "tmp"), "TZ": "JST-9"},
    )
    warm.submit(spec)
    warm.set_allocation("spawner", ("local",))
    _until(warm, lambda: _finished(warm, "spawner"), 60, "job spawner to finish")
    assert warm.jobs()["spawner"].phase is Phase.SUCCEEDED, _log(warm, "spawner")
    (report,) = _reports(warm, "spawner")
    assert report["warm"] is True
    assert report["file"] == str(workdir / "spawner.py")
    assert report["doubled"] == [2, 4]
    assert report["tmp"] == str(tmp_path / "tmp")
    assert report["tzname"] == ["JST", "JST"]
    # ps and clean-up scripts find a warm replica's cluster by its command line.
    assert f"--cluster\0{warm.home}" in report["cmdline"]


def test_failure_exit_code_and_traceback(warm: LocalBackend, workdir: Path) -> None:
    _submit(warm, workdir, "crash", "fail", max_restarts=0)
    _until(warm, lambda: _finished(warm, "crash"), 60, "job crash to fail")
    job = warm.jobs()["crash"]
    assert job.phase is Phase.FAILED
    assert _exit_code(warm, "crash") == 1
    assert job.message is not None
    assert job.message.startswith("replica 0 exited with code 1")
    assert "RuntimeError: failing on purpose" in job.message
    # The traceback starts in the user's script, not in the launcher.
    traceback = job.message.split("Traceback (most recent call last):", 1)[1]
    assert "probe.py" in traceback.splitlines()[1]
    assert "_zygote" not in traceback


def test_scripts_that_move_fail_to_compile_or_are_archives_run_as_cold_ones(
    warm: LocalBackend, tmp_path: Path
) -> None:
    import zipapp

    work = tmp_path / "scripts"
    (work / "app").mkdir(parents=True)
    (work / "app" / "__main__.py").write_text("import sys; print('ZIP', 'torch' in sys.modules)\n")
    zipapp.create_archive(work / "app", work / "app.pyz")
    (work / "moves.py").write_text("import os\nos.chdir('/')\nraise RuntimeError('moved')\n")
    (work / "broken.py").write_text("x = (\n")
    for name, script in (("zip", "app.pyz"), ("moves", "moves.py"), ("broken", "broken.py")):
        spec = JobSpec(name=name, command=("python", script), working_dir=str(work), max_restarts=0)
        warm.submit(spec)
        warm.set_allocation(name, ("local",))
    for name in ("zip", "moves", "broken"):
        _until(warm, lambda name=name: _finished(warm, name), 60, f"job {name} to end")
    # A zip archive was compiled as source ("null bytes") instead of run.
    assert warm.jobs()["zip"].phase is Phase.SUCCEEDED, _log(warm, "zip")
    assert "ZIP True" in _log(warm, "zip")  # warm, all the same
    # The launcher's frames were kept once the script had changed directory.
    moved = _log(warm, "moves").split("Traceback (most recent call last):", 1)[1]
    assert str(work / "moves.py") in moved.splitlines()[1]
    assert "_zygote" not in moved and "RuntimeError: moved" in moved
    # As Python prints it: where, and what, with no launcher traceback.
    broken = _log(warm, "broken")
    assert f'File "{work / "broken.py"}", line 1' in broken and "SyntaxError" in broken
    assert "Traceback" not in broken and "_zygote" not in broken


def test_sys_exit_code_is_recorded(warm: LocalBackend, workdir: Path) -> None:
    _submit(warm, workdir, "exit3", "exit", "3", max_restarts=0)
    _until(warm, lambda: _finished(warm, "exit3"), 60, "job exit3 to fail")
    assert _exit_code(warm, "exit3") == 3
    assert (warm.jobs()["exit3"].message or "").startswith("replica 0 exited with code 3")


def test_sigterm_handled_by_script_records_143(warm: LocalBackend, workdir: Path) -> None:
    _submit(warm, workdir, "term", "term")
    _until(warm, lambda: "waiting" in _log(warm, "term"), 60, "the script to install its handler")
    shim = warm.store.get("term").replicas[0]["pid"]  # type: ignore[union-attr]
    os.killpg(shim, signal.SIGTERM)
    _until(warm, lambda: _exit_code(warm, "term") is not None, 30, "the exit record")
    assert _exit_code(warm, "term") == 143
    _until(
        warm,
        lambda: any(e.kind == "Checkpointed" for e in warm.events("term")),
        30,
        "the backend to treat 143 as a checkpoint-and-exit",
    )
    assert warm.jobs()["term"].failures == 0
    warm.delete("term")


def test_killed_replica_and_killed_group_are_recorded(warm: LocalBackend, workdir: Path) -> None:
    _submit(warm, workdir, "victim", "hang", max_restarts=0)
    _until(warm, lambda: "waiting" in _log(warm, "victim"), 60, "the replica to run")
    shim = warm.store.get("victim").replicas[0]["pid"]  # type: ignore[union-attr]
    (replica,) = children(shim)
    os.kill(replica, signal.SIGKILL)
    _until(warm, lambda: _finished(warm, "victim"), 30, "victim to fail")
    assert _exit_code(warm, "victim") == -signal.SIGKILL  # recorded by the shim
    assert "killed by SIGKILL" in (warm.jobs()["victim"].message or "")

    # SIGKILL to the whole group kills the shim too: the zygote records it.
    _submit(warm, workdir, "group", "hang", max_restarts=0)
    _until(warm, lambda: "waiting" in _log(warm, "group"), 60, "the replica to run")
    shim = warm.store.get("group").replicas[0]["pid"]  # type: ignore[union-attr]
    os.killpg(shim, signal.SIGKILL)
    _until(warm, lambda: _finished(warm, "group"), 30, "group to fail")
    assert _exit_code(warm, "group") == -signal.SIGKILL
    assert "killed by SIGKILL" in (warm.jobs()["group"].message or "")


@pytest.mark.parametrize("delete", [False, True], ids=["finished", "deleted"])
def test_processes_a_warm_replica_leaves_behind_end_with_it(
    warm: LocalBackend,
    workdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    delete: bool,
) -> None:
    """The zygote's shims end a replica's leftovers as the cold shim does."""
    (workdir / "leaver.py").write_text(LEAVER)
    monkeypatch.setattr(warm, "grace_period", 2.0)
    name = "leaver-deleted" if delete else "leaver"
    spec = JobSpec(
        name=name,
        command=("python", "leaver.py"),
        args=("wait",) if delete else (),
        working_dir=str(workdir),
    )
    assert warm._warm_zygote(name, spec) is not None  # the warm path, not the cold one
    warm.submit(spec)
    warm.set_allocation(name, ("local",))
    pids = warm.job_dir(name) / "share" / "pids.json"
    _until(warm, pids.exists, 60, "the replica to start its processes")
    (tmp_path / "pids.json").write_bytes(pids.read_bytes())  # deletion removes the job's files
    shim = int(warm.store.get(name).replicas[0]["pid"])  # type: ignore[union-attr]
    if delete:
        warm.delete(name)
        _until(warm, lambda: name not in warm.jobs(), 30, "the job to go")
    else:
        _until(warm, lambda: _finished(warm, name), 30, "the job to finish")
        assert warm.jobs()[name].phase is Phase.SUCCEEDED
    zygote = warm._zygote
    assert zygote is not None
    _until(warm, lambda: zygote.exit_code(shim) is not None, 10, "the zygote to report")
    check_leftovers_ended(tmp_path)


def test_no_zombies_left_behind(warm: LocalBackend, workdir: Path) -> None:
    _submit(warm, workdir, "reaped", "ok", min_replicas=3)
    _until(warm, lambda: _finished(warm, "reaped"), 60, "job reaped to finish")
    shims = [int(r["pid"]) for r in warm.store.get("reaped").replicas or []]  # type: ignore[union-attr]
    zygote = warm._zygote
    assert zygote is not None and zygote.pid is not None

    def reaped() -> bool:
        zombies = [pid for pid in children(zygote.pid or 0) if _state(pid) == "Z"]
        return not zombies and all(_state(pid) is None for pid in shims)

    _until(warm, reaped, 10, "the zygote to reap its shims")


def test_fallback_to_cold_when_the_zygote_dies(
    warm: LocalBackend, workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = warm._zygote
    assert old is not None and old.pid is not None
    warm._zygote_retry_at = time.monotonic() + 3600  # keep it down for this job
    old.kill()
    deadline = time.monotonic() + 10
    while not old.dead and time.monotonic() < deadline:
        time.sleep(0.05)
    assert old.dead
    with caplog.at_level(logging.INFO, logger="adaptdl.cluster"):
        _submit(warm, workdir, "cold", "ok")
        _until(warm, lambda: _finished(warm, "cold"), 60, "job cold to finish")
    assert warm.jobs()["cold"].phase is Phase.SUCCEEDED
    (report,) = _reports(warm, "cold")
    assert report["warm"] is False  # a fresh interpreter
    assert any("zygote" in record.getMessage() for record in caplog.records)
    assert _state(old.pid) is None  # the dead zygote was reaped

    warm._zygote_retry_at = 0.0  # now let the backend restart it
    _until(warm, lambda: warm._zygote is not old, 10, "a new zygote")
    assert warm.wait_warm(120)
    _submit(warm, workdir, "warm-again", "ok")
    _until(warm, lambda: _finished(warm, "warm-again"), 60, "job warm-again to finish")
    assert _reports(warm, "warm-again")[0]["warm"] is True


def test_non_python_commands_and_python_flags_start_cold(warm: LocalBackend) -> None:
    spec = JobSpec(name="c", command=("python", "-c", "print(1)"), working_dir=".")
    assert warm._warm_zygote("c", spec) is None
    spec = JobSpec(name="c", command=("bash", "run.sh"), working_dir=".")
    assert warm._warm_zygote("c", spec) is None
    spec = JobSpec(name="c", command=("python", "x.py"), working_dir=".", env={"PYTHONPATH": "/x"})
    assert warm._warm_zygote("c", spec) is None  # start-up settings need a fresh interpreter
    spec = JobSpec(name="c", command=("python", "x.py"), working_dir=".")
    assert warm._warm_zygote("c", spec) is warm._zygote


def test_shutdown_stops_the_zygote(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, slots=1, gpus=[], warm_start=True, preload=["json"])
    zygote = backend._zygote
    assert zygote is not None and zygote.pid is not None
    assert backend.wait_warm(120)
    assert "json" in zygote.info["modules"]
    assert zygote.info["python_threads"] == 1
    backend.shutdown(stop_jobs=False)
    assert zygote.dead and _state(zygote.pid) is None


def test_disabled_warm_start_starts_no_zygote(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, slots=1, gpus=[])
    assert backend._zygote is None and not backend.wait_warm(0.1)
    backend.shutdown(stop_jobs=False)


def test_options_and_helpers() -> None:
    assert parse_preload(["sklearn.datasets,scipy", "scipy", " "]) == ["sklearn.datasets", "scipy"]
    with pytest.raises(ValueError, match="'a-b' is not a module name"):
        parse_preload(["a-b"])
    assert startup_env_differs({"PYTHONPATH": "a", "PYTHONUNBUFFERED": "1"}, {}) == ["PYTHONPATH"]
    assert startup_env_differs({"HOME": "x", "OMP_NUM_THREADS": "4"}, {"HOME": "y"}) == []
    # The locale fixed the standard streams' encoding when the zygote started.
    assert startup_env_differs({"LANG": "C", "LC_ALL": "C"}, {"LANG": "C.UTF-8"}) == [
        "LANG",
        "LC_ALL",
    ]
    assert startup_env_differs({}, {"LD_PRELOAD": "x", "MKL_NUM_THREADS": "2"}) == [
        "LD_PRELOAD",
        "MKL_NUM_THREADS",
    ]
    config = build_parser().parse_args(["--home", "h", "--no-warm-start", "--preload", "a,b"])
    assert config.warm_start is False and config.preload == ["a,b"]
    assert build_parser().parse_args(["--home", "h"]).warm_start is True


def test_daemon_restart_readopts_warm_replicas(daemon_home: Path) -> None:
    """kill -9 of the daemon (and so of its zygote) leaves warm replicas running."""
    client = start_test_daemon(daemon_home)
    wait_for(
        lambda: (
            "zygote" in (daemon_home / "daemon.log").read_text()
            and "ready" in (daemon_home / "daemon.log").read_text()
        ),
        120,
        "the daemon's zygote",
    )
    client.submit(counter_spec("survivor", "--steps", "600", "--step-time", "0.05"))
    log = daemon_home / "jobs" / "survivor" / "logs" / "replica-0.log"
    wait_for(lambda: len(log_steps(log)) >= 10, 40, "survivor running")
    parent = _parent(_shim_pid(daemon_home))
    assert parent != client.pid  # forked by the zygote, not started by the daemon
    assert b"_zygote.py" in Path(f"/proc/{parent}/cmdline").read_bytes()
    os.kill(client.pid, signal.SIGKILL)
    wait_for(lambda: _state(client.pid) in (None, "Z"), 10, "the daemon to die")

    client = start_test_daemon(daemon_home)
    events = client.describe("survivor")["events"]
    assert any(e["kind"] == "Adopted" and "1 of 1 replicas" in e["message"] for e in events)
    wait_for(lambda: client.describe("survivor")["phase"] == "Succeeded", 120, "survivor done")
    assert client.describe("survivor")["restarts"] == 0
    assert _exit_file(daemon_home, "survivor") == 0


def _shim_pid(home: Path) -> int:
    import sqlite3

    with sqlite3.connect(home / "state.db") as db:
        (raw,) = db.execute("SELECT replicas FROM jobs WHERE name = 'survivor'").fetchone()
    return int(json.loads(raw)[0]["pid"])


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _exit_file(home: Path, name: str) -> int | None:
    path = home / "jobs" / name / "run" / "g0-r0.exit"
    return int(path.read_text()) if path.exists() else None


def test_zygote_that_dies_while_starting_means_cold_launches_and_a_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "zygote_killer.py").write_text("import os\nos._exit(7)\n")
    (tmp_path / "hello.py").write_text("import sys\nprint('hello', 'torch' in sys.modules)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(lib), os.environ.get("PYTHONPATH", "")]))
    backend = LocalBackend(
        tmp_path / "home", slots=1, gpus=[], warm_start=True, preload=["zygote_killer"]
    )
    try:
        first = backend._zygote
        assert first is not None and not backend.wait_warm(120) and first.dead
        assert "exited with code 7" in caplog.text
        backend.submit(JobSpec(name="h", command=("python", "hello.py"), working_dir=str(tmp_path)))
        backend.set_allocation("h", ("local",))
        _until(backend, lambda: _finished(backend, "h"), 60, "job h to finish")
        assert backend.jobs()["h"].phase is Phase.SUCCEEDED
        assert "hello False" in _log(backend, "h")  # started cold
        _until(backend, lambda: backend._zygote is not first, 10, "a restarted zygote")
    finally:
        backend.shutdown(stop_jobs=True, timeout=10)


def test_a_late_reply_to_a_timed_out_launch_kills_its_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica forked for a launch the backend gave up on is not left running."""
    import sys

    from adaptdl.cluster._zygote import Zygote, ZygoteError

    zygote = Zygote(sys.executable, [], dict(os.environ), tmp_path / "zygote.log")
    zygote.start()
    assert zygote.wait_ready(60), (tmp_path / "zygote.log").read_text()
    pid_file = tmp_path / "replica.pid"
    (tmp_path / "sleeper.py").write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    )
    # The zygote is too slow to answer, and the kill of the broken zygote comes
    # after it forked the replica (simulated: the zygote survives, paused).
    monkeypatch.setattr(zygote, "_kill_locked", lambda: None)
    assert zygote.pid is not None
    os.kill(zygote.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ZygoteError, match="did not answer"):
            zygote.launch(
                ["sleeper.py"],
                cwd=str(tmp_path),
                env=dict(os.environ),
                log=tmp_path / "replica.log",
                exit_file=tmp_path / "replica.exit",
                timeout=0.3,
            )
    finally:
        os.kill(zygote.pid, signal.SIGCONT)
    try:
        # The zygote reports every replica it forked when it exits.
        exits = wait_for(lambda: dict(zygote._exits), 15, "the untracked replica to die")
        assert list(exits.values()) == [-signal.SIGKILL], exits
    finally:
        if pid_file.exists() and _state(int(pid_file.read_text())) not in (None, "Z"):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        monkeypatch.undo()
        zygote.stop()


def test_a_shim_whose_set_up_outlasts_the_launch_never_runs_its_replica(tmp_path: Path) -> None:
    """The daemon gave up and started the rank cold: the warm shim must not run it too."""
    import sys

    from adaptdl.cluster._zygote import Zygote, ZygoteError

    zygote = Zygote(sys.executable, [], dict(os.environ), tmp_path / "zygote.log")
    zygote.start()
    assert zygote.wait_ready(60), (tmp_path / "zygote.log").read_text()
    marker = tmp_path / "ran"
    (tmp_path / "script.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    log = tmp_path / "replica.log"
    os.mkfifo(log)  # the shim blocks opening its log, as on a hung file system
    exit_file = tmp_path / "replica.exit"
    try:
        with pytest.raises(ZygoteError, match="did not answer"):
            zygote.launch(
                ["script.py"],
                cwd=str(tmp_path),
                env=dict(os.environ),
                log=log,
                exit_file=exit_file,
                timeout=1.0,
            )
        # The zygote was killed; now the shim's set-up goes on.
        reader = os.open(log, os.O_RDONLY | os.O_NONBLOCK)
        try:
            time.sleep(3.0)
        finally:
            os.close(reader)
        assert not marker.exists(), "the abandoned shim ran the replica"
        assert not exit_file.exists()
        assert not (tmp_path / "replica.shim.pid").exists()
    finally:
        zygote.stop()


def test_a_stop_reaches_the_warm_replica_not_its_workers(warm: LocalBackend, workdir: Path) -> None:
    # The forked shim passes SIGTERM on to the replica alone, as the cold
    # shim does (a group signal killed PyTorch's loader workers first).
    (workdir / "with_worker.py").write_text(WITH_WORKER)
    spec = JobSpec(name="ww", command=("python", "with_worker.py"), working_dir=str(workdir))
    warm.submit(spec)
    warm.set_allocation("ww", ("local",))
    _until(warm, lambda: "waiting" in _log(warm, "ww"), 60, "the replica to start")
    zygote = warm._zygote
    assert zygote is not None and zygote.pid is not None
    shim = warm.store.get("ww").replicas[0]["pid"]  # type: ignore[union-attr]
    assert shim in children(zygote.pid)  # warm: forked by the zygote
    warm.set_allocation("ww", ("local", "local"))
    share = warm.job_dir("ww") / "share"
    _until(
        warm,
        lambda: (share / "worker-termed").exists() and (share / "worker-at-stop").exists(),
        30,
        "the stop to end the replica and its worker",
    )
    assert (share / "worker-at-stop").read_text() == "alive"
    warm.delete("ww")
    _until(warm, lambda: "ww" not in warm.jobs(), 30, "ww to go")
