"""Reading one ER-2 flight: IR frame times, lidar labels, filters, label-to-frame matching, sun angles.

Frames themselves are read by the cache builder (cache.py) straight from the open HDF5 dataset;
this module returns everything else about a flight as small NumPy arrays. It reads the files as
they are (ER2_DATA.md, "Corrections from public evidence"):
- CPL `Profile_Decimal_Julian_Day` is (N, 3): first, mean and last time of each averaged profile;
  the mean is used. `Layer_Base_Altitude` is (N, 10) km with layer 0 the *top* layer and
  `Number_Layers` valid ones; `Lidar_Surface_Altitude` is in km.
- IR `Time/TimeUTC` is Unix epoch seconds, may hold a stray 0 or fill value, and may be longer
  than the frames.
- The nav file has no time axis: nav row i is IR frame i, and its arrays may be longer or
  shorter than the frames. Public ICARTT nav text (`*_MetNav_ER2_*.ict`) has one and is matched by
  time. The heading (IWG1 True_Hdg) lets the flip mirror the sun azimuth across the flight axis;
  without it flips are off for the flight.
Every missing file, dataset or inconsistent value raises DataError naming the flight, the file and the key.
"""
from __future__ import annotations

import calendar
import datetime as dt
import logging
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from cloudml_lib.config import MIN_FRAME_SIDE, DataConfig, FlightConfig
from cloudml_lib.errors import DataError

log = logging.getLogger(__name__)

FILL_BELOW = -999.0              # fill values such as -9999 mean "none"
NAV_MATCH_TOLERANCE_S = 2.0
TIME_COLUMNS = {"start": 0, "centre": 1, "end": 2}       # of Profile_Decimal_Julian_Day (N, 3)
OTHER_COLUMN = {"start": "centre", "centre": "start", "end": "centre"}   # compared against in the log
TIME_JUMP_S = 600.0              # a forward gap between two profiles larger than this is reported
LOW_MATCH_RATE = 0.5             # of the filtered profiles: fewer matched is a warning with the likely cause
LAYER_ORDER_TOLERANCE = 0.02     # share of multi-layer profiles that may contradict the configured order
STRAY_TIME_S = 86400.0           # epoch times further than this from the flight's median are strays
CPL_DATE = re.compile(r"_(\d{2})([a-z]{3})(\d{2})\.hdf5?$", re.IGNORECASE)
MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m}

# The order in which filters remove profiles; `counts` in FlightLabels and the cache use these names.
REMOVAL_REASONS = ("bad_time", "no_layer", "multi_layer", "out_of_range", "over_land", "bad_surface",
                   "unmatched", "duplicate_frame", "beyond_nav")


@dataclass
class FlightLabels:
    """The labelled frames of one flight, after filtering and matching."""
    name: str
    n_frames: int
    frame_shape: tuple[int, int]                 # raw (rows, cols)
    frame_index: np.ndarray                      # (N,) int, matched IR frame
    cbh_km: np.ndarray                           # (N,) float
    sza_deg: np.ndarray                          # (N,) float, NaN where the source has none
    saa_deg: np.ndarray                          # (N,)
    lat: np.ndarray                              # (N,)
    lon: np.ndarray                              # (N,)
    counts: dict = field(default_factory=dict)   # profiles seen and removed, by reason
    match: dict = field(default_factory=dict)    # match rate and time differences (match_statistics)
    heading_deg: np.ndarray | None = None        # (N,) aircraft true heading, NaN where none (flips off there)
    heading_note: str = ""                       # where the heading came from, or why there is none


# ------------------------------------------------------------------------------------ files

def required_roles(data: DataConfig) -> tuple[str, ...]:
    """The files a flight needs: the nav file only when the sun angles come from it."""
    return ("ir", "cpl", "nav") if data.angles_source == "nav" else ("ir", "cpl")


def _resolve(root: Path, name: str, flight: str) -> Path:
    """A path relative to data.dir, or a glob pattern (e.g. 10Feb25/CPL_L2_*.hdf5) matching one file."""
    if not any(ch in name for ch in "*?["):
        return root / name
    matches = sorted(root.glob(name))
    if len(matches) > 1:
        raise DataError(f"flight {flight}: pattern {name!r} matches {len(matches)} files in {root} "
                        f"({', '.join(m.name for m in matches[:5])}); make it match exactly one")
    return matches[0] if matches else root / name


def flight_paths(flight: FlightConfig, data: DataConfig) -> dict[str, Path]:
    root = Path(data.dir)
    return {role: _resolve(root, getattr(flight, f"{role}_file"), flight.name) for role in required_roles(data)}


def check_files(flight: FlightConfig, data: DataConfig) -> None:
    missing = [f"{role} file {p}" for role, p in flight_paths(flight, data).items() if not p.is_file()]
    if missing:
        raise DataError(f"flight {flight.name}: missing {'; '.join(missing)}. Put the file in data.dir "
                        f"({data.dir}), fix its name in data.flights, or remove the flight from data.flights.")


@contextmanager
def open_h5(path: Path, flight: str):
    try:
        f = h5py.File(path, "r")
    except FileNotFoundError:
        raise DataError(f"flight {flight}: file not found: {path}") from None
    except OSError as e:
        raise DataError(f"flight {flight}: cannot read {path} as HDF5 ({e}); is the file complete?") from None
    try:
        yield f
    finally:
        f.close()


def dataset(f: h5py.File, key: str, flight: str, config_key: str) -> h5py.Dataset:
    if key not in f or not isinstance(f[key], h5py.Dataset):
        present = []
        f.visit(lambda name: present.append(name) if isinstance(f[name], h5py.Dataset) else None)
        raise DataError(f"flight {flight}: {f.filename} has no dataset '{key}' (set by data.keys.{config_key}); "
                        f"datasets present: {', '.join(present[:20]) or 'none'}")
    return f[key]


def numbers(f: h5py.File, key: str, flight: str, config_key: str, expected: str = "numbers") -> np.ndarray:
    """A dataset's values as float64. Numbers stored as text are read (and logged); anything else that is
    not numbers (words, dates as text, compound records) is a DataError naming the dataset and its key."""
    ds = dataset(f, key, flight, config_key)
    raw = np.asarray(ds[()])
    where = f"flight {flight}: {f.filename} '{key}' (data.keys.{config_key})"
    if raw.dtype.kind in "biuf":
        return raw.astype(np.float64)
    if raw.dtype.kind in "SUO":
        try:
            values = raw.astype(np.float64)
        except (ValueError, TypeError):
            example = raw.reshape(-1)[0] if raw.size else ""
            example = example.decode(errors="replace") if isinstance(example, bytes) else example
            raise DataError(f"{where} holds text ({raw.dtype}, e.g. {str(example)[:40]!r}), not {expected}. Is it "
                            f"the right dataset? Set data.keys.{config_key} to the dataset that holds {expected}."
                            ) from None
        log.info("%s: stored as text (%s); read as numbers", where, raw.dtype)
        return values
    raise DataError(f"{where} holds {raw.dtype} values, not {expected}. Is it the right dataset? Set "
                    f"data.keys.{config_key} to the dataset that holds {expected}.")


def _column(f: h5py.File, key: str, flight: str, config_key: str, pick: int = 1) -> np.ndarray:
    """A per-profile array: (N,) as is, (N, 3) first/mean/last -> column `pick`, (N, 1) -> column 0."""
    x = numbers(f, key, flight, config_key)
    if x.ndim == 2 and x.shape[1] == 1:
        return x[:, 0]
    if x.ndim == 2 and x.shape[1] == 3:
        return x[:, pick]
    if x.ndim != 1:
        raise DataError(f"flight {flight}: {f.filename} '{key}' (data.keys.{config_key}) has shape {x.shape}; "
                        "expected (profiles,) or (profiles, 3) with first, mean and last values")
    return x


# ------------------------------------------------------------------------------------ dates and times

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
        raise DataError(f"flight {flight.name}: cannot read the date from CPL file name {flight.cpl_file!r} "
                        "(expected it to end like _10feb25.hdf5); set data.flights[].date: YYYY-MM-DD")
    return date


def _utc(t: float) -> str:
    return f"{dt.datetime.fromtimestamp(float(t), dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def _midnight_epoch(date: dt.date) -> float:
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
            raise DataError(f"{where}: cannot tell the time format from values around {median:.1f}; expected "
                            "epoch seconds (> 1e8) or seconds of day (0..86400); set data.ir_time_format")
    looks = "epoch" if median > 1e8 else "seconds_of_day" if median < 2 * 86400 else "neither"
    if fmt != looks:                          # only a forced format can disagree with the values
        raise DataError(f"{where}: data.ir_time_format is '{fmt}', but the values (median {median:.1f}) are "
                        + ("epoch seconds" if looks == "epoch" else "seconds of day" if looks == "seconds_of_day"
                           else "neither epoch seconds (> 1e8) nor seconds of day (0..172800)")
                        + f". Set data.ir_time_format: auto (detects it){'' if looks == 'neither' else f' or {looks}'}.")
    out = np.full(t.shape, np.nan)
    if fmt == "epoch":
        ok = positive & (np.abs(t - median) <= STRAY_TIME_S)
        out[ok] = t[ok]
    else:
        ok = np.isfinite(t) & (t >= 0) & (t < 2 * 86400)
        v = t[ok]
        wraps = np.concatenate([[0.0], np.cumsum(np.diff(v) < -43200.0)]) * 86400.0
        out[ok] = _midnight_epoch(date) + v + wraps
    return out, fmt, int((~ok).sum())


def julian_to_epoch(julian_day: np.ndarray, year: int) -> np.ndarray:
    """Decimal day of year (1.0 = 1 January 00:00 UTC) to epoch seconds; fill values become NaN."""
    jd = np.asarray(julian_day, dtype=np.float64)
    jd = np.where(np.isfinite(jd) & (jd >= 1.0) & (jd < 368.0), jd, np.nan)
    return _midnight_epoch(dt.date(year, 1, 1)) + (jd - 1.0) * 86400.0


# ------------------------------------------------------------------------------------ labels

def label_definition(data: DataConfig) -> dict:
    """Every setting that decides which profile labels which frame with which height (the cache key,
    provenance)."""
    return {"layer": data.label_layer, "layer_order": data.layer_order, "time_column": data.cpl_time_column,
            "time_round": data.cpl_time_round, "time_offset_s": data.cpl_time_offset_s,
            "cbh_km": [data.cbh_min_km, data.cbh_max_km], "max_lidar_surface_km": data.max_lidar_surface_km,
            "max_dem_surface_m": data.max_dem_surface_m, "match_tolerance_s": data.match_tolerance_s}


def top_first(base: np.ndarray, n_layers: np.ndarray, order: str) -> np.ndarray:
    """Layer bases with layer 0 on top: as stored (top_first), or each profile's n valid layers reversed."""
    if order == "top_first":
        return base
    out = base.copy()
    n = np.clip(n_layers, 0, base.shape[1]).astype(int)
    for k in np.unique(n[n > 1]):
        rows = n == k
        out[rows, :k] = base[rows, :k][:, ::-1]
    return out


def check_layer_order(base: np.ndarray, n_layers: np.ndarray, flight: str, path: Path, order: str) -> int:
    """`base` ordered by `order` (top_first): where two or more layers exist, the top layer's base (layer 0)
    lies at or above the lowest one's. A flight that contradicts the configured order is a DataError; returns the profiles checked."""
    n = np.clip(n_layers, 0, base.shape[1]).astype(int)
    rows = np.flatnonzero(n > 1)
    top, low = base[rows, 0], base[rows, n[rows] - 1]
    valid = (top > FILL_BELOW) & (low > FILL_BELOW)
    wrong = int((valid & (top < low)).sum())
    checked = int(valid.sum())
    if checked and wrong > LAYER_ORDER_TOLERANCE * checked:
        other = "bottom_first" if order == "top_first" else "top_first"
        raise DataError(f"flight {flight}: {path}: in {wrong} of {checked} multi-layer profiles the layer "
                        f"data.layer_order: {order} calls the top lies below the lowest one (e.g. profile "
                        f"{rows[valid & (top < low)][0]}). Set data.layer_order: {other} if this file stores its "
                        "layers the other way round, or check data.keys.cpl_base.")
    return checked


def check_times_increase(t: np.ndarray, flight: str, path: Path) -> int:
    """Lidar profile times must increase (equal times occur): a decrease or a jump is a warning naming the
    profile. Returns the number of decreases."""
    ok = np.flatnonzero(np.isfinite(t))
    if ok.size < 2:
        return 0
    d = np.diff(t[ok])
    back, jump = np.flatnonzero(d < 0), np.flatnonzero(d > TIME_JUMP_S)
    if back.size:
        i = ok[back[0]]
        log.warning("flight %s: %s: lidar times decrease %d time(s), first after profile %d (%s -> %s); labels "
                    "near it may match the wrong frames", flight, path.name, back.size, i, _utc(t[i]),
                    _utc(t[ok[back[0] + 1]]))
    if jump.size:
        i = ok[jump[0]]
        log.warning("flight %s: %s: lidar times jump forward %d time(s) by more than %.0f s, first after profile "
                    "%d (%s -> %s)", flight, path.name, jump.size, TIME_JUMP_S, i, _utc(t[i]), _utc(t[ok[jump[0] + 1]]))
    return int(back.size)

def choose_label(base: np.ndarray, n_layers: np.ndarray, label_layer: str) -> tuple[np.ndarray, np.ndarray]:
    """The label height of each profile from (N, L) layer bases (layer 0 on top) and layer counts.

    lowest: base of the lowest layer, base[i, n_i - 1] (the physical cloud base height);
    top: base[:, 0], the base of the top layer (the users' published labels);
    single: base[:, 0] of single-layer profiles only.
    Returns (height km, NaN where none; mask of profiles removed as multi-layer).
    """
    n = np.clip(n_layers, 0, base.shape[1]).astype(int)
    has = n >= 1
    if label_layer == "lowest":
        h = np.where(has, base[np.arange(len(base)), np.maximum(n - 1, 0)], np.nan)
    else:
        h = np.where(has, base[:, 0], np.nan)
    h = np.where(h > FILL_BELOW, h, np.nan)
    multi = (n > 1) if label_layer == "single" else np.zeros(len(base), bool)
    return h, multi


def filter_profiles(label_t, height_km, multi, lidar_surface_km, dem, data: DataConfig) -> tuple[np.ndarray, dict]:
    """Keep a profile with a usable time and layer, in range, over ocean and with a plausible surface."""
    steps = [
        ("bad_time", ~np.isfinite(label_t)),
        ("no_layer", ~np.isfinite(height_km)),
        ("multi_layer", multi),
        ("out_of_range", ~((height_km >= data.cbh_min_km) & (height_km <= data.cbh_max_km))),
        ("over_land", ~((dem >= 0) & (dem <= data.max_dem_surface_m))),     # fill values (-9999) too
        # km in the real files; fill values (-9999) fail this test too
        ("bad_surface", ~(np.abs(lidar_surface_km) <= data.max_lidar_surface_km)),
    ]
    keep = np.ones(len(label_t), bool)
    counts = {"profiles": int(len(label_t))}
    for reason, removed in steps:
        counts[reason] = int((keep & removed).sum())
        keep &= ~removed
    return keep, counts


def match_to_frames(label_t: np.ndarray, frame_t: np.ndarray, tolerance_s: float) -> tuple[np.ndarray, np.ndarray]:
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


def match_statistics(label_t: np.ndarray, frame_t: np.ndarray, frames: np.ndarray, filtered: np.ndarray,
                     matched: np.ndarray, tolerance_s: float) -> dict:
    """Of the profiles every filter kept: how many lie inside the camera's time span (give or take the
    tolerance), how many matched a frame (the match rate is of those inside), and |time difference| to
    the matched frame (median, 95th percentile, seconds)."""
    cam = frame_t[np.isfinite(frame_t)]
    inside = (filtered & (label_t >= cam.min() - tolerance_s) & (label_t <= cam.max() + tolerance_s) if cam.size
              else np.zeros_like(filtered))
    ok = filtered & matched
    dt = np.abs(frame_t[frames[ok]] - label_t[ok])
    return {"filtered": int(filtered.sum()), "inside_camera": int(inside.sum()), "matched": int(ok.sum()),
            "match_rate": float(ok.sum() / inside.sum()) if inside.sum() else None,
            "dt_median_s": float(np.median(dt)) if dt.size else None,
            "dt_p95_s": float(np.percentile(dt, 95)) if dt.size else None}


def estimate_offset(label_t: np.ndarray, frame_t: np.ndarray, filtered: np.ndarray, tolerance_s: float) -> float | None:
    """A constant lidar-to-camera clock offset that would explain few matches: the seconds to add to the lidar
    times that match the most filtered profiles, searched in 1 s steps over +-10 minutes and in whole hours
    (a time zone) up to +-12 h; the centre of the best offsets when several tie (a camera at one frame per
    second matches as well one second later). None unless it matches clearly more than no offset, and None
    when the lidar's time span covers the camera's (the lidar ran longer: an offset would only crowd more
    profiles into the recording)."""
    cam = np.sort(frame_t[np.isfinite(frame_t)])
    t = label_t[filtered & np.isfinite(label_t)]
    if cam.size < 2 or t.size == 0:
        return None
    if t.min() <= cam[0] + tolerance_s and t.max() >= cam[-1] - tolerance_s:
        return None                 # the lidar covers the whole recording: it ran longer, no clock is off

    def hits(offset: float) -> int:
        pos = np.clip(np.searchsorted(cam, t + offset), 1, cam.size - 1)
        gap = np.minimum(np.abs(cam[pos] - t - offset), np.abs(cam[pos - 1] - t - offset))
        return int((gap <= tolerance_s).sum())
    candidates = np.concatenate([np.arange(-600.0, 601.0), 3600.0 * np.arange(-12, 13)])
    scores = np.array([hits(o) for o in candidates])
    best = candidates[scores == scores.max()]
    near = best[np.abs(best - np.median(best)) <= 600.0] if np.ptp(best) > 600.0 else best
    offset = float(np.round(np.median(near)))
    none = hits(0.0)
    return offset if scores.max() >= max(2 * none, none + 5) and offset != 0.0 else None


def one_label_per_frame(frames: np.ndarray, gap_s: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Among kept profiles matched to the same frame, keep the one nearest in time (ties: the first)."""
    idx = np.flatnonzero(keep)
    order = idx[np.lexsort((idx, gap_s[idx]))]           # by time gap, then file order
    _, first = np.unique(frames[order], return_index=True)
    out = np.zeros_like(keep)
    out[order[first]] = True
    return out


def _time_columns(julian: np.ndarray, data: DataConfig, where: str) -> tuple[np.ndarray, np.ndarray | None, str]:
    """The configured column of (N, 3) start/centre/end decimal days, the column it is compared against, and
    a note; (N,) times are used as they are (no column to choose)."""
    if julian.ndim == 2 and julian.shape[1] == 3:
        return (julian[:, TIME_COLUMNS[data.cpl_time_column]], julian[:, TIME_COLUMNS[OTHER_COLUMN[data.cpl_time_column]]],
                f"the profile {data.cpl_time_column} time")
    if julian.ndim == 2 and julian.shape[1] == 1:
        julian = julian[:, 0]
    if julian.ndim != 1:
        raise DataError(f"{where} (data.keys.cpl_time) has shape {julian.shape}; expected (profiles,) or "
                        "(profiles, 3) with start, centre and end times")
    return julian, None, "one time per profile (data.cpl_time_column does not apply)"


def lidar_times(t: np.ndarray, data: DataConfig) -> np.ndarray:
    """Epoch seconds of the profiles as matched: rounded to whole seconds when asked, plus the offset."""
    return (np.round(t) if data.cpl_time_round else t) + data.cpl_time_offset_s


def _read_cpl(path: Path, flight: FlightConfig, data: DataConfig) -> dict:
    """Per-profile times (epoch s), label heights, filter inputs and sun angles of one CPL file."""
    k, name = data.keys, flight.name
    with open_h5(path, name) as f:
        julian_all = numbers(f, k.cpl_time, name, "cpl_time", "decimal days of year")
        base = numbers(f, k.cpl_base, name, "cpl_base", "heights in km")
        base = base[:, None] if base.ndim == 1 else base
        if base.ndim != 2:
            raise DataError(f"flight {name}: {path} '{k.cpl_base}' (data.keys.cpl_base) has shape {base.shape}; "
                            "expected (profiles, layers)")
        if k.cpl_layer_count and k.cpl_layer_count in f:
            n_layers = numbers(f, k.cpl_layer_count, name, "cpl_layer_count", "layer counts").reshape(-1)
        else:                                             # layers are packed from index 0
            n_layers = (base > FILL_BELOW).sum(axis=1)
        surface = _column(f, k.cpl_lidar_surface, name, "cpl_lidar_surface")
        dem = _column(f, k.cpl_dem_surface, name, "cpl_dem_surface")
        year = (int(numbers(f, k.cpl_year, name, "cpl_year", "a year").reshape(-1)[0])
                if k.cpl_year and k.cpl_year in f else None)
        angles = {}
        if data.angles_source == "cpl":
            angles = {"sza": _column(f, k.cpl_zenith, name, "cpl_zenith"),
                      "saa": _column(f, k.cpl_azimuth, name, "cpl_azimuth"),
                      "lat": _column(f, k.cpl_lat, name, "cpl_lat"), "lon": _column(f, k.cpl_lon, name, "cpl_lon")}
    julian, julian_other, column_note = _time_columns(julian_all, data, f"flight {name}: {path} '{k.cpl_time}'")
    sizes = {"times": julian.size, "layer rows": base.shape[0], "Number_Layers": n_layers.size,
             "lidar surfaces": surface.size, "DEM values": dem.size, **{a: v.size for a, v in angles.items()}}
    if len(set(sizes.values())) != 1:
        raise DataError(f"flight {name}: {path} datasets disagree on the number of profiles ("
                        + ", ".join(f"{v} {a}" for a, v in sizes.items()) + ")")
    date = flight_date(flight)
    if year is not None and year != date.year:
        log.warning("flight %s: %s says File_Year %d but its name says %d; using %d for the Julian days",
                    name, path.name, year, date.year, year)
    base = top_first(base, n_layers, data.layer_order)
    check_layer_order(base, n_layers, name, path, data.layer_order)
    height, multi = choose_label(base, n_layers, data.label_layer)
    angles = {a: np.where(v > FILL_BELOW, v, np.nan) for a, v in angles.items()}
    if "saa" in angles:
        angles["saa"] = np.mod(angles["saa"], 360.0)     # -180..180 and 0..360 conventions agree after this
    t = julian_to_epoch(julian, year or date.year)
    check_times_increase(t, name, path)
    other = None if julian_other is None else lidar_times(julian_to_epoch(julian_other, year or date.year), data)
    return {"t": lidar_times(t, data), "t_other": other, "column_note": column_note, "height": height, "multi": multi,
            "surface": surface, "dem": dem, "multi_layer_profiles": int((n_layers > 1).sum()), **angles}


# ------------------------------------------------------------------------------------ IR and nav

def read_ir_times(path: Path, flight: FlightConfig, data: DataConfig) -> tuple[np.ndarray, int, int, int]:
    """Epoch time per frame (NaN where unusable) and the raw frame shape."""
    k, name = data.keys, flight.name
    with open_h5(path, name) as f:
        signal = dataset(f, k.ir_signal, name, "ir_signal")
        if signal.ndim != 3:
            raise DataError(f"flight {name}: {path} '{k.ir_signal}' has shape {signal.shape}; "
                            "expected (frames, rows, columns)")
        n_frames, rows, cols = signal.shape
        if signal.dtype.kind not in "biuf":
            raise DataError(f"flight {name}: {path} '{k.ir_signal}' (data.keys.ir_signal) holds {signal.dtype} "
                            "values, not image counts or temperatures; set data.keys.ir_signal to the frames")
        raw_t = numbers(f, k.ir_time, name, "ir_time", "times (epoch seconds)").reshape(-1)
    where = f"flight {name}: {path} '{k.ir_time}'"
    if raw_t.size < n_frames:
        raise DataError(f"{where}: {raw_t.size} times for {n_frames} frames; every frame needs a time")
    if raw_t.size > n_frames:
        log.info("flight %s: %s has %d times for %d frames; using the first %d", name, path.name, raw_t.size,
                 n_frames, n_frames)
        raw_t = raw_t[:n_frames]
    frame_t, fmt, n_bad = to_epoch_seconds(raw_t, data.ir_time_format, flight_date(flight), where)
    how = "detected" if data.ir_time_format == "auto" else "set by data.ir_time_format"
    log.info("flight %s: IR times read as %s (%s)%s", name, "Unix epoch seconds" if fmt == "epoch" else
             "seconds of day", how, f"; {n_bad} unusable values (0, fill or far off): those frames get no label"
             if n_bad else "")
    if data.swath_slice[1] > rows:
        raise DataError(f"flight {name}: data.swath_slice {data.swath_slice} needs {data.swath_slice[1]} "
                        f"sensor rows but {path} frames have {rows}; valid: end_row <= {rows}")
    if cols // data.downsample < MIN_FRAME_SIDE:
        raise DataError(f"flight {name}: {path} frames are {cols} columns wide, {cols // data.downsample} after "
                        f"data.downsample {data.downsample}; the network's three blocks need at least {MIN_FRAME_SIDE}"
                        + (f": set data.downsample to at most {cols // MIN_FRAME_SIDE}" if cols >= MIN_FRAME_SIDE
                           else ": these frames are too narrow for the network"))
    return frame_t, n_frames, rows, cols


NAV_COLUMNS = (("sza", "nav_zenith", "ict_zenith"), ("saa", "nav_azimuth", "ict_azimuth"),
               ("lat", "nav_lat", "ict_lat"), ("lon", "nav_lon", "ict_lon"), ("heading", "nav_heading", "ict_heading"))


@dataclass
class Nav:
    """Nav values per IR frame (NaN where unknown), the frames the file covers, and where the heading came from."""
    values: dict                 # sza, saa, lat, lon, heading -> (n_frames,)
    covered: np.ndarray          # (n_frames,) bool
    heading_note: str            # "nav/trueHdg", or why there is none


def is_icartt(path: Path) -> bool:
    return Path(path).suffix.lower() == ".ict"


def _read_icartt(path: Path, flight: FlightConfig, data: DataConfig) -> tuple[dict, np.ndarray, str | None]:
    """Columns (heading None when absent), epoch times and the heading column's name of an ICARTT nav file."""
    try:
        import icartt
    except ImportError:
        raise DataError(f"flight {flight.name}: {path} is ICARTT text; reading it needs the icartt package: "
                        "pip install icartt") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # missing normal-comment keywords: not our concern here
            ds = icartt.Dataset(str(path))
        table, date = ds.data.data, dt.date(*[int(x) for x in ds.dateOfCollection])
    except Exception as e:                           # the parser raises many types on a malformed file
        raise DataError(f"flight {flight.name}: cannot read {path} as ICARTT 1001 nav ({type(e).__name__}: {e}); "
                        "is it a complete *_MetNav_ER2_*.ict file?") from None
    if table is None or len(table) == 0:
        raise DataError(f"flight {flight.name}: {path} holds no data records")
    present = {n.lower(): n for n in table.dtype.names}

    def column(key: str, required: bool = True) -> tuple[np.ndarray | None, str | None]:
        for name in getattr(data.keys, key).split("|"):
            if name.strip().lower() in present:
                real = present[name.strip().lower()]
                v = np.asarray(table[real], np.float64)
                return np.where(v > FILL_BELOW, v, np.nan), real
        if required:
            raise DataError(f"flight {flight.name}: {path} has no column {getattr(data.keys, key)!r} (data.keys.{key});"
                            f" columns present: {', '.join(table.dtype.names)}")
        return None, None
    seconds, _ = column("ict_time")
    epoch = _midnight_epoch(date) + seconds           # ICARTT seconds keep counting past 24 h after midnight
    cols = {name: column(ict)[0] for name, _, ict in NAV_COLUMNS if name != "heading"}
    heading, heading_name = column("ict_heading", required=False)
    cols["heading"] = heading
    return cols, epoch, heading_name


def _read_hdf_nav(path: Path, flight: FlightConfig, data: DataConfig) -> tuple[dict, np.ndarray | None, str | None]:
    k = data.keys
    with open_h5(path, flight.name) as f:
        cols = {name: numbers(f, getattr(k, key), flight.name, key, "angles or coordinates in degrees").reshape(-1)
                for name, key, _ in NAV_COLUMNS if name != "heading"}
        has_heading = bool(k.nav_heading) and k.nav_heading in f
        cols["heading"] = (numbers(f, k.nav_heading, flight.name, "nav_heading", "a heading in degrees").reshape(-1)
                           if has_heading else None)
        nav_t = numbers(f, k.nav_time, flight.name, "nav_time", "times") if k.nav_time and k.nav_time in f else None
    if nav_t is not None:
        nav_t, _, _ = to_epoch_seconds(nav_t, "auto", flight_date(flight), f"flight {flight.name}: {path} '{k.nav_time}'")
    return cols, nav_t, k.nav_heading if has_heading else None


def read_nav(flight: FlightConfig, data: DataConfig, path: Path, frame_t: np.ndarray) -> Nav:
    """Sun angles, position and heading per IR frame: matched by time when the nav file has a time axis (an
    ICARTT file always has), else nav row i is frame i. A frame without a nav record keeps NaN values (angles
    are filled later, and counted); a file without a heading gives NaN headings, and flips are off."""
    n_frames = frame_t.size
    icartt_file = is_icartt(path)
    cols, nav_epoch, heading_name = (_read_icartt if icartt_file else _read_hdf_nav)(path, flight, data)
    if heading_name is None:
        where = f"data.keys.{'ict_heading' if icartt_file else 'nav_heading'}"
        note = f"no heading ({where} {getattr(data.keys, where.split('.')[-1])!r} not in {path.name})"
        cols["heading"] = np.full(next(iter(cols.values())).size, np.nan)
    else:
        note = f"heading from {path.name} '{heading_name}'"
        cols["heading"] = np.mod(cols["heading"], 360.0)
    lengths = {v.size for v in cols.values()}
    if len(lengths) != 1:
        raise DataError(f"flight {flight.name}: nav datasets in {path} have different lengths {sorted(lengths)}")
    n_nav = lengths.pop()
    if nav_epoch is not None:
        if nav_epoch.size != n_nav:
            raise DataError(f"flight {flight.name}: {path}: {nav_epoch.size} times for {n_nav} nav rows")
        rows, ok = match_to_frames(frame_t, nav_epoch, NAV_MATCH_TOLERANCE_S)
        log.info("flight %s: nav records of %s matched to IR frames by time (%d of %d frames within %g s)",
                 flight.name, path.name, int(ok.sum()), n_frames, NAV_MATCH_TOLERANCE_S)
        return Nav({name: np.where(ok, v[rows], np.nan) for name, v in cols.items()}, np.ones(n_frames, bool), note)
    span = (f"the first {n_frames} of its {n_nav} rows used" if n_nav > n_frames else
            f"it covers frames 0..{n_nav - 1} of {n_frames}" if n_nav < n_frames else "same length")
    log.info("flight %s: %s has no time axis, as in the users' files: nav row i is taken to be IR frame i (%s)",
             flight.name, path.name, span)
    out = {name: np.full(n_frames, np.nan) for name in cols}
    m = min(n_nav, n_frames)
    for name, v in cols.items():
        out[name][:m] = v[:m]
    return Nav(out, np.arange(n_frames) < n_nav, note)


def _heading_only(flight: FlightConfig, data: DataConfig, frame_t: np.ndarray) -> tuple[np.ndarray, str]:
    """With data.angles_source: cpl, the heading still comes from the nav file when the flight has one."""
    path = Path(data.dir) / flight.nav_file if flight.nav_file else None
    if path is None or not path.is_file():
        return np.full(frame_t.size, np.nan), "no heading (no nav file)"
    nav = read_nav(flight, data, path, frame_t)
    return nav.values["heading"], nav.heading_note


def read_flight_labels(flight: FlightConfig, data: DataConfig) -> FlightLabels:
    """Read, filter and match one flight's labels; frames stay on disk."""
    check_files(flight, data)
    paths = flight_paths(flight, data)
    frame_t, n_frames, rows, cols = read_ir_times(paths["ir"], flight, data)
    cpl = _read_cpl(paths["cpl"], flight, data)
    keep, counts = filter_profiles(cpl["t"], cpl["height"], cpl["multi"], cpl["surface"], cpl["dem"], data)
    frames, matched = match_to_frames(cpl["t"], frame_t, data.match_tolerance_s)
    counts["unmatched"] = int((keep & ~matched).sum())
    match = match_statistics(cpl["t"], frame_t, frames, keep, matched, data.match_tolerance_s)
    _say_match(flight.name, cpl, frame_t, frames, keep, matched, match, data)
    keep &= matched
    single = one_label_per_frame(frames, np.abs(frame_t[frames] - cpl["t"]), keep)
    counts["duplicate_frame"] = int((keep & ~single).sum())
    keep = single
    if data.angles_source == "nav":
        nav = read_nav(flight, data, paths["nav"], frame_t)
        beyond = keep & ~nav.covered[frames]
        counts["beyond_nav"] = int(beyond.sum())
        keep &= ~beyond
        sel = frames[keep]
        angles = {a: nav.values[a][sel] for a in ("sza", "saa", "lat", "lon", "heading")}
        heading_note = nav.heading_note
    else:
        counts["beyond_nav"] = 0
        angles = {a: cpl[a][keep] for a in ("sza", "saa", "lat", "lon")}
        heading, heading_note = _heading_only(flight, data, frame_t)
        angles["heading"] = heading[frames[keep]]
    counts["no_heading"] = int((~np.isfinite(angles["heading"])).sum())
    if counts["no_heading"]:
        log.warning("flight %s: %s for %d of %d labels: the horizontal flip is off for them (it could not keep the "
                    "image and the sun azimuth consistent)%s", flight.name, heading_note if heading_note.startswith(
                        "no heading") else "no heading", counts["no_heading"], int(keep.sum()),
                    "; with data.sun_azimuth: relative their azimuth is unknown (the network gets no direction)"
                    if data.sun_azimuth == "relative" else "")
    counts["kept"] = int(keep.sum())
    counts["multi_layer_profiles"] = cpl["multi_layer_profiles"]
    if counts["duplicate_frame"]:
        log.info("flight %s: %d profiles matched a frame that already had a nearer one; one label per frame "
                 "(the profile nearest in time, the first on a tie)", flight.name, counts["duplicate_frame"])
    if counts["beyond_nav"]:
        log.info("flight %s: %d labels lie beyond the end of the nav file and were dropped", flight.name,
                 counts["beyond_nav"])
    if counts["kept"] == 0:
        label_t = cpl["t"][np.isfinite(cpl["t"])]
        cam = frame_t[np.isfinite(frame_t)]
        span = lambda x: f"{_utc(x.min())}..{_utc(x.max())}" if x.size else "no usable times"  # noqa: E731
        span = f"camera {span(cam)}, lidar {span(label_t)}"
        raise DataError(f"flight {flight.name}: no lidar label survives the filters and time matching "
                        f"({counts}); time spans: {span}. Check data.ir_time_format, data.label_layer, "
                        "the data.cbh_* range and the flight date.")
    return FlightLabels(name=flight.name, n_frames=n_frames, frame_shape=(rows, cols), frame_index=frames[keep],
                        cbh_km=cpl["height"][keep].astype(np.float32), sza_deg=angles["sza"], saa_deg=angles["saa"],
                        lat=angles["lat"], lon=angles["lon"], heading_deg=angles["heading"], counts=counts,
                        match=match, heading_note=heading_note)


def _say_match(name: str, cpl: dict, frame_t: np.ndarray, frames: np.ndarray, filtered: np.ndarray,
               matched: np.ndarray, match: dict, data: DataConfig) -> None:
    """Log the match rate and time differences, the labels another time column would move, and a warning
    with the likely cause when few profiles inside the camera's time span match."""
    rate = match["match_rate"]
    log.info("flight %s: %d of %d filtered profiles inside the camera's time span matched a frame (%s); |time "
             "difference| median %s s, 95th percentile %s s; lidar time: %s%s%s", name, match["matched"],
             match["inside_camera"], "-" if rate is None else f"{100 * rate:.0f}%",
             _num(match["dt_median_s"]), _num(match["dt_p95_s"]), cpl["column_note"],
             ", rounded to whole seconds" if data.cpl_time_round else "",
             f", offset {data.cpl_time_offset_s:+g} s" if data.cpl_time_offset_s else "")
    if cpl["t_other"] is not None:
        other_frames, other_ok = match_to_frames(cpl["t_other"], frame_t, data.match_tolerance_s)
        both = filtered & matched & other_ok
        moved = int((both & (other_frames != frames)).sum())
        gained = int((filtered & matched & ~other_ok).sum()) - int((filtered & ~matched & other_ok).sum())
        log.info("flight %s: against the profile %s time (data.cpl_time_column: %s), %d of %d labels sit on another "
                 "frame and %+d more match", name, OTHER_COLUMN[data.cpl_time_column],
                 OTHER_COLUMN[data.cpl_time_column], moved, int(both.sum()), gained)
    overall = match["matched"] / match["filtered"] if match["filtered"] else None
    if overall is not None and overall < LOW_MATCH_RATE and match["filtered"] >= 5:
        offset = estimate_offset(cpl["t"], frame_t, filtered, data.match_tolerance_s)
        if offset is not None:
            cause = (f"a constant clock offset would explain it: {offset:+g} s added to the lidar times matches "
                     f"clearly more; set data.cpl_time_offset_s: {data.cpl_time_offset_s + offset:g}")
        elif match["inside_camera"] < 0.5 * match["filtered"]:
            cause = ("most profiles lie outside the camera's recording (the lidar ran longer, or the IR file "
                     "covers only part of the flight); no constant time offset explains it")
        else:
            cause = ("no constant time offset explains it: most likely gaps in the IR recording (frames without a "
                     "usable time), or a data.match_tolerance_s too small for the frame rate")
        log.warning("flight %s: only %d of %d filtered lidar profiles (%.0f%%) matched a frame within %g s: %s",
                    name, match["matched"], match["filtered"], 100 * overall, data.match_tolerance_s, cause)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
