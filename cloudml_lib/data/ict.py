"""Our own reader of ICARTT text files of format 1001 (one independent variable, the public ER-2 MetNav
`*_MetNav_ER2_*.ict`), written from the ICARTT 2.0 standard (NASA ESDS-RFC-029v2). CloudML used the `icartt`
package before; it is GPL-3.0-or-later, so CloudML (BSD-3-Clause) reads the format itself. The tests read the
real NASA file and the demo's with both and compare them value for value.

The header, line by line: (1) its line count and the format, "NLHEAD, 1001"; (2-5) PI, affiliation, data
source, mission; (6) volume "1, 1"; (7) the date the data were collected and the revision date, "yyyy, mm,
dd, yyyy, mm, dd"; (8) the data interval; (9) the independent variable ("Time_Start, seconds"); (10) the count
of dependent variables n; (11) their n scale factors; (12) their n missing-value flags; (13 ...) one line per
dependent variable ("name, units[, standard name[, long name]]"); then the special comments (a count, then
that many lines) and the normal comments (a count, then that many lines, "KEYWORD: value" such as ULOD_FLAG:
-7777, the last one naming the columns). The data follow the header: one record per line, values separated by
commas. A value is its number times its column's scale factor; a flag (the missing value, a limit-of-detection
flag) is compared before scaling."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field

import numpy as np

FORMAT = 1001
FIXED_LINES = 12  # header lines before the dependent variables' own lines
KEYWORD = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*:\s*(.*?)\s*$")


class IcarttError(ValueError):
    """A file that is not a readable ICARTT 1001 file; the message names the line and what was expected."""


@dataclass
class Ict:
    """An ICARTT 1001 file as read: its header's facts and its records' numbers as written (`raw`, one
    column per variable, the independent one first); `values` gives a variable's physical values."""

    collected: tuple[int, int, int]  # header line 7: the date Time_Start counts from (year, month, day)
    names: list[str]  # the independent variable, then the dependent ones, in file order
    units: dict[str, str]
    scale: dict[str, float]  # 1.0 for the independent variable
    missing: dict[str, float | None]  # the declared missing-value flag (None: not a number)
    pi: str = ""  # header line 2
    mission: str = ""  # header line 5
    keywords: dict[str, str] = field(default_factory=dict)  # the normal comments' KEYWORD: value lines
    raw: np.ndarray | None = None  # (records, variables): the numbers as written
    header_lines: int = 0

    def values(self, name: str) -> np.ndarray:
        """The values of `name`: its numbers times its scale factor, NaN where a number is a flag."""
        if self.raw is None:
            raise IcarttError(f"{name}: the file's numbers were not read")
        raw = self.raw[:, self.names.index(name)]
        out = raw * self.scale[name]
        out[np.isin(raw, self.flags(name))] = np.nan
        return out

    def flags(self, name: str) -> list[float]:
        """The raw numbers of `name` that mean "no value": the declared missing-value flag and the normal
        comments' limit-of-detection flags (ULOD_FLAG, LLOD_FLAG) where they are numbers."""
        declared = self.missing.get(name)
        out = [] if declared is None else [declared]
        for key in ("ULOD_FLAG", "LLOD_FLAG"):
            number = _number(self.keywords.get(key, ""))
            if number is not None:
                out.append(number)
        return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _most_common(values: list[float | None]) -> float | None:
    numbers = [v for v in values if v is not None]
    return max(numbers, key=numbers.count) if numbers else None


def _fields(line: str, n: int | None, what: str, at: int, kind=float) -> list:
    """`line`'s comma-separated values as `kind` (exactly `n` of them where n is given)."""
    parts = [p.strip() for p in line.split(",")]
    if parts and parts[-1] == "" and len(parts) > 1:
        parts = parts[:-1]  # a trailing comma
    if n is not None and len(parts) != n:
        raise IcarttError(f"line {at}: {what}: {n} value(s) expected, found {len(parts)} ({line.strip()!r})")
    try:
        return [kind(p) for p in parts]
    except ValueError:
        raise IcarttError(f"line {at}: {what}: numbers expected, found {line.strip()!r}") from None


def _variable(line: str, at: int) -> tuple[str, str]:
    """(name, units) of a variable line "name, units[, standard name[, long name]]"."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 2 or not parts[0]:
        raise IcarttError(f"line {at}: a variable's 'name, units' expected, found {line.strip()!r}")
    return parts[0], parts[1]


def _header(lines: list[str]) -> tuple[Ict, int]:
    """The header's contents and its line count."""
    if not lines:
        raise IcarttError("the file is empty")
    nlhead, ffi = _fields(lines[0], 2, "the header's line count and format, 'NLHEAD, 1001'", 1, int)
    if ffi != FORMAT:
        raise IcarttError(f"line 1: format {ffi}; only ICARTT format {FORMAT} (one time axis) is read")
    if nlhead < FIXED_LINES + 3 or nlhead > len(lines):
        raise IcarttError(f"line 1: a header of {nlhead} lines, but the file has {len(lines)} line(s)")
    head = lines[:nlhead]
    date = _fields(head[6], 6, "the collection and revision dates, 'yyyy, mm, dd, yyyy, mm, dd'", 7, int)
    try:
        dt.date(*date[:3])
    except ValueError as e:
        raise IcarttError(f"line 7: the collection date {date[:3]} is no date ({e})") from None
    time_name, time_units = _variable(head[8], 9)
    n = _fields(head[9], 1, "the count of dependent variables", 10, int)[0]
    if n < 1 or FIXED_LINES + n + 2 > nlhead:
        raise IcarttError(f"line 10: {n} dependent variables do not fit a header of {nlhead} lines")
    scales = _fields(head[10], n, "the scale factors", 11)
    missing = [_number(p.strip()) for p in head[11].split(",")][:n]
    if len(missing) != n:
        raise IcarttError(f"line 12: the missing-value flags: {n} expected, found {len(missing)}")
    variables = [_variable(head[FIXED_LINES + i], FIXED_LINES + i + 1) for i in range(n)]
    names = [time_name] + [v[0] for v in variables]
    if len(set(names)) != len(names):
        raise IcarttError(f"lines 9-{FIXED_LINES + n}: a variable name appears twice: {', '.join(names)}")
    ict = Ict(
        collected=tuple(date[:3]),
        names=names,
        units={time_name: time_units, **dict(variables)},
        scale={time_name: 1.0, **dict(zip(names[1:], scales))},
        # the time axis declares no flag and should hold none: a record whose time is the flag most of the
        # other columns declare (-9999) has no time
        missing={time_name: _most_common(missing), **dict(zip(names[1:], missing))},
        pi=head[1].strip(),
        mission=head[4].strip(),
        header_lines=nlhead,
    )
    ict.keywords = _keywords(head, FIXED_LINES + n)
    return ict, nlhead


def _keywords(head: list[str], at: int) -> dict[str, str]:
    """The normal comments' KEYWORD: value lines, after the special comments that start at line `at` + 1.
    Line 1's header length decides where the data start; a comment count that does not add up to it (real
    files have one line too few) is not an error."""
    special = _fields(head[at], 1, "the count of special comment lines", at + 1, int)[0]
    if special < 0 or at + 1 + special >= len(head):
        raise IcarttError(f"line {at + 1}: {special} special comment lines do not fit the header")
    at += 1 + special
    _fields(head[at], 1, "the count of normal comment lines", at + 1, int)
    found: dict[str, str] = {}
    for line in head[at + 1 : -1]:  # the last header line names the columns
        m = KEYWORD.match(line)
        if m:
            found.setdefault(m.group(1).upper(), m.group(2))
    return found


def read_text(text: str) -> Ict:
    """The ICARTT 1001 file whose text is `text`; IcarttError names the line of the first problem."""
    lines = text.splitlines()
    ict, nlhead = _header(lines)
    rows = []
    for i, line in enumerate(lines[nlhead:], nlhead + 1):
        if line.strip():
            rows.append(_fields(line, len(ict.names), "a data record", i))
    ict.raw = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(ict.names))
    return ict
