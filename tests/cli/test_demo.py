"""``adaptdl demo``: option checks and a home that holds other jobs.

The real demo trains three models for minutes; these tests swap in tiny
scripts (an examples directory of their own, and jobs without the late
arrival), so they run in seconds.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from adaptdl.cli import _demo, main
from adaptdl.cluster import JobSpec, LocalBackend
from tests.cluster.conftest import stop_cluster

pytestmark = pytest.mark.cluster

#: Stands in for a demo script: logs a loss, works briefly, succeeds.
_QUICK = "import time\nprint('epoch 1, loss 0.5', flush=True)\ntime.sleep(2)\n"


@pytest.fixture
def examples(tmp_path: Path) -> Path:
    """An examples directory with the scripts the demo jobs name."""
    root = tmp_path / "examples"
    for job in _demo.DEMO_JOBS:
        script = root / job.script
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(_QUICK)
    return root


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A home whose daemon, and replicas, are stopped at the end (should the demo not)."""
    path = tmp_path / "home"
    yield path
    stop_cluster(path)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["demo", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_bad_options_are_refused_like_cluster_start_and_leave_no_temporary_home(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    examples: Path,
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for bad, message in (
        (["--slots", "0"], "--slots=0: expected an integer from 1 to 2**31 - 1"),
        (["--interval", "0"], "--interval=0.0: expected a positive number of seconds"),
        (["--interval", "nan"], "--interval=nan: expected a positive number of seconds"),
        (["--interval", "inf"], "--interval=inf: expected a positive number of seconds"),
        (["--policy", "nope"], "--policy: unknown policy 'nope'; on a cluster use one of:"),
        (["--policy-option", "restart_delay=abc"], "--policy-option restart_delay=abc:"),
        (["--timeout", "nan"], "--timeout=nan: expected a positive number of seconds"),
        (["--home", ""], "--home '': expected a directory"),  # not the current directory
    ):
        # A short timeout bounds the run, should an option be let through.
        code, _, err = _run(capsys, "--examples", str(examples), "--timeout", "5", *bad)
        assert code == 2 and err.startswith(f"adaptdl: error: {message}"), (bad, err)
        assert "Traceback" not in err
        assert not list(scratch.iterdir()), f"{bad} left {list(scratch.iterdir())}"


def test_a_home_with_other_jobs_shows_and_waits_for_the_demos_own(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    home: Path,
    examples: Path,
) -> None:
    """Another job, running while the demo runs, is neither shown nor lost."""
    monkeypatch.setattr(
        _demo,
        "DEMO_JOBS",
        tuple(job for job in _demo.DEMO_JOBS if not job.delay),  # no late arrival
    )
    backend = LocalBackend(home, slots=3, gpus=[])
    sleeper = "import time; time.sleep(120)"
    backend.submit(JobSpec(name="other", command=("python", "-c", sleeper), working_dir="."))
    backend.shutdown(stop_jobs=False)
    backend.close()
    # The user's saved cluster settings: the demo's daemon must not replace them.
    settings = home / "daemon-settings.json"
    settings.write_text('{"slots": 3, "interval": 30.0}')

    code, out, err = _run(
        capsys,
        "--home",
        str(home),
        "--examples",
        str(examples),
        "--slots",
        "3",
        "--interval",
        "1",
        "--timeout",
        "90",
    )
    assert code == 0, err
    assert f"{home} also holds 1 other job(s) (other)" in out
    rows = [line.split()[0] for line in out.splitlines() if line.split()]
    assert "other" not in rows  # in no table
    assert {"mnist", "linreg"} <= set(rows)
    assert settings.read_text() == '{"slots": 3, "interval": 30.0}'

    backend = LocalBackend(home, slots=3, gpus=[])
    try:
        assert "other" in backend.jobs()  # stopped with the demo's cluster, not lost
    finally:
        backend.shutdown(stop_jobs=False)
        backend.close()


def test_a_missing_dependency_of_the_demo_jobs_is_named_up_front(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, examples: Path
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a)
    )
    code, _, err = _run(capsys, "--examples", str(examples), "--timeout", "5")
    assert code == 1 and "adaptdl demo needs scikit-learn" in err, err
    assert "pip install scikit-learn" in err


def test_slots_default_to_the_gpus_there_are(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    examples: Path,
) -> None:
    # Each slot is one GPU: on a one-GPU machine the default of 4 failed.
    from adaptdl.cli import build_parser

    monkeypatch.setattr(_demo, "detect_gpus", lambda: ["0"])
    args = build_parser().parse_args(["demo"])
    _demo._demo_policy_options(args)
    assert args.slots == 1
    monkeypatch.setattr(_demo, "detect_gpus", lambda: [])
    args = build_parser().parse_args(["demo"])
    _demo._demo_policy_options(args)
    assert args.slots == 4  # CPU slots
    monkeypatch.setattr(_demo, "detect_gpus", lambda: ["0", "1"])
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, _, err = _run(capsys, "--examples", str(examples), "--slots", "4", "--timeout", "5")
    assert code == 2 and "--slots 4: this machine has 2 GPUs" in err, err
    assert not list(scratch.iterdir())


def test_keep_and_clean_together_are_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # --clean deleted the home of the cluster --keep left running: an orphan daemon.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, _, err = _run(capsys, "--keep", "--clean")
    assert code == 2 and "--keep and --clean" in err, err
    assert not list(scratch.iterdir())


def test_a_daemon_another_command_started_is_neither_used_nor_stopped(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    examples: Path,
) -> None:
    # Two demos started at once in one --home: the second attached to the
    # first one's daemon, found its jobs, and shut that daemon down.
    class Attached:
        started_here = False
        stopped = False

        def shutdown(self, **kwargs: object) -> bool:
            Attached.stopped = True
            return True

    monkeypatch.setattr(_demo, "start_daemon", lambda *args, **kwargs: Attached())
    code, _, err = _run(capsys, "--home", str(tmp_path / "h"), "--examples", str(examples))
    assert code == 1 and f"a cluster already runs in {tmp_path / 'h'}" in err, err
    assert not Attached.stopped


def test_batch_sizes_are_read_from_the_log() -> None:
    # The summary showed the scheduler's predictions (64 -> 392) while the
    # job used 64 and then 512.
    log = (
        "Train Epoch: 1 [0/1000]\tLoss: 0.1\tbatch size 64\n"
        "Train Epoch: 1 [640/1000]\tLoss: 0.1\tbatch size 64\n"
        "epoch 3: loss 0.2, batch sizes [64, 512, 512], 1.0s\n"
        "Epoch 4: loss 0.1, accuracy 90%, batch size 512\n"
    )
    assert _demo.batch_sizes(log) == [64, 512]
    assert _demo.batch_sizes("no sizes here, loss 1.0") == []
    assert _demo._shown([1, 2, 3, 4, 5, 6, 7, 8]) == "1 -> 2 -> 3 -> ... -> 6 -> 7 -> 8"


def test_a_sigterm_stops_the_demos_cluster_as_ctrl_c_does(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    # The daemon runs in its own session: a SIGTERM (timeout, a CI cancel)
    # ended only the demo, and the daemon and its jobs ran on.
    import os
    import signal
    import threading
    import time

    from adaptdl.cluster import ClusterClient, DaemonNotRunningError

    examples = tmp_path / "forever"
    for job in _demo.DEMO_JOBS:
        script = examples / job.script
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text("import time\nprint('epoch 1, loss 0.5', flush=True)\ntime.sleep(600)\n")
    before = signal.getsignal(signal.SIGTERM)

    def terminate_once_running() -> None:
        # Once the demo has submitted a job (its cluster is up), as a CI cancel would.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if ClusterClient(home).jobs():
                    break
            except DaemonNotRunningError:
                pass
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_once_running, daemon=True)
    killer.start()
    code, out, _ = _run(capsys, "--home", str(home), "--examples", str(examples), "--timeout", "60")
    killer.join(10)
    assert code == 130
    assert f"Logs: {home}/jobs" in out  # where to look, even when interrupted
    with pytest.raises(DaemonNotRunningError):
        ClusterClient(home)
    assert signal.getsignal(signal.SIGTERM) == before  # put back


def test_an_interrupted_start_leaves_no_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C while start_daemon waited for the daemon to answer left it
    # running, unseen, in a temporary home.
    import time

    from adaptdl.cluster import _client, start_daemon

    def interrupted(root: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_client, "_try_client", interrupted)
    home = tmp_path / "h"
    with pytest.raises(KeyboardInterrupt):
        start_daemon(home, slots=1, warm_start=False)

    def daemons() -> list[str]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "adaptdl.cli._daemon" in cmdline and str(home) in cmdline:
                found.append(cmdline)
        return found

    deadline = time.monotonic() + 10
    while daemons() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not daemons()


def test_the_demo_runs_outside_the_main_thread(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, examples: Path
) -> None:
    # signal.signal raised ValueError there before anything started.
    import threading

    from adaptdl.cli import CLIError

    def refuse(*args: object) -> None:
        raise CLIError("stand-in: no cluster")

    monkeypatch.setattr(_demo, "_start_demo_cluster", refuse)
    codes: list[int] = []
    worker = threading.Thread(
        target=lambda: codes.append(main(["demo", "--examples", str(examples)]))
    )
    worker.start()
    worker.join(30)
    assert codes == [1]
    assert "stand-in: no cluster" in capsys.readouterr().err
