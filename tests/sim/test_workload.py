"""Workload CSV parsing: column aliases and file/line/column errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptdl.sim import WorkloadError, read_workload


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "w.csv"
    path.write_text(text)
    return path


def test_pollux_columns(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "name,time,application,num_replicas,batch_size\nb-1,20,toy,4,64\na-0,10,toy,1,8\n"
    )
    jobs = read_workload(path, {"toy"})
    assert [j.name for j in jobs] == ["b-1", "a-0"]  # file order is kept
    assert (jobs[0].submission_time, jobs[0].num_replicas, jobs[0].batch_size) == (20.0, 4, 64)


def test_sia_style_aliases_and_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, "job_id,submit_time,model\nx,5.5,toy\n")
    (job,) = read_workload(path, {"toy"})
    assert (job.name, job.submission_time, job.application) == ("x", 5.5, "toy")
    assert (job.num_replicas, job.batch_size) == (1, None)


def test_header_spelling_is_normalised(tmp_path: Path) -> None:
    # Spaces, dashes and case do not matter: "Submit Time" is submit_time.
    path = _write(tmp_path, "Job ID,Submit Time,model,Num-GPUs\nx,5,toy,2\n")
    (job,) = read_workload(path, {"toy"})
    assert (job.name, job.submission_time, job.num_replicas) == ("x", 5.0, 2)
    with pytest.raises(WorkloadError, match="duplicate column"):
        read_workload(_write(tmp_path, "name,time,Time,application\na,1,1,toy\n"), {"toy"})


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("name,application\na,toy\n", r"w.csv:1: missing column\(s\): time"),
        ("name,time,application\na,ten,toy\n", r"w.csv:2: column 'time': expected a number"),
        ("name,time,application\na,1,toy\nb,2,gpt\n", r"w.csv:3: column 'application': unknown"),
        ("name,time,application,num_replicas\na,1,toy,2.5\n", r"w.csv:2: column 'num_replicas'"),
        (
            "name,time,application,batch_size\na,1,toy,0\n",
            r"w.csv:2: column 'batch_size': expected an integer from 1 to 2\*\*31 - 1, got '0'",
        ),
        (
            "name,time,application,num_replicas\na,1,toy," + "9" * 5000 + "\n",
            r"w.csv:2: column 'num_replicas': expected an integer from 1 to 2\*\*31 - 1, "
            r"got '9{20}'\.\.\. \(5000 characters\)",
        ),
        (
            "name,time,application\na,1" + "0" * 5000 + ",toy\n",
            r"w.csv:2: column 'time': expected a time .*, got '10{19}'\.\.\. \(5001 characters\)",
        ),
        # A quote left open swallowed every later row into a column nobody
        # reads; the error names the row where it opens.
        (
            'name,time,application,note\na,1,toy,ok\nb,2,toy,"open\nc,3,toy,ok\nd,4,toy,ok\n',
            r"w.csv:3: a quote opened in this row is never closed",
        ),
        ('name,time,application\na,1,"toy"x\n', r"w.csv:2: text after a closing quote"),
        ("name,time,application\na,1,toy\na,2,toy\n", r"w.csv:3: column 'name': duplicate"),
        ("name,time,application\na,-1,toy\n", r"w.csv:2: column 'time': expected a time >= 0"),
        ("", r"w.csv:1: empty file"),
        ("name,time,application\n", r"w.csv: no jobs"),
    ],
)
def test_errors_name_file_line_column(tmp_path: Path, text: str, pattern: str) -> None:
    with pytest.raises(WorkloadError, match=pattern):
        read_workload(_write(tmp_path, text), {"toy"})


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read workload"):
        read_workload(tmp_path / "missing.csv")


def test_byte_order_mark_and_bad_encoding(tmp_path: Path) -> None:
    path = tmp_path / "w.csv"
    path.write_bytes(b"\xef\xbb\xbfname,time,application\na,1,toy\n")  # as spreadsheets save
    assert [j.name for j in read_workload(path, {"toy"})] == ["a"]
    path.write_bytes(b"name,time,application\nj\xf6b,1,toy\n")
    with pytest.raises(WorkloadError, match=r"w.csv:2: not UTF-8 text \(byte 0xf6 at offset 23\)"):
        read_workload(path, {"toy"})
    # Past the first block the text stream decodes: the offset and line are
    # the file's, not the block's.
    rows = "".join(f"j{i},{i},toy\n" for i in range(600)).encode()
    bad = rows.index(b"j500,")
    path.write_bytes(b"name,time,application\n" + rows[:bad] + b"\xe9" + rows[bad:])
    offset = len(b"name,time,application\n") + bad
    with pytest.raises(WorkloadError, match=rf"w.csv:502: not UTF-8 .*at offset {offset}\)"):
        read_workload(path, {"toy"})
    path.write_text("name,time,application\n" + "a" * 200_000 + ",1,toy\n")
    with pytest.raises(WorkloadError, match=r"w.csv:\d+: malformed CSV"):
        read_workload(path, {"toy"})


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("name,time,application,Time\na,1,toy,2\n", r"w.csv:1: duplicate column\(s\) time"),
        (
            "name,time,application,num_replicas\na,1,toy\n",
            r"w.csv:2: expected 4 fields, got 3: no value for column\(s\) num_replicas",
        ),
        ("name,time,application\na,1,toy,4,8\n", r"w.csv:2: expected 3 fields, got 5"),
        (
            "name,time,application\na,1e300,toy\n",
            r"w.csv:2: column 'time': expected a time >= 0 and <= 1099511627776 s",
        ),
        ("name,time,application\na,nan,toy\n", r"w.csv:2: column 'time': expected a time >= 0"),
    ],
)
def test_malformed_rows_and_headers(tmp_path: Path, text: str, pattern: str) -> None:
    with pytest.raises(WorkloadError, match=pattern):
        read_workload(_write(tmp_path, text), {"toy"})


def test_jobs_remember_their_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "name,time,application\n\na,1,toy\nb,2,toy\n")
    assert [job.origin for job in read_workload(path, {"toy"})] == [f"{path}:3", f"{path}:4"]


def test_trailing_empty_fields_are_tolerated(tmp_path: Path) -> None:
    # As spreadsheets export them: empty extra header cells and trailing commas.
    path = _write(tmp_path, "name,time,application,,\na,1,toy,,\nb,2,toy,\n")
    assert [job.name for job in read_workload(path, {"toy"})] == ["a", "b"]


@pytest.mark.parametrize(
    ("header", "first", "second"),
    [
        ("name,time,application,submit_time", "time", "submit_time"),
        ("name,time,application,num_replicas,batch_size,gpus", "num_replicas", "gpus"),
        ("job_id,time,model,application", "application", "model"),
    ],
)
def test_two_columns_for_one_field(tmp_path: Path, header: str, first: str, second: str) -> None:
    values = ",".join(["a", "1", "toy", "1", "8", "2"][: header.count(",") + 1])
    path = _write(tmp_path, f"{header}\n{values}\n")
    with pytest.raises(WorkloadError, match=rf"w.csv:1: columns '{first}' and '{second}' both"):
        read_workload(path, {"toy"})


def test_rows_without_text_are_skipped_like_blank_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, "\n,,\nname,time,application\na,1,toy\n,,\n , ,\nb,2,toy\n")
    jobs = read_workload(path, {"toy"})
    assert [job.origin for job in jobs] == [f"{path}:4", f"{path}:7"]
    with pytest.raises(WorkloadError, match=r"w.csv:3: duplicate column\(s\) time"):
        read_workload(_write(tmp_path, "\n\nname,time,Time,application\n"), {"toy"})
    with pytest.raises(WorkloadError, match=r"w.csv:1: empty file \(or only blank lines\)"):
        read_workload(_write(tmp_path, "\n,,\n"), {"toy"})


@pytest.mark.parametrize(
    ("row", "column", "value"),
    [
        ("a,1_000,toy,1,8", "time", "1_000"),
        ("a,\u0661\u0662,toy,1,8", "time", "\u0661\u0662"),  # Arabic-Indic digits
        ("a,1,toy,\u0663,8", "num_replicas", "\u0663"),
        ("a,1,toy,1,1_6", "batch_size", "1_6"),
        ("a,1,toy,\uff12,8", "num_replicas", "\uff12"),  # a full-width 2
    ],
)
def test_numbers_need_ascii_digits(tmp_path: Path, row: str, column: str, value: str) -> None:
    path = _write(tmp_path, f"name,time,application,num_replicas,batch_size\n{row}\n")
    with pytest.raises(WorkloadError, match=rf"w.csv:2: column '{column}': expected .*{value!r}"):
        read_workload(path, {"toy"})


def test_number_forms_float_accepts_still_load(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "name,time,application,num_replicas\na,1e3,toy,+2\nb,.5,toy,3\nc,7.,toy,1\n"
    )
    times = [(job.submission_time, job.num_replicas) for job in read_workload(path, {"toy"})]
    assert times == [(1000.0, 2), (0.5, 3), (7.0, 1)]


def test_a_file_without_line_breaks_is_refused_without_reading_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /dev/zero as a workload used to grow to gigabytes of memory.
    from adaptdl.sim import _csvutil

    monkeypatch.setattr(_csvutil, "MAX_LINE", 100)
    path = _write(tmp_path, "name,time,application\n" + "x" * 1000)
    with pytest.raises(WorkloadError, match=r"w.csv:2: .*a line longer than 100 characters"):
        read_workload(path, {"toy"})
    assert len(_csvutil.shown("y" * 1000)) < 60


@pytest.mark.parametrize(
    ("header", "typo", "meant"),
    [
        ("name,time,application,num_replica,batch_size", "num_replica", "num_replicas"),
        ("name,time,application,num_replicas,batchsize", "batchsize", "batch_size"),
        ("name,time,application,Num-GPU", "Num-GPU", "num_gpus"),
    ],
)
def test_a_misspelt_column_is_an_error_not_a_default(
    tmp_path: Path, header: str, typo: str, meant: str
) -> None:
    # Ignored, num_replica made every job run on 1 GPU at the smallest batch.
    row = ",".join(["a", "1", "toy", "4", "64"][: header.count(",") + 1])
    path = _write(tmp_path, f"{header}\n{row}\n")
    with pytest.raises(
        WorkloadError, match=rf"w.csv:1: column '{typo}' is not .*did you mean '{meant}'"
    ):
        read_workload(path, {"toy"})


def test_unrelated_extra_columns_are_ignored(tmp_path: Path) -> None:
    # A pandas index (unnamed), and columns that are other columns, however
    # alike their names: none is a typo of a column read here.
    header = ",name,time,application,duration,max_batch_size,min_replicas,num_cpus"
    path = _write(tmp_path, f"{header}\n0,a,1,toy,3600,512,1,8\n")
    (job,) = read_workload(path, {"toy"})
    assert (job.name, job.application, job.category) == ("a", "toy", None)
    assert (job.num_replicas, job.batch_size) == (1, None)


def test_sia_category_column(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "name,time,application,num_replicas,batch_size,category\n"
        "a,1,toy,2,16,rigid\nb,2,toy,1,8,Adaptive\nc,3,toy,1,8,\n",
    )
    jobs = read_workload(path, {"toy"})
    assert [j.category for j in jobs] == ["rigid", "adaptive", None]
    assert jobs[0].where("category") == f"{path}:2: column 'category': "
