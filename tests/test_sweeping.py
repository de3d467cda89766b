"""The training notebook's sweep cell (cloudml_lib.colab.sweeping): off unless asked for, Optuna installed on
demand and its absence never failing Run all, a real one-trial sweep followed trial by trial in the live
view and its report shown. Headless: widgets are inspected, not rendered."""

import subprocess
from pathlib import Path

import nbformat
import pytest
import yaml
from test_picker import TINY_PRESET, move

from cloudml_lib import (
    colab,
)
from cloudml_lib.colab import sweeping
from cloudml_lib.commands import presets
from cloudml_lib.data.synthetic import make_demo_flights

REPO = Path(__file__).parent.parent


@pytest.fixture
def own(ws, tmp_path, monkeypatch):
    """Three flights of the user's in data/ and the tiny preset for every preset (Auto: B)."""
    make_demo_flights(tmp_path / "all", n_flights=3, frames_per_flight=120, frame_shape=(40, 48))
    for f in ("01Mar25", "03Mar25", "05Mar25"):
        move(f, tmp_path / "all", ws.data / "ER2")
    path = tmp_path / "tiny_preset.yaml"
    path.write_text(yaml.safe_dump(TINY_PRESET))
    monkeypatch.setattr(presets, "preset_config_path", lambda name: path)
    monkeypatch.setattr(presets, "choose_preset", lambda report: ("B", "a test GPU that fits it"))
    return ws


def no_optuna_needed():
    pytest.fail("Optuna was asked for although no sweep runs")


def test_the_sweep_is_off_unless_asked_for(ws, shown, monkeypatch, capsys):
    monkeypatch.setattr(sweeping, "ensure_optuna", no_optuna_needed)
    p = colab.Picker(ws)
    assert not p.sweep.value and p.choice().sweep_trials == 0 and p.sweep_size.layout.display == "none"
    assert colab.sweep(ws, p, None) is None
    assert "Sweep not asked for" in capsys.readouterr().out
    p.sweep.value = True  # asked for, but the run is not finished: nothing starts
    assert (
        p.sweep_size.layout.display is None and "Then a sweep: 8 trials of at most 6 epochs" in p.note.value
    )
    assert colab.sweep(ws, p, ws.runs / "demo") is None
    assert "The sweep waits for training to finish" in capsys.readouterr().out


def test_without_optuna_the_sweep_says_so_and_run_all_goes_on(ws, shown, monkeypatch, capsys):
    from cloudml_lib.colab import drive

    real = drive.importlib.util.find_spec
    monkeypatch.setattr(
        drive.importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else real(name, *a)
    )
    asked = []

    def pip(cmd, **kwargs):
        asked.append(cmd)
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution found for optuna>=4.0"
        )

    monkeypatch.setattr(drive.subprocess, "run", pip)
    p = colab.Picker(ws)
    p.sweep.value = True
    assert colab.sweep(ws, p, None) is None  # no exception: Run all goes on
    out = capsys.readouterr().out
    assert asked and asked[0][1:4] == ["-m", "pip", "install"] and "optuna>=4.0" in asked[0]
    assert "installing optuna>=4.0 now" in out and "optuna could not be installed, so no sweep runs" in out
    assert "No matching distribution found" in out and "then run this cell again" in out


@pytest.mark.slow
def test_a_sweep_runs_trial_by_trial_and_shows_its_report(own, shown, monkeypatch):
    pytest.importorskip("optuna")
    p = colab.Picker(own)
    p.sweep.value, p.sweep_trials.value, p.sweep_epochs.value = True, 1, 1
    c = p.choice()
    cmd = sweeping.sweep_command(own, c)
    assert cmd[cmd.index("--trials") + 1] == "1" and "train.epochs=1" in cmd
    assert cmd[cmd.index("--run-dir") + 1] == str(own.runs / "preset_B_sweep")
    views = []

    class Recorded(sweeping.SweepView):
        def __init__(self, *args):
            super().__init__(*args)
            views.append(self)

    monkeypatch.setattr(sweeping, "SweepView", Recorded)
    folder = colab.sweep(own, p, None)
    assert folder == own.runs / "preset_B_sweep" and (folder / "sweep.json").is_file()
    view = views[0]
    assert view.trial == "trial 1 of 1 (trials/0)"
    assert view.metrics_path == folder / "trials" / "0" / "metrics.jsonl"
    assert "finished" in view.table.value and "train.learning_rate" in view.table.value
    assert "1 of 1 started" in view.table.value
    assert "<th>MAE (km)</th>" in view.table.value and "<td>1 (trials/0)</td>" in view.table.value
    said = "\n".join(x for x in shown if isinstance(x, str))
    assert "**Sweep** of 1 trial, each at most 1 epoch" in said and "train.learning_rate" in said
    assert "## Trials" in said and "## Importance of each parameter" in said  # the report, shown


def test_the_training_notebook_has_a_sweep_cell_and_compare_points_to_it():
    nb = nbformat.read(REPO / "colab_training.ipynb", as_version=4)
    cells = [c.source for c in nb.cells]
    at = next(i for i, s in enumerate(cells) if s.startswith("## Sweep (optional)"))
    assert cells[at + 1] == "sweep_dir = colab.sweep(ws, picker, run_dir)"
    compare = next(s for s in cells if s.startswith("## Compare runs"))
    assert "python -m cloudml_lib sweep" not in compare and "the Sweep cell above" in compare
