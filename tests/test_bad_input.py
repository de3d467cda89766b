"""Bad input, wrong folders and misleading messages, end to end through the command line (issue 15,
parts C to E): each case ends with exit status 2 and a message naming the key, file or value and what
would be valid, never a traceback, and loses nothing. Each test failed before its fix."""

import errno
import json
import os
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml
from conftest import REPO, run_cli, tiny_raw

from cloudml_lib.core.run.checkpoint import META, find_checkpoints, read_meta
from cloudml_lib.core.run.folder import RunFolder


def refused(r, *words):
    """Exit 2, a message with every word, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])
    assert "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


@pytest.fixture(scope="module")
def data(tiny_flights, tmp_path_factory):
    """A private copy of the tiny flights (tests here damage files)."""
    root, entries = tiny_flights
    copy = tmp_path_factory.mktemp("bad") / "flights"
    shutil.copytree(root, copy)
    return copy, entries


def write_config(tmp_path, data_dir, entries, **sections) -> Path:
    raw = tiny_raw(data_dir, entries, tmp_path / "cache")
    raw["checkpoint"] = {"every_steps": 3, "keep_last": 3}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def finished(session_runs):
    """The session's finished tiny run (config file, run folder), read in place (conftest.SessionRuns)."""
    return session_runs.cfg, session_runs.finished()


@pytest.fixture
def run_copy(session_runs, tmp_path):
    """A copy of the session's finished tiny run, to change, and its config file."""
    return session_runs.cfg, session_runs.copy(session_runs.finished(), tmp_path / "run")


# ------------------------------------------------------------------ C. tracebacks that became messages


def test_frames_too_small_for_the_network_are_refused_before_any_work(data, tmp_path):
    cfg = write_config(tmp_path, *data)
    r = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "run", "--set", "data.swath_slice=[20,26]")
    refused(r, "data.swath_slice [20, 26]", "6 rows high", "at least 8", "keep at least 8 rows")
    r = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "run", "--set", "data.downsample=16")
    refused(r, "data.downsample 16", "2 rows high", "set data.downsample to at most 4")
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_frames_too_narrow_for_the_network_are_named_with_their_file(tmp_path):
    from cloudml_lib.data.synthetic import make_demo_flights

    entries = make_demo_flights(tmp_path / "narrow", n_flights=3, frames_per_flight=40, frame_shape=(64, 40))
    cfg = write_config(tmp_path, tmp_path / "narrow", entries, data={"swath_slice": [0, 64], "downsample": 6})
    r = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "run")
    refused(
        r,
        "frames are 40 columns wide, 6 after data.downsample 6",
        "set data.downsample to at most 5",
        entries[0]["ir_file"].split("/")[-1],
    )
    assert not (tmp_path / "run").exists()


def test_a_wrong_ir_time_format_is_named(data, tmp_path):
    cfg = write_config(tmp_path, *data)
    r = run_cli(
        "train", "--config", cfg, "--run-dir", tmp_path / "run", "--set", "data.ir_time_format=seconds_of_day"
    )
    refused(
        r,
        "data.ir_time_format is 'seconds_of_day', but the values",
        "are epoch seconds",
        "Set data.ir_time_format: auto",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_cache_folder_that_is_a_file_is_named(data, tmp_path):
    cfg = write_config(tmp_path, *data)
    (tmp_path / "notes.txt").write_text("keep me")
    for key in ("data.cache_dir", "data.cache_copy_dir"):
        r = run_cli(
            "train",
            "--config",
            cfg,
            "--run-dir",
            tmp_path / "run",
            "--set",
            f"{key}={tmp_path / 'notes.txt'}",
        )
        refused(r, f"{key}: {tmp_path / 'notes.txt'} is a file; it must be a folder")
    r = run_cli(
        "train",
        "--config",
        cfg,
        "--run-dir",
        tmp_path / "run",
        "--set",
        f"data.cache_dir={tmp_path / 'notes.txt' / 'cache'}",
    )
    refused(r, f"lies inside {tmp_path / 'notes.txt'}, which is a file")
    assert (tmp_path / "notes.txt").read_text() == "keep me" and not (tmp_path / "run").exists()


def test_paths_of_the_wrong_kind_are_named(tmp_path):
    r = run_cli("make-demo-data", "--out", "/dev/null")  # a device where a folder belongs
    refused(r, "/dev/null is not a folder, but a folder is needed there")
    r = run_cli("train", "--config", REPO / "configs", "--run-dir", tmp_path / "run")
    refused(r, "configs is a folder; --config takes a YAML file in it", "demo.yaml")
    (tmp_path / "out").write_text("notes")
    r = run_cli("predict", "--run-dir", tmp_path / "no_run", "--out", tmp_path / "out")
    refused(r, "has no best.pt")


def _replace_dataset(path: Path, key: str, value) -> None:
    with h5py.File(path, "a") as f:
        del f[key]
        f[key] = value


@pytest.mark.parametrize(
    "role,key,value,words",
    [
        (
            "ir_file",
            "Time/TimeUTC",
            np.array([b"10:00:%02d" % (i % 60) for i in range(243)]),
            ["'Time/TimeUTC' (data.keys.ir_time) holds text", "not times (epoch seconds)", "'10:00:00'"],
        ),
        (
            "cpl_file",
            "layer_descriptor/Lidar_Surface_Altitude",
            None,
            ["'layer_descriptor/Lidar_Surface_Altitude' (data.keys.cpl_lidar_surface) holds", "not numbers"],
        ),
        (
            "nav_file",
            "nav/sunAzGrd",
            None,
            ["'nav/sunAzGrd' (data.keys.nav_azimuth) holds text", "not angles"],
        ),
    ],
    ids=["IR times as text", "CPL records", "nav text"],
)
@pytest.mark.slow
def test_datasets_of_the_wrong_kind_are_named(data, tmp_path, role, key, value, words):
    root, entries = data
    copy = tmp_path / "flights"
    shutil.copytree(root, copy)
    path = copy / entries[0][role]
    with h5py.File(path) as f:
        n = f[key].shape[0]
    if value is None and role == "cpl_file":
        value = np.zeros(n, dtype=[("a", "f4"), ("b", "i2")])  # compound records
    elif value is None:
        value = np.array([b"south"] * n)
    _replace_dataset(path, key, value)
    cfg = write_config(tmp_path, copy, entries)
    r = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "run")
    refused(r, f"flight {entries[0]['name']}", *words)
    assert not (tmp_path / "run").exists()


def test_numbers_stored_as_text_are_read(data, tmp_path):
    from cloudml_lib.base.config import build_config
    from cloudml_lib.data import er2

    root, entries = data
    copy = tmp_path / "flights"
    shutil.copytree(root, copy)
    path = copy / entries[0]["ir_file"]
    with h5py.File(path) as f:
        times = f["Time/TimeUTC"][()]
    _replace_dataset(path, "Time/TimeUTC", np.array([b"%.3f" % t for t in times]))
    cfg = build_config(tiny_raw(copy, entries, tmp_path / "cache"))
    read, n, _, _ = er2.read_ir_times(path, cfg.data.flights[0], cfg.data)
    assert n == 240 and np.nanmax(np.abs(read - times[:240].astype(float))) < 1e-3


@pytest.mark.slow
def test_predict_on_a_full_disk_names_the_file_and_leaves_no_half_file(
    finished, tmp_path, monkeypatch, capsys
):
    import xarray

    from cloudml_lib.commands import cli

    _, run = finished
    out = tmp_path / "out"
    real = xarray.Dataset.to_netcdf

    def fills_the_disk(self, path, *a, **k):  # what h5py raises on a full disk, after writing part of it
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(
            errno.ENOSPC,
            "Can't synchronously write data (file write failed: errno = 28, error message "
            "= 'No space left on device')",
        )

    monkeypatch.setattr(xarray.Dataset, "to_netcdf", fills_the_disk)
    assert cli.main(["predict", "--run-dir", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no space left on the disk holding" in err and f"{out}/" in err and "_cbh.nc" in err
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    monkeypatch.setattr(xarray.Dataset, "to_netcdf", real)
    assert cli.main(["predict", "--run-dir", str(run), "--out", str(out)]) == 0  # space freed: it works


def test_a_log_file_on_a_full_disk_is_said_once_in_words(tmp_path, capsys):
    import logging

    from cloudml_lib.base.logs import attach_run_log

    logger = attach_run_log(RunFolder(tmp_path))
    handler = next(h for h in logger.handlers if hasattr(h, "baseFilename"))
    handler.stream = open(os.devnull, "w")

    def full(text):
        raise OSError(errno.ENOSPC, "No space left on device")

    handler.stream.write = full
    for i in range(3):
        logging.getLogger("cloudml_lib.test").info("line %d", i)
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count("cannot be written (No space left on device); the log continues on screen only") == 1
    attach_run_log(None)


@pytest.mark.slow
def test_a_damaged_evaluation_is_computed_again_from_the_best_model(run_copy):
    cfg, run = run_copy
    good = json.loads((run / "evaluation.json").read_text())
    (run / "evaluation.json").write_text('{"overall": {"r2": 0.9')  # cut off by a disconnect
    r = run_cli("train", "--config", cfg, "--run-dir", run)
    assert r.returncode == 0, r.stderr[-2000:]
    pending = r"The end of the run \(damaged: \S*evaluation\.json \(.*\)\): the best model on the validation"
    assert re.search(pending, r.stdout), r.stdout[-3000:]
    assert "nothing to train" in r.stdout
    again = json.loads((run / "evaluation.json").read_text())
    assert again["overall"]["n"] == good["overall"]["n"]
    assert abs(again["overall"]["mae_km"] - good["overall"]["mae_km"]) < 1e-6


# ------------------------------------------------------------------ D. accepted silently


def test_predict_gives_no_height_for_blank_frames_and_counts_them(finished, data, tmp_path):
    import netCDF4

    root, entries = data
    _, run = finished
    copy = tmp_path / "flights"
    shutil.copytree(root, copy)
    held = entries[2]
    with h5py.File(copy / held["ir_file"], "a") as f:
        frames = f["Product/Signal"][()].astype("f4")
        frames[10] = np.nan  # all NaN
        frames[11] = np.inf  # all inf
        frames[12, 4:9] = np.nan  # partly NaN (5 of the 32 rows kept): filled, predicted
        frames[13] = 11000.0  # every pixel equal: no contrast
        stated = dict(f["Product/Signal"].attrs)  # its units, scale and offset stay as they were
        del f["Product/Signal"]
        f["Product/Signal"] = frames
        f["Product/Signal"].attrs.update(stated)
    r = run_cli("predict", "--run-dir", run, "--data-dir", copy, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 frames are blank (no finite pixel, or every pixel equal): no height" in r.stdout
    assert "240 non-finite pixels replaced" in r.stdout
    with netCDF4.Dataset(tmp_path / "out" / f"{held['name']}_cbh.nc") as nc:
        index = nc["frame_index"][:]
        cbh = np.ma.filled(nc["cloud_base_height"][:], np.nan)
        prob = np.ma.filled(nc["cloud_probability"][:], np.nan)
        cloudy = np.ma.filled(nc["cloud_flag"][:], 0) == 1
        blank = np.isin(index, [10, 11, 13])
        assert np.isnan(cbh[blank]).all() and np.isnan(prob[blank]).all()
        assert np.isfinite(prob[~blank]).all()  # every other frame answered, frame 12 too
        assert (
            np.isfinite(cbh[~blank & cloudy]).all() and np.isnan(cbh[~cloudy]).all()
        )  # no height over clear sky
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())[held["name"]]
    assert summary["blank"] == 3 and summary["filled_pixels"] == 240
    from cloudml_lib.science.report import build_report_md

    shutil.copytree(run, tmp_path / "run")
    shutil.copytree(tmp_path / "out", tmp_path / "run" / "predictions")
    assert "3 blank frames (no finite pixel, or no contrast) have no height" in build_report_md(
        RunFolder(tmp_path / "run")
    )


def test_predict_refuses_two_nav_files_or_two_copies_of_a_flight(finished, data, tmp_path):
    root, entries = data
    _, run = finished
    name, folder = entries[0]["name"], Path(entries[0]["ir_file"]).parent
    two_nav = tmp_path / "two_nav"
    shutil.copytree(root, two_nav)
    shutil.copy(two_nav / entries[0]["nav_file"], two_nav / Path(entries[0]["nav_file"]).name)
    r = run_cli("predict", "--run-dir", run, "--data-dir", two_nav, "--flights", name)
    refused(r, f"flight {name}: several nav files", "the choice must be unambiguous")
    two_copies = tmp_path / "two_copies"
    shutil.copytree(root, two_copies)
    shutil.copytree(two_copies / folder, two_copies / "backup" / folder)
    r = run_cli("predict", "--run-dir", run, "--data-dir", two_copies, "--flights", name)
    refused(r, f"flight {name}: several IR files")


def test_status_checks_meta_json_against_the_verified_state(run_copy):
    from cloudml_lib.core.run.status import format_status, run_status

    _, run = run_copy
    real = run_status(RunFolder(run))
    newest = find_checkpoints(RunFolder(run))[0]
    meta = read_meta(newest)
    meta.update(epoch=-5, epochs=2, step=5_000_000_000)
    (newest / META).write_text(json.dumps(meta))
    s = run_status(RunFolder(run))
    assert s["rejected"] and "meta.json disagrees with state.pt" in s["rejected"][0]["reason"]
    assert s["step"] < real["step"] and 0 <= s["progress"] <= 100 and s["epoch"] >= 1
    assert "epoch -5" not in format_status(s).splitlines()[0] and "epoch 2/2" in format_status(s)


@pytest.mark.slow
def test_resume_from_another_runs_checkpoint_is_refused(run_copy, finished, tmp_path):
    cfg, run = run_copy
    other = tmp_path / "other"
    r = run_cli("train", "--config", cfg, "--run-dir", other, "--set", "train.epochs=1")
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = find_checkpoints(RunFolder(run))[-1]
    r = run_cli("train", "--config", cfg, "--run-dir", other, "--resume", theirs)
    refused(r, "that checkpoint belongs to another run", f"use --run-dir with its own folder ({run})")
    r = run_cli("train", "--config", cfg, "--run-dir", other, "--resume", run / "best.pt")
    refused(r, "best.pt holds the best model's weights only, not a resumable state")
    r = run_cli(
        "train", "--config", cfg, "--run-dir", tmp_path / "fresh", "--resume", theirs
    )  # an empty folder
    assert r.returncode == 0 and "becomes a copy of that run" in r.stdout, r.stderr[-2000:]


@pytest.mark.slow
def test_commands_on_a_crossval_folder_say_which_command_fits(finished, tmp_path):
    cfg, run = finished
    cv = tmp_path / "cv"
    shutil.copytree(run, cv / "folds" / "12Feb25" / "model")
    r = run_cli("train", "--config", cfg, "--run-dir", cv)
    refused(r, f"{cv} is a cross-validation folder", f"crossval --config FILE --run-dir {cv}")
    assert not (cv / "checkpoints").exists() and not (cv / "config.yaml").exists()
    r = run_cli("evaluate", "--run-dir", cv)
    refused(r, "is a cross-validation folder", f"evaluate --run-dir {cv / 'folds' / '12Feb25' / 'model'}")
    r = run_cli("status", cv)
    assert r.returncode == 0 and "cross-validation, 1 of 1 folds trained" in r.stdout, r.stderr
    r = run_cli("crossval", "--config", cfg, "--run-dir", run)
    refused(r, "is CloudML's run folder, not a cross-validation folder", "or an existing cross-validation")


def test_a_rewritten_ir_file_with_the_same_name_size_and_time_is_not_served_from_the_old_cache(
    data, tmp_path
):
    from cloudml_lib.base.config import build_config
    from cloudml_lib.data.cache import load_flight_cache

    root, entries = data
    copy = tmp_path / "flights"
    shutil.copytree(root, copy)
    cfg = build_config(tiny_raw(copy, entries, tmp_path / "cache"))
    first = load_flight_cache(cfg.data.flights[0], cfg.data)
    path = copy / entries[0]["ir_file"]
    stat = path.stat()
    with h5py.File(path, "a") as f:  # reprocessed in place, same size
        f["Product/Signal"][...] = f["Product/Signal"][()][::-1]
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    second = load_flight_cache(cfg.data.flights[0], cfg.data)
    assert second.source == "built" and second.path != first.path


# ------------------------------------------------------------------ E. messages that misled


def test_a_disk_error_without_a_file_name_names_the_places(tmp_path):
    from cloudml_lib.base.errors import explain_os_error

    text = explain_os_error(
        OSError(errno.ENOSPC, "No space left on device"),
        {"run folder": str(tmp_path / "run"), "output folder": None},
    )
    assert "the disk holding the disk" not in text
    assert f"a disk this command writes to (run folder {tmp_path / 'run'})" in text


def test_best_pt_on_a_full_disk_is_a_named_disk_error_not_a_torch_traceback(tmp_path, monkeypatch):
    from cloudml_lib.base.errors import explain_os_error
    from cloudml_lib.core.run import checkpoint

    def full(obj, f):  # what torch raises when the disk fills mid-write
        f.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 105408 vs 105296")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    (tmp_path / "best.pt").write_bytes(b"the previous best")
    with pytest.raises(OSError) as e:
        checkpoint.save_atomic({"model": {}}, tmp_path / "best.pt")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "best.pt")
    assert (tmp_path / "best.pt").read_bytes() == b"the previous best" and len(list(tmp_path.iterdir())) == 1
    text = explain_os_error(e.value, resumes=False)
    assert (
        text.startswith(f"no space left on the disk holding {tmp_path / 'best.pt'}")
        and "checkpoint" not in text
    )


def test_evaluate_on_a_full_disk_keeps_the_previous_predictions(run_copy, monkeypatch, capsys):
    import csv

    from cloudml_lib.commands import cli

    _, run = run_copy
    before = (run / "predictions.csv").read_text()

    class Full:
        def __init__(self, f):
            self.rows = 0

        def writerow(self, row):
            self.rows += 1
            if self.rows > 3:
                raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(csv, "writer", Full)
    assert cli.main(["evaluate", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"no space left on the disk holding {run / 'predictions.csv'}" in err
    assert (run / "predictions.csv").read_text() == before
    assert not [p for p in run.iterdir() if ".tmp" in p.name]


def test_an_unreadable_checkpoint_is_rejected_as_unreadable_not_read_only(run_copy, monkeypatch):
    from cloudml_lib.core.run import checkpoint
    from cloudml_lib.core.run.status import run_status

    _, run = run_copy
    newest = find_checkpoints(RunFolder(run))[0]
    real = checkpoint.sha256_file

    def denied(path):
        if Path(path).parent == newest:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(checkpoint, "sha256_file", denied)
    s = run_status(RunFolder(run))
    assert s["rejected"][0]["reason"].startswith("cannot read state.pt (Permission denied)")
    assert s["latest_checkpoint"] and newest.name not in s["latest_checkpoint"]


@pytest.mark.slow
def test_bit_rot_in_the_cache_is_named_instead_of_blaming_the_learning_rate(data, tmp_path):
    cfg = write_config(tmp_path, *data)
    r = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "first", "--set", "train.epochs=1")
    assert r.returncode == 0, r.stderr[-2000:]
    name = data[1][0]["name"]
    (folder,) = (tmp_path / "cache").glob(f"{name}-*")
    frames = np.load(folder / "frames.npy", mmap_mode="r+")
    frames[::2] = np.float16("nan")  # bit rot: half the frames unreadable numbers
    frames.flush()
    del frames
    r = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "second")
    refused(r, f"flight {name}: the preprocessing cache {folder} is corrupt", "Delete the named cache folder")
    assert "Lower train.learning_rate" not in r.stderr


def test_advice_in_messages_can_fix_what_they_describe(data, tmp_path):
    cfg = write_config(tmp_path, *data)
    r = run_cli(
        "train", "--config", cfg, "--run-dir", tmp_path / "run", "--set", "train.grad_accum_steps=1024"
    )
    n = int(re.search(r"larger than the training set \((\d+) samples\)", r.stderr).group(1))
    refused(
        r,
        "train.batch_size 5 x train.grad_accum_steps 1024",
        f"larger than the training set ({n} samples)",
        f"Choose train.grad_accum_steps <= {n // 5} (with train.batch_size 5)",
    )
    assert "train.batch_size <= 1" not in r.stderr


def test_a_damaged_best_model_is_named(run_copy):
    _, run = run_copy
    best = torch.load(run / "best.pt", weights_only=True)
    best["model"] = {"encoder.weight": torch.zeros(3)}
    torch.save(best, run / "best.pt")
    r = run_cli("evaluate", "--run-dir", run)
    refused(r, f"{run / 'best.pt'}: its weights do not fit the model its config describes")
    del best["scalers"]
    torch.save(best, run / "best.pt")
    refused(
        run_cli("predict", "--run-dir", run), f"{run / 'best.pt'} is not a complete best model (no scalers)"
    )


def test_a_fresh_unreadable_lock_is_explained(tmp_path):
    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.core.run.runlock import RunLock

    (tmp_path / ".lock").write_text("{not json")
    with pytest.raises(
        CloudMLError, match=r"exists but cannot be read \(not the JSON object a lock holds: .*delete "
    ):
        RunLock(RunFolder(tmp_path)).acquire()
    old = 1_000_000_000
    os.utime(tmp_path / ".lock", (old, old))  # a damaged lock long left behind: taken over
    lock = RunLock(RunFolder(tmp_path))
    lock.acquire()
    lock.release()


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_a_stop_at_any_moment_exits_130(data, tmp_path, sig):
    cfg = write_config(tmp_path, *data)
    for point in ("start:1", "setup:1"):
        r = run_cli(
            "train", "--config", cfg, "--run-dir", tmp_path / "run", env={"CLOUDML_KILL_AT": f"{point}:{sig}"}
        )
        assert r.returncode == 130, (point, r.returncode, r.stderr[-1000:])
        assert "Run the same command again" in r.stderr
