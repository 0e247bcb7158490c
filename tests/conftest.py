"""Shared pytest configuration."""

from __future__ import annotations

import os

# Keep every test process single-threaded: CI has 2 cores and many tests start
# several replica processes at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# CI must not fail on an example no earlier run tried: there, property tests
# draw the same examples every time; elsewhere they keep exploring.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
