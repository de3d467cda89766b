"""The reader on files written the way the real ones are (ER2_DATA.md, "Corrections from public evidence"):
(N, 3) Julian days, (N, 10) layers with the top one first and Number_Layers, surface altitude in km,
epoch IR times with strays, nav without a time axis, one folder per flight."""

import datetime as dt
import logging

import h5py
import numpy as np
import pytest
from conftest import preprocess_frame, with_heights

from cloudml_lib.base.config import build_config
from cloudml_lib.base.errors import DataError
from cloudml_lib.data import cpl, er2, times

DATE = dt.date(2025, 2, 10)
MIDNIGHT = 1739145600.0  # 2025-02-10 00:00 UTC
T0 = 3600.0  # the camera starts at 01:00 UTC
FOLDER = "10Feb25"
NAMES = {
    "ir": f"{FOLDER}/GLOVE2025_IRAI_L1B_Rev-_20250210-003.h5",
    "cpl": f"{FOLDER}/CPL_L2_V1-02_01kmLay_259015_10feb25.hdf5",
    "nav": f"{FOLDER}/CRS_20250210_nav.hdf",
}

# (time of day s, layer bases top first, lidar surface km, DEM)
PROFILES = [
    (T0 + 2.2, [1.0], 0.0, 0.0),  # kept, frame 2
    (T0 + 5.4, [9.0, 0.5], 0.01, 0.0),  # two layers: lowest 0.5 kept at frame 5; the top one is cirrus
    (T0 + 7.5, [0.6], 0.0, 0.0),  # 0.5 s from frames 7 and 8: kept, nearest wins ties -> 7
    (T0 + 9.0, [], 0.0, 0.0),  # no layer
    (T0 + 10.0, [2.5], 0.0, 0.0),  # out of range
    (T0 + 11.0, [1.2], 0.0, 120.0),  # over land
    (T0 + 12.0, [1.2], 1.5, 0.0),  # lidar surface 1.5 km: too high
    (T0 + 13.0, [1.2], -9999.0, 0.0),  # lidar surface fill value
    (T0 + 14.1, [1.1], 0.0, 0.0),  # kept, frame 14
    (T0 + 14.1, [1.3], 0.0, 0.0),  # the same time again: one label per frame, the first
    (T0 + 40.0, [1.0], 0.0, 0.0),  # after the camera stopped: unmatched
]


def write_flight(
    root,
    n_frames=20,
    ir_time=None,
    rows=12,
    frames_dtype=np.float32,
    profiles=PROFILES,
    julian_2d=True,
    nav_rows=None,
    nav_time=False,
    year=DATE.year,
):
    """A small flight in the real layout whose labels, times and angles are known exactly."""
    (root / FOLDER).mkdir(parents=True, exist_ok=True)
    ir_time = MIDNIGHT + T0 + np.arange(n_frames, dtype=float) if ir_time is None else ir_time
    with h5py.File(root / NAMES["ir"], "w") as f:
        counts = np.random.default_rng(0).integers(9000, 11000, (n_frames, rows, 16))  # 100 counts per K
        f["Product/Signal"] = counts.astype(frames_dtype)
        f["Time/TimeUTC"] = ir_time
    n = len(profiles)
    t = np.array([p[0] for p in profiles])
    doy = DATE.timetuple().tm_yday + t / 86400.0
    base = np.full((n, 10), -9999.0, np.float32)
    for i, p in enumerate(profiles):
        base[i, : len(p[1])] = p[1]
    with h5py.File(root / NAMES["cpl"], "w") as f:
        f["metadata_parameters/File_Year"] = np.array([year], np.int32)
        g = f.create_group("layer_descriptor")
        g["Profile_Decimal_Julian_Day"] = (
            np.stack([doy - 2.5 / 86400, doy, doy + 2.5 / 86400], 1) if julian_2d else doy
        )
        g["Layer_Base_Altitude"] = base
        g["Number_Layers"] = np.array([len(p[1]) for p in profiles], np.int16)
        g["Lidar_Surface_Altitude"] = np.array([p[2] for p in profiles], np.float32)
        g["DEM_Surface_Altitude"] = np.array([p[3] for p in profiles], np.float32)
        geo = f.create_group("geolocation")
        geo["Solar_Zenith_Angle"] = 50.0 + np.arange(n, dtype=np.float32)  # zenith = 50 + profile
        geo["Solar_Azimuth_Angle"] = -170.0 + np.arange(n, dtype=np.float32)  # -180..180 convention
        geo["CPL_Latitude"] = np.stack([np.full(n, 33.0), np.full(n, 34.0), np.full(n, 35.0)], 1)
        geo["CPL_Longitude"] = np.full((n, 3), -122.0)
    n_nav = nav_rows or n_frames
    with h5py.File(root / NAMES["nav"], "w") as f:
        f["nav/solarZenith"] = 30.0 + np.arange(n_nav, dtype=float)  # zenith = 30 + row
        f["nav/sunAzGrd"] = 100.0 + np.arange(n_nav, dtype=float)
        f["nav/IWG_lat"] = np.full(n_nav, 34.0)
        f["nav/IWG_lon"] = np.full(n_nav, -122.0)
        if nav_time:
            f["nav/Time"] = T0 - 3.0 + np.arange(n_nav, dtype=float)  # row r is frame r - 3
    return {"name": "10Feb25", "ir_file": NAMES["ir"], "cpl_file": NAMES["cpl"], "nav_file": NAMES["nav"]}


def labels_for(root, entry, **data):
    other = dict(entry, name="other")
    cfg = build_config(
        {
            "data": {
                "dir": str(root),
                "flights": [entry, other],
                "test_flights": ["other"],
                "swath_slice": [2, 10],
                **data,
            }
        }
    )
    return with_heights(cpl.read_flight_labels(cfg.data.flights[0], cfg.data))


def test_real_layout_filters_matching_and_counts(tmp_path):
    labels = labels_for(tmp_path, write_flight(tmp_path))
    assert labels.frame_index.tolist() == [2, 5, 7, 14]
    np.testing.assert_allclose(labels.cbh_km, [1.0, 0.5, 0.6, 1.1])  # the lowest layer's base by default
    assert labels.counts == {
        "profiles": 11,
        "bad_time": 0,
        "no_layer": 1,
        "multi_layer": 0,
        "out_of_range": 1,
        "over_land": 1,
        "bad_surface": 2,
        "unmatched": 1,
        "duplicate_frame": 1,
        "beyond_nav": 0,
        "kept": 4,
        "multi_layer_profiles": 1,
        "no_heading": 4,
        "cloud_labels": 8,
        "clear_sky": 1,
    }  # every usable matched profile: a cloud flag
    np.testing.assert_allclose(labels.sza_deg, [32, 35, 37, 44])  # nav row i = frame i


def test_label_layer_top_and_single(tmp_path):
    entry = write_flight(tmp_path)
    top = labels_for(tmp_path, entry, label_layer="top")
    assert top.frame_index.tolist() == [2, 7, 14]  # 9.0 km cirrus is out of range
    assert top.counts["out_of_range"] == 2
    single = labels_for(tmp_path, entry, label_layer="single")
    assert single.frame_index.tolist() == [2, 7, 14] and single.counts["multi_layer"] == 1
    assert single.counts["out_of_range"] == 1


def test_one_dimensional_julian_days_are_still_read(tmp_path):
    labels = labels_for(tmp_path, write_flight(tmp_path, julian_2d=False))
    assert labels.frame_index.tolist() == [2, 5, 7, 14]


def test_julian_days_take_the_file_year(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)
    entry = write_flight(tmp_path, year=2024)  # the file says 2024: no label matches 2025 frames
    with pytest.raises(DataError, match=r"no lidar label survives.*lidar 2024-02-10"):
        labels_for(tmp_path, entry)
    assert "File_Year 2024 but its name says 2025" in caplog.text


def test_epoch_times_survive_strays_and_say_which_format(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)
    t = MIDNIGHT + T0 + np.arange(20, dtype=float)
    t[5], t[9], t[11] = 0.0, -9999.0, 1.0e9  # a stray zero, a fill value, an outlier
    with caplog.at_level(logging.INFO, logger="cloudml_lib"):
        labels = labels_for(tmp_path, write_flight(tmp_path, ir_time=t))
    assert labels.frame_index.tolist() == [2, 7, 14]  # frame 5 has no time: its label is unmatched
    assert "IR times read as Unix epoch seconds (detected); 3 unusable values" in caplog.text


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda t: t[::-1].copy(), "0 repeat the time before and 19 run backwards (first: frame 1 at"),
        (lambda t: np.r_[t[:8], t[7], t[9:]], "1 repeat the time before and 0 run backwards (first: frame 8"),
    ],
)
def test_frame_times_that_repeat_or_run_backwards_are_refused_by_name(tmp_path, edit, said):
    """Frames whose times run backwards would get the mirror-image frames' lidar heights: refused, naming the
    file, its time key and the first offending frame (stray fill values apart, as the test above shows)."""
    t = edit(MIDNIGHT + T0 + np.arange(20, dtype=float))
    with pytest.raises(DataError) as e:
        labels_for(tmp_path, write_flight(tmp_path, ir_time=t))
    msg = str(e.value)
    where = f"flight 10Feb25: {tmp_path / NAMES['ir']} 'Time/TimeUTC'"
    assert msg.startswith(f"{where}: the frames' times do not increase: ")
    assert said in msg and "data.flights" in msg


def test_time_format_detection_and_midnight_wrap():
    sod = np.array([86398.0, 86399.0, 0.0, 1.0])
    t, fmt, bad = times.to_epoch_seconds(sod, "auto", DATE, "test")
    assert fmt == "seconds_of_day" and bad == 0
    np.testing.assert_allclose(t, MIDNIGHT + np.array([86398, 86399, 86400, 86401]))
    t2, fmt2, _ = times.to_epoch_seconds(np.concatenate([[0.0], t]), "auto", DATE, "test")
    assert fmt2 == "epoch" and np.isnan(t2[0]) and np.array_equal(t2[1:], t)
    with pytest.raises(DataError, match="cannot tell the time format.*data.ir_time_format"):
        times.to_epoch_seconds(np.array([5e5, 1e6]), "auto", DATE, "flight X")
    with pytest.raises(DataError, match="no usable time values"):
        times.to_epoch_seconds(np.array([0.0, -9999.0]), "auto", DATE, "flight X")


def test_seconds_of_day_ir_times_match_the_same_labels(tmp_path):
    labels = labels_for(tmp_path, write_flight(tmp_path, ir_time=T0 + np.arange(20, dtype=float)))
    assert labels.frame_index.tolist() == [2, 5, 7, 14]


def test_time_axis_longer_than_frames_is_trimmed_shorter_is_an_error(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="cloudml_lib"):
        labels = labels_for(
            tmp_path, write_flight(tmp_path, ir_time=MIDNIGHT + T0 + np.arange(23, dtype=float))
        )
    assert labels.n_frames == 20 and "has 23 times for 20 frames; using the first 20" in caplog.text
    with pytest.raises(DataError, match="15 times for 20 frames; every frame needs a time"):
        labels_for(tmp_path, write_flight(tmp_path, ir_time=MIDNIGHT + T0 + np.arange(15, dtype=float)))


def test_an_ir_file_without_frames_says_so(tmp_path):
    entry = write_flight(tmp_path, n_frames=0)
    with pytest.raises(DataError) as e:
        labels_for(tmp_path, entry)
    assert str(e.value) == (
        f"flight 10Feb25: {tmp_path / NAMES['ir']} has no frames: 'Product/Signal' (data.keys.ir_signal) has "
        "shape (0, 12, 16). Is the download complete? Replace the file, or remove flight 10Feb25 from "
        "data.flights."
    )


def test_big_endian_unsigned_frames_preprocess_like_floats(tmp_path):
    entry = write_flight(tmp_path, frames_dtype=np.dtype(">u2"))
    cfg = build_config(
        {
            "data": {
                "dir": str(tmp_path),
                "flights": [entry, dict(entry, name="o")],
                "test_flights": ["o"],
                "swath_slice": [2, 10],
            }
        }
    )
    with h5py.File(tmp_path / entry["ir_file"]) as f:
        raw = f["Product/Signal"]
        assert raw.dtype == np.dtype(">u2")
        frame, n_bad, blank = preprocess_frame(raw[3], cfg.data)
        expected = preprocess_frame(raw[3].astype(np.float32), cfg.data)[0]
    assert n_bad == 0 and not blank and np.isfinite(frame).all()
    np.testing.assert_array_equal(frame, expected)
    assert abs(frame.mean()) < 1e-4 and abs(frame.std() - 1) < 1e-3


def test_nav_longer_than_the_frames_is_aligned_from_row_0(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="cloudml_lib"):
        labels = labels_for(tmp_path, write_flight(tmp_path, nav_rows=31))
    np.testing.assert_allclose(labels.sza_deg, [32, 35, 37, 44])
    np.testing.assert_allclose(labels.saa_deg, [102, 105, 107, 114])
    assert "nav row i is taken to be IR frame i (the first 20 of its 31 rows used)" in caplog.text


def test_short_nav_drops_and_counts_the_labels_beyond_it(tmp_path):
    labels = labels_for(tmp_path, write_flight(tmp_path, nav_rows=10))
    assert labels.frame_index.tolist() == [2, 5, 7] and labels.counts["beyond_nav"] == 1
    np.testing.assert_allclose(labels.sza_deg, [32, 35, 37])


def test_nav_with_a_time_axis_is_matched_by_time(tmp_path):
    labels = labels_for(tmp_path, write_flight(tmp_path, nav_rows=30, nav_time=True))
    np.testing.assert_allclose(labels.sza_deg, [30 + 5, 30 + 8, 30 + 10, 30 + 17])


def test_angles_from_the_cpl_profiles_need_no_nav_file(tmp_path):
    entry = write_flight(tmp_path)
    (tmp_path / entry["nav_file"]).unlink()
    labels = labels_for(tmp_path, dict(entry, nav_file=""), angles_source="cpl")
    assert labels.frame_index.tolist() == [2, 5, 7, 14]
    np.testing.assert_allclose(labels.sza_deg, [50, 51, 52, 58])  # profiles 0, 1, 2 and 8
    np.testing.assert_allclose(labels.saa_deg, [190, 191, 192, 198])  # -170 -> 190: clockwise from N
    np.testing.assert_allclose(labels.lat, 34.0)  # the mean column of (N, 3)


def test_profile_count_disagreement_names_every_dataset(tmp_path):
    entry = write_flight(tmp_path)
    with h5py.File(tmp_path / entry["cpl_file"], "a") as f:
        del f["layer_descriptor/Number_Layers"]
        f["layer_descriptor/Number_Layers"] = np.ones(5, np.int16)
    with pytest.raises(
        DataError,
        match=r"disagree on the number of profiles \(11 times, 11 layer rows, "
        r"5 Number_Layers",
    ):
        labels_for(tmp_path, entry)


def test_missing_file_names_flight_and_file(tmp_path):
    entry = write_flight(tmp_path)
    (tmp_path / entry["nav_file"]).unlink()
    with pytest.raises(DataError, match=r"flight 10Feb25: missing nav file .*10Feb25/CRS_20250210_nav.hdf"):
        labels_for(tmp_path, entry)


def test_missing_key_names_flight_file_and_config_key(tmp_path):
    entry = write_flight(tmp_path)
    with pytest.raises(
        DataError,
        match=r"flight 10Feb25: .*GLOVE2025_IRAI_L1B_Rev-_20250210-003.h5 has no dataset "
        r"'Product/Radiance' \(set by data.keys.ir_signal\); datasets present: "
        r"Product/Signal",
    ):
        labels_for(tmp_path, entry, keys={"ir_signal": "Product/Radiance"})


def test_swath_slice_beyond_the_sensor_is_explained(tmp_path):
    with pytest.raises(DataError, match=r"data.swath_slice \[40, 480\] needs 480 sensor rows .* have 12"):
        labels_for(tmp_path, write_flight(tmp_path), swath_slice=[40, 480])


def test_corrupt_file_is_named(tmp_path):
    entry = write_flight(tmp_path)
    (tmp_path / entry["cpl_file"]).write_bytes(b"not hdf5 at all")
    with pytest.raises(DataError, match="cannot read .*10feb25.hdf5 as HDF5"):
        labels_for(tmp_path, entry)


def test_glob_patterns_in_sub_folders_must_match_exactly_one_file(tmp_path):
    entry = write_flight(tmp_path)
    cfg = build_config(
        {
            "data": {
                "dir": str(tmp_path),
                "test_flights": ["o"],
                "flights": [dict(entry, cpl_file="10Feb25/CPL_L2_*_10feb25.hdf5"), dict(entry, name="o")],
            }
        }
    )
    assert (
        er2.flight_paths(cfg.data.flights[0], cfg.data)["cpl"].name
        == "CPL_L2_V1-02_01kmLay_259015_10feb25.hdf5"
    )
    (tmp_path / "10Feb25" / "CPL_L2_V1-02_01kmLay_999999_10feb25.hdf5").write_bytes(b"")
    with pytest.raises(DataError, match="matches 2 files"):
        er2.flight_paths(cfg.data.flights[0], cfg.data)
