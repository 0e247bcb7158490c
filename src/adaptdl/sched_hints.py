"""Scheduling hints: what a training job tells the scheduler about itself.

The scheduler decides how many replicas a job gets from a model of its
goodput, which only the job can measure: the step-time parameters fitted from
its profile, the gradient statistics behind its statistical efficiency, and the
batch-size limits it accepts. Rank 0 periodically sends these hints to the
supervisor with :func:`post_sched_hints`; the supervisor validates uploads with
:meth:`SchedHints.from_json` before the policy ever sees them.

On the wire the hints are a JSON object with camelCase names (the template is
:data:`SCHED_HINTS`, the performance parameters :data:`PERF_PARAMS`). In Python
they are a frozen, validated :class:`SchedHints`. Unlike the original, which
only asserted that the keys were known, every value is checked: numbers must
be finite and non-negative, bounds ordered, and ``gamma`` within the range the
goodput model is fitted in.

Posting is best effort: a training loop must never die because the supervisor
is restarting, so network failures and error responses are logged and
:func:`post_sched_hints` returns False. Invalid hints, on the other hand, are a
bug in the caller and raise :class:`ValueError` before anything is sent.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.client import HTTPException
from types import MappingProxyType
from typing import Any

from adaptdl import env
from adaptdl._goodput import MAX_BATCH_SIZE
from adaptdl._hints import check_bool, check_int, check_keys, check_number, label
from adaptdl.goodput import GradParams, PerfParams

__all__ = [
    "GAMMA_RANGE",
    "PERF_PARAMS",
    "SCHED_HINTS",
    "POST_TIMEOUT",
    "GradParams",
    "PerfParams",
    "SchedHints",
    "post_sched_hints",
]

logger = logging.getLogger(__name__)

PERF_PARAMS: Mapping[str, None] = MappingProxyType(dict.fromkeys(PerfParams._fields))
"""Read-only template of the ``perfParams`` hint: the seven step-time parameters."""

SCHED_HINTS: Mapping[str, Any] = MappingProxyType(
    {
        "initBatchSize": 0,
        "localBszBounds": None,
        "globalBatchSize": None,
        "maxBatchSize": 0,
        "maxProfiledReplicas": 0,
        "gradientAccumulation": False,
        "gradParams": None,
        "perfParams": None,
        "remainingIterations": None,
    }
)
"""Read-only template of the hints object: every wire name with its default."""

GAMMA_RANGE = (1.0, 10.0)
"""Allowed ``gamma`` (compute/communication overlap exponent), as in the fit."""

POST_TIMEOUT = 5.0
"""Seconds :func:`post_sched_hints` waits for the supervisor before giving up."""

# Python field name -> wire name, in template order.
_WIRE_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "init_batch_size": "initBatchSize",
        "local_bsz_bounds": "localBszBounds",
        "global_batch_size": "globalBatchSize",
        "max_batch_size": "maxBatchSize",
        "max_profiled_replicas": "maxProfiledReplicas",
        "gradient_accumulation": "gradientAccumulation",
        "grad_params": "gradParams",
        "perf_params": "perfParams",
        "remaining_iterations": "remainingIterations",
    }
)
_GRAD_WIRE = ("norm", "var")


def _field(name: str) -> str:
    return label(name, _WIRE_NAMES[name])


@dataclass(frozen=True)
class SchedHints:
    """Validated scheduling hints of one job.

    Zero means "not known yet" for the integer fields, as in the wire
    template, so a job that has not profiled anything can still send hints.

    Attributes:
        init_batch_size: the global batch size the job was written for
            (``B0`` of the efficiency model); 0 if unknown.
        local_bsz_bounds: optional ``(lo, hi)`` per-replica batch-size limits;
            either end may be None (unbounded).
        global_batch_size: the global batch size currently in use, if known.
        max_batch_size: the largest global batch size the job accepts; 0 if
            unknown (then ``init_batch_size`` is not checked against it).
        max_profiled_replicas: the most replicas the job has been profiled
            with; the scheduler limits exploration relative to it.
        gradient_accumulation: whether the job may accumulate gradients over
            several micro-batches per step.
        grad_params: gradient statistics (``sqr`` is sent as ``norm``).
        perf_params: fitted step-time parameters.
        remaining_iterations: optimizer steps at ``init_batch_size`` the job
            still needs to finish (its remaining statistical work), or None if
            it does not know its end. Together with the step time from
            ``perf_params`` it tells the scheduler which jobs are short, so
            that the ``adaptdl`` policy can let them finish first.

    Raises:
        ValueError: a value is of the wrong type, not finite, negative, or
            inconsistent with another; the message names the field and value.
    """

    init_batch_size: int = 0
    local_bsz_bounds: tuple[int | None, int | None] | None = None
    global_batch_size: int | None = None
    max_batch_size: int = 0
    max_profiled_replicas: int = 0
    gradient_accumulation: bool = False
    grad_params: GradParams | None = None
    perf_params: PerfParams | None = None
    remaining_iterations: float | None = None

    def __post_init__(self) -> None:
        # Normalise in place (frozen, hence object.__setattr__) so that equal
        # hints compare equal whatever numeric types they were built from.
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        for size in ("init_batch_size", "max_batch_size"):
            put(size, check_int(getattr(self, size), _field(size), maximum=MAX_BATCH_SIZE))
        put(
            "max_profiled_replicas",
            check_int(self.max_profiled_replicas, _field("max_profiled_replicas")),
        )
        if self.global_batch_size is not None:
            put(
                "global_batch_size",
                check_int(
                    self.global_batch_size, _field("global_batch_size"), maximum=MAX_BATCH_SIZE
                ),
            )
        put(
            "gradient_accumulation",
            check_bool(self.gradient_accumulation, _field("gradient_accumulation")),
        )
        put("local_bsz_bounds", _check_bounds(self.local_bsz_bounds))
        put("grad_params", _check_grad_params(self.grad_params))
        put("perf_params", _check_perf_params(self.perf_params))
        if self.remaining_iterations is not None:
            put(
                "remaining_iterations",
                check_number(self.remaining_iterations, _field("remaining_iterations")),
            )
        if self.max_batch_size > 0 and self.init_batch_size > self.max_batch_size:
            raise ValueError(
                f"{_field('init_batch_size')} must be <= {_field('max_batch_size')}, "
                f"got {self.init_batch_size} > {self.max_batch_size}"
            )

    def to_json(self) -> dict[str, Any]:
        """The hints as a JSON-ready object with the camelCase wire names.

        Every key of :data:`SCHED_HINTS` is present; unknown values are None.
        """
        bounds = self.local_bsz_bounds
        grad = self.grad_params
        perf = self.perf_params
        return {
            "initBatchSize": self.init_batch_size,
            "localBszBounds": None if bounds is None else list(bounds),
            "globalBatchSize": self.global_batch_size,
            "maxBatchSize": self.max_batch_size,
            "maxProfiledReplicas": self.max_profiled_replicas,
            "gradientAccumulation": self.gradient_accumulation,
            "gradParams": None if grad is None else {"norm": grad.sqr, "var": grad.var},
            "perfParams": None if perf is None else dict(perf._asdict()),
            "remainingIterations": self.remaining_iterations,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | bytes) -> SchedHints:
        """Parse and validate hints in wire form.

        Args:
            data: a JSON object (already decoded) or its text. Missing keys,
                and keys whose value is null ("unknown"), take their
                :data:`SCHED_HINTS` defaults.

        Raises:
            ValueError: the text is not JSON, a key is unknown (the message
                lists the valid ones), or a value is invalid.
        """
        if isinstance(data, str | bytes | bytearray):
            try:
                data = json.loads(data)
            except ValueError as error:
                raise ValueError(f"hints are not valid JSON: {error}") from None
        obj = check_keys(data, tuple(SCHED_HINTS), "hints")
        kwargs: dict[str, Any] = {}
        for name, wire in _WIRE_NAMES.items():
            if wire not in obj:
                continue
            value = obj[wire]
            if value is None:
                continue  # null means unknown: keep the template default
            if wire == "gradParams":
                grad = check_keys(value, _GRAD_WIRE, _field(name))
                missing = [key for key in _GRAD_WIRE if key not in grad]
                if missing:
                    raise ValueError(f"{_field(name)} is missing keys {missing}")
                value = GradParams(grad["norm"], grad["var"])
            elif wire == "perfParams":
                perf = check_keys(value, PerfParams._fields, _field(name))
                missing = [key for key in PerfParams._fields if key not in perf]
                if missing:
                    raise ValueError(f"{_field(name)} is missing keys {missing}")
                value = PerfParams(**{key: perf[key] for key in PerfParams._fields})
            kwargs[name] = value
        return cls(**kwargs)


def _check_bounds(bounds: object) -> tuple[int | None, int | None] | None:
    name = _field("local_bsz_bounds")
    if bounds is None:
        return None
    if not isinstance(bounds, Sequence) or isinstance(bounds, str | bytes) or len(bounds) != 2:
        raise ValueError(f"{name} must be a pair (lo, hi), got {bounds!r}")
    lo, hi = (
        None if item is None else check_int(item, f"{name}[{i}]", minimum=1, maximum=MAX_BATCH_SIZE)
        for i, item in enumerate(bounds)
    )
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"{name} must have lo <= hi, got {bounds!r}")
    return (lo, hi)


def _check_grad_params(grad: object) -> GradParams | None:
    name = _field("grad_params")
    if grad is None:
        return None
    if not isinstance(grad, Sequence) or isinstance(grad, str | bytes) or len(grad) != 2:
        raise ValueError(f"{name} must be a GradParams(sqr, var), got {grad!r}")
    return GradParams(
        check_number(grad[0], f"{name}.sqr (norm)"),
        check_number(grad[1], f"{name}.var"),
    )


def _check_perf_params(perf: object) -> PerfParams | None:
    name = _field("perf_params")
    if perf is None:
        return None
    fields = PerfParams._fields
    if not isinstance(perf, Sequence) or isinstance(perf, str | bytes) or len(perf) != len(fields):
        raise ValueError(f"{name} must be a PerfParams with fields {list(fields)}, got {perf!r}")
    values = {}
    for key, value in zip(fields, perf):
        if key == "gamma":
            lo, hi = GAMMA_RANGE
            values[key] = check_number(value, f"{name}.gamma", minimum=lo, maximum=hi)
        else:
            values[key] = check_number(value, f"{name}.{key}")
    if values["alpha_c"] + values["beta_c"] <= 0:
        # The goodput model needs a compute time: a step cannot take no time.
        raise ValueError(
            f"{name}.alpha_c={values['alpha_c']!r} and {name}.beta_c={values['beta_c']!r}: "
            "at least one must be > 0"
        )
    return PerfParams(**values)


def _coerce(hints: object) -> SchedHints:
    if isinstance(hints, SchedHints):
        return hints
    if isinstance(hints, Mapping):
        return SchedHints.from_json(hints)
    raise TypeError(
        f"hints must be a SchedHints or a mapping of wire names, got {type(hints).__name__}"
    )


def post_sched_hints(sched_hints: SchedHints | Mapping[str, Any], job_key: str) -> bool:
    """Send ``sched_hints`` for job ``job_key`` to the supervisor (best effort).

    Sends ``PUT {ADAPTDL_SUPERVISOR_URL}/hints/{job_key}`` with the hints as
    JSON and, when ``ADAPTDL_JOB_TOKEN`` is set, ``Authorization: Bearer
    <token>`` so the supervisor can tell the job's own replicas from anyone
    else on the network. The request goes directly to the supervisor, never
    through an HTTP proxy from the environment, because it carries that
    token and the supervisor is a cluster-internal service.

    Args:
        sched_hints: validated hints, or a mapping in wire form (validated
            here); the keyword name is the original library's.
        job_key: the job's identifier, normally :func:`adaptdl.env.job_id`
            (``namespace/name``; the slash stays a path separator).

    Returns:
        True if the supervisor accepted the hints; False if there is no
        supervisor or the request failed (the failure is logged).

    Raises:
        ValueError: the hints are invalid or ``job_key`` is empty.
        TypeError: ``sched_hints`` or ``job_key`` has the wrong type.
    """
    checked = _coerce(sched_hints)
    if not isinstance(job_key, str):
        raise TypeError(f"job_key must be a str, got {type(job_key).__name__}: {job_key!r}")
    if not job_key.strip("/"):
        raise ValueError(f"job_key must be a non-empty job identifier, got {job_key!r}")
    try:
        base = env.supervisor_url()
    except env.EnvironmentVariableError as error:
        logger.warning("could not post scheduling hints for %s: %s", job_key, error)
        return False
    if base is None:
        logger.debug("no supervisor URL; not posting scheduling hints for %s", job_key)
        return False
    url = f"{base}/hints/{urllib.parse.quote(job_key.strip('/'), safe='/')}"
    body = json.dumps(checked.to_json(), allow_nan=False).encode()
    headers = {"Content-Type": "application/json"}
    token = env.job_token()
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        request = urllib.request.Request(url, data=body, headers=headers, method="PUT")
        with opener.open(request, timeout=POST_TIMEOUT) as response:
            status = int(response.status)
    except urllib.error.HTTPError as error:
        error.close()
        logger.warning(
            "supervisor rejected scheduling hints for %s: HTTP %d %s",
            job_key,
            error.code,
            error.reason,
        )
        return False
    except (OSError, HTTPException, ValueError) as error:
        # OSError covers URLError, refused connections and timeouts;
        # ValueError a URL urllib still cannot use (e.g. a bad port).
        logger.warning("could not post scheduling hints for %s to %s: %s", job_key, url, error)
        return False
    if not 200 <= status < 300:
        logger.warning("supervisor answered HTTP %d to scheduling hints for %s", status, job_key)
        return False
    logger.debug("posted scheduling hints for %s", job_key)
    return True
