"""Whole-flight prediction: the NetCDF file's variables, units and lengths, a flight without its CPL
file, and streaming in blocks (bounded reads, the same numbers as one pass over the flight)."""

import json
import shutil

import netCDF4
import numpy as np
import pytest
import torch

from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.data import preprocess
from cloudml_lib.science import predict as pr
from cloudml_lib.science import products


@pytest.mark.slow
def test_the_netcdf_file_follows_cf_with_one_value_per_usable_frame(tiny_run_copy):
    run_dir, _, entries = tiny_run_copy
    held = entries[2]["name"]
    (path,) = pr.predict_flights(run_dir)  # default: the test flight
    assert path == run_dir / "predictions" / f"{held}_cbh.nc"
    with netCDF4.Dataset(path) as nc:
        assert nc.Conventions == "CF-1.8, ACDD-1.3" and set(nc.variables) == {
            "trajectory",  # CF's discrete sampling geometry: the flight, its cf_role trajectory_id
            "input_distance",  # the domain check (data/domain.py)
            "time",
            "lat",
            "lon",
            "cloud_probability",
            "cloud_flag",
            "cloud_base_height",
            "cloud_base_height_lower",
            "cloud_base_height_upper",
            "cloud_base_height_qc",
            "cpl_cloud_base_height",
            "cpl_cloud_flag",
            "frame_index",
        }
        n = len(nc.dimensions["time"])
        assert n == 240 - 1  # every frame but one stray time value
        assert nc["time"].units == "seconds since 1970-01-01 00:00:00" and nc["lat"].units == "degrees_north"
        assert nc["cloud_base_height"].units == "km" and nc["cloud_base_height"]._FillValue == products.FILL
        prob, flag = nc["cloud_probability"][:], nc["cloud_flag"][:]
        assert ((prob >= 0) & (prob <= 1)).all() and list(nc["cloud_flag"].flag_values) == [0, 1, 2, 3]
        assert nc["cloud_flag"].flag_meanings.split() == list(products.CLASS_MEANINGS)
        np.testing.assert_array_equal(flag == 1, prob >= nc.cloud_threshold)  # a cloud base in the range
        cbh = nc["cloud_base_height"][:]
        assert (np.ma.getmaskarray(cbh) == (flag != 1)).all()  # a height only under a base in the range
        assert nc["cloud_base_height"].standard_name == "cloud_base_altitude"
        assert nc.flight_role == "a test flight of this run: nothing was trained or chosen on it"
        assert nc.model_test_skill.startswith(f"{held}: R2 ") and "training mean MAE" in nc.model_test_skill
        assert "best baseline (" in nc.model_test_skill and "MAE skill against it" in nc.model_test_skill
        assert nc.model_verdict.startswith("Verdict") and "nothing was chosen" in nc.model_evaluation_protocol
        assert nc.interval_calibrated_on_this_flight == "no"
        here = nc.interval_coverage_on_this_flight  # the tiny run's CPL heights of its test flight
        assert "CPL heights inside the 90% intervals: " in here and ("short of" in here or "within" in here)
        assert nc.cloud_flag_source.startswith("the model") and "height product's range" in (
            nc.cloud_flag_definition
        )
        lower, upper = nc["cloud_base_height_lower"][:], nc["cloud_base_height_upper"][:]
        cloudy = flag == 1
        assert (lower[cloudy] <= cbh[cloudy]).all() and (cbh[cloudy] <= upper[cloudy]).all()
        assert (upper[cloudy] - lower[cloudy]).min() > 0.01
        assert nc.interval_method.startswith("conformal_absolute") and nc.interval_coverage == pytest.approx(
            0.9
        )
        assert "heights from the validation data of the training flights" in nc.interval_calibration
        spread = nc.interval_calibration_flights  # the tiny run validates on one flight: what that misses
        assert spread.startswith("calibrated on one flight's heights (")
        assert "--calibration CROSSVAL_DIR" in spread
        t = nc["time"][:]
        assert np.all(np.diff(t) > 0) and 1.7e9 < t[0] < 1.8e9
        labels = np.ma.filled(nc["cpl_cloud_base_height"][:], np.nan)
        assert 10 < np.isfinite(labels).sum() < n  # the lidar label where one exists
    for name in (f"{held}_cbh.csv", f"{held}_cbh_along_flight.png", f"{held}_track.png"):
        assert (run_dir / "predictions" / name).is_file()
    assert len((run_dir / "predictions" / f"{held}_cbh.csv").read_text().splitlines()) == n + 1
    # best.pt replaced after the evaluation (put back from a backup): no skill of other weights in the files
    best = torch.load(run_dir / "best.pt", weights_only=False)
    best["model"] = {k: v + 1e-3 if v.is_floating_point() else v for k, v in best["model"].items()}
    torch.save(best, run_dir / "best.pt")
    (path,) = pr.predict_flights(run_dir, out_dir=run_dir / "after")
    with netCDF4.Dataset(path) as nc:
        assert nc.model_test_skill.startswith("not evaluated on these weights: evaluation.json scored other")
        assert "model_verdict" not in nc.ncattrs()
        # nor intervals calibrated on the other weights' errors: intervals.json records whose they are
        assert nc.interval_method == "none" and nc.interval_calibration_flights == "no intervals"
        assert np.isnan(np.ma.filled(nc["cloud_base_height_lower"][:], np.nan)).all()
    from cloudml_lib.science.evaluate import evaluate_run

    assert "intervals" not in evaluate_run(run_dir, write=False)  # evaluate scores them without, as predict


def test_a_flight_with_only_ir_and_nav_files_is_predicted(tiny_run, tmp_path):
    run_dir, data, entries = tiny_run
    only = tmp_path / "data"
    shutil.copytree(data, only)
    (only / entries[0]["cpl_file"]).unlink()
    (path,) = pr.predict_flights(run_dir, [entries[0]["name"]], out_dir=tmp_path / "out", data_dir=str(only))
    with netCDF4.Dataset(path) as nc:
        assert len(nc.dimensions["time"]) > 200
        assert np.isnan(np.ma.filled(nc["cpl_cloud_base_height"][:], np.nan)).all()
    with pytest.raises(Exception, match="--flights: 12Feb25 not found"):
        pr.predict_flights(run_dir, ["12Feb25"], out_dir=tmp_path / "out")


def test_streaming_in_blocks_reads_each_frame_once_and_changes_nothing(tiny_run, tmp_path, monkeypatch):
    run_dir, _, entries = tiny_run
    (whole,) = pr.predict_flights(run_dir, out_dir=tmp_path / "whole")
    prepared = []
    real_prepare = preprocess.prepare
    monkeypatch.setattr(pr, "BLOCK", 16)
    monkeypatch.setattr(pr, "resolve_workers", lambda setting: 0)  # in this process, where the count is
    monkeypatch.setattr(preprocess, "prepare", lambda x, s: (prepared.append(1), real_prepare(x, s))[1])
    (blocks,) = pr.predict_flights(run_dir, out_dir=tmp_path / "blocks")
    with netCDF4.Dataset(whole) as a, netCDF4.Dataset(blocks) as b:
        np.testing.assert_array_equal(a["cloud_base_height"][:], b["cloud_base_height"][:])
    assert len(prepared) == 240  # the test flight's frames, each exactly once


def test_worker_processes_give_the_same_bytes_and_prepare_ahead_of_the_model(tiny_run, tmp_path, monkeypatch):
    """Serial (0 workers) and 2 worker processes: identical files; while the model encodes a block's frames,
    the workers have already been given the frames beyond it."""
    run_dir, _, entries = tiny_run
    monkeypatch.setattr(pr, "BLOCK", 64)
    monkeypatch.setattr(pr, "resolve_workers", lambda setting: 0)
    (serial,) = pr.predict_flights(run_dir, out_dir=tmp_path / "serial")
    pools, ahead = [], []
    real_pool = pr.FramePool

    def pool(workers):
        pools.append(real_pool(2))
        return pools[-1]

    real_predict = pr.predict_flight

    def watched(predictor, *args, **kwargs):
        real_encode = predictor.model.encode_frames

        def encode(frames):
            ahead.append((len(frames), pools[-1].submitted))
            return real_encode(frames)

        monkeypatch.setattr(predictor.model, "encode_frames", encode)
        return real_predict(predictor, *args, **kwargs)

    monkeypatch.setattr(pr, "FramePool", pool)
    monkeypatch.setattr(pr, "predict_flight", watched)
    (parallel,) = pr.predict_flights(run_dir, out_dir=tmp_path / "parallel")
    with netCDF4.Dataset(serial) as a, netCDF4.Dataset(parallel) as b:
        for name in ("cloud_base_height", "cloud_probability", "cloud_base_height_upper"):
            np.testing.assert_array_equal(a[name][:], b[name][:])
    assert pools[-1].workers == 2 and not pools[-1]._procs  # used, then stopped
    # the first frames are encoded while the next block (BLOCK frames) and more are already queued
    encoded, queued = ahead[0]
    assert queued >= encoded + 64, ahead
    assert sum(n for n, _ in ahead) == 240  # each frame encoded once


@pytest.mark.slow
def test_a_model_trained_on_kornia_frames_is_predicted_with_kornia(tiny_run, tmp_path):
    """The backend recorded in best.pt is the one predict uses (auto), on the CPU here; its heights are close
    to those from scikit-image frames, not equal, and the NetCDF file says which made them."""
    pytest.importorskip("kornia")
    run_dir, _, _ = tiny_run
    (skimage,) = pr.predict_flights(run_dir, out_dir=tmp_path / "skimage")
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    best = torch.load(copy / "best.pt", weights_only=True)
    best["provenance"]["inputs"]["preprocess_backend"] = "kornia"
    torch.save(best, copy / "best.pt")
    (kornia,) = pr.predict_flights(copy, out_dir=tmp_path / "kornia")
    with netCDF4.Dataset(skimage) as a, netCDF4.Dataset(kornia) as b:
        assert (
            json.loads(b.preprocessing)["backend"] == "kornia"
            and json.loads(a.preprocessing)["backend"] == "skimage"
        )
        diff = np.abs(a["cloud_base_height"][:] - b["cloud_base_height"][:])
        assert 0 < float(diff.mean()) < 0.3


def test_the_report_links_what_the_run_holds(tiny_run_copy):
    run_dir, _, entries = tiny_run_copy
    pr.predict_flights(run_dir)
    report = (run_dir / "report.md").read_text()
    held = entries[2]["name"]
    assert "## Test flights" in report and f"| baseline (training mean): flight {held} |" in report
    assert "The validation score of every epoch" in report and "| 1 (best) |" in report
    assert f"### {entries[2]['name']}" in report
    links = [line[line.index("(") + 1 : -1] for line in report.splitlines() if line.startswith("![")]
    assert len(links) == 4 and all((run_dir / link).is_file() for link in links)


@pytest.mark.slow
def test_host_memory_stays_flat_as_flights_get_longer(tiny_run, tmp_path, monkeypatch):
    import tracemalloc

    from conftest import TINY_SHAPE

    from cloudml_lib.data.synthetic import make_demo_flights

    run_dir, data, entries = tiny_run
    monkeypatch.setattr(pr, "BLOCK", 16)
    peaks = {}
    for frames in (240, 960):
        folder = tmp_path / f"f{frames}"
        make_demo_flights(folder, n_flights=2, seed=1, frames_per_flight=frames, frame_shape=TINY_SHAPE)
        tracemalloc.start()  # NumPy reports its allocations to tracemalloc
        pr.predict_flights(
            run_dir, [entries[0]["name"]], out_dir=tmp_path / f"o{frames}", data_dir=str(folder)
        )
        peaks[frames] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    whole_flight = 960 * 32 * 48 * 4  # the long flight's preprocessed frames, as float32
    assert peaks[960] < 1.5 * peaks[240], peaks  # 4x the frames, about the same peak
    assert peaks[960] < whole_flight, peaks


def test_a_flight_without_its_nav_file_keeps_its_lidar_labels(tiny_run, tmp_path):
    run_dir, data, entries = tiny_run
    no_nav = tmp_path / "data"
    shutil.copytree(data, no_nav)
    (no_nav / entries[0]["nav_file"]).unlink()
    (path,) = pr.predict_flights(
        run_dir, [entries[0]["name"]], out_dir=tmp_path / "out", data_dir=str(no_nav)
    )
    with netCDF4.Dataset(path) as nc:
        assert np.isfinite(np.ma.filled(nc["cpl_cloud_base_height"][:], np.nan)).sum() > 10
        assert np.isnan(np.ma.filled(nc["lat"][:], np.nan)).all()  # no position without nav
        cbh = nc["cloud_base_height"][:]  # angles: the training mean
        assert cbh.count() > 0 and np.isfinite(cbh.compressed()).all()


def test_provenance_is_in_every_checkpoint_the_report_and_the_netcdf(tiny_run_copy):
    import hashlib
    import json

    from cloudml_lib.base.config import config_from_dict
    from cloudml_lib.core.run.checkpoint import check_folder, find_checkpoints, load_checkpoint
    from cloudml_lib.data import cpl

    run_dir, data, entries = tiny_run_copy
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    best = load_checkpoint(run_dir / "best.pt")
    cfg = config_from_dict(best["config"])
    committed = [check_folder(p)[1] for p in find_checkpoints(RunFolder(run_dir))]
    assert committed and all(c is not None for c in committed)
    for ckpt in [best] + committed:
        record = ckpt["provenance"]
        assert record["label_definition"] == cpl.label_definition(cfg.data)
        assert set(record["flights"]) == {e["name"] for e in entries}
        for e in entries:
            f = record["flights"][e["name"]]
            assert f["counts"]["profiles"] > f["samples"] > 0 and f["match"]["matched"] > 0
            assert {r: v["sha256"] for r, v in f["files"].items()} == {
                r: sha(data / e[f"{r}_file"]) for r in ("ir", "cpl", "nav")
            }
    report = (run_dir / "report.md").read_text()
    assert "## Data provenance" in report and sha(data / entries[0]["ir_file"]) in report
    assert "time_column centre" in report
    held = entries[2]
    (path,) = pr.predict_flights(run_dir)
    with netCDF4.Dataset(path) as nc:
        files = json.loads(nc.input_files)
        assert files["ir"]["sha256"] == sha(data / held["ir_file"]) and files["cpl"]["name"].endswith(".hdf5")
        assert json.loads(nc.label_definition)["time_column"] == "centre"
        assert set(json.loads(nc.training_data_provenance)["flights"]) == {e["name"] for e in entries}


def test_a_run_from_before_the_cloud_output_still_predicts_and_says_what_is_missing(
    tiny_run, tmp_path, caplog, monkeypatch
):
    import logging

    import torch

    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)  # the run's handler stops it

    from cloudml_lib.science.evaluate import evaluate_run

    run_dir, _, _ = tiny_run
    old = tmp_path / "old_run"
    shutil.copytree(run_dir, old, ignore=shutil.ignore_patterns("predictions", "checkpoints"))
    best = torch.load(old / "best.pt", weights_only=False)
    assert int(best["model"]["cloud_fitted"]) == 1  # this version's run: a fitted probe
    for key in (
        "cloud.weight",
        "cloud.bias",
        "cloud_fitted",
    ):  # the height output only, as earlier models had
        del best["model"][key]
    del best["config"]["model"]["cloud_head"]
    torch.save(best, old / "best.pt")
    (old / "intervals.json").unlink()
    (path,) = pr.predict_flights(old, out_dir=tmp_path / "out")
    said = caplog.text
    assert (
        "has no cloud / no-cloud output (trained without one)" in said and "no usable intervals.json" in said
    )
    with netCDF4.Dataset(path) as nc:
        assert "cloud_flag" not in nc.variables and "cloud_probability" not in nc.variables
        assert nc["cloud_base_height"][:].count() == len(nc.dimensions["time"])  # a height everywhere
        assert nc["cloud_base_height_lower"][:].count() == 0 and nc.interval_method == "none"
    report = evaluate_run(old, write=False)
    assert "model" not in report["cloud"] and report["cloud"]["bt_threshold"]["overall"]["n"] > 0


def test_one_table_of_variables_drives_the_netcdf_the_csv_and_the_summary(tiny_run, tmp_path, monkeypatch):
    """A new output variable is one entry in products.VARIABLES: it then appears in the NetCDF file with its
    CF attributes, as a CSV column and in summary.json, with nothing else changed."""
    import xarray as xr

    run_dir, _, entries = tiny_run
    extra = products.Variable(
        "cloud_base_height_doubled",
        "doubled",
        "f4",
        {"long_name": "twice the height", "units": "km"},
        "doubled_km",
        3,
    )
    monkeypatch.setattr(products, "VARIABLES", products.VARIABLES + (extra,))
    real = pr.cloud_and_intervals

    def and_doubled(result, *a):
        real(result, *a)
        result["doubled"] = 2 * result["cbh_km"]

    monkeypatch.setattr(pr, "cloud_and_intervals", and_doubled)
    (path,) = pr.predict_flights(run_dir, out_dir=tmp_path)
    with xr.open_dataset(path) as ds:
        np.testing.assert_allclose(
            ds["cloud_base_height_doubled"].values, 2 * ds["cloud_base_height"].values, rtol=1e-6
        )
        assert ds["cloud_base_height_doubled"].attrs["long_name"] == "twice the height"
        assert (
            set(ds.coords) == {"time", "frame_index", "lat", "lon", "trajectory"}
            and ds["cloud_base_height"].attrs["units"] == "km"
        )
    rows = (tmp_path / path.name.replace(".nc", ".csv")).read_text().splitlines()
    assert rows[0].split(",") == [v.csv for v in products.VARIABLES] and rows[0].endswith("doubled_km")
    summary = json.loads((tmp_path / "summary.json").read_text())[entries[2]["name"]]["variables"]
    assert summary["cloud_base_height_doubled"]["max"] == pytest.approx(
        2 * summary["cloud_base_height"]["max"]
    )


@pytest.mark.slow
def test_predicts_summary_is_read_back_by_every_reader(tiny_run_copy):
    """Issue 65, item 1: what predict writes into the run (predictions/summary.json) is read back by its
    reader, by compare and by status (conftest.assert_reads_back), and the report says its counts."""
    from conftest import assert_reads_back

    from cloudml_lib.base.runfiles import RunFiles
    from cloudml_lib.science.report import write_report

    run_dir, _, entries = tiny_run_copy
    flight = entries[2]["name"]
    pr.predict_flights(run_dir, [flight])  # into the run's predictions/, as the Whole flights cell does
    assert "predictions/summary.json" in assert_reads_back(run_dir)
    counts = RunFiles(run_dir / "predictions").predictions_summary()[flight]
    assert counts["frames"] > 0 and counts["variables"]["cloud_base_height"]["max"] > 0, counts
    write_report(RunFolder(run_dir))
    assert f"### {flight}" in (run_dir / "report.md").read_text()


def test_the_brightness_temperature_flag_can_be_written_and_the_file_says_so(tiny_run, tmp_path):
    """When the verdict says the brightness-temperature baseline beats the model's cloud output, predict
    writes that baseline's flag (fitted on the training flights, kept in best.pt), and says which it holds."""
    run_dir, _, entries = tiny_run
    flight = entries[0]["name"]  # a training flight of the run
    (path,) = pr.predict_flights(run_dir, [flight], out_dir=tmp_path / "bt", cloud_flag="bt_threshold")
    baseline = torch.load(run_dir / "best.pt", weights_only=True)["cloud_baseline"]
    assert baseline["kind"] == "window" and baseline["high"] is not None  # a low end may be open (None)
    assert baseline["low"] is None or baseline["low"] < baseline["high"]
    with netCDF4.Dataset(path) as nc:
        assert nc.cloud_flag_source.startswith("the brightness-temperature baseline (window")
        # its bounds in the units the IR files state (the demo's: kelvin, packed), not "the file's units"
        assert baseline["units"] == "K" and f"{baseline['high']:g} stored (" in nc.cloud_flag_source
        unpacked = baseline["high"] * baseline["scale"] + baseline["offset"]
        assert f"{unpacked:.4g} K, by the file's scale_factor" in nc.cloud_flag_source
        assert nc["cloud_flag"].flag_meanings.split() == list(products.BT_MEANINGS)
        flag, cbh = nc["cloud_flag"][:], nc["cloud_base_height"][:]
        assert set(np.unique(flag.compressed())) <= {0, 1, 2} and (flag == 1).sum() > 10
        assert (np.ma.getmaskarray(cbh) == (flag != 1)).all()
        assert nc.flight_role == "a training flight of this run: the model was fitted on it"
    with pytest.raises(Exception, match="--cloud-flag"):
        pr.predict_flights(run_dir, [flight], out_dir=tmp_path / "x", cloud_flag="nonsense")


def test_a_model_that_read_the_temperature_refuses_a_flight_in_other_units(tiny_run, tmp_path):
    """It was trained on brightness statistics in kelvin: a flight whose IR file states counts would be read
    on the wrong scale, so it is refused, naming both; nothing is written."""
    import h5py

    from cloudml_lib.base.errors import DataError

    run_dir, data, entries = tiny_run
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert best["scalers"]["radiometry_units"] == "K"  # recorded with the scale
    other = tmp_path / "flights"
    shutil.copytree(data, other)
    with h5py.File(other / entries[2]["ir_file"], "r+") as f:
        f["Product/Signal"].attrs["units"] = "counts"
        del f["Product/Signal"].attrs["scale_factor"], f["Product/Signal"].attrs["add_offset"]
    with pytest.raises(
        DataError, match="states its numbers in counts, but this model was trained on brightness"
    ):
        pr.predict_flights(run_dir, [entries[2]["name"]], out_dir=tmp_path / "out", data_dir=str(other))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.nc"))
