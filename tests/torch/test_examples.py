"""The examples run as documented: the MNIST tutorial steps, checkpoint-restart, autoscaling."""

from __future__ import annotations

import os
import re
import runpy
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from adaptdl import collective
from adaptdl.testing import free_port, run_elastic

ROOT = Path(__file__).resolve().parents[2]
MNIST = ROOT / "examples" / "mnist"
LINEAR = ROOT / "examples" / "linear_regression"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTDL_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _run(script: Path, *args: str, timeout: float = 120, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    return output


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run example scripts inside the test process (no torch import per script)."""
    monkeypatch.syspath_prepend(str(MNIST))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_script(script: Path, *args: str) -> None:
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


@pytest.mark.parametrize(
    "name",
    ["mnist_original", "mnist_step_1", "mnist_step_2", "mnist_step_3", "mnist_step_4"],
)
def test_tutorial_step_runs(
    name: str, in_process: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", sys.argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_script(MNIST / f"{name}.py", "--epochs", "1", "--log-interval", "100")
    assert "Test set: Average loss" in capsys.readouterr().out
    # Step 1 wraps the model but keeps torch's DataLoader: the one step that
    # should hear that it trains with a fixed batch size.
    outside = [w for w in caught if "outside an adaptdl.torch.AdaptiveDataLoader" in str(w.message)]
    assert len(outside) == (1 if name == "mnist_step_1" else 0), [str(w.message) for w in caught]


def test_tutorial_step_5_matches_the_docs_flow(
    in_process: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", sys.argv)
    _run_script(MNIST / "mnist_step_5.py", "--epochs", "2", "--log-interval", "100")
    accuracies = re.findall(r"Accuracy: (\d+)/(\d+)", capsys.readouterr().out)
    assert len(accuracies) == 2
    assert int(accuracies[-1][0]) / int(accuracies[-1][1]) > 0.5


def test_main_trains_locally(in_process: None) -> None:
    import main  # type: ignore[import-not-found]

    records = main.run(["--epochs", "3"])
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert records[-1]["accuracy"] > 0.8 and records[-1]["batch_size"] == 64


def _wait_for(proc: subprocess.Popen[str], pattern: str, lines: list[str]) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return
    raise AssertionError(f"{pattern!r} never appeared:\n{''.join(lines)[-3000:]}")


def _positions(lines: list[str] | str) -> list[tuple[int, int]]:
    text = "".join(lines) if isinstance(lines, list) else lines
    return [(int(e), int(p)) for e, p in re.findall(r"Train Epoch: (\d+) \[(\d+)/", text)]


def test_ctrl_c_checkpoints_and_rerun_resumes_at_the_same_batch(tmp_path: Path) -> None:
    args = [str(MNIST / "main.py"), "--epochs", "2", "--log-interval", "1"]
    env = _env(ADAPTDL_CHECKPOINT_PATH=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        _wait_for(proc, r"Train Epoch: 0 \[[1-9]\d\d+/", lines)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    lines.append(rest)
    assert proc.returncode == 143, "".join(lines)[-3000:]
    before = _positions(lines)
    output = _run(
        MNIST / "main.py",
        "--epochs",
        "2",
        "--log-interval",
        "1",
        ADAPTDL_CHECKPOINT_PATH=str(tmp_path),
    )
    after = _positions(output)
    # Same epoch, next batch (64 samples per step) after the last one trained.
    assert after[0] == (before[-1][0], before[-1][1] + 64)
    assert re.findall(r"Epoch (\d+):", output)[0] == str(before[-1][0])


def _start_replicas(
    count: int, port: int, ckpt: Path, restarts: int
) -> list[subprocess.Popen[str]]:
    procs = []
    for rank in range(count):
        env = _env(
            ADAPTDL_MASTER_ADDR="127.0.0.1",
            ADAPTDL_MASTER_PORT=str(port),
            ADAPTDL_NUM_REPLICAS=str(count),
            ADAPTDL_REPLICA_RANK=str(rank),
            ADAPTDL_CHECKPOINT_PATH=str(ckpt),
            ADAPTDL_NUM_RESTARTS=str(restarts),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(MNIST / "main.py"), "--epochs", "1", "--log-interval", "1"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def test_two_replicas_then_resume_with_three(tmp_path: Path) -> None:
    procs = _start_replicas(2, free_port(), tmp_path, 0)
    lines: list[str] = []
    try:
        _wait_for(procs[0], r"Train Epoch: 0 \[\d+/", lines)
        procs[1].send_signal(signal.SIGINT)  # any replica may be interrupted
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [143, 143], outputs
    before = _positions(lines + [outputs[0]])
    resumed = _start_replicas(3, free_port(), tmp_path, 1)
    try:
        outputs = [p.communicate(timeout=120)[0] for p in resumed]
    finally:
        for p in resumed:
            p.kill()
    assert [p.returncode for p in resumed] == [0, 0, 0], outputs[0][-3000:]
    after = _positions(outputs[0])
    assert after[0] == (0, before[-1][1] + 64)  # 2x32 per step before the restart
    assert "Epoch 0:" in outputs[0]


def _linear_job(argv: list[str]) -> Any:
    module = runpy.run_path(str(LINEAR / "main.py"), run_name="linear_regression")
    records = module["run"](argv)
    collective.teardown()
    return records


def test_batch_size_grows_with_the_noise_scale_only_when_autoscaling() -> None:
    fast = {"ADAPTDL_FIT_INTERVAL": "0.5", "ADAPTDL_DECIDE_INTERVAL": "0.5"}
    # At most 512 = 16 x 32: AdaScale's learning rate (up to 16 x 0.02) stays
    # well inside the stable range of this quadratic (below 1).
    args = ["--epochs", "6", "--size", "4096", "--max-batch-size", "512"]
    grown = run_elastic(_linear_job, 2, args=(args + ["--autoscale-bsz"],), env=fast, timeout=150)
    records = grown.final.results[0]
    first, last = records[0]["batch_sizes"], records[-1]["batch_sizes"]
    assert first[0] == 32
    assert max(last) >= 4 * 32, records
    assert records[-1]["weight_error"] < 0.2
    fixed = run_elastic(
        _linear_job, 2, args=(["--epochs", "3", "--size", "4096"],), env=fast, timeout=150
    )
    assert all(r["batch_sizes"] == [32] for r in fixed.final.results[0])
