"""Scheduling policies: pure functions from cluster state to allocations.

A policy receives :class:`JobInfo` and :class:`NodeInfo` descriptions and
returns a :class:`Decision`. The simulator (:mod:`adaptdl.sim`) and the
cluster controller (:mod:`adaptdl.cluster`) drive the same policy objects.
Policies are looked up by name with :func:`get_policy`.

Writing one: subclass :class:`Policy`, give it a ``name`` and implement
``optimize``; register its class with :func:`register_policy`. An
allocation lists one node name per replica, each node's replicas together.
Executors compare the replicas per node, so listing the same ones in another
order is not a move; a job whose replicas change restarts. The simulator
and the cluster check every decision with :func:`check_decision` (capacity,
``min_replicas`` and ``max_replicas``, grouping, non-preemptible jobs kept):
the simulator stops with a :class:`~adaptdl.sim.PolicyError` naming the
policy and the job, the cluster logs it and keeps the allocations it has.
"""

from __future__ import annotations

from adaptdl.sched._adaptdl import AdaptDLPolicy
from adaptdl.sched._optimus import OptimusPolicy
from adaptdl.sched._pollux import PolluxPolicy
from adaptdl.sched._speedup import SpeedupFunction
from adaptdl.sched._tiresias import TiresiasPolicy
from adaptdl.sched._types import (
    BUILTIN_POLICIES,
    DEFAULT_POLICY,
    MAX_COUNT,
    Allocation,
    Decision,
    DecisionError,
    JobInfo,
    NodeInfo,
    Policy,
    SpeedupFn,
    check_allocation,
    check_decision,
    check_round,
    copy_nodes,
    get_policy,
    linear_speedup,
    policy_factory,
    policy_names,
    register_policy,
)

__all__ = [
    "BUILTIN_POLICIES",
    "DEFAULT_POLICY",
    "MAX_COUNT",
    "AdaptDLPolicy",
    "Allocation",
    "Decision",
    "DecisionError",
    "JobInfo",
    "NodeInfo",
    "OptimusPolicy",
    "Policy",
    "PolluxPolicy",
    "SpeedupFn",
    "SpeedupFunction",
    "TiresiasPolicy",
    "check_allocation",
    "check_decision",
    "check_round",
    "copy_nodes",
    "get_policy",
    "linear_speedup",
    "policy_factory",
    "policy_names",
    "register_policy",
]
