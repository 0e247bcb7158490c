"""Trace-driven cluster simulator for scheduling policies.

Reproduces the physics of the Pollux (OSDI'21) simulator: measured step
times, gradient statistics and per-epoch progress of six models drive
simulated jobs, and any :class:`adaptdl.sched.Policy` decides allocations
every scheduling interval. The deterministic baselines (``tiresias``,
``optimus``) reproduce the published per-job completion times to the second.

Example::

    from adaptdl.sim import simulate
    result = simulate("workload-1.csv", "tiresias", traces_dir="pollux-data/traces")
    print(result.summary()["avg_jct"])
"""

from __future__ import annotations

from adaptdl.sim._job import RESTART_DELAY, SimJob, placement_of
from adaptdl.sim._simulate import (
    MAX_CLUSTER_GPUS,
    MAX_EXPLORED_REPLICAS,
    MAX_RUN_TIME,
    MAX_SEED,
    PINNED_MODELS,
    STALL_ROUNDS,
    JobResult,
    PolicyError,
    SimResult,
    Simulator,
    find_traces_dir,
    is_adaptive,
    load_applications,
    make_policy,
    simulate,
)
from adaptdl.sim._trace import Application, TraceError, load_application, normalize_placement
from adaptdl.sim._workload import (
    ADAPTIVE_CATEGORY,
    COLUMN_ALIASES,
    WorkloadError,
    WorkloadJob,
    check_jobs,
    read_workload,
)

__all__ = [
    "ADAPTIVE_CATEGORY",
    "COLUMN_ALIASES",
    "MAX_CLUSTER_GPUS",
    "MAX_EXPLORED_REPLICAS",
    "MAX_RUN_TIME",
    "MAX_SEED",
    "PINNED_MODELS",
    "STALL_ROUNDS",
    "RESTART_DELAY",
    "Application",
    "JobResult",
    "PolicyError",
    "SimJob",
    "SimResult",
    "Simulator",
    "TraceError",
    "WorkloadError",
    "WorkloadJob",
    "check_jobs",
    "find_traces_dir",
    "is_adaptive",
    "load_application",
    "load_applications",
    "make_policy",
    "normalize_placement",
    "placement_of",
    "read_workload",
    "simulate",
]
