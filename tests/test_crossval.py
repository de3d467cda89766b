"""Leave-one-flight-out cross-validation: fold isolation, resuming an interrupted run, the warnings."""

import json
import signal

import numpy as np
import pytest
import yaml
from conftest import assert_reads_back, run_cli, tiny_raw

from cloudml_lib.base.config import config_from_dict
from cloudml_lib.commands.crossval import fold_warnings
from cloudml_lib.core.run.checkpoint import load_checkpoint
from cloudml_lib.data.cache import load_flight_cache
from cloudml_lib.data.dataset import fit_scalers
from cloudml_lib.data.splits import choose_split
from cloudml_lib.science.baselines import ATMOSPHERE, BASELINES


def crossval(cfg, run_dir, kill_at=None):
    env = {"CLOUDML_KILL_AT": kill_at} if kill_at else None
    return run_cli("crossval", "--config", cfg, "--run-dir", run_dir, env=env)


@pytest.fixture(scope="module")
def reference(tiny_flights, tmp_path_factory):
    root, entries = tiny_flights
    tmp = tmp_path_factory.mktemp("cv")
    raw = tiny_raw(root, entries, tmp / "cache")
    raw["train"]["epochs"] = 1
    raw["checkpoint"] = {"every_steps": 2}
    cfg = tmp / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    r = crossval(cfg, tmp / "ref")
    assert r.returncode == 0, r.stderr[-2000:]
    # the flight table once on screen (each run's train.log has it), not twice per fold
    assert r.stdout.count("labels kept") == 1 and "Flights: as in the table above" in r.stdout
    control = (tmp / "ref" / "folds" / entries[0]["name"] / "scalars_only" / "train.log").read_text()
    assert "labels kept" in control and "Control run (model.scalars_only" in r.stdout
    for name in (e["name"] for e in entries):  # each end said once, naming its run (two runs a fold)
        for what in ("model", "scalars-only control"):
            assert r.stdout.count(f"The end of the fold {name}'s {what} (") == 1, r.stdout[-3000:]
    return cfg, tmp / "ref", [e["name"] for e in entries]


@pytest.mark.slow
def test_every_flight_is_held_out_once_with_baselines_and_summary(reference):
    _, ref, names = reference
    result = json.loads((ref / "crossval.json").read_text())
    assert list(result["folds"]) == names
    for name, fold in result["folds"].items():
        assert set(fold) >= {"model", "mean", "scalars_only", "linear", "trees", "best_baseline", "warnings"}
        assert fold["model"]["n"] == fold["trees"]["n"] == fold["linear"]["n"] > 10
        best = fold["best_baseline"]  # the lowest MAE of the baselines, and the network's skill against it
        assert best["mae_km"] == min(fold[m]["mae_km"] for m in BASELINES if m in fold)
        assert best["skill"] == pytest.approx(1 - fold["model"]["mae_km"] / best["mae_km"])
        preds = (ref / "folds" / name / "model" / "predictions.csv").read_text().splitlines()[1:]
        assert {line.split(",")[0] for line in preds} == {name}  # only the test flight is scored
    # and with ERA5 beside the flights (the demo's), the baselines on the atmosphere
    assert set(result["summary"]) - set(ATMOSPHERE) == {
        "model",
        "mean",
        "scalars_only",
        "linear",
        "trees",
        "skill_vs_best_baseline",
        "cloud_model",
        "cloud_majority",
        "cloud_bt_threshold",
    }
    for fold in result["folds"].values():  # cloud metrics per fold, baselines
        assert fold["cloud"]["model"]["overall"]["n"] > fold["model"]["n"]
        assert set(fold["cloud"]) >= {"model", "majority", "bt_threshold"}
    md = (ref / "crossval.md").read_text()
    assert "| test flight |" in md and "The image model beats the training mean on" in md
    assert "The image model beats the linear model on brightness statistics on" in md
    assert "Against the best baseline of each test flight the network's MAE skill is" in md

    assert md.splitlines()[2].startswith("Nested: each fold's test flight is untouched")
    assert "The cloud output beats the brightness-temperature threshold on" in md
    # intervals measured on each flight never seen, per method; calibrations written for predict
    iv = result["intervals"]
    assert iv["chosen"] in ("conformal_absolute", "conformal_gamma") and set(iv["methods"]) == {
        "conformal_absolute",
        "conformal_gamma",
    }
    for method in iv["methods"].values():
        assert set(method["per_flight"]) == set(names)
        assert all(0 <= p["coverage"] <= 1 and p["mean_width_km"] > 0 for p in method["per_flight"].values())
    assert "Prediction intervals (90% target) on each flight never seen" in md
    assert set(iv["nested"]["per_flight"]) == set(names) and "method chosen on the other flights |" in md
    pooled = json.loads((ref / "intervals.json").read_text())
    assert pooled["method"] == iv["chosen"] and pooled["n"] == sum(
        f["model"]["n"] for f in result["folds"].values()
    )
    # the adaptation curve (train.adaptation_labels [10, 25, 50]): the tiny flights hold 20-28 labels, too few
    # to adapt on 10 and score 20, and each fold says so (test_adapt.py scores a longer flight)
    adaptation = result["adaptation"]
    assert adaptation["labels"] == [10, 25, 50] and set(adaptation["per_flight"]) == set(names)
    for name, record in adaptation["per_flight"].items():
        assert record["curve"] == [] and set(record["left_out"]) == {"10", "25", "50"}
        assert record["labels"] == result["folds"][name]["model"]["n"] < 30
        assert "10 to adapt on and 20 to score need 30 at least" in record["left_out"]["10"]
    assert "## Adaptation to each test flight with a few of its labels" in md
    own = json.loads((ref / "folds" / names[0] / "model" / "intervals.json").read_text())
    assert own["n"] == pooled["n"] - result["folds"][names[0]]["model"]["n"]  # the other folds' errors only
    # for the fold model's weights alone: another best.pt put in its place predicts without them
    scored = json.loads((ref / "folds" / names[0] / "model" / "evaluation.json").read_text())
    assert own["weights_sha256"] == scored["weights_sha256"]


def test_every_file_a_crossval_writes_reads_back_and_compare_shows_its_numbers(reference):
    """What crossval writes, its readers take (runfiles.py): a fresh cross-validation in Compare with its
    numbers, today's protocol and its skill, never "damaged" (Compare once called a fresh crossval.json
    damaged: its summary's skill has no metric level, and the reader wanted one)."""
    from cloudml_lib.commands.compare import compare_runs, format_comparison

    _, ref, names = reference
    read = assert_reads_back(ref)
    assert "crossval.json" in read and f"folds/{names[0]}/model/evaluation.json" in read
    (row,) = compare_runs([ref])
    assert row["state"] == "finished" and row["held_out"] == f"each flight once ({len(names)} folds, mean)"
    summary = json.loads((ref / "crossval.json").read_text())["summary"]
    assert row["metrics"]["mae_km"] == summary["model"]["mae_km"]["mean"] > 0
    assert row["skill"] == f"{summary['skill_vs_best_baseline']['mean']:+.2f} vs each fold's best (mean)"
    assert "CloudML 0.2" not in format_comparison([row])


def test_a_fold_scored_by_an_earlier_release_gets_todays_baselines(reference):
    """Its `trees` saw the per-frame reading, not the temperature: fitted again, beside a linear model."""
    from cloudml_lib.base.config import load_config
    from cloudml_lib.commands.crossval import with_baselines

    cfg, ref, names = reference
    today = json.loads((ref / "crossval.json").read_text())["folds"][names[0]]
    earlier = {k: v for k, v in today.items() if k not in ("linear", "best_baseline")}
    earlier["trees"] = dict(today["trees"], mae_km=9.0)  # what that release's trees said
    again = with_baselines(load_config(cfg), names[0], earlier, {})
    assert again["linear"] == today["linear"] and again["trees"] == today["trees"]
    assert again["best_baseline"] == today["best_baseline"]
    assert with_baselines(load_config(cfg), names[0], today, {}) is today  # today's: kept as they are


def test_each_fold_is_nested_its_test_flight_untouched(reference):
    """Each fold's test flight is its own; its validation data and scalers come from its other flights."""
    _, ref, names = reference
    for held in names:
        best = load_checkpoint(ref / "folds" / held / "model" / "best.pt")
        cfg = config_from_dict(best["config"])
        assert cfg.data.test_flights == [held] and cfg.data.validation == "auto"
        caches = [load_flight_cache(f, cfg.data) for f in cfg.data.flights]
        split = choose_split(caches, cfg.data)
        assert held not in split.validation and split.rule == "time_blocks"  # two training flights
        run = json.loads((ref / "folds" / held / "model" / "run.json").read_text())
        assert run["split"] == split.record() == best["split"]
        fit, _, _ = split.parts(caches)
        expected = fit_scalers(fit, cfg.data.radiometry).to_dict()  # the brightness scale too
        assert best["scalers"] == pytest.approx(expected)  # no statistics of the test flight or validation
        fold = json.loads((ref / "folds" / held / "fold.json").read_text())
        assert fold["protocol"] == "untouched_test" and fold["validation"]["n"] > 0


@pytest.mark.slow
def test_an_interrupted_crossval_continues_with_its_unfinished_fold(reference, tmp_path):
    cfg, ref, names = reference
    run = tmp_path / "cv"
    # Fold 1 takes 7 + 7 steps (model, scalars-only control); step 19 is the 2nd fold's step 5, after its
    # step-4 save waited for the step-2 one to commit (step 3 would race the background writer).
    r = crossval(cfg, run, kill_at="step:19")
    assert r.returncode == -signal.SIGKILL
    assert (run / "folds" / names[0] / "fold.json").is_file() and not (
        run / "folds" / names[1] / "fold.json"
    ).exists()
    r = crossval(cfg, run)
    assert r.returncode == 0, r.stderr[-2000:]
    first_log = (run / "folds" / names[0] / "model" / "train.log").read_text()
    assert "nothing to train" in first_log  # not trained again
    assert "Resumed from step" in (run / "folds" / names[1] / "model" / "train.log").read_text()
    got, want = (json.loads((d / "crossval.json").read_text())["folds"] for d in (run, ref))
    for name in names:
        assert got[name]["model"] == want[name]["model"]  # as if never interrupted
        assert got[name]["trees"] == want[name]["trees"]


def test_the_warnings_say_what_went_wrong():
    m = lambda mae, ratio: {"mae_km": mae, "std_ratio": ratio, "r2": 0.0}  # noqa: E731
    warnings = fold_warnings(
        "10Feb25",
        {"model": m(0.30, 0.1), "mean": m(0.25, 0.0)},
        train_km=np.array([0.3, 0.5, 0.9]),
        val_km=np.array([0.2, 0.4, 1.5, 1.8]),
    )
    assert any("collapse towards a constant (std(pred)/std(true) 0.10" in w for w in warnings)
    assert any("no better than predicting the training mean" in w for w in warnings)
    assert any(
        "75% of its heights lie outside the training flights' range 0.30..0.90 km" in w for w in warnings
    )
    assert (
        fold_warnings(
            "x", {"model": m(0.1, 0.9), "mean": m(0.3, 0.0)}, np.array([0.2, 1.0]), np.array([0.5, 0.6])
        )
        == []
    )


@pytest.mark.slow
def test_crossval_needs_no_validation_flight_in_the_config(reference, tmp_path):
    cfg, _, names = reference
    raw = yaml.safe_load(cfg.read_text())
    raw["data"]["test_flights"] = []
    raw["train"]["epochs"] = 1
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(raw))
    r = run_cli("crossval", "--config", plain, "--run-dir", tmp_path / "cv", "--no-controls")
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(json.loads((tmp_path / "cv" / "crossval.json").read_text())["folds"]) == names


@pytest.mark.slow
def test_a_campaign_is_held_out_with_all_its_flights(tiny_flights, tmp_path):
    """data.fold_by campaign: the campaign from the IR file names (one flight renamed WHYMSIE2024_IRAI_...),
    each held out whole, its validation drawn from the other campaign's flights; said in crossval.md, and
    compare names it."""
    import shutil

    from cloudml_lib.base.config import load_config
    from cloudml_lib.commands.compare import compare_runs
    from cloudml_lib.commands.crossval import crossval as run_crossval

    root, entries = tiny_flights
    data = tmp_path / "flights"
    shutil.copytree(root, data)
    last = entries[2]
    renamed = last["ir_file"].replace("GLOVE2025_IRAI", "WHYMSIE2024_IRAI")
    (data / last["ir_file"]).rename(data / renamed)
    raw = tiny_raw(data, [*entries[:2], {**last, "ir_file": renamed}], tmp_path / "cache")
    raw["train"].update(epochs=1, adaptation_labels=[])
    raw["data"]["fold_by"] = "campaign"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    result = run_crossval(load_config(cfg), tmp_path / "cv", controls=False)
    names = [e["name"] for e in entries]
    assert list(result["folds"]) == ["GLOVE2025", "WHYMSIE2024"] and result["fold_by"] == "campaign"
    for fold, tested in (("GLOVE2025", names[:2]), ("WHYMSIE2024", names[2:])):
        best = load_checkpoint(tmp_path / "cv" / "folds" / fold / "model" / "best.pt")
        assert best["config"]["data"]["test_flights"] == tested
        split = best["split"]
        assert not set(split["validation"]) & set(tested)  # validation from the other campaign
        assert result["folds"][fold]["model"]["n"] > 20  # every flight of the campaign scored
    md = (tmp_path / "cv" / "crossval.md").read_text()
    assert "Cross-validation over 2 campaigns, each held out with all its flights" in md
    assert "WHYMSIE2024 (05Mar25)" in md
    assert compare_runs([tmp_path / "cv"])[0]["held_out"] == "each campaign once (2 folds, mean)"


def test_campaigns_stated_in_the_config_and_the_mistakes_named(tiny_raw_config, tmp_path):
    from cloudml_lib.base.config import load_config
    from cloudml_lib.base.errors import ConfigError
    from cloudml_lib.commands.crossval import fold_config, fold_groups

    names = [f["name"] for f in tiny_raw_config["data"]["flights"]]

    def config(campaigns, fold_by="campaign"):
        raw = {
            **tiny_raw_config,
            "data": {**tiny_raw_config["data"], "fold_by": fold_by, "campaigns": campaigns},
        }
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
        return load_config(tmp_path / "c.yaml")

    cfg = config([{"name": "A", "flights": names[:1]}, {"name": "B", "flights": names[1:]}])
    assert fold_groups(cfg) == {"A": names[:1], "B": names[1:]}
    assert fold_config(cfg, "B").data.test_flights == names[1:]
    assert fold_groups(config([], fold_by="flight")) == {n: [n] for n in names}
    with pytest.raises(ConfigError, match="the flights form 1 campaign.*GLOVE2025: 3 flights.*at least two"):
        fold_groups(config([]))  # every tiny flight's IR file says GLOVE2025
    with pytest.raises(ConfigError, match=f"{names[2]} in no campaign"):
        fold_groups(config([{"name": "A", "flights": names[:2]}]))
    with pytest.raises(ConfigError, match=f"{names[0]} is in campaign A too"):
        config([{"name": "A", "flights": names[:1]}, {"name": "B", "flights": names}])
    with pytest.raises(ConfigError, match=r"data.campaigns\[0\].name: '../x' is not valid"):
        config([{"name": "../x", "flights": names}])
