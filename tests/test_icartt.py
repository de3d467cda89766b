"""Public ER-2 navigation as ICARTT text (`*_MetNav_ER2_YYYYMMDD_R0.ict`): found in data.dir, read by
CloudML's own reader (data/ict.py; the same values as the icartt package's on the real NASA file), matched
to the IR frames by time (across midnight too), fill values as NaN, and every problem named with its file
and key. A file is checked before it is trusted: its date (header, file name, Day_Of_Year), its times and
its angles; a flight whose frames mostly find no record is refused by train, flagged by labels and warned
about by predict. A real NASA file (tests/fixtures/impacts_metnav) is read."""

from __future__ import annotations

import calendar
import datetime as dt
import logging
import re
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from conftest import tiny_raw

from cloudml_lib.base.config import DataConfig, FlightConfig, build_config
from cloudml_lib.base.errors import DataError
from cloudml_lib.commands import cli
from cloudml_lib.data import cpl, er2, navigation, times
from cloudml_lib.data.flights import check_rows, find_flights
from cloudml_lib.data.synthetic import ICARTT_NAV_INDEX, make_demo_flights, write_icartt_nav


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
    # the file holds one record per whole second; each label's frame takes the nearest usable record (one
    # with both sun angles: a fill value makes a record unusable)
    import icartt

    table = icartt.Dataset(str(root / ict)).data.data
    table = table[np.isfinite(table["Solar_Zenith_Angle"]) & np.isfinite(table["Sun_Azimuth"])]
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
    nav = navigation.read_nav(
        d.flights[1], d, ict, er2.read_ir_times(root / e["ir_file"], d.flights[1], d)[0]
    )
    usable = np.isfinite(er2.read_ir_times(root / e["ir_file"], d.flights[1], d)[0])
    # every frame with a time, before and after midnight, has its record; a frame whose own record has a fill
    # value (-9999) for a sun angle takes the nearest usable one (1 s away): no angle is left unknown
    same = np.isclose(nav.values["heading"][usable], per_frame["heading"][usable] % 360, atol=1e-3)
    assert same.mean() > 0.95
    assert nav.matched == usable.sum() == nav.timed and np.isfinite(nav.values["sza"][usable]).all()
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
        r"Time_Start, Day_Of_Year, Latitude",
    ):
        navigation.read_nav(flight, d, path, t)
    d = data()
    d.keys.ict_heading = "Heading_missing"  # no heading: not an error, flips are off
    nav = navigation.read_nav(flight, d, path, t)
    assert "no heading (data.keys.ict_heading 'Heading_missing'" in nav.heading_note
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:5]) + "\n")  # a download cut off in the header
    with pytest.raises(DataError, match=rf"cannot read {path} as ICARTT 1001 nav"):
        navigation.read_nav(flight, d, path, t)
    path.write_text("\n".join(lines) + "\n")  # whole again: read without the icartt package
    monkeypatch.setitem(sys.modules, "icartt", None)
    assert navigation.read_nav(flight, d, path, t).heading_note


# ------------------------------------------------------------------------ checked before trusted

DAY = dt.date(2025, 3, 9)
MIDNIGHT = calendar.timegm(DAY.timetuple())
NAME = "IMPACTS_MetNav_ER2_20250309_R0.ict"
REAL = "IMPACTS_MetNav_ER2_20230302_R0.ict"
REAL_FIXTURE = Path(__file__).parent / "fixtures" / "impacts_metnav" / REAL
REAL_FULL = Path(__file__).resolve().parents[2] / "shared" / "data" / "real" / REAL  # ../shared


class NoFill:
    """In place of write_icartt_nav's random generator: no fill values (each test writes its own)."""

    def random(self, shape):
        return np.ones(shape)


@pytest.fixture
def warned(logs_reach_caplog, caplog):
    """The WARNING lines logged so far, joined."""
    return lambda: " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def small_nav(tmp_path, n=60, start_s=64800.0, sza=40.0, saa=150.0, name=NAME, flight_date=DAY, demo=False):
    """An ICARTT nav file (one record a second, from 10 s before `n` frames to 10 s after them, the frames 1 s
    apart from `start_s` seconds of day) and (flight, data settings, path, frame times) to read it with. A
    user's file unless `demo` (the demo's: its angles set per flight, not by the sun, and records it leaves
    out said without a warning)."""
    seconds = start_s + np.arange(n, dtype=float)
    per_frame = {
        "sza": np.broadcast_to(np.asarray(sza, float), (n,)).copy(),
        "saa": np.broadcast_to(np.asarray(saa, float), (n,)).copy(),
        "heading": np.full(n, 90.0),
        "lat": np.full(n, 34.0),
        "lon": np.full(n, -122.0),
    }
    write_icartt_nav(tmp_path / name, DAY, seconds, per_frame, NoFill())
    if not demo:  # another PI than the demo's
        lines = (tmp_path / name).read_text().splitlines(keepends=True)
        (tmp_path / name).write_text("".join([lines[0], "Test, Pilot\n", *lines[2:]]))
    flight = FlightConfig(name="09Mar25", nav_file=name, date=flight_date.isoformat())
    return flight, DataConfig(dir=str(tmp_path)), tmp_path / name, MIDNIGHT + seconds + 0.2


def edit_records(path, change) -> int:
    """Rewrite an ICARTT file's records: `change` edits a dict of column name -> values (floats; NaN is
    written as text). Returns the number of header lines."""
    lines = path.read_text().splitlines()
    n_header = int(lines[0].split(",")[0])
    names = [n.strip() for n in lines[n_header - 1].split(",")]
    table = np.array([[float(x) for x in line.split(",")] for line in lines[n_header:]])
    cols = {name: table[:, i].copy() for i, name in enumerate(names)}
    change(cols)
    rows = [", ".join(f"{v:.10g}" for v in row) for row in np.stack([cols[n] for n in names], 1)]
    path.write_text("\n".join(lines[:n_header] + rows) + "\n")
    return n_header


def set_header_date(path, date: dt.date) -> None:
    lines = path.read_text().splitlines()
    lines[6] = f"{date:%Y, %m, %d}, {date:%Y, %m, %d}"  # line 7: the date Time_Start counts from
    path.write_text("\n".join(lines) + "\n")


def test_every_value_a_fill_value_is_refused_naming_the_file_and_what_is_valid(tmp_path):
    flight, data, path, t = small_nav(tmp_path)

    def fill(cols):
        for name in ("Latitude", "Longitude", "True_Heading", "Solar_Zenith_Angle", "Sun_Azimuth"):
            cols[name][:] = -9999.0
        cols["Solar_Zenith_Angle"][:10] = -8888.0  # the limit-of-detection flags are no values either
        cols["Solar_Zenith_Angle"][10:20] = -7777.0

    edit_records(path, fill)
    with pytest.raises(DataError) as e:
        navigation.read_nav(flight, data, path, t)
    assert str(e.value).startswith(
        f"flight 09Mar25: {path} has no usable nav record: of its 80 records, 80 with no solar zenith (fill "
        "value or not a number), 80 with no sun azimuth (fill value or not a number). Valid: Time_Start "
        "0..172800 s"
    )
    assert "set data.angles_source: cpl" in str(e.value)


def test_fill_values_in_the_time_column_are_refused_or_left_out_with_a_count(tmp_path, warned):
    flight, data, path, t = small_nav(tmp_path)
    edit_records(path, lambda c: c["Time_Start"].__setitem__(slice(None), -9999.0))
    with pytest.raises(
        DataError, match=r"has no usable nav record: of its 80 records, 80 with no time \(fill"
    ):
        navigation.read_nav(flight, data, path, t)
    flight, data, path, t = small_nav(tmp_path)
    edit_records(path, lambda c: c["Time_Start"].__setitem__(slice(0, None, 4), -9999.0))
    nav = navigation.read_nav(flight, data, path, t)
    assert (
        f"flight 09Mar25: {path}: 60 of 80 nav records usable (75.0%); left out: 20 with no time (fill value "
        "or not a number). A frame takes the nearest usable record within 2 s" in warned()
    )
    assert nav.matched == nav.timed == 60 and np.all(nav.values["sza"] == 40.0)  # each from a neighbour
    # the demo's own nav leaves records out on purpose: said in the log, never a newcomer's first warning
    before = warned().count("nav records usable")
    (tmp_path / "demo").mkdir()
    flight, data, path, t = small_nav(tmp_path / "demo", demo=True)
    edit_records(path, lambda c: c["Time_Start"].__setitem__(slice(0, None, 4), -9999.0))
    assert navigation.read_nav(flight, data, path, t).matched == 60
    assert warned().count("nav records usable") == before == 1


def test_the_header_date_is_outvoted_by_the_file_name_and_day_of_year(tmp_path, warned):
    flight, data, path, t = small_nav(tmp_path)
    set_header_date(path, dt.date(2025, 1, 5))  # as the real NASA file: 63 days early
    nav = navigation.read_nav(flight, data, path, t)
    assert nav.matched == 60
    assert (
        f"flight 09Mar25: {path}: the header's date (line 7) is 2025-01-05, but the dates disagree (the file "
        "name says 2025-03-09; its Day_Of_Year column (day 68) says 2025-03-09); its records are dated "
        "2025-03-09 (2 of 3 agree)" in warned()
    )


def test_a_file_name_that_disagrees_is_outvoted_by_the_header_and_day_of_year(tmp_path, warned):
    flight, data, path, t = small_nav(tmp_path, name="IMPACTS_MetNav_ER2_20250310_R0.ict")
    nav = navigation.read_nav(flight, data, path, t)
    assert nav.matched == 60
    assert "the file name says 2025-03-10" in warned()
    assert "its records are dated 2025-03-09 (2 of 3 agree)" in warned()


def test_without_day_of_year_a_tie_is_decided_by_the_flights_date_or_refused(tmp_path, warned):
    flight, data, path, t = small_nav(tmp_path)
    edit_records(path, lambda c: c["Day_Of_Year"].__setitem__(slice(None), -9999.0))
    set_header_date(path, dt.date(2025, 3, 8))
    nav = navigation.read_nav(flight, data, path, t)
    assert nav.matched == 60
    assert "its records are dated 2025-03-09 (the flight's own date decides)" in warned()
    flight.date = "2025-03-07"
    with pytest.raises(DataError) as e:
        navigation.read_nav(flight, data, path, t)
    assert (
        f"flight 09Mar25: {path}: cannot tell which day its times count from: the header (line 7) says "
        "2025-03-08; the file name says 2025-03-09; the flight's date is 2025-03-07. Make them agree"
    ) in str(e.value)


def test_absurd_times_are_left_out_and_a_file_of_them_is_refused(tmp_path, warned):
    flight, data, path, t = small_nav(tmp_path)

    def absurd(cols):
        cols["Time_Start"][:5] = -5.0  # before the file's day
        cols["Time_Start"][-5:] = 250000.0  # nearly three days on: no flight lasts that long

    edit_records(path, absurd)
    nav = navigation.read_nav(flight, data, path, t)
    assert "70 of 80 nav records usable (87.5%); left out: 10 with a time outside 0..172800 s" in warned()
    assert nav.matched == 60  # the records left out lay outside the frames' span anyway
    edit_records(path, lambda c: c["Time_Start"].__setitem__(slice(None), 3e6 + np.arange(80)))
    with pytest.raises(DataError, match="no usable nav record: of its 80 records, 80 with a time outside"):
        navigation.read_nav(flight, data, path, t)


def test_times_that_step_back_are_refused_and_a_single_one_left_out_with_a_count(tmp_path, warned):
    flight, data, path, t = small_nav(tmp_path, n=200)
    n_header = edit_records(path, lambda c: c["Time_Start"].__setitem__(slice(None), c["Time_Start"][::-1]))
    with pytest.raises(DataError) as e:
        navigation.read_nav(flight, data, path, t)
    assert (
        f"flight 09Mar25: {path}: Time_Start steps back or repeats in 219 of 220 records (first at record "
        f"2, line {n_header + 2}: 65008 s after 65009 s); the records must be in time order, or frames would "
        "get another record's angles"
    ) in str(e.value)
    flight, data, path, t = small_nav(tmp_path, n=200)
    edit_records(path, lambda c: c["Time_Start"].__setitem__(31, c["Time_Start"][30]))  # a repeated second
    nav = navigation.read_nav(flight, data, path, t)
    assert (
        "219 of 220 nav records usable (99.5%); left out: 1 with a time not after the record before it"
        in (warned())
    )
    assert nav.matched == 200


def test_angles_not_a_number_or_impossible_are_left_out_and_a_file_of_them_refused(tmp_path, warned):
    flight, data, path, t = small_nav(tmp_path)
    edit_records(path, lambda c: c["Solar_Zenith_Angle"].__setitem__(slice(None), 400.0))
    with pytest.raises(DataError, match="of its 80 records, 80 with a solar zenith outside 0..180 deg"):
        navigation.read_nav(flight, data, path, t)

    def damage(cols):
        cols["Solar_Zenith_Angle"][::10] = np.nan  # "nan" in the text
        cols["Sun_Azimuth"][15] = 500.0

    flight, data, path, t = small_nav(tmp_path)
    edit_records(path, damage)
    nav = navigation.read_nav(flight, data, path, t)
    assert (
        "71 of 80 nav records usable (88.8%); left out: 8 with no solar zenith (fill value or not a number), "
        "1 with a sun azimuth outside -180..360 deg" in warned()
    )
    assert nav.matched == 60 and np.all(nav.values["sza"] == 40.0) and np.all(nav.values["saa"] == 150.0)


def test_a_flight_across_midnight_keeps_every_record(tmp_path, warned):
    flight, data, path, t = small_nav(tmp_path, start_s=86400.0 - 30, demo=True)
    text = path.read_text().splitlines()
    assert text[-1].startswith("86439, 69")  # Time_Start past 86,400 s, on the next day of the year
    nav = navigation.read_nav(flight, data, path, t)
    assert nav.matched == nav.timed == 60 and warned() == ""


def test_a_zenith_past_90_is_kept_and_azimuths_in_either_convention_agree(tmp_path, warned):
    sza, saa = np.linspace(88.0, 92.2, 60), np.linspace(-179.0, 179.0, 60)
    flight, data, path, t = small_nav(tmp_path, sza=sza, saa=saa, demo=True)
    lines = path.read_text().splitlines()
    assert lines[int(lines[0].split(",")[0])].split(", ")[6] == "-179"  # the first record, -180..180
    nav = navigation.read_nav(flight, data, path, t)
    np.testing.assert_allclose(nav.values["sza"], sza, atol=1e-4)  # the sun at the horizon: valid
    np.testing.assert_allclose(nav.values["saa"], saa % 360, atol=1e-3)
    edit_records(path, lambda c: c["Sun_Azimuth"].__setitem__(slice(None), c["Sun_Azimuth"] % 360))
    np.testing.assert_allclose(navigation.read_nav(flight, data, path, t).values["saa"], saa % 360, atol=1e-3)
    assert warned() == ""


def test_the_real_nasa_file_is_dated_by_its_file_name_and_day_of_year(tmp_path, warned):
    """NASA ER-2 MetNav, IMPACTS campaign, published in the public GitHub repository slesaad/viz-experiments
    (public/assets/): a trimmed copy (tests/fixtures/impacts_metnav/README.md). Its header says 2023-01-05."""
    read_real_file(REAL_FIXTURE, 180, warned)


@pytest.mark.skipif(not REAL_FULL.is_file(), reason=f"the full real file is not at {REAL_FULL}")
def test_the_full_real_nasa_file_is_read_and_every_record_is_usable(warned):
    read_real_file(REAL_FULL, 17862, warned)


def read_real_file(path, n_records, warned):
    flight = FlightConfig(name="02Mar23", nav_file=path.name, date="2023-03-02")
    data = DataConfig(dir=str(path.parent))
    import icartt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the real header's comment count is one short: icartt says so
        seconds = icartt.Dataset(str(path)).data.data["Time_Start"]
    assert (seconds[0], seconds[-1], seconds.size) == (43203, 61064, n_records)
    midnight = calendar.timegm(dt.date(2023, 3, 2).timetuple())
    nav = navigation.read_nav(flight, data, path, midnight + seconds)
    assert nav.matched == n_records  # 2023-03-02, 12:00:03 to 16:57:44 UTC: every record
    assert [times.utc_text(midnight + s) for s in (seconds[0], seconds[-1])] == [
        "2023-03-02 12:00:03 UTC",
        "2023-03-02 16:57:44 UTC",
    ]
    first, last = {k: v[0] for k, v in nav.values.items()}, {k: v[-1] for k, v in nav.values.items()}
    assert (first["sza"], first["saa"], first["heading"]) == (92.2, 97.2, 287.21)  # the sun at the horizon
    assert (last["sza"], last["saa"], last["heading"]) == (60.9, 123.9, 231.31)
    assert (
        f"flight 02Mar23: {path}: the header's date (line 7) is 2023-01-05, but the dates disagree (the file "
        "name says 2023-03-02; its Day_Of_Year column (day 61) says 2023-03-02); its records are dated "
        "2023-03-02 (2 of 3 agree)" in warned()
    )
    assert "records usable" not in warned()  # no record is left out
    header = midnight - (dt.date(2023, 3, 2) - dt.date(2023, 1, 5)).days * 86400
    assert (
        navigation.read_nav(flight, data, path, header + seconds).matched == 0
    )  # as the header would date them


def icartt_values(path) -> dict:
    """Each column as the icartt package reads it (a test-only dependency: GPL-3.0, so CloudML does not
    ship with it), fill values (the declared flag, ULOD/LLOD flags) as NaN."""
    import icartt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = icartt.Dataset(str(path))
    flags = [-7777.0, -8888.0]
    out = {}
    for name in ds.data.data.dtype.names:
        v = np.atleast_1d(np.asarray(ds.data.data[name], np.float64)).copy()
        miss = ds.variables[name].miss
        v[np.isin(v, flags + ([float(miss)] if miss not in (None, "") else []))] = np.nan
        out[name] = v
    return out, tuple(int(x) for x in ds.dateOfCollection)


@pytest.mark.parametrize("which", ["fixture", "full", "demo"])
def test_our_reader_reads_what_the_icartt_package_reads(which, tmp_path):
    from cloudml_lib.data import ict

    if which == "demo":
        path = small_nav(tmp_path, n=30)[2]
        edit_records(path, lambda c: c["Solar_Zenith_Angle"].__setitem__(3, -9999.0))
    else:
        path = REAL_FIXTURE if which == "fixture" else REAL_FULL
        if not path.is_file():
            pytest.skip(f"the full real file is not at {path}")
    ours, (theirs, date) = ict.read_text(path.read_text()), icartt_values(path)
    assert ours.names == list(theirs) and ours.collected == date
    for name in ours.names:
        np.testing.assert_array_equal(ours.values(name), theirs[name], err_msg=name)
    assert any(np.isnan(ours.values(name)).any() for name in ours.names)  # fill values were compared too


def test_our_reader_names_the_line_of_a_broken_header_and_applies_scale_factors(tmp_path):
    from cloudml_lib.data import ict

    path = small_nav(tmp_path, n=20)[2]
    lines = path.read_text().splitlines()
    good = ict.read_text("\n".join(lines))

    def broken(i, text):
        return "\n".join(lines[:i] + [text] + lines[i + 1 :])

    for i, text, said in (
        (0, "57, 2110", "line 1: format 2110; only ICARTT format 1001"),
        (0, "500, 1001", "line 1: a header of 500 lines, but the file has"),
        (6, "2025, 02, 30, 2025, 03, 09", "line 7: the collection date [2025, 2, 30] is no date"),
        (10, "1, 1", "line 11: the scale factors: 6 value(s) expected, found 2"),
        (len(lines) - 1, "1, 2, x", "a data record: 7 value(s) expected, found 3"),
    ):
        with pytest.raises(ict.IcarttError, match=re.escape(said)):
            ict.read_text(broken(i, text))
    count = lines.index("0") + 1  # the normal comments' count, after the special ones' (none)
    lenient = ict.read_text(broken(count, str(int(lines[count]) - 1)))  # one short, as real files are
    np.testing.assert_array_equal(lenient.raw, good.raw)  # line 1's header length decides
    scaled = ict.read_text(broken(10, ", ".join(["1"] * 3 + ["0.5"] + ["1"] * 2)))
    name = good.names[4]
    np.testing.assert_array_equal(scaled.values(name), good.values(name) * 0.5)


# ------------------------------------------------------------------------ too few frames matched


def shift_a_day(root, entries):
    """The demo ICARTT flight's nav times one day on: no frame finds its record."""
    path = root / entries[ICARTT_NAV_INDEX]["nav_file"]
    edit_records(path, lambda c: c["Time_Start"].__setitem__(slice(None), c["Time_Start"] + 86400))
    return path


def test_too_few_frames_matched_is_refused_by_train_naming_the_flight_file_share_and_key(five, capsys):
    root, entries, data = five
    path = shift_a_day(root, entries)
    raw = tiny_raw(root, entries, root.parent / "cache")
    raw["data"]["flights"] = [entries[2], entries[ICARTT_NAV_INDEX]]
    config = root.parent / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert cli.main(["train", "--config", str(config), "--run-dir", str(root.parent / "run")]) == 2
    said = capsys.readouterr().err
    assert "Traceback" not in said
    assert (
        f"flight 09Mar25: only 0 of 199 IR frames (0.0%) found a nav record in {path} within 2 s, fewer than "
        "data.min_nav_match (0.5); its records span 2025-03-10 " in said
    )
    assert "the nav lies 1 day later; check the date its times count from" in said
    assert "set data.min_nav_match lower (0: any)" in said


def test_too_few_frames_matched_is_flagged_by_labels_and_accepted_when_the_setting_allows(five, capsys):
    root, entries, data = five
    shift_a_day(root, entries)
    rows, ok = check_rows(data())
    assert not ok and rows[ICARTT_NAV_INDEX][7].startswith("not usable: see note")
    raw = tiny_raw(root, entries, root.parent / "cache")
    config = root.parent / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert cli.main(["labels", "--config", str(config)]) != 0  # reported as unusable
    printed = capsys.readouterr().out
    assert "only 0 of 199 IR frames (0.0%) found a nav record" in printed and "data.min_nav_match" in printed
    rows, ok = check_rows(data(min_nav_match=0.0))
    assert ok  # 0: any share will do (the frames get the training mean zenith)


def test_predict_warns_when_too_few_frames_found_nav_and_leaves_their_angles_unknown(five, warned):
    from cloudml_lib.science.predict import _flight_inputs

    root, entries, data = five
    shift_a_day(root, entries)
    d = data()
    inputs = _flight_inputs(d.flights[ICARTT_NAV_INDEX], d)
    assert "flight 09Mar25: only 0 of 199 IR frames (0.0%) found a nav record" in warned()
    assert "Predicting anyway, with the nav records that were found." in warned()
    assert np.isnan(inputs["sza"]).all() and np.isnan(inputs["lat"]).all()  # no other record's angles
    assert np.isfinite(inputs["label"]).sum() > 5  # the CPL labels still compare (read with its own angles)


def test_with_angles_from_the_cpl_file_a_bad_nav_file_costs_only_the_heading(five, warned):
    root, entries, data = five
    path = root / entries[ICARTT_NAV_INDEX]["nav_file"]
    edit_records(path, lambda c: c["Time_Start"].__setitem__(slice(None), -9999.0))
    d = data(angles_source="cpl")
    labels = cpl.read_flight_labels(d.flights[ICARTT_NAV_INDEX], d)
    assert labels.heights > 5 and np.isnan(labels.heading_deg).all() and np.isfinite(labels.sza_deg).all()
    assert labels.heading_note == f"no heading ({path.name} is not usable)"
    assert f"{path} has no usable nav record" in warned() and "flips are off for the flight" in warned()
