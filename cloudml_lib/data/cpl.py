"""From the CPL layer file to one label per IR frame: which layer's base, which profiles pass the
filters, which frame each profile labels, and the flight's match rate said in plain words.

The layer file is read as it is (ER2_DATA.md, "Corrections"): `Profile_Decimal_Julian_Day` is (N, 3),
first, mean and last time of each averaged profile, and `data.cpl_time_column` picks one;
`Layer_Base_Altitude` is (N, 10) km with layer 0 the *top* layer and `Number_Layers` valid ones;
`Lidar_Surface_Altitude` is in km, the DEM in metres. Files, times, IR frames and the nav are read
by er2.py; every problem raises DataError naming the flight, the file and the key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cloudml_lib.base.config import BASE_ABOVE as BASE_ABOVE  # the classes: base/config.py's, named here too
from cloudml_lib.base.config import BASE_BELOW as BASE_BELOW
from cloudml_lib.base.config import BASE_IN_RANGE as BASE_IN_RANGE
from cloudml_lib.base.config import CLASS_MEANINGS as CLASS_MEANINGS
from cloudml_lib.base.config import CLEAR as CLEAR
from cloudml_lib.base.config import DataConfig, FlightConfig
from cloudml_lib.base.errors import DataError
from cloudml_lib.data.er2 import check_files, flight_paths, read_ir_times
from cloudml_lib.data.hdf5 import FILL_BELOW, numbers, open_h5, read_column
from cloudml_lib.data.navigation import heading_only, nav_match_problem, read_nav
from cloudml_lib.data.times import flight_date, julian_to_epoch, match_to_frames, utc_text

log = logging.getLogger(__name__)

TIME_COLUMNS = {"start": 0, "centre": 1, "end": 2}  # of Profile_Decimal_Julian_Day (N, 3)
OTHER_COLUMN = {"start": "centre", "centre": "start", "end": "centre"}  # compared against in the log
TIME_JUMP_S = 600.0  # a forward gap between two profiles larger than this is reported
LOW_MATCH_RATE = 0.5  # of the filtered profiles: fewer matched is a warning with the likely cause
LAYER_ORDER_TOLERANCE = 0.02  # share of multi-layer profiles that may contradict the configured order


@dataclass
class FlightLabels:
    """The labelled frames of one flight, after filtering and matching: every frame a usable profile matched,
    with its cloud flag, and a height where the profile passed the height filters (NaN elsewhere)."""

    name: str
    n_frames: int
    frame_shape: tuple[int, int]  # raw (rows, cols)
    frame_index: np.ndarray  # (N,) int, matched IR frame, increasing
    cbh_km: np.ndarray  # (N,) float, NaN: no height label (clear, or cloud not labelled)
    sza_deg: np.ndarray  # (N,) float, NaN where the source has none
    saa_deg: np.ndarray  # (N,)
    lat: np.ndarray  # (N,)
    lon: np.ndarray  # (N,)
    counts: dict = field(default_factory=dict)  # profiles seen and removed, by reason
    match: dict = field(default_factory=dict)  # match rate and time differences (match_statistics)
    heading_deg: np.ndarray | None = None  # (N,) aircraft true heading, NaN where none (flips off there)
    heading_note: str = ""  # where the heading came from, or why there is none
    cloud: np.ndarray | None = None  # (N,) int8: 1 a layer below the aircraft, 0 clear sky
    layer_base_km: np.ndarray | None = None  # (N,) base of the flag's layer (flag_layer), NaN: clear sky

    @property
    def heights(self) -> int:
        return int(np.isfinite(self.cbh_km).sum())


# ------------------------------------------------------------------------------------ labels

# What a CPL profile says of the cloud under the aircraft, by the base of the flag's layer against the label
# range (data.cloud_flag base_in_range): the classes of the cloud output and of cpl_cloud_flag (base/config.py
# holds them: the network's output is made of them).
CLASS_WORDS = (
    "clear sky (no CPL layer)",
    "a cloud base in the height product's range",
    "cloud only above the range (high cloud alone)",
    "a cloud base below the range (fog or near-surface cloud)",
)


def flag_layer(label_layer: str) -> str:
    """The layer whose base the cloud flag compares with the label range: the label's own layer, the lowest
    for `single` (whose multi-layer profiles have no label, but still a cloud)."""
    return "top" if label_layer == "top" else "lowest"


def cloud_classes(layer_base_km: np.ndarray, cloud: np.ndarray, low_km: float, high_km: float) -> np.ndarray:
    """Per profile (int8): CLEAR, BASE_IN_RANGE, BASE_ABOVE or BASE_BELOW, from the flag layer's base and the
    label range; a layer whose base is unknown (fill) counts as in range (its profile has a layer)."""
    base = np.asarray(layer_base_km, np.float64)
    out = np.where(np.asarray(cloud) > 0, BASE_IN_RANGE, CLEAR).astype(np.int8)
    with np.errstate(invalid="ignore"):
        out[(out == BASE_IN_RANGE) & (base > high_km)] = BASE_ABOVE
        out[(out == BASE_IN_RANGE) & (base < low_km)] = BASE_BELOW
    return out


def label_definition(data: DataConfig) -> dict:
    """Every setting that decides which profile labels which frame with which height (the cache key,
    provenance)."""
    return {
        "layer": data.label_layer,
        "layer_order": data.layer_order,
        "time_column": data.cpl_time_column,
        "time_round": data.cpl_time_round,
        "time_offset_s": data.cpl_time_offset_s,
        "cbh_km": [data.cbh_min_km, data.cbh_max_km],
        "max_lidar_surface_km": data.max_lidar_surface_km,
        "max_dem_surface_m": data.max_dem_surface_m,
        "match_tolerance_s": data.match_tolerance_s,
    }


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
    lies at or above the lowest one's. A flight that contradicts the configured order is a DataError; returns
    the profiles checked."""
    n = np.clip(n_layers, 0, base.shape[1]).astype(int)
    rows = np.flatnonzero(n > 1)
    top, low = base[rows, 0], base[rows, n[rows] - 1]
    valid = (top > FILL_BELOW) & (low > FILL_BELOW)
    wrong = int((valid & (top < low)).sum())
    checked = int(valid.sum())
    if checked and wrong > LAYER_ORDER_TOLERANCE * checked:
        other = "bottom_first" if order == "top_first" else "top_first"
        raise DataError(
            f"flight {flight}: {path}: in {wrong} of {checked} multi-layer profiles the layer "
            f"data.layer_order: {order} calls the top lies below the lowest one (e.g. profile "
            f"{rows[valid & (top < low)][0]}). Set data.layer_order: {other} if this file stores its "
            "layers the other way round, or check data.keys.cpl_base."
        )
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
        log.warning(
            "flight %s: %s: lidar times decrease %d time(s), first after profile %d (%s -> %s); labels "
            "near it may match the wrong frames",
            flight,
            path.name,
            back.size,
            i,
            utc_text(t[i]),
            utc_text(t[ok[back[0] + 1]]),
        )
    if jump.size:
        i = ok[jump[0]]
        log.warning(
            "flight %s: %s: lidar times jump forward %d time(s) by more than %.0f s, first after profile "
            "%d (%s -> %s)",
            flight,
            path.name,
            jump.size,
            TIME_JUMP_S,
            i,
            utc_text(t[i]),
            utc_text(t[ok[jump[0] + 1]]),
        )
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


def filter_profiles(
    label_t, height_km, multi, lidar_surface_km, dem, data: DataConfig
) -> tuple[np.ndarray, dict]:
    """Keep a profile with a usable time and layer, in range, over ocean and with a plausible surface."""
    steps = [
        ("bad_time", ~np.isfinite(label_t)),
        ("no_layer", ~np.isfinite(height_km)),
        ("multi_layer", multi),
        ("out_of_range", ~((height_km >= data.cbh_min_km) & (height_km <= data.cbh_max_km))),
        ("over_land", ~((dem >= 0) & (dem <= data.max_dem_surface_m))),  # fill values (-9999) too
        # km in the real files; fill values (-9999) fail this test too
        ("bad_surface", ~(np.abs(lidar_surface_km) <= data.max_lidar_surface_km)),
    ]
    keep = np.ones(len(label_t), bool)
    counts = {"profiles": int(len(label_t))}
    for reason, removed in steps:
        counts[reason] = int((keep & removed).sum())
        keep &= ~removed
    return keep, counts


def match_statistics(
    label_t: np.ndarray,
    frame_t: np.ndarray,
    frames: np.ndarray,
    filtered: np.ndarray,
    matched: np.ndarray,
    tolerance_s: float,
) -> dict:
    """Of the profiles every filter kept: how many lie inside the camera's time span (give or take the
    tolerance), how many matched a frame (the match rate is of those inside), and |time difference| to
    the matched frame (median, 95th percentile, seconds)."""
    cam = frame_t[np.isfinite(frame_t)]
    inside = (
        filtered & (label_t >= cam.min() - tolerance_s) & (label_t <= cam.max() + tolerance_s)
        if cam.size
        else np.zeros_like(filtered)
    )
    ok = filtered & matched
    dt = np.abs(frame_t[frames[ok]] - label_t[ok])
    return {
        "filtered": int(filtered.sum()),
        "inside_camera": int(inside.sum()),
        "matched": int(ok.sum()),
        "match_rate": float(ok.sum() / inside.sum()) if inside.sum() else None,
        "dt_median_s": float(np.median(dt)) if dt.size else None,
        "dt_p95_s": float(np.percentile(dt, 95)) if dt.size else None,
    }


def estimate_offset(
    label_t: np.ndarray, frame_t: np.ndarray, filtered: np.ndarray, tolerance_s: float
) -> float | None:
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
        return None  # the lidar covers the whole recording: it ran longer, no clock is off

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
    order = idx[np.lexsort((idx, gap_s[idx]))]  # by time gap, then file order
    _, first = np.unique(frames[order], return_index=True)
    out = np.zeros_like(keep)
    out[order[first]] = True
    return out


def _time_columns(
    julian: np.ndarray, data: DataConfig, where: str
) -> tuple[np.ndarray, np.ndarray | None, str]:
    """The configured column of (N, 3) start/centre/end decimal days, the column it is compared against, and
    a note; (N,) times are used as they are (no column to choose)."""
    if julian.ndim == 2 and julian.shape[1] == 3:
        return (
            julian[:, TIME_COLUMNS[data.cpl_time_column]],
            julian[:, TIME_COLUMNS[OTHER_COLUMN[data.cpl_time_column]]],
            f"the profile {data.cpl_time_column} time",
        )
    if julian.ndim == 2 and julian.shape[1] == 1:
        julian = julian[:, 0]
    if julian.ndim != 1:
        raise DataError(
            f"{where} (data.keys.cpl_time) has shape {julian.shape}; expected (profiles,) or "
            "(profiles, 3) with start, centre and end times"
        )
    return julian, None, "one time per profile (data.cpl_time_column does not apply)"


def lidar_times(t: np.ndarray, data: DataConfig) -> np.ndarray:
    """Epoch seconds of the profiles as matched: rounded to whole seconds when asked, plus the offset."""
    return (np.round(t) if data.cpl_time_round else t) + data.cpl_time_offset_s


def _read_cpl(path: Path, flight: FlightConfig, data: DataConfig) -> dict:
    """Per-profile times (epoch s), label heights, filter inputs and sun angles of one CPL file."""
    k, name = data.keys, flight.name
    raw = _read_cpl_datasets(path, name, data)
    julian, julian_other, column_note = _time_columns(
        raw["julian"], data, f"flight {name}: {path} '{k.cpl_time}'"
    )
    base, n_layers, angles = raw["base"], raw["n_layers"], raw["angles"]
    sizes = {
        "times": julian.size,
        "layer rows": base.shape[0],
        "Number_Layers": n_layers.size,
        "lidar surfaces": raw["surface"].size,
        "DEM values": raw["dem"].size,
        **{a: v.size for a, v in angles.items()},
    }
    if len(set(sizes.values())) != 1:
        raise DataError(
            f"flight {name}: {path} datasets disagree on the number of profiles ("
            + ", ".join(f"{v} {a}" for a, v in sizes.items())
            + ")"
        )
    date, year = flight_date(flight), raw["year"]
    if year is not None and year != date.year:
        log.warning(
            "flight %s: %s says File_Year %d but its name says %d; using %d for the Julian days",
            name,
            path.name,
            year,
            date.year,
            year,
        )
    base = top_first(base, n_layers, data.layer_order)
    check_layer_order(base, n_layers, name, path, data.layer_order)
    height, multi = choose_label(base, n_layers, data.label_layer)
    flag_base, _ = choose_label(base, n_layers, flag_layer(data.label_layer))
    angles = {a: np.where(v > FILL_BELOW, v, np.nan) for a, v in angles.items()}
    if "saa" in angles:
        angles["saa"] = np.mod(angles["saa"], 360.0)  # -180..180 and 0..360 conventions agree after this
    t = julian_to_epoch(julian, year or date.year)
    check_times_increase(t, name, path)
    other = (
        None if julian_other is None else lidar_times(julian_to_epoch(julian_other, year or date.year), data)
    )
    return {
        "t": lidar_times(t, data),
        "t_other": other,
        "column_note": column_note,
        "height": height,
        "flag_base": flag_base,
        "multi": multi,
        "n_layers": n_layers,
        "surface": raw["surface"],
        "dem": raw["dem"],
        "multi_layer_profiles": int((n_layers > 1).sum()),
        **angles,
    }


def _read_cpl_datasets(path: Path, name: str, data: DataConfig) -> dict:
    """The CPL file's datasets as read: Julian days, layer bases (profiles, layers), layer counts, surfaces,
    the year (None when absent) and, with data.angles_source: cpl, the angles and position."""
    k = data.keys
    with open_h5(path, name) as f:
        julian = numbers(f, k.cpl_time, name, "cpl_time", "decimal days of year")
        base = numbers(f, k.cpl_base, name, "cpl_base", "heights in km")
        base = base[:, None] if base.ndim == 1 else base
        if base.ndim != 2:
            raise DataError(
                f"flight {name}: {path} '{k.cpl_base}' (data.keys.cpl_base) has shape {base.shape}; "
                "expected (profiles, layers)"
            )
        if k.cpl_layer_count and k.cpl_layer_count in f:
            n_layers = numbers(f, k.cpl_layer_count, name, "cpl_layer_count", "layer counts").reshape(-1)
        else:  # layers are packed from index 0
            n_layers = (base > FILL_BELOW).sum(axis=1)
        year = (
            int(numbers(f, k.cpl_year, name, "cpl_year", "a year").reshape(-1)[0])
            if k.cpl_year and k.cpl_year in f
            else None
        )
        angles = {}
        if data.angles_source == "cpl":
            angles = {
                a: read_column(f, getattr(k, key), name, key)
                for a, key in (
                    ("sza", "cpl_zenith"),
                    ("saa", "cpl_azimuth"),
                    ("lat", "cpl_lat"),
                    ("lon", "cpl_lon"),
                )
            }
        return {
            "julian": julian,
            "base": base,
            "n_layers": n_layers,
            "year": year,
            "angles": angles,
            "surface": read_column(f, k.cpl_lidar_surface, name, "cpl_lidar_surface"),
            "dem": read_column(f, k.cpl_dem_surface, name, "cpl_dem_surface"),
        }


def _all_beyond_range(name: str, cpl: dict, matched: np.ndarray, data: DataConfig) -> str | None:
    """Where every single-layer cloud base the lidar measured during the camera's recording lies outside
    data.cbh_min_km..cbh_max_km (a flight of high cloud alone, say): that in words, else None."""
    measured = matched & np.isfinite(cpl["t"]) & np.isfinite(cpl["height"]) & ~cpl["multi"]
    above = measured & (cpl["height"] > data.cbh_max_km)
    below = measured & (cpl["height"] < data.cbh_min_km)
    if not measured.any() or (above | below).sum() < measured.sum():
        return None
    return (
        f"flight {name}: every cloud base the lidar measured while the camera recorded "
        f"({int(measured.sum())} profiles: {int(above.sum())} above {data.cbh_max_km:g} km, "
        f"{int(below.sum())} below {data.cbh_min_km:g} km) lies outside the height product's range "
        "(data.cbh_min_km..cbh_max_km): it has no height label. As a test flight it is scored for its cloud "
        "flag alone; it cannot train or validate the height."
    )


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
    m = Matched(frame_t, frames, matched, match)
    _say_match(flight.name, cpl, m, keep, data)
    keep &= matched
    gap = np.abs(frame_t[frames] - cpl["t"])
    single = one_label_per_frame(frames, gap, keep)
    counts["duplicate_frame"] = int((keep & ~single).sum())
    keep = single
    # Cloud / no-cloud: every other frame a usable profile (a time, over ocean) matched, flagged by its layer
    # count; a frame with a height label keeps that profile (it has a layer: cloud).
    usable = np.isfinite(cpl["t"]) & matched & (cpl["dem"] >= 0) & (cpl["dem"] <= data.max_dem_surface_m)
    extra = one_label_per_frame(frames, gap, usable & ~np.isin(frames, frames[keep]))
    pick = np.flatnonzero(keep | extra)
    pick = pick[np.argsort(frames[pick], kind="stable")]
    nav_path = paths.get("nav")  # none where the angles come from the CPL file
    pick, angles, heading_note, counts["beyond_nav"] = _angles(flight, data, nav_path, m, pick, keep, cpl)
    has_height = keep[pick]
    cloud = (cpl["n_layers"][pick] > 0).astype(np.int8)
    counts["no_heading"] = int((~np.isfinite(angles["heading"][has_height])).sum())
    counts["kept"] = int(has_height.sum())
    counts["cloud_labels"], counts["clear_sky"] = int(len(pick)), int((cloud == 0).sum())
    counts["multi_layer_profiles"] = cpl["multi_layer_profiles"]
    _say_counts(flight.name, counts, heading_note, data)
    beyond = _all_beyond_range(flight.name, cpl, matched, data) if counts["kept"] == 0 else None
    if beyond and len(pick):  # the time matching worked: only the range removed every height
        log.warning("%s", beyond)
        counts["all_beyond_range"] = 1
    elif counts["kept"] == 0:
        raise DataError(
            f"flight {flight.name}: no lidar label survives the filters and time matching ({counts}); time "
            f"spans: camera {_span(frame_t)}, lidar {_span(cpl['t'])}. Check data.ir_time_format, "
            "data.label_layer, the data.cbh_* range and the flight date."
        )
    return FlightLabels(
        name=flight.name,
        n_frames=n_frames,
        frame_shape=(rows, cols),
        frame_index=frames[pick],
        cbh_km=np.where(has_height, cpl["height"][pick], np.nan).astype(np.float32),
        sza_deg=angles["sza"],
        saa_deg=angles["saa"],
        lat=angles["lat"],
        lon=angles["lon"],
        heading_deg=angles["heading"],
        counts=counts,
        match=match,
        heading_note=heading_note,
        cloud=cloud,
        layer_base_km=cpl["flag_base"][pick].astype(np.float32),
    )


@dataclass
class Matched:
    """Each lidar profile's frame: the camera's frame times, the frame nearest each profile's time, whether
    it lies within data.match_tolerance_s, and the statistics of the match (match_statistics)."""

    frame_t: np.ndarray
    frames: np.ndarray
    matched: np.ndarray
    stats: dict


def _angles(
    flight: FlightConfig,
    data: DataConfig,
    nav_path: Path | None,
    m: Matched,
    pick: np.ndarray,
    keep: np.ndarray,
    cpl: dict,
) -> tuple[np.ndarray, dict, str, int]:
    """The sun angles, position and heading of the picked labels (from the nav file, or the CPL file itself
    with data.angles_source: cpl), and how many labels with a height lie beyond the end of the nav file
    (dropped). A nav file that too few frames found (data.min_nav_match) is a DataError."""
    frame_t, frames = m.frame_t, m.frames
    if data.angles_source == "nav":
        if nav_path is None:
            raise DataError(f"flight {flight.name}: no nav file, and data.angles_source is nav")
        nav = read_nav(flight, data, nav_path, frame_t)
        problem = nav_match_problem(nav, flight, data, nav_path)
        if problem:
            raise DataError(problem)
        beyond = ~nav.covered[frames[pick]]
        dropped = int((beyond & keep[pick]).sum())
        pick = pick[~beyond]
        return (
            pick,
            {a: nav.values[a][frames[pick]] for a in ("sza", "saa", "lat", "lon", "heading")},
            nav.heading_note,
            dropped,
        )
    angles = {a: cpl[a][pick] for a in ("sza", "saa", "lat", "lon")}
    heading, heading_note = heading_only(flight, data, frame_t)
    angles["heading"] = heading[frames[pick]]
    return pick, angles, heading_note, 0


def _say_counts(name: str, counts: dict, heading_note: str, data: DataConfig) -> None:
    """What the log says of a flight's labels: no heading (no flip), duplicates, beyond the nav file."""
    if counts["no_heading"]:
        relative = data.sun_azimuth == "relative"
        log.warning(
            "flight %s: %s for %d of %d labels: the horizontal flip is off for them (it could not keep the "
            "image and the sun azimuth consistent)%s",
            name,
            heading_note if heading_note.startswith("no heading") else "no heading",
            counts["no_heading"],
            counts["kept"],
            "; with data.sun_azimuth: relative their azimuth is unknown (the network gets no direction)"
            if relative
            else "",
        )
    if counts["duplicate_frame"]:
        log.info(
            "flight %s: %d profiles matched a frame that already had a nearer one; one label per frame (the "
            "profile nearest in time, the first on a tie)",
            name,
            counts["duplicate_frame"],
        )
    if counts["beyond_nav"]:
        log.info(
            "flight %s: %d labels lie beyond the end of the nav file and were dropped",
            name,
            counts["beyond_nav"],
        )


def _span(t: np.ndarray) -> str:
    t = t[np.isfinite(t)]
    return f"{utc_text(t.min())}..{utc_text(t.max())}" if t.size else "no usable times"


def _say_match(name: str, cpl: dict, m: Matched, filtered: np.ndarray, data: DataConfig) -> None:
    """Log the match rate and time differences, the labels another time column would move, and a warning
    with the likely cause when few profiles inside the camera's time span match."""
    frame_t, frames, matched, match = m.frame_t, m.frames, m.matched, m.stats
    rate = match["match_rate"]
    log.info(
        "flight %s: %d of %d filtered profiles inside the camera's time span matched a frame (%s); |time "
        "difference| median %s s, 95th percentile %s s; lidar time: %s%s%s",
        name,
        match["matched"],
        match["inside_camera"],
        "-" if rate is None else f"{100 * rate:.0f}%",
        _num(match["dt_median_s"]),
        _num(match["dt_p95_s"]),
        cpl["column_note"],
        ", rounded to whole seconds" if data.cpl_time_round else "",
        f", offset {data.cpl_time_offset_s:+g} s" if data.cpl_time_offset_s else "",
    )
    if cpl["t_other"] is not None:
        _say_other_column(name, cpl["t_other"], frame_t, frames, filtered, matched, data)
    overall = match["matched"] / match["filtered"] if match["filtered"] else None
    if overall is not None and overall < LOW_MATCH_RATE and match["filtered"] >= 5:
        log.warning(
            "flight %s: only %d of %d filtered lidar profiles (%.0f%%) matched a frame within %g s: %s",
            name,
            match["matched"],
            match["filtered"],
            100 * overall,
            data.match_tolerance_s,
            _low_match_cause(cpl["t"], frame_t, filtered, match, data),
        )


def _say_other_column(
    name: str,
    t_other: np.ndarray,
    frame_t: np.ndarray,
    frames: np.ndarray,
    filtered: np.ndarray,
    matched: np.ndarray,
    data: DataConfig,
) -> None:
    """How many labels the other time column of the profiles would move to another frame, or gain."""
    other_frames, other_ok = match_to_frames(t_other, frame_t, data.match_tolerance_s)
    both = filtered & matched & other_ok
    moved = int((both & (other_frames != frames)).sum())
    here, there = int((filtered & matched).sum()), int((filtered & other_ok).sum())
    other = OTHER_COLUMN[data.cpl_time_column]
    log.info(
        "flight %s: against the profile %s time (data.cpl_time_column: %s), %d of %d labels sit on another "
        "frame, and %d profiles match a frame (%d with the %s time used)",
        name,
        other,
        other,
        moved,
        int(both.sum()),
        there,
        here,
        data.cpl_time_column,
    )


def _low_match_cause(
    t: np.ndarray, frame_t: np.ndarray, filtered: np.ndarray, match: dict, data: DataConfig
) -> str:
    """The likely cause of a low match rate, in words, with the setting that fixes it where one does."""
    offset = estimate_offset(t, frame_t, filtered, data.match_tolerance_s)
    if offset is not None:
        return (
            f"a constant clock offset would explain it: {offset:+g} s added to the lidar times matches "
            f"clearly more; set data.cpl_time_offset_s: {data.cpl_time_offset_s + offset:g}"
        )
    if match["inside_camera"] < 0.5 * match["filtered"]:
        return (
            "most profiles lie outside the camera's recording (the lidar ran longer, or the IR file covers "
            "only part of the flight); no constant time offset explains it"
        )
    return (
        "no constant time offset explains it: most likely gaps in the IR recording (frames without a usable "
        "time), or a data.match_tolerance_s too small for the frame rate"
    )


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
