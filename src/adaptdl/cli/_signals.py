"""Signal handlers for the length of a command, set the way POSIX tools set them."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Union

__all__ = ["handling"]

Handler = Union[Callable[[int, FrameType | None], object], int, signal.Handlers]


@contextmanager
def handling(signals: Iterable[signal.Signals], handler: Handler) -> Iterator[None]:
    """Install ``handler`` for ``signals`` inside the block, then put back the old ones.

    A signal the caller ignores (``nohup``, ``trap '' TERM``) stays ignored:
    the user asked for that. Outside the main thread nothing is installed
    (Python allows handlers only there). A previous handler installed from
    outside Python is put back as the default action.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in signals:
        if signal.getsignal(signum) == signal.SIG_IGN:
            continue
        previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, signal.SIG_DFL if old is None else old)
