"""Small helpers kept for compatibility with the original ``adaptdl.utils``."""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["print_exc"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def print_exc(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate ``function`` so that an exception prints its traceback, then propagates.

    Callbacks run by frameworks (autograd hooks, futures, threads) often have
    their exceptions swallowed or reported without the original stack; this
    makes the failure visible where it happened without changing control flow.
    """

    @functools.wraps(function)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return function(*args, **kwargs)
        except BaseException:
            traceback.print_exc()
            raise

    return wrapper
