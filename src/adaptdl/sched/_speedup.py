"""Speedup of a job as a function of its allocation, from its goodput model.

A scheduling policy compares allocations by how much faster each makes a job
progress. :class:`SpeedupFunction` turns a job's
:class:`~adaptdl.goodput.GoodputFunction` into that number: the best goodput
reachable on ``(num_nodes, num_replicas)`` (re-optimising the batch size for
every allocation, since more replicas favour a larger batch) divided by a base
goodput. Policies evaluate it for thousands of candidate allocations per
round, so results are memoised and misses are computed in one vectorised call.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from adaptdl.goodput import GoodputFunction
from adaptdl.sched._types import MAX_COUNT

__all__ = ["SpeedupFunction"]

_LOG = logging.getLogger(__name__)

_FloatArray = NDArray[np.float64]
_IntArray = NDArray[np.int64]
_Scalar = int | np.integer[Any]

#: Packs a (nodes, replicas) pair into one int64 key for the overflow memo.
_KEY_SHIFT = 1 << 32

_INT_TYPES = (int, np.integer)


#: Largest dense memo: 4096 x 4096 tables take about 420 MB together.
_MAX_MEM_SIZE = 4096


def _as_count(name: str, value: ArrayLike) -> _IntArray:
    """Convert a node or replica count (scalar or array) to int64, strictly."""
    arr = np.asarray(value)
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise TypeError(f"{name}={value!r}: expected integer counts")
    if np.issubdtype(arr.dtype, np.floating):
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise ValueError(f"{name}={value!r}: expected whole numbers")
    if np.any(bad := arr > MAX_COUNT):
        # Larger counts would collide in the memo's packed keys.
        raise ValueError(f"{name}={arr[bad].flat[0]!r}: must be below 2**31")
    return arr.astype(np.int64)


def _first(arr: _IntArray, bad: NDArray[np.bool_]) -> int:
    return int(arr[bad].flat[0])


def _validate_pairs(num_nodes: ArrayLike, num_replicas: ArrayLike) -> tuple[_IntArray, _IntArray]:
    nodes = _as_count("num_nodes", num_nodes)
    replicas = _as_count("num_replicas", num_replicas)
    try:
        nodes, replicas = np.broadcast_arrays(nodes, replicas)
    except ValueError as exc:
        raise ValueError(
            f"num_nodes (shape {nodes.shape}) and num_replicas (shape {replicas.shape}) "
            "do not broadcast together"
        ) from exc
    if np.any(bad := nodes < 0):
        raise ValueError(f"num_nodes={_first(nodes, bad)}: must be >= 0")
    if np.any(bad := nodes > replicas):
        raise ValueError(
            f"num_nodes={_first(nodes, bad)} exceeds num_replicas={_first(replicas, bad)}: "
            "every node used must host at least one replica"
        )
    if np.any(bad := (nodes == 0) & (replicas > 0)):
        raise ValueError(
            f"num_nodes=0 with num_replicas={_first(replicas, bad)}: replicas need a node "
            "(use num_nodes=num_replicas=0 for no allocation)"
        )
    return nodes, replicas


class _Overflow(NamedTuple):
    """Memoised pairs beyond the dense tables, sorted by key for ``searchsorted``."""

    keys: _IntArray
    goodput: _FloatArray
    bsz: _IntArray
    steps: _IntArray


def _pair_keys(nodes: _IntArray, replicas: _IntArray) -> _IntArray:
    return np.asarray(nodes * _KEY_SHIFT + replicas, dtype=np.int64)


def _find(keys: _IntArray, queries: _IntArray) -> tuple[_IntArray, NDArray[np.bool_]]:
    """Positions of ``queries`` in the sorted ``keys`` and whether each is present."""
    pos = np.searchsorted(keys, queries)
    if keys.size == 0:
        return pos, np.zeros(queries.shape, dtype=np.bool_)
    clipped = np.minimum(pos, keys.size - 1)
    return clipped, keys[clipped] == queries


class _GoodputMemo:
    """Optimised raw goodput and batch configuration per (nodes, replicas).

    The values do not depend on the base goodput, so several
    :class:`SpeedupFunction` objects with different bases share one memo and
    none of them can leave another's results stale. Pairs with
    ``replicas < mem_size`` live in dense tables (one fancy-indexing lookup for
    a whole array of pairs); larger pairs live in sorted arrays searched with
    ``np.searchsorted``, so lookups stay vectorised either way.
    """

    def __init__(
        self,
        goodput_fn: GoodputFunction,
        max_batch_size: float | None,
        atomic_bsz_range: tuple[float | None, float | None] | None,
        accumulation: bool,
        mem_size: int,
    ) -> None:
        self.goodput_fn = goodput_fn
        self.max_batch_size = max_batch_size
        self.atomic_bsz_range = atomic_bsz_range
        self.accumulation = accumulation
        self.mem_size = mem_size
        self.goodput = np.zeros((mem_size, mem_size), dtype=np.float64)
        self.bsz = np.zeros((mem_size, mem_size), dtype=np.int64)
        self.steps = np.zeros((mem_size, mem_size), dtype=np.int64)
        self.known = np.zeros((mem_size, mem_size), dtype=np.bool_)
        self.known[0, 0] = True  # no allocation: goodput 0, no batch
        # Replaced as a whole (never modified in place) so that a reader
        # always sees a consistent snapshot.
        self._overflow = _Overflow(
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.float64),
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.int64),
        )
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Locks cannot be pickled; the memo travels with jobs (deep copies,
        # simulator snapshots, process pools), so drop it and make a new one.
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def lookup(
        self, nodes: _IntArray, replicas: _IntArray
    ) -> tuple[_FloatArray, _IntArray, _IntArray]:
        """Goodput, atomic batch size and accumulation steps for validated pairs.

        Unseen pairs are deduplicated and evaluated with a single vectorised
        ``optimize`` call before the lookup. Results are flat arrays.
        """
        nodes = nodes.ravel()
        replicas = replicas.ravel()
        in_table = replicas < self.mem_size
        if np.all(in_table):
            if not np.all(self.known[nodes, replicas]):
                self._fill(nodes, replicas)
            return (
                self.goodput[nodes, replicas],
                self.bsz[nodes, replicas],
                self.steps[nodes, replicas],
            )
        self._fill(nodes, replicas)
        goodput = np.empty(nodes.shape, dtype=np.float64)
        bsz = np.empty(nodes.shape, dtype=np.int64)
        steps = np.empty(nodes.shape, dtype=np.int64)
        t_nodes, t_replicas = nodes[in_table], replicas[in_table]
        goodput[in_table] = self.goodput[t_nodes, t_replicas]
        bsz[in_table] = self.bsz[t_nodes, t_replicas]
        steps[in_table] = self.steps[t_nodes, t_replicas]
        out = ~in_table
        overflow = self._overflow
        pos, _ = _find(overflow.keys, _pair_keys(nodes[out], replicas[out]))
        goodput[out] = overflow.goodput[pos]
        bsz[out] = overflow.bsz[pos]
        steps[out] = overflow.steps[pos]
        return goodput, bsz, steps

    def _fill(self, nodes: _IntArray, replicas: _IntArray) -> None:
        with self._lock:
            in_table = replicas < self.mem_size
            out = ~in_table
            missing = np.zeros(nodes.shape, dtype=np.bool_)
            missing[in_table] = ~self.known[nodes[in_table], replicas[in_table]]
            overflow = self._overflow
            _, found = _find(overflow.keys, _pair_keys(nodes[out], replicas[out]))
            missing[out] = ~found
            if not np.any(missing):
                return
            pairs = np.unique(np.stack([nodes[missing], replicas[missing]], axis=1), axis=0)
            goodput, bsz, steps = self.goodput_fn.optimize(
                pairs[:, 0],
                pairs[:, 1],
                max_batch_size=self.max_batch_size,
                atomic_bsz_range=self.atomic_bsz_range,
                accumulation=self.accumulation,
            )
            small = pairs[:, 1] < self.mem_size
            rows, cols = pairs[small, 0], pairs[small, 1]
            # Values before flags, so a lock-free reader that sees a flag set
            # also sees its value.
            self.goodput[rows, cols] = goodput[small]
            self.bsz[rows, cols] = bsz[small]
            self.steps[rows, cols] = steps[small]
            self.known[rows, cols] = True
            if not np.all(small):
                big = ~small
                keys = np.concatenate([overflow.keys, _pair_keys(pairs[big, 0], pairs[big, 1])])
                order = np.argsort(keys, kind="stable")
                self._overflow = _Overflow(
                    keys[order],
                    np.concatenate([overflow.goodput, goodput[big]])[order],
                    np.concatenate([overflow.bsz, bsz[big]])[order],
                    np.concatenate([overflow.steps, steps[big]])[order],
                )
            _LOG.debug("speedup memo: optimised %d new (nodes, replicas) pairs", len(pairs))


class SpeedupFunction:
    """Goodput speedup of a job on ``num_nodes`` nodes with ``num_replicas`` replicas.

    ``speedup(N, K) = optimize(N, K).goodput / base``, where ``base`` is the
    best goodput on one replica unless :meth:`with_base` chose another
    configuration, and ``speedup(0, 0) = 0``. Call it with scalars (returns a
    float) or broadcastable integer arrays (returns an array of their shape).

    Args:
        goodput_fn: The job's goodput model.
        max_batch_size: Largest total batch size the job accepts (None: the
            initial batch size, i.e. no batch growth).
        atomic_bsz_range: ``(min, max)`` per-replica micro-batch size; either
            may be None.
        accumulation: Whether the job may use gradient accumulation.
        mem_size: Memoise pairs with ``num_replicas < mem_size`` in dense
            tables; larger pairs are memoised in sorted arrays.

    Raises:
        ValueError: Invalid bounds (as for ``GoodputFunction.optimize``),
            ``mem_size`` outside 2-4096, or a base configuration with zero goodput.
        TypeError: ``goodput_fn`` is not a GoodputFunction or ``mem_size`` is
            not an integer.
    """

    def __init__(
        self,
        goodput_fn: GoodputFunction,
        max_batch_size: float | None = None,
        atomic_bsz_range: tuple[float | None, float | None] | None = None,
        accumulation: bool = False,
        mem_size: int = 32,
    ) -> None:
        if not isinstance(goodput_fn, GoodputFunction):
            raise TypeError(f"goodput_fn={goodput_fn!r}: expected a GoodputFunction")
        if isinstance(mem_size, bool) or not isinstance(mem_size, (int, np.integer)):
            raise TypeError(f"mem_size={mem_size!r}: expected an integer")
        if not 2 <= mem_size <= _MAX_MEM_SIZE:
            raise ValueError(
                f"mem_size={mem_size!r}: must be from 2 (the table holds (1, 1)) to "
                f"{_MAX_MEM_SIZE} (four mem_size x mem_size tables are allocated)"
            )
        # Computing the base runs optimize(1, 1), which validates the bounds.
        memo = _GoodputMemo(
            goodput_fn, max_batch_size, atomic_bsz_range, accumulation, int(mem_size)
        )
        self._memo = memo
        self._base = self._base_goodput(memo, 1, 1)

    @staticmethod
    def _base_goodput(memo: _GoodputMemo, num_nodes: int, num_replicas: int) -> float:
        goodput = float(memo.lookup(np.array([num_nodes]), np.array([num_replicas]))[0][0])
        if not goodput > 0:
            raise ValueError(
                f"goodput at num_nodes={num_nodes}, num_replicas={num_replicas} is "
                f"{goodput!r}: cannot normalise speedups by it (max_atomic below the "
                "initial batch size without accumulation, or step-time parameters so "
                "large that the throughput underflows?)"
            )
        return goodput

    @property
    def goodput_fn(self) -> GoodputFunction:
        """The job's goodput model."""
        return self._memo.goodput_fn

    @property
    def max_batch_size(self) -> float | None:
        """The largest total batch size considered (None: the initial one)."""
        return self._memo.max_batch_size

    @property
    def atomic_bsz_range(self) -> tuple[float | None, float | None] | None:
        """The ``(min, max)`` per-replica micro-batch size considered."""
        return self._memo.atomic_bsz_range

    @property
    def accumulation(self) -> bool:
        """Whether gradient accumulation is considered."""
        return self._memo.accumulation

    @property
    def base_goodput(self) -> float:
        """The goodput that speedup 1 corresponds to."""
        return self._base

    def with_base(self, num_nodes: int, num_replicas: int) -> SpeedupFunction:
        """A speedup function normalised to the goodput of another configuration.

        The Pollux paper normalises each job to its fair share of the cluster.
        The new object shares this one's memo of raw goodputs (they do not
        depend on the base) and leaves this object unchanged.

        Raises:
            ValueError: The configuration is invalid or has zero goodput.
        """
        nodes, replicas = _validate_pairs(num_nodes, num_replicas)
        if nodes.ndim != 0:
            raise ValueError(
                f"with_base(num_nodes={num_nodes!r}, num_replicas={num_replicas!r}): "
                "expected scalars"
            )
        if replicas == 0:
            raise ValueError(
                f"with_base(num_nodes={num_nodes!r}, num_replicas={num_replicas!r}): the base "
                "must be a configuration with at least one replica (speedups are relative "
                "to its goodput, and no replicas have none)"
            )
        other = object.__new__(SpeedupFunction)
        other._memo = self._memo
        other._base = self._base_goodput(self._memo, int(nodes), int(replicas))
        return other

    def __repr__(self) -> str:
        return (
            f"SpeedupFunction({self._memo.goodput_fn!r}, max_batch_size="
            f"{self._memo.max_batch_size!r}, atomic_bsz_range={self._memo.atomic_bsz_range!r}, "
            f"accumulation={self._memo.accumulation!r}, base_goodput={self._base!r})"
        )

    def _lookup(
        self, num_nodes: ArrayLike, num_replicas: ArrayLike
    ) -> tuple[tuple[int, ...], _FloatArray, _IntArray, _IntArray]:
        nodes, replicas = _validate_pairs(num_nodes, num_replicas)
        goodput, bsz, steps = self._memo.lookup(nodes, replicas)
        return nodes.shape, goodput, bsz, steps

    def _fast_scalar(self, num_nodes: Any, num_replicas: Any) -> float | None:
        """Table hit for integer scalars without array overhead, else None.

        Policies often call the speedup one allocation at a time; this path
        skips validation-by-array and fancy indexing when the answer is
        already memoised (anything unusual falls through to the full path).
        """
        if (
            isinstance(num_nodes, _INT_TYPES)
            and isinstance(num_replicas, _INT_TYPES)
            and not isinstance(num_nodes, bool)
            and not isinstance(num_replicas, bool)
        ):
            nodes, replicas = int(num_nodes), int(num_replicas)
            mem = self._memo
            if (
                0 <= nodes <= replicas < mem.mem_size
                and (nodes > 0) == (replicas > 0)
                and mem.known[nodes, replicas]
            ):
                return float(mem.goodput[nodes, replicas])
        return None

    @overload
    def __call__(self, num_nodes: _Scalar, num_replicas: _Scalar) -> float: ...

    @overload
    def __call__(self, num_nodes: ArrayLike, num_replicas: ArrayLike) -> _FloatArray: ...

    def __call__(self, num_nodes: ArrayLike, num_replicas: ArrayLike) -> _FloatArray | float:
        """Speedup relative to the base goodput.

        Raises:
            ValueError: A pair violates ``0 <= num_nodes <= num_replicas`` or
                ``num_nodes > 0 iff num_replicas > 0``, or the shapes do not
                broadcast.
            TypeError: The counts are not integers.
        """
        fast = self._fast_scalar(num_nodes, num_replicas)
        if fast is not None:
            return fast / self._base
        shape, goodput, _, _ = self._lookup(num_nodes, num_replicas)
        result = (goodput / self._base).reshape(shape)
        if not shape:
            return float(result)
        return result

    @overload
    def goodput(self, num_nodes: _Scalar, num_replicas: _Scalar) -> float: ...

    @overload
    def goodput(self, num_nodes: ArrayLike, num_replicas: ArrayLike) -> _FloatArray: ...

    def goodput(self, num_nodes: ArrayLike, num_replicas: ArrayLike) -> _FloatArray | float:
        """The raw optimised goodput (samples/s, efficiency-weighted) of a configuration."""
        shape, goodput, _, _ = self._lookup(num_nodes, num_replicas)
        return float(goodput[0]) if not shape else goodput.reshape(shape)

    @overload
    def configuration(self, num_nodes: _Scalar, num_replicas: _Scalar) -> tuple[int, int]: ...

    @overload
    def configuration(
        self, num_nodes: ArrayLike, num_replicas: ArrayLike
    ) -> tuple[_IntArray, _IntArray]: ...

    def configuration(
        self, num_nodes: ArrayLike, num_replicas: ArrayLike
    ) -> tuple[_IntArray, _IntArray] | tuple[int, int]:
        """The ``(atomic_bsz, accum_steps)`` that reaches the memoised goodput.

        ``(0, 0)`` for the empty allocation. The total batch size is
        ``num_replicas * atomic_bsz * (accum_steps + 1)``.
        """
        shape, _, bsz, steps = self._lookup(num_nodes, num_replicas)
        if not shape:
            return int(bsz[0]), int(steps[0])
        return bsz.reshape(shape), steps.reshape(shape)
