"""Public ER-2 navigation as ICARTT text (`*_MetNav_ER2_YYYYMMDD_R0.ict`): found in data.dir, read with the
icartt package, matched to the IR frames by time (across midnight too), fill values as NaN, and every
problem named with its file and key."""

from __future__ import annotations

import calendar
import datetime as dt
import sys

import h5py
import numpy as np
import pytest
from conftest import tiny_raw

from cloudml_lib.config import build_config
from cloudml_lib.data import cpl, er2
from cloudml_lib.data.flights import find_flights
from cloudml_lib.data.synthetic import ICARTT_NAV_INDEX, make_demo_flights, write_icartt_nav
from cloudml_lib.errors import DataError


@pytest.fixture
def five(tmp_path):
    entries = make_demo_flights(
        tmp_path / "flights", n_flights=5, seed=2, frames_per_flight=200, frame_shape=(40, 48)
    )

    def data(**settings):
        raw = tiny_raw(tmp_path / "flights", entries, tmp_path / "cache")
        raw["data"].update(settings)
        return build_config(raw).data

    return tmp_path / "flights", entries, data


def ir_times(root, entry):
    with h5py.File(root / entry["ir_file"]) as f:
        return f["Time/TimeUTC"][()][: f["Product/Signal"].shape[0]]


def test_the_demo_flight_with_icartt_nav_is_found_and_matched_by_time(five):
    root, entries, data = five
    ict = entries[ICARTT_NAV_INDEX]["nav_file"]
    assert ict.endswith("_MetNav_ER2_20250309_R0.ict")
    found = {f.name: f for f in find_flights(data(flights=[]))}
    assert found["09Mar25"].files["nav"] == ict
    d = data()
    labels = cpl.read_flight_labels(d.flights[ICARTT_NAV_INDEX], d)
    assert labels.heading_note.startswith("heading from") and np.isfinite(labels.heading_deg).all()
    # the file holds one record per whole second; each label's frame takes the nearest record
    import icartt

    table = icartt.Dataset(str(root / ict)).data.data
    t = ir_times(root, entries[ICARTT_NAV_INDEX])
    midnight = calendar.timegm(dt.date(2025, 3, 9).timetuple())
    nearest = np.abs(table["Time_Start"][None, :] + midnight - t[labels.frame_index][:, None]).argmin(axis=1)
    np.testing.assert_allclose(labels.heading_deg, table["True_Heading"][nearest])
    np.testing.assert_allclose(labels.saa_deg, table["Sun_Azimuth"][nearest] % 360)


def test_icartt_nav_across_midnight_fills_and_a_preferred_time_axis(five):
    root, entries, data = five
    e = entries[1]  # the demo flight that crosses 00 UTC
    t = ir_times(root, e)
    midnight = calendar.timegm(dt.date(2025, 3, 3).timetuple())
    assert np.nanmax(t) - midnight > 86400 > np.nanmin(t[t > 0]) - midnight
    with h5py.File(root / e["nav_file"]) as f:
        rows = t.size
        per_frame = {
            "sza": f["nav/solarZenith"][:rows],
            "saa": f["nav/sunAzGrd"][:rows],
            "heading": f["nav/trueHdg"][:rows],
            "lat": f["nav/IWG_lat"][:rows],
            "lon": f["nav/IWG_lon"][:rows],
        }
    ict = root / "03Mar25" / "IMPACTS_MetNav_ER2_20250303_R0.ict"
    write_icartt_nav(ict, dt.date(2025, 3, 3), t - midnight, per_frame, np.random.default_rng(0))
    assert max(float(x.split(",")[0]) for x in ict.read_text().splitlines()[-3:]) > 86400  # past 24 h
    found = {f.name: f for f in find_flights(data(flights=[]))}
    assert found["03Mar25"].files["nav"].endswith(".ict")  # chosen over the .hdf: it has a time axis
    d = data()
    d.flights[1].nav_file = "03Mar25/IMPACTS_MetNav_ER2_20250303_R0.ict"
    nav = er2.read_nav(d.flights[1], d, ict, er2.read_ir_times(root / e["ir_file"], d.flights[1], d)[0])
    usable = np.isfinite(er2.read_ir_times(root / e["ir_file"], d.flights[1], d)[0])
    # every frame with a time, before and after midnight, has its record: the heading is never filled
    np.testing.assert_allclose(nav.values["heading"][usable], per_frame["heading"][usable] % 360, atol=1e-3)
    filled = usable & np.isnan(nav.values["sza"])  # about 1% fill values (-9999) come back as NaN
    assert 0 < filled.sum() < 0.05 * usable.sum()
    assert cpl.read_flight_labels(d.flights[1], d).counts["kept"] > 5


def test_icartt_problems_name_the_file_and_key(five, monkeypatch):
    root, entries, data = five
    d = data()
    flight, path = d.flights[ICARTT_NAV_INDEX], root / entries[ICARTT_NAV_INDEX]["nav_file"]
    t = np.arange(10.0)
    d.keys.ict_zenith = "SZA_missing"
    with pytest.raises(
        DataError,
        match=r"no column 'SZA_missing' \(data.keys.ict_zenith\); columns present: "
        r"Time_Start, Latitude",
    ):
        er2.read_nav(flight, d, path, t)
    d = data()
    d.keys.ict_heading = "Heading_missing"  # no heading: not an error, flips are off
    nav = er2.read_nav(flight, d, path, t)
    assert "no heading (data.keys.ict_heading 'Heading_missing'" in nav.heading_note
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:5]) + "\n")  # a download cut off in the header
    with pytest.raises(DataError, match=rf"cannot read {path} as ICARTT 1001 nav"):
        er2.read_nav(flight, d, path, t)
    monkeypatch.setitem(sys.modules, "icartt", None)
    with pytest.raises(DataError, match="needs the icartt package: pip install 'icartt>=2.0'"):
        er2.read_nav(flight, d, path, t)
