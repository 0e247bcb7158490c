"""Graceful checkpoint-and-exit on SIGINT/SIGTERM, and checkpoints requested from code.

A scheduler rescales a job by sending SIGTERM to every replica; a user at a
terminal presses Ctrl-C on one of them. Either way the replicas must stop *at
the same training step*, save one consistent checkpoint and exit with code 143
(the agreed "checkpointed, please restart me" code). A signal handler cannot do
that itself: it runs at an arbitrary point, maybe in the middle of an optimizer
step, and the other replicas know nothing about it. So the handler only raises
a local flag; the data loaders (and the epoch loop) fold the flags of all
replicas together with a collective at step boundaries (every step or every
few steps, see :data:`adaptdl.torch.data.AGREE_INTERVAL`) and act on the result.

Handlers are installed lazily, the first time an AdaptDL loop runs, and only
from the main thread (Python only allows that there). Importing
:mod:`adaptdl.torch` therefore leaves the application's own handlers alone.

A second SIGINT restores the previous handler before the flag is acted on, so
pressing Ctrl-C twice still interrupts a hung job with ``KeyboardInterrupt``.

Two ways out, both chosen so that a finished job is never restarted and a
checkpointed one is restarted promptly:

* checkpoint-and-exit ends with :func:`exit_after_checkpoint`, which flushes
  output and leaves with ``os._exit(143)`` instead of a normal interpreter
  shutdown (which took replicas 4-7 s, tearing down torch, gloo and thread
  pools, during which a second SIGTERM killed them with -15);
* once the interpreter shuts down (the training script returned or failed),
  an ``atexit`` hook sets SIGTERM and SIGINT to "ignore". Python resets its
  own handlers to the default action late in finalisation, so without this a
  SIGTERM that arrives while a finished job tears down kills it with -15,
  which a launcher reads as "interrupted, restart me". No checkpoint can be
  taken at that point anyway, and the process is already on its way out.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, NoReturn

from adaptdl import _procstate

__all__ = [
    "CHECKPOINT_EXIT_CODE",
    "FLAG_CHECKPOINT",
    "FLAG_EXIT",
    "clear_checkpoint_request",
    "exit_after_checkpoint",
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
_atexit_registered = False
_previous: dict[int, Any] = {}
_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    # A lock another thread held at the fork is never released in the child.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


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
        global _atexit_registered
        if not _atexit_registered:
            # Registered after torch's own hooks, so it runs before them (LIFO).
            atexit.register(_ignore_late_signals)
            _atexit_registered = True
        return True


def _ignore_late_signals() -> None:
    """At interpreter exit, stop SIGTERM/SIGINT from turning a finished job into a killed one.

    Only signals still routed to :func:`_handler` are changed: a SIGINT whose
    handler was already handed back (Ctrl-C pressed once) keeps its
    "press again to force exit" meaning, and an application's own handlers are
    left alone. ``SIG_IGN`` survives finalisation (Python only resets handlers
    that are Python functions), so it covers the whole teardown.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            if signal.getsignal(signum) is _handler:
                signal.signal(signum, signal.SIG_IGN)
        except (ValueError, OSError):  # pragma: no cover - defensive, interpreter exiting
            pass
    if _flags & FLAG_EXIT:
        logger.info("a stop request arrived after the last training step; exiting normally")


def exit_after_checkpoint(code: int = CHECKPOINT_EXIT_CODE) -> NoReturn:
    """Leave the process right away with ``code`` once a checkpoint is saved.

    A normal interpreter shutdown after a checkpoint only costs time (seconds
    of module, thread-pool and process-group teardown) and risk: a second
    SIGTERM from an impatient launcher during it kills the replica with -15.
    The checkpoint is already durable and the collectives are closed, so
    nothing of value is lost by skipping it: this flushes ``sys.stdout``,
    ``sys.stderr`` and every logging handler (``logging.shutdown``), then calls
    :func:`os._exit`. ``atexit`` hooks and ``finally`` blocks of the training
    script do not run; anything they must persist belongs in a checkpointed
    :class:`adaptdl.checkpoint.State`.

    ``torch.distributed`` is deliberately not destroyed: every replica leaves
    at the same step after the same collectives, so no operation is in
    flight, and the operating system closes its sockets (or the driver its
    NCCL resources) at exit without the multi-second orderly shutdown.

    Args:
        code: the exit status, :data:`CHECKPOINT_EXIT_CODE` for "restart me".
    """
    try:
        logging.shutdown()
    except Exception:  # pragma: no cover - never let a broken handler block the exit
        pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more to save
            pass
    os._exit(code)


def get_flags() -> int:
    """The local request bits (:data:`FLAG_EXIT`, :data:`FLAG_CHECKPOINT`)."""
    return _flags


def get_exit_flag() -> bool:
    """True once this replica was asked to checkpoint and exit."""
    return bool(_flags & FLAG_EXIT)


def request_checkpoint(exit: bool = False) -> None:
    """Ask the job to save a checkpoint at the next agreement between replicas.

    The request is local to this replica but acts on all of them: replicas
    agree on it through the same periodic collective that carries signals
    (about every ``adaptdl.torch.data.AGREE_INTERVAL`` seconds of training,
    or at the end of the epoch), so every replica saves at the same step.

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


@_procstate.register_reset
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
