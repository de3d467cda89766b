"""The height's baselines (science/baselines.py): fitted on the training part alone, on the raw brightness
statistics of the labelled frame; the best of them named, the network's skill against it, and the verdict that
says so in words when a baseline does as well."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_SHAPE

from cloudml_lib.base.config import build_config
from cloudml_lib.core.network.metrics import regression_metrics
from cloudml_lib.data.cache import load_caches
from cloudml_lib.data.dataset import CloudDataset, fit_scalers
from cloudml_lib.data.synthetic import make_demo_flights
from cloudml_lib.science import baselines
from cloudml_lib.science.report import flight_verdicts, verdict


@pytest.fixture(scope="module")
def physics_flights(tmp_path_factory):
    """Four flights of generator version 2, whose cloud pixels sit at the temperature of the base + 0.3 km
    (one sea, one lapse rate): the base is a known function of the frames' coldest temperatures. Their caches
    as (training caches, test cache)."""
    root = tmp_path_factory.mktemp("v2")
    entries = make_demo_flights(
        root, n_flights=4, seed=3, frames_per_flight=400, frame_shape=TINY_SHAPE, version=2
    )
    cfg = build_config(
        {
            "data": {
                "dir": str(root),
                "cache_dir": str(tmp_path_factory.mktemp("cache")),
                "flights": entries,
                "test_flights": [entries[2]["name"]],
                "temporal_frames": 3,
                "swath_slice": [4, 36],
                "preprocess_workers": 0,
            }
        }
    )
    caches = load_caches(cfg.data)
    return [c for i, c in enumerate(caches) if i != 2], caches[2]


def sets(train, test):
    scalers = fit_scalers(train)
    return CloudDataset(train, scalers, cloud=False), CloudDataset([test], scalers, cloud=False)


def test_a_baseline_that_sees_the_temperature_beats_the_mean_where_the_base_follows_it(physics_flights):
    train, test = sets(*physics_flights)
    assert train.caches[0].radiometry.units == "counts"  # what a version-2 file states
    predicted = baselines.fit_predict(train, [test], seed=0)
    true = test.targets_km()
    mae = {k: float(np.abs(v[0] - true).mean()) for k, v in predicted.items()}
    assert set(mae) == {"mean", "linear", "trees"} and len(true) > 30
    assert mae["linear"] < 0.5 * mae["mean"], mae  # the temperature gives the base here
    assert mae["trees"] < 0.7 * mae["mean"], mae


def test_the_baselines_are_fitted_on_the_training_part_alone(physics_flights):
    """Whatever the test flight's labels, the baselines' answers on it are the same: nothing of it is
    fitted."""
    train, test = sets(*physics_flights)
    first = baselines.fit_predict(train, [test], seed=0)
    shuffled = physics_flights[1].part(np.arange(len(physics_flights[1])))
    has = np.flatnonzero(np.isfinite(shuffled.cbh_km))
    shuffled.cbh_km = shuffled.cbh_km.copy()
    shuffled.cbh_km[has] = np.random.default_rng(0).permutation(shuffled.cbh_km[has])
    again = baselines.fit_predict(train, [sets(physics_flights[0], shuffled)[1]], seed=0)
    for k in first:
        np.testing.assert_array_equal(first[k][0], again[k][0])
    moved = [c.part(np.arange(len(c))) for c in physics_flights[0]]
    moved[0].frame_stats = moved[0].frame_stats + 300.0  # a training flight's temperatures do count
    other = baselines.fit_predict(sets(moved, physics_flights[1])[0], [test], seed=0)
    assert not np.array_equal(other["linear"][0], first["linear"][0])


def test_flights_in_other_units_leave_the_brightness_baselines_out(
    physics_flights, caplog, logs_reach_caplog
):
    train, test = sets(*physics_flights)
    kelvin = test.caches[0].part(np.arange(len(test)))
    kelvin.meta = {**kelvin.meta, "radiometry": {**kelvin.meta["radiometry"], "units": "K"}}
    predicted = baselines.fit_predict(train, [CloudDataset([kelvin], train.scalers, cloud=False)])
    assert set(predicted) == {"mean"}
    assert "state different units" in caplog.text and "counts" in caplog.text and " K" in caplog.text


def report_with(model_mae: float, linear_mae: float) -> dict:
    """An evaluation of one test flight where the network and the linear baseline have these MAEs."""
    true = np.linspace(0.2, 1.8, 50)
    flights = np.array(["12Feb25"] * 50)
    model = true + model_mae * np.where(np.arange(50) % 2, 1, -1)
    predicted = {
        "mean": np.full(50, true.mean()),
        "linear": true + linear_mae * np.where(np.arange(50) % 3, 1, -1),
        "trees": true + 0.2,
    }
    compared = baselines.compare_baselines(true, model, flights, predicted)
    metrics = {k: v["per_flight"]["12Feb25"] for k, v in compared["methods"].items()}
    model_metrics = regression_metrics(true, model)
    return {
        "overall": model_metrics,
        "baseline": metrics["mean"],
        "per_flight": {"12Feb25": model_metrics},
        "baseline_per_flight": {"12Feb25": metrics["mean"]},
        "baselines": compared,
        "protocol": {"name": "untouched_test"},
    }


def test_the_verdict_names_the_best_baseline_when_it_wins_with_both_numbers():
    report = report_with(model_mae=0.066, linear_mae=0.029)
    best = report["baselines"]["best"]["pooled"]
    assert best["name"] == "linear" and best["skill"] == pytest.approx(1 - 0.066 / 0.029)
    said = verdict(report)
    assert said.startswith("Verdict: this model is not useful yet on 12Feb25")
    assert (
        "a linear model on the frame's brightness statistics and the sun's angles does at least as well as "
        "the network (MAE 0.029 km for the baseline, 0.066 km for the network; skill -1.28): the network "
        "adds nothing yet" in said
    )
    assert "publish the baseline beside them" in said
    assert "not useful yet" in flight_verdicts(report)["12Feb25"]


def test_a_network_that_beats_every_baseline_is_said_so_with_its_skill():
    report = report_with(model_mae=0.02, linear_mae=0.05)
    said = verdict(report)
    assert said.startswith("Verdict: the model beats every baseline on 12Feb25")
    assert "the network's MAE skill against it is +0.60" in said
    against = report["baselines"]["best"]["per_flight"]["12Feb25"]["skill_against"]
    assert against["linear"] == pytest.approx(0.6) and against["trees"] == pytest.approx(0.9)
