"""Shared helper of the benchmark scripts: write results as JSON and a markdown table.

Every ``benchmarks/<name>.py`` ends with :func:`write_results`, so the results
directory always holds a machine-readable file (for comparisons across runs)
next to a table that can be pasted into a report or a pull request.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS_DIR",
    "at_least",
    "command_line",
    "markdown_table",
    "package_versions",
    "source_state",
    "write_results",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def at_least(minimum: float, kind: type[int] | type[float] = int) -> Callable[[str], Any]:
    """An argparse ``type`` that parses ``kind`` and refuses values below ``minimum``.

    argparse then names the option: ``argument --steps: expected an int >= 1,
    got '0'`` (a bad count used to end in a traceback deep inside a run, or
    to be swapped silently for the default).
    """

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not minimum <= value < float("inf"):
            what = "an int" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"expected {what} >= {minimum:g}, got {text!r}")
        return value

    return parse


def command_line(script: str, argv: list[str] | None = None) -> str:
    """How a run was started, every option included, for its results' metadata.

    Args:
        script: the file name under ``benchmarks/``.
        argv: the arguments ``main`` was given; None means ``sys.argv[1:]``
            (an explicit empty list means none, not the process's own).
    """
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"benchmarks/{script}", *args])


#: Packages whose versions change results: HiGHS (in scipy) breaks ties
#: between equally good schedules differently from one release to the next.
_PACKAGES = ("numpy", "scipy", "torch")


def source_state() -> str:
    """The commit of the ``adaptdl`` code that runs, ``-dirty`` when it was edited.

    Asked of the imported package's own checkout, not of the folder holding
    these scripts: with an editable install elsewhere, or an older checkout
    of the benchmarks, the two differ (and the result says so). A result
    recorded from an edited working tree cannot be reproduced from any
    commit; edited tracked files anywhere, or new files under ``src/``, mark
    it. Changes under ``benchmarks/results/`` do not count: one benchmark's
    fresh results must not mark the next one's.
    """
    import adaptdl

    code = Path(adaptdl.__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=code, capture_output=True, text=True, timeout=30, check=False
        )

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        tracked = git("ls-files", "--error-unmatch", "__init__.py")
        if head.returncode != 0 or tracked.returncode != 0:
            # Not a checkout, or an installed copy inside one (a .venv in it).
            return f"unknown (adaptdl from {code} is not tracked by git)"
        edits = git(
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ":/",
            ":(exclude,top)benchmarks/results",
        ).stdout.strip()
        edits += git("status", "--porcelain", "--untracked-files=all", "--", ":(top)src").stdout
        top = Path(git("rev-parse", "--show-toplevel").stdout.strip())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    state = head.stdout.strip() + ("-dirty" if edits.strip() else "")
    if top.resolve() != RESULTS_DIR.parent.parent.resolve():
        state += f" (adaptdl imported from {code}, not from this checkout)"
    return state


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that results depend on."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _format(value: Any) -> str:
    # As many digits as the JSON holds (its values are rounded where they
    # are written), so a table cell can be matched to the JSON exactly.
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e10:
            return f"{value:.10g}"
        return f"{value:.6e}"
    return str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Render ``rows`` as a markdown table; columns in first-seen key order."""
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    if not columns:
        return "(no rows)\n"
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_format(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def write_results(name: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write ``results/<name>.json`` and ``results/<name>.md``.

    Args:
        name: the benchmark's name, used as the file stem (letters, digits,
            ``_``, ``-`` and ``.``).
        rows: one dict per measurement; values must be JSON-serialisable.
        meta: how the numbers were obtained (command, parameters); the date,
            Python version, platform, CPU count, source commit and package
            versions are added automatically because numbers mean little
            without them.

    Raises:
        ValueError: ``name`` is not a plain file stem.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name must be a plain file stem like 'collective', got {name!r}")
    full_meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "source": source_state(),
        "packages": ", ".join(f"{k} {v}" for k, v in package_versions().items()),
        **meta,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    with open(RESULTS_DIR / f"{name}.json", "w") as f:
        json.dump({"name": name, "meta": full_meta, "rows": rows}, f, indent=2, default=str)
        f.write("\n")
    with open(RESULTS_DIR / f"{name}.md", "w") as f:
        f.write(markdown_document(name, full_meta, rows))


def markdown_document(name: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The ``results/<name>.md`` of a result: its meta as a list, then its table."""
    meta_lines = "\n".join(f"- {key}: `{value}`" for key, value in meta.items())
    return f"# Benchmark: {name}\n\n{meta_lines}\n\n{markdown_table(rows)}"
