"""Importing the user modules named by ``--plugin`` options.

A plugin registers policies or backends as a side effect of being imported.
The simulator's CLI, the cluster CLI and the cluster daemon all import them
the same way, so a plugin that fails does so with the same message
everywhere.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["PluginImportError", "import_plugins"]


class PluginImportError(ImportError):
    """A plugin module could not be imported (or raised while importing).

    Its message names the ``--plugin`` option, the one way plugins are given,
    so every caller prints it as it is.

    Attributes:
        module: The module name as given.
        reason: ``"ExceptionType: message"`` of the failure, or what is
            wrong with a blank name.
        searched: The directory looked in after the installed packages,
            set only when the module itself was not found there (not a
            module that it imports), so the message says where to put it.
        exit_code: 2 when the name itself is malformed (blank, a file
            path): a usage error, as the CLI counts them; 1 when the module
            was named well but could not be imported.
    """

    def __init__(
        self, module: str, reason: str, searched: str | None = None, *, exit_code: int = 1
    ) -> None:
        if not module.strip():
            message = f"--plugin {module!r}: {reason}"
        elif searched is None:
            message = f"--plugin {module!r} cannot be imported: {reason}"
        else:
            message = (
                f"--plugin {module!r} cannot be imported: {reason} "
                f"(looked in the installed packages, then in {searched})"
            )
        super().__init__(message)
        self.module = module
        self.reason = reason
        self.searched = searched
        self.exit_code = exit_code


def import_plugins(modules: Sequence[str], search_dir: str | None = None) -> None:
    """Import ``modules`` in order.

    Args:
        modules: Module names, e.g. ``["mypolicies"]``.
        search_dir: A directory appended to ``sys.path`` (last, so that its
            files cannot hide installed modules) before the first import.

    Raises:
        PluginImportError: a name is blank, or its import raised anything
            (a plugin is user code: a ``ValueError`` or ``SystemExit`` at
            import time is reported the same way as a missing module), or
            a standard-library module of its name hides its file in
            ``search_dir``.
    """
    if modules and search_dir is not None and search_dir not in sys.path:
        sys.path.append(search_dir)
    for module in modules:
        if not module.strip():
            raise PluginImportError(module, "expected a module name", exit_code=2)
        if "/" in module or os.sep in module:
            # A file path: importlib would fail with a misleading message.
            raise PluginImportError(
                module, f"expected a module name, not a file path: {_use(module)}", exit_code=2
            )
        try:
            imported = importlib.import_module(module)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of user code
            # The plugin itself (or its package) is missing, not something it imports.
            missing = isinstance(exc, ModuleNotFoundError) and (
                f"{module.strip()}.".startswith(f"{exc.name}.")
            )
            searched = search_dir if missing else None
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ModuleNotFoundError) and module.strip().endswith(".py"):
                reason += f"; for the file {module.strip()}, {_use(module)}"
            raise PluginImportError(module, reason, searched) from exc
        if search_dir is not None:
            _check_not_hidden(module.strip(), imported, search_dir)


def _check_not_hidden(module: str, imported: ModuleType, search_dir: str) -> None:
    """Refuse a plugin file in ``search_dir`` that a standard-library module hides.

    ``search_dir`` comes last on ``sys.path``, so a plugin named like a
    standard-library module (``random.py``) would silently be replaced by
    that module: its policies would never register, and the user would be
    told only that a policy name is unknown. An installed copy of the plugin
    found first is the documented order (e.g. after ``pip install .`` in its
    source tree), so only standard-library names are refused.

    Raises:
        PluginImportError: ``search_dir`` holds the top-level module or
            package of ``module``, but the standard library's was imported.
    """
    top = module.split(".", 1)[0]
    if top not in sys.stdlib_module_names and top not in sys.builtin_module_names:
        return
    candidates = (
        os.path.join(search_dir, f"{top}.py"),
        os.path.join(search_dir, top, "__init__.py"),
    )
    mine = next((path for path in candidates if os.path.isfile(path)), None)
    if mine is None:
        return
    origin = getattr(sys.modules.get(top, imported), "__file__", None)
    if origin is not None and os.path.realpath(origin) == os.path.realpath(mine):
        return
    where = "built into Python" if origin is None else f"at {origin}"
    raise PluginImportError(
        module,
        f"{mine} is hidden by the standard-library module {top!r} ({where}), which comes "
        "first on the import path; rename your file",
    )


def _use(path: str) -> str:
    """What to pass instead of the file ``path``."""
    stem = os.path.splitext(os.path.basename(path.strip()))[0]
    return f"use --plugin {stem} (from its directory, or with that directory on PYTHONPATH)"
