"""Shared pytest configuration."""

from __future__ import annotations

import os

# Keep every test process single-threaded: CI has 2 cores and many tests start
# several replica processes at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
