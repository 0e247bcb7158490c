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
