"""The daemon's state database: transactions leave all or nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from adaptdl.cluster._store import JobRow, Store


class _FailingCommit:
    """A connection whose next COMMIT fails, as on a disk that just filled up."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.fail = True

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == "COMMIT" and self.fail:
            self.fail = False
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)


def _row(name: str) -> JobRow:
    return JobRow(name=name, spec={}, token="t", phase="Pending", submitted=0.0)


def test_a_failed_commit_rolls_back_and_later_transactions_work(tmp_path: Path) -> None:
    # The transaction stayed open: every later write failed with "cannot
    # start a transaction within a transaction".
    store = Store(tmp_path / "state.db")
    real = store._conn
    store._conn = _FailingCommit(real)  # type: ignore[assignment]
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        with store.transaction():
            store.insert(_row("a"))
    assert not real.in_transaction and store.get("a") is None
    with store.transaction():
        store.insert(_row("b"))
    assert [row.name for row in store.all()] == ["b"]
    store._conn = real
    store.close()
