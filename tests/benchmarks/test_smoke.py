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
        # These ended in tracebacks, or ran with NaN losses and exited 0.
        ("time_to_target.py", ["--lr", "-1"], "argument --lr: expected a finite number"),
        ("time_to_target.py", ["--gamma", "-1"], "argument --gamma: expected a finite number"),
        ("time_to_target.py", ["--target", "nan"], "argument --target: expected a finite"),
        ("time_to_target.py", ["--target", "1.5"], "--target: expected an accuracy in (0, 1]"),
        ("time_to_target.py", ["--smoke", "--repeats", "2"], "leave out --repeats"),
        ("policy_speed.py", ["--seed", "-1"], "argument --seed: expected an int >= 0, got '-1'"),
        # A preload the zygote cannot import was only logged, and ignored.
        ("rescale.py", ["--preload", "nosuchmod"], "--preload: no module named 'nosuchmod'"),
        ("rescale.py", ["--preload", "a b"], "--preload 'a b': 'a b' is not a module name"),
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


def test_markdown_cells_keep_the_digits_of_the_json() -> None:
    # ".4g" turned 47840.8 into 4.784e+04 and 2473.7 into 2474.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _common import markdown_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    table = markdown_table([{"p99": 47840.8, "avg": 2473.7, "ratio": 1.0397, "tiny": 1e-12}])
    assert table.splitlines()[2] == "| 47840.8 | 2473.7 | 1.0397 | 1.000000e-12 |"


def test_committed_markdown_matches_its_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _common import markdown_document
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for path in sorted(RESULTS.glob("*.json")):
        if path.stem.endswith("_smoke"):
            continue
        data = json.loads(path.read_text())
        expected = markdown_document(data["name"], data["meta"], data["rows"])
        assert path.with_suffix(".md").read_text() == expected, path.name
