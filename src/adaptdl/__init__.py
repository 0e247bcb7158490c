"""AdaptDL: resource-adaptive deep-learning training and scheduling.

The top-level package holds the framework-agnostic core (environment,
collectives, checkpoints, the goodput model and scheduling hints). PyTorch
support lives in :mod:`adaptdl.torch`, scheduling policies in
:mod:`adaptdl.sched`, the trace simulator in :mod:`adaptdl.sim` and the
cluster backends in :mod:`adaptdl.cluster`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__: str = version("adaptdl")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
