"""Restart-safe epoch loops.

A plain ``for epoch in range(E)`` starts from 0 again after every restart. The
generator :func:`remaining_epochs_until` instead counts finished epochs in a
checkpointed state, so a restarted job continues where it stopped::

    for epoch in remaining_epochs_until(30):
        for batch in train_loader:   # resumes mid-epoch after a restart
            ...

An epoch interrupted by a checkpoint is *replayed* after the restart: the
epoch number is yielded again, data-loader loops that had already finished in
it are skipped, the interrupted loop resumes at the saved position, and
:class:`~adaptdl.torch.accumulator.Accumulator` replays the results it had
already synchronised. Code in the epoch body outside those constructs runs
again, so it should be idempotent (printing, LR scheduler steps taken on a
restored scheduler, ...).

Epoch boundaries are also points where every replica checks, through one small
collective, whether any replica received SIGINT/SIGTERM or a checkpoint
request; a job whose training loop is not an AdaptDL data loader (or that is
between loops, e.g. in validation code) therefore still stops cleanly.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections.abc import Callable, Iterator
from typing import IO

import numpy as np

from adaptdl import _procstate, checkpoint
from adaptdl.torch import _signal, _sync
from adaptdl.torch._listeners import WeakListeners

__all__ = ["current_epoch", "finished_epochs", "remaining_epochs_until", "target_epoch"]

logger = logging.getLogger(__name__)


class _EpochState(checkpoint.State):
    """The number of finished epochs; saved with every checkpoint."""

    _adaptdl_internal = True  # forgotten in a forked test replica (_procstate)
    _adaptdl_owns_name = True  # a name checkpoint reserves for the library

    def __init__(self) -> None:
        super().__init__("adaptdl-epoch")
        self.finished_epochs = 0
        self.current_epoch: int | None = None
        # Not checkpointed: the loop sets it again after a restart.
        self.target_epoch: int | None = None

    def save(self, fileobj: IO[bytes]) -> None:
        pickle.dump(self.finished_epochs, fileobj)

    def load(self, fileobj: IO[bytes]) -> None:
        self.finished_epochs = int(pickle.load(fileobj))  # noqa: S301 - our own checkpoint


_STATE: _EpochState | None = None

_LOOPS_ENTERED = 0


def _epoch_loops_entered() -> int:
    """How many :func:`remaining_epochs_until` loops this process has entered.

    Code outside epoch loops runs again after a restart, so this count (not
    checkpointed) tells apart the stretches between epoch loops the same way
    in every run: a data loader iterated both before and after the epoch loop
    resumes the loop that was interrupted, not the first one it meets.
    """
    return _LOOPS_ENTERED


#: States made in an epoch's body (its data loaders and Accumulators), by
#: epoch. Once the epoch has finished no restart runs that body again, so
#: they leave the registry: otherwise every later checkpoint would carry them
#: (a loader and an Accumulator per epoch: 600 states after 300 epochs).
_EPOCH_STATES: dict[int, list[checkpoint.State]] = {}


#: Called with the new count each time an epoch loop is entered (weakly held).
_LOOP_ENTRY_HOOKS = WeakListeners()


def _on_loop_entry(callback: Callable[[int], None]) -> None:
    """Call the bound method ``callback(count)`` whenever an epoch loop is entered."""
    _LOOP_ENTRY_HOOKS.add(callback)


def _bind_to_epoch(state: checkpoint.State, epoch: int | None) -> None:
    """Unregister ``state`` once ``epoch`` has finished (no-op outside epochs)."""
    if epoch is not None:
        _EPOCH_STATES.setdefault(epoch, []).append(state)


def _warn_if_outlived(what: str, created: int | None) -> bool:
    """Warn that ``what``, made inside epoch ``created``, is used after that epoch.

    Its state is named after the epoch it was created in (so that objects
    made anew every epoch find theirs after a restart) and leaves the
    checkpoints when that epoch ends; used later, a restart loses its
    position without a word. Returns whether it warned.
    """
    if created is None:
        return False
    now = current_epoch()
    if now == created:
        return False
    logger.warning(
        "%s was created inside epoch %d and is used %s: checkpoints no longer save its "
        "state, so a restart loses its progress; create it before remaining_epochs_until(), "
        "or anew in every epoch",
        what,
        created,
        "after the epoch loop" if now is None else f"in epoch {now}",
    )
    return True


def _epoch_state_name(kind: str, epoch: int | None, count: int) -> str:
    """The checkpoint name of the ``count``-th ``kind`` (accumulator, dataloader) made in ``epoch``.

    Named after the epoch, so that objects made anew every epoch find theirs
    after a restart.
    """
    return f"adaptdl-{kind}-epoch{epoch}-{count}"


#: File names of the states made in an epoch's body (named by
#: _epoch_state_name, of letters, digits and dashes: a state's file name is
#: its name).
_EPOCH_STATE_FILE = re.compile(r"adaptdl-(?:accumulator|dataloader)-epoch(\d+)-\d+")


def _of_finished_epoch(filename: str) -> bool:
    """Whether a checkpoint's state file belongs to an epoch that has finished.

    No run makes that epoch's loaders and Accumulators again, so checkpoints
    stop carrying them over, also after a restart (whose registry never held
    them).
    """
    match = _EPOCH_STATE_FILE.fullmatch(filename)
    return match is not None and int(match.group(1)) < finished_epochs()


checkpoint._drop_when(_of_finished_epoch)


def _retire_states(finished: int) -> None:
    """Unregister the states of every epoch before ``finished``."""
    for epoch in [e for e in _EPOCH_STATES if e < finished]:
        for state in _EPOCH_STATES.pop(epoch):
            state.unregister()


def _state() -> _EpochState:
    global _STATE
    if _STATE is None:
        _STATE = _EpochState()
        if checkpoint.load_state(_STATE):
            logger.info("resuming at epoch %d", _STATE.finished_epochs)
    return _STATE


def current_epoch() -> int | None:
    """The epoch being iterated by :func:`remaining_epochs_until`, or None outside it."""
    return _state().current_epoch


def finished_epochs() -> int:
    """How many epochs have finished (equal to :func:`current_epoch` inside the loop)."""
    return _state().finished_epochs


def target_epoch() -> int | None:
    """The epoch the latest :func:`remaining_epochs_until` loop runs up to, or None.

    It tells how much training is left (reported to the scheduler as the
    job's remaining work); None outside a loop, since whatever the job does
    after its loop is not counted in epochs. Unlike the other
    queries it does not create (and register for checkpoints) the epoch state
    of a job that never runs an epoch loop.
    """
    return None if _STATE is None else _STATE.target_epoch


def remaining_epochs_until(epoch: int) -> Iterator[int]:
    """Yield the epochs from the first unfinished one up to ``epoch`` (exclusive).

    A second loop continues where the first one ended: after
    ``remaining_epochs_until(30)`` completes, ``remaining_epochs_until(60)``
    yields 30 to 59. Leaving the loop early with ``break`` still counts the
    epoch as finished, as in the original library.

    Args:
        epoch: the epoch number to stop at, exclusive.

    Raises:
        TypeError: ``epoch`` is not an int.
        ValueError: ``epoch`` is negative.
        RuntimeError: another epoch loop is still running (loops do not nest).
    """
    if isinstance(epoch, bool) or not isinstance(epoch, int | np.integer):
        raise TypeError(f"epoch must be an int, got {type(epoch).__name__}: {epoch!r}")
    epoch = int(epoch)
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    state = _state()
    if state.current_epoch is not None:
        raise RuntimeError(
            f"remaining_epochs_until({epoch}) called inside the epoch loop of epoch "
            f"{state.current_epoch}; epoch loops cannot be nested"
        )
    _signal.install_handlers()
    global _LOOPS_ENTERED
    _LOOPS_ENTERED += 1
    _LOOP_ENTRY_HOOKS.call(_LOOPS_ENTERED)
    state.target_epoch = max(epoch, state.finished_epochs)
    if state.finished_epochs < epoch:
        logger.info("starting at epoch %d", state.finished_epochs)
    try:
        while state.finished_epochs < epoch:
            # Act on signals that arrived outside data-loader loops, at a point all
            # replicas reach together.
            _sync.handle_requests(_sync.agree_flags())
            state.current_epoch = state.finished_epochs
            try:
                yield state.current_epoch
            finally:
                state.finished_epochs += 1
                state.current_epoch = None
                _retire_states(state.finished_epochs)
    finally:
        # Also after ``break`` or an exception: the scheduler would otherwise
        # keep hearing of the loop's remaining epochs as work left.
        state.target_epoch = None


@_procstate.register_reset
def _reset_for_tests() -> None:
    """Forget the in-memory epoch state and unregister it (test helper)."""
    global _STATE, _LOOPS_ENTERED
    if _STATE is not None:
        _STATE.unregister()
    _STATE = None
    _LOOPS_ENTERED = 0
    _EPOCH_STATES.clear()
    _LOOP_ENTRY_HOOKS.clear()
