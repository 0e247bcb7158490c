"""The one set of rules every name registry follows (policies, backends, scaling rules).

Each extension point keeps its own dict; these helpers make registering and
looking up behave the same in all of them: the same name syntax, the same
refusal to shadow a built-in by accident, and unknown names listing the
valid ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import TypeVar

__all__ = ["check_name", "lookup", "register", "unknown_name"]

_LOG = logging.getLogger(__name__)

T = TypeVar("T")


def check_name(kind: str, name: object) -> str:
    """Return ``name`` if it is a valid registry name, else raise.

    Names are what users type after ``--policy`` and friends, so they are
    identifiers in which dashes are allowed (``my-policy``, ``fifo2``), but
    not first: ``--policy -x`` would read as an option.

    Raises:
        ValueError: ``name`` is not such a string.
    """
    if (
        not isinstance(name, str)
        or name.startswith("-")
        or not name.replace("-", "_").isidentifier()
    ):
        raise ValueError(
            f"{kind} name {name!r}: expected a non-empty identifier "
            "(letters, digits, '_' and '-', starting with a letter or '_')"
        )
    return name


def register(
    registry: MutableMapping[str, T],
    kind: str,
    name: str,
    entry: T,
    *,
    builtins: Iterable[str],
    replace: bool,
    key: Callable[[str], str] = str,
    expected: str = "",
) -> None:
    """Add ``entry`` to ``registry`` under ``name``, by the shared rules.

    Registering the same entry again is a no-op. A different entry may take
    a plugin's name (a reloaded module registers new objects), with a
    warning, but a built-in's only with ``replace=True``: a plugin that
    silently shadowed ``adaptdl`` would have its results filed under the
    built-in's name.

    Args:
        registry: The extension point's dict.
        kind: What is registered, for messages (``"policy"``).
        name: The name users will type.
        entry: The factory or class.
        builtins: The names the project itself registers.
        replace: Allow replacing a built-in.
        key: Maps a name to its dict key (``str.lower`` for case-insensitive
            registries).
        expected: What ``entry`` should be, for the error when it is not
            callable (``"a Policy subclass or a function returning a Policy"``).

    Raises:
        ValueError: ``name`` is invalid, or a built-in's without ``replace``.
        TypeError: ``entry`` is not callable.
    """
    check_name(kind, name)
    if not callable(entry):
        raise TypeError(
            f"register_{kind.replace(' ', '_')}({name!r}, {entry!r}): the factory must be "
            f"callable ({expected or 'a class or a function'})"
        )
    slot = key(name)
    current = registry.get(slot)
    if current is entry:
        return
    if current is not None:
        if slot in {key(b) for b in builtins} and not replace:
            raise ValueError(
                f"{kind} {name!r} is built in ({current!r}); register yours under another "
                "name, or pass replace=True to override the built-in on purpose"
            )
        _LOG.warning("%s %r: %r replaces %r", kind, name, entry, current)
    registry[slot] = entry


def lookup(
    registry: Mapping[str, T],
    kind: str,
    name: object,
    plural: str,
    *,
    key: Callable[[str], str] = str,
) -> T:
    """The entry registered as ``name``, by the shared rules.

    Anything but a registered name (a list, a number) gets the same error,
    listing the valid names, rather than a bare ``unhashable type``.

    Raises:
        ValueError: ``name`` is not registered.
    """
    entry = registry.get(key(name)) if isinstance(name, str) else None
    if entry is None:
        raise unknown_name(kind, name, registry, plural)
    return entry


def unknown_name(kind: str, name: object, names: Iterable[str], plural: str) -> ValueError:
    """The error for a name nobody registered, listing the valid ones.

    Args:
        kind: What was looked up (``"policy"``).
        name: The name given.
        names: The registered names.
        plural: How the list is introduced (``"policies"``).
    """
    valid = ", ".join(sorted(names)) or "(none)"
    return ValueError(f"unknown {kind} {name!r}; valid {plural}: {valid}")
