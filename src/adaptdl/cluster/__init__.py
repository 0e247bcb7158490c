"""Run many elastic jobs on a cluster, scheduled by goodput.

The pieces, each replaceable:

* :class:`Backend`, found by name with :func:`get_backend`: where replicas
  run and where job records live. ``local`` runs process groups on this
  machine with state in SQLite; other backends register their own factory.
* :class:`Controller`: the only code that calls both a scheduling policy
  (:mod:`adaptdl.sched`) and a backend. It re-plans periodically, on arrivals
  and on completions.
* :class:`Supervisor`: the HTTP service replicas use for discovery and hints,
  and the CLI uses to submit and inspect jobs.
* :class:`ClusterClient` and :func:`start_daemon`: the CLI's side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaptdl.cluster._backend import (
    ACTIVE_PHASES,
    BUILTIN_BACKENDS,
    Backend,
    BackendError,
    ClusterEvent,
    JobExistsError,
    JobNotFoundError,
    JobStatus,
    Phase,
    UnauthorizedError,
    backend_names,
    get_backend,
    register_backend,
)
from adaptdl.cluster._client import (
    ClusterAPIError,
    ClusterClient,
    DaemonNotAnsweringError,
    DaemonNotRunningError,
    DaemonTimeoutError,
    default_home,
    start_daemon,
)
from adaptdl.cluster._controller import (
    Controller,
    job_info,
    predict_batch_and_goodput,
    waiting_reason,
)
from adaptdl.cluster._daemon import (
    DEFAULT_HOST,
    DEFAULT_INTERVAL,
    DEFAULT_POLICY,
    SETTINGS_FILE,
    check_listen_address,
    load_daemon_settings,
    parse_policy_options,
)
from adaptdl.cluster._local import (
    PYTHON_COMMANDS,
    LocalBackend,
    check_command,
    detect_gpus,
    gpu_slot_shortfall,
)
from adaptdl.cluster._spec import (
    API_VERSION,
    KIND,
    JobSpec,
    JobSpecError,
    check_launchable,
    load_job_file,
    parse_job_manifest,
    validate_job_name,
)
from adaptdl.cluster._store import STORE_FILE, Store
from adaptdl.cluster._supervisor import Supervisor, validate_hints
from adaptdl.cluster._zygote import DEFAULT_PRELOAD, parse_preload

__all__ = [
    "ACTIVE_PHASES",
    "API_VERSION",
    "Backend",
    "BackendError",
    "ClusterAPIError",
    "ClusterClient",
    "ClusterEvent",
    "Controller",
    "DEFAULT_HOST",
    "DEFAULT_INTERVAL",
    "DEFAULT_POLICY",
    "DEFAULT_PRELOAD",
    "DaemonNotAnsweringError",
    "DaemonTimeoutError",
    "DaemonNotRunningError",
    "JobExistsError",
    "JobNotFoundError",
    "JobSpec",
    "JobSpecError",
    "JobStatus",
    "KIND",
    "LocalBackend",
    "PYTHON_COMMANDS",
    "Phase",
    "SETTINGS_FILE",
    "STORE_FILE",
    "Store",
    "Supervisor",
    "UnauthorizedError",
    "BUILTIN_BACKENDS",
    "backend_names",
    "check_command",
    "check_launchable",
    "check_listen_address",
    "default_home",
    "detect_gpus",
    "gpu_slot_shortfall",
    "get_backend",
    "job_info",
    "load_daemon_settings",
    "load_job_file",
    "parse_job_manifest",
    "parse_policy_options",
    "parse_preload",
    "predict_batch_and_goodput",
    "register_backend",
    "start_daemon",
    "validate_hints",
    "validate_job_name",
    "waiting_reason",
]


def _local_factory(home: str | Path, **options: Any) -> Backend:
    return LocalBackend(home, **options)


register_backend("local", _local_factory)
