"""A CSV reader shared by the trace and workload readers.

Rows are checked against the header's width on the raw fields (a
``csv.DictReader`` merges duplicate empty header names and so cannot count
them), tolerating the empty trailing columns spreadsheets often export.
Rows with no text at all (blank lines, or only commas as spreadsheets save
emptied rows) are skipped, before the header as after it.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator
from typing import IO

__all__ = ["CsvTable", "duplicate_names", "width_error"]


def duplicate_names(names: Iterable[str]) -> list[str]:
    """Header names given more than once, sorted; empty names are ignored."""
    seen: set[str] = set()
    duplicates: set[str] = set()
    for name in names:
        if name in seen:
            duplicates.add(name)
        elif name:
            seen.add(name)
    return sorted(duplicates)


def width_error(header: list[str], count: int) -> str:
    """Why a row of ``count`` fields does not fit ``header``, naming the columns."""
    message = f"expected {len(header)} fields, got {count}"
    if count < len(header):
        missing = ", ".join(name.strip() or "(unnamed)" for name in header[count:])
        return f"{message}: no value for column(s) {missing}"
    return f"{message}: {count - len(header)} more than the header's columns"


def _is_blank(fields: list[str]) -> bool:
    """Whether a row holds no text: a blank line, or only separators and spaces."""
    return not any(field.strip() for field in fields)


class CsvTable:
    """The header and rows of a CSV file opened with ``newline=""``.

    Attributes:
        header: The first non-blank row (None when the file has none).
        header_line: Line of the file the header ended on (1 without one).
    """

    def __init__(self, handle: IO[str]) -> None:
        self._reader = csv.reader(handle)
        self.header: list[str] | None = None
        self.header_line = 1
        for fields in self._reader:
            if not _is_blank(fields):
                self.header, self.header_line = fields, self._reader.line_num
                break

    @property
    def line_num(self) -> int:
        """Line of the file the last row ended on (for error messages)."""
        return self._reader.line_num

    def rows(self, names: list[str]) -> Iterator[tuple[dict[str, str], int | None]]:
        """Each non-blank row as ``names`` -> value, with its field count if misshapen.

        Args:
            names: The column names to key the values by (the header, usually
                stripped), one per header field.

        Yields:
            The row, and None when it fits the header; otherwise the number of
            fields it has. Missing fields under empty header names and empty
            extra fields are not counted as misshapen.
        """
        width = len(names)
        for fields in self._reader:
            if _is_blank(fields):
                continue
            misshapen = any(names[len(fields) :]) or any(f.strip() for f in fields[width:])
            yield dict(zip(names, fields)), (len(fields) if misshapen else None)
