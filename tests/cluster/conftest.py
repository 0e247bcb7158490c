"""Fixtures for local-cluster tests: an in-process cluster and a real daemon."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from adaptdl.cluster import (
    ClusterClient,
    Controller,
    DaemonNotRunningError,
    JobSpec,
    LocalBackend,
    Supervisor,
    start_daemon,
)
from adaptdl.sched import get_policy
from tests.cluster import _plugin  # noqa: F401 - registers "test-fair"

ROOT = Path(__file__).resolve().parents[2]
COUNTER = ROOT / "examples" / "jobs" / "counter.py"


def expected_total(steps: int) -> float:
    """What counter.py computes, however often it was interrupted."""
    return round(sum(math.sin(step) ** 2 for step in range(steps)), 9)


def counter_spec(name: str, *args: str, **fields: Any) -> JobSpec:
    """A job running examples/jobs/counter.py."""
    return JobSpec(
        name=name,
        command=("python", str(COUNTER)),
        args=tuple(args),
        working_dir=str(COUNTER.parent),
        **fields,
    )


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def log_steps(path: Path) -> list[int]:
    """Step numbers a counter replica printed."""
    if not path.exists():
        return []
    return [int(m) for m in re.findall(r"^step (\d+) ", path.read_text(), flags=re.M)]


def children(pid: int) -> list[int]:
    """Child pids of ``pid`` (Linux)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(item) for item in text.split()]


#: A replica that starts processes and leaves them behind: one in its process
#: group, one in a group of its own within its session, one that ignores
#: SIGTERM, and one that escapes into a session of its own (which the cluster
#: must leave alone). Their pids go to ``pids.json`` in the job's share; with
#: ``wait`` it then runs until stopped, otherwise it exits 0 at once.
LEAVER = """
import json, os, subprocess, sys, time
share = os.environ["ADAPTDL_SHARE_PATH"]
ready = os.path.join(share, "stubborn.ready")
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
stubborn = [sys.executable, "-c", (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(sys.argv[1], 'w').close(); time.sleep(120)"
), ready]
pids = {
    "group": subprocess.Popen(sleeper).pid,
    "own_group": subprocess.Popen(sleeper, process_group=0).pid,
    "stubborn": subprocess.Popen(stubborn).pid,
    "escaped": subprocess.Popen(sleeper, start_new_session=True).pid,
}
deadline = time.monotonic() + 30
while not os.path.exists(ready) and time.monotonic() < deadline:
    time.sleep(0.01)
# Written then renamed: a test polling for the file never reads it half-written.
with open(os.path.join(share, "pids.json.tmp"), "w") as handle:
    json.dump(pids, handle)
os.replace(os.path.join(share, "pids.json.tmp"), os.path.join(share, "pids.json"))
print("spawned", flush=True)
if sys.argv[1:] == ["wait"]:
    time.sleep(120)
"""


#: A replica whose child dies of a SIGTERM that does not come from its parent
#: (as PyTorch's data loader workers do); the replica checks on it when asked
#: to stop, then exits 143.
WITH_WORKER = """
import os, pathlib, signal, subprocess, sys, time
share = pathlib.Path(os.environ["ADAPTDL_SHARE_PATH"])
worker = subprocess.Popen([sys.executable, "-c", (
    "import os, pathlib, signal, sys, time\\n"
    "def term(signum, frame):\\n"
    "    pathlib.Path(sys.argv[1]).write_text('termed')\\n"
    "    sys.exit(0)\\n"
    "signal.signal(signal.SIGTERM, term)\\n"
    "pathlib.Path(sys.argv[2]).write_text('ready')\\n"
    "time.sleep(120)\\n"
), str(share / "worker-termed"), str(share / "worker-ready")])
while not (share / "worker-ready").exists():
    time.sleep(0.01)

def stop(signum, frame):
    time.sleep(0.3)  # a checkpoint takes a moment
    (share / "worker-at-stop").write_text("alive" if worker.poll() is None else "dead")
    sys.exit(143)

signal.signal(signal.SIGTERM, stop)
print("waiting", flush=True)
time.sleep(120)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie only waits to be reaped)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def check_leftovers_ended(share: Path) -> None:
    """Assert that the processes LEAVER left in its session are gone; kill the escaped one.

    The one in a session of its own was never the replica's to end: it must
    still run (the cluster signals nothing outside a replica's session).
    """
    pids = json.loads((share / "pids.json").read_text())
    try:
        alive = [name for name in ("group", "own_group", "stubborn") if running(pids[name])]
        assert not alive, f"left behind by the replica and still running: {alive}"
        assert running(pids["escaped"]), "a process outside the replica's session was killed"
    finally:
        for pid in pids.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class InProcessCluster:
    """Backend, supervisor and controller running in threads of the test."""

    backend: LocalBackend
    supervisor: Supervisor
    controller: Controller
    home: Path

    def status(self, name: str) -> Any:
        return self.backend.jobs()[name]


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[InProcessCluster]:
    backend = LocalBackend(tmp_path / "home", slots=4, gpus=[], grace_period=10.0)
    controller = Controller(backend, get_policy("test-fair"), interval=0.5, tick=0.1)
    supervisor = Supervisor(backend, admin_token=secrets.token_hex(8), on_change=controller.wake)
    backend.supervisor_url = supervisor.url
    supervisor.start()
    stop = threading.Event()
    worker = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    worker.start()
    try:
        yield InProcessCluster(backend, supervisor, controller, tmp_path / "home")
    finally:
        stop.set()
        worker.join()
        backend.shutdown(stop_jobs=True, timeout=15.0)
        supervisor.close()
        backend.close()


@pytest.fixture
def daemon_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A home directory whose daemon(s) are stopped, and replicas killed, at the end."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    home = tmp_path / "home"
    yield home
    stop_cluster(home)


def stop_cluster(home: Path) -> None:
    """Stop the daemon of ``home`` (and its jobs) if one runs, then kill leftover replicas."""
    try:
        ClusterClient(home).shutdown(stop_jobs=True, wait=20.0)
    except DaemonNotRunningError:
        pass
    _kill_leftovers(home)


def _kill_leftovers(home: Path) -> None:
    """Kill any process whose environment or command line mentions this home.

    Cold replicas carry the home in their environment; warm ones (forked by
    the zygote) keep the zygote's, whose command line names the home.
    """
    marker = str(home).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            found = marker in (entry / "environ").read_bytes()
            found = found or marker in (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if found and int(entry.name) != os.getpid():
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def start_test_daemon(home: Path, **options: Any) -> ClusterClient:
    """A daemon running the deterministic test policy."""
    options.setdefault("slots", 4)
    options.setdefault("interval", 1.0)
    options.setdefault("grace", 10.0)
    return start_daemon(home, policy="test-fair", plugins=["tests.cluster._plugin"], **options)
