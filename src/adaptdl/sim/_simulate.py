"""The tick loop: advance every job, then ask the policy for new allocations.

Time moves in fixed ticks of ``interval`` seconds. One tick (1) advances every
job under the allocation chosen at the previous tick, (2) advances the clock,
(3) collects the active jobs (submitted and not complete), (4) calls the
policy with them, the nodes and their previous allocations, and (5)
re-allocates every job whose node list changed. Decisions therefore happen
only at tick boundaries: an arrival waits for the next boundary and GPUs
freed inside a tick are handed out at its end, exactly as in the Pollux
artifact whose published numbers this loop reproduces.
"""

from __future__ import annotations

import logging
import math
import numbers
import operator
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import cast

import numpy as np

from adaptdl.sched import (
    Decision,
    DecisionError,
    JobInfo,
    NodeInfo,
    Policy,
    check_decision,
    copy_nodes,
    get_policy,
    linear_speedup,
    policy_factory,
)
from adaptdl.sim._job import RESTART_DELAY, SimJob, placement_of
from adaptdl.sim._trace import Application, TraceError, missing_trace_dir
from adaptdl.sim._workload import ADAPTIVE_CATEGORY, WorkloadJob, check_jobs, read_workload

__all__ = [
    "MAX_CLUSTER_GPUS",
    "MAX_EXPLORED_REPLICAS",
    "MAX_RUN_TIME",
    "MAX_SEED",
    "PINNED_MODELS",
    "PolicyError",
    "STALL_ROUNDS",
    "find_traces_dir",
    "JobResult",
    "SimResult",
    "Simulator",
    "is_adaptive",
    "load_applications",
    "simulate",
]

_LOG = logging.getLogger(__name__)


class PolicyError(RuntimeError):
    """The policy raised while deciding a round, or decided what cannot run.

    Policies are often user code (plugins): this says whose code failed, and
    when, instead of letting the exception look like a simulator bug. When
    the policy raised, its exception is the ``__cause__``, with its
    traceback; a decision refused by :func:`adaptdl.sched.check_decision`
    has no cause.
    """


class _OracleError(PolicyError, ValueError):
    """A policy called a simulator callback with what it cannot answer (already labelled).

    A :class:`PolicyError` (the policy's fault), and a ``ValueError`` as before.
    """


#: Progress callback: (simulated seconds, completed jobs, total jobs).
ProgressFn = Callable[[float, int, int], None]

_APP_CACHE: dict[tuple[str, str], Application] = {}

#: Most replicas an adaptive job may explore: the scalability traces end at
#: 64 GPUs, so larger jobs cannot be simulated.
MAX_EXPLORED_REPLICAS = 64

#: Most GPUs a simulated cluster may have. Every round hands each policy every
#: node, so far larger clusters would only exhaust memory before the first
#: round (the Pollux clusters have 64 GPUs).
MAX_CLUSTER_GPUS = 1_000_000

#: Simulated seconds after the last arrival after which a run is declared
#: hung (10 years): no real workload gets near it, and an interval longer
#: than this could not run a single round within it.
MAX_RUN_TIME = 10 * 365 * 86400.0

#: Largest seed: results record it as a JSON number, exact up to 2**53.
MAX_SEED = 2**53

#: Scheduling rounds in a row in which no job makes progress (jobs wait and
#: no job holds a GPU, or every job that holds one is restarted again before
#: its restart delay is over), after which the simulation stops: the policy
#: will never finish them.
STALL_ROUNDS = 1000

#: Models that goodput policies run at a fixed batch (their largest) on one
#: GPU, as the Pollux artifact does: ncf trains in about a minute, so
#: adapting it would only add restarts.
PINNED_MODELS = frozenset({"ncf"})


def find_traces_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Locate the trace folder: ``explicit``, else ``ADAPTDL_SIM_TRACES``, else a search.

    The search looks for ``shared/pollux-data/traces`` next to the current
    directory or any of its parents, then next to the source checkout, which
    is where the project keeps the (not redistributed) Pollux traces. A
    folder counts only if it holds at least one model folder.

    Raises:
        TraceError: nothing was found; the message lists where it looked.
    """
    from adaptdl import env

    if explicit is not None:
        return Path(explicit)
    configured = env.sim_traces()
    if configured:
        return Path(configured)
    tail = Path("shared") / "pollux-data" / "traces"
    cwd = Path.cwd().resolve()
    candidates = [cwd / "pollux-data" / "traces"]
    candidates += [parent / tail for parent in (cwd, *cwd.parents)]
    candidates.append(Path(__file__).resolve().parents[3].parent / tail)
    for candidate in candidates:
        # Only a folder that holds model traces counts, not any folder of that name.
        if any((sub / "placements.csv").is_file() for sub in _subdirs(candidate)):
            return candidate
    raise TraceError(
        "no trace folder found: pass --traces DIR (or traces_dir=) or set "
        "ADAPTDL_SIM_TRACES; looked in " + ", ".join(str(c) for c in dict.fromkeys(candidates))
    )


def _subdirs(path: Path) -> list[Path]:
    try:
        return [entry for entry in path.iterdir() if entry.is_dir()]
    except OSError:
        return []


def load_applications(traces_dir: str | os.PathLike[str]) -> dict[str, Application]:
    """Load every model folder of ``traces_dir`` (cached per process).

    Raises:
        TraceError: the directory is missing or holds no model folder.
    """
    root = Path(traces_dir)
    if not root.is_dir():
        raise TraceError(missing_trace_dir(root))
    apps: dict[str, Application] = {}
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if not (entry / "placements.csv").is_file():
            # A folder with other trace files is a model missing one, not a
            # stray folder: skipped, its jobs would be "unknown applications".
            others = sorted(
                f.name
                for f in entry.iterdir()
                if f.name == "scalability.csv"
                or (f.name.startswith(("validation-", "placements-")) and f.suffix == ".csv")
            )
            if others:
                per_gpu = [name for name in others if name.startswith("placements-")]
                hint = (
                    f" (per-GPU-type files such as {per_gpu[0]} are not supported; "
                    "keep one GPU type's file as placements.csv)"
                    if per_gpu
                    else ""
                )
                raise TraceError(
                    f"{entry}: missing placements.csv (the folder has {', '.join(others[:3])}"
                    f"{', ...' if len(others) > 3 else ''}){hint}"
                )
            continue
        key = (str(entry.resolve()), entry.name)
        app = _APP_CACHE.get(key)
        if app is None:
            app = Application(entry)
            _APP_CACHE[key] = app
        apps[entry.name] = app
    if not apps:
        raise TraceError(f"{root}: no model folders with placements.csv")
    return apps


def is_adaptive(policy: Policy) -> bool:
    """Whether a policy's jobs adapt their batch size with the goodput model.

    A policy declares it with the class attribute
    :attr:`~adaptdl.sched.Policy.adaptive_batch`; the others run the
    workload's fixed batch sizes.
    """
    return bool(policy.adaptive_batch)


@dataclass(frozen=True)
class JobResult:
    """Outcome of one job.

    Attributes:
        name: Job name.
        application: Model name.
        submission_time: Arrival (s).
        completion_time: Completion (s).
        jct: Completion minus submission (s).
        num_restarts: Restarts (the first start is not one).
        gpu_seconds: GPU-seconds held, restart delays included.
        allocations: ``(time, placement)`` at every change of the job's
            allocation, its first start included: GPUs per node used, ``()``
            when its GPUs were taken away. The time is the scheduling round's
            (the job then serves its restart delay).
    """

    name: str
    application: str
    submission_time: float
    completion_time: float
    jct: float
    num_restarts: int
    gpu_seconds: float
    allocations: tuple[tuple[float, tuple[int, ...]], ...] = ()

    @property
    def start_time(self) -> float:
        """When the job first got GPUs (s); its queueing delay is this minus submission."""
        return self.allocations[0][0] if self.allocations else self.completion_time


@dataclass(frozen=True)
class SimResult:
    """Result of one simulation.

    Attributes:
        policy: Policy name.
        workload: Workload name (file stem).
        jobs: Per-job results in workload order.
        makespan: Time the last job completed (s).
        wall_time: Seconds of real time the simulation took.
        policy_time: Part of ``wall_time`` spent inside ``policy.optimize``
            (the rest is the simulator: physics and the jobs' model fits).
        options: The cluster and physics options used.
    """

    policy: str
    workload: str
    jobs: tuple[JobResult, ...]
    makespan: float
    wall_time: float = 0.0
    policy_time: float = 0.0
    options: Mapping[str, float] = field(default_factory=dict)

    @property
    def jcts(self) -> dict[str, float]:
        """Job name to JCT (s)."""
        return {job.name: job.jct for job in self.jobs}

    def summary(self) -> dict[str, float]:
        """Average/median/p99 JCT, makespan, restarts per job and GPU-hours."""
        jcts = np.array([job.jct for job in self.jobs], dtype=float)
        return {
            "jobs": float(len(self.jobs)),
            "avg_jct": float(jcts.mean()),
            "p50_jct": float(np.percentile(jcts, 50)),
            "p99_jct": float(np.percentile(jcts, 99)),
            "makespan": float(self.makespan),
            "restarts_per_job": float(np.mean([j.num_restarts for j in self.jobs])),
            "gpu_hours": float(sum(j.gpu_seconds for j in self.jobs) / 3600.0),
        }


def _is_int_at_least(value: object, minimum: int) -> bool:
    """Whether ``value`` is an integer (numpy's included, bool not) >= ``minimum``."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= minimum  # type: ignore[arg-type]
    except TypeError:
        return False


def _check_type(name: str, value: object, *, integer: bool) -> None:
    """Refuse a wrong type by the option's name (bool is not a number here)."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        wanted = "an integer" if integer else "a number"
        raise TypeError(f"{name}={value!r}: expected {wanted}")


def _check_seed(seed: object) -> None:
    if not (_is_int_at_least(seed, 0) and seed <= MAX_SEED):  # type: ignore[operator]
        raise ValueError(f"seed={seed!r}: must be an integer from 0 to 2**53")


def _node_names(count: int) -> list[str]:
    width = len(str(max(count - 1, 0)))
    return [f"n{i:0{width}d}" for i in range(count)]


class Simulator:
    """A cluster of identical GPU nodes driving one policy over one workload.

    Args:
        workload: Jobs in arrival order.
        policy: The scheduling policy (fresh: it may keep state).
        applications: Model name to ground truth.
        nodes: Number of nodes.
        gpus_per_node: GPUs per node.
        interval: Seconds between scheduling rounds (at least 1: epoch
            boundaries are rounded to whole seconds).
        interference: Slowdown of distributed jobs sharing a node with
            another distributed job (0 = none, 0.25 = 25% slower).
        seed: The seed the policy was built with, recorded in the result's
            options (None: not known, not recorded); an integer from 0 to
            :data:`MAX_SEED`. The simulator itself draws no random numbers.
        policy_name: The name the result is filed under (default: the
            policy's ``name``, else its class), e.g. the registered name of
            a variant such as ``pollux-noavoid``.

    The cluster is fixed: a decision's ``desired_nodes`` (autoscaling) is
    not acted on; a policy that asks for another size is told once, in the
    log.

    Raises:
        TypeError: an option or the policy has the wrong type.
        ValueError: an option is out of range, a workload job names an
            unknown model, or a job cannot run at all: nodes larger than the
            traces measured, or, for a fixed-batch policy, a batch size
            outside the validated range, a per-GPU batch below the measured
            ones, or a gang wider than the cluster. Messages name the job's
            file and line.
    """

    def __init__(
        self,
        workload: Sequence[WorkloadJob],
        policy: Policy,
        applications: Mapping[str, Application],
        *,
        nodes: int = 16,
        gpus_per_node: int = 4,
        interval: float = 60,
        interference: float = 0.0,
        seed: int | None = None,
        policy_name: str | None = None,
    ) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy={policy!r}: expected a Policy object")
        _check_type("nodes", nodes, integer=True)
        _check_type("gpus_per_node", gpus_per_node, integer=True)
        _check_type("interval", interval, integer=False)
        _check_type("interference", interference, integer=False)
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: need at least one node")
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={gpus_per_node}: need at least one GPU per node")
        if nodes * gpus_per_node > MAX_CLUSTER_GPUS:
            raise ValueError(
                f"nodes={nodes}, gpus_per_node={gpus_per_node}: {nodes * gpus_per_node} GPUs; "
                f"at most {MAX_CLUSTER_GPUS} can be simulated"
            )
        if not 1 <= interval <= MAX_RUN_TIME:
            raise ValueError(
                f"interval={interval!r}: must be a number of seconds from 1 to "
                f"{MAX_RUN_TIME:.0f} (10 years)"
            )
        if not 0.0 <= interference < 1.0:
            raise ValueError(f"interference={interference!r}: must be in [0, 1)")
        if seed is not None:
            _check_seed(seed)
        if policy_name is not None and (not isinstance(policy_name, str) or not policy_name):
            raise TypeError(f"policy_name={policy_name!r}: expected a non-empty str or None")
        self.policy = policy
        # A plain float: numpy's float32 would fail inside the clock's Fractions.
        self.interval = float(interval)
        self.interference = interference
        self.gpus_per_node = gpus_per_node
        self.seed = seed
        self.adaptive = is_adaptive(policy)
        self.node_names = _node_names(nodes)
        self.nodes = {name: NodeInfo(resources={"gpu": gpus_per_node}) for name in self.node_names}
        self.current_time: float = 0.0
        self.policy_time = 0.0
        self.allocations: dict[str, tuple[str, ...]] = {}
        self.jobs: list[SimJob] = []
        total_gpus = nodes * gpus_per_node
        workload = check_jobs(workload)
        for entry in workload:
            try:
                app = applications[entry.application]
            except KeyError:
                raise ValueError(
                    f"{entry.where('application')}job {entry.name!r}: unknown application "
                    f"{entry.application!r}; "
                    f"known: {', '.join(sorted(applications))}"
                ) from None
            if gpus_per_node > app.max_gpus_per_node:
                raise ValueError(
                    f"gpus_per_node={gpus_per_node}: the {app.name} traces measure at most "
                    f"{app.max_gpus_per_node} GPUs per node, so larger nodes cannot be simulated"
                )
            if not self.adaptive:
                self._check_fixed_job(entry, app, total_gpus)
            self.jobs.append(self._make_job(entry, app))
        self._origins = {entry.name: entry.origin for entry in workload}
        #: Each job's max_replicas as last shown to the policy.
        self._max_replicas: dict[str, int] = {}
        self._stalled_rounds = 0
        self._frozen_rounds = 0
        #: The name the result is filed under, when given.
        self._registered_name = policy_name or ""
        self._warned_desired_nodes = False
        self._by_name = {job.name: job for job in self.jobs}
        self._num_complete = 0

    def _check_fixed_job(self, entry: WorkloadJob, app: Application, total_gpus: int) -> None:
        """Reject a fixed-batch job the traces (or the cluster) cannot run.

        Caught here, such a job would otherwise fail hours into the run, or
        (wider than the cluster under a gang policy) wait forever.
        """
        replicas = entry.num_replicas if self.policy.gang_scheduled else 1
        if self.policy.gang_scheduled and replicas > total_gpus:
            raise ValueError(
                f"{entry.where('num_replicas')}job {entry.name!r} needs {replicas} GPUs but "
                f"the cluster has {total_gpus} "
                f"({len(self.node_names)} nodes x {self.gpus_per_node}); policy "
                f"{self.policy.name!r} would never start it"
            )
        if self.policy.gang_scheduled and replicas > MAX_EXPLORED_REPLICAS:
            raise ValueError(
                f"{entry.where('num_replicas')}job {entry.name!r} needs {replicas} GPUs, but "
                f"the scalability traces of {app.name} end at {MAX_EXPLORED_REPLICAS} "
                "replicas: its throughput cannot be simulated"
            )
        batch = entry.batch_size if entry.batch_size is not None else app.init_batch_size
        low, high = app.init_batch_size, app.max_batch_size
        who = f"{entry.where('batch_size')}job {entry.name!r}"
        if entry.batch_size is None:
            # The user wrote no batch size: say where the number comes from.
            who += f" (no batch size given: {app.name}'s smallest validated, {batch})"
        if not low <= batch <= high:
            raise ValueError(
                f"{who}: batch size {batch} is outside the range validated for "
                f"{app.name} [{low}, {high}]"
            )
        atomic, _ = app.fixed_config(replicas, batch, force_accum=batch > low)
        if atomic < app.min_local_bsz:
            raise ValueError(
                f"{who}: batch size {batch} on {replicas} GPU(s) gives {app.name} a per-GPU "
                f"batch of {atomic}, below the smallest measured ({app.min_local_bsz})"
            )

    def _make_job(self, entry: WorkloadJob, app: Application) -> SimJob:
        batch = entry.batch_size if entry.batch_size is not None else app.init_batch_size
        if self.adaptive and entry.category not in (None, ADAPTIVE_CATEGORY):
            raise ValueError(
                f"{entry.where('category')}job {entry.name!r} is {entry.category!r}, but "
                f"policy {self.policy.name!r} adapts every job's GPUs and batch size; only "
                f"{ADAPTIVE_CATEGORY!r} jobs (or no category) can be simulated with it "
                "(fixed-size policies such as tiresias run every job as given)"
            )
        if not self.adaptive:
            return SimJob(
                entry.name,
                app,
                entry.submission_time,
                requested_replicas=entry.num_replicas,
                target_batch_size=batch,
            )
        from adaptdl.sim._agent import GoodputAgent

        if app.name in PINNED_MODELS:
            return SimJob(
                entry.name,
                app,
                entry.submission_time,
                requested_replicas=1,
                target_batch_size=app.max_batch_size,
                agent=GoodputAgent(app, fit=True),
            )
        return SimJob(
            entry.name,
            app,
            entry.submission_time,
            requested_replicas=entry.num_replicas,
            agent=GoodputAgent(app, fit=True),
        )

    @property
    def done(self) -> bool:
        """Whether every job has completed."""
        return self._num_complete == len(self.jobs)

    def _interfering_jobs(self) -> set[str]:
        """Distributed jobs with a GPU on a node shared with another distributed job."""
        counts: dict[str, int] = {}
        distributed: list[tuple[str, set[str]]] = []
        for key, alloc in self.allocations.items():
            used = set(alloc)
            if len(used) > 1:
                distributed.append((key, used))
                for node in used:
                    counts[node] = counts.get(node, 0) + 1
        return {key for key, used in distributed if any(counts[n] > 1 for n in used)}

    def _job_info(self, job: SimJob) -> JobInfo:
        app = job.app
        if self.adaptive and job.agent is not None:
            # Explore gradually: at most twice the largest size profiled so far.
            cap = min(
                max(2 * job.max_profiled_replicas, 1),
                MAX_EXPLORED_REPLICAS,
                app.max_batch_size // app.min_local_bsz,
            )
            if app.name in PINNED_MODELS:
                cap = 1
            speedup = job.agent.speedup_fn()
        else:
            batch = job.target_batch_size or app.init_batch_size
            # A fixed batch cannot be split over more GPUs than min_local allows.
            cap = 1 if app.name in PINNED_MODELS else max(batch // app.min_local_bsz, 1)
            cap = min(cap, MAX_EXPLORED_REPLICAS)  # the scalability traces end there
            if self.policy.gang_scheduled:
                # The gang size is the workload's; its batch was checked for it.
                cap = max(cap, job.requested_replicas or 1)
            speedup = linear_speedup
        self._max_replicas[job.name] = cap
        return JobInfo(
            resources={"gpu": 1},
            speedup_fn=speedup,
            submission_time=job.submission_time,
            attained_service=job.attained_service,
            num_restarts=job.num_restarts or 0,
            min_replicas=0,
            max_replicas=cap,
            preemptible=True,
            requested_replicas=job.requested_replicas,
            step_time_fn=partial(self._packed_step_time, job),
            remaining_iterations=job.remaining_iterations(),
        )

    def _packed_step_time(self, job: SimJob, num_replicas: int) -> float:
        """Optimus' step-time oracle for ``job``, naming the job when the traces lack it.

        Raises:
            ValueError: ``num_replicas`` is outside ``[1, max_replicas]`` of the
                job's :class:`JobInfo` (a policy's mistake, named as such).
        """
        high = self._max_replicas.get(job.name)
        if (
            isinstance(num_replicas, bool)
            or not isinstance(num_replicas, (int, np.integer))
            or num_replicas < 1
            or (high is not None and num_replicas > high)
        ):
            raise _OracleError(
                f"policy {self._policy_label()} asked job {job.name!r} for step_time_fn("
                f"{num_replicas!r}): expected an int from 1 to its max_replicas={high}"
            )
        try:
            return job.packed_step_time(num_replicas, self.gpus_per_node)
        except ValueError as exc:
            raise self._trace_gap(job, f"{num_replicas} packed GPU(s)", exc) from None

    def _trace_gap(self, job: SimJob, where: str, exc: ValueError) -> ValueError:
        """A failed trace lookup for ``job``, naming its file:line, the time and ``where``."""
        origin = self._origins.get(job.name) or "workload"
        return _OracleError(
            f"{origin}: job {job.name!r} at t={self.current_time:.0f}s on {where}: {exc}"
        )

    def tick(self) -> None:
        """Advance one interval and run one scheduling round."""
        interval = self.interval
        slowed = self._interfering_jobs() if self.interference > 0 else set()
        held = advanced = False
        for job in self.jobs:
            if job.completion_time is not None:
                continue
            before = job.progress
            held = held or bool(job.placement)
            try:
                job.step(interval, self.interference if job.name in slowed else 0.0)
            except ValueError as exc:
                # Trace lookups fail only for configurations the traces lack.
                raise self._trace_gap(job, f"placement {job.placement}", exc) from None
            advanced = advanced or job.progress > before
            if job.completion_time is not None:
                self._num_complete += 1
        self.current_time += interval
        self._frozen_rounds = self._frozen_rounds + 1 if held and not advanced else 0
        if self._frozen_rounds >= STALL_ROUNDS:
            running = [j.name for j in self.jobs if j.placement and j.completion_time is None]
            raise RuntimeError(
                f"policy {self._policy_label()}: no job made progress for {STALL_ROUNDS} rounds "
                f"in a row although jobs held GPUs (e.g. {', '.join(running[:5])}): each "
                f"change of a job's allocation costs a {RESTART_DELAY:g} s restart delay, and "
                f"the policy changed every running job's again before it was over "
                f"(interval={interval:g} s)"
            )
        now = self.current_time
        active = [
            job for job in self.jobs if job.submission_time <= now and job.completion_time is None
        ]
        if not active:
            self._skip_idle_rounds()
            return
        infos = {job.name: self._job_info(job) for job in active}
        previous = {k: v for k, v in self.allocations.items() if k in infos}
        start = time.perf_counter()
        try:
            # Copies: a policy that edits its inputs must not edit the cluster.
            nodes = copy_nodes(self.nodes)
            decision = self.policy.optimize(dict(infos), nodes, dict(previous), now)
        except _OracleError:
            raise  # raised by the simulator's own callback, and says so
        except Exception as exc:
            raise PolicyError(
                f"policy {self._policy_label()} raised {type(exc).__name__} in optimize(): {exc}"
            ) from exc
        self.policy_time += time.perf_counter() - start
        allocations = self._check_decision(decision, infos, previous)
        wanted = getattr(decision, "desired_nodes", None)
        if wanted is not None and wanted != len(self.nodes) and not self._warned_desired_nodes:
            self._warned_desired_nodes = True
            _LOG.warning(
                "policy %s asks for %s nodes; the simulated cluster stays at %d "
                "(autoscaling is not simulated)",
                self._policy_label(),
                wanted,
                len(self.nodes),
            )
        for job in active:
            new = allocations.get(job.name, ())
            old = previous.get(job.name, ())
            # The same replicas listed in another order are not a move.
            if new != old and Counter(new) != Counter(old):
                job.reallocate(placement_of(new))
        self.allocations = allocations
        self._stalled_rounds = 0 if allocations else self._stalled_rounds + 1
        if self._stalled_rounds >= STALL_ROUNDS:
            waiting = [job.name for job in active]
            raise RuntimeError(
                f"policy {self._policy_label()} left all {len(active)} waiting jobs without "
                f"GPUs for {STALL_ROUNDS} rounds in a row (e.g. {', '.join(waiting[:5])}) "
                "with the cluster empty; it will never schedule them"
            )

    def _check_decision(
        self,
        decision: object,
        infos: Mapping[str, JobInfo],
        previous: Mapping[str, tuple[str, ...]],
    ) -> dict[str, tuple[str, ...]]:
        """The decision's non-empty allocations, refused if the cluster could not run them.

        A custom policy's mistakes are named here, by policy and job, instead
        of surfacing later as a trace lookup that blames the workload.
        """
        name = self._policy_label()
        if isinstance(decision, Decision):
            for key, alloc in decision.allocations.items():
                if alloc and key not in infos:
                    raise PolicyError(f"policy {name} allocated {self._inactive(key)}")
        try:
            return check_decision(decision, infos, self.nodes, previous)
        except DecisionError as exc:
            raise PolicyError(f"policy {name} {exc}") from None

    def _policy_label(self) -> str:
        """The policy's name (or class) and the simulated time, for error messages."""
        label = self._registered_name or self.policy.name or type(self.policy).__name__
        return f"{label!r} at t={self.current_time:.0f}s"

    def _inactive(self, key: str) -> str:
        """A job the decision may not allocate, described (often a cached old decision)."""
        job = self._by_name.get(key)
        if job is None:
            return f"unknown job {key!r}"
        if job.completion_time is not None:
            return f"job {key!r}, which completed at t={job.completion_time:.0f}s"
        return f"job {key!r}, which is not submitted until t={job.submission_time:.0f}s"

    def _skip_idle_rounds(self) -> None:
        """Jump over rounds in which no job is submitted or running.

        Nothing happens in those rounds, so landing on the last round boundary
        before the next arrival gives the same result as ticking through
        them; every unfinished job's clock (equal to the cluster's between
        rounds) moves with it. The clock lands exactly where ticking's
        repeated additions would (see :func:`_advance_clock`), so results
        stay bit-identical for any interval.
        """
        upcoming = [
            job.submission_time for job in self.jobs if job.submission_time > self.current_time
        ]
        if not upcoming:
            return
        start = self.current_time
        self.current_time = _advance_clock(start, self.interval, min(upcoming))
        if self.current_time == start:
            return
        for job in self.jobs:
            if job.completion_time is None:
                job.current_time = self.current_time

    def run(self, progress: ProgressFn | None = None, max_time: float = MAX_RUN_TIME) -> None:
        """Tick until every job completes.

        Raises:
            RuntimeError: no job made progress for :data:`STALL_ROUNDS`
                rounds in a row (the policy left the cluster empty with jobs
                waiting, or kept restarting every running job), or the simulated clock
                passed ``max_time`` seconds after the last arrival.
            ValueError: a job reached a configuration its traces lack (the
                message names the job's file and line).
        """
        total = len(self.jobs)
        # The limit counts from the last arrival: a late arrival is not a hang.
        last_arrival = max((job.submission_time for job in self.jobs), default=0.0)
        limit = max_time + last_arrival
        while not self.done:
            self.tick()
            if progress is not None:
                progress(self.current_time, self._num_complete, total)
            if self.current_time > limit and not self.done:
                stuck = [j.name for j in self.jobs if j.completion_time is None][:5]
                # Name the limit: with a huge interval, one round passes it and
                # blaming the policy would mislead.
                hint = (
                    f"only {max_time / self.interval:.0f} rounds of interval={self.interval:g} s "
                    "fit in that limit"
                    if self.interval * 100 > max_time
                    else "does the policy ever schedule them?"
                )
                raise RuntimeError(
                    f"simulated clock reached {self.current_time:.0f} s, past the limit of "
                    f"{limit:.0f} s ({_duration(max_time)} after the last arrival at "
                    f"{last_arrival:.0f} s), with jobs still incomplete "
                    f"(e.g. {', '.join(stuck)}); {hint}"
                )

    def result(self, workload: str, wall_time: float = 0.0) -> SimResult:
        """Collect per-job results (all jobs must be complete)."""
        jobs = []
        for job in self.jobs:
            if job.completion_time is None:
                raise RuntimeError(f"job {job.name!r} has not completed")
            jobs.append(
                JobResult(
                    name=job.name,
                    application=job.app.name,
                    submission_time=job.submission_time,
                    completion_time=job.completion_time,
                    jct=job.completion_time - job.submission_time,
                    num_restarts=job.num_restarts or 0,
                    gpu_seconds=job.attained_service,
                    allocations=tuple(job.history),
                )
            )
        makespan = max(j.completion_time for j in jobs)
        return SimResult(
            policy=self._registered_name or self.policy.name or type(self.policy).__name__,
            workload=workload,
            jobs=tuple(jobs),
            makespan=makespan,
            wall_time=wall_time,
            policy_time=self.policy_time,
            options={
                "nodes": float(len(self.nodes)),
                "gpus_per_node": float(self.gpus_per_node),
                "interval": float(self.interval),
                "interference": float(self.interference),
                **({} if self.seed is None else {"seed": float(self.seed)}),
            },
        )


def _duration(seconds: float) -> str:
    """``seconds`` in the largest unit that reads naturally (years, days, hours, s)."""
    for unit, size in (("years", 365 * 86400.0), ("days", 86400.0), ("hours", 3600.0)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def _advance_clock(start: float, step: float, limit: float) -> float:
    """Where ``t = start; while t + step < limit: t += step`` leaves ``t``, in O(binades).

    The simulator's clock is a running sum of float additions, so a skip must
    reproduce their rounding, not compute ``start + k * step``. Inside one
    binade ``[2**e, 2**(e+1))`` every float is a multiple of the binade's ulp
    ``u``, so each addition that stays in the binade adds ``step / u`` rounded
    to an integer (ties to an even result, which makes every increment after
    the first even). That run of additions is counted in closed form with
    exact fractions; additions that leave a binade are done as floats. The
    loop therefore takes at most a few passes per binade crossed (under 100
    up to 2**40 s) whatever ``limit - start`` is.

    Args:
        start: The clock now (>= 0).
        step: The scheduling interval (> 0, finite).
        limit: Stop before the first sum that is not below it.
    """
    t = start
    while t + step < limit:
        if t <= 0:
            t += step  # no binade to reason in yet
            continue
        _, exponent = math.frexp(t)  # t in [2**(exponent-1), 2**exponent)
        scale = Fraction(2) ** (53 - exponent)  # 1 / ulp of t's binade
        units = int(math.ldexp(t, 53 - exponent))  # t / ulp, in [2**52, 2**53)
        q = Fraction(step) * scale  # the exact step in ulps
        whole = math.floor(q)
        tie = q - whole == Fraction(1, 2)
        if tie and units % 2:
            t += step  # the first tie rounds to an even count; then all are even
            continue
        increment = whole + (whole % 2 if tie else round(q - whole))
        if increment == 0:
            return t  # the sum never moves (ticking would never end either)
        # Steps k = 0, 1, ... from units + k * increment are taken while
        # the exact sum stays in the binade, and the rounded sum is below limit.
        room = 2**53 - units - q
        in_binade = math.ceil(room / increment) if room > 0 else 0
        below = Fraction(limit) * scale - units
        before_limit = max(math.ceil(below / increment) - 1, 0)
        count = min(in_binade, before_limit)
        if count == 0:
            t += step  # this addition leaves the binade
            continue
        t = math.ldexp(float(units + count * increment), exponent - 53)
    return t


def simulate(
    workload_path: str | os.PathLike[str] | Sequence[WorkloadJob],
    policy: Policy | str,
    *,
    traces_dir: str | os.PathLike[str] | None = None,
    nodes: int = 16,
    gpus_per_node: int = 4,
    interval: float = 60,
    interference: float = 0.0,
    seed: int | None = None,
    progress: ProgressFn | None = None,
    max_jobs: int | None = None,
    name: str | None = None,
) -> SimResult:
    """Simulate one workload under one policy.

    Args:
        workload_path: Workload CSV, or its jobs as :func:`read_workload`
            returns them (so that a file read once, e.g. from a pipe, is
            simulated exactly as it was checked).
        policy: A fresh policy object or a registered policy name; a name is
            instantiated with ``seed=`` when its factory accepts it. Seed a
            policy object when creating it: ``seed`` cannot reach it.
        traces_dir: Folder with one sub-folder of traces per model
            (default: :func:`find_traces_dir`).
        nodes: Nodes in the cluster.
        gpus_per_node: GPUs per node.
        interval: Seconds between scheduling rounds.
        interference: Slowdown of co-located distributed jobs.
        seed: Seed of a policy given by name (default 0); an error with a
            policy object. Recorded in the result's options.
        progress: Called after every tick with (time, completed, total).
        max_jobs: Simulate only the first ``max_jobs`` (>= 1) jobs of the file.
        name: Workload name in the result (default: the file's stem, or
            ``"workload"`` for jobs).

    Returns:
        Per-job JCTs, restarts and GPU time, and the makespan.

    Raises:
        PolicyError: the policy raised (its exception is the cause), or
            returned a decision :func:`adaptdl.sched.check_decision` refuses
            (beyond the cluster, outside a job's replica limits, not grouped
            by node, moving a non-preemptible job).
        RuntimeError: no job made progress for :data:`STALL_ROUNDS` rounds,
            or the run passed :data:`MAX_RUN_TIME` after the last arrival.
        ValueError: bad options, or a job reached a configuration its
            traces lack (the message names the job's file and line).

    Note:
        Set ``OMP_NUM_THREADS=1`` (before numpy is imported) on shared
        machines: the throughput fits and the 3-D interpolation are tiny,
        and multi-threaded BLAS makes them up to 20 times slower under load.
    """
    if max_jobs is not None and not _is_int_at_least(max_jobs, 1):
        raise ValueError(f"max_jobs={max_jobs!r}: must be an integer >= 1 (or None for all)")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name={name!r}: expected the workload's name as a str (or None)")
    if isinstance(workload_path, (bytes, bytearray)):
        # A Sequence too, of ints: named here rather than as "job 0: got 47".
        raise TypeError(
            f"workload_path={workload_path!r}: expected a str or os.PathLike path "
            "(decode bytes first) or a sequence of WorkloadJob"
        )
    apps = load_applications(find_traces_dir(traces_dir))
    if isinstance(workload_path, (str, os.PathLike)):
        jobs = read_workload(workload_path, apps)
        default_name = Path(workload_path).stem
    elif isinstance(workload_path, Sequence):
        # Checked by the Simulator, like a file's jobs.
        jobs = list(cast(Sequence[WorkloadJob], workload_path))
        default_name = "workload"
    else:
        raise TypeError(
            f"workload_path={workload_path!r}: expected a path or a sequence of WorkloadJob"
        )
    if max_jobs is not None:
        jobs = jobs[:max_jobs]
    registered_name = ""
    seed_used = True
    if isinstance(policy, str):
        seed = 0 if seed is None else seed
        _check_seed(seed)  # before the policy is built with it
        registered_name = policy
        # A policy that takes no seed has no seed to record: a sweep over
        # seeds would otherwise file identical runs under different ones.
        seed_used = _takes_seed(policy)
        policy = make_policy(policy, seed)
    elif seed is not None:
        raise ValueError(
            f"seed={seed!r} with a policy object: the seed only builds a policy given by "
            "name; pass it when creating the object instead (get_policy(name, seed=...))"
        )
    sim = Simulator(
        jobs,
        policy,
        apps,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        interval=interval,
        interference=interference,
        seed=seed if seed_used else None,
        policy_name=registered_name or None,
    )
    start = time.perf_counter()
    sim.run(progress)
    return sim.result(default_name if name is None else name, time.perf_counter() - start)


def make_policy(name: str, seed: int = 0) -> Policy:
    """Instantiate a registered policy, passing ``seed`` when its factory takes one.

    Raises:
        ValueError: ``name`` is not registered (the message lists valid names).
    """
    return get_policy(name, seed=seed) if _takes_seed(name) else get_policy(name)


def _takes_seed(name: str) -> bool:
    """Whether the factory registered as ``name`` takes a ``seed`` argument.

    Raises:
        ValueError: ``name`` is not registered (the message lists valid names).
    """
    import inspect

    factory = policy_factory(name)  # raises, listing the valid names
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == "seed" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
