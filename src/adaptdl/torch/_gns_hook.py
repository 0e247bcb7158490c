"""The DDP communication hook that averages accumulated gradients.

:meth:`torch.nn.parallel.DistributedDataParallel.register_comm_hook` inspects
the hook's signature and rejects a ``bucket`` annotation that is not the
:class:`torch.distributed.GradBucket` class itself. Postponed (string)
annotations would therefore break registration, which is why this tiny module
deliberately does not use ``from __future__ import annotations``.
"""

from typing import Protocol

import torch
import torch.distributed as dist

__all__: list[str] = []


class BucketReducer(Protocol):
    """What the hook forwards each gradient bucket to (the noise-scale estimator)."""

    def _reduce_bucket(
        self,
        bucket: dist.GradBucket,  # type: ignore[name-defined]
    ) -> torch.futures.Future[torch.Tensor]: ...


def accumulation_comm_hook(
    state: BucketReducer,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce one bucket, averaged over replicas and accumulated micro-batches.

    DDP calls this once per gradient bucket on every synchronising backward
    pass, once gradient accumulation has been used.
    """
    return state._reduce_bucket(bucket)
