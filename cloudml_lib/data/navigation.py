"""The navigation of an ER-2 flight per camera frame: sun zenith and azimuth, position and heading.

- The users' HDF nav file has no time axis: nav row i is IR frame i, and its arrays may be longer or
  shorter than the frames.
- Public ICARTT nav text (`*_MetNav_ER2_*.ict`) has one and is matched by time. An ICARTT file is checked
  before it is trusted: its date is what most of the header (line 7), the file name and a Day_Of_Year column
  say (a real NASA file's header is 56 days off); a record is used only with a time in 0..2 days after that
  date's 00 UTC, in order, and physically possible sun angles, none a declared fill value.
- The heading (IWG1 True_Hdg) lets the flip mirror the sun azimuth across the flight axis; without it
  flips are off for the flight. A flight whose frames mostly find no nav record is judged by
  `nav_match_problem`."""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cloudml_lib.base import files
from cloudml_lib.base.config import DataConfig, FlightConfig
from cloudml_lib.base.errors import CloudMLError, DataError
from cloudml_lib.data import ict, sun
from cloudml_lib.data.hdf5 import numbers, open_h5
from cloudml_lib.data.times import flight_date, match_to_frames, midnight_epoch, to_epoch_seconds, utc_text

log = logging.getLogger(__name__)


NAV_MATCH_TOLERANCE_S = 2.0


# ICARTT Time_Start counts seconds from 00 UTC of the file's date and goes past 86,400 on a flight that
# crosses midnight; no ER-2 flight lasts two days, so a time beyond that (or below 0) is not this flight's.
ICARTT_MAX_SECONDS = 2 * 86400.0


# Records whose time steps back or repeats are dropped (and counted) up to this share of the timed records;
# more means a file joined or sorted wrongly, whose records cannot be trusted to be matched by time.
MAX_OUT_OF_ORDER = 0.01


ICARTT_DAY_COLUMNS = ("Day_Of_Year", "DOY", "Julian_Day")


# In the cache key of a flight with ICARTT nav (cache.py): 2, records checked and dated by most of the header,
# the file name and Day_Of_Year (caches built before may hold angles of the wrong day). CloudML's own reader
# (ict.py) reads the values the icartt package read (tests/test_icartt.py), so the key stays.
ICARTT_READER = 2


ICARTT_NAME_DATE = re.compile(r"_(\d{8})(?:\d{2}){0,3}(?=[_.])")  # ..._YYYYMMDD[hh[mm[ss]]]_R0.ict


# What is physically possible, not a tidy range: the zenith goes past 90 deg with the sun at or below the
# horizon (92 in a real file: kept); azimuth and heading come as 0..360 or as -180..180.
NAV_RANGES = {
    "sza": (0.0, 180.0),
    "saa": (-180.0, 360.0),
    "heading": (-180.0, 360.0),
    "lat": (-90.0, 90.0),
    "lon": (-180.0, 360.0),
}


NAV_WORDS = {"sza": "solar zenith", "saa": "sun azimuth"}


NAV_COLUMNS = (
    ("sza", "nav_zenith", "ict_zenith"),
    ("saa", "nav_azimuth", "ict_azimuth"),
    ("lat", "nav_lat", "ict_lat"),
    ("lon", "nav_lon", "ict_lon"),
    ("heading", "nav_heading", "ict_heading"),
)


@dataclass
class Nav:
    """Nav values per IR frame (NaN where unknown), the frames the file covers, and where the heading came
    from."""

    values: dict  # sza, saa, lat, lon, heading, altitude (m) -> (n_frames,)
    covered: np.ndarray  # (n_frames,) bool
    heading_note: str  # "nav/trueHdg", or why there is none
    matched: int = 0  # IR frames with a usable time that found a nav record (by time, or a row)
    timed: int = 0  # IR frames with a usable time
    by_time: bool = False  # matched by time (else nav row i is frame i)
    span_note: str = ""  # where the nav records lie against the frames (by time only), for a message


def is_icartt(path: Path) -> bool:
    return Path(path).suffix.lower() == ".ict"


ICARTT_LIMIT = 512 << 20  # a day's MetNav at 1 Hz is ~15 MB: a larger .ict is not a nav file


def _clean_text(raw: bytes) -> tuple[str, list[str]] | None:
    """The file's text when it needs cleaning before the parser sees it (None: it reads as it is), and what
    was cleaned: a UTF-8 byte-order mark, lines that are not UTF-8 (read as Latin-1, as such bytes in a
    comment mostly are)."""
    notes = []
    if raw.startswith(b"\xef\xbb\xbf"):
        raw, notes = raw[3:], ["a UTF-8 byte-order mark"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        lines, latin = [], []
        for i, line in enumerate(raw.split(b"\n"), 1):
            try:
                lines.append(line.decode("utf-8"))
            except UnicodeDecodeError:
                lines.append(line.decode("latin-1"))
                latin.append(i)
        text = "\n".join(lines)
        shown = ", ".join(map(str, latin[:5])) + (" ..." if len(latin) > 5 else "")
        notes.append(f"bytes that are not UTF-8 on line(s) {shown}, read as Latin-1")
    return (text, notes) if notes else None


def _parse_icartt(path: Path, flight: FlightConfig) -> ict.Ict:
    """The ICARTT 1001 file at `path` (ict.read_text), with at least one data record."""
    try:
        raw = files.read_bytes(path, ICARTT_LIMIT)
    except CloudMLError as e:
        raise DataError(f"flight {flight.name}: {e}") from None
    except OSError as e:
        raise DataError(f"flight {flight.name}: cannot read {path} ({e.strerror or e})") from None
    cleaned = _clean_text(raw)
    try:
        found = ict.read_text(raw.decode("utf-8") if cleaned is None else cleaned[0])
    except ict.IcarttError as e:
        raise DataError(
            f"flight {flight.name}: cannot read {path} as ICARTT 1001 nav ({e}); is it a complete "
            "*_MetNav_ER2_*.ict file?"
        ) from None
    if found.raw is None or found.raw.shape[0] == 0:
        raise DataError(
            f"flight {flight.name}: {path} holds no data records (its header only); is the download "
            "complete? Replace the file, or set data.angles_source: cpl to take the sun angles from the CPL "
            "file"
        )
    if cleaned is not None:
        log.info("flight %s: %s read despite %s", flight.name, path.name, " and ".join(cleaned[1]))
    return found


def _icartt_columns(
    found: ict.Ict, path: Path, flight: FlightConfig, data: DataConfig
) -> tuple[dict, str | None]:
    """The nav columns (fill values as NaN: ict.Ict.values) under our names, plus "time" and "day"
    (Day_Of_Year, None when absent), and the heading column's name (None when absent)."""
    present = {n.lower(): n for n in found.names}

    def column(names: str, key: str | None) -> tuple[np.ndarray | None, str | None]:
        for name in names.split("|"):
            if name.strip().lower() in present:
                real = present[name.strip().lower()]
                return found.values(real), real
        if key is not None:
            raise DataError(
                f"flight {flight.name}: {path} has no column {names!r} (data.keys.{key}); columns present: "
                f"{', '.join(found.names)}"
            )
        return None, None

    cols = {
        name: column(getattr(data.keys, key), key)[0] for name, _, key in NAV_COLUMNS if name != "heading"
    }
    cols["heading"], heading_name = column(data.keys.ict_heading, None)
    cols["altitude"] = column(data.keys.ict_altitude, None)[0]  # optional: bounds predicted heights
    cols["time"] = column(data.keys.ict_time, "ict_time")[0]
    cols["day"] = column("|".join(ICARTT_DAY_COLUMNS), None)[0]
    return cols, heading_name


def _date_in_name(name: str) -> dt.date | None:
    m = ICARTT_NAME_DATE.search(name)
    try:
        return dt.datetime.strptime(m.group(1), "%Y%m%d").date() if m else None
    except ValueError:
        return None


def _date_of_days(day: np.ndarray | None, seconds: np.ndarray, year: int) -> dt.date | None:
    """The date a Day_Of_Year column gives the records of the file's own day (Time_Start below 86,400 s;
    later records may already count the next day): the day most of them name."""
    if day is None:
        return None
    first = np.isfinite(seconds) & (seconds >= 0) & (seconds < 86400) & (day >= 1) & (day <= 366)
    if not first.any():
        return None
    values, counts = np.unique(np.round(day[first]), return_counts=True)
    date = dt.date(year, 1, 1) + dt.timedelta(days=int(values[counts.argmax()]) - 1)
    return date if date.year == year else None


def icartt_date(path: Path, flight: FlightConfig, header: dt.date, seconds, day) -> dt.date:
    """The date Time_Start counts from. ICARTT states it three times: the header (line 7), the file name
    (..._YYYYMMDD_R0.ict) and, in MetNav files, a Day_Of_Year column; a real NASA file's header is 56 days
    off while the other two agree. Most of them decide (a WARNING names the file, the header's date and the
    date used); on a tie the flight's own date decides, else the file is refused."""
    named = _date_in_name(path.name)
    by_day = _date_of_days(day, seconds, (named or header).year)
    day_column = f"its Day_Of_Year column (day {by_day.timetuple().tm_yday})" if by_day else ""
    candidates = {"the header (line 7)": header, "the file name": named, day_column: by_day}
    said: dict[str, dt.date] = {who: d for who, d in candidates.items() if d is not None}
    votes = Counter(said.values())
    date, n = votes.most_common(1)[0]
    if len(votes) == 1:
        return date
    told = "; ".join(f"{who} says {d}" for who, d in said.items())
    why = f"{n} of {len(said)} agree"
    if n == 1:  # no two agree: a tie
        own: dt.date | None
        try:
            own, why = flight_date(flight), "the flight's own date decides"
        except DataError:
            own = None
        if own is None or own not in votes:
            raise DataError(
                f"flight {flight.name}: {path}: cannot tell which day its times count from: {told}"
                + (f"; the flight's date is {own}" if own else "")
                + ". Make them agree (line 7 of the header is the UTC date of the first record), or check "
                "that the nav file belongs to this flight."
            )
        date = own
    log.warning(
        "flight %s: %s: the header's date (line 7) is %s, but the dates disagree (%s); its records are dated "
        "%s (%s). If that is wrong, correct line 7 of the header or the file name.",
        flight.name,
        path,
        header,
        "; ".join(f"{who} says {d}" for who, d in said.items() if who != "the header (line 7)"),
        date,
        why,
    )
    return date


def _out_of_order(seconds: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Records (among `ok`) whose time is not after every earlier one: a step back or a repeat."""
    index = np.flatnonzero(ok)
    latest = np.maximum.accumulate(seconds[index])
    back = np.zeros(seconds.size, bool)
    back[index[1:]] = seconds[index[1:]] <= latest[:-1]
    return back


def check_records(
    cols: dict, path: Path, flight: FlightConfig, first_line: int, demo: bool = False
) -> np.ndarray:
    """Which records are usable: a time (seconds from 00 UTC of the file's date) in 0..2 days and after every
    earlier record, a sun zenith of 0..180 deg and an azimuth of -180..360 deg, none a fill value. Position
    and heading outside their ranges become NaN (no flip there). Refuses a file with no usable record, or
    whose times step back often; warns with the share usable and why the others are not."""
    t, n = cols["time"], cols["time"].size
    reasons = {
        "no time (fill value or not a number)": ~np.isfinite(t),
        f"a time outside 0..{ICARTT_MAX_SECONDS:.0f} s": np.isfinite(t)
        & ((t < 0) | (t >= ICARTT_MAX_SECONDS)),
    }
    timed = np.isfinite(t) & (t >= 0) & (t < ICARTT_MAX_SECONDS)
    back = _out_of_order(t, timed)
    if back.sum() > MAX_OUT_OF_ORDER * max(int(timed.sum()), 1):
        i = int(np.flatnonzero(back)[0])
        raise DataError(
            f"flight {flight.name}: {path}: Time_Start steps back or repeats in {int(back.sum())} of {n} "
            f"records (first at record {i + 1}, line {first_line + i}: {t[i]:g} s after "
            f"{np.max(t[:i][timed[:i]]):g} s); the records must be in time order, or frames would get "
            "another record's angles. Is it two files joined, or sorted by another column? Use the file as "
            "published."
        )
    reasons["a time not after the record before it"] = back
    for name, (low, high) in NAV_RANGES.items():
        v = cols[name]
        if v is None:
            continue
        bad = np.isfinite(v) & ((v < low) | (v > high))
        if name in ("sza", "saa"):
            word = NAV_WORDS[name]
            reasons[f"no {word} (fill value or not a number)"] = ~np.isfinite(v)
            reasons[f"a {word} outside {low:g}..{high:g} deg"] = bad
        v[bad] = np.nan
    usable = ~np.logical_or.reduce(list(reasons.values()))
    said = ", ".join(f"{int(m.sum())} with {why}" for why, m in reasons.items() if m.any())
    if not usable.any():
        raise DataError(
            f"flight {flight.name}: {path} has no usable nav record: of its {n} records, {said}. Valid: "
            f"Time_Start 0..{ICARTT_MAX_SECONDS:.0f} s (from 00 UTC of the header's date), increasing; solar "
            "zenith 0..180 deg; sun azimuth -180..360 deg; none the declared fill value. Replace the file "
            "(a complete *_MetNav_ER2_*.ict), or set data.angles_source: cpl to take the sun angles from the "
            "CPL file."
        )
    if not usable.all():  # the demo's nav leaves records out on purpose (as real files do): no warning there
        (log.info if demo else log.warning)(
            "flight %s: %s: %d of %d nav records usable (%.1f%%); left out: %s. A frame takes the nearest "
            "usable record within %g s, else it has no nav",
            flight.name,
            path,
            int(usable.sum()),
            n,
            100 * usable.mean(),
            said,
            NAV_MATCH_TOLERANCE_S,
        )
    return usable


def _read_icartt(path: Path, flight: FlightConfig, data: DataConfig) -> tuple[dict, np.ndarray, str | None]:
    """Columns (heading None when absent), epoch times (NaN for a record that is not usable) and the heading
    column's name of an ICARTT nav file, its records checked (check_records) and dated (icartt_date)."""
    found = _parse_icartt(path, flight)
    cols, heading_name = _icartt_columns(found, path, flight, data)
    header = dt.date(*found.collected)
    date = icartt_date(path, flight, header, cols["time"], cols.pop("day"))
    usable = check_records(cols, path, flight, found.header_lines + 1, demo=_is_demo(found))
    seconds = cols.pop("time")
    epoch = np.where(usable, midnight_epoch(date) + seconds, np.nan)  # past 86,400 s after midnight: valid
    cols["saa"] = np.mod(cols["saa"], 360.0)  # -180..180 (the real files) and 0..360 agree after this
    check_sun(cols, epoch, path, flight, data, synthetic=_is_demo(found))
    return cols, epoch, heading_name


def _is_demo(found: ict.Ict) -> bool:
    """A nav file CloudML's demo wrote (synthetic.write_icartt_nav: its PI line and mission), whose sun
    angles are set per flight, not by the sun."""
    return found.pi == "CloudML demo" and found.mission == "DEMO"


def check_sun(
    cols: dict, epoch: np.ndarray, path: Path, flight: FlightConfig, data: DataConfig, synthetic=False
):
    """Warn when the file's sun angles do not agree with the sun at its times and positions (sun.compare,
    judged over the flight). Only words: no value read is changed, no record left out."""
    found = sun.compare(epoch, cols["lat"], cols["lon"], cols["sza"], cols["saa"])
    if found.agrees:
        if found.judged:
            log.info(
                "flight %s: %s: sun angles agree with the sun's position (%s)",
                flight.name,
                path.name,
                found.words(),
            )
        return
    if synthetic:
        log.info(
            "flight %s: %s: a demo file, its sun angles set per flight (%s)",
            flight.name,
            path.name,
            found.words(),
        )
        return
    keys = (
        f"data.keys.ict_zenith {data.keys.ict_zenith!r} and data.keys.ict_azimuth {data.keys.ict_azimuth!r}"
    )
    why = (
        f"they agree once exchanged: the zenith and azimuth columns look swapped; check {keys}"
        if found.swapped
        else f"check {keys} (the columns read), the time column and the latitude and longitude"
    )
    log.warning(
        "flight %s: %s: its sun angles do not match where the sun was at its times and positions: %s; %s. "
        "The angles are used as read.",
        flight.name,
        path,
        found.words(),
        why,
    )


def _read_hdf_nav(
    path: Path, flight: FlightConfig, data: DataConfig
) -> tuple[dict, np.ndarray | None, str | None]:
    k = data.keys
    with open_h5(path, flight.name) as f:
        cols: dict[str, np.ndarray | None] = {
            name: numbers(f, getattr(k, key), flight.name, key, "angles or coordinates in degrees").reshape(
                -1
            )
            for name, key, _ in NAV_COLUMNS
            if name != "heading"
        }
        has_heading = bool(k.nav_heading) and k.nav_heading in f
        cols["heading"] = (
            numbers(f, k.nav_heading, flight.name, "nav_heading", "a heading in degrees").reshape(-1)
            if has_heading
            else None
        )
        cols["altitude"] = (  # optional: bounds predicted heights
            numbers(f, k.nav_altitude, flight.name, "nav_altitude", "an altitude in metres").reshape(-1)
            if k.nav_altitude and k.nav_altitude in f
            else None
        )
        nav_t = (
            numbers(f, k.nav_time, flight.name, "nav_time", "times")
            if k.nav_time and k.nav_time in f
            else None
        )
    if nav_t is not None:
        nav_t, _, _ = to_epoch_seconds(
            nav_t, "auto", flight_date(flight), f"flight {flight.name}: {path} '{k.nav_time}'"
        )
    return cols, nav_t, k.nav_heading if has_heading else None


def read_nav(flight: FlightConfig, data: DataConfig, path: Path, frame_t: np.ndarray) -> Nav:
    """Sun angles, position and heading per IR frame: matched by time when the nav file has a time axis (an
    ICARTT file always has), else nav row i is frame i. A frame without a nav record keeps NaN values (angles
    are filled later, and counted); a file without a heading gives NaN headings, and flips are off. How many
    frames found a record is in the result: `nav_match_problem` judges it."""
    icartt_file = is_icartt(path)
    cols, nav_epoch, heading_name = (_read_icartt if icartt_file else _read_hdf_nav)(path, flight, data)
    if heading_name is None:
        where = f"data.keys.{'ict_heading' if icartt_file else 'nav_heading'}"
        note = f"no heading ({where} {getattr(data.keys, where.split('.')[-1])!r} not in {path.name})"
        cols["heading"] = np.full(next(iter(cols.values())).size, np.nan)
    else:
        note = f"heading from {path.name} '{heading_name}'"
        cols["heading"] = np.mod(cols["heading"], 360.0)
    if cols.get("altitude") is None:  # aircraft altitude (m), where the file has it
        cols["altitude"] = np.full(cols["heading"].size, np.nan)
    lengths = {v.size for v in cols.values()}
    if len(lengths) != 1:
        raise DataError(
            f"flight {flight.name}: nav datasets in {path} have different lengths {sorted(lengths)}"
        )
    n_nav, timed = lengths.pop(), np.isfinite(frame_t)
    if nav_epoch is None:
        return _nav_by_row(flight, path, cols, n_nav, frame_t, note)
    if nav_epoch.size != n_nav:
        raise DataError(f"flight {flight.name}: {path}: {nav_epoch.size} times for {n_nav} nav rows")
    rows, ok = match_to_frames(frame_t, nav_epoch, NAV_MATCH_TOLERANCE_S)
    ok &= timed
    log.info(
        "flight %s: nav records of %s matched to IR frames by time (%d of %d frames within %g s)",
        flight.name,
        path.name,
        int(ok.sum()),
        frame_t.size,
        NAV_MATCH_TOLERANCE_S,
    )
    return Nav(
        {name: np.where(ok, v[rows], np.nan) for name, v in cols.items()},
        np.ones(frame_t.size, bool),
        note,
        int(ok.sum()),
        int(timed.sum()),
        True,
        _span_note(nav_epoch, frame_t),
    )


def _nav_by_row(
    flight: FlightConfig, path: Path, cols: dict, n_nav: int, frame_t: np.ndarray, note: str
) -> Nav:
    """A nav file without a time axis, as the users' files: nav row i is IR frame i."""
    n_frames = frame_t.size
    span = (
        f"the first {n_frames} of its {n_nav} rows used"
        if n_nav > n_frames
        else f"it covers frames 0..{n_nav - 1} of {n_frames}"
        if n_nav < n_frames
        else "same length"
    )
    log.info(
        "flight %s: %s has no time axis, as in the users' files: nav row i is taken to be IR frame i (%s)",
        flight.name,
        path.name,
        span,
    )
    out = {name: np.full(n_frames, np.nan) for name in cols}
    m = min(n_nav, n_frames)
    for name, v in cols.items():
        out[name][:m] = v[:m]
    covered, timed = np.arange(n_frames) < n_nav, np.isfinite(frame_t)
    return Nav(out, covered, note, int((covered & timed).sum()), int(timed.sum()))


def _span_note(nav_t: np.ndarray, frame_t: np.ndarray) -> str:
    """Where the nav records lie against the camera's frames, and by how many days when a date is off."""
    nav, frames = nav_t[np.isfinite(nav_t)], frame_t[np.isfinite(frame_t)]
    if not nav.size or not frames.size:
        return ""
    text = (
        f"; its records span {utc_text(nav.min())} .. {utc_text(nav.max())}, the camera's frames "
        f"{utc_text(frames.min())} .. {utc_text(frames.max())}"
    )
    days = int(np.round((np.median(nav) - np.median(frames)) / 86400.0))
    if days:
        text += (
            f": the nav lies {abs(days)} day{'s' if abs(days) > 1 else ''} "
            f"{'later' if days > 0 else 'earlier'}; check the date its times count from (in an ICARTT file: "
            "header line 7, the file name, Day_Of_Year)"
        )
    return text


def nav_match_problem(nav: Nav, flight: FlightConfig, data: DataConfig, path: Path) -> str | None:
    """What is wrong, in words, when fewer than data.min_nav_match of the flight's IR frames (those with a
    usable time) found a nav record; None when enough did. train refuses such a flight, labels flags it,
    predict warns."""
    if nav.timed == 0 or nav.matched >= data.min_nav_match * nav.timed:
        return None
    how = f"within {NAV_MATCH_TOLERANCE_S:g} s" if nav.by_time else "(a nav row)"
    share = 100 * nav.matched / nav.timed
    return (
        f"flight {flight.name}: only {nav.matched} of {nav.timed} IR frames ({share:.1f}%) found a nav "
        f"record in {path} {how}, fewer than data.min_nav_match ({data.min_nav_match:g})"
        f"{nav.span_note}. Check that the nav file belongs to this flight and its date, or set "
        "data.min_nav_match lower (0: any) to use the flight as it is: frames without nav get the training "
        "mean zenith and no sun direction."
    )


def heading_only(flight: FlightConfig, data: DataConfig, frame_t: np.ndarray) -> tuple[np.ndarray, str]:
    """With data.angles_source: cpl, the heading still comes from the nav file when the flight has one."""
    path = Path(data.dir) / flight.nav_file if flight.nav_file else None
    if path is None or not path.is_file():
        return np.full(frame_t.size, np.nan), "no heading (no nav file)"
    try:
        nav = read_nav(flight, data, path, frame_t)
    except DataError as e:  # the sun angles come from the CPL file: a bad nav file costs the heading only
        log.warning("%s; no heading from it, so flips are off for the flight", e)
        return np.full(frame_t.size, np.nan), f"no heading ({path.name} is not usable)"
    return nav.values["heading"], nav.heading_note
