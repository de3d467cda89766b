"""Runs made by the previous release (commit d1cecbe, tests/fixtures/run_d1cecbe) keep working: a finished run
predicts and evaluates with today's code and gives that release's numbers; a stopped run resumes and ends
with the bytes its uninterrupted twin ended with. Nothing in a user's runs folder has to be retrained."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run_d1cecbe"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def old(tmp_path, monkeypatch):
    """The fixture's runs in a fresh folder, the flights they were trained on regenerated beside them (the
    runs store data.dir: flights, relative, as that release did), and the working directory there."""
    from cloudml_lib.data.synthetic import make_demo_flights

    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    f = EXPECTED["flights"]
    make_demo_flights(
        "flights",
        n_flights=f["n_flights"],
        seed=f["seed"],
        frames_per_flight=f["frames_per_flight"],
        frame_shape=tuple(f["frame_shape"]),
    )
    now = {
        str(p.relative_to("flights")): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path("flights").rglob("*"))
        if p.is_file()
    }
    assert now == EXPECTED["flight_files"], (
        "the demo generator (data/synthetic.py) no longer writes the flights "
        "the fixture was trained on: regenerate the fixture (its README)"
    )
    return tmp_path


def test_a_finished_run_of_the_previous_release_predicts_its_numbers(old):
    import xarray as xr

    from cloudml_lib.predict import predict_flights

    for name, want in EXPECTED["predictions"].items():
        (path,) = predict_flights("finished", [name], out_dir="predictions")
        with xr.open_dataset(path, decode_times=False) as ds:
            np.testing.assert_array_equal(ds["frame_index"].values, np.array(want["frame_index"], int))
            for key, tolerance in (
                ("cloud_base_height", 1e-4),
                ("cloud_base_height_lower", 1e-4),
                ("cloud_base_height_upper", 1e-4),
                ("cloud_probability", 1e-5),
            ):
                a, b = np.array(want[key], float), ds[key].values.astype(float)
                np.testing.assert_array_equal(
                    np.isnan(a), np.isnan(b), err_msg=f"{name} {key}: missing values"
                )
                assert np.nanmax(np.abs(a - b)) < tolerance, f"{name} {key}"


def test_a_finished_run_of_the_previous_release_evaluates_to_its_numbers(old):
    from cloudml_lib.evaluate import evaluate_run

    before = json.loads(Path("finished/evaluation.json").read_text())
    now = evaluate_run("finished")
    assert now["overall"]["n"] == before["overall"]["n"]
    for key in ("mae_km", "rmse_km", "bias_km"):
        assert abs(now["overall"][key] - before["overall"][key]) < 1e-5, key


def test_a_stopped_run_of_the_previous_release_resumes_to_the_same_bytes(old):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cloudml_lib",
            "train",
            "--config",
            "stopped/config.yaml",
            "--run-dir",
            "stopped",
        ],
        cwd=old,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Resumed from step 8" in r.stdout
    final = sorted(Path("stopped/checkpoints").glob("step-*"))[-1]
    assert int(final.name.split("-")[1]) == EXPECTED["final_step"]
    weights = torch.load(final / "state.pt", weights_only=True)["model"]
    digests = {
        k: hashlib.sha256(v.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
        for k, v in weights.items()
    }
    trained = {k for k in digests if not k.startswith("cloud.")}
    assert {k: digests[k] for k in trained} == {
        k: EXPECTED["final_weights"][k] for k in trained
    }  # bit for bit
    # the cloud probe is fitted after training, on features now computed frame by frame (float reordering):
    # close
    probe = torch.load(Path("finished/best.pt"), weights_only=True)["model"]
    for key in ("cloud.weight", "cloud.bias"):
        torch.testing.assert_close(weights[key], probe[key], rtol=1e-3, atol=1e-4)
