"""The supervisor's replica endpoints demand the job token; the API its admin token."""

from __future__ import annotations

import json
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from adaptdl.cluster import LocalBackend, Phase, Supervisor
from tests.cluster.conftest import InProcessCluster, counter_spec, wait_for


def _call(url: str, method: str = "GET", token: str | None = None, body: Any = None) -> Any:
    request = urllib.request.Request(
        url, method=method, data=None if body is None else json.dumps(body).encode()
    )
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_healthz(local_cluster: InProcessCluster) -> None:
    assert _call(f"{local_cluster.supervisor.url}/healthz") == (
        200,
        {"status": "ok", "pid": os.getpid()},
    )


def test_a_client_ignores_another_daemon_on_a_stale_records_port(
    local_cluster: InProcessCluster, tmp_path: Path
) -> None:
    from adaptdl.cluster._client import ClusterClient, DaemonNotRunningError

    home = tmp_path / "other-home"
    home.mkdir()
    record = {"url": local_cluster.supervisor.url, "token": "stale", "pid": os.getpid()}
    (home / "daemon.json").write_text(json.dumps(record))
    assert ClusterClient(home).healthy()
    # The recorded daemon died and another one (this test's) took its port.
    (home / "daemon.json").write_text(json.dumps({**record, "pid": 2**22 + 7}))
    with pytest.raises(DaemonNotRunningError, match="is not reachable"):
        ClusterClient(home)


def test_discovery_and_hints_need_the_job_token(local_cluster: InProcessCluster) -> None:
    url = local_cluster.supervisor.url
    # A paused job (maxReplicas... minReplicas 0 and no allocation yet) is enough here.
    spec = counter_spec("auth", "--steps", "400", "--step-time", "0.05")
    local_cluster.backend.submit(spec)
    token = local_cluster.backend.token("auth")

    for path, method, body in [
        ("/discover/auth/0?timeout=0.1", "GET", None),
        ("/hints/auth", "PUT", {"maxProfiledReplicas": 1}),
    ]:
        status, payload = _call(url + path, method, None, body)
        assert status == 401, payload
        assert "missing job token" in payload["error"]
        status, payload = _call(url + path, method, "not-the-token", body)
        assert status == 403 and "wrong job token" in payload["error"]

    # Without the job's token nobody learns whether a job exists: 401, not 404.
    for bearer in (None, token, "not-the-token"):
        for path, method, body in [
            ("/discover/nosuchjob/0?timeout=0.1", "GET", None),
            ("/hints/nosuchjob", "PUT", {"maxProfiledReplicas": 1}),
        ]:
            status, payload = _call(url + path, method, bearer, body)
            assert status == 401, (bearer, path, payload)

    wait_for(lambda: local_cluster.status("auth").phase is Phase.RUNNING, 20, "job running")
    group = local_cluster.status("auth").restarts
    status, payload = _call(f"{url}/discover/auth/{group}?timeout=5", "GET", token)
    assert (status, payload) == (200, ["127.0.0.1"])
    # A group that does not exist (yet) times out with 408, so clients retry.
    status, _ = _call(f"{url}/discover/auth/{group + 5}?timeout=0.2", "GET", token)
    assert status == 408
    # A timeout that would never expire is refused, not waited on forever.
    status, payload = _call(f"{url}/discover/auth/{group + 5}?timeout=nan", "GET", token)
    assert status == 400 and "timeout must be numbers" in payload["error"]
    status, _ = _call(f"{url}/discover/auth/{group + 5}?timeout=-inf", "GET", token)
    assert status == 408  # no wait at all

    status, payload = _call(f"{url}/hints/auth", "PUT", token, {"maxProfiledReplicas": 2})
    assert status == 200, payload
    assert local_cluster.status("auth").hints == {**payload["hints"]}
    assert local_cluster.status("auth").hints["maxProfiledReplicas"] == 2
    status, payload = _call(f"{url}/hints/auth", "PUT", token, {"noSuchHint": 1})
    assert status == 400 and "noSuchHint" in payload["error"]


def test_api_needs_the_admin_token(local_cluster: InProcessCluster) -> None:
    url = local_cluster.supervisor.url
    assert _call(f"{url}/api/jobs")[0] == 401
    assert _call(f"{url}/api/jobs", token="wrong")[0] == 403
    status, payload = _call(f"{url}/api/jobs", token=local_cluster.supervisor.admin_token)
    assert (status, payload) == (200, [])


@pytest.mark.parametrize("body", [{"name": "x"}, {"name": "Bad Name", "command": ["python"]}])
def test_api_rejects_bad_specs(local_cluster: InProcessCluster, body: dict[str, Any]) -> None:
    url = local_cluster.supervisor.url
    status, payload = _call(f"{url}/api/jobs", "POST", local_cluster.supervisor.admin_token, body)
    assert status == 400, payload
    assert local_cluster.backend.jobs() == {}


@pytest.mark.parametrize("working_dir", [".", "project", None])
def test_api_refuses_a_relative_working_dir(
    local_cluster: InProcessCluster, working_dir: str | None
) -> None:
    # The daemon resolved it against its own directory (the cluster home), so
    # the job was accepted and then failed to find its script.
    url, token = local_cluster.supervisor.url, local_cluster.supervisor.admin_token
    body = counter_spec("rel").to_json()
    if working_dir is None:
        del body["workingDir"]
    else:
        body["workingDir"] = working_dir
    status, payload = _call(f"{url}/api/jobs", "POST", token, body)
    assert status == 400, payload
    assert f"workingDir={working_dir!r}: expected an absolute path" in payload["error"]
    assert local_cluster.backend.jobs() == {}


def test_a_full_state_database_is_reported_with_what_to_do(
    local_cluster: InProcessCluster,
) -> None:
    """sqlite's "database or disk is full" becomes 507 naming the home, not a bare 500."""
    store = local_cluster.backend.store
    with store.transaction():
        pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
        store._conn.execute(f"PRAGMA max_page_count = {pages}")  # as if the disk were full
    url, token = local_cluster.supervisor.url, local_cluster.supervisor.admin_token
    spec = counter_spec("full", env={"PAD": "x" * 100_000})  # needs new pages
    status, payload = _call(f"{url}/api/jobs", "POST", token, spec.to_json())
    assert status == 507, payload
    assert "could not update its state database in" in payload["error"]
    assert str(local_cluster.home) in payload["error"]
    assert "disk is full" in payload["error"] and "free some disk space" in payload["error"]
    # Nothing half-made: no row, no event, no directories.
    assert local_cluster.backend.jobs() == {} and store.events("full") == []
    assert not local_cluster.backend.job_dir("full").exists()


def test_home_and_secrets_are_private(local_cluster: InProcessCluster, tmp_path: Path) -> None:
    """Job tokens (state.db) and the admin token (daemon.json) are owner-only."""
    home = local_cluster.home
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "state.db").stat().st_mode) == 0o600
    # An existing home of ours with loose permissions is tightened.
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    (loose / "state.db").touch(mode=0o644)
    os.chmod(loose / "state.db", 0o644)
    backend = LocalBackend(loose, slots=1, gpus=[])
    try:
        assert stat.S_IMODE(loose.stat().st_mode) == 0o700
        assert stat.S_IMODE((loose / "state.db").stat().st_mode) == 0o600
    finally:
        backend.shutdown(stop_jobs=False)


@pytest.mark.parametrize("body", [[1], "stop", 3])
def test_shutdown_rejects_a_body_that_is_not_an_object(
    local_cluster: InProcessCluster, body: Any
) -> None:
    url = local_cluster.supervisor.url
    status, payload = _call(
        f"{url}/api/shutdown", "POST", local_cluster.supervisor.admin_token, body
    )
    assert status == 400 and "JSON object" in payload["error"], payload


def test_stopping_closes_the_service_before_the_store(tmp_path: Path) -> None:
    """An in-flight long poll ends with 503, never with a 500 from a closed database."""
    import threading

    from adaptdl.cluster._daemon import stop_services

    backend = LocalBackend(tmp_path / "home", slots=1, gpus=[])
    supervisor = Supervisor(backend, admin_token="admin")
    supervisor.start()
    backend.submit(counter_spec("idle"))  # never allocated: discovery waits
    token = backend.token("idle")
    answers: list[Any] = []
    poll = threading.Thread(
        target=lambda: answers.append(
            _call(f"{supervisor.url}/discover/idle/0?timeout=30", token=token)
        )
    )
    poll.start()
    wait_for(lambda: supervisor._in_flight == 1, 10, "the poll to be in flight")
    stop_services(backend, supervisor, stop_jobs=True)
    poll.join(10)
    assert answers and answers[0][0] == 503, answers


def test_a_daemon_shutting_down_refuses_new_jobs(local_cluster: InProcessCluster) -> None:
    # It accepted them while draining, said "submitted", then exited without
    # starting them.
    supervisor = local_cluster.supervisor
    url, token = supervisor.url, supervisor.admin_token
    spec = counter_spec("before").to_json()
    assert _call(f"{url}/api/jobs", "POST", token, spec)[0] == 201
    assert _call(f"{url}/api/cluster", "GET", token)[1]["draining"] is False
    assert _call(f"{url}/api/shutdown", "POST", token, {"stopJobs": True})[0] == 202
    # 'cluster start' reads this to wait rather than report a daemon about to exit.
    assert _call(f"{url}/api/cluster", "GET", token)[1]["draining"] is True
    status, payload = _call(f"{url}/api/jobs", "POST", token, counter_spec("late").to_json())
    assert status == 503 and "shutting down and would not start the job" in payload["error"]
    assert "late" not in local_cluster.backend.jobs()
    # Everything else is still served while the jobs drain.
    assert _call(f"{url}/api/jobs/before", "GET", token)[0] == 200


def _raw(url: str, request: bytes, timeout: float = 10.0) -> bytes:
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


@pytest.mark.parametrize("length", [b"-1", b"abc"])
def test_a_bad_content_length_is_refused_before_reading(
    local_cluster: InProcessCluster, length: bytes
) -> None:
    # -1 read the socket to its end: any caller could make the daemon hold
    # an unbounded body, before the token was checked.
    request = b"PUT /hints/x HTTP/1.1\r\nHost: h\r\nContent-Length: " + length + b"\r\n\r\n"
    answer = _raw(local_cluster.supervisor.url, request + b"x" * 1000)
    assert answer.startswith(b"HTTP/1.1 400")
    assert b"Content-Length" in answer and b"expected bytes >= 0" in answer


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 5000])
def test_json_nested_past_the_parsers_depth_is_a_bad_request(
    local_cluster: InProcessCluster, body: bytes
) -> None:
    # A RecursionError escaped as a 500 with a traceback in the daemon log,
    # for anyone who could reach the port, before any token was checked.
    head = (
        f"PUT /hints/nosuch HTTP/1.1\r\nHost: h\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    answer = _raw(local_cluster.supervisor.url, head.encode() + body)
    assert answer.startswith(b"HTTP/1.1 400") and b"request body is not valid JSON" in answer


def test_an_unread_body_is_never_taken_for_the_next_request(
    local_cluster: InProcessCluster,
) -> None:
    # After a 413 (body too large) or a chunked body (not decoded), the bytes
    # that followed were parsed as a second request on the same connection.
    url = local_cluster.supervisor.url
    smuggled = b"GET /healthz HTTP/1.1\r\nHost: h\r\n\r\n"
    big = b"PUT /hints/x HTTP/1.1\r\nHost: h\r\nContent-Length: 2000000\r\n\r\n"
    answer = _raw(url, big + smuggled)
    assert answer.startswith(b"HTTP/1.1 413") and answer.count(b"HTTP/1.1 ") == 1, answer
    assert b"\r\nConnection: close\r\n" in answer  # a keep-alive client must not reuse it
    chunked = (
        b"POST /api/shutdown HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n"
        b"Authorization: Bearer " + local_cluster.supervisor.admin_token.encode() + b"\r\n\r\n"
        b'12\r\n{"stopJobs": false}\r\n0\r\n\r\n'
    )
    answer = _raw(url, chunked + smuggled)
    assert answer.startswith(b"HTTP/1.1 501") and answer.count(b"HTTP/1.1 ") == 1, answer
    assert b"Transfer-Encoding 'chunked' is not supported" in answer
    assert not local_cluster.supervisor._draining.is_set()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"stopJobs": "false"}, "shutdown: stopJobs='false': expected true or false"),
        ({"stopjobs": False}, "shutdown: unknown field(s) stopjobs; valid: stopJobs"),
    ],
)
def test_a_shutdown_with_a_bad_field_is_refused(
    local_cluster: InProcessCluster, body: dict[str, Any], message: str
) -> None:
    # bool("false") is True: the jobs were stopped.
    supervisor = local_cluster.supervisor
    status, payload = _call(f"{supervisor.url}/api/shutdown", "POST", supervisor.admin_token, body)
    assert (status, payload["error"]) == (400, message)
    assert not supervisor._draining.is_set()


def test_other_methods_get_a_json_answer(local_cluster: InProcessCluster) -> None:
    status, payload = _call(f"{local_cluster.supervisor.url}/healthz", "PATCH")
    assert status == 404 and "no route for PATCH /healthz" in payload["error"]


def test_connections_beyond_the_cap_are_refused_at_once(
    local_cluster: InProcessCluster,
) -> None:
    # Idle connections had no limit: each held a thread and a descriptor, and
    # enough of them left the daemon none to start replicas with.
    import socket
    import threading
    from urllib.parse import urlsplit

    supervisor = local_cluster.supervisor
    supervisor.server._slots = threading.BoundedSemaphore(2)  # type: ignore[attr-defined]
    parts = urlsplit(supervisor.url)
    idle = [socket.create_connection((parts.hostname, parts.port)) for _ in range(2)]
    try:
        request = b"GET /healthz HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        answers: list[bytes] = []
        # The server accepts the idle two in its own time: ask until it refuses.
        wait_for(
            lambda: answers.append(_raw(supervisor.url, request)) or b" 503 " in answers[-1],
            10,
            "a refusal",
        )
        assert (
            answers[-1].startswith(b"HTTP/1.1 503") and b"too many open connections" in answers[-1]
        )
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: _call(f"{supervisor.url}/healthz")[0] == 200, 10, "a slot to free up")


def test_hints_without_a_usable_model_are_refused() -> None:
    # Each value is valid, but no micro-batch holds B0=128 without
    # accumulation (or the step times overflow): accepted with 200, they
    # then failed in every scheduling round with a traceback.
    from adaptdl.cluster import validate_hints

    perf = {
        "alpha_c": 0.01,
        "beta_c": 0.001,
        "alpha_n": 0.05,
        "beta_n": 1e-4,
        "alpha_r": 0.01,
        "beta_r": 5e-5,
        "gamma": 1.5,
    }
    capped = {"perfParams": perf, "initBatchSize": 128, "localBszBounds": [None, 64]}
    with pytest.raises(ValueError, match="^the hints give no usable goodput model: goodput at"):
        validate_hints(capped)
    huge = {"perfParams": {**perf, "alpha_c": 1e308, "beta_c": 1e308}, "initBatchSize": 128}
    with pytest.raises(ValueError, match="no usable goodput model.*underflows"):
        validate_hints(huge)
    assert validate_hints({**capped, "gradientAccumulation": True})["initBatchSize"] == 128


def test_an_idle_connection_is_closed(
    local_cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each one held a thread and a file descriptor for ever.
    import time

    from adaptdl.cluster import _supervisor

    monkeypatch.setattr(_supervisor._Handler, "timeout", 0.5)
    started = time.monotonic()
    assert _raw(local_cluster.supervisor.url, b"GET /healthz HTTP/1.1\r\n") == b""
    assert time.monotonic() - started < 5
