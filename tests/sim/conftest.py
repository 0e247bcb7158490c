"""Fixtures for the simulator tests."""

from __future__ import annotations

from pathlib import Path

import pytest

#: The Pollux artifact's data, kept next to the repository (not redistributed).
POLLUX_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "pollux-data"


@pytest.fixture(scope="session")
def pollux_data() -> Path:
    """Path of shared/pollux-data; skips the test when it is absent."""
    if not (POLLUX_DATA / "traces").is_dir():
        pytest.skip(
            f"Pollux traces not found at {POLLUX_DATA} (shared/pollux-data next to the repo)"
        )
    return POLLUX_DATA
