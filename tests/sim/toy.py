"""A tiny synthetic trace set whose physics can be checked by hand.

Step times are *linear* in (nodes, replicas, local batch size), so linear
interpolation (per placement, or the 3-D Delaunay fallback) is exact anywhere
inside the measured range and tests can compare against the formula.
"""

from __future__ import annotations

from pathlib import Path

#: Placements measured in placements.csv (note: (1, 2) but not (2, 1)).
PLACEMENTS = (1, 2, 4, 11, 12, 22, 44, 111, 1111, 4444)
LOCAL_BSZ = (8, 16, 32)
SCALABILITY_NODES = (6, 8, 16)
#: Validated total batch sizes and their per-epoch rows.
BATCH_SIZES = (8, 16, 32, 64)
EPOCHS = 10
#: Progress of one epoch at B0 (every curve gains about the same per epoch).
EPOCH_PROGRESS = 1000.0


def step_time(nodes: int, replicas: int, local_bsz: float) -> float:
    """The toy ground truth: seconds per optimizer step."""
    return 0.1 + 0.01 * nodes + 0.002 * replicas + 0.001 * local_bsz


def sync_time(nodes: int, replicas: int, local_bsz: float) -> float:
    """Seconds of a step spent synchronising gradients."""
    return 0.02 + 0.005 * nodes + 0.001 * replicas


def grad_stats(batch_size: int, epoch: int) -> tuple[float, float]:
    """(grad_sqr, grad_var) measured in ``epoch`` of the run at ``batch_size``."""
    return 1.0 + 0.1 * epoch + batch_size / 1000.0, 4.0 + epoch + batch_size / 100.0


def progress(batch_size: int, epoch: int) -> float:
    """Cumulative progress after ``epoch + 1`` epochs (the largest batch lags a bit)."""
    lag = 5.0 if batch_size == BATCH_SIZES[-1] else 0.0
    return EPOCH_PROGRESS * (epoch + 1) - lag


def make_toy_traces(root: Path, name: str = "toy") -> Path:
    """Write ``root/<name>/`` with placements, scalability and validation files."""
    folder = root / name
    folder.mkdir(parents=True)
    lines = ["placement,local_bsz,step_time,sync_time"]
    for pid in PLACEMENTS:
        digits = [int(d) for d in str(pid)]
        nodes, replicas = len(digits), sum(digits)
        for bsz in LOCAL_BSZ:
            step, sync = step_time(nodes, replicas, bsz), sync_time(nodes, replicas, bsz)
            lines.append(f"{pid},{bsz},{step!r},{sync!r}")
    (folder / "placements.csv").write_text("\n".join(lines) + "\n")
    lines = ["num_nodes,num_replicas,local_bsz,step_time,sync_time"]
    for nodes in SCALABILITY_NODES:
        for replicas in (nodes, 2 * nodes, 4 * nodes):
            for bsz in LOCAL_BSZ:
                lines.append(
                    f"{nodes},{replicas},{bsz},{step_time(nodes, replicas, bsz)!r},"
                    f"{sync_time(nodes, replicas, bsz)!r}"
                )
    (folder / "scalability.csv").write_text("\n".join(lines) + "\n")
    for batch in BATCH_SIZES:
        lines = ["progress,iteration,metric,grad_sqr,grad_var"]
        for epoch in range(EPOCHS):
            sqr, var = grad_stats(batch, epoch)
            iters = (epoch + 1) * 800 * BATCH_SIZES[0] // batch
            lines.append(f"{progress(batch, epoch)!r},{iters},0.5,{sqr!r},{var!r}")
        (folder / f"validation-{batch}.csv").write_text("\n".join(lines) + "\n")
    return folder
