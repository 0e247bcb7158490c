"""The ``ADAPTDL_*`` environment: the one place where those variables are parsed.

Every accessor reads :data:`os.environ` on each call, nothing is cached, so a
process that changes its environment (a test harness, a launcher) sees the new
values at once. A malformed value raises :class:`EnvironmentVariableError`
naming the variable and the value, instead of surfacing later as an obscure
failure deep inside a collective or a checkpoint.
"""

from __future__ import annotations

import os
import re
import sys
import urllib.parse

from adaptdl._reducer import MAX_CONNECT_TIMEOUT

__all__ = [
    "EnvironmentVariableError",
    "checkpoint_path",
    "share_path",
    "job_id",
    "master_addr",
    "master_port",
    "replica_rank",
    "num_nodes",
    "num_replicas",
    "num_restarts",
    "adaptdl_sched_version",
    "supervisor_url",
    "job_token",
    "connect_timeout",
    "tensorboard_logdir",
    "from_ray",
    "home",
    "sim_traces",
    "fit_interval",
    "decide_interval",
    "get_str",
    "get_int",
    "get_float",
    "get_bool",
]


class EnvironmentVariableError(ValueError):
    """An ``ADAPTDL_*`` variable holds a value that cannot be used."""

    def __init__(self, name: str, value: str, expected: str) -> None:
        super().__init__(f"environment variable {name}={value!r} is invalid: expected {expected}")
        self.name = name
        self.value = value


_INT_RE = re.compile(r"[+-]?[0-9]+")
#: What float() should see: ASCII only (it also takes other scripts' digits).
_FLOAT_RE = re.compile(
    r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.I
)


def get_str(name: str, default: str | None = None) -> str | None:
    """Return the variable ``name``, or ``default`` when unset or blank.

    Leading and trailing whitespace is dropped, as the numeric accessors drop
    it: a stray space from a shell script would otherwise become part of an
    address or a directory name and fail far from here.
    """
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip()


#: Largest integer an ``ADAPTDL_*`` count may hold.
_MAX_INT = 2**31 - 1


def get_int(name: str, default: int, *, minimum: int | None = None, maximum: int = _MAX_INT) -> int:
    """Parse the integer variable ``name``; ``default`` when unset or empty.

    Raises:
        EnvironmentVariableError: the value is not an integer, or is below
            ``minimum`` or above ``maximum`` (2**31 - 1 unless given: counts,
            ranks and ports beyond it overflow the C calls they reach).
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    # Plain ASCII digits only: int() would also take "1_000" or non-ASCII
    # digits, which no launcher writes and which usually mean a typo.
    if _INT_RE.fullmatch(raw.strip()) is None:
        raise EnvironmentVariableError(name, raw, "an integer")
    value = int(raw.strip())
    if minimum is not None and value < minimum:
        raise EnvironmentVariableError(name, raw, f"an integer >= {minimum}")
    if value > maximum:
        raise EnvironmentVariableError(name, raw, f"an integer <= {maximum}")
    return value


def get_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """Parse the float variable ``name``; ``default`` when unset or empty.

    Raises:
        EnvironmentVariableError: the value is not a finite number, or is below
            ``minimum``.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    # float() also takes "1_0" and non-ASCII digits; treat them as the typos they are.
    if _FLOAT_RE.fullmatch(raw.strip()) is None:
        raise EnvironmentVariableError(name, raw, "a number")
    value = float(raw.strip())
    if value != value or value in (float("inf"), float("-inf")):
        raise EnvironmentVariableError(name, raw, "a finite number")
    if minimum is not None and value < minimum:
        raise EnvironmentVariableError(name, raw, f"a number >= {minimum}")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def get_bool(name: str, default: bool) -> bool:
    """Parse the boolean variable ``name`` (1/0, true/false, yes/no, on/off)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise EnvironmentVariableError(name, raw, "a boolean (true/false, 1/0, yes/no, on/off)")


def checkpoint_path() -> str | None:
    """Directory for checkpoints (``ADAPTDL_CHECKPOINT_PATH``); None disables them."""
    return get_str("ADAPTDL_CHECKPOINT_PATH")


def share_path() -> str | None:
    """Directory shared by all replicas of a job (``ADAPTDL_SHARE_PATH``)."""
    return get_str("ADAPTDL_SHARE_PATH")


def job_id() -> str | None:
    """Identifier of the job (``ADAPTDL_JOB_ID``), e.g. ``namespace/name``."""
    return get_str("ADAPTDL_JOB_ID")


def master_addr() -> str:
    """Address of rank 0 (``ADAPTDL_MASTER_ADDR``, default ``0.0.0.0``)."""
    return get_str("ADAPTDL_MASTER_ADDR", "0.0.0.0") or "0.0.0.0"  # noqa: S104


def master_port() -> int:
    """Port of rank 0 (``ADAPTDL_MASTER_PORT``); 0 lets the OS pick one (local mode)."""
    raw = os.environ.get("ADAPTDL_MASTER_PORT", "")
    if _INT_RE.fullmatch(raw.strip()) and int(raw.strip()) > 65535:
        raise EnvironmentVariableError("ADAPTDL_MASTER_PORT", raw, "a TCP port between 0 and 65535")
    return get_int("ADAPTDL_MASTER_PORT", 0, minimum=0)


def num_replicas() -> int:
    """Number of replicas of the job (``ADAPTDL_NUM_REPLICAS``, default 1)."""
    return get_int("ADAPTDL_NUM_REPLICAS", 1, minimum=1)


# replica_rank() takes a parameter of the same name.
_num_replicas = num_replicas


def replica_rank(num_replicas: int | None = None) -> int:
    """Rank of this replica (``ADAPTDL_REPLICA_RANK``, default 0).

    Args:
        num_replicas: The replica count the rank must be below; defaults to
            ``ADAPTDL_NUM_REPLICAS`` (a caller that was given the count
            explicitly passes it, so the variable is not consulted).
    """
    if num_replicas is not None and (
        isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1
    ):
        raise ValueError(f"num_replicas={num_replicas!r}: expected an integer >= 1")
    rank = get_int("ADAPTDL_REPLICA_RANK", 0, minimum=0)
    if num_replicas is None:
        replicas, source = _num_replicas(), "ADAPTDL_NUM_REPLICAS"
    else:
        replicas, source = num_replicas, "num_replicas"
    if rank >= replicas:
        raise EnvironmentVariableError(
            "ADAPTDL_REPLICA_RANK",
            str(rank),
            f"a rank below {source}={replicas}",
        )
    return rank


def num_nodes() -> int:
    """Number of distinct nodes the job runs on (``ADAPTDL_NUM_NODES``).

    Defaults to :func:`num_replicas`, i.e. one replica per node.
    """
    replicas = num_replicas()
    nodes = get_int("ADAPTDL_NUM_NODES", replicas, minimum=1)
    if nodes > replicas:
        # Every node hosts at least one replica; a larger count would poison
        # the throughput profile (and the checkpoint that carries it).
        raise EnvironmentVariableError(
            "ADAPTDL_NUM_NODES",
            os.environ["ADAPTDL_NUM_NODES"],
            f"at most ADAPTDL_NUM_REPLICAS={replicas}",
        )
    return nodes


def num_restarts() -> int:
    """How many times the job has been restarted (``ADAPTDL_NUM_RESTARTS``, default 0)."""
    return get_int("ADAPTDL_NUM_RESTARTS", 0, minimum=0)


def adaptdl_sched_version() -> str | None:
    """Version of the scheduler that started this job (``ADAPTDL_SCHED_VERSION``)."""
    return get_str("ADAPTDL_SCHED_VERSION")


def supervisor_url() -> str | None:
    """URL of the supervisor service (``ADAPTDL_SUPERVISOR_URL``), if any.

    Trailing slashes are dropped, since callers append ``/discover/...`` or
    ``/hints/...``.

    Raises:
        EnvironmentVariableError: the value is not an ``http://`` or
            ``https://`` URL with a host (``supervisor:8080`` would otherwise
            fail later, inside urllib, with a message that names no variable).
    """
    url = get_str("ADAPTDL_SUPERVISOR_URL")
    if not url:
        return None
    try:
        parsed = urllib.parse.urlsplit(url)
        valid = parsed.scheme in ("http", "https") and bool(parsed.hostname)
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:  # e.g. "http://[::1" (an unclosed IPv6 bracket)
        valid = False
    if not valid:
        raise EnvironmentVariableError(
            "ADAPTDL_SUPERVISOR_URL", url, "an http:// or https:// URL with a host"
        )
    return url.rstrip("/")


def job_token() -> str | None:
    """Secret shared by the replicas of one job (``ADAPTDL_JOB_TOKEN``).

    The collective server rejects peers without it and the supervisor requires
    it for discovery and hints, so a stray process cannot join or steer a job.
    """
    return get_str("ADAPTDL_JOB_TOKEN")


def tensorboard_logdir() -> str | None:
    """TensorBoard log directory chosen by the launcher (``ADAPTDL_TENSORBOARD_LOGDIR``)."""
    return get_str("ADAPTDL_TENSORBOARD_LOGDIR")


def from_ray() -> bool:
    """True inside a Ray Tune trial started by the AdaptDL trial scheduler."""
    if os.environ.get("ADAPTDL_TUNE_TRIAL_SCHED") != "True":
        return False
    # A trial process has Ray imported already; never import it from here.
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def fit_interval() -> float:
    """Seconds between refits of the performance model (``ADAPTDL_FIT_INTERVAL``).

    Rank 0 refits its throughput model and posts scheduling hints at most this
    often (default 30 s, as in the original library). Tests and short demos
    lower it so that adaptive batch sizes kick in within seconds.
    """
    return get_float("ADAPTDL_FIT_INTERVAL", 30.0, minimum=0.0)


def decide_interval() -> float:
    """Seconds between batch-size decisions inside a pass (``ADAPTDL_DECIDE_INTERVAL``).

    Besides the decision at every pass boundary, the training loader re-decides
    its batch size at most this often (default 30 s) in the middle of a pass,
    so long epochs still benefit from a refitted model.
    """
    return get_float("ADAPTDL_DECIDE_INTERVAL", 30.0, minimum=0.0)


def connect_timeout() -> float:
    """Seconds a replica waits for rank 0's reducer and all peers (``ADAPTDL_CONNECT_TIMEOUT``).

    Defaults to 120 s: replicas of one job may start minutes apart on a busy
    cluster, and a bounded wait turns a wrong master address into an error
    that names it instead of a hang.
    """
    value = get_float("ADAPTDL_CONNECT_TIMEOUT", 120.0)
    if not 0 < value <= MAX_CONNECT_TIMEOUT:
        raise EnvironmentVariableError(
            "ADAPTDL_CONNECT_TIMEOUT",
            os.environ["ADAPTDL_CONNECT_TIMEOUT"],
            f"a number > 0 and <= {MAX_CONNECT_TIMEOUT:g} (seconds)",
        )
    return value


def sim_traces() -> str | None:
    """Trace folder of the simulator (``ADAPTDL_SIM_TRACES``), if set.

    ``adaptdl simulate`` and :mod:`adaptdl.sim` read one sub-folder of
    measurements per model from it when no ``--traces`` option is given.
    """
    return get_str("ADAPTDL_SIM_TRACES")


def home() -> str:
    """Home directory of the local cluster (``ADAPTDL_HOME``, default ``~/.adaptdl``).

    The daemon keeps its SQLite state, job logs, checkpoints and its address
    file there; the CLI finds the running daemon through it.
    """
    return os.path.expanduser(get_str("ADAPTDL_HOME") or "~/.adaptdl")
