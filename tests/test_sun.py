"""ICARTT nav files as they come: one record, a byte-order mark, a Latin-1 byte in a comment; and the sun
check: the file's zenith and azimuth against the sun that its times and positions give (NOAA's equations),
judged per flight, a named warning that changes nothing read."""

from __future__ import annotations

import calendar
import datetime as dt
import logging
import re
import warnings

import numpy as np
import pytest
from test_icartt import REAL, REAL_FIXTURE, REAL_FULL

from cloudml_lib.base.config import DataConfig, FlightConfig
from cloudml_lib.data import navigation, sun
from cloudml_lib.data.synthetic import ICARTT_NAV_INDEX, make_demo_flights

MIDNIGHT = calendar.timegm(dt.date(2023, 3, 2).timetuple())


@pytest.fixture
def logged(logs_reach_caplog, caplog):
    """The lines logged so far at a level, joined."""
    caplog.set_level(logging.INFO)
    return lambda level: " ".join(r.getMessage() for r in caplog.records if r.levelno == level)


def real_records(path=REAL_FIXTURE):
    import icartt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return icartt.Dataset(str(path)).data.data


def read(tmp_path, data: bytes, frames=None):
    """read_nav of `data` written as the real file's name, frames at every record's time."""
    path = tmp_path / REAL
    path.write_bytes(data)
    seconds = real_records(REAL_FIXTURE)["Time_Start"] if frames is None else frames
    flight = FlightConfig(name="02Mar23", nav_file=REAL, date="2023-03-02")
    return navigation.read_nav(flight, DataConfig(dir=str(tmp_path)), path, MIDNIGHT + seconds)


@pytest.mark.parametrize("path", [REAL_FIXTURE, REAL_FULL], ids=["trimmed", "full"])
def test_noaas_sun_matches_the_real_nasa_file_within_a_third_of_a_degree(path):
    if not path.is_file():
        pytest.skip(f"the full real file is not beside the checkout ({path.name})")
    d = real_records(path)
    zenith, azimuth = sun.position(MIDNIGHT + d["Time_Start"], d["Latitude"], d["Longitude"])
    day = (zenith < 90) & (d["Solar_Zenith_Angle"] > -9999)
    assert day.sum() > 0.9 * day.size
    off_z = np.abs(d["Solar_Zenith_Angle"][day] - zenith[day])
    off_a = np.abs((d["Sun_Azimuth"][day] - azimuth[day] + 180) % 360 - 180)  # the file: -180..180
    assert off_z.max() < 0.3 and off_a.max() < 0.3, (off_z.max(), off_a.max())


def test_the_sun_is_where_it_must_be_at_simple_moments():
    """Equinox noon on the equator: overhead; the same moment 90 degrees east: on the horizon, in the west;
    the northern winter solstice at 40 N, local noon: due south at 40 + 23.44 degrees from the zenith."""
    equinox = calendar.timegm(dt.datetime(2024, 3, 20, 12, 7).timetuple())  # noon at 0 E (equation of time)
    z, a = sun.position(np.array([equinox, equinox]), np.array([0.0, 0.0]), np.array([0.0, 90.0]))
    assert z[0] < 0.5 and abs(z[1] - 90) < 0.5 and abs(a[1] - 270) < 0.5
    solstice = calendar.timegm(dt.datetime(2024, 12, 21, 12, 2).timetuple())
    z, a = sun.position(np.array([solstice]), np.array([40.0]), np.array([0.0]))
    assert abs(z[0] - 63.44) < 0.2 and abs(a[0] - 180) < 1.0


def test_a_file_of_one_record_is_read(tmp_path):
    """The parser gives one record as a 0-d array: it was `TypeError: len() of unsized object` in labels,
    predict and train."""
    lines = REAL_FIXTURE.read_bytes().split(b"\n")
    n_header = int(lines[0].split(b",")[0])
    nav = read(tmp_path, b"\n".join(lines[: n_header + 1]) + b"\n", frames=np.array([43203.0]))
    assert nav.matched == 1 and nav.values["sza"][0] == 92.2


def test_a_byte_order_mark_or_a_latin1_byte_in_a_comment_reads_the_same_values(tmp_path, logged):
    plain = REAL_FIXTURE.read_bytes()
    want = read(tmp_path, plain).values
    lines = plain.split(b"\n")
    comment = next(i for i, line in enumerate(lines) if line.startswith(b"OTHER_COMMENTS"))
    lines[comment] += b" (calibr\xe9)"  # Latin-1 e-acute
    for tag, data in [("bom", b"\xef\xbb\xbf" + plain), ("latin-1", b"\n".join(lines))]:
        got = read(tmp_path, data).values
        assert got.keys() == want.keys(), tag
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{tag}: {key}")
    assert "read despite a UTF-8 byte-order mark" in logged(logging.INFO)
    assert f"on line(s) {comment + 1}, read as Latin-1" in logged(logging.INFO)
    assert "do not match" not in logged(logging.WARNING)


def exchanged_declarations(data: bytes) -> bytes:
    """The zenith and azimuth columns' declarations swapped: each column now carries the other's name."""
    lines = data.split(b"\n")
    z = next(i for i, line in enumerate(lines) if line.startswith(b"Solar_Zenith_Angle,"))
    a = next(i for i, line in enumerate(lines) if line.startswith(b"Sun_Azimuth,"))
    lines[z], lines[a] = lines[a], lines[z]
    return b"\n".join(lines)


def test_swapped_sun_columns_are_warned_about_by_name_and_used_as_read(tmp_path, logged):
    """The range checks pass them (zenith 97 deg and azimuth 92 deg are possible values): only the sun
    knows. The warning names the file, the keys and the swap; the values stay as read."""
    nav = read(tmp_path, exchanged_declarations(REAL_FIXTURE.read_bytes()))
    warned = logged(logging.WARNING)
    assert f"{tmp_path / REAL}: its sun angles do not match where the sun was" in warned
    assert "look swapped; check data.keys.ict_zenith" in warned and "data.keys.ict_azimuth" in warned
    assert re.search(
        r"zenith off by 3\d\.\d deg \(median; 100% of 1\d\d daylight records beyond 2 deg", warned
    )
    assert nav.values["sza"][0] == 97.2 and nav.values["saa"][0] == 92.2  # as read: nothing changed


def test_either_azimuth_convention_agrees_and_a_wrong_position_is_named(tmp_path, logged):
    def edit(data: bytes, column: str, change) -> bytes:
        lines = data.split(b"\n")
        n_header = int(lines[0].split(b",")[0])
        names = [n.strip() for n in lines[n_header - 1].decode().split(",")]
        k = names.index(column)
        for i in range(n_header, len(lines)):
            if lines[i].strip():
                row = lines[i].decode().split(",")
                row[k] = f"{change(float(row[k])):.4f}"
                lines[i] = ",".join(row).encode()
        return b"\n".join(lines)

    plain = REAL_FIXTURE.read_bytes()
    read(tmp_path, edit(plain, "Sun_Azimuth", lambda a: a % 360))  # 0..360 instead of -180..180
    assert "do not match" not in logged(logging.WARNING)
    read(tmp_path, edit(plain, "Longitude", lambda x: x + 60))  # the position of another place
    warned = logged(logging.WARNING)
    assert "do not match" in warned and "the latitude and longitude" in warned and "swapped" not in warned


def test_demo_flights_never_trip_the_check_and_it_runs_on_them(tmp_path, logged):
    """The demo's sun angles are set per flight (its shadows are drawn with them), not by the sun: its
    files say so in their header, and the check says it at INFO, having compared them."""
    entries = make_demo_flights(tmp_path, n_flights=5, seed=0, frames_per_flight=60, frame_shape=(16, 16))
    entry = entries[ICARTT_NAV_INDEX]
    flight = FlightConfig(name=entry["name"], nav_file=entry["nav_file"])
    navigation._read_icartt(tmp_path / entry["nav_file"], flight, DataConfig(dir=str(tmp_path)))
    assert "sun angles" not in logged(logging.WARNING)
    assert "a demo file, its sun angles set per flight (zenith off by" in logged(logging.INFO)
