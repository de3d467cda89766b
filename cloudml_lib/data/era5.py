"""ERA5 reanalysis as the Copernicus Climate Data Store serves it, read and interpolated to each IR frame.

A flight's atmosphere (its sea, air, humidity, boundary layer and, with pressure levels, its lower
troposphere) comes from ERA5 files in the data folder: in the flight's folder, or one file for a campaign's
box beside the flights (`era5_files`). Both NetCDF layouts the CDS has served are read:

- since the 2024 CDS (its new GRIB-to-NetCDF converter): NetCDF-4, the time coordinate `valid_time` in
  seconds since 1970-01-01, `latitude` descending, `longitude`, levels on `pressure_level` (hPa), and
  `expver` and `number` as coordinates; values stored as floats;
- before (the legacy CDS): NetCDF-3, `time` in hours since 1900-01-01, `level` (millibars), values packed
  as 16-bit integers with `scale_factor` and `add_offset`, and during ERA5T's overlap an `expver` dimension
  (1: ERA5, 5: ERA5T) whose members hold NaN where the other holds the value.

Longitudes come as 0..360 or -180..180, latitudes either way up: each grid is put in one order, and a box
that crosses the date line stays one box. GRIB files are read only where cfgrib is installed (optional;
its install command is named). Units are read from each variable's attributes and checked against the
quantity's unit and a physical range; what a file lacks is named with what it affects.

A frame takes each value linearly in time between the file's hours and bilinearly in space between its
grid points (`Era5.at`); a frame outside the file's hours or box is refused by name, never extrapolated.
Single levels: ERA5's short names (SINGLE); pressure levels (LEVELS) from 1000 to 700 hPa.

A file read once is kept by this process for as long as its bytes are the same (`read_file`): the start of a
run, its end, each fold of a cross-validation and each trial of a sweep read the flights' files again."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from cloudml_lib.base.errors import DataError, install_command

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Quantity:
    """An ERA5 variable: what it is, its unit (as ERA5 writes it, and the spellings taken as the same), the
    physically possible range of its values, and what CloudML derives from it (for a message)."""

    what: str
    units: tuple[str, ...]
    low: float
    high: float
    feeds: str


SINGLE = {
    "t2m": Quantity(
        "2 m temperature", ("K",), 180.0, 340.0, "relative humidity, LCL, sea-air difference, LTS"
    ),
    "d2m": Quantity("2 m dew point temperature", ("K",), 150.0, 330.0, "relative humidity, LCL"),
    "sst": Quantity("sea surface temperature", ("K",), 260.0, 320.0, "sea-air difference"),
    "skt": Quantity("skin temperature", ("K",), 180.0, 350.0, "the sea's temperature where sst is missing"),
    "sp": Quantity("surface pressure", ("Pa",), 40000.0, 110000.0, "LCL, LTS, EIS"),
    "msl": Quantity("mean sea level pressure", ("Pa",), 85000.0, 110000.0, "a predictor of its own"),
    "blh": Quantity("boundary layer height", ("m",), 0.0, 6000.0, "a predictor of its own"),
    "tcwv": Quantity(
        "total column water vapour", ("kg m**-2", "kg m-2", "kg/m2", "kg m^-2"), 0.0, 100.0, "a predictor"
    ),
    "lcc": Quantity(
        "low cloud cover", ("(0 - 1)", "1", "0-1", "dimensionless", "~"), 0.0, 1.0, "a predictor"
    ),
    "u10": Quantity("10 m eastward wind", ("m s**-1", "m s-1", "m/s"), -100.0, 100.0, "wind speed"),
    "v10": Quantity("10 m northward wind", ("m s**-1", "m s-1", "m/s"), -100.0, 100.0, "wind speed"),
}

LEVELS = {
    "t": Quantity("temperature", ("K",), 150.0, 350.0, "LTS, EIS"),
    "q": Quantity("specific humidity", ("kg kg**-1", "kg kg-1", "kg/kg", "1"), 0.0, 0.05, "EIS"),
    "z": Quantity(
        "geopotential", ("m**2 s**-2", "m2 s-2", "m^2/s^2"), -10000.0, 400000.0, "EIS (z at 700 hPa)"
    ),
    "r": Quantity("relative humidity", ("%",), 0.0, 150.0, "a predictor"),
}

PRESSURE_UNITS = ("hPa", "millibars", "mbar", "hectopascal")
LEVEL_RANGE_HPA = (700.0, 1000.0)  # the lower troposphere: the levels read (ISSUE: 1000-700 hPa)
GRID_TOLERANCE = 1e-6  # degrees: a frame on the box's edge is inside it


@dataclass(frozen=True)
class Grid:
    """One variable on (time, latitude, longitude), in one order: times and latitudes ascending, longitudes
    ascending and contiguous in `convention` (180: -180..180, 360: 0..360)."""

    name: str
    path: Path
    times: np.ndarray  # epoch seconds, ascending
    lats: np.ndarray  # ascending
    lons: np.ndarray  # ascending, in `convention`
    values: np.ndarray  # (time, lat, lon) float64, NaN where the file holds none (a land point's sst)
    convention: int = 180
    level: float | None = None  # hPa, for a pressure-level variable


@dataclass
class Era5:
    """The ERA5 variables found for a flight: `grids` by name (single levels by their short name, pressure
    levels as "t700", "z850", ...), the files they came from, and what is missing with what it affects."""

    grids: dict[str, Grid] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # name -> what it affects

    def names(self) -> list[str]:
        return sorted(self.grids)

    def at(self, name: str, t: np.ndarray, lat: np.ndarray, lon: np.ndarray, flight: str) -> np.ndarray:
        """The variable `name` at each frame (epoch seconds, degrees): linear in time, bilinear in space.
        NaN where the frame's time or position is unknown; a frame outside the file's hours or box is refused
        by name (DataError)."""
        return interpolate(self.grids[name], t, lat, lon, flight)

    def describe(self) -> str:
        if not self.grids:
            return "no ERA5 variable"
        levels = sorted({g.level for g in self.grids.values() if g.level is not None})
        single = [n for n, g in self.grids.items() if g.level is None]
        text = f"single levels {', '.join(sorted(single))}" if single else "no single level"
        if levels:
            text += f"; pressure levels {', '.join(f'{p:g}' for p in levels)} hPa"
        return text


# ------------------------------------------------------------------------------------------------- reading


def _engine(path: Path) -> str:
    """xarray's engine for the file by its first bytes: NetCDF-3 (scipy), NetCDF-4/HDF5 (h5netcdf), GRIB
    (cfgrib, optional)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise DataError(f"ERA5 file {path} cannot be read: {e.strerror or e}") from None
    if head.startswith(b"CDF\x01") or head.startswith(b"CDF\x02"):
        return "scipy"
    if head.startswith(b"\x89HDF"):
        return "h5netcdf"
    if head.startswith(b"GRIB"):
        try:
            import cfgrib  # noqa: F401
        except ImportError:
            raise DataError(
                f"ERA5 file {path} is GRIB, which CloudML reads only with cfgrib: "
                f"{install_command('cfgrib')}, "
                "or download NetCDF from the Climate Data Store (data_format: netcdf)"
            ) from None
        return "cfgrib"
    raise DataError(f"ERA5 file {path} is neither NetCDF nor GRIB (it begins {head[:4]!r})")


def open_dataset(path: Path):
    """The file as an xarray Dataset in one layout: `time` (epoch seconds), `latitude`, `longitude`,
    `level` (hPa) where it has levels; expver and ensemble members resolved. Values unpacked (scale_factor,
    add_offset, _FillValue) by xarray's decoding."""
    import xarray as xr

    path = Path(path)
    engine = _engine(path)
    try:
        ds = xr.open_dataset(path, engine=engine, mask_and_scale=True, decode_times=True)
        ds = ds.load()
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DataError(
            f"ERA5 file {path} cannot be read as NetCDF: {str(e)[:300]}. A download cut short: delete it and "
            "fetch it again (fetch-era5 fetches what is missing)"
        ) from None
    ds = ds.rename({k: v for k, v in {"valid_time": "time", "lat": "latitude", "lon": "longitude"}.items()
                    if k in ds.variables and v not in ds.variables})  # fmt: skip
    if "pressure_level" in ds.dims or "pressure_level" in ds.coords:
        ds = ds.rename({"pressure_level": "level"})
    for coord in ("time", "latitude", "longitude"):
        if coord not in ds.coords:
            raise DataError(
                f"ERA5 file {path} has no {coord!r} coordinate "
                f"(coordinates: {', '.join(map(str, ds.coords))}): "
                "not a file of the Climate Data Store's layout (valid_time or time, latitude, longitude)"
            )
    if "expver" in ds.dims:  # the legacy overlap of ERA5 (1) and ERA5T (5): each hour from the member with it
        merged = ds.isel(expver=0, drop=True)
        for k in range(1, ds.sizes["expver"]):
            merged = merged.fillna(ds.isel(expver=k, drop=True))
        ds = merged
    if "number" in ds.dims:  # an ensemble dimension: the reanalysis is member 0
        ds = ds.sel(number=0) if 0 in ds["number"].values else ds.isel(number=0)
    ds = ds.drop_vars([v for v in ("expver", "number") if v in ds.coords], errors="ignore")
    if "level" in ds.coords:
        units = str(ds["level"].attrs.get("units", "hPa"))
        if units not in PRESSURE_UNITS:
            raise DataError(
                f"ERA5 file {path}: pressure levels in {units!r}; expected hPa ({', '.join(PRESSURE_UNITS)})"
            )
    return ds.assign_coords(time=_epoch_seconds(ds["time"].values, path))


def _epoch_seconds(times: np.ndarray, path: Path) -> np.ndarray:
    t = np.atleast_1d(times)
    if np.issubdtype(t.dtype, np.datetime64):
        return t.astype("datetime64[ns]").astype(np.int64) / 1e9
    raise DataError(
        f"ERA5 file {path}: its times could not be read as dates (units {t.dtype}); the CDS writes "
        "'seconds since 1970-01-01' (valid_time) or 'hours since 1900-01-01' (time)"
    )


def _check_units(da, name: str, q: Quantity, path: Path) -> None:
    units = str(da.attrs.get("units", "")).strip()
    if units not in q.units:
        raise DataError(
            f"ERA5 file {path}: {name} ({q.what}) is in {units or 'no stated unit'!r}; expected "
            f"{q.units[0]!r}, as the Climate Data Store writes it. Download it again from the CDS "
            "(fetch-era5 fetches what is missing), or convert the variable and its units attribute"
        )
    finite = np.asarray(da.values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if finite.size and (finite.min() < q.low or finite.max() > q.high):
        raise DataError(
            f"ERA5 file {path}: {name} ({q.what}) holds values from {finite.min():g} to {finite.max():g} "
            f"{units}, outside what is physically possible ({q.low:g} to {q.high:g} {units}): a damaged "
            "file, or a variable of another unit under ERA5's name. Delete it and fetch it again"
        )


def _ordered(values: np.ndarray, times, lats, lons, name: str, path: Path, level=None) -> Grid:
    """A (time, lat, lon) array in ascending times and latitudes, and longitudes contiguous in the
    convention (-180..180 or 0..360) in which the grid is regular."""
    times, lats, lons = (np.asarray(x, dtype=np.float64) for x in (times, lats, lons))
    values = np.asarray(values, dtype=np.float64)
    t_order, y_order = np.argsort(times, kind="stable"), np.argsort(lats, kind="stable")
    values = values[t_order][:, y_order]
    times, lats = times[t_order], lats[y_order]
    if np.any(np.diff(times) <= 0) or np.any(np.diff(lats) <= 0):
        raise DataError(f"ERA5 file {path}: {name} repeats a time or a latitude: not one grid")
    best = None
    for convention in (180, 360):
        lon = _in_convention(lons, convention)
        order = np.argsort(lon, kind="stable")
        steps = np.diff(lon[order])
        if np.all(steps > 0) and (steps.size == 0 or np.ptp(steps) <= 1e-6 * max(1.0, steps.max())):
            best = (convention, lon[order], values[:, :, order])
            break
    if best is None:  # not regular in either: keep -180..180, sorted (bilinear between neighbours still)
        lon = _in_convention(lons, 180)
        order = np.argsort(lon, kind="stable")
        best = (180, lon[order], values[:, :, order])
    convention, lons, values = best
    return Grid(name, path, times, lats, lons, values, convention, level)


def _in_convention(lon, convention: int) -> np.ndarray:
    lon = np.asarray(lon, dtype=np.float64)
    return np.mod(lon, 360.0) if convention == 360 else np.mod(lon + 180.0, 360.0) - 180.0


# Files this process has read, by their path and the SHA-256 of their bytes (a file changed since, by any
# byte, is read and checked again), the most recently used last; their grids read-only and shared. Bounded by
# the size of the grids kept (decoded floats: a packed file takes four times its size); a file whose grids
# would not fit is read each time.
_KEPT: OrderedDict[tuple[str, str], Era5] = OrderedDict()
_KEPT_LOCK = threading.Lock()
KEPT_BYTES = 256 << 20


def read_file(path: Path, keep: bool = True) -> Era5:
    """The ERA5 variables of one file (single levels, or pressure levels within 1000-700 hPa): read, or as
    this process read the same bytes before. `keep`: False for a file read once only (a download checked
    before it is named)."""
    path = Path(path)
    before = _digest(path) if keep else None
    key = (str(path), before) if before else None
    found = None
    if key is not None:
        with _KEPT_LOCK:
            found = _KEPT.get(key)
            if found is not None:
                _KEPT.move_to_end(key)
    if found is None:
        found = _read_file(path)
        # kept where the file was not rewritten during the parse and its grids fit
        if key is not None and _digest(path) == before and _nbytes(found) <= KEPT_BYTES:
            for grid in found.grids.values():
                for a in (grid.times, grid.lats, grid.lons, grid.values):
                    a.setflags(write=False)
            with _KEPT_LOCK:
                _KEPT[key] = found
                while sum(_nbytes(e) for e in _KEPT.values()) > KEPT_BYTES:
                    _KEPT.popitem(last=False)
    return replace(found, grids=dict(found.grids), files=list(found.files), missing=dict(found.missing))


def _digest(path: Path) -> str | None:
    """The SHA-256 of a regular file's bytes; None for anything else, or a file that cannot be read (read
    without the memory: open_dataset names what is wrong)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None  # a FIFO or a device would not end
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def _nbytes(found: Era5) -> int:
    return sum(g.times.nbytes + g.lats.nbytes + g.lons.nbytes + g.values.nbytes for g in found.grids.values())


def _read_file(path: Path) -> Era5:
    ds = open_dataset(path)
    found = Era5(files=[Path(path)])
    for name in ds.data_vars:
        da = ds[name]
        q = SINGLE.get(name) or LEVELS.get(name)
        if q is None:
            continue
        if ("level" in da.dims) != (name in LEVELS):
            raise DataError(
                f"ERA5 file {path}: {name} ({q.what}) is "
                f"{'on pressure levels' if 'level' in da.dims else 'without pressure levels'}; ERA5 has it "
                f"{'on pressure levels' if name in LEVELS else 'on single levels'}"
            )
        _check_units(da, name, q, path)
        if "level" in da.dims:
            for p in ds["level"].values:
                p = float(p)
                if LEVEL_RANGE_HPA[0] <= p <= LEVEL_RANGE_HPA[1]:
                    one = da.sel(level=p).transpose("time", "latitude", "longitude")
                    key = f"{name}{p:g}"
                    found.grids[key] = _ordered(
                        one.values, ds["time"].values, ds["latitude"].values, ds["longitude"].values, key,
                        Path(path), level=p,
                    )  # fmt: skip
        else:
            one = da.transpose("time", "latitude", "longitude")
            found.grids[name] = _ordered(
                one.values, ds["time"].values, ds["latitude"].values, ds["longitude"].values, name, Path(path)
            )
    if not found.grids:
        known = ", ".join([*SINGLE, *LEVELS])
        raise DataError(
            f"ERA5 file {path} holds none of the variables CloudML reads ({known}); it has: "
            f"{', '.join(map(str, ds.data_vars)) or 'no variable'}"
        )
    return found


def read_files(paths: list[Path]) -> Era5:
    """The variables of several files (a flight's single and pressure levels, or a campaign's): a variable
    in two files is refused (which one would be meant is not known); what is missing is named with what it
    affects."""
    out = Era5()
    for path in paths:
        one = read_file(Path(path))
        for name, grid in one.grids.items():
            out.grids[name] = _joined(out.grids[name], grid) if name in out.grids else grid
        out.files.append(Path(path))
    for name, q in SINGLE.items():
        if name not in out.grids:
            out.missing[name] = f"{q.what}: {q.feeds}"
    if not any(g.level is not None for g in out.grids.values()):
        out.missing["pressure levels"] = "lower-tropospheric stability and estimated inversion strength"
    return out


def _joined(a: Grid, b: Grid) -> Grid:
    """One variable from two files of the same grid and different hours (a flight across midnight, fetched a
    day at a time), joined in time; two files holding the same hour, or other grids, are refused."""
    same_grid = (
        a.convention == b.convention
        and a.level == b.level
        and a.lats.shape == b.lats.shape
        and a.lons.shape == b.lons.shape
        and np.allclose(a.lats, b.lats)
        and np.allclose(a.lons, b.lons)
    )
    if not same_grid or np.intersect1d(a.times, b.times).size:
        raise DataError(
            f"ERA5 files {a.path.name} and {b.path.name} both hold {a.name}"
            + (" for the same hours" if same_grid else " on different grids")
            + ": keep one file per variable and hour for a flight (or one campaign file)"
        )
    times = np.concatenate([a.times, b.times])
    order = np.argsort(times, kind="stable")
    values = np.concatenate([a.values, b.values])[order]
    return Grid(a.name, a.path, times[order], a.lats, a.lons, values, a.convention, a.level)


# ------------------------------------------------------------------------------------------- interpolating


def _bracket(axis: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices i (with i + 1 inside) and weights w of x between axis[i] and axis[i + 1] (linear)."""
    if axis.size == 1:
        return np.zeros(x.shape, int), np.zeros(x.shape)
    i = np.clip(np.searchsorted(axis, x, side="right") - 1, 0, axis.size - 2)
    w = (x - axis[i]) / (axis[i + 1] - axis[i])
    return i, np.clip(w, 0.0, 1.0)


def interpolate(grid: Grid, t, lat, lon, flight: str) -> np.ndarray:
    """`grid` at each frame: linear in time between hours, bilinear in space between grid points. NaN where
    a frame's time or position is unknown (NaN); a frame outside the grid's hours or box: DataError naming
    the flight, the frames and the file's span."""
    t, lat, lon = (np.asarray(x, dtype=np.float64).reshape(-1) for x in (t, lat, lon))
    known = np.isfinite(t) & np.isfinite(lat) & np.isfinite(lon)
    lon_c = _in_convention(lon, grid.convention)
    outside = known & (
        (t < grid.times[0] - GRID_TOLERANCE)
        | (t > grid.times[-1] + GRID_TOLERANCE)
        | (lat < grid.lats[0] - GRID_TOLERANCE)
        | (lat > grid.lats[-1] + GRID_TOLERANCE)
        | (lon_c < grid.lons[0] - GRID_TOLERANCE)
        | (lon_c > grid.lons[-1] + GRID_TOLERANCE)
    )
    if outside.any():
        raise DataError(_outside_message(grid, flight, t, lat, lon, outside))
    out = np.full(t.shape, np.nan)
    if not known.any():
        return out
    ti, tw = _bracket(grid.times, t[known])
    yi, yw = _bracket(grid.lats, lat[known])
    xi, xw = _bracket(grid.lons, lon_c[known])
    v = grid.values
    single_t, single_y, single_x = (n == 1 for n in v.shape)
    t1, y1, x1 = (ti + (0 if single_t else 1), yi + (0 if single_y else 1), xi + (0 if single_x else 1))

    def plane(k):
        return (
            v[k, yi, xi] * (1 - yw) * (1 - xw)
            + v[k, yi, x1] * (1 - yw) * xw
            + v[k, y1, xi] * yw * (1 - xw)
            + v[k, y1, x1] * yw * xw
        )

    out[known] = plane(ti) * (1 - tw) + plane(t1) * tw
    return out


def _outside_message(grid: Grid, flight: str, t, lat, lon, outside: np.ndarray) -> str:
    import datetime as dt

    def when(s: float) -> str:
        return dt.datetime.fromtimestamp(s, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    idx = np.flatnonzero(outside)
    first = int(idx[0])
    lo, hi = (grid.lons[0], grid.lons[-1])
    west, east = _in_convention(lo, 180), _in_convention(hi, 180)
    box = f"{grid.lats[0]:g} to {grid.lats[-1]:g} N, {west:g} to {east:g} E"
    return (
        f"flight {flight}: {idx.size} frame(s) lie outside ERA5 file {grid.path.name}'s hours or box "
        f"({grid.name}: {when(grid.times[0])} to {when(grid.times[-1])}, {box}), e.g. frame {first} at "
        f"{when(t[first]) if math.isfinite(t[first]) else 'an unknown time'}, {lat[first]:.3f} N "
        f"{lon[first]:.3f} E. CloudML does not extrapolate the atmosphere: download a box and hours that "
        "hold "
        "the whole flight (the fetch command computes them from the nav files)"
    )


# ---------------------------------------------------------------------------------------- finding, deriving

ERA5_NAME = re.compile(r"^era5.*\.(nc|nc4|netcdf|grib|grb|grib2)$", re.IGNORECASE)


def find_files(data_dir: Path, flight_folder: Path) -> list[Path]:
    """A flight's ERA5 files: those in its own folder (names beginning "ERA5", NetCDF or GRIB), else a
    campaign's beside the flights (in a folder between the flight's and data.dir, nearest first). Sorted;
    empty where there are none."""
    root, here = Path(data_dir).resolve(), Path(flight_folder).resolve()
    folders = [here, *[p for p in here.parents if p == root or root in p.parents]]
    for folder in folders:
        found = sorted(p for p in folder.iterdir() if p.is_file() and ERA5_NAME.match(p.name))
        if found:
            return found
        if folder == root:
            break
    return []


# The predictors and what each needs: name -> (unit, the variables, what it is)
PREDICTORS = {
    "t2m": ("K", ("t2m",), "2 m air temperature"),
    "sea_surface_temperature": (
        "K",
        ("sst|skt",),
        "the sea's surface temperature (skin where sst is missing)",
    ),
    "sea_air_difference": ("K", ("sst|skt", "t2m"), "sea surface less 2 m air temperature"),
    "relative_humidity": ("1", ("t2m", "d2m"), "2 m relative humidity over liquid water"),
    "lcl_height": ("m", ("sp", "t2m", "d2m"), "lifting condensation level of surface air (Romps 2017)"),
    "boundary_layer_height": ("m", ("blh",), "ERA5's boundary layer height"),
    "column_water_vapour": ("kg m-2", ("tcwv",), "total column water vapour"),
    "low_cloud_cover": ("1", ("lcc",), "ERA5's low cloud cover"),
    "wind_speed": ("m s-1", ("u10", "v10"), "10 m wind speed"),
    "lts": ("K", ("t700", "t2m", "sp"), "lower-tropospheric stability (Klein and Hartmann 1993)"),
    "eis": (
        "K",
        ("t700", "z700", "t2m", "sp", "d2m"),
        "estimated inversion strength (Wood and Bretherton 2006)",
    ),
}


def _has(found: Era5, need: str) -> bool:
    return any(n in found.grids for n in need.split("|"))


def available_predictors(found: Era5) -> tuple[list[str], dict[str, str]]:
    """The predictors `found` allows, and each other one with the variables it lacks."""
    ok, lacking = [], {}
    for name, (_, needs, _) in PREDICTORS.items():
        missing = [n.replace("|", " or ") for n in needs if not _has(found, n)]
        if missing:
            lacking[name] = ", ".join(missing)
        else:
            ok.append(name)
    return ok, lacking


def predictors_at(
    found: Era5, t, lat, lon, flight: str, names: list[str] | None = None
) -> dict[str, np.ndarray]:
    """Each predictor (PREDICTORS, or `names`) at each frame: the variables interpolated, then derived
    (atmosphere.py). A frame outside the files' hours or box is refused by name (DataError)."""
    from cloudml_lib.data import atmosphere as atm

    names = names or available_predictors(found)[0]
    cache: dict[str, np.ndarray] = {}

    def v(name: str) -> np.ndarray:
        if name not in cache:
            if name == "sst|skt":
                sea = v("sst") if "sst" in found.grids else np.full(np.shape(t), np.nan)
                if "skt" in found.grids:
                    sea = np.where(np.isfinite(sea), sea, v("skt"))
                cache[name] = sea
            else:
                cache[name] = found.at(name, t, lat, lon, flight)
        return cache[name]

    derive = {
        "t2m": lambda: v("t2m"),
        "sea_surface_temperature": lambda: v("sst|skt"),
        "sea_air_difference": lambda: atm.sea_air_difference(v("sst|skt"), v("t2m")),
        "relative_humidity": lambda: atm.relative_humidity(v("t2m"), v("d2m")),
        "lcl_height": lambda: atm.lcl_height(v("sp"), v("t2m"), v("d2m")),
        "boundary_layer_height": lambda: v("blh"),
        "column_water_vapour": lambda: v("tcwv"),
        "low_cloud_cover": lambda: v("lcc"),
        "wind_speed": lambda: atm.wind_speed(v("u10"), v("v10")),
        "lts": lambda: atm.lower_tropospheric_stability(v("t700"), v("t2m"), v("sp")),
        "eis": lambda: atm.estimated_inversion_strength(
            v("t700"),
            atm.geopotential_height(v("z700")),
            v("t2m"),
            v("sp"),
            atm.lcl_height(v("sp"), v("t2m"), v("d2m")),
        ),
    }
    unknown = [n for n in names if n not in derive]
    if unknown:
        raise DataError(f"unknown atmosphere predictor(s) {unknown}; valid: {', '.join(PREDICTORS)}")
    return {name: derive[name]() for name in names}
