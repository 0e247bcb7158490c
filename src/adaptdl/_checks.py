"""Argument checks shared by the core and the scheduler.

Kept in the core so that :mod:`adaptdl.goodput` and :mod:`adaptdl.sched`
word the same mistake the same way.
"""

from __future__ import annotations

import numpy as np

__all__ = ["check_bool"]


def check_bool(label: str, value: object) -> None:
    """Refuse anything but ``True``/``False`` (numpy's too) for ``label``.

    Raises:
        TypeError: ``value`` is not a boolean.
    """
    # "no" or 0 would be read as a truth value: only real booleans are clear.
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{label}={value!r}: expected True or False")
