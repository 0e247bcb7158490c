"""Process-wide AdaptDL state that a forked replica must not inherit.

Modules that keep state for the life of a process (AdaptDL's own checkpoint
states, epoch counters, loader positions, metrics, signal handlers) register a
function here that forgets it. :mod:`adaptdl.testing` calls them in every
replica it forks, so a replica starts like a fresh process even when the test
process itself trained in-process before. The functions must only *forget*:
sockets and threads inherited through ``fork`` are shared with the parent, and
closing them would break the parent's copy. (State that no forked child may
keep, such as the collectives' connection or a lock, is reset for every fork
with :func:`os.register_at_fork` instead.)
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
