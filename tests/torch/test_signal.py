"""SIGINT/SIGTERM handling: lazy installation, agreement across replicas, exit 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import adaptdl.torch as adt
from adaptdl import checkpoint, collective, env
from adaptdl.testing import run_elastic
from adaptdl.torch import _signal


def test_handlers_are_installed_lazily_and_once() -> None:
    before = signal.getsignal(signal.SIGTERM)
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    assert signal.getsignal(signal.SIGTERM) is before  # creating a loader changes nothing
    for _ in loader:
        break
    assert signal.getsignal(signal.SIGTERM) is _signal._handler
    assert _signal.install_handlers() is True


def test_no_handlers_outside_the_main_thread() -> None:
    results = []
    thread = threading.Thread(target=lambda: results.append(_signal.install_handlers()))
    thread.start()
    thread.join()
    assert results == [False]
    assert signal.getsignal(signal.SIGTERM) is not _signal._handler


def test_second_sigint_forces_exit() -> None:
    _signal.install_handlers()
    os.kill(os.getpid(), signal.SIGINT)
    assert _signal.get_exit_flag()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_request_checkpoint_validates_and_sets_bits() -> None:
    with pytest.raises(TypeError, match="exit"):
        adt.request_checkpoint(exit="yes")  # type: ignore[arg-type]
    adt.request_checkpoint()
    assert _signal.get_flags() == _signal.FLAG_CHECKPOINT
    _signal.clear_checkpoint_request()
    adt.request_checkpoint(exit=True)
    assert _signal.get_flags() == _signal.FLAG_EXIT


def test_checkpoint_and_continue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    steps = 0
    for _ in adt.remaining_epochs_until(2):
        for _ in loader:
            steps += 1
            if steps == 2:
                adt.request_checkpoint()
                assert checkpoint.latest_checkpoint() is None
    assert steps == 8  # kept training
    assert checkpoint.latest_checkpoint() is not None
    assert _signal.get_flags() == 0


def _job() -> Any:
    adt.init_process_group("gloo")
    rank = env.replica_rank()
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(400)), batch_size=4)
    log = Path(env.share_path() or "") / f"steps-g{env.num_restarts()}-r{rank}.json"
    steps = []
    for _epoch in adt.remaining_epochs_until(1):
        for _ in loader:
            steps.append(loader._elastic.current_index)
            log.write_text(json.dumps(steps))
            if env.num_restarts() == 0 and rank == 1 and len(steps) == 3:
                os.kill(os.getpid(), signal.SIGTERM)
    collective.teardown()
    return steps


@pytest.mark.usefixtures("agree_every_step")
def test_sigterm_on_one_replica_stops_all_at_the_same_step() -> None:
    result = run_elastic(_job, [2, 2], timeout=60)
    assert result.generations[0].exit_codes == [143, 143]
    share = Path(result.share_dir)
    first = [json.loads((share / f"steps-g0-r{r}.json").read_text()) for r in (0, 1)]
    assert first[0] == first[1] and len(first[0]) == 4  # acted on one step later
    resumed = result.final.results[0]
    # The restart resumes right after the last step before the exit.
    assert resumed[0] == first[0][-1] + 4


# A replica script whose interpreter shutdown is slow, like a real job's (torch,
# gloo and thread-pool teardown took 4-7 s): a global's finaliser sleeps during
# module teardown, which runs after Python has reset its signal handlers.
_SLOW_SHUTDOWN_JOB = """
import logging, logging.handlers, os, sys, time
import torch
from torch.utils.data import TensorDataset
import adaptdl.torch as adt

class SlowTeardown:
    def __del__(self, write=os.write, sleep=time.sleep):
        write(2, b"finalizing\\n")
        sleep(float(os.environ["SLOW_TEARDOWN_S"]))

slow = SlowTeardown()
log_path = sys.argv[1]
# Buffers records until flushed: only an orderly logging shutdown writes them.
handler = logging.handlers.MemoryHandler(10000, target=logging.FileHandler(log_path))
logging.getLogger("job").addHandler(handler)
logging.getLogger("job").setLevel(logging.INFO)
loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(64)), batch_size=4)
for epoch in adt.remaining_epochs_until(int(os.environ["EPOCHS"])):
    for (batch,) in loader:
        print("step", int(batch[0]))  # block-buffered: stdout is a pipe
        logging.getLogger("job").info("logged %d", int(batch[0]))
        os.write(2, b"stepped\\n")
        time.sleep(float(os.environ["STEP_S"]))
print("training finished")
sys.stdout.flush()
os.write(2, b"finished\\n")
"""


def _start_job(
    tmp_path: Path, epochs: int, step_s: float, teardown_s: float = 6
) -> subprocess.Popen[bytes]:
    script = tmp_path / "job.py"
    script.write_text(_SLOW_SHUTDOWN_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTDL_")}
    env.pop("PYTHONUNBUFFERED", None)
    env.update(
        OMP_NUM_THREADS="1",
        ADAPTDL_CHECKPOINT_PATH=str(tmp_path / "ckpt"),
        SLOW_TEARDOWN_S=str(teardown_s),
        EPOCHS=str(epochs),
        STEP_S=str(step_s),
    )
    (tmp_path / "ckpt").mkdir()
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "job.log")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for_line(proc: subprocess.Popen[bytes], marker: bytes, timeout: float = 90) -> None:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    seen = b""
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
        if line.strip() == marker:
            return
    proc.kill()
    raise AssertionError(f"{marker!r} never appeared on stderr:\n{seen.decode()[-3000:]}")


def test_checkpoint_exit_is_prompt_and_flushes_output(tmp_path: Path) -> None:
    # Long enough (800 steps) that the signal always arrives mid-training.
    proc = _start_job(tmp_path, epochs=50, step_s=0.05, teardown_s=30)
    try:
        for _ in range(3):
            _wait_for_line(proc, b"stepped")
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr.decode()[-3000:]
    # Exit skips the 30 s finaliser: no interpreter shutdown after the save.
    assert elapsed < 25.0 and b"finalizing" not in stderr
    steps = stdout.decode().split()
    assert steps[:2] == ["step", "0"] and len(steps) >= 8  # buffered prints flushed
    logged = (tmp_path / "job.log").read_text().split()
    assert logged.count("logged") == len(steps) // 2  # buffered log records flushed
    assert checkpoint.latest_checkpoint(str(tmp_path / "ckpt")) is not None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_late_signal_during_shutdown_keeps_a_finished_job_finished(
    tmp_path: Path, signum: int
) -> None:
    proc = _start_job(tmp_path, epochs=1, step_s=0.0)
    try:
        _wait_for_line(proc, b"finished")
        _wait_for_line(proc, b"finalizing")
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # Without the atexit hook the default action kills it: -15 (or -2).
    assert proc.returncode == 0, stderr.decode()[-3000:]
    assert b"training finished" in stdout


def _agreeing_job() -> Any:
    """Steps of ~5 ms: the loader agrees only every ~AGREE_INTERVAL (about 10 steps)."""
    adt.init_process_group("gloo")
    rank = env.replica_rank()
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(400)), batch_size=4)
    log = Path(env.share_path() or "") / f"agree-g{env.num_restarts()}-r{rank}.json"
    steps, countdowns = [], []
    for _epoch in adt.remaining_epochs_until(1):
        for _ in loader:
            time.sleep(0.005)
            steps.append(loader._elastic.current_index)
            countdowns.append(loader._elastic._agree_countdown)
            log.write_text(json.dumps({"steps": steps, "countdowns": countdowns}))
            if env.num_restarts() == 0 and rank == 1 and len(steps) == 30:
                os.kill(os.getpid(), signal.SIGTERM)
    collective.teardown()
    return steps


def test_sparse_agreement_still_stops_all_replicas_at_the_same_step() -> None:
    result = run_elastic(_agreeing_job, [2, 2], timeout=60)
    assert result.generations[0].exit_codes == [143, 143]
    share = Path(result.share_dir)
    first = [json.loads((share / f"agree-g0-r{r}.json").read_text()) for r in (0, 1)]
    assert first[0]["steps"] == first[1]["steps"]  # the same last step everywhere
    assert first[0]["countdowns"] == first[1]["countdowns"]  # one agreed schedule
    assert max(first[0]["countdowns"]) > 1  # agreements were spaced out
    assert 30 <= len(first[0]["steps"]) < 80  # yet the request was served within ~0.2 s
    resumed = result.final.results[0]
    assert resumed[0] == first[0]["steps"][-1] + 4


_NO_CHECKPOINT_PATH_JOB = """
import os, signal
import torch
from torch.utils.data import TensorDataset
import adaptdl.torch as adt

loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(64)), batch_size=4)
for epoch in adt.remaining_epochs_until(2):
    for (batch,) in loader:
        if int(batch[0]) == 8:
            os.kill(os.getpid(), signal.SIGTERM)
"""


def test_an_exit_without_a_checkpoint_path_says_nothing_was_kept(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_NO_CHECKPOINT_PATH_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTDL_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "no checkpoint path is set" in proc.stderr
    assert "a restart begins from scratch" in proc.stderr


def _request_once(caplog: pytest.LogCaptureFixture) -> list[str]:
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    with caplog.at_level("WARNING", logger="adaptdl"):
        for (batch,) in loader:
            if int(batch[0]) == 2:
                adt.request_checkpoint()
    return [r.getMessage() for r in caplog.records if "no checkpoint path" in r.getMessage()]


@pytest.mark.usefixtures("agree_every_step")
def test_a_checkpoint_request_without_a_path_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("ADAPTDL_CHECKPOINT_PATH", raising=False)
    assert _request_once(caplog) == [
        "no checkpoint path is set (ADAPTDL_CHECKPOINT_PATH or a checkpoint path hook), "
        "so no checkpoint is saved"
    ]


@pytest.mark.usefixtures("agree_every_step")
@pytest.mark.parametrize("where", ["environment", "hook", "rank 1"])
def test_no_warning_where_the_checkpoint_is_saved_or_on_other_ranks(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    where: str,
) -> None:
    monkeypatch.delenv("ADAPTDL_CHECKPOINT_PATH", raising=False)
    if where == "environment":
        monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    elif where == "hook":
        checkpoint.set_checkpoint_path_hook(lambda purpose: str(tmp_path))
    else:
        from adaptdl.torch import _sync

        monkeypatch.setattr(_sync.env, "replica_rank", lambda: 1)
        with caplog.at_level("WARNING", logger="adaptdl"):
            _sync.handle_requests(_signal.FLAG_CHECKPOINT)
        assert caplog.records == []
        return
    try:
        assert _request_once(caplog) == []
    finally:
        checkpoint.set_checkpoint_path_hook(None)
    assert checkpoint.latest_checkpoint(str(tmp_path)) is not None
