"""`export`: a run's best model as files a colleague loads without CloudML (science/export.py). A process
in which cloudml_lib cannot be imported loads the program and the safetensors weights with plain torch, makes
the scalar inputs from the raw angles and brightness statistics by preprocessing.json's formulas and scalers,
and gives CloudML's heights and cloud probabilities on the test flight to float rounding. (The frames are
CloudML's cached ones: preprocessing.json states their steps; this test does not repeat them.)"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import run_cli

COLLEAGUE = r"""
import sys
sys.modules["cloudml_lib"] = None  # CloudML cannot be imported here
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

folder, data = Path(sys.argv[1]), np.load(sys.argv[2])
spec = json.loads((folder / "preprocessing.json").read_text())
scalars_spec = spec["inputs"]["scalars"]
s, order = scalars_spec["scalers"], scalars_spec["order"]
program = torch.export.load(str(folder / "model.pt2")).module()
with torch.no_grad():  # the weights come from the safetensors file, not from the program
    for p in program.parameters():
        p.zero_()
program.load_state_dict(load_file(str(folder / "weights.safetensors")))
sza, az = data["sza_deg"], np.radians(data["azimuth_deg"])
columns = [
    np.where(np.isfinite(sza), (sza - s["sza_mean"]) / s["sza_std"], 0.0),
    np.where(np.isfinite(az), np.sin(az), 0.0),
    np.where(np.isfinite(az), np.cos(az), 0.0),
]
if "radiometry_scale" in s:
    stats = data["stats"]
    x = (stats - s["radiometry_offset"]) / s["radiometry_scale"]
    spread = order.index("std_scaled") - 3
    x[:, spread] = stats[:, spread] / s["radiometry_scale"]
    columns += list(np.where(np.isfinite(x), x, 0.0).T)
scalars = torch.from_numpy(np.stack(columns, 1).astype(np.float32))
assert scalars.shape[1] == len(order), (scalars.shape, order)
with torch.no_grad():
    out = program(torch.from_numpy(data["frames"]), scalars)
np.savez(sys.argv[3], **{name: o.numpy() for name, o in zip(spec["outputs"], out)})
"""


def cloudml_answers(run):
    """The test flight's inputs as CloudML reads them, and CloudML's answers for them."""
    from cloudml_lib.core.network.metrics import Scored
    from cloudml_lib.core.run.checkpoint import Key
    from cloudml_lib.data.dataset import Scalers
    from cloudml_lib.science.evaluate import load_end_data, load_run_model

    rm = load_run_model(run, channels_last=False)
    scalers = Scalers.from_dict(rm.ckpt[Key.SCALERS])
    test = load_end_data(rm.cfg, scalers, rm.ckpt.get(Key.PROVENANCE)).test_set
    index = np.arange(len(test))
    frames = np.stack([test[i]["frames"].numpy() for i in index])
    k, j = test.flight_of[index], test.local[index]
    raw = {
        "frames": frames,
        "sza_deg": np.array([test.caches[a].sza_deg[b] for a, b in zip(k, j)], np.float64),
        "azimuth_deg": np.array([test.azimuth[a][b] for a, b in zip(k, j)], np.float64),
        "stats": np.stack([test.caches[a].frame_stats[b] for a, b in zip(k, j)]).astype(np.float64),
    }
    with torch.no_grad():
        out = rm.model(torch.from_numpy(frames), torch.from_numpy(test.inputs(index)[0]))
    scored = Scored.from_outputs(
        {"height": out.height.double().numpy(), "cloud_logit": out.cloud_logit.double().numpy()}, scalers
    )
    return raw, scored


@pytest.mark.slow
def test_an_export_loads_without_cloudml_and_gives_cloudmls_answers(tiny_run_copy, tmp_path):
    run, _, _ = tiny_run_copy
    r = run_cli("export", "--run-dir", run, "--out", tmp_path / "export")
    assert r.returncode == 0, r.stderr[-3000:]
    folder = tmp_path / "export"
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted(
        ["MODEL_CARD.md", "model.pt2", "preprocessing.json", "weights.safetensors"]
    )
    raw, scored = cloudml_answers(run)
    np.savez(tmp_path / "inputs.npz", **raw)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            COLLEAGUE,
            str(folder),
            str(tmp_path / "inputs.npz"),
            str(tmp_path / "out.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    assert len(raw["frames"]) > 10 and np.isfinite(scored.height_km).all()
    np.testing.assert_allclose(got["cloud_base_height_km"], scored.height_km, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got["cloud_probability"], scored.cloud_prob, atol=1e-5, rtol=0)
    spec = json.loads((folder / "preprocessing.json").read_text())
    assert spec["written_by"].startswith("CloudML") and len(spec["inputs"]["frames"]["steps"]) == 7
    # every file readable by the colleague it is for: each as any new file of the user's (the umask)
    (tmp_path / "new").write_text("")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir() if not p.name.startswith(".")}
    assert set(modes.values()) == {oct((tmp_path / "new").stat().st_mode & 0o777)}, modes
    # no path of the writer's machine travels with it (the markers record a digest of their folder)
    for path in folder.iterdir():
        text = path.read_bytes()
        assert str(tmp_path).encode() not in text and str(run).encode() not in text, path.name
    # how the nav is read and matched to the frames, named as the run read them
    nav = spec["inputs"]["navigation"]
    assert nav["variables"]["hdf"]["solar_zenith_deg"] == "nav/solarZenith" and "within 2 s" in nav["match"]
    card = (folder / "MODEL_CARD.md").read_text()
    evaluation = json.loads((run / "evaluation.json").read_text())
    test_flight = evaluation["protocol"]["test_flights"][0]
    mae = evaluation["per_flight"][test_flight]["mae_km"]
    assert f"| {test_flight} |" in card and f"{mae:.3f}" in card  # the test flight's skill, as evaluated
    digest = hashlib.sha256((folder / "weights.safetensors").read_bytes()).hexdigest()
    assert f"- Weights: `weights.safetensors`, sha256 {digest}." in card and "Training:" not in card


@pytest.mark.slow
def test_the_card_carries_test_skill_only_for_the_weights_it_was_measured_on(tiny_run_copy, tmp_path, capsys):
    """best.pt replaced after the evaluation: the card says so instead of the other weights' skill; a run
    whose end is pending says its weights are the best so far."""
    from cloudml_lib.core.run.checkpoint import Key, load_checkpoint, save_atomic

    run, _, _ = tiny_run_copy
    ckpt = load_checkpoint(run / "best.pt")
    name = next(k for k, v in ckpt[Key.MODEL].items() if v.is_floating_point())
    ckpt[Key.MODEL][name] = ckpt[Key.MODEL][name] + 0.01
    save_atomic(ckpt, run / "best.pt")
    # status, compare and the Python API tell the same: the test skill recorded is not these weights'
    from cloudml_lib import CloudMLError, read_report
    from cloudml_lib.commands.compare import run_row
    from cloudml_lib.core.run.folder import RunFolder
    from cloudml_lib.core.run.status import format_status, run_status

    said = format_status(run_status(RunFolder(run)))
    assert "trained, end pending (evaluation.json scored other weights than best.pt holds now" in said, said
    row = run_row(RunFolder(run), "run")
    assert row["per_flight"] is None and row["skill"] is None and "(epoch" in row["state"], row
    with pytest.raises(CloudMLError, match="no valid evaluation.json .the run is trained, end pending"):
        read_report(run)
    from cloudml_lib.colab.show import show_evaluation

    capsys.readouterr()
    show_evaluation(run)  # the notebook's results cell
    shown = capsys.readouterr().out
    assert (
        "its evaluation.json is not of its weights now, so it is not shown" in shown and "| MAE" not in shown
    )
    assert run_cli("export", "--run-dir", run, "--out", tmp_path / "a").returncode == 0
    card = (tmp_path / "a" / "MODEL_CARD.md").read_text()
    assert (
        "Not evaluated on these weights: evaluation.json scored other weights than best.pt holds now" in card
    )
    assert "| MAE km |" not in card
    # the same train command runs the end, which says why (the state's reason, not its advice to run it)
    r = run_cli("train", "--config", run / "config.yaml", "--run-dir", run)
    assert r.returncode == 0, r.stderr[-2000:]
    why = "evaluation.json scored other weights than best.pt holds now: best.pt was replaced or put back"
    assert f"The end of the run ({why} after the evaluation): the best model" in r.stdout, r.stdout[-3000:]
    assert RunFolder(run).state().kind == "finished"
    ckpt[Key.MODEL][name] = ckpt[Key.MODEL][name] + 0.01  # another swap: evaluate alone scores them
    save_atomic(ckpt, run / "best.pt")
    assert "evaluate the run again" in RunFolder(run).state().words
    assert run_cli("evaluate", "--run-dir", run).returncode == 0  # scored again: the skill is theirs
    assert RunFolder(run).state().kind == "finished" and read_report(run)["weights_sha256"]
    assert run_cli("export", "--run-dir", run, "--out", tmp_path / "b").returncode == 0
    assert "| MAE km |" in (tmp_path / "b" / "MODEL_CARD.md").read_text()
    (run / "evaluation.json").unlink()
    assert run_cli("export", "--run-dir", run, "--out", tmp_path / "c").returncode == 0
    card = (tmp_path / "c" / "MODEL_CARD.md").read_text()
    assert (
        "- Training: the run is trained, end pending (not evaluated yet); these are its best weights so far"
        in card
    )
    assert "Not evaluated on these weights: the run has no evaluation.json" in card
    # a best.pt of an earlier state of the run put back (its record of the best model is not the final
    # checkpoint's): evaluate scores it as asked, and the log, report.md and the card say whose skill it is
    ckpt = load_checkpoint(run / "best.pt")
    ckpt[Key.VAL_LOSS] = float(ckpt[Key.VAL_LOSS]) + 0.5
    save_atomic(ckpt, run / "best.pt")
    r = run_cli("evaluate", "--run-dir", run)
    assert r.returncode == 0, r.stderr[-2000:]
    said = f"best.pt holds the best model of epoch {ckpt[Key.EPOCH]} (validation loss"
    out = r.stdout + r.stderr
    assert said in out and "was put back from an earlier state of the run" in out, out[-3000:]
    assert json.loads((run / "evaluation.json").read_text())["best_model"].startswith(said)
    assert f"Note: {said}" in (run / "report.md").read_text()
    assert run_cli("export", "--run-dir", run, "--out", tmp_path / "d").returncode == 0
    card = (tmp_path / "d" / "MODEL_CARD.md").read_text()
    assert "| MAE km |" in card and f"Note: {said}" in card


@pytest.mark.slow
def test_a_stopped_run_exports_its_best_weights_so_far_said_as_such_and_without_them_is_refused(
    session_runs, tmp_path
):
    """A run stopped in its second epoch (the session's run killed at step 8): the card says the run is
    stopped and these are its best weights so far, with no test skill; the same run without a best.pt (killed
    before its first epoch ended) is refused by name, nothing written."""
    run = session_runs.copy(session_runs.killed("step:8"), tmp_path / "run")
    assert run_cli("export", "--run-dir", run, "--out", tmp_path / "a").returncode == 0
    card = (tmp_path / "a" / "MODEL_CARD.md").read_text()
    assert "- Training: the run is stopped (resumable)" in card and "best weights so far" in card, card
    assert "| MAE km |" not in card
    assert "Not evaluated on these weights: the run has no evaluation.json" in card
    (run / "best.pt").unlink()
    r = run_cli("export", "--run-dir", run, "--out", tmp_path / "b")
    assert r.returncode == 2 and "best.pt" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert not (tmp_path / "b").exists()


def test_the_programs_window_max_is_max_pooling_at_any_frame_size():
    """The program's 2 x 2 pooling (export._WindowMax, which torch 2.11's export takes at a free frame size)
    gives max_pool2d's numbers, odd rows and columns dropped alike; the network's own pooling is swapped in
    the exported copy only, its parameters' names unchanged."""
    from cloudml_lib.core.network.model import FrameEncoder
    from cloudml_lib.science.export import _for_export, _WindowMax

    torch.manual_seed(0)
    for shape in [(2, 3, 16, 16), (1, 4, 17, 23), (3, 2, 55, 101)]:
        x = torch.randn(shape)
        assert torch.equal(_WindowMax()(x), torch.nn.functional.max_pool2d(x, 2))
    encoder = FrameEncoder([4, 8, 8])
    names = list(encoder.state_dict())
    frames = torch.randn(3, 1, 41, 67)
    before = encoder.eval()(frames)
    swapped = _for_export(encoder)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in swapped.modules())
    assert list(swapped.state_dict()) == names and torch.equal(swapped(frames), before)


@pytest.mark.slow
def test_export_refuses_a_folder_it_did_not_write_and_a_run_without_a_model(tiny_run, tmp_path):
    run, _, _ = tiny_run
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    r = run_cli("export", "--run-dir", run, "--out", mine)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert (mine / "notes.txt").read_text() == "keep me" and not (mine / "model.pt2").exists()
    r = run_cli("export", "--run-dir", tmp_path / "nothing")
    assert r.returncode == 2 and "best.pt" in r.stdout + r.stderr


@pytest.mark.slow
def test_exporting_again_writes_the_same_files_into_its_own_folder(tiny_run_copy, tmp_path):
    """The default folder is the run's export/: the run folder stays the run's (status reads it)."""
    run, _, _ = tiny_run_copy
    out = run / "export"
    assert run_cli("export", "--run-dir", run).returncode == 0
    from safetensors.torch import load_file

    first = load_file(out / "weights.safetensors")
    assert run_cli("export", "--run-dir", run, "--out", out).returncode == 0  # its own folder: written again
    again = load_file(out / "weights.safetensors")  # (the header's metadata may come in another order)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    status = run_cli("status", run)
    assert status.returncode == 0, status.stdout[-2000:] + status.stderr[-2000:]
