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

# A shell starts background commands ("make test &", nohup in a script) with
# SIGINT ignored, and Python then installs no KeyboardInterrupt handler, nor
# do the subprocesses the tests start. The signal tests need Ctrl-C to behave
# as in a terminal, so it is restored here, once, for the whole run.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
