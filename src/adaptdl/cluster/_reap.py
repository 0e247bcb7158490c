"""Reaping child processes that nobody waits for in the foreground."""

from __future__ import annotations

import subprocess
import threading

__all__ = ["reap_in_background"]


def reap_in_background(proc: subprocess.Popen[bytes]) -> None:
    """Wait for ``proc`` on a daemon thread, so it leaves no zombie behind.

    For children the caller stops tracking while they may still run (a
    daemon it started, a replica shim it leaves running): without a wait
    their exit would leave a zombie in the caller until the next
    ``subprocess.Popen`` anywhere happens to collect it.
    """
    if proc.poll() is not None:
        return
    threading.Thread(target=proc.wait, name=f"adaptdl-reap-{proc.pid}", daemon=True).start()
