"""SQLite state of the local cluster: jobs, their replica groups and events.

Everything the daemon knows lives in ``<home>/state.db``, written before the
daemon acts on it, so a daemon killed at any instant (even ``kill -9``) can be
started again and find every job: the replica process ids it had launched, the
restart group they belong to, the allocation, hints and failure count.
SQLite's write-ahead log keeps concurrent readers (request threads) from
blocking the controller.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["STORE_FILE", "EventRow", "JobRow", "Store", "StoreError", "private_dir"]

#: The local cluster's job store, in its home.
STORE_FILE = "state.db"


def private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) and make it private when it is ours.

    The cluster home holds job tokens (``state.db``) and the admin token
    (``daemon.json``), so other users must not be able to read or list it. A
    directory owned by someone else is left alone (chmod would fail anyway).
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    token TEXT NOT NULL,
    phase TEXT NOT NULL,
    reason TEXT,
    message TEXT,
    submitted REAL NOT NULL,
    started REAL,
    completed REAL,
    allocation TEXT NOT NULL DEFAULT '[]',
    grp INTEGER NOT NULL DEFAULT -1,
    group_allocation TEXT NOT NULL DEFAULT '[]',
    group_started REAL,
    master_port INTEGER NOT NULL DEFAULT 0,
    replicas TEXT NOT NULL DEFAULT '[]',
    devices TEXT NOT NULL DEFAULT '[]',
    failures INTEGER NOT NULL DEFAULT 0,
    stop_reason TEXT,
    stop_time REAL,
    not_before REAL NOT NULL DEFAULT 0,
    hints TEXT,
    attained REAL NOT NULL DEFAULT 0,
    batch_size INTEGER,
    goodput REAL,
    deleted INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events (job, id);
"""

_JSON_COLUMNS = ("spec", "allocation", "group_allocation", "replicas", "devices", "hints")


@dataclass
class JobRow:
    """One row of the ``jobs`` table, with JSON columns decoded.

    ``replicas`` holds one ``{"pid", "start", "rank"}`` record per launched
    replica of the current group (``start`` is the kernel's process start time,
    which tells a re-used pid from ours after a daemon restart).
    """

    name: str
    spec: dict[str, Any]
    token: str
    phase: str
    submitted: float
    reason: str | None = None
    message: str | None = None
    started: float | None = None
    completed: float | None = None
    allocation: list[str] = field(default_factory=list)
    grp: int = -1
    group_allocation: list[str] = field(default_factory=list)
    group_started: float | None = None
    master_port: int = 0
    replicas: list[dict[str, Any]] = field(default_factory=list)
    #: GPU identifiers (``CUDA_VISIBLE_DEVICES`` values; ints in older state).
    devices: list[int | str] = field(default_factory=list)
    failures: int = 0
    stop_reason: str | None = None
    stop_time: float | None = None
    not_before: float = 0.0
    hints: dict[str, Any] | None = None
    attained: float = 0.0
    batch_size: int | None = None
    goodput: float | None = None
    deleted: int = 0


@dataclass(frozen=True)
class EventRow:
    """One row of the ``events`` table."""

    job: str
    time: float
    kind: str
    message: str


_COLUMNS = tuple(f.name for f in fields(JobRow))


class StoreError(ValueError):
    """``state.db`` exists but is no job store (corrupt, or another file)."""


class Store:
    """Thread-safe access to ``state.db``.

    One connection is shared behind a lock: the daemon's write rate is tiny
    (a few rows per second), and a single writer avoids ``database is locked``
    retries entirely.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Job tokens live here: owner-only before SQLite writes the first byte
        # (its -wal and -shm files inherit the database file's mode).
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        if self.path.stat().st_mode & 0o077:
            os.chmod(self.path, 0o600)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(
            str(self.path), check_same_thread=False, isolation_level=None, timeout=30.0
        )
        self._conn.row_factory = sqlite3.Row
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise StoreError(
                f"{self.path} is not a readable job store ({exc}); move it aside (e.g. to "
                f"{self.path.name}.bad) to start with no jobs, or put a backup in its place"
            ) from exc

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group several writes so a crash leaves all or none of them."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                # Some errors (SQLITE_FULL) roll back by themselves; a second
                # ROLLBACK would hide the real error behind "no transaction".
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            try:
                self._conn.execute("COMMIT")
            except BaseException:
                # A failed COMMIT (disk full) leaves the transaction open, and
                # every later BEGIN would fail with "within a transaction".
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def insert(self, row: JobRow) -> None:
        """Add a job.

        Raises:
            sqlite3.IntegrityError: a job with that name exists.
        """
        values = [_encode(name, getattr(row, name)) for name in _COLUMNS]
        placeholders = ", ".join("?" for _ in _COLUMNS)
        with self._lock:
            self._conn.execute(
                f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({placeholders})", values
            )

    def get(self, name: str) -> JobRow | None:
        """The job named ``name``, or None."""
        with self._lock:
            cur = self._conn.execute("SELECT * FROM jobs WHERE name = ?", (name,))
            record = cur.fetchone()
        return _decode(record) if record is not None else None

    def all(self, *, active_only: bool = False) -> list[JobRow]:
        """Every job, in submission order; with ``active_only`` the unfinished ones.

        The controller reads the active jobs every tick: filtering in SQL
        keeps that cheap however many finished jobs the history holds.
        """
        where = " WHERE phase NOT IN ('Succeeded', 'Failed')" if active_only else ""
        with self._lock:
            records = self._conn.execute(
                f"SELECT * FROM jobs{where} ORDER BY submitted, name"  # noqa: S608 - constant
            ).fetchall()
        return [_decode(record) for record in records]

    def update(self, name: str, **values: Any) -> None:
        """Set columns of one job."""
        unknown = set(values) - set(_COLUMNS)
        if unknown:
            raise ValueError(f"unknown job columns: {sorted(unknown)}")
        assignments = ", ".join(f"{key} = ?" for key in values)
        params = [_encode(key, value) for key, value in values.items()] + [name]
        with self._lock:
            self._conn.execute(f"UPDATE jobs SET {assignments} WHERE name = ?", params)

    def remove(self, name: str) -> None:
        """Forget a job and its events."""
        with self.transaction():
            self._conn.execute("DELETE FROM jobs WHERE name = ?", (name,))
            self._conn.execute("DELETE FROM events WHERE job = ?", (name,))

    def add_event(self, job: str, kind: str, message: str, when: float | None = None) -> EventRow:
        """Append an event to a job's log and return it."""
        event = EventRow(job, time.time() if when is None else when, kind, message)
        with self._lock:
            self._conn.execute(
                "INSERT INTO events (job, time, kind, message) VALUES (?, ?, ?, ?)",
                (event.job, event.time, event.kind, event.message),
            )
        return event

    def events(self, job: str | None = None) -> list[EventRow]:
        """Events of one job (or all), oldest first."""
        with self._lock:
            if job is None:
                records = self._conn.execute("SELECT * FROM events ORDER BY id").fetchall()
            else:
                records = self._conn.execute(
                    "SELECT * FROM events WHERE job = ? ORDER BY id", (job,)
                ).fetchall()
        return [EventRow(r["job"], r["time"], r["kind"], r["message"]) for r in records]


def _encode(column: str, value: Any) -> Any:
    if column in _JSON_COLUMNS:
        return None if value is None else json.dumps(value)
    return value


def _decode(record: sqlite3.Row | Mapping[str, Any]) -> JobRow:
    values = {name: record[name] for name in _COLUMNS}
    for column in _JSON_COLUMNS:
        raw = values[column]
        values[column] = None if raw is None else json.loads(raw)
    return JobRow(**values)
