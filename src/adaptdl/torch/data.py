"""Elastic, restart-safe data loading with adaptive batch sizes.

:class:`AdaptiveDataLoader` replaces :class:`torch.utils.data.DataLoader`. Its
``batch_size`` is the *global* target batch size ``B0`` of the whole job; each
replica loads ``ceil(B0 / K)`` samples per step with ``K`` replicas, or, once
:meth:`~AdaptiveDataLoaderMixin.autoscale_batch_size` is enabled, whatever
per-replica batch and gradient-accumulation steps the fitted goodput model
says train fastest.

Positions are tracked globally: after each step the loader's
``current_index`` advances by the number of samples all replicas consumed
together, and that index is checkpointed. The sample order of a pass is a
permutation that depends only on the epoch and the pass (never on the number
of replicas, nor on Python's hash seed), and replica ``r`` of ``K`` takes every
``K``-th element from the current index. A job restarted with a different
number of replicas therefore resumes at exactly the next unseen sample. When
the samples left in the pass do not divide among the ``K`` replicas, the
last step repeats a few of them (fewer than ``K``) so that every replica
takes the same number, as without a restart: a restart mid-pass with another
``K`` can leave a remainder that the uninterrupted run did not have.

About every :data:`AGREE_INTERVAL` seconds (every ``k`` steps, with ``k``
chosen by rank 0 from the measured step time and shipped with each agreement)
every replica folds its pending requests (signals, checkpoint requests) into
one asynchronous collective, together with rank 0's batch-size decision, so
all replicas stop, checkpoint or switch batch size at the same step without
an extra blocking round trip, and without paying for a collective each step.
An autoscaled loop that reached its progress target ends after the step
during which the next agreement runs: one to ``k`` steps later (rank 0
shortens ``k`` as the target nears, so usually one step). In epoch loops the
targets are absolute (``N * (epoch + 1) / B0`` scale-invariant iterations),
so the overshoot of one epoch shortens the next instead of adding up.

Gradient accumulation never spans two loops: when a training loop ends (its
last pass finishes, the user breaks out of it, or an exception leaves it) in
the middle of an accumulation, the gradients of that incomplete step are
discarded, so the next loop (the next epoch) starts from clean gradients and
its first optimizer step averages only its own micro-batches. The same
happens when the batch size changes at the start of a pass. Under
autoscaling, the only case where accumulation is used, a loop lasts until a
given statistical progress is made, and discarded micro-batches never made
any, so no progress is lost; and a checkpoint-restart, which cannot keep
partial gradients, resumes exactly like an uninterrupted run.

Loops outside :func:`~adaptdl.torch.epoch.remaining_epochs_until` are never
skipped after a restart, since the code around them runs again. A checkpoint
taken in one of them resumes that loop only: loops before the first epoch loop
and loops after it are counted apart, so an evaluation pass before training
runs whole again and the interrupted pass after it continues where it stopped.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import pickle
import random
import time
import weakref
from collections.abc import Callable, Iterator, Sized
from typing import IO, Any, ClassVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from adaptdl import _procstate, checkpoint, env
from adaptdl._goodput import MAX_BATCH_SIZE
from adaptdl.torch import _metrics, _signal, _sync
from adaptdl.torch._listeners import WeakListeners
from adaptdl.torch.epoch import (
    _bind_to_epoch,
    _epoch_loops_entered,
    _epoch_state_name,
    _warn_if_outlived,
    current_epoch,
)

__all__ = [
    "AdaptiveDataLoader",
    "AdaptiveDataLoaderHelper",
    "AdaptiveDataLoaderMixin",
    "ElasticSampler",
    "current_dataloader",
]

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1

# Bit that rank 0 adds to the agreement message when an autoscaled loop has made
# the progress of one pass at the initial batch size (never set by signals).
_LOOP_DONE = 1 << 8

SPEEDUP_THRESHOLD = 1.05
"""A new batch size is adopted only if it promises this much more goodput.

Switching has a cost (a restarted input pipeline, a learning-rate schedule
that sees a new scale), so small predicted gains, which are often just noise in
the fitted model, are ignored.
"""


def _mix64(value: int) -> int:
    """A fixed 64-bit integer mixer (the splitmix64 finaliser)."""
    value &= _MASK64
    value ^= value >> 30
    value = (value * 0xBF58476D1CE4E5B9) & _MASK64
    value ^= value >> 27
    value = (value * 0x94D049BB133111EB) & _MASK64
    value ^= value >> 31
    return value


def shuffle_seed(epoch: int, cycle: int) -> int:
    """The seed of the permutation for pass ``cycle`` of ``epoch``.

    Derived with integer arithmetic only, so it is the same in every process,
    Python version and hash seed (the original used ``hash((epoch, cycle))``).
    """
    value = _mix64(epoch * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019)
    return _mix64(value ^ (cycle * 0xD1B54A32D192ED03)) & ((1 << 63) - 1)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


class _BoundTypeError(TypeError, ValueError):
    """A batch-size bound of the wrong type: ``except ValueError`` catches it too."""


class ElasticSampler(Sampler[int]):
    """Partitions a dataset across replicas and resumes from any global index.

    Iteration yields this replica's share of the samples from the index set
    with :meth:`set_epoch` to the end of that pass: the elements
    ``perm[base + rank :: K]`` of the pass's permutation, where
    ``base = index % len(dataset)``. Replicas with one sample fewer than rank 0
    repeat rank 0's last sample, so that every replica takes the same number
    of steps (unequal step counts would deadlock the gradient all-reduce).

    The number of replicas and this replica's rank are read from the
    environment whenever they are needed, so a loader created before
    :func:`~adaptdl.torch.init_process_group` (as the tutorial does) follows
    the topology that call sets. Assigning ``rank`` or ``num_replicas`` fixes
    them instead (as tests of a partition do).

    Args:
        dataset: the dataset to sample from; only its length is used.
        shuffle: whether each pass uses a fresh permutation (deterministic in
            the epoch and the pass number) instead of the natural order.

    Raises:
        TypeError: ``dataset`` has no length or ``shuffle`` is not a bool.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset must have a length, got {type(dataset).__name__}")
        if not isinstance(shuffle, bool | np.bool_):
            raise TypeError(f"shuffle must be a bool, got {shuffle!r}")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.index = 0
        self._rank: int | None = None
        self._num_replicas: int | None = None

    @property
    def rank(self) -> int:
        """This replica's rank: ``ADAPTDL_REPLICA_RANK`` unless assigned."""
        if self._rank is not None:
            return self._rank
        return env.replica_rank(self.num_replicas)

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = _check_int("rank", value, 0)

    @property
    def num_replicas(self) -> int:
        """The job's replica count: ``ADAPTDL_NUM_REPLICAS`` unless assigned."""
        return env.num_replicas() if self._num_replicas is None else self._num_replicas

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._num_replicas = _check_int("num_replicas", value, 1)

    def set_epoch(self, epoch: int, index: int = 0) -> None:
        """Choose the epoch whose order to follow and the global index to start at.

        Args:
            epoch: the epoch; different epochs give different permutations.
            index: the global position (over all replicas and passes) to
                start from, e.g. the saved position after a restart.
                ``index // len(dataset)`` selects the pass.

        Raises:
            TypeError, ValueError: a value is not a non-negative int.
        """
        epoch = _check_int("epoch", epoch, 0)
        self.index = _check_int("index", index, 0)
        self.epoch = epoch

    def _permutation(self, size: int) -> list[int]:
        if not self.shuffle:
            return list(range(size))
        generator = torch.Generator()
        generator.manual_seed(shuffle_seed(self.epoch, self.index // size))
        perm: list[int] = torch.randperm(size, generator=generator).tolist()
        return perm

    def __iter__(self) -> Iterator[int]:
        size = len(self.dataset)
        if size == 0:
            return iter(())
        perm = self._permutation(size)
        base = self.index % size
        replicas, rank = self.num_replicas, self.rank
        if rank >= replicas:
            raise ValueError(f"rank={rank} must be below num_replicas={replicas}")
        indices = perm[base + rank :: replicas]
        length = math.ceil((size - base) / replicas)
        if len(indices) < length:
            # Repeat rank 0's last sample: in this stretch, and the same one
            # whichever step a restart at this replica count resumed from.
            indices.append(perm[base + replicas * ((size - base) // replicas)])
        return iter(indices)

    def __len__(self) -> int:
        size = len(self.dataset)
        if size == 0:
            return 0
        base = self.index % size
        return math.ceil((size - base) / self.num_replicas)


# Called (bound methods, held weakly) when the training loader abandons an
# incomplete gradient accumulation; AdaptiveDataParallel registers itself.
_discard_listeners = WeakListeners()


def _add_discard_listener(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever the training loader abandons an accumulation.

    Args:
        callback: a bound method (held through a weak reference, so the
            registration does not keep its object alive).

    Raises:
        TypeError: ``callback`` is not a bound method.
    """
    _discard_listeners.add(callback)


def current_dataloader() -> AdaptiveDataLoaderHelper | None:
    """The helper of the AdaptDL data loader being iterated right now, or None."""
    return AdaptiveDataLoaderHelper._current


def _outside_loop() -> tuple[str, tuple[int, int]] | None:
    """The loader name and ``(key, position)`` of a loop outside epochs being iterated.

    None when no loader is being iterated or the loop is in an epoch.
    """
    helper = AdaptiveDataLoaderHelper._current
    loop = None if helper is None else helper._state.loop
    if helper is None or loop is None or loop[0] >= 0:
        return None
    return helper._state.name, loop


def _loop_key() -> int:
    """Which loops a loop now started counts among: the epoch, or ``-1 - k`` outside.

    ``k`` is the number of epoch loops entered so far, so the loops before the
    first epoch loop, and those after it, are counted (and resumed) apart.
    """
    epoch = current_epoch()
    return epoch if epoch is not None else -1 - _epoch_loops_entered()


#: Every loader's state by checkpoint name, so that an Accumulator can ask
#: whether a loop outside epochs will resume after a restart.
_LOADER_STATES: weakref.WeakValueDictionary[str, _LoaderState] = weakref.WeakValueDictionary()


def _loop_resumes(loader: str, loop: tuple[int, int]) -> bool:
    """Whether a checkpoint taken now resumes ``loop`` of the loader named ``loader``.

    Only a loop interrupted mid-way resumes (now, or by an earlier checkpoint
    and not yet reached again); any other loop outside epochs runs whole
    again after the restart.
    """
    state = _LOADER_STATES.get(loader)
    return state is not None and state.resumes(loop)


class _LoaderState(checkpoint.State):
    """Position and batch-size decision of one loader, saved with each checkpoint."""

    _adaptdl_internal = True  # forgotten in a forked test replica (_procstate)
    _adaptdl_owns_name = True  # a name checkpoint reserves for the library

    def __init__(self, name: str) -> None:
        super().__init__(name)
        _LOADER_STATES[name] = self
        self.current_index = 0
        self.end_index = 0
        # Keyed by _loop_key(): the epoch, or -1 - k for the stretch of code
        # after the k-th epoch loop.
        self.last_position: dict[int, int] = {}
        self.local_bsz = 0
        self.accum_steps = 0
        self.num_replicas = 0
        # The loop being iterated, as (key, position), with its shuffle seed
        # and absolute progress target when they cannot be derived from the
        # epoch (a loop outside epochs: the target is relative to its start).
        self.loop: tuple[int, int] | None = None
        self.seed: int | None = None
        self.target: float | None = None
        # Loops interrupted by a checkpoint that this process has not reached
        # again yet: (key, position) -> {"index", "end", "seed", "target"}.
        self.resume: dict[tuple[int, int], dict[str, Any]] = {}
        # A mid-loop position from a checkpoint older than ``resume``: it
        # belongs to the first loop this loader does not skip.
        self.legacy: dict[str, Any] | None = None

    def resumes(self, loop: tuple[int, int]) -> bool:
        """Whether a checkpoint taken now makes ``loop`` resume at its position."""
        return (loop == self.loop and self.current_index > 0) or loop in self.resume

    def save(self, fileobj: IO[bytes]) -> None:
        resume = dict(self.resume)
        if self.loop is not None and self.current_index > 0:
            resume[self.loop] = {
                "index": self.current_index,
                "end": self.end_index,
                "seed": self.seed,
                "target": self.target,
            }
        legacy = self.legacy or {"index": 0, "end": 0}
        pickle.dump(
            {
                "current_index": legacy["index"],
                "end_index": legacy["end"],
                "legacy_seed": legacy.get("seed"),
                "resume": resume,
                "last_position": dict(self.last_position),
                "local_bsz": self.local_bsz,
                "accum_steps": self.accum_steps,
                "num_replicas": self.num_replicas,
            },
            fileobj,
        )

    def load(self, fileobj: IO[bytes]) -> None:
        payload = pickle.load(fileobj)  # noqa: S301 - our own checkpoint
        self.resume = {
            (int(key), int(position)): dict(entry)
            for (key, position), entry in payload.get("resume", {}).items()
        }
        # Checkpoints before the resume map keyed loops outside epochs by None
        # and seeded such a loop's shuffle with their running count.
        outside = payload["last_position"].get(None, -1)
        self.last_position = {
            -1 if key is None else int(key): int(position)
            for key, position in payload["last_position"].items()
        }
        index, end = int(payload["current_index"]), int(payload["end_index"])
        seed = payload["legacy_seed"] if "resume" in payload else outside + 1
        self.legacy = {"index": index, "end": end, "seed": seed} if index > 0 else None
        self.local_bsz = int(payload.get("local_bsz", 0))
        self.accum_steps = int(payload.get("accum_steps", 0))
        self.num_replicas = int(payload.get("num_replicas", 0))


_StepMessage = tuple[int, tuple[int, int] | None, int | None]


def _combine_step(a: _StepMessage, b: _StepMessage) -> _StepMessage:
    """Fold agreement messages: OR the request bits, keep rank 0's proposal and interval."""
    return (
        a[0] | b[0],
        a[1] if a[1] is not None else b[1],
        a[2] if a[2] is not None else b[2],
    )


AGREE_INTERVAL = 0.1
"""Target seconds between two agreement collectives of the data loader.

Replicas must agree on signals, checkpoint requests and batch-size changes,
which costs one small collective (a network round trip, plus a wake-up of the
reducer's threads). Doing it on every step added about 1 ms to a 7.6 ms step
on two CPU replicas; once every ~100 ms keeps the reaction to SIGTERM
imperceptible (a tenth of a second) while making the cost negligible. Rank 0 turns this into a
number of steps from the step times it measured and sends it along with each
agreement, so every replica knows the next agreement step.
"""

MAX_AGREE_STEPS = 200
"""Upper bound on the steps between agreements (for extremely fast steps)."""


class AdaptiveDataLoaderHelper:
    """The elastic machinery shared by every AdaptDL loader.

    It owns the checkpointed position of the loader, the batch-size decision,
    and the per-step protocol (profiling, agreement on requests and batch
    sizes). :class:`AdaptiveDataLoader` and
    :class:`~adaptdl.torch.iterator.AdaptiveBPTTIterator` drive it;
    :class:`~adaptdl.torch.parallel.AdaptiveDataParallel` reads it through
    :func:`current_dataloader`.

    Args:
        batch_size: the global target batch size ``B0``.

    Raises:
        TypeError, ValueError: ``batch_size`` is not a positive int.
        RuntimeError: created while another loader is being iterated (its
            checkpoint name would then depend on timing).
    """

    # Loops started per epoch, over all loaders; used to skip finished loops.
    _position: ClassVar[collections.Counter[int]] = collections.Counter()
    # Loaders created per epoch, so that each gets a stable, unique state name.
    _created: ClassVar[collections.Counter[int | None]] = collections.Counter()
    _training: ClassVar[AdaptiveDataLoaderHelper | None] = None
    _current: ClassVar[AdaptiveDataLoaderHelper | None] = None

    def __init__(self, batch_size: int = 1) -> None:
        self._batch_size = _check_int("batch_size", batch_size, 1)
        if AdaptiveDataLoaderHelper._current is not None:
            raise RuntimeError(
                "an AdaptDL data loader cannot be created while another one is being iterated"
            )
        self._max_batch_size: int | None = None
        self._local_bsz_bounds: tuple[int | None, int | None] | None = None
        self._gradient_accumulation = False
        epoch = current_epoch()
        count = AdaptiveDataLoaderHelper._created[epoch]
        AdaptiveDataLoaderHelper._created[epoch] += 1
        self._state = _LoaderState(_epoch_state_name("dataloader", epoch, count))
        self._created_in: int | None = epoch  # None once warned that it outlived it
        # This loader's loops outside epochs, per _loop_key().
        self._outside: collections.Counter[int] = collections.Counter()
        _bind_to_epoch(self._state, epoch)
        checkpoint.load_state(self._state)
        self._accum_count = 0
        self._future: _sync.Resolvable | None = None
        self._last_decision = time.monotonic()
        # Agreement schedule (see AGREE_INTERVAL): steps left until the next
        # agreement collective, identical on every replica because the
        # interval travels with each agreement. A fresh process agrees on
        # its first step.
        self._agree_countdown = 1
        # This process's rank never changes once the job runs (a rescale
        # restarts it); reading it from the environment at every agreement
        # cost ~0.1 ms. Read at the first agreement, not here: a loader may be
        # created before init_process_group sets the rank.
        self._rank0: bool | None = None
        # Rank 0 only: when the last agreement started and steps since then.
        self._agree_clock: float | None = None
        self._agree_steps = 0
        self._agree_progress: float | None = None
        # Loaders that can change the batch size in the middle of a pass.
        self._midpass_decisions = True
        # Progress (scale-invariant steps) at which an autoscaled loop ends.
        self._progress_target: float | None = None
        # Samples in one pass, once a loop has started.
        self._dataset_size: int | None = None

    # ------------------------------------------------------------ properties
    @property
    def batch_size(self) -> int:
        """The global target batch size ``B0`` given by the user."""
        return self._batch_size

    @property
    def max_batch_size(self) -> int | None:
        """The largest global batch size autoscaling may use; None until it is enabled."""
        return self._max_batch_size

    @property
    def local_bsz_bounds(self) -> tuple[int | None, int | None] | None:
        """``(min, max)`` per-replica batch size allowed by autoscaling, or None."""
        return self._local_bsz_bounds

    @property
    def gradient_accumulation(self) -> bool:
        """Whether autoscaling may use gradient accumulation."""
        return self._gradient_accumulation

    @property
    def autoscaling(self) -> bool:
        """Whether the batch size may grow beyond ``B0``."""
        return self._max_batch_size is not None and self._max_batch_size > self._batch_size

    @property
    def current_index(self) -> int | None:
        """Global position (samples over all replicas and passes) in the current loop.

        None while this loader is not being iterated.
        """
        if AdaptiveDataLoaderHelper._current is not self:
            return None
        return self._state.current_index

    @current_index.setter
    def current_index(self, index: int) -> None:
        if AdaptiveDataLoaderHelper._current is not self:
            raise RuntimeError("current_index can only be set while this loader is iterated")
        self._state.current_index = _check_int("current_index", index, 0)

    @property
    def end_index(self) -> int:
        """Global position at which the current pass ends."""
        return self._state.end_index

    @end_index.setter
    def end_index(self, index: int) -> None:
        if AdaptiveDataLoaderHelper._current is not self:
            raise RuntimeError("end_index can only be set while this loader is iterated")
        self._state.end_index = _check_int("end_index", index, 0)

    @property
    def current_local_bsz(self) -> int:
        """Per-replica batch size of each (micro-)step, as last decided."""
        return self._state.local_bsz

    @property
    def accumulation_steps(self) -> int:
        """Extra micro-batches accumulated before each optimizer step."""
        return self._state.accum_steps

    @property
    def current_batch_size(self) -> int:
        """Global batch size per optimizer step: local * (accumulation + 1) * replicas."""
        return self.current_local_bsz * (self.accumulation_steps + 1) * env.num_replicas()

    @property
    def training(self) -> bool:
        """Whether this is the training loader (the first one that backpropagated)."""
        return AdaptiveDataLoaderHelper._training is self

    def is_accum_step(self) -> bool:
        """True if the current step only accumulates gradients (no optimizer step)."""
        return self._accum_count < self.accumulation_steps

    def is_optim_step(self) -> bool:
        """True if the current step ends with an optimizer step."""
        return not self.is_accum_step()

    # ------------------------------------------------------------ configuration
    def train(self) -> None:
        """Mark this loader as the training loader, unless another one already is."""
        if AdaptiveDataLoaderHelper._training is None:
            AdaptiveDataLoaderHelper._training = self
        if self.training:
            _metrics.set_batch_size(
                self._batch_size,
                self._max_batch_size,
                self._local_bsz_bounds,
                self._gradient_accumulation,
            )
            if self._dataset_size is not None:
                _metrics.set_dataset_size(self._dataset_size)

    def autoscale_batch_size(
        self,
        max_batch_size: int,
        local_bsz_bounds: tuple[int | None, int | None] | None = None,
        gradient_accumulation: bool = False,
    ) -> None:
        """Let the batch size grow up to ``max_batch_size`` when that trains faster.

        Args:
            max_batch_size: the largest global batch size to use; at least
                ``batch_size``.
            local_bsz_bounds: ``(min, max)`` per-replica batch size, either
                may be None; the bounds must admit ``batch_size`` itself.
                Typically the upper bound is what fits in memory.
            gradient_accumulation: whether batches larger than the replicas
                can hold at once may be made of several micro-batches. The
                micro-batches of a step that a loop does not complete (it
                ends, or is left, in the middle) are discarded.

        Raises:
            TypeError: an argument has the wrong type (for the batch sizes,
                also a ValueError, which the original library raised).
            ValueError: ``max_batch_size < batch_size`` (or above 2**53), or
                the bounds are invalid or exclude ``batch_size``.
        """
        try:
            max_batch_size, bounds = self._check_bounds(max_batch_size, local_bsz_bounds)
        except TypeError as exc:
            # The original library documented (and raised) ValueError for
            # any bad bound; scripts that catch it keep working.
            raise _BoundTypeError(str(exc)) from None
        if not isinstance(gradient_accumulation, bool | np.bool_):
            raise TypeError(f"gradient_accumulation must be a bool, got {gradient_accumulation!r}")
        self._max_batch_size = max_batch_size
        self._local_bsz_bounds = bounds
        self._gradient_accumulation = bool(gradient_accumulation)
        self.train()

    def _check_bounds(
        self, max_batch_size: object, local_bsz_bounds: tuple[object, object] | None
    ) -> tuple[int, tuple[int | None, int | None] | None]:
        """``autoscale_batch_size``'s batch-size arguments, checked."""
        max_batch_size = _check_int("max_batch_size", max_batch_size, 1)
        if not self._batch_size <= max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(
                f"max_batch_size={max_batch_size} must be >= batch_size={self._batch_size} "
                "and <= 2**53"
            )
        bounds: tuple[int | None, int | None] | None = None
        if local_bsz_bounds is not None:
            try:
                lo_arg, hi_arg = local_bsz_bounds
            except (TypeError, ValueError):
                raise TypeError(
                    f"local_bsz_bounds must be a (min, max) pair, got {local_bsz_bounds!r}"
                ) from None
            lo = None if lo_arg is None else _check_int("local_bsz_bounds[0]", lo_arg, 1)
            hi = None if hi_arg is None else _check_int("local_bsz_bounds[1]", hi_arg, 1)
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"local_bsz_bounds={local_bsz_bounds!r}: min exceeds max")
            if hi is not None and hi > MAX_BATCH_SIZE:
                raise ValueError(f"local_bsz_bounds={local_bsz_bounds!r}: max exceeds 2**53")
            if (lo is not None and lo > self._batch_size) or (
                hi is not None and hi < self._batch_size
            ):
                raise ValueError(
                    f"local_bsz_bounds={local_bsz_bounds!r} must contain "
                    f"batch_size={self._batch_size}"
                )
            bounds = (lo, hi)
        return max_batch_size, bounds

    # ------------------------------------------------------------ decisions
    def _default_decision(self) -> tuple[int, int]:
        return math.ceil(self._batch_size / env.num_replicas()), 0

    def _decide(self) -> tuple[int, int]:
        """Rank 0's choice of ``(local_bsz, accumulation_steps)``."""
        num_replicas = env.num_replicas()
        current = (self._state.local_bsz, self._state.accum_steps)
        have_current = current[0] > 0 and self._state.num_replicas == num_replicas
        if not (self.autoscaling and self.training):
            return self._default_decision()
        goodput_fn = _metrics.get_goodput_fn()
        if goodput_fn is None:
            return current if have_current else self._default_decision()
        num_nodes = env.num_nodes()
        _, local_bsz, accum_steps = goodput_fn.optimize(
            num_nodes,
            num_replicas,
            max_batch_size=self._max_batch_size,
            atomic_bsz_range=self._local_bsz_bounds,
            accumulation=self._gradient_accumulation,
        )
        best = (int(local_bsz), int(accum_steps))
        if have_current and best != current:
            try:
                now = goodput_fn.evaluate(num_nodes, num_replicas, *current)
                new = goodput_fn.evaluate(num_nodes, num_replicas, *best)
            except ValueError:  # e.g. the current batch is below B0 after a config change
                return best
            if not new > SPEEDUP_THRESHOLD * now:
                return current
        return best

    def _adopt(self, decision: tuple[int, int]) -> None:
        local_bsz, accum_steps = decision
        changed = (local_bsz, accum_steps) != (self._state.local_bsz, self._state.accum_steps)
        self._state.local_bsz = int(local_bsz)
        self._state.accum_steps = int(accum_steps)
        self._state.num_replicas = env.num_replicas()
        self._last_decision = time.monotonic()
        if changed:
            # Never mix micro-batches of two sizes in one step.
            self._discard_incomplete_accumulation()
            logger.info(
                "batch size: %d per replica x %d micro-batches x %d replicas = %d",
                self._state.local_bsz,
                self._state.accum_steps + 1,
                self._state.num_replicas,
                self.current_batch_size,
            )

    def _discard_incomplete_accumulation(self) -> None:
        """Restart the accumulation cycle and drop the gradients of an unfinished one.

        The models (every registered listener) zero their gradients if an
        accumulation is in progress, so no micro-batch of this cycle reaches a
        later optimizer step. Every replica counts the same steps, so all of
        them discard alike (no collective is needed).
        """
        if self._accum_count > 0:
            logger.debug("discarding an incomplete gradient accumulation")
        self._accum_count = 0
        if not self.training:
            return
        _discard_listeners.call()

    def _sync_local_bsz(self) -> int:
        """Decide the batch size on rank 0 and adopt it everywhere (collective)."""
        proposal = self._decide() if env.replica_rank() == 0 else None
        decision = _sync.broadcast(proposal)
        if decision is None:  # pragma: no cover - rank 0 always proposes
            raise RuntimeError("rank 0 did not send a batch-size decision")
        self._adopt(decision)
        return self._state.local_bsz

    # ------------------------------------------------------------ per-step protocol
    @contextlib.contextmanager
    def profile(self, commit: bool) -> Iterator[None]:
        """Wrap one step of a custom loader: time it and act on agreed requests.

        The agreement (request bits, rank 0's batch-size proposal and the
        number of steps until the next agreement) runs only every few steps,
        about every :data:`AGREE_INTERVAL` seconds, and only on a step that
        ends with an optimizer step. Every replica counts the same steps and
        receives the same interval, so all of them stop, checkpoint or switch
        batch size at the same step, just as with a per-step agreement.

        The agreement is resolved when the block exits: a checkpoint request
        or a signal checkpoints there (and exits, if asked to), and a new
        batch size is adopted (read :attr:`current_local_bsz` for the next
        step). Advance :attr:`current_index` *inside* the block, so that a
        checkpoint taken at its exit resumes after this step.

        Args:
            commit: whether the step time goes into the performance profile
                (training steps only; the first step of each pass is excluded
                because it includes warm-up such as starting data workers).
        """
        self._step_begin(commit)
        yield
        self._step_end(commit)
        self._finish_step()

    def _step_begin(self, commit: bool) -> None:
        """The part of :meth:`profile` before the step (the loaders call it directly)."""
        if self._agree_countdown <= 1 and self.is_optim_step():
            self._start_agreement(commit)
        else:
            self._agree_countdown -= 1
            self._agree_steps += 1
        if commit:
            _metrics.profile_step_start(self.current_local_bsz)

    def _step_end(self, commit: bool) -> None:
        """The part of :meth:`profile` after the step."""
        state = self._state
        if commit:
            _metrics.profile_step_commit(self._accum_count < state.accum_steps)
        self._accum_count = 0 if self._accum_count >= state.accum_steps else self._accum_count + 1

    def _start_agreement(self, commit: bool) -> None:
        """Launch the agreement collective of this step (resolved by :meth:`_finish_step`)."""
        proposal: tuple[int, int] | None = None
        interval: int | None = None
        if self._rank0 is None:
            self._rank0 = env.replica_rank() == 0
        if self._rank0:
            now = time.perf_counter()
            steps = self._agree_steps + 1
            if self._agree_clock is not None:
                per_step = max((now - self._agree_clock) / steps, 1e-9)
                interval = max(1, min(MAX_AGREE_STEPS, int(AGREE_INTERVAL / per_step)))
            self._agree_clock = now
            interval = self._cap_by_progress(interval, steps)
            if (
                self._midpass_decisions
                and commit
                and self.autoscaling
                and time.monotonic() - self._last_decision >= env.decide_interval()
            ):
                self._last_decision = time.monotonic()
                choice = self._decide()
                if choice != (self._state.local_bsz, self._state.accum_steps):
                    proposal = choice
        self._agree_steps = 0
        flags = _signal.get_flags()
        target = self._progress_target
        if (
            target is not None
            and self._rank0
            and self.autoscaling
            and self.training
            and _metrics.get_progress() >= target
        ):
            flags |= _LOOP_DONE
        self._future = _sync.allreduce_async((flags, proposal, interval), _combine_step)

    def _cap_by_progress(self, interval: int | None, steps: int) -> int | None:
        """Shorten the agreement interval so an autoscaled loop ends on time (rank 0).

        The end of an autoscaled loop is only seen at an agreement. With fast
        steps the interval can reach :data:`MAX_AGREE_STEPS`, so without a cap
        a loop would overshoot its progress target by up to that many steps.
        The cap is the number of steps left at the recent progress per step.
        """
        target = self._progress_target
        progress = _metrics.get_progress()
        last, self._agree_progress = self._agree_progress, progress
        if interval is None or target is None or last is None or not self.autoscaling:
            return interval
        per_step = (progress - last) / steps
        if per_step <= 0:
            return interval
        return max(1, min(interval, math.ceil((target - progress) / per_step)))

    def _finish_step(self) -> str:
        """Resolve the step's agreement, if one ran, and say how the loop goes on.

        Called by the loaders after they advanced :attr:`current_index`, so a
        checkpoint taken here resumes right after this step. A changed batch
        size is adopted only after an optimizer step (never in the middle of
        an accumulation), and identically on every replica.

        Returns:
            ``"done"`` when an autoscaled loop has made enough progress (seen
            at the first agreement after that point),
            ``"switch"`` when the batch size changed (the pass continues with
            the new size), else ``"continue"``.
        """
        future, self._future = self._future, None
        if future is None:
            return "continue"
        flags, proposal, interval = future.result()
        self._agree_countdown = 1 if interval is None else int(interval)
        _sync.handle_requests(flags)
        if flags & _LOOP_DONE and self._accum_count == 0:
            return "done"
        if proposal is not None and self._accum_count == 0:
            if tuple(proposal) != (self._state.local_bsz, self._state.accum_steps):
                self._adopt(tuple(proposal))
                return "switch"
        return "continue"

    def set_progress_target(self, dataset_size: int) -> None:
        """Fix the progress at which the current autoscaled loop ends.

        One loop makes the statistical progress of one pass at ``B0``: the
        target is cumulative per epoch (so it survives restarts), or relative
        to now outside an epoch loop.
        """
        self._dataset_size = dataset_size
        epoch = current_epoch()
        if self.training:
            _metrics.set_dataset_size(dataset_size)
            if epoch and self._state.current_index == 0:
                # A fresh pass at the start of epoch ``epoch``: the progress so
                # far is what the finished epochs made.
                _metrics.set_epoch_progress(_metrics.get_progress() / epoch)
        if epoch is None:
            # Kept with a checkpoint, so a resumed loop ends where it would have.
            if self._state.target is None:
                self._state.target = _metrics.get_progress() + dataset_size / self._batch_size
            self._progress_target = self._state.target
        else:
            self._progress_target = dataset_size * (epoch + 1) / self._batch_size

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Mark this loader as the one being iterated for the duration of a loop.

        Raises:
            RuntimeError: another AdaptDL loader is being iterated already.
        """
        if AdaptiveDataLoaderHelper._current is not None:
            raise RuntimeError(
                "an AdaptDL data loader is already being iterated; finish (or break out "
                "of) that loop before starting another"
            )
        _signal.install_handlers()
        if _warn_if_outlived("an AdaptiveDataLoader", self._created_in):
            self._created_in = None
        state = self._state
        key = _loop_key()
        if key >= 0:
            position = AdaptiveDataLoaderHelper._position[key]
        else:
            # Outside remaining_epochs_until no finished loop is skipped after
            # a restart, so this loader continues its own loop count from the
            # checkpoint: the loop a checkpoint interrupted gets its position
            # (and shuffle) back even if another loader ran first.
            position = max(self._outside[key], state.last_position.get(key, -1) + 1)
        loop = (key, position)
        # Only the loop a checkpoint interrupted continues at its position.
        saved = state.resume.pop(loop, None)
        if saved is None and state.legacy is not None and not self._finished(loop):
            saved, state.legacy = state.legacy, None
        saved = saved or {}
        state.current_index = int(saved.get("index", 0))
        state.end_index = int(saved.get("end", 0))
        state.seed = saved.get("seed") if key < 0 else None
        state.target = saved.get("target") if key < 0 else None
        state.loop = loop
        AdaptiveDataLoaderHelper._current = self
        try:
            yield
        finally:
            state.loop = state.seed = state.target = None
            state.current_index = 0
            state.end_index = 0
            state.last_position[key] = max(position, state.last_position.get(key, -1))
            if key >= 0:
                AdaptiveDataLoaderHelper._position[key] += 1
            else:
                self._outside[key] = position + 1
            self._future = None
            self._progress_target = None
            AdaptiveDataLoaderHelper._current = None
            # The next loop starts a fresh accumulation (see the module doc).
            self._discard_incomplete_accumulation()

    def _loop(self) -> tuple[int, int]:
        """The ``(key, position)`` of the loop being iterated."""
        if self._state.loop is None:
            raise RuntimeError("this AdaptDL data loader is not being iterated")
        return self._state.loop

    def _finished(self, loop: tuple[int, int]) -> bool:
        """Whether ``loop`` finished before a restart (only loops in epochs are skipped)."""
        key, position = loop
        return key >= 0 and position <= self._state.last_position.get(key, -1)

    def skipdone(self) -> bool:
        """True if this loop already finished in the current epoch before a restart."""
        done = self._finished(self._loop())
        if done:
            logger.debug("skipping a loop that finished before the restart")
        return done

    def seed_epoch(self) -> int:
        """The epoch that seeds shuffling: the epoch, or the loop count outside epochs."""
        key, position = self._loop()
        if key >= 0:
            return key
        if self._state.seed is None:
            # Distinct for each of this loader's loops outside epochs.
            self._state.seed = position + (-1 - key) * 2**20
        return self._state.seed

    def pass_done(self, progress_made: bool, dataset_size: int) -> bool:
        """Whether a loop ends after the pass that just finished (collective if autoscaling).

        Without autoscaling one pass is one loop. With autoscaling, a loop
        lasts until the training progress (in scale-invariant iterations)
        reaches what one pass at ``B0`` would have made, so larger batches
        take more than one pass. Rank 0 decides and broadcasts, so replicas can
        never disagree because of rounding.

        Args:
            progress_made: whether the pass advanced the progress counter
                (False when nothing reports progress, e.g. no
                AdaptiveDataParallel, which would otherwise loop forever).
            dataset_size: samples in one pass.
        """
        if not (self.autoscaling and self.training):
            return True
        done = True
        if env.replica_rank() == 0 and progress_made:
            if self._progress_target is None:
                self.set_progress_target(dataset_size)
            done = _metrics.get_progress() >= (self._progress_target or 0.0)
        return bool(_sync.broadcast(done))

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write the current batch sizes to a TensorBoard ``SummaryWriter``."""
        tag_prefix = _tag_prefix(tag_prefix)
        writer.add_scalar(tag_prefix + "Total_Batch_Size", self.current_batch_size, global_step)
        writer.add_scalar(tag_prefix + "Local_Batch_Size", self.current_local_bsz, global_step)
        writer.add_scalar(tag_prefix + "Accumulation_Steps", self.accumulation_steps, global_step)


def _tag_prefix(prefix: str) -> str:
    """Check a TensorBoard tag prefix and end it with ``/`` (``"Train"`` -> ``"Train/Gain"``).

    The original library appended the ``/`` to a non-empty prefix that
    lacked one, so existing dashboards keep their tag names (and groups).
    """
    if not isinstance(prefix, str):
        raise TypeError(f"tag_prefix must be a str, got {type(prefix).__name__}: {prefix!r}")
    return prefix if not prefix or prefix.endswith("/") else prefix + "/"


class AdaptiveDataLoaderMixin:
    """Adds the AdaptDL batch-size API to a data-loading class.

    Args:
        batch_size: the global target batch size ``B0``.
    """

    def __init__(self, batch_size: int) -> None:
        self._elastic = AdaptiveDataLoaderHelper(batch_size)

    def autoscale_batch_size(
        self,
        max_batch_size: int,
        local_bsz_bounds: tuple[int | None, int | None] | None = None,
        gradient_accumulation: bool = False,
    ) -> None:
        """See :meth:`AdaptiveDataLoaderHelper.autoscale_batch_size`."""
        self._elastic.autoscale_batch_size(max_batch_size, local_bsz_bounds, gradient_accumulation)

    @property
    def current_local_bsz(self) -> int | None:
        """Per-replica batch size while this loader is iterated, else None."""
        if current_dataloader() is not self._elastic:
            return None
        return self._elastic.current_local_bsz

    @property
    def accumulation_steps(self) -> int:
        """Extra micro-batches accumulated before each optimizer step."""
        return self._elastic.accumulation_steps

    @property
    def training(self) -> bool:
        """Whether this is the training loader."""
        return self._elastic.training

    @property
    def current_batch_size(self) -> int | None:
        """Global batch size per optimizer step while iterated, else None."""
        if current_dataloader() is not self._elastic:
            return None
        return self._elastic.current_batch_size

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """See :meth:`AdaptiveDataLoaderHelper.to_tensorboard`."""
        self._elastic.to_tensorboard(writer, global_step, tag_prefix)


class _WorkerInit:
    """Seeds each data worker differently per replica, then runs the user's hook.

    PyTorch derives worker seeds from the main process's RNG, which replicas
    usually seed identically; without an offset per rank every replica would
    apply the same "random" augmentations.
    """

    def __init__(self, num_workers: int, user_fn: Callable[[int], None] | None) -> None:
        self.num_workers = num_workers
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        # The rank is read in the worker (its environment is the replica's at
        # the time the workers start), not when the loader was created.
        rank = env.replica_rank()
        seed = (torch.initial_seed() + rank * self.num_workers) % (1 << 32)
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class AdaptiveDataLoader(DataLoader[Any], AdaptiveDataLoaderMixin):
    """A :class:`~torch.utils.data.DataLoader` with elastic, adaptive batches.

    Differences from a plain DataLoader:

    1. ``batch_size`` is the target *global* batch size over all replicas
       (and ``loader.batch_size`` stays that value whatever the replica
       count); each replica loads ``ceil(batch_size / K)`` per step unless
       autoscaling chooses otherwise.
    2. ``sampler`` and ``batch_sampler`` cannot be given (an
       :class:`ElasticSampler` is installed).
    3. Only one AdaptDL loader can be iterated at a time, and a loop
       interrupted by a checkpoint resumes at the next unseen sample after the
       restart (inside :func:`~adaptdl.torch.epoch.remaining_epochs_until`).
       A loader created inside an epoch belongs to that epoch (its state is
       found again after a restart by the epoch and creation order): create
       it before the epoch loop, or anew in each epoch. One kept for later
       epochs is not checkpointed there, and its first loop says so.
    4. With gradient accumulation, a loop that ends in the middle of an
       optimizer step's micro-batches discards their gradients: the next
       loop starts from clean gradients (see :mod:`adaptdl.torch.data`).

    Args:
        dataset: the dataset to load from.
        batch_size: the global target batch size.
        shuffle: whether every pass uses a fresh (deterministic) permutation.
        **kwargs: other DataLoader arguments (``num_workers``, ``drop_last``,
            ``collate_fn``, ``worker_init_fn``, ...).

    Raises:
        ValueError: ``sampler`` or ``batch_sampler`` was given.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int = 1,
        shuffle: bool = False,
        **kwargs: Any,
    ) -> None:
        for name in ("sampler", "batch_sampler"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"AdaptiveDataLoader does not support a custom {name} "
                    f"(got {kwargs[name]!r}); it installs an ElasticSampler"
                )
            kwargs.pop(name, None)
        batch_size = _check_int("batch_size", batch_size, 1)
        if batch_size > MAX_BATCH_SIZE:
            raise ValueError(f"batch_size={batch_size} must be <= 2**53")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            # torch's own error would blame a sampler the user never passed.
            raise TypeError(
                f"dataset={type(dataset).__name__}: AdaptiveDataLoader needs a map-style "
                "dataset (with __len__ and __getitem__) to partition it across replicas "
                "and resume at any sample; an IterableDataset is not supported"
            )
        sampler = ElasticSampler(dataset, shuffle=shuffle)  # type: ignore[arg-type]
        num_workers = _check_int("num_workers", kwargs.get("num_workers", 0), 0)
        kwargs["worker_init_fn"] = _WorkerInit(num_workers, kwargs.get("worker_init_fn"))
        # ``loader.batch_size`` is the global batch size, as in the original;
        # each loop sets the batch sampler's size to the replica's share.
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        # len(loader) counts this replica's steps before the first loop too.
        self.batch_sampler.batch_size = math.ceil(batch_size / env.num_replicas())  # type: ignore[union-attr]
        AdaptiveDataLoaderMixin.__init__(self, batch_size)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """Yield this replica's batches for one loop, resuming after restarts.

        Without autoscaling a loop is one pass over the dataset shared by all
        replicas (each sees about ``1/K`` of it). With autoscaling a loop lasts
        until the statistical progress equals one pass at ``batch_size``.
        """
        helper = self._elastic
        sampler = self.sampler
        if not isinstance(sampler, ElasticSampler):  # pragma: no cover - set in __init__
            raise RuntimeError("the sampler of an AdaptiveDataLoader was replaced")
        size = len(sampler.dataset)
        num_replicas = env.num_replicas()
        entered = False  # a refused nested loop must not reset the running one's sampler
        try:
            with helper.context():
                entered = True
                if helper.skipdone() or size == 0:
                    return
                seed_epoch = helper.seed_epoch()
                helper.set_progress_target(size)
                state = helper._state
                start = state.current_index
                # A checkpoint taken right after the loop's last step: at the
                # end of a pass, or, autoscaled, where the progress reached its
                # target (the checkpoint is acted on before the loop's end is).
                resumed_at_end = start % size == 0 or (helper.autoscaling and helper.training)
                if start > 0 and resumed_at_end and helper.pass_done(True, size):
                    return
                while True:
                    start = state.current_index
                    end = (start // size + 1) * size
                    helper.end_index = end
                    sampler.set_epoch(seed_epoch, start)
                    local_bsz = helper._sync_local_bsz()
                    self.batch_sampler.batch_size = local_bsz  # type: ignore[union-attr]
                    progress_before = _metrics.get_progress()
                    switched = False
                    yielded = False
                    for idx, batch in enumerate(super().__iter__()):
                        yielded = True
                        # helper.profile() unrolled: a generator-based context
                        # manager costs several microseconds per step.
                        commit = helper.training and idx >= 1
                        helper._step_begin(commit)
                        yield batch
                        helper._step_end(commit)
                        consumed = min(num_replicas * local_bsz, end - state.current_index)
                        state.current_index += max(consumed, 0)
                        outcome = helper._finish_step()
                        if outcome == "done":
                            return
                        if outcome == "switch":
                            switched = True
                            break
                    if switched and state.current_index < end:
                        continue  # same pass, new batch size
                    helper.current_index = end
                    # A stretch that began mid-pass (a restart, a new batch
                    # size) may find fewer samples left than one batch, and
                    # drop_last yields none: that is not "nothing reports
                    # progress", which would end the loop short of its target.
                    empty_tail = not yielded and start % size != 0
                    progress_made = empty_tail or _metrics.get_progress() > progress_before
                    if helper.pass_done(progress_made, size):
                        return
        finally:
            # The next loop starts a fresh pass: len(loader) must count a whole
            # pass, not what was left of the one a restart resumed.
            if entered:
                sampler.index = 0


@_procstate.register_reset
def _forget_loaders() -> None:
    """Forget the loaders' process-wide counters (a forked replica, or a test)."""
    AdaptiveDataLoaderHelper._position.clear()
    AdaptiveDataLoaderHelper._created.clear()
    AdaptiveDataLoaderHelper._training = None
    AdaptiveDataLoaderHelper._current = None
