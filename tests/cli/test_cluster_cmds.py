"""The cluster commands of the ``adaptdl`` CLI, against a real daemon.

Bad input must give a clear error naming the thing, a non-zero exit status,
and change nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptdl.cli import CLIError, main
from adaptdl.cli._cluster_cmds import job_rows
from adaptdl.cluster import ClusterAPIError, ClusterClient, DaemonNotRunningError
from adaptdl.cluster._daemon import parse_config, run_daemon
from tests.cluster.conftest import (
    COUNTER,
    ROOT,
    expected_total,
    start_test_daemon,
    stop_cluster,
    wait_for,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), old or ""])
    path = tmp_path_factory.mktemp("cli") / "home"
    start_test_daemon(path, interval=0.5)
    try:
        yield path
    finally:
        stop_cluster(path)
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _no_jobs(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    code, out, _ = run(capsys, "ls", "--home", str(home))
    assert code == 0 and out.strip() == "no jobs"


def test_daemon_not_reachable(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv in (["ls"], ["describe", "x"], ["delete", "x"], ["cluster", "status"]):
        code, _, err = run(capsys, *argv, "--home", str(tmp_path))
        assert code == 1
        assert f"no adaptdl cluster daemon is running for {tmp_path}" in err
    # A stale daemon.json (dead daemon) is reported too, not hung on.
    (tmp_path / "daemon.json").write_text(
        json.dumps({"url": "http://127.0.0.1:9", "token": "t", "pid": 999999})
    )
    code, _, err = run(capsys, "ls", "--home", str(tmp_path))
    assert code == 1 and "is not reachable" in err


@contextlib.contextmanager
def _hung_daemon(home: Path) -> Iterator[None]:
    """This process holds ``home``'s daemon lock and record but answers nothing."""
    import fcntl

    with open(home / "daemon.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write(str(os.getpid()))
        lock.flush()
        record = {"url": "http://127.0.0.1:9", "token": "t", "pid": os.getpid()}
        (home / "daemon.json").write_text(json.dumps(record))
        yield


def test_a_hung_daemon_is_named_with_what_to_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # "restart it with: adaptdl cluster start" only led to a wait for the
    # lock the stopped daemon still held.
    with _hung_daemon(tmp_path):
        code, _, err = run(capsys, "ls", "--home", str(tmp_path))
        assert code == 1
        assert f"(pid {os.getpid()}) runs but does not answer at http://127.0.0.1:9" in err
        assert f"kill -CONT {os.getpid()}" in err
        # Commands that start a daemon when none runs say the same at once,
        # instead of waiting half a minute for the lock.
        for argv in (
            ["cluster", "start"],
            ["submit", str(COUNTER)],
            ["demo", "--timeout", "5"],
        ):
            started = time.monotonic()
            code, out, err = run(capsys, *argv, "--home", str(tmp_path))
            assert code == 1 and f"kill -CONT {os.getpid()}" in err, (argv, err)
            assert "reusing the settings" not in out
            assert time.monotonic() - started < 10, argv


def test_a_daemon_in_its_last_moments_of_stopping_is_not_called_hung(tmp_path: Path) -> None:
    # Between closing its HTTP service and removing daemon.json, a stopping
    # daemon was reported as "runs but does not answer ... (stopped or hung?)".
    import threading

    from adaptdl.cluster import ClusterClient, DaemonNotAnsweringError, DaemonNotRunningError

    with _hung_daemon(tmp_path):
        timer = threading.Timer(0.5, (tmp_path / "daemon.json").unlink)
        timer.start()
        with pytest.raises(DaemonNotRunningError, match="it has just stopped") as info:
            ClusterClient(tmp_path)
        timer.join()
    assert not isinstance(info.value, DaemonNotAnsweringError)


def test_a_slow_answer_to_a_change_is_not_called_a_stopped_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A submit that waited on the state database was reported as "stopped
    # answering" after 10 s, then went through: a retry was refused.
    import http.server
    import threading

    from adaptdl.cluster import ClusterClient, DaemonTimeoutError, _client

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps({"status": "ok", "pid": os.getpid()}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            time.sleep(1.5)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        (tmp_path / "daemon.json").write_text(
            json.dumps({"url": url, "token": "t", "pid": os.getpid()})
        )
        monkeypatch.setattr(_client, "CHANGE_TIMEOUT", 0.5)
        client = ClusterClient(tmp_path, timeout=0.2)
        with pytest.raises(DaemonTimeoutError) as info:
            client.request("POST", "/api/jobs", {})
        assert str(info.value) == (
            f"the adaptdl cluster daemon at {url} did not answer POST /api/jobs within 0.5s; "
            "it may still carry it out: check with 'adaptdl ls' before retrying"
        )
    finally:
        server.shutdown()
        server.server_close()


def test_unknown_job(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    for command in ("describe", "delete", "logs"):
        code, _, err = run(capsys, command, "nope", "--home", str(home))
        assert code == 1, command
        assert "no job named 'nope'" in err
    for odd in ("a b", "../x", "x/y", "A_B"):  # names that need quoting in a URL
        code, _, err = run(capsys, "describe", odd, "--home", str(home))
        assert code == 1 and f"no job named {odd!r}" in err
    code, _, err = run(capsys, "cp", "nope:share/x", "/tmp/x", "--home", str(home))
    assert code == 1 and "no job named 'nope'" in err
    for argv in (["describe", ""], ["logs", " "], ["delete", ""], ["cp", ":share", "/tmp/x"]):
        with pytest.raises(SystemExit) if argv[0] != "cp" else contextlib.nullcontext():
            code, _, err = run(capsys, *argv, "--home", str(home))
            assert code == 2
        assert "invalid job name" in capsys.readouterr().err + err
    _no_jobs(capsys, home)


def test_bad_submissions_change_nothing(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    h = ["--home", str(home)]
    code, _, err = run(capsys, "submit", *h, str(tmp_path / "missing.py"))
    assert code == 1 and "missing.py" in err and "does not exist" in err

    code, _, err = run(capsys, "submit", *h, str(tmp_path))
    assert code == 1 and "neither adaptdljob.yaml nor main.py" in err
    code, _, err = run(capsys, "submit", *h, os.devnull)
    assert code == 1 and f"{os.devnull!r} is neither a file nor a directory" in err

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("spec: [oops\n")
    code, _, err = run(capsys, "submit", *h, "-f", str(bad_yaml), str(tmp_path))
    assert code == 1 and "is not valid YAML" in err and "bad.yaml" in err

    project = tmp_path / "proj"
    project.mkdir()

    def write_job(spec: str, script: str) -> None:
        (project / "adaptdljob.yaml").write_text(
            "apiVersion: adaptdl.petuum.com/v1\nkind: AdaptDLJob\nmetadata: {name: proj}\n"
            f"spec:\n{spec}  template:\n    spec:\n"
            f"      containers: [{{name: main, command: [python3, {script}]}}]\n"
        )

    write_job("  minReplicas: 3\n  maxReplicas: 2\n", "train.py")
    code, _, err = run(capsys, "submit", *h, str(project))
    assert code == 1 and "minReplicas=3 is greater than spec.maxReplicas=2" in err
    # A flag's value is not blamed on the file (it said spec.minReplicas=5).
    code, _, err = run(
        capsys, "submit", *h, "--min-replicas", "5", "--max-replicas", "4", str(project)
    )
    assert code == 2 and "--min-replicas=5 is greater than --max-replicas=4" in err, err
    code, _, err = run(capsys, "submit", *h, "--max-replicas", "1", str(project))
    assert code == 1 and "spec.minReplicas=3 is greater than --max-replicas=1" in err, err
    code, _, err = run(capsys, "submit", *h, "--min-replicas", "4", str(project))
    assert code == 1 and "--min-replicas=4 is greater than spec.maxReplicas=2" in err, err

    code, _, err = run(
        capsys,
        "submit",
        *h,
        str(COUNTER),
        "--min-replicas",
        "3",
        "--max-replicas",
        "1",
        "--",
        "--steps",
        "1",
    )
    assert code == 2 and "--min-replicas=3 is greater than --max-replicas=1" in err

    write_job("", "train.py")
    code, _, err = run(capsys, "submit", *h, str(project))
    assert code == 1 and "script 'train.py' not found in" in err

    # The original hello-world job file names the path its Dockerfile copies to.
    (project / "hello_world.py").write_text("print('Hello, world!')\n")
    write_job("", "/root/hello_world.py")
    code, _, err = run(capsys, "submit", *h, str(project))
    assert code == 1 and "script '/root/hello_world.py' not found in" in err
    assert f"{project / 'hello_world.py'} exists: the local cluster runs jobs" in err
    assert "name the script 'hello_world.py' in the command" in err

    code, _, err = run(capsys, "submit", *h, "--min-replicas", "9", str(COUNTER))
    assert code == 1 and "minReplicas=9 but this cluster has only 4" in err

    # Submit options after the script are recognised even without "--".
    code, _, err = run(
        capsys, "submit", *h, str(COUNTER), "--min-replicas", "3", "--max-replicas", "1"
    )
    assert code == 2 and "--min-replicas=3 is greater than --max-replicas=1" in err
    code, _, err = run(capsys, "submit", *h, str(COUNTER), "-f", str(bad_yaml))
    assert code == 1 and "is not valid YAML" in err
    _no_jobs(capsys, home)


def test_more_bad_submissions_change_nothing(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = ["--home", str(home)]
    shell = tmp_path / "run.sh"
    shell.write_text("echo hi\n")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for argv, status, fragment in (
        # A shell script was run with python and failed four times.
        (["submit", *h, str(shell)], 1, "is not a Python script"),
        # A misspelt submit option after the script reached the job.
        (["submit", *h, str(COUNTER), "--max-replica", "2"], 2, "did you mean --max-replicas?"),
        (["submit", *h, str(COUNTER), "--Min_Replicas", "2"], 2, "did you mean --min-replicas?"),
        # Empty paths meant the current directory or no job file at all.
        (["submit", *h, ""], 2, "script or project directory '': expected a path"),
        (["submit", *h, "-f", "", str(COUNTER)], 2, "-f '': expected a job file"),
        (["ls", "--home", ""], 2, "--home '': expected a directory"),
        (
            ["ls", "--home", str(blocker / "sub")],
            1,
            f"--home {blocker / 'sub'}: {blocker} is a file, so no directory",
        ),
    ):
        code, _, err = run(capsys, *argv)
        assert code == status and fragment in err, (argv, err)
    # The hint blamed --home for a value that came from ADAPTDL_HOME.
    monkeypatch.setenv("ADAPTDL_HOME", str(blocker / "sub"))
    code, _, err = run(capsys, "ls")
    assert code == 1 and f"ADAPTDL_HOME={blocker / 'sub'}: {blocker} is a file" in err, err
    assert "--home" not in err.split(":")[0]
    monkeypatch.undo()
    # Undecodable file names and impossible job names: no traceback.
    odd = tmp_path / "caf\udce9"
    os.makedirs(os.fsencode(odd))
    (odd / "main.py").write_text("print(1)\n")
    code, _, err = run(capsys, "submit", *h, str(odd))
    assert code == 1 and "is not valid UTF-8" in err and "Traceback" not in err
    for command in ("describe", "logs", "delete"):
        for name in ("caf\udce9", "x" * 70_000):
            with pytest.raises(SystemExit) as info:
                run(capsys, command, name, *h)
            assert info.value.code == 2
            err = capsys.readouterr().err
            assert "invalid job name" in err and len(err) < 2000
            assert "not valid UTF-8" in err or "job names have at most 63" in err
    _no_jobs(capsys, home)


def test_a_yaml_target_is_the_job_file_and_describe_quotes_the_command(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    h = ["--home", str(home)]
    job = tmp_path / "job.yaml"
    job.write_text(
        "apiVersion: adaptdl.petuum.com/v1\nkind: AdaptDLJob\nmetadata: {name: from-yaml}\n"
        "spec:\n  template:\n    spec:\n"
        f"      containers: [{{name: main, command: [python3, '{COUNTER}'], "
        "args: ['--steps', '1', '']}]\n"
    )
    code, out, err = run(capsys, "submit", *h, str(job))
    assert code == 0, err
    assert "job from-yaml submitted" in out
    code, out, _ = run(capsys, "describe", "from-yaml", *h)
    assert code == 0
    assert f"Command:      python3 {COUNTER} --steps 1 ''" in out
    run(capsys, "delete", "from-yaml", *h)
    code, _, err = run(capsys, "submit", *h, str(job), "-f", str(job))
    assert code == 1 and "is a job file and -f" in err


def test_tensorboard_and_dockerfile_options_of_the_original_cli(
    capsys: pytest.CaptureFixture[str], home: Path
) -> None:
    # The documentation's "adaptdl submit ... --tensorboard NAME -d Dockerfile".
    h = ["--home", str(home)]
    argv = ["submit", *h, str(COUNTER), "--name", "with-tb", "--tensorboard", "tb"]
    code, _, err = run(capsys, *argv)
    assert code == 1 and "adaptdl tensorboard create tb" in err
    assert run(capsys, "tensorboard", "create", "tb", *h)[0] == 0
    code, out, err = run(capsys, *argv, "-d", "tutorial/Dockerfile", "--", "--steps", "1")
    assert code == 0, err
    assert "-d tutorial/Dockerfile ignored" in err
    spec = ClusterClient(home).describe("with-tb")["spec"]
    logdir = str(home / "tensorboard" / "tb")
    assert spec["env"]["ADAPTDL_TENSORBOARD_LOGDIR"] == logdir
    assert spec["args"] == ["--steps", "1"]  # neither option reached the job
    # ls counts the jobs attached now (it counted log folders only: 0 here).
    code, out, _ = run(capsys, "tensorboard", "ls", *h)
    assert code == 0 and out.splitlines()[1].split()[:3] == ["tb", "0", "1"], out
    # Deleting the instance under a running job is refused, naming the job.
    code, _, err = run(capsys, "tensorboard", "delete", "tb", *h)
    assert code == 1 and "with-tb" in err and "--force" in err
    assert Path(logdir).is_dir()
    run(capsys, "delete", *h, "with-tb")
    wait_for(lambda: not ClusterClient(home).jobs(), 30, "the job to go")
    assert run(capsys, "tensorboard", "delete", "tb", *h)[0] == 0
    # A job's own -d after the script is the job's, unless it names a Dockerfile.
    argv = ["submit", *h, str(COUNTER), "--name", "own-d", "-d", "/data", "--steps", "1"]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    assert "ignored" not in err
    assert ClusterClient(home).describe("own-d")["spec"]["args"] == ["-d", "/data", "--steps", "1"]
    run(capsys, "delete", *h, "own-d")
    wait_for(lambda: not ClusterClient(home).jobs(), 30, "the job to go")


def test_daemon_options_are_checked_and_flagged_when_a_daemon_runs(
    capsys: pytest.CaptureFixture[str], home: Path
) -> None:
    h = ["--home", str(home)]
    for bad, message in (
        (["--interval", "nan"], "--interval=nan"),
        (["--grace", "-5"], "--grace=-5.0"),
        (["--policy", "nope"], "unknown policy 'nope'"),
    ):
        for argv in (["cluster", "start", *h, *bad], ["submit", *h, *bad, str(COUNTER)]):
            code, _, err = run(capsys, *argv)
            assert code == 2 and message in err, (argv, err)
    code, out, err = run(capsys, "cluster", "start", *h, "--slots", "1")
    assert code == 0 and "already running" in out
    assert "--slots apply only when it starts" in err
    # No abbreviations after the script: "--min" is the job's, not --min-replicas.
    code, out, err = run(capsys, "submit", *h, str(COUNTER), "--name", "abbrev", "--min", "0.1")
    assert code == 0 and "job abbrev submitted" in out
    code, out, _ = run(capsys, "describe", *h, "abbrev")
    assert code == 0 and "--min" in out and "0.1" in out
    code, _, _ = run(capsys, "delete", *h, "abbrev")
    assert code == 0
    wait_for(lambda: run(capsys, "ls", *h)[1].strip() == "no jobs", 60, "the job to go")


def test_unknown_policy_starts_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "cluster", "start", "--home", str(tmp_path), "--policy", "nope")
    # Only the policies a cluster runs are offered, not the simulator baselines.
    assert code == 2 and "unknown policy 'nope'; on a cluster use one of: adaptdl, pollux" in err
    assert not (tmp_path / "daemon.json").exists()
    with pytest.raises(DaemonNotRunningError):
        ClusterClient(tmp_path)


def test_submit_ls_describe_logs_cp_delete(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    h = ["--home", str(home)]
    code, out, _ = run(capsys, "cluster", "start", *h)
    assert code == 0 and "already running" in out

    code, out, err = run(
        capsys, "submit", str(COUNTER), "--name", "cli-job", *h, "--", "--steps", "30"
    )
    assert code == 0, err
    assert "job cli-job submitted" in out

    def finished() -> bool:
        run(capsys, "ls", *h)
        return bool(ClusterClient(home).describe("cli-job")["phase"] == "Succeeded")

    wait_for(finished, 40, "cli-job to succeed")
    code, out, _ = run(capsys, "ls", *h)
    header, row = out.splitlines()[:2]
    assert header.split() == [
        "NAME",
        "STATUS",
        "REPLICAS",
        "RESTARTS",
        "BATCH",
        "GOODPUT",
        "DURATION",
        "AGE",
    ]
    assert row.split()[:2] == ["cli-job", "Succeeded"]

    code, out, _ = run(capsys, "describe", "cli-job", *h)
    assert code == 0 and "Status:       Succeeded" in out and "Started" in out

    code, out, _ = run(capsys, "logs", "cli-job", "--rank", "0", *h)
    assert code == 0 and "step 30 loss" in out and "restart group 0" in out
    code, _, err = run(capsys, "logs", "cli-job", "--rank", "3", *h)
    assert code == 1 and "no log for rank 3" in err

    dest = tmp_path / "result.json"
    code, out, _ = run(capsys, "cp", "cli-job:/adaptdl/share/result.json", str(dest), *h)
    assert code == 0
    assert json.loads(dest.read_text()) == {"steps": 30, "total": expected_total(30)}
    code, _, err = run(capsys, "cp", "cli-job:share/../../../etc/passwd", str(dest), *h)
    assert code == 2 and "expected share/..." in err
    # Copying an empty folder (e.g. a checkpoint never written) says so.
    (Path(ClusterClient(home).describe("cli-job")["paths"]["share"]) / "empty").mkdir()
    code, _, err = run(capsys, "cp", "cli-job:share/empty", str(tmp_path / "e"), *h)
    assert code == 0 and "adaptdl: note: cli-job:share/empty is empty" in err, err

    code, out, _ = run(capsys, "delete", "cli-job", *h)
    assert code == 0
    wait_for(lambda: not ClusterClient(home).jobs(), 60, "cli-job to go")
    _no_jobs(capsys, home)
    code, out, _ = run(capsys, "cluster", "status", *h)
    assert code == 0 and "0/4 cpu in use" in out


def test_cp_copies_links_as_links_and_stays_in_its_folder(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    h = ["--home", str(home)]
    code, _, err = run(capsys, "submit", str(COUNTER), "--name", "cp-job", *h, "--", "--steps", "3")
    assert code == 0, err
    wait_for(lambda: ClusterClient(home).describe("cp-job")["phase"] == "Succeeded", 120, "cp-job")
    share = Path(ClusterClient(home).describe("cp-job")["paths"]["share"])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not the job's\n")
    (share / "data").symlink_to(outside)  # e.g. a dataset linked into the share
    (share / "dangling").symlink_to(tmp_path / "nowhere")
    # The link named directly is refused; inside a copied folder it stays a
    # link: neither the files behind it nor a dangling one break the copy.
    code, _, err = run(capsys, "cp", "cp-job:share/data", str(tmp_path / "d"), *h)
    assert code == 1 and "leaves the job's share folder" in err
    code, _, err = run(capsys, "cp", "cp-job:share", str(tmp_path / "copy"), *h)
    assert code == 0, err
    assert (tmp_path / "copy" / "data").is_symlink()
    assert (tmp_path / "copy" / "dangling").is_symlink()
    assert (tmp_path / "copy" / "result.json").is_file()
    # ".." cannot reach the job's other folders.
    for path in ("share/../run", "share/..", "/adaptdl/share/../run"):
        code, _, err = run(capsys, "cp", f"cp-job:{path}", str(tmp_path / "r"), *h)
        assert code == 2 and "expected share/..." in err, path
    assert not (tmp_path / "r").exists()
    # "DIR/" must be an existing directory, as for cp; an empty DEST is refused.
    code, _, err = run(capsys, "cp", "cp-job:share/result.json", str(tmp_path / "new") + "/", *h)
    assert code == 1 and "no such directory" in err
    assert not (tmp_path / "new").exists()
    code, _, err = run(capsys, "cp", "cp-job:share/result.json", "", *h)
    assert code == 2 and "DEST ''" in err
    code, _, err = run(capsys, "cp", "cp-job:share", str(tmp_path / "copy" / "result.json"), *h)
    assert code == 1 and "is a file" in err
    # Copying a folder with links again merges, as cp -r does (an existing
    # link failed the copy); a link at a file's place is replaced, not
    # written through.
    (tmp_path / "m").mkdir()
    assert run(capsys, "cp", "cp-job:share", str(tmp_path / "m") + "/", *h)[0] == 0
    (tmp_path / "m" / "share" / "result.json").unlink()
    (tmp_path / "m" / "share" / "result.json").symlink_to(outside / "secret.txt")
    (share / "data").unlink()
    (share / "data").symlink_to(tmp_path / "elsewhere")
    code, _, err = run(capsys, "cp", "cp-job:share", str(tmp_path / "m") + "/", *h)
    assert code == 0, err
    assert os.readlink(tmp_path / "m" / "share" / "data") == str(tmp_path / "elsewhere")
    assert not (tmp_path / "m" / "share" / "result.json").is_symlink()
    assert (outside / "secret.txt").read_text() == "not the job's\n"
    # A folder copied into itself is refused, with nothing made (it recursed
    # ~500 levels deep, then failed with a traceback).
    (share / "sub").mkdir()
    code, _, err = run(capsys, "cp", "cp-job:share/sub", str(share / "sub" / "deep"), *h)
    assert code == 1 and "cannot copy a directory into itself" in err, err
    assert not (share / "sub" / "deep").exists()
    # A folder, like a file, needs DEST's parent to exist (it was made).
    code, _, err = run(capsys, "cp", "cp-job:share/sub", str(tmp_path / "no" / "such"), *h)
    assert code == 1 and "destination directory" in err and "does not exist" in err
    assert not (tmp_path / "no").exists()
    code, _, err = run(capsys, "cp", "cp-job:share/result.json", str(share / "result.json"), *h)
    assert code == 1 and "is cp-job:share/result.json itself" in err, err
    assert run(capsys, "delete", "cp-job", *h)[0] == 0
    wait_for(lambda: "cp-job" not in [j["name"] for j in ClusterClient(home).jobs()], 60, "gone")


def test_a_generated_name_that_is_taken_is_replaced(
    capsys: pytest.CaptureFixture[str], home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import secrets

    h = ["--home", str(home)]
    steps = ["--", "--steps", "2"]
    assert run(capsys, "submit", str(COUNTER), "--name", "counter-beef", *h, *steps)[0] == 0
    suffixes = iter(["beef", "cafe"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(suffixes))
    code, out, err = run(capsys, "submit", str(COUNTER), *h, *steps)
    assert code == 0 and "job counter-cafe submitted" in out, err
    # A name the user chose is theirs: taken, it is an error.
    code, _, err = run(capsys, "submit", str(COUNTER), "--name", "counter-beef", *h, *steps)
    assert code == 1 and "a job named 'counter-beef' already exists" in err
    for name in ("counter-beef", "counter-cafe"):
        assert run(capsys, "delete", name, *h)[0] == 0
    wait_for(lambda: not ClusterClient(home).jobs(), 60, "the jobs to go")


def test_bad_logs_and_cp_arguments_are_named_without_a_daemon(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    h = ["--home", str(tmp_path)]
    for argv, expected in (
        (["logs", "j", "--rank", "-1"], "--rank=-1"),
        (["logs", "j", "--tail", "-5"], "--tail=-5"),
        (["cp", "j:/etc/passwd", "x"], "expected share/..."),
        (["cp", "j:bogus", "x"], "expected share/..."),
        (["cp", "j:share/x", ""], "DEST ''"),
    ):
        code, _, err = run(capsys, *argv, *h)
        assert code == 2 and expected in err and "daemon" not in err, argv


def test_counts_beyond_a_job_spec_are_usage_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for option in ("--min-replicas", "--max-replicas", "--max-restarts"):
        code, _, err = run(
            capsys, "submit", "--home", str(tmp_path), str(COUNTER), option, "99999999999"
        )
        assert code == 2 and f"{option}=99999999999: must be <= 2147483647" in err
    assert not (tmp_path / "daemon.json").exists()


def test_a_bare_dash_dash_clears_a_job_files_args(tmp_path: Path) -> None:
    from adaptdl.cli import build_parser
    from adaptdl.cli._cluster_cmds import _build_spec, _split_submit_args

    (tmp_path / "main.py").write_text("print(1)\n")
    (tmp_path / "adaptdljob.yaml").write_text(
        "apiVersion: adaptdl.petuum.com/v1\nkind: AdaptDLJob\nmetadata:\n  name: j\n"
        "spec:\n  template:\n    spec:\n      containers:\n      - name: main\n"
        "        command: [python, main.py]\n        args: [--from-file]\n"
    )
    for tail, expected in (([], ("--from-file",)), (["--"], ()), (["--", "x"], ("x",))):
        args = build_parser().parse_args(["submit", str(tmp_path), *tail])
        assert _build_spec(args, _split_submit_args(args)).args == expected, tail


def test_demo_reads_the_loss_before_and_after_each_resize() -> None:
    from adaptdl.cli._demo import resize_losses

    log = (
        "===== adaptdl: restart group 0, replica 0 of 1, started x =====\n"
        "Train Epoch: 3 [0] Loss: 0.900000 batch size 64\n"
        "Epoch 3: train loss 0.8000, test loss 0.7000, accuracy 70.0%\n"
        "===== adaptdl: restart group 1, replica 0 of 2, started y =====\n"
        "Train Epoch: 4 [0] Loss: 0.750000 batch size 128\n"
        "===== adaptdl: restart group 2, replica 0 of 1, started z =====\n"
    )
    assert resize_losses(log) == [
        (1, 1, "Epoch 3, loss 0.8000", 2, "Epoch: 4, loss 0.750000"),
        (2, 2, "Epoch: 4, loss 0.750000", 1, None),
    ]


def test_failed_job_shows_its_traceback(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    h = ["--home", str(home)]
    code, _, err = run(
        capsys,
        "submit",
        str(COUNTER),
        "--name",
        "boom",
        "--max-restarts",
        "0",
        *h,
        "--",
        "--fail-at",
        "2",
    )
    assert code == 0, err

    def failed() -> bool:
        return bool(ClusterClient(home).describe("boom")["phase"] == "Failed")

    wait_for(failed, 30, "boom to fail")
    code, out, _ = run(capsys, "describe", "boom", *h)
    assert code == 0
    assert "Status:       Failed (ReplicaFailed)" in out
    assert "Error:\n  replica 0 exited with code 1" in out
    assert "RuntimeError: counter job failed on purpose at step 2" in out
    code, out, _ = run(capsys, "logs", "boom", *h)
    assert "Traceback (most recent call last)" in out
    run(capsys, "delete", "boom", *h)


def test_submit_starts_a_daemon_when_none_runs(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    del home  # only for PYTHONPATH, so the new daemon finds the test policy
    other = tmp_path / "autostart"
    argv = ["--home", str(other), "--slots", "2", "--policy", "test-fair"]
    argv += ["--plugin", "tests.cluster._plugin"]
    try:
        code, out, err = run(capsys, "submit", *argv, str(COUNTER), "--", "--steps", "3")
        assert code == 0, err
        assert "started an adaptdl cluster at http://127.0.0.1:" in out
        code, out, _ = run(capsys, "cluster", "status", "--home", str(other))
        assert code == 0 and ("0/2 cpu in use" in out or "1/2 cpu in use" in out)
        assert "test-fair" in out
        code, out, _ = run(capsys, "cluster", "stop", "--home", str(other))
        assert code == 0 and "cluster stopped" in out
        code, _, err = run(capsys, "ls", "--home", str(other))
        assert code == 1 and "no adaptdl cluster daemon is running" in err
    finally:
        stop_cluster(other)


def test_a_refused_submit_says_how_to_stop_the_daemon_it_started(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    del home  # only for PYTHONPATH
    other = tmp_path / "refused"
    argv = ["--home", str(other), "--slots", "2", "--min-replicas", "5"]
    try:
        code, out, err = run(capsys, "submit", *argv, str(COUNTER))
        assert "started an adaptdl cluster" in out
        assert code == 1 and "needs minReplicas=5 but this cluster has only 2" in err
        # Not stopped: another command may be using it by now.
        assert f"keeps running; 'adaptdl cluster stop --home {other}' stops it" in err
        assert ClusterClient(other).jobs() == []
    finally:
        stop_cluster(other)


def test_slots_beyond_the_gpus(
    capsys: pytest.CaptureFixture[str],
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    del home  # only for PYTHONPATH
    other = tmp_path / "gpus"
    h = ["--home", str(other)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    code, _, err = run(capsys, "cluster", "start", *h, "--slots", "4")
    # A bad option value: a usage error (2), as the README says.
    assert code == 2 and "--slots 4: this machine has 2 GPUs (0, 1)" in err
    with pytest.raises(DaemonNotRunningError):
        ClusterClient(other)
    try:
        code, out, err = run(capsys, "cluster", "start", *h, "--slots", "2")
        assert code == 0 and "2 gpu slots" in out, err
        run(capsys, "cluster", "stop", *h)
        # Fewer GPUs now than when --slots 2 was saved: a start still works.
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
        code, out, err = run(capsys, "cluster", "start", *h)
        assert code == 0 and "1 gpu slots" in out, err
        assert "the saved --slots 2" in err and "the cluster uses 1" in err
    finally:
        stop_cluster(other)


def test_logs_tail(
    capsys: pytest.CaptureFixture[str], home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = ["--home", str(home)]
    code, _, err = run(
        capsys, "submit", str(COUNTER), "--name", "tail-job", *h, "--", "--steps", "4"
    )
    assert code == 0, err
    wait_for(
        lambda: ClusterClient(home).describe("tail-job")["phase"] == "Succeeded", 40, "tail-job"
    )
    code, _, err = run(capsys, "logs", "tail-job", "--tail", "-1", *h)
    assert code == 2 and "--tail=-1: must be >= 0" in err
    code, out, _ = run(capsys, "logs", "tail-job", "--tail", "0", *h)
    assert code == 0 and out == ""
    code, out, _ = run(capsys, "logs", "tail-job", "--tail", "2", *h)
    assert code == 0 and out == "step 4 loss 0.200000 replicas 1\ndone\n"
    code, out, _ = run(capsys, "logs", "tail-job", "--tail", "1000", *h)
    assert code == 0 and out.startswith("===== adaptdl: restart group 0") and out.endswith("done\n")

    # Bytes appended right after the tail was read are still printed when following.
    log = home / "jobs" / "tail-job" / "logs" / "replica-0.log"
    from adaptdl.cli import _cluster_cmds

    tail_offset = _cluster_cmds._tail_offset

    def append_after(handle: Any, end: int, count: int) -> int:
        offset = tail_offset(handle, end, count)
        with open(log, "a") as appender:
            appender.write("appended later\n")
        return offset

    monkeypatch.setattr(_cluster_cmds, "_tail_offset", append_after)
    code, out, _ = run(capsys, "logs", "tail-job", "--tail", "1", "--follow", *h)
    monkeypatch.undo()
    assert code == 0 and out == "done\nappended later\n"
    run(capsys, "delete", "tail-job", *h)


def test_a_restarted_daemon_reuses_the_last_daemons_settings(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    del home  # only for PYTHONPATH, so the new daemon finds the test policy
    other = tmp_path / "settings"
    h = ["--home", str(other)]
    first = ["--slots", "3", "--policy", "test-fair", "--plugin", "tests.cluster._plugin"]
    first += ["--interval", "0.5", "--no-warm-start"]
    try:
        code, out, err = run(capsys, "cluster", "start", *h, *first)
        assert code == 0, err
        assert "3 cpu slots, policy test-fair, interval 0.5s" in out
        assert "reusing" not in out
        code, _, _ = run(capsys, "cluster", "stop", *h)
        assert code == 0
        # submit starts the next daemon with the same settings, and says so.
        code, out, err = run(
            capsys, "submit", *h, "--grace", "5", str(COUNTER), "--", "--steps", "2"
        )
        assert code == 0, err
        code, status, _ = run(capsys, "cluster", "status", *h)
        assert code == 0 and "test-fair (every 0.5s" in status and "/3 cpu in use" in status
        assert "reusing the settings of the last cluster in" in out
        assert "--slots 3, --interval 0.5, --policy test-fair" in out
        assert "--plugin tests.cluster._plugin, --no-warm-start" in out
        assert "3 cpu slots, policy test-fair, interval 0.5s" in out
        assert json.loads((other / "daemon-settings.json").read_text()) == {
            "slots": 3,
            "interval": 0.5,
            "policy": "test-fair",
            "grace": 5.0,
            "plugin": ["tests.cluster._plugin"],
            "plugin_dir": os.getcwd(),
            "warm_start": False,
        }
        code, _, _ = run(capsys, "cluster", "stop", *h)
        assert code == 0
        # --defaults ignores them; options given still apply.
        code, out, err = run(
            capsys, "cluster", "start", *h, "--defaults", "--slots", "1", "--no-warm-start"
        )
        assert code == 0, err
        assert "reusing" not in out and "1 cpu slots, policy adaptdl, interval 30s" in out
        # ... and the options of that start replace the saved ones, as documented.
        saved = json.loads((other / "daemon-settings.json").read_text())
        assert saved == {"slots": 1, "warm_start": False}
    finally:
        stop_cluster(other)


def test_defaults_help_says_it_replaces_the_saved_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["cluster", "start", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "start from the defaults instead of the options the last one was given" in out
    assert "the options of this start then replace the saved ones" in out
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`--defaults` starts from the defaults instead" in readme
    assert "(so `--defaults` resets them)" in readme


def test_a_busy_saved_port_says_it_was_saved(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (tmp_path / "daemon-settings.json").write_text(json.dumps({"port": port}))
        try:
            code, _, err = run(capsys, "cluster", "start", "--home", str(tmp_path))
        finally:
            stop_cluster(tmp_path)  # should one have started
    assert code == 1 and "Traceback" not in err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "leave --port out" not in err
    assert (
        f"the port was reused from the last cluster's settings in "
        f"{tmp_path / 'daemon-settings.json'}: pass --port 0 for any free port, or --defaults"
    ) in err


def test_an_empty_host_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "cluster", "start", "--home", str(tmp_path), "--host", "")
    try:
        assert code == 2
        assert err.startswith("adaptdl: error: --host '': expected an interface address or name")
    finally:
        stop_cluster(tmp_path)  # should one have started
    config = parse_config(["--home", str(tmp_path / "d"), "--host", " "])
    config.warm_start = False
    assert run_daemon(config) == 2
    assert capsys.readouterr().err.startswith("--host ' ': expected an interface address")
    assert not (tmp_path / "d" / "daemon.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--policy-option", "=1"], "policy option '=1': expected KEY=VALUE"),
        (["--preload", "a-b"], "--preload 'a-b': 'a-b' is not a module name"),
        # It was a traceback.
        (["--backend", "nope"], "unknown cluster backend 'nope'; valid backends: local"),
    ],
)
def test_a_daemon_option_error_exits_2_and_frees_the_lock(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    config = parse_config(["--home", str(tmp_path), *argv])
    config.warm_start = False
    assert run_daemon(config) == 2
    assert message in capsys.readouterr().err
    config = parse_config(["--home", str(tmp_path), "--host", " "])
    assert run_daemon(config) == 2  # not EXIT_LOCKED: the lock was released


def test_a_corrupt_job_store_is_named_with_what_to_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    garbage = bytes(range(256)) * 4
    (tmp_path / "state.db").write_bytes(garbage)
    config = parse_config(["--home", str(tmp_path)])
    config.warm_start = False
    assert run_daemon(config) == 2  # was a traceback
    err = capsys.readouterr().err
    assert f"{tmp_path / 'state.db'} is not a readable job store" in err
    assert "move it aside" in err and "Traceback" not in err
    assert (tmp_path / "state.db").read_bytes() == garbage  # left as it was
    assert not (tmp_path / "daemon.json").exists()


def test_a_daemon_error_other_than_binding_is_not_blamed_on_host(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    home = tmp_path / "d"
    (home / "supervisor.port").mkdir(parents=True)  # unreadable and unwritable as a file
    config = parse_config(["--home", str(home)])
    config.warm_start = False
    with pytest.raises(IsADirectoryError):
        run_daemon(config)
    assert "--host" not in capsys.readouterr().err
    assert not (home / "daemon.json").exists()


def test_unreadable_saved_settings_are_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "daemon-settings.json").write_text('{"slots": "two"}')
    try:
        code, _, err = run(capsys, "cluster", "start", "--home", str(tmp_path))
    finally:
        stop_cluster(tmp_path)  # should one have started
    assert code == 1
    assert f"{tmp_path / 'daemon-settings.json'}: daemon setting slots='two'" in err
    assert "pass --defaults to ignore it" in err
    assert not (tmp_path / "daemon.json").exists()


def test_bad_host_or_busy_port_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    h = ["--home", str(tmp_path / "h"), "--no-warm-start"]
    code, _, err = run(capsys, "cluster", "start", *h, "--host", "no-such-host.invalid")
    assert code == 1 and "Traceback" not in err
    assert err.startswith("adaptdl: error: --host 'no-such-host.invalid': cannot listen on it")
    # Labels longer than DNS allows: the IDNA codec refuses them (and binding
    # with the second one would raise TypeError, not OSError).
    # They are usage errors (exit 2, like --host ''), found before any lookup.
    for label in ("a" * 64, "\u00e9" * 70, "bad..host"):
        code, _, err = run(capsys, "cluster", "start", *h, "--host", label)
        assert code == 2 and "Traceback" not in err
        assert err.startswith(f"adaptdl: error: --host '{label}': not a valid host name")
        config = parse_config(["--home", str(tmp_path / "d"), "--host", label])
        config.warm_start = False
        assert run_daemon(config) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"--host '{label}': not a valid host name")
        assert "Traceback" not in err and not (tmp_path / "d" / "daemon.json").exists()
    assert "Traceback" not in err and not (tmp_path / "d" / "daemon.json").exists()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run(capsys, "cluster", "start", *h, "--port", str(port))
        assert code == 1 and "Traceback" not in err
        assert err.startswith(
            f"adaptdl: error: --port {port}: cannot listen on 127.0.0.1:{port}: "
            "Address already in use"
        )
        # The daemon itself says the same in one line, should it meet a busy port.
        config = parse_config(["--home", str(tmp_path / "d"), "--port", str(port)])
        config.warm_start = False
        assert run_daemon(config) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"--port {port}: cannot listen on 127.0.0.1:{port}")
        assert "Traceback" not in err and not (tmp_path / "d" / "daemon.json").exists()
    with pytest.raises(DaemonNotRunningError):
        ClusterClient(tmp_path / "h")


def test_ls_age_is_since_submission_and_duration_is_the_run_time() -> None:
    job = {
        "name": "j",
        "phase": "Succeeded",
        "replicas": 0,
        "allocation": [],
        "restarts": 1,
        "batchSize": None,
        "goodput": None,
        "submitted": 0.0,
        "started": 10.0,
        "completed": 100.0,
    }
    running = {**job, "name": "r", "phase": "Running", "completed": None}
    pending = {**job, "name": "p", "phase": "Pending", "started": None, "completed": None}
    header, *rows = job_rows([job, running, pending], now=1000.0)
    assert header[-2:] == ["DURATION", "AGE"]
    assert [row[-2:] for row in rows] == [["90s", "16m40s"], ["16m30s", "16m40s"], ["-", "16m40s"]]


def test_ls_help_explains_duration_and_age(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["ls", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "DURATION is the time from a job's first start to its completion" in out
    assert "time spent pending or preempted since included" in out
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "DURATION (run time)" not in readme
    assert "pending and preempted time included" in readme
    assert "AGE is the time since it was submitted, for finished jobs too" in out


def _wait_finished(home: Path, name: str) -> None:
    """Wait up to 30 s for job ``name`` to succeed or fail."""
    wait_for(
        lambda: ClusterClient(home).describe(name)["phase"] in ("Succeeded", "Failed"),
        30,
        f"{name} to finish",
    )


def _job_file(path: Path, command: str, extra: str = "") -> Path:
    path.write_text(
        "apiVersion: adaptdl.petuum.com/v1\nkind: AdaptDLJob\nmetadata: {name: proj}\n"
        f"spec:\n{extra}  template:\n    spec:\n"
        f"      containers: [{{name: main, command: {command}}}]\n"
    )
    return path


def test_job_file_problems_name_the_file(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    h = ["--home", str(home)]
    code, _, err = run(capsys, "submit", *h, "-f", str(tmp_path), str(tmp_path))
    assert code == 1  # load_job_file's check, mapped by the CLI
    assert err.startswith(f"adaptdl: error: {tmp_path}: is a directory, not a job file")
    missing = tmp_path / "nope.yaml"
    code, _, err = run(capsys, "submit", *h, "-f", str(missing), str(tmp_path))
    assert code == 1 and err.startswith(f"adaptdl: error: {missing}: cannot read job file")
    job = _job_file(
        tmp_path / "job.yaml", "[python3, x.py]", "  minReplicas: 3\n  maxReplicas: 2\n"
    )
    code, _, err = run(capsys, "submit", *h, "-f", str(job), str(tmp_path))
    assert code == 1
    assert err.startswith(f"adaptdl: error: {job}: spec.minReplicas=3 is greater than")
    secret = "{name: SECRET, valueFrom: {secretKeyRef: {name: s, key: k}}}"
    _job_file(job, f"[echo], env: [{secret}]")
    code, _, err = run(capsys, "submit", *h, "-f", str(job), str(tmp_path))
    assert code == 1 and err.startswith(f"adaptdl: error: {job}: ")
    assert "(SECRET): valueFrom is not supported by the local backend" in err
    _job_file(job, "[python3, x.py]")
    code, _, err = run(capsys, "submit", *h, "-f", str(job), str(tmp_path))
    assert code == 1 and err.startswith(f"adaptdl: error: {job}: script 'x.py' not found in")
    code, _, err = run(capsys, "submit", *h, "--name", "Bad_Name", "-f", str(job), str(tmp_path))
    assert code == 2 and err.startswith("adaptdl: error: --name 'Bad_Name': job name")
    _no_jobs(capsys, home)


def test_a_command_in_the_job_directory_needs_a_slash(
    capsys: pytest.CaptureFixture[str], home: Path, tmp_path: Path
) -> None:
    h = ["--home", str(home)]
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho trained\n")
    job = _job_file(tmp_path / "adaptdljob.yaml", "[train.sh]")
    code, _, err = run(capsys, "submit", *h, str(tmp_path))
    assert code == 1 and err.startswith("adaptdl: error: command 'train.sh' of job 'proj'")
    assert "is not on the PATH of the cluster's replicas" in err
    assert "write './train.sh' to run the file there" in err
    _job_file(job, "[./train.sh]")
    code, _, err = run(capsys, "submit", *h, str(tmp_path))
    assert code == 1 and "is not executable: run 'chmod +x" in err
    _job_file(job, "[no-such-program-here]")
    code, _, err = run(capsys, "submit", *h, str(tmp_path))
    assert code == 1
    assert "command 'no-such-program-here' of job 'proj' was not found on the PATH" in err
    _no_jobs(capsys, home)
    # With the slash it runs, from the job's directory.
    script.chmod(0o755)
    _job_file(job, "[./train.sh]")
    code, out, err = run(capsys, "submit", *h, str(tmp_path))
    assert code == 0, err
    _wait_finished(home, "proj")
    assert ClusterClient(home).describe("proj")["phase"] == "Succeeded"
    code, out, _ = run(capsys, "logs", "proj", *h)
    assert "trained" in out
    run(capsys, "delete", "proj", *h)
    wait_for(lambda: not ClusterClient(home).jobs(), 30, "proj to go")


def test_the_path_check_uses_the_daemons_path_not_the_submitters(
    capsys: pytest.CaptureFixture[str],
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = ["--home", str(home)]
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "mytool").write_text("#!/bin/sh\necho from-tools\n")
    (tools / "mytool").chmod(0o755)
    job = _job_file(tmp_path / "adaptdljob.yaml", "[mytool]")
    # On the submitter's PATH only: the running daemon's replicas would not find it.
    monkeypatch.setenv("PATH", os.pathsep.join([str(tools), os.environ["PATH"]]))
    code, _, err = run(capsys, "submit", *h, str(tmp_path))
    assert code == 1
    assert "command 'mytool' of job 'proj' was not found on the PATH of the cluster's" in err
    _no_jobs(capsys, home)
    # On the replicas' PATH (the job's env) but not the submitter's: accepted, and runs.
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    _job_file(job, f"[mytool], env: [{{name: PATH, value: '{tools}:/usr/bin:/bin'}}]")
    code, _, err = run(capsys, "submit", *h, str(tmp_path))
    assert code == 0, err
    _wait_finished(home, "proj")
    code, out, _ = run(capsys, "logs", "proj", *h)
    assert "from-tools" in out
    run(capsys, "delete", "proj", *h)
    wait_for(lambda: not ClusterClient(home).jobs(), 30, "proj to go")


def test_a_missing_command_starts_no_daemon(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _job_file(tmp_path / "adaptdljob.yaml", "[no-such-program-here]")
    other = tmp_path / "home"
    try:
        code, _, err = run(capsys, "submit", "--home", str(other), str(tmp_path))
    finally:
        stop_cluster(other)  # should one have started
    assert code == 1
    assert "command 'no-such-program-here' of job 'proj' was not found on the PATH" in err
    assert not (other / "daemon.json").exists()


@pytest.mark.parametrize(
    ("argv", "job_args", "name"),
    [
        (["--name", "a1", "s.py", "--", "--lr", "0.1", "--max-restarts", "0"], None, "a1"),
        (["s.py", "--", "-n", "5"], ["-n", "5"], None),
        (["--name", "x", "s.py", "--", "--", "c"], ["--", "c"], "x"),
        (["s.py", "--name", "y", "--", "--port", "8080"], ["--port", "8080"], "y"),
        (["--", "s.py", "--", "-f", "z"], ["-f", "z"], None),
    ],
)
def test_everything_after_the_first_dash_dash_after_the_script_goes_to_the_job(
    argv: list[str], job_args: list[str] | None, name: str | None
) -> None:
    from adaptdl.cli import build_parser
    from adaptdl.cli._cluster_cmds import _split_submit_args

    args = build_parser().parse_args(["submit", *argv])
    expected = argv[argv.index("--", argv.index("s.py")) + 1 :] if job_args is None else job_args
    assert _split_submit_args(args) == expected
    assert args.target == "s.py" and args.name == name
    assert args.max_restarts is None and args.port is None and args.jobfile is None


def test_submit_help_says_where_the_jobs_arguments_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "usage: adaptdl submit [options] SCRIPT_OR_DIR [options] [-- ARGS ...]" in out
    assert "Everything after the first '--' that follows it goes to the job unchanged" in out


def test_job_options_after_dash_dash_reach_the_job_not_submit(
    capsys: pytest.CaptureFixture[str], home: Path
) -> None:
    h = ["--home", str(home)]
    argv = ["submit", *h, "--name", "verbatim", str(COUNTER), "--", "--steps", "1"]
    code, out, err = run(capsys, *argv, "--max-restarts", "0", "--", "x")
    assert code == 0, err
    spec = ClusterClient(home).describe("verbatim")["spec"]
    assert spec["args"] == ["--steps", "1", "--max-restarts", "0", "--", "x"]
    assert spec["maxRestarts"] == 3  # the default: "--max-restarts 0" was the job's
    run(capsys, "delete", *h, "verbatim")
    wait_for(lambda: not ClusterClient(home).jobs(), 30, "the job to go")


def test_cluster_start_finds_a_plugin_beside_the_caller(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "cwd_policy.py").write_text(
        "from adaptdl.sched import AdaptDLPolicy, register_policy\n"
        "register_policy('cwd-adaptdl', AdaptDLPolicy)\n"
    )
    path = list(sys.path)

    def forget(imported: bool = True) -> None:  # as in a fresh CLI process
        monkeypatch.setattr(sys, "path", list(path))
        monkeypatch.delitem(sys.modules, "cwd_policy", raising=imported)

    forget(imported=False)
    monkeypatch.chdir(work)
    home = tmp_path / "h"
    h = ["--home", str(home)]
    try:
        argv = ["--policy", "cwd-adaptdl", "--plugin", "cwd_policy", "--no-warm-start"]
        code, out, err = run(capsys, "cluster", "start", *h, *argv)
        assert code == 0, err
        assert "policy cwd-adaptdl" in out
        assert run(capsys, "cluster", "stop", *h)[0] == 0
        # Started from elsewhere, the saved plugin is looked for where it was found.
        monkeypatch.chdir(tmp_path)
        forget()
        code, out, err = run(capsys, "cluster", "start", *h)
        assert code == 0, err
        assert "--plugin cwd_policy" in out and "policy cwd-adaptdl" in out
        saved = json.loads((home / "daemon-settings.json").read_text())
        assert saved["plugin"] == ["cwd_policy"] and saved["plugin_dir"] == str(work)
        assert run(capsys, "cluster", "stop", *h)[0] == 0
        # Gone from there, it is reported with where it was looked for.
        (work / "cwd_policy.py").unlink()
        forget()
        code, _, err = run(capsys, "cluster", "start", *h)
        assert code == 1
        assert "--plugin 'cwd_policy' cannot be imported: ModuleNotFoundError" in err
        assert f"(looked in the installed packages, then in {work})" in err
        # A module the plugin imports is missing: where the plugin was found is beside the point.
        (work / "cwd_policy.py").write_text("import no_such_dependency_of_a_plugin\n")
        monkeypatch.chdir(work)
        code, _, err = run(capsys, "cluster", "start", *h, "--plugin", "cwd_policy")
        assert code == 1 and "No module named 'no_such_dependency_of_a_plugin'" in err
        assert "looked in" not in err
    finally:
        stop_cluster(home)


def test_a_plugin_that_fails_is_one_line_and_starts_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('registry offline')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_plugin", raising=False)
    home = tmp_path / "h"
    code, _, err = run(capsys, "cluster", "start", "--home", str(home), "--plugin", "broken_plugin")
    assert code == 1 and "Traceback" not in err
    assert "--plugin 'broken_plugin' cannot be imported: RuntimeError: registry offline" in err
    assert not (home / "daemon.json").exists()
    # A daemon started by hand reports it the same way and frees its lock.
    config = parse_config(["--home", str(home), "--plugin", "broken_plugin"])
    config.warm_start = False
    assert run_daemon(config) == 2
    err = capsys.readouterr().err
    assert err.startswith("--plugin 'broken_plugin' cannot be imported: RuntimeError: registry")
    assert not (home / "daemon.json").exists()
    config = parse_config(["--home", str(home), "--host", " "])
    assert run_daemon(config) == 2  # not EXIT_LOCKED: the lock was released


def test_bad_policy_options_and_max_replicas_name_the_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    h = ["--home", str(tmp_path / "h")]
    code, _, err = run(capsys, "cluster", "start", *h, "--policy-option", "restart_delay=abc")
    assert code == 2 and "Traceback" not in err
    assert err.startswith(
        "adaptdl: error: --policy-option restart_delay=abc: expected a number or another JSON "
        "value, not the text 'abc'"
    )
    code, _, err = run(capsys, "cluster", "start", *h, "--policy-option", "restart_dela=5")
    assert code == 2 and "--policy-option restart_dela=5: policy 'adaptdl' has no option" in err
    for option in ("exact_max_jobs=Infinity", "node_limit=1e999"):
        code, _, err = run(capsys, "cluster", "start", *h, "--policy-option", option)
        assert code == 2 and "Traceback" not in err
        key = option.split("=")[0]
        assert f"--policy-option {key}=" in err and f"{key}=inf: expected an int" in err, err
    code, _, err = run(capsys, "cluster", "start", *h, "--slots", "3000000000")
    assert code == 2 and "--slots=3000000000: expected an integer from 1 to 2**31 - 1" in err
    code, _, err = run(capsys, "submit", *h, "--max-replicas", "0", str(COUNTER))
    assert code == 2 and err.startswith("adaptdl: error: --max-replicas=0: must be >= 1")
    # Named as typed, not as the job spec's fields (spec.minReplicas=3 ...).
    argv = ["submit", *h, "--min-replicas", "3", "--max-replicas", "2", str(COUNTER)]
    code, _, err = run(capsys, *argv)
    assert code == 2 and "--min-replicas=3 is greater than --max-replicas=2" in err, err
    # Simulator baselines would fail every round on a cluster: refused up front.
    for baseline in ("tiresias", "optimus"):
        code, _, err = run(capsys, "cluster", "start", *h, "--policy", baseline)
        assert code == 2 and f"--policy {baseline}: a simulator baseline" in err
        usable = err.split("use one of: ")[1].strip().split(", ")
        assert {"adaptdl", "pollux"} <= set(usable) and "tiresias" not in usable
    assert not (tmp_path / "h" / "daemon.json").exists()


def test_a_preload_that_cannot_be_found_is_refused_before_any_daemon_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    h = ["--home", str(tmp_path / "h")]
    for module in ("no_such_module_xyz", "no_such_module_xyz.sub"):
        for command in (["cluster", "start"], ["submit", str(COUNTER)]):
            code, _, err = run(capsys, *command[:2], *h, "--preload", module, *command[2:])
            assert code == 1 and "Traceback" not in err
            expected = f"--preload {module}: no module named 'no_such_module_xyz' is importable"
            assert expected in err, err
    assert not (tmp_path / "h" / "daemon.json").exists()


def test_preload_without_warm_start_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from adaptdl.cli import build_parser
    from adaptdl.cli._cluster_cmds import _check_daemon_options

    # It was saved and silently did nothing: there is no warm-start process.
    argv = ["cluster", "start", "--home", str(tmp_path), "--no-warm-start", "--preload", "json"]
    _check_daemon_options(build_parser().parse_args(argv))
    assert "--preload json has no effect with --no-warm-start" in capsys.readouterr().err
    _check_daemon_options(build_parser().parse_args(argv[:-3] + ["--preload", "json"]))
    assert capsys.readouterr().err == ""


def test_the_preload_check_imports_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptdl.cli._cluster_cmds import _check_importable

    # A package whose import would fail, or be slow, where the CLI runs.
    package = tmp_path / "heavy_pkg_xyz"
    package.mkdir()
    (package / "__init__.py").write_text("raise OSError('libfoo.so: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _check_importable("--preload", "heavy_pkg_xyz.sub")
    _check_importable("--preload", "sys")  # built in, not on a path
    assert "heavy_pkg_xyz" not in sys.modules


def test_a_home_that_is_a_file_is_named_as_such(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for argv in (["cluster", "start"], ["cluster", "status"], ["ls"], ["describe", "x"]):
        code, _, err = run(capsys, *argv, "--home", str(afile))
        assert code == 1
        assert f"--home {afile}: {afile} is a file, not a directory" in err, err
    monkeypatch.setenv("ADAPTDL_HOME", str(afile))
    code, _, err = run(capsys, "ls")
    assert code == 1 and f"ADAPTDL_HOME={afile}: {afile} is a file" in err, err
    # Not set: the default home is to blame, not a variable the user never set.
    monkeypatch.delenv("ADAPTDL_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".adaptdl").write_text("")
    code, _, err = run(capsys, "ls")
    assert code == 1 and err.startswith("adaptdl: error: the default home (set ADAPTDL_HOME"), err
    assert f"{tmp_path / '.adaptdl'} is a file" in err
    assert afile.read_text() == "keep me"


def test_repeatable_options_on_both_sides_of_the_script_add_up() -> None:
    from adaptdl.cli import build_parser
    from adaptdl.cli._cluster_cmds import _split_submit_args

    argv = ["submit", "--preload", "json", "--plugin", "p1", str(COUNTER)]
    args = build_parser().parse_args([*argv, "--preload", "csv", "--plugin", "p2", "--", "x"])
    assert _split_submit_args(args) == ["x"]
    assert (args.preload, args.plugin) == (["json", "csv"], ["p1", "p2"])


@pytest.mark.parametrize("option", ["--max-replicas=abc", "--name"])
def test_a_bad_option_after_the_script_is_one_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str
) -> None:
    code, out, err = run(capsys, "submit", "--home", str(tmp_path), str(COUNTER), option)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("adaptdl: error: submit: argument ")
    assert not (tmp_path / "daemon.json").exists()


def test_job_options_like_submit_options_and_python_files_still_pass(tmp_path: Path) -> None:
    # A too-eager near-miss check refused these (--hosts as --host ...).
    from adaptdl.cli import build_parser
    from adaptdl.cli._cluster_cmds import _build_spec, _split_submit_args

    job_args = ["--hosts", "a,b", "--default", "--sport", "x", "--names", "n", "--plugins", "p"]
    for suffix in (".py", ".pyz", ".pyc", ".pyw", ""):
        script = tmp_path / f"app{suffix}"
        script.write_text("print(1)\n")
        args = build_parser().parse_args(["submit", str(script), *job_args])
        spec = _build_spec(args, _split_submit_args(args))
        assert spec.command == ("python", str(script)) and list(spec.args) == job_args


def test_a_symlinked_script_runs_where_it_was_submitted(tmp_path: Path) -> None:
    from adaptdl.cli import build_parser
    from adaptdl.cli._cluster_cmds import _build_spec, _split_submit_args

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "train.py").write_text("print('hi')\n")
    project = tmp_path / "proj"
    project.mkdir()
    (project / "main.py").symlink_to(tmp_path / "shared" / "train.py")
    for target in (project / "main.py", project):
        args = build_parser().parse_args(["submit", str(target)])
        spec = _build_spec(args, _split_submit_args(args))
        assert spec.working_dir == str(project)
        assert spec.command == ("python", str(project / "main.py"))


def test_dot_dot_after_a_symlinked_directory_names_the_real_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adaptdl.cli import build_parser
    from adaptdl.cli._cluster_cmds import _build_spec, _split_submit_args

    (tmp_path / "other" / "sub").mkdir(parents=True)
    (tmp_path / "other" / "train.py").write_text("print('hi')\n")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "lnk").symlink_to(tmp_path / "other" / "sub")
    monkeypatch.chdir(tmp_path / "proj")
    args = build_parser().parse_args(["submit", "lnk/../train.py"])
    spec = _build_spec(args, _split_submit_args(args))
    assert spec.command == ("python", str(tmp_path / "other" / "train.py"))


@pytest.mark.parametrize(
    ("text", "count", "expected"),
    [
        (b"a\nb\nc\nd\n", 3, b"b\nc\nd\n"),
        (b"a\nb\nc\nd", 1, b"d"),
        (b"a\nb\n", 5, b"a\nb\n"),
        (b"a\nb\n", 0, b""),
        (b"", 2, b""),
        (b"\n\n\n", 2, b"\n\n"),
        (b"x" * 5000 + b"\n" + b"y" * 3000 + b"\n", 1, b"y" * 3000 + b"\n"),
    ],
)
def test_log_tail_reads_backwards_in_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: bytes, count: int, expected: bytes
) -> None:
    # `logs --tail 3` of a 400 MB log held the whole file in memory (1 GB).
    import codecs
    import io

    from adaptdl.cli import _cluster_cmds

    monkeypatch.setattr(_cluster_cmds, "_LOG_BLOCK", 1024)  # lines span blocks
    path = tmp_path / "replica-0.log"
    path.write_bytes(text)
    out = io.StringIO()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(path, "rb") as handle:
        start = _cluster_cmds._tail_offset(handle, len(text), count)
        assert _cluster_cmds._copy_log(handle, start, len(text), out, decoder) == len(text)
    assert out.getvalue() == expected.decode()


def _fake_client(monkeypatch: pytest.MonkeyPatch, log_dir: Path, answers: list[Any]) -> list[str]:
    """Make the CLI's ClusterClient answer ``describe`` from ``answers`` in turn.

    An exception in ``answers`` is raised (after a line is added to the log);
    the last answer repeats.
    """
    from adaptdl.cli import _cluster_cmds

    log = log_dir / "replica-0.log"
    said: list[str] = []

    class Fake:
        def __init__(self, home: Any) -> None:
            said.append("connect")

        def describe(self, name: str) -> dict[str, Any]:
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            if isinstance(answer, Exception):
                with open(log, "a") as handle:
                    handle.write("while the daemon was down\n")
                raise answer
            if isinstance(answer, tuple):  # (phase, submitted)
                return {"phase": answer[0], "submitted": answer[1], "paths": {"logs": str(log_dir)}}
            return {"phase": answer, "paths": {"logs": str(log_dir)}}

    monkeypatch.setattr(_cluster_cmds, "ClusterClient", Fake)
    return said


def test_logs_follow_outlasts_a_daemon_restart(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # It stopped with "the daemon stopped answering" though the job ran on.
    from adaptdl.cli import _cluster_cmds

    (tmp_path / "replica-0.log").write_text("before\n")
    gone = DaemonNotRunningError("the adaptdl cluster daemon stopped answering")
    said = _fake_client(monkeypatch, tmp_path, ["Running", gone, "Running", "Succeeded"])
    monkeypatch.setattr(_cluster_cmds.time, "sleep", lambda seconds: None)
    code, out, err = run(capsys, "logs", "j", "-f", "--home", str(tmp_path))
    assert code == 0, err
    assert out == "before\nwhile the daemon was down\n"
    assert "stopped answering; still following the log" in err
    assert "the cluster daemon is back" in err
    assert said == ["connect", "connect"]  # a new client for the restarted daemon


def test_logs_follow_gives_up_on_a_daemon_gone_for_good(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from adaptdl.cli import _cluster_cmds

    (tmp_path / "replica-0.log").write_text("before\n")
    gone = DaemonNotRunningError("the adaptdl cluster daemon stopped answering")
    _fake_client(monkeypatch, tmp_path, ["Running", gone])
    monkeypatch.setattr(_cluster_cmds, "FOLLOW_WITHOUT_DAEMON", 0.01)
    code, _, err = run(capsys, "logs", "j", "-f", "--home", str(tmp_path))
    assert code == 1
    assert "adaptdl: error: the adaptdl cluster daemon stopped answering (for 0.01 s)" in err


def test_logs_follow_says_when_the_job_was_deleted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # It ended silently, as if the job had finished.
    from adaptdl.cli import _cluster_cmds

    (tmp_path / "replica-0.log").write_text("before\n")
    _fake_client(monkeypatch, tmp_path, ["Running", ClusterAPIError(404, "no job 'j'")])
    monkeypatch.setattr(_cluster_cmds.time, "sleep", lambda seconds: None)
    code, out, err = run(capsys, "logs", "j", "-f", "--home", str(tmp_path))
    assert code == 0, err
    assert out == "before\n"  # its files go with it: nothing more to read
    assert "adaptdl: job 'j' was deleted" in err


def test_logs_follow_stops_at_a_new_job_of_the_same_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A job deleted and resubmitted between two polls was followed on: the
    # new job's log printed from the old one's offset, as if it continued.
    from adaptdl.cli import _cluster_cmds

    log = tmp_path / "replica-0.log"
    log.write_text("old job\n")
    answers: list[Any] = [("Running", 100.0), ("Running", 100.0), ("Running", 200.0)]
    _fake_client(monkeypatch, tmp_path, answers)

    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        assert len(naps) < 10, "still following the new job"
        if len(answers) == 1:  # the new job has replaced the old one's log
            log.write_text("new job's own log, longer than the old\n")

    monkeypatch.setattr(_cluster_cmds.time, "sleep", sleep)
    code, out, err = run(capsys, "logs", "j", "-f", "--home", str(tmp_path))
    assert code == 0, err
    assert out == "old job\n"
    assert "adaptdl: job 'j' was deleted (a new job of that name runs now)" in err


def test_logs_follow_reports_other_daemon_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Any refusal was taken for a deletion and ended with status 0.
    from adaptdl.cli import _cluster_cmds

    (tmp_path / "replica-0.log").write_text("before\n")
    refusal = ClusterAPIError(500, "internal error: database is locked")
    _fake_client(monkeypatch, tmp_path, ["Running", refusal])
    monkeypatch.setattr(_cluster_cmds.time, "sleep", lambda seconds: None)
    code, _, err = run(capsys, "logs", "j", "-f", "--home", str(tmp_path))
    assert code == 1
    assert "adaptdl: error: internal error: database is locked" in err
    assert "deleted" not in err


def test_the_policy_check_survives_a_plugin_that_needs_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Listing the cluster policies built every factory with no options, so a
    # plugin needing one broke `cluster start` for every --policy.
    from adaptdl.cli._cluster_cmds import _check_policy
    from adaptdl.sched import _types

    def needs_weight(weight: float, **options: Any) -> Any:
        raise NotImplementedError(weight)

    monkeypatch.setitem(_types._REGISTRY, "needy", needs_weight)
    _check_policy("adaptdl", [])
    with pytest.raises(CLIError, match="on a cluster use one of: ") as info:
        _check_policy("nope", [])
    # Other tests' plugins may be registered too: only these are certain.
    offered = str(info.value).split("on a cluster use one of: ")[1].split(", ")
    assert {"adaptdl", "pollux"} <= set(offered)
    assert "needy" not in offered and "tiresias" not in offered


def test_cluster_start_checks_backend_names(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A plugin's backend could only be used through the private daemon module.
    code, _, err = run(capsys, "cluster", "start", "--home", str(tmp_path), "--backend", "nope")
    assert code == 2
    assert "--backend: unknown backend 'nope'; valid backends: local (a --plugin" in err
    assert not (tmp_path / "daemon.json").exists()
    with pytest.raises(SystemExit):
        main(["cluster", "start", "--help"])
    assert "--backend BACKEND" in capsys.readouterr().out


def test_the_backend_registry_checks_like_the_policy_registry() -> None:
    from adaptdl.cluster import BUILTIN_BACKENDS, backend_names, get_backend, register_backend
    from adaptdl.cluster._backend import _REGISTRY

    assert BUILTIN_BACKENDS == {"local"} <= set(backend_names())
    with pytest.raises(TypeError, match="register_backend\\('b1', 5\\): the factory must be"):
        register_backend("b1", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend name 5: expected a non-empty identifier"):
        register_backend(5, dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend 'local' is built in"):
        register_backend("local", dict)  # type: ignore[arg-type]
    register_backend("not-a-backend", dict)  # type: ignore[arg-type]
    try:
        with pytest.raises(TypeError, match="its registered factory returned {}, not a Backend"):
            get_backend("not-a-backend")
    finally:
        del _REGISTRY["not-a-backend"]
    with pytest.raises(ValueError, match="unknown cluster backend 'x'; valid backends: local"):
        get_backend("x")


def test_cluster_status_shows_the_policys_latest_failure(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A failing policy was visible only in daemon.log.
    import time

    from adaptdl.cli import _cluster_cmds

    info = {
        "pid": 1,
        "home": "/h",
        "backend": "local",
        "usedSlots": 0,
        "slots": 2,
        "slotResource": "cpu",
        "policy": "mine",
        "interval": 60.0,
        "rounds": 0,
        "started": time.time() - 100,
        "policyError": {"time": time.time() - 5, "message": "policy 'mine' raised KeyError"},
    }

    class Fake:
        url = "http://127.0.0.1:1"

        def cluster(self) -> dict[str, Any]:
            return info

        def jobs(self) -> list[dict[str, Any]]:
            return []

    monkeypatch.setattr(_cluster_cmds, "_client", lambda args: Fake())
    code, out, _ = run(capsys, "cluster", "status")
    assert code == 0
    assert "error:     5s ago: policy 'mine' raised KeyError; allocations unchanged" in out
    info["policyError"] = None
    code, out, _ = run(capsys, "cluster", "status")
    assert code == 0 and "error:" not in out


def test_help_after_the_script_shows_the_submit_help(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # It was passed to the script, which was submitted (starting a daemon).
    with pytest.raises(SystemExit) as info:
        main(["submit", "--home", str(tmp_path), str(COUNTER), "--help"])
    assert info.value.code == 0
    assert "usage: adaptdl submit" in capsys.readouterr().out
    assert not (tmp_path / "daemon.json").exists()


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("--tensorbord", "--tensorboard"),
        ("--max-repilcas", "--max-replicas"),
        ("--max-rep", "--max-replicas"),
        ("--min-Replica", "--min-replicas"),
    ],
)
def test_near_misses_of_submit_options_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, typo: str, meant: str
) -> None:
    code, _, err = run(capsys, "submit", "--home", str(tmp_path), str(COUNTER), typo, "2")
    assert code == 2
    assert f"{typo!r} is not a submit option; did you mean {meant}?" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    h = ["--home", str(tmp_path)]
    for argv in (
        ["submit", *h],
        ["submit", *h, str(COUNTER), "--max-replicas", "0"],
        ["submit", *h, str(COUNTER), "--min-replicas", "5", "--max-replicas", "3"],
        ["submit", *h, str(COUNTER), "-x", "--", "a"],
        ["cluster", "start", *h, "--slots", "0"],
        ["cluster", "start", *h, "--interval", "-5"],
        ["cluster", "start", *h, "--port", "99999"],
        ["cluster", "start", *h, "--policy", "nope"],
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2, (argv, err)
    assert not (tmp_path / "daemon.json").exists()
    code, out, err = run(capsys)
    assert code == 2 and out == "" and "usage: adaptdl" in err


def test_stopping_a_stopped_cluster_succeeds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, "cluster", "stop", "--home", str(tmp_path))
    assert code == 0
    assert f"adaptdl cluster is not running (home {tmp_path}); nothing to stop" in out


def test_logs_of_a_rank_that_never_ran_say_so_for_a_finished_job(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # "(yet)" suggested waiting for a job that had ended.
    _fake_client(monkeypatch, tmp_path, ["Succeeded"])
    code, _, err = run(capsys, "logs", "j", "--rank", "1", "--home", str(tmp_path))
    assert code == 1
    assert "job 'j' (Succeeded) has no log for rank 1: no replica of that rank ever ran" in err
    _fake_client(monkeypatch, tmp_path, ["Running"])
    code, _, err = run(capsys, "logs", "j", "--rank", "1", "--home", str(tmp_path))
    assert code == 1 and "has no log for rank 1 (yet)" in err


def test_cluster_start_waits_for_a_stopping_daemon_then_starts_anew(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # It said "already running" and exited 0; a moment later no daemon ran.
    from adaptdl.cli import _cluster_cmds

    answers: list[Any] = [{"draining": True}, {"draining": True}, DaemonNotRunningError("gone")]

    class Stopping:
        pid = 42

        def __init__(self, home: Any) -> None:
            self.home = home
            if not answers:
                raise DaemonNotRunningError("no daemon")

        def cluster(self) -> dict[str, Any]:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return dict(answer)

    class Started:
        started_here = True

    monkeypatch.setattr(_cluster_cmds, "ClusterClient", Stopping)
    monkeypatch.setattr(_cluster_cmds, "_start", lambda args: Started())
    monkeypatch.setattr(_cluster_cmds, "_started", lambda client, home: "anew")
    monkeypatch.setattr(_cluster_cmds.time, "sleep", lambda seconds: None)
    code, out, err = run(capsys, "cluster", "start", "--home", str(tmp_path))
    assert code == 0, err
    assert "the cluster daemon (pid 42) is stopping; waiting for it to exit" in err
    assert out.strip() == "adaptdl cluster started: anew"


def test_a_jobs_own_backend_and_short_h_options_reach_the_job() -> None:
    # cluster start --backend must not take a training script's --backend
    # nccl, nor -h (often a height or hidden size) show the submit help.
    from adaptdl.cli import build_parser
    from adaptdl.cli._cluster_cmds import _split_submit_args

    argv = ["submit", str(COUNTER), "--backend", "nccl", "-h", "64", "--max-replicas", "2"]
    argv += ["--internal", "--reload"]  # one letter from --interval, --preload
    args = build_parser().parse_args(argv)
    assert _split_submit_args(args) == ["--backend", "nccl", "-h", "64", "--internal", "--reload"]
    assert args.max_replicas == 2


def test_stopping_a_daemon_that_does_not_answer_is_an_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # "not running; nothing to stop" with exit 0, while it held its jobs.
    from adaptdl.cli import _cluster_cmds
    from adaptdl.cluster import DaemonNotAnsweringError

    def hung(home: Any) -> Any:
        raise DaemonNotAnsweringError("the daemon (pid 7) runs but does not answer")

    monkeypatch.setattr(_cluster_cmds, "ClusterClient", hung)
    code, out, err = run(capsys, "cluster", "stop", "--home", str(tmp_path))
    assert code == 1 and out == ""
    assert "runs but does not answer" in err


def test_a_second_stop_reports_the_mode_of_the_first_and_waits_out_the_grace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adaptdl.cli import _cluster_cmds
    from adaptdl.cluster import JobSpec

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    home = tmp_path / "home"
    client = start_test_daemon(home, grace=3.0)
    try:
        stubborn = (
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\ntime.sleep(300)\n"
        )
        (tmp_path / "stubborn.py").write_text(stubborn)
        spec = JobSpec(
            name="stubborn", command=("python", "stubborn.py"), working_dir=str(tmp_path)
        )
        client.submit(spec)
        logs = Path(client.describe("stubborn")["paths"]["logs"]) / "replica-0.log"
        wait_for(lambda: logs.exists() and "ready" in logs.read_text(), 60, "the job to run")
        # "cluster stop" then "cluster stop --leave-jobs": the jobs are stopped,
        # and the second one says so instead of "jobs keep running".
        assert client.request_shutdown(stop_jobs=True) is True
        # Its wait covers the daemon's --grace, not a fixed minute.
        monkeypatch.setattr(_cluster_cmds, "_STOP_WAIT", 0.5)
        code, out, err = run(capsys, "cluster", "stop", "--leave-jobs", "--home", str(home))
        assert code == 0, err
        assert "a stop was already under way and stops the jobs" in err
        assert "keep running" not in out and "resume from their last checkpoint" in out
    finally:
        stop_cluster(home)


def test_help_into_a_closed_pipe_exits_141() -> None:
    import subprocess

    # argparse ignores a failed write, and the exit status was 0 (or 120).
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaptdl.cli", "submit", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the interpreter has even started
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err


def test_usage_help_into_a_closed_stderr_is_still_a_usage_error() -> None:
    import subprocess

    read, write = os.pipe()
    os.close(read)
    try:
        for argv in ([], ["cluster"]):
            proc = subprocess.run(
                [sys.executable, "-m", "adaptdl.cli", *argv],
                stdout=write,
                stderr=write,
                timeout=120,
            )
            assert proc.returncode == 2, argv  # not 1 from an uncaught BrokenPipeError
    finally:
        os.close(write)


def test_a_commands_extra_arguments_show_that_commands_usage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The top-level usage ("adaptdl [-h] [-v] COMMAND ...") was shown.
    for argv, usage in (
        (["delete", "one", "two"], "usage: adaptdl delete "),
        (["tensorboard", "create", "a", "b"], "usage: adaptdl tensorboard create "),
    ):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--home", str(tmp_path)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith(usage), err
        assert "unrecognized arguments: " in err
