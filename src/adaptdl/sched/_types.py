"""Data model shared by every scheduling policy, the simulator and the cluster.

Policies are pure: they receive immutable descriptions of jobs and nodes and
return a :class:`Decision`; executors (the simulator, the cluster controller)
do the I/O. Nothing here reads a clock or global random state.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Protocol

import numpy as np

__all__ = [
    "MAX_COUNT",
    "Allocation",
    "Decision",
    "JobInfo",
    "NodeInfo",
    "Policy",
    "SpeedupFn",
    "check_int_type",
    "check_name_type",
    "check_new_job",
    "check_real_types",
    "check_round",
    "get_policy",
    "linear_speedup",
    "policy_factory",
    "policy_names",
    "register_policy",
]

#: Node names, one entry per replica, grouped by node (e.g. ``("n0", "n0", "n1")``).
Allocation = tuple[str, ...]


class SpeedupFn(Protocol):
    """Speedup of a job on ``num_nodes`` nodes with ``num_replicas`` replicas.

    Accepts scalars or equally-shaped integer arrays and returns the same
    shape. ``speedup(0, 0) == 0``.
    """

    def __call__(self, num_nodes: Any, num_replicas: Any) -> Any: ...


def linear_speedup(num_nodes: Any, num_replicas: Any) -> Any:
    """The speedup of a job without a goodput model: linear in replicas."""
    del num_nodes
    return np.asarray(num_replicas, dtype=float) if np.ndim(num_replicas) else float(num_replicas)


#: Largest replica count or resource amount: policies do their arithmetic in
#: 64-bit integers, and no cluster comes near it.
MAX_COUNT = 2**31 - 1


def check_int_type(label: str, value: Any) -> None:
    """Refuse anything but a Python or numpy integer (a bool too) for ``label``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{label}={value!r}: expected an int")


def check_real_types(**values: Any) -> None:
    """Refuse anything but real numbers (ints, floats, numpy reals; no bools) by keyword.

    Policies call it before their range checks, so that ``p="x"`` is named
    as the option it is instead of failing inside a comparison.
    """
    for label, value in values.items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)
        ):
            raise TypeError(f"{label}={value!r}: expected a number")


def check_name_type(label: str, value: Any) -> None:
    """Refuse anything but a non-empty string for ``label`` (a resource name)."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{label}={value!r}: expected a non-empty resource name")


def _check_int(label: str, value: Any) -> None:
    check_int_type(label, value)
    if value > MAX_COUNT:
        raise ValueError(f"{label}={value!r}: must be at most 2**31 - 1")


def _check_bool(label: str, value: Any) -> None:
    # "no" or 0 would be read as a truth value: only real booleans are clear.
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{label}={value!r}: expected True or False")


def _value_hash(self: Any) -> int:
    """Hash the fields equality compares, a mapping by its items.

    The dataclass-generated hash would fail on the dict fields, and frozen
    values are expected to work as set members and dict keys.
    """
    values = []
    for item in fields(self):
        if item.compare:
            value = getattr(self, item.name)
            values.append(frozenset(value.items()) if isinstance(value, Mapping) else value)
    return hash(tuple(values))


def _own_resources(owner: Any, name: str) -> None:
    """Check ``owner.resources`` and keep a copy, so the caller's dict cannot change it."""
    resources = owner.resources
    if not isinstance(resources, Mapping):
        raise TypeError(f"{name}.resources={resources!r}: expected a mapping like {{'gpu': 1}}")
    for key, value in resources.items():
        if not isinstance(key, str):
            raise TypeError(f"{name}.resources key {key!r}: expected a resource name (str)")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(
                f"{name}.resources[{key!r}]={value!r}: expected a non-negative integer"
            )
        if value > MAX_COUNT:
            raise ValueError(f"{name}.resources[{key!r}]={value!r}: must be at most 2**31 - 1")
    object.__setattr__(owner, "resources", dict(resources))


def check_round(
    jobs: Mapping[str, Any], nodes: Mapping[str, Any], previous: Mapping[str, Any], now: float
) -> None:
    """Check the arguments of :meth:`Policy.optimize` (every policy calls it first).

    Raises:
        TypeError: an argument is not a mapping of the expected values.
        ValueError: ``now`` is not a finite number.
    """
    for label, mapping, kind in (("jobs", jobs, JobInfo), ("nodes", nodes, NodeInfo)):
        if not isinstance(mapping, Mapping):
            raise TypeError(f"{label}={mapping!r}: expected a mapping of names to {kind.__name__}")
        for key, value in mapping.items():
            if not isinstance(value, kind):
                raise TypeError(f"{label}[{key!r}]={value!r}: expected a {kind.__name__}")
    if not isinstance(previous, Mapping):
        raise TypeError(f"previous={previous!r}: expected a mapping of job names to node tuples")
    for key, alloc in previous.items():
        if not isinstance(alloc, (tuple, list)) or not all(isinstance(n, str) for n in alloc):
            raise TypeError(f"previous[{key!r}]={alloc!r}: expected a tuple of node names")
    if isinstance(now, bool) or not isinstance(now, (int, float, np.number)):
        raise TypeError(f"now={now!r}: expected a number of seconds")
    if not math.isfinite(now):
        raise ValueError(f"now={now!r}: expected a finite time")


def check_new_job(job: Any, nodes: Mapping[str, Any]) -> None:
    """Check the arguments of :meth:`Policy.allocate_job` (as :func:`check_round` does).

    Raises:
        TypeError: ``job`` is not a JobInfo or ``nodes`` not a mapping of NodeInfo.
        ValueError: the job requests no positive resource (``optimize``
            refuses such a job too).
    """
    if not isinstance(job, JobInfo):
        raise TypeError(f"job={job!r}: expected a JobInfo")
    check_round({}, nodes, {}, 0.0)
    if not any(amount > 0 for amount in job.resources.values()):
        raise ValueError(
            f"job.resources={dict(job.resources)!r}: a replica must request at least "
            "one positive resource (e.g. {'gpu': 1})"
        )


@dataclass(frozen=True)
class NodeInfo:
    """A node that can host replicas.

    Attributes:
        resources: Capacity per resource type, e.g. ``{"gpu": 4}``.
        preemptible: Whether the node may disappear (spot/preemptible VM).
        gpu_type: Accelerator model, for heterogeneity-aware policies.
    """

    resources: Mapping[str, int]
    preemptible: bool = False
    gpu_type: str | None = None

    __hash__ = _value_hash

    def __post_init__(self) -> None:
        _own_resources(self, "NodeInfo")
        _check_bool("NodeInfo.preemptible", self.preemptible)
        if self.gpu_type is not None and not isinstance(self.gpu_type, str):
            raise TypeError(f"NodeInfo.gpu_type={self.gpu_type!r}: expected a str or None")


def copy_nodes(nodes: Mapping[str, NodeInfo]) -> dict[str, NodeInfo]:
    """Copies of ``nodes`` with resource dicts of their own, to hand to a policy.

    A policy is often user code; one that edits what it is given (a node's
    ``resources``, or the mapping itself) must not change the cluster its
    decision is then checked against, nor what it sees next round.
    """
    return {name: replace(node, resources=dict(node.resources)) for name, node in nodes.items()}


@dataclass(frozen=True)
class JobInfo:
    """What a policy knows about one job.

    Attributes:
        resources: Resources one replica needs, e.g. ``{"gpu": 1}``.
        speedup_fn: Goodput speedup as a function of (nodes, replicas).
        submission_time: When the job was submitted (seconds, any epoch).
        attained_service: Resource-seconds received so far (GPU-seconds).
        num_restarts: Restarts so far (the first start does not count).
        min_replicas: Fewest replicas the job can run with (0: may be paused).
        max_replicas: Most replicas the job may get this round.
        preemptible: A non-preemptible job keeps its allocation once running.
        requested_replicas: Fixed gang size, for non-elastic policies (Tiresias).
        step_time_fn: Seconds per iteration on ``r`` replicas packed onto as
            few nodes as possible, for Optimus' remaining-time oracle.
        remaining_iterations: Iterations left to completion (Optimus' oracle).
            With ``step_time_fn`` it also gives the job's remaining work, by
            which the ``adaptdl`` policy favours short jobs; None: unknown.
    """

    resources: Mapping[str, int]
    speedup_fn: SpeedupFn | Callable[..., Any]
    submission_time: float
    attained_service: float = 0.0
    num_restarts: int = 0
    min_replicas: int = 0
    max_replicas: int = 2**31 - 1
    preemptible: bool = True
    requested_replicas: int | None = None
    step_time_fn: Callable[[int], float] | None = field(default=None, compare=False)
    remaining_iterations: float | None = None

    __hash__ = _value_hash

    def __post_init__(self) -> None:
        _own_resources(self, "JobInfo")
        _check_bool("JobInfo.preemptible", self.preemptible)
        for label in ("min_replicas", "max_replicas", "num_restarts"):
            _check_int(f"JobInfo.{label}", getattr(self, label))
        if self.requested_replicas is not None:
            _check_int("JobInfo.requested_replicas", self.requested_replicas)
            if self.requested_replicas < 1:
                raise ValueError(
                    f"JobInfo.requested_replicas={self.requested_replicas}: must be >= 1 or None"
                )
        if self.num_restarts < 0:
            raise ValueError(f"JobInfo.num_restarts={self.num_restarts}: must be >= 0")
        if not callable(self.speedup_fn):
            raise TypeError(f"JobInfo.speedup_fn={self.speedup_fn!r}: expected a callable")
        if self.step_time_fn is not None and not callable(self.step_time_fn):
            raise TypeError(f"JobInfo.step_time_fn={self.step_time_fn!r}: expected a callable")
        for label in ("submission_time", "attained_service", "remaining_iterations"):
            value = getattr(self, label)
            if value is None and label == "remaining_iterations":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                raise TypeError(f"JobInfo.{label}={value!r}: expected a number")
        if not (math.isfinite(self.attained_service) and self.attained_service >= 0):
            raise ValueError(
                f"JobInfo.attained_service={self.attained_service!r}: must be finite and >= 0"
            )
        if self.min_replicas < 0:
            raise ValueError(f"JobInfo.min_replicas={self.min_replicas}: must be >= 0")
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"JobInfo.max_replicas={self.max_replicas} is below "
                f"min_replicas={self.min_replicas}"
            )
        if not math.isfinite(self.submission_time):
            raise ValueError(f"JobInfo.submission_time={self.submission_time!r}: must be finite")
        remaining = self.remaining_iterations
        if remaining is not None and not (math.isfinite(remaining) and remaining >= 0):
            raise ValueError(
                f"JobInfo.remaining_iterations={remaining!r}: must be finite and >= 0 or None"
            )


@dataclass(frozen=True)
class Decision:
    """The outcome of one scheduling round.

    Attributes:
        allocations: Job name to allocation; a job missing or mapped to ``()``
            gets no resources.
        desired_nodes: Cluster size the policy would like (autoscaling), or
            None when the policy has no opinion.
    """

    allocations: Mapping[str, Allocation]
    desired_nodes: int | None = None

    __hash__ = _value_hash

    def __post_init__(self) -> None:
        if not isinstance(self.allocations, Mapping):
            raise TypeError(
                f"Decision.allocations={self.allocations!r}: expected a mapping of job names "
                "to node-name tuples"
            )
        allocations: dict[str, Allocation] = {}
        for key, alloc in self.allocations.items():
            if isinstance(alloc, str) or not isinstance(alloc, (tuple, list)):
                raise TypeError(
                    f"Decision.allocations[{key!r}]={alloc!r}: expected a tuple of node names"
                )
            if not all(isinstance(node, str) for node in alloc):
                raise TypeError(f"Decision.allocations[{key!r}]={alloc!r}: node names must be str")
            allocations[key] = tuple(alloc)
        # A copy: the policy's own dict may change in its next round.
        object.__setattr__(self, "allocations", allocations)
        if self.desired_nodes is not None:
            _check_int("Decision.desired_nodes", self.desired_nodes)
            if self.desired_nodes < 0:
                raise ValueError(f"Decision.desired_nodes={self.desired_nodes}: must be >= 0")


class Policy(ABC):
    """A scheduling policy: jobs and nodes in, a :class:`Decision` out.

    Implementations may keep state between rounds (a GA population, queues),
    but must not do I/O, read clocks or use global random state: ``now`` is
    passed in and randomness comes from a seeded generator.
    """

    name: ClassVar[str] = ""
    #: Whether the jobs this policy schedules adapt their batch size with the
    #: goodput model (Pollux-style co-adaptation) rather than keeping the
    #: batch size they were submitted with.
    adaptive_batch: ClassVar[bool] = False
    #: Whether the policy runs each job on exactly
    #: :attr:`JobInfo.requested_replicas` GPUs or not at all (gang scheduling,
    #: as Tiresias does); a simulator can then reject jobs wider than the
    #: cluster before running.
    gang_scheduled: ClassVar[bool] = False
    #: Whether the policy can schedule jobs as a live cluster describes them:
    #: without a fixed gang size or an oracle of the remaining work, which
    #: only a simulator knows. The CLI refuses to run the others on a cluster.
    cluster_ready: ClassVar[bool] = True

    @abstractmethod
    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        """Decide the allocation of every job for the next interval."""

    def allocate_job(self, job: JobInfo, nodes: Mapping[str, NodeInfo]) -> Allocation:
        """Fast path for a new arrival: a small allocation without a full round.

        The default places ``max(min_replicas, 1)`` replicas on the first node
        (in name order) whose free resources fit them, or returns ``()``.
        ``nodes`` must describe *free* resources.
        """
        check_new_job(job, nodes)
        count = max(job.min_replicas, 1)
        if job.max_replicas < count:
            return ()
        for name in sorted(nodes):
            free = nodes[name].resources
            if all(free.get(key, 0) >= need * count for key, need in job.resources.items()):
                return (name,) * count
        return ()


_REGISTRY: dict[str, Callable[..., Policy]] = {}

#: The policy the cluster and the simulator use when none is named.
DEFAULT_POLICY = "adaptdl"


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Register a policy factory under ``name`` (overrides an earlier one).

    Raises:
        ValueError: ``name`` is not an identifier (dashes allowed).
        TypeError: ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name or not name.replace("-", "_").isidentifier():
        raise ValueError(f"policy name {name!r}: expected a non-empty identifier")
    if not callable(factory):
        raise TypeError(
            f"register_policy({name!r}, {factory!r}): the factory must be callable "
            "(a Policy subclass or a function returning a Policy)"
        )
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    """Names of every registered policy, sorted."""
    return sorted(_REGISTRY)


def policy_factory(name: str) -> Callable[..., Policy]:
    """The factory registered as ``name`` (to inspect the options it takes).

    Raises:
        ValueError: ``name`` is not registered; the message lists valid names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; valid policies: {', '.join(policy_names()) or '(none)'}"
        ) from None


def get_policy(name: str, **options: Any) -> Policy:
    """Instantiate the policy registered as ``name`` with keyword ``options``.

    Raises:
        ValueError: ``name`` is not registered; the message lists valid names.
        TypeError: the registered factory did not return a :class:`Policy`.
    """
    policy = policy_factory(name)(**options)
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy {name!r}: its registered factory returned {policy!r}, not a Policy"
        )
    return policy
