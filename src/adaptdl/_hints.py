"""Value checks shared by :mod:`adaptdl.sched_hints`.

Hints arrive from two directions: typed Python values built by the training
library, and JSON uploaded to the supervisor by a job (which may be buggy,
outdated or hostile). Both go through the same checks so that the scheduler
never sees a NaN batch size or a negative step time. Every error names the
field, in both spellings (``snake_case (camelCase)``), and the offending value.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any, SupportsIndex, cast

__all__ = [
    "check_bool",
    "check_int",
    "check_number",
    "check_keys",
    "label",
]


def label(field: str, wire: str) -> str:
    """How a field is named in error messages: Python name and wire name."""
    return f"{field} ({wire})"


def check_int(value: object, name: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Return ``value`` as an int in ``[minimum, maximum]``.

    Integral floats (``128.0``) are accepted because JSON producers in other
    languages do not distinguish them; booleans are rejected because
    ``True`` as a batch size is always a bug.

    Raises:
        ValueError: naming ``name`` and the value.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    try:
        value = operator.index(cast(SupportsIndex, value))  # int, numpy integers
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")
    return value


def check_number(
    value: object,
    name: str,
    *,
    minimum: float = 0.0,
    maximum: float | None = None,
) -> float:
    """Return ``value`` as a finite float in ``[minimum, maximum]``.

    Raises:
        ValueError: naming ``name`` and the value.
    """
    # Strings and booleans convert with float() but are never meant as numbers;
    # numpy scalars are not int/float subclasses but convert exactly.
    if isinstance(value, bool | str | bytes):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum:g}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum:g}, got {value!r}")
    return number


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a real boolean (not 0/1 or a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def check_keys(data: object, valid: tuple[str, ...], where: str) -> Mapping[str, Any]:
    """Check that ``data`` is a JSON object whose keys are all in ``valid``.

    Unknown keys are rejected rather than ignored: a misspelt hint would
    otherwise be dropped silently and the scheduler would act on defaults.

    Raises:
        ValueError: ``data`` is not a mapping, or has unknown or non-string
            keys; the message lists the valid keys.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}: {data!r}")
    unknown = [key for key in data if key not in valid]
    if unknown:
        raise ValueError(
            f"{where} has unknown keys {sorted(map(str, unknown))}; valid keys are {list(valid)}"
        )
    return data
