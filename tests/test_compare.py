"""compare's table (issue 38, defect 5): the flights each row's metrics were measured on, a warning when
they differ, metrics to the same decimals in every row and before the settings, and only settings that
change what a run computes counted as differing."""

import json
import shutil
from pathlib import Path

import yaml

from cloudml_lib.commands.compare import compare_runs, format_comparison

FINISHED = Path(__file__).parent / "fixtures" / "run_d1cecbe" / "finished"


def copy_run(folder: Path, flight: str | None = None, **changes) -> Path:
    shutil.copytree(FINISHED, folder)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    for key, value in changes.items():
        section, name = key.split("__")
        config[section][name] = value
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    if flight:
        evaluation = json.loads((folder / "evaluation.json").read_text())
        evaluation["per_flight"] = {flight: evaluation["per_flight"].popitem()[1]}
        (folder / "evaluation.json").write_text(json.dumps(evaluation))
    return folder


def table(text: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")
    ]


def test_rows_name_their_test_flights_and_differing_flights_are_said(tmp_path):
    a = copy_run(tmp_path / "a")
    b = copy_run(tmp_path / "b", flight="01Mar25", model__dropout=0.1)
    text = format_comparison(compare_runs([a, b]))
    head, _, *rows = table(text)
    assert head[:7] == ["run", "scored on", "R2", "MAE (km)", "RMSE (km)", "bias (km)", "n"]
    assert head[-1] == "model.dropout"
    # runs of an earlier release chose their epoch on the flight they are scored on: said in the row
    assert [r[1] for r in rows] == [f"{f} (chosen on them: CloudML 0.2)" for f in ("05Mar25", "01Mar25")]
    assert "measured on different data" in text
    assert all(len(r[2].split(".")[1]) == 3 for r in rows)  # R2 0.077, never 0.07728 beside 0.9318


def test_a_run_with_several_test_flights_gets_a_row_per_flight_then_the_pooled_row(tmp_path):
    a = copy_run(tmp_path / "a")
    evaluation = json.loads((a / "evaluation.json").read_text())
    ((name, m),) = evaluation["per_flight"].items()
    evaluation["per_flight"] = {name: m, "12Feb25": {**m, "mae_km": 0.77, "r2": -27.6, "n": 60}}
    evaluation["protocol"] = {"name": "untouched_test", "test_flights": [name, "12Feb25"]}
    (a / "evaluation.json").write_text(json.dumps(evaluation))
    rows = compare_runs([a])
    assert [r["run"] for r in rows] == [f"{a}: {name}", f"{a}: 12Feb25", f"{a}: pooled"]
    assert rows[1]["metrics"]["mae_km"] == 0.77 and rows[1]["n"] == 60
    assert rows[2]["held_out"].startswith("pooled over") and rows[2]["metrics"] == {
        k: evaluation["overall"][k] for k in rows[2]["metrics"]
    }


def test_bookkeeping_settings_are_not_differences_and_the_same_flights_need_no_warning(tmp_path):
    a = copy_run(tmp_path / "a")
    b = copy_run(tmp_path / "b", train__epochs=7, checkpoint__every_steps=5, data__num_workers=1)
    text = format_comparison(compare_runs([a, b]))
    head = table(text)[0]
    assert head[-1] == "compiled" and "No setting differs between these runs." in text
    assert "measured on different data" not in text


def test_epoch_records_past_the_end_or_with_impossible_times_are_not_counted_and_said(tmp_path):
    """metrics.jsonl appended to by something else showed as "3/2 epochs, inf min"."""
    a = copy_run(tmp_path / "a")
    planned = yaml.safe_load((a / "config.yaml").read_text())["train"]["epochs"]
    own = [{"kind": "epoch", "epoch": k, "step": 10 * k, "time_s": 60.0} for k in range(1, planned + 1)]
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own))
    with open(a / "metrics.jsonl", "a") as f:
        for k in (planned + 1, planned + 2):
            f.write(json.dumps({"kind": "epoch", "epoch": k, "step": 999, "time_s": 1e308}) + "\n")
    row = compare_runs([a])[0]
    assert row["epochs"] == f"{planned}/{planned}" and row["minutes"] == planned
    text = format_comparison([row])
    assert f"metrics.jsonl: 2 epoch record(s) outside epochs 1-{planned}, not counted" in text
    assert "inf" not in text


def test_channels_chosen_by_memory_optimized_are_shown_as_the_model_has_them(tmp_path):
    """Preset C leaves model.channels empty (memory_optimized chooses them): compare showed `[]`."""
    a = copy_run(tmp_path / "a")
    c = copy_run(tmp_path / "c", model__channels=[], model__memory_optimized=True)
    head, _, *rows = table(format_comparison(compare_runs([a, c])))
    at = head.index("model.channels")
    assert rows[1][at] == "[32, 64, 128]" and rows[0][at] != "[]"


def test_a_run_on_other_flights_differs_by_its_flights_and_test_flights_not_by_their_folder(tmp_path):
    """Compare said "No setting differs" between the demo run and a run on the user's own flights: the
    flights (by name), the test flights and data.demo are what a run was trained on; where they live is
    not."""
    a = copy_run(tmp_path / "a", data__demo=True)
    config = yaml.safe_load((a / "config.yaml").read_text())
    theirs = [dict(f, name=f"1{i}Feb25") for i, f in enumerate(config["data"]["flights"])]
    b = copy_run(
        tmp_path / "b", data__demo=False, data__flights=theirs, data__test_flights=["10Feb25"], data__dir="/x"
    )
    text = format_comparison(compare_runs([a, b]))
    head = table(text)[0]
    assert {"data.demo", "data.flights", "data.test_flights"} <= set(head) and "data.dir" not in head
    assert "No setting differs" not in text


def test_the_sweeps_history_plot_counts_trials_from_1_as_every_line_does(tmp_path, monkeypatch):
    """Optuna's history plot counted trials from 0 under lines that count them from 1."""
    import optuna

    from cloudml_lib.commands import compare
    from cloudml_lib.science import plots

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig))
    assert compare._optuna_figure("history", study, tmp_path / "h.png", "mae_km") is None
    ax = drawn[0].axes[0]
    drawn[0].canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels[:3] == ["1", "2", "3"] and "counted from 1" in ax.get_xlabel(), labels


def test_the_table_says_whether_the_frames_add_anything_to_the_atmosphere_per_flight(tmp_path):
    """The column "frames beyond the atmosphere": from each evaluation's baselines.beyond_atmosphere, per test
    flight and pooled; "-" for a run without ERA5 (or written before)."""
    a = copy_run(tmp_path / "a")
    old = copy_run(tmp_path / "old")
    evaluation = json.loads((a / "evaluation.json").read_text())
    ((name, m),) = evaluation["per_flight"].items()
    evaluation["per_flight"] = {name: m, "12Feb25": m}
    evaluation["protocol"] = {"name": "untouched_test", "test_flights": [name, "12Feb25"]}
    said = {"frames_model": "network", "frames_mae_km": 0.12, "atmosphere_model": "physical"}
    evaluation.setdefault("baselines", {"methods": {}, "best": {}})["beyond_atmosphere"] = {
        "per_flight": {
            name: {**said, "atmosphere_mae_km": 0.2, "skill": 0.4, "frames_add": True},
            "12Feb25": {**said, "atmosphere_mae_km": 0.1, "skill": -0.2, "frames_add": False},
        },
        "pooled": {**said, "atmosphere_mae_km": 0.15, "skill": 0.2, "frames_add": True},
    }
    (a / "evaluation.json").write_text(json.dumps(evaluation))
    head, _, *rows = table(format_comparison(compare_runs([a, old])))
    column = head.index("frames beyond the atmosphere")
    assert [r[column] for r in rows] == ["add +0.40", "nothing", "add +0.20", "-"]
