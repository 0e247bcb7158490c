"""init_process_group: standalone, environment, init_method, discovery, versions."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import adaptdl.torch as adt
from adaptdl import collective, env
from adaptdl.testing import free_port, run_elastic


@pytest.fixture
def destroy_group() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_public_api() -> None:
    for name in (
        "init_process_group",
        "current_epoch",
        "finished_epochs",
        "remaining_epochs_until",
        "current_dataloader",
        "AdaptiveDataLoader",
        "ElasticSampler",
        "Accumulator",
        "AdaptiveDataParallel",
    ):
        assert name in adt.__all__
    with pytest.raises(AttributeError, match="no_such_name"):
        adt.no_such_name  # noqa: B018


def test_standalone_without_environment(destroy_group: None) -> None:
    adt.init_process_group("gloo")
    assert collective.is_initialized()
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
    assert collective.broadcast(7) == 7


def test_init_method(destroy_group: None) -> None:
    adt.init_process_group(None, init_method=f"tcp://127.0.0.1:{free_port()}")
    assert dist.get_backend() == "gloo"


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:gloo", " CPU:Gloo , cuda:gloo ", "cpu:gloo"])
def test_device_backend_pairs_are_accepted(backend: str, destroy_group: None) -> None:
    adt.init_process_group(backend)
    expected = backend.replace(" ", "").lower()
    assert dist.get_backend() == expected
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    assert tensor.tolist() == [1.0, 1.0]


@pytest.mark.skipif(
    not (dist.is_nccl_available() and torch.cuda.is_available()),
    reason="needs a CUDA build of PyTorch with NCCL and a GPU (CI pins the CPU wheel)",
)
def test_cpu_gloo_cuda_nccl(destroy_group: None) -> None:
    adt.init_process_group("cpu:gloo,cuda:nccl")
    assert dist.get_backend() == "cpu:gloo,cuda:nccl"
    for device in ("cpu", "cuda"):
        tensor = torch.ones(2, device=device)
        dist.all_reduce(tensor)
        assert tensor.tolist() == [1.0, 1.0]


@pytest.mark.skipif(dist.is_nccl_available(), reason="this PyTorch build has NCCL")
def test_cuda_nccl_pair_without_nccl_is_rejected() -> None:
    missing = r"'nccl' \(in 'cuda:nccl'\) is not available in this PyTorch build"
    with pytest.raises(ValueError, match=missing):
        adt.init_process_group("cpu:gloo,cuda:nccl")


@pytest.mark.parametrize("name", ["ucc", "mpi", "nccl"])
def test_backends_missing_from_this_build_are_rejected_up_front(name: str) -> None:
    if dist.is_backend_available(name):
        pytest.skip(f"this PyTorch build has {name}")
    for backend in (name, f"cuda:{name}"):
        with pytest.raises(ValueError, match=f"'{name}'.* is not available in this PyTorch build"):
            adt.init_process_group(backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
def test_nccl_needs_cuda_in_both_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_backend_available", lambda name: True)
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        with pytest.raises(ValueError, match="'nccl' needs CUDA"):
            adt.init_process_group(backend)


def test_backend_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="backend must be a string or None, got int: 3"):
        adt.init_process_group(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "bogus"}, "backend"),
        ({"backend": "cpu:gloo,cuda"}, "'cuda' is not a 'device:backend' pair"),
        ({"backend": "cpu:gloo,"}, "'' is not a 'device:backend' pair"),
        ({"backend": "cpu:gloo:x"}, "'cpu:gloo:x' is not a 'device:backend' pair"),
        ({"backend": "cpu:bogus"}, r"'bogus' \(in 'cpu:bogus'\) is unknown; usable here: 'gloo'"),
        ({"backend": "tpu:gloo"}, "'gloo' cannot serve device 'tpu'"),
        ({"backend": "cpu:nccl"}, "'nccl' cannot serve device 'cpu'"),
        ({"backend": "cpu:gloo,CPU:ucc"}, "device 'cpu' is given twice"),
        ({"backend": "gloo", "init_method": "http://x:1"}, "tcp://host:port"),
        ({"backend": "gloo", "world_size": 0}, "world_size"),
        ({"backend": "gloo", "world_size": 2, "rank": 2}, "rank"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        adt.init_process_group(**kwargs)


@pytest.mark.parametrize(
    ("init_method", "detail"),
    [
        ("tcp://127.0.0.1:99999", "out of range"),
        ("tcp://127.0.0.1:abc", "could not be cast"),
        ("tcp://[::1", "Invalid IPv6"),
        ("tcp://127.0.0.1:0", "127.0.0.1:0"),
    ],
)
def test_malformed_init_method_is_named(init_method: str, detail: str) -> None:
    # urllib's own errors ("Port out of range 0-65535") did not say which
    # argument was wrong.
    with pytest.raises(ValueError, match=rf"init_method must look like .*{detail}"):
        adt.init_process_group("gloo", init_method=init_method)
    with pytest.raises(TypeError, match="init_method must be a 'tcp://host:port' string"):
        adt.init_process_group("gloo", init_method=5)  # type: ignore[arg-type]
    assert not collective.is_initialized()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("how", ["init_method", "environment"])
def test_ipv6_master_address(
    how: str, monkeypatch: pytest.MonkeyPatch, destroy_group: None
) -> None:
    # The torch.distributed URL put the address in without brackets, so
    # "tcp://::1:port" failed to parse.
    port = free_port()
    try:
        if how == "init_method":
            adt.init_process_group("gloo", init_method=f"tcp://[::1]:{port}")
        else:
            monkeypatch.setenv("ADAPTDL_MASTER_ADDR", "::1")
            monkeypatch.setenv("ADAPTDL_MASTER_PORT", str(port))
            adt.init_process_group("gloo")
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        assert tensor.tolist() == [1.0, 1.0]
    finally:
        collective.teardown()


def test_a_failed_torch_init_leaves_nothing_initialized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The collectives stayed connected, so a retry said "already
    # initialized" instead of the real cause.
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated rendezvous failure")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    with pytest.raises(RuntimeError, match="simulated rendezvous failure"):
        adt.init_process_group("gloo")
    assert not collective.is_initialized()
    monkeypatch.undo()
    try:
        adt.init_process_group("gloo")
        assert dist.is_initialized()
    finally:
        collective.teardown()
        dist.destroy_process_group()


def test_a_default_group_created_by_torch_is_refused_up_front(destroy_group: None) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0
    )
    with pytest.raises(RuntimeError, match="torch.distributed is already initialized"):
        adt.init_process_group("gloo")
    assert not collective.is_initialized()


def test_major_version_mismatch_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("adaptdl.__version__", "1.2.3")
    monkeypatch.setenv("ADAPTDL_SCHED_VERSION", "2.0.0")
    with pytest.raises(RuntimeError, match="major versions must match"):
        adt.init_process_group("gloo")
    from adaptdl.torch import _check_versions

    # The same major version passes; 0.0.0 and non-semver versions are not checked.
    for version in ("1.9.0", "0.0.0", "nightly", "2.x"):
        monkeypatch.setenv("ADAPTDL_SCHED_VERSION", version)
        _check_versions()


class _Supervisor(http.server.BaseHTTPRequestHandler):
    """Refuses the first ``timeouts`` requests with ``refusal``, then answers."""

    requests: list[tuple[str, str | None]] = []
    timeouts = 2
    refusal = 408
    port = 0

    def do_GET(self) -> None:  # noqa: N802
        type(self).requests.append((self.path, self.headers.get("Authorization")))
        if type(self).timeouts > 0:
            type(self).timeouts -= 1
            self.send_response(type(self).refusal)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps(["127.0.0.1", "10.0.0.2"]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_discovery_through_the_supervisor(
    monkeypatch: pytest.MonkeyPatch, destroy_group: None
) -> None:
    _fast_retries(monkeypatch, 30.0)  # a broken supervisor fails the test, not hangs it
    with _serving(_Supervisor) as port:
        monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", f"http://127.0.0.1:{port}/")
        monkeypatch.setenv("ADAPTDL_JOB_ID", "ns/job")
        monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "3")
        monkeypatch.setenv("ADAPTDL_JOB_TOKEN", "secret")
        monkeypatch.setenv("ADAPTDL_MASTER_ADDR", "192.0.2.1")  # must not be used
        adt.init_process_group("gloo")
    assert _Supervisor.requests == [("/discover/ns/job/3", "Bearer secret")] * 3
    assert dist.is_initialized()


class _NotJson(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"<html>proxy error</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Ready(_Supervisor):
    """Answers at once (its own request log, so tests do not share one)."""

    requests: list[tuple[str, str | None]] = []
    timeouts = 0


@contextlib.contextmanager
def _serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    """Run ``handler`` on a local port in a thread; yields the port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def _fast_retries(monkeypatch: pytest.MonkeyPatch, deadline: float) -> None:
    import adaptdl.torch as module

    monkeypatch.setattr(module, "_DISCOVER_DEADLINE", deadline)
    monkeypatch.setattr(module, "_DISCOVER_BACKOFF", 0.1)
    monkeypatch.setattr(module, "_DISCOVER_BACKOFF_MAX", 0.2)


def test_discovery_of_an_unreachable_supervisor_fails_with_the_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from adaptdl.torch import _discover_master

    _fast_retries(monkeypatch, 1.0)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"discover/ns/job/0 gave up after \d+ s: .*ADAPTDL_SUPERVISOR"
    ):
        _discover_master(url, "ns/job", 0)
    assert time.monotonic() - start < 10


def test_discovery_retries_until_the_supervisor_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptdl.torch import _discover_master

    _fast_retries(monkeypatch, 30.0)
    port = free_port()
    started = threading.Event()
    servers: list[http.server.ThreadingHTTPServer] = []

    def start_late() -> None:
        time.sleep(0.5)  # the first requests are refused
        servers.append(http.server.ThreadingHTTPServer(("127.0.0.1", port), _Ready))
        started.set()
        servers[0].serve_forever()

    threading.Thread(target=start_late, daemon=True).start()
    try:
        assert _discover_master(f"http://127.0.0.1:{port}", "ns/job", 2) == "127.0.0.1"
    finally:
        started.wait(timeout=10)
        for server in servers:
            server.shutdown()
            server.server_close()
    assert _Ready.requests == [("/discover/ns/job/2", None)]


def test_discovery_url_without_a_scheme_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_SUPERVISOR_URL", "localhost:8080")
    monkeypatch.setenv("ADAPTDL_JOB_ID", "ns/job")
    with pytest.raises(
        env.EnvironmentVariableError, match=r"ADAPTDL_SUPERVISOR_URL='localhost:8080' is invalid"
    ):
        adt.init_process_group("gloo")
    assert not collective.is_initialized()


def test_discovery_ignores_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptdl.torch import _discover_master

    # A proxy that does not exist: discovery through it would fail.
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    _fast_retries(monkeypatch, 2.0)
    with _serving(_Ready) as port:
        assert _discover_master(f"http://127.0.0.1:{port}", "j", 0) == "127.0.0.1"


class _Busy(_Supervisor):
    """Answers 503 (too many connections) twice, then the addresses."""

    requests: list[tuple[str, str | None]] = []
    timeouts = 2
    refusal = 503


def test_discovery_retries_a_busy_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 503 (the supervisor's connection cap, reached while hundreds of
    # replicas wait in discovery) failed the replica and so its whole group.
    from adaptdl.torch import _discover_master

    _fast_retries(monkeypatch, 10.0)
    with _serving(_Busy) as port:
        assert _discover_master(f"http://127.0.0.1:{port}", "j", 0) == "127.0.0.1"
    assert _Busy.timeouts == 0 and len(_Busy.requests) == 3


def test_discovery_rejects_a_body_that_is_not_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptdl.torch import _discover_master

    with _serving(_NotJson) as port, pytest.raises(RuntimeError, match="not JSON"):
        _discover_master(f"http://127.0.0.1:{port}", "ns/job", 0)


def _job() -> Any:
    adt.init_process_group("gloo")
    value = collective.allreduce(env.replica_rank() + 1, lambda a, b: a + b)
    rank, size = dist.get_rank(), dist.get_world_size()
    collective.teardown()
    return value, rank, size


def test_replicas_from_the_environment() -> None:
    result = run_elastic(_job, 3, timeout=60)
    assert result.final.results == [(6, 0, 3), (6, 1, 3), (6, 2, 3)]


def _job_with_explicit_world_size() -> Any:
    import os

    # As a launcher that passes the size but leaves only the rank in the environment.
    os.environ.pop("ADAPTDL_NUM_REPLICAS", None)
    adt.init_process_group("gloo", world_size=2)
    rank, size = dist.get_rank(), dist.get_world_size()
    collective.teardown()
    return rank, size


def test_rank_from_the_environment_is_checked_against_the_explicit_world_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = run_elastic(_job_with_explicit_world_size, 2, timeout=60)
    assert result.final.results == [(0, 2), (1, 2)]
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", "2")
    monkeypatch.delenv("ADAPTDL_NUM_REPLICAS", raising=False)
    with pytest.raises(env.EnvironmentVariableError, match="num_replicas=2"):
        adt.init_process_group("gloo", world_size=2)


def _tutorial_order_job() -> list[int]:
    import os

    # A launcher that passes the topology as arguments; the loader is created
    # first, as in the tutorial.
    rank, replicas = env.replica_rank(), env.num_replicas()
    port = env.master_port()
    del os.environ["ADAPTDL_REPLICA_RANK"], os.environ["ADAPTDL_NUM_REPLICAS"]
    loader = adt.AdaptiveDataLoader(torch.utils.data.TensorDataset(torch.arange(20)), 4)
    adt.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=replicas, rank=rank
    )
    seen = [int(x) for (batch,) in loader for x in batch]
    collective.teardown()
    return seen


def test_loader_created_before_explicit_topology_follows_it() -> None:
    shares = run_elastic(_tutorial_order_job, 2, timeout=60).final.results
    assert len(shares[0]) == len(shares[1]) == 10
    assert sorted(shares[0] + shares[1]) == list(range(20))


def test_rejected_second_call_changes_nothing(destroy_group: None) -> None:
    adt.init_process_group("gloo")
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            adt.init_process_group("gloo", world_size=3, rank=2)
        assert (env.num_replicas(), env.replica_rank()) == (1, 0)
    finally:
        collective.teardown()


def _train_a_step() -> str:
    adt.init_process_group("gloo")
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model = adt.AdaptiveDataParallel(net, optimizer)
    loader = adt.AdaptiveDataLoader(torch.utils.data.TensorDataset(torch.ones(8, 2)), batch_size=4)
    for _ in adt.remaining_epochs_until(1):
        for (x,) in loader:
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
    # Not an int: rank 0 returning one would ask the harness for a restart.
    return f"world size {dist.get_world_size()}"


def test_the_harness_refuses_to_fork_an_initialized_default_group(destroy_group: None) -> None:
    # A replica forked after in-process training failed with "trying to
    # initialize the default process group twice".
    _train_a_step()
    with pytest.raises(RuntimeError, match=r"destroy_process_group\(\).*start_method='spawn'"):
        run_elastic(_train_a_step, 2)
    # With the group destroyed, the AdaptDL state the replicas inherit (the
    # loader and epoch registrations, the collectives) is forgotten in them.
    dist.destroy_process_group()
    assert run_elastic(_train_a_step, 2, timeout=60).final.results == ["world size 2"] * 2
