"""Data model shared by every scheduling policy, the simulator and the cluster.

Policies are pure: they receive immutable descriptions of jobs and nodes and
return a :class:`Decision`; executors (the simulator, the cluster controller)
do the I/O. Nothing here reads a clock or global random state.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Protocol

import numpy as np

from adaptdl import _registry
from adaptdl._checks import check_bool

__all__ = [
    "MAX_COUNT",
    "Allocation",
    "Decision",
    "DecisionError",
    "JobInfo",
    "NodeInfo",
    "Policy",
    "SpeedupFn",
    "check_allocation",
    "check_decision",
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
        if not isinstance(key, str) or not key:
            raise TypeError(f"{name}.resources key {key!r}: expected a resource name (str)")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(
                f"{name}.resources[{key!r}]={value!r}: expected a non-negative integer"
            )
        if value > MAX_COUNT:
            raise ValueError(f"{name}.resources[{key!r}]={value!r}: must be at most 2**31 - 1")
    object.__setattr__(owner, "resources", _Resources(resources))


def check_round(
    jobs: Mapping[str, Any], nodes: Mapping[str, Any], previous: Mapping[str, Any], now: float
) -> None:
    """Check the arguments of :meth:`Policy.optimize` (every policy calls it first).

    Raises:
        TypeError: an argument is not a mapping of the expected values.
        ValueError: ``now`` is not a finite number, or a previous allocation
            does not list each node's replicas together.
    """
    for label, mapping, kind in (("jobs", jobs, JobInfo), ("nodes", nodes, NodeInfo)):
        if not isinstance(mapping, Mapping):
            raise TypeError(f"{label}={mapping!r}: expected a mapping of names to {kind.__name__}")
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise TypeError(f"{label} key {key!r}: expected a {label[:-1]} name (str)")
            if not isinstance(value, kind):
                raise TypeError(f"{label}[{key!r}]={value!r}: expected a {kind.__name__}")
    if not isinstance(previous, Mapping):
        raise TypeError(f"previous={previous!r}: expected a mapping of job names to node tuples")
    for key, alloc in previous.items():
        if not isinstance(alloc, (tuple, list)) or not all(isinstance(n, str) for n in alloc):
            raise TypeError(f"previous[{key!r}]={alloc!r}: expected a tuple of node names")
        # Decisions list each node's replicas together; an echoed-back
        # previous allocation must already be a valid decision.
        if not _grouped(alloc):
            raise ValueError(
                f"previous[{key!r}]={tuple(alloc)!r}: list each node's replicas together "
                f"(e.g. {tuple(sorted(alloc, key=list(dict.fromkeys(alloc)).index))!r})"
            )
    if isinstance(now, bool) or not isinstance(now, (int, float, np.integer, np.floating)):
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
        check_bool("NodeInfo.preemptible", self.preemptible)
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
        check_bool("JobInfo.preemptible", self.preemptible)
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
            if isinstance(value, bool) or not isinstance(
                value, (int, float, np.integer, np.floating)
            ):
                raise TypeError(f"JobInfo.{label}={value!r}: expected a real number")
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


class _FrozenDict(dict[str, Any]):
    """A dict that refuses changes: it still serialises (JSON), pickles and copies."""

    _refusal = "this mapping cannot be changed"

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(self._refusal)

    __setitem__ = __delitem__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))


class _ReadOnly(_FrozenDict):
    _refusal = "Decision.allocations cannot be changed; make a new Decision"


class _Resources(_FrozenDict):
    # Frozen JobInfo and NodeInfo hash by their resources: a change would
    # also lose them in the sets and dicts that hold them.
    _refusal = "resources cannot be changed; make a new one with dataclasses.replace"


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
            if not isinstance(key, str):
                raise TypeError(f"Decision.allocations key {key!r}: expected a job name (str)")
            if isinstance(alloc, str) or not isinstance(alloc, (tuple, list)):
                raise TypeError(
                    f"Decision.allocations[{key!r}]={alloc!r}: expected a tuple of node names"
                )
            if not all(isinstance(node, str) for node in alloc):
                raise TypeError(f"Decision.allocations[{key!r}]={alloc!r}: node names must be str")
            allocations[key] = tuple(alloc)
        # A read-only copy: the policy's own dict may change in its next
        # round, and a frozen decision's hash must not.
        object.__setattr__(self, "allocations", _ReadOnly(allocations))
        if self.desired_nodes is not None:
            _check_int("Decision.desired_nodes", self.desired_nodes)
            if self.desired_nodes < 0:
                raise ValueError(f"Decision.desired_nodes={self.desired_nodes}: must be >= 0")


class DecisionError(ValueError):
    """A policy's allocation that the cluster cannot carry out.

    The message names the job and the rule it breaks; callers prefix the
    policy's name.
    """


def _grouped(allocation: Sequence[str]) -> bool:
    """Whether each node's replicas are listed together (``n0, n0, n1``, not ``n0, n1, n0``)."""
    runs = [node for i, node in enumerate(allocation) if i == 0 or allocation[i - 1] != node]
    return len(runs) == len(set(runs))


def _check_placement(name: str, allocation: Allocation, nodes: Mapping[str, NodeInfo]) -> None:
    """Known nodes, each node's replicas listed together."""
    for node in allocation:
        if node not in nodes:
            raise DecisionError(f"placed job {name!r} on unknown node {node!r}")
    if not _grouped(allocation):
        raise DecisionError(
            f"gave job {name!r} the allocation {allocation}: list each node's "
            "replicas together (an allocation is grouped by node)"
        )


def _check_limits(name: str, allocation: Allocation, job: JobInfo) -> None:
    if not job.min_replicas <= len(allocation) <= job.max_replicas:
        raise DecisionError(
            f"gave job {name!r} {len(allocation)} replicas, outside its "
            f"min_replicas={job.min_replicas} and max_replicas={job.max_replicas}"
        )


def _check_capacity(
    allocations: Mapping[str, Allocation],
    jobs: Mapping[str, JobInfo],
    nodes: Mapping[str, NodeInfo],
) -> None:
    """No node's resources exceeded, counting every job's replicas."""
    used: dict[str, dict[str, int]] = {}
    for key, alloc in allocations.items():
        for node in alloc:
            for resource, need in jobs[key].resources.items():
                per_node = used.setdefault(node, {})
                per_node[resource] = per_node.get(resource, 0) + need
    for node, demand in sorted(used.items()):
        for resource, amount in sorted(demand.items()):
            capacity = nodes[node].resources.get(resource, 0)
            if amount > capacity:
                holders = ", ".join(
                    f"{key!r} ({alloc.count(node)} replicas)"
                    for key, alloc in sorted(allocations.items())
                    if node in alloc
                )
                raise DecisionError(
                    f"put {amount} {resource} on node {node!r}, which has {capacity}: "
                    f"jobs {holders}"
                )


def check_allocation(
    name: str, allocation: Allocation, job: JobInfo, nodes: Mapping[str, NodeInfo]
) -> None:
    """Check one new job's allocation: known nodes, grouped, within limits, fits.

    For :meth:`Policy.allocate_job`, whose ``nodes`` describe free
    resources. An empty allocation (the job waits) is always valid.

    Raises:
        DecisionError: the allocation breaks one of these rules.
    """
    if not allocation:
        return
    _check_placement(name, allocation, nodes)
    _check_capacity({name: allocation}, {name: job}, nodes)
    _check_limits(name, allocation, job)


def pinned_allocations(
    jobs: Mapping[str, JobInfo],
    nodes: Mapping[str, NodeInfo],
    previous: Mapping[str, Allocation],
) -> dict[str, Allocation]:
    """The allocations a round must keep: those of running non-preemptible jobs.

    A job whose nodes are gone, or shrank below its allocation, is not held
    (it must restart anyway). If the nodes shrank below what such jobs held
    *together*, they are held in submission order (then by name) while they
    fit, so a shrunk node frees only the jobs it cannot hold any more, and
    jobs on other nodes stay. Policies and :func:`check_decision` share this
    rule.
    """
    candidates = sorted(
        (
            key
            for key, job in jobs.items()
            if not job.preemptible
            and previous.get(key)
            and all(node in nodes for node in previous[key])
        ),
        key=lambda key: (jobs[key].submission_time, key),
    )
    # Held one by one against what the earlier ones use (linear in the jobs).
    used: dict[tuple[str, str], int] = {}
    pinned: dict[str, Allocation] = {}
    for key in candidates:
        alloc = tuple(previous[key])
        demand: dict[tuple[str, str], int] = {}
        for node in alloc:
            for resource, need in jobs[key].resources.items():
                demand[node, resource] = demand.get((node, resource), 0) + need
        if all(
            used.get(spot, 0) + amount <= nodes[spot[0]].resources.get(spot[1], 0)
            for spot, amount in demand.items()
        ):
            pinned[key] = alloc
            for spot, amount in demand.items():
                used[spot] = used.get(spot, 0) + amount
    return pinned


def check_decision(
    decision: object,
    jobs: Mapping[str, JobInfo],
    nodes: Mapping[str, NodeInfo],
    previous: Mapping[str, Allocation],
) -> dict[str, Allocation]:
    """Check a decision against the round it answers, as every executor must.

    The simulator and the cluster controller both call this on whatever a
    policy (perhaps a plugin) returned, before acting on it. The rules:

    * the result is a :class:`Decision`, allocating only jobs in ``jobs``;
    * allocations name known nodes, each node's replicas together;
    * no node's resources are exceeded, counting every job's replicas;
    * a job that is not preemptible keeps the allocation it was given (the
      same replicas per node), unless a node of it is gone or the nodes
      shrank below what such jobs held together;
    * every other job gets ``min_replicas`` to ``max_replicas`` replicas, or
      none.

    Returns:
        The non-empty allocations, by job name.

    Raises:
        DecisionError: a rule is broken; the message names the job (or node).
    """
    if not isinstance(decision, Decision):
        raise DecisionError(
            f"returned {type(decision).__name__} from optimize(), expected a Decision"
        )
    allocations: dict[str, Allocation] = {}
    for key, alloc in decision.allocations.items():
        if not alloc:
            continue
        if key not in jobs:
            raise DecisionError(f"allocated job {key!r}, which is not in this round's jobs")
        _check_placement(key, alloc, nodes)
        allocations[key] = alloc
    _check_capacity(allocations, jobs, nodes)
    kept: set[str] = set()
    for key, before in pinned_allocations(jobs, nodes, previous).items():
        after = allocations.get(key, ())
        if sorted(after) != sorted(before):
            raise DecisionError(
                f"changed the allocation of job {key!r} from {before} to {after}, but the "
                "job is not preemptible: it keeps the allocation it was given"
            )
        kept.add(key)
    for key, alloc in allocations.items():
        if key not in kept:  # a kept job may exceed limits that changed since it started
            _check_limits(key, alloc, jobs[key])
    return allocations


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
        """Decide the allocation of every job for the next interval.

        Call :func:`check_round` first, so bad arguments fail with a clear
        message. Executors hand in copies, and run the result through
        :func:`check_decision` before acting on it, so a decision must:

        * allocate only jobs in ``jobs`` (a job left out, or given ``()``,
          is paused or keeps waiting);
        * list one node of ``nodes`` per replica, each node's replicas
          together, without exceeding any node's ``resources``;
        * give each job ``min_replicas`` to ``max_replicas`` replicas, or
          none;
        * keep ``previous[name]`` (the same replicas per node) for a job
          that is not ``preemptible``, while its nodes still hold it.

        The cluster calls this on its control thread every ``interval``
        seconds: keep it well under a second, or job exits are noticed
        late.

        Args:
            jobs: Active jobs by name.
            nodes: Every node with its total resources.
            previous: Each job's current allocation (``()`` when it has none).
            now: The current time in seconds (simulated, or Unix time).
        """

    def allocate_job(self, job: JobInfo, nodes: Mapping[str, NodeInfo]) -> Allocation:
        """Fast path for a new arrival: a small allocation without a full round.

        The default places ``max(min_replicas, 1)`` replicas on the first node
        whose free resources fit them, or returns ``()``. Non-preemptible
        nodes come first (then name order), so a new job does not start on a
        spot node while a reliable one has room. ``nodes`` must describe
        *free* resources.
        """
        check_new_job(job, nodes)
        count = max(job.min_replicas, 1)
        if job.max_replicas < count:
            return ()
        for name in sorted(nodes, key=lambda key: (nodes[key].preemptible, key)):
            free = nodes[name].resources
            if all(free.get(key, 0) >= need * count for key, need in job.resources.items()):
                return (name,) * count
        return ()


_REGISTRY: dict[str, Callable[..., Policy]] = {}

#: The policy the cluster and the simulator use when none is named.
DEFAULT_POLICY = "adaptdl"

#: Names of the policies this package registers; a plugin may not take them
#: by accident (see :func:`register_policy`).
BUILTIN_POLICIES = frozenset({"adaptdl", "optimus", "pollux", "tiresias"})


def register_policy(name: str, factory: Callable[..., Policy], *, replace: bool = False) -> None:
    """Register a policy factory under ``name``, as ``--policy NAME`` selects it.

    Registering the same factory twice is harmless; another factory may take
    a plugin's name (with a logged warning), but a built-in's
    (:data:`BUILTIN_POLICIES`) only with ``replace=True``.

    Raises:
        ValueError: ``name`` is not an identifier (dashes allowed), or is a
            built-in's and ``replace`` is false.
        TypeError: ``factory`` is not callable.
    """
    _registry.register(
        _REGISTRY,
        "policy",
        name,
        factory,
        builtins=BUILTIN_POLICIES,
        replace=replace,
        expected="a Policy subclass or a function returning a Policy",
    )


def policy_names() -> list[str]:
    """Names of every registered policy, sorted."""
    return sorted(_REGISTRY)


def policy_factory(name: str) -> Callable[..., Policy]:
    """The factory registered as ``name`` (to inspect the options it takes).

    Raises:
        ValueError: ``name`` is not registered; the message lists valid names.
    """
    return _registry.lookup(_REGISTRY, "policy", name, "policies")


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
