"""Tests of the multi-process harness :mod:`adaptdl.testing`."""

from __future__ import annotations

import json
import multiprocessing.process
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from adaptdl import env
from adaptdl.testing import (
    CHECKPOINT_EXIT_CODE,
    ElasticResult,
    ReplicaError,
    elastic_multiprocessing,
    run_elastic,
)


def _report() -> dict[str, object]:
    return {
        "rank": env.replica_rank(),
        "replicas": env.num_replicas(),
        "restarts": env.num_restarts(),
        "nodes": env.num_nodes(),
        "addr": env.master_addr(),
        "port": env.master_port(),
        "token": env.job_token(),
        "job": env.job_id(),
        "ckpt": env.checkpoint_path(),
        "share": env.share_path(),
        "pid": os.getpid(),
    }


@pytest.mark.parametrize("n", [1, 2, 4])
def test_environment_per_replica(n: int) -> None:
    result = run_elastic(_report, n)
    assert isinstance(result, ElasticResult)
    assert len(result.generations) == 1
    gen = result.generations[0]
    assert gen.num_replicas == n
    assert gen.exit_codes == [0] * n
    assert [r["rank"] for r in gen.results] == list(range(n))
    assert len({r["pid"] for r in gen.results} | {os.getpid()}) == n + 1
    for r in gen.results:
        assert r["replicas"] == n
        assert r["restarts"] == 0
        assert r["nodes"] == 1
        assert r["addr"] == "127.0.0.1"
        assert isinstance(r["port"], int) and r["port"] > 0
        assert isinstance(r["token"], str) and len(r["token"]) >= 16
        assert str(r["job"]).startswith("test/")
        assert r["ckpt"] == result.checkpoint_dir
        assert r["share"] == result.share_dir
    assert len({(r["port"], r["token"], r["job"]) for r in gen.results}) == 1
    assert os.path.isdir(result.checkpoint_dir)
    assert os.path.isdir(result.share_dir)
    assert result.final is gen


def _restart_by_return(ckpt_marker: str) -> int | None:
    # Each generation leaves a file in the shared checkpoint dir so the next
    # one can prove the directory survived the restart.
    path = Path(env.checkpoint_path() or "") / f"gen{env.num_restarts()}-rank{env.replica_rank()}"
    path.write_text(ckpt_marker)
    schedule = {0: 4, 1: 2, 2: None}
    return schedule[env.num_restarts()]


def test_restart_sequence_driven_by_return_values(tmp_path: Path) -> None:
    result = run_elastic(_restart_by_return, 1, args=("x",), checkpoint_dir=tmp_path)
    assert [g.num_replicas for g in result.generations] == [1, 4, 2]
    assert result.generations[0].results == [4]
    assert result.generations[1].results == [2, 2, 2, 2]
    assert result.generations[2].results == [None, None]
    assert result.checkpoint_dir == str(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    expected = ["gen0-rank0"] + [f"gen1-rank{r}" for r in range(4)]
    expected += ["gen2-rank0", "gen2-rank1"]
    assert names == sorted(expected)


def test_token_and_job_id_survive_restarts_but_port_is_fresh() -> None:
    def body() -> object:
        if env.num_restarts() == 0:
            # Generation 0 returns the next replica count, so it leaves its
            # environment in the share directory for the comparison.
            report = _report()
            Path(env.share_path() or "", "gen0.json").write_text(json.dumps(report))
            return 2
        return _report()

    def first() -> object:
        return _report() if env.num_restarts() == 0 else None

    result = run_elastic(body, 1)
    before = json.loads(Path(result.share_dir, "gen0.json").read_text())
    later = result.generations[1].results
    assert [r["restarts"] for r in later] == [1, 1]
    for report in later:
        assert report["token"] == before["token"]
        assert report["job"] == before["job"]
        assert report["port"] != before["port"]  # a fresh rendezvous per generation
    probe = run_elastic(first, 1).generations[0].results[0]
    assert later[0]["token"] != probe["token"]  # a fresh token per run
    assert later[0]["job"] != probe["job"]


def _checkpoint_exit() -> str:
    if env.num_restarts() < 2:
        sys.exit(CHECKPOINT_EXIT_CODE)
    return f"done with {env.num_replicas()}"


def test_checkpoint_exit_follows_schedule() -> None:
    result = run_elastic(_checkpoint_exit, [1, 2, 3])
    assert [g.num_replicas for g in result.generations] == [1, 2, 3]
    assert result.generations[0].exit_codes == [CHECKPOINT_EXIT_CODE]
    assert result.generations[1].exit_codes == [CHECKPOINT_EXIT_CODE] * 2
    assert result.generations[1].results == [None, None]
    assert result.generations[2].results == ["done with 3"] * 3


def test_checkpoint_exit_with_exhausted_schedule_raises() -> None:
    with pytest.raises(ReplicaError, match=r"schedule \[1, 2\] has no entry for generation 2"):
        run_elastic(_checkpoint_exit, [1, 2])


def test_sigterm_counts_as_checkpoint_exit() -> None:
    def body() -> None:
        if env.num_restarts() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)

    result = run_elastic(body, [2, 1])
    assert [g.num_replicas for g in result.generations] == [2, 1]


def test_mixed_checkpoint_exit_and_return_raises() -> None:
    def body() -> None:
        if env.replica_rank() == 1:
            sys.exit(CHECKPOINT_EXIT_CODE)

    with pytest.raises(ReplicaError, match="mix 143"):
        run_elastic(body, [2, 2])


def _fail_on_rank(rank: int) -> None:
    if env.replica_rank() == rank:
        raise KeyError("boom from the replica")
    time.sleep(30)  # the harness must kill this rank, not wait for it


def test_exception_propagates_with_traceback_and_kills_others() -> None:
    start = time.monotonic()
    with pytest.raises(ReplicaError) as info:
        run_elastic(_fail_on_rank, 3, args=(1,), timeout=60)
    assert time.monotonic() - start < 25
    err = info.value
    assert err.rank == 1
    assert err.exit_code == 1
    assert err.generation == 0
    assert err.traceback is not None and "KeyError: 'boom from the replica'" in err.traceback
    message = str(err)
    assert "rank 1 of 3" in message
    assert "exit code 1" in message
    assert "_fail_on_rank" in message  # the traceback names the failing frame


def _fail_then_exit_slowly() -> None:
    import multiprocessing.util

    # Runs as the replica process exits, after its report was sent.
    multiprocessing.util.Finalize(None, time.sleep, args=(1.0,), exitpriority=0)
    raise KeyError("boom from the replica")


def test_a_failed_replica_slow_to_exit_keeps_its_own_exit_code() -> None:
    # The harness read the report and SIGKILLed the replica before it exited,
    # so the error said exit code -9 (seen as a flaky failure on a busy host).
    with pytest.raises(ReplicaError) as info:
        run_elastic(_fail_then_exit_slowly, 1, timeout=60)
    assert info.value.exit_code == 1
    assert "exit code 1" in str(info.value)


def test_other_exit_code_raises() -> None:
    def body() -> None:
        os._exit(7)

    with pytest.raises(ReplicaError, match="rank 0 of 1 in generation 0 failed with exit code 7"):
        run_elastic(body, 1)


def test_unpicklable_result_is_reported() -> None:
    def body() -> object:
        return lambda: None

    with pytest.raises(ReplicaError, match="must be picklable"):
        run_elastic(body, 1)


def test_a_tensor_result_arrives_by_value() -> None:
    # Sent as a shared-memory handle, it was gone once the replica exited.
    torch = pytest.importorskip("torch")

    def body() -> object:
        return torch.tensor([1.0, 2.0])

    (value,) = run_elastic(body, 1).final.results
    assert value.tolist() == [1.0, 2.0]


def test_large_result_does_not_deadlock() -> None:
    def body() -> bytes:
        return bytes(4 * 1024 * 1024)

    result = run_elastic(body, 2)
    assert [len(r) for r in result.generations[0].results] == [4 * 1024 * 1024] * 2


def test_timeout_kills_every_process_and_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"

    def body() -> None:
        # A grandchild in the replica's process group must be killed too.
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        with open(pid_file, "a") as f:
            f.write(f"{os.getpid()} {child}\n")
        time.sleep(60)

    start = time.monotonic()
    with pytest.raises(ReplicaError, match=r"timed out after 5\.0 s.*ranks \[0, 1\]"):
        run_elastic(body, 2, timeout=5)
    assert time.monotonic() - start < 25
    pids = [int(p) for line in pid_file.read_text().split("\n") if line for p in line.split()]
    assert len(pids) == 4
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.05)
    assert alive == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); treat it as dead (only its parent can reap it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_env_overrides_are_applied_last() -> None:
    def body() -> tuple[str | None, str | None]:
        return os.environ.get("EXTRA"), env.job_token()

    result = run_elastic(body, 2, env={"EXTRA": "1", "ADAPTDL_JOB_TOKEN": "fixed"})
    assert result.generations[0].results == [("1", "fixed")] * 2


def test_negative_return_raises() -> None:
    def body() -> int:
        return -1

    with pytest.raises(ReplicaError, match="rank 0 of generation 0 returned -1"):
        run_elastic(body, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replicas": 0}, "replicas must be an int from 1 to 256 .*, got 0"),
        ({"replicas": []}, r"non-empty sequence, got \[\]"),
        ({"replicas": [1, -2]}, r"replicas\[1\] must be an int from 1 to 256 .*, got -2"),
        # Each is a process: 10**7 of them was no typo the harness caught.
        ({"replicas": [1, 10**7]}, r"replicas\[1\] must be an int from 1 to 256 .*, got 10000000"),
        # Refused in this process, naming env (a replica died of them, unnamed).
        ({"replicas": 1, "env": {"A=B": "x"}}, "env key 'A=B': not a variable name"),
        ({"replicas": 1, "env": {"": "x"}}, "env key '': not a variable name"),
        ({"replicas": 1, "env": {"ADAPTDL_FOO": "a\0b"}}, "env\\['ADAPTDL_FOO'\\]=.*NUL byte"),
        (
            {"replicas": 1, "checkpoint_dir": "/x\0y"},
            "checkpoint_dir=.*: a path cannot hold a NUL byte",
        ),
        ({"replicas": "2"}, "replicas must be a positive int or a sequence of them, got '2'"),
        ({"replicas": 1, "timeout": 0}, "timeout must be a positive number of seconds, got 0"),
        ({"replicas": 1, "start_method": "teleport"}, "start_method must be one of"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_elastic(_report, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"env": [("A", "b")]}, r"env must be a mapping of str to str, got list: \[\('A', 'b'\)\]"),
        ({"checkpoint_dir": 123}, "checkpoint_dir must be a path .*, got int: 123"),
    ],
)
def test_arguments_of_the_wrong_type(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        run_elastic(_report, 1, **kwargs)  # type: ignore[arg-type]


def _ask_for_many_replicas() -> int | None:
    return 10**7 if env.num_restarts() == 0 else None


def test_a_returned_replica_count_beyond_the_cap_is_refused() -> None:
    # It forked replicas until the machine ran out, past the timeout.
    with pytest.raises(ReplicaError, match="returned 10000000; return an int from 1 to 256"):
        run_elastic(_ask_for_many_replicas, 1, timeout=30)


def _ask_for_slow_starts() -> int | None:
    if env.num_restarts() == 0:
        return 40
    time.sleep(30)
    return None


def test_the_timeout_holds_while_a_generation_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Starting replicas did not look at the deadline: 149 were started over
    # 15 s for a 2 s limit.
    started = time.monotonic()
    original_start = multiprocessing.process.BaseProcess.start

    def slow_start(self: multiprocessing.process.BaseProcess) -> None:
        time.sleep(0.2)
        original_start(self)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", slow_start)
    with pytest.raises(ReplicaError, match=r"timed out after 2.0 s in generation 1 while starting"):
        run_elastic(_ask_for_slow_starts, 1, timeout=2.0)
    assert time.monotonic() - started < 6


def test_spawn_start_method() -> None:
    result = run_elastic(_report, 2, start_method="spawn", timeout=60)
    assert [r["rank"] for r in result.generations[0].results] == [0, 1]


def test_elastic_multiprocessing_decorator(tmp_path: Path) -> None:
    @elastic_multiprocessing
    def body(folder: str, *, tag: str) -> int | None:
        Path(folder, f"{tag}-g{env.num_restarts()}-r{env.replica_rank()}").touch()
        return 3 if env.num_restarts() == 0 else None

    # A test decorator returns None (pytest warns about anything else), and
    # keyword arguments (fixtures) reach every replica.
    assert body(str(tmp_path), tag="t") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "t-g0-r0",
        "t-g1-r0",
        "t-g1-r1",
        "t-g1-r2",
    ]


@elastic_multiprocessing
def test_elastic_multiprocessing_passes_pytest_fixtures(tmp_path: Path) -> None:
    # Collected by pytest itself: tmp_path arrives as a keyword argument.
    (tmp_path / f"g{env.num_restarts()}-r{env.replica_rank()}").touch()
    if env.num_restarts() == 0:
        return 2  # type: ignore[return-value]
    assert (tmp_path / "g0-r0").exists()


def test_elastic_multiprocessing_raises_on_failure() -> None:
    @elastic_multiprocessing
    def body() -> None:
        raise KeyError("decorated failure")

    with pytest.raises(ReplicaError, match="decorated failure"):
        body()


def test_replica_error_survives_pickling() -> None:
    import pickle

    err = ReplicaError("boom", generation=2, rank=1, exit_code=7, traceback="tb")
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.generation, copy.rank, copy.exit_code, copy.traceback) == (
        "boom",
        2,
        1,
        7,
        "tb",
    )


@pytest.mark.parametrize(
    "key",
    [
        "ADAPTDL_CHECKPOINT_PATH",
        "ADAPTDL_MASTER_PORT",
        "ADAPTDL_REPLICA_RANK",
        "ADAPTDL_NUM_REPLICAS",
        "ADAPTDL_NUM_RESTARTS",
    ],
)
def test_env_may_not_set_what_the_harness_sets_per_generation(key: str) -> None:
    # They were silently overwritten, although the docstring said env wins.
    with pytest.raises(ValueError, match=f"env may not set {key} \\(got '5'\\)"):
        run_elastic(_report, 1, env={key: "5"})


def test_adaptdl_variables_of_the_test_process_do_not_leak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A supervisor URL inherited from an enclosing job made replicas try
    # discovery at it until they timed out.
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("ADAPTDL_DECIDE_INTERVAL", "5")

    def body() -> list[str]:
        return sorted(k for k in os.environ if k.startswith("ADAPTDL_"))

    (names,) = run_elastic(body, 1, env={"ADAPTDL_DECIDE_INTERVAL": "7"}).final.results
    assert "ADAPTDL_SUPERVISOR_URL" not in names
    assert "ADAPTDL_DECIDE_INTERVAL" in names


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_module_level_states_of_the_user_stay_registered(method: str) -> None:
    # The reset cleared the whole registry: a State made when the user's
    # module was imported was no longer saved in any replica.
    from tests import _harness_state

    if not _harness_state.COUNTER.registered:  # an earlier test cleared the registry
        _harness_state.COUNTER = _harness_state._Counter()
    (names,) = run_elastic(_harness_state.registered_names, 1, start_method=method).final.results
    assert "harness-module-level-counter" in names


def _put(queue: Any) -> None:
    queue.put("from the replica")


def test_a_queue_reaches_a_spawned_replica() -> None:
    # The picklability check pickled args outside a process start, where a
    # Queue refuses to be pickled, and blamed func for it.
    import multiprocessing

    queue = multiprocessing.get_context("spawn").Queue()
    run_elastic(_put, 1, args=(queue,), start_method="spawn", timeout=60)
    assert queue.get(timeout=10) == "from the replica"


def test_unpicklable_args_for_spawn_name_the_start_method() -> None:
    with pytest.raises(TypeError, match="args must be picklable with start_method='spawn'"):
        run_elastic(_report, 1, args=(lambda: None,), start_method="spawn")


def test_a_forked_replica_forgets_the_test_process_state() -> None:
    from adaptdl import checkpoint

    class Named(checkpoint.State):
        def save(self, fileobj: object) -> None:
            pass

        def load(self, fileobj: object) -> None:
            pass

    class Internal(Named):
        _adaptdl_internal = True  # like the loaders' and epochs' states

    # Registered in this process: a forked replica inherited the names and
    # could not create its own states under them.
    held = [Named("harness-inherited-state"), Internal("harness-internal-state")]
    try:

        def body() -> tuple[list[str], list[str]]:
            before = [s.name for s in checkpoint.registered_states()]
            mine = Named("harness-inherited-state")
            after = [s.name for s in checkpoint.registered_states()]
            assert checkpoint.registered_states()[-1] is mine
            return before, after

        ((before, after),) = run_elastic(body, 1).final.results
        # AdaptDL's own states are gone (never saved with the replica's
        # checkpoints); the user's stays until the replica makes its own.
        assert "harness-internal-state" not in before
        assert "harness-inherited-state" in before
        assert after.count("harness-inherited-state") == 1
    finally:
        for state in held:
            state.unregister()


def test_an_infinite_timeout_means_no_limit() -> None:
    # It passed the check and then overflowed select().
    result = run_elastic(_report, 1, timeout=float("inf"))
    assert result.final.exit_codes == [0]


def _fail_and_hang_in_exit() -> None:
    import threading

    # A non-daemon thread keeps the process from exiting after its report.
    threading.Thread(target=time.sleep, args=(60,)).start()
    raise KeyError("boom with a thread left")


def test_waiting_for_a_failed_replica_to_exit_respects_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(ReplicaError, match="boom with a thread left"):
        run_elastic(_fail_and_hang_in_exit, 1, timeout=3)
    assert time.monotonic() - start < 8


def test_sys_exit_with_a_message_is_reported() -> None:
    def body() -> None:
        sys.exit("fatal: bad config")

    with pytest.raises(ReplicaError, match="fatal: bad config") as info:
        run_elastic(body, 1)
    assert info.value.exit_code == 1


def test_an_unpicklable_func_for_spawn_names_the_start_method() -> None:
    with pytest.raises(TypeError, match="func must be picklable with start_method='spawn'"):
        run_elastic(lambda: None, 1, start_method="spawn")


def test_a_file_as_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ValueError, match="checkpoint_dir must be a directory"):
        run_elastic(_report, 1, checkpoint_dir=path)


_ORPHAN_SCRIPT = """
import os, subprocess, sys, time
from adaptdl.testing import run_elastic

def body():
    child = subprocess.Popen(["sleep", "120"])
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()} {child.pid}\\n")
    time.sleep(120)

run_elastic(body, 2, timeout=300)
"""


def test_replicas_die_with_a_killed_harness(tmp_path: Path) -> None:
    # SIGTERM runs no cleanup in the test process; the replicas, each in a
    # process group of its own, ran on as orphans with their children.
    import subprocess

    pid_file = tmp_path / "pids"
    script = tmp_path / "harness.py"
    script.write_text(_ORPHAN_SCRIPT)
    harness = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if pid_file.exists() and len(pid_file.read_text().split()) == 4:
                break
            time.sleep(0.1)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 4
    finally:
        harness.send_signal(signal.SIGTERM)
        harness.wait(30)
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    assert alive == []


def test_clean_exit_counts_as_returning_none() -> None:
    def body() -> None:
        if env.replica_rank() == 0:
            sys.exit()
        os._exit(0)

    result = run_elastic(body, 2)
    assert result.generations[0].results == [None, None]
    assert result.generations[0].exit_codes == [0, 0]
