"""The DDP communication hook through which gradient noise is measured.

:meth:`torch.nn.parallel.DistributedDataParallel.register_comm_hook` inspects
the hook's signature and rejects a ``bucket`` annotation that is not the
:class:`torch.distributed.GradBucket` class itself. Postponed (string)
annotations would therefore break registration, which is why this tiny module
deliberately does not use ``from __future__ import annotations``.
"""

import logging
from typing import Protocol

import torch
import torch.distributed as dist

__all__: list[str] = []

logger = logging.getLogger(__name__)


class BucketObserver(Protocol):
    """What the hook forwards each gradient bucket to (the noise-scale estimator)."""

    def _on_bucket(
        self,
        bucket: dist.GradBucket,  # type: ignore[name-defined]
    ) -> torch.futures.Future[torch.Tensor]: ...


def gns_comm_hook(
    state: BucketObserver,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """Reduce one bucket while letting ``state`` look at it before and after.

    DDP calls this once per gradient bucket on every synchronising backward
    pass. The observer computes the local statistics, launches the
    all-reduce and returns the future DDP waits for.
    """
    return state._on_bucket(bucket)
