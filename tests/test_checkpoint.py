"""Tests for :mod:`adaptdl.checkpoint`: registry, atomic saves, loads and restarts."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from adaptdl import checkpoint
from adaptdl.checkpoint import (
    CKPT_DIR_PREFIX,
    State,
    clear_registry,
    latest_checkpoint,
    load_state,
    registered_states,
    save_all_states,
    save_state,
    set_checkpoint_path_hook,
)
from adaptdl.testing import run_elastic

_ENV_VARS = (
    "ADAPTDL_CHECKPOINT_PATH",
    "ADAPTDL_REPLICA_RANK",
    "ADAPTDL_NUM_REPLICAS",
    "ADAPTDL_NUM_RESTARTS",
    "ADAPTDL_TUNE_TRIAL_SCHED",
)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Give every test an empty registry and its own checkpoint path."""
    for name in _ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "ckpt"
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(root))
    clear_registry()
    set_checkpoint_path_hook(None)
    yield root
    clear_registry()
    set_checkpoint_path_hook(None)


@pytest.fixture
def root(_isolated: Path) -> Path:
    return _isolated


class Blob(State):
    """A state holding bytes, recording which hooks ran."""

    def __init__(self, name: str, data: bytes = b"") -> None:
        super().__init__(name)
        self.data = data
        self.calls: list[str] = []

    def save(self, fileobj: BinaryIO) -> None:
        self.calls.append("save")
        fileobj.write(self.data)

    def load(self, fileobj: BinaryIO) -> None:
        self.calls.append("load")
        self.data = fileobj.read()

    def sync(self) -> None:
        self.calls.append("sync")


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _reload(name: str) -> tuple[bool, bytes]:
    """Load state ``name`` through a fresh object, as a restarted process would.

    A live state of that name is unregistered first, since names are unique.
    """
    for state in registered_states():
        if state.name == name:
            state.unregister()
    blob = Blob(name)
    try:
        return load_state(blob), blob.data
    finally:
        blob.unregister()


# --------------------------------------------------------------------------- registry


def test_prefix_constant() -> None:
    assert CKPT_DIR_PREFIX == "checkpoint-"


def test_duplicate_name_is_rejected_with_the_name() -> None:
    Blob("model")
    with pytest.raises(ValueError, match=r"'model' is already registered"):
        Blob("model")


def test_unregister_frees_the_name() -> None:
    first = Blob("model")
    assert first.registered
    first.unregister()
    assert not first.registered
    first.unregister()  # idempotent
    second = Blob("model")
    assert second.registered
    # Unregistering a stale object must not remove its successor.
    first.unregister()
    assert second.registered
    assert registered_states() == [second]


def test_clear_registry() -> None:
    a, b = Blob("a"), Blob("b")
    assert registered_states() == [a, b]
    clear_registry()
    assert registered_states() == []
    assert not a.registered
    Blob("a")  # the name is free again


@pytest.mark.parametrize("bad", [None, 3, b"bytes"])
def test_name_must_be_a_string(bad: Any) -> None:
    with pytest.raises(TypeError, match="State name must be a str"):
        State(bad)


def test_name_must_not_be_empty_or_too_long() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        State("")
    with pytest.raises(ValueError, match="too long"):
        State("x" * 300)
    assert registered_states() == []


def test_name_and_repr() -> None:
    state = State("adaptdl-dataloader")
    assert state.name == "adaptdl-dataloader"
    assert "adaptdl-dataloader" in repr(state)
    # Assigning a name relabels the object only; repr and checkpoints keep
    # the registered one (see the next tests).
    state.name = "other"
    assert state.name == "other" and "adaptdl-dataloader" in repr(state)


def test_a_subclass_that_skips_state_init_is_told_to_call_it(root: Path) -> None:
    # Each of these raised AttributeError: '...' object has no attribute
    # '_State__name'.
    class Forgetful(State):
        def __init__(self) -> None:
            self.value = 1

    state = Forgetful()
    for call in (
        lambda: load_state(state),
        lambda: save_state(state, str(root)),
        lambda: state.name,
        lambda: state.registered,
        state.unregister,
    ):
        with pytest.raises(TypeError, match=r"Forgetful .*must call super\(\).__init__\(name\)"):
            call()
    assert repr(state) == "<Forgetful (uninitialized)>"


def test_default_hooks_are_noops(root: Path) -> None:
    state = State("plain")
    state.sync()
    assert save_all_states() == str(root)
    ckpt = latest_checkpoint()
    assert ckpt is not None
    assert (Path(ckpt) / "plain").read_bytes() == b""
    assert load_state(state) is True


def test_non_state_arguments_are_rejected(root: Path) -> None:
    with pytest.raises(TypeError, match="state must be an adaptdl.checkpoint.State"):
        load_state("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got dict"):
        save_state({}, str(root))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- save and load


def test_round_trip(root: Path) -> None:
    model = Blob("model", b"weights")
    opt = Blob("optimizer", b"moments")
    assert save_all_states() == str(root)
    assert model.calls == ["sync", "save"]
    assert opt.calls == ["sync", "save"]
    assert _entries(root) == ["checkpoint-0"]
    assert _entries(root / "checkpoint-0") == ["model", "optimizer"]
    clear_registry()
    assert _reload("model") == (True, b"weights")
    assert _reload("optimizer") == (True, b"moments")


def test_states_are_synced_and_saved_in_registration_order(root: Path) -> None:
    order: list[str] = []

    class Recorder(State):
        def sync(self) -> None:
            order.append(f"sync {self.name}")

        def save(self, fileobj: BinaryIO) -> None:
            order.append(f"save {self.name}")

    for name in ("c", "a", "b"):
        Recorder(name)
    save_all_states()
    assert order == ["sync c", "save c", "sync a", "save a", "sync b", "save b"]


def test_load_without_checkpoint_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADAPTDL_CHECKPOINT_PATH")
    blob = Blob("model")
    assert load_state(blob) is False
    assert blob.calls == []
    assert latest_checkpoint() is None


def test_load_from_missing_directory_returns_false(root: Path) -> None:
    # The original listed the directory unconditionally and raised here.
    assert not root.exists()
    assert load_state(Blob("model")) is False


def test_load_from_empty_directory_or_file(root: Path, tmp_path: Path) -> None:
    root.mkdir()
    assert load_state(Blob("a")) is False
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert latest_checkpoint(not_a_dir) is None


def test_a_checkpoint_path_that_is_a_file_is_refused_at_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # It read as "no checkpoint", and only the first save failed, with
    # FileExistsError, after all the work since the start.
    not_a_dir = tmp_path / "model.pt"
    not_a_dir.write_text("x")
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(not_a_dir))
    for call in (lambda: load_state(Blob("a")), save_all_states):
        with pytest.raises(NotADirectoryError, match="ADAPTDL_CHECKPOINT_PATH=.*model.pt"):
            call()
    assert not_a_dir.read_text() == "x"


def test_load_state_missing_from_checkpoint(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    Blob("model", b"w")
    save_all_states()
    late = Blob("late-state")
    with caplog.at_level(logging.INFO, logger="adaptdl.checkpoint"):
        assert load_state(late) is False
    assert late.calls == []
    # Usually a state created after the checkpoint: said, not warned about.
    (record,) = [r for r in caplog.records if "'late-state'" in r.getMessage()]
    assert record.levelno == logging.INFO


def test_save_without_checkpoint_path_only_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADAPTDL_CHECKPOINT_PATH")
    blob = Blob("model", b"w")
    assert save_all_states() is None
    assert blob.calls == ["sync"]


def test_only_rank_zero_writes(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "2")
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", "1")
    blob = Blob("model", b"w")
    assert save_all_states() == str(root)
    save_state(blob, str(root))
    assert blob.calls == ["sync", "sync"]
    assert not root.exists()


def test_many_saves_in_one_generation(root: Path) -> None:
    # The original renamed onto an existing checkpoint-<n> and died with ENOTEMPTY.
    names = []
    for i in range(4):
        clear_registry()
        Blob("model", f"v{i}".encode())
        save_all_states()
        names.append(_entries(root))
        assert _reload("model") == (True, f"v{i}".encode())
    assert names == [["checkpoint-0"], ["checkpoint-0.1"], ["checkpoint-0.2"], ["checkpoint-0.3"]]


def test_a_file_squatting_a_checkpoint_name_is_skipped(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Listings skip non-directories, so the same name was picked (and failed
    # with a rename error naming a temporary directory) on every later save.
    Blob("model", b"v0")
    save_all_states()
    (root / "checkpoint-0.1").write_text("not a checkpoint")
    for version in (b"v1", b"v2"):
        clear_registry()
        Blob("model", version)
        with caplog.at_level(logging.WARNING, logger="adaptdl"):
            save_all_states()
        assert _reload("model") == (True, version)
    assert "checkpoint-0.1 is not a checkpoint directory" in caplog.text
    assert _entries(root) == ["checkpoint-0.1", "checkpoint-0.3"]
    assert (root / "checkpoint-0.1").read_text() == "not a checkpoint"
    # A symlink to a directory is skipped too (listings do not follow links).
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    (root / "checkpoint-0.4").symlink_to(elsewhere)
    clear_registry()
    Blob("model", b"v3")
    save_all_states()
    assert _reload("model") == (True, b"v3")
    assert "checkpoint-0.5" in _entries(root) and not list(elsewhere.iterdir())


def test_restart_generations_name_checkpoints(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    blob = Blob("model", b"g0")
    save_all_states()
    monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "1")
    blob.data = b"g1"
    save_all_states()
    assert _entries(root) == ["checkpoint-1"]
    monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "3")
    blob.data = b"g3"
    save_all_states()
    assert _entries(root) == ["checkpoint-3"]
    assert _reload("model") == (True, b"g3")


def test_newer_existing_checkpoint_is_superseded(
    monkeypatch: pytest.MonkeyPatch, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A local re-run (restarts back at 0) over a cluster job's checkpoint-5:
    # the new save must still be the one loaded next.
    monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "5")
    blob = Blob("model", b"cluster")
    save_all_states()
    monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "0")
    blob.data = b"local"
    with caplog.at_level(logging.WARNING):
        save_all_states()
    assert _entries(root) == ["checkpoint-5.1"]
    assert "later restart" in caplog.text
    assert _reload("model") == (True, b"local")


def test_load_picks_newest_checkpoint(root: Path) -> None:
    # Leftovers of an interrupted prune: several committed checkpoints.
    for name, data in [
        ("checkpoint-2", b"two"),
        ("checkpoint-10", b"ten"),
        ("checkpoint-2.7", b"x"),
    ]:
        (root / name).mkdir(parents=True)
        (root / name / "model").write_bytes(data)
    (root / "checkpoint-11").write_text("a file, not a checkpoint")
    (root / "checkpoint-abc").mkdir()
    (root / "_checkpoint").mkdir()
    assert _reload("model") == (True, b"ten")
    assert latest_checkpoint() == str(root / "checkpoint-10")


def test_load_warns_when_checkpoint_skips_generations(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Blob("model", b"old")
    save_all_states()
    clear_registry()
    monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "3")
    with caplog.at_level(logging.WARNING):
        assert _reload("model") == (True, b"old")
    assert "older than the previous generation" in caplog.text


def test_unregistered_states_are_carried_over(root: Path) -> None:
    Blob("model", b"m1")
    Blob("loader", b"position")
    save_all_states()
    # Next generation: the loader has not been created again yet when the job
    # is interrupted; its last saved value must survive the new checkpoint.
    clear_registry()
    Blob("model", b"m2")
    save_all_states()
    clear_registry()
    assert _reload("model") == (True, b"m2")
    assert _reload("loader") == (True, b"position")


def test_save_state_commits_one_state(root: Path) -> None:
    model = Blob("model", b"m1")
    Blob("opt", b"o1")
    save_all_states()
    model.data = b"m2"
    save_state(model, str(root))
    assert model.calls == ["sync", "save", "sync", "save"]
    assert _entries(root) == ["checkpoint-0.1"]
    assert _reload("model") == (True, b"m2")
    assert _reload("opt") == (True, b"o1")
    save_state(model, checkpoint_dir=root, sync=False)  # the documented keyword; PathLike
    assert model.calls[-1] == "save"
    assert model.calls.count("sync") == 2


def test_save_state_without_directory_only_syncs(root: Path) -> None:
    blob = Blob("model", b"x")
    save_state(blob, None)
    assert blob.calls == ["sync"]
    assert not root.exists()


def test_unusual_names_round_trip(root: Path) -> None:
    names = ["ns/job", "..", ".hidden", "spaces and ünïcode", "100%", "%2E"]
    for i, name in enumerate(names):
        Blob(name, str(i).encode())
    save_all_states()
    files = _entries(Path(latest_checkpoint() or ""))
    assert len(files) == len(names)
    assert all(not f.startswith(".") and "/" not in f for f in files)
    clear_registry()
    for i, name in enumerate(names):
        assert _reload(name) == (True, str(i).encode())


def test_save_may_close_the_file(root: Path) -> None:
    class Closer(State):
        def save(self, fileobj: BinaryIO) -> None:
            fileobj.write(b"closed early")
            fileobj.close()

    Closer("closer")
    save_all_states()
    assert _reload("closer") == (True, b"closed early")


def test_failed_save_keeps_previous_checkpoint(root: Path) -> None:
    good = Blob("good", b"v1")
    save_all_states()

    class Broken(State):
        def save(self, fileobj: BinaryIO) -> None:
            fileobj.write(b"partial")
            raise OSError("disk full")

    Broken("broken")
    good.data = b"v2"
    with pytest.raises(OSError, match="disk full"):
        save_all_states()
    assert _entries(root) == ["checkpoint-0"]  # temp dir cleaned, old one intact
    assert _reload("good") == (True, b"v1")


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_dirs_are_ignored_then_pruned(root: Path) -> None:
    Blob("model", b"good")
    save_all_states()
    stale = root / f".tmp-checkpoint-{_dead_pid()}-deadbeef"
    stale.mkdir()
    (stale / "model").write_bytes(b"half-writ")
    assert _reload("model") == (True, b"good")
    save_all_states()
    assert _entries(root) == ["checkpoint-0.1"]


def test_a_live_writers_temporary_checkpoint_is_not_pruned(root: Path) -> None:
    # Two processes saving into one root: pruning after one's commit deleted
    # the other's save in progress, which that one then committed, empty.
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        Blob("model", b"good")
        busy = root / f".tmp-checkpoint-{writer.pid}-cafe"
        busy.mkdir(parents=True)
        (busy / "model").write_bytes(b"theirs")
        save_all_states()
        assert (busy / "model").read_bytes() == b"theirs"
        assert sorted(_entries(root)) == [".tmp-checkpoint-" + f"{writer.pid}-cafe", "checkpoint-0"]
    finally:
        writer.kill()
        writer.wait()
    save_all_states()  # its writer is gone: now it is stale
    assert _entries(root) == ["checkpoint-0.1"]


def test_write_is_durable_and_ordered(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Every file and the temp dir are fsynced before the rename, the root after it."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src: str, dst: str) -> None:
        events.append(("rename", f"{src} -> {dst}"))
        real_rename(src, dst)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to map descriptors to paths")
    Blob("a", b"1")
    Blob("b", b"2")
    root.mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", fsync)
        patch.setattr(os, "rename", rename)
        save_all_states()

    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renames) == 1
    at = renames[0]
    tmp, final = events[at][1].split(" -> ")
    assert final == str(root / "checkpoint-0")
    assert os.path.basename(tmp).startswith(".tmp-checkpoint-")
    before = [path for kind, path in events[:at] if kind == "fsync"]
    after = [path for kind, path in events[at + 1 :] if kind == "fsync"]
    assert os.path.join(tmp, "a") in before
    assert os.path.join(tmp, "b") in before
    assert before[-1] == tmp  # the directory itself, after its files
    assert after[0] == str(root)  # the parent, right after the rename


def test_commit_retries_when_the_name_is_taken(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """A checkpoint appearing between listing and renaming bumps the name."""
    real_rename = os.rename
    raced: list[str] = []

    def rename(src: str, dst: str) -> None:
        if not raced:
            raced.append(dst)
            os.makedirs(dst)
            Path(dst, "model").write_bytes(b"other writer")
        real_rename(src, dst)

    Blob("model", b"mine")
    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", rename)
        save_all_states()
    assert raced == [str(root / "checkpoint-0")]
    assert _entries(root) == ["checkpoint-0.1"]
    assert _reload("model") == (True, b"mine")


def test_checkpoint_path_hook(tmp_path: Path, root: Path) -> None:
    tune_dir = tmp_path / "tune"
    purposes: list[str] = []

    def hook(purpose: str) -> Path:
        purposes.append(purpose)
        return tune_dir

    set_checkpoint_path_hook(hook)
    blob = Blob("model", b"tuned")
    assert save_all_states() == str(tune_dir)
    assert load_state(blob) is True
    assert purposes == ["save", "load"]
    assert not root.exists()
    set_checkpoint_path_hook(lambda purpose: None)
    assert save_all_states() is None
    assert load_state(blob) is False
    with pytest.raises(TypeError, match="hook must be callable"):
        set_checkpoint_path_hook("dir")  # type: ignore[arg-type]


def test_public_names() -> None:
    for name in checkpoint.__all__:
        assert hasattr(checkpoint, name), name


# --------------------------------------------------------------------------- SIGKILL mid-save

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from adaptdl import checkpoint

    class Blob(checkpoint.State):
        def __init__(self, name, data=b"", hang_after=None):
            super().__init__(name)
            self.data = data
            self.hang_after = hang_after

        def save(self, fileobj):
            if self.hang_after is None:
                fileobj.write(self.data)
                return
            fileobj.write(self.data[: self.hang_after])
            fileobj.flush()
            open(os.environ["MARKER"], "w").close()
            time.sleep(120)

        def load(self, fileobj):
            self.data = fileobj.read()

    mode = sys.argv[1]
    if mode == "save":
        Blob("a", b"good-a")
        Blob("b", b"good-b")
        checkpoint.save_all_states()
    elif mode == "hang":
        Blob("a", b"new-a" * 1000)
        Blob("b", b"new-b" * 1000, hang_after=7)
        checkpoint.save_all_states()
    else:
        a, b = Blob("a"), Blob("b")
        print(json.dumps([checkpoint.load_state(a), a.data.decode(),
                          checkpoint.load_state(b), b.data.decode()]))
    """
)


def _script(mode: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_sigkill_during_save_keeps_previous_checkpoint(root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "saving"
    env = dict(os.environ, ADAPTDL_CHECKPOINT_PATH=str(root), MARKER=str(marker))
    _script("save", env)
    assert _entries(root) == ["checkpoint-0"]

    env["ADAPTDL_NUM_RESTARTS"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, "hang"], env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "the saving process died before the marker"
            assert time.monotonic() < deadline, "the saving process never reached save()"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL

    # The dead save left a half-written temp dir next to the good checkpoint.
    stale = [name for name in _entries(root) if name.startswith(".tmp-checkpoint-")]
    assert len(stale) == 1
    assert (root / stale[0] / "a").read_bytes() == b"new-a" * 1000
    assert (root / stale[0] / "b").read_bytes() == (b"new-b" * 1000)[:7]
    assert "checkpoint-0" in _entries(root)

    # A fresh process loads the previous checkpoint, untouched.
    loaded = json.loads(_script("load", env).stdout)
    assert loaded == [True, "good-a", True, "good-b"]

    # The next save works and removes the debris.
    _script("save", env)
    assert _entries(root) == ["checkpoint-1"]
    assert json.loads(_script("load", env).stdout) == [True, "good-a", True, "good-b"]


# --------------------------------------------------------------------------- multi-process


def _barrier(tag: str) -> None:
    """Wait until every replica of this generation reached ``tag`` (via files).

    Stands in for a collective inside State.sync so that these tests only
    exercise the checkpoint module.
    """
    share = os.environ["ADAPTDL_SHARE_PATH"]
    gen = os.environ["ADAPTDL_NUM_RESTARTS"]
    rank = int(os.environ["ADAPTDL_REPLICA_RANK"])
    replicas = int(os.environ["ADAPTDL_NUM_REPLICAS"])
    Path(share, f"{tag}-g{gen}-r{rank}").touch()
    deadline = time.monotonic() + 60
    while not all(Path(share, f"{tag}-g{gen}-r{r}").exists() for r in range(replicas)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {tag} timed out")
        time.sleep(0.01)


class Progress(State):
    """Training progress: which generations ran, with how many replicas."""

    def __init__(self) -> None:
        super().__init__("progress")
        self.history: list[int] = []

    def sync(self) -> None:
        share = os.environ["ADAPTDL_SHARE_PATH"]
        gen, rank = os.environ["ADAPTDL_NUM_RESTARTS"], os.environ["ADAPTDL_REPLICA_RANK"]
        Path(share, f"synced-g{gen}-r{rank}").touch()
        _barrier("sync")

    def save(self, fileobj: BinaryIO) -> None:
        share = os.environ["ADAPTDL_SHARE_PATH"]
        gen, rank = os.environ["ADAPTDL_NUM_RESTARTS"], os.environ["ADAPTDL_REPLICA_RANK"]
        Path(share, f"saved-g{gen}-r{rank}").touch()
        pickle.dump(self.history, fileobj)

    def load(self, fileobj: BinaryIO) -> None:
        self.history = pickle.load(fileobj)


def _replica(schedule: list[int], exit_to_restart: bool) -> int | None:
    """One replica: restore progress, record this generation, checkpoint, restart."""
    progress = Progress()
    loaded = load_state(progress)
    report = {"loaded": loaded, "restored": list(progress.history)}
    progress.history.append(int(os.environ["ADAPTDL_NUM_REPLICAS"]))
    save_all_states()
    gen = int(os.environ["ADAPTDL_NUM_RESTARTS"])
    rank = int(os.environ["ADAPTDL_REPLICA_RANK"])
    Path(os.environ["ADAPTDL_SHARE_PATH"], f"report-g{gen}-r{rank}.json").write_text(
        json.dumps(report)
    )
    if gen + 1 >= len(schedule):
        return None
    if exit_to_restart:
        sys.exit(143)
    return schedule[gen + 1]


def _markers(share: str, kind: str) -> set[tuple[int, int]]:
    found = set()
    for name in os.listdir(share):
        if name.startswith(f"{kind}-g"):
            gen, rank = name[len(kind) + 2 :].split(".")[0].split("-r")
            found.add((int(gen), int(rank)))
    return found


@pytest.mark.parametrize(
    ("schedule", "exit_to_restart"), [([1, 4, 2], False), ([2, 1, 4, 2], True)]
)
def test_elastic_restarts_restore_state(schedule: list[int], exit_to_restart: bool) -> None:
    """Save with n replicas, restart with m: every replica sees the saved state."""
    result = run_elastic(_replica, schedule, args=(schedule, exit_to_restart), timeout=90.0)
    assert [g.num_replicas for g in result.generations] == schedule
    share = Path(result.share_dir)
    everyone = {(g, r) for g, n in enumerate(schedule) for r in range(n)}
    assert _markers(result.share_dir, "report") == everyone
    for gen, rank in everyone:
        report = json.loads((share / f"report-g{gen}-r{rank}.json").read_text())
        assert report == {"loaded": gen > 0, "restored": schedule[:gen]}, (gen, rank)
    # Sync ran on every replica of every generation; save only on rank 0.
    assert _markers(result.share_dir, "synced") == everyone
    assert _markers(result.share_dir, "saved") == {(g, 0) for g in range(len(schedule))}
    root = Path(result.checkpoint_dir)
    assert _entries(root) == [f"checkpoint-{len(schedule) - 1}"]
    with open(root / f"checkpoint-{len(schedule) - 1}" / "progress", "rb") as f:
        assert pickle.load(f) == schedule


def test_concurrent_saves_from_threads(root: Path) -> None:
    """Threads saving different states never lose each other's updates."""
    states = [Blob(f"worker-{i}") for i in range(3)]
    errors: list[BaseException] = []

    def work(blob: Blob) -> None:
        try:
            for step in range(8):
                blob.data = f"{blob.name}:{step}".encode()
                save_state(blob, str(root))
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(blob,)) for blob in states]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(_entries(root)) == 1
    for i in range(3):
        assert _reload(f"worker-{i}") == (True, f"worker-{i}:7".encode())


def test_a_new_temporary_checkpoint_survives_a_prune_right_after_its_mkdir(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's commit prunes unknown temporary directories (the CI flake)."""
    from adaptdl import _checkpoint

    other = _checkpoint.PendingCheckpoint(str(root))
    real_mkdir = os.mkdir

    def mkdir_then_prune(path: Any, *args: Any) -> None:
        real_mkdir(path, *args)
        if os.path.basename(path).startswith(_checkpoint.TMP_DIR_PREFIX):
            other._prune(_checkpoint.CheckpointKey(0, 0))  # what a commit does last

    monkeypatch.setattr(_checkpoint.os, "mkdir", mkdir_then_prune)
    pending = _checkpoint.PendingCheckpoint(str(root))
    monkeypatch.undo()
    with pending.open_state("s") as fileobj:
        fileobj.write(b"x")
    pending.commit(0)
    other.abort()


def test_a_subclass_may_use_name_for_its_own_purposes(root: Path) -> None:
    # The original State had no name attribute; assigning one raised here.
    class Labelled(Blob):
        def __init__(self) -> None:
            super().__init__("labelled-state", b"payload")
            self.name = "my label"

    state = Labelled()
    assert state.name == "my label"
    save_state(state, str(root))
    state.unregister()
    # Checkpoints still go under the registered name.
    assert _reload("labelled-state") == (True, b"payload")


@pytest.mark.parametrize(
    "name",
    [
        "adaptdl-epoch",
        "adaptdl-metrics",
        "adaptdl-dataloader-epochNone-0",
        "adaptdl-accumulator-epoch3-1",
    ],
)
def test_the_librarys_own_state_names_are_reserved(name: str) -> None:
    # Taken by a user State (or an AdaptiveDataParallel name), the library's
    # own state later failed as a duplicate inside an unrelated call.
    with pytest.raises(ValueError, match=f"State name '{name}' is reserved by AdaptDL"):
        checkpoint.State(name)
    assert name not in [state.name for state in checkpoint.registered_states()]
    checkpoint.State("adaptdl-epochs-of-mine").unregister()  # only the exact names
