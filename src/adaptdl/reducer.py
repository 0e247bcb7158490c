"""A small TCP reducer: allreduce and broadcast of arbitrary Python objects.

AdaptDL needs collectives for bookkeeping (checkpoint sync, metrics, batch-size
decisions), not for gradients, so values are pickled Python objects and the
topology is a star: rank 0 runs a server thread and every rank, rank 0
included, is a client of it. Operations carry implicit sequence numbers, so all
ranks must issue the same collectives in the same order; the server checks
that they do.

Compared with the original reducer this one connects with exponential backoff
(no fixed 5 s sleep), bounds connection time (the error names the address),
admits only peers that present the job token, checks ranks, is thread-safe,
and turns every server-side failure (a raising reduce function, a peer that
disconnects mid-operation) into a :class:`ReducerError` on every rank instead
of a hang.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import threading
import time
from typing import Any, TypeVar

from adaptdl._reducer import (
    MAX_CONNECT_TIMEOUT,
    MAX_HANDSHAKE_BYTES,
    PROTOCOL_VERSION,
    ReduceFn,
    ReducerConnectError,
    ReducerError,
    Server,
    decode,
    encode_json,
    encode_pickle,
    recv_frame,
    send_frame,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "Future",
    "Reducer",
    "ReducerConnectError",
    "ReducerError",
    "default_reduce_fn",
]

logger = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT = 120.0
"""Seconds a rank waits for the server and for all its peers to join.

Generous because replicas of a real job can start minutes apart (image pulls,
slow nodes); the original retried for about 125 s.
"""

# Connection retries start after a few milliseconds, so a local job whose ranks
# race the server's bind connects almost at once, and back off to this cap.
_BACKOFF_START = 0.002
_BACKOFF_MAX = 0.25
_WARN_EVERY = 10.0

#: When this process last closed a reducer, by server address: a server seen
#: closing during a handshake soon after is most likely that one, about to be
#: replaced (teardown() then initialize()), not a wrong address.
_CLOSED_AT: dict[tuple[str, int], float] = {}
_RECENT = 60.0

T = TypeVar("T")


def default_reduce_fn(a: T, b: T) -> T:
    """Fold ``b`` into ``a`` with ``+=`` and return ``a`` (numbers, lists, arrays, Counters)."""
    a += b  # type: ignore[operator]
    return a


class Future:
    """The result of :meth:`Reducer.allreduce_async`.

    Futures may be resolved in any order and from any thread; the first
    :meth:`result` call takes the value from the reducer and caches it.
    """

    def __init__(self, reducer: Reducer, key: int) -> None:
        self._reducer = reducer
        self._key = key
        self._done = False
        self._value: Any = None

    @property
    def key(self) -> int:
        """The sequence number of the operation."""
        return self._key

    def done(self) -> bool:
        """True once the result has arrived (or the reducer has failed)."""
        with self._reducer._cond:
            return (
                self._done
                or self._key in self._reducer._results
                or self._reducer._error is not None
            )

    def result(self, timeout: float | None = None) -> Any:
        """Block until the reduced value is available and return it.

        Args:
            timeout: seconds to wait; None waits for as long as it takes
                (training steps between collectives can be long).

        Raises:
            ReducerError: the operation failed on the server or the connection
                was lost; every rank sees the same error.
            TimeoutError: ``timeout`` expired (the future stays usable).
        """
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
        reducer = self._reducer
        with reducer._cond:
            if self._done:
                return self._value
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._key not in reducer._results:
                if self._done:  # another thread took the value while we waited
                    return self._value
                if reducer._error is not None:
                    raise ReducerError(reducer._error)
                if deadline is None:
                    reducer._cond.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"collective operation {self._key} did not complete within {timeout} s"
                        )
                    reducer._cond.wait(left)
            self._value = reducer._results.pop(self._key)
            self._done = True
            return self._value

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<Future key={self._key} {state}>"


def _bind_host(root_host: str, root_port: int) -> str:
    """Where rank 0's server listens, given the address the ranks dial.

    Port 0 is local mode: only this process can learn the port, so the server
    listens on (and rank 0 dials) the IPv4 loopback, whatever
    ``ADAPTDL_MASTER_ADDR`` says. A loopback master address (any ``127.x``,
    ``localhost`` or ``::1``) means a single-machine job: that address
    itself. Anything else must be reachable from other nodes: the wildcard of
    its address family.
    """
    if root_port == 0:
        return "127.0.0.1"
    if root_host == "localhost":
        return "127.0.0.1"
    if root_host.startswith("127.") or root_host == "::1":
        return root_host
    return "::" if ":" in root_host else "0.0.0.0"  # noqa: S104 - other nodes dial in


def _host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


class Reducer:
    """One rank's handle on the job's star reducer.

    Constructing it connects to the server (rank 0 starts the server first)
    and returns once *every* rank has joined, so a successful constructor
    means the whole job is wired up.

    Args:
        rank: this replica's rank, ``0 <= rank < replicas``.
        replicas: the number of replicas in the job.
        root_host: address of rank 0.
        root_port: port of rank 0's server; 0 lets the OS pick one, which
            only works for a single replica (nobody else could learn it).
        token: the job token peers must present (see
            :func:`adaptdl.env.job_token`); None admits any peer.
        connect_timeout: seconds to wait for the server and for all ranks.

    Raises:
        ValueError, TypeError: invalid arguments.
        ReducerConnectError: the server was unreachable, rejected this rank,
            or not every rank joined in time.
    """

    def __init__(
        self,
        rank: int,
        replicas: int,
        root_host: str,
        root_port: int,
        *,
        token: str | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        replicas = _check_int("replicas", replicas, 1, 2**31 - 1)
        rank = _check_int("rank", rank, 0, replicas - 1)
        root_port = _check_int("root_port", root_port, 0, 65535)
        if not isinstance(root_host, str) or not root_host:
            raise ValueError(f"root_host must be a non-empty host name, got {root_host!r}")
        if root_port == 0 and replicas > 1:
            raise ValueError(
                f"root_port=0 (let the OS pick a port) only works with replicas=1, got "
                f"replicas={replicas}; set ADAPTDL_MASTER_PORT for a multi-replica job"
            )
        if token is not None and not isinstance(token, str):
            raise TypeError(f"token must be a str or None, got {type(token).__name__}")
        if (
            isinstance(connect_timeout, bool)
            or not isinstance(connect_timeout, int | float)
            or not 0 < connect_timeout <= MAX_CONNECT_TIMEOUT
        ):
            raise ValueError(
                f"connect_timeout must be a number of seconds > 0 and <= "
                f"{MAX_CONNECT_TIMEOUT:g}, got {connect_timeout!r}"
            )

        self._rank = rank
        self._replicas = replicas
        self._host = root_host
        self._cond = threading.Condition()
        self._results: dict[int, Any] = {}
        self._error: str | None = None
        self._send_lock = threading.Lock()
        self._next_key = 0
        self._closed = False
        self._server: Server | None = None
        port = root_port
        if rank == 0:
            self._server = Server(
                replicas,
                root_port,
                _bind_host(root_host, root_port),
                token,
                float(connect_timeout),
                root_host,
            )
            port = self._server.port
        self._port = port
        if root_port == 0:
            self._host = "127.0.0.1"  # where _bind_host put the local-mode server
        try:
            self._sock = self._connect(token, float(connect_timeout))
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise
        self._receiver = threading.Thread(
            target=self._receive, name=f"adaptdl-reducer-rank{rank}", daemon=True
        )
        self._receiver.start()

    # ------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        """This replica's rank."""
        return self._rank

    @property
    def replicas(self) -> int:
        """Number of replicas in the job."""
        return self._replicas

    @property
    def port(self) -> int:
        """The server's port (the OS-chosen one in local mode)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` of the server (``[host]:port`` for IPv6), as in error messages."""
        return _host_port(self._host, self._port)

    # ------------------------------------------------------------ connection

    def _connect(self, token: str | None, timeout: float) -> socket.socket:
        start = time.monotonic()
        deadline = start + timeout
        delay = _BACKOFF_START
        attempts = 0
        last_warn = start
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection(
                    (self._host, self._port), timeout=max(0.001, min(left, 5.0))
                )
            except OSError as exc:
                reason = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise ReducerConnectError(
                        f"rank {self._rank} could not connect to the reducer server at "
                        f"{self.address} within {timeout:g} s ({attempts} attempts, last "
                        f"error: {reason}); check ADAPTDL_MASTER_ADDR "
                        "and ADAPTDL_MASTER_PORT, or raise ADAPTDL_CONNECT_TIMEOUT"
                    ) from exc
            else:
                try:
                    retry = self._handshake(sock, token, deadline, timeout)
                    if retry is None:
                        break
                    reason = retry
                except ReducerError:
                    sock.close()
                    raise
                except OSError as exc:
                    # Reset by a server that closed meanwhile: its successor
                    # may come, if this process just closed a reducer there.
                    if not self._recently_closed():
                        sock.close()
                        raise ReducerConnectError(
                            f"rank {self._rank} lost its connection to the reducer server "
                            f"at {self.address} during the handshake: {exc}"
                        ) from exc
                    reason = f"{type(exc).__name__}: {exc}"
                except BaseException:
                    sock.close()
                    raise
                sock.close()
                if time.monotonic() >= deadline:
                    raise ReducerConnectError(
                        f"rank {self._rank} could not join the reducer server at "
                        f"{self.address} within {timeout:g} s ({reason}); raise "
                        "ADAPTDL_CONNECT_TIMEOUT if rank 0 starts its reducer slowly"
                    )
            now = time.monotonic()
            if now - last_warn >= _WARN_EVERY:
                last_warn = now
                logger.warning(
                    "rank %d still waiting for the reducer server at %s (%s)",
                    self._rank,
                    self.address,
                    reason,
                )
            jittered = delay * (0.5 + random.random())  # noqa: S311 - jitter only
            time.sleep(max(0.0, min(jittered, deadline - now)))
            delay = min(delay * 2, _BACKOFF_MAX)
        logger.debug(
            "rank %d joined the reducer at %s in %.3f s (%d connection attempts)",
            self._rank,
            self.address,
            time.monotonic() - start,
            attempts,
        )
        return sock

    def _handshake(
        self, sock: socket.socket, token: str | None, deadline: float, timeout: float
    ) -> str | None:
        """Join through ``sock``; None once joined, else why to try again.

        Rank 0's previous server, closing after :func:`teardown`, asks a rank
        that re-joins too early to come back (or closes on it): its successor
        takes the port soon.
        """
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = {
            "type": "hello",
            "version": PROTOCOL_VERSION,
            "rank": self._rank,
            "replicas": self._replicas,
            "token": token,
        }
        # The server reports a missing peer itself when its own deadline
        # passes; the extra second lets that clearer message arrive first.
        sock.settimeout(max(0.001, deadline - time.monotonic()) + 1.0)
        send_frame(sock, encode_json(hello))
        not_ours = (
            f"unexpected handshake reply from {self.address}; is ADAPTDL_MASTER_PORT the "
            "port of this job's rank 0?"
        )
        try:
            # A reply is a few hundred bytes: another service's greeting read
            # as a frame length must not allocate exabytes.
            frame = recv_frame(sock, max_length=MAX_HANDSHAKE_BYTES)
        except ReducerError as exc:
            raise ReducerConnectError(f"{not_ours} ({exc})") from None
        except TimeoutError:
            raise ReducerConnectError(
                f"rank {self._rank} connected to the reducer server at {self.address} "
                f"but not every one of the {self._replicas} replicas joined within "
                f"{timeout:g} s; raise ADAPTDL_CONNECT_TIMEOUT if replicas start slowly"
            ) from None
        if frame is None:
            if self._recently_closed():
                return "the server closed the connection during the handshake"
            raise ReducerConnectError(
                f"the reducer server at {self.address} closed the connection during the "
                f"handshake of rank {self._rank}"
            )
        try:
            reply = decode(*frame)
        except (ReducerError, ValueError) as exc:  # ValueError: bad JSON or UTF-8
            raise ReducerConnectError(f"{not_ours} ({exc})") from None
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            reply = {"type": "error", "message": reply[1]}
        kind = reply.get("type") if isinstance(reply, dict) else None
        if kind == "retry":
            return "the previous reducer server is closing"
        if kind == "reject":
            raise ReducerConnectError(
                f"the reducer server at {self.address} rejected rank {self._rank}: "
                f"{reply.get('message')}"
            )
        if kind == "error":
            raise ReducerConnectError(
                f"the reducer server at {self.address} failed while rank {self._rank} "
                f"was joining: {reply.get('message')}"
            )
        if kind != "welcome":
            raise ReducerConnectError(f"{not_ours} (got {reply!r})")
        sock.settimeout(None)
        return None

    def _receive(self) -> None:
        """Background reader: files results by key and records failures."""
        error: str | None = None
        try:
            while True:
                frame = recv_frame(self._sock)
                if frame is None:
                    error = (
                        f"lost the connection to the reducer server at {self.address} "
                        "(rank 0 exited or closed its reducer)"
                    )
                    break
                msg = decode(*frame)
                if msg[0] == "result":
                    with self._cond:
                        self._results[msg[1]] = msg[2]
                        self._cond.notify_all()
                elif msg[0] == "error":
                    error = f"collective operation failed (reported by {self.address}): {msg[1]}"
                    break
        except OSError as exc:
            error = f"lost the connection to the reducer server at {self.address}: {exc}"
        except Exception as exc:  # e.g. a result that cannot be unpickled here
            error = f"could not receive a result from {self.address}: {exc!r}"
        with self._cond:
            if self._error is None:
                self._error = "this Reducer was closed" if self._closed else error
            self._cond.notify_all()

    # ------------------------------------------------------------ operations

    def _submit(self, kind: str, value: Any, reduce_fn: ReduceFn | None) -> Future:
        with self._send_lock:
            if self._closed:
                raise ReducerError("this Reducer was closed")
            with self._cond:
                if self._error is not None:
                    raise ReducerError(self._error)
            key = self._next_key
            try:
                frame = encode_pickle(("op", key, kind, value))
            except Exception as exc:
                raise TypeError(
                    f"the value passed to {kind} must be picklable to reach the other "
                    f"replicas; {type(value).__name__} is not: {exc}"
                ) from exc
            if self._server is not None and reduce_fn is not None:
                self._server.register(key, reduce_fn)
            self._next_key += 1
            try:
                send_frame(self._sock, frame)
            except OSError as exc:
                with self._cond:
                    reason = self._error
                raise ReducerError(
                    reason or f"lost the connection to the reducer server at {self.address}: {exc}"
                ) from exc
        return Future(self, key)

    def allreduce_async(self, obj: Any, reduce_fn: ReduceFn = default_reduce_fn) -> Future:
        """Start folding ``obj`` across all ranks; return a :class:`Future`.

        The fold is ``reduce_fn(...reduce_fn(v0, v1)..., vN-1)`` in rank order,
        run in rank 0's process with the function rank 0 passed (the ones other
        ranks pass are ignored, as in the original).
        """
        if not callable(reduce_fn):
            raise TypeError(f"reduce_fn must be callable, got {reduce_fn!r}")
        return self._submit("allreduce", obj, reduce_fn)

    def allreduce(self, obj: Any, reduce_fn: ReduceFn = default_reduce_fn) -> Any:
        """Fold ``obj`` across all ranks and return the result on every rank."""
        return self.allreduce_async(obj, reduce_fn).result()

    def broadcast(self, obj: Any) -> Any:
        """Return rank 0's ``obj`` on every rank (other ranks' values are not sent)."""
        return self._submit("broadcast", obj if self._rank == 0 else None, None).result()

    def _teardown_barrier_async(self) -> Future:
        """Start the barrier that closing the collectives waits for.

        An operation kind of its own, so a rank tearing down while another
        still issues an allreduce is reported as a mismatch instead of being
        folded into that allreduce.
        """
        return self._submit("teardown", None, None)

    def _recently_closed(self) -> bool:
        closed = _CLOSED_AT.get((self._host, self._port))
        return closed is not None and time.monotonic() - closed < _RECENT

    def _release_after_fork(self) -> None:
        """In a forked child: close its copies of the descriptors, not the connection.

        Without this the child holds the sockets open after the parent dies,
        and the other ranks notice the loss only when the child exits.
        Nothing is sent and nothing is shut down: the parent's connection
        stays as it is.
        """
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._server is not None:
            self._server._release_after_fork()

    def close(self) -> None:
        """Disconnect, and on rank 0 stop the server after flushing its results.

        Idempotent. Pending futures and later operations raise
        :class:`ReducerError`.
        """
        with self._send_lock:
            if self._closed:
                return
            _CLOSED_AT[(self._host, self._port)] = time.monotonic()
            self._closed = True
            try:
                send_frame(self._sock, encode_pickle(("bye",)))
            except OSError:
                pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._receiver.join(10.0)
        self._sock.close()
        with self._cond:
            if self._error is None:
                self._error = "this Reducer was closed"
            self._cond.notify_all()
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> Reducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Reducer rank={self._rank}/{self._replicas} server={self.address}>"
