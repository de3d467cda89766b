"""Finding flights in data.dir: one folder per flight (or nested, or flat), revision suffixes, a
missing file, and a config that names only data.dir trained end to end from the command line."""

import json
import shutil

import pytest
import yaml
from conftest import TINY_FRAMES, TINY_SHAPE, run_cli

from cloudml_lib.base.config import build_config
from cloudml_lib.base.errors import ConfigError, DataError
from cloudml_lib.data import flights
from cloudml_lib.data.synthetic import make_demo_flights


@pytest.fixture(scope="module")
def users_folder(tmp_path_factory):
    """Three flights as users keep them: 01Mar25/ as written, 03Mar25 nested two folders deeper,
    05Mar25's files loose in data/; plus an older IR revision (unreadable) and unrelated files."""
    root = tmp_path_factory.mktemp("drive") / "data"
    make_demo_flights(root, n_flights=3, seed=1, frames_per_flight=TINY_FRAMES, frame_shape=TINY_SHAPE)
    nested = root / "GLOVE2025" / "flights"
    nested.mkdir(parents=True)
    shutil.move(root / "03Mar25", nested / "03Mar25")
    for f in (root / "05Mar25").iterdir():
        shutil.move(f, root / f.name)
    (root / "05Mar25").rmdir()
    (root / "01Mar25" / "GLOVE2025_IRAI_L1B_Rev-_20250301-001.h5").write_bytes(b"an older revision")
    (root / "notes.txt").write_text("not a flight file")
    (root / "01Mar25" / "quicklook.h5").write_bytes(b"")
    return root


def data_config(root, **data):
    return build_config({"data": {"dir": str(root), "test_flights": ["05Mar25"], **data}}).data


def test_flights_are_found_grouped_by_date_and_named(users_folder):
    found = flights.find_flights(data_config(users_folder))
    assert [f.name for f in found] == ["01Mar25", "03Mar25", "05Mar25"]
    assert all(not f.problems for f in found)
    assert found[0].files["ir"] == "01Mar25/GLOVE2025_IRAI_L1B_Rev-_20250301-003.h5"  # newest revision
    assert found[1].files == {
        "ir": "GLOVE2025/flights/03Mar25/GLOVE2025_IRAI_L1B_Rev-_20250303.h5",
        "cpl": "GLOVE2025/flights/03Mar25/CPL_L2_V1-02_01kmLay_900002_03mar25.hdf5",
        "nav": "GLOVE2025/flights/03Mar25/CRS_20250303_nav.hdf",
    }
    assert found[2].files["cpl"] == "CPL_L2_V1-02_01kmLay_900003_05mar25.hdf5"


def test_file_names_are_classified_by_role_and_date():
    assert flights.classify("WHYMSIE2024_IRAI_L1B_Rev-_20241030-005.h5")[:2] == (
        "ir",
        flights.dt.date(2024, 10, 30),
    )
    assert flights.classify("CPL_L2_V1-02_01kmLay_259015_10feb25.hdf5")[:2] == (
        "cpl",
        flights.dt.date(2025, 2, 10),
    )
    assert flights.classify("CRS_20250210_nav.hdf")[:2] == ("nav", flights.dt.date(2025, 2, 10))
    assert flights.classify("CPL_L2_V1-02_01kmPro_259015_10feb25.hdf5") is None  # a profile, not a layer file
    assert flights.classify("GLOVE2025_IRAI_L1B_Rev-_20251399.h5") is None  # not a date
    assert flights.flight_name(flights.dt.date(2024, 10, 23)) == "23Oct24"


@pytest.mark.slow
def test_a_config_naming_only_the_data_folder_trains_end_to_end(users_folder, tmp_path):
    raw = {
        "data": {
            "dir": str(users_folder),
            "cache_dir": str(tmp_path / "cache"),
            "test_flights": ["05Mar25"],
            "temporal_frames": 3,
            "swath_slice": [4, 36],
            "num_workers": 0,
        },
        "model": {"channels": [4, 8, 8]},
        "train": {"epochs": 1, "batch_size": 8, "warmup_steps": 2},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    r = run_cli("train", "--config", tmp_path / "c.yaml", "--run-dir", run)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "found 3 flights in" in r.stdout
    table = r.stdout[r.stdout.index("Flights:") :]
    for name in ("01Mar25", "03Mar25", "05Mar25", "GLOVE2025_IRAI_L1B_Rev-_20250303.h5", "labels kept"):
        assert name in table
    saved = yaml.safe_load((run / "config.yaml").read_text())["data"]["flights"]  # resolved, for resume
    assert [f["name"] for f in saved] == ["01Mar25", "03Mar25", "05Mar25"]
    assert saved[1]["nav_file"] == "GLOVE2025/flights/03Mar25/CRS_20250303_nav.hdf"
    report = json.loads((run / "evaluation.json").read_text())
    assert list(report["per_flight"]) == ["05Mar25"] and report["overall"]["n"] > 10
    r = run_cli("evaluate", "--run-dir", run, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["overall"]["n"] == report["overall"]["n"]


@pytest.fixture
def incomplete(users_folder, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(users_folder, root)
    (root / "GLOVE2025" / "flights" / "03Mar25" / "CRS_20250303_nav.hdf").unlink()
    (root / "04Mar25").mkdir()
    (root / "04Mar25" / "CPL_L2_V1-02_01kmLay_900009_04mar25.hdf5").write_bytes(b"")  # only a CPL file
    return root


def test_a_flight_missing_a_file_is_a_clear_error_listing_what_is_missing(incomplete):
    with pytest.raises(DataError) as e:
        flights.resolve_flights(data_config(incomplete))
    msg = str(e.value)
    assert "2 of 4 flights lack files" in msg
    assert "03Mar25" in msg and "no nav file" in msg and "04Mar25" in msg and "no IR file; no nav file" in msg
    assert "data.skip_incomplete_flights: true" in msg


def test_skipping_incomplete_flights_is_explicit_and_listed(incomplete, tmp_path):
    data = data_config(
        incomplete,
        skip_incomplete_flights=True,
        cache_dir=str(tmp_path / "cache"),
        temporal_frames=3,
        swath_slice=[4, 36],
    )
    resolved, skipped = flights.resolve_flights(data)
    assert data.flights == [] and [f.name for f in resolved.flights] == [
        "01Mar25",
        "05Mar25",
    ]  # data not changed
    data = resolved
    assert [f.name for f in skipped] == ["03Mar25", "04Mar25"]
    from cloudml_lib.data.cache import load_caches

    table = flights.format_table(flights.summary_rows(data, load_caches(data), skipped))
    assert "skipped: no nav file" in table and "skipped: no IR file; no nav file" in table


def test_a_test_flight_that_was_not_found_is_named(users_folder):
    with pytest.raises(
        ConfigError,
        match=r"data.test_flights: 12Feb25 not in the flights found in .*"
        r"\(known: 01Mar25, 03Mar25, 05Mar25\)",
    ):
        flights.resolve_flights(data_config(users_folder, test_flights=["12Feb25"]))
    with pytest.raises(ConfigError, match="data.overweight_flight: '30Oct24' not in the flights found"):
        flights.resolve_flights(data_config(users_folder, overweight_flight="30Oct24"))


def test_two_nav_files_for_one_date_are_ambiguous(users_folder, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(users_folder, root)
    shutil.copy(root / "01Mar25" / "CRS_20250301_nav.hdf", root / "CRS_20250301_nav.hdf")
    found = {f.name: f for f in flights.find_flights(data_config(root))}
    assert "several nav files" in found["01Mar25"].problems[0]


def test_an_empty_or_absent_folder_says_what_to_do(tmp_path):
    with pytest.raises(DataError, match=r"no ER-2 flight files found in data.dir .*GLOVE2025_IRAI_L1B"):
        flights.resolve_flights(data_config(tmp_path))
    with pytest.raises(DataError, match=r"data.dir .*nowhere does not exist.*Google Drive is mounted"):
        flights.resolve_flights(data_config(tmp_path / "nowhere"))


def test_angles_from_cpl_make_the_nav_file_optional(incomplete):
    data = data_config(incomplete, angles_source="cpl")
    found = {f.name: f for f in flights.find_flights(data)}
    assert not found["03Mar25"].problems and found["04Mar25"].problems == ["no IR file"]


def test_the_same_files_under_two_flight_names_are_refused(users_folder):
    entry = {
        "ir_file": "01Mar25/GLOVE2025_IRAI_L1B_Rev-_20250301-003.h5",
        "cpl_file": "01Mar25/CPL_L2_V1-02_01kmLay_900001_01mar25.hdf5",
        "nav_file": "01Mar25/CRS_20250301_nav.hdf",
    }
    data = build_config(
        {
            "data": {
                "dir": str(users_folder),
                "test_flights": ["b"],
                "flights": [dict(entry, name="a"), dict(entry, name="b")],
            }
        }
    ).data
    with pytest.raises(ConfigError, match="flights a and b use the same IR file .*trained twice"):
        flights.resolve_flights(data)


def test_a_long_list_of_removed_labels_goes_under_the_table_so_a_row_stays_one_line():
    """The setup table's rows were ~180 px tall: "removed by filter" wrapped to 11 lines beside empty
    columns. A list longer than a cell holds becomes its total and a numbered note."""
    from cloudml_lib.data.flights import NOTE_AFTER, REMOVED_WORDS, Notes, _removed

    notes = Notes()
    many = {k: 10 + i for i, k in enumerate(REMOVED_WORDS)}
    cell = _removed(many, notes, "01Mar25")
    assert cell == f"{sum(many.values())}: see note 1" and len(cell) <= NOTE_AFTER
    assert notes[0].startswith("01Mar25: labels removed by filter: ") and all(
        word in notes[0] for word in REMOVED_WORDS.values()
    )
    one = next(iter(REMOVED_WORDS))
    assert (
        _removed({one: 3}, notes, "x") == f"{REMOVED_WORDS[one]} 3" and len(notes) == 1
    )  # short: in the cell


def test_a_linked_flight_folder_is_named_never_skipped_without_a_word(tmp_path, caplog, logs_reach_caplog):
    """A flight folder that is a symbolic link was skipped silently (os.walk does not follow links). Outside
    the data folder it is named with what to do; inside, it is searched where it leads, not twice."""
    import logging

    root, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    make_demo_flights(elsewhere, n_flights=2, seed=1, frames_per_flight=TINY_FRAMES, frame_shape=TINY_SHAPE)
    root.mkdir()
    shutil.copytree(elsewhere / "01Mar25", root / "01Mar25")
    (root / "03Mar25").symlink_to(elsewhere / "03Mar25", target_is_directory=True)  # outside
    (root / "again").symlink_to(root / "01Mar25", target_is_directory=True)  # inside
    with caplog.at_level(logging.INFO, logger="cloudml_lib.data.flights"):
        found = flights.find_flights(data_config(root))
    assert [f.name for f in found] == ["01Mar25"] and not found[0].problems
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"{root / '03Mar25'} is a link to {elsewhere / '03Mar25'}" in warned[0]
    assert "outside the data folder" in warned[0] and "set data.dir" in warned[0]
    assert f"{root / 'again'} is a link to {root / '01Mar25'}, inside the data folder" in caplog.text
