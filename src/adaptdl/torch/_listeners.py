"""Callbacks held through weak references, for module-level hooks.

A hook registered by an object (an AdaptiveDataParallel, an Accumulator's
state) must not keep that object alive, so bound methods are kept as
:class:`weakref.WeakMethod` and dropped once their object is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["WeakListeners"]


class WeakListeners:
    """Bound methods, called in registration order while their objects live."""

    def __init__(self) -> None:
        self._refs: list[weakref.WeakMethod[Callable[..., None]]] = []

    def add(self, callback: Callable[..., None]) -> None:
        """Register ``callback``, a bound method (held weakly).

        Raises:
            TypeError: ``callback`` is not a bound method.
        """
        try:
            ref = weakref.WeakMethod(callback)
        except TypeError:
            raise TypeError(f"callback must be a bound method, got {callback!r}") from None
        self._refs.append(ref)

    def call(self, *args: Any) -> None:
        """Call every live callback with ``args``; forget those whose object is gone."""
        for ref in list(self._refs):
            callback = ref()
            if callback is None:
                self._refs.remove(ref)
            else:
                callback(*args)

    def clear(self) -> None:
        self._refs.clear()
