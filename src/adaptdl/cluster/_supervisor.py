"""The supervisor: the daemon's HTTP service for replicas and for the CLI.

Replicas use two endpoints, both guarded by the job's token (``Authorization:
Bearer <ADAPTDL_JOB_TOKEN>``; 401 without it or for a job that does not
exist, never 404, and 403 with a wrong one), so a stray process can neither
join a job nor steer its scheduling, nor probe which jobs exist without a
token:

* ``GET /discover/{job_id}/{group}?timeout=S``: long poll for the addresses of
  every replica of a restart group (JSON list, index = rank); 408 when the
  group is not complete within the timeout, so the client retries.
* ``PUT /hints/{job_id}``: scheduling hints (validated; 400 names the bad key).

``GET /healthz`` answers 200. The CLI's endpoints live under ``/api/`` and
need the admin token from ``<home>/daemon.json`` (readable only by the owner):
``GET /api/cluster``, ``GET|POST /api/jobs``, ``GET|DELETE /api/jobs/{name}``
and ``POST /api/shutdown``. Job ids may contain ``/``; the group is the last
path segment of a discovery request.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from adaptdl.cluster._backend import (
    Backend,
    BackendError,
    JobExistsError,
    JobNotFoundError,
    UnauthorizedError,
)
from adaptdl.cluster._controller import check_model, waiting_reason
from adaptdl.cluster._spec import JobSpec, JobSpecError

__all__ = ["Supervisor"]

_LOG = logging.getLogger(__name__)

#: Longest discovery long-poll a client may ask for (seconds).
_MAX_DISCOVER_TIMEOUT = 120.0
#: Largest request body accepted (hints and job specs are small).
_MAX_BODY = 1 << 20
#: Seconds an idle or half-sent connection is kept open.
_IDLE_TIMEOUT = 60.0
#: Connections served at once unless the daemon asks for more; each holds a
#: thread and a file descriptor, and idle ones beyond this would starve the
#: daemon (and its launches) of descriptors. The daemon adds two per slot,
#: for replicas waiting in discovery (a long poll each).
DEFAULT_MAX_CONNECTIONS = 256


class _HTTPError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def validate_hints(body: Any) -> dict[str, Any]:
    """Validate uploaded hints with :class:`adaptdl.sched_hints.SchedHints`.

    Returns the hints in their wire form (camelCase keys).

    Raises:
        ValueError: a key is unknown or a value is out of range.
    """
    from adaptdl.sched_hints import SchedHints

    if not isinstance(body, dict):
        raise ValueError(f"hints must be a JSON object, got {type(body).__name__}")
    hints = SchedHints.from_json(body)
    to_json = getattr(hints, "to_json", None)
    wire = to_json() if callable(to_json) else body
    valid = {key: value for key, value in dict(wire).items() if value is not None}
    # Values valid one by one can still make a model with no goodput at one
    # replica (step times that overflow, a micro-batch cap below the initial
    # batch without accumulation); refused here, where the job hears of it,
    # instead of failing in every scheduling round.
    check_model(valid)
    return valid


class Supervisor:
    """Serve discovery, hints and the CLI API for one backend.

    Args:
        backend: The backend whose jobs are served.
        admin_token: Secret the CLI must present for ``/api/`` requests.
        host: Interface to bind (127.0.0.1 unless configured otherwise).
        port: TCP port; 0 picks a free one.
        on_change: Called after a submit, delete or hints upload, so the
            controller reacts at once instead of at its next tick.
        on_shutdown: Called (from a request thread) on ``POST /api/shutdown``
            with the requested ``stopJobs``; returns whether jobs will be
            stopped (an earlier request may have decided it), or None to
            take the request's value.
        info: Extra fields for ``GET /api/cluster`` (policy, interval, ...).
        max_connections: Connections served at once; more get a 503 with
            ``Retry-After`` (replicas in discovery retry it).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        admin_token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        on_change: Callable[[], None] | None = None,
        on_shutdown: Callable[[bool], bool | None] | None = None,
        info: Callable[[], Mapping[str, Any]] | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.backend = backend
        self.admin_token = admin_token
        self._on_change = on_change or (lambda: None)
        self._on_shutdown: Callable[[bool], bool | None] = on_shutdown or (lambda stop_jobs: None)
        self._info = info or dict
        handler = type("_BoundHandler", (_Handler,), {"supervisor": self})
        self.server = _Server((host, port), handler, max_connections=max_connections)
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        # Set once a shutdown is under way (jobs draining): new jobs are
        # refused, since this daemon would exit without ever starting them.
        self._draining = threading.Event()
        self._busy = threading.Condition()
        self._in_flight = 0

    @property
    def url(self) -> str:
        """Base URL of the service."""
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="adaptdl-supervisor", daemon=True
        )
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Refuse new jobs from now on; everything else is served until :meth:`close`."""
        self._draining.set()

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving, let in-flight requests finish, and release the port.

        Discovery long-polls end at once (503), so that the backend (and its
        database) can be closed after this returns without a request thread
        still using it; requests still running after ``timeout`` seconds are
        abandoned.
        """
        self._closing.set()
        if self._thread is not None:
            self.server.shutdown()
        deadline = time.monotonic() + timeout
        with self._busy:
            while self._in_flight and time.monotonic() < deadline:
                self._busy.wait(max(deadline - time.monotonic(), 0.0))
        self.server.server_close()

    def _enter(self) -> bool:
        """Count a request in; False once closing (it is refused)."""
        with self._busy:
            if self._closing.is_set():
                return False
            self._in_flight += 1
            return True

    def _leave(self) -> None:
        with self._busy:
            self._in_flight -= 1
            self._busy.notify_all()

    # ------------------------------------------------------------------ routes

    def handle(
        self, method: str, path: str, query: Mapping[str, list[str]], headers: Any, body: Any
    ) -> tuple[HTTPStatus, Any]:
        """Route one request; returns the status and a JSON-serialisable body."""
        parts = [unquote(part) for part in path.strip("/").split("/")] if path.strip("/") else []
        if method == "GET" and parts == ["healthz"]:
            # The pid lets a client tell this daemon from one that took over
            # the port of a dead daemon it has a stale record of.
            return HTTPStatus.OK, {"status": "ok", "pid": os.getpid()}
        if parts and parts[0] == "discover" and method == "GET":
            return self._discover(parts[1:], query, headers)
        if parts and parts[0] == "hints" and method == "PUT":
            return self._hints(parts[1:], headers, body)
        if parts and parts[0] == "api":
            self._check_admin(headers)
            return self._api(method, parts[1:], body)
        raise _HTTPError(HTTPStatus.NOT_FOUND, f"no route for {method} {path}")

    def _token(self, headers: Any) -> str | None:
        value = headers.get("Authorization") or ""
        if value.startswith("Bearer "):
            return value[len("Bearer ") :].strip() or None
        return None

    def _check_admin(self, headers: Any) -> None:
        token = self._token(headers)
        if token is None:
            raise _HTTPError(HTTPStatus.UNAUTHORIZED, "missing admin token")
        if not hmac.compare_digest(token.encode(), self.admin_token.encode()):
            raise _HTTPError(HTTPStatus.FORBIDDEN, "wrong admin token")

    def _authorize(self, job_id: str, headers: Any) -> str:
        """The job's name, once the request's token is the job's.

        Whether a job exists is revealed only to a caller holding its token:
        a request without a token gets 401 before the job is looked up, and
        one for an unknown job gets 401 too, never 404.
        """
        token = self._token(headers)
        if token is None:
            raise _HTTPError(
                HTTPStatus.UNAUTHORIZED,
                f"job {job_id!r}: missing job token (Authorization: Bearer)",
            )
        try:
            return self.backend.authorize(job_id, token)
        except JobNotFoundError:
            raise _HTTPError(
                HTTPStatus.UNAUTHORIZED, f"job {job_id!r}: no job accepts this token"
            ) from None
        except UnauthorizedError as exc:
            status = HTTPStatus.UNAUTHORIZED if exc.missing else HTTPStatus.FORBIDDEN
            raise _HTTPError(status, str(exc)) from None

    def _discover(
        self, parts: list[str], query: Mapping[str, list[str]], headers: Any
    ) -> tuple[HTTPStatus, Any]:
        if len(parts) < 2:
            raise _HTTPError(HTTPStatus.NOT_FOUND, "expected /discover/{job_id}/{group}")
        job_id, raw_group = "/".join(parts[:-1]), parts[-1]
        try:
            group = int(raw_group)
            timeout = float(query.get("timeout", ["30"])[0])
            if math.isnan(timeout):  # inf is capped below; NaN would never expire
                raise ValueError(timeout)
        except ValueError:
            raise _HTTPError(
                HTTPStatus.BAD_REQUEST, f"group={raw_group!r} and timeout must be numbers"
            ) from None
        name = self._authorize(job_id, headers)
        deadline = time.monotonic() + min(max(timeout, 0.0), _MAX_DISCOVER_TIMEOUT)
        while True:
            addresses = self.backend.discover(name, group)
            if addresses is not None:
                return HTTPStatus.OK, addresses
            if self._closing.is_set():
                raise _HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, "the supervisor is shutting down")
            if time.monotonic() >= deadline:
                raise _HTTPError(
                    HTTPStatus.REQUEST_TIMEOUT,
                    f"restart group {group} of job {job_id!r} is not complete yet",
                )
            time.sleep(0.05)

    def _hints(self, parts: list[str], headers: Any, body: Any) -> tuple[HTTPStatus, Any]:
        job_id = "/".join(parts)
        if not job_id:
            raise _HTTPError(HTTPStatus.NOT_FOUND, "expected /hints/{job_id}")
        name = self._authorize(job_id, headers)
        try:
            hints = validate_hints(body)
        except (ValueError, TypeError) as exc:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, f"invalid hints: {exc}") from None
        self.backend.set_hints(name, hints)
        self._on_change()
        return HTTPStatus.OK, {"job": name, "hints": hints}

    def _api(self, method: str, parts: list[str], body: Any) -> tuple[HTTPStatus, Any]:
        if parts == ["cluster"] and method == "GET":
            nodes = self.backend.nodes()
            resource = self.backend.slot_resource()
            jobs = self.backend.jobs()
            return HTTPStatus.OK, {
                **dict(self._info()),
                "backend": self.backend.name,
                "slotResource": resource,
                "slots": sum(node.resources.get(resource, 0) for node in nodes.values()),
                "usedSlots": sum(job.replicas for job in jobs.values()),
                "jobs": len(jobs),
                "draining": self._draining.is_set(),
            }
        if parts == ["jobs"] and method == "GET":
            return HTTPStatus.OK, [job.to_json() for job in self.backend.jobs().values()]
        if parts == ["jobs"] and method == "POST":
            if self._draining.is_set():
                raise _HTTPError(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    "the cluster daemon is shutting down and would not start the job; "
                    "submit it again once the daemon has stopped (a new one then starts)",
                )
            working_dir = body.get("workingDir") if isinstance(body, dict) else None
            if isinstance(body, dict) and (
                working_dir is None
                or (isinstance(working_dir, str) and not os.path.isabs(working_dir))
            ):
                # JobSpec would resolve it against the daemon's own directory.
                raise _HTTPError(
                    HTTPStatus.BAD_REQUEST,
                    f"workingDir={working_dir!r}: expected an absolute path (the daemon "
                    "cannot know the submitter's current directory)",
                )
            try:
                spec = JobSpec.from_json(body)
                status = self.backend.submit(spec)
            except JobExistsError as exc:
                raise _HTTPError(HTTPStatus.CONFLICT, str(exc)) from None
            except (JobSpecError, BackendError) as exc:
                raise _HTTPError(HTTPStatus.BAD_REQUEST, str(exc)) from None
            self._on_change()
            return HTTPStatus.CREATED, status.to_json()
        if len(parts) == 2 and parts[0] == "jobs":
            name = parts[1]
            if method == "GET":
                return HTTPStatus.OK, self._describe(name)
            if method == "DELETE":
                self.backend.delete(name)
                self._on_change()
                return HTTPStatus.OK, {"deleted": name}
        if parts == ["shutdown"] and method == "POST":
            if body is not None and not isinstance(body, dict):
                raise _HTTPError(
                    HTTPStatus.BAD_REQUEST,
                    f'shutdown body must be a JSON object like {{"stopJobs": true}}, '
                    f"got {type(body).__name__}",
                )
            unknown = sorted(set(body or {}) - {"stopJobs"})
            if unknown:
                raise _HTTPError(
                    HTTPStatus.BAD_REQUEST,
                    f"shutdown: unknown field(s) {', '.join(map(str, unknown))}; valid: stopJobs",
                )
            stop_jobs = (body or {}).get("stopJobs", True)
            if not isinstance(stop_jobs, bool):
                # bool("false") is True: the jobs were stopped.
                raise _HTTPError(
                    HTTPStatus.BAD_REQUEST,
                    f"shutdown: stopJobs={stop_jobs!r}: expected true or false",
                )
            self.begin_shutdown()
            effective = self._on_shutdown(stop_jobs)
            if effective is not None:
                stop_jobs = effective
            return HTTPStatus.ACCEPTED, {"shuttingDown": True, "stopJobs": stop_jobs}
        raise _HTTPError(HTTPStatus.NOT_FOUND, f"no API route {method} /api/{'/'.join(parts)}")

    def _describe(self, name: str) -> dict[str, Any]:
        jobs = self.backend.jobs()
        if name not in jobs:
            raise JobNotFoundError(name)
        status = jobs[name]
        nodes = self.backend.nodes()
        resource = self.backend.slot_resource()
        slots = sum(node.resources.get(resource, 0) for node in nodes.values())
        out = status.to_json()
        out["waiting"] = waiting_reason(status, jobs, slots)
        out["events"] = [
            {"time": event.time, "kind": event.kind, "message": event.message}
            for event in self.backend.events(name)
        ]
        return out


_BUSY_BODY = json.dumps({"error": "too many open connections to the supervisor"}).encode()
_BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class _Server(ThreadingHTTPServer):
    """The HTTP server, quiet about clients that hang up or time out.

    Connections beyond ``max_connections`` get a 503 at once and are
    closed, and the listen backlog is large enough that a burst of replicas
    calling at once is not held back by SYN retries.
    """

    request_queue_size = 128

    def __init__(self, *args: Any, max_connections: int, **kwargs: Any) -> None:
        self._max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _LOG.warning(
                "supervisor: %d connections open; refusing %s",
                self._max_connections,
                client_address,
            )
            try:
                request.sendall(_BUSY_ANSWER)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: give its slot back
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            _LOG.debug("client %s: %s", client_address, error)
            return
        _LOG.exception("supervisor: error serving %s", client_address)


class _Handler(BaseHTTPRequestHandler):
    supervisor: Supervisor
    protocol_version = "HTTP/1.1"
    server_version = "adaptdl-supervisor"
    #: Seconds a connection may sit idle (or half-sent): each holds a thread
    #: and a file descriptor of the daemon.
    timeout = _IDLE_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        _LOG.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        try:
            body: Any = None
            declared = self.headers.get("Content-Length") or "0"
            try:
                length = int(declared)
            except ValueError:
                length = -1
            if length < 0:
                # A negative length read the socket to its end, unbounded.
                self.close_connection = True
                raise _HTTPError(
                    HTTPStatus.BAD_REQUEST, f"Content-Length {declared!r}: expected bytes >= 0"
                )
            if self.headers.get("Transfer-Encoding"):
                # Not decoded here: the chunks would be read as the next request.
                self.close_connection = True
                raise _HTTPError(
                    HTTPStatus.NOT_IMPLEMENTED,
                    f"Transfer-Encoding {self.headers['Transfer-Encoding']!r} is not supported; "
                    "send the body with a Content-Length",
                )
            if length > _MAX_BODY:
                # Unread, the body would be parsed as the next request.
                self.close_connection = True
                raise _HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request body too large")
            if length:
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except (ValueError, RecursionError):  # nested past the parser's depth
                    raise _HTTPError(
                        HTTPStatus.BAD_REQUEST, "request body is not valid JSON"
                    ) from None
            if not self.supervisor._enter():
                raise _HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, "the supervisor is shutting down")
            try:
                status, payload = self.supervisor.handle(
                    method, split.path, parse_qs(split.query), self.headers, body
                )
            finally:
                self.supervisor._leave()
        except _HTTPError as exc:
            status, payload = exc.status, {"error": str(exc)}
        except JobNotFoundError as exc:
            status, payload = HTTPStatus.NOT_FOUND, {"error": str(exc)}
        except BackendError as exc:
            status, payload = HTTPStatus.CONFLICT, {"error": str(exc)}
        except sqlite3.Error as exc:
            # A full disk or a read-only home: say what failed and what to do,
            # not just sqlite's words. sqlite rolled the transaction back.
            _LOG.exception("request %s %s failed in the state database", method, self.path)
            full = isinstance(exc, sqlite3.OperationalError) and "full" in str(exc)
            where = getattr(self.supervisor.backend, "home", None)
            place = f" in {where}" if where is not None else ""
            status = HTTPStatus.INSUFFICIENT_STORAGE if full else HTTPStatus.INTERNAL_SERVER_ERROR
            payload = {
                "error": f"the cluster could not update its state database{place}: {exc}; "
                + (
                    "free some disk space there and try again"
                    if full
                    else "check that the directory is writable and see the daemon log"
                )
            }
        except Exception as exc:
            _LOG.exception("request %s %s failed", method, self.path)
            status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": repr(exc)}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:  # say so: a keep-alive client would reuse the socket
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - stdlib hook name
        self._dispatch("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802 - a JSON 404, not the standard library's HTML 501
        self._dispatch("PATCH")

    def do_OPTIONS(self) -> None:  # noqa: N802
        self._dispatch("OPTIONS")
