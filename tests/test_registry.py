"""The shared registry rules (policies, backends, scaling rules follow them alike)."""

from __future__ import annotations

import logging

import pytest

from adaptdl import _registry


def test_names_are_identifiers_with_dashes() -> None:
    assert _registry.check_name("policy", "my-fifo2") == "my-fifo2"
    assert _registry.check_name("policy", "_x-") == "_x-"
    assert _registry.check_name("policy", "pol\u00edtica") == "pol\u00edtica"
    # "-x" and "--help" read as options after --policy.
    for bad in ("", "a b", "2x", None, 5, "x/y", "-x", "--help", "-", "x\n"):
        with pytest.raises(ValueError, match="policy name .*: expected a non-empty identifier"):
            _registry.check_name("policy", bad)


def test_a_builtin_is_replaced_only_on_purpose(caplog: pytest.LogCaptureFixture) -> None:
    def builtin() -> None: ...

    def mine() -> None: ...

    def other() -> None: ...

    table = {"std": builtin}
    with pytest.raises(ValueError, match="widget 'std' is built in .*replace=True"):
        _registry.register(table, "widget", "std", mine, builtins={"std"}, replace=False)
    assert table["std"] is builtin
    _registry.register(table, "widget", "std", builtin, builtins={"std"}, replace=False)
    _registry.register(table, "widget", "std", mine, builtins={"std"}, replace=True)
    assert table["std"] is mine
    # A plugin's name may be taken again (a reloaded module), with a warning.
    _registry.register(table, "widget", "plug", mine, builtins={"std"}, replace=False)
    with caplog.at_level(logging.WARNING, logger="adaptdl._registry"):
        _registry.register(table, "widget", "plug", other, builtins={"std"}, replace=False)
    assert table["plug"] is other
    assert "widget 'plug'" in caplog.text and "replaces" in caplog.text


def test_case_insensitive_registries_compare_builtins_by_key() -> None:
    table: dict[str, object] = {"adascale": object}
    with pytest.raises(ValueError, match="is built in"):
        _registry.register(
            table, "rule", "AdaScale", int, builtins={"adascale"}, replace=False, key=str.lower
        )


def test_unknown_names_list_the_valid_ones() -> None:
    error = _registry.unknown_name("policy", "nope", ["b", "a"], "policies")
    assert str(error) == "unknown policy 'nope'; valid policies: a, b"
    assert str(_registry.unknown_name("backend", "x", [], "backends")).endswith("(none)")


def test_unhashable_names_list_the_valid_ones_too() -> None:
    from adaptdl.cluster import get_backend
    from adaptdl.sched import get_policy

    with pytest.raises(ValueError, match=r"unknown policy \['adaptdl'\]; valid policies: .*"):
        get_policy(["adaptdl"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown cluster backend \['local'\]"):
        get_backend(["local"])  # type: ignore[arg-type]
