"""Reading one ER-2 flight: IR frame times, lidar labels, filters, label-to-frame matching, sun angles.

Frames themselves are read by the cache builder (cache.py) straight from the open HDF5 dataset;
this module returns everything else about a flight as small NumPy arrays. Every missing file,
dataset or inconsistent value raises DataError naming the flight, the file and the key.
"""
from __future__ import annotations

import calendar
import datetime as dt
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from cloudml_lib.config import DataConfig, FlightConfig
from cloudml_lib.errors import DataError

log = logging.getLogger(__name__)

NO_LAYER_BELOW = -999.0          # fill values such as -9999 mean "no layer"
NAV_MATCH_TOLERANCE_S = 2.0
_CPL_DATE = re.compile(r"(\d{2})([a-z]{3})(\d{2})\.hdf5?$", re.IGNORECASE)
_MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m}


@dataclass
class FlightLabels:
    """The labelled frames of one flight, after filtering and matching."""
    name: str
    n_frames: int
    frame_shape: tuple[int, int]                 # raw (rows, cols)
    frame_index: np.ndarray                      # (N,) int, matched IR frame
    cbh_km: np.ndarray                           # (N,) float
    sza_deg: np.ndarray                          # (N,) float, NaN where the nav file has none
    saa_deg: np.ndarray                          # (N,)
    lat: np.ndarray                              # (N,)
    lon: np.ndarray                              # (N,)
    counts: dict = field(default_factory=dict)   # profiles seen and removed, by reason


def _resolve(root: Path, name: str, flight: str) -> Path:
    """A file name, or a glob pattern (e.g. CPL_L2_*_10feb25.hdf5) that must match exactly one file."""
    if not any(ch in name for ch in "*?["):
        return root / name
    matches = sorted(root.glob(name))
    if len(matches) > 1:
        raise DataError(f"flight {flight}: pattern {name!r} matches {len(matches)} files in {root} "
                        f"({', '.join(m.name for m in matches[:5])}); make it match exactly one")
    return matches[0] if matches else root / name


def flight_paths(flight: FlightConfig, data: DataConfig) -> dict[str, Path]:
    root = Path(data.dir)
    return {role: _resolve(root, getattr(flight, f"{role}_file"), flight.name) for role in ("ir", "cpl", "nav")}


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


def flight_date(flight: FlightConfig) -> dt.date:
    """The flight's UTC date: `date` if given, else from the CPL file name (..._10feb25.hdf5)."""
    if flight.date:
        try:
            return dt.date.fromisoformat(flight.date)
        except ValueError:
            raise DataError(f"flight {flight.name}: date {flight.date!r} is not YYYY-MM-DD") from None
    m = _CPL_DATE.search(Path(flight.cpl_file).name.replace("*", ""))
    if not m or m.group(2).lower() not in _MONTHS:
        raise DataError(f"flight {flight.name}: cannot read the date from CPL file name {flight.cpl_file!r} "
                        "(expected it to end like _10feb25.hdf5); set data.flights[].date: YYYY-MM-DD")
    return dt.date(2000 + int(m.group(3)), _MONTHS[m.group(2).lower()], int(m.group(1)))


def _utc(t: float) -> str:
    return f"{dt.datetime.fromtimestamp(float(t), dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def _midnight_epoch(date: dt.date) -> float:
    return float(calendar.timegm(date.timetuple()))


def to_epoch_seconds(t: np.ndarray, fmt: str, date: dt.date, where: str) -> tuple[np.ndarray, str]:
    """Seconds since 1970 from seconds-of-day (unwrapped across midnight) or epoch seconds."""
    t = np.asarray(t, dtype=np.float64).reshape(-1)
    finite = t[np.isfinite(t)]
    if finite.size == 0:
        raise DataError(f"{where}: no finite time values")
    if fmt == "auto":
        if finite.min() >= 0 and finite.max() < 2 * 86400:
            fmt = "seconds_of_day"
        elif finite.min() > 1e8:
            fmt = "epoch"
        else:
            raise DataError(f"{where}: cannot tell the time format from values {finite.min():.1f}..{finite.max():.1f}; "
                            "expected seconds of day (0..86400) or epoch seconds (> 1e8); set "
                            "data.ir_time_format")
    if fmt == "seconds_of_day":
        wraps = np.concatenate([[0.0], np.cumsum(np.diff(t) < -43200.0) * 86400.0])
        return _midnight_epoch(date) + t + wraps, fmt
    return t, fmt


def julian_to_epoch(julian_day: np.ndarray, date: dt.date) -> np.ndarray:
    """Decimal day of year (1.0 = 1 January 00:00 UTC) in the flight's year to epoch seconds."""
    year_start = _midnight_epoch(dt.date(date.year, 1, 1))
    return year_start + (np.asarray(julian_day, dtype=np.float64) - 1.0) * 86400.0


def filter_profiles(base_km, lidar_surface_m, dem_m, data: DataConfig) -> tuple[np.ndarray, dict]:
    """Keep a profile if finite, a layer exists, in range, over ocean and with a plausible surface."""
    finite = np.isfinite(base_km) & (base_km > NO_LAYER_BELOW)
    in_range = (base_km >= data.cbh_min_km) & (base_km <= data.cbh_max_km)
    ocean = dem_m == 0
    surface_ok = np.abs(lidar_surface_m) / 1000.0 <= data.max_lidar_surface_km
    keep = finite & in_range & ocean & surface_ok
    counts = {"profiles": int(base_km.size), "no_layer": int((~finite).sum()),
              "out_of_range": int((finite & ~in_range).sum()), "over_land": int((finite & in_range & ~ocean).sum()),
              "bad_surface": int((finite & in_range & ocean & ~surface_ok).sum())}
    return keep, counts


def match_to_frames(label_t: np.ndarray, frame_t: np.ndarray, tolerance_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Nearest frame for each label time; returns (frame index, matched mask)."""
    order = np.argsort(frame_t, kind="stable")
    sorted_t = frame_t[order]
    pos = np.clip(np.searchsorted(sorted_t, label_t), 1, max(sorted_t.size - 1, 1))
    left, right = sorted_t[pos - 1], sorted_t[np.minimum(pos, sorted_t.size - 1)]
    use_left = np.abs(label_t - left) <= np.abs(label_t - right)
    nearest = np.where(use_left, pos - 1, np.minimum(pos, sorted_t.size - 1))
    ok = np.abs(frame_t[order[nearest]] - label_t) <= tolerance_s
    return order[nearest], ok


def _read_nav(flight: FlightConfig, data: DataConfig, path: Path, frame_t: np.ndarray, frames: np.ndarray, date):
    """Sun angles and position for the given frames, matched by time when the nav file has a time axis."""
    k = data.keys
    with open_h5(path, flight.name) as f:
        cols = {name: np.asarray(dataset(f, getattr(k, key), flight.name, key)[()], dtype=np.float64).reshape(-1)
                for name, key in (("sza", "nav_zenith"), ("saa", "nav_azimuth"), ("lat", "nav_lat"),
                                  ("lon", "nav_lon"))}
        nav_t = f[k.nav_time][()] if k.nav_time and k.nav_time in f else None
    lengths = {v.size for v in cols.values()}
    if len(lengths) != 1:
        raise DataError(f"flight {flight.name}: nav datasets in {path} have different lengths {sorted(lengths)}")
    if nav_t is not None:
        where = f"flight {flight.name}: {path} '{k.nav_time}'"
        nav_epoch, _ = to_epoch_seconds(nav_t, "auto", date, where)
        if nav_epoch.size != lengths.pop():
            raise DataError(f"{where}: {nav_epoch.size} times for {cols['sza'].size} nav rows")
        rows, ok = match_to_frames(frame_t[frames], nav_epoch, NAV_MATCH_TOLERANCE_S)
        out = {name: np.where(ok, v[rows], np.nan) for name, v in cols.items()}
        if (~ok).any():
            log.warning("flight %s: %d labelled frames have no nav record within %.0f s; their angles are filled",
                        flight.name, int((~ok).sum()), NAV_MATCH_TOLERANCE_S)
        return out
    n_nav = lengths.pop()
    log.warning("flight %s: %s has no time axis ('%s'); assuming nav row i belongs to IR frame i",
                flight.name, path.name, k.nav_time)
    if n_nav < frame_t.size:
        raise DataError(f"flight {flight.name}: {path} has {n_nav} nav rows but the IR file has {frame_t.size} "
                        f"frames and no nav time axis ('{k.nav_time}') to match them by; set data.keys.nav_time")
    return {name: v[frames] for name, v in cols.items()}


def read_flight_labels(flight: FlightConfig, data: DataConfig) -> FlightLabels:
    """Read, filter and match one flight's labels; frames stay on disk."""
    check_files(flight, data)
    paths = flight_paths(flight, data)
    date = flight_date(flight)
    k = data.keys
    with open_h5(paths["ir"], flight.name) as f:
        signal = dataset(f, k.ir_signal, flight.name, "ir_signal")
        if signal.ndim != 3:
            raise DataError(f"flight {flight.name}: {paths['ir']} '{k.ir_signal}' has shape {signal.shape}; "
                            "expected (frames, rows, columns)")
        n_frames, rows, cols = signal.shape
        raw_t = dataset(f, k.ir_time, flight.name, "ir_time")[()]
    where = f"flight {flight.name}: {paths['ir']} '{k.ir_time}'"
    frame_t, fmt = to_epoch_seconds(raw_t, data.ir_time_format, date, where)
    if frame_t.size != n_frames:
        raise DataError(f"{where}: {frame_t.size} times for {n_frames} frames")
    if data.swath_slice[1] > rows:
        raise DataError(f"flight {flight.name}: data.swath_slice {data.swath_slice} needs {data.swath_slice[1]} "
                        f"sensor rows but {paths['ir']} frames have {rows}; valid: end_row <= {rows}")

    with open_h5(paths["cpl"], flight.name) as f:
        julian = np.asarray(dataset(f, k.cpl_time, flight.name, "cpl_time")[()], np.float64).reshape(-1)
        base = dataset(f, k.cpl_base, flight.name, "cpl_base")[()]
        lidar_surface = np.asarray(dataset(f, k.cpl_lidar_surface, flight.name, "cpl_lidar_surface")[()]).reshape(-1)
        dem = np.asarray(dataset(f, k.cpl_dem_surface, flight.name, "cpl_dem_surface")[()]).reshape(-1)
    base = np.asarray(base, np.float64)
    base0 = base[:, 0] if base.ndim == 2 else base.reshape(-1)
    if not (base0.size == julian.size == lidar_surface.size == dem.size):
        raise DataError(f"flight {flight.name}: {paths['cpl']} datasets disagree on the number of profiles "
                        f"({julian.size} times, {base0.size} bases, {lidar_surface.size} lidar surfaces, "
                        f"{dem.size} DEM values)")
    keep, counts = filter_profiles(base0, lidar_surface, dem, data)
    label_t = julian_to_epoch(julian, date)
    frames, matched = match_to_frames(label_t, frame_t, data.match_tolerance_s)
    counts["unmatched"] = int((keep & ~matched).sum())
    keep &= matched
    counts["kept"] = int(keep.sum())
    if counts["kept"] == 0:
        span = (f"camera {_utc(frame_t.min())}..{_utc(frame_t.max())} (read as {fmt}), "
                f"lidar {_utc(np.nanmin(label_t))}..{_utc(np.nanmax(label_t))}")
        raise DataError(f"flight {flight.name}: no lidar label survives the filters and time matching "
                        f"({counts}); time spans: {span}. Check data.ir_time_format and the flight date.")
    frames = frames[keep]
    nav = _read_nav(flight, data, paths["nav"], frame_t, frames, date)
    return FlightLabels(name=flight.name, n_frames=n_frames, frame_shape=(rows, cols), frame_index=frames,
                        cbh_km=base0[keep].astype(np.float32), sza_deg=nav["sza"], saa_deg=nav["saa"],
                        lat=nav["lat"], lon=nav["lon"], counts=counts)
