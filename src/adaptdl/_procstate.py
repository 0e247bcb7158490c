"""Process-wide AdaptDL state that a forked replica must not inherit.

Modules that keep state for the life of a process (the collectives, the
checkpoint registry, epoch counters, loader positions) register a function
here that forgets it. :mod:`adaptdl.testing` calls them in every replica it
forks, so a replica starts like a fresh process even when the test process
itself trained in-process before. The functions must only *forget*: sockets and
threads inherited through ``fork`` are shared with the parent, and closing
them would break the parent's copy.
"""

from __future__ import annotations

from collections.abc import Callable

_RESETS: list[Callable[[], None]] = []


def register_reset(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` to run in a forked replica before its body; returns ``fn``."""
    if fn not in _RESETS:
        _RESETS.append(fn)
    return fn


def forget_inherited_state() -> None:
    """Run every registered reset, in registration order."""
    for fn in list(_RESETS):
        fn()
