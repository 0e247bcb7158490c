"""The supervisor's replica endpoints demand the job token; the API its admin token."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from adaptdl.cluster import Phase
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
    assert _call(f"{local_cluster.supervisor.url}/healthz") == (200, {"status": "ok"})


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

    status, payload = _call(f"{url}/discover/nosuchjob/0", "GET", token)
    assert status == 404 and "nosuchjob" in payload["error"]

    wait_for(lambda: local_cluster.status("auth").phase is Phase.RUNNING, 20, "job running")
    group = local_cluster.status("auth").restarts
    status, payload = _call(f"{url}/discover/auth/{group}?timeout=5", "GET", token)
    assert (status, payload) == (200, ["127.0.0.1"])
    # A group that does not exist (yet) times out with 408, so clients retry.
    status, _ = _call(f"{url}/discover/auth/{group + 5}?timeout=0.2", "GET", token)
    assert status == 408

    status, payload = _call(f"{url}/hints/auth", "PUT", token, {"maxProfiledReplicas": 2})
    assert status == 200, payload
    assert local_cluster.status("auth").hints == {**payload["hints"]}
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
