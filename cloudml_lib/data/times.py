"""Dates and times of an ER-2 flight: the flight's date (from the CPL file's name or the flight's name),
times in any of the files' formats to epoch seconds (UTC), Julian days, and each lidar profile matched to
the nearest camera frame in time."""

from __future__ import annotations

import calendar
import datetime as dt
import logging
import re
from pathlib import Path

import numpy as np

from cloudml_lib.base.config import FlightConfig
from cloudml_lib.base.errors import DataError

log = logging.getLogger(__name__)


STRAY_TIME_S = 86400.0  # epoch times further than this from the flight's median are strays


CPL_DATE = re.compile(r"_(\d{2})([a-z]{3})(\d{2})\.hdf5?$", re.IGNORECASE)


MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m}


def cpl_file_date(date: dt.date) -> str:
    """A date as a CPL file name writes it (10feb25): what `date_from_cpl_name` reads."""
    return f"{date.day:02d}{calendar.month_abbr[date.month].lower()}{date.year % 100:02d}"


def date_from_cpl_name(name: str) -> dt.date | None:
    m = CPL_DATE.search(name.replace("*", ""))
    if not m or m.group(2).lower() not in MONTHS:
        return None
    try:
        return dt.date(2000 + int(m.group(3)), MONTHS[m.group(2).lower()], int(m.group(1)))
    except ValueError:
        return None


def flight_date(flight: FlightConfig) -> dt.date:
    """The flight's UTC date: `date` if given, else from the CPL file name (..._10feb25.hdf5)."""
    if flight.date:
        try:
            return dt.date.fromisoformat(flight.date)
        except ValueError:
            raise DataError(f"flight {flight.name}: date {flight.date!r} is not YYYY-MM-DD") from None
    date = date_from_cpl_name(Path(flight.cpl_file).name)
    if date is None:
        raise DataError(
            f"flight {flight.name}: cannot read the date from CPL file name {flight.cpl_file!r} "
            "(expected it to end like _10feb25.hdf5); set data.flights[].date: YYYY-MM-DD"
        )
    return date


def utc_text(t: float) -> str:
    return f"{dt.datetime.fromtimestamp(float(t), dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def midnight_epoch(date: dt.date) -> float:
    return float(calendar.timegm(date.timetuple()))


def to_epoch_seconds(t: np.ndarray, fmt: str, date: dt.date, where: str) -> tuple[np.ndarray, str, int]:
    """Seconds since 1970 from epoch seconds or seconds of day (unwrapped across midnight).

    Returns (times with NaN where a value is unusable, the format used, how many were unusable).
    `auto` decides from the median of the positive finite values, so a stray 0, a fill value or a
    few outliers cannot tip it; in epoch format, values more than a day from that median are strays.
    """
    t = np.asarray(t, dtype=np.float64).reshape(-1)
    positive = np.isfinite(t) & (t > 0)
    if not positive.any():
        raise DataError(f"{where}: no usable time values (all are zero, negative or not finite)")
    median = float(np.median(t[positive]))
    if fmt == "auto":
        if median > 1e8:
            fmt = "epoch"
        elif median < 2 * 86400:
            fmt = "seconds_of_day"
        else:
            raise DataError(
                f"{where}: cannot tell the time format from values around {median:.1f}; expected "
                "epoch seconds (> 1e8) or seconds of day (0..86400); set data.ir_time_format"
            )
    looks = "epoch" if median > 1e8 else "seconds_of_day" if median < 2 * 86400 else "neither"
    if fmt != looks:  # only a forced format can disagree with the values
        raise DataError(
            f"{where}: data.ir_time_format is '{fmt}', but the values (median {median:.1f}) are "
            + (
                "epoch seconds"
                if looks == "epoch"
                else "seconds of day"
                if looks == "seconds_of_day"
                else "neither epoch seconds (> 1e8) nor seconds of day (0..172800)"
            )
            + f". Set data.ir_time_format: auto (detects it){'' if looks == 'neither' else f' or {looks}'}."
        )
    out = np.full(t.shape, np.nan)
    if fmt == "epoch":
        ok = positive & (np.abs(t - median) <= STRAY_TIME_S)
        out[ok] = t[ok]
    else:
        ok = np.isfinite(t) & (t >= 0) & (t < 2 * 86400)
        v = t[ok]
        wraps = np.concatenate([[0.0], np.cumsum(np.diff(v) < -43200.0)]) * 86400.0
        out[ok] = midnight_epoch(date) + v + wraps
    return out, fmt, int((~ok).sum())


def julian_to_epoch(julian_day: np.ndarray, year: int) -> np.ndarray:
    """Decimal day of year (1.0 = 1 January 00:00 UTC) to epoch seconds; fill values become NaN."""
    jd = np.asarray(julian_day, dtype=np.float64)
    jd = np.where(np.isfinite(jd) & (jd >= 1.0) & (jd < 368.0), jd, np.nan)
    return midnight_epoch(dt.date(year, 1, 1)) + (jd - 1.0) * 86400.0


def match_to_frames(
    label_t: np.ndarray, frame_t: np.ndarray, tolerance_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """Nearest frame (with a usable time) for each label time; returns (frame index, matched mask)."""
    usable = np.flatnonzero(np.isfinite(frame_t))
    if usable.size == 0:
        return np.zeros(len(label_t), int), np.zeros(len(label_t), bool)
    order = usable[np.argsort(frame_t[usable], kind="stable")]
    sorted_t = frame_t[order]
    lt = np.where(np.isfinite(label_t), label_t, -np.inf)
    pos = np.clip(np.searchsorted(sorted_t, lt), 1, max(sorted_t.size - 1, 1))
    left, right = sorted_t[pos - 1], sorted_t[np.minimum(pos, sorted_t.size - 1)]
    use_left = np.abs(lt - left) <= np.abs(lt - right)
    nearest = order[np.where(use_left, pos - 1, np.minimum(pos, sorted_t.size - 1))]
    ok = np.abs(frame_t[nearest] - lt) <= tolerance_s
    return nearest, ok
