"""Tests of :mod:`adaptdl.reducer`: one job's ranks as threads of this process.

Threads exercise the real TCP server and clients (each rank has its own
sockets) while keeping failures, such as a peer that vanishes, easy to stage.
Tests with real processes live in ``test_collective.py``.
"""

from __future__ import annotations

import collections
import json
import logging
import multiprocessing
import os
import pickle
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from adaptdl.reducer import (
    Future,
    Reducer,
    ReducerConnectError,
    ReducerError,
    default_reduce_fn,
)
from adaptdl.testing import free_port


def _start_job(
    replicas: int, token: str | None = "tok", timeout: float = 10.0, port: int | None = None
) -> list[Reducer]:
    port = free_port() if port is None else port
    with ThreadPoolExecutor(replicas) as pool:
        futures = [
            pool.submit(
                Reducer, r, replicas, "127.0.0.1", port, token=token, connect_timeout=timeout
            )
            for r in range(replicas)
        ]
        return [f.result() for f in futures]


@pytest.fixture
def job3() -> Iterator[list[Reducer]]:
    reducers = _start_job(3)
    yield reducers
    for r in reversed(reducers):
        r.close()


def _on_all(reducers: list[Reducer], fn: Callable[[Reducer], Any]) -> list[Any]:
    """Run ``fn(reducer)`` on every rank concurrently, as separate replicas would."""
    with ThreadPoolExecutor(len(reducers)) as pool:
        return list(pool.map(fn, reducers))


def _expect_error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ReducerError as exc:
        return str(exc)
    raise AssertionError("expected a ReducerError")


# --------------------------------------------------------------------- basics


def test_default_reduce_fn() -> None:
    assert default_reduce_fn(2, 3) == 5
    assert default_reduce_fn([1], [2]) == [1, 2]
    a = np.array([1.0, 2.0])
    out = default_reduce_fn(a, np.array([1.0, 1.0]))
    assert out is a and out.tolist() == [2.0, 3.0]
    counts = default_reduce_fn(collections.Counter("ab"), collections.Counter("b"))
    assert counts == collections.Counter({"a": 1, "b": 2})


def test_single_replica_local_mode() -> None:
    with Reducer(0, 1, "127.0.0.1", 0) as reducer:
        assert reducer.port > 0
        assert reducer.allreduce(5) == 5
        assert reducer.broadcast("x") == "x"
        futures = [reducer.allreduce_async(i) for i in range(3)]
        assert [f.result() for f in reversed(futures)] == [2, 1, 0]
        assert f"127.0.0.1:{reducer.port}" in repr(reducer)


def test_allreduce_folds_in_rank_order_with_rank0_fn(job3: list[Reducer]) -> None:
    def body(r: Reducer) -> tuple[Any, ...]:
        concat = r.allreduce(str(r.rank), lambda a, b: a + b)
        # Only rank 0's function counts; the others pass a wrong one.
        fn = (lambda a, b: a * b) if r.rank == 0 else (lambda a, b: a + b)
        product = r.allreduce(r.rank + 2, fn)
        ranks = r.allreduce([r.rank])
        union = r.allreduce({r.rank, 10}, lambda a, b: a | b)
        merged = r.allreduce({f"k{r.rank}": r.rank}, lambda a, b: {**a, **b})
        counts = r.allreduce(collections.Counter({"x": 1, r.rank: 1}))
        return concat, product, ranks, union, merged, counts

    results = _on_all(job3, body)
    assert results[0] == results[1] == results[2]
    concat, product, ranks, union, merged, counts = results[0]
    assert concat == "012"
    assert product == 2 * 3 * 4
    assert ranks == [0, 1, 2]
    assert union == {0, 1, 2, 10}
    assert merged == {"k0": 0, "k1": 1, "k2": 2}
    assert counts == collections.Counter({"x": 3, 0: 1, 1: 1, 2: 1})


def test_large_numpy_allreduce(job3: list[Reducer]) -> None:
    def body(r: Reducer) -> Any:
        return r.allreduce(np.full(262_144, float(r.rank + 1)))  # 2 MiB of float64

    for out in _on_all(job3, body):
        assert out.shape == (262_144,)
        assert np.all(out == 6.0)


def test_broadcast_sends_rank0_value(job3: list[Reducer]) -> None:
    assert _on_all(job3, lambda r: r.broadcast({"from": r.rank})) == [{"from": 0}] * 3


def test_documented_keyword_names(job3: list[Reducer]) -> None:
    """The docs spell the methods allreduce(obj, reduce_fn=...) and broadcast(obj)."""

    def body(r: Reducer) -> Any:
        total = r.allreduce(obj=r.rank, reduce_fn=max)
        later = r.allreduce_async(obj=1).result()
        return total, later, r.broadcast(obj=r.rank)

    assert _on_all(job3, body) == [(2, 3, 0)] * 3


def test_async_out_of_order(job3: list[Reducer]) -> None:
    def body(r: Reducer) -> list[Any]:
        f1 = r.allreduce_async(1)
        f2 = r.allreduce_async([r.rank])
        f3 = r.allreduce_async(r.rank * 10)
        out = [f2.result(), f1.result(), f3.result()]
        assert f2.result() is out[0]  # cached
        assert f1.done() and f1.key + 1 == f2.key
        return out

    assert _on_all(job3, body) == [[[0, 1, 2], 3, 30]] * 3


def test_futures_resolved_from_many_threads(job3: list[Reducer]) -> None:
    def body(r: Reducer) -> list[list[Any]]:
        futures = [r.allreduce_async(i) for i in range(40)]
        out: list[list[Any]] = []
        lock = threading.Lock()

        def resolve(seed: int) -> None:
            order = list(range(40))
            random.Random(seed).shuffle(order)
            got = [None] * 40
            for i in order:
                got[i] = futures[i].result(timeout=20)
            with lock:
                out.append(got)

        threads = [threading.Thread(target=resolve, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    for per_rank in _on_all(job3, body):
        assert per_rank == [[3 * i for i in range(40)]] * 6


def test_result_timeout_and_repr(job3: list[Reducer]) -> None:
    future = job3[0].allreduce_async(1)
    assert not future.done()
    with pytest.raises(TimeoutError, match="did not complete within 0.05 s"):
        future.result(timeout=0.05)
    assert "pending" in repr(future)
    with pytest.raises(ValueError, match="timeout must be None or >= 0 seconds, got -1"):
        future.result(timeout=-1)
    rest = [r.allreduce_async(1) for r in job3[1:]]
    assert future.result(timeout=10) == 3
    assert [f.result() for f in rest] == [3, 3]
    assert isinstance(future, Future) and "done" in repr(future)


def test_unpicklable_value_does_not_consume_an_operation(job3: list[Reducer]) -> None:
    with pytest.raises(TypeError, match="must be picklable.*lock"):
        job3[1].allreduce_async(threading.Lock())
    assert _on_all(job3, lambda r: r.allreduce(1)) == [3, 3, 3]


def test_close_is_idempotent_and_later_ops_fail() -> None:
    reducers = _start_job(2)
    pending = reducers[1].allreduce_async(1)
    for r in reversed(reducers):
        r.close()
        r.close()
    assert "closed" in _expect_error(pending.result)
    assert "this Reducer was closed" in _expect_error(lambda: reducers[0].allreduce(1))


# -------------------------------------------------------------- connecting


def test_connects_with_fast_backoff_when_server_starts_late() -> None:
    port = free_port()
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        client = pool.submit(Reducer, 1, 2, "127.0.0.1", port, connect_timeout=10)
        time.sleep(0.15)  # rank 1 is refused a few times first
        server = pool.submit(Reducer, 0, 2, "127.0.0.1", port, connect_timeout=10)
        reducers = [server.result(), client.result()]
    elapsed = time.monotonic() - start
    try:
        assert elapsed < 3.0, f"joining took {elapsed:.2f} s"
        assert _on_all(reducers, lambda r: r.allreduce(1)) == [2, 2]
    finally:
        for r in reversed(reducers):
            r.close()


def test_connect_timeout_names_address() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(ReducerConnectError) as info:
        Reducer(1, 2, "127.0.0.1", port, connect_timeout=0.3)
    assert time.monotonic() - start < 5.0
    message = str(info.value)
    assert f"could not connect to the reducer server at 127.0.0.1:{port} within 0.3 s" in message
    assert "ADAPTDL_MASTER_ADDR" in message
    assert isinstance(info.value, TimeoutError)


def test_server_reports_ranks_that_never_join() -> None:
    with pytest.raises(ReducerConnectError) as info:
        Reducer(0, 3, "127.0.0.1", free_port(), connect_timeout=0.3)
    message = str(info.value)
    assert "only ranks [0] of 3 joined" in message
    assert "missing ranks [1, 2]" in message


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rank": 2, "replicas": 2}, ValueError, "rank must be between 0 and 1, got 2"),
        ({"rank": -1}, ValueError, "rank must be between 0 and 1, got -1"),
        (
            {"replicas": 0, "rank": 0},
            ValueError,
            "replicas must be between 1 and 2147483647, got 0",
        ),
        # listen() overflowed with an OverflowError.
        ({"replicas": 3 * 10**9, "rank": 0}, ValueError, "replicas must be between 1 and"),
        ({"rank": "0"}, TypeError, "rank must be an int, got str"),
        ({"root_port": 70000}, ValueError, "root_port must be between 0 and 65535, got 70000"),
        ({"root_port": 0}, ValueError, "root_port=0 .* only works with replicas=1"),
        ({"root_host": ""}, ValueError, "root_host must be a non-empty host name, got ''"),
        ({"connect_timeout": 0}, ValueError, r"connect_timeout must be .* > 0 .*, got 0"),
        ({"connect_timeout": float("inf")}, ValueError, r"<= 1e\+06, got inf"),
        ({"token": 5}, TypeError, "token must be a str or None, got int"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"rank": 1, "replicas": 2, "root_host": "127.0.0.1", "root_port": 1}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        Reducer(**args)


# ----------------------------------------------------------- admission


def _once_listening(connect: Callable[[], Any], timeout: float = 30.0) -> Any:
    """``connect()``, retried while the server is not listening yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return connect()
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _join_rank0(port: int, replicas: int = 2, token: str | None = "secret") -> Any:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(Reducer, 0, replicas, "127.0.0.1", port, token=token, connect_timeout=10)
    pool.shutdown(wait=False)
    return future


@pytest.mark.parametrize(
    ("token", "what"), [("wrong", "a wrong job token"), (None, "no job token")]
)
def test_bad_token_is_rejected_and_job_continues(token: str | None, what: str) -> None:
    port = free_port()
    rank0 = _join_rank0(port)
    with pytest.raises(ReducerConnectError) as info:
        Reducer(1, 2, "127.0.0.1", port, token=token, connect_timeout=10)
    message = str(info.value)
    assert f"the reducer server at 127.0.0.1:{port} rejected rank 1" in message
    assert f"the peer presented {what}" in message
    assert "secret" not in message
    good = Reducer(1, 2, "127.0.0.1", port, token="secret", connect_timeout=10)
    reducers = [rank0.result(timeout=10), good]
    try:
        assert _on_all(reducers, lambda r: r.allreduce(r.rank + 1)) == [3, 3]
    finally:
        for r in reversed(reducers):
            r.close()


def test_join_timeout_names_the_refused_peers() -> None:
    # Rank 0 used to blame a slow start (raise ADAPTDL_CONNECT_TIMEOUT) when
    # the missing rank had been refused for a configuration error.
    port = free_port()
    pool = ThreadPoolExecutor(1)
    rank0 = pool.submit(Reducer, 0, 2, "127.0.0.1", port, token="secret", connect_timeout=1.5)
    pool.shutdown(wait=False)
    with pytest.raises(ReducerConnectError, match="expects 3 replicas"):
        Reducer(1, 3, "127.0.0.1", port, token="secret", connect_timeout=5)
    with pytest.raises(ReducerConnectError) as info:
        rank0.result(timeout=10)
    message = str(info.value)
    assert "missing ranks [1]; peers were refused meanwhile: the peer expects 3" in message
    assert "raise ADAPTDL_CONNECT_TIMEOUT" not in message


def test_duplicate_and_mismatched_ranks_are_rejected() -> None:
    port = free_port()
    reducers = _start_job(2, token="secret", port=port)
    try:
        with pytest.raises(ReducerConnectError, match="rank 1 is already connected"):
            Reducer(1, 2, "127.0.0.1", port, token="secret", connect_timeout=5)
        with pytest.raises(ReducerConnectError, match="expects 3 replicas but the job has 2"):
            Reducer(2, 3, "127.0.0.1", port, token="secret", connect_timeout=5)
        assert _on_all(reducers, lambda r: r.allreduce(1)) == [2, 2]
    finally:
        for r in reversed(reducers):
            r.close()


def _raw_handshake(port: int, frame: bytes) -> Any:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(frame)
        header = sock.recv(9, socket.MSG_WAITALL)
        kind, length = struct.unpack("!BQ", header)
        payload = sock.recv(length, socket.MSG_WAITALL)
        assert kind == ord("J")
        return json.loads(payload)


def _json_frame(obj: object) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("!BQ", ord("J"), len(data)) + data


class _Boom:
    def __reduce__(self) -> Any:
        return (os.getpid, ())  # would run in the server if it unpickled unauthenticated data


_BOOM = pickle.dumps(_Boom())
_PICKLED_BOOM = struct.pack("!BQ", ord("P"), len(_BOOM)) + _BOOM


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (
            _json_frame(
                {"type": "hello", "version": 1, "rank": 7, "replicas": 2, "token": "secret"}
            ),
            "rank 7 is out of range for 2 replicas",
        ),
        (
            _json_frame({"type": "hello", "version": 99, "rank": 1, "replicas": 2}),
            "protocol version 99 does not match",
        ),
        (_json_frame(["not", "a", "hello"]), "must be an AdaptDL reducer handshake"),
        (struct.pack("!BQ", ord("J"), 3) + b"{{{", "not valid JSON"),
        (_PICKLED_BOOM, "must be an AdaptDL reducer handshake"),
        # These two crashed the server for the whole job (RecursionError,
        # and TypeError from comparing non-ASCII str tokens).
        (
            struct.pack("!BQ", ord("J"), 60_000) + b"[" * 30_000 + b"]" * 30_000,
            "not valid JSON",
        ),
        (
            _json_frame({"type": "hello", "version": 1, "rank": 1, "replicas": 2, "token": "é"}),
            "a wrong job token",
        ),
        (
            _json_frame(
                {"type": "hello", "version": 1, "rank": 1, "replicas": 2, "token": "\ud800"}
            ),
            "a wrong job token",
        ),
    ],
    ids=[
        "rank-out-of-range",
        "version",
        "not-a-hello",
        "bad-json",
        "pickle-before-auth",
        "deep-json",
        "non-ascii-token",
        "lone-surrogate-token",
    ],
)
def test_bad_handshakes_are_rejected(frame: bytes, match: str) -> None:
    port = free_port()
    rank0 = _join_rank0(port)
    reply = _once_listening(lambda: _raw_handshake(port, frame))
    assert reply["type"] == "reject"
    assert match in reply["message"]
    good = Reducer(1, 2, "127.0.0.1", port, token="secret", connect_timeout=10)
    reducers = [rank0.result(timeout=10), good]
    try:
        assert _on_all(reducers, lambda r: r.broadcast(r.rank)) == [0, 0]
    finally:
        for r in reversed(reducers):
            r.close()


def test_a_job_token_with_non_ascii_characters_works() -> None:
    reducers = _start_job(2, token="pässwörd")
    try:
        assert _on_all(reducers, lambda r: r.allreduce(1)) == [2, 2]
    finally:
        for r in reversed(reducers):
            r.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    ("host", "port"),
    [
        # Debian's `hostname -i`: the server listened on 127.0.0.1 and rank 0
        # could not reach its own server at 127.0.1.1.
        ("127.0.1.1", "free"),
        # Local mode with the node's address set, as in a standalone setup:
        # the server listens on loopback, so rank 0 must dial loopback too.
        ("192.0.2.2", 0),
        pytest.param(
            "::1",
            "free",
            marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback"),
        ),
    ],
)
def test_the_server_listens_where_the_ranks_dial(host: str, port: int | str) -> None:
    number = free_port() if port == "free" else int(port)
    with Reducer(0, 1, host, number, connect_timeout=10) as reducer:
        assert reducer.allreduce(4) == 4
        if ":" in host:
            assert f"[{host}]:{reducer.port}" in repr(reducer)


# -------------------------------------------------------------- failures


def test_raising_reduce_fn_reaches_every_rank(job3: list[Reducer]) -> None:
    def body(r: Reducer) -> tuple[str, str]:
        first = _expect_error(lambda: r.allreduce(r.rank, lambda a, b: a / 0))
        later = _expect_error(lambda: r.allreduce(1))
        return first, later

    for first, later in _on_all(job3, body):
        assert "the reduce function of collective operation 0 raised ZeroDivisionError" in first
        assert "Traceback" in first
        assert later == first


def test_mismatched_collectives_are_reported(job3: list[Reducer]) -> None:
    def body(r: Reducer) -> str:
        if r.rank == 1:
            return _expect_error(lambda: r.allreduce(1))
        return _expect_error(lambda: r.broadcast(1))

    for message in _on_all(job3, body):
        assert "collective operation 0 does not match across ranks" in message
        assert "rank 1: allreduce" in message


def _crashing_rank(port: int, rank: int, replicas: int, delay: float) -> None:
    Reducer(rank, replicas, "127.0.0.1", port, token="tok", connect_timeout=10)
    time.sleep(delay)
    os._exit(3)  # no goodbye: a crash


def _start_crashing_process(
    port: int, rank: int, replicas: int, delay: float
) -> multiprocessing.process.BaseProcess:
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_crashing_rank, args=(port, rank, replicas, delay), daemon=True)
    proc.start()
    return proc


def test_peer_crash_mid_operation_reaches_every_rank() -> None:
    port = free_port()
    proc = _start_crashing_process(port, 2, 3, delay=0.3)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(Reducer, r, 3, "127.0.0.1", port, token="tok", connect_timeout=10)
                for r in range(2)
            ]
            reducers = [f.result() for f in futures]
        start = time.monotonic()
        messages = _on_all(reducers, lambda r: _expect_error(lambda: r.allreduce(1)))
        assert time.monotonic() - start < 5
        for message in messages:
            assert "rank 2 disconnected before contributing to collective operation 0" in message
        for r in reversed(reducers):
            r.close()
    finally:
        proc.join(5)
    assert proc.exitcode == 3


def test_server_crash_reaches_clients() -> None:
    port = free_port()
    proc = _start_crashing_process(port, 0, 3, delay=0.3)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(Reducer, r, 3, "127.0.0.1", port, token="tok", connect_timeout=10)
                for r in (1, 2)
            ]
            reducers = [f.result() for f in futures]
        messages = _on_all(reducers, lambda r: _expect_error(lambda: r.allreduce(1)))
        for message in messages:
            assert f"lost the connection to the reducer server at 127.0.0.1:{port}" in message
        for r in reducers:
            r.close()
    finally:
        proc.join(5)


# ----------------------------------------------------------- wire format


def test_arrays_round_trip_out_of_band_and_writable(job3: list[Reducer]) -> None:
    base = np.arange(12.0).reshape(3, 4)

    def body(r: Reducer) -> Any:
        value = {
            "c": base + r.rank,
            "f": np.asfortranarray(base),
            "strided": base[:, ::2],
            "big": np.full(300_000, r.rank, dtype=np.int32),
            "raw": bytearray(b"ab"),
        }

        def fold(a: Any, b: Any) -> Any:
            for key in ("c", "big"):
                a[key] += b[key]
            return a

        out = r.allreduce(value, fold)
        out["c"] += 1  # results are writable arrays
        return out

    for out in _on_all(job3, body):
        np.testing.assert_array_equal(out["c"], 3 * base + 3 + 1)
        np.testing.assert_array_equal(out["f"], base)
        np.testing.assert_array_equal(out["strided"], base[:, ::2])
        assert out["big"].dtype == np.int32 and np.all(out["big"] == 3)
        assert out["raw"] == bytearray(b"ab")


def test_read_only_arrays_reduce_and_come_back_writable(job3: list[Reducer]) -> None:
    # Out of band they kept their read-only flag: rank 0's copy refused the
    # default `a += b` and failed the job (np.frombuffer, mmap, setflags).
    def body(r: Reducer) -> Any:
        value = np.full(1000, r.rank + 1.0)
        value.setflags(write=False)
        out = r.allreduce(value)
        out += 1
        return out

    for out in _on_all(job3, body):
        assert np.all(out == 7.0)
    with Reducer(0, 1, "127.0.0.1", 0) as single:
        frozen = np.frombuffer(b"\x00" * 16, dtype=np.float64)
        result = single.allreduce(frozen)
        result += 1
        assert result.tolist() == [1.0, 1.0]


def test_encode_decode_and_corrupt_frames() -> None:
    from adaptdl import _reducer

    frame = _reducer.encode_pickle(("x", np.ones(3)))
    joined = b"".join(bytes(chunk) for chunk in frame)
    kind, length = _reducer.HEADER.unpack_from(joined)
    payload = bytearray(joined[_reducer.HEADER.size :])
    assert length == len(payload)
    name, array = _reducer.decode(kind, payload)
    assert name == "x" and array.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ReducerError, match="corrupt reducer frame: buffer lengths do not add up"):
        _reducer.decode(kind, payload[:-1])
    with pytest.raises(ReducerError, match="corrupt reducer frame"):
        _reducer.decode(kind, bytearray(b"\x00"))
    with pytest.raises(ReducerError, match="unknown frame kind 90"):
        _reducer.decode(90, bytearray())


def test_port_in_use_is_reported() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(ReducerError, match=rf"could not listen on 127\.0\.0\.1:{port}.*in use"):
            Reducer(0, 2, "127.0.0.1", port, connect_timeout=1)


def test_operation_before_everyone_joined_fails_the_job(caplog: pytest.LogCaptureFixture) -> None:
    from adaptdl import _reducer

    caplog.set_level(logging.DEBUG, logger="adaptdl._reducer")
    port = free_port()
    rank0 = _join_rank0(port, replicas=3)
    # Rank 0 must have joined before the early operation fails the job, or it
    # would find the server gone.
    deadline = time.monotonic() + 60
    while "rank 0 joined" not in caplog.text:
        assert time.monotonic() < deadline, "rank 0 never joined"
        time.sleep(0.01)
    hello = {"type": "hello", "version": 1, "rank": 1, "replicas": 3, "token": "secret"}
    early = _reducer.encode_pickle(("op", 0, "allreduce", 1))
    sock = _once_listening(lambda: socket.create_connection(("127.0.0.1", port), timeout=5))
    with sock:
        _reducer.send_frame(sock, [_json_frame(hello)])
        _reducer.send_frame(sock, early)
        with pytest.raises(ReducerConnectError) as info:
            rank0.result(timeout=10)
    assert "rank 1 sent an operation before every rank had joined" in str(info.value)


def _mixed_reducer_job() -> list[Any]:
    from adaptdl import env

    reducer = Reducer(
        env.replica_rank(),
        env.num_replicas(),
        env.master_addr(),
        env.master_port(),
        token=env.job_token(),
        connect_timeout=30,
    )
    rank = reducer.rank
    out: list[Any] = []
    pending = reducer.allreduce_async(collections.Counter({rank: 1, "all": 1}))
    out.append(reducer.broadcast(rank + 100))
    out.append(dict(pending.result()))
    # A training-loop-like pattern: start the next op before consuming the last.
    previous = reducer.allreduce_async(0)
    for step in range(1, 20):
        current = reducer.allreduce_async(step * (rank + 1))
        out.append(previous.result())
        previous = current
    out.append(previous.result())
    reducer.close()
    return out


def test_three_processes_mixing_async_broadcast_and_counters() -> None:
    from adaptdl.testing import run_elastic

    results = run_elastic(_mixed_reducer_job, 3, timeout=60).generations[0].results
    expected = [100, {0: 1, 1: 1, 2: 1, "all": 3}] + [6 * s for s in range(20)]
    assert results == [expected] * 3


def test_a_server_that_hangs_up_during_the_handshake_fails_fast() -> None:
    # Retrying is for a reducer this process has just closed (teardown, then
    # initialize); anything else hanging up is a wrong port: say so at once.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def hang_up() -> None:
        conn, _ = listener.accept()
        conn.close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(ReducerConnectError, match="during the handshake"):
        Reducer(1, 2, "127.0.0.1", port, connect_timeout=20)
    assert time.monotonic() - start < 5
    listener.close()


@pytest.mark.parametrize(
    "greeting",
    [b"SSH-2.0-OpenSSH_8.9\r\n", b"P\0\0\0\0\0\0\0\x05hello", b"J\0\0\0\0\0\0\0\x02\xff\xfe"],
)
def test_a_service_that_speaks_first_is_named_as_the_wrong_port(greeting: bytes) -> None:
    # The SSH banner was read as a frame of ~6e18 bytes (a bare MemoryError);
    # others gave a "corrupt reducer frame" that named neither port nor variable.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def greet() -> None:
        conn, _ = listener.accept()
        conn.sendall(greeting)
        time.sleep(2)
        conn.close()

    thread = threading.Thread(target=greet, daemon=True)
    thread.start()
    with pytest.raises(
        ReducerConnectError, match="unexpected handshake reply from .*ADAPTDL_MASTER_PORT"
    ):
        Reducer(1, 2, "127.0.0.1", port, connect_timeout=10)
    listener.close()
