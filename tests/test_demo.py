"""README's first command, end to end: the demo trains and the height is learned from the frames."""

import json

import pytest
from conftest import REPO, run_cli

from cloudml_lib.science.baselines import BASELINES


def train_demo(tmp_path, flights, name, *overrides):
    args = [
        "train",
        "--config",
        "configs/demo.yaml",
        "--run-dir",
        tmp_path / name,
        "--set",
        f"data.dir={flights}",
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    for o in overrides:
        args += ["--set", o]
    r = run_cli(*args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads((tmp_path / name / "evaluation.json").read_text()), r.stdout


@pytest.mark.slow
def test_demo_learns_height_from_the_frames(tmp_path, demo_flights):
    """The demo's flights as `--preset demo` writes them, written once for the session (conftest's
    demo_flights: the generator's files are tested in test_synthetic.py and by test_cli's `--preset auto`)."""
    report, stdout = train_demo(tmp_path, demo_flights, "runs/demo")
    assert "Epoch 12/12 |" in stdout and "New best model saved" in stdout
    held_out = report["per_flight"]["05Mar25"]  # the test flight: nothing was trained or chosen on it
    assert report["overall"]["n"] == held_out["n"] > 100
    assert held_out["r2"] >= 0.75, report
    assert report["baseline"]["r2"] < 0.05
    cloud = report["cloud"]  # clear sky, cirrus alone and low cloud
    model, majority, threshold = (
        cloud[m]["per_flight"]["05Mar25"] for m in ("model", "majority", "bt_threshold")
    )
    assert (
        model["n"] > held_out["n"] and 0.1 < 1 - model["cloud_share"] < 0.6
    )  # clear frames are a real class
    assert model["accuracy"] > majority["accuracy"] + 0.15 and model["roc_auc"] > 0.85
    assert model["accuracy"] >= threshold["accuracy"] - 0.05
    # calibrated on the validation flight and measured on the test flight: a coverage, not a construction
    assert report["intervals"]["calibrated_on"] == list(report["protocol"]["validation"])
    assert report["protocol"]["validation"] and "05Mar25" not in report["protocol"]["validation"]
    intervals = report["intervals"]["per_flight"]["05Mar25"]
    assert 0.6 <= intervals["coverage"] <= 1.0 and intervals["mean_width_km"] < 1.0
    assert report["protocol"]["name"] == "untouched_test" and report["mae_interval_km"]["05Mar25"]
    # the baselines that see the temperature, on the test flight; the best named, with the skill against it
    methods = report["baselines"]["methods"]
    assert {"mean", "linear", "trees"} <= set(methods) <= set(BASELINES)
    assert report["radiometry"]["units"]["05Mar25"] == "K"
    if "atmosphere_trees" in methods:  # ERA5 beside the demo's flights: do the frames add to the atmosphere?
        assert report["baselines"]["beyond_atmosphere"]["per_flight"]["05Mar25"]["atmosphere_model"]
    best = report["baselines"]["best"]["per_flight"]["05Mar25"]
    assert best["mae_km"] == min(m["per_flight"]["05Mar25"]["mae_km"] for m in methods.values())
    assert methods["linear"]["per_flight"]["05Mar25"]["mae_km"] < 0.7 * report["baseline"]["mae_km"]
    assert "baseline" in report["verdict"] and report["by_height"]["per_flight"]["05Mar25"]
    readme_python_example_runs_on(tmp_path, report)
    # the docs' examples of a demo run's progress use its real step counts (they once said 39 a epoch, of 30)
    run = json.loads((tmp_path / "runs" / "demo" / "run.json").read_text())
    per_epoch, total = run["steps_per_epoch"], run["total_steps"]
    states = (REPO / "docs" / "reference" / "run-states.md").read_text()
    assert f"batch 0/{per_epoch}, step {per_epoch}/{total} (" in states
    assert (
        f"Resumed from step {per_epoch} (epoch 2, batch 0/{per_epoch})"
        in (REPO / "docs" / "how-to" / "resume.md").read_text()
    )
    control, _ = train_demo(
        tmp_path, demo_flights, "scalars_only", "model.scalars_only=true", "data.radiometry=none"
    )
    assert control["overall"]["r2"] < 0.3  # the angles alone do not give the height
    said = control["verdict"]  # a control loses by design: no advice to train it longer
    assert said.startswith("Control run (model.scalars_only") and "Try more" not in said
    assert held_out["r2"] - control["overall"]["r2"] > 0.5
    assert held_out["mae_km"] < 0.6 * control["overall"]["mae_km"]


def readme_python_example_runs_on(folder, report):
    """README's Python example (python-api.md's first), run where runs/demo is the demo's run."""
    import re
    import subprocess
    import sys

    from conftest import REPO

    example = re.search(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    r = subprocess.run(
        [sys.executable, "-c", example], cwd=folder, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "finished" and lines[1].startswith(f"{report['overall']['r2']} "), lines
    assert lines[2].endswith(" km") and 0 < float(lines[2].split()[0]) < 20, lines
