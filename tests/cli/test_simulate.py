"""``adaptdl simulate``: option errors, input errors, end-to-end with --output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptdl.cli import main
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
        (["--seed", "-1"], "--seed -1: must be an integer >= 0"),
        (["--interval", "1e-9"], "--interval 1e-09: must be a finite number of seconds >= 1"),
        (["--gpus-per-node", "8"], "--gpus-per-node 8: the toy traces (used by "),
        (["--output", "w.csv"], "w.csv: exists and is not a directory"),
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
    assert code == 1 and message in err, err


def test_fixed_size_job_wider_than_the_cluster(
    tmp_path: Path, toy_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application,num_replicas,batch_size\na,1,toy,6,64\n")
    argv = ["simulate", str(path), "--traces", str(toy_traces), "--nodes", "1"]
    code, _, err = _run(argv, capsys)
    assert code == 1, err
    assert f"tiresias on {path}: {path}:2: job 'a' needs 6 GPUs but the cluster has 4" in err
    for policy in ("pollux", "optimus"):  # they choose the width themselves
        code, _, err = _run([*argv, "--policy", policy, "--no-progress"], capsys)
        assert code == 0, err


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
    import subprocess
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
    assert code == 1 and "--traces:" in err and "not found" in err


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
        assert set(summary) == {"jcts", "avgs", "mean"}
        assert set(summary["jcts"]) == {"small-1", "small-2"}
        assert len(summary["jcts"]["small-1"]) == 6
        avgs = summary["avgs"]
        assert summary["mean"] == pytest.approx(sum(avgs.values()) / 2)
    png = out_dir / "jct.png"
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not (POLLUX_DATA / "traces").is_dir(), reason="shared/pollux-data absent")
def test_published_workload_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = (POLLUX_DATA / "workloads" / "workload-1.csv").read_text().splitlines()
    path = tmp_path / "head.csv"
    path.write_text("\n".join(lines[:21]) + "\n")
    code, out, err = _run(
        ["simulate", str(path), "--traces", str(POLLUX_DATA / "traces"), "--no-progress"], capsys
    )
    assert code == 0, err
    assert "head" in out and err == ""
