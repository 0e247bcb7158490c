"""Every benchmark runs end to end at smoke size and writes its results.

The full benchmarks are run by hand (see README); CI only proves that each
script still works and writes a JSON file plus a markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
POLLUX_DATA = ROOT.parent / "shared" / "pollux-data"
PYTHON = sys.executable

#: (script, extra arguments, results name, seconds allowed)
CASES = [
    ("collective.py", [], "collective_smoke", 120),
    ("policy_speed.py", [], "policy_speed_smoke", 180),
    (
        "simulate.py",
        ["--policies", "tiresias,optimus,adaptdl", "--jobs", "1"],
        "simulate_smoke",
        300,
    ),
    ("overhead.py", [], "overhead_smoke", 300),
    ("time_to_target.py", [], "time_to_target_smoke", 300),
    ("rescale.py", [], "rescale_smoke", 300),
]


@pytest.mark.parametrize("script,args,name,limit", CASES, ids=[c[0] for c in CASES])
def test_benchmark_smoke(script: str, args: list[str], name: str, limit: int) -> None:
    if script == "simulate.py" and not POLLUX_DATA.is_dir():
        pytest.skip(f"the Pollux data is not beside the checkout ({POLLUX_DATA})")
    for suffix in (".json", ".md"):
        (RESULTS / f"{name}{suffix}").unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [PYTHON, str(ROOT / "benchmarks" / script), "--smoke", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=limit,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((RESULTS / f"{name}.json").read_text())
    assert data.get("rows"), f"{script} wrote no rows: {data}"
    # Which code and which solver produced the numbers travel with them.
    meta = data["meta"]
    assert meta["source"] and not meta["source"].startswith("unknown"), meta
    assert "scipy " in meta["packages"] and "numpy " in meta["packages"], meta
    table = (RESULTS / f"{name}.md").read_text()
    assert "|" in table


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("collective.py", ["--iterations", "0"], "--iterations must be >= 1, got 0"),
        ("policy_speed.py", ["--rounds", "0"], "--rounds must be >= 1, got 0"),
        ("overhead.py", ["--steps", "0"], "argument --steps: expected an int >= 1, got '0'"),
        ("simulate.py", ["--workloads", "5"], "--workloads '5': expected a comma-separated"),
        ("simulate.py", ["--jobs", "0"], "argument --jobs: expected an int >= 1, got '0'"),
        # The example would silently train on the digits instead.
        ("time_to_target.py", ["--data", "mnist", "--data-dir", "/nonexistent"], "needs"),
    ],
)
def test_bad_benchmark_options_are_refused(script: str, args: list[str], message: str) -> None:
    proc = subprocess.run(
        [PYTHON, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
