"""``adaptdl simulate``: option errors, input errors, end-to-end with --output."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from adaptdl.cli import main
from adaptdl.sim import simulate
from tests.sim import toy

POLLUX_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "pollux-data"


@pytest.fixture(scope="module")
def toy_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("traces")
    toy.make_toy_traces(root, "toy")
    return root


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("csv", "message"),
    [
        ("name,time\na,1\n", "w.csv:1: missing column(s): application"),
        ("name,time,application\na,1,toy\nb,x,toy\n", "w.csv:3: column 'time': expected a number"),
        (
            "name,time,application\na,1,bert\n",
            "w.csv:2: column 'application': unknown application 'bert'",
        ),
    ],
)
def test_workload_errors(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str], csv: str, message: str
) -> None:
    path = tmp_path / "w.csv"
    path.write_text(csv)
    code, _, err = _run(["simulate", str(path), "--traces", str(toy_traces)], capsys)
    assert code == 1
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--policy", "nope"], "unknown policy 'nope'; valid policies:"),
        (["--policy", "tiresias,tiresias"], "listed twice"),
        (["--nodes", "0"], "--nodes 0"),
        (["--interference", "1"], "--interference 1.0"),
        (["--jobs", "0"], "--jobs 0"),
        (["--seed", "-1"], "--seed -1: must be an integer from 0 to 2**53"),
        (["--seed", str(2**53 + 1)], f"--seed {2**53 + 1}: must be an integer from 0 to 2**53"),
        (["--interval", "1e-9"], "--interval 1e-09: must be a number of seconds from 1 to"),
        (["--interval", "4e8"], "--interval 4e+08: must be a number of seconds from 1 to"),
        (["--interval", "nan"], "--interval nan: must be a number of seconds from 1 to"),
        (["--gpus-per-node", "8"], "--gpus-per-node 8: the toy traces (used by "),
        (["--output", "w.csv"], "w.csv: exists and is not a directory"),
        # A doubled comma is likely a name deleted by mistake: not skipped.
        (["--policy", "tiresias,,optimus"], "--policy tiresias,,optimus: empty policy name at"),
        (["--policy", ",tiresias"], "empty policy name at position 1"),
    ],
)
def test_option_errors(
    tmp_path: Path,
    toy_traces: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    message: str,
) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application\na,1,toy\n")
    options = [str(path) if option == "w.csv" else option for option in options]
    code, _, err = _run(["simulate", str(path), "--traces", str(toy_traces), *options], capsys)
    # Every one a bad option value (usage error), also where the traces or
    # the file system refuse it.
    assert code == 2 and message in err, err


def test_fixed_size_job_wider_than_the_cluster(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application,num_replicas,batch_size\na,1,toy,6,64\n")
    base = ["simulate", str(path), "--traces", str(toy_traces), "--nodes", "1"]
    argv = [*base, "--policy", "tiresias"]
    code, _, err = _run(argv, capsys)
    assert code == 1, err
    needs = "job 'a' needs 6 GPUs but the cluster has 4"
    # The file and line are named once.
    assert f"adaptdl: error: tiresias: {path}:2: column 'num_replicas': {needs}" in err
    # The column is named as the file spells it (Sia's header), for the batch too.
    sia = tmp_path / "sia.csv"
    sia.write_text("job_id,submit_time,model,num_gpus,bsz\na,1,toy,6,64\nb,2,toy,1,4096\n")
    code, _, err = _run([*argv[:1], str(sia), *argv[2:]], capsys)
    assert code == 1 and f"{sia}:2: column 'num_gpus': {needs}" in err, err
    sia.write_text("job_id,submit_time,model,num_gpus,bsz\nb,2,toy,1,4096\n")
    code, _, err = _run([*argv[:1], str(sia), *argv[2:]], capsys)
    assert code == 1 and f"{sia}:2: column 'bsz': job 'b': batch size 4096 is outside" in err, err
    # The others choose the width themselves; no --policy is ours, adaptdl.
    for options in (["--policy", "pollux"], ["--policy", "optimus"], []):
        code, out, err = _run([*base, *options, "--no-progress"], capsys)
        assert code == 0, err
        name = options[1] if options else "adaptdl"
        assert name in out and "tiresias" not in out, out


def test_a_failed_run_does_not_lose_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "traces"
    toy.make_toy_traces(root, "toy")
    # "gap" lacks placement (2,) at local batch 8, which a 2-GPU job of batch 16 needs.
    gap = toy.make_toy_traces(root, "gap")
    placements = gap / "placements.csv"
    kept = [line for line in placements.read_text().splitlines() if not line.startswith("2,8,")]
    placements.write_text("\n".join(kept) + "\n")
    header = "name,time,application,num_replicas,batch_size\n"
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    good.write_text(header + "a,1,toy,1,8\n")
    bad.write_text(header + "b,1,gap,2,16\n")
    argv = ["simulate", str(bad), str(good), "--traces", str(root), "--jobs", "1"]
    code, out, err = _run([*argv, "--no-progress", "--policy", "tiresias,optimus"], capsys)
    assert code == 1
    assert f"tiresias on {bad}: {bad}:2: job 'b' at t=60s on placement (2,)" in err
    assert f"optimus on {bad}: {bad}:2: job 'b' at t=60s on 2 packed GPU(s)" in err
    assert "2 of 4 simulations failed" in err and "the table shows the others" in err
    assert [line.split()[:2] for line in out.splitlines()[2:]] == [
        ["tiresias", "good"],
        ["optimus", "good"],
    ]


def test_closed_stdout_is_not_a_traceback(tmp_path: Path, toy_traces: Path) -> None:
    import sys

    path = tmp_path / "w.csv"
    path.write_text("name,time,application\na,1,toy\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaptdl.cli", "simulate", str(path), "--traces", str(toy_traces)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head` exiting before the table is printed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_missing_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application\na,1,toy\n")
    code, _, err = _run(["simulate", str(path), "--traces", str(tmp_path / "none")], capsys)
    assert code == 2 and f"--traces {tmp_path / 'none'}: not a directory" in err, err


def test_end_to_end_with_output(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workloads = []
    for index in (1, 2):
        path = tmp_path / f"small-{index}.csv"
        rows = [f"toy-{i},{i * 40 * index},toy,{1 + i % 3},{16 * (1 + i % 3)}" for i in range(6)]
        path.write_text("name,time,application,num_replicas,batch_size\n" + "\n".join(rows) + "\n")
        workloads.append(str(path))
    out_dir = tmp_path / "out"
    code, out, err = _run(
        [
            "simulate",
            *workloads,
            "--traces",
            str(toy_traces),
            "--policy",
            "tiresias,optimus",
            "--nodes",
            "2",
            "--jobs",
            "2",
            "--output",
            str(out_dir),
        ],
        capsys,
    )
    assert code == 0, err
    assert "jobs" in err  # the progress bar
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["policy", "workload", "jobs"]
    assert sum(line.startswith(("tiresias", "optimus")) for line in lines) == 4
    for policy in ("tiresias", "optimus"):
        summary = json.loads((out_dir / policy / "summary.json").read_text())
        assert set(summary) == {"jcts", "avgs", "mean", "cluster", "traces"}
        assert summary["cluster"] == "2 nodes x 4 GPUs, 60 s interval, no interference, seed 0"
        assert set(summary["jcts"]) == {"small-1", "small-2"}
        assert len(summary["jcts"]["small-1"]) == 6
        # Whole seconds are integers, as in the published summary files.
        assert all(type(jct) is int for jct in summary["jcts"]["small-1"].values())
        avgs = summary["avgs"]
        assert summary["mean"] == pytest.approx(sum(avgs.values()) / 2)
    png = out_dir / "jct.png"
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not (POLLUX_DATA / "traces").is_dir(), reason="shared/pollux-data absent")
def test_published_workload_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = (POLLUX_DATA / "workloads" / "workload-1.csv").read_text().splitlines()
    path = tmp_path / "head.csv"
    path.write_text("\n".join(lines[:21]) + "\n")
    traces = POLLUX_DATA / "traces"
    out_dir = tmp_path / "out"
    code, out, err = _run(
        ["simulate", str(path), "--traces", str(traces), "--no-progress", "--output", str(out_dir)]
        + ["--policy", "tiresias"],
        capsys,
    )
    assert code == 0, err
    assert err == ""
    # The CLI reports what the library computes for the same workload.
    expected = simulate(str(path), "tiresias", traces_dir=str(traces))
    summary = json.loads((out_dir / "tiresias" / "summary.json").read_text())
    assert summary["jcts"]["head"] == expected.jcts
    average = sum(expected.jcts.values()) / len(expected.jcts)
    assert summary["avgs"]["head"] == pytest.approx(average, abs=0.05)
    row = next(line for line in out.splitlines() if line.startswith("tiresias"))
    assert row.split()[1:4] == ["head", "20", f"{average:.1f}"]


@pytest.mark.parametrize("blocker", ["tiresias", "jct.png"])
def test_output_paths_are_checked_before_any_run(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str], blocker: str
) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application\na,1,toy\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    if blocker == "jct.png":
        (out_dir / blocker).mkdir()  # a folder where the plot goes
    else:
        (out_dir / blocker).write_text("not a folder\n")  # a file where a folder goes
    argv = ["simulate", str(path), "--traces", str(toy_traces), "--policy", "optimus,tiresias"]
    code, out, err = _run([*argv, "--output", str(out_dir), "--no-progress"], capsys)
    assert code == 1 and "Traceback" not in err
    assert f"--output {out_dir}: {out_dir / blocker} exists and is not a" in err
    assert out == ""  # no simulation ran
    assert sorted(p.name for p in out_dir.iterdir()) == [blocker]  # nothing written


def test_empty_output_is_rejected(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application\na,1,toy\n")
    code, out, err = _run(
        ["simulate", str(path), "--traces", str(toy_traces), "--output", ""], capsys
    )
    assert code == 2 and out == ""
    assert "--output '': expected a directory path" in err


def test_cluster_size_is_bounded(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application\na,1,toy\n")
    argv = ["simulate", str(path), "--traces", str(toy_traces), "--nodes", "250001"]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert "--nodes 250001 --gpus-per-node 4: 1000004 GPUs; at most 1000000 can be simulated" in err


def test_traces_from_the_environment_are_named_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application\na,1,toy\n")
    monkeypatch.setenv("ADAPTDL_SIM_TRACES", str(tmp_path / "nope"))
    code, _, err = _run(["simulate", str(path)], capsys)
    assert code == 1
    assert f"adaptdl: error: ADAPTDL_SIM_TRACES: {tmp_path / 'nope'}: trace directory" in err
    assert "--traces" not in err


def _cli(*argv: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "adaptdl.cli", "simulate", *argv]


def _piped(csv: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``adaptdl simulate argv...`` in a new process, with ``csv`` on its standard input."""
    return subprocess.run(_cli(*argv), input=csv, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("given", ["/dev/stdin", "-"])
def test_a_workload_from_a_pipe_is_read_once(tmp_path: Path, toy_traces: Path, given: str) -> None:
    csv = "name,time,application,num_replicas,batch_size\na,1,toy,1,8\nb,30,toy,2,16\n"
    proc = _piped(
        csv, given, "--traces", str(toy_traces), "--policy", "tiresias,optimus", "--no-progress"
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[:3] for line in proc.stdout.splitlines()[2:]]
    assert rows == [["tiresias", "stdin", "2"], ["optimus", "stdin", "2"]]


def test_standard_input_is_read_once_only(
    toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(["simulate", "-", "-", "--traces", str(toy_traces)], capsys)
    assert code == 2
    assert "- (standard input) is given more than once; it can be read only once" in err


def test_errors_in_a_workload_from_standard_input_name_it(toy_traces: Path) -> None:
    proc = _piped("name,time\na,1\n", "-", "--traces", str(toy_traces))
    assert proc.returncode == 1
    assert "adaptdl: error: - (standard input):1: missing column(s): application" in proc.stderr


def test_later_errors_in_a_workload_from_standard_input_name_it(toy_traces: Path) -> None:
    # Found by the simulator's checks, after reading: it said /dev/stdin.
    csv = "name,time,application,num_replicas,batch_size\na,1,toy,1,1000\n"
    proc = _piped(csv, "-", "--traces", str(toy_traces), "--policy", "tiresias")
    assert proc.returncode == 1
    assert "error: tiresias: - (standard input):2: column 'batch_size': job 'a'" in proc.stderr


def test_a_closed_standard_input_is_a_clear_error(toy_traces: Path) -> None:
    proc = subprocess.run(
        _cli("-", "--traces", str(toy_traces)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.close(0),
    )
    assert proc.returncode == 1
    assert "- (standard input): it is closed; give the workload's file instead" in proc.stderr


def test_simulate_takes_parsed_jobs(tmp_path: Path, toy_traces: Path) -> None:
    from adaptdl.sim import read_workload, simulate

    path = tmp_path / "w.csv"
    path.write_text("name,time,application,num_replicas,batch_size\na,1,toy,1,8\nb,30,toy,2,16\n")
    from_path = simulate(path, "tiresias", traces_dir=toy_traces)
    jobs = read_workload(path, {"toy"})
    from_jobs = simulate(jobs, "tiresias", traces_dir=toy_traces, name="w")
    assert from_jobs.workload == from_path.workload == "w"
    assert from_jobs.jcts == from_path.jcts
    assert simulate(jobs, "tiresias", traces_dir=toy_traces).workload == "workload"


def _workers(parent: int) -> set[int]:
    """Live multiprocessing workers (spawn_main) whose parent is ``parent``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == parent and fields[0] != "Z" and b"spawn_main" in cmdline:
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def _wait_for(predicate: Callable[[], object], timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def _slow_workload(path: Path, jobs: int) -> Path:
    """Jobs queued on a 1-GPU cluster, ticked every second: about 0.2 s of CPU per job."""
    rows = [f"j{i},0,toy,1,8" for i in range(jobs)]
    path.write_text("name,time,application,num_replicas,batch_size\n" + "\n".join(rows) + "\n")
    return path


# Tiresias: deterministic, and its jobs ask for the one GPU there is.
_SLOW = (
    *("--nodes", "1", "--gpus-per-node", "1", "--interval", "1"),
    *("--no-progress", "--policy", "tiresias"),
)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(("signum", "status"), [(2, 130), (15, 143)])
def test_a_signal_to_the_parent_stops_the_workers(
    tmp_path: Path, toy_traces: Path, signum: int, status: int
) -> None:
    import os
    import signal
    import time

    workload = _slow_workload(tmp_path / "slow.csv", 300)  # about a minute of simulation
    argv = _cli(str(workload), "--traces", str(toy_traces), *_SLOW, "--output", str(tmp_path / "o"))
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the signal reaches the parent only, as `kill PID` sends it
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    workers: set[int] = set()
    try:
        assert _wait_for(lambda: _workers(proc.pid), 60), "no worker started"
        workers = _workers(proc.pid)
        time.sleep(1.0)  # let the simulation get going
        sent = time.monotonic()
        os.kill(proc.pid, signum)
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - sent < 30  # ~1 s; the bug this guards took a minute
        assert proc.returncode == status, err
        name = signal.Signals(signum).name
        assert f"({name}): stopped 1 running simulation(s)" in err and "Traceback" not in err
        assert out == "" and not (tmp_path / "o" / "tiresias").exists()
        assert _wait_for(lambda: not any(_alive(pid) for pid in workers), 3), "worker survived"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for pid in workers:  # orphans of a parent that did not stop them
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("kills", [1, 2])
def test_a_killed_worker_costs_only_its_run(tmp_path: Path, toy_traces: Path, kills: int) -> None:
    import os
    import signal
    import time

    fast = tmp_path / "fast.csv"
    fast.write_text("name,time,application\na,1,toy\n")
    slow = _slow_workload(tmp_path / "slow.csv", 25)  # a few seconds
    argv = _cli(str(slow), str(fast), "--traces", str(toy_traces), *_SLOW, "--jobs", "1")
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    killed: set[int] = set()
    try:
        for _ in range(kills):
            # One worker at a time (--jobs 1), and the slow run comes first (and
            # is retried first): whenever the newest worker dies, it holds it.
            assert _wait_for(lambda: _workers(proc.pid) - killed, 60), "no worker started"
            (worker,) = _workers(proc.pid) - killed
            time.sleep(1.0)
            os.kill(worker, signal.SIGKILL)  # as the out-of-memory killer would
            killed.add(worker)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in err
    assert "tiresias on " + str(slow) + ": its worker process was killed by SIGKILL" in err
    rows = [line.split()[:2] for line in out.splitlines()[2:]]
    if kills == 1:  # run again in a fresh worker: every result is there
        assert proc.returncode == 0, err
        assert "running it again" in err
        assert rows == [["tiresias", "slow"], ["tiresias", "fast"]]
    else:  # twice: only that run fails, the finished one is kept
        assert proc.returncode == 1
        assert "(out of memory?) (twice)" in err
        assert f"1 of 2 simulations failed (tiresias on {slow}); the table shows the others" in err
        assert rows == [["tiresias", "fast"]]


def _small_workload(tmp_path: Path) -> Path:
    path = tmp_path / "small.csv"
    rows = [f"toy-{i},{i * 40},toy,1,16" for i in range(4)]
    path.write_text("name,time,application,num_replicas,batch_size\n" + "\n".join(rows) + "\n")
    return path


def _two_workloads(tmp_path: Path, traces: Path, out_dir: Path) -> tuple[Path, Path, list[str]]:
    """Two small workloads of different job names, and options writing to ``out_dir``."""
    first = _small_workload(tmp_path)
    second = tmp_path / "second.csv"
    second.write_text(first.read_text().replace("toy-", "job-"))
    argv = ["--traces", str(traces), "--nodes", "2", "--no-progress", "--output", str(out_dir)]
    return first, second, argv


class _FailingStdout(io.StringIO):
    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def write(self, text: str) -> int:
        raise self.error


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (BrokenPipeError(errno.EPIPE, "Broken pipe"), 141, ""),
        (OSError(errno.ENOSPC, "No space left on device"), 1, "cannot print the results"),
    ],
)
def test_results_are_written_even_when_stdout_fails(
    tmp_path: Path,
    toy_traces: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: OSError,
    code: int,
    message: str,
) -> None:
    out_dir = tmp_path / "out"
    argv = ["simulate", str(_small_workload(tmp_path)), "--traces", str(toy_traces)]
    argv += ["--nodes", "2", "--no-progress", "--output", str(out_dir), "--policy", "tiresias"]
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", _FailingStdout(error))
    monkeypatch.setattr(sys, "stderr", err)
    if code == 141:  # main() points the broken stdout's descriptor at /dev/null
        monkeypatch.setattr(_FailingStdout, "fileno", lambda self: os.dup(1), raising=False)
    assert main(argv) == code
    assert json.loads((out_dir / "tiresias" / "summary.json").read_text())["jcts"]
    assert message in err.getvalue()
    if message:
        assert f"the files were written ({out_dir / 'tiresias' / 'summary.json'}" in err.getvalue()


class _BrokenStream(io.StringIO):
    """A stream every write to which fails, as a full disk or a gone reader makes it."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stderr", [_BrokenStream(), None], ids=["failing", "closed"])
def test_a_failing_or_closed_stderr_costs_only_the_progress_bar(
    tmp_path: Path,
    toy_traces: Path,
    monkeypatch: pytest.MonkeyPatch,
    stderr: io.StringIO | None,
) -> None:
    # The bar's first write used to end the run with a traceback (or, for a
    # closed stderr, an AttributeError before any run), losing the results.
    out_dir = tmp_path / "out"
    argv = ["simulate", str(_small_workload(tmp_path)), "--traces", str(toy_traces)]
    argv += ["--nodes", "2", "--output", str(out_dir), "--policy", "tiresias,optimus"]
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main(argv) == 0
    assert out.getvalue().count("small") == 2  # one table row per policy
    assert json.loads((out_dir / "optimus" / "summary.json").read_text())["jcts"]["small"]


def test_a_closed_stdout_is_a_clear_error(
    tmp_path: Path, toy_traces: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "out"
    argv = ["simulate", str(_small_workload(tmp_path)), "--traces", str(toy_traces)]
    argv += ["--nodes", "2", "--no-progress", "--output", str(out_dir), "--policy", "tiresias"]
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(sys, "stderr", err)
    assert main(argv) == 1
    assert "cannot print the results to standard output (it is closed); the files were" in (
        err.getvalue()
    )
    assert (out_dir / "tiresias" / "summary.json").exists()


def test_max_jobs_simulates_the_first_jobs_of_each_file(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", str(_small_workload(tmp_path)), "--traces", str(toy_traces)]
    argv += ["--nodes", "2", "--no-progress", "--policy", "tiresias", "--output", str(tmp_path)]
    code, out, err = _run([*argv, "--max-jobs", "3"], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "tiresias" / "summary.json").read_text())
    assert sorted(summary["jcts"]["small"]) == ["toy-0", "toy-1", "toy-2"]
    # Truncated workloads are not averaged with whole ones in one summary.
    assert summary["cluster"].endswith(", seed 0, first 3 jobs")
    other = tmp_path / "other.csv"
    other.write_text(_small_workload(tmp_path).read_text())
    # Whole workloads into the same folder would drop the truncated results:
    # refused before any run, and the file is left as it was.
    before = (tmp_path / "tiresias" / "summary.json").read_text()
    code, _, err = _run([*argv[:1], str(other), *argv[2:]], capsys)
    assert code == 2 and "holds results of small from a run on " in err, err
    assert "choose another --output" in err
    assert (tmp_path / "tiresias" / "summary.json").read_text() == before
    # Running the same workload again, whole, replaces its own result.
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "tiresias" / "summary.json").read_text())
    assert not summary["cluster"].endswith("jobs") and summary["traces"] == str(
        toy_traces.resolve()
    )
    code, _, err = _run([*argv, "--max-jobs", "0"], capsys)
    assert code == 2 and "--max-jobs 0: must be at least 1" in err


def test_results_of_other_workloads_are_kept_in_the_summary(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A second workload written to the same folder used to replace the
    # first one's results without a word.
    out_dir = tmp_path / "out"
    first, second, argv = _two_workloads(tmp_path, toy_traces, out_dir)
    code, _, err = _run(["simulate", str(first), *argv, "--policy", "tiresias,optimus"], capsys)
    assert code == 0, err
    path = out_dir / "tiresias" / "summary.json"
    code, _, err = _run(["simulate", str(second), *argv, "--policy", "tiresias"], capsys)
    assert code == 0, err
    assert f"kept the earlier results of small in {path}" in err
    summary = json.loads(path.read_text())
    assert sorted(summary["jcts"]) == sorted(summary["avgs"]) == ["second", "small"]
    assert summary["mean"] == pytest.approx(sum(summary["avgs"].values()) / 2)
    optimus = out_dir / "optimus" / "summary.json"
    assert (
        f"left from an earlier run over other workloads (it covers small; this run's results "
        f"cover second, small): {optimus}" in err
    )
    # Run again, the same workload replaces its own result, silently.
    code, _, err = _run(["simulate", str(first), *argv, "--policy", "tiresias"], capsys)
    assert code == 0 and "kept the earlier results of second" in err and "replaced" not in err
    # On another cluster, dropping the others would lose them: refused.
    code, _, err = _run(
        ["simulate", str(first), *argv, "--policy", "tiresias", "--nodes", "3"], capsys
    )
    assert code == 2 and f"{path} holds results of second from a run on 2 nodes" in err, err
    assert sorted(json.loads(path.read_text())["avgs"]) == ["second", "small"]
    # So are other traces (the cluster label alone used to merge them).
    other_traces = tmp_path / "traces-copy"
    shutil.copytree(toy_traces, other_traces)
    code, _, err = _run(
        ["simulate", str(first), *argv, "--policy", "tiresias", "--traces", str(other_traces)],
        capsys,
    )
    assert code == 2 and f"traces {other_traces.resolve()}; choose another --output" in err, err


@pytest.mark.parametrize(
    ("avgs", "jcts"),
    [
        ('{"old": "1"}', '{"old": {"x": 1}}'),
        ('{"old": 1}', '{"old": [1, 2]}'),
        ('{"old": true}', '{"old": {"x": 1}}'),
        ('{"old": 1}', '{"old": {"x": null}}'),
    ],
)
def test_a_summary_with_bad_values_is_replaced_not_fatal(
    avgs: str, jcts: str, tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Merging it failed after the run (a TypeError in the mean, or in the
    # plot) with a traceback, and the run's results were lost.
    out_dir = tmp_path / "out"
    path = out_dir / "tiresias" / "summary.json"
    path.parent.mkdir(parents=True)
    path.write_text(f'{{"jcts": {jcts}, "avgs": {avgs}, "mean": 1}}')
    argv = ["simulate", str(_small_workload(tmp_path)), "--traces", str(toy_traces)]
    argv += ["--nodes", "2", "--no-progress", "--policy", "tiresias", "--output", str(out_dir)]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    assert any(line.startswith("tiresias") for line in out.splitlines()), out  # the table
    assert f"replaced a file that is not a readable summary: {path}" in err
    assert sorted(json.loads(path.read_text())["avgs"]) == ["small"]


def test_runs_whose_options_differ_beyond_six_digits_are_not_merged(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The label printed the interval with :g, so 600 and 600.0004 s were
    # "the same cluster" and their results were averaged together.
    out_dir = tmp_path / "out"
    first, second, argv = _two_workloads(tmp_path, toy_traces, out_dir)
    argv += ["--policy", "tiresias"]
    code, _, err = _run(["simulate", str(first), *argv, "--interval", "600"], capsys)
    assert code == 0, err
    code, _, err = _run(["simulate", str(second), *argv, "--interval", "600.0004"], capsys)
    assert code == 2 and "600.0004 s interval" in err, err
    summary = json.loads((out_dir / "tiresias" / "summary.json").read_text())
    assert summary["cluster"].startswith("2 nodes x 4 GPUs, 600 s interval")


def test_the_plot_compares_policies_over_the_workloads_they_share(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # tiresias's summary keeps an earlier workload that optimus never ran:
    # the picture used to pool it anyway, titled "2 workloads pooled".
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "out"
    first, second, argv = _two_workloads(tmp_path, toy_traces, out_dir)
    assert _run(["simulate", str(first), *argv, "--policy", "tiresias"], capsys)[0] == 0
    code, _, err = _run(["simulate", str(second), *argv, "--policy", "tiresias,optimus"], capsys)
    assert code == 0, err
    plot = out_dir / "jct.png"
    assert f"{plot} compares only the workloads every policy covers (second), not small" in err
    assert plot.stat().st_size > 0


def test_results_of_another_cluster_left_in_the_folder_are_pointed_out(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "out"
    argv = ["simulate", str(_small_workload(tmp_path)), "--traces", str(toy_traces)]
    argv += ["--no-progress", "--output", str(out_dir)]
    code, _, err = _run([*argv, "--policy", "tiresias,optimus", "--nodes", "2"], capsys)
    assert code == 0 and "earlier run" not in err
    code, _, err = _run([*argv, "--policy", "tiresias", "--nodes", "2"], capsys)
    assert code == 0 and "earlier run" not in err  # optimus's is from the same cluster
    # A file from before the field existed cannot be told apart: no note.
    (out_dir / "old").mkdir()
    (out_dir / "old" / "summary.json").write_text('{"jcts": {}, "avgs": {}, "mean": 0}')
    code, _, err = _run([*argv, "--policy", "tiresias", "--nodes", "3"], capsys)
    assert code == 0 and str(out_dir / "old") not in err
    assert (
        "left from an earlier run on another cluster or traces: "
        f"{out_dir / 'optimus' / 'summary.json'}" in err
    )


def test_the_progress_line_counts_failed_runs() -> None:
    from adaptdl.cli._simulate import _ProgressBar

    stream = io.StringIO()
    bar = _ProgressBar({0: 4, 1: 4}, stream, enabled=True)
    bar.start(0)
    bar.start(1)
    bar.update(0, 120.0, 3)
    bar.finish(0)
    bar.finish(1, failed=True)
    bar.draw()
    # The failed run's jobs did not complete: the bar used to count them (8/8).
    assert "4/8 jobs, 2/2 runs (1 failed), simulated" in stream.getvalue()


def test_the_progress_clock_follows_the_slowest_running_simulation() -> None:
    from adaptdl.cli._simulate import _ProgressBar

    stream = io.StringIO()
    bar = _ProgressBar({0: 4, 1: 4}, stream, enabled=True)
    bar.start(0)
    bar.start(1)
    bar.update(0, 7200.0, 4)
    bar.update(1, 3600.0, 1)
    bar.finish(0)
    bar.draw()
    # The finished run's 2 h used to stay on screen while the other ran on.
    assert stream.getvalue().endswith("5/8 jobs, 1/2 runs, simulated 1.0 h\n")


def test_an_output_folder_is_not_left_behind_when_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "traces"
    gap = toy.make_toy_traces(root, "gap")  # lacks what the job needs: the run fails
    placements = gap / "placements.csv"
    kept = [line for line in placements.read_text().splitlines() if not line.startswith("2,8,")]
    placements.write_text("\n".join(kept) + "\n")
    bad = tmp_path / "bad.csv"
    bad.write_text("name,time,application,num_replicas,batch_size\nb,1,gap,2,16\n")
    output = tmp_path / "new" / "results"
    argv = ["simulate", str(bad), "--traces", str(root), "--no-progress", "--output", str(output)]
    code, _, err = _run(argv, capsys)
    assert code == 1 and "1 of 1 simulations failed" in err, err
    assert not (tmp_path / "new").exists()
    # A folder that was there before stays, empty or not.
    output.mkdir(parents=True)
    code, _, err = _run(argv, capsys)
    assert code == 1 and output.is_dir()


def test_ctrl_c_while_the_parser_is_built_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import adaptdl.cli as cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["simulate", "x.csv"]) == 130
    assert capsys.readouterr().err == "adaptdl: interrupted\n"


_PLUGIN = """
from adaptdl.sched import Decision, Policy, register_policy


class Fifo(Policy):
    \"\"\"Each job, in submission order, gets one GPU on the first node with room.\"\"\"

    def optimize(self, jobs, nodes, previous, now):
        free = {name: node.resources.get("gpu", 0) for name, node in nodes.items()}
        used = {name: 0 for name in nodes}
        out = {}
        for name in sorted(jobs, key=lambda n: (jobs[n].submission_time, n)):
            node = next((n for n in sorted(nodes) if used[n] < free[n]), None)
            out[name] = (node,) if node is not None else ()
            if node is not None:
                used[node] += 1
        return Decision(out)


register_policy("plugin-fifo", Fifo)
"""


def test_a_plugin_module_registers_a_policy_for_every_worker(
    tmp_path: Path,
    toy_traces: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # There was no way to simulate one's own policy from the CLI: the
    # workers (spawned) look the name up again.
    from adaptdl.sched import _types

    (tmp_path / "my_policies.py").write_text(_PLUGIN)
    monkeypatch.chdir(tmp_path)  # imported from the current directory
    monkeypatch.setattr(_types, "_REGISTRY", dict(_types._REGISTRY))  # unregistered after
    monkeypatch.setattr(sys, "path", list(sys.path))
    workload = tmp_path / "w.csv"
    rows = [f"toy-{i},{i * 30},toy,1,16" for i in range(4)]
    workload.write_text("name,time,application,num_replicas,batch_size\n" + "\n".join(rows) + "\n")
    argv = ["simulate", str(workload), "--traces", str(toy_traces), "--nodes", "1"]
    code, _, err = _run([*argv, "--policy", "plugin-fifo"], capsys)
    assert code == 2 and "unknown policy 'plugin-fifo'" in err
    code, out, err = _run(
        [*argv, "--plugin", "my_policies", "--policy", "plugin-fifo,tiresias", "--jobs", "2"],
        capsys,
    )
    assert code == 0, err
    assert sum(line.startswith(("plugin-fifo", "tiresias")) for line in out.splitlines()) == 2
    code, _, err = _run([*argv, "--plugin", "no_such_module", "--policy", "tiresias"], capsys)
    assert code == 1 and "--plugin 'no_such_module' cannot be imported: ModuleNotFoundError" in err
    assert f"(looked in the installed packages, then in {tmp_path})" in err
    # A malformed name is a usage error, as the README's exit codes say (it exited 1).
    code, _, err = _run([*argv, "--plugin", "./my_policies.py", "--policy", "tiresias"], capsys)
    assert code == 2 and "not a file path" in err
    # A factory that raises is one line, whatever it raises.
    (tmp_path / "bad_factory.py").write_text(
        "from adaptdl.sched import register_policy\n"
        "def make(**kwargs):\n    raise RuntimeError('license server unreachable')\n"
        "register_policy('plugin-bad', make)\n"
    )
    code, _, err = _run([*argv, "--plugin", "bad_factory", "--policy", "plugin-bad"], capsys)
    assert code == 1 and "Traceback" not in err
    assert "plugin-bad: its factory failed: RuntimeError: license server unreachable" in err
    # A plugin that fails only in the workers says why, not "unknown policy".
    (tmp_path / "worker_fails.py").write_text(
        "import multiprocessing\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    raise RuntimeError('no GPU driver in this process')\n"
        + _PLUGIN.replace("plugin-fifo", "plugin-wf")
    )
    code, _, err = _run([*argv, "--plugin", "worker_fails", "--policy", "plugin-wf"], capsys)
    assert code == 1 and "RuntimeError: no GPU driver in this process" in err
    assert "in a simulation worker" in err and "unknown policy" not in err
    # An exception in a policy is the policy's, with its traceback, not an "internal error".
    (tmp_path / "crashing.py").write_text(
        _PLUGIN.replace("plugin-fifo", "plugin-crash").replace(
            "        free = {", "        {}['oops']\n        free = {"
        )
    )
    code, _, err = _run([*argv, "--plugin", "crashing", "--policy", "plugin-crash"], capsys)
    assert code == 1 and "internal error" not in err
    assert "policy 'plugin-crash' at t=60s raised KeyError in optimize(): 'oops'" in err
    assert f'File "{tmp_path / "crashing.py"}"' in err
    # Files in the current directory do not hide installed modules.
    assert sys.path.index(str(tmp_path)) > sys.path.index(os.path.dirname(os.__file__))


def test_runs_side_by_side_into_one_output_keep_every_workload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each run read, merged and renamed the summary: one of two concurrent
    # runs dropped the workload the other had just written.
    import threading
    import time

    from adaptdl.cli import _simulate

    merge = _simulate._merge_summary

    def slow_merge(*args: Any, **kwargs: Any) -> Any:
        summary = merge(*args, **kwargs)
        time.sleep(0.3)  # between the read and the rename
        return summary

    monkeypatch.setattr(_simulate, "_merge_summary", slow_merge)
    monkeypatch.setattr(_simulate, "_plot", lambda path, summaries, notes: None)
    setup = _simulate._Setup("c", "/traces")

    def write(workload: str) -> None:
        row = {"policy": "p", "workload": workload, "jcts": {"j": 1.0}, "summary": {"avg_jct": 1}}
        assert _simulate._write_outputs(tmp_path, ["p"], [row], setup).error is None

    threads = [threading.Thread(target=write, args=(f"w{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert sorted(summary["avgs"]) == ["w0", "w1", "w2"]
