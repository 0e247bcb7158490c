"""Workload files: which jobs arrive when, with which model and configuration.

Columns are found by name, not position, so the Pollux artifact's files
(``name,time,application,num_replicas,batch_size``) and Sia-style files
(``submit_time``, ``model``, ...) both load. Every error names the file, the
line and the column, because workloads are edited by hand.

Numbers must be written with ASCII digits: Python's ``int``/``float`` also
accept ``1_000`` and other scripts' digits, which in a hand-edited file are
far more likely a typo than intended.
"""

from __future__ import annotations

import csv
import dataclasses
import numbers
import os
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from adaptdl.sched import MAX_COUNT
from adaptdl.sim._csvutil import (
    FLOAT_RE,
    CsvTable,
    describe_error,
    duplicate_names,
    not_utf8,
    shown,
    width_error,
)

__all__ = [
    "ADAPTIVE_CATEGORY",
    "COLUMN_ALIASES",
    "WorkloadError",
    "WorkloadJob",
    "check_jobs",
    "read_workload",
]

#: Canonical column -> accepted header names, in order of preference.
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "name": ("name", "job_name", "job_id", "id"),
    "time": ("time", "submit_time", "submission_time", "arrival_time"),
    "application": ("application", "model", "app", "job_type"),
    "num_replicas": ("num_replicas", "num_gpus", "gpus", "replicas"),
    "batch_size": ("batch_size", "bsz", "target_batch_size"),
    "category": ("category", "job_category"),
}

#: The job category that adaptive policies simulate (Sia's names the others).
ADAPTIVE_CATEGORY = "adaptive"

_REQUIRED = ("name", "time", "application")

#: What the canonical columns hold, for the error naming two columns of one.
_MEANING = {
    "name": "the job name",
    "time": "the submission time",
    "application": "the model",
    "num_replicas": "the GPU count",
    "batch_size": "the batch size",
    "category": "the job category",
}

_INT_RE = re.compile(r"[+-]?[0-9]+")

#: Latest arrival accepted (about 35,000 years): beyond it, adding an interval
#: to the clock would lose whole seconds.
_MAX_TIME = float(2**40)


class WorkloadError(ValueError):
    """A workload file cannot be used; the message names file, line and column."""


@dataclass(frozen=True)
class WorkloadJob:
    """One job of a workload.

    Attributes:
        name: Unique job name.
        submission_time: Seconds from the start of the workload.
        application: Trace (model) name.
        num_replicas: GPU count for fixed-size policies (Tiresias).
        batch_size: Total batch size for fixed-batch policies, or None for
            the model's smallest validated batch size.
        origin: ``file:line`` the job was read from, for error messages
            (empty for jobs built in code).
        columns: ``(field, header)`` pairs: the file's column that gave each
            field, so that a value the simulator later refuses (a batch size
            the traces cannot run) is named by file, line and column.
        category: Sia's job category (``rigid``, ``scale-gpus``,
            ``adaptive``), or None when the file has none. Adaptive policies
            can only simulate adaptive jobs, so the simulator refuses the
            others under them; fixed-size policies run every job as given.
    """

    name: str
    submission_time: float
    application: str
    num_replicas: int
    batch_size: int | None
    origin: str = ""
    columns: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    category: str | None = None

    def where(self, column: str) -> str:
        """``file:line: column 'header': `` for the file's cell giving ``column``.

        Empty for a job built in code, and without the column when the file
        has none for it (the value is then a default).
        """
        if not self.origin:
            return ""
        header = dict(self.columns).get(column)
        return f"{self.origin}: column {header!r}: " if header else f"{self.origin}: "


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _job_error(index: int, job: WorkloadJob, field: str, expected: str) -> WorkloadError:
    value = getattr(job, field)
    return WorkloadError(
        f"workload job {index} ({job.name!r}): {field}={value!r}: expected {expected}"
    )


def check_jobs(jobs: Sequence[object]) -> list[WorkloadJob]:
    """Apply :func:`read_workload`'s checks to jobs built in code.

    A file's jobs are checked as they are read; jobs made by a script reach
    the simulator directly, and one NaN arrival time would make it run
    forever. Returns the jobs as a list.

    Raises:
        TypeError: an entry is not a :class:`WorkloadJob`.
        WorkloadError: no jobs, a duplicate name or a field out of range; the
            message names the job's index and the field.
    """
    checked: list[WorkloadJob] = []
    seen: dict[str, int] = {}
    for index, job in enumerate(jobs):
        if not isinstance(job, WorkloadJob):
            raise TypeError(f"workload job {index}: expected a WorkloadJob, got {job!r}")
        if not isinstance(job.name, str) or not job.name:
            raise _job_error(index, job, "name", "a non-empty string")
        if job.name in seen:
            raise _job_error(index, job, "name", f"a unique name (job {seen[job.name]} has it too)")
        seen[job.name] = index
        time = job.submission_time
        if (
            isinstance(time, bool)
            or not isinstance(time, numbers.Real)
            or not 0 <= time <= _MAX_TIME
        ):
            expected = f"a number of seconds >= 0 and <= {_MAX_TIME:.0f} (2**40)"
            raise _job_error(index, job, "submission_time", expected)
        # A plain float from here on: numpy's float32 (a DataFrame column) or a
        # Fraction would otherwise fail deep inside the simulator's clock.
        job = dataclasses.replace(job, submission_time=float(time))
        if not isinstance(job.application, str) or not job.application:
            raise _job_error(index, job, "application", "a model name (a non-empty string)")
        # The same bounds as a file's cells (see read_workload).
        if not _is_int(job.num_replicas) or not 1 <= job.num_replicas <= MAX_COUNT:
            raise _job_error(index, job, "num_replicas", "an integer from 1 to 2**31 - 1")
        if job.batch_size is not None and (
            not _is_int(job.batch_size) or not 1 <= job.batch_size <= MAX_COUNT
        ):
            raise _job_error(index, job, "batch_size", "an integer from 1 to 2**31 - 1, or None")
        if job.category is not None and (
            not isinstance(job.category, str) or not job.category.strip()
        ):
            raise _job_error(index, job, "category", "a non-empty string or None")
        if job.category is not None:  # as a file's cells are read ("Adaptive")
            job = dataclasses.replace(job, category=job.category.strip().lower())
        checked.append(job)
    if not checked:
        raise WorkloadError("workload: no jobs")
    return checked


def _normal(header: str) -> str:
    """A header name as the aliases spell it: ``Submit Time`` is ``submit_time``."""
    return "_".join(header.strip().lower().replace("-", " ").split())


def _skeleton(name: str) -> str:
    """``name`` without separators and a final "s": ``Num-Replica`` and ``num_replicas`` agree."""
    letters = "".join(char for char in name.lower() if char.isalnum())
    return letters[:-1] if letters.endswith("s") else letters


def _find_columns(path: Path, header: list[str], line: int) -> dict[str, str]:
    """Map each canonical column to the header name that gives it.

    Two aliases of one column (``time`` and ``submit_time``) are an error:
    silently preferring one would simulate values the author may not mean.
    """
    duplicates = duplicate_names(_normal(h) for h in header)
    if duplicates:
        raise WorkloadError(f"{path}:{line}: duplicate column(s) {', '.join(duplicates)}")
    lowered = {_normal(h): h for h in header}
    found: dict[str, str] = {}
    for canonical, aliases in COLUMN_ALIASES.items():
        present = [lowered[alias] for alias in aliases if alias in lowered]
        if len(present) > 1:
            names = " and ".join(repr(name) for name in present)
            raise WorkloadError(
                f"{path}:{line}: columns {names} both give {_MEANING[canonical]}; keep one"
            )
        if present:
            found[canonical] = present[0]
    used = {_normal(name) for name in found.values()}
    unfound = {
        _skeleton(alias): (alias, canonical)
        for canonical, aliases in COLUMN_ALIASES.items()
        if canonical not in found
        for alias in aliases
    }
    for header_name in header:
        normal = _normal(header_name)
        near = unfound.get(_skeleton(normal)) if normal and normal not in used else None
        if near is not None:
            # Other columns are ignored, but one that differs from a known
            # name only in separators or a plural "s" is a typo: ignored, it
            # would silently simulate every job with the default (1 GPU).
            raise WorkloadError(
                f"{path}:{line}: column {header_name!r} is not a column this reader knows; "
                f"did you mean {near[0]!r} ({_MEANING[near[1]]})? Rename it to that, or, if "
                "it holds something else, to a name unlike it"
            )
    missing = [c for c in _REQUIRED if c not in found]
    if missing:
        wanted = "; ".join(f"{c} (or {', '.join(COLUMN_ALIASES[c][1:])})" for c in missing)
        raise WorkloadError(
            f"{path}:{line}: missing column(s): {wanted}; header is {','.join(header)}"
        )
    return found


def read_workload(
    path: str | os.PathLike[str], applications: Collection[str] | None = None
) -> list[WorkloadJob]:
    """Read a workload CSV into jobs, in file order.

    File order is kept (not re-sorted by time) because it is the order in
    which the simulator presents jobs to a policy, and policies break ties by
    that order.

    Args:
        path: The CSV file.
        applications: Known model names; an unknown one is an error.

    Raises:
        WorkloadError: unreadable file, missing column, malformed value,
            unknown application or duplicate job name. (Whether the traces
            can simulate a job's batch size and GPU count depends on the
            policy; :class:`~adaptdl.sim.Simulator` checks that.)
    """
    file = Path(path)
    try:
        # utf-8-sig: spreadsheets often save a byte-order mark before the header.
        handle = file.open(newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise WorkloadError(f"{file}: cannot read workload ({exc.strerror})") from None
    try:
        with handle:
            reader: CsvTable | None = None
            try:
                reader = CsvTable(handle)
                return _parse_rows(file, reader, applications)
            except csv.Error as exc:
                line = reader.error_line if reader is not None else 1
                raise WorkloadError(f"{file}:{line}: {describe_error(exc)}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(not_utf8(file, exc)) from None


def _parse_rows(
    file: Path,
    reader: CsvTable,
    applications: Collection[str] | None,
) -> list[WorkloadJob]:
    """The jobs of an opened workload CSV, validated row by row."""
    if reader.header is None:
        raise WorkloadError(f"{file}:1: empty file (or only blank lines), expected a CSV header")
    columns = _find_columns(file, reader.header, reader.header_line)
    found = tuple(columns.items())
    jobs: list[WorkloadJob] = []
    seen: dict[str, int] = {}
    for row, fields in reader.rows(reader.header):
        line = reader.line_num
        if fields is not None:
            raise WorkloadError(f"{file}:{line}: {width_error(reader.header, fields)}")

        def cell(canonical: str, row: dict[str, str] = row) -> str:
            return row.get(columns[canonical], "").strip()

        def fail(canonical: str, message: str, line: int = line) -> WorkloadError:
            return WorkloadError(f"{file}:{line}: column {columns[canonical]!r}: {message}")

        def positive_int(canonical: str) -> int | None:
            """An optional column of integers >= 1 (None when absent or empty)."""
            if canonical not in columns or not cell(canonical):
                return None
            raw = cell(canonical)
            if _INT_RE.fullmatch(raw) is None:
                raise fail(canonical, f"expected an integer, got {shown(raw)}")
            # Python refuses to convert more than 4300 digits; far fewer are
            # already beyond any cluster.
            value = int(raw) if len(raw) <= 20 else MAX_COUNT + 1
            if not 1 <= value <= MAX_COUNT:
                raise fail(canonical, f"expected an integer from 1 to 2**31 - 1, got {shown(raw)}")
            return value

        name = cell("name")
        if not name:
            raise fail("name", "empty job name")
        if name in seen:
            raise fail("name", f"duplicate job name {shown(name)} (first on line {seen[name]})")
        seen[name] = line
        raw_time = cell("time")
        if FLOAT_RE.fullmatch(raw_time) is None:
            raise fail("time", f"expected a number of seconds, got {shown(raw_time)}")
        time = float(raw_time)
        if not 0 <= time <= _MAX_TIME:
            raise fail(
                "time",
                f"expected a time >= 0 and <= {_MAX_TIME:.0f} s (2**40), got {shown(raw_time)}",
            )
        app = cell("application")
        if applications is not None and app not in applications:
            known = ", ".join(sorted(applications))
            raise fail("application", f"unknown application {shown(app)}; known: {known}")
        replicas = positive_int("num_replicas")
        batch = positive_int("batch_size")
        category = cell("category").lower() if "category" in columns else ""
        jobs.append(
            WorkloadJob(
                name,
                time,
                app,
                replicas or 1,
                batch,
                origin=f"{file}:{line}",
                columns=found,
                category=category or None,
            )
        )
    if not jobs:
        raise WorkloadError(f"{file}: no jobs")
    return jobs
