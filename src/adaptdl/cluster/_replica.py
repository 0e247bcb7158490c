"""Replica shim: run one replica's command and record how it ended.

The local backend starts every replica as ``python _replica.py EXIT_FILE
[--grace SECONDS] -- COMMAND...`` in a session of its own. The shim runs the
command as its child and, when it ends, writes the child's return code to
``EXIT_FILE`` (atomically). That file is what lets a *restarted* daemon,
which is not the parent of replicas launched by its predecessor and so
cannot ``wait`` for them, still tell a clean exit (0), a checkpoint-and-exit
(143) and a crash apart.

The shim ignores SIGTERM and SIGINT itself. To stop a replica, the backend
sends SIGTERM to the command's process alone (the shim records its pid
beside the exit file), as Kubernetes signals only a container's main
process: what that process started (data loader workers) is its own to
stop. Signalling the whole group killed PyTorch's loader workers, which die
of a SIGTERM that does not come from their parent, and the replica crashed
before it could checkpoint. Until the command's pid is recorded the backend
signals the group, which then holds nothing the command started.

Before it records the code, the shim ends whatever the command left behind
in its session (a ``subprocess.Popen`` that outlived the script, a data
loader worker), as a container's other processes end with its main one:
SIGTERM, then SIGKILL once the grace period has passed since the stop began.
Only the shim can do this safely: while it lives, its pid names its own
session and process group and no other, so nothing outside the replica is
ever signalled. The backend counts the replica as running until the exit
file exists, so its slot is not reused while such processes still hold it.
The warm-start zygote's shims (:mod:`adaptdl.cluster._zygote`) use the same
functions. This file is run by path and imports only the standard library, so
it adds only interpreter start-up time to a rescale.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from types import FrameType

#: Seconds a leftover process gets after SIGTERM unless ``--grace`` says.
DEFAULT_GRACE = 30.0
#: Seconds between looks at the session while leftover processes exit.
_POLL = 0.05
#: Seconds to wait for SIGKILLed leftovers to vanish before giving up.
_KILL_WAIT = 5.0

#: When (``time.monotonic``) the first SIGTERM or SIGINT reached the shim.
_stop_began: float | None = None


def _note_stop(signum: int, frame: FrameType | None) -> None:
    """Swallow a signal meant for the child, remembering when the stop began.

    A Python handler, not SIG_IGN, so that the child, after ``exec``, gets
    the default disposition back.
    """
    del signum, frame
    global _stop_began
    if _stop_began is None:
        _stop_began = time.monotonic()


def watch_stop_signals() -> None:
    """Ignore SIGTERM and SIGINT in the shim, noting when the first arrived."""
    signal.signal(signal.SIGTERM, _note_stop)
    signal.signal(signal.SIGINT, _note_stop)


def proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (state first)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            raw = handle.read()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def _ours(fields: list[str] | None, leader: int) -> bool:
    """Whether a live process is in ``leader``'s process group or session."""
    if fields is None or len(fields) < 4 or fields[0] in ("Z", "X"):
        return False  # gone, or a zombie that only waits for its parent to reap it
    return int(fields[2]) == leader or int(fields[3]) == leader


def start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot), Linux only."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def leftovers(leader: int) -> list[int]:
    """Live processes other than ``leader`` in its process group or session (Linux)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit() and int(entry) != leader and _ours(proc_stat(int(entry)), leader):
            found.append(int(entry))
    return found


def signal_member(pid: int, signum: int, leader: int) -> bool:
    """Send ``signum`` to ``pid`` if it is still in ``leader``'s group or session.

    With a pidfd the check and the signal address the same process, so a pid
    reused between the look at ``/proc`` and the signal is never hit.
    Returns whether the signal was sent.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            if _ours(proc_stat(pid), leader):
                os.kill(pid, signum)
                return True
            return False
        try:
            if _ours(proc_stat(pid), leader):
                signal.pidfd_send_signal(fd, signum)
                return True
        finally:
            os.close(fd)
    return False


def end_session(grace: float) -> None:
    """End what the replica's command left in this shim's group and session.

    Must be called by the session leader (the shim) while it lives. Each
    leftover gets SIGTERM, and SIGKILL once ``grace`` seconds have passed
    since the stop began (the first SIGTERM to the shim, else now), a little
    before the backend's own SIGKILL of the group would end the shim and
    lose the exit code. Returns at once when nothing was left behind.
    """
    leader = os.getpid()
    if not os.path.isdir("/proc"):  # no way to watch: ask once, as the group
        with contextlib.suppress(OSError):
            os.killpg(leader, signal.SIGTERM)  # the shim itself ignores it
        return
    found = leftovers(leader)
    if not found:
        return
    began = _stop_began if _stop_began is not None else time.monotonic()
    kill_at = began + max(grace - 1.0, grace / 2)
    termed: set[int] = set()
    killed_at: float | None = None
    while found:
        now = time.monotonic()
        if killed_at is None and now >= kill_at:
            killed_at = now
        for pid in found:
            if killed_at is not None:
                signal_member(pid, signal.SIGKILL, leader)
            elif pid not in termed:
                signal_member(pid, signal.SIGTERM, leader)
                termed.add(pid)
        if killed_at is not None and now - killed_at > _KILL_WAIT:
            return  # unkillable (uninterruptible I/O): do not hang the replica forever
        time.sleep(_POLL)
        found = leftovers(leader)


def _beside(exit_file: str, suffix: str) -> str:
    """A file next to ``exit_file``: ``g0-r1.exit`` -> ``g0-r1`` + ``suffix``."""
    stem = exit_file[: -len(".exit")] if exit_file.endswith(".exit") else exit_file
    return stem + suffix


def pid_file(exit_file: str) -> str:
    """Where the shim of ``exit_file`` records its pid: ``g0-r1.exit`` -> ``g0-r1.shim.pid``."""
    return _beside(exit_file, ".shim.pid")


def killed_marker(exit_file: str) -> str:
    """The file the zygote adds when it records the code of a shim that was killed.

    The shim itself ends its session before it writes a code; a shim that
    was killed could not, so what it leaves may still run.
    """
    return _beside(exit_file, ".shim-killed")


def child_file(exit_file: str) -> str:
    """Where the shim records its command's pid: ``g0-r1.exit`` -> ``g0-r1.child.pid``."""
    return _beside(exit_file, ".child.pid")


def record_child(exit_file: str, pid: int) -> None:
    """Write the command's ``pid`` next to ``exit_file``, for the backend to signal it.

    A failure to write is ignored: the backend then signals the group.
    """
    target = child_file(exit_file)
    with contextlib.suppress(OSError):
        with open(f"{target}.tmp", "w") as handle:
            handle.write(f"{pid}\n")
        os.replace(f"{target}.tmp", target)


def signal_replica(leader: int, exit_file: str, signum: int) -> None:
    """Send ``signum`` to the command of the shim ``leader``, else to its group.

    The command's process gets it alone when its pid is recorded and it is
    still in the shim's session (see :func:`signal_member`).
    """
    try:
        with open(child_file(exit_file)) as handle:
            child = int(handle.read().strip())
    except (OSError, ValueError):
        child = None
    if child is not None and signal_member(child, signum, leader):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signum)


def write_exit(exit_file: str, code: int) -> None:
    """Record ``code`` in ``exit_file`` atomically (the zygote's shims use it too)."""
    tmp = f"{exit_file}.tmp"
    with open(tmp, "w") as handle:
        handle.write(str(code))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, exit_file)


def record_pid(exit_file: str) -> None:
    """Write ``PID START`` (start: clock ticks since boot) next to ``exit_file``.

    The daemon records each replica's pid once the launch returns; a daemon
    killed in between would not know this shim, which would run on beside
    the relaunched group. The file lets the next daemon find it and stop it.
    A failure to write is ignored: it costs only that safety net.
    """
    start = start_time(os.getpid())
    target = pid_file(exit_file)
    with contextlib.suppress(OSError):
        with open(f"{target}.tmp", "w") as handle:
            handle.write(f"{os.getpid()} {'-' if start is None else start}\n")
        os.replace(f"{target}.tmp", target)


def read_pid_file(exit_file: str) -> tuple[int, int | None] | None:
    """``(pid, start)`` from the shim's pid file, or None if there is none."""
    try:
        with open(pid_file(exit_file)) as handle:
            pid, start = handle.read().split()
        return int(pid), (None if start == "-" else int(start))
    except (OSError, ValueError):
        return None


def _parse(argv: list[str]) -> tuple[str, float, list[str]] | None:
    """``EXIT_FILE [--grace SECONDS] -- COMMAND...``, or None when malformed."""
    if len(argv) < 3:
        return None
    exit_file, rest, grace = argv[0], argv[1:], DEFAULT_GRACE
    if rest[0] == "--grace" and len(rest) >= 2:
        try:
            grace = float(rest[1])
        except ValueError:
            return None
        rest = rest[2:]
    if len(rest) < 2 or rest[0] != "--":
        return None
    return exit_file, grace, rest[1:]


def main(argv: list[str]) -> int:
    """Run the command after ``--`` and record its return code in ``argv[0]``."""
    parsed = _parse(argv)
    if parsed is None:
        print(
            "usage: _replica.py EXIT_FILE [--grace SECONDS] -- COMMAND [ARGS...]", file=sys.stderr
        )
        return 2
    exit_file, grace, command = parsed
    watch_stop_signals()
    record_pid(exit_file)
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"adaptdl: cannot start replica command {command!r}: {exc}", flush=True)
        code = 127
    else:
        record_child(exit_file, child.pid)
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
    end_session(grace)
    write_exit(exit_file, code)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
