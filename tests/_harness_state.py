"""A module with a checkpoint State made at import time, for the harness tests.

Replicas must keep such states: they belong to the user's program, not to
what an earlier in-process run left behind.
"""

from __future__ import annotations

from typing import IO

from adaptdl import checkpoint


class _Counter(checkpoint.State):
    def __init__(self) -> None:
        super().__init__("harness-module-level-counter")
        self.value = 0

    def save(self, fileobj: IO[bytes]) -> None:
        fileobj.write(str(self.value).encode())

    def load(self, fileobj: IO[bytes]) -> None:
        self.value = int(fileobj.read())


COUNTER = _Counter()


def registered_names() -> list[str]:
    """The states registered in this process, by name."""
    return [state.name for state in checkpoint.registered_states()]
