"""Replica shim: run one replica's command and record how it ended.

The local backend starts every replica as ``python _replica.py EXIT_FILE --
COMMAND...`` in a session of its own. The shim runs the command as its child
and, when it ends, writes the child's return code to ``EXIT_FILE``
(atomically). That file is what lets a *restarted* daemon, which is not the
parent of replicas launched by its predecessor and so cannot ``wait`` for
them, still tell a clean exit (0), a checkpoint-and-exit (143) and a crash
apart.

The shim ignores SIGTERM and SIGINT itself: the backend signals the whole
process group, so the child receives the signal directly, checkpoints and
exits, and the shim stays alive to record the code. It is run by path and
imports only the standard library, so it adds only interpreter start-up time
to a rescale.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Swallow a signal meant for the child (a Python handler, not SIG_IGN,
    so that the child, after ``exec``, gets the default disposition back)."""
    del signum, frame


def main(argv: list[str]) -> int:
    """Run ``argv[2:]`` (after ``--``) and record its return code in ``argv[0]``."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: _replica.py EXIT_FILE -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    exit_file, command = argv[0], argv[2:]
    signal.signal(signal.SIGTERM, _ignore)
    signal.signal(signal.SIGINT, _ignore)
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"adaptdl: cannot start replica command {command!r}: {exc}", flush=True)
        code = 127
    else:
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
    tmp = f"{exit_file}.tmp"
    with open(tmp, "w") as handle:
        handle.write(str(code))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, exit_file)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
