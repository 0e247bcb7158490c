"""Elastic, adaptive-batch-size PyTorch training.

A training script needs four changes to run under AdaptDL (see the MNIST
tutorial in ``examples/mnist``)::

    adaptdl.torch.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model = adaptdl.torch.AdaptiveDataParallel(model, optimizer, scheduler)
    loader = adaptdl.torch.AdaptiveDataLoader(dataset, batch_size=128, shuffle=True)
    for epoch in adaptdl.torch.remaining_epochs_until(epochs):
        for batch in loader:
            ...

The job can then be stopped at any step (SIGINT, SIGTERM or
:func:`request_checkpoint`) and restarted with any number of replicas; it
resumes at the same epoch and sample.

Importing this package has no side effects: signal handlers are installed the
first time an epoch or data-loader loop runs.
"""

from __future__ import annotations

import atexit
import json
import logging
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed

import adaptdl
from adaptdl import collective, env
from adaptdl.torch._signal import request_checkpoint
from adaptdl.torch.accumulator import Accumulator
from adaptdl.torch.data import (
    AdaptiveDataLoader,
    AdaptiveDataLoaderHelper,
    AdaptiveDataLoaderMixin,
    ElasticSampler,
    current_dataloader,
)
from adaptdl.torch.epoch import current_epoch, finished_epochs, remaining_epochs_until

if TYPE_CHECKING:
    from adaptdl.torch.parallel import AdaptiveDataParallel

__all__ = [
    "Accumulator",
    "AdaptiveDataLoader",
    "AdaptiveDataLoaderHelper",
    "AdaptiveDataLoaderMixin",
    "AdaptiveDataParallel",
    "ElasticSampler",
    "current_dataloader",
    "current_epoch",
    "finished_epochs",
    "init_process_group",
    "remaining_epochs_until",
    "request_checkpoint",
]

logger = logging.getLogger(__name__)

# Seconds one discovery request may wait; the supervisor answers 408 earlier
# when the pods are not all up yet, and we simply ask again.
_DISCOVER_TIMEOUT = 60.0
_DISCOVER_DEADLINE = 600.0
# Pause before asking again after a network error (the supervisor restarting,
# a refused connection), doubled up to the cap: a 408 is re-asked at once.
_DISCOVER_BACKOFF = 1.0
_DISCOVER_BACKOFF_MAX = 15.0


def __getattr__(name: str) -> Any:
    # AdaptiveDataParallel imports a good part of torch.nn.parallel; load it on
    # first use so `import adaptdl.torch` stays light for data-only users.
    if name == "AdaptiveDataParallel":
        from adaptdl.torch.parallel import AdaptiveDataParallel

        return AdaptiveDataParallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _semver_major(version: str | None) -> int | None:
    """The major version of a ``MAJOR.MINOR.PATCH[...]`` string; None if not semver or 0.0.0."""
    if not version:
        return None
    core = version.strip().lstrip("v").split("+")[0].split("-")[0]
    parts = core.split(".")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    if all(int(part) == 0 for part in parts):
        return None
    return int(parts[0])


def _check_versions() -> None:
    trainer = adaptdl.__version__
    sched = env.adaptdl_sched_version()
    trainer_major, sched_major = _semver_major(trainer), _semver_major(sched)
    if trainer_major is not None and sched_major is not None and trainer_major != sched_major:
        raise RuntimeError(
            f"adaptdl {trainer} in this job is incompatible with the scheduler's "
            f"ADAPTDL_SCHED_VERSION={sched}: the major versions must match"
        )


def _parse_tcp(init_method: object) -> tuple[str, int]:
    if not isinstance(init_method, str):
        raise TypeError(
            "init_method must be a 'tcp://host:port' string or None, got "
            f"{type(init_method).__name__}: {init_method!r}"
        )
    usage = (
        "init_method must look like 'tcp://host:port' (IPv6: 'tcp://[::1]:port'), "
        f"got {init_method!r}"
    )
    try:
        parsed = urllib.parse.urlparse(init_method)
        host, port = parsed.hostname, parsed.port
    except ValueError as exc:  # a bad port or an unclosed IPv6 bracket
        raise ValueError(f"{usage}: {exc}") from None
    if parsed.scheme != "tcp" or not host or port is None or port == 0:
        raise ValueError(usage)
    return host, port


def _url_host(host: str) -> str:
    """``host`` as it goes into a URL: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _discover_master(url: str, job_id: str, num_restarts: int) -> str:
    """Ask the supervisor for rank 0's address (a long poll, retried while it answers 408).

    Network errors (refused connections, timeouts) are retried with a growing
    pause until the deadline, since the supervisor may be restarting, and so
    is a 503 (too many connections, or a supervisor shutting down); another
    HTTP error other than 408 is final. Either way the error names the URL and
    the environment variable it came from.
    """
    # ``url`` comes from env.supervisor_url(), which checked it.
    request_url = f"{url}/discover/{urllib.parse.quote(job_id, safe='/')}/{num_restarts}"
    # The supervisor is inside the cluster: an HTTP(S)_PROXY set for the
    # job's downloads must not carry discovery (sched_hints does the same).
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {}
    token = env.job_token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    start = time.monotonic()
    deadline = start + _DISCOVER_DEADLINE
    pause = _DISCOVER_BACKOFF
    request = urllib.request.Request(request_url, headers=headers, method="GET")  # noqa: S310
    while True:
        left = deadline - time.monotonic()
        try:
            with opener.open(request, timeout=max(min(_DISCOVER_TIMEOUT, left), 0.1)) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 408 and time.monotonic() < deadline:
                continue
            if exc.code == 503 and time.monotonic() + pause < deadline:
                # Busy (too many connections) or restarting: ask again later.
                logger.warning("discovery at %s answered 503; retrying in %g s", url, pause)
                time.sleep(pause)
                pause = min(pause * 2, _DISCOVER_BACKOFF_MAX)
                continue
            raise RuntimeError(
                f"discovery of rank 0 at {request_url} failed with HTTP {exc.code}"
            ) from exc
        except OSError as exc:
            # URLError (an OSError) wraps refused connections and DNS
            # failures; a timed-out read raises TimeoutError directly.
            reason = getattr(exc, "reason", exc)
            if time.monotonic() + pause >= deadline:
                raise RuntimeError(
                    f"discovery of rank 0 at {request_url} gave up after "
                    f"{time.monotonic() - start:.0f} s: {reason}; check ADAPTDL_SUPERVISOR_URL"
                ) from exc
            logger.warning("discovery at %s failed (%s); retrying in %g s", url, reason, pause)
            time.sleep(pause)
            pause = min(pause * 2, _DISCOVER_BACKOFF_MAX)
            continue
        try:
            addresses = json.loads(body.decode())
        except ValueError as exc:  # not UTF-8, or not JSON
            raise RuntimeError(
                f"discovery at {request_url} returned a body that is not JSON: {exc}"
            ) from exc
        if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
            raise RuntimeError(
                f"discovery at {request_url} returned {addresses!r}; expected a list of addresses"
            )
        return addresses[0]


def _free_port(host: str = "") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


# Devices each built-in torch.distributed backend can serve. Backends
# registered by plugins (``Backend.register_backend``) are accepted when
# ``is_backend_available`` says so, with their devices left to torch.
_BACKEND_DEVICES: dict[str, tuple[str, ...]] = {
    "gloo": ("cpu", "cuda"),
    "nccl": ("cuda",),
    "mpi": ("cpu", "cuda"),
    "ucc": ("cpu", "cuda"),
}


def _check_backend_name(name: str, device: str | None, backend: str) -> None:
    """Check that backend ``name`` can run here (and serve ``device``, if given).

    Raises:
        ValueError: unknown or unavailable backend, a device it cannot serve,
            or NCCL without CUDA; the message names ``backend``.
    """
    devices = _BACKEND_DEVICES.get(name)
    if device is not None and devices is not None and device not in devices:
        raise ValueError(
            f"backend={backend!r}: {name!r} cannot serve device {device!r}; it supports "
            f"{', '.join(repr(d) for d in devices)}"
        )
    where = f" (in '{device}:{name}')" if device else ""
    if not torch.distributed.is_backend_available(name):
        usable = [b for b in _BACKEND_DEVICES if torch.distributed.is_backend_available(b)]
        kind = "not available in this PyTorch build" if name in _BACKEND_DEVICES else "unknown"
        raise ValueError(
            f"backend={backend!r}: {name!r}{where} is {kind}; usable here: "
            f"{', '.join(repr(b) for b in usable)} (or 'device:backend' pairs such as "
            "'cpu:gloo,cuda:nccl')"
        )
    if name == "nccl" and device in (None, "cuda") and not torch.cuda.is_available():
        raise ValueError(f"backend={backend!r}: 'nccl' needs CUDA, which is not available")


def _check_backend(backend: object) -> str:
    """Validate a ``torch.distributed`` backend string and return it normalised.

    Accepts a single backend (``"gloo"``) or comma-separated ``device:backend``
    pairs (``"cpu:gloo,cuda:nccl"``), case-insensitively and with spaces around
    the parts. Every backend named must be usable in this PyTorch build, so a
    missing one fails here rather than after the replicas have connected.

    Raises:
        TypeError: ``backend`` is not a string.
        ValueError: an unknown or unavailable backend, a malformed or
            duplicate pair, a backend that cannot serve the device, or NCCL
            without CUDA.
    """
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a string or None, got {type(backend).__name__}: {backend!r}"
        )
    text = backend.strip().lower()
    if ":" not in text and "," not in text:
        _check_backend_name(text, None, backend)
        return text
    pairs: dict[str, str] = {}
    for part in text.split(","):
        device, sep, name = (piece.strip() for piece in part.partition(":"))
        if not sep or not device or not name or ":" in name:
            raise ValueError(
                f"backend={backend!r}: {part.strip()!r} is not a 'device:backend' pair "
                "(expected e.g. 'cpu:gloo,cuda:nccl')"
            )
        if device in pairs:
            raise ValueError(f"backend={backend!r}: device {device!r} is given twice")
        _check_backend_name(name, device, backend)
        pairs[device] = name
    return ",".join(f"{device}:{name}" for device, name in pairs.items())


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
) -> None:
    """Start the AdaptDL collectives and the default ``torch.distributed`` group.

    Rank 0's address comes from, in order: ``init_method`` (``tcp://host:port``),
    the supervisor (``ADAPTDL_SUPERVISOR_URL``, asked for job
    ``ADAPTDL_JOB_ID`` and restart ``ADAPTDL_NUM_RESTARTS``), or
    ``ADAPTDL_MASTER_ADDR``/``ADAPTDL_MASTER_PORT``. With none of them set the
    job runs as a single local replica. The ``torch.distributed`` port is picked
    by rank 0 and shared through the AdaptDL collectives, so only one port has
    to be known in advance.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"mpi"``, ``"ucc"``, comma-separated
            ``device:backend`` pairs such as ``"cpu:gloo,cuda:nccl"`` (each
            device's collectives use its own backend), or None to pick
            ``nccl`` when CUDA is available and ``gloo`` otherwise.
        init_method: optional ``tcp://host:port`` of rank 0's AdaptDL collectives.
        world_size: number of replicas (default ``ADAPTDL_NUM_REPLICAS``).
        rank: this replica's rank (default ``ADAPTDL_REPLICA_RANK``). Both
            are exported to those variables once connected, so loaders
            created earlier (as in the tutorial) follow them.

    Raises:
        TypeError: ``backend`` is not a string or None.
        ValueError: an argument is invalid (e.g. an unknown backend, or a
            malformed or duplicate ``device:backend`` pair), or
            ``ADAPTDL_SUPERVISOR_URL`` is not an http(s) URL.
        RuntimeError: version mismatch with the scheduler, failed discovery,
            or already initialized.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    backend = _check_backend(backend)
    num_replicas = env.num_replicas() if world_size is None else world_size
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    # A rank from the environment is checked against the explicit world size,
    # not against ADAPTDL_NUM_REPLICAS (which a launcher may not have set).
    replica_rank = env.replica_rank(num_replicas) if rank is None else rank
    if (
        isinstance(replica_rank, bool)
        or not isinstance(replica_rank, int)
        or not 0 <= replica_rank < num_replicas
    ):
        raise ValueError(f"rank must be an int in [0, {num_replicas}), got {rank!r}")
    _check_versions()
    if collective.is_initialized():
        # Before anything changes: a rejected call leaves the process as it was.
        raise RuntimeError(
            "adaptdl.collective is already initialized; init_process_group may be called "
            "only once per process"
        )
    if torch.distributed.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized; adaptdl.torch.init_process_group "
            "creates the default process group itself, so call it instead of "
            "torch.distributed.init_process_group, not after it"
        )

    port = env.master_port()
    if init_method is not None:
        master_addr, port = _parse_tcp(init_method)
    elif env.supervisor_url() is not None and env.job_id() is not None:
        master_addr = _discover_master(
            env.supervisor_url() or "", env.job_id() or "", env.num_restarts()
        )
    else:
        master_addr = env.master_addr()
    if master_addr in ("0.0.0.0", ""):  # noqa: S104 - "listen anywhere", connect locally
        master_addr = "127.0.0.1"
    elif master_addr == "::":
        master_addr = "::1"

    collective.initialize(master_addr, port, replica_rank, num_replicas)
    # Rank 0 serves the collectives; flush them before the interpreter exits so
    # the other replicas are not cut off in the middle of the last one.
    atexit.register(collective.close_at_exit)
    try:
        torch_port = collective.broadcast(_free_port(master_addr) if replica_rank == 0 else None)
        url = f"tcp://{_url_host(master_addr)}:{torch_port}"
        logger.info(
            "initializing torch.distributed (%s) at %s, rank %d of %d",
            backend,
            url,
            replica_rank,
            num_replicas,
        )
        torch.distributed.init_process_group(
            backend, init_method=url, world_size=num_replicas, rank=replica_rank
        )
    except BaseException:
        # Leave the process as it was, so the real cause is not hidden by
        # "already initialized" when the caller retries.
        collective.close_at_exit()
        raise
    logger.info("torch.distributed initialized")
