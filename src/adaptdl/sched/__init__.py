"""Scheduling policies: pure functions from cluster state to allocations.

A policy receives :class:`JobInfo` and :class:`NodeInfo` descriptions and
returns a :class:`Decision`. The simulator (:mod:`adaptdl.sim`) and the
cluster controller (:mod:`adaptdl.cluster`) drive the same policy objects.
Policies are looked up by name with :func:`get_policy`.
"""

from __future__ import annotations

from adaptdl.sched._types import (
    Allocation,
    Decision,
    JobInfo,
    NodeInfo,
    Policy,
    SpeedupFn,
    get_policy,
    linear_speedup,
    policy_names,
    register_policy,
)

__all__ = [
    "Allocation",
    "Decision",
    "JobInfo",
    "NodeInfo",
    "Policy",
    "SpeedupFn",
    "get_policy",
    "linear_speedup",
    "policy_names",
    "register_policy",
]
