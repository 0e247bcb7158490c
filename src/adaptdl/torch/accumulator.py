"""Sum statistics over all replicas and across checkpoint-restarts.

An :class:`Accumulator` is a dictionary with two modes:

* **accumulation mode** (the default): every replica adds its own updates
  (``acc["loss"] += x``, ``acc.update(...)``, ``acc -= {...}``); they are kept
  locally and reads behave as on an empty dict, because no replica knows the
  job-wide value yet;
* **synchronized mode** (``with acc.synchronized():``): the updates of all
  replicas are summed into the results, and inside the block the object is a
  plain dict with the same content everywhere.

Restarts: entering synchronized mode outside a data-loader loop is recorded
per epoch (and outside epochs), so when code runs again after a restart the
same synchronisations return the recorded results instead of counting the
repeated work twice; after the last of them that the checkpoint recorded, the
results are the checkpoint's again (they hold what synchronisations inside
loader loops folded in later, which the restart does not repeat). Updates
still pending when a checkpoint is taken are summed over the replicas and
saved with it; they are added back at the first
synchronisation after the restart. The exceptions are updates that the
restart makes again: those outside loader loops in the interrupted epoch,
those of code outside epoch loops after the restart's resume point (after
the last epoch loop entered, or before the first one), and those of a loader
loop outside epochs that does not resume (any but the one the checkpoint
interrupted runs whole again). They are not saved (the original library
counted them twice), and what a synchronisation inside a loader loop had
already folded of them into the results comes back out of the saved
results. Code before the epoch loop the checkpoint was taken in
(or after) also runs again, but as a dry run: entering that loop restores
the results and pending sums the checkpoint saved, which already hold that
code's work. Together with loaders resuming at the exact next sample, the
results of an interrupted job equal those of an uninterrupted one (updates
made by every replica are counted for the replicas that made them before the
checkpoint).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import pickle
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import IO, Any

from adaptdl import _procstate, checkpoint
from adaptdl.torch import _sync
from adaptdl.torch.data import _loop_key, _loop_resumes, _outside_loop, current_dataloader
from adaptdl.torch.epoch import (
    _bind_to_epoch,
    _epoch_loops_entered,
    _epoch_state_name,
    _on_loop_entry,
    _warn_if_outlived,
    current_epoch,
    finished_epochs,
)

__all__ = ["Accumulator"]

logger = logging.getLogger(__name__)


_Updates = tuple[dict[Any, Any], dict[Any, Any], dict[Any, Any]]

#: ``resume_key`` when there is nothing to resume (None means outside epochs).
_NO_RESUME = object()


def _add_each(a: _Updates, b: _Updates) -> _Updates:
    """Reduce function: key-wise sums of the matching dicts of two triples."""
    return _add_dicts(a[0], b[0]), _add_dicts(a[1], b[1]), _add_dicts(a[2], b[2])


def _add_dicts(a: dict[Any, Any], b: dict[Any, Any]) -> dict[Any, Any]:
    """Reduce function: key-wise sum (module level so it can be pickled)."""
    result = dict(a)
    for key, value in b.items():
        result[key] = result[key] + value if key in result else value
    return result


def _check_addable(
    state: _AccumulatorState,
    in_loops: dict[Any, Any],
    outside: dict[tuple[Any, Any], Any],
    looped: dict[tuple[Any, Any], Any],
) -> None:
    """Refuse updates that cannot be added to the values, keeping every other one.

    Checked before anything changes: the updates of the other keys are
    carried to the next synchronisation (as :meth:`_AccumulatorState.sync`
    carries them), so one bad value does not lose them all.

    Raises:
        TypeError: naming the key, the value and the update; that key's
            update is dropped.
    """
    pending: dict[Any, list[Any]] = {}
    for plain in (state.carried, in_loops):
        for key, value in plain.items():
            pending.setdefault(key, []).append(value)
    for tagged in (state.carried_outside, outside, state.carried_looped, looped):
        for (_, key), value in tagged.items():
            pending.setdefault(key, []).append(value)
    bad: dict[Any, str] = {}
    for key, values in pending.items():
        total = state.results.get(key, 0) if key in state.results else None
        try:
            for value in values:
                total = value if total is None else total + value
        except Exception as exc:  # noqa: BLE001 - any failure of user values
            current = state.results.get(key, "(none)")
            bad[key] = (
                f"Accumulator key {key!r}: cannot add the update {_describe(value)} to "
                f"{_describe(current)} ({type(exc).__name__}: {exc})"
            )
    if not bad:
        return

    def clean(updates: dict[Any, Any], tagged: bool) -> dict[Any, Any]:
        return {k: v for k, v in updates.items() if (k[1] if tagged else k) not in bad}

    state.carried = _add_dicts(clean(state.carried, False), clean(in_loops, False))
    state.carried_outside = _add_dicts(clean(state.carried_outside, True), clean(outside, True))
    state.carried_looped = _add_dicts(clean(state.carried_looped, True), clean(looped, True))
    raise TypeError(
        "; ".join(bad.values()) + "; that update was dropped, the other keys' updates are kept"
    )


def _describe(value: Any) -> str:
    """A value's type and, for arrays and tensors, shape, for messages."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__name__} of shape {tuple(shape)}"
    return f"{type(value).__name__} {value!r}"


def _untagged(tagged: dict[tuple[Any, Any], Any]) -> dict[Any, Any]:
    """Sum ``(tag, key)``-keyed updates by key."""
    result: dict[Any, Any] = {}
    for (_, key), value in tagged.items():
        result[key] = result[key] + value if key in result else value
    return result


def _fresh(delta: Any) -> Any:
    """``0 + delta``: a new object, so a later in-place change of the caller's does not leak in.

    ``acc[k] += v`` gets this from :class:`_Value`; ``update`` stored ``v``
    itself. Values that do not add to 0 (lists, say) are kept as they are.
    """
    try:
        return 0 + delta
    except TypeError:
        return delta


def _check_update(key: Any, delta: Any) -> None:
    """Refuse an update that cannot be summed across replicas, naming the key.

    Raises:
        TypeError: ``delta`` is None or text (summed, text would come back
            concatenated in rank order: not a statistic, and not what was meant).
    """
    if delta is None or isinstance(delta, (str, bytes, bytearray)):
        raise TypeError(
            f"Accumulator update of {key!r} with {type(delta).__name__} {delta!r}: "
            "updates are summed across replicas; use numbers, arrays or tensors "
            "(assign other values inside 'with accumulator.synchronized():')"
        )


class _Value:
    """What ``acc[key]`` returns in accumulation mode: records ``+=`` and ``-=``."""

    __slots__ = ("delta", "key")

    def __init__(self, key: Any) -> None:
        self.delta: Any = 0
        self.key = key

    def __iadd__(self, other: Any) -> _Value:
        self.delta = self._combined(other, 1)
        return self

    def __isub__(self, other: Any) -> _Value:
        self.delta = self._combined(other, -1)
        return self

    def _combined(self, other: Any, sign: int) -> Any:
        """``delta + other`` (or ``-``), refused by key like :meth:`Accumulator.update`."""
        _check_update(self.key, other)
        try:
            return self.delta + other if sign > 0 else self.delta - other
        except TypeError as exc:
            raise TypeError(
                f"Accumulator update of {self.key!r} with {type(other).__name__} {other!r}: {exc}"
            ) from None

    def __repr__(self) -> str:
        return "<pending Accumulator update; read values inside synchronized()>"


class _AccumulatorState(checkpoint.State):
    _adaptdl_internal = True  # forgotten in a forked test replica (_procstate)
    _adaptdl_owns_name = True  # a name checkpoint reserves for the library

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.results: dict[Any, Any] = {}
        # Pending local updates, made inside data-loader loops in epochs,
        # outside loops (keyed by (epoch, key), so that a checkpoint can tell
        # the interrupted epoch's updates from those of finished ones), and in
        # loops outside epochs (keyed by ((loader, loop), key): a checkpoint
        # keeps only those of a loop that resumes after the restart).
        self.updates: dict[Any, Any] = {}
        self.outside: dict[tuple[int, Any], Any] = {}
        self.looped: dict[tuple[tuple[str, tuple[int, int]], Any], Any] = {}
        # Results at each synchronisation outside loader loops, per epoch.
        self.history: dict[int | None, list[dict[Any, Any]]] = collections.defaultdict(list)
        # Job-wide sums of the updates pending at the last checkpoint.
        self.carried: dict[Any, Any] = {}
        # After a restart in (or after) an epoch loop: which loop's entry
        # restores ``snapshot``, the checkpoint's results and carried sums.
        self.reset_at: int | None = None
        self.snapshot: tuple[Any, ...] = ()
        self.saved_in: int | None | object = _NO_RESUME  # resume_key as loaded
        self.carried_outside: dict[tuple[int, Any], Any] = {}
        self.carried_looped: dict[tuple[tuple[str, tuple[int, int]], Any], Any] = {}
        # Updates of the two kinds above that a synchronisation inside a
        # loader loop folded into the results: ("outside" or "looped", tag,
        # key) -> sum. Outside-loop synchronisations are replayed instead.
        self.folded: dict[tuple[str, Any, Any], Any] = {}
        # After a restart: the epoch (None: outside epochs) the checkpoint was
        # taken in, and its results. Replaying that epoch's recorded
        # synchronisations shows the results of those moments; after the last
        # one the checkpoint's results, which hold the later work (such as a
        # synchronisation inside a loader loop) that the restart does not
        # make again, are current again.
        self.resume_key: int | None | object = _NO_RESUME
        self.resume_results: dict[Any, Any] = {}

    def take_pending(self) -> _Updates:
        """Sum every replica's pending updates (a collective) and clear them."""
        summed = _sync.allreduce((self.updates, self.outside, self.looped), _add_each)
        self.clear_pending()
        return summed

    def clear_pending(self) -> None:
        self.updates = {}
        self.outside = {}
        self.looped = {}

    def sync(self) -> None:
        summed = self.take_pending()
        self.carried = _add_dicts(self.carried, summed[0])
        self.carried_outside = _add_dicts(self.carried_outside, summed[1])
        self.carried_looped = _add_dicts(self.carried_looped, summed[2])

    def save(self, fileobj: IO[bytes]) -> None:
        if self.reset_at is not None:
            # A checkpoint during the dry run: nothing has happened since the
            # loaded checkpoint but work it already holds, so save that again.
            results, carried, looped = self.snapshot
            payload = (dict(self.history), results, carried, looped, self.reset_at, self.saved_in)
            pickle.dump(payload, fileobj)
            return
        finished = finished_epochs()
        entered = _epoch_loops_entered()
        # What the restart makes again is not saved: updates outside loader
        # loops in the interrupted epoch (its replay), and those of the code
        # outside epoch loops that runs after the restart's resume point (the
        # stretch after the last epoch loop entered, or before the first).
        # Code in earlier stretches runs again too, but only as a dry run that
        # the entry of the epoch loop undoes (see reset), so its updates are
        # saved like any finished work.

        def outside_kept(tag: int) -> bool:
            return tag < finished if tag >= 0 else -1 - tag < entered

        # Loops outside epochs: a loop that resumes keeps its updates, tagged,
        # so that a later checkpoint can drop them once that loop has finished.
        def looped_kept(tag: tuple[str, tuple[int, int]]) -> bool:
            return _loop_resumes(*tag) or -1 - tag[1][0] < entered

        kept = {pair: v for pair, v in self.carried_outside.items() if outside_kept(pair[0])}
        carried = _add_dicts(self.carried, _untagged(kept))
        looped = {pair: v for pair, v in self.carried_looped.items() if looped_kept(pair[0])}
        # Such updates that a synchronisation inside a loader loop already
        # folded into the results come back out of the saved results.
        taken_back: dict[tuple[tuple[str, Any], Any], Any] = {}
        for (kind, tag, key), value in list(self.folded.items()):
            if outside_kept(tag) if kind == "outside" else looped_kept(tag):
                if kind == "outside":
                    del self.folded[kind, tag, key]  # kept now, kept for good
            else:
                taken_back[(kind, tag), key] = -value
        results = _add_dicts(self.results, _untagged(taken_back))
        payload = (dict(self.history), results, carried, looped, entered, current_epoch())
        pickle.dump(payload, fileobj)

    def load(self, fileobj: IO[bytes]) -> None:
        payload = pickle.load(fileobj)  # noqa: S301 - our own checkpoint
        history, self.results, self.carried = payload[:3]
        # Older checkpoints hold three items (no loops outside epochs told
        # apart), four (no dry run to undo) or five (the epoch not recorded).
        self.carried_looped = dict(payload[3]) if len(payload) > 3 else {}
        entered = int(payload[4]) if len(payload) > 4 else 0
        self.saved_in = payload[5] if len(payload) > 5 else _NO_RESUME
        self.resume_key = self.saved_in
        self.resume_results = copy.deepcopy(self.results)
        self.history = collections.defaultdict(list, history)
        self.carried_outside = {}
        # The code before the epoch loop the checkpoint was taken in (or
        # after) runs again after the restart: its synchronisations replay
        # their recorded results and its updates were saved already, so
        # entering that loop restores the checkpoint's state (see reset).
        # An Accumulator made after that loop was entered (in the epoch's
        # body, or after the loop) has no dry run behind it: waiting for an
        # entry that had passed kept every later checkpoint at this one.
        self.reset_at = entered if entered > _epoch_loops_entered() else None
        self.snapshot = copy.deepcopy((self.results, self.carried, self.carried_looped))

    def reset(self, entered: int) -> None:
        """On entering epoch loop number ``entered``: undo the dry run before it, if any.

        Without this, a synchronisation replayed before the epoch loop left
        the results of that moment (losing the finished epochs' sums), and
        updates that an epoch's synchronisation had folded in before the
        checkpoint were counted again.
        """
        if self.reset_at != entered:
            return
        self.reset_at = None
        self.results, self.carried, self.carried_looped = copy.deepcopy(self.snapshot)
        self.carried_outside = {}
        self.folded = {}
        self.clear_pending()


class Accumulator(MutableMapping[Any, Any]):
    """A dict that sums updates over replicas and survives restarts.

    Example::

        acc = Accumulator()
        for epoch in remaining_epochs_until(10):
            for x, y in valid_loader:
                acc["loss_sum"] += loss_fn(model(x), y).item() * len(y)
                acc["total"] += len(y)
            with acc.synchronized():          # collective: all replicas
                print(acc["loss_sum"] / acc["total"])
                acc.clear()

    Args:
        *args, **kwargs: initial *results*, as for ``dict``; they are taken
            as already synchronized, so every replica should pass the same.

    Raises:
        RuntimeError: created while an AdaptDL data loader is being iterated.
    """

    _created: collections.Counter[int | None] = collections.Counter()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if current_dataloader() is not None:
            raise RuntimeError(
                "an Accumulator cannot be created while an AdaptDL data loader is being iterated"
            )
        try:
            # Before the checkpoint name is taken: a failure must not leave it
            # registered (saved in every checkpoint, shifting later names).
            initial = dict(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"Accumulator expects initial values as a mapping or (key, value) pairs, "
                f"got {args!r}: {exc}"
            ) from None
        epoch = current_epoch()
        count = Accumulator._created[epoch]
        Accumulator._created[epoch] += 1
        self._state = _AccumulatorState(_epoch_state_name("accumulator", epoch, count))
        _bind_to_epoch(self._state, epoch)
        self._created_in: int | None = epoch  # None once warned that it outlived it
        self._state.results = initial
        checkpoint.load_state(self._state)
        _on_loop_entry(self._state.reset)
        self._synchronized = 0
        self._sync_count: collections.Counter[int | None] = collections.Counter()

    # ------------------------------------------------------------ modes
    @contextlib.contextmanager
    def synchronized(self) -> Iterator[Accumulator]:
        """Sum all replicas' updates, then act as a plain dict inside the block.

        This is a collective: every replica must enter it at the same point.
        Nested use is allowed and does not synchronise again.
        """
        if _warn_if_outlived("an Accumulator", self._created_in):
            self._created_in = None
        if self._synchronized:
            self._synchronized += 1
            try:
                yield self
            finally:
                self._synchronized -= 1
            return
        state = self._state
        epoch = current_epoch()
        if epoch is not None:
            for old in [key for key in state.history if key is not None and key < epoch]:
                del state.history[old]
        in_loop = current_dataloader() is not None
        index = self._sync_count[epoch]
        recorded = state.history.get(epoch, [])
        resume = False
        if not in_loop and index < len(recorded):
            # Replaying an epoch interrupted by a restart: these updates were
            # already summed before the checkpoint.
            state.results = copy.deepcopy(recorded[index])
            state.clear_pending()
            self._sync_count[epoch] += 1
            resume = index == len(recorded) - 1 and epoch == state.resume_key
        else:
            in_loops, outside, looped = state.take_pending()
            _check_addable(state, in_loops, outside, looped)
            outside = _add_dicts(outside, state.carried_outside)
            looped = _add_dicts(looped, state.carried_looped)
            if in_loop:
                for kind, tagged in (("outside", outside), ("looped", looped)):
                    folded = {(kind, tag, key): value for (tag, key), value in tagged.items()}
                    state.folded = _add_dicts(state.folded, folded)
            summed = _add_dicts(_add_dicts(in_loops, _untagged(outside)), state.carried)
            summed = _add_dicts(summed, _untagged(looped))
            state.carried = {}
            state.carried_outside = {}
            state.carried_looped = {}
            state.results = _add_dicts(state.results, summed)
            if not in_loop:
                state.history[epoch].append(copy.deepcopy(state.results))
                self._sync_count[epoch] += 1
                # What loops folded of this stretch's updates outside loops
                # is in the recorded results now: a replay restores those and
                # drops the updates it makes again, so a checkpoint keeps it
                # (taken back, it was lost twice).
                tag = _loop_key()
                for entry in [e for e in state.folded if e[0] == "outside" and e[1] == tag]:
                    del state.folded[entry]
        self._synchronized = 1
        try:
            yield self
        finally:
            self._synchronized = 0
            if resume:
                state.results = state.resume_results
                state.resume_key, state.resume_results = _NO_RESUME, {}

    # ------------------------------------------------------------ updates
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Add updates to the values (``dict.update`` semantics, but additive)."""
        for key, value in dict(*args, **kwargs).items():
            self._apply(key, value)

    def subtract(self, *args: Any, **kwargs: Any) -> None:
        """Subtract updates from the values."""
        for key, value in dict(*args, **kwargs).items():
            _check_update(key, value)  # before negating: -"text" names nothing
            self._apply(key, -value)

    def _apply(self, key: Any, delta: Any) -> None:
        _check_update(key, delta)
        if self._synchronized:
            results = self._state.results
            results[key] = results[key] + delta if key in results else _fresh(delta)
        else:
            # Updates outside loader loops are re-made when an interrupted epoch
            # is replayed, and those in loops outside epochs when the loop runs
            # again, so they are kept apart (see _AccumulatorState.save).
            loop = _outside_loop()
            updates: dict[Any, Any]
            if loop is not None:
                updates, key = self._state.looped, (loop, key)
            elif current_dataloader() is not None:
                updates = self._state.updates
            else:
                # Tagged by epoch, or outside epochs by stretch (-1 - k after
                # the k-th epoch loop entered), as loader loops are.
                updates, key = self._state.outside, (_loop_key(), key)
            updates[key] = updates[key] + delta if key in updates else _fresh(delta)

    def __iadd__(self, other: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> Accumulator:
        self.update(other)
        return self

    def __isub__(self, other: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> Accumulator:
        self.subtract(other)
        return self

    # ------------------------------------------------------------ mapping protocol
    def __getitem__(self, key: Any) -> Any:
        if self._synchronized:
            return self._state.results[key]
        return _Value(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._synchronized:
            self._state.results[key] = value
            return
        if isinstance(value, _Value):
            self._apply(key, value.delta)
            return
        raise TypeError(
            f"Accumulator[{key!r}] = {value!r}: only += and -= are allowed in accumulation "
            "mode; assign values inside 'with accumulator.synchronized():'"
        )

    def __delitem__(self, key: Any) -> None:
        if not self._synchronized:
            raise TypeError(f"del Accumulator[{key!r}] is only allowed inside synchronized()")
        del self._state.results[key]

    # Reads in accumulation mode act on an empty dict (the job-wide values
    # are unknown); __getitem__ cannot, since it serves ``acc[key] += x``.
    def get(self, key: Any, default: Any = None) -> Any:
        if self._synchronized:
            return self._state.results.get(key, default)
        return default

    _MISSING: Any = object()

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        if self._synchronized:
            if default is Accumulator._MISSING:
                return self._state.results.pop(key)
            return self._state.results.pop(key, default)
        if default is Accumulator._MISSING:
            raise KeyError(key)
        return default

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if self._synchronized:
            return self._state.results.setdefault(key, default)
        raise TypeError(
            f"Accumulator.setdefault({key!r}, ...) is only allowed inside synchronized()"
        )

    def __iter__(self) -> Iterator[Any]:
        if self._synchronized:
            return iter(self._state.results)
        return iter(())

    def __len__(self) -> int:
        return len(self._state.results) if self._synchronized else 0

    def __contains__(self, key: object) -> bool:
        return self._synchronized > 0 and key in self._state.results

    def __repr__(self) -> str:
        if self._synchronized:
            return f"Accumulator({self._state.results!r})"
        state = self._state
        pending = len(state.updates) + len(state.outside) + len(state.looped)
        return f"Accumulator(<{pending} pending updates>)"


@_procstate.register_reset
def _forget_accumulators() -> None:
    """Forget the accumulators' per-epoch counters (a forked replica, or a test)."""
    Accumulator._created.clear()
