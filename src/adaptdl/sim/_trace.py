"""Job types of the simulator, derived from measured traces.

An :class:`Application` holds everything the simulator knows about one model:
the measured step times of every placement (``placements.csv``), the larger
scalability sweep (``scalability.csv``) and one training curve per validated
total batch size (``validation-<B>.csv``). The simulator uses it as ground
truth; policies never see it directly.

The lookups reproduce the physics of the Pollux (OSDI'21) artifact exactly,
including its quirks, because published job completion times are compared to
the second: placements are normalised to their smallest *rotation* only,
batch sizes are interpolated linearly per placement with the same arithmetic
as ``scipy.interpolate.interp1d``, and jobs on five or more nodes fall back to
a 3-D Delaunay interpolation over (nodes, replicas, local batch size).
"""

from __future__ import annotations

import csv
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from adaptdl.sim._csvutil import (
    CsvTable,
    describe_error,
    duplicate_names,
    not_utf8,
    shown,
    strict_float,
    width_error,
)

__all__ = ["Application", "TraceError", "load_application", "normalize_placement"]

_LOG = logging.getLogger(__name__)

#: Epochs to completion per model (the artifact hard-codes them; no model has a
#: target metric, so a job completes after exactly this many epochs).
MAX_EPOCHS: dict[str, int] = {
    "bert": 2,
    "cifar10": 100,
    "deepspeech2": 80,
    "imagenet": 90,
    "ncf": 10,
    "yolov3": 50,
}

#: Per-GPU batch size caps that override the trace (yolov3 runs out of memory
#: above 8 in the artifact even though the trace was measured up to 16).
MAX_LOCAL_BSZ_OVERRIDE: dict[str, int] = {"yolov3": 8}

_VALIDATION_RE = re.compile(r"^validation-(\d+)\.csv$")


class TraceError(ValueError):
    """A trace directory is missing a file or holds malformed data."""


@dataclass(frozen=True)
class _Curve:
    """One ``validation-<B>.csv`` file: per-epoch cumulative values."""

    progress: NDArray[np.float64]
    iteration: NDArray[np.float64]
    grad_sqr: NDArray[np.float64]
    grad_var: NDArray[np.float64]


def normalize_placement(placement: Sequence[int]) -> tuple[int, ...]:
    """Drop empty nodes and rotate to the lexicographically smallest rotation.

    Only rotations are considered, not permutations, because that is how the
    traces were keyed: ``(2, 1, 3)`` becomes ``(1, 3, 2)`` but ``(1, 2, 4, 3)``
    stays distinct from ``(1, 2, 3, 4)``.
    """
    for count in placement:
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(
                f"placement must list GPUs per node as integers >= 0, got {tuple(placement)!r}"
            )
    used = tuple(int(count) for count in placement if count)
    if not used:
        return ()
    return min(used[i:] + used[:i] for i in range(len(used)))


#: A per-column value check: (predicate, what the value must be).
_Check = tuple[Callable[[float], bool], str]

_FINITE: _Check = (math.isfinite, "a finite number")
_POSITIVE: _Check = (lambda v: math.isfinite(v) and v > 0, "a number > 0")
_NON_NEGATIVE: _Check = (lambda v: math.isfinite(v) and v >= 0, "a number >= 0")
_COUNT: _Check = (lambda v: math.isfinite(v) and v >= 1 and v == int(v), "an integer >= 1")
# A placement id lists GPUs per node as digits, so none of them may be 0.
_PLACEMENT: _Check = (
    lambda v: math.isfinite(v) and v >= 1 and v == int(v) and "0" not in str(int(v)),
    "an integer of non-zero digits (GPUs per node)",
)


def _read_csv(path: Path, checks: Mapping[str, _Check]) -> tuple[dict[str, list[float]], list[int]]:
    """Read the named numeric columns of a CSV file, with file/line errors.

    Every value must pass its column's check: a zero step time or a NaN
    would otherwise surface hours into a simulation as a division by zero
    or a job that never finishes.

    Returns:
        The values per column and the line number of each row, for errors
        found by checks that span rows.
    """
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace file ({exc.strerror})") from None
    columns = list(checks)
    out: dict[str, list[float]] = {name: [] for name in columns}
    lines: list[int] = []
    with handle:
        reader: CsvTable | None = None
        try:
            reader = CsvTable(handle)
            header = [h.strip() for h in reader.header or []]
            duplicates = duplicate_names(header)
            if duplicates:
                raise TraceError(
                    f"{path}:{reader.header_line}: duplicate column(s) {', '.join(duplicates)}"
                )
            missing = [name for name in columns if name not in header]
            if missing:
                raise TraceError(
                    f"{path}:{reader.header_line}: missing column(s) {', '.join(missing)}; "
                    f"header is {','.join(header)}"
                )
            for row, fields in reader.rows(header):
                if fields is not None:
                    raise TraceError(f"{path}:{reader.line_num}: {width_error(header, fields)}")
                for name, (valid, wanted) in checks.items():
                    raw = row[name]
                    value = strict_float(raw)  # every check rejects NaN
                    if not valid(value):
                        raise TraceError(
                            f"{path}:{reader.line_num}: column {name!r}: "
                            f"expected {wanted}, got {shown(raw)}"
                        )
                    out[name].append(value)
                lines.append(reader.line_num)
        except csv.Error as exc:
            line = reader.error_line if reader is not None else 1
            raise TraceError(f"{path}:{line}: {describe_error(exc)}") from None
        except UnicodeDecodeError as exc:
            raise TraceError(not_utf8(path, exc)) from None
    return out, lines


def _check_timing(path: Path, data: Mapping[str, list[float]], lines: Sequence[int]) -> None:
    """Sync time is the part of a step spent communicating, so it cannot exceed it."""
    for step, sync, line in zip(data["step_time"], data["sync_time"], lines):
        if sync > step:
            raise TraceError(
                f"{path}:{line}: column 'sync_time': {sync:g} exceeds step_time {step:g}"
            )


def _check_curve(path: Path, data: Mapping[str, list[float]], lines: Sequence[int]) -> None:
    """Cumulative columns never decrease, and the noise model needs sqr + var > 0."""
    for name in ("progress", "iteration"):
        values = data[name]
        for k in range(1, len(values)):
            if values[k] < values[k - 1]:
                raise TraceError(
                    f"{path}:{lines[k]}: column {name!r}: {values[k]:g} is below the "
                    f"previous row's {values[k - 1]:g} (the column is cumulative)"
                )
    for sqr, var, line in zip(data["grad_sqr"], data["grad_var"], lines):
        if sqr + var <= 0:
            raise TraceError(
                f"{path}:{line}: grad_sqr and grad_var are both 0 (the gain would be 0/0)"
            )


def missing_trace_dir(path: Path) -> str:
    """Why ``path`` (not a directory) cannot be a trace directory."""
    if path.exists():
        return f"{path}: is a file, not a trace directory"
    return f"{path}: trace directory not found"


def _interp_linear(
    xs: NDArray[np.float64], ys: NDArray[np.float64], x: float
) -> NDArray[np.float64]:
    """Linear interpolation with the arithmetic of ``interp1d(kind="linear")``.

    ``interp1d`` evaluates ``slope * (x - x_lo) + y_lo`` on the bracket found
    by a left ``searchsorted`` clipped to ``[1, n-1]``, so even an exact hit on
    a measured point goes through the formula. Reproducing it bit-for-bit
    keeps the whole-second rounding at epoch boundaries identical.
    """
    if len(xs) == 1:
        # A placement measured at one batch size: callers reject any other
        # size as out of range, so this is an exact hit.
        return np.array(ys[0], dtype=np.float64)
    idx = int(np.searchsorted(xs, x))
    idx = min(max(idx, 1), len(xs) - 1)
    x_lo, x_hi = xs[idx - 1], xs[idx]
    y_lo, y_hi = ys[idx - 1], ys[idx]
    slope = (y_hi - y_lo) / (x_hi - x_lo)
    result: NDArray[np.float64] = slope * (x - x_lo) + y_lo
    return result


class Application:
    """Ground truth for one job type, loaded from ``traces/<name>/``.

    Attributes:
        name: Model name (the trace folder name).
        init_batch_size: Smallest validated total batch size B0.
        max_batch_size: Largest validated total batch size.
        min_local_bsz: Smallest per-GPU batch size measured.
        max_local_bsz: Largest usable per-GPU batch size.
        max_epochs: Epochs to completion.
        max_gpus_per_node: Most GPUs on one node in any measured placement;
            larger nodes are outside the traces.
    """

    def __init__(self, trace_dir: str | os.PathLike[str], max_epochs: int | None = None) -> None:
        path = Path(trace_dir)
        if not path.is_dir():
            raise TraceError(missing_trace_dir(path))
        self.name = path.name
        self._path = path
        columns = ("placement", "local_bsz", "step_time", "sync_time")
        file = path / "placements.csv"
        placements, lines = _read_csv(
            file,
            {
                "placement": _PLACEMENT,
                "local_bsz": _COUNT,
                "step_time": _POSITIVE,
                "sync_time": _NON_NEGATIVE,
            },
        )
        if not lines:
            raise TraceError(f"{file}: no rows")
        _check_timing(file, placements, lines)
        rows: dict[int, list[tuple[float, float, float]]] = {}
        first_line: dict[tuple[int, float], int] = {}
        for pid, bsz, step, sync, line in zip(*(placements[c] for c in columns), lines):
            # Two rows for one point would make the interpolation divide by zero.
            seen = first_line.setdefault((int(pid), bsz), line)
            if seen != line:
                raise TraceError(
                    f"{file}:{line}: placement {int(pid)} with local_bsz {bsz:g} "
                    f"is already measured on line {seen}"
                )
            rows.setdefault(int(pid), []).append((bsz, step, sync))
        self._placements: dict[int, tuple[NDArray[np.float64], NDArray[np.float64]]] = {}
        for pid, entries in rows.items():
            entries.sort(key=lambda e: e[0])
            xs = np.array([e[0] for e in entries])
            ys = np.array([[e[1], e[2]] for e in entries])
            self._placements[pid] = (xs, ys)
        self._placement_rows = placements
        # Placement ids list GPUs per node as digits.
        self.max_gpus_per_node = max(int(d) for pid in rows for d in str(pid))
        file = path / "scalability.csv"
        self._scalability, lines = _read_csv(
            file,
            {
                "num_nodes": _COUNT,
                "num_replicas": _COUNT,
                "local_bsz": _COUNT,
                "step_time": _POSITIVE,
                "sync_time": _NON_NEGATIVE,
            },
        )
        _check_timing(file, self._scalability, lines)
        for nodes, replicas, line in zip(
            self._scalability["num_nodes"], self._scalability["num_replicas"], lines
        ):
            if replicas < nodes:
                raise TraceError(
                    f"{file}:{line}: column 'num_replicas': {replicas:g} replicas "
                    f"cannot span {nodes:g} nodes"
                )
        curves: dict[int, _Curve] = {}
        for entry in sorted(os.listdir(path)):
            match = _VALIDATION_RE.match(entry)
            if not match:
                continue
            file = path / entry
            if int(match.group(1)) < 1:
                raise TraceError(f"{file}: the batch size in the file name must be >= 1")
            data, lines = _read_csv(
                file,
                {
                    "progress": _NON_NEGATIVE,
                    "iteration": _NON_NEGATIVE,
                    "grad_sqr": _NON_NEGATIVE,
                    "grad_var": _NON_NEGATIVE,
                },
            )
            _check_curve(file, data, lines)
            curves[int(match.group(1))] = _Curve(
                progress=np.array(data["progress"]),
                iteration=np.array(data["iteration"]),
                grad_sqr=np.array(data["grad_sqr"]),
                grad_var=np.array(data["grad_var"]),
            )
        if not curves:
            raise TraceError(f"{path}: no validation-<B>.csv files")
        self._curves = dict(sorted(curves.items()))
        self._batch_sizes = list(self._curves)
        self.init_batch_size = self._batch_sizes[0]
        self.max_batch_size = self._batch_sizes[-1]
        self.min_local_bsz = int(min(placements["local_bsz"]))
        self.max_local_bsz = MAX_LOCAL_BSZ_OVERRIDE.get(
            self.name, int(max(placements["local_bsz"]))
        )
        rows_available = min(len(c.progress) for c in self._curves.values())
        if max_epochs is None:
            max_epochs = MAX_EPOCHS.get(self.name, rows_available)
        if not 1 <= max_epochs <= rows_available:
            raise TraceError(
                f"{path}: max_epochs={max_epochs} needs that many rows in every "
                f"validation file (shortest has {rows_available})"
            )
        self.max_epochs = max_epochs
        self._rows = rows_available
        # Epoch k ends at the smallest progress any curve reached after k epochs.
        self._progress = [0.0] + [
            min(float(c.progress[k]) for c in self._curves.values()) for k in range(max_epochs)
        ]
        self._throughput_memo: dict[tuple[tuple[int, ...], int], tuple[float, float]] = {}
        self._grad_memo: dict[tuple[float, int], tuple[float, float]] = {}
        self._nd: Callable[..., NDArray[np.float64]] | None = None

    def __repr__(self) -> str:
        return f"Application({self.name!r}, B0={self.init_batch_size}, epochs={self.max_epochs})"

    # ------------------------------------------------------------------ throughput

    def throughput(self, placement: Sequence[int], local_bsz: int) -> tuple[float, float]:
        """Measured ``(step_time, sync_time)`` for a placement and per-GPU batch.

        Args:
            placement: GPUs per node (zeros are ignored).
            local_bsz: Per-GPU (atomic) batch size.

        Raises:
            ValueError: the batch size lies outside the measured range of the
                placement, or the 3-D fallback is outside the convex hull.
        """
        key = (tuple(placement), int(local_bsz))
        memo = self._throughput_memo.get(key)
        if memo is not None:
            return memo
        norm = normalize_placement(placement)
        if not norm:
            raise ValueError(f"{self.name}: empty placement has no throughput")
        pid = int("".join(map(str, norm))) if max(norm) < 10 else -1
        entry = self._placements.get(pid)
        if entry is not None:
            xs, ys = entry
            if not xs[0] <= local_bsz <= xs[-1]:
                raise ValueError(
                    f"{self.name}: local_bsz={local_bsz} outside the measured range "
                    f"[{xs[0]:g}, {xs[-1]:g}] of placement {pid}"
                )
            values = _interp_linear(xs, ys, float(local_bsz))
        else:
            interpolator = self._nd_interpolator()
            point = np.array([[min(len(norm), 16), sum(norm), local_bsz]], dtype=float)
            values = interpolator(point)[0]
            if np.isnan(values).any():
                raise ValueError(
                    f"{self.name}: placement {norm} with local_bsz={local_bsz} is outside "
                    "the measured range of the scalability trace"
                )
        result = (float(values[0]), float(values[1]))
        self._throughput_memo[key] = result
        return result

    def _nd_interpolator(self) -> Callable[..., NDArray[np.float64]]:
        """Build (once) the (nodes, replicas, local_bsz) interpolator for 5+ nodes.

        Placement rows are averaged per (nodes, replicas, local_bsz) in sorted
        key order and followed by the scalability rows in file order; the
        point order matters because the Delaunay triangulation of grid points
        is degenerate and its tie-breaking follows the input order.
        """
        if self._nd is not None:
            return self._nd
        from scipy.interpolate import LinearNDInterpolator

        groups: dict[tuple[int, int, float], list[tuple[float, float]]] = {}
        rows = self._placement_rows
        for pid, bsz, step, sync in zip(
            rows["placement"], rows["local_bsz"], rows["step_time"], rows["sync_time"]
        ):
            digits = str(int(pid))
            key = (len(digits), sum(int(d) for d in digits), bsz)
            groups.setdefault(key, []).append((step, sync))
        points: list[tuple[float, float, float]] = []
        values: list[tuple[float, float]] = []
        for key in sorted(groups):
            group = groups[key]
            points.append((float(key[0]), float(key[1]), float(key[2])))
            values.append(
                (
                    float(np.mean([g[0] for g in group])),
                    float(np.mean([g[1] for g in group])),
                )
            )
        scal = self._scalability
        for nodes, reps, bsz, step, sync in zip(
            scal["num_nodes"],
            scal["num_replicas"],
            scal["local_bsz"],
            scal["step_time"],
            scal["sync_time"],
        ):
            points.append((nodes, reps, bsz))
            values.append((step, sync))
        self._nd = LinearNDInterpolator(np.array(points), np.array(values))
        return self._nd

    # ------------------------------------------------------------------ statistics

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        """True ``(grad_sqr, grad_var)`` during ``epoch`` at total batch ``batch_size``.

        Linear in the batch size between the two bracketing validated curves.

        Raises:
            ValueError: ``batch_size`` is outside ``[B0, max_batch_size]``.
        """
        key = (batch_size, epoch)
        memo = self._grad_memo.get(key)
        if memo is not None:
            return memo
        if not self.init_batch_size <= batch_size <= self.max_batch_size:
            raise ValueError(
                f"{self.name}: batch size {batch_size} outside the validated range "
                f"[{self.init_batch_size}, {self.max_batch_size}]"
            )
        self._check_epoch(epoch, self._rows - 1)
        curve = self._curves.get(int(batch_size)) if batch_size == int(batch_size) else None
        if curve is not None:
            result = (float(curve.grad_sqr[epoch]), float(curve.grad_var[epoch]))
        else:
            lo = max(b for b in self._batch_sizes if b < batch_size)
            hi = min(b for b in self._batch_sizes if b > batch_size)
            c_lo, c_hi = self._curves[lo], self._curves[hi]
            # The original's formula, not np.interp: the two differ in the
            # last bit for about half of the batch sizes.
            w_lo, w_hi = hi - batch_size, batch_size - lo
            result = (
                float((w_hi * c_hi.grad_sqr[epoch] + w_lo * c_lo.grad_sqr[epoch]) / (hi - lo)),
                float((w_hi * c_hi.grad_var[epoch] + w_lo * c_lo.grad_var[epoch]) / (hi - lo)),
            )
        self._grad_memo[key] = result
        return result

    def progress(self, epoch: int) -> float:
        """Progress (in B0 steps) at the end of ``epoch`` epochs; 0 for epoch 0.

        Raises:
            ValueError: ``epoch`` is not an integer in ``[0, max_epochs]``.
        """
        if type(epoch) is not int or not 0 <= epoch <= self.max_epochs:
            self._check_epoch(epoch, self.max_epochs)
        return self._progress[epoch]

    def _check_epoch(self, epoch: object, last: int) -> None:
        # Python's negative indices would read the last epochs' values.
        if (
            isinstance(epoch, bool)
            or not isinstance(epoch, (int, np.integer))
            or not 0 <= epoch <= last
        ):
            raise ValueError(f"{self.name}: epoch must be an integer in [0, {last}], got {epoch!r}")

    @property
    def total_progress(self) -> float:
        """Progress at which a job of this type completes."""
        return self._progress[self.max_epochs]

    def iteration(self, batch_size: float, epoch: int) -> float:
        """Cumulative optimizer steps in row ``epoch`` of the curves at ``batch_size``.

        Row ``epoch`` is the end of epoch ``epoch + 1``; the artifact indexes
        the rows this way when it computes Optimus' remaining work (the
        difference of two such values), so the oracle is reproduced with the
        same off-by-one. Linear in the batch size between validated curves.
        """
        self._check_epoch(epoch, self._rows - 1)
        xs = [float(b) for b in self._batch_sizes]
        ys = [float(self._curves[b].iteration[epoch]) for b in self._batch_sizes]
        return float(np.interp(batch_size, xs, ys))

    def fixed_config(
        self, num_replicas: int, batch_size: int, force_accum: bool
    ) -> tuple[int, int]:
        """``(atomic_bsz, accum_steps)`` that realise a fixed total batch size.

        The local batch ``ceil(B/R)`` is split into the fewest micro-batches
        that fit the per-GPU limit. A single replica accumulates at least one
        extra micro-batch when ``force_accum`` (the artifact does so whenever
        ``B > B0``, and always in the Optimus oracle), because a lone replica
        cannot otherwise estimate gradient noise. The atomic batch is finally
        capped so that the total never exceeds the largest validated batch.
        """
        local = math.ceil(batch_size / num_replicas - 1e-8)
        accum = math.ceil(local / self.max_local_bsz - 1e-8) - 1
        if num_replicas == 1 and force_accum:
            accum = max(1, accum)
        atomic = math.ceil(local / (accum + 1) - 1e-8)
        atomic = min(atomic, int(self.max_batch_size / (num_replicas * (accum + 1))))
        return atomic, accum


def load_application(trace_dir: str | os.PathLike[str]) -> Application:
    """Load one application, logging its derived limits at debug level."""
    app = Application(trace_dir)
    _LOG.debug(
        "loaded %s: B0=%d max_batch=%d atomic=[%d, %d] epochs=%d",
        app.name,
        app.init_batch_size,
        app.max_batch_size,
        app.min_local_bsz,
        app.max_local_bsz,
        app.max_epochs,
    )
    return app
