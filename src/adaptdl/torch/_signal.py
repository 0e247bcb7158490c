"""Graceful checkpoint-and-exit on SIGINT/SIGTERM, and checkpoints requested from code.

A scheduler rescales a job by sending SIGTERM to every replica; a user at a
terminal presses Ctrl-C on one of them. Either way the replicas must stop *at
the same training step*, save one consistent checkpoint and exit with code 143
(the agreed "checkpointed, please restart me" code). A signal handler cannot do
that itself: it runs at an arbitrary point, maybe in the middle of an optimizer
step, and the other replicas know nothing about it. So the handler only raises
a local flag; the data loaders (and the epoch loop) fold the flags of all
replicas together with a collective at step boundaries and act on the result.

Handlers are installed lazily, the first time an AdaptDL loop runs, and only
from the main thread (Python only allows that there). Importing
:mod:`adaptdl.torch` therefore leaves the application's own handlers alone.

A second SIGINT restores the previous handler before the flag is acted on, so
pressing Ctrl-C twice still interrupts a hung job with ``KeyboardInterrupt``.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

__all__ = [
    "CHECKPOINT_EXIT_CODE",
    "FLAG_CHECKPOINT",
    "FLAG_EXIT",
    "clear_checkpoint_request",
    "get_exit_flag",
    "get_flags",
    "install_handlers",
    "request_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_EXIT_CODE = 143
"""Exit code of a replica that saved a checkpoint and stopped so it can be restarted."""

FLAG_EXIT = 1
"""Bit set when the job should checkpoint and exit with :data:`CHECKPOINT_EXIT_CODE`."""

FLAG_CHECKPOINT = 2
"""Bit set when the job should checkpoint and keep training."""

_flags = 0
_installed = False
_previous: dict[int, Any] = {}
_lock = threading.Lock()


def _handler(signum: int, frame: FrameType | None) -> None:
    global _flags
    _flags |= FLAG_EXIT
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        # Hand Ctrl-C back to the previous handler: a second press is a hard stop.
        previous = _previous.get(signum)
        if not callable(previous) and previous != signal.SIG_IGN:
            previous = signal.default_int_handler
        signal.signal(signal.SIGINT, previous)
        logger.info("got %s, exiting gracefully... send it again to force exit", name)
    else:
        logger.info("got %s, checkpointing and exiting gracefully", name)


def install_handlers() -> bool:
    """Install the SIGINT and SIGTERM handlers once; return whether they are installed.

    Safe to call any number of times and from any thread: outside the main
    thread (where Python refuses to install handlers) it does nothing and
    returns False, and the job then stops only on explicit requests.
    """
    global _installed
    with _lock:
        if _installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not in the main thread, signal handlers not installed")
            return False
        for signum in (signal.SIGINT, signal.SIGTERM):
            _previous[signum] = signal.getsignal(signum)
            signal.signal(signum, _handler)
        _installed = True
        return True


def get_flags() -> int:
    """The local request bits (:data:`FLAG_EXIT`, :data:`FLAG_CHECKPOINT`)."""
    return _flags


def get_exit_flag() -> bool:
    """True once this replica was asked to checkpoint and exit."""
    return bool(_flags & FLAG_EXIT)


def request_checkpoint(exit: bool = False) -> None:
    """Ask the job to save a checkpoint at the next step boundary.

    The request is local to this replica but acts on all of them: replicas
    agree on it through the same per-step collective that carries signals, so
    every replica saves at the same step.

    Args:
        exit: False (checkpoint-and-continue) saves and keeps training, e.g. to
            snapshot progress before a risky phase. True (checkpoint-and-exit)
            saves and then exits every replica with code 143, exactly as if
            SIGTERM had arrived; a launcher restarts the job from the
            checkpoint.
    """
    global _flags
    if not isinstance(exit, bool):
        raise TypeError(f"exit must be a bool, got {exit!r}")
    _flags |= FLAG_EXIT if exit else FLAG_CHECKPOINT


def clear_checkpoint_request() -> None:
    """Forget a checkpoint-and-continue request once it has been served."""
    global _flags
    _flags &= ~FLAG_CHECKPOINT


def _reset_for_tests() -> None:
    """Restore the previous handlers and clear all flags (test helper)."""
    global _flags, _installed
    with _lock:
        if _installed and threading.current_thread() is threading.main_thread():
            for signum, previous in _previous.items():
                signal.signal(signum, previous)
        _previous.clear()
        _installed = False
        _flags = 0
