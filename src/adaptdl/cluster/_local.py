"""The local backend: elastic jobs as process groups on this machine.

Each replica slot is a GPU when the machine has any (a replica sees exactly one
through ``CUDA_VISIBLE_DEVICES``) and otherwise one CPU core. A job's restart
group is one process per replica, each in a session of its own, started with
the ``ADAPTDL_*`` environment. A replica ends with its session: processes its
command leaves behind are terminated by its shim (see ``_replica.py``) before
its exit is recorded, so they outlive neither the job nor its deletion.
Rescaling follows the AdaptDL protocol: SIGTERM to every replica, which
checkpoints and exits with 143, then a new group with the new size and
``ADAPTDL_NUM_RESTARTS`` one higher, which restores the checkpoint. Any other
exit code is a failure: the group is stopped and started again from the last
checkpoint until ``maxRestarts`` is spent, then the job is Failed with the
replica's traceback as its message.

Every transition is written to SQLite (:class:`~adaptdl.cluster._store.Store`)
before it is acted upon, and every replica runs under a small shim that
records its exit code in a file, so a daemon that is killed and started again
re-adopts live replicas (by pid and kernel start time) and learns how the
others ended.

With ``warm_start`` (the daemon's default), ``python SCRIPT ...`` replicas
are forked from a pre-warmed *zygote* (:mod:`adaptdl.cluster._zygote`) that
has imported torch already, which takes the interpreter and import start-up
(seconds of CPU) out of every rescale. A warm replica runs under a forked
shim with the same session, exit-file and signal semantics, so everything
above holds for it unchanged; its shim is the zygote's child rather than the
daemon's, so the backend watches it through ``/proc`` and the exit file, as
it does for re-adopted replicas, plus the zygote's exit reports. Any launch
the zygote cannot serve (not ready, dead, refused) falls back to the cold
path, and a dead zygote is restarted.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from adaptdl.cluster import _replica
from adaptdl.cluster._backend import (
    Backend,
    BackendError,
    ClusterEvent,
    JobExistsError,
    JobNotFoundError,
    JobStatus,
    Phase,
    UnauthorizedError,
    _as_allocation,
)
from adaptdl.cluster._reap import reap_in_background
from adaptdl.cluster._spec import JobSpec, JobSpecError, check_launchable
from adaptdl.cluster._store import STORE_FILE, EventRow, JobRow, Store, private_dir
from adaptdl.cluster._zygote import DEFAULT_PRELOAD, Zygote, ZygoteError, startup_env_differs
from adaptdl.sched import MAX_COUNT, Allocation, NodeInfo

__all__ = ["PYTHON_COMMANDS", "LocalBackend", "check_command", "detect_gpus", "gpu_slot_shortfall"]

_LOG = logging.getLogger(__name__)

#: The shim every replica runs under (executed by path: no package import).
_SHIM = str(Path(__file__).with_name("_replica.py"))
#: The exit code of a replica that checkpointed on request.
EXIT_RESCALE = 143
#: Pseudo exit code of a replica whose shim vanished without a record.
EXIT_LOST = -1000

#: Unrequested checkpoint-and-exits within this many seconds double the next
#: restart's delay, up to MAX_UNASKED_DELAY seconds.
UNASKED_WINDOW = 600.0
MAX_UNASKED_DELAY = 300.0
_UNASKED = "without being asked to"
#: Seconds a Starting group must stay up before it counts as Running.
_STARTUP_SECONDS = 1.0
#: Launch errors that pass (too many processes or open files, no memory):
#: counted as one failure, not a permanent LaunchError.
_TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})
#: The only node of a local cluster.
NODE_NAME = "local"
#: Seconds before a zygote that died is restarted; doubles while it keeps
#: dying before it is ready, up to :data:`_ZYGOTE_MAX_BACKOFF`.
_ZYGOTE_BACKOFF = 2.0
_ZYGOTE_MAX_BACKOFF = 300.0
#: Seconds after the SIGKILL at the end of a grace period that a group still
#: waits for processes left by a shim that died (unkillable ones, in
#: uninterruptible I/O, must not hold the job forever).
_ORPHAN_KILL_WAIT = 10.0


def detect_gpus() -> list[str]:
    """The NVIDIA GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` values.

    Each identifier is what one replica's ``CUDA_VISIBLE_DEVICES`` is set to:
    an index (``"0"``), a GPU UUID (``"GPU-..."``) or a MIG device
    (``"MIG-..."``). In order:

    * ``CUDA_VISIBLE_DEVICES``, when set, is the set, read as CUDA reads it:
      indices and UUIDs up to the first invalid entry (``""`` or ``"-1"``:
      no GPU).
    * Else ``nvidia-smi -L`` lists the GPUs, by UUID (asked instead of
      importing a deep-learning framework, which would add seconds to the
      daemon's start); a GPU split into MIG devices contributes those devices,
      and one in MIG mode without MIG instances (nothing can run on it)
      contributes none, told apart by ``nvidia-smi --query-gpu=mig.mode.current``.
    * Else, in a container without ``nvidia-smi``, an explicit
      ``NVIDIA_VISIBLE_DEVICES`` list (not ``all``/``none``/``void``) gives
      the count; the container sees those GPUs renumbered from 0, so their
      UUIDs are kept and indices become positions.

    Returns:
        Identifiers without duplicates; empty on a machine without GPUs.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _parse_devices(visible)
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return _container_devices(os.environ.get("NVIDIA_VISIBLE_DEVICES", ""))
    try:
        out = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    devices = _parse_nvidia_smi(out.stdout)
    if any(device.startswith("GPU-") for device in devices):
        unusable = _mig_without_instances(tool, devices)
        if unusable:
            _LOG.warning(
                "skipping GPU(s) %s: MIG mode is enabled but no MIG instance exists; "
                "create instances (nvidia-smi mig -cgi ... -C) or disable MIG mode",
                ", ".join(unusable),
            )
            devices = [device for device in devices if device not in unusable]
    return devices


def _mig_without_instances(tool: str, devices: Sequence[str]) -> list[str]:
    """The whole GPUs among ``devices`` whose current MIG mode is enabled.

    ``_parse_nvidia_smi`` has already replaced every GPU that has MIG
    instances by those instances, so a whole GPU still in MIG mode has none.
    When the query fails (an old driver, no MIG support), none is dropped.
    """
    try:
        out = subprocess.run(
            [tool, "--query-gpu=uuid,mig.mode.current", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    enabled: set[str] = set()
    for line in out.stdout.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[1].lower() == "enabled":
            enabled.add(fields[0])
    return [device for device in devices if device in enabled]


#: Programs the local backend runs with the cluster's own interpreter (no lookup).
PYTHON_COMMANDS = ("python", "python3")


def check_command(spec: JobSpec, environ: Mapping[str, str]) -> None:
    """Check that a replica could find ``spec``'s program when it starts.

    A program without a ``/`` is looked up, by exec as on Kubernetes, on the
    ``PATH`` of the replica's environment: ``environ`` (the environment the
    replicas start from) updated by ``spec.env``; never in the job's
    directory. Relative ``PATH`` entries count from the job's directory, where
    the replica starts. Programs with a ``/`` and ``python``/``python3``
    are not checked here.

    Args:
        spec: The job.
        environ: The environment every replica starts from.

    Raises:
        BackendError: the program is not on that ``PATH``; the message names
            the job, the program and, when a file of that name is in the
            job's directory, the ``./NAME`` fix.
    """
    program = spec.command[0]
    if program in PYTHON_COMMANDS or "/" in program:
        return
    workdir = Path(spec.working_dir)
    path = {**environ, **spec.env}.get("PATH", os.defpath)
    entries = [str(workdir / entry) if entry else str(workdir) for entry in path.split(os.pathsep)]
    if shutil.which(program, path=os.pathsep.join(entries)):
        return
    where = f"the PATH of the cluster's replicas ({path})"
    if (workdir / program).is_file():
        hint = f"'./{program}'" + (f" or 'python {program}'" if program.endswith(".py") else "")
        raise BackendError(
            f"command {program!r} of job {spec.name!r} is not on {where}: a command without "
            f"a '/' is looked up there, not in the job's directory {spec.working_dir}; "
            f"write {hint} to run the file there"
        )
    raise BackendError(
        f"command {program!r} of job {spec.name!r} was not found on {where}; give its "
        "full path, or set PATH in the job's env"
    )


def _is_uuid(item: str) -> bool:
    return item.startswith(("GPU-", "MIG-"))


def _is_index(item: str) -> bool:
    """Whether ``item`` is a device index: ASCII digits only (not ``'²'``)."""
    return item.isascii() and item.isdecimal()


def _parse_devices(value: str) -> list[str]:
    """Device identifiers of a ``CUDA_VISIBLE_DEVICES`` value, as CUDA reads it."""
    devices: list[str] = []
    for raw in value.split(","):
        item = raw.strip()
        if _is_index(item):
            item = str(int(item))
        elif not _is_uuid(item):
            break  # CUDA ignores an invalid entry and every one after it
        if item not in devices:
            devices.append(item)
    return devices


_GPU_LINE = re.compile(r"GPU (\d+):(?:.*\(UUID: (GPU-[^)\s]+)\))?")
_MIG_LINE = re.compile(r"\s+MIG\b.*\(UUID: (MIG-[^)\s]+)\)")


def _parse_nvidia_smi(listing: str) -> list[str]:
    """Identifiers from ``nvidia-smi -L``: GPU UUIDs, or MIG UUIDs where split.

    UUIDs, not indices: ``nvidia-smi`` numbers GPUs in PCI bus order while
    CUDA's default order (fastest first) may differ, and a UUID names the
    same GPU in both. A line without a UUID falls back to its index. A GPU
    in MIG mode that has no MIG instances looks like an ordinary GPU in this
    listing; :func:`detect_gpus` asks for the MIG mode to drop it.
    """
    devices: list[str] = []
    gpu: str | None = None  # the last GPU listed, while no MIG device follows it
    for line in listing.splitlines():
        match = _GPU_LINE.match(line)
        if match:
            gpu = match.group(2) or match.group(1)
            devices.append(gpu)
            continue
        mig = _MIG_LINE.match(line)
        if mig is None:
            continue
        if gpu is not None and devices and devices[-1] == gpu:
            devices.pop()  # a GPU in MIG mode: its MIG devices are the slots
        gpu = None
        devices.append(mig.group(1))
    return devices


def _check_gpus(gpus: Sequence[int | str]) -> list[str]:
    """Validate the ``gpus`` argument of :class:`LocalBackend` as identifiers."""
    if isinstance(gpus, (str, bytes)):
        raise ValueError(f"gpus={gpus!r}: expected a list of GPU indices or UUIDs")
    devices: list[str] = []
    for gpu in gpus:
        if isinstance(gpu, int) and not isinstance(gpu, bool) and gpu >= 0:
            device = str(gpu)
        elif isinstance(gpu, str) and _is_index(gpu):
            device = str(int(gpu))
        elif isinstance(gpu, str) and _is_uuid(gpu):
            device = gpu
        else:
            raise ValueError(
                f"gpus contains {gpu!r}: expected an index >= 0 (ASCII digits) or a GPU-/MIG- UUID"
            )
        if device in devices:
            raise ValueError(f"gpus lists {device!r} twice")
        devices.append(device)
    return devices


def _container_devices(value: str) -> list[str]:
    """GPUs the NVIDIA container runtime exposed, from ``NVIDIA_VISIBLE_DEVICES``."""
    value = value.strip()
    if value.lower() in ("", "all", "none", "void"):
        return []  # "all": unknown without nvidia-smi; the others: no GPU
    items = list(dict.fromkeys(item.strip() for item in value.split(",") if item.strip()))
    if all(_is_uuid(item) for item in items):
        return items
    return [str(index) for index in range(len(items))]


def gpu_slot_shortfall(slots: int, gpus: Sequence[str]) -> str | None:
    """Why ``slots`` replica slots cannot run on ``gpus``, or None when they can.

    Each slot is one GPU; without GPUs, slots are CPU slots and any count runs.
    """
    if not gpus or slots <= len(gpus):
        return None
    return (
        f"this machine has {len(gpus)} GPUs ({', '.join(gpus)}) and each slot is one GPU; "
        f"ask for at most {len(gpus)}"
    )


def _ends_a_line(path: Path) -> bool:
    """Whether the file is empty or its last byte is a newline."""
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return True
        handle.seek(size - 1)
        return handle.read(1) == b"\n"


class LocalBackend(Backend):
    """Run jobs as local process groups; state in ``<home>/state.db``.

    Args:
        home: Cluster home: ``state.db``, ``zygote.log`` (the warm-start
            process's own output) plus ``jobs/<name>/{checkpoint,share,logs,run}``.
        slots: Replica slots on CPU-only machines (default: the core count);
            with GPUs, the number of GPUs to use (default: all).
        gpus: GPUs to use, as ``CUDA_VISIBLE_DEVICES`` values (indices, or
            ``GPU-``/``MIG-`` UUIDs); default: :func:`detect_gpus`. ``[]``
            forces CPU slots.
        supervisor_url: URL replicas use for discovery and hints.
        grace_period: Seconds replicas get to checkpoint after SIGTERM before
            they are killed.
        restart_delay: Seconds to wait before restarting a failed job.
        python: Interpreter that replaces ``python``/``python3`` in commands.
        warm_start: Launch ``python SCRIPT ...`` replicas by forking a
            pre-warmed zygote (:mod:`adaptdl.cluster._zygote`) that has
            imported ``preload`` already, instead of starting an interpreter
            that imports torch again; other commands, and every launch while
            the zygote is starting or down, take the cold path.
        preload: Modules the zygote imports besides
            :data:`~adaptdl.cluster._zygote.DEFAULT_PRELOAD`.
    """

    name = "local"

    def __init__(
        self,
        home: str | Path,
        *,
        slots: int | None = None,
        gpus: Sequence[int | str] | None = None,
        supervisor_url: str = "",
        grace_period: float = 30.0,
        restart_delay: float = 1.0,
        python: str | None = None,
        warm_start: bool = False,
        preload: Sequence[str] = (),
    ) -> None:
        if slots is not None and (isinstance(slots, bool) or not 1 <= slots <= MAX_COUNT):
            # The upper bound is the scheduler's limit on a node's resources.
            raise ValueError(f"slots={slots!r}: expected an integer from 1 to 2**31 - 1")
        self._gpus = detect_gpus() if gpus is None else _check_gpus(gpus)
        if slots is not None:
            shortfall = gpu_slot_shortfall(slots, self._gpus)
            if shortfall is not None:
                raise ValueError(f"slots={slots}: {shortfall}")
        if self._gpus:
            self._gpus = self._gpus[: slots or len(self._gpus)]
            self._slots = len(self._gpus)
        else:
            self._slots = slots or os.cpu_count() or 1
        self.home = private_dir(Path(home).expanduser().resolve())
        self.store = Store(self.home / STORE_FILE)
        if (self.home / "trash").is_dir():  # directories an earlier daemon left half-deleted
            for leftover in (self.home / "trash").iterdir():
                _empty_in_background(leftover)
        self.supervisor_url = supervisor_url
        self.grace_period = grace_period
        # Monotonic twins of the stored wall-clock times this process set:
        # when each job's stop began, and until when it must wait to restart.
        # A clock step (NTP, a resumed VM) must not stretch a grace period or
        # cut it short; after a daemon restart the stored times are used.
        self._stop_began: dict[str, float] = {}
        self._hold_until: dict[str, float] = {}
        self.restart_delay = restart_delay
        self.python = python or sys.executable
        self._lock = threading.RLock()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        #: (job, group) -> when (monotonic) its replicas were SIGKILLed.
        self._killed: dict[tuple[str, int], float] = {}
        self._last_reconcile: float | None = None
        #: Set by :meth:`shutdown`: stop every group, launch none.
        self._draining = False
        self.warm_start = warm_start
        self.preload = list(dict.fromkeys([*DEFAULT_PRELOAD, *preload]))
        self._zygote: Zygote | None = None
        self._zygote_retry_at = 0.0
        self._zygote_backoff = _ZYGOTE_BACKOFF
        self._recover()
        if warm_start:
            self._ensure_zygote(time.monotonic())

    # ------------------------------------------------------------------ snapshot

    def slot_resource(self) -> str:
        """``"gpu"`` on a GPU machine, else ``"cpu"``."""
        return "gpu" if self._gpus else "cpu"

    @property
    def slots(self) -> int:
        """Total replica slots."""
        return self._slots

    def nodes(self) -> dict[str, NodeInfo]:
        """One node, ``local``, with every slot."""
        return {NODE_NAME: NodeInfo(resources={self.slot_resource(): self._slots})}

    def job_dir(self, name: str) -> Path:
        """Directory holding a job's checkpoint, share, logs and run files."""
        return self.home / "jobs" / name

    def jobs(self, *, include_finished: bool = True) -> dict[str, JobStatus]:
        """Snapshot of every job (deleted ones show as Stopping until gone)."""
        out = {}
        for row in self.store.all(active_only=not include_finished):
            status = self._status(row)
            if include_finished or status.phase not in (Phase.SUCCEEDED, Phase.FAILED):
                out[row.name] = status
        return out

    def events(self, name: str | None = None) -> list[ClusterEvent]:
        """Recorded events, oldest first."""
        return [_event(row) for row in self.store.events(name)]

    # ------------------------------------------------------------------ requests

    def submit(self, spec: JobSpec) -> JobStatus:
        """Record a new Pending job and create its directories.

        A deleted job's name is free again once its replicas have stopped and
        it is gone; the new job starts with fresh directories and events.

        Raises:
            BackendError: the name is taken (or its job is still being
                deleted), the job needs more slots than the machine has, its
                working directory is missing, its command line holds a NUL
                byte, or its program is not on the replicas' ``PATH`` (see
                :func:`check_command`).
        """
        if spec.min_replicas > self._slots:
            raise BackendError(
                f"job {spec.name!r} needs minReplicas={spec.min_replicas} but this cluster "
                f"has only {self._slots} {self.slot_resource()} slots"
            )
        if not Path(spec.working_dir).is_dir():
            state = "is a file" if Path(spec.working_dir).exists() else "does not exist"
            raise BackendError(f"job {spec.name!r}: working directory {spec.working_dir!r} {state}")
        try:
            check_launchable(spec)
        except JobSpecError as exc:
            raise BackendError(f"job {spec.name!r}: {exc}") from None
        check_command(spec, self._base_env())
        now = time.time()
        row = JobRow(
            name=spec.name,
            spec=spec.to_json(),
            token=secrets.token_urlsafe(24),
            phase=Phase.PENDING.value,
            submitted=now,
        )
        with self._lock:
            existing = self.store.get(spec.name)
            if existing is not None:
                self._refuse_taken_name(spec.name, existing)
            root = self.job_dir(spec.name)
            if root.exists():  # left over from a deleted job of the same name
                self._discard(root)
            try:
                for sub in ("checkpoint", "share", "logs", "run"):
                    (root / sub).mkdir(parents=True, exist_ok=True)
                # Row and event together: a full disk leaves neither, so no
                # half-submitted job without its "Submitted" event remains.
                with self.store.transaction():
                    self.store.insert(row)
                    self.store.add_event(spec.name, "Submitted", _describe_spec(spec), now)
            except OSError as exc:
                shutil.rmtree(root, ignore_errors=True)
                raise BackendError(
                    f"job {spec.name!r}: cannot create its directories in {root}: {exc}"
                ) from None
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
            stored = self.store.get(spec.name)
        assert stored is not None  # noqa: S101 - just inserted under the lock
        return self._status(stored)

    @staticmethod
    def _refuse_taken_name(name: str, existing: JobRow) -> NoReturn:
        if existing.deleted:
            raise BackendError(
                f"job {name!r} is still being deleted (its replicas are "
                "checkpointing and stopping); submit it again once 'adaptdl ls' no "
                "longer lists it, or pick another --name"
            )
        raise JobExistsError(
            f"a job named {name!r} already exists ({existing.phase}); delete it or pick "
            "another --name"
        )

    def delete(self, name: str) -> None:
        """Checkpoint-stop the job's replicas, then forget it and its files."""
        with self._lock:
            row = self._row(name)
            if row.deleted and row.phase in (Phase.STOPPING.value, Phase.PENDING.value):
                return  # under way; a job marked but left running is stopped below
            self.store.update(name, deleted=1)
            row.deleted = 1
            if row.phase in (Phase.STARTING.value, Phase.RUNNING.value):
                self._begin_stop(row, "delete", time.time())
            elif row.phase == Phase.STOPPING.value:
                self.store.update(name, stop_reason="delete")
            else:
                self._forget(row)

    def set_allocation(self, name: str, allocation: Allocation) -> None:
        """Record the scheduler's allocation; :meth:`reconcile` acts on it."""
        with self._lock:
            row = self._row(name)
            if row.phase in (Phase.SUCCEEDED.value, Phase.FAILED.value) or row.deleted:
                return
            allocation = tuple(allocation)
            for node in allocation:
                if node != NODE_NAME:
                    raise BackendError(f"allocation for {name!r} names unknown node {node!r}")
            if len(allocation) > self._slots:
                raise BackendError(
                    f"allocation of {len(allocation)} replicas for {name!r} exceeds "
                    f"{self._slots} slots"
                )
            if tuple(row.allocation) == allocation:
                return
            self.store.update(name, allocation=list(allocation))
            self.store.add_event(
                name,
                "Allocated",
                f"scheduler allocated {_replicas(len(allocation))} (was {len(row.allocation)})",
            )

    def set_metrics(self, name: str, batch_size: int | None, goodput: float | None) -> None:
        """Store the predicted batch size and goodput for ``ls``."""
        with self._lock:
            if self.store.get(name) is not None:
                self.store.update(name, batch_size=batch_size, goodput=goodput)

    def set_hints(self, name: str, hints: Mapping[str, Any]) -> None:
        """Store the job's latest scheduling hints."""
        with self._lock:
            self._row(name)
            self.store.update(name, hints=dict(hints))

    def authorize(self, job_id: str, token: str | None) -> str:
        """Check ``token`` against the job's secret; the job id is its name.

        A missing token is reported before the job is looked up, so a caller
        without one cannot learn which jobs exist.
        """
        if not token:
            raise UnauthorizedError(
                f"job {job_id!r}: missing job token (Authorization: Bearer)", missing=True
            )
        row = self._row(job_id)
        if not hmac.compare_digest(token.encode(), row.token.encode()):
            raise UnauthorizedError(f"job {job_id!r}: wrong job token", missing=False)
        return row.name

    def discover(self, name: str, group: int) -> list[str] | None:
        """All replicas share this host; answer once the group is launched."""
        row = self._row(name)
        if row.grp != group or row.phase not in (Phase.STARTING.value, Phase.RUNNING.value):
            return None
        if len(row.replicas) != len(row.group_allocation):
            return None
        return ["127.0.0.1"] * len(row.group_allocation)

    def token(self, name: str) -> str:
        """The job's secret (for tests and tools running as the cluster owner)."""
        return self._row(name).token

    # ------------------------------------------------------------------ reconcile

    def reconcile(self, now: float) -> list[ClusterEvent]:
        """Advance every job's state machine by one step."""
        events: list[EventRow] = []
        if self.warm_start:
            self._ensure_zygote(time.monotonic())
        with self._lock:
            elapsed = 0.0 if self._last_reconcile is None else max(now - self._last_reconcile, 0)
            self._last_reconcile = now
            rows = self.store.all(active_only=True)  # finished jobs need no step
            used = sum(len(row.group_allocation) for row in rows if self._holds_slots(row))
            for row in rows:
                if row.phase in (Phase.SUCCEEDED.value, Phase.FAILED.value):
                    continue
                if self._holds_slots(row) and elapsed:
                    self.store.update(
                        row.name, attained=row.attained + elapsed * len(row.group_allocation)
                    )
                before = self._holds_slots(row)
                try:
                    events.extend(self._step(row, now, self._slots - used))
                except Exception:  # keep the other jobs going; the log has details
                    _LOG.exception("reconciling job %s failed", row.name)
                refreshed = self.store.get(row.name)
                after = refreshed is not None and self._holds_slots(refreshed)
                if after and not before and refreshed is not None:
                    used += len(refreshed.group_allocation)
                elif before and not after:
                    used -= len(row.group_allocation)
        return [_event(event) for event in events]

    def _holds_slots(self, row: JobRow) -> bool:
        return row.phase in (Phase.STARTING.value, Phase.RUNNING.value, Phase.STOPPING.value)

    def _step(self, row: JobRow, now: float, free: int) -> list[EventRow]:
        phase = Phase(row.phase)
        if phase is Phase.PENDING:
            if row.deleted:
                self._forget(row)
                return [EventRow(row.name, now, "Deleted", "job deleted")]
            want = len(row.allocation)
            spec = _stored_spec(row)
            waiting = self._held_until(row, now) is not None
            if want == 0 or want < spec.min_replicas or waiting:
                return []
            if want > free:
                return []  # another job is still checkpointing out of these slots
            if self._draining:
                return []  # the cluster is stopping: the job resumes on the next start
            return self._launch(row, spec, now)
        codes, orphaned = self._exit_codes(row)
        if phase is Phase.STOPPING:
            if all(code is not None for code in codes):
                if row.stop_reason == "incomplete" and self._adopt_late_shims(row, now):
                    return []  # a shim of the interrupted launch started late: wait for it too
                return self._finish_group(row, [c for c in codes if c is not None], now)
            began = self._stop_began.get(row.name)
            stopping_for = (
                time.monotonic() - began
                if began is not None
                else (None if row.stop_time is None else now - row.stop_time)
            )
            if stopping_for is not None and stopping_for > self.grace_period:
                key = (row.name, row.grp)
                if key not in self._killed:
                    self._killed[key] = time.monotonic()
                    self._signal_all(row, signal.SIGKILL)
                    return [
                        self.store.add_event(
                            row.name,
                            "Killed",
                            f"replicas did not exit within {self.grace_period:.0f}s of "
                            "SIGTERM; killed them",
                            now,
                        )
                    ]
            return []
        # Starting or Running.
        if orphaned:
            rank, count = orphaned[0]
            message = (
                f"replica {rank}'s shim (pid {row.replicas[rank]['pid']}) died and left "
                f"{count} process{'es' if count != 1 else ''} of the replica running; "
                "stopping them"
            )
            self.store.update(row.name, reason="ReplicaFailed", message=message)
            return [
                self.store.add_event(row.name, "ReplicaFailed", message, now),
                *self._begin_stop(row, "failure", now),
            ]
        if row.deleted:
            # Marked deleted but not stopping: the daemon died (or a write
            # failed) between the two updates of delete(). Stop it now.
            return self._begin_stop(row, "delete", now)
        if self._draining:
            return self._begin_stop(row, "shutdown", now)
        exited = [(rank, code) for rank, code in enumerate(codes) if code is not None]
        if exited:
            if len(exited) == len(codes):
                return self._finish_group(row, [code for _, code in exited], now)
            bad = [(rank, code) for rank, code in exited if code not in (0, EXIT_RESCALE)]
            if bad:
                rank, code = bad[0]
                message = _failure_message(self._log_path(row.name, rank), rank, code)
                self.store.update(row.name, reason="ReplicaFailed", message=message)
                return [
                    self.store.add_event(row.name, "ReplicaFailed", message.splitlines()[0], now),
                    *self._begin_stop(row, "failure", now),
                ]
            if any(code == EXIT_RESCALE for _, code in exited):
                return self._begin_stop(row, "preempted", now)
            return []  # some replicas finished first; wait for the rest
        if len(row.replicas) < len(row.group_allocation):
            return self._begin_stop(row, "incomplete", now)  # launch was interrupted
        if sorted(row.allocation) != sorted(row.group_allocation):
            return self._begin_stop(row, "rescale", now)
        if phase is Phase.STARTING and now - (row.group_started or now) >= _STARTUP_SECONDS:
            self.store.update(row.name, phase=Phase.RUNNING.value)
            return [
                self.store.add_event(
                    row.name,
                    "Running",
                    f"{_replicas(len(row.group_allocation))} running (restart group {row.grp})",
                    now,
                )
            ]
        return []

    def _launch(self, row: JobRow, spec: JobSpec, now: float) -> list[EventRow]:
        allocation = list(row.allocation)
        count = len(allocation)
        group = row.grp + 1
        devices: list[str] = []
        if self._gpus:
            busy = {
                str(device)  # older state stored indices as ints
                for other in self.store.all(active_only=True)
                if other.name != row.name and self._holds_slots(other)
                for device in other.devices
            }
            devices = [gpu for gpu in self._gpus if gpu not in busy][:count]
            if len(devices) < count:
                return []
        port = _free_port()
        self.store.update(
            row.name,
            phase=Phase.STARTING.value,
            grp=group,
            group_allocation=allocation,
            group_started=now,
            started=row.started if row.started is not None else now,
            master_port=port,
            replicas=[],
            devices=devices,
            stop_reason=None,
            stop_time=None,
            reason=None,
        )
        verb = "started" if group == 0 else "restarted"
        events = [
            self.store.add_event(
                row.name,
                "Started",
                f"{verb} with {_replicas(count)} (restart group {group})",
                now,
            )
        ]
        argv = [self.python if spec.command[0] in PYTHON_COMMANDS else spec.command[0]]
        argv += list(spec.argv[1:])
        replicas: list[dict[str, Any]] = []
        zygote = self._warm_zygote(row.name, spec)
        grace = self.grace_period  # what each shim gives the processes a replica leaves

        def launch_failed(rank: int, exc: Exception) -> list[EventRow]:
            # Whatever went wrong (a missing working directory, a log path that
            # is a directory, a NUL byte in an argument), the job fails with the
            # reason instead of being relaunched forever; only a shortage of
            # processes, descriptors or memory, which passes, counts as one
            # failure against maxRestarts.
            message = f"cannot start replica {rank}: {exc}"
            self.store.update(row.name, replicas=replicas)
            row.replicas = replicas
            self._signal_all(row, signal.SIGKILL)
            for replica in replicas:  # reap them: the failed job is never polled again
                proc = self._procs.pop(int(replica["pid"]), None)
                if proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=1)  # under the lock: SIGKILLed, it ends at once
                    reap_in_background(proc)  # a loaded host may take longer
            if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
                cleared: dict[str, Any] = {"replicas": [], "group_allocation": [], "devices": []}
                return [
                    *events,
                    self._count_failure(row, spec, "LaunchError", message, now, cleared),
                ]
            failed = self._mark_failed(
                row, "LaunchError", message, message, now, group_allocation=[], replicas=[]
            )
            return [*events, failed]

        for rank in range(count):
            exit_file = self._exit_file(row.name, group, rank)
            try:
                exit_file.unlink(missing_ok=True)
                Path(_replica.pid_file(str(exit_file))).unlink(missing_ok=True)
                Path(_replica.child_file(str(exit_file))).unlink(missing_ok=True)
                Path(_replica.killed_marker(str(exit_file))).unlink(missing_ok=True)
                env = self._replica_env(row, spec, group, rank, allocation, port, devices)
                log = self._open_log(row.name, rank, group, count)
            except (OSError, ValueError) as exc:
                return launch_failed(rank, exc)
            if zygote is not None:
                log.close()
                try:
                    pid = zygote.launch(
                        spec.argv[1:],
                        cwd=spec.working_dir,
                        env=env,
                        log=self._log_path(row.name, rank),
                        exit_file=exit_file,
                        grace=self.grace_period,
                    )
                except ZygoteError as exc:
                    _LOG.warning(
                        "job %s replica %d: warm start failed (%s); starting it cold",
                        row.name,
                        rank,
                        exc,
                    )
                    zygote = None
                    try:
                        log = open(self._log_path(row.name, rank), "ab")  # noqa: SIM115
                    except (OSError, ValueError) as error:
                        return launch_failed(rank, error)
                else:
                    replicas.append({"rank": rank, "pid": pid, "start": _replica.start_time(pid)})
                    self.store.update(row.name, replicas=replicas)
                    continue
            try:
                proc = subprocess.Popen(
                    [self.python, _SHIM, str(exit_file), "--grace", f"{grace}", "--", *argv],
                    cwd=spec.working_dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except (OSError, ValueError) as exc:
                log.close()
                return launch_failed(rank, exc)
            log.close()
            self._procs[proc.pid] = proc
            replicas.append({"rank": rank, "pid": proc.pid, "start": _replica.start_time(proc.pid)})
            self.store.update(row.name, replicas=replicas)
        return events

    def _replica_env(
        self,
        row: JobRow,
        spec: JobSpec,
        group: int,
        rank: int,
        allocation: Sequence[str],
        port: int,
        devices: Sequence[str],
    ) -> dict[str, str]:
        env = self._base_env()
        env.update(spec.env)
        root = self.job_dir(row.name)
        env.update(
            {
                "ADAPTDL_JOB_ID": row.name,
                "ADAPTDL_REPLICA_RANK": str(rank),
                "ADAPTDL_NUM_REPLICAS": str(len(allocation)),
                "ADAPTDL_NUM_NODES": str(len(set(allocation))),
                "ADAPTDL_NUM_RESTARTS": str(group),
                "ADAPTDL_CHECKPOINT_PATH": str(root / "checkpoint"),
                "ADAPTDL_SHARE_PATH": str(root / "share"),
                "ADAPTDL_SUPERVISOR_URL": self.supervisor_url,
                "ADAPTDL_JOB_TOKEN": row.token,
                "ADAPTDL_MASTER_ADDR": "127.0.0.1",
                "ADAPTDL_MASTER_PORT": str(port),
                "ADAPTDL_SCHED_VERSION": _version(),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices[rank]
        return env

    def _base_env(self) -> dict[str, str]:
        """The environment every replica (and the zygote) starts from."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("ADAPTDL_")}
        if not self._gpus:
            env.setdefault("OMP_NUM_THREADS", "1")  # one core per CPU slot
        return env

    # ------------------------------------------------------------------ warm start

    def _ensure_zygote(self, now: float) -> None:
        """Start the zygote, or restart it (with back-off) after it died."""
        with self._lock:
            zygote = self._zygote
            if zygote is not None and not zygote.dead:
                if zygote.ready:
                    self._zygote_backoff = _ZYGOTE_BACKOFF
                return
            if now < self._zygote_retry_at:
                return
            if zygote is not None:
                _LOG.warning("restarting the warm-start zygote (the last one exited)")
            self._zygote_retry_at = now + self._zygote_backoff
            self._zygote_backoff = min(self._zygote_backoff * 2, _ZYGOTE_MAX_BACKOFF)
            zygote = Zygote(self.python, self.preload, self._base_env(), self.home / "zygote.log")
            self._zygote = zygote
            try:
                zygote.start()
            except ZygoteError as exc:
                _LOG.warning("warm start unavailable, launching replicas cold: %s", exc)

    def wait_warm(self, timeout: float) -> bool:
        """Block until the zygote is ready (True) or ``timeout`` passes.

        For benchmarks and tests that need the warm path from the first launch.
        """
        zygote = self._zygote
        return zygote is not None and zygote.wait_ready(timeout)

    def _warm_zygote(self, name: str, spec: JobSpec) -> Zygote | None:
        """The zygote to launch ``spec`` with, or None for the cold path."""
        zygote = self._zygote
        if not self.warm_start or zygote is None:
            return None
        command = spec.argv
        if command[0] not in PYTHON_COMMANDS or len(command) < 2:
            return None  # not ``python SCRIPT ...``: a binary, ``-m``, ``-c``
        if command[1].startswith("-"):
            return None
        if not zygote.ready:
            _LOG.info("job %s: the zygote is not ready; launching cold", name)
            return None
        differs = startup_env_differs({**self._base_env(), **spec.env}, zygote.env)
        if differs:
            _LOG.info("job %s sets %s; launching cold", name, ", ".join(differs))
            return None
        return zygote

    def _exit_file(self, name: str, group: int, rank: int) -> Path:
        """Where the shim of ``rank`` in restart ``group`` records its exit code."""
        return self.job_dir(name) / "run" / f"g{group}-r{rank}.exit"

    def _log_path(self, name: str, rank: int) -> Path:
        return self.job_dir(name) / "logs" / f"replica-{rank}.log"

    def _open_log(self, name: str, rank: int, group: int, count: int) -> IO[bytes]:
        path = self._log_path(name, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "ab")  # noqa: SIM115 - handed to the child process
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        # The header starts a line even after a cut-off progress bar.
        handle.write(b"" if _ends_a_line(path) else b"\n")
        handle.write(
            f"===== adaptdl: restart group {group}, replica {rank} of {count}, "
            f"started {stamp} =====\n".encode()
        )
        handle.flush()
        return handle

    def _exit_codes(self, row: JobRow) -> tuple[list[int | None], list[tuple[int, int]]]:
        """Exit code per launched replica (None while it runs), and the orphaned ones.

        A replica whose shim died (killed on its own: no exit file, or one
        the zygote wrote for it) while processes of the replica live on is
        *orphaned*: nobody ends those processes or records
        their exit code, so it counts as running until they are gone (or
        until :data:`_ORPHAN_KILL_WAIT` after our SIGKILL), and the caller
        stops the group. The second list holds (rank, processes left).
        """
        codes = self._shim_codes(row)
        orphaned: list[tuple[int, int]] = []
        killed = self._killed.get((row.name, row.grp))
        if killed is not None and time.monotonic() - killed > _ORPHAN_KILL_WAIT:
            return codes, orphaned
        for rank, (replica, code) in enumerate(zip(row.replicas, codes)):
            exit_file = str(self._exit_file(row.name, row.grp, replica["rank"]))
            if code is None or (
                os.path.exists(exit_file) and not os.path.exists(_replica.killed_marker(exit_file))
            ):
                continue  # running, or its shim ended the session and wrote the code
            left = _orphans(int(replica["pid"]), replica.get("start"))
            if left:
                codes[rank] = None
                orphaned.append((rank, len(left)))
        return codes, orphaned

    def _shim_codes(self, row: JobRow) -> list[int | None]:
        """Exit code per launched replica's shim; None while the shim runs."""
        codes: list[int | None] = []
        for replica in row.replicas:
            exit_file = self._exit_file(row.name, row.grp, replica["rank"])
            pid = int(replica["pid"])
            proc = self._procs.get(pid)
            if proc is not None:
                if proc.poll() is None:
                    codes.append(None)
                    continue
                del self._procs[pid]
                code = _read_code(exit_file)
                codes.append(code if code is not None else proc.returncode)
                continue
            code = _read_code(exit_file)
            zygote = self._zygote
            if code is None and (
                _alive(pid, replica.get("start")) or (zygote is not None and zygote.pending(pid))
            ):
                codes.append(None)  # running, or its zygote has yet to record it
                continue
            if code is None:
                code = _read_code(exit_file)  # it may have exited between the two looks
            if code is None and zygote is not None:
                code = zygote.exit_code(pid)
            codes.append(EXIT_LOST if code is None else code)
        return codes

    def _begin_stop(self, row: JobRow, reason: str, now: float) -> list[EventRow]:
        """SIGTERM every replica so it checkpoints; move to Stopping."""
        self.store.update(row.name, phase=Phase.STOPPING.value, stop_reason=reason, stop_time=now)
        self._stop_began[row.name] = time.monotonic()
        self._signal_all(row, signal.SIGTERM)
        texts = {
            "rescale": f"rescaling from {len(row.group_allocation)} to {len(row.allocation)} "
            "replicas: checkpointing",
            "failure": "stopping the other replicas after a failure",
            "preempted": "a replica checkpointed and exited; restarting the group",
            "incomplete": "the daemon stopped while launching; restarting the group",
            "delete": "deleting: checkpointing and stopping replicas",
            "shutdown": "cluster shutting down: checkpointing and stopping replicas",
        }
        return [self.store.add_event(row.name, "Stopping", texts.get(reason, reason), now)]

    def _signal_all(self, row: JobRow, signum: int) -> None:
        for replica in row.replicas:
            pid = int(replica["pid"])
            if pid not in self._procs and not _alive(pid, replica.get("start")):
                for orphan in _orphans(pid, replica.get("start")):  # its shim died
                    _replica.signal_member(orphan, signum, pid)
                continue
            # A SIGKILL ends the shim before it can end its session, so the
            # members that left its process group (a helper started with a
            # group of its own) are killed here, or they would run on.
            members = _replica.leftovers(pid) if signum == signal.SIGKILL else []
            if signum == signal.SIGKILL:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signum)  # the shim leads a session: the whole replica
            else:
                # The command's process alone (see _replica.py): its loader
                # workers are its own to stop.
                exit_file = self._exit_file(row.name, row.grp, replica["rank"])
                _replica.signal_replica(pid, str(exit_file), signum)
            for member in members:
                _replica.signal_member(member, signum, pid)

    def _finish_group(self, row: JobRow, codes: list[int], now: float) -> list[EventRow]:
        """Every replica of the group has exited: decide what comes next."""
        reason = row.stop_reason
        killed = self._killed.pop((row.name, row.grp), None) is not None
        cleared: dict[str, Any] = {"replicas": [], "group_allocation": [], "devices": []}
        if row.deleted:
            self._forget(row)
            return [EventRow(row.name, now, "Deleted", "job deleted")]
        if codes and all(code == 0 for code in codes):
            self.store.update(
                row.name,
                phase=Phase.SUCCEEDED.value,
                reason="Completed",
                completed=self._group_ended(row, now),
                allocation=[],
                **cleared,
            )
            return [self.store.add_event(row.name, "Succeeded", "all replicas exited with 0", now)]
        benign = {0, EXIT_RESCALE, -signal.SIGTERM}
        if killed or reason in ("rescale", "delete", "shutdown"):
            # Our own kill at the end of the grace period. A replica adopted
            # after a daemon restart is not our child, so its code is lost.
            benign |= {-signal.SIGKILL, EXIT_LOST}
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in benign]
        spec = _stored_spec(row)
        message = row.message if reason == "failure" and row.message else None
        if not failed and not spec.preemptible and reason in (None, "preempted"):
            # As in the original: a job that may not be preempted has no
            # business exiting to be restarted, so nobody-asked-for 143 (or an
            # outside SIGTERM) is a failure, counted against maxRestarts.
            failed = [
                (rank, code)
                for rank, code in enumerate(codes)
                if code in (EXIT_RESCALE, -signal.SIGTERM)
            ]
            if failed:
                # Not one replica by name: after the first one's own exit, the
                # daemon stopped the others (with SIGTERM) itself.
                message = (
                    "a replica exited to be restarted (code 143, or SIGTERM) without the "
                    "daemon asking, but the job is not preemptible (spec.preemptible: false); "
                    f"exit codes by rank: {codes}"
                )
        if reason == "failure" or failed:
            if message is None:
                rank, code = failed[0]
                message = _failure_message(self._log_path(row.name, rank), rank, code)
            return [self._count_failure(row, spec, "ReplicaFailed", message, now, cleared)]
        # A checkpoint-and-exit nobody asked for (an outside SIGTERM, or a job
        # that exits 143 on its own) restarts after a delay, not at once, that
        # doubles with each such exit in the last UNASKED_WINDOW seconds: a
        # job that always does it cannot spin the daemon or hog its slots.
        unasked = reason in (None, "preempted") and EXIT_RESCALE in codes
        wait = self._unasked_delay(row.name, now) if unasked else 0.0
        delay = {"not_before": now + wait} if unasked else {}
        self.store.update(row.name, phase=Phase.PENDING.value, reason=None, **cleared, **delay)
        self._stop_began.pop(row.name, None)
        if unasked:
            self._hold_until[row.name] = time.monotonic() + wait
        unsaved = [
            rank
            for rank, code in enumerate(codes)
            if code in (-signal.SIGTERM, -signal.SIGKILL, EXIT_LOST)
        ]
        if unsaved:
            # SIGTERM before the job installed its handler (start-up) or after Python
            # dropped it (interpreter shutdown): nothing new was saved.
            text = (
                f"replicas {unsaved} were killed before they could checkpoint; the job "
                "resumes from its last checkpoint"
            )
            return [self.store.add_event(row.name, "Interrupted", text, now)]
        text = f"all {len(codes)} replicas checkpointed and exited"
        if unasked:
            text += f" {_UNASKED}; restarting in {wait:g}s"
        return [self.store.add_event(row.name, "Checkpointed", text, now)]

    def _count_failure(
        self,
        row: JobRow,
        spec: JobSpec,
        reason: str,
        message: str,
        now: float,
        cleared: Mapping[str, Any],
    ) -> EventRow:
        """Count one failure against ``maxRestarts``: restart after a delay, or give up.

        Args:
            reason: The status reason (``ReplicaFailed``, ``LaunchError``).
            message: What failed; its first line goes into the event.
            cleared: The columns to reset (replicas, allocations, devices).
        """
        failures = row.failures + 1
        if failures > spec.max_restarts:
            summary = (
                f"{message.splitlines()[0]}; gave up after {failures} failures "
                f"(maxRestarts={spec.max_restarts})"
            )
            return self._mark_failed(
                row,
                reason,
                message,
                summary,
                now,
                completed=self._group_ended(row, now),
                failures=failures,
                **cleared,
            )
        self.store.update(
            row.name,
            phase=Phase.PENDING.value,
            reason=reason,
            message=message,
            failures=failures,
            not_before=now + self.restart_delay,
            **cleared,
        )
        self._stop_began.pop(row.name, None)
        self._hold_until[row.name] = time.monotonic() + self.restart_delay
        return self.store.add_event(
            row.name,
            "Restarting",
            f"{message.splitlines()[0]}; restarting from the last checkpoint "
            f"(failure {failures} of maxRestarts={spec.max_restarts})",
            now,
        )

    def _group_ended(self, row: JobRow, now: float) -> float:
        """When the group's last replica ended: its exit file's time, else ``now``.

        A group that ended while no daemon was running is only noticed when
        the next one starts; the job's completion (and so its duration) is
        the replicas' end, not that start.
        """
        ended = 0.0
        for replica in row.replicas:
            try:
                stamp = self._exit_file(row.name, row.grp, replica["rank"]).stat().st_mtime
            except OSError:
                return now  # no record of when it ended
            ended = max(ended, stamp)
        return min(now, ended) if row.replicas else now

    def _unasked_delay(self, name: str, now: float) -> float:
        """``restart_delay`` doubled for each recent unrequested checkpoint-and-exit."""
        recent = sum(
            1
            for event in self.store.events(name)
            if event.kind == "Checkpointed"
            and _UNASKED in event.message
            and now - event.time < UNASKED_WINDOW
        )
        cap = max(MAX_UNASKED_DELAY, self.restart_delay)
        return float(min(self.restart_delay * 2.0 ** min(recent, 30), cap))

    def _mark_failed(
        self,
        row: JobRow,
        reason: str,
        message: str,
        summary: str,
        now: float,
        completed: float | None = None,
        **fields: Any,
    ) -> EventRow:
        """Record the job as Failed for good, free its GPUs and emit the Failed event.

        Args:
            reason: The status reason (``LaunchError``, ``ReplicaFailed``).
            message: The full status message (e.g. a replica's traceback).
            summary: The one-line event text.
            completed: When the job ended, if earlier than ``now``.
            fields: Further columns to update (cleared replicas, the failure count).
        """
        self.store.update(
            row.name,
            phase=Phase.FAILED.value,
            reason=reason,
            message=message,
            completed=now if completed is None else completed,
            allocation=[],
            **fields,
        )
        return self.store.add_event(row.name, "Failed", summary, now)

    def _forget(self, row: JobRow) -> None:
        self._stop_began.pop(row.name, None)
        self._hold_until.pop(row.name, None)
        self.store.remove(row.name)
        self._discard(self.job_dir(row.name))

    def _discard(self, path: Path) -> None:
        """Move a job's directory aside at once; delete it in the background.

        Deleting a large checkpoint takes seconds, and this runs under the
        backend's lock, which every request (submit, hints, discovery) needs.
        """
        if not path.exists():
            return
        trash = self.home / "trash"
        target = trash / f"{path.name}-{secrets.token_hex(4)}"
        try:
            trash.mkdir(exist_ok=True)
            path.rename(target)  # the same file system: instant
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
            return
        _empty_in_background(target)

    # ------------------------------------------------------------------ lifecycle

    def _recover(self) -> None:
        """Re-adopt the replicas a previous daemon launched."""
        now = time.time()
        for row in self.store.all():
            if not self._holds_slots(row):
                continue
            if len(row.replicas) < len(row.group_allocation):
                row.replicas = self._unrecorded_shims(row)
            alive = [
                int(replica["pid"])
                for replica in row.replicas
                if _alive(int(replica["pid"]), replica.get("start"))
            ]
            self.store.add_event(
                row.name,
                "Adopted",
                f"daemon restarted: {len(alive)} of {len(row.group_allocation)} replicas of "
                f"restart group {row.grp} still alive",
                now,
            )
            if row.phase == Phase.STOPPING.value:
                self.store.update(row.name, stop_time=now)  # a fresh grace period
                self._stop_began[row.name] = time.monotonic()

    def _adopt_late_shims(self, row: JobRow, now: float) -> bool:
        """Record (and stop) shims of an interrupted launch that wrote their pid file late.

        A shim the last daemon started just before it died may not have
        written its pid file by the time the next daemon recovered; it is
        looked for again before the interrupted group counts as ended. It
        gets a grace period of its own, then SIGKILL like any replica.
        """
        if len(row.replicas) >= len(row.group_allocation):
            return False
        found = self._unrecorded_shims(row)
        if len(found) == len(row.replicas):
            return False
        row.replicas = found
        self._killed.pop((row.name, row.grp), None)
        self._stop_began[row.name] = time.monotonic()
        self.store.update(row.name, stop_time=now)
        self._signal_all(row, signal.SIGTERM)
        return True

    def _unrecorded_shims(self, row: JobRow) -> list[dict[str, Any]]:
        """``row.replicas`` plus shims the last daemon started but died before recording.

        Their pid files (written by each shim as it starts) name them. Once
        recorded, they run on if the whole group was launched; otherwise the
        interrupted group is stopped whole (them included) and launched again.
        """
        replicas = list(row.replicas)
        known = {int(replica["rank"]) for replica in replicas}
        for rank in range(len(row.group_allocation)):
            found = _replica.read_pid_file(str(self._exit_file(row.name, row.grp, rank)))
            if rank in known or found is None or not _alive(*found):
                continue
            pid, start = found
            replicas.append({"rank": rank, "pid": pid, "start": start})
            _LOG.warning(
                "job %s: adopting replica %d (pid %d), launched by the last daemon but not "
                "recorded",
                row.name,
                rank,
                pid,
            )
        replicas.sort(key=lambda replica: int(replica["rank"]))
        if len(replicas) != len(row.replicas):
            self.store.update(row.name, replicas=replicas)
        return replicas

    def shutdown(self, *, stop_jobs: bool, timeout: float | None = None) -> None:
        """Optionally checkpoint-stop every job (they resume on the next start).

        With ``stop_jobs`` the backend *drains*: every running group is asked
        to checkpoint and no group is launched any more, so a job whose
        replicas checkpoint while another job is still saving stays Pending
        (with its allocation) instead of being restarted, and resumes when the
        next daemon starts.
        """
        if stop_jobs:
            now = time.time()
            with self._lock:
                self._draining = True
                for row in self.store.all():
                    if row.phase in (Phase.STARTING.value, Phase.RUNNING.value):
                        self._begin_stop(row, "shutdown", now)
            # Monotonic: a clock step must not cut the drain short or stretch it.
            deadline = time.monotonic() + (self.grace_period + 5 if timeout is None else timeout)
            while time.monotonic() < deadline:
                self.reconcile(time.time())
                if not any(self._holds_slots(row) for row in self.store.all(active_only=True)):
                    break
                time.sleep(0.1)
        zygote, self._zygote = self._zygote, None
        self.warm_start = False
        if zygote is not None:
            zygote.stop()
        with self._lock:
            # Shims of jobs left running are no longer polled; their exits
            # must not stay zombies of this process.
            procs, self._procs = list(self._procs.values()), {}
        for proc in procs:
            reap_in_background(proc)

    def close(self) -> None:
        """Close ``state.db``; call it once no request thread can use it."""
        self.store.close()

    # ------------------------------------------------------------------ helpers

    def _row(self, name: str) -> JobRow:
        row = self.store.get(name)
        if row is None:
            raise JobNotFoundError(name)
        return row

    def _status(self, row: JobRow) -> JobStatus:
        root = self.job_dir(row.name)
        phase = Phase(row.phase)
        reason = row.reason
        if row.deleted:
            phase, reason = Phase.STOPPING, "Deleting"
        return JobStatus(
            spec=_stored_spec(row),
            phase=phase,
            reason=reason,
            message=row.message,
            submitted=row.submitted,
            started=row.started,
            completed=row.completed,
            allocation=_as_allocation(row.allocation),
            replicas=len(row.group_allocation) if self._holds_slots(row) else 0,
            restarts=row.grp,
            failures=row.failures,
            hints=row.hints,
            attained_service=row.attained,
            batch_size=row.batch_size,
            goodput=row.goodput,
            paths={
                "checkpoint": str(root / "checkpoint"),
                "share": str(root / "share"),
                "logs": str(root / "logs"),
            },
            not_before=self._held_until(row, time.time()),
        )

    def _held_until(self, row: JobRow, now: float) -> float | None:
        """When a held-back restart of the job may start (wall clock), or None if it may now.

        A hold this process set follows the monotonic clock; after a daemon
        restart, the stored wall-clock time is all there is.
        """
        if row.phase != Phase.PENDING.value:
            return None
        hold = self._hold_until.get(row.name)
        if hold is not None:
            left = hold - time.monotonic()
            return now + left if left > 0 else None
        return row.not_before if now < row.not_before else None


def _event(row: EventRow) -> ClusterEvent:
    return ClusterEvent(job=row.job, kind=row.kind, message=row.message, time=row.time)


def _describe_spec(spec: JobSpec) -> str:
    top = "unbounded" if spec.max_replicas >= 2**31 - 1 else str(spec.max_replicas)
    return (
        f"submitted: {shlex.join(spec.argv)} (replicas {spec.min_replicas}..{top}, "
        f"maxRestarts={spec.max_restarts})"
    )


def _free_port() -> int:
    """A TCP port that was free a moment ago, for the job's rank-0 server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _version() -> str:
    from adaptdl import __version__

    return __version__


def _read_code(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int, start: int | None) -> bool:
    """Whether ``pid`` is running and is the process we started (not a re-use)."""
    fields = _replica.proc_stat(pid)
    if fields is None:
        if Path("/proc").is_dir():
            return False
        try:  # no procfs (macOS): existence only
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] in ("Z", "X"):
        return False
    return start is None or len(fields) <= 19 or int(fields[19]) == int(start)


def _empty_in_background(path: Path) -> None:
    """Delete ``path`` in a daemon thread (what is left is removed at the next start)."""
    threading.Thread(
        target=shutil.rmtree,
        args=(path,),
        kwargs={"ignore_errors": True},
        name="adaptdl-discard",
        daemon=True,
    ).start()


def _replicas(count: int) -> str:
    return f"{count} replica" if count == 1 else f"{count} replicas"


def _orphans(pid: int, start: int | None) -> list[int]:
    """Live processes left in the session or process group of the dead shim ``pid``.

    Empty while the shim lives (it looks after its session itself) and when
    ``pid`` now names another process: the kernel does not reuse a pid
    while a group or session of that number has members, so once the
    number is taken again nothing of the shim's can be left.
    """
    fields = _replica.proc_stat(pid)
    if fields is not None:
        if start is not None and len(fields) > 19 and int(fields[19]) != int(start):
            return []
        if fields[0] not in ("Z", "X"):
            return []
    return _replica.leftovers(pid)


def _stored_spec(row: JobRow) -> JobSpec:
    """The spec of a stored job (see ``JobSpec.from_json(stored=True)``).

    Raises:
        JobSpecError: the row cannot be read even so; the message names the
            job and how to remove it.
    """
    try:
        return JobSpec.from_json(row.spec, stored=True)
    except JobSpecError as exc:
        raise JobSpecError(
            f"stored job {row.name!r} cannot be read: {exc}; remove it with "
            f"'adaptdl delete {row.name}'"
        ) from None


def _failure_message(log: Path, rank: int, code: int) -> str:
    """First line: which replica failed how; then the traceback from its log."""
    if code == EXIT_LOST:
        head = f"replica {rank} disappeared without an exit code"
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        head = f"replica {rank} was killed by {name}"
    else:
        head = f"replica {rank} exited with code {code}"
    tail = _log_tail(log)
    return f"{head}\n{tail}" if tail else head


def _log_tail(log: Path, max_lines: int = 60) -> str:
    """The traceback of the last restart group in ``log``, or its last lines."""
    try:
        with open(log, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(size - 65536, 0))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    marker = text.rfind("===== adaptdl: restart group")
    if marker >= 0:
        text = text[text.find("\n", marker) + 1 :]
    start = text.rfind("Traceback (most recent call last):")
    lines = (text[start:] if start >= 0 else text).rstrip().splitlines()
    return "\n".join(lines[-max_lines:])
