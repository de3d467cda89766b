"""The height's baselines (science/baselines.py): fitted on the training part alone, on the raw brightness
statistics of the labelled frame and on the atmosphere; the physical retrievals against worked examples; the
best of them named, the network's skill against it, the verdict that says so in words when a baseline does as
well, and whether the frames add anything to the atmosphere."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import TINY_SHAPE

from cloudml_lib.base.config import build_config
from cloudml_lib.core.network.metrics import regression_metrics
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.data.cache import load_caches
from cloudml_lib.data.dataset import CloudDataset, fit_scalers
from cloudml_lib.data.preprocess import STAT_NAMES
from cloudml_lib.data.synthetic import make_demo_flights
from cloudml_lib.science import baselines
from cloudml_lib.science.report import flight_verdicts, verdict, write_report


@pytest.fixture(scope="module")
def physics_flights(tmp_path_factory):
    """Four flights of generator version 2, whose cloud pixels sit at the temperature of the base + 0.3 km
    (one sea, one lapse rate): the base is a known function of the frames' coldest temperatures. Their caches
    as (training caches, test cache, the data config; no ERA5 file beside them)."""
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
    return [c for i, c in enumerate(caches) if i != 2], caches[2], cfg.data


def sets(train, test):
    scalers = fit_scalers(train)
    return CloudDataset(train, scalers, cloud=False), CloudDataset([test], scalers, cloud=False)


def test_a_baseline_that_sees_the_temperature_beats_the_mean_where_the_base_follows_it(physics_flights):
    train, test = sets(*physics_flights[:2])
    assert train.caches[0].radiometry.units == "counts"  # what a version-2 file states
    predicted = baselines.fit_predict(train, [test], seed=0).heights
    true = test.targets_km()
    mae = {k: float(np.abs(v[0] - true).mean()) for k, v in predicted.items()}
    assert set(mae) == {"mean", "linear", "trees"} and len(true) > 30
    assert mae["linear"] < 0.5 * mae["mean"], mae  # the temperature gives the base here
    assert mae["trees"] < 0.7 * mae["mean"], mae


def test_the_baselines_are_fitted_on_the_training_part_alone(physics_flights):
    """Whatever the test flight's labels, the baselines' answers on it are the same: nothing of it is
    fitted."""
    train, test = sets(*physics_flights[:2])
    first = baselines.fit_predict(train, [test], seed=0).heights
    shuffled = physics_flights[1].part(np.arange(len(physics_flights[1])))
    has = np.flatnonzero(np.isfinite(shuffled.cbh_km))
    shuffled.cbh_km = shuffled.cbh_km.copy()
    shuffled.cbh_km[has] = np.random.default_rng(0).permutation(shuffled.cbh_km[has])
    again = baselines.fit_predict(train, [sets(physics_flights[0], shuffled)[1]], seed=0).heights
    for k in first:
        np.testing.assert_array_equal(first[k][0], again[k][0])
    moved = [c.part(np.arange(len(c))) for c in physics_flights[0]]
    moved[0].frame_stats = moved[0].frame_stats + 300.0  # a training flight's temperatures do count
    other = baselines.fit_predict(sets(moved, physics_flights[1])[0], [test], seed=0).heights
    assert not np.array_equal(other["linear"][0], first["linear"][0])


def test_flights_in_other_units_leave_the_brightness_baselines_out(
    physics_flights, caplog, logs_reach_caplog
):
    train, test = sets(*physics_flights[:2])
    kelvin = flight(test.caches[0], kelvin=True)
    fitted = baselines.fit_predict(train, [CloudDataset([kelvin], train.scalers, cloud=False)])
    assert set(fitted.heights) == {"mean"} and "state different units" in fitted.left_out["trees"]
    assert "state different units" in caplog.text and "counts" in caplog.text and " K" in caplog.text


def flight(cache, kelvin: bool = False, stats=None, **air):
    """A copy of `cache` with the atmosphere's predictors `air` (name -> one value per sample, or one for
    all), its IR file stating kelvin (`kelvin`), its frames' statistics `stats` (where given)."""
    out = cache.part(np.arange(len(cache)))
    if air:
        n = len(out)
        out.atmosphere = np.stack([np.broadcast_to(np.asarray(v, float), (n,)) for v in air.values()], 1)
        out.atmosphere_names = tuple(air)
    if kelvin:
        out.meta = {**out.meta, "radiometry": {**out.meta["radiometry"], "units": "K"}}
    if stats is not None:
        out.frame_stats = stats
    return out


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


# ------------------------------------------------------------------------------- the atmosphere's baselines

LCL_EXAMPLE = (101325.0, 293.15, 288.15)  # surface pressure (Pa), 2 m temperature and dew point (K)
# By hand: the parcel lifted dry-adiabatically (g / cpm per metre, its pressure along the dry adiabat) until
# its vapour pressure, carried in proportion to the pressure, meets saturation at its temperature (Romps's
# saturation curve), solved by bisection: 636.63 m (Espy's 125 m per K of dew-point depression: 625 m)
LCL_EXAMPLE_M = 636.63


def test_the_physical_baseline_is_the_lcl_of_the_surface_air_with_no_fitted_parameter(physics_flights):
    from cloudml_lib.data import atmosphere

    lcl = float(atmosphere.lcl_height(*LCL_EXAMPLE))
    assert lcl == pytest.approx(LCL_EXAMPLE_M, abs=0.01)
    assert baselines.lcl_base_km(lcl) == pytest.approx(0.63663, abs=1e-5)
    train_c, test_c, _ = physics_flights
    unknown = np.full(len(test_c), lcl)
    unknown[np.flatnonzero(test_c.has_height)[0]] = np.nan  # the first labelled frame has no position
    train, test = sets([flight(c, lcl_height=lcl) for c in train_c], flight(test_c, lcl_height=unknown))
    fitted = baselines.fit_predict(train, [test])
    got = fitted.heights["physical"][0]
    mean = float(np.mean(train.targets_km()))  # where the LCL is unknown: the training mean
    np.testing.assert_allclose(got, np.where(np.isnan(unknown[test_c.has_height]), mean, lcl / 1000.0))
    assert got[0] == pytest.approx(mean)
    higher = [flight(c, lcl_height=lcl) for c in train_c]
    for c in higher:  # other training labels: nothing of the retrieval is fitted on them
        c.cbh_km = c.cbh_km + 1.0
    again = baselines.fit_predict(sets(higher, test.caches[0])[0], [test]).heights["physical"][0]
    np.testing.assert_array_equal(again[1:], got[1:])
    assert "cold_top" in fitted.left_out and "t2m" in fitted.left_out["cold_top"]


def test_the_cold_top_retrieval_against_a_worked_example_and_only_in_kelvin(
    physics_flights, caplog, logs_reach_caplog
):
    # the top (290 - 282.6) K / 7.4 K/km = 1.0 km above the sea, the base 0.3 km below it
    assert baselines.cold_top_base_km(290.0, 282.6) == pytest.approx(0.7)
    assert baselines.cold_top_base_km(290.0, 291.0) == 0.0  # warmer than the air: at the sea, not below
    train_c, test_c, _ = physics_flights
    stats = test_c.frame_stats.copy()
    stats[:, STAT_NAMES.index(baselines.COLD_STATISTIC)] = 282.6
    train = [flight(c, kelvin=True, t2m=290.0) for c in train_c]
    fitted = baselines.fit_predict(*_sets(train, flight(test_c, kelvin=True, stats=stats, t2m=290.0)))
    np.testing.assert_allclose(fitted.heights["cold_top"][0], 0.7, rtol=1e-5)  # statistics: float32
    assert "lcl_height" in fitted.left_out["physical"]  # these files had no dew point
    counts = [flight(c, t2m=290.0) for c in train_c]
    fitted = baselines.fit_predict(*_sets(counts, flight(test_c, t2m=290.0)))
    assert "cold_top" not in fitted.heights
    assert fitted.left_out["cold_top"] == f"the IR files state {test_c.name} counts, not kelvin"
    assert "cold_top is left out: the IR files state" in caplog.text


def _sets(train, test):
    a, b = sets(train, test)
    return a, [b]


def coupled(cache, rng, shift_m: float = 0.0):
    """`cache` with an atmosphere whose LCL follows the cloud base (a coupled layer), ERA5's error added,
    moved up by `shift_m`."""
    base_m = np.where(np.isfinite(cache.cbh_km), cache.cbh_km * 1000.0, 800.0)
    n = len(cache)
    return flight(
        cache,
        lcl_height=base_m + rng.normal(0.0, 40.0, n) + shift_m,
        t2m=288.0 + rng.normal(0.0, 0.5, n),
        boundary_layer_height=base_m + 300.0 + rng.normal(0.0, 150.0, n),
    )


def test_the_atmosphere_trees_are_fitted_on_the_training_part_alone(physics_flights):
    """A test flight's atmosphere, shifted, changes its own answers but not the model: what the trees answer
    for another flight stays the same; a training flight's atmosphere does change them."""
    train_c, test_c, _ = physics_flights
    rng = np.random.default_rng(0)
    train = [coupled(c, rng) for c in train_c]
    probe, test = coupled(test_c, rng), coupled(test_c, rng)
    shifted = flight(test)
    shifted.atmosphere = test.atmosphere + np.array([500.0, 0.0, 0.0])  # the LCL 500 m higher
    train_set, probe_set = sets(train, probe)
    as_is = baselines.fit_predict(train_set, [probe_set, sets(train, test)[1]]).heights
    moved = baselines.fit_predict(train_set, [probe_set, sets(train, shifted)[1]]).heights
    for name in ("atmosphere_trees", "atmosphere_brightness_trees"):
        np.testing.assert_array_equal(as_is[name][0], moved[name][0])  # the probe: the same model
        assert not np.array_equal(as_is[name][1], moved[name][1])  # the shifted flight: its own answers
    true = probe_set.targets_km()
    mae = {k: float(np.abs(v[0] - true).mean()) for k, v in as_is.items()}
    assert mae["atmosphere_trees"] < 0.5 * mae["mean"], mae  # the LCL gives the base here
    assert mae["physical"] < 0.5 * mae["mean"], mae
    other = [coupled(c, np.random.default_rng(1), shift_m=300.0) for c in train_c]
    refitted = baselines.fit_predict(sets(other, probe)[0], [probe_set]).heights
    assert not np.array_equal(refitted["atmosphere_trees"][0], as_is["atmosphere_trees"][0])


def test_without_era5_the_atmosphere_baselines_are_left_out_with_the_reason(
    physics_flights, caplog, logs_reach_caplog
):
    train_c, test_c, data = physics_flights
    train, test = sets(train_c, test_c)
    fitted = baselines.fit_predict(train, [test], data=data)
    assert set(fitted.heights) == {"mean", "linear", "trees"}
    assert set(fitted.left_out) == set(baselines.ATMOSPHERE)
    why = fitted.left_out["atmosphere_trees"]
    assert why.startswith("no ERA5 file lies beside flight(s) ") and "fetch-era5" in why
    assert all(c.name in why for c in [*train_c, test_c])
    assert "The atmosphere baselines are left out: no ERA5 file" in caplog.text
    unread = baselines.fit_predict(train, [test]).left_out  # no data config: nothing to read them from
    assert "not read" in unread["physical"]
    true = test.targets_km()
    report = report_over({test_c.name: (0.05, None)}, left_out=fitted.left_out, true=true, model=true + 0.05)
    said = verdict(report)
    assert f"The atmosphere baselines could not be fitted: {why}." in said
    assert "Beyond" not in said and "add nothing to the atmosphere" not in said


def report_over(maes: dict, left_out=None, brightness_atmosphere=None, true=None, model=None) -> dict:
    """An evaluation of test flights where the network and the trees on the atmosphere have these MAEs
    ({flight: (network, atmosphere trees or None)}), the LCL worse than both, and the trees on atmosphere +
    brightness with the MAEs of `brightness_atmosphere` ({flight: MAE}) where given."""
    rows = []
    for name, (model_mae, air_mae) in maes.items():
        t = np.linspace(0.2, 1.8, 40) if true is None else true
        sign = np.where(np.arange(len(t)) % 2, 1.0, -1.0)
        rows.append(
            {
                "flight": np.array([name] * len(t)),
                "true": t,
                "model": t + model_mae * sign if model is None else model,
                "mean": np.full(len(t), 1.0),
                "atmosphere_trees": None if air_mae is None else t + air_mae * sign[::-1],
                "physical": None if air_mae is None else t + 0.4,
                "atmosphere_brightness_trees": None
                if brightness_atmosphere is None
                else t - brightness_atmosphere[name],
            }
        )
    cat = {k: np.concatenate([r[k] for r in rows]) for k in rows[0] if rows[0][k] is not None}
    predicted = {k: v for k, v in cat.items() if k not in ("flight", "true", "model")}
    compared = baselines.compare_baselines(cat["true"], cat["model"], cat["flight"], predicted, left_out)
    per = {n: regression_metrics(r["true"], r["model"]) for n, r in zip(maes, rows)}
    base = {n: compared["methods"]["mean"]["per_flight"][n] for n in maes}
    return {
        "overall": regression_metrics(cat["true"], cat["model"]),
        "baseline": compared["methods"]["mean"]["overall"],
        "per_flight": per,
        "baseline_per_flight": base,
        "baselines": compared,
        "protocol": {"name": "untouched_test"},
    }


def test_the_verdict_says_on_how_many_flights_the_frames_add_nothing_to_the_atmosphere():
    report = report_over({"01Mar25": (0.06, 0.03), "03Mar25": (0.08, 0.05), "05Mar25": (0.02, 0.05)})
    per = report["baselines"]["beyond_atmosphere"]["per_flight"]
    assert [r["frames_add"] for r in per.values()] == [False, False, True]
    assert per["05Mar25"]["skill"] == pytest.approx(1 - 0.02 / 0.05)
    said = verdict(report)
    assert (
        "On 2 of 3 test flights the frames add nothing to the atmosphere (01Mar25: trees on atmosphere MAE "
        "0.030 km, the best that sees the frames (the network) 0.060 km; 03Mar25: trees on atmosphere MAE "
        "0.050 km, the best that sees the frames (the network) 0.080 km); on 1 of 3 test flights the frames "
        "add something to the atmosphere (05Mar25: the best that sees the frames (the network) 0.020 km "
        "against trees on atmosphere MAE 0.050 km, MAE skill +0.60)." in said
    )
    assert "or data.atmosphere: with_frames (this network never saw the atmosphere)" in said
    assert "not useful yet: a gradient-boosted tree model on the ERA5 atmosphere alone does at least" in said
    # the trees that see the frames and the atmosphere do better than the network: they are the frames' best
    both = report_over({"01Mar25": (0.06, 0.03)}, brightness_atmosphere={"01Mar25": 0.01})
    said = verdict(both)
    assert (
        "On 01Mar25 the frames add something to the atmosphere (the best that sees the frames (trees on "
        "atmosphere + brightness) 0.010 km against trees on atmosphere MAE 0.030 km, MAE skill +0.67)"
    ) in said


def test_crossval_says_the_same_of_its_folds():
    from cloudml_lib.commands.crossval import atmosphere_verdict

    folds = {}
    for name, (model_mae, air_mae) in {"A": (0.06, 0.03), "B": (0.02, 0.05)}.items():
        t = np.linspace(0.2, 1.8, 40)
        folds[name] = {
            "model": regression_metrics(t, t + model_mae),
            "atmosphere_trees": regression_metrics(t, t - air_mae),
            "left_out": {"cold_top": "the IR files state A counts, not kelvin"},
        }
    (said,) = atmosphere_verdict(folds)
    assert said.startswith("On 1 of 2 test flights the frames add nothing to the atmosphere (A: trees on")
    assert "on 1 of 2 test flights the frames add something to the atmosphere (B: " in said
    airless = {n: {"model": f["model"], "left_out": {"physical": "no ERA5 file lies beside flight(s) A"}}
               for n, f in folds.items()}  # fmt: skip
    assert atmosphere_verdict(airless) == [
        "The atmosphere baselines could not be fitted: no ERA5 file lies beside flight(s) A."
    ]
    assert atmosphere_verdict({n: {"model": f["model"]} for n, f in folds.items()}) == []  # before them


def test_evaluations_with_and_without_the_atmosphere_baselines_read_back_and_report(tmp_path):
    """An evaluation.json of today (seven baselines, those left out, the frames against the atmosphere) and
    one of the release before (three) both read back whole (runfiles.py) and make a report."""
    from cloudml_lib.base.outputs import json_safe
    from cloudml_lib.base.runfiles import RunFiles

    today = report_over(
        {"01Mar25": (0.06, 0.03), "03Mar25": (0.02, 0.05)},
        left_out={"cold_top": "the IR files state 01Mar25 counts, not kelvin"},
    )
    before = report_with(model_mae=0.066, linear_mae=0.029)
    for kept in ("left_out", "beyond_atmosphere"):  # what the release before did not write
        before["baselines"].pop(kept, None)
    for name, report in (("today", today), ("before", before)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "evaluation.json").write_text(json.dumps(json_safe({**report, "verdict": verdict(report)})))
        files = RunFiles(folder)
        assert files.evaluation()["baselines"] == json.loads(json.dumps(json_safe(report["baselines"])))
        assert files.damaged == []
        md = (write_report(RunFolder(folder))).read_text()
        assert "| test | best baseline |" in md
        assert ("skill vs trees on atmosphere" in md) == (name == "today")
        assert ("add nothing to the atmosphere" in md) == (name == "today")
        assert "could not be fitted" not in md


@pytest.mark.slow
def test_with_era5_beside_the_flights_the_baselines_read_it_though_the_network_does_not(copied_flights):
    """data.atmosphere none: the network sees no reanalysis, the baselines read it from the files fetch-era5
    wrote (the stand-in CDS's uniform air: 289 K over a 286 K dew point at 1015 hPa)."""
    from test_era5 import StandInCDS

    from cloudml_lib.commands import era5 as command
    from cloudml_lib.data import atmosphere
    from cloudml_lib.data.dataset import prepare_data

    root, entries, config = copied_flights
    for path in root.rglob("ERA5_*"):  # the demo's own: the stand-in's instead
        path.unlink()
    cfg = config()
    command.fetch(cfg, client=StandInCDS())
    data = prepare_data(cfg)
    assert data.train_set.atmosphere()[1] == () and data.train_set.scalers.atmosphere is None
    fitted = baselines.fit_predict(data.train_set, [data.test_set], data=cfg.data)
    assert set(fitted.heights) == set(baselines.BASELINES) and fitted.left_out == {}
    lcl_km = float(atmosphere.lcl_height(101500.0, 289.0, 286.0)) / 1000.0
    np.testing.assert_allclose(fitted.heights["physical"][0], lcl_km, rtol=1e-6)
    cold = data.test_set.frame_stats()[:, STAT_NAMES.index(baselines.COLD_STATISTIC)]
    np.testing.assert_allclose(fitted.heights["cold_top"][0], baselines.cold_top_base_km(289.0, cold))


def test_the_frames_add_something_when_any_model_that_reads_them_beats_the_atmosphere_alone():
    """beyond_atmosphere: the best model that reads the frames (the network, or a baseline on their
    brightness, the cold-top retrieval, trees on both) against the best on the atmosphere alone; equal is
    "nothing"."""
    from cloudml_lib.science.baselines import beyond_atmosphere

    maes = {"physical": 0.30, "atmosphere_trees": 0.25, "linear": 0.40, "trees": 0.20, "mean": 0.10}
    v = beyond_atmosphere(0.35, maes)  # the training mean reads nothing: never in the comparison
    assert (v["frames_model"], v["atmosphere_model"], v["frames_add"]) == ("trees", "atmosphere_trees", True)
    assert v["skill"] == pytest.approx(1 - 0.20 / 0.25)
    v = beyond_atmosphere(0.25, {**maes, "trees": 0.26})
    assert (v["frames_model"], v["frames_add"]) == ("network", False)  # as good is not better
    assert beyond_atmosphere(0.2, {"linear": 0.3}) is None  # no atmosphere: no verdict on it
