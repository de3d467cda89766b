"""What to ask the Copernicus Climate Data Store for: the ERA5 box and hours of a flight, from its frames'
times and positions (the nav file), and the requests that fetch exactly those.

- The box: the frames' latitudes and longitudes, widened to the 0.25 degree grid points around them and one
  grid step more on each side, so that every frame lies between four grid points with room for a position
  read a little differently (the bilinear interpolation of era5.py never extrapolates). A track across the
  date line keeps one box, in longitudes east of 0..360 (the CDS's `area` takes [north, west, south, east],
  east beyond 180 there).
- The hours: every UTC hour from the one before the first frame to the one after the last (linear in time
  between hours, never beyond). A flight across midnight gets one request per UTC day, each with its own
  hours: nothing outside the flight's hours is asked for.
- Two datasets: `reanalysis-era5-single-levels` (SINGLE's variables) and `reanalysis-era5-pressure-levels`
  (LEVELS' variables at 1000, 925, 850 and 700 hPa), NetCDF, the reanalysis product.

The request's keys (`product_type`, `variable`, `year`, `month`, `day`, `time`, `pressure_level`, `area`,
`data_format`, `download_format`) are those the CDS API documents for these two datasets."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cloudml_lib.base.errors import DataError

GRID_STEP = 0.25  # degrees: ERA5's grid on the CDS
SINGLE_DATASET = "reanalysis-era5-single-levels"
LEVELS_DATASET = "reanalysis-era5-pressure-levels"
PRESSURE_LEVELS = ("700", "850", "925", "1000")  # hPa, the lower troposphere read by era5.py
# The CDS's long names of the variables era5.py reads by their short names (era5.SINGLE, era5.LEVELS)
SINGLE_VARIABLES = {
    "t2m": "2m_temperature",
    "d2m": "2m_dewpoint_temperature",
    "sst": "sea_surface_temperature",
    "skt": "skin_temperature",
    "sp": "surface_pressure",
    "msl": "mean_sea_level_pressure",
    "blh": "boundary_layer_height",
    "tcwv": "total_column_water_vapour",
    "lcc": "low_cloud_cover",
    "u10": "10m_u_component_of_wind",
    "v10": "10m_v_component_of_wind",
}
LEVEL_VARIABLES = {
    "t": "temperature",
    "q": "specific_humidity",
    "z": "geopotential",
    "r": "relative_humidity",
}


@dataclass(frozen=True)
class Box:
    """[north, west, south, east] in degrees, on the 0.25 degree grid; east > west (east beyond 180 for a
    box across the date line)."""

    north: float
    west: float
    south: float
    east: float

    def area(self) -> list[float]:
        return [self.north, self.west, self.south, self.east]


@dataclass(frozen=True)
class Request:
    """One CDS request: its dataset, its keys, and the file it is written to."""

    dataset: str
    keys: dict
    target: str  # a file name in the flight's folder ("ERA5_..."; era5.find_files finds it)


def flight_box(lat, lon, flight: str) -> Box:
    """The grid box around the frames' positions (degrees north, east in either convention)."""
    lat, lon = np.asarray(lat, dtype=np.float64), np.asarray(lon, dtype=np.float64)
    ok = np.isfinite(lat) & np.isfinite(lon)
    if not ok.any():
        raise DataError(
            f"flight {flight}: no frame has a position (latitude and longitude from its nav file), so the "
            "ERA5 box cannot be computed: check the nav file (data.keys.nav_lat, data.keys.nav_lon)"
        )
    lat, lon = lat[ok], lon[ok]
    east180 = np.mod(lon + 180.0, 360.0) - 180.0
    east360 = np.mod(lon, 360.0)
    # the convention in which the track is narrower: across the date line, 0..360 keeps it one box
    lon = east360 if np.ptp(east360) + 1.0 < np.ptp(east180) else east180  # not for a rounding's difference
    snap_down = lambda x: math.floor(x / GRID_STEP) * GRID_STEP - GRID_STEP  # noqa: E731
    snap_up = lambda x: math.ceil(x / GRID_STEP) * GRID_STEP + GRID_STEP  # noqa: E731
    north, south = min(90.0, snap_up(lat.max())), max(-90.0, snap_down(lat.min()))
    return Box(north, snap_down(lon.min()), south, snap_up(lon.max()))


def flight_hours(times, flight: str) -> dict[dt.date, list[int]]:
    """The UTC hours to fetch, by day: from the hour before the first frame to the hour after the last
    (epoch seconds; NaN for a frame without a time)."""
    t = np.asarray(times, dtype=np.float64)
    t = t[np.isfinite(t)]
    if t.size == 0:
        raise DataError(f"flight {flight}: no frame has a time, so the ERA5 hours cannot be computed")
    first = math.floor(t.min() / 3600.0) * 3600.0
    last = math.ceil(t.max() / 3600.0) * 3600.0
    if last == first:
        last += 3600.0
    by_day: dict[dt.date, list[int]] = {}
    for s in np.arange(first, last + 1.0, 3600.0):
        when = dt.datetime.fromtimestamp(float(s), dt.timezone.utc)
        by_day.setdefault(when.date(), []).append(when.hour)
    return by_day


def flight_requests(flight: str, times, lat, lon, levels: bool = True) -> list[Request]:
    """The requests that fetch a flight's ERA5: single levels (and pressure levels with `levels`), one
    request per UTC day of the flight, each exactly its hours and the flight's box."""
    box = flight_box(lat, lon, flight)
    out = []
    for day, hours in sorted(flight_hours(times, flight).items()):
        common = {
            "product_type": ["reanalysis"],
            "year": [f"{day.year:04d}"],
            "month": [f"{day.month:02d}"],
            "day": [f"{day.day:02d}"],
            "time": [f"{h:02d}:00" for h in hours],
            "area": box.area(),
            "data_format": "netcdf",
            "download_format": "unarchived",
        }
        stamp = day.strftime("%Y%m%d")
        out.append(
            Request(
                SINGLE_DATASET,
                {**common, "variable": list(SINGLE_VARIABLES.values())},
                f"ERA5_single_{flight}_{stamp}.nc",
            )
        )
        if levels:
            out.append(
                Request(
                    LEVELS_DATASET,
                    {
                        **common,
                        "variable": list(LEVEL_VARIABLES.values()),
                        "pressure_level": list(PRESSURE_LEVELS),
                    },
                    f"ERA5_pressure_{flight}_{stamp}.nc",
                )
            )
    return out


def flight_track(flight, data) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(epoch seconds, latitude, longitude) of each IR frame of `flight` (a FlightConfig of `data`): the IR
    file's times, the positions from the flight's nav file (NaN where a frame has none)."""
    from cloudml_lib.data import er2, navigation

    paths = er2.flight_paths(flight, data)
    nav_path = paths.get("nav") or (Path(data.dir) / flight.nav_file if flight.nav_file else None)
    if nav_path is None or not Path(nav_path).is_file():
        raise DataError(
            f"flight {flight.name}: no nav file, so its positions (and the ERA5 box) are not known; put its "
            "nav file beside its IR file"
        )
    frame_t = er2.read_ir_times(paths["ir"], flight, data)[0]
    nav = navigation.read_nav(flight, data, Path(nav_path), frame_t)
    return frame_t, nav.values["lat"], nav.values["lon"]
