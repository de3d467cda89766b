import datetime as dt
import logging

import h5py
import numpy as np
import pytest

from cloudml_lib.config import build_config
from cloudml_lib.data import er2
from cloudml_lib.errors import DataError

DATE = dt.date(2025, 2, 10)
MIDNIGHT = 1739145600.0      # 2025-02-10 00:00 UTC


def write_flight(root, n_frames=20, ir_time=None, with_nav_time=True, nav_rows=None, profiles=None, rows=12):
    """A small flight whose labels, times and angles are known exactly."""
    t0 = 3600.0
    ir_time = t0 + np.arange(n_frames, dtype=float) if ir_time is None else ir_time
    with h5py.File(root / "IR_20250210.h5", "w") as f:
        f["Product/Signal"] = np.arange(n_frames * rows * 8, dtype=np.float32).reshape(n_frames, rows, 8)
        f["Time/TimeUTC"] = ir_time
    # (time of day s, base km, lidar surface m, dem m)
    profiles = profiles or [
        (t0 + 2.2, 1.0, 0.0, 0.0),       # kept, frame 2
        (t0 + 5.4, 0.5, 10.0, 0.0),      # kept, frame 5
        (t0 + 7.5, 0.6, 0.0, 0.0),       # 0.5 s from frames 7 and 8: kept, nearest wins ties -> 7
        (t0 + 9.0, -9999.0, 0.0, 0.0),   # no layer
        (t0 + 10.0, 2.5, 0.0, 0.0),      # out of range
        (t0 + 11.0, 1.2, 0.0, 120.0),    # over land
        (t0 + 12.0, 1.2, 1500.0, 0.0),   # lidar surface too high
        (t0 + 40.0, 1.0, 0.0, 0.0),      # after the camera stopped: unmatched
    ]
    p = np.array(profiles)
    doy = DATE.timetuple().tm_yday
    with h5py.File(root / "CPL_L2_V1-02_01kmLay_259015_10feb25.hdf5", "w") as f:
        f["layer_descriptor/Profile_Decimal_Julian_Day"] = doy + p[:, 0] / 86400.0
        base = np.full((len(p), 3), -9999.0)
        base[:, 0] = p[:, 1]
        f["layer_descriptor/Layer_Base_Altitude"] = base
        f["layer_descriptor/Lidar_Surface_Altitude"] = p[:, 2]
        f["layer_descriptor/DEM_Surface_Altitude"] = p[:, 3]
    n_nav = nav_rows or n_frames
    with h5py.File(root / "CRS_20250210_nav.hdf", "w") as f:
        f["nav/solarZenith"] = 30.0 + np.arange(n_nav, dtype=float)        # zenith = 30 + row
        f["nav/sunAzGrd"] = 100.0 + np.arange(n_nav, dtype=float)
        f["nav/IWG_lat"] = np.zeros(n_nav)
        f["nav/IWG_lon"] = np.zeros(n_nav)
        if with_nav_time:
            f["nav/Time"] = t0 - 3.0 + np.arange(n_nav, dtype=float)       # row r is frame r - 3
    return {"name": "10Feb25", "ir_file": "IR_20250210.h5", "cpl_file": "CPL_L2_V1-02_01kmLay_259015_10feb25.hdf5",
            "nav_file": "CRS_20250210_nav.hdf"}


def config_for(root, entry, **data):
    other = dict(entry, name="other")
    raw = {"data": {"dir": str(root), "flights": [entry, other], "validation_flights": ["other"],
                    "swath_slice": [2, 10], **data}}
    return build_config(raw)


def test_filters_matching_and_counts(tmp_path):
    cfg = config_for(tmp_path, write_flight(tmp_path))
    labels = er2.read_flight_labels(cfg.data.flights[0], cfg.data)
    assert labels.frame_index.tolist() == [2, 5, 7]
    np.testing.assert_allclose(labels.cbh_km, [1.0, 0.5, 0.6])
    assert labels.counts == {"profiles": 8, "no_layer": 1, "out_of_range": 1, "over_land": 1, "bad_surface": 1,
                             "unmatched": 1, "kept": 3}
    # nav matched by its own time axis: row r belongs to frame r - 3
    np.testing.assert_allclose(labels.sza_deg, [30 + 5, 30 + 8, 30 + 10])


def test_match_tolerance_is_respected(tmp_path):
    entry = write_flight(tmp_path, profiles=[(3600.0 + 4.6, 1.0, 0.0, 0.0), (3600.0 + 6.0, 1.0, 0.0, 0.0)],
                         ir_time=3600.0 + np.array([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
                                                    19, 20], float))
    cfg = config_for(tmp_path, entry, match_tolerance_s=0.3)
    labels = er2.read_flight_labels(cfg.data.flights[0], cfg.data)
    assert labels.frame_index.tolist() == [5]            # 4.6 s is 0.4 s from the frame at 4 s: too far
    assert labels.counts["unmatched"] == 1


def test_epoch_seconds_and_midnight_wrap_are_understood():
    sod = np.array([86398.0, 86399.0, 0.0, 1.0])
    t, fmt = er2.to_epoch_seconds(sod, "auto", DATE, "test")
    assert fmt == "seconds_of_day"
    np.testing.assert_allclose(t, MIDNIGHT + np.array([86398, 86399, 86400, 86401]))
    t2, fmt2 = er2.to_epoch_seconds(t, "auto", DATE, "test")
    assert fmt2 == "epoch" and np.array_equal(t2, t)
    with pytest.raises(DataError, match="cannot tell the time format.*data.ir_time_format"):
        er2.to_epoch_seconds(np.array([-5.0, 1e6]), "auto", DATE, "flight X")


def test_ir_file_with_epoch_times_matches_the_same_labels(tmp_path):
    entry = write_flight(tmp_path, ir_time=MIDNIGHT + 3600.0 + np.arange(20, dtype=float))
    cfg = config_for(tmp_path, entry)
    assert er2.read_flight_labels(cfg.data.flights[0], cfg.data).frame_index.tolist() == [2, 5, 7]


def test_julian_day_uses_the_year_from_the_cpl_file_name(tmp_path):
    entry = write_flight(tmp_path)
    cfg = config_for(tmp_path, entry)
    assert er2.flight_date(cfg.data.flights[0]) == DATE
    assert er2.julian_to_epoch(np.array([41.5]), DATE)[0] == MIDNIGHT + 43200.0    # 10 Feb = day 41


def test_nav_without_time_axis_assumes_alignment_and_says_so(tmp_path, caplog, monkeypatch):
    entry = write_flight(tmp_path, with_nav_time=False)
    cfg = config_for(tmp_path, entry)
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="cloudml_lib"):
        labels = er2.read_flight_labels(cfg.data.flights[0], cfg.data)
    np.testing.assert_allclose(labels.sza_deg, [32, 35, 37])
    assert "assuming nav row i belongs to IR frame i" in caplog.text


def test_short_nav_without_time_axis_is_an_error(tmp_path):
    entry = write_flight(tmp_path, with_nav_time=False, nav_rows=10)
    cfg = config_for(tmp_path, entry)
    with pytest.raises(DataError, match="10 nav rows but the IR file has 20 frames"):
        er2.read_flight_labels(cfg.data.flights[0], cfg.data)


def test_missing_file_names_flight_and_file(tmp_path):
    entry = write_flight(tmp_path)
    (tmp_path / entry["nav_file"]).unlink()
    cfg = config_for(tmp_path, entry)
    with pytest.raises(DataError, match=r"flight 10Feb25: missing nav file .*CRS_20250210_nav.hdf"):
        er2.read_flight_labels(cfg.data.flights[0], cfg.data)


def test_missing_key_names_flight_file_and_config_key(tmp_path):
    entry = write_flight(tmp_path)
    cfg = config_for(tmp_path, entry, keys={"ir_signal": "Product/Radiance"})
    with pytest.raises(DataError, match=r"flight 10Feb25: .*IR_20250210.h5 has no dataset 'Product/Radiance' "
                                        r"\(set by data.keys.ir_signal\); datasets present: Product/Signal"):
        er2.read_flight_labels(cfg.data.flights[0], cfg.data)


def test_swath_slice_beyond_the_sensor_is_explained(tmp_path):
    cfg = config_for(tmp_path, write_flight(tmp_path), swath_slice=[40, 480])
    with pytest.raises(DataError, match=r"data.swath_slice \[40, 480\] needs 480 sensor rows .* have 12"):
        er2.read_flight_labels(cfg.data.flights[0], cfg.data)


def test_corrupt_file_is_named(tmp_path):
    entry = write_flight(tmp_path)
    (tmp_path / entry["cpl_file"]).write_bytes(b"not hdf5 at all")
    cfg = config_for(tmp_path, entry)
    with pytest.raises(DataError, match="cannot read .*10feb25.hdf5 as HDF5"):
        er2.read_flight_labels(cfg.data.flights[0], cfg.data)


def test_glob_patterns_must_match_exactly_one_file(tmp_path):
    entry = write_flight(tmp_path)
    cfg = config_for(tmp_path, dict(entry, cpl_file="CPL_L2_*_10feb25.hdf5"))
    assert er2.flight_paths(cfg.data.flights[0], cfg.data)["cpl"].name == entry["cpl_file"]
    (tmp_path / "CPL_L2_V1-02_01kmLay_999999_10feb25.hdf5").write_bytes(b"")
    with pytest.raises(DataError, match="matches 2 files"):
        er2.flight_paths(cfg.data.flights[0], cfg.data)
