"""The daemon's own command line: bad values end it with a usage error naming them."""

from __future__ import annotations

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
