"""``adaptdl tensorboard``: instances are log directories in the cluster home."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from adaptdl.cli import main


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
    assert out.splitlines()[1].split() == ["my-tb", "1", str(logdir)]
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
    assert code == 1 and f"TensorBoard name {name!r}" in err
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
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    code, _, err = run(capsys, "tensorboard", "proxy", "tb", *h)
    assert code == 1 and "pip install tensorboard" in err
    code, _, err = run(capsys, "tensorboard", "proxy", "tb", "-p", "70000", *h)
    assert code == 1 and "--port=70000" in err
    code, _, err = run(capsys, "tensorboard", "proxy", "nosuch", *h)
    assert code == 1 and "no TensorBoard of that name" in err


def test_proxy_serves_the_log_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in ``tensorboard`` package that records how it was started.
    package = tmp_path / "fake" / "tensorboard"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    record = tmp_path / "argv.json"
    (package / "main.py").write_text(
        f"import json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    sys.modules.pop("tensorboard", None)
    h = ["--home", str(tmp_path / "home")]
    run(capsys, "tensorboard", "create", "tb", *h)
    code, out, err = run(capsys, "tensorboard", "proxy", "tb", "-p", "8080", *h)
    assert code == 0, err
    assert "Proxying to TensorBoard instance tb at http://localhost:8080" in out
    logdir = tmp_path / "home" / "tensorboard" / "tb"
    argv = json.loads(record.read_text())
    assert argv == ["--logdir", str(logdir), "--host", "localhost", "--port", "8080"]
