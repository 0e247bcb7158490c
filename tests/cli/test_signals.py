"""Signal handlers for the length of a command."""

from __future__ import annotations

import signal
import threading

from adaptdl.cli._signals import handling


def _handler(signum: int, frame: object) -> None:
    raise AssertionError("not called")


def test_handlers_are_installed_and_put_back() -> None:
    before = signal.getsignal(signal.SIGHUP)
    with handling([signal.SIGHUP], _handler):
        assert signal.getsignal(signal.SIGHUP) is _handler
    assert signal.getsignal(signal.SIGHUP) == before


def test_an_ignored_signal_stays_ignored() -> None:
    # Under nohup, the demo turned SIGHUP back into an interrupt.
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with handling([signal.SIGHUP], _handler):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_outside_the_main_thread_nothing_is_installed() -> None:
    # signal.signal raised ValueError there, so the demo did not start at all.
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with handling([signal.SIGHUP], _handler):
                pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert errors == []
    assert signal.getsignal(signal.SIGHUP) is not _handler
