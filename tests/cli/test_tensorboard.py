"""``adaptdl tensorboard``: instances are log directories in the cluster home."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from adaptdl.cli import main
from adaptdl.testing import free_port

SRC = Path(__file__).resolve().parents[2] / "src"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_create_ls_delete(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    h = ["--home", str(tmp_path / "home")]
    code, out, _ = run(capsys, "tensorboard", "ls", *h)
    assert code == 0 and "no TensorBoard instances" in out
    code, out, err = run(capsys, "tensorboard", "create", "my-tb", *h)
    assert code == 0, err
    logdir = tmp_path / "home" / "tensorboard" / "my-tb"
    assert logdir.is_dir() and str(logdir) in out
    (logdir / "job-a").mkdir()
    code, out, _ = run(capsys, "tensorboard", "ls", *h)
    assert code == 0
    assert out.splitlines()[0].split() == ["NAME", "LOGS", "WRITING", "LOGDIR"]
    assert out.splitlines()[1].split() == ["my-tb", "1", "0", str(logdir)]  # no cluster ever
    code, _, err = run(capsys, "tensorboard", "create", "my-tb", *h)
    assert code == 1 and "already exists" in err
    code, out, err = run(capsys, "tensorboard", "delete", "my-tb", *h)
    assert code == 0, err
    assert not logdir.exists()
    code, _, err = run(capsys, "tensorboard", "delete", "my-tb", *h)
    assert code == 1 and "adaptdl tensorboard create my-tb" in err


@pytest.mark.parametrize("name", ["Bad_Name", "x-", "", "a" * 64, "../up"])
def test_bad_names_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    code, _, err = run(capsys, "tensorboard", "create", name, "--home", str(tmp_path))
    assert code == 2 and f"TensorBoard name {name!r}" in err
    assert not (tmp_path / "tensorboard").exists() or not any((tmp_path / "tensorboard").iterdir())


def test_proxy_without_tensorboard_says_how_to_install(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = ["--home", str(tmp_path)]
    run(capsys, "tensorboard", "create", "tb", *h)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.split(".")[0] == "tensorboard" else real(name, *a),
    )
    code, _, err = run(capsys, "tensorboard", "proxy", "tb", *h)
    assert code == 1 and "pip install tensorboard" in err
    code, _, err = run(capsys, "tensorboard", "proxy", "tb", "-p", "70000", *h)
    assert code == 2 and "--port=70000" in err
    code, _, err = run(capsys, "tensorboard", "proxy", "nosuch", *h)
    assert code == 1 and "no TensorBoard of that name" in err


@pytest.mark.parametrize("port", [None, "0", "free"])
def test_proxy_runs_tensorboard_on_the_log_directory(tmp_path: Path, port: str | None) -> None:
    # A stand-in ``tensorboard`` package that records how it was started; the
    # proxy replaces its own process with it, so it runs as a subprocess here.
    port = str(free_port()) if port == "free" else port
    package = tmp_path / "fake" / "tensorboard"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    record = tmp_path / "argv.json"
    (package / "main.py").write_text(
        f"import json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        "sys.exit(3)\n"
    )
    home = tmp_path / "home"
    assert main(["tensorboard", "create", "tb", "--home", str(home)]) == 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), str(SRC)]))
    argv = [sys.executable, "-m", "adaptdl.cli", "tensorboard", "proxy", "tb", "--home", str(home)]
    proc = subprocess.run(
        argv + ([] if port is None else ["-p", port]),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr  # TensorBoard's own exit status
    assert "starting TensorBoard for instance tb" in proc.stdout
    logdir = home / "tensorboard" / "tb"
    expected = ["--logdir", str(logdir), "--host", "localhost"]
    assert json.loads(record.read_text()) == expected + ([] if port is None else ["--port", port])


def test_proxy_refuses_a_port_in_use(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # TensorBoard, which replaces the CLI's process, failed there with 255.
    h = ["--home", str(tmp_path)]
    run(capsys, "tensorboard", "create", "tb", *h)
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, _, err = run(capsys, "tensorboard", "proxy", "tb", "-p", port, *h)
    assert code == 1 and f"--port {port}: cannot listen on localhost:{port}" in err, err


def test_ls_leaves_out_folders_no_command_accepts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # ls listed a hand-made 'Bad_Name' that delete (and proxy) refused.
    h = ["--home", str(tmp_path)]
    run(capsys, "tensorboard", "create", "good", *h)
    (tmp_path / "tensorboard" / "Bad_Name").mkdir()
    code, out, err = run(capsys, "tensorboard", "ls", *h)
    assert code == 0 and "good" in out and "Bad_Name" not in out
    assert "not TensorBoard instances (not a valid name), left out: Bad_Name" in err


def test_a_tensorboard_folder_that_is_a_file_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "tensorboard").write_text("not a folder\n")
    for argv in (["create", "tb"], ["ls"], ["delete", "tb"]):
        code, _, err = run(capsys, "tensorboard", *argv, "--home", str(tmp_path))
        assert code == 1 and "is not a directory" in err and "Traceback" not in err


def test_tensorboard_without_an_action_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "tensorboard")
    assert code == 2 and out == "" and "create" in err and "proxy" in err


def _store_with_job(home: Path, logdir: Path, phase: str) -> None:
    from adaptdl.cluster import Store
    from adaptdl.cluster._store import JobRow

    store = Store(home / "state.db")
    try:
        spec = {"env": {"ADAPTDL_TENSORBOARD_LOGDIR": str(logdir)}}
        store.insert(JobRow(name="writer", spec=spec, token="t", phase=phase, submitted=1.0))
    finally:
        store.close()


def _home_with_tb(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> tuple[Path, list[str]]:
    """A cluster home holding the TensorBoard instance "tb", and its --home option."""
    home = tmp_path / "home"
    h = ["--home", str(home)]
    assert run(capsys, "tensorboard", "create", "tb", *h)[0] == 0
    return home, h


def test_delete_without_a_daemon_asks_the_job_store(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Replicas outlive "cluster stop --leave-jobs": no daemon answering is
    # not the same as no job writing.
    home, h = _home_with_tb(capsys, tmp_path)
    logdir = home / "tensorboard" / "tb"
    _store_with_job(home, logdir, "Running")
    code, out, _ = run(capsys, "tensorboard", "ls", *h)
    assert code == 0 and out.splitlines()[1].split()[:3] == ["tb", "0", "1"]
    code, _, err = run(capsys, "tensorboard", "delete", "tb", *h)
    assert code == 1 and "in use by unfinished jobs (writer)" in err and "--force" in err
    assert logdir.is_dir()
    code, _, err = run(capsys, "tensorboard", "delete", "tb", "--force", *h)
    assert code == 0, err
    assert not logdir.exists()


def test_delete_after_the_writers_finished(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    home, h = _home_with_tb(capsys, tmp_path)
    _store_with_job(home, home / "tensorboard" / "tb", "Succeeded")
    code, _, err = run(capsys, "tensorboard", "delete", "tb", *h)
    assert code == 0, err


def test_delete_refuses_when_the_job_store_cannot_be_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    home, h = _home_with_tb(capsys, tmp_path)
    (home / "state.db").write_bytes(b"not a database" * 100)
    code, _, err = run(capsys, "tensorboard", "delete", "tb", *h)
    assert code == 1 and "cannot tell whether jobs still write" in err
    assert (home / "tensorboard" / "tb").is_dir()
    code, out, _ = run(capsys, "tensorboard", "ls", *h)
    assert code == 0 and out.splitlines()[1].split()[2] == "-"


def test_a_symlinked_instance_is_not_listed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # ls, create and delete agree: a symlink in the folder is no instance.
    home = tmp_path / "home"
    (home / "tensorboard").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (home / "tensorboard" / "linked").symlink_to(tmp_path / "elsewhere")
    code, out, _ = run(capsys, "tensorboard", "ls", "--home", str(home))
    assert code == 0 and "no TensorBoard instances" in out


def test_submit_names_the_tensorboard_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "main.py"
    script.write_text("print(1)\n")
    code, _, err = run(
        capsys, "submit", str(script), "--tensorboard", "Bad", "--home", str(tmp_path / "h")
    )
    assert code == 2 and "--tensorboard 'Bad'" in err


def test_proxy_is_not_fooled_by_a_tensorboard_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "python -m adaptdl.cli" puts the current directory on sys.path, where
    # a "tensorboard" folder is a namespace package without tensorboard.main.
    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("TensorBoard is installed here")
    (tmp_path / "shadow" / "tensorboard").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "shadow"))

    def no_exec(*args: object) -> None:
        raise AssertionError(f"TensorBoard was started: {args}")

    monkeypatch.setattr(os, "execv", no_exec)  # else it would replace this process
    h = ["--home", str(tmp_path / "home")]
    assert run(capsys, "tensorboard", "create", "tb", *h)[0] == 0
    code, _, err = run(capsys, "tensorboard", "proxy", "tb", *h)
    assert code == 1 and "pip install tensorboard" in err
