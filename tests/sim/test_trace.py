"""Trace physics: placement normalisation, throughput interpolation, statistics."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from adaptdl.sim import Application, TraceError, normalize_placement
from tests.sim import toy


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Application:
    return Application(toy.make_toy_traces(tmp_path_factory.mktemp("traces")))


def test_limits_derived_from_traces(app: Application) -> None:
    assert app.init_batch_size == 8
    assert app.max_batch_size == 64
    assert (app.min_local_bsz, app.max_local_bsz) == (8, 32)
    assert app.max_epochs == toy.EPOCHS  # unknown model: as many epochs as rows


def test_normalize_placement_rotations_only() -> None:
    assert normalize_placement((2, 1, 3)) == (1, 3, 2)
    assert normalize_placement((1, 2, 4, 3)) == (1, 2, 4, 3)
    assert normalize_placement((1, 2, 3, 4)) == (1, 2, 3, 4)
    assert normalize_placement((0, 4, 0, 2)) == (2, 4)
    assert normalize_placement(()) == ()
    # (1.7, 2) became (1, 2) and (2, -1) became (-1, 2).
    for bad in ((1.7, 2), (2, -1), "12", (True, 1)):
        with pytest.raises(ValueError, match="placement must list GPUs per node as integers"):
            normalize_placement(bad)  # type: ignore[arg-type]


def test_rotation_normalisation_in_lookup(
    app: Application, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (2, 1) is not measured but its rotation (1, 2) is. The toy physics is
    # linear and the 3-D fallback holds the measured point itself, so values
    # alone cannot tell a rotated lookup from the fallback: the fallback is
    # made to fail.
    def no_fallback() -> None:
        raise AssertionError("the 3-D fallback was used for a measured rotation")

    monkeypatch.setattr(app, "_throughput_memo", {})
    monkeypatch.setattr(app, "_nd_interpolator", no_fallback)
    measured = (toy.step_time(2, 3, 16), toy.sync_time(2, 3, 16))
    assert app.throughput((1, 2), 16) == pytest.approx(measured, rel=1e-12)
    assert app.throughput((2, 1), 16) == app.throughput((1, 2), 16)
    assert app.throughput((0, 2, 0, 1), 16) == app.throughput((1, 2), 16)


def test_per_placement_linear_interpolation(app: Application) -> None:
    step, sync = app.throughput((2, 2), 12)
    assert step == pytest.approx(toy.step_time(2, 4, 12), rel=1e-12)
    assert sync == pytest.approx(toy.sync_time(2, 4, 12), rel=1e-12)
    with pytest.raises(ValueError, match="outside the measured range"):
        app.throughput((2, 2), 33)
    with pytest.raises(ValueError, match="empty placement"):
        app.throughput((), 8)


def test_interpolation_matches_interp1d_arithmetic(app: Application) -> None:
    # Exact hits go through slope * (x - x_lo) + y_lo like scipy's interp1d.
    xs = np.array([8.0, 16.0, 32.0])
    ys = np.array([toy.step_time(1, 1, b) for b in xs])
    slope = (ys[2] - ys[1]) / (xs[2] - xs[1])
    expected = slope * (32.0 - xs[1]) + ys[1]
    assert app.throughput((1,), 32)[0] == expected


def test_3d_fallback_for_five_or_more_nodes(app: Application) -> None:
    # 5 nodes x 2 GPUs is not in placements.csv: (nodes, replicas, bsz) interpolation.
    step, sync = app.throughput((2, 2, 2, 2, 2), 16)
    assert step == pytest.approx(toy.step_time(5, 10, 16), rel=1e-9)
    assert sync == pytest.approx(toy.sync_time(5, 10, 16), rel=1e-9)
    # More than 16 nodes are looked up at 16 nodes.
    step20, _ = app.throughput((1,) * 20 + (4,) * 4, 8)
    assert step20 == pytest.approx(toy.step_time(16, 36, 8), rel=1e-9)
    # Memoised per (placement, local_bsz).
    assert ((2, 2, 2, 2, 2), 16) in app._throughput_memo
    with pytest.raises(ValueError, match="outside the measured range"):
        app.throughput((4,) * 17, 8)  # 68 replicas on "16" nodes: outside the hull


def test_grad_stats_interpolated_in_batch_size(app: Application) -> None:
    assert app.grad_stats(16, 1) == toy.grad_stats(16, 1)
    sqr, var = app.grad_stats(24, 2)
    lo, hi = toy.grad_stats(16, 2), toy.grad_stats(32, 2)
    assert sqr == pytest.approx((lo[0] + hi[0]) / 2)
    assert var == pytest.approx((lo[1] + hi[1]) / 2)
    with pytest.raises(ValueError, match="outside the validated range"):
        app.grad_stats(65, 0)
    # A negative epoch read the last epoch's statistics (Python indexing).
    for epoch in (-1, toy.EPOCHS, 1.5):
        with pytest.raises(ValueError, match=r"toy: epoch must be an integer in \[0, "):
            app.grad_stats(16, epoch)  # type: ignore[arg-type]


def test_progress_boundaries_are_min_over_curves(app: Application) -> None:
    assert app.progress(0) == 0.0
    for epoch in range(1, toy.EPOCHS + 1):
        expected = min(toy.progress(b, epoch - 1) for b in toy.BATCH_SIZES)
        assert app.progress(epoch) == expected
    assert app.total_progress == app.progress(toy.EPOCHS)
    # progress(-1) returned the total progress, and too large an epoch
    # raised a bare IndexError.
    for epoch in (-1, toy.EPOCHS + 1, True):
        with pytest.raises(ValueError, match=rf"epoch must be an integer in \[0, {toy.EPOCHS}\]"):
            app.progress(epoch)


def test_iteration_rows_interpolated(app: Application) -> None:
    assert app.iteration(8, 0) == 800
    assert app.iteration(16, 1) == 800
    assert app.iteration(12, 1) == pytest.approx((1600 + 800) / 2)
    with pytest.raises(ValueError, match="epoch must be an integer"):
        app.iteration(12, -1)


def test_fixed_config_splits_batch(app: Application) -> None:
    # 1 GPU above B0 accumulates at least once.
    assert app.fixed_config(1, 16, force_accum=True) == (8, 1)
    assert app.fixed_config(1, 8, force_accum=False) == (8, 0)
    # 64 on 1 GPU: local 64 > max 32 -> 2 micro-batches of 32.
    assert app.fixed_config(1, 64, force_accum=True) == (32, 1)
    # Capped so R * b * (a + 1) <= max batch: ceil(64/3) = 22 -> floor(64/3) = 21.
    assert app.fixed_config(3, 64, force_accum=False) == (21, 0)


def test_yolov3_override_and_epochs(tmp_path: Path) -> None:
    folder = toy.make_toy_traces(tmp_path, name="yolov3")
    with pytest.raises(TraceError, match="max_epochs=50"):
        # The real yolov3 runs 50 epochs; the toy curves only have 10 rows.
        Application(folder)
    yolo = Application(folder, max_epochs=3)
    assert yolo.max_local_bsz == 8  # trace goes to 32, yolov3 is capped at 8


def test_missing_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="trace directory not found"):
        Application(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(TraceError, match="file: is a file, not a trace directory"):
        Application(tmp_path / "file")
    folder = toy.make_toy_traces(tmp_path)
    (folder / "scalability.csv").unlink()
    with pytest.raises(TraceError, match="scalability.csv"):
        Application(folder)


def test_a_model_folder_without_placements_is_named(tmp_path: Path) -> None:
    # It used to be skipped, and its jobs were then "unknown applications".
    from adaptdl.sim import load_applications

    toy.make_toy_traces(tmp_path / "traces", name="good")
    broken = toy.make_toy_traces(tmp_path / "traces", name="broken")
    (broken / "placements.csv").unlink()
    with pytest.raises(TraceError, match=r"broken: missing placements.csv \(the folder has"):
        load_applications(tmp_path / "traces")
    (broken / "placements-v100.csv").write_text("")
    with pytest.raises(TraceError, match="per-GPU-type files such as placements-v100.csv"):
        load_applications(tmp_path / "traces")
    # A folder of something else entirely is still skipped.
    for path in broken.iterdir():
        path.unlink()
    (broken / "notes.txt").write_text("")
    assert set(load_applications(tmp_path / "traces")) == {"good"}


def test_malformed_trace_value(tmp_path: Path) -> None:
    folder = toy.make_toy_traces(tmp_path)
    text = (folder / "placements.csv").read_text().splitlines()
    text[3] = "1,32,abc,0.1"
    (folder / "placements.csv").write_text("\n".join(text) + "\n")
    with pytest.raises(TraceError, match=r"placements.csv:4: column 'step_time'"):
        Application(folder)


def test_real_traces_table(pollux_data: Path) -> None:
    from adaptdl.sim import load_applications

    apps = load_applications(pollux_data / "traces")
    expected = {
        "bert": (12, 384, 4, 12, 2, 14774.0),
        "cifar10": (128, 4096, 32, 1024, 100, 39062.9),
        "deepspeech2": (20, 640, 10, 80, 80, 28536.0),
        "imagenet": (200, 12800, 20, 200, 90, 576525.6),
        "ncf": (256, 32768, 32, 32768, 10, 194174.0),
        "yolov3": (8, 512, 4, 8, 50, 103444.0),
    }
    for name, (b0, bmax, lo, hi, epochs, total) in expected.items():
        app = apps[name]
        assert (app.init_batch_size, app.max_batch_size) == (b0, bmax)
        assert (app.min_local_bsz, app.max_local_bsz, app.max_epochs) == (lo, hi, epochs)
        assert math.isclose(app.total_progress, total, rel_tol=1e-5)


def test_grad_stats_use_the_originals_arithmetic(pollux_data: Path) -> None:
    # np.interp differed from the original's formula in the last bit for
    # about half of the batch sizes between two validated ones.
    from adaptdl.sim import load_applications

    app = load_applications(pollux_data / "traces")["cifar10"]
    assert app.grad_stats(212, 2) == (1.179466723788623, 1.616433433815275)
    lo_sqr, lo_var = app.grad_stats(128, 7)
    hi_sqr, hi_var = app.grad_stats(256, 7)
    for batch in range(129, 256):
        expected = (
            ((batch - 128) * hi_sqr + (256 - batch) * lo_sqr) / 128,
            ((batch - 128) * hi_var + (256 - batch) * lo_var) / 128,
        )
        assert app.grad_stats(batch, 7) == expected, batch


def _replace_line(path: Path, index: int, line: str) -> None:
    lines = path.read_text().splitlines()
    lines[index] = line
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("file", "index", "line", "pattern"),
    [
        (
            "placements.csv",
            3,
            "1,32,0,0.0",
            r"placements.csv:4: column 'step_time': expected a number > 0, got '0'",
        ),
        ("placements.csv", 3, "1,32,nan,0.01", r"placements.csv:4: column 'step_time'"),
        # float() reads these; a hand-edited trace more likely holds a typo.
        ("placements.csv", 3, "1,32,0_2,0.01", r"placements.csv:4: column 'step_time'"),
        ("placements.csv", 3, "1,32,\u0661,0.01", r"placements.csv:4: column 'step_time'"),
        (
            "placements.csv",
            3,
            "1,32,0.2,-1",
            r"placements.csv:4: column 'sync_time': expected a number >= 0",
        ),
        (
            "placements.csv",
            3,
            "1,32,0.2,0.3",
            r"placements.csv:4: column 'sync_time': 0.3 exceeds step_time 0.2",
        ),
        (
            "placements.csv",
            3,
            "10,32,0.2,0.1",
            r"placements.csv:4: column 'placement': expected an integer of non-zero digits",
        ),
        (
            "placements.csv",
            3,
            "1,2.5,0.2,0.1",
            r"placements.csv:4: column 'local_bsz': expected an integer >= 1",
        ),
        (
            "placements.csv",
            3,
            "1,16,0.2,0.1",
            r"placements.csv:4: placement 1 with local_bsz 16 is already measured on line 3",
        ),
        (
            "placements.csv",
            3,
            "1,32,0.2",
            r"placements.csv:4: expected 4 fields, got 3: no value for column\(s\) sync_time",
        ),
        (
            "placements.csv",
            3,
            "1,32,0.2,0.1,7",
            r"placements.csv:4: expected 4 fields, got 5: 1 more than the header's columns",
        ),
        (
            "placements.csv",
            0,
            "placement,local_bsz,step_time,step_time",
            r"placements.csv:1: duplicate column\(s\) step_time",
        ),
        (
            "placements.csv",
            0,
            "placement,local_bsz,step_time",
            r"placements.csv:1: missing column\(s\) sync_time; header is placement,local_bsz,",
        ),
        (
            "scalability.csv",
            1,
            "6,3,8,0.5,0.1",
            r"scalability.csv:2: column 'num_replicas': 3 replicas cannot span 6 nodes",
        ),
        ("scalability.csv", 1, "6,6,8,inf,0.1", r"scalability.csv:2: column 'step_time'"),
        (
            "validation-8.csv",
            3,
            "1.0,2,0.5,1.0,1.0",
            r"validation-8.csv:4: column 'progress': 1 is below the previous row's 2000",
        ),
        (
            "validation-8.csv",
            3,
            "3000,2,0.5,1.0,1.0",
            r"validation-8.csv:4: column 'iteration': 2 is below",
        ),
        (
            "validation-8.csv",
            3,
            "3000,2400,0.5,1.0,-1",
            r"validation-8.csv:4: column 'grad_var': expected a number >= 0",
        ),
        (
            "validation-8.csv",
            3,
            "3000,2400,0.5,0,0",
            r"validation-8.csv:4: grad_sqr and grad_var are both 0",
        ),
    ],
)
def test_bad_trace_values_name_file_line_column(
    tmp_path: Path, file: str, index: int, line: str, pattern: str
) -> None:
    folder = toy.make_toy_traces(tmp_path)
    _replace_line(folder / file, index, line)
    with pytest.raises(TraceError, match=pattern):
        Application(folder)


def test_a_trace_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    folder = toy.make_toy_traces(tmp_path)
    lines = (folder / "placements.csv").read_bytes().splitlines(keepends=True)
    lines[3] = b"1,32,0.2\xe9,0.1\n"
    (folder / "placements.csv").write_bytes(b"".join(lines))
    with pytest.raises(TraceError, match=r"placements.csv:4: not UTF-8 text \(byte 0xe9 at"):
        Application(folder)


def test_validation_file_needs_a_positive_batch_size(tmp_path: Path) -> None:
    folder = toy.make_toy_traces(tmp_path)
    (folder / "validation-0.csv").write_text((folder / "validation-8.csv").read_text())
    with pytest.raises(TraceError, match=r"validation-0.csv: the batch size in the file name"):
        Application(folder)


def test_max_gpus_per_node_from_placements(app: Application) -> None:
    assert app.max_gpus_per_node == 4  # toy placements go up to 4444


def test_trailing_empty_columns_are_tolerated(tmp_path: Path) -> None:
    folder = toy.make_toy_traces(tmp_path)
    path = folder / "placements.csv"
    path.write_text("".join(f"{line},,\n" for line in path.read_text().splitlines()))
    assert Application(folder).throughput((1,), 8) == Application(
        toy.make_toy_traces(tmp_path, "plain")
    ).throughput((1,), 8)


def test_a_placement_measured_at_one_batch_size(tmp_path: Path) -> None:
    """A single row is an exact point: no 0/0 slope, and other sizes are out of range."""
    folder = toy.make_toy_traces(tmp_path)
    lines = (folder / "placements.csv").read_text().splitlines()
    ones = [line for line in lines[1:] if line.startswith("1,")]
    kept = [lines[0], ones[0], *(line for line in lines[1:] if not line.startswith("1,"))]
    (folder / "placements.csv").write_text("\n".join(kept) + "\n")
    _, bsz, step, sync = ones[0].split(",")
    app = Application(folder)
    assert app.throughput((1,), int(bsz)) == (float(step), float(sync))
    with pytest.raises(ValueError, match=rf"outside the measured range \[{bsz}, {bsz}\] of"):
        app.throughput((1,), 2 * int(bsz))
