"""Elastic backpropagation-through-time batches over one long token stream.

Language models are trained on one long sequence of token ids cut into
``batch`` parallel streams: the stream is padded to a multiple of the
per-replica batch size, reshaped to a ``(rows, batch)`` matrix whose columns
are contiguous pieces of text, and consumed ``bptt_len`` rows at a time, the
target being the input shifted by one row. The original AdaptDL subclassed the
legacy torchtext ``BPTTIterator`` (removed in torchtext 0.12);
:class:`AdaptiveBPTTIterator` needs nothing but PyTorch.

Elasticity follows the original: replica ``r`` of ``K`` takes the windows that
start at rows ``cur + bptt_len * (r + j * K)``, every replica takes as many
steps as the last rank can (so collectives stay in lockstep), and the
checkpointed row position is rescaled when a restart changes the per-replica
batch size (and therefore the number of rows).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from adaptdl import env
from adaptdl.torch.data import AdaptiveDataLoaderMixin

__all__ = ["AdaptiveBPTTIterator", "BPTTBatch"]

logger = logging.getLogger(__name__)


class BPTTBatch(NamedTuple):
    """One window: unpacks as ``text, target``, and reads as ``batch.text`` and
    ``batch.target``, as the torchtext batches of the original did."""

    text: torch.Tensor
    target: torch.Tensor


#: torchtext ``Iterator`` options that change nothing for a BPTT stream (its
#: order is the text's); accepted so that scripts passing them still run.
_TORCHTEXT_NOOPS = frozenset({"shuffle", "sort", "sort_within_batch"})


class AdaptiveBPTTIterator(AdaptiveDataLoaderMixin):
    """Iterate ``(text, target)`` windows of a token stream, elastically and resumably.

    Each item is a :class:`BPTTBatch` ``(text, target)`` of ``LongTensor`` of
    shape ``(seq_len, local_bsz)`` with ``seq_len <= bptt_len``; ``target``
    is ``text`` shifted by one token.
    Use it inside :func:`~adaptdl.torch.epoch.remaining_epochs_until` like an
    :class:`~adaptdl.torch.data.AdaptiveDataLoader`. One loop is one pass; the
    batch size is (re)decided at the start of each loop.

    Args:
        dataset: the token ids, a 1-D tensor or a sequence of ints.
        batch_size: the global target number of parallel streams ``B0``.
        bptt_len: rows (time steps) per window.
        max_batch_size: if given, enables autoscaling up to this many streams.
        local_bsz_bounds: per-replica bounds for autoscaling.
        pad_value: token id used to pad the stream to a whole number of rows.
        device: where to put the batches (default: where ``dataset`` is).
        **kwargs: torchtext ``Iterator`` options of the original:
            ``repeat=False`` (the default; loop with
            :func:`~adaptdl.torch.epoch.remaining_epochs_until` instead of
            ``repeat=True``), and ``shuffle``, ``sort`` and
            ``sort_within_batch``, which do not change a BPTT stream.

    Raises:
        TypeError, ValueError: an argument is invalid (e.g. a stream that is
            not 1-D or too short for one window).
    """

    def __init__(
        self,
        dataset: torch.Tensor | Sequence[int],
        batch_size: int,
        bptt_len: int,
        max_batch_size: int | None = None,
        local_bsz_bounds: tuple[int | None, int | None] | None = None,
        pad_value: int = 0,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - _TORCHTEXT_NOOPS - {"repeat"})
        if unknown:
            raise TypeError(
                f"AdaptiveBPTTIterator got unexpected keyword arguments {unknown}; of "
                "torchtext's Iterator options it takes repeat=False, shuffle, sort and "
                "sort_within_batch"
            )
        if kwargs.get("repeat", False):
            raise ValueError(
                f"repeat={kwargs['repeat']!r}: an AdaptDL loop is one pass; loop over "
                "remaining_epochs_until() to repeat"
            )
        tokens = torch.as_tensor(dataset)
        if tokens.dim() != 1:
            raise ValueError(f"dataset must be 1-D token ids, got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise TypeError(f"dataset must hold integer token ids, got dtype {tokens.dtype}")
        if isinstance(bptt_len, bool) or not isinstance(bptt_len, int | np.integer) or bptt_len < 1:
            raise ValueError(f"bptt_len must be a positive int, got {bptt_len!r}")
        if isinstance(pad_value, bool) or not isinstance(pad_value, int | np.integer):
            raise TypeError(f"pad_value must be an int token id, got {pad_value!r}")
        super().__init__(batch_size)
        try:
            self._set_up(tokens, bptt_len, pad_value, device, max_batch_size, local_bsz_bounds)
        except BaseException:
            # A refused argument must not leave the loader's checkpoint name
            # registered (saved in every checkpoint, shifting later names).
            self._elastic._state.unregister()
            raise

    def _set_up(
        self,
        tokens: torch.Tensor,
        bptt_len: int,
        pad_value: int,
        device: Any,
        max_batch_size: int | None,
        local_bsz_bounds: Any,
    ) -> None:
        """The checks and settings of ``__init__`` that need the loader's helper."""
        if tokens.numel() <= self._elastic.batch_size:
            # At most one row per stream: no (text, target) pair for any
            # number of replicas (K replicas make about K rows, and the last
            # rank's first window starts at row bptt_len * (K - 1)).
            raise ValueError(
                f"dataset has {tokens.numel()} tokens, too few for batch_size="
                f"{self._elastic.batch_size} streams: each stream needs at least 2 tokens "
                "(a token and its target), so pass more than batch_size tokens"
            )
        self.dataset = tokens
        self.bptt_len = int(bptt_len)
        self.pad_value = int(pad_value)
        self.device = device
        # Decisions mid-pass would reshape the stream under the running loop.
        self._elastic._midpass_decisions = False
        if max_batch_size is not None:
            self.autoscale_batch_size(max_batch_size, local_bsz_bounds)
        elif local_bsz_bounds is not None:
            raise ValueError("local_bsz_bounds needs max_batch_size (it bounds autoscaling)")

    def _matrix(self, local_bsz: int) -> torch.Tensor:
        """The stream padded and reshaped to ``(rows, local_bsz)`` (columns are contiguous)."""
        count = self.dataset.numel()
        rows = math.ceil(count / local_bsz)
        padded = torch.full((rows * local_bsz,), self.pad_value, dtype=self.dataset.dtype)
        padded[:count] = self.dataset
        matrix = padded.view(local_bsz, rows).t().contiguous()
        return matrix if self.device is None else matrix.to(self.device)

    def _steps(self, start: int, rows: int, num_replicas: int) -> int:
        """Steps every replica takes from row ``start``: what the last rank can take."""
        first = start + self.bptt_len * (num_replicas - 1)
        if first >= rows - 1:
            return 0
        return math.ceil((rows - 1 - first) / (self.bptt_len * num_replicas))

    def __len__(self) -> int:
        """Steps of a full pass with the default per-replica batch size."""
        num_replicas = env.num_replicas()
        local_bsz = self._elastic.current_local_bsz or math.ceil(
            self._elastic.batch_size / num_replicas
        )
        rows = math.ceil(self.dataset.numel() / local_bsz)
        return self._steps(0, rows, num_replicas)

    def __iter__(self) -> Iterator[BPTTBatch]:
        helper = self._elastic
        num_replicas = env.num_replicas()
        rank = env.replica_rank()
        with helper.context():
            if helper.skipdone():
                return
            local_bsz = helper._sync_local_bsz()
            matrix = self._matrix(local_bsz)
            rows = matrix.shape[0]
            state = helper._state
            start = state.current_index
            if start > 0 and state.end_index > 0 and state.end_index != rows:
                # Resuming with another layout: keep the same fraction of the pass.
                start = math.ceil(start * rows / state.end_index)
                logger.debug("rescaled resume row to %d of %d", start, rows)
            helper.current_index = start
            helper.end_index = rows
            steps = self._steps(start, rows, num_replicas)
            for step in range(steps):
                row = state.current_index + self.bptt_len * rank
                seq_len = min(self.bptt_len, rows - 1 - row)
                text = matrix[row : row + seq_len]
                target = matrix[row + 1 : row + 1 + seq_len]
                # Not helper.profile(): the step is resolved only after the
                # index advanced, so a checkpoint resumes after this step.
                commit = helper.training and step >= 1
                helper._step_begin(commit)
                yield BPTTBatch(text, target)
                helper._step_end(commit)
                helper.current_index = min(state.current_index + self.bptt_len * num_replicas, rows)
                if helper._finish_step() == "done":
                    return
