"""The ERA5 reanalysis of a demo flight (generator version 4): the files fetch-era5 would download for it,
drawn around the atmosphere that made its frames, with the errors of a reanalysis at a point.

What is written: for each request era5_requests makes for the flight (one per UTC day and dataset: the box
of 0.25 degree grid points around the nav positions, every hour from the one before the first frame to the
one after the last), the file of its name in the flight's folder, as the Climate Data Store serves it: the
2024 layout (NetCDF-4, `valid_time` in seconds since 1970, `pressure_level`, `expver` and `number` as
coordinates, floats) or the legacy one (NetCDF-3, `time` in hours since 1900, `level` in millibars, values
packed in 16-bit integers), latitudes descending in both. era5.read_files reads them like downloaded ones.

The truth is the flight's smooth large-scale state (`BoundaryLayer`; the frame-to-frame drift of the cloud
base is not in a 0.25 degree hourly field, so neither the frames alone nor the reanalysis alone gives the
base exactly):
- the sea at the flight's temperature at its mean position, with a gentle gradient (0.3 K per degree,
  cooler to the north and toward the coast, as the upwelling off California makes it); the skin
  0.17 K cooler (the cool skin at moderate winds: Donlon et al. 2002, J. Climate 15, 353);
- the air at 2 m the flight's air-sea difference below the sea; the temperature falls at the flight's
  sub-cloud lapse rate to the cloud base, at the moist rate through the cloud, jumps by the flight's
  inversion strength (6-12 K) at the cloud top, and falls at 6.5 K/km above (the standard atmosphere's
  lapse rate, ICAO 1993); pressures and geopotentials from the hypsometric equation (virtual temperature),
  the surface pressure drawn per flight (1012-1022 hPa) with a gentle gradient, mean sea level the same;
- the dew point at 2 m such that the lifting condensation level of the surface air (atmosphere.lcl_height,
  Romps 2017) is the flight's `lcl_km`: the cloud base where the boundary layer is coupled (well mixed),
  below it where the layer is decoupled (synthetic.BOUNDARY_LAYERS); the vapour well mixed below the base
  (never supersaturated), saturated in the cloud, 30% relative humidity in the dry free troposphere above
  (an assumption, of the order of subsiding air over the eastern Pacific); the column's water vapour summed
  from the surface to 8 km;
- the boundary layer height at the cloud top (the inversion), the low cloud cover the fraction of the flight
  under low cloud, a northwesterly wind at 10 m of 4-9 m/s (drawn per flight).

The reanalysis less the truth at a point: a per-flight bias plus a field smooth in space (about two grid
steps) and time (an hour), each of the size published for ERA5 over the ocean where one was found (ERRORS),
drawn from the flight's own random stream. Sources: the sea's skin temperature differs from shipborne
radiometers (M-AERI) by about 0.2 K (Luo and Minnett 2020, Remote Sens. 12, 1873); ERA5's 10 m wind over
the Atlantic has biases of -0.5 to 0.3 m/s and RMS errors under 1.5 m/s outside storms (Campos et al. 2022,
Remote Sens. 14, 4918); ERA5's daytime boundary layer height is about 130 m too low against radiosondes
(Guo et al. 2021, ACP 21, 17079: tens of percent of a marine layer's height; here a 20% bias and a 10%
field). The 2 m temperature and dew point errors (about 0.6 K and 1 K) are the order the issue states; no
figure for the subtropical ocean was found in the stored sources, so these, and those of the pressure, the
column water, the cloud cover and the pressure levels, are assumptions of a plausible size."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cloudml_lib.data import atmosphere as atm
from cloudml_lib.data import era5_requests

SST_GRADIENT_K_PER_DEG = (-0.3, -0.3)  # per degree north, per degree east (toward the coast)
SKIN_COOLING_K = 0.17  # the skin below the bulk sea (Donlon et al. 2002)
FREE_LAPSE_K_PER_KM = 6.5  # above the inversion: the standard atmosphere's (ICAO 1993)
FREE_RH = 0.3  # relative humidity of the free troposphere above the inversion (assumed)
SP_RANGE_PA = (101200.0, 102200.0)  # the flight's surface pressure (a subtropical high's)
SP_GRADIENT_PA_PER_DEG = 50.0  # rising to the north (assumed, gentle)
WIND_FROM_DEG, WIND_RANGE_M_S = 320.0, (4.0, 9.0)  # northwesterly along the coast
TOP_KM, STEP_KM = 8.0, 0.02  # the column the profile and the column water are computed on
GEOPOTENTIAL_G = 9.80665  # m s-2, ECMWF's standard gravity (atmosphere.geopotential_height)
LEVELS_HPA = (1000.0, 925.0, 850.0, 700.0)  # era5_requests.PRESSURE_LEVELS

# The reanalysis less the truth at a point: (per-flight bias sd, smooth field sd); relative ones (a
# fraction of the value) marked. Sources in the module's docstring.
ERRORS = {
    "sst": (0.2, 0.15, False),  # K, Luo and Minnett (2020): about 0.2 K
    "t2m": (0.5, 0.3, False),  # K, about 0.6 K in all (the order; assumed)
    "d2m": (0.8, 0.5, False),  # K, about 1 K in all (the order; assumed)
    "sp": (40.0, 20.0, False),  # Pa (assumed)
    "blh": (0.2, 0.1, True),  # Guo et al. (2021): tens of percent
    "tcwv": (0.05, 0.03, True),  # assumed
    "lcc": (0.1, 0.1, False),  # assumed
    "u10": (0.4, 1.0, False),  # m/s, Campos et al. (2022)
    "v10": (0.4, 1.0, False),  # m/s, Campos et al. (2022)
    "t": (0.4, 0.3, False),  # K at each pressure level (assumed)
    "q": (0.05, 0.05, True),  # assumed
    "z": (30.0, 20.0, False),  # m2 s-2 (a few metres of height; assumed)
}
UNITS = {"t2m": "K", "d2m": "K", "sst": "K", "skt": "K", "sp": "Pa", "msl": "Pa", "blh": "m",
         "tcwv": "kg m**-2", "lcc": "(0 - 1)", "u10": "m s**-1", "v10": "m s**-1", "t": "K",
         "q": "kg kg**-1", "z": "m**2 s**-2", "r": "%"}  # fmt: skip
ERROR_SCALES = (1.0, 2.0, 2.0)  # the error fields' smoothing: hours, grid steps (latitude, longitude)
LAYOUTS = ("2024", "legacy", "2024")  # flight i's files: LAYOUTS[i % 3] (both layouts among five flights)


@dataclass(frozen=True)
class BoundaryLayer:
    """A flight's smooth large-scale state, the truth its reanalysis is drawn around: the sea (K), the air's
    difference to it at the surface (K), the lapse rates below the cloud base and inside the cloud (K/km),
    the cloud's base and top (km, the flight's means), the lifting condensation level of the surface air (km;
    the base where the layer is coupled, below it where decoupled), the inversion above the top (K) and the
    fraction of the flight under low cloud."""

    sea_k: float
    air_sea_k: float
    lapse_k_per_km: float
    moist_lapse_k_per_km: float
    base_km: float
    top_km: float
    lcl_km: float
    inversion_k: float
    cover: float


@dataclass(frozen=True)
class Track:
    """Each frame's time (epoch seconds) and position (degrees), as the flight's files give them."""

    times: np.ndarray
    lat: np.ndarray
    lon: np.ndarray


def ndimage():
    """scipy.ndimage, imported when flights are made: half a second of every command's start otherwise
    (the commands import this module and synthetic.py, and make flights only for the demo)."""
    from scipy import ndimage as module

    return module


def layout_of(index: int) -> str:
    """The layout of demo flight `index`'s files: "2024" or "legacy"."""
    return LAYOUTS[index % len(LAYOUTS)]


def file_names(flight: str, span) -> list[str]:
    """The files of `flight` whose frames lie within `span` (epoch seconds), as era5_requests names them
    (the position does not enter a name)."""
    anywhere = np.zeros(2)
    return [r.target for r in era5_requests.flight_requests(flight, span, anywhere, anywhere)]


def write_flight(
    folder: Path, flight: str, layer: BoundaryLayer, track: Track, span, layout: str, rng
) -> list[Path]:
    """The ERA5 files of `flight` in `folder` (file_names(flight, span)): the requests' boxes and hours around
    `track`, `layer` with the reanalysis' errors drawn from `rng`, in `layout`. Returns their paths."""
    requests = era5_requests.flight_requests(flight, span, track.lat, track.lon)
    north, west, south, east = requests[0].keys["area"]
    step = era5_requests.GRID_STEP
    lats = np.arange(north, south - step / 2, -step)  # descending, as the CDS serves them
    lons = np.arange(west, east + step / 2, step)
    hours = sorted({_hour(r.keys, h) for r in requests for h in r.keys["time"]})
    centre = (float(np.nanmean(track.lat)), float(np.nanmean(track.lon)))
    fields = _reanalysis(layer, np.array(hours), lats, lons, centre, rng)
    paths = []
    for r in requests:
        here = np.isin(hours, [_hour(r.keys, h) for h in r.keys["time"]])
        levels = r.dataset == era5_requests.LEVELS_DATASET
        names = ("t", "q", "z", "r") if levels else tuple(era5_requests.SINGLE_VARIABLES)
        values = {n: fields[n][here] for n in names}
        path = Path(folder) / r.target
        _write(path, np.array(hours)[here], lats, lons, values, levels, layout)
        paths.append(path)
    return paths


def _hour(keys: dict, hh: str) -> float:
    day = dt.datetime(
        int(keys["year"][0]), int(keys["month"][0]), int(keys["day"][0]), tzinfo=dt.timezone.utc
    )
    return day.timestamp() + 3600.0 * int(hh[:2])


# ------------------------------------------------------------------------------------------------ the truth


def _reanalysis(layer: BoundaryLayer, hours, lats, lons, centre, rng) -> dict[str, np.ndarray]:
    """Every variable on (time, lat, lon), pressure levels on (time, level, lat, lon): the truth of `layer`
    (constant in time, a gentle gradient in space) plus the reanalysis' errors."""
    sp0 = rng.uniform(*SP_RANGE_PA)
    speed, direction = rng.uniform(*WIND_RANGE_M_S), np.radians(WIND_FROM_DEG + rng.normal(0.0, 15.0))
    y, x = np.meshgrid(lats - centre[0], lons - centre[1], indexing="ij")
    sea = layer.sea_k + SST_GRADIENT_K_PER_DEG[0] * y + SST_GRADIENT_K_PER_DEG[1] * x
    truth = {
        "sst": sea,
        "t2m": sea - layer.air_sea_k,
        "sp": sp0 + SP_GRADIENT_PA_PER_DEG * y,
        "blh": np.full(y.shape, 1000.0 * layer.top_km),
        "lcc": np.full(y.shape, layer.cover),
        "u10": np.full(y.shape, -speed * np.sin(direction)),  # the wind blows from `direction`
        "v10": np.full(y.shape, -speed * np.cos(direction)),
    }
    truth["d2m"] = dew_point_for_lcl(truth["sp"], truth["t2m"], 1000.0 * layer.lcl_km)
    profile = column(layer, truth["t2m"].ravel(), truth["sp"].ravel(), truth["d2m"].ravel())
    truth["tcwv"] = profile.pop("tcwv").reshape(y.shape)
    shape = (len(hours), *y.shape)
    out = {}
    for name in ("sst", "t2m", "d2m", "sp", "blh", "tcwv", "lcc", "u10", "v10"):
        out[name] = _with_error(np.broadcast_to(truth[name], shape), name, rng)
    out["d2m"] = np.minimum(out["d2m"], out["t2m"])  # a dew point never above the temperature
    out["lcc"] = np.clip(out["lcc"], 0.0, 1.0)
    out["skt"] = out["sst"] - SKIN_COOLING_K
    out["msl"] = out["sp"]  # over the sea the surface is mean sea level
    for name in ("t", "q", "z"):
        levels = [_with_error(np.broadcast_to(v.reshape(y.shape), shape), name, rng) for v in profile[name]]
        out[name] = np.stack(levels, axis=1)  # (time, level, lat, lon)
    qs = atm.specific_humidity(
        100.0 * np.array(LEVELS_HPA)[None, :, None, None], atm.saturation_vapour_pressure(out["t"])
    )
    out["r"] = np.clip(100.0 * out["q"] / qs, 0.0, 100.0)
    return out


def _with_error(truth: np.ndarray, name: str, rng) -> np.ndarray:
    """`truth` with a per-flight bias and a field smooth over ~2 grid steps and an hour (ERRORS)."""
    bias_sd, field_sd, relative = ERRORS[name]
    pad = [int(np.ceil(4.0 * s)) for s in ERROR_SCALES]  # white noise beyond the edges too: the same field
    noise = rng.standard_normal([n + 2 * p for n, p in zip(truth.shape, pad)])
    noise = ndimage().gaussian_filter(noise, ERROR_SCALES, mode="constant")[tuple(slice(p, -p) for p in pad)]
    error = rng.normal(0.0, bias_sd) + field_sd * noise / _smoothed_sd()
    return truth * (1.0 + error) if relative else truth + error


def _smoothed_sd() -> float:
    """The standard deviation of unit white noise smoothed over ERROR_SCALES (the filter's own: a small grid's
    sample would take the field's common part for its scale)."""
    impulse = np.zeros(tuple(8 * int(np.ceil(s)) + 1 for s in ERROR_SCALES))
    impulse[tuple(n // 2 for n in impulse.shape)] = 1.0
    return float(np.sqrt(np.square(ndimage().gaussian_filter(impulse, ERROR_SCALES, mode="constant")).sum()))


def dew_point_for_lcl(sp, t2m, lcl_m, iterations: int = 40) -> np.ndarray:
    """K: the 2 m dew point at which surface air at `sp` (Pa) and `t2m` (K) condenses at `lcl_m` metres
    (atmosphere.lcl_height, which falls as the dew point rises; by bisection)."""
    low, high = np.asarray(t2m, dtype=np.float64) - 30.0, np.asarray(t2m, dtype=np.float64)
    for _ in range(iterations):
        mid = (low + high) / 2.0
        too_low = atm.lcl_height(sp, t2m, mid) > lcl_m  # condenses too high: the air is too dry
        low, high = np.where(too_low, mid, low), np.where(too_low, high, mid)
    return (low + high) / 2.0


def column(layer: BoundaryLayer, t2m, sp, d2m) -> dict:
    """The profile of each column (surface `t2m` K, `sp` Pa, `d2m` K; N columns): temperature (K), specific
    humidity (kg/kg) and geopotential (m2 s-2) at LEVELS_HPA (each a list of (N,) arrays, a level each), and
    the column's water vapour (kg m-2, (N,))."""
    z = np.arange(0.0, TOP_KM + STEP_KM / 2, STEP_KM)  # (Z,) km
    base, top = layer.base_km, layer.top_km
    t = (
        t2m[:, None]
        - layer.lapse_k_per_km * np.minimum(z, base)
        - layer.moist_lapse_k_per_km * np.clip(z - base, 0.0, top - base)
        + layer.inversion_k * (z >= top)
        - FREE_LAPSE_K_PER_KM * np.maximum(z - top, 0.0)
    )  # (N, Z)
    q_surface = atm.specific_humidity(sp, atm.saturation_vapour_pressure(d2m))[:, None]
    p = _hypsometric(sp, t, z)
    for _ in range(2):  # the vapour from the pressure, the pressure from the virtual temperature
        qs = atm.specific_humidity(p, atm.saturation_vapour_pressure(t))
        q = np.where(z < base, np.minimum(q_surface, qs), np.where(z < top, qs, FREE_RH * qs))
        p = _hypsometric(sp, t * (1.0 + 0.608 * q), z)
    rho_v = q * p / (atm.R_AIR * t * (1.0 + 0.608 * q))
    out = {"t": [], "q": [], "z": [], "tcwv": rho_v.sum(axis=1) * 1000.0 * STEP_KM}
    for level in LEVELS_HPA:
        at = np.array([np.interp(np.log(100.0 * level), np.log(p[k, ::-1]), z[::-1]) for k in range(len(p))])
        out["z"].append(GEOPOTENTIAL_G * 1000.0 * at)
        out["t"].append(np.array([np.interp(a, z, t[k]) for k, a in enumerate(at)]))
        out["q"].append(np.array([np.interp(a, z, q[k]) for k, a in enumerate(at)]))
    return out


def _hypsometric(sp, tv, z) -> np.ndarray:
    """(N, Z) Pa: the pressure at heights `z` (km) above surfaces at `sp` (Pa) of air at virtual temperature
    `tv` (N, Z) (K): d ln p / dz = -g / (R Tv), trapezoids."""
    inv = atm.GRAVITY / (atm.R_AIR * tv)
    steps = 0.5 * (inv[:, 1:] + inv[:, :-1]) * np.diff(z)[None, :] * 1000.0
    return np.asarray(sp, dtype=np.float64)[:, None] * np.exp(
        -np.concatenate([np.zeros((len(tv), 1)), np.cumsum(steps, axis=1)], axis=1)
    )


# ------------------------------------------------------------------------------------------------ the files


def _write(path: Path, hours, lats, lons, values: dict, levels: bool, layout: str) -> None:
    """One file of the CDS's `layout` ("2024" or "legacy")."""
    import xarray as xr

    times = np.asarray(hours).astype("datetime64[s]")
    legacy = layout == "legacy"
    time_dim, level_dim = ("time", "level") if legacy else ("valid_time", "pressure_level")
    dims = (time_dim, level_dim, "latitude", "longitude") if levels else (time_dim, "latitude", "longitude")
    order = slice(None, None, -1) if legacy else slice(None)  # 700 hPa first in one layout: either is read
    data = {}
    for name, v in values.items():
        v = v[:, order] if levels else v
        data[name] = (dims, v if legacy else v.astype(np.float32), {"units": UNITS[name]})
    coords = {
        time_dim: (time_dim, times),
        "latitude": ("latitude", lats, {"units": "degrees_north", "long_name": "latitude"}),
        "longitude": ("longitude", lons, {"units": "degrees_east", "long_name": "longitude"}),
    }
    if levels:
        hpa = np.array(LEVELS_HPA)[order]
        coords[level_dim] = (
            (level_dim, hpa.astype(np.int32), {"units": "millibars", "long_name": "pressure_level"})
            if legacy
            else (level_dim, hpa, {"units": "hPa", "long_name": "pressure"})
        )
    if not legacy:
        coords["number"] = ((), 0)
        coords["expver"] = (time_dim, np.array(["0001"] * len(times)))
    attrs = {"Conventions": "CF-1.7" if not legacy else "CF-1.6", "history": "CloudML demo (synthetic ERA5)"}
    ds = xr.Dataset(data, coords=coords, attrs=attrs)
    if legacy:
        encoding = {n: _packing(np.asarray(v[1])) for n, v in data.items()}
        encoding["time"] = {"units": "hours since 1900-01-01 00:00:00.0", "dtype": "int32"}
        ds.to_netcdf(path, engine="scipy", encoding=encoding)
    else:
        ds.to_netcdf(
            path,
            engine="h5netcdf",
            encoding={"valid_time": {"units": "seconds since 1970-01-01", "dtype": "int64"}},
        )


def _packing(v: np.ndarray) -> dict:
    """The legacy CDS's 16-bit packing of `v`: its range over the integers -32766..32766 (-32767 is the fill
    value, which a value packed onto it would become)."""
    low, high = float(np.nanmin(v)), float(np.nanmax(v))
    scale = max(high - low, 1e-9 * max(abs(high), 1.0)) / 65532.0
    return {
        "dtype": "int16",
        "scale_factor": scale,
        "add_offset": (high + low) / 2.0,
        "_FillValue": np.int16(-32767),
    }
