"""A run's numbers on its test flights (science/skill.py, report.py): per flight first, with their spread; a
flight where the model loses or collapses is called so whatever the pool says; coverage only where the
intervals were not calibrated; a fold or flight whose R2 is undefined is named."""

from __future__ import annotations

import numpy as np
import pytest

from cloudml_lib.core.network.metrics import mae_interval, regression_metrics, time_blocks
from cloudml_lib.science import intervals, skill
from cloudml_lib.science.report import interval_lines, metric_rows, verdict


def three_flights():
    """Three test flights: a long one like the training flights (the model good there), one whose labels
    all lie above every training label (the model collapses there), one whose labels do not vary."""
    rng = np.random.default_rng(0)
    good = rng.uniform(0.3, 1.1, 300)
    high = rng.uniform(1.3, 1.9, 60)
    flat = np.full(40, 0.7)
    true = np.concatenate([good, high, flat])
    pred = np.concatenate([good + rng.normal(0, 0.05, 300), 1.0 + rng.normal(0, 0.04, 60), flat + 0.03])
    flights = np.array(["long"] * 300 + ["high"] * 60 + ["flat"] * 40)
    frames = np.concatenate([np.arange(300) * 7, np.arange(60) * 7, np.arange(40) * 7])
    return true, pred, flights, frames


def report_of(true, pred, flights, frames, train_mean=0.7, span=(0.3, 1.1)) -> dict:
    report = skill.height_scores(true, pred, flights, frames, train_mean)
    report["training_label_range_km"] = list(span)
    report["outside_training_labels"] = skill.outside_labels(true, flights, list(span))
    report["protocol"] = {"name": "untouched_test", "test_flights": sorted(set(flights))}
    return report


def test_each_test_flight_is_judged_on_its_own_whatever_the_pool_says():
    report = report_of(*three_flights())
    said = verdict(report)
    assert said.startswith("Verdict, flight by flight: ")
    assert "long: the model beats predicting the training mean" in said
    assert "high: not useful yet: the predictions collapse towards a constant" in said
    assert (
        "60 of its 60 labels (100%, 1.3" in said
        and "lie outside the heights trained on (0.30-1.10 km)" in said
    )
    assert "R2 is undefined there: its 40 labels do not vary" in said
    assert "NOT on high" in said and "Pooled over the 3 test flights" in said
    rows = [name for name, _ in metric_rows(report)]
    assert rows[:2] == ["model: flight long", "baseline (training mean): flight long"]
    assert rows[-2:] == ["model: pooled over 3 test flights", "baseline (training mean): pooled over 3"]
    assert report["per_flight"]["flat"]["r2"] != report["per_flight"]["flat"]["r2"]  # NaN: undefined


def test_the_maes_interval_resamples_whole_time_blocks():
    rng = np.random.default_rng(1)
    frames = np.concatenate([np.arange(20) + 1000 * b for b in range(12)])  # 12 bursts of 20 labels
    assert len(time_blocks(frames)) == 12
    true = rng.uniform(0.2, 1.5, frames.size)
    pred = true + np.repeat(rng.normal(0, 0.2, 12), 20)  # errors alike within a burst
    low, high = mae_interval(true, pred, frames)
    mae = np.abs(pred - true).mean()
    assert low < mae < high
    assert mae_interval(true, pred, frames) == [low, high]  # the same numbers every time
    # treating the 240 labels as independent would give a narrower, falsely confident interval
    singles = mae_interval(true, pred, np.arange(frames.size) * 1000)  # every label its own block
    assert high - low > singles[1] - singles[0]
    assert mae_interval(true[:4], pred[:4], frames[:4]) is None
    assert len(time_blocks(np.arange(30))) == 10  # one burst: ten runs of consecutive labels


def test_coverage_is_measured_only_where_the_intervals_were_not_calibrated():
    rng = np.random.default_rng(2)
    cal_true = rng.uniform(0.3, 1.5, 200)
    cal = intervals.calibrate(
        cal_true + rng.normal(0, 0.1, 200),
        cal_true,
        "conformal_absolute",
        0.9,
        "validation",
        groups=["V"] * 200,
    )
    true = rng.uniform(0.3, 1.5, 100)
    pred = true + rng.normal(0, 0.1, 100)
    flights = np.array(["V"] * 50 + ["T"] * 50)
    scores = skill.interval_scores(true, pred, flights, cal, cal["flights"])
    assert scores["per_flight"]["V"]["coverage"] is None and scores["per_flight"]["V"]["calibrated_here"]
    assert 0.7 < scores["per_flight"]["T"]["coverage"] <= 1.0
    assert scores["overall"]["n"] == 50  # the pooled coverage is over the unseen flight alone
    lines = "\n".join(interval_lines({"intervals": scores, "protocol": {"name": "untouched_test"}}))
    assert "| V | calibrated here |" in lines and "| T | " in lines
    # a run of the earlier protocol calibrated on its test flights: no coverage is said at all
    old = {k: v for k, v in scores.items() if k not in ("calibrated_on", "mode")}
    said = "\n".join(interval_lines({"intervals": old}))
    assert "no coverage is measured here" in said
    assert "| V | calibrated here |" in said and "| T | calibrated here |" in said


def test_per_flight_calibration_holds_every_validation_flight_at_the_target():
    """Flights differ: a pooled calibration covers the flight with larger errors far less than the target,
    the per-flight one (the widest of each flight's own) holds it there too."""
    rng = np.random.default_rng(3)
    true = rng.uniform(0.3, 1.5, 750)
    noise = np.concatenate([rng.normal(0, 0.05, 600), rng.normal(0, 0.3, 150)])
    groups = ["calm"] * 600 + ["rough"] * 150
    pooled = intervals.calibrate(true + noise, true, "conformal_absolute", 0.9, "v", groups=groups)
    per = intervals.calibrate(
        true + noise, true, "conformal_absolute", 0.9, "v", groups=groups, mode="per_flight"
    )
    assert "the widest of 2 calibrations" in per["source"]
    test_true = rng.uniform(0.3, 1.5, 500)
    test_pred = test_true + rng.normal(0, 0.3, 500)  # a new flight as rough as the roughest
    cover = {
        name: intervals.scores(test_true, *intervals.bounds(test_pred, c))["coverage"]
        for name, c in (("pooled", pooled), ("per_flight", per))
    }
    assert cover["pooled"] < 0.7 and cover["per_flight"] >= 0.8


@pytest.mark.parametrize("constant", [0.7, 1.2])
def test_a_constant_label_fold_is_named_and_the_mean_says_over_how_many(constant):
    from cloudml_lib.commands.crossval import format_markdown, summarise

    rng = np.random.default_rng(4)
    folds = {}
    for name in ("A", "B", "C"):
        true = np.full(30, constant) if name == "B" else rng.uniform(0.3, 1.5, 30)
        model = regression_metrics(true, true + rng.normal(0, 0.1, 30))
        folds[name] = {"model": model, "mean": regression_metrics(true, np.full(30, 0.9)), "warnings": []}
    result = {"folds": folds, **summarise(folds), "warnings": [], "protocol": "nested"}
    assert result["undefined"]["r2"]["model"] == ["B"]
    assert any("R2 is undefined on B" in v and "2 of 3 folds" in v for v in result["verdicts"])
    text = format_markdown(result)
    assert "| B | 30 | undefined |" in text and "(2 of 3 folds; undefined on B)" in text
    mean = np.mean([folds[n]["model"]["r2"] for n in ("A", "C")])
    assert abs(result["summary"]["model"]["r2"]["mean"] - mean) < 1e-12


def test_the_error_is_given_by_height_range_and_flight_with_the_bias_and_a_baselines_error():
    """Cloud-base papers report the error by height: thirds of the heights trained on, and outside them."""
    from cloudml_lib.science.report import height_range_lines

    true, pred, flights, frames = three_flights()
    baseline = np.full_like(true, 0.7)
    by = skill.by_height(true, pred, flights, [0.3, 1.1], ("training mean", baseline))
    assert by["edges_km"] == [0.3, 0.567, 0.833, 1.1] and by["baseline"] == "training mean"
    long = {r["range"]: r for r in by["per_flight"]["long"]}
    assert set(long) == {"0.30-0.57", "0.57-0.83", "0.83-1.10"}  # nothing of it outside: no empty rows
    assert sum(r["n"] for r in long.values()) == 300
    high = by["per_flight"]["high"]
    assert [r["range"] for r in high] == ["0.30-0.57", "0.57-0.83", "0.83-1.10", "above 1.10"]
    above = high[-1]
    m = flights == "high"
    assert above["n"] == 60 and above["bias_km"] == pytest.approx(float((pred[m] - true[m]).mean()))
    assert above["bias_km"] < -0.3 and above["baseline_mae_km"] == pytest.approx(
        float(np.abs(0.7 - true[m]).mean())
    )
    assert high[0]["n"] == 0 and high[0]["mae_km"] is None  # a third with no label: said, not invented
    lines = "\n".join(height_range_lines({"by_height": by}))
    assert "| flight high | above 1.10 | 60 |" in lines and "MAE km of training mean" in lines
    assert skill.by_height(true, pred, flights, [], None) == {}
