"""Collectives as used by adaptdl.torch, plus acting on agreed checkpoint requests.

Every collective in this package goes through here so that:

* a single process that never called
  :func:`adaptdl.torch.init_process_group` still works (there is nobody to
  agree with, so the local value *is* the agreed value), while a process of a
  multi-replica job that forgot to call it gets a clear error instead of a
  hang;
* acting on checkpoint requests (save, then exit with 143 or continue) is
  implemented once, for data-loader steps and epoch boundaries alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from adaptdl import checkpoint, collective, env
from adaptdl.torch import _signal

__all__ = [
    "Resolvable",
    "agree_flags",
    "allreduce",
    "allreduce_async",
    "broadcast",
    "handle_requests",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Resolvable(Protocol):
    """Anything with a blocking ``result()``, like :class:`adaptdl.reducer.Future`."""

    def result(self) -> Any: ...


class _Done(Generic[T]):
    """An already-resolved future, for the single-process case."""

    def __init__(self, value: T) -> None:
        self._value = value

    def result(self) -> T:
        return self._value


def _initialized() -> bool:
    return bool(collective.is_initialized())


def _check_local(what: str) -> None:
    if env.num_replicas() > 1:
        raise RuntimeError(
            f"{what} needs the AdaptDL collectives, but this replica (rank "
            f"{env.replica_rank()} of ADAPTDL_NUM_REPLICAS={env.num_replicas()}) has not "
            "initialized them; call adaptdl.torch.init_process_group() first"
        )


def allreduce(value: T, reduce_fn: Callable[[T, T], T]) -> T:
    """Blocking fold of ``value`` over all replicas (the local value if alone)."""
    if _initialized():
        return collective.allreduce(value, reduce_fn)  # type: ignore[no-any-return]
    _check_local("an allreduce")
    return value


def allreduce_async(value: T, reduce_fn: Callable[[T, T], T]) -> Resolvable:
    """Start a fold of ``value`` over all replicas; resolve it with ``.result()``."""
    if _initialized():
        return collective.allreduce_async(value, reduce_fn)
    _check_local("an allreduce")
    return _Done(value)


def broadcast(value: T) -> T:
    """Rank 0's ``value`` on every replica (the local value if alone)."""
    if _initialized():
        return collective.broadcast(value)  # type: ignore[no-any-return]
    _check_local("a broadcast")
    return value


def or_flags(a: int, b: int) -> int:
    """Reduce function for request bits (module level so it can be pickled)."""
    return a | b


def agree_flags() -> int:
    """The request bits of all replicas OR-ed together (blocking, collective)."""
    return allreduce(_signal.get_flags(), or_flags)


def _warn_if_nowhere_to_save(flags: int) -> None:
    """Say so when a requested checkpoint will not be written anywhere.

    Exit code 143 means "checkpointed, restart me", so an exit without a
    checkpoint must not look like one. The path is looked up as the save
    does (the path hook first, then ``ADAPTDL_CHECKPOINT_PATH``).
    """
    try:
        root = checkpoint._checkpoint_root("save")
    except NotADirectoryError:
        return  # the save itself raises, naming the path
    if root is None:
        logger.warning(
            "no checkpoint path is set (ADAPTDL_CHECKPOINT_PATH or a checkpoint path hook), "
            "so no checkpoint is saved%s",
            "; exiting with code 143, and a restart begins from scratch"
            if flags & _signal.FLAG_EXIT
            else "",
        )


def handle_requests(flags: int) -> None:
    """Act on agreed request bits; every replica must call this with the same bits.

    A checkpoint-and-exit saves every state and ends the process with code
    143 through :func:`adaptdl.torch._signal.exit_after_checkpoint` (flushed
    output, no interpreter shutdown; see there why); a
    checkpoint-and-continue saves and clears the local request.
    """
    if (flags & (_signal.FLAG_EXIT | _signal.FLAG_CHECKPOINT)) and env.replica_rank() == 0:
        _warn_if_nowhere_to_save(flags)
    if flags & _signal.FLAG_EXIT:
        logger.info("checkpointing and exiting with code %d", _signal.CHECKPOINT_EXIT_CODE)
        checkpoint.save_all_states()
        # Rank 0 hosts the reducer: close it cleanly so the other replicas get
        # the results of the last collectives before this process goes away.
        collective.teardown()
        _signal.exit_after_checkpoint(_signal.CHECKPOINT_EXIT_CODE)
    if flags & _signal.FLAG_CHECKPOINT:
        logger.info("checkpoint requested, saving and continuing")
        checkpoint.save_all_states()
        _signal.clear_checkpoint_request()
