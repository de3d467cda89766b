"""ERA5 files as the Climate Data Store serves them (data/era5.py) and the predictors derived from them
(data/atmosphere.py): both NetCDF layouts, both longitude conventions, latitudes either way up, packed
values, the interpolation against values computed by hand, a frame outside the box refused by name."""

import datetime as dt
import logging
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from cloudml_lib.base.errors import DataError
from cloudml_lib.data import atmosphere, era5

T0 = dt.datetime(2025, 3, 1, 18, tzinfo=dt.timezone.utc).timestamp()  # 18 UTC on a flight day
HOUR = 3600.0


def field(t_hours, lat, lon):
    """A value linear in time, latitude and longitude (what linear and bilinear interpolation reproduce
    exactly): 285 K + 0.5 K per hour + 0.2 K per degree north - 0.1 K per degree east (east of 0..360)."""
    return 285.0 + 0.5 * t_hours + 0.2 * lat - 0.1 * lon


def grid_values(hours, lats, lons, east360=True):
    t, y, x = np.meshgrid(hours, lats, np.mod(lons, 360.0) if east360 else lons, indexing="ij")
    return field(t, y, x)


def new_layout(path, lons=(200.0, 200.25, 200.5), lats=(30.5, 30.25, 30.0), hours=(0, 1, 2), extra=None):
    """The 2024 CDS's single-levels file: valid_time in seconds since 1970, latitude descending, expver and
    number as coordinates, NetCDF-4, floats."""
    times = np.array([T0 + h * HOUR for h in hours]).astype("datetime64[s]")
    values = grid_values(np.array(hours, float), np.array(lats), np.array(lons)).astype(np.float32)
    ds = xr.Dataset(
        {
            "t2m": (("valid_time", "latitude", "longitude"), values, {"units": "K"}),
            "d2m": (("valid_time", "latitude", "longitude"), values - 3.0, {"units": "K"}),
            **(extra or {}),
        },
        coords={
            "valid_time": ("valid_time", times),
            "latitude": (
                "latitude",
                np.array(lats),
                {"units": "degrees_north", "stored_direction": "decreasing"},
            ),
            "longitude": ("longitude", np.array(lons), {"units": "degrees_east"}),
            "number": 0,
            "expver": ("valid_time", np.array(["0001"] * len(hours))),
        },
    )
    ds.to_netcdf(path, engine="h5netcdf", encoding={"valid_time": {"units": "seconds since 1970-01-01"}})
    return path


def legacy_layout(path, lons=(-160.0, -159.75, -159.5), lats=(30.5, 30.25, 30.0), hours=(0, 1, 2)):
    """The legacy CDS's file: time in hours since 1900, NetCDF-3, values packed in 16-bit integers, and the
    ERA5/ERA5T overlap as an expver dimension (ERA5 for the first two hours, ERA5T for the last)."""
    times = np.array([T0 + h * HOUR for h in hours]).astype("datetime64[s]")
    values = grid_values(np.array(hours, float), np.array(lats), np.array(lons))
    both = np.stack([values, values])
    both[0, 2:] = np.nan  # ERA5 has not reached the last hour
    both[1, :2] = np.nan  # ERA5T holds only it
    ds = xr.Dataset(
        {"t2m": (("time", "expver", "latitude", "longitude"), both.transpose(1, 0, 2, 3), {"units": "K"})},
        coords={"time": times, "expver": [1, 5], "latitude": np.array(lats), "longitude": np.array(lons)},
    )
    packing = {"dtype": "int16", "scale_factor": 0.001, "add_offset": 290.0, "_FillValue": np.int16(-32767)}
    ds.to_netcdf(
        path,
        engine="scipy",
        encoding={"t2m": packing, "time": {"units": "hours since 1900-01-01 00:00:00.0", "dtype": "int32"}},
    )
    return path


def test_the_2024_layout_is_read_and_interpolated_linearly_in_time_and_bilinearly_in_space(tmp_path):
    found = era5.read_files([new_layout(tmp_path / "era5.nc")])
    assert found.names() == ["d2m", "t2m"] and "sst" in found.missing and "pressure levels" in found.missing
    assert "sea-air difference" in found.missing["sst"]  # what is missing, with what it affects
    t = np.array([T0, T0 + 1.5 * HOUR, T0 + 2 * HOUR])
    lat = np.array([30.0, 30.1, 30.5])
    lon = np.array([200.0, -159.8, 200.5])  # either convention for the frames
    got = found.at("t2m", t, lat, lon, "01Mar25")
    want = field(np.array([0.0, 1.5, 2.0]), lat, np.mod(lon, 360.0))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)  # float32 in the file
    # a point between four grid points: the mean of the corners, by hand
    g = found.grids["t2m"]
    centre = found.at("t2m", [T0], [30.125], [200.125], "x")[0]
    corners = g.values[0, 0:2, 0:2]
    assert g.lats[0] < g.lats[1] and centre == pytest.approx(corners.mean(), abs=1e-9)


def test_the_legacy_layout_packed_with_expver_reads_the_same_values(tmp_path):
    found = era5.read_files([legacy_layout(tmp_path / "old.nc")])
    t = np.array([T0 + 0.5 * HOUR, T0 + 1.75 * HOUR])  # the second between ERA5's hour and ERA5T's
    lat, lon = np.array([30.2, 30.4]), np.array([-159.9, 200.3])
    got = found.at("t2m", t, lat, lon, "01Mar25")
    np.testing.assert_allclose(
        got, field(np.array([0.5, 1.75]), lat, np.mod(lon, 360.0)), atol=2e-3
    )  # packed


def test_a_grid_across_the_date_line_is_one_box_in_either_convention(tmp_path):
    for lons in ((179.75, 180.0, 180.25), (179.75, -180.0, -179.75)):
        path = new_layout(tmp_path / f"dl{lons[1]}.nc", lons=lons)
        found = era5.read_files([path])
        lon = np.array([179.9, -179.9, 180.1])
        got = found.at("t2m", np.full(3, T0), np.full(3, 30.25), lon, "x")
        np.testing.assert_allclose(got, field(0.0, 30.25, np.mod(lon, 360.0)), atol=1e-4)


def test_a_frame_outside_the_box_or_the_hours_is_refused_by_name_never_extrapolated(tmp_path):
    found = era5.read_files([new_layout(tmp_path / "era5.nc")])
    with pytest.raises(
        DataError, match=r"flight 01Mar25: 1 frame\(s\) lie outside ERA5 file era5.nc.*frame 1"
    ):
        found.at("t2m", [T0, T0], [30.2, 31.0], [200.1, 200.1], "01Mar25")
    with pytest.raises(DataError, match=r"frame 0 at 2025-03-01 21:00 UTC"):
        found.at("t2m", [T0 + 3 * HOUR], [30.2], [200.1], "01Mar25")  # after the file's last hour
    unknown = found.at("t2m", [np.nan, T0], [30.2, np.nan], [200.1, 200.1], "01Mar25")
    assert np.isnan(unknown).all()  # no time or no position: unknown, not refused


def test_a_file_read_again_is_taken_as_read_until_a_byte_of_it_changes(tmp_path, monkeypatch):
    """The start and the end of a run, each fold and each trial read the same files: parsed once while their
    bytes stay the same (the grids read-only, shared), parsed and checked again once any byte changes."""
    path = new_layout(tmp_path / "era5.nc")
    first = era5.read_files([path])
    parsed = []
    monkeypatch.setattr(era5, "_read_file", parsed.append)
    again = era5.read_files([path])
    assert parsed == [] and again.grids.keys() == first.grids.keys()
    np.testing.assert_array_equal(again.grids["t2m"].values, first.grids["t2m"].values)
    assert not again.grids["t2m"].values.flags.writeable  # shared: nothing may change it in place
    again.grids.pop("t2m")  # the containers are each caller's own
    assert "t2m" in era5.read_files([path]).grids
    monkeypatch.undo()
    dims = ("valid_time", "latitude", "longitude")
    new_layout(path, extra={"sst": (dims, np.full((3, 3, 3), 15.0), {"units": "degC"})})  # rewritten
    with pytest.raises(DataError, match=r"sst \(sea surface temperature\) is in 'degC'; expected 'K'"):
        era5.read_files([path])


def test_units_ranges_and_layouts_that_are_not_era5_are_named(tmp_path):
    dims = ("valid_time", "latitude", "longitude")
    bad = new_layout(tmp_path / "c.nc", extra={"sst": (dims, np.full((3, 3, 3), 15.0), {"units": "degC"})})
    with pytest.raises(DataError, match=r"sst \(sea surface temperature\) is in 'degC'; expected 'K'"):
        era5.read_files([bad])
    hot = new_layout(tmp_path / "h.nc", extra={"blh": (dims, np.full((3, 3, 3), 9e4), {"units": "m"})})
    with pytest.raises(DataError, match=r"blh .* 90000 .* outside what is physically possible"):
        era5.read_files([hot])
    (tmp_path / "x.nc").write_bytes(b"not a netcdf file")
    with pytest.raises(DataError, match="neither NetCDF nor GRIB"):
        era5.read_files([tmp_path / "x.nc"])
    (tmp_path / "g.grib").write_bytes(b"GRIB" + bytes(100))
    try:
        import cfgrib  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="pip install"):
            era5.read_files([tmp_path / "g.grib"])


def test_pressure_levels_are_read_between_1000_and_700_hpa(tmp_path):
    times = np.array([T0 + h * HOUR for h in (0, 1)]).astype("datetime64[s]")
    levels = np.array([1000.0, 850.0, 700.0, 500.0])
    shape = (2, 4, 2, 2)
    t = 290.0 - (1000.0 - levels)[None, :, None, None] * 0.05 + np.zeros(shape)
    ds = xr.Dataset(
        {
            "t": (("valid_time", "pressure_level", "latitude", "longitude"), t, {"units": "K"}),
            "z": (
                ("valid_time", "pressure_level", "latitude", "longitude"),
                np.full(shape, 30000.0),
                {"units": "m**2 s**-2"},
            ),
        },  # fmt: skip
        coords={
            "valid_time": times,
            "pressure_level": ("pressure_level", levels, {"units": "hPa"}),
            "latitude": [30.25, 30.0],
            "longitude": [200.0, 200.25],
        },
    )
    ds.to_netcdf(tmp_path / "pl.nc", engine="h5netcdf")
    found = era5.read_files([tmp_path / "pl.nc"])
    assert {"t1000", "t850", "t700", "z700"} <= set(found.grids) and "t500" not in found.grids
    assert "pressure levels" not in found.missing and found.grids["t700"].level == 700.0
    got = found.at("t700", [T0], [30.1], [200.1], "x")[0]
    assert got == pytest.approx(290.0 - 300 * 0.05)


# ------------------------------------------------------------------------------------------ the predictors


def test_the_lcl_meets_saturation_of_the_lifted_parcel_and_agrees_with_espy():
    """Romps's LCL: a parcel lifted dry-adiabatically that far is just saturated (its vapour pressure, carried
    with it in proportion to the pressure, equals saturation at its new temperature); Espy's rule agrees to
    a few percent at the humidity of marine air."""
    p, t = 101000.0, 293.0
    for depression in (1.0, 3.0, 6.0, 10.0):
        td = t - depression
        z = atmosphere.lcl_height(p, t, td)
        rh = atmosphere.relative_humidity(t, td)
        e = rh * atmosphere.saturation_vapour_pressure(t)
        qv = atmosphere.specific_humidity(p, e)
        cpm = (1 - qv) * atmosphere.CP_AIR + qv * atmosphere.CP_VAP
        rm = (1 - qv) * atmosphere.R_AIR + qv * atmosphere.R_VAP
        t_lcl = t - atmosphere.GRAVITY * z / cpm  # the dry adiabat in height
        p_lcl = p * (t_lcl / t) ** (cpm / rm)  # and in pressure
        assert e * p_lcl / p == pytest.approx(atmosphere.saturation_vapour_pressure(t_lcl), rel=1e-6)
        assert z == pytest.approx(atmosphere.lcl_height_espy(t, td), rel=0.06)
    assert atmosphere.lcl_height(p, t, t) == pytest.approx(0.0, abs=1e-6)  # saturated: at the surface
    assert np.isnan(atmosphere.lcl_height(p, np.nan, 290.0))


def test_relative_humidity_stability_and_inversion_strength_against_worked_values():
    assert atmosphere.relative_humidity(300.0, 300.0) == pytest.approx(1.0)
    # Magnus-type curves give 0.543 at 25 C with a 15 C dew point: within 1 %
    assert atmosphere.relative_humidity(298.15, 288.15) == pytest.approx(0.543, rel=0.01)
    # theta(700 hPa) of 280 K: 280 (1000/700)^0.2853 = 310.0 K; surface air 290 K at 1000 hPa: theta 290 K
    lts = atmosphere.lower_tropospheric_stability(280.0, 290.0, 100000.0)
    assert lts == pytest.approx(280.0 * (1000 / 700) ** atmosphere.KAPPA - 290.0)
    assert lts == pytest.approx(20.0, abs=0.05)
    # Wood and Bretherton's expression at 850 hPa and 285 K, by hand: qs = 0.0104, (g/cp)(1 - 1.318/2.727)
    # = 5.0 K/km (the textbook pseudo-adiabat there: 4.7)
    assert 1000 * atmosphere.moist_adiabatic_lapse_rate(285.0, 85000.0) == pytest.approx(5.04, abs=0.05)
    eis = atmosphere.estimated_inversion_strength(280.0, 3100.0, 290.0, 100000.0, 500.0)
    gamma = atmosphere.moist_adiabatic_lapse_rate(285.0, 85000.0)
    assert eis == pytest.approx(lts - gamma * 2600.0)
    assert atmosphere.sea_air_difference(291.0, 290.0) == 1.0
    assert atmosphere.wind_speed(3.0, 4.0) == 5.0


def test_a_flights_own_era5_files_come_before_the_campaigns(tmp_path):
    (tmp_path / "01Mar25").mkdir()
    (tmp_path / "03Mar25").mkdir()
    campaign = new_layout(tmp_path / "ERA5_GLOVE2025_single.nc")
    own = new_layout(tmp_path / "01Mar25" / "era5_single_20250301.nc")
    (tmp_path / "01Mar25" / "notes_era5.txt").write_text("not an ERA5 file by its name")
    assert era5.find_files(tmp_path, tmp_path / "01Mar25") == [own]
    assert era5.find_files(tmp_path, tmp_path / "03Mar25") == [campaign]
    assert era5.find_files(tmp_path / "03Mar25", tmp_path / "03Mar25") == []  # never above data.dir


def test_predictors_are_derived_from_the_interpolated_variables_and_the_missing_ones_named(tmp_path):
    dims = ("valid_time", "latitude", "longitude")
    sst = np.full((3, 3, 3), 291.0)
    sst[:, 0, :] = np.nan  # land under the northern row: the skin temperature stands in
    extra = {
        "sp": (dims, np.full((3, 3, 3), 101000.0), {"units": "Pa"}),
        "sst": (dims, sst, {"units": "K"}),
        "skt": (dims, np.full((3, 3, 3), 289.0), {"units": "K"}),
    }
    found = era5.read_files([new_layout(tmp_path / "era5.nc", extra=extra)])
    ok, lacking = era5.available_predictors(found)
    assert {"sea_air_difference", "lcl_height", "relative_humidity"} <= set(ok)
    assert lacking["eis"] == "t700, z700" and lacking["boundary_layer_height"] == "blh"
    t, lat, lon = np.array([T0, T0 + HOUR]), np.array([30.1, 30.5]), np.array([200.1, 200.2])
    got = era5.predictors_at(found, t, lat, lon, "01Mar25")
    t2m = found.at("t2m", t, lat, lon, "x")
    np.testing.assert_allclose(got["sea_air_difference"], [291.0 - t2m[0], 289.0 - t2m[1]])  # sst, then skt
    np.testing.assert_allclose(got["lcl_height"], atmosphere.lcl_height(101000.0, t2m, t2m - 3.0))
    assert got["lcl_height"] == pytest.approx(atmosphere.lcl_height_espy(t2m, t2m - 3.0), rel=0.06)
    with pytest.raises(DataError, match="unknown atmosphere predictor"):
        era5.predictors_at(found, t, lat, lon, "01Mar25", ["cape"])


# ------------------------------------------------------------------------------- what to ask the CDS for


def test_the_requests_of_a_flight_across_the_date_line_keep_one_box_on_the_grid():
    from cloudml_lib.data import era5_requests as req

    t = T0 + np.array([0.0, 1800.0, 3000.0])  # 18:00 to 18:50 UTC
    lat = np.array([30.1, 30.2, 30.3])
    lon = np.array([179.9, -179.95, -179.8])  # eastward across 180
    (single, levels) = req.flight_requests("01Mar25", t, lat, lon)
    # the frames between 179.9 and 180.2 east: the grid points 179.75 and 180.25 around them, one step more
    assert single.keys["area"] == [30.75, 179.5, 29.75, 180.5] == levels.keys["area"]
    assert single.keys["time"] == ["18:00", "19:00"] and single.keys["day"] == ["01"]
    assert (
        single.dataset == "reanalysis-era5-single-levels"
        and "2m_dewpoint_temperature" in single.keys["variable"]
    )
    assert (
        levels.keys["pressure_level"] == ["700", "850", "925", "1000"]
        and single.target == "ERA5_single_01Mar25_20250301.nc"
    )
    west = req.flight_requests("x", t, lat, np.array([-120.1, -120.3, -119.9]), levels=False)
    assert [r.keys["area"] for r in west] == [
        [30.75, -120.75, 29.75, -119.5]
    ]  # a track away from it: -180..180


def test_a_flight_across_midnight_gets_one_request_per_day_with_its_own_hours(tmp_path):
    from cloudml_lib.data import era5_requests as req

    midnight = dt.datetime(2025, 3, 2, tzinfo=dt.timezone.utc).timestamp()
    t = midnight + np.array([-5400.0, -60.0, np.nan, 2400.0])  # 22:30 to 00:40 UTC, one frame without a time
    got = req.flight_requests("01Mar25", t, np.full(4, 30.2), np.full(4, 200.1), levels=False)
    assert [(r.keys["day"], r.keys["time"]) for r in got] == [
        (["01"], ["22:00", "23:00"]),
        (["02"], ["00:00", "01:00"]),
    ]
    with pytest.raises(DataError, match="no frame has a position"):
        req.flight_requests("01Mar25", t, np.full(4, np.nan), np.full(4, 200.1))
    # the two days' files, as the CDS would serve them, read as one flight's hours
    for day, hours in ((0, (22, 23)), (1, (24, 25))):
        new_layout(tmp_path / f"ERA5_single_01Mar25_{day}.nc", hours=tuple(h - 18 for h in hours))
    found = era5.read_files(era5.find_files(tmp_path, tmp_path))
    assert found.grids["t2m"].times.size == 4
    got = found.at("t2m", [midnight - 1800.0], [30.25], [200.0], "01Mar25")  # between 23:00 and 00:00
    assert got[0] == pytest.approx(field(5.5, 30.25, 200.0), abs=1e-4)
    new_layout(tmp_path / "ERA5_again.nc", hours=(4, 5))  # 22:00 again
    with pytest.raises(DataError, match="both hold t2m for the same hours"):
        era5.read_files(era5.find_files(tmp_path, tmp_path))


def test_a_demo_flights_requests_come_from_its_ir_times_and_nav_positions(tiny_flights):
    """The track of a flight as the files give it: IR times, nav positions (the demo flights lie off
    California): the box holds every frame's position, the hours every frame's time."""
    from cloudml_lib.base.config import build_config
    from cloudml_lib.data import era5_requests as req

    root, entries = tiny_flights
    data = build_config({"data": {"dir": str(root), "flights": entries, "swath_slice": [4, 36]}}).data
    flight = data.flights[0]
    t, lat, lon = req.flight_track(flight, data)
    ok = np.isfinite(t) & np.isfinite(lat) & np.isfinite(lon)
    assert ok.sum() > 0.9 * t.size and 20 < np.nanmedian(lat) < 45 and -130 < np.nanmedian(lon) < -110
    (single,) = req.flight_requests(flight.name, t, lat, lon, levels=False)
    north, west, south, east = single.keys["area"]
    assert south < lat[ok].min() <= lat[ok].max() < north and west < lon[ok].min() <= lon[ok].max() < east
    hours = [int(h[:2]) for h in single.keys["time"]]
    first, last = (dt.datetime.fromtimestamp(x, dt.timezone.utc) for x in (t[ok].min(), t[ok].max()))
    assert hours[0] <= first.hour and (last.hour + 1) % 24 in hours


class StandInCDS:
    """The Climate Data Store's client as the tests stand it in: checks each request as the CDS API takes
    it, and serves a NetCDF of the 2024 layout over exactly the requested box and hours."""

    def __init__(self, serve_garbage: bool = False):
        self.requests, self.serve_garbage = [], serve_garbage

    def retrieve(self, dataset, keys, target):
        from cloudml_lib.data import era5_requests as req

        self.requests.append((dataset, keys))
        assert keys["product_type"] == ["reanalysis"] and keys["data_format"] == "netcdf"
        north, west, south, east = keys["area"]
        assert north > south and east > west and all(round(x / 0.25) * 0.25 == x for x in keys["area"])
        if self.serve_garbage:
            Path(target).write_bytes(b"<html>Service unavailable</html>")
            return
        day = dt.datetime(
            int(keys["year"][0]), int(keys["month"][0]), int(keys["day"][0]), tzinfo=dt.timezone.utc
        )
        times = np.array([day.timestamp() + int(h[:2]) * HOUR for h in keys["time"]]).astype("datetime64[s]")
        lats = np.arange(north, south - 0.125, -0.25)
        lons = np.arange(west, east + 0.125, 0.25)
        shape = (len(times), len(lats), len(lons))
        coords = {"valid_time": times, "latitude": lats, "longitude": lons, "number": 0}
        dims = ("valid_time", "latitude", "longitude")
        if dataset == req.SINGLE_DATASET:
            short = {v: k for k, v in req.SINGLE_VARIABLES.items()}
            values = {"t2m": 289.0, "d2m": 286.0, "sst": 290.0, "skt": 290.0, "sp": 101500.0, "msl": 101500.0,
                      "blh": 700.0, "tcwv": 20.0, "lcc": 0.8, "u10": 5.0, "v10": -3.0}  # fmt: skip
            units = {"sp": "Pa", "msl": "Pa", "blh": "m", "tcwv": "kg m**-2", "lcc": "(0 - 1)",
                     "u10": "m s**-1",
                     "v10": "m s**-1"}  # fmt: skip
            ds = xr.Dataset(
                {
                    short[v]: (dims, np.full(shape, values[short[v]]), {"units": units.get(short[v], "K")})
                    for v in keys["variable"]
                },  # fmt: skip
                coords=coords,
            )
        else:
            levels = np.array([float(p) for p in keys["pressure_level"]])
            dims4 = ("valid_time", "pressure_level", "latitude", "longitude")
            full = (shape[0], len(levels), *shape[1:])
            t = 289.0 - 0.006 * (1000.0 - levels)[None, :, None, None] / 0.12 + np.zeros(full)
            ds = xr.Dataset(
                {
                    "t": (dims4, t, {"units": "K"}),
                    "q": (dims4, np.full(full, 0.006), {"units": "kg kg**-1"}),
                    "z": (dims4, np.full(full, 29000.0), {"units": "m**2 s**-2"}),
                    "r": (dims4, np.full(full, 70.0), {"units": "%"}),
                },
                coords={**coords, "pressure_level": ("pressure_level", levels, {"units": "hPa"})},
            )
        ds.to_netcdf(target, engine="h5netcdf")


def test_fetch_era5_asks_for_each_flights_box_and_hours_writes_its_folder_and_fetches_only_whats_missing(
    tiny_flights, tmp_path, monkeypatch
):
    import shutil

    from cloudml_lib.base.config import build_config
    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.commands import era5 as command
    from cloudml_lib.data import era5_requests as req

    root, entries = tiny_flights
    shutil.copytree(root, tmp_path / "flights")
    for own in (tmp_path / "flights").rglob("ERA5_*"):  # the demo's own (generator 4): fetched here instead
        own.unlink()
    cfg = build_config(
        {"data": {"dir": str(tmp_path / "flights"), "flights": entries[:2], "swath_slice": [4, 36]}}
    )
    cds = StandInCDS()
    done = command.fetch(cfg, client=cds)
    # two datasets for each UTC day: 01Mar25 flies in one, 03Mar25 across midnight into 4 March
    assert len(done["fetched"]) == 6 == len(cds.requests)
    assert (
        sorted(Path(p).name for p in done["fetched"] if "03Mar25" in p)[-1]
        == "ERA5_single_03Mar25_20250304.nc"
    )
    assert (
        sorted(Path(p).name for p in done["fetched"])[0] == f"ERA5_pressure_{entries[0]['name']}_20250301.nc"
    )
    for entry in entries[:2]:  # the predictors of every frame: inside the box and the hours fetched
        flight = next(f for f in cfg.data.flights if f.name == entry["name"])
        folder = command.flight_folder(flight, cfg.data)
        found = era5.read_files(era5.find_files(tmp_path / "flights", folder))
        t, lat, lon = req.flight_track(flight, cfg.data)
        got = era5.predictors_at(found, t, lat, lon, flight.name)
        assert set(got) == set(era5.PREDICTORS)
        assert np.nanmax(np.abs(got["sea_air_difference"] - 1.0)) < 1e-9
    again = command.fetch(cfg, client=StandInCDS(serve_garbage=True))
    assert again["fetched"] == [] and len(again["kept"]) == 6  # nothing asked for twice
    # what the CDS serves is read back before it takes a name: a page of HTML is named, no file is left
    (Path(done["fetched"][0])).unlink()
    with pytest.raises(DataError, match="neither NetCDF nor GRIB"):
        command.fetch(cfg, client=StandInCDS(serve_garbage=True))
    folder = Path(done["fetched"][0]).parent
    assert not Path(done["fetched"][0]).exists() and not list(folder.glob(".*.partial"))
    # without the client: its install command; without a key: where to put one
    monkeypatch.setitem(__import__("sys").modules, "cdsapi", None)
    with pytest.raises(CloudMLError, match=r"pip install 'cdsapi>=0.7'"):
        command.fetch(cfg)


def test_fetch_era5_dry_run_prints_the_requests_from_the_command_line(copied_flights, tmp_path):
    """--dry-run: the request of each file that is missing, "kept" for each that is there; nothing written."""
    import yaml
    from conftest import run_cli

    root, entries, _ = copied_flights
    kept = sorted((root / entries[0]["name"]).glob("ERA5_single_*"))
    kept[0].unlink()  # the demo flight's own single-levels file: its request is what a fetch would send
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump({"data": {"dir": str(root), "flights": entries[:1], "swath_slice": [4, 36]}})
    )
    before = sorted(root.rglob("*"))
    r = run_cli("fetch-era5", "--config", cfg, "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [line for line in r.stdout.splitlines() if " <- " in line]  # the log's lines beside it
    assert line.startswith(f"{entries[0]['name']}: ") and "reanalysis-era5-single-levels" in line
    assert f"{kept[0].name.replace('single', 'pressure')} is there already: kept" in r.stdout
    assert '"area": [' in line and sorted(root.rglob("*")) == before  # nothing written
    r = run_cli("fetch-era5", "--config", cfg, "--flights", "09Dec99", "--dry-run")
    assert r.returncode == 2 and "--flights: 09Dec99 not among the flights found" in r.stderr


def test_the_cds_key_comes_from_the_usual_places_or_colabs_secrets_and_is_never_logged(
    tmp_path, monkeypatch, caplog
):
    import sys
    import types

    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.commands import era5 as command

    made = []
    stand_in = types.ModuleType("cdsapi")
    stand_in.Client = lambda **kw: made.append(kw) or "client"
    monkeypatch.setitem(sys.modules, "cdsapi", stand_in)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("CDSAPI_KEY", "CDSAPI_URL", "CDSAPI_RC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(command, "colab_key", lambda: None)
    with pytest.raises(CloudMLError, match=r"no Climate Data Store key was found: .*~/.cdsapirc"):
        command.cds_client()
    (tmp_path / ".cdsapirc").write_text("url: https://cds.climate.copernicus.eu/api\nkey: in-the-file\n")
    assert command.cds_client() == "client" and made[-1] == {"quiet": True}  # the client reads its file
    monkeypatch.setattr(command, "colab_key", lambda: "secret-from-colab")
    with caplog.at_level(logging.DEBUG):
        command.cds_client()
    assert made[-1]["key"] == "secret-from-colab" and made[-1]["url"] == command.CDS_URL
    assert "secret-from-colab" not in caplog.text


def test_the_setup_notebooks_era5_cell_says_what_to_do_without_a_key_then_fetches_what_is_missing(
    ws, tmp_path, monkeypatch, capsys
):
    """colab.fetch_era5: without a key it names the secret to add and fetches nothing; with one, the client
    (installed on demand: pip is the remote service stood in here) fetches each flight's files, and the cell
    run again finds them all."""
    from cloudml_lib.colab import drive
    from cloudml_lib.commands import era5 as command
    from cloudml_lib.data.synthetic import make_demo_flights

    make_demo_flights(ws.data / "ER2", n_flights=2, frames_per_flight=60, version=3)  # no ERA5 beside them
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("CDSAPI_KEY", "CDSAPI_URL", "CDSAPI_RC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(command, "colab_key", lambda: None)
    done = drive.fetch_era5(ws)
    said = capsys.readouterr().out
    assert done["missing"] == ["01Mar25", "03Mar25"] and done["fetched"] == []
    assert "a notebook secret named CDSAPI_KEY" in said and "Training works without them" in said
    assert not list((ws.data / "ER2").rglob("ERA5_*"))
    monkeypatch.setattr(command, "colab_key", lambda: "secret-from-colab")
    installs = []
    monkeypatch.setattr(drive, "ensure_package", lambda *a: installs.append(a[1]) or True)
    cds = StandInCDS()
    monkeypatch.setattr(command, "cds_client", lambda: cds)
    done = drive.fetch_era5(ws)
    assert installs == [command.CDSAPI] and len(done["fetched"]) == len(cds.requests) == 6
    assert "Fetched 6 ERA5 files for 01Mar25, 03Mar25" in capsys.readouterr().out
    again = drive.fetch_era5(ws)
    assert again["missing"] == [] and "Every flight has its ERA5 files" in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_reads_the_atmosphere_where_every_flight_has_it_and_says_in_one_line_what_it_could_use(
    copied_flights, caplog
):
    """data.atmosphere with_frames: without ERA5 beside any flight the run trains on the frames as before and
    says so in one line; `alone` then stops with what to do; ERA5 beside some flights only stops the run
    naming the others; beside every flight, each labelled frame gets the predictors the files allow."""
    from cloudml_lib.commands import era5 as command
    from cloudml_lib.data.dataset import prepare_data

    root, entries, config = copied_flights
    for path in root.rglob("ERA5_*"):  # flights as they come from the camera and lidar alone
        path.unlink()
    with caplog.at_level(logging.INFO, logger="cloudml_lib.data.predictors"):
        data = prepare_data(config(atmosphere="with_frames"))
    said = [r.getMessage() for r in caplog.records if r.name == "cloudml_lib.data.predictors"]
    assert len(said) == 1 and "no ERA5 file lies beside the flights" in said[0] and "fetch-era5" in said[0]
    assert data.train_set.scalers.atmosphere is None and data.train_set.atmosphere()[1] == ()
    assert prepare_data(config()).train_set.scalers == data.train_set.scalers  # as a run before the setting
    with pytest.raises(DataError, match="data.atmosphere: alone needs the atmosphere of each flight"):
        prepare_data(config(atmosphere="alone"))
    first = config(atmosphere="with_frames").data.flights[0]
    command.fetch(config(), names=[first.name], client=StandInCDS())
    with pytest.raises(DataError, match=f"beside flights {first.name} but not .*--flights"):
        prepare_data(config(atmosphere="with_frames"))
    command.fetch(config(), client=StandInCDS())
    data = prepare_data(config(atmosphere="with_frames"))
    values, names = data.test_set.atmosphere()
    assert list(names) == list(era5.PREDICTORS) == data.test_set.scalers.atmosphere
    assert np.isfinite(values).all() and np.allclose(values[:, names.index("sea_air_difference")], 1.0)
    # the stand-in's fields are constant: centred, with the spread of a reanalysis' error (0.5 K), not of
    # nothing, so a test flight's other value stays a number of its units' size
    assert data.test_set.scalers.atmosphere_std[names.index("t2m")] == 0.5
    assert np.abs(data.test_set.inputs(np.arange(4))[0]).max() < 10


@pytest.mark.slow
def test_a_model_that_read_the_atmosphere_evaluates_and_predicts_with_the_same_predictors(
    copied_flights, tmp_path
):
    """A tiny run with data.atmosphere with_frames: the network takes the predictors beside the angles and
    statistics; its report says what it saw; evaluate and predict read the same predictors from each flight's
    files, and a flight whose files are gone is named, never scored on a made-up atmosphere."""
    import yaml

    import cloudml_lib as cml
    from cloudml_lib.base.config import build_config
    from cloudml_lib.commands import era5 as command
    from cloudml_lib.data.preprocess import STAT_NAMES
    from cloudml_lib.science.evaluate import load_run_model

    root, entries, config = copied_flights
    command.fetch(config(), client=StandInCDS())  # what a flight lacks (the demo's own files are kept)
    raw = build_config_dict(config(atmosphere="with_frames"))
    raw["train"]["epochs"] = 1
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    run = cml.fit(tmp_path / "c.yaml", tmp_path / "run")
    report = cml.read_report(run)
    assert report["atmosphere"] == {"network_inputs": "with_frames", "predictors": list(era5.PREDICTORS)}
    model = load_run_model(run.path).model
    assert model.film[0].in_features == 3 + len(STAT_NAMES) + len(era5.PREDICTORS)
    again = cml.evaluate(run)
    assert again["overall"] == pytest.approx(report["overall"], rel=1e-6)  # the same predictors, numbers
    ds = cml.predict_flight(run)
    assert np.isfinite(ds["cloud_base_height"].values).any()
    import json

    spec = json.loads((cml.export(run, tmp_path / "export") / "preprocessing.json").read_text())["inputs"]
    assert spec["scalars"]["order"][-len(era5.PREDICTORS) :] == [f"{n}_standardised" for n in era5.PREDICTORS]
    assert (
        spec["scalars"]["shape"] == ["batch", model.film[0].in_features]
        and "lcl_height_standardised = (" in (spec["scalars"]["formulas"][-1])
    )
    test_flight = build_config(raw).data.test_flights[0]
    for path in (root / test_flight).glob("ERA5_*"):
        path.unlink()
    with pytest.raises(DataError, match=f"this model reads the atmosphere of each flight|{test_flight}"):
        cml.predict_flight(run)


def build_config_dict(cfg) -> dict:
    """A Config as the plain dict a YAML file holds."""
    from dataclasses import asdict

    return asdict(cfg)


def test_a_missing_value_in_a_file_where_the_flight_is_is_refused_by_name_and_a_lost_file_named(
    tiny_flights, tmp_path
):
    """A NaN of the file's at a frame with a known time and position is named (file, predictor, frame), never
    taken for a frame without a position; a model asked to score a flight whose files are gone is told where
    to fetch them, not to change a setting it was trained with."""
    import shutil

    from cloudml_lib.base.config import build_config
    from cloudml_lib.data import era5_requests as req
    from cloudml_lib.data import predictors

    root, entries = tiny_flights
    shutil.copytree(root, tmp_path / "flights")
    data = build_config(
        {"data": {"dir": str(tmp_path / "flights"), "flights": entries[:1], "swath_slice": [4, 36]}}
    ).data
    flight = data.flights[0]
    t, lat, lon = req.flight_track(flight, data)
    names = ["t2m", "lcl_height"]
    assert np.isfinite(predictors.frames_atmosphere(flight, data, t, lat, lon, names)[np.isfinite(lat)]).all()
    (single,) = [p for p in predictors.flight_files(flight, data) if p.name.startswith("ERA5_single")]
    ds = xr.load_dataset(single)
    ds["t2m"][:] = np.nan
    single.unlink()
    ds.to_netcdf(single, engine="h5netcdf" if "valid_time" in ds.coords else "scipy")
    with pytest.raises(
        DataError, match=rf"flight {flight.name}: its ERA5 files .* hold no value of t2m .*frame"
    ):
        predictors.frames_atmosphere(flight, data, t, lat, lon, names)
    for path in predictors.flight_files(flight, data):
        path.unlink()
    with pytest.raises(DataError, match=rf"flight {flight.name}: no ERA5 file lies beside it .*--flights"):
        predictors.frames_atmosphere(flight, data, t, lat, lon, names)
    from types import SimpleNamespace

    with pytest.raises(DataError, match="this model reads the atmosphere of each flight it scores") as e:
        predictors.attach([SimpleNamespace(name=flight.name)], data, names)  # files are looked for first
    assert "data.atmosphere: none" not in str(e.value)


def test_the_predictors_a_run_reads_are_part_of_its_data_fingerprint(tiny_config):
    """A run that reads the atmosphere resumes only on the same predictors (an ERA5 file changed since is new
    data); a run that reads none keeps the fingerprint it had before the setting (old runs resume)."""
    from dataclasses import replace

    from cloudml_lib.data.cache import load_caches
    from cloudml_lib.train.build import data_fingerprint

    caches = load_caches(tiny_config.data)
    before = data_fingerprint(caches)
    names = ("t2m",)
    read = [replace(c, atmosphere=np.full((len(c), 1), 289.0), atmosphere_names=names) for c in caches]
    warmer = [replace(c, atmosphere=c.atmosphere + 0.5) for c in read]
    assert data_fingerprint(read) != before and data_fingerprint(warmer) != data_fingerprint(read)
    assert data_fingerprint(caches) == before and data_fingerprint(read) == data_fingerprint(read)
