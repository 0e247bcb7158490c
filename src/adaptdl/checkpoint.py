"""Save and restore arbitrary training state across checkpoint-restarts.

An elastic job is stopped and restarted, possibly with a different number of
replicas, whenever the scheduler changes its allocation. Everything needed to
resume (model and optimizer state, data-loader position, epoch counters,
profiles) is wrapped in :class:`State` objects. A state registers itself under
a unique name when it is created, loads its previous value with
:func:`load_state`, and is written out with every other registered state by
:func:`save_all_states` when the job is about to stop.

Saving is collective: :meth:`State.sync` runs on every replica (so the replicas
can agree on a consistent value), then only rank 0 writes. Checkpoints live
under ``ADAPTDL_CHECKPOINT_PATH`` as directories ``checkpoint-<restarts>``
(``checkpoint-<restarts>.<n>`` for further saves in the same generation), one
file per state. Compared with the original implementation, writes are atomic
and durable (temporary directory, fsync, rename, fsync), any number of saves
may happen in one restart generation, the previous checkpoint survives a save
that dies midway, the registry can be cleared, and a missing checkpoint
directory simply means "nothing to load".

Example::

    class Counter(adaptdl.checkpoint.State):
        def __init__(self) -> None:
            super().__init__("counter")
            self.value = 0

        def save(self, fileobj):
            fileobj.write(str(self.value).encode())

        def load(self, fileobj):
            self.value = int(fileobj.read())

    counter = Counter()
    adaptdl.checkpoint.load_state(counter)  # False on the first run
    ...
    adaptdl.checkpoint.save_all_states()
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import BinaryIO, Literal, TypeAlias

from adaptdl import _checkpoint, _procstate, env

__all__ = [
    "CKPT_DIR_PREFIX",
    "State",
    "clear_registry",
    "latest_checkpoint",
    "load_state",
    "registered_states",
    "save_all_states",
    "save_state",
    "set_checkpoint_path_hook",
]

logger = logging.getLogger(__name__)

CKPT_DIR_PREFIX = _checkpoint.CKPT_DIR_PREFIX
"""Name prefix of committed checkpoint directories under the checkpoint path."""

CheckpointPathHook: TypeAlias = Callable[[Literal["save", "load"]], "str | os.PathLike[str] | None"]

# Registry of live states by name, in registration order (the save order).
# Guarded by a lock so states may be created from several threads.
_REGISTRY: dict[str, State] = {}
_REGISTRY_LOCK = threading.RLock()

_PATH_HOOK: CheckpointPathHook | None = None

_COMMIT_LOCK = threading.Lock()

#: Tests of state file names that later checkpoints no longer carry over
#: (see :func:`_drop_when`).
_DROPPED: list[Callable[[str], bool]] = []


def _drop_when(test: Callable[[str], bool]) -> None:
    """Stop carrying over state files for which ``test(filename)`` holds.

    For states that no run will load again (those of finished epochs): carried
    over from checkpoint to checkpoint, their number grew without end.
    """
    if test not in _DROPPED:
        _DROPPED.append(test)


def _new_locks_after_fork() -> None:
    # A lock another parent thread held at the fork is never released in the child.
    global _REGISTRY_LOCK, _COMMIT_LOCK
    _REGISTRY_LOCK = threading.RLock()
    _COMMIT_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_after_fork)


# States a forked test replica inherited from the test process (by id): a new
# State of the same name replaces one of them instead of being refused.
_INHERITED: set[int] = set()


@_procstate.register_reset
def _forget_own_states() -> None:
    """Unregister AdaptDL's own states; let the user's be replaced by name.

    A test process that trained in-process leaves AdaptDL's states (loaders,
    epochs, models) behind: they must neither be saved with the replica's
    checkpoints nor block its own. The user's states stay registered (one
    made when a module was imported belongs to every replica), but creating
    one again under its name, as the replica's training code does, replaces
    the inherited copy.
    """
    with _REGISTRY_LOCK:
        for name, state in list(_REGISTRY.items()):
            if getattr(state, "_adaptdl_internal", False):
                del _REGISTRY[name]
        _INHERITED.clear()
        _INHERITED.update(id(state) for state in _REGISTRY.values())


def _registered_name(state: State) -> str:
    """The name ``state`` was registered, saved and loaded under.

    Raises:
        TypeError: the object never ran ``State.__init__`` (a subclass whose
            ``__init__`` does not call ``super().__init__(name)``).
    """
    name: str | None = state.__dict__.get("_State__name")
    if name is None:
        raise TypeError(
            f"{type(state).__name__} object has no State name: its __init__ must call "
            "super().__init__(name) to name and register it"
        )
    return name


#: Names of the library's own states (the epoch counter, the metrics, and
#: per-epoch loaders and Accumulators); no other State may take them.
_RESERVED_NAME = re.compile(r"adaptdl-(epoch|metrics)|adaptdl-(dataloader|accumulator)-epoch.*")


class State:
    """A named piece of state that is saved in, and restored from, checkpoints.

    Subclass it and override :meth:`save`, :meth:`load` and, when replicas may
    hold different values, :meth:`sync`. Creating the object registers it so
    :func:`save_all_states` includes it; the name is also the key under which
    it is found again after a restart, so it must be stable across restarts
    and unique within the process.

    Args:
        name: unique, non-empty name of this state.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is empty, too long for a file name, or already
            registered by another live state.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"State name must be a str, got {type(name).__name__}: {name!r}")
        if not name:
            raise ValueError("State name must be a non-empty string, got ''")
        _checkpoint.state_filename(name)  # rejects names that cannot be stored
        if _RESERVED_NAME.fullmatch(name) and not getattr(type(self), "_adaptdl_owns_name", False):
            # Taken first, the library's own state (made lazily) would later
            # fail as a duplicate inside an unrelated call, or load this file.
            raise ValueError(
                f"State name {name!r} is reserved by AdaptDL for its epoch counter, metrics, "
                "loaders and Accumulators; choose another name"
            )
        # Name-mangled so subclasses cannot clobber it by accident.
        self.__name = name
        with _REGISTRY_LOCK:
            if name in _REGISTRY and id(_REGISTRY[name]) in _INHERITED:
                _INHERITED.discard(id(_REGISTRY.pop(name)))
            if name in _REGISTRY:
                raise ValueError(
                    f"a State named {name!r} is already registered; names must be unique "
                    "(call unregister() on the old state or clear_registry() first)"
                )
            _REGISTRY[name] = self

    @property
    def name(self) -> str:
        """The name this state is saved and loaded under.

        A subclass may assign its own ``name`` (the original library's State
        had no such attribute, so subclasses used it freely): reading it back
        then gives that value, while checkpoints keep the registered name.
        """
        alias: str | None = self.__dict__.get("_State__alias")
        return _registered_name(self) if alias is None else alias

    @name.setter
    def name(self, value: str) -> None:
        self.__alias = value

    @property
    def registered(self) -> bool:
        """Whether this object is currently in the registry."""
        name = _registered_name(self)
        with _REGISTRY_LOCK:
            return _REGISTRY.get(name) is self

    def unregister(self) -> None:
        """Remove this state from the registry; a no-op if it is not registered.

        After this the name may be reused and :func:`save_all_states` no
        longer saves this object (a checkpoint keeps its last saved value).
        """
        name = _registered_name(self)
        with _REGISTRY_LOCK:
            if _REGISTRY.get(name) is self:
                del _REGISTRY[name]
                _INHERITED.discard(id(self))

    def save(self, fileobj: BinaryIO) -> None:
        """Write this state to ``fileobj`` (a binary, writable file); runs on rank 0 only.

        The default writes nothing.
        """

    def load(self, fileobj: BinaryIO) -> None:
        """Restore this state from ``fileobj`` (binary, readable), as written by :meth:`save`.

        Runs on every replica that calls :func:`load_state`. The default reads
        nothing.
        """

    def sync(self) -> None:
        """Make the state consistent across replicas before it is saved.

        Runs on every replica, in the same order everywhere (it may use
        collectives); after it returns, rank 0's value is what gets saved. The
        default does nothing.
        """

    def __repr__(self) -> str:
        name = self.__dict__.get("_State__name")
        return f"<{type(self).__name__} {'(uninitialized)' if name is None else repr(name)}>"


def registered_states() -> list[State]:
    """A snapshot of the registered states, in registration (and save) order."""
    with _REGISTRY_LOCK:
        return list(_REGISTRY.values())


def clear_registry() -> None:
    """Unregister every state.

    The original registry only ever grew, which leaked every state object
    (often holding a model) for the life of the process and made it
    impossible to create a second training loop with the same names, e.g. in
    tests or notebooks.
    """
    with _REGISTRY_LOCK:
        _REGISTRY.clear()
        _INHERITED.clear()


def set_checkpoint_path_hook(hook: CheckpointPathHook | None) -> None:
    """Let an integration choose the checkpoint directory instead of the environment.

    Under Ray Tune a trial's checkpoints belong in directories that Tune
    manages, not in ``ADAPTDL_CHECKPOINT_PATH``. The core library must not
    import Ray, so the Ray integration installs a hook here instead: it is
    called with ``"save"`` by :func:`save_all_states` and with ``"load"`` by
    :func:`load_state` and returns the checkpoint root to use (or None for "no
    checkpointing"). Pass None to go back to :func:`adaptdl.env.checkpoint_path`.

    Raises:
        TypeError: ``hook`` is neither callable nor None.
    """
    global _PATH_HOOK
    if hook is not None and not callable(hook):
        raise TypeError(f"hook must be callable or None, got {hook!r}")
    _PATH_HOOK = hook


def _checkpoint_root(purpose: Literal["save", "load"]) -> str | None:
    """The checkpoint directory, refused early if something else is there.

    A regular file at that path would read as "no checkpoint" and fail only
    at the first save, maybe hours later, losing the work done until then.

    Raises:
        NotADirectoryError: the path exists and is not a directory.
    """
    if _PATH_HOOK is not None:
        path = _PATH_HOOK(purpose)
        root = None if path is None else os.fspath(path)
        source = f"the checkpoint path hook returned {root!r}, which"
    else:
        root = env.checkpoint_path()
        source = f"ADAPTDL_CHECKPOINT_PATH={root!r}"
    if root is not None and os.path.exists(root) and not os.path.isdir(root):
        raise NotADirectoryError(
            f"{source} exists but is not a directory; point it at a directory "
            "(a checkpoint is a directory of files)"
        )
    return root


def _check_state(state: object) -> State:
    if not isinstance(state, State):
        raise TypeError(
            f"state must be an adaptdl.checkpoint.State, got {type(state).__name__}: {state!r}"
        )
    _registered_name(state)
    return state


def _write(pending: _checkpoint.PendingCheckpoint, state: State) -> None:
    with pending.open_state(_registered_name(state)) as fileobj:
        state.save(fileobj)


def _commit(pending: _checkpoint.PendingCheckpoint) -> str:
    """Carry unsaved states over from the previous checkpoint, then commit.

    States registered in an earlier generation but not (yet) in this one keep
    their last saved value instead of silently disappearing from the
    checkpoint, e.g. a data loader that had not been created again before the
    job was interrupted.
    """
    # Serialised so that concurrent saves from several threads cannot lose
    # each other's updates: each carries over what the previous commit wrote.
    with _COMMIT_LOCK:
        previous = _checkpoint.newest_checkpoint(pending.root)
        if previous is not None:
            carried = pending.carry_over(
                previous[1], skip=lambda name: any(test(name) for test in _DROPPED)
            )
            if carried:
                logger.debug("carried %s over from %s", carried, previous[1])
        return pending.commit(env.num_restarts())


def save_state(
    state: State, checkpoint_dir: str | os.PathLike[str] | None, sync: bool = True
) -> None:
    """Save one state into a new checkpoint under ``checkpoint_dir``.

    First calls ``state.sync()`` on every replica (if ``sync``), so every
    replica must call this function. Then rank 0, and only rank 0, writes a new
    checkpoint that holds this state's data plus, unchanged, every other state
    of the previous checkpoint, and commits it atomically. Nothing is written
    when ``checkpoint_dir`` is None.

    Args:
        state: the state to save.
        checkpoint_dir: the checkpoint root, normally
            :func:`adaptdl.env.checkpoint_path`; None only syncs.
        sync: whether to call ``state.sync()`` first.

    Raises:
        TypeError: ``state`` is not a :class:`State`.
    """
    state = _check_state(state)
    if sync:
        state.sync()
    if checkpoint_dir is None or env.replica_rank() != 0:
        return
    pending = _checkpoint.PendingCheckpoint(os.fspath(checkpoint_dir))
    try:
        _write(pending, state)
        path = _commit(pending)
    except BaseException:
        pending.abort()
        raise
    logger.info("saved state %r into %s", _registered_name(state), path)


def save_all_states() -> str | None:
    """Sync every registered state on all replicas and save them all on rank 0.

    States are synced and saved in registration order (every replica must
    call this, because :meth:`State.sync` may use collectives). Rank 0 writes
    everything into one new checkpoint, commits it durably and atomically,
    and only then deletes older checkpoints, so a save killed at any point
    leaves the previous checkpoint loadable.

    Called by hand inside a training loop, it saves the data loader at the
    start of the batch being trained, so a job restarted from it trains that
    batch again. ``adaptdl.torch.request_checkpoint()`` saves between steps
    instead, at a step every replica agrees on, and resumes exactly.

    Returns:
        The checkpoint root (on every rank), or None when checkpointing is
        disabled (no ``ADAPTDL_CHECKPOINT_PATH``), in which case the states
        are still synced.

    Raises:
        NotADirectoryError: the checkpoint path exists and is not a directory.
    """
    root = _checkpoint_root("save")
    states = registered_states()
    # Only rank 0 writes; the other replicas just take part in the syncs.
    target = root if env.replica_rank() == 0 else None
    start = time.monotonic()
    pending: _checkpoint.PendingCheckpoint | None = None
    try:
        for state in states:
            state.sync()
            if target is not None:
                if pending is None:
                    pending = _checkpoint.PendingCheckpoint(target)
                _write(pending, state)
        if target is not None:
            if pending is None:
                pending = _checkpoint.PendingCheckpoint(target)
            path = _commit(pending)
            logger.info(
                "saved %d states into %s in %.3f s", len(states), path, time.monotonic() - start
            )
    except BaseException:
        if pending is not None:
            pending.abort()
        raise
    return root


def latest_checkpoint(ckpt_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Path of the newest committed checkpoint directory, or None if there is none.

    Args:
        ckpt_dir: the checkpoint root; defaults to the one :func:`load_state`
            uses.

    Raises:
        NotADirectoryError: ``ckpt_dir`` is left out and the default path
            exists but is not a directory.
    """
    root = _checkpoint_root("load") if ckpt_dir is None else os.fspath(ckpt_dir)
    if root is None:
        return None
    newest = _checkpoint.newest_checkpoint(root)
    return None if newest is None else newest[1]


# How often load_state re-lists the root when the file it chose vanished,
# which happens only when rank 0 prunes concurrently with a late load.
_LOAD_ATTEMPTS = 3


def load_state(state: State) -> bool:
    """Restore ``state`` from the newest checkpoint, if it is in one.

    Args:
        state: the state to load; its :meth:`State.load` is called with the
            file it was saved into.

    Returns:
        True if :meth:`State.load` was called; False when checkpointing is
        disabled, the checkpoint directory does not exist or holds no
        checkpoint, or the newest checkpoint has no data for this state.

    Raises:
        TypeError: ``state`` is not a :class:`State`.
        NotADirectoryError: the checkpoint path exists but is not a directory
            (a checkpoint *file* of another tool, or a typo); refused here
            rather than at the first save.
    """
    state = _check_state(state)
    root = _checkpoint_root("load")
    if root is None:
        return False
    filename = _checkpoint.state_filename(_registered_name(state))
    for _ in range(_LOAD_ATTEMPTS):
        newest = _checkpoint.newest_checkpoint(root)
        if newest is None:
            logger.debug("no checkpoint in %s to load %r from", root, _registered_name(state))
            return False
        key, directory = newest
        expected = env.num_restarts() - 1
        path = os.path.join(directory, filename)
        try:
            fileobj = open(path, "rb")
        except FileNotFoundError:
            if os.path.isdir(directory):
                # The usual reason is a state created after that checkpoint
                # (the tutorial's per-epoch Accumulator): nothing to warn about.
                logger.info(
                    "checkpoint %s has no data for state %r; starting it fresh",
                    directory,
                    _registered_name(state),
                )
                return False
            continue  # the whole checkpoint was pruned meanwhile: look again
        with fileobj:
            if key.restarts < expected:
                logger.warning(
                    "loading %r from %s although this is restart %d: the newest "
                    "checkpoint is older than the previous generation",
                    _registered_name(state),
                    directory,
                    env.num_restarts(),
                )
            state.load(fileobj)
        logger.info("loaded state %r from %s", _registered_name(state), directory)
        return True
    raise RuntimeError(
        f"checkpoints under {root} kept disappearing while loading state "
        f"{_registered_name(state)!r}; "
        "is another process saving into the same ADAPTDL_CHECKPOINT_PATH?"
    )
