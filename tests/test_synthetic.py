"""The demo generator (data/synthetic.py): version 3 puts the cloud's top in the frames and its base a varying
thickness below, each flight with its own sea and air, so no temperature statistic gives the base; version 4
writes beside 3's flights the ERA5 reanalysis of that atmosphere (data/demo_era5.py), in both layouts of the
Climate Data Store, with a reanalysis' errors; version 2 is still written byte for byte for the runs made on
it, and each says which it is."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from conftest import TINY_SHAPE

from cloudml_lib.base.config import build_config
from cloudml_lib.data.cache import load_caches
from cloudml_lib.data.preprocess import STAT_NAMES
from cloudml_lib.data.synthetic import (
    DEMO_VERSION,
    GENERATOR_ATTR,
    VERSION_FILE,
    Atmosphere,
    demo_flight_entries,
    emissivity,
    make_demo_flights,
)


def written(tmp_path, version: int):
    """Four small flights of `version` and their caches."""
    root = tmp_path / f"v{version}"
    entries = make_demo_flights(
        root, n_flights=4, seed=5, frames_per_flight=400, frame_shape=TINY_SHAPE, version=version
    )
    data = {
        "dir": str(root),
        "cache_dir": str(tmp_path / f"cache{version}"),
        "flights": entries,
        "test_flights": [entries[0]["name"]],
        "temporal_frames": 3,
        "swath_slice": [4, 36],
        "preprocess_workers": 0,
    }
    return root, entries, load_caches(build_config({"data": data}).data)


def best_single_statistic_r2(caches) -> float:
    """The R2 of the base against the best single brightness statistic, one line over every flight."""
    x = np.concatenate([c.frame_stats[c.has_height] for c in caches]).astype(np.float64)
    y = np.concatenate([c.cbh_km[c.has_height] for c in caches]).astype(np.float64)
    return max(float(np.corrcoef(x[:, j], y)[0, 1] ** 2) for j in range(len(STAT_NAMES)))


@pytest.mark.slow
def test_version_3_gives_no_statistic_the_base_where_version_2_did(tmp_path):
    root, entries, v3 = written(tmp_path, 3)
    _, _, v2 = written(tmp_path, 2)
    assert sum(int(c.has_height.sum()) for c in v3) > 100
    easy, honest = best_single_statistic_r2(v2), best_single_statistic_r2(v3)
    assert easy > 0.9  # version 2: the coldest pixels were the base's temperature
    assert honest < 0.9 and honest < easy - 0.1, (easy, honest)
    with h5py.File(root / entries[0]["ir_file"]) as f:  # the file says what it is
        attrs = dict(f["Product/Signal"].attrs)
        assert f.attrs[GENERATOR_ATTR] == 3
    assert (attrs["units"], attrs["scale_factor"], attrs["add_offset"]) == ("K", 0.01, 180.0)
    assert (root / VERSION_FILE).read_text().strip() == "3"
    with h5py.File(tmp_path / "v2" / entries[0]["ir_file"]) as f:  # version 2's bytes: no new attribute
        assert GENERATOR_ATTR not in f.attrs and dict(f["Product/Signal"].attrs) == {"units": "counts"}
    # the lidar's layer tops lie a varying thickness above the bases (version 2: 0.3 km everywhere)
    with h5py.File(root / entries[1]["cpl_file"]) as f:
        base, top = f["layer_descriptor/Layer_Base_Altitude"][:], f["layer_descriptor/Layer_Top_Altitude"][:]
    low = (base > 0) & (base < 3)
    thickness = (top - base)[low]
    assert thickness.std() > 0.03 and 0.1 < np.median(thickness) < 0.6


def test_a_thin_cloud_is_partly_transparent_and_the_top_is_colder_than_the_base():
    assert emissivity(0.05) == pytest.approx(0.21, abs=0.01)  # Stephens (1978) at 60% adiabatic water
    assert emissivity(0.3) > 0.99
    air = Atmosphere(sea_k=289.0, air_sea_k=1.0, lapse_k_per_km=9.0)
    assert air.top_k(1.0, 0.0) == pytest.approx(279.0)
    assert air.top_k(1.0, 0.4) == pytest.approx(277.0)  # 5 K/km inside the cloud


def test_an_unknown_generator_version_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="generator version 2, 3 or 4"):
        make_demo_flights(tmp_path / "x", n_flights=2, frames_per_flight=20, version=7)
    assert not (tmp_path / "x").exists()


def test_an_earlier_versions_demo_flights_are_kept_for_the_runs_made_on_them(
    tmp_path, caplog, logs_reach_caplog
):
    """data.demo never writes over them: a run of CloudML 0.3 continues on the flights it was trained on, and
    the notebooks continue such a run with its own demo folder."""
    import logging

    import yaml

    from cloudml_lib.colab.drive import demo_folder_of
    from cloudml_lib.data.synthetic import ensure_demo_flights

    old = tmp_path / "flights"
    make_demo_flights(old, n_flights=2, frames_per_flight=20, frame_shape=(16, 16), version=2)
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    data = build_config({"data": {"dir": str(old), "demo": True}}).data
    with caplog.at_level(logging.WARNING):
        assert ensure_demo_flights(data).dir == str(old)
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before
    assert "generator version 2; this one writes 4): they are kept" in caplog.text
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"dir": str(old), "demo": True}}))
    assert demo_folder_of(run) == str(old)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"dir": str(old), "demo": False}}))
    assert demo_folder_of(run) is None


def test_demo_flights_written_again_never_replace_a_file_the_user_put_where_one_goes(tmp_path):
    """`make-demo-data --out F` again with more flights: F's ledger lists the files of the first writing; a
    file the user put since where a new flight's file goes is named, before anything is written, and left as
    it was (nothing of F changes); without it, the flights are written and listed."""
    import hashlib

    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.base.ledger import listed

    out = tmp_path / "demo"
    make_demo_flights(out, n_flights=2, frames_per_flight=40, frame_shape=TINY_SHAPE)
    third = demo_flight_entries(3)[2]
    theirs = out / third["ir_file"]
    theirs.parent.mkdir()
    theirs.write_bytes(b"the user's own IR file")

    def tree():
        return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*")) if p.is_file()}

    before = tree()
    with pytest.raises(CloudMLError, match="was not written by CloudML") as e:
        make_demo_flights(out, n_flights=3, frames_per_flight=40, frame_shape=TINY_SHAPE)
    assert str(theirs) in str(e.value) and tree() == before
    theirs.unlink()
    make_demo_flights(out, n_flights=3, frames_per_flight=40, frame_shape=TINY_SHAPE)
    assert third["ir_file"] in listed(out) and (out / third["ir_file"]).read_bytes()[:4] == b"\x89HDF"
    assert "05Mar25/ERA5_single_05Mar25_20250305.nc" in listed(out)  # generator 4's reanalysis too


# ---------------------------------------------------------------------------------- version 4: the reanalysis


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """Five small flights of version 4 (the default) and their data settings."""
    root = tmp_path_factory.mktemp("v4")
    entries = make_demo_flights(root, n_flights=5, seed=5, frames_per_flight=200, frame_shape=TINY_SHAPE)
    data = {
        "dir": str(root),
        "cache_dir": str(root.parent / "cache4"),
        "flights": entries,
        "test_flights": [entries[2]["name"]],
        "swath_slice": [4, 36],
        "preprocess_workers": 0,
    }
    return root, entries, build_config({"data": data}).data


def test_version_4_writes_what_fetch_era5_would_ask_for_in_both_layouts_and_every_predictor_reads(v4):
    """Each flight's folder holds the files fetch-era5 would download for it (their names, boxes and hours
    from the IR times and nav positions, one pair per UTC day: 03Mar25 crosses midnight), as the 2024 CDS
    serves them on three flights and as the legacy CDS did on two; read back, they give every predictor,
    finite at every frame with a time and a position."""
    import xarray as xr

    from cloudml_lib.base.ledger import listed
    from cloudml_lib.data import era5, era5_requests

    root, entries, data = v4
    assert DEMO_VERSION == 4 and (root / VERSION_FILE).read_text().strip() == "4"
    layouts = {}
    for flight, entry in zip(data.flights, entries):
        folder = (root / entry["ir_file"]).parent
        t, lat, lon = era5_requests.flight_track(flight, data)
        asked = sorted(r.target for r in era5_requests.flight_requests(flight.name, t, lat, lon))
        files = era5.find_files(root, folder)
        assert [p.name for p in files] == asked and all(f"{flight.name}/{n}" in listed(root) for n in asked)
        layouts[flight.name] = {p.read_bytes()[:4] for p in files}
        found = era5.read_files(files)
        ok, lacking = era5.available_predictors(found)
        assert lacking == {} and ok == list(era5.PREDICTORS), lacking
        known = np.isfinite(t) & np.isfinite(lat) & np.isfinite(lon)
        assert known.mean() > 0.9
        got = era5.predictors_at(found, t[known], lat[known], lon[known], flight.name)
        assert all(np.isfinite(v).all() for v in got.values()), flight.name
    legacy, new = {b"CDF\x02"}, {b"\x89HDF"}  # NetCDF-3 (64-bit offset), NetCDF-4
    assert [layouts[e["name"]] for e in entries] == [new, legacy, new, new, legacy]
    assert len(era5.find_files(root, root / "03Mar25")) == 4  # two UTC days, single and pressure levels
    packed = {"decode_times": False, "mask_and_scale": False}
    with xr.open_dataset(root / "03Mar25" / "ERA5_pressure_03Mar25_20250304.nc", **packed) as old:
        assert old["time"].attrs["units"].startswith("hours since 1900-01-01") and old["t"].dtype == np.int16
        assert {"scale_factor", "add_offset", "_FillValue"} <= set(old["t"].attrs)
        assert old["level"].attrs["units"] == "millibars" and old["latitude"][0] > old["latitude"][-1]
    single = root / "01Mar25" / "ERA5_single_01Mar25_20250301.nc"
    with xr.open_dataset(single, engine="h5netcdf", decode_times=False) as now:
        assert (
            now["valid_time"].attrs["units"] == "seconds since 1970-01-01" and now["t2m"].dtype == np.float32
        )
        assert {"expver", "number"} <= set(now.coords) and now["latitude"][0] > now["latitude"][-1]


def test_version_4s_reanalysis_holds_the_flights_atmosphere_with_a_reanalysis_errors(v4):
    """The files hold the atmosphere that made the frames, as a reanalysis sees it: at the labelled frames the
    lifting condensation level of the surface air lies within a few hundred metres of the lidar's mean base on
    the coupled flights and below it on the decoupled ones; it is the flight's smooth state, not the base's
    drift from frame to frame; the 2 m air and the sea differ from the truth by about the published errors,
    never exactly."""
    from cloudml_lib.data import demo_era5, era5, era5_requests
    from cloudml_lib.data.synthetic import ATMOSPHERES, BOUNDARY_LAYERS

    root, entries, data = v4
    caches = {c.name: c for c in load_caches(data)}
    t2m_error, sst_error = [], []
    for i, flight in enumerate(data.flights):
        c = caches[flight.name]
        frames, base = c.frame_index[c.has_height], c.cbh_km[c.has_height]
        t, lat, lon = (x[frames] for x in era5_requests.flight_track(flight, data))
        known = np.isfinite(t) & np.isfinite(lat) & np.isfinite(lon)  # 07Mar25's nav ends before its frames
        t, lat, lon, base = t[known], lat[known], lon[known], base[known]
        found = era5.read_files(era5.find_files(root, (root / flight.ir_file).parent))
        lcl = era5.predictors_at(found, t, lat, lon, flight.name, ["lcl_height"])["lcl_height"] / 1000.0
        assert base.size >= 10 and np.isfinite(lcl).all()
        if BOUNDARY_LAYERS[i][0] == 0.0:  # coupled
            assert abs(lcl.mean() - base.mean()) < 0.4, (flight.name, lcl.mean(), base.mean())
        else:  # decoupled: the cloud base 0.25-0.40 km above the condensation level
            assert lcl.mean() < base.mean() - 0.1, (flight.name, lcl.mean(), base.mean())
        assert lcl.std() < 0.3 * base.std()  # the hourly 0.25 degree field: not the drift of the base
        sea, air_sea = ATMOSPHERES[i][:2]
        gradient = np.array(demo_era5.SST_GRADIENT_K_PER_DEG)
        sea_here = sea + (np.stack([lat - lat.mean(), lon - lon.mean()], 1) @ gradient)
        t2m_error.append(found.at("t2m", t, lat, lon, flight.name) - (sea_here - air_sea))
        sst_error.append(found.at("sst", t, lat, lon, flight.name) - sea_here)
    t2m_rms, sst_rms = (float(np.sqrt(np.mean(np.concatenate(e) ** 2))) for e in (t2m_error, sst_error))
    assert 0.1 < t2m_rms < 1.5 and 0.05 < sst_rms < 0.8, (t2m_rms, sst_rms)
    assert min(abs(float(e.mean())) for e in t2m_error) > 0.0  # a bias on every flight, not the truth


def test_version_4s_frames_labels_and_nav_are_version_3s(v4, tmp_path):
    """Version 4 adds the reanalysis and changes nothing else: the same frames, times, labels and nav as
    version 3 (its ERA5 drawn from a random stream of its own), the IR file naming its generator; version 3
    writes no ERA5 file."""
    import hashlib

    root, entries, _ = v4
    old = tmp_path / "v3"
    make_demo_flights(old, n_flights=5, seed=5, frames_per_flight=200, frame_shape=TINY_SHAPE, version=3)
    assert not list(old.rglob("ERA5_*"))
    for entry in entries:
        for key in ("cpl_file", "nav_file"):
            digests = {hashlib.sha256((r / entry[key]).read_bytes()).hexdigest() for r in (old, root)}
            assert len(digests) == 1, entry[key]
        with h5py.File(old / entry["ir_file"]) as a, h5py.File(root / entry["ir_file"]) as b:
            assert np.array_equal(a["Product/Signal"][()], b["Product/Signal"][()])
            assert np.array_equal(a["Time/TimeUTC"][()], b["Time/TimeUTC"][()])
            assert (a.attrs[GENERATOR_ATTR], b.attrs[GENERATOR_ATTR]) == (3, 4)
