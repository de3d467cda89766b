"""Heights that can be a cloud base, and verdicts on a useless model.

A cloud base lies between the surface and the aircraft (config.height_bounds_km: 0 km to data.cbh_max_km
where the nav file gives no altitude). A new run's height head cannot leave those bounds (model.height_head
bounded); a run made before that setting keeps its unbounded head (it loads, predicts and resumes as
trained) and its heights outside the bounds are masked at output: missing, flagged in cloud_base_height_qc,
counted, and said in the NetCDF attributes, the CSV and report.md. A model whose predictions are constant,
or that does not beat the training mean, is told so in a sentence (evaluate, report.md, the notebook), by the
rule cross-validation warns with.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import h5py
import netCDF4
import numpy as np
import pytest
import torch

from cloudml_lib.base.config import absent_settings, build_config, config_from_dict, derive, height_bounds_km
from cloudml_lib.core.network.model import build_model
from cloudml_lib.core.run.checkpoint import Key, load_checkpoint, save_atomic
from cloudml_lib.data.dataset import Scalers, n_scalar_inputs
from cloudml_lib.science import flagging, flightfile
from cloudml_lib.science import predict as pr
from cloudml_lib.science.report import shortcomings, verdict

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run_d1cecbe"


def as_old_run_predicting_below_the_surface(run_dir: Path, shift: float = -50.0) -> None:
    """best.pt as a run made before model.height_head (no such key in its config: unbounded), its heights
    moved `shift` standard deviations: far below the surface (the smoke run had 81 frames down to -1.51
    km)."""
    best = run_dir / "best.pt"
    ckpt = load_checkpoint(best)
    del ckpt[Key.CONFIG]["model"]["height_head"]
    ckpt[Key.MODEL]["head.4.bias"] = ckpt[Key.MODEL]["head.4.bias"] + shift
    save_atomic(ckpt, best)


def test_new_runs_get_the_bounded_head_and_older_runs_keep_theirs():
    from cloudml_lib.core.run.resume import compare_configs, resumed_config

    new = build_config({"data": {"demo": True}})
    assert new.model.height_head == "bounded"
    stored = new.to_dict()
    del stored["model"]["height_head"]  # a run saved before the setting existed
    assert absent_settings(stored) == {"model.height_head": "unbounded"}
    assert config_from_dict(stored).model.height_head == "unbounded"
    assert absent_settings(new.to_dict()) == {}
    # resuming: the old run goes on with the head it was trained with, whatever the new config says
    assert resumed_config(new, stored).model.height_head == "unbounded"
    assert compare_configs(stored, resumed_config(new, stored).to_dict()) == ([], [])
    math, _ = compare_configs(stored, new.to_dict())
    assert [m.split(" ")[0] for m in math] == ["model.height_head"]  # never silently switched


def test_the_bounded_head_cannot_leave_the_bounds_whatever_its_weights():
    cfg = build_config({"data": {"demo": True, "cbh_max_km": 1.5}, "model": {"channels": [4, 8, 8]}})
    scalers = Scalers(sza_mean=45.0, sza_std=5.0, cbh_mean=0.8, cbh_std=0.4)
    low, high = height_bounds_km(cfg.data)
    assert (low, high) == (0.0, 1.5)
    frames, angles = torch.randn(6, 3, 16, 16), torch.randn(6, n_scalar_inputs(cfg.data.radiometry))

    def heights_km(model, bias):
        model.eval()
        with torch.no_grad():
            model.head[4].bias.fill_(bias)
            with torch.autocast("cpu", dtype=torch.bfloat16):  # half precision cannot round past a bound
                out = model(frames, angles).float()
        return out.height.double().numpy() * scalers.cbh_std + scalers.cbh_mean

    bounded = build_model(cfg, scalers)
    for bias in (-1e4, -3.0, 0.0, 3.0, 1e4):
        h = heights_km(bounded, bias)
        assert (h >= low - 1e-6).all() and (h <= high + 1e-6).all(), (bias, h)
    assert heights_km(bounded, -1e4) == pytest.approx(low, abs=1e-6)
    unbounded = build_model(derive(cfg, {"model.height_head": "unbounded"}), scalers)
    assert (heights_km(unbounded, -10.0) < 0).all()  # the old head can answer below the surface


def test_the_run_of_the_previous_release_loads_with_its_unbounded_head(tmp_path):
    from cloudml_lib.science.evaluate import load_run_model

    shutil.copytree(FIXTURE / "finished", tmp_path / "finished")
    rm = load_run_model(tmp_path / "finished")
    assert rm.cfg.model.height_head == "unbounded" and rm.model.height_head == "unbounded"


def test_a_new_run_answers_inside_the_bounds_and_says_so(tiny_run_copy, tmp_path):
    run_dir, _, entries = tiny_run_copy
    best = load_checkpoint(run_dir / "best.pt")
    assert best[Key.CONFIG]["model"]["height_head"] == "bounded"
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    bounds = evaluation["out_of_bounds"]
    assert (bounds["low_km"], bounds["high_km"], bounds["below"], bounds["above"]) == (0.0, 2.0, 0, 0)
    assert bounds["n"] == evaluation["overall"]["n"] > 0
    assert evaluation["verdict"].startswith("Verdict: ")
    (path,) = pr.predict_flights(run_dir, out_dir=tmp_path / "out")
    with netCDF4.Dataset(path) as nc:
        assert nc.height_head.startswith("bounded") and nc.cloud_base_height_max_km == 2.0
        assert "0 heights below the surface and 0 above" in nc.cloud_base_height_masked
        qc = np.ma.filled(nc["cloud_base_height_qc"][:], -1)
        cbh = np.ma.filled(nc["cloud_base_height"][:].astype(float), np.nan)
        kept = (qc == 0) | (qc == 3) | (qc == 4)  # 4: inside the span, the inputs outside training's
        assert (kept == np.isfinite(cbh)).all() and (qc != 1).all() and (qc != 2).all()
        low, high = best[Key.LABEL_RANGE]  # the span of the heights the model was fitted on
        assert 0.1 <= low < high <= 2.0
        outside = (cbh < low) | (cbh > high)  # above every training label too: an extrapolation
        assert ((qc == 3) == (outside & np.isfinite(cbh))).all()
        assert (
            f"{int((qc == 3).sum())} heights outside {low:g}-{high:g} km (the span of the labels the model "
            "was" in (nc.cloud_base_height_outside_labels)
        )
        assert list(nc["cloud_base_height_qc"].flag_values) == [0, 1, 2, 3, 4]
        assert nc["cloud_base_height_qc"].flag_meanings.split()[:3] == [  # what files written before meant
            "inside_bounds",
            "below_surface_masked",
            "above_upper_bound_masked",
        ]
        assert np.isfinite(cbh).sum() > 10 and np.nanmin(cbh) >= 0.0 and np.nanmax(cbh) <= 2.0


def test_an_old_runs_heights_below_the_surface_are_masked_counted_and_said(tiny_run_copy, tmp_path):
    from cloudml_lib.science.evaluate import evaluate_run
    from cloudml_lib.science.report import format_report

    run_dir = tmp_path / "old"
    shutil.copytree(tiny_run_copy[0], run_dir)
    as_old_run_predicting_below_the_surface(run_dir)
    (path,) = pr.predict_flights(run_dir)  # into the run: report.md is rewritten
    with netCDF4.Dataset(path) as nc:
        flag = np.ma.filled(nc["cloud_flag"][:], -1)
        qc = np.ma.filled(nc["cloud_base_height_qc"][:], -1)
        cloudy = int((flag == 1).sum())
        assert cloudy > 10
        assert np.ma.getmaskarray(nc["cloud_base_height"][:]).all()  # no height reported at all
        np.testing.assert_array_equal(qc, np.where(flag == 1, 1, -1))  # below the surface, where cloudy
        assert np.ma.getmaskarray(nc["cloud_base_height_lower"][:]).all()
        assert f"{cloudy} heights below the surface and 0 above the upper bound masked" in (
            nc.cloud_base_height_masked
        )
        assert (
            nc.height_head.startswith("unbounded") and "cloud_base_height_qc" in nc.cloud_base_height_bounds
        )
    held = path.name[: -len("_cbh.nc")]
    rows = (path.parent / f"{held}_cbh.csv").read_text().splitlines()
    header = rows[0].split(",")
    cells = [dict(zip(header, r.split(","))) for r in rows[1:]]
    assert all(c["cbh_km"] == "" for c in cells)
    assert sum(c["cbh_qc"] == "1" for c in cells) == cloudy
    summary = json.loads((path.parent / "summary.json").read_text())[held]
    assert summary["height_below_surface"] == cloudy and summary["height_above_ceiling"] == 0
    report_md = (run_dir / "report.md").read_text()
    assert f"{cloudy} predicted heights could not be a cloud base and are left out" in report_md
    # evaluation on the labelled frames: counted, kept in the metrics, and a verdict in words
    report = evaluate_run(run_dir)
    assert report["out_of_bounds"]["below"] == report["overall"]["n"] > 0
    assert "not useful yet" in report["verdict"] and "Try more epochs" in report["verdict"]
    text = format_report(report)
    assert report["verdict"] in text and f"{report['overall']['n']} of {report['overall']['n']}" in text
    assert report["verdict"] in (run_dir / "report.md").read_text()


def test_heights_above_the_aircraft_or_the_label_range_are_masked():
    from cloudml_lib.science import intervals

    result = {
        "cbh_km": np.array([-0.5, 0.5, 1.5, 2.5, np.nan, 2.0000004, 0.05]),
        "altitude_km": np.array([np.nan, np.nan, 1.0, np.nan, np.nan, np.nan, 18.0]),
        "t": np.arange(7.0),
        "label": np.full(7, np.nan),
        "cpl_cloud": np.full(7, np.nan),
        "cloud_probability": None,
        "counts": {},
    }
    calibration = intervals.calibrate(
        np.linspace(0.2, 1.8, 40), np.linspace(0.2, 1.8, 40) + 0.3, "conformal_absolute", 0.9, "a test"
    )
    flagging.cloud_and_intervals(result, flagging.Flagging(0.5), calibration, (0.0, 2.0))
    np.testing.assert_array_equal(result["cbh_qc"], [1, 0, 2, 2, -1, 0, 0])  # 1.5 km: above the aircraft
    np.testing.assert_allclose(result["cbh_km"], [np.nan, 0.5, np.nan, np.nan, np.nan, 2.0, 0.05])
    keys = ("height_below_surface", "height_above_ceiling", "altitude_known")
    assert [result["counts"][k] for k in keys] == [1, 2, 2]
    ok = np.isfinite(result["cbh_km"])
    assert (result["lower"][ok] >= 0.0).all() and (result["upper"][ok] <= 2.0).all()
    assert result["lower"][6] == 0.0 and result["upper"][5] == 2.0  # the intervals cut to the bounds
    assert np.isnan(result["lower"][~ok]).all()  # no interval for a masked height


def test_the_aircraft_altitude_is_read_from_the_nav_file_where_it_has_one(tiny_flights, tmp_path):
    from cloudml_lib.base.config import FlightConfig

    root, entries = tiny_flights
    data = tmp_path / "flights"
    shutil.copytree(root, data)
    flight = FlightConfig(**{k: v for k, v in entries[0].items() if k in FlightConfig.__dataclass_fields__})
    raw = {"dir": str(data), "flights": [entries[0]], "test_flights": [], "swath_slice": [4, 36]}
    cfg = build_config({"data": raw})
    before = pr._flight_inputs(flight, cfg.data)
    assert np.isnan(before["altitude_km"]).all()  # the demo's nav file has none: bounded by cbh_max_km
    n_nav = h5py.File(data / flight.nav_file, "r")["nav/solarZenith"].shape[0]
    with h5py.File(data / flight.nav_file, "a") as f:
        f["nav/IWG_alt"] = np.full(n_nav, 19_500.0)  # metres
    inputs = pr._flight_inputs(flight, cfg.data)
    covered = np.isfinite(inputs["sza"])
    assert covered.any() and np.allclose(inputs["altitude_km"][covered], 19.5)
    with h5py.File(data / flight.nav_file, "a") as f:
        f["nav/IWG_alt"][...] = 19.5  # km, not metres: not trusted
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(pr.__name__).addHandler(handler)  # the package's logger may not propagate to caplog
    try:
        assert np.isnan(pr._flight_inputs(flight, cfg.data)["altitude_km"]).all()
    finally:
        logging.getLogger(pr.__name__).removeHandler(handler)
    assert any("not an altitude in metres" in s for s in said)


def test_a_useless_model_gets_a_verdict_in_one_sentence():
    from cloudml_lib.commands.crossval import fold_warnings

    base = {"r2": -0.02, "mae_km": 0.29, "rmse_km": 0.35, "bias_km": 0.0, "std_ratio": 0.0, "n": 40}
    constant = {**base, "r2": -0.01, "mae_km": 0.28, "std_ratio": 0.012}
    worse = {**base, "r2": -0.35, "mae_km": 0.31, "std_ratio": 0.8}
    good = {**base, "r2": 0.41, "mae_km": 0.2, "std_ratio": 0.9}
    said = lambda m: verdict({"overall": m, "baseline": base, "per_flight": {"12Feb25": m}})  # noqa: E731
    assert "collapse towards a constant (std(pred)/std(true) 0.01" in said(constant)
    assert "not useful yet on 12Feb25" in said(constant) and "Try more epochs, more flights" in said(constant)
    assert "no better than predicting the training mean (MAE 0.310 vs 0.290 km, R2 -0.35 vs -0.02)" in said(
        worse
    )
    assert said(good).startswith("Verdict: the model beats predicting the training mean on 12Feb25")
    assert said({**base, "n": 0}) is None  # nothing held out to judge by
    control = verdict(
        {"overall": constant, "baseline": base, "per_flight": {"12Feb25": constant}, "control": "scalars"}
    )  # a control run (crossval's scalars_only) loses by design: judged in the same words, without advice
    assert control.startswith("Control run (scalars), to compare with the model, not to use: Verdict: this")
    assert "not useful yet on 12Feb25" in control and "Try more epochs" not in control
    assert shortcomings(good, base) == [] and len(shortcomings({**constant, "mae_km": 0.3}, base)) == 2
    # cross-validation warns by the same rule, per flight
    warned = fold_warnings("12Feb25", {"model": worse, "mean": base}, np.array([0.3, 0.9]), np.array([0.5]))
    assert warned == [f"12Feb25: {w}" for w in shortcomings(worse, base)]


def test_the_notebook_shows_the_verdict_of_an_evaluation_written_before_verdicts(tmp_path, capsys):
    from cloudml_lib.colab.show import show_evaluation

    m = {"r2": -0.4, "mae_km": 0.31, "rmse_km": 0.4, "bias_km": 0.1, "std_ratio": 0.012, "n": 30}
    b = {**m, "r2": -0.02, "mae_km": 0.29, "std_ratio": 0.0}
    old = {"overall": m, "baseline": b, "per_flight": {"12Feb25": m}, "baseline_per_flight": {"12Feb25": b}}
    (tmp_path / "evaluation.json").write_text(json.dumps(old))
    show_evaluation(tmp_path)
    out = capsys.readouterr().out
    assert "Verdict: this model is not useful yet on 12Feb25" in out and "collapse towards a constant" in out
    assert "| model: flight 12Feb25 |" in out  # a Markdown table, not a monospace block
    assert "Test flights scored as CloudML 0.2 did" in out  # written before the protocol was recorded
    assert "*training mean* predicts the training labels' mean height" in out  # the baselines explained


def test_a_cloud_baseline_that_beats_the_model_is_said_in_the_verdict(tmp_path, capsys):
    """bt_threshold 0.982 against the model's 0.930 passed without a word."""
    from cloudml_lib.colab.show import show_evaluation
    from cloudml_lib.science.report import cloud_verdict

    m = {"r2": 0.9, "mae_km": 0.05, "rmse_km": 0.07, "bias_km": 0.0, "std_ratio": 0.95, "n": 30}
    b = {**m, "r2": 0.0, "mae_km": 0.29}
    flag = lambda acc, auc: {"accuracy": acc, "f1": acc, "roc_auc": auc, "cloud_share": 0.5, "n": 40}  # noqa: E731
    cloud = {
        "model": {"overall": flag(0.930, 0.95), "per_flight": {"12Feb25": flag(0.930, 0.95)}},
        "majority": {"overall": flag(0.55, 0.5), "per_flight": {"12Feb25": flag(0.55, 0.5)}},
        "bt_threshold": {"overall": flag(0.982, 0.93), "per_flight": {"12Feb25": flag(0.982, 0.93)}},
    }
    report = {"overall": m, "baseline": b, "per_flight": {"12Feb25": m}, "cloud": cloud}
    said = cloud_verdict(report)
    assert said.startswith("Cloud flag: the model's cloud / no-cloud is not useful yet")
    assert (
        "the brightness-temperature threshold beats it (accuracy 0.930 for the model, 0.982 for the "
        "brightness-temperature threshold)" in said
    )
    assert "predict --cloud-flag bt_threshold" in said  # how to write that baseline's flag
    assert "majority" not in said
    control = cloud_verdict({**report, "control": "scalars"})  # a control's flag: the numbers, no advice
    assert control.startswith("Cloud flag of this control run: the brightness-temperature threshold beats")
    assert "predict --cloud-flag" not in control and "train longer" not in control
    cloud["bt_threshold"]["overall"] = flag(0.90, 0.90)
    assert cloud_verdict(report) == "Cloud flag: the model beats both baselines (accuracy 0.930)."
    assert cloud_verdict({"overall": m}) is None  # no cloud output to judge
    cloud["bt_threshold"]["overall"] = flag(0.982, 0.93)
    (tmp_path / "evaluation.json").write_text(json.dumps(report))
    show_evaluation(tmp_path)
    assert "beats it (accuracy 0.930 for the model, 0.982" in capsys.readouterr().out


def test_heights_outside_the_labels_range_are_kept_flagged_counted_and_drawn_apart():
    """Labels below data.cbh_min_km or above data.cbh_max_km never reach training: a height out there is an
    extrapolation, kept (it can be a cloud base) but with its own qc value, 3."""
    result = {
        "cbh_km": np.array([0.05, 0.5, 5.0, 1.0, 0.099, 2.5]),
        "altitude_km": np.array([np.nan, np.nan, 18.0, np.nan, np.nan, np.nan]),
        "t": np.arange(6.0),
        "label": np.full(6, np.nan),
        "cpl_cloud": np.full(6, np.nan),
        "cloud_probability": None,
        "counts": {},
        "lat": np.zeros(6),
        "lon": np.zeros(6),
    }
    flagging.cloud_and_intervals(result, flagging.Flagging(0.5), None, (0.0, 2.0), learned=(0.1, 2.0))
    np.testing.assert_array_equal(result["cbh_qc"], [3, 0, 3, 0, 3, 2])  # 5 km under an aircraft at 18 km
    np.testing.assert_allclose(result["cbh_km"], [0.05, 0.5, 5.0, 1.0, 0.099, np.nan])  # kept, not masked
    assert result["counts"]["height_outside_labels"] == 3 and result["counts"]["height_above_ceiling"] == 1
    attrs = flightfile.bounds_attributes(result)
    assert attrs["cloud_base_height_outside_labels"].startswith("3 heights outside 0.1-2 km")
    from cloudml_lib.science.report import counts_in_words

    assert "3 heights lie outside the labels' range" in counts_in_words(
        {"predicted": 6, "frames": 6, "blank": 0, "no_time": 0, "filled_pixels": 0, **result["counts"]}
    )
    along, _ = flightfile.flight_figures("X", result)
    labels = [line.get_label() for line in along.axes[0].get_lines()]
    assert "outside 0.1-2 km, the labels' range (extrapolated)" in labels
    assert "height masked (below the surface or above the bound)" in labels  # the masked one, apart
