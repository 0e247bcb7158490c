"""Tests for :mod:`adaptdl.sched_hints`: templates, validation, wire form, posting."""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl import sched_hints
from adaptdl.sched_hints import (
    PERF_PARAMS,
    SCHED_HINTS,
    GradParams,
    PerfParams,
    SchedHints,
    post_sched_hints,
)

_PERF = PerfParams(0.1, 0.01, 0.5, 1.0, 1e-6, 1e-6, 1.2)
_FULL = SchedHints(
    init_batch_size=128,
    local_bsz_bounds=(32, 256),
    global_batch_size=512,
    max_batch_size=4096,
    max_profiled_replicas=4,
    gradient_accumulation=True,
    grad_params=GradParams(0.5, 2.0),
    perf_params=_PERF,
    remaining_iterations=1500.5,
)


@pytest.fixture(autouse=True)
def _no_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADAPTDL_SUPERVISOR_URL", raising=False)
    monkeypatch.delenv("ADAPTDL_JOB_TOKEN", raising=False)


# --------------------------------------------------------------------------- templates


def test_perf_params_template() -> None:
    assert list(PERF_PARAMS) == [
        "alpha_c",
        "beta_c",
        "alpha_n",
        "beta_n",
        "alpha_r",
        "beta_r",
        "gamma",
    ]
    with pytest.raises(TypeError):
        PERF_PARAMS["alpha_c"] = 1.0  # type: ignore[index]


def test_sched_hints_template() -> None:
    assert dict(SCHED_HINTS) == {
        "initBatchSize": 0,
        "localBszBounds": None,
        "globalBatchSize": None,
        "maxBatchSize": 0,
        "maxProfiledReplicas": 0,
        "gradientAccumulation": False,
        "gradParams": None,
        "perfParams": None,
        "remainingIterations": None,
    }
    with pytest.raises(TypeError):
        SCHED_HINTS["initBatchSize"] = 1  # type: ignore[index]


def test_defaults_match_template() -> None:
    assert SchedHints().to_json() == dict(SCHED_HINTS)
    assert SchedHints.from_json({}) == SchedHints()


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        _FULL.init_batch_size = 1  # type: ignore[misc]


# --------------------------------------------------------------------------- wire form


def test_wire_names_and_values() -> None:
    wire = _FULL.to_json()
    assert wire == {
        "initBatchSize": 128,
        "localBszBounds": [32, 256],
        "globalBatchSize": 512,
        "maxBatchSize": 4096,
        "maxProfiledReplicas": 4,
        "gradientAccumulation": True,
        "gradParams": {"norm": 0.5, "var": 2.0},
        "perfParams": {
            "alpha_c": 0.1,
            "beta_c": 0.01,
            "alpha_n": 0.5,
            "beta_n": 1.0,
            "alpha_r": 1e-6,
            "beta_r": 1e-6,
            "gamma": 1.2,
        },
        "remainingIterations": 1500.5,
    }
    assert set(wire) == set(SCHED_HINTS)
    assert set(wire["perfParams"]) == set(PERF_PARAMS)


@pytest.mark.parametrize("encode", [lambda w: w, json.dumps, lambda w: json.dumps(w).encode()])
def test_round_trip(encode: Any) -> None:
    assert SchedHints.from_json(encode(_FULL.to_json())) == _FULL


def test_open_bounds_round_trip() -> None:
    hints = SchedHints(local_bsz_bounds=(None, 64))
    assert hints.to_json()["localBszBounds"] == [None, 64]
    assert SchedHints.from_json(json.dumps(hints.to_json())) == hints


def test_null_means_default() -> None:
    wire = {key: None for key in SCHED_HINTS}
    assert SchedHints.from_json(wire) == SchedHints()


def test_numeric_types_are_normalised() -> None:
    hints = SchedHints(
        init_batch_size=np.int64(64),  # type: ignore[arg-type]
        max_batch_size=1024.0,  # type: ignore[arg-type]
        local_bsz_bounds=[8, np.int32(32)],  # type: ignore[arg-type]
        grad_params=(np.float32(1.0), 3),  # type: ignore[arg-type]
        perf_params=[1, 0, 0, 0, 0, 0, 2],  # type: ignore[arg-type]
    )
    assert hints == SchedHints(
        init_batch_size=64,
        max_batch_size=1024,
        local_bsz_bounds=(8, 32),
        grad_params=GradParams(1.0, 3.0),
        perf_params=PerfParams(1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0),
    )
    assert type(hints.init_batch_size) is int
    assert isinstance(hints.perf_params, PerfParams)
    json.dumps(hints.to_json())  # plain JSON types only


def test_perf_params_without_compute_time_are_rejected() -> None:
    # GoodputFunction cannot model a step that takes no time: reject at upload.
    with pytest.raises(ValueError, match=r"alpha_c=0.0 .*beta_c=0.0.*at least one must be > 0"):
        SchedHints(perf_params=PerfParams(0.0, 0.0, 0.1, 0.1, 0.1, 0.1, 1.0))


_finite = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(
    init=st.integers(0, 10_000),
    extra=st.integers(0, 10_000),
    lo=st.one_of(st.none(), st.integers(1, 100)),
    width=st.integers(0, 100),
    replicas=st.integers(0, 64),
    accumulate=st.booleans(),
    grad=st.one_of(st.none(), st.tuples(_finite, _finite)),
    perf=st.one_of(
        st.none(),
        # alpha_c > 0: a step must take some compute time (checked separately).
        st.tuples(st.floats(min_value=1e-6, max_value=1e6), *[_finite] * 5, st.floats(1, 10)),
    ),
    remaining=st.one_of(st.none(), _finite),
)
def test_round_trip_property(
    init: int,
    extra: int,
    lo: int | None,
    width: int,
    replicas: int,
    accumulate: bool,
    grad: tuple[float, float] | None,
    perf: tuple[float, ...] | None,
    remaining: float | None,
) -> None:
    hints = SchedHints(
        init_batch_size=init,
        max_batch_size=init + extra,
        local_bsz_bounds=(lo, None if lo is None else lo + width),
        max_profiled_replicas=replicas,
        gradient_accumulation=accumulate,
        grad_params=None if grad is None else GradParams(*grad),
        perf_params=None if perf is None else PerfParams(*perf),
        remaining_iterations=remaining,
    )
    assert SchedHints.from_json(json.dumps(hints.to_json())) == hints


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_batch_size": -1}, "init_batch_size (initBatchSize) must be >= 0, got -1"),
        ({"init_batch_size": 1.5}, "init_batch_size (initBatchSize) must be an integer, got 1.5"),
        ({"init_batch_size": "64"}, "init_batch_size (initBatchSize) must be an integer, got '64'"),
        ({"init_batch_size": True}, "init_batch_size (initBatchSize) must be an integer, got True"),
        (
            {"init_batch_size": math.inf},
            "init_batch_size (initBatchSize) must be an integer, got inf",
        ),
        ({"max_batch_size": -8}, "max_batch_size (maxBatchSize) must be >= 0, got -8"),
        (
            {"max_batch_size": 10**25},
            f"max_batch_size (maxBatchSize) must be <= {2**53}, got {10**25}",
        ),
        (
            {"global_batch_size": 2**53 + 1},
            f"global_batch_size (globalBatchSize) must be <= {2**53}, got {2**53 + 1}",
        ),
        (
            {"local_bsz_bounds": (1, 2**60)},
            f"local_bsz_bounds (localBszBounds)[1] must be <= {2**53}, got {2**60}",
        ),
        (
            {"max_profiled_replicas": -1},
            "max_profiled_replicas (maxProfiledReplicas) must be >= 0, got -1",
        ),
        (
            {"global_batch_size": -1},
            "global_batch_size (globalBatchSize) must be >= 0, got -1",
        ),
        (
            {"remaining_iterations": -1.0},
            "remaining_iterations (remainingIterations) must be >= 0, got -1.0",
        ),
        (
            {"remaining_iterations": math.nan},
            "remaining_iterations (remainingIterations) must be finite, got nan",
        ),
        (
            {"remaining_iterations": "10"},
            "remaining_iterations (remainingIterations) must be a number, got '10'",
        ),
        (
            {"gradient_accumulation": 1},
            "gradient_accumulation (gradientAccumulation) must be true or false, got 1",
        ),
        (
            {"init_batch_size": 256, "max_batch_size": 128},
            "init_batch_size (initBatchSize) must be <= max_batch_size (maxBatchSize), "
            "got 256 > 128",
        ),
        (
            {"local_bsz_bounds": (64, 32)},
            "local_bsz_bounds (localBszBounds) must have lo <= hi, got (64, 32)",
        ),
        (
            {"local_bsz_bounds": (0, 32)},
            "local_bsz_bounds (localBszBounds)[0] must be >= 1, got 0",
        ),
        (
            {"local_bsz_bounds": (1, -2)},
            "local_bsz_bounds (localBszBounds)[1] must be >= 1, got -2",
        ),
        (
            {"local_bsz_bounds": (1, 2, 3)},
            "local_bsz_bounds (localBszBounds) must be a pair (lo, hi), got (1, 2, 3)",
        ),
        (
            {"local_bsz_bounds": "1,2"},
            "local_bsz_bounds (localBszBounds) must be a pair (lo, hi), got '1,2'",
        ),
        (
            {"grad_params": GradParams(-1.0, 1.0)},
            "grad_params (gradParams).sqr (norm) must be >= 0, got -1.0",
        ),
        (
            {"grad_params": GradParams(1.0, math.nan)},
            "grad_params (gradParams).var must be finite, got nan",
        ),
        (
            {"grad_params": GradParams(1.0, "big")},  # type: ignore[arg-type]
            "grad_params (gradParams).var must be a number, got 'big'",
        ),
        (
            {"grad_params": (1.0,)},
            "grad_params (gradParams) must be a GradParams(sqr, var), got (1.0,)",
        ),
        (
            {"perf_params": _PERF._replace(alpha_c=-0.1)},
            "perf_params (perfParams).alpha_c must be >= 0, got -0.1",
        ),
        (
            {"perf_params": _PERF._replace(beta_n=math.inf)},
            "perf_params (perfParams).beta_n must be finite, got inf",
        ),
        (
            {"perf_params": _PERF._replace(gamma=0.5)},
            "perf_params (perfParams).gamma must be >= 1, got 0.5",
        ),
        (
            {"perf_params": _PERF._replace(gamma=11.0)},
            "perf_params (perfParams).gamma must be <= 10, got 11.0",
        ),
        (
            {"perf_params": (1.0, 2.0)},
            "perf_params (perfParams) must be a PerfParams with fields",
        ),
    ],
)
def test_validation_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        SchedHints(**kwargs)
    assert message in str(info.value)


def test_max_batch_size_zero_means_unknown() -> None:
    assert SchedHints(init_batch_size=256).max_batch_size == 0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"initBatchSize": 1, "batchSize": 2},
            "hints has unknown keys ['batchSize']; valid keys are ['initBatchSize', "
            "'localBszBounds', 'globalBatchSize', 'maxBatchSize', 'maxProfiledReplicas', "
            "'gradientAccumulation', 'gradParams', 'perfParams', 'remainingIterations']",
        ),
        ({"init_batch_size": 1}, "unknown keys ['init_batch_size']"),
        (
            {"gradParams": {"norm": 1.0, "var": 1.0, "sqr": 1.0}},
            "grad_params (gradParams) has unknown keys ['sqr']; valid keys are ['norm', 'var']",
        ),
        ({"gradParams": {"norm": 1.0}}, "grad_params (gradParams) is missing keys ['var']"),
        ({"gradParams": [1.0, 2.0]}, "grad_params (gradParams) must be a JSON object"),
        (
            {"perfParams": {"alpha_c": 0.1}},
            "perf_params (perfParams) is missing keys ['beta_c', 'alpha_n', 'beta_n', "
            "'alpha_r', 'beta_r', 'gamma']",
        ),
        (
            {"perfParams": {**_PERF._asdict(), "delta": 1.0}},
            "perf_params (perfParams) has unknown keys ['delta']",
        ),
        (
            {"perfParams": {**_PERF._asdict(), "gamma": 20}},
            "perf_params (perfParams).gamma must be <= 10, got 20",
        ),
        ({"maxBatchSize": "1024"}, "max_batch_size (maxBatchSize) must be an integer, got '1024'"),
        ({"localBszBounds": [16, 8]}, "must have lo <= hi, got [16, 8]"),
        ([1, 2], "hints must be a JSON object, got list"),
        ("[1, 2]", "hints must be a JSON object, got list"),
        ("{not json", "hints are not valid JSON"),
        ('{"initBatchSize": NaN}', "init_batch_size (initBatchSize) must be an integer, got nan"),
    ],
)
def test_from_json_errors(data: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SchedHints.from_json(data)
    assert message in str(info.value)


# --------------------------------------------------------------------------- posting


@dataclass
class _Server:
    url: str
    status: int = 200
    delay: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
def supervisor() -> Iterator[_Server]:
    """A real HTTP server on 127.0.0.1 that records PUT requests."""
    state = _Server(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            state.requests.append(
                {
                    "path": self.path,
                    "headers": dict(self.headers.items()),
                    "body": self.rfile.read(length),
                }
            )
            if state.delay:
                time.sleep(state.delay)
            self.send_response(state.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_no_supervisor_is_a_noop(supervisor: _Server) -> None:
    assert post_sched_hints(_FULL, "ns/job") is False
    assert supervisor.requests == []


def test_put_with_token_and_body(monkeypatch: pytest.MonkeyPatch, supervisor: _Server) -> None:
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", supervisor.url + "/")
    monkeypatch.setenv("ADAPTDL_JOB_TOKEN", "t0ken")
    assert post_sched_hints(_FULL, "default/mnist") is True
    (request,) = supervisor.requests
    assert request["path"] == "/hints/default/mnist"
    assert request["headers"]["Authorization"] == "Bearer t0ken"
    assert request["headers"]["Content-Type"] == "application/json"
    assert json.loads(request["body"]) == _FULL.to_json()
    assert SchedHints.from_json(request["body"]) == _FULL


def test_put_mapping_without_token(monkeypatch: pytest.MonkeyPatch, supervisor: _Server) -> None:
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", supervisor.url)
    supervisor.status = 204
    # The original library's keyword names.
    hints = {"initBatchSize": 64, "maxBatchSize": 512}
    assert post_sched_hints(sched_hints=hints, job_key="job 1") is True
    (request,) = supervisor.requests
    assert request["path"] == "/hints/job%201"
    assert "Authorization" not in request["headers"]
    body = json.loads(request["body"])
    assert body["initBatchSize"] == 64
    assert body["maxBatchSize"] == 512
    assert body["perfParams"] is None


def test_proxies_from_environment_are_bypassed(
    monkeypatch: pytest.MonkeyPatch, supervisor: _Server
) -> None:
    # The request carries the job token; it must go straight to the supervisor.
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", supervisor.url)
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert post_sched_hints(_FULL, "ns/job") is True
    assert len(supervisor.requests) == 1


@pytest.mark.parametrize("status", [400, 403, 404, 500, 503])
def test_error_status_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch,
    supervisor: _Server,
    caplog: pytest.LogCaptureFixture,
    status: int,
) -> None:
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", supervisor.url)
    supervisor.status = status
    with caplog.at_level(logging.WARNING, logger="adaptdl.sched_hints"):
        assert post_sched_hints(_FULL, "ns/job") is False
    assert len(supervisor.requests) == 1
    assert f"HTTP {status}" in caplog.text


def test_non_2xx_success_code_is_logged(
    monkeypatch: pytest.MonkeyPatch, supervisor: _Server, caplog: pytest.LogCaptureFixture
) -> None:
    # A 1xx/3xx that urllib does not turn into an exception is still a failure.
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", supervisor.url)
    supervisor.status = 304
    with caplog.at_level(logging.WARNING, logger="adaptdl.sched_hints"):
        assert post_sched_hints(_FULL, "ns/job") is False
    assert "304" in caplog.text


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_unreachable_supervisor_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", f"http://127.0.0.1:{_closed_port()}")
    with caplog.at_level(logging.WARNING, logger="adaptdl.sched_hints"):
        assert post_sched_hints(_FULL, "ns/job") is False
    assert "could not post scheduling hints for ns/job" in caplog.text


def test_slow_supervisor_times_out(
    monkeypatch: pytest.MonkeyPatch, supervisor: _Server, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", supervisor.url)
    monkeypatch.setattr(sched_hints, "POST_TIMEOUT", 0.2)
    supervisor.delay = 10.0
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="adaptdl.sched_hints"):
        assert post_sched_hints(_FULL, "ns/job") is False
    assert time.monotonic() - start < 5.0
    assert "could not post" in caplog.text


def test_malformed_url_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", "supervisor:8080")
    with caplog.at_level(logging.WARNING, logger="adaptdl.sched_hints"):
        assert post_sched_hints(_FULL, "ns/job") is False
    assert "could not post" in caplog.text


def test_invalid_hints_raise_before_any_request(
    monkeypatch: pytest.MonkeyPatch, supervisor: _Server
) -> None:
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", supervisor.url)
    with pytest.raises(ValueError, match="unknown keys"):
        post_sched_hints({"initBatchSize": 1, "bogus": 2}, "ns/job")
    with pytest.raises(ValueError, match=r"initBatchSize\) must be >= 0"):
        post_sched_hints({"initBatchSize": -1}, "ns/job")
    with pytest.raises(ValueError, match="job_key must be a non-empty"):
        post_sched_hints(_FULL, "")
    with pytest.raises(TypeError, match="job_key must be a str"):
        post_sched_hints(_FULL, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hints must be a SchedHints"):
        post_sched_hints([1, 2], "ns/job")  # type: ignore[arg-type]
    assert supervisor.requests == []


def test_public_names() -> None:
    for name in sched_hints.__all__:
        assert hasattr(sched_hints, name), name
