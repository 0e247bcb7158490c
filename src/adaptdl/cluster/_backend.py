"""The backend interface: where jobs really run, behind one small API.

A backend owns the *mechanics* of a cluster (processes, pods, actors) and the
record of every job; the :class:`~adaptdl.cluster.Controller` owns the
*decisions*. The controller reads a snapshot (:meth:`Backend.nodes`,
:meth:`Backend.jobs`), asks a scheduling policy for allocations and hands them
back with :meth:`Backend.set_allocation`; :meth:`Backend.reconcile` then moves
each job towards its allocation (start, resize through checkpoint-restart,
stop) and reports what happened. Keeping this split means the same
controller and policies drive a laptop, a Ray cluster or Kubernetes.

Backends are found by name with :func:`get_backend`; a factory imports its
optional dependencies only when called.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from adaptdl import _registry
from adaptdl.cluster._spec import JobSpec
from adaptdl.sched import Allocation, NodeInfo

__all__ = [
    "ACTIVE_PHASES",
    "BUILTIN_BACKENDS",
    "Backend",
    "BackendError",
    "ClusterEvent",
    "JobExistsError",
    "JobNotFoundError",
    "JobStatus",
    "Phase",
    "UnauthorizedError",
    "backend_names",
    "get_backend",
    "register_backend",
]


class Phase(str, enum.Enum):
    """Life-cycle phase of a job (the names of the Kubernetes status field).

    ``Pending`` waits for an allocation or between two restart groups;
    ``Starting`` has launched replicas that are not all up yet; ``Running``
    trains; ``Stopping`` is checkpointing before a rescale, a restart after a
    failure, or a deletion.
    """

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    STOPPING = "Stopping"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


#: Phases whose jobs take part in scheduling.
ACTIVE_PHASES = frozenset({Phase.PENDING, Phase.STARTING, Phase.RUNNING, Phase.STOPPING})


class BackendError(RuntimeError):
    """A request to the backend cannot be carried out; the message says why."""


class JobNotFoundError(BackendError, KeyError):
    """No job with the given name (or job id) exists."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no job named {name!r}")
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])


class JobExistsError(BackendError):
    """A job of that name exists; a client may pick another name and submit again."""


class UnauthorizedError(BackendError):
    """A supervisor request carried no job token (``missing``) or a wrong one."""

    def __init__(self, message: str, *, missing: bool) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class JobStatus:
    """A snapshot of one job, as the controller and the CLI see it.

    Attributes:
        spec: The submitted specification.
        phase: Current life-cycle phase.
        reason: Short machine-readable reason for the phase (e.g. ``Failed``
            with ``ReplicaFailed``), or None.
        message: Human-readable detail (for a failed job, the traceback).
        submitted: Submission time (Unix seconds).
        started: When the first replica group started, or None.
        completed: When the job succeeded or failed, or None.
        allocation: The allocation the scheduler wants (one node per replica).
        replicas: Replicas of the group that runs now (0 when none).
        restarts: Restart groups started after the first (``ADAPTDL_NUM_RESTARTS``
            of the current group); -1 before the first start.
        failures: Replica failures so far (each costs one of ``max_restarts``).
        hints: The latest scheduling hints uploaded by the job, or None.
        attained_service: Slot-seconds the job has used.
        batch_size: Global batch size the goodput model expects at the current
            size, or None without a model.
        goodput: Predicted goodput (samples/s, statistically scaled), or None.
        paths: Named directories of the job (``checkpoint``, ``share``, ``logs``).
        not_before: While the backend holds a restart back (the delay after a
            group ended, longer after exits nobody asked for), when the next
            group may start (Unix seconds); None otherwise.
    """

    spec: JobSpec
    phase: Phase
    submitted: float
    reason: str | None = None
    message: str | None = None
    started: float | None = None
    completed: float | None = None
    allocation: Allocation = ()
    replicas: int = 0
    restarts: int = -1
    failures: int = 0
    hints: Mapping[str, Any] | None = None
    attained_service: float = 0.0
    batch_size: int | None = None
    goodput: float | None = None
    paths: Mapping[str, str] = field(default_factory=dict)
    not_before: float | None = None

    @property
    def name(self) -> str:
        """The job's name."""
        return self.spec.name

    def to_json(self) -> dict[str, Any]:
        """JSON form used by the HTTP API (no secrets)."""
        return {
            "name": self.name,
            "spec": self.spec.to_json(),
            "phase": self.phase.value,
            "reason": self.reason,
            "message": self.message,
            "submitted": self.submitted,
            "started": self.started,
            "completed": self.completed,
            "allocation": list(self.allocation),
            "replicas": self.replicas,
            "restarts": max(self.restarts, 0),
            "failures": self.failures,
            "hints": dict(self.hints) if self.hints is not None else None,
            "attainedService": self.attained_service,
            "batchSize": self.batch_size,
            "goodput": self.goodput,
            "paths": dict(self.paths),
            "notBefore": self.not_before,
        }


@dataclass(frozen=True)
class ClusterEvent:
    """Something that happened to a job, for the event log and the controller.

    ``kind`` is one of ``Submitted``, ``Started``, ``Running``, ``Rescaling``,
    ``Restarting``, ``ReplicaFailed``, ``Succeeded``, ``Failed``, ``Deleted``,
    ``Adopted``, ``Allocated``, ``Hints``; the controller re-plans on
    ``Submitted`` (arrival) and on completions (``Succeeded``, ``Failed``,
    ``Deleted``).
    """

    job: str
    kind: str
    message: str
    time: float


class Backend(ABC):
    """Where jobs run: replica processes, their records and their events.

    Implementations must be safe to call from several threads: the controller
    thread reconciles while the supervisor's request threads submit jobs,
    upload hints and answer discovery.

    The daemon (``adaptdl cluster start --backend NAME``) calls the
    registered factory with these keyword arguments, and a factory should
    accept (and may ignore) each of them:

    * ``home`` (:class:`pathlib.Path`): the cluster's home directory, where
      the backend keeps its records, checkpoints and logs;
    * ``slots`` (int or None): the replica slots to offer (``--slots``),
      None for the backend's own default;
    * ``grace_period`` (float): seconds a replica gets to checkpoint after
      SIGTERM before it is killed (``--grace``).

    Before the first :meth:`reconcile`, the daemon sets
    :attr:`supervisor_url`, which replicas need to reach the supervisor
    (``ADAPTDL_SUPERVISOR_URL``).
    """

    name: ClassVar[str] = ""
    #: The supervisor's URL (set by the daemon before jobs start), or ""
    #: when no supervisor runs (in-process tests).
    supervisor_url: str = ""

    @abstractmethod
    def nodes(self) -> dict[str, NodeInfo]:
        """Every node and its total capacity (replica slots)."""

    @abstractmethod
    def slot_resource(self) -> str:
        """The resource key one replica consumes (``"gpu"`` or ``"cpu"``)."""

    @abstractmethod
    def jobs(self, *, include_finished: bool = True) -> dict[str, JobStatus]:
        """Snapshot of the jobs, by name."""

    @abstractmethod
    def submit(self, spec: JobSpec) -> JobStatus:
        """Record a new job in phase Pending.

        Raises:
            BackendError: the name is taken, or the job cannot ever fit.
        """

    @abstractmethod
    def delete(self, name: str) -> None:
        """Stop the job's replicas (they checkpoint) and forget the job.

        Raises:
            JobNotFoundError: no such job.
        """

    @abstractmethod
    def set_allocation(self, name: str, allocation: Allocation) -> None:
        """Ask for the job to run with ``allocation`` (``()`` pauses it)."""

    @abstractmethod
    def set_metrics(self, name: str, batch_size: int | None, goodput: float | None) -> None:
        """Record the controller's goodput prediction for display."""

    @abstractmethod
    def reconcile(self, now: float) -> list[ClusterEvent]:
        """Move every job one step towards its allocation; return new events."""

    @abstractmethod
    def events(self, name: str | None = None) -> list[ClusterEvent]:
        """The recorded events of one job (or of all jobs), oldest first."""

    @abstractmethod
    def authorize(self, job_id: str, token: str | None) -> str:
        """Check a replica's job token; return the job's name.

        Raises:
            JobNotFoundError: no job with that id.
            UnauthorizedError: the token is missing or wrong.
        """

    @abstractmethod
    def discover(self, name: str, group: int) -> list[str] | None:
        """Addresses of the replicas of restart group ``group``, by rank.

        Returns None while the group is not (or no longer) fully launched, so
        the caller can long-poll.
        """

    @abstractmethod
    def set_hints(self, name: str, hints: Mapping[str, Any]) -> None:
        """Store validated scheduling hints uploaded by the job."""

    def shutdown(self, *, stop_jobs: bool) -> None:  # noqa: B027 - optional hook
        """Release resources; with ``stop_jobs`` checkpoint and stop replicas.

        The backend must still answer requests afterwards (the supervisor
        serves until it is closed); :meth:`close` releases the rest.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what requests need (a database); called after the supervisor closed."""


_REGISTRY: dict[str, Callable[..., Backend]] = {}

#: Names of the backends this package registers (see :func:`register_backend`).
BUILTIN_BACKENDS = frozenset({"local"})


def register_backend(name: str, factory: Callable[..., Backend], *, replace: bool = False) -> None:
    """Register a backend factory under ``name``, as ``--backend NAME`` selects it.

    The factory is called with the keyword arguments described in
    :class:`Backend` and should import optional dependencies (``ray``,
    ``kubernetes``) itself, so that listing backends never needs them. The
    same rules as :func:`adaptdl.sched.register_policy` apply: a built-in's
    name is taken only with ``replace=True``.

    Raises:
        ValueError: ``name`` is not an identifier (dashes allowed), or is a
            built-in's and ``replace`` is false.
        TypeError: ``factory`` is not callable.
    """
    _registry.register(
        _REGISTRY,
        "backend",
        name,
        factory,
        builtins=BUILTIN_BACKENDS,
        replace=replace,
        expected="a Backend subclass or a function returning a Backend",
    )


def backend_names() -> list[str]:
    """Names of every registered backend, sorted."""
    return sorted(_REGISTRY)


def get_backend(name: str, **options: Any) -> Backend:
    """Instantiate the backend registered as ``name`` with keyword ``options``.

    Raises:
        ValueError: ``name`` is not registered; the message lists valid names.
        TypeError: the registered factory did not return a :class:`Backend`.
    """
    factory = _registry.lookup(_REGISTRY, "cluster backend", name, "backends")
    backend = factory(**options)
    if not isinstance(backend, Backend):
        raise TypeError(
            f"backend {name!r}: its registered factory returned {backend!r}, not a Backend"
        )
    return backend


def _as_allocation(value: Sequence[Any]) -> Allocation:
    """Normalise a JSON list of node names into an :data:`Allocation`."""
    return tuple(str(item) for item in value)
