from __future__ import annotations

import pytest

from adaptdl.utils import print_exc


def test_print_exc_prints_the_traceback_and_reraises(capsys: pytest.CaptureFixture[str]) -> None:
    @print_exc
    def fails(value: int) -> int:
        raise ValueError(f"bad value {value}")

    with pytest.raises(ValueError, match="bad value 3"):
        fails(3)
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "bad value 3" in err
    assert fails.__name__ == "fails"


def test_print_exc_passes_results_through(capsys: pytest.CaptureFixture[str]) -> None:
    assert print_exc(lambda a, b=2: a + b)(1, b=5) == 6
    assert capsys.readouterr().err == ""
