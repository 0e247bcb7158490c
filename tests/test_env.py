"""Tests for :mod:`adaptdl.env`: defaults, set values and malformed values."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable

import pytest

from adaptdl import env
from adaptdl.env import EnvironmentVariableError

_ALL_VARIABLES = [
    "ADAPTDL_CHECKPOINT_PATH",
    "ADAPTDL_SHARE_PATH",
    "ADAPTDL_JOB_ID",
    "ADAPTDL_MASTER_ADDR",
    "ADAPTDL_MASTER_PORT",
    "ADAPTDL_REPLICA_RANK",
    "ADAPTDL_NUM_NODES",
    "ADAPTDL_NUM_REPLICAS",
    "ADAPTDL_NUM_RESTARTS",
    "ADAPTDL_SCHED_VERSION",
    "ADAPTDL_SUPERVISOR_URL",
    "ADAPTDL_JOB_TOKEN",
    "ADAPTDL_TENSORBOARD_LOGDIR",
    "ADAPTDL_TUNE_TRIAL_SCHED",
    "ADAPTDL_FIT_INTERVAL",
    "ADAPTDL_DECIDE_INTERVAL",
    "ADAPTDL_CONNECT_TIMEOUT",
    "ADAPTDL_SIM_TRACES",
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start every test from an environment without any ADAPTDL_* variable."""
    for name in _ALL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------- defaults


@pytest.mark.parametrize(
    ("accessor", "expected"),
    [
        (env.checkpoint_path, None),
        (env.share_path, None),
        (env.job_id, None),
        (env.master_addr, "0.0.0.0"),  # noqa: S104
        (env.master_port, 0),
        (env.replica_rank, 0),
        (env.num_nodes, 1),
        (env.num_replicas, 1),
        (env.num_restarts, 0),
        (env.adaptdl_sched_version, None),
        (env.supervisor_url, None),
        (env.job_token, None),
        (env.tensorboard_logdir, None),
        (env.from_ray, False),
        (env.fit_interval, 30.0),
        (env.decide_interval, 30.0),
        (env.connect_timeout, 120.0),
        (env.sim_traces, None),
    ],
)
def test_default_when_unset(accessor: Callable[[], object], expected: object) -> None:
    assert accessor() == expected


@pytest.mark.parametrize(
    ("accessor", "variable"),
    [
        (env.checkpoint_path, "ADAPTDL_CHECKPOINT_PATH"),
        (env.share_path, "ADAPTDL_SHARE_PATH"),
        (env.job_id, "ADAPTDL_JOB_ID"),
        (env.adaptdl_sched_version, "ADAPTDL_SCHED_VERSION"),
        (env.supervisor_url, "ADAPTDL_SUPERVISOR_URL"),
        (env.job_token, "ADAPTDL_JOB_TOKEN"),
        (env.tensorboard_logdir, "ADAPTDL_TENSORBOARD_LOGDIR"),
    ],
)
def test_empty_string_means_unset(
    monkeypatch: pytest.MonkeyPatch, accessor: Callable[[], object], variable: str
) -> None:
    # Launchers often export VAR= to "clear" a variable; that must not become
    # a checkpoint directory called "" or a supervisor URL called "".
    monkeypatch.setenv(variable, "")
    assert accessor() is None


def test_numeric_defaults_when_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ADAPTDL_MASTER_PORT", "ADAPTDL_NUM_REPLICAS", "ADAPTDL_NUM_RESTARTS"):
        monkeypatch.setenv(name, "  ")
    assert env.master_port() == 0
    assert env.num_replicas() == 1
    assert env.num_restarts() == 0


# --------------------------------------------------------------------------- set values


@pytest.mark.parametrize(
    ("accessor", "variable", "raw", "expected"),
    [
        (env.checkpoint_path, "ADAPTDL_CHECKPOINT_PATH", "/ckpt/job", "/ckpt/job"),
        (env.share_path, "ADAPTDL_SHARE_PATH", "/share", "/share"),
        (env.job_id, "ADAPTDL_JOB_ID", "default/mnist", "default/mnist"),
        (env.master_addr, "ADAPTDL_MASTER_ADDR", "10.0.0.7", "10.0.0.7"),
        (env.master_port, "ADAPTDL_MASTER_PORT", "47000", 47000),
        (env.master_port, "ADAPTDL_MASTER_PORT", " 65535 ", 65535),
        (env.num_replicas, "ADAPTDL_NUM_REPLICAS", "8", 8),
        (env.num_restarts, "ADAPTDL_NUM_RESTARTS", "3", 3),
        (env.adaptdl_sched_version, "ADAPTDL_SCHED_VERSION", "0.9.0", "0.9.0"),
        (env.supervisor_url, "ADAPTDL_SUPERVISOR_URL", "http://sup:8080", "http://sup:8080"),
        (env.job_token, "ADAPTDL_JOB_TOKEN", "s3cret", "s3cret"),
        (env.tensorboard_logdir, "ADAPTDL_TENSORBOARD_LOGDIR", "/tb", "/tb"),
        (env.fit_interval, "ADAPTDL_FIT_INTERVAL", "0.5", 0.5),
        (env.decide_interval, "ADAPTDL_DECIDE_INTERVAL", "0", 0.0),
        (env.connect_timeout, "ADAPTDL_CONNECT_TIMEOUT", "2.5", 2.5),
        (env.sim_traces, "ADAPTDL_SIM_TRACES", "/traces", "/traces"),
    ],
)
def test_set_value(
    monkeypatch: pytest.MonkeyPatch,
    accessor: Callable[[], object],
    variable: str,
    raw: str,
    expected: object,
) -> None:
    monkeypatch.setenv(variable, raw)
    assert accessor() == expected


def test_values_are_read_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "1")
    assert env.num_restarts() == 1
    monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "2")
    assert env.num_restarts() == 2
    monkeypatch.delenv("ADAPTDL_NUM_RESTARTS")
    assert env.num_restarts() == 0


def test_supervisor_url_drops_trailing_slashes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Callers build "{url}/hints/{key}"; a trailing slash would give "//hints".
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", "http://sup:8080//")
    assert env.supervisor_url() == "http://sup:8080"


@pytest.mark.parametrize(
    "raw",
    [
        "supervisor:8080",
        "ftp://sup",
        "http://",
        "http:/sup",
        "sup",
        "http://[::1",
        "http://sup:80a",
    ],
)
def test_supervisor_url_must_be_http_with_a_host(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    # Checked here, where the variable is parsed, for discovery and hints alike.
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", raw)
    with pytest.raises(env.EnvironmentVariableError) as info:
        env.supervisor_url()
    assert str(info.value) == (
        f"environment variable ADAPTDL_SUPERVISOR_URL={raw!r} is invalid: "
        "expected an http:// or https:// URL with a host"
    )


def test_replica_rank_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "4")
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", "3")
    assert env.replica_rank() == 3


def test_num_nodes_defaults_to_num_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "6")
    assert env.num_nodes() == 6
    monkeypatch.setenv("ADAPTDL_NUM_NODES", "2")
    assert env.num_nodes() == 2


def test_num_nodes_above_num_replicas_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    # Accepted, it would record an impossible profile that breaks every later fit.
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "2")
    monkeypatch.setenv("ADAPTDL_NUM_NODES", "3")
    with pytest.raises(
        EnvironmentVariableError,
        match=r"ADAPTDL_NUM_NODES='3' is invalid: expected at most ADAPTDL_NUM_REPLICAS=2",
    ):
        env.num_nodes()


# --------------------------------------------------------------------------- from_ray


def _fake_ray(initialized: bool) -> types.ModuleType:
    module = types.ModuleType("ray")
    module.is_initialized = lambda: initialized  # type: ignore[attr-defined]
    return module


def test_from_ray_needs_flag_and_initialized_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", _fake_ray(True))
    assert env.from_ray() is False  # flag unset
    monkeypatch.setenv("ADAPTDL_TUNE_TRIAL_SCHED", "true")
    assert env.from_ray() is False  # the flag must be exactly "True"
    monkeypatch.setenv("ADAPTDL_TUNE_TRIAL_SCHED", "True")
    assert env.from_ray() is True
    monkeypatch.setitem(sys.modules, "ray", _fake_ray(False))
    assert env.from_ray() is False


def test_from_ray_never_imports_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_TUNE_TRIAL_SCHED", "True")
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert env.from_ray() is False
    assert "ray" not in sys.modules


# --------------------------------------------------------------------------- malformed


def _assert_names(error: EnvironmentVariableError, variable: str, raw: str) -> None:
    message = str(error)
    assert variable in message
    assert repr(raw) in message
    assert error.name == variable
    assert error.value == raw


@pytest.mark.parametrize(
    ("accessor", "variable", "raw", "expected"),
    [
        (env.num_replicas, "ADAPTDL_NUM_REPLICAS", "two", "an integer"),
        (env.num_replicas, "ADAPTDL_NUM_REPLICAS", "0", ">= 1"),
        (env.num_replicas, "ADAPTDL_NUM_REPLICAS", "-3", ">= 1"),
        (env.num_replicas, "ADAPTDL_NUM_REPLICAS", "2.5", "an integer"),
        # Accepted, then an OverflowError in the reducer's listen().
        (env.num_replicas, "ADAPTDL_NUM_REPLICAS", "3000000000", "<= 2147483647"),
        (env.replica_rank, "ADAPTDL_REPLICA_RANK", "9" * 30, "<= 2147483647"),
        (env.master_port, "ADAPTDL_MASTER_PORT", "-1", ">= 0"),
        (env.master_port, "ADAPTDL_MASTER_PORT", "http", "an integer"),
        (env.master_port, "ADAPTDL_MASTER_PORT", "65536", "between 0 and 65535"),
        (env.master_port, "ADAPTDL_MASTER_PORT", "99999999999", "between 0 and 65535"),
        (env.num_restarts, "ADAPTDL_NUM_RESTARTS", "-1", ">= 0"),
        (env.num_restarts, "ADAPTDL_NUM_RESTARTS", "many", "an integer"),
        (env.num_nodes, "ADAPTDL_NUM_NODES", "0", ">= 1"),
        (env.num_nodes, "ADAPTDL_NUM_NODES", "x", "an integer"),
        (env.replica_rank, "ADAPTDL_REPLICA_RANK", "-2", ">= 0"),
        (env.replica_rank, "ADAPTDL_REPLICA_RANK", "first", "an integer"),
        (env.num_replicas, "ADAPTDL_NUM_REPLICAS", "1_0", "an integer"),
        (env.num_replicas, "ADAPTDL_NUM_REPLICAS", "\u0663", "an integer"),  # Arabic-Indic 3
        (env.fit_interval, "ADAPTDL_FIT_INTERVAL", "-1", ">= 0"),
        (env.fit_interval, "ADAPTDL_FIT_INTERVAL", "soon", "a number"),
        (env.decide_interval, "ADAPTDL_DECIDE_INTERVAL", "nan", "finite"),
        (env.decide_interval, "ADAPTDL_DECIDE_INTERVAL", "3_0", "a number"),
        # float() takes other scripts' digits; get_int does not.
        (env.fit_interval, "ADAPTDL_FIT_INTERVAL", "\u0663", "a number"),
        (env.fit_interval, "ADAPTDL_FIT_INTERVAL", "\uff11\uff10", "a number"),
        (env.connect_timeout, "ADAPTDL_CONNECT_TIMEOUT", "0", "> 0"),
        (env.connect_timeout, "ADAPTDL_CONNECT_TIMEOUT", "inf", "finite"),
    ],
)
def test_malformed_value_names_variable_and_value(
    monkeypatch: pytest.MonkeyPatch,
    accessor: Callable[[], object],
    variable: str,
    raw: str,
    expected: str,
) -> None:
    monkeypatch.setenv(variable, raw)
    with pytest.raises(EnvironmentVariableError) as info:
        accessor()
    _assert_names(info.value, variable, raw)
    assert expected in str(info.value)
    # It is a ValueError, so generic "bad configuration" handlers still catch it.
    assert isinstance(info.value, ValueError)


def test_rank_must_be_below_num_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "2")
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", "2")
    with pytest.raises(EnvironmentVariableError) as info:
        env.replica_rank()
    _assert_names(info.value, "ADAPTDL_REPLICA_RANK", "2")
    assert "ADAPTDL_NUM_REPLICAS=2" in str(info.value)


def test_rank_without_num_replicas_is_checked_against_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", "1")
    with pytest.raises(EnvironmentVariableError, match="ADAPTDL_NUM_REPLICAS=1"):
        env.replica_rank()


def test_bad_num_replicas_reported_by_dependent_accessors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # replica_rank() and num_nodes() depend on num_replicas(); the error must
    # still point at the variable that is actually wrong.
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "two")
    for accessor in (env.replica_rank, env.num_nodes):
        with pytest.raises(EnvironmentVariableError) as info:
            accessor()
        _assert_names(info.value, "ADAPTDL_NUM_REPLICAS", "two")


# --------------------------------------------------------------------------- generic parsers


def test_get_str(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.get_str("ADAPTDL_TEST_STR") is None
    assert env.get_str("ADAPTDL_TEST_STR", "dflt") == "dflt"
    monkeypatch.setenv("ADAPTDL_TEST_STR", "value")
    assert env.get_str("ADAPTDL_TEST_STR", "dflt") == "value"


def test_get_int(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.get_int("ADAPTDL_TEST_INT", 7) == 7
    monkeypatch.setenv("ADAPTDL_TEST_INT", "-4")
    assert env.get_int("ADAPTDL_TEST_INT", 7) == -4
    with pytest.raises(EnvironmentVariableError, match=r"ADAPTDL_TEST_INT='-4'.*>= 0"):
        env.get_int("ADAPTDL_TEST_INT", 7, minimum=0)


@pytest.mark.parametrize("raw", ["1.5", " 2e-3 ", "0"])
def test_get_float_accepts_numbers(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("ADAPTDL_TEST_FLOAT", raw)
    assert env.get_float("ADAPTDL_TEST_FLOAT", 9.0) == float(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("abc", "a number"), ("nan", "finite"), ("inf", "finite"), ("-1e999", "finite")],
)
def test_get_float_rejects(monkeypatch: pytest.MonkeyPatch, raw: str, expected: str) -> None:
    monkeypatch.setenv("ADAPTDL_TEST_FLOAT", raw)
    with pytest.raises(EnvironmentVariableError) as info:
        env.get_float("ADAPTDL_TEST_FLOAT", 1.0)
    _assert_names(info.value, "ADAPTDL_TEST_FLOAT", raw)
    assert expected in str(info.value)


def test_get_float_minimum_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.get_float("ADAPTDL_TEST_FLOAT", 2.5) == 2.5
    monkeypatch.setenv("ADAPTDL_TEST_FLOAT", "-0.5")
    with pytest.raises(EnvironmentVariableError, match=">= 0"):
        env.get_float("ADAPTDL_TEST_FLOAT", 1.0, minimum=0.0)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("TRUE", True), ("yes", True), (" on ", True)]
    + [("0", False), ("False", False), ("no", False), ("off", False)],
)
def test_get_bool(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv("ADAPTDL_TEST_BOOL", raw)
    assert env.get_bool("ADAPTDL_TEST_BOOL", not expected) is expected


def test_get_bool_default_and_error(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.get_bool("ADAPTDL_TEST_BOOL", True) is True
    monkeypatch.setenv("ADAPTDL_TEST_BOOL", "maybe")
    with pytest.raises(EnvironmentVariableError) as info:
        env.get_bool("ADAPTDL_TEST_BOOL", True)
    _assert_names(info.value, "ADAPTDL_TEST_BOOL", "maybe")


def test_all_names_exported() -> None:
    for name in env.__all__:
        assert hasattr(env, name), name


def test_every_accessor_works_in_a_clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Accessors added later must also have a usable default, not raise.
    for name in list(os.environ):
        if name.startswith("ADAPTDL_"):
            monkeypatch.delenv(name)
    for name in env.__all__:
        accessor = getattr(env, name)
        if name.startswith("get_") or isinstance(accessor, type):
            continue
        accessor()


def test_home_defaults_to_dot_adaptdl_and_expands_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADAPTDL_HOME", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert env.home() == "/home/someone/.adaptdl"
    monkeypatch.setenv("ADAPTDL_HOME", "~/cluster")
    assert env.home() == "/home/someone/cluster"


def test_replica_rank_against_an_explicit_replica_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "1")
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", "2")
    assert env.replica_rank(num_replicas=4) == 2
    with pytest.raises(
        env.EnvironmentVariableError, match=r"ADAPTDL_REPLICA_RANK='2'.*num_replicas=2"
    ):
        env.replica_rank(num_replicas=2)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1e3", 1000.0), ("-2.5", -2.5), (".5", 0.5), ("7.", 7.0), (" 4 ", 4.0), ("+1E-2", 0.01)],
)
def test_get_float_takes_plain_ascii_numbers(
    monkeypatch: pytest.MonkeyPatch, raw: str, expected: float
) -> None:
    monkeypatch.setenv("ADAPTDL_TEST_FLOAT", raw)
    assert env.get_float("ADAPTDL_TEST_FLOAT", 0.0) == expected


def test_string_variables_drop_surrounding_whitespace(monkeypatch: pytest.MonkeyPatch) -> None:
    # "127.0.0.1 " reached the reducer as a host name and failed after the
    # connect timeout; "   " as ADAPTDL_HOME made a folder of three spaces.
    monkeypatch.setenv("ADAPTDL_MASTER_ADDR", "127.0.0.1 ")
    assert env.master_addr() == "127.0.0.1"
    monkeypatch.setenv("ADAPTDL_MASTER_ADDR", "  ")
    assert env.master_addr() == "0.0.0.0"  # noqa: S104
    monkeypatch.setenv("ADAPTDL_HOME", "   ")
    assert env.home() == os.path.expanduser("~/.adaptdl")


@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True, None])
def test_replica_rank_names_a_bad_num_replicas_argument(bad: object) -> None:
    if bad is None:
        assert env.replica_rank(None) == 0
        return
    # It was blamed on ADAPTDL_REPLICA_RANK (unset), or a TypeError from ">=".
    with pytest.raises(ValueError, match=r"^num_replicas=.*expected an integer >= 1"):
        env.replica_rank(bad)  # type: ignore[arg-type]
