"""Process-wide collectives of an AdaptDL job, backed by one :class:`~adaptdl.reducer.Reducer`.

The rest of the library (checkpoints, metrics, data loaders) calls these
functions without passing a handle around, so the reducer is a module global:
:func:`initialize` creates it from the ``ADAPTDL_*`` environment, and
:func:`teardown` closes it so that a later :func:`initialize` (a test, an
in-process restart) starts afresh. Every rank must call the collectives in the
same order; values are arbitrary picklable Python objects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

from adaptdl import env
from adaptdl._reducer import ReduceFn
from adaptdl.reducer import Future, Reducer, ReducerError, default_reduce_fn

__all__ = [
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "close_at_exit",
    "initialize",
    "is_initialized",
    "teardown",
]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_REDUCER: Reducer | None = None


def _reset_after_fork() -> None:
    # A forked child inherits the parent's reducer object but neither its
    # threads nor a usable connection; it must initialize its own. Its
    # copies of the sockets are closed, so that the other ranks still see
    # the parent's death at once while the child lives on.
    global _REDUCER, _LOCK
    reducer, _REDUCER = _REDUCER, None
    _LOCK = threading.Lock()
    if reducer is not None:
        with contextlib.suppress(Exception):
            reducer._release_after_fork()


os.register_at_fork(after_in_child=_reset_after_fork)


def initialize(
    master_addr: str | None = None,
    master_port: int | None = None,
    replica_rank: int | None = None,
    num_replicas: int | None = None,
) -> None:
    """Connect this replica to the job's reducer; blocks until every rank joined.

    Arguments left as None come from :mod:`adaptdl.env`
    (``ADAPTDL_MASTER_ADDR``, ``ADAPTDL_MASTER_PORT``, ``ADAPTDL_REPLICA_RANK``,
    ``ADAPTDL_NUM_REPLICAS``); the job token and the connection timeout always
    do (``ADAPTDL_JOB_TOKEN``, ``ADAPTDL_CONNECT_TIMEOUT``). Once connected,
    the rank and replica count are exported as ``ADAPTDL_REPLICA_RANK`` and
    ``ADAPTDL_NUM_REPLICAS``, so that :mod:`adaptdl.checkpoint` (which writes
    on rank 0 only) and the rest of the library agree with explicit arguments.

    Raises:
        RuntimeError: already initialized (call :func:`teardown` first).
        ReducerConnectError: the reducer could not be reached, rejected this
            rank, or not every rank joined within the timeout.
    """
    global _REDUCER
    with _LOCK:
        if _REDUCER is not None:
            raise RuntimeError(
                "adaptdl.collective is already initialized; call adaptdl.collective.teardown() "
                "before initializing again"
            )
        addr = env.master_addr() if master_addr is None else master_addr
        port = env.master_port() if master_port is None else master_port
        replicas = env.num_replicas() if num_replicas is None else num_replicas
        rank = env.replica_rank(num_replicas) if replica_rank is None else replica_rank
        _REDUCER = Reducer(
            rank,
            replicas,
            addr,
            port,
            token=env.job_token(),
            connect_timeout=env.connect_timeout(),
        )
        # The rest of the library (checkpoints: only rank 0 writes) reads the
        # topology from the environment; make explicit arguments visible to it.
        os.environ["ADAPTDL_NUM_REPLICAS"] = str(replicas)
        os.environ["ADAPTDL_REPLICA_RANK"] = str(rank)
        logger.debug("collective initialized: %r", _REDUCER)


def is_initialized() -> bool:
    """True between :func:`initialize` and :func:`teardown`."""
    return _REDUCER is not None


def teardown() -> None:
    """Close the reducer (its sockets and threads); a no-op when not initialized.

    Every rank should call it: it first waits until all ranks have (a
    barrier, given up after :data:`TEARDOWN_WAIT` seconds or once a rank is
    gone, so a rank that fails while the others train cannot hang in it),
    so no rank's last collective is cut short by rank 0 closing the server.
    Afterwards :func:`initialize` may be called again; a rank that does so
    before rank 0 has replaced its server waits for the new one.
    """
    _teardown(barrier=True)


#: Seconds :func:`teardown` waits for the other ranks before closing anyway.
TEARDOWN_WAIT = 30.0


def _teardown(barrier: bool) -> None:
    global _REDUCER
    with _LOCK:
        reducer, _REDUCER = _REDUCER, None
    if reducer is None:
        return
    try:
        if barrier:
            reducer._teardown_barrier_async().result(timeout=TEARDOWN_WAIT)
    except ReducerError as exc:
        logger.debug("teardown: no barrier, the job's reducer failed: %s", exc)
    except TimeoutError:
        logger.warning(
            "teardown: not every rank reached teardown() within %g s; closing anyway",
            TEARDOWN_WAIT,
        )
    finally:
        reducer.close()


def close_at_exit() -> None:
    """Close the reducer without waiting for the other ranks (an ``atexit`` hook).

    A replica that exits on an error must not wait for the others to exit
    too (they may be waiting for its next collective, or be stuck); closing
    still flushes rank 0's last results to every rank, and the others learn
    that this rank closed its reducer.
    """
    _teardown(barrier=False)


def _reducer() -> Reducer:
    reducer = _REDUCER
    if reducer is None:
        raise RuntimeError(
            "adaptdl.collective is not initialized; call adaptdl.collective.initialize() "
            "first (adaptdl.torch.init_process_group does it for you)"
        )
    return reducer


def allreduce(value: Any, reduce_fn: ReduceFn = default_reduce_fn) -> Any:
    """Fold ``value`` over all ranks in rank order with rank 0's ``reduce_fn``.

    Raises:
        RuntimeError: not initialized.
        ReducerError: the operation failed anywhere in the job.
    """
    return _reducer().allreduce(value, reduce_fn)


def allreduce_async(value: Any, reduce_fn: ReduceFn = default_reduce_fn) -> Future:
    """Like :func:`allreduce` but return a :class:`~adaptdl.reducer.Future` at once."""
    return _reducer().allreduce_async(value, reduce_fn)


def broadcast(value: Any) -> Any:
    """Return rank 0's ``value`` on every rank."""
    return _reducer().broadcast(value)


def barrier() -> None:
    """Return once every rank has called :func:`barrier`."""
    _reducer().broadcast(None)
