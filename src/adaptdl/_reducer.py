"""Wire protocol and server of the star reducer behind :mod:`adaptdl.reducer`.

Frames are ``kind (1 byte) | length (8 bytes, big endian) | payload``. The kind
is ``J`` (UTF-8 JSON) or ``P`` (a pickle). The handshake is JSON on purpose:
unpickling bytes from a peer that has not proven it knows the job token would
let any process that can reach the port run code in rank 0. Only after the
server accepted a peer's token does it unpickle that peer's frames.

The server is one thread in rank 0 that multiplexes every connection with
:mod:`selectors`, so it notices a peer that disconnects while it waits for
another, never blocks on a slow reader (outgoing data is buffered per peer),
and can report any failure to every rank instead of dying silently.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import io
import json
import logging
import pickle
import selectors
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
KIND_JSON = ord("J")
KIND_PICKLE = ord("P")
HEADER = struct.Struct("!BQ")
# A handshake is a few hundred bytes; anything larger from an unauthenticated
# peer is garbage or abuse and is not buffered.
MAX_HANDSHAKE_BYTES = 64 * 1024
# How long the server keeps flushing buffered results and error reports
# before it closes the sockets when it shuts down.
FLUSH_TIMEOUT = 5.0
# Longest connection timeout in seconds (about 11.6 days): sockets reject
# timeouts beyond about 1e9 s with an OverflowError.
MAX_CONNECT_TIMEOUT = 1e6
_RECV_CHUNK = 256 * 1024
# Frames larger than this are received in place (see Server._read).
_INPLACE_MIN = 256 * 1024

ReduceFn = Callable[[Any, Any], Any]


class ReducerError(RuntimeError):
    """A collective operation failed; every rank of the job sees the same error."""


class ReducerConnectError(ReducerError, TimeoutError):
    """The reducer server could not be reached, or did not admit this rank."""


ReducerError.__module__ = "adaptdl.reducer"
ReducerConnectError.__module__ = "adaptdl.reducer"


Frame = list[bytes | memoryview]
"""A frame as a list of chunks, sent back to back (large buffers are not copied)."""


def encode_json(obj: dict[str, Any]) -> Frame:
    payload = json.dumps(obj).encode()
    return [HEADER.pack(KIND_JSON, len(payload)) + payload]


class _Pickler(pickle.Pickler):
    """Protocol-5 pickler that sends read-only numpy arrays in band.

    Out of band, a read-only array's buffer is marked read-only in the
    stream, and its copy on the other side would be read-only too: ``a += b``
    in a reduce function, or the caller's own use of the result, would fail
    although the copy belongs to nobody else. In band it arrives writable,
    as with plain pickling.
    """

    def reducer_override(self, obj: object) -> Any:
        numpy = sys.modules.get("numpy")  # no array can exist without it
        if numpy is not None and isinstance(obj, numpy.ndarray) and not obj.flags.writeable:
            return obj.__reduce__()
        return NotImplemented


def encode_pickle(obj: object) -> Frame:
    """Pickle ``obj`` with protocol 5, keeping large buffers (arrays) out of band.

    In-band pickling of a 1 MiB array costs milliseconds (the pickle grows by
    reallocation); out of band, the array's memory is sent as is and, on the
    receiving side, becomes the new array's memory without a copy. The payload
    is ``count (u32) | pickle length, buffer lengths (u64 each) | pickle |
    buffers``.
    """
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    data = out.getvalue()
    raws = [b.raw() for b in buffers]
    meta = struct.pack(f"!I{len(raws) + 1}Q", len(raws), len(data), *(r.nbytes for r in raws))
    total = len(meta) + len(data) + sum(r.nbytes for r in raws)
    return [HEADER.pack(KIND_PICKLE, total) + meta + data, *raws]


def _decode_pickle(payload: bytes | bytearray) -> Any:
    view = memoryview(payload)
    try:
        (count,) = struct.unpack_from("!I", view, 0)
        if 4 + 8 * (count + 1) > len(view):
            raise ValueError("truncated buffer table")
        lengths = struct.unpack_from(f"!{count + 1}Q", view, 4)
        offset = 4 + 8 * (count + 1)
        if offset + sum(lengths) != len(view):
            raise ValueError("buffer lengths do not add up")
    except (struct.error, ValueError) as exc:
        raise ReducerError(f"corrupt reducer frame: {exc}") from None
    data = view[offset : offset + lengths[0]]
    offset += lengths[0]
    # Slices of the (writable) receive buffer: arrays come back writable, so
    # in-place reduce functions such as ``a += b`` work on them (read-only
    # arrays travel in band, see _Pickler).
    buffers = []
    for length in lengths[1:]:
        buffers.append(view[offset : offset + length])
        offset += length
    return pickle.loads(data, buffers=buffers)


def decode(kind: int, payload: bytes | bytearray) -> Any:
    if kind == KIND_JSON:
        return json.loads(bytes(payload).decode())
    if kind == KIND_PICKLE:
        return _decode_pickle(payload)
    raise ReducerError(f"corrupt reducer frame: unknown frame kind {kind!r}")


def send_frame(sock: socket.socket, frame: Frame) -> None:
    """Send ``frame`` on a blocking socket."""
    for chunk in frame:
        sock.sendall(chunk)


def recv_exactly(sock: socket.socket, size: int) -> bytearray | None:
    """Read exactly ``size`` bytes from a blocking socket; None on a clean EOF."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return buf


def recv_frame(sock: socket.socket, max_length: int | None = None) -> tuple[int, bytearray] | None:
    """Read one frame from a blocking socket; None on EOF.

    Raises:
        ReducerError: the frame is longer than ``max_length`` bytes.
    """
    header = recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    kind, length = HEADER.unpack(header)
    if max_length is not None and length > max_length:
        raise ReducerError(
            f"corrupt reducer frame: {length} bytes announced, at most {max_length} expected"
        )
    payload = recv_exactly(sock, length) if length else bytearray()
    if payload is None:
        return None
    return kind, payload


class _Peer:
    """One connection to the server, before and after it was admitted."""

    def __init__(self, sock: socket.socket, addr: object) -> None:
        self.sock = sock
        self.addr = addr
        self.rank: int | None = None
        self.inbuf = bytearray()
        # A large frame being received in place: its buffer, kind and fill level.
        self.frame: bytearray | None = None
        self.frame_kind = 0
        self.frame_got = 0
        self.outbuf: collections.deque[memoryview] = collections.deque()
        self.pending: collections.deque[tuple[int, str, Any]] = collections.deque()
        self.closing = False  # drop the connection once outbuf is flushed
        self.dead = False
        self.said_bye = False


def _queue(peer: _Peer, frame: Frame) -> None:
    """Append ``frame``'s non-empty chunks to what ``peer`` is still to be sent."""
    for chunk in frame:
        if len(chunk):
            peer.outbuf.append(memoryview(chunk).cast("B"))


class Server:
    """The rank-0 side of the star: admits peers, folds values, reports errors.

    Args:
        replicas: number of ranks that must join.
        port: the port to listen on; 0 lets the OS pick one.
        bind_host: the interface to listen on.
        token: the job token every peer must present (None: none required).
        join_timeout: seconds, counted from the start, within which every rank
            must have joined; otherwise the joined ranks get an error.
        host_label: the host name clients use, for error messages.
    """

    def __init__(
        self,
        replicas: int,
        port: int,
        bind_host: str,
        token: str | None,
        join_timeout: float,
        host_label: str,
    ) -> None:
        self.replicas = replicas
        self.token = token
        self.join_timeout = join_timeout
        self.reduce_fns: dict[int, ReduceFn] = {}
        self.reduce_fns_lock = threading.Lock()
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and bind_host == "::":
                # Dual stack where the system allows it: IPv4 peers may dial too.
                self._listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            self._listener.bind((bind_host, port))
            self._listener.listen(max(replicas, 16))
        except OSError as exc:
            self._listener.close()
            raise ReducerError(
                f"the reducer server could not listen on {bind_host}:{port} ({exc}); "
                "is ADAPTDL_MASTER_PORT already in use?"
            ) from exc
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.label = f"{host_label}:{self.port}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._clients: dict[int, _Peer] = {}
        self._peers: set[_Peer] = set()
        self._joined = False
        self._next_key = 0
        self._root_deferred: list[Frame] = []
        self._failed: str | None = None
        self._rejected: list[str] = []  # the last few handshake refusals, for the join timeout
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"adaptdl-reducer-server-{self.port}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ API

    def register(self, key: int, fn: ReduceFn) -> None:
        with self.reduce_fns_lock:
            self.reduce_fns[key] = fn

    def close(self) -> None:
        """Stop the server after flushing what it still has to send."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(FLUSH_TIMEOUT + 5.0)

    # ----------------------------------------------------------- event loop

    def _run(self) -> None:
        flush_deadline: float | None = None
        try:
            while True:
                if self._stop.is_set() or self._failed is not None:
                    if flush_deadline is None:
                        flush_deadline = time.monotonic() + FLUSH_TIMEOUT
                    if not any(p.outbuf for p in self._peers if not p.dead):
                        break
                    if time.monotonic() > flush_deadline:
                        logger.warning("reducer server: gave up flushing to slow peers")
                        break
                timeout = 0.5
                if not self._joined and self._failed is None:
                    left = self._started + self.join_timeout - time.monotonic()
                    if left <= 0:
                        self._fail(self._join_timeout_message())
                        continue
                    timeout = min(timeout, left)
                for key, mask in self._sel.select(timeout):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        peer: _Peer = key.data
                        if mask & selectors.EVENT_READ and not peer.dead:
                            self._read(peer)
                        if mask & selectors.EVENT_WRITE and not peer.dead:
                            self._write(peer)
        except Exception:
            # A bug in the server itself: still tell every rank instead of hanging.
            logger.exception("reducer server crashed")
            with contextlib.suppress(Exception):
                self._fail("the reducer server crashed:\n" + traceback.format_exc())
                self._flush_blocking()
            # Even if reporting failed, closing the sockets below makes every
            # client's next wait end with a lost-connection error.
        finally:
            self._shutdown()

    def _join_timeout_message(self) -> str:
        joined = sorted(self._clients)
        missing = sorted(set(range(self.replicas)) - set(joined))
        if self._rejected:
            # A missing rank was most likely one of these: its cause is the fix.
            hint = "; peers were refused meanwhile: " + "; ".join(self._rejected)
        else:
            hint = " (raise ADAPTDL_CONNECT_TIMEOUT if replicas start slowly)"
        return (
            f"only ranks {joined} of {self.replicas} joined the reducer server at "
            f"{self.label} within {self.join_timeout:g} s; missing ranks {missing}{hint}"
        )

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("reducer server: accept failed: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = _Peer(sock, addr)
            self._peers.add(peer)
            self._sel.register(sock, selectors.EVENT_READ, peer)

    def _read(self, peer: _Peer) -> None:
        if peer.frame is not None:
            self._read_into_frame(peer)
            return
        try:
            data = peer.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._on_eof(peer)
            return
        peer.inbuf += data
        while len(peer.inbuf) >= HEADER.size and not peer.dead and not peer.closing:
            kind, length = HEADER.unpack_from(peer.inbuf)
            if peer.rank is None and (kind != KIND_JSON or length > MAX_HANDSHAKE_BYTES):
                self._reject(peer, "the first message must be an AdaptDL reducer handshake")
                return
            available = len(peer.inbuf) - HEADER.size
            if available < length:
                if length > _INPLACE_MIN:
                    # A large value (an array): receive the rest straight into
                    # its final buffer instead of growing and copying inbuf.
                    peer.frame = bytearray(length)
                    peer.frame[:available] = peer.inbuf[HEADER.size :]
                    peer.frame_kind = kind
                    peer.frame_got = available
                    peer.inbuf.clear()
                return
            payload = peer.inbuf[HEADER.size : HEADER.size + length]
            del peer.inbuf[: HEADER.size + length]
            self._dispatch(peer, kind, payload)

    def _read_into_frame(self, peer: _Peer) -> None:
        frame = peer.frame
        if frame is None:  # pragma: no cover - guarded by the caller
            return
        try:
            with memoryview(frame) as view:
                got = peer.sock.recv_into(view[peer.frame_got :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        if got == 0:
            self._on_eof(peer)
            return
        peer.frame_got += got
        if peer.frame_got == len(frame):
            peer.frame = None
            self._dispatch(peer, peer.frame_kind, frame)

    def _dispatch(self, peer: _Peer, kind: int, payload: bytes | bytearray) -> None:
        if peer.rank is None:
            self._handshake(peer, kind, payload)
        else:
            self._message(peer, kind, payload)

    def _write(self, peer: _Peer) -> None:
        while peer.outbuf:
            chunk = peer.outbuf[0]
            try:
                sent = peer.sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._on_eof(peer)
                return
            if sent < len(chunk):
                peer.outbuf[0] = chunk[sent:]
                break
            peer.outbuf.popleft()
        if peer.outbuf:
            self._sel.modify(peer.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)
        elif peer.closing:
            self._drop(peer)
        else:
            self._sel.modify(peer.sock, selectors.EVENT_READ, peer)
        if not peer.outbuf and peer.rank:
            self._release_root()

    def _send(self, peer: _Peer, frame: Frame) -> None:
        if peer.dead:
            return
        _queue(peer, frame)
        self._write(peer)

    def _drop(self, peer: _Peer) -> None:
        if peer.dead:
            return
        peer.dead = True
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(peer.sock)
        with contextlib.suppress(OSError):
            peer.sock.close()
        self._peers.discard(peer)
        if peer.rank:
            self._release_root()

    def _reject(self, peer: _Peer, reason: str) -> None:
        logger.warning(
            "reducer server at %s rejected a peer from %s: %s", self.label, peer.addr, reason
        )
        peer.closing = True
        peer.inbuf.clear()
        self._rejected.append(reason)
        del self._rejected[:-3]
        self._send(peer, encode_json({"type": "reject", "message": reason}))

    # ------------------------------------------------------------ protocol

    def _handshake(self, peer: _Peer, kind: int, payload: bytes | bytearray) -> None:
        try:
            hello = decode(kind, payload)
        except (ValueError, UnicodeDecodeError, RecursionError, ReducerError):
            # Nothing a stray peer sends before the token check may fail the
            # server for the job's own ranks.
            self._reject(peer, "the handshake is not valid JSON")
            return
        if not isinstance(hello, dict) or hello.get("type") != "hello":
            self._reject(peer, "the first message must be an AdaptDL reducer handshake")
            return
        if hello.get("version") != PROTOCOL_VERSION:
            self._reject(
                peer,
                f"protocol version {hello.get('version')!r} does not match the server's "
                f"{PROTOCOL_VERSION} (mixed AdaptDL versions in one job?)",
            )
            return
        token = hello.get("token")
        if self.token is not None and (
            # Bytes: compare_digest refuses str with non-ASCII characters, and JSON
            # may carry lone surrogates ("\ud800"), which only surrogatepass encodes.
            not isinstance(token, str)
            or not hmac.compare_digest(
                token.encode(errors="surrogatepass"), self.token.encode(errors="surrogatepass")
            )
        ):
            what = "no job token" if token is None else "a wrong job token"
            self._reject(
                peer, f"the peer presented {what}; set ADAPTDL_JOB_TOKEN to the job's token"
            )
            return
        rank, replicas = hello.get("rank"), hello.get("replicas")
        if self._stop.is_set() or any(p.said_bye for p in self._clients.values()):
            # This server is being torn down and a rank is re-joining (perhaps
            # with a new replica count): it should come back to the server
            # that replaces this one, not be judged by this one's settings.
            peer.closing = True
            peer.inbuf.clear()
            self._send(peer, encode_json({"type": "retry"}))
            return
        if replicas != self.replicas:
            self._reject(
                peer, f"the peer expects {replicas!r} replicas but the job has {self.replicas}"
            )
            return
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.replicas:
            self._reject(
                peer,
                f"rank {rank!r} is out of range for {self.replicas} replicas "
                f"(0..{self.replicas - 1})",
            )
            return
        if rank in self._clients:
            self._reject(peer, f"rank {rank} is already connected; duplicate ranks are not allowed")
            return
        if self._failed is not None:
            self._reject(peer, self._failed)
            return
        peer.rank = rank
        self._clients[rank] = peer
        logger.debug(
            "reducer server: rank %d joined (%d/%d)", rank, len(self._clients), self.replicas
        )
        if len(self._clients) == self.replicas:
            self._joined = True
            welcome = encode_json({"type": "welcome"})
            for client in self._clients.values():
                self._send(client, welcome)

    def _message(self, peer: _Peer, kind: int, payload: bytes | bytearray) -> None:
        if kind != KIND_PICKLE:
            self._fail(f"rank {peer.rank} sent a malformed message (frame kind {kind})")
            return
        try:
            msg = _decode_pickle(payload)
        except Exception as exc:
            self._fail(f"rank {peer.rank} sent a value the server cannot unpickle: {exc!r}")
            return
        if not isinstance(msg, tuple) or not msg:
            self._fail(f"rank {peer.rank} sent a malformed message {msg!r}")
            return
        if msg[0] == "bye":
            peer.said_bye = True
            return
        if msg[0] != "op" or len(msg) != 4:
            self._fail(f"rank {peer.rank} sent a malformed message {msg[0]!r}")
            return
        if self._failed is not None:
            return
        if not self._joined:
            self._fail(f"rank {peer.rank} sent an operation before every rank had joined")
            return
        peer.pending.append((msg[1], msg[2], msg[3]))
        self._reduce_ready()

    def _on_eof(self, peer: _Peer) -> None:
        rank = peer.rank
        self._drop(peer)
        if rank is None or self._clients.get(rank) is not peer:
            return
        if not self._joined:
            # It may come back (a restarting client); let the slot be taken again.
            del self._clients[rank]
            return
        if self._failed is None and not self._stop.is_set():
            logger.debug("reducer server: rank %d disconnected", rank)
            self._reduce_ready()

    def _gone_message(self, rank: int, key: int) -> str:
        peer = self._clients[rank]
        how = "closed its reducer" if peer.said_bye else "disconnected"
        return (
            f"rank {rank} {how} before contributing to collective operation {key}; "
            "the operation cannot complete on any rank"
        )

    def _reduce_ready(self) -> None:
        """Fold every operation for which all ranks have sent their value."""
        clients = [self._clients[r] for r in range(self.replicas)]
        while self._failed is None:
            if not all(c.pending for c in clients):
                if any(c.pending for c in clients):
                    for c in clients:
                        if c.dead and not c.pending and c.rank is not None:
                            self._fail(self._gone_message(c.rank, self._next_key))
                            return
                return
            entries = [c.pending.popleft() for c in clients]
            key = self._next_key
            self._next_key += 1
            for rank, (k, _, _) in enumerate(entries):
                if k != key:
                    self._fail(
                        f"rank {rank} sent collective operation number {k} while the "
                        f"server expected {key}"
                    )
                    return
            kinds = [kind for _, kind, _ in entries]
            if len(set(kinds)) != 1:
                described = ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
                self._fail(
                    f"collective operation {key} does not match across ranks ({described}); "
                    "every rank must issue the same collectives in the same order"
                )
                return
            with self.reduce_fns_lock:
                fn = self.reduce_fns.pop(key, None)
            try:
                result = entries[0][2]
                if kinds[0] == "allreduce":
                    if fn is None:
                        raise ReducerError(f"no reduce function registered for operation {key}")
                    for _, _, value in entries[1:]:
                        result = fn(result, value)
                frame = encode_pickle(("result", key, result))
            except Exception as exc:
                self._fail(
                    f"the reduce function of collective operation {key} raised "
                    f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                )
                return
            for c in clients[1:]:
                self._send(c, frame)
            self._root_deferred.append(frame)
            self._release_root()

    def _release_root(self) -> None:
        """Deliver rank 0's results once the other ranks' results are in the kernel.

        Rank 0 hosts this server, so once it has a result it may exit; if other
        ranks' copies were still queued here they would be lost with the
        process. Sending to rank 0 last (as the original did) prevents that.
        """
        if not self._root_deferred:
            return
        for rank, peer in self._clients.items():
            if rank != 0 and peer.outbuf and not peer.dead:
                return
        root = self._clients.get(0)
        frames, self._root_deferred = self._root_deferred, []
        if root is not None:
            for frame in frames:
                self._send(root, frame)

    def _fail(self, message: str) -> None:
        """Report ``message`` to every connected peer and shut down after flushing."""
        if self._failed is not None:
            return
        self._failed = message
        logger.error("reducer server at %s failed: %s", self.label, message)
        admitted = encode_pickle(("error", message))
        waiting = encode_json({"type": "error", "message": message})
        root = self._clients.get(0)
        for peer in list(self._peers):
            peer.pending.clear()
            peer.closing = True
        # Like results, rank 0 (this process) hears last: once it has the
        # error it may exit, taking the others' copies with it. So it is
        # queued only after every other peer's copy is (a send below may
        # release rank 0's queue as soon as the copies before it are out).
        for peer in list(self._peers):
            if peer is not root:
                self._send(peer, admitted if peer.rank is not None else waiting)
        if root is not None:
            self._root_deferred.append(admitted)
        self._release_root()

    def _flush_blocking(self) -> None:
        deadline = time.monotonic() + FLUSH_TIMEOUT
        root = self._clients.get(0)
        # Rank 0 last, with what was held back for it: as in _release_root.
        peers = [p for p in self._peers if p is not root]
        if root is not None and root in self._peers:
            for frame in self._root_deferred:
                _queue(root, frame)
            self._root_deferred = []
            peers.append(root)
        for peer in peers:
            with contextlib.suppress(OSError):
                peer.sock.settimeout(max(0.0, deadline - time.monotonic()))
                for chunk in peer.outbuf:
                    peer.sock.sendall(chunk)

    def _release_after_fork(self) -> None:
        """In a forked child: close its copies of every descriptor (see Reducer)."""
        for sock in [self._listener, self._wake_r, self._wake_w, *(p.sock for p in self._peers)]:
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError, ValueError):
            self._sel.close()

    def _shutdown(self) -> None:
        for peer in list(self._peers):
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
            self._drop(peer)
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        self._sel.close()
