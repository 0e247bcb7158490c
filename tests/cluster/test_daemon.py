"""The daemon's own command line: bad values end it with a usage error naming them."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import pytest

from adaptdl.cluster._daemon import DEFAULT_INTERVAL, parse_config


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("--interval", "nan", "argument --interval: nan: expected a finite number of seconds > 0"),
        ("--interval", "inf", "argument --interval: inf: expected a finite number"),
        ("--interval", "0", "argument --interval: 0: expected a finite number of seconds > 0"),
        ("--tick", "nan", "argument --tick: nan: expected a finite number"),
        ("--grace", "nan", "argument --grace: nan: expected a finite number of seconds >= 0"),
        ("--grace", "-1", "argument --grace: -1: expected a finite number of seconds >= 0"),
        ("--slots", "0", "argument --slots: 0: expected an integer from 1 to 2**31 - 1"),
        ("--slots", "3000000000", "argument --slots: 3000000000: expected an integer from 1"),
        ("--port", "70000", "argument --port: 70000: expected a TCP port"),
    ],
)
def test_bad_values_are_usage_errors(
    capsys: pytest.CaptureFixture[str], option: str, value: str, fragment: str
) -> None:
    """Checked before the daemon takes its lock or starts anything (no traceback)."""
    with pytest.raises(SystemExit) as info:
        parse_config(["--home", "h", option, value])
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_good_values_and_defaults_parse() -> None:
    config = parse_config(["--home", "h", "--interval", "2.5", "--grace", "0", "--slots", "3"])
    assert (config.interval, config.grace, config.slots) == (2.5, 0.0, 3)
    defaults = parse_config(["--home", "h"])
    assert (defaults.interval, defaults.tick, defaults.port) == (DEFAULT_INTERVAL, 0.25, 0)


def test_a_daemon_whose_controller_ends_stops_instead_of_answering_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The controller's thread could end (a SystemExit) while /healthz kept
    # answering: a daemon that never scheduled again.
    from adaptdl.cluster import _controller, _daemon

    monkeypatch.setattr(_controller.Controller, "run", lambda self, stop: None)
    config = parse_config(["--home", str(tmp_path), "--slots", "1", "--host", "127.0.0.1"])
    config.warm_start = False
    started = time.monotonic()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level(logging.ERROR, logger=_daemon.__name__):
            assert _daemon.run_daemon(config) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert time.monotonic() - started < 30
    assert "the controller thread ended unexpectedly" in caplog.text
    assert not (tmp_path / "daemon.json").exists()
