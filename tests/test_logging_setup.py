"""Only the command-line programs in ``adaptdl.cli`` install log handlers."""

from __future__ import annotations

import re
from pathlib import Path

import adaptdl

_CONFIGURES = re.compile(r"\b(basicConfig|addHandler|dictConfig|fileConfig)\s*\(")


def test_library_modules_do_not_configure_logging() -> None:
    root = Path(adaptdl.__file__).parent
    offenders = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).parts[0] != "cli"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _CONFIGURES.search(line)
    ]
    assert offenders == [], f"library code configures logging at {offenders}"
