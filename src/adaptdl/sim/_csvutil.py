"""A CSV reader shared by the trace and workload readers.

Rows are checked against the header's width on the raw fields (a
``csv.DictReader`` merges duplicate empty header names and so cannot count
them), tolerating the empty trailing columns spreadsheets often export.
Rows with no text at all (blank lines, or only commas as spreadsheets save
emptied rows) are skipped, before the header as after it.

Parsing is strict: a quote left open would otherwise swallow every later
line into one field, silently, if that field's column is not used. Lines
are read with a length limit, so a file that is not a CSV (no line breaks)
fails at once instead of being read whole into memory.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

__all__ = [
    "FLOAT_RE",
    "MAX_LINE",
    "CsvTable",
    "describe_error",
    "duplicate_names",
    "not_utf8",
    "shown",
    "strict_float",
    "width_error",
]

#: Longest line read, in characters; far beyond any workload or trace row.
MAX_LINE = 1 << 20

#: float()'s syntax minus underscores and non-ASCII digits, which in a
#: hand-edited file are far more likely a typo than intended; inf and nan
#: parse, so that range checks report them as out of range.
FLOAT_RE = re.compile(
    r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)",
    re.IGNORECASE,
)

#: Most bytes re-read to locate an undecodable byte (CSV inputs are far smaller).
_MAX_REREAD = 1 << 28


def strict_float(raw: str) -> float:
    """``float(raw)`` for ASCII decimal numbers; NaN for anything else."""
    text = raw.strip()
    return float(text) if FLOAT_RE.fullmatch(text) else float("nan")


def not_utf8(path: Path, exc: UnicodeDecodeError) -> str:
    """``"path:line: not UTF-8 text (...)"`` for a decoding error while reading ``path``.

    A text stream decodes in blocks, so ``exc`` only knows the offset within
    one block; the file is read again to find the line and the offset in
    the file. A stream that cannot be read again (a pipe) gets no line.
    """
    try:
        with path.open("rb") as handle:
            data = handle.read(_MAX_REREAD)
        data.decode("utf-8-sig")
    except UnicodeDecodeError as found:
        start = found.start
        line = data.count(b"\n", 0, start) + 1
        return f"{path}:{line}: not UTF-8 text (byte {data[start]:#04x} at offset {start})"
    except OSError:
        pass
    return f"{path}: not UTF-8 text ({exc.reason})"


def shown(raw: str, limit: int = 40) -> str:
    """``repr(raw)``, shortened for a message when the value is long."""
    if len(raw) <= limit:
        return repr(raw)
    return f"{raw[: limit // 2]!r}... ({len(raw)} characters)"


def _bounded_lines(handle: IO[str]) -> Iterator[str]:
    """The lines of ``handle``, refusing one longer than :data:`MAX_LINE`."""
    while True:
        line = handle.readline(MAX_LINE + 1)
        if not line:
            return
        if len(line) > MAX_LINE:
            raise csv.Error(f"a line longer than {MAX_LINE} characters: is this a CSV file?")
        yield line


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


def describe_error(exc: csv.Error) -> str:
    """What a csv.Error means, for a message that also names the line."""
    text = str(exc)
    if "unexpected end of data" in text:
        return "a quote opened in this row is never closed (it runs to the end of the file)"
    if "expected after" in text:
        return f"text after a closing quote ({text}): quote the whole field, doubling inner quotes"
    return f"malformed CSV ({text})"


def _is_blank(fields: list[str]) -> bool:
    """Whether a row holds no text: a blank line, or only separators and spaces."""
    return not any(field.strip() for field in fields)


class CsvTable:
    """The header and rows of a CSV file opened with ``newline=""``.

    Attributes:
        header: The first non-blank row (None when the file has none).
        header_line: Line of the file the header ended on (1 without one).

    Raises:
        csv.Error: from the constructor and :meth:`rows`, for malformed CSV;
            :attr:`error_line` then tells where the offending row began, and
            :func:`describe_error` says what is wrong in words.
    """

    def __init__(self, handle: IO[str]) -> None:
        self._reader = csv.reader(_bounded_lines(handle), strict=True)
        self.header: list[str] | None = None
        self.header_line = 1
        self.error_line = 1
        for fields in self._records():
            if not _is_blank(fields):
                self.header, self.header_line = fields, self._reader.line_num
                break

    def _records(self) -> Iterator[list[str]]:
        """The reader's records, noting the line each starts on."""
        while True:
            self.error_line = self._reader.line_num + 1
            try:
                fields = next(self._reader)
            except StopIteration:
                return
            yield fields

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
        for fields in self._records():
            if _is_blank(fields):
                continue
            misshapen = any(names[len(fields) :]) or any(f.strip() for f in fields[width:])
            yield dict(zip(names, fields)), (len(fields) if misshapen else None)
